// 4-bit NormalFloat (NF4) with double quantization, as in QLoRA (Dettmers et al., 2023): a frozen
// weight of n elements is cut into blocks of 64; each element becomes the index of the nearest of
// 16 levels (the quantiles of N(0, 1), scaled to [-1, 1]) after dividing by its block's absolute
// maximum; the blocks' maxima are themselves quantized: less their mean, in groups of 256 blocks,
// each divided by its group's absolute maximum and stored as the index of the nearest of 256
// signed 8-bit dynamic floats (Dettmers' dynamic map, as bitsandbytes nests it). About 0.516
// bytes a parameter.
//
// One packed tensor is one contiguous byte string (Nf4Layout): the 4-bit codes, two per byte,
// element 2j in the high nibble; the blocks' 8-bit codes; one f32 scale per group; the f32 mean.
// Every step is defined by IEEE single operations (and the searches by midpoints formed in
// double), so tools/golden/nf4_golden.py reproduces the bytes and the dequantized values exactly.
#pragma once

#include <array>
#include <cstdint>

#include "strata/core/status.h"

namespace strata::device {

inline constexpr std::int64_t kNf4BlockElems = 64;    // elements under one absmax
inline constexpr std::int64_t kNf4AbsmaxGroup = 256;  // block maxima under one second-level scale

// The 16 NF4 levels, ascending (index 7 is 0): QLoRA's Appendix E values as f32.
inline constexpr std::array<float, 16> kNf4Levels = {-1.0f,
                                                     -0.6961928009986877f,
                                                     -0.5250730514526367f,
                                                     -0.39491748809814453f,
                                                     -0.28444138169288635f,
                                                     -0.18477343022823334f,
                                                     -0.09105003625154495f,
                                                     0.0f,
                                                     0.07958029955625534f,
                                                     0.16093020141124725f,
                                                     0.24611230194568634f,
                                                     0.33791524171829224f,
                                                     0.44070982933044434f,
                                                     0.5626170039176941f,
                                                     0.7229568362236023f,
                                                     1.0f};

// The 256 signed dynamic 8-bit values, ascending: for i = 0..6, the 2^i midpoints of
// linspace(0.1, 1, 2^i + 1) times 10^(i - 6), with both signs; then 0 and 1. Formed in double,
// rounded to f32.
const std::array<float, 256>& nf4_absmax_code();

// Where each part of a packed tensor of n elements lies, in bytes from its start.
struct Nf4Layout {
  std::int64_t elems = 0;
  std::int64_t blocks = 0;        // ceil(elems / 64)
  std::int64_t groups = 0;        // ceil(blocks / 256)
  std::uint64_t codes = 0;        // ceil(elems / 2) bytes of 4-bit codes
  std::uint64_t absmax = 0;       // `blocks` bytes of 8-bit codes
  std::uint64_t scales = 0;       // `groups` f32 (4-byte aligned)
  std::uint64_t mean = 0;         // one f32
  std::uint64_t total_bytes = 0;  // a multiple of 16
};
Nf4Layout nf4_layout(std::int64_t elems);
inline std::uint64_t nf4_bytes(std::int64_t elems) { return nf4_layout(elems).total_bytes; }

// Quantizes x[0, n) into `out` (nf4_bytes(n) bytes, every byte written). Fails, naming `what`
// and the element, on a value that is not finite.
Status nf4_quantize(const float* x, std::int64_t n, void* out, const char* what);

// The maxima of blocks [first, first + count) as the packed tensor stores them, decoded:
// code * group scale + mean, two f32 operations.
void nf4_block_absmax(const void* packed, std::int64_t n, std::int64_t first, std::int64_t count,
                      float* absmax);

// The 4-bit decode on the host: out[i] = level(code i) * absmax[block of i], one f32 product.
// The reference the device kernels are tested against.
void nf4_dequantize_reference(const void* packed, std::int64_t n, float* out);

}  // namespace strata::device
