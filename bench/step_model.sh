#!/usr/bin/env bash
# strata estimate's predicted step against the measured one on models too large for its layer
# probe (so priced from its GEMM, attention and memory rates): for each case, PAIRS times in turn,
# `strata estimate --json` then `strata train` of the same config (4 steps, the median of steps
# 2-4), each pair's predicted / measured, and the parts of the prediction.
#
# Usage: bench/step_model.sh
# Environment: STRATA (default build/strata), WORK (default /tmp/strata-step-model), PAIRS
# (default 3).
set -euo pipefail
cd "$(dirname "$0")/.."

STRATA=${STRATA:-build/strata}
WORK=${WORK:-/tmp/strata-step-model}
PAIRS=${PAIRS:-3}
if [[ ! -x "$STRATA" ]]; then
  echo "step_model: $STRATA not found; build it or set STRATA" >&2
  exit 2
fi
rm -rf "$WORK"
mkdir -p "$WORK"
trap 'rm -rf "$WORK"' EXIT

python3 - "$STRATA" "$WORK" "$PAIRS" <<'PY'
import json, os, statistics, subprocess, sys

strata, work, pairs = sys.argv[1], sys.argv[2], int(sys.argv[3])
data = os.path.join(work, "data.txt")
with open(data, "w") as f:
    f.write("".join(f"the step model prices product {i % 97} and kernel {i % 89}. "
                    for i in range(40000)))
# name, model, seq, batch, micro-batch, precision, offload (param, optimizer)
cases = [
    ("32k vocabulary, hidden 512, 6 layers, fp32, host",
     {"vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 6,
      "num_attention_heads": 8, "num_key_value_heads": 8, "max_position_embeddings": 256},
     256, 8, 4, "fp32", ("cpu", "cpu")),
    ("hidden 1024, 4 layers, seq 512, bf16, device",
     {"vocab_size": 8000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4,
      "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 512},
     512, 4, 2, "bf16", ("none", "none")),
]
print("| case | pair | predicted ms (compute, transfers, optimizer) | measured ms (compute, of it "
      "stalled on copies) | predicted / measured |")
print("|---|---|---|---|---|")
for n, (name, model, seq, batch, mb, prec, (param, opt)) in enumerate(cases):
    d = os.path.join(work, f"case{n}")
    os.makedirs(d, exist_ok=True)
    config = {"model": model, "seq_len": seq, "batch_size": batch, "micro_batch_size": mb,
              "max_steps": 4, "precision": prec, "save_dir": "", "offload_param": param,
              "offload_optimizer": opt, "optimizer_overlap": "none",
              "data": {"path": data, "format": "text"},
              "metrics_file": os.path.join(d, "metrics.jsonl")}
    path = os.path.join(d, "config.json")
    json.dump(config, open(path, "w"))
    for p in range(pairs):
        est = json.loads(subprocess.run([strata, "estimate", path, "--json"], check=True,
                                        capture_output=True, text=True).stdout)
        if os.path.exists(config["metrics_file"]):
            os.remove(config["metrics_file"])
        subprocess.run([strata, "train", path], check=True, capture_output=True)
        rows = [json.loads(l) for l in open(config["metrics_file"]) if l.strip()]
        step = statistics.median(m["step_ms"] for m in rows[1:])
        st = est.get("step", {})
        parts = ", ".join(f"{st.get(k, 0):.0f}" for k in
                          ("compute_ms", "transfer_ms", "optimizer_ms"))
        compute = statistics.median(m["compute_ms"] for m in rows[1:])
        stall = statistics.median(m.get("stall_ms", 0) for m in rows[1:])
        print(f"| {name} | {p + 1} | {est['step_ms']:.0f} ({parts}) | {step:.0f} ({compute:.0f}, "
              f"{stall:.0f}) | {est['step_ms'] / step:.2f} |", flush=True)
PY
