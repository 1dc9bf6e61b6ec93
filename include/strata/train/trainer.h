// The training loop: data, model, the ZeRO provider over the tiered store, optimizer schedule,
// checkpoints and metrics.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "strata/core/json.h"
#include "strata/core/status.h"
#include "strata/io/fault_injection.h"
#include "strata/train/config.h"
#include "strata/train/step_metrics.h"

namespace strata::device {
class Device;
}  // namespace strata::device
namespace strata::dist {
class Communicator;
}  // namespace strata::dist

namespace strata::train {

struct TrainOptions {
  std::string resume_dir;                             // empty: start fresh
  std::ostream* progress = nullptr;                   // one line per step; null = silent
  const std::atomic<bool>* stop_requested = nullptr;  // checked after every step
  // Called on every rank after each step with its metrics, before stop_requested is read (so it
  // may request the stop). Null: nothing.
  std::function<void(const StepMetrics&)> after_step;
  // Called on every rank as each step starts, with the rank and the 1-based step: the seam
  // through which tests inject failures (strata train's --inject-fault). Null: nothing.
  std::function<void(int rank, std::int64_t step)> before_step;
  // True for (rank, step): that rank's gradients of the step overflow (its loss gradient is
  // scaled by infinity), as an fp16 overflow on one GPU would (strata train's --inject-fault
  // overflow:RANK:STEP). Null: never.
  std::function<bool(int rank, std::int64_t step)> overflow_at;
  // Failures of the swap space's I/O, for tests (io::FaultInjection's rules). Empty: none.
  io::FaultInjection swap_faults;
  // save_async: called on the save's thread before it writes step `step`'s checkpoint (tests:
  // a slow save, so that training runs into the state it holds). Null: nothing.
  std::function<void(std::int64_t step)> async_save_started;
  // Makes this rank's communicator for the device the trainer created, in place of the one
  // dist_backend picks: ranks as threads of one process, each its own trainer (tests put pipeline
  // stages on one GPU so, where NCCL puts no two ranks). Null: dist_backend's.
  std::function<Result<std::unique_ptr<dist::Communicator>>(device::Device&)> make_communicator;
};

class Trainer {
 public:
  static Result<std::unique_ptr<Trainer>> create(const TrainConfig& config,
                                                 const TrainOptions& options);
  ~Trainer();

  // Trains until max_steps (or a stop request, which saves a checkpoint and returns
  // `cancelled`). Saves every save_every steps and at the end. Writes trace_file, if set, however
  // the run ends.
  Status run();
  // Trains exactly n more steps with no checkpointing or progress output (benchmarks, tests);
  // writes trace_file, if set, afterwards.
  Status run_steps(std::int64_t n);
  // Saves a checkpoint of the current state now; returns its path.
  Result<std::string> save();

  const std::vector<StepMetrics>& history() const;
  // The most each of the history's steps measured: device, host tier, NVMe, resident memory.
  using Peaks = StepPeaks;
  Peaks peaks() const;
  // The median of the history's step times after the first (which warms up); 0 without two.
  double steady_step_ms() const;
  // Path of the newest checkpoint this trainer saved; empty if none.
  const std::string& last_checkpoint() const;
  std::int64_t step() const;
  // True on the rank that prints progress and the final summary (rank 0).
  bool reports() const;
  // The config as resolved for this run (its "auto" choices made), and the device's name.
  const TrainConfig& resolved_config() const;
  std::string device_name() const;
  // Human-readable summary of the plan (model size, tiers, budgets), printed before training.
  std::string describe() const;
  // One line: the run's peaks against the plan's prediction (rank 0's), e.g. "peaks: device
  // 1.86 GiB (planned 2.00 GiB), ...".
  std::string peaks_against_plan() const;

 private:
  struct Impl;
  Status run_loop();
  explicit Trainer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::train
