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
#include "strata/device/adam8bit.h"
#include "strata/device/ops.h"
#include "strata/optim/state_layout.h"

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

// An AdamState's master weights and moments stored as a compact setting lays them out (each
// array one buffer as optim::StateLayout says: bf16 master weights with their Kahan compensation
// plane, 8-bit moments with their block scales), filled from the state's f32 values.
struct PackedState {
  DType master_dtype = DType::kF32;
  device::MasterRounding rounding = device::MasterRounding::kStochastic;
  DType state_dtype = DType::kF32;
  std::int64_t n = 0;
  std::vector<std::byte> master, exp_avg, exp_avg_sq;

  PackedState(const AdamState& st, DType master_dtype_, device::MasterRounding rounding_,
              DType state_dtype_)
      : master_dtype(master_dtype_), rounding(rounding_), state_dtype(state_dtype_), n(st.n) {
    const StateLayout ml = master_layout(master_dtype, rounding);
    const StateLayout sl = moment_layout(state_dtype);
    master.assign(ml.bytes(n) + 1, std::byte{0});
    exp_avg.assign(sl.bytes(n) + 1, std::byte{0});
    exp_avg_sq.assign(sl.bytes(n) + 1, std::byte{0});
    const float* p = st.param.data() + st.offset;
    if (master_dtype == DType::kF32) {
      std::memcpy(master.data(), p, static_cast<std::size_t>(n) * 4);
    } else {
      auto* hi = reinterpret_cast<bf16*>(master.data());
      for (std::int64_t i = 0; i < n; ++i) hi[i] = f32_to_bf16(p[i]);
      if (ml.has_aux()) {
        auto* lo = reinterpret_cast<bf16*>(master.data() + ml.aux_offset(n));
        for (std::int64_t i = 0; i < n; ++i) {
          lo[i] =
              std::isfinite(p[i]) ? f32_to_bf16_toward_zero(p[i] - bf16_to_f32(hi[i])) : bf16{0};
        }
      }
    }
    pack_moment(st.exp_avg.data() + st.offset, false, exp_avg.data());
    pack_moment(st.exp_avg_sq.data() + st.offset, true, exp_avg_sq.data());
  }
  void pack_moment(const float* x, bool second, std::byte* out) const {
    const StateLayout sl = moment_layout(state_dtype);
    std::vector<float> v(x, x + n);
    if (second) {
      for (float& e : v) e = std::abs(e);
    }
    if (state_dtype == DType::kF32) {
      std::memcpy(out, v.data(), static_cast<std::size_t>(n) * 4);
    } else if (state_dtype == DType::kBF16) {
      auto* h = reinterpret_cast<bf16*>(out);
      for (std::int64_t i = 0; i < n; ++i) h[i] = f32_to_bf16(v[static_cast<std::size_t>(i)]);
    } else {
      for (float& e : v) {  // the block quantizer wants finite moments, as Adam makes them
        if (!std::isfinite(e)) e = 0;
      }
      device::adam8_quantize_array(v.data(), n, second, reinterpret_cast<std::uint8_t*>(out),
                                   reinterpret_cast<float*>(out + sl.aux_offset(n)));
    }
  }
  // The step's arguments over these buffers (`in`: read from them, out of place).
  void point(device::AdamWArgs& a) {
    a.master_dtype = master_dtype;
    a.master_rounding = rounding;
    a.state_dtype = state_dtype;
    a.param = master.data();
    a.exp_avg = exp_avg.data();
    a.exp_avg_sq = exp_avg_sq.data();
    attach_aux_planes(a, n, a.param, a.exp_avg, a.exp_avg_sq);
  }
  void point_in(device::AdamWArgs& a) const {
    a.param_in = master.data();
    a.exp_avg_in = exp_avg.data();
    a.exp_avg_sq_in = exp_avg_sq.data();
    attach_aux_planes_in(a, n, a.param_in, a.exp_avg_in, a.exp_avg_sq_in);
  }
  // Whether one array's stored bytes (its planes, not the padding between them) equal another's.
  static bool same(const std::vector<std::byte>& a, const std::vector<std::byte>& b,
                   const StateLayout& l, std::int64_t n) {
    if (std::memcmp(a.data(), b.data(), l.plane_bytes(n)) != 0) return false;
    return !l.has_aux() || std::memcmp(a.data() + l.aux_offset(n), b.data() + l.aux_offset(n),
                                       l.aux_plane_bytes(n)) == 0;
  }
  bool same_master(const PackedState& o) const {
    return same(master, o.master, master_layout(master_dtype, rounding), n);
  }
  bool same_moments(const PackedState& o) const {
    const StateLayout l = moment_layout(state_dtype);
    return same(exp_avg, o.exp_avg, l, n) && same(exp_avg_sq, o.exp_avg_sq, l, n);
  }
};

}  // namespace strata::optim::testing
