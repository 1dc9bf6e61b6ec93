// The single-process ZeRO-3 offload engine: owns every parameter group's fp32 master weights,
// Adam moments, gradient accumulator and compute-dtype working copy in the tiers the config
// names, serves the model's ParamProvider requests, and runs the optimizer step.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "strata/core/aligned.h"
#include "strata/core/status.h"
#include "strata/device/device.h"
#include "strata/io/swap.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/model/param_layout.h"
#include "strata/model/param_provider.h"
#include "strata/optim/adamw.h"

namespace strata::zero {

enum class Offload : std::uint8_t { kNone, kCpu, kNvme };
std::string_view offload_name(Offload o);

struct EngineOptions {
  Offload offload_param = Offload::kNone;      // where bf16/f32 working copies live
  Offload offload_optimizer = Offload::kNone;  // where master weights, moments, gradients live
  DType compute_dtype = DType::kF32;
  optim::AdamWHyper adam;
  std::uint64_t host_memory_limit_bytes = 0;  // 0 = no limit
};

struct EngineStats {
  std::uint64_t h2d_bytes = 0;        // host -> device
  std::uint64_t d2h_bytes = 0;        // device -> host
  std::uint64_t nvme_read_bytes = 0;  // NVMe -> host
  std::uint64_t nvme_write_bytes = 0;
  std::uint64_t host_bytes = 0;  // host memory the engine holds (its peak: it only grows)
  std::uint64_t nvme_bytes = 0;  // swap space the engine holds
  double wait_ms = 0;            // compute blocked waiting for parameters
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
  // Global L2 norm of the accumulated fp32 gradients.
  Result<double> grad_norm();
  // Sum of squares of one group's accumulated fp32 gradient (for norms across ranks).
  Result<double> grad_sum_squares(int group);
  // One AdamW step (step is 1-based) with gradients multiplied by grad_scale, then refreshes the
  // working copies and zeroes the gradients.
  Status step(double lr, std::int64_t step, float grad_scale);
  // Drops the accumulated gradients (a step skipped for non-finite gradients).
  void zero_grads();

  const EngineStats& stats() const { return stats_; }
  std::uint64_t host_bytes_planned() const { return stats_.host_bytes; }

 private:
  struct Group;
  OffloadEngine(const model::ParamLayout& layout, device::Device& device, io::SwapSpace* swap,
                const EngineOptions& options);
  Status plan();
  Result<AlignedBuffer*> take_staging();
  void give_staging(AlignedBuffer* b);
  Status start_fetch(Group& g);
  Status drain_one_grad();
  Status accumulate_grad(Group& g, const void* grad_host);
  Status store_working_copy(Group& g, const void* src_host);  // host compute-dtype -> its tier
  Status nvme_read(const io::Extent& x, void* buf, std::size_t bytes);
  Status nvme_write(const io::Extent& x, const void* buf, std::size_t bytes);
  Result<AlignedBuffer> host_alloc(std::size_t bytes, const char* what);

  const model::ParamLayout& layout_;
  device::Device& device_;
  io::SwapSpace* swap_;
  EngineOptions options_;
  std::vector<std::unique_ptr<Group>> groups_;
  std::size_t max_work_bytes_ = 0;
  std::size_t max_f32_bytes_ = 0;
  std::vector<AlignedBuffer> staging_;  // compute-dtype transfers (params and grads)
  std::vector<AlignedBuffer*> free_staging_;
  AlignedBuffer opt_buf_[2][3];            // nvme optimizer: master, m, v for two groups
  device::DeviceBuffer grad_f32_scratch_;  // optimizer on device: bf16 -> f32 grad
  struct PendingGrad {
    int group;
    device::DeviceBuffer buffer;
    AlignedBuffer* staging;
    device::Event done;
  };
  std::deque<PendingGrad> pending_grads_;
  EngineStats stats_;
};

}  // namespace strata::zero
