// The MPI communicator's communication thread (private): the one thread that makes every MPI
// call after MPI_Init_thread, and the liveness probe it answers and asks. Built when
// STRATA_HAVE_MPI.
#pragma once

#include <mpi.h>
#include <pthread.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <list>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace strata::dist::detail {

inline std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, buf, &len);
  return std::string(buf, static_cast<std::size_t>(len));
}

// Starts one MPI operation on the communication thread: a non-blocking call that fills *req, or
// a blocking one that leaves *req as MPI_REQUEST_NULL. Returns the MPI error code.
using StartFn = std::function<int(MPI_Request*)>;

// The thread that makes every MPI call after MPI_Init_thread. With Open MPI a non-blocking
// collective only moves inside MPI calls, so without this thread nothing would happen while the
// caller computes between issuing a collective and waiting for it. Operations start in issue
// order (the order every rank must agree on) and are then tested until they finish; one thread
// calling MPI needs only MPI_THREAD_SERIALIZED. While operations are in flight it tests them with
// a backoff of at most kMaxBackoff (measured: under a tenth of a core while a collective waits on
// a peer); with none it sleeps on a condition variable, taking nothing from compute.
class CommThread {
 public:
  CommThread() : thread_([this] { loop(); }) {
    pthread_setname_np(thread_.native_handle(), "strata-mpi");  // for top and debuggers
  }
  ~CommThread() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  CommThread(const CommThread&) = delete;
  CommThread& operator=(const CommThread&) = delete;

  // Queues `start`, named `label` in what this rank answers a liveness probe; the future holds ""
  // on success or the MPI error text once it has finished.
  std::future<std::string> submit(MPI_Comm comm, std::string label, StartFn start) {
    Pending p{comm, std::move(label), std::move(start), {}};
    std::future<std::string> done = p.done.get_future();
    {
      std::lock_guard lock(mu_);
      if (failed_) {
        p.done.set_value(failed_text_);
        return done;
      }
      queue_.push_back(std::move(p));
    }
    cv_.notify_one();
    return done;
  }
  // After a wait timed out: this process makes no MPI call again. A collective still in flight
  // moves only inside MPI calls, so it can no longer write into buffers its waiter gave up on
  // (and freed); the run is ending with that timeout's error anyway. Later operations fail at
  // once, naming the cause.
  // `why`: the operation that timed out, named in what every later one answers.
  void fail(const std::string& why) {
    {
      std::lock_guard lock(mu_);
      if (!failed_) failed_text_ = "not run: " + why + ", and this process makes no more MPI calls";
      failed_ = true;
    }
    cv_.notify_one();
  }
  bool failed() {
    std::lock_guard lock(mu_);
    return failed_;
  }
  // Operations on `comm` still in flight after testing them all once; only for StartFns, which
  // run on this thread.
  int in_flight(MPI_Comm comm) {
    test_active();
    int n = 0;
    for (const Active& a : active_) n += a.comm == comm ? 1 : 0;
    return n;
  }

  // From now on answers other ranks' liveness probes on `probe` (this process's own duplicate of
  // MPI_COMM_WORLD, used for nothing else) with what it has in flight. Only from a StartFn.
  int listen(MPI_Comm probe, int rank, int world) {
    probe_comm_ = probe;
    world_rank_ = rank;
    world_size_ = world;
    return post_listener();
  }
  // Stops answering (a clean shutdown): the posted receive is cancelled. Only from a StartFn.
  int stop_listening() {
    if (probe_comm_ == MPI_COMM_NULL) return MPI_SUCCESS;
    if (ping_ != MPI_REQUEST_NULL) {
      MPI_Cancel(&ping_);
      MPI_Wait(&ping_, MPI_STATUS_IGNORE);
    }
    for (Answer& a : answers_) MPI_Wait(&a.req, MPI_STATUS_IGNORE);
    answers_.clear();
    const int rc = MPI_Comm_free(&probe_comm_);
    probe_comm_ = MPI_COMM_NULL;
    return rc;
  }

  // What each rank of the job answered a liveness probe (its operations in flight, or how long
  // it has been idle), or nothing where it did not answer within the window; empty where this
  // process does not listen (yet).
  using Answers = std::vector<std::optional<std::string>>;
  // Asks every other rank what it is doing and waits at most `window` for the answers. A second
  // call while one runs shares it. Call before fail(): a failed thread asks nothing.
  std::shared_future<Answers> probe(std::chrono::milliseconds window) {
    {
      std::lock_guard lock(mu_);
      if (!probe_asked_) {
        probe_asked_ = true;
        probe_window_ = window;
        probe_answers_ = probe_done_.get_future().share();
      }
    }
    cv_.notify_one();
    return probe_answers_;
  }

 private:
  struct Pending {
    MPI_Comm comm;
    std::string label;
    StartFn start;
    std::promise<std::string> done;
  };
  struct Active {
    MPI_Comm comm;
    std::string label;
    MPI_Request req;
    std::promise<std::string> done;
    StartFn start;  // keeps what it captured (results MPI writes on completion) alive until then
  };
  // What a rank answers a probe: text of at most kAnswerBytes - 1 characters.
  static constexpr int kAnswerBytes = 240;
  using AnswerText = std::array<char, kAnswerBytes>;
  struct Answer {  // a reply being sent
    MPI_Request req = MPI_REQUEST_NULL;
    AnswerText text{};
  };
  struct Probing {  // this rank's own probe, in flight
    std::chrono::steady_clock::time_point deadline;
    std::vector<MPI_Request> pings, replies;
    std::vector<AnswerText> texts;
    std::vector<bool> answered;
  };
  static constexpr int kPingTag = 1, kReplyTag = 2;
  // How often an idle thread looks for a probe to answer: a probe waits a second or more.
  static constexpr std::chrono::milliseconds kIdleListen{20};
  // Longest pause between tests of in-flight operations: bounds the latency added to each round
  // of a collective's schedule, and the CPU the thread takes while waiting (see class comment).
  static constexpr std::chrono::microseconds kMaxBackoff{100};

  void loop() {
    auto backoff = std::chrono::microseconds(0);
    for (;;) {
      std::deque<Pending> batch;
      {
        std::unique_lock lock(mu_);
        auto woken = [this] {
          return stop_ || !queue_.empty() || (probe_asked_ && !probe_started_);
        };
        if (active_.empty() && !probe_open_) {
          if (probe_comm_ == MPI_COMM_NULL || failed_) {
            cv_.wait(lock, woken);
          } else {
            cv_.wait_for(lock, kIdleListen, woken);
          }
        } else if (backoff.count() > 0) {
          cv_.wait_for(lock, backoff, woken);
        }
        if (stop_) break;
        batch.swap(queue_);
        if (failed_) {
          for (Pending& p : batch) p.done.set_value(failed_text_);
          for (Active& a : active_) a.done.set_value(failed_text_);
          active_.clear();  // never tested again; their keep-alives are released
          if (probe_asked_ && !probe_started_) {
            probe_started_ = true;
            probe_done_.set_value({});
          } else if (probe_open_) {
            probe_open_ = false;
            probe_done_.set_value({});
          }
          backoff = std::chrono::microseconds(0);
          continue;
        }
        if (probe_asked_ && !probe_started_) start_probe();
      }
      bool progressed = !batch.empty();
      for (Pending& p : batch) {
        MPI_Request req = MPI_REQUEST_NULL;
        const int rc = p.start(&req);
        if (rc != MPI_SUCCESS) {
          p.done.set_value(mpi_error_string(rc));
        } else if (req == MPI_REQUEST_NULL) {
          note_finished(p.label);
          p.done.set_value("");
        } else {
          active_.push_back(
              Active{p.comm, std::move(p.label), req, std::move(p.done), std::move(p.start)});
        }
      }
      if (test_active()) progressed = true;
      if (answer_probes()) progressed = true;
      if (probe_open_) test_probe();
      backoff = progressed ? std::chrono::microseconds(0)
                           : std::min(kMaxBackoff, backoff * 2 + std::chrono::microseconds(5));
    }
    // Shutting down with operations in flight: their peers may be dead, so nothing more is
    // tested; waiters (there should be none) learn they were abandoned.
    std::lock_guard lock(mu_);
    for (Pending& p : queue_) p.done.set_value("not started: the MPI communicator shut down");
    for (Active& a : active_) a.done.set_value("abandoned: the MPI communicator shut down");
  }

  // Tests every operation in flight once (each MPI_Test also moves all of them along); completes
  // the finished ones. Returns whether any finished.
  bool test_active() {
    bool finished = false;
    for (auto it = active_.begin(); it != active_.end();) {
      int done = 0;
      const int rc = MPI_Test(&it->req, &done, MPI_STATUS_IGNORE);
      if (rc != MPI_SUCCESS || done) {
        note_finished(it->label);
        it->done.set_value(rc == MPI_SUCCESS ? "" : mpi_error_string(rc));
        it = active_.erase(it);
        finished = true;
      } else {
        ++it;
      }
    }
    return finished;
  }
  void note_finished(const std::string& label) {
    last_label_ = label;
    last_done_ = std::chrono::steady_clock::now();
  }

  int post_listener() {
    return MPI_Irecv(&ping_byte_, 1, MPI_BYTE, MPI_ANY_SOURCE, kPingTag, probe_comm_, &ping_);
  }
  // What this rank is doing, as it answers a probe.
  AnswerText state() const {
    std::string text;
    if (!active_.empty()) {
      text = "waiting in ";
      int named = 0;
      for (const Active& a : active_) {
        if (named++ == 3) {
          text += " and " + std::to_string(active_.size() - 3) + " more";
          break;
        }
        text += (named > 1 ? ", " : "") + a.label;
      }
    } else if (last_label_.empty()) {
      text = "idle, before its first operation";
    } else {
      const double idle =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - last_done_).count();
      char secs[32];
      std::snprintf(secs, sizeof secs, "%.1f", idle);
      text = "idle for " + std::string(secs) + " s since " + last_label_ + " finished";
    }
    AnswerText out{};
    std::memcpy(out.data(), text.data(), std::min<std::size_t>(text.size(), kAnswerBytes - 1));
    return out;
  }
  // Answers the probes that have come in; sends finish on later passes. Returns whether any came.
  bool answer_probes() {
    if (probe_comm_ == MPI_COMM_NULL) return false;
    for (auto it = answers_.begin(); it != answers_.end();) {
      int done = 0;
      if (MPI_Test(&it->req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS || done) {
        it = answers_.erase(it);
      } else {
        ++it;
      }
    }
    bool any = false;
    for (;;) {
      int came = 0;
      MPI_Status status;
      if (ping_ == MPI_REQUEST_NULL || MPI_Test(&ping_, &came, &status) != MPI_SUCCESS || !came) {
        return any;
      }
      any = true;
      Answer& a = answers_.emplace_back();
      a.text = state();
      MPI_Isend(a.text.data(), kAnswerBytes, MPI_CHAR, status.MPI_SOURCE, kReplyTag, probe_comm_,
                &a.req);
      if (post_listener() != MPI_SUCCESS) ping_ = MPI_REQUEST_NULL;
    }
  }
  // Called with mu_ held.
  void start_probe() {
    const auto world = static_cast<std::size_t>(world_size_);
    probe_started_ = true;
    if (probe_comm_ == MPI_COMM_NULL) {
      probe_done_.set_value({});
      return;
    }
    probe_open_ = true;
    Probing p;
    p.deadline = std::chrono::steady_clock::now() + probe_window_;
    p.pings.assign(world, MPI_REQUEST_NULL);
    p.replies.assign(world, MPI_REQUEST_NULL);
    p.texts.assign(world, AnswerText{});
    p.answered.assign(world, false);
    probing_ = std::move(p);
    for (int r = 0; r < world_size_; ++r) {
      const auto i = static_cast<std::size_t>(r);
      if (r == world_rank_) continue;
      MPI_Irecv(probing_->texts[i].data(), kAnswerBytes, MPI_CHAR, r, kReplyTag, probe_comm_,
                &probing_->replies[i]);
      MPI_Isend(&ping_out_, 1, MPI_BYTE, r, kPingTag, probe_comm_, &probing_->pings[i]);
    }
  }
  void test_probe() {
    Probing& p = *probing_;
    bool all = true;
    for (int r = 0; r < world_size_; ++r) {
      const auto i = static_cast<std::size_t>(r);
      if (r == world_rank_ || p.answered[i]) continue;
      int done = 0;
      if (MPI_Test(&p.replies[i], &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) {
        p.answered[i] = true;
      } else {
        all = false;
      }
    }
    if (!all && std::chrono::steady_clock::now() < p.deadline) return;
    // Requests of ranks that did not answer stay posted: after a probe this process fails, and
    // makes no MPI call again.
    Answers answers(static_cast<std::size_t>(world_size_));
    for (int r = 0; r < world_size_; ++r) {
      const auto i = static_cast<std::size_t>(r);
      if (r == world_rank_) {
        answers[i] = "this rank";
      } else if (p.answered[i]) {
        p.texts[i].back() = '\0';
        answers[i] = std::string(p.texts[i].data());
      }
    }
    probe_open_ = false;
    probe_done_.set_value(std::move(answers));
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> queue_;                  // guarded by mu_
  bool stop_ = false;                          // guarded by mu_
  bool failed_ = false;                        // guarded by mu_
  std::string failed_text_;                    // guarded by mu_
  bool probe_asked_ = false;                   // guarded by mu_
  bool probe_started_ = false;                 // guarded by mu_
  std::chrono::milliseconds probe_window_{0};  // guarded by mu_
  std::shared_future<Answers> probe_answers_;  // guarded by mu_
  std::promise<Answers> probe_done_;           // set once, by the thread
  // Only touched by the thread:
  std::list<Active> active_;
  std::string last_label_;  // the last operation that finished, and when
  std::chrono::steady_clock::time_point last_done_;
  MPI_Comm probe_comm_ = MPI_COMM_NULL;
  int world_rank_ = -1, world_size_ = 0;
  MPI_Request ping_ = MPI_REQUEST_NULL;
  char ping_byte_ = 0, ping_out_ = 0;
  std::list<Answer> answers_;
  std::optional<Probing> probing_;  // kept once started: requests may stay posted on it
  bool probe_open_ = false;         // probing_ waits for answers
  std::thread thread_;              // last: starts after every member above is constructed
};

}  // namespace strata::dist::detail
