// A communicator over one device's buffers through a communicator over host buffers: each call
// copies its device input to pinned host memory (after the work the compute stream holds before
// it), runs the host communicator there, and copies the result back to the device when its handle
// is waited for. Ranks that share one GPU in one process (NCCL puts no two ranks on one GPU) meet
// so over an in-process group; on the CPU backend the copies are plain copies.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/device/device.h"
#include "strata/dist/communicator.h"

namespace strata::testing {

class StagedCommunicator final : public dist::Communicator {
 public:
  // `host` moves its buffers in host memory (dist::make_in_process_group's members); `device`
  // owns the buffers callers pass and must outlive this communicator and its handles.
  StagedCommunicator(std::unique_ptr<dist::Communicator> host, device::Device& device)
      : host_(std::move(host)), device_(device), pool_(std::make_shared<Pool>(device)) {}

  int rank() const override { return host_->rank(); }
  int world_size() const override { return host_->world_size(); }
  std::string name() const override { return "staged " + host_->name(); }

  dist::CommHandle all_gather(const void* send, void* recv, std::int64_t count, DType dtype,
                              std::string_view what) override {
    const std::size_t n = bytes(count, dtype);
    return staged(send, n, recv, n * world(), n, [&](std::byte* in, std::byte* out) {
      return host_->all_gather(in, out, count, dtype, what);
    });
  }
  dist::CommHandle reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype,
                                  dist::ReduceOp op, std::string_view what) override {
    const std::size_t n = bytes(count, dtype);
    return staged(send, n * world(), recv, n, n * world(), [&](std::byte* in, std::byte* out) {
      return host_->reduce_scatter(in, out, count, dtype, op, what);
    });
  }
  dist::CommHandle reduce_scatter_wide(const void* send, float* recv, std::int64_t count,
                                       DType dtype, std::string_view what) override {
    const std::size_t n = bytes(count, dtype);
    return staged(send, n * world(), recv, bytes(count, DType::kF32), n * world(),
                  [&](std::byte* in, std::byte* out) {
                    return host_->reduce_scatter_wide(in, reinterpret_cast<float*>(out), count,
                                                      dtype, what);
                  });
  }
  dist::CommHandle all_reduce(const void* send, void* recv, std::int64_t count, DType dtype,
                              dist::ReduceOp op, std::string_view what) override {
    const std::size_t n = bytes(count, dtype);
    return staged(send, n, recv, n, n, [&](std::byte* in, std::byte* out) {
      return host_->all_reduce(in, out, count, dtype, op, what);
    });
  }
  dist::CommHandle broadcast(void* buffer, std::int64_t count, DType dtype, int root,
                             std::string_view what) override {
    const std::size_t n = bytes(count, dtype);
    return staged(buffer, n, buffer, n, 0, [&](std::byte* in, std::byte*) {
      return host_->broadcast(in, count, dtype, root, what);
    });
  }
  Status barrier(std::string_view what) override { return counted(host_->barrier(what)); }
  dist::CommHandle all_to_all_v(const void* send, std::span<const std::int64_t> send_counts,
                                void* recv, std::span<const std::int64_t> recv_counts, DType dtype,
                                std::string_view what) override {
    const auto total = [&](std::span<const std::int64_t> counts) {
      return bytes(std::accumulate(counts.begin(), counts.end(), std::int64_t{0}), dtype);
    };
    const std::size_t in_bytes = total(send_counts);
    return staged(send, in_bytes, recv, total(recv_counts), in_bytes,
                  [&](std::byte* in, std::byte* out) {
                    return host_->all_to_all_v(in, send_counts, out, recv_counts, dtype, what);
                  });
  }
  dist::CommHandle send(const void* buffer, std::int64_t count, DType dtype, int peer,
                        std::string_view what) override {
    return staged(buffer, bytes(count, dtype), nullptr, 0, 0, [&](std::byte* in, std::byte*) {
      return host_->send(in, count, dtype, peer, what);
    });
  }
  dist::CommHandle recv(void* buffer, std::int64_t count, DType dtype, int peer,
                        std::string_view what) override {
    return staged(nullptr, 0, buffer, bytes(count, dtype), 0, [&](std::byte*, std::byte* out) {
      return host_->recv(out, count, dtype, peer, what);
    });
  }
  Status connect(std::span<const int> peers, std::string_view what) override {
    return counted(host_->connect(peers, what));
  }
  Status all_reduce_host(double* values, int count, dist::ReduceOp op,
                         std::string_view what) override {
    return counted(host_->all_reduce_host(values, count, op, what));
  }
  Status all_gather_host(const std::uint64_t* send, std::uint64_t* recv, int count,
                         std::string_view what) override {
    return counted(host_->all_gather_host(send, recv, count, what));
  }
  Status gather_host(const void* send, void* recv, std::int64_t count, DType dtype, int root,
                     std::string_view what) override {
    return counted(host_->gather_host(send, recv, count, dtype, root, what));
  }
  Result<std::unique_ptr<dist::Communicator>> split(int color, int key, std::string_view what,
                                                    device::StreamKind stream) override {
    STRATA_ASSIGN_OR_RETURN(auto made, host_->split(color, key, what, stream));
    stats_ = host_->stats();
    return std::unique_ptr<dist::Communicator>(new StagedCommunicator(std::move(made), device_));
  }

 private:
  // Pinned staging buffers, each lent to one call until its handle is waited for and then kept
  // for the next call that fits in it (calls may be in flight together).
  class Pool {
   public:
    explicit Pool(device::Device& device) : device_(device) {}
    Result<device::PinnedBuffer> take(std::size_t need) {
      {
        std::lock_guard lock(mu_);
        auto fits = std::find_if(free_.begin(), free_.end(),
                                 [&](const device::PinnedBuffer& b) { return b.size() >= need; });
        if (fits != free_.end()) {
          device::PinnedBuffer b = std::move(*fits);
          free_.erase(fits);
          return b;
        }
      }
      return device_.allocate_pinned(std::max<std::size_t>(need, 4096), "staged collective");
    }
    void give(device::PinnedBuffer b) {
      std::lock_guard lock(mu_);
      free_.push_back(std::move(b));
    }

   private:
    device::Device& device_;
    std::mutex mu_;
    std::vector<device::PinnedBuffer> free_;
  };

  // A call in flight: its host handle and staging buffer; waiting copies the result back.
  struct Pending final : dist::CommHandle::State {
    Pending(dist::CommHandle h, device::Device& d, std::shared_ptr<Pool> p, device::PinnedBuffer b,
            void* o, std::size_t at, std::size_t n)
        : host(std::move(h)),
          device(d),
          pool(std::move(p)),
          buffer(std::move(b)),
          out(o),
          out_at(at),
          out_bytes(n) {}
    ~Pending() override {
      if (!buffer.empty()) pool->give(std::move(buffer));
    }
    Status wait() override {
      Status s = host.wait();
      if (s.is_ok() && out_bytes > 0) {
        device::Stream& compute = device.stream(device::StreamKind::kCompute);
        device.copy_to_device(out, buffer.as<std::byte>() + out_at, out_bytes, compute);
        compute.synchronize();
        s = device.last_error();
      }
      return s;
    }
    bool ready() override { return host.ready(); }

    dist::CommHandle host;
    device::Device& device;
    std::shared_ptr<Pool> pool;
    device::PinnedBuffer buffer;
    void* out;
    std::size_t out_at, out_bytes;
  };

  static std::size_t bytes(std::int64_t count, DType dtype) {
    return static_cast<std::size_t>(count) * dtype_size(dtype);
  }
  std::size_t world() const { return static_cast<std::size_t>(world_size()); }
  Status counted(Status s) {
    stats_ = host_->stats();
    return s;
  }

  // `in_bytes` of `in` to the staging buffer's start, then issue(start, start + out_at) on the
  // host communicator; the handle copies `out_bytes` from start + out_at to `out` when waited for.
  template <typename Issue>
  dist::CommHandle staged(const void* in, std::size_t in_bytes, void* out, std::size_t out_bytes,
                          std::size_t out_at, Issue&& issue) {
    auto buffer = pool_->take(std::max(in_bytes, out_at + out_bytes));
    if (!buffer.is_ok()) return dist::CommHandle::done(buffer.status());
    auto* host = buffer->as<std::byte>();
    device::Stream& compute = device_.stream(device::StreamKind::kCompute);
    if (in_bytes > 0) device_.copy_to_host(host, in, in_bytes, compute);
    compute.synchronize();
    if (Status s = device_.last_error(); !s.is_ok()) {
      pool_->give(std::move(*buffer));
      return dist::CommHandle::done(std::move(s));
    }
    dist::CommHandle h = issue(host, host + out_at);
    stats_ = host_->stats();
    return dist::CommHandle(std::make_shared<Pending>(std::move(h), device_, pool_,
                                                      std::move(*buffer), out, out_at, out_bytes));
  }

  std::unique_ptr<dist::Communicator> host_;
  device::Device& device_;
  std::shared_ptr<Pool> pool_;
};

}  // namespace strata::testing
