// QuantizedBaseCache: a directory of a quantized base's working copies and its manifest.
#include "strata/train/quantized_cache.h"

#include <filesystem>
#include <fstream>
#include <span>
#include <system_error>

#include "strata/core/file.h"
#include "strata/model/lora.h"

namespace strata::train {
namespace fs = std::filesystem;

namespace {

constexpr const char* kManifest = "manifest.json";
constexpr const char* kFormat = "nf4 blocks 64, block maxima 8-bit dynamic in groups of 256 (v1)";

}  // namespace

Result<Json> quantized_base_identity(const TrainConfig& config) {
  Json id = {{"format", kFormat}, {"dtype", std::string(dtype_name(config.precision))}};
  // The modules that train whole leave the base's groups (a block's norms move out): another
  // set lays the cached groups out otherwise.
  Json saved = Json::array();
  for (const auto& m : model::saveable_modules(config.model)) {
    if (config.finetune.lora.saves(m)) saved.push_back(m);
  }
  id["modules_to_save"] = saved;
  if (config.model_path.empty()) {
    id["seed"] = config.seed;
    id["config"] = config.model.to_json();
    return id;
  }
  std::error_code ec;
  const fs::path dir = fs::absolute(config.model_path, ec);
  id["model"] = dir.string();
  STRATA_ASSIGN_OR_RETURN(std::string text, read_file((dir / "config.json").string()));
  id["config"] = text;
  Json files = Json::array();
  std::vector<fs::path> weights;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".safetensors") weights.push_back(e.path());
  }
  if (ec) return io_error("cannot list " + dir.string() + ": " + ec.message());
  std::sort(weights.begin(), weights.end());
  for (const auto& p : weights) {
    const auto size = fs::file_size(p, ec);
    const auto mtime = fs::last_write_time(p, ec).time_since_epoch().count();
    if (ec) return io_error("cannot stat " + p.string() + ": " + ec.message());
    files.push_back({{"name", p.filename().string()},
                     {"size", static_cast<std::uint64_t>(size)},
                     {"mtime", static_cast<std::int64_t>(mtime)}});
  }
  id["files"] = files;
  return id;
}

namespace {

Status create_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return io_error("finetune.quantized_cache '" + dir +
                    "': cannot create the directory: " + ec.message());
  }
  return Status::ok();
}

bool manifest_matches(const std::string& dir, const Json& identity) {
  auto text = read_file((fs::path(dir) / kManifest).string());
  if (!text.is_ok()) return false;
  const Json on_disk = Json::parse(*text, nullptr, /*allow_exceptions=*/false);
  return !on_disk.is_discarded() && on_disk == identity;
}

}  // namespace

Status QuantizedBaseCache::claim(const std::string& dir, const Json& identity) {
  STRATA_RETURN_IF_ERROR(create_dir(dir));
  if (manifest_matches(dir, identity)) return Status::ok();
  // Another base's files go first, then this base's manifest.
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".nf4") fs::remove(e.path(), ec);
  }
  return write_file_atomic((fs::path(dir) / kManifest).string(), identity.dump(1) + "\n")
      .with_context("finetune.quantized_cache");
}

Result<std::unique_ptr<QuantizedBaseCache>> QuantizedBaseCache::open(const std::string& dir,
                                                                     const Json& identity,
                                                                     bool writer,
                                                                     model::TensorParallel tensor) {
  STRATA_RETURN_IF_ERROR(create_dir(dir));
  return std::unique_ptr<QuantizedBaseCache>(
      new QuantizedBaseCache(dir, manifest_matches(dir, identity), writer, tensor));
}

std::string QuantizedBaseCache::path_of(const model::ParamGroup& group) const {
  const std::string slice = tensor_.size > 1 ? ".tensor-" + std::to_string(tensor_.rank) + "-of-" +
                                                   std::to_string(tensor_.size)
                                             : std::string();
  return (fs::path(dir_) / (group.name + slice + ".nf4")).string();
}

Result<bool> QuantizedBaseCache::read(const model::ParamGroup& group, void* dst,
                                      std::uint64_t bytes) {
  const std::string path = path_of(group);
  std::error_code ec;
  if (!matches_ || fs::file_size(path, ec) != bytes || ec) {
    ++misses_;
    return false;
  }
  std::ifstream in(path, std::ios::binary);
  in.read(static_cast<char*>(dst), static_cast<std::streamsize>(bytes));
  if (!in || static_cast<std::uint64_t>(in.gcount()) != bytes) {
    return io_error("finetune.quantized_cache: cannot read " + path);
  }
  ++hits_;
  return true;
}

Status QuantizedBaseCache::write(const model::ParamGroup& group, const void* src,
                                 std::uint64_t bytes) {
  if (!writer_ || !matches_) return Status::ok();
  return write_file_atomic(path_of(group), std::span(static_cast<const std::byte*>(src), bytes))
      .with_context("finetune.quantized_cache");
}

std::string QuantizedBaseCache::describe() const {
  if (misses_ == 0) {
    return "NF4 base: " + std::to_string(hits_) + " groups read from " + dir_;
  }
  return "NF4 base: " + std::to_string(misses_) + " groups quantized" +
         (hits_ > 0 ? ", " + std::to_string(hits_) + " read from " + dir_ : "") +
         (writer_ && matches_ ? ", kept in " + dir_ : "");
}

}  // namespace strata::train
