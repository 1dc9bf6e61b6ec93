#!/usr/bin/env bash
# Several nodes over real TCP (tools/cluster.sh: network namespaces on a bridge, links shaped by
# tbf), ZeRO-3 with parameters and optimizer state on each node's drive, fp32, `strata train` on a
# randomly initialized model of HIDDEN x LAYERS (vocabulary 4096), a global batch of 8 sequences
# of 64 tokens in micro-batches of 2:
#   1. bytes: what each node sends on its link (the host side's counters) on 2 x 1, 4 x 1 and
#      2 x 2 nodes x ranks, unshaped, beside ZeRO-3's arithmetic: each micro-batch every rank
#      sends (D - L) / D of its 3 passes (gather, gather, reduce-scatter) of the model, less the
#      second gather of the embedding and the LM head, across the node's link for each of its L
#      ranks, and at the end each rank but 0 its shard of the weights for the save.
#   2. step time against link bandwidth: 2 nodes x 1 rank at each of RATES, the median step after
#      the first WARMUP beside strata estimate's prediction for that link
#      (inter_node_bytes_per_s, ranks_per_node 1).
#   3. the grid on slow and fast links: 2 nodes x 2 ranks, tensor_parallel_size 2 inside each
#      node, data-parallel (ZeRO-3) or pipeline across the nodes, each timed at each of RATES,
#      beside what parallelism "auto" chooses given that link (inter_node_bytes_per_s) and how
#      fast its choice runs.
# Usage: bench/cluster.sh    (as root; tools/cluster.sh check says whether this machine can)
# Environment: STRATA (default build/strata), WORK (default /tmp/strata-cluster-bench), HIDDEN
# (default 512), LAYERS (default 4), STEPS (default 6), WARMUP (default 2), RATES (default
# "300mbit 1gbit 10gbit"), PARTS (default "1 2 3"), KEEP=1 keeps WORK.
set -euo pipefail
cd "$(dirname "$0")/.."

STRATA=$(realpath "${STRATA:-build/strata}")
WORK=${WORK:-/tmp/strata-cluster-bench}
HIDDEN=${HIDDEN:-512}
LAYERS=${LAYERS:-4}
STEPS=${STEPS:-6}
WARMUP=${WARMUP:-2}
RATES=${RATES:-300mbit 1gbit 10gbit}
PARTS=${PARTS:-1 2 3}
export STRATA_CLUSTER_NAME=stratab STRATA_CLUSTER_SUBNET=10.215.0 STRATA_CLUSTER_DIR=$WORK/cluster
cluster=tools/cluster.sh
if ! why=$($cluster check); then
  echo "cluster: cannot make a cluster here: $why" >&2
  exit 2
fi
rm -rf "$WORK"
mkdir -p "$WORK"
trap '$cluster down; [[ "${KEEP:-0}" == 1 ]] || rm -rf "$WORK"' EXIT

python3 - "$WORK/tokens.u16" <<'PY'
import random, struct, sys
rng = random.Random(1234)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<%dH" % 100000, *(rng.randrange(4096) for _ in range(100000))))
PY

# config NAME [KEY=JSON ...]: WORK/NAME.json
config() {
  local name=$1
  shift
  python3 - "$WORK/$name.json" "$WORK" "$HIDDEN" "$LAYERS" "$STEPS" "$@" <<'PY'
import json, sys
out, work, hidden, layers, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
name = out.rsplit("/", 1)[1][:-5]
j = {
  "model": {"vocab_size": 4096, "hidden_size": hidden, "intermediate_size": hidden * 8 // 3 // 64 * 64,
            "num_hidden_layers": layers, "num_attention_heads": hidden // 64,
            "num_key_value_heads": hidden // 128, "max_position_embeddings": 64,
            "tie_word_embeddings": False},
  "data": {"path": work + "/tokens.u16", "format": "u16"},
  "seq_len": 64, "batch_size": 8, "micro_batch_size": 2, "max_steps": steps,
  "precision": "fp32", "optimizer": {"lr": 1e-4}, "threads": 1,
  "zero_stage": 3, "offload_param": "nvme", "offload_optimizer": "nvme",
  "param_persistence_threshold": 0, "deterministic_reduction": True,
  "swap_paths": [work + "/cluster/drive/" + name + "-{rank}"],
  "save_dir": work + "/" + name + "-ckpt", "save_every": 0,
  "metrics_file": work + "/" + name + ".jsonl", "dist_timeout_s": 120,
}
for kv in sys.argv[6:]:
    k, v = kv.split("=", 1)
    j[k] = json.loads(v)
json.dump(j, open(out, "w"), indent=1)
PY
}

# train NAME NP [MAP]: runs WORK/NAME.json on the cluster; prints nothing, fails loudly.
train() {
  if ! OMPI_MCA_orte_tmpdir_base=$WORK $cluster run mpirun --hostfile "$WORK/cluster/hostfile" \
    --map-by "${3:-slot}" --bind-to none -np "$2" "$STRATA" train "$WORK/$1.json" \
    >"$WORK/$1.out" 2>&1; then
    cat "$WORK/$1.out" >&2
    exit 1
  fi
}

# Median step time (s) after WARMUP, from a metrics file.
median_step() {
  python3 - "$1" "$WARMUP" <<'PY'
import json, statistics, sys
ms = [json.loads(l)["step_ms"] for l in open(sys.argv[1])][int(sys.argv[2]):]
print("%.3f" % (statistics.median(ms) / 1e3))
PY
}

sent() { $cluster bytes | awk '{print $5}'; }

params() {
  python3 - "$1" <<'PY'
import json, struct, sys
with open(sys.argv[1], "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    h = json.loads(f.read(n))
print(sum((e["data_offsets"][1] - e["data_offsets"][0]) // 4 for k, e in h.items() if k != "__metadata__"))
PY
}

echo "cluster bench: $(date -u +%Y-%m-%d), $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores," \
  "hidden $HIDDEN x $LAYERS layers, $STEPS steps"

if [[ " $PARTS " == *" 1 "* ]]; then
  echo "== 1. bytes each node sends, unshaped links"
  for shape in 2x1 4x1 2x2; do
    nodes=${shape%x*} slots=${shape#*x}
    $cluster up --nodes "$nodes" --slots "$slots" >/dev/null
    config "bytes$shape"
    before=($(sent))
    train "bytes$shape" $((nodes * slots))
    after=($(sent))
    p=$(params "$WORK/bytes$shape-ckpt/step-$(printf %08d "$STEPS")/model/model.safetensors")
    python3 - "$nodes" "$slots" "$p" "$STEPS" "${before[*]}" "${after[*]}" "$HIDDEN" <<'PY'
import sys
nodes, slots, p, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
hidden = int(sys.argv[7])
before = [int(x) for x in sys.argv[5].split()]
after = [int(x) for x in sys.argv[6].split()]
d = nodes * slots
micro = 8 // 2 // d
ends = 2 * 4096 * hidden  # the embedding and the untied LM head: gathered once a micro-batch
for k in range(nodes):
    theory = steps * micro * (3 * p - ends) * 4 * (d - slots) / d * slots
    theory += sum(p / d * 4 for r in range(k * slots, (k + 1) * slots) if r != 0 and k != 0)
    got = after[k] - before[k]
    print("  %d nodes x %d ranks, node %d: sent %.1f MB, ZeRO-3's arithmetic %.1f MB (%d parameters): %.3f"
          % (nodes, slots, k, got / 1e6, theory / 1e6, p, got / theory))
PY
  done
fi

if [[ " $PARTS " == *" 2 "* ]]; then
  echo "== 2. step time against the link's bandwidth, 2 nodes x 1 rank"
  for rate in $RATES; do
    $cluster up --nodes 2 --bandwidth "$rate" >/dev/null
    measured=$($cluster measure 0 1 64 | sed 's/.*: //')
    bits=$(python3 -c "import re,sys; m=re.match(r'(\d+)(g|m)bit','$rate'); print(int(m[1])*(1e9 if m[2]=='g' else 1e6))")
    config "rate$rate" "inter_node_bytes_per_s=$(python3 -c "print($bits / 8)")" "ranks_per_node=1"
    train "rate$rate" 2
    step=$(median_step "$WORK/rate$rate.jsonl")
    predicted=$("$STRATA" estimate "$WORK/rate$rate.json" --ranks 2 2>/dev/null |
      sed -n 's/^predicted step: \([0-9.]*\) s.*communication \([0-9.]*\) s.*/\1 (communication \2)/p')
    echo "  $rate (measured $measured): step ${step} s; strata estimate predicts ${predicted} s"
  done
fi

if [[ " $PARTS " == *" 3 "* ]]; then
  echo "== 3. 2 nodes x 2 ranks, tensor 2 inside each node: data-parallel or pipeline across"
  for rate in $RATES; do
    $cluster up --nodes 2 --slots 2 --bandwidth "$rate" >/dev/null
    bits=$(python3 -c "import re,sys; m=re.match(r'(\d+)(g|m)bit','$rate'); print(int(m[1])*(1e9 if m[2]=='g' else 1e6))")
    link="inter_node_bytes_per_s=$(python3 -c "print($bits / 8)")"
    config "dp$rate" "tensor_parallel_size=2" "$link"
    config "pp$rate" "tensor_parallel_size=2" "pipeline_parallel_size=2" "$link"
    config "auto$rate" 'parallelism="auto"' "$link"
    train "dp$rate" 4
    train "pp$rate" 4
    train "auto$rate" 4
    choice=$(sed -n 's/^.*grid: \(tensor [0-9] x pipeline [0-9] x data [0-9]\).*predicted step \([0-9.]* s\).*/\1 (predicted \2)/p' "$WORK/auto$rate.out")
    echo "  $rate: tensor 2 x data 2 (ZeRO-3 across): $(median_step "$WORK/dp$rate.jsonl") s;" \
      "tensor 2 x pipeline 2 (stages across): $(median_step "$WORK/pp$rate.jsonl") s;" \
      "parallelism auto chose $choice and ran $(median_step "$WORK/auto$rate.jsonl") s"
  done
fi
