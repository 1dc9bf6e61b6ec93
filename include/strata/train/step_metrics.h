// What one training step measured (one JSON line of the metrics file), and its progress lines.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "strata/core/json.h"

namespace strata::train {

struct StepMetrics {
  std::int64_t step = 0;  // 1-based optimizer step
  double loss = 0;        // mean over the global batch's targets (those the loss mask marks)
  // MoE models: the load-balancing loss (transformers' load_balancing_loss_func, each
  // micro-batch's, averaged as the loss is); the trained objective adds router_aux_loss_coef times
  // it when output_router_logits is set.
  std::optional<double> aux_loss;
  // MoE models, this rank's micro-batches (model::ExpertTraffic): per MoE layer and micro-batch
  // the experts some rank's tokens chose and those none chose (never fetched nor computed), and
  // the working-copy bytes of the experts acquired.
  std::int64_t experts_run = 0, experts_skipped = 0;
  std::uint64_t expert_bytes = 0;
  double lr = 0;
  double grad_norm = 0;
  bool skipped = false;  // non-finite gradients (fp16: an overflow): no update
  // fp16: the loss scale this step's gradients were computed with (grad_norm is unscaled).
  std::optional<double> loss_scale;
  double tokens_per_s = 0;
  double step_ms = 0;
  // Since this process's first step began, and the time left to max_steps at the steps' mean
  // pace so far.
  double elapsed_s = 0, eta_s = 0;
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
  // Of optimizer_ms, the device's step of the groups it keeps (offload_optimizer_fraction below
  // 1), after backward: all of it exposed.
  double optimizer_device_ms = 0;
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
  // Expert parallelism: what this rank's token exchanges sent to the other ranks of its expert
  // group (counted in comm_bytes too).
  std::uint64_t all_to_all_bytes = 0;
  std::uint64_t sent_bytes = 0;  // point-to-point payload it sent (pipeline stage boundaries)
  std::int64_t loss_tokens = 0;  // targets the loss averaged over (all but masked-out ones)
  // Evaluation on eval_data after this step, when it was due.
  std::optional<double> eval_loss, eval_ppl;
  std::int64_t eval_tokens = 0;
  double eval_ms = 0;
  Json to_json() const;
};

// "step 3/100 | loss 2.1234 | ... | 2m05s elapsed, ETA 1h08m" (one line a step on the console).
std::string progress_line(const StepMetrics& m, std::int64_t max_steps);
// A duration as a person reads it: "42s", "12m03s", "2h05m".
std::string format_duration(double seconds);
// "eval at step 3/100 | loss ... | perplexity ..." (a step with eval_loss).
std::string eval_line(const StepMetrics& m, std::int64_t max_steps);
// The most each of `history`'s steps measured: device, host tier, NVMe, resident memory.
struct StepPeaks {
  std::uint64_t device = 0, host = 0, nvme = 0, rss = 0;
};
StepPeaks peaks_of(const std::vector<StepMetrics>& history);
// The median of `history`'s step times after the first (which warms up); 0 without two.
double steady_step_ms(const std::vector<StepMetrics>& history);
// A loss scale as the logs print it ("%.15g": 65536, 0.5).
std::string format_scale(double scale);

}  // namespace strata::train
