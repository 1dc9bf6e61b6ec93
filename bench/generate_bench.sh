#!/usr/bin/env bash
# Decoding speed of strata generate on the CPU backend: the quick start's model (trained for a
# few steps) and a random-weight model of TinyLlama-1.1B's shape, greedy, 64 tokens after a
# 16-token prompt, fp32, every core.
#   bench/generate_bench.sh [WORKDIR]   (default /tmp/strata-generate-bench; about 7 GB for 1.1B)
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/strata-generate-bench}
mkdir -p "$work"
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; $(date -u +%Y-%m-%d)"
if [[ ! -d "$work/quickstart/step-00000010/model" ]]; then
  build/strata train examples/quickstart.json --set max_steps=10 --set log_every=10 \
    --set save_dir="\"$work/quickstart\"" --set metrics_file="\"\"" >/dev/null
fi
if [[ ! -f "$work/tinyllama/model.safetensors" ]]; then
  /usr/bin/python3 bench/make_random_checkpoint.py "$work/tinyllama" '{"vocab_size": 32000,
    "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
    "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-5}'
fi
prompt=$(seq -s, 1 16)
for model in quickstart/step-00000010/model tinyllama; do
  echo "== $model"
  build/strata generate --model "$work/$model" --prompt-ids "$prompt" --max-new-tokens 64 \
    --temperature 0 2>&1 >/dev/null | tail -2
done
