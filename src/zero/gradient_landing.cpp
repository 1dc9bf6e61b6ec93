// GradientLanding: gradients off the device as they are made, accumulated and summed where the
// plan says, final for a guessed update as soon as they are.
#include "strata/zero/gradient_landing.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "strata/core/clock.h"
#include "strata/core/summation_tree.h"

namespace strata::zero {

struct GradientLanding::Group {
  // Kept gradients (plan.keep_gradients): the gradient itself, homed where the plan keeps
  // gradients. Otherwise this micro-batch's gradient in transit (a transient tensor), summed
  // into `sums`, the fp32 buffers the tree's partial sums take (plan.accumulators of them).
  mem::Handle grad = mem::Handle::kInvalid;
  std::vector<mem::Handle> sums;
  std::optional<SummationTree> tree;
  std::vector<ExactSum> squares;  // by buffer: of its sum as last written (summed off the device)
  bool whole = false;             // every merge is made: sums[result] is the step's gradient
  void* on_device = nullptr;      // the gradient's device copy while the model accumulates into it
  bool has_grad = false;          // a gradient arrived since the last step
  bool final_sent = false;        // a guessed update has its final sum (device accumulation)
};

GradientLanding::GradientLanding(mem::TieredStore& store, const std::vector<ShardGroup>& groups,
                                 const device::HostArrays& arrays, device::Device& device,
                                 const MemoryPlan& plan, DType gradient_dtype,
                                 mem::Timeline* timeline)
    : store_(store),
      shapes_(groups),
      arrays_(arrays),
      device_(device),
      plan_(plan),
      dtype_(gradient_dtype),
      timeline_(timeline),
      groups_(groups.size()) {}

GradientLanding::~GradientLanding() = default;

Result<std::unique_ptr<GradientLanding>> GradientLanding::create(
    mem::TieredStore& store, const std::vector<ShardGroup>& groups,
    const device::HostArrays& arrays, device::Device& device, const MemoryPlan& plan,
    DType gradient_dtype, mem::Timeline* timeline) {
  std::unique_ptr<GradientLanding> l(
      new GradientLanding(store, groups, arrays, device, plan, gradient_dtype, timeline));
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
  norms_host_ = static_cast<ExactSum*>(norms_host);
  norm_slots_ = norms_host_;
  if (!device_.host_addressable()) {
    ns.name = "gradient sums of squares (device)";
    ns.scratch = true;
    STRATA_ASSIGN_OR_RETURN(const mem::Handle device_norms, store_.add(ns));
    STRATA_ASSIGN_OR_RETURN(void* slots, store_.emplace(device_norms, Tier::kDevice, true));
    norm_slots_ = static_cast<ExactSum*>(slots);
  }
  std::int64_t max_elems = 0;  // of the groups summed on the device
  for (std::size_t gi = 0; gi < shapes_.size(); ++gi) {
    const ShardGroup& s = shapes_[gi];
    if (!s.trains()) continue;  // a frozen group has no gradient; an empty one nothing here
    if (plan_.sums_on_device(gi)) max_elems = std::max(max_elems, s.n);
    Group& g = groups_[gi];
    const std::string name = "gradient of " + s.name();
    // As the model makes it, or summed over the ranks into f32 (ZeroOptions::wide_gradients).
    const std::uint64_t bytes = static_cast<std::uint64_t>(s.n) * dtype_size(dtype_);
    if (plan_.keeps_gradient(gi)) {
      STRATA_ASSIGN_OR_RETURN(g.grad, add_tensor(store_, name, bytes, plan_.gradients_of(gi)));
      continue;
    }
    STRATA_ASSIGN_OR_RETURN(g.grad, add_tensor(store_, name, bytes, Tier::kHost, true));
    for (int b = 0; b < plan_.accumulators; ++b) {
      STRATA_ASSIGN_OR_RETURN(
          const mem::Handle sum,
          add_tensor(store_,
                     (b == 0 ? "gradient accumulator of "
                             : "gradient partial sum " + std::to_string(b) + " of ") +
                         s.name(),
                     static_cast<std::uint64_t>(s.n) * sizeof(float), plan_.gradients_of(gi)));
      g.sums.push_back(sum);
    }
    g.squares.resize(g.sums.size());
    g.tree.emplace(plan_.accumulation_steps, plan_.tree_sums);
  }
  if (max_elems != 0 && dtype_ != DType::kF32) {
    STRATA_ASSIGN_OR_RETURN(
        widened_grad_,
        add_tensor(store_, "widened gradient",
                   static_cast<std::uint64_t>(max_elems) * sizeof(float), Tier::kDevice));
  }
  return Status::ok();
}

Result<void*> GradientLanding::acquire(int group, model::GradientWrite write) {
  const ShardGroup& s = shapes_.at(static_cast<std::size_t>(group));
  Group& g = groups_[static_cast<std::size_t>(group)];
  STRATA_CHECK(!s.frozen(), "gradient of a frozen group (ZeroProvider refuses it)", s.name());
  STRATA_CHECK(g.on_device == nullptr, "acquire_grads twice without release", s.name());
  if (plan_.keeps_gradient(static_cast<std::size_t>(group)) && g.has_grad) {
    return failed_precondition("a second gradient of '" + s.name() +
                               "' before the optimizer step, but the plan keeps one gradient "
                               "per step (accumulation_steps 1)");
  }
  STRATA_ASSIGN_OR_RETURN(
      g.on_device, store_.emplace(g.grad, Tier::kDevice, write == model::GradientWrite::kAdd));
  return g.on_device;
}

Status GradientLanding::release(int group) {
  const ShardGroup& s = shapes_[static_cast<std::size_t>(group)];
  Group& g = groups_[static_cast<std::size_t>(group)];
  STRATA_CHECK(g.on_device != nullptr, "release_grads without acquire", s.name());
  void* src = std::exchange(g.on_device, nullptr);
  const auto gi = static_cast<std::size_t>(group);
  if (plan_.sums_on_device(gi)) {
    // Summed on the device, in fp32.
    Status st = [&]() -> Status {
      if (dtype_ == DType::kF32) return sum_in(group, micro_, src, DType::kF32, Tier::kDevice);
      STRATA_ASSIGN_OR_RETURN(void* wide, store_.emplace(widened_grad_, Tier::kDevice, false));
      device_.ops().cast(src, dtype_, wide, DType::kF32, s.n);
      Status summed = sum_in(group, micro_, wide, DType::kF32, Tier::kDevice);
      store_.unpin(widened_grad_, Tier::kDevice);
      return summed;
    }();
    store_.unpin(g.grad, Tier::kDevice);
    STRATA_RETURN_IF_ERROR(st);
    g.has_grad = true;
    STRATA_RETURN_IF_ERROR(store_.discard(g.grad));
    // The last micro-batch, with a guessed update running on the host: the sum is final once
    // the tree owes it no merge.
    if (final_ == nullptr || plan_.steps_on_device(gi)) return Status::ok();
    if (micro_ + 1 < plan_.accumulation_steps) return Status::ok();
    STRATA_RETURN_IF_ERROR(sum_in(group, -1, nullptr, DType::kF32, Tier::kDevice));
    return send_final_sum(group);
  }
  if (plan_.keeps_gradient(gi)) {
    // The gradient is final: summed here, while on the device, then off to where the plan
    // keeps gradients on the copy streams while the next layer's backward runs.
    device_sum_squares(src, dtype_, static_cast<std::size_t>(group));
    g.has_grad = true;
  }
  // Off the device while the next layer's backward runs: home (kept), to the host for a
  // guessed update to read it there (kept, guessing), or to the host to be accumulated.
  store_.unpin(g.grad, Tier::kDevice);
  const bool to_host = plan_.keeps_gradient(gi) && final_ != nullptr;
  STRATA_ASSIGN_OR_RETURN(mem::Completion done, to_host ? store_.fetch(g.grad, Tier::kHost)
                                                        : store_.evict(g.grad, Tier::kDevice));
  pending_.push_back(Pending{group, std::move(done), micro_});
  // Keep at most one transfer behind the compute: its copy is the store's to budget.
  while (pending_.size() > 1) STRATA_RETURN_IF_ERROR(drain_one());
  return Status::ok();
}

Status GradientLanding::send_final_sum(int group) {
  Group& g = groups_[static_cast<std::size_t>(group)];
  // The guessed update reads (and may discard) the final sum before the global norm is taken:
  // its sum of squares is taken now, while it is here.
  const mem::Handle sum = g.sums.front();
  STRATA_ASSIGN_OR_RETURN(void* acc, store_.acquire(sum, Tier::kDevice));
  device_sum_squares(acc, DType::kF32, static_cast<std::size_t>(group));
  store_.unpin(sum, Tier::kDevice);
  g.final_sent = true;
  // To host memory for the update while the next layer's backward runs.
  STRATA_ASSIGN_OR_RETURN(mem::Completion sent, store_.fetch(sum, Tier::kHost));
  pending_.push_back(Pending{group, std::move(sent), micro_});
  while (pending_.size() > 1) STRATA_RETURN_IF_ERROR(drain_one());
  return Status::ok();
}

Status GradientLanding::drain_one() {
  Pending p = std::move(pending_.front());
  pending_.pop_front();
  const ShardGroup& s = shapes_[static_cast<std::size_t>(p.group)];
  Group& g = groups_[static_cast<std::size_t>(p.group)];
  Status st = store_.wait(p.done);
  const auto gi = static_cast<std::size_t>(p.group);
  if (plan_.accumulate_on_device(gi)) {  // a final sum, now in host memory for the guessed update
    if (st.is_ok() && final_ != nullptr) final_->gradient_final(p.group);
    return st;
  }
  if (plan_.keeps_gradient(gi)) {
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
  // The sums (their host copies: the home, or fetched from it, or fresh) take in the
  // gradient's host copy.
  STRATA_ASSIGN_OR_RETURN(void* host, store_.acquire(g.grad, Tier::kHost));
  const std::int64_t t0 = now_ns();
  Status summed = sum_in(p.group, p.micro, host, dtype_, Tier::kHost);
  store_.unpin(g.grad, Tier::kHost);
  if (!summed.is_ok()) {
    store_.discard(g.grad).ignore();
    return summed;
  }
  g.has_grad = true;
  if (timeline_ != nullptr) {
    timeline_->add(mem::Lane::kCompute, "accumulate " + s.name() + " gradient", t0, now_ns());
  }
  STRATA_RETURN_IF_ERROR(store_.discard(g.grad));
  if (final_ != nullptr && p.micro + 1 >= plan_.accumulation_steps) {
    // Final: the guessed update reads the host copy.
    STRATA_RETURN_IF_ERROR(sum_in(p.group, -1, nullptr, DType::kF32, Tier::kHost));
    final_->gradient_final(p.group);
  }
  return Status::ok();
}

Status GradientLanding::sum_in(int group, std::int64_t leaf, const void* x, DType dtype,
                               Tier tier) {
  const ShardGroup& s = shapes_[static_cast<std::size_t>(group)];
  Group& g = groups_[static_cast<std::size_t>(group)];
  if (x == nullptr && g.whole) return Status::ok();
  if (x != nullptr && leaf >= plan_.accumulation_steps) {
    return failed_precondition("a gradient of '" + s.name() + "' in micro-batch " +
                               std::to_string(leaf + 1) + " of a step planned for " +
                               std::to_string(plan_.accumulation_steps));
  }
  if (x != nullptr && leaf < g.tree->next()) {
    return failed_precondition("a second gradient of '" + s.name() + "' for micro-batch " +
                               std::to_string(leaf + 1) +
                               " (each micro-batch releases a group's gradient once)");
  }
  const std::vector<SummationTree::Op> ops = x != nullptr ? g.tree->arrive(leaf) : g.tree->finish();
  const auto& dev = device_.ops();
  std::vector<int> written;
  for (const SummationTree::Op& op : ops) {
    const mem::Handle into = g.sums[static_cast<std::size_t>(op.into)];
    const bool fresh = op.kind == SummationTree::Op::Kind::kStore;
    STRATA_ASSIGN_OR_RETURN(void* sum, fresh ? store_.emplace(into, tier, tier == Tier::kDevice)
                                             : store_.acquire(into, tier));
    const void* addend = x;
    DType addend_dtype = dtype;
    mem::Handle from = mem::Handle::kInvalid;
    if (op.kind == SummationTree::Op::Kind::kMerge) {
      from = g.sums[static_cast<std::size_t>(op.from)];
      auto other = store_.acquire(from, tier);
      if (!other.is_ok()) {
        store_.unpin(into, tier);
        return other.status();
      }
      addend = *other;
      addend_dtype = DType::kF32;
    }
    if (tier == Tier::kDevice) {  // a fresh sum is zero-filled: +0 + x, as the host's
      dev.add(sum, addend, sum, s.n, DType::kF32);
    } else {
      g.squares[static_cast<std::size_t>(op.into)] = arrays_.accumulate(
          static_cast<float*>(sum), addend, addend_dtype, s.n, fresh, s.dup_begin);
    }
    store_.mark_dirty(into, tier);
    store_.unpin(into, tier);
    if (from != mem::Handle::kInvalid) {
      store_.unpin(from, tier);
      STRATA_RETURN_IF_ERROR(store_.discard(from));
      std::erase(written, op.from);
    }
    if (std::find(written.begin(), written.end(), op.into) == written.end()) {
      written.push_back(op.into);
    }
  }
  if (x == nullptr) {
    g.whole = true;
    // The first buffer a step stores into is the tree's bottom one, which every later sum
    // joins: the sum always ends in buffer 0 (a guessed update holds that handle from the start).
    STRATA_CHECK(g.tree->result() <= 0, "the summation tree's sum left buffer 0", s.name());
  }
  // Host sums go back to their home (NVMe) while compute goes on, unless a guessed update is
  // about to read them here.
  if (tier == Tier::kHost && plan_.gradients_of(static_cast<std::size_t>(group)) != Tier::kHost &&
      final_ == nullptr) {
    for (const int b : written) {
      STRATA_ASSIGN_OR_RETURN(mem::Completion home,
                              store_.evict(g.sums[static_cast<std::size_t>(b)], Tier::kHost));
      writebacks_.push_back(std::move(home));
    }
  }
  return Status::ok();
}

Status GradientLanding::finish_sums() {
  for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
    if (!groups_[gi].has_grad || plan_.keeps_gradient(gi)) continue;
    const Tier tier = plan_.sums_on_device(gi) ? Tier::kDevice : Tier::kHost;
    STRATA_RETURN_IF_ERROR(sum_in(static_cast<int>(gi), -1, nullptr, DType::kF32, tier));
  }
  return Status::ok();
}

void GradientLanding::set_micro_batch(std::int64_t micro) { micro_ = micro; }

Status GradientLanding::finish_micro_batch() {
  Status first;
  const auto keep = [&first](Status s) {
    if (!s.is_ok() && first.is_ok()) first = std::move(s);
  };
  // A guess reads device sums from host memory: a group that had its last gradient in an
  // earlier micro-batch sends its sum now (its sum of squares too).
  if (final_ != nullptr) {
    for (std::size_t gi = 0; gi < groups_.size() && first.is_ok(); ++gi) {
      if (!plan_.accumulate_on_device(gi)) continue;
      if (!groups_[gi].has_grad || groups_[gi].final_sent) continue;
      keep(sum_in(static_cast<int>(gi), -1, nullptr, DType::kF32, Tier::kDevice));
      if (first.is_ok()) keep(send_final_sum(static_cast<int>(gi)));
    }
  }
  while (!pending_.empty()) keep(drain_one());
  // After the step's last pass, with a guess waiting: the merges the trees still owe (zero
  // leaves after a group's last gradient), so every sum is whole. (Otherwise the norm and the
  // step make them: a pipeline's passes end micro-batches chunk by chunk.)
  if (first.is_ok() && final_ != nullptr) keep(finish_sums());
  keep(wait_all(store_, writebacks_));
  ++micro_;
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
  device_.ops().sum_squares(x, shapes_[group].dup_begin, dtype, norm_slots_ + group);
}

Result<std::vector<ExactSum>> GradientLanding::sums_of_squares() {
  STRATA_CHECK(pending_.empty(), "gradient norm before finish_micro_batch");
  STRATA_RETURN_IF_ERROR(finish_sums());
  // Where the sums are is the plan's, by group: taken on the device when the gradients are
  // accumulated there (summed now, unless a guess took them already) or kept (summed as each left
  // the device), else on the host as they were accumulated.
  const auto on_device = [&](std::size_t i) {
    return plan_.sums_on_device(i) || plan_.keeps_gradient(i);
  };
  bool any = false;
  for (std::size_t i = 0; i < groups_.size(); ++i) {
    Group& g = groups_[i];
    any |= g.has_grad && on_device(i);
    if (!g.has_grad || !plan_.sums_on_device(i) || g.final_sent) continue;
    const mem::Handle sum = g.sums.front();
    STRATA_ASSIGN_OR_RETURN(void* acc, store_.acquire(sum, Tier::kDevice));
    device_sum_squares(acc, DType::kF32, i);
    store_.unpin(sum, Tier::kDevice);
  }
  if (any) {
    device::Stream& compute = device_.stream(device::StreamKind::kCompute);
    if (norm_slots_ != norms_host_) {
      device_.copy_to_host(norms_host_, norm_slots_, groups_.size() * sizeof(ExactSum), compute);
    }
    compute.synchronize();
    // A failed sum (its launch, or a fault before it) is the error, not a stale number.
    STRATA_RETURN_IF_ERROR(device_.last_error());
  }
  std::vector<ExactSum> sums(groups_.size());
  for (std::size_t i = 0; i < groups_.size(); ++i) {
    const Group& g = groups_[i];
    if (!g.has_grad) continue;
    sums[i] = on_device(i) ? norms_host_[i] : g.squares.front();
  }
  return sums;
}

void GradientLanding::clear() {
  micro_ = 0;
  for (Group& g : groups_) {
    g.has_grad = false;
    g.final_sent = false;
    for (ExactSum& s : g.squares) s = ExactSum{};
    if (g.tree) g.tree->reset();
    g.whole = false;
  }
}

Status GradientLanding::give_zeros() {
  for (std::size_t i = 0; i < groups_.size(); ++i) {
    Group& g = groups_[i];
    if (g.has_grad || !shapes_[i].trains()) continue;
    STRATA_RETURN_IF_ERROR(store_.fill_zero(step_grad(static_cast<int>(i))));
    // Its sum of squares, where kept gradients' and guessed device sums' are.
    if (plan_.keeps_gradient(i) || (plan_.accumulate_on_device(i) && final_ != nullptr)) {
      device_.fill_zero(norm_slots_ + i, sizeof(ExactSum),
                        device_.stream(device::StreamKind::kCompute));
      g.final_sent = plan_.accumulate_on_device(i);
    }
    g.has_grad = true;
  }
  return Status::ok();
}

Status GradientLanding::send_sums_to_host() {
  for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
    if (!shapes_[gi].trains() || !plan_.accumulate_on_device(gi)) continue;
    STRATA_RETURN_IF_ERROR(store_.fetch(step_grad(static_cast<int>(gi)), Tier::kHost).status());
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
  return plan_.keeps_gradient(static_cast<std::size_t>(group)) ? g.grad : g.sums.front();
}

DType GradientLanding::step_dtype(bool device_steps) const {
  return plan_.keep_gradients && !device_steps ? dtype_ : DType::kF32;
}

}  // namespace strata::zero
