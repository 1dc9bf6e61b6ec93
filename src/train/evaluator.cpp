// Held-out evaluation (evaluator.h).
#include "src/train/evaluator.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "strata/core/clock.h"

namespace strata::train {

Result<std::unique_ptr<Evaluator>> Evaluator::open(const Parts& parts) {
  std::unique_ptr<Evaluator> e(new Evaluator(parts));
  const DataConfig& data = *parts.config.eval_data;
  const std::int64_t seq = parts.config.seq_len;
  STRATA_ASSIGN_OR_RETURN(e->dataset_, TokenDataset::open(data.path, data.format, "eval_data"));
  STRATA_RETURN_IF_ERROR(SequenceSampler::check(*e->dataset_, seq).with_context("eval_data"));
  e->sampler_ = std::make_unique<SequenceSampler>(e->dataset_, seq, parts.config.seed);
  STRATA_RETURN_IF_ERROR(attach_loss_mask(data.path, e->dataset_->format(), e->sampler_.get()));
  std::vector<std::int32_t> inputs(static_cast<std::size_t>(seq)), targets(inputs.size());
  const std::int64_t sequences =
      e->batch_count() * parts.config.micro_batch_size * parts.grid.data().world_size();
  for (std::int64_t g = 0; g < sequences; ++g) {
    STRATA_RETURN_IF_ERROR(
        e->sampler_->sequence(g, parts.config.model.vocab_size, inputs.data(), targets.data())
            .with_context("eval_data"));
  }
  return e;
}

std::int64_t Evaluator::batch_count() const {
  // eval_batches 0: the whole file once (at least one batch, which may wrap around it).
  const std::int64_t per_batch = p_.config.micro_batch_size * p_.grid.data().world_size();
  return p_.config.eval_batches > 0
             ? p_.config.eval_batches
             : std::max<std::int64_t>(1, sampler_->num_windows() / per_batch);
}

Status Evaluator::maybe_evaluate(StepMetrics* m) {
  const bool due = m->step == p_.config.max_steps ||
                   (p_.config.eval_every > 0 && m->step % p_.config.eval_every == 0);
  if (!due) return Status::ok();
  Stopwatch timer;
  // An overlapped update lands first: evaluation sees the weights of this step.
  STRATA_RETURN_IF_ERROR(p_.provider.finish_step());
  const std::int64_t mb = p_.config.micro_batch_size, seq = p_.config.seq_len;
  const std::int64_t world = p_.grid.data().world_size(), rank = p_.grid.data().rank();
  const std::int64_t batches = batch_count();
  std::vector<std::int32_t> inputs(static_cast<std::size_t>(mb * seq));
  std::vector<std::int32_t> targets(inputs.size());
  double sums[2] = {0.0, 0.0};  // loss x targets, targets
  for (std::int64_t b = 0; b < batches; ++b) {
    const std::int64_t first = (b * world + rank) * mb;
    std::int64_t n = 0;
    for (std::int64_t i = 0; i < mb; ++i) {
      STRATA_RETURN_IF_ERROR(sampler_
                                 ->sequence(first + i, p_.config.model.vocab_size,
                                            inputs.data() + i * seq, targets.data() + i * seq)
                                 .with_context("eval_data"));
      STRATA_ASSIGN_OR_RETURN(std::int64_t c, sampler_->count_targets(first + i));
      n += c;
    }
    float loss = 0;
    if (p_.pipeline != nullptr) {
      STRATA_ASSIGN_OR_RETURN(loss, p_.pipeline->forward({inputs.data(), targets.data(), mb, seq}));
    } else {
      STRATA_ASSIGN_OR_RETURN(
          loss, p_.model.forward_loss(p_.provider, inputs.data(), targets.data(), mb, seq));
    }
    STRATA_RETURN_IF_ERROR(p_.provider.finish_micro_batch());
    sums[0] += static_cast<double>(loss) * static_cast<double>(n);
    sums[1] += static_cast<double>(n);
  }
  // The last stage's losses to every stage (the others add zero: exact).
  if (p_.grid.shape().pipeline > 1) {
    STRATA_RETURN_IF_ERROR(
        p_.grid.pipeline().all_reduce_host(sums, 1, dist::ReduceOp::kSum, "eval loss (pipeline)"));
  }
  if (world > 1) {
    STRATA_RETURN_IF_ERROR(
        p_.grid.data().all_reduce_host(sums, 2, dist::ReduceOp::kSum, "eval loss"));
  }
  if (sums[1] == 0) {
    return invalid_argument("eval_data " + p_.config.eval_data->path +
                            ": the loss mask leaves no target in the evaluated sequences");
  }
  m->eval_loss = sums[0] / sums[1];
  m->eval_ppl = std::exp(*m->eval_loss);
  m->eval_tokens = static_cast<std::int64_t>(sums[1]);
  m->eval_ms = timer.elapsed_ms();
  return Status::ok();
}

}  // namespace strata::train
