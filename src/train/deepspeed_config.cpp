// DeepSpeed's training config read into Strata's keys.
#include "strata/train/deepspeed_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <optional>

#include "strata/zero/bucket.h"

namespace strata::train {
namespace {

// A DeepSpeed value Strata takes as it is: absent, null and "auto" leave the key to the Strata
// config (nullptr).
const Json* given(JsonReader& r, const std::string& key) {
  const Json* v = r.raw(key);
  if (v == nullptr || v->is_null() || (v->is_string() && *v == "auto")) return nullptr;
  return v;
}

// DeepSpeed's files write counts as 5e8 as often as 500000000: a number with no fraction.
std::optional<std::int64_t> whole(JsonReader& r, const std::string& key, std::int64_t min) {
  const Json* v = given(r, key);
  if (v == nullptr) return std::nullopt;
  if (v->is_number()) {
    const double d = v->get<double>();
    if (d == std::floor(d) && d >= static_cast<double>(min) && d < 9.2e18) {
      return static_cast<std::int64_t>(d);
    }
  }
  r.error(key, "expected a whole number of at least " + std::to_string(min) + " or \"auto\", got " +
                   v->dump());
  return std::nullopt;
}

std::optional<double> number(JsonReader& r, const std::string& key, double min = 0.0) {
  const Json* v = given(r, key);
  if (v == nullptr) return std::nullopt;
  if (v->is_number() && v->get<double>() >= min) return v->get<double>();
  r.error(key,
          "expected a number of at least " + Json(min).dump() + " or \"auto\", got " + v->dump());
  return std::nullopt;
}

std::optional<bool> flag(JsonReader& r, const std::string& key) {
  const Json* v = given(r, key);
  if (v == nullptr) return std::nullopt;
  if (v->is_boolean()) return v->get<bool>();
  r.error(key, "expected true, false or \"auto\", got " + v->dump());
  return std::nullopt;
}

std::optional<std::string> text(JsonReader& r, const std::string& key) {
  const Json* v = given(r, key);
  if (v == nullptr) return std::nullopt;
  if (v->is_string()) return v->get<std::string>();
  r.error(key, "expected a string, got " + v->dump());
  return std::nullopt;
}

// An object of the file, or nullptr (with an error where it is something else).
const Json* block(JsonReader& r, const std::string& key) {
  const Json* v = r.raw(key);
  if (v == nullptr || v->is_null()) return nullptr;
  if (!v->is_object()) {
    r.error(key, "expected an object, got " + v->dump());
    return nullptr;
  }
  return v;
}

// Strata's keys whose values are byte counts ("64MiB" or a number).
bool is_bytes_key(const std::string& key) {
  return key == "reduce_bucket_bytes" || key == "allgather_bucket_bytes" ||
         key == "prefetch_bytes" || key == "max_live_bytes" || key == "max_reuse_distance" ||
         key == "swap_block_size";
}

// Whether two config values say the same (numbers by value, byte counts by bytes).
bool same(const std::string& key, const Json& a, const Json& b) {
  if (is_bytes_key(key)) {
    const auto x = parse_bytes(a), y = parse_bytes(b);
    return x.is_ok() && y.is_ok() && *x == *y;
  }
  if (a.is_number() && b.is_number()) return a.get<double>() == b.get<double>();
  if (a.is_array() && b.is_array()) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (!same(key, a[i], b[i])) return false;
    }
    return true;
  }
  return a == b;
}

// The value at dotted `key` of `config`, or nullptr.
const Json* at(const Json& config, const std::string& key) {
  const Json* node = &config;
  std::size_t start = 0;
  for (;;) {
    const auto dot = key.find('.', start);
    const std::string part = key.substr(start, dot == std::string::npos ? dot : dot - start);
    if (!node->is_object() || !node->contains(part)) return nullptr;
    node = &(*node)[part];
    if (dot == std::string::npos) return node->is_null() ? nullptr : node;
    start = dot + 1;
  }
}

void put(Json* config, const std::string& key, Json value) {
  Json* node = config;
  std::size_t start = 0;
  for (;;) {
    const auto dot = key.find('.', start);
    const std::string part = key.substr(start, dot == std::string::npos ? dot : dot - start);
    if (dot == std::string::npos) {
      (*node)[part] = std::move(value);
      return;
    }
    if (!node->contains(part) || !(*node)[part].is_object()) (*node)[part] = Json::object();
    node = &(*node)[part];
    start = dot + 1;
  }
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

class Joiner {
 public:
  Joiner(const Json& config, const KeyOrigin& origin, std::string ds_source,
         std::vector<std::string>* errors)
      : config_(config), origin_(origin), ds_source_(std::move(ds_source)), errors_(errors) {}

  // DeepSpeed's `ds_key` sets Strata's `key` to `value`: refused where the Strata config sets
  // it otherwise.
  void set(const std::string& ds_key, const std::string& key, Json value) {
    settings_.push_back({ds_key, key, std::move(value), false});
  }
  // DeepSpeed's default for a key its file leaves out: applies where the Strata config does
  // not set `key` either.
  void fallback(const std::string& ds_key, const std::string& key, Json value) {
    settings_.push_back({ds_key, key, std::move(value), true});
  }
  void decided(const std::string& ds_key) { decided_.push_back(ds_key); }
  bool sets(const std::string& key) const {
    return std::any_of(settings_.begin(), settings_.end(),
                       [&](const Setting& s) { return s.key == key && !s.fallback; });
  }
  const Json& config() const { return config_; }

  DeepSpeedJoin finish(std::vector<std::string> ds_errors) {
    DeepSpeedJoin out{config_, std::move(decided_), {}};
    for (std::string& e : ds_errors) errors_->push_back(ds_source_ + ": " + e);
    // Two keys of the file for one Strata key must agree.
    std::map<std::string, const Setting*> first;
    for (const Setting& s : settings_) {
      if (s.fallback) continue;
      const auto [it, fresh] = first.emplace(s.key, &s);
      if (!fresh && !same(s.key, it->second->value, s.value)) {
        errors_->push_back(ds_source_ + ": '" + it->second->ds_key + "' and '" + s.ds_key +
                           "' both set '" + s.key + "', to " + it->second->value.dump() + " and " +
                           s.value.dump() + "; keep one");
      }
      if (fresh) out.keys.push_back(s.key);
    }
    for (const Setting& s : settings_) {
      const Json* theirs = at(config_, s.key);
      if (theirs == nullptr) {
        put(&out.config, s.key, s.value);
      } else if (!s.fallback && !same(s.key, *theirs, s.value)) {
        errors_->push_back(ds_source_ + "'s '" + s.ds_key + "' makes '" + s.key + "' " +
                           s.value.dump() + ", but " + origin_(s.key) + " makes it " +
                           theirs->dump() + "; set it in one place");
      }
    }
    return out;
  }

 private:
  struct Setting {
    std::string ds_key, key;
    Json value;
    bool fallback;
  };
  const Json& config_;
  const KeyOrigin& origin_;
  std::string ds_source_;
  std::vector<std::string>* errors_;
  std::vector<Setting> settings_;
  std::vector<std::string> decided_;
};

// Keys that only tune what Strata decides itself: each accepted, named in the log.
void accept_decided(JsonReader& r, Joiner& j, const std::string& prefix,
                    std::initializer_list<const char*> keys) {
  for (const char* k : keys) {
    if (r.raw(k) != nullptr) j.decided(prefix + k);
  }
}

// Keys that would change the mathematics in a way Strata does not: refused where on.
void refuse_when_on(JsonReader& r,
                    std::initializer_list<std::pair<const char*, const char*>> keys) {
  for (const auto& [k, why] : keys) {
    const Json* v = r.raw(k);
    if (v == nullptr || v->is_null() || *v == false || *v == "auto") continue;
    if (v->is_object() && v->contains("enabled") && (*v)["enabled"] != true) continue;
    r.error(k, why);
  }
}

// "bf16"/"fp16"/"fp32": the compute dtype the run will have, DeepSpeed's file first.
struct Precision {
  std::string name = "fp32";
  std::int64_t bytes() const { return name == "fp32" ? 4 : 2; }
};

}  // namespace

DeepSpeedJoin join_deepspeed_config(const Json& config, const KeyOrigin& origin, const Json& ds,
                                    const std::string& ds_source,
                                    std::vector<std::string>* errors) {
  Joiner j(config, origin, ds_source, errors);
  std::vector<std::string> ds_errors;
  if (!ds.is_object()) {
    errors->push_back(ds_source + ": a DeepSpeed config is a JSON object, got " + ds.type_name());
    return {config, {}, {}};
  }
  JsonReader r(ds, "", &ds_errors);

  // The batch, by DeepSpeed's rule (TrainConfig::resolve_batch applies it over the ranks).
  const auto train = whole(r, "train_batch_size", 1);
  const auto micro = whole(r, "train_micro_batch_size_per_gpu", 1);
  if (train) j.set("train_batch_size", "batch_size", *train);
  if (micro) j.set("train_micro_batch_size_per_gpu", "micro_batch_size", *micro);
  if (auto v = whole(r, "gradient_accumulation_steps", 1)) {
    j.set("gradient_accumulation_steps", "gradient_accumulation_steps", *v);
  } else if (r.raw("gradient_accumulation_steps") == nullptr &&
             train.has_value() != micro.has_value() &&
             at(config, train ? "micro_batch_size" : "batch_size") == nullptr) {
    // One of the two alone: DeepSpeed accumulates once (the micro-batch is the batch over the
    // ranks, or the batch the micro-batches of the ranks).
    j.fallback("gradient_accumulation_steps", "gradient_accumulation_steps", 1);
  }
  if (auto v = number(r, "gradient_clipping")) {
    j.set("gradient_clipping", "grad_clip", *v);
  } else if (r.raw("gradient_clipping") == nullptr) {
    j.fallback("gradient_clipping", "grad_clip", 0.0);  // DeepSpeed clips only when asked
  }

  // Precision: bf16 (or bfloat16), fp16, torch_autocast.
  Precision precision;
  if (const Json* p = at(config, "precision"); p != nullptr && p->is_string()) {
    precision.name = p->get<std::string>();
  }
  {
    std::optional<bool> bf16_on, fp16_on;
    bool any_auto = false;  // an "enabled": "auto": the Strata config's precision stands
    const auto enabled = [&](JsonReader& er) {
      if (const Json* e = er.raw("enabled"); e != nullptr && *e == "auto") any_auto = true;
      return flag(er, "enabled");
    };
    std::vector<std::pair<std::string, Json>> scaler;  // fp16's loss-scaling keys
    std::string bf16_key = r.has("bfloat16") ? "bfloat16" : "bf16";
    if (r.has("bf16") && r.has("bfloat16")) r.error("bfloat16", "is bf16's other name; keep one");
    if (const Json* b = block(r, bf16_key)) {
      JsonReader br(*b, bf16_key, &ds_errors);
      bf16_on = enabled(br);
      accept_decided(br, j, bf16_key + ".", {"immediate_grad_update", "check_grad_overflow"});
      refuse_when_on(br, {{"bf16_master_weights_and_grads",
                           "keeps bf16 master weights and gradients with round-to-nearest; "
                           "Strata's bf16 masters (optimizer.master_dtype \"bf16\") round "
                           "stochastically and keep fp32 gradient sums"}});
      if (auto s = flag(br, "bf16_optimizer_states"); s && *s) {
        j.set(bf16_key + ".bf16_optimizer_states", "optimizer.state_dtype", "bf16");
      }
      br.reject_unknown();
    }
    if (const Json* f = block(r, "fp16")) {
      JsonReader fr(*f, "fp16", &ds_errors);
      fp16_on = enabled(fr);
      accept_decided(fr, j, "fp16.", {"auto_cast"});
      refuse_when_on(fr, {{"fp16_master_weights_and_grads",
                           "keeps fp16 master weights and gradients; Strata keeps fp32 masters "
                           "(or bf16: optimizer.master_dtype)"}});
      for (const char* k : {"loss_scale", "min_loss_scale"}) {
        if (auto v = number(fr, k)) scaler.emplace_back(k, *v);
      }
      for (const char* k : {"initial_scale_power", "loss_scale_window", "hysteresis"}) {
        if (auto v = whole(fr, k, 0)) scaler.emplace_back(k, *v);
      }
      if (auto v = flag(fr, "consecutive_hysteresis")) {
        scaler.emplace_back("consecutive_hysteresis", *v);
      }
      fr.reject_unknown();
    }
    if (const Json* a = block(r, "torch_autocast")) {
      JsonReader ar(*a, "torch_autocast", &ds_errors);
      if (auto on = flag(ar, "enabled"); on && *on) {
        const std::string dtype = text(ar, "dtype").value_or("torch.bfloat16");
        if (dtype == "torch.bfloat16" || dtype == "bfloat16") {
          bf16_on = true;
        } else if (dtype == "torch.float16" || dtype == "float16") {
          fp16_on = true;
        } else {
          ar.error("dtype", "expected torch.bfloat16 or torch.float16, got \"" + dtype + "\"");
        }
      } else {
        text(ar, "dtype");
      }
      accept_decided(ar, j, "torch_autocast.", {"lower_precision_safe_modules"});
      ar.reject_unknown();
    }
    if (bf16_on.value_or(false) && fp16_on.value_or(false)) {
      r.error("fp16", "and bf16 are both enabled; a run computes in one of them");
    } else if (bf16_on.value_or(false)) {
      j.set(bf16_key + ".enabled", "precision", "bf16");
      precision.name = "bf16";
    } else if (fp16_on.value_or(false)) {
      j.set("fp16.enabled", "precision", "fp16");
      precision.name = "fp16";
    } else if ((bf16_on || fp16_on) && !any_auto) {  // set false: fp32, as DeepSpeed runs it
      j.set(bf16_on ? bf16_key + ".enabled" : "fp16.enabled", "precision", "fp32");
      precision.name = "fp32";
    }
    // The loss scaler's keys are Strata's own fp16 block's, which applies in fp16 (whichever
    // file says so); in another precision DeepSpeed ignores them too.
    for (const auto& [k, v] : scaler) {
      if (precision.name == "fp16") {
        j.set("fp16." + k, "fp16." + k, v);
      } else {
        j.decided("fp16." + k + " (fp16 is off)");
      }
    }
  }
  const std::int64_t elem = precision.bytes();

  // The optimizer: Adam or AdamW; DeepSpeed's Adam is AdamW unless adam_w_mode is false.
  std::optional<double> optimizer_lr;
  if (const Json* o = block(r, "optimizer")) {
    JsonReader orr(*o, "optimizer", &ds_errors);
    const std::string type = text(orr, "type").value_or("");
    const std::string t = lower(type);
    if (t != "adam" && t != "adamw") {
      orr.error("type", (type.empty() ? std::string("is required")
                                      : "\"" + type + "\" is not an optimizer Strata runs") +
                            "; expected \"Adam\" or \"AdamW\" (Strata's AdamW, with 8-bit or "
                            "bf16 moments by optimizer.state_dtype)");
    }
    accept_decided(orr, j, "optimizer.", {"legacy_fusion"});
    bool adamw_mode = true;  // DeepSpeed's Adam and AdamW alike, unless adam_w_mode says
    std::string mode_key = "optimizer.type";
    if (const Json* p = block(orr, "params")) {
      JsonReader pr(*p, "optimizer.params", &ds_errors);
      optimizer_lr = number(pr, "lr");  // set below, unless the scheduler's supersedes it
      if (const Json* b = given(pr, "betas")) {
        if (b->is_array() && b->size() == 2 && (*b)[0].is_number() && (*b)[1].is_number()) {
          j.set("optimizer.params.betas", "optimizer.betas", *b);
        } else {
          pr.error("betas", "expected two numbers, e.g. [0.9, 0.999]");
        }
      }
      if (auto v = number(pr, "eps")) j.set("optimizer.params.eps", "optimizer.eps", *v);
      if (auto v = number(pr, "weight_decay")) {
        j.set("optimizer.params.weight_decay", "optimizer.weight_decay", *v);
      }
      // DeepSpeed: the name AdamW forces decoupled decay; Adam's adam_w_mode defaults to true.
      const std::optional<bool> w_mode = flag(pr, "adam_w_mode");
      adamw_mode = t == "adamw" || w_mode.value_or(true);
      if (t == "adam" && w_mode) mode_key = "optimizer.params.adam_w_mode";
      if (t == "adamw" && w_mode && !*w_mode) {
        j.decided(
            "optimizer.params.adam_w_mode (DeepSpeed's AdamW decays decoupled whatever it "
            "says)");
      }
      if (auto v = flag(pr, "bias_correction"); v && !*v) {
        pr.error("bias_correction", "false: Strata's Adam always corrects the moments' bias");
      }
      if (auto v = flag(pr, "amsgrad"); v && *v) {
        pr.error("amsgrad", "true: Strata's Adam has no AMSGrad variant");
      }
      if (auto v = flag(pr, "fp32_optimizer_states"); v && !*v) {
        if (precision.name == "bf16") {
          j.set("optimizer.params.fp32_optimizer_states", "optimizer.state_dtype", "bf16");
        } else {
          pr.error("fp32_optimizer_states",
                   "false keeps the moments in the parameters' dtype; Strata's compact moments "
                   "are bf16 or int8 (optimizer.state_dtype), and this run computes in " +
                       precision.name);
        }
      }
      accept_decided(pr, j, "optimizer.params.", {"torch_adam"});
      pr.reject_unknown();
    }
    if (t == "adam" || t == "adamw") {
      j.set(mode_key, "optimizer.adamw_mode", adamw_mode);
    }
    orr.reject_unknown();
  }

  // The scheduler: WarmupLR, WarmupDecayLR, WarmupCosineLR, as DeepSpeed computes them. None: the
  // lr stays (Strata's lr_schedule, whose default is constant, as DeepSpeed's).
  if (const Json* s = block(r, "scheduler")) {
    JsonReader sr(*s, "scheduler", &ds_errors);
    const std::string type = text(sr, "type").value_or("");
    const char* kind = type == "WarmupLR"         ? "warmup"
                       : type == "WarmupDecayLR"  ? "warmup_decay"
                       : type == "WarmupCosineLR" ? "warmup_cosine"
                                                  : nullptr;
    if (kind == nullptr) {
      sr.error("type", (type.empty() ? std::string("is required")
                                     : "\"" + type + "\" is not a schedule Strata runs") +
                           "; expected WarmupLR, WarmupDecayLR or WarmupCosineLR (OneCycle and "
                           "LRRangeTest are not done)");
    } else {
      j.set("scheduler.type", "lr_schedule.type", kind);
    }
    const Json empty = Json::object();
    const Json* p = block(sr, "params");
    JsonReader pr(p != nullptr ? *p : empty, "scheduler.params", &ds_errors);
    const std::string k = kind != nullptr ? kind : "";
    const auto param = [&](const char* ds_key, const char* key, Json value) {
      j.set(std::string("scheduler.params.") + ds_key, key, std::move(value));
    };
    const auto deepspeed_default = [&](const char* ds_key, const char* key, Json value) {
      if (pr.raw(ds_key) == nullptr) {
        j.fallback(std::string("scheduler.params.") + ds_key, key, std::move(value));
      }
    };
    if (const Json* l = pr.raw("last_batch_iteration"); l != nullptr && *l != -1) {
      pr.error("last_batch_iteration",
               "starts DeepSpeed's schedule part-way; a resumed Strata "
               "run continues its schedule from the checkpoint's step");
    }
    if (auto v = whole(pr, "warmup_num_steps", 1)) {
      param("warmup_num_steps", "lr_schedule.warmup_steps", *v);
    }
    deepspeed_default("warmup_num_steps", "lr_schedule.warmup_steps", 1000);
    if (auto v = text(pr, "warmup_type")) {
      if (*v == "log" || *v == "linear") {
        param("warmup_type", "lr_schedule.warmup_type", *v);
      } else {
        pr.error("warmup_type", "expected \"log\" or \"linear\", got \"" + *v + "\"");
      }
    }
    if (k == "warmup" || k == "warmup_decay") {
      if (auto v = number(pr, "warmup_min_lr"))
        param("warmup_min_lr", "lr_schedule.warmup_min_lr", *v);
      // The schedule's top is the optimizer's lr; WarmupDecayLR's default top is 0.001
      // whatever the optimizer's lr, WarmupLR's the optimizer's.
      if (auto v = number(pr, "warmup_max_lr")) {
        param("warmup_max_lr", "optimizer.lr", *v);
      } else if (k == "warmup_decay" && pr.raw("warmup_max_lr") == nullptr) {
        param("warmup_max_lr (WarmupDecayLR's default)", "optimizer.lr", 0.001);
      }
    }
    if (k == "warmup_cosine") {
      if (auto v = number(pr, "warmup_min_ratio")) {
        param("warmup_min_ratio", "lr_schedule.warmup_min_ratio", *v);
      }
      if (auto v = number(pr, "cos_min_ratio"))
        param("cos_min_ratio", "lr_schedule.cos_min_ratio", *v);
    }
    if (k == "warmup_decay" || k == "warmup_cosine") {
      if (auto v = whole(pr, "total_num_steps", 1))
        param("total_num_steps", "lr_schedule.total_steps", *v);
    }
    pr.reject_unknown();
    sr.reject_unknown();
  }

  // WarmupLR's and WarmupDecayLR's warmup_max_lr is the lr DeepSpeed runs at, whatever the
  // optimizer's params say.
  if (optimizer_lr) {
    if (j.sets("optimizer.lr")) {
      j.decided(
          "optimizer.params.lr (the scheduler's warmup_max_lr supersedes it, as in "
          "DeepSpeed)");
    } else {
      j.set("optimizer.params.lr", "optimizer.lr", *optimizer_lr);
    }
  }

  // ZeRO: the stage, the offloads, the sizes (elements of the compute dtype, as bytes).
  std::vector<std::string> nvme_paths;
  if (const Json* z = block(r, "zero_optimization")) {
    JsonReader zr(*z, "zero_optimization", &ds_errors);
    if (auto v = whole(zr, "stage", 0)) {
      if (*v > 3) {
        zr.error("stage", "expected 0, 1, 2 or 3, got " + std::to_string(*v));
      } else if (*v == 0) {
        // No sharding at all; Strata shards the optimizer states at least, which changes the
        // memory and not the results.
        j.set("zero_optimization.stage", "zero_stage", 1);
        j.decided("zero_optimization.stage 0 (run as stage 1)");
      } else {
        j.set("zero_optimization.stage", "zero_stage", *v);
      }
    }
    for (const auto& [ds_key, key] : {std::pair{"offload_param", "offload_param"},
                                      std::pair{"offload_optimizer", "offload_optimizer"}}) {
      const Json* o = block(zr, ds_key);
      if (o == nullptr) continue;
      const std::string prefix = std::string("zero_optimization.") + ds_key;
      JsonReader orr(*o, prefix, &ds_errors);
      const std::optional<std::string> given_device = text(orr, "device");
      const std::string device = given_device.value_or("none");
      if (device != "none" && device != "cpu" && device != "nvme") {
        orr.error("device", "expected \"none\", \"cpu\" or \"nvme\", got \"" + device + "\"");
      } else if (given_device) {
        j.set(prefix + ".device", key, device);
      }
      if (auto p = text(orr, "nvme_path")) {
        if (device == "nvme" &&
            std::find(nvme_paths.begin(), nvme_paths.end(), *p) == nvme_paths.end()) {
          nvme_paths.push_back(*p);
        }
      }
      // The share of the optimizer state CPU Adam steps (ZeRO-3's partial offload): Strata's
      // offload_optimizer_fraction.
      if (std::string(ds_key) == "offload_optimizer") {
        if (auto r = number(orr, "ratio")) {
          if (*r < 0 || *r > 1) {
            orr.error("ratio", "expected a share from 0 to 1, got " + Json(*r).dump());
          } else {
            j.set(prefix + ".ratio", "offload_optimizer_fraction", *r);
          }
        }
      }
      accept_decided(orr, j, prefix + ".",
                     {"pin_memory", "buffer_count", "buffer_size", "max_in_cpu", "pipeline_read",
                      "pipeline_write", "fast_init", "super_offload", "cpuadam_cores_perc"});
      if (std::string(ds_key) == "offload_param") accept_decided(orr, j, prefix + ".", {"ratio"});
      orr.reject_unknown();
    }
    // DeepSpeed's older spellings of the offloads.
    if (auto v = flag(zr, "cpu_offload"); v && *v) {
      j.set("zero_optimization.cpu_offload", "offload_optimizer", "cpu");
    }
    if (auto v = flag(zr, "cpu_offload_param"); v && *v) {
      j.set("zero_optimization.cpu_offload_param", "offload_param", "cpu");
    }
    if (auto v = whole(zr, "sub_group_size", 1024)) {
      j.set("zero_optimization.sub_group_size", "sub_group_size", *v);
    }
    // Sizes in elements become bytes of the compute dtype; a bucket is at most 1 GiB in Strata
    // (MPI counts its elements in an int), so a larger one (DeepSpeed's default 5e8 elements in
    // fp32) is capped there.
    const auto elements = [&](const char* ds_key, const char* alias, const char* key, bool bucket) {
      const char* name = zr.has(alias) ? alias : ds_key;
      if (std::string(alias) != ds_key && zr.has(alias) && zr.has(ds_key))
        zr.error(alias, std::string("is ") + ds_key + "'s other name; keep one");
      auto v = whole(zr, name, bucket ? 1 : 0);
      if (!v) return;
      std::uint64_t bytes = static_cast<std::uint64_t>(*v) * static_cast<std::uint64_t>(elem);
      if (bucket && bytes > zero::kMaxBucketBytes) {
        bytes = zero::kMaxBucketBytes;
        j.decided(std::string("zero_optimization.") + name + " (capped at 1 GiB)");
      }
      j.set(std::string("zero_optimization.") + name, key, bytes);
    };
    elements("reduce_bucket_size", "reduce_bucket_size", "reduce_bucket_bytes", true);
    elements("allgather_bucket_size", "allgather_bucket_size", "allgather_bucket_bytes", true);
    elements("stage3_prefetch_bucket_size", "prefetch_bucket_size", "prefetch_bytes", false);
    elements("stage3_max_live_parameters", "max_live_parameters", "max_live_bytes", false);
    elements("stage3_max_reuse_distance", "max_reuse_distance", "max_reuse_distance", false);
    {
      const char* name = zr.has("param_persistence_threshold")
                             ? "param_persistence_threshold"
                             : "stage3_param_persistence_threshold";
      if (zr.has("param_persistence_threshold") && zr.has("stage3_param_persistence_threshold")) {
        zr.error("param_persistence_threshold",
                 "is stage3_param_persistence_threshold's other name; keep one");
      }
      if (auto v = whole(zr, name, 0)) {
        j.set(std::string("zero_optimization.") + name, "param_persistence_threshold", *v);
      }
    }
    refuse_when_on(
        zr, {{"zero_quantized_weights",
              "quantizes the all-gathered weights (ZeRO++): Strata gathers them exactly"},
             {"zero_quantized_nontrainable_weights",
              "quantizes frozen weights (ZeRO++); for a quantized frozen base use finetune.method "
              "\"qlora\""},
             {"zero_quantized_gradients",
              "quantizes the reduced gradients (ZeRO++): Strata reduces them exactly"},
             {"zenflow", "ZenFlow updates part of the gradients late; Strata's steps are exact"},
             {"zeropp_loco_param", "LoCo's error feedback belongs to quantized gradients"}});
    accept_decided(zr, j, "zero_optimization.",
                   {"contiguous_gradients",
                    "reduce_scatter",
                    "overlap_comm",
                    "allgather_partitions",
                    "use_multi_rank_bucket_allreduce",
                    "load_from_fp32_weights",
                    "elastic_checkpoint",
                    "cpu_offload_use_pin_memory",
                    "stage3_model_persistence_threshold",
                    "model_persistence_threshold",
                    "stage3_gather_16bit_weights_on_model_save",
                    "gather_16bit_weights_on_model_save",
                    "stage3_gather_fp16_weights_on_model_save",
                    "stage3_module_granularity_threshold",
                    "module_granularity_threshold",
                    "stage3_use_all_reduce_for_fetch_params",
                    "use_all_reduce_for_fetch_params",
                    "stage3_allgather_sequential",
                    "allgather_sequential",
                    "ignore_unused_parameters",
                    "legacy_stage1",
                    "round_robin_gradients",
                    "zero_hpz_partition_size",
                    "mics_shard_size",
                    "mics_hierarchical_params_gather",
                    "memory_efficient_linear",
                    "pipeline_loading_checkpoint",
                    "override_module_apply",
                    "log_trace_cache_warnings",
                    "enable_sanity_checks",
                    "save_muon_momentum_buffer_in_memory",
                    "leaf_module"});
    zr.reject_unknown();
  }
  // DeepSpeed's nvme_path is a node's: each rank keeps its files in a folder of its own there
  // (strata-{rank}, made at the start where the nvme_path exists).
  for (std::string& p : nvme_paths) {
    while (p.size() > 1 && p.back() == '/') p.pop_back();
    p += "/strata-{rank}";
  }
  if (!nvme_paths.empty()) {
    j.set("zero_optimization.offload_*.nvme_path", "swap_paths", nvme_paths);
  }

  // DeepNVMe's settings: the swap engine's.
  if (const Json* a = block(r, "aio")) {
    JsonReader ar(*a, "aio", &ds_errors);
    if (auto v = whole(ar, "block_size", 4096)) j.set("aio.block_size", "swap_block_size", *v);
    if (auto v = whole(ar, "queue_depth", 1)) j.set("aio.queue_depth", "swap_queue_depth", *v);
    if (ar.has("intra_op_parallelism") && ar.has("thread_count")) {
      ar.error("thread_count", "is intra_op_parallelism's other name; keep one");
    }
    for (const char* k : {"intra_op_parallelism", "thread_count"}) {
      if (auto v = whole(ar, k, 1)) j.set(std::string("aio.") + k, "swap_threads", *v);
    }
    accept_decided(ar, j, "aio.", {"single_submit", "overlap_events", "use_gds"});
    ar.reject_unknown();
  }

  // DeepSpeed's activation checkpointing: cpu_checkpointing keeps the checkpoints in host
  // memory, as Strata's activation_offload "cpu".
  if (const Json* a = block(r, "activation_checkpointing")) {
    JsonReader ar(*a, "activation_checkpointing", &ds_errors);
    if (auto v = flag(ar, "cpu_checkpointing"); v && *v) {
      j.set("activation_checkpointing.cpu_checkpointing", "activation_checkpointing", true);
      j.set("activation_checkpointing.cpu_checkpointing", "activation_offload", "cpu");
    }
    accept_decided(ar, j, "activation_checkpointing.",
                   {"partition_activations", "contiguous_memory_optimization", "number_checkpoints",
                    "synchronize_checkpoint_boundary", "profile"});
    ar.reject_unknown();
  }

  if (auto op = text(r, "gradient_allreduce_op"); op && *op != "mean") {
    r.error("gradient_allreduce_op", "\"" + *op +
                                         "\": Strata averages the gradients over the ranks "
                                         "(DeepSpeed's \"mean\")");
  } else if (op) {
    j.decided("gradient_allreduce_op");
  }
  refuse_when_on(r, {{"amp", "NVIDIA Apex's AMP: use bf16 or fp16"},
                     {"sparse_attention", "Strata's attention is dense (flash or simple)"},
                     {"compression_training", "compresses the model while training; not done"},
                     {"progressive_layer_drop", "skips layers at random; not done"},
                     {"curriculum_learning", "changes the data's order and length; not done"},
                     {"data_efficiency", "samples the data by difficulty; not done"},
                     {"eigenvalue", "not done"},
                     {"quantize_training", "quantizes the weights while training; not done"},
                     {"elasticity",
                      "changes the batch with the GPUs; Strata keeps the batch and restarts "
                      "on the ranks there are (strata launch)"},
                     {"autotuning",
                      "Strata chooses its grid and placement itself: parallelism, "
                      "offload_param and offload_optimizer \"auto\""},
                     {"pipeline",
                      "DeepSpeed's pipeline engine: Strata's pipeline is "
                      "pipeline_parallel_size"}});
  accept_decided(r, j, "",
                 {"wall_clock_breakdown",
                  "memory_breakdown",
                  "dump_state",
                  "prescale_gradients",
                  "gradient_predivide_factor",
                  "communication_data_type",
                  "seq_parallel_communication_data_type",
                  "zero_allow_untested_optimizer",
                  "zero_force_ds_cpu_optimizer",
                  "tensorboard",
                  "wandb",
                  "csv_monitor",
                  "comet",
                  "comms_logger",
                  "flops_profiler",
                  "monitor_config",
                  "checkpoint",
                  "data_types",
                  "dataloader_drop_last",
                  "disable_allgather",
                  "sparse_gradients",
                  "timers",
                  "graph_harvesting",
                  "use_node_local_storage",
                  "nebula",
                  "compile",
                  "use_data_before_expert_parallelism",
                  "log_level",
                  "steps_per_print",
                  "hybrid_engine",
                  "zero_force_ds_cpu_initialization"});
  r.reject_unknown();
  return j.finish(std::move(ds_errors));
}

}  // namespace strata::train
