// ShardStore: the rooms of a rank's share made in one tiered store, and what spans them.
#include "strata/zero/shard_store.h"

#include <algorithm>
#include <utility>

namespace strata::zero {

PlanOptions plan_options(const ShardOptions& options, std::uint64_t device_budget_bytes,
                         bool has_swap, bool host_addressable_device) {
  PlanOptions po;
  po.params = options.offload_param;
  po.optimizer = options.offload_optimizer;
  po.offload_fraction = options.offload_optimizer_fraction;
  po.compute_dtype = options.compute_dtype;
  po.state_dtype = options.adam.state_dtype;
  po.master_dtype = options.adam.master_dtype;
  po.master_rounding = options.adam.master_rounding;
  po.accumulation_steps = options.accumulation_steps;
  po.tree_sums = options.tree_sums;
  po.device_budget_bytes = device_budget_bytes;
  po.host_budget_bytes = options.host_memory_limit_bytes;
  po.activation_bytes = options.activation_bytes;
  po.host_io_bytes = options.host_io_bytes;
  po.num_checkpoints = options.num_checkpoints;
  po.checkpoint_bytes = options.checkpoint_bytes;
  po.checkpoint_home = options.checkpoint_home;
  po.sub_group_size = options.sub_group_size;
  po.has_swap = has_swap;
  po.host_addressable_device = host_addressable_device;
  po.tied_embeddings = options.tied_embeddings;
  po.swap_free_bytes = options.swap_free_bytes;
  po.overlap = options.overlap;
  po.grad_accumulation = options.grad_accumulation;
  po.hold_state = options.hold_state;
  return po;
}

namespace {

// RankStats' counters (summed and subtracted) and peaks (the larger kept).
constexpr std::uint64_t RankStats::*kCounts[] = {
    &RankStats::h2d_bytes,         &RankStats::d2h_bytes,     &RankStats::nvme_read_bytes,
    &RankStats::nvme_write_bytes,  &RankStats::steps_guessed, &RankStats::steps_redone,
    &RankStats::steps_rolled_back, &RankStats::gathers_ahead, &RankStats::gathers_ahead_refused};
constexpr double RankStats::*kTimes[] = {
    &RankStats::wait_ms, &RankStats::stall_ms, &RankStats::optimizer_total_ms,
    &RankStats::optimizer_exposed_ms, &RankStats::optimizer_device_ms};
constexpr std::uint64_t RankStats::*kPeaks[] = {&RankStats::host_bytes, &RankStats::nvme_bytes};

}  // namespace

RankStats& RankStats::operator+=(const RankStats& o) {
  for (auto m : kCounts) this->*m += o.*m;
  for (auto m : kTimes) this->*m += o.*m;
  for (auto m : kPeaks) this->*m = std::max(this->*m, o.*m);
  return *this;
}

RankStats RankStats::since(const RankStats& before) const {
  RankStats d = *this;  // the peaks are the run's so far
  for (auto m : kCounts) d.*m -= before.*m;
  for (auto m : kTimes) d.*m -= before.*m;
  return d;
}

ShardStore::ShardStore(const model::ParamLayout& layout, device::Device& device,
                       io::SwapSpace* swap, const ShardOptions& options, const MemoryPlan& plan)
    : device_(device),
      swap_(swap),
      options_(options),
      plan_(plan),
      groups_(shard_groups(layout, options.compute_dtype)) {}

ShardStore::~ShardStore() {
  if (store_) store_->drain();  // the store owns every buffer; its transfers end first
}

Result<std::unique_ptr<ShardStore>> ShardStore::create(const model::ParamLayout& layout,
                                                       device::Device& device, io::SwapSpace* swap,
                                                       const ShardOptions& options,
                                                       const MemoryPlan& plan) {
  std::unique_ptr<ShardStore> s(new ShardStore(layout, device, swap, options, plan));
  STRATA_RETURN_IF_ERROR(s->create_rooms());
  return s;
}

bool ShardStore::trains() const {
  return std::any_of(groups_.begin(), groups_.end(),
                     [](const ShardGroup& g) { return !g.frozen(); });
}

std::int64_t ShardStore::max_group_elems() const {
  std::int64_t max_n = 0;
  for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
    const ShardGroup& g = groups_[gi];
    if (!g.frozen() && !plan_.steps_on_device(gi)) max_n = std::max(max_n, g.n);
  }
  return max_n;
}

Status ShardStore::create_rooms() {
  // Gradients accumulated and summed, and working copies converted, in host memory: on as many
  // cores as the host optimizer, whose step never runs at the same time as an accumulation of
  // the same group.
  device::HostArrayOptions ho;
  ho.threads = options_.cpu_adam.threads;
  ho.simd = options_.cpu_adam.simd;
  STRATA_ASSIGN_OR_RETURN(device::HostArrays arrays, device::HostArrays::create(ho));
  host_arrays_.emplace(std::move(arrays));

  mem::StoreOptions so;
  // Everything on the device is the store's (the model's workspace and ZeRO's buffers are its
  // scratch) except what the device took for itself before (a CUDA backend's cuBLAS workspace).
  const device::MemoryStats dev = device_.memory_stats();
  if (dev.limit_bytes != 0) {
    so.budget_bytes[static_cast<int>(Tier::kDevice)] =
        std::max<std::uint64_t>(1, dev.limit_bytes - std::min(dev.limit_bytes, dev.in_use_bytes));
  }
  // The whole host budget: the store's staging pool holds the optimizer's sub-group slots too.
  so.budget_bytes[static_cast<int>(Tier::kHost)] = options_.host_memory_limit_bytes;
  so.staging_buffer_bytes = plan_.staging_buffer_bytes;
  so.num_staging_buffers = plan_.num_staging_buffers;
  so.range_io_bytes = plan_.optimizer_staging_bytes;
  so.timeline = options_.timeline;
  STRATA_ASSIGN_OR_RETURN(store_, mem::TieredStore::create(device_, swap_, so));

  WorkingCopyOptions wo;
  wo.home = plan_.params;
  wo.trained_home = plan_.trained_params;
  wo.device_homed = plan_.device_steps;
  wo.compute_dtype = options_.compute_dtype;
  wo.host_budget = options_.host_memory_limit_bytes != 0;
  wo.prefetch_bytes = options_.prefetch_bytes;
  wo.max_live_bytes = options_.max_live_bytes;
  wo.max_reuse_distance = options_.max_reuse_distance;
  wo.timeline = options_.timeline;
  STRATA_ASSIGN_OR_RETURN(params_, WorkingCopies::create(*store_, groups_, *host_arrays_, wo));
  STRATA_ASSIGN_OR_RETURN(
      state_, OptimizerState::create(*store_, groups_, *host_arrays_, options_.adam, plan_,
                                     options_.shard_offsets));
  STRATA_ASSIGN_OR_RETURN(grads_,
                          GradientLanding::create(*store_, groups_, *host_arrays_, device_, plan_,
                                                  plan_.gradient_dtype, options_.timeline));
  scratch_ = std::make_unique<ScratchSpace>(*store_, plan_.checkpoints);
  store_seen_ = store_->stats();
  absorb_store_stats();
  return Status::ok();
}

void ShardStore::absorb_store_stats() {
  const mem::StoreStats now = store_->stats();
  auto moved = [&](Tier from, Tier to) {
    const int f = static_cast<int>(from), t = static_cast<int>(to);
    return now.bytes_moved[f][t] - store_seen_.bytes_moved[f][t];
  };
  const Tier d = Tier::kDevice, h = Tier::kHost, n = Tier::kNvme;
  // NVMe <-> device moves pass through host staging: they count on both legs.
  stats_.h2d_bytes += moved(h, d) + moved(n, d);
  stats_.d2h_bytes += moved(d, h) + moved(d, n);
  stats_.nvme_read_bytes += moved(n, h) + moved(n, d);
  stats_.nvme_write_bytes += moved(h, n) + moved(d, n);
  stats_.stall_ms += now.stall_ms - store_seen_.stall_ms;
  stats_.host_bytes = now.peak_bytes[static_cast<int>(h)];
  stats_.nvme_bytes = now.peak_bytes[static_cast<int>(n)];
  store_seen_ = now;
}

RankStats ShardStore::stats() const {
  RankStats s = stats_;
  s.wait_ms += params_->wait_ms();
  return s;
}

Result<void*> ShardStore::acquire_grads(int group, model::GradientWrite write) {
  params_->backward_began();
  return grads_->acquire(group, write);
}

Status ShardStore::finish_micro_batch() {
  Status first = grads_->finish_micro_batch();
  params_->end_pass();
  // Between passes the trained groups' copies are dropped and the freed blocks go back to the
  // device; a frozen base's copies stay while there is room (nothing rewrites them).
  if (trains()) store_->trim_device_cache();
  absorb_store_stats();
  STRATA_RETURN_IF_ERROR(first);
  return device_.last_error();
}

Status ShardStore::load_master(const model::GroupSource& source, WorkingCopyCache* cache,
                               const model::GroupRangeSource& frozen_pieces) {
  for (int gi = 0; gi < num_groups(); ++gi) {
    const ShardGroup& g = groups_[static_cast<std::size_t>(gi)];
    if (g.empty()) continue;  // another stage's
    Status s = g.frozen() ? params_->load_frozen(gi, source, cache, frozen_pieces, writebacks_)
                          : state_->load(gi, source, *params_, writebacks_);
    if (Status w = wait_all(*store_, writebacks_); s.is_ok()) s = w;
    STRATA_RETURN_IF_ERROR(s);
  }
  grads_->clear();
  // The host copies loading passed through are not made again in training: give them back.
  store_->trim_host_cache();
  absorb_store_stats();
  return device_.last_error();
}

Status ShardStore::read_master(int group, float* dst, bool held) {
  const ShardGroup& g = groups_.at(static_cast<std::size_t>(group));
  if (g.empty()) return Status::ok();  // another stage's: nothing here
  // A frozen group's weights are its working copy, widened (NF4 tensors decoded).
  return g.frozen() ? params_->read(group, dst) : state_->read_master(group, dst, held);
}

Status ShardStore::restore_working_copies(const std::vector<bool>& groups) {
  Status s;
  for (int gi = 0; gi < num_groups() && s.is_ok(); ++gi) {
    if (groups[static_cast<std::size_t>(gi)]) {
      s = state_->restore_working_copy(gi, *params_, writebacks_);
    }
  }
  if (Status w = wait_all(*store_, writebacks_); s.is_ok()) s = w;
  absorb_store_stats();  // the restored copies' transfers
  return s;
}

void ShardStore::end_step(bool commit) {
  grads_->clear();
  if (commit) state_->commit();
}

}  // namespace strata::zero
