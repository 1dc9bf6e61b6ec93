// ZeroProvider: all-gather before use, bucketed reduce-scatter after backward, cross-rank norms.
#include "strata/zero/zero_provider.h"

#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>
#include <utility>

#include "strata/core/logging.h"

namespace strata::zero {

Result<std::unique_ptr<ZeroProvider>> ZeroProvider::create(
    const model::ParamLayout& full, std::int64_t persistence_threshold, device::Device& device,
    io::SwapSpace* swap, dist::ProcessGrid& grid, const ZeroOptions& options,
    const ShardOptions& shard_options, const MemoryPlan* given_plan) {
  // ZeRO shards over the data-parallel ranks; an expert's groups, under expert parallelism, over
  // the ranks holding that expert.
  dist::Communicator& comm = grid.data();
  std::optional<ShardAxis> experts;
  if (grid.shape().expert > 1) {
    experts = ShardAxis{grid.expert_data().rank(), grid.expert_data().world_size()};
  }
  auto partition = std::make_unique<Partition>(full, ShardAxis{comm.rank(), comm.world_size()},
                                               persistence_threshold, experts);
  MemoryPlan plan;
  if (given_plan != nullptr) {
    plan = *given_plan;
  } else {
    PlanOptions po = plan_options(shard_options, device.memory_stats().limit_bytes, swap != nullptr,
                                  device.host_addressable());
    po.zero = options;
    STRATA_ASSIGN_OR_RETURN(plan, make_plan(*partition, po));
  }
  // Each group's shard starts here in the group's flat vector: where its elements' stochastic
  // rounding draws from, so any world size rounds them alike.
  ShardOptions store_options = shard_options;
  store_options.shard_offsets.clear();
  for (const GroupPartition& g : partition->groups()) {
    store_options.shard_offsets.push_back(g.replicated ? 0 : g.shard_offset);
  }
  STRATA_ASSIGN_OR_RETURN(
      std::unique_ptr<ShardStore> shards,
      ShardStore::create(partition->local_layout(), device, swap, store_options, plan));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<OptimizerSchedule> schedule,
                          OptimizerSchedule::create(*shards, device, shard_options));
  return std::unique_ptr<ZeroProvider>(new ZeroProvider(
      full, std::move(partition), std::move(shards), std::move(schedule), grid, device, options));
}

ZeroProvider::ZeroProvider(const model::ParamLayout& full, std::unique_ptr<Partition> partition,
                           std::unique_ptr<ShardStore> shards,
                           std::unique_ptr<OptimizerSchedule> schedule, dist::ProcessGrid& grid,
                           device::Device& device, const ZeroOptions& options)
    : full_(full),
      partition_(std::move(partition)),
      shards_(std::move(shards)),
      schedule_(std::move(schedule)),
      comm_(grid.data()),
      expert_data_(grid.expert_data()),
      tensor_(grid.tensor()),
      pipeline_(grid.pipeline()),
      expert_parallel_(grid.shape().expert > 1),
      device_(device),
      options_(options),
      dsize_(dtype_size(options.compute_dtype)),
      gather_cap_elems_{
          bucket_cap_elems(options.allgather_bucket_bytes, dsize_, comm_.world_size()),
          bucket_cap_elems(options.allgather_bucket_bytes, dsize_, expert_data_.world_size())},
      packers_{
          BucketPacker(bucket_cap_elems(options.reduce_bucket_bytes, dsize_, 1)),
          BucketPacker(bucket_cap_elems(options.reduce_bucket_bytes, dsize_, comm_.world_size())),
          BucketPacker(bucket_cap_elems(options.reduce_bucket_bytes, dsize_, 1)),
          BucketPacker(
              bucket_cap_elems(options.reduce_bucket_bytes, dsize_, expert_data_.world_size()))} {
  full_params_.resize(static_cast<std::size_t>(full.num_groups()));
  param_refs_.assign(static_cast<std::size_t>(full.num_groups()), 0);
  full_grads_.resize(static_cast<std::size_t>(full.num_groups()));
  shard_grads_.assign(static_cast<std::size_t>(full.num_groups()), nullptr);
  // Constructed in place: a deque of move-only chunks is not copyable, and its move may throw.
  gathers_ = std::vector<PendingGather>(static_cast<std::size_t>(full.num_groups()));
  grad_sources_.resize(static_cast<std::size_t>(full.num_groups()));
  gathering_.assign(static_cast<std::size_t>(full.num_groups()), false);
}

// Normally nothing is in flight here. After an error ended a step, collectives may still be
// queued or running, and they write into buffers of the shard store: wait for them (for a
// moment: the peers that issued them too finish them quickly), and where one does not finish,
// abandon the shard store rather than free memory MPI or NCCL may still write into.
ZeroProvider::~ZeroProvider() {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  bool stuck = false;
  auto settle = [&](dist::CommHandle& h) {
    while (!h.ready()) {
      if (std::chrono::steady_clock::now() >= give_up) {
        stuck = true;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    (void)h.wait();  // its error, if any, was the run's to report
  };
  for (PendingReduce& p : pending_reduces_) settle(p.handle);
  for (PendingGather& g : gathers_) {
    for (GatherChunk& c : g.chunks) settle(c.handle);
  }
  if (!stuck) {
    schedule_.reset();  // before the store it updates
    return;
  }
  log_warning("rank " + std::to_string(comm_.rank()) +
              ": collectives still in flight at shutdown; their device memory is left allocated");
  (void)schedule_.release();
  (void)shards_.release();
}

Status ZeroProvider::load_master(const model::GroupSource& full_source, WorkingCopyCache* cache,
                                 const model::GroupRangeSource& frozen_pieces) {
  // Pieces of this rank's part of a group: its shard's range of the full group, zeros past it.
  model::GroupRangeSource local_pieces;
  if (frozen_pieces) {
    local_pieces = [&](const model::ParamGroup& local, std::int64_t begin, std::int64_t count,
                       float* dst) {
      const GroupPartition& p = partition_->group(local.id);
      const model::ParamGroup& full = full_.group(local.id);
      std::fill(dst, dst + count, 0.0f);
      const std::int64_t from = (p.replicated ? 0 : p.shard_offset) + begin;
      const std::int64_t to = std::min(from + count, full.num_elems);
      return to > from ? frozen_pieces(full, from, to - from, dst) : Status::ok();
    };
  }
  STRATA_RETURN_IF_ERROR(schedule_->finish_step());
  std::vector<float> tmp;
  STRATA_RETURN_IF_ERROR(shards_->load_master(
      [&](const model::ParamGroup& local, float* dst) {
        const GroupPartition& p = partition_->group(local.id);
        const model::ParamGroup& full = full_.group(local.id);
        // This rank holds the whole group (one rank, or a replicated group): straight into `dst`,
        // with no group-sized copy beside it. `dst` comes zero-filled.
        if ((p.replicated || p.shard_offset == 0) && p.local_elems() >= full.num_elems) {
          return full_source(full, dst);
        }
        tmp.assign(static_cast<std::size_t>(p.padded_elems), 0.0f);
        STRATA_RETURN_IF_ERROR(full_source(full_.group(local.id), tmp.data()));
        const std::int64_t begin = p.replicated ? 0 : p.shard_offset;
        std::memcpy(dst, tmp.data() + begin,
                    static_cast<std::size_t>(p.local_elems()) * sizeof(float));
        return Status::ok();
      },
      cache, local_pieces));
  STRATA_RETURN_IF_ERROR(schedule_->restart());
  return refresh_replicated_params();
}

void ZeroProvider::copy(void* dst, const void* src, std::int64_t num_elems) {
  // A cast to the same dtype is the op table's device-to-device copy, ordered on the compute
  // stream with the collectives and the model's ops.
  device_.ops().cast(src, options_.compute_dtype, dst, options_.compute_dtype, num_elems);
}

Result<ZeroProvider::Scratch> ZeroProvider::take(std::uint64_t bytes, const std::string& name,
                                                 bool zero_fill) {
  return shards_->scratch().take(bytes, name, zero_fill);
}

void ZeroProvider::give(Scratch& s) { shards_->scratch().give(s); }

Result<const void*> ZeroProvider::acquire_shard(int group) {
  STRATA_RETURN_IF_ERROR(schedule_->wait_update(group));
  return shards_->params().acquire(group);
}

Result<void*> ZeroProvider::workspace(std::uint64_t bytes, const std::string& what) {
  if (workspace_.held()) {
    const mem::TensorSpec& spec = shards_->store().spec(workspace_.h);
    if (spec.size_bytes == bytes && spec.name == what) return workspace_.data;
    give(workspace_);  // the old shape's bytes go back before the new ones are asked for
  }
  STRATA_ASSIGN_OR_RETURN(workspace_, take(bytes, what));
  return workspace_.data;
}

std::string ZeroProvider::describe(const Bucket& bucket, const std::string& what) const {
  const int first = bucket.pieces.front().group;
  const int last = bucket.pieces.back().group;
  std::string s = what + " of " + full_.group(first).name;
  if (last != first) s += ".." + full_.group(last).name;
  if (!bucket.whole_group()) {
    s += " (bucket of " + std::to_string(bucket.pieces.size()) + " pieces)";
  }
  return s;
}

Status ZeroProvider::refresh_replicated_params() {
  if (options_.stage >= 3) return Status::ok();
  // A bucket's groups share an axis: one packer for each.
  std::array<BucketPacker, 2> packers{BucketPacker(gather_cap_elems_[0]),
                                      BucketPacker(gather_cap_elems_[1])};
  for (const auto& p : partition_->groups()) {
    if (p.replicated || p.padded_elems == 0) continue;  // an empty group has nothing to hold
    Scratch& full = full_params_[static_cast<std::size_t>(p.group)];
    if (!full.held()) {
      STRATA_ASSIGN_OR_RETURN(full, take(static_cast<std::uint64_t>(p.padded_elems) * dsize_,
                                         "replicated parameters of " + full_.group(p.group).name));
    }
    if (p.shard_elems == 0) continue;
    for (const Bucket& b : packers[p.experts ? 1 : 0].add(p.group, p.shard_elems)) {
      STRATA_RETURN_IF_ERROR(gather_bucket(b));
    }
  }
  for (BucketPacker& packer : packers) {
    if (auto b = packer.flush()) STRATA_RETURN_IF_ERROR(gather_bucket(*b));
  }
  return Status::ok();
}

// Stages 1-2: one all-gather of a bucket of consecutive groups' shard ranges, unpacked into each
// group's full parameters. A bucket that is one whole group gathers straight into its layout.
Status ZeroProvider::gather_bucket(const Bucket& bucket) {
  const BucketPiece& first = bucket.pieces.front();
  const std::string what = describe(bucket, "parameters");
  dist::Communicator& comm = comm_of(first.group);
  if (bucket.whole_group()) {
    STRATA_ASSIGN_OR_RETURN(const void* shard, acquire_shard(first.group));
    Status s = comm.all_gather(shard, full_params_[static_cast<std::size_t>(first.group)].data,
                               bucket.block_elems, options_.compute_dtype, what)
                   .wait();
    shards_->params().release(first.group);
    return s;
  }
  const int world = comm.world_size();
  const auto count = static_cast<std::size_t>(bucket.block_elems);
  STRATA_ASSIGN_OR_RETURN(Scratch send, take(count * dsize_, "all-gather bucket (send)"));
  auto recv = take(count * dsize_ * static_cast<std::size_t>(world), "all-gather bucket");
  if (!recv.is_ok()) give(send);
  STRATA_RETURN_IF_ERROR(recv.status());
  Status s = [&]() -> Status {
    for (const BucketPiece& piece : bucket.pieces) {
      STRATA_ASSIGN_OR_RETURN(const void* shard, acquire_shard(piece.group));
      copy(send.bytes() + static_cast<std::size_t>(piece.offset) * dsize_,
           static_cast<const std::byte*>(shard) + static_cast<std::size_t>(piece.begin) * dsize_,
           piece.count);
      shards_->params().release(piece.group);
    }
    STRATA_RETURN_IF_ERROR(
        comm.all_gather(send.data, recv->data, bucket.block_elems, options_.compute_dtype, what)
            .wait());
    for (int r = 0; r < world; ++r) {
      for (const BucketPiece& piece : bucket.pieces) {
        const GroupPartition& p = partition_->group(piece.group);
        std::byte* full = full_params_[static_cast<std::size_t>(piece.group)].bytes();
        copy(full + static_cast<std::size_t>(r * p.shard_elems + piece.begin) * dsize_,
             recv->bytes() +
                 (static_cast<std::size_t>(r) * count + static_cast<std::size_t>(piece.offset)) *
                     dsize_,
             piece.count);
      }
    }
    return Status::ok();
  }();
  give(send);
  give(*recv);
  return s;
}

Result<bool> ZeroProvider::start_gather(int group, bool prefetch) {
  const GroupPartition& p = partition_->group(group);
  const auto gi = static_cast<std::size_t>(group);
  // A group above allgather_bucket_bytes is gathered in chunks (at least two), two in flight,
  // through two staging buffers of its own.
  const bool chunked = p.shard_elems > gather_cap(group);
  const std::uint64_t full_bytes = static_cast<std::uint64_t>(p.padded_elems) * dsize_;
  const std::uint64_t staging_bytes = chunked ? gather_staging_bytes(group) : 0;
  if (prefetch && !shards_->store().device_fits(full_bytes + 2 * staging_bytes +
                                                shards_->params().acquire_device_bytes(group))) {
    return false;
  }
  PendingGather& g = gathers_[gi];
  Scratch& full = full_params_[gi];
  Status s = [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(full,
                            take(full_bytes, "gathered parameters of " + full_.group(group).name));
    for (int i = 0; chunked && i < 2; ++i) {
      STRATA_ASSIGN_OR_RETURN(g.staging[static_cast<std::size_t>(i)],
                              take(staging_bytes, "all-gather staging"));
    }
    STRATA_ASSIGN_OR_RETURN(g.shard, acquire_shard(group));
    return Status::ok();
  }();
  if (!s.is_ok()) {
    give(full);
    for (Scratch& b : g.staging) give(b);
    return s;
  }
  g.next_begin = 0;
  gathering_[gi] = true;
  if (!chunked) {
    STRATA_RETURN_IF_ERROR(issue_gather_chunk(group, nullptr));
    return true;
  }
  for (int i = 0; i < 2 && g.next_begin < p.shard_elems; ++i) {
    STRATA_RETURN_IF_ERROR(issue_gather_chunk(group, g.staging[static_cast<std::size_t>(i)].data));
  }
  return true;
}

std::size_t ZeroProvider::gather_staging_bytes(int group) const {
  // Never more than the largest chunk any group of the axis needs.
  const bool experts = partition_->group(group).experts;
  std::int64_t widest = 0;
  for (const auto& p : partition_->groups()) {
    if (!p.replicated && p.experts == experts) widest = std::max(widest, p.shard_elems);
  }
  return static_cast<std::size_t>(std::min(gather_cap(group), widest)) *
         static_cast<std::size_t>(partition_->group(group).world) * dsize_;
}

// Issues the all-gather of the group's next shard range: into `recv` (packed, then unpacked by
// finish_gather), or straight into the full layout when `recv` is null (the whole shard).
Status ZeroProvider::issue_gather_chunk(int group, void* recv) {
  const GroupPartition& p = partition_->group(group);
  PendingGather& g = gathers_[static_cast<std::size_t>(group)];
  GatherChunk c;
  c.begin = g.next_begin;
  c.count = recv == nullptr ? p.shard_elems : std::min(gather_cap(group), p.shard_elems - c.begin);
  g.next_begin += c.count;
  const auto* send =
      static_cast<const std::byte*>(g.shard) + static_cast<std::size_t>(c.begin) * dsize_;
  void* dst = recv == nullptr ? full_params_[static_cast<std::size_t>(group)].data : recv;
  std::string what = "parameters of " + full_.group(group).name;
  if (recv != nullptr) {
    what += " [" + std::to_string(c.begin) + ", " + std::to_string(c.begin + c.count) +
            ") of each shard";
  }
  c.handle = comm_of(group).all_gather(send, dst, c.count, options_.compute_dtype, what);
  c.recv = recv;
  g.chunks.push_back(std::move(c));
  return Status::ok();
}

Status ZeroProvider::finish_gather(int group) {
  const auto gi = static_cast<std::size_t>(group);
  const GroupPartition& p = partition_->group(group);
  PendingGather& g = gathers_[gi];
  Status s;
  while (!g.chunks.empty()) {
    GatherChunk c = std::move(g.chunks.front());
    g.chunks.pop_front();
    Status cs = c.handle.wait();  // waits every chunk, even after a failure: MPI writes into recv
    if (!s.is_ok()) continue;
    s = cs;
    if (!s.is_ok() || c.recv == nullptr) continue;
    std::byte* full = full_params_[gi].bytes();
    for (int r = 0; r < p.world; ++r) {
      copy(full + static_cast<std::size_t>(r * p.shard_elems + c.begin) * dsize_,
           static_cast<const std::byte*>(c.recv) + static_cast<std::size_t>(r * c.count) * dsize_,
           c.count);
    }
    // The unpack and the next all-gather into the same buffer are ordered on the compute stream.
    if (g.next_begin < p.shard_elems) s = issue_gather_chunk(group, c.recv);
  }
  g.shard = nullptr;
  for (Scratch& b : g.staging) give(b);
  gathering_[gi] = false;
  shards_->params().release(group);  // the shard is no longer needed once gathered
  if (!s.is_ok()) give(full_params_[gi]);
  return s;
}

Result<const void*> ZeroProvider::acquire_params(int group) {
  if (!partitioned(group)) return acquire_shard(group);
  const auto gi = static_cast<std::size_t>(group);
  if (options_.stage < 3) return static_cast<const void*>(full_params_[gi].data);
  if (param_refs_[gi] > 0) {
    ++param_refs_[gi];
    return static_cast<const void*>(full_params_[gi].data);
  }
  if (!gathering_[gi]) STRATA_RETURN_IF_ERROR(start_gather(group, /*prefetch=*/false).status());
  STRATA_RETURN_IF_ERROR(finish_gather(group));
  ++param_refs_[gi];
  return static_cast<const void*>(full_params_[gi].data);
}

void ZeroProvider::release_params(int group) {
  if (!partitioned(group)) return shards_->params().release(group);
  if (options_.stage < 3) return;
  const auto gi = static_cast<std::size_t>(group);
  STRATA_CHECK(param_refs_[gi] > 0, "release_params without acquire", group);
  if (--param_refs_[gi] == 0) give(full_params_[gi]);
}

void ZeroProvider::prefetch_params(int group) {
  if (!partitioned(group) || options_.stage < 3) {
    if (!partitioned(group)) shards_->params().prefetch(group);
    return;
  }
  const auto gi = static_cast<std::size_t>(group);
  if (param_refs_[gi] > 0 || gathering_[gi]) return;
  if (!options_.gather_ahead || (expert_parallel_ && !partition_->group(group).experts)) {
    shards_->params().prefetch(group);  // start the shard's slow fetch; gather at acquire
    return;
  }
  // Start the all-gather now so it runs while the current layer computes. A prefetch is only a
  // hint: without room on the device, acquire gathers on demand. Whether it fits depends on
  // what every rank holds after the same calls, so all ranks choose alike and issue
  // collectives in the same order, as MPI and NCCL require. An error here (a failed shard read)
  // shows again at acquire, which gathers on demand.
  auto started = start_gather(group, /*prefetch=*/true);
  ++(started.is_ok() && *started ? stats_.gathers_ahead : stats_.gathers_ahead_refused);
}

Status ZeroProvider::sum_expert_rows(std::vector<double>& rows, const std::string& what) {
  if (comm_.world_size() == 1) return Status::ok();
  return comm_.all_reduce_host(rows.data(), static_cast<int>(rows.size()), dist::ReduceOp::kSum,
                               "expert rows of " + what);
}

Result<void*> ZeroProvider::acquire_grads(int group, model::GradientWrite write) {
  if (full_.group(group).frozen) {
    return failed_precondition("parameter group '" + full_.group(group).name +
                               "' is frozen: it has no gradient");
  }
  STRATA_RETURN_IF_ERROR(schedule_->before_gradients());
  // A replicated group's gradient lands in the shard store's buffer as the model makes it; with
  // wide gradients (several data-parallel ranks) that buffer is f32, and the model's goes into
  // scratch first, as a partitioned group's does: also an expert's group whose axis is one rank
  // (the only one holding that expert), "reduced" over that rank into f32.
  if (!partitioned(group) && !options_.wide_gradients) {
    STRATA_ASSIGN_OR_RETURN(void* buf, shards_->acquire_grads(group, write));
    shard_grads_[static_cast<std::size_t>(group)] = buf;
    // The buffer is the gradient landing's, in the plan's gradient dtype.
    if (write == model::GradientWrite::kWrite) {
      zero_gaps(buf, group, full_.group(group).num_elems, dtype_size(plan().gradient_dtype));
    }
    return buf;
  }
  const GroupPartition& p = partition_->group(group);
  const auto gi = static_cast<std::size_t>(group);
  const bool add = write == model::GradientWrite::kAdd;
  STRATA_ASSIGN_OR_RETURN(full_grads_[gi],
                          take(static_cast<std::uint64_t>(p.padded_elems) * dsize_,
                               "full gradient of " + full_.group(group).name, /*zero_fill=*/add));
  if (!add) zero_gaps(full_grads_[gi].data, group, p.padded_elems, dsize_);
  return full_grads_[gi].data;
}

void ZeroProvider::zero_gaps(void* grad, int group, std::int64_t elems, std::size_t elem_bytes) {
  for (const auto& [first, last] : full_.group(group).gaps(elems)) {
    device_.fill_zero(static_cast<std::byte*>(grad) + static_cast<std::size_t>(first) * elem_bytes,
                      static_cast<std::size_t>(last - first) * elem_bytes,
                      device_.stream(device::StreamKind::kCompute));
  }
}

Status ZeroProvider::release_grads(int group) {
  const auto gi = static_cast<std::size_t>(group);
  GradSource& src = grad_sources_[gi];
  const ReduceKind kind = partitioned(group) ? ReduceKind::kPartitioned : ReduceKind::kReplicated;
  if (kind == ReduceKind::kReplicated && !options_.wide_gradients) {
    if (comm_of(group).world_size() == 1) return shards_->grads().release(group);
    src.data = shard_grads_[gi];
  } else {
    src.full = std::exchange(full_grads_[gi], Scratch{});
    src.data = src.full.data;
    // The reduction writes every element of this rank's part (unpack_reduce, or the collective
    // itself for a whole bucket).
    STRATA_ASSIGN_OR_RETURN(src.shard, shards_->acquire_grads(group, model::GradientWrite::kWrite));
  }
  if (partition_->group(group).local_elems() == 0) {  // nothing to reduce
    give(src.full);
    src = GradSource{};
    return shards_->grads().release(group);
  }
  // Replicated and partitioned groups reduce through different collectives: a change of kind
  // closes the other kind's bucket, so buckets are reduced in the order gradients arrive. Each
  // axis keeps its own buckets: under expert parallelism the data-parallel ranks release
  // different experts (those their replicas' tokens chose), and a data-parallel bucket closed by
  // one would be another bucket on a rank that released none.
  const bool experts = partition_->group(group).experts;
  const ReduceKind other =
      kind == ReduceKind::kPartitioned ? ReduceKind::kReplicated : ReduceKind::kPartitioned;
  if (auto b = packer(experts, other).flush()) {
    STRATA_RETURN_IF_ERROR(issue_reduce(other, std::move(*b)));
  }
  for (Bucket& b : packer(experts, kind).add(group, partition_->group(group).local_elems())) {
    STRATA_RETURN_IF_ERROR(issue_reduce(kind, std::move(b)));
  }
  return Status::ok();
}

// Packs a bucket (rank block r: every piece's range of rank r's block) and starts its
// collective. One bucket is in flight at a time: the previous one finishes first (it had the
// backward of this bucket's layers to run, on the communication thread or the NCCL stream), so
// device memory holds at most one packed bucket beside the open bucket's gradients. Buffers are
// allocated before anything is packed or freed, so running out of memory leaves every gradient
// where it was. A bucket that is one whole group reduces that group's own buffer, as an
// unbucketed reduction would.
//
// Every stage reduces partitioned groups with a reduce-scatter (each rank keeps its block only:
// stage 1's step reads no more), which sums the ranks in the canonical tree; replicated groups
// are all-gathered and summed here in that same tree (Ops::sum_blocks), so every rank holds the
// sum with the bits one rank's micro-batches would give it.
Status ZeroProvider::issue_reduce(ReduceKind kind, Bucket bucket) {
  while (!pending_reduces_.empty()) STRATA_RETURN_IF_ERROR(finish_one_reduce());
  const BucketPiece& first = bucket.pieces.front();
  const bool whole = bucket.whole_group();
  const bool scatter = kind == ReduceKind::kPartitioned;
  dist::Communicator& comm = comm_of(first.group);
  const auto world = static_cast<std::size_t>(comm.world_size());
  const std::size_t blocks = scatter ? world : 1;
  const auto count = static_cast<std::size_t>(bucket.block_elems);
  const std::string what = describe(bucket, "gradient");
  PendingReduce pending;
  pending.kind = kind;
  pending.comm = &comm;
  if (!whole) {
    STRATA_ASSIGN_OR_RETURN(pending.send, take(count * blocks * dsize_, "gradient bucket"));
  }
  // Where the collective delivers: this rank's reduced block (reduced_dtype), or every rank's
  // copy to sum (and with wide gradients, a bucket of several groups' f32 sums to unpack).
  const std::size_t rsize = dtype_size(reduced_dtype());
  const std::size_t recv_bytes = scatter ? (whole ? 0 : count * rsize) : count * world * dsize_;
  const std::size_t sum_bytes = !scatter && options_.wide_gradients && !whole ? count * 4 : 0;
  Status buffers = [&]() -> Status {
    if (recv_bytes != 0) {
      STRATA_ASSIGN_OR_RETURN(pending.recv,
                              take(recv_bytes, scatter ? "gradient bucket (reduced)"
                                                       : "gradient bucket (every rank's)"));
    }
    if (sum_bytes != 0) {
      STRATA_ASSIGN_OR_RETURN(pending.sum, take(sum_bytes, "gradient bucket (summed)"));
    }
    return Status::ok();
  }();
  if (!buffers.is_ok()) {
    give(pending.send);
    give(pending.recv);
    return buffers;
  }
  void* send = grad_sources_[static_cast<std::size_t>(first.group)].data;
  if (!whole) {
    send = pending.send.data;
    for (std::size_t r = 0; r < blocks; ++r) {
      for (const BucketPiece& piece : bucket.pieces) {
        const auto* src = static_cast<const std::byte*>(
            grad_sources_[static_cast<std::size_t>(piece.group)].data);
        const std::int64_t from =
            static_cast<std::int64_t>(r) * partition_->group(piece.group).local_elems() +
            piece.begin;
        const std::size_t to = r * count + static_cast<std::size_t>(piece.offset);
        copy(pending.send.bytes() + to * dsize_, src + static_cast<std::size_t>(from) * dsize_,
             piece.count);
      }
    }
    // A partitioned group whose last piece is packed needs its full gradient no longer: free it
    // now, so device memory holds the open bucket's gradients and packed buckets, not both.
    for (const BucketPiece& piece : bucket.pieces) {
      GradSource& src = grad_sources_[static_cast<std::size_t>(piece.group)];
      if (kind == ReduceKind::kPartitioned && piece.last) {
        give(src.full);
        src.data = nullptr;
      }
    }
  }
  const auto n = static_cast<std::int64_t>(count);
  const GradSource& head = grad_sources_[static_cast<std::size_t>(first.group)];
  if (!scatter) {
    pending.handle = comm.all_gather(send, pending.recv.data, n, options_.compute_dtype, what);
    // Where finish_one_reduce sums them: in place, or (wide) the group's f32 buffer or the
    // packed f32 sums.
    pending.result = !options_.wide_gradients ? send : (whole ? head.shard : pending.sum.data);
  } else {
    void* recv = whole ? head.shard : pending.recv.data;
    pending.handle = options_.wide_gradients
                         ? comm.reduce_scatter_wide(send, static_cast<float*>(recv), n,
                                                    options_.compute_dtype, what)
                         : comm.reduce_scatter(send, recv, n, options_.compute_dtype,
                                               dist::ReduceOp::kSum, what);
    pending.result = recv;
  }
  pending.bucket = std::move(bucket);
  pending_reduces_.push_back(std::move(pending));
  return Status::ok();
}

Status ZeroProvider::finish_one_reduce() {
  PendingReduce p = std::move(pending_reduces_.front());
  pending_reduces_.pop_front();
  Status st = p.handle.wait();
  if (st.is_ok() && p.kind == ReduceKind::kReplicated) {  // every rank's copy: their sum
    device_.ops().sum_blocks(p.recv.data, p.comm->world_size(), p.bucket.block_elems,
                             options_.compute_dtype, p.result, reduced_dtype());
  }
  if (st.is_ok()) st = unpack_reduce(p);
  give(p.send);
  give(p.recv);
  give(p.sum);
  return st;
}

Status ZeroProvider::unpack_reduce(const PendingReduce& p) {
  const bool whole = p.bucket.whole_group();
  const auto* result = static_cast<const std::byte*>(p.result);
  const DType rdtype = reduced_dtype();
  const std::size_t rsize = dtype_size(rdtype);
  for (const BucketPiece& piece : p.bucket.pieces) {
    GradSource& src = grad_sources_[static_cast<std::size_t>(piece.group)];
    // Into the model's buffer (a replicated group's, summed in place) or the shard store's.
    void* into =
        p.kind == ReduceKind::kReplicated && !options_.wide_gradients ? src.data : src.shard;
    if (!whole) {
      device_.ops().cast(
          result + static_cast<std::size_t>(piece.offset) * rsize, rdtype,
          static_cast<std::byte*>(into) + static_cast<std::size_t>(piece.begin) * rsize, rdtype,
          piece.count);
    }
    if (piece.last) {
      give(src.full);  // the full gradient's last piece is reduced
      src = GradSource{};
      STRATA_RETURN_IF_ERROR(shards_->grads().release(piece.group));
    }
  }
  return Status::ok();
}

Status ZeroProvider::finish_micro_batch() {
  for (const bool experts : {false, true}) {
    for (ReduceKind kind : {ReduceKind::kReplicated, ReduceKind::kPartitioned}) {
      if (auto b = packer(experts, kind).flush()) {
        STRATA_RETURN_IF_ERROR(issue_reduce(kind, std::move(*b)));
      }
    }
  }
  while (!pending_reduces_.empty()) STRATA_RETURN_IF_ERROR(finish_one_reduce());
  return schedule_->finish_micro_batch();
}

Result<double> ZeroProvider::grad_norm() {
  STRATA_ASSIGN_OR_RETURN(const std::vector<ExactSum> sums, schedule_->grad_sums_of_squares());
  // Every chunk of every gradient (core/dtype.h's chunks, which shard boundaries never cut) is
  // one term of an exact sum: what each rank holds, then over the data, tensor and pipeline
  // ranks, with the same bits whatever the number of ranks on each axis.
  ExactSum total;
  for (const auto& p : partition_->groups()) {
    // A replicated group's gradient is the same on every rank of its axis: count it once. (An
    // expert's group is empty on the data-parallel ranks not holding that expert.)
    const int rank = p.experts ? expert_data_.rank() : comm_.rank();
    if (!p.replicated || rank == 0) total += sums.at(static_cast<std::size_t>(p.group));
  }
  std::array<double, ExactSum::kDoubles> limbs{};
  total.to_doubles(limbs.data());
  const auto sum_over = [&](dist::Communicator& axis, const char* what) {
    if (axis.world_size() == 1) return Status::ok();
    return axis.all_reduce_host(limbs.data(), ExactSum::kDoubles, dist::ReduceOp::kSum, what);
  };
  STRATA_RETURN_IF_ERROR(sum_over(comm_, "gradient norm"));
  // Each tensor-parallel rank's slices (its duplicates already left out).
  STRATA_RETURN_IF_ERROR(sum_over(tensor_, "gradient norm (tensor)"));
  STRATA_RETURN_IF_ERROR(sum_over(pipeline_, "gradient norm (pipeline)"));
  return std::sqrt(ExactSum::from_doubles(limbs.data()).value());
}

Status ZeroProvider::zero_grads() { return schedule_->zero_grads(); }

Status ZeroProvider::step(double lr, std::int64_t step, float grad_scale) {
  STRATA_RETURN_IF_ERROR(schedule_->step(lr, step, grad_scale));
  return refresh_replicated_params();
}

Status ZeroProvider::gather_master(int group, float* full_out, const StateSnapshot& from) {
  const GroupPartition& p = partition_->group(group);
  dist::Communicator* snapshot = p.experts ? from.expert_comm : from.comm;
  dist::Communicator& comm = snapshot != nullptr ? *snapshot : comm_of(group);
  STRATA_CHECK(comm.rank() != 0 || full_out != nullptr,
               "gather_master: rank 0 of the gather must receive the group", group);
  std::vector<float> local(static_cast<std::size_t>(p.local_elems()));
  // The held state is the saved step's: a step running now is training's, not waited for.
  if (!from.held) STRATA_RETURN_IF_ERROR(schedule_->finish_step());
  STRATA_RETURN_IF_ERROR(shards_->read_master(group, local.data(), from.held));
  if (p.replicated) {
    if (comm.rank() == 0) std::memcpy(full_out, local.data(), local.size() * sizeof(float));
    return Status::ok();
  }
  std::vector<float> all(comm.rank() == 0 ? static_cast<std::size_t>(p.padded_elems) : 0);
  STRATA_RETURN_IF_ERROR(comm.gather_host(local.data(), all.data(), p.shard_elems, DType::kF32, 0,
                                          "master weights of " + full_.group(group).name));
  if (comm.rank() == 0) {
    std::memcpy(full_out, all.data(), static_cast<std::size_t>(p.full_elems) * sizeof(float));
  }
  return Status::ok();
}

Status ZeroProvider::read_moment_slice(int group, float* exp_avg, float* exp_avg_sq,
                                       const StateSnapshot& from) {
  if (!from.held) STRATA_RETURN_IF_ERROR(schedule_->finish_step());
  const GroupPartition& p = partition_->group(group);
  if (!p.replicated) return shards_->state().read_moments(group, exp_avg, exp_avg_sq, from.held);
  std::vector<float> m(static_cast<std::size_t>(p.padded_elems), 0.0f), v(m.size(), 0.0f);
  STRATA_RETURN_IF_ERROR(shards_->state().read_moments(group, m.data(), v.data(), from.held));
  const auto off = static_cast<std::size_t>(p.shard_offset);
  const auto n = static_cast<std::size_t>(p.shard_elems);
  std::memcpy(exp_avg, m.data() + off, n * sizeof(float));
  std::memcpy(exp_avg_sq, v.data() + off, n * sizeof(float));
  return Status::ok();
}

Status ZeroProvider::hold_state() {
  STRATA_RETURN_IF_ERROR(schedule_->finish_step());
  shards_->state().hold();
  return Status::ok();
}

void ZeroProvider::release_state() { shards_->state().release(); }

Status ZeroProvider::load_moments(const MomentRangeReader& read_range) {
  STRATA_RETURN_IF_ERROR(schedule_->finish_step());
  for (const auto& p : partition_->groups()) {
    if (full_.group(p.group).frozen) continue;  // no optimizer state
    const std::int64_t begin = p.replicated ? 0 : p.shard_offset;
    const std::int64_t count = p.local_elems();
    std::vector<float> m(static_cast<std::size_t>(count), 0.0f), v(m.size(), 0.0f);
    const std::int64_t real = std::max<std::int64_t>(0, std::min(count, p.full_elems - begin));
    if (real > 0) STRATA_RETURN_IF_ERROR(read_range(p.group, begin, real, m.data(), v.data()));
    STRATA_RETURN_IF_ERROR(shards_->state().write_moments(p.group, m.data(), v.data()));
  }
  return Status::ok();
}

RankStats ZeroProvider::stats() const {
  RankStats s = stats_;
  s += shards_->stats();
  s += schedule_->stats();
  return s;
}

}  // namespace strata::zero
