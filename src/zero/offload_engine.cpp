// OffloadEngine: placement of master weights, moments, gradients and working copies across the
// device, host and NVMe tiers; working copies and gradients through the tiered store with
// trace-driven prefetch; the optimizer step.
#include "strata/zero/offload_engine.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "strata/core/clock.h"
#include "strata/core/json.h"
#include "strata/core/logging.h"

namespace strata::zero {

std::string_view offload_name(Offload o) {
  switch (o) {
    case Offload::kNone:
      return "none";
    case Offload::kCpu:
      return "cpu";
    case Offload::kNvme:
      return "nvme";
  }
  return "?";
}

struct OffloadEngine::Group {
  const model::ParamGroup* spec = nullptr;
  std::int64_t n = 0;
  std::size_t work_bytes = 0;     // n * compute dtype size
  std::size_t work_io_bytes = 0;  // rounded up for O_DIRECT
  std::size_t f32_bytes = 0;
  std::size_t f32_io_bytes = 0;
  // Optimizer state: exactly one of the three placements is used.
  AlignedBuffer master_h, m_h, v_h, grad_h;
  device::DeviceBuffer master_d, m_d, v_d, grad_acc_d;
  io::Extent master_x, m_x, v_x;
  // Working copy in the compute dtype: work_d (offload_param none) or, in the tiered store,
  // `work` with its home in work_h (cpu) or on NVMe.
  device::DeviceBuffer work_d;
  AlignedBuffer work_h;
  mem::Handle work = mem::Handle::kInvalid;
  // This micro-batch's gradient in the compute dtype: a transient tensor of the store.
  mem::Handle grad = mem::Handle::kInvalid;
  void* grad_d = nullptr;  // its device copy while the model accumulates into it
  std::int64_t span_begin_ns = 0;
};

OffloadEngine::OffloadEngine(const model::ParamLayout& layout, device::Device& device,
                             io::SwapSpace* swap, const EngineOptions& options)
    : layout_(layout), device_(device), swap_(swap), options_(options) {}

OffloadEngine::~OffloadEngine() {
  // Copies in flight reference device memory owned here; the store (destroyed before groups_)
  // finishes its own transfers.
  device_.stream(device::StreamKind::kHostToDevice).synchronize();
  device_.stream(device::StreamKind::kDeviceToHost).synchronize();
  if (store_) store_->drain();
  if (swap_ != nullptr) {
    for (auto& g : groups_) {
      if (!g) continue;
      for (const io::Extent* x : {&g->master_x, &g->m_x, &g->v_x}) {
        if (x->valid()) swap_->free(*x);
      }
    }
  }
}

Result<std::unique_ptr<OffloadEngine>> OffloadEngine::create(const model::ParamLayout& layout,
                                                             device::Device& device,
                                                             io::SwapSpace* swap,
                                                             const EngineOptions& options) {
  if (options.offload_param != Offload::kNone && options.offload_optimizer == Offload::kNone) {
    return invalid_argument(
        "offload_param '" + std::string(offload_name(options.offload_param)) +
        "' needs offload_optimizer cpu or nvme (the optimizer cannot run on the device when the "
        "parameters live off it)");
  }
  const bool needs_swap =
      options.offload_param == Offload::kNvme || options.offload_optimizer == Offload::kNvme;
  if (needs_swap && swap == nullptr) {
    return invalid_argument("offload to nvme needs swap_paths (one or more directories)");
  }
  std::unique_ptr<OffloadEngine> engine(new OffloadEngine(layout, device, swap, options));
  STRATA_RETURN_IF_ERROR(engine->plan());
  return engine;
}

Status OffloadEngine::charge_host(std::size_t bytes, const char* what) {
  const std::uint64_t limit = options_.host_memory_limit_bytes;
  if (limit != 0 && stats_.host_bytes + bytes > limit) {
    return out_of_memory("host_memory_limit " + format_bytes(limit) +
                         " is too small: " + format_bytes(stats_.host_bytes) +
                         " already planned, and " + what + " needs " + format_bytes(bytes) +
                         " more; raise host_memory_limit or offload to nvme");
  }
  stats_.host_bytes += bytes;
  return Status::ok();
}

Result<AlignedBuffer> OffloadEngine::host_alloc(std::size_t bytes, const char* what) {
  STRATA_RETURN_IF_ERROR(charge_host(bytes, what));
  return AlignedBuffer(bytes, io::kIoAlignBytes);
}

Status OffloadEngine::plan() {
  const std::size_t dsize = dtype_size(options_.compute_dtype);
  const Offload param = options_.offload_param, opt = options_.offload_optimizer;
  for (const auto& spec : layout_.groups()) {
    auto g = std::make_unique<Group>();
    g->spec = &spec;
    g->n = spec.num_elems;
    g->work_bytes = static_cast<std::size_t>(g->n) * dsize;
    g->work_io_bytes = align_up(g->work_bytes, io::kIoAlignBytes);
    g->f32_bytes = static_cast<std::size_t>(g->n) * sizeof(float);
    g->f32_io_bytes = align_up(g->f32_bytes, io::kIoAlignBytes);
    max_work_bytes_ = std::max(max_work_bytes_, g->work_io_bytes);
    max_f32_bytes_ = std::max(max_f32_bytes_, g->f32_io_bytes);
    groups_.push_back(std::move(g));
  }

  // A group's parameters and gradient must fit on the device together.
  const std::uint64_t limit = device_.memory_stats().limit_bytes;
  for (const auto& g : groups_) {
    if (limit != 0 && 2 * g->work_bytes > limit) {
      return out_of_memory(
          "parameter group '" + g->spec->name + "' needs " + format_bytes(2 * g->work_bytes) +
          " on the device (parameters + gradient), more than device_memory_limit " +
          format_bytes(limit));
    }
  }

  for (auto& gp : groups_) {
    Group& g = *gp;
    const std::string& name = g.spec->name;
    switch (opt) {
      case Offload::kNone: {
        STRATA_ASSIGN_OR_RETURN(g.master_d,
                                device_.allocate(g.f32_bytes, "master weights of " + name));
        STRATA_ASSIGN_OR_RETURN(g.m_d, device_.allocate(g.f32_bytes, "exp_avg of " + name));
        STRATA_ASSIGN_OR_RETURN(g.v_d, device_.allocate(g.f32_bytes, "exp_avg_sq of " + name));
        STRATA_ASSIGN_OR_RETURN(g.grad_acc_d,
                                device_.allocate(g.f32_bytes, "gradients of " + name));
        break;
      }
      case Offload::kCpu: {
        STRATA_ASSIGN_OR_RETURN(g.master_h, host_alloc(g.f32_io_bytes, "master weights"));
        STRATA_ASSIGN_OR_RETURN(g.m_h, host_alloc(g.f32_io_bytes, "exp_avg"));
        STRATA_ASSIGN_OR_RETURN(g.v_h, host_alloc(g.f32_io_bytes, "exp_avg_sq"));
        STRATA_ASSIGN_OR_RETURN(g.grad_h, host_alloc(g.f32_io_bytes, "gradients"));
        break;
      }
      case Offload::kNvme: {
        STRATA_ASSIGN_OR_RETURN(g.master_x, swap_->allocate(g.f32_io_bytes, "master " + name));
        STRATA_ASSIGN_OR_RETURN(g.m_x, swap_->allocate(g.f32_io_bytes, "exp_avg " + name));
        STRATA_ASSIGN_OR_RETURN(g.v_x, swap_->allocate(g.f32_io_bytes, "exp_avg_sq " + name));
        STRATA_ASSIGN_OR_RETURN(g.grad_h, host_alloc(g.f32_io_bytes, "gradients"));
        stats_.nvme_bytes += 3 * g.f32_io_bytes;
        break;
      }
    }
    switch (param) {
      case Offload::kNone: {
        STRATA_ASSIGN_OR_RETURN(g.work_d, device_.allocate(g.work_bytes, "parameters of " + name));
        break;
      }
      case Offload::kCpu: {
        STRATA_ASSIGN_OR_RETURN(g.work_h, host_alloc(g.work_io_bytes, "parameters"));
        break;
      }
      case Offload::kNvme: {
        stats_.nvme_bytes += g.work_io_bytes;  // the tiered store places it (create_store)
        break;
      }
    }
  }
  if (opt == Offload::kNone && options_.compute_dtype != DType::kF32) {
    STRATA_ASSIGN_OR_RETURN(grad_f32_scratch_,
                            device_.allocate(max_f32_bytes_, "gradient conversion scratch"));
  }
  if (opt != Offload::kNone) {
    STRATA_ASSIGN_OR_RETURN(optim::CpuAdam adam, optim::CpuAdam::create(options_.cpu_adam));
    cpu_adam_.emplace(std::move(adam));
  }
  if (opt == Offload::kNvme) {
    for (auto& b : opt_buf_[0]) {
      STRATA_ASSIGN_OR_RETURN(b, host_alloc(max_f32_bytes_, "optimizer staging"));
    }
    std::int64_t max_n = 0;
    for (const auto& g : groups_) max_n = std::max(max_n, g->n);
    optim::StreamedAdamOptions so;
    so.sub_group_size = options_.sub_group_size;
    so.max_segment_elems = max_n;
    so.check_finite = false;  // the trainer skips steps whose gradient norm is not finite
    STRATA_RETURN_IF_ERROR(
        charge_host(optim::StreamedAdam::staging_bytes_for(so), "optimizer sub-group staging"));
    STRATA_ASSIGN_OR_RETURN(optim::StreamedAdam streamed,
                            optim::StreamedAdam::create(*swap_, *cpu_adam_, so));
    streamed_adam_.emplace(std::move(streamed));
  }
  // Fresh working copies (the optimizer's output, load_master) on their way to their tier; the
  // store moves everything else through its own pinned staging pool.
  for (int i = 0; i < 2; ++i) {
    STRATA_ASSIGN_OR_RETURN(AlignedBuffer b, host_alloc(max_work_bytes_, "staging buffers"));
    staging_.push_back(std::move(b));
  }
  for (auto& b : staging_) free_staging_.push_back(&b);
  return create_store();
}

Result<AlignedBuffer*> OffloadEngine::take_staging() {
  if (free_staging_.empty()) return internal_error("no working-copy staging buffer free");
  AlignedBuffer* b = free_staging_.back();
  free_staging_.pop_back();
  return b;
}

void OffloadEngine::give_staging(AlignedBuffer* b) { free_staging_.push_back(b); }

void OffloadEngine::trim_device_cache() {
  if (store_ != nullptr) store_->trim_device_cache();
}

Status OffloadEngine::nvme_read(const io::Extent& x, void* buf, std::size_t bytes) {
  stats_.nvme_read_bytes += bytes;
  return swap_->read(x, 0, buf, bytes).wait();
}

Status OffloadEngine::nvme_write(const io::Extent& x, const void* buf, std::size_t bytes) {
  stats_.nvme_write_bytes += bytes;
  return swap_->write(x, 0, buf, bytes).wait();
}

// ---- the tiered store ----

Status OffloadEngine::create_store() {
  const Offload param = options_.offload_param, opt = options_.offload_optimizer;
  mem::StoreOptions so;
  so.budget_bytes[static_cast<int>(Tier::kDevice)] = device_.memory_stats().limit_bytes;
  // NVMe -> device moves go through the pool in chunks; 8 MiB keeps several reads in flight
  // at a size the drive handles at full speed. Without parameters on NVMe one page will do.
  so.staging_buffer_bytes = param == Offload::kNvme
                                ? std::min<std::size_t>(max_work_bytes_, std::size_t{8} << 20)
                                : io::kIoAlignBytes;
  so.num_staging_buffers = param == Offload::kNvme ? 4 : 1;
  so.timeline = options_.timeline;
  const std::uint64_t limit = options_.host_memory_limit_bytes;
  if (limit != 0) {
    // The store gets what the plan left: its staging pool and the gradients on their way from
    // the device (one draining while the next one lands).
    const std::uint64_t need =
        static_cast<std::uint64_t>(so.staging_buffer_bytes) * so.num_staging_buffers +
        (opt != Offload::kNone ? 2 * max_work_bytes_ : 0);
    const std::uint64_t left = limit > stats_.host_bytes ? limit - stats_.host_bytes : 0;
    if (left < need) {
      return out_of_memory("host_memory_limit " + format_bytes(limit) +
                           " is too small: " + format_bytes(stats_.host_bytes) +
                           " already planned, and the staging pool and gradients leaving the "
                           "device need " +
                           format_bytes(need) +
                           " more; raise host_memory_limit or offload to nvme");
    }
    so.budget_bytes[static_cast<int>(Tier::kHost)] = left;
  }
  STRATA_ASSIGN_OR_RETURN(store_, mem::TieredStore::create(device_, swap_, so));
  for (auto& gp : groups_) {
    Group& g = *gp;
    if (param != Offload::kNone) {
      mem::TensorSpec spec;
      spec.name = g.spec->name;
      spec.size_bytes = g.work_bytes;
      spec.home = param == Offload::kCpu ? Tier::kHost : Tier::kNvme;
      spec.home_data = param == Offload::kCpu ? g.work_h.data() : nullptr;
      STRATA_ASSIGN_OR_RETURN(g.work, store_->add(spec));
    }
    mem::TensorSpec grad;
    grad.name = "gradient of " + g.spec->name;
    grad.size_bytes = g.work_bytes;
    grad.transient = true;
    STRATA_ASSIGN_OR_RETURN(g.grad, store_->add(grad));
  }
  if (param != Offload::kNone) {
    sched::PrefetchOptions po;
    po.prefetch_bytes = options_.prefetch_bytes;
    po.max_live_bytes = options_.max_live_bytes;
    po.max_reuse_distance = options_.max_reuse_distance;
    sched_ = std::make_unique<sched::PrefetchScheduler>(*store_, po);
  }
  store_seen_ = store_->stats();
  planned_host_bytes_ = stats_.host_bytes;
  return Status::ok();
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
  // What the plan holds plus the most the store has held (staging, gradients leaving).
  stats_.host_bytes = planned_host_bytes_ + now.peak_bytes[static_cast<int>(Tier::kHost)];
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
  if (!sched_) {
    g.span_begin_ns = now_ns();
    return static_cast<const void*>(g.work_d.data());
  }
  Stopwatch wait;
  auto p = sched_->acquire(g.work);
  stats_.wait_ms += wait.elapsed_ms();
  absorb_store_stats();
  if (!p.is_ok()) return p.status();
  g.span_begin_ns = now_ns();
  return static_cast<const void*>(*p);
}

void OffloadEngine::release_params(int group) {
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  end_compute_span(g);
  if (sched_) sched_->release(g.work);
}

// ---- gradients ----

Result<void*> OffloadEngine::acquire_grads(int group) {
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  STRATA_CHECK(g.grad_d == nullptr, "acquire_grads twice without release", g.spec->name);
  backward_ = true;
  STRATA_ASSIGN_OR_RETURN(g.grad_d, store_->emplace(g.grad, Tier::kDevice, /*zero_fill=*/true));
  return g.grad_d;
}

Status OffloadEngine::accumulate_grad(Group& g, const void* grad) {
  float* acc = g.grad_h.as<float>();
  const std::size_t n = static_cast<std::size_t>(g.n);
  if (options_.compute_dtype == DType::kF32) {
    const float* src = static_cast<const float*>(grad);
    for (std::size_t i = 0; i < n; ++i) acc[i] += src[i];
  } else {
    // Widen a block at a time (vectorized conversion), then add: same sums, element by element.
    constexpr std::size_t kBlock = 4096;
    float wide[kBlock];
    const std::size_t esize = dtype_size(options_.compute_dtype);
    for (std::size_t i = 0; i < n; i += kBlock) {
      const std::size_t m = std::min(kBlock, n - i);
      convert(static_cast<const std::byte*>(grad) + i * esize, options_.compute_dtype, wide,
              DType::kF32, m);
      for (std::size_t j = 0; j < m; ++j) acc[i + j] += wide[j];
    }
  }
  return Status::ok();
}

Status OffloadEngine::release_grads(int group) {
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  STRATA_CHECK(g.grad_d != nullptr, "release_grads without acquire", g.spec->name);
  void* src = std::exchange(g.grad_d, nullptr);
  if (options_.offload_optimizer == Offload::kNone) {
    const auto& ops = device_.ops();
    if (options_.compute_dtype != DType::kF32) {
      ops.cast(src, options_.compute_dtype, grad_f32_scratch_.data(), DType::kF32, g.n);
      src = grad_f32_scratch_.data();
    }
    ops.add(g.grad_acc_d.data(), src, g.grad_acc_d.data(), g.n, DType::kF32);
    store_->unpin(g.grad, Tier::kDevice);
    return store_->discard(g.grad);
  }
  // Off the device on the d2h stream while the next layer's backward runs.
  store_->unpin(g.grad, Tier::kDevice);
  STRATA_ASSIGN_OR_RETURN(mem::Completion done, store_->evict(g.grad, Tier::kDevice));
  pending_grads_.push_back(PendingGrad{group, std::move(done)});
  // Keep at most one transfer behind the compute: its host copy is the store's to budget.
  while (pending_grads_.size() > 1) STRATA_RETURN_IF_ERROR(drain_one_grad());
  return Status::ok();
}

Status OffloadEngine::drain_one_grad() {
  PendingGrad p = std::move(pending_grads_.front());
  pending_grads_.pop_front();
  Group& g = *groups_[static_cast<std::size_t>(p.group)];
  Status s = store_->wait(p.done);
  if (!s.is_ok()) {
    store_->discard(g.grad).ignore();
    return s;
  }
  STRATA_ASSIGN_OR_RETURN(void* host, store_->acquire(g.grad, Tier::kHost));
  const std::int64_t t0 = now_ns();
  s = accumulate_grad(g, host);
  if (options_.timeline != nullptr) {
    options_.timeline->add(mem::Lane::kCompute, "accumulate " + g.spec->name + " gradient", t0,
                           now_ns());
  }
  store_->unpin(g.grad, Tier::kHost);
  STRATA_RETURN_IF_ERROR(store_->discard(g.grad));
  return s;
}

Status OffloadEngine::finish_micro_batch() {
  Status first;
  while (!pending_grads_.empty()) {
    Status s = drain_one_grad();
    if (!s.is_ok() && first.is_ok()) first = s;
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

Result<double> OffloadEngine::grad_sum_squares(int group) {
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  if (options_.offload_optimizer == Offload::kNone) {
    return device_.ops().sum_squares(g.grad_acc_d.data(), g.n, DType::kF32);
  }
  const float* acc = g.grad_h.as<float>();
  double s = 0;
  for (std::int64_t i = 0; i < g.n; ++i) s += static_cast<double>(acc[i]) * acc[i];
  return s;
}

Result<double> OffloadEngine::grad_norm() {
  STRATA_RETURN_IF_ERROR(finish_micro_batch());
  double sum = 0;
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    STRATA_ASSIGN_OR_RETURN(double s, grad_sum_squares(static_cast<int>(g)));
    sum += s;
  }
  return std::sqrt(sum);
}

void OffloadEngine::zero_grads() {
  for (auto& g : groups_) {
    if (options_.offload_optimizer == Offload::kNone) {
      device_.fill_zero(g->grad_acc_d.data(), g->f32_bytes,
                        device_.stream(device::StreamKind::kCompute));
    } else {
      std::memset(g->grad_h.data(), 0, g->f32_bytes);
    }
  }
}

// ---- optimizer ----

Status OffloadEngine::store_working_copy(Group& g, const void* src) {
  switch (options_.offload_param) {
    case Offload::kNone: {
      auto& h2d = device_.stream(device::StreamKind::kHostToDevice);
      // Ordered after the compute stream, which may still use these buffers (the optimizer
      // step on the device, a forward): a no-op on the CPU backend, whose compute is inline.
      device_.wait_event(h2d, device_.record_event(device_.stream(device::StreamKind::kCompute)));
      device_.copy_to_device(g.work_d.data(), src, g.work_bytes, h2d);
      stats_.h2d_bytes += g.work_bytes;
      device_.record_event(h2d).synchronize();
      return Status::ok();
    }
    case Offload::kCpu:
    case Offload::kNvme: {
      // The store drops any cached copy and writes the home; it writes an NVMe home straight
      // from `src` when src has a whole O_DIRECT block behind it (our staging buffers do).
      auto* p = static_cast<const std::byte*>(src);
      bool padded = src == g.work_h.data();
      for (const AlignedBuffer& b : staging_) {
        padded |= p >= b.data() && p + g.work_io_bytes <= b.data() + b.size();
      }
      const std::size_t capacity = padded ? g.work_io_bytes : g.work_bytes;
      Status s = store_->write(g.work, src, capacity);
      absorb_store_stats();
      return s.is_ok() ? s
                       : s.with_context("writing parameters of " + g.spec->name + " to " +
                                        std::string(offload_name(options_.offload_param)));
    }
  }
  return Status::ok();
}

Status OffloadEngine::step(double lr, std::int64_t step, float grad_scale) {
  STRATA_RETURN_IF_ERROR(finish_micro_batch());
  Stopwatch timer;
  const device::AdamWArgs base = optim::make_adamw_args(options_.adam, lr, step, grad_scale);
  const Offload opt = options_.offload_optimizer;
  if (opt == Offload::kNone) {
    for (auto& g : groups_) {
      device::AdamWArgs a = base;
      a.param = g->master_d.as<float>();
      a.grad = g->grad_acc_d.data();
      a.grad_dtype = DType::kF32;
      a.exp_avg = g->m_d.as<float>();
      a.exp_avg_sq = g->v_d.as<float>();
      a.n = g->n;
      a.param_out = g->work_d.data();
      a.out_dtype = options_.compute_dtype;
      device_.ops().adamw(a);
    }
  } else if (opt == Offload::kCpu) {
    for (auto& g : groups_) {
      device::AdamWArgs a = base;
      a.param = g->master_h.as<float>();
      a.grad = g->grad_h.data();
      a.grad_dtype = DType::kF32;
      a.exp_avg = g->m_h.as<float>();
      a.exp_avg_sq = g->v_h.as<float>();
      a.n = g->n;
      AlignedBuffer* out = nullptr;
      if (options_.offload_param == Offload::kCpu) {
        a.param_out = g->work_h.data();
      } else {
        STRATA_ASSIGN_OR_RETURN(out, take_staging());
        a.param_out = out->data();
      }
      a.out_dtype = options_.compute_dtype;
      // No finite scan: the trainer skips a step whose gradient norm is not finite, so a scan
      // here would re-read every gradient for nothing (non-finite values propagate exactly as
      // in the reference).
      const optim::StepOutcome outcome = cpu_adam_->step(a, /*check_finite=*/false);
      STRATA_CHECK(outcome == optim::StepOutcome::kUpdated, "an unchecked CpuAdam step skipped");
      if (out != nullptr) {
        Status s = store_working_copy(*g, out->data());
        give_staging(out);
        STRATA_RETURN_IF_ERROR(s);
      }
    }
  } else {
    // NVMe: the state streams through optim::StreamedAdam in sub-groups (read i+1 while i is
    // updated and i-1 written back); a group's working copy is stored as soon as it is complete,
    // before the next group's update starts, so one staging buffer serves every group.
    AlignedBuffer* out = nullptr;
    if (options_.offload_param != Offload::kCpu) {
      STRATA_ASSIGN_OR_RETURN(out, take_staging());
    }
    std::vector<optim::StreamedSegment> segments;
    segments.reserve(groups_.size());
    for (auto& gp : groups_) {
      Group& g = *gp;
      optim::StreamedSegment seg;
      seg.name = g.spec->name;
      seg.master = g.master_x;
      seg.exp_avg = g.m_x;
      seg.exp_avg_sq = g.v_x;
      seg.grad = g.grad_h.data();
      seg.grad_dtype = DType::kF32;
      seg.num_elems = g.n;
      seg.param_out = out != nullptr ? out->data() : g.work_h.data();
      seg.out_dtype = options_.compute_dtype;
      segments.push_back(seg);
    }
    auto report = streamed_adam_->step(segments, base, [&](std::size_t gi) {
      return store_working_copy(*groups_[gi], segments[gi].param_out);
    });
    if (out != nullptr) give_staging(out);
    if (!report.is_ok()) return report.status().with_context("optimizer step on NVMe");
    stats_.nvme_read_bytes += report->bytes_read;
    stats_.nvme_write_bytes += report->bytes_written;
  }
  zero_grads();
  stats_.optimizer_ms = timer.elapsed_ms();
  return device_.last_error();
}

// ---- state in and out ----

Status OffloadEngine::load_master(const model::GroupSource& source) {
  AlignedBuffer tmp(max_f32_bytes_, io::kIoAlignBytes);
  AlignedBuffer zeros(max_f32_bytes_, io::kIoAlignBytes);
  auto& compute = device_.stream(device::StreamKind::kCompute);
  for (auto& gp : groups_) {
    Group& g = *gp;
    std::memset(tmp.data(), 0, g.f32_io_bytes);
    STRATA_RETURN_IF_ERROR(source(*g.spec, tmp.as<float>()));
    switch (options_.offload_optimizer) {
      case Offload::kNone: {
        auto& h2d = device_.stream(device::StreamKind::kHostToDevice);
        device_.wait_event(h2d, device_.record_event(compute));  // see store_working_copy
        device_.copy_to_device(g.master_d.data(), tmp.data(), g.f32_bytes, h2d);
        device_.record_event(h2d).synchronize();
        device_.fill_zero(g.m_d.data(), g.f32_bytes, compute);
        device_.fill_zero(g.v_d.data(), g.f32_bytes, compute);
        break;
      }
      case Offload::kCpu:
        std::memcpy(g.master_h.data(), tmp.data(), g.f32_bytes);
        std::memset(g.m_h.data(), 0, g.f32_bytes);
        std::memset(g.v_h.data(), 0, g.f32_bytes);
        break;
      case Offload::kNvme:
        STRATA_RETURN_IF_ERROR(nvme_write(g.master_x, tmp.data(), g.f32_io_bytes));
        STRATA_RETURN_IF_ERROR(nvme_write(g.m_x, zeros.data(), g.f32_io_bytes));
        STRATA_RETURN_IF_ERROR(nvme_write(g.v_x, zeros.data(), g.f32_io_bytes));
        break;
    }
    STRATA_ASSIGN_OR_RETURN(AlignedBuffer * work, take_staging());
    convert(tmp.data(), DType::kF32, work->data(), options_.compute_dtype,
            static_cast<std::size_t>(g.n));
    Status s = store_working_copy(g, work->data());
    give_staging(work);
    STRATA_RETURN_IF_ERROR(s);
  }
  zero_grads();
  return device_.last_error();
}

Status OffloadEngine::read_master(int group, float* dst) {
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  switch (options_.offload_optimizer) {
    case Offload::kNone: {
      auto& d2h = device_.stream(device::StreamKind::kDeviceToHost);
      // Ordered after the compute stream, which may still be updating these buffers (the
      // optimizer step on the device): a no-op on the CPU backend, whose compute is inline.
      device_.wait_event(d2h, device_.record_event(device_.stream(device::StreamKind::kCompute)));
      device_.copy_to_host(dst, g.master_d.data(), g.f32_bytes, d2h);
      device_.record_event(d2h).synchronize();
      return device_.last_error();
    }
    case Offload::kCpu:
      std::memcpy(dst, g.master_h.data(), g.f32_bytes);
      return Status::ok();
    case Offload::kNvme:
      STRATA_RETURN_IF_ERROR(nvme_read(g.master_x, opt_buf_[0][0].data(), g.f32_io_bytes));
      std::memcpy(dst, opt_buf_[0][0].data(), g.f32_bytes);
      return Status::ok();
  }
  return Status::ok();
}

Status OffloadEngine::read_moments(int group, float* exp_avg, float* exp_avg_sq) {
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  switch (options_.offload_optimizer) {
    case Offload::kNone: {
      auto& d2h = device_.stream(device::StreamKind::kDeviceToHost);
      // Ordered after the compute stream, which may still be updating these buffers (the
      // optimizer step on the device): a no-op on the CPU backend, whose compute is inline.
      device_.wait_event(d2h, device_.record_event(device_.stream(device::StreamKind::kCompute)));
      device_.copy_to_host(exp_avg, g.m_d.data(), g.f32_bytes, d2h);
      device_.copy_to_host(exp_avg_sq, g.v_d.data(), g.f32_bytes, d2h);
      device_.record_event(d2h).synchronize();
      return device_.last_error();
    }
    case Offload::kCpu:
      std::memcpy(exp_avg, g.m_h.data(), g.f32_bytes);
      std::memcpy(exp_avg_sq, g.v_h.data(), g.f32_bytes);
      return Status::ok();
    case Offload::kNvme:
      STRATA_RETURN_IF_ERROR(nvme_read(g.m_x, opt_buf_[0][1].data(), g.f32_io_bytes));
      STRATA_RETURN_IF_ERROR(nvme_read(g.v_x, opt_buf_[0][2].data(), g.f32_io_bytes));
      std::memcpy(exp_avg, opt_buf_[0][1].data(), g.f32_bytes);
      std::memcpy(exp_avg_sq, opt_buf_[0][2].data(), g.f32_bytes);
      return Status::ok();
  }
  return Status::ok();
}

Status OffloadEngine::write_moments(int group, const float* exp_avg, const float* exp_avg_sq) {
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  switch (options_.offload_optimizer) {
    case Offload::kNone: {
      auto& h2d = device_.stream(device::StreamKind::kHostToDevice);
      // Ordered after the compute stream, which may still use these buffers (the optimizer
      // step on the device, a forward): a no-op on the CPU backend, whose compute is inline.
      device_.wait_event(h2d, device_.record_event(device_.stream(device::StreamKind::kCompute)));
      device_.copy_to_device(g.m_d.data(), exp_avg, g.f32_bytes, h2d);
      device_.copy_to_device(g.v_d.data(), exp_avg_sq, g.f32_bytes, h2d);
      device_.record_event(h2d).synchronize();
      return device_.last_error();
    }
    case Offload::kCpu:
      std::memcpy(g.m_h.data(), exp_avg, g.f32_bytes);
      std::memcpy(g.v_h.data(), exp_avg_sq, g.f32_bytes);
      return Status::ok();
    case Offload::kNvme:
      std::memcpy(opt_buf_[0][1].data(), exp_avg, g.f32_bytes);
      std::memcpy(opt_buf_[0][2].data(), exp_avg_sq, g.f32_bytes);
      STRATA_RETURN_IF_ERROR(nvme_write(g.m_x, opt_buf_[0][1].data(), g.f32_io_bytes));
      return nvme_write(g.v_x, opt_buf_[0][2].data(), g.f32_io_bytes);
  }
  return Status::ok();
}

}  // namespace strata::zero
