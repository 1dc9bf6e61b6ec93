// TieredStore: owns tensors by handle and keeps each one's copies in the device, host and NVMe
// tiers, moving them asynchronously (device<->host on the device's copy streams, host<->NVMe
// through the swap space, NVMe<->device through a fixed pool of pinned staging buffers) while no
// tier ever holds more than its budget, transfers in flight included.
//
// Vocabulary. A tensor's *home* is the tier that always holds an allocated copy (a transient
// tensor has none: its data lives only in the copies it has). A copy is *valid* when it holds the
// latest data. The tensor is *dirty* when its home copy is not valid (for a transient tensor:
// always, while it has data). A copy is *pinned* while a caller uses it in place (a kernel reads
// it): it cannot be released or evicted. Dropping a copy that is the only valid one would lose
// data, so release() refuses it and evict() writes it back first.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "strata/core/status.h"
#include "strata/device/device.h"
#include "strata/io/swap.h"
#include "strata/mem/host_memory.h"
#include "strata/mem/timeline.h"
#include "strata/tensor/tensor.h"

namespace strata::mem {

enum class Handle : std::uint32_t { kInvalid = 0xffffffffu };
inline std::uint32_t handle_index(Handle h) { return static_cast<std::uint32_t>(h); }

inline constexpr std::uint64_t kNeverUsed = std::numeric_limits<std::uint64_t>::max();

// Knows the future access order (the prefetch scheduler's recorded trace). The store asks it to
// choose eviction victims by Belady's rule; without one it evicts the least recently used.
class EvictionAdvisor {
 public:
  virtual ~EvictionAdvisor() = default;
  // Accesses until `h` is next used, or kNeverUsed. Called with the store's lock held: it must
  // not call back into the store.
  virtual std::uint64_t next_use(Handle h) const = 0;
};

struct TensorSpec {
  std::string name;  // used in every message about the tensor
  std::uint64_t size_bytes = 0;
  Tier home = Tier::kHost;  // ignored for a transient tensor
  bool transient = false;   // no home: e.g. a gradient on its way from the device to the host
  // Device working memory (ZeRO's gathered parameters and reduce buckets, the model's
  // activations): transient, lives only on the device and only from emplace to discard. Never
  // fetched, evicted or written back; it counts against the device budget like any copy.
  bool scratch = false;
  // A home copy the caller owns (kDevice: a device pointer; kHost: 4096-aligned host memory of
  // at least round_up(size_bytes, 4096) bytes). Null: the store allocates the home copy.
  void* home_data = nullptr;
  // A home copy's initial contents count as the tensor's data (false: the tensor is empty until
  // written; fetching it is an error).
  bool home_initialized = true;
};

struct StoreOptions {
  // Budget per tier, indexed by Tier (device, host, nvme); 0 = no limit of the store's own (the
  // device's allocator and the swap space still have theirs). The host budget covers the
  // staging pool and every host copy the store allocates, not caller-owned homes.
  std::array<std::uint64_t, kNumTiers> budget_bytes{};
  std::size_t staging_buffer_bytes = std::size_t{8} << 20;  // chunk of an NVMe<->device move
  int num_staging_buffers = 4;
  // Staging for ranged NVMe I/O (read_range, write_range: the optimizer's sub-group slots), a
  // multiple of 4096: part of the same pool and registration, counted in the host budget.
  std::size_t range_io_bytes = 0;
  // Device buffers of dropped copies kept for reuse, per tensor size: the next fetch of that size
  // skips the allocator (on the CPU backend, fresh pages cost 7x the copy into them; on CUDA, a
  // cudaMalloc). Cached buffers count against the device budget and go first when room is needed.
  int device_cache_blocks_per_size = 2;
  // On a host-addressable device (the CPU backend) NVMe <-> device moves read and write the
  // device copy directly, without the staging copy; such copies are allocated page-aligned with
  // room for a whole O_DIRECT block (round_up(size, 4096) + 4096 bytes of the budget).
  bool direct_device_io = true;
  // Host memory source; null = make_device_host_allocator(device) (pinned by the device).
  // Must outlive the store.
  HostAllocator* host_allocator = nullptr;
  Timeline* timeline = nullptr;  // spans of every transfer and stall; optional
};

// The end of one asynchronous operation. Copyable; a default-constructed completion is done.
class Completion {
 public:
  struct State;
  Completion() = default;
  explicit Completion(std::shared_ptr<State> state) : state_(std::move(state)) {}
  bool done() const;
  // Blocks until done; the operation's status. Prefer TieredStore::wait (counts stall time).
  Status wait() const;
  const State* state() const { return state_.get(); }

 private:
  std::shared_ptr<State> state_;
};

struct Residency {
  std::array<bool, kNumTiers> valid{};      // holds the latest data
  std::array<bool, kNumTiers> allocated{};  // holds a buffer
  std::array<int, kNumTiers> pins{};
  bool dirty = false;
  bool in_flight = false;  // an operation on this tensor has not finished
  int num_valid() const { return int(valid[0]) + int(valid[1]) + int(valid[2]); }
};

struct TierUsage {
  std::uint64_t budget_bytes = 0;    // 0 = no limit
  std::uint64_t reserved_bytes = 0;  // copies held plus destinations of transfers in flight
  std::uint64_t peak_bytes = 0;      // high-water mark of reserved_bytes
  std::uint64_t pinned_bytes = 0;
};

struct StoreStats {
  std::uint64_t bytes_moved[kNumTiers][kNumTiers] = {};  // [from][to]
  std::uint64_t fetches = 0;             // transfers started to make a copy valid somewhere
  std::uint64_t prefetches = 0;          // of which started by try_prefetch
  std::uint64_t prefetches_refused = 0;  // try_prefetch that found no room without waiting
  std::uint64_t hits = 0;                // acquire found the copy already valid
  std::uint64_t misses = 0;              // acquire had to start a fetch itself
  std::uint64_t evictions = 0;           // copies dropped to make room
  std::uint64_t writebacks = 0;          // transfers that saved the only valid copy
  std::uint64_t failures = 0;            // operations that ended with an error
  double stall_ms = 0;                   // callers blocked waiting for data or room
  std::array<std::uint64_t, kNumTiers> peak_bytes{};
};

class TieredStore {
 public:
  // `swap` may be null when no tensor ever touches the NVMe tier. Device and swap must outlive
  // the store.
  static Result<std::unique_ptr<TieredStore>> create(device::Device& device, io::SwapSpace* swap,
                                                     const StoreOptions& options);
  // Waits for every transfer in flight, then frees every copy the store allocated.
  ~TieredStore();
  TieredStore(const TieredStore&) = delete;
  TieredStore& operator=(const TieredStore&) = delete;

  // Registers a tensor and allocates its home copy. A tensor larger than the budget of its home
  // tier or of the device tier is an out_of_memory error naming the tensor, its size and the
  // budget; so is a home that does not fit next to the tensors already registered.
  Result<Handle> add(const TensorSpec& spec);

  // Starts making the copy on `to` valid; returns at once when it already is. A transfer of this
  // tensor that failed earlier (a prefetch nobody waited for) is reported here, once. Makes room by
  // evicting other tensors' unpinned copies (farthest next use first), writing back dirty ones,
  // and waits for transfers in flight when only they can free room. Errors: out_of_memory when
  // pinned copies leave no room; the completion carries transfer errors.
  Result<Completion> fetch(Handle h, Tier to);
  // A fetch that starts only if it can start now: no waiting, no write-backs, and no evicting a
  // copy that will be used before `h`. nullopt when it did not start (or nothing was to do).
  std::optional<Completion> try_prefetch(Handle h, Tier to);

  // Fetches on demand if needed, waits, and pins the copy on `tier` (device or host); returns its
  // address. A transfer of this tensor that failed earlier (a prefetch) is reported here.
  Result<void*> acquire(Handle h, Tier tier);
  void unpin(Handle h, Tier tier);
  // The caller changed the copy it has pinned on `tier`: it becomes the only valid copy.
  void mark_dirty(Handle h, Tier tier);
  // Gives the tensor a fresh copy on `tier` (device or host) as its only data, zero-filled on
  // request, pinned; previous data is discarded. Until the caller unpins it or marks it dirty,
  // no prefetch reads it (it is being written).
  Result<void*> emplace(Handle h, Tier tier, bool zero_fill);
  // Whether `bytes` more would fit in the device budget beside what no eviction can free:
  // device homes, pinned device copies, scratch, and transient tensors' only copies that their
  // owner has not evicted; if so, an emplace of that many bytes finds room. The answer depends
  // only on which tensors are registered, pinned and emplaced, never on the timing of
  // transfers, so processes that make the same calls get the same answer: ZeRO's gather-ahead,
  // which every rank must issue or skip alike, asks this before it takes anything. Always true
  // without a device budget.
  bool device_fits(std::uint64_t bytes) const;

  // Drops the copy on `tier` if another valid copy exists. failed_precondition if it is the home,
  // pinned, or the only valid copy (use evict). No copy there: ok.
  Status release(Handle h, Tier tier);
  // Drops the copy on `tier`, first writing it back (to the home, or for a transient tensor to
  // `down_to`, default the next tier down: a checkpointed activation goes from the device
  // straight to NVMe) when it is the only valid copy. On a write-back error the copy stays.
  Result<Completion> evict(Handle h, Tier tier, std::optional<Tier> down_to = std::nullopt);
  // The tensor's data is no longer needed: drops every copy without writing anything back. A
  // homed tensor keeps its home allocated, holding no data until written again (a fetch before
  // then is an error).
  Status discard(Handle h);

  // Overwrites a homed tensor's data from host memory `src` (at least size_bytes; NVMe homes are
  // written directly when src is 4096-aligned with round_up(size, 4096) readable bytes, as
  // `src_capacity_bytes` says, else through staging). Every other copy is dropped. Synchronous.
  Status write(Handle h, const void* src, std::size_t src_capacity_bytes);
  // Copies the tensor's latest data into host memory `dst` (size_bytes). Synchronous.
  Status read(Handle h, void* dst);
  // Overwrites a homed tensor's data with zeros (every other copy is dropped). Synchronous.
  Status fill_zero(Handle h);

  // Ranged I/O straight on an NVMe home, in and out of the pool's range region (the optimizer
  // streams sub-groups of its state this way, and the store counts the bytes as it counts its
  // own moves). open_ranges writes a newer copy back first and drops every other copy; until
  // close_ranges the tensor is held: no other operation on it starts. A home never written may
  // be opened to be written.
  Status open_ranges(Handle h);
  // Asynchronous: `bytes` (a multiple of 4096, within the home's extent) at `offset` (4096-
  // aligned) of the held tensor's home into or out of `buffer`, which lies in range_staging().
  io::IoHandle read_range(Handle h, std::uint64_t offset, void* buffer, std::size_t bytes);
  io::IoHandle write_range(Handle h, std::uint64_t offset, const void* buffer, std::size_t bytes);
  // `wrote`: ranges were written, and `ok` says whether every write succeeded (if not, the data
  // is lost and the tensor has none until written again). Every range I/O must have finished.
  void close_ranges(Handle h, bool wrote, bool ok);
  // The region of the staging pool for ranged I/O (StoreOptions::range_io_bytes); pinned,
  // registered with the swap space with the rest of the pool, and one caller's to use.
  std::span<std::byte> range_staging() const;

  // Blocks until `c` is done, counting the time as stall; returns its status.
  Status wait(const Completion& c);
  // Blocks until no operation is in flight.
  void drain();
  // Frees the cached device buffers of dropped copies (see device_cache_blocks_per_size).
  void trim_device_cache();
  // Returns the host blocks of dropped copies, kept for reuse by copies of the same size, to the
  // allocator (after loading, whose copies are not made again).
  void trim_host_cache();

  void set_advisor(const EvictionAdvisor* advisor);
  Residency residency(Handle h) const;
  TierUsage usage(Tier tier) const;
  StoreStats stats() const;
  const TensorSpec& spec(Handle h) const;
  std::size_t num_tensors() const;
  std::uint64_t staging_bytes() const;
  // Bytes a device copy of `h` takes from the device budget: its size, plus room to page-align
  // it where NVMe moves read and write the device copy directly.
  std::uint64_t device_bytes(Handle h) const;

 private:
  struct Impl;
  explicit TieredStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::mem
