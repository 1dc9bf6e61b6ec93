// hwloc thread binding for CpuAdam's arena: a worker entering the arena in slot k is bound to
// the k-th core the process may use; on leaving it gets the process binding back, so workers of
// the shared oneTBB pool are never left pinned when they serve other arenas. The thread that
// runs a step takes slot 0 (reserved for it by the arena) and is bound to core 0 only for the
// step: its own binding is saved and restored, since it belongs to the caller.
#include "src/optim/thread_pinning.h"

#include <hwloc.h>
#include <oneapi/tbb/task_scheduler_observer.h>

#include <vector>

#include "strata/core/logging.h"

namespace strata::optim::detail {
namespace {

// Puts a thread's saved binding back.
class Restore final : public ArenaPinning::CallerBinding {
 public:
  Restore(hwloc_topology_t topo, hwloc_bitmap_t saved) : topo_(topo), saved_(saved) {}
  ~Restore() override {
    hwloc_set_cpubind(topo_, saved_, HWLOC_CPUBIND_THREAD);
    hwloc_bitmap_free(saved_);
  }
  Restore(const Restore&) = delete;
  Restore& operator=(const Restore&) = delete;

 private:
  hwloc_topology_t topo_;
  hwloc_bitmap_t saved_;
};

class HwlocPinning final : public ArenaPinning, public tbb::task_scheduler_observer {
 public:
  HwlocPinning(tbb::task_arena& arena, hwloc_topology_t topo, hwloc_bitmap_t process_set,
               std::vector<hwloc_bitmap_t> cores)
      : tbb::task_scheduler_observer(arena),
        topo_(topo),
        process_set_(process_set),
        cores_(std::move(cores)) {
    observe(true);
  }
  ~HwlocPinning() override {
    observe(false);  // waits for callbacks in progress
    for (hwloc_bitmap_t c : cores_) hwloc_bitmap_free(c);
    hwloc_bitmap_free(process_set_);
    hwloc_topology_destroy(topo_);
  }
  HwlocPinning(const HwlocPinning&) = delete;
  HwlocPinning& operator=(const HwlocPinning&) = delete;

  void on_scheduler_entry(bool is_worker) override {
    if (!is_worker) return;
    const int slot = tbb::this_task_arena::current_thread_index();
    if (slot < 0) return;
    const hwloc_bitmap_t core = cores_[static_cast<std::size_t>(slot) % cores_.size()];
    hwloc_set_cpubind(topo_, core, HWLOC_CPUBIND_THREAD);  // best effort: unpinned still works
  }
  void on_scheduler_exit(bool is_worker) override {
    if (!is_worker) return;
    hwloc_set_cpubind(topo_, process_set_, HWLOC_CPUBIND_THREAD);
  }
  std::unique_ptr<CallerBinding> bind_caller() override {
    hwloc_bitmap_t saved = hwloc_bitmap_alloc();
    if (hwloc_get_cpubind(topo_, saved, HWLOC_CPUBIND_THREAD) != 0 ||
        hwloc_set_cpubind(topo_, cores_[0], HWLOC_CPUBIND_THREAD) != 0) {
      hwloc_bitmap_free(saved);
      return nullptr;
    }
    return std::make_unique<Restore>(topo_, saved);
  }

 private:
  hwloc_topology_t topo_;
  hwloc_bitmap_t process_set_;
  std::vector<hwloc_bitmap_t> cores_;
};

}  // namespace

std::unique_ptr<ArenaPinning> ArenaPinning::create(tbb::task_arena& arena) {
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) {
    log_warning("CpuAdam: hwloc_topology_init failed; worker threads stay unpinned");
    return nullptr;
  }
  if (hwloc_topology_load(topo) != 0) {
    hwloc_topology_destroy(topo);
    log_warning("CpuAdam: hwloc cannot read the CPU topology; worker threads stay unpinned");
    return nullptr;
  }
  hwloc_bitmap_t process_set = hwloc_bitmap_alloc();
  if (hwloc_get_cpubind(topo, process_set, HWLOC_CPUBIND_PROCESS) != 0) {
    hwloc_bitmap_copy(process_set, hwloc_topology_get_allowed_cpuset(topo));
  }
  std::vector<hwloc_bitmap_t> cores;
  const int num_cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
  for (int i = 0; i < num_cores; ++i) {
    hwloc_obj_t core = hwloc_get_obj_by_type(topo, HWLOC_OBJ_CORE, static_cast<unsigned>(i));
    if (core == nullptr || core->cpuset == nullptr) continue;
    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    hwloc_bitmap_and(set, core->cpuset, process_set);
    if (hwloc_bitmap_iszero(set)) {
      hwloc_bitmap_free(set);
      continue;
    }
    cores.push_back(set);
  }
  if (cores.empty()) {
    hwloc_bitmap_free(process_set);
    hwloc_topology_destroy(topo);
    log_warning(
        "CpuAdam: hwloc finds no core this process may run on; worker threads stay unpinned");
    return nullptr;
  }
  return std::make_unique<HwlocPinning>(arena, topo, process_set, std::move(cores));
}

}  // namespace strata::optim::detail
