// A small model's training step, timed by training a few steps of 1- and 3-layer variants of its
// config: at that size the engine's, the store's and the swap engine's per-step and per-group
// costs weigh as much as compute, and only a run shows them. Above the trainer (it makes
// trainers), so that estimate, step_time and the trainer stay a line.
#pragma once

#include "strata/core/status.h"
#include "strata/train/config.h"
#include "strata/train/step_time.h"

namespace strata::train {

// Small models only (where the layer probe runs, `rates.layer_passes` measured): the step of
// `config`'s own placement, timed by training a few steps of 1- and 3-layer variants of it (random
// tokens, nothing saved) and scaled to its layers. The tokens go to a temporary file; the
// variants' swap files to the config's swap paths, deleted after. With several ranks the variants
// run one rank's share of the batch in one process (which then updates every rank's share of the
// state: the update is overstated up to `ranks` times), and the collectives are added from the
// assumed bandwidth. Fails where the layer probe did not run or a variant cannot.
Result<double> time_small_step(const TrainConfig& config, int ranks, const MachineRates& rates);

}  // namespace strata::train
