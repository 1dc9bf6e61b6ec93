// Chooses, step by step, between an overlapped optimizer schedule and the serial one from the
// step cycles each was measured to take (optimizer_overlap "auto").
//
// Overlap pays only where the update's work does not slow compute by more than it hides: on a GPU
// it nearly always does; on the CPU backend the update's threads and its disk traffic share the
// cores with compute, and on some machines (a virtual disk whose emulation runs on the guest's
// cores) overlapping is slower than running the update alone. Every schedule gives the same bits,
// so the choice is free to change at any step: this runs the overlapped schedule, measures it,
// probes the serial one, keeps the faster, and probes the other again every `hold_steps` steps,
// so that a change in the machine's load is followed.
#pragma once

#include <cstdint>
#include <vector>

#include "strata/zero/plan.h"

namespace strata::zero {

struct ScheduleChooserOptions {
  // Cycles measured per schedule before a comparison (their median is compared), each after one
  // cycle that is not counted: the one in which the schedule changed runs half of each.
  int samples = 3;
  // Cycles the chosen schedule runs before the other one is probed again.
  std::int64_t hold_steps = 50;
  // A probed schedule takes over only when its median cycle is this fraction below the chosen
  // one's: noise alone should not flip the choice back and forth.
  double margin = 0.05;
};

class ScheduleChooser {
 public:
  // `overlapped`: the schedule the plan allows (kForward or kBackward), run first.
  ScheduleChooser(OptimizerOverlap overlapped, const ScheduleChooserOptions& options);

  // The schedule the step now beginning runs.
  OptimizerOverlap current() const { return current_; }
  // An optimizer step begins at `now_ns`: the cycle since the last one ran current(). Call once
  // per step, before current() decides the step's schedule.
  void step_began(std::int64_t now_ns);

  // Comparisons made so far, and how many of them changed the schedule.
  std::int64_t probes() const { return probes_; }
  std::int64_t switches() const { return switches_; }

 private:
  void start(OptimizerOverlap schedule);  // runs `schedule` from the next step
  static double median(std::vector<double> v);

  const OptimizerOverlap overlapped_;
  const ScheduleChooserOptions options_;
  OptimizerOverlap current_;
  OptimizerOverlap incumbent_;     // the schedule chosen last; current_ differs while probing
  std::vector<double> cycles_[2];  // the last `samples` cycles: [0] serial, [1] overlapped
  std::int64_t last_ns_ = -1;
  int skip_ = 0;                // cycles still to leave uncounted
  std::int64_t hold_left_ = 0;  // counted cycles of the incumbent before the next probe
  std::int64_t probes_ = 0;
  std::int64_t switches_ = 0;
};

}  // namespace strata::zero
