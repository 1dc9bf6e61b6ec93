// NVMe swap space: preallocated files in one or more directories, an extent allocator, and
// asynchronous reads and writes through an I/O engine (io_uring with O_DIRECT, or a pread/pwrite
// fallback), with optional checksums of everything written.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "strata/core/status.h"
#include "strata/io/fault_injection.h"

namespace strata::io {

// O_DIRECT needs buffers, offsets and lengths aligned to this.
inline constexpr std::size_t kIoAlignBytes = 4096;
// With verify_swap, every extent keeps one xxh3 checksum per piece of this many bytes (counted
// from the extent's start), so partial reads and writes are verified too.
inline constexpr std::size_t kVerifyPieceBytes = 64 * 1024;

enum class IoOp : std::uint8_t { kRead, kWrite };

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
  std::uint64_t fixed_chunks = 0;     // chunks that went through a registered buffer
  std::uint64_t verified_bytes = 0;   // bytes read whose checksum was checked (verify_swap)
  std::uint64_t checksum_errors = 0;  // reads that failed their checksum
};

// kAuto: io_uring if it works, else posix (pread/pwrite on threads). kMemory keeps the files in
// RAM and never touches the directories: paths, if given, only name the in-memory files
// ("memory:<path>") and set how many are striped over.
enum class SwapEngine : std::uint8_t { kAuto, kUring, kPosix, kMemory };
inline constexpr std::array<SwapEngine, 4> kSwapEngines = {SwapEngine::kAuto, SwapEngine::kUring,
                                                           SwapEngine::kPosix, SwapEngine::kMemory};
inline std::string_view swap_engine_name(SwapEngine engine) {
  switch (engine) {
    case SwapEngine::kAuto:
      return "auto";
    case SwapEngine::kUring:
      return "uring";
    case SwapEngine::kPosix:
      return "posix";
    case SwapEngine::kMemory:
      return "memory";
  }
  return "?";
}
// For command lines: the engine of that name, or nullopt.
std::optional<SwapEngine> parse_swap_engine(std::string_view name);

struct SwapOptions {
  std::vector<std::string> paths;  // one directory per drive
  SwapEngine engine = SwapEngine::kAuto;
  std::size_t block_size_bytes = 1 << 20;  // requests are split into chunks of this size
  // io_uring: most chunks in the kernel per ring (like fio's iodepth per job). The thread-pool
  // engines use it to cap their worker count.
  int queue_depth = 32;
  // io_uring: number of rings; chunks are dealt to them round-robin. Each ring has its own driver
  // thread, unless caller_driven.
  int thread_count = 1;
  // io_uring: no driver threads. Rings make progress inside the calls of the threads that use
  // the swap space (read, write, wait, poll, and the destructor), and callbacks run there.
  bool caller_driven = false;
  // io_uring: a kernel thread polls each ring's submission queue (IORING_SETUP_SQPOLL), saving
  // the submit system call at the price of a busy core while I/O flows. Falls back to normal
  // submission with a warning where the kernel refuses it.
  bool sqpoll = false;
  bool direct = true;  // O_DIRECT (falls back to buffered with one warning if the fs refuses)
  // Checksum every write (xxh3, per kVerifyPieceBytes of each extent) and check every read
  // against it; a mismatch is a data_loss error naming the tensor and the extent.
  bool verify_swap = false;
  std::uint64_t initial_capacity_bytes = 0;  // preallocated with fallocate; grows on demand
  int posix_threads = 4;                     // worker threads of the "posix" and "memory" engines
  // create() logs its warnings (io_uring unavailable, O_DIRECT refused) once each. A tool that
  // creates many swap spaces may turn that off and read warnings() instead.
  bool log_warnings = true;
  FaultInjection fault_injection;  // tests only: make chosen requests short or failing
};

// A range of swap space. Offsets and sizes are multiples of kIoAlignBytes.
struct Extent {
  std::uint64_t offset = 0;
  std::uint64_t size_bytes = 0;
  bool valid() const { return size_bytes != 0; }
};

// What a finished request reports: its status, the bytes transferred and the time from
// submission to completion.
struct IoCompletion {
  IoOp op = IoOp::kRead;
  Status status;
  std::uint64_t bytes = 0;
  double elapsed_s = 0;
};

// Called exactly once when a request finishes, before its handle reports done: on an engine
// thread (or, caller_driven, in whichever call made the progress; for a request rejected up
// front, inside read()/write()). Keep it short; it may submit new requests but must not wait on
// one.
using IoCallback = std::function<void(const IoCompletion&)>;

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
  // Whether the request finished, without blocking. Caller-driven engines make progress here.
  bool poll();
  bool done() const;
  // Bytes transferred and seconds from submission to completion; 0 until done().
  std::uint64_t bytes() const;
  double elapsed_s() const;

 private:
  std::shared_ptr<State> state_;
};

// One request for SwapSpace::submit / submit_batch.
struct IoRequest {
  IoOp op = IoOp::kRead;
  Extent extent;
  std::uint64_t offset_in_extent = 0;
  void* buf = nullptr;  // a write only reads from it
  std::size_t size_bytes = 0;
  IoCallback callback;  // optional
};

class SwapSpace;

// Keeps a set of buffers registered with a swap space (SwapSpace::register_buffers) while it
// lives. Move-only; an empty one (default, moved from, or reset) holds nothing.
class BufferRegistration {
 public:
  BufferRegistration() = default;
  ~BufferRegistration() { reset(); }
  BufferRegistration(BufferRegistration&& other) noexcept
      : swap_(std::exchange(other.swap_, nullptr)), id_(std::exchange(other.id_, 0)) {}
  BufferRegistration& operator=(BufferRegistration&& other) noexcept {
    if (this != &other) {
      reset();
      swap_ = std::exchange(other.swap_, nullptr);
      id_ = std::exchange(other.id_, 0);
    }
    return *this;
  }
  BufferRegistration(const BufferRegistration&) = delete;
  BufferRegistration& operator=(const BufferRegistration&) = delete;

  // Unregisters the buffers (after the requests in flight finish); they are ordinary memory
  // to the swap space from then on.
  void reset();
  bool active() const { return swap_ != nullptr; }

 private:
  friend class SwapSpace;
  BufferRegistration(SwapSpace* swap, std::uint64_t id) : swap_(swap), id_(id) {}
  SwapSpace* swap_ = nullptr;
  std::uint64_t id_ = 0;
};

// Bytes that swap files of Strata processes no longer running hold in `dir`: creating a swap
// space there reclaims them, so they count as free.
std::uint64_t stale_swap_bytes(const std::string& dir);

class SwapSpace {
 public:
  // Creates "<path>/strata-<pid>.swap" in every path (checking the directory exists and is
  // writable), takes a lock file so two live runs never share a directory, and reclaims files
  // left by a dead process. Errors name the directory and what to do.
  static Result<std::unique_ptr<SwapSpace>> create(const SwapOptions& options);
  // Finishes requests still in flight, then deletes the swap files and lock files.
  virtual ~SwapSpace() = default;

  // Reserves swap space (rounded up to kIoAlignBytes). Grows the files if needed; ENOSPC is an
  // out_of_memory error naming the directory, the request and the free space. `what` names the
  // tensor in later errors (a failed checksum, for one).
  virtual Result<Extent> allocate(std::uint64_t size_bytes, std::string_view what) = 0;
  // Takes exactly an extent allocate() returned (freeing it twice is a bug and aborts); an empty
  // extent is ignored. Adjacent free space is merged, so steady-state loops reuse the same bytes.
  virtual void free(const Extent& extent) = 0;

  // Asynchronous transfer between `extent` (starting offset_in_extent bytes in) and a host buffer.
  // buf, offset_in_extent and size_bytes must be multiples of kIoAlignBytes (checked; an
  // invalid_argument error names the misaligned value). The buffer must stay alive until the
  // request is done.
  IoHandle read(const Extent& extent, std::uint64_t offset_in_extent, void* buf,
                std::size_t size_bytes, IoCallback callback = {}) {
    return submit({IoOp::kRead, extent, offset_in_extent, buf, size_bytes, std::move(callback)});
  }
  IoHandle write(const Extent& extent, std::uint64_t offset_in_extent, const void* buf,
                 std::size_t size_bytes, IoCallback callback = {}) {
    // The engine only reads from a write's buffer; the cast lets both directions share IoRequest.
    return submit({IoOp::kWrite, extent, offset_in_extent, const_cast<void*>(buf), size_bytes,
                   std::move(callback)});
  }
  virtual IoHandle submit(const IoRequest& request) = 0;
  // Several requests handed to the engine at once: one wake-up of each ring and one system call
  // for all their chunks, rather than one per request. Handles come back in request order.
  virtual std::vector<IoHandle> submit_batch(std::span<const IoRequest> requests) = 0;

  // Registers host buffers (a pinned staging pool) with the kernel, so requests whose buffer
  // lies inside one of them skip per-request page pinning (io_uring fixed buffers). Registrations
  // add up: each keeps its buffers registered until the returned handle is destroyed or reset,
  // whoever else registers meanwhile. Waits for requests in flight first. The buffers must stay
  // alive, and the handle must not outlive the swap space. Engines without fixed buffers accept
  // and ignore them. An error (RLIMIT_MEMLOCK too low, say) leaves the earlier registrations as
  // they were and I/O working as before.
  Result<BufferRegistration> register_buffers(std::span<const std::span<std::byte>> buffers);

  virtual IoStats stats() const = 0;
  virtual std::string engine_name() const = 0;  // "io_uring", "posix", "memory"
  virtual std::uint64_t capacity_bytes() const = 0;
  virtual std::uint64_t used_bytes() const = 0;
  // The warnings create() gave (and logged, with log_warnings): io_uring unavailable and the
  // posix fallback chosen, O_DIRECT refused, SQPOLL refused.
  virtual std::vector<std::string> warnings() const = 0;

 protected:
  // The engine's whole fixed-buffer table becomes `buffers` (every live registration's buffers,
  // in any order); empty clears it.
  virtual Status set_registered_buffers(std::span<const std::span<std::byte>> buffers) = 0;

 private:
  friend class BufferRegistration;
  void release_registration(std::uint64_t id);
  // Every live registration's buffers; call with registration_mu_ held.
  std::vector<std::span<std::byte>> registered_buffers() const;
  std::mutex registration_mu_;
  std::vector<std::pair<std::uint64_t, std::vector<std::span<std::byte>>>> registrations_;
  std::uint64_t next_registration_ = 1;
};

}  // namespace strata::io
