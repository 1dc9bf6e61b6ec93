// Private to the model: the vocabulary-parallel layers at the model's two ends (Megatron-Core's
// VocabParallelEmbedding and vocab_parallel_cross_entropy). Split over the tensor-parallel group,
// each rank holds rows [vocab_begin, vocab_begin + vocab) of the embedding and of lm_head; the
// whole [rows, vocab] logits never exist on any rank. On one rank they are the plain lookup and
// the fused cross-entropy.
#pragma once

#include <cstdint>

#include "src/model/parallel_layers.h"
#include "strata/core/status.h"
#include "strata/device/device.h"

namespace strata::model::detail {

struct VocabParallelEmbedding {
  const TensorSplit* split = nullptr;
  std::int64_t vocab = 0, hidden = 0;  // this rank's rows of the table, and their width
  DType dtype = DType::kF32;

  // Token ids (host) as rows of this rank's slice, -1 for the others' (the lookup writes zeros
  // for them and its backward skips them). Nothing on one rank.
  void to_local_ids(std::int32_t* ids, std::int64_t n) const;
  // out [local rows, hidden]: each token's row from the rank that holds it, zeros elsewhere
  // (lookup, into `partial` [rows, hidden] under sequence parallelism), summed over the group
  // (sum: this rank's rows of the sum under sequence parallelism). The table is read by the
  // lookup alone: its holder may let it go before the sum.
  void lookup(const device::Ops& ops, const std::int32_t* ids, std::int64_t rows, const void* table,
              void* partial, void* out) const;
  Status sum(void* partial, void* out) const;
  // The table's gradient += the lookup's, from dy [rows, hidden]: every row, gathered from this
  // rank's rows in place under sequence parallelism.
  Status backward(const device::Ops& ops, const std::int32_t* ids, std::int64_t rows, void* dy,
                  void* table_grad) const;
};

// The loss of rows of logits against their targets and, training, the logits' gradient in place.
// Split: each rank's per-row (max, sum of exp, target logit) over its slice gathered, combined in
// double the same way on every rank into the loss and the whole row's max and sum, then the
// gradient of the slice.
struct VocabParallelCrossEntropy {
  const TensorSplit* split = nullptr;
  device::Device* device = nullptr;
  std::int64_t vocab = 0;  // this rank's slice of the logits' columns
  DType dtype = DType::kF32;
  // Split only, for up to `max_rows` rows at a time: device f32 [3 max_rows] (this rank's
  // statistics), [3 max_rows size] (every rank's), [2 max_rows] (the rows' max and sum); pinned
  // host f32 [3 max_rows size + 2 max_rows].
  float* local = nullptr;
  float* stats = nullptr;
  float* row_stats = nullptr;
  float* host = nullptr;

  // logits [n, vocab] -> losses of the n rows: on one rank into `device_losses` (device f32,
  // read back by the caller), split into `host_losses`. With `train`, dlogits = dloss_scale *
  // d(loss)/d(logits) overwrite the logits.
  Status forward_backward(const device::Ops& ops, void* logits, const std::int32_t* targets,
                          std::int64_t n, float* device_losses, float* host_losses, bool train,
                          float dloss_scale) const;
};

}  // namespace strata::model::detail
