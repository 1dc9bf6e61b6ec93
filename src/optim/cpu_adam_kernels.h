// Kernel table shared by CpuAdam and its per-ISA translation units (scalar, AVX2, AVX-512).
//
// This header is included by files compiled with -mavx2/-mavx512* flags, so it must define no
// inline functions or templates: a function emitted in such a file could be picked by the
// linker for every caller and crash CPUs without those instructions. Plain data only.
#pragma once

#include <cstdint>

#include "strata/device/adamw_constants.h"

namespace strata::optim::detail {

enum GradKind : std::uint8_t { kGradF32 = 0, kGradBF16 = 1, kGradF16 = 2, kNumGradKinds = 3 };
enum OutKind : std::uint8_t {
  kOutNone = 0,
  kOutF32 = 1,
  kOutBF16 = 2,
  kOutF16 = 3,
  kNumOutKinds = 4
};

// Per-step constants: device::adamw_reference's own (device::adamw_constants). Trivial type.
using AdamConstants = device::AdamWConstants;

// One tile: every pointer already points at the tile's first element. The state is read from the
// *_in arrays and written to param, exp_avg and exp_avg_sq: the same arrays for a step in place,
// others for one out of place (the shadow state).
struct AdamTile {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* param_out;  // null when OutKind is kOutNone
  std::int64_t n;
  const float* param_in;
  const float* exp_avg_in;
  const float* exp_avg_sq_in;
};

// How far ahead of the element being updated the prefetching kernels ask for each input array's
// lines: about a memory latency's worth of one core's share of the bandwidth (100 ns at 10 GB/s
// per array is 1 KiB), so the lines arrive just before use without leaving the L1.
inline constexpr std::int64_t kPrefetchAheadBytes = 1024;

// Block-wise 8-bit moments (device/adam8bit.h): one code's nearest-value search as plain data
// (device::Adam8Search's arrays), and how the block is taken.
struct Quant8Search {
  // device::Adam8Search's, for the signed code's magnitudes (the first moment) or (second) the
  // unsigned code's (the second moment's root; a positive root never becomes 0).
  bool second;
  const float* threshold;  // 258, ascending; +infinity past the last
  const float* level;      // the thresholds by binary-search level (device::Adam8Search::level)
  // By the top 16 bits of u, clamped to [bucket_lo, bucket_hi]: the thresholds below.
  const std::int32_t* bucket;
  std::int32_t bucket_lo, bucket_hi;
  const float* value;  // each byte's value (device::adam8_signed_code / adam8_unsigned_code)
  // The byte by arithmetic (device::Adam8Search::band_*, binade_*; 32 and 16 entries).
  const std::int32_t* binade_band;
  const float* binade_boundary;
  const float* band_slope;
  const float* band_offset;
};

// The search of the first moment's code, or (second) of the second moment's.
Quant8Search quant8_search(bool second);

using AdamKernel = void (*)(const AdamConstants& c, const AdamTile& t);
// The master weights an 8-bit kernel keeps: f32, or bf16 with a bf16 Kahan compensation, or bf16
// rounded stochastically (optimizer.master_dtype and master_rounding).
enum MasterKind : std::uint8_t {
  kMasterF32 = 0,
  kMasterKahan = 1,
  kMasterStochastic = 2,
  kNumMasterKinds = 3
};
// A tile of 8-bit moments (device/adam8bit.h), from a block's first element: each array at the
// tile's first element, the moments' scales at its first block; n may end inside the last block.
// The state is read from the *_in arrays and written to the others (the same for a step in
// place).
struct Adam8Tile {
  void* param;  // f32, or bf16 (kMasterKahan, kMasterStochastic)
  const void* param_in;
  std::uint16_t* param_comp;  // kMasterKahan: the compensation
  const std::uint16_t* param_comp_in;
  const void* grad;
  void* param_out;  // null when OutKind is kOutNone
  std::uint8_t* exp_avg;
  float* exp_avg_scale;
  std::uint8_t* exp_avg_sq;
  float* exp_avg_sq_scale;
  const std::uint8_t* exp_avg_in;
  const float* exp_avg_scale_in;
  const std::uint8_t* exp_avg_sq_in;
  const float* exp_avg_sq_scale_in;
  std::int64_t n;
  // kMasterStochastic: the random bits of element j are splitmix64_at(seed, first + j)'s.
  std::uint64_t seed, first;
};
// Dequantizes, updates and quantizes again a block at a time in registers, the master weights
// widened, updated and stored as CpuAdam's chunks do (their compensation added, or rounded
// stochastically), the copy converted from the value stored: bit for bit the dequantizer, the f32
// kernel, the quantizer and the master weights' store (Dequant8Kernel, AdamKernel, Quant8Kernel,
// RoundStochasticKernel) one after the other.
using Adam8Kernel = void (*)(const AdamConstants& c, const Quant8Search& m, const Quant8Search& v,
                             const Adam8Tile& t);
// One block (n <= 256) quantized into codes and *scale: bit for bit device::adam8_quantize_m
// (second false) or adam8_quantize_v (second true), whose header says how.
using Quant8Kernel = void (*)(const Quant8Search& s, const float* x, std::int64_t n,
                              std::uint8_t* codes, float* scale);
// out[i] = value[codes[i]] * scale, squared when `square` (value: a code of 256 entries whose
// bytes with the sign bit, in the signed one, are the negated magnitudes and 0x80 is 0): bit for
// bit device::adam8_dequantize_m and adam8_dequantize_v.
using Dequant8Kernel = void (*)(const float* value, const std::uint8_t* codes, float scale,
                                std::int64_t n, bool square, float* out);
// bf16 master weights, stochastic rounding: dst[j] = f32_to_bf16_stochastic(p[j], the low 32
// bits of splitmix64_at(seed, first + j)), then p[j] = the value stored (the reference's loop).
using RoundStochasticKernel = void (*)(float* p, std::int64_t n, std::uint64_t seed,
                                       std::uint64_t first, std::uint16_t* dst);
using RooflineKernel = void (*)(const AdamTile& t);
using FiniteKernel = bool (*)(const void* grad, std::int64_t n);  // true: all finite

// Trivial type (no member initializers, so no constructor is ever emitted here): value-initialize
// it (`KernelSet set{};`) in generic code before filling it.
struct KernelSet {
  const char* name;
  // [grad kind][out kind][adamw_mode][nontemporal][prefetch]
  AdamKernel adam[kNumGradKinds][kNumOutKinds][2][2][2];
  // bf16 moments read and written in place of f32 ones (the tile's moment pointers point at
  // std::uint16_t), regular stores, no prefetch: [grad kind][out kind][adamw_mode]. Null where an
  // ISA has none (the caller then widens the moments into f32 scratch).
  AdamKernel adam_bf16_moments[kNumGradKinds][kNumOutKinds][2];
  // 8-bit moments, master weights and copy read and written by the kernel itself, regular
  // stores: [grad kind][out kind][adamw_mode][master kind]. Null where an ISA has none (the
  // caller then widens the state into f32 scratch and quantizes the moments back with quant8).
  Adam8Kernel adam8[kNumGradKinds][kNumOutKinds][2][kNumMasterKinds];
  // [grad kind][out kind][nontemporal][prefetch]
  RooflineKernel roofline[kNumGradKinds][kNumOutKinds][2][2];
  FiniteKernel all_finite[kNumGradKinds];
  Quant8Kernel quant8;
  Dequant8Kernel dequant8;
  RoundStochasticKernel round_stochastic;
};

// Fills `set` from one ISA's kernels. `K` is a struct in that ISA's file, in an anonymous
// namespace, with static constexpr variable templates naming its kernels. fill_adam_kernels takes
//   AdamKernel adam<G, O, kAdamW, kNT, kPrefetch>; AdamKernel adam_bf16_moments<G, O, kAdamW>
//   (may be null); RooflineKernel roofline<G, O, kNT, kPrefetch>; FiniteKernel all_finite<G>
// and fill_compact_kernels
//   Adam8Kernel adam8<G, O, kAdamW, kMaster> (may be null); Quant8Kernel quant8;
//   Dequant8Kernel dequant8; RoundStochasticKernel round_stochastic
// (fill_kernel_table: both from one struct). Its type has internal linkage, so every
// instantiation below is that file's own, compiled with its flags: nothing ISA-specific is
// emitted where another file could pick it up.
template <class K, int G, int O, bool kNT, bool kPF>
void fill_kernel_entry(KernelSet* set) {
  set->adam[G][O][0][kNT][kPF] = K::template adam<G, O, false, kNT, kPF>;
  set->adam[G][O][1][kNT][kPF] = K::template adam<G, O, true, kNT, kPF>;
  set->roofline[G][O][kNT][kPF] = K::template roofline<G, O, kNT, kPF>;
}
template <class K, int G, int O>
void fill_kernel_out(KernelSet* set) {
  fill_kernel_entry<K, G, O, false, false>(set);
  fill_kernel_entry<K, G, O, false, true>(set);
  fill_kernel_entry<K, G, O, true, false>(set);
  fill_kernel_entry<K, G, O, true, true>(set);
  set->adam_bf16_moments[G][O][0] = K::template adam_bf16_moments<G, O, false>;
  set->adam_bf16_moments[G][O][1] = K::template adam_bf16_moments<G, O, true>;
}
template <class K, int G>
void fill_kernel_grad(KernelSet* set) {
  fill_kernel_out<K, G, kOutNone>(set);
  fill_kernel_out<K, G, kOutF32>(set);
  fill_kernel_out<K, G, kOutBF16>(set);
  fill_kernel_out<K, G, kOutF16>(set);
  set->all_finite[G] = K::template all_finite<G>;
}
template <class K>
void fill_adam_kernels(KernelSet* set, const char* name) {
  set->name = name;
  fill_kernel_grad<K, kGradF32>(set);
  fill_kernel_grad<K, kGradBF16>(set);
  fill_kernel_grad<K, kGradF16>(set);
}

template <class K, int G, int O>
void fill_compact_out(KernelSet* set) {
  set->adam8[G][O][0][kMasterF32] = K::template adam8<G, O, false, kMasterF32>;
  set->adam8[G][O][1][kMasterF32] = K::template adam8<G, O, true, kMasterF32>;
  set->adam8[G][O][0][kMasterKahan] = K::template adam8<G, O, false, kMasterKahan>;
  set->adam8[G][O][1][kMasterKahan] = K::template adam8<G, O, true, kMasterKahan>;
  set->adam8[G][O][0][kMasterStochastic] = K::template adam8<G, O, false, kMasterStochastic>;
  set->adam8[G][O][1][kMasterStochastic] = K::template adam8<G, O, true, kMasterStochastic>;
}
template <class K, int G>
void fill_compact_grad(KernelSet* set) {
  fill_compact_out<K, G, kOutNone>(set);
  fill_compact_out<K, G, kOutF32>(set);
  fill_compact_out<K, G, kOutBF16>(set);
  fill_compact_out<K, G, kOutF16>(set);
}
template <class K>
void fill_compact_kernels(KernelSet* set) {
  set->quant8 = K::quant8;
  set->dequant8 = K::dequant8;
  set->round_stochastic = K::round_stochastic;
  fill_compact_grad<K, kGradF32>(set);
  fill_compact_grad<K, kGradBF16>(set);
  fill_compact_grad<K, kGradF16>(set);
}

template <class K>
void fill_kernel_table(KernelSet* set, const char* name) {
  fill_adam_kernels<K>(set, name);
  fill_compact_kernels<K>(set);
}

void fill_scalar_kernels(KernelSet* set);
// The scalar stochastic rounding (cpu_adam_scalar.cpp, no ISA flags): AVX2's too.
void round_stochastic_scalar(float* p, std::int64_t n, std::uint64_t seed, std::uint64_t first,
                             std::uint16_t* dst);
void fill_avx2_kernels(KernelSet* set);
// native_bf16: convert with vcvtneps2bf16 (needs avx512_bf16 at run time). Fills the compact
// states' kernels too, from cpu_adam_compact_avx512.cpp (fill_avx512_compact_kernels).
void fill_avx512_kernels(KernelSet* set, bool native_bf16);
void fill_avx512_compact_kernels(KernelSet* set, bool native_bf16);

}  // namespace strata::optim::detail
