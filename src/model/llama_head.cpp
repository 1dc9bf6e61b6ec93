// LlamaModel's head: model.norm, lm_head in chunks of rows, and the loss (a vocabulary-parallel
// cross-entropy), forward and backward.
#include "src/model/llama_impl.h"

namespace strata::model {

Status LlamaModel::Impl::head_forward_backward(ProviderSession& ps, const MicroBatch& mb,
                                               ChunkSpace& ch, bool train) {
  const Dims& d = setup_.d;
  const TensorSplit& sp = setup_.split;
  const DType dt = d.dtype;
  const std::size_t eb = d.elem_bytes;
  const std::int64_t R = d.rows, H = d.hidden, V = d.vocab;
  const bool tied = config_.tie_word_embeddings;
  const auto& ops = device_.ops();
  auto& stream = device_.stream(device::StreamKind::kCompute);
  const auto& bwd = ws_.bwd;
  const std::int32_t* targets = ws_.slots[static_cast<std::size_t>(mb.slot)].targets;
  float* host_losses = host_rows(mb.slot).losses;
  const auto trains = [&](int group) { return !layout_.group(group).frozen; };

  STRATA_ASSIGN_OR_RETURN(const HeadWeights head, acquire_head(ps));
  const void* lm_weight = head.lm;
  const void* norm_weight = head.norm;
  const std::int64_t n = ch.end - ch.begin;
  if (train && n > 0) prefetch_block(ps, ch.end - 1);
  void* x_final = ch.xs[static_cast<std::size_t>(n)];
  ops.rmsnorm_forward(x_final, norm_weight, sp.row_slot(ws_.hf, H), ws_.rstd_final, sp.local_rows,
                      H, d.eps, dt);
  STRATA_RETURN_IF_ERROR(sp.gather_rows(ws_.hf, H, "model.norm output"));
  // Training: the head's gradients. Tied: the embedding's gradient collects the head's part now
  // and the lookup's part last. A frozen head, norm or embedding has no gradient: its weight
  // products are skipped.
  const bool norm_trains = train && trains(norm_group_), lm_trains = train && trains(lm_group_);
  void* norm_grads = nullptr;
  void* lm_grads = nullptr;
  if (norm_trains) {
    STRATA_ASSIGN_OR_RETURN(norm_grads, ps.acquire_grads(norm_group_, GradientWrite::kAdd));
  }
  if (lm_trains) {
    if (embedding_copy_) {
      lm_grads = ws_.embedding_grad;  // the head's part, from zero as one stage's
      device_.fill_zero(lm_grads, static_cast<std::size_t>(V * H) * eb, stream);
    } else if (lm_group_ == norm_group_) {
      lm_grads = norm_grads;
    } else {
      STRATA_ASSIGN_OR_RETURN(lm_grads, ps.acquire_grads(lm_group_, GradientWrite::kAdd));
    }
  }
  // d(mean loss * grad_scale)/dlogits; no valid target means no gradient.
  const float dloss_scale = num_valid_ > 0 ? mb.grad_scale / static_cast<float>(num_valid_) : 0.0f;
  // The logits, the loss and (training) their gradient a chunk of tokens at a time: the whole
  // [rows, vocab] never exists. Each chunk's dlogits overwrite its logits, then give lm_head's
  // weight gradient (accumulated over the chunks) and the chunk's rows of the input gradient.
  void* dlogits = ws_.logits;
  const detail::VocabParallelCrossEntropy loss = cross_entropy();
  for (std::int64_t r0 = 0; r0 < R; r0 += d.head_rows) {
    const std::int64_t rows = std::min(d.head_rows, R - r0);
    const void* hf = offset_ptr(ws_.hf, r0 * H, eb);
    matmul(ops, dt, false, true, rows, V, H, hf, lm_weight, ws_.logits, false);
    STRATA_RETURN_IF_ERROR(loss.forward_backward(ops, ws_.logits, targets + r0, rows,
                                                 ws_.losses + r0, host_losses + r0, train,
                                                 dloss_scale));
    if (!train) continue;
    if (lm_trains) {
      matmul(ops, dt, true, false, V, H, rows, dlogits, hf, offset_ptr(lm_grads, lm_offset_, eb),
             true);
    }
    matmul(ops, dt, false, false, rows, H, V, dlogits, lm_weight, offset_ptr(bwd.dx, r0 * H, eb),
           false);
  }
  if (!sp.split()) {
    device_.copy_to_host(host_losses, ws_.losses, static_cast<std::size_t>(R) * 4, stream);
    stream.synchronize();
  }
  double sum = 0;
  for (std::int64_t i = 0; i < R; ++i) sum += host_losses[i];
  slot_loss_[static_cast<std::size_t>(mb.slot)] =
      num_valid_ > 0 ? static_cast<float>(sum / static_cast<double>(num_valid_)) : 0.0f;
  last_slot_ = static_cast<std::size_t>(mb.slot);
  if (!train) {
    release_head(ps);
    return Status::ok();
  }

  // Each rank's vocabulary slice gives part of the input gradient: summed (this rank's rows).
  void* dx = sp.seq_parallel ? bwd.dx_local : bwd.dx;
  if (sp.split()) {
    STRATA_RETURN_IF_ERROR(sp.sum_partial(bwd.dx, dx, H, "lm_head input gradient"));
  }
  // The sums norm_backward adds into start at zero (absent ones: no-ops).
  if (bwd.dln1 != nullptr) device_.fill_zero(bwd.dln1, static_cast<std::size_t>(H) * eb, stream);
  STRATA_RETURN_IF_ERROR(
      detail::norm_backward(ops, d, sp, dx, x_final, norm_weight, ws_.rstd_final, ch.dout,
                            norm_trains ? offset_ptr(norm_grads, norm_offset_, eb) : nullptr,
                            bwd.dln1, "model.norm weight gradient"));
  release_head(ps);
  if (norm_trains) STRATA_RETURN_IF_ERROR(ps.release_grads(norm_group_));
  // The embedding's (tied) are released after the lookup's part, last.
  if (lm_trains && lm_group_apart() && !tied) {
    STRATA_RETURN_IF_ERROR(ps.release_grads(lm_group_));
  }
  tied_grads_ = tied && !embedding_copy_ ? lm_grads : nullptr;
  return Status::ok();
}

}  // namespace strata::model
