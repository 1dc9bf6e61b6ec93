// Element types and the half-precision conversions used everywhere (round to nearest even).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace strata {

enum class DType : std::uint8_t { kF32, kBF16, kF16, kU16, kU32, kI32, kI64, kU8 };

std::size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);  // "f32", "bf16", ...
// Parses Strata names ("f32", "bf16", "fp32") and safetensors names ("F32", "BF16", "F16").
std::optional<DType> parse_dtype(std::string_view name);
// safetensors spelling: "F32", "BF16", "F16", "U16", "U32", "I32", "I64", "U8".
std::string_view safetensors_dtype_name(DType dtype);

struct bf16 {
  std::uint16_t bits;
};
struct f16 {
  std::uint16_t bits;
};

inline float bf16_to_f32(bf16 h) { return std::bit_cast<float>(std::uint32_t{h.bits} << 16); }

inline bf16 f32_to_bf16(float f) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{static_cast<std::uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return bf16{static_cast<std::uint16_t>(u >> 16)};
}

// Stochastic rounding to bf16: up with probability equal to the fraction the truncation drops,
// drawn from the low 16 bits of `random` (unbiased: the expected result is f). NaN and
// infinity round as f32_to_bf16.
inline bf16 f32_to_bf16_stochastic(float f, std::uint32_t random) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7f800000u) == 0x7f800000u) return f32_to_bf16(f);
  return bf16{static_cast<std::uint16_t>((u + (random & 0xffffu)) >> 16)};
}

// Rounds a finite f32 toward zero to bf16 (drops the low 16 bits): Kahan-compensated master
// weights keep what rounding dropped this way, never more than it.
inline bf16 f32_to_bf16_toward_zero(float f) {
  return bf16{static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(f) >> 16)};
}

float f16_to_f32(f16 h);
f16 f32_to_f16(float f);

// Loads element i of a buffer of dtype f32/bf16/f16 as float.
inline float load_as_f32(const void* data, DType dtype, std::size_t i) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(data)[i];
    case DType::kBF16:
      return bf16_to_f32(static_cast<const bf16*>(data)[i]);
    case DType::kF16:
      return f16_to_f32(static_cast<const f16*>(data)[i]);
    default:
      return 0.0f;
  }
}

// Converts n elements between f32/bf16/f16 buffers (same dtype: memcpy). The scalar reference:
// hot paths use device::HostArrays (the same bits, vectorized and parallel).
void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::size_t n);

// A sum of squares is taken in chunks of kSumSquaresChunkElems elements counted from the start
// of the array, each summed in float64 by sum_squares_chunk in kSumSquaresLanes lanes (element i
// of the chunk in lane i % 8, each lane in order, the lanes added as a fixed tree), and the
// chunks' sums added exactly (an ExactSum): the same bits however the chunks are spread over
// threads, whatever the SIMD width, and however an array is cut into pieces at chunk boundaries.
// ZeRO's shards start on multiples of the chunk (zero::kShardAlignElems), so a gradient's norm
// has the same bits on any number of ranks. The CPU backend's sum_squares op and the host-side
// gradient sums (device::HostArrays) both do this, so a gradient norm is the same number whether
// its pieces were summed on the device or on the host.
inline constexpr std::size_t kSumSquaresChunkElems = 256;
inline constexpr std::size_t kSumSquaresLanes = 8;
// The scalar reference of one chunk; f32/bf16/f16.
double sum_squares_chunk(const void* x, DType dtype, std::size_t n);

}  // namespace strata
