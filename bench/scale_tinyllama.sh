#!/usr/bin/env bash
# Scale check (not in ctest): `strata train` on a randomly initialized model of TinyLlama-1.1B's
# shape (hidden 2048, 22 layers, intermediate 5632, 32 heads, 4 kv heads, vocab 32000) or, with
# SHAPE=llama-3.2-3b, Llama-3.2-3B's (hidden 3072, 28 layers, intermediate 8192, 24 heads, 8 kv
# heads, vocab 128256, tied embeddings): seq 256, bf16, a 2 GiB device budget, parameters and
# optimizer states on NVMe, no checkpoint (save_dir ""). It must complete with the process's
# peak resident memory (VmHWM, from /proc) under RSS_LIMIT_GIB. Prints the memory plan, each
# step split into compute, transfer and optimizer, and the overlap ratio.
#
# Usage: bench/scale_tinyllama.sh [extra strata train args...]
# Environment: STRATA (binary, default build/strata), WORK (scratch directory, default
# /tmp/strata-scale-tinyllama; needs the swap files: about 17 GB for 1.1B, 45 GB for 3B),
# SHAPE (tinyllama-1.1b or llama-3.2-3b), HOST_LIMIT (host_memory_limit, default 2GiB),
# RSS_LIMIT_GIB (default 4.5: host_memory_limit 2 GiB, plus the 2 GiB device budget, which on the
# CPU backend is host memory too, plus half a GiB for the process itself; the store uses its
# host budget as a cache of clean copies), STEPS (default 3), BATCH (sequences per step,
# default 1), KEEP=1 keeps WORK afterwards. Ends with each tier's measured peak against what
# strata estimate predicts for the config (the run's own prediction).
set -euo pipefail
cd "$(dirname "$0")/.."

STRATA=${STRATA:-build/strata}
WORK=${WORK:-/tmp/strata-scale-tinyllama}
STEPS=${STEPS:-3}
BATCH=${BATCH:-1}
SHAPE=${SHAPE:-tinyllama-1.1b}
HOST_LIMIT=${HOST_LIMIT:-2GiB}
RSS_LIMIT_GIB=${RSS_LIMIT_GIB:-4.5}
RSS_LIMIT_BYTES=$(python3 -c "print(int(float('$RSS_LIMIT_GIB') * 2**30))")

if [[ ! -x "$STRATA" ]]; then
  echo "scale_tinyllama: $STRATA not found; build it (cmake --build build --target strata) or set STRATA" >&2
  exit 2
fi
rm -rf "$WORK"
mkdir -p "$WORK/swap"
trap '[[ "${KEEP:-0}" == 1 ]] || rm -rf "$WORK"' EXIT

# Random token ids below the vocabulary, little-endian u16.
python3 - "$WORK/tokens.u16" <<'EOF'
import random, struct, sys
rng = random.Random(1234)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<%dH" % 200000, *(rng.randrange(32000) for _ in range(200000))))
EOF

case "$SHAPE" in
  tinyllama-1.1b)
    MODEL='{"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
            "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": false}' ;;
  llama-3.2-3b)
    MODEL='{"vocab_size": 128256, "hidden_size": 3072, "intermediate_size": 8192,
            "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": true}' ;;
  *) echo "scale_tinyllama: unknown SHAPE '$SHAPE' (tinyllama-1.1b or llama-3.2-3b)" >&2; exit 2 ;;
esac

cat > "$WORK/config.json" <<EOF
{
  "model": $MODEL,
  "data": {"path": "$WORK/tokens.u16", "format": "u16"},
  "seq_len": 256, "batch_size": $BATCH, "micro_batch_size": 1, "max_steps": $STEPS,
  "precision": "bf16",
  "optimizer": {"lr": 1e-4, "weight_decay": 0.01},
  "device_memory_limit": "2GiB", "host_memory_limit": "$HOST_LIMIT",
  "offload_param": "nvme", "offload_optimizer": "nvme",
  "swap_paths": ["$WORK/swap"],
  "save_dir": "", "metrics_file": "$WORK/metrics.jsonl"
}
EOF

echo "scale_tinyllama: $STRATA train $WORK/config.json --trace $WORK/trace.json $*"
start=$(date +%s)
"$STRATA" train "$WORK/config.json" --trace "$WORK/trace.json" "$@"
echo "scale_tinyllama: the run took $(( $(date +%s) - start )) s in all (setup and final checkpoint included)"

python3 - "$WORK/metrics.jsonl" "$RSS_LIMIT_BYTES" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
limit = int(sys.argv[2])
gib = 1024.0 ** 3
print()
print("| step | step s | compute s | stall s | optimizer s | exposed s | transfer s (busiest stream) | h2d / d2h / nvme r / nvme w busy s | overlap ratio | peak device GiB | peak RSS GiB |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
worst = 0
for m in rows:
    exposed = m.get("optimizer_exposed_ms", m["optimizer_ms"]) / 1e3
    optim = m["optimizer_ms"] / 1e3
    compute = (m["compute_ms"] - m["stall_ms"]) / 1e3  # the model's own work
    busy = [m["h2d_busy_ms"], m["d2h_busy_ms"], m["nvme_read_busy_ms"], m["nvme_write_busy_ms"]]
    transfer = max(busy) / 1e3
    ratio = (m["step_ms"] / 1e3) / max(compute + exposed, transfer)
    worst = max(worst, m["peak_rss_bytes"])
    print("| %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %s | %.2f | %.2f | %.2f |" % (
        m["step"], m["step_ms"] / 1e3, compute, m["stall_ms"] / 1e3, optim, exposed, transfer,
        " / ".join("%.1f" % (b / 1e3) for b in busy), ratio, m["peak_device_bytes"] / gib,
        m["peak_rss_bytes"] / gib))
print()
print("optimizer s: updates that ended in the step (overlapped: the previous step's, run during")
print("this forward, and this step's beside backward); exposed s: how long compute waited for them")
print("overlap ratio = step / max(compute + exposed, busiest transfer stream); compute excludes waits")
if len(rows) > 1:
    later = rows[1:]
    print("mean step of steps 2-%d: %.1f s" % (rows[-1]["step"],
          sum(m["step_ms"] for m in later) / len(later) / 1e3))
last = rows[-1]
for tier, measured, planned in (("device", "peak_device_bytes", "planned_device_bytes"),
                                ("host", "peak_host_bytes", "planned_host_bytes"),
                                ("nvme", "peak_nvme_bytes", "planned_nvme_bytes"),
                                ("rss", "peak_rss_bytes", "predicted_rss_bytes")):
    got = max(m[measured] for m in rows)
    want = last.get(planned, 0)
    print("%s: measured %.3f GiB, predicted %.3f GiB (%+.1f%%)" % (
        tier, got / gib, want / gib, 100.0 * (got - want) / want if want else 0.0))
if worst >= limit:
    print("FAIL: peak RSS %.2f GiB is not under %.2f GiB" % (worst / gib, limit / gib))
    sys.exit(1)
print("OK: peak RSS %.2f GiB < %.2f GiB" % (worst / gib, limit / gib))
EOF
