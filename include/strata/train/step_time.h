// A training step's predicted time, from the plan and rates measured on this machine by short
// probes (strata estimate). Each rate says whether it was measured or assumed, and how.
#pragma once

#include <cstdint>
#include <string>

#include "strata/core/json.h"
#include "strata/core/status.h"
#include "strata/device/device.h"
#include "strata/train/config.h"
#include "strata/train/estimate.h"

namespace strata::train {

struct Rate {
  double per_s = 0;
  bool measured = false;
  std::string how;  // "sgemm 1024^3 on cpu, 0.3 s" or why it is assumed
};

struct MachineRates {
  Rate gemm_flops;       // matrix products in the compute dtype, on the config's device
  Rate memory_bytes;     // host memory copy bandwidth (CPU Adam's bound, CPU-device copies)
  Rate nvme_read_bytes;  // the swap engine on the first swap path, as configured
  Rate nvme_write_bytes;
  Rate comm_bytes;  // collective bus bandwidth per rank (several ranks only)
  Json to_json() const;
};

// Short probes (about a second in all): a GEMM on `device` (nullptr: a device of the config's
// kind made for the probe alone, sized for it), a host memory copy, and, when anything lives on
// NVMe, a write and read of a temporary swap file through the configured swap engine (deleted
// afterwards). A device that cannot be made, or no swap paths, leave those rates unmeasured with
// the reason.
MachineRates calibrate(const TrainConfig& config, device::Device* device = nullptr);

struct StepTime {
  double compute_ms = 0;     // forward + backward FLOPs (recompute included) at the GEMM rate
  double transfer_ms = 0;    // parameters to the device and gradients off it, NVMe legs included
  double optimizer_ms = 0;   // the update: CPU Adam's memory traffic, or its NVMe streaming
  double comm_ms = 0;        // ZeRO collectives
  double serial_ms = 0;      // the step with the update after compute
  double overlapped_ms = 0;  // with the update beside compute (0 where the plan never overlaps)
  double step_ms = 0;        // the whole step, for the plan's schedule
  std::string schedule;      // how the parts were combined
  Json to_json() const;
};

// The step of `e` (rank 0 of its ranks) on a machine with `rates`. Transfers are taken to
// overlap compute (the prefetcher's aim); the update adds to the step under the serial
// schedule and overlaps compute under the others.
StepTime predict_step(const TrainConfig& config, const Estimate& e, const MachineRates& rates);

// offload_param / offload_optimizer "auto": of the placements the config leaves open, the one with
// the lowest predicted step that fits device_memory_limit, host_memory_limit and the free space
// of the swap paths (fewer offloads win a tie). `why` says what was chosen and how the others
// fared. Fails, listing why each was refused, when none fits.
struct PlacementChoice {
  Tier param = Tier::kDevice;
  Tier optimizer = Tier::kDevice;
  StepTime step;
  std::string why;
};
Result<PlacementChoice> choose_placement(const TrainConfig& config, int ranks,
                                         const MachineRates& rates);

}  // namespace strata::train
