// The model's one ParamProvider, for every ZeRO stage and any number of ranks (one included):
// partitions the layout, owns this rank's OffloadEngine, gathers a group's full parameters from
// every rank's shard before use, reduces gradients so each rank keeps only its shard, and
// combines norms and checkpoints across ranks. Collectives are bucketed (bucket.h): gradients of
// several groups share a reduction, large groups are split. At one rank every group is
// replicated and each call goes straight to the engine.
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "strata/device/device.h"
#include "strata/dist/communicator.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/model/param_provider.h"
#include "strata/zero/bucket.h"
#include "strata/zero/offload_engine.h"
#include "strata/zero/partition.h"

namespace strata::zero {

struct ZeroOptions {
  int stage = 3;  // 1: optimizer states partitioned; 2: + gradients; 3: + parameters
  DType compute_dtype = DType::kF32;
  // Stage 3: start a group's all-gather when the model announces it (prefetch), so it overlaps
  // the current layer. Off when shards come from NVMe: there the prefetch starts the read instead.
  bool gather_ahead = true;
  // Most bytes one gradient reduction moves, counting every rank's block (DeepSpeed's
  // reduce_bucket_size, in bytes): released gradients are packed into buckets of this size, small
  // groups together and large groups split, one collective per bucket. Device memory beyond the
  // unbucketed reduction: the full gradients of the open bucket's groups (up to this many bytes,
  // plus the rest of a split group) and one packed bucket (this many bytes, and 1/world of it
  // for the reduced block).
  std::uint64_t reduce_bucket_bytes = kDefaultReduceBucketBytes;
  // Most bytes one parameter all-gather receives (DeepSpeed's allgather_bucket_size, in bytes):
  // stage 3 gathers a larger group in several all-gathers through two staging buffers of this
  // size (allocated once, at the first such group, and kept); stages 1-2 coalesce the re-gather
  // after each step into buckets of this size.
  std::uint64_t allgather_bucket_bytes = kDefaultAllgatherBucketBytes;
};

class ZeroProvider final : public model::ParamProvider {
 public:
  // Partitions `full` over comm's ranks (groups under persistence_threshold elements stay whole)
  // and creates this rank's engine over its part; fails with the engine's plan errors. `full`,
  // `device`, `swap` (may be null without NVMe) and `comm` must outlive the provider.
  static Result<std::unique_ptr<ZeroProvider>> create(const model::ParamLayout& full,
                                                      std::int64_t persistence_threshold,
                                                      device::Device& device, io::SwapSpace* swap,
                                                      dist::Communicator& comm,
                                                      const ZeroOptions& options,
                                                      const EngineOptions& engine_options);
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

  // Global gradient norm over all ranks (replicated groups counted once), after the last
  // micro-batch's finish_micro_batch.
  Result<double> grad_norm();
  // Optimizer step on every rank's shard, then (stages 1-2) re-gathers the full parameters.
  Status step(double lr, std::int64_t step, float grad_scale);
  // Drops the accumulated gradients (a step skipped for non-finite gradients).
  void zero_grads();

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

  const Partition& partition() const { return *partition_; }
  // This rank's engine: its memory plan, transfer counters and store (stats, tests).
  const OffloadEngine& engine() const { return *engine_; }

 private:
  Status refresh_replicated_params();  // stages 1-2: full parameters resident on every rank
  Status gather_bucket(const Bucket& bucket);
  Status start_gather(int group, bool prefetch);
  Status issue_gather_chunk(int group, void* recv);
  Status finish_gather(int group);

  // Gradient reductions. Replicated groups are all-reduced whole (one rank block); partitioned
  // groups are reduce-scattered (stage 1: all-reduced) in world rank blocks of shard size.
  enum class ReduceKind : std::uint8_t { kReplicated, kPartitioned };
  // A group's gradient from release_grads until its last piece has been reduced.
  struct GradSource {
    device::DeviceBuffer full;  // partitioned: the full-size gradient the model wrote
    void* data = nullptr;       // full.data(), or the engine's buffer for a replicated group
    void* shard = nullptr;      // partitioned: the engine's buffer for this rank's shard
  };
  struct PendingReduce {
    ReduceKind kind = ReduceKind::kReplicated;
    Bucket bucket;
    dist::CommHandle handle;
    device::DeviceBuffer send;  // the packed bucket; empty when it is one whole group's buffer
    device::DeviceBuffer recv;  // stages 2-3, packed: this rank's block of the result
    void* result = nullptr;     // where this rank's reduced block(s) lie once the handle is done
  };
  // One stage 3 all-gather of shard range [begin, begin + count) of a group, in flight.
  struct GatherChunk {
    std::int64_t begin = 0, count = 0;
    dist::CommHandle handle;
    void* recv = nullptr;  // world * count, packed, in staging; null: straight to the full layout
  };
  struct PendingGather {
    const void* shard = nullptr;
    std::int64_t next_begin = 0;  // first shard element whose all-gather is not yet issued
    std::deque<GatherChunk> chunks;
    std::vector<device::DeviceBuffer> own_staging;  // when the shared pair was lent out
  };
  std::size_t gather_staging_bytes() const;
  BucketPacker& packer(ReduceKind kind) {
    return kind == ReduceKind::kPartitioned ? partitioned_packer_ : replicated_packer_;
  }
  Status issue_reduce(ReduceKind kind, Bucket bucket);
  Status finish_one_reduce();
  bool partitioned(int group) const { return !partition_->group(group).replicated; }
  std::string describe(const Bucket& bucket, const std::string& what) const;
  void copy(void* dst, const void* src, std::int64_t num_elems);  // device to device, in order
  Result<device::DeviceBuffer> allocate(std::size_t bytes, const std::string& what,
                                        bool may_trim = true);

  ZeroProvider(const model::ParamLayout& full, std::unique_ptr<Partition> partition,
               std::unique_ptr<OffloadEngine> engine, dist::Communicator& comm,
               device::Device& device, const ZeroOptions& options);

  const model::ParamLayout& full_;
  std::unique_ptr<Partition> partition_;
  std::unique_ptr<OffloadEngine> engine_;  // this rank's part: partition_->local_layout()
  dist::Communicator& comm_;
  device::Device& device_;
  ZeroOptions options_;
  std::size_t dsize_;
  std::vector<device::DeviceBuffer> full_params_;  // gathered parameters per group
  std::vector<int> param_refs_;
  std::vector<device::DeviceBuffer> full_grads_;  // full-size gradients while being produced
  std::vector<void*> engine_grads_;               // replicated groups: the engine's buffer
  std::vector<PendingGather> gathers_;            // stage 3: all-gathers in flight
  std::vector<bool> gathering_;
  std::int64_t gather_cap_elems_;  // shard elements per all-gather (allgather_bucket_bytes)
  std::vector<device::DeviceBuffer> gather_staging_;  // the pair chunked gathers share
  int staging_owner_ = -1;                            // the group it is lent to, or -1
  std::vector<GradSource> grad_sources_;
  BucketPacker replicated_packer_;   // at most one of the two has an open bucket
  BucketPacker partitioned_packer_;  // its rank blocks: world
  std::deque<PendingReduce> pending_reduces_;
};

}  // namespace strata::zero
