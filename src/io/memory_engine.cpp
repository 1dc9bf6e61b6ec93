// In-memory swap files for tests and disk-less machines, served by the worker-pool engine.
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <new>
#include <shared_mutex>
#include <utility>

#include "src/io/engine.h"

namespace strata::io {
namespace {

// Files are lists of fixed segments so growing never moves bytes a transfer may be copying.
constexpr std::size_t kSegmentBytes = std::size_t{1} << 20;

class MemoryBackend final : public SyncBackend {
 public:
  explicit MemoryBackend(std::size_t num_files) : files_(num_files) {}

  std::int64_t transfer(IoOp op, int file, int /*fd*/, std::uint64_t offset, std::byte* buf,
                        std::size_t size_bytes) override {
    std::shared_lock lock(mu_);
    const File& f = files_[file];
    const std::uint64_t size = f.segments.size() * kSegmentBytes;
    if (offset >= size) return op == IoOp::kRead ? 0 : -ENOSPC;  // like pread past the end
    const std::size_t n =
        static_cast<std::size_t>(std::min<std::uint64_t>(size_bytes, size - offset));
    std::size_t done = 0;
    while (done < n) {
      const std::uint64_t at = offset + done;
      std::byte* seg = f.segments[at / kSegmentBytes].get() + at % kSegmentBytes;
      const std::size_t len = std::min<std::size_t>(n - done, kSegmentBytes - at % kSegmentBytes);
      if (op == IoOp::kRead) {
        std::memcpy(buf + done, seg, len);
      } else {
        std::memcpy(seg, buf + done, len);
      }
      done += len;
    }
    return static_cast<std::int64_t>(n);
  }

  int grow(int file, int /*fd*/, std::uint64_t size_bytes) override {
    const std::uint64_t want = (size_bytes + kSegmentBytes - 1) / kSegmentBytes;
    std::unique_lock lock(mu_);
    File& f = files_[file];
    try {
      while (f.segments.size() < want) {
        f.segments.push_back(std::make_unique<std::byte[]>(kSegmentBytes));  // zero-filled
      }
    } catch (const std::bad_alloc&) {
      return ENOMEM;
    }
    return 0;
  }

 private:
  struct File {
    std::vector<std::unique_ptr<std::byte[]>> segments;
  };
  // Shared for transfers (their bytes never move); exclusive only to append segments.
  std::shared_mutex mu_;
  std::vector<File> files_;
};

}  // namespace

std::unique_ptr<Engine> make_memory_engine(std::vector<std::string> names,
                                           const EngineOptions& options) {
  std::vector<EngineFile> files;
  files.reserve(names.size());
  for (std::string& name : names) files.push_back({-1, std::move(name)});
  auto backend = std::make_unique<MemoryBackend>(files.size());
  return make_thread_pool_engine("memory", std::move(files), options, std::move(backend));
}

}  // namespace strata::io
