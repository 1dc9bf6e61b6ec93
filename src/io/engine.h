// I/O engine interface: asynchronous chunk reads and writes against a fixed table of swap files.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "src/io/fault_injector.h"
#include "src/io/io_state.h"
#include "strata/core/status.h"

namespace strata::io {

// A file the engine addresses by its index in the table. The engine does not own the descriptor:
// the swap space closes it after the engine is gone. The memory engine has no descriptors (-1).
struct EngineFile {
  int fd = -1;
  std::string path;
};

// One contiguous piece of a request, inside a single file. The buffer stays alive until the
// request's handle is done (the caller's promise, passed down from SwapSpace).
struct IoChunk {
  IoOp op = IoOp::kRead;
  int file = 0;
  std::uint64_t file_offset = 0;
  std::uint64_t swap_offset = 0;  // the same byte in swap-space coordinates (fault matching)
  std::byte* buf = nullptr;
  std::size_t size_bytes = 0;
  std::shared_ptr<IoHandle::State> state;
};

struct EngineOptions {
  int queue_depth = 32;        // most chunks in the kernel at once, per ring
  int threads = 4;             // thread-pool engines: worker count (capped at queue_depth)
  int rings = 1;               // io_uring: rings, each with queue_depth slots
  bool caller_driven = false;  // io_uring: no driver threads (see SwapOptions::caller_driven)
  bool sqpoll = false;         // io_uring: IORING_SETUP_SQPOLL
  FaultInjection faults;       // no rules: no injector at all
};

struct EngineCounters {
  std::uint64_t read_chunks = 0;
  std::uint64_t write_chunks = 0;
  std::uint64_t retries = 0;
  std::uint64_t faults_injected = 0;
  std::uint64_t fixed_chunks = 0;
};

// A chunk's progress across attempts: short transfers and EINTR/EAGAIN resubmit the remainder.
struct ChunkRun {
  IoChunk chunk;
  std::size_t done_bytes = 0;
  int transient_retries = 0;

  std::uint64_t file_offset() const { return chunk.file_offset + done_bytes; }
  std::uint64_t swap_offset() const { return chunk.swap_offset + done_bytes; }
  std::byte* buf() const { return chunk.buf + done_bytes; }
  std::size_t remaining() const { return chunk.size_bytes - done_bytes; }
};

// Base of every engine. Public entry points are thread-safe. Implementations issue attempts,
// ask before_attempt() about injected faults, and feed every result to on_result(), which holds
// the one set of retry rules and completes handles.
class Engine {
 public:
  Engine(std::vector<EngineFile> files, const EngineOptions& options);
  virtual ~Engine() = default;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  virtual std::string_view name() const = 0;

  // Queues the chunks and returns without waiting for them, nor for room in the queue.
  void submit(std::vector<IoChunk> chunks);
  // Blocks until every chunk submitted so far has completed.
  void drain();
  // Non-null when the engine makes progress only in its callers' threads; request states then
  // drive it from wait() and poll().
  virtual CallerDriver* caller_driver() { return nullptr; }
  // Fixed buffers (see SwapSpace::register_buffers): the whole table becomes `buffers` (empty:
  // none). Called with nothing in flight. The default engine has none and accepts any buffers.
  virtual Status register_buffers(std::span<const std::span<std::byte>> buffers);
  // A warning from setup the swap space should pass on (SQPOLL refused), or empty.
  virtual std::string setup_warning() const { return {}; }
  // Makes file `file` at least size_bytes long with its blocks allocated (fallocate). Returns 0
  // or an errno (ENOSPC when the file system is full). Safe while I/O is in flight.
  int grow(int file, std::uint64_t size_bytes);

  int num_files() const { return static_cast<int>(files_.size()); }
  // A slot of the table given a new file (FileIo's table of named files; a swap space's never
  // changes). Only while no chunk of that slot is in flight: the next submit() orders the change
  // before the engine's threads read it. An engine made with any slot empty (fd -1) addresses
  // files by descriptor, never by a registered (fixed) file table.
  void set_file(int file, EngineFile f);
  const std::string& path(int file) const { return files_[file].path; }
  EngineCounters counters() const;

 protected:
  enum class Step { kResubmit, kFinished };
  // Gives the implementation its chunks; called outside any engine lock.
  virtual void enqueue(std::vector<IoChunk> chunks) = 0;
  // Default: grow_fd() on the file's descriptor.
  virtual int grow_impl(int file, std::uint64_t size_bytes);

  // The injected fault for the next attempt of `run` (size_bytes = run.remaining() without one).
  FaultDecision before_attempt(const ChunkRun& run);
  // Applies one attempt's result: bytes transferred, or -errno. kFinished means the handle has
  // been told (success or an error naming file, offset and length); the run is spent.
  Step on_result(ChunkRun& run, std::int64_t res);
  void count_fixed() { fixed_chunks_.fetch_add(1, std::memory_order_relaxed); }
  bool idle();

  std::vector<EngineFile> files_;
  const int queue_depth_;
  const int threads_;

 private:
  void finish(ChunkRun& run, Status status);

  std::unique_ptr<FaultInjector> faults_;
  std::mutex outstanding_mu_;
  std::condition_variable outstanding_cv_;
  std::uint64_t outstanding_ = 0;
  std::atomic<std::uint64_t> read_chunks_{0};
  std::atomic<std::uint64_t> write_chunks_{0};
  std::atomic<std::uint64_t> retries_{0};
  std::atomic<std::uint64_t> fixed_chunks_{0};
};

// Transfers behind a thread-pool engine: synchronous, pread/pwrite-like (bytes or -errno).
class SyncBackend {
 public:
  virtual ~SyncBackend() = default;
  // `file`: the index in the engine's table, `fd` its descriptor there (-1 for the memory
  // engine's files).
  virtual std::int64_t transfer(IoOp op, int file, int fd, std::uint64_t offset, std::byte* buf,
                                std::size_t size_bytes) = 0;
  virtual int grow(int file, int fd, std::uint64_t size_bytes) = 0;
};

// Extends a file to at least size_bytes with fallocate (ftruncate where the file system cannot
// preallocate). Returns 0 or an errno.
int grow_fd(int fd, std::uint64_t size_bytes);

// io_uring engine; unavailable() when not compiled in or when the kernel refuses a ring (the
// message says why, for the fallback warning). options.rings rings, each with its own driver
// thread unless options.caller_driven.
Result<std::unique_ptr<Engine>> make_uring_engine(std::vector<EngineFile> files,
                                                  const EngineOptions& options);
// pread/pwrite on a pool of worker threads.
std::unique_ptr<Engine> make_posix_engine(std::vector<EngineFile> files,
                                          const EngineOptions& options);
// Files held in RAM, one per name; grows in place without moving existing bytes.
std::unique_ptr<Engine> make_memory_engine(std::vector<std::string> names,
                                           const EngineOptions& options);
// io_uring, or (kind kPosix, or kAuto where the kernel refuses a ring, with a warning naming
// `what` uses it) pread/pwrite on threads. kMemory is not a disk engine.
Result<std::unique_ptr<Engine>> make_disk_engine(SwapEngine kind, std::vector<EngineFile> files,
                                                 const EngineOptions& eo, std::string_view what,
                                                 std::vector<std::string>& warnings);
// The worker-pool engine both of the above are made of.
std::unique_ptr<Engine> make_thread_pool_engine(std::string name, std::vector<EngineFile> files,
                                                const EngineOptions& options,
                                                std::unique_ptr<SyncBackend> backend);

}  // namespace strata::io
