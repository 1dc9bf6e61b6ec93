// Pipeline stages (pipeline_stage.h): which layers each stage's chunks hold.
#include "strata/model/pipeline_stage.h"

#include <numeric>

#include "strata/core/check.h"

namespace strata::model {

int PipelineStage::stage_holding(std::int64_t layer, std::int64_t layers) const {
  if (bounds.empty()) return 0;
  STRATA_CHECK(layer >= 0 && layer < layers, "a layer outside the model", layer, layers);
  for (int v = 0; v < virtual_count(); ++v) {
    if (layer < bounds[static_cast<std::size_t>(v + 1)]) return v % stages;
  }
  return stages - 1;
}

int PipelineStage::chunk_of(std::int64_t layer, std::int64_t layers) const {
  for (int c = 0; c < virtual_stages; ++c) {
    if (layer >= chunk_begin(c) && layer < chunk_end(c, layers)) return c;
  }
  return -1;
}

PipelineStage pipeline_stage(int stages, int virtual_stages, int stage,
                             const std::vector<std::int64_t>& counts) {
  STRATA_CHECK(stages >= 1 && virtual_stages >= 1 && stage >= 0 && stage < stages &&
                   counts.size() == static_cast<std::size_t>(stages * virtual_stages),
               "a pipeline stage without a layer count per virtual stage", stages, virtual_stages,
               stage, counts.size());
  PipelineStage s;
  s.stages = stages;
  s.virtual_stages = virtual_stages;
  s.stage = stage;
  if (stages == 1 && virtual_stages == 1) return s;  // one stage: every layer
  s.bounds.assign(1, 0);
  for (const std::int64_t n : counts) s.bounds.push_back(s.bounds.back() + n);
  return s;
}

std::vector<std::string> pipeline_layers_problems(const std::vector<std::int64_t>& counts,
                                                  int stages, int virtual_stages,
                                                  std::int64_t layers) {
  std::vector<std::string> problems;
  const int want = stages * virtual_stages;
  if (static_cast<int>(counts.size()) != want) {
    problems.push_back("has " + std::to_string(counts.size()) + " counts; expected one per " +
                       (virtual_stages > 1
                            ? "virtual stage (pipeline_parallel_size " + std::to_string(stages) +
                                  " x virtual_stages " + std::to_string(virtual_stages) + " = " +
                                  std::to_string(want) + ")"
                            : "stage (" + std::to_string(stages) + ")"));
  }
  for (std::size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] < 1) {
      problems.push_back("count " + std::to_string(i) + " is " + std::to_string(counts[i]) +
                         "; every stage needs at least one layer");
    }
  }
  const std::int64_t sum = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
  if (sum != layers) {
    problems.push_back("sums to " + std::to_string(sum) + " layers; the model has " +
                       std::to_string(layers) + " (num_hidden_layers)");
  }
  return problems;
}

}  // namespace strata::model
