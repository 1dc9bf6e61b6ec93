// NF4 with double quantization: the host quantizer, the block-max decode and the reference
// dequantizer (strata/device/nf4.h).
#include "strata/device/nf4.h"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace strata::device {
namespace {

std::uint64_t align16(std::uint64_t x) { return (x + 15) / 16 * 16; }

// Midpoints between neighbouring entries of an ascending table, in double.
template <std::size_t N>
std::array<double, N - 1> midpoints(const std::array<float, N>& t) {
  std::array<double, N - 1> m{};
  for (std::size_t j = 0; j + 1 < N; ++j) {
    m[j] = (static_cast<double>(t[j]) + static_cast<double>(t[j + 1])) / 2.0;
  }
  return m;
}

// The index of the nearest table entry: how many midpoints lie below v (a tie takes the lower).
template <std::size_t M>
std::uint8_t nearest(const std::array<double, M>& mids, float v) {
  const auto it = std::lower_bound(mids.begin(), mids.end(), static_cast<double>(v));
  return static_cast<std::uint8_t>(it - mids.begin());
}

std::array<float, 256> make_absmax_code() {
  constexpr double kPow10[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  std::vector<double> values;
  for (int i = 0; i < 7; ++i) {
    const int items = (1 << i) + 1;
    const double step = (1.0 - 0.1) / static_cast<double>(items - 1);
    for (int k = 0; k + 1 < items; ++k) {
      const double lo = 0.1 + static_cast<double>(k) * step;
      const double hi = 0.1 + static_cast<double>(k + 1) * step;
      const double mean = (lo + hi) / 2.0;
      values.push_back(kPow10[i] * mean);
      values.push_back(-(kPow10[i] * mean));
    }
  }
  values.push_back(0.0);
  values.push_back(1.0);
  std::array<float, 256> code{};
  for (std::size_t j = 0; j < code.size(); ++j) code[j] = static_cast<float>(values.at(j));
  std::sort(code.begin(), code.end());
  return code;
}

}  // namespace

const std::array<float, 256>& nf4_absmax_code() {
  static const std::array<float, 256> code = make_absmax_code();
  return code;
}

Nf4Layout nf4_layout(std::int64_t elems) {
  Nf4Layout l;
  l.elems = elems;
  l.blocks = (elems + kNf4BlockElems - 1) / kNf4BlockElems;
  l.groups = (l.blocks + kNf4AbsmaxGroup - 1) / kNf4AbsmaxGroup;
  l.codes = 0;
  l.absmax = align16(static_cast<std::uint64_t>(elems + 1) / 2);
  l.scales = align16(l.absmax + static_cast<std::uint64_t>(l.blocks));
  l.mean = l.scales + static_cast<std::uint64_t>(l.groups) * sizeof(float);
  l.total_bytes = align16(l.mean + sizeof(float));
  return l;
}

Status nf4_quantize(const float* x, std::int64_t n, void* out, const char* what) {
  const Nf4Layout l = nf4_layout(n);
  auto* bytes = static_cast<std::uint8_t*>(out);
  std::memset(bytes, 0, l.total_bytes);
  static const auto level_mids = midpoints(kNf4Levels);
  static const auto code_mids = midpoints(nf4_absmax_code());

  // The 4-bit codes, against each block's absolute maximum; groups of blocks in parallel (each
  // writes its own bytes: a block is 32 of them).
  std::vector<float> absmax(static_cast<std::size_t>(l.blocks));
  std::atomic<std::int64_t> first_bad{n};
  tbb::parallel_for(std::int64_t{0}, l.groups, [&](std::int64_t g) {
    const std::int64_t b_end = std::min(l.blocks, (g + 1) * kNf4AbsmaxGroup);
    for (std::int64_t b = g * kNf4AbsmaxGroup; b < b_end; ++b) {
      const std::int64_t begin = b * kNf4BlockElems;
      const std::int64_t end = std::min(n, begin + kNf4BlockElems);
      float m = 0.0f;
      for (std::int64_t i = begin; i < end; ++i) {
        if (!std::isfinite(x[i])) {
          std::int64_t seen = first_bad.load();
          while (i < seen && !first_bad.compare_exchange_weak(seen, i)) {
          }
          return;
        }
        m = std::max(m, std::fabs(x[i]));
      }
      absmax[static_cast<std::size_t>(b)] = m;
      for (std::int64_t i = begin; i < end; ++i) {
        const float v = m > 0.0f ? x[i] / m : 0.0f;
        const std::uint8_t c = nearest(level_mids, v);
        bytes[l.codes + static_cast<std::uint64_t>(i / 2)] |=
            static_cast<std::uint8_t>(i % 2 == 0 ? c << 4 : c);
      }
    }
  });
  if (const std::int64_t i = first_bad.load(); i < n) {
    return invalid_argument(std::string(what) + ": element " + std::to_string(i) + " is " +
                            std::to_string(x[i]) + "; NF4 quantization needs finite weights");
  }

  // The maxima: less their mean (summed in order, in double), in groups of 256 against each
  // group's absolute maximum.
  double sum = 0.0;
  for (const float a : absmax) sum += static_cast<double>(a);
  const float mean = l.blocks > 0 ? static_cast<float>(sum / static_cast<double>(l.blocks)) : 0.0f;
  std::memcpy(bytes + l.mean, &mean, sizeof mean);
  for (std::int64_t g = 0; g < l.groups; ++g) {
    const std::int64_t begin = g * kNf4AbsmaxGroup;
    const std::int64_t end = std::min(l.blocks, begin + kNf4AbsmaxGroup);
    float scale = 0.0f;
    for (std::int64_t b = begin; b < end; ++b) {
      scale = std::max(scale, std::fabs(absmax[static_cast<std::size_t>(b)] - mean));
    }
    std::memcpy(bytes + l.scales + static_cast<std::uint64_t>(g) * sizeof(float), &scale,
                sizeof scale);
    for (std::int64_t b = begin; b < end; ++b) {
      const float r = absmax[static_cast<std::size_t>(b)] - mean;
      bytes[l.absmax + static_cast<std::uint64_t>(b)] =
          nearest(code_mids, scale > 0.0f ? r / scale : 0.0f);
    }
  }
  return Status::ok();
}

void nf4_block_absmax(const void* packed, std::int64_t n, std::int64_t first, std::int64_t count,
                      float* absmax) {
  const Nf4Layout l = nf4_layout(n);
  const auto* bytes = static_cast<const std::uint8_t*>(packed);
  const auto& code = nf4_absmax_code();
  float mean = 0.0f;
  std::memcpy(&mean, bytes + l.mean, sizeof mean);
  for (std::int64_t b = first; b < first + count; ++b) {
    float scale = 0.0f;
    std::memcpy(&scale,
                bytes + l.scales + static_cast<std::uint64_t>(b / kNf4AbsmaxGroup) * sizeof(float),
                sizeof scale);
    const float scaled = code[bytes[l.absmax + static_cast<std::uint64_t>(b)]] * scale;
    absmax[b - first] = scaled + mean;
  }
}

void nf4_dequantize_reference(const void* packed, std::int64_t n, float* out) {
  const Nf4Layout l = nf4_layout(n);
  std::vector<float> absmax(static_cast<std::size_t>(l.blocks));
  nf4_block_absmax(packed, n, 0, l.blocks, absmax.data());
  const auto* codes = static_cast<const std::uint8_t*>(packed) + l.codes;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint8_t byte = codes[i / 2];
    const int c = i % 2 == 0 ? byte >> 4 : byte & 15;
    out[i] = kNf4Levels[static_cast<std::size_t>(c)] * absmax[static_cast<std::size_t>(i / 64)];
  }
}

}  // namespace strata::device
