#!/usr/bin/env bash
# What deterministic_reduction costs, measured as a user sees it: `strata train` on a randomly
# initialized slice of the TinyLlama-1.1B shape (hidden 2048, intermediate 5632, 32 heads, 4 kv
# heads, vocab 32000; LAYERS of its 22 layers), fp32, ZeRO stage 2 with the optimizer on the host
# (offload_optimizer cpu, gradients summed in host memory), the CPU backend, a global batch of
# MICROS micro-batches of one sequence, on each rank count of RANKS, run two ways in alternation
# (A B A B ...):
#   A: deterministic_reduction true  (the micro-batches summed in the canonical tree)
#   B: deterministic_reduction false (a running sum)
# The ranks' reduction sums in the canonical tree either way (it costs nothing: the same bytes
# and additions in another pairing); what the switch changes is each rank's sum over its own
# micro-batches (partial sums held and merged).
# Prints each run's median step time over the steps after the first WARMUP, the ratio A/B pair by
# pair and its median with its range, for every rank count.
#
# Usage: bench/deterministic_reduction.sh
# Environment: STRATA (default build/strata), WORK (default /tmp/strata-deterministic-reduction),
# LAYERS (default 2), SEQ (tokens a sequence, default 128), MICROS (default 8), RANKS (default "1 4"), ROUNDS (pairs, default 3),
# STEPS (per run, default 6), WARMUP (steps left out, default 2), KEEP=1 keeps WORK.
set -euo pipefail
cd "$(dirname "$0")/.."

STRATA=${STRATA:-build/strata}
WORK=${WORK:-/tmp/strata-deterministic-reduction}
LAYERS=${LAYERS:-2}
MICROS=${MICROS:-8}
RANKS=${RANKS:-1 4}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-6}
SEQ=${SEQ:-128}
WARMUP=${WARMUP:-2}
if [[ ! -x "$STRATA" ]]; then
  echo "deterministic_reduction: $STRATA not found; build it or set STRATA" >&2
  exit 2
fi
rm -rf "$WORK"
mkdir -p "$WORK"
trap '[[ "${KEEP:-0}" == 1 ]] || rm -rf "$WORK"' EXIT

python3 - "$WORK/tokens.u16" <<'PY'
import random, struct, sys
rng = random.Random(1234)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<%dH" % 200000, *(rng.randrange(32000) for _ in range(200000))))
PY

for variant in A B; do
  det=true
  [[ $variant == B ]] && det=false
  cat > "$WORK/$variant.json" <<JSON
{
  "model": {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
            "num_hidden_layers": $LAYERS, "num_attention_heads": 32, "num_key_value_heads": 4,
            "max_position_embeddings": 2048, "tie_word_embeddings": false},
  "data": {"path": "$WORK/tokens.u16", "format": "u16"},
  "seq_len": $SEQ, "batch_size": $MICROS, "micro_batch_size": 1, "max_steps": $STEPS,
  "precision": "fp32", "optimizer": {"lr": 1e-4, "weight_decay": 0.01}, "grad_clip": 1.0,
  "device": "cpu", "zero_stage": 2, "offload_param": "none", "offload_optimizer": "cpu",
  "param_persistence_threshold": 0, "threads": 0, "save_dir": "",
  "deterministic_reduction": $det
}
JSON
done

for ranks in $RANKS; do
  launch=()
  if ((ranks > 1)); then
    launch=(mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$ranks")
  fi
  for ((r = 1; r <= ROUNDS; r++)); do
    for variant in A B; do
      echo "deterministic_reduction: $ranks rank(s), round $r, $variant" >&2
      "${launch[@]}" "$STRATA" train "$WORK/$variant.json" \
        --metrics "$WORK/$variant.$ranks.$r.jsonl" >"$WORK/$variant.$ranks.$r.log" 2>&1 ||
        { cat "$WORK/$variant.$ranks.$r.log"; exit 1; }
    done
  done
done
grep -m1 "^plan:" "$WORK/A.1.1.log" || true

python3 - "$WORK" "$ROUNDS" "$WARMUP" "$RANKS" <<'PY'
import json, statistics, sys
work, rounds, warmup, ranks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()

def median_step_s(path):
    rows = [json.loads(l) for l in open(path) if l.strip()][warmup:]
    return statistics.median(m["step_ms"] for m in rows) / 1e3

print("| ranks | round | A: tree, median step s | B: running sum, median step s | A / B |")
print("|---|---|---|---|---|")
summary = []
for n in ranks:
    ratios = []
    for r in range(1, rounds + 1):
        a = median_step_s(f"{work}/A.{n}.{r}.jsonl")
        b = median_step_s(f"{work}/B.{n}.{r}.jsonl")
        ratios.append(a / b)
        print("| %s | %d | %.2f | %.2f | %.3f |" % (n, r, a, b, a / b))
    summary.append((n, statistics.median(ratios), min(ratios), max(ratios)))
print()
for n, med, lo, hi in summary:
    print("%s rank(s): median A / B %.3f over %d pairs (min %.3f, max %.3f)" % (n, med, rounds, lo, hi))
PY
