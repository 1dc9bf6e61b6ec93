// Reads and writes of named files (not a swap space's extents) through the swap space's
// engines: io_uring with O_DIRECT where the file system allows it, else pread/pwrite on threads.
// DeepNVMe's aio_handle over Strata's engine (the Python module's strata.io.AIOHandle):
// requests are split into block_size_bytes chunks, queued at once, and waited for together.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "strata/core/status.h"
#include "strata/io/swap.h"
#include "strata/sys/host_mapping.h"

namespace strata::io {

class Engine;

struct FileIoOptions {
  std::size_t block_size_bytes = 1 << 20;  // requests split into chunks of this size
  int queue_depth = 32;                    // io_uring: chunks in the kernel at once, per ring
  int threads = 1;                         // io_uring rings (each its driver thread), or workers
  SwapEngine engine = SwapEngine::kAuto;   // kAuto, kUring or kPosix
  bool direct = true;                      // O_DIRECT where the file system allows it
  int max_open_files = 64;                 // files kept open between requests
};

class FileIo {
 public:
  // Errors: kMemory or a bad option (naming it), io_uring asked for and unavailable.
  static Result<std::unique_ptr<FileIo>> create(const FileIoOptions& options);
  ~FileIo();  // waits for the requests in flight
  FileIo(const FileIo&) = delete;
  FileIo& operator=(const FileIo&) = delete;

  // Starts moving `size_bytes` between `buf` and the file `path` at `offset`; `buf` must stay
  // as it is (a write) or untouched (a read) until wait(). Any alignment: the part whose buffer,
  // offset and length are multiples of kIoAlignBytes goes through O_DIRECT (where the file
  // system allows it), the rest through the page cache. A read's file must exist and hold the
  // range (else wait() names the file and the end it met); a write creates the file when it is
  // missing and never truncates it. Errors here: a file that cannot be opened, named.
  Status read(const std::string& path, std::uint64_t offset, void* buf, std::size_t size_bytes);
  Status write(const std::string& path, std::uint64_t offset, const void* buf,
               std::size_t size_bytes);
  // Blocks until every request so far has finished, then closes the files they opened (the
  // next request opens its file afresh); the number that finished since the last wait, or the
  // first error among them (naming the operation, the file, the offset and length).
  Result<std::int64_t> wait();

  // Page-aligned host memory on 2 MiB boundaries (sys::HostMapping), registered with the engine
  // so requests inside it skip per-request page pinning (io_uring fixed buffers) until
  // free_pinned; the mapping lives while either holds it. Both wait for the requests in flight
  // first.
  Result<std::shared_ptr<sys::HostMapping>> new_pinned(std::size_t size_bytes);
  Status free_pinned(const void* data);

  std::string engine_name() const;
  const FileIoOptions& options() const { return options_; }
  std::vector<std::string> warnings() const { return warnings_; }

 private:
  struct Slot {
    int direct_fd = -1;  // -1 where the file system refused O_DIRECT
    int buffered_fd = -1;
    int direct_index = -1, buffered_index = -1;  // their places in the engine's table
  };
  FileIo(const FileIoOptions& options, std::unique_ptr<Engine> engine);
  Status submit(IoOp op, const std::string& path, std::uint64_t offset, std::byte* buf,
                std::size_t size_bytes);
  // The open file for (op, path), opening it (and first, when the table is full, waiting for the
  // requests in flight and closing every file).
  Result<Slot> open(IoOp op, const std::string& path);
  void close_all();
  Status register_pinned();

  FileIoOptions options_;
  std::unique_ptr<Engine> engine_;
  std::vector<std::string> warnings_;
  std::mutex mu_;
  std::map<std::pair<IoOp, std::string>, Slot> open_;
  std::vector<int> free_indices_;
  std::vector<IoHandle> pending_;
  std::vector<std::shared_ptr<sys::HostMapping>> pinned_;
};

}  // namespace strata::io
