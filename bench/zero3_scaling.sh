#!/usr/bin/env bash
# ZeRO-3 scaling on one machine: tokens/s and collective bytes per rank per step for world sizes
# 1, 2 and 4, and the measured communication volume against the theoretical ZeRO-3 volume
# (3 x parameter bytes per step: all-gather in forward, all-gather in backward, reduce-scatter of
# gradients). Usage: bench/zero3_scaling.sh [build-dir]   (not part of ctest)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
strata="$build/strata"
work=$(mktemp -d /tmp/strata-zero3-XXXXXX)
trap 'rm -rf "$work"' EXIT

head -c 2000000 /dev/urandom | base64 > "$work/data.txt"
cat > "$work/config.json" <<JSON
{
  "model": {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 688,
            "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
            "max_position_embeddings": 256, "tie_word_embeddings": false},
  "data": {"path": "$work/data.txt", "format": "text"},
  "seq_len": 128, "batch_size": 8, "max_steps": 6, "precision": "fp32",
  "zero_stage": 3, "param_persistence_threshold": 0, "threads": 1,
  "optimizer": {"lr": 1e-3}, "save_dir": "$work/ckpt", "log_every": 100
}
JSON

printf '%-6s %12s %16s %16s %10s\n' ranks tokens/s comm_bytes/step theoretical ratio
for np in 1 2 4; do
  launch=()
  if ((np > 1)); then
    launch=(mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader -np "$np")
  fi
  # Each rank processes batch_size / np sequences in one micro-batch (no accumulation), so one
  # step is exactly one forward and one backward.
  "${launch[@]}" "$strata" train "$work/config.json" --set micro_batch_size=$((8 / np)) \
    --metrics "$work/m$np.jsonl" > "$work/out$np.txt"
  params=$(sed -n 's/^model: \([0-9]*\) parameters.*/\1/p' "$work/out$np.txt")
  /usr/bin/python3 - "$work/m$np.jsonl" "$params" "$np" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])][2:]  # skip warm-up steps
params, np_ = int(sys.argv[2]), int(sys.argv[3])
tps = sum(r["tokens_per_s"] for r in rows) / len(rows)
comm = sum(r["comm_bytes"] for r in rows) / len(rows)
theory = 3 * params * 4 if np_ > 1 else 0
ratio = f"{comm / theory:.3f}" if theory else "-"
print(f"{np_:<6d} {tps:12.0f} {comm:16.0f} {theory:16d} {ratio:>10s}")
PY
done
