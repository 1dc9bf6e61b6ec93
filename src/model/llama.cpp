// LlamaModel: LlamaForCausalLM's training step over parameter groups from a ParamProvider, with
// activations in one device workspace per (batch, seq) shape.
#include "strata/model/llama.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "src/model/llama_block.h"
#include "strata/core/aligned.h"
#include "strata/core/clock.h"

namespace strata::model {
namespace {

using detail::BlockActs;
using detail::BlockGrads;
using detail::BlockOffsets;
using detail::BlockSetup;
using detail::BlockWeights;
using detail::Dims;
using detail::matmul;
using detail::offset_ptr;
using detail::TensorSplit;

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
    return s;
  }
  // Checkpointed layer inputs a micro-batch writes: each chunk's but its first layer's.
  std::int64_t inner_inputs() const {
    std::int64_t n = 0;
    for (const auto& [b, e] : chunks) n += e - b - 1;
    return n;
  }
};

// Layer `i`'s activations, their input at `x`, for rows of `d`: `rows_apart` keeps this rank's
// rows of the norm outputs only (a_local, b_local; the whole ones gathered into a_shared,
// b_shared).
template <typename Act, typename F32>
BlockActs carve_acts(const BlockSetup& setup, Act act, F32 f32, bool rows_apart, void* a_shared,
                     void* b_shared) {
  const Dims& d = setup.d;
  const TensorSplit& sp = setup.split;
  const std::int64_t R = d.rows, H = d.hidden, Q = d.q_dim, KV = d.kv_dim, F = d.ffn;
  const std::int64_t Rl = sp.local_rows;
  BlockActs a;
  a.rstd1 = f32(Rl);
  a.a = rows_apart ? a_shared : act(R * H);
  if (rows_apart) a.a_local = act(Rl * H);
  a.q = act(R * Q);
  a.k = act(R * KV);
  a.v = act(R * KV);
  if (d.qk_norm) {
    a.q_pre = act(R * Q);
    a.k_pre = act(R * KV);
    a.rstd_q = f32(R * d.heads);
    a.rstd_k = f32(R * d.kv_heads);
  }
  a.att = act(R * Q);
  a.lse = f32(d.batch * d.heads * d.seq);
  a.hmid = act(Rl * H);
  a.rstd2 = f32(Rl);
  a.b = rows_apart ? b_shared : act(R * H);
  if (rows_apart) a.b_local = act(Rl * H);
  a.gate = act(R * F);
  a.up = act(R * F);
  a.m = act(R * F);
  for (int t = 0; t < kNumLoraTargets; ++t) {
    if (setup.lora.on[t]) a.lora_t[t] = act(R * setup.lora.rank);
  }
  return a;
}

// Lays the workspace out from `base`; with base == nullptr it only measures. Returns the bytes
// needed, so activation_bytes() and the allocation can never disagree.
std::uint64_t carve_workspace(const BlockSetup& setup, const StageShape& stage, std::byte* base,
                              Workspace* ws) {
  const Dims& d = setup.d;
  const TensorSplit& sp = setup.split;
  Carver c{base};
  const std::size_t eb = d.elem_bytes;
  const std::int64_t R = d.rows, H = d.hidden, Q = d.q_dim, KV = d.kv_dim, F = d.ffn;
  // The residual stream's rows: this rank's under sequence parallelism, else all.
  const std::int64_t Rl = sp.local_rows;
  const bool checkpointing = stage.checkpointing;
  auto f32 = [&](std::int64_t n) { return c.f32(n); };
  auto act = [&](std::int64_t n) { return c.take(n, eb); };

  // An adapter's dropped-out input: scratch shared by every layer.
  const bool lora_dropout = setup.lora.rank > 0 && setup.lora.dropout > 0;
  void* lora_x = lora_dropout ? act(R * d.max_in()) : nullptr;
  // Sequence parallelism: a row-parallel product before its reduce-scatter (also the
  // embedding's), shared by every layer.
  ws->partial = sp.seq_parallel ? act(R * H) : nullptr;
  // Every layer's activations kept under sequence parallelism: each keeps its rows of the norm
  // outputs, gathered whole into buffers the layers share (again in backward).
  const bool rows_apart = sp.seq_parallel && !checkpointing;
  void* a_shared = rows_apart ? act(R * H) : nullptr;
  void* b_shared = rows_apart ? act(R * H) : nullptr;
  const auto layer_acts = [&]() {
    BlockActs a = carve_acts(setup, act, f32, rows_apart, a_shared, b_shared);
    a.lora_x = lora_x;
    a.partial = ws->partial;
    return a;
  };
  if (checkpointing) ws->shared = layer_acts();
  ws->slots.resize(static_cast<std::size_t>(stage.in_flight));
  for (SlotSpace& slot : ws->slots) {
    slot.ids = stage.embeds ? c.i32(R) : nullptr;
    slot.targets = stage.heads ? c.i32(R) : nullptr;
    slot.embedding_grad = stage.embeds && stage.embedding_grads ? act(d.vocab * H) : nullptr;
    slot.chunks.resize(stage.chunks.size());
    for (std::size_t ci = 0; ci < stage.chunks.size(); ++ci) {
      ChunkSpace& ch = slot.chunks[ci];
      std::tie(ch.begin, ch.end) = stage.chunks[ci];
      const std::int64_t n = ch.end - ch.begin;
      ch.xs.assign(static_cast<std::size_t>(n + 1), nullptr);
      for (std::int64_t i = 0; i <= n; ++i) {
        if (!checkpointing || i == 0 || i == n) ch.xs[static_cast<std::size_t>(i)] = act(Rl * H);
      }
      ch.acts.clear();
      for (std::int64_t i = 0; i < n && !checkpointing; ++i) {
        ch.acts.push_back(layer_acts());
        ch.acts.back().x = ch.xs[static_cast<std::size_t>(i)];
      }
      ch.dout = act(Rl * H);
      const bool first = stage.embeds && ci == 0;
      ch.din = first ? nullptr : act(Rl * H);
    }
  }
  if (stage.heads) {
    const std::int64_t C = d.head_rows;
    ws->rstd_final = f32(Rl);
    ws->hf = act(R * H);
    ws->logits = act(C * d.vocab);
    ws->losses = f32(R);
    if (sp.split()) {
      ws->ce_local = f32(3 * C);
      ws->ce_stats = f32(3 * C * sp.size);
      ws->ce_rows = f32(2 * C);
    }
    if (stage.embedding_copy) {
      ws->embedding = act(d.vocab * H);
      ws->embedding_grad = stage.embedding_grads ? act(d.vocab * H) : nullptr;
    }
  }
  if (setup.base.nf4) ws->nf4_weight = act(d.max_weight());
  auto& s = ws->bwd;
  if (sp.split() && d.qk_norm) {
    s.dqn = act(d.head_dim);
    s.dkn = act(d.head_dim);
  }
  if (sp.kv_replicas > 1) {
    s.kv_dw = act(d.kv_dim * H);
    s.kdb = act(d.kv_dim);
    s.vdb = act(d.kv_dim);
  }
  if (sp.seq_parallel) {
    s.dh_full = act(R * H);
    s.dh = s.dh_full == nullptr ? nullptr : sp.row_slot(s.dh_full, H);
    s.dx_local = act(Rl * H);
    s.dln1 = act(H);
    s.dln2 = act(H);
  } else {
    s.dh = act(R * H);
  }
  s.dtmp = act(Rl * H);
  s.dx = act(R * H);
  if (setup.lora.rank > 0) s.lora_dt = act(R * setup.lora.rank);
  if (lora_dropout) s.lora_dx = act(R * d.max_in());
  const std::uint64_t union_start = align_up(c.off, kAlignBytes);
  s.dm = act(R * F);
  const std::uint64_t mlp_end = c.off;
  c.off = union_start;
  s.datt = act(R * Q);
  s.dq = act(R * Q);
  s.dk = act(R * KV);
  s.dv = act(R * KV);
  if (d.qk_norm) {
    s.dq_pre = act(R * Q);
    s.dk_pre = act(R * KV);
  }
  return std::max(c.off, mlp_end);
}

// The decoding workspace: the KV caches of every layer and one block's activations for up to
// `rows` tokens at a time.
struct DecodeWorkspace {
  std::int32_t* ids = nullptr;          // [rows]
  std::vector<void*> k_cache, v_cache;  // per layer, [positions, kv_dim]
  void* xs[2] = {nullptr, nullptr};     // [rows, hidden]: block input and output, alternating
  detail::DecodeActs acts;
  void* nf4_weight = nullptr;   // [max_weight] with an NF4 base: one decoded weight
  float* rstd_final = nullptr;  // [1]
  void* hf = nullptr;           // [hidden]: model.norm of the last row
  void* logits = nullptr;       // [vocab], compute dtype
  float* logits_f32 = nullptr;  // [vocab]
};

std::uint64_t carve_decode(const BlockSetup& setup, std::int64_t num_layers, std::int64_t positions,
                           std::byte* base, DecodeWorkspace* ws) {
  const Dims& d = setup.d;
  Carver c{base};
  const std::size_t eb = d.elem_bytes;
  const std::int64_t R = d.rows, H = d.hidden, Q = d.q_dim, KV = d.kv_dim, F = d.ffn;
  auto act = [&](std::int64_t n) { return c.take(n, eb); };
  ws->ids = c.i32(R);
  ws->k_cache.resize(static_cast<std::size_t>(num_layers));
  ws->v_cache.resize(static_cast<std::size_t>(num_layers));
  for (std::int64_t l = 0; l < num_layers; ++l) {
    ws->k_cache[static_cast<std::size_t>(l)] = act(positions * KV);
    ws->v_cache[static_cast<std::size_t>(l)] = act(positions * KV);
  }
  ws->xs[0] = act(R * H);
  ws->xs[1] = act(R * H);
  auto& a = ws->acts;
  a.a = act(R * H);
  a.q = act(R * Q);
  if (d.qk_norm) {
    a.q_pre = act(R * Q);
    a.k_pre = act(R * KV);
  }
  a.rstd = c.f32(R * std::max(d.heads, d.kv_heads));
  a.att = act(R * Q);
  a.hmid = act(R * H);
  a.b = act(R * H);
  a.gate = act(R * F);
  a.up = act(R * F);
  a.m = act(R * F);
  if (setup.lora.rank > 0) a.lora_t = act(R * setup.lora.rank);
  if (setup.base.nf4) ws->nf4_weight = act(d.max_weight());
  ws->rstd_final = c.f32(1);
  ws->hf = act(H);
  ws->logits = act(d.vocab);
  ws->logits_f32 = c.f32(d.vocab);
  return c.off;
}

const TensorSpec& tensor_in(const ParamLayout& layout, const std::string& name, int group) {
  const auto loc = layout.find(name);
  STRATA_CHECK(loc.has_value() && loc->group == group, "parameter missing from the layout", name,
               group);
  return *loc->tensor;
}

std::int64_t tensor_offset(const ParamLayout& layout, const std::string& name, int group) {
  return tensor_in(layout, name, group).offset_elems;
}

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
  Result<void*> acquire_grads(int group) {
    Stopwatch sw;
    auto r = provider_.acquire_grads(group);
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

}  // namespace

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
  Result<float> step(ParamProvider& provider, const MicroBatch& mb, bool train,
                     StepTimings& timings);
  Status begin_decode(ParamProvider& provider, std::int64_t max_positions, std::int64_t max_rows);
  Result<const float*> decode(ParamProvider& provider, const std::int32_t* ids, std::int64_t n);
  BlockSetup decode_setup(std::int64_t rows) const {
    BlockSetup b = BlockSetup::make(config_, options_, 1, rows);
    b.lora.dropout = 0;  // not training
    return b;
  }
  DecodeWorkspace dws_;
  BlockSetup decode_setup_;
  std::int64_t decode_positions_ = 0, decode_rows_ = 0, decoded_ = 0;
  void* decode_io_ = nullptr;  // the provider's host_io: token ids in, logits out

  // A block is its layer's group and, with LoRA, its adapter group, held together: layer l's
  // weights with its adapters attached, valid until release_block.
  Result<BlockWeights> acquire_block(ProviderSession& ps, std::int64_t l) const {
    const auto li = static_cast<std::size_t>(l);
    const std::size_t eb = dtype_size(options_.compute_dtype);
    STRATA_ASSIGN_OR_RETURN(const void* p, ps.acquire(layout_.layer_group(static_cast<int>(l))));
    BlockWeights w = BlockWeights::at(p, block_bytes_[li], 1);
    if (layout_.has_adapters()) {
      STRATA_ASSIGN_OR_RETURN(const void* a,
                              ps.acquire(layout_.adapter_group(static_cast<int>(l))));
      w.overlay(a, block_trained_[li], eb);
      w.attach_lora(a, adapters_[li], eb);
    }
    return w;
  }
  void release_block(ProviderSession& ps, std::int64_t l) const {
    ps.release(layout_.layer_group(static_cast<int>(l)));
    if (layout_.has_adapters()) ps.release(layout_.adapter_group(static_cast<int>(l)));
  }
  void prefetch_block(ProviderSession& ps, std::int64_t l) const {
    ps.prefetch(layout_.layer_group(static_cast<int>(l)));
    if (layout_.has_adapters()) ps.prefetch(layout_.adapter_group(static_cast<int>(l)));
  }

  // Vocabulary-parallel: token ids as rows of this rank's slice of the embedding, -1 for the
  // others' (embedding_forward writes zeros for them, embedding_backward skips them).
  void to_local_ids(std::int32_t* ids, std::int64_t n) const {
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t local = ids[i] - setup_.split.vocab_begin;
      ids[i] = local >= 0 && local < setup_.d.vocab ? static_cast<std::int32_t>(local) : -1;
    }
  }

  // Megatron's vocabulary-parallel cross-entropy over ws_.logits (this rank's slice): each
  // rank's per-row (max, sum of exp, target logit) gathered, combined in double the same way on
  // every rank into the loss and the whole row's max and sum, then (training) the gradient of
  // the slice in place. The logits are never whole.
  Status parallel_cross_entropy(const std::int32_t* targets, std::int64_t n, float* host_losses,
                                bool train, float dloss_scale) {
    const Dims& d = setup_.d;
    const TensorSplit& sp = setup_.split;
    const std::int64_t T = sp.size;
    auto& stream = device_.stream(device::StreamKind::kCompute);
    const auto& ops = device_.ops();
    ops.cross_entropy_stats(ws_.logits, targets, n, d.vocab, sp.vocab_begin, ws_.ce_local, d.dtype);
    STRATA_RETURN_IF_ERROR(sp.group->all_gather(ws_.ce_local, ws_.ce_stats, 3 * n, DType::kF32,
                                                "cross-entropy statistics"));
    // In the pinned host buffer, after every slot's ids, targets and losses.
    float* stats =
        reinterpret_cast<float*>(static_cast<std::byte*>(host_io_) +
                                 12 * d.rows * static_cast<std::int64_t>(ws_.slots.size()));
    float* rows = stats + 3 * n * T;
    device_.copy_to_host(stats, ws_.ce_stats, static_cast<std::size_t>(3 * n * T) * 4, stream);
    stream.synchronize();
    for (std::int64_t i = 0; i < n; ++i) {
      float m = -std::numeric_limits<float>::infinity();
      for (std::int64_t r = 0; r < T; ++r) m = std::max(m, stats[3 * (r * n + i)]);
      double sum = 0, target = 0;
      for (std::int64_t r = 0; r < T; ++r) {
        const float* st = stats + 3 * (r * n + i);
        if (st[1] > 0) sum += static_cast<double>(st[1]) * std::exp(static_cast<double>(st[0]) - m);
        target += st[2];
      }
      host_losses[i] =
          sum > 0 ? static_cast<float>(std::log(sum) + (static_cast<double>(m) - target)) : 0.0f;
      rows[i] = m;
      rows[n + i] = static_cast<float>(sum);
    }
    if (!train) return Status::ok();
    device_.copy_to_device(ws_.ce_rows, rows, static_cast<std::size_t>(2 * n) * 4, stream);
    ops.cross_entropy_grad(ws_.logits, targets, n, d.vocab, sp.vocab_begin, ws_.ce_rows,
                           ws_.ce_rows + n, ws_.logits, dloss_scale, d.dtype);
    stream.synchronize();  // `rows` is read by the copy
    return Status::ok();
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

  // The micro-batch's dimensions with layer `layer`'s attention window and dropout masks.
  BlockSetup setup_of(std::int64_t layer) const {
    BlockSetup b = setup_;
    b.d.window = config_.window_of(layer);
    b.lora.layer = layer;
    if (!train_) b.lora.dropout = 0;
    b.lora.key = dropout_key_;
    return b;
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
  bool train_ = false;                         // this step runs backward (and dropout)
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
        LlamaModel::host_io_bytes(batch, seq, options_.tensor_parallel.size, stage.in_flight),
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

// The chunk's layers forward, after the embedding on the first virtual stage; on the last, the
// head and the loss, and with train the head's backward at once (dlogits overwrite the logits),
// leaving the gradient of the chunk's output for backward_chunk.
Status LlamaModel::Impl::forward_chunk(ParamProvider& provider, const MicroBatch& mb, int chunk,
                                       bool train, StepTimings& timings) {
  Stopwatch clock;
  STRATA_RETURN_IF_ERROR(begin_pass(provider, mb, chunk, train));
  const PipelineStage& stage = options_.pipeline;
  const bool embeds = stage.first_chunk(chunk), heads = stage.last_chunk(chunk);
  const Dims& d = setup_.d;
  const TensorSplit& sp = setup_.split;
  const DType dt = d.dtype;
  const std::size_t eb = d.elem_bytes;
  const std::int64_t R = d.rows, H = d.hidden;
  const auto& ops = device_.ops();
  auto& stream = device_.stream(device::StreamKind::kCompute);
  SlotSpace& slot = ws_.slots[static_cast<std::size_t>(mb.slot)];
  ChunkSpace& ch = slot.chunks[static_cast<std::size_t>(chunk)];
  ProviderSession ps(provider, layout_, timings);

  if (embeds || heads) {
    STRATA_RETURN_IF_ERROR(check_tokens(mb));
    const HostRows host = host_rows(mb.slot);
    const std::size_t row_bytes = static_cast<std::size_t>(R) * 4;
    if (embeds) {
      std::memcpy(host.ids, mb.inputs, row_bytes);
      if (sp.split()) to_local_ids(host.ids, R);
      device_.copy_to_device(slot.ids, host.ids, row_bytes, stream);
    }
    if (heads) {
      std::memcpy(host.targets, mb.targets, row_bytes);
      device_.copy_to_device(slot.targets, host.targets, row_bytes, stream);
    }
  }
  // The chunk's layer inputs: its first and its output the workspace's; checkpointed, the others
  // the provider's, each written once here and read back by its block's backward.
  const bool checkpointing = options_.activation_checkpointing;
  const std::int64_t n = ch.end - ch.begin;
  std::vector<void*> xs = ch.xs;
  const auto inner = [&](std::int64_t i) { return checkpointing && i > 0 && i < n; };
  const auto new_x = [&](std::int64_t i) -> Status {
    if (!inner(i)) return Status::ok();
    STRATA_ASSIGN_OR_RETURN(
        xs[static_cast<std::size_t>(i)],
        provider.write_activation(checkpoint_index(mb.slot, ch.begin + i), checkpoint_bytes()));
    return Status::ok();
  };
  const auto done_x = [&](std::int64_t i, bool keep) -> Status {
    return inner(i) ? provider.release_activation(checkpoint_index(mb.slot, ch.begin + i), keep)
                    : Status::ok();
  };
  if (embeds) {
    const int embed = layout_.embed_group();
    STRATA_ASSIGN_OR_RETURN(const void* p, ps.acquire(embed));
    if (n > 0) prefetch_block(ps, ch.begin);
    // Vocabulary-parallel: each token's row from the rank that holds it, zeros elsewhere, summed
    // (this rank's rows of the sum under sequence parallelism).
    void* embedded = sp.seq_parallel ? ws_.partial : xs[0];
    ops.embedding_forward(slot.ids, R, offset_ptr(p, embed_offset_, eb), H, embedded, dt);
    ps.release(embed);
    if (sp.split()) STRATA_RETURN_IF_ERROR(sp.sum_partial(embedded, xs[0], H, "embedding"));
  }
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t l = ch.begin + i;
    STRATA_ASSIGN_OR_RETURN(const BlockWeights w, acquire_block(ps, l));
    if (i + 1 < n) {
      prefetch_block(ps, l + 1);
    } else if (heads) {
      prefetch_head(ps);
    }
    STRATA_RETURN_IF_ERROR(new_x(i + 1));
    STRATA_RETURN_IF_ERROR(detail::block_forward(ops, setup_of(l), w,
                                                 acts_for(ch, i, xs[static_cast<std::size_t>(i)]),
                                                 xs[static_cast<std::size_t>(i + 1)]));
    release_block(ps, l);
    STRATA_RETURN_IF_ERROR(done_x(i, train));  // its block's backward reads it again
  }
  if (heads) {
    STRATA_RETURN_IF_ERROR(head_forward_backward(ps, mb, ch, train));
  }
  timings.forward_ms += clock.elapsed_ms();
  return device_.last_error();
}

Status LlamaModel::Impl::head_forward_backward(ProviderSession& ps, const MicroBatch& mb,
                                               ChunkSpace& ch, bool train) {
  const Dims& d = setup_.d;
  const TensorSplit& sp = setup_.split;
  const DType dt = d.dtype;
  const std::size_t eb = d.elem_bytes;
  const std::int64_t R = d.rows, H = d.hidden, V = d.vocab;
  const bool tied = config_.tie_word_embeddings;
  const auto& ops = device_.ops();
  auto& stream = device_.stream(device::StreamKind::kCompute);
  const auto& bwd = ws_.bwd;
  const std::int32_t* targets = ws_.slots[static_cast<std::size_t>(mb.slot)].targets;
  float* host_losses = host_rows(mb.slot).losses;
  const auto trains = [&](int group) { return !layout_.group(group).frozen; };

  STRATA_ASSIGN_OR_RETURN(const HeadWeights head, acquire_head(ps));
  const void* lm_weight = head.lm;
  const void* norm_weight = head.norm;
  const std::int64_t n = ch.end - ch.begin;
  if (train && n > 0) prefetch_block(ps, ch.end - 1);
  void* x_final = ch.xs[static_cast<std::size_t>(n)];
  ops.rmsnorm_forward(x_final, norm_weight, sp.row_slot(ws_.hf, H), ws_.rstd_final, sp.local_rows,
                      H, d.eps, dt);
  STRATA_RETURN_IF_ERROR(sp.gather_rows(ws_.hf, H, "model.norm output"));
  // Training: the head's gradients. Tied: the embedding's gradient collects the head's part now
  // and the lookup's part last. A frozen head, norm or embedding has no gradient: its weight
  // products are skipped.
  const bool norm_trains = train && trains(norm_group_), lm_trains = train && trains(lm_group_);
  void* norm_grads = nullptr;
  void* lm_grads = nullptr;
  if (norm_trains) {
    STRATA_ASSIGN_OR_RETURN(norm_grads, ps.acquire_grads(norm_group_));
  }
  if (lm_trains) {
    if (embedding_copy_) {
      lm_grads = ws_.embedding_grad;  // the head's part, from zero as one stage's
      device_.fill_zero(lm_grads, static_cast<std::size_t>(V * H) * eb, stream);
    } else if (lm_group_ == norm_group_) {
      lm_grads = norm_grads;
    } else {
      STRATA_ASSIGN_OR_RETURN(lm_grads, ps.acquire_grads(lm_group_));
    }
  }
  // d(mean loss * grad_scale)/dlogits; no valid target means no gradient.
  const float dloss_scale = num_valid_ > 0 ? mb.grad_scale / static_cast<float>(num_valid_) : 0.0f;
  // The logits, the loss and (training) their gradient a chunk of tokens at a time: the whole
  // [rows, vocab] never exists. Each chunk's dlogits overwrite its logits, then give lm_head's
  // weight gradient (accumulated over the chunks) and the chunk's rows of the input gradient.
  void* dlogits = ws_.logits;
  for (std::int64_t r0 = 0; r0 < R; r0 += d.head_rows) {
    const std::int64_t rows = std::min(d.head_rows, R - r0);
    const void* hf = offset_ptr(ws_.hf, r0 * H, eb);
    matmul(ops, dt, false, true, rows, V, H, hf, lm_weight, ws_.logits, false);
    if (sp.split()) {
      STRATA_RETURN_IF_ERROR(
          parallel_cross_entropy(targets + r0, rows, host_losses + r0, train, dloss_scale));
    } else {
      ops.cross_entropy(ws_.logits, targets + r0, ws_.losses + r0, train ? dlogits : nullptr, rows,
                        V, dloss_scale, dt);
    }
    if (!train) continue;
    if (lm_trains) {
      matmul(ops, dt, true, false, V, H, rows, dlogits, hf, offset_ptr(lm_grads, lm_offset_, eb),
             true);
    }
    matmul(ops, dt, false, false, rows, H, V, dlogits, lm_weight, offset_ptr(bwd.dx, r0 * H, eb),
           false);
  }
  if (!sp.split()) {
    device_.copy_to_host(host_losses, ws_.losses, static_cast<std::size_t>(R) * 4, stream);
    stream.synchronize();
  }
  double sum = 0;
  for (std::int64_t i = 0; i < R; ++i) sum += host_losses[i];
  slot_loss_[static_cast<std::size_t>(mb.slot)] =
      num_valid_ > 0 ? static_cast<float>(sum / static_cast<double>(num_valid_)) : 0.0f;
  if (!train) {
    release_head(ps);
    return Status::ok();
  }

  // Each rank's vocabulary slice gives part of the input gradient: summed (this rank's rows).
  void* dx = sp.seq_parallel ? bwd.dx_local : bwd.dx;
  if (sp.split()) {
    STRATA_RETURN_IF_ERROR(sp.sum_partial(bwd.dx, dx, H, "lm_head input gradient"));
  }
  // The sums norm_backward adds into start at zero (absent ones: no-ops).
  if (bwd.dln1 != nullptr) device_.fill_zero(bwd.dln1, static_cast<std::size_t>(H) * eb, stream);
  STRATA_RETURN_IF_ERROR(
      detail::norm_backward(ops, d, sp, dx, x_final, norm_weight, ws_.rstd_final, ch.dout,
                            norm_trains ? offset_ptr(norm_grads, norm_offset_, eb) : nullptr,
                            bwd.dln1, "model.norm weight gradient"));
  release_head(ps);
  if (norm_trains) STRATA_RETURN_IF_ERROR(ps.release_grads(norm_group_));
  // The embedding's (tied) are released after the lookup's part, last.
  if (lm_trains && lm_group_apart() && !tied) {
    STRATA_RETURN_IF_ERROR(ps.release_grads(lm_group_));
  }
  tied_grads_ = tied && !embedding_copy_ ? lm_grads : nullptr;
  return Status::ok();
}

// The chunk's layers backward from the gradient of its output (ch.dout), down to the gradient
// of its input: into the embedding's on the first virtual stage, else into ch.din to be sent.
Status LlamaModel::Impl::backward_chunk(ParamProvider& provider, const MicroBatch& mb, int chunk,
                                        StepTimings& timings) {
  Stopwatch clock;
  STRATA_RETURN_IF_ERROR(begin_pass(provider, mb, chunk, /*train=*/true));
  const PipelineStage& stage = options_.pipeline;
  const bool embeds = stage.first_chunk(chunk);
  const Dims& d = setup_.d;
  const TensorSplit& sp = setup_.split;
  const DType dt = d.dtype;
  const std::size_t eb = d.elem_bytes;
  const std::int64_t R = d.rows, H = d.hidden;
  const bool tied = config_.tie_word_embeddings;
  const auto& ops = device_.ops();
  auto& stream = device_.stream(device::StreamKind::kCompute);
  const auto& bwd = ws_.bwd;
  SlotSpace& slot = ws_.slots[static_cast<std::size_t>(mb.slot)];
  ChunkSpace& ch = slot.chunks[static_cast<std::size_t>(chunk)];
  ProviderSession ps(provider, layout_, timings);
  const bool checkpointing = options_.activation_checkpointing;
  const bool adapters = layout_.has_adapters();
  const auto layer = [&](std::int64_t l) { return layout_.layer_group(static_cast<int>(l)); };
  const auto adapter = [&](std::int64_t l) { return layout_.adapter_group(static_cast<int>(l)); };
  const auto trains = [&](int group) { return !layout_.group(group).frozen; };
  const auto zero = [&](void* scratch, std::int64_t elems) {
    if (scratch != nullptr) {
      device_.fill_zero(scratch, static_cast<std::size_t>(elems) * eb, stream);
    }
  };
  const std::int64_t n = ch.end - ch.begin;
  // The gradient of the residual stream, layer by layer, in bwd.dh (this rank's rows).
  ops.cast(ch.dout, dt, bwd.dh, dt, sp.local_rows * H);
  if (checkpointing && n > 1) {
    provider.prefetch_activation(checkpoint_index(mb.slot, ch.end - 1));
  }
  for (std::int64_t i = n - 1; i >= 0; --i) {
    const std::int64_t l = ch.begin + i;
    const auto li = static_cast<std::size_t>(l);
    STRATA_ASSIGN_OR_RETURN(const BlockWeights w, acquire_block(ps, l));
    if (i > 0) prefetch_block(ps, l - 1);
    const void* x = ch.xs[static_cast<std::size_t>(i)];
    const bool inner = checkpointing && i > 0;
    if (inner) {
      STRATA_ASSIGN_OR_RETURN(x, provider.read_activation(checkpoint_index(mb.slot, l)));
      if (i > 1) provider.prefetch_activation(checkpoint_index(mb.slot, l - 1));
    }
    // A frozen base's gradients stay null: block_backward skips its weight products.
    const bool base_trains = trains(layer(l));
    BlockGrads grads;
    if (base_trains) {
      STRATA_ASSIGN_OR_RETURN(void* g, ps.acquire_grads(layer(l)));
      grads = BlockGrads::at(g, blocks_[li], eb);
    }
    if (adapters) {
      STRATA_ASSIGN_OR_RETURN(void* g, ps.acquire_grads(adapter(l)));
      grads.overlay(g, block_trained_[li], eb);
      grads.attach_lora(g, adapters_[li], eb);
    }
    const BlockActs acts = acts_for(ch, i, x);
    const BlockSetup dl = setup_of(l);
    if (checkpointing) STRATA_RETURN_IF_ERROR(detail::block_forward(ops, dl, w, acts, nullptr));
    // The sums block_backward adds into start at zero (absent ones: no-ops).
    for (void* scratch : {bwd.dqn, bwd.dkn}) zero(scratch, d.head_dim);
    for (void* scratch : {bwd.dln1, bwd.dln2}) zero(scratch, H);
    for (void* scratch : {bwd.kdb, bwd.vdb}) zero(scratch, d.kv_dim);
    STRATA_RETURN_IF_ERROR(detail::block_backward(ops, dl, w, acts, grads, bwd));
    release_block(ps, l);
    if (inner) {
      STRATA_RETURN_IF_ERROR(provider.release_activation(checkpoint_index(mb.slot, l), false));
    }
    if (base_trains) STRATA_RETURN_IF_ERROR(ps.release_grads(layer(l)));
    if (adapters) STRATA_RETURN_IF_ERROR(ps.release_grads(adapter(l)));
  }

  if (!embeds) {
    ops.cast(bwd.dh, dt, ch.din, dt, sp.local_rows * H);
  } else if (const int embed = layout_.embed_group(); trains(embed)) {
    // Tied: the head's gradient of the same group, acquired by the head where one stage holds
    // both; cut into stages, the head's part received from the last stage starts the sum.
    const bool received = tied && stage.split();
    void* embed_grads = tied_grads_;
    if (!tied || received) {
      STRATA_ASSIGN_OR_RETURN(embed_grads, ps.acquire_grads(embed));
    }
    if (received) {
      ops.cast(slot.embedding_grad, dt, offset_ptr(embed_grads, embed_offset_, eb), dt,
               d.vocab * H);
    }
    STRATA_RETURN_IF_ERROR(sp.gather_rows(bwd.dh_full, H, "embedding output gradient"));
    ops.embedding_backward(slot.ids, R, sp.seq_parallel ? bwd.dh_full : bwd.dh, H,
                           offset_ptr(embed_grads, embed_offset_, eb), dt);
    STRATA_RETURN_IF_ERROR(ps.release_grads(embed));
  }
  stream.synchronize();
  timings.backward_ms += clock.elapsed_ms();
  return device_.last_error();
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
    STRATA_CHECK(!options_.lora.has_value() && !options_.nf4_base,
                 "adapters with tensor parallelism are not supported yet", tp->size());
    STRATA_CHECK(tp->kv_replicas() == kv_head_replicas(config.num_key_value_heads, tp->size()),
                 "the tensor group's kv replicas do not match the model", tp->kv_replicas(),
                 config.num_key_value_heads);
    const auto q =
        layout.find("model.layers." + std::to_string(first_layer) + ".self_attn.q_proj.weight");
    STRATA_CHECK(q && q->tensor->slice.parts == tp->size() && q->tensor->slice.index == tp->rank(),
                 "the layout is not this rank's tensor-parallel slice", tp->size(), tp->rank());
  }
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
      o.wg = off(true, "mlp.gate_proj.weight");
      o.wu = off(true, "mlp.up_proj.weight");
      o.wd = off(true, "mlp.down_proj.weight");
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
      if (!options_.lora->has(target)) continue;
      const std::string m = p + std::string(lora_module_path(target));
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

Status LlamaModel::Impl::begin_decode(ParamProvider& provider, std::int64_t max_positions,
                                      std::int64_t max_rows) {
  if (max_positions <= 0 || max_rows <= 0 || max_rows > max_positions) {
    return invalid_argument("decoding needs 0 < rows <= positions, got rows " +
                            std::to_string(max_rows) + " and positions " +
                            std::to_string(max_positions));
  }
  if (options_.tensor_parallel.size > 1) {
    return failed_precondition("decoding a model split over " +
                               std::to_string(options_.tensor_parallel.size) +
                               " tensor-parallel ranks is not supported yet");
  }
  if (max_positions > config_.max_position_embeddings) {
    return invalid_argument("decoding " + std::to_string(max_positions) +
                            " positions exceeds max_position_embeddings " +
                            std::to_string(config_.max_position_embeddings));
  }
  const BlockSetup setup = decode_setup(max_rows);
  DecodeWorkspace measure;
  const std::uint64_t bytes =
      carve_decode(setup, config_.num_hidden_layers, max_positions, nullptr, &measure);
  STRATA_ASSIGN_OR_RETURN(
      void* base, provider.workspace(bytes, "KV cache and decoding activations (" +
                                                std::to_string(max_positions) + " positions)"));
  carve_decode(setup, config_.num_hidden_layers, max_positions, static_cast<std::byte*>(base),
               &dws_);
  decode_setup_ = setup;
  decode_setup_.base.decoded = dws_.nf4_weight;
  decode_positions_ = max_positions;
  decode_rows_ = max_rows;
  decoded_ = 0;
  workspace_ = nullptr;  // the training workspace, if any, was replaced
  STRATA_ASSIGN_OR_RETURN(
      decode_io_,
      provider.host_io(static_cast<std::uint64_t>(std::max(max_rows, setup.d.vocab)) * 4,
                       "decoding token ids and logits"));
  host_io_ = nullptr;  // the training one, if any, was replaced
  return Status::ok();
}

Result<const float*> LlamaModel::Impl::decode(ParamProvider& provider, const std::int32_t* ids,
                                              std::int64_t n) {
  if (decode_positions_ == 0) return failed_precondition("decode before begin_decode");
  if (n <= 0 || n > decode_rows_ || decoded_ + n > decode_positions_) {
    return invalid_argument(
        "decoding " + std::to_string(n) + " tokens after " + std::to_string(decoded_) +
        " exceeds the " + std::to_string(decode_positions_) + " positions (" +
        std::to_string(decode_rows_) + " at a time) begin_decode made room for");
  }
  for (std::int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= config_.vocab_size) {
      return invalid_argument("token " + std::to_string(ids[i]) +
                              " is outside the vocabulary [0, " +
                              std::to_string(config_.vocab_size) + ")");
    }
  }
  BlockSetup setup = decode_setup_;
  Dims& d = setup.d;
  d.rows = n;
  d.seq = n;
  const DType dt = d.dtype;
  const std::size_t eb = d.elem_bytes;
  const std::int64_t H = d.hidden, V = d.vocab, L = config_.num_hidden_layers;
  const auto& ops = device_.ops();
  auto& stream = device_.stream(device::StreamKind::kCompute);
  StepTimings timings;
  ProviderSession ps(provider, layout_, timings);
  const int embed = layout_.embed_group();

  auto* host = static_cast<std::byte*>(decode_io_);
  std::memcpy(host, ids, static_cast<std::size_t>(n) * 4);
  device_.copy_to_device(dws_.ids, host, static_cast<std::size_t>(n) * 4, stream);
  {
    STRATA_ASSIGN_OR_RETURN(const void* p, ps.acquire(embed));
    ps.prefetch(layout_.layer_group(0));
    ops.embedding_forward(dws_.ids, n, offset_ptr(p, embed_offset_, eb), H, dws_.xs[0], dt);
    ps.release(embed);
  }
  for (std::int64_t l = 0; l < L; ++l) {
    const auto li = static_cast<std::size_t>(l);
    STRATA_ASSIGN_OR_RETURN(const BlockWeights w, acquire_block(ps, l));
    if (l + 1 < L) {
      prefetch_block(ps, l + 1);
    } else {
      prefetch_head(ps);
    }
    BlockSetup dl = setup;
    dl.d.window = config_.window_of(l);
    detail::DecodeActs acts = dws_.acts;
    acts.x = dws_.xs[l % 2];
    STRATA_RETURN_IF_ERROR(detail::block_decode(ops, dl, w, acts, dws_.k_cache[li],
                                                dws_.v_cache[li], decoded_, dws_.xs[(l + 1) % 2]));
    release_block(ps, l);
  }
  // Head on the last token only.
  STRATA_ASSIGN_OR_RETURN(const HeadWeights head, acquire_head(ps));
  const void* last = offset_ptr(dws_.xs[L % 2], (n - 1) * H, eb);
  ops.rmsnorm_forward(last, head.norm, dws_.hf, dws_.rstd_final, 1, H, d.eps, dt);
  matmul(ops, dt, false, true, 1, V, H, dws_.hf, head.lm, dws_.logits, false);
  ops.cast(dws_.logits, dt, dws_.logits_f32, DType::kF32, V);
  release_head(ps);
  auto* logits = static_cast<float*>(decode_io_);
  device_.copy_to_host(logits, dws_.logits_f32, static_cast<std::size_t>(V) * 4, stream);
  stream.synchronize();
  STRATA_RETURN_IF_ERROR(device_.last_error());
  decoded_ += n;
  return static_cast<const float*>(logits);
}

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
          embedding_grad};
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

std::uint64_t LlamaModel::host_io_bytes(std::int64_t batch, std::int64_t seq, int tensor_parallel,
                                        int in_flight) {
  const std::int64_t split = tensor_parallel > 1 ? 3 * tensor_parallel + 2 : 0;
  return static_cast<std::uint64_t>(batch * seq * (3 * in_flight + split)) * 4;
}

}  // namespace strata::model
