// The single-process ZeRO-3 offload engine: owns every parameter group's fp32 master weights,
// Adam moments, gradient accumulator and compute-dtype working copy in the tiers the config
// names, serves the model's ParamProvider requests, and runs the optimizer step. Working copies
// and gradients move through a mem::TieredStore, parameters ahead of use as the
// sched::PrefetchScheduler's recorded trace says.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "strata/core/aligned.h"
#include "strata/core/status.h"
#include "strata/device/device.h"
#include "strata/io/swap.h"
#include "strata/mem/tiered_store.h"
#include "strata/mem/timeline.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/model/param_layout.h"
#include "strata/model/param_provider.h"
#include "strata/optim/adamw.h"
#include "strata/optim/cpu_adam.h"
#include "strata/optim/streamed_adam.h"
#include "strata/sched/prefetch_scheduler.h"

namespace strata::zero {

enum class Offload : std::uint8_t { kNone, kCpu, kNvme };
std::string_view offload_name(Offload o);

struct EngineOptions {
  Offload offload_param = Offload::kNone;      // where bf16/f32 working copies live
  Offload offload_optimizer = Offload::kNone;  // where master weights, moments, gradients live
  DType compute_dtype = DType::kF32;
  optim::AdamWHyper adam;
  // The host optimizer (offload_optimizer cpu or nvme): threads, SIMD path, pinning.
  optim::CpuAdamOptions cpu_adam;
  // offload_optimizer nvme: elements per streamed sub-group (DeepSpeed's sub_group_size).
  std::int64_t sub_group_size = 1 << 22;
  std::uint64_t host_memory_limit_bytes = 0;  // 0 = no limit
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
  std::uint64_t host_bytes = 0;  // host memory the engine holds (its peak: it only grows)
  std::uint64_t nvme_bytes = 0;  // swap space the engine holds
  double wait_ms = 0;            // compute blocked waiting for parameters
  double stall_ms = 0;           // compute blocked waiting for data or room in a tier
  double optimizer_ms = 0;       // last optimizer step
};

class OffloadEngine final : public model::ParamProvider {
 public:
  // Plans and allocates every buffer up front. Fails with out_of_memory naming the tier, what
  // was needed and the limit when the plan does not fit. `swap` is required when any offload is
  // nvme and must outlive the engine.
  static Result<std::unique_ptr<OffloadEngine>> create(const model::ParamLayout& layout,
                                                       device::Device& device, io::SwapSpace* swap,
                                                       const EngineOptions& options);
  ~OffloadEngine() override;

  // Sets every group's master weights (and working copy) from `source`; moments are zeroed.
  Status load_master(const model::GroupSource& source);
  Status read_master(int group, float* dst);
  Status read_moments(int group, float* exp_avg, float* exp_avg_sq);
  Status write_moments(int group, const float* exp_avg, const float* exp_avg_sq);

  // ParamProvider.
  Result<const void*> acquire_params(int group) override;
  void release_params(int group) override;
  void prefetch_params(int group) override;
  Result<void*> acquire_grads(int group) override;
  Status release_grads(int group) override;

  // Waits for gradient transfers still in flight; call after each micro-batch's backward.
  Status finish_micro_batch();
  // Gives the store's cached device blocks (kept for reuse by dropped copies) back to the
  // device, for an allocation outside the store that did not fit.
  void trim_device_cache();
  // Global L2 norm of the accumulated fp32 gradients.
  Result<double> grad_norm();
  // Sum of squares of one group's accumulated fp32 gradient (for norms across ranks). Call
  // after finish_micro_batch(), once per group.
  Result<double> grad_sum_squares(int group);
  // One AdamW step (step is 1-based) with gradients multiplied by grad_scale, then refreshes the
  // working copies and zeroes the gradients.
  Status step(double lr, std::int64_t step, float grad_scale);
  // Drops the accumulated gradients (a step skipped for non-finite gradients).
  void zero_grads();

  const EngineStats& stats() const { return stats_; }
  // The tiered store's and the prefetch scheduler's own counters (zeros where unused).
  mem::StoreStats store_stats() const;
  sched::SchedulerStats prefetch_stats() const;
  std::uint64_t host_bytes_planned() const { return planned_host_bytes_; }

 private:
  struct Group;
  OffloadEngine(const model::ParamLayout& layout, device::Device& device, io::SwapSpace* swap,
                const EngineOptions& options);
  Status plan();
  Result<AlignedBuffer*> take_staging();
  void give_staging(AlignedBuffer* b);
  Status create_store();
  void absorb_store_stats();  // adds the store's new transfer counts to stats_
  void end_compute_span(Group& g);
  Status drain_one_grad();
  Status accumulate_grad(Group& g, const void* grad_host);
  Status store_working_copy(Group& g, const void* src_host);  // host compute-dtype -> its tier
  Status nvme_read(const io::Extent& x, void* buf, std::size_t bytes);
  Status nvme_write(const io::Extent& x, const void* buf, std::size_t bytes);
  Result<AlignedBuffer> host_alloc(std::size_t bytes, const char* what);
  Status charge_host(std::size_t bytes, const char* what);  // counts against the host limit

  const model::ParamLayout& layout_;
  device::Device& device_;
  io::SwapSpace* swap_;
  EngineOptions options_;
  std::vector<std::unique_ptr<Group>> groups_;
  std::size_t max_work_bytes_ = 0;
  std::size_t max_f32_bytes_ = 0;
  std::vector<AlignedBuffer> staging_;  // fresh compute-dtype working copies (step, load_master)
  std::vector<AlignedBuffer*> free_staging_;
  AlignedBuffer opt_buf_[2][3];  // nvme: [0] = one group's master, m, v (read/write_master,
                                 // moments); [1] unused since the step streams sub-groups
  std::optional<optim::CpuAdam> cpu_adam_;            // offload_optimizer cpu or nvme
  std::optional<optim::StreamedAdam> streamed_adam_;  // offload_optimizer nvme
  device::DeviceBuffer grad_f32_scratch_;             // optimizer on device: bf16 -> f32 grad
  struct PendingGrad {  // a gradient on its way from the device to the host
    int group;
    mem::Completion done;
  };
  std::deque<PendingGrad> pending_grads_;
  EngineStats stats_;
  // Declared after groups_ (whose work_h buffers are homes in the store): destroyed first.
  std::unique_ptr<mem::TieredStore> store_;
  std::unique_ptr<sched::PrefetchScheduler> sched_;  // offload_param cpu or nvme
  mem::StoreStats store_seen_;                       // store counters already in stats_
  std::uint64_t planned_host_bytes_ = 0;             // host bytes the plan holds
  bool backward_ = false;  // this micro-batch has reached its backward (for span names)
};

}  // namespace strata::zero
