// Private to the model: the device workspace of a LlamaModel, carved from one buffer the
// provider owns: per micro-batch slot and chunk of layers their activations, the head's buffers,
// the backward's scratch; and the decoding workspace (KV caches, one block's activations).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

#include "src/model/llama_block.h"
#include "strata/core/aligned.h"
#include "strata/model/llama.h"

namespace strata::model::detail {

constexpr std::size_t kAlignBytes = 256;

// One chunk of layers' activations of one micro-batch (all device pointers): the inputs of its
// layers and their activations, and the gradients crossing its ends. The chunk's input and output
// are always the workspace's (they cross pipeline stages); checkpointed, the inner layers' inputs
// are the provider's (ParamProvider::write_activation), null here. Under sequence parallelism
// they hold this rank's local_rows.
struct ChunkSpace {
  std::int64_t begin = 0, end = 0;  // its layers
  std::vector<void*> xs;            // end - begin + 1 of [rows, hidden]: xs[i] is layer begin+i's
  std::vector<BlockActs> acts;      // per layer, unless checkpointing
  void* dout = nullptr;  // [rows, hidden]: the output's gradient (received, or the head's)
  void* din = nullptr;   // [rows, hidden]: the input's gradient, to send (not on virtual stage 0)
  // MoE layers cut into stages: the micro-batch's routing counts (MoeAux::bytes), received with
  // the input and sent with the output (the sums so far), and the totals received with the
  // output's gradient and sent with the input's (null where the chunk has no such neighbour).
  void* routing_in = nullptr;
  void* routing_out = nullptr;
  void* totals_in = nullptr;
  void* totals_out = nullptr;
};

// One micro-batch in flight: its tokens and every chunk's activations.
struct SlotSpace {
  std::int32_t* ids = nullptr;      // [rows]: on the stage holding the embedding
  std::int32_t* targets = nullptr;  // [rows]: on the stage holding the head
  std::vector<ChunkSpace> chunks;
  // Tied embeddings cut into stages, on the first: the head's part of the micro-batch's embedding
  // gradient, received from the last stage ([vocab, hidden]).
  void* embedding_grad = nullptr;
};

// The stage's workspace: `in_flight` micro-batches' activations and the scratch they share.
struct Workspace {
  std::vector<SlotSpace> slots;
  BlockActs shared;             // checkpointing: the one set of activations every layer recomputes
  void* partial = nullptr;      // sequence parallelism: [rows, hidden] before a reduce-scatter
  float* rstd_final = nullptr;  // [rows]                      (the head's, on the last stage)
  void* hf = nullptr;           // [rows, hidden] model.norm output
  void* logits = nullptr;       // [head_rows, vocab], overwritten by dlogits in training
  float* losses = nullptr;      // [rows]
  void* nf4_weight = nullptr;   // [max_weight] with an NF4 base: one decoded weight
  // Tensor parallelism: each rank's cross-entropy statistics [size, head_rows, 3] (all
  // gathered) and the whole vocabulary's row maximum and sum [2, head_rows].
  float* ce_local = nullptr;  // [head_rows, 3]: this rank's
  float* ce_stats = nullptr;
  float* ce_rows = nullptr;
  // Tied embeddings cut into stages, on the last: the copy of the embedding the head reads and
  // the head's part of the embedding gradient, to send ([vocab, hidden] each).
  void* embedding = nullptr;
  void* embedding_grad = nullptr;
  detail::BackwardScratch bwd;
  // Mixture of experts: the scratch the MoE layers share (its host part is the model's pinned
  // host buffer's), and each kept set of activations' expert offsets (host).
  MoeScratch moe;
  std::deque<std::vector<std::int64_t>> moe_offsets;
};

// Lays buffers out one after another from `base`, each aligned; with base == nullptr it only
// measures, so a workspace's size and its layout come from the same code.
struct Carver {
  std::byte* base = nullptr;
  std::uint64_t off = 0;
  void* take(std::int64_t elems, std::size_t elem_bytes) {
    off = align_up(off, kAlignBytes);
    void* p = base == nullptr ? nullptr : base + off;
    off += static_cast<std::uint64_t>(elems) * elem_bytes;
    return p;
  }
  float* f32(std::int64_t n) { return static_cast<float*>(take(n, 4)); }
  std::int32_t* i32(std::int64_t n) { return static_cast<std::int32_t*>(take(n, 4)); }
};

// What a stage's workspace holds: its chunks' layers, whether it embeds and runs the head, and how
// many micro-batches' activations it keeps at once.
struct StageShape {
  std::vector<std::pair<std::int64_t, std::int64_t>> chunks;  // [begin, end) layers
  bool embeds = true, heads = true;
  int in_flight = 1;
  bool checkpointing = false;
  // Tied embeddings cut into stages: the head reads a copy of the embedding (the last stage), and
  // the head's part of the embedding gradient crosses from the last stage to the first (where the
  // embedding trains).
  bool embedding_copy = false, embedding_grads = false;
  // MoE layers cut into stages: the bytes of a micro-batch's routing counts (MoeAux::bytes) that
  // cross with the activations; 0 otherwise.
  std::size_t routing_bytes = 0;

  static StageShape of(const LlamaConfig& config, const ModelOptions& options) {
    const PipelineStage& p = options.pipeline;
    StageShape s;
    for (int c = 0; c < p.virtual_stages; ++c) {
      s.chunks.emplace_back(p.chunk_begin(c), p.chunk_end(c, config.num_hidden_layers));
    }
    s.embeds = p.holds_embedding();
    s.heads = p.holds_head();
    s.in_flight = std::max(1, p.in_flight);
    s.checkpointing = options.activation_checkpointing;
    const bool tied = config.tie_word_embeddings && p.split();
    const bool embedding_trains = !options.lora || options.lora->saves("model.embed_tokens");
    s.embedding_copy = tied && s.heads;
    s.embedding_grads = tied && embedding_trains;
    if (config.has_moe() && p.split()) s.routing_bytes = MoeAux::bytes(config.moe.num_experts);
    return s;
  }
  // Checkpointed layer inputs a micro-batch writes: each chunk's but its first layer's.
  std::int64_t inner_inputs() const {
    std::int64_t n = 0;
    for (const auto& [b, e] : chunks) n += e - b - 1;
    return n;
  }
};

// The decoding workspace: the KV caches of every layer and one block's activations for up to
// `rows` tokens at a time.
struct DecodeWorkspace {
  std::int32_t* ids = nullptr;          // [rows]
  std::vector<void*> k_cache, v_cache;  // per layer, [positions, kv_dim]
  void* xs[2] = {nullptr, nullptr};     // [rows, hidden]: block input and output, alternating
  detail::DecodeActs acts;
  void* nf4_weight = nullptr;         // [max_weight] with an NF4 base: one decoded weight
  float* rstd_final = nullptr;        // [1]
  void* hf = nullptr;                 // [hidden]: model.norm of the last row
  void* logits = nullptr;             // [vocab], compute dtype: this rank's slice
  float* logits_f32 = nullptr;        // [vocab x tensor ranks]: the whole vocabulary's
  float* logits_local_f32 = nullptr;  // [vocab] split: this rank's slice before the all-gather
  MoeScratch moe;                     // mixture of experts (host: the decoding's pinned buffer)
  std::vector<std::int64_t> moe_offsets;
};

// Lays the workspace out from `base`; with base == nullptr it only measures. Returns the bytes
// needed, so activation_bytes() and the allocation can never disagree.
std::uint64_t carve_workspace(const BlockSetup& setup, const StageShape& stage, std::byte* base,
                              Workspace* ws);
// The decoding workspace for `num_layers` layers' caches of `positions` positions.
std::uint64_t carve_decode(const BlockSetup& setup, std::int64_t num_layers, std::int64_t positions,
                           std::byte* base, DecodeWorkspace* ws);

}  // namespace strata::model::detail
