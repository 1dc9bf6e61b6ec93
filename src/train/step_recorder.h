// The counters of one training step: it reads every room's own counters (the provider's, the
// timeline's, the swap space's, the device's, the grid's collectives', the process's) as the step
// begins and ends, and writes their differences into the step's metrics beside the plan's
// prediction. Private to train/.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "strata/core/clock.h"
#include "strata/device/device.h"
#include "strata/dist/communicator.h"
#include "strata/dist/process_grid.h"
#include "strata/io/swap.h"
#include "strata/mem/timeline.h"
#include "strata/train/estimate.h"
#include "strata/train/step_metrics.h"
#include "strata/zero/tensor_group.h"
#include "strata/zero/zero_provider.h"

namespace strata::train {

// The model's pass `name` from `begin_ns` to now, on the trace's compute row.
inline void trace_pass(mem::Timeline& timeline, const std::string& name, std::int64_t begin_ns) {
  if (timeline.recording()) timeline.add(mem::Lane::kCompute, name, begin_ns, now_ns());
}

class StepRecorder {
 public:
  // The rooms whose counters a step reads; each must outlive the recorder. `swap` and
  // `tensor_group` may be null (no swap space; an unsplit model).
  struct Rooms {
    const zero::ZeroProvider& provider;
    device::Device& device;
    const mem::Timeline& timeline;
    const io::SwapSpace* swap;
    const dist::ProcessGrid& grid;
    const zero::CommTensorGroup* tensor_group;
    const Estimate& planned;  // what strata estimate says of the config
  };
  explicit StepRecorder(const Rooms& rooms) : rooms_(rooms) {}

  // A step begins: every counter read, the device's peak reset, the clock started.
  void begin();
  // The model's own time in the step so far: `model_ms` without the time it waited for an
  // overlapped update.
  double compute_ms(double model_ms) const;
  // Training's time lost to a save, counted into the next step's metrics.
  void add_save_stall(double ms) { save_stall_ms_ += ms; }
  // The step has ended, `tokens` trained: its time, its optimizer's, the transfers' busy time and
  // bytes, the peaks, the collectives' bytes and the plan into *m.
  void finish(std::int64_t tokens, StepMetrics* m);

 private:
  // Every collective of the run so far: each grid axis's, and the kv-replica sums.
  dist::CommStats comm_stats() const;

  Rooms rooms_;
  zero::RankStats provider_before_;
  dist::CommStats comm_before_;
  std::array<double, mem::kNumLanes> busy_before_{};
  io::IoStats io_before_;
  Stopwatch clock_;
  double save_stall_ms_ = 0;
};

}  // namespace strata::train
