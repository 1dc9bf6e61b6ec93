#!/usr/bin/env bash
# Optimizer-state bytes each step moves to and from NVMe, by optimizer state setting: the
# TinyLlama-1.1B shape (22 layers; COMPACT_LAYERS overrides), bf16, the optimizer on NVMe and
# the parameters in host memory, so every NVMe byte of a step is optimizer state. Runs the
# settings alternately, round after round (this machine's disk swings from run to run), for
# COMPACT_STEPS steps each (3) at seq 16, one sequence a step (the compute is small beside the
# drive's traffic): fp32 state (12 bytes a parameter), bf16 moments (8), int8 moments with bf16
# master weights and Kahan compensation (6.125), int8 moments with bf16 master weights rounded
# stochastically (4.125); COMPACT_SETTINGS overrides ("state:master:rounding ..."). Prints, per
# run, the median step's NVMe bytes read and written per parameter and its time.
#
# Usage: bench/compact_states.sh [build/strata]   (needs python3; writes under /tmp)
set -euo pipefail
cd "$(dirname "$0")/.."
strata=${1:-build/strata}
layers=${COMPACT_LAYERS:-22}
steps=${COMPACT_STEPS:-3}
work=$(mktemp -d /tmp/strata-compact-states.XXXXXX)
trap 'rm -rf "$work"' EXIT
for _ in $(seq 1 300); do echo "the drive moves the optimizer state every step"; done >"$work/data.txt"

run() {  # state_dtype master_dtype master_rounding round
  local dir=$work/$1-$2-$3-$4
  local rounding=()
  [ "$2" = bf16 ] && rounding=(--set optimizer.master_rounding="$3")
  mkdir -p "$dir/swap"
  "$strata" train examples/quickstart.json --set max_steps="$steps" --set save_dir= \
    --set data.path="$work/data.txt" --set data.format=text \
    --set model.vocab_size=32000 --set model.hidden_size=2048 --set model.intermediate_size=5632 \
    --set model.num_hidden_layers="$layers" --set model.num_attention_heads=32 \
    --set model.num_key_value_heads=4 --set model.tie_word_embeddings=false \
    --set precision=bf16 --set seq_len=16 --set batch_size=1 --set micro_batch_size=1 \
    --set offload_param=cpu --set offload_optimizer=nvme --set "swap_paths=[\"$dir/swap\"]" \
    --set device_memory_limit=0 --set host_memory_limit=0 \
    --set optimizer.state_dtype="$1" --set optimizer.master_dtype="$2" "${rounding[@]}" \
    --set metrics_file="$dir/metrics.jsonl" \
    --set optimizer_overlap="${COMPACT_OVERLAP:-auto}" \
    >"$dir/out.txt" 2>&1 || {
    cat "$dir/out.txt" >&2
    exit 1
  }
  python3 - "$dir/metrics.jsonl" "$dir/out.txt" "$1/$2${rounding:+ $3}" <<'PY'
import json, re, statistics, sys
steps = [json.loads(l) for l in open(sys.argv[1])]
params = int(re.search(r"model: (\d+) parameters", open(sys.argv[2]).read()).group(1))
rest = steps[1:] or steps  # the first step has no state to read back
mid = sorted(rest, key=lambda m: m["step_ms"])[len(rest) // 2]
print(f"{sys.argv[3]:16}: {params} parameters | per step: nvme read "
      f"{mid['nvme_read_bytes'] / params:.2f} B/param, written {mid['nvme_write_bytes'] / params:.2f} "
      f"B/param | step {mid['step_ms']:.0f} ms (optimizer {mid['optimizer_ms']:.0f}, nvme busy r "
      f"{mid['nvme_read_busy_ms']:.0f} w {mid['nvme_write_busy_ms']:.0f})")
PY
}
read -r -a settings <<<"${COMPACT_SETTINGS:-fp32:fp32:- bf16:fp32:- int8:bf16:kahan int8:bf16:stochastic}"
for round in 1 2; do
  for setting in "${settings[@]}"; do
    IFS=: read -r state master rounding <<<"$setting"
    run "$state" "$master" "$rounding" "$round"
  done
done
