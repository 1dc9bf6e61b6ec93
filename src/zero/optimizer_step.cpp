// OptimizerStep: AdamW in place on the device or in host memory, or streamed from NVMe.
#include "strata/zero/optimizer_step.h"

#include <array>
#include <optional>
#include <utility>
#include <vector>

#include "strata/core/rng.h"
#include "strata/optim/state_layout.h"
#include "strata/optim/streamed_adam.h"

namespace strata::zero {
namespace {

// The groups in the order the step updates them.
std::vector<std::size_t> step_order(const StepIo& io) {
  if (!io.order.empty()) return {io.order.begin(), io.order.end()};
  std::vector<std::size_t> order(io.groups.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  return order;
}

// Device or host: every array pinned where it lives, one group after another; with shadow
// state, the step reads the state and writes the shadow (out of place: no copy first).
class InPlaceStep final : public OptimizerStep {
 public:
  // `cpu_adam` null: the device's adamw op on device-resident state. With it, CpuAdam updates
  // the state in `tier`, which must be host memory (the host tier, or a host-addressable
  // device's memory).
  InPlaceStep(device::Device& device, Tier tier, std::optional<optim::CpuAdam> cpu_adam)
      : device_(device), tier_(tier), cpu_adam_(std::move(cpu_adam)) {}

  Status run(const StepIo& io, const device::AdamWArgs& base) override {
    const Tier tier = tier_;
    for (const std::size_t gi : step_order(io)) {
      if (io.ready) STRATA_RETURN_IF_ERROR(io.ready(gi, /*wait=*/true).status());
      const StepGroup& g = io.groups[gi];
      const mem::Handle in[] = {g.master, g.exp_avg, g.exp_avg_sq};
      const mem::Handle shadow[] = {g.master_out, g.exp_avg_out, g.exp_avg_sq_out};
      const bool shadowed = g.master_out != mem::Handle::kInvalid;
      STRATA_CHECK(!shadowed || tier == Tier::kHost, "shadow state on the device", g.name);
      STRATA_CHECK(!shadowed || cpu_adam_.has_value(), "shadow state without the host optimizer",
                   g.name);
      const mem::Handle* out = shadowed ? shadow : in;
      // Pinned so far, to be let go however this ends: the inputs, then the shadow outputs.
      void* src[3] = {};
      void* dst[3] = {};
      const auto unpin_all = [&] {
        for (int k = 0; k < 3; ++k) {
          if (src[k] != nullptr) io.store.unpin(in[k], tier);
          if (shadowed && dst[k] != nullptr) io.store.unpin(out[k], tier);
        }
      };
      Status s = [&]() -> Status {
        for (int k = 0; k < 3; ++k) {
          STRATA_ASSIGN_OR_RETURN(src[k], io.store.acquire(in[k], tier));
          if (!shadowed) continue;
          // The shadow is overwritten whole: no need for what it held.
          STRATA_ASSIGN_OR_RETURN(dst[k], io.store.emplace(out[k], tier, /*zero_fill=*/false));
        }
        return Status::ok();
      }();
      if (!s.is_ok()) {
        unpin_all();
        return s;
      }
      void* const* ptr = shadowed ? dst : src;
      auto grad = io.store.acquire(g.grad, tier);
      if (!grad.is_ok()) {
        unpin_all();
        return grad.status();
      }
      auto param_out = io.open_output(gi, tier);
      if (!param_out.is_ok()) {
        unpin_all();
        io.store.unpin(g.grad, tier);
        return param_out.status();
      }
      device::AdamWArgs a = base;
      a.param = ptr[0];
      a.exp_avg = ptr[1];
      a.exp_avg_sq = ptr[2];
      optim::attach_aux_planes(a, g.num_elems, ptr[0], ptr[1], ptr[2]);
      if (shadowed) {
        a.param_in = src[0];
        a.exp_avg_in = src[1];
        a.exp_avg_sq_in = src[2];
        optim::attach_aux_planes_in(a, g.num_elems, src[0], src[1], src[2]);
      }
      a.grad = *grad;
      a.grad_dtype = io.grad_dtype;
      a.n = g.num_elems;
      a.rounding_seed = splitmix64_at(base.rounding_seed, static_cast<std::uint64_t>(g.id));
      a.element_offset = g.element_offset;
      a.param_out = *param_out;
      a.out_dtype = io.out_dtype;
      if (cpu_adam_) {
        // No finite scan: the trainer skips a step whose gradient norm is not finite, so a
        // scan here would re-read every gradient for nothing.
        const optim::StepOutcome outcome = cpu_adam_->step(a, /*check_finite=*/false);
        STRATA_CHECK(outcome == optim::StepOutcome::kUpdated, "an unchecked CpuAdam step skipped");
      } else {
        device_.ops().adamw(a);
      }
      for (int k = 0; k < 3; ++k) io.store.mark_dirty(out[k], tier);
      unpin_all();
      io.store.unpin(g.grad, tier);
      STRATA_RETURN_IF_ERROR(io.close_output(gi, tier));
    }
    return Status::ok();
  }

 private:
  device::Device& device_;
  const Tier tier_;
  std::optional<optim::CpuAdam> cpu_adam_;
};

// NVMe: the state streams through optim::StreamedAdam in sub-groups (read i+1 while i is
// updated and i-1 written back) as ranges of the store's NVMe homes (written to the shadow homes
// when there are some), through the store's range staging; each gradient with it from its host
// copy or, when it has none, its NVMe home; each group's working copy is written to a host copy
// and sent home as soon as the group is done.
class StreamedStep final : public OptimizerStep, private optim::SegmentStorage {
 public:
  StreamedStep(mem::TieredStore& store, optim::CpuAdam cpu_adam, bool stream_grads)
      : store_(store), cpu_adam_(std::move(cpu_adam)), stream_grads_(stream_grads) {}

  Status init(const OptimizerStepOptions& options) {
    optim::StreamedAdamOptions so;
    so.sub_group_size = options.sub_group_size;
    so.max_segment_elems = options.max_group_elems;
    so.check_finite = false;  // the trainer skips steps whose gradient norm is not finite
    so.stream_grads = stream_grads_;
    so.master_layout = options.master_layout;
    so.moment_layout = options.moment_layout;
    STRATA_ASSIGN_OR_RETURN(optim::StreamedAdam streamed,
                            optim::StreamedAdam::create(cpu_adam_, so, store_.range_staging()));
    streamed_.emplace(std::move(streamed));
    return Status::ok();
  }

  Status run(const StepIo& io, const device::AdamWArgs& base) override {
    read_ = written_ = 0;
    const std::vector<std::size_t> order = step_order(io);
    std::vector<optim::StreamedSegment> segments;
    segments_.assign(order.size(), SegmentHomes{});
    // Closed however the step ends: homes opened for ranged I/O (and whether the step writes
    // them), and each segment's gradient while the step holds it.
    std::vector<std::pair<mem::Handle, bool>> opened;
    const auto open = [&](mem::Handle h, bool write) -> Status {
      STRATA_RETURN_IF_ERROR(io.store.open_ranges(h));
      opened.emplace_back(h, write);
      return Status::ok();
    };
    enum class Held : std::uint8_t { kNone, kHost, kRanges };
    std::vector<Held> held(order.size(), Held::kNone);
    const auto let_go = [&](std::size_t si, bool ok) {
      const mem::Handle h = io.groups[order[si]].grad;
      if (held[si] == Held::kHost) io.store.unpin(h, Tier::kHost);
      if (held[si] == Held::kRanges) io.store.close_ranges(h, false, ok);
      held[si] = Held::kNone;
    };
    Status s;
    for (std::size_t si = 0; si < order.size(); ++si) {
      const StepGroup& g = io.groups[order[si]];
      const bool shadowed = g.master_out != mem::Handle::kInvalid;
      SegmentHomes& homes = segments_[si];
      homes.in = {g.master, g.exp_avg, g.exp_avg_sq, g.grad};
      homes.out = shadowed ? std::array{g.master_out, g.exp_avg_out, g.exp_avg_sq_out}
                           : std::array{g.master, g.exp_avg, g.exp_avg_sq};
      for (int k = 0; k < 3 && s.is_ok(); ++k) s = open(homes.in[k], !shadowed);
      for (int k = 0; k < 3 && s.is_ok() && shadowed; ++k) s = open(homes.out[k], true);
      if (!s.is_ok()) break;
      optim::StreamedSegment seg;
      seg.name = g.name;
      seg.grad_dtype = io.grad_dtype;
      seg.num_elems = g.num_elems;
      seg.out_dtype = io.out_dtype;
      seg.rounding_seed = splitmix64_at(base.rounding_seed, static_cast<std::uint64_t>(g.id));
      seg.element_offset = g.element_offset;
      segments.push_back(seg);
    }
    // A segment's gradient once it is final: its host copy when it has a valid one, else
    // (gradients homed on NVMe) read from the home with the state.
    const auto ready = [&](std::size_t si,
                           bool wait) -> Result<std::optional<optim::StreamedAdam::SegmentGrad>> {
      const std::size_t gi = order[si];
      if (io.ready) {
        STRATA_ASSIGN_OR_RETURN(const bool final, io.ready(gi, wait));
        if (!final) return std::optional<optim::StreamedAdam::SegmentGrad>();
      }
      const mem::Handle h = io.groups[gi].grad;
      optim::StreamedAdam::SegmentGrad grad;
      if (stream_grads_ && !io.store.residency(h).valid[static_cast<int>(Tier::kHost)]) {
        STRATA_RETURN_IF_ERROR(io.store.open_ranges(h));
        grad.streamed = true;
        held[si] = Held::kRanges;
      } else {
        STRATA_ASSIGN_OR_RETURN(grad.grad, io.store.acquire(h, Tier::kHost));
        held[si] = Held::kHost;
      }
      return std::optional<optim::StreamedAdam::SegmentGrad>(grad);
    };
    const bool ran = s.is_ok();  // else nothing was written: every home keeps its data
    if (ran) {
      auto report = streamed_->step(
          segments, *this, base,
          [&](std::size_t si) {
            let_go(si, true);
            return io.close_output(order[si], Tier::kHost);
          },
          [&](std::size_t si) { return io.open_output(order[si], Tier::kHost); }, ready);
      s = report.status();
      if (report.is_ok()) {
        read_ = report->bytes_read;
        written_ = report->bytes_written;
      }
    }
    for (std::size_t si = 0; si < held.size(); ++si) let_go(si, true);
    for (const auto& [h, write] : opened) io.store.close_ranges(h, write && ran, s.is_ok());
    return s.is_ok() || s.code() == StatusCode::kCancelled
               ? s
               : s.with_context("optimizer step on NVMe");
  }

  std::uint64_t bytes_read() const override { return read_; }
  std::uint64_t bytes_written() const override { return written_; }

 private:
  // Where segment si's arrays live: read from `in` (master, exp_avg, exp_avg_sq, gradient),
  // written to `out`.
  struct SegmentHomes {
    std::array<mem::Handle, 4> in{};
    std::array<mem::Handle, 3> out{};
  };

  io::IoHandle read(std::size_t segment, optim::StreamedArray array, std::uint64_t offset,
                    void* dst, std::size_t bytes) override {
    return store_.read_range(segments_[segment].in[static_cast<std::size_t>(array)], offset, dst,
                             bytes);
  }
  io::IoHandle write(std::size_t segment, optim::StreamedArray array, std::uint64_t offset,
                     const void* src, std::size_t bytes) override {
    return store_.write_range(segments_[segment].out[static_cast<std::size_t>(array)], offset, src,
                              bytes);
  }

  mem::TieredStore& store_;  // the same as every StepIo's
  optim::CpuAdam cpu_adam_;  // before streamed_, which uses it
  bool stream_grads_;
  std::optional<optim::StreamedAdam> streamed_;
  std::vector<SegmentHomes> segments_;
  std::uint64_t read_ = 0, written_ = 0;
};

}  // namespace

Result<std::unique_ptr<OptimizerStep>> make_optimizer_step(Tier tier, device::Device& device,
                                                           mem::TieredStore& store,
                                                           const OptimizerStepOptions& options) {
  using Step = std::unique_ptr<OptimizerStep>;
  if (tier == Tier::kDevice && !device.host_addressable()) {
    return Step(std::make_unique<InPlaceStep>(device, tier, std::nullopt));
  }
  // Host memory, or a device whose memory is host memory (the CPU backend): the SIMD CpuAdam,
  // bit-identical to the device's adamw op (adamw_reference) and several times faster.
  STRATA_ASSIGN_OR_RETURN(optim::CpuAdam adam, optim::CpuAdam::create(options.cpu_adam));
  if (tier != Tier::kNvme)
    return Step(std::make_unique<InPlaceStep>(device, tier, std::move(adam)));
  auto step = std::make_unique<StreamedStep>(store, std::move(adam), options.stream_grads);
  STRATA_RETURN_IF_ERROR(step->init(options));
  return Step(std::move(step));
}

}  // namespace strata::zero
