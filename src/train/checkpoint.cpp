// Checkpoint save and load.
#include "strata/train/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
#include <vector>

#include "src/train/group_gatherer.h"
#include "strata/core/file.h"
#include "strata/device/adam8bit.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/model/peft_adapter.h"
#include "strata/model/safetensors.h"

namespace fs = std::filesystem;

namespace strata::train {

namespace {

Status make_dirs(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return io_error("cannot create directory " + dir + ": " + ec.message());
  return Status::ok();
}

}  // namespace

Status copy_tokenizer_files(const std::string& from, const std::string& to) {
  std::error_code ec;
  if (!fs::is_directory(from, ec)) return Status::ok();
  for (const char* name : {"tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                           "special_tokens_map.json", "generation_config.json"}) {
    const fs::path src = fs::path(from) / name;
    if (!fs::exists(src, ec)) continue;
    fs::copy_file(src, fs::path(to) / name, fs::copy_options::overwrite_existing, ec);
    if (ec) return io_error("cannot copy " + src.string() + " into " + to + ": " + ec.message());
  }
  return Status::ok();
}

namespace {

// This rank's moments: one flat slice per group, the same slice boundaries the Partition uses.
Status write_optimizer_shard(const std::string& path, const model::ParamLayout& layout,
                             zero::ZeroProvider& provider, const zero::StateSnapshot& from) {
  model::SafetensorsWriter writer;
  for (const auto& g : layout.groups()) {
    if (g.frozen || g.num_elems == 0) continue;  // no optimizer state, or another stage's
    const std::int64_t n = provider.partition().group(g.id).shard_elems;
    writer.add("exp_avg." + g.name, DType::kF32, {n});
    writer.add("exp_avg_sq." + g.name, DType::kF32, {n});
  }
  writer.set_metadata({{"format", "strata-optimizer"}});
  std::vector<float> m, v;
  int cached = -1;
  return writer.write(path, [&](const model::SafetensorsEntry& e, void* dst) -> Status {
    const bool is_sq = e.name.rfind("exp_avg_sq.", 0) == 0;
    const std::string group_name = e.name.substr(is_sq ? 11 : 8);
    int gid = -1;
    for (const auto& g : layout.groups()) {
      if (g.name == group_name) gid = g.id;
    }
    if (gid < 0) return internal_error("no parameter group " + group_name);
    if (gid != cached) {
      const auto n = static_cast<std::size_t>(provider.partition().group(gid).shard_elems);
      m.assign(n, 0.0f);
      v.assign(n, 0.0f);
      STRATA_RETURN_IF_ERROR(provider.read_moment_slice(gid, m.data(), v.data(), from));
      cached = gid;
    }
    const auto& src = is_sq ? v : m;
    std::memcpy(dst, src.data(), src.size() * sizeof(float));
    return Status::ok();
  });
}

// Whether a group's tensors start where format_version 1 put them (each on a 64-element
// boundary after the one before), so its saved moments read the same under either layout.
bool same_offsets_in_version_1(const model::ParamGroup& group) {
  std::int64_t v1 = 0;
  for (const model::TensorSpec& t : group.tensors) {
    if (t.offset_elems != v1) return false;
    v1 = (t.offset_elems + t.num_elems + 63) / 64 * 64;
  }
  return true;
}

// The ids of the layout's groups, in order, that `keep` selects.
std::vector<int> group_ids(const model::ParamLayout& layout,
                           const std::function<bool(const model::ParamGroup&)>& keep) {
  std::vector<int> ids;
  for (const auto& g : layout.groups()) {
    if (keep(g)) ids.push_back(g.id);
  }
  return ids;
}

// Full fine-tuning: model/, every group's master weights, each tensor whole whatever the split.
Status write_consolidated_model(const std::string& dir, const model::LlamaConfig& config,
                                const model::ParamLayout& layout, const model::ParamLayout& whole,
                                zero::ZeroProvider& provider, dist::ProcessGrid& grid,
                                const zero::StateSnapshot& from) {
  GroupGatherer gatherer(config, std::nullopt, layout, whole, provider, grid, from);
  return write_gathered(group_ids(whole, [](const model::ParamGroup&) { return true; }), gatherer,
                        grid, [&](const model::GroupSource& source) {
                          return model::write_hf_checkpoint(dir, config, gatherer.whole(),
                                                            DType::kF32, source);
                        });
}

// LoRA: the adapters alone, as PEFT saves them, in the checkpoint directory itself; the frozen
// base is where the run read it from.
Status write_adapters(const std::string& dir, const model::LlamaConfig& config,
                      const model::LoraConfig& lora, const model::ParamLayout& layout,
                      const model::ParamLayout& whole, const std::string& base_model,
                      zero::ZeroProvider& provider, dist::ProcessGrid& grid,
                      const zero::StateSnapshot& from) {
  // Every trainable group: the adapters and the modules saved whole beside them.
  GroupGatherer gatherer(config, lora, layout, whole, provider, grid, from);
  return write_gathered(group_ids(whole, [](const model::ParamGroup& g) { return !g.frozen; }),
                        gatherer, grid, [&](const model::GroupSource& source) {
                          return model::write_peft_adapter(dir, lora, whole, base_model, source,
                                                           config.family);
                        });
}

}  // namespace

Result<std::vector<std::string>> prune_checkpoints(
    const std::string& save_dir, std::int64_t keep_last,
    const std::function<void(const std::string&)>& before_remove) {
  STRATA_CHECK(keep_last >= 1, "prune_checkpoints keeps at least one", keep_last);
  const auto step_of = [](const std::string& name) -> std::optional<std::int64_t> {
    // step-NNNNNNNN exactly as step_name writes it (8 or more digits), nothing else.
    if (name.size() < 13 || name.rfind("step-", 0) != 0) return std::nullopt;
    std::int64_t step = 0;
    for (std::size_t i = 5; i < name.size(); ++i) {
      if (name[i] < '0' || name[i] > '9' || step > (INT64_MAX - 9) / 10) return std::nullopt;
      step = step * 10 + (name[i] - '0');
    }
    if (step_name(step) != name) return std::nullopt;
    return step;
  };
  std::string latest;
  if (auto l = read_file(save_dir + "/latest"); l.is_ok()) {
    latest = *l;
    while (!latest.empty() && (latest.back() == '\n' || latest.back() == '\r')) latest.pop_back();
  }
  std::vector<std::pair<std::int64_t, std::string>> complete;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(save_dir, ec)) {
    const std::string name = entry.path().filename().string();
    std::error_code e2;
    if (name.size() > 7 && name[0] == '.' && name.ends_with(".pruned") && entry.is_directory(e2)) {
      fs::remove_all(entry.path(), e2);  // an earlier prune's leftover: no longer a checkpoint
      continue;
    }
    const std::optional<std::int64_t> step = step_of(name);
    if (!step || !entry.is_directory(e2) || !fs::exists(entry.path() / "trainer_state.json", e2)) {
      continue;
    }
    complete.emplace_back(*step, name);
  }
  if (ec) return io_error("listing " + save_dir + " to prune checkpoints: " + ec.message());
  std::sort(complete.begin(), complete.end());
  std::vector<std::string> pruned;
  const auto excess = static_cast<std::int64_t>(complete.size()) - keep_last;
  for (std::int64_t i = 0; i < excess; ++i) {
    const std::string& name = complete[static_cast<std::size_t>(i)].second;
    if (name == latest) continue;
    const std::string dir = (fs::path(save_dir) / name).string();
    const std::string trash = (fs::path(save_dir) / ("." + name + ".pruned")).string();
    STRATA_RETURN_IF_ERROR(rename_synced(dir, trash).with_context("pruning checkpoint " + dir));
    if (before_remove) before_remove(trash);
    fs::remove_all(trash, ec);
    if (ec) return io_error("removing " + trash + " (pruned checkpoint): " + ec.message());
    pruned.push_back(dir);
  }
  return pruned;
}

Result<std::string> save_checkpoint(const std::string& save_dir, const model::LlamaConfig& config,
                                    const model::ParamLayout& layout,
                                    const model::ParamLayout& whole,
                                    const std::optional<model::LoraConfig>& lora,
                                    zero::ZeroProvider& provider, dist::ProcessGrid& grid,
                                    const TrainerState& state, bool held_state) {
  STRATA_CHECK(layout.has_adapters() == lora.has_value(), "adapters without their config");
  const zero::StateSnapshot from{held_state, &grid.data(), &grid.expert_data()};
  dist::Communicator& comm = grid.world();
  const bool root = comm.rank() == 0;
  const std::string final_dir = (fs::path(save_dir) / step_name(state.step)).string();
  const std::string tmp_dir =
      (fs::path(save_dir) / ("." + step_name(state.step) + ".tmp")).string();
  Status s;
  if (root) {
    s = make_dirs(save_dir);
    std::error_code ec;
    fs::remove_all(tmp_dir, ec);
    if (s.is_ok()) s = make_dirs(tmp_dir);
  }
  // Every rank learns whether rank 0 could prepare the directory before writing into it.
  double failed = s.is_ok() ? 0.0 : 1.0;
  STRATA_RETURN_IF_ERROR(
      comm.all_reduce_host(&failed, 1, dist::ReduceOp::kSum, "checkpoint start"));
  if (failed > 0)
    return s.is_ok() ? io_error("rank 0 could not create " + tmp_dir)
                     : s.with_context("saving checkpoint " + final_dir);

  s = write_optimizer_shard(tmp_dir + "/" + optimizer_shard_name(comm.rank(), comm.world_size()),
                            layout, provider, from);
  const std::string base_model = state.config.contains("model") && state.config["model"].is_string()
                                     ? state.config["model"].get<std::string>()
                                     : std::string();
  Status model_status =
      lora ? write_adapters(tmp_dir, config, *lora, layout, whole, base_model, provider, grid, from)
           : write_consolidated_model(tmp_dir + "/model", config, layout, whole, provider, grid,
                                      from);
  if (s.is_ok()) s = model_status;
  if (root && s.is_ok()) {
    Json js = {{"format_version", kCheckpointFormatVersion},
               {"step", state.step},
               {"sequences_consumed", state.sequences_consumed},
               {"seed", state.seed},
               {"world_size", comm.world_size()},
               {"tensor_parallel_size", grid.shape().tensor},
               {"pipeline_parallel_size", grid.shape().pipeline},
               {"expert_parallel_size", grid.shape().expert},
               {"pipeline_layers", state.pipeline_layers},
               {"config", state.config}};
    if (state.loss_scaler) {
      const optim::LossScaler::State& l = *state.loss_scaler;
      js["loss_scaler"] = {{"scale", l.scale},
                           {"iteration", l.iteration},
                           {"last_overflow", l.last_overflow},
                           {"hysteresis", l.hysteresis_left}};
    }
    s = write_json_file(tmp_dir + "/trainer_state.json", js);
    if (s.is_ok() && !lora && !base_model.empty()) {
      s = copy_tokenizer_files(base_model, tmp_dir + "/model");
    }
  }
  failed = s.is_ok() ? 0.0 : 1.0;
  STRATA_RETURN_IF_ERROR(
      comm.all_reduce_host(&failed, 1, dist::ReduceOp::kSum, "checkpoint written"));
  if (failed > 0) {
    if (root) {
      std::error_code ec;
      fs::remove_all(tmp_dir, ec);
    }
    if (s.is_ok()) s = io_error("another rank failed to write its part");
    return s.with_context("saving checkpoint " + final_dir);
  }

  if (root) {
    s = fsync_path(tmp_dir);
    // Swap the finished directory into place. An existing checkpoint of the same step is moved
    // aside first and removed only after the new one is in place.
    std::string old_dir;
    if (s.is_ok() && fs::exists(final_dir)) {
      old_dir = final_dir + ".old";
      std::error_code ec;
      fs::remove_all(old_dir, ec);
      s = rename_synced(final_dir, old_dir);
    }
    if (s.is_ok()) {
      s = rename_synced(tmp_dir, final_dir);
      if (!s.is_ok() && !old_dir.empty()) rename_synced(old_dir, final_dir).ignore();
    }
    bool named = false;  // `latest` names the new checkpoint
    if (s.is_ok()) {
      const std::string latest = save_dir + "/latest", name = step_name(state.step) + "\n";
      // A step saved again over itself: `latest` names it already.
      const Result<std::string> was = read_file(latest);
      if (!was.is_ok() || *was != name) s = write_file_atomic(latest, name);
      const Result<std::string> now = s.is_ok() ? Result<std::string>(name) : read_file(latest);
      named = now.is_ok() && *now == name;
      // Unnamed by `latest` (its write failed before its rename), the new checkpoint was not
      // saved: it goes back to its temporary name (removed below; an incomplete directory under
      // the real name could pass for a checkpoint), and the one it replaced comes back, so the
      // save directory is as it was. Named (only the directory's sync failed after the rename),
      // it stays: it is whole, and `latest` must not name a directory that is gone.
      if (!named && rename_synced(final_dir, tmp_dir).is_ok() && !old_dir.empty()) {
        rename_synced(old_dir, final_dir).ignore();
      }
    }
    if (named && !old_dir.empty()) {
      std::error_code ec;
      fs::remove_all(old_dir, ec);
    }
    if (!s.is_ok()) {
      std::error_code ec;
      fs::remove_all(tmp_dir, ec);
    }
  }
  failed = s.is_ok() ? 0.0 : 1.0;
  STRATA_RETURN_IF_ERROR(
      comm.all_reduce_host(&failed, 1, dist::ReduceOp::kSum, "checkpoint renamed"));
  if (failed > 0) {
    if (s.is_ok()) s = io_error("rank 0 could not move the checkpoint into place");
    return s.with_context("saving checkpoint " + final_dir);
  }
  return final_dir;
}

Status load_checkpoint(const std::string& checkpoint, const model::LlamaConfig& config,
                       const model::ParamLayout& layout, const model::ParamLayout& whole,
                       model::TensorParallel tp, zero::ZeroProvider& provider,
                       const model::GroupSource& base, zero::WorkingCopyCache* base_cache,
                       const model::GroupRangeSource& base_pieces) {
  std::optional<model::LoraConfig> lora;  // the saved adapters' (the run's: validated)
  if (layout.has_adapters()) {
    if (!fs::exists(fs::path(checkpoint) / model::kAdapterConfigFile)) {
      return failed_precondition("checkpoint " + checkpoint +
                                 " holds a full model, not LoRA adapters; resume it with "
                                 "finetune.method \"full\"");
    }
    STRATA_ASSIGN_OR_RETURN(auto adapter, model::PeftAdapterReader::open(checkpoint));
    STRATA_RETURN_IF_ERROR(adapter.validate(whole));
    lora = adapter.config();
    STRATA_RETURN_IF_ERROR(provider.load_master(
        [&](const model::ParamGroup& g, float* dst) {
          return g.frozen ? base(g, dst) : adapter.read_group(g, dst);
        },
        base_cache, base_pieces));
  } else {
    if (!fs::exists(fs::path(checkpoint) / "model")) {
      return failed_precondition("checkpoint " + checkpoint +
                                 " holds LoRA adapters, not a full model; resume it with the "
                                 "finetune settings it was trained with");
    }
    STRATA_ASSIGN_OR_RETURN(auto reader, model::HfCheckpointReader::open(checkpoint + "/model"));
    STRATA_RETURN_IF_ERROR(reader.validate(whole));
    STRATA_RETURN_IF_ERROR(provider.load_master(
        [&](const model::ParamGroup& g, float* dst) { return reader.read_group(g, dst); }));
  }

  // The saved moments: file r holds world rank r's slice of each trainable group of its
  // tensor-parallel rank's layout (the group's flat vector cut into data-parallel-size equal
  // slices). This rank's range is read a saved file at a time, each element found by its place
  // in the whole tensor, so any grid resumes any other. O(shard) memory.
  STRATA_ASSIGN_OR_RETURN(TrainerState st, read_trainer_state(checkpoint));
  const std::string state_file = checkpoint + "/trainer_state.json";
  STRATA_ASSIGN_OR_RETURN(const SavedGrid saved, saved_grid(st, config, state_file));
  const int saved_tp = saved.shape.tensor;
  const model::PipelineStage& saved_stage = saved.stage;
  const dist::GridShape& saved_grid = saved.shape;
  // Each saved tensor-parallel rank's layout of every group (its stage's groups in its file).
  std::vector<model::ParamLayout> saved_layouts;
  if (saved_tp == 1 && tp.size == 1) {
    saved_layouts.push_back(whole);  // the same layout (adapters included)
  } else {
    saved_layouts = rank_layouts(config, lora, saved_tp);
  }
  std::vector<model::SafetensorsReader> shards;
  for (int r = 0; r < st.world_size; ++r) {
    STRATA_ASSIGN_OR_RETURN(auto f, model::SafetensorsReader::open(
                                        checkpoint + "/" + optimizer_shard_name(r, st.world_size)));
    shards.push_back(std::move(f));
  }
  struct Run {
    std::int64_t at, full, n;  // elements [at, at + n) hold the tensor's [full, full + n)
  };
  struct Copy {
    std::int64_t from, to, n;
  };
  std::vector<float> m, v;
  return provider.load_moments([&](int gid, std::int64_t begin, std::int64_t count, float* exp_avg,
                                   float* exp_avg_sq) -> Status {
    const model::ParamGroup& group = layout.group(gid);
    std::fill(exp_avg, exp_avg + count, 0.0f);
    std::fill(exp_avg_sq, exp_avg_sq + count, 0.0f);
    // Where this rank's range [begin, begin + count) sits in each of its tensors.
    std::vector<std::pair<const model::TensorSpec*, std::vector<Run>>> wanted;
    for (const auto& t : group.tensors) {
      const std::int64_t lo = std::max(begin, t.offset_elems),
                         hi = std::min(begin + count, t.offset_elems + t.num_elems);
      if (lo >= hi) continue;
      std::vector<Run> runs;
      t.for_each_run(lo - t.offset_elems, hi - lo,
                     [&](std::int64_t first, std::int64_t full_first, std::int64_t n) {
                       runs.push_back({t.offset_elems + first - begin, full_first, n});
                     });
      wanted.emplace_back(&t, std::move(runs));
    }
    const std::string& name = group.name;
    // An expert's group under the saved expert parallelism: in the files of the ranks holding
    // that expert, cut over them.
    const int expert = saved_grid.expert > 1 ? whole.expert_of(gid) : -1;
    const int slices = expert >= 0 ? saved_grid.data / saved_grid.expert : saved_grid.data;
    for (int r = 0; r < st.world_size; ++r) {
      const dist::GridCoord at = dist::grid_coord(saved_grid, r);
      if (whole.stage_of(gid, saved_stage) != at.pipeline) continue;  // another stage's file
      if (expert >= 0 && at.expert != expert / (config.moe.num_experts / saved_grid.expert)) {
        continue;  // another rank's experts
      }
      const int slice_at = expert >= 0 ? at.data / saved_grid.expert : at.data;
      const model::ParamGroup& saved =
          saved_layouts[static_cast<std::size_t>(at.tensor)].group(gid);
      const auto& f = shards[static_cast<std::size_t>(r)];
      const model::SafetensorsEntry* e = f.find("exp_avg." + name);
      if (saved.name != name || e == nullptr || e->shape.size() != 1) {
        return data_loss(f.path() + " has no 1-D tensor exp_avg." + name);
      }
      if (st.format_version < 2 && !same_offsets_in_version_1(saved)) {
        return data_loss(
            checkpoint + ": written with format_version " + std::to_string(st.format_version) +
            ", whose optimizer moments lay group " + name +
            "'s tensors on 64-element boundaries, not the 256 of this build: its moments would be "
            "read at the wrong places, so they are not read. Resume it with the Strata that wrote "
            "it, or start from its weights alone (its model.safetensors as model_path)");
      }
      const std::int64_t slice = e->shape[0];
      if (slice * slices < saved.num_elems) {
        return data_loss(checkpoint + ": the saved moments of " + name + " hold " +
                         std::to_string(slice * slices) + " elements, fewer than the " +
                         std::to_string(saved.num_elems) + " the model needs");
      }
      const std::int64_t lo = slice * slice_at, hi = std::min(lo + slice, saved.num_elems);
      // Both run lists ascend through the whole tensor: one merge per tensor.
      std::vector<Copy> copies;
      for (const auto& entry : wanted) {
        const model::TensorSpec* tensor = entry.first;
        const auto& runs = entry.second;  // a name a lambda can capture (clang < 16)
        const model::TensorSpec* had = tensor_named(saved, tensor->name);
        if (had == nullptr) {
          return data_loss(f.path() + ": group " + name + " has no " + tensor->name);
        }
        // A duplicate's moments are the counting rank's: read them there, once.
        if (!saved.counts(*had)) continue;
        const std::int64_t a = std::max(lo, had->offset_elems),
                           b = std::min(hi, had->offset_elems + had->num_elems);
        if (a >= b) continue;
        std::size_t k = 0;
        had->for_each_run(
            a - had->offset_elems, b - a,
            [&](std::int64_t first, std::int64_t full_first, std::int64_t n) {
              while (k < runs.size() && runs[k].full + runs[k].n <= full_first) ++k;
              for (std::size_t w = k; w < runs.size() && runs[w].full < full_first + n; ++w) {
                const std::int64_t x = std::max(full_first, runs[w].full),
                                   y = std::min(full_first + n, runs[w].full + runs[w].n);
                if (x < y) {
                  copies.push_back({had->offset_elems + first + (x - full_first) - lo,
                                    runs[w].at + (x - runs[w].full), y - x});
                }
              }
            });
      }
      if (copies.empty()) continue;
      m.assign(static_cast<std::size_t>(slice), 0.0f);
      v.assign(m.size(), 0.0f);
      STRATA_RETURN_IF_ERROR(f.read("exp_avg." + name, {slice}, m.data(), DType::kF32));
      STRATA_RETURN_IF_ERROR(f.read("exp_avg_sq." + name, {slice}, v.data(), DType::kF32));
      for (const Copy& c : copies) {
        const auto n = static_cast<std::size_t>(c.n) * sizeof(float);
        std::memcpy(exp_avg + c.to, m.data() + c.from, n);
        std::memcpy(exp_avg_sq + c.to, v.data() + c.from, n);
      }
    }
    return Status::ok();
  });
}

}  // namespace strata::train
