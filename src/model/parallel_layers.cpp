// The block's layers: the tensor split's collectives, a projection with its adapter, and the
// row-parallel product's sum.
#include "src/model/parallel_layers.h"

#include "strata/core/check.h"

namespace strata::model::detail {
void* TensorSplit::row_slot(void* full, std::int64_t n) const {
  return offset_ptr(full, row_begin * n, elem_bytes);
}

Status TensorSplit::gather_rows(void* full, std::int64_t n, std::string_view what,
                                const void* local) const {
  if (!seq_parallel) return Status::ok();
  return group->all_gather(local != nullptr ? local : row_slot(full, n), full, local_rows * n,
                           dtype, what);
}

Status TensorSplit::sum_partial(void* partial, void* out, std::int64_t n,
                                std::string_view what) const {
  if (seq_parallel) return group->reduce_scatter_sum(partial, out, local_rows * n, dtype, what);
  STRATA_CHECK(partial == out, "a partial product summed elsewhere without sequence parallelism");
  return sum(out, rows * n, what);
}

Status TensorSplit::sum(void* buffer, std::int64_t n, std::string_view what) const {
  return split() ? group->all_reduce_sum(buffer, n, dtype, what) : Status::ok();
}

void matmul(const device::Ops& ops, DType dtype, bool trans_a, bool trans_b, std::int64_t m,
            std::int64_t n, std::int64_t k, const void* a, const void* b, void* c, bool accumulate,
            float alpha) {
  device::GemmArgs g;
  g.trans_a = trans_a;
  g.trans_b = trans_b;
  g.m = m;
  g.n = n;
  g.k = k;
  g.alpha = alpha;
  g.a = a;
  g.lda = trans_a ? m : k;
  g.b = b;
  g.ldb = trans_b ? k : n;
  g.beta = accumulate ? 1.0f : 0.0f;
  g.c = c;
  g.ldc = n;
  g.dtype = dtype;
  ops.gemm(g);
}

// The adapter's input: x, or dropout(x) in `scratch` while training with dropout > 0.
const void* Linear::adapter_input(const device::Ops& ops, const void* x, void* scratch) const {
  if (lora->dropout <= 0.0f) return x;
  ops.dropout(x, scratch, dropout_block(), lora->dropout,
              lora_dropout_key(lora->key, lora->layer, target), dtype);
  return scratch;
}

void Linear::adapter_t(const device::Ops& ops, const void* x, void* t, void* scratch) const {
  const void* xin = adapter_input(ops, x, scratch);
  matmul(ops, dtype, false, true, rows, lora->rank, in, xin, adapter.a, t, false);
}

void Linear::forward(const device::Ops& ops, const void* x, void* y, void* t, void* scratch) const {
  matmul(ops, dtype, false, true, rows, out, in, x, weight(ops), y, false);
  if (b != nullptr) ops.add_bias(y, b, rows, out, dtype);
  if (!adapted()) return;
  adapter_t(ops, x, t, scratch);
  matmul(ops, dtype, false, true, rows, out, lora->rank, t, adapter.b, y, true, lora->scaling);
}

Status Linear::backward(const device::Ops& ops, const void* x, const void* t, void* gw, void* gb,
                        const LoraPair<void*>& ga, const void* dy, void* dx, bool accumulate,
                        void* x_scratch, const AdapterScratch& s, void* replica_dw,
                        void* replica_db) const {
  const DType dt = dtype;
  const std::int64_t R = rows;
  STRATA_CHECK(!writes_grads || (b == nullptr && replicas == nullptr),
               "a written weight gradient beside a bias or kv replicas (their sums add)");
  if (replicas == nullptr) {
    if (gw != nullptr) matmul(ops, dt, true, false, out, in, R, dy, x, gw, !writes_grads);
    if (gb != nullptr) ops.bias_grad(dy, gb, R, out, dt);
  }
  matmul(ops, dt, false, false, R, in, out, dy, weight(ops), dx, accumulate);
  if (adapted()) {
    const std::int64_t r = lora->rank;
    // Split, some of the adapter's gradients are this rank's part of a sum: B's over the group
    // where t is partial (row-parallel), or over the kv replicas where dy is; A's over the group
    // where dt is (column-parallel).
    const bool row = split() && kind == ParallelKind::kRow;
    const bool column = split() && kind == ParallelKind::kColumn;
    STRATA_RETURN_IF_ERROR(adapter_grad(ops, true, out, r, R, dy, t, ga.b, lora->scaling,
                                        row ? tp : nullptr, column ? replicas : nullptr, s.grad,
                                        "lora_B gradient"));
    matmul(ops, dt, false, false, R, r, out, dy, adapter.b, s.dt, false, lora->scaling);
    const void* xin = adapter_input(ops, x, x_scratch);
    STRATA_RETURN_IF_ERROR(adapter_grad(ops, true, r, in, R, s.dt, xin, ga.a, 1.0f,
                                        column ? tp : nullptr, nullptr, s.grad, "lora_A gradient"));
    if (lora->dropout <= 0.0f) {
      matmul(ops, dt, false, false, R, in, r, s.dt, adapter.a, dx, true);
    } else {
      matmul(ops, dt, false, false, R, in, r, s.dt, adapter.a, s.dx, false);
      ops.dropout(s.dx, s.dx, dropout_block(), lora->dropout,
                  lora_dropout_key(lora->key, lora->layer, target), dt);
      ops.add(dx, s.dx, dx, R * in, dt);
    }
  }
  if (replicas == nullptr) return Status::ok();
  // The weight is whole on several ranks, each with the gradient of its own q heads: its
  // gradients are summed over them, each in scratch before it is added.
  const std::string_view what = target == LoraTarget::kK ? "k_proj gradient" : "v_proj gradient";
  if (gw != nullptr) {
    matmul(ops, dt, true, false, out, in, R, dy, x, replica_dw, false);
    STRATA_RETURN_IF_ERROR(replicas->kv_replica_sum(replica_dw, out * in, dt, what));
    ops.add(gw, replica_dw, gw, out * in, dt);
  }
  if (gb != nullptr) {
    ops.bias_grad(dy, replica_db, R, out, dt);
    STRATA_RETURN_IF_ERROR(replicas->kv_replica_sum(replica_db, out, dt, what));
    ops.add(gb, replica_db, gb, out, dt);
  }
  return Status::ok();
}

Status Linear::adapter_grad(const device::Ops& ops, bool trans_a, std::int64_t m, std::int64_t n,
                            std::int64_t k, const void* a, const void* b, void* grad, float alpha,
                            const TensorSplit* group, TensorGroup* replica_group, void* scratch,
                            std::string_view what) const {
  if (group == nullptr && replica_group == nullptr) {
    matmul(ops, dtype, trans_a, false, m, n, k, a, b, grad, true, alpha);
    return Status::ok();
  }
  matmul(ops, dtype, trans_a, false, m, n, k, a, b, scratch, false, alpha);
  STRATA_RETURN_IF_ERROR(group != nullptr
                             ? group->sum(scratch, m * n, what)
                             : replica_group->kv_replica_sum(scratch, m * n, dtype, what));
  ops.add(grad, scratch, grad, m * n, dtype);
  return Status::ok();
}

Status RowParallelLinear::forward(const device::Ops& ops, const void* x, void* partial, void* out,
                                  void* t, void* scratch, std::string_view what) const {
  void* product = split->seq_parallel ? partial : out;
  part.forward(ops, x, product, t, scratch);
  if (!split->split()) return Status::ok();
  STRATA_RETURN_IF_ERROR(split->sum_partial(product, out, part.out, what));
  if (bias != nullptr) ops.add_bias(out, bias, split->local_rows, part.out, part.dtype);
  return Status::ok();
}

}  // namespace strata::model::detail
