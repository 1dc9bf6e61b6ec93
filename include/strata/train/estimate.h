// What a config will hold in each memory tier, known before anything is allocated: rank 0's
// memory plan, made exactly as `strata train` makes it (no weights read, no swap file written,
// no device memory taken), and the process's predicted peak resident memory. `strata estimate`
// prints it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "strata/core/json.h"
#include "strata/core/status.h"
#include "strata/io/swap.h"
#include "strata/model/llama_config.h"
#include "strata/train/config.h"
#include "strata/zero/plan.h"
#include "strata/zero/shard_store.h"
#include "strata/zero/zero_provider.h"

namespace strata::train {

// The swap space a config asks for on `rank` ("{rank}" in a swap path becomes the rank).
io::SwapOptions swap_options(const TrainConfig& config, int rank);
// Makes rank `rank`'s swap directories that a "{rank}" in swap_paths names, where the directory
// above exists (a drive's mount point: a mistyped one is still refused as missing).
Status make_rank_swap_dirs(const TrainConfig& config, int rank);

// Free space of the swap paths `config` gives `rank` for a run's swap files, which stripe data
// evenly over the paths: the fullest filesystem's free space (stale swap files included) per
// path it holds, times the paths. 0 when a path cannot be read: not known.
std::uint64_t swap_free_bytes(const TrainConfig& config, int rank);

// The shard options a config resolves into on `world` ranks, with the model's activation
// workspace and checkpointed activations for one micro-batch: the trainer's and the estimate's
// one source.
zero::ShardOptions shard_options(const TrainConfig& config, int data_ranks, int pipeline_rank = 0);
// The pipeline's shape (its stages, each data-parallel rank's micro-batches, its chunks) can run
// its schedule: else the error naming the values.
Status check_pipeline_shape(const TrainConfig& config, int data_ranks);

// The ZeRO options a config resolves into (stage, dtype, bucket sizes within the device budget,
// 16-bit gradients reduced into f32 where deterministic_reduction has several data-parallel
// ranks on the CPU backend).
zero::ZeroOptions zero_options(const TrainConfig& config, int data_ranks);

struct Estimate {
  model::LlamaConfig model;
  std::int64_t parameters = 0;  // the whole model's
  // Those that train: all of them, or the adapters (LoRA); the embedding's among them or not.
  std::int64_t trainable_parameters = 0;
  // Mixture of experts: the parameters a token does not compute with, the experts it does not
  // pick (experts - experts_per_token of each MoE layer's); of them, those that train. A step's
  // FLOPs follow the active parameters (parameters less these), its bytes every parameter.
  std::int64_t inactive_parameters = 0, inactive_trainable = 0;
  std::int64_t active_parameters() const { return parameters - inactive_parameters; }
  bool embedding_trains = true;
  // Elements this rank holds a gradient and optimizer state for (its shards, padding included).
  std::int64_t trainable_local_elems = 0;
  std::string finetune;        // describe_finetune's line; "" for full fine-tuning
  int ranks = 1;               // planned for one rank of these
  int rank = 0;                // that one
  int pipeline_stages = 1;     // of the grid
  int pipeline_stage = 0;      // the rank's
  int groups_partitioned = 0;  // of the parameter groups, split across the ranks
  zero::MemoryPlan plan;       // the rank's: what its provider runs, and the peaks it will measure
  // Resident memory of a process that has loaded Strata and its libraries (this one, measured
  // when the estimate is made), and the predicted peak: that, plus the host RAM the plan's tiers
  // hold at their peaks (MemoryPlan::host_ram_bytes).
  std::uint64_t process_bytes = 0;
  std::uint64_t rss_bytes = 0;
  // Measures process_bytes now and sets rss_bytes from it: a run measures again once its
  // communicators exist, just before anything large is allocated.
  void measure_process();

  // Host memory that is not the store's pinned tier: the process's own and, on the CPU backend,
  // the device's.
  std::uint64_t other_host_bytes() const { return rss_bytes - plan.peak(Tier::kHost); }

  // The least device memory a run needs: the plan's device bytes, plus the group in use when
  // parameters are offloaded (plan.group_in_use_bytes).
  std::uint64_t device_bytes_needed() const;

  std::string describe() const;  // the lines strata estimate prints
  // Where gradients are summed over a step's micro-batches: "none" (one micro-batch: kept as
  // computed), "device" or "host".
  const char* grad_accumulation() const;
  // device_bytes, host_bytes, nvme_bytes, rss_bytes, and each tier's bytes by kind.
  Json to_json() const;
};

// What estimate plans.
struct EstimateOptions {
  int rank = 0;  // the rank planned (its partition and swap paths); strata estimate: 0
  // false plans the NVMe tier without the swap paths' free space (what a placement would need
  // there).
  bool check_swap_free = true;
};

// Rank `options.rank` of `ranks` running `config` (its model as the config resolved it). Fails as
// the trainer would on a config whose plan cannot work (placements that contradict each other, a
// host or device budget too small), naming what. The trainer plans its own rank with it and runs
// that plan; estimate_with_changes (step_time.h) adds what would fit to a refusal.
// One line on what a LoRA run trains: the adapters' settings and trainable parameters, and the
// frozen base's; "" for full fine-tuning.
std::string describe_finetune(const TrainConfig& config, const model::ParamLayout& layout);

Result<Estimate> estimate(const TrainConfig& config, int ranks,
                          const EstimateOptions& options = {});

}  // namespace strata::train
