// Strict parsing of the training config.
#include "strata/train/config.h"

#include <algorithm>
#include <array>
#include <functional>

#include "strata/core/file.h"
#include "strata/device/adam8bit.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/train/deepspeed_config.h"
#include "strata/zero/plan.h"

namespace strata::train {

Status apply_override(Json& json, const std::string& assignment) {
  if (!is_utf8(assignment)) {
    return invalid_argument(
        "--set: an assignment that is not UTF-8; a config holds UTF-8 text only");
  }
  const auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    return invalid_argument("--set '" + assignment +
                            "' must look like key=value (e.g. --set optimizer.lr=1e-4)");
  }
  const std::string key = assignment.substr(0, eq);
  const std::string text = assignment.substr(eq + 1);
  Json value;
  try {
    value = Json::parse(text);
  } catch (const Json::exception&) {  // not JSON, or a number out of range (1e999)
    value = text;
  }
  Json* node = &json;
  std::size_t start = 0;
  for (;;) {
    const auto dot = key.find('.', start);
    const std::string part =
        key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (part.empty()) return invalid_argument("--set key '" + key + "' has an empty component");
    if (!node->is_object()) {
      return invalid_argument("--set " + key + ": '" + key.substr(0, start == 0 ? 0 : start - 1) +
                              "' is not an object");
    }
    if (dot == std::string::npos) {
      (*node)[part] = value;
      return Status::ok();
    }
    if (!node->contains(part)) (*node)[part] = Json::object();
    node = &(*node)[part];
    start = dot + 1;
  }
}

std::string_view precision_name(DType precision) {
  switch (precision) {
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "fp16";
    case device::kAdam8StateDType:
      return "int8";  // optimizer.state_dtype's block-wise 8-bit moments
    default:
      return "fp32";
  }
}

namespace {

constexpr std::array<DType, 3> kPrecisions = {DType::kF32, DType::kBF16, DType::kF16};
constexpr std::array<Tier, 3> kTiers = {Tier::kDevice, Tier::kHost, Tier::kNvme};

// Reads a string key that names one of `values` (as `name` spells them) into *out; anything
// else is an error listing the names. Absent: *out keeps its default.
template <typename T, std::size_t N>
void read_enum(JsonReader& r, const std::string& key, T* out, const std::array<T, N>& values,
               std::string_view (*name)(T)) {
  std::string s(name(*out));
  std::vector<std::string> names;
  for (T v : values) names.emplace_back(name(v));
  r.read_choice(key, &s, names);
  for (T v : values) {
    if (name(v) == s) *out = v;
  }
}

// "none", "cpu", "nvme" or "auto" (the tier stays as it was, to be chosen).
void read_offload(JsonReader& r, const std::string& key, Tier* tier, bool* automatic) {
  std::string s = *automatic ? "auto" : std::string(zero::offload_name(*tier));
  std::vector<std::string> names;
  for (Tier t : kTiers) names.emplace_back(zero::offload_name(t));
  names.emplace_back("auto");
  r.read_choice(key, &s, names);
  *automatic = s == "auto";
  for (Tier t : kTiers) {
    if (zero::offload_name(t) == s) *tier = t;
  }
}

}  // namespace

namespace {
// The "finetune" object: PEFT's LoraConfig keys, strictly.
void read_finetune(const Json& f, FinetuneConfig* out, std::vector<std::string>* errors) {
  if (!f.is_object()) {
    errors->push_back("'finetune': expected an object, e.g. {\"method\": \"lora\", \"r\": 16}");
    return;
  }
  JsonReader r(f, "finetune", errors);
  constexpr std::array<FinetuneMethod, 3> kMethods{FinetuneMethod::kFull, FinetuneMethod::kLora,
                                                   FinetuneMethod::kQlora};
  read_enum(r, "method", &out->method, kMethods, finetune_method_name);
  model::LoraConfig& l = out->lora;
  r.read("r", &l.r, 1, 65536);
  // PEFT's names (adapter_config.json's lora_alpha, lora_dropout) as well as Strata's; one of
  // each pair.
  for (const auto& [ours, peft] :
       {std::pair{"alpha", "lora_alpha"}, std::pair{"dropout", "lora_dropout"}}) {
    if (r.has(ours) && r.has(peft)) {
      r.error(peft, std::string("is PEFT's name for '") + ours + "', which is set too; keep one");
    }
  }
  const char* alpha = r.has("lora_alpha") ? "lora_alpha" : "alpha";
  r.read(alpha, &l.alpha, 0.0);
  if (l.alpha <= 0) r.error(alpha, "expected a positive number, e.g. 32 (scaling alpha / r)");
  const char* dropout = r.has("lora_dropout") ? "lora_dropout" : "dropout";
  r.read(dropout, &l.dropout, 0.0, 1.0);
  if (l.dropout >= 1) r.error(dropout, "expected a probability in [0, 1)");
  if (r.has("target_modules")) {
    const Json* t = r.raw("target_modules");
    std::vector<std::string> names;
    if (t->is_string() && *t == "all-linear") {
      l.targets = model::LoraConfig::all_linear();
    } else if (!t->is_array() || t->empty()) {
      r.error("target_modules",
              "expected a non-empty list of q_proj, k_proj, v_proj, o_proj, gate_proj, "
              "up_proj, down_proj, gate (an MoE layer's router), or \"all-linear\"");
    } else {
      l.targets.fill(false);
      for (const Json& n : *t) {
        const auto target =
            n.is_string() ? model::parse_lora_target(n.get<std::string>()) : std::nullopt;
        if (!target) {
          r.error("target_modules", n.dump() +
                                        " is not a projection of the decoder; expected q_proj, "
                                        "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj "
                                        "or gate (an MoE layer's router)");
          continue;
        }
        l.targets[static_cast<std::size_t>(*target)] = true;
      }
    }
  }
  r.read("use_rslora", &l.use_rslora);
  if (const Json* m = r.raw("modules_to_save"); m != nullptr && !m->is_null()) {
    if (!m->is_array()) {
      r.error("modules_to_save",
              "expected a list of modules that train whole beside the adapters, e.g. "
              "[\"embed_tokens\", \"lm_head\"], or null");
    } else {
      for (const Json& n : *m) {
        if (n.is_string() && !n.get<std::string>().empty()) {
          l.modules_to_save.push_back(n.get<std::string>());
        } else {
          r.error("modules_to_save", n.dump() + " is not a module name");
        }
      }
    }
  }
  if (const Json* a = r.raw("adapter"); a != nullptr && !a->is_null()) {
    if (a->is_string()) {
      out->adapter = a->get<std::string>();
    } else {
      r.error("adapter", "expected a PEFT adapter directory path or null");
    }
  }
  if (const Json* q = r.raw("quantized_cache"); q != nullptr && !q->is_null()) {
    if (!q->is_string() || q->get<std::string>().empty()) {
      r.error("quantized_cache", "expected a directory path (kept between runs) or null");
    } else if (out->method != FinetuneMethod::kQlora) {
      r.error("quantized_cache", "keeps a quantized base: it applies only to method \"qlora\"");
    } else {
      out->quantized_cache = q->get<std::string>();
    }
  }
  if (out->method == FinetuneMethod::kFull) {
    for (const char* k : {"r", "alpha", "lora_alpha", "dropout", "lora_dropout", "target_modules",
                          "use_rslora", "modules_to_save"}) {
      if (r.has(k)) r.error(k, "applies only to method \"lora\"; it has no meaning for \"full\"");
    }
    if (!out->adapter.empty()) r.error("adapter", "starts LoRA adapters: use method \"lora\"");
  }
  r.reject_unknown();
}
}  // namespace

std::string ConfigOrigins::of(const std::string& indexed_key, const std::string& source) const {
  const std::string dotted_key = indexed_key.substr(0, indexed_key.find('['));  // swap_paths[0]
  const auto within = [&](const std::string& k) {
    return dotted_key == k || dotted_key.rfind(k + ".", 0) == 0;
  };
  if (std::any_of(set_keys.begin(), set_keys.end(), within)) return "--set " + dotted_key;
  if (std::any_of(flag_keys.begin(), flag_keys.end(), within)) return "a command-line flag";
  if (std::any_of(deepspeed_keys.begin(), deepspeed_keys.end(), within)) return deepspeed_source;
  return source;
}

namespace {
constexpr const char* kListKeysHint = "strata train --list-keys lists every key";

// The config with its "deepspeed" file (or object) joined in; the file's name in *ds_source.
Json with_deepspeed(const Json& json, const std::string& source, ConfigOrigins* origins,
                    TrainConfig* c, std::vector<std::string>* errors) {
  const Json& d = json["deepspeed"];
  Json ds;
  if (d.is_string()) {
    auto path = expand_path(d.get<std::string>());
    auto read = path.is_ok() ? read_json_file(*path) : Result<Json>(path.status());
    if (!read.is_ok()) {
      errors->push_back("'deepspeed': " + read.status().message());
      return json;
    }
    ds = std::move(*read);
    c->deepspeed_source = d.get<std::string>();
  } else if (d.is_object()) {
    ds = d;
    c->deepspeed_source = source + "'s \"deepspeed\"";
  } else {
    errors->push_back(
        "'deepspeed': expected a DeepSpeed config file's path or the config object, got " +
        d.dump());
    return json;
  }
  Json base = json;
  base.erase("deepspeed");
  DeepSpeedJoin joined = join_deepspeed_config(
      base, [&](const std::string& key) { return origins->of(key, source); }, ds,
      c->deepspeed_source, errors);
  c->deepspeed_decided = std::move(joined.decided);
  origins->deepspeed_keys = std::move(joined.keys);
  origins->deepspeed_source = c->deepspeed_source;
  return std::move(joined.config);
}
}  // namespace

Result<TrainConfig> parse_train_config(const Json& in, const std::string& source,
                                       const ConfigOrigins& given_origins) {
  ConfigOrigins origins = given_origins;
  if (!in.is_object()) return invalid_argument(source + ": the config must be a JSON object");
  std::vector<std::string> errors;
  TrainConfig c;
  const bool deepspeed = in.contains("deepspeed") && !in["deepspeed"].is_null();
  const Json json = deepspeed ? with_deepspeed(in, source, &origins, &c, &errors) : in;
  JsonReader r(json, "", &errors);
  r.set_list_hint(kListKeysHint);
  r.raw("deepspeed");

  bool has_model = false;
  if (const Json* m = r.raw("model")) {
    Result<model::LlamaConfig> read = invalid_argument(
        "expected a path to a Hugging Face checkpoint directory or an inline config object, got " +
        m->dump());
    if (m->is_string()) {
      c.model_path = m->get<std::string>();
      // "~" is the home directory, as for every path key (below).
      if (auto path = expand_path(c.model_path); path.is_ok()) {
        c.model_path = *path;
        read = model::HfCheckpointReader::read_config(c.model_path);
      } else {
        read = path.status();
      }
    } else if (m->is_object()) {
      read = model::LlamaConfig::from_json(*m, "config key 'model'");
    }
    if (read.is_ok()) {
      c.model = *read;
      has_model = true;
    } else {
      r.error("model", read.status().message());
    }
  } else {
    r.error("model", "is required: a checkpoint directory path or an inline HF config object");
  }
  std::int64_t seed = static_cast<std::int64_t>(c.seed);
  r.read("seed", &seed, 0);
  c.seed = static_cast<std::uint64_t>(seed);

  auto read_data = [&](const char* key, DataConfig* out) {
    const Json* d = r.raw(key);
    if (!d->is_object()) {
      r.error(key, "expected an object {\"path\": ..., \"format\": ...}");
      return;
    }
    JsonReader dr(*d, key, &errors);
    dr.read("path", &out->path);
    read_enum(dr, "format", &out->format, kTokenFormats, token_format_name);
    if (out->path.empty()) dr.error("path", "is required");
    dr.reject_unknown();
  };
  if (r.has("data")) {
    read_data("data", &c.data);
  } else {
    r.error("data", "is required: {\"path\": FILE, \"format\": \"auto|u16|u32|llmc|text\"}");
  }
  if (r.has("eval_data")) {
    c.eval_data.emplace();
    read_data("eval_data", &*c.eval_data);
  } else {
    r.raw("eval_data");  // null is allowed: no evaluation
  }
  r.read("eval_every", &c.eval_every, 0);
  r.read("eval_batches", &c.eval_batches, 0);
  if (!c.eval_data && (c.eval_every > 0 || c.eval_batches > 0)) {
    r.error(c.eval_every > 0 ? "eval_every" : "eval_batches",
            "needs eval_data: {\"path\": FILE, \"format\": ...}");
  }
  r.read("seq_len", &c.seq_len, 1, 1 << 20);
  if (has_model && c.seq_len > c.model.max_position_embeddings) {
    r.error("seq_len", std::to_string(c.seq_len) + " exceeds the model's max_position_embeddings " +
                           std::to_string(c.model.max_position_embeddings));
  }
  r.read("batch_size", &c.batch_size, 1);
  r.read("micro_batch_size", &c.micro_batch_size, 0);
  r.read("gradient_accumulation_steps", &c.gradient_accumulation_steps, 0);
  if (c.gradient_accumulation_steps > 0 && !r.has("batch_size")) {
    c.batch_size = 0;  // micro_batch_size x gradient_accumulation_steps x the ranks
    if (c.micro_batch_size == 0) {
      r.error("gradient_accumulation_steps",
              "needs batch_size or micro_batch_size as well (DeepSpeed's rule derives the third)");
    }
  }
  r.read("max_steps", &c.max_steps, 0);
  read_enum(r, "precision", &c.precision, kPrecisions, precision_name);
  // fp16's loss scaling: DeepSpeed's "fp16" block and key names ("enabled" is the precision).
  if (const Json* f = r.raw("fp16"); f != nullptr && !f->is_null()) {
    if (!f->is_object()) {
      r.error("fp16", "expected an object, e.g. {\"loss_scale\": 0, \"initial_scale_power\": 16}");
    } else if (c.precision != DType::kF16) {
      r.error("fp16", "sets fp16's loss scaling, but precision is \"" +
                          std::string(precision_name(c.precision)) + "\"; set precision \"fp16\"");
    } else {
      JsonReader fr(*f, "fp16", &errors);
      optim::LossScalerConfig& l = c.loss_scaler;
      fr.read("loss_scale", &l.loss_scale, 0.0);
      fr.read("initial_scale_power", &l.initial_scale_power, 0, 64);
      fr.read("loss_scale_window", &l.loss_scale_window, 1);
      fr.read("hysteresis", &l.hysteresis, 1);
      fr.read("consecutive_hysteresis", &l.consecutive_hysteresis);
      fr.read("min_loss_scale", &l.min_loss_scale, 0.0);
      if (!(l.min_loss_scale > 0)) fr.error("min_loss_scale", "expected a number above 0");
      if (const Json* e = fr.raw("enabled"); e && *e != true) {
        fr.error("enabled", "fp16 is on when precision is \"fp16\"; drop \"enabled\"");
      }
      fr.reject_unknown();
    }
  }

  if (const Json* o = r.raw("optimizer")) {
    if (!o->is_object()) {
      r.error("optimizer", "expected an object");
    } else {
      JsonReader orr(*o, "optimizer", &errors);
      orr.read("lr", &c.optimizer.lr, 0.0);
      std::vector<double> betas{c.optimizer.beta1, c.optimizer.beta2};
      orr.read("betas", &betas);
      if (betas.size() != 2 || betas[0] < 0 || betas[0] >= 1 || betas[1] < 0 || betas[1] >= 1) {
        orr.error("betas", "expected two numbers in [0, 1), e.g. [0.9, 0.999]");
      } else {
        c.optimizer.beta1 = betas[0];
        c.optimizer.beta2 = betas[1];
      }
      orr.read("eps", &c.optimizer.eps, 0.0);
      orr.read("weight_decay", &c.optimizer.weight_decay, 0.0);
      // false: Adam with L2 regularisation (weight_decay x w added to the gradient, as
      // torch.optim.Adam and DeepSpeed's adam_w_mode false), not AdamW's decoupled decay.
      orr.read("adamw_mode", &c.optimizer.adamw_mode);
      {
        std::string state = "fp32", master = "fp32", rounding = "stochastic";
        orr.read_choice("state_dtype", &state, {"fp32", "bf16", "int8"});
        c.optimizer.state_dtype = state == "bf16"   ? DType::kBF16
                                  : state == "int8" ? device::kAdam8StateDType
                                                    : DType::kF32;
        orr.read_choice("master_dtype", &master, {"fp32", "bf16"});
        c.optimizer.master_dtype = master == "bf16" ? DType::kBF16 : DType::kF32;
        orr.read_choice("master_rounding", &rounding, {"stochastic", "kahan"});
        c.optimizer.master_rounding = rounding == "kahan" ? device::MasterRounding::kKahan
                                                          : device::MasterRounding::kStochastic;
        if (orr.has("master_rounding") && master != "bf16") {
          orr.error("master_rounding", "applies to master_dtype \"bf16\" only");
        }
      }
      if (const Json* t = orr.raw("type"); t && *t != "adamw")
        orr.error("type", "only \"adamw\" is supported");
      orr.reject_unknown();
    }
  }
  if (const Json* s = r.raw("lr_schedule")) {
    if (!s->is_object()) {
      r.error("lr_schedule", "expected an object");
    } else {
      JsonReader sr(*s, "lr_schedule", &errors);
      LrScheduleConfig& l = c.lr_schedule;
      read_enum(sr, "type", &l.type, optim::kScheduleKinds, optim::schedule_kind_name);
      sr.read("warmup_steps", &l.warmup_steps, 0);
      sr.read("min_lr", &l.min_lr, 0.0);
      constexpr std::array<optim::WarmupType, 2> kWarmupTypes{optim::WarmupType::kLog,
                                                              optim::WarmupType::kLinear};
      read_enum(sr, "warmup_type", &l.warmup_type, kWarmupTypes, optim::warmup_type_name);
      sr.read("warmup_min_lr", &l.warmup_min_lr, 0.0);
      sr.read("warmup_min_ratio", &l.warmup_min_ratio, 0.0, 1.0);
      sr.read("cos_min_ratio", &l.cos_min_ratio, 0.0, 1.0);
      sr.read("total_steps", &l.total_steps, 0);
      // Each key where its schedule reads it: DeepSpeed's keys with DeepSpeed's schedules.
      const bool deepspeed = optim::is_deepspeed_schedule(l.type);
      const std::string type(optim::schedule_kind_name(l.type));
      if (sr.has("min_lr") && deepspeed) {
        sr.error("min_lr", "is cosine's floor; type \"" + type +
                               "\" does not read it (DeepSpeed's schedules: warmup_min_lr, "
                               "cos_min_ratio)");
      }
      for (const char* k : {"warmup_type", "total_steps"}) {
        if (sr.has(k) && !deepspeed) {
          sr.error(k, std::string("applies to DeepSpeed's schedules (warmup, warmup_decay, "
                                  "warmup_cosine), not \"") +
                          type + "\"");
        }
      }
      if (sr.has("warmup_min_lr") && l.type != optim::ScheduleKind::kWarmup &&
          l.type != optim::ScheduleKind::kWarmupDecay) {
        sr.error("warmup_min_lr", "applies to types \"warmup\" and \"warmup_decay\", not \"" +
                                      type + "\"" +
                                      (l.type == optim::ScheduleKind::kWarmupCosine
                                           ? " (it starts at warmup_min_ratio x lr)"
                                           : ""));
      }
      for (const char* k : {"warmup_min_ratio", "cos_min_ratio"}) {
        if (sr.has(k) && l.type != optim::ScheduleKind::kWarmupCosine) {
          sr.error(k, "applies to type \"warmup_cosine\", not \"" + type + "\"");
        }
      }
      sr.reject_unknown();
    }
  }
  if (const Json* f = r.raw("finetune")) {
    read_finetune(*f, &c.finetune, &errors);
    if (has_model) {
      for (const auto& p : model::lora_problems(c.model, c.finetune.lora)) {
        errors.push_back("'finetune." + p.key + "': " + p.text);
      }
    }
  }
  r.read("grad_clip", &c.grad_clip, 0.0);
  if (const Json* d = r.raw("deterministic_reduction")) {
    if (d->is_boolean()) {
      c.deterministic_reduction = d->get<bool>();
      c.deterministic_reduction_auto = false;
    } else if (!d->is_string() || d->get<std::string>() != "auto") {
      r.error("deterministic_reduction", "expected true, false or \"auto\", got " + d->dump());
    }
  }
  read_enum(r, "optimizer_overlap", &c.optimizer_overlap, zero::kOptimizerOverlaps,
            zero::optimizer_overlap_name);
  read_enum(r, "grad_accumulation", &c.grad_accumulation, zero::kGradAccumulations,
            zero::grad_accumulation_name);
  r.read("activation_checkpointing", &c.activation_checkpointing);
  r.read("lm_head_chunk_tokens", &c.lm_head_chunk_tokens, 0);
  r.read("zero_stage", &c.zero_stage, 1, 3);
  r.read("tensor_parallel_size", &c.tensor_parallel_size, 1, 1 << 16);
  r.read("sequence_parallel", &c.sequence_parallel);
  r.read("pipeline_parallel_size", &c.pipeline_parallel_size, 1, 1 << 16);
  r.read("expert_parallel_size", &c.expert_parallel_size, 1, 1 << 16);
  {
    std::string parallelism = "manual";
    r.read_choice("parallelism", &parallelism, {"manual", "auto"});
    c.parallelism_auto = parallelism == "auto";
  }
  read_enum(r, "pipeline_schedule", &c.pipeline_schedule, kPipelineSchedules,
            pipeline_schedule_name);
  // Interleaving's default: two chunks a stage.
  if (c.pipeline_schedule == PipelineSchedule::kInterleaved) c.virtual_stages = 2;
  r.read("virtual_stages", &c.virtual_stages, 1, 1 << 16);
  r.read("pipeline_layers", &c.pipeline_layers);
  r.read("sub_group_size", &c.sub_group_size, 1024);
  r.read("param_persistence_threshold", &c.param_persistence_threshold, 0);
  for (const auto& [key, out] : {std::pair{"reduce_bucket_bytes", &c.reduce_bucket_bytes},
                                 std::pair{"allgather_bucket_bytes", &c.allgather_bucket_bytes}}) {
    r.read_bytes(key, out);
    if (*out == 0) {
      r.error(key,
              "must be positive, got 0: it is the most bytes one collective moves "
              "(e.g. \"64MiB\"; smaller means more, smaller collectives)");
    } else if (*out > zero::kMaxBucketBytes) {
      r.error(key, "must be at most 1GiB (" + std::to_string(zero::kMaxBucketBytes) + "), got " +
                       std::to_string(*out) +
                       ": a bucket lives in device memory, and MPI counts its elements in an int");
    }
  }
  read_enum(r, "dist_backend", &c.dist_backend, dist::kCommBackends, dist::comm_backend_name);
  r.read("dist_timeout_s", &c.dist_timeout_s, 1);
  r.read("ranks_per_node", &c.ranks_per_node, 0, 1 << 20);
  r.read("intra_node_bytes_per_s", &c.intra_node_bytes_per_s, 0.0);
  r.read("inter_node_bytes_per_s", &c.inter_node_bytes_per_s, 0.0);
  read_offload(r, "offload_optimizer", &c.offload_optimizer, &c.offload_optimizer_auto);
  read_offload(r, "offload_param", &c.offload_param, &c.offload_param_auto);
  if (const Json* f = r.raw("offload_optimizer_fraction")) {
    if (f->is_number() && f->get<double>() >= 0.0 && f->get<double>() <= 1.0) {
      c.offload_optimizer_fraction = f->get<double>();
    } else if (f->is_string() && f->get<std::string>() == "auto") {
      c.offload_optimizer_fraction_auto = true;
    } else {
      r.error("offload_optimizer_fraction",
              "expected a number from 0 to 1 or \"auto\", got " + f->dump());
    }
    const bool partial = c.offload_optimizer_fraction_auto || c.offload_optimizer_fraction < 1.0;
    if (partial && !c.offload_optimizer_auto && c.offload_optimizer == Tier::kDevice) {
      r.error("offload_optimizer_fraction",
              "is the share of an offloaded optimizer's state, and offload_optimizer is "
              "\"none\" (all of it on the device); set offload_optimizer to \"cpu\" or "
              "\"nvme\"");
    }
  }
  read_enum(r, "activation_offload", &c.activation_offload, kTiers, zero::offload_name);
  r.read_bytes("prefetch_bytes", &c.prefetch_bytes);
  r.read_bytes("max_live_bytes", &c.max_live_bytes);
  r.read_bytes("max_reuse_distance", &c.max_reuse_distance);
  r.read("swap_paths", &c.swap_paths);
  read_enum(r, "swap_engine", &c.swap_engine, io::kSwapEngines, io::swap_engine_name);
  r.read_bytes("swap_block_size", &c.swap_block_size);
  if (c.swap_block_size == 0 || c.swap_block_size % 4096 != 0 || c.swap_block_size > (1u << 30)) {
    r.error("swap_block_size", std::to_string(c.swap_block_size) +
                                   " must be a positive multiple of 4096 no larger than 1GiB "
                                   "(e.g. \"1MiB\"; strata io-bench finds a good value)");
  }
  r.read("swap_queue_depth", &c.swap_queue_depth, 1, 4096);
  r.read("swap_threads", &c.swap_threads, 1, 64);
  r.read("verify_swap", &c.verify_swap);
  r.read("swap_read_bytes_per_s", &c.swap_read_bytes_per_s, 0.0);
  r.read("swap_write_bytes_per_s", &c.swap_write_bytes_per_s, 0.0);
  r.read("swap_mixed_bytes_per_s", &c.swap_mixed_bytes_per_s, 0.0);
  read_enum(r, "device", &c.device, device::kDeviceKinds, device::device_kind_name);
  r.read_bytes("device_memory_limit", &c.device_memory_limit);
  r.read("device_index", &c.device_index, -1, 1023);
  r.read("allow_tf32", &c.allow_tf32);
  read_enum(r, "attention", &c.attention, device::kAttentionVariants,
            device::attention_variant_name);
  r.read_bytes("host_memory_limit", &c.host_memory_limit);
  r.read("threads", &c.threads, 0, 1024);
  r.read("save_dir", &c.save_dir);
  r.read("save_every", &c.save_every, 0);
  if (c.save_dir.empty() && c.save_every > 0) {
    r.error("save_every", std::to_string(c.save_every) +
                              " needs a save_dir to write to, but save_dir is \"\" (no "
                              "checkpoints); set save_dir or drop save_every");
  }
  r.read("keep_last", &c.keep_last, 0);
  if (c.save_dir.empty() && c.keep_last > 0) {
    r.error("keep_last", "applies to checkpoints, but save_dir is \"\" (no checkpoints)");
  }
  r.read("save_async", &c.save_async);
  if (c.save_async && c.save_dir.empty()) {
    r.error("save_async", "applies to checkpoints, but save_dir is \"\" (no checkpoints)");
  }
  if (c.save_async && !c.offload_optimizer_auto && c.offload_optimizer == Tier::kDevice) {
    r.error("save_async",
            "sets a saved step's optimizer state aside in the optimizer's tier while training "
            "goes on, and offload_optimizer is \"none\"; set offload_optimizer to \"cpu\" or "
            "\"nvme\"");
  }
  if (c.save_async && c.offload_optimizer_fraction < 1.0) {
    r.error("save_async",
            "sets a saved step's optimizer state aside in the optimizer's tier, and "
            "offload_optimizer_fraction below 1 keeps part of it on the device; set "
            "offload_optimizer_fraction to 1 (or \"auto\"), or save_async false");
  }
  r.read("metrics_file", &c.metrics_file);
  r.read("trace_file", &c.trace_file);
  r.read("log_every", &c.log_every, 1);
  r.reject_unknown();

  if (c.micro_batch_size == 0 && c.gradient_accumulation_steps == 0) {
    c.micro_batch_size = c.batch_size;
  }
  if (c.gradient_accumulation_steps == 0 && c.micro_batch_size > 0 &&
      c.batch_size % c.micro_batch_size != 0) {
    errors.push_back("'micro_batch_size': " + std::to_string(c.micro_batch_size) +
                     " must divide batch_size " + std::to_string(c.batch_size) +
                     " (gradient accumulation steps = batch_size / micro_batch_size)");
  }
  // A frozen base (LoRA's) goes where offload_param says whatever the optimizer's tier; with
  // every parameter trained, the optimizer on the device would keep them all there.
  if (c.offload_param != Tier::kDevice && c.offload_optimizer == Tier::kDevice &&
      !c.offload_optimizer_auto && !c.lora()) {
    errors.push_back("'offload_param': \"" + std::string(zero::offload_name(c.offload_param)) +
                     "\" needs offload_optimizer \"cpu\" or \"nvme\" as well (every parameter "
                     "trains; offload_param alone places a frozen base, with finetune.method "
                     "\"lora\" or \"qlora\")");
  }
  if (c.activation_offload != Tier::kDevice && !c.activation_checkpointing) {
    errors.push_back("'activation_offload': \"" +
                     std::string(zero::offload_name(c.activation_offload)) +
                     "\" moves checkpointed activations; it needs activation_checkpointing true");
  }
  // "~" in a path is the home directory, as a shell would have it (the model's: above).
  const auto expand = [&](const std::string& key, std::string* path) {
    auto expanded = expand_path(*path);
    if (expanded.is_ok()) {
      *path = *expanded;
    } else {
      errors.push_back("'" + key + "': " + expanded.status().message());
    }
  };
  expand("data.path", &c.data.path);
  if (c.eval_data) expand("eval_data.path", &c.eval_data->path);
  for (std::size_t i = 0; i < c.swap_paths.size(); ++i) {
    expand("swap_paths[" + std::to_string(i) + "]", &c.swap_paths[i]);
  }
  expand("save_dir", &c.save_dir);
  expand("metrics_file", &c.metrics_file);
  expand("trace_file", &c.trace_file);
  expand("finetune.adapter", &c.finetune.adapter);
  expand("finetune.quantized_cache", &c.finetune.quantized_cache);
  if (c.uses_nvme() && c.swap_paths.empty()) {
    errors.push_back("'swap_paths': offload to nvme needs at least one swap directory");
  }
  if (c.device == device::DeviceKind::kCuda && c.device_memory_limit == 0) {
    // The CUDA backend sizes its arena from this; refuse to guess.
    errors.push_back("'device_memory_limit': required with device \"cuda\" (e.g. \"20GiB\")");
  }
  for (std::string& p : c.grid_problems(has_model)) errors.push_back(std::move(p));
  if (c.zero_stage != 3 && c.offload_param != Tier::kDevice) {
    errors.push_back("'offload_param': parameter offload needs zero_stage 3");
  }
  if (!errors.empty()) {
    std::string msg = "invalid config " + source +
                      (c.deepspeed_source.empty() ? "" : " with " + c.deepspeed_source) + ":";
    for (const auto& e : errors) {
      // A key that came from the command line is blamed on it, not on the file.
      std::string line = e;
      if (line.size() > 2 && line[0] == '\'') {
        const auto end = line.find('\'', 1);
        const std::string key = line.substr(1, end - 1);
        if (const std::string from = origins.of(key, source);
            end != std::string::npos && from != source) {
          line.insert(end + 1, " (from " + from + ")");
        }
      }
      msg += "\n  " + line;
    }
    return invalid_argument(msg);
  }
  return c;
}

Result<TrainConfig> load_train_config(const std::string& path,
                                      const std::vector<std::string>& overrides, const Json& keys) {
  STRATA_ASSIGN_OR_RETURN(Json json, read_json_file(path));
  return train_config_from_json(std::move(json), path, overrides, keys);
}

Result<TrainConfig> train_config_from_json(Json json, const std::string& path,
                                           const std::vector<std::string>& overrides,
                                           const Json& keys) {
  ConfigOrigins origins;
  for (const auto& o : overrides) {
    STRATA_RETURN_IF_ERROR(apply_override(json, o));
    origins.set_keys.push_back(o.substr(0, o.find('=')));
  }
  for (const auto& [key, value] : keys.items()) origins.flag_keys.push_back(key);
  // Two DeepSpeed files, the config's and the flag's, would be joined one over the other.
  if (json.is_object() && keys.contains("deepspeed") && json.contains("deepspeed") &&
      !json["deepspeed"].is_null() && json["deepspeed"] != keys["deepspeed"]) {
    return invalid_argument("invalid config " + path + ": its 'deepspeed' is " +
                            json["deepspeed"].dump() + " and --deepspeed gives " +
                            keys["deepspeed"].dump() + "; keep one");
  }
  if (json.is_object()) {
    for (const auto& [key, value] : keys.items()) {
      if (value.is_string() && !is_utf8(value.get<std::string>())) {  // a file name, say
        return invalid_argument("the value given for '" + key +
                                "' is not UTF-8; a config holds UTF-8 text only");
      }
      json[key] = value;
    }
  }
  return parse_train_config(json, path, origins);
}

Status TrainConfig::resolve_batch(int ranks) {
  if (ranks < 1) return invalid_argument("ranks " + std::to_string(ranks) + ": expected >= 1");
  if (const std::int64_t g = gradient_accumulation_steps; g > 0) {  // DeepSpeed's rule
    const std::string with = " x gradient_accumulation_steps " + std::to_string(g) + " x " +
                             std::to_string(ranks) + " data-parallel rank" +
                             (ranks == 1 ? "" : "s");
    if (batch_size == 0) {
      batch_size = micro_batch_size * g * ranks;
    } else if (micro_batch_size == 0) {
      if (batch_size % (g * ranks) != 0) {
        return invalid_argument("batch_size " + std::to_string(batch_size) +
                                " does not split into micro-batches of" + with.substr(3) +
                                ": make it a multiple of " + std::to_string(g * ranks));
      }
      micro_batch_size = batch_size / (g * ranks);
    } else if (batch_size != micro_batch_size * g * ranks) {
      return invalid_argument(
          "batch_size " + std::to_string(batch_size) + " must be micro_batch_size " +
          std::to_string(micro_batch_size) + with + " = " +
          std::to_string(micro_batch_size * g * ranks) +
          " (DeepSpeed's train_batch_size rule); leave one of the three out to have it derived");
    }
    return Status::ok();
  }
  if (batch_size % (micro_batch_size * ranks) == 0) return Status::ok();
  // The largest micro-batch that fits this rank count, to suggest.
  std::int64_t fit = 0;
  for (std::int64_t m = micro_batch_size; m >= 1 && fit == 0; --m) {
    if (batch_size % (m * ranks) == 0) fit = m;
  }
  return invalid_argument(
      "batch_size " + std::to_string(batch_size) + " must be a multiple of micro_batch_size " +
      std::to_string(micro_batch_size) + " x " + std::to_string(ranks) + " ranks" +
      (fit > 0 ? "; with " + std::to_string(ranks) +
                     " ranks use --set micro_batch_size=" + std::to_string(fit)
               : "; no micro_batch_size fits " + std::to_string(ranks) +
                     " ranks: make batch_size a multiple of the rank count"));
}

device::DeviceOptions TrainConfig::device_options() const {
  device::DeviceOptions o;
  o.kind = device;
  o.memory_limit_bytes = device_memory_limit;
  o.device_index = device_index;
  o.allow_tf32 = allow_tf32;
  o.attention = attention;
  o.compute_threads = threads;
  return o;
}

optim::LrSchedule TrainConfig::schedule() const {
  optim::LrSchedule s;
  s.type = lr_schedule.type;
  s.base_lr = optimizer.lr;
  s.warmup_steps = lr_schedule.warmup_steps;
  s.min_lr = lr_schedule.min_lr;
  s.total_steps = lr_schedule.total_steps > 0 ? lr_schedule.total_steps : max_steps;
  s.warmup_type = lr_schedule.warmup_type;
  s.warmup_min_lr = lr_schedule.warmup_min_lr;
  s.warmup_min_ratio = lr_schedule.warmup_min_ratio;
  s.cos_min_ratio = lr_schedule.cos_min_ratio;
  return s;
}

}  // namespace strata::train
