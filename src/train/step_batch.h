// The micro-batches of one training step on this rank: which sequences of the global batch, each
// one's share of the step's loss, the scale of its loss gradient and its adapter dropout key.
// Private to train/.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/core/status.h"
#include "strata/train/config.h"
#include "strata/train/data.h"

namespace strata::train {

// One micro-batch of this rank's step: its tokens, its share of the step's loss, the scale of its
// loss gradient (its share times the loss scale) and its adapter dropout key.
struct StepMicroBatch {
  std::vector<std::int32_t> inputs, targets;
  double share = 0;
  float grad_scale = 0;
  std::uint64_t dropout_key = 0;
};

// A step's micro-batches on this rank, and the targets of the whole global batch that count.
struct StepBatch {
  std::vector<StepMicroBatch> micros;
  std::int64_t global_targets = 0;
};

// Step `step` (0-based) of data-parallel rank `rank` of `world`: the global batch is sequences
// [step * batch_size, (step + 1) * batch_size) whatever the rank count, and micro-batch k of rank r
// takes its own contiguous run of them. The loss is the mean over every target of the global batch
// that counts (all of them without a loss mask), however the batch is split: each micro-batch's
// mean is weighted by its share, which every rank computes from the whole batch's counts (the
// sampler is a function of the step). `overflow`: every gradient scale is infinite (an injected
// fp16 overflow); else each is its share times `loss_scale`.
Result<StepBatch> make_step_batch(const TrainConfig& config, SequenceSampler& sampler,
                                  std::int64_t step, int world, int rank, double loss_scale,
                                  bool overflow);

}  // namespace strata::train
