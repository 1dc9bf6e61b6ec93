// The memory plan: the one place that decides in which tier each kind of tensor lives, and how
// many bytes of each tier it takes at its peak. Made once from the layout, the placements the
// config asks for and the budgets; the shard store registers every tensor in the tiered store
// where the plan says, and the store holds it there. The plan is the run's only memory model:
// strata estimate prints it, and its peaks are what the run measures itself against.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/exact_sum.h"
#include "strata/core/status.h"
#include "strata/device/ops.h"
#include "strata/model/param_layout.h"
#include "strata/tensor/tensor.h"
#include "strata/zero/bucket.h"
#include "strata/zero/partition.h"

namespace strata::zero {

// The config's spelling of a tier (offload_param, offload_optimizer): none = the device,
// cpu = host memory, nvme = the swap space.
inline std::string_view offload_name(Tier tier) {
  switch (tier) {
    case Tier::kDevice:
      return "none";
    case Tier::kHost:
      return "cpu";
    case Tier::kNvme:
      return "nvme";
  }
  return "?";
}

// When the optimizer step runs relative to compute (off the device; a device step is the
// device's own work, ordered on its stream). Every schedule is exact: the same arithmetic on the
// same gradients as kNone, so the same bits.
// kNone: after backward and the global norm, to the end, before the next forward starts.
// kForward: after backward and the global norm, on a thread of its own, in the order the next
//   forward needs the groups; that forward's acquire of a group waits for that group's update.
// kBackward: as kForward, but each group's update starts as soon as its final gradient exists,
//   while backward goes on, assuming the step will not clip; it writes the plan's shadow state,
//   so the state before the step stays intact until the global norm confirms the guess. A step
//   that clips is redone from that state (overlapping the next forward), one whose gradient is
//   not finite is rolled back, and after a clipped step the next one does not guess.
// kAuto (asked for only; a plan resolves it): kBackward where it fits (else kForward), and the
//   serial schedule instead for as long as it measures faster (schedule_chooser.h).
enum class OptimizerOverlap : std::uint8_t { kNone, kForward, kBackward, kAuto };
inline constexpr std::array<OptimizerOverlap, 4> kOptimizerOverlaps = {
    OptimizerOverlap::kNone, OptimizerOverlap::kForward, OptimizerOverlap::kBackward,
    OptimizerOverlap::kAuto};
inline std::string_view optimizer_overlap_name(OptimizerOverlap overlap) {
  switch (overlap) {
    case OptimizerOverlap::kNone:
      return "none";
    case OptimizerOverlap::kForward:
      return "forward";
    case OptimizerOverlap::kBackward:
      return "backward";
    case OptimizerOverlap::kAuto:
      return "auto";
  }
  return "?";
}

enum class TensorKind : std::uint8_t {
  kParameters,     // working copies in the compute dtype
  kGradients,      // fp32 accumulators, or the compute-dtype gradients themselves
  kMasterWeights,  // fp32
  kMoments,        // Adam's exp_avg and exp_avg_sq, fp32
  kStaging,        // buffers transfers and the optimizer pass through; gradients in transit
  kActivations,    // the model's activation workspace (device scratch)
};
inline constexpr int kNumTensorKinds = 6;
std::string_view tensor_kind_name(TensorKind kind);

// Where gradients are summed over the micro-batches of a step when the optimizer runs off the
// device (with it on the device they always are on the device).
// kHost: each micro-batch's gradient goes to host memory and is added into an fp32 accumulator
//   homed where the plan keeps gradients (host memory, or NVMe).
// kDevice: into fp32 accumulators homed on the device; each group's sum goes to host memory once
//   per step. Refused when the device budget cannot hold them.
// kAuto: kDevice where the device is not host memory (a GPU) and its budget holds the
//   accumulators beside everything else, else kHost. On the CPU backend the device is host
//   memory: accumulating there costs one more copy of every sum and saves nothing.
enum class GradAccumulation : std::uint8_t { kAuto, kHost, kDevice };
inline constexpr std::array<GradAccumulation, 3> kGradAccumulations = {
    GradAccumulation::kAuto, GradAccumulation::kHost, GradAccumulation::kDevice};
inline std::string_view grad_accumulation_name(GradAccumulation where) {
  switch (where) {
    case GradAccumulation::kAuto:
      return "auto";
    case GradAccumulation::kHost:
      return "host";
    case GradAccumulation::kDevice:
      return "device";
  }
  return "?";
}

struct ZeroOptions {
  int stage = 3;  // 1: optimizer states partitioned; 2: + gradients; 3: + parameters
  DType compute_dtype = DType::kF32;
  // 16-bit gradients summed over the ranks in f32 and kept so (Communicator::reduce_scatter_wide):
  // deterministic_reduction's bits for bf16 and fp16, where one rank's sums are fp32 too. The
  // gradients the step reads are then fp32 (and take twice the memory as they land).
  bool wide_gradients = false;
  // Stage 3: start a group's all-gather when the model announces it (prefetch), so it overlaps
  // the current layer. Off when shards come from NVMe: there the prefetch starts the read instead.
  bool gather_ahead = true;
  // Most bytes one gradient reduction moves, counting every rank's block (DeepSpeed's
  // reduce_bucket_size, in bytes): released gradients are packed into buckets of this size, small
  // groups together and large groups split, one collective per bucket. Device memory beyond the
  // unbucketed reduction: the full gradients of the open bucket's groups (up to this many bytes,
  // plus the rest of a split group) and one packed bucket (this many bytes, and 1/world of it
  // for the reduced block).
  std::uint64_t reduce_bucket_bytes = kDefaultReduceBucketBytes;
  // Most bytes one parameter all-gather receives (DeepSpeed's allgather_bucket_size, in bytes):
  // stage 3 gathers a larger group in several all-gathers through two staging buffers of this
  // size; stages 1-2 coalesce the re-gather after each step into buckets of this size.
  std::uint64_t allgather_bucket_bytes = kDefaultAllgatherBucketBytes;
};

// The gradients' sums of squares the shard store keeps: one exact sum per group (of the elements
// this rank counts: its tensor-parallel duplicates left out).
inline std::uint64_t gradient_norm_bytes(std::size_t num_groups) {
  return static_cast<std::uint64_t>(num_groups == 0 ? 1 : num_groups) * sizeof(ExactSum);
}

struct PlanOptions {
  Tier params = Tier::kDevice;     // offload_param
  Tier optimizer = Tier::kDevice;  // offload_optimizer: master weights, moments, the step
  DType compute_dtype = DType::kF32;
  DType state_dtype = DType::kF32;   // the Adam moments' (optimizer.state_dtype)
  DType master_dtype = DType::kF32;  // the master weights' (optimizer.master_dtype)
  device::MasterRounding master_rounding = device::MasterRounding::kStochastic;
  std::int64_t accumulation_steps = 1;  // micro-batches per optimizer step
  // deterministic_reduction: micro-batches summed in the canonical tree (the same bits on any
  // number of data-parallel ranks), which holds a few fp32 partial sums a group at once; else a
  // running sum in one.
  bool tree_sums = true;
  std::uint64_t device_budget_bytes = 0;  // 0 = no limit
  std::uint64_t host_budget_bytes = 0;    // 0 = no limit
  std::int64_t sub_group_size = 1 << 22;  // NVMe-streamed optimizer sub-group, in elements
  bool has_swap = false;                  // swap paths were given
  std::uint64_t swap_free_bytes = 0;      // free space of the swap paths; 0 = not checked
  // The device is host memory (the CPU backend): device copies of tensors that touch NVMe are
  // whole O_DIRECT blocks (TieredStore's direct_device_io).
  bool host_addressable_device = false;
  bool tied_embeddings = false;        // the head reads the embedding's weights
  std::uint64_t activation_bytes = 0;  // the model's device workspace for one micro-batch
  std::uint64_t host_io_bytes = 0;     // the model's pinned host buffer (token ids, losses)
  // Checkpointed activations: how many, each's bytes, and where they wait for the backward.
  int num_checkpoints = 0;
  std::uint64_t checkpoint_bytes = 0;
  Tier checkpoint_home = Tier::kDevice;
  OptimizerOverlap overlap = OptimizerOverlap::kNone;
  GradAccumulation grad_accumulation = GradAccumulation::kAuto;
  // offload_optimizer_fraction: with the optimizer off the device, the share of the trained
  // elements whose optimizer state lives there and is stepped there, in whole groups; the rest
  // stays on the device and the device steps it (MemoryPlan::device_steps).
  double offload_fraction = 1.0;
  // Asynchronous checkpoints (save_async): a saved step's state is held for the save's thread
  // while training goes on, which takes the shadow state and a third copy of the state; a plan
  // that cannot hold them is refused.
  bool hold_state = false;
  // ZeRO's collectives over the partition's ranks (their dtype is compute_dtype).
  ZeroOptions zero;
};

struct MemoryPlan {
  Tier params = Tier::kDevice;  // the working copies' home (offload_param)
  // The trained groups' working copies: with the rest, except where the optimizer runs on the
  // device and a frozen base lives off it (LoRA): then beside their optimizer on the device.
  Tier trained_params = Tier::kDevice;
  Tier optimizer = Tier::kDevice;
  Tier gradients = Tier::kDevice;  // the fp32 accumulators, or the kept gradients
  // Where checkpointed activations wait between a block's forward and its backward (kept on the
  // device, or sent down as soon as written and fetched back for the backward).
  Tier checkpoints = Tier::kDevice;
  // One micro-batch per step and the step off the device: each group's gradient is kept as the
  // model made it (compute dtype, exact) until the step, with no fp32 accumulator beside it.
  bool keep_gradients = false;
  // Otherwise the micro-batches' gradients are summed, in the canonical tree (tree_sums) or as a
  // running sum, over accumulation_steps micro-batches, into `accumulators` fp32 buffers a group
  // (SummationTree::buffers_needed: the tree's partial sums at their most; 1 for a running sum).
  bool tree_sums = true;
  std::int64_t accumulation_steps = 1;
  int accumulators = 1;
  // The gradients as they land: the compute dtype, or f32 (ZeroOptions::wide_gradients).
  DType gradient_dtype = DType::kF32;
  // Transfers between NVMe and the device pass through the store's pool of these.
  std::size_t staging_buffer_bytes = 0;
  int num_staging_buffers = 0;
  // The optimizer's own sub-group staging (optimizer on NVMe), outside the store's host budget.
  std::uint64_t optimizer_staging_bytes = 0;
  // A second copy of the master weights and moments in the optimizer's tier: each step writes
  // the other copy and switches at commit, so the state before the step survives it until then
  // (OptimizerOverlap::kBackward's guess, a failed step). false where it does not fit.
  bool shadow_state = false;
  // save_async: a third copy, so that the copy a save reads is set aside while training
  // alternates between the other two (OptimizerState::hold).
  bool held_copy = false;
  // offload_optimizer_fraction below 1, by group of the share: the trained groups whose
  // optimizer state stays on the device though the optimizer is offloaded, and which the device
  // steps, ordered on its stream after the global norm, with their gradients summed there in
  // fp32 and their working copies there. They are the groups whose gradients are final last in
  // backward (the embedding and the first layers), so the offloaded ones, final first, give the
  // host optimizer the longest window beside backward. Empty: none (every trained group's state
  // is in `optimizer`). The shadow and held copies are the offloaded groups' alone.
  std::vector<bool> device_steps;
  // Of the trained elements, the share whose state is in `optimizer` (1 without device_steps).
  double offload_fraction = 1.0;
  int state_copies() const { return (shadow_state ? 2 : 1) + (held_copy ? 1 : 0); }
  // The schedule the optimizer step will run (never kAuto), and why when it is not the one asked
  // for; with `measure_overlap` (kAuto) the serial one instead while that measures faster.
  OptimizerOverlap overlap = OptimizerOverlap::kNone;
  bool measure_overlap = false;
  std::string overlap_note;
  // The optimizer state's bytes a trained parameter, and what they are made of.
  std::string state_note;
  // Peak bytes by tier and kind: homes in full, transient buffers at the most the plan lets be
  // in flight at once. What a run needs: the budgets are checked against these.
  std::array<std::array<std::uint64_t, kNumTensorKinds>, kNumTiers> bytes{};
  // Beyond that, per tier: the buffers of transient tensors the store keeps for reuse by size
  // (one for each size of group that passes through at once: the embedding, a layer and the
  // head are three sizes), held while the tier's budget has room and given back when it needs
  // it. A run without a budget holds them at its peak.
  std::array<std::uint64_t, kNumTiers> cache_bytes{};
  // Of the device's gradient bytes, the one group's gradient in transit (the rest are homes).
  std::uint64_t gradient_transit_bytes = 0;
  // With parameters offloaded, the largest group's working copy on the device: what a run needs
  // there beside tier_bytes(kDevice) (the group in use; the plan leaves fetched parameters out).
  std::uint64_t group_in_use_bytes = 0;
  // ZeRO's own device buffers at their peak, beyond the gradient in transit counted above: full
  // parameters (stages 1-2: all of them; stage 3: the group in use and the one gathered ahead,
  // with their chunk staging), the full gradients the model writes, the packed reduction bucket
  // and the gradient buffers reductions land in, with the blocks the store's device cache keeps
  // of them. Transient: never refused against the budget (the store makes room by dropping
  // cached copies), but part of the device's peak. 0 on one rank.
  std::uint64_t collective_bytes = 0;
  // The tiers' peaks as the run's store will measure them: each tier's bytes, ZeRO's buffers on
  // the device, and what the store keeps there for reuse while the tier's budget has room
  // (cache_bytes, and working copies cached on the device, or in host memory when they live on
  // NVMe under a host budget), capped by the budget.
  std::array<std::uint64_t, kNumTiers> peak_bytes{};
  // The device is host memory (the CPU backend): its peak is resident memory of the process too.
  bool device_is_host_memory = false;

  // The fp32 sums of several micro-batches are on the device: with the optimizer there, or homed
  // there for a step off it (GradAccumulation::kDevice), which reads each group's sum from a copy
  // sent to host memory once per step. Kept gradients are never homed on the device.
  bool sums_on_device() const { return gradients == Tier::kDevice; }
  // Where a group's working copy lives (an offloaded group's, where device_steps has any).
  Tier home_of(bool frozen) const { return frozen ? params : trained_params; }
  bool accumulate_on_device() const { return sums_on_device() && optimizer != Tier::kDevice; }

  // By group of the share (its index in the local layout): the placements above where the group
  // is offloaded, the device's where it steps there (device_steps).
  bool steps_on_device(std::size_t group) const {
    return optimizer == Tier::kDevice || (group < device_steps.size() && device_steps[group]);
  }
  bool any_device_steps() const {
    for (const bool d : device_steps) {
      if (d) return true;
    }
    return false;
  }
  Tier optimizer_of(std::size_t group) const {
    return steps_on_device(group) ? Tier::kDevice : optimizer;
  }
  Tier gradients_of(std::size_t group) const {
    return steps_on_device(group) ? Tier::kDevice : gradients;
  }
  bool keeps_gradient(std::size_t group) const { return keep_gradients && !steps_on_device(group); }
  bool sums_on_device(std::size_t group) const { return gradients_of(group) == Tier::kDevice; }
  bool accumulate_on_device(std::size_t group) const {
    return sums_on_device(group) && !steps_on_device(group);
  }
  bool shadowed(std::size_t group) const { return shadow_state && !steps_on_device(group); }
  bool held(std::size_t group) const { return held_copy && !steps_on_device(group); }
  Tier home_of(std::size_t group, bool frozen) const {
    return frozen ? params : steps_on_device(group) ? Tier::kDevice : trained_params;
  }

  std::uint64_t tier_bytes(Tier tier) const;
  std::uint64_t peak(Tier tier) const { return peak_bytes[static_cast<std::size_t>(tier)]; }
  // Host RAM the tiers hold at their peaks: the pinned host tier's, and the device's where the
  // device is host memory. A process's resident memory is this beside its own.
  std::uint64_t host_ram_bytes() const {
    return peak(Tier::kHost) + (device_is_host_memory ? peak(Tier::kDevice) : 0);
  }
  std::uint64_t kind_bytes(Tier tier, TensorKind kind) const {
    return bytes[static_cast<std::size_t>(tier)][static_cast<std::size_t>(kind)];
  }
  // "parameters 250.01 MiB, staging 224.00 MiB": the tier's kinds that hold bytes.
  std::string kinds_text(Tier tier) const;
  // " (62.5% of its state; the 3 groups backward reaches last stay on the device and are
  // stepped there)",
  // or "" without device_steps.
  std::string device_steps_text() const;
  // A few lines: the placements, then each tier's bytes by kind.
  std::string describe() const;
};

// A share as a config writes it: "0.5", "0.0625", "1".
std::string fraction_text(double f);

// The plan of this rank's share of `partition` (its local layout), and of the buffers ZeRO's
// collectives take beside it. Fails when the placements contradict each other (trained
// parameters off the device with the optimizer on it, NVMe without swap paths) or when the host
// budget cannot hold what must live there, naming the kinds and their bytes.
Result<MemoryPlan> make_plan(const Partition& partition, const PlanOptions& options);
// One rank holding all of `layout`.
Result<MemoryPlan> make_plan(const model::ParamLayout& layout, const PlanOptions& options);

}  // namespace strata::zero
