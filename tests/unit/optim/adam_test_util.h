// Shared helpers for the optim tests: random Adam state with hard values, a reference run, and
// byte comparisons that report the first differing element.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/rng.h"
#include "strata/device/ops.h"

namespace strata::optim::testing {

// Mostly ordinary magnitudes, with zeros, tiny, subnormal and huge values mixed in.
inline float hard_value(Rng& rng) {
  const double u = rng.uniform();
  const double x = rng.normal();
  if (u < 0.70) return static_cast<float>(x * std::pow(10.0, rng.uniform() * 4.0 - 3.0));
  if (u < 0.78) return static_cast<float>(x * 1e-30);
  if (u < 0.86) {  // f32 subnormal with a random sign
    return std::bit_cast<float>(static_cast<std::uint32_t>(rng.next_u64()) & 0x807fffffu);
  }
  if (u < 0.92) return static_cast<float>(x * 1e30);
  if (u < 0.96) return u < 0.94 ? 0.0f : -0.0f;
  return static_cast<float>(x * 1e4);
}

// A random finite half-precision bit pattern (every exponent but all-ones, so subnormals too).
inline std::uint16_t random_half_bits(Rng& rng, DType dtype) {
  const std::uint16_t exp_mask = dtype == DType::kBF16 ? 0x7f80 : 0x7c00;
  for (;;) {
    const auto b = static_cast<std::uint16_t>(rng.next_u64());
    if ((b & exp_mask) != exp_mask) return b;
  }
}

// One Adam problem over n elements; each array starts `offset` elements into its storage (the
// grad and output at other offsets) so SIMD paths see unaligned starts.
struct AdamState {
  std::int64_t n = 0;
  int offset = 0;
  DType grad_dtype = DType::kF32;
  DType out_dtype = DType::kF32;
  bool has_out = true;
  std::vector<float> param, exp_avg, exp_avg_sq;
  std::vector<std::byte> grad, out;

  float* p() { return param.data() + offset; }
  float* m() { return exp_avg.data() + offset; }
  float* v() { return exp_avg_sq.data() + offset; }
  std::byte* g() { return grad.data() + grad_offset_bytes(); }
  std::byte* o() { return has_out ? out.data() + out_offset_bytes() : nullptr; }
  std::size_t grad_offset_bytes() const {
    return static_cast<std::size_t>(offset * 3 % 16) * dtype_size(grad_dtype);
  }
  std::size_t out_offset_bytes() const {
    return static_cast<std::size_t>(offset * 5 % 16) * dtype_size(out_dtype);
  }

  device::AdamWArgs args(const device::AdamWArgs& hyper) {
    device::AdamWArgs a = hyper;
    a.param = p();
    a.grad = g();
    a.grad_dtype = grad_dtype;
    a.exp_avg = m();
    a.exp_avg_sq = v();
    a.n = n;
    a.param_out = o();
    a.out_dtype = out_dtype;
    return a;
  }
};

inline AdamState make_state(std::int64_t n, int offset, DType grad_dtype, DType out_dtype,
                            bool has_out, std::uint64_t seed) {
  Rng rng(seed);
  AdamState s;
  s.n = n;
  s.offset = offset;
  s.grad_dtype = grad_dtype;
  s.out_dtype = out_dtype;
  s.has_out = has_out;
  const auto total = static_cast<std::size_t>(n + 16);
  s.param.resize(total);
  s.exp_avg.resize(total);
  s.exp_avg_sq.resize(total);
  for (std::size_t i = 0; i < total; ++i) {
    s.param[i] = hard_value(rng);
    s.exp_avg[i] = hard_value(rng);
    s.exp_avg_sq[i] = std::abs(hard_value(rng));
  }
  s.grad.resize(total * dtype_size(grad_dtype));
  for (std::size_t i = 0; i < total; ++i) {
    if (grad_dtype == DType::kF32) {
      const float x = hard_value(rng);
      std::memcpy(s.grad.data() + i * 4, &x, 4);
    } else {
      const std::uint16_t b = random_half_bits(rng, grad_dtype);
      std::memcpy(s.grad.data() + i * 2, &b, 2);
    }
  }
  s.out.resize(total * dtype_size(out_dtype));
  for (auto& b : s.out) b = static_cast<std::byte>(rng.next_u64());
  return s;
}

inline device::AdamWArgs hyper(bool adamw_mode, float grad_scale, std::int64_t step = 3) {
  device::AdamWArgs a;
  a.lr = 1e-2f;
  a.beta1 = 0.9f;
  a.beta2 = 0.999f;
  a.eps = 1e-8f;
  a.weight_decay = 0.05f;
  a.grad_scale = grad_scale;
  a.step = step;
  a.adamw_mode = adamw_mode;
  return a;
}

// "" when equal, else where and what differs.
inline std::string compare_bytes(const char* what, const void* got, const void* want,
                                 std::size_t elem_bytes, std::int64_t n) {
  const auto* a = static_cast<const unsigned char*>(got);
  const auto* b = static_cast<const unsigned char*>(want);
  const std::size_t total = elem_bytes * static_cast<std::size_t>(n);
  if (total == 0 || std::memcmp(a, b, total) == 0) return "";
  for (std::size_t i = 0; i < total; i += elem_bytes) {
    if (std::memcmp(a + i, b + i, elem_bytes) != 0) {
      std::uint32_t x = 0, y = 0;
      std::memcpy(&x, a + i, elem_bytes);
      std::memcpy(&y, b + i, elem_bytes);
      char buf[160];
      std::snprintf(buf, sizeof(buf), "%s differs at element %zu: got 0x%08x, want 0x%08x", what,
                    i / elem_bytes, x, y);
      return buf;
    }
  }
  return "";
}

// Every array of `got` against `want`, padding included (so a write past the span shows).
// Element indices in the message count from the start of the storage.
inline std::string compare_states(const AdamState& got, const AdamState& want) {
  const auto total = static_cast<std::int64_t>(got.param.size());
  std::string r = compare_bytes("param", got.param.data(), want.param.data(), 4, total);
  if (r.empty()) r = compare_bytes("exp_avg", got.exp_avg.data(), want.exp_avg.data(), 4, total);
  if (r.empty()) {
    r = compare_bytes("exp_avg_sq", got.exp_avg_sq.data(), want.exp_avg_sq.data(), 4, total);
  }
  if (r.empty()) {
    r = compare_bytes("param_out", got.out.data(), want.out.data(), dtype_size(got.out_dtype),
                      total);
  }
  if (r.empty())
    r = compare_bytes("grad", got.grad.data(), want.grad.data(), 1,
                      static_cast<std::int64_t>(got.grad.size()));
  return r;
}

}  // namespace strata::optim::testing
