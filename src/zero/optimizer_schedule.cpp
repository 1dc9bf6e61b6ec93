// OptimizerSchedule: the optimizer step serially, overlapped with the next forward, or guessed
// beside backward and validated, over the shard store's tensors.
#include "strata/zero/optimizer_schedule.h"

#include <algorithm>
#include <utility>

#include "strata/core/clock.h"
#include "strata/optim/adamw.h"

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
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<OptimizerStep> optimizer,
                          make_optimizer_step(plan.optimizer, device, shards.store(), oo));
  std::unique_ptr<OptimizerSchedule> s(
      new OptimizerSchedule(shards, device, options, std::move(optimizer)));
  shards.set_step_view(s.get());
  return s;
}

OptimizerSchedule::OptimizerSchedule(ShardStore& shards, device::Device& device,
                                     const ShardOptions& options,
                                     std::unique_ptr<OptimizerStep> optimizer)
    : shards_(shards),
      device_(device),
      options_(options),
      optimizer_(std::move(optimizer)),
      schedule_(shards.plan().overlap) {
  if (shards.plan().measure_overlap) {
    chooser_.emplace(shards.plan().overlap, options_.schedule_chooser);
  }
}

OptimizerSchedule::~OptimizerSchedule() {
  (void)finish_step();  // its error, if nobody asked, was the run's to report
  shards_.set_step_view(nullptr);
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

Result<std::vector<double>> OptimizerSchedule::grad_sums_of_squares() {
  STRATA_RETURN_IF_ERROR(finish_unless_guessing());
  return shards_.grad_sums_of_squares();
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
  shards_.clear_grads();
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
  if (phase_ == Phase::kGuessing) {
    const bool holds = lr == guess_lr_ && step == guess_step_ && grad_scale == expected_scale_;
    ++stats_.steps_guessed;
    if (holds) {  // the guess is the step: it runs on into the next forward
      phase_ = Phase::kRunning;
      step_inline_ = false;  // what it hid beside backward stays hidden
      // Unless the serial schedule was chosen from now on: then the step ends here.
      return schedule_ == OptimizerOverlap::kNone ? finish_step() : Status::ok();
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
  STRATA_CHECK(shards_.idle(), "optimizer step before the last micro-batch's finish_micro_batch");
  STRATA_RETURN_IF_ERROR(shards_.give_zero_grads());
  // Sums made on the device go to host memory on the copy streams (a redo finds them there
  // already); the step's acquire of each waits for its copy only.
  STRATA_RETURN_IF_ERROR(shards_.send_sums_to_host());
  const device::AdamWArgs args = optim::make_adamw_args(options_.adam, lr, step, grad_scale);
  if (schedule_ != OptimizerOverlap::kNone) {
    launch_step(args, Phase::kRunning, /*keep_touched=*/redo);
    return Status::ok();
  }
  reset_step_flags(/*keep_touched=*/redo);
  Status s = run_step(args, /*guess=*/false);
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
  phase_ = phase;
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
  phase_ = Phase::kIdle;
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

// Every group in layout order (the order the forward needs them), or as a guess in backward
// order as each gradient becomes final; each new working copy is sent home as soon as it is
// written; returns once they are all home.
Status OptimizerSchedule::run_step(const device::AdamWArgs& args, bool guess) {
  Stopwatch timer;
  update_span_ns_ = now_ns();
  // The trainable groups; ids[i]: step group i's group in the store (frozen ones have no step).
  std::vector<int> ids;
  const std::vector<StepGroup> groups = shards_.step_groups(&ids);
  const std::size_t num_groups = groups.size();
  std::vector<std::size_t> order;
  if (guess) {
    for (std::size_t gi = num_groups; gi-- > 0;) order.push_back(gi);
  }
  mem::TieredStore& store = shards_.store();
  // Working copies opened and not yet closed: a step that stops between the two unpins them.
  std::vector<std::optional<Tier>> open(num_groups);
  const auto open_one = [this, &open, &ids](std::size_t gi, Tier tier) -> Result<void*> {
    const int group = ids[gi];
    {
      std::lock_guard lock(step_mu_);
      touched_[static_cast<std::size_t>(group)] = true;  // emplace drops the old data even if
                                                         // the update never comes
    }
    auto out = shards_.open_output(group, tier);
    if (out.is_ok()) open[gi] = tier;
    return out;
  };
  const auto close = [this, guess, &open, &store, &groups, &ids](std::size_t gi, Tier tier) {
    const int group = ids[gi];
    open[gi].reset();
    Status s = shards_.close_output(group, tier, step_writebacks_, /*keep_host_copy=*/true);
    // The gradient is spent, unless a redo may need it: then it goes home like any other.
    const mem::Handle grad = shards_.step_grad(group);
    if (s.is_ok() && guess && guess_keeps_grads_) {
      if (store.spec(grad).home != Tier::kHost) {
        auto home = store.evict(grad, Tier::kHost);
        s = home.status();
        if (home.is_ok()) step_writebacks_.push_back(std::move(*home));
      }
    } else if (s.is_ok()) {
      s = store.discard(grad);
    }
    const std::int64_t end = now_ns();
    if (options_.timeline != nullptr) {
      options_.timeline->add(mem::Lane::kCpuOptimizer,
                             (guess ? "update (guessed) " : "update ") + groups[gi].name,
                             update_span_ns_, end);
    }
    update_span_ns_ = end;
    {
      std::lock_guard lock(step_mu_);
      updated_[static_cast<std::size_t>(group)] = true;
    }
    step_cv_.notify_all();
    return s;
  };
  const auto ready = [this, &ids](std::size_t gi, bool wait) -> Result<bool> {
    const auto group = static_cast<std::size_t>(ids[gi]);
    {
      std::unique_lock lock(step_mu_);
      if (wait) step_cv_.wait(lock, [&] { return ready_[group] || cancel_; });
      if (!cancel_) {
        const bool final = ready_[group];
        lock.unlock();
        // The group's update starts once its gradient is final, or the last one has ended.
        if (final) update_span_ns_ = std::max(update_span_ns_, now_ns());
        return final;
      }
    }
    return Status(StatusCode::kCancelled, "the guessed optimizer step was abandoned");
  };
  StepIo io{store, groups, shards_.step_grad_dtype(), options_.compute_dtype, open_one, close,
            order, {}};
  if (guess) io.ready = ready;
  Status s = optimizer_->run(io, args);
  for (std::size_t gi = 0; gi < open.size(); ++gi) {
    if (open[gi]) shards_.abandon_output(ids[gi], *open[gi]);
  }
  for (const mem::Completion& c : step_writebacks_) {
    Status w = store.wait(c);
    if (s.is_ok()) s = w;
  }
  step_writebacks_.clear();
  step_ms_ = timer.elapsed_ms();
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
  phase_ = Phase::kIdle;
  stats_.optimizer_exposed_ms += wait.elapsed_ms();
  Status s;
  {
    std::lock_guard lock(step_mu_);
    s = step_status_;
  }
  return end_step(std::move(s));
}

}  // namespace strata::zero
