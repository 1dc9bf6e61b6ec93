// A step's predicted time from the plan and the machine's rates (machine_rates.cpp), the
// small-step probe, and the grid "auto" chooses (placements: placement_advice.cpp).
#include "strata/train/step_time.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "strata/optim/state_layout.h"
#include "strata/zero/plan.h"

namespace strata::train {

double ms(double bytes_or_flops, const Rate& r) {
  return r.per_s > 0 ? bytes_or_flops / r.per_s * 1e3 : 0.0;
}

namespace {

int data_ranks_of(const TrainConfig& config, int ranks) {
  return ranks / (config.tensor_parallel_size * config.pipeline_parallel_size);
}

// Ranks on a node: the config's, or every rank on one.
int node_ranks(const TrainConfig& config, int ranks) {
  return config.ranks_per_node > 0 ? std::min(config.ranks_per_node, ranks) : ranks;
}

// A node's link to the others (where given; else the rate within a node).
const Rate& between_nodes(const MachineRates& rates) {
  return rates.inter_node_bytes.per_s > 0 ? rates.inter_node_bytes : rates.comm_bytes;
}

// `bytes` each rank of a group of `members` sends in a collective where each sends (n - 1) / n
// of them, `local` of the members on each node and `senders` ranks of a node sending at once:
// the share to the members on its own node at the rate within a node, the rest through the
// node's one link, shared by the senders, at once.
double group_ms(double bytes, int members, int local, int senders, const MachineRates& rates) {
  local = std::clamp(local, 1, members);
  const double within = ms(bytes * (local - 1) / members, rates.comm_bytes);
  if (local == members) return within;
  return std::max(within, ms(bytes * (members - local) / members * senders, between_nodes(rates)));
}

// The MoE layers' count.
double moe_layers(const model::LlamaConfig& m) {
  double n = 0;
  for (std::int64_t l = 0; l < m.num_hidden_layers; ++l) n += m.is_moe_layer(l) ? 1 : 0;
  return n;
}

}  // namespace

double zero_comm_ms(const TrainConfig& config, double parameters, int ranks,
                    const MachineRates& rates) {
  const int tensor = config.tensor_parallel_size;
  const double split = tensor * config.pipeline_parallel_size;
  const int data = data_ranks_of(config, ranks);
  if (data <= 1) return 0;
  // Expert parallelism: a rank holds 1 / E of the experts, whose traffic is over the D / E ranks
  // holding them.
  if (const int e = config.expert_parallel_size; e > 1 && config.model.has_moe()) {
    const model::LlamaConfig& m = config.model;
    const double experts = moe_layers(m) * static_cast<double>(m.moe.num_experts) * 3.0 *
                           static_cast<double>(m.hidden_size) *
                           static_cast<double>(m.moe.expert_intermediate_size);
    parameters -= std::min(experts, parameters) * (1.0 - 1.0 / e);
  }
  // Stage 3 gathers every micro-batch's parameters for the forward and again for the backward
  // (but for the embedding, whose backward needs only the tokens, and the LM head, kept from its
  // forward to its backward: one matrix of vocab x hidden tied, two untied) and reduces its
  // gradients; stages 1 and 2 reduce each micro-batch's gradients and gather the updated
  // parameters once a step.
  const double accum = static_cast<double>(config.accumulation_steps(data));
  const double ends = static_cast<double>(config.model.vocab_size) *
                      static_cast<double>(config.model.hidden_size) *
                      (config.model.tie_word_embeddings ? 1.0 : 2.0);
  const double elements = config.zero_stage >= 3
                              ? accum * (3.0 * parameters - std::min(ends, parameters))
                              : (accum + 1.0) * parameters;
  const double bytes = elements / split * static_cast<double>(dtype_size(config.precision));
  // A rank's data-parallel peers are T ranks apart (tensor groups adjacent): a node of L ranks
  // holds L / T of a group, and all its L ranks send at once.
  const int node = node_ranks(config, ranks);
  return group_ms(bytes, data, node / tensor, node, rates);
}

namespace {
// One micro-batch's activations, b s h in the compute dtype.
double activation_bytes_of(const TrainConfig& config) {
  return static_cast<double>(config.micro_batch_size) * static_cast<double>(config.seq_len) *
         static_cast<double>(config.model.hidden_size) *
         static_cast<double>(dtype_size(config.precision));
}
}  // namespace

double tensor_parallel_ms(const TrainConfig& config, int ranks, const MachineRates& rates) {
  const int tensor = config.tensor_parallel_size;
  if (tensor <= 1) return 0;
  const double accum = static_cast<double>(config.accumulation_steps(data_ranks_of(config, ranks)));
  const double per_layer = config.activation_checkpointing ? 6.0 : 4.0;
  // A stage's share of the layers (the embedding's and lm_head's at the pipeline's ends); an MoE
  // layer's MLP runs whole on every rank of the group, so it sums attention's alone: half.
  const double layers =
      (static_cast<double>(config.model.num_hidden_layers) - 0.5 * moe_layers(config.model)) /
      static_cast<double>(config.pipeline_parallel_size);
  const double ends = config.pipeline_parallel_size > 1 ? 1.0 : 2.0;
  const double collectives = accum * (per_layer * layers + ends);
  double bytes = collectives * 2.0 * (tensor - 1) / tensor * activation_bytes_of(config);
  // LoRA over the split: each micro-batch's backward sums every adapted projection's whole copy's
  // gradient over the group (lora_A [r, hidden] over a column-parallel base, lora_B [hidden, r]
  // over a row-parallel one: r x hidden either way), and with kv heads whole on several ranks
  // k's and v's lora_B [kv slice, r] over those.
  if (const auto lora = config.lora()) {
    const double eb = static_cast<double>(dtype_size(config.precision));
    const double r = static_cast<double>(lora->r);
    const model::LlamaConfig& m = config.model;
    const int replicas = model::kv_head_replicas(m.num_key_value_heads, tensor);
    double per_micro_batch = 0;
    for (int i = 0; i < model::kNumLoraTargets; ++i) {
      const auto target = static_cast<model::LoraTarget>(i);
      // The router's adapter is whole on every rank, as the router: nothing to sum.
      if (!lora->has(target) || target == model::LoraTarget::kRouter) continue;
      per_micro_batch += 2.0 * (tensor - 1) / tensor * r * static_cast<double>(m.hidden_size);
      if (replicas > 1 && (target == model::LoraTarget::kK || target == model::LoraTarget::kV)) {
        per_micro_batch += 2.0 * (replicas - 1) / replicas * r *
                           static_cast<double>(m.kv_dim() * replicas / tensor);
      }
    }
    bytes += accum * layers * per_micro_batch * eb;
  }
  // A tensor group larger than a node (which the grid avoids) crosses the nodes' links.
  const int node = node_ranks(config, ranks);
  return tensor <= node ? ms(bytes, rates.comm_bytes) : group_ms(bytes, tensor, node, node, rates);
}

double expert_parallel_ms(const TrainConfig& config, int ranks, const MachineRates& rates) {
  const int e = config.expert_parallel_size;
  if (e <= 1 || !config.model.has_moe()) return 0;
  const model::LlamaConfig& m = config.model;
  const double accum = static_cast<double>(config.accumulation_steps(data_ranks_of(config, ranks)));
  // Each MoE layer of a stage (its share of them) sends a micro-batch's k rows a token out and
  // their outputs back in forward (again where checkpointing recomputes it), and their gradients
  // out and back in backward.
  const double passes = config.activation_checkpointing ? 6.0 : 4.0;
  const double layers =
      moe_layers(m) / static_cast<double>(std::max(1, config.pipeline_parallel_size));
  const double bytes = accum * layers * passes * static_cast<double>(m.moe.experts_per_token) *
                       activation_bytes_of(config);
  // The expert group: E data-parallel ranks T apart, (E - 1) / E of the rows to the others under
  // balanced routing.
  const int node = node_ranks(config, ranks);
  return group_ms(bytes, e, node / config.tensor_parallel_size, node, rates);
}

namespace {
// Where a pipeline spans nodes (each stage's T x D ranks a block of world ranks, a node's L ranks
// another), some boundary crosses a node's link, which that stage's ranks on the node share,
// sending at once: the rate of the slowest boundary; else the rate within a node.
struct BoundaryLink {
  const Rate* rate;
  double senders;
};
BoundaryLink boundary_link(const TrainConfig& config, int ranks, const MachineRates& rates) {
  const int stage = config.tensor_parallel_size * data_ranks_of(config, ranks);
  const int node = node_ranks(config, ranks);
  if (stage * config.pipeline_parallel_size <= node) return {&rates.comm_bytes, 1.0};
  return {&between_nodes(rates), static_cast<double>(std::min(stage, node))};
}
double boundary_bytes(const TrainConfig& config) {
  return activation_bytes_of(config) / (config.sequence_parallel ? config.tensor_parallel_size : 1);
}
}  // namespace

double pipeline_boundary_ms(const TrainConfig& config, int ranks, const MachineRates& rates) {
  const int p = config.pipeline_parallel_size;
  if (p <= 1) return 0;
  const double hops = static_cast<double>(p * config.virtual_stages - 1);
  const BoundaryLink link = boundary_link(config, ranks, rates);
  double total = 2.0 * hops * ms(boundary_bytes(config) * link.senders, *link.rate);
  // Tied embeddings: the first stage sends the last the embedding (this rank's vocabulary rows)
  // before the step's first forward. The head's part of each micro-batch's embedding gradient
  // goes back while the stages compute.
  if (config.model.tie_word_embeddings) {
    const double embedding = static_cast<double>(config.model.vocab_size) *
                             static_cast<double>(config.model.hidden_size) *
                             static_cast<double>(dtype_size(config.precision)) /
                             config.tensor_parallel_size;
    total += ms(embedding * link.senders, *link.rate);
  }
  return total;
}

double pipeline_traffic_ms(const TrainConfig& config, int ranks, const MachineRates& rates) {
  if (config.pipeline_parallel_size <= 1) return 0;
  const double accum = static_cast<double>(config.accumulation_steps(data_ranks_of(config, ranks)));
  const BoundaryLink link = boundary_link(config, ranks, rates);
  // A middle stage sends each micro-batch's activations on and its gradients back (the interleaved
  // schedule each chunk's).
  return ms(2.0 * accum * config.virtual_stages * boundary_bytes(config) * link.senders,
            *link.rate);
}

namespace {

// The step of `e` at `rates` (predict_step's, without the spread).
StepTime predict(const TrainConfig& config, const Estimate& e, const MachineRates& rates) {
  StepTime st;
  const model::LlamaConfig& m = e.model;
  const double ranks = e.ranks;
  const double tokens = static_cast<double>(config.batch_size) / ranks * config.seq_len;
  // Tensor parallelism: each of the T ranks of a group runs the same tokens through 1/T of every
  // layer (the FLOPs below, per rank, come out the same as the whole model's over all ranks); a
  // pipeline's P stages each run all of a data-parallel rank's tokens through 1/P of the layers
  // on average (its stretch, below, adds the costliest stage's excess and the bubble).
  const int tensor = config.tensor_parallel_size, stages = config.pipeline_parallel_size;
  const double accum =
      static_cast<double>(config.accumulation_steps(data_ranks_of(config, e.ranks)));
  const double dsize = static_cast<double>(dtype_size(config.precision));
  // Matrix products: 2 FLOPs per parameter and token forward, 4 backward (input and weight
  // gradients; 2 for a frozen weight, whose weight gradient is skipped); the embedding is a
  // lookup, not a product. Attention 4 x seq x hidden per token and layer forward, 8 backward.
  // Checkpointing runs the forward again.
  // A mixture of experts computes with its active parameters (each token's experts).
  const double params = static_cast<double>(e.active_parameters());
  const double embedding = static_cast<double>(m.vocab_size * m.hidden_size);
  const double trainable = static_cast<double>(e.trainable_parameters - e.inactive_trainable);
  double matmul_trainable = trainable - (e.embedding_trains ? embedding : 0.0);
  double matmul_frozen = (params - trainable) - (e.embedding_trains ? 0.0 : embedding);
  // The LM head apart: it runs at its own rate (chunks of tokens against the vocabulary), once
  // forward whatever the checkpointing, and its weight gradient only where it trains. Untied,
  // its weight is among the products above; tied, the embedding's (a lookup there) serves it.
  const double head = embedding;
  const bool head_trains =
      config.finetune.method == FinetuneMethod::kFull ||
      std::any_of(config.finetune.lora.modules_to_save.begin(),
                  config.finetune.lora.modules_to_save.end(), [&](const std::string& s) {
                    return s.ends_with("lm_head") ||
                           (m.tie_word_embeddings && s.ends_with("embed_tokens"));
                  });
  if (!m.tie_word_embeddings) (head_trains ? matmul_trainable : matmul_frozen) -= head;
  const double passes = config.activation_checkpointing ? 4.0 : 3.0;
  const double flops = 2.0 * tokens * (passes * matmul_trainable + (passes - 1) * matmul_frozen) +
                       passes * 4.0 * static_cast<double>(m.num_hidden_layers) * config.seq_len *
                           static_cast<double>(m.hidden_size) * tokens;
  const double head_flops = 2.0 * tokens * head * (head_trains ? 3.0 : 2.0);
  // The loss over the logits: written, read for the softmax's max and sum, its gradient written
  // and read by the head's products, fp32, bound by memory.
  const double logit_bytes = tokens * static_cast<double>(m.vocab_size) * 4.0 * 4.0;
  // The layers' products: the attention projections' share at their rate, the rest (the MLP's,
  // the experts', the adapters') at the MLP's.
  const double h = static_cast<double>(m.hidden_size);
  const double attention_params = h * static_cast<double>(2 * m.q_dim() + 2 * m.kv_dim());
  const double layer_params =
      static_cast<double>(m.num_hidden_layers) *
      (attention_params + 3.0 * h * static_cast<double>(m.intermediate_size));
  const double attention_share =
      rates.attention_gemm_flops.per_s > 0 && layer_params > 0
          ? std::min(1.0, static_cast<double>(m.num_hidden_layers) * attention_params /
                              std::max(layer_params, matmul_trainable + matmul_frozen))
          : 0.0;
  st.compute_ms =
      ms(flops * (1.0 - attention_share), rates.gemm_flops) +
      (attention_share > 0 ? ms(flops * attention_share, rates.attention_gemm_flops) : 0.0) +
      ms(head_flops, rates.head_gemm_flops.per_s > 0 ? rates.head_gemm_flops : rates.gemm_flops) +
      (rates.memory_bytes.per_s > 0 ? ms(logit_bytes, rates.memory_bytes) : 0.0);
  if (rates.layer_passes.measured && rates.end_passes.measured) {
    // Timed at the run's micro-batch, recompute included: per micro-batch, every layer and the
    // two ends.
    // Timed at the run's micro-batch on an unsplit layer, recompute included: per micro-batch,
    // every layer and the two ends; a split rank does 1/T of it.
    st.compute_ms = accum *
                    (static_cast<double>(m.num_hidden_layers) * 1e3 / rates.layer_passes.per_s +
                     1e3 / rates.end_passes.per_s) /
                    (tensor * stages);
  }

  // The rank's working copies, gradients and optimizer state, as its shard store holds them.
  const double work =
      static_cast<double>(e.plan.kind_bytes(config.offload_param, zero::TensorKind::kParameters));
  // Elements with a gradient and optimizer state on this rank.
  const double elems = static_cast<double>(e.trainable_local_elems);
  // Parameters fetched to the device for forward and backward of each micro-batch, from the
  // host (a copy) or NVMe; what the host caches under a host budget comes from there. A frozen
  // base's copies that fit in the device's room stay there: a pass fetches only the rest.
  if (config.offload_param != Tier::kDevice) {
    const FrozenResidency base = frozen_residency(config, e);
    const double fetched = 2.0 * accum * (work - base.frozen_bytes + base.refetched_bytes());
    st.transfer_ms += ms(2.0 * fetched, rates.memory_bytes);  // the copy to the device
    if (config.offload_param == Tier::kNvme) {
      const double cached = std::clamp((static_cast<double>(e.plan.peak(Tier::kHost)) -
                                        static_cast<double>(e.plan.tier_bytes(Tier::kHost))) /
                                           std::max(work, 1.0),
                                       0.0, 1.0);
      st.transfer_ms += ms(fetched * (1.0 - cached), rates.nvme_read_bytes);
    }
  }
  // Gradients leave the device once per micro-batch (those of the offloaded groups:
  // offload_optimizer_fraction keeps the rest's there).
  const double offloaded = config.offload_optimizer != Tier::kDevice ? e.plan.offload_fraction : 0;
  if (config.offload_optimizer != Tier::kDevice) {
    st.transfer_ms += ms(2.0 * accum * offloaded * elems * dsize, rates.memory_bytes);
    if (e.plan.gradients == Tier::kNvme) {
      st.transfer_ms += ms(accum * offloaded * elems * dsize, rates.nvme_write_bytes);
    }
  }
  // The update reads and writes the master weights and both moments as the optimizer keeps them
  // (fp32: 12 bytes an element; optimizer.state_dtype and master_dtype shrink them), reads the
  // gradient and writes the new working copy.
  const double state_bytes =
      optim::state_bytes_per_param(config.optimizer.master_dtype, config.optimizer.master_rounding,
                                   config.optimizer.state_dtype);
  const double grad_bytes = e.plan.keep_gradients ? dsize : 4.0;
  // The offloaded share at the host's rate, and the groups the device keeps (fp32 sums) at the
  // device's, where measured (else the host's).
  const double host_elems = config.offload_optimizer != Tier::kDevice ? offloaded * elems : elems;
  st.optimizer_ms = ms(host_elems * (2 * state_bytes + grad_bytes + dsize), rates.memory_bytes);
  if (offloaded < 1.0 && config.offload_optimizer != Tier::kDevice) {
    st.device_optimizer_ms =
        ms((elems - host_elems) * (2 * state_bytes + 4.0 + dsize),
           rates.device_memory_bytes.per_s > 0 ? rates.device_memory_bytes : rates.memory_bytes);
  }
  if (config.offload_optimizer == Tier::kNvme) {
    double read = host_elems * state_bytes, write = host_elems * state_bytes;
    if (e.plan.gradients == Tier::kNvme) read += host_elems * grad_bytes;
    if (config.offload_param == Tier::kNvme) write += host_elems * dsize;
    // Reads and writes in turn at their own rates, or at once at the mixed rate where recorded.
    const double streamed =
        rates.nvme_mixed_bytes.measured
            ? ms(std::max(read, write), rates.nvme_mixed_bytes)
            : ms(read, rates.nvme_read_bytes) + ms(write, rates.nvme_write_bytes);
    st.optimizer_ms = std::max(st.optimizer_ms, streamed);
  }
  // ZeRO's collectives and the pipeline's steady sends share the links; they run beside compute.
  st.comm_ms = zero_comm_ms(config, static_cast<double>(e.parameters), e.ranks, rates) +
               pipeline_traffic_ms(config, e.ranks, rates);
  st.tensor_ms = tensor_parallel_ms(config, e.ranks, rates);
  st.expert_ms = expert_parallel_ms(config, e.ranks, rates);
  // Pipeline stages: the work above is the average stage's; the costliest stage's, stretched by
  // the fill and drain, sets the step, and the first micro-batch's activations cross every
  // boundary forward and its gradients back before the pipeline is full and after it drains.
  const double stretch = config.pipeline_stretch(data_ranks_of(config, e.ranks));
  st.bubble_ms = (st.compute_ms + st.tensor_ms) * (stretch - 1.0);
  st.boundary_ms = pipeline_boundary_ms(config, e.ranks, rates);
  const double critical =
      st.compute_ms + st.tensor_ms + st.expert_ms + st.bubble_ms + st.boundary_ms;
  st.serial_ms =
      std::max({critical, st.transfer_ms, st.comm_ms}) + st.optimizer_ms + st.device_optimizer_ms;
  if (e.plan.overlap == zero::OptimizerOverlap::kNone) {
    st.step_ms = st.serial_ms;
    st.schedule = "serial";
  } else {
    st.overlapped_ms =
        std::max({critical, st.transfer_ms + st.optimizer_ms, st.comm_ms}) + st.device_optimizer_ms;
    st.step_ms =
        e.plan.measure_overlap ? std::min(st.overlapped_ms, st.serial_ms) : st.overlapped_ms;
    st.schedule =
        e.plan.measure_overlap ? "auto: the faster of serial and overlapped" : "overlapped";
  }
  return st;
}

}  // namespace

FrozenResidency frozen_residency(const TrainConfig& config, const Estimate& e) {
  FrozenResidency r;
  if (config.offload_param == Tier::kDevice) return r;
  const double work =
      static_cast<double>(e.plan.kind_bytes(config.offload_param, zero::TensorKind::kParameters));
  // The trained groups' copies share the tier where their optimizer is off the device (the
  // offloaded share of them: offload_optimizer_fraction keeps the rest on the device).
  const double trained = e.plan.trained_params == config.offload_param
                             ? static_cast<double>(e.trainable_local_elems) *
                                   e.plan.offload_fraction *
                                   static_cast<double>(dtype_size(config.precision))
                             : 0.0;
  r.frozen_bytes = std::max(0.0, work - trained);
  const std::uint64_t needed = e.device_bytes_needed() + config.prefetch_bytes;
  if (config.device_memory_limit > needed) {
    r.room_bytes = static_cast<double>(config.device_memory_limit - needed);
  }
  return r;
}

StepTime predict_step(const TrainConfig& config, const Estimate& e, const MachineRates& rates) {
  StepTime st = predict(config, e, rates);
  // The drive's rates as they swing: the step at its slowest and its fastest measured intervals.
  if (e.plan.tier_bytes(Tier::kNvme) == 0) return st;
  MachineRates slow = rates, fast = rates;
  bool spread = false;
  for (Rate MachineRates::*m : {&MachineRates::nvme_read_bytes, &MachineRates::nvme_write_bytes,
                                &MachineRates::nvme_mixed_bytes}) {
    if (!(rates.*m).has_spread()) continue;
    (slow.*m).per_s = (rates.*m).low_per_s;
    (fast.*m).per_s = (rates.*m).high_per_s;
    spread = true;
  }
  if (spread) {
    st.slowest_ms = predict(config, e, slow).step_ms;
    st.fastest_ms = predict(config, e, fast).step_ms;
  }
  return st;
}

Json StepTime::to_json() const {
  return Json{{"step_ms", step_ms},
              {"serial_ms", serial_ms},
              {"overlapped_ms", overlapped_ms},
              {"compute_ms", compute_ms},
              {"transfer_ms", transfer_ms},
              {"optimizer_ms", optimizer_ms},
              {"device_optimizer_ms", device_optimizer_ms},
              {"comm_ms", comm_ms},
              {"tensor_ms", tensor_ms},
              {"expert_ms", expert_ms},
              {"bubble_ms", bubble_ms},
              {"boundary_ms", boundary_ms},
              {"schedule", schedule},
              {"slowest_ms", slowest_ms},
              {"fastest_ms", fastest_ms}};
}

TrainConfig on_grid(const TrainConfig& config, int tensor, int pipeline, int expert) {
  TrainConfig c = config;
  c.tensor_parallel_size = tensor;
  c.pipeline_parallel_size = pipeline;
  c.expert_parallel_size = expert;
  c.pipeline_layers.clear();
  if (pipeline > 1 && config.pipeline_schedule == PipelineSchedule::kInterleaved) {
    c.virtual_stages = std::max(config.virtual_stages, 2);
  } else {
    c.pipeline_schedule = PipelineSchedule::k1F1B;
    c.virtual_stages = 1;
  }
  c.sequence_parallel = config.sequence_parallel && tensor > 1;
  c.parallelism_auto = false;
  return c;
}

TrainConfig GridChoice::applied_to(const TrainConfig& config) const {
  TrainConfig c = on_grid(config, tensor, pipeline, expert);
  c.offload_param = param;
  c.offload_optimizer = optimizer;
  c.offload_param_auto = c.offload_optimizer_auto = false;
  return c;
}

namespace {

// Every (tensor, pipeline) split of `ranks` the config's model and batch allow, data parallelism
// first (pipelines, then tensor splits, then both, each smallest first), and for a mixture of
// experts every expert-parallel size that divides the data-parallel ranks and the experts (the
// smallest first); `refused` names why a split that divides the ranks cannot run.
struct GridCandidate {
  int tensor, pipeline;
  std::string refused;
  int expert = 1;
};
std::vector<GridCandidate> grid_candidates(const TrainConfig& config, int ranks) {
  std::vector<GridCandidate> out;
  for (int tensor = 1; tensor <= ranks; ++tensor) {
    if (ranks % tensor != 0) continue;
    for (int pipeline = 1; pipeline <= ranks / tensor; ++pipeline) {
      if ((ranks / tensor) % pipeline != 0) continue;
      GridCandidate g{tensor, pipeline, ""};
      const int data = ranks / (tensor * pipeline);
      TrainConfig c = on_grid(config, tensor, pipeline);
      if (const auto p = model::tensor_parallel_problems(config.model, tensor);
          tensor > 1 && !p.empty()) {
        g.refused = p.front();
      } else if (config.ranks_per_node > 0 && tensor > config.ranks_per_node) {
        g.refused = "a tensor group stays inside a node (" + std::to_string(config.ranks_per_node) +
                    " rank(s), ranks_per_node)";
      } else if (tensor > 1 && config.sequence_parallel &&
                 (config.micro_batch_size * config.seq_len) % tensor != 0) {
        g.refused = "sequence parallelism needs the micro-batch's tokens split evenly";
      } else if (pipeline * c.virtual_stages > config.model.num_hidden_layers) {
        g.refused = "more stages than layers";
      } else if (Status s = c.resolve_batch(data); !s.is_ok()) {
        g.refused =
            "batch_size does not split over " + std::to_string(data) + " data-parallel ranks";
      } else if (pipeline > 1 &&
                 !pipeline_shape_problems(c.pipeline_schedule, c.pipeline_shape(data)).empty()) {
        g.refused = pipeline_shape_problems(c.pipeline_schedule, c.pipeline_shape(data)).front();
      }
      out.push_back(g);
      if (!g.refused.empty() || !config.model.has_moe()) continue;
      for (int expert = 2; expert <= data; ++expert) {
        if (data % expert != 0 || config.model.moe.num_experts % expert != 0) continue;
        g.expert = expert;
        out.push_back(g);
      }
    }
  }
  // Fewer splits first: a tie keeps the simpler grid.
  std::stable_sort(out.begin(), out.end(), [](const GridCandidate& a, const GridCandidate& b) {
    return std::tuple(a.tensor > 1, a.tensor * a.pipeline, a.expert) <
           std::tuple(b.tensor > 1, b.tensor * b.pipeline, b.expert);
  });
  return out;
}

std::string grid_name(int tensor, int pipeline, int data, int expert) {
  return "tensor " + std::to_string(tensor) + " x pipeline " + std::to_string(pipeline) +
         " x data " + std::to_string(data) +
         (expert > 1 ? " (experts over " + std::to_string(expert) + ")" : "");
}

}  // namespace

Result<GridChoice> choose_grid(const TrainConfig& config, int ranks, const MachineRates& rates) {
  std::optional<GridChoice> best;
  std::string others;
  const std::uint64_t swap_free = config.swap_paths.empty() ? 0 : swap_free_bytes(config, 0);
  for (const GridCandidate& g : grid_candidates(config, ranks)) {
    const int data = ranks / (g.tensor * g.pipeline);
    const std::string name = grid_name(g.tensor, g.pipeline, data, g.expert);
    if (!g.refused.empty()) {
      others += "; " + name + ": " + g.refused;
      continue;
    }
    TrainConfig c = on_grid(config, g.tensor, g.pipeline, g.expert);
    STRATA_RETURN_IF_ERROR(c.resolve_batch(data));  // checked in grid_candidates
    // The placement: the config's, or the fastest that fits rank 0 where it is left open.
    if (c.offload_param_auto || c.offload_optimizer_auto) {
      auto placed = choose_placement(c, ranks, rates);
      if (!placed.is_ok()) {
        others += "; " + name + ": no placement fits";
        continue;
      }
      c.offload_param = placed->param;
      c.offload_optimizer = placed->optimizer;
      c.offload_param_auto = c.offload_optimizer_auto = false;
    }
    // Every stage's first rank (stages differ: the embedding, the head, their layers).
    std::string refused;
    std::optional<Estimate> first;
    for (int stage = 0; stage < g.pipeline && refused.empty(); ++stage) {
      auto e = estimate(c, ranks, EstimateOptions{stage * g.tensor * data, true});
      if (!e.is_ok()) {
        refused = (g.pipeline > 1 ? "stage " + std::to_string(stage) + ": " : std::string()) +
                  e.status().message();
      } else if (config.device_memory_limit != 0 &&
                 e->device_bytes_needed() > config.device_memory_limit) {
        refused = "device " + format_bytes(e->device_bytes_needed()) + " > device_memory_limit " +
                  format_bytes(config.device_memory_limit) +
                  (g.pipeline > 1 ? " on stage " + std::to_string(stage) : "");
      } else if (swap_free != 0 && e->plan.tier_bytes(Tier::kNvme) > swap_free) {
        refused = "nvme " + format_bytes(e->plan.tier_bytes(Tier::kNvme)) + " > " +
                  format_bytes(swap_free) + " free in swap_paths";
      } else if (stage == 0) {
        first = std::move(*e);
      }
    }
    if (!refused.empty()) {
      others += "; " + name + ": " + refused;
      continue;
    }
    const StepTime st = predict_step(c, *first, rates);
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.3f s", st.step_ms / 1e3);
    if (best && st.step_ms >= best->step.step_ms) {
      others += "; " + name + ": " + buf;
      continue;
    }
    if (best) {
      others += "; " + grid_name(best->tensor, best->pipeline, best->data, best->expert) + ": " +
                best->why;
    }
    best = GridChoice{g.tensor, g.pipeline, data,    c.offload_param, c.offload_optimizer,
                      st,       buf,        g.expert};
  }
  if (!best) {
    return out_of_memory("no grid of " + std::to_string(ranks) + " ranks fits" +
                         (others.empty() ? "" : ":" + others.substr(1)));
  }
  best->why = grid_name(best->tensor, best->pipeline, best->data, best->expert) +
              " (offload_param " + std::string(zero::offload_name(best->param)) +
              ", offload_optimizer " + std::string(zero::offload_name(best->optimizer)) +
              "): predicted step " + best->why + ", the fastest that fits" +
              (others.empty() ? "" : " (" + others.substr(2) + ")");
  return *best;
}

}  // namespace strata::train
