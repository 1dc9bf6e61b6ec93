// A .safetensors file (a model's weights, an adapter, an optimizer shard): the header parsed and
// checked against the file, then every tensor read in its own dtype and, for the float dtypes,
// converted to f32.
#include <vector>

#include "strata/core/dtype.h"
#include "strata/model/safetensors.h"
#include "tests/fuzz/fuzz_target.h"

STRATA_FUZZ_TARGET(safetensors) {
  using strata::DType;
  const std::string path =
      strata::fuzz::write_input("model.safetensors", strata::fuzz::as_text(data));
  auto reader = strata::model::SafetensorsReader::open(path);
  if (!reader.is_ok()) return;
  std::vector<std::byte> buffer;
  for (const auto& e : reader->entries()) {
    // The header was checked against the file, so no tensor is larger than the input.
    buffer.resize(e.end - e.begin + 1);
    (void)reader->read(e.name, e.shape, buffer.data(), e.dtype);
    if (e.dtype == DType::kF32 || e.dtype == DType::kBF16 || e.dtype == DType::kF16) {
      std::int64_t numel = 1;
      for (const auto d : e.shape) numel *= d;
      buffer.resize(static_cast<std::size_t>(numel) * sizeof(float) + 1);
      (void)reader->read(e.name, e.shape, buffer.data(), DType::kF32);
      if (numel > 1) {
        (void)reader->read_range(e.name, e.shape, 1, numel - 1, buffer.data(), DType::kF32);
      }
    }
  }
}
