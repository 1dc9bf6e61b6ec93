// Ranks as threads of one process: a group of communicators that meet at one rendezvous, for
// testing multi-rank logic without mpirun. The reductions sum the ranks in the canonical tree
// (reduce_in_tree_order), as the MPI path's reduce-scatter does.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "src/dist/rank_order.h"
#include "strata/core/check.h"
#include "strata/device/device.h"
#include "strata/dist/communicator.h"

namespace strata::dist {
namespace {

enum class OpKind : std::uint8_t {
  kAllGather,
  kReduceScatter,
  kReduceScatterWide,
  kAllReduce,
  kBroadcast,
  kBarrier,
  kAllReduceHost,
  kAllGatherHost,
  kGatherHost,
  kAllToAllV,
  kSplit
};

const char* op_name(OpKind k) {
  switch (k) {
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kReduceScatterWide:
      return "reduce_scatter_wide";
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kBroadcast:
      return "broadcast";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kAllReduceHost:
      return "all_reduce_host";
    case OpKind::kAllGatherHost:
      return "all_gather_host";
    case OpKind::kGatherHost:
      return "gather_host";
    case OpKind::kAllToAllV:
      return "all_to_all_v";
    case OpKind::kSplit:
      return "split";
  }
  return "?";
}

// One rank's part in a collective.
struct Call {
  OpKind kind = OpKind::kBarrier;
  const void* send = nullptr;
  void* recv = nullptr;
  std::int64_t count = 0;
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  std::string what;
  // all_to_all_v: the counts to and from each rank.
  std::vector<std::int64_t> send_counts{}, recv_counts{};
  // split: this rank's color and key, its device, and where its new communicator goes.
  int color = 0, key = 0;
  device::Device* device = nullptr;
  std::unique_ptr<Communicator>* made = nullptr;
};

class Rendezvous;
// A member of the group meeting at `meet` (defined with the communicator, below).
std::unique_ptr<Communicator> make_member(std::shared_ptr<Rendezvous> meet, int rank, int world,
                                          device::Device& device);

std::string describe(int rank, const Call& c) {
  return "rank " + std::to_string(rank) + ": " + op_name(c.kind) + " '" + c.what + "' (" +
         std::to_string(c.count) + " x " + std::string(dtype_name(c.dtype)) + ")";
}

// out[i] = op over ranks of in_r[offset + i], as reduce_in_tree_order folds it.
void reduce(const std::vector<Call>& calls, std::int64_t offset, std::int64_t count, DType dtype,
            ReduceOp op, void* out) {
  const std::size_t at = static_cast<std::size_t>(offset) * dtype_size(dtype);
  std::vector<const void*> inputs;
  for (const Call& c : calls) inputs.push_back(static_cast<const std::byte*>(c.send) + at);
  reduce_in_tree_order(inputs, count, dtype, op, out);
}

// The meeting point of one group: the last rank to arrive at a collective carries it out for
// every rank, while the others wait; all leave together, so every buffer stays valid throughout.
class Rendezvous {
 public:
  Rendezvous(int world, std::chrono::milliseconds timeout)
      : world_(world),
        timeout_(timeout),
        calls_(static_cast<std::size_t>(world)),
        here_(static_cast<std::size_t>(world), false) {}

  Status meet(int rank, Call call) {
    std::unique_lock lock(mu_);
    if (!broken_.is_ok()) return broken_;
    const std::uint64_t generation = generation_;
    calls_[static_cast<std::size_t>(rank)] = std::move(call);
    here_[static_cast<std::size_t>(rank)] = true;
    if (++arrived_ < world_) {
      const bool done = cv_.wait_for(lock, timeout_,
                                     [&] { return generation_ != generation || !broken_.is_ok(); });
      if (!broken_.is_ok()) return broken_;
      if (!done) {
        broken_ = unavailable(describe(rank, calls_[static_cast<std::size_t>(rank)]) +
                              " did not complete in time; " + absent() +
                              " not reached it: died or stuck (raise the timeout if it is only "
                              "slow)");
        cv_.notify_all();
        return broken_;
      }
      return status_;
    }
    status_ = carry_out();
    if (!status_.is_ok()) broken_ = status_;
    arrived_ = 0;
    here_.assign(here_.size(), false);
    ++generation_;
    cv_.notify_all();
    return status_;
  }

 public:
  void post(int from, int to, const void* buffer, std::int64_t count, DType dtype,
            std::string_view what) {
    const auto* p = static_cast<const std::byte*>(buffer);
    Message m{std::vector<std::byte>(p, p + static_cast<std::size_t>(count) * dtype_size(dtype)),
              count, dtype, std::string(what)};
    std::lock_guard lock(mu_);
    Pair& pair = pairs_[{from, to}];
    pair.mail.emplace(pair.sent++, std::move(m));
    cv_.notify_all();
  }
  // The place of the next receive from `from` at `to` among the pair's messages: receives match
  // sends in the order each side issues them, however late each is waited for.
  std::uint64_t ticket(int from, int to) {
    std::lock_guard lock(mu_);
    return pairs_[{from, to}].tickets++;
  }
  bool arrived(int from, int to, std::uint64_t ticket) {
    std::lock_guard lock(mu_);
    return pairs_[{from, to}].mail.contains(ticket);
  }
  Status take(int from, int to, std::uint64_t ticket, void* buffer, std::int64_t count, DType dtype,
              std::string_view what) {
    std::unique_lock lock(mu_);
    auto& mail = pairs_[{from, to}].mail;
    if (!cv_.wait_for(lock, timeout_, [&] { return mail.contains(ticket); })) {
      return unavailable("rank " + std::to_string(to) + ": recv '" + std::string(what) +
                         "' from rank " + std::to_string(from) +
                         " did not complete in time; a peer rank may have died or be stuck "
                         "(raise the timeout if it is only slow)");
    }
    auto it = mail.find(ticket);
    Message m = std::move(it->second);
    mail.erase(it);
    if (m.count != count || m.dtype != dtype) {
      return failed_precondition(
          "rank " + std::to_string(to) + ": recv '" + std::string(what) + "' of " +
          std::to_string(count) + " x " + std::string(dtype_name(dtype)) + " from rank " +
          std::to_string(from) + " met its send '" + m.what + "' of " + std::to_string(m.count) +
          " x " + std::string(dtype_name(m.dtype)));
    }
    std::memcpy(buffer, m.data.data(), m.data.size());
    return Status::ok();
  }

 private:
  // Every rank has arrived: checks that they agree, then fills every rank's output.
  Status carry_out() {
    const Call& c0 = calls_[0];
    for (int r = 1; r < world_; ++r) {
      const Call& c = calls_[static_cast<std::size_t>(r)];
      if (c.kind != c0.kind || c.count != c0.count || c.dtype != c0.dtype || c.op != c0.op ||
          c.root != c0.root) {
        return failed_precondition(
            "ranks disagree on a collective: " + describe(0, c0) + ", but " + describe(r, c) +
            "; every rank must issue the same collectives in the same order");
      }
    }
    if (c0.kind == OpKind::kSplit) return split();
    if (c0.kind == OpKind::kAllToAllV) return all_to_all_v();
    const std::int64_t n = c0.count;
    const DType dtype = c0.dtype;
    const std::size_t bytes = static_cast<std::size_t>(n) * dtype_size(dtype);
    switch (c0.kind) {
      case OpKind::kBarrier:
      case OpKind::kSplit:      // split() above
      case OpKind::kAllToAllV:  // all_to_all_v() above
        return Status::ok();
      case OpKind::kAllGather:
      case OpKind::kAllGatherHost: {
        // Gathered first, then written: a rank's send may lie inside its own recv (in place).
        std::vector<std::byte> all(bytes * static_cast<std::size_t>(world_));
        for (int r = 0; r < world_; ++r) {
          std::memcpy(all.data() + bytes * static_cast<std::size_t>(r),
                      calls_[static_cast<std::size_t>(r)].send, bytes);
        }
        for (const Call& c : calls_) std::memcpy(c.recv, all.data(), all.size());
        return Status::ok();
      }
      case OpKind::kGatherHost: {
        std::vector<std::byte> all(bytes * static_cast<std::size_t>(world_));
        for (int r = 0; r < world_; ++r) {
          std::memcpy(all.data() + bytes * static_cast<std::size_t>(r),
                      calls_[static_cast<std::size_t>(r)].send, bytes);
        }
        std::memcpy(calls_[static_cast<std::size_t>(c0.root)].recv, all.data(), all.size());
        return Status::ok();
      }
      case OpKind::kBroadcast: {
        const Call& root = calls_[static_cast<std::size_t>(c0.root)];
        for (const Call& c : calls_) {
          if (c.recv != root.recv) std::memcpy(c.recv, root.recv, bytes);
        }
        return Status::ok();
      }
      case OpKind::kAllReduce: {
        std::vector<std::byte> out(bytes);
        reduce(calls_, 0, n, dtype, c0.op, out.data());
        for (const Call& c : calls_) std::memcpy(c.recv, out.data(), bytes);
        return Status::ok();
      }
      case OpKind::kReduceScatter: {
        std::vector<std::vector<std::byte>> out(static_cast<std::size_t>(world_),
                                                std::vector<std::byte>(bytes));
        for (int r = 0; r < world_; ++r) {
          reduce(calls_, n * r, n, dtype, c0.op, out[static_cast<std::size_t>(r)].data());
        }
        for (int r = 0; r < world_; ++r) {
          std::memcpy(calls_[static_cast<std::size_t>(r)].recv,
                      out[static_cast<std::size_t>(r)].data(), bytes);
        }
        return Status::ok();
      }
      case OpKind::kReduceScatterWide: {  // every rank's block summed into its f32 recv
        const std::size_t at = static_cast<std::size_t>(n) * dtype_size(dtype);
        for (int r = 0; r < world_; ++r) {
          std::vector<const void*> inputs;
          for (const Call& c : calls_) {
            inputs.push_back(static_cast<const std::byte*>(c.send) +
                             at * static_cast<std::size_t>(r));
          }
          sum_in_tree_order(inputs, n, dtype,
                            static_cast<float*>(calls_[static_cast<std::size_t>(r)].recv));
        }
        return Status::ok();
      }
      case OpKind::kAllReduceHost: {
        // As the MPI path: a sum of doubles, then a division by the rank count.
        std::vector<double> sum(static_cast<std::size_t>(n), 0.0);
        for (const Call& c : calls_) {
          const auto* v = static_cast<const double*>(c.send);
          for (std::int64_t i = 0; i < n; ++i) sum[static_cast<std::size_t>(i)] += v[i];
        }
        if (c0.op == ReduceOp::kAvg) {
          for (double& s : sum) s /= world_;
        }
        for (const Call& c : calls_) std::memcpy(c.recv, sum.data(), sum.size() * sizeof(double));
        return Status::ok();
      }
    }
    return internal_error("unknown collective");
  }

  // Each pair's counts checked against each other, then every block copied to its rank.
  Status all_to_all_v() {
    const auto world = static_cast<std::size_t>(world_);
    for (std::size_t a = 0; a < world; ++a) {
      for (std::size_t b = 0; b < world; ++b) {
        const std::int64_t sent = calls_[a].send_counts[b], expected = calls_[b].recv_counts[a];
        if (sent != expected) {
          return failed_precondition(
              "ranks disagree on all_to_all_v '" + calls_[a].what + "': rank " + std::to_string(a) +
              " sends " + std::to_string(sent) + " elements to rank " + std::to_string(b) +
              ", which expects " + std::to_string(expected) + " from it");
        }
      }
    }
    const std::size_t element = dtype_size(calls_[0].dtype);
    std::vector<std::size_t> recv_at(world, 0);  // where each receiver's next block lands
    for (std::size_t a = 0; a < world; ++a) {    // senders in rank order: each receiver's order
      const auto* from = static_cast<const std::byte*>(calls_[a].send);
      for (std::size_t b = 0; b < world; ++b) {
        const std::size_t bytes = static_cast<std::size_t>(calls_[a].send_counts[b]) * element;
        if (bytes > 0)
          std::memcpy(static_cast<std::byte*>(calls_[b].recv) + recv_at[b], from, bytes);
        from += bytes;
        recv_at[b] += bytes;
      }
    }
    return Status::ok();
  }

  // One new group per color, its members ordered by key, then by rank.
  Status split() {
    std::vector<int> order(static_cast<std::size_t>(world_));
    for (int r = 0; r < world_; ++r) order[static_cast<std::size_t>(r)] = r;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      const Call& ca = calls_[static_cast<std::size_t>(a)];
      const Call& cb = calls_[static_cast<std::size_t>(b)];
      return ca.color != cb.color ? ca.color < cb.color : ca.key < cb.key;
    });
    for (std::size_t i = 0; i < order.size();) {
      std::size_t j = i;
      const int color = calls_[static_cast<std::size_t>(order[i])].color;
      while (j < order.size() && calls_[static_cast<std::size_t>(order[j])].color == color) ++j;
      const auto size = static_cast<int>(j - i);
      auto meet = std::make_shared<Rendezvous>(size, timeout_);
      for (std::size_t m = i; m < j; ++m) {
        const Call& c = calls_[static_cast<std::size_t>(order[m])];
        *c.made = make_member(meet, static_cast<int>(m - i), size, *c.device);
      }
      i = j;
    }
    return Status::ok();
  }

  const int world_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  // Point-to-point messages not yet received, per (sender, receiver), in sending order.
  struct Message {
    std::vector<std::byte> data;
    std::int64_t count;
    DType dtype;
    std::string what;
  };
  // One direction between two ranks: its messages by their place in the order sent, how many
  // were sent and how many receives were issued.
  struct Pair {
    std::map<std::uint64_t, Message> mail;
    std::uint64_t sent = 0, tickets = 0;
  };
  std::map<std::pair<int, int>, Pair> pairs_;  // under mu_: (from, to)
  std::vector<Call> calls_;                    // under mu_
  std::vector<bool> here_;                     // under mu_: the ranks at the collective now
  // "rank 1 has", "ranks 1, 3 have": the ranks of the group not at the collective. Under mu_.
  std::string absent() const {
    std::string ranks;
    int n = 0;
    for (std::size_t r = 0; r < here_.size(); ++r) {
      if (here_[r]) continue;
      ranks += (n++ > 0 ? ", " : "") + std::to_string(r);
    }
    return (n == 1 ? "rank " + ranks + " has" : "ranks " + ranks + " have");
  }

  int arrived_ = 0;               // under mu_
  std::uint64_t generation_ = 0;  // under mu_: collectives completed
  Status status_;                 // under mu_: the last collective's
  Status broken_;  // under mu_: once a collective failed or timed out, every later one
};

class InProcessCommunicator final : public Communicator {
 public:
  InProcessCommunicator(std::shared_ptr<Rendezvous> meet, int rank, int world,
                        device::Device& device)
      : meet_(std::move(meet)), rank_(rank), world_(world), device_(device) {}

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string name() const override { return "in-process"; }

  CommHandle all_gather(const void* send, void* recv, std::int64_t count, DType dtype,
                        std::string_view what) override {
    stats_.all_gather_bytes += bytes(count, dtype) * static_cast<std::uint64_t>(world_);
    return done(device_call(OpKind::kAllGather, send, recv, count, dtype, ReduceOp::kSum, 0, what));
  }
  CommHandle reduce_scatter(const void* send, void* recv, std::int64_t count, DType dtype,
                            ReduceOp op, std::string_view what) override {
    stats_.reduce_scatter_bytes += bytes(count, dtype) * static_cast<std::uint64_t>(world_);
    return done(device_call(OpKind::kReduceScatter, send, recv, count, dtype, op, 0, what));
  }
  CommHandle reduce_scatter_wide(const void* send, float* recv, std::int64_t count, DType dtype,
                                 std::string_view what) override {
    stats_.reduce_scatter_bytes += bytes(count, dtype) * static_cast<std::uint64_t>(world_);
    return done(
        device_call(OpKind::kReduceScatterWide, send, recv, count, dtype, ReduceOp::kSum, 0, what));
  }
  CommHandle all_reduce(const void* send, void* recv, std::int64_t count, DType dtype, ReduceOp op,
                        std::string_view what) override {
    stats_.all_reduce_bytes += bytes(count, dtype);
    return done(device_call(OpKind::kAllReduce, send, recv, count, dtype, op, 0, what));
  }
  CommHandle broadcast(void* buffer, std::int64_t count, DType dtype, int root,
                       std::string_view what) override {
    return done(
        device_call(OpKind::kBroadcast, buffer, buffer, count, dtype, ReduceOp::kSum, root, what));
  }
  Status barrier(std::string_view what) override {
    return call(OpKind::kBarrier, nullptr, nullptr, 0, DType::kU8, ReduceOp::kSum, 0, what);
  }
  CommHandle all_to_all_v(const void* send, std::span<const std::int64_t> send_counts, void* recv,
                          std::span<const std::int64_t> recv_counts, DType dtype,
                          std::string_view what) override {
    if (Status s = check_all_to_all(*this, send_counts, recv_counts, what); !s.is_ok()) {
      return done(std::move(s));
    }
    for (int r = 0; r < world_; ++r) {
      if (r != rank_) stats_.all_to_all_bytes += bytes(send_counts[r], dtype);
    }
    ++stats_.collectives;
    device_.stream(device::StreamKind::kCompute).synchronize();
    Call c{OpKind::kAllToAllV, send, recv, 0, dtype, ReduceOp::kSum, 0, std::string(what)};
    c.send_counts.assign(send_counts.begin(), send_counts.end());
    c.recv_counts.assign(recv_counts.begin(), recv_counts.end());
    return done(meet_->meet(rank_, std::move(c)));
  }
  // A send leaves a copy in the pair's mailbox and is done; a receive takes its place in the
  // pair's order now and waits for that message when its handle is waited for (a stage posts its
  // receives ahead of the work its peer waits for, as with MPI's Irecv).
  CommHandle send(const void* buffer, std::int64_t count, DType dtype, int peer,
                  std::string_view what) override {
    if (Status s = check_peer(*this, "send", peer, what); !s.is_ok()) return done(std::move(s));
    stats_.sent_bytes += bytes(count, dtype);
    device_.stream(device::StreamKind::kCompute).synchronize();
    meet_->post(rank_, peer, buffer, count, dtype, what);
    return {};
  }
  CommHandle recv(void* buffer, std::int64_t count, DType dtype, int peer,
                  std::string_view what) override {
    if (Status s = check_peer(*this, "recv", peer, what); !s.is_ok()) return done(std::move(s));
    struct Receive final : CommHandle::State {
      Receive(std::shared_ptr<Rendezvous> m, int f, int t, std::uint64_t k, void* b, std::int64_t c,
              DType d, std::string_view w)
          : meet(std::move(m)), from(f), to(t), ticket(k), buffer(b), count(c), dtype(d), what(w) {}
      Status wait() override { return meet->take(from, to, ticket, buffer, count, dtype, what); }
      bool ready() override { return meet->arrived(from, to, ticket); }
      std::shared_ptr<Rendezvous> meet;
      int from, to;
      std::uint64_t ticket;
      void* buffer;
      std::int64_t count;
      DType dtype;
      std::string what;
    };
    const std::uint64_t ticket = meet_->ticket(peer, rank_);
    return CommHandle(
        std::make_shared<Receive>(meet_, peer, rank_, ticket, buffer, count, dtype, what));
  }
  Status all_reduce_host(double* values, int count, ReduceOp op, std::string_view what) override {
    return call(OpKind::kAllReduceHost, values, values, count, DType::kI64, op, 0, what);
  }
  Status all_gather_host(const std::uint64_t* send, std::uint64_t* recv, int count,
                         std::string_view what) override {
    return call(OpKind::kAllGatherHost, send, recv, count, DType::kI64, ReduceOp::kSum, 0, what);
  }
  Status gather_host(const void* send, void* recv, std::int64_t count, DType dtype, int root,
                     std::string_view what) override {
    return call(OpKind::kGatherHost, send, recv, count, dtype, ReduceOp::kSum, root, what);
  }
  Result<std::unique_ptr<Communicator>> split(int color, int key, std::string_view what,
                                              device::StreamKind) override {
    std::unique_ptr<Communicator> made;
    Call c{OpKind::kSplit, nullptr, nullptr, 0, DType::kU8, ReduceOp::kSum, 0, std::string(what)};
    c.color = color;
    c.key = key;
    c.device = &device_;
    c.made = &made;
    STRATA_RETURN_IF_ERROR(meet_->meet(rank_, std::move(c)));
    return made;
  }

 private:
  static std::uint64_t bytes(std::int64_t count, DType dtype) {
    return static_cast<std::uint64_t>(count) * dtype_size(dtype);
  }
  static CommHandle done(Status s) { return CommHandle::done(std::move(s)); }
  // Device buffers: what the compute stream wrote before the call is read.
  Status device_call(OpKind kind, const void* send, void* recv, std::int64_t count, DType dtype,
                     ReduceOp op, int root, std::string_view what) {
    ++stats_.collectives;
    device_.stream(device::StreamKind::kCompute).synchronize();
    return call(kind, send, recv, count, dtype, op, root, what);
  }
  Status call(OpKind kind, const void* send, void* recv, std::int64_t count, DType dtype,
              ReduceOp op, int root, std::string_view what) {
    if (root < 0 || root >= world_) {
      return invalid_argument("rank " + std::to_string(rank_) + ": " + op_name(kind) + " '" +
                              std::string(what) + "' root " + std::to_string(root) +
                              " is not a rank of " + std::to_string(world_));
    }
    Call c{kind, send, recv, count, dtype, op, root, std::string(what)};
    return meet_->meet(rank_, std::move(c));
  }

  std::shared_ptr<Rendezvous> meet_;
  int rank_, world_;
  device::Device& device_;
};

std::unique_ptr<Communicator> make_member(std::shared_ptr<Rendezvous> meet, int rank, int world,
                                          device::Device& device) {
  return std::make_unique<InProcessCommunicator>(std::move(meet), rank, world, device);
}

}  // namespace

Result<std::vector<std::unique_ptr<Communicator>>> make_in_process_group(
    const std::vector<device::Device*>& devices, std::chrono::milliseconds timeout) {
  if (devices.empty()) return invalid_argument("an in-process group needs at least one rank");
  const auto world = static_cast<int>(devices.size());
  auto meet = std::make_shared<Rendezvous>(world, timeout);
  std::vector<std::unique_ptr<Communicator>> group;
  for (int r = 0; r < world; ++r) {
    device::Device* d = devices[static_cast<std::size_t>(r)];
    if (d == nullptr || !d->host_addressable()) {
      return invalid_argument("in-process rank " + std::to_string(r) +
                              ": its device must address host memory (the CPU backend)");
    }
    group.push_back(make_member(meet, r, world, *d));
  }
  return group;
}

}  // namespace strata::dist
