#!/usr/bin/env bash
# Does a compact optimizer state keep the loss curve? The quick start's model (byte-level, 0.8M
# parameters) trained for QUALITY_STEPS steps (2000, 4.1M tokens) on the first 90% of a 3 MB
# corpus, the repository's own text at HEAD (its Markdown and sources in path order: the same
# bytes on every machine for a commit; the quick start's 35 KB text alone is learnt by heart in
# 200 steps, after which its held-out loss only measures overfitting), evaluated every 100 steps
# on the last 10%, once per setting: fp32 state (12 bytes a parameter), bf16 moments (8), bf16
# moments and bf16 master weights with stochastic rounding (6), int8 moments (6.125), int8 moments
# and bf16 master weights with Kahan compensation (6.125) or stochastic rounding (4.125); prints
# each setting's final training and
# held-out loss against fp32's, and plots the curves together (bench/compact_states_quality.png,
# with python3-matplotlib; the numbers are printed either way).
#
# QUALITY_SEED sets the run's seed (its initial weights and data order; default the quick
# start's); QUALITY_SETTINGS picks settings ("state:master:rounding ...", e.g. "fp32:fp32:-
# int8:bf16:kahan"); QUALITY_PLOT names the plot ("" for none); QUALITY_KEEP names a folder to
# keep each setting's metrics in (.jsonl; the work folder is removed).
#
# Usage: bench/compact_states_quality.sh [build/strata]
set -euo pipefail
cd "$(dirname "$0")/.."
strata=${1:-build/strata}
steps=${QUALITY_STEPS:-2000}
work=$(mktemp -d /tmp/strata-compact-quality.XXXXXX)
trap 'rm -rf "$work"' EXIT
git ls-files '*.md' '*.cpp' '*.h' '*.cu' '*.cuh' | sort | xargs cat >"$work/all.txt"
head -c 3000000 "$work/all.txt" >"$work/corpus.txt"
cut=$(($(wc -c <"$work/corpus.txt") * 9 / 10))
head -c "$cut" "$work/corpus.txt" >"$work/train.txt"
tail -c +$((cut + 1)) "$work/corpus.txt" >"$work/eval.txt"

# state_dtype:master_dtype:master_rounding
read -r -a settings <<<"${QUALITY_SETTINGS:-fp32:fp32:- bf16:fp32:- bf16:bf16:stochastic int8:fp32:- int8:bf16:kahan int8:bf16:stochastic}"
seed=()
[ -n "${QUALITY_SEED:-}" ] && seed=(--set seed="$QUALITY_SEED")
for setting in "${settings[@]}"; do
  IFS=: read -r state master rounding <<<"$setting"
  name=$state-$master-$rounding
  extra=()
  [ "$master" = bf16 ] && extra=(--set optimizer.master_rounding="$rounding")
  "$strata" train examples/quickstart.json --set max_steps="$steps" --set save_dir= \
    --set data.path="$work/train.txt" \
    --set 'eval_data={"path": "'"$work/eval.txt"'", "format": "text"}' --set eval_every=100 \
    --set optimizer.state_dtype="$state" --set optimizer.master_dtype="$master" "${extra[@]}" \
    "${seed[@]}" \
    --set metrics_file="$work/$name.jsonl" >"$work/$name.out" 2>&1 || {
    cat "$work/$name.out" >&2
    exit 1
  }
done
if [ -n "${QUALITY_KEEP:-}" ]; then
  mkdir -p "$QUALITY_KEEP"
  cp "$work"/*.jsonl "$QUALITY_KEEP"/
fi
/usr/bin/python3 - "$work" "$steps" "${QUALITY_PLOT-bench/compact_states_quality.png}" <<'PY'
import json, sys
import os
work, steps, plot = sys.argv[1], int(sys.argv[2]), sys.argv[3]
labels = {"fp32-fp32--": "fp32 state (12 B/param)", "bf16-fp32--": "bf16 moments (8 B/param)",
          "bf16-bf16-stochastic": "bf16 moments + bf16 master, stochastic rounding (6 B/param)",
          "int8-fp32--": "int8 moments (6.125 B/param)",
          "int8-bf16-kahan": "int8 moments + bf16 master, Kahan (6.125 B/param)",
          "int8-bf16-stochastic": "int8 moments + bf16 master, stochastic rounding (4.125 B/param)"}
runs = {}
for state in labels:
    if not os.path.exists(f"{work}/{state}.jsonl"):
        continue  # a setting QUALITY_SETTINGS left out
    rows = [json.loads(l) for l in open(f"{work}/{state}.jsonl")]
    train = [(r["step"], r["loss"]) for r in rows]
    held = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    runs[state] = (train, held)
def tail_mean(curve, n=100):
    return sum(l for _, l in curve[-n:]) / len(curve[-n:])
base_train, base_eval = tail_mean(runs["fp32-fp32--"][0]), runs["fp32-fp32--"][1][-1][1]
for state, (train, held) in runs.items():
    t, e = tail_mean(train), held[-1][1]
    print(f"{labels[state]:60}: training loss (mean of the last 100 steps) {t:.4f} "
          f"({t / base_train - 1:+.2%}), held-out loss at step {held[-1][0]} {e:.4f} "
          f"({e / base_eval - 1:+.2%})")
if not plot:
    sys.exit(0)
try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    print("no matplotlib (apt install python3-matplotlib): no plot")
    sys.exit(0)
fig, ax = plt.subplots(figsize=(8, 5))
for i, (state, (train, held)) in enumerate(runs.items()):
    color = plt.get_cmap("tab10")(i)  # one colour a setting, its two curves alike
    ax.plot([s for s, _ in train], [l for _, l in train], lw=0.6, alpha=0.5, color=color,
            label=f"training, {labels[state]}")
    ax.plot([s for s, _ in held], [l for _, l in held], marker="o", ms=3, color=color,
            label=f"held-out, {labels[state]}")
ax.set_xlabel("step")
ax.set_ylabel("loss (nats per byte)")
ax.set_title(f"Quick start model, {steps} steps on 2.7 MB of text: compact optimizer states")
ax.set_ylim(top=max(l for _, l in runs["fp32-fp32--"][0][50:]) + 0.2)
ax.legend()
fig.tight_layout()
fig.savefig(plot, dpi=110)
print("plot: " + plot)
PY
