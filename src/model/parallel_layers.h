// Private to the model: the layers a decoder block is made of, in the spirit of Megatron-Core's
// tensor_parallel/layers.py and PEFT's LoraLayer. A Linear is one projection, y = x W^T (+ b),
// its base weight dense or NF4, with the LoRA adapter that wraps it where it has one. A
// column-parallel layer holds projections that read one input and are split by output features
// over the tensor-parallel group (q/k/v, gate/up); a row-parallel one holds a projection split by
// input features (o_proj, down_proj). Each owns its collectives, which TensorSplit runs: the
// all-reduce of a split product (the reduce-scatter to this rank's rows and the all-gather of
// every rank's rows under sequence parallelism). On one rank every collective is a no-op.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/device/ops.h"
#include "strata/model/lora.h"
#include "strata/model/tensor_group.h"

namespace strata::model::detail {

// Pointer `elems` elements of `elem_bytes` past `base`.
inline void* offset_ptr(const void* base, std::int64_t elems, std::size_t elem_bytes) {
  return const_cast<std::byte*>(static_cast<const std::byte*>(base)) +
         static_cast<std::size_t>(elems) * elem_bytes;
}

// How the model is split over its tensor-parallel group (ModelOptions::tensor_parallel), and
// the collectives over it.
struct TensorSplit {
  TensorGroup* group = nullptr;  // null where only sizes are asked
  int size = 1;
  int rank = 0;
  // Ranks holding this rank's kv head whole (kv heads fewer than ranks): k's and v's weight
  // gradients are summed over them.
  std::int64_t kv_replicas = 1;
  std::int64_t vocab_begin = 0;  // this rank's first token of the vocabulary
  // Sequence parallelism: the residual stream and the norms hold rows [row_begin, row_begin +
  // local_rows) of the rows; without it local_rows = rows.
  bool seq_parallel = false;
  std::int64_t rows = 0, local_rows = 0, row_begin = 0;
  DType dtype = DType::kF32;
  std::size_t elem_bytes = 4;

  bool split() const { return size > 1; }
  // The rows of `full` [rows, n] that are this rank's (row_begin on).
  void* row_slot(void* full, std::int64_t n) const;
  // `full` [rows, n] made whole from every rank's rows: `local` [local_rows, n], or (null) the
  // row_slot each wrote in place. Nothing without sequence parallelism.
  Status gather_rows(void* full, std::int64_t n, std::string_view what,
                     const void* local = nullptr) const;
  // The ranks' partial products `partial` [rows, n] summed into `out`: this rank's rows of the
  // sum under sequence parallelism (reduce-scatter), else every row in place (out must be
  // partial).
  Status sum_partial(void* partial, void* out, std::int64_t n, std::string_view what) const;
  // buffer [n] summed over the group (nothing on one rank).
  Status sum(void* buffer, std::int64_t n, std::string_view what) const;
};

// What every adapter of the model shares (PEFT's LoraConfig as the model runs it), and the
// micro-batch's dropout mask key with the layer that picks each adapter's own mask
// (lora_dropout_key). rank 0: no adapters.
struct AdapterSpec {
  std::int64_t rank = 0;
  bool on[kNumLoraTargets] = {};  // which projections have adapters
  float scaling = 0;
  float dropout = 0;  // 0 outside training
  std::uint64_t key = 0;
  std::int64_t layer = 0;
};

// A base weight's format: dense in the compute dtype, or NF4 (QLoRA), decoded into `decoded`
// (workspace of the largest projection) just before its product, one projection at a time.
struct BaseFormat {
  bool nf4 = false;
  void* decoded = nullptr;

  // A base weight `w` of `elems` elements as its product reads it: itself, or decoded.
  const void* weight(const device::Ops& ops, const void* w, std::int64_t elems, DType dtype) const {
    if (!nf4) return w;
    ops.dequantize_nf4(w, elems, decoded, dtype);
    return decoded;
  }
};

// Thin wrapper over Ops::gemm for row-major operands with tight leading dimensions:
// C[m, n] = alpha op(A) op(B) (+ C if accumulate).
void matmul(const device::Ops& ops, DType dtype, bool trans_a, bool trans_b, std::int64_t m,
            std::int64_t n, std::int64_t k, const void* a, const void* b, void* c, bool accumulate,
            float alpha = 1.0f);

template <typename Ptr>
struct LoraPair {
  Ptr a = nullptr;  // lora_A [r, in]
  Ptr b = nullptr;  // lora_B [out, r]
};

// Scratch a Linear's backward shares with every other: the gradient of an adapter's t
// [rows, r], (dropout > 0) of its dropped-out input [rows, in], and (split) an adapter weight's
// gradient before its sum (A's [r, in] over the group; B's [out, r] over the group or the kv
// replicas), r x the widest projection at most.
struct AdapterScratch {
  void* dt = nullptr;
  void* dx = nullptr;
  void* grad = nullptr;
};

// How a projection is split over the tensor group, and with it its adapter (NeMo's layout):
// kColumn, its output features (this rank's rows of B; A whole, its gradient summed over the
// group); kRow, its input features (this rank's columns of A, t a partial product; B whole, its
// gradient summed over the group).
enum class ParallelKind : std::uint8_t { kNone, kColumn, kRow };

// One projection over `rows` rows: y [rows, out] = x W^T (+ b), W [out, in], then its adapter's
// scaling * dropout(x) A^T B^T (PEFT: base_layer(x) + lora_B(lora_A(dropout(x))) * scaling),
// with t = dropout(x) A^T [rows, r] kept for the backward.
struct Linear {
  LoraTarget target = LoraTarget::kQ;
  std::int64_t rows = 0, out = 0, in = 0;
  const void* w = nullptr;        // [out, in]
  const void* b = nullptr;        // [out] or nullptr
  LoraPair<const void*> adapter;  // nullptrs without one
  const AdapterSpec* lora = nullptr;
  const BaseFormat* base = nullptr;
  DType dtype = DType::kF32;
  // Its weight and bias gradients are summed over the kv replicas (k and v, kv_replicas > 1),
  // in `replica_dw` [out, in] (overwritten) and `replica_db` [out] (zero on entry) before they
  // are added; so is its adapter's B gradient.
  TensorGroup* replicas = nullptr;
  // Split over `tp` as `kind` says; kRow: this rank's input features are [in_begin, in_begin +
  // in) of full_in (the adapter's dropout takes the whole input's mask at them).
  ParallelKind kind = ParallelKind::kNone;
  const TensorSplit* tp = nullptr;
  std::int64_t in_begin = 0, full_in = 0;
  // The weight gradient is written (dW = dy^T x, beta 0), not added: its buffer came unfilled
  // (model::GradientWrite::kWrite). Only without a bias or kv replicas, whose sums add.
  bool writes_grads = false;

  bool adapted() const { return adapter.a != nullptr; }
  // y = x W^T (+ b) (+ the adapter's product, its t into `t`); `scratch` [rows, in] holds the
  // adapter's dropped-out input.
  void forward(const device::Ops& ops, const void* x, void* y, void* t, void* scratch) const;
  // t = dropout(x) A^T alone (a recomputed forward that stops before this projection).
  void adapter_t(const device::Ops& ops, const void* x, void* t, void* scratch) const;
  // Backward with dy [rows, out]: dW += dy^T x (= with writes_grads) and db += sum(dy) where the
  // weight trains (gw, gb non-null), dB += scaling dy^T t and dA += (scaling dy B)^T dropout(x)
  // where it has an adapter (ga), and dx [rows, in] = (or += with accumulate) dy W +
  // dropout(scaling dy B A).
  Status backward(const device::Ops& ops, const void* x, const void* t, void* gw, void* gb,
                  const LoraPair<void*>& ga, const void* dy, void* dx, bool accumulate,
                  void* x_scratch, const AdapterScratch& s, void* replica_dw = nullptr,
                  void* replica_db = nullptr) const;

 private:
  const void* weight(const device::Ops& ops) const { return base->weight(ops, w, out * in, dtype); }
  bool split() const { return tp != nullptr && tp->split(); }
  // The elements the adapter's dropout covers: the input, or a row-parallel rank's columns of
  // the whole input.
  device::DropoutBlock dropout_block() const {
    return kind == ParallelKind::kRow && split() ? device::DropoutBlock{rows, in, full_in, in_begin}
                                                 : device::DropoutBlock::flat(rows * in);
  }
  // The adapter's gradient `grad` [m, n] += alpha op(a) op(b), summed first over `sum` (the
  // group, or the kv replicas) when given, through scratch.
  Status adapter_grad(const device::Ops& ops, bool trans_a, std::int64_t m, std::int64_t n,
                      std::int64_t k, const void* a, const void* b, void* grad, float alpha,
                      const TensorSplit* group, TensorGroup* replica_group, void* scratch,
                      std::string_view what) const;
  const void* adapter_input(const device::Ops& ops, const void* x, void* scratch) const;
};

// Column-parallel (Megatron's ColumnParallelLinear, fused over the projections that read one
// input): each rank holds its output features of every projection. The input is every row:
// under sequence parallelism gathered from the ranks' rows first; the input gradient is each
// rank's part of the sum, summed over the group (to this rank's rows under sequence
// parallelism).
template <std::size_t N>
struct ColumnParallelLinear {
  const TensorSplit* split = nullptr;
  std::array<Linear, N> parts;

  // `x` [rows, in] made whole: this rank's rows are in place at row_slot, or in `local`.
  Status gather_input(void* x, std::string_view what, const void* local = nullptr) const {
    return split->gather_rows(x, parts[0].in, what, local);
  }
  // Each part's y = x W^T (+ b) (+ its adapter's, its t kept), from the gathered x.
  void forward(const device::Ops& ops, const void* x, const std::array<void*, N>& y,
               const std::array<void*, N>& t, void* scratch) const {
    for (std::size_t i = 0; i < N; ++i) parts[i].forward(ops, x, y[i], t[i], scratch);
  }
  // Sums the group's input gradients: `partial` [rows, in], every part's added up, into `dx`
  // (this rank's rows under sequence parallelism, else `partial` itself).
  Status reduce_input_grad(void* partial, void* dx, std::string_view what) const {
    return split->sum_partial(partial, dx, parts[0].in, what);
  }
};

// Row-parallel (Megatron's RowParallelLinear): each rank holds its input features of one
// projection, reads its part of the input, and its partial products are summed over the group
// (this rank's rows of the sum under sequence parallelism) before the bias is added; in
// backward the output gradient is every row (gathered under sequence parallelism).
struct RowParallelLinear {
  const TensorSplit* split = nullptr;
  Linear part;  // split: no bias here, it is added after the sum
  const void* bias = nullptr;

  // out = x W^T (+ adapter) summed over the group, + b. `partial` [rows, out]: scratch for the
  // product before its reduce-scatter under sequence parallelism (else out itself).
  Status forward(const device::Ops& ops, const void* x, void* partial, void* out, void* t,
                 void* scratch, std::string_view what) const;
  // `dy` [rows, out] made whole from this rank's rows in place (sequence parallelism).
  Status gather_output_grad(void* dy, std::string_view what) const {
    return split->gather_rows(dy, part.out, what);
  }
};

}  // namespace strata::model::detail
