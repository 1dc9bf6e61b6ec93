#!/usr/bin/env bash
# The training stall of a checkpoint, synchronous against asynchronous (save_async): the
# TinyLlama-1.1B shape (22 layers; ASYNC_LAYERS overrides), bf16 working copies, fp32 master
# weights and moments (12 bytes a parameter) with the optimizer on NVMe and the parameters in host
# memory (ASYNC_OPTIMIZER=cpu: the optimizer in host memory too), seq 16, one sequence a step,
# ASYNC_STEPS steps (12) saving every ASYNC_SAVE_EVERY (8) and at the end. Runs the two settings
# alternately, ASYNC_ROUNDS rounds (1). Prints, per run, the steps' times, save_stall_ms where a
# step has one (the whole save when synchronous; waiting for the save before and holding the
# state when asynchronous; the final save's is in no step), for the asynchronous runs how long
# each save took in the background, and what the save after step ASYNC_SAVE_EVERY cost the
# training: its stall plus what the steps after it took beyond the median step before it (the
# drive is shared with the save's reads and writes).
#
# Usage: bench/async_save.sh [build/strata]   (needs python3; writes under /tmp: the swap space
# and the checkpoints, about 60 GB for the 1.1B shape)
set -euo pipefail
cd "$(dirname "$0")/.."
strata=${1:-build/strata}
layers=${ASYNC_LAYERS:-22}
steps=${ASYNC_STEPS:-12}
save_every=${ASYNC_SAVE_EVERY:-8}
rounds=${ASYNC_ROUNDS:-1}
optimizer=${ASYNC_OPTIMIZER:-nvme}  # or cpu: the state in host memory (needs 24 bytes a parameter)
work=$(mktemp -d /tmp/strata-async-save.XXXXXX)
trap 'rm -rf "$work"' EXIT
for _ in $(seq 1 300); do echo "the drive keeps the optimizer state while training goes on"; done \
  >"$work/data.txt"

run() {  # save_async round
  local dir=$work/async-$1-$2
  mkdir -p "$dir/swap"
  "$strata" train examples/quickstart.json --set max_steps="$steps" --set save_every="$save_every" \
    --set save_dir="$dir/ckpt" --set keep_last=1 --set save_async="$1" \
    --set data.path="$work/data.txt" --set data.format=text \
    --set model.vocab_size=32000 --set model.hidden_size=2048 --set model.intermediate_size=5632 \
    --set model.num_hidden_layers="$layers" --set model.num_attention_heads=32 \
    --set model.num_key_value_heads=4 --set model.tie_word_embeddings=false \
    --set precision=bf16 --set seq_len=16 --set batch_size=1 --set micro_batch_size=1 \
    --set offload_param=cpu --set offload_optimizer="$optimizer" --set "swap_paths=[\"$dir/swap\"]" \
    --set device_memory_limit=0 --set host_memory_limit=0 --set optimizer_overlap=none \
    --set metrics_file="$dir/metrics.jsonl" >"$dir/out.txt" 2>&1 || {
    cat "$dir/out.txt" >&2
    exit 1
  }
  python3 - "$dir/metrics.jsonl" "$dir/out.txt" "$1" "$save_every" <<'PY'
import json, re, sys
steps = [json.loads(l) for l in open(sys.argv[1])]
out = open(sys.argv[2]).read()
params = int(re.search(r"model: (\d+) parameters", out).group(1))
stalls = [(m["step"], m["save_stall_ms"]) for m in steps if m["save_stall_ms"] > 0]
background = re.findall(r"saved checkpoint \S+ \(([\d.]+) s in the background\)", out)
every = int(sys.argv[4])
before = sorted(m["step_ms"] for m in steps[1:every])
median = before[len(before) // 2]
after = [m for m in steps if m["step"] > every]
lost = sum(m["save_stall_ms"] for m in after) + sum(max(0.0, m["step_ms"] - median) for m in after)
print(f"save_async {sys.argv[3]:5}: {params} parameters | step ms "
      + ", ".join(f"{m['step_ms']:.0f}" for m in steps)
      + " | save_stall_ms at step " + ", ".join(f"{s}: {ms:.0f}" for s, ms in stalls)
      + (" | in the background s " + ", ".join(background) if background else "")
      + f" | the save after step {every} cost training {lost / 1e3:.1f} s (median step before it {median / 1e3:.1f} s)")
PY
  rm -rf "$dir"  # its swap space and checkpoints: the disk holds one run's at a time
}
for round in $(seq 1 "$rounds"); do
  run false "$round"
  run true "$round"
done
