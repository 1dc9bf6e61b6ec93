// Hugging Face checkpoint directories: reading (single file or sharded with an index), checking
// against a parameter layout, and writing config.json + model.safetensors.
#include "strata/model/hf_checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <set>
#include <system_error>

#include "strata/core/json.h"
#include "strata/tensor/tensor.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;

constexpr const char* kConfigFile = "config.json";
constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

std::string join(const std::string& dir, const std::string& name) {
  return (fs::path(dir) / name).string();
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string_view hf_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "float32";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    default:
      return "";
  }
}

}  // namespace

Result<LlamaConfig> HfCheckpointReader::read_config(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return not_found("checkpoint directory " + dir +
                     " does not exist or is not a directory; expected a Hugging Face model "
                     "directory with config.json and model.safetensors");
  }
  const std::string config_path = join(dir, kConfigFile);
  auto config_json = read_json_file(config_path);
  if (!config_json.is_ok()) return config_json.status().with_context("reading checkpoint " + dir);
  return LlamaConfig::from_json(*config_json, config_path);
}

Result<HfCheckpointReader> HfCheckpointReader::open(const std::string& dir) {
  HfCheckpointReader reader;
  reader.dir_ = dir;
  STRATA_ASSIGN_OR_RETURN(reader.config_, read_config(dir));
  std::error_code ec;

  const std::string index_path = join(dir, kIndexFile);
  const std::string single_path = join(dir, kSingleFile);
  if (fs::exists(index_path, ec)) {
    STRATA_ASSIGN_OR_RETURN(Json index, read_json_file(index_path));
    const Json* weight_map =
        index.is_object() && index.contains("weight_map") ? &index.at("weight_map") : nullptr;
    if (weight_map == nullptr || !weight_map->is_object()) {
      return data_loss(index_path +
                       ": expected an object with a \"weight_map\" object mapping "
                       "tensor names to shard file names");
    }
    std::map<std::string, std::size_t> shard_index;  // shard file name -> index in files_
    for (const auto& [tensor, shard_json] : weight_map->items()) {
      if (!shard_json.is_string()) {
        return data_loss(index_path + ": weight_map entry for '" + tensor +
                         "' must be a shard file name, found " + shard_json.dump());
      }
      const std::string shard = shard_json.get<std::string>();
      auto it = shard_index.find(shard);
      if (it == shard_index.end()) {
        const std::string shard_path = join(dir, shard);
        if (!fs::exists(shard_path, ec)) {
          return not_found(index_path + " names shard '" + shard + "' (for tensor '" + tensor +
                           "'), but " + shard_path +
                           " does not exist; the checkpoint is incomplete");
        }
        STRATA_ASSIGN_OR_RETURN(SafetensorsReader file, SafetensorsReader::open(shard_path));
        reader.files_.push_back(std::make_shared<SafetensorsReader>(std::move(file)));
        it = shard_index.emplace(shard, reader.files_.size() - 1).first;
      }
      if (reader.files_[it->second]->find(tensor) == nullptr) {
        return data_loss(index_path + " says tensor '" + tensor + "' is in shard '" + shard +
                         "', but that shard does not contain it");
      }
      reader.tensor_file_[tensor] = it->second;
    }
  } else if (fs::exists(single_path, ec)) {
    STRATA_ASSIGN_OR_RETURN(SafetensorsReader file, SafetensorsReader::open(single_path));
    reader.files_.push_back(std::make_shared<SafetensorsReader>(std::move(file)));
    for (const auto& e : reader.files_.back()->entries()) reader.tensor_file_[e.name] = 0;
  } else {
    return not_found("checkpoint directory " + dir + " has no weights: expected " + kSingleFile +
                     ", or " + kIndexFile + " with its model-0000i-of-0000n.safetensors shards");
  }
  return reader;
}

Status HfCheckpointReader::validate(const ParamLayout& layout) const {
  std::vector<std::string> errors;
  std::set<std::string> expected;
  for (const auto& group : layout.groups()) {
    for (const auto& t : group.tensors) {
      expected.insert(t.name);
      auto it = tensor_file_.find(t.name);
      if (it == tensor_file_.end()) {
        errors.push_back("missing tensor '" + t.name + "' (expected shape " +
                         shape_string(t.full_shape()) + ")");
        continue;
      }
      const SafetensorsReader& file = *files_[it->second];
      const SafetensorsEntry* e = file.find(t.name);
      STRATA_CHECK(e != nullptr, "tensor indexed but absent from its file", t.name, file.path());
      if (e->shape != t.full_shape()) {
        errors.push_back("tensor '" + t.name + "' in " + file.path() + " has shape " +
                         shape_string(e->shape) + ", expected " + shape_string(t.full_shape()));
      }
      if (e->dtype != DType::kF32 && e->dtype != DType::kBF16 && e->dtype != DType::kF16) {
        errors.push_back("tensor '" + t.name + "' in " + file.path() + " has dtype " +
                         std::string(safetensors_dtype_name(e->dtype)) +
                         ", expected F32, BF16 or F16");
      }
    }
  }
  for (const auto& [name, file_index] : tensor_file_) {
    if (expected.count(name) != 0) continue;
    // Older exports carry the rotary frequency buffers; tied models may still store the head.
    if (ends_with(name, "rotary_emb.inv_freq")) continue;
    if (name == "lm_head.weight" && config_.tie_word_embeddings) continue;
    errors.push_back("unexpected tensor '" + name + "' in " + files_[file_index]->path());
  }
  if (errors.empty()) return Status::ok();
  std::string msg = "checkpoint " + dir_ + " does not match the model (" +
                    std::to_string(errors.size()) + " problems):";
  for (const auto& e : errors) msg += "\n  " + e;
  return invalid_argument(msg);
}

Status read_slice(const SafetensorsReader& file, const std::string& name, const TensorSpec& t,
                  std::int64_t a, std::int64_t count, float* dst) {
  const std::vector<std::int64_t> full = t.full_shape();
  Status s;
  t.for_each_run(a, count, [&](std::int64_t first, std::int64_t full_first, std::int64_t n) {
    if (s.is_ok()) s = file.read_range(name, full, full_first, n, dst + (first - a), DType::kF32);
  });
  return s;
}

Status HfCheckpointReader::read_group(const ParamGroup& group, float* dst) const {
  return read_group_range(group, 0, group.num_elems, dst);
}

Status HfCheckpointReader::read_group_range(const ParamGroup& group, std::int64_t begin,
                                            std::int64_t count, float* dst) const {
  std::fill(dst, dst + count, 0.0f);
  const std::int64_t end = begin + count;
  for (const auto& t : group.tensors) {
    const std::int64_t a = std::clamp(begin - t.offset_elems, std::int64_t{0}, t.num_elems);
    const std::int64_t b = std::clamp(end - t.offset_elems, std::int64_t{0}, t.num_elems);
    if (b <= a) continue;
    auto it = tensor_file_.find(t.name);
    if (it == tensor_file_.end()) {
      return not_found("checkpoint " + dir_ + " has no tensor '" + t.name + "' (group " +
                       group.name + ")");
    }
    STRATA_RETURN_IF_ERROR(
        read_slice(*files_[it->second], t.name, t, a, b - a, dst + (t.offset_elems + a - begin)));
  }
  return Status::ok();
}

GroupSource split_source(std::function<bool(const TensorSpec&)> pick, GroupSource picked,
                         GroupSource others) {
  return [pick = std::move(pick), picked = std::move(picked), others = std::move(others)](
             const ParamGroup& group, float* dst) -> Status {
    ParamGroup mine = group, theirs = group;
    mine.tensors.clear();
    theirs.tensors.clear();
    for (const auto& t : group.tensors) (pick(t) ? mine : theirs).tensors.push_back(t);
    if (theirs.tensors.empty()) return picked(group, dst);
    if (mine.tensors.empty()) return others(group, dst);
    STRATA_RETURN_IF_ERROR(others(theirs, dst));
    std::vector<float> values(static_cast<std::size_t>(group.num_elems));
    STRATA_RETURN_IF_ERROR(picked(mine, values.data()));
    for (const auto& t : mine.tensors) {
      std::copy_n(values.data() + t.offset_elems, t.num_elems, dst + t.offset_elems);
    }
    return Status::ok();
  };
}

Status write_hf_checkpoint(const std::string& dir, const LlamaConfig& config,
                           const ParamLayout& layout, DType dtype, const GroupSource& read_group) {
  const std::string_view hf_name = hf_dtype_name(dtype);
  if (hf_name.empty()) {
    return invalid_argument("cannot write checkpoint " + dir + " in dtype " +
                            std::string(dtype_name(dtype)) + "; use f32, bf16 or f16");
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return io_error("cannot create checkpoint directory " + dir + ": " + ec.message());

  SafetensorsWriter writer;
  writer.set_metadata({{"format", "pt"}});
  struct Slot {
    const ParamGroup* group;
    const TensorSpec* tensor;
  };
  std::vector<Slot> slots;  // declaration order, which is the order fill() is called in
  for (const auto& group : layout.groups()) {
    for (const auto& t : group.tensors) {
      writer.add(t.name, dtype, t.shape);
      slots.push_back({&group, &t});
    }
  }

  // One group's f32 values are cached while its tensors are written.
  std::vector<float> group_values;
  int cached_group = -1;
  std::size_t next = 0;
  auto fill = [&](const SafetensorsEntry& entry, void* out) -> Status {
    STRATA_CHECK(next < slots.size() && slots[next].tensor->name == entry.name,
                 "safetensors writer visited tensors out of order", entry.name);
    const Slot& slot = slots[next++];
    if (slot.group->id != cached_group) {
      group_values.assign(static_cast<std::size_t>(slot.group->num_elems), 0.0f);
      cached_group = -1;
      const Status s = read_group(*slot.group, group_values.data());
      if (!s.is_ok()) return s.with_context("reading parameter group " + slot.group->name);
      cached_group = slot.group->id;
    }
    convert(group_values.data() + slot.tensor->offset_elems, DType::kF32, out, dtype,
            static_cast<std::size_t>(slot.tensor->num_elems));
    return Status::ok();
  };
  // Weights first: a config.json next to them then means the directory is complete.
  STRATA_RETURN_IF_ERROR(writer.write(join(dir, kSingleFile), fill));
  // A stale index from an earlier sharded save would take precedence over the new file.
  const std::string stale_index = join(dir, kIndexFile);
  if (fs::exists(stale_index, ec) && !fs::remove(stale_index, ec)) {
    return io_error("cannot remove stale " + stale_index + ": " + ec.message());
  }

  Json config_json = config.to_json();
  config_json["torch_dtype"] = std::string(hf_name);
  return write_json_file(join(dir, kConfigFile), config_json);
}

}  // namespace strata::model
