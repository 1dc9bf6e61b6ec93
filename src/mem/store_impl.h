// The tiered store's private state: entries (one per tensor, with a copy slot per tier), the
// operations in flight, budgets, and the lanes that observe transfer completions.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "src/mem/ordered_lane.h"
#include "strata/mem/tiered_store.h"

namespace strata::mem {

struct Completion::State {
  void finish(Status s) {
    std::lock_guard lock(mu);
    status = std::move(s);
    done = true;
    cv.notify_all();
  }
  bool is_done() const {
    std::lock_guard lock(mu);
    return done;
  }
  Status wait() const {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return done; });
    return status;
  }

  mutable std::mutex mu;
  mutable std::condition_variable cv;
  bool done = false;
  Status status;
};

namespace detail {

enum class OpKind : std::uint8_t {
  kFetch,      // make the copy on `to` valid from the copy on `from`
  kWriteback,  // save the only valid copy (`from`) to `to`, then (evict) drop it
  kSync,       // a caller doing synchronous I/O on the tensor (write/read) holds it
};

// One transfer of one tensor. Moves between the device and NVMe go through staging buffers in
// chunks; every other move is a single chunk.
struct Op {
  OpKind kind = OpKind::kFetch;
  Handle h = Handle::kInvalid;
  Tier from = Tier::kHost, to = Tier::kHost;
  bool drop_source = false;  // evict: drop `from` once `to` is valid
  bool fresh_dest = false;   // the destination copy was allocated for this op
  bool prefetch = false;
  int chunks_total = 1;
  int chunks_issued = 0;
  int chunks_done = 0;
  Status status;  // first error
  std::int64_t begin_ns = 0;
  std::shared_ptr<Completion::State> completion = std::make_shared<Completion::State>();
};

struct CopySlot {
  bool allocated = false;
  bool valid = false;
  bool external = false;  // the caller's home memory
  int pins = 0;
  void* data = nullptr;  // device or host address
  device::DeviceBuffer device_buffer;
  io::Extent extent;
  // A caller-owned host home, registered with the device so copies from and to it are pinned.
  device::HostRegistration registration;
};

struct Entry {
  Handle h = Handle::kInvalid;
  TensorSpec spec;
  std::uint64_t io_bytes = 0;  // size rounded up to kIoAlignBytes
  std::array<CopySlot, kNumTiers> copy;
  std::shared_ptr<Op> op;      // in flight; blocks every other operation on this tensor
  std::shared_ptr<Op> failed;  // an op that failed and whose error nobody has seen yet
  std::uint64_t last_use = 0;
  bool writing = false;  // emplace gave the caller a copy to fill: no prefetch reads it yet

  CopySlot& at(Tier t) { return copy[static_cast<std::size_t>(t)]; }
  const CopySlot& at(Tier t) const { return copy[static_cast<std::size_t>(t)]; }
  bool is_home(Tier t) const { return !spec.transient && spec.home == t; }
  int num_valid() const { return int(copy[0].valid) + int(copy[1].valid) + int(copy[2].valid); }
};

// "device", "host", "nvme": a tier in messages.
inline std::string tier_text(Tier t) { return std::string(tier_name(t)); }

// The config key a tier's budget comes from, in messages.
inline std::string budget_key(Tier t) {
  switch (t) {
    case Tier::kDevice:
      return "device budget (device_memory_limit)";
    case Tier::kHost:
      return "host budget (host_memory_limit)";
    case Tier::kNvme:
      return "nvme budget";
  }
  return "budget";
}

}  // namespace detail

// The store's own files (tiered_store.cpp, store_budgets.cpp, store_transfers.cpp) use these
// unqualified.
using detail::budget_key;
using detail::Entry;
using detail::Op;
using detail::OpKind;
using detail::tier_text;

struct TieredStore::Impl {
  using Op = detail::Op;
  using Entry = detail::Entry;
  using Lock = std::unique_lock<std::mutex>;
  enum class Room : std::uint8_t { kReady, kWait, kRefused };

  Impl(device::Device& d, io::SwapSpace* s, const StoreOptions& o)
      : device(d), swap(s), options(o) {}

  // ---- tiered_store.cpp: budgets, victims, waiting ----
  Entry& entry(Handle h);
  const Entry& entry(Handle h) const;
  std::uint64_t budget(Tier t) const { return options.budget_bytes[static_cast<std::size_t>(t)]; }
  // NVMe <-> device without staging: the device is host memory and the tensor touches NVMe.
  bool direct_io(const Entry& e) const {
    return options.direct_device_io && device.host_addressable() && swap != nullptr &&
           !e.spec.scratch && (e.spec.transient || e.spec.home == Tier::kNvme);
  }
  // Bytes a device copy of `e` takes from the device (and the device budget).
  std::uint64_t device_bytes(const Entry& e) const {
    return direct_io(e) ? e.io_bytes + io::kIoAlignBytes : e.spec.size_bytes;
  }
  std::uint64_t& reserved(Tier t) { return reserved_bytes[static_cast<std::size_t>(t)]; }
  void charge(Tier t, std::uint64_t bytes);
  void uncharge(Tier t, std::uint64_t bytes);
  void sync_host_reserved();
  std::uint64_t room_needed(Tier t, const Entry& e) const;
  // Device bytes no eviction can free: device homes, pinned copies, scratch, and transient
  // tensors' only copies not yet on their way out.
  std::uint64_t held_device_bytes() const;
  Result<Room> make_room(Tier t, Entry& target, bool prefetch);
  // The best copy on `t` to drop or write back for `target` (null: for memory outside the store).
  Entry* pick_victim(Tier t, const Entry* target, bool prefetch,
                     const std::vector<Entry*>& exclude = {});
  // The device's reclaimer (Device::add_reclaimer): frees toward `bytes` from the device cache,
  // then clean device copies no one uses now; the bytes freed.
  std::uint64_t reclaim_device(std::uint64_t bytes);
  // A prefetch evicts only if the victims it may take free enough room: all or nothing.
  bool drop_victims_for_prefetch(Tier t, Entry& target, std::uint64_t over);
  Status allocate_copy(Entry& e, Tier t);
  // make_room + allocate, waiting when it must (demand) or giving up (prefetch: kRefused).
  Result<Room> allocate_with_room(Entry& e, Tier t, bool prefetch, Lock& lock);
  void drop_copy(Entry& e, Tier t);
  // Frees cached device buffers (never of size `keep`) until `bytes` were freed; returns that.
  std::uint64_t trim_device_cache(std::uint64_t bytes, std::uint64_t keep = 0);
  void wait_change(Lock& lock, const Entry* for_entry);
  void wait_op(Lock& lock, const std::shared_ptr<Op>& op);
  void wait_idle(Lock& lock, Entry& e);  // until e has no op in flight
  void add_stall(std::int64_t begin_ns, const Entry* e);

  // ---- store_transfers.cpp: starting, advancing and finishing operations ----
  std::shared_ptr<Op> new_op(detail::OpKind kind, Entry& e, Tier from, Tier to);
  Result<std::shared_ptr<Op>> start_fetch(Entry& e, Tier to, bool prefetch, Lock& lock);
  // `down_to` (a transient tensor only): the tier to write to, below `from`; default the next.
  Result<std::shared_ptr<Op>> start_writeback(Entry& e, Tier from, Lock* lock,
                                              std::optional<Tier> down_to = std::nullopt);
  void issue(const std::shared_ptr<Op>& op);
  void pump_staging();
  void issue_chunk(const std::shared_ptr<Op>& op, int chunk, int buf);
  void chunk_landed(const std::shared_ptr<Op>& op, int chunk, int buf, Status s);
  void chunk_staged(const std::shared_ptr<Op>& op, int chunk, int buf);
  void chunk_done(const std::shared_ptr<Op>& op, int buf);
  // One leg of a transfer: a copy between host and device memory on the direction's copy stream
  // (after what it was told to wait for), or an NVMe read or write of `extent` at `offset`; once
  // done, `then` runs on the leg's lane under the store's lock, the leg on the timeline.
  void device_copy(const std::shared_ptr<Op>& op, bool to_device, void* dst, const void* src,
                   std::size_t bytes, const char* verb, std::function<void()> then);
  void nvme_io(const std::shared_ptr<Op>& op, bool read, const io::Extent& extent,
               std::uint64_t offset, void* buf, std::size_t bytes, const char* verb,
               std::function<void(Status)> then);
  void complete_chunks(const std::shared_ptr<Op>& op, int n);
  void fail(Op& op, const Status& s);
  void finish(const std::shared_ptr<Op>& op);
  // The op (e's, synchronous or asynchronous) is over: wakes its waiters with `st`.
  void retire(Entry& e, const std::shared_ptr<Op>& op, const Status& st);
  void record(Lane lane, const Entry& e, const char* verb, std::int64_t begin_ns,
              std::uint64_t bytes);
  // src null: zeros.
  Status sync_write(Entry& e, const void* src, std::size_t capacity, Lock& lock);
  Status sync_read(Entry& e, void* dst, Lock& lock);
  int take_staging_blocking(Lock& lock);
  // Whether open_ranges holds `e` (its synchronous op on the NVMe home).
  static bool held_for_ranges(const Entry& e) {
    return e.op && e.op->kind == OpKind::kSync && e.op->from == Tier::kNvme &&
           e.op->to == Tier::kNvme;
  }
  // A read or write of a range of h's NVMe home (held by open_ranges), counted in the stats.
  io::IoHandle start_range(Handle h, std::uint64_t offset, std::byte* buffer, std::size_t bytes,
                           bool write);
  Status staged_nvme_io(Entry& e, const io::Extent& x, void* data, bool write, Lock& lock);
  // Exactly one of from_host (a copy to the device) and to_host (from it) is set.
  Status staged_device_copy(Entry& e, void* device_data, const void* from_host, void* to_host,
                            Lock& lock);

  device::Device& device;
  io::SwapSpace* swap;
  StoreOptions options;
  std::unique_ptr<HostAllocator> own_allocator;
  HostAllocator* allocator = nullptr;
  std::unique_ptr<StagingPool> staging;
  io::BufferRegistration staging_registration;  // the pool's, with the swap engine; before it dies
  std::unique_ptr<HostBlockCache> host_cache;
  // Device buffers of dropped copies by size, for reuse; counted in reserved(kDevice).
  std::map<std::uint64_t, std::vector<device::DeviceBuffer>> device_cache;

  mutable std::mutex mu;
  std::condition_variable cv;  // an op finished or a staging buffer came back
  std::vector<std::unique_ptr<Entry>> entries;
  std::array<std::uint64_t, kNumTiers> reserved_bytes{};
  std::deque<std::shared_ptr<Op>> staging_waiters;  // ops with chunks not yet issued
  int ops_in_flight = 0;
  std::uint64_t generation = 0;  // bumped whenever an op finishes
  std::uint64_t tick = 0;        // LRU clock
  const EvictionAdvisor* advisor = nullptr;
  StoreStats stats;
  std::int64_t stall_ns = 0;
  device::Event last_device_drop;  // compute may still read a dropped device copy (CUDA)

  // Last: destroyed first, after ~TieredStore drained them.
  std::unique_ptr<detail::OrderedLane> read_lane, write_lane, h2d_lane, d2h_lane;
};

}  // namespace strata::mem
