// The memory plan: placements from the config and the budgets, and the bytes they take.
#include "strata/zero/plan.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "src/zero/plan_bytes.h"
#include "strata/core/aligned.h"
#include "strata/core/json.h"
#include "strata/core/summation_tree.h"
#include "strata/io/swap.h"
#include "strata/mem/host_memory.h"
#include "strata/mem/tiered_store.h"
#include "strata/optim/state_layout.h"
#include "strata/optim/streamed_adam.h"

namespace strata::zero {

using detail::count_bytes;
using detail::count_peaks;
using detail::Sizes;

std::string_view tensor_kind_name(TensorKind kind) {
  switch (kind) {
    case TensorKind::kParameters:
      return "parameters";
    case TensorKind::kGradients:
      return "gradients";
    case TensorKind::kMasterWeights:
      return "master weights";
    case TensorKind::kMoments:
      return "moments";
    case TensorKind::kStaging:
      return "staging";
    case TensorKind::kActivations:
      return "activations";
  }
  return "?";
}

std::uint64_t MemoryPlan::tier_bytes(Tier tier) const {
  std::uint64_t sum = 0;
  for (std::uint64_t b : bytes[static_cast<std::size_t>(tier)]) sum += b;
  return sum;
}

std::string MemoryPlan::kinds_text(Tier tier) const {
  std::string s;
  for (int k = 0; k < kNumTensorKinds; ++k) {
    const std::uint64_t b = kind_bytes(tier, static_cast<TensorKind>(k));
    if (b == 0) continue;
    s += std::string(s.empty() ? "" : ", ") +
         std::string(tensor_kind_name(static_cast<TensorKind>(k))) + " " + format_bytes(b);
  }
  return s;
}

std::string MemoryPlan::device_steps_text() const {
  if (!any_device_steps()) return "";
  int on_device = 0;
  for (const bool d : device_steps) on_device += d ? 1 : 0;
  char buf[192];
  std::snprintf(buf, sizeof buf,
                " (%.1f%% of its state; the %s backward reaches last stay%s on the %s and %s "
                "stepped there)",
                100.0 * offload_fraction,
                on_device == 1 ? "group" : (std::to_string(on_device) + " groups").c_str(),
                on_device == 1 ? "s" : "", std::string(tier_name(Tier::kDevice)).c_str(),
                on_device == 1 ? "is" : "are");
  return buf;
}

std::string MemoryPlan::describe() const {
  std::string s = "plan: parameters on " + std::string(tier_name(params)) +
                  (trained_params != params
                       ? " (the trained ones on " + std::string(tier_name(trained_params)) + ")"
                       : "") +
                  ", optimizer on " + std::string(tier_name(optimizer)) + device_steps_text() +
                  ", gradients " + (keep_gradients ? "kept as computed" : "accumulated in fp32") +
                  (!keep_gradients && accumulators > 1
                       ? " (the canonical tree: " + std::to_string(accumulators) +
                             " partial sums a group at once)"
                       : "") +
                  " on " + std::string(tier_name(gradients)) +
                  (accumulate_on_device()
                       ? ", sent to " + std::string(tier_name(Tier::kHost)) + " once per step"
                       : "") +
                  "\n";
  if (checkpoints != Tier::kDevice) {
    s += "  checkpointed activations wait for the backward on " +
         std::string(tier_name(checkpoints)) + "\n";
  }
  if (!state_note.empty()) s += "  optimizer state: " + state_note + "\n";
  s += "  optimizer step overlaps: " + std::string(optimizer_overlap_name(overlap)) +
       (held_copy      ? " (shadow optimizer state, and a copy for saves)"
        : shadow_state ? " (shadow optimizer state)"
                       : "") +
       (measure_overlap ? ", or none while that measures faster" : "") +
       (overlap_note.empty() ? "" : "; " + overlap_note) + "\n";
  for (Tier t : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
    const std::string kinds = kinds_text(t);
    s += "  " + std::string(tier_name(t)) + " " + format_bytes(tier_bytes(t)) + ": " +
         (kinds.empty() ? "nothing" : kinds);
    // The peak a run measures (its closing "peaks:" line): beyond these, the parameters in use,
    // ZeRO's buffers and what the store keeps for reuse while the budget has room.
    if (peak(t) > tier_bytes(t)) {
      s += "; peak " + format_bytes(peak(t)) + " with the working copies and buffers in use";
    }
    s += "\n";
  }
  if (collective_bytes != 0) {
    s += "  and on the " + std::string(tier_name(Tier::kDevice)) + ", ZeRO's collective buffers " +
         format_bytes(collective_bytes) +
         " at their peak (gathered parameters, gradients in reduction, buckets)\n";
  }
  return s;
}

std::string fraction_text(double f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", f);
  return buf;
}

namespace {

// The plan of the share `layout` by itself: placements, homes, buffers in flight, caches.
// "12 bytes a parameter: master weights fp32 4 + moments fp32 2 x 4", as the layouts store it.
std::string state_note(const PlanOptions& o, const optim::StateLayout& master,
                       const optim::StateLayout& moment) {
  const auto num = [](double b) {
    char buf[32];
    std::snprintf(buf, sizeof buf, b == static_cast<double>(static_cast<int>(b)) ? "%.0f" : "%.2f",
                  b);
    return std::string(buf);
  };
  const bool kahan =
      o.master_dtype == DType::kBF16 && o.master_rounding == device::MasterRounding::kKahan;
  const std::string master_what = o.master_dtype == DType::kF32 ? "fp32"
                                  : kahan                       ? "bf16 + Kahan compensation bf16"
                                                                : "bf16, stochastic rounding";
  const std::string moment_what = o.state_dtype == DType::kF32    ? "fp32"
                                  : o.state_dtype == DType::kBF16 ? "bf16"
                                                                  : "int8 + block scales";
  return num(optim::state_bytes_per_param(o.master_dtype, o.master_rounding, o.state_dtype)) +
         " bytes a trained parameter: master weights " + master_what + " " +
         num(master.bytes_per_elem()) + " + moments " + moment_what + " 2 x " +
         num(moment.bytes_per_elem());
}

Result<MemoryPlan> plan_share(const model::ParamLayout& layout, const PlanOptions& o) {
  const auto& groups = layout.groups();
  const bool any_frozen = std::any_of(groups.begin(), groups.end(),
                                      [](const model::ParamGroup& g) { return g.frozen; });
  // With the optimizer on the device the trained groups live there beside it; offload_param
  // then places the frozen base (LoRA's), and without one it would place nothing.
  if (!any_frozen && o.params != Tier::kDevice && o.optimizer == Tier::kDevice) {
    return invalid_argument(
        "offload_param '" + std::string(offload_name(o.params)) +
        "' needs offload_optimizer cpu or nvme (every parameter trains, and the optimizer on the "
        "device keeps the trained ones there; offload_param alone places a frozen base, as "
        "LoRA's)");
  }
  if ((o.params == Tier::kNvme || o.optimizer == Tier::kNvme) && !o.has_swap) {
    return invalid_argument("offload to nvme needs swap_paths (one or more directories)");
  }
  // A gradient as the model makes it, or as it lands summed over the ranks in f32.
  const std::uint64_t gsize = o.zero.wide_gradients ? 4 : dtype_size(o.compute_dtype);
  const optim::StateLayout master_layout = optim::master_layout(o.master_dtype, o.master_rounding);
  const optim::StateLayout moment_layout = optim::moment_layout(o.state_dtype);
  // offload_optimizer_fraction: the trained groups in backward order (the layout's, reversed)
  // go to the optimizer's tier while at least half of each falls within the fraction of the
  // trained elements; from the first that does not, the rest stay on the device.
  std::vector<bool> device_steps;
  if (o.optimizer != Tier::kDevice && o.offload_fraction < 1.0) {
    double trained = 0;
    for (const auto& g : groups) trained += g.frozen ? 0.0 : static_cast<double>(g.num_elems);
    device_steps.assign(groups.size(), false);
    double offloaded = 0;
    bool full = false;  // once a group stays, so do all that backward reaches after it
    for (std::size_t i = groups.size(); i-- > 0;) {
      if (groups[i].frozen || groups[i].num_elems == 0) continue;
      const auto n = static_cast<double>(groups[i].num_elems);
      full = full || offloaded + n / 2 > o.offload_fraction * trained;
      if (full) {
        device_steps[i] = true;
      } else {
        offloaded += n;
      }
    }
  }
  Sizes z;
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    const model::ParamGroup& g = groups[gi];
    const auto n = static_cast<std::uint64_t>(g.num_elems);
    const std::uint64_t work = model::working_bytes(g, o.compute_dtype);
    // A group's parameters and gradient (none when frozen) must fit on the device together.
    const std::uint64_t in_use = work + (g.frozen ? 0 : n * gsize);
    if (o.device_budget_bytes != 0 && in_use > o.device_budget_bytes) {
      return out_of_memory("parameter group '" + g.name + "' needs " + format_bytes(in_use) +
                           " on the device (parameters" + (g.frozen ? "" : " + gradient") +
                           "), more than device_memory_limit " +
                           format_bytes(o.device_budget_bytes));
    }
    z.max_work_io = std::max(z.max_work_io, align_up(work, io::kIoAlignBytes));
    z.elems.push_back(n);
    z.work_bytes.push_back(work);
    z.frozen.push_back(g.frozen);
    if (g.frozen) continue;
    z.max_grad_io = std::max(z.max_grad_io, align_up(n * gsize, io::kIoAlignBytes));
    z.max_f32_io = std::max(z.max_f32_io, align_up(n * 4, io::kIoAlignBytes));
    if (gi < device_steps.size() && device_steps[gi]) {
      z.on_device.elems += n;
      z.on_device.f32 += n * 4;
      z.on_device.moment += moment_layout.bytes(g.num_elems);
      z.on_device.master += master_layout.bytes(g.num_elems);
      continue;
    }
    z.trained.push_back(n);
    z.max_grad_io_off = std::max(z.max_grad_io_off, align_up(n * gsize, io::kIoAlignBytes));
    z.max_f32_io_off = std::max(z.max_f32_io_off, align_up(n * 4, io::kIoAlignBytes));
    z.grad_work_io += align_up(n * gsize, io::kIoAlignBytes);
    z.f32 += n * 4;
    z.f32_io += align_up(n * 4, io::kIoAlignBytes);
    z.moment += moment_layout.bytes(g.num_elems);
    z.master += master_layout.bytes(g.num_elems);
    z.master_io += align_up(master_layout.bytes(g.num_elems), io::kIoAlignBytes);
    z.moment_io += align_up(moment_layout.bytes(g.num_elems), io::kIoAlignBytes);
    z.max_elems = std::max(z.max_elems, g.num_elems);
  }

  MemoryPlan plan;
  plan.state_note = state_note(o, master_layout, moment_layout);
  plan.params = o.params;
  plan.trained_params = o.optimizer == Tier::kDevice ? Tier::kDevice : o.params;
  plan.optimizer = o.optimizer;
  plan.device_steps = std::move(device_steps);
  if (plan.any_device_steps()) {
    const double offloaded = static_cast<double>(z.f32) / 4;
    plan.offload_fraction = offloaded / (offloaded + static_cast<double>(z.on_device.elems));
  }
  plan.checkpoints = o.checkpoint_home;
  if (o.checkpoint_home == Tier::kNvme && !o.has_swap) {
    return invalid_argument("checkpointed activations on nvme need swap_paths");
  }
  plan.keep_gradients = o.accumulation_steps == 1 && o.optimizer != Tier::kDevice;
  plan.tree_sums = o.tree_sums;
  plan.gradient_dtype = o.zero.wide_gradients ? DType::kF32 : o.compute_dtype;
  plan.accumulation_steps = std::max<std::int64_t>(o.accumulation_steps, 1);
  plan.accumulators =
      plan.keep_gradients ? 1 : SummationTree::buffers_needed(plan.accumulation_steps, o.tree_sums);
  // NVMe <-> device moves, whole-tensor reads and writes of NVMe homes, and copies between the
  // device and unpinned caller memory (loading, checkpoints) go through the store's pool in
  // chunks; 8 MiB keeps several reads in flight at a size the drive handles at full speed.
  // Without NVMe one buffer will do.
  plan.staging_buffer_bytes =
      std::min<std::size_t>(std::max(z.max_work_io, z.max_f32_io), std::size_t{8} << 20);
  plan.num_staging_buffers =
      o.params == Tier::kNvme || o.optimizer == Tier::kNvme || o.checkpoint_home == Tier::kNvme ? 4
                                                                                                : 1;
  const auto place = [&](Tier gradients) {
    plan.gradients = gradients;
    plan.optimizer_staging_bytes = 0;
    if (o.optimizer == Tier::kNvme && !z.trained.empty()) {  // none: the device steps them all
      optim::StreamedAdamOptions so;
      so.sub_group_size = o.sub_group_size;
      so.max_segment_elems = z.max_elems;
      so.stream_grads = gradients == Tier::kNvme;
      so.master_layout = master_layout;
      so.moment_layout = moment_layout;
      plan.optimizer_staging_bytes = optim::StreamedAdam::staging_bytes_for(so);
    }
    count_bytes(z, o, plan);
  };
  const auto fits = [&] {
    return o.host_budget_bytes == 0 || plan.tier_bytes(Tier::kHost) <= o.host_budget_bytes;
  };
  // The schedule: a device step is ordered on the device's stream; the guess beside backward
  // needs the shadow state, on NVMe beside the state, in host memory only if the budget holds it.
  const bool automatic = o.overlap == OptimizerOverlap::kAuto;
  const OptimizerOverlap asked = automatic ? OptimizerOverlap::kBackward : o.overlap;
  plan.overlap = o.optimizer == Tier::kDevice ? OptimizerOverlap::kNone : asked;
  plan.measure_overlap = automatic && plan.overlap != OptimizerOverlap::kNone;
  if (o.optimizer == Tier::kDevice && o.overlap != OptimizerOverlap::kNone) {
    plan.overlap_note = "the optimizer runs on the device, ordered with compute on its stream";
  }
  if (o.hold_state && plan.any_device_steps()) {
    return invalid_argument(
        "save_async sets a saved step's optimizer state aside in the optimizer's tier, and "
        "offload_optimizer_fraction " +
        fraction_text(o.offload_fraction) +
        " keeps part of it on the device; set offload_optimizer_fraction to 1, or save_async "
        "false");
  }
  if (o.hold_state && o.optimizer == Tier::kDevice) {
    return invalid_argument(
        "save_async sets a saved step's optimizer state aside in the optimizer's tier, and the "
        "optimizer's tier is the device; set offload_optimizer to cpu or nvme, or save_async "
        "false");
  }
  plan.shadow_state = plan.overlap == OptimizerOverlap::kBackward || o.hold_state;
  plan.held_copy = o.hold_state;
  // Gradients live beside the optimizer; with the optimizer on NVMe, in host memory when the
  // host budget holds them there (no extra NVMe traffic), else on NVMe.
  place(o.optimizer == Tier::kNvme ? Tier::kHost : o.optimizer);
  if (!fits() && o.optimizer == Tier::kNvme) place(Tier::kNvme);
  // Or summed over the micro-batches on the device, where that is asked for or pays and fits.
  const bool may_sum_on_device = o.optimizer != Tier::kDevice && o.accumulation_steps > 1;
  if (may_sum_on_device && o.grad_accumulation != GradAccumulation::kHost &&
      (o.grad_accumulation == GradAccumulation::kDevice || !o.host_addressable_device)) {
    const Tier before = plan.gradients;
    place(Tier::kDevice);
    const std::uint64_t device_needed = plan.tier_bytes(Tier::kDevice) + plan.group_in_use_bytes;
    const bool device_fits = o.device_budget_bytes == 0 || device_needed <= o.device_budget_bytes;
    if (!device_fits || !fits()) {
      if (o.grad_accumulation == GradAccumulation::kDevice) {
        return out_of_memory("grad_accumulation 'device' needs " + format_bytes(device_needed) +
                             " of device memory (" + plan.kinds_text(Tier::kDevice) + ")" +
                             (device_fits ? " and " + format_bytes(plan.tier_bytes(Tier::kHost)) +
                                                " of host memory, more than host_memory_limit " +
                                                format_bytes(o.host_budget_bytes)
                                          : ", more than device_memory_limit " +
                                                format_bytes(o.device_budget_bytes)) +
                             "; set grad_accumulation to 'host' or 'auto'");
      }
      place(before);
    }
  }
  // One copy of the optimizer state, as a tier's bytes name it.
  const auto one_copy = [&](Tier tier) {
    return format_bytes((plan.kind_bytes(tier, TensorKind::kMasterWeights) +
                         plan.kind_bytes(tier, TensorKind::kMoments)) /
                        plan.state_copies());
  };
  if (!fits() && o.hold_state && o.optimizer == Tier::kHost) {
    return out_of_memory("host_memory_limit " + format_bytes(o.host_budget_bytes) +
                         " is too small for save_async: this plan needs " +
                         format_bytes(plan.tier_bytes(Tier::kHost)) +
                         " of host memory with three copies of the optimizer state (" +
                         one_copy(Tier::kHost) +
                         " each: the state, the one the step writes, the one a save reads); raise "
                         "host_memory_limit, offload the optimizer to nvme, or set save_async "
                         "false");
  }
  if (!fits() && o.optimizer == Tier::kHost && plan.shadow_state) {
    plan.shadow_state = false;
    plan.overlap = OptimizerOverlap::kForward;
    plan.overlap_note = "a second copy of the optimizer state (" +
                        format_bytes(plan.kind_bytes(Tier::kHost, TensorKind::kMasterWeights) +
                                     plan.kind_bytes(Tier::kHost, TensorKind::kMoments)) +
                        " with it) does not fit host_memory_limit, so the update overlaps the "
                        "next forward only";
    place(o.optimizer);
  }
  if (!fits()) {
    return out_of_memory("host_memory_limit " + format_bytes(o.host_budget_bytes) +
                         " is too small: this plan needs " +
                         format_bytes(plan.tier_bytes(Tier::kHost)) + " of host memory (" +
                         plan.kinds_text(Tier::kHost) +
                         "); raise host_memory_limit or offload to nvme");
  }
  // The swap paths' free space: the shadow state goes first.
  const auto nvme_fits = [&] {
    return o.swap_free_bytes == 0 || plan.tier_bytes(Tier::kNvme) <= o.swap_free_bytes;
  };
  if (!nvme_fits() && o.optimizer == Tier::kNvme && o.hold_state) {
    return out_of_memory(
        "swap_paths have " + format_bytes(o.swap_free_bytes) +
        " free, too little for save_async: this plan needs " +
        format_bytes(plan.tier_bytes(Tier::kNvme)) + " with three copies of the optimizer state (" +
        one_copy(Tier::kNvme) +
        " each: the state, the one the step writes, the one a save reads); free space "
        "or set save_async false");
  }
  if (!nvme_fits() && o.optimizer == Tier::kNvme && plan.shadow_state) {
    plan.shadow_state = false;
    plan.overlap = OptimizerOverlap::kForward;
    plan.overlap_note = "a second copy of the optimizer state (" + one_copy(Tier::kNvme) +
                        ") does not fit the " + format_bytes(o.swap_free_bytes) +
                        " free in swap_paths, so the update overlaps the next forward only";
    place(plan.gradients);
  }
  if (!nvme_fits()) {
    return out_of_memory("swap_paths have " + format_bytes(o.swap_free_bytes) +
                         " free: this plan needs " + format_bytes(plan.tier_bytes(Tier::kNvme)) +
                         " on NVMe (" + plan.kinds_text(Tier::kNvme) +
                         "); free space there, add a swap path on another drive, or keep more "
                         "in host memory");
  }
  return plan;
}

}  // namespace

Result<MemoryPlan> make_plan(const Partition& partition, const PlanOptions& o) {
  STRATA_ASSIGN_OR_RETURN(MemoryPlan plan, plan_share(partition.local_layout(), o));
  count_peaks(partition, o, plan);
  return plan;
}

Result<MemoryPlan> make_plan(const model::ParamLayout& layout, const PlanOptions& o) {
  return make_plan(Partition(layout, {0, 1}, 0), o);
}

}  // namespace strata::zero
