// Private to the model: LlamaModel's state and the pieces its files share (llama.cpp: shapes,
// workspace and step; llama_stage.cpp: a pipeline stage's chunk of layers forward and backward;
// llama_head.cpp: model.norm, lm_head and the loss; llama_decode.cpp: decoding with KV caches).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "src/model/llama_block.h"
#include "src/model/llama_workspace.h"
#include "src/model/vocab_parallel.h"
#include "strata/core/clock.h"
#include "strata/model/llama.h"

namespace strata::model {

using detail::BlockActs;
using detail::BlockGrads;
using detail::BlockOffsets;
using detail::BlockSetup;
using detail::BlockWeights;
using detail::ChunkSpace;
using detail::DecodeWorkspace;
using detail::Dims;
using detail::matmul;
using detail::offset_ptr;
using detail::SlotSpace;
using detail::StageShape;
using detail::TensorSplit;
using detail::Workspace;

// Provider calls, timed, with every held parameter group released if the step bails out.
class ProviderSession {
 public:
  ProviderSession(ParamProvider& provider, const ParamLayout& layout, StepTimings& timings)
      : provider_(provider), layout_(layout), timings_(timings) {}
  ~ProviderSession() {
    for (int g : held_) provider_.release_params(g);
  }
  ProviderSession(const ProviderSession&) = delete;
  ProviderSession& operator=(const ProviderSession&) = delete;

  Result<const void*> acquire(int group) {
    Stopwatch sw;
    auto r = provider_.acquire_params(group);
    timings_.wait_params_ms += sw.elapsed_ms();
    if (!r.is_ok()) return r.status().with_context("acquiring parameters of " + name(group));
    held_.push_back(group);
    return r;
  }
  void release(int group) {
    auto it = std::find(held_.begin(), held_.end(), group);
    STRATA_CHECK(it != held_.end(), "releasing a parameter group that is not held", group);
    held_.erase(it);
    provider_.release_params(group);
  }
  void prefetch(int group) { provider_.prefetch_params(group); }
  Status sum_expert_rows(std::vector<double>& rows, const std::string& what) {
    return provider_.sum_expert_rows(rows, what);
  }
  bool acquire_is_collective(int group) const { return provider_.acquire_is_collective(group); }
  Result<void*> acquire_grads(int group, GradientWrite write) {
    Stopwatch sw;
    auto r = provider_.acquire_grads(group, write);
    timings_.wait_params_ms += sw.elapsed_ms();
    if (!r.is_ok()) return r.status().with_context("acquiring gradients of " + name(group));
    return r;
  }
  Status release_grads(int group) {
    Stopwatch sw;
    Status s = provider_.release_grads(group);
    timings_.wait_params_ms += sw.elapsed_ms();
    if (!s.is_ok()) return s.with_context("releasing gradients of " + name(group));
    return s;
  }

 private:
  std::string name(int group) const {
    return "parameter group '" + layout_.group(group).name + "'";
  }

  ParamProvider& provider_;
  const ParamLayout& layout_;
  StepTimings& timings_;
  std::vector<int> held_;
};

// The pinned host bytes an MoE model's routing needs for `rows` token rows (0 without MoE).
std::uint64_t moe_host_bytes(const LlamaConfig& config, std::int64_t rows,
                             std::int64_t expert_ranks = 1);

// Where an expert's tensors lie, the same in every expert of the model: its projections in its
// working copy (bytes) and in its gradients (elements); with LoRA on the experts, each
// projection's adapter in the expert's adapter group (elements, gate/up/down; -1 where none); and
// the working-copy bytes of the expert and its adapters.
struct ExpertOffsets {
  detail::ExpertTensors<std::int64_t> bytes, elems;
  std::array<std::int64_t, 3> lora_a{-1, -1, -1}, lora_b{-1, -1, -1};
  std::uint64_t work_bytes = 0;
};

// One MoE layer's experts, as its block asks for them: each expert's group, and its adapter
// group where it has one, through the session.
class LayerExperts final : public detail::ExpertSource {
 public:
  LayerExperts(ProviderSession& ps, const ParamLayout& layout, std::int64_t layer,
               const ExpertOffsets& at, std::size_t elem_bytes)
      : ps_(ps), layout_(layout), layer_(static_cast<int>(layer)), at_(at), eb_(elem_bytes) {}
  void prefetch(std::int64_t expert) override {
    ps_.prefetch(group(expert));
    if (adapted()) ps_.prefetch(adapter_group(expert));
  }
  Result<detail::ExpertWeights> acquire(std::int64_t expert) override {
    detail::ExpertWeights w;
    STRATA_ASSIGN_OR_RETURN(const void* p, ps_.acquire(group(expert)));
    w.w = {offset_ptr(p, at_.bytes.gate, 1), offset_ptr(p, at_.bytes.up, 1),
           offset_ptr(p, at_.bytes.down, 1)};
    if (adapted()) {
      STRATA_ASSIGN_OR_RETURN(const void* a, ps_.acquire(adapter_group(expert)));
      w.lora = adapters<const void*>(a);
    }
    return w;
  }
  void release(std::int64_t expert) override {
    ps_.release(group(expert));
    if (adapted()) ps_.release(adapter_group(expert));
  }
  bool trains() const override { return adapted() || !layout_.group(group(0)).frozen; }
  Result<detail::ExpertGrads> acquire_grads(std::int64_t expert, bool computes) override {
    detail::ExpertGrads g;
    if (!layout_.group(group(expert)).frozen) {
      // An expert's three products write its whole gradient (Linear::writes_grads).
      STRATA_ASSIGN_OR_RETURN(
          void* p,
          ps_.acquire_grads(group(expert), computes ? GradientWrite::kWrite : GradientWrite::kAdd));
      g.w = {offset_ptr(p, at_.elems.gate, eb_), offset_ptr(p, at_.elems.up, eb_),
             offset_ptr(p, at_.elems.down, eb_)};
    }
    if (adapted()) {
      STRATA_ASSIGN_OR_RETURN(void* a,
                              ps_.acquire_grads(adapter_group(expert), GradientWrite::kAdd));
      g.lora = adapters<void*>(a);
    }
    return g;
  }
  Status release_grads(std::int64_t expert) override {
    if (!layout_.group(group(expert)).frozen) {
      STRATA_RETURN_IF_ERROR(ps_.release_grads(group(expert)));
    }
    return adapted() ? ps_.release_grads(adapter_group(expert)) : Status::ok();
  }
  Status sum_rows(std::vector<double>& rows) override {
    return ps_.sum_expert_rows(rows, "layer " + std::to_string(layer_));
  }
  std::uint64_t bytes() const override { return at_.work_bytes; }
  bool gathers(std::int64_t expert) const override {
    return ps_.acquire_is_collective(group(expert)) ||
           (adapted() && ps_.acquire_is_collective(adapter_group(expert)));
  }

 private:
  int group(std::int64_t expert) const {
    return layout_.expert_group(layer_, static_cast<int>(expert));
  }
  int adapter_group(std::int64_t expert) const {
    return layout_.expert_adapter_group(layer_, static_cast<int>(expert));
  }
  bool adapted() const { return layout_.expert_adapter_group(layer_, 0) >= 0; }
  // The adapters' views in an adapter group's working copy or gradient at `base`.
  template <typename Ptr>
  detail::ExpertTensors<detail::LoraPair<Ptr>> adapters(Ptr base) const {
    const auto pair = [&](int i) {
      detail::LoraPair<Ptr> p;
      if (at_.lora_a[static_cast<std::size_t>(i)] < 0) return p;
      p.a = static_cast<Ptr>(offset_ptr(base, at_.lora_a[static_cast<std::size_t>(i)], eb_));
      p.b = static_cast<Ptr>(offset_ptr(base, at_.lora_b[static_cast<std::size_t>(i)], eb_));
      return p;
    };
    return {pair(0), pair(1), pair(2)};
  }
  ProviderSession& ps_;
  const ParamLayout& layout_;
  int layer_;
  const ExpertOffsets& at_;
  std::size_t eb_;
};

struct LlamaModel::Impl {
  Impl(const LlamaConfig& config, const ParamLayout& layout, device::Device& device,
       const ModelOptions& options)
      : config_(config), layout_(layout), device_(device), options_(options) {}

  Status check_shape(std::int64_t batch, std::int64_t seq) const;
  // The micro-batch's tokens: in the vocabulary; counts the targets that count (num_valid_).
  Status check_tokens(const MicroBatch& mb);
  // The workspace for this shape, from the provider (which owns it).
  Status ensure_workspace(ParamProvider& provider, std::int64_t batch, std::int64_t seq);
  Status begin_pass(ParamProvider& provider, const MicroBatch& mb, int chunk, bool train);
  Status forward_chunk(ParamProvider& provider, const MicroBatch& mb, int chunk, bool train,
                       StepTimings& timings);
  Status backward_chunk(ParamProvider& provider, const MicroBatch& mb, int chunk,
                        StepTimings& timings);
  // The head on the last virtual stage: model.norm, lm_head and the loss into slot_loss_, and,
  // training, their backward down to the gradient of the last chunk's output (ch.dout).
  Status head_forward_backward(ProviderSession& ps, const MicroBatch& mb, ChunkSpace& ch,
                               bool train);
  // MoE layers cut into stages: the slot's routing counts read from, or written to, a boundary's
  // device buffer (ChunkSpace::routing_in and the others).
  Status import_routing(int slot, const void* from);
  Status export_routing(int slot, void* to);
  Result<float> step(ParamProvider& provider, const MicroBatch& mb, bool train,
                     StepTimings& timings);
  Status begin_decode(ParamProvider& provider, std::int64_t max_positions, std::int64_t max_rows);
  Result<const float*> decode(ParamProvider& provider, const std::int32_t* ids, std::int64_t n);
  BlockSetup decode_setup(std::int64_t rows) const {
    BlockSetup b = BlockSetup::make(config_, options_, 1, rows);
    b.lora.dropout = 0;  // not training
    // A few rows at a time: every rank holds every row (no sequence parallelism).
    b.split.seq_parallel = false;
    b.split.local_rows = b.split.rows;
    b.split.row_begin = 0;
    return b;
  }
  DecodeWorkspace dws_;
  BlockSetup decode_setup_;
  std::int64_t decode_positions_ = 0, decode_rows_ = 0, decoded_ = 0;
  void* decode_io_ = nullptr;  // the provider's host_io: token ids in, logits out

  // Whether layer l's adapter group holds anything (an MoE layer whose only targets are its
  // experts' projections has an empty one: nothing to acquire).
  bool block_adapted(std::int64_t l) const {
    return layout_.has_adapters() &&
           layout_.group(layout_.adapter_group(static_cast<int>(l))).num_elems > 0;
  }
  // A block is its layer's group and, with LoRA, its adapter group, held together: layer l's
  // weights with its adapters attached, valid until release_block.
  Result<BlockWeights> acquire_block(ProviderSession& ps, std::int64_t l) const {
    const auto li = static_cast<std::size_t>(l);
    const std::size_t eb = dtype_size(options_.compute_dtype);
    STRATA_ASSIGN_OR_RETURN(const void* p, ps.acquire(layout_.layer_group(static_cast<int>(l))));
    BlockWeights w = BlockWeights::at(p, block_bytes_[li], 1);
    if (block_adapted(l)) {
      STRATA_ASSIGN_OR_RETURN(const void* a,
                              ps.acquire(layout_.adapter_group(static_cast<int>(l))));
      w.overlay(a, block_trained_[li], eb);
      w.attach_lora(a, adapters_[li], eb);
    }
    return w;
  }
  void release_block(ProviderSession& ps, std::int64_t l) const {
    ps.release(layout_.layer_group(static_cast<int>(l)));
    if (block_adapted(l)) ps.release(layout_.adapter_group(static_cast<int>(l)));
  }
  void prefetch_block(ProviderSession& ps, std::int64_t l) const {
    ps.prefetch(layout_.layer_group(static_cast<int>(l)));
    if (block_adapted(l)) ps.prefetch(layout_.adapter_group(static_cast<int>(l)));
  }

  // The model's two vocabulary-parallel ends over the current workspace.
  detail::VocabParallelEmbedding embedding() const {
    return {&setup_.split, setup_.d.vocab, setup_.d.hidden, setup_.d.dtype};
  }
  detail::VocabParallelCrossEntropy cross_entropy() const {
    // The host statistics sit in the pinned host buffer, after every slot's ids, targets and
    // losses.
    float* host =
        reinterpret_cast<float*>(static_cast<std::byte*>(host_io_) +
                                 12 * setup_.d.rows * static_cast<std::int64_t>(ws_.slots.size()));
    return {&setup_.split, &device_,     setup_.d.vocab, setup_.d.dtype,
            ws_.ce_local,  ws_.ce_stats, ws_.ce_rows,    host};
  }

  // The head: model.norm's weight and lm_head's (tied: the embedding), from one group or two,
  // or (tied, cut into stages) model.norm's group and the workspace's copy of the embedding.
  struct HeadWeights {
    const void* norm;
    const void* lm;
  };
  bool lm_group_apart() const { return !embedding_copy_ && lm_group_ != norm_group_; }
  Result<HeadWeights> acquire_head(ProviderSession& ps) const {
    const std::size_t eb = dtype_size(options_.compute_dtype);
    STRATA_ASSIGN_OR_RETURN(const void* n, ps.acquire(norm_group_));
    const void* lm = embedding_copy_ ? ws_.embedding : n;
    if (lm_group_apart()) {
      STRATA_ASSIGN_OR_RETURN(lm, ps.acquire(lm_group_));
    }
    return HeadWeights{offset_ptr(n, norm_offset_, eb), offset_ptr(lm, lm_offset_, eb)};
  }
  void release_head(ProviderSession& ps) const {
    ps.release(norm_group_);
    if (lm_group_apart()) ps.release(lm_group_);
  }
  void prefetch_head(ProviderSession& ps) const {
    ps.prefetch(norm_group_);
    if (lm_group_apart()) ps.prefetch(lm_group_);
  }

  // The micro-batch's dimensions with layer `layer`'s attention window and dropout masks; an MoE
  // layer's experts from `experts`, its load-balancing sums the slot's.
  BlockSetup setup_of(std::int64_t layer, int slot, detail::ExpertSource* experts) {
    BlockSetup b = setup_;
    b.d.window = config_.window_of(layer);
    b.lora.layer = layer;
    if (!train_) b.lora.dropout = 0;
    b.lora.key = dropout_key_;
    b.moe.source = experts;
    b.moe.aux = config_.has_moe() ? &aux_[static_cast<std::size_t>(slot)] : nullptr;
    b.moe.aux_grad = config_.moe.aux_loss && train_;
    b.moe.traffic = &traffic_;
    return b;
  }
  // Layer `layer`'s experts through `ps` (a dense layer's: never asked for).
  LayerExperts experts_of(ProviderSession& ps, std::int64_t layer) const {
    return LayerExperts(ps, layout_, layer, experts_, dtype_size(options_.compute_dtype));
  }
  // The chunk's layer `i` activations, its input at `x`.
  BlockActs acts_for(const ChunkSpace& ch, std::int64_t i, const void* x) const {
    BlockActs a =
        options_.activation_checkpointing ? ws_.shared : ch.acts[static_cast<std::size_t>(i)];
    a.x = const_cast<void*>(x);
    return a;
  }
  std::uint64_t checkpoint_bytes() const {
    return LlamaModel::checkpoint_bytes(config_, options_, batch_, seq_);
  }
  // The provider's number for layer `layer`'s checkpointed input in slot `slot`.
  int checkpoint_index(int slot, std::int64_t layer) const {
    return static_cast<int>(slot * (config_.num_hidden_layers + 1) + layer);
  }
  // Slot `slot`'s part of the pinned host buffer: its ids, targets (int32) and losses (f32).
  struct HostRows {
    std::int32_t* ids;
    std::int32_t* targets;
    float* losses;
  };
  HostRows host_rows(int slot) const {
    auto* base = static_cast<std::byte*>(host_io_) + 12 * setup_.d.rows * slot;
    return {reinterpret_cast<std::int32_t*>(base),
            reinterpret_cast<std::int32_t*>(base + 4 * setup_.d.rows),
            reinterpret_cast<float*>(base + 8 * setup_.d.rows)};
  }

  const LlamaConfig& config_;
  const ParamLayout& layout_;
  device::Device& device_;
  const ModelOptions& options_;

  std::int64_t embed_offset_ = 0;
  // model.norm's and the head's weight (tied: the embedding) and their groups, which may differ.
  int norm_group_ = 0, lm_group_ = 0;
  std::int64_t norm_offset_ = 0, lm_offset_ = 0;
  // Tied, cut into stages, on the last stage: the head's weight is the workspace's copy of the
  // embedding (offset 0), its gradient the workspace's too (lm_group_ says whether it trains).
  bool embedding_copy_ = false;
  std::vector<BlockOffsets> blocks_;       // in the layer's group, in elements: the gradients'
  std::vector<BlockOffsets> block_bytes_;  // the same in bytes: the working copies' views
  // With LoRA, per layer: the block's tensors in its adapter group (modules_to_save norms).
  std::vector<BlockOffsets> block_trained_;
  std::vector<detail::LoraOffsets> adapters_;  // per layer, with LoRA
  // Mixture of experts: where every expert's tensors lie; per slot, the micro-batch's
  // load-balancing sums.
  ExpertOffsets experts_;
  ExpertTraffic traffic_;  // since take_expert_traffic
  std::vector<detail::MoeAux> aux_;
  std::size_t last_slot_ = 0;  // the slot of the last micro-batch that ran the head
  bool train_ = false;         // this step runs backward (and dropout)
  std::uint64_t dropout_key_ = 0;

  std::int64_t batch_ = 0, seq_ = 0;  // shape of the current workspace
  // What ensure_workspace asks the provider for at shape (batch, seq), measured once per shape.
  struct WorkspaceAsk {
    std::int64_t batch = -1, seq = -1;  // none yet
    std::uint64_t bytes = 0, host_io_bytes = 0;
    std::string what;
  };
  WorkspaceAsk ask_;
  BlockSetup setup_;
  void* workspace_ = nullptr;  // the provider's; ws_ is carved from it
  Workspace ws_;
  // Pinned host side of the per-step copies: per slot, token ids, targets (int32) and losses
  // (f32), `rows` entries each (host_rows), then the cross-entropy statistics of a split model.
  void* host_io_ = nullptr;
  std::int64_t num_valid_ = 0;
  std::vector<float> slot_loss_;  // per slot, its micro-batch's mean loss (the last stage's)
  void* tied_grads_ = nullptr;    // tied: the embedding's gradient the head began
};

}  // namespace strata::model
