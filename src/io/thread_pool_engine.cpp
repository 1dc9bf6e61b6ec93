// Worker-pool engine with synchronous transfers; the pread/pwrite ("posix") engine is built on it.
#include <unistd.h>

#include <cerrno>
#include <deque>
#include <thread>
#include <utility>

#include "src/io/engine.h"

namespace strata::io {
namespace {

class ThreadPoolEngine final : public Engine {
 public:
  ThreadPoolEngine(std::string name, std::vector<EngineFile> files, const EngineOptions& options,
                   std::unique_ptr<SyncBackend> backend)
      : Engine(std::move(files), options), name_(std::move(name)), backend_(std::move(backend)) {
    workers_.reserve(threads_);
    for (int i = 0; i < threads_; ++i) workers_.emplace_back([this] { work(); });
  }

  ~ThreadPoolEngine() override {
    drain();
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : workers_) t.join();
  }

  std::string_view name() const override { return name_; }

 protected:
  void enqueue(std::vector<IoChunk> chunks) override {
    {
      std::lock_guard lock(mu_);
      for (IoChunk& c : chunks) queue_.push_back(std::move(c));
    }
    if (chunks.size() == 1) {
      cv_.notify_one();
    } else {
      cv_.notify_all();
    }
  }

  int grow_impl(int file, std::uint64_t size_bytes) override {
    return backend_->grow(file, files_[file].fd, size_bytes);
  }

 private:
  void work() {
    for (;;) {
      ChunkRun run;
      {
        std::unique_lock lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and the destructor drained everything first
        run.chunk = std::move(queue_.front());
        queue_.pop_front();
      }
      run_chunk(run);
    }
  }

  void run_chunk(ChunkRun& run) {
    for (;;) {
      const FaultDecision fault = before_attempt(run);
      const std::int64_t res =
          fault.error != 0
              ? -static_cast<std::int64_t>(fault.error)
              : backend_->transfer(run.chunk.op, run.chunk.file, files_[run.chunk.file].fd,
                                   run.file_offset(), run.buf(), fault.size_bytes);
      if (on_result(run, res) == Step::kFinished) return;
    }
  }

  const std::string name_;
  const std::unique_ptr<SyncBackend> backend_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<IoChunk> queue_;
  bool stop_ = false;
  std::vector<std::thread> workers_;  // last: started once everything above exists
};

class PosixBackend final : public SyncBackend {
 public:
  std::int64_t transfer(IoOp op, int /*file*/, int fd, std::uint64_t offset, std::byte* buf,
                        std::size_t size_bytes) override {
    const auto off = static_cast<off_t>(offset);
    const ssize_t n =
        op == IoOp::kRead ? ::pread(fd, buf, size_bytes, off) : ::pwrite(fd, buf, size_bytes, off);
    return n >= 0 ? static_cast<std::int64_t>(n) : -static_cast<std::int64_t>(errno);
  }

  int grow(int /*file*/, int fd, std::uint64_t size_bytes) override {
    return grow_fd(fd, size_bytes);
  }
};

}  // namespace

std::unique_ptr<Engine> make_thread_pool_engine(std::string name, std::vector<EngineFile> files,
                                                const EngineOptions& options,
                                                std::unique_ptr<SyncBackend> backend) {
  return std::make_unique<ThreadPoolEngine>(std::move(name), std::move(files), options,
                                            std::move(backend));
}

std::unique_ptr<Engine> make_posix_engine(std::vector<EngineFile> files,
                                          const EngineOptions& options) {
  return make_thread_pool_engine("posix", std::move(files), options,
                                 std::make_unique<PosixBackend>());
}

}  // namespace strata::io
