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
#include "strata/train/trainer_state.h"
#include "strata/zero/zero_provider.h"

namespace strata::train {

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
