#!/usr/bin/env bash
# The CPU backend's forward + backward against PyTorch's on the same LLaMA model, same threads,
# in one run: Debian's python3-torch (bench/torch_llama_step.py, eager) and `strata train`
# (offload none, the progress line's `compute`: forward + backward), median of the last three of
# four steps, fp32 and bf16. Prints a table with the ratio (strata / torch: below 1 is faster).
#   bench/cpu_vs_torch.sh [THREADS]   (default: every core)
#   DTYPES="fp32 bf16"                  which precisions to run (PyTorch 1.13's bf16 on a CPU
#                                       without bf16 instructions takes minutes a step)
set -euo pipefail
cd "$(dirname "$0")/.."
threads=${1:-$(nproc)}
model='{"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
        "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5}'
batch=4 seq=256
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
/usr/bin/python3 -c 'import numpy, sys
numpy.random.default_rng(0).integers(0, 32000, 200000, dtype=numpy.uint16).tofile(sys.argv[1])' \
  "$work/data.bin"
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p') ($(nproc) cores, $threads threads); $(date -u +%Y-%m-%d)"
echo "model: hidden 1024, 8 layers, ffn 2816, 16/4 heads, vocab 32000; batch $batch x seq $seq"
printf '| dtype | PyTorch (s) | strata compute (s) | ratio |\n|---|---|---|---|\n'
for dtype in ${DTYPES:-fp32 bf16}; do
  torch_s=$(/usr/bin/python3 bench/torch_llama_step.py "$model" "$dtype" "$threads" "$batch" "$seq" |
            sed -n 's/.*"seconds": \([0-9.e-]*\).*/\1/p')
  cat >"$work/config.json" <<JSON
{"model": $model, "data": {"path": "$work/data.bin", "format": "u16"},
 "seq_len": $seq, "batch_size": $batch, "micro_batch_size": $batch, "max_steps": 4,
 "precision": "$dtype", "threads": $threads, "save_dir": "", "log_every": 100,
 "metrics_file": "$work/metrics.jsonl", "optimizer": {"lr": 1e-4}}
JSON
  build/strata train "$work/config.json" >/dev/null
  strata_s=$(/usr/bin/python3 -c '
import json, statistics, sys
ms = [json.loads(l)["compute_ms"] for l in open(sys.argv[1])][1:]
print(statistics.median(ms) / 1e3)' "$work/metrics.jsonl")
  printf '| %s | %.2f | %.2f | %.2f |\n' "$dtype" "$torch_s" "$strata_s" \
    "$(echo "$strata_s $torch_s" | awk '{print $1/$2}')"
done
