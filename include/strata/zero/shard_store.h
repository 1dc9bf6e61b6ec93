// This rank's share of the model: every parameter group's working copy, fp32 master weights,
// Adam moments and gradients registered in one mem::TieredStore where the memory plan (plan.h)
// puts them. It serves working copies (prefetched, when they live off the device, as the
// sched::PrefetchScheduler's recorded trace says), lands and accumulates gradients where the plan
// says, takes their sums of squares, and hands out scratch: the device buffers of ZeroProvider
// and the model's workspace. The store owns residency and budgets; this says which tier it needs
// a tensor in and when. The optimizer schedule (optimizer_schedule.h) updates what it holds; all
// it asks of that schedule is the StepView below.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "strata/core/status.h"
#include "strata/device/device.h"
#include "strata/device/host_arrays.h"
#include "strata/io/swap.h"
#include "strata/mem/tiered_store.h"
#include "strata/mem/timeline.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/model/param_layout.h"
#include "strata/optim/adamw.h"
#include "strata/optim/cpu_adam.h"
#include "strata/optim/state_layout.h"
#include "strata/sched/prefetch_scheduler.h"
#include "strata/zero/optimizer_step.h"
#include "strata/zero/plan.h"
#include "strata/zero/schedule_chooser.h"

namespace strata::zero {

// What one rank's share is made with: where its tensors live, how the optimizer steps them, and
// how working copies are prefetched.
struct ShardOptions {
  Tier offload_param = Tier::kDevice;      // where compute-dtype working copies live
  Tier offload_optimizer = Tier::kDevice;  // master weights and moments, and where the step runs
  DType compute_dtype = DType::kF32;
  std::int64_t accumulation_steps = 1;  // micro-batches per step (1: gradients kept as made)
  // Off the device only (a device step is the device's own work, ordered on its stream); the
  // plan may fall back (MemoryPlan::overlap says what runs).
  OptimizerOverlap overlap = OptimizerOverlap::kNone;
  GradAccumulation grad_accumulation = GradAccumulation::kAuto;  // see plan.h
  // OptimizerOverlap::kAuto: how the overlapped and the serial schedule are compared, and the
  // clock the step cycles are timed with (nullptr: now_ns; tests set their own).
  ScheduleChooserOptions schedule_chooser;
  std::function<std::int64_t()> clock;
  optim::AdamWHyper adam;
  // Each group's shard's first element in the group's flat vector (ZeroProvider fills it from
  // its Partition); empty: 0 for every group.
  std::vector<std::int64_t> shard_offsets;
  // The host optimizer (offload_optimizer cpu or nvme): threads, SIMD path, pinning.
  optim::CpuAdamOptions cpu_adam;
  // offload_optimizer nvme: elements per streamed sub-group (DeepSpeed's sub_group_size).
  std::int64_t sub_group_size = 1 << 22;
  std::uint64_t host_memory_limit_bytes = 0;  // 0 = no limit
  std::uint64_t activation_bytes = 0;         // the model's workspace, as the plan counts it
  std::uint64_t host_io_bytes = 0;  // the model's pinned host buffer (ParamProvider::host_io)
  // Checkpointed activations (model::ParamProvider::write_activation): how many, each's bytes,
  // and the tier that keeps them between the forward and the backward.
  int num_checkpoints = 0;
  std::uint64_t checkpoint_bytes = 0;
  Tier checkpoint_home = Tier::kDevice;
  bool tied_embeddings = false;       // the model's head reads the embedding's weights
  std::uint64_t swap_free_bytes = 0;  // free space of the swap paths; 0 = not checked
  // Parameter prefetch (offload_param cpu or nvme), DeepSpeed's names in bytes: fetches in flight,
  // parameters resident or arriving on the device, and the reuse distance within which a
  // released group stays resident. See sched::PrefetchOptions.
  std::uint64_t prefetch_bytes = std::uint64_t{256} << 20;
  std::uint64_t max_live_bytes = std::uint64_t{1} << 30;
  std::uint64_t max_reuse_distance = std::uint64_t{1} << 30;
  mem::Timeline* timeline = nullptr;  // transfer and per-group compute spans; optional
  // Asynchronous checkpoints (save_async): the plan keeps the shadow state and a third copy so
  // that hold_state() can set a saved step's state aside for the save's thread
  // (PlanOptions::hold_state).
  bool hold_state = false;
};

// What the memory plan of a share is made from: its options, the device budget (the device's own
// limit), whether swap paths exist and whether the device is host memory. strata estimate makes
// the same plan without a store.
PlanOptions plan_options(const ShardOptions& options, std::uint64_t device_budget_bytes,
                         bool has_swap, bool host_addressable_device);

// One rank's counters since it was made: the shard store's transfers and waits, and the
// optimizer schedule's steps. `since` gives what happened after an earlier reading (peaks stay).
struct RankStats {
  std::uint64_t h2d_bytes = 0;        // host -> device
  std::uint64_t d2h_bytes = 0;        // device -> host
  std::uint64_t nvme_read_bytes = 0;  // NVMe -> host (the streamed optimizer step's included)
  std::uint64_t nvme_write_bytes = 0;
  std::uint64_t host_bytes = 0;   // peak host memory held: the store's and the optimizer's staging
  std::uint64_t nvme_bytes = 0;   // peak swap space held
  double wait_ms = 0;             // compute blocked waiting for parameters
  double stall_ms = 0;            // compute blocked waiting for data or room in a tier
  double optimizer_total_ms = 0;  // every finished optimizer step, start to end
  double optimizer_exposed_ms = 0;  // compute blocked waiting for overlapped updates
  // OptimizerOverlap::kBackward: steps whose update started beside backward, guessing no
  // clipping; of those, redone from the state before the step (they clipped), and rolled back
  // (their gradient was not finite).
  std::uint64_t steps_guessed = 0;
  std::uint64_t steps_redone = 0;
  std::uint64_t steps_rolled_back = 0;
  std::uint64_t gathers_ahead = 0;          // stage 3 all-gathers started by prefetch_params
  std::uint64_t gathers_ahead_refused = 0;  // prefetches that did not fit; acquire gathered

  RankStats& operator+=(const RankStats& o);  // counters add, peaks take the larger
  RankStats since(const RankStats& before) const;
};

// What the shard store asks of the optimizer schedule that updates it.
class StepView {
 public:
  virtual ~StepView() = default;
  // The prefetcher may fetch group's working copy ahead: no overlapped update is still to write it.
  virtual bool update_done(int group) = 0;
  // A guessed update runs beside backward: it reads each gradient as soon as it is final.
  virtual bool guessing() const = 0;
  // Group's gradient is final and where the guessed update reads it.
  virtual void gradient_final(int group) = 0;
};

// Working copies kept between runs (QLoRA's quantized base, so a second run skips quantizing):
// a group's bytes are read from here when present, and offered here when made.
class WorkingCopyCache {
 public:
  virtual ~WorkingCopyCache() = default;
  // Fills `dst` with the group's `bytes` and returns true, or returns false when not cached.
  virtual Result<bool> read(const model::ParamGroup& group, void* dst, std::uint64_t bytes) = 0;
  // Keeps the group's bytes for later runs.
  virtual Status write(const model::ParamGroup& group, const void* src, std::uint64_t bytes) = 0;
};

class ShardStore {
 public:
  // Registers every tensor of `layout` in a new store as `plan` says. Fails with out_of_memory
  // naming the tensor, its tier and the budget when a home does not fit. `swap` is required when
  // anything lives on nvme; `device`, `swap` and `layout` must outlive the store.
  static Result<std::unique_ptr<ShardStore>> create(const model::ParamLayout& layout,
                                                    device::Device& device, io::SwapSpace* swap,
                                                    const ShardOptions& options,
                                                    const MemoryPlan& plan);
  ~ShardStore();
  ShardStore(const ShardStore&) = delete;
  ShardStore& operator=(const ShardStore&) = delete;

  // The schedule that updates this store; set once, before the first pass.
  void set_step_view(StepView* view) { view_ = view; }

  // ---- parameters and gradients, with ParamProvider's contract (model/param_provider.h) ----
  // A frozen group has no gradient: ZeroProvider refuses acquire_grads for it, naming it.
  Result<const void*> acquire_params(int group);
  void release_params(int group);
  void prefetch_params(int group);
  Result<void*> acquire_grads(int group);
  Status release_grads(int group);
  // Waits for gradient transfers still in flight; with a guess running (the step view's
  // guessing()), the gradients that never came are zeros and every gradient is final.
  Status finish_micro_batch();
  // Sum of squares of each group's accumulated gradient, by group, less its tensor-parallel
  // duplicates' (ParamGroup::duplicate_begin: another rank counts them); after finish_micro_batch.
  // The same numbers wherever the gradients live (kSumSquaresChunkElems); sums taken on the
  // device come back in one copy and one wait.
  Result<std::vector<double>> grad_sums_of_squares();
  // Device bytes acquire_params(group) adds to what the store holds: 0 when working copies live
  // on the device, else the copy fetched there.
  std::uint64_t acquire_device_bytes(int group) const;

  // ---- scratch: device buffers pinned from take to give ----
  struct Scratch {
    mem::Handle h = mem::Handle::kInvalid;
    void* data = nullptr;
    bool held() const { return data != nullptr; }
    std::byte* bytes() const { return static_cast<std::byte*>(data); }
  };
  // Scratch of `bytes` named `name` (in the store's errors), zero-filled on request: the store
  // makes room by evicting what is not pinned. Tensors are registered once per (name, size) and
  // reused, so a layer's buffers come back from the store's cache of dropped device copies.
  Result<Scratch> take(std::uint64_t bytes, const std::string& name, bool zero_fill = false);
  void give(Scratch& s);  // no-op when not held

  // The model's pinned host buffer (model::ParamProvider::host_io): a host copy of a transient
  // tensor, held until the next call asks for another size.
  Result<void*> host_io(std::uint64_t bytes, const std::string& what);

  // Checkpointed activations (model::ParamProvider's): transient store tensors, one per index,
  // written on the device and, between the forward and the backward, kept where the plan homes
  // them (MemoryPlan::checkpoints): left on the device, or sent down to host memory or NVMe as
  // soon as written and fetched back for the backward.
  Result<void*> write_activation(int index, std::uint64_t bytes);
  Result<const void*> read_activation(int index);
  void prefetch_activation(int index);
  Status release_activation(int index, bool keep);
  // Whether `bytes` more fit on the device beside what cannot be evicted.
  bool device_fits(std::uint64_t bytes) const { return store_->device_fits(bytes); }

  // ---- state in and out (no step running) ----
  // Sets every group's master weights (and working copy) from `source`; moments are zeroed and
  // gradients dropped. A frozen group's working copy is set alone; its "master weights" read back
  // are that copy widened, and its moments are zeros (writes to them are ignored). With `cache`,
  // a quantized group's working copy is taken from it when there, without reading `source` or
  // quantizing, and offered to it when made. With `frozen_pieces`, frozen groups are read from it
  // a piece at a time (NF4 tensors one at a time), never as one fp32 array of the whole group.
  Status load_master(const model::GroupSource& source, WorkingCopyCache* cache = nullptr,
                     const model::GroupRangeSource& frozen_pieces = nullptr);
  // With `held`: the state hold_state() holds, from any thread while training goes on.
  Status read_master(int group, float* dst, bool held = false);
  Status read_moments(int group, float* exp_avg, float* exp_avg_sq, bool held = false);
  Status write_moments(int group, const float* exp_avg, const float* exp_avg_sq);

  // ---- the state an asynchronous save reads ----
  // Holds the state as the last step left it (call with no step running) for read_master and
  // read_moments with `held`, while training goes on: copy on write, with nothing copied. Needs
  // the plan's held copy (ShardOptions::hold_state): the next step writes the shadow copy as
  // always, and when it commits, the held copy (now the shadow) swaps places with the third
  // copy, so later steps alternate between the other two and never wait. One hold at a time.
  void hold_state();
  void release_state();  // from any thread

  // ---- what the optimizer schedule works with ----
  int num_groups() const { return static_cast<int>(groups_.size()); }
  bool frozen(int group) const { return layout_.group(group).frozen; }
  // No elements here (another pipeline stage's group): nothing to update.
  bool empty(int group) const { return layout_.group(group).num_elems == 0; }
  bool trains() const {  // some group is not frozen
    return std::any_of(layout_.groups().begin(), layout_.groups().end(),
                       [](const model::ParamGroup& g) { return !g.frozen; });
  }
  std::int64_t max_group_elems() const;  // of the trainable groups
  // The step's view of each trainable group: its state (the shadow copies as outputs with
  // plan.shadow_state) and the gradient the optimizer reads; `ids` gets each one's group.
  std::vector<StepGroup> step_groups(std::vector<int>* ids) const;
  // The gradient the optimizer reads: the kept gradient or the fp32 accumulator.
  mem::Handle step_grad(int group) const;
  DType step_grad_dtype() const;
  // Groups with no gradient this step get zeros (their sums of squares too, where kept).
  Status give_zero_grads();
  // Optimizer off the device with gradients summed on it: every group's sum to host memory, in
  // the order the step reads them, on the copy streams.
  Status send_sums_to_host();
  // A copy of group's working copy on `tier` for the optimizer to write (the home when it lives
  // there); close_output makes it the working copy, writing it back home if it is not the home
  // (`keep_host_copy`: under a host budget, a host copy written to NVMe stays, clean, for the
  // next forward).
  Result<void*> open_output(int group, Tier tier);
  void abandon_output(int group, Tier tier);  // unpins what open_output opened
  Status close_output(int group, Tier tier, std::vector<mem::Completion>& writebacks,
                      bool keep_host_copy = false);
  // The working copies of `groups` (flags by group) rewritten from the master weights.
  Status restore_working_copies(const std::vector<bool>& groups);
  // The step is over: gradients dropped; with `commit` and the shadow state, the state the step
  // wrote becomes the state.
  void end_step(bool commit);
  // Drops the accumulated gradients.
  void clear_grads();
  bool idle() const { return pending_grads_.empty() && writebacks_.empty(); }

  const MemoryPlan& plan() const { return plan_; }
  mem::TieredStore& store() { return *store_; }
  device::Device& device() { return device_; }
  // Transfers and waits so far (the store's counters read at the last pass end or step).
  const RankStats& stats() const { return stats_; }
  void absorb_store_stats();  // adds the store's new transfer counts to stats()
  mem::StoreStats store_stats() const;
  sched::SchedulerStats prefetch_stats() const;

 private:
  struct Group;
  ShardStore(const model::ParamLayout& layout, device::Device& device, io::SwapSpace* swap,
             const ShardOptions& options, const MemoryPlan& plan);
  Status create_store();
  Status drain_one_grad();
  Status wait_writebacks();
  // Writes the group's working copy from fp32 master weights in host memory.
  Status write_working_copy(int group, const float* master);
  // The working copy's bytes from the fp32 values, into `out` (the group's work_bytes).
  Status fill_working_copy(int group, const float* master, void* out);
  // The group's master weights in host memory as fp32: themselves, or bf16 ones widened into
  // scratch of the store's (valid until the next call).
  const float* widened_master(const Group& g, const void* master);
  // Elements [begin, begin + count) of a group's fp32 values, valid until the next call.
  using Fp32Pieces = std::function<Result<const float*>(std::int64_t begin, std::int64_t count)>;
  // The same from `values` asked at most `piece_elems` at a time (an NF4 tensor whole).
  Status fill_working_copy(int group, const Fp32Pieces& values, std::int64_t piece_elems,
                           void* out);
  void end_compute_span(Group& g);  // the compute lane's span names say forward or backward
  bool guessing() const { return view_ != nullptr && view_->guessing(); }

  const model::ParamLayout& layout_;
  device::Device& device_;
  io::SwapSpace* swap_;
  ShardOptions options_;
  MemoryPlan plan_;
  optim::StateLayout master_layout_;  // how the master weights and moments lie in their tensors
  optim::StateLayout moment_layout_;
  StepView* view_ = nullptr;
  std::vector<std::unique_ptr<Group>> groups_;
  // Stored optimizer state <-> f32, as the layouts below say (exact widening; narrowing rounds
  // to nearest, Kahan keeping what it dropped, 8-bit moments quantized by block).
  void master_to_f32(const void* stored, float* dst, std::int64_t n);
  void master_from_f32(const float* src, void* stored, std::int64_t n);
  void moment_to_f32(const void* stored, bool second, float* dst, std::int64_t n);
  void moment_from_f32(const float* src, bool second, void* stored, std::int64_t n);
  std::vector<float> wide_master_;                    // widened_master's scratch
  std::optional<device::HostArrays> host_arrays_;     // host-side accumulation and conversion
  mem::Handle widened_grad_ = mem::Handle::kInvalid;  // optimizer on the device: bf16 -> f32
  // Sums of squares taken on the device, one double per group, and their host copy: read back
  // together when the norm is asked for, not one synchronization per group.
  // Gradient sums of squares, one double per group, in store tensors pinned for the store's
  // life: a host copy, and on a device that cannot address host memory device scratch that the
  // sums are written to and copied from.
  // Into slot `group` the sum of squares of x [n] (a group's gradient, in dtype), and into slot
  // groups + group that of its duplicates.
  void device_sum_squares(const void* x, DType dtype, std::size_t group);
  double* norms_host_ = nullptr;
  double* norm_slots_ = nullptr;                 // where the device writes them
  mem::Handle host_io_ = mem::Handle::kInvalid;  // the model's (host_io), and its pinned copy
  void* host_io_data_ = nullptr;
  struct PendingGrad {  // a gradient on its way off the device
    int group;
    mem::Completion done;
  };
  std::deque<PendingGrad> pending_grads_;
  struct Checkpoint {
    mem::Handle h = mem::Handle::kInvalid;
    std::uint64_t bytes = 0;
    bool held = false, writing = false;
  };
  std::vector<Checkpoint> checkpoints_;
  std::vector<mem::Completion> writebacks_;  // accumulators and working copies going home
  std::map<std::pair<std::string, std::uint64_t>, std::vector<mem::Handle>> free_scratch_;
  // A group's master weights, exp_avg and exp_avg_sq handles: the current state's, or with
  // `held` the held one's.
  std::array<mem::Handle, 3> state_handles(const Group& g, bool held) const;
  RankStats stats_;
  // The held state: whether a save holds one, and whether a step's commit has since set it
  // aside (the `*_spare` handles). Guards those and the handle swaps of a commit.
  mutable std::mutex held_mu_;
  bool held_ = false;
  bool held_is_spare_ = false;
  std::unique_ptr<mem::TieredStore> store_;
  std::unique_ptr<sched::PrefetchScheduler> sched_;  // offload_param cpu or nvme
  mem::StoreStats store_seen_;                       // store counters already in stats_
  bool backward_ = false;  // this micro-batch has reached its backward (for span names)
};

}  // namespace strata::zero
