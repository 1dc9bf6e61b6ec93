#!/usr/bin/env bash
# Gradient accumulation's cost on the host, measured as a user sees it: `strata train` on a
# randomly initialized ~334M-parameter LLaMA (hidden 1024, 21 layers, intermediate 2816, 16 heads,
# vocab 32000), bf16, the optimizer on the host (offload_optimizer cpu), the CPU backend, the same
# two sequences of 256 tokens per step, run two ways in alternation (A B A B ...):
#   A: two micro-batches of one sequence (each micro-batch's gradient summed into fp32 on the host)
#   B: one micro-batch of two sequences (one gradient, kept as computed)
# Prints each run's median step time over the steps after the first WARMUP, the ratio A/B pair by
# pair and its median, and, from A's Chrome trace, the share of the timed steps the compute
# thread spent accumulating gradients (the engine's "accumulate ..." spans).
#
# Usage: bench/accumulation_step.sh
# Environment: STRATA (default build/strata), WORK (default /tmp/strata-accumulation-step),
# ROUNDS (pairs, default 2), STEPS (per run, default 8), WARMUP (steps left out, default 3),
# SET (extra --set k=v arguments for both runs, space separated), KEEP=1 keeps WORK.
set -euo pipefail
cd "$(dirname "$0")/.."

STRATA=${STRATA:-build/strata}
WORK=${WORK:-/tmp/strata-accumulation-step}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-8}
WARMUP=${WARMUP:-3}
if [[ ! -x "$STRATA" ]]; then
  echo "accumulation_step: $STRATA not found; build it or set STRATA" >&2
  exit 2
fi
rm -rf "$WORK"
mkdir -p "$WORK"
trap '[[ "${KEEP:-0}" == 1 ]] || rm -rf "$WORK"' EXIT

python3 - "$WORK/tokens.u16" <<'EOF'
import random, struct, sys
rng = random.Random(1234)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<%dH" % 100000, *(rng.randrange(32000) for _ in range(100000))))
EOF

for variant in A B; do
  micro=1
  [[ $variant == B ]] && micro=2
  cat > "$WORK/$variant.json" <<EOF
{
  "model": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
            "num_hidden_layers": 21, "num_attention_heads": 16, "num_key_value_heads": 16,
            "max_position_embeddings": 512, "tie_word_embeddings": false},
  "data": {"path": "$WORK/tokens.u16", "format": "u16"},
  "seq_len": 256, "batch_size": 2, "micro_batch_size": $micro, "max_steps": $STEPS,
  "precision": "bf16", "optimizer": {"lr": 1e-4, "weight_decay": 0.01}, "grad_clip": 1.0,
  "device": "cpu", "offload_param": "none", "offload_optimizer": "cpu", "save_dir": ""
}
EOF
done

sets=()
for s in ${SET:-}; do sets+=(--set "$s"); done
for ((r = 1; r <= ROUNDS; r++)); do
  for variant in A B; do
    echo "accumulation_step: round $r, $variant"
    "$STRATA" train "$WORK/$variant.json" --metrics "$WORK/$variant.$r.jsonl" \
      --trace "$WORK/$variant.$r.trace.json" "${sets[@]}" >"$WORK/$variant.$r.log" 2>&1 ||
      { cat "$WORK/$variant.$r.log"; exit 1; }
  done
done
grep -m1 "^plan:" "$WORK/A.1.log" || true

python3 - "$WORK" "$ROUNDS" "$WARMUP" <<'EOF'
import json, statistics, sys
work, rounds, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def steps(path):
    return [json.loads(l) for l in open(path) if l.strip()][warmup:]

def accumulate_share(trace_path, rows):
    # The timed steps' window in the trace: the compute lane's spans between the end of step
    # `warmup` and the end of the run; the share of their wall time in "accumulate" spans.
    events = json.load(open(trace_path))
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    spans = [e for e in events if e.get("ph") == "X"]
    if not spans:
        return None
    end = max(e["ts"] + e["dur"] for e in spans)
    window_us = sum(m["step_ms"] for m in rows) * 1e3
    start = end - window_us
    acc = sum(e["dur"] for e in spans
              if e["name"].startswith("accumulate") and e["ts"] >= start)
    return acc / window_us

ratios, shares = [], []
print("| round | A: 2 x 1 sequence, median step s | B: 1 x 2 sequences, median step s | A / B | A's compute thread in accumulation |")
print("|---|---|---|---|---|")
for r in range(1, rounds + 1):
    a = steps(f"{work}/A.{r}.jsonl")
    b = steps(f"{work}/B.{r}.jsonl")
    ma = statistics.median(m["step_ms"] for m in a) / 1e3
    mb = statistics.median(m["step_ms"] for m in b) / 1e3
    share = accumulate_share(f"{work}/A.{r}.trace.json", a)
    ratios.append(ma / mb)
    if share is not None:
        shares.append(share)
    print("| %d | %.2f | %.2f | %.3f | %s |" % (r, ma, mb, ma / mb,
          "%.1f%%" % (100 * share) if share is not None else "?"))
print()
print("median A / B: %.3f over %d pairs (min %.3f, max %.3f)" % (
    statistics.median(ratios), len(ratios), min(ratios), max(ratios)))
if shares:
    print("A's compute thread in accumulation: median %.1f%% of the step" % (100 * statistics.median(shares)))
EOF
