// The memory plan of a config, made as the trainer makes it but without allocating anything.
#include "strata/train/estimate.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>

#include "strata/core/aligned.h"
#include "strata/core/dtype.h"
#include "strata/device/nf4.h"
#include "strata/dist/process_grid.h"
#include "strata/model/llama.h"
#include "strata/model/param_layout.h"
#include "strata/sys/process.h"
#include "strata/zero/partition.h"

namespace strata::train {

io::SwapOptions swap_options(const TrainConfig& config, int rank) {
  io::SwapOptions o;
  for (std::string path : config.swap_paths) {
    const std::string key = "{rank}";
    for (auto pos = path.find(key); pos != std::string::npos; pos = path.find(key)) {
      path.replace(pos, key.size(), std::to_string(rank));
    }
    o.paths.push_back(std::move(path));
  }
  o.engine = config.swap_engine;
  o.block_size_bytes = config.swap_block_size;
  o.queue_depth = config.swap_queue_depth;
  o.thread_count = config.swap_threads;
  o.verify_swap = config.verify_swap;
  return o;
}

Status make_rank_swap_dirs(const TrainConfig& config, int rank) {
  const std::vector<std::string> paths = swap_options(config, rank).paths;
  for (std::size_t i = 0; i < paths.size(); ++i) {
    if (config.swap_paths[i].find("{rank}") == std::string::npos) continue;
    const std::filesystem::path p(paths[i]);
    std::error_code ec;
    if (std::filesystem::exists(p, ec) || !std::filesystem::is_directory(p.parent_path(), ec)) {
      continue;  // there, or refused as missing when the swap space opens
    }
    if (!std::filesystem::create_directory(p, ec) && ec) {
      return failed_precondition("cannot make swap directory " + paths[i] + ": " + ec.message());
    }
  }
  return Status::ok();
}

std::uint64_t swap_free_bytes(const TrainConfig& config, int rank) {
  // Per filesystem: its free space (with the stale swap files a run reclaims) and its paths.
  struct Fs {
    std::uint64_t free = 0;
    int paths = 0;
  };
  std::map<dev_t, Fs> filesystems;
  const std::vector<std::string> paths = swap_options(config, rank).paths;
  for (std::string path : paths) {
    struct stat st {};
    std::error_code ec;
    // A rank's directory made at the start: its drive's space.
    if (!std::filesystem::exists(path, ec)) path = std::filesystem::path(path).parent_path();
    const auto space = std::filesystem::space(path, ec);
    if (ec || ::stat(path.c_str(), &st) != 0) return 0;  // not known
    Fs& fs = filesystems[st.st_dev];
    fs.free += fs.paths == 0 ? space.available : 0;
    fs.free += io::stale_swap_bytes(path);
    ++fs.paths;
  }
  // Data is striped evenly over the paths: the fullest filesystem, per path, bounds them all.
  std::uint64_t per_path = std::numeric_limits<std::uint64_t>::max();
  for (const auto& [dev, fs] : filesystems) {
    per_path = std::min(per_path, fs.free / static_cast<std::uint64_t>(fs.paths));
  }
  return filesystems.empty() ? 0 : per_path * paths.size();
}

zero::ShardOptions shard_options(const TrainConfig& config, int data_ranks, int pipeline_rank) {
  zero::ShardOptions o;
  const model::ModelOptions mo = config.model_options(pipeline_rank, data_ranks);
  const std::int64_t batch = config.micro_batch_size, seq = config.seq_len;
  o.activation_bytes = model::LlamaModel::activation_bytes(config.model, mo, batch, seq);
  o.checkpoint_bytes = model::LlamaModel::checkpoint_bytes(config.model, mo, batch, seq);
  o.num_checkpoints = model::LlamaModel::num_checkpoints(config.model, mo);
  o.host_io_bytes =
      model::LlamaModel::host_io_bytes(config.model, batch, seq, config.tensor_parallel_size,
                                       mo.pipeline.in_flight, config.expert_parallel_size);
  // Cut into stages, the last stage's head reads a copy of the embedding in the workspace.
  o.tied_embeddings = config.model.tie_word_embeddings && config.pipeline_parallel_size == 1;
  o.offload_param = config.offload_param;
  o.offload_optimizer = config.offload_optimizer;
  o.offload_optimizer_fraction = config.offload_optimizer_fraction;
  o.checkpoint_home = config.activation_offload;
  o.compute_dtype = config.precision;
  o.accumulation_steps = config.accumulation_steps(data_ranks);
  o.tree_sums = config.deterministic_reduction;
  o.overlap = config.optimizer_overlap;
  o.grad_accumulation = config.grad_accumulation;
  o.adam = config.optimizer;
  o.adam.seed = config.seed;  // bf16 master weights' stochastic rounding
  o.host_memory_limit_bytes = config.host_memory_limit;
  o.cpu_adam.threads = config.threads;
  o.sub_group_size = config.sub_group_size;
  o.prefetch_bytes = config.prefetch_bytes;
  o.max_live_bytes = config.max_live_bytes;
  o.max_reuse_distance = config.max_reuse_distance;
  o.hold_state = config.save_async;
  return o;
}

zero::ZeroOptions zero_options(const TrainConfig& config, int data_ranks) {
  zero::ZeroOptions o;
  o.stage = config.zero_stage;
  o.compute_dtype = config.precision;
  // One rank sums 16-bit gradients in fp32: so do several, to give its bits (the MPI path's
  // reduction; NCCL's ring has its own order, so on a GPU they stay 16-bit).
  o.wide_gradients = config.deterministic_reduction && data_ranks > 1 &&
                     config.precision != DType::kF32 && config.device == device::DeviceKind::kCpu;
  o.gather_ahead = config.offload_param != Tier::kNvme;
  o.reduce_bucket_bytes =
      zero::effective_bucket_bytes(config.reduce_bucket_bytes, config.device_memory_limit);
  o.allgather_bucket_bytes =
      zero::effective_bucket_bytes(config.allgather_bucket_bytes, config.device_memory_limit);
  return o;
}

Status check_pipeline_shape(const TrainConfig& config, int data_ranks) {
  if (config.pipeline_parallel_size == 1) return Status::ok();
  const PipelineShape shape = config.pipeline_shape(data_ranks);
  const auto problems = pipeline_shape_problems(config.pipeline_schedule, shape);
  if (problems.empty()) return Status::ok();
  std::string msg = "pipeline_schedule \"" +
                    std::string(pipeline_schedule_name(config.pipeline_schedule)) + "\" over " +
                    std::to_string(shape.stages) + " stages with " +
                    std::to_string(shape.micro_batches) + " micro-batches a step (batch_size " +
                    std::to_string(config.batch_size) + " / (micro_batch_size " +
                    std::to_string(config.micro_batch_size) + " x " + std::to_string(data_ranks) +
                    " data-parallel ranks)) cannot run:";
  for (const auto& p : problems) msg += "\n  " + p;
  return invalid_argument(msg);
}

Result<Estimate> estimate(const TrainConfig& given, int ranks, const EstimateOptions& options) {
  TrainConfig config = given;
  if (ranks < 1) return invalid_argument("--ranks " + std::to_string(ranks) + ": expected >= 1");
  STRATA_CHECK(options.rank >= 0 && options.rank < ranks, "rank outside the ranks planned",
               options.rank, ranks);
  // The grid: tensor_parallel_size ranks split each layer, pipeline_parallel_size stages hold
  // the layers in turn, ZeRO shards over the rest.
  const int tp = config.tensor_parallel_size, pp = config.pipeline_parallel_size;
  if (ranks % (tp * pp) != 0) {
    return invalid_argument("--ranks " + std::to_string(ranks) +
                            " must be a multiple of tensor_parallel_size " + std::to_string(tp) +
                            (pp > 1 ? " x pipeline_parallel_size " + std::to_string(pp) : ""));
  }
  const dist::GridShape shape{ranks / (tp * pp), tp, pp, config.expert_parallel_size};
  if (shape.data % shape.expert != 0) {
    return invalid_argument("--ranks " + std::to_string(ranks) + ": expert_parallel_size " +
                            std::to_string(shape.expert) + " must divide the " +
                            std::to_string(shape.data) + " data-parallel ranks");
  }
  const dist::GridCoord at = dist::grid_coord(shape, options.rank);
  STRATA_RETURN_IF_ERROR(config.resolve_batch(shape.data));
  Estimate e;
  e.ranks = ranks;
  e.rank = options.rank;
  e.pipeline_stages = pp;
  e.pipeline_stage = at.pipeline;
  e.model = config.model;
  STRATA_RETURN_IF_ERROR(check_pipeline_shape(config, shape.data));
  // This rank's slices of its stage's layers (the whole model without tensor and pipeline
  // parallelism); the counts are the whole model's.
  const model::ParamLayout full = config.param_layout(at.tensor, at.pipeline, at.expert);
  const model::ParamLayout whole = config.whole_layout();
  e.parameters = whole.num_parameters();
  for (const auto& g : whole.groups()) {
    std::int64_t n = 0;
    for (const auto& t : g.tensors) n += t.num_elems;
    if (!g.frozen) e.trainable_parameters += n;
    // Each expert is idle for all but experts_per_token / experts of the tokens.
    if (g.expert_layer >= 0) {
      const double idle = 1.0 - static_cast<double>(config.model.moe.experts_per_token) /
                                    static_cast<double>(config.model.moe.num_experts);
      const auto inactive = static_cast<std::int64_t>(std::llround(idle * static_cast<double>(n)));
      e.inactive_parameters += inactive;
      if (!g.frozen) e.inactive_trainable += inactive;
    }
  }
  e.embedding_trains = !full.group(full.embed_group()).frozen;
  e.finetune = describe_finetune(config, whole);
  // ZeRO over the data-parallel ranks; an expert's groups over the expert-data ranks.
  std::optional<zero::ShardAxis> experts;
  if (shape.expert > 1)
    experts = zero::ShardAxis{at.data / shape.expert, shape.data / shape.expert};
  const zero::Partition partition(full, {at.data, shape.data}, config.param_persistence_threshold,
                                  experts);
  for (const auto& g : partition.groups()) {
    e.groups_partitioned += g.replicated || g.full_elems == 0 ? 0 : 1;  // of the rank's stage
    if (!full.group(g.group).frozen) e.trainable_local_elems += g.local_elems();
  }

  const bool swap = config.uses_nvme();
  zero::ShardOptions eo = shard_options(config, shape.data, at.pipeline);
  if (swap && options.check_swap_free) eo.swap_free_bytes = swap_free_bytes(config, options.rank);
  zero::PlanOptions po = zero::plan_options(eo, config.device_memory_limit, swap,
                                            config.device == device::DeviceKind::kCpu);
  po.zero = zero_options(config, shape.data);
  auto plan = zero::make_plan(partition, po);
  if (!plan.is_ok()) return plan.status();
  e.plan = std::move(*plan);
  if (config.device_memory_limit != 0 && e.device_bytes_needed() > config.device_memory_limit) {
    return out_of_memory(
        "device_memory_limit " + format_bytes(config.device_memory_limit) +
        " is too small: this plan needs " + format_bytes(e.device_bytes_needed()) +
        " on the device (" + e.plan.kinds_text(Tier::kDevice) +
        (e.plan.params == Tier::kDevice
             ? ""
             : ", and " + format_bytes(e.plan.group_in_use_bytes) + " for the group in use") +
        ")");
  }

  e.measure_process();
  return e;
}

void Estimate::measure_process() {
  if (auto mem = sys::read_process_memory(); mem.is_ok()) process_bytes = mem->rss_bytes;
  rss_bytes = process_bytes + plan.host_ram_bytes();
}

std::uint64_t Estimate::device_bytes_needed() const {
  return plan.tier_bytes(Tier::kDevice) + plan.group_in_use_bytes;
}

std::string describe_finetune(const TrainConfig& config, const model::ParamLayout& layout) {
  const auto lora = config.lora();
  if (!lora) return "";
  std::int64_t trainable = 0, frozen = 0, nf4 = 0;
  std::uint64_t nf4_bytes = 0;
  for (const auto& g : layout.groups()) {
    for (const auto& t : g.tensors) {
      (g.frozen ? frozen : trainable) += t.num_elems;
      if (t.format != model::TensorFormat::kNf4) continue;
      nf4 += t.num_elems;
      nf4_bytes += device::nf4_bytes(t.num_elems);
    }
  }
  std::string targets;
  for (const auto& n : lora->target_names(config.model.family))
    targets += (targets.empty() ? "" : ", ") + n;
  char buf[200];
  std::snprintf(buf, sizeof(buf),
                "%s r %lld, alpha %g%s, dropout %g on %s: ", config.nf4_base() ? "QLoRA" : "LoRA",
                static_cast<long long>(lora->r), lora->alpha, lora->use_rslora ? " (rsLoRA)" : "",
                lora->dropout, targets.c_str());
  std::string s = buf + std::to_string(trainable) + " trainable parameters";
  if (!lora->modules_to_save.empty()) {
    std::string saved;
    for (const auto& m : lora->modules_to_save) saved += (saved.empty() ? "" : ", ") + m;
    s += " (with " + saved + " trained whole)";
  }
  s += "; the base's " + std::to_string(frozen) +
       " frozen (read only: no gradient, no optimizer state)";
  if (nf4 > 0) {
    std::snprintf(buf, sizeof(buf), "; its %lld projection weights in NF4: %s, %.3f bytes each",
                  static_cast<long long>(nf4), format_bytes(nf4_bytes).c_str(),
                  static_cast<double>(nf4_bytes) / static_cast<double>(nf4));
    s += buf;
  }
  return s;
}

std::string Estimate::describe() const {
  std::string s = "model: " + std::to_string(parameters) + " parameters (" +
                  std::to_string(model.num_hidden_layers) + " layers, hidden " +
                  std::to_string(model.hidden_size) + ", vocab " +
                  std::to_string(model.vocab_size) + ")\n";
  if (model.has_moe()) {
    s += "mixture of experts: " + std::to_string(active_parameters()) +
         " parameters active per token (" + std::to_string(model.moe.experts_per_token) + " of " +
         std::to_string(model.moe.num_experts) +
         " experts in each MoE layer); the step's FLOPs follow them, its bytes every parameter\n";
  }
  if (!finetune.empty()) s += finetune + "\n";
  s += "rank " + std::to_string(rank) + " of " + std::to_string(ranks) +
       (pipeline_stages > 1 ? " (pipeline stage " + std::to_string(pipeline_stage) + " of " +
                                  std::to_string(pipeline_stages) + ")"
                            : std::string()) +
       ": " + std::to_string(groups_partitioned) + " parameter groups partitioned\n";
  s += plan.describe();
  const auto beyond = [](std::uint64_t peak, std::uint64_t planned, const std::string& of) {
    return peak > planned ? " (" + format_bytes(planned) + " planned + " +
                                format_bytes(peak - planned) + " of " + of + ")"
                          : std::string();
  };
  const std::string reuse = "working copies and buffers kept for reuse";
  const std::uint64_t device_peak = plan.peak(Tier::kDevice);
  const std::uint64_t host_peak = plan.peak(Tier::kHost);
  s += "peaks: device " + format_bytes(device_peak) +
       beyond(device_peak, plan.tier_bytes(Tier::kDevice),
              (plan.collective_bytes != 0 ? "ZeRO's buffers, " : "") + reuse) +
       ", pinned host " + format_bytes(host_peak) +
       beyond(host_peak, plan.tier_bytes(Tier::kHost), reuse) + ", nvme " +
       format_bytes(plan.peak(Tier::kNvme)) + "\n";
  s += "peak resident memory (rss): " + format_bytes(rss_bytes) + " = pinned host " +
       format_bytes(host_peak) + " + other " + format_bytes(other_host_bytes()) + " (the process " +
       format_bytes(process_bytes) +
       (plan.device_is_host_memory ? ", the device " + format_bytes(device_peak) +
                                         ": the CPU backend's device memory is host memory"
                                   : std::string()) +
       ")\n";
  return s;
}

const char* Estimate::grad_accumulation() const {
  if (plan.keep_gradients) return "none";
  return plan.sums_on_device() ? "device" : "host";
}

Json Estimate::to_json() const {
  Json tiers = Json::object();
  for (Tier t : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
    Json kinds = Json::object();
    for (int k = 0; k < zero::kNumTensorKinds; ++k) {
      const auto kind = static_cast<zero::TensorKind>(k);
      kinds[std::string(zero::tensor_kind_name(kind))] = plan.kind_bytes(t, kind);
    }
    tiers[std::string(tier_name(t))] = kinds;
  }
  return Json{{"parameters", parameters},
              {"active_parameters", active_parameters()},
              {"ranks", ranks},
              {"rank", rank},
              {"device_bytes", plan.tier_bytes(Tier::kDevice)},
              {"host_bytes", plan.tier_bytes(Tier::kHost)},
              {"nvme_bytes", plan.tier_bytes(Tier::kNvme)},
              {"host_peak_bytes", plan.peak(Tier::kHost)},
              {"device_peak_bytes", plan.peak(Tier::kDevice)},
              {"collective_bytes", plan.collective_bytes},
              {"pinned_host_bytes", plan.peak(Tier::kHost)},
              {"other_host_bytes", other_host_bytes()},
              {"cache_bytes",
               {{"device", plan.cache_bytes[static_cast<std::size_t>(Tier::kDevice)]},
                {"host", plan.cache_bytes[static_cast<std::size_t>(Tier::kHost)]}}},
              {"process_bytes", process_bytes},
              {"rss_bytes", rss_bytes},
              {"optimizer_overlap", zero::optimizer_overlap_name(plan.overlap)},
              {"shadow_state", plan.shadow_state},
              {"offload_fraction", plan.offload_fraction},
              {"grad_accumulation", grad_accumulation()},
              {"kinds", tiers}};
}

}  // namespace strata::train
