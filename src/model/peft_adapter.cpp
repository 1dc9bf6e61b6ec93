// PEFT adapter directories: names, config and weights.
#include "strata/model/peft_adapter.h"

#include <tbb/parallel_for.h>

#include <cstring>
#include <filesystem>
#include <set>

#include "strata/core/check.h"
#include "strata/core/json.h"

namespace strata::model {
namespace {

constexpr const char* kPrefix = "base_model.model.";

std::string join(const std::string& dir, const char* file) {
  return (std::filesystem::path(dir) / file).string();
}

}  // namespace

std::string peft_tensor_name(const std::string& hf_name) { return kPrefix + hf_name; }

namespace {

// PEFT's LoRA keys of an adapter_config.json object, every problem into `errors`.
LoraConfig read_lora_keys(const Json& j, std::vector<std::string>& errors) {
  auto fail = [&](const std::string& key, const std::string& what) {
    errors.push_back("'" + key + "': " + what);
  };
  LoraConfig c;
  if (j.contains("r") && j["r"].is_number_integer() && j["r"].get<std::int64_t>() > 0) {
    c.r = j["r"];
  } else {
    fail("r", "expected a positive integer");
  }
  if (j.contains("lora_alpha") && j["lora_alpha"].is_number() && j["lora_alpha"] > 0) {
    c.alpha = j["lora_alpha"];
  } else {
    fail("lora_alpha", "expected a positive number");
  }
  if (j.contains("lora_dropout") && j["lora_dropout"].is_number()) c.dropout = j["lora_dropout"];
  if (j.contains("use_rslora") && j["use_rslora"].is_boolean()) c.use_rslora = j["use_rslora"];
  const Json& t = j.contains("target_modules") ? j["target_modules"] : Json();
  if (t.is_string() && t == "all-linear") {
    c.targets = LoraConfig::all_linear();
  } else if (t.is_array() && !t.empty()) {
    c.targets.fill(false);
    for (const Json& n : t) {
      const auto target = n.is_string() ? parse_lora_target(n.get<std::string>()) : std::nullopt;
      if (!target) {
        fail("target_modules", n.dump() +
                                   " is not a projection Strata adapts (q_proj, k_proj, "
                                   "v_proj, o_proj, gate_proj, up_proj, down_proj, gate)");
      } else {
        c.targets[static_cast<std::size_t>(*target)] = true;
      }
    }
  } else {
    fail("target_modules", "expected a non-empty list of module names");
  }
  if (j.contains("modules_to_save") && !j["modules_to_save"].is_null()) {
    const Json& m = j["modules_to_save"];
    if (!m.is_array()) fail("modules_to_save", "expected a list of module names or null");
    for (const Json& n : m.is_array() ? m : Json::array()) {
      if (n.is_string() && !n.get<std::string>().empty()) {
        c.modules_to_save.push_back(n.get<std::string>());
      } else {
        fail("modules_to_save", n.dump() + " is not a module name");
      }
    }
  }
  for (const char* k : {"use_dora", "fan_in_fan_out"}) {
    if (j.contains(k) && j[k].is_boolean() && j[k].get<bool>()) fail(k, "true is not supported");
  }
  if (j.contains("bias") && j["bias"].is_string() && j["bias"] != "none") {
    fail("bias", "only \"none\" is supported, got " + j["bias"].dump());
  }
  for (const char* k : {"rank_pattern", "alpha_pattern"}) {
    if (j.contains(k) && j[k].is_object() && !j[k].empty())
      fail(k, "per-module ranks are not supported");
  }
  return c;
}

}  // namespace

Result<LoraConfig> lora_config_from_peft(const Json& j, const std::string& where) {
  if (!j.is_object()) return data_loss(where + " is not a JSON object");
  std::vector<std::string> errors;
  LoraConfig c = read_lora_keys(j, errors);
  if (errors.empty()) return c;
  std::string msg = where + " is not a LoRA adapter Strata can load:";
  for (const auto& e : errors) msg += "\n  " + e;
  return data_loss(msg);
}

Result<PeftAdapterReader> PeftAdapterReader::open(const std::string& dir) {
  PeftAdapterReader a;
  a.dir_ = dir;
  const std::string path = join(dir, kAdapterConfigFile);
  STRATA_ASSIGN_OR_RETURN(Json j, read_json_file(path));
  // Compared as JSON: a peft_type that is not a string is wrong, not an exception.
  if (j.is_object() && (!j.contains("peft_type") || j["peft_type"] != "LORA")) {
    return data_loss(path + ": 'peft_type' is " +
                     (j.contains("peft_type") ? j["peft_type"].dump() : std::string("missing")) +
                     ", expected \"LORA\"");
  }
  STRATA_ASSIGN_OR_RETURN(a.config_, lora_config_from_peft(j, path));
  STRATA_ASSIGN_OR_RETURN(a.weights_, SafetensorsReader::open(join(dir, kAdapterWeightsFile)));
  return a;
}

Status PeftAdapterReader::validate(const ParamLayout& layout) const {
  std::vector<std::string> problems;
  std::set<std::string> expected;
  for (const auto& g : layout.groups()) {
    if (g.frozen) continue;
    for (const auto& t : g.tensors) {
      const std::string name = peft_tensor_name(t.name);
      expected.insert(name);
      const SafetensorsEntry* e = weights_.find(name);
      if (e == nullptr) {
        problems.push_back("missing " + name);
      } else if (e->shape != t.full_shape()) {
        std::string got, want;
        for (auto d : e->shape) got += (got.empty() ? "" : ", ") + std::to_string(d);
        for (auto d : t.full_shape()) want += (want.empty() ? "" : ", ") + std::to_string(d);
        problems.push_back(name + " has shape [" + got + "], expected [" + want + "]");
      }
    }
  }
  for (const auto& e : weights_.entries()) {
    if (!expected.count(e.name)) problems.push_back("unexpected tensor " + e.name);
  }
  if (problems.empty()) return Status::ok();
  std::string msg = weights_.path() + " does not match the model's adapters:";
  for (std::size_t i = 0; i < problems.size() && i < 20; ++i) msg += "\n  " + problems[i];
  if (problems.size() > 20) msg += "\n  ... and " + std::to_string(problems.size() - 20) + " more";
  return data_loss(msg);
}

bool PeftAdapterReader::holds(const std::string& hf_name) const {
  return weights_.find(peft_tensor_name(hf_name)) != nullptr;
}

GroupSource PeftAdapterReader::over(GroupSource base) const {
  return split_source([this](const TensorSpec& t) { return holds(t.name); },
                      [this](const ParamGroup& g, float* dst) { return read_group(g, dst); },
                      std::move(base));
}

Status PeftAdapterReader::read_group(const ParamGroup& group, float* dst) const {
  std::fill(dst, dst + group.num_elems, 0.0f);
  for (const auto& t : group.tensors) {
    // A tensor-parallel slice reads its rows, or each row's columns, from the whole tensor.
    STRATA_RETURN_IF_ERROR(
        read_slice(weights_, peft_tensor_name(t.name), t, 0, t.num_elems, dst + t.offset_elems));
  }
  return Status::ok();
}

Status write_peft_adapter(const std::string& dir, const LoraConfig& lora, const ParamLayout& layout,
                          const std::string& base_model, const GroupSource& read_group,
                          ModelFamily family) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return io_error("cannot create adapter directory " + dir + ": " + ec.message());
  SafetensorsWriter writer;
  writer.set_metadata({{"format", "pt"}});
  struct Slot {
    const ParamGroup* group;
    const TensorSpec* tensor;
  };
  std::vector<Slot> slots;
  for (const auto& g : layout.groups()) {
    if (g.frozen) continue;
    for (const auto& t : g.tensors) {
      writer.add(peft_tensor_name(t.name), DType::kF32, t.shape);
      slots.push_back({&g, &t});
    }
  }
  std::vector<float> values;
  int cached = -1;
  std::size_t next = 0;
  STRATA_RETURN_IF_ERROR(
      writer.write(join(dir, kAdapterWeightsFile), [&](const SafetensorsEntry&, void* out) {
        const Slot& slot = slots[next++];
        if (slot.group->id != cached) {
          values.assign(static_cast<std::size_t>(slot.group->num_elems), 0.0f);
          cached = -1;
          STRATA_RETURN_IF_ERROR(read_group(*slot.group, values.data())
                                     .with_context("reading adapter group " + slot.group->name));
          cached = slot.group->id;
        }
        std::memcpy(out, values.data() + slot.tensor->offset_elems,
                    static_cast<std::size_t>(slot.tensor->num_elems) * sizeof(float));
        return Status::ok();
      }));
  const Json config = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", base_model.empty() ? Json() : Json(base_model)},
      {"r", lora.r},
      {"lora_alpha", lora.alpha},
      {"lora_dropout", lora.dropout},
      {"target_modules", lora.target_names(family)},
      {"use_rslora", lora.use_rslora},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"init_lora_weights", true},
      {"inference_mode", true},
      {"modules_to_save", lora.modules_to_save.empty() ? Json() : Json(lora.modules_to_save)},
      {"use_dora", false},
      {"rank_pattern", Json::object()},
      {"alpha_pattern", Json::object()},
      {"layers_to_transform", Json()},
      {"revision", Json()}};
  return write_json_file(join(dir, kAdapterConfigFile), config);
}

void merge_adapters(const LoraConfig& lora, const ParamGroup& block, float* base,
                    const ParamGroup& adapters, const float* values) {
  const double scaling = lora.scaling();
  const std::string suffix = ".lora_A.weight";
  for (const auto& a : adapters.tensors) {
    if (a.name.size() <= suffix.size() ||
        a.name.compare(a.name.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;
    }
    const std::string module = a.name.substr(0, a.name.size() - suffix.size());
    const TensorSpec* b = nullptr;
    const TensorSpec* w = nullptr;
    for (const auto& t : adapters.tensors) {
      if (t.name == module + ".lora_B.weight") b = &t;
    }
    for (const auto& t : block.tensors) {
      if (t.name == module + ".weight") w = &t;
    }
    STRATA_CHECK(b != nullptr && w != nullptr, "an adapter without its pair or weight", a.name);
    const std::int64_t r = a.shape[0], in = a.shape[1], out = b->shape[0];
    STRATA_CHECK(w->shape[0] == out && w->shape[1] == in && b->shape[1] == r,
                 "adapter shapes do not match the weight", a.name);
    const float* av = values + a.offset_elems;
    const float* bv = values + b->offset_elems;
    float* wv = base + w->offset_elems;
    tbb::parallel_for(std::int64_t{0}, out, [&](std::int64_t o) {
      for (std::int64_t i = 0; i < in; ++i) {
        double sum = 0;
        for (std::int64_t k = 0; k < r; ++k) {
          sum += static_cast<double>(bv[o * r + k]) * static_cast<double>(av[k * in + i]);
        }
        wv[o * in + i] = static_cast<float>(static_cast<double>(wv[o * in + i]) + scaling * sum);
      }
    });
  }
}

}  // namespace strata::model
