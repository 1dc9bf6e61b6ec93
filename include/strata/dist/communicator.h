// Collective communication between data-parallel ranks: single-rank, MPI (CPU backend) and
// NCCL (CUDA backend) implementations behind one interface.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/status.h"

namespace strata::device {
class Device;
enum class StreamKind : std::uint8_t;
}  // namespace strata::device

namespace strata::dist {

enum class ReduceOp : std::uint8_t { kSum, kAvg };

// Completion of an asynchronous collective. wait() returns the error of a failed or timed-out
// collective, naming the rank and the operation.
class CommHandle {
 public:
  struct State {
    virtual ~State() = default;
    virtual Status wait() = 0;
    // Whether wait() would return at once. States that finish before they are handed out need
    // not override it.
    virtual bool ready() { return true; }
  };
  CommHandle() = default;
  explicit CommHandle(std::shared_ptr<State> s) : state_(std::move(s)) {}
  // Done already, with `status` (ok: nothing to wait for; else an error found before anything
  // started).
  static CommHandle done(Status status);
  Status wait() {
    if (!state_) return Status::ok();
    Status s = state_->wait();
    state_.reset();
    return s;
  }
  bool pending() const { return state_ != nullptr; }
  // Done (or never started): wait() would not block.
  bool ready() const { return state_ == nullptr || state_->ready(); }

 private:
  std::shared_ptr<State> state_;
};

struct CommStats {
  std::uint64_t all_gather_bytes = 0;
  std::uint64_t reduce_scatter_bytes = 0;
  std::uint64_t all_reduce_bytes = 0;
  std::uint64_t sent_bytes = 0;        // point-to-point sends
  std::uint64_t all_to_all_bytes = 0;  // all_to_all_v: what this rank sends to the others
  std::uint64_t collectives = 0;
  CommStats& operator+=(const CommStats& o) {
    all_gather_bytes += o.all_gather_bytes;
    reduce_scatter_bytes += o.reduce_scatter_bytes;
    all_reduce_bytes += o.all_reduce_bytes;
    sent_bytes += o.sent_bytes;
    all_to_all_bytes += o.all_to_all_bytes;
    collectives += o.collectives;
    return *this;
  }
};

// Buffers are device pointers of the device the communicator was created for; dtypes f32, bf16,
// f16. Counts are in elements. Collectives are issued in the same order on every rank.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string name() const = 0;

  // recv[r * count + i] = send_of_rank_r[i]. recv holds world_size * count elements.
  virtual CommHandle all_gather(const void* send, void* recv, std::int64_t count, DType dtype,
                                std::string_view what) = 0;
  // recv[i] = op over ranks of send_of_rank_r[rank * count + i]. send holds world_size * count.
  // The MPI path on host memory and the in-process group sum the ranks in the canonical tree
  // (core/summation_tree.h), in f32 rounded once, so the data-parallel gradient sums have the
  // same bits on any power-of-two number of ranks; NCCL sums in its ring's order.
  virtual CommHandle reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype,
                                    ReduceOp op, std::string_view what) = 0;
  // reduce_scatter's sum of 16-bit gradients kept in f32: recv (f32, count) = the ranks' values
  // widened and summed in the canonical tree, not rounded to dtype, so a group of ranks hands
  // on what one rank's fp32 accumulator of the same micro-batches holds. The MPI path on host
  // memory, the in-process group and one rank have it; elsewhere (NCCL) an error names it.
  virtual CommHandle reduce_scatter_wide(const void* send, float* recv, std::int64_t count,
                                         DType dtype, std::string_view what);
  // recv[i] = op over ranks of send[i]; recv may equal send.
  virtual CommHandle all_reduce(const void* send, void* recv, std::int64_t count, DType dtype,
                                ReduceOp op, std::string_view what) = 0;
  virtual CommHandle broadcast(void* buffer, std::int64_t count, DType dtype, int root,
                               std::string_view what) = 0;
  virtual Status barrier(std::string_view what) = 0;
  // All-to-all with a count for each pair of ranks (the experts' token dispatch): send holds
  // send_counts[r] elements for each rank r, packed in rank order (this rank's own share
  // included), and recv gets recv_counts[r] elements from each rank r, packed in rank order. Both
  // spans hold world_size counts, read before the call returns; each pair must agree (rank a's
  // send_counts[b] is rank b's recv_counts[a]); send and recv do not overlap. A pair that
  // disagrees is an error naming both where the transport can see it (in process), else MPI's or
  // NCCL's own.
  virtual CommHandle all_to_all_v(const void* send, std::span<const std::int64_t> send_counts,
                                  void* recv, std::span<const std::int64_t> recv_counts,
                                  DType dtype, std::string_view what) = 0;

  // Point-to-point (pipeline stage boundaries): `count` elements of this device's memory to or
  // from rank `peer` (not this rank). Between two ranks, sends and receives match in the order
  // each issues them, and must agree on count and dtype. Asynchronous like the collectives:
  // the send's buffer stays untouched and the receive's unread until the handle is waited for;
  // a peer that never matches ends the wait with the timeout's error naming `what`.
  virtual CommHandle send(const void* buffer, std::int64_t count, DType dtype, int peer,
                          std::string_view what) = 0;
  virtual CommHandle recv(void* buffer, std::int64_t count, DType dtype, int peer,
                          std::string_view what) = 0;
  // Readies point-to-point with `peers` (ranks of this communicator, not this one), both ways,
  // before the first send or receive: every rank that will use send/recv calls it once, naming
  // its own peers, and each names it back. A send then never waits behind a receive or another
  // peer's traffic, only for its own receive to be posted (MPI's Issend, which the MPI transport
  // uses so that no test relies on buffering). Transports that need no setup (MPI, one rank,
  // threads) accept it and do nothing; NCCL makes a two-rank communicator on a stream of its own
  // for each direction, so the sends and receives of a 1F1B schedule do not queue behind one
  // another on one stream (NCCL's send and receive block the GPU until matched).
  virtual Status connect(std::span<const int> peers, std::string_view what) {
    (void)peers;
    (void)what;
    return Status::ok();
  }

  // Host-memory helpers for small control data (loss, norms, flags, config hashes).
  virtual Status all_reduce_host(double* values, int count, ReduceOp op, std::string_view what) = 0;
  virtual Status all_gather_host(const std::uint64_t* send, std::uint64_t* recv, int count,
                                 std::string_view what) = 0;
  // Host-memory gather of count elements from every rank into root's recv (world * count).
  virtual Status gather_host(const void* send, void* recv, std::int64_t count, DType dtype,
                             int root, std::string_view what) = 0;

  // A communicator over the ranks that pass the same `color` (MPI_Comm_split's meaning): its
  // ranks ordered by `key`, then by rank here. Collective: every rank calls it, in the same
  // order as its other collectives, within the timeout. The new communicator may outlive this
  // one's use but not this object. Its device collectives run on the device's `stream` (NCCL;
  // the host paths have no streams).
  virtual Result<std::unique_ptr<Communicator>> split(int color, int key, std::string_view what,
                                                      device::StreamKind stream) = 0;

  const CommStats& stats() const { return stats_; }

 protected:
  CommStats stats_;
};

// Ok when `peer` is a rank of `comm` other than its own, else the error for a point-to-point `op`.
Status check_peer(const Communicator& comm, const char* op, int peer, std::string_view what);
// Ok when all_to_all_v's counts are world_size each and none is negative, else the error naming
// the call and the count.
Status check_all_to_all(const Communicator& comm, std::span<const std::int64_t> send_counts,
                        std::span<const std::int64_t> recv_counts, std::string_view what);

// kAuto: mpi when launched by mpirun (nccl on a device that is not host memory), else single.
enum class CommBackend : std::uint8_t { kAuto, kSingle, kMpi, kNccl };
inline constexpr std::array<CommBackend, 4> kCommBackends = {
    CommBackend::kAuto, CommBackend::kSingle, CommBackend::kMpi, CommBackend::kNccl};
inline std::string_view comm_backend_name(CommBackend backend) {
  switch (backend) {
    case CommBackend::kAuto:
      return "auto";
    case CommBackend::kSingle:
      return "single";
    case CommBackend::kMpi:
      return "mpi";
    case CommBackend::kNccl:
      return "nccl";
  }
  return "?";
}

struct CommOptions {
  CommBackend backend = CommBackend::kAuto;
  std::chrono::seconds timeout{300};  // a collective that does not finish in time ends the run
};

// Creates the communicator. MPI is initialized on first use and finalized when the last MPI
// communicator is destroyed. `device` decides which buffers collectives touch.
Result<std::unique_ptr<Communicator>> create_communicator(const CommOptions& options,
                                                          device::Device& device);

// The single-rank communicator (no MPI): every collective is a local copy.
std::unique_ptr<Communicator> make_single_rank_communicator(device::Device& device);

// Ranks as threads of one process, for tests of multi-rank logic without mpirun: one
// communicator per device (rank r on devices[r]), each to be used from its own thread. Every
// collective completes when all ranks have called it (the handles it returns are done), a send
// when its copy is posted, a receive when its handle is waited for and its message is there; ranks
// that disagree on it get an error naming both calls, and a rank left waiting longer than
// `timeout` gets the error the MPI path gives, after which every later collective of the group
// fails. Devices must address host memory (the CPU backend). Reductions sum the ranks in the
// canonical tree (core/summation_tree.h) in f32, rounded once, as the MPI reduce-scatter does.
Result<std::vector<std::unique_ptr<Communicator>>> make_in_process_group(
    const std::vector<device::Device*>& devices,
    std::chrono::milliseconds timeout = std::chrono::milliseconds(60000));

}  // namespace strata::dist
