// When and where this rank's optimizer step runs over its ShardStore: serially in step(), on a
// thread of its own beside the next forward (OptimizerOverlap::kForward), or started beside
// backward as a guess that the step will not clip (kBackward), validated when the step is known
// and redone from the state before the step when it was wrong; under kAuto a ScheduleChooser
// times both schedules and keeps the faster. The update itself is an OptimizerStep
// (optimizer_step.h) for the plan's optimizer tier: on the device, the SIMD Adam on the host, or
// streamed from NVMe. With the plan's shadow state the step writes the other copy of the state
// and switches to it when every group is done, so a step that fails leaves the state as it was.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "strata/core/status.h"
#include "strata/device/device.h"
#include "strata/zero/optimizer_step.h"
#include "strata/zero/schedule_chooser.h"
#include "strata/zero/shard_store.h"

namespace strata::zero {

// It answers the working copies' prefetcher (UpdateGate) and, while a guess runs, hears from the
// gradient landing when each gradient is final (FinalGradients).
class OptimizerSchedule final : public UpdateGate, public FinalGradients {
 public:
  // The schedule of `shards`' steps, with the plan's optimizer and overlap; the working copies'
  // update gate. `shards` and `device` must outlive it; on NVMe the step streams through the
  // shard store's range staging.
  static Result<std::unique_ptr<OptimizerSchedule>> create(ShardStore& shards,
                                                           device::Device& device,
                                                           const ShardOptions& options);
  ~OptimizerSchedule() override;
  OptimizerSchedule(const OptimizerSchedule&) = delete;
  OptimizerSchedule& operator=(const OptimizerSchedule&) = delete;

  // ---- the parameter path's questions ----
  // Group's working copy is current: an overlapped update of it is written (the time waited
  // counts as exposed). A guess updates only groups whose backward is done: no wait then.
  Status wait_update(int group);
  bool update_done(int group) override;
  void gradient_final(int group) override;

  // ---- a step's events, in order ----
  // The micro-batch about to run is the step's last, and the step will be step(lr, step, s)
  // with s = `unscale` (1, or the inverse of fp16's loss scale) unless clipping changes it
  // (`may_clip`) or an overflow skips it. Under OptimizerOverlap::kBackward each group's update
  // then starts as soon as its final gradient exists, guessing s = unscale, unless the last
  // step clipped or was skipped. With `may_clip` the gradients are kept until the step
  // commits, for a redo. A no-op under the other schedules.
  void begin_last_micro_batch(double lr, std::int64_t step, bool may_clip, float unscale = 1.0f);
  // A gradient is about to be written: the last step is done reading gradients, or the guess
  // begin_last_micro_batch armed starts.
  Status before_gradients();
  // After each micro-batch's backward: the store's gradient transfers end (an overlapped step
  // still running first).
  Status finish_micro_batch();
  // The gradients' sums of squares, by group (see GradientLanding::sums_of_squares).
  Result<std::vector<ExactSum>> grad_sums_of_squares();
  // One AdamW step (step is 1-based) with gradients multiplied by grad_scale, then refreshes the
  // working copies and zeroes the gradients; call after the last finish_micro_batch. A group
  // that received no gradient steps with zeros. Overlapped (MemoryPlan::overlap not kNone) it
  // returns once the step runs on its own thread (a guess that holds runs on; one that does not
  // is redone): wait_update(g) then waits for group g's update; finish_step for all of it.
  Status step(double lr, std::int64_t step, float grad_scale);
  // Waits for an overlapped step still running; its error, if any. A guess still running is
  // abandoned. A no-op otherwise.
  Status finish_step();
  // Drops the accumulated gradients (a step skipped for non-finite gradients); a guessed
  // update is abandoned and the working copies it wrote are restored from the state.
  Status zero_grads();
  // The state was loaded anew: no gradients, and the next step may be guessed.
  Status restart();

  // The schedule the last step() ran its update with: the plan's, or under kAuto the one the
  // measurements chose (kNone while the serial one is faster).
  OptimizerOverlap step_schedule() const { return schedule_; }
  // Its steps so far (the optimizer's own NVMe traffic included).
  const RankStats& stats() const { return stats_; }

 private:
  // Where the step is (main thread only). kGuessing: the step thread updates groups as their
  // gradients become final, before step() knows the scale. kRunning: step() launched the step
  // (or let the guess run on), overlapping what follows until finish_step.
  enum class Phase : std::uint8_t { kIdle, kGuessing, kRunning };
  // The step as its OptimizerStep sees it: the store's state and gradients, the working copies
  // it writes, and this schedule's flags (optimizer_schedule.cpp).
  class ScheduledStep;
  bool guessing() const { return phase_ == Phase::kGuessing; }
  // The gradient landing reports final gradients to this schedule while it guesses.
  void set_phase(Phase phase);
  OptimizerSchedule(ShardStore& shards, device::Device& device, const ShardOptions& options,
                    std::unique_ptr<OptimizerStep> optimizer,
                    std::unique_ptr<OptimizerStep> device_optimizer);
  // Runs on whichever thread runs the step. `guess`: in backward order, each group once its
  // gradient is final (ready_), keeping gradients for a redo if guess_keeps_grads_.
  Status run_step(const device::AdamWArgs& args, bool guess);
  // The groups the device steps (MemoryPlan::device_steps), in step() on the main thread, once
  // the scale is known; a no-op without them.
  Status run_device_step(const device::AdamWArgs& args);
  Status end_step(Status s);  // after run_step: counters, gradients zeroed, the state switched
  void start_guess();         // armed_ -> kGuessing: the step thread waits for gradients
  // The step's flags (updated_, ready_, ...) for a new run; `keep_touched`: a redo keeps the
  // groups its guess touched, for a failure to restore.
  void reset_step_flags(bool keep_touched);
  // Runs run_step on the step thread, in `phase` (kGuessing: as a guess).
  void launch_step(const device::AdamWArgs& args, Phase phase, bool keep_touched);
  void count_step();  // the finished (or abandoned) step's time and NVMe bytes into stats_
  // Stops a guessed step and waits for it; restores the working copies it wrote unless a redo
  // is to rewrite them (`restore` false).
  Status abandon_guess(bool restore = true);
  // An overlapped step still running ends first; a guess goes on.
  Status finish_unless_guessing() { return guessing() ? Status::ok() : finish_step(); }

  ShardStore& shards_;
  device::Device& device_;
  ShardOptions options_;
  std::unique_ptr<OptimizerStep> optimizer_;         // for the plan's optimizer tier
  std::unique_ptr<OptimizerStep> device_optimizer_;  // for its device_steps; null without
  OptimizerOverlap schedule_;                        // the last step's (plan.overlap unless chosen)
  std::optional<ScheduleChooser> chooser_;           // plan.measure_overlap
  bool step_inline_ = false;                         // the last step ran in step() itself
  // The overlapped step (beside the next forward, or a guess beside backward) on its own
  // thread; the thread touches only the store, the optimizer and what is below, under step_mu_
  // where marked.
  std::thread step_thread_;
  std::mutex step_mu_;
  std::condition_variable step_cv_;
  Phase phase_ = Phase::kIdle;
  bool armed_ = false;  // begin_last_micro_batch chose to guess: it starts at the first gradient
  double guess_lr_ = 0;
  std::int64_t guess_step_ = 0;
  bool guess_keeps_grads_ = false;
  float expected_scale_ = 1.0f;  // the step's multiplier without clipping (begin_last_...)
  bool last_clipped_ = false;    // the last step's scale was not that, or it was skipped
  std::vector<bool> ready_;      // under step_mu_: the group's gradient is final (a guess)
  bool cancel_ = false;          // under step_mu_: the guessed step stops at the next group
  std::vector<bool> updated_;    // under step_mu_: the group's new working copy is written
  std::vector<bool> touched_;    // under step_mu_: the step began writing the working copy
  bool step_done_ = true;        // under step_mu_
  Status step_status_;           // under step_mu_, once step_done_
  double step_ms_ = 0;
  RankStats stats_;
};

}  // namespace strata::zero
