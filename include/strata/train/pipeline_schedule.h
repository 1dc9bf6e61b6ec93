// Pipeline parallelism's schedules (Megatron's 1F1B and interleaved 1F1B) as plain lists: what
// one stage runs in a step, in order, and a simulation of all stages under given pass times that
// measures the bubble the schedule leaves against the theory.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/status.h"

namespace strata::train {

enum class PipelineSchedule : std::uint8_t {
  k1F1B,         // "1f1b": warm-up forwards, one forward one backward, cool-down backwards
  kInterleaved,  // "interleaved": each stage holds V chunks of layers, V times as many passes
};
inline constexpr std::array<PipelineSchedule, 2> kPipelineSchedules = {
    PipelineSchedule::k1F1B, PipelineSchedule::kInterleaved};
std::string_view pipeline_schedule_name(PipelineSchedule schedule);  // "1f1b", "interleaved"

// The shape of a step's pipeline: P stages, M micro-batches, V layer chunks per stage (1 for
// 1F1B). Virtual stage c * P + s is chunk c of stage s: micro-batches cross P * V of them.
struct PipelineShape {
  int stages = 1;
  int micro_batches = 1;
  int virtual_stages = 1;
  int virtual_count() const { return stages * virtual_stages; }
};

// Every reason `shape` cannot run under `schedule`, naming the values: at least one of each;
// interleaving needs V >= 2 and M a multiple of P (its micro-batches go through the chunks in
// groups of P); 1F1B takes V = 1.
std::vector<std::string> pipeline_shape_problems(PipelineSchedule schedule,
                                                 const PipelineShape& shape);

struct PipelinePass {
  bool forward = true;
  int micro_batch = 0;
  int chunk = 0;  // the stage's layer chunk, 0..V-1
};

// Stage `stage`'s passes in the order it runs them (Megatron's schedules.py): 1F1B runs
// min(P - stage - 1, M) warm-up forwards, then alternates a forward and a backward until the
// forwards are done, then the remaining backwards; at most P - stage micro-batches' activations
// are held at once. Interleaved runs (P - stage - 1) * 2 + (V - 1) * P warm-up forwards
// (capped at M * V), forwards walking the chunks upward and backwards downward, P micro-batches
// to a chunk at a time. The shape must have no problems.
std::vector<PipelinePass> stage_passes(PipelineSchedule schedule, const PipelineShape& shape,
                                       int stage);

// The largest number of micro-batches whose forward a stage has run and whose backward it has not
// (the activations it holds at once), over the stage's passes.
int peak_in_flight(const std::vector<PipelinePass>& passes);

// The most micro-batches a stage holds some activation of at once: from its first forward (of
// chunk 0) until its last backward (of chunk 0). They enter and leave in order, so micro-batch m
// may use activation set m % peak_micro_batches.
int peak_micro_batches(const std::vector<PipelinePass>& passes);

// All stages run their passes in order, each pass starting when its stage is free and its inputs
// exist (a forward after the previous virtual stage's forward of that micro-batch; a backward
// after its own forward and the next virtual stage's backward), with every forward of a chunk
// taking forward_time and every backward backward_time. Boundary transfers take no time.
struct PipelineTimeline {
  double makespan = 0;         // first pass's start to the last pass's end
  double busy = 0;             // summed over the stages
  std::vector<double> starts;  // per stage, per pass, in stage_passes order, concatenated
  // The fraction of stage time idle: 1 - busy / (P * makespan).
  double bubble(int stages) const { return 1.0 - busy / (stages * makespan); }
};
// An error (naming the stage and pass) if the passes deadlock: a schedule whose order no run
// could follow.
Result<PipelineTimeline> simulate(PipelineSchedule schedule, const PipelineShape& shape,
                                  double forward_time, double backward_time);

// The theory's bubble: (P - 1) / (M + P - 1) for 1F1B, (P - 1) / (V M + P - 1) interleaved.
double theoretical_bubble(PipelineSchedule schedule, const PipelineShape& shape);

// Each stage's count of consecutive layers (at least one each; `layers` >= `stages`) that makes
// the costliest stage as cheap as any split can: every layer costs `layer_cost`, the first stage
// also `first_extra` (the embedding) and the last `last_extra` (the final norm, the LM head and
// the loss). Ties go to the earlier stages' holding more layers.
std::vector<int> balance_stages(int layers, int stages, double layer_cost, double first_extra,
                                double last_extra);

}  // namespace strata::train
