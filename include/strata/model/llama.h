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
#include "strata/model/model_options.h"
#include "strata/model/param_layout.h"
#include "strata/model/param_provider.h"
#include "strata/model/pipeline_stage.h"
#include "strata/model/tensor_group.h"

namespace strata::model {

struct StepTimings {
  double forward_ms = 0;
  double backward_ms = 0;
  double wait_params_ms = 0;  // time blocked in acquire_params / release_grads
};

// Mixture of experts, what the MoE layers did since the counts were last taken: per MoE layer
// and micro-batch, the experts some data-parallel rank's tokens chose (run) and those none chose
// (skipped: never fetched, never computed, their gradient zero); and the working-copy bytes of
// the experts acquired (forward, recomputed forward and backward), which an offloaded store
// fetches for them.
struct ExpertTraffic {
  std::int64_t run = 0, skipped = 0;
  std::uint64_t bytes = 0;
  ExpertTraffic& operator+=(const ExpertTraffic& o) {
    run += o.run;
    skipped += o.skipped;
    bytes += o.bytes;
    return *this;
  }
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

  // ---- One pipeline stage's passes (ModelOptions::pipeline; forward_backward is one stage's
  // forward_chunk then backward_chunk) ----
  struct MicroBatch {
    const std::int32_t* inputs = nullptr;   // host [batch * seq]
    const std::int32_t* targets = nullptr;  // host [batch * seq]; < 0 ignored
    std::int64_t batch = 0, seq = 0;
    float grad_scale = 1;  // the gradient is of (mean loss * grad_scale)
    std::uint64_t dropout_key = 0;
    // Which of the stage's PipelineStage::in_flight activation sets the micro-batch uses, from
    // its first forward here until its last backward.
    int slot = 0;
  };
  // Makes the workspace of this shape (boundary() is valid after it).
  Status prepare(ParamProvider& provider, std::int64_t batch, std::int64_t seq);
  // Chunk `chunk`'s layers forward: on the first virtual stage after the embedding of
  // mb.inputs, else from what boundary().input holds (the previous virtual stage's output). On
  // the last virtual stage the head and the loss follow (loss(slot)), and with `train` the head's
  // backward down to boundary().output_grad.
  Status forward_chunk(ParamProvider& provider, const MicroBatch& mb, int chunk, bool train);
  // Chunk `chunk`'s layers backward from boundary().output_grad (the next virtual stage's input
  // gradient, or the head's) to the gradient of the chunk's input: into the embedding's on the
  // first virtual stage, else into boundary().input_grad. Gradients go to the provider as in
  // forward_backward.
  Status backward_chunk(ParamProvider& provider, const MicroBatch& mb, int chunk);
  // Where a chunk's tensors crossing stages lie for slot `slot`: device buffers of `elems`
  // elements in the compute dtype ([local_rows, hidden]), valid until the next prepare.
  struct Boundary {
    void* input;         // the chunk's input: received before forward_chunk
    const void* output;  // its output: to send after forward_chunk
    void* output_grad;   // its output's gradient: received before backward_chunk
    const void*
        input_grad;  // its input's gradient: to send after backward_chunk (null on the first)
    std::int64_t elems;
    // Tied embeddings cut into stages, where the embedding trains: the head's part of the
    // micro-batch's embedding gradient ([vocab rows of this rank, hidden], embedding_elems()),
    // sent to the first stage after the last virtual stage's forward_chunk and received there
    // before the first virtual stage's backward_chunk, where the lookup's part adds to it (the
    // sum one stage makes, in its order). Null on other chunks.
    void* embedding_grad;
    // MoE layers cut into stages: the micro-batch's routing counts so far (device buffers of
    // routing_bytes), received into routing_in with the input and sent from routing_out with the
    // output; the load-balancing loss needs every layer's, so the last virtual stage's totals go
    // back, received into totals_in with the output's gradient and sent from totals_out with the
    // input's. Null where the chunk has no such neighbour, and without MoE layers (0 bytes).
    void* routing_in;
    const void* routing_out;
    void* totals_in;
    const void* totals_out;
    std::size_t routing_bytes;
  };
  Boundary boundary(int slot, int chunk) const;
  // Tied embeddings cut into stages (tie_word_embeddings with P > 1): the last stage's head
  // reads its own copy of the embedding, which the first stage sends it whenever the embedding
  // may have changed. True on those two stages.
  bool shares_embedding() const;
  std::int64_t embedding_elems() const;  // this rank's vocabulary rows x hidden
  // The first stage's embedding working copy to send: valid until release_embedding.
  Result<const void*> acquire_embedding(ParamProvider& provider);
  void release_embedding(ParamProvider& provider);
  // The last stage's copy to receive it into (in the workspace: after prepare).
  void* embedding_copy() const;
  // The mean loss of the micro-batch in `slot`, after the last virtual stage's forward_chunk.
  float loss(int slot) const;
  // Its load-balancing loss over every MoE layer (as last_aux_loss), there too.
  double aux_loss(int slot) const;

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
  // Bytes of the head's own buffers (the final norm's output, the logits of a chunk of tokens,
  // the losses, and the vocabulary-parallel statistics of a split model) for (batch, seq).
  static std::uint64_t head_bytes(const LlamaConfig& config, const ModelOptions& options,
                                  std::int64_t batch, std::int64_t seq);
  // With activation_checkpointing, the bytes of each checkpointed activation
  // (ParamProvider::write_activation: a [batch * seq, hidden] tensor in the compute dtype); 0
  // without.
  static std::uint64_t checkpoint_bytes(const LlamaConfig& config, const ModelOptions& options,
                                        std::int64_t batch, std::int64_t seq);
  // How many checkpointed activations the provider holds at most: the input of every layer but
  // each chunk's first (which, like a chunk's output, stays in the workspace), for each
  // micro-batch in flight; 0 without.
  static int num_checkpoints(const LlamaConfig& config, const ModelOptions& options);
  // Bytes of the pinned host buffer a training step asks for (ParamProvider::host_io): token
  // ids, targets and losses, an int32 or f32 each per token and micro-batch in flight; split over
  // `tensor_parallel` ranks, the ranks' cross-entropy statistics too (3 per rank and 2 more f32
  // per token); with MoE layers, the routing read back (moe_host_bytes), and over
  // `expert_parallel` ranks the permutations of the rows that travel.
  static std::uint64_t host_io_bytes(const LlamaConfig& config, std::int64_t batch,
                                     std::int64_t seq, int tensor_parallel = 1, int in_flight = 1,
                                     int expert_parallel = 1);
  // The load-balancing loss (transformers' load_balancing_loss_func over the MoE layers, before
  // router_aux_loss_coef) of the last micro-batch that ran the head; 0 without MoE layers. The
  // training loss adds it times router_aux_loss_coef when output_router_logits is set.
  double last_aux_loss() const;
  // The experts' traffic since the last call (zero without MoE layers); resets it.
  ExpertTraffic take_expert_traffic();

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
