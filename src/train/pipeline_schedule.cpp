// Pipeline schedules (pipeline_schedule.h): Megatron's 1F1B and interleaved 1F1B orders, and a
// simulation of every stage running them.
#include "strata/train/pipeline_schedule.h"

#include <algorithm>
#include <limits>
#include <map>
#include <tuple>

#include "strata/core/check.h"

namespace strata::train {

std::string_view pipeline_schedule_name(PipelineSchedule schedule) {
  return schedule == PipelineSchedule::kInterleaved ? "interleaved" : "1f1b";
}

std::vector<std::string> pipeline_shape_problems(PipelineSchedule schedule,
                                                 const PipelineShape& shape) {
  std::vector<std::string> problems;
  const auto named = [](const char* what, int v) {
    return std::string(what) + " " + std::to_string(v);
  };
  if (shape.stages < 1)
    problems.push_back(named("pipeline stages", shape.stages) + ": expected >= 1");
  if (shape.micro_batches < 1) {
    problems.push_back(named("micro-batches", shape.micro_batches) + ": expected >= 1");
  }
  if (schedule == PipelineSchedule::k1F1B && shape.virtual_stages != 1) {
    problems.push_back(named("virtual_stages", shape.virtual_stages) +
                       ": the 1f1b schedule runs one chunk of layers a stage; use \"interleaved\"");
  }
  if (schedule == PipelineSchedule::kInterleaved) {
    if (shape.virtual_stages < 2) {
      problems.push_back(named("virtual_stages", shape.virtual_stages) +
                         ": the interleaved schedule needs 2 or more chunks a stage");
    }
    if (shape.stages >= 1 && shape.micro_batches % shape.stages != 0) {
      problems.push_back(named("micro-batches", shape.micro_batches) +
                         ": the interleaved schedule takes them " + std::to_string(shape.stages) +
                         " at a time (one per stage); use a multiple of " +
                         std::to_string(shape.stages));
    }
  }
  return problems;
}

std::vector<PipelinePass> stage_passes(PipelineSchedule schedule, const PipelineShape& shape,
                                       int stage) {
  STRATA_CHECK(
      pipeline_shape_problems(schedule, shape).empty() && stage >= 0 && stage < shape.stages,
      "a pipeline shape that cannot run", shape.stages, shape.micro_batches, shape.virtual_stages,
      stage);
  const int p = shape.stages, m = shape.micro_batches, v = shape.virtual_stages;
  // Pass k of the stage's forwards (and of its backwards): micro-batches go through a chunk P
  // at a time, forwards up the chunks, backwards down them.
  const auto pass = [&](int k, bool forward) {
    const int group = k / (p * v), in_group = k % (p * v);
    const int chunk = in_group / p;
    return PipelinePass{forward, group * p + in_group % p, forward ? chunk : v - 1 - chunk};
  };
  const int total = m * v;
  int warmup = 0;
  if (schedule == PipelineSchedule::k1F1B) {
    warmup = std::min(p - stage - 1, m);
  } else {
    warmup = m == p ? total : std::min((p - stage - 1) * 2 + (v - 1) * p, total);
  }
  std::vector<PipelinePass> passes;
  passes.reserve(static_cast<std::size_t>(2 * total));
  for (int k = 0; k < warmup; ++k) passes.push_back(pass(k, true));
  const int steady = total - warmup;
  for (int k = 0; k < steady; ++k) {
    passes.push_back(pass(warmup + k, true));
    passes.push_back(pass(k, false));
  }
  for (int k = steady; k < total; ++k) passes.push_back(pass(k, false));
  return passes;
}

int peak_in_flight(const std::vector<PipelinePass>& passes) {
  int live = 0, peak = 0;
  for (const PipelinePass& p : passes) {
    live += p.forward ? 1 : -1;
    peak = std::max(peak, live);
  }
  return peak;
}

int peak_micro_batches(const std::vector<PipelinePass>& passes) {
  int live = 0, peak = 0;
  for (const PipelinePass& p : passes) {
    if (p.chunk != 0) continue;
    live += p.forward ? 1 : -1;
    peak = std::max(peak, live);
  }
  return peak;
}

Result<PipelineTimeline> simulate(PipelineSchedule schedule, const PipelineShape& shape,
                                  double forward_time, double backward_time) {
  const int p = shape.stages, vcount = shape.virtual_count();
  std::vector<std::vector<PipelinePass>> passes;
  for (int s = 0; s < p; ++s) passes.push_back(stage_passes(schedule, shape, s));
  // When each (forward?, micro-batch, virtual stage) pass ended.
  std::map<std::tuple<bool, int, int>, double> done;
  std::vector<std::size_t> next(static_cast<std::size_t>(p), 0);
  std::vector<double> free_at(static_cast<std::size_t>(p), 0.0);
  std::vector<std::vector<double>> starts(static_cast<std::size_t>(p));
  PipelineTimeline t;
  for (bool moved = true; moved;) {
    moved = false;
    for (int s = 0; s < p; ++s) {
      const auto si = static_cast<std::size_t>(s);
      while (next[si] < passes[si].size()) {
        const PipelinePass& x = passes[si][next[si]];
        const int vs = x.chunk * p + s;
        double ready = free_at[si];
        bool inputs = true;
        const auto need = [&](bool forward, int virtual_stage) {
          const auto it = done.find({forward, x.micro_batch, virtual_stage});
          if (it == done.end()) {
            inputs = false;
          } else {
            ready = std::max(ready, it->second);
          }
        };
        if (x.forward) {
          if (vs > 0) need(true, vs - 1);
        } else {
          need(true, vs);
          if (vs + 1 < vcount) need(false, vs + 1);
        }
        if (!inputs) break;
        const double took = x.forward ? forward_time : backward_time;
        starts[si].push_back(ready);
        free_at[si] = ready + took;
        done[{x.forward, x.micro_batch, vs}] = ready + took;
        t.busy += took;
        t.makespan = std::max(t.makespan, ready + took);
        ++next[si];
        moved = true;
      }
    }
  }
  for (int s = 0; s < p; ++s) {
    const auto si = static_cast<std::size_t>(s);
    if (next[si] < passes[si].size()) {
      const PipelinePass& x = passes[si][next[si]];
      return failed_precondition("the " + std::string(pipeline_schedule_name(schedule)) +
                                 " schedule deadlocks: stage " + std::to_string(s) + " waits at " +
                                 (x.forward ? "forward" : "backward") + " of micro-batch " +
                                 std::to_string(x.micro_batch) + ", chunk " +
                                 std::to_string(x.chunk));
    }
    t.starts.insert(t.starts.end(), starts[si].begin(), starts[si].end());
  }
  return t;
}

std::vector<int> balance_stages(int layers, int stages, double layer_cost, double first_extra,
                                double last_extra) {
  STRATA_CHECK(stages >= 1 && layers >= stages && layer_cost > 0, "stages that cannot be balanced",
               layers, stages, layer_cost);
  const auto cost = [&](int stage, int count) {
    return count * layer_cost + (stage == 0 ? first_extra : 0.0) +
           (stage == stages - 1 ? last_extra : 0.0);
  };
  // best[s][l]: the least costliest-stage of stages 0..s holding the first l layers; take[s][l]
  // the count stage s holds there. Exact over every split (stages * layers^2, layers ~ 100).
  const double kInf = std::numeric_limits<double>::infinity();
  const auto S = static_cast<std::size_t>(stages), L = static_cast<std::size_t>(layers);
  std::vector<std::vector<double>> best(S, std::vector<double>(L + 1, kInf));
  std::vector<std::vector<int>> take(S, std::vector<int>(L + 1, 0));
  for (int l = 1; l <= layers; ++l) {
    best[0][static_cast<std::size_t>(l)] = cost(0, l);
    take[0][static_cast<std::size_t>(l)] = l;
  }
  for (int s = 1; s < stages; ++s) {
    const auto si = static_cast<std::size_t>(s);
    for (int l = s + 1; l <= layers; ++l) {
      // The last stage's count from the smallest up: an equal cost keeps the smaller count here,
      // the larger one earlier.
      for (int k = 1; k <= l - s; ++k) {
        const double c = std::max(best[si - 1][static_cast<std::size_t>(l - k)], cost(s, k));
        if (c < best[si][static_cast<std::size_t>(l)]) {
          best[si][static_cast<std::size_t>(l)] = c;
          take[si][static_cast<std::size_t>(l)] = k;
        }
      }
    }
  }
  std::vector<int> counts(S);
  for (int s = stages - 1, l = layers; s >= 0; --s) {
    counts[static_cast<std::size_t>(s)] =
        take[static_cast<std::size_t>(s)][static_cast<std::size_t>(l)];
    l -= counts[static_cast<std::size_t>(s)];
  }
  return counts;
}

double theoretical_bubble(PipelineSchedule schedule, const PipelineShape& shape) {
  const double p = shape.stages, m = shape.micro_batches;
  const double v = schedule == PipelineSchedule::kInterleaved ? shape.virtual_stages : 1;
  return (p - 1) / (v * m + p - 1);
}

}  // namespace strata::train
