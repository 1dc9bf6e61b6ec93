#!/usr/bin/env bash
# strata estimate against the runs it predicts (not in ctest): for each case of a matrix (offload
# placements, fp32/bf16, activation checkpointing, micro-batch sizes, a 32k vocabulary, ZeRO
# stages 1-3 on 1 and 2 ranks, with and without a device budget), `strata estimate --json` and
# then `strata train` of the same config (6 steps). Prints each tier's measured peak (device,
# pinned host, NVMe, RSS) against the prediction, and the predicted step against the median of
# steps 2-6, as a Markdown table, and the worst of each.
#
# Usage: bench/estimate_matrix.sh
# Environment: STRATA (binary, default build/strata), WORK (scratch directory, default
# /tmp/strata-estimate-matrix), MPIRUN (default mpirun; 2-rank cases are skipped without it).
set -euo pipefail
cd "$(dirname "$0")/.."

STRATA=${STRATA:-build/strata}
WORK=${WORK:-/tmp/strata-estimate-matrix}
MPIRUN=${MPIRUN:-mpirun}
if [[ ! -x "$STRATA" ]]; then
  echo "estimate_matrix: $STRATA not found; build it or set STRATA" >&2
  exit 2
fi
rm -rf "$WORK"
mkdir -p "$WORK"
trap 'rm -rf "$WORK"' EXIT

python3 - "$STRATA" "$WORK" "$MPIRUN" <<'EOF'
import json, os, shutil, statistics, subprocess, sys

strata, work, mpirun = sys.argv[1:4]
have_mpi = shutil.which(mpirun) is not None
# ranks, stage, param, optimizer, precision, checkpointing, micro-batch, vocab, device limit
cases = [
    (1, 3, "none", "none", "fp32", True, 2, 256, ""),
    (1, 3, "none", "none", "bf16", False, 1, 256, ""),
    (1, 3, "none", "cpu", "fp32", False, 4, 256, ""),
    (1, 3, "none", "nvme", "bf16", True, 2, 256, ""),
    (1, 3, "cpu", "cpu", "fp32", True, 2, 256, ""),
    (1, 3, "cpu", "cpu", "bf16", False, 4, 256, ""),
    (1, 3, "cpu", "nvme", "fp32", False, 1, 256, ""),
    (1, 3, "nvme", "nvme", "fp32", True, 4, 256, ""),
    (1, 3, "nvme", "nvme", "bf16", False, 2, 256, ""),
    (1, 3, "none", "none", "fp32", False, 2, 32000, ""),
    (1, 3, "cpu", "cpu", "bf16", True, 2, 32000, ""),
    (1, 3, "nvme", "nvme", "fp32", True, 1, 32000, ""),
    (1, 3, "cpu", "nvme", "bf16", False, 2, 32000, ""),
    (2, 1, "none", "none", "fp32", False, 2, 256, ""),
    (2, 1, "none", "nvme", "bf16", False, 2, 256, "12MiB"),
    (2, 2, "none", "none", "bf16", False, 2, 256, "12MiB"),
    (2, 2, "none", "cpu", "fp32", False, 2, 256, ""),
    (2, 3, "none", "none", "fp32", False, 2, 256, "12MiB"),
    (2, 3, "cpu", "cpu", "bf16", False, 2, 256, ""),
    (2, 3, "cpu", "cpu", "fp32", False, 2, 256, "12MiB"),
    (2, 3, "nvme", "nvme", "fp32", False, 2, 256, ""),
]
data = os.path.join(work, "data.txt")
with open(data, "w") as f:
    f.write("".join("tier %d moves\n" % (i % 97) for i in range(3000)))

def pct(got, want):
    return 100.0 * (got - want) / want if want else 0.0

print("| ranks | stage | placement | precision | ckpt | micro-batch | vocab | device limit "
      "| device % | host % | nvme % | rss % | step predicted / measured ms | step % |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
worst = {"device": 0.0, "host": 0.0, "nvme": 0.0, "rss": 0.0, "step": 0.0}
for n, (ranks, stage, param, opt, prec, ckpt, mb, vocab, limit) in enumerate(cases):
    if ranks > 1 and not have_mpi:
        continue
    d = os.path.join(work, "case%d" % n)
    for r in range(ranks):
        os.makedirs(os.path.join(d, "swap-%d" % r), exist_ok=True)
    config = {
        "model": {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 96,
                  "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "max_position_embeddings": 64},
        "seq_len": 32, "batch_size": 4 * ranks, "micro_batch_size": mb, "max_steps": 6,
        "precision": prec, "threads": 1, "save_dir": "", "zero_stage": stage,
        "activation_checkpointing": ckpt, "offload_param": param, "offload_optimizer": opt,
        "param_persistence_threshold": 0,
        "data": {"path": data, "format": "text"},
        "swap_paths": [os.path.join(d, "swap-{rank}")],
        "metrics_file": os.path.join(d, "metrics.jsonl"),
    }
    if limit:
        config["device_memory_limit"] = limit
    path = os.path.join(d, "config.json")
    with open(path, "w") as f:
        json.dump(config, f)
    est = json.loads(subprocess.run([strata, "estimate", path, "--ranks", str(ranks), "--json"],
                                    check=True, capture_output=True, text=True).stdout)
    cmd = [strata, "train", path]
    if ranks > 1:
        cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
               "--mca", "btl", "self,vader", "-np", str(ranks)] + cmd
    subprocess.run(cmd, check=True, capture_output=True)
    rows = [json.loads(l) for l in open(config["metrics_file"]) if l.strip()]
    last = rows[-1]
    got = {k: max(m["peak_%s_bytes" % k] for m in rows) for k in ("device", "host", "nvme", "rss")}
    want = {"device": last["planned_device_bytes"], "host": last["planned_host_bytes"],
            "nvme": last["planned_nvme_bytes"], "rss": last["predicted_rss_bytes"]}
    step = statistics.median(m["step_ms"] for m in rows[1:])
    res = {k: pct(got[k], want[k]) for k in got}
    res["step"] = pct(step, est["step_ms"])
    for k, v in res.items():
        worst[k] = max(worst[k], abs(v))
    print("| %d | %d | %s/%s | %s | %s | %d | %d | %s | %+.1f | %+.1f | %+.1f | %+.1f | %.1f / %.1f | %+.0f |" % (
        ranks, stage, param, opt, prec, "on" if ckpt else "off", mb, vocab, limit or "none",
        res["device"], res["host"], res["nvme"], res["rss"], est["step_ms"], step, res["step"]))
print()
print("worst: " + ", ".join("%s %.1f%%" % (k, v) for k, v in worst.items()))
EOF
