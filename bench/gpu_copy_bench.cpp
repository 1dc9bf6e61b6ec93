// Host<->device copy bandwidth through the CUDA device's copy path (Device::copy_to_device /
// copy_to_host on its copy streams, from Device::allocate_pinned memory) against a plain
// cudaMemcpyAsync of the same size from cudaHostAlloc memory on a fresh stream, measured in the
// same run; plus the device path from pageable memory, for reference. Every size is verified by
// a round trip before it is timed.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "strata/core/aligned.h"
#include "strata/device/device.h"

namespace {

namespace dev = strata::device;

constexpr std::size_t kBytes = std::size_t{256} << 20;

enum class Path { kDevicePinned, kPlainPinned, kDevicePageable };
enum class Dir { kH2D, kD2H };

struct Fixture {
  std::unique_ptr<dev::Device> gpu;
  dev::DeviceBuffer buf;
  dev::PinnedBuffer pinned;    // the device path's host memory
  void* plain_host = nullptr;  // cudaHostAlloc, for the baseline
  strata::AlignedBuffer pageable;
  cudaStream_t plain_stream = nullptr;
  std::string error;

  ~Fixture() {
    if (plain_stream != nullptr) cudaStreamDestroy(plain_stream);
    if (plain_host != nullptr) cudaFreeHost(plain_host);
  }
};

bool fill_and_verify(Fixture& f, void* host, Path path) {
  auto* h = static_cast<unsigned char*>(host);
  for (std::size_t i = 0; i < kBytes; i += 4096) h[i] = static_cast<unsigned char>(i / 4096 * 7);
  std::vector<unsigned char> back(kBytes);
  if (path == Path::kPlainPinned) {
    cudaMemcpyAsync(f.buf.data(), host, kBytes, cudaMemcpyHostToDevice, f.plain_stream);
    cudaMemcpyAsync(back.data(), f.buf.data(), kBytes, cudaMemcpyDeviceToHost, f.plain_stream);
    if (cudaStreamSynchronize(f.plain_stream) != cudaSuccess) return false;
  } else {
    auto& h2d = f.gpu->stream(dev::StreamKind::kHostToDevice);
    auto& d2h = f.gpu->stream(dev::StreamKind::kDeviceToHost);
    f.gpu->copy_to_device(f.buf.data(), host, kBytes, h2d);
    f.gpu->wait_event(d2h, f.gpu->record_event(h2d));
    f.gpu->copy_to_host(back.data(), f.buf.data(), kBytes, d2h);
    d2h.synchronize();
    if (!f.gpu->last_error().is_ok()) return false;
  }
  for (std::size_t i = 0; i < kBytes; i += 4096) {
    if (back[i] != h[i]) return false;
  }
  return true;
}

void BM_Copy(benchmark::State& state, Fixture& f, Path path, Dir dir) {
  void* host = path == Path::kPlainPinned    ? f.plain_host
               : path == Path::kDevicePinned ? f.pinned.data()
                                             : static_cast<void*>(f.pageable.data());
  if (!fill_and_verify(f, host, path)) {
    state.SkipWithError("round-trip verification failed");
    return;
  }
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    if (path == Path::kPlainPinned) {
      if (dir == Dir::kH2D) {
        cudaMemcpyAsync(f.buf.data(), host, kBytes, cudaMemcpyHostToDevice, f.plain_stream);
      } else {
        cudaMemcpyAsync(host, f.buf.data(), kBytes, cudaMemcpyDeviceToHost, f.plain_stream);
      }
      cudaStreamSynchronize(f.plain_stream);
    } else {
      auto& s = f.gpu->stream(dir == Dir::kH2D ? dev::StreamKind::kHostToDevice
                                               : dev::StreamKind::kDeviceToHost);
      if (dir == Dir::kH2D) {
        f.gpu->copy_to_device(f.buf.data(), host, kBytes, s);
      } else {
        f.gpu->copy_to_host(host, f.buf.data(), kBytes, s);
      }
      s.synchronize();
    }
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(kBytes));
}

}  // namespace

int main(int argc, char** argv) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    std::printf("SKIPPED gpu_copy: no GPU (%s)\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "no devices");
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  Fixture f;
  dev::DeviceOptions o;
  o.kind = strata::device::DeviceKind::kCuda;
  o.memory_limit_bytes = kBytes + (std::size_t{64} << 20);
  auto d = dev::create_device(o);
  if (!d.is_ok()) {
    std::fprintf(stderr, "cannot create the CUDA device: %s\n", d.status().message().c_str());
    return 1;
  }
  f.gpu = std::move(d).value();
  auto buf = f.gpu->allocate(kBytes, "copy target");
  auto pinned = f.gpu->allocate_pinned(kBytes, "copy source");
  if (!buf.is_ok() || !pinned.is_ok() ||
      cudaHostAlloc(&f.plain_host, kBytes, cudaHostAllocDefault) != cudaSuccess ||
      cudaStreamCreateWithFlags(&f.plain_stream, cudaStreamNonBlocking) != cudaSuccess) {
    std::fprintf(stderr, "cannot allocate the copy buffers\n");
    return 1;
  }
  f.buf = std::move(buf).value();
  f.pinned = std::move(pinned).value();
  f.pageable = strata::AlignedBuffer(kBytes);
  const struct {
    const char* name;
    Path path;
  } paths[] = {{"device_pinned", Path::kDevicePinned},
               {"plain_cudaMemcpyAsync", Path::kPlainPinned},
               {"device_pageable", Path::kDevicePageable}};
  for (Dir dir : {Dir::kH2D, Dir::kD2H}) {
    for (const auto& p : paths) {
      const std::string name =
          std::string("BM_Copy/") + (dir == Dir::kH2D ? "h2d/" : "d2h/") + p.name + "/256MiB";
      benchmark::RegisterBenchmark(
          name.c_str(), [&f, path = p.path, dir](benchmark::State& s) { BM_Copy(s, f, path, dir); })
          ->UseManualTime()
          ->MinTime(0.5)
          ->Unit(benchmark::kMillisecond);
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  f.buf.reset();
  f.pinned.reset();
  return 0;
}
