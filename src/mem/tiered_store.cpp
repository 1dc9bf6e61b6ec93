// TieredStore: registration and the residency rules of its operations. Budgets and victim choice
// are in store_budgets.cpp, the transfers themselves in store_transfers.cpp.
#include "strata/mem/tiered_store.h"

#include <algorithm>
#include <cstring>
#include <span>
#include <tuple>

#include "src/mem/store_impl.h"
#include "strata/core/aligned.h"
#include "strata/core/clock.h"
#include "strata/core/json.h"
#include "strata/core/logging.h"

namespace strata::mem {

bool Completion::done() const { return state_ == nullptr || state_->is_done(); }

Status Completion::wait() const { return state_ == nullptr ? Status::ok() : state_->wait(); }

// ---- creation ----

TieredStore::TieredStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<TieredStore>> TieredStore::create(device::Device& device,
                                                         io::SwapSpace* swap,
                                                         const StoreOptions& options) {
  auto impl = std::make_unique<Impl>(device, swap, options);
  if (options.host_allocator != nullptr) {
    impl->allocator = options.host_allocator;
  } else {
    impl->own_allocator = make_device_host_allocator(device);
    impl->allocator = impl->own_allocator.get();
  }
  const std::size_t chunk = options.staging_buffer_bytes;
  if (chunk == 0 || chunk % io::kIoAlignBytes != 0) {
    return invalid_argument("staging_buffer_bytes " + std::to_string(chunk) +
                            " must be a positive multiple of " + std::to_string(io::kIoAlignBytes));
  }
  const std::uint64_t pool =
      static_cast<std::uint64_t>(chunk) * options.num_staging_buffers + options.range_io_bytes;
  const std::uint64_t host_budget = impl->budget(Tier::kHost);
  if (host_budget != 0 && pool > host_budget) {
    return out_of_memory(
        "the staging pool (" + std::to_string(options.num_staging_buffers) + " x " +
        format_bytes(chunk) +
        (options.range_io_bytes != 0
             ? " and " + format_bytes(options.range_io_bytes) + " for the optimizer's sub-groups"
             : std::string()) +
        ") does not fit in the host budget of " + format_bytes(host_budget) +
        "; raise host_memory_limit or use fewer or smaller staging buffers");
  }
  STRATA_ASSIGN_OR_RETURN(impl->staging,
                          StagingPool::create(*impl->allocator, chunk, options.num_staging_buffers,
                                              options.range_io_bytes));
  if (swap != nullptr) {
    // Every NVMe transfer through the pool (the store's chunked moves and the optimizer's
    // ranges) reads and writes it as io_uring registered (fixed) buffers: no per-request page
    // pinning. Without them (another engine, or the memlock limit) the same I/O runs
    // unregistered.
    const std::span<std::byte> pool_bytes = impl->staging->all();
    auto reg = swap->register_buffers({&pool_bytes, 1});
    if (reg.is_ok()) {
      impl->staging_registration = std::move(*reg);
    } else {
      log_debug("tiered store: staging pool not registered with io_uring: " +
                reg.status().message());
    }
  }
  impl->host_cache = std::make_unique<HostBlockCache>(*impl->allocator);
  impl->sync_host_reserved();
  impl->read_lane = std::make_unique<detail::OrderedLane>();
  impl->write_lane = std::make_unique<detail::OrderedLane>();
  impl->h2d_lane = std::make_unique<detail::OrderedLane>();
  impl->d2h_lane = std::make_unique<detail::OrderedLane>();
  // Memory the device is asked for outside the store (a backend's op scratch, grown as shapes
  // need it) may take what the store keeps only as a cache.
  device.add_reclaimer(impl.get(),
                       [s = impl.get()](std::uint64_t bytes) { return s->reclaim_device(bytes); });
  return std::unique_ptr<TieredStore>(new TieredStore(std::move(impl)));
}

TieredStore::~TieredStore() {
  Impl& s = *impl_;
  s.device.remove_reclaimer(&s);
  drain();
  {
    std::lock_guard lock(s.mu);
    for (auto& e : s.entries) {
      for (int t = 0; t < kNumTiers; ++t) {
        auto& c = e->copy[static_cast<std::size_t>(t)];
        c.pins = 0;
        if (c.allocated && !c.external) s.drop_copy(*e, static_cast<Tier>(t));
      }
    }
  }
  // Lanes are idle (drained); stop them before the pool and cache they touch go away.
  s.read_lane.reset();
  s.write_lane.reset();
  s.h2d_lane.reset();
  s.d2h_lane.reset();
}

Result<Handle> TieredStore::add(const TensorSpec& requested) {
  Impl& s = *impl_;
  TensorSpec spec = requested;
  spec.transient = spec.transient || spec.scratch;
  if (spec.size_bytes == 0) {
    return invalid_argument("tensor '" + spec.name +
                            "' has size 0; the store holds no empty tensors");
  }
  auto e = std::make_unique<Entry>();
  e->spec = spec;
  if (spec.scratch && spec.home_data != nullptr) {
    return invalid_argument("tensor '" + spec.name + "': scratch memory has no home_data");
  }
  e->io_bytes = align_up(spec.size_bytes, io::kIoAlignBytes);
  // Every tensor here exists to reach the device; its home (or, transient, the host it drains
  // to) must hold it as well. Scratch never leaves the device.
  std::vector<Tier> tiers = {Tier::kDevice};
  if (!spec.scratch) tiers.push_back(spec.transient ? Tier::kHost : spec.home);
  for (Tier t : tiers) {
    const std::uint64_t b = s.budget(t);
    const std::uint64_t need = t == Tier::kDevice ? s.device_bytes(*e) : e->io_bytes;
    if (b != 0 && need > b && !(spec.home_data != nullptr && t == spec.home)) {
      return out_of_memory("tensor '" + spec.name + "' (" + format_bytes(spec.size_bytes) +
                           ") is larger than the whole " + budget_key(t) + " of " +
                           format_bytes(b) + "; raise the budget or split the tensor");
    }
  }
  if (!spec.transient && spec.home == Tier::kNvme && s.swap == nullptr) {
    return invalid_argument("tensor '" + spec.name +
                            "' lives on nvme but the store has no swap "
                            "space; give swap_paths");
  }
  if (spec.home_data != nullptr) {
    if (spec.transient || spec.home == Tier::kNvme) {
      return invalid_argument("tensor '" + spec.name +
                              "': home_data is only for a device or host home");
    }
    if (spec.home == Tier::kHost &&
        reinterpret_cast<std::uintptr_t>(spec.home_data) % io::kIoAlignBytes != 0) {
      return invalid_argument("tensor '" + spec.name + "': host home_data must be aligned to " +
                              std::to_string(io::kIoAlignBytes) + " bytes");
    }
  }
  std::lock_guard lock(s.mu);
  e->h = static_cast<Handle>(s.entries.size());
  if (!spec.transient) {
    auto& home = e->at(spec.home);
    if (spec.home_data != nullptr) {
      if (spec.home == Tier::kHost) {
        STRATA_ASSIGN_OR_RETURN(home.registration,
                                s.device.register_host(spec.home_data, e->io_bytes));
      }
      home.allocated = true;
      home.external = true;
      home.data = spec.home_data;
    } else {
      Result<Impl::Room> room = s.make_room(spec.home, *e, /*prefetch=*/true);
      if (!room.is_ok() || *room != Impl::Room::kReady) {
        const std::uint64_t b = s.budget(spec.home);
        return out_of_memory("tensor '" + spec.name + "' (" + format_bytes(e->io_bytes) +
                             ") does not fit in the " + budget_key(spec.home) + " of " +
                             format_bytes(b) + " next to the " +
                             format_bytes(s.reserved(spec.home)) + " already placed there");
      }
      STRATA_RETURN_IF_ERROR(s.allocate_copy(*e, spec.home)
                                 .with_context("placing the home copy of '" + spec.name + "'"));
    }
    home.valid = spec.home_initialized;
  }
  s.entries.push_back(std::move(e));
  return s.entries.back()->h;
}

// ---- operations ----

Result<Completion> TieredStore::fetch(Handle h, Tier to) {
  Impl& s = *impl_;
  Impl::Lock lock(s.mu);
  Entry& e = s.entry(h);
  for (;;) {
    if (e.op) {
      if (e.op->kind == OpKind::kFetch && e.op->to == to) return Completion(e.op->completion);
      s.wait_op(lock, e.op);
      continue;
    }
    if (e.failed) {
      Status st = e.failed->status;
      e.failed.reset();
      return st;
    }
    if (e.at(to).valid) return Completion();
    STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Op> op, s.start_fetch(e, to, false, lock));
    if (op) return Completion(op->completion);
  }
}

std::optional<Completion> TieredStore::try_prefetch(Handle h, Tier to) {
  Impl& s = *impl_;
  Impl::Lock lock(s.mu);
  Entry& e = s.entry(h);
  if (e.op || e.failed || e.writing || e.at(to).valid || e.num_valid() == 0) return std::nullopt;
  auto op = s.start_fetch(e, to, /*prefetch=*/true, lock);
  if (!op.is_ok() || *op == nullptr) {
    ++s.stats.prefetches_refused;
    return std::nullopt;
  }
  ++s.stats.prefetches;
  return Completion((*op)->completion);
}

Result<void*> TieredStore::acquire(Handle h, Tier tier) {
  STRATA_CHECK(tier != Tier::kNvme, "NVMe copies cannot be pinned", handle_index(h));
  Impl& s = *impl_;
  Impl::Lock lock(s.mu);
  Entry& e = s.entry(h);
  bool missed = false;
  for (;;) {
    if (e.failed) {
      Status st = e.failed->status;
      e.failed.reset();
      return st;
    }
    if (e.op) {
      s.wait_op(lock, e.op);
      continue;
    }
    auto& c = e.at(tier);
    if (c.valid) {
      ++c.pins;
      e.last_use = ++s.tick;
      ++(missed ? s.stats.misses : s.stats.hits);
      return c.data;
    }
    missed = true;
    STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Op> op, s.start_fetch(e, tier, false, lock));
    (void)op;  // the next turn waits for it
  }
}

void TieredStore::unpin(Handle h, Tier tier) {
  Impl& s = *impl_;
  std::lock_guard lock(s.mu);
  auto& c = s.entry(h).at(tier);
  STRATA_CHECK(c.pins > 0, "unpin of a copy that is not pinned", s.entry(h).spec.name,
               tier_text(tier));
  --c.pins;
  s.entry(h).writing = false;
}

void TieredStore::mark_dirty(Handle h, Tier tier) {
  Impl& s = *impl_;
  std::lock_guard lock(s.mu);
  Entry& e = s.entry(h);
  STRATA_CHECK(e.at(tier).pins > 0 && e.at(tier).valid,
               "mark_dirty needs the caller to hold a pinned, valid copy", e.spec.name,
               tier_text(tier));
  STRATA_CHECK(!e.op, "mark_dirty while a transfer of the tensor is in flight", e.spec.name);
  e.writing = false;
  for (int i = 0; i < kNumTiers; ++i) {
    const auto t = static_cast<Tier>(i);
    if (t == tier) continue;
    auto& c = e.at(t);
    STRATA_CHECK(c.pins == 0, "mark_dirty while another tier's copy is pinned (a stale reader)",
                 e.spec.name, tier_text(t));
    if (e.is_home(t)) {
      c.valid = false;
    } else if (c.allocated) {
      s.drop_copy(e, t);
    }
  }
}

Result<void*> TieredStore::emplace(Handle h, Tier tier, bool zero_fill) {
  STRATA_CHECK(tier != Tier::kNvme, "emplace on NVMe is not supported", handle_index(h));
  Impl& s = *impl_;
  Impl::Lock lock(s.mu);
  Entry& e = s.entry(h);
  STRATA_CHECK(!e.spec.scratch || tier == Tier::kDevice, "scratch lives on the device",
               e.spec.name);
  s.wait_idle(lock, e);
  e.failed.reset();
  for (int i = 0; i < kNumTiers; ++i) {
    const auto t = static_cast<Tier>(i);
    auto& c = e.at(t);
    STRATA_CHECK(c.pins == 0, "emplace while a copy is pinned", e.spec.name, tier_text(t));
    if (t == tier) continue;
    if (e.is_home(t)) {
      c.valid = false;
    } else if (c.allocated) {
      s.drop_copy(e, t);
    }
  }
  auto& c = e.at(tier);
  if (!c.allocated) {
    for (;;) {
      STRATA_ASSIGN_OR_RETURN(Impl::Room room, s.allocate_with_room(e, tier, false, lock));
      if (room == Impl::Room::kReady) break;
      if (e.op) s.wait_idle(lock, e);  // a writeback another caller started; rare
    }
  }
  c.valid = true;
  ++c.pins;
  e.writing = true;
  e.last_use = ++s.tick;
  if (zero_fill) {
    if (tier == Tier::kDevice) {
      s.device.fill_zero(c.data, e.spec.size_bytes, s.device.stream(device::StreamKind::kCompute));
    } else {
      std::memset(c.data, 0, e.spec.size_bytes);
    }
  }
  return c.data;
}

bool TieredStore::device_fits(std::uint64_t bytes) const {
  const Impl& s = *impl_;
  std::lock_guard lock(s.mu);
  const std::uint64_t b = s.budget(Tier::kDevice);
  return b == 0 || s.held_device_bytes() + bytes <= b;
}

std::uint64_t TieredStore::Impl::held_device_bytes() const {
  std::uint64_t bytes = 0;
  for (const auto& e : entries) {
    const auto& c = e->at(Tier::kDevice);
    if (!c.allocated || c.external) continue;
    // A transient tensor's only copy moves when its owner evicts it (an op in flight, then
    // gone): until then nothing else may move it.
    const bool stranded = e->spec.transient && c.valid && e->num_valid() == 1 && !e->op;
    if (c.pins > 0 || e->is_home(Tier::kDevice) || e->spec.scratch || stranded) {
      bytes += device_bytes(*e);
    }
  }
  return bytes;
}

std::uint64_t TieredStore::device_bytes(Handle h) const {
  std::lock_guard lock(impl_->mu);
  return impl_->device_bytes(impl_->entry(h));
}

Status TieredStore::release(Handle h, Tier tier) {
  Impl& s = *impl_;
  Impl::Lock lock(s.mu);
  Entry& e = s.entry(h);
  s.wait_idle(lock, e);
  auto& c = e.at(tier);
  if (!c.allocated) return Status::ok();
  const std::string what = "release of the " + tier_text(tier) + " copy of '" + e.spec.name + "'";
  if (e.is_home(tier)) return failed_precondition(what + ": it is the tensor's home");
  if (c.pins > 0) return failed_precondition(what + ": it is pinned");
  if (c.valid && e.num_valid() == 1) {
    return failed_precondition(what + ": it is the only valid copy; evict it to write it back");
  }
  s.drop_copy(e, tier);
  return Status::ok();
}

Result<Completion> TieredStore::evict(Handle h, Tier tier, std::optional<Tier> down_to) {
  Impl& s = *impl_;
  Impl::Lock lock(s.mu);
  Entry& e = s.entry(h);
  s.wait_idle(lock, e);
  STRATA_CHECK(!e.spec.scratch, "scratch is discarded, never evicted", e.spec.name);
  auto& c = e.at(tier);
  const std::string what = "evicting the " + tier_text(tier) + " copy of '" + e.spec.name + "'";
  if (!c.allocated) return Completion();
  if (e.is_home(tier)) return invalid_argument(what + ": it is the tensor's home");
  if (c.pins > 0) return failed_precondition(what + ": it is pinned");
  if (down_to && (!e.spec.transient || *down_to <= tier)) {
    return invalid_argument(what + " to " + tier_text(*down_to) +
                            ": only a transient tensor's copy goes down to a tier of its choosing, "
                            "and only down");
  }
  if (!c.valid || e.num_valid() > 1) {
    s.drop_copy(e, tier);
    return Completion();
  }
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Op> op, s.start_writeback(e, tier, &lock, down_to));
  return Completion(op->completion);
}

Status TieredStore::discard(Handle h) {
  Impl& s = *impl_;
  Impl::Lock lock(s.mu);
  Entry& e = s.entry(h);
  s.wait_idle(lock, e);
  e.failed.reset();
  for (int i = 0; i < kNumTiers; ++i) {
    const auto t = static_cast<Tier>(i);
    auto& c = e.at(t);
    STRATA_CHECK(c.pins == 0, "discard of a pinned tensor", e.spec.name);
    if (e.is_home(t)) {
      c.valid = false;  // the home stays allocated, empty until written
    } else if (c.allocated) {
      s.drop_copy(e, t);
    }
  }
  return Status::ok();
}

Status TieredStore::write(Handle h, const void* src, std::size_t src_capacity_bytes) {
  Impl& s = *impl_;
  Impl::Lock lock(s.mu);
  Entry& e = s.entry(h);
  STRATA_CHECK(!e.spec.transient, "write is for tensors with a home", e.spec.name);
  s.wait_idle(lock, e);
  e.failed.reset();
  return s.sync_write(e, src, src_capacity_bytes, lock);
}

Status TieredStore::read(Handle h, void* dst) {
  Impl& s = *impl_;
  Impl::Lock lock(s.mu);
  Entry& e = s.entry(h);
  s.wait_idle(lock, e);
  return s.sync_read(e, dst, lock);
}

Status TieredStore::fill_zero(Handle h) { return write(h, nullptr, 0); }  // null: zeros

Status TieredStore::open_ranges(Handle h) {
  Impl& s = *impl_;
  Impl::Lock lock(s.mu);
  Entry& e = s.entry(h);
  STRATA_CHECK(!e.spec.transient && e.spec.home == Tier::kNvme,
               "ranged I/O is for tensors with an NVMe home", e.spec.name);
  s.wait_idle(lock, e);
  if (e.failed) {
    Status st = e.failed->status;
    e.failed.reset();
    return st;
  }
  auto& home = e.at(Tier::kNvme);
  if (!home.valid) {
    for (Tier t : {Tier::kHost, Tier::kDevice}) {
      if (!e.at(t).valid) continue;
      STRATA_CHECK(e.at(t).pins == 0, "ranged I/O while a newer copy is pinned", e.spec.name,
                   tier_text(t));
      STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Op> op, s.start_writeback(e, t, &lock));
      STRATA_CHECK(op != nullptr, "a write-back to an allocated home found no room", e.spec.name);
      s.wait_op(lock, op);
      if (!op->status.is_ok()) {
        e.failed.reset();  // reported here
        return op->status;
      }
      break;
    }
  }
  for (Tier t : {Tier::kHost, Tier::kDevice}) {
    STRATA_CHECK(e.at(t).pins == 0, "ranged I/O while a copy is pinned", e.spec.name, tier_text(t));
    if (e.at(t).allocated) s.drop_copy(e, t);
  }
  s.new_op(OpKind::kSync, e, Tier::kNvme, Tier::kNvme);
  return Status::ok();
}

io::IoHandle TieredStore::Impl::start_range(Handle h, std::uint64_t offset, std::byte* buffer,
                                            std::size_t bytes, bool write) {
  io::Extent x;
  {
    std::lock_guard lock(mu);
    const Entry& e = entry(h);
    STRATA_CHECK(held_for_ranges(e), "ranged I/O on a tensor not opened with open_ranges",
                 e.spec.name);
    x = e.at(Tier::kNvme).extent;
    STRATA_CHECK(offset % io::kIoAlignBytes == 0 && bytes % io::kIoAlignBytes == 0 &&
                     offset + bytes <= x.size_bytes,
                 "a range outside the tensor's home", e.spec.name, offset, bytes, x.size_bytes);
    const std::span<std::byte> region = staging->range_io();
    STRATA_CHECK(buffer >= region.data() && buffer + bytes <= region.data() + region.size(),
                 "ranged I/O outside the store's range staging", e.spec.name, bytes);
    const int nvme = static_cast<int>(Tier::kNvme), host = static_cast<int>(Tier::kHost);
    (write ? stats.bytes_moved[host][nvme] : stats.bytes_moved[nvme][host]) += bytes;
  }
  return write ? swap->write(x, offset, buffer, bytes) : swap->read(x, offset, buffer, bytes);
}

io::IoHandle TieredStore::read_range(Handle h, std::uint64_t offset, void* buffer,
                                     std::size_t bytes) {
  return impl_->start_range(h, offset, static_cast<std::byte*>(buffer), bytes, /*write=*/false);
}

io::IoHandle TieredStore::write_range(Handle h, std::uint64_t offset, const void* buffer,
                                      std::size_t bytes) {
  // The swap space only reads `buffer` on a write.
  return impl_->start_range(h, offset, static_cast<std::byte*>(const_cast<void*>(buffer)), bytes,
                            /*write=*/true);
}

void TieredStore::close_ranges(Handle h, bool wrote, bool ok) {
  Impl& s = *impl_;
  std::lock_guard lock(s.mu);
  Entry& e = s.entry(h);
  STRATA_CHECK(s.held_for_ranges(e), "close_ranges without open_ranges", e.spec.name);
  if (wrote) e.at(Tier::kNvme).valid = ok;
  s.retire(e, e.op, Status::ok());
}

std::span<std::byte> TieredStore::range_staging() const { return impl_->staging->range_io(); }

Status TieredStore::wait(const Completion& c) {
  if (c.state() == nullptr) return Status::ok();
  Impl& s = *impl_;
  const bool was_done = c.done();
  const std::int64_t t0 = now_ns();
  Status st = c.wait();
  if (was_done && st.is_ok()) return st;
  std::lock_guard lock(s.mu);
  if (!was_done) s.add_stall(t0, nullptr);
  if (!st.is_ok()) {
    // The caller saw this error: acquire must not report it a second time.
    for (auto& e : s.entries) {
      if (e->failed && e->failed->completion.get() == c.state()) e->failed.reset();
    }
  }
  return st;
}

void TieredStore::trim_device_cache() {
  std::lock_guard lock(impl_->mu);
  impl_->trim_device_cache(std::numeric_limits<std::uint64_t>::max());
}

void TieredStore::trim_host_cache() {
  std::lock_guard lock(impl_->mu);
  impl_->host_cache->trim(std::numeric_limits<std::uint64_t>::max());
  impl_->sync_host_reserved();
}

void TieredStore::drain() {
  Impl& s = *impl_;
  Impl::Lock lock(s.mu);
  s.cv.wait(lock, [&] { return s.ops_in_flight == 0; });
}

// ---- queries ----

void TieredStore::set_advisor(const EvictionAdvisor* advisor) {
  std::lock_guard lock(impl_->mu);
  impl_->advisor = advisor;
}

Residency TieredStore::residency(Handle h) const {
  const Impl& s = *impl_;
  std::lock_guard lock(s.mu);
  const Entry& e = s.entry(h);
  Residency r;
  for (int i = 0; i < kNumTiers; ++i) {
    const auto& c = e.copy[static_cast<std::size_t>(i)];
    r.valid[static_cast<std::size_t>(i)] = c.valid;
    r.allocated[static_cast<std::size_t>(i)] = c.allocated;
    r.pins[static_cast<std::size_t>(i)] = c.pins;
  }
  r.dirty = e.spec.transient ? e.num_valid() > 0 : !e.at(e.spec.home).valid && e.num_valid() > 0;
  r.in_flight = e.op != nullptr;
  return r;
}

TierUsage TieredStore::usage(Tier tier) const {
  const Impl& s = *impl_;
  std::lock_guard lock(s.mu);
  TierUsage u;
  u.budget_bytes = s.budget(tier);
  u.reserved_bytes = s.reserved_bytes[static_cast<std::size_t>(tier)];
  u.peak_bytes = s.stats.peak_bytes[static_cast<std::size_t>(tier)];
  for (const auto& e : s.entries) {
    if (e->at(tier).pins > 0) u.pinned_bytes += e->spec.size_bytes;
  }
  return u;
}

StoreStats TieredStore::stats() const {
  const Impl& s = *impl_;
  std::lock_guard lock(s.mu);
  StoreStats out = s.stats;
  out.stall_ms = static_cast<double>(s.stall_ns) * 1e-6;
  return out;
}

const TensorSpec& TieredStore::spec(Handle h) const {
  std::lock_guard lock(impl_->mu);
  return impl_->entry(h).spec;  // entries never move or go away
}

std::size_t TieredStore::num_tensors() const {
  std::lock_guard lock(impl_->mu);
  return impl_->entries.size();
}

std::uint64_t TieredStore::staging_bytes() const { return impl_->staging->total_bytes(); }

}  // namespace strata::mem
