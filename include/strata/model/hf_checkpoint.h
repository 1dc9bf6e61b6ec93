// Hugging Face checkpoint directories: config.json + model.safetensors, or sharded
// model-0000i-of-0000n.safetensors with model.safetensors.index.json.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/model/llama_config.h"
#include "strata/model/param_layout.h"
#include "strata/model/safetensors.h"

namespace strata::model {

class HfCheckpointReader {
 public:
  // Reads config.json and indexes every tensor (through the index file when present). Missing
  // files, malformed JSON or an index naming a missing shard are errors naming the file.
  static Result<HfCheckpointReader> open(const std::string& dir);
  // The model config of the checkpoint in `dir` (its config.json) alone, without its tensors.
  static Result<LlamaConfig> read_config(const std::string& dir);

  const LlamaConfig& config() const { return config_; }
  // Checks that every tensor the layout needs is present with the right shape, and that no
  // unexpected tensor is present (rotary inv_freq buffers and a redundant lm_head.weight under
  // tied embeddings are tolerated). Reports all problems at once.
  Status validate(const ParamLayout& layout) const;
  // Fills the group's flat f32 buffer (padding zeroed) from the checkpoint.
  Status read_group(const ParamGroup& group, float* dst) const;
  // Elements [begin, begin + count) of that buffer, into dst[0, count).
  Status read_group_range(const ParamGroup& group, std::int64_t begin, std::int64_t count,
                          float* dst) const;

 private:
  std::string dir_;
  LlamaConfig config_;
  std::vector<std::shared_ptr<SafetensorsReader>> files_;
  std::map<std::string, std::size_t> tensor_file_;  // tensor name -> index in files_
};

// Elements [a, a + count) of `t` (a tensor-parallel slice, or whole) as f32 into
// dst[0, count): its rows, or each row's columns, read from the whole tensor `name` in `file`.
Status read_slice(const SafetensorsReader& file, const std::string& name, const TensorSpec& t,
                  std::int64_t a, std::int64_t count, float* dst);

// Writes an HF checkpoint directory `dir` (created if needed): config.json and
// model.safetensors with tensors in `dtype`. `read_group` supplies each group's flat f32 values.
// Files are written atomically.
using GroupSource = std::function<Status(const ParamGroup& group, float* dst)>;
// Elements [begin, begin + count) of what a GroupSource writes, into dst[0, count): loading a
// large frozen group a piece at a time.
using GroupRangeSource = std::function<Status(const ParamGroup& group, std::int64_t begin,
                                              std::int64_t count, float* dst)>;
// A group's values from two sources: the tensors `pick` selects from `picked`, the others from
// `others`. Each source is handed the group with only its own tensors (the same id, size and
// offsets) and fills those and zeroes the rest, as every GroupSource does.
GroupSource split_source(std::function<bool(const TensorSpec&)> pick, GroupSource picked,
                         GroupSource others);
Status write_hf_checkpoint(const std::string& dir, const LlamaConfig& config,
                           const ParamLayout& layout, DType dtype, const GroupSource& read_group);

}  // namespace strata::model
