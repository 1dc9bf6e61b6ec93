// The config's JSON forms: every key with its value (saved in checkpoints), the key list
// strata train --list-keys prints, and the DeepSpeed file's line in the log.
#include <functional>
#include <string>

#include "strata/train/config.h"

namespace strata::train {

namespace {
// The schedule's keys: those its type reads.
Json schedule_json(const LrScheduleConfig& l) {
  Json j{{"type", optim::schedule_kind_name(l.type)}, {"warmup_steps", l.warmup_steps}};
  switch (l.type) {
    case optim::ScheduleKind::kConstant:
    case optim::ScheduleKind::kCosine:
      j["min_lr"] = l.min_lr;
      break;
    case optim::ScheduleKind::kWarmup:
    case optim::ScheduleKind::kWarmupDecay:
      j["warmup_min_lr"] = l.warmup_min_lr;
      break;
    case optim::ScheduleKind::kWarmupCosine:
      j["warmup_min_ratio"] = l.warmup_min_ratio;
      j["cos_min_ratio"] = l.cos_min_ratio;
      break;
  }
  if (optim::is_deepspeed_schedule(l.type)) {
    j["warmup_type"] = optim::warmup_type_name(l.warmup_type);
    j["total_steps"] = l.total_steps;
  }
  return j;
}
}  // namespace

Json TrainConfig::to_json() const {
  Json j{
      {"model", model_path.empty() ? model.to_json() : Json(model_path)},
      {"seed", seed},
      {"data", {{"path", data.path}, {"format", token_format_name(data.format)}}},
      {"eval_data",
       eval_data ? Json{{"path", eval_data->path}, {"format", token_format_name(eval_data->format)}}
                 : Json()},
      {"eval_every", eval_every},
      {"eval_batches", eval_batches},
      {"seq_len", seq_len},
      {"batch_size", batch_size},
      {"micro_batch_size", micro_batch_size},
      {"gradient_accumulation_steps", gradient_accumulation_steps},
      {"max_steps", max_steps},
      {"precision", precision_name(precision)},
      {"fp16", precision == DType::kF16
                   ? Json{{"loss_scale", loss_scaler.loss_scale},
                          {"initial_scale_power", loss_scaler.initial_scale_power},
                          {"loss_scale_window", loss_scaler.loss_scale_window},
                          {"hysteresis", loss_scaler.hysteresis},
                          {"consecutive_hysteresis", loss_scaler.consecutive_hysteresis},
                          {"min_loss_scale", loss_scaler.min_loss_scale}}
                   : Json()},
      {"optimizer",
       {{"lr", optimizer.lr},
        {"betas", {optimizer.beta1, optimizer.beta2}},
        {"eps", optimizer.eps},
        {"weight_decay", optimizer.weight_decay},
        {"adamw_mode", optimizer.adamw_mode},
        {"state_dtype", precision_name(optimizer.state_dtype)},
        {"master_dtype", precision_name(optimizer.master_dtype)}}},
      {"lr_schedule", schedule_json(lr_schedule)},
      {"grad_clip", grad_clip},
      {"deterministic_reduction",
       deterministic_reduction_auto ? Json("auto") : Json(deterministic_reduction)},
      {"optimizer_overlap", zero::optimizer_overlap_name(optimizer_overlap)},
      {"grad_accumulation", zero::grad_accumulation_name(grad_accumulation)},
      {"activation_checkpointing", activation_checkpointing},
      {"lm_head_chunk_tokens", lm_head_chunk_tokens},
      {"zero_stage", zero_stage},
      {"tensor_parallel_size", tensor_parallel_size},
      {"sequence_parallel", sequence_parallel},
      {"parallelism", parallelism_auto ? "auto" : "manual"},
      {"pipeline_parallel_size", pipeline_parallel_size},
      {"expert_parallel_size", expert_parallel_size},
      {"pipeline_schedule", pipeline_schedule_name(pipeline_schedule)},
      {"virtual_stages", virtual_stages},
      {"pipeline_layers", pipeline_layers},
      {"sub_group_size", sub_group_size},
      {"param_persistence_threshold", param_persistence_threshold},
      {"reduce_bucket_bytes", reduce_bucket_bytes},
      {"allgather_bucket_bytes", allgather_bucket_bytes},
      {"dist_backend", dist::comm_backend_name(dist_backend)},
      {"dist_timeout_s", dist_timeout_s},
      {"ranks_per_node", ranks_per_node},
      {"intra_node_bytes_per_s", intra_node_bytes_per_s},
      {"inter_node_bytes_per_s", inter_node_bytes_per_s},
      {"offload_optimizer",
       offload_optimizer_auto ? "auto" : zero::offload_name(offload_optimizer)},
      {"offload_param", offload_param_auto ? "auto" : zero::offload_name(offload_param)},
      {"offload_optimizer_fraction",
       offload_optimizer_fraction_auto ? Json("auto") : Json(offload_optimizer_fraction)},
      {"activation_offload", zero::offload_name(activation_offload)},
      {"prefetch_bytes", prefetch_bytes},
      {"max_live_bytes", max_live_bytes},
      {"max_reuse_distance", max_reuse_distance},
      {"swap_paths", swap_paths},
      {"swap_engine", io::swap_engine_name(swap_engine)},
      {"swap_block_size", swap_block_size},
      {"swap_queue_depth", swap_queue_depth},
      {"swap_read_bytes_per_s", swap_read_bytes_per_s},
      {"swap_write_bytes_per_s", swap_write_bytes_per_s},
      {"swap_mixed_bytes_per_s", swap_mixed_bytes_per_s},
      {"swap_threads", swap_threads},
      {"verify_swap", verify_swap},
      {"device", device::device_kind_name(device)},
      {"device_memory_limit", device_memory_limit},
      {"device_index", device_index},
      {"allow_tf32", allow_tf32},
      {"attention", device::attention_variant_name(attention)},
      {"host_memory_limit", host_memory_limit},
      {"threads", threads},
      {"save_dir", save_dir},
      {"save_every", save_every},
      {"keep_last", keep_last},
      {"save_async", save_async},
      {"metrics_file", metrics_file},
      {"trace_file", trace_file},
      {"log_every", log_every},
      {"finetune", finetune.to_json(model.family)},
  };
  if (optimizer.master_dtype == DType::kBF16) {  // the key applies to bf16 master weights only
    j["optimizer"]["master_rounding"] =
        optimizer.master_rounding == device::MasterRounding::kKahan ? "kahan" : "stochastic";
  }
  return j;
}

std::string TrainConfig::deepspeed_line() const {
  if (deepspeed_source.empty()) return "";
  std::string s = "deepspeed " + deepspeed_source + ": its keys joined";
  if (!deepspeed_decided.empty()) {
    s += "; decided by Strata:";
    for (std::size_t i = 0; i < deepspeed_decided.size(); ++i) {
      s += (i == 0 ? " " : ", ") + deepspeed_decided[i];
    }
  }
  return s + "\n";
}

std::string list_config_keys() {
  TrainConfig defaults;
  Json j = defaults.to_json();
  j["model"] = "(required) a Hugging Face checkpoint directory, or its config.json inline";
  j["data"]["path"] = "(required) the token file";
  j["eval_data"] = "null, or {\"path\": ..., \"format\": ...} like data";
  j["deepspeed"] = "null, or a DeepSpeed config file's path (or its object): its keys join in";
  j["finetune"] = Json{{"method", "full | lora | qlora"},
                       {"r", 16},
                       {"alpha", 32},
                       {"dropout", 0.0},
                       {"target_modules", "[\"q_proj\", ...] or \"all-linear\""},
                       {"use_rslora", false},
                       {"modules_to_save", "null, or [\"embed_tokens\", \"lm_head\"]"},
                       {"adapter", "null, or a PEFT adapter directory to start from"},
                       {"quantized_cache", "null, or a directory keeping qlora's NF4 base"}};
  std::string out;
  const std::function<void(const Json&, const std::string&)> walk = [&](const Json& v,
                                                                        const std::string& key) {
    if (v.is_object() && !v.empty() && key != "model") {
      for (const auto& [k, child] : v.items()) walk(child, key.empty() ? k : key + "." + k);
      return;
    }
    out += key + " = " + (v.is_string() ? v.get<std::string>() : v.dump()) + "\n";
  };
  walk(j, "");
  return out;
}

}  // namespace strata::train
