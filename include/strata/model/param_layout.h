// Flat parameter layout: every parameter of the model lives in one of a few flat groups with
// named views, one group per unit of fetching (the embedding, each decoder block, the head).
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/device/adam8bit.h"
#include "strata/model/llama_config.h"
#include "strata/model/lora.h"
#include "strata/model/pipeline_stage.h"

namespace strata::model {

// Element offsets of tensors inside a group are multiples of this: every view is 128-byte aligned
// in f32 and bf16 alike, and each block of 8-bit Adam moments (optimizer.state_dtype "int8")
// holds one tensor's elements, its scale the tensor's own (a norm's moments never share a block,
// and so a scale, with a projection's).
inline constexpr std::int64_t kTensorAlignElems = 256;
static_assert(kTensorAlignElems % device::kAdam8BlockElems == 0);

// How a fresh tensor is initialized (init_group).
enum class TensorInit : std::uint8_t {
  kNormal,       // linear and embedding weights: N(0, initializer_range)
  kOnes,         // RMSNorm weights
  kZeros,        // biases, LoRA's B
  kUniformFanIn  // LoRA's A: U(-1/sqrt(in), 1/sqrt(in)), PEFT's kaiming_uniform_(a=sqrt(5))
};

// How a tensor's working copy is stored.
enum class TensorFormat : std::uint8_t {
  kCompute,  // in the compute dtype
  kNf4       // NF4 with double quantization (strata/device/nf4.h): QLoRA's frozen projections
};

// Which part of a full tensor a TensorSpec holds under tensor parallelism: slice `index` of
// `parts` equal slices along `dim` (0: rows, 1: columns). parts == 1: the whole tensor.
struct TensorSlice {
  int dim = 0;
  int parts = 1;
  int index = 0;
};

struct TensorSpec {
  std::string name;  // Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
  std::vector<std::int64_t> shape;  // what this rank holds (the full tensor unless sliced)
  std::int64_t offset_elems = 0;    // inside its group (its f32 values, its gradient)
  std::int64_t num_elems = 0;
  TensorInit init = TensorInit::kNormal;
  TensorFormat format = TensorFormat::kCompute;
  TensorSlice slice{};
  // kNormal and kUniformFanIn: where its numbers start in its group's stream of that kind
  // (init_group), the whole tensor's place there; -1: right after the tensors of its kind
  // before it in the group.
  std::int64_t draw_first = -1;

  // The whole tensor's shape and element count (as in a Hugging Face checkpoint).
  std::vector<std::int64_t> full_shape() const;
  std::int64_t full_elems() const;
  // Elements [begin, begin + count) of this slice as runs contiguous in the whole tensor:
  // fn(first, full_first, n) for the slice's elements [first, first + n), which are the whole
  // tensor's [full_first, full_first + n); in order.
  template <typename Fn>
  void for_each_run(std::int64_t begin, std::int64_t count, Fn&& fn) const {
    if (count <= 0) return;
    if (slice.parts == 1 || slice.dim == 0 || shape.size() < 2) {
      fn(begin, slice.index * num_elems + begin, count);
      return;
    }
    const std::int64_t cols = shape[1], full_cols = cols * slice.parts;
    for (std::int64_t e = begin; e < begin + count;) {
      const std::int64_t row = e / cols, col = e % cols;
      const std::int64_t n = std::min(cols - col, begin + count - e);
      fn(e, row * full_cols + slice.index * cols + col, n);
      e += n;
    }
  }
};

// Tensor parallelism (Megatron-LM's): `size` ranks each hold a slice of every layer's matrices,
// this one slice `rank`. Column-parallel (rows split): q, k, v, gate and up projections with
// their biases, the embedding and lm_head (vocabulary-parallel). Row-parallel (columns split):
// o_proj and down_proj (their biases whole). Norms are whole on every rank. k and v split by
// kv heads when size divides them; when kv heads divide size, each kv head is whole on
// size / kv_heads ranks.
struct TensorParallel {
  int size = 1;
  int rank = 0;
};
// Expert parallelism: each MoE layer's experts shared out over `size` ranks, this one holding
// experts [rank L, (rank + 1) L), L = num_experts / size (Megatron's expert_model_parallel).
struct ExpertSplit {
  int size = 1;
  int rank = 0;
  bool split() const { return size > 1; }
};
// How many consecutive ranks of `size` hold each kv head whole: size / kv_heads when the kv
// heads are fewer than the ranks, else 1 (the heads split).
inline int kv_head_replicas(std::int64_t kv_heads, int size) {
  return kv_heads < size ? static_cast<int>(size / kv_heads) : 1;
}
// Every reason `size` ranks cannot split `config` (what `size` must divide), naming the value.
std::vector<std::string> tensor_parallel_problems(const LlamaConfig& config, int size);

struct ParamGroup {
  int id = 0;
  std::string name;  // "embed", "layers.3", "head"
  std::vector<TensorSpec> tensors;
  std::int64_t num_elems = 0;  // including alignment padding
  // No gradient and no optimizer state: its working copy is read, never written back (a frozen
  // base under trainable adapters; every group when generating).
  bool frozen = false;
  // An MoE layer's expert: that layer (-1: not an expert). The model acquires a layer's experts
  // as its router chooses them, in no fixed order and not all of them.
  int expert_layer = -1;
  // Some tensor's working copy is NF4 (frozen groups only): the group's working bytes follow
  // working_bytes(), and ZeRO keeps it whole on every rank.
  bool quantized() const;
  // The element ranges [first, second) of [0, end) that none of its tensors covers: the
  // alignment padding after each, and past num_elems up to `end` (what a gradient written tensor
  // by tensor leaves unwritten), in order.
  std::vector<std::pair<std::int64_t, std::int64_t>> gaps(std::int64_t end) const;
  // Tensor parallelism: elements [duplicate_begin, num_elems) are tensors another rank of the
  // group also holds whole and counts in the gradient norm (norms, row-parallel biases, a
  // replicated kv head on all but its first rank); num_elems when none (-1: not yet laid out).
  std::int64_t duplicate_begin = -1;
  std::int64_t duplicates() const { return duplicate_begin < 0 ? 0 : num_elems - duplicate_begin; }
  // Whether `t` (one of this group's tensors) is this rank's to count: not a duplicate.
  bool counts(const TensorSpec& t) const {
    return duplicate_begin < 0 || t.offset_elems < duplicate_begin;
  }
};

// The one rule for a working copy's bytes: elements times the compute dtype's size, unless the
// group is quantized; then each tensor starts on a kQuantizedAlignBytes boundary and takes
// nf4_bytes(elements) (kNf4) or elements times the dtype's size (norms, biases).
inline constexpr std::uint64_t kQuantizedAlignBytes = 256;
std::uint64_t working_bytes(const ParamGroup& group, DType dtype);
// Where `tensor` (one of the group's) starts in the group's working copy, in bytes.
std::uint64_t working_offset(const ParamGroup& group, const TensorSpec& tensor, DType dtype);

// Groups: 0 = "embed" (model.embed_tokens.weight); 1..L = "layers.i" in the order
// input_layernorm, self_attn.{q,k,v,o}_proj (each weight followed by its bias where the family
// has one), self_attn.{q,k}_norm (Qwen3), post_attention_layernorm, mlp.{gate,up,down}_proj
// (with biases under mlp_bias) or, in an MoE layer, its router; L+1 = "head" (model.norm.weight,
// then lm_head.weight unless tie_word_embeddings). Then each MoE layer's experts, a group each
// in layer and expert order: X = the number of them, "layers.i.experts.e" holding the expert's
// gate, up and down projections (expert_weight_names). With LoRA adapters, every group above is
// frozen and L+X+2..2L+X+1 = "layers.i.lora" hold layer i's adapters: for each target in the
// block's order, model.layers.i.<module>.lora_A.weight [r, in] then .lora_B.weight [out, r]. The
// base's group ids do not change, so a base drawn from a seed is the same with or without adapters.
// With `nf4_base` (QLoRA, adapters required) every block's projection weights are kNf4.
//
// Modules that train whole beside the adapters (LoraConfig::modules_to_save): the embed group,
// or the head group, trains when all its tensors do; a block's norms move out of its frozen group
// to the end of its adapter group, in the block's order; model.norm moves to a group of its own,
// 2L+X+2 = "head.norm", when it trains and lm_head does not, or the other way round. Only norms
// move (they start at one, drawing nothing), so a base from a seed stays the same.
//
// With `tp`, each tensor is this rank's slice (TensorSpec::slice; adapters split as NeMo's: B by
// rows over a column-parallel base, A by columns over a row-parallel one, the other whole); the
// group ids do not change, and each group lists the tensors whose gradient this rank counts in the
// norm first, then its duplicates (ParamGroup::duplicate_begin). Seeded values do not depend on the
// order (TensorSpec::draw_first).
//
// With a pipeline `stage` that splits the model, every group keeps its id and name but the groups
// another stage holds are empty (no tensors, no elements): the embedding off stage 0, the head
// off the last stage, each layer (and its adapters) off the stage holding it. With an expert
// split, so are the groups of the experts (and their adapters) other ranks hold.
class ParamLayout {
 public:
  static ParamLayout build(const LlamaConfig& config,
                           const std::optional<LoraConfig>& lora = std::nullopt,
                           bool nf4_base = false, TensorParallel tp = {},
                           const PipelineStage& stage = {}, ExpertSplit experts = {});
  // A layout made of the given groups (ids are renumbered in order). Used for one rank's shards.
  static ParamLayout from_groups(std::vector<ParamGroup> groups);
  // This layout with every group frozen (generation: nothing trains).
  ParamLayout all_frozen() const;

  const std::vector<ParamGroup>& groups() const { return groups_; }
  const ParamGroup& group(int id) const { return groups_.at(static_cast<std::size_t>(id)); }
  int num_groups() const { return static_cast<int>(groups_.size()); }
  int embed_group() const { return 0; }
  int layer_group(int layer) const { return 1 + layer; }
  int head_group() const { return 1 + num_layers_; }
  // Expert `expert` of MoE layer `layer`'s group (the layer must be an MoE one).
  int expert_group(int layer, int expert) const {
    return first_expert_[static_cast<std::size_t>(layer)] + expert;
  }
  // The experts' groups of layer `layer`: 0 for a dense layer.
  int num_experts(int layer) const {
    return first_expert_.empty() ? 0
                                 : first_expert_[static_cast<std::size_t>(layer) + 1] -
                                       first_expert_[static_cast<std::size_t>(layer)];
  }
  int num_expert_groups() const { return expert_groups_; }
  bool has_adapters() const { return adapters_; }
  // Layer `layer`'s adapter group; -1 without adapters.
  int adapter_group(int layer) const {
    return adapters_ ? 2 + num_layers_ + expert_groups_ + layer : -1;
  }
  bool is_adapter(int group) const { return adapters_ && group >= adapter_group(0); }
  // Expert `expert` of MoE layer `layer`'s adapter group (its gate, up and down projections'
  // adapters, those targeted); -1 where the experts have none.
  int expert_adapter_group(int layer, int expert) const {
    return first_expert_adapter_ < 0
               ? -1
               : first_expert_adapter_ + expert_group(layer, expert) - first_expert_.front();
  }
  // The expert split the layout is of; the expert a group holds (or adapts), -1 for the other
  // groups; and the rank of the split holding it (0 unsplit, and for the other groups).
  const ExpertSplit& expert_split() const { return experts_; }
  int expert_of(int group) const;
  int expert_owner(int group) const {
    const int e = expert_of(group);
    return e < 0 || !experts_.split() ? 0 : e / experts_per_rank();
  }
  // Each MoE layer's experts a rank of the split holds (all unsplit), and the first of them this
  // layout's rank holds.
  int experts_per_rank() const { return num_experts_per_layer() / experts_.size; }
  int first_held_expert() const {
    return experts_.split() ? experts_.rank * experts_per_rank() : 0;
  }
  // The pipeline stage the layout is of, and the stage that holds group `group` (0 unsplit),
  // or that would under `stage`'s split.
  const PipelineStage& pipeline() const { return stage_; }
  int stage_of(int group) const { return stage_of(group, stage_); }
  int stage_of(int group, const PipelineStage& stage) const;
  std::int64_t total_elems() const { return total_elems_; }
  // Number of real parameters (without padding).
  std::int64_t num_parameters() const { return num_parameters_; }

  struct Location {
    int group;
    const TensorSpec* tensor;
  };
  std::optional<Location> find(const std::string& name) const;

 private:
  void index();  // the totals and find()'s index, from groups_
  // An MoE layer's expert count (every MoE layer has the same); 0 without experts.
  int num_experts_per_layer() const;
  std::vector<ParamGroup> groups_;
  int num_layers_ = 0;
  // The first expert group of each layer, and one past the last layer's: a dense layer's range
  // is empty. Empty for a layout made from_groups.
  std::vector<int> first_expert_;
  int expert_groups_ = 0;
  int first_expert_adapter_ = -1;  // the first expert's adapter group, in expert group order
  std::unordered_map<std::string, std::pair<int, int>> by_name_;  // group and tensor index
  bool adapters_ = false;
  PipelineStage stage_;
  ExpertSplit experts_;
  std::int64_t total_elems_ = 0;
  std::int64_t num_parameters_ = 0;
};

// An MoE layer's router weight, [num_experts, hidden]: "model.layers.N.mlp.gate.weight"
// (Qwen3-MoE) or "model.layers.N.block_sparse_moe.gate.weight" (Mixtral).
std::string router_weight_name(const LlamaConfig& config, std::int64_t layer);
// An expert's projections as Hugging Face names them: mlp.experts.E.{gate,up,down}_proj.weight
// (Qwen3-MoE), block_sparse_moe.experts.E.{w1,w3,w2}.weight (Mixtral).
struct ExpertNames {
  std::string gate, up, down;
};
ExpertNames expert_weight_names(const LlamaConfig& config, std::int64_t layer, std::int64_t expert);

// Initializes one group like transformers' LlamaForCausalLM and PEFT's LoRA: linear and
// embedding weights ~ N(0, initializer_range), norm weights = 1, biases, LoRA's B and padding = 0,
// LoRA's A ~ U(-1/sqrt(in), 1/sqrt(in)). Each group draws from its
// own stream seeded by (seed, group id), so the result does not depend on the order groups are
// visited; the group's elements are drawn in parallel chunks that give the same numbers as one
// thread drawing them in order.
void init_group(const LlamaConfig& config, const ParamGroup& group, std::uint64_t seed, float* out);
// Elements [begin, begin + count) of what init_group writes, into out[0, count).
void init_group_range(const LlamaConfig& config, const ParamGroup& group, std::uint64_t seed,
                      std::int64_t begin, std::int64_t count, float* out);

}  // namespace strata::model
