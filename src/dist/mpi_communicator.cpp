// MPI communicator: non-blocking MPI collectives, driven by a communication thread so they progress
// while the caller computes, and waited on with a deadline, so a dead or stuck peer ends the run
// with a message instead of a hang, naming the peers a liveness probe finds gone or elsewhere.
// Needs a host-addressable device.
#include "strata/build_config.h"

#if STRATA_HAVE_MPI

#include <mpi.h>
#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <limits>
#include <list>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "src/dist/mpi_communicator.h"
#include "src/dist/mpi_thread.h"
#include "src/dist/rank_order.h"
#include "strata/core/logging.h"
#include "strata/device/device.h"

namespace strata::dist {
namespace {

// Elementwise sums for 16-bit floats, which MPI has no type for: convert, add in f32, round.
template <typename Half, float (*ToF32)(Half), Half (*FromF32)(float)>
void half_sum(void* in, void* inout, int* len, MPI_Datatype*) {
  const Half* a = static_cast<const Half*>(in);
  Half* b = static_cast<Half*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = FromF32(ToF32(a[i]) + ToF32(b[i]));
}

using detail::CommThread;
using detail::mpi_error_string;
using detail::StartFn;

// MPI is process-wide state: initialized once, finalized when the last communicator goes away.
struct MpiRuntime {
  std::mutex mu;
  int users = 0;
  bool we_initialized = false;
  // A communicator was destroyed with collectives in flight (a timed-out peer): MPI_Finalize
  // could wait for that peer forever, so the process ends without it.
  bool unclean = false;
  MPI_Op bf16_sum = MPI_OP_NULL;
  MPI_Op f16_sum = MPI_OP_NULL;
  std::unique_ptr<CommThread> thread;  // while users > 0
  MPI_Comm probe = MPI_COMM_NULL;      // the liveness probe's own duplicate of MPI_COMM_WORLD
  std::vector<std::string> hosts;      // each rank's host name, by rank of the job
};
MpiRuntime& runtime() {
  static MpiRuntime rt;  // the one process-wide MPI state; MPI itself is a process singleton
  return rt;
}

// How long a rank whose operation timed out waits for the others to answer its liveness probe:
// their communication threads answer within milliseconds when they are alive and reachable.
std::chrono::milliseconds probe_window(std::chrono::seconds timeout) {
  return std::clamp<std::chrono::milliseconds>(timeout / 4, std::chrono::seconds(1),
                                               std::chrono::seconds(5));
}

// "rank 2 (node-b)": a rank of the job and its host.
std::string rank_on_host(int rank) {
  const MpiRuntime& rt = runtime();
  std::string s = "rank " + std::to_string(rank);
  if (static_cast<std::size_t>(rank) < rt.hosts.size()) {
    s += " (" + rt.hosts[static_cast<std::size_t>(rank)] + ")";
  }
  return s;
}

// What a liveness probe found, for the message of `what`, which timed out: the ranks that did not
// answer (gone, or cut off), and those that answered but are not in `what` (stuck elsewhere).
std::string probe_findings(const CommThread::Answers& answers, const std::string& what,
                           std::chrono::milliseconds window) {
  if (answers.empty()) return "";
  constexpr int kNamed = 8;  // a line, not a page, on a large job
  std::string silent, elsewhere;
  int n_silent = 0, n_elsewhere = 0;
  for (std::size_t i = 0; i < answers.size(); ++i) {
    const int r = static_cast<int>(i);
    if (!answers[i]) {
      if (n_silent++ < kNamed) silent += (silent.empty() ? "" : ", ") + rank_on_host(r);
    } else if (answers[i]->find(what) == std::string::npos && *answers[i] != "this rank") {
      if (n_elsewhere++ < kNamed) {
        elsewhere += (elsewhere.empty() ? "" : "; ") + rank_on_host(r) + " is " + *answers[i];
      }
    }
  }
  const auto more = [](int n) {
    return n > kNamed ? " and " + std::to_string(n - kNamed) + " more" : std::string();
  };
  char secs[32];
  std::snprintf(secs, sizeof secs, "%.1f", std::chrono::duration<double>(window).count());
  std::string out;
  if (n_silent > 0) {
    out += "; no answer within " + std::string(secs) + " s to a liveness probe from " + silent +
           more(n_silent) + " (gone, or the network to it is down)";
  }
  if (n_elsewhere > 0) out += "; answered but not in it: " + elsewhere + more(n_elsewhere);
  if (n_silent == 0 && n_elsewhere == 0) {
    out += "; every rank answered a liveness probe and is in it (a link may be too slow)";
  }
  return out;
}

Status timed_out(int rank, const std::string& what, const std::string& findings) {
  return unavailable("rank " + std::to_string(rank) + ": " + what +
                     " did not complete in time; a peer rank may have died or be stuck" + findings +
                     " (raise dist_timeout_s if it is only slow)");
}

// Waits for an operation the communication thread runs, until `deadline`. Past it, asks every
// rank what it is doing (for at most `window`), and makes no MPI call again.
Status wait_for_op(std::future<std::string>& done, int rank, const std::string& what,
                   std::chrono::steady_clock::time_point deadline,
                   std::chrono::milliseconds window) {
  if (done.wait_until(deadline) != std::future_status::ready) {
    CommThread& thread = *runtime().thread;
    std::shared_future<CommThread::Answers> answers = thread.probe(window);
    const bool answered =
        answers.wait_for(window + std::chrono::seconds(1)) == std::future_status::ready;
    Status s = timed_out(rank, what, answered ? probe_findings(answers.get(), what, window) : "");
    thread.fail("an earlier operation on this rank timed out (" + s.message() + ")");
    return s;
  }
  const std::string error = done.get();
  if (!error.empty()) {
    return internal_error("rank " + std::to_string(rank) + ": " + what + " failed: " + error);
  }
  return Status::ok();
}

class MpiRequestState final : public CommHandle::State {
 public:
  MpiRequestState(std::future<std::string> done, std::string what, int rank,
                  std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds window,
                  std::function<void()> finish)
      : done_(std::move(done)),
        what_(std::move(what)),
        rank_(rank),
        deadline_(deadline),
        window_(window),
        finish_(std::move(finish)) {}
  bool ready() override {
    return done_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }
  Status wait() override {
    STRATA_RETURN_IF_ERROR(wait_for_op(done_, rank_, what_, deadline_, window_));
    if (finish_) finish_();
    return Status::ok();
  }

 private:
  std::future<std::string> done_;
  std::string what_;
  int rank_;
  std::chrono::steady_clock::time_point deadline_;
  std::chrono::milliseconds window_;
  std::function<void()> finish_;
};

class MpiCommunicator final : public Communicator {
 public:
  // `comm` is a duplicate of MPI_COMM_WORLD owned by this communicator; rank and world come from
  // the communication thread, which makes every MPI call.
  MpiCommunicator(MPI_Comm comm, int rank, int world, const CommOptions& options,
                  device::Device& device)
      : comm_(comm), timeout_(options.timeout), device_(device), rank_(rank), world_(world) {}
  ~MpiCommunicator() override {
    MpiRuntime& rt = runtime();
    std::lock_guard lock(rt.mu);
    // Freed on the communication thread once no collective is in flight on it. One still in
    // flight after a short grace (its wait timed out, or its handle was dropped on an error path)
    // keeps the communicator: MPI may still write to its buffers, and MPI_Finalize would wait for
    // its peers, which may be dead.
    const auto give_up = std::chrono::steady_clock::now() +
                         std::min<std::chrono::steady_clock::duration>(timeout_, kShutdownGrace);
    if (rt.thread->failed()) rt.unclean = true;  // no MPI call after a timeout, not even a free
    for (bool freed = rt.unclean; !freed;) {
      std::future<std::string> done = rt.thread->submit(comm_, "freeing", [&](MPI_Request*) {
        if (rt.thread->in_flight(comm_) > 0) return MPI_SUCCESS;
        freed = true;
        return MPI_Comm_free(&comm_);
      });
      done.wait();
      if (!freed && std::chrono::steady_clock::now() >= give_up) {
        rt.unclean = true;
        break;
      }
      if (!freed) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (--rt.users > 0) return;
    if (!rt.unclean && rt.probe != MPI_COMM_NULL) {
      rt.thread
          ->submit(rt.probe, "freeing",
                   [&rt](MPI_Request*) {
                     rt.probe = MPI_COMM_NULL;
                     return rt.thread->stop_listening();
                   })
          .wait();
    }
    rt.thread.reset();  // joins; every later MPI call is on this thread
    if (rt.unclean) {
      log_warning("rank " + std::to_string(rank_) +
                  ": MPI collectives were still in flight at shutdown (a peer rank may have died "
                  "or be stuck); not calling MPI_Finalize, which could wait for it forever");
      return;
    }
    if (rt.we_initialized) {
      MPI_Op_free(&rt.bf16_sum);
      MPI_Op_free(&rt.f16_sum);
      MPI_Finalize();
    }
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string name() const override { return "mpi"; }

  CommHandle all_gather(const void* send, void* recv, std::int64_t count, DType dtype,
                        std::string_view what) override {
    const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
    stats_.all_gather_bytes += bytes * static_cast<std::size_t>(world_);
    ++stats_.collectives;
    const void* src =
        send == static_cast<const std::byte*>(recv) + bytes * static_cast<std::size_t>(rank_)
            ? MPI_IN_PLACE
            : send;
    const int n = static_cast<int>(count);
    const MPI_Datatype type = type_of(dtype);
    return issue("all_gather", what, {}, [=, comm = comm_](MPI_Request* req) {
      return MPI_Iallgather(src, n, type, recv, n, type, comm, req);
    });
  }

  CommHandle reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype,
                            ReduceOp op, std::string_view what) override {
    const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
    stats_.reduce_scatter_bytes += bytes * static_cast<std::size_t>(world_);
    ++stats_.collectives;
    const int n = static_cast<int>(count);
    const MPI_Datatype type = type_of(dtype);
    if (world_ > 1 && device_.host_addressable()) {
      // Open MPI's non-blocking reduce-scatter (libnbc) reduces the whole buffer to rank 0 and
      // scatters it back: every other rank sends all of its data, where (P - 1) / P of it is
      // enough (measured: bench/tp_traffic.sh). An all-to-all sends exactly that.
      return scatter_then_sum("reduce_scatter", send, count, dtype, what,
                              [=](const std::vector<const void*>& chunks) {
                                reduce_in_tree_order(chunks, count, dtype, op, recv);
                              });
    }
    const MPI_Op sum = sum_of(dtype);
    return issue("reduce_scatter", what, averager(op, recv, count, dtype),
                 [=, comm = comm_](MPI_Request* req) {
                   return MPI_Ireduce_scatter_block(send, recv, n, type, sum, comm, req);
                 });
  }

  CommHandle reduce_scatter_wide(const void* send, float* recv, std::int64_t count, DType dtype,
                                 std::string_view what) override {
    if (!device_.host_addressable())
      return Communicator::reduce_scatter_wide(send, recv, count, dtype, what);
    stats_.reduce_scatter_bytes +=
        static_cast<std::uint64_t>(count) * dtype_size(dtype) * static_cast<std::uint64_t>(world_);
    ++stats_.collectives;
    return scatter_then_sum("reduce_scatter_wide", send, count, dtype, what,
                            [=](const std::vector<const void*>& chunks) {
                              sum_in_tree_order(chunks, count, dtype, recv);
                            });
  }

  CommHandle all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, ReduceOp op,
                        std::string_view what) override {
    const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
    stats_.all_reduce_bytes += bytes;
    ++stats_.collectives;
    const int n = static_cast<int>(count);
    const MPI_Datatype type = type_of(dtype);
    const MPI_Op sum = sum_of(dtype);
    if (send == recv && world_ >= 4 && bytes >= kCopiedAllReduceBytes &&
        device_.host_addressable()) {
      // Open MPI's non-blocking all-reduce sends 2 (P - 1) / P of the data from each rank
      // (reduce-scatter, then all-gather) from 64 KiB on 4 ranks or more, but only out of place:
      // in place it reduces to one rank and broadcasts back, sending up to twice that (measured:
      // bench/tp_traffic.sh). A large in-place call therefore sends from a copy, which the
      // request keeps until it is done.
      auto copy = std::make_shared<std::vector<std::byte>>(bytes);
      std::function<void()> average = averager(op, recv, count, dtype);
      return issue(
          "all_reduce", what,
          [average, copy] {
            if (average) average();
          },
          [=, comm = comm_](MPI_Request* req) {
            std::memcpy(copy->data(), recv, bytes);
            return MPI_Iallreduce(copy->data(), recv, n, type, sum, comm, req);
          });
    }
    const void* src = send == recv ? MPI_IN_PLACE : send;
    return issue("all_reduce", what, averager(op, recv, count, dtype),
                 [=, comm = comm_](MPI_Request* req) {
                   return MPI_Iallreduce(src, recv, n, type, sum, comm, req);
                 });
  }

  CommHandle broadcast(void* buffer, std::int64_t count, DType dtype, int root,
                       std::string_view what) override {
    ++stats_.collectives;
    const int n = static_cast<int>(count);
    const MPI_Datatype type = type_of(dtype);
    return issue("broadcast", what, {}, [=, comm = comm_](MPI_Request* req) {
      return MPI_Ibcast(buffer, n, type, root, comm, req);
    });
  }

  CommHandle send(const void* buffer, std::int64_t count, DType dtype, int peer,
                  std::string_view what) override {
    if (Status s = check_peer(*this, "send", peer, what); !s.is_ok()) {
      return CommHandle::done(std::move(s));
    }
    stats_.sent_bytes += static_cast<std::size_t>(count) * dtype_size(dtype);
    const int n = static_cast<int>(count);
    const MPI_Datatype type = type_of(dtype);
    // Synchronous (Issend): done only once the receive is posted, as NCCL's sends are, never
    // from a copy in MPI's buffers, so a schedule that would wait forever on NCCL does here too.
    return issue("send", what, {}, [=, comm = comm_](MPI_Request* req) {
      return MPI_Issend(buffer, n, type, peer, kPointToPointTag, comm, req);
    });
  }
  CommHandle recv(void* buffer, std::int64_t count, DType dtype, int peer,
                  std::string_view what) override {
    if (Status s = check_peer(*this, "recv", peer, what); !s.is_ok()) {
      return CommHandle::done(std::move(s));
    }
    const int n = static_cast<int>(count);
    const MPI_Datatype type = type_of(dtype);
    return issue("recv", what, {}, [=, comm = comm_](MPI_Request* req) {
      return MPI_Irecv(buffer, n, type, peer, kPointToPointTag, comm, req);
    });
  }

  CommHandle all_to_all_v(const void* send, std::span<const std::int64_t> send_counts, void* recv,
                          std::span<const std::int64_t> recv_counts, DType dtype,
                          std::string_view what) override {
    if (Status s = check_all_to_all(*this, send_counts, recv_counts, what); !s.is_ok()) {
      return CommHandle::done(std::move(s));
    }
    // MPI counts and places elements in ints: each side's total must fit one.
    struct Layout {
      std::vector<int> send_counts, send_at, recv_counts, recv_at;
    };
    auto layout = std::make_shared<Layout>();
    for (const auto& [counts, n, at] :
         {std::tuple{send_counts, &layout->send_counts, &layout->send_at},
          std::tuple{recv_counts, &layout->recv_counts, &layout->recv_at}}) {
      std::int64_t total = 0;
      for (const std::int64_t c : counts) {
        at->push_back(static_cast<int>(total));
        n->push_back(static_cast<int>(c));
        total += c;
      }
      if (total > std::numeric_limits<int>::max()) {
        return CommHandle::done(invalid_argument(
            "rank " + std::to_string(rank_) + ": all_to_all_v '" + std::string(what) + "' of " +
            std::to_string(total) + " elements: MPI counts elements in an int (at most " +
            std::to_string(std::numeric_limits<int>::max()) + "); send fewer at once"));
      }
    }
    for (int r = 0; r < world_; ++r) {
      if (r != rank_)
        stats_.all_to_all_bytes += static_cast<std::uint64_t>(send_counts[r]) * dtype_size(dtype);
    }
    ++stats_.collectives;
    const MPI_Datatype type = type_of(dtype);
    return issue("all_to_all_v", what, {}, [=, comm = comm_](MPI_Request* req) {
      return MPI_Ialltoallv(send, layout->send_counts.data(), layout->send_at.data(), type, recv,
                            layout->recv_counts.data(), layout->recv_at.data(), type, comm, req);
    });
  }

  Status barrier(std::string_view what) override {
    return issue("barrier", what, {},
                 [comm = comm_](MPI_Request* req) { return MPI_Ibarrier(comm, req); })
        .wait();
  }

  Status all_reduce_host(double* values, int count, ReduceOp op, std::string_view what) override {
    const int world = world_;
    auto finish = [=] {
      if (op == ReduceOp::kAvg) {
        for (int i = 0; i < count; ++i) values[i] /= world;
      }
    };
    return issue("all_reduce", what, finish,
                 [=, comm = comm_](MPI_Request* req) {
                   return MPI_Iallreduce(MPI_IN_PLACE, values, count, MPI_DOUBLE, MPI_SUM, comm,
                                         req);
                 })
        .wait();
  }

  Status all_gather_host(const std::uint64_t* send, std::uint64_t* recv, int count,
                         std::string_view what) override {
    return issue("all_gather", what, {},
                 [=, comm = comm_](MPI_Request* req) {
                   return MPI_Iallgather(send, count, MPI_UINT64_T, recv, count, MPI_UINT64_T, comm,
                                         req);
                 })
        .wait();
  }

  Result<std::unique_ptr<Communicator>> split(int color, int key, std::string_view what,
                                              device::StreamKind) override {
    // MPI has no non-blocking split: a timed all-gather first, so that a missing peer times out
    // here, and MPI_Comm_split only once every rank has arrived.
    const std::string label = "split '" + std::string(what) + "'";
    const std::uint64_t mine = static_cast<std::uint32_t>(color);
    std::vector<std::uint64_t> colors(static_cast<std::size_t>(world_));
    STRATA_RETURN_IF_ERROR(all_gather_host(&mine, colors.data(), 1, label));
    // On the heap: a split that times out may still complete later.
    struct Out {
      MPI_Comm comm = MPI_COMM_NULL;
      int rank = -1, world = 0;
    };
    auto out = std::make_shared<Out>();
    MpiRuntime& rt = runtime();
    std::lock_guard lock(rt.mu);
    std::future<std::string> done = rt.thread->submit(
        comm_, "MPI_Comm_split for " + label, [out, comm = comm_, color, key](MPI_Request*) {
          int rc = MPI_Comm_split(comm, color, key, &out->comm);
          if (rc == MPI_SUCCESS) rc = MPI_Comm_set_errhandler(out->comm, MPI_ERRORS_RETURN);
          if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(out->comm, &out->rank);
          if (rc == MPI_SUCCESS) rc = MPI_Comm_size(out->comm, &out->world);
          return rc;
        });
    STRATA_RETURN_IF_ERROR(wait_for_op(done, rank_, "MPI_Comm_split for " + label,
                                       std::chrono::steady_clock::now() + timeout_,
                                       probe_window(timeout_)));
    ++rt.users;
    CommOptions o;
    o.backend = CommBackend::kMpi;
    o.timeout = timeout_;
    return std::unique_ptr<Communicator>(
        std::make_unique<MpiCommunicator>(out->comm, out->rank, out->world, o, device_));
  }

  Status gather_host(const void* send, void* recv, std::int64_t count, DType dtype, int root,
                     std::string_view what) override {
    const int n = static_cast<int>(count);
    const MPI_Datatype type = type_of(dtype);
    return issue("gather", what, {},
                 [=, comm = comm_](MPI_Request* req) {
                   return MPI_Igather(send, n, type, recv, n, type, root, comm, req);
                 })
        .wait();
  }

 private:
  static constexpr std::chrono::seconds kShutdownGrace{1};

  static MPI_Datatype type_of(DType dtype) {
    switch (dtype) {
      case DType::kF32:
        return MPI_FLOAT;
      case DType::kBF16:
      case DType::kF16:
      case DType::kU16:
        return MPI_UINT16_T;
      case DType::kU32:
        return MPI_UINT32_T;
      case DType::kI32:
        return MPI_INT32_T;
      case DType::kI64:
        return MPI_INT64_T;
      case DType::kU8:
        return MPI_UINT8_T;
    }
    return MPI_BYTE;
  }
  static MPI_Op sum_of(DType dtype) {
    if (dtype == DType::kBF16) return runtime().bf16_sum;
    if (dtype == DType::kF16) return runtime().f16_sum;
    return MPI_SUM;
  }
  std::function<void()> averager(ReduceOp op, void* recv, std::int64_t count, DType dtype) const {
    if (op != ReduceOp::kAvg || world_ == 1) return {};
    const float inv = 1.0f / static_cast<float>(world_);
    const float world = static_cast<float>(world_);
    return [=] {
      for (std::int64_t i = 0; i < count; ++i) {
        const auto idx = static_cast<std::size_t>(i);
        switch (dtype) {
          case DType::kF32:
            static_cast<float*>(recv)[idx] /= world;
            break;
          case DType::kBF16: {
            auto* p = static_cast<bf16*>(recv) + idx;
            *p = f32_to_bf16(bf16_to_f32(*p) * inv);
            break;
          }
          case DType::kF16: {
            auto* p = static_cast<f16*>(recv) + idx;
            *p = f32_to_f16(f16_to_f32(*p) * inv);
            break;
          }
          default:
            break;
        }
      }
    };
  }
  // A reduce-scatter as an all-to-all (rank r's chunk j to rank j) and `sum` of the chunks this
  // rank received, in rank order, once they are here (the in-process communicator's arithmetic;
  // the request keeps the chunks until it is done).
  CommHandle scatter_then_sum(const char* op, const void* send, std::int64_t count, DType dtype,
                              std::string_view what,
                              std::function<void(const std::vector<const void*>&)> sum) {
    const std::size_t bytes = static_cast<std::size_t>(count) * dtype_size(dtype);
    auto chunks =
        std::make_shared<std::vector<std::byte>>(bytes * static_cast<std::size_t>(world_));
    const int world = world_, n = static_cast<int>(count);
    const MPI_Datatype type = type_of(dtype);
    return issue(
        op, what,
        [=] {
          std::vector<const void*> inputs;
          for (int r = 0; r < world; ++r) {
            inputs.push_back(chunks->data() + bytes * static_cast<std::size_t>(r));
          }
          sum(inputs);
        },
        [=, comm = comm_](MPI_Request* req) {
          return MPI_Ialltoall(send, n, type, chunks->data(), n, type, comm, req);
        });
  }
  // Queues the operation on the communication thread; its deadline starts now.
  CommHandle issue(const char* op, std::string_view what, std::function<void()> finish,
                   StartFn start) {
    std::string label = std::string(op) + " '" + std::string(what) + "'";
    CommThread& thread = *runtime().thread;
    std::future<std::string> done = thread.submit(comm_, label, std::move(start));
    return CommHandle(std::make_shared<MpiRequestState>(std::move(done), std::move(label), rank_,
                                                        std::chrono::steady_clock::now() + timeout_,
                                                        probe_window(timeout_), std::move(finish)));
  }

  static constexpr std::size_t kCopiedAllReduceBytes = std::size_t{64} << 10;
  // MPI orders messages of one tag between two ranks: sends and receives match in issue order.
  static constexpr int kPointToPointTag = 7;

  MPI_Comm comm_;
  std::chrono::seconds timeout_;
  device::Device& device_;
  int rank_ = 0, world_ = 1;
};

// The liveness probe's own duplicate of MPI_COMM_WORLD and every rank's host name, for the
// messages of timeouts; then the communication thread answers other ranks' probes.
Status start_listening(MpiRuntime& rt, int rank, int world,
                       std::chrono::steady_clock::time_point deadline,
                       std::chrono::milliseconds window) {
  struct Setup {  // on the heap: a timed-out step may still complete later
    MPI_Comm comm = MPI_COMM_NULL;
    std::array<char, MPI_MAX_PROCESSOR_NAME> mine{};
    std::vector<char> names;
  };
  auto setup = std::make_shared<Setup>();
  setup->names.resize(static_cast<std::size_t>(world) * MPI_MAX_PROCESSOR_NAME);
  std::future<std::string> done = rt.thread->submit(
      MPI_COMM_WORLD, "duplicating MPI_COMM_WORLD for liveness probes", [setup](MPI_Request* req) {
        int len = 0;
        MPI_Get_processor_name(setup->mine.data(), &len);
        return MPI_Comm_idup(MPI_COMM_WORLD, &setup->comm, req);
      });
  STRATA_RETURN_IF_ERROR(
      wait_for_op(done, rank, "duplicating MPI_COMM_WORLD for liveness probes", deadline, window));
  done = rt.thread->submit(setup->comm, "all_gather 'host names'", [setup](MPI_Request* req) {
    int rc = MPI_Comm_set_errhandler(setup->comm, MPI_ERRORS_RETURN);
    if (rc != MPI_SUCCESS) return rc;
    return MPI_Iallgather(setup->mine.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, setup->names.data(),
                          MPI_MAX_PROCESSOR_NAME, MPI_CHAR, setup->comm, req);
  });
  STRATA_RETURN_IF_ERROR(wait_for_op(done, rank, "all_gather 'host names'", deadline, window));
  rt.hosts.clear();
  for (int r = 0; r < world; ++r) {
    const char* name = setup->names.data() + static_cast<std::size_t>(r) * MPI_MAX_PROCESSOR_NAME;
    rt.hosts.emplace_back(name, strnlen(name, MPI_MAX_PROCESSOR_NAME));
  }
  done = rt.thread->submit(setup->comm, "listening", [&rt, setup, rank, world](MPI_Request*) {
    rt.probe = setup->comm;
    return rt.thread->listen(setup->comm, rank, world);
  });
  return wait_for_op(done, rank, "listening for liveness probes", deadline, window);
}

}  // namespace

Result<std::unique_ptr<Communicator>> make_mpi_communicator(const CommOptions& options,
                                                            device::Device& device) {
  if (!device.host_addressable()) {
    return unavailable(
        "the MPI communicator needs host-addressable buffers (device \"cpu\"); on "
        "GPUs use dist_backend \"nccl\"");
  }
  return make_mpi_host_communicator(options, device);
}

Result<std::unique_ptr<Communicator>> make_mpi_host_communicator(const CommOptions& options,
                                                                 device::Device& device) {
  MpiRuntime& rt = runtime();
  std::lock_guard lock(rt.mu);
  if (!rt.thread) {
    // No communication thread yet, so this thread may call MPI.
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (finalized) {
      return failed_precondition(
          "MPI was already finalized in this process (its last communicator was destroyed); "
          "keep one communicator alive for the whole run");
    }
    if (!initialized) {
      int provided = 0;
      if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
        return unavailable("MPI_Init_thread failed; is this process started by mpirun?");
      }
      rt.we_initialized = true;
    }
    int provided = 0;
    MPI_Query_thread(&provided);
    if (provided < MPI_THREAD_SERIALIZED) {
      return unavailable("the MPI library provides thread level " + std::to_string(provided) +
                         ", but the communication thread needs MPI_THREAD_SERIALIZED (" +
                         std::to_string(MPI_THREAD_SERIALIZED) +
                         "); use an MPI built with thread support");
    }
    if (rt.bf16_sum == MPI_OP_NULL) {
      MPI_Op_create(&half_sum<bf16, bf16_to_f32, f32_to_bf16>, 1, &rt.bf16_sum);
      MPI_Op_create(&half_sum<f16, f16_to_f32, f32_to_f16>, 1, &rt.f16_sum);
    }
    rt.thread = std::make_unique<CommThread>();
  }
  // Duplicating MPI_COMM_WORLD is collective: non-blocking, so a missing peer times out. The
  // results live on the heap because a timed-out duplication may still complete later.
  struct Dup {
    MPI_Comm comm = MPI_COMM_NULL;
    std::atomic<int> rank{-1};  // read for the message of a timed-out duplication
    int world = 0;
  };
  auto dup = std::make_shared<Dup>();
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  const std::chrono::milliseconds window = probe_window(options.timeout);
  std::future<std::string> duplicated =
      rt.thread->submit(MPI_COMM_WORLD, "duplicating MPI_COMM_WORLD", [dup](MPI_Request* req) {
        int rank = -1;
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        dup->rank = rank;
        MPI_Comm_size(MPI_COMM_WORLD, &dup->world);
        return MPI_Comm_idup(MPI_COMM_WORLD, &dup->comm, req);
      });
  Status s = wait_for_op(duplicated, dup->rank, "duplicating MPI_COMM_WORLD", deadline, window);
  if (s.is_ok()) {
    // Errors come back as return codes, so they become a Status naming the rank and operation.
    std::future<std::string> setup = rt.thread->submit(
        dup->comm, "MPI_Comm_set_errhandler",
        [dup](MPI_Request*) { return MPI_Comm_set_errhandler(dup->comm, MPI_ERRORS_RETURN); });
    s = wait_for_op(setup, dup->rank, "MPI_Comm_set_errhandler", deadline, window);
  }
  if (s.is_ok() && rt.probe == MPI_COMM_NULL) {
    s = start_listening(rt, dup->rank, dup->world, deadline, window);
  }
  if (!s.is_ok()) {
    if (rt.users == 0) rt.thread.reset();  // a timed-out duplication stays in flight: no finalize
    rt.unclean = true;
    return s;
  }
  ++rt.users;
  return std::unique_ptr<Communicator>(
      std::make_unique<MpiCommunicator>(dup->comm, dup->rank, dup->world, options, device));
}

}  // namespace strata::dist

#endif  // STRATA_HAVE_MPI
