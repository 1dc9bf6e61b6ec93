// The vocabulary-parallel embedding and cross-entropy.
#include "src/model/vocab_parallel.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace strata::model::detail {

void VocabParallelEmbedding::to_local_ids(std::int32_t* ids, std::int64_t n) const {
  if (!split->split()) return;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t local = ids[i] - split->vocab_begin;
    ids[i] = local >= 0 && local < vocab ? static_cast<std::int32_t>(local) : -1;
  }
}

void VocabParallelEmbedding::lookup(const device::Ops& ops, const std::int32_t* ids,
                                    std::int64_t rows, const void* table, void* partial,
                                    void* out) const {
  ops.embedding_forward(ids, rows, table, hidden, split->seq_parallel ? partial : out, dtype);
}

Status VocabParallelEmbedding::sum(void* partial, void* out) const {
  if (!split->split()) return Status::ok();
  return split->sum_partial(split->seq_parallel ? partial : out, out, hidden, "embedding");
}

Status VocabParallelEmbedding::backward(const device::Ops& ops, const std::int32_t* ids,
                                        std::int64_t rows, void* dy, void* table_grad) const {
  STRATA_RETURN_IF_ERROR(split->gather_rows(dy, hidden, "embedding output gradient"));
  ops.embedding_backward(ids, rows, dy, hidden, table_grad, dtype);
  return Status::ok();
}

Status VocabParallelCrossEntropy::forward_backward(const device::Ops& ops, void* logits,
                                                   const std::int32_t* targets, std::int64_t n,
                                                   float* device_losses, float* host_losses,
                                                   bool train, float dloss_scale) const {
  if (!split->split()) {
    ops.cross_entropy(logits, targets, device_losses, train ? logits : nullptr, n, vocab,
                      dloss_scale, dtype);
    return Status::ok();
  }
  const std::int64_t T = split->size;
  auto& stream = device->stream(device::StreamKind::kCompute);
  ops.cross_entropy_stats(logits, targets, n, vocab, split->vocab_begin, local, dtype);
  STRATA_RETURN_IF_ERROR(
      split->group->all_gather(local, stats, 3 * n, DType::kF32, "cross-entropy statistics"));
  float* rows = host + 3 * n * T;
  device->copy_to_host(host, stats, static_cast<std::size_t>(3 * n * T) * 4, stream);
  stream.synchronize();
  for (std::int64_t i = 0; i < n; ++i) {
    float m = -std::numeric_limits<float>::infinity();
    for (std::int64_t r = 0; r < T; ++r) m = std::max(m, host[3 * (r * n + i)]);
    double sum = 0, target = 0;
    for (std::int64_t r = 0; r < T; ++r) {
      const float* st = host + 3 * (r * n + i);
      if (st[1] > 0) sum += static_cast<double>(st[1]) * std::exp(static_cast<double>(st[0]) - m);
      target += st[2];
    }
    host_losses[i] =
        sum > 0 ? static_cast<float>(std::log(sum) + (static_cast<double>(m) - target)) : 0.0f;
    rows[i] = m;
    rows[n + i] = static_cast<float>(sum);
  }
  if (!train) return Status::ok();
  device->copy_to_device(row_stats, rows, static_cast<std::size_t>(2 * n) * 4, stream);
  ops.cross_entropy_grad(logits, targets, n, vocab, split->vocab_begin, row_stats, row_stats + n,
                         logits, dloss_scale, dtype);
  stream.synchronize();  // `rows` is read by the copy
  return Status::ok();
}

}  // namespace strata::model::detail
