// FileIo: named files through the swap space's engines, a table of open files in the engine's
// slots, each file open twice (O_DIRECT for the aligned part of a request, the page cache for
// the rest).
#include "strata/io/file_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <new>

#include "src/io/engine.h"
#include "src/io/errno_text.h"
#include "src/io/io_state.h"

namespace strata::io {

FileIo::FileIo(const FileIoOptions& options, std::unique_ptr<Engine> engine)
    : options_(options), engine_(std::move(engine)) {
  for (int i = engine_->num_files() - 1; i >= 0; --i) free_indices_.push_back(i);
}

Result<std::unique_ptr<FileIo>> FileIo::create(const FileIoOptions& o) {
  if (o.engine == SwapEngine::kMemory) {
    return invalid_argument("engine \"memory\" holds no named files; use auto, uring or posix");
  }
  if (o.block_size_bytes < kIoAlignBytes || o.block_size_bytes % kIoAlignBytes != 0) {
    return invalid_argument("block_size " + std::to_string(o.block_size_bytes) +
                            ": expected a multiple of " + std::to_string(kIoAlignBytes));
  }
  if (o.queue_depth < 1 || o.threads < 1 || o.max_open_files < 1) {
    return invalid_argument("queue_depth " + std::to_string(o.queue_depth) + ", threads " +
                            std::to_string(o.threads) + ", max_open_files " +
                            std::to_string(o.max_open_files) + ": each must be at least 1");
  }
  EngineOptions eo;
  eo.queue_depth = o.queue_depth;
  eo.threads = o.threads;
  eo.rings = o.threads;
  // Two slots a file (O_DIRECT and buffered), empty until a request opens one.
  std::vector<EngineFile> slots(static_cast<std::size_t>(2 * o.max_open_files));
  std::vector<std::string> warnings;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                          make_disk_engine(o.engine, std::move(slots), eo, "file I/O", warnings));
  std::unique_ptr<FileIo> io(new FileIo(o, std::move(engine)));
  io->warnings_ = std::move(warnings);
  return io;
}

FileIo::~FileIo() {
  std::lock_guard lock(mu_);
  close_all();
}

std::string FileIo::engine_name() const { return std::string(engine_->name()); }

void FileIo::close_all() {
  engine_->drain();  // no chunk reads a descriptor about to close; wait() reads the results
  for (auto& [key, slot] : open_) {
    for (const auto& [fd, index] : {std::pair{slot.direct_fd, slot.direct_index},
                                    std::pair{slot.buffered_fd, slot.buffered_index}}) {
      if (fd < 0) continue;
      ::close(fd);
      engine_->set_file(index, EngineFile{});
      free_indices_.push_back(index);
    }
  }
  open_.clear();
}

Result<FileIo::Slot> FileIo::open(IoOp op, const std::string& path) {
  const auto key = std::make_pair(op, path);
  if (auto it = open_.find(key); it != open_.end()) return it->second;
  if (free_indices_.size() < 2) close_all();
  const bool reading = op == IoOp::kRead;
  const int flags = (reading ? O_RDONLY : O_WRONLY | O_CREAT) | O_CLOEXEC;
  const std::string what = reading ? " for reading" : " for writing";
  Slot s;
  s.buffered_fd = ::open(path.c_str(), flags, 0644);
  if (s.buffered_fd < 0) {
    const int err = errno;
    return Status(err == ENOENT ? StatusCode::kNotFound : StatusCode::kIoError,
                  "cannot open " + path + what + ": " + errno_text(err));
  }
  if (options_.direct) {
    s.direct_fd = ::open(path.c_str(), flags | O_DIRECT, 0644);
    if (s.direct_fd < 0 && errno != EINVAL) {
      const int err = errno;
      ::close(s.buffered_fd);
      return io_error("cannot open " + path + what + " with O_DIRECT: " + errno_text(err));
    }
    // EINVAL: the file system refuses O_DIRECT; the page cache serves every request.
  }
  s.buffered_index = free_indices_.back();
  free_indices_.pop_back();
  engine_->set_file(s.buffered_index, EngineFile{s.buffered_fd, path});
  if (s.direct_fd >= 0) {
    s.direct_index = free_indices_.back();
    free_indices_.pop_back();
    engine_->set_file(s.direct_index, EngineFile{s.direct_fd, path});
  }
  open_[key] = s;
  return s;
}

Status FileIo::submit(IoOp op, const std::string& path, std::uint64_t offset, std::byte* buf,
                      std::size_t size_bytes) {
  std::lock_guard lock(mu_);
  STRATA_ASSIGN_OR_RETURN(const Slot slot, open(op, path));
  if (size_bytes == 0) {
    pending_.emplace_back(IoHandle::State::finished(op, Status::ok()));
    return Status::ok();
  }
  // The aligned body through O_DIRECT, the rest (all of it, when the buffer or offset is not
  // aligned) through the page cache.
  const bool aligned = slot.direct_index >= 0 &&
                       reinterpret_cast<std::uintptr_t>(buf) % kIoAlignBytes == 0 &&
                       offset % kIoAlignBytes == 0;
  const std::size_t body = aligned ? size_bytes / kIoAlignBytes * kIoAlignBytes : 0;
  std::vector<IoChunk> chunks;
  const auto add = [&](int index, std::size_t from, std::size_t length) {
    for (std::size_t done = 0; done < length; done += options_.block_size_bytes) {
      const std::size_t n = std::min(options_.block_size_bytes, length - done);
      const std::uint64_t at = offset + from + done;
      chunks.push_back(IoChunk{op, index, at, at, buf + from + done, n, nullptr});
    }
  };
  add(slot.direct_index, 0, body);
  add(slot.buffered_index, body, size_bytes - body);
  auto state = std::make_shared<IoHandle::State>(op, static_cast<std::uint32_t>(chunks.size()),
                                                 nullptr, engine_->caller_driver());
  for (IoChunk& c : chunks) c.state = state;
  engine_->submit(std::move(chunks));
  pending_.emplace_back(std::move(state));
  return Status::ok();
}

Status FileIo::read(const std::string& path, std::uint64_t offset, void* buf,
                    std::size_t size_bytes) {
  return submit(IoOp::kRead, path, offset, static_cast<std::byte*>(buf), size_bytes);
}

Status FileIo::write(const std::string& path, std::uint64_t offset, const void* buf,
                     std::size_t size_bytes) {
  // The engine only reads from a write's buffer.
  return submit(IoOp::kWrite, path, offset, static_cast<std::byte*>(const_cast<void*>(buf)),
                size_bytes);
}

Result<std::int64_t> FileIo::wait() {
  std::vector<IoHandle> handles;
  {
    std::lock_guard lock(mu_);
    handles.swap(pending_);
  }
  Status first;
  for (IoHandle& h : handles) {
    if (Status s = h.wait(); first.is_ok() && !s.is_ok()) first = std::move(s);
  }
  {
    // Files stay open only between waits: a file removed or replaced after a wait is opened
    // afresh, never written through a descriptor of the old one.
    std::lock_guard lock(mu_);
    close_all();
  }
  if (!first.is_ok()) return first;
  return static_cast<std::int64_t>(handles.size());
}

Status FileIo::register_pinned() {
  engine_->drain();
  std::vector<std::span<std::byte>> buffers;
  for (const auto& m : pinned_) buffers.push_back(m->bytes());
  return engine_->register_buffers(buffers);
}

Result<std::shared_ptr<sys::HostMapping>> FileIo::new_pinned(std::size_t size_bytes) {
  std::shared_ptr<sys::HostMapping> m;
  try {
    m = std::make_shared<sys::HostMapping>(std::max<std::size_t>(size_bytes, 1));
  } catch (const std::bad_alloc&) {
    return out_of_memory("cannot map " + std::to_string(size_bytes) + " bytes of pinned memory");
  }
  std::lock_guard lock(mu_);
  pinned_.push_back(m);
  // Unregistered memory still works, only slower: a refusal (RLIMIT_MEMLOCK) is not an error.
  (void)register_pinned();
  return m;
}

Status FileIo::free_pinned(const void* data) {
  std::lock_guard lock(mu_);
  const auto it = std::find_if(pinned_.begin(), pinned_.end(),
                               [&](const auto& m) { return m->data() == data; });
  if (it == pinned_.end()) {
    return invalid_argument("free_pinned: that buffer is not one new_pinned made");
  }
  pinned_.erase(it);
  (void)register_pinned();
  return Status::ok();
}

}  // namespace strata::io
