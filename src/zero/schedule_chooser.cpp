// ScheduleChooser: the overlapped or the serial optimizer schedule, whichever measured faster.
#include "strata/zero/schedule_chooser.h"

#include <algorithm>
#include <utility>

#include "strata/core/status.h"

namespace strata::zero {

namespace {
int slot(OptimizerOverlap schedule) { return schedule == OptimizerOverlap::kNone ? 0 : 1; }
}  // namespace

ScheduleChooser::ScheduleChooser(OptimizerOverlap overlapped, const ScheduleChooserOptions& options)
    : overlapped_(overlapped),
      options_(options),
      current_(overlapped),
      incumbent_(overlapped),
      // The first cycle fills the host caches and the prefetch trace: not counted.
      skip_(1),
      hold_left_(options.samples) {
  STRATA_CHECK(overlapped != OptimizerOverlap::kNone, "nothing to choose between");
  STRATA_CHECK(options.samples >= 1 && options.hold_steps >= options.samples,
               "a hold shorter than a measurement", options.samples, options.hold_steps);
}

double ScheduleChooser::median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void ScheduleChooser::start(OptimizerOverlap schedule) {
  if (schedule == current_) return;
  current_ = schedule;
  skip_ = 1;  // the cycle in which the schedule changes runs half of each
}

void ScheduleChooser::step_began(std::int64_t now_ns) {
  const std::int64_t last = std::exchange(last_ns_, now_ns);
  if (last < 0) return;
  if (skip_ > 0) {
    --skip_;
    return;
  }
  std::vector<double>& mine = cycles_[slot(current_)];
  mine.push_back(static_cast<double>(now_ns - last));
  if (mine.size() > static_cast<std::size_t>(options_.samples)) mine.erase(mine.begin());

  if (current_ == incumbent_) {
    if (--hold_left_ > 0) return;
    // Probe the other schedule against the incumbent's latest cycles.
    const OptimizerOverlap other =
        incumbent_ == OptimizerOverlap::kNone ? overlapped_ : OptimizerOverlap::kNone;
    cycles_[slot(other)].clear();
    start(other);
    return;
  }
  if (mine.size() < static_cast<std::size_t>(options_.samples)) return;
  // The probe is complete: the challenger takes over only if clearly faster.
  ++probes_;
  const double challenger = median(mine);
  const double incumbent = median(cycles_[slot(incumbent_)]);
  if (challenger < incumbent * (1.0 - options_.margin)) {
    incumbent_ = current_;
    ++switches_;
  } else {
    start(incumbent_);
  }
  hold_left_ = options_.hold_steps;
}

}  // namespace strata::zero
