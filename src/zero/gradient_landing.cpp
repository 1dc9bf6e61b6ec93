// GradientLanding: gradients off the device as they are made, accumulated and summed where the
// plan says, final for a guessed update as soon as they are.
#include "strata/zero/gradient_landing.h"

#include <utility>

#include "strata/core/clock.h"

namespace strata::zero {

struct GradientLanding::Group {
  // Kept gradients (plan.keep_gradients): the gradient itself, homed where the plan keeps
  // gradients. Otherwise this micro-batch's gradient in transit (a transient tensor), added
  // into `acc`, the fp32 accumulator.
  mem::Handle grad = mem::Handle::kInvalid;
  mem::Handle acc = mem::Handle::kInvalid;
  void* on_device = nullptr;   // the gradient's device copy while the model accumulates into it
  bool has_grad = false;       // a gradient arrived since the last step
  bool final_sent = false;     // a guessed update has its final sum (device accumulation)
  double sum_squares = 0;      // of the gradient as accumulated so far, when summed off the device
  double dup_sum_squares = 0;  // the same of its duplicates
};

GradientLanding::GradientLanding(mem::TieredStore& store, const std::vector<ShardGroup>& groups,
                                 const device::HostArrays& arrays, device::Device& device,
                                 const MemoryPlan& plan, DType compute_dtype,
                                 mem::Timeline* timeline)
    : store_(store),
      shapes_(groups),
      arrays_(arrays),
      device_(device),
      plan_(plan),
      dtype_(compute_dtype),
      timeline_(timeline),
      groups_(groups.size()) {}

GradientLanding::~GradientLanding() = default;

Result<std::unique_ptr<GradientLanding>> GradientLanding::create(
    mem::TieredStore& store, const std::vector<ShardGroup>& groups,
    const device::HostArrays& arrays, device::Device& device, const MemoryPlan& plan,
    DType compute_dtype, mem::Timeline* timeline) {
  std::unique_ptr<GradientLanding> l(
      new GradientLanding(store, groups, arrays, device, plan, compute_dtype, timeline));
  STRATA_RETURN_IF_ERROR(l->add_tensors());
  return l;
}

Status GradientLanding::add_tensors() {
  // Where device sums of squares land: on a device that addresses host memory, straight in the
  // host copy; else in device scratch, copied to the host copy when read. Both stay pinned.
  mem::TensorSpec ns;
  ns.name = "gradient sums of squares";
  ns.size_bytes = gradient_norm_bytes(shapes_.size());
  ns.transient = true;
  STRATA_ASSIGN_OR_RETURN(const mem::Handle norms, store_.add(ns));
  STRATA_ASSIGN_OR_RETURN(void* norms_host, store_.emplace(norms, Tier::kHost, true));
  norms_host_ = static_cast<double*>(norms_host);
  norm_slots_ = norms_host_;
  if (!device_.host_addressable()) {
    ns.name = "gradient sums of squares (device)";
    ns.scratch = true;
    STRATA_ASSIGN_OR_RETURN(const mem::Handle device_norms, store_.add(ns));
    STRATA_ASSIGN_OR_RETURN(void* slots, store_.emplace(device_norms, Tier::kDevice, true));
    norm_slots_ = static_cast<double*>(slots);
  }
  std::int64_t max_elems = 0;
  for (std::size_t gi = 0; gi < shapes_.size(); ++gi) {
    const ShardGroup& s = shapes_[gi];
    if (!s.trains()) continue;  // a frozen group has no gradient; an empty one nothing here
    max_elems = std::max(max_elems, s.n);
    Group& g = groups_[gi];
    const std::string name = "gradient of " + s.name();
    if (plan_.keep_gradients) {
      STRATA_ASSIGN_OR_RETURN(g.grad, add_tensor(store_, name, s.work_bytes, plan_.gradients));
      continue;
    }
    STRATA_ASSIGN_OR_RETURN(g.grad, add_tensor(store_, name, s.work_bytes, Tier::kHost, true));
    STRATA_ASSIGN_OR_RETURN(
        g.acc, add_tensor(store_, "gradient accumulator of " + s.name(),
                          static_cast<std::uint64_t>(s.n) * sizeof(float), plan_.gradients));
  }
  if (plan_.sums_on_device() && dtype_ != DType::kF32) {
    STRATA_ASSIGN_OR_RETURN(
        widened_grad_,
        add_tensor(store_, "widened gradient",
                   static_cast<std::uint64_t>(max_elems) * sizeof(float), Tier::kDevice));
  }
  return Status::ok();
}

Result<void*> GradientLanding::acquire(int group) {
  const ShardGroup& s = shapes_.at(static_cast<std::size_t>(group));
  Group& g = groups_[static_cast<std::size_t>(group)];
  STRATA_CHECK(!s.frozen(), "gradient of a frozen group (ZeroProvider refuses it)", s.name());
  STRATA_CHECK(g.on_device == nullptr, "acquire_grads twice without release", s.name());
  if (plan_.keep_gradients && g.has_grad) {
    return failed_precondition("a second gradient of '" + s.name() +
                               "' before the optimizer step, but the plan keeps one gradient "
                               "per step (accumulation_steps 1)");
  }
  STRATA_ASSIGN_OR_RETURN(g.on_device, store_.emplace(g.grad, Tier::kDevice, /*zero_fill=*/true));
  return g.on_device;
}

Status GradientLanding::release(int group) {
  const ShardGroup& s = shapes_[static_cast<std::size_t>(group)];
  Group& g = groups_[static_cast<std::size_t>(group)];
  STRATA_CHECK(g.on_device != nullptr, "release_grads without acquire", s.name());
  void* src = std::exchange(g.on_device, nullptr);
  if (plan_.sums_on_device()) {
    // Accumulate on the device, in fp32.
    const auto& ops = device_.ops();
    auto pinned = g.has_grad ? store_.acquire(g.acc, Tier::kDevice)
                             : store_.emplace(g.acc, Tier::kDevice, true);
    if (!pinned.is_ok()) {
      store_.unpin(g.grad, Tier::kDevice);
      return pinned.status();
    }
    void* const acc = *pinned;
    if (dtype_ != DType::kF32) {
      auto wide = store_.emplace(widened_grad_, Tier::kDevice, false);
      if (!wide.is_ok()) {
        store_.unpin(g.acc, Tier::kDevice);
        store_.unpin(g.grad, Tier::kDevice);
        return wide.status();
      }
      ops.cast(src, dtype_, *wide, DType::kF32, s.n);
      src = *wide;
    }
    ops.add(acc, src, acc, s.n, DType::kF32);
    if (dtype_ != DType::kF32) store_.unpin(widened_grad_, Tier::kDevice);
    store_.mark_dirty(g.acc, Tier::kDevice);
    store_.unpin(g.acc, Tier::kDevice);
    store_.unpin(g.grad, Tier::kDevice);
    g.has_grad = true;
    STRATA_RETURN_IF_ERROR(store_.discard(g.grad));
    // The last micro-batch, with a guessed update running on the host: the sum is final.
    if (final_ == nullptr || plan_.optimizer == Tier::kDevice) return Status::ok();
    return send_final_sum(group);
  }
  if (plan_.keep_gradients) {
    // The gradient is final: summed here, while on the device, then off to where the plan
    // keeps gradients on the copy streams while the next layer's backward runs.
    device_sum_squares(src, dtype_, static_cast<std::size_t>(group));
    g.has_grad = true;
  }
  // Off the device while the next layer's backward runs: home (kept), to the host for a
  // guessed update to read it there (kept, guessing), or to the host to be accumulated.
  store_.unpin(g.grad, Tier::kDevice);
  const bool to_host = plan_.keep_gradients && final_ != nullptr;
  STRATA_ASSIGN_OR_RETURN(mem::Completion done, to_host ? store_.fetch(g.grad, Tier::kHost)
                                                        : store_.evict(g.grad, Tier::kDevice));
  pending_.push_back(Pending{group, std::move(done)});
  // Keep at most one transfer behind the compute: its copy is the store's to budget.
  while (pending_.size() > 1) STRATA_RETURN_IF_ERROR(drain_one());
  return Status::ok();
}

Status GradientLanding::send_final_sum(int group) {
  Group& g = groups_[static_cast<std::size_t>(group)];
  // The guessed update reads (and may discard) the final sum before the global norm is taken:
  // its sum of squares is taken now, while it is here.
  STRATA_ASSIGN_OR_RETURN(void* acc, store_.acquire(g.acc, Tier::kDevice));
  device_sum_squares(acc, DType::kF32, static_cast<std::size_t>(group));
  store_.unpin(g.acc, Tier::kDevice);
  g.final_sent = true;
  // To host memory for the update while the next layer's backward runs.
  STRATA_ASSIGN_OR_RETURN(mem::Completion sent, store_.fetch(g.acc, Tier::kHost));
  pending_.push_back(Pending{group, std::move(sent)});
  while (pending_.size() > 1) STRATA_RETURN_IF_ERROR(drain_one());
  return Status::ok();
}

Status GradientLanding::drain_one() {
  Pending p = std::move(pending_.front());
  pending_.pop_front();
  const ShardGroup& s = shapes_[static_cast<std::size_t>(p.group)];
  Group& g = groups_[static_cast<std::size_t>(p.group)];
  Status st = store_.wait(p.done);
  if (plan_.accumulate_on_device()) {  // a final sum, now in host memory for the guessed update
    if (st.is_ok() && final_ != nullptr) final_->gradient_final(p.group);
    return st;
  }
  if (plan_.keep_gradients) {
    if (!st.is_ok() || final_ == nullptr) return st;  // it is home
    // Its host copy is valid: the device copy goes (written home first if the store dropped
    // the host copy meanwhile), and the guessed update may have it.
    STRATA_ASSIGN_OR_RETURN(mem::Completion home, store_.evict(g.grad, Tier::kDevice));
    writebacks_.push_back(std::move(home));
    final_->gradient_final(p.group);
    return Status::ok();
  }
  if (!st.is_ok()) {
    store_.discard(g.grad).ignore();
    return st;
  }
  // acc (its host copy: the home, or fetched from it, or fresh on the first micro-batch)
  // += the gradient's host copy.
  STRATA_ASSIGN_OR_RETURN(void* host, store_.acquire(g.grad, Tier::kHost));
  const std::int64_t t0 = now_ns();
  auto acc = g.has_grad ? store_.acquire(g.acc, Tier::kHost)
                        : store_.emplace(g.acc, Tier::kHost, /*zero_fill=*/false);
  if (!acc.is_ok()) {
    store_.unpin(g.grad, Tier::kHost);
    store_.discard(g.grad).ignore();
    return acc.status();
  }
  auto* sum = static_cast<float*>(*acc);
  g.sum_squares = arrays_.accumulate(sum, host, dtype_, s.n, !g.has_grad);
  g.dup_sum_squares = s.dup_begin < s.n
                          ? arrays_.sum_squares(sum + s.dup_begin, DType::kF32, s.n - s.dup_begin)
                          : 0.0;
  g.has_grad = true;
  store_.mark_dirty(g.acc, Tier::kHost);
  store_.unpin(g.acc, Tier::kHost);
  if (timeline_ != nullptr) {
    timeline_->add(mem::Lane::kCompute, "accumulate " + s.name() + " gradient", t0, now_ns());
  }
  store_.unpin(g.grad, Tier::kHost);
  STRATA_RETURN_IF_ERROR(store_.discard(g.grad));
  if (final_ != nullptr) {  // final: the guessed update reads the host copy
    final_->gradient_final(p.group);
  } else if (plan_.gradients != Tier::kHost) {  // back to its home (NVMe) while compute goes on
    STRATA_ASSIGN_OR_RETURN(mem::Completion home, store_.evict(g.acc, Tier::kHost));
    writebacks_.push_back(std::move(home));
  }
  return Status::ok();
}

Status GradientLanding::finish_micro_batch() {
  Status first;
  const auto keep = [&first](Status s) {
    if (!s.is_ok() && first.is_ok()) first = std::move(s);
  };
  // A guess reads device sums from host memory: a group that had its last gradient in an
  // earlier micro-batch sends its sum now (its sum of squares too).
  if (final_ != nullptr && plan_.accumulate_on_device()) {
    for (std::size_t gi = 0; gi < groups_.size() && first.is_ok(); ++gi) {
      if (groups_[gi].has_grad && !groups_[gi].final_sent)
        keep(send_final_sum(static_cast<int>(gi)));
    }
  }
  while (!pending_.empty()) keep(drain_one());
  keep(wait_all(store_, writebacks_));
  if (final_ != nullptr && first.is_ok()) {
    // Backward is over: every gradient is final, zeros where none came. (After an error the
    // guess is abandoned, not fed.)
    keep(give_zeros());
    for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
      final_->gradient_final(static_cast<int>(gi));
    }
  }
  return first;
}

void GradientLanding::device_sum_squares(const void* x, DType dtype, std::size_t group) {
  const ShardGroup& s = shapes_[group];
  device_.ops().sum_squares(x, s.n, dtype, norm_slots_ + group);
  if (s.dup_begin < s.n) {
    device_.ops().sum_squares(static_cast<const std::byte*>(x) +
                                  static_cast<std::size_t>(s.dup_begin) * dtype_size(dtype),
                              s.n - s.dup_begin, dtype, norm_slots_ + shapes_.size() + group);
  }
}

Result<std::vector<double>> GradientLanding::sums_of_squares() {
  STRATA_CHECK(pending_.empty(), "gradient norm before finish_micro_batch");
  // Where the sums are is the plan's: taken on the device when the gradients are accumulated
  // there (summed now, unless a guess took them already) or kept (summed as each left the
  // device), else on the host as they were accumulated.
  const bool summed_on_device = plan_.sums_on_device();
  const bool on_device = summed_on_device || plan_.keep_gradients;
  bool any = false;
  for (std::size_t i = 0; i < groups_.size(); ++i) {
    Group& g = groups_[i];
    any |= g.has_grad;
    if (!g.has_grad || !summed_on_device || g.final_sent) continue;
    STRATA_ASSIGN_OR_RETURN(void* acc, store_.acquire(g.acc, Tier::kDevice));
    device_sum_squares(acc, DType::kF32, i);
    store_.unpin(g.acc, Tier::kDevice);
  }
  if (on_device && any) {
    device::Stream& compute = device_.stream(device::StreamKind::kCompute);
    if (norm_slots_ != norms_host_) {
      device_.copy_to_host(norms_host_, norm_slots_, 2 * groups_.size() * sizeof(double), compute);
    }
    compute.synchronize();
    // A failed sum (its launch, or a fault before it) is the error, not a stale number.
    STRATA_RETURN_IF_ERROR(device_.last_error());
  }
  // What this rank counts: each gradient's sum less its duplicates' (summed apart, so kept
  // from going below zero by rounding; NaN and infinity stay, for the step to be skipped).
  std::vector<double> sums(groups_.size(), 0.0);
  const std::size_t dups = groups_.size();
  for (std::size_t i = 0; i < groups_.size(); ++i) {
    const ShardGroup& s = shapes_[i];
    const Group& g = groups_[i];
    if (!g.has_grad) continue;
    const double whole = on_device ? norms_host_[i] : g.sum_squares;
    const double dup = s.dup_begin >= s.n ? 0.0
                       : on_device        ? norms_host_[dups + i]
                                          : g.dup_sum_squares;
    const double counted = whole - dup;
    sums[i] = counted < 0 ? 0.0 : counted;  // a non-finite sum stays what it is
  }
  return sums;
}

void GradientLanding::clear() {
  for (Group& g : groups_) {
    g.has_grad = false;
    g.final_sent = false;
    g.sum_squares = 0;
    g.dup_sum_squares = 0;
  }
}

Status GradientLanding::give_zeros() {
  for (std::size_t i = 0; i < groups_.size(); ++i) {
    Group& g = groups_[i];
    if (g.has_grad || !shapes_[i].trains()) continue;
    STRATA_RETURN_IF_ERROR(store_.fill_zero(step_grad(static_cast<int>(i))));
    // Its sum of squares, where kept gradients' and guessed device sums' are.
    if (plan_.keep_gradients || (plan_.accumulate_on_device() && final_ != nullptr)) {
      for (std::size_t slot : {i, groups_.size() + i}) {
        device_.fill_zero(norm_slots_ + slot, sizeof(double),
                          device_.stream(device::StreamKind::kCompute));
      }
      g.final_sent = plan_.accumulate_on_device();
    }
    g.has_grad = true;
  }
  return Status::ok();
}

Status GradientLanding::send_sums_to_host() {
  if (!plan_.accumulate_on_device()) return Status::ok();
  for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
    if (!shapes_[gi].trains()) continue;
    STRATA_RETURN_IF_ERROR(store_.fetch(groups_[gi].acc, Tier::kHost).status());
  }
  return Status::ok();
}

Status GradientLanding::spend(int group, bool keep, std::vector<mem::Completion>& writebacks) {
  const mem::Handle grad = step_grad(group);
  if (!keep) return store_.discard(grad);
  if (store_.spec(grad).home == Tier::kHost) return Status::ok();
  STRATA_ASSIGN_OR_RETURN(mem::Completion home, store_.evict(grad, Tier::kHost));
  writebacks.push_back(std::move(home));
  return Status::ok();
}

mem::Handle GradientLanding::step_grad(int group) const {
  const Group& g = groups_.at(static_cast<std::size_t>(group));
  return plan_.keep_gradients ? g.grad : g.acc;
}

DType GradientLanding::step_dtype() const { return plan_.keep_gradients ? dtype_ : DType::kF32; }

}  // namespace strata::zero
