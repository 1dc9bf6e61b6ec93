// OffloadEngine: placement of master weights, moments, gradients and working copies across the
// device, host and NVMe tiers; parameter fetch with one-ahead prefetch; the optimizer step.
#include "strata/zero/offload_engine.h"

#include <cmath>
#include <cstring>

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
  // Working copy in the compute dtype.
  device::DeviceBuffer work_d;
  AlignedBuffer work_h;
  io::Extent work_x;
  // Fetch in flight or done.
  bool fetch_started = false;
  AlignedBuffer* fetch_staging = nullptr;
  io::IoHandle fetch_io;
  device::Event fetch_done;
  int param_refs = 0;
  device::DeviceBuffer grad_d;
};

OffloadEngine::OffloadEngine(const model::ParamLayout& layout, device::Device& device,
                             io::SwapSpace* swap, const EngineOptions& options)
    : layout_(layout), device_(device), swap_(swap), options_(options) {}

OffloadEngine::~OffloadEngine() {
  // Copies in flight reference staging buffers and device memory owned here.
  device_.stream(device::StreamKind::kHostToDevice).synchronize();
  device_.stream(device::StreamKind::kDeviceToHost).synchronize();
  for (auto& g : groups_) {
    if (g && g->fetch_io.valid()) g->fetch_io.wait().ignore();
  }
  if (swap_ != nullptr) {
    for (auto& g : groups_) {
      if (!g) continue;
      for (const io::Extent* x : {&g->master_x, &g->m_x, &g->v_x, &g->work_x}) {
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

Result<AlignedBuffer> OffloadEngine::host_alloc(std::size_t bytes, const char* what) {
  const std::uint64_t limit = options_.host_memory_limit_bytes;
  if (limit != 0 && stats_.host_bytes + bytes > limit) {
    return out_of_memory("host_memory_limit " + format_bytes(limit) +
                         " is too small: " + format_bytes(stats_.host_bytes) +
                         " already planned, and " + what + " needs " + format_bytes(bytes) +
                         " more; raise host_memory_limit or offload to nvme");
  }
  stats_.host_bytes += bytes;
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
        STRATA_ASSIGN_OR_RETURN(g.work_x, swap_->allocate(g.work_io_bytes, "parameters " + name));
        stats_.nvme_bytes += g.work_io_bytes;
        break;
      }
    }
  }
  if (opt == Offload::kNone && options_.compute_dtype != DType::kF32) {
    STRATA_ASSIGN_OR_RETURN(grad_f32_scratch_,
                            device_.allocate(max_f32_bytes_, "gradient conversion scratch"));
  }
  if (opt == Offload::kNvme) {
    for (auto& set : opt_buf_) {
      for (auto& b : set) {
        STRATA_ASSIGN_OR_RETURN(b, host_alloc(max_f32_bytes_, "optimizer staging"));
      }
    }
  }
  // Staging for parameter fetches from NVMe, gradients leaving the device and fresh working
  // copies: three buffers let one fetch run ahead while a gradient drains.
  const std::size_t staging_bytes = std::max(max_work_bytes_, max_f32_bytes_);
  for (int i = 0; i < 3; ++i) {
    STRATA_ASSIGN_OR_RETURN(AlignedBuffer b, host_alloc(staging_bytes, "staging buffers"));
    staging_.push_back(std::move(b));
  }
  for (auto& b : staging_) free_staging_.push_back(&b);
  return Status::ok();
}

Result<AlignedBuffer*> OffloadEngine::take_staging() {
  while (free_staging_.empty()) {
    if (pending_grads_.empty()) return internal_error("no staging buffer free and none draining");
    STRATA_RETURN_IF_ERROR(drain_one_grad());
  }
  AlignedBuffer* b = free_staging_.back();
  free_staging_.pop_back();
  return b;
}

void OffloadEngine::give_staging(AlignedBuffer* b) { free_staging_.push_back(b); }

Status OffloadEngine::nvme_read(const io::Extent& x, void* buf, std::size_t bytes) {
  stats_.nvme_read_bytes += bytes;
  return swap_->read(x, 0, buf, bytes).wait();
}

Status OffloadEngine::nvme_write(const io::Extent& x, const void* buf, std::size_t bytes) {
  stats_.nvme_write_bytes += bytes;
  return swap_->write(x, 0, buf, bytes).wait();
}

// ---- parameters ----

Status OffloadEngine::start_fetch(Group& g) {
  if (g.work_d.empty()) {
    STRATA_ASSIGN_OR_RETURN(g.work_d,
                            device_.allocate(g.work_bytes, "parameters of " + g.spec->name));
  }
  if (options_.offload_param == Offload::kCpu) {
    auto& h2d = device_.stream(device::StreamKind::kHostToDevice);
    device_.copy_to_device(g.work_d.data(), g.work_h.data(), g.work_bytes, h2d);
    g.fetch_done = device_.record_event(h2d);
    stats_.h2d_bytes += g.work_bytes;
  } else {
    STRATA_ASSIGN_OR_RETURN(g.fetch_staging, take_staging());
    g.fetch_io = swap_->read(g.work_x, 0, g.fetch_staging->data(), g.work_io_bytes);
    stats_.nvme_read_bytes += g.work_io_bytes;
  }
  g.fetch_started = true;
  return Status::ok();
}

void OffloadEngine::prefetch_params(int group) {
  if (options_.offload_param == Offload::kNone) return;
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  if (g.fetch_started) return;
  if (options_.offload_param == Offload::kNvme && free_staging_.empty()) return;
  // A prefetch is only a hint: if the device has no room yet, acquire will fetch on demand.
  Status s = start_fetch(g);
  if (!s.is_ok()) {
    log_debug("prefetch of " + g.spec->name + " deferred: " + s.message());
    g.work_d.reset();
  }
}

Result<const void*> OffloadEngine::acquire_params(int group) {
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  if (options_.offload_param == Offload::kNone) return static_cast<const void*>(g.work_d.data());
  Stopwatch wait;
  if (!g.fetch_started) STRATA_RETURN_IF_ERROR(start_fetch(g));
  if (g.fetch_staging != nullptr) {  // NVMe read in flight: land it, then copy to the device
    Status io = g.fetch_io.wait();
    g.fetch_io = io::IoHandle();
    if (!io.is_ok()) {
      give_staging(g.fetch_staging);
      g.fetch_staging = nullptr;
      g.fetch_started = false;
      g.work_d.reset();
      return io.with_context("fetching parameters of " + g.spec->name + " from NVMe");
    }
    auto& h2d = device_.stream(device::StreamKind::kHostToDevice);
    device_.copy_to_device(g.work_d.data(), g.fetch_staging->data(), g.work_bytes, h2d);
    g.fetch_done = device_.record_event(h2d);
    stats_.h2d_bytes += g.work_bytes;
    g.fetch_done.synchronize();  // the staging buffer is reused once the copy has left it
    give_staging(g.fetch_staging);
    g.fetch_staging = nullptr;
  }
  device_.wait_event(device_.stream(device::StreamKind::kCompute), g.fetch_done);
  ++g.param_refs;
  stats_.wait_ms += wait.elapsed_ms();
  return static_cast<const void*>(g.work_d.data());
}

void OffloadEngine::release_params(int group) {
  if (options_.offload_param == Offload::kNone) return;
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  STRATA_CHECK(g.param_refs > 0, "release_params without acquire", g.spec->name);
  if (--g.param_refs == 0) {
    g.work_d.reset();
    g.fetch_started = false;
    g.fetch_done = device::Event();
  }
}

// ---- gradients ----

Result<void*> OffloadEngine::acquire_grads(int group) {
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  STRATA_CHECK(g.grad_d.empty(), "acquire_grads twice without release", g.spec->name);
  STRATA_ASSIGN_OR_RETURN(g.grad_d, device_.allocate(g.work_bytes, "gradient of " + g.spec->name));
  device_.fill_zero(g.grad_d.data(), g.work_bytes, device_.stream(device::StreamKind::kCompute));
  return g.grad_d.data();
}

Status OffloadEngine::accumulate_grad(Group& g, const void* grad) {
  float* acc = g.grad_h.as<float>();
  const std::size_t n = static_cast<std::size_t>(g.n);
  if (options_.compute_dtype == DType::kF32) {
    const float* src = static_cast<const float*>(grad);
    for (std::size_t i = 0; i < n; ++i) acc[i] += src[i];
  } else {
    for (std::size_t i = 0; i < n; ++i) acc[i] += load_as_f32(grad, options_.compute_dtype, i);
  }
  return Status::ok();
}

Status OffloadEngine::release_grads(int group) {
  Group& g = *groups_.at(static_cast<std::size_t>(group));
  STRATA_CHECK(!g.grad_d.empty(), "release_grads without acquire", g.spec->name);
  const auto& ops = device_.ops();
  if (options_.offload_optimizer == Offload::kNone) {
    void* src = g.grad_d.data();
    if (options_.compute_dtype != DType::kF32) {
      ops.cast(src, options_.compute_dtype, grad_f32_scratch_.data(), DType::kF32, g.n);
      src = grad_f32_scratch_.data();
    }
    ops.add(g.grad_acc_d.data(), src, g.grad_acc_d.data(), g.n, DType::kF32);
    g.grad_d.reset();
    return Status::ok();
  }
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer * staging, take_staging());
  auto& d2h = device_.stream(device::StreamKind::kDeviceToHost);
  device_.wait_event(d2h, device_.record_event(device_.stream(device::StreamKind::kCompute)));
  device_.copy_to_host(staging->data(), g.grad_d.data(), g.work_bytes, d2h);
  stats_.d2h_bytes += g.work_bytes;
  pending_grads_.push_back(
      PendingGrad{group, std::move(g.grad_d), staging, device_.record_event(d2h)});
  // Keep at most one transfer behind the compute so staging stays available for fetches.
  while (pending_grads_.size() > 1) STRATA_RETURN_IF_ERROR(drain_one_grad());
  return Status::ok();
}

Status OffloadEngine::drain_one_grad() {
  PendingGrad p = std::move(pending_grads_.front());
  pending_grads_.pop_front();
  p.done.synchronize();
  p.buffer.reset();
  Status s = accumulate_grad(*groups_[static_cast<std::size_t>(p.group)], p.staging->data());
  give_staging(p.staging);
  return s;
}

Status OffloadEngine::finish_micro_batch() {
  while (!pending_grads_.empty()) STRATA_RETURN_IF_ERROR(drain_one_grad());
  return device_.last_error();
}

Result<double> OffloadEngine::grad_sum_squares(int group) {
  STRATA_RETURN_IF_ERROR(finish_micro_batch());
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
      device_.copy_to_device(g.work_d.data(), src, g.work_bytes, h2d);
      stats_.h2d_bytes += g.work_bytes;
      device_.record_event(h2d).synchronize();
      return Status::ok();
    }
    case Offload::kCpu:
      if (src != g.work_h.data()) std::memcpy(g.work_h.data(), src, g.work_bytes);
      return Status::ok();
    case Offload::kNvme:
      return nvme_write(g.work_x, src, g.work_io_bytes)
          .with_context("writing parameters of " + g.spec->name + " to NVMe");
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
      optim::cpu_adamw_step(a);
      if (out != nullptr) {
        Status s = store_working_copy(*g, out->data());
        give_staging(out);
        STRATA_RETURN_IF_ERROR(s);
      }
    }
  } else {
    // NVMe: read group i+1's state while group i is updated; writes of i-1 finish before its
    // buffers are reused.
    io::IoHandle reads[2][3], writes[2][3];
    auto start_reads = [&](std::size_t gi) {
      Group& g = *groups_[gi];
      const io::Extent* xs[3] = {&g.master_x, &g.m_x, &g.v_x};
      for (int k = 0; k < 3; ++k) {
        reads[gi % 2][k] = swap_->read(*xs[k], 0, opt_buf_[gi % 2][k].data(), g.f32_io_bytes);
        stats_.nvme_read_bytes += g.f32_io_bytes;
      }
    };
    Status first_error;
    auto wait_all = [&](io::IoHandle(&hs)[3]) {
      for (auto& h : hs) {
        if (!h.valid()) continue;
        Status s = h.wait();
        if (!s.is_ok() && first_error.is_ok()) first_error = s;
        h = io::IoHandle();
      }
    };
    if (!groups_.empty()) start_reads(0);
    for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
      Group& g = *groups_[gi];
      const std::size_t slot = gi % 2;
      wait_all(reads[slot]);
      if (gi + 1 < groups_.size()) {
        wait_all(writes[(gi + 1) % 2]);
        if (first_error.is_ok()) start_reads(gi + 1);
      }
      if (!first_error.is_ok()) break;
      STRATA_ASSIGN_OR_RETURN(AlignedBuffer * out, take_staging());
      device::AdamWArgs a = base;
      a.param = opt_buf_[slot][0].as<float>();
      a.grad = g.grad_h.data();
      a.grad_dtype = DType::kF32;
      a.exp_avg = opt_buf_[slot][1].as<float>();
      a.exp_avg_sq = opt_buf_[slot][2].as<float>();
      a.n = g.n;
      a.param_out = out->data();
      a.out_dtype = options_.compute_dtype;
      optim::cpu_adamw_step(a);
      const io::Extent* xs[3] = {&g.master_x, &g.m_x, &g.v_x};
      for (int k = 0; k < 3; ++k) {
        writes[slot][k] = swap_->write(*xs[k], 0, opt_buf_[slot][k].data(), g.f32_io_bytes);
        stats_.nvme_write_bytes += g.f32_io_bytes;
      }
      Status s = store_working_copy(g, out->data());
      give_staging(out);
      if (!s.is_ok()) {
        first_error = s;
        break;
      }
    }
    for (auto& set : reads) wait_all(set);
    for (auto& set : writes) wait_all(set);
    if (!first_error.is_ok()) return first_error.with_context("optimizer step on NVMe");
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
