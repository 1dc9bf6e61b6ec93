// NVMe swap space: preallocated files in one or more directories, an extent allocator, and
// asynchronous reads and writes through an I/O engine (io_uring with O_DIRECT, or a pread/pwrite
// fallback).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/status.h"
#include "strata/io/fault_injection.h"

namespace strata::io {

// O_DIRECT needs buffers, offsets and lengths aligned to this.
inline constexpr std::size_t kIoAlignBytes = 4096;

struct IoStats {
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::uint64_t reads = 0;
  std::uint64_t writes = 0;
  double read_busy_s = 0;  // wall time with at least one read in flight
  double write_busy_s = 0;
  std::uint64_t read_chunks = 0;  // engine requests after splitting into block_size_bytes pieces
  std::uint64_t write_chunks = 0;
  std::uint64_t retries = 0;  // resubmissions after short transfers, EINTR or EAGAIN
  std::uint64_t errors = 0;   // reads and writes whose handle reported an error
  std::uint64_t faults_injected = 0;
};

struct SwapOptions {
  std::vector<std::string> paths;  // one directory per drive
  // "memory" keeps the files in RAM and never touches the directories: paths, if given, only
  // name the in-memory files ("memory:<path>") and set how many are striped over.
  std::string engine = "auto";  // "auto" (io_uring if it works), "uring", "posix", "memory"
  std::size_t block_size_bytes = 1 << 20;  // requests are split into chunks of this size
  int queue_depth = 32;
  bool direct = true;  // O_DIRECT (falls back to buffered with one warning if the fs refuses)
  std::uint64_t initial_capacity_bytes = 0;  // preallocated with fallocate; grows on demand
  int posix_threads = 4;                     // worker threads of the "posix" and "memory" engines
  FaultInjection fault_injection;            // tests only: make chosen requests short or failing
};

// A range of swap space. Offsets and sizes are multiples of kIoAlignBytes.
struct Extent {
  std::uint64_t offset = 0;
  std::uint64_t size_bytes = 0;
  bool valid() const { return size_bytes != 0; }
};

// Completion of one asynchronous read or write (possibly split into many chunks).
class IoHandle {
 public:
  IoHandle() = default;
  struct State;
  explicit IoHandle(std::shared_ptr<State> state) : state_(std::move(state)) {}
  bool valid() const { return state_ != nullptr; }
  // Blocks until every chunk finished; returns the first error, naming file, offset and length.
  // May be called again (same result) and from several threads. An empty handle returns ok.
  Status wait();
  bool done() const;

 private:
  std::shared_ptr<State> state_;
};

class SwapSpace {
 public:
  // Creates "<path>/strata-<pid>.swap" in every path (checking the directory exists and is
  // writable), takes a lock file so two live runs never share a directory, and reclaims files
  // left by a dead process. Errors name the directory and what to do.
  static Result<std::unique_ptr<SwapSpace>> create(const SwapOptions& options);
  // Finishes requests still in flight, then deletes the swap files and lock files.
  virtual ~SwapSpace() = default;

  // Reserves swap space (rounded up to kIoAlignBytes). Grows the files if needed; ENOSPC is an
  // out_of_memory error naming the directory, the request and the free space.
  virtual Result<Extent> allocate(std::uint64_t size_bytes, std::string_view what) = 0;
  // Takes exactly an extent allocate() returned (freeing it twice is a bug and aborts); an empty
  // extent is ignored. Adjacent free space is merged, so steady-state loops reuse the same bytes.
  virtual void free(const Extent& extent) = 0;

  // Asynchronous transfer between `extent` (starting offset_in_extent bytes in) and a host buffer.
  // buf, offset_in_extent and size_bytes must be multiples of kIoAlignBytes (checked; an
  // invalid_argument error names the misaligned value). The buffer must stay alive until wait().
  virtual IoHandle read(const Extent& extent, std::uint64_t offset_in_extent, void* buf,
                        std::size_t size_bytes) = 0;
  virtual IoHandle write(const Extent& extent, std::uint64_t offset_in_extent, const void* buf,
                         std::size_t size_bytes) = 0;

  virtual IoStats stats() const = 0;
  virtual std::string engine_name() const = 0;  // "io_uring", "posix", "memory"
  virtual std::uint64_t capacity_bytes() const = 0;
  virtual std::uint64_t used_bytes() const = 0;
};

}  // namespace strata::io
