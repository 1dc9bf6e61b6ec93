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
std::vector<std::size_t> step_order(const StepTarget& target) {
  const std::span<const std::size_t> asked = target.order();
  if (!asked.empty()) return {asked.begin(), asked.end()};
  std::vector<std::size_t> order(target.groups().size());
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

  Status run(StepTarget& target, const device::AdamWArgs& base) override {
    const Tier tier = tier_;
    for (const std::size_t gi : step_order(target)) {
      STRATA_RETURN_IF_ERROR(target.gradient_ready(gi, /*wait=*/true).status());
      const StepGroup& g = target.groups()[gi];
      STRATA_CHECK(!g.shadowed || tier == Tier::kHost, "shadow state on the device", g.name);
      STRATA_CHECK(!g.shadowed || cpu_adam_.has_value(), "shadow state without the host optimizer",
                   g.name);
      STRATA_ASSIGN_OR_RETURN(const PinnedState state, target.pin(gi, tier));
      auto param_out = target.open_output(gi, tier);
      if (!param_out.is_ok()) {
        target.unpin(gi, tier, /*written=*/false);
        return param_out.status();
      }
      device::AdamWArgs a = base;
      a.param = state.out[0];
      a.exp_avg = state.out[1];
      a.exp_avg_sq = state.out[2];
      optim::attach_aux_planes(a, g.num_elems, state.out[0], state.out[1], state.out[2]);
      if (g.shadowed) {
        a.param_in = state.in[0];
        a.exp_avg_in = state.in[1];
        a.exp_avg_sq_in = state.in[2];
        optim::attach_aux_planes_in(a, g.num_elems, state.in[0], state.in[1], state.in[2]);
      }
      a.grad = state.grad;
      a.grad_dtype = target.grad_dtype();
      a.n = g.num_elems;
      a.rounding_seed = splitmix64_at(base.rounding_seed, static_cast<std::uint64_t>(g.id));
      a.element_offset = g.element_offset;
      a.param_out = *param_out;
      a.out_dtype = target.out_dtype();
      if (cpu_adam_) {
        // No finite scan: the trainer skips a step whose gradient norm is not finite, so a
        // scan here would re-read every gradient for nothing.
        const optim::StepOutcome outcome = cpu_adam_->step(a, /*check_finite=*/false);
        STRATA_CHECK(outcome == optim::StepOutcome::kUpdated, "an unchecked CpuAdam step skipped");
      } else {
        device_.ops().adamw(a);
      }
      target.unpin(gi, tier, /*written=*/true);
      STRATA_RETURN_IF_ERROR(target.close_output(gi, tier));
    }
    return Status::ok();
  }

 private:
  device::Device& device_;
  const Tier tier_;
  std::optional<optim::CpuAdam> cpu_adam_;
};

// NVMe: the state streams through optim::StreamedAdam in sub-groups (read i+1 while i is
// updated and i-1 written back) as ranges of the target's homes, through the range staging; each
// gradient with it from its host copy or, when it has none, its NVMe home; each group's working
// copy is written to a host copy and closed as soon as the group is done.
class StreamedStep final : public OptimizerStep, private optim::SegmentStorage {
 public:
  StreamedStep(optim::CpuAdam cpu_adam, bool stream_grads)
      : cpu_adam_(std::move(cpu_adam)), stream_grads_(stream_grads) {}

  Status init(const OptimizerStepOptions& options, std::span<std::byte> staging) {
    optim::StreamedAdamOptions so;
    so.sub_group_size = options.sub_group_size;
    so.max_segment_elems = options.max_group_elems;
    so.check_finite = false;  // the trainer skips steps whose gradient norm is not finite
    so.stream_grads = stream_grads_;
    so.master_layout = options.master_layout;
    so.moment_layout = options.moment_layout;
    STRATA_ASSIGN_OR_RETURN(optim::StreamedAdam streamed,
                            optim::StreamedAdam::create(cpu_adam_, so, staging));
    streamed_.emplace(std::move(streamed));
    return Status::ok();
  }

  Status run(StepTarget& target, const device::AdamWArgs& base) override {
    read_ = written_ = 0;
    target_ = &target;
    order_ = step_order(target);
    std::vector<optim::StreamedSegment> segments;
    // Each segment's gradient while the step holds it, let go however the step ends.
    std::vector<bool> held(order_.size(), false);
    const auto let_go = [&](std::size_t si) {
      if (held[si]) target.close_gradient(order_[si]);
      held[si] = false;
    };
    Status s;
    for (std::size_t si = 0; si < order_.size() && s.is_ok(); ++si) {
      const StepGroup& g = target.groups()[order_[si]];
      s = target.open_ranges(order_[si]);
      optim::StreamedSegment seg;
      seg.name = g.name;
      seg.grad_dtype = target.grad_dtype();
      seg.num_elems = g.num_elems;
      seg.out_dtype = target.out_dtype();
      seg.rounding_seed = splitmix64_at(base.rounding_seed, static_cast<std::uint64_t>(g.id));
      seg.element_offset = g.element_offset;
      segments.push_back(seg);
    }
    // A segment's gradient once it is final: its host copy when it has one, else (gradients
    // homed on NVMe) read from the home with the state.
    const auto ready = [&](std::size_t si,
                           bool wait) -> Result<std::optional<optim::StreamedAdam::SegmentGrad>> {
      const std::size_t gi = order_[si];
      STRATA_ASSIGN_OR_RETURN(const bool final, target.gradient_ready(gi, wait));
      if (!final) return std::optional<optim::StreamedAdam::SegmentGrad>();
      STRATA_ASSIGN_OR_RETURN(const void* host, target.open_gradient(gi));
      held[si] = true;
      optim::StreamedAdam::SegmentGrad grad;
      grad.grad = host;
      grad.streamed = host == nullptr;
      STRATA_CHECK(!grad.streamed || stream_grads_, "a gradient with no host copy", seg_name(si));
      return std::optional<optim::StreamedAdam::SegmentGrad>(grad);
    };
    const bool ran = s.is_ok();  // else nothing was written: every home keeps its data
    if (ran) {
      auto report = streamed_->step(
          segments, *this, base,
          [&](std::size_t si) {
            let_go(si);
            return target.close_output(order_[si], Tier::kHost);
          },
          [&](std::size_t si) { return target.open_output(order_[si], Tier::kHost); }, ready);
      s = report.status();
      if (report.is_ok()) {
        read_ = report->bytes_read;
        written_ = report->bytes_written;
      }
    }
    for (std::size_t si = 0; si < held.size(); ++si) let_go(si);
    target.close_ranges(ran, s.is_ok());
    target_ = nullptr;
    return s.is_ok() || s.code() == StatusCode::kCancelled
               ? s
               : s.with_context("optimizer step on NVMe");
  }

  std::uint64_t bytes_read() const override { return read_; }
  std::uint64_t bytes_written() const override { return written_; }

 private:
  const std::string& seg_name(std::size_t si) const { return target_->groups()[order_[si]].name; }
  io::IoHandle read(std::size_t segment, optim::StreamedArray array, std::uint64_t offset,
                    void* dst, std::size_t bytes) override {
    return target_->read_range(order_[segment], array, offset, dst, bytes);
  }
  io::IoHandle write(std::size_t segment, optim::StreamedArray array, std::uint64_t offset,
                     const void* src, std::size_t bytes) override {
    return target_->write_range(order_[segment], array, offset, src, bytes);
  }

  optim::CpuAdam cpu_adam_;  // before streamed_, which uses it
  bool stream_grads_;
  std::optional<optim::StreamedAdam> streamed_;
  StepTarget* target_ = nullptr;    // during run
  std::vector<std::size_t> order_;  // during run: segment -> the target's group
  std::uint64_t read_ = 0, written_ = 0;
};

}  // namespace

Result<std::unique_ptr<OptimizerStep>> make_optimizer_step(Tier tier, device::Device& device,
                                                           std::span<std::byte> staging,
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
  auto step = std::make_unique<StreamedStep>(std::move(adam), options.stream_grads);
  STRATA_RETURN_IF_ERROR(step->init(options, staging));
  return Step(std::move(step));
}

}  // namespace strata::zero
