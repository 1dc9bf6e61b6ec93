// QLoRA's quantized base kept between runs (finetune.quantized_cache), so a second run reads
// the NF4 bytes instead of reading the base and quantizing it again.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "strata/core/json.h"
#include "strata/core/status.h"
#include "strata/train/config.h"
#include "strata/zero/shard_store.h"

namespace strata::train {

// What a quantized base was made from: the format and compute dtype, and the model directory's
// config.json and weight files (name, size, modification time), or the seed and the inline
// config. Two runs with the same identity quantize to the same bytes.
Result<Json> quantized_base_identity(const TrainConfig& config);

// One directory per base: manifest.json (the identity) and one file of working-copy bytes per
// quantized group ("layers.N.nf4"). A run whose identity is the manifest's reads its groups from
// here; otherwise the first group it writes replaces the manifest, and with it whatever the
// directory held. Files are written to a temporary name, synced and renamed, so a stopped run
// leaves each file whole or absent; a file of the wrong size is quantized again.
class QuantizedBaseCache final : public zero::WorkingCopyCache {
 public:
  // `writer`: this rank writes (one rank per process group does; the others only read).
  static Result<std::unique_ptr<QuantizedBaseCache>> open(const std::string& dir, Json identity,
                                                          bool writer);
  Result<bool> read(const model::ParamGroup& group, void* dst, std::uint64_t bytes) override;
  Status write(const model::ParamGroup& group, const void* src, std::uint64_t bytes) override;

  int hits() const { return hits_; }
  int misses() const { return misses_; }
  // "NF4 base: 32 groups read from DIR" or "... quantized (7 groups), kept in DIR".
  std::string describe() const;

 private:
  QuantizedBaseCache(std::string dir, Json identity, bool matches, bool writer)
      : dir_(std::move(dir)), identity_(std::move(identity)), matches_(matches), writer_(writer) {}
  std::string path_of(const model::ParamGroup& group) const;

  std::string dir_;
  Json identity_;
  bool matches_;  // the manifest on disk is this base's
  bool writer_;
  int hits_ = 0, misses_ = 0;
};

}  // namespace strata::train
