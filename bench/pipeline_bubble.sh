#!/usr/bin/env bash
# Pipeline parallelism measured from the stages' own traces: the bubble of 1F1B and interleaved
# 1F1B against the theory, (P - 1) / (M + P - 1) and (P - 1) / (V M + P - 1) for M micro-batches;
# the bytes each stage boundary carries per micro-batch against b * s * h * 4 (fp32
# activations); and each stage's device peak against its plan.
#
# Each rank writes its trace (trace_file with {rank}); the traces carry the machine's monotonic
# clock (otherData.clock_origin_ns), so the stages' passes line up. A pass's span is its own work
# (a forward or backward of one chunk), not the wait for its input. Per step after the first:
# makespan = the last pass's end - the first pass's start over all stages, busy = the passes'
# time summed, bubble = 1 - busy / (P * makespan). Each stage runs on one core (threads 1), so P
# must not exceed the cores. The "tied" row ties the embedding to the head: the first stage also
# sends the last the embedding (vocab x hidden x 4 bytes) each step, and the last sends back the
# head's part of its gradient (the same bytes) each micro-batch; its byte columns count those
# against that expectation.
#
# Usage: bench/pipeline_bubble.sh [build/strata] [P]   (default P 2; needs mpirun and python3)
set -euo pipefail
cd "$(dirname "$0")/.."
strata=${1:-build/strata}
stages=${2:-2}
work=$(mktemp -d /tmp/strata-pipeline-bubble.XXXXXX)
trap 'rm -rf "$work"' EXIT

micro=2 seq=128 hidden=256 layers=8 steps=${PIPELINE_BUBBLE_STEPS:-6}
for text in $(seq 1 400); do echo "stages pass activations down and gradients back up again"; done >"$work/data.txt"

run() {  # name schedule micro_batches tied -> the run's directory
  local name=$1 schedule=$2 m=$3 tied=$4 dir=$work/$1
  mkdir -p "$dir"
  mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$stages" \
    "$strata" train examples/quickstart.json --set max_steps=$steps --set save_dir= \
    --set data.path="$work/data.txt" --set data.format=text --set threads=1 \
    --set model.num_hidden_layers=$layers --set model.hidden_size=$hidden \
    --set model.intermediate_size=$((3 * hidden)) --set model.num_attention_heads=4 \
    --set model.num_key_value_heads=4 --set model.vocab_size=256 \
    --set model.tie_word_embeddings="$tied" --set precision=fp32 \
    --set seq_len=$seq --set micro_batch_size=$micro --set batch_size=$((m * micro)) \
    --set pipeline_parallel_size="$stages" --set pipeline_schedule="$schedule" \
    --set trace_file="$dir/trace-{rank}.json" --set metrics_file="$dir/metrics-{rank}.jsonl" \
    >"$dir/out.txt" 2>&1 || {
    cat "$dir/out.txt" >&2
    exit 1
  }
  echo "$dir"
}

printf '| schedule | P | M | V | bubble measured (median of steps 2-%d, min-max) | theory | stage 0 sent bytes / micro-batch / ((2V - 1) b s h 4) | device peak per stage (planned) |\n' $steps
printf '|---|---|---|---|---|---|---|---|\n'
for spec in "1f1b 4 1 false" "1f1b 8 1 false" "interleaved 4 2 false" "interleaved 8 2 false" \
  "1f1b 4 1 true"; do
  read -r schedule m v tied <<<"$spec"
  dir=$(run "$schedule-$m-$tied" "$schedule" "$m" "$tied")
  python3 - "$dir" "$stages" "$m" "$v" "$schedule" "$steps" $((micro * seq * hidden * 4)) "$tied" $((256 * hidden * 4)) <<'PY'
import json, statistics, sys
d, P, M, V, schedule, steps, bsh4 = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6]), int(sys.argv[7])
tied, vh4 = sys.argv[8] == "true", int(sys.argv[9])
passes = []  # per stage: [(start_ns, end_ns)] in time order
for s in range(P):
    t = json.load(open(f"{d}/trace-{s}.json"))
    origin = t["otherData"]["clock_origin_ns"]
    spans = sorted((origin + e["ts"] * 1e3, origin + (e["ts"] + e["dur"]) * 1e3)
                   for e in t["traceEvents"]
                   if e.get("name", "").startswith(("forward micro-batch", "backward micro-batch")))
    assert len(spans) == steps * 2 * M * V, (s, len(spans))
    passes.append(spans)
per_step = 2 * M * V
bubbles = []
for k in range(1, steps):  # the first step warms up
    step = [p[k * per_step:(k + 1) * per_step] for p in passes]
    start = min(sp[0][0] for sp in step)
    end = max(sp[-1][1] for sp in step)
    busy = sum(e - b for sp in step for b, e in sp)
    bubbles.append(1 - busy / (P * (end - start)))
theory = (P - 1) / ((V * M if schedule == "interleaved" else M) + P - 1)
sent = [json.loads(l)["sent_bytes"] for l in open(f"{d}/metrics-0.jsonl")]
# Stage 0 sends each micro-batch's activations once from each of its V chunks, and the input
# gradient once from each but its first (virtual stage 0): 2V - 1 tensors of b * s * h.
# Tied: the embedding's vocab x hidden x 4 bytes once a step besides.
per_micro = (statistics.median(sent) - (vh4 if tied else 0)) / (M * (2 * V - 1))
peaks = []
for s in range(P):
    last = [json.loads(l) for l in open(f"{d}/metrics-{s}.jsonl")][-1]
    peaks.append(f"{last['peak_device_bytes'] / 2**20:.2f} ({last['planned_device_bytes'] / 2**20:.2f}) MiB")
if tied:
    # The last stage sends 2V - 1 boundary tensors a micro-batch too (an input gradient from each
    # chunk, an output from each but its last), and the head's part of the embedding gradient.
    last_sent = statistics.median(json.loads(l)["sent_bytes"] for l in open(f"{d}/metrics-{P - 1}.jsonl"))
    grads = (last_sent - M * (2 * V - 1) * bsh4) / (M * vh4)
    schedule += f" tied (last stage: embedding gradient {grads:.4f} x V h 4 a micro-batch)"
print(f"| {schedule} | {P} | {M} | {V} | {100 * statistics.median(bubbles):.1f}% "
      f"({100 * min(bubbles):.1f}-{100 * max(bubbles):.1f}) | {100 * theory:.1f}% | "
      f"{per_micro / bsh4:.4f} | {'; '.join(peaks)} |")
PY
done
