// The flat parameter layout and HF-style initialization.
#include "strata/model/param_layout.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <string>
#include <tuple>

#include "strata/core/check.h"
#include "strata/core/rng.h"
#include "strata/device/nf4.h"

namespace strata::model {
namespace {

// Adds a tensor of the full shape `shape`, of which the group holds `slice`.
void add_tensor(ParamGroup& g, std::string name, std::vector<std::int64_t> shape, TensorInit init,
                TensorSlice slice = {}) {
  TensorSpec t;
  t.name = std::move(name);
  t.shape = std::move(shape);
  t.slice = slice;
  if (slice.parts > 1) {
    const auto d = static_cast<std::size_t>(slice.dim);
    STRATA_CHECK(d < t.shape.size() && t.shape[d] % slice.parts == 0,
                 "a slice that does not divide", t.name, slice.dim, slice.parts);
    t.shape[d] /= slice.parts;
  }
  t.num_elems = 1;
  for (auto d : t.shape) t.num_elems *= d;
  t.offset_elems = g.num_elems;
  t.init = init;
  g.num_elems = (t.offset_elems + t.num_elems + kTensorAlignElems - 1) / kTensorAlignElems *
                kTensorAlignElems;
  g.tensors.push_back(std::move(t));
}

}  // namespace

std::vector<std::int64_t> TensorSpec::full_shape() const {
  std::vector<std::int64_t> full = shape;
  if (slice.parts > 1) full[static_cast<std::size_t>(slice.dim)] *= slice.parts;
  return full;
}

std::int64_t TensorSpec::full_elems() const { return num_elems * slice.parts; }

std::vector<std::string> tensor_parallel_problems(const LlamaConfig& c, int size) {
  std::vector<std::string> problems;
  if (size < 1) return {"tensor_parallel_size " + std::to_string(size) + " must be at least 1"};
  const std::string t = "tensor_parallel_size " + std::to_string(size);
  const auto must_divide = [&](std::int64_t n, const char* what) {
    if (n % size != 0) {
      problems.push_back(t + " must divide " + what + " (" + std::to_string(n) + ")");
    }
  };
  must_divide(c.num_attention_heads, "num_attention_heads");
  if (c.num_key_value_heads % size != 0 && size % c.num_key_value_heads != 0) {
    problems.push_back(t + " must divide num_key_value_heads (" +
                       std::to_string(c.num_key_value_heads) + ") or be a multiple of it");
  }
  must_divide(c.intermediate_size, "intermediate_size");
  must_divide(c.vocab_size, "vocab_size");
  return problems;
}

bool ParamGroup::quantized() const {
  return std::any_of(tensors.begin(), tensors.end(),
                     [](const TensorSpec& t) { return t.format != TensorFormat::kCompute; });
}

std::vector<std::pair<std::int64_t, std::int64_t>> ParamGroup::gaps(std::int64_t end) const {
  std::vector<std::pair<std::int64_t, std::int64_t>> covered;
  covered.reserve(tensors.size());
  for (const TensorSpec& t : tensors)
    covered.emplace_back(t.offset_elems, t.offset_elems + t.num_elems);
  std::sort(covered.begin(), covered.end());
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  std::int64_t at = 0;
  for (const auto& [first, last] : covered) {
    if (first > at) out.emplace_back(at, std::min(first, end));
    at = std::max(at, last);
    if (at >= end) return out;
  }
  if (at < end) out.emplace_back(at, end);
  return out;
}

namespace {

// Bytes of one tensor's working copy in a quantized group.
std::uint64_t quantized_tensor_bytes(const TensorSpec& t, DType dtype) {
  return t.format == TensorFormat::kNf4
             ? device::nf4_bytes(t.num_elems)
             : static_cast<std::uint64_t>(t.num_elems) * dtype_size(dtype);
}

std::uint64_t align_quantized(std::uint64_t bytes) {
  return (bytes + kQuantizedAlignBytes - 1) / kQuantizedAlignBytes * kQuantizedAlignBytes;
}

}  // namespace

std::uint64_t working_bytes(const ParamGroup& group, DType dtype) {
  if (!group.quantized()) return static_cast<std::uint64_t>(group.num_elems) * dtype_size(dtype);
  std::uint64_t end = 0;
  for (const auto& t : group.tensors) end = align_quantized(end) + quantized_tensor_bytes(t, dtype);
  return align_quantized(end);
}

std::uint64_t working_offset(const ParamGroup& group, const TensorSpec& tensor, DType dtype) {
  if (!group.quantized()) {
    return static_cast<std::uint64_t>(tensor.offset_elems) * dtype_size(dtype);
  }
  std::uint64_t at = 0;
  for (const auto& t : group.tensors) {
    at = align_quantized(at);
    if (&t == &tensor) return at;
    at += quantized_tensor_bytes(t, dtype);
  }
  STRATA_CHECK(false, "tensor not in its group", tensor.name, group.name);
  return 0;
}

ParamLayout ParamLayout::build(const LlamaConfig& c, const std::optional<LoraConfig>& lora,
                               bool nf4_base, TensorParallel tp, const PipelineStage& stage,
                               ExpertSplit experts) {
  STRATA_CHECK(!nf4_base || lora.has_value(), "an NF4 base needs adapters (QLoRA)");
  STRATA_CHECK(tp.rank >= 0 && tp.rank < tp.size && tensor_parallel_problems(c, tp.size).empty(),
               "a tensor-parallel split the config does not allow", tp.size, tp.rank);
  // Column-parallel (rows) and row-parallel (columns) slices of this rank; k and v split by kv
  // heads, or whole on size / kv_heads ranks each.
  const TensorSlice rows{0, tp.size, tp.rank}, cols{1, tp.size, tp.rank};
  const int kv_replicas = kv_head_replicas(c.num_key_value_heads, tp.size);
  const TensorSlice kv_rows{0, tp.size / kv_replicas, tp.rank / kv_replicas};
  ParamLayout layout;
  constexpr auto kNormal = TensorInit::kNormal, kOnes = TensorInit::kOnes;
  const std::int64_t h = c.hidden_size, q = c.q_dim(), kv = c.kv_dim();
  const std::int64_t ffn = c.intermediate_size;
  // Whether the tensor `name` (a module's ".weight") trains beside the adapters.
  const auto saved = [&](const std::string& name) {
    constexpr std::string_view kWeight = ".weight";
    return lora && name.ends_with(kWeight) &&
           lora->saves(std::string_view(name).substr(0, name.size() - kWeight.size()));
  };

  ParamGroup embed;
  embed.name = "embed";
  add_tensor(embed, "model.embed_tokens.weight", {c.vocab_size, h}, kNormal, rows);
  layout.groups_.push_back(std::move(embed));

  // Each block's norms that train beside its adapters, moved to its adapter group.
  std::vector<std::vector<TensorSpec>> moved(static_cast<std::size_t>(c.num_hidden_layers));
  for (std::int64_t l = 0; l < c.num_hidden_layers; ++l) {
    ParamGroup g;
    g.name = "layers." + std::to_string(l);
    const std::string p = "model.layers." + std::to_string(l) + ".";
    // A projection whose weight holds `slice`: rows (its bias sliced alike) or columns (its
    // bias whole, added once after the partial products are summed).
    auto linear = [&](const std::string& name, std::int64_t out, std::int64_t in, bool bias,
                      TensorSlice slice) {
      add_tensor(g, p + name + ".weight", {out, in}, kNormal, slice);
      if (bias) {
        add_tensor(g, p + name + ".bias", {out}, TensorInit::kZeros,
                   slice.dim == 0 ? slice : TensorSlice{});
      }
      if (nf4_base) g.tensors[g.tensors.size() - (bias ? 2 : 1)].format = TensorFormat::kNf4;
    };
    auto norm = [&](const std::string& name, std::int64_t n) {
      if (saved(p + name)) {
        TensorSpec t;
        t.name = p + name;
        t.shape = {n};
        t.init = kOnes;
        moved[static_cast<std::size_t>(l)].push_back(std::move(t));
      } else {
        add_tensor(g, p + name, {n}, kOnes);
      }
    };
    norm("input_layernorm.weight", h);
    linear("self_attn.q_proj", q, h, c.qkv_bias, rows);
    linear("self_attn.k_proj", kv, h, c.qkv_bias, kv_rows);
    linear("self_attn.v_proj", kv, h, c.qkv_bias, kv_rows);
    linear("self_attn.o_proj", h, q, c.o_bias, cols);
    if (c.qk_norm) {
      norm("self_attn.q_norm.weight", c.head_dim());
      norm("self_attn.k_norm.weight", c.head_dim());
    }
    norm("post_attention_layernorm.weight", h);
    if (c.is_moe_layer(l)) {
      // The router here; the experts in groups of their own, after the head.
      add_tensor(g, router_weight_name(c, l), {c.moe.num_experts, h}, kNormal);
    } else {
      linear("mlp.gate_proj", ffn, h, c.mlp_bias, rows);
      linear("mlp.up_proj", ffn, h, c.mlp_bias, rows);
      linear("mlp.down_proj", h, ffn, c.mlp_bias, cols);
    }
    layout.groups_.push_back(std::move(g));
  }

  // The head; model.norm in a group of its own when it trains and lm_head does not, or the
  // other way round.
  const bool split_head =
      !c.tie_word_embeddings && saved("model.norm.weight") != saved("lm_head.weight");
  ParamGroup head;
  head.name = "head";
  if (!split_head) add_tensor(head, "model.norm.weight", {h}, kOnes);
  if (!c.tie_word_embeddings) {
    add_tensor(head, "lm_head.weight", {c.vocab_size, h}, kNormal, rows);
  }
  layout.groups_.push_back(std::move(head));

  // Every MoE layer's experts, a group each: gate, up and down projection.
  layout.num_layers_ = static_cast<int>(c.num_hidden_layers);
  layout.first_expert_.assign(static_cast<std::size_t>(c.num_hidden_layers) + 1, 0);
  for (std::int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const int first = layout.num_layers_ + 2 + layout.expert_groups_;
    layout.first_expert_[static_cast<std::size_t>(l)] = first;
    if (!c.is_moe_layer(l)) continue;
    const std::int64_t f = c.moe.expert_intermediate_size;
    for (std::int64_t e = 0; e < c.moe.num_experts; ++e) {
      ParamGroup g;
      g.name = "layers." + std::to_string(l) + ".experts." + std::to_string(e);
      g.expert_layer = static_cast<int>(l);
      const ExpertNames n = expert_weight_names(c, l, e);
      for (const auto& [name, shape] :
           {std::pair{n.gate, std::vector<std::int64_t>{f, h}}, std::pair{n.up, std::vector{f, h}},
            std::pair{n.down, std::vector{h, f}}}) {
        add_tensor(g, name, shape, kNormal);
        if (nf4_base) g.tensors.back().format = TensorFormat::kNf4;
      }
      layout.groups_.push_back(std::move(g));
      ++layout.expert_groups_;
    }
  }
  layout.first_expert_.back() = layout.num_layers_ + 2 + layout.expert_groups_;

  layout.adapters_ = lora.has_value();
  if (lora) {
    // Frozen, but for the modules that train whole beside the adapters.
    for (auto& g : layout.groups_) {
      g.frozen = !std::all_of(g.tensors.begin(), g.tensors.end(),
                              [&](const TensorSpec& t) { return saved(t.name); });
    }
    for (std::int64_t l = 0; l < c.num_hidden_layers; ++l) {
      ParamGroup g;
      g.name = "layers." + std::to_string(l) + ".lora";
      const std::string p = "model.layers." + std::to_string(l) + ".";
      // Split as NeMo splits them: over a column-parallel base B splits by rows as the base
      // does and A is whole; over a row-parallel one (o, down) A splits by columns and B is
      // whole.
      for (int t = 0; t < kNumLoraTargets; ++t) {
        const auto target = static_cast<LoraTarget>(t);
        if (!lora->has(target) || !in_layer_adapters(target, c.is_moe_layer(l))) continue;
        const std::string m = p + std::string(lora_module_path(target, c.family));
        const bool row_parallel = target == LoraTarget::kO || target == LoraTarget::kDown;
        const bool kv = target == LoraTarget::kK || target == LoraTarget::kV;
        // The router is whole on every rank of a tensor split, and so is its adapter.
        const bool whole = row_parallel || target == LoraTarget::kRouter;
        add_tensor(g, m + ".lora_A.weight", {lora->r, lora_in_features(c, target)},
                   TensorInit::kUniformFanIn, row_parallel ? cols : TensorSlice{});
        add_tensor(g, m + ".lora_B.weight", {lora_out_features(c, target), lora->r},
                   TensorInit::kZeros,
                   whole ? TensorSlice{}
                   : kv  ? kv_rows
                         : rows);
      }
      for (auto& t : moved[static_cast<std::size_t>(l)]) {
        add_tensor(g, std::move(t.name), std::move(t.shape), t.init);
      }
      // An MoE layer whose only targets are its experts' projections adapts nothing here (the
      // router's adapter sits here where it has one): the group is empty, and nothing of it
      // trains (or is saved, or asked for).
      g.frozen = g.tensors.empty();
      layout.groups_.push_back(std::move(g));
    }
    if (split_head) {
      ParamGroup norm;
      norm.name = "head.norm";
      add_tensor(norm, "model.norm.weight", {h}, kOnes);
      norm.frozen = !saved("model.norm.weight");
      layout.groups_.push_back(std::move(norm));
    }
    // Each expert's adapters, a group each after every other (acquired with the expert, so an
    // expert no token chose moves neither): PEFT's module paths under the expert's.
    const bool expert_targets =
        lora->has(LoraTarget::kGate) || lora->has(LoraTarget::kUp) || lora->has(LoraTarget::kDown);
    if (expert_targets && layout.expert_groups_ > 0) {
      layout.first_expert_adapter_ = static_cast<int>(layout.groups_.size());
      const std::int64_t f = c.moe.expert_intermediate_size;
      for (std::int64_t l = 0; l < c.num_hidden_layers; ++l) {
        if (!c.is_moe_layer(l)) continue;
        for (std::int64_t e = 0; e < c.moe.num_experts; ++e) {
          ParamGroup g;
          g.name = "layers." + std::to_string(l) + ".experts." + std::to_string(e) + ".lora";
          g.expert_layer = static_cast<int>(l);
          const ExpertNames n = expert_weight_names(c, l, e);
          const std::array<std::tuple<LoraTarget, const std::string*, std::int64_t, std::int64_t>,
                           3>
              projections{{{LoraTarget::kGate, &n.gate, h, f},
                           {LoraTarget::kUp, &n.up, h, f},
                           {LoraTarget::kDown, &n.down, f, h}}};
          for (const auto& [target, name, in, out] : projections) {
            if (!lora->has(target)) continue;
            const std::string m =
                name->substr(0, name->size() - std::string_view(".weight").size());
            add_tensor(g, m + ".lora_A.weight", {lora->r, in}, TensorInit::kUniformFanIn);
            add_tensor(g, m + ".lora_B.weight", {out, lora->r}, TensorInit::kZeros);
          }
          layout.groups_.push_back(std::move(g));
        }
      }
    }
  }

  for (auto& g : layout.groups_) {
    // Each random tensor's place in its group's stream (normals, or LoRA's uniforms), in this
    // order: a slice draws the whole tensor's numbers wherever the tensors end up.
    std::int64_t normals = 0, uniforms = 0;
    for (auto& t : g.tensors) {
      std::int64_t& draws = t.init == TensorInit::kNormal ? normals : uniforms;
      if (t.init != TensorInit::kNormal && t.init != TensorInit::kUniformFanIn) continue;
      t.draw_first = draws;
      draws += t.full_elems();
    }
    if (tp.size > 1) {
      // This rank's duplicates last: tensors whole on `copies` ranks count on the first only.
      const auto duplicate = [&](const TensorSpec& t) {
        return tp.rank % (tp.size / t.slice.parts) != 0;
      };
      std::vector<TensorSpec> tensors = std::move(g.tensors);
      std::stable_partition(tensors.begin(), tensors.end(),
                            [&](const TensorSpec& t) { return !duplicate(t); });
      g.tensors.clear();
      g.num_elems = 0;
      g.duplicate_begin = -1;
      for (auto& t : tensors) {
        if (duplicate(t) && g.duplicate_begin < 0) g.duplicate_begin = g.num_elems;
        t.offset_elems = g.num_elems;
        g.num_elems = (t.offset_elems + t.num_elems + kTensorAlignElems - 1) / kTensorAlignElems *
                      kTensorAlignElems;
        g.tensors.push_back(std::move(t));
      }
    }
    if (g.duplicate_begin < 0) g.duplicate_begin = g.num_elems;
  }
  for (std::size_t i = 0; i < layout.groups_.size(); ++i)
    layout.groups_[i].id = static_cast<int>(i);
  if (stage.split()) {
    STRATA_CHECK(stage.bounds.size() == static_cast<std::size_t>(stage.virtual_count() + 1) &&
                     stage.bounds.back() == c.num_hidden_layers && stage.stage >= 0 &&
                     stage.stage < stage.stages,
                 "a pipeline stage that does not cut this model", stage.stages, stage.stage,
                 c.num_hidden_layers);
    layout.stage_ = stage;
    for (auto& g : layout.groups_) {
      if (layout.stage_of(g.id) == stage.stage) continue;
      g.tensors.clear();
      g.num_elems = 0;
      g.duplicate_begin = 0;
    }
  }
  if (experts.split()) {
    const int per_layer = layout.num_experts_per_layer();
    STRATA_CHECK(per_layer > 0 && per_layer % experts.size == 0 && experts.rank >= 0 &&
                     experts.rank < experts.size,
                 "an expert split that does not share out this model's experts", experts.size,
                 experts.rank, per_layer);
    layout.experts_ = experts;
    for (auto& g : layout.groups_) {
      if (layout.expert_of(g.id) < 0 || layout.expert_owner(g.id) == experts.rank) continue;
      g.tensors.clear();
      g.num_elems = 0;
      g.duplicate_begin = 0;
    }
  }
  layout.index();
  return layout;
}

int ParamLayout::num_experts_per_layer() const {
  for (std::size_t l = 0; l + 1 < first_expert_.size(); ++l) {
    if (first_expert_[l + 1] > first_expert_[l]) return first_expert_[l + 1] - first_expert_[l];
  }
  return 0;
}

int ParamLayout::expert_of(int group) const {
  if (expert_groups_ == 0) return -1;
  if (first_expert_adapter_ >= 0 && group >= first_expert_adapter_ &&
      group < first_expert_adapter_ + expert_groups_) {
    group = first_expert_.front() + (group - first_expert_adapter_);
  }
  if (group < first_expert_.front() || group >= first_expert_.back()) return -1;
  const auto layer = std::upper_bound(first_expert_.begin(), first_expert_.end(), group) -
                     first_expert_.begin() - 1;
  return group - first_expert_[static_cast<std::size_t>(layer)];
}

void ParamLayout::index() {
  total_elems_ = num_parameters_ = 0;
  by_name_.clear();
  for (const auto& g : groups_) {
    total_elems_ += g.num_elems;
    for (std::size_t i = 0; i < g.tensors.size(); ++i) {
      num_parameters_ += g.tensors[i].num_elems;
      by_name_.emplace(g.tensors[i].name, std::pair{g.id, static_cast<int>(i)});
    }
  }
}

int ParamLayout::stage_of(int group, const PipelineStage& stage) const {
  if (!stage.split() || group == embed_group()) return 0;
  const int layers = num_layers_;
  if (group >= layer_group(0) && group < layer_group(layers)) {
    return stage.stage_holding(group - layer_group(0), layers);
  }
  if (expert_groups_ > 0 && group >= first_expert_.front() && group < first_expert_.back()) {
    const auto layer = std::upper_bound(first_expert_.begin(), first_expert_.end(), group) -
                       first_expert_.begin() - 1;
    return stage.stage_holding(static_cast<int>(layer), layers);
  }
  if (adapters_ && group >= adapter_group(0) && group < adapter_group(layers)) {
    return stage.stage_holding(group - adapter_group(0), layers);
  }
  if (first_expert_adapter_ >= 0 && group >= first_expert_adapter_) {
    return stage_of(expert_group(0, 0) + (group - first_expert_adapter_), stage);
  }
  return stage.stages - 1;  // the head, and the head's norm in a group of its own
}

ParamLayout ParamLayout::from_groups(std::vector<ParamGroup> groups) {
  ParamLayout layout;
  layout.groups_ = std::move(groups);
  layout.num_layers_ = std::max(0, static_cast<int>(layout.groups_.size()) - 2);
  for (std::size_t i = 0; i < layout.groups_.size(); ++i) {
    layout.groups_[i].id = static_cast<int>(i);
  }
  layout.index();
  return layout;
}

ParamLayout ParamLayout::all_frozen() const {
  ParamLayout layout = *this;
  for (auto& g : layout.groups_) g.frozen = true;
  return layout;
}

std::optional<ParamLayout::Location> ParamLayout::find(const std::string& name) const {
  const auto it = by_name_.find(name);
  if (it == by_name_.end()) return std::nullopt;
  const auto [group, tensor] = it->second;
  return Location{
      group, &groups_[static_cast<std::size_t>(group)].tensors[static_cast<std::size_t>(tensor)]};
}

std::string router_weight_name(const LlamaConfig& c, std::int64_t layer) {
  return "model.layers." + std::to_string(layer) +
         (c.family == ModelFamily::kMixtral ? ".block_sparse_moe.gate.weight" : ".mlp.gate.weight");
}

ExpertNames expert_weight_names(const LlamaConfig& c, std::int64_t layer, std::int64_t expert) {
  const std::string p = "model.layers." + std::to_string(layer);
  if (c.family == ModelFamily::kMixtral) {
    const std::string m = p + ".block_sparse_moe.experts." + std::to_string(expert) + ".";
    return {m + "w1.weight", m + "w3.weight", m + "w2.weight"};
  }
  const std::string m = p + ".mlp.experts." + std::to_string(expert) + ".";
  return {m + "gate_proj.weight", m + "up_proj.weight", m + "down_proj.weight"};
}

void init_group(const LlamaConfig& config, const ParamGroup& group, std::uint64_t seed,
                float* out) {
  init_group_range(config, group, seed, 0, group.num_elems, out);
}

void init_group_range(const LlamaConfig& config, const ParamGroup& group, std::uint64_t seed,
                      std::int64_t begin, std::int64_t count, float* out) {
  const std::int64_t end = begin + count;
  std::fill(out, out + count, 0.0f);
  const Rng start(seed * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(group.id) + 1);
  // The random tensors' elements, in order, take one stream of normals, two draws each. Pieces
  // of it are drawn in parallel, each from the stream advanced to its start (Rng::discard): the
  // same numbers as one thread drawing them in order. Only [begin, end) of the group is written.
  struct Piece {
    std::int64_t first;  // index in the stream of its first normal
    std::int64_t count;
    float* data;
  };
  std::vector<Piece> pieces;
  std::int64_t total = 0;  // normals before the tensor at hand
  bool uniform = false;
  for (const auto& t : group.tensors) {
    // The tensor's elements inside [begin, end), as [a, b) of the tensor.
    const std::int64_t a = std::clamp(begin - t.offset_elems, std::int64_t{0}, t.num_elems);
    const std::int64_t b = std::clamp(end - t.offset_elems, std::int64_t{0}, t.num_elems);
    float* p = out + (t.offset_elems + a - begin);
    if (t.init == TensorInit::kOnes) {
      std::fill(p, p + (b - a), 1.0f);
    } else if (t.init == TensorInit::kNormal) {
      // A slice draws the whole tensor's numbers at its elements' places in the whole tensor.
      const std::int64_t at = t.draw_first >= 0 ? t.draw_first : total;
      t.for_each_run(a, b - a, [&](std::int64_t first, std::int64_t full_first, std::int64_t n) {
        pieces.push_back(Piece{at + full_first, n, out + (t.offset_elems + first - begin)});
      });
      total = (t.draw_first >= 0 ? t.draw_first : total) + t.full_elems();
    }
    uniform = uniform || t.init == TensorInit::kUniformFanIn;
  }
  if (uniform) {  // LoRA's A: small tensors, one draw each from their own stream
    const Rng stream(start.state[0] ^ 0x5bd1e995u);
    std::int64_t drawn = 0;  // uniforms before the tensor at hand
    for (const auto& t : group.tensors) {
      if (t.init != TensorInit::kUniformFanIn) continue;
      const std::int64_t at = t.draw_first >= 0 ? t.draw_first : drawn;
      drawn = at + t.full_elems();
      // The whole tensor's fan-in, and its numbers at a slice's elements' places in it.
      const double bound = 1.0 / std::sqrt(static_cast<double>(t.full_shape().at(1)));
      const std::int64_t a = std::clamp(begin - t.offset_elems, std::int64_t{0}, t.num_elems);
      const std::int64_t b = std::clamp(end - t.offset_elems, std::int64_t{0}, t.num_elems);
      t.for_each_run(a, b - a, [&](std::int64_t first, std::int64_t full_first, std::int64_t n) {
        Rng rng = stream;
        rng.discard(static_cast<std::uint64_t>(at + full_first));
        float* p = out + (t.offset_elems + first - begin);
        for (std::int64_t i = 0; i < n; ++i) {
          p[i] = static_cast<float>((2.0 * rng.uniform() - 1.0) * bound);
        }
      });
    }
  }
  // Tensors listed out of their draw order (tensor parallelism's duplicates last) give pieces
  // out of stream order.
  std::sort(pieces.begin(), pieces.end(),
            [](const Piece& a, const Piece& b) { return a.first < b.first; });
  const double range = config.initializer_range;
  constexpr std::int64_t kChunk = std::int64_t{1} << 16;
  // Chunks of kChunk normals of the stream, from the first piece's start to the last one's end;
  // each draws the parts of the pieces it covers.
  std::atomic<bool> irregular{false};
  if (!pieces.empty()) {
    const std::int64_t first_chunk = pieces.front().first / kChunk;
    const std::int64_t last = pieces.back().first + pieces.back().count;
    tbb::parallel_for(first_chunk, (last + kChunk - 1) / kChunk, [&](std::int64_t c) {
      const std::int64_t c0 = c * kChunk, c1 = c0 + kChunk;
      // Pieces are in stream order and apart (a slice's columns are one piece a row).
      auto it = std::partition_point(pieces.begin(), pieces.end(), [&](const Piece& piece) {
        return piece.first + piece.count <= c0;
      });
      for (; it != pieces.end() && it->first < c1; ++it) {
        const Piece& piece = *it;
        const std::int64_t a = std::max(c0, piece.first);
        const std::int64_t b = std::min(c1, piece.first + piece.count);
        if (b <= a) continue;
        Rng rng = start;
        rng.discard(static_cast<std::uint64_t>(2 * a));
        for (std::int64_t i = a; i < b; ++i) {
          const double u1 = rng.uniform();
          if (u1 <= 0.0) {  // normal() would draw a third time (p = 2^-53): offsets are off
            irregular = true;
            return;
          }
          piece.data[i - piece.first] =
              static_cast<float>(Rng::box_muller(u1, rng.uniform()) * range);
        }
      }
    });
  }
  if (irregular) {  // one thread, in order, as normal() draws, up to the last piece's end
    Rng rng = start;
    std::int64_t at = 0;
    for (const Piece& piece : pieces) {
      for (; at < piece.first; ++at) (void)rng.normal();
      for (std::int64_t i = 0; i < piece.count; ++i, ++at) {
        piece.data[i] = static_cast<float>(rng.normal() * range);
      }
    }
  }
}

}  // namespace strata::model
