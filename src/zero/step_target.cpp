// StoreStepTarget: a step's state and gradients pinned, or streamed, from a tiered store.
#include "strata/zero/step_target.h"

namespace strata::zero {

StoreStepTarget::StoreStepTarget(mem::TieredStore& store, std::vector<StepGroup> groups,
                                 std::vector<StepTensors> tensors, DType grad_dtype,
                                 DType out_dtype, std::vector<std::size_t> order)
    : store_(store),
      groups_(std::move(groups)),
      tensors_(std::move(tensors)),
      grad_dtype_(grad_dtype),
      out_dtype_(out_dtype),
      order_(std::move(order)),
      grad_held_(groups_.size(), GradHeld::kNone) {
  STRATA_CHECK(groups_.size() == tensors_.size(), "a step group without its tensors");
  for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
    groups_[gi].shadowed = tensors_[gi].out[0] != mem::Handle::kInvalid;
  }
}

Result<PinnedState> StoreStepTarget::pin(std::size_t group, Tier tier) {
  const StepTensors& t = tensors_[group];
  const bool shadowed = groups_[group].shadowed;
  PinnedState p;
  // Pinned so far, let go if a later one fails: the inputs, the shadow outputs, the gradient.
  const auto let_go = [&] {
    for (int k = 0; k < 3; ++k) {
      if (p.in[k] != nullptr) store_.unpin(t.state[k], tier);
      if (shadowed && p.out[k] != nullptr) store_.unpin(t.out[k], tier);
    }
  };
  for (int k = 0; k < 3; ++k) {
    auto in = store_.acquire(t.state[k], tier);
    if (!in.is_ok()) {
      let_go();
      return in.status();
    }
    p.in[k] = *in;
    if (!shadowed) {
      p.out[k] = p.in[k];
      continue;
    }
    // The shadow is overwritten whole: no need for what it held.
    auto out = store_.emplace(t.out[k], tier, /*zero_fill=*/false);
    if (!out.is_ok()) {
      let_go();
      return out.status();
    }
    p.out[k] = *out;
  }
  auto grad = store_.acquire(t.grad, tier);
  if (!grad.is_ok()) {
    let_go();
    return grad.status();
  }
  p.grad = *grad;
  return p;
}

void StoreStepTarget::unpin(std::size_t group, Tier tier, bool written) {
  const StepTensors& t = tensors_[group];
  if (written) {
    for (const mem::Handle h : this->written(group)) store_.mark_dirty(h, tier);
  }
  for (int k = 0; k < 3; ++k) {
    store_.unpin(t.state[k], tier);
    if (groups_[group].shadowed) store_.unpin(t.out[k], tier);
  }
  store_.unpin(t.grad, tier);
}

Status StoreStepTarget::open_ranges(std::size_t group) {
  const StepTensors& t = tensors_[group];
  const bool shadowed = groups_[group].shadowed;
  for (int k = 0; k < 3; ++k) {
    STRATA_RETURN_IF_ERROR(store_.open_ranges(t.state[k]));
    ranges_.emplace_back(t.state[k], !shadowed);
  }
  for (int k = 0; k < 3 && shadowed; ++k) {
    STRATA_RETURN_IF_ERROR(store_.open_ranges(t.out[k]));
    ranges_.emplace_back(t.out[k], true);
  }
  return Status::ok();
}

void StoreStepTarget::close_ranges(bool written, bool ok) {
  for (const auto& [h, writes] : ranges_) store_.close_ranges(h, writes && written, ok);
  ranges_.clear();
}

io::IoHandle StoreStepTarget::read_range(std::size_t group, optim::StreamedArray array,
                                         std::uint64_t offset, void* dst, std::size_t bytes) {
  const StepTensors& t = tensors_[group];
  const auto a = static_cast<std::size_t>(array);
  return store_.read_range(array == optim::StreamedArray::kGrad ? t.grad : t.state[a], offset, dst,
                           bytes);
}

io::IoHandle StoreStepTarget::write_range(std::size_t group, optim::StreamedArray array,
                                          std::uint64_t offset, const void* src,
                                          std::size_t bytes) {
  return store_.write_range(written(group)[static_cast<std::size_t>(array)], offset, src, bytes);
}

Result<const void*> StoreStepTarget::open_gradient(std::size_t group) {
  const mem::Handle h = tensors_[group].grad;
  // Homed on NVMe with no host copy: read with the state, as ranges of its home.
  if (store_.spec(h).home == Tier::kNvme &&
      !store_.residency(h).valid[static_cast<int>(Tier::kHost)]) {
    STRATA_RETURN_IF_ERROR(store_.open_ranges(h));
    grad_held_[group] = GradHeld::kRanges;
    return static_cast<const void*>(nullptr);
  }
  STRATA_ASSIGN_OR_RETURN(void* host, store_.acquire(h, Tier::kHost));
  grad_held_[group] = GradHeld::kHost;
  return static_cast<const void*>(host);
}

void StoreStepTarget::close_gradient(std::size_t group) {
  const mem::Handle h = tensors_[group].grad;
  if (grad_held_[group] == GradHeld::kHost) store_.unpin(h, Tier::kHost);
  if (grad_held_[group] == GradHeld::kRanges) store_.close_ranges(h, false, true);
  grad_held_[group] = GradHeld::kNone;
}

}  // namespace strata::zero
