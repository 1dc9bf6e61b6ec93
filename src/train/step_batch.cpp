// The micro-batches of one training step on this rank (step_batch.h).
#include "src/train/step_batch.h"

#include <limits>

#include "strata/core/rng.h"

namespace strata::train {

namespace {
// Salts the seed for adapter dropout masks (tools/golden/lora_golden.py uses the same).
constexpr std::uint64_t kDropoutSalt = 0x6c6f72612d64726full;
}  // namespace

Result<StepBatch> make_step_batch(const TrainConfig& config, SequenceSampler& sampler,
                                  std::int64_t step, int world, int rank, double loss_scale,
                                  bool overflow) {
  const std::int64_t mb = config.micro_batch_size, seq = config.seq_len;
  const std::int64_t accum = config.accumulation_steps(world);
  const std::int64_t batch_start = step * config.batch_size;
  StepBatch batch;
  std::vector<std::int64_t> counts(static_cast<std::size_t>(config.batch_size));
  for (std::int64_t g = 0; g < config.batch_size; ++g) {
    STRATA_ASSIGN_OR_RETURN(counts[static_cast<std::size_t>(g)],
                            sampler.count_targets(batch_start + g));
    batch.global_targets += counts[static_cast<std::size_t>(g)];
  }
  batch.micros.resize(static_cast<std::size_t>(accum));
  for (std::int64_t micro = 0; micro < accum; ++micro) {
    StepMicroBatch& mi = batch.micros[static_cast<std::size_t>(micro)];
    mi.inputs.resize(static_cast<std::size_t>(mb * seq));
    mi.targets.resize(mi.inputs.size());
    const std::int64_t first = batch_start + (micro * world + rank) * mb;
    std::int64_t micro_targets = 0;
    for (std::int64_t i = 0; i < mb; ++i) {
      STRATA_RETURN_IF_ERROR(sampler.sequence(first + i, config.model.vocab_size,
                                              mi.inputs.data() + i * seq,
                                              mi.targets.data() + i * seq));
      micro_targets += counts[static_cast<std::size_t>(first + i - batch_start)];
    }
    mi.share = batch.global_targets > 0
                   ? static_cast<double>(micro_targets) / static_cast<double>(batch.global_targets)
                   : 0.0;
    mi.grad_scale = overflow ? std::numeric_limits<float>::infinity()
                             : static_cast<float>(mi.share * loss_scale);
    // Adapter dropout masks: a function of the seed and of where the micro-batch sits in the run.
    mi.dropout_key =
        splitmix64_at(config.seed ^ kDropoutSalt,
                      static_cast<std::uint64_t>((step * accum + micro) * world + rank));
  }
  return batch;
}

}  // namespace strata::train
