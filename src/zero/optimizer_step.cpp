// OptimizerStep: AdamW in place on the device or in host memory, or streamed from NVMe.
#include "strata/zero/optimizer_step.h"

#include <optional>
#include <utility>
#include <vector>

#include "strata/optim/streamed_adam.h"

namespace strata::zero {
namespace {

// Device or host: every array pinned where it lives, one group after another.
class InPlaceStep final : public OptimizerStep {
 public:
  // `cpu_adam` null: the device's adamw op on device-resident state.
  InPlaceStep(device::Device& device, std::optional<optim::CpuAdam> cpu_adam)
      : device_(device), cpu_adam_(std::move(cpu_adam)) {}

  Status run(const StepIo& io, const device::AdamWArgs& base) override {
    const Tier tier = cpu_adam_ ? Tier::kHost : Tier::kDevice;
    for (std::size_t gi = 0; gi < io.groups.size(); ++gi) {
      const StepGroup& g = io.groups[gi];
      const mem::Handle state[] = {g.master, g.exp_avg, g.exp_avg_sq};
      void* ptr[3] = {};
      for (int k = 0; k < 3; ++k) {
        STRATA_ASSIGN_OR_RETURN(ptr[k], io.store.acquire(state[k], tier));
      }
      STRATA_ASSIGN_OR_RETURN(void* grad, io.store.acquire(g.grad, tier));
      STRATA_ASSIGN_OR_RETURN(void* out, io.open_output(gi, tier));
      device::AdamWArgs a = base;
      a.param = static_cast<float*>(ptr[0]);
      a.exp_avg = static_cast<float*>(ptr[1]);
      a.exp_avg_sq = static_cast<float*>(ptr[2]);
      a.grad = grad;
      a.grad_dtype = io.grad_dtype;
      a.n = g.num_elems;
      a.param_out = out;
      a.out_dtype = io.out_dtype;
      if (cpu_adam_) {
        // No finite scan: the trainer skips a step whose gradient norm is not finite, so a
        // scan here would re-read every gradient for nothing.
        const optim::StepOutcome outcome = cpu_adam_->step(a, /*check_finite=*/false);
        STRATA_CHECK(outcome == optim::StepOutcome::kUpdated, "an unchecked CpuAdam step skipped");
      } else {
        device_.ops().adamw(a);
      }
      for (const mem::Handle h : state) {
        io.store.mark_dirty(h, tier);
        io.store.unpin(h, tier);
      }
      io.store.unpin(g.grad, tier);
      STRATA_RETURN_IF_ERROR(io.close_output(gi, tier));
    }
    return Status::ok();
  }

 private:
  device::Device& device_;
  std::optional<optim::CpuAdam> cpu_adam_;
};

// NVMe: the state streams through optim::StreamedAdam in sub-groups (read i+1 while i is
// updated and i-1 written back) straight on the store's NVMe homes, gradients with it when they
// live there too; each group's working copy is written to a host copy and sent home as soon as
// the group is done.
class StreamedStep final : public OptimizerStep {
 public:
  StreamedStep(optim::CpuAdam cpu_adam, bool stream_grads)
      : cpu_adam_(std::move(cpu_adam)), stream_grads_(stream_grads) {}

  Status init(io::SwapSpace& swap, const OptimizerStepOptions& options) {
    optim::StreamedAdamOptions so;
    so.sub_group_size = options.sub_group_size;
    so.max_segment_elems = options.max_group_elems;
    so.check_finite = false;  // the trainer skips steps whose gradient norm is not finite
    so.stream_grads = stream_grads_;
    STRATA_ASSIGN_OR_RETURN(optim::StreamedAdam streamed,
                            optim::StreamedAdam::create(swap, cpu_adam_, so));
    streamed_.emplace(std::move(streamed));
    return Status::ok();
  }

  Status run(const StepIo& io, const device::AdamWArgs& base) override {
    read_ = written_ = 0;
    std::vector<optim::StreamedSegment> segments;
    // Closed however the step ends: homes opened for direct I/O (and whether the step writes
    // them: the gradients are only read), and gradients pinned in host memory.
    std::vector<std::pair<mem::Handle, bool>> opened;
    std::vector<mem::Handle> pinned;
    const auto open = [&](mem::Handle h, bool write, io::Extent& x) -> Status {
      STRATA_ASSIGN_OR_RETURN(x, io.store.begin_direct_io(h));
      opened.emplace_back(h, write);
      return Status::ok();
    };
    Status s;
    for (const StepGroup& g : io.groups) {
      optim::StreamedSegment seg;
      seg.name = g.name;
      s = open(g.master, true, seg.master);
      if (s.is_ok()) s = open(g.exp_avg, true, seg.exp_avg);
      if (s.is_ok()) s = open(g.exp_avg_sq, true, seg.exp_avg_sq);
      if (s.is_ok() && stream_grads_) s = open(g.grad, false, seg.grad_extent);
      if (s.is_ok() && !stream_grads_) {
        auto p = io.store.acquire(g.grad, Tier::kHost);
        s = p.status();
        if (p.is_ok()) {
          seg.grad = *p;
          pinned.push_back(g.grad);
        }
      }
      if (!s.is_ok()) break;
      seg.grad_dtype = io.grad_dtype;
      seg.num_elems = g.num_elems;
      seg.out_dtype = io.out_dtype;
      segments.push_back(seg);
    }
    const bool ran = s.is_ok();  // else nothing was written: every home keeps its data
    if (ran) {
      auto report = streamed_->step(
          segments, base, [&](std::size_t gi) { return io.close_output(gi, Tier::kHost); },
          [&](std::size_t gi) { return io.open_output(gi, Tier::kHost); });
      s = report.status();
      if (report.is_ok()) {
        read_ = report->bytes_read;
        written_ = report->bytes_written;
      }
    }
    for (const mem::Handle h : pinned) io.store.unpin(h, Tier::kHost);
    for (const auto& [h, write] : opened) io.store.end_direct_io(h, write && ran, s.is_ok());
    return s.is_ok() ? s : s.with_context("optimizer step on NVMe");
  }

  std::uint64_t bytes_read() const override { return read_; }
  std::uint64_t bytes_written() const override { return written_; }

 private:
  optim::CpuAdam cpu_adam_;  // before streamed_, which uses it
  bool stream_grads_;
  std::optional<optim::StreamedAdam> streamed_;
  std::uint64_t read_ = 0, written_ = 0;
};

}  // namespace

std::string_view optimizer_overlap_name(OptimizerOverlap overlap) {
  return overlap == OptimizerOverlap::kNone ? "none" : "forward";
}

Result<std::unique_ptr<OptimizerStep>> make_optimizer_step(Tier tier, device::Device& device,
                                                           io::SwapSpace* swap,
                                                           const OptimizerStepOptions& options) {
  using Step = std::unique_ptr<OptimizerStep>;
  if (tier == Tier::kDevice) return Step(std::make_unique<InPlaceStep>(device, std::nullopt));
  STRATA_ASSIGN_OR_RETURN(optim::CpuAdam adam, optim::CpuAdam::create(options.cpu_adam));
  if (tier == Tier::kHost) return Step(std::make_unique<InPlaceStep>(device, std::move(adam)));
  STRATA_CHECK(swap != nullptr, "an NVMe optimizer step without a swap space");
  auto step = std::make_unique<StreamedStep>(std::move(adam), options.stream_grads);
  STRATA_RETURN_IF_ERROR(step->init(*swap, options));
  return Step(std::move(step));
}

}  // namespace strata::zero
