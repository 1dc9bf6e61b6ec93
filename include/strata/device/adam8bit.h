// Block-wise 8-bit Adam moments (optimizer.state_dtype "int8"), after Dettmers et al., "8-bit
// Optimizers via Block-wise Quantization" (2022): a moment array of n elements is cut into blocks
// of kAdam8BlockElems; each block stores its absolute maximum as one f32 scale and each element
// as a byte, the index of the nearest value of a dynamic tree code after dividing by the scale.
//
// The dynamic tree code (the paper's section 2.2): after an optional sign bit, the number of
// leading zero bits z is a decimal exponent, the first one bit an indicator, and the k bits after
// it a linear fraction f, so a byte means 10^-z * (0.1 + 0.9 * (f + 1) / 2^k); all zero bits mean
// 0. The first moment uses the signed code (7 bits after the sign: 10^-6 .. 1 with both signs),
// the second the unsigned one (8 bits: 10^-7 .. 1) on its square root, the denominator Adam
// divides by, and a non-zero root never becomes zero (a zero there would turn a small update
// into m / eps). Both codes hold exactly 1 (and -1), so a block's largest element is stored
// exactly: dequantizing and quantizing again gives the same bytes and scale (a resume from a
// checkpoint's f32 moments changes nothing), as long as a second moment's dequantized value
// stays a normal f32 (v >= 1.2e-38; below, f32 itself has lost the bits).
//
// Quantizing a block: its scale a is the largest magnitude; each element is multiplied by the
// f32 reciprocal r = 1 / a (as bitsandbytes does: one division a block, not one an element) and
// its magnitude u = |x * r| takes the nearest of the code's magnitudes, a tie the smaller one; a
// negative element's byte is its magnitude's with the sign bit. A block whose largest magnitude
// is below f32's normal range (1.2e-38, where r would overflow) is stored as zeros: such moments
// move no weight (Adam's denominator is at least eps).
//
// Every operation is an IEEE single operation (the nearest-value searches compare against
// midpoints formed in double), so any implementation can reproduce the bytes.
#pragma once

#include <array>
#include <cstdint>

#include "strata/core/dtype.h"

namespace strata::device {

// 64 elements a block (bitsandbytes' 8-bit optimizers use 256, its 4-bit weights 64): every real
// model's hidden size is a multiple of 64, so a block never straddles two rows of a matrix (two
// tokens' embedding rows with independent statistics), and the loss curves of bench/RESULTS.md
// ("Issue 40, fourth part") fell within fp32 state's where blocks of 256 ended 1.3-1.9% above
// it; the scale costs 1/16 byte an element.
inline constexpr std::int64_t kAdam8BlockElems = 64;
// The moments' storage type in AdamWArgs::state_dtype (and the config's "int8"): bytes of code.
inline constexpr DType kAdam8StateDType = DType::kU8;

// The blocks of n elements (one f32 scale each).
inline std::int64_t adam8_blocks(std::int64_t n) {
  return (n + kAdam8BlockElems - 1) / kAdam8BlockElems;
}

// The value of each byte of the signed (first moment) and the unsigned (second moment's root)
// code, formed in double and rounded to f32.
const std::array<float, 256>& adam8_signed_code();
const std::array<float, 256>& adam8_unsigned_code();

// The nearest-value search of one code, for quantizers that run it themselves (CpuAdam's SIMD
// kernels). The code's magnitudes ascend with their bytes (without the sign bit), so the byte of
// the nearest magnitude is the number of thresholds below u, where a threshold is the double
// midpoint between neighbouring magnitudes rounded down to f32: u lies above the midpoint exactly
// when u > threshold. 2^bits magnitudes (bits: 7 signed, 8 unsigned), 2^bits - 1 thresholds.
//
// Short cuts for vector code, where each probe of a search from memory is a gather:
// - `level`: the thresholds of an 8-probe (7-probe) binary search by level, to be looked up in
//   registers: the level whose probe has n candidates (n = 1, 2, 4, .., 2^(bits-1)) holds them at
//   [n, 2n); after k is found to lie in [j * 2s, (j + 1) * 2s) with s = 2^(bits-1) / n, the probe
//   is k += s when level[n + j] < u.
// - `bucket` maps the top 16 bits of u (exponent and 7 mantissa bits) to the number of
//   thresholds below every u with those bits, and at most 2 more thresholds lie within such a
//   bucket, so the byte is bucket + (threshold[bucket] < u) + (threshold[bucket + 1] < u).
//   Magnitudes below 2^-21 (no threshold there but 0's neighbour's midpoint, which lies above)
//   share the first bucket.
// - `band_*` find the byte by arithmetic, with no search: the bytes of decimal band z (u in
//   (10^-(z+1), 10^-z], z < bits - 1) are 2^k - 1 + c with k = bits - 1 - z, where c counts the
//   band's thresholds below u, and those lie evenly at 10^-(z+1) + s * (j + 1/2), s = 0.9 *
//   10^-z / 2^k, so the byte is floor(x) for x = u / s + 2^k - 1/2 - 10^-(z+1) / s, which runs
//   from 2^k - 1/2 to 2^(k+1) - 1/2 over the band (the last band holds (0, 10^-(bits-1)], its
//   one threshold halfway to 0: x = u / s + 1/2). The band of u is the band of its binade's
//   least value, one less above the decimal boundary inside the binade (next to a boundary both
//   bands' formulas give the same byte).
//   x formed in f32 with one fused multiply-add (the constants rounded to f32) lies within 2^-16
//   of the integer it passes at each threshold of either code (a test checks every one), and x
//   rises with u within a band, so the byte is certain wherever x lies further than
//   kAdam8BandMargin (2^-10) from an integer; elsewhere (about 1 u in 500) a search decides.
inline constexpr std::int32_t kAdam8BucketLo = 0x3480;  // the top 16 bits of 2^-22
inline constexpr std::int32_t kAdam8BucketHi = 0x3f80;  // of 1.0
inline constexpr std::int32_t kAdam8Buckets = kAdam8BucketHi - kAdam8BucketLo + 1;
inline constexpr std::int32_t kAdam8BinadeLo = 96;  // the biased exponent of 2^-31
inline constexpr float kAdam8BandMargin = 1.0f / 1024;
struct Adam8Search {
  std::array<float, 258> threshold;   // +infinity past the last (read up to 2 past it)
  std::array<float, 256 + 16> level;  // (read up to 16 floats from each level's start)
  std::array<std::int32_t, kAdam8Buckets> bucket;
  // By binade: max(biased exponent of u - kAdam8BinadeLo, 0) (u <= 1: at most 31).
  std::array<std::int32_t, 32> binade_band;  // the band of the binade's least value
  std::array<float, 32> binade_boundary;     // u above it is one band up (+infinity: none)
  // By band z (16 entries, bits used): the byte is floor(u * slope + offset).
  std::array<float, 16> band_slope, band_offset;
};
const Adam8Search& adam8_search(bool second);  // the signed code's, or (second) the unsigned's
// The byte of magnitude u (the search above, 8 probes), for either code.
int adam8_nearest(const Adam8Search& s, float u);
// The reciprocal a block's elements are multiplied by: 1 / a, or 0 when its largest magnitude a
// is below f32's normal range (the block is stored as zeros, with scale 0).
float adam8_reciprocal(float a);

// Quantizes one block of n <= kAdam8BlockElems first-moment values into codes and *scale.
void adam8_quantize_m(const float* m, std::int64_t n, std::uint8_t* codes, float* scale);
// The second moment: v's square roots (v >= 0), quantized with the unsigned code.
void adam8_quantize_v(const float* v, std::int64_t n, std::uint8_t* codes, float* scale);
// m[i] = code(codes[i]) * scale; v[i] = s * s with s = code(codes[i]) * scale.
void adam8_dequantize_m(const std::uint8_t* codes, float scale, std::int64_t n, float* m);
void adam8_dequantize_v(const std::uint8_t* codes, float scale, std::int64_t n, float* v);

// Whole arrays (blocks from element 0; `scales` has adam8_blocks(n) entries).
void adam8_quantize_array(const float* x, std::int64_t n, bool second, std::uint8_t* codes,
                          float* scales);
void adam8_dequantize_array(const std::uint8_t* codes, const float* scales, std::int64_t n,
                            bool second, float* x);

}  // namespace strata::device
