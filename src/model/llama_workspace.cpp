// The model's workspaces laid out: what each activation, gradient and scratch buffer takes.
#include "src/model/llama_workspace.h"

namespace strata::model::detail {
namespace {

// The host counts an MoE layer keeps: its offsets (experts + 1), its rows over the ranks
// (experts) and, under expert parallelism, every rank's rows for every expert.
std::size_t moe_host_counts(const Dims& d) {
  return static_cast<std::size_t>(2 * d.experts + 1 +
                                  (d.expert_ranks > 1 ? d.expert_ranks * d.experts : 0));
}

// An MoE layer's kept routing and expert outputs; its gate, up and m are the layer's own.
// `offsets`: host room for moe_host_counts.
MoeActs carve_moe_acts(const Dims& d, const AdapterSpec& lora, Carver& c, std::int64_t* offsets,
                       void* gate, void* up, void* m) {
  const std::int64_t N = d.rows * d.experts_per_token, X = d.expert_rows();
  MoeActs a;
  a.probs = c.f32(d.rows * d.experts);
  a.chosen = c.i32(N);
  a.weights = c.f32(N);
  a.tokens = c.i32(N);
  a.slots = c.i32(N);
  a.row_weights = c.f32(N);
  a.gate = gate;
  a.up = up;
  a.m = m;
  a.out = c.take(N * d.hidden, d.elem_bytes);
  a.offsets = offsets;
  a.rows_all = offsets + d.experts + 1;
  if (d.expert_ranks > 1) {
    a.ep_in = c.take(X * d.hidden, d.elem_bytes);
    a.ep_counts = a.rows_all + d.experts;
  }
  // The experts' adapters' t, by projection, over the rows the experts run.
  const auto t = [&](LoraTarget target) {
    return lora.rank > 0 && lora.on[static_cast<int>(target)] ? c.take(X * lora.rank, d.elem_bytes)
                                                              : nullptr;
  };
  a.t_gate = t(LoraTarget::kGate);
  a.t_up = t(LoraTarget::kUp);
  a.t_down = t(LoraTarget::kDown);
  // The router's, over every token.
  if (lora.rank > 0 && lora.on[static_cast<int>(LoraTarget::kRouter)]) {
    a.t_router = c.take(d.rows * lora.rank, d.elem_bytes);
  }
  return a;
}

// The scratch the MoE layers share (its host part placed by the model).
MoeScratch carve_moe_scratch(const Dims& d, const AdapterSpec& lora, Carver& c) {
  const std::int64_t R = d.rows, E = d.experts, N = d.rows * d.experts_per_token;
  const std::int64_t X = d.expert_rows();
  MoeScratch s;
  s.logits = c.take(R * E, d.elem_bytes);
  s.logits_f32 = c.f32(R * E);
  s.rows_in = c.take(N * d.hidden, d.elem_bytes);
  s.rows_grad = c.take(N * d.hidden, d.elem_bytes);
  s.dweights = c.f32(N);
  s.prob_sums = c.f32(E);
  s.aux_grad = c.f32(E);
  // The experts' and the router's adapters: t's gradient, and with dropout the dropped input
  // and its gradient (the router's over the tokens, fewer than the experts' rows).
  const auto on = [&](LoraTarget t) { return lora.on[static_cast<int>(t)]; };
  const bool adapted = lora.rank > 0 && (on(LoraTarget::kGate) || on(LoraTarget::kUp) ||
                                         on(LoraTarget::kDown) || on(LoraTarget::kRouter));
  if (adapted) s.lora.dt = c.take(X * lora.rank, d.elem_bytes);
  if (adapted && lora.dropout > 0) {
    const std::int64_t widest = std::max(d.hidden, d.expert_ffn);
    s.lora_x = c.take(X * widest, d.elem_bytes);
    s.lora.dx = c.take(X * widest, d.elem_bytes);
  }
  if (d.expert_ranks > 1) {  // the rows on their way, and the permutations between orders
    s.ep_a = c.take(X * d.hidden, d.elem_bytes);
    s.ep_b = c.take(X * d.hidden, d.elem_bytes);
    s.ep_index = c.i32(2 * X);
  }
  return s;
}

// Layer `i`'s activations, their input at `x`, for rows of `d`: `rows_apart` keeps this rank's
// rows of the norm outputs only (a_local, b_local; the whole ones gathered into a_shared,
// b_shared).
template <typename Act, typename F32>
BlockActs carve_acts(const BlockSetup& setup, Act act, F32 f32, bool rows_apart, void* a_shared,
                     void* b_shared) {
  const Dims& d = setup.d;
  const TensorSplit& sp = setup.split;
  const std::int64_t R = d.rows, H = d.hidden, Q = d.q_dim, KV = d.kv_dim, F = d.mlp_elems();
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
  a.gate = act(F);
  a.up = act(F);
  a.m = act(F);
  for (int t = 0; t < kNumLoraTargets; ++t) {
    const bool router = t == static_cast<int>(LoraTarget::kRouter);  // in the MoE acts
    if (setup.lora.on[t] && !router) a.lora_t[t] = act(R * setup.lora.rank);
  }
  return a;
}

}  // namespace

std::uint64_t carve_workspace(const BlockSetup& setup, const StageShape& stage, std::byte* base,
                              Workspace* ws) {
  const Dims& d = setup.d;
  const TensorSplit& sp = setup.split;
  Carver c{base};
  const std::size_t eb = d.elem_bytes;
  const std::int64_t R = d.rows, H = d.hidden, Q = d.q_dim, KV = d.kv_dim;
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
  ws->moe = d.experts > 0 ? carve_moe_scratch(d, setup.lora, c) : MoeScratch{};
  ws->moe_offsets.clear();
  const auto layer_acts = [&]() {
    BlockActs a = carve_acts(setup, act, f32, rows_apart, a_shared, b_shared);
    a.lora_x = lora_x;
    a.partial = ws->partial;
    if (d.experts > 0) {
      // Each kept set of MoE activations has its expert offsets on the host.
      ws->moe_offsets.emplace_back(moe_host_counts(d), 0);
      a.moe = carve_moe_acts(d, setup.lora, c, ws->moe_offsets.back().data(), a.gate, a.up, a.m);
    }
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
      if (stage.routing_bytes > 0) {
        const bool last = stage.heads && ci + 1 == stage.chunks.size();
        const auto routing = [&]() {
          return c.take(static_cast<std::int64_t>(stage.routing_bytes), 1);
        };
        ch.routing_in = first ? nullptr : routing();
        ch.totals_out = first ? nullptr : routing();
        ch.routing_out = last ? nullptr : routing();
        ch.totals_in = last ? nullptr : routing();
      }
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
  if (setup.lora.rank > 0 && sp.split()) s.lora_grad = act(setup.lora.rank * d.max_in());
  if (lora_dropout) s.lora_dx = act(R * d.max_in());
  const std::uint64_t union_start = align_up(c.off, kAlignBytes);
  s.dm = act(d.mlp_elems());
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

std::uint64_t carve_decode(const BlockSetup& setup, std::int64_t num_layers, std::int64_t positions,
                           std::byte* base, DecodeWorkspace* ws) {
  const Dims& d = setup.d;
  Carver c{base};
  const std::size_t eb = d.elem_bytes;
  const std::int64_t R = d.rows, H = d.hidden, Q = d.q_dim, KV = d.kv_dim;
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
  a.gate = act(d.mlp_elems());
  a.up = act(d.mlp_elems());
  a.m = act(d.mlp_elems());
  if (setup.lora.rank > 0) a.lora_t = act(R * setup.lora.rank);
  if (d.experts > 0) {
    ws->moe_offsets.assign(moe_host_counts(d), 0);
    a.moe = carve_moe_acts(d, setup.lora, c, ws->moe_offsets.data(), a.gate, a.up, a.m);
    ws->moe = carve_moe_scratch(d, setup.lora, c);
  }
  if (setup.base.nf4) ws->nf4_weight = act(d.max_weight());
  ws->rstd_final = c.f32(1);
  ws->hf = act(H);
  ws->logits = act(d.vocab);
  ws->logits_f32 = c.f32(d.vocab * setup.split.size);
  if (setup.split.split()) ws->logits_local_f32 = c.f32(d.vocab);
  return c.off;
}

}  // namespace strata::model::detail
