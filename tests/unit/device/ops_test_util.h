// Helpers for op tests: typed host tensors with random fill and NaN poisoning, tolerance checks.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/rng.h"
#include "strata/device/device.h"

namespace strata::device::testing {

// A tensor of f32/bf16/f16 elements in host memory (which is device memory on the CPU backend).
class HostTensor {
 public:
  HostTensor(DType dtype, std::int64_t n)
      : dtype_(dtype), n_(n), bytes_(static_cast<std::size_t>(n) * dtype_size(dtype) + 64) {}

  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(bytes_.data());
  }
  std::int64_t size() const { return n_; }
  DType dtype() const { return dtype_; }

  double get(std::int64_t i) const {
    return load_as_f32(bytes_.data(), dtype_, static_cast<std::size_t>(i));
  }
  void set(std::int64_t i, double v) {
    const float f = static_cast<float>(v);
    convert(&f, DType::kF32, bytes_.data() + i * dtype_size(dtype_), dtype_, 1);
  }
  // Uniform in [lo, hi), rounded to the dtype.
  void fill_uniform(Rng& rng, double lo, double hi) {
    for (std::int64_t i = 0; i < n_; ++i) set(i, lo + (hi - lo) * rng.uniform());
  }
  void poison() {
    for (std::int64_t i = 0; i < n_; ++i) set(i, std::numeric_limits<double>::quiet_NaN());
  }
  std::vector<double> values() const {
    std::vector<double> v(static_cast<std::size_t>(n_));
    for (std::int64_t i = 0; i < n_; ++i) v[static_cast<std::size_t>(i)] = get(i);
    return v;
  }
  bool bitwise_equal(const HostTensor& o) const {
    return n_ == o.n_ && dtype_ == o.dtype_ &&
           std::memcmp(bytes_.data(), o.bytes_.data(),
                       static_cast<std::size_t>(n_) * dtype_size(dtype_)) == 0;
  }

 private:
  DType dtype_;
  std::int64_t n_;
  std::vector<std::byte> bytes_;
};

inline double rms(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return v.empty() ? 0.0 : std::sqrt(s / static_cast<double>(v.size()));
}

// Every element within rtol * max(|want_i|, rms(want)): relative where values are large,
// absolute (scaled to the tensor) where they cancel to near zero. NaN always fails.
inline void expect_close(const std::string& what, const std::vector<double>& got,
                         const std::vector<double>& want, double rtol) {
  ASSERT_EQ(got.size(), want.size()) << what;
  const double floor = std::max(rms(want), 1e-30);
  int failures = 0;
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double tol = rtol * std::max(std::abs(want[i]), floor);
    const double err = std::abs(got[i] - want[i]);
    if (!(err <= tol)) {
      if (++failures <= 5) {
        ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i] << " (tol "
                      << tol << ")";
      }
    }
    if (err / std::max(std::abs(want[i]), floor) > worst)
      worst = err / std::max(std::abs(want[i]), floor);
  }
  EXPECT_EQ(failures, 0) << what << ": " << failures << " of " << got.size()
                         << " elements out of tolerance " << rtol << ", worst " << worst;
}

// Bound on the relative error, against sum|terms|, of a sum of n terms accumulated in f32 in any
// order: the worst case (n - 1) u, or for long sums the probabilistic lambda sqrt(n) u of Higham
// and Mary (2019), which holds with overwhelming probability at lambda = 6 and is the tighter
// of the two beyond 36 terms (up to 5.5x at the sizes tested); plus 2u for the roundings around
// the sum (products, scaling).
inline double f32_sum_error(std::int64_t n) {
  constexpr double kU = 0x1p-24;
  const double terms = static_cast<double>(std::max<std::int64_t>(n, 1));
  return std::min(terms, 6.0 * std::sqrt(terms)) * kU + 2 * kU;
}

// Every element within its own bound: |got_i - want_i| <= bound_i, for bounds derived from the
// arithmetic that produced got (see the attention test). NaN always fails.
inline void expect_within(const std::string& what, const std::vector<double>& got,
                          const std::vector<double>& want, const std::vector<double>& bound) {
  ASSERT_EQ(got.size(), want.size()) << what;
  ASSERT_EQ(bound.size(), want.size()) << what;
  int failures = 0;
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(got[i] - want[i]);
    if (!(err <= bound[i])) {
      if (++failures <= 5) {
        ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i]
                      << " (bound " << bound[i] << ")";
      }
    }
    if (bound[i] > 0) worst = std::max(worst, err / bound[i]);
  }
  EXPECT_EQ(failures, 0) << what << ": " << failures << " of " << got.size()
                         << " elements out of their bounds, worst " << worst << "x";
}

inline double tolerance(DType dtype) { return dtype == DType::kF32 ? 1e-5 : 1e-2; }

inline std::unique_ptr<Device> make_device(int threads = 0, std::uint64_t limit = 0) {
  DeviceOptions o;
  o.kind = device::DeviceKind::kCpu;
  o.compute_threads = threads;
  o.memory_limit_bytes = limit;
  auto d = create_device(o);
  STRATA_CHECK(d.is_ok(), "cannot create the CPU device", d.status().to_string());
  return std::move(d).value();
}

// Central finite differences of a double-precision scalar function at x, all coordinates.
template <typename Fn>
std::vector<double> numeric_grad(Fn&& f, std::vector<double> x, double step = 1e-6) {
  std::vector<double> g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + step;
    const double up = f(x);
    x[i] = x0 - step;
    const double down = f(x);
    x[i] = x0;
    g[i] = (up - down) / (2 * step);
  }
  return g;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

}  // namespace strata::device::testing
