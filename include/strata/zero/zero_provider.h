// ZeRO stages 1-3 across data-parallel ranks on top of one rank's OffloadEngine: gathers a
// group's full parameters from every rank's shard before use, reduces gradients so each rank
// keeps only its shard, and combines norms and checkpoints across ranks.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "strata/device/device.h"
#include "strata/dist/communicator.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/model/param_provider.h"
#include "strata/zero/offload_engine.h"
#include "strata/zero/partition.h"

namespace strata::zero {

struct ZeroOptions {
  int stage = 3;  // 1: optimizer states partitioned; 2: + gradients; 3: + parameters
  DType compute_dtype = DType::kF32;
  // Stage 3: start a group's all-gather when the model announces it (prefetch), so it overlaps
  // the current layer. Off when shards come from NVMe: there the prefetch starts the read instead.
  bool gather_ahead = true;
};

class ZeroProvider final : public model::ParamProvider {
 public:
  // `engine` holds this rank's part (partition.local_layout()); all references must outlive this.
  ZeroProvider(const model::ParamLayout& full, const Partition& partition, OffloadEngine& engine,
               dist::Communicator& comm, device::Device& device, ZeroOptions options);
  ~ZeroProvider() override;

  // Sets master weights from a source of FULL groups; each rank keeps its slice.
  Status load_master(const model::GroupSource& full_source);

  Result<const void*> acquire_params(int group) override;
  void release_params(int group) override;
  void prefetch_params(int group) override;
  Result<void*> acquire_grads(int group) override;
  Status release_grads(int group) override;
  // Waits for reductions still in flight and the engine's gradient transfers; call after each
  // micro-batch's backward.
  Status finish_micro_batch();

  // Global gradient norm over all ranks (replicated groups counted once).
  Result<double> grad_norm();
  // Optimizer step on every rank's shard, then (stages 1-2) re-gathers the full parameters.
  Status step(double lr, std::int64_t step, float grad_scale);

  // Checkpoint support. Collective: every rank calls these for the same groups in order.
  // The group's full fp32 master weights; written to `full_out` on rank 0 only.
  Status gather_master(int group, float* full_out);
  // This rank's slice [shard_offset, shard_offset + shard_elems) of the group's moments
  // (zero beyond the real elements), for every group whether partitioned or not.
  Status read_moment_slice(int group, float* exp_avg, float* exp_avg_sq);
  // Loads this rank's moments from a reader of global element ranges [begin, begin + count).
  using MomentRangeReader = std::function<Status(int group, std::int64_t begin, std::int64_t count,
                                                 float* exp_avg, float* exp_avg_sq)>;
  Status load_moments(const MomentRangeReader& read_range);

  const Partition& partition() const { return partition_; }

 private:
  Status refresh_replicated_params();  // stages 1-2: full parameters resident on every rank
  Status start_gather(int group);
  Status finish_gather(int group);
  Status finish_one_reduce();
  struct PendingReduce {
    int group = 0;
    dist::CommHandle handle;
    device::DeviceBuffer full;   // full-size gradient, alive until the collective is done
    void* slice_into = nullptr;  // stage 1: the engine shard that receives this rank's slice
  };
  bool partitioned(int group) const { return !partition_.group(group).replicated; }

  const model::ParamLayout& full_;
  const Partition& partition_;
  OffloadEngine& engine_;
  dist::Communicator& comm_;
  device::Device& device_;
  ZeroOptions options_;
  std::size_t dsize_;
  std::vector<device::DeviceBuffer> full_params_;  // gathered parameters per group
  std::vector<int> param_refs_;
  std::vector<device::DeviceBuffer> full_grads_;  // full-size gradients while being produced
  std::vector<void*> engine_grads_;               // replicated groups: the engine's buffer
  std::vector<dist::CommHandle> gathers_;         // stage 3: all-gathers in flight
  std::vector<bool> gathering_;
  std::deque<PendingReduce> pending_reduces_;
};

}  // namespace strata::zero
