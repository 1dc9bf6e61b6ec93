// LlamaModel: LlamaForCausalLM's training step over parameter groups from a ParamProvider, with
// activations in one device workspace per (batch, seq) shape: its shapes, workspace, layout and
// step. The stage's passes, the head and decoding live beside it (llama_impl.h).
#include "strata/model/llama.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "src/model/llama_impl.h"

namespace strata::model {
namespace {

const TensorSpec& tensor_in(const ParamLayout& layout, const std::string& name, int group) {
  const auto loc = layout.find(name);
  STRATA_CHECK(loc.has_value() && loc->group == group, "parameter missing from the layout", name,
               group);
  return *loc->tensor;
}

std::int64_t tensor_offset(const ParamLayout& layout, const std::string& name, int group) {
  return tensor_in(layout, name, group).offset_elems;
}

}  // namespace

Status LlamaModel::Impl::check_shape(std::int64_t batch, std::int64_t seq) const {
  if (batch <= 0 || seq <= 0) {
    return invalid_argument("micro-batch shape must be positive, got batch " +
                            std::to_string(batch) + " and seq " + std::to_string(seq));
  }
  if (seq > config_.max_position_embeddings) {
    return invalid_argument(
        "sequence length " + std::to_string(seq) + " exceeds max_position_embeddings " +
        std::to_string(config_.max_position_embeddings) + "; use a shorter seq_len");
  }
  if (const int t = options_.tensor_parallel.size;
      options_.sequence_parallel && (batch * seq) % t != 0) {
    return invalid_argument(
        "sequence parallelism over " + std::to_string(t) +
        " ranks needs a micro-batch whose batch * seq tokens they divide, got " +
        std::to_string(batch) + " x " + std::to_string(seq));
  }
  return Status::ok();
}

Status LlamaModel::Impl::check_tokens(const MicroBatch& mb) {
  if (mb.inputs == nullptr || mb.targets == nullptr) {
    return invalid_argument("inputs and targets must not be null");
  }
  num_valid_ = 0;
  const std::int64_t rows = mb.batch * mb.seq, vocab = config_.vocab_size;
  for (std::int64_t i = 0; i < rows; ++i) {
    if (mb.inputs[i] < 0 || mb.inputs[i] >= vocab) {
      return invalid_argument("input token " + std::to_string(mb.inputs[i]) + " at position " +
                              std::to_string(i) + " is outside the vocabulary [0, " +
                              std::to_string(vocab) + ")");
    }
    if (mb.targets[i] >= vocab) {
      return invalid_argument("target token " + std::to_string(mb.targets[i]) + " at position " +
                              std::to_string(i) + " is outside the vocabulary [0, " +
                              std::to_string(vocab) + "); negative targets are ignored");
    }
    if (mb.targets[i] >= 0) ++num_valid_;
  }
  return Status::ok();
}

// Asked of the provider every pass: it hands back the same memory while the shape is the same,
// and the layout is carved again only when the memory or the shape changed.
Status LlamaModel::Impl::ensure_workspace(ParamProvider& provider, std::int64_t batch,
                                          std::int64_t seq) {
  // What to ask for is measured once per shape: every pass asks again.
  if (ask_.batch != batch || ask_.seq != seq) {
    STRATA_RETURN_IF_ERROR(check_shape(batch, seq));
    const StageShape stage = StageShape::of(config_, options_);
    Workspace measure;
    std::string layers = std::to_string(config_.num_hidden_layers) + " layers";
    if (options_.pipeline.split()) {
      std::int64_t held = 0;
      for (const auto& [b, e] : stage.chunks) held += e - b;
      layers = std::to_string(held) + " layers of pipeline stage " +
               std::to_string(options_.pipeline.stage) + ", " + std::to_string(stage.in_flight) +
               " micro-batches in flight";
    }
    ask_ = {
        batch, seq,
        carve_workspace(BlockSetup::make(config_, options_, batch, seq), stage, nullptr, &measure),
        LlamaModel::host_io_bytes(config_, batch, seq, options_.tensor_parallel.size,
                                  stage.in_flight, options_.expert_parallel.size),
        "activations (batch " + std::to_string(batch) + ", seq " + std::to_string(seq) + ", " +
            layers + ", activation_checkpointing " + (stage.checkpointing ? "on" : "off") + ")"};
  }
  STRATA_ASSIGN_OR_RETURN(void* base, provider.workspace(ask_.bytes, ask_.what));
  // Asked every pass too: the provider hands back the same buffer while the size is the same.
  STRATA_ASSIGN_OR_RETURN(host_io_,
                          provider.host_io(ask_.host_io_bytes, "token ids, targets and losses"));
  if (base == workspace_ && batch == batch_ && seq == seq_) return Status::ok();
  workspace_ = base;
  setup_ = BlockSetup::make(config_, options_, batch, seq);
  carve_workspace(setup_, StageShape::of(config_, options_), static_cast<std::byte*>(base), &ws_);
  setup_.base.decoded = ws_.nf4_weight;
  batch_ = batch;
  seq_ = seq;
  slot_loss_.assign(ws_.slots.size(), 0.0f);
  if (config_.has_moe()) {
    // The routing's host side at the pinned buffer's end.
    const Dims& d = setup_.d;
    ws_.moe.place_host(static_cast<std::byte*>(host_io_) + ask_.host_io_bytes -
                           moe_host_bytes(config_, d.rows, d.expert_ranks),
                       d.rows, d.experts, d.experts_per_token, d.expert_ranks);
    setup_.moe.device = &device_;
    setup_.moe.scratch = ws_.moe;
    aux_.assign(ws_.slots.size(), detail::MoeAux{});
    for (auto& a : aux_) a.reset(d.experts);
  }
  return Status::ok();
}

// A pass's micro-batch, chunk and mode: its workspace ready, its slot and chunk the stage's.
Status LlamaModel::Impl::begin_pass(ParamProvider& provider, const MicroBatch& mb, int chunk,
                                    bool train) {
  train_ = train;
  dropout_key_ = mb.dropout_key;
  STRATA_RETURN_IF_ERROR(ensure_workspace(provider, mb.batch, mb.seq));
  STRATA_CHECK(mb.slot >= 0 && mb.slot < static_cast<int>(ws_.slots.size()) && chunk >= 0 &&
                   chunk < options_.pipeline.virtual_stages,
               "a micro-batch slot or chunk the stage does not have", mb.slot, chunk);
  return Status::ok();
}

Result<float> LlamaModel::Impl::step(ParamProvider& provider, const MicroBatch& mb, bool train,
                                     StepTimings& timings) {
  timings = StepTimings{};
  const int chunks = options_.pipeline.virtual_stages;
  STRATA_CHECK(!options_.pipeline.split(),
               "a pipeline stage runs forward_chunk and backward_chunk, not whole steps");
  for (int c = 0; c < chunks; ++c)
    STRATA_RETURN_IF_ERROR(forward_chunk(provider, mb, c, train, timings));
  if (train) {
    for (int c = chunks - 1; c >= 0; --c)
      STRATA_RETURN_IF_ERROR(backward_chunk(provider, mb, c, timings));
  }
  return slot_loss_[static_cast<std::size_t>(mb.slot)];
}

LlamaModel::LlamaModel(const LlamaConfig& config, const ParamLayout& layout, device::Device& device,
                       ModelOptions options)
    : config_(config), layout_(layout), device_(device), options_(options) {
  STRATA_CHECK(options_.compute_dtype == DType::kF32 || options_.compute_dtype == DType::kBF16 ||
                   options_.compute_dtype == DType::kF16,
               "compute_dtype must be f32, bf16 or f16, got", dtype_name(options_.compute_dtype));
  STRATA_CHECK(layout.has_adapters() == options_.lora.has_value(),
               "the layout's adapters do not match the model options", layout.has_adapters());
  STRATA_CHECK(layout.num_groups() >= (config.num_hidden_layers + 2) +
                                          (layout.has_adapters() ? config.num_hidden_layers : 0),
               "layout does not match the config", layout.num_groups(), config.num_hidden_layers);
  const PipelineStage& stage = options_.pipeline;
  STRATA_CHECK(layout.pipeline().stage == stage.stage && layout.pipeline().bounds == stage.bounds,
               "the layout is not of this pipeline stage", layout.pipeline().stage, stage.stage);
  // The stage's first layer: every stage holds one.
  const std::int64_t first_layer = stage.chunk_begin(0);
  STRATA_CHECK(config.num_hidden_layers == 0 ||
                   layout.group(layout.layer_group(static_cast<int>(first_layer))).quantized() ==
                       options_.nf4_base,
               "the layout's base format does not match ModelOptions::nf4_base", options_.nf4_base);
  const TensorParallel& split = options_.tensor_parallel;
  STRATA_CHECK(split.size == 1 || (options_.tensor_group != nullptr &&
                                   options_.tensor_group->size() == split.size &&
                                   options_.tensor_group->rank() == split.rank),
               "a split model needs the tensor group of its rank", split.size, split.rank);
  if (const TensorGroup* tp = options_.tensor_group; tp != nullptr && split.size > 1) {
    STRATA_CHECK(tp->kv_replicas() == kv_head_replicas(config.num_key_value_heads, tp->size()),
                 "the tensor group's kv replicas do not match the model", tp->kv_replicas(),
                 config.num_key_value_heads);
    const auto q =
        layout.find("model.layers." + std::to_string(first_layer) + ".self_attn.q_proj.weight");
    STRATA_CHECK(q && q->tensor->slice.parts == tp->size() && q->tensor->slice.index == tp->rank(),
                 "the layout is not this rank's tensor-parallel slice", tp->size(), tp->rank());
  }
  const ExpertSplit& experts = options_.expert_parallel;
  STRATA_CHECK(
      layout.expert_split().size == experts.size && layout.expert_split().rank == experts.rank,
      "the layout is not this rank's share of the experts", experts.size, experts.rank);
  STRATA_CHECK(!experts.split() || (options_.expert_group != nullptr &&
                                    options_.expert_group->size() == experts.size &&
                                    options_.expert_group->rank() == experts.rank),
               "experts shared out need the expert group of this rank", experts.size, experts.rank);
  impl_ = std::make_unique<Impl>(config_, layout_, device_, options_);
  // Every tensor is found by name in the group the layout put it in.
  const auto locate = [&](const std::string& name) {
    const auto loc = layout.find(name);
    STRATA_CHECK(loc.has_value(), "parameter missing from the layout", name);
    return *loc;
  };
  // A pipeline stage finds its own tensors only: the embedding on the first, the head on the
  // last, its chunks' layers.
  if (stage.holds_embedding()) {
    impl_->embed_offset_ = tensor_offset(layout, "model.embed_tokens.weight", layout.embed_group());
  }
  if (stage.holds_head()) {
    const auto norm = locate("model.norm.weight");
    impl_->norm_group_ = norm.group;
    impl_->norm_offset_ = norm.tensor->offset_elems;
    if (config.tie_word_embeddings) {
      // Cut into stages, the embedding lies on the first stage: the head reads a copy.
      impl_->lm_group_ = layout.embed_group();
      impl_->embedding_copy_ = stage.split();
      impl_->lm_offset_ = stage.split() ? 0 : impl_->embed_offset_;
    } else {
      const auto lm = locate("lm_head.weight");
      impl_->lm_group_ = lm.group;
      impl_->lm_offset_ = lm.tensor->offset_elems;
    }
  }
  impl_->blocks_.resize(static_cast<std::size_t>(config.num_hidden_layers));
  impl_->block_bytes_.resize(impl_->blocks_.size());
  if (layout.has_adapters()) {
    impl_->block_trained_.resize(impl_->blocks_.size());
    impl_->adapters_.resize(impl_->blocks_.size());
  }
  for (std::int64_t l = 0; l < config.num_hidden_layers; ++l) {
    if (!stage.holds_layer(l, config.num_hidden_layers)) continue;
    const auto li = static_cast<std::size_t>(l);
    const int g = layout.layer_group(static_cast<int>(l));
    const int ag = layout.adapter_group(static_cast<int>(l));
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const bool dense = !config.is_moe_layer(l);
    const std::string router = router_weight_name(config, l).substr(p.size());
    if (!dense) {
      // Every expert's group is laid out alike: the first one this rank holds (all of them
      // without expert parallelism) gives the offsets of every one.
      const int e0 = layout.first_held_expert();
      const ParamGroup& eg = layout.group(layout.expert_group(static_cast<int>(l), e0));
      const ExpertNames names = expert_weight_names(config, l, e0);
      const auto at = [&](const std::string& name, bool bytes) {
        const auto loc = locate(name);
        return bytes ? static_cast<std::int64_t>(
                           working_offset(eg, *loc.tensor, options_.compute_dtype))
                     : loc.tensor->offset_elems;
      };
      ExpertOffsets& x = impl_->experts_;
      for (const bool bytes : {true, false}) {
        (bytes ? x.bytes : x.elems) = detail::ExpertTensors<std::int64_t>{
            at(names.gate, bytes), at(names.up, bytes), at(names.down, bytes)};
      }
      x.work_bytes = working_bytes(eg, options_.compute_dtype);
      // With LoRA on the experts, their adapters' places in the first expert's adapter group.
      if (const int ag0 = layout.expert_adapter_group(static_cast<int>(l), e0); ag0 >= 0) {
        const ParamGroup& a = layout.group(ag0);
        x.work_bytes += working_bytes(a, options_.compute_dtype);
        const std::array<const std::string*, 3> projections{&names.gate, &names.up, &names.down};
        for (std::size_t i = 0; i < projections.size(); ++i) {
          const std::string& w = *projections[i];
          const std::string m = w.substr(0, w.size() - std::string_view(".weight").size());
          if (!layout.find(m + ".lora_A.weight")) continue;
          x.lora_a[i] = tensor_offset(layout, m + ".lora_A.weight", ag0);
          x.lora_b[i] = tensor_offset(layout, m + ".lora_B.weight", ag0);
        }
      }
    }
    // The offsets of the block's tensors that live in `group`, in elements or (bytes = true) in
    // the working copy's bytes; -1 for the others.
    const auto offsets = [&](int group, bool bytes) {
      auto off = [&](bool present, const char* suffix) -> std::int64_t {
        if (!present) return -1;
        const auto loc = locate(p + suffix);
        STRATA_CHECK(loc.group == g || loc.group == ag, "a block's tensor outside its groups",
                     loc.tensor->name, loc.group);
        if (loc.group != group) return -1;
        return bytes ? static_cast<std::int64_t>(
                           working_offset(layout.group(group), *loc.tensor, options_.compute_dtype))
                     : loc.tensor->offset_elems;
      };
      BlockOffsets o;
      o.ln1 = off(true, "input_layernorm.weight");
      o.wq = off(true, "self_attn.q_proj.weight");
      o.wk = off(true, "self_attn.k_proj.weight");
      o.wv = off(true, "self_attn.v_proj.weight");
      o.wo = off(true, "self_attn.o_proj.weight");
      o.ln2 = off(true, "post_attention_layernorm.weight");
      o.wg = off(dense, "mlp.gate_proj.weight");
      o.wu = off(dense, "mlp.up_proj.weight");
      o.wd = off(dense, "mlp.down_proj.weight");
      o.router = off(!dense, router.c_str());
      o.bq = off(config.qkv_bias, "self_attn.q_proj.bias");
      o.bk = off(config.qkv_bias, "self_attn.k_proj.bias");
      o.bv = off(config.qkv_bias, "self_attn.v_proj.bias");
      o.bo = off(config.o_bias, "self_attn.o_proj.bias");
      o.qn = off(config.qk_norm, "self_attn.q_norm.weight");
      o.kn = off(config.qk_norm, "self_attn.k_norm.weight");
      o.bg = off(config.mlp_bias, "mlp.gate_proj.bias");
      o.bu = off(config.mlp_bias, "mlp.up_proj.bias");
      o.bd = off(config.mlp_bias, "mlp.down_proj.bias");
      return o;
    };
    impl_->block_bytes_[li] = offsets(g, true);
    impl_->blocks_[li] = offsets(g, false);
    if (!layout.has_adapters()) continue;
    impl_->block_trained_[li] = offsets(ag, false);
    detail::LoraOffsets lo;
    for (int t = 0; t < kNumLoraTargets; ++t) {
      const auto target = static_cast<LoraTarget>(t);
      if (!options_.lora->has(target) || !in_layer_adapters(target, !dense)) continue;
      const std::string m = p + std::string(lora_module_path(target, config.family));
      lo.a[t] = tensor_offset(layout, m + ".lora_A.weight", ag);
      lo.b[t] = tensor_offset(layout, m + ".lora_B.weight", ag);
    }
    impl_->adapters_[li] = lo;
  }
}

LlamaModel::~LlamaModel() = default;

std::uint64_t LlamaModel::decode_bytes(std::int64_t max_positions, std::int64_t max_rows) const {
  DecodeWorkspace measure;
  return carve_decode(impl_->decode_setup(max_rows), config_.num_hidden_layers, max_positions,
                      nullptr, &measure);
}

Status LlamaModel::begin_decode(ParamProvider& provider, std::int64_t max_positions,
                                std::int64_t max_rows) {
  return impl_->begin_decode(provider, max_positions, max_rows);
}

Result<const float*> LlamaModel::decode(ParamProvider& provider, const std::int32_t* ids,
                                        std::int64_t n) {
  return impl_->decode(provider, ids, n);
}

std::int64_t LlamaModel::decoded_positions() const { return impl_->decoded_; }

Result<float> LlamaModel::forward_backward(ParamProvider& provider, const std::int32_t* inputs,
                                           const std::int32_t* targets, std::int64_t batch,
                                           std::int64_t seq, float grad_scale,
                                           std::uint64_t dropout_key) {
  return impl_->step(provider, MicroBatch{inputs, targets, batch, seq, grad_scale, dropout_key, 0},
                     true, timings_);
}

Result<float> LlamaModel::forward_loss(ParamProvider& provider, const std::int32_t* inputs,
                                       const std::int32_t* targets, std::int64_t batch,
                                       std::int64_t seq) {
  return impl_->step(provider, MicroBatch{inputs, targets, batch, seq, 1.0f, 0, 0}, false,
                     timings_);
}

Status LlamaModel::prepare(ParamProvider& provider, std::int64_t batch, std::int64_t seq) {
  return impl_->ensure_workspace(provider, batch, seq);
}

Status LlamaModel::forward_chunk(ParamProvider& provider, const MicroBatch& mb, int chunk,
                                 bool train) {
  timings_ = StepTimings{};
  return impl_->forward_chunk(provider, mb, chunk, train, timings_);
}

Status LlamaModel::backward_chunk(ParamProvider& provider, const MicroBatch& mb, int chunk) {
  timings_ = StepTimings{};
  return impl_->backward_chunk(provider, mb, chunk, timings_);
}

LlamaModel::Boundary LlamaModel::boundary(int slot, int chunk) const {
  const auto& slots = impl_->ws_.slots;
  STRATA_CHECK(slot >= 0 && static_cast<std::size_t>(slot) < slots.size() && chunk >= 0 &&
                   chunk < options_.pipeline.virtual_stages,
               "a boundary of a slot or chunk the stage does not have (prepare first)", slot,
               chunk);
  const auto& ch = slots[static_cast<std::size_t>(slot)].chunks[static_cast<std::size_t>(chunk)];
  const PipelineStage& stage = options_.pipeline;
  void* embedding_grad = nullptr;
  if (stage.first_chunk(chunk)) {
    embedding_grad = slots[static_cast<std::size_t>(slot)].embedding_grad;
  } else if (stage.last_chunk(chunk)) {
    embedding_grad = impl_->ws_.embedding_grad;
  }
  return {ch.xs.front(),
          ch.xs.back(),
          ch.dout,
          ch.din,
          impl_->setup_.split.local_rows * impl_->setup_.d.hidden,
          embedding_grad,
          ch.routing_in,
          ch.routing_out,
          ch.totals_in,
          ch.totals_out,
          ch.routing_in != nullptr || ch.routing_out != nullptr
              ? detail::MoeAux::bytes(impl_->setup_.d.experts)
              : 0};
}

bool LlamaModel::shares_embedding() const {
  const PipelineStage& stage = options_.pipeline;
  return config_.tie_word_embeddings && stage.split() &&
         (stage.holds_embedding() || stage.holds_head());
}

std::int64_t LlamaModel::embedding_elems() const {
  return BlockSetup::make(config_, options_, 1, 1).d.vocab * config_.hidden_size;
}

Result<const void*> LlamaModel::acquire_embedding(ParamProvider& provider) {
  STRATA_CHECK(options_.pipeline.holds_embedding(), "the embedding lies on the first stage",
               options_.pipeline.stage);
  STRATA_ASSIGN_OR_RETURN(const void* p, provider.acquire_params(layout_.embed_group()));
  return offset_ptr(p, impl_->embed_offset_, dtype_size(options_.compute_dtype));
}

void LlamaModel::release_embedding(ParamProvider& provider) {
  provider.release_params(layout_.embed_group());
}

void* LlamaModel::embedding_copy() const {
  STRATA_CHECK(impl_->ws_.embedding != nullptr,
               "the embedding's copy is the last stage's of a tied model cut into stages, after "
               "prepare",
               options_.pipeline.stage);
  return impl_->ws_.embedding;
}

float LlamaModel::loss(int slot) const {
  return impl_->slot_loss_.at(static_cast<std::size_t>(slot));
}

double LlamaModel::aux_loss(int slot) const {
  return impl_->aux_.empty() ? 0.0 : impl_->aux_.at(static_cast<std::size_t>(slot)).loss();
}

std::uint64_t LlamaModel::activation_bytes(std::int64_t batch, std::int64_t seq) const {
  return activation_bytes(config_, options_, batch, seq);
}

std::uint64_t LlamaModel::activation_bytes(const LlamaConfig& config, const ModelOptions& options,
                                           std::int64_t batch, std::int64_t seq) {
  Workspace measure;
  return carve_workspace(BlockSetup::make(config, options, batch, seq),
                         StageShape::of(config, options), nullptr, &measure);
}

std::uint64_t LlamaModel::head_bytes(const LlamaConfig& config, const ModelOptions& options,
                                     std::int64_t batch, std::int64_t seq) {
  const BlockSetup setup = BlockSetup::make(config, options, batch, seq);
  const Dims& d = setup.d;
  const TensorSplit& sp = setup.split;
  const auto u = [](std::int64_t n) { return static_cast<std::uint64_t>(n); };
  std::uint64_t bytes =
      u(d.rows * d.hidden + d.head_rows * d.vocab) * d.elem_bytes + u(d.rows + sp.local_rows) * 4;
  if (sp.split()) bytes += u(d.head_rows * (5 + 3 * sp.size)) * 4;
  return bytes;
}

std::uint64_t LlamaModel::checkpoint_bytes(const LlamaConfig& config, const ModelOptions& options,
                                           std::int64_t batch, std::int64_t seq) {
  if (!options.activation_checkpointing) return 0;
  const BlockSetup setup = BlockSetup::make(config, options, batch, seq);
  const Dims& d = setup.d;
  const TensorSplit& sp = setup.split;
  return static_cast<std::uint64_t>(sp.local_rows * d.hidden) * d.elem_bytes;
}

int LlamaModel::num_checkpoints(const LlamaConfig& config, const ModelOptions& options) {
  if (!options.activation_checkpointing) return 0;
  const StageShape stage = StageShape::of(config, options);
  return static_cast<int>(stage.in_flight * stage.inner_inputs());
}

std::uint64_t LlamaModel::host_io_bytes(const LlamaConfig& config, std::int64_t batch,
                                        std::int64_t seq, int tensor_parallel, int in_flight,
                                        int expert_parallel) {
  const std::int64_t split = tensor_parallel > 1 ? 3 * tensor_parallel + 2 : 0;
  return static_cast<std::uint64_t>(batch * seq * (3 * in_flight + split)) * 4 +
         moe_host_bytes(config, batch * seq, expert_parallel);
}

std::uint64_t moe_host_bytes(const LlamaConfig& config, std::int64_t rows,
                             std::int64_t expert_ranks) {
  return config.has_moe()
             ? detail::MoeScratch::host_bytes(rows, config.moe.num_experts,
                                              config.moe.experts_per_token, expert_ranks)
             : 0;
}

ExpertTraffic LlamaModel::take_expert_traffic() { return std::exchange(impl_->traffic_, {}); }

double LlamaModel::last_aux_loss() const {
  return impl_->aux_.empty() ? 0.0 : impl_->aux_[impl_->last_slot_].loss();
}

}  // namespace strata::model
