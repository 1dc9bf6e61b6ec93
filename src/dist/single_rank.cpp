// The world-size-1 communicator: collectives are local copies on the compute stream.
#include <algorithm>
#include <cstring>
#include <memory>

#include "strata/device/device.h"
#include "strata/dist/communicator.h"

namespace strata::dist {
namespace {

class SingleRankCommunicator final : public Communicator {
 public:
  explicit SingleRankCommunicator(device::Device& device) : device_(device) {}
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string name() const override { return "single"; }

  CommHandle all_gather(const void* send, void* recv, std::int64_t count, DType dtype,
                        std::string_view) override {
    copy(send, recv, count, dtype);
    stats_.all_gather_bytes += static_cast<std::uint64_t>(count) * dtype_size(dtype);
    return {};
  }
  CommHandle reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype, ReduceOp,
                            std::string_view) override {
    copy(send, recv, count, dtype);
    stats_.reduce_scatter_bytes += static_cast<std::uint64_t>(count) * dtype_size(dtype);
    return {};
  }
  CommHandle reduce_scatter_wide(const void* send, float* recv, std::int64_t count, DType dtype,
                                 std::string_view) override {
    device_.ops().cast(send, dtype, recv, DType::kF32, count);
    stats_.reduce_scatter_bytes += static_cast<std::uint64_t>(count) * dtype_size(dtype);
    return {};
  }
  CommHandle all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, ReduceOp,
                        std::string_view) override {
    copy(send, recv, count, dtype);
    return {};
  }
  CommHandle broadcast(void*, std::int64_t, DType, int, std::string_view) override { return {}; }
  CommHandle all_to_all_v(const void* send, std::span<const std::int64_t> send_counts, void* recv,
                          std::span<const std::int64_t> recv_counts, DType dtype,
                          std::string_view what) override {
    if (Status s = check_all_to_all(*this, send_counts, recv_counts, what); !s.is_ok()) {
      return CommHandle::done(std::move(s));
    }
    if (send_counts[0] != recv_counts[0]) {
      return CommHandle::done(invalid_argument("rank 0: all_to_all_v '" + std::string(what) +
                                               "' sends " + std::to_string(send_counts[0]) +
                                               " elements to itself but receives " +
                                               std::to_string(recv_counts[0])));
    }
    ++stats_.collectives;
    copy(send, recv, send_counts[0], dtype);
    return {};
  }
  Status barrier(std::string_view) override { return Status::ok(); }
  CommHandle send(const void*, std::int64_t, DType, int peer, std::string_view what) override {
    return CommHandle::done(check_peer(*this, "send", peer, what));
  }
  CommHandle recv(void*, std::int64_t, DType, int peer, std::string_view what) override {
    return CommHandle::done(check_peer(*this, "recv", peer, what));
  }
  Status all_reduce_host(double*, int, ReduceOp, std::string_view) override { return Status::ok(); }
  Status all_gather_host(const std::uint64_t* send, std::uint64_t* recv, int count,
                         std::string_view) override {
    std::copy(send, send + count, recv);
    return Status::ok();
  }
  Result<std::unique_ptr<Communicator>> split(int, int, std::string_view,
                                              device::StreamKind) override {
    return std::unique_ptr<Communicator>(std::make_unique<SingleRankCommunicator>(device_));
  }
  Status gather_host(const void* send, void* recv, std::int64_t count, DType dtype, int,
                     std::string_view) override {
    if (send != recv) std::memcpy(recv, send, static_cast<std::size_t>(count) * dtype_size(dtype));
    return Status::ok();
  }

 private:
  void copy(const void* send, void* recv, std::int64_t count, DType dtype) {
    if (send != recv && count > 0) device_.ops().cast(send, dtype, recv, dtype, count);
  }
  device::Device& device_;
};

}  // namespace

std::unique_ptr<Communicator> make_single_rank_communicator(device::Device& device) {
  return std::make_unique<SingleRankCommunicator>(device);
}

}  // namespace strata::dist
