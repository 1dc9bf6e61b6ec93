// The trainer state of a checkpoint (trainer_state.json: the step, the data position, the seed,
// the grid that saved it, the loss scaler's state, the run's config) and the names of a
// checkpoint's files: what a resume reads before it loads any tensor. Reads only files; nothing
// here touches the engine, so the parsers' fuzz build links it alone.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/json.h"
#include "strata/core/status.h"
#include "strata/dist/process_grid.h"
#include "strata/model/llama_config.h"
#include "strata/model/pipeline_stage.h"
#include "strata/optim/loss_scaler.h"

namespace strata::train {

// 2: a group's tensors start on 256-element boundaries (model::kTensorAlignElems) in the flat
// optimizer moments; version 1 laid them on 64-element ones. 3: 8-bit moments were kept in blocks
// of 64 (device::kAdam8BlockElems); before, of 256 (the saved values are fp32 either way: a
// resume quantizes them anew, and says so).
inline constexpr int kCheckpointFormatVersion = 3;

struct TrainerState {
  int format_version = kCheckpointFormatVersion;
  std::int64_t step = 0;                // optimizer steps completed
  std::int64_t sequences_consumed = 0;  // position of the data sampler
  std::uint64_t seed = 0;
  int world_size = 1;              // ranks that wrote the optimizer shards
  int tensor_parallel_size = 1;    // the grid they formed: data-parallel size world_size / (this
  int pipeline_parallel_size = 1;  // x pipeline_parallel_size)
  // Expert parallelism: each run of this many data-parallel ranks shared out the experts (each
  // expert's moments in the files of the ranks holding it, cut over those ranks).
  int expert_parallel_size = 1;
  // Pipeline: each virtual stage's layers (pipeline_parallel_size x its virtual stages counts);
  // empty without.
  std::vector<std::int64_t> pipeline_layers;
  // fp16: the loss scaler's state ("loss_scaler"), restored on resume.
  std::optional<optim::LossScaler::State> loss_scaler;
  Json config;  // the run's config, for reference
};

// "step-00000012": the directory of step 12's checkpoint in save_dir.
std::string step_name(std::int64_t step);

// "optimizer-00001-of-00004.safetensors"
std::string optimizer_shard_name(int rank, int world);

// Resolves DIR (a save_dir with a `latest` file, or one step-N directory) to a checkpoint path
// and checks that its files exist.
Result<std::string> resolve_checkpoint(const std::string& dir);
Result<TrainerState> read_trainer_state(const std::string& checkpoint);
// How a resume converts the checkpoint's Adam moments (kept in fp32 whatever the run kept) for a
// run keeping them as `state_dtype` ("bf16", "int8", "fp32"): a line to log, or "" when they
// continue as they were kept.
std::string moments_conversion_note(const TrainerState& saved, std::string_view state_dtype);
// The grid that saved a checkpoint (data x tensor x pipeline) and its pipeline cut, from the
// trainer state, checked against the model it resumes: the tensor-parallel size splits it, the
// grid divides the world size, pipeline_layers cut its layers. Errors name `state_file`.
struct SavedGrid {
  dist::GridShape shape;
  model::PipelineStage stage;  // one stage holding everything without a pipeline
};
Result<SavedGrid> saved_grid(const TrainerState& state, const model::LlamaConfig& config,
                             const std::string& state_file);
}  // namespace strata::train
