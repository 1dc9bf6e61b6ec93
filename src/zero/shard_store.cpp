// ShardStore: every tensor of every group in the tiered store where the plan puts it; the
// model's parameter and gradient requests; scratch; the state in and out.
#include "strata/zero/shard_store.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "strata/core/clock.h"
#include "strata/device/adam8bit.h"
#include "strata/device/nf4.h"

namespace strata::zero {

struct ShardStore::Group {
  const model::ParamGroup* spec = nullptr;
  std::int64_t n = 0;
  // Elements [dup_begin, n): tensor-parallel duplicates, left out of the norm this rank counts.
  std::int64_t dup_begin = 0;
  std::size_t work_bytes = 0;  // model::working_bytes: n * compute dtype size unless quantized
  std::size_t f32_bytes = 0;
  std::size_t moment_bytes = 0;              // one moment's, as optim::moment_layout says
  std::size_t master_bytes = 0;              // the master weights', as optim::master_layout says
  mem::Handle work = mem::Handle::kInvalid;  // the working copy, in the compute dtype
  mem::Handle master = mem::Handle::kInvalid;
  mem::Handle exp_avg = mem::Handle::kInvalid;
  mem::Handle exp_avg_sq = mem::Handle::kInvalid;
  // The shadow state (plan.shadow_state): what the next step writes; swapped with the above
  // when that step is done.
  mem::Handle master_next = mem::Handle::kInvalid;
  mem::Handle exp_avg_next = mem::Handle::kInvalid;
  mem::Handle exp_avg_sq_next = mem::Handle::kInvalid;
  // The third copy (plan.held_copy): where a held state is set aside while steps alternate
  // between the two above (hold_state).
  mem::Handle master_spare = mem::Handle::kInvalid;
  mem::Handle exp_avg_spare = mem::Handle::kInvalid;
  mem::Handle exp_avg_sq_spare = mem::Handle::kInvalid;
  // Kept gradients (plan.keep_gradients): the gradient itself, homed where the plan keeps
  // gradients. Otherwise this micro-batch's gradient in transit (a transient tensor), added
  // into `grad_acc`, the fp32 accumulator.
  mem::Handle grad = mem::Handle::kInvalid;
  mem::Handle grad_acc = mem::Handle::kInvalid;
  void* grad_d = nullptr;      // the gradient's device copy while the model accumulates into it
  bool has_grad = false;       // a gradient arrived since the last step
  double sum_squares = 0;      // of the gradient as accumulated so far, when summed off the device
  double dup_sum_squares = 0;  // the same of its duplicates
  std::int64_t span_begin_ns = 0;
  bool frozen() const { return spec->frozen; }  // a working copy only
};

PlanOptions plan_options(const ShardOptions& options, std::uint64_t device_budget_bytes,
                         bool has_swap, bool host_addressable_device) {
  PlanOptions po;
  po.params = options.offload_param;
  po.optimizer = options.offload_optimizer;
  po.compute_dtype = options.compute_dtype;
  po.state_dtype = options.adam.state_dtype;
  po.master_dtype = options.adam.master_dtype;
  po.master_rounding = options.adam.master_rounding;
  po.accumulation_steps = options.accumulation_steps;
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
constexpr double RankStats::*kTimes[] = {&RankStats::wait_ms, &RankStats::stall_ms,
                                         &RankStats::optimizer_total_ms,
                                         &RankStats::optimizer_exposed_ms};
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
    : layout_(layout),
      device_(device),
      swap_(swap),
      options_(options),
      plan_(plan),
      master_layout_(optim::master_layout(options.adam.master_dtype, options.adam.master_rounding)),
      moment_layout_(optim::moment_layout(options.adam.state_dtype)) {}

ShardStore::~ShardStore() {
  if (store_) store_->drain();  // the store owns every buffer; its transfers end first
}

Result<std::unique_ptr<ShardStore>> ShardStore::create(const model::ParamLayout& layout,
                                                       device::Device& device, io::SwapSpace* swap,
                                                       const ShardOptions& options,
                                                       const MemoryPlan& plan) {
  std::unique_ptr<ShardStore> s(new ShardStore(layout, device, swap, options, plan));
  STRATA_RETURN_IF_ERROR(s->create_store());
  return s;
}

std::int64_t ShardStore::max_group_elems() const {
  std::int64_t max_n = 0;
  for (const auto& spec : layout_.groups()) {
    if (!spec.frozen) max_n = std::max(max_n, spec.num_elems);
  }
  return max_n;
}

Status ShardStore::create_store() {
  const Tier opt = plan_.optimizer;
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

  // Where device sums of squares land: on a device that addresses host memory, straight in the
  // host copy; else in device scratch, copied to the host copy when read.
  // Both stay pinned for the store's life.
  mem::TensorSpec ns;
  ns.name = "gradient sums of squares";
  ns.size_bytes = gradient_norm_bytes(layout_.groups().size());
  ns.transient = true;
  STRATA_ASSIGN_OR_RETURN(const mem::Handle norms, store_->add(ns));
  STRATA_ASSIGN_OR_RETURN(void* norms_host, store_->emplace(norms, Tier::kHost, true));
  norms_host_ = static_cast<double*>(norms_host);
  norm_slots_ = norms_host_;
  if (!device_.host_addressable()) {
    ns.name = "gradient sums of squares (device)";
    ns.scratch = true;
    STRATA_ASSIGN_OR_RETURN(const mem::Handle device_norms, store_->add(ns));
    STRATA_ASSIGN_OR_RETURN(void* slots, store_->emplace(device_norms, Tier::kDevice, true));
    norm_slots_ = static_cast<double*>(slots);
  }

  const auto add = [&](const std::string& name, std::size_t bytes, Tier home,
                       bool transient = false) -> Result<mem::Handle> {
    mem::TensorSpec spec;
    spec.name = name;
    spec.size_bytes = bytes;
    spec.home = home;
    spec.transient = transient;
    spec.home_initialized = false;  // load_master writes it, or the first gradient
    return store_->add(spec);
  };
  for (const auto& spec : layout_.groups()) {
    auto g = std::make_unique<Group>();
    g->spec = &spec;
    g->n = spec.num_elems;
    g->dup_begin = spec.duplicate_begin < 0 ? spec.num_elems : spec.duplicate_begin;
    g->work_bytes = model::working_bytes(spec, options_.compute_dtype);
    g->f32_bytes = static_cast<std::size_t>(g->n) * sizeof(float);
    g->moment_bytes = moment_layout_.bytes(g->n);
    g->master_bytes = master_layout_.bytes(g->n);
    const std::string& name = spec.name;
    // A group another pipeline stage holds has no elements here, and no tensors: nothing asks
    // for them, and the loops over every group pass it by.
    if (g->n == 0) {
      groups_.push_back(std::move(g));
      continue;
    }
    STRATA_ASSIGN_OR_RETURN(g->work, add("parameters of " + name, g->work_bytes, plan_.params));
    if (spec.frozen) {  // a working copy only: no gradient, no optimizer state
      groups_.push_back(std::move(g));
      continue;
    }
    STRATA_ASSIGN_OR_RETURN(g->master, add("master weights of " + name, g->master_bytes, opt));
    STRATA_ASSIGN_OR_RETURN(g->exp_avg, add("exp_avg of " + name, g->moment_bytes, opt));
    STRATA_ASSIGN_OR_RETURN(g->exp_avg_sq, add("exp_avg_sq of " + name, g->moment_bytes, opt));
    if (plan_.shadow_state) {
      STRATA_ASSIGN_OR_RETURN(g->master_next,
                              add("master weights of " + name + " (shadow)", g->master_bytes, opt));
      STRATA_ASSIGN_OR_RETURN(g->exp_avg_next,
                              add("exp_avg of " + name + " (shadow)", g->moment_bytes, opt));
      STRATA_ASSIGN_OR_RETURN(g->exp_avg_sq_next,
                              add("exp_avg_sq of " + name + " (shadow)", g->moment_bytes, opt));
    }
    if (plan_.held_copy) {
      STRATA_ASSIGN_OR_RETURN(
          g->master_spare, add("master weights of " + name + " (for saves)", g->master_bytes, opt));
      STRATA_ASSIGN_OR_RETURN(g->exp_avg_spare,
                              add("exp_avg of " + name + " (for saves)", g->moment_bytes, opt));
      STRATA_ASSIGN_OR_RETURN(g->exp_avg_sq_spare,
                              add("exp_avg_sq of " + name + " (for saves)", g->moment_bytes, opt));
    }
    if (plan_.keep_gradients) {
      STRATA_ASSIGN_OR_RETURN(g->grad, add("gradient of " + name, g->work_bytes, plan_.gradients));
    } else {
      STRATA_ASSIGN_OR_RETURN(g->grad,
                              add("gradient of " + name, g->work_bytes, Tier::kHost, true));
      STRATA_ASSIGN_OR_RETURN(
          g->grad_acc, add("gradient accumulator of " + name, g->f32_bytes, plan_.gradients));
    }
    groups_.push_back(std::move(g));
  }
  if (plan_.sums_on_device() && options_.compute_dtype != DType::kF32) {
    STRATA_ASSIGN_OR_RETURN(
        widened_grad_,
        add("widened gradient", static_cast<std::size_t>(max_group_elems()) * sizeof(float),
            Tier::kDevice));
  }
  if (plan_.params != Tier::kDevice) {
    sched::PrefetchOptions po;
    po.prefetch_bytes = options_.prefetch_bytes;
    po.max_live_bytes = options_.max_live_bytes;
    po.max_reuse_distance = options_.max_reuse_distance;
    // Working copies nobody rewrites (every group frozen) stay on the device between passes.
    po.release_at_pass_end = trains();
    // While an overlapped step runs, a working copy is fetched ahead (from the trace or a hint)
    // only once it is updated.
    std::unordered_map<std::uint32_t, int> group_of_work;
    for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
      if (groups_[gi]->n == 0) continue;
      group_of_work[mem::handle_index(groups_[gi]->work)] = static_cast<int>(gi);
    }
    po.may_prefetch = [this, group_of_work = std::move(group_of_work)](mem::Handle h) {
      return view_ == nullptr || view_->update_done(group_of_work.at(mem::handle_index(h)));
    };
    sched_ = std::make_unique<sched::PrefetchScheduler>(*store_, po);
  }
  store_seen_ = store_->stats();
  absorb_store_stats();
  return Status::ok();
}

std::uint64_t ShardStore::acquire_device_bytes(int group) const {
  if (plan_.params == Tier::kDevice) return 0;
  return store_->device_bytes(groups_.at(static_cast<std::size_t>(group))->work);
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

mem::StoreStats ShardStore::store_stats() const { return store_->stats(); }

sched::SchedulerStats ShardStore::prefetch_stats() const {
  return sched_ ? sched_->stats() : sched::SchedulerStats{};
}

void ShardStore::end_compute_span(Group& g) {
  if (options_.timeline == nullptr || g.span_begin_ns == 0) return;
  options_.timeline->add(mem::Lane::kCompute, g.spec->name + (backward_ ? " backward" : " forward"),
                         g.span_begin_ns, now_ns());
  g.span_begin_ns = 0;
}

// ---- parameters ----

void ShardStore::prefetch_params(int group) {
  if (!sched_) return;
  sched_->hint(groups_.at(static_cast<std::size_t>(group))->work);
}

Result<const void*> ShardStore::acquire_params(int group) {
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  Stopwatch wait;
  auto p = sched_ ? sched_->acquire(g.work) : store_->acquire(g.work, Tier::kDevice);
  stats_.wait_ms += wait.elapsed_ms();  // the store's own counters are read once a pass
  if (!p.is_ok()) return p.status();
  g.span_begin_ns = now_ns();
  return static_cast<const void*>(*p);
}

void ShardStore::release_params(int group) {
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  end_compute_span(g);
  if (sched_) {
    sched_->release(g.work);
  } else {
    store_->unpin(g.work, Tier::kDevice);
  }
}

// ---- gradients ----

Result<void*> ShardStore::acquire_grads(int group) {
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  STRATA_CHECK(!g.frozen(), "gradient of a frozen group (ZeroProvider refuses it)", g.spec->name);
  STRATA_CHECK(g.grad_d == nullptr, "acquire_grads twice without release", g.spec->name);
  if (plan_.keep_gradients && g.has_grad) {
    return failed_precondition("a second gradient of '" + g.spec->name +
                               "' before the optimizer step, but the plan keeps one gradient "
                               "per step (accumulation_steps 1)");
  }
  backward_ = true;
  STRATA_ASSIGN_OR_RETURN(g.grad_d, store_->emplace(g.grad, Tier::kDevice, /*zero_fill=*/true));
  return g.grad_d;
}

Status ShardStore::release_grads(int group) {
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  STRATA_CHECK(g.grad_d != nullptr, "release_grads without acquire", g.spec->name);
  void* src = std::exchange(g.grad_d, nullptr);
  const DType dtype = options_.compute_dtype;
  if (plan_.sums_on_device()) {
    // Accumulate on the device, in fp32.
    const auto& ops = device_.ops();
    STRATA_ASSIGN_OR_RETURN(void* acc, g.has_grad
                                           ? store_->acquire(g.grad_acc, Tier::kDevice)
                                           : store_->emplace(g.grad_acc, Tier::kDevice, true));
    if (dtype != DType::kF32) {
      STRATA_ASSIGN_OR_RETURN(void* wide, store_->emplace(widened_grad_, Tier::kDevice, false));
      ops.cast(src, dtype, wide, DType::kF32, g.n);
      src = wide;
    }
    ops.add(acc, src, acc, g.n, DType::kF32);
    // A guessed update will read (and may discard) the final sum before the global norm is
    // taken: its sum of squares is taken now, while it is here.
    const bool final_for_guess = plan_.optimizer != Tier::kDevice && guessing();
    if (final_for_guess) device_sum_squares(acc, DType::kF32, static_cast<std::size_t>(group));
    if (dtype != DType::kF32) store_->unpin(widened_grad_, Tier::kDevice);
    store_->mark_dirty(g.grad_acc, Tier::kDevice);
    store_->unpin(g.grad_acc, Tier::kDevice);
    store_->unpin(g.grad, Tier::kDevice);
    g.has_grad = true;
    STRATA_RETURN_IF_ERROR(store_->discard(g.grad));
    if (!final_for_guess) return Status::ok();
    // The last micro-batch, with a guessed update running: the sum is final, and goes to host
    // memory for the update while the next layer's backward runs.
    STRATA_ASSIGN_OR_RETURN(mem::Completion sent, store_->fetch(g.grad_acc, Tier::kHost));
    pending_grads_.push_back(PendingGrad{group, std::move(sent)});
    while (pending_grads_.size() > 1) STRATA_RETURN_IF_ERROR(drain_one_grad());
    return Status::ok();
  }
  if (plan_.keep_gradients) {
    // The gradient is final: summed here, while on the device, then off to where the plan
    // keeps gradients on the copy streams while the next layer's backward runs.
    device_sum_squares(src, dtype, static_cast<std::size_t>(group));
    g.has_grad = true;
  }
  // Off the device while the next layer's backward runs: home (kept), to the host for a
  // guessed update to read it there (kept, guessing), or to the host to be accumulated.
  store_->unpin(g.grad, Tier::kDevice);
  const bool to_host = plan_.keep_gradients && guessing();
  STRATA_ASSIGN_OR_RETURN(mem::Completion done, to_host ? store_->fetch(g.grad, Tier::kHost)
                                                        : store_->evict(g.grad, Tier::kDevice));
  pending_grads_.push_back(PendingGrad{group, std::move(done)});
  // Keep at most one transfer behind the compute: its copy is the store's to budget.
  while (pending_grads_.size() > 1) STRATA_RETURN_IF_ERROR(drain_one_grad());
  return Status::ok();
}

Status ShardStore::drain_one_grad() {
  PendingGrad p = std::move(pending_grads_.front());
  pending_grads_.pop_front();
  Group& g = *groups_[static_cast<std::size_t>(p.group)];
  Status s = store_->wait(p.done);
  if (plan_.accumulate_on_device()) {  // a final sum, now in host memory for the guessed update
    if (s.is_ok()) view_->gradient_final(p.group);
    return s;
  }
  if (plan_.keep_gradients) {
    if (!s.is_ok() || !guessing()) return s;  // it is home
    // Its host copy is valid: the device copy goes (written home first if the store dropped
    // the host copy meanwhile), and the guessed update may have it.
    STRATA_ASSIGN_OR_RETURN(mem::Completion home, store_->evict(g.grad, Tier::kDevice));
    writebacks_.push_back(std::move(home));
    view_->gradient_final(p.group);
    return Status::ok();
  }
  if (!s.is_ok()) {
    store_->discard(g.grad).ignore();
    return s;
  }
  // acc (its host copy: the home, or fetched from it, or fresh on the first micro-batch)
  // += the gradient's host copy.
  STRATA_ASSIGN_OR_RETURN(void* host, store_->acquire(g.grad, Tier::kHost));
  const std::int64_t t0 = now_ns();
  auto acc = g.has_grad ? store_->acquire(g.grad_acc, Tier::kHost)
                        : store_->emplace(g.grad_acc, Tier::kHost, /*zero_fill=*/false);
  if (!acc.is_ok()) {
    store_->unpin(g.grad, Tier::kHost);
    store_->discard(g.grad).ignore();
    return acc.status();
  }
  g.sum_squares = host_arrays_->accumulate(static_cast<float*>(*acc), host, options_.compute_dtype,
                                           g.n, !g.has_grad);
  g.dup_sum_squares = g.dup_begin < g.n
                          ? host_arrays_->sum_squares(static_cast<float*>(*acc) + g.dup_begin,
                                                      DType::kF32, g.n - g.dup_begin)
                          : 0.0;
  g.has_grad = true;
  store_->mark_dirty(g.grad_acc, Tier::kHost);
  store_->unpin(g.grad_acc, Tier::kHost);
  if (options_.timeline != nullptr) {
    options_.timeline->add(mem::Lane::kCompute, "accumulate " + g.spec->name + " gradient", t0,
                           now_ns());
  }
  store_->unpin(g.grad, Tier::kHost);
  STRATA_RETURN_IF_ERROR(store_->discard(g.grad));
  if (guessing()) {  // final: the guessed update reads the host copy
    view_->gradient_final(p.group);
  } else if (plan_.gradients != Tier::kHost) {  // back to its home (NVMe) while compute goes on
    STRATA_ASSIGN_OR_RETURN(mem::Completion home, store_->evict(g.grad_acc, Tier::kHost));
    writebacks_.push_back(std::move(home));
  }
  return Status::ok();
}

Status ShardStore::wait_writebacks() {
  Status first;
  for (const mem::Completion& c : writebacks_) {
    Status s = store_->wait(c);
    if (!s.is_ok() && first.is_ok()) first = s;
  }
  writebacks_.clear();
  return first;
}

Status ShardStore::finish_micro_batch() {
  Status first;
  while (!pending_grads_.empty()) {
    Status s = drain_one_grad();
    if (!s.is_ok() && first.is_ok()) first = s;
  }
  if (Status s = wait_writebacks(); !s.is_ok() && first.is_ok()) first = s;
  if (guessing()) {
    // Backward is over: every gradient is final, zeros where none came.
    if (Status s = give_zero_grads(); !s.is_ok() && first.is_ok()) first = s;
    for (int gi = 0; gi < num_groups(); ++gi) view_->gradient_final(gi);
  }
  // The end of a pass: the scheduler settles its prefetches and drops what it kept, since the
  // optimizer may rewrite the working copies before the next pass. Between passes the store
  // then holds nothing on the device that the model might need. With every group frozen
  // nothing rewrites them: they stay for the next pass while there is room.
  if (sched_) sched_->end_pass();
  if (trains()) store_->trim_device_cache();
  backward_ = false;
  absorb_store_stats();
  STRATA_RETURN_IF_ERROR(first);
  return device_.last_error();
}

void ShardStore::device_sum_squares(const void* x, DType dtype, std::size_t group) {
  const Group& g = *groups_[group];
  device_.ops().sum_squares(x, g.n, dtype, norm_slots_ + group);
  if (g.dup_begin < g.n) {
    device_.ops().sum_squares(static_cast<const std::byte*>(x) +
                                  static_cast<std::size_t>(g.dup_begin) * dtype_size(dtype),
                              g.n - g.dup_begin, dtype, norm_slots_ + groups_.size() + group);
  }
}

Result<std::vector<double>> ShardStore::grad_sums_of_squares() {
  STRATA_CHECK(pending_grads_.empty(), "gradient norm before finish_micro_batch");
  // Where the sums are is the plan's: taken on the device when the gradients are accumulated
  // there (summed now) or kept (summed as each left the device), else on the host as they were
  // accumulated.
  const bool summed_on_device = plan_.sums_on_device();
  const bool on_device = summed_on_device || plan_.keep_gradients;
  bool any = false;
  for (std::size_t i = 0; i < groups_.size(); ++i) {
    Group& g = *groups_[i];
    any |= g.has_grad;
    if (!g.has_grad || !summed_on_device) continue;
    if (plan_.accumulate_on_device() && guessing()) continue;  // summed already
    STRATA_ASSIGN_OR_RETURN(void* acc, store_->acquire(g.grad_acc, Tier::kDevice));
    device_sum_squares(acc, DType::kF32, i);
    store_->unpin(g.grad_acc, Tier::kDevice);
  }
  if (on_device && any) {
    device::Stream& compute = device_.stream(device::StreamKind::kCompute);
    if (norm_slots_ != norms_host_) {
      device_.copy_to_host(norms_host_, norm_slots_, 2 * groups_.size() * sizeof(double), compute);
    }
    compute.synchronize();
    // A failed sum (its launch, or a fault before it) is the error, not a stale number.
    STRATA_RETURN_IF_ERROR(device_.last_error());
  }
  // What this rank counts: each gradient's sum less its duplicates' (summed apart, so kept
  // from going below zero by rounding; NaN and infinity stay, for the step to be skipped).
  std::vector<double> sums(groups_.size(), 0.0);
  const double* host = norms_host_;
  const std::size_t dups = groups_.size();
  for (std::size_t i = 0; i < groups_.size(); ++i) {
    const Group& g = *groups_[i];
    if (!g.has_grad) continue;
    const double whole = on_device ? host[i] : g.sum_squares;
    const double dup = g.dup_begin >= g.n ? 0.0 : on_device ? host[dups + i] : g.dup_sum_squares;
    const double counted = whole - dup;
    sums[i] = counted < 0 ? 0.0 : counted;  // a non-finite sum stays what it is
  }
  return sums;
}

void ShardStore::clear_grads() {
  for (auto& g : groups_) {
    g->has_grad = false;
    g->sum_squares = 0;
    g->dup_sum_squares = 0;
  }
}

Status ShardStore::give_zero_grads() {
  for (std::size_t i = 0; i < groups_.size(); ++i) {
    Group& g = *groups_[i];
    if (g.has_grad || g.frozen() || g.n == 0) continue;
    STRATA_RETURN_IF_ERROR(store_->fill_zero(step_grad(static_cast<int>(i))));
    // Its sum of squares, where kept gradients' and guessed device sums' are.
    if (plan_.keep_gradients || (plan_.accumulate_on_device() && guessing())) {
      for (std::size_t slot : {i, groups_.size() + i}) {
        device_.fill_zero(norm_slots_ + slot, sizeof(double),
                          device_.stream(device::StreamKind::kCompute));
      }
    }
    g.has_grad = true;
  }
  return Status::ok();
}

Status ShardStore::send_sums_to_host() {
  if (!plan_.accumulate_on_device()) return Status::ok();
  for (const auto& g : groups_) {
    if (!g->frozen() && g->n > 0) {
      STRATA_RETURN_IF_ERROR(store_->fetch(g->grad_acc, Tier::kHost).status());
    }
  }
  return Status::ok();
}

mem::Handle ShardStore::step_grad(int group) const {
  const Group& g = *groups_.at(static_cast<std::size_t>(group));
  return plan_.keep_gradients ? g.grad : g.grad_acc;
}

DType ShardStore::step_grad_dtype() const {
  return plan_.keep_gradients ? options_.compute_dtype : DType::kF32;
}

std::vector<StepGroup> ShardStore::step_groups(std::vector<int>* ids) const {
  std::vector<StepGroup> groups;
  ids->clear();
  for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
    const Group& g = *groups_[gi];
    if (g.frozen() || g.n == 0) continue;
    ids->push_back(static_cast<int>(gi));
    StepGroup sg;
    sg.name = g.spec->name;
    sg.num_elems = g.n;
    sg.id = static_cast<int>(gi);
    sg.element_offset = gi < options_.shard_offsets.size()
                            ? static_cast<std::uint64_t>(options_.shard_offsets[gi])
                            : 0;
    sg.master = g.master;
    sg.exp_avg = g.exp_avg;
    sg.exp_avg_sq = g.exp_avg_sq;
    sg.grad = step_grad(static_cast<int>(gi));
    if (plan_.shadow_state) {
      sg.master_out = g.master_next;
      sg.exp_avg_out = g.exp_avg_next;
      sg.exp_avg_sq_out = g.exp_avg_sq_next;
    }
    groups.push_back(std::move(sg));
  }
  return groups;
}

void ShardStore::end_step(bool commit) {
  clear_grads();
  if (!commit || !plan_.shadow_state) return;
  std::lock_guard lock(held_mu_);  // a save's thread may be reading the held copy's handles
  for (auto& g : groups_) {        // the step is done: its state is the state
    std::swap(g->master, g->master_next);
    std::swap(g->exp_avg, g->exp_avg_next);
    std::swap(g->exp_avg_sq, g->exp_avg_sq_next);
  }
  if (held_ && !held_is_spare_) {  // the held copy is the shadow now: set it aside
    for (auto& g : groups_) {
      std::swap(g->master_next, g->master_spare);
      std::swap(g->exp_avg_next, g->exp_avg_spare);
      std::swap(g->exp_avg_sq_next, g->exp_avg_sq_spare);
    }
    held_is_spare_ = true;
  }
}

void ShardStore::hold_state() {
  STRATA_CHECK(plan_.held_copy, "hold_state needs the plan's held copy (hold_state option)");
  std::lock_guard lock(held_mu_);
  STRATA_CHECK(!held_, "the state is already held");
  held_ = true;
  held_is_spare_ = false;
}

void ShardStore::release_state() {
  std::lock_guard lock(held_mu_);
  held_ = false;
}

// ---- working copies the optimizer writes ----

Result<void*> ShardStore::open_output(int group, Tier tier) {
  // The output replaces every copy: the home itself when it lives on `tier`.
  return store_->emplace(groups_.at(static_cast<std::size_t>(group))->work, tier,
                         /*zero_fill=*/false);
}

void ShardStore::abandon_output(int group, Tier tier) {
  store_->unpin(groups_.at(static_cast<std::size_t>(group))->work, tier);
}

Status ShardStore::close_output(int group, Tier tier, std::vector<mem::Completion>& writebacks,
                                bool keep_host_copy) {
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  store_->mark_dirty(g.work, tier);
  store_->unpin(g.work, tier);
  const Tier home = store_->spec(g.work).home;
  if (home == tier) return Status::ok();
  // Home on the copy streams (NVMe, or the device) while the next group is updated. Under a
  // host budget a step's host copy on its way to NVMe stays as a clean copy, so the next forward
  // can take it from host memory while the budget has room (clean copies go first when room is
  // needed). Without one it goes: parameters on NVMe must not fill the host unbounded.
  const bool keep = keep_host_copy && home == Tier::kNvme && tier == Tier::kHost &&
                    options_.host_memory_limit_bytes != 0;
  STRATA_ASSIGN_OR_RETURN(mem::Completion done,
                          keep ? store_->fetch(g.work, Tier::kNvme) : store_->evict(g.work, tier));
  writebacks.push_back(std::move(done));
  return Status::ok();
}

Status ShardStore::restore_working_copies(const std::vector<bool>& groups) {
  Status s;
  for (std::size_t gi = 0; gi < groups_.size() && s.is_ok(); ++gi) {
    if (!groups[gi]) continue;
    Group& g = *groups_[gi];
    auto master = store_->acquire(g.master, Tier::kHost);
    s = master.status();
    if (!master.is_ok()) break;
    s = write_working_copy(static_cast<int>(gi), widened_master(g, *master));
    store_->unpin(g.master, Tier::kHost);
  }
  if (Status w = wait_writebacks(); s.is_ok()) s = w;
  absorb_store_stats();  // the restored copies' transfers
  return s;
}

const float* ShardStore::widened_master(const Group& g, const void* master) {
  if (options_.adam.master_dtype == DType::kF32) return static_cast<const float*>(master);
  wide_master_.resize(static_cast<std::size_t>(g.n));
  master_to_f32(master, wide_master_.data(), g.n);
  return wide_master_.data();
}

void ShardStore::master_to_f32(const void* stored, float* dst, std::int64_t n) {
  host_arrays_->convert(stored, options_.adam.master_dtype, dst, DType::kF32, n);
  if (!master_layout_.has_aux()) return;
  // Kahan: each weight is the pair's f32 sum.
  const auto* comp = reinterpret_cast<const bf16*>(static_cast<const std::byte*>(stored) +
                                                   master_layout_.aux_offset(n));
  for (std::int64_t i = 0; i < n; ++i) dst[i] += bf16_to_f32(comp[i]);
}

void ShardStore::master_from_f32(const float* src, void* stored, std::int64_t n) {
  // bf16: rounded to nearest (a loaded or resumed weight; steps round as master_rounding says).
  host_arrays_->convert(src, DType::kF32, stored, options_.adam.master_dtype, n);
  if (!master_layout_.has_aux()) return;
  // Kahan: what rounding dropped, rounded toward zero, so the pair sums back to src's split.
  const auto* hi = static_cast<const bf16*>(stored);
  auto* comp =
      reinterpret_cast<bf16*>(static_cast<std::byte*>(stored) + master_layout_.aux_offset(n));
  for (std::int64_t i = 0; i < n; ++i)
    comp[i] = f32_to_bf16_toward_zero(src[i] - bf16_to_f32(hi[i]));
}

void ShardStore::moment_to_f32(const void* stored, bool second, float* dst, std::int64_t n) {
  const DType sd = options_.adam.state_dtype;
  if (sd != device::kAdam8StateDType) {
    host_arrays_->convert(stored, sd, dst, DType::kF32, n);
    return;
  }
  const auto* codes = static_cast<const std::uint8_t*>(stored);
  const auto* scales = reinterpret_cast<const float*>(codes + moment_layout_.aux_offset(n));
  device::adam8_dequantize_array(codes, scales, n, second, dst);
}

void ShardStore::moment_from_f32(const float* src, bool second, void* stored, std::int64_t n) {
  const DType sd = options_.adam.state_dtype;
  if (sd != device::kAdam8StateDType) {
    host_arrays_->convert(src, DType::kF32, stored, sd, n);
    return;
  }
  auto* codes = static_cast<std::uint8_t*>(stored);
  auto* scales = reinterpret_cast<float*>(codes + moment_layout_.aux_offset(n));
  device::adam8_quantize_array(src, n, second, codes, scales);
}

Status ShardStore::write_working_copy(int group, const float* master) {
  STRATA_ASSIGN_OR_RETURN(void* out, open_output(group, Tier::kHost));
  if (Status s = fill_working_copy(group, master, out); !s.is_ok()) {
    abandon_output(group, Tier::kHost);
    return s;
  }
  return close_output(group, Tier::kHost, writebacks_);
}

Status ShardStore::fill_working_copy(int group, const float* master, void* out) {
  const std::int64_t n = groups_[static_cast<std::size_t>(group)]->n;
  return fill_working_copy(
      group,
      [master](std::int64_t begin, std::int64_t) -> Result<const float*> { return master + begin; },
      n, out);
}

Status ShardStore::fill_working_copy(int group, const Fp32Pieces& values, std::int64_t piece_elems,
                                     void* out) {
  const Group& g = *groups_[static_cast<std::size_t>(group)];
  const DType dtype = options_.compute_dtype;
  const std::size_t dsize = dtype_size(dtype);
  // Elements [begin, begin + count) of the group converted to `at`, a piece at a time.
  const auto convert = [&](std::int64_t begin, std::int64_t count, std::byte* at) -> Status {
    for (std::int64_t k = 0; k < count; k += piece_elems) {
      const std::int64_t m = std::min(piece_elems, count - k);
      STRATA_ASSIGN_OR_RETURN(const float* v, values(begin + k, m));
      host_arrays_->convert(v, DType::kF32, at + static_cast<std::size_t>(k) * dsize, dtype, m);
    }
    return Status::ok();
  };
  if (!g.spec->quantized()) return convert(0, g.n, static_cast<std::byte*>(out));
  // Tensor by tensor: NF4 projections whole (their block maxima's mean is the tensor's) and
  // quantized, the rest converted; the gaps zero.
  std::memset(out, 0, g.work_bytes);
  for (const auto& t : g.spec->tensors) {
    auto* at = static_cast<std::byte*>(out) + model::working_offset(*g.spec, t, dtype);
    if (t.format != model::TensorFormat::kNf4) {
      STRATA_RETURN_IF_ERROR(convert(t.offset_elems, t.num_elems, at));
      continue;
    }
    STRATA_ASSIGN_OR_RETURN(const float* v, values(t.offset_elems, t.num_elems));
    STRATA_RETURN_IF_ERROR(device::nf4_quantize(v, t.num_elems, at, t.name.c_str()));
  }
  return Status::ok();
}

// ---- scratch ----

Result<ShardStore::Scratch> ShardStore::take(std::uint64_t bytes, const std::string& name,
                                             bool zero_fill) {
  std::vector<mem::Handle>& free = free_scratch_[{name, bytes}];
  Scratch s;
  if (free.empty()) {
    mem::TensorSpec spec;
    spec.name = name;
    spec.size_bytes = bytes;
    spec.scratch = true;
    STRATA_ASSIGN_OR_RETURN(s.h, store_->add(spec));
  } else {
    s.h = free.back();
    free.pop_back();
  }
  auto data = store_->emplace(s.h, Tier::kDevice, zero_fill);
  if (!data.is_ok()) {
    free.push_back(s.h);
    return data.status();
  }
  s.data = *data;
  return s;
}

Result<void*> ShardStore::host_io(std::uint64_t bytes, const std::string& what) {
  if (host_io_ != mem::Handle::kInvalid) {
    const mem::TensorSpec& spec = store_->spec(host_io_);
    if (spec.size_bytes == bytes && spec.name == what) return host_io_data_;
    store_->unpin(host_io_, Tier::kHost);
    STRATA_RETURN_IF_ERROR(store_->discard(host_io_));
    host_io_data_ = nullptr;
  }
  mem::TensorSpec spec;
  spec.name = what;
  spec.size_bytes = bytes;
  spec.transient = true;
  STRATA_ASSIGN_OR_RETURN(host_io_, store_->add(spec));
  STRATA_ASSIGN_OR_RETURN(host_io_data_, store_->emplace(host_io_, Tier::kHost, true));
  return host_io_data_;
}

Result<void*> ShardStore::write_activation(int index, std::uint64_t bytes) {
  STRATA_CHECK(index >= 0, "negative activation index", index);
  if (checkpoints_.size() <= static_cast<std::size_t>(index)) {
    checkpoints_.resize(static_cast<std::size_t>(index) + 1);
  }
  Checkpoint& c = checkpoints_[static_cast<std::size_t>(index)];
  if (c.held) STRATA_RETURN_IF_ERROR(release_activation(index, false));  // after a failed step
  if (c.h == mem::Handle::kInvalid || c.bytes != bytes) {
    // A transient tensor: no home; a copy of another shape, if any, holds nothing.
    if (c.h != mem::Handle::kInvalid) STRATA_RETURN_IF_ERROR(store_->discard(c.h));
    mem::TensorSpec spec;
    spec.name = "checkpointed activation " + std::to_string(index);
    spec.size_bytes = bytes;
    spec.transient = true;
    STRATA_ASSIGN_OR_RETURN(c.h, store_->add(spec));
    c.bytes = bytes;
  }
  STRATA_ASSIGN_OR_RETURN(void* p, store_->emplace(c.h, Tier::kDevice, /*zero_fill=*/false));
  c.held = c.writing = true;
  return p;
}

Result<const void*> ShardStore::read_activation(int index) {
  STRATA_CHECK(index >= 0 && static_cast<std::size_t>(index) < checkpoints_.size() &&
                   checkpoints_[static_cast<std::size_t>(index)].h != mem::Handle::kInvalid,
               "activation read before it was written", index);
  Checkpoint& c = checkpoints_[static_cast<std::size_t>(index)];
  STRATA_CHECK(!c.held, "activation read while held", index);
  STRATA_ASSIGN_OR_RETURN(void* p, store_->acquire(c.h, Tier::kDevice));
  c.held = true;
  c.writing = false;
  return static_cast<const void*>(p);
}

void ShardStore::prefetch_activation(int index) {
  if (index < 0 || static_cast<std::size_t>(index) >= checkpoints_.size()) return;
  const Checkpoint& c = checkpoints_[static_cast<std::size_t>(index)];
  if (c.h != mem::Handle::kInvalid && !c.held) (void)store_->try_prefetch(c.h, Tier::kDevice);
}

Status ShardStore::release_activation(int index, bool keep) {
  STRATA_CHECK(index >= 0 && static_cast<std::size_t>(index) < checkpoints_.size() &&
                   checkpoints_[static_cast<std::size_t>(index)].held,
               "activation released but not held", index);
  Checkpoint& c = checkpoints_[static_cast<std::size_t>(index)];
  if (c.writing) store_->mark_dirty(c.h, Tier::kDevice);
  store_->unpin(c.h, Tier::kDevice);
  c.held = false;
  if (!keep) return store_->discard(c.h);
  if (!c.writing || plan_.checkpoints == Tier::kDevice) return Status::ok();
  // Homed off the device: down to its tier now, behind the compute, which goes on (an error
  // shows at the read).
  return store_->evict(c.h, Tier::kDevice, plan_.checkpoints).status();
}

void ShardStore::give(Scratch& s) {
  if (!s.held()) return;
  store_->unpin(s.h, Tier::kDevice);
  (void)store_->discard(s.h);  // ok for an unpinned scratch tensor
  const mem::TensorSpec& spec = store_->spec(s.h);
  free_scratch_[{spec.name, spec.size_bytes}].push_back(s.h);
  s = Scratch{};
}

// ---- state in and out ----

Status ShardStore::load_master(const model::GroupSource& source, WorkingCopyCache* cache,
                               const model::GroupRangeSource& frozen_pieces) {
  std::vector<float> frozen_source;
  for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
    Group& g = *groups_[gi];
    const int id = static_cast<int>(gi);
    if (g.n == 0) continue;  // another stage's
    if (g.frozen()) {  // the working copy alone: from the cache, or made from the source's fp32
      STRATA_ASSIGN_OR_RETURN(void* out, open_output(id, Tier::kHost));
      Status s = [&]() -> Status {
        const bool cached = cache != nullptr && g.spec->quantized();
        if (cached) {
          STRATA_ASSIGN_OR_RETURN(const bool hit, cache->read(*g.spec, out, g.work_bytes));
          if (hit) return Status::ok();
        }
        if (frozen_pieces) {
          // 16 Mi elements (64 MiB of fp32) at a time beside the working copy.
          constexpr std::int64_t kPieceElems = std::int64_t{1} << 24;
          std::vector<float> piece;
          const Fp32Pieces from_source = [&](std::int64_t begin,
                                             std::int64_t count) -> Result<const float*> {
            piece.resize(static_cast<std::size_t>(count));
            STRATA_RETURN_IF_ERROR(frozen_pieces(*g.spec, begin, count, piece.data()));
            return static_cast<const float*>(piece.data());
          };
          STRATA_RETURN_IF_ERROR(fill_working_copy(id, from_source, kPieceElems, out));
        } else {
          frozen_source.assign(static_cast<std::size_t>(g.n), 0.0f);
          STRATA_RETURN_IF_ERROR(source(*g.spec, frozen_source.data()));
          STRATA_RETURN_IF_ERROR(fill_working_copy(id, frozen_source.data(), out));
        }
        return cached ? cache->write(*g.spec, out, g.work_bytes) : Status::ok();
      }();
      if (!s.is_ok()) {
        abandon_output(id, Tier::kHost);
        return s;
      }
      STRATA_RETURN_IF_ERROR(close_output(id, Tier::kHost, writebacks_));
      STRATA_RETURN_IF_ERROR(wait_writebacks());
      continue;
    }
    // The master weights' host copy (its home, or a fresh copy on its way home), filled by the
    // source; the working copy converted from it the same way.
    STRATA_ASSIGN_OR_RETURN(void* master, store_->emplace(g.master, Tier::kHost, true));
    Status s;
    if (options_.adam.master_dtype == DType::kF32) {
      s = source(*g.spec, static_cast<float*>(master));
    } else {
      // bf16 master weights: the source rounded to nearest (with Kahan, what that dropped kept
      // beside); the working copy is made from the values stored, as every step's is.
      std::vector<float> wide(static_cast<std::size_t>(g.n));
      s = source(*g.spec, wide.data());
      if (s.is_ok()) master_from_f32(wide.data(), master, g.n);
    }
    if (s.is_ok()) s = write_working_copy(static_cast<int>(gi), widened_master(g, master));
    store_->unpin(g.master, Tier::kHost);
    STRATA_RETURN_IF_ERROR(s);
    if (store_->spec(g.master).home != Tier::kHost) {
      STRATA_ASSIGN_OR_RETURN(mem::Completion done, store_->evict(g.master, Tier::kHost));
      writebacks_.push_back(std::move(done));
    }
    STRATA_RETURN_IF_ERROR(store_->fill_zero(g.exp_avg));
    STRATA_RETURN_IF_ERROR(store_->fill_zero(g.exp_avg_sq));
    STRATA_RETURN_IF_ERROR(wait_writebacks());
  }
  clear_grads();
  // The host copies loading passed through are not made again in training: give them back.
  store_->trim_host_cache();
  absorb_store_stats();
  return device_.last_error();
}

Status ShardStore::read_master(int group, float* dst, bool held) {
  const Group& g = *groups_.at(static_cast<std::size_t>(group));
  if (g.n == 0) return Status::ok();  // another stage's: nothing here
  if (!g.frozen()) {
    const mem::Handle master = state_handles(g, held)[0];
    if (options_.adam.master_dtype == DType::kF32) return store_->read(master, dst);
    std::vector<std::byte> stored(g.master_bytes);
    STRATA_RETURN_IF_ERROR(store_->read(master, stored.data()));
    master_to_f32(stored.data(), dst, g.n);
    return Status::ok();
  }
  // A frozen group's weights are its working copy, widened (NF4 tensors decoded).
  std::vector<std::byte> work(g.work_bytes);
  STRATA_RETURN_IF_ERROR(store_->read(g.work, work.data()));
  if (!g.spec->quantized()) {
    host_arrays_->convert(work.data(), options_.compute_dtype, dst, DType::kF32, g.n);
    return Status::ok();
  }
  std::fill_n(dst, g.n, 0.0f);
  for (const auto& t : g.spec->tensors) {
    const std::byte* at = work.data() + model::working_offset(*g.spec, t, options_.compute_dtype);
    if (t.format == model::TensorFormat::kNf4) {
      device::nf4_dequantize_reference(at, t.num_elems, dst + t.offset_elems);
    } else {
      host_arrays_->convert(at, options_.compute_dtype, dst + t.offset_elems, DType::kF32,
                            t.num_elems);
    }
  }
  return Status::ok();
}

Status ShardStore::read_moments(int group, float* exp_avg, float* exp_avg_sq, bool held) {
  const Group& g = *groups_.at(static_cast<std::size_t>(group));
  if (g.frozen() || g.n == 0) {  // no optimizer state (here): zeros, as before a first step
    std::fill_n(exp_avg, g.n, 0.0f);
    std::fill_n(exp_avg_sq, g.n, 0.0f);
    return Status::ok();
  }
  const auto h = state_handles(g, held);
  if (options_.adam.state_dtype == DType::kF32) {
    STRATA_RETURN_IF_ERROR(store_->read(h[1], exp_avg));
    return store_->read(h[2], exp_avg_sq);
  }
  // Compact moments: read as stored, widened (exactly: 8-bit ones decoded) for the caller.
  std::vector<std::byte> stored(g.moment_bytes);
  STRATA_RETURN_IF_ERROR(store_->read(h[1], stored.data()));
  moment_to_f32(stored.data(), false, exp_avg, g.n);
  STRATA_RETURN_IF_ERROR(store_->read(h[2], stored.data()));
  moment_to_f32(stored.data(), true, exp_avg_sq, g.n);
  return Status::ok();
}

std::array<mem::Handle, 3> ShardStore::state_handles(const Group& g, bool held) const {
  std::lock_guard lock(held_mu_);  // a commit swaps them on the training side
  STRATA_CHECK(!held || held_, "the held state is read but none is held", g.spec->name);
  if (held && held_is_spare_) return {g.master_spare, g.exp_avg_spare, g.exp_avg_sq_spare};
  return {g.master, g.exp_avg, g.exp_avg_sq};
}

Status ShardStore::write_moments(int group, const float* exp_avg, const float* exp_avg_sq) {
  const Group& g = *groups_.at(static_cast<std::size_t>(group));
  if (g.frozen() || g.n == 0) return Status::ok();  // no optimizer state (here) to set
  if (options_.adam.state_dtype == DType::kF32) {
    STRATA_RETURN_IF_ERROR(store_->write(g.exp_avg, exp_avg, g.f32_bytes));
    return store_->write(g.exp_avg_sq, exp_avg_sq, g.f32_bytes);
  }
  // Compact moments: rounded to bf16 (nearest, ties to even) or quantized to 8 bits (a block's
  // largest element exactly, so moments read from this store come back the same bytes).
  std::vector<std::byte> stored(g.moment_bytes);
  moment_from_f32(exp_avg, false, stored.data(), g.n);
  STRATA_RETURN_IF_ERROR(store_->write(g.exp_avg, stored.data(), g.moment_bytes));
  moment_from_f32(exp_avg_sq, true, stored.data(), g.n);
  return store_->write(g.exp_avg_sq, stored.data(), g.moment_bytes);
}

}  // namespace strata::zero
