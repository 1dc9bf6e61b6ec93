// safetensors files: a strict reader that validates the header against the file, and a
// streaming writer.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/status.h"

namespace strata::model {

struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  // byte offsets relative to the start of the data section
  std::uint64_t end = 0;
};

class SafetensorsReader {
 public:
  // Parses and validates the header: 8-byte length within the file, JSON object, known dtypes,
  // offsets inside the data section, end - begin == numel * dtype size, no overlaps. Every
  // problem is a data_loss error naming the file and the tensor.
  static Result<SafetensorsReader> open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  const SafetensorsEntry* find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Reads tensor `name` converting to `dst_dtype` (f32/bf16/f16 among each other; other dtypes
  // only to themselves). Checks that the shape equals `expected_shape`.
  Status read(const std::string& name, const std::vector<std::int64_t>& expected_shape, void* dst,
              DType dst_dtype) const;
  // The same for elements [begin, begin + count) of the tensor (row-major), into dst[0, count).
  Status read_range(const std::string& name, const std::vector<std::int64_t>& expected_shape,
                    std::int64_t begin, std::int64_t count, void* dst, DType dst_dtype) const;

 private:
  std::string path_;
  std::uint64_t data_offset_ = 0;
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Writes a safetensors file tensor by tensor without holding them all in memory: the header is
// computed from the declared tensors, then `fill` is called once per tensor in declaration order
// to produce its bytes. The file is written to a temporary name, fsynced and renamed.
class SafetensorsWriter {
 public:
  void add(const std::string& name, DType dtype, std::vector<std::int64_t> shape);
  void set_metadata(std::map<std::string, std::string> metadata) {
    metadata_ = std::move(metadata);
  }
  using FillFn = std::function<Status(const SafetensorsEntry& entry, void* dst)>;
  Status write(const std::string& path, const FillFn& fill) const;

 private:
  std::vector<SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace strata::model
