// Private to the model: a mixture-of-experts MLP (transformers' Qwen3MoeSparseMoeBlock and
// MixtralSparseMoeBlock), the piece an MoE layer's block calls where a dense layer calls its
// DenseMlp. A router scores the experts for each token; the top k are chosen; the tokens are
// permuted so that each expert's tokens are contiguous, each chosen expert runs one SwiGLU over
// its block of tokens (three GEMMs), and its outputs, times their routing weights, are added
// back to their tokens. The experts come from an ExpertSource once the router has chosen, and an
// expert no token chose is never asked for: its gradient stays zero without any work. Over
// data-parallel ranks, "no token" is no token of any rank's micro-batch: every rank reduces the
// gradients of the same experts (the union of their choices) in the same order, and gathers
// them where ZeRO-3 partitions them, as those collectives require; an expert a rank has no rows
// for costs it no compute, and no fetch where acquiring it is not a collective.
//
// Under expert parallelism each rank of the expert group runs its share of the experts: a
// token's rows travel to the ranks of its experts and their outputs back (all_to_all_v), in
// forward and again in backward, and each expert runs over the rows every rank of the group
// sent it, in the group's token order (rank 0's tokens, then rank 1's, each in its order), as
// one rank running the group's tokens as one micro-batch would.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "src/model/parallel_layers.h"
#include "strata/core/status.h"
#include "strata/device/device.h"
#include "strata/model/expert_group.h"
#include "strata/model/llama.h"

namespace strata::model::detail {

// One expert's projections (or their gradients): gate and up [ffn, hidden], down [hidden, ffn].
template <typename Ptr>
struct ExpertTensors {
  Ptr gate{};
  Ptr up{};
  Ptr down{};
};
// An expert as its MLP computes with it: the projections (NF4 under QLoRA) and, with LoRA, their
// adapters (nullptrs where a projection has none); or their gradients (a frozen base's null).
template <typename Ptr>
struct ExpertParts {
  ExpertTensors<Ptr> w;
  ExpertTensors<LoraPair<Ptr>> lora;
};
using ExpertWeights = ExpertParts<const void*>;
using ExpertGrads = ExpertParts<void*>;

// Where one MoE layer's experts come from (the model's parameter provider). The MLP prefetches
// every chosen expert as soon as the routing is known, then acquires each in expert order.
class ExpertSource {
 public:
  virtual ~ExpertSource() = default;
  virtual void prefetch(std::int64_t expert) = 0;
  virtual Result<ExpertWeights> acquire(std::int64_t expert) = 0;
  virtual void release(std::int64_t expert) = 0;
  // Whether the experts train (their base or their adapters): gradients are asked for in
  // backward.
  virtual bool trains() const = 0;
  // With `computes`, the expert's backward writes its base gradients (each projection's
  // product with beta 0), so they come unfilled; without, zeros (its rows are another rank's).
  virtual Result<ExpertGrads> acquire_grads(std::int64_t expert, bool computes) = 0;
  virtual Status release_grads(std::int64_t expert) = 0;
  // Each expert's rows on this rank in, their sum over the data-parallel ranks out (a
  // collective: ParamProvider::sum_expert_rows).
  virtual Status sum_rows(std::vector<double>& rows) = 0;
  // One expert's working-copy bytes (every expert of a layer is laid out alike).
  virtual std::uint64_t bytes() const = 0;
  // Whether acquiring `expert` is a collective (ZeRO-3's gather): then a rank joins it for an
  // expert only other ranks' tokens chose; else it does not fetch such an expert at all.
  virtual bool gathers(std::int64_t expert) const = 0;
};

// What an MoE layer keeps from its forward for its backward (device pointers unless noted; a
// token's k picks are its "slots" t k + j, and the slots sorted by expert, then token, its
// "rows").
struct MoeActs {
  float* probs = nullptr;          // [tokens, experts] f32: the router's softmax
  std::int32_t* chosen = nullptr;  // [tokens, k]
  float* weights = nullptr;        // [tokens, k] f32
  std::int32_t* tokens = nullptr;  // [tokens k]: each row's token
  std::int32_t* slots = nullptr;   // [tokens k]: each row's slot
  float* row_weights = nullptr;    // [tokens k] f32: each row's routing weight
  void* gate = nullptr;            // [tokens k, expert_ffn] (gradients in place in backward)
  void* up = nullptr;              // [tokens k, expert_ffn]
  void* m = nullptr;               // [tokens k, expert_ffn]: silu(gate) * up
  void* out = nullptr;             // [tokens k, hidden]: each row's expert output, unweighted
  // With LoRA on the experts: each adapted projection's t = dropout(x) A^T, [tokens k, r]; on
  // the router: its t [tokens, r].
  void* t_gate = nullptr;
  void* t_up = nullptr;
  void* t_down = nullptr;
  void* t_router = nullptr;
  std::int64_t* offsets = nullptr;  // host [experts + 1]: each expert's first row
  // host [experts]: each expert's rows summed over the data-parallel ranks; the experts with
  // some are the ones this layer runs (acquires, and in backward reduces), on every rank.
  std::int64_t* rows_all = nullptr;
  // Expert parallelism: the rows this rank's experts ran, as they came from the group's ranks
  // ([capacity, hidden]: by expert, then sending rank, then token; gate, up, m, out's partner and
  // the adapters' t hold these rows then, not this rank's own), and every rank's rows for every
  // expert (host [group size x experts]), which place them.
  void* ep_in = nullptr;
  std::int64_t* ep_counts = nullptr;
};

// What transformers' load_balancing_loss_func sums over a micro-batch's MoE layers: N token
// rows, per expert the picks that chose it (f_e = counts_e / N) and its probability summed over
// the rows (P_e = probs_e / N); the loss is experts * sum_e f_e P_e.
struct MoeAux {
  std::vector<std::int64_t> counts;
  std::vector<double> probs;
  std::int64_t rows = 0;

  void reset(std::int64_t experts) {
    counts.assign(static_cast<std::size_t>(experts), 0);
    probs.assign(static_cast<std::size_t>(experts), 0.0);
    rows = 0;
  }
  double loss() const;
  // scale d(loss)/d(probability of expert e) for every token row: scale E f_e / N, into out
  // [experts] (host f32).
  void gradient(double scale, float* out) const;
  // As bytes, to cross pipeline stages: the counts, the sums and the rows, 8 bytes each, so a
  // stage continues the sums where the one before stopped (the order one stage adds in).
  static std::size_t bytes(std::int64_t experts) {
    return static_cast<std::size_t>(2 * experts + 1) * 8;
  }
  void write(void* out) const;
  void read(const void* in);  // of as many experts as this one holds
};

// Scratch the MoE layers share (not kept).
struct MoeScratch {
  void* logits = nullptr;       // [tokens, experts] compute dtype (their gradient in backward)
  float* logits_f32 = nullptr;  // [tokens, experts] (their gradient in backward)
  void* rows_in = nullptr;      // [tokens k, hidden]: gathered inputs; in backward input gradients
  void* rows_grad = nullptr;    // [tokens k, hidden]: backward: the output gradient's rows
  float* dweights = nullptr;    // [tokens k] f32: the routing weights' gradient
  float* prob_sums = nullptr;   // [experts] f32: each expert's probability summed over the tokens
  float* aux_grad = nullptr;    // [experts] f32: the load-balancing loss's gradient (backward)
  // With LoRA on the experts or the router: an adapter's t gradient [tokens k, r]; with
  // dropout, its dropped input and that input's gradient [tokens k, max(hidden, ffn)].
  AdapterScratch lora;
  void* lora_x = nullptr;
  // Pinned host: the choice read back and each row's token and slot formed from it ([tokens k]
  // each), the probability sums read back and the aux gradient on its way ([experts] each).
  std::int32_t* host_chosen = nullptr;
  std::int32_t* host_tokens = nullptr;
  std::int32_t* host_slots = nullptr;
  float* host_prob_sums = nullptr;
  float* host_aux_grad = nullptr;
  // Expert parallelism: the rows on their way ([capacity, hidden] each) and the permutations
  // between the order they travel in (by rank, then expert) and the experts' (by expert, then
  // rank): device [2 x capacity] int32, and its host staging.
  void* ep_a = nullptr;
  void* ep_b = nullptr;
  std::int32_t* ep_index = nullptr;
  std::int32_t* host_ep_index = nullptr;
  // A micro-batch's routing counts on their way across pipeline stages (MoeAux::bytes).
  std::byte* host_routing = nullptr;

  // Over `ranks` ranks of expert parallelism (1: none), host_ep_index's [2 x capacity] besides.
  static std::uint64_t host_bytes(std::int64_t tokens, std::int64_t experts, std::int64_t k,
                                  std::int64_t ranks = 1) {
    const std::int64_t ep = ranks > 1 ? 2 * ranks * tokens * k : 0;
    return static_cast<std::uint64_t>(3 * tokens * k + 2 * experts + ep) * 4 +
           MoeAux::bytes(experts);
  }
  // The host pointers laid out from `host` (host_bytes of it).
  void place_host(std::byte* host, std::int64_t tokens, std::int64_t experts, std::int64_t k,
                  std::int64_t ranks = 1) {
    host_chosen = reinterpret_cast<std::int32_t*>(host);
    host_tokens = host_chosen + tokens * k;
    host_slots = host_tokens + tokens * k;
    host_prob_sums = reinterpret_cast<float*>(host_slots + tokens * k);
    host_aux_grad = host_prob_sums + experts;
    host_ep_index = ranks > 1 ? reinterpret_cast<std::int32_t*>(host_aux_grad + experts) : nullptr;
    host_routing = reinterpret_cast<std::byte*>(host_aux_grad + experts +
                                                (ranks > 1 ? 2 * ranks * tokens * k : 0));
  }
};

// Expert parallelism for one MoE layer: its experts shared out over the ranks of `group` (the
// process grid's expert group), rank p running experts [p L, (p + 1) L), L = experts / ranks;
// the rows this rank's experts receive are at most `capacity` (the activations' and scratch's
// expert rows hold that many).
struct ExpertParallel {
  ExpertGroup* group = nullptr;
  std::int64_t capacity = 0;
};

struct MoeMlp {
  device::Device* device = nullptr;
  std::int64_t tokens = 0, hidden = 0, experts = 0, k = 0, ffn = 0;
  bool normalize = false;  // the top-k weights renormalized
  DType dtype = DType::kF32;
  const void* router = nullptr;          // [experts, hidden], in the compute dtype (never NF4)
  LoraPair<const void*> router_adapter;  // its adapter where it has one (PEFT's "gate")
  ExpertSource* source = nullptr;
  const BaseFormat* base = nullptr;  // NF4 experts are decoded before their products
  // The adapters' settings (rank 0: none), `layer` this MoE layer's; an expert's adapters draw
  // their dropout masks as a layer numbered num_layers + layer x experts + expert would
  // (expert_lora_layer).
  const AdapterSpec* lora = nullptr;
  std::int64_t num_layers = 0;
  ExpertTraffic* traffic = nullptr;    // counted where given
  const ExpertParallel* ep = nullptr;  // experts over several ranks where given

  // x [tokens, hidden] -> acts, then unless out is null out [tokens, hidden] = the weighted sum
  // of each token's experts (a null out, the forward recomputed for the backward, stops before
  // the sum). `aux`, where given, counts this layer's routing. Under expert parallelism every
  // rank of the group calls it (and backward) in the same order: they exchange rows.
  Status forward(const device::Ops& ops, const void* x, const MoeActs& a, const MoeScratch& s,
                 void* out, MoeAux* aux) const;
  // dy [tokens, hidden] -> dx [tokens, hidden] (overwritten); the experts' gradients (+=) where
  // they train, router_grad (+=) unless null and the router's adapter's (+=) where it has one;
  // with s.aux_grad the load-balancing loss's term. `dm` [tokens k, ffn] (expert parallelism:
  // [capacity, ffn]) is scratch.
  Status backward(const device::Ops& ops, const void* x, const MoeActs& a, const MoeScratch& s,
                  const void* dy, void* dm, void* router_grad,
                  const LoraPair<void*>& router_adapter_grad, bool aux, void* dx) const;

 private:
  // One expert's three projections over its `rows` rows, with its adapters and their settings
  // (which the Linears point at: filled in place, never copied).
  struct ExpertLayers {
    AdapterSpec spec;
    Linear gate, up, down;
    ExpertLayers() = default;
    ExpertLayers(const ExpertLayers&) = delete;
    ExpertLayers& operator=(const ExpertLayers&) = delete;
  };
  // A projection of this layer over `rows` rows: its weight (in `format`), its adapter, whose
  // settings are `spec`.
  Linear projection(LoraTarget target, std::int64_t rows, std::int64_t out, std::int64_t in,
                    const void* weight, const LoraPair<const void*>& adapter,
                    const AdapterSpec* spec, const BaseFormat* format) const;
  void layers_of(const ExpertWeights& w, std::int64_t expert, std::int64_t rows,
                 ExpertLayers& p) const;
  // The router as a projection over every token: logits [tokens, experts] = x router^T, plus its
  // adapter's product (t in MoeActs::t_router), whose dropout masks are the layer's own.
  Linear router_layer() const;
  // Expert `e` over its `n` rows, the first of them row `first` of the activations: inputs `xe`,
  // outputs `out` [n, hidden]. Backward: `dy` the rows' output gradient in, their input
  // gradient out (in place); `dm` [rows, ffn] scratch at the same rows.
  void expert_forward(const device::Ops& ops, const ExpertWeights& w, std::int64_t e,
                      std::int64_t first, std::int64_t n, const void* xe, const MoeActs& a,
                      const MoeScratch& s, void* out) const;
  Status expert_backward(const device::Ops& ops, const ExpertWeights& w, const ExpertGrads& g,
                         std::int64_t e, std::int64_t first, std::int64_t n, const void* xe,
                         const MoeActs& a, const MoeScratch& s, void* dy, void* dm) const;
  // Where the rows go under expert parallelism, from every rank's counts (a.ep_counts).
  struct Dispatch {
    std::int64_t first = 0, local = 0;   // this rank's experts: [first, first + local)
    std::vector<std::int64_t> to, from;  // rows to and from each rank of the group
    std::vector<std::int64_t> start;     // [local + 1]: each local expert's first row received
  };
  Dispatch dispatch_of(const MoeActs& a) const;
  // The permutations between the rows as they travel and as the experts take them, to the
  // device (s.ep_index: experts' order from travel order, then back).
  void upload_permutation(const MoeActs& a, const Dispatch& d, const MoeScratch& s) const;
  // The experts' part of forward and backward: this rank's rows through every expert they chose,
  // or (dispatched) every rank's rows through this rank's experts. Forward fills a.rows_all and
  // a.out; backward takes s.rows_grad (each row's output gradient) and leaves there each row's
  // input gradient.
  Status run_local(const device::Ops& ops, const void* x, const MoeActs& a, const MoeScratch& s,
                   bool counted) const;
  Status run_dispatched(const device::Ops& ops, const void* x, const MoeActs& a,
                        const MoeScratch& s, bool counted) const;
  Status back_local(const device::Ops& ops, const void* x, const MoeActs& a, const MoeScratch& s,
                    void* dm) const;
  Status back_dispatched(const device::Ops& ops, const MoeActs& a, const MoeScratch& s,
                         void* dm) const;
  // Whether this rank acquires expert `e`, which `rows` of this rank's (or, dispatched, its
  // group's) rows chose: some did, or only other ranks' did and acquiring is a collective
  // (ZeRO-3's gather).
  bool acquires(const MoeActs& a, std::int64_t e, std::int64_t rows) const {
    return rows > 0 || (a.rows_all[e] > 0 && source->gathers(e));
  }
  // Row `first`'s place in an adapter's t [rows, r]; null without adapters.
  void* t_of(void* t, std::int64_t first) const {
    return t == nullptr ? nullptr : offset_ptr(t, first * lora->rank, dtype_size(dtype));
  }
};

}  // namespace strata::model::detail
