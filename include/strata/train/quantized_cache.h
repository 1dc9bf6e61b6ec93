// QLoRA's quantized base kept between runs (finetune.quantized_cache), so a second run reads
// the NF4 bytes instead of reading the base and quantizing it again.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "strata/core/json.h"
#include "strata/core/status.h"
#include "strata/model/param_layout.h"
#include "strata/train/config.h"
#include "strata/zero/shard_store.h"

namespace strata::train {

// What a quantized base was made from: the format and compute dtype, and the model directory's
// config.json and weight files (name, size, modification time), or the seed and the inline
// config. Two runs with the same identity quantize to the same bytes.
Result<Json> quantized_base_identity(const TrainConfig& config);

// One directory per base: manifest.json (the identity) and one file of working-copy bytes per
// quantized group and tensor-parallel slice ("layers.N.nf4"; split over T ranks, each rank's
// "layers.N.tensor-R-of-T.nf4", so that the splits of one base share the directory). One rank
// claims the directory for the run's base before any rank opens it; a run then reads every file
// of the right size and writes the others. Files are written to a temporary name, synced and
// renamed, so a stopped run leaves each file whole or absent; a file of the wrong size is
// quantized again.
class QuantizedBaseCache final : public zero::WorkingCopyCache {
 public:
  // Makes `dir` this base's cache: where its manifest is another base's (or absent), removes that
  // base's files and writes `identity`'s manifest. One rank calls it, before every rank opens.
  static Status claim(const std::string& dir, const Json& identity);
  // `writer`: this rank writes its slice's groups (one rank of each tensor-parallel slice and
  // pipeline stage does; the others only read). `tensor`: the split, {1, 0} for none.
  static Result<std::unique_ptr<QuantizedBaseCache>> open(const std::string& dir,
                                                          const Json& identity, bool writer,
                                                          model::TensorParallel tensor);
  Result<bool> read(const model::ParamGroup& group, void* dst, std::uint64_t bytes) override;
  Status write(const model::ParamGroup& group, const void* src, std::uint64_t bytes) override;

  int hits() const { return hits_; }
  int misses() const { return misses_; }
  // "NF4 base: 32 groups read from DIR" or "... quantized (7 groups), kept in DIR".
  std::string describe() const;

 private:
  QuantizedBaseCache(std::string dir, bool matches, bool writer, model::TensorParallel tensor)
      : dir_(std::move(dir)), matches_(matches), writer_(writer), tensor_(tensor) {}
  std::string path_of(const model::ParamGroup& group) const;

  std::string dir_;
  bool matches_;  // the manifest on disk is this base's (else nothing is read or written)
  bool writer_;
  model::TensorParallel tensor_;
  int hits_ = 0, misses_ = 0;
};

}  // namespace strata::train
