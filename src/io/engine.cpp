// Engine base: bookkeeping, fault hooks and the retry rules shared by every engine.
#include "src/io/engine.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <functional>
#include <string>
#include <utility>

#include "src/io/errno_text.h"

namespace strata::io {
namespace {

// EINTR and EAGAIN are worth retrying, but not forever: a device that keeps saying "again" is a
// failure the user should see rather than a hang.
constexpr int kMaxTransientRetries = 1000;

std::string describe(const ChunkRun& run) {
  const bool write = run.chunk.op == IoOp::kWrite;
  return std::string(write ? "write of " : "read of ") + std::to_string(run.remaining()) +
         " bytes at offset " + std::to_string(run.file_offset()) + (write ? " to " : " from ");
}

}  // namespace

Engine::Engine(std::vector<EngineFile> files, const EngineOptions& options)
    : files_(std::move(files)),
      queue_depth_(options.queue_depth),
      threads_(options.threads < options.queue_depth ? options.threads : options.queue_depth) {
  STRATA_CHECK(!files_.empty(), "an engine needs at least one file");
  STRATA_CHECK(queue_depth_ > 0 && threads_ > 0, "bad engine options", queue_depth_, threads_);
  if (!options.faults.rules.empty()) faults_ = std::make_unique<FaultInjector>(options.faults);
}

void Engine::submit(std::vector<IoChunk> chunks) {
  if (chunks.empty()) return;
  for (const IoChunk& c : chunks) {
    STRATA_CHECK(c.file >= 0 && c.file < num_files() && c.size_bytes > 0 && c.state != nullptr,
                 "bad chunk", c.file, c.size_bytes);
    (c.op == IoOp::kRead ? read_chunks_ : write_chunks_).fetch_add(1, std::memory_order_relaxed);
  }
  {
    std::lock_guard lock(outstanding_mu_);
    outstanding_ += chunks.size();
  }
  enqueue(std::move(chunks));
}

void Engine::drain() {
  if (CallerDriver* driver = caller_driver()) {
    const std::function<bool()> idle_now = [this] { return idle(); };
    while (!idle()) driver->progress(idle_now);
    return;
  }
  std::unique_lock lock(outstanding_mu_);
  outstanding_cv_.wait(lock, [this] { return outstanding_ == 0; });
}

bool Engine::idle() {
  std::lock_guard lock(outstanding_mu_);
  return outstanding_ == 0;
}

Status Engine::register_buffers(std::span<const std::span<std::byte>>) { return Status::ok(); }

Result<std::unique_ptr<Engine>> make_disk_engine(SwapEngine kind, std::vector<EngineFile> files,
                                                 const EngineOptions& eo, std::string_view what,
                                                 std::vector<std::string>& warnings) {
  if (kind == SwapEngine::kPosix) return make_posix_engine(std::move(files), eo);
  auto uring = make_uring_engine(files, eo);
  if (uring.is_ok()) return std::move(uring).value();
  if (kind == SwapEngine::kUring) {
    return uring.status().with_context(
        "engine \"uring\" is not available (use engine \"auto\" or \"posix\")");
  }
  warnings.push_back("io_uring is not available (" + uring.status().message() + "); " +
                     std::string(what) + " uses the posix engine (pread/pwrite on " +
                     std::to_string(eo.threads < eo.queue_depth ? eo.threads : eo.queue_depth) +
                     " threads), which reaches a lower queue depth");
  return make_posix_engine(std::move(files), eo);
}

void Engine::set_file(int file, EngineFile f) {
  STRATA_CHECK(file >= 0 && file < num_files(), "bad file index", file);
  files_[file] = std::move(f);
}

int Engine::grow(int file, std::uint64_t size_bytes) {
  STRATA_CHECK(file >= 0 && file < num_files(), "bad file index", file);
  if (faults_ != nullptr) {
    const int err = faults_->on_grow(file);
    if (err != 0) return err;
  }
  return grow_impl(file, size_bytes);
}

int Engine::grow_impl(int file, std::uint64_t size_bytes) {
  return grow_fd(files_[file].fd, size_bytes);
}

int grow_fd(int fd, std::uint64_t size_bytes) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return errno;
  if (static_cast<std::uint64_t>(st.st_size) >= size_bytes) return 0;
  // Allocate from the current end only: blocks below it were allocated by earlier calls.
  const off_t begin = st.st_size;
  const off_t len = static_cast<off_t>(size_bytes) - begin;
  int rc;
  do {
    rc = ::fallocate(fd, 0, begin, len);
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return 0;
  if (errno != EOPNOTSUPP) return errno;
  // Some file systems cannot preallocate; a sparse file still works, it just may hit ENOSPC on a
  // write later instead of here.
  return ::ftruncate(fd, static_cast<off_t>(size_bytes)) == 0 ? 0 : errno;
}

EngineCounters Engine::counters() const {
  EngineCounters c;
  c.read_chunks = read_chunks_.load(std::memory_order_relaxed);
  c.write_chunks = write_chunks_.load(std::memory_order_relaxed);
  c.retries = retries_.load(std::memory_order_relaxed);
  c.faults_injected = faults_ != nullptr ? faults_->fired() : 0;
  c.fixed_chunks = fixed_chunks_.load(std::memory_order_relaxed);
  return c;
}

FaultDecision Engine::before_attempt(const ChunkRun& run) {
  if (faults_ == nullptr) return {0, run.remaining()};
  const FaultOp op = run.chunk.op == IoOp::kRead ? FaultOp::kRead : FaultOp::kWrite;
  return faults_->on_transfer(op, run.chunk.file, run.swap_offset(), run.remaining());
}

Engine::Step Engine::on_result(ChunkRun& run, std::int64_t res) {
  const std::string& file_path = files_[run.chunk.file].path;
  if (res < 0) {
    const int err = static_cast<int>(-res);
    if ((err == EINTR || err == EAGAIN) && run.transient_retries < kMaxTransientRetries) {
      ++run.transient_retries;
      retries_.fetch_add(1, std::memory_order_relaxed);
      return Step::kResubmit;
    }
    std::string msg = describe(run) + file_path + " failed: " + errno_text(err);
    if (err == EINTR || err == EAGAIN) {
      msg += " (still failing after " + std::to_string(kMaxTransientRetries) + " retries)";
    }
    finish(run, io_error(std::move(msg)));
    return Step::kFinished;
  }
  const auto n = static_cast<std::size_t>(res);
  STRATA_CHECK(n <= run.remaining(), "kernel reported more bytes than asked", n, run.remaining());
  if (n == 0) {
    // pread at end of file or a write that made no progress: retrying would spin forever.
    const char* why = run.chunk.op == IoOp::kRead
                          ? "unexpected end of file (the file ends before the range read)"
                          : "the write made no progress";
    finish(run, io_error(describe(run) + file_path + " failed: " + why));
    return Step::kFinished;
  }
  run.done_bytes += n;
  if (run.remaining() == 0) {
    finish(run, Status::ok());
    return Step::kFinished;
  }
  retries_.fetch_add(1, std::memory_order_relaxed);
  return Step::kResubmit;
}

void Engine::finish(ChunkRun& run, Status status) {
  run.chunk.state->finish_chunk(run.done_bytes, std::move(status));
  run.chunk.state.reset();
  std::lock_guard lock(outstanding_mu_);
  if (--outstanding_ == 0) outstanding_cv_.notify_all();
}

}  // namespace strata::io
