#!/usr/bin/env bash
# The training stall of a checkpoint, synchronous against asynchronous (save_async): the
# TinyLlama-1.1B shape (22 layers; ASYNC_LAYERS overrides), bf16 working copies, fp32 master
# weights and moments (12 bytes a parameter) with the optimizer on NVMe and the parameters in host
# memory, seq 16, one sequence a step, ASYNC_STEPS steps (5) saving every 2 and at the end. Runs
# the two settings alternately, ASYNC_ROUNDS rounds (1). Prints, per run, each save's stall
# (save_stall_ms in the metrics of the steps after it: the whole save when synchronous; the
# hold, and the optimizer's wait for the held state two steps later, when asynchronous; the
# final save's is in no step's), the steps' times, and for the asynchronous runs how long each
# save took in the background.
#
# Usage: bench/async_save.sh [build/strata]   (needs python3; writes under /tmp: the swap space
# and the checkpoints, about 60 GB for the 1.1B shape)
set -euo pipefail
cd "$(dirname "$0")/.."
strata=${1:-build/strata}
layers=${ASYNC_LAYERS:-22}
steps=${ASYNC_STEPS:-5}
rounds=${ASYNC_ROUNDS:-1}
work=$(mktemp -d /tmp/strata-async-save.XXXXXX)
trap 'rm -rf "$work"' EXIT
for _ in $(seq 1 300); do echo "the drive keeps the optimizer state while training goes on"; done \
  >"$work/data.txt"

run() {  # save_async round
  local dir=$work/async-$1-$2
  mkdir -p "$dir/swap"
  "$strata" train examples/quickstart.json --set max_steps="$steps" --set save_every=2 \
    --set save_dir="$dir/ckpt" --set keep_last=1 --set save_async="$1" \
    --set data.path="$work/data.txt" --set data.format=text \
    --set model.vocab_size=32000 --set model.hidden_size=2048 --set model.intermediate_size=5632 \
    --set model.num_hidden_layers="$layers" --set model.num_attention_heads=32 \
    --set model.num_key_value_heads=4 --set model.tie_word_embeddings=false \
    --set precision=bf16 --set seq_len=16 --set batch_size=1 --set micro_batch_size=1 \
    --set offload_param=cpu --set offload_optimizer=nvme --set "swap_paths=[\"$dir/swap\"]" \
    --set device_memory_limit=0 --set host_memory_limit=0 --set optimizer_overlap=none \
    --set metrics_file="$dir/metrics.jsonl" >"$dir/out.txt" 2>&1 || {
    cat "$dir/out.txt" >&2
    exit 1
  }
  python3 - "$dir/metrics.jsonl" "$dir/out.txt" "$1" <<'PY'
import json, re, sys
steps = [json.loads(l) for l in open(sys.argv[1])]
out = open(sys.argv[2]).read()
params = int(re.search(r"model: (\d+) parameters", out).group(1))
stalls = [(m["step"], m["save_stall_ms"]) for m in steps if m["save_stall_ms"] > 0]
background = re.findall(r"saved checkpoint \S+ \(([\d.]+) s in the background\)", out)
print(f"save_async {sys.argv[3]:5}: {params} parameters | step ms "
      + ", ".join(f"{m['step_ms']:.0f}" for m in steps)
      + " | save_stall_ms at step " + ", ".join(f"{s}: {ms:.0f}" for s, ms in stalls)
      + (" | in the background s " + ", ".join(background) if background else ""))
PY
  rm -rf "$dir"  # its swap space and checkpoints: the disk holds one run's at a time
}
for round in $(seq 1 "$rounds"); do
  run false "$round"
  run true "$round"
done
