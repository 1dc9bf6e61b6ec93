// OffloadEngine: every tensor of every group in the tiered store where the plan puts it; the
// model's parameter and gradient requests; the optimizer step in the tier the plan names.
#include "strata/zero/offload_engine.h"

#include <cmath>
#include <cstring>
#include <optional>
#include <utility>

#include "strata/core/clock.h"

namespace strata::zero {

struct OffloadEngine::Group {
  const model::ParamGroup* spec = nullptr;
  std::int64_t n = 0;
  std::size_t work_bytes = 0;  // n * compute dtype size
  std::size_t f32_bytes = 0;
  mem::Handle work = mem::Handle::kInvalid;  // the working copy, in the compute dtype
  mem::Handle master = mem::Handle::kInvalid;
  mem::Handle exp_avg = mem::Handle::kInvalid;
  mem::Handle exp_avg_sq = mem::Handle::kInvalid;
  // The shadow state (plan.shadow_state): what the next step writes; swapped with the above
  // when that step is done.
  mem::Handle master_next = mem::Handle::kInvalid;
  mem::Handle exp_avg_next = mem::Handle::kInvalid;
  mem::Handle exp_avg_sq_next = mem::Handle::kInvalid;
  // Kept gradients (plan.keep_gradients): the gradient itself, homed where the plan keeps
  // gradients. Otherwise this micro-batch's gradient in transit (a transient tensor), added
  // into `grad_acc`, the fp32 accumulator.
  mem::Handle grad = mem::Handle::kInvalid;
  mem::Handle grad_acc = mem::Handle::kInvalid;
  void* grad_d = nullptr;  // the gradient's device copy while the model accumulates into it
  bool has_grad = false;   // a gradient arrived since the last step
  double sum_squares = 0;  // of the gradient as accumulated so far, when summed off the device
  std::int64_t span_begin_ns = 0;
};

PlanOptions plan_options(const EngineOptions& options, std::uint64_t device_budget_bytes,
                         bool has_swap, bool host_addressable_device) {
  PlanOptions po;
  po.params = options.offload_param;
  po.optimizer = options.offload_optimizer;
  po.compute_dtype = options.compute_dtype;
  po.accumulation_steps = options.accumulation_steps;
  po.device_budget_bytes = device_budget_bytes;
  po.host_budget_bytes = options.host_memory_limit_bytes;
  po.activation_bytes = options.activation_bytes;
  po.sub_group_size = options.sub_group_size;
  po.has_swap = has_swap;
  po.host_addressable_device = host_addressable_device;
  po.tied_embeddings = options.tied_embeddings;
  po.swap_free_bytes = options.swap_free_bytes;
  po.overlap = options.overlap;
  po.grad_accumulation = options.grad_accumulation;
  return po;
}

OffloadEngine::OffloadEngine(const model::ParamLayout& layout, device::Device& device,
                             io::SwapSpace* swap, const EngineOptions& options, MemoryPlan plan)
    : layout_(layout),
      device_(device),
      swap_(swap),
      options_(options),
      plan_(std::move(plan)),
      schedule_(plan_.overlap) {
  if (plan_.measure_overlap) chooser_.emplace(plan_.overlap, options_.schedule_chooser);
}

OffloadEngine::~OffloadEngine() {
  (void)finish_step();          // its error, if nobody asked, was the run's to report
  if (store_) store_->drain();  // the store owns every buffer; its transfers end first
}

Result<std::unique_ptr<OffloadEngine>> OffloadEngine::create(const model::ParamLayout& layout,
                                                             device::Device& device,
                                                             io::SwapSpace* swap,
                                                             const EngineOptions& options) {
  STRATA_ASSIGN_OR_RETURN(
      MemoryPlan plan, make_plan(layout, plan_options(options, device.memory_stats().limit_bytes,
                                                      swap != nullptr, device.host_addressable())));
  std::unique_ptr<OffloadEngine> engine(
      new OffloadEngine(layout, device, swap, options, std::move(plan)));
  STRATA_RETURN_IF_ERROR(engine->create_store());
  return engine;
}

Status OffloadEngine::create_store() {
  const Tier opt = plan_.optimizer;
  std::int64_t max_n = 0;
  for (const auto& spec : layout_.groups()) max_n = std::max(max_n, spec.num_elems);
  OptimizerStepOptions oo;
  oo.cpu_adam = options_.cpu_adam;
  oo.sub_group_size = options_.sub_group_size;
  oo.max_group_elems = max_n;
  oo.stream_grads = plan_.gradients == Tier::kNvme;
  STRATA_ASSIGN_OR_RETURN(optimizer_, make_optimizer_step(opt, device_, swap_, oo));
  // Gradients accumulated and summed, and working copies converted, in host memory: on as many
  // cores as the host optimizer, whose step never runs at the same time as an accumulation of
  // the same group.
  device::HostArrayOptions ho;
  ho.threads = options_.cpu_adam.threads;
  ho.simd = options_.cpu_adam.simd;
  STRATA_ASSIGN_OR_RETURN(device::HostArrays arrays, device::HostArrays::create(ho));
  host_arrays_.emplace(std::move(arrays));

  // Where device sums of squares land: on a device that addresses host memory, straight in the
  // host buffer; else in device memory taken, like cuBLAS's workspace, before the store takes
  // the rest of the budget.
  const std::size_t norm_bytes = std::max<std::size_t>(1, layout_.groups().size()) * sizeof(double);
  STRATA_ASSIGN_OR_RETURN(norms_host_,
                          device_.allocate_pinned(norm_bytes, "gradient sums of squares"));
  norm_slots_ = norms_host_.as<double>();
  if (!device_.host_addressable()) {
    STRATA_ASSIGN_OR_RETURN(norms_, device_.allocate(norm_bytes, "gradient sums of squares"));
    norm_slots_ = norms_.as<double>();
  }

  mem::StoreOptions so;
  // Everything on the device is the store's (the model's workspace and ZeRO's buffers are its
  // scratch) except what the device took for itself before (a CUDA backend's cuBLAS workspace).
  const device::MemoryStats dev = device_.memory_stats();
  if (dev.limit_bytes != 0) {
    so.budget_bytes[static_cast<int>(Tier::kDevice)] =
        std::max<std::uint64_t>(1, dev.limit_bytes - std::min(dev.limit_bytes, dev.in_use_bytes));
  }
  // The optimizer's sub-group staging is its own (registered with io_uring, locked); the store
  // gets the rest of the host budget, which the plan showed is enough.
  const std::uint64_t limit = options_.host_memory_limit_bytes;
  if (limit != 0) {
    so.budget_bytes[static_cast<int>(Tier::kHost)] = limit - plan_.optimizer_staging_bytes;
  }
  so.staging_buffer_bytes = plan_.staging_buffer_bytes;
  so.num_staging_buffers = plan_.num_staging_buffers;
  so.timeline = options_.timeline;
  STRATA_ASSIGN_OR_RETURN(store_, mem::TieredStore::create(device_, swap_, so));

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
  const std::size_t dsize = dtype_size(options_.compute_dtype);
  for (const auto& spec : layout_.groups()) {
    auto g = std::make_unique<Group>();
    g->spec = &spec;
    g->n = spec.num_elems;
    g->work_bytes = static_cast<std::size_t>(g->n) * dsize;
    g->f32_bytes = static_cast<std::size_t>(g->n) * sizeof(float);
    const std::string& name = spec.name;
    STRATA_ASSIGN_OR_RETURN(g->work, add("parameters of " + name, g->work_bytes, plan_.params));
    STRATA_ASSIGN_OR_RETURN(g->master, add("master weights of " + name, g->f32_bytes, opt));
    STRATA_ASSIGN_OR_RETURN(g->exp_avg, add("exp_avg of " + name, g->f32_bytes, opt));
    STRATA_ASSIGN_OR_RETURN(g->exp_avg_sq, add("exp_avg_sq of " + name, g->f32_bytes, opt));
    if (plan_.shadow_state) {
      STRATA_ASSIGN_OR_RETURN(g->master_next,
                              add("master weights of " + name + " (shadow)", g->f32_bytes, opt));
      STRATA_ASSIGN_OR_RETURN(g->exp_avg_next,
                              add("exp_avg of " + name + " (shadow)", g->f32_bytes, opt));
      STRATA_ASSIGN_OR_RETURN(g->exp_avg_sq_next,
                              add("exp_avg_sq of " + name + " (shadow)", g->f32_bytes, opt));
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
        add("widened gradient", static_cast<std::size_t>(max_n) * sizeof(float), Tier::kDevice));
  }
  if (plan_.params != Tier::kDevice) {
    sched::PrefetchOptions po;
    po.prefetch_bytes = options_.prefetch_bytes;
    po.max_live_bytes = options_.max_live_bytes;
    po.max_reuse_distance = options_.max_reuse_distance;
    // While an overlapped step runs, a working copy is fetched ahead (from the trace or a hint)
    // only once it is updated.
    for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
      group_of_work_[mem::handle_index(groups_[gi]->work)] = gi;
    }
    po.may_prefetch = [this](mem::Handle h) {
      // A guessed update writes only groups whose backward is done.
      if (!step_thread_.joinable() || phase_ == Phase::kGuessing) return true;
      std::lock_guard lock(step_mu_);
      return static_cast<bool>(updated_[group_of_work_.at(mem::handle_index(h))]);
    };
    sched_ = std::make_unique<sched::PrefetchScheduler>(*store_, po);
  }
  store_seen_ = store_->stats();
  absorb_store_stats();
  return Status::ok();
}

std::uint64_t OffloadEngine::acquire_device_bytes(int group) const {
  if (plan_.params == Tier::kDevice) return 0;
  return store_->device_bytes(groups_.at(static_cast<std::size_t>(group))->work);
}

void OffloadEngine::absorb_store_stats() {
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
  stats_.host_bytes = plan_.optimizer_staging_bytes + now.peak_bytes[static_cast<int>(h)];
  stats_.nvme_bytes = now.peak_bytes[static_cast<int>(n)];
  store_seen_ = now;
}

mem::StoreStats OffloadEngine::store_stats() const { return store_->stats(); }

sched::SchedulerStats OffloadEngine::prefetch_stats() const {
  return sched_ ? sched_->stats() : sched::SchedulerStats{};
}

void OffloadEngine::end_compute_span(Group& g) {
  if (options_.timeline == nullptr || g.span_begin_ns == 0) return;
  options_.timeline->add(mem::Lane::kCompute, g.spec->name + (backward_ ? " backward" : " forward"),
                         g.span_begin_ns, now_ns());
  g.span_begin_ns = 0;
}

// ---- parameters ----

void OffloadEngine::prefetch_params(int group) {
  if (!sched_) return;
  sched_->hint(groups_.at(static_cast<std::size_t>(group))->work);
}

Result<const void*> OffloadEngine::acquire_params(int group) {
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  STRATA_RETURN_IF_ERROR(wait_update(group));
  Stopwatch wait;
  auto p = sched_ ? sched_->acquire(g.work) : store_->acquire(g.work, Tier::kDevice);
  stats_.wait_ms += wait.elapsed_ms();  // the store's own counters are read once a pass
  if (!p.is_ok()) return p.status();
  g.span_begin_ns = now_ns();
  return static_cast<const void*>(*p);
}

void OffloadEngine::release_params(int group) {
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  end_compute_span(g);
  if (sched_) {
    sched_->release(g.work);
  } else {
    store_->unpin(g.work, Tier::kDevice);
  }
}

// ---- gradients ----

Result<void*> OffloadEngine::acquire_grads(int group) {
  // The last step still reads its gradients; a guessed one starts with this step's first.
  if (phase_ != Phase::kGuessing) STRATA_RETURN_IF_ERROR(finish_step());
  if (std::exchange(armed_, false)) start_guess();
  Group& g = *groups_.at(static_cast<std::size_t>(group));
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

Status OffloadEngine::release_grads(int group) {
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
    const bool final_for_guess = plan_.optimizer != Tier::kDevice && phase_ == Phase::kGuessing;
    if (final_for_guess) ops.sum_squares(acc, g.n, DType::kF32, norm_slots_ + group);
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
    device_.ops().sum_squares(src, g.n, dtype, norm_slots_ + group);
    g.has_grad = true;
  }
  // Off the device while the next layer's backward runs: home (kept), to the host for a
  // guessed update to read it there (kept, guessing), or to the host to be accumulated.
  store_->unpin(g.grad, Tier::kDevice);
  const bool to_host = plan_.keep_gradients && phase_ == Phase::kGuessing;
  STRATA_ASSIGN_OR_RETURN(mem::Completion done, to_host ? store_->fetch(g.grad, Tier::kHost)
                                                        : store_->evict(g.grad, Tier::kDevice));
  pending_grads_.push_back(PendingGrad{group, std::move(done)});
  // Keep at most one transfer behind the compute: its copy is the store's to budget.
  while (pending_grads_.size() > 1) STRATA_RETURN_IF_ERROR(drain_one_grad());
  return Status::ok();
}

Status OffloadEngine::drain_one_grad() {
  PendingGrad p = std::move(pending_grads_.front());
  pending_grads_.pop_front();
  Group& g = *groups_[static_cast<std::size_t>(p.group)];
  Status s = store_->wait(p.done);
  if (plan_.accumulate_on_device()) {  // a final sum, now in host memory for the guessed update
    if (s.is_ok()) mark_final(static_cast<std::size_t>(p.group));
    return s;
  }
  if (plan_.keep_gradients) {
    if (!s.is_ok() || phase_ != Phase::kGuessing) return s;  // it is home
    // Its host copy is valid: the device copy goes (written home first if the store dropped
    // the host copy meanwhile), and the guessed update may have it.
    STRATA_ASSIGN_OR_RETURN(mem::Completion home, store_->evict(g.grad, Tier::kDevice));
    writebacks_.push_back(std::move(home));
    mark_final(static_cast<std::size_t>(p.group));
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
  g.has_grad = true;
  store_->mark_dirty(g.grad_acc, Tier::kHost);
  store_->unpin(g.grad_acc, Tier::kHost);
  if (options_.timeline != nullptr) {
    options_.timeline->add(mem::Lane::kCompute, "accumulate " + g.spec->name + " gradient", t0,
                           now_ns());
  }
  store_->unpin(g.grad, Tier::kHost);
  STRATA_RETURN_IF_ERROR(store_->discard(g.grad));
  if (phase_ == Phase::kGuessing) {  // final: the guessed update reads the host copy
    mark_final(static_cast<std::size_t>(p.group));
  } else if (plan_.gradients != Tier::kHost) {  // back to its home (NVMe) while compute goes on
    STRATA_ASSIGN_OR_RETURN(mem::Completion home, store_->evict(g.grad_acc, Tier::kHost));
    writebacks_.push_back(std::move(home));
  }
  return Status::ok();
}

Status OffloadEngine::wait_writebacks() {
  Status first;
  for (const mem::Completion& c : writebacks_) {
    Status s = store_->wait(c);
    if (!s.is_ok() && first.is_ok()) first = s;
  }
  writebacks_.clear();
  return first;
}

void OffloadEngine::begin_last_micro_batch(double lr, std::int64_t step, bool may_clip) {
  // The schedule the last step ran: the chooser may change it at the next step(), after the
  // guess would have begun; a guess running then is finished at once.
  if (schedule_ != OptimizerOverlap::kBackward || last_clipped_) return;
  STRATA_CHECK(phase_ != Phase::kGuessing, "begin_last_micro_batch while a guess runs");
  guess_lr_ = lr;
  guess_step_ = step;
  guess_keeps_grads_ = may_clip;
  armed_ = true;  // the guess starts with the micro-batch's first gradient
}

Status OffloadEngine::finish_micro_batch() {
  Status first = phase_ == Phase::kGuessing ? Status::ok() : finish_step();
  while (!pending_grads_.empty()) {
    Status s = drain_one_grad();
    if (!s.is_ok() && first.is_ok()) first = s;
  }
  if (Status s = wait_writebacks(); !s.is_ok() && first.is_ok()) first = s;
  armed_ = false;  // no gradient at all: nothing to guess
  if (phase_ == Phase::kGuessing) {
    // Backward is over: every gradient is final, zeros where none came.
    if (Status s = give_zero_grads(); !s.is_ok() && first.is_ok()) first = s;
    for (std::size_t gi = 0; gi < groups_.size(); ++gi) mark_final(gi);
  }
  // The end of a pass: the scheduler settles its prefetches and drops what it kept, since the
  // optimizer may rewrite the working copies before the next pass.
  if (sched_) sched_->end_pass();
  // Between passes the store holds nothing on the device that the model might need.
  store_->trim_device_cache();
  backward_ = false;
  absorb_store_stats();
  STRATA_RETURN_IF_ERROR(first);
  return device_.last_error();
}

Result<std::vector<double>> OffloadEngine::grad_sums_of_squares() {
  STRATA_CHECK(pending_grads_.empty(), "gradient norm before finish_micro_batch");
  if (phase_ != Phase::kGuessing) STRATA_RETURN_IF_ERROR(finish_step());
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
    if (plan_.accumulate_on_device() && phase_ == Phase::kGuessing) continue;  // summed already
    STRATA_ASSIGN_OR_RETURN(void* acc, store_->acquire(g.grad_acc, Tier::kDevice));
    device_.ops().sum_squares(acc, g.n, DType::kF32, norm_slots_ + i);
    store_->unpin(g.grad_acc, Tier::kDevice);
  }
  if (on_device && any) {
    device::Stream& compute = device_.stream(device::StreamKind::kCompute);
    if (norm_slots_ != norms_host_.as<double>()) {
      device_.copy_to_host(norms_host_.data(), norm_slots_, groups_.size() * sizeof(double),
                           compute);
    }
    compute.synchronize();
    // A failed sum (its launch, or a fault before it) is the error, not a stale number.
    STRATA_RETURN_IF_ERROR(device_.last_error());
  }
  std::vector<double> sums(groups_.size(), 0.0);
  const double* host = norms_host_.as<double>();
  for (std::size_t i = 0; i < groups_.size(); ++i) {
    const Group& g = *groups_[i];
    if (g.has_grad) sums[i] = on_device ? host[i] : g.sum_squares;
  }
  return sums;
}

Result<double> OffloadEngine::grad_norm() {
  STRATA_ASSIGN_OR_RETURN(const std::vector<double> sums, grad_sums_of_squares());
  double sum = 0;
  for (const double s : sums) sum += s;
  return std::sqrt(sum);
}

Status OffloadEngine::zero_grads() {
  Status s;
  if (phase_ == Phase::kGuessing) {
    s = abandon_guess();
    ++stats_.steps_guessed;
    ++stats_.steps_rolled_back;
  }
  STRATA_CHECK(!step_thread_.joinable(), "zero_grads while an optimizer step runs");
  armed_ = false;
  last_clipped_ = true;  // a skipped step says little about the next: do not guess it
  for (auto& g : groups_) {
    g->has_grad = false;
    g->sum_squares = 0;
  }
  return s;
}

Status OffloadEngine::give_zero_grads() {
  for (std::size_t i = 0; i < groups_.size(); ++i) {
    Group& g = *groups_[i];
    if (g.has_grad) continue;
    STRATA_RETURN_IF_ERROR(store_->fill_zero(step_grad(g)));
    // Its sum of squares, where kept gradients' and guessed device sums' are.
    if (plan_.keep_gradients || (plan_.accumulate_on_device() && phase_ == Phase::kGuessing)) {
      device_.fill_zero(norm_slots_ + i, sizeof(double),
                        device_.stream(device::StreamKind::kCompute));
    }
    g.has_grad = true;
  }
  return Status::ok();
}

mem::Handle OffloadEngine::step_grad(const Group& g) const {
  return plan_.keep_gradients ? g.grad : g.grad_acc;
}

// ---- optimizer ----

Result<void*> OffloadEngine::open_output(Group& g, Tier tier) {
  // The output replaces every copy: the home itself when it lives on `tier`.
  return store_->emplace(g.work, tier, /*zero_fill=*/false);
}

Status OffloadEngine::close_output(Group& g, Tier tier, std::vector<mem::Completion>& writebacks,
                                   bool keep_host_copy) {
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

Status OffloadEngine::step(double lr, std::int64_t step, float grad_scale) {
  if (chooser_) {
    chooser_->step_began(options_.clock ? options_.clock() : now_ns());
    schedule_ = chooser_->current();
  }
  step_inline_ = schedule_ == OptimizerOverlap::kNone;
  bool redo = false;  // the working copies a guess touched stay touched: the redo rewrites them
  last_clipped_ = grad_scale != 1.0f;
  if (phase_ == Phase::kGuessing) {
    const bool holds = lr == guess_lr_ && step == guess_step_ && grad_scale == 1.0f;
    ++stats_.steps_guessed;
    if (holds) {  // the guess is the step: it runs on into the next forward
      phase_ = Phase::kRunning;
      step_inline_ = false;  // what it hid beside backward stays hidden
      // Unless the serial schedule was chosen from now on: then the step ends here.
      return schedule_ == OptimizerOverlap::kNone ? finish_step() : Status::ok();
    }
    // The scale differs (clipping): the state before the step is intact in the shadow scheme;
    // stop the guess and redo the step from it with the gradients kept for this.
    STRATA_CHECK(guess_keeps_grads_, "a redo of a guess that did not keep its gradients");
    STRATA_RETURN_IF_ERROR(abandon_guess(/*restore=*/false));
    ++stats_.steps_redone;
    redo = true;
  } else {
    STRATA_RETURN_IF_ERROR(finish_step());
  }
  STRATA_CHECK(pending_grads_.empty() && writebacks_.empty(),
               "optimizer step before the last micro-batch's finish_micro_batch");
  STRATA_RETURN_IF_ERROR(give_zero_grads());
  if (plan_.accumulate_on_device()) {
    // Every group's sum to host memory, in the order the step reads them, on the copy streams
    // (a redo finds them there already); the step's acquire of each waits for its copy only.
    for (const auto& g : groups_) {
      STRATA_RETURN_IF_ERROR(store_->fetch(g->grad_acc, Tier::kHost).status());
    }
  }
  const device::AdamWArgs args = optim::make_adamw_args(options_.adam, lr, step, grad_scale);
  if (schedule_ != OptimizerOverlap::kNone) {
    launch_step(args, Phase::kRunning, /*keep_touched=*/redo);
    return Status::ok();
  }
  reset_step_flags(/*keep_touched=*/redo);
  Status s = run_step(args, /*guess=*/false);
  {
    std::lock_guard lock(step_mu_);
    step_done_ = true;
  }
  return end_step(std::move(s));
}

void OffloadEngine::start_guess() {
  launch_step(optim::make_adamw_args(options_.adam, guess_lr_, guess_step_, 1), Phase::kGuessing,
              /*keep_touched=*/false);
}

void OffloadEngine::reset_step_flags(bool keep_touched) {
  std::lock_guard lock(step_mu_);
  updated_.assign(groups_.size(), false);
  if (!keep_touched) touched_.assign(groups_.size(), false);
  ready_.assign(groups_.size(), false);
  cancel_ = false;
  step_done_ = false;
  step_status_ = Status::ok();
}

void OffloadEngine::launch_step(const device::AdamWArgs& args, Phase phase, bool keep_touched) {
  reset_step_flags(keep_touched);
  phase_ = phase;
  step_thread_ = std::thread([this, args, guess = phase == Phase::kGuessing] {
    Status s = run_step(args, guess);
    std::lock_guard lock(step_mu_);
    step_status_ = std::move(s);
    step_done_ = true;
    step_cv_.notify_all();
  });
}

void OffloadEngine::mark_final(std::size_t group) {
  {
    std::lock_guard lock(step_mu_);
    ready_[group] = true;
  }
  step_cv_.notify_all();
}

Status OffloadEngine::abandon_guess(bool restore) {
  {
    std::lock_guard lock(step_mu_);
    cancel_ = true;
  }
  step_cv_.notify_all();
  Stopwatch wait;
  step_thread_.join();
  stats_.optimizer_exposed_ms += wait.elapsed_ms();
  phase_ = Phase::kIdle;
  Status guess;
  std::vector<bool> written;
  {
    std::lock_guard lock(step_mu_);
    guess = step_status_;
    written = touched_;
  }
  count_step();
  // The state is as before the step (the guess wrote the shadow copy); the working copies the
  // guess wrote go back to what that state says, unless a redo is about to rewrite them all.
  const bool failed = !guess.is_ok() && guess.code() != StatusCode::kCancelled;
  Status s = restore || failed ? restore_working_copies(written) : Status::ok();
  absorb_store_stats();  // the restored copies' transfers
  // The guess's own error (it read or wrote the state) comes first; being stopped is none.
  return failed ? guess : s;
}

Status OffloadEngine::restore_working_copies(const std::vector<bool>& groups) {
  Status s;
  for (std::size_t gi = 0; gi < groups_.size() && s.is_ok(); ++gi) {
    if (!groups[gi]) continue;
    Group& g = *groups_[gi];
    auto master = store_->acquire(g.master, Tier::kHost);
    s = master.status();
    if (!master.is_ok()) break;
    s = write_working_copy(g, static_cast<const float*>(*master));
    store_->unpin(g.master, Tier::kHost);
  }
  if (Status w = wait_writebacks(); s.is_ok()) s = w;
  return s;
}

Status OffloadEngine::write_working_copy(Group& g, const float* master) {
  STRATA_ASSIGN_OR_RETURN(void* out, open_output(g, Tier::kHost));
  host_arrays_->convert(master, DType::kF32, out, options_.compute_dtype, g.n);
  return close_output(g, Tier::kHost, writebacks_);
}

// Every group in layout order (the order the forward needs them), or as a guess in backward
// order as each gradient becomes final; each new working copy is sent home as soon as it is
// written; returns once they are all home.
Status OffloadEngine::run_step(const device::AdamWArgs& args, bool guess) {
  Stopwatch timer;
  update_span_ns_ = now_ns();
  std::vector<StepGroup> groups;
  for (const auto& gp : groups_) {
    const Group& g = *gp;
    StepGroup sg{g.spec->name, g.n, g.master, g.exp_avg, g.exp_avg_sq, step_grad(g)};
    if (plan_.shadow_state) {
      sg.master_out = g.master_next;
      sg.exp_avg_out = g.exp_avg_next;
      sg.exp_avg_sq_out = g.exp_avg_sq_next;
    }
    groups.push_back(std::move(sg));
  }
  std::vector<std::size_t> order;
  if (guess) {
    for (std::size_t gi = groups_.size(); gi-- > 0;) order.push_back(gi);
  }
  // Working copies opened and not yet closed: a step that stops between the two unpins them.
  std::vector<std::optional<Tier>> open(groups_.size());
  const auto open_one = [this, &open](std::size_t gi, Tier tier) -> Result<void*> {
    {
      std::lock_guard lock(step_mu_);
      touched_[gi] = true;  // emplace drops the old data even if the update never comes
    }
    auto out = open_output(*groups_[gi], tier);
    if (out.is_ok()) open[gi] = tier;
    return out;
  };
  const auto close = [this, guess, &open](std::size_t gi, Tier tier) {
    Group& g = *groups_[gi];
    open[gi].reset();
    Status s = close_output(g, tier, step_writebacks_, /*keep_host_copy=*/true);
    // The gradient is spent, unless a redo may need it: then it goes home like any other.
    if (s.is_ok() && guess && guess_keeps_grads_) {
      const mem::Handle h = step_grad(g);
      if (store_->spec(h).home != Tier::kHost) {
        auto home = store_->evict(h, Tier::kHost);
        s = home.status();
        if (home.is_ok()) step_writebacks_.push_back(std::move(*home));
      }
    } else if (s.is_ok()) {
      s = store_->discard(step_grad(g));
    }
    const std::int64_t end = now_ns();
    if (options_.timeline != nullptr) {
      options_.timeline->add(mem::Lane::kCpuOptimizer,
                             (guess ? "update (guessed) " : "update ") + g.spec->name,
                             update_span_ns_, end);
    }
    update_span_ns_ = end;
    {
      std::lock_guard lock(step_mu_);
      updated_[gi] = true;
    }
    step_cv_.notify_all();
    return s;
  };
  const auto ready = [this](std::size_t gi, bool wait) -> Result<bool> {
    {
      std::unique_lock lock(step_mu_);
      if (wait) step_cv_.wait(lock, [&] { return ready_[gi] || cancel_; });
      if (!cancel_) {
        const bool final = ready_[gi];
        lock.unlock();
        // The group's update starts once its gradient is final, or the last one has ended.
        if (final) update_span_ns_ = std::max(update_span_ns_, now_ns());
        return final;
      }
    }
    return Status(StatusCode::kCancelled, "the guessed optimizer step was abandoned");
  };
  StepIo io{*store_,
            groups,
            plan_.keep_gradients ? options_.compute_dtype : DType::kF32,
            options_.compute_dtype,
            open_one,
            close,
            order,
            {}};
  if (guess) io.ready = ready;
  Status s = optimizer_->run(io, args);
  for (std::size_t gi = 0; gi < open.size(); ++gi) {
    if (open[gi]) store_->unpin(groups_[gi]->work, *open[gi]);
  }
  for (const mem::Completion& c : step_writebacks_) {
    Status w = store_->wait(c);
    if (s.is_ok()) s = w;
  }
  step_writebacks_.clear();
  step_ms_ = timer.elapsed_ms();
  return s;
}

void OffloadEngine::count_step() {
  stats_.nvme_read_bytes += optimizer_->bytes_read();
  stats_.nvme_write_bytes += optimizer_->bytes_written();
  absorb_store_stats();
  stats_.optimizer_total_ms += step_ms_;
  // A step run in step() itself hides nothing: compute waits for all of it.
  if (step_inline_) stats_.optimizer_exposed_ms += step_ms_;
}

Status OffloadEngine::end_step(Status s) {
  count_step();
  if (!s.is_ok()) {
    for (auto& g : groups_) g->has_grad = false;  // the step consumed some: start afresh
    // With the shadow state the state before the step is intact: the working copies the step
    // wrote go back to it, so the engine is as it was. Without, the state may be part updated.
    if (!plan_.shadow_state) return s;
    std::vector<bool> touched;
    {
      std::lock_guard lock(step_mu_);
      touched = touched_;
    }
    (void)restore_working_copies(touched);  // the step's own error is the one to report
    return s;
  }
  for (auto& g : groups_) {
    g->has_grad = false;
    g->sum_squares = 0;
    if (plan_.shadow_state) {  // the step is done: its state is the state
      std::swap(g->master, g->master_next);
      std::swap(g->exp_avg, g->exp_avg_next);
      std::swap(g->exp_avg_sq, g->exp_avg_sq_next);
    }
  }
  return device_.last_error();
}

Status OffloadEngine::finish_step() {
  if (phase_ == Phase::kGuessing) return abandon_guess();  // nobody will call step(): unwind
  if (!step_thread_.joinable()) return Status::ok();
  Stopwatch wait;
  step_thread_.join();
  phase_ = Phase::kIdle;
  stats_.optimizer_exposed_ms += wait.elapsed_ms();
  Status s;
  {
    std::lock_guard lock(step_mu_);
    s = step_status_;
  }
  return end_step(std::move(s));
}

Status OffloadEngine::wait_update(int group) {
  // A guess updates only groups whose backward is done; the forward after it waits.
  if (!step_thread_.joinable() || phase_ == Phase::kGuessing) return Status::ok();
  Stopwatch wait;
  bool updated = false;
  {
    std::unique_lock lock(step_mu_);
    step_cv_.wait(lock, [&] { return updated_[static_cast<std::size_t>(group)] || step_done_; });
    updated = updated_[static_cast<std::size_t>(group)];
  }
  stats_.optimizer_exposed_ms += wait.elapsed_ms();
  // The step ended without writing this group: an error, which finishing reports.
  return updated ? Status::ok() : finish_step();
}

// ---- state in and out ----

Status OffloadEngine::load_master(const model::GroupSource& source) {
  STRATA_RETURN_IF_ERROR(finish_step());
  for (auto& gp : groups_) {
    Group& g = *gp;
    // The master weights' host copy (its home, or a fresh copy on its way home), filled by the
    // source; the working copy converted from it the same way.
    STRATA_ASSIGN_OR_RETURN(void* master, store_->emplace(g.master, Tier::kHost, true));
    Status s = source(*g.spec, static_cast<float*>(master));
    if (s.is_ok()) s = write_working_copy(g, static_cast<const float*>(master));
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
  STRATA_RETURN_IF_ERROR(zero_grads());
  last_clipped_ = false;
  // The host copies loading passed through are not made again in training: give them back.
  store_->trim_host_cache();
  absorb_store_stats();
  return device_.last_error();
}

Status OffloadEngine::read_master(int group, float* dst) {
  STRATA_RETURN_IF_ERROR(finish_step());
  return store_->read(groups_.at(static_cast<std::size_t>(group))->master, dst);
}

Status OffloadEngine::read_moments(int group, float* exp_avg, float* exp_avg_sq) {
  STRATA_RETURN_IF_ERROR(finish_step());
  const Group& g = *groups_.at(static_cast<std::size_t>(group));
  STRATA_RETURN_IF_ERROR(store_->read(g.exp_avg, exp_avg));
  return store_->read(g.exp_avg_sq, exp_avg_sq);
}

Status OffloadEngine::write_moments(int group, const float* exp_avg, const float* exp_avg_sq) {
  STRATA_RETURN_IF_ERROR(finish_step());
  const Group& g = *groups_.at(static_cast<std::size_t>(group));
  STRATA_RETURN_IF_ERROR(store_->write(g.exp_avg, exp_avg, g.f32_bytes));
  return store_->write(g.exp_avg_sq, exp_avg_sq, g.f32_bytes);
}

}  // namespace strata::zero
