// NCCL communicator for the CUDA backend: device collectives on the device's collective stream,
// so they overlap the compute stream's kernels (each waits, on the GPU, for the compute work
// issued before it: the data it sends), bootstrapped and backed for host-side control data by
// MPI, or by nothing in a single process; point-to-point on links of their own (connect).
// Built when CUDA and NCCL are found.
#include "strata/build_config.h"

#if STRATA_HAVE_NCCL

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "src/dist/mpi_communicator.h"
#include "src/dist/nccl_communicator.h"
#include "strata/core/check.h"
#include "strata/device/device.h"
#include "strata/sys/environment.h"

// Communicators are created non-blocking (ncclCommInitRankConfig), so that creation has a
// deadline: NCCL_CONFIG_INITIALIZER and ncclGetLastError need 2.14.
// Sub-communicators are made with ncclCommSplit, which needs 2.18.
#if NCCL_VERSION_CODE < NCCL_VERSION(2, 18, 0)
#error "Strata's NCCL communicator needs NCCL 2.18 or newer"
#endif

namespace strata::dist {
namespace {

using Clock = std::chrono::steady_clock;

// "unhandled system error (run with NCCL_DEBUG=WARN for details) (socket: ...)": the code's text
// and NCCL's own account of the last error, when it has one.
std::string nccl_error(ncclResult_t rc) {
  std::string text = ncclGetErrorString(rc);
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && *last != '\0') text += std::string(" (") + last + ")";
  return text;
}

// As the MPI communicator words it (mpi_communicator.cpp, timed_out).
Status timed_out(int rank, const std::string& what) {
  return unavailable("rank " + std::to_string(rank) + ": " + what +
                     " did not complete in time; a peer rank may have died or be stuck "
                     "(raise dist_timeout_s if it is only slow)");
}

// Polls a non-blocking communicator until the call it is busy with (its creation, or enqueueing
// a collective: connections are made on first use) is done: ncclSuccess or an error, or still
// ncclInProgress once `deadline` has passed.
ncclResult_t settle(ncclComm_t comm, Clock::time_point deadline) {
  auto sleep = std::chrono::microseconds(0);
  for (;;) {
    ncclResult_t state = ncclInProgress;
    if (const ncclResult_t q = ncclCommGetAsyncError(comm, &state); q != ncclSuccess) return q;
    if (state != ncclInProgress || Clock::now() > deadline) return state;
    if (sleep < std::chrono::microseconds(500)) sleep += std::chrono::microseconds(10);
    std::this_thread::sleep_for(sleep);
  }
}

// ncclGetUniqueId on a thread of its own: it starts NCCL's bootstrap network, which can hang
// (no usable interface, a name lookup that never answers), and cannot be aborted. Past the
// deadline the thread is left behind, writing only to the state it shares.
Result<ncclUniqueId> unique_id_by(Clock::time_point deadline, int rank) {
  struct Outcome {
    ncclUniqueId id{};
    ncclResult_t rc = ncclSuccess;
  };
  auto outcome = std::make_shared<Outcome>();
  std::promise<void> finished;
  std::future<void> done = finished.get_future();
  std::thread([outcome, ready = std::move(finished)]() mutable {
    outcome->rc = ncclGetUniqueId(&outcome->id);
    ready.set_value();
  }).detach();
  if (done.wait_until(deadline) != std::future_status::ready) {
    return unavailable("rank " + std::to_string(rank) +
                       ": ncclGetUniqueId did not complete in time; NCCL's bootstrap may find no "
                       "network interface it can use (on one node, NCCL_SOCKET_IFNAME=lo names "
                       "one; raise dist_timeout_s if it is only slow)");
  }
  if (outcome->rc != ncclSuccess) {
    return unavailable("rank " + std::to_string(rank) +
                       ": ncclGetUniqueId failed: " + nccl_error(outcome->rc));
  }
  return outcome->id;
}

// ncclCommInitRankConfig, non-blocking, polled until `deadline`; past it the communicator is
// aborted and the error names the rank and the operation.
Result<ncclComm_t> init_comm_by(Clock::time_point deadline, int world, const ncclUniqueId& id,
                                int rank) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  ncclResult_t rc = ncclCommInitRankConfig(&comm, world, id, rank, &config);
  if (rc == ncclInProgress) rc = settle(comm, deadline);
  if (rc == ncclSuccess) return comm;
  if (comm != nullptr) ncclCommAbort(comm);
  if (rc == ncclInProgress) {
    return timed_out(rank, "ncclCommInitRank (" + std::to_string(world) + " ranks)");
  }
  return unavailable("rank " + std::to_string(rank) +
                     ": ncclCommInitRank failed: " + nccl_error(rc));
}

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
      // ncclInProgress: the non-blocking communicator is busy with a later call; not an error.
      if (async_err != ncclSuccess && async_err != ncclInProgress) {
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
  // `compute` and `stream` are the device's compute stream and the collective stream this
  // communicator runs on (the device's frees wait for every stream's work too); `ready` (owned)
  // orders each collective after the compute work issued before it.
  NcclCommunicator(device::Device& device, std::unique_ptr<Communicator> host,
                   std::shared_ptr<NcclComm> comm, cudaStream_t compute, cudaStream_t stream,
                   cudaEvent_t ready, std::chrono::seconds timeout)
      : device_(device),
        host_(std::move(host)),
        comm_(std::move(comm)),
        compute_(compute),
        stream_(stream),
        ready_(ready),
        timeout_(timeout) {}
  ~NcclCommunicator() override {
    // Collectives and sends still queued finish before the communicator goes, or are aborted
    // when they do not within the timeout (a peer that died would otherwise hang the exit).
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    drain(*comm_, stream_, deadline);
    for (Link& link : links_) {
      drain(*link.comm, link.stream, deadline);
      cudaStreamDestroy(link.stream);
    }
    cudaEventDestroy(ready_);
  }

  int rank() const override { return host_->rank(); }
  int world_size() const override { return host_->world_size(); }
  std::string name() const override { return "nccl"; }

  // The host side splits first (its timed collectives find a missing peer); then ncclCommSplit,
  // non-blocking and polled against the timeout like the communicator's creation.
  Result<std::unique_ptr<Communicator>> split(int color, int key, std::string_view what,
                                              device::StreamKind kind) override {
    void* on = device_.stream(kind).native_handle();
    if (on == nullptr) return unavailable("the device has no native CUDA stream for a split");
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> host,
                            host_->split(color, key, what, kind));
    const std::string label = "ncclCommSplit for split '" + std::string(what) + "'";
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    // Non-blocking, NCCL writes the new communicator's handle when its own thread has made it,
    // after ncclCommSplit returns (the first GPU run found it still null there, and a write into
    // a returned frame's variable corrupting the next communicator): into memory of its own,
    // left behind if the split does not finish in time.
    auto* out = new ncclComm_t(nullptr);
    const Clock::time_point deadline = Clock::now() + timeout_;
    ncclResult_t rc = ncclCommSplit(comm_->get(), color, key, out, &config);
    ncclComm_t raw = nullptr;
    for (auto sleep = std::chrono::microseconds(0); rc == ncclSuccess || rc == ncclInProgress;
         std::this_thread::sleep_for(sleep)) {
      raw = std::atomic_ref<ncclComm_t>(*out).load(std::memory_order_acquire);
      if (raw != nullptr) {
        rc = settle(raw, deadline);
        break;
      }
      ncclResult_t parent = ncclSuccess;
      if (const ncclResult_t q = ncclCommGetAsyncError(comm_->get(), &parent); q != ncclSuccess) {
        rc = q;
      } else if (parent != ncclSuccess && parent != ncclInProgress) {
        rc = parent;
      } else if (Clock::now() > deadline) {
        rc = ncclInProgress;
        break;
      }
      if (sleep < std::chrono::microseconds(500)) sleep += std::chrono::microseconds(10);
    }
    if (raw != nullptr) delete out;  // written once, and read
    if (rc != ncclSuccess) {
      if (raw != nullptr) ncclCommAbort(raw);
      if (rc == ncclInProgress) return timed_out(rank(), label);
      return unavailable("rank " + std::to_string(rank()) + ": " + label +
                         " failed: " + nccl_error(rc));
    }
    cudaEvent_t ready = nullptr;
    if (cudaEventCreateWithFlags(&ready, cudaEventDisableTiming) != cudaSuccess) {
      ncclCommAbort(raw);
      return unavailable("rank " + std::to_string(rank()) +
                         ": cannot create the CUDA event for NCCL collectives");
    }
    return std::unique_ptr<Communicator>(std::make_unique<NcclCommunicator>(
        device_, std::move(host), std::make_shared<NcclComm>(raw), compute_,
        static_cast<cudaStream_t>(on), ready, timeout_));
  }

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
  // One NCCL group of a send and a receive with each rank (NCCL's own all-to-all pattern): the
  // group runs as one operation, so no pair waits behind another.
  CommHandle all_to_all_v(const void* send, std::span<const std::int64_t> send_counts, void* recv,
                          std::span<const std::int64_t> recv_counts, DType dtype,
                          std::string_view what) override {
    if (Status s = check_all_to_all(*this, send_counts, recv_counts, what); !s.is_ok()) {
      return failed(std::move(s));
    }
    ++stats_.collectives;
    if (!after_compute()) return failed("all_to_all_v", what, "cudaStreamWaitEvent");
    const std::size_t element = dtype_size(dtype);
    const ncclDataType_t type = nccl_type(dtype);
    const auto* from = static_cast<const std::byte*>(send);
    auto* to = static_cast<std::byte*>(recv);
    ncclResult_t rc = ncclGroupStart();
    for (int r = 0; r < world_size() && rc == ncclSuccess; ++r) {
      const auto out = static_cast<std::size_t>(send_counts[r]);
      const auto in = static_cast<std::size_t>(recv_counts[r]);
      if (r != rank()) stats_.all_to_all_bytes += out * element;
      if (out > 0) rc = ncclSend(from, out, type, r, comm_->get(), stream_);
      if (in > 0 && (rc == ncclSuccess || rc == ncclInProgress)) {
        rc = ncclRecv(to, in, type, r, comm_->get(), stream_);
      }
      if (rc == ncclInProgress) rc = ncclSuccess;
      from += out * element;
      to += in * element;
    }
    const ncclResult_t ended = ncclGroupEnd();
    return finish(rc != ncclSuccess ? rc : ended, "all_to_all_v", what);
  }

  // Point-to-point runs on links, one a direction and peer, each a two-rank NCCL communicator
  // (the sender its rank 0) on a stream of its own: NCCL's send and receive block their stream
  // until matched, so on one shared stream a 1F1B stage's second send would hold back the
  // receive of the gradient its peer sends first, and the peer's receive of that send sits
  // behind its own gradient send. On links, as with MPI's Issend, a send waits only for its
  // own receive.
  Status connect(std::span<const int> peers, std::string_view what) override {
    std::vector<int> with(peers.begin(), peers.end());
    std::sort(with.begin(), with.end());
    with.erase(std::unique(with.begin(), with.end()), with.end());
    for (const int peer : with) {
      STRATA_RETURN_IF_ERROR(check_peer(*this, "connect", peer, what));
      if (link(peer, true) != nullptr) {
        return invalid_argument("rank " + std::to_string(rank()) + ": connect '" +
                                std::string(what) + "': already linked with rank " +
                                std::to_string(peer));
      }
    }
    const Clock::time_point deadline = Clock::now() + timeout_;
    // The sender of each link makes its NCCL id and hands it to the receiver over MPI.
    const std::size_t n = with.size();
    std::vector<ncclUniqueId> sends(n), receives(n);
    for (std::size_t i = 0; i < n; ++i) {
      STRATA_ASSIGN_OR_RETURN(sends[i], unique_id_by(deadline, rank()));
    }
    std::vector<CommHandle> ids;
    const std::string label = "NCCL ids for " + std::string(what);
    for (std::size_t i = 0; i < n; ++i) {
      ids.push_back(host_->send(&sends[i], sizeof(ncclUniqueId), DType::kU8, with[i], label));
      ids.push_back(host_->recv(&receives[i], sizeof(ncclUniqueId), DType::kU8, with[i], label));
    }
    for (CommHandle& h : ids) STRATA_RETURN_IF_ERROR(h.wait());
    // Each link's two ranks must create it together: every rank makes its links in one order
    // over all of them (by the pair, then the sender), so the first link still to make has both
    // its ranks at it.
    struct Todo {
      int low, high, sender;
      const ncclUniqueId* id;
      int peer;
    };
    std::vector<Todo> todo;
    for (std::size_t i = 0; i < n; ++i) {
      const int low = std::min(rank(), with[i]), high = std::max(rank(), with[i]);
      todo.push_back({low, high, rank(), &sends[i], with[i]});
      todo.push_back({low, high, with[i], &receives[i], with[i]});
    }
    std::sort(todo.begin(), todo.end(), [](const Todo& a, const Todo& b) {
      return std::tie(a.low, a.high, a.sender) < std::tie(b.low, b.high, b.sender);
    });
    for (const Todo& t : todo) {
      const bool outgoing = t.sender == rank();
      cudaStream_t stream = nullptr;
      if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
        return unavailable("rank " + std::to_string(rank()) +
                           ": cannot create a CUDA stream for the link with rank " +
                           std::to_string(t.peer));
      }
      Result<ncclComm_t> made = init_comm_by(deadline, 2, *t.id, outgoing ? 0 : 1);
      if (!made.is_ok()) {
        cudaStreamDestroy(stream);
        return unavailable("rank " + std::to_string(rank()) + ": connect '" + std::string(what) +
                           "' with rank " + std::to_string(t.peer) + ": " +
                           made.status().message());
      }
      links_.push_back({t.peer, outgoing, std::make_shared<NcclComm>(*made), stream});
    }
    return Status::ok();
  }
  CommHandle send(const void* buffer, std::int64_t count, DType dtype, int peer,
                  std::string_view what) override {
    if (Status s = check_peer(*this, "send", peer, what); !s.is_ok()) return failed(std::move(s));
    const Link* to = link(peer, true);
    if (to == nullptr) return failed("send", what, unlinked(peer));
    if (!after_compute(to->stream)) return failed("send", what, "cudaStreamWaitEvent");
    stats_.sent_bytes += static_cast<std::size_t>(count) * dtype_size(dtype);
    return finish(ncclSend(buffer, static_cast<std::size_t>(count), nccl_type(dtype), 1,
                           to->comm->get(), to->stream),
                  "send", what, to->comm, to->stream);
  }
  CommHandle recv(void* buffer, std::int64_t count, DType dtype, int peer,
                  std::string_view what) override {
    if (Status s = check_peer(*this, "recv", peer, what); !s.is_ok()) return failed(std::move(s));
    const Link* from = link(peer, false);
    if (from == nullptr) return failed("recv", what, unlinked(peer));
    // The receive waits for the compute issued before it: the last reads of its buffer.
    if (!after_compute(from->stream)) return failed("recv", what, "cudaStreamWaitEvent");
    return finish(ncclRecv(buffer, static_cast<std::size_t>(count), nccl_type(dtype), 0,
                           from->comm->get(), from->stream),
                  "recv", what, from->comm, from->stream);
  }
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
  // One direction of point-to-point with one peer (see connect).
  struct Link {
    int peer = -1;
    bool outgoing = false;  // this rank sends on it (its rank 0)
    std::shared_ptr<NcclComm> comm;
    cudaStream_t stream = nullptr;
  };
  const Link* link(int peer, bool outgoing) const {
    for (const Link& l : links_) {
      if (l.peer == peer && l.outgoing == outgoing) return &l;
    }
    return nullptr;
  }
  std::string unlinked(int peer) const {
    return "no point-to-point link with rank " + std::to_string(peer) +
           " (every rank calls connect, naming its peers, before its first send or receive)";
  }
  // Waits until `stream` is idle, or aborts `comm` when it is not by `deadline`.
  static void drain(NcclComm& comm, cudaStream_t stream, Clock::time_point deadline) {
    while (!comm.aborted() && cudaStreamQuery(stream) == cudaErrorNotReady) {
      if (Clock::now() > deadline) {
        comm.abort();
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  // `stream` waits (on the GPU, not the host) for everything issued to the compute stream so
  // far: the kernels that wrote what a collective sends, or last read what a receive overwrites.
  bool after_compute(cudaStream_t stream) {
    return cudaEventRecord(ready_, compute_) == cudaSuccess &&
           cudaStreamWaitEvent(stream, ready_, 0) == cudaSuccess;
  }
  bool after_compute() { return after_compute(stream_); }
  static CommHandle failed(Status status) { return CommHandle::done(std::move(status)); }
  CommHandle failed(const char* op, std::string_view what, const std::string& why) {
    return failed(internal_error("rank " + std::to_string(rank()) + ": " + op + " '" +
                                 std::string(what) + "' failed: " + why));
  }
  // A handle on the operation just enqueued on `comm` and `stream`: its wait polls an event
  // recorded after it there, so waiting never waits for unrelated compute.
  CommHandle finish(ncclResult_t rc, const char* op, std::string_view what,
                    const std::shared_ptr<NcclComm>& comm, cudaStream_t stream) {
    const std::string label = std::string(op) + " '" + std::string(what) + "'";
    auto fail = [&](const std::string& why) { return failed(op, what, why); };
    if (rc == ncclInProgress) {  // the communicator is non-blocking: enqueued once it settles
      rc = settle(comm->get(), Clock::now() + timeout_);
      if (rc == ncclInProgress) {
        comm->abort();
        return failed(timed_out(rank(), label));
      }
    }
    if (rc != ncclSuccess) return fail(nccl_error(rc));
    cudaEvent_t ev;
    if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess)
      return fail("cudaEventCreate");
    if (cudaEventRecord(ev, stream) != cudaSuccess) {
      cudaEventDestroy(ev);
      return fail("cudaEventRecord");
    }
    return CommHandle(std::make_shared<NcclHandleState>(
        ev, comm, label, rank(), std::chrono::steady_clock::now() + timeout_));
  }
  CommHandle finish(ncclResult_t rc, const char* op, std::string_view what) {
    return finish(rc, op, what, comm_, stream_);
  }

  device::Device& device_;
  std::unique_ptr<Communicator> host_;
  std::shared_ptr<NcclComm> comm_;
  cudaStream_t compute_;
  cudaStream_t stream_;
  cudaEvent_t ready_;
  std::chrono::seconds timeout_;
  std::vector<Link> links_;
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
  STRATA_ASSIGN_OR_RETURN(const sys::Launch launch, sys::read_launch());
  if (launch.multiple_ranks()) {
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
  // Rank 0 creates the NCCL id; the host communicator carries it to everyone. Creation as a
  // whole gets dist_timeout_s, as every collective does.
  const Clock::time_point deadline = Clock::now() + options.timeout;
  ncclUniqueId id{};
  if (host->rank() == 0) {
    STRATA_ASSIGN_OR_RETURN(id, unique_id_by(deadline, host->rank()));
  }
  static_assert(sizeof(id) % sizeof(std::uint64_t) == 0);
  constexpr int kWords = sizeof(id) / sizeof(std::uint64_t);
  std::uint64_t words[kWords];
  std::memcpy(words, &id, sizeof(id));
  std::vector<std::uint64_t> all(static_cast<std::size_t>(kWords * host->world_size()));
  STRATA_RETURN_IF_ERROR(host->all_gather_host(words, all.data(), kWords, "NCCL unique id"));
  std::memcpy(&id, all.data(), sizeof(id));  // rank 0's id
  STRATA_ASSIGN_OR_RETURN(ncclComm_t raw,
                          init_comm_by(deadline, host->world_size(), id, host->rank()));
  auto comm = std::make_shared<NcclComm>(raw);
  cudaEvent_t ready = nullptr;
  if (cudaEventCreateWithFlags(&ready, cudaEventDisableTiming) != cudaSuccess) {
    return unavailable("rank " + std::to_string(host->rank()) +
                       ": cannot create the CUDA event for NCCL collectives");
  }
  return std::unique_ptr<Communicator>(std::make_unique<NcclCommunicator>(
      device, std::move(host), std::move(comm), static_cast<cudaStream_t>(compute),
      static_cast<cudaStream_t>(stream), ready, options.timeout));
}

}  // namespace strata::dist

#endif  // STRATA_HAVE_NCCL
