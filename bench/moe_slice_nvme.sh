#!/usr/bin/env bash
# A 4-layer slice of Qwen3-30B-A3B (hidden 2048, 128 experts of 768, top 8, 32/4 heads of 128,
# vocabulary 151,936) trained on the CPU backend with parameters and optimizer state on NVMe
# (not in ctest: about 3.1 B parameters, 40 GB of swap). Prints what `strata estimate` plans for
# each tier against the peaks the run measured, and, per step, the experts the routing ran and
# skipped, the working-copy bytes of those run against the NVMe bytes read.
#
# Usage: bench/moe_slice_nvme.sh
# Environment: STRATA (binary, default build/strata), WORK (scratch directory on the drive to
# measure, default /tmp/strata-moe-slice), STEPS (default 2), SEQ (tokens a micro-batch, default
# 32: 256 picks over 128 experts, so some are skipped).
set -euo pipefail
cd "$(dirname "$0")/.."

STRATA=${STRATA:-build/strata}
WORK=${WORK:-/tmp/strata-moe-slice}
STEPS=${STEPS:-2}
SEQ=${SEQ:-32}
if [[ ! -x "$STRATA" ]]; then
  echo "moe_slice_nvme: $STRATA not found; build it or set STRATA" >&2
  exit 2
fi
rm -rf "$WORK"
mkdir -p "$WORK/swap"
trap 'rm -rf "$WORK"' EXIT

python3 - "$STRATA" "$WORK" "$STEPS" "$SEQ" <<'EOF'
import json, subprocess, sys

strata, work, steps, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
config = {
    "model": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 4, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 4096,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "output_router_logits": True},
    "data": {"path": "examples/data/gpl-3.0.txt", "format": "text"},
    "seq_len": seq, "batch_size": 4, "micro_batch_size": 1, "max_steps": steps,
    "precision": "bf16",
    "optimizer": {"lr": 1e-5, "weight_decay": 0.0, "state_dtype": "bf16"},
    "optimizer_overlap": "none",
    "offload_param": "nvme", "offload_optimizer": "nvme",
    "swap_paths": [work + "/swap"],
    "device": "cpu", "device_memory_limit": "6GiB", "host_memory_limit": "8GiB",
    "save_dir": "", "metrics_file": work + "/metrics.jsonl", "log_every": 1,
}
path = work + "/config.json"
with open(path, "w") as f:
    json.dump(config, f)
est = json.loads(subprocess.run([strata, "estimate", path, "--json"], check=True,
                                capture_output=True, text=True).stdout)
subprocess.run([strata, "train", path], check=True)
rows = [json.loads(l) for l in open(work + "/metrics.jsonl")]
gib = 1 << 30
print()
print("parameters %d, active %d" % (est["parameters"], est["active_parameters"]))
print()
print("| tier | planned (estimate) | measured peak, worst step | measured / planned |")
print("|---|---|---|---|")
for tier, planned, peak in (("device", "device_peak_bytes", "peak_device_bytes"),
                            ("pinned host", "host_peak_bytes", "peak_host_bytes"),
                            ("nvme", "nvme_bytes", "peak_nvme_bytes")):
    p = est[planned]
    m = max(r[peak] for r in rows)
    print("| %s | %.2f GiB | %.2f GiB | %.3f |" % (tier, p / gib, m / gib, m / p if p else 0))
print("| rss | %.2f GiB | %.2f GiB | %.3f |" % (
    est["rss_bytes"] / gib, max(r["peak_rss_bytes"] for r in rows) / gib,
    max(r["peak_rss_bytes"] for r in rows) / est["rss_bytes"]))
print()
print("| step | experts run | skipped | their bytes (fwd+bwd) | NVMe read | read / run | ms |")
print("|---|---|---|---|---|---|---|")
for r in rows:
    print("| %d | %d | %d | %.2f GiB | %.2f GiB | %.2f | %.0f |" % (
        r["step"], r["experts_run"], r["experts_skipped"], r["expert_bytes"] / gib,
        r["nvme_read_bytes"] / gib, r["nvme_read_bytes"] / max(r["expert_bytes"], 1),
        r["step_ms"]))
EOF
