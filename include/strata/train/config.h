// The training config: one JSON object whose keys read like DeepSpeed's, validated strictly
// (every unknown key, wrong type and out-of-range value reported at once) and resolved once into
// typed values (enums, byte counts) that the modules receive as they are.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/json.h"
#include "strata/core/status.h"
#include "strata/device/device.h"
#include "strata/dist/communicator.h"
#include "strata/io/swap.h"
#include "strata/model/llama.h"
#include "strata/model/llama_config.h"
#include "strata/model/lora.h"
#include "strata/optim/adamw.h"
#include "strata/optim/loss_scaler.h"
#include "strata/optim/schedule.h"
#include "strata/tensor/tensor.h"
#include "strata/train/data.h"
#include "strata/train/pipeline_schedule.h"
#include "strata/zero/bucket.h"
#include "strata/zero/plan.h"

namespace strata::train {

struct DataConfig {
  std::string path;
  TokenFormat format = TokenFormat::kAuto;  // by the file's name and header
};

// The config's "lr_schedule" (optim::LrSchedule's fields; the lr is optimizer.lr).
struct LrScheduleConfig {
  optim::ScheduleKind type = optim::ScheduleKind::kConstant;
  std::int64_t warmup_steps = 0;
  double min_lr = 0.0;
  // DeepSpeed's schedules (warmup, warmup_decay, warmup_cosine) only, with its defaults.
  optim::WarmupType warmup_type = optim::WarmupType::kLog;
  double warmup_min_lr = 0.0;
  double warmup_min_ratio = 0.0;
  double cos_min_ratio = 1e-4;
  std::int64_t total_steps = 0;  // DeepSpeed's total_num_steps; 0: max_steps
};

// What a run trains: every weight ("full"), or LoRA adapters on a frozen base ("lora"), or LoRA
// adapters on a frozen base whose projection weights are quantized to NF4 at load ("qlora").
enum class FinetuneMethod : std::uint8_t { kFull, kLora, kQlora };
std::string_view finetune_method_name(FinetuneMethod method);

struct FinetuneConfig {
  FinetuneMethod method = FinetuneMethod::kFull;
  // The config's r, alpha, dropout, target_modules and use_rslora, with PEFT's meanings.
  model::LoraConfig lora;
  // A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) to start from;
  // "": fresh adapters drawn from the seed.
  std::string adapter;
  // QLoRA: a directory (on NVMe) that keeps the quantized base between runs; "": none.
  std::string quantized_cache;
  // The settings against those `adapter` was trained with (its adapter_config.json): each
  // mismatch named with the value that would match, target modules by `family`'s names.
  Status check_adapter(const model::LoraConfig& trained, model::ModelFamily family) const;
  // As the config file writes it (PEFT's names for the adapter's keys, `family`'s module names).
  Json to_json(model::ModelFamily family) const;
};

struct TrainConfig {
  // The config's "model": a path to a Hugging Face checkpoint directory (model_path; its
  // config.json is read once, with the config) or an inline HF config object; either way the
  // typed model config, every module's one source for the model's shape.
  model::LlamaConfig model;
  std::string model_path;  // the checkpoint directory; "" for an inline config
  std::uint64_t seed = 1234;
  DataConfig data;
  // Held-out data: mean loss and perplexity every eval_every steps (0: only at the end) and at
  // the end, over eval_batches micro-batches per rank (0: the whole file once).
  std::optional<DataConfig> eval_data;
  std::int64_t eval_every = 0;
  std::int64_t eval_batches = 0;
  std::int64_t seq_len = 128;
  // The batch, in sequences: global, per rank and micro-batch, and micro-batches per step on
  // each rank. Without gradient_accumulation_steps, micro_batch_size 0 is batch_size and the
  // accumulation is what divides out; with it, DeepSpeed's rule (batch_size = micro_batch_size x
  // gradient_accumulation_steps x data-parallel ranks) gives the one left out, which stays 0
  // until resolve_batch knows the ranks.
  std::int64_t batch_size = 8;
  std::int64_t micro_batch_size = 0;
  std::int64_t gradient_accumulation_steps = 0;
  std::int64_t max_steps = 100;
  DType precision = DType::kF32;  // "fp32" | "bf16" | "fp16": the compute dtype
  // fp16's loss scaling (the config's "fp16" object, DeepSpeed's keys); used only in fp16.
  optim::LossScalerConfig loss_scaler;
  optim::AdamWHyper optimizer;  // the config's "optimizer": lr, betas, eps, weight_decay
  LrScheduleConfig lr_schedule;
  double grad_clip = 1.0;  // max global gradient norm; 0 = off
  // The step's gradient sums over micro-batches and data-parallel ranks in one canonical tree
  // (core/summation_tree.h), so 1, 2, 4... ranks train the same bits; costs a few fp32 partial
  // sums a group at once where a rank sums 4 or more micro-batches (the plan counts them).
  // false: a running sum in one accumulator. "auto" (deterministic_reduction_auto): on where the
  // run has several data-parallel ranks or resumes a checkpoint whose run had it on (resolve.h).
  bool deterministic_reduction = false;
  bool deterministic_reduction_auto = true;
  // "none": the optimizer step after backward, before the next forward; "forward": on its own
  // thread during the next forward, which waits for each group's update only; "backward": each
  // group's update starts beside backward, guessing no clipping, redone if it clips; "auto":
  // "backward", or "none" for as long as it measures faster (all exact).
  zero::OptimizerOverlap optimizer_overlap = zero::OptimizerOverlap::kAuto;
  // With several micro-batches per step and the optimizer off the device, where their gradients
  // are summed: "host" (each micro-batch's gradient to host memory, added there), "device" (fp32
  // sums on the device, sent to the host once per step) or "auto" (the device where it is a GPU
  // and its budget holds the sums).
  zero::GradAccumulation grad_accumulation = zero::GradAccumulation::kAuto;
  bool activation_checkpointing = false;
  // Tokens the LM head and the loss run at once (ModelOptions::lm_head_chunk_tokens); 0: chosen
  // so that a chunk's logits are twice the hidden states' bytes (all tokens while the vocabulary
  // is at most twice the hidden size).
  std::int64_t lm_head_chunk_tokens = 0;
  int zero_stage = 3;
  // Megatron-style tensor parallelism: each group of this many consecutive ranks splits every
  // layer's matrices; ZeRO shards over the rest (the data-parallel ranks).
  int tensor_parallel_size = 1;
  // Megatron's sequence parallelism over the tensor-parallel ranks: the residual stream and the
  // norms hold 1/tensor_parallel_size of the tokens (ModelOptions::sequence_parallel).
  bool sequence_parallel = false;
  // Pipeline parallelism: this many stages, each holding consecutive layers (the embedding on
  // the first, the final norm, the LM head and the loss on the last), the step's micro-batches
  // streaming through them in `pipeline_schedule`'s order; under "interleaved" each stage holds
  // `virtual_stages` chunks of layers. pipeline_layers: the layers of each virtual stage (P x V
  // counts); empty: balanced by each layer's and the head's arithmetic (balance_stages).
  int pipeline_parallel_size = 1;
  // Expert parallelism (mixture-of-experts models): each run of this many data-parallel ranks
  // shares out every MoE layer's experts, num_experts / expert_parallel_size each, and sends
  // each token to the ranks of its experts; it divides the data-parallel ranks and the experts.
  int expert_parallel_size = 1;
  // parallelism "auto": the trainer (and strata estimate --ranks N) chooses tensor_parallel_size,
  // pipeline_parallel_size and expert_parallel_size (train::choose_grid), which the config then
  // leaves at 1;
  // "manual" (default): the config's.
  bool parallelism_auto = false;
  PipelineSchedule pipeline_schedule = PipelineSchedule::k1F1B;
  int virtual_stages = 1;
  std::vector<std::int64_t> pipeline_layers;
  std::int64_t sub_group_size = 1 << 22;  // elements per NVMe-streamed optimizer sub-group
  std::int64_t param_persistence_threshold = 100000;  // groups smaller than this stay whole
  dist::CommBackend dist_backend = dist::CommBackend::kAuto;
  std::int64_t dist_timeout_s = 300;  // a collective slower than this ends the run
  // The nodes: ranks on each (0 = every rank on one; a run under a launcher finds its own from
  // the ranks' host names), and the collectives' bandwidth per rank within a node and per node
  // between nodes (bytes/s each way; 0 = not given: 5e9 assumed within, the within-node rate
  // between). The step time prediction and the grid planner use them.
  int ranks_per_node = 0;
  double intra_node_bytes_per_s = 0;
  double inter_node_bytes_per_s = 0;
  Tier offload_optimizer = Tier::kDevice;  // "none" (device) | "cpu" (host) | "nvme"
  Tier offload_param = Tier::kDevice;      // likewise
  // With activation_checkpointing, where each layer's checkpointed input lives between its
  // forward and its backward: "none" (the device), "cpu" (host memory) or "nvme" (the swap
  // paths); it leaves the device as soon as the next layer has read it and comes back ahead of
  // its backward.
  Tier activation_offload = Tier::kDevice;
  // "auto" for either: the placement with the lowest predicted step time that fits the budgets
  // is chosen before the run (train::choose_placement); the tiers above then hold the choice.
  bool offload_optimizer_auto = false;
  bool offload_param_auto = false;
  // With the optimizer offloaded (cpu or nvme): the share of the optimizer state (whole groups,
  // those whose gradients are final first in backward) that lives there and is stepped by the
  // host's Adam; the rest stays on the device with its AdamW (Megatron's
  // optimizer_offload_fraction, DeepSpeed's offload_optimizer.ratio). "auto": the share whose
  // host step fits the window it can hide in, from the measured rates, raised until the plan
  // fits the device (resolve_config); the field then holds the choice.
  double offload_optimizer_fraction = 1.0;
  bool offload_optimizer_fraction_auto = false;
  // Bytes one gradient reduction / one parameter all-gather moves at most (every rank's part
  // counted): small groups share a collective, large ones are split. DeepSpeed's
  // reduce_bucket_size and allgather_bucket_size, in bytes.
  std::uint64_t reduce_bucket_bytes = zero::kDefaultReduceBucketBytes;
  std::uint64_t allgather_bucket_bytes = zero::kDefaultAllgatherBucketBytes;
  // Parameter prefetch (offload_param cpu or nvme), in bytes: fetches in flight (0 = fetch on
  // demand only), parameters resident or arriving on the device (0 = the device budget alone),
  // and how close a group's next use must be for it to stay resident after its release.
  std::uint64_t prefetch_bytes = std::uint64_t{256} << 20;
  std::uint64_t max_live_bytes = std::uint64_t{1} << 30;
  std::uint64_t max_reuse_distance = std::uint64_t{1} << 30;
  std::vector<std::string> swap_paths;
  io::SwapEngine swap_engine = io::SwapEngine::kAuto;
  // Swap engine tuning (strata io-bench --write-config measures these).
  std::uint64_t swap_block_size = 1 << 20;  // bytes per I/O request and stripe unit
  int swap_queue_depth = 32;                // requests in flight per ring
  int swap_threads = 1;                     // io_uring rings, each with its own thread
  bool verify_swap = false;                 // xxh3 checksums of swapped data, checked on read
  // The swap paths' sustained bandwidth with these settings, as strata io-bench measured it
  // (bytes/s; 0 = not recorded: strata estimate probes briefly instead).
  double swap_read_bytes_per_s = 0;
  double swap_write_bytes_per_s = 0;
  // Each direction's bandwidth with reads and writes at once (io-bench --op mixed or all): the
  // NVMe-streamed optimizer's. 0 = not recorded.
  double swap_mixed_bytes_per_s = 0;
  device::DeviceKind device = device::DeviceKind::kCpu;
  std::uint64_t device_memory_limit = 0;  // bytes; 0 = no limit (cpu backend only)
  // cuda: the GPU; -1 = the node-local rank's (device::choose_device_index).
  int device_index = device::kAutoDeviceIndex;
  bool allow_tf32 = false;  // cuda: fp32 GEMMs on TF32 tensor cores (10-bit mantissa products)
  // cuda: the attention kernels (device::AttentionVariant): "auto", "flash2", "simple".
  device::AttentionVariant attention = device::AttentionVariant::kAuto;
  std::uint64_t host_memory_limit = 0;  // bytes; 0 = no limit
  int threads = 0;                      // compute threads on the cpu backend; 0 = all cores
  std::string save_dir = "checkpoints";
  std::int64_t save_every = 0;  // steps; 0 = only at the end and on Ctrl-C
  // After each save, keep the newest keep_last checkpoints of save_dir (Hugging Face's
  // save_total_limit); 0 keeps every one.
  std::int64_t keep_last = 0;
  // Checkpoints written on a thread beside training: the saved step's state is set aside in a
  // third copy in the optimizer's tier (no bytes copied) and read from there while the steps
  // alternate between the other two. At most one save in flight.
  bool save_async = false;
  std::string metrics_file;  // JSON lines; empty = none
  std::string trace_file;    // Chrome trace (trace-event JSON) of the run; empty = none
  std::int64_t log_every = 1;
  FinetuneConfig finetune;
  // The DeepSpeed config joined in (the key "deepspeed", or --deepspeed): its name, and its keys
  // that only tune what Strata decides itself (train::join_deepspeed_config), for the log. Its
  // mapped keys are in the fields above; neither is in to_json().
  std::string deepspeed_source;
  std::vector<std::string> deepspeed_decided;

  // Anything lives on NVMe: parameters, optimizer states or checkpointed activations.
  bool uses_nvme() const {
    return offload_param == Tier::kNvme || offload_optimizer == Tier::kNvme ||
           activation_offload == Tier::kNvme;
  }
  // The adapters the run trains (finetune.method lora), or none (full fine-tuning).
  std::optional<model::LoraConfig> lora() const {
    return finetune.method == FinetuneMethod::kFull ? std::nullopt : std::optional(finetune.lora);
  }
  // QLoRA: the base's projections are NF4.
  bool nf4_base() const { return finetune.method == FinetuneMethod::kQlora; }
  // The parameter layout of this run: the model's groups, with adapters and the base's format.
  // Split over tensor_parallel_size ranks, tensor-parallel rank `tensor_rank`'s slices.
  // Of pipeline stage `pipeline_rank`, its layers only (the other stages' groups empty); of
  // expert-parallel rank `expert_rank`, its experts only.
  model::ParamLayout param_layout(int tensor_rank = 0, int pipeline_rank = 0,
                                  int expert_rank = 0) const {
    return model::ParamLayout::build(model, lora(), nf4_base(), {tensor_parallel_size, tensor_rank},
                                     pipeline_stage(pipeline_rank),
                                     {expert_parallel_size, expert_rank});
  }
  // The layout unsplit: every group whole (checkpoints' files, the counts strata estimate
  // prints).
  model::ParamLayout whole_layout() const {
    return model::ParamLayout::build(model, lora(), nf4_base());
  }
  // Pipeline stage `stage`'s layers: each virtual stage's count from pipeline_layers, else
  // balanced.
  model::PipelineStage pipeline_stage(int stage) const;
  // Each reason the parallelism keys (tensor, sequence, pipeline and expert parallelism,
  // parallelism "auto") cannot run, naming the key; `has_model`: the model's shape is known.
  std::vector<std::string> grid_problems(bool has_model) const;
  // The layers of each virtual stage, P x V of them (pipeline_layers, else balanced).
  std::vector<std::int64_t> pipeline_layer_counts() const;
  // What balances the stages: a decoder layer's and the head's multiply-adds a token.
  struct PipelineCosts {
    double layer = 0, head = 0;
  };
  PipelineCosts pipeline_costs() const;
  // How much longer a step's compute takes through the pipeline than its work spread evenly
  // over the stages: the costliest stage's share times the stages (1 when balanced), times the
  // fill and drain, (M + (P - 1) / V) / M for M micro-batches (the schedules' bubble). 1 without
  // a pipeline.
  double pipeline_stretch(int data_ranks) const;
  // Micro-batches per optimizer step on each of `ranks` data-parallel ranks.
  std::int64_t accumulation_steps(int ranks = 1) const {
    return batch_size / (micro_batch_size * ranks);
  }
  // The batch on `ranks` data-parallel ranks: fills batch_size or micro_batch_size where
  // gradient_accumulation_steps left one to the rank count, and checks that batch_size splits
  // into micro-batches over the ranks (the error suggests the micro_batch_size that would).
  Status resolve_batch(int ranks);
  // Whether resolve_batch(ranks) would succeed.
  Status check_batch_split(int ranks) const {
    TrainConfig c = *this;
    return c.resolve_batch(ranks);
  }
  // The learning rate of every step: lr_schedule with optimizer.lr, over max_steps unless
  // lr_schedule.total_steps says otherwise.
  optim::LrSchedule schedule() const;
  // The device the config asks for (kind, budget, GPU index, TF32, attention, threads).
  device::DeviceOptions device_options() const;
  // The model's options the config asks for (compute dtype, activation checkpointing), as
  // pipeline stage `pipeline_rank` runs them with `data_ranks` data-parallel ranks (whose
  // micro-batches set how many the stage holds at once).
  model::ModelOptions model_options(int pipeline_rank = 0, int data_ranks = 1) const;
  // The pipeline's shape with `data_ranks` data-parallel ranks: its micro-batches are each
  // rank's gradient-accumulation micro-batches.
  PipelineShape pipeline_shape(int data_ranks) const {
    return {pipeline_parallel_size, static_cast<int>(accumulation_steps(data_ranks)),
            virtual_stages};
  }
  // "deepspeed FILE: its keys joined; decided by Strata: K, K, ..." and a newline, or "" without
  // a DeepSpeed config.
  std::string deepspeed_line() const;
  // The config as JSON with every key (defaults filled in): saved in checkpoints.
  Json to_json() const;
};

// Where keys of a config came from other than its file, for messages: the dotted keys of its
// "--set key=value" overrides, and the keys a command's flags set (metrics_file by --metrics).
struct ConfigOrigins {
  std::vector<std::string> set_keys;
  std::vector<std::string> flag_keys;
  // The keys a DeepSpeed config set, and its name (filled in while it is joined).
  std::vector<std::string> deepspeed_keys;
  std::string deepspeed_source;
  std::string of(const std::string& dotted_key, const std::string& source) const;
};

// Parses and validates. `source` names the file in messages; a "deepspeed" key (a DeepSpeed
// config file's path, or the object) is joined in first (join_deepspeed_config).
Result<TrainConfig> parse_train_config(const Json& json, const std::string& source,
                                       const ConfigOrigins& origins = {});
// The config's keys, each with its default, a line each ("optimizer.lr = 0.001"): what
// strata train --list-keys prints.
std::string list_config_keys();
// "fp32", "bf16" or "fp16", as the config spells the precision.
std::string_view precision_name(DType precision);
// The config file at `path`, with the "--set key=value" `overrides` and then the top-level
// `keys` the command's own flags give (--metrics FILE is "metrics_file") applied, read as one:
// every problem, the file's or a flag's, reported at once.
Result<TrainConfig> load_train_config(const std::string& path,
                                      const std::vector<std::string>& overrides,
                                      const Json& keys = Json::object());
// The same for a config already read: `json`, named `source` in messages (the Python module's
// strata.train takes a dict).
Result<TrainConfig> train_config_from_json(Json json, const std::string& source,
                                           const std::vector<std::string>& overrides,
                                           const Json& keys = Json::object());
// Applies one "--set key=value" override: dotted keys address nested objects; the value is
// parsed as JSON when it is valid JSON, else taken as a string.
Status apply_override(Json& json, const std::string& assignment);

}  // namespace strata::train
