// What a config asks of the grid: each pipeline stage's layers (given, or balanced by their
// arithmetic), the pipeline's stretch of a step, and the model options a stage runs with.
#include <algorithm>
#include <vector>

#include "strata/train/config.h"

namespace strata::train {

TrainConfig::PipelineCosts TrainConfig::pipeline_costs() const {
  // Each layer's and the head's multiply-adds a token (their weights, and a layer's causal
  // attention over seq_len / 2 positions on average); the embedding is a lookup.
  const double h = static_cast<double>(model.hidden_size);
  return {h * static_cast<double>(2 * model.q_dim() + 2 * model.kv_dim()) +
              3.0 * h * static_cast<double>(model.intermediate_size) +
              static_cast<double>(seq_len * model.q_dim()),
          h * static_cast<double>(model.vocab_size)};
}

std::vector<std::int64_t> TrainConfig::pipeline_layer_counts() const {
  if (!pipeline_layers.empty()) return pipeline_layers;
  const int virtual_count = pipeline_parallel_size * virtual_stages;
  if (virtual_count == 1) return {model.num_hidden_layers};
  const PipelineCosts cost = pipeline_costs();
  const std::vector<int> counts = balance_stages(static_cast<int>(model.num_hidden_layers),
                                                 virtual_count, cost.layer, 0.0, cost.head);
  return {counts.begin(), counts.end()};
}

double TrainConfig::pipeline_stretch(int data_ranks) const {
  const int p = pipeline_parallel_size, v = virtual_stages;
  if (p == 1) return 1.0;
  const PipelineCosts cost = pipeline_costs();
  const std::vector<std::int64_t> counts = pipeline_layer_counts();
  std::vector<double> stage(static_cast<std::size_t>(p), 0.0);
  double total = 0;
  for (std::size_t i = 0; i < counts.size(); ++i) {
    const double c =
        static_cast<double>(counts[i]) * cost.layer + (i + 1 == counts.size() ? cost.head : 0.0);
    stage[i % static_cast<std::size_t>(p)] += c;
    total += c;
  }
  const double imbalance = *std::max_element(stage.begin(), stage.end()) * p / total;
  const double m = static_cast<double>(accumulation_steps(data_ranks));
  return imbalance * (m + static_cast<double>(p - 1) / v) / m;
}

model::PipelineStage TrainConfig::pipeline_stage(int stage) const {
  return model::pipeline_stage(pipeline_parallel_size, virtual_stages, stage,
                               pipeline_layer_counts());
}

model::ModelOptions TrainConfig::model_options(int pipeline_rank, int data_ranks) const {
  model::ModelOptions o;
  o.compute_dtype = precision;
  o.activation_checkpointing = activation_checkpointing;
  o.lm_head_chunk_tokens = lm_head_chunk_tokens;
  o.lora = lora();
  o.nf4_base = nf4_base();
  o.tensor_parallel.size = tensor_parallel_size;  // the rank's place: the trainer's
  o.sequence_parallel = sequence_parallel;
  o.pipeline = pipeline_stage(pipeline_rank);
  o.expert_parallel.size = expert_parallel_size;  // the rank's place: the trainer's
  if (const PipelineShape shape = pipeline_shape(data_ranks);
      shape.stages > 1 && pipeline_shape_problems(pipeline_schedule, shape).empty()) {
    o.pipeline.in_flight =
        peak_micro_batches(stage_passes(pipeline_schedule, shape, pipeline_rank));
  }
  return o;
}

}  // namespace strata::train
