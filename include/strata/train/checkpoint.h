// Resumable checkpoints: an HF-layout model/ (fp32 master weights, consolidated from every
// rank's shard one group at a time) or, training LoRA adapters, the adapters as PEFT saves them
// (adapter_config.json, adapter_model.safetensors; the frozen base stays where it was read from),
// each rank's shard of the Adam moments (trainable groups only), and the trainer state. Everything
// is written under a temporary name, fsynced and renamed into place, so an earlier checkpoint is
// never damaged by a failed or interrupted save. model/ holds every tensor whole whatever the
// tensor-parallel size and pipeline stages, and a checkpoint saved on one grid (data x tensor x
// pipeline) resumes on any other that can split the model.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/json.h"
#include "strata/core/status.h"
#include "strata/dist/process_grid.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/model/llama_config.h"
#include "strata/model/lora.h"
#include "strata/model/param_layout.h"
#include "strata/optim/loss_scaler.h"
#include "strata/zero/zero_provider.h"

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

// Copies the tokenizer and generation files of model directory `from` (those it has) into `to`,
// so saved weights make a complete Hugging Face model directory (strata generate,
// transformers' from_pretrained). A `from` that is not a directory copies nothing.
Status copy_tokenizer_files(const std::string& from, const std::string& to);

// Collective: every rank of `grid` calls it. Writes <save_dir>/step-<N> and points
// <save_dir>/latest at it. Returns the checkpoint path. With `held_state`, the state read is the
// one the provider holds (ZeroProvider::hold_state), on a thread beside training, and `grid`
// must be a grid of the same ranks that training does not use (its collectives run beside
// training's). `layout`: this rank's (its tensor-parallel
// slices of its pipeline stage's groups); `whole`: the run's layout unsplit (every group whole);
// `lora`: the adapters' config when the layout has adapters.
Result<std::string> save_checkpoint(const std::string& save_dir, const model::LlamaConfig& config,
                                    const model::ParamLayout& layout,
                                    const model::ParamLayout& whole,
                                    const std::optional<model::LoraConfig>& lora,
                                    zero::ZeroProvider& provider, dist::ProcessGrid& grid,
                                    const TrainerState& state, bool held_state = false);

// Keeps the newest `keep_last` (>= 1) complete checkpoints of save_dir and deletes the older ones:
// only directories named step-NNNNNNNN that hold a trainer_state.json (so never a directory that
// is not a Strata checkpoint, nor one still being written), never the one `latest` names. Each
// goes in two steps: renamed to a hidden .step-NNNNNNNN.pruned (atomic: a crash leaves either a
// whole checkpoint or a hidden leftover, never a half-deleted one a resume could pick), then
// removed; leftovers of an earlier crash are removed first. `before_remove`, for tests, runs
// between the two steps. Returns the checkpoints deleted.
Result<std::vector<std::string>> prune_checkpoints(
    const std::string& save_dir, std::int64_t keep_last,
    const std::function<void(const std::string&)>& before_remove = {});

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
// Loads master weights (from model/, or with adapters the frozen groups from `base` and the
// adapters from the checkpoint) and this rank's moments (resharded from whatever grid saved them)
// into the provider. `layout` is this rank's, tensor-parallel rank `tp` of `config`'s split, of
// its pipeline stage; `whole` the run's layout unsplit; the checkpoint's model must match them.
// `base_cache`: a
// quantized base's working copies kept between runs, `base_pieces` the base a piece at a time
// (ShardStore::load_master).
Status load_checkpoint(const std::string& checkpoint, const model::LlamaConfig& config,
                       const model::ParamLayout& layout, const model::ParamLayout& whole,
                       model::TensorParallel tp, zero::ZeroProvider& provider,
                       const model::GroupSource& base = nullptr,
                       zero::WorkingCopyCache* base_cache = nullptr,
                       const model::GroupRangeSource& base_pieces = nullptr);

}  // namespace strata::train
