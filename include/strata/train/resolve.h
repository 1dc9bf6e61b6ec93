// A config resolved once, for a run or for strata estimate: the grid and the placement "auto"
// chose (and why), the grid's shape, this rank's {rank} paths, and its memory plan, which settles
// where gradients are summed. strata train and strata estimate both resolve through it and print
// what it resolved.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "strata/core/status.h"
#include "strata/device/device.h"
#include "strata/dist/communicator.h"
#include "strata/dist/process_grid.h"
#include "strata/train/config.h"
#include "strata/train/estimate.h"
#include "strata/train/step_time.h"

namespace strata::train {

struct ResolveOptions {
  int world = 1;  // the ranks: a run's communicator's, strata estimate's --ranks
  int rank = 0;   // the rank resolved for: its {rank} paths and its plan
  // A run: its ranks check that they run one config, take rank 0's choices, and check the grid
  // against their number in the run's words. Null: strata estimate, one process deciding for
  // every rank (its plan names --ranks where the grid does not divide them).
  dist::Communicator* comm = nullptr;
  // Where "auto" measures the machine's rates; null: a probe device of its own.
  device::Device* probe_device = nullptr;
  // A resume: whether the checkpoint's run summed in the canonical tree (its saved config), which
  // deterministic_reduction "auto" keeps, so a run restarted on one rank continues its bits.
  std::optional<bool> resumed_deterministic;
  // strata estimate --gpu NAME: that GPU's published rate in place of the device's measured one
  // in every choice "auto" makes (the rates kept in ResolvedConfig::rates). "": the measured one.
  std::string gpu;
};

struct ResolvedConfig {
  TrainConfig config;  // the grid, the placement and {rank} paths applied
  dist::GridShape shape;
  Estimate planned;                   // this rank's plan: what estimate prints, the run runs
  std::optional<MachineRates> rates;  // measured (or ResolveOptions::gpu's), where "auto" chose
  std::vector<std::string> choices;   // "grid: ...", "placement: ...": what "auto" chose, why
  // "resolved: data D x tensor T x pipeline P | offload param X, optimizer Y | M micro-batch(es)
  // of N a step on each data-parallel rank, gradients summed on Z" and a newline.
  std::string line() const;
  // The choices, each a line, then line(): what strata estimate prints first.
  std::string describe() const;
};

// In this order, the same on every rank of a run: the ranks' configs compared; the grid
// (tensor_parallel_size and pipeline_parallel_size "auto": choose_grid on measured rates, rank
// 0's choice for all); the grid against the ranks, the batch and the pipeline's shape; the
// placement ("auto" tiers: choose_placement, rank 0's for all); this rank's plan
// (estimate_with_changes, whose refusal says what would fit, unchanged); and metrics_file and
// trace_file: "{rank}" replaced by the rank, or, without it, the path cleared on every rank but
// 0. (A path's "~" is expanded when the config is read: the model's config.json is read there.)
Result<ResolvedConfig> resolve_config(TrainConfig config, const ResolveOptions& options);

}  // namespace strata::train
