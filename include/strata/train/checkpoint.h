// Resumable checkpoints: an HF-layout model/ (fp32 master weights), the Adam moments, and the
// trainer state. Each is written under a temporary name, fsynced and renamed into place, so an
// earlier checkpoint is never damaged by a failed or interrupted save.
#pragma once

#include <cstdint>
#include <string>

#include "strata/core/json.h"
#include "strata/core/status.h"
#include "strata/model/llama_config.h"
#include "strata/model/param_layout.h"
#include "strata/zero/offload_engine.h"

namespace strata::train {

inline constexpr int kCheckpointFormatVersion = 1;

struct TrainerState {
  std::int64_t step = 0;                // optimizer steps completed
  std::int64_t sequences_consumed = 0;  // position of the data sampler
  std::uint64_t seed = 0;
  Json config;  // the run's config, for reference
};

// Writes <save_dir>/step-<N> and points <save_dir>/latest at it. Returns the checkpoint path.
Result<std::string> save_checkpoint(const std::string& save_dir, const model::LlamaConfig& config,
                                    const model::ParamLayout& layout, zero::OffloadEngine& engine,
                                    const TrainerState& state);

// Resolves DIR (a save_dir with a `latest` file, or one step-N directory) to a checkpoint path
// and checks its files exist.
Result<std::string> resolve_checkpoint(const std::string& dir);
Result<TrainerState> read_trainer_state(const std::string& checkpoint);
// Loads master weights (from model/) and moments into the engine. The checkpoint's model must
// match `layout`.
Status load_checkpoint(const std::string& checkpoint, const model::ParamLayout& layout,
                       zero::OffloadEngine& engine);

}  // namespace strata::train
