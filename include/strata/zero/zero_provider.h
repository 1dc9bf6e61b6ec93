// The model's one ParamProvider, for every ZeRO stage and any number of ranks (one included). It
// composes the partition (partition.h), the collectives of the grid's data-parallel ranks, this
// rank's ShardStore (shard_store.h: its share of the model in the tiered store) and the
// OptimizerSchedule that updates it (optimizer_schedule.h). It gathers a group's full parameters
// from every rank's shard before use, reduces gradients so each rank keeps only its shard, and
// combines norms and checkpoints across ranks. Collectives are bucketed (bucket.h): gradients of
// several groups share a reduction, large groups are split. At one rank every group is
// replicated and each call goes straight to the shard store. Every device buffer of its own
// (gathered parameters, full gradients, buckets, staging) and the model's workspace are scratch
// of the shard store, under its one device budget.
#pragma once

#include <array>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "strata/device/device.h"
#include "strata/dist/communicator.h"
#include "strata/dist/process_grid.h"
#include "strata/mem/tiered_store.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/model/param_provider.h"
#include "strata/zero/bucket.h"
#include "strata/zero/optimizer_schedule.h"
#include "strata/zero/partition.h"
#include "strata/zero/shard_store.h"

namespace strata::zero {

// Which state a checkpoint reads. The live state, with the gathers on the provider's own
// data-parallel (and expert-data) communicators; or the state hold_state() holds, read on a
// save's thread with the gathers on `comm` (and `expert_comm`), communicators of the same ranks
// that training does not use.
struct StateSnapshot {
  bool held = false;
  dist::Communicator* comm = nullptr;
  dist::Communicator* expert_comm = nullptr;
};

class ZeroProvider final : public model::ParamProvider {
 public:
  // Partitions `full` over the grid's data-parallel ranks (groups under persistence_threshold
  // elements stay whole) and creates its shard store and optimizer schedule as `plan` says: the
  // memory plan of this rank's part that the caller made (the trainer's, which strata estimate
  // prints), or, when null, one made here from `shard_options`; fails with the plan's errors.
  // `full`, `device`, `swap` (may be null without NVMe) and `grid` must outlive the provider.
  static Result<std::unique_ptr<ZeroProvider>> create(
      const model::ParamLayout& full, std::int64_t persistence_threshold, device::Device& device,
      io::SwapSpace* swap, dist::ProcessGrid& grid, const ZeroOptions& options,
      const ShardOptions& shard_options, const MemoryPlan* plan = nullptr);
  ~ZeroProvider() override;

  // Sets master weights from a source of FULL groups; each rank keeps its slice. `cache`: see
  // ShardStore::load_master.
  Status load_master(const model::GroupSource& full_source, WorkingCopyCache* cache = nullptr,
                     const model::GroupRangeSource& frozen_pieces = nullptr);

  Result<const void*> acquire_params(int group) override;
  void release_params(int group) override;
  void prefetch_params(int group) override;
  // A frozen group (model::ParamGroup::frozen) has no gradient: acquire_grads fails, naming it.
  Result<void*> acquire_grads(int group, model::GradientWrite write) override;
  Status release_grads(int group) override;
  Result<void*> workspace(std::uint64_t bytes, const std::string& what) override;
  Result<void*> host_io(std::uint64_t bytes, const std::string& what) override {
    return shards_->scratch().host_io(bytes, what);
  }
  // Checkpointed activations are this rank's own (its micro-batch's): the shard store's.
  Result<void*> write_activation(int index, std::uint64_t bytes) override {
    return shards_->scratch().write_activation(index, bytes);
  }
  Result<const void*> read_activation(int index) override {
    return shards_->scratch().read_activation(index);
  }
  void prefetch_activation(int index) override { shards_->scratch().prefetch_activation(index); }
  Status release_activation(int index, bool keep) override {
    return shards_->scratch().release_activation(index, keep);
  }
  // Summed over the data-parallel ranks (a host all-reduce of one value per expert).
  Status sum_expert_rows(std::vector<double>& rows, const std::string& what) override;
  // Stage 3 gathers a partitioned group from every rank.
  bool acquire_is_collective(int group) const override {
    return options_.stage == 3 && partitioned(group);
  }
  // The micro-batch about to run is the step's last (see OptimizerSchedule): under
  // optimizer_overlap "backward" each rank updates its shard of a group as soon as that
  // group's reduction is done.
  void begin_last_micro_batch(double lr, std::int64_t step, bool may_clip, float unscale = 1.0f) {
    schedule_->begin_last_micro_batch(lr, step, may_clip, unscale);
  }
  // Waits for reductions still in flight and the shard store's gradient transfers; call after
  // each micro-batch's backward.
  Status finish_micro_batch();

  // Global gradient norm over all ranks (replicated groups counted once, and each tensor
  // parallel duplicate once), after the last micro-batch's finish_micro_batch: the same bits
  // whatever the pipeline stages.
  Result<double> grad_norm();
  // Optimizer step on every rank's shard, then (stages 1-2) re-gathers the full parameters.
  Status step(double lr, std::int64_t step, float grad_scale);
  // Drops the accumulated gradients (a step skipped for non-finite gradients).
  Status zero_grads();
  // The micro-batch of this rank's step (0-based) whose backward comes next: where its
  // gradients sit in the summation tree (GradientLanding::set_micro_batch).
  void set_micro_batch(std::int64_t micro) { shards_->grads().set_micro_batch(micro); }
  // Waits for an overlapped optimizer step to end; its error.
  Status finish_step() { return schedule_->finish_step(); }

  // Checkpoint support. Collective: every rank calls these for the same groups in order.
  // The group's full fp32 master weights into `full_out` on rank 0 of the gather (which must
  // pass one: a checked contract); null and untouched elsewhere. An expert's group under expert
  // parallelism is gathered over the expert-data ranks (a rank not holding it has it empty).
  Status gather_master(int group, float* full_out, const StateSnapshot& from = {});
  // This rank's slice [shard_offset, shard_offset + shard_elems) of the group's moments
  // (zero beyond the real elements), for every group whether partitioned or not.
  Status read_moment_slice(int group, float* exp_avg, float* exp_avg_sq,
                           const StateSnapshot& from = {});
  // An asynchronous save: holds the state as this step left it (an overlapped step finished
  // first) for gather_master and read_moment_slice with StateSnapshot::held, on the save's
  // thread, until release_state(); training goes on meanwhile (OptimizerState::hold).
  Status hold_state();
  void release_state();
  // Loads this rank's moments from a reader of global element ranges [begin, begin + count).
  using MomentRangeReader = std::function<Status(int group, std::int64_t begin, std::int64_t count,
                                                 float* exp_avg, float* exp_avg_sq)>;
  Status load_moments(const MomentRangeReader& read_range);

  const Partition& partition() const { return *partition_; }
  // This rank's memory plan.
  const MemoryPlan& plan() const { return shards_->plan(); }
  // The schedule the last step's update ran with (OptimizerSchedule::step_schedule).
  OptimizerOverlap step_schedule() const { return schedule_->step_schedule(); }
  // Everything this rank counted so far: transfers, waits, optimizer steps, gathers ahead.
  RankStats stats() const;
  // This rank's share: its store's and prefetcher's own counters (tests).
  const ShardStore& shards() const { return *shards_; }

 private:
  // A device buffer: scratch of the shard store, held (pinned) from take to give.
  using Scratch = ScratchSpace::Scratch;
  Result<Scratch> take(std::uint64_t bytes, const std::string& name, bool zero_fill = false);
  void give(Scratch& s);  // no-op when not held
  // A gradient buffer of `elems` elements of `elem_bytes` the model writes tensor by tensor
  // (GradientWrite::kWrite): what none of group's tensors covers (alignment gaps, padding)
  // zeroed, since it is reduced and stepped with the rest.
  void zero_gaps(void* grad, int group, std::int64_t elems, std::size_t elem_bytes);
  // This rank's part of a group, once an overlapped update of it is written.
  Result<const void*> acquire_shard(int group);

  Status refresh_replicated_params();  // stages 1-2: full parameters resident on every rank
  Status gather_bucket(const Bucket& bucket);
  // Takes the buffers and issues the first all-gathers. A prefetch goes ahead only if
  // everything the gather holds fits beside what the store cannot evict (device_fits): the
  // same answer on every rank. false: a prefetch that did not fit; nothing was taken.
  Result<bool> start_gather(int group, bool prefetch);
  Status issue_gather_chunk(int group, void* recv);
  Status finish_gather(int group);
  // The ranks a group is split over: the expert-data ones for an expert's group under expert
  // parallelism, else the data-parallel ones.
  dist::Communicator& comm_of(int group) {
    return partition_->group(group).experts ? expert_data_ : comm_;
  }
  // Shard elements per all-gather on that axis (allgather_bucket_bytes).
  std::int64_t gather_cap(int group) const {
    return gather_cap_elems_[partition_->group(group).experts ? 1 : 0];
  }

  // Gradient reductions. Replicated groups are all-reduced whole (one rank block); partitioned
  // groups are reduce-scattered (stage 1: all-reduced) in world rank blocks of shard size.
  enum class ReduceKind : std::uint8_t { kReplicated, kPartitioned };
  // A group's gradient from release_grads until its last piece has been reduced.
  struct GradSource {
    // Partitioned, or replicated with wide gradients: the full-size gradient the model wrote.
    Scratch full;
    void* data = nullptr;  // full.data, or the shard store's buffer for a replicated group
    // The shard store's buffer the reduction lands in: this rank's shard (partitioned), or the
    // whole group in f32 (replicated, wide gradients).
    void* shard = nullptr;
  };
  struct PendingReduce {
    ReduceKind kind = ReduceKind::kReplicated;
    dist::Communicator* comm = nullptr;  // the bucket's axis
    Bucket bucket;
    dist::CommHandle handle;
    Scratch send;            // the packed bucket; not held when it is one whole group's buffer
    Scratch recv;            // this rank's block of the result, packed; or every rank's copy
    Scratch sum;             // replicated, wide gradients, packed: the f32 sum to unpack
    void* result = nullptr;  // where this rank's reduced block(s) lie once the handle is done
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
    std::array<Scratch, 2> staging;  // chunked gathers: two chunks in flight
  };
  std::size_t gather_staging_bytes(int group) const;
  // The buckets of one kind on one axis: a group's axis (expert-data or data-parallel).
  BucketPacker& packer(bool experts, ReduceKind kind) {
    return packers_[(experts ? 2 : 0) + (kind == ReduceKind::kPartitioned ? 1 : 0)];
  }
  Status issue_reduce(ReduceKind kind, Bucket bucket);
  Status finish_one_reduce();
  Status unpack_reduce(const PendingReduce& p);  // into each piece's shard, then to the store
  bool partitioned(int group) const { return !partition_->group(group).replicated; }
  std::string describe(const Bucket& bucket, const std::string& what) const;
  void copy(void* dst, const void* src, std::int64_t num_elems);  // device to device, in order
  // The reductions' results: compute_dtype, or f32 with wide gradients.
  DType reduced_dtype() const {
    return options_.wide_gradients ? DType::kF32 : options_.compute_dtype;
  }

  ZeroProvider(const model::ParamLayout& full, std::unique_ptr<Partition> partition,
               std::unique_ptr<ShardStore> shards, std::unique_ptr<OptimizerSchedule> schedule,
               dist::ProcessGrid& grid, device::Device& device, const ZeroOptions& options);

  const model::ParamLayout& full_;
  std::unique_ptr<Partition> partition_;
  std::unique_ptr<ShardStore> shards_;  // this rank's part: partition_->local_layout()
  std::unique_ptr<OptimizerSchedule> schedule_;
  dist::Communicator& comm_;         // the data-parallel ranks ZeRO shards over
  dist::Communicator& expert_data_;  // those holding the same experts: the experts' groups'
  dist::Communicator& tensor_;       // the tensor-parallel ranks, each with its own slices
  dist::Communicator& pipeline_;     // the pipeline stages, each with its own groups
  // Expert parallelism: the data-parallel ranks hold different experts, so what fits on the
  // device beside a gather ahead differs between them, and a data-parallel group is gathered
  // at acquire (every rank then issues those gathers at the same point).
  bool expert_parallel_;
  device::Device& device_;
  ZeroOptions options_;
  std::size_t dsize_;
  Scratch workspace_;
  std::vector<Scratch> full_params_;  // gathered parameters per group
  std::vector<int> param_refs_;
  std::vector<Scratch> full_grads_;     // full-size gradients while being produced
  std::vector<void*> shard_grads_;      // replicated groups: the shard store's buffer
  std::vector<PendingGather> gathers_;  // stage 3: all-gathers in flight
  std::vector<bool> gathering_;
  // Shard elements per all-gather (allgather_bucket_bytes): data-parallel, expert-data axis.
  std::array<std::int64_t, 2> gather_cap_elems_;
  std::vector<GradSource> grad_sources_;
  // Per axis (data-parallel, expert-data): replicated then partitioned (rank blocks: the axis'
  // world); at most one of an axis' two has an open bucket.
  std::array<BucketPacker, 4> packers_;
  std::deque<PendingReduce> pending_reduces_;
  RankStats stats_;  // gathers ahead; the rest is the store's and the schedule's
};

}  // namespace strata::zero
