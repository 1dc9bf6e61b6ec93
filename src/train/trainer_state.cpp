// A checkpoint's trainer state and the names of its files.
#include "strata/train/trainer_state.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "strata/core/file.h"
#include "strata/device/adam8bit.h"
#include "strata/model/peft_adapter.h"

namespace fs = std::filesystem;

namespace strata::train {

std::string step_name(std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::string optimizer_shard_name(int rank, int world) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "optimizer-%05d-of-%05d.safetensors", rank, world);
  return buf;
}

Result<std::string> resolve_checkpoint(const std::string& dir) {
  // Never throws: a name from `latest` may be anything (too long, a loop of links).
  const auto present = [](const fs::path& p) {
    std::error_code ec;
    return fs::exists(p, ec);
  };
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return not_found("checkpoint directory " + dir + " does not exist");
  std::string ckpt = dir;
  if (!present(fs::path(dir) / "trainer_state.json")) {
    const std::string latest = (fs::path(dir) / "latest").string();
    if (!present(latest)) {
      return not_found(dir +
                       " is not a checkpoint: it has neither trainer_state.json nor a "
                       "'latest' file naming one");
    }
    STRATA_ASSIGN_OR_RETURN(std::string name, read_file(latest));
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
      return data_loss(latest + " is malformed: expected a step directory name, got '" + name +
                       "'");
    }
    ckpt = (fs::path(dir) / name).string();
  }
  // A full fine-tune saves the model (model/), a LoRA run its adapters (PEFT's files).
  const bool adapters = present(fs::path(ckpt) / model::kAdapterConfigFile);
  for (const char* f :
       {"trainer_state.json", adapters ? model::kAdapterWeightsFile : "model/config.json"}) {
    if (!present(fs::path(ckpt) / f)) {
      return not_found("checkpoint " + ckpt + " is incomplete: " + f + " is missing");
    }
  }
  STRATA_ASSIGN_OR_RETURN(TrainerState st, read_trainer_state(ckpt));
  for (int r = 0; r < st.world_size; ++r) {
    const std::string f = optimizer_shard_name(r, st.world_size);
    if (!present(fs::path(ckpt) / f)) {
      return not_found("checkpoint " + ckpt + " is incomplete: " + f +
                       " is missing (it was saved by " + std::to_string(st.world_size) + " ranks)");
    }
  }
  return ckpt;
}

std::string moments_conversion_note(const TrainerState& saved, std::string_view state_dtype) {
  const Json& optimizer = saved.config.contains("optimizer") ? saved.config["optimizer"] : Json();
  const std::string kept = optimizer.is_object() && optimizer.contains("state_dtype")
                               ? optimizer["state_dtype"].get<std::string>()
                               : "fp32";
  const std::string state(state_dtype);
  const std::string blocks = std::to_string(device::kAdam8BlockElems);
  if (kept != state) {
    return "the checkpoint's Adam moments were kept in " + kept + "; they continue in " + state +
           (state == "bf16"   ? " (rounded to nearest)"
            : state == "int8" ? " (quantized to 8 bits in blocks of " + blocks + ")"
                              : " (widened exactly)");
  }
  if (state == "int8" && saved.format_version < 3) {
    return "the checkpoint's 8-bit Adam moments were kept in blocks of 256; they continue in "
           "blocks of " +
           blocks + " (quantized anew from the saved values)";
  }
  return "";
}

Result<TrainerState> read_trainer_state(const std::string& checkpoint) {
  const std::string path = checkpoint + "/trainer_state.json";
  STRATA_ASSIGN_OR_RETURN(Json js, read_json_file(path));
  TrainerState st;
  std::vector<std::string> errors;
  JsonReader r(js, "", &errors);
  std::int64_t version = 0, seed = 0;
  r.read("format_version", &version, 1);
  r.read("world_size", &st.world_size, 1, 1 << 20);
  r.read("tensor_parallel_size", &st.tensor_parallel_size, 1, 1 << 16);
  r.read("pipeline_parallel_size", &st.pipeline_parallel_size, 1, 1 << 16);
  r.read("expert_parallel_size", &st.expert_parallel_size, 1, 1 << 16);
  r.read("pipeline_layers", &st.pipeline_layers);
  r.read("step", &st.step, 0);
  r.read("sequences_consumed", &st.sequences_consumed, 0);
  r.read("seed", &seed, 0);
  st.seed = static_cast<std::uint64_t>(seed);
  if (const Json* c = r.raw("config")) st.config = *c;
  if (const Json* l = r.raw("loss_scaler"); l != nullptr && !l->is_null()) {
    JsonReader lr(*l, "loss_scaler", &errors);
    optim::LossScaler::State ls;
    lr.read("scale", &ls.scale, 0.0);
    lr.read("iteration", &ls.iteration, 0);
    lr.read("last_overflow", &ls.last_overflow, -1);
    lr.read("hysteresis", &ls.hysteresis_left, 1);
    for (const char* k : {"scale", "iteration", "last_overflow", "hysteresis"}) {
      if (!lr.has(k)) lr.error(k, "is missing");
    }
    lr.reject_unknown();
    st.loss_scaler = ls;
  }
  for (const char* k : {"format_version", "step", "sequences_consumed", "seed"}) {
    if (!r.has(k)) r.error(k, "is missing");
  }
  st.format_version = static_cast<int>(version);
  if (version > kCheckpointFormatVersion) {
    errors.push_back("format_version " + std::to_string(version) +
                     " is newer than this build supports (" +
                     std::to_string(kCheckpointFormatVersion) + ")");
  }
  if (!errors.empty()) {
    std::string msg = path + " is malformed:";
    for (const auto& e : errors) msg += "\n  " + e;
    return data_loss(msg);
  }
  return st;
}

Result<SavedGrid> saved_grid(const TrainerState& st, const model::LlamaConfig& config,
                             const std::string& state_file) {
  const int saved_tp = st.tensor_parallel_size;
  if (const auto problems = model::tensor_parallel_problems(config, saved_tp); !problems.empty()) {
    return data_loss(state_file + ": tensor_parallel_size " + std::to_string(saved_tp) +
                     " cannot split this model: " + problems.front());
  }
  const int saved_pp = st.pipeline_parallel_size;
  if (st.world_size % (saved_tp * saved_pp) != 0) {
    return data_loss(state_file + ": tensor_parallel_size " + std::to_string(saved_tp) +
                     (saved_pp > 1 ? " x pipeline_parallel_size " + std::to_string(saved_pp) : "") +
                     " does not divide world_size " + std::to_string(st.world_size));
  }
  // Which saved stage held each group.
  SavedGrid saved;
  if (saved_pp > 1) {
    const auto n = static_cast<int>(st.pipeline_layers.size());
    const int virtual_stages = n % saved_pp == 0 ? n / saved_pp : 0;
    const auto problems = model::pipeline_layers_problems(
        st.pipeline_layers, saved_pp, std::max(virtual_stages, 1), config.num_hidden_layers);
    if (virtual_stages == 0 || !problems.empty()) {
      return data_loss(state_file + ": pipeline_layers " + Json(st.pipeline_layers).dump() +
                       " cannot cut this model over pipeline_parallel_size " +
                       std::to_string(saved_pp) +
                       (problems.empty() ? "" : ": " + problems.front()));
    }
    saved.stage = model::pipeline_stage(saved_pp, virtual_stages, 0, st.pipeline_layers);
  }
  saved.shape = {st.world_size / (saved_tp * saved_pp), saved_tp, saved_pp};
  if (const int e = st.expert_parallel_size; e > 1) {
    if (saved.shape.data % e != 0 || !config.has_moe() || config.moe.num_experts % e != 0) {
      return data_loss(
          state_file + ": expert_parallel_size " + std::to_string(e) + " does not divide the " +
          std::to_string(saved.shape.data) + " data-parallel ranks" +
          (config.has_moe()
               ? " and the " + std::to_string(config.moe.num_experts) + " experts of each MoE layer"
               : " (the model has no experts)"));
    }
    saved.shape.expert = e;
  }
  return saved;
}

}  // namespace strata::train
