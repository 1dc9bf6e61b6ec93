// OptimizerSchedule: the optimizer step serially, overlapped with the next forward, or guessed
// beside backward and validated, over the shard store's tensors.
#include "strata/zero/optimizer_schedule.h"

#include <algorithm>
#include <utility>

#include "strata/core/clock.h"
#include "strata/optim/adamw.h"
#include "strata/zero/step_target.h"

namespace strata::zero {

Result<std::unique_ptr<OptimizerSchedule>> OptimizerSchedule::create(ShardStore& shards,
                                                                     device::Device& device,
                                                                     const ShardOptions& options) {
  const MemoryPlan& plan = shards.plan();
  OptimizerStepOptions oo;
  oo.cpu_adam = options.cpu_adam;
  oo.sub_group_size = options.sub_group_size;
  oo.max_group_elems = shards.max_group_elems();
  oo.stream_grads = plan.gradients == Tier::kNvme;
  oo.master_layout = optim::master_layout(options.adam.master_dtype, options.adam.master_rounding);
  oo.moment_layout = optim::moment_layout(options.adam.state_dtype);
  // offload_optimizer_fraction 0 leaves the offload tier nothing to step (nor staging to stream
  // through): an empty host step stands in.
  const Tier offloaded = plan.offload_fraction > 0 ? plan.optimizer : Tier::kHost;
  STRATA_ASSIGN_OR_RETURN(
      std::unique_ptr<OptimizerStep> optimizer,
      make_optimizer_step(offloaded, device, shards.store().range_staging(), oo));
  std::unique_ptr<OptimizerStep> on_device;  // the groups the device steps (device_steps)
  if (plan.optimizer != Tier::kDevice && plan.any_device_steps()) {
    STRATA_ASSIGN_OR_RETURN(on_device, make_optimizer_step(Tier::kDevice, device, {}, oo));
  }
  std::unique_ptr<OptimizerSchedule> s(
      new OptimizerSchedule(shards, device, options, std::move(optimizer), std::move(on_device)));
  shards.params().set_update_gate(s.get());
  return s;
}

OptimizerSchedule::OptimizerSchedule(ShardStore& shards, device::Device& device,
                                     const ShardOptions& options,
                                     std::unique_ptr<OptimizerStep> optimizer,
                                     std::unique_ptr<OptimizerStep> device_optimizer)
    : shards_(shards),
      device_(device),
      options_(options),
      optimizer_(std::move(optimizer)),
      device_optimizer_(std::move(device_optimizer)),
      schedule_(shards.plan().overlap) {
  if (shards.plan().measure_overlap) {
    chooser_.emplace(shards.plan().overlap, options_.schedule_chooser);
  }
}

OptimizerSchedule::~OptimizerSchedule() {
  (void)finish_step();  // its error, if nobody asked, was the run's to report
  shards_.params().set_update_gate(nullptr);
  shards_.grads().report_final_to(nullptr);
}

void OptimizerSchedule::set_phase(Phase phase) {
  phase_ = phase;
  shards_.grads().report_final_to(phase == Phase::kGuessing ? this : nullptr);
}

// ---- the parameter path's questions ----

bool OptimizerSchedule::update_done(int group) {
  // A guessed update writes only groups whose backward is done.
  if (!step_thread_.joinable() || phase_ == Phase::kGuessing) return true;
  std::lock_guard lock(step_mu_);
  return static_cast<bool>(updated_[static_cast<std::size_t>(group)]);
}

Status OptimizerSchedule::wait_update(int group) {
  // A guess updates only groups whose backward is done; the forward after it waits.
  if (!step_thread_.joinable() || phase_ == Phase::kGuessing) return Status::ok();
  Stopwatch wait;
  bool updated = false;
  {
    std::unique_lock lock(step_mu_);
    step_cv_.wait(lock, [&] { return updated_[static_cast<std::size_t>(group)] || step_done_; });
    updated = updated_[static_cast<std::size_t>(group)];
  }
  stats_.optimizer_exposed_ms += wait.elapsed_ms();
  // The step ended without writing this group: an error, which finishing reports.
  return updated ? Status::ok() : finish_step();
}

void OptimizerSchedule::gradient_final(int group) {
  {
    std::lock_guard lock(step_mu_);
    ready_[static_cast<std::size_t>(group)] = true;
  }
  step_cv_.notify_all();
}

// ---- a step's events ----

void OptimizerSchedule::begin_last_micro_batch(double lr, std::int64_t step, bool may_clip,
                                               float unscale) {
  expected_scale_ = unscale;
  // The schedule the last step ran: the chooser may change it at the next step(), after the
  // guess would have begun; a guess running then is finished at once.
  if (schedule_ != OptimizerOverlap::kBackward || last_clipped_) return;
  STRATA_CHECK(phase_ != Phase::kGuessing, "begin_last_micro_batch while a guess runs");
  guess_lr_ = lr;
  guess_step_ = step;
  guess_keeps_grads_ = may_clip;
  armed_ = true;  // the guess starts with the micro-batch's first gradient
}

Status OptimizerSchedule::before_gradients() {
  // The last step still reads its gradients; a guessed one starts with this step's first.
  STRATA_RETURN_IF_ERROR(finish_unless_guessing());
  if (std::exchange(armed_, false)) start_guess();
  return Status::ok();
}

Status OptimizerSchedule::finish_micro_batch() {
  Status first = finish_unless_guessing();
  if (Status s = shards_.finish_micro_batch(); !s.is_ok() && first.is_ok()) first = s;
  armed_ = false;  // no gradient at all: nothing to guess
  return first;
}

Result<std::vector<ExactSum>> OptimizerSchedule::grad_sums_of_squares() {
  STRATA_RETURN_IF_ERROR(finish_unless_guessing());
  return shards_.grads().sums_of_squares();
}

Status OptimizerSchedule::zero_grads() {
  Status s;
  if (phase_ == Phase::kGuessing) {
    s = abandon_guess();
    ++stats_.steps_guessed;
    ++stats_.steps_rolled_back;
  }
  STRATA_CHECK(!step_thread_.joinable(), "zero_grads while an optimizer step runs");
  armed_ = false;
  last_clipped_ = true;  // a skipped step says little about the next: do not guess it
  shards_.grads().clear();
  return s;
}

Status OptimizerSchedule::restart() {
  STRATA_RETURN_IF_ERROR(zero_grads());
  last_clipped_ = false;
  return Status::ok();
}

Status OptimizerSchedule::step(double lr, std::int64_t step, float grad_scale) {
  if (chooser_) {
    chooser_->step_began(options_.clock ? options_.clock() : now_ns());
    schedule_ = chooser_->current();
  }
  step_inline_ = schedule_ == OptimizerOverlap::kNone;
  bool redo = false;  // the working copies a guess touched stay touched: the redo rewrites them
  last_clipped_ = grad_scale != expected_scale_;
  const device::AdamWArgs args = optim::make_adamw_args(options_.adam, lr, step, grad_scale);
  if (phase_ == Phase::kGuessing) {
    const bool holds = lr == guess_lr_ && step == guess_step_ && grad_scale == expected_scale_;
    ++stats_.steps_guessed;
    if (holds) {  // the guess is the step: it runs on into the next forward
      set_phase(Phase::kRunning);
      step_inline_ = false;  // what it hid beside backward stays hidden
      // The groups the device steps, now that the scale is known (their sums are whole: the
      // guess's finish_micro_batch made them).
      Status on_device = run_device_step(args);
      // Unless the serial schedule was chosen from now on: then the step ends here.
      if (!on_device.is_ok() || schedule_ == OptimizerOverlap::kNone) {
        Status host = finish_step();
        return on_device.is_ok() ? host : on_device;
      }
      return Status::ok();
    }
    // The scale differs (clipping): the state before the step is intact in the shadow scheme;
    // stop the guess and redo the step from it with the gradients kept for this.
    STRATA_CHECK(guess_keeps_grads_, "a redo of a guess that did not keep its gradients");
    STRATA_RETURN_IF_ERROR(abandon_guess(/*restore=*/false));
    ++stats_.steps_redone;
    redo = true;
  } else {
    STRATA_RETURN_IF_ERROR(finish_step());
  }
  GradientLanding& grads = shards_.grads();
  STRATA_CHECK(grads.idle(), "optimizer step before the last micro-batch's finish_micro_batch");
  STRATA_RETURN_IF_ERROR(grads.finish_sums());
  STRATA_RETURN_IF_ERROR(grads.give_zeros());
  // Sums made on the device go to host memory on the copy streams (a redo finds them there
  // already); the step's acquire of each waits for its copy only.
  STRATA_RETURN_IF_ERROR(grads.send_sums_to_host());
  if (schedule_ != OptimizerOverlap::kNone) {
    launch_step(args, Phase::kRunning, /*keep_touched=*/redo);
    // The groups the device steps, ordered on its stream while the host's update runs. They
    // have one copy of their state, written in place: a device step that fails leaves them part
    // stepped, and the run ends with its error (the host's update is joined first).
    Status on_device = run_device_step(args);
    if (on_device.is_ok()) return Status::ok();
    (void)finish_step();  // the device's error is the one to report
    return on_device;
  }
  reset_step_flags(/*keep_touched=*/redo);
  Status s = run_step(args, /*guess=*/false);
  if (s.is_ok()) s = run_device_step(args);
  {
    std::lock_guard lock(step_mu_);
    step_done_ = true;
  }
  return end_step(std::move(s));
}

void OptimizerSchedule::start_guess() {
  launch_step(optim::make_adamw_args(options_.adam, guess_lr_, guess_step_, expected_scale_),
              Phase::kGuessing,
              /*keep_touched=*/false);
}

void OptimizerSchedule::reset_step_flags(bool keep_touched) {
  const auto n = static_cast<std::size_t>(shards_.num_groups());
  std::lock_guard lock(step_mu_);
  updated_.assign(n, false);
  // A frozen group's working copy is never written (nor an empty one's): it is as updated as it
  // will be.
  for (std::size_t g = 0; g < n; ++g) {
    updated_[g] = shards_.frozen(static_cast<int>(g)) || shards_.empty(static_cast<int>(g));
  }
  if (!keep_touched) touched_.assign(n, false);
  ready_.assign(n, false);
  cancel_ = false;
  step_done_ = false;
  step_status_ = Status::ok();
}

void OptimizerSchedule::launch_step(const device::AdamWArgs& args, Phase phase, bool keep_touched) {
  reset_step_flags(keep_touched);
  set_phase(phase);
  step_thread_ = std::thread([this, args, guess = phase == Phase::kGuessing] {
    Status s = run_step(args, guess);
    std::lock_guard lock(step_mu_);
    step_status_ = std::move(s);
    step_done_ = true;
    step_cv_.notify_all();
  });
}

Status OptimizerSchedule::abandon_guess(bool restore) {
  {
    std::lock_guard lock(step_mu_);
    cancel_ = true;
  }
  step_cv_.notify_all();
  Stopwatch wait;
  step_thread_.join();
  stats_.optimizer_exposed_ms += wait.elapsed_ms();
  set_phase(Phase::kIdle);
  Status guess;
  std::vector<bool> written;
  {
    std::lock_guard lock(step_mu_);
    guess = step_status_;
    written = touched_;
  }
  count_step();
  // The state is as before the step (the guess wrote the shadow copy); the working copies the
  // guess wrote go back to what that state says, unless a redo is about to rewrite them all.
  const bool failed = !guess.is_ok() && guess.code() != StatusCode::kCancelled;
  Status s = restore || failed ? shards_.restore_working_copies(written) : Status::ok();
  // The guess's own error (it read or wrote the state) comes first; being stopped is none.
  return failed ? guess : s;
}

// The step's target: the optimizer state's tensors in the store (StoreStepTarget), the working
// copies each update writes, sent home as soon as written, the gradients spent or kept for a
// redo, and the schedule's flags: which groups the step touched and updated, and (a guess) when
// each gradient is final.
class OptimizerSchedule::ScheduledStep final : public StoreStepTarget {
 public:
  // `on_device`: the groups the device steps (device_steps), on the calling thread beside the
  // host's step, which its own writebacks and spans keep apart from. A guess steps its groups
  // in backward order, as their gradients become final; else in layout order.
  ScheduledStep(OptimizerSchedule& schedule, bool guess, bool on_device)
      : ScheduledStep(schedule,
                      schedule.shards_.state().step_groups(schedule.shards_.grads(), on_device),
                      guess, on_device) {}

  // The working copies it wrote, home.
  Status wait_writebacks() { return wait_all(schedule_.shards_.store(), writebacks_); }

  // A guess updates each group once its gradient is final; else every gradient is.
  Result<bool> gradient_ready(std::size_t gi, bool wait) override {
    if (!guess_) return true;
    OptimizerSchedule& s = schedule_;
    const auto group = static_cast<std::size_t>(ids_[gi]);
    {
      std::unique_lock lock(s.step_mu_);
      if (wait) s.step_cv_.wait(lock, [&] { return s.ready_[group] || s.cancel_; });
      if (!s.cancel_) {
        const bool final = s.ready_[group];
        lock.unlock();
        // The group's update starts once its gradient is final, or the last one has ended.
        if (final) span_ns_ = std::max(span_ns_, now_ns());
        return final;
      }
    }
    return Status(StatusCode::kCancelled, "the guessed optimizer step was abandoned");
  }

  Result<void*> open_output(std::size_t gi, Tier tier) override {
    const int group = ids_[gi];
    {
      std::lock_guard lock(schedule_.step_mu_);
      // emplace drops the old data even if the update never comes
      schedule_.touched_[static_cast<std::size_t>(group)] = true;
    }
    auto out = schedule_.shards_.params().open(group, tier);
    if (out.is_ok()) open_[gi] = tier;
    return out;
  }

  Status close_output(std::size_t gi, Tier tier) override {
    OptimizerSchedule& s = schedule_;
    const int group = ids_[gi];
    open_[gi].reset();
    Status st = s.shards_.params().close(group, tier, writebacks_, /*keep_host_copy=*/true);
    // The gradient is spent, unless a redo may need it: then it goes home like any other.
    if (st.is_ok()) {
      st = s.shards_.grads().spend(group, guess_ && s.guess_keeps_grads_, writebacks_);
    }
    const std::int64_t end = now_ns();
    if (s.options_.timeline != nullptr) {
      s.options_.timeline->add(on_device_ ? mem::Lane::kCompute : mem::Lane::kCpuOptimizer,
                               (guess_       ? "update (guessed) "
                                : on_device_ ? "update (device) "
                                             : "update ") +
                                   groups()[gi].name,
                               span_ns_, end);
    }
    span_ns_ = end;
    {
      std::lock_guard lock(s.step_mu_);
      s.updated_[static_cast<std::size_t>(group)] = true;
    }
    s.step_cv_.notify_all();
    return st;
  }

  // Working copies opened and not closed (a step that stopped between the two): unpinned.
  void abandon_open() {
    for (std::size_t gi = 0; gi < open_.size(); ++gi) {
      if (open_[gi]) schedule_.shards_.params().abandon(ids_[gi], *open_[gi]);
    }
  }

 private:
  ScheduledStep(OptimizerSchedule& schedule, OptimizerState::StepGroups groups, bool guess,
                bool on_device)
      : StoreStepTarget(schedule.shards_.store(), std::move(groups.groups),
                        std::move(groups.tensors), schedule.shards_.grads().step_dtype(on_device),
                        schedule.options_.compute_dtype, backward_order(guess, groups.ids.size())),
        schedule_(schedule),
        ids_(std::move(groups.ids)),
        guess_(guess),
        on_device_(on_device),
        open_(ids_.size()) {}

  // A guess's order: the last group first (empty: layout order).
  static std::vector<std::size_t> backward_order(bool guess, std::size_t n) {
    std::vector<std::size_t> order;
    if (guess) {
      for (std::size_t gi = n; gi-- > 0;) order.push_back(gi);
    }
    return order;
  }

  OptimizerSchedule& schedule_;
  std::vector<int> ids_;  // step group -> the store's group (frozen ones have no step)
  bool guess_;
  bool on_device_;
  std::vector<std::optional<Tier>> open_;
  std::vector<mem::Completion> writebacks_;  // working copies the step sends home
  std::int64_t span_ns_ = now_ns();          // where the next group's update span begins
};

// Every group in layout order (the order the forward needs them), or as a guess in backward
// order as each gradient becomes final; each new working copy is sent home as soon as it is
// written; returns once they are all home.
Status OptimizerSchedule::run_step(const device::AdamWArgs& args, bool guess) {
  Stopwatch timer;
  ScheduledStep target(*this, guess, /*on_device=*/false);
  Status s = optimizer_->run(target, args);
  target.abandon_open();
  if (Status w = target.wait_writebacks(); s.is_ok()) s = w;
  step_ms_ = timer.elapsed_ms();
  return s;
}

// The groups the device steps (MemoryPlan::device_steps), in layout order on this thread: the
// device's adamw ordered on its compute stream, which the next forward follows. Compute waits
// for all of it.
Status OptimizerSchedule::run_device_step(const device::AdamWArgs& args) {
  if (device_optimizer_ == nullptr) return Status::ok();
  Stopwatch timer;
  ScheduledStep target(*this, /*guess=*/false, /*on_device=*/true);
  Status s = device_optimizer_->run(target, args);
  target.abandon_open();
  if (Status w = target.wait_writebacks(); s.is_ok()) s = w;
  const double took = timer.elapsed_ms();
  stats_.optimizer_device_ms += took;
  stats_.optimizer_total_ms += took;
  stats_.optimizer_exposed_ms += took;
  return s;
}

void OptimizerSchedule::count_step() {
  // The streamed step's NVMe traffic is the store's ranged I/O, which the store counts.
  shards_.absorb_store_stats();
  stats_.optimizer_total_ms += step_ms_;
  // A step run in step() itself hides nothing: compute waits for all of it.
  if (step_inline_) stats_.optimizer_exposed_ms += step_ms_;
}

Status OptimizerSchedule::end_step(Status s) {
  count_step();
  if (!s.is_ok()) {
    shards_.end_step(/*commit=*/false);  // the step consumed some gradients: start afresh
    // With the shadow state the state before the step is intact: the working copies the step
    // wrote go back to it, so the store is as it was. Without, the state may be part updated.
    if (!shards_.plan().shadow_state) return s;
    std::vector<bool> touched;
    {
      std::lock_guard lock(step_mu_);
      touched = touched_;
    }
    (void)shards_.restore_working_copies(touched);  // the step's own error is the one to report
    return s;
  }
  shards_.end_step(/*commit=*/true);
  return device_.last_error();
}

Status OptimizerSchedule::finish_step() {
  if (phase_ == Phase::kGuessing) return abandon_guess();  // nobody will call step(): unwind
  if (!step_thread_.joinable()) return Status::ok();
  Stopwatch wait;
  step_thread_.join();
  set_phase(Phase::kIdle);
  stats_.optimizer_exposed_ms += wait.elapsed_ms();
  Status s;
  {
    std::lock_guard lock(step_mu_);
    s = step_status_;
  }
  return end_step(std::move(s));
}

}  // namespace strata::zero
