// Helpers for CUDA backend tests: a fixture that skips with the probe's reason when there is no
// GPU, and device tensors that upload, download and poison host tensors. CUDA builds only.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "src/device/cuda/cuda_probe.h"
#include "tests/testing/gpu_rehearsal.h"
#include "tests/unit/device/ops_test_util.h"

namespace strata::device::testing {

inline constexpr std::uint64_t kGpuTestLimitBytes = std::uint64_t{4} << 30;

// Creates a CUDA device; Unavailable (no GPU) -> nullptr and `why` holds the probe's message.
// STRATA_CUDA_SYNC=1 in the environment makes every op synchronize and check, as it does for
// create_cuda_device(options), so a faulting kernel names its op in any test.
// Rehearsing (tests/testing/gpu_rehearsal.h) it gives a CPU device instead; only the tests that
// hold for any backend rehearse (not those of CUDA's own memory, streams and rounding).
inline std::unique_ptr<Device> make_gpu_device(std::string* why,
                                               const cuda::CudaTuning& tuning = {},
                                               std::uint64_t limit = kGpuTestLimitBytes) {
  if (strata::testing::rehearsing_gpu_tests()) return make_device();
  DeviceOptions o;
  o.kind = device::DeviceKind::kCuda;
  o.memory_limit_bytes = limit;
  cuda::CudaTuning t = tuning;
  t.sync_after_each_op = t.sync_after_each_op || cuda::sync_requested_by_environment();
  auto d = cuda::create_cuda_device(o, t);
  if (d.is_ok()) return std::move(d).value();
  *why = d.status().message();
  // Anything but "no GPU" on a machine with one is a real failure.
  EXPECT_EQ(d.status().code(), StatusCode::kUnavailable) << d.status().to_string();
  return nullptr;
}

// A device buffer of n elements of dtype with host round trips, all on the compute stream.
class GpuTensor {
 public:
  GpuTensor(Device& dev, DType dtype, std::int64_t n) : dev_(&dev), dtype_(dtype), n_(n) {
    auto b = dev.allocate(bytes() + 64, "test tensor");
    STRATA_CHECK(b.is_ok(), "test tensor allocation failed", b.status().to_string());
    buf_ = std::move(b).value();
  }
  GpuTensor(Device& dev, const HostTensor& h) : GpuTensor(dev, h.dtype(), h.size()) { upload(h); }

  void* data() const { return buf_.data(); }
  template <typename T>
  T* as() const {
    return buf_.as<T>();
  }
  std::size_t bytes() const { return static_cast<std::size_t>(n_) * dtype_size(dtype_); }

  void upload(const HostTensor& h) {
    STRATA_CHECK(h.size() == n_ && h.dtype() == dtype_, "shape mismatch");
    copy_in(h.data(), bytes());
  }
  HostTensor download() const {
    HostTensor h(dtype_, n_);
    auto& s = dev_->stream(StreamKind::kCompute);
    dev_->copy_to_host(h.data(), buf_.data(), bytes(), s);
    s.synchronize();
    return h;
  }
  // 0xFF bytes: NaN in f32, bf16 and f16, so any element an op fails to write is caught.
  void poison() {
    std::vector<unsigned char> ff(bytes(), 0xFF);
    copy_in(ff.data(), ff.size());
  }

 private:
  void copy_in(const void* src, std::size_t n) {
    auto& s = dev_->stream(StreamKind::kCompute);
    dev_->copy_to_device(buf_.data(), src, n, s);
    s.synchronize();
  }

  Device* dev_;
  DType dtype_;
  std::int64_t n_;
  DeviceBuffer buf_;
};

// Uploads and downloads plain arrays (ids, targets, lse, rstd).
template <typename T>
DeviceBuffer upload_array(Device& dev, const std::vector<T>& v) {
  auto b = dev.allocate(std::max<std::size_t>(v.size() * sizeof(T), 1), "test array");
  STRATA_CHECK(b.is_ok(), "test array allocation failed", b.status().to_string());
  auto& s = dev.stream(StreamKind::kCompute);
  dev.copy_to_device(b->data(), v.data(), v.size() * sizeof(T), s);
  s.synchronize();
  return std::move(b).value();
}
template <typename T>
std::vector<T> download_array(Device& dev, const DeviceBuffer& b, std::size_t n) {
  std::vector<T> v(n);
  auto& s = dev.stream(StreamKind::kCompute);
  dev.copy_to_host(v.data(), b.data(), n * sizeof(T), s);
  s.synchronize();
  return v;
}
inline DeviceBuffer poisoned_floats(Device& dev, std::size_t n) {
  return upload_array(dev, std::vector<float>(n, std::numeric_limits<float>::quiet_NaN()));
}

template <typename T>
std::vector<double> as_doubles(const std::vector<T>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// The fixture: a GPU device (or a skip that says why there is none) and the CPU reference.
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    gpu_ = make_gpu_device(&why, tuning());
    if (gpu_ == nullptr) GTEST_SKIP() << "no GPU: " << why;
    cpu_ = make_device();
  }
  void TearDown() override {
    if (gpu_ != nullptr) {
      const Status s = gpu_->last_error();
      EXPECT_TRUE(s.is_ok()) << "sticky CUDA error: " << s.to_string();
    }
  }
  virtual cuda::CudaTuning tuning() const { return {}; }

  const Ops& gpu_ops() const { return gpu_->ops(); }
  const Ops& cpu_ops() const { return cpu_->ops(); }
  void sync() { gpu_->stream(StreamKind::kCompute).synchronize(); }

  std::unique_ptr<Device> gpu_, cpu_;
};

}  // namespace strata::device::testing
