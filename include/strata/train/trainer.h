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

namespace strata::train {

struct StepMetrics {
  std::int64_t step = 0;  // 1-based optimizer step
  double loss = 0;        // mean over the global batch's targets (those the loss mask marks)
  double lr = 0;
  double grad_norm = 0;
  bool skipped = false;  // non-finite gradients (fp16: an overflow): no update
  // fp16: the loss scale this step's gradients were computed with (grad_norm is unscaled).
  std::optional<double> loss_scale;
  double tokens_per_s = 0;
  double step_ms = 0;
  double compute_ms = 0;  // forward + backward
  double wait_ms = 0;     // compute blocked on parameter fetches
  double stall_ms = 0;    // compute blocked on any data (parameters, gradients, room in a tier)
  // Training's time lost to checkpoints since the step before: a synchronous save whole; an
  // asynchronous one's start (waiting for the save before it, holding the state).
  double save_stall_ms = 0;
  // Optimizer time that ended in this step: overlapped, the previous step's update run during
  // this step's forward and this step's run beside its backward; exposed: how long compute
  // waited for it.
  double optimizer_ms = 0;
  double optimizer_exposed_ms = 0;
  // optimizer_overlap "backward": the update started beside backward, guessing no clipping;
  // redone: the step clipped, so it was redone from the state before it.
  bool guessed = false;
  bool redone = false;
  // The schedule this step's update ran with: "none" (serial), "forward" or "backward"; under
  // optimizer_overlap "auto", whichever was measured faster (or is being probed).
  std::string optimizer_schedule = "none";
  bool schedule_measured = false;  // "auto": optimizer_schedule is the measurements' choice
  // Busy time of each transfer stream in the step (the union of its transfers' spans): copies
  // to and from the device, and NVMe reads and writes (the optimizer's included).
  double h2d_busy_ms = 0, d2h_busy_ms = 0, nvme_read_busy_ms = 0, nvme_write_busy_ms = 0;
  std::uint64_t h2d_bytes = 0, d2h_bytes = 0, nvme_read_bytes = 0, nvme_write_bytes = 0;
  std::uint64_t peak_device_bytes = 0, peak_host_bytes = 0, peak_nvme_bytes = 0;
  std::uint64_t peak_rss_bytes = 0;  // the process's resident-memory high-water mark
  // What strata estimate predicts for this config, to compare with the peaks above.
  std::uint64_t planned_device_bytes = 0, planned_host_bytes = 0, planned_nvme_bytes = 0;
  std::uint64_t predicted_rss_bytes = 0;
  std::uint64_t comm_bytes = 0;  // payload of this rank's collectives in the step
  std::uint64_t sent_bytes = 0;  // point-to-point payload it sent (pipeline stage boundaries)
  std::int64_t loss_tokens = 0;  // targets the loss averaged over (all but masked-out ones)
  // Evaluation on eval_data after this step, when it was due.
  std::optional<double> eval_loss, eval_ppl;
  std::int64_t eval_tokens = 0;
  double eval_ms = 0;
  Json to_json() const;
};

struct TrainOptions {
  std::string resume_dir;                             // empty: start fresh
  std::ostream* progress = nullptr;                   // one line per step; null = silent
  const std::atomic<bool>* stop_requested = nullptr;  // checked after every step
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
  struct Peaks {
    std::uint64_t device = 0, host = 0, nvme = 0, rss = 0;
  };
  Peaks peaks() const;
  // The median of the history's step times after the first (which warms up); 0 without two.
  double steady_step_ms() const;
  // Path of the newest checkpoint this trainer saved; empty if none.
  const std::string& last_checkpoint() const;
  std::int64_t step() const;
  // True on the rank that prints progress and the final summary (rank 0).
  bool reports() const;
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
