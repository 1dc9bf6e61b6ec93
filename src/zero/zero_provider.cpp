// ZeroProvider: all-gather before use, reduce-scatter after backward, cross-rank norms.
#include "strata/zero/zero_provider.h"

#include <cmath>
#include <cstring>

namespace strata::zero {

ZeroProvider::ZeroProvider(const model::ParamLayout& full, const Partition& partition,
                           OffloadEngine& engine, dist::Communicator& comm, device::Device& device,
                           ZeroOptions options)
    : full_(full),
      partition_(partition),
      engine_(engine),
      comm_(comm),
      device_(device),
      options_(options),
      dsize_(dtype_size(options.compute_dtype)) {
  full_params_.resize(static_cast<std::size_t>(full.num_groups()));
  param_refs_.assign(static_cast<std::size_t>(full.num_groups()), 0);
  full_grads_.resize(static_cast<std::size_t>(full.num_groups()));
  engine_grads_.assign(static_cast<std::size_t>(full.num_groups()), nullptr);
  gathers_.resize(static_cast<std::size_t>(full.num_groups()));
  gathering_.assign(static_cast<std::size_t>(full.num_groups()), false);
}

ZeroProvider::~ZeroProvider() = default;

Status ZeroProvider::load_master(const model::GroupSource& full_source) {
  std::vector<float> tmp;
  STRATA_RETURN_IF_ERROR(engine_.load_master([&](const model::ParamGroup& local, float* dst) {
    const GroupPartition& p = partition_.group(local.id);
    tmp.assign(static_cast<std::size_t>(p.padded_elems), 0.0f);
    STRATA_RETURN_IF_ERROR(full_source(full_.group(local.id), tmp.data()));
    const std::int64_t begin = p.replicated ? 0 : p.shard_offset;
    std::memcpy(dst, tmp.data() + begin, static_cast<std::size_t>(p.local_elems()) * sizeof(float));
    return Status::ok();
  }));
  return refresh_replicated_params();
}

Status ZeroProvider::refresh_replicated_params() {
  if (options_.stage >= 3) return Status::ok();
  for (const auto& p : partition_.groups()) {
    if (p.replicated) continue;
    auto& full = full_params_[static_cast<std::size_t>(p.group)];
    if (full.empty()) {
      STRATA_ASSIGN_OR_RETURN(
          full, device_.allocate(static_cast<std::size_t>(p.padded_elems) * dsize_,
                                 "replicated parameters of " + full_.group(p.group).name));
    }
    STRATA_ASSIGN_OR_RETURN(const void* shard, engine_.acquire_params(p.group));
    Status s = comm_
                   .all_gather(shard, full.data(), p.shard_elems, options_.compute_dtype,
                               "parameters of " + full_.group(p.group).name)
                   .wait();
    engine_.release_params(p.group);
    STRATA_RETURN_IF_ERROR(s);
  }
  return Status::ok();
}

Status ZeroProvider::start_gather(int group) {
  const GroupPartition& p = partition_.group(group);
  const auto gi = static_cast<std::size_t>(group);
  STRATA_ASSIGN_OR_RETURN(full_params_[gi],
                          device_.allocate(static_cast<std::size_t>(p.padded_elems) * dsize_,
                                           "gathered parameters of " + full_.group(group).name));
  auto shard = engine_.acquire_params(group);
  if (!shard.is_ok()) {
    full_params_[gi].reset();
    return shard.status();
  }
  gathers_[gi] =
      comm_.all_gather(*shard, full_params_[gi].data(), p.shard_elems, options_.compute_dtype,
                       "parameters of " + full_.group(group).name);
  gathering_[gi] = true;
  return Status::ok();
}

Status ZeroProvider::finish_gather(int group) {
  const auto gi = static_cast<std::size_t>(group);
  Status s = gathers_[gi].wait();
  gathering_[gi] = false;
  engine_.release_params(group);  // the shard is no longer needed once gathered
  if (!s.is_ok()) full_params_[gi].reset();
  return s;
}

Result<const void*> ZeroProvider::acquire_params(int group) {
  if (!partitioned(group)) return engine_.acquire_params(group);
  const auto gi = static_cast<std::size_t>(group);
  if (options_.stage < 3) return static_cast<const void*>(full_params_[gi].data());
  if (param_refs_[gi] > 0) {
    ++param_refs_[gi];
    return static_cast<const void*>(full_params_[gi].data());
  }
  if (!gathering_[gi]) STRATA_RETURN_IF_ERROR(start_gather(group));
  STRATA_RETURN_IF_ERROR(finish_gather(group));
  ++param_refs_[gi];
  return static_cast<const void*>(full_params_[gi].data());
}

void ZeroProvider::release_params(int group) {
  if (!partitioned(group)) return engine_.release_params(group);
  if (options_.stage < 3) return;
  const auto gi = static_cast<std::size_t>(group);
  STRATA_CHECK(param_refs_[gi] > 0, "release_params without acquire", group);
  if (--param_refs_[gi] == 0) full_params_[gi].reset();
}

void ZeroProvider::prefetch_params(int group) {
  if (!partitioned(group) || options_.stage < 3) {
    if (!partitioned(group)) engine_.prefetch_params(group);
    return;
  }
  const auto gi = static_cast<std::size_t>(group);
  if (param_refs_[gi] > 0 || gathering_[gi]) return;
  if (!options_.gather_ahead) {
    engine_.prefetch_params(group);  // start the shard's slow fetch; gather at acquire
    return;
  }
  // Start the all-gather now so it runs while the current layer computes. A prefetch is only a
  // hint: without room on the device, acquire gathers on demand. Every rank has the same budget
  // and allocation pattern, so all ranks make the same choice and issue collectives in the
  // same order, as MPI and NCCL require.
  if (!start_gather(group).is_ok()) full_params_[gi].reset();
}

Result<void*> ZeroProvider::acquire_grads(int group) {
  if (!partitioned(group)) {
    STRATA_ASSIGN_OR_RETURN(void* buf, engine_.acquire_grads(group));
    engine_grads_[static_cast<std::size_t>(group)] = buf;
    return buf;
  }
  const GroupPartition& p = partition_.group(group);
  const auto gi = static_cast<std::size_t>(group);
  STRATA_ASSIGN_OR_RETURN(full_grads_[gi],
                          device_.allocate(static_cast<std::size_t>(p.padded_elems) * dsize_,
                                           "full gradient of " + full_.group(group).name));
  device_.fill_zero(full_grads_[gi].data(), full_grads_[gi].size(),
                    device_.stream(device::StreamKind::kCompute));
  return full_grads_[gi].data();
}

Status ZeroProvider::release_grads(int group) {
  const std::string what = "gradient of " + full_.group(group).name;
  PendingReduce pending;
  pending.group = group;
  if (!partitioned(group)) {
    if (comm_.world_size() == 1) return engine_.release_grads(group);
    void* buf = engine_grads_[static_cast<std::size_t>(group)];
    pending.handle = comm_.all_reduce(buf, buf, partition_.group(group).full_elems,
                                      options_.compute_dtype, dist::ReduceOp::kSum, what);
  } else {
    const GroupPartition& p = partition_.group(group);
    pending.full = std::move(full_grads_[static_cast<std::size_t>(group)]);
    STRATA_ASSIGN_OR_RETURN(void* shard, engine_.acquire_grads(group));
    if (options_.stage == 1) {
      // Stage 1 keeps full gradients on every rank: all-reduce, then keep this rank's slice.
      pending.handle = comm_.all_reduce(pending.full.data(), pending.full.data(), p.padded_elems,
                                        options_.compute_dtype, dist::ReduceOp::kSum, what);
      pending.slice_into = shard;
    } else {
      pending.handle = comm_.reduce_scatter(pending.full.data(), shard, p.shard_elems,
                                            options_.compute_dtype, dist::ReduceOp::kSum, what);
    }
  }
  // The reduction runs while the previous layer's backward computes; keep one in flight.
  pending_reduces_.push_back(std::move(pending));
  while (pending_reduces_.size() > 1) STRATA_RETURN_IF_ERROR(finish_one_reduce());
  return Status::ok();
}

Status ZeroProvider::finish_one_reduce() {
  PendingReduce p = std::move(pending_reduces_.front());
  pending_reduces_.pop_front();
  STRATA_RETURN_IF_ERROR(p.handle.wait());
  if (p.slice_into != nullptr) {
    const GroupPartition& gp = partition_.group(p.group);
    const auto* slice = static_cast<const std::byte*>(p.full.data()) +
                        static_cast<std::size_t>(gp.shard_offset) * dsize_;
    device_.ops().add(p.slice_into, slice, p.slice_into, gp.shard_elems, options_.compute_dtype);
  }
  p.full.reset();
  return engine_.release_grads(p.group);
}

Status ZeroProvider::finish_micro_batch() {
  while (!pending_reduces_.empty()) STRATA_RETURN_IF_ERROR(finish_one_reduce());
  return engine_.finish_micro_batch();
}

Result<double> ZeroProvider::grad_norm() {
  STRATA_RETURN_IF_ERROR(finish_micro_batch());
  double sum = 0;
  for (const auto& p : partition_.groups()) {
    STRATA_ASSIGN_OR_RETURN(double s, engine_.grad_sum_squares(p.group));
    // A replicated group's gradient is the same on every rank: count it once.
    if (!p.replicated || comm_.rank() == 0) sum += s;
  }
  if (comm_.world_size() > 1) {
    STRATA_RETURN_IF_ERROR(comm_.all_reduce_host(&sum, 1, dist::ReduceOp::kSum, "gradient norm"));
  }
  return std::sqrt(sum);
}

Status ZeroProvider::step(double lr, std::int64_t step, float grad_scale) {
  STRATA_RETURN_IF_ERROR(engine_.step(lr, step, grad_scale));
  return refresh_replicated_params();
}

Status ZeroProvider::gather_master(int group, float* full_out) {
  const GroupPartition& p = partition_.group(group);
  std::vector<float> local(static_cast<std::size_t>(p.local_elems()));
  STRATA_RETURN_IF_ERROR(engine_.read_master(group, local.data()));
  if (p.replicated) {
    if (comm_.rank() == 0) std::memcpy(full_out, local.data(), local.size() * sizeof(float));
    return Status::ok();
  }
  std::vector<float> all(comm_.rank() == 0 ? static_cast<std::size_t>(p.padded_elems) : 0);
  STRATA_RETURN_IF_ERROR(comm_.gather_host(local.data(), all.data(), p.shard_elems, DType::kF32, 0,
                                           "master weights of " + full_.group(group).name));
  if (comm_.rank() == 0) {
    std::memcpy(full_out, all.data(), static_cast<std::size_t>(p.full_elems) * sizeof(float));
  }
  return Status::ok();
}

Status ZeroProvider::read_moment_slice(int group, float* exp_avg, float* exp_avg_sq) {
  const GroupPartition& p = partition_.group(group);
  if (!p.replicated) return engine_.read_moments(group, exp_avg, exp_avg_sq);
  std::vector<float> m(static_cast<std::size_t>(p.padded_elems), 0.0f), v(m.size(), 0.0f);
  STRATA_RETURN_IF_ERROR(engine_.read_moments(group, m.data(), v.data()));
  const auto off = static_cast<std::size_t>(p.shard_offset);
  const auto n = static_cast<std::size_t>(p.shard_elems);
  std::memcpy(exp_avg, m.data() + off, n * sizeof(float));
  std::memcpy(exp_avg_sq, v.data() + off, n * sizeof(float));
  return Status::ok();
}

Status ZeroProvider::load_moments(const MomentRangeReader& read_range) {
  for (const auto& p : partition_.groups()) {
    const std::int64_t begin = p.replicated ? 0 : p.shard_offset;
    const std::int64_t count = p.local_elems();
    std::vector<float> m(static_cast<std::size_t>(count), 0.0f), v(m.size(), 0.0f);
    const std::int64_t real = std::max<std::int64_t>(0, std::min(count, p.full_elems - begin));
    if (real > 0) STRATA_RETURN_IF_ERROR(read_range(p.group, begin, real, m.data(), v.data()));
    STRATA_RETURN_IF_ERROR(engine_.write_moments(p.group, m.data(), v.data()));
  }
  return Status::ok();
}

}  // namespace strata::zero
