#!/usr/bin/env bash
# Bytes each rank sends per layer under tensor parallelism, counted by Open MPI's own monitoring
# (the pml "monitoring" component: every message of every collective, per peer) against
# Megatron's theory: per layer, micro-batch and pass (forward, backward) two all-reduces of the
# b * s * h activations, each sending 2 (T - 1) / T of its payload from every rank in a ring.
#
# The per-layer figure is the difference between two runs that differ only in their layer count
# (L and L + 2, one optimizer step each, no activation checkpointing so no forward is run twice),
# halved: what the embedding, the head, the loss and the setup send cancels out. The rest of a
# layer's traffic (its replicated norms' gradient sums, and with T above the kv heads the kv
# heads' gradient sums) is in the measured figure and counted beside the theory. With
# sequence parallelism each all-reduce becomes an all-gather and a reduce-scatter, (T - 1) / T
# of the payload each: the same total (and the norms' weight gradients, summed over the group,
# join the small extras).
#
# Usage: bench/tp_traffic.sh [build/strata] [T...]   (default T: 2 4; needs mpirun)
set -euo pipefail
cd "$(dirname "$0")/.."
strata=${1:-build/strata}
shift || true
sizes=("${@:-2}")
(($# == 0)) && sizes=(2 4)
work=$(mktemp -d /tmp/strata-tp-traffic.XXXXXX)
trap 'rm -rf "$work"' EXIT

seq=128 micro=8 batch=16 hidden=128 layers=2
# Bytes every rank sent over all communicators (collectives' messages), the largest of the ranks.
sent() {  # T layers sequence_parallel -> bytes
  local t=$1 l=$2 sp=$3 dir=$work/t$1-l$2-sp$3
  mkdir -p "$dir"
  mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$t" \
    --mca pml_monitoring_enable 2 --mca pml_monitoring_enable_output 3 \
    --mca pml_monitoring_filename "$dir/prof" ${TP_TRAFFIC_MCA:-} \
    "$strata" train examples/quickstart.json --set max_steps=1 --set save_dir= \
    --set metrics_file= --set tensor_parallel_size="$t" --set sequence_parallel="$sp" \
    --set activation_checkpointing=false \
    --set model.num_hidden_layers="$l" --set seq_len=$seq --set micro_batch_size=$micro \
    --set batch_size=$batch >"$dir/out.txt" 2>&1 || {
    cat "$dir/out.txt" >&2
    exit 1
  }
  awk '$1 == "I" { sent[$2] += $4 } END { m = 0; for (r in sent) if (sent[r] > m) m = sent[r]; print m }' \
    "$dir"/prof.*.prof
}

printf '| T | sequence parallel | bytes per layer per step (measured) | theory (activations) | measured / theory |\n'
printf '|---|---|---|---|---|\n'
for t in "${sizes[@]}"; do
  for sp in false true; do
  a=$(sent "$t" $layers $sp)
  b=$(sent "$t" $((layers + 2)) $sp)
  micro_batches=$((batch / micro))
  awk -v a="$a" -v b="$b" -v t="$t" -v sp=$sp -v mb=$micro_batches \
    -v bsh=$((micro * seq * hidden)) 'BEGIN {
    per_layer = (b - a) / 2
    theory = 4 * mb * 2 * (t - 1) / t * bsh * 4
    printf "| %d | %s | %.0f | %.0f | %.4f |\n", t, sp == "true" ? "on" : "off", per_layer,
      theory, per_layer / theory
  }'
  done
done
