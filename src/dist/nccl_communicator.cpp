// NCCL communicator for the CUDA backend: device collectives on the device's collective stream,
// so they overlap the compute stream's kernels (each waits, on the GPU, for the compute work
// issued before it: the data it sends), bootstrapped and backed for host-side control data by
// MPI, or by nothing in a single process. Built when CUDA and NCCL are found.
#include "strata/build_config.h"

#if STRATA_HAVE_NCCL

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "src/dist/mpi_communicator.h"
#include "src/dist/nccl_communicator.h"
#include "strata/core/check.h"
#include "strata/device/device.h"

namespace strata::dist {
namespace {

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF16:
      return ncclFloat16;
    case DType::kI32:
      return ncclInt32;
    case DType::kU8:
      return ncclUint8;
    case DType::kF32:
      return ncclFloat32;
    default:
      // Another width would move the wrong number of bytes.
      STRATA_CHECK(false, "NCCL collectives take f32, bf16, f16, i32 or u8, not",
                   dtype_name(dtype));
      return ncclFloat32;
  }
}

// The NCCL communicator, shared by the communicator and every handle on one of its collectives
// (a handle may be waited on after the communicator is gone). Aborted at most once, and never
// destroyed after an abort: ncclCommAbort frees what ncclCommDestroy would.
class NcclComm {
 public:
  explicit NcclComm(ncclComm_t comm) : comm_(comm) {}
  ~NcclComm() {
    if (!aborted_.load()) ncclCommDestroy(comm_);
  }
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  ncclComm_t get() const { return comm_; }
  bool aborted() const { return aborted_.load(); }
  // Unblocks the collectives still queued on the stream, so the process can go on or exit.
  void abort() {
    if (!aborted_.exchange(true)) ncclCommAbort(comm_);
  }

 private:
  ncclComm_t comm_;
  std::atomic<bool> aborted_{false};
};

// Completion of a collective enqueued on a CUDA stream: an event polled against a deadline.
class NcclHandleState final : public CommHandle::State {
 public:
  NcclHandleState(cudaEvent_t event, std::shared_ptr<NcclComm> comm, std::string what, int rank,
                  std::chrono::steady_clock::time_point deadline)
      : event_(event),
        comm_(std::move(comm)),
        what_(std::move(what)),
        rank_(rank),
        deadline_(deadline) {}
  ~NcclHandleState() override { cudaEventDestroy(event_); }
  bool ready() override { return cudaEventQuery(event_) != cudaErrorNotReady; }
  Status wait() override {
    auto sleep = std::chrono::microseconds(0);
    for (;;) {
      const cudaError_t q = cudaEventQuery(event_);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) {
        return internal_error("rank " + std::to_string(rank_) + ": " + what_ +
                              " failed: " + cudaGetErrorString(q));
      }
      if (comm_->aborted()) {
        return unavailable("rank " + std::to_string(rank_) + ": " + what_ +
                           " was cut short: an earlier collective timed out and aborted NCCL");
      }
      ncclResult_t async_err = ncclSuccess;
      ncclCommGetAsyncError(comm_->get(), &async_err);
      if (async_err != ncclSuccess) {
        return internal_error("rank " + std::to_string(rank_) + ": " + what_ +
                              " failed: " + ncclGetErrorString(async_err));
      }
      if (std::chrono::steady_clock::now() > deadline_) {
        comm_->abort();
        return unavailable("rank " + std::to_string(rank_) + ": " + what_ +
                           " did not complete in time; a peer rank may have died or be stuck");
      }
      if (sleep < std::chrono::microseconds(500)) sleep += std::chrono::microseconds(10);
      std::this_thread::sleep_for(sleep);
    }
    return Status::ok();
  }

 private:
  cudaEvent_t event_;
  std::shared_ptr<NcclComm> comm_;
  std::string what_;
  int rank_;
  std::chrono::steady_clock::time_point deadline_;
};

class NcclCommunicator final : public Communicator {
 public:
  // `compute` and `stream` are the device's compute and collective streams (the device's frees
  // wait for the collective stream's work too); `ready` (owned) orders each collective after the
  // compute work issued before it.
  NcclCommunicator(std::unique_ptr<Communicator> host, std::shared_ptr<NcclComm> comm,
                   cudaStream_t compute, cudaStream_t stream, cudaEvent_t ready,
                   std::chrono::seconds timeout)
      : host_(std::move(host)),
        comm_(std::move(comm)),
        compute_(compute),
        stream_(stream),
        ready_(ready),
        timeout_(timeout) {}
  ~NcclCommunicator() override {
    // Collectives still queued finish before the communicator goes, or are aborted when they
    // do not within the timeout (a peer that died would otherwise hang the exit).
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (!comm_->aborted() && cudaStreamQuery(stream_) == cudaErrorNotReady) {
      if (std::chrono::steady_clock::now() > deadline) {
        comm_->abort();
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    cudaEventDestroy(ready_);
  }

  int rank() const override { return host_->rank(); }
  int world_size() const override { return host_->world_size(); }
  std::string name() const override { return "nccl"; }

  CommHandle all_gather(const void* send, void* recv, std::int64_t count, DType dtype,
                        std::string_view what) override {
    count_bytes(&CommStats::all_gather_bytes, count * world_size(), dtype);
    if (!after_compute()) return failed("all_gather", what, "cudaStreamWaitEvent");
    return finish(ncclAllGather(send, recv, static_cast<std::size_t>(count), nccl_type(dtype),
                                comm_->get(), stream_),
                  "all_gather", what);
  }
  CommHandle reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype,
                            ReduceOp op, std::string_view what) override {
    count_bytes(&CommStats::reduce_scatter_bytes, count * world_size(), dtype);
    if (!after_compute()) return failed("reduce_scatter", what, "cudaStreamWaitEvent");
    return finish(
        ncclReduceScatter(send, recv, static_cast<std::size_t>(count), nccl_type(dtype),
                          op == ReduceOp::kAvg ? ncclAvg : ncclSum, comm_->get(), stream_),
        "reduce_scatter", what);
  }
  CommHandle all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, ReduceOp op,
                        std::string_view what) override {
    count_bytes(&CommStats::all_reduce_bytes, count, dtype);
    if (!after_compute()) return failed("all_reduce", what, "cudaStreamWaitEvent");
    return finish(ncclAllReduce(send, recv, static_cast<std::size_t>(count), nccl_type(dtype),
                                op == ReduceOp::kAvg ? ncclAvg : ncclSum, comm_->get(), stream_),
                  "all_reduce", what);
  }
  CommHandle broadcast(void* buffer, std::int64_t count, DType dtype, int root,
                       std::string_view what) override {
    ++stats_.collectives;
    if (!after_compute()) return failed("broadcast", what, "cudaStreamWaitEvent");
    return finish(ncclBroadcast(buffer, buffer, static_cast<std::size_t>(count), nccl_type(dtype),
                                root, comm_->get(), stream_),
                  "broadcast", what);
  }
  Status barrier(std::string_view what) override { return host_->barrier(what); }
  Status all_reduce_host(double* values, int count, ReduceOp op, std::string_view what) override {
    return host_->all_reduce_host(values, count, op, what);
  }
  Status all_gather_host(const std::uint64_t* send, std::uint64_t* recv, int count,
                         std::string_view what) override {
    return host_->all_gather_host(send, recv, count, what);
  }
  Status gather_host(const void* send, void* recv, std::int64_t count, DType dtype, int root,
                     std::string_view what) override {
    return host_->gather_host(send, recv, count, dtype, root, what);
  }

 private:
  void count_bytes(std::uint64_t CommStats::*field, std::int64_t elems, DType dtype) {
    const std::uint64_t bytes = static_cast<std::uint64_t>(elems) * dtype_size(dtype);
    stats_.*field += bytes;
    ++stats_.collectives;
  }
  // The collective stream waits (on the GPU, not the host) for everything issued to the compute
  // stream so far: the kernels that wrote what the collective sends.
  bool after_compute() {
    return cudaEventRecord(ready_, compute_) == cudaSuccess &&
           cudaStreamWaitEvent(stream_, ready_, 0) == cudaSuccess;
  }
  CommHandle failed(const char* op, std::string_view what, const std::string& why) {
    struct Failed final : CommHandle::State {
      Status s;
      Status wait() override { return s; }
    };
    auto f = std::make_shared<Failed>();
    f->s = internal_error("rank " + std::to_string(rank()) + ": " + op + " '" + std::string(what) +
                          "' failed: " + why);
    return CommHandle(f);
  }
  // A handle on the collective just enqueued: its wait polls an event recorded after it on the
  // collective stream, so waiting never waits for unrelated compute.
  CommHandle finish(ncclResult_t rc, const char* op, std::string_view what) {
    const std::string label = std::string(op) + " '" + std::string(what) + "'";
    auto fail = [&](const std::string& why) { return failed(op, what, why); };
    if (rc != ncclSuccess) return fail(ncclGetErrorString(rc));
    cudaEvent_t ev;
    if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess)
      return fail("cudaEventCreate");
    if (cudaEventRecord(ev, stream_) != cudaSuccess) {
      cudaEventDestroy(ev);
      return fail("cudaEventRecord");
    }
    return CommHandle(std::make_shared<NcclHandleState>(
        ev, comm_, label, rank(), std::chrono::steady_clock::now() + timeout_));
  }

  std::unique_ptr<Communicator> host_;
  std::shared_ptr<NcclComm> comm_;
  cudaStream_t compute_;
  cudaStream_t stream_;
  cudaEvent_t ready_;
  std::chrono::seconds timeout_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> make_nccl_communicator(const CommOptions& options,
                                                             device::Device& device) {
  if (device.host_addressable()) {
    return invalid_argument(
        "dist_backend \"nccl\" needs device \"cuda\"; use \"mpi\" on the CPU backend");
  }
  void* compute = device.stream(device::StreamKind::kCompute).native_handle();
  void* stream = device.stream(device::StreamKind::kCollective).native_handle();
  if (compute == nullptr || stream == nullptr) {
    return unavailable("the device has no native CUDA streams for NCCL");
  }
  // The host side (NCCL's id, barriers, host reductions): MPI when launched with several
  // ranks; one process needs none, so a build without MPI still runs NCCL on one GPU.
  std::unique_ptr<Communicator> host;
  if (launched_with_multiple_ranks()) {
#if STRATA_HAVE_MPI
    STRATA_ASSIGN_OR_RETURN(host, make_mpi_host_communicator(options, device));
#else
    return unavailable(
        "dist_backend \"nccl\" with several ranks needs MPI to start NCCL, but this build has "
        "none (install libopenmpi-dev and rebuild)");
#endif
  } else {
    host = make_single_rank_communicator(device);
  }
  // Rank 0 creates the NCCL id; the host communicator carries it to everyone.
  ncclUniqueId id{};
  if (host->rank() == 0) {
    const ncclResult_t rc = ncclGetUniqueId(&id);
    if (rc != ncclSuccess)
      return unavailable(std::string("ncclGetUniqueId: ") + ncclGetErrorString(rc));
  }
  static_assert(sizeof(id) % sizeof(std::uint64_t) == 0);
  constexpr int kWords = sizeof(id) / sizeof(std::uint64_t);
  std::uint64_t words[kWords];
  std::memcpy(words, &id, sizeof(id));
  std::vector<std::uint64_t> all(static_cast<std::size_t>(kWords * host->world_size()));
  STRATA_RETURN_IF_ERROR(host->all_gather_host(words, all.data(), kWords, "NCCL unique id"));
  std::memcpy(&id, all.data(), sizeof(id));  // rank 0's id
  ncclComm_t raw;
  const ncclResult_t rc = ncclCommInitRank(&raw, host->world_size(), id, host->rank());
  if (rc != ncclSuccess) {
    return unavailable("rank " + std::to_string(host->rank()) +
                       ": ncclCommInitRank failed: " + ncclGetErrorString(rc));
  }
  auto comm = std::make_shared<NcclComm>(raw);
  cudaEvent_t ready = nullptr;
  if (cudaEventCreateWithFlags(&ready, cudaEventDisableTiming) != cudaSuccess) {
    return unavailable("rank " + std::to_string(host->rank()) +
                       ": cannot create the CUDA event for NCCL collectives");
  }
  return std::unique_ptr<Communicator>(std::make_unique<NcclCommunicator>(
      std::move(host), std::move(comm), static_cast<cudaStream_t>(compute),
      static_cast<cudaStream_t>(stream), ready, options.timeout));
}

}  // namespace strata::dist

#endif  // STRATA_HAVE_NCCL
