#!/usr/bin/env bash
# Expert parallelism's traffic against theory and each rank's device peak against its plan:
# `strata train` under `mpirun -np RANKS` on a randomly initialized Qwen3-MoE shape (hidden 256,
# 4 layers all MoE, 16 experts of 128, top 2, vocabulary 256), bf16, ZeRO-3, sequences of 512, 2
# a micro-batch, one micro-batch a rank and step, at each expert_parallel_size of EXPERTS.
# Prints, from rank 0's metrics, each step's all_to_all_bytes against the balanced-routing
# theory (4 passes x MoE layers x rows x hidden x 2 bytes x (E - 1) / E), its mean over the
# steps, comm_bytes, the loss, and the device peak against the planned one. With PIPELINE=P the
# model is cut into P stages (P x D x E): a stage exchanges its own MoE layers' rows, and rank 0
# (the first stage) sends each micro-batch's activations and routing counts to the next stage
# (sent_bytes, against micro-batches x (rows x hidden x 2 bytes + 8 x (2 x 16 experts + 1))).
#
# Usage: bench/expert_parallel.sh
# Environment: STRATA (default build/strata), WORK (default /tmp/strata-expert-parallel),
# RANKS (default 4), EXPERTS (default "1 2 4"), PIPELINE (default 1), STEPS (default 6), KEEP=1
# keeps WORK.
set -euo pipefail
cd "$(dirname "$0")/.."

STRATA=${STRATA:-build/strata}
WORK=${WORK:-/tmp/strata-expert-parallel}
RANKS=${RANKS:-4}
EXPERTS=${EXPERTS:-1 2 4}
STEPS=${STEPS:-6}
PIPELINE=${PIPELINE:-1}
if [[ ! -x "$STRATA" ]]; then
  echo "expert_parallel: $STRATA not found; build it or set STRATA" >&2
  exit 2
fi
rm -rf "$WORK"
mkdir -p "$WORK"
trap '[[ "${KEEP:-0}" == 1 ]] || rm -rf "$WORK"' EXIT

for e in $EXPERTS; do
  python3 - "$WORK" "$e" "$STEPS" "$PIPELINE" <<'PY'
import json, os, sys
work, e, steps, p = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
data = os.path.join(work, "data.txt")
if not os.path.exists(data):
    with open(data, "w") as f:
        f.write("".join(f"the expert {i % 97} routes token {i % 89} to rank {i % 7}. "
                        for i in range(40000)))
model = {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 256,
         "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "max_position_embeddings": 512, "num_hidden_layers": 4,
         "num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
         "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
         "router_aux_loss_coef": 0.01, "output_router_logits": True}
cfg = {"model": model, "seq_len": 512, "batch_size": 8, "micro_batch_size": 2,
       "max_steps": steps, "precision": "bf16", "optimizer": {"lr": 1e-3}, "threads": 1,
       "zero_stage": 3, "data": {"path": data, "format": "text"}, "save_dir": "",
       "metrics_file": os.path.join(work, f"e{e}.jsonl"), "expert_parallel_size": e,
       "pipeline_parallel_size": p}
json.dump(cfg, open(os.path.join(work, f"e{e}.json"), "w"))
PY
  mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$RANKS" \
    "$STRATA" train "$WORK/e$e.json" >"$WORK/e$e.out" 2>&1 || {
    echo "expert_parallel: E=$e failed; see $WORK/e$e.out (KEEP=1 keeps it)" >&2
    tail -5 "$WORK/e$e.out" >&2
    exit 1
  }
  python3 - "$WORK/e$e.jsonl" "$e" "$RANKS" "$PIPELINE" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
e, ranks, p = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
# A rank's tokens a step (batch 8 x 512 over D = ranks / P), 2 picks each, through its stage's
# 4 / P MoE layers, 4 passes, hidden 256 in bf16.
tokens = 8 * 512 // (ranks // p)
theory = 4 * (4 // p) * tokens * 2 * 256 * 2 * (e - 1) / e
a = [r["all_to_all_bytes"] for r in rows]
mean = sum(a) / len(a)
print(f"E={e}: all_to_all MB {[round(x / 1e6, 2) for x in a]}, mean {mean / 1e6:.2f}, "
      f"theory {theory / 1e6:.2f}" + (f", mean/theory {mean / theory:.3f}" if theory else ""))
print(f"  comm MB {[round(r['comm_bytes'] / 1e6, 1) for r in rows]}")
print(f"  loss {[round(r['loss'], 4) for r in rows]}, aux_loss "
      f"{[round(r['aux_loss'], 4) for r in rows]}")
if p > 1:
    micro_batches = tokens // (2 * 512)
    sent = micro_batches * (2 * 512 * 256 * 2 + 8 * (2 * 16 + 1))
    print(f"  first stage sent bytes {[r['sent_bytes'] for r in rows]}, arithmetic {sent}")
peak = max(r["peak_device_bytes"] for r in rows)
plan = rows[0]["planned_device_bytes"]
print(f"  device peak {peak / 2**20:.1f} MiB, planned {plan / 2**20:.1f} MiB, "
      f"peak/plan {peak / plan:.2f}")
PY
done
