// Checkpoint save and load.
#include "strata/train/checkpoint.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "strata/core/file.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/model/safetensors.h"

namespace fs = std::filesystem;

namespace strata::train {
namespace {

std::string step_name(std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
  return buf;
}

Status make_dirs(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return io_error("cannot create directory " + dir + ": " + ec.message());
  return Status::ok();
}

}  // namespace

Result<std::string> save_checkpoint(const std::string& save_dir, const model::LlamaConfig& config,
                                    const model::ParamLayout& layout, zero::OffloadEngine& engine,
                                    const TrainerState& state) {
  STRATA_RETURN_IF_ERROR(make_dirs(save_dir));
  const std::string final_dir = (fs::path(save_dir) / step_name(state.step)).string();
  const std::string tmp_dir =
      (fs::path(save_dir) / ("." + step_name(state.step) + ".tmp-" + std::to_string(::getpid())))
          .string();
  std::error_code ec;
  fs::remove_all(tmp_dir, ec);
  STRATA_RETURN_IF_ERROR(make_dirs(tmp_dir));
  auto fail = [&](const Status& s) {
    std::error_code ignored;
    fs::remove_all(tmp_dir, ignored);
    return s.with_context("saving checkpoint " + final_dir);
  };

  Status s = model::write_hf_checkpoint(
      tmp_dir + "/model", config, layout, DType::kF32,
      [&](const model::ParamGroup& g, float* dst) { return engine.read_master(g.id, dst); });
  if (!s.is_ok()) return fail(s);

  model::SafetensorsWriter writer;
  for (const auto& g : layout.groups()) {
    writer.add("exp_avg." + g.name, DType::kF32, {g.num_elems});
    writer.add("exp_avg_sq." + g.name, DType::kF32, {g.num_elems});
  }
  writer.set_metadata({{"format", "strata-optimizer"}});
  // Moments are read a group at a time: exp_avg then exp_avg_sq of the same group.
  std::vector<float> m, v;
  int cached = -1;
  s = writer.write(tmp_dir + "/optimizer.safetensors",
                   [&](const model::SafetensorsEntry& e, void* dst) -> Status {
                     const bool is_sq = e.name.rfind("exp_avg_sq.", 0) == 0;
                     const std::string group_name = e.name.substr(is_sq ? 11 : 8);
                     int gid = -1;
                     for (const auto& g : layout.groups())
                       if (g.name == group_name) gid = g.id;
                     if (gid < 0) return internal_error("no group " + group_name);
                     if (gid != cached) {
                       const auto n = static_cast<std::size_t>(layout.group(gid).num_elems);
                       m.assign(n, 0.0f);
                       v.assign(n, 0.0f);
                       STRATA_RETURN_IF_ERROR(engine.read_moments(gid, m.data(), v.data()));
                       cached = gid;
                     }
                     const auto& src = is_sq ? v : m;
                     std::memcpy(dst, src.data(), src.size() * sizeof(float));
                     return Status::ok();
                   });
  if (!s.is_ok()) return fail(s);

  Json js = {{"format_version", kCheckpointFormatVersion},
             {"step", state.step},
             {"sequences_consumed", state.sequences_consumed},
             {"seed", state.seed},
             {"config", state.config}};
  s = write_json_file(tmp_dir + "/trainer_state.json", js);
  if (!s.is_ok()) return fail(s);
  s = fsync_path(tmp_dir);
  if (!s.is_ok()) return fail(s);

  // Swap the finished directory into place. An existing checkpoint of the same step is moved
  // aside first and removed only after the new one is in place.
  std::string old_dir;
  if (fs::exists(final_dir)) {
    old_dir = final_dir + ".old-" + std::to_string(::getpid());
    s = rename_synced(final_dir, old_dir);
    if (!s.is_ok()) return fail(s);
  }
  s = rename_synced(tmp_dir, final_dir);
  if (!s.is_ok()) {
    if (!old_dir.empty()) rename_synced(old_dir, final_dir).ignore();
    return fail(s);
  }
  STRATA_RETURN_IF_ERROR(write_file_atomic(save_dir + "/latest", step_name(state.step) + "\n"));
  if (!old_dir.empty()) fs::remove_all(old_dir, ec);
  return final_dir;
}

Result<std::string> resolve_checkpoint(const std::string& dir) {
  if (!fs::is_directory(dir)) return not_found("checkpoint directory " + dir + " does not exist");
  std::string ckpt = dir;
  if (!fs::exists(fs::path(dir) / "trainer_state.json")) {
    const std::string latest = (fs::path(dir) / "latest").string();
    if (!fs::exists(latest)) {
      return not_found(dir +
                       " is not a checkpoint: it has neither trainer_state.json nor a "
                       "'latest' file naming one");
    }
    STRATA_ASSIGN_OR_RETURN(std::string name, read_file(latest));
    while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
    if (name.empty() || name.find('/') != std::string::npos) {
      return data_loss(latest + " is malformed: expected a step directory name, got '" + name +
                       "'");
    }
    ckpt = (fs::path(dir) / name).string();
  }
  for (const char* f : {"trainer_state.json", "optimizer.safetensors", "model/config.json",
                        "model/model.safetensors"}) {
    if (!fs::exists(fs::path(ckpt) / f)) {
      return not_found("checkpoint " + ckpt + " is incomplete: " + f + " is missing");
    }
  }
  return ckpt;
}

Result<TrainerState> read_trainer_state(const std::string& checkpoint) {
  const std::string path = checkpoint + "/trainer_state.json";
  STRATA_ASSIGN_OR_RETURN(Json js, read_json_file(path));
  TrainerState st;
  std::vector<std::string> errors;
  JsonReader r(js, "", &errors);
  std::int64_t version = 0, seed = 0;
  r.read("format_version", &version, 1);
  r.read("step", &st.step, 0);
  r.read("sequences_consumed", &st.sequences_consumed, 0);
  r.read("seed", &seed, 0);
  st.seed = static_cast<std::uint64_t>(seed);
  if (const Json* c = r.raw("config")) st.config = *c;
  for (const char* k : {"format_version", "step", "sequences_consumed", "seed"}) {
    if (!r.has(k)) r.error(k, "is missing");
  }
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

Status load_checkpoint(const std::string& checkpoint, const model::ParamLayout& layout,
                       zero::OffloadEngine& engine) {
  STRATA_ASSIGN_OR_RETURN(auto reader, model::HfCheckpointReader::open(checkpoint + "/model"));
  STRATA_RETURN_IF_ERROR(reader.validate(layout));
  STRATA_RETURN_IF_ERROR(engine.load_master(
      [&](const model::ParamGroup& g, float* dst) { return reader.read_group(g, dst); }));
  const std::string opt_path = checkpoint + "/optimizer.safetensors";
  STRATA_ASSIGN_OR_RETURN(auto opt, model::SafetensorsReader::open(opt_path));
  std::vector<float> m, v;
  for (const auto& g : layout.groups()) {
    const auto n = static_cast<std::size_t>(g.num_elems);
    m.assign(n, 0.0f);
    v.assign(n, 0.0f);
    STRATA_RETURN_IF_ERROR(opt.read("exp_avg." + g.name, {g.num_elems}, m.data(), DType::kF32));
    STRATA_RETURN_IF_ERROR(opt.read("exp_avg_sq." + g.name, {g.num_elems}, v.data(), DType::kF32));
    STRATA_RETURN_IF_ERROR(engine.write_moments(g.id, m.data(), v.data()));
  }
  return Status::ok();
}

}  // namespace strata::train
