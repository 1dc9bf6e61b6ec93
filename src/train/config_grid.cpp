// What a config asks of the grid: what its parallelism keys must satisfy, each pipeline stage's
// layers (given, or balanced by their arithmetic), the pipeline's stretch of a step, and the
// model options a stage runs with.
#include <algorithm>
#include <string>
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

std::vector<std::string> TrainConfig::grid_problems(bool has_model) const {
  const TrainConfig& c = *this;
  std::vector<std::string> problems;
  if (c.sequence_parallel && c.tensor_parallel_size == 1 && !c.parallelism_auto) {
    problems.push_back(
        "'sequence_parallel': splits the tokens over the tensor-parallel ranks; it needs "
        "tensor_parallel_size above 1");
  }
  if (c.sequence_parallel && c.tensor_parallel_size > 1 && c.micro_batch_size > 0 &&
      (c.micro_batch_size * c.seq_len) % c.tensor_parallel_size != 0) {
    problems.push_back("'sequence_parallel': tensor_parallel_size " +
                       std::to_string(c.tensor_parallel_size) + " must divide the " +
                       std::to_string(c.micro_batch_size * c.seq_len) +
                       " tokens of a micro-batch (micro_batch_size x seq_len)");
  }
  if (c.tensor_parallel_size > 1) {
    if (has_model) {
      for (const auto& p : model::tensor_parallel_problems(c.model, c.tensor_parallel_size)) {
        problems.push_back("'tensor_parallel_size': " + p);
      }
    }
  }
  if (c.pipeline_schedule == PipelineSchedule::k1F1B && c.virtual_stages != 1) {
    problems.push_back("'virtual_stages': " + std::to_string(c.virtual_stages) +
                       " chunks a stage need pipeline_schedule \"interleaved\"; \"1f1b\" runs one");
  }
  if (c.pipeline_schedule == PipelineSchedule::kInterleaved) {
    if (c.virtual_stages < 2) {
      problems.push_back(
          "'virtual_stages': the interleaved schedule needs 2 or more chunks a stage, "
          "got " +
          std::to_string(c.virtual_stages));
    }
    if (c.pipeline_parallel_size < 2 && !c.parallelism_auto) {
      problems.push_back(
          "'pipeline_schedule': \"interleaved\" needs pipeline_parallel_size above 1");
    }
  }
  if (c.expert_parallel_size > 1 && has_model) {
    const std::string e = std::to_string(c.expert_parallel_size);
    if (!c.model.has_moe()) {
      problems.push_back("'expert_parallel_size': " + e +
                         " shares out the experts of mixture-of-experts layers; " +
                         std::string(model::model_type_name(c.model.family)) + " has none (use 1)");
    } else if (c.model.moe.num_experts % c.expert_parallel_size != 0) {
      problems.push_back("'expert_parallel_size': " + e + " must divide the " +
                         std::to_string(c.model.moe.num_experts) +
                         " experts of each MoE layer (num_experts)");
    }
  }
  if (has_model && c.model.has_moe()) {
    const std::string family(model::model_type_name(c.model.family));
    if (c.sequence_parallel) {
      problems.push_back("'sequence_parallel': the mixture-of-experts layers of " + family +
                         " run every token of a micro-batch on each tensor-parallel rank; use "
                         "sequence_parallel false");
    }
  }
  if (c.pipeline_parallel_size > 1 || !c.pipeline_layers.empty()) {
    const int virtual_count = c.pipeline_parallel_size * c.virtual_stages;
    if (has_model && c.pipeline_layers.empty() && virtual_count > c.model.num_hidden_layers) {
      problems.push_back("'pipeline_parallel_size': " + std::to_string(c.pipeline_parallel_size) +
                         (c.virtual_stages > 1
                              ? " x virtual_stages " + std::to_string(c.virtual_stages) + " = " +
                                    std::to_string(virtual_count) + " virtual stages"
                              : " stages") +
                         " need at least as many layers; the model has " +
                         std::to_string(c.model.num_hidden_layers) + " (num_hidden_layers)");
    }
    if (has_model && !c.pipeline_layers.empty()) {
      for (const auto& p :
           model::pipeline_layers_problems(c.pipeline_layers, c.pipeline_parallel_size,
                                           c.virtual_stages, c.model.num_hidden_layers)) {
        problems.push_back("'pipeline_layers': " + p);
      }
    }
  }
  if (c.parallelism_auto && (c.tensor_parallel_size != 1 || c.pipeline_parallel_size != 1 ||
                             c.expert_parallel_size != 1 || !c.pipeline_layers.empty())) {
    problems.push_back(
        "'parallelism': \"auto\" chooses tensor_parallel_size, pipeline_parallel_size and "
        "expert_parallel_size (and "
        "each stage's layers); leave them out, or use \"manual\"");
  }
  return problems;
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
