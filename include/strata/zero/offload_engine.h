// One rank's offload engine, under zero::ZeroProvider (the model's one ParamProvider): registers
// every parameter group's working copy, fp32 master weights, Adam moments and gradients in a
// mem::TieredStore where the memory plan (plan.h) puts them, serves this rank's parameters and
// takes its gradients, and runs the optimizer step (optimizer_step.h) on the device, on the host
// (SIMD Adam) or streamed from NVMe. The store owns residency and budgets; the
// engine only says which tier it needs a tensor in and when. Working copies offloaded from the
// device are prefetched as the sched::PrefetchScheduler's recorded trace says.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "strata/core/status.h"
#include "strata/device/device.h"
#include "strata/device/host_arrays.h"
#include "strata/io/swap.h"
#include "strata/mem/tiered_store.h"
#include "strata/mem/timeline.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/model/param_layout.h"
#include "strata/optim/adamw.h"
#include "strata/optim/cpu_adam.h"
#include "strata/sched/prefetch_scheduler.h"
#include "strata/zero/optimizer_step.h"
#include "strata/zero/plan.h"
#include "strata/zero/schedule_chooser.h"

namespace strata::zero {

struct EngineOptions {
  Tier offload_param = Tier::kDevice;      // where compute-dtype working copies live
  Tier offload_optimizer = Tier::kDevice;  // master weights and moments, and where the step runs
  DType compute_dtype = DType::kF32;
  std::int64_t accumulation_steps = 1;  // micro-batches per step (1: gradients kept as made)
  // Off the device only (a device step is the device's own work, ordered on its stream); the
  // plan may fall back (MemoryPlan::overlap says what runs).
  OptimizerOverlap overlap = OptimizerOverlap::kNone;
  GradAccumulation grad_accumulation = GradAccumulation::kAuto;  // see plan.h
  // OptimizerOverlap::kAuto: how the overlapped and the serial schedule are compared, and the
  // clock the step cycles are timed with (nullptr: now_ns; tests set their own).
  ScheduleChooserOptions schedule_chooser;
  std::function<std::int64_t()> clock;
  optim::AdamWHyper adam;
  // The host optimizer (offload_optimizer cpu or nvme): threads, SIMD path, pinning.
  optim::CpuAdamOptions cpu_adam;
  // offload_optimizer nvme: elements per streamed sub-group (DeepSpeed's sub_group_size).
  std::int64_t sub_group_size = 1 << 22;
  std::uint64_t host_memory_limit_bytes = 0;  // 0 = no limit
  std::uint64_t activation_bytes = 0;         // the model's workspace, as the plan counts it
  bool tied_embeddings = false;               // the model's head reads the embedding's weights
  std::uint64_t swap_free_bytes = 0;          // free space of the swap paths; 0 = not checked
  // Parameter prefetch (offload_param cpu or nvme), DeepSpeed's names in bytes: fetches in flight,
  // parameters resident or arriving on the device, and the reuse distance within which a
  // released group stays resident. See sched::PrefetchOptions.
  std::uint64_t prefetch_bytes = std::uint64_t{256} << 20;
  std::uint64_t max_live_bytes = std::uint64_t{1} << 30;
  std::uint64_t max_reuse_distance = std::uint64_t{1} << 30;
  mem::Timeline* timeline = nullptr;  // transfer and per-group compute spans; optional
};

struct EngineStats {
  std::uint64_t h2d_bytes = 0;        // host -> device
  std::uint64_t d2h_bytes = 0;        // device -> host
  std::uint64_t nvme_read_bytes = 0;  // NVMe -> host
  std::uint64_t nvme_write_bytes = 0;
  std::uint64_t host_bytes = 0;   // peak host memory held: the store's and the optimizer's staging
  std::uint64_t nvme_bytes = 0;   // peak swap space held
  double wait_ms = 0;             // compute blocked waiting for parameters
  double stall_ms = 0;            // compute blocked waiting for data or room in a tier
  double optimizer_total_ms = 0;  // every finished optimizer step, start to end
  double optimizer_exposed_ms = 0;  // compute blocked waiting for overlapped updates
  // OptimizerOverlap::kBackward: steps whose update started beside backward, guessing no
  // clipping; of those, redone from the state before the step (they clipped), and rolled back
  // (their gradient was not finite).
  std::uint64_t steps_guessed = 0;
  std::uint64_t steps_redone = 0;
  std::uint64_t steps_rolled_back = 0;
};

// What the engine's memory plan is made from: its options, the device budget (the device's own
// limit), whether swap paths exist and whether the device is host memory. strata estimate makes
// the same plan without an engine.
PlanOptions plan_options(const EngineOptions& options, std::uint64_t device_budget_bytes,
                         bool has_swap, bool host_addressable_device);

class OffloadEngine {
 public:
  // Makes the plan and registers every tensor in the store. Fails with the plan's errors, or
  // out_of_memory naming the tensor, its tier and the budget when a home does not fit. `swap`
  // is required when anything lives on nvme and must outlive the engine.
  static Result<std::unique_ptr<OffloadEngine>> create(const model::ParamLayout& layout,
                                                       device::Device& device, io::SwapSpace* swap,
                                                       const EngineOptions& options);
  ~OffloadEngine();
  OffloadEngine(const OffloadEngine&) = delete;
  OffloadEngine& operator=(const OffloadEngine&) = delete;

  // Sets every group's master weights (and working copy) from `source`; moments are zeroed.
  Status load_master(const model::GroupSource& source);
  Status read_master(int group, float* dst);
  Status read_moments(int group, float* exp_avg, float* exp_avg_sq);
  Status write_moments(int group, const float* exp_avg, const float* exp_avg_sq);

  // This rank's part of each group, with ParamProvider's contract (model/param_provider.h).
  Result<const void*> acquire_params(int group);
  void release_params(int group);
  void prefetch_params(int group);
  Result<void*> acquire_grads(int group);
  Status release_grads(int group);

  // The micro-batch about to run is the step's last, and the step will be step(lr, step, s)
  // with s = 1 unless clipping changes it (`may_clip`). Under OptimizerOverlap::kBackward each
  // group's update then starts as soon as its final gradient exists, guessing s = 1, unless the
  // last step clipped or was skipped. With `may_clip` the gradients are kept until the step
  // commits, for a redo. A no-op under the other schedules.
  void begin_last_micro_batch(double lr, std::int64_t step, bool may_clip);
  // Waits for gradient transfers still in flight; call after each micro-batch's backward.
  Status finish_micro_batch();
  // Global L2 norm of the accumulated gradients (after the last finish_micro_batch).
  Result<double> grad_norm();
  // Sum of squares of each group's accumulated gradient, by group (for norms across ranks).
  // Call after finish_micro_batch(). The same numbers wherever the gradients live
  // (kSumSquaresChunkElems); sums taken on the device come back in one copy and one wait.
  Result<std::vector<double>> grad_sums_of_squares();
  // One AdamW step (step is 1-based) with gradients multiplied by grad_scale, then refreshes the
  // working copies and zeroes the gradients; call after the last finish_micro_batch. A group
  // that received no gradient steps with zeros. Overlapped (MemoryPlan::overlap not kNone) it
  // returns once the step runs on its own thread (a guess that holds runs on; one that does not
  // is redone): acquire_params(g) then waits for group g's update, and every other call
  // (gradients, norms, state in and out) for the whole step. With the shadow state the step
  // writes the other copy of the state and switches to it when every group is done: a step
  // that fails leaves the state as it was before it.
  Status step(double lr, std::int64_t step, float grad_scale);
  // Waits for an overlapped step still running; its error, if any. A no-op otherwise.
  Status finish_step();
  // Drops the accumulated gradients (a step skipped for non-finite gradients); a guessed
  // update is abandoned and the working copies it wrote are restored from the state.
  Status zero_grads();

  // Device bytes acquire_params(group) adds to what the store holds: 0 when working copies
  // live on the device, else the copy fetched there.
  std::uint64_t acquire_device_bytes(int group) const;

  const MemoryPlan& plan() const { return plan_; }
  // The schedule the last step() ran its update with: the plan's, or under kAuto the one the
  // measurements chose (kNone while the serial one is faster).
  OptimizerOverlap step_schedule() const { return schedule_; }
  // The store every tensor lives in; ZeroProvider keeps its device buffers there as scratch.
  mem::TieredStore& store() { return *store_; }
  const EngineStats& stats() const { return stats_; }
  // The tiered store's and the prefetch scheduler's own counters (zeros where unused).
  mem::StoreStats store_stats() const;
  sched::SchedulerStats prefetch_stats() const;

 private:
  struct Group;
  OffloadEngine(const model::ParamLayout& layout, device::Device& device, io::SwapSpace* swap,
                const EngineOptions& options, MemoryPlan plan);
  Status create_store();
  void absorb_store_stats();  // adds the store's new transfer counts to stats_
  void end_compute_span(Group& g);
  Status drain_one_grad();
  Status wait_writebacks();
  Status give_zero_grads();  // groups with no gradient this step get zeros
  // The gradient the optimizer reads: the kept gradient or the fp32 accumulator.
  mem::Handle step_grad(const Group& g) const;
  // A copy of the working copy on `tier` for the optimizer to write (the home when it lives
  // there); close_output makes it the working copy, writing it back home if it is not the home
  // (`keep_host_copy`: under a host budget, a host copy written to NVMe stays, clean, for the
  // next forward).
  Result<void*> open_output(Group& g, Tier tier);
  Status close_output(Group& g, Tier tier, std::vector<mem::Completion>& writebacks,
                      bool keep_host_copy = false);
  // Runs on whichever thread runs the step. `guess`: in backward order, each group once its
  // gradient is final (ready_), keeping gradients for a redo if guess_keeps_grads_.
  Status run_step(const device::AdamWArgs& args, bool guess);
  Status end_step(Status s);      // after run_step: counters, gradients zeroed, the state switched
  Status wait_update(int group);  // the overlapped step has written it
  void start_guess();             // armed_ -> kGuessing: the step thread waits for gradients
  // The step's flags (updated_, ready_, ...) for a new run; `keep_touched`: a redo keeps the
  // groups its guess touched, for a failure to restore.
  void reset_step_flags(bool keep_touched);
  // Where the step is (main thread only). kGuessing: the step thread updates groups as their
  // gradients become final, before step() knows the scale. kRunning: step() launched the step
  // (or let the guess run on), overlapping what follows until finish_step.
  enum class Phase : std::uint8_t { kIdle, kGuessing, kRunning };
  // Runs run_step on the step thread, in `phase` (kGuessing: as a guess).
  void launch_step(const device::AdamWArgs& args, Phase phase, bool keep_touched);
  void count_step();  // the finished (or abandoned) step's time and NVMe bytes into stats_
  void mark_final(std::size_t group);  // its gradient is final: a guessed update may read it
  // Stops a guessed step and waits for it; restores the working copies it wrote unless a redo
  // is to rewrite them (`restore` false).
  Status abandon_guess(bool restore = true);
  // The working copies of `groups` (flags by group) rewritten from the master weights.
  Status restore_working_copies(const std::vector<bool>& groups);
  // Writes the group's working copy from fp32 master weights in host memory.
  Status write_working_copy(Group& g, const float* master);

  const model::ParamLayout& layout_;
  device::Device& device_;
  io::SwapSpace* swap_;
  EngineOptions options_;
  MemoryPlan plan_;
  OptimizerOverlap schedule_;               // the last step's (plan_.overlap unless chosen)
  std::optional<ScheduleChooser> chooser_;  // plan_.measure_overlap
  bool step_inline_ = false;                // the last step ran in step() itself
  std::vector<std::unique_ptr<Group>> groups_;
  std::unique_ptr<OptimizerStep> optimizer_;          // for the plan's optimizer tier
  std::optional<device::HostArrays> host_arrays_;     // host-side accumulation and conversion
  mem::Handle widened_grad_ = mem::Handle::kInvalid;  // optimizer on the device: bf16 -> f32
  // Sums of squares taken on the device, one double per group, and their host copy: read back
  // together when the norm is asked for, not one synchronization per group.
  device::DeviceBuffer norms_;  // none on a host-addressable device: the slots are norms_host_
  device::PinnedBuffer norms_host_;
  double* norm_slots_ = nullptr;  // one per group, where the device writes them
  struct PendingGrad {            // a gradient on its way off the device
    int group;
    mem::Completion done;
  };
  std::deque<PendingGrad> pending_grads_;
  std::vector<mem::Completion> writebacks_;  // accumulators and working copies going home
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
  bool last_clipped_ = false;  // the last step's scale was not 1, or it was skipped
  std::vector<bool> ready_;    // under step_mu_: the group's gradient is final (a guess)
  bool cancel_ = false;        // under step_mu_: the guessed step stops at the next group
  std::vector<bool> updated_;  // under step_mu_: the group's new working copy is written
  std::vector<bool> touched_;  // under step_mu_: the step began writing the working copy
  std::unordered_map<std::uint32_t, std::size_t> group_of_work_;  // work handle -> group
  bool step_done_ = true;                                         // under step_mu_
  Status step_status_;                                            // under step_mu_, once step_done_
  std::vector<mem::Completion> step_writebacks_;  // working copies the step sends home
  std::int64_t update_span_ns_ = 0;               // where the next group's update span begins
  double step_ms_ = 0;
  EngineStats stats_;
  std::unique_ptr<mem::TieredStore> store_;
  std::unique_ptr<sched::PrefetchScheduler> sched_;  // offload_param cpu or nvme
  mem::StoreStats store_seen_;                       // store counters already in stats_
  bool backward_ = false;  // this micro-batch has reached its backward (for span names)
};

}  // namespace strata::zero
