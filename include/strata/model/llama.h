// The LLaMA decoder's forward and hand-written backward through the device op table.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>

#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/device/device.h"
#include "strata/model/llama_config.h"
#include "strata/model/lora.h"
#include "strata/model/param_layout.h"
#include "strata/model/param_provider.h"
#include "strata/model/tensor_group.h"

namespace strata::model {

struct ModelOptions {
  DType compute_dtype = DType::kF32;      // f32 or bf16: weights, activations and gradients
  bool activation_checkpointing = false;  // keep only each block's input; recompute in backward
  // LoRA adapters on a frozen base: the layout must be ParamLayout::build(config, lora, nf4_base).
  std::optional<LoraConfig> lora;
  // QLoRA: the base's projection weights are NF4 (TensorFormat::kNf4), decoded one at a time
  // into workspace before each product.
  bool nf4_base = false;
  // Tensor parallelism: this rank's slices of every layer (the layout must be
  // ParamLayout::build(..., tensor_parallel)), and the group they run over (size and rank the
  // same; only sizes, as for activation_bytes, need none). Column-parallel products' input
  // gradients and row-parallel products' outputs are summed over it, the embedding and the
  // cross-entropy are vocabulary-parallel (the logits never whole).
  TensorParallel tensor_parallel{};
  TensorGroup* tensor_group = nullptr;
  // Megatron's sequence parallelism (a split only): the residual stream, the norms and their
  // activations hold this rank's rows (batch * seq / size of them, which it must divide);
  // all-gathers before the column-parallel products and reduce-scatters after the row-parallel
  // ones take the place of the all-reduces, and the norms' weight gradients are summed.
  bool sequence_parallel = false;
};

struct StepTimings {
  double forward_ms = 0;
  double backward_ms = 0;
  double wait_params_ms = 0;  // time blocked in acquire_params / release_grads
};

class LlamaModel {
 public:
  LlamaModel(const LlamaConfig& config, const ParamLayout& layout, device::Device& device,
             ModelOptions options);
  ~LlamaModel();
  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;

  // Forward and backward on one micro-batch. inputs/targets: host int32 [batch * seq]; a target
  // < 0 is ignored. Returns the mean cross-entropy over valid targets. Gradients of
  // (mean loss * grad_scale) are accumulated through provider.acquire_grads/release_grads for
  // every group that trains (frozen groups get none: their weight-gradient products are
  // skipped). Activation memory comes from the device budget (out_of_memory if it does not fit).
  // dropout_key: the micro-batch's adapter dropout masks (lora dropout > 0; lora_dropout_key).
  Result<float> forward_backward(ParamProvider& provider, const std::int32_t* inputs,
                                 const std::int32_t* targets, std::int64_t batch, std::int64_t seq,
                                 float grad_scale, std::uint64_t dropout_key = 0);
  // Forward only (no dropout); returns the mean loss.
  Result<float> forward_loss(ParamProvider& provider, const std::int32_t* inputs,
                             const std::int32_t* targets, std::int64_t batch, std::int64_t seq);

  // Decoding one sequence with a KV cache. begin_decode takes a workspace for up to
  // `max_positions` tokens (prompt and generated) fed `max_rows` at a time, and forgets any
  // earlier sequence; decode feeds the next `n` tokens (the prompt, then one at a time) and
  // returns the logits of the last one (host f32 [vocab], valid until the next call).
  Status begin_decode(ParamProvider& provider, std::int64_t max_positions, std::int64_t max_rows);
  Result<const float*> decode(ParamProvider& provider, const std::int32_t* ids, std::int64_t n);
  std::int64_t decoded_positions() const;
  // Device bytes begin_decode takes for that many positions and rows.
  std::uint64_t decode_bytes(std::int64_t max_positions, std::int64_t max_rows) const;

  // Bytes of activations and workspace this model asks of its provider's workspace for
  // (batch, seq): with activation_checkpointing, all but the checkpointed activations.
  std::uint64_t activation_bytes(std::int64_t batch, std::int64_t seq) const;
  // The same for a model not made (strata estimate): from its config and options alone.
  static std::uint64_t activation_bytes(const LlamaConfig& config, const ModelOptions& options,
                                        std::int64_t batch, std::int64_t seq);
  // With activation_checkpointing, the bytes of each checkpointed activation
  // (ParamProvider::write_activation: num_hidden_layers + 1 of them, each a [batch * seq, hidden]
  // tensor in the compute dtype); 0 without.
  static std::uint64_t checkpoint_bytes(const LlamaConfig& config, const ModelOptions& options,
                                        std::int64_t batch, std::int64_t seq);
  // How many checkpointed activations a step writes: num_hidden_layers + 1, or 0 without.
  static int num_checkpoints(const LlamaConfig& config, const ModelOptions& options);
  // Bytes of the pinned host buffer a training step asks for (ParamProvider::host_io): token
  // ids, targets and losses, an int32 or f32 each per token; split over `tensor_parallel` ranks,
  // the ranks' cross-entropy statistics too (3 per rank and 2 more f32 per token).
  static std::uint64_t host_io_bytes(std::int64_t batch, std::int64_t seq, int tensor_parallel = 1);

  const StepTimings& last_timings() const { return timings_; }
  const LlamaConfig& config() const { return config_; }

 private:
  struct Impl;
  LlamaConfig config_;
  const ParamLayout& layout_;
  device::Device& device_;
  ModelOptions options_;
  StepTimings timings_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::model
