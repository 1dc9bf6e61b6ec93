// MoeMlp: routing, the tokens permuted by expert, one SwiGLU per chosen expert over its block of
// tokens, and the weighted sum back; the same backwards.
#include "src/model/moe_mlp.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace strata::model::detail {

double MoeAux::loss() const {
  if (rows == 0) return 0;
  const double n = static_cast<double>(rows);
  double sum = 0;
  for (std::size_t e = 0; e < counts.size(); ++e) {
    sum += (static_cast<double>(counts[e]) / n) * (probs[e] / n);
  }
  return sum * static_cast<double>(counts.size());
}

void MoeAux::gradient(double scale, float* out) const {
  const double n = static_cast<double>(std::max<std::int64_t>(rows, 1));
  const double experts = static_cast<double>(counts.size());
  for (std::size_t e = 0; e < counts.size(); ++e) {
    out[e] = static_cast<float>(scale * experts * (static_cast<double>(counts[e]) / n) / n);
  }
}

void MoeAux::write(void* out) const {
  auto* p = static_cast<std::byte*>(out);
  const std::size_t n = counts.size() * 8;
  std::memcpy(p, counts.data(), n);
  std::memcpy(p + n, probs.data(), n);
  std::memcpy(p + 2 * n, &rows, 8);
}

void MoeAux::read(const void* in) {
  const auto* p = static_cast<const std::byte*>(in);
  const std::size_t n = counts.size() * 8;
  std::memcpy(counts.data(), p, n);
  std::memcpy(probs.data(), p + n, n);
  std::memcpy(&rows, p + 2 * n, 8);
}

Linear MoeMlp::projection(LoraTarget target, std::int64_t rows, std::int64_t out, std::int64_t in,
                          const void* weight, const LoraPair<const void*>& adapter,
                          const AdapterSpec* spec, const BaseFormat* format) const {
  Linear l;
  l.target = target;
  l.rows = rows;
  l.out = out;
  l.in = in;
  l.w = weight;
  l.adapter = adapter;
  l.lora = spec;
  l.base = format;
  l.dtype = dtype;
  return l;
}

void MoeMlp::layers_of(const ExpertWeights& w, std::int64_t expert, std::int64_t rows,
                       ExpertLayers& p) const {
  p.spec = *lora;
  p.spec.layer = expert_lora_layer(num_layers, experts, lora->layer, expert);
  p.gate = projection(LoraTarget::kGate, rows, ffn, hidden, w.w.gate, w.lora.gate, &p.spec, base);
  p.up = projection(LoraTarget::kUp, rows, ffn, hidden, w.w.up, w.lora.up, &p.spec, base);
  p.down = projection(LoraTarget::kDown, rows, hidden, ffn, w.w.down, w.lora.down, &p.spec, base);
  // Each projection's one product over the expert's rows writes its weight gradient.
  p.gate.writes_grads = p.up.writes_grads = p.down.writes_grads = true;
}

Linear MoeMlp::router_layer() const {
  static const BaseFormat kDense;  // never NF4
  return projection(LoraTarget::kRouter, tokens, experts, hidden, router, router_adapter, lora,
                    &kDense);
}

Status MoeMlp::forward(const device::Ops& ops, const void* x, const MoeActs& a, const MoeScratch& s,
                       void* out, MoeAux* aux) const {
  const std::int64_t T = tokens, E = experts, K = k, H = hidden, N = T * K;
  const std::size_t eb = dtype_size(dtype);
  auto& stream = device->stream(device::StreamKind::kCompute);
  // Router logits in the compute dtype (an nn.Linear, with its adapter where it has one), the
  // softmax and the choice in f32.
  router_layer().forward(ops, x, s.logits, a.t_router, s.lora_x);
  ops.cast(s.logits, dtype, s.logits_f32, DType::kF32, T * E);
  ops.moe_route(s.logits_f32, T, E, K, normalize, a.probs, a.chosen, a.weights);

  // The choice read back (and, counted, the probabilities summed over the tokens); each
  // expert's rows formed on the host, tokens in ascending order.
  const bool count = aux != nullptr && out != nullptr;
  device->copy_to_host(s.host_chosen, a.chosen, static_cast<std::size_t>(N) * 4, stream);
  if (count) {
    device->fill_zero(s.prob_sums, static_cast<std::size_t>(E) * 4, stream);
    ops.bias_grad(a.probs, s.prob_sums, T, E, DType::kF32);
    device->copy_to_host(s.host_prob_sums, s.prob_sums, static_cast<std::size_t>(E) * 4, stream);
  }
  stream.synchronize();
  STRATA_RETURN_IF_ERROR(device->last_error());
  const std::int32_t* chosen = s.host_chosen;
  std::int64_t* offsets = a.offsets;
  std::fill(offsets, offsets + E + 1, 0);
  for (std::int64_t i = 0; i < N; ++i) ++offsets[chosen[i] + 1];
  for (std::int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  std::vector<std::int64_t> next(offsets, offsets + E);
  for (std::int64_t slot = 0; slot < N; ++slot) {
    const std::int64_t r = next[static_cast<std::size_t>(chosen[slot])]++;
    s.host_tokens[r] = static_cast<std::int32_t>(slot / K);
    s.host_slots[r] = static_cast<std::int32_t>(slot);
  }
  if (count) {
    for (std::int64_t e = 0; e < E; ++e) {
      const auto i = static_cast<std::size_t>(e);
      aux->counts[i] += offsets[e + 1] - offsets[e];
      aux->probs[i] += s.host_prob_sums[e];
    }
    aux->rows += T;
  }
  device->copy_to_device(a.tokens, s.host_tokens, static_cast<std::size_t>(N) * 4, stream);
  device->copy_to_device(a.slots, s.host_slots, static_cast<std::size_t>(N) * 4, stream);
  // Each row's routing weight, gathered by its slot (a row gather of one-element rows).
  ops.embedding_forward(a.slots, N, a.weights, 1, a.row_weights, DType::kF32);

  const bool counted = out != nullptr;
  STRATA_RETURN_IF_ERROR(ep != nullptr ? run_dispatched(ops, x, a, s, counted)
                                       : run_local(ops, x, a, s, counted));
  if (out == nullptr) return Status::ok();
  // out[t] = sum over t's picks of weight * expert output, added in expert order.
  device->fill_zero(out, static_cast<std::size_t>(T * H) * eb, stream);
  ops.cast(a.out, dtype, s.rows_in, dtype, N * H);
  ops.scale_rows(s.rows_in, a.row_weights, N, H, dtype);
  ops.embedding_backward(a.tokens, N, s.rows_in, H, out, dtype);
  return Status::ok();
}

Status MoeMlp::backward(const device::Ops& ops, const void* x, const MoeActs& a,
                        const MoeScratch& s, const void* dy, void* dm, void* router_grad,
                        const LoraPair<void*>& router_adapter_grad, bool aux, void* dx) const {
  const std::int64_t T = tokens, E = experts, K = k, H = hidden, N = T * K;
  const std::size_t eb = dtype_size(dtype);
  auto& stream = device->stream(device::StreamKind::kCompute);
  // Each row's output gradient: the routing weight's gradient (its dot with the expert's
  // output), then times the weight, the expert output's.
  ops.embedding_forward(a.tokens, N, dy, H, s.rows_grad, dtype);
  ops.row_dots(s.rows_grad, a.out, N, H, a.slots, s.dweights, dtype);
  ops.scale_rows(s.rows_grad, a.row_weights, N, H, dtype);
  STRATA_RETURN_IF_ERROR(ep != nullptr ? back_dispatched(ops, a, s, dm)
                                       : back_local(ops, x, a, s, dm));
  device->fill_zero(dx, static_cast<std::size_t>(T * H) * eb, stream);
  ops.embedding_backward(a.tokens, N, s.rows_grad, H, dx, dtype);
  // The router: the routing weights' gradient (and the load-balancing loss's) through the top-k
  // and the softmax, then the projection's (and its adapter's).
  ops.moe_route_backward(a.probs, a.chosen, s.dweights, aux ? s.aux_grad : nullptr, T, E, K,
                         normalize, s.logits_f32);
  ops.cast(s.logits_f32, DType::kF32, s.logits, dtype, T * E);
  return router_layer().backward(ops, x, a.t_router, router_grad, nullptr, router_adapter_grad,
                                 s.logits, dx, true, s.lora_x, s.lora);
}

Status MoeMlp::run_local(const device::Ops& ops, const void* x, const MoeActs& a,
                         const MoeScratch& s, bool counted) const {
  const std::int64_t E = experts, H = hidden;
  const std::size_t eb = dtype_size(dtype);
  const std::int64_t* offsets = a.offsets;
  // The experts every data-parallel rank runs: those some rank's tokens chose.
  std::vector<double> rows(static_cast<std::size_t>(E));
  for (std::int64_t e = 0; e < E; ++e) {
    rows[static_cast<std::size_t>(e)] = static_cast<double>(offsets[e + 1] - offsets[e]);
  }
  STRATA_RETURN_IF_ERROR(source->sum_rows(rows));
  std::int64_t run = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    a.rows_all[e] = static_cast<std::int64_t>(rows[static_cast<std::size_t>(e)]);
    if (a.rows_all[e] > 0) ++run;
  }
  if (traffic != nullptr && counted) {
    traffic->run += run;
    traffic->skipped += E - run;
  }

  // Every expert this rank acquires asked for at once; then each over its rows, in expert order.
  for (std::int64_t e = 0; e < E; ++e) {
    if (acquires(a, e, offsets[e + 1] - offsets[e])) source->prefetch(e);
  }
  for (std::int64_t e = 0; e < E; ++e) {
    const std::int64_t first = offsets[e], n = offsets[e + 1] - first;
    if (!acquires(a, e, n)) continue;
    STRATA_ASSIGN_OR_RETURN(const ExpertWeights w, source->acquire(e));
    if (traffic != nullptr) traffic->bytes += source->bytes();
    if (n == 0) {  // another rank's tokens chose it: this rank joins the gather
      source->release(e);
      continue;
    }
    void* xe = offset_ptr(s.rows_in, first * H, eb);
    ops.embedding_forward(a.tokens + first, n, x, H, xe, dtype);
    expert_forward(ops, w, e, first, n, xe, a, s, offset_ptr(a.out, first * H, eb));
    source->release(e);
  }
  return Status::ok();
}

MoeMlp::Dispatch MoeMlp::dispatch_of(const MoeActs& a) const {
  const int ranks = ep->group->size(), me = ep->group->rank();
  const std::int64_t E = experts;
  Dispatch d;
  d.local = E / ranks;
  d.first = me * d.local;
  const auto count = [&](int rank, std::int64_t e) { return a.ep_counts[rank * E + e]; };
  d.to.assign(static_cast<std::size_t>(ranks), 0);
  d.from.assign(static_cast<std::size_t>(ranks), 0);
  d.start.assign(static_cast<std::size_t>(d.local + 1), 0);
  for (int q = 0; q < ranks; ++q) {
    for (std::int64_t l = 0; l < d.local; ++l) {
      d.to[static_cast<std::size_t>(q)] += count(me, q * d.local + l);
      d.from[static_cast<std::size_t>(q)] += count(q, d.first + l);
      d.start[static_cast<std::size_t>(l + 1)] += count(q, d.first + l);
    }
  }
  for (std::int64_t l = 0; l < d.local; ++l) {
    d.start[static_cast<std::size_t>(l + 1)] += d.start[static_cast<std::size_t>(l)];
  }
  return d;
}

void MoeMlp::upload_permutation(const MoeActs& a, const Dispatch& d, const MoeScratch& s) const {
  const int ranks = ep->group->size();
  const std::int64_t E = experts, rows = d.start.back();
  std::int32_t* to_experts = s.host_ep_index;        // [rows]: experts' order from travel order
  std::int32_t* to_travel = s.host_ep_index + rows;  // [rows]: and back
  std::int64_t travel = 0;  // block (q, l) in travel order: by sending rank, then expert
  std::vector<std::int64_t> at(d.start.begin(), d.start.end() - 1);  // each expert's next row
  for (int q = 0; q < ranks; ++q) {
    for (std::int64_t l = 0; l < d.local; ++l) {
      const std::int64_t n = a.ep_counts[q * E + d.first + l];
      std::int64_t& experts_at = at[static_cast<std::size_t>(l)];
      for (std::int64_t i = 0; i < n; ++i) {
        to_experts[experts_at + i] = static_cast<std::int32_t>(travel + i);
        to_travel[travel + i] = static_cast<std::int32_t>(experts_at + i);
      }
      experts_at += n;
      travel += n;
    }
  }
  device->copy_to_device(s.ep_index, s.host_ep_index, static_cast<std::size_t>(2 * rows) * 4,
                         device->stream(device::StreamKind::kCompute));
}

Status MoeMlp::run_dispatched(const device::Ops& ops, const void* x, const MoeActs& a,
                              const MoeScratch& s, bool counted) const {
  ExpertGroup& group = *ep->group;
  const std::int64_t E = experts, H = hidden, N = tokens * k;
  const std::size_t eb = dtype_size(dtype);
  if (E % group.size() != 0) {
    return invalid_argument("expert parallelism over " + std::to_string(group.size()) + " ranks: " +
                            std::to_string(E) + " experts do not split evenly over them");
  }
  // Every rank's rows for every expert, so each knows what it sends, what it receives and where
  // the rows go.
  std::vector<std::uint64_t> mine(static_cast<std::size_t>(E));
  for (std::int64_t e = 0; e < E; ++e) {
    mine[static_cast<std::size_t>(e)] = static_cast<std::uint64_t>(a.offsets[e + 1] - a.offsets[e]);
  }
  std::vector<std::uint64_t> all(static_cast<std::size_t>(E * group.size()));
  STRATA_RETURN_IF_ERROR(
      group.all_gather_host(mine.data(), all.data(), static_cast<int>(E), "rows for each expert"));
  for (std::size_t i = 0; i < all.size(); ++i) a.ep_counts[i] = static_cast<std::int64_t>(all[i]);
  const Dispatch d = dispatch_of(a);
  const std::int64_t received = d.start.back();
  if (received > ep->capacity) {
    return out_of_memory("expert parallelism: " + std::to_string(received) +
                         " token rows came to rank " + std::to_string(group.rank()) +
                         "'s experts, more than the " + std::to_string(ep->capacity) +
                         " its workspace holds");
  }
  // The experts this rank and its replicas over the data axis run: those some row chose.
  std::vector<double> rows(static_cast<std::size_t>(E), 0.0);
  for (std::int64_t l = 0; l < d.local; ++l) {
    rows[static_cast<std::size_t>(d.first + l)] = static_cast<double>(
        d.start[static_cast<std::size_t>(l + 1)] - d.start[static_cast<std::size_t>(l)]);
  }
  STRATA_RETURN_IF_ERROR(source->sum_rows(rows));
  std::int64_t run = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    a.rows_all[e] = static_cast<std::int64_t>(rows[static_cast<std::size_t>(e)]);
    const bool local = e >= d.first && e < d.first + d.local;
    if (local && a.rows_all[e] > 0) ++run;
  }
  if (traffic != nullptr && counted) {
    traffic->run += run;
    traffic->skipped += d.local - run;
  }

  // This rank's rows out to their experts' ranks; those that came, into the experts' order.
  std::vector<std::int64_t> out_counts(d.to), in_counts(d.from);
  for (auto& c : out_counts) c *= H;
  for (auto& c : in_counts) c *= H;
  ops.embedding_forward(a.tokens, N, x, H, s.rows_in, dtype);
  STRATA_RETURN_IF_ERROR(
      group.all_to_all_v(s.rows_in, out_counts, s.ep_a, in_counts, dtype, "tokens to experts"));
  upload_permutation(a, d, s);
  ops.embedding_forward(s.ep_index, received, s.ep_a, H, a.ep_in, dtype);

  for (std::int64_t l = 0; l < d.local; ++l) {
    const std::int64_t e = d.first + l;
    const std::int64_t n =
        d.start[static_cast<std::size_t>(l + 1)] - d.start[static_cast<std::size_t>(l)];
    if (acquires(a, e, n)) source->prefetch(e);
  }
  for (std::int64_t l = 0; l < d.local; ++l) {
    const std::int64_t e = d.first + l, first = d.start[static_cast<std::size_t>(l)];
    const std::int64_t n = d.start[static_cast<std::size_t>(l + 1)] - first;
    if (!acquires(a, e, n)) continue;
    STRATA_ASSIGN_OR_RETURN(const ExpertWeights w, source->acquire(e));
    if (traffic != nullptr) traffic->bytes += source->bytes();
    if (n == 0) {  // only a replica's rows chose it: this rank joins the gather
      source->release(e);
      continue;
    }
    expert_forward(ops, w, e, first, n, offset_ptr(a.ep_in, first * H, eb), a, s,
                   offset_ptr(s.ep_a, first * H, eb));
    source->release(e);
  }
  // The outputs back into travel order, and home: each row's output where run_local leaves it.
  ops.embedding_forward(s.ep_index + received, received, s.ep_a, H, s.ep_b, dtype);
  return group.all_to_all_v(s.ep_b, in_counts, a.out, out_counts, dtype, "expert outputs back");
}

Status MoeMlp::back_local(const device::Ops& ops, const void* x, const MoeActs& a,
                          const MoeScratch& s, void* dm) const {
  const std::int64_t E = experts, H = hidden;
  const std::size_t eb = dtype_size(dtype);
  const bool trains = source->trains();
  const std::int64_t* offsets = a.offsets;
  for (std::int64_t e = E - 1; e >= 0; --e) {
    if (acquires(a, e, offsets[e + 1] - offsets[e])) source->prefetch(e);
  }
  for (std::int64_t e = E - 1; e >= 0; --e) {
    const std::int64_t first = offsets[e], n = offsets[e + 1] - first;
    if (a.rows_all[e] == 0) continue;
    if (n == 0) {
      // Only other ranks' tokens chose it: this rank joins its gather (where acquiring is a
      // collective) and reduces its zero gradient, as the collectives require.
      if (source->gathers(e)) {
        STRATA_RETURN_IF_ERROR(source->acquire(e).status());
        if (traffic != nullptr) traffic->bytes += source->bytes();
        source->release(e);
      }
      if (trains) {
        STRATA_RETURN_IF_ERROR(source->acquire_grads(e, false).status());
        STRATA_RETURN_IF_ERROR(source->release_grads(e));
      }
      continue;
    }
    STRATA_ASSIGN_OR_RETURN(const ExpertWeights w, source->acquire(e));
    if (traffic != nullptr) traffic->bytes += source->bytes();
    ExpertGrads g;
    if (trains) {
      STRATA_ASSIGN_OR_RETURN(g, source->acquire_grads(e, true));
    }
    void* xe = offset_ptr(s.rows_in, first * H, eb);
    ops.embedding_forward(a.tokens + first, n, x, H, xe, dtype);
    STRATA_RETURN_IF_ERROR(expert_backward(ops, w, g, e, first, n, xe, a, s,
                                           offset_ptr(s.rows_grad, first * H, eb), dm));
    if (trains) STRATA_RETURN_IF_ERROR(source->release_grads(e));
    source->release(e);
  }
  return Status::ok();
}

Status MoeMlp::back_dispatched(const device::Ops& ops, const MoeActs& a, const MoeScratch& s,
                               void* dm) const {
  ExpertGroup& group = *ep->group;
  const std::int64_t H = hidden;
  const std::size_t eb = dtype_size(dtype);
  const Dispatch d = dispatch_of(a);
  const std::int64_t received = d.start.back();
  std::vector<std::int64_t> out_counts(d.to), in_counts(d.from);
  for (auto& c : out_counts) c *= H;
  for (auto& c : in_counts) c *= H;
  // The rows' output gradients out to their experts' ranks, into the experts' order.
  STRATA_RETURN_IF_ERROR(group.all_to_all_v(s.rows_grad, out_counts, s.ep_a, in_counts, dtype,
                                            "output gradients to experts"));
  upload_permutation(a, d, s);
  ops.embedding_forward(s.ep_index, received, s.ep_a, H, s.ep_b, dtype);
  const bool trains = source->trains();
  for (std::int64_t l = d.local - 1; l >= 0; --l) {
    const std::int64_t e = d.first + l;
    const std::int64_t n =
        d.start[static_cast<std::size_t>(l + 1)] - d.start[static_cast<std::size_t>(l)];
    if (acquires(a, e, n)) source->prefetch(e);
  }
  for (std::int64_t l = d.local - 1; l >= 0; --l) {
    const std::int64_t e = d.first + l, first = d.start[static_cast<std::size_t>(l)];
    const std::int64_t n = d.start[static_cast<std::size_t>(l + 1)] - first;
    if (a.rows_all[e] == 0) continue;
    if (n == 0) {  // only a replica's rows chose it: join its gather, reduce a zero gradient
      if (source->gathers(e)) {
        STRATA_RETURN_IF_ERROR(source->acquire(e).status());
        if (traffic != nullptr) traffic->bytes += source->bytes();
        source->release(e);
      }
      if (trains) {
        STRATA_RETURN_IF_ERROR(source->acquire_grads(e, false).status());
        STRATA_RETURN_IF_ERROR(source->release_grads(e));
      }
      continue;
    }
    STRATA_ASSIGN_OR_RETURN(const ExpertWeights w, source->acquire(e));
    if (traffic != nullptr) traffic->bytes += source->bytes();
    ExpertGrads g;
    if (trains) {
      STRATA_ASSIGN_OR_RETURN(g, source->acquire_grads(e, true));
    }
    STRATA_RETURN_IF_ERROR(expert_backward(ops, w, g, e, first, n,
                                           offset_ptr(a.ep_in, first * H, eb), a, s,
                                           offset_ptr(s.ep_b, first * H, eb), dm));
    if (trains) STRATA_RETURN_IF_ERROR(source->release_grads(e));
    source->release(e);
  }
  // The rows' input gradients back into travel order, and home.
  ops.embedding_forward(s.ep_index + received, received, s.ep_b, H, s.ep_a, dtype);
  return group.all_to_all_v(s.ep_a, in_counts, s.rows_grad, out_counts, dtype,
                            "input gradients back");
}

void MoeMlp::expert_forward(const device::Ops& ops, const ExpertWeights& w, std::int64_t e,
                            std::int64_t first, std::int64_t n, const void* xe, const MoeActs& a,
                            const MoeScratch& s, void* out) const {
  const std::size_t eb = dtype_size(dtype);
  ExpertLayers p;
  layers_of(w, e, n, p);
  void* gate = offset_ptr(a.gate, first * ffn, eb);
  void* up = offset_ptr(a.up, first * ffn, eb);
  void* m = offset_ptr(a.m, first * ffn, eb);
  p.gate.forward(ops, xe, gate, t_of(a.t_gate, first), s.lora_x);
  p.up.forward(ops, xe, up, t_of(a.t_up, first), s.lora_x);
  ops.swiglu_forward(gate, up, m, n * ffn, dtype);
  p.down.forward(ops, m, out, t_of(a.t_down, first), s.lora_x);
}

Status MoeMlp::expert_backward(const device::Ops& ops, const ExpertWeights& w, const ExpertGrads& g,
                               std::int64_t e, std::int64_t first, std::int64_t n, const void* xe,
                               const MoeActs& a, const MoeScratch& s, void* dy, void* dm) const {
  const std::size_t eb = dtype_size(dtype);
  ExpertLayers p;
  layers_of(w, e, n, p);
  void* gate = offset_ptr(a.gate, first * ffn, eb);
  void* up = offset_ptr(a.up, first * ffn, eb);
  const void* m = offset_ptr(a.m, first * ffn, eb);
  void* dme = offset_ptr(dm, first * ffn, eb);
  STRATA_RETURN_IF_ERROR(p.down.backward(ops, m, t_of(a.t_down, first), g.w.down, nullptr,
                                         g.lora.down, dy, dme, false, s.lora_x, s.lora));
  // In place: gate and up are read here for the last time.
  ops.swiglu_backward(dme, gate, up, gate, up, n * ffn, dtype);
  STRATA_RETURN_IF_ERROR(p.gate.backward(ops, xe, t_of(a.t_gate, first), g.w.gate, nullptr,
                                         g.lora.gate, gate, dy, false, s.lora_x, s.lora));
  return p.up.backward(ops, xe, t_of(a.t_up, first), g.w.up, nullptr, g.lora.up, up, dy, true,
                       s.lora_x, s.lora);
}

}  // namespace strata::model::detail
