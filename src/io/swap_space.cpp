// SwapSpace: option checks, engine choice, striped extent allocation and request splitting.

#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <mutex>
#include <set>
#include <utility>

#include "src/io/engine.h"
#include "src/io/errno_text.h"
#include "src/io/extent_allocator.h"
#include "src/io/extent_checksums.h"
#include "src/io/io_state.h"
#include "src/io/stripe_layout.h"
#include "src/io/swap_dir.h"
#include "strata/build_config.h"
#include "strata/core/json.h"
#include "strata/core/logging.h"
#include "strata/io/swap.h"

namespace strata::io {
namespace {

// Kernel transfers return an int and Linux caps one at just under 2 GiB; 1 GiB chunks are more
// than any drive needs.
constexpr std::size_t kMaxBlockBytes = std::size_t{1} << 30;
constexpr int kMaxQueueDepth = 4096;
constexpr int kMaxThreads = 256;
constexpr int kMaxRings = 64;

// Exact bytes for a size the user compares with `df`, with the readable form beside them.
std::string exact_bytes(std::uint64_t bytes) {
  return std::to_string(bytes) + " bytes (" + format_bytes(bytes) + ")";
}

Status validate_options(const SwapOptions& o) {
  std::vector<std::string> problems;
  const bool memory = o.engine == SwapEngine::kMemory;
  if (o.paths.empty() && !memory) {
    problems.push_back("swap_paths is empty; give at least one directory (one per drive)");
  }
  std::set<std::string> seen;
  for (const std::string& p : o.paths) {
    if (p.empty()) {
      problems.push_back("swap_paths has an empty entry");
      continue;
    }
    std::string normal = std::filesystem::path(p).lexically_normal().string();
    while (normal.size() > 1 && normal.back() == '/') normal.pop_back();  // "/x/" is "/x"
    if (!seen.insert(normal).second) {
      problems.push_back("swap_paths lists " + p + " twice; give each directory once");
    }
  }
  if (o.block_size_bytes == 0 || o.block_size_bytes % kIoAlignBytes != 0 ||
      o.block_size_bytes > kMaxBlockBytes) {
    problems.push_back("block_size_bytes " + std::to_string(o.block_size_bytes) +
                       " must be a positive multiple of " + std::to_string(kIoAlignBytes) +
                       " no larger than " + std::to_string(kMaxBlockBytes));
  }
  if (o.queue_depth < 1 || o.queue_depth > kMaxQueueDepth) {
    problems.push_back("queue_depth " + std::to_string(o.queue_depth) + " must be in [1, " +
                       std::to_string(kMaxQueueDepth) + "]");
  }
  if (o.thread_count < 1 || o.thread_count > kMaxRings) {
    problems.push_back("thread_count " + std::to_string(o.thread_count) + " must be in [1, " +
                       std::to_string(kMaxRings) + "]");
  }
  if (o.posix_threads < 1 || o.posix_threads > kMaxThreads) {
    problems.push_back("posix_threads " + std::to_string(o.posix_threads) + " must be in [1, " +
                       std::to_string(kMaxThreads) + "]");
  }
  if (o.verify_swap && STRATA_HAVE_XXHASH == 0) {
    problems.push_back(
        "verify_swap needs libxxhash, which this build lacks (install "
        "libxxhash-dev and rebuild)");
  }
  if (problems.empty()) return Status::ok();
  std::string msg = "invalid swap options: ";
  for (std::size_t i = 0; i < problems.size(); ++i) msg += (i > 0 ? "; " : "") + problems[i];
  return invalid_argument(std::move(msg));
}

std::string hex(std::uint64_t v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%016jx", static_cast<std::uintmax_t>(v));
  return buf;
}

class SwapSpaceImpl final : public SwapSpace {
 public:
  SwapSpaceImpl(std::vector<SwapDir> dirs, StripeLayout layout, std::unique_ptr<Engine> engine,
                bool verify, std::vector<std::string> warnings)
      : dirs_(std::move(dirs)),
        layout_(layout),
        verify_(verify),
        warnings_(std::move(warnings)),
        engine_(std::move(engine)) {
    STRATA_CHECK(engine_->num_files() == layout_.num_files(), "engine and layout disagree");
  }

  ~SwapSpaceImpl() override {
    // Chunks in flight point into caller buffers and at our files: finish them before the
    // engine stops and the files are deleted (dirs_ is destroyed after engine_).
    engine_->drain();
    engine_.reset();
  }

  Result<Extent> allocate(std::uint64_t size_bytes, std::string_view what) override {
    if (size_bytes == 0) {
      return invalid_argument("cannot allocate 0 bytes of swap for '" + std::string(what) + "'");
    }
    std::lock_guard lock(mu_);
    auto extent = allocator_.allocate(size_bytes);
    if (!extent) {
      const std::uint64_t grown =
          layout_.round_up_to_rows(allocator_.capacity() + allocator_.growth_needed(size_bytes));
      STRATA_RETURN_IF_ERROR(grow_locked(grown, size_bytes, what));
      extent = allocator_.allocate(size_bytes);
      STRATA_CHECK(extent.has_value(), "allocation failed right after growing", size_bytes);
    }
    if (verify_) checksums_.add(*extent, what);
    return *extent;
  }

  void free(const Extent& extent) override {
    if (!extent.valid()) return;
    std::lock_guard lock(mu_);
    allocator_.free(extent);
    if (verify_) checksums_.remove(extent);
  }

  IoHandle submit(const IoRequest& request) override {
    std::vector<IoChunk> chunks;
    IoHandle handle = prepare(request, chunks);
    engine_->submit(std::move(chunks));
    return handle;
  }

  std::vector<IoHandle> submit_batch(std::span<const IoRequest> requests) override {
    std::vector<IoChunk> chunks;
    std::vector<IoHandle> handles;
    handles.reserve(requests.size());
    for (const IoRequest& r : requests) handles.push_back(prepare(r, chunks));
    engine_->submit(std::move(chunks));
    return handles;
  }

  Status set_registered_buffers(std::span<const std::span<std::byte>> buffers) override {
    engine_->drain();
    return engine_->register_buffers(buffers);
  }

  IoStats stats() const override {
    IoStats s = tracker_.snapshot();
    const EngineCounters c = engine_->counters();
    s.read_chunks = c.read_chunks;
    s.write_chunks = c.write_chunks;
    s.retries = c.retries;
    s.faults_injected = c.faults_injected;
    s.fixed_chunks = c.fixed_chunks;
    return s;
  }

  std::string engine_name() const override { return std::string(engine_->name()); }

  std::uint64_t capacity_bytes() const override {
    std::lock_guard lock(mu_);
    return allocator_.capacity();
  }

  std::uint64_t used_bytes() const override {
    std::lock_guard lock(mu_);
    return allocator_.used_bytes();
  }

  std::vector<std::string> warnings() const override { return warnings_; }

  Status reserve_initial(std::uint64_t bytes) {
    std::lock_guard lock(mu_);
    return grow_locked(layout_.round_up_to_rows(bytes), bytes, "initial_capacity_bytes");
  }

 private:
  // Grows every file so the swap space holds `capacity` bytes. A failure leaves capacity as it
  // was (files that did grow are merely larger than needed, which the next growth reuses).
  Status grow_locked(std::uint64_t capacity, std::uint64_t request, std::string_view what) {
    if (capacity <= allocator_.capacity()) return Status::ok();
    const std::uint64_t file_bytes = layout_.file_bytes(capacity);
    for (int f = 0; f < layout_.num_files(); ++f) {
      const int err = engine_->grow(f, file_bytes);
      if (err == 0) continue;
      const std::string& path = engine_->path(f);
      const std::string detail = "cannot grow " + path + " to " + exact_bytes(file_bytes) +
                                 " for '" + std::string(what) + "' (a request of " +
                                 exact_bytes(request) + "): " + errno_text(err);
      if (err == ENOSPC || err == EDQUOT || err == ENOMEM) {
        if (dirs_.empty()) {
          return out_of_memory("in-memory swap is exhausted: " + detail +
                               "; free host memory or use a disk engine with swap_paths");
        }
        const SwapDir& dir = dirs_[f];
        const std::int64_t free_bytes = dir.free_bytes();
        const std::string free_text =
            free_bytes >= 0 ? exact_bytes(static_cast<std::uint64_t>(free_bytes)) : "unknown";
        return out_of_memory("swap directory " + dir.dir() + " is full: " + detail + "; " +
                             free_text + " free there. Free disk space, add a drive to " +
                             "swap_paths, or offload less");
      }
      return io_error(detail);
    }
    allocator_.grow(capacity);
    return Status::ok();
  }

  const std::string& path_at(std::uint64_t swap_offset) const {
    return engine_->path(layout_.locate(swap_offset).file);
  }

  Status validate(IoOp op, const Extent& extent, std::uint64_t offset, const std::byte* buf,
                  std::size_t size_bytes) const {
    const char* verb = op == IoOp::kRead ? "read" : "write";
    const std::string& path = path_at(extent.offset + offset);
    const std::string align = std::to_string(kIoAlignBytes);
    const auto addr = reinterpret_cast<std::uintptr_t>(buf);
    if (addr % kIoAlignBytes != 0) {
      char hex_addr[32];
      std::snprintf(hex_addr, sizeof(hex_addr), "0x%jx", static_cast<std::uintmax_t>(addr));
      return invalid_argument("buffer address " + std::string(hex_addr) + " is not aligned to " +
                              align + " for O_DIRECT on " + path +
                              "; allocate buffers with AlignedBuffer or posix_memalign(" + align +
                              ")");
    }
    if (offset % kIoAlignBytes != 0) {
      return invalid_argument("offset " + std::to_string(offset) + " is not aligned to " + align +
                              " for O_DIRECT on " + path + "; use offsets that are multiples of " +
                              align);
    }
    if (size_bytes % kIoAlignBytes != 0) {
      return invalid_argument("size " + std::to_string(size_bytes) + " bytes is not aligned to " +
                              align + " for O_DIRECT on " + path +
                              "; use sizes that are multiples of " + align);
    }
    if (!extent.valid()) return invalid_argument(std::string(verb) + " on an empty extent");
    if (offset > extent.size_bytes || size_bytes > extent.size_bytes - offset) {
      return invalid_argument(std::string(verb) + " of " + std::to_string(size_bytes) +
                              " bytes at offset " + std::to_string(offset) +
                              " runs past the end of its extent of " +
                              std::to_string(extent.size_bytes) + " bytes");
    }
    std::lock_guard lock(mu_);
    if (!allocator_.is_allocated(extent.offset, extent.size_bytes)) {
      return invalid_argument(std::string(verb) + " on an extent of " +
                              std::to_string(extent.size_bytes) + " bytes at swap offset " +
                              std::to_string(extent.offset) +
                              " that is not allocated (freed already?)");
    }
    return Status::ok();
  }

  // Validates a request and appends its chunks; a rejected or empty request comes back done.
  IoHandle prepare(const IoRequest& req, std::vector<IoChunk>& chunks) {
    auto* buf = static_cast<std::byte*>(req.buf);
    Status status = validate(req.op, req.extent, req.offset_in_extent, buf, req.size_bytes);
    if (!status.is_ok()) {
      tracker_.count_rejected();
      return IoHandle(IoHandle::State::finished(req.op, std::move(status), req.callback));
    }
    if (req.size_bytes == 0) {
      return IoHandle(IoHandle::State::finished(req.op, Status::ok(), req.callback));
    }
    const std::uint64_t start = req.extent.offset + req.offset_in_extent;
    std::vector<StripeLayout::Piece> pieces;
    layout_.split(start, req.size_bytes, pieces);
    auto state = std::make_shared<IoHandle::State>(
        req.op, static_cast<std::uint32_t>(pieces.size()), &tracker_, engine_->caller_driver());
    if (verify_) attach_verification(req, *state);
    if (req.callback) state->set_callback(req.callback);
    for (const StripeLayout::Piece& p : pieces) {
      chunks.push_back({req.op, p.file, p.file_offset, p.swap_offset, buf + (p.swap_offset - start),
                        static_cast<std::size_t>(p.size_bytes), state});
    }
    return IoHandle(std::move(state));
  }

  // Writes record their pieces' checksums now (the buffer must not change until the write is
  // done) and forget them if the write fails; reads check what they got on completion.
  void attach_verification(const IoRequest& req, IoHandle::State& state) {
    const auto* buf = static_cast<const std::byte*>(req.buf);
    const Extent extent = req.extent;
    const std::uint64_t offset = req.offset_in_extent;
    const std::size_t size = req.size_bytes;
    if (req.op == IoOp::kWrite) {
      checksums_.record_write(extent, offset, buf, size);
      state.set_finisher([this, extent, offset, size](const Status& s) {
        if (!s.is_ok()) checksums_.forget(extent, offset, size);
        return s;
      });
      return;
    }
    ExtentChecksums::ReadCheck check = checksums_.expect_read(extent, offset, size);
    if (check.pieces.empty()) return;  // nothing known to compare with
    state.set_finisher([this, check = std::move(check), buf](const Status& s) -> Status {
      if (!s.is_ok()) return s;
      const auto mismatch = ExtentChecksums::check(check, buf);
      tracker_.count_verified(ExtentChecksums::bytes_checked(check), !mismatch.has_value());
      if (!mismatch) return s;
      return data_loss(describe_mismatch(check, *mismatch));
    });
  }

  std::string describe_mismatch(const ExtentChecksums::ReadCheck& check,
                                const ExtentChecksums::Mismatch& m) const {
    const ExtentChecksums::Piece& p = m.piece;
    std::vector<StripeLayout::Piece> where;
    layout_.split(check.extent.offset + p.offset_in_extent, p.size_bytes, where);
    std::string files;
    for (std::size_t i = 0; i < where.size(); ++i) {
      files += (i > 0 ? ", " : "") + engine_->path(where[i].file) + " at offset " +
               std::to_string(where[i].file_offset);
    }
    return "checksum mismatch reading '" + check.what + "' from swap: bytes " +
           std::to_string(p.offset_in_extent) + ".." +
           std::to_string(p.offset_in_extent + p.size_bytes) + " of its extent (swap offset " +
           std::to_string(check.extent.offset) + ", " + std::to_string(check.extent.size_bytes) +
           " bytes) read back with xxh3 " + hex(m.actual) + " but were written with " + hex(p.sum) +
           " (stored in " + files +
           "); the swap file was changed behind Strata's back or the drive returned bad data";
  }

  // Destroyed in reverse: engine_ first (it drains), then the tracker its chunks report to,
  // then dirs_, which deletes the files.
  std::vector<SwapDir> dirs_;
  const StripeLayout layout_;
  const bool verify_;
  const std::vector<std::string> warnings_;
  StatsTracker tracker_;
  ExtentChecksums checksums_;
  mutable std::mutex mu_;  // guards allocator_ and growth
  ExtentAllocator allocator_{kIoAlignBytes};
  std::unique_ptr<Engine> engine_;
};

}  // namespace

std::optional<SwapEngine> parse_swap_engine(std::string_view name) {
  for (SwapEngine e : kSwapEngines) {
    if (swap_engine_name(e) == name) return e;
  }
  return std::nullopt;
}

Result<std::unique_ptr<SwapSpace>> SwapSpace::create(const SwapOptions& options) {
  STRATA_RETURN_IF_ERROR(validate_options(options));
  EngineOptions eo;
  eo.queue_depth = options.queue_depth;
  eo.threads = options.posix_threads;
  eo.rings = options.thread_count;
  eo.caller_driven = options.caller_driven;
  eo.sqpoll = options.sqpoll;
  eo.faults = options.fault_injection;

  std::vector<SwapDir> dirs;
  std::vector<std::string> warnings;
  std::unique_ptr<Engine> engine;
  if (options.engine == SwapEngine::kMemory) {
    std::vector<std::string> names;
    for (const std::string& p : options.paths) names.push_back("memory:" + p);
    if (names.empty()) names.push_back("memory:0");
    engine = make_memory_engine(std::move(names), eo);
  } else {
    std::vector<EngineFile> files;
    std::string refused;
    for (const std::string& path : options.paths) {
      STRATA_ASSIGN_OR_RETURN(
          SwapDir dir, SwapDir::open(path, options.direct, options.fault_injection.refuse_direct));
      if (dir.direct_refused()) refused += (refused.empty() ? "" : ", ") + dir.dir();
      files.push_back({dir.fd(), dir.file_path()});
      dirs.push_back(std::move(dir));
    }
    if (!refused.empty()) {
      warnings.push_back("the file system of " + refused +
                         " refuses O_DIRECT; swap there uses buffered I/O through the page cache, "
                         "which costs host memory and bandwidth");
    }
    STRATA_ASSIGN_OR_RETURN(
        engine, make_disk_engine(options.engine, std::move(files), eo, "swap", warnings));
  }
  if (std::string w = engine->setup_warning(); !w.empty()) warnings.push_back(std::move(w));
  if (options.log_warnings) {
    for (const std::string& w : warnings) log_warning(w);
  }
  const int num_files = engine->num_files();
  auto space = std::make_unique<SwapSpaceImpl>(
      std::move(dirs), StripeLayout(num_files, options.block_size_bytes), std::move(engine),
      options.verify_swap, std::move(warnings));
  if (options.initial_capacity_bytes > 0) {
    STRATA_RETURN_IF_ERROR(space->reserve_initial(options.initial_capacity_bytes));
  }
  log_debug("swap space: engine " + space->engine_name() + ", " + std::to_string(num_files) +
            " file(s), block " + std::to_string(options.block_size_bytes) + " bytes, queue depth " +
            std::to_string(options.queue_depth) + ", " + std::to_string(options.thread_count) +
            " ring(s)" + (options.caller_driven ? " driven by callers" : "") +
            (options.verify_swap ? ", verified" : ""));
  return std::unique_ptr<SwapSpace>(std::move(space));
}

Result<BufferRegistration> SwapSpace::register_buffers(
    std::span<const std::span<std::byte>> buffers) {
  std::lock_guard lock(registration_mu_);
  const std::vector<std::span<std::byte>> live = registered_buffers();
  std::vector<std::span<std::byte>> all(buffers.begin(), buffers.end());
  all.insert(all.end(), live.begin(), live.end());
  Status st = set_registered_buffers(all);
  if (!st.is_ok()) {
    // The engine dropped its whole table; the registrations that were live keep theirs.
    if (!live.empty()) (void)set_registered_buffers(live);
    return st;
  }
  const std::uint64_t id = next_registration_++;
  registrations_.emplace_back(id,
                              std::vector<std::span<std::byte>>(buffers.begin(), buffers.end()));
  return BufferRegistration(this, id);
}

std::vector<std::span<std::byte>> SwapSpace::registered_buffers() const {
  std::vector<std::span<std::byte>> all;
  for (const auto& [id, bufs] : registrations_) all.insert(all.end(), bufs.begin(), bufs.end());
  return all;
}

void SwapSpace::release_registration(std::uint64_t id) {
  std::lock_guard lock(registration_mu_);
  std::erase_if(registrations_, [id](const auto& r) { return r.first == id; });
  // Re-registering fewer buffers than a table that already worked cannot hit the memlock limit;
  // if the kernel refuses anyway the rest go through ordinary (slower, correct) requests.
  Status st = set_registered_buffers(registered_buffers());
  if (!st.is_ok()) log_warning("swap space: " + st.message());
}

void BufferRegistration::reset() {
  if (swap_ != nullptr) swap_->release_registration(id_);
  swap_ = nullptr;
  id_ = 0;
}

}  // namespace strata::io
