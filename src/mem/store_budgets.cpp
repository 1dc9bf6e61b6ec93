// TieredStore's budgets and victim choice: charging each tier, making room by evicting or
// dropping copies (the eviction advisor's choice, else the least recently used), allocating and
// dropping copies, and the waits on the store's condition.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>

#include "src/mem/store_impl.h"
#include "strata/core/aligned.h"
#include "strata/core/clock.h"
#include "strata/core/json.h"
#include "strata/core/logging.h"

namespace strata::mem {

// ---- Impl: budgets and victims ----

Entry& TieredStore::Impl::entry(Handle h) {
  const auto i = handle_index(h);
  STRATA_CHECK(i < entries.size(), "unknown tensor handle", i);
  return *entries[i];
}

const Entry& TieredStore::Impl::entry(Handle h) const {
  const auto i = handle_index(h);
  STRATA_CHECK(i < entries.size(), "unknown tensor handle", i);
  return *entries[i];
}

void TieredStore::Impl::charge(Tier t, std::uint64_t bytes) {
  const auto i = static_cast<std::size_t>(t);
  reserved_bytes[i] += bytes;
  stats.peak_bytes[i] = std::max(stats.peak_bytes[i], reserved_bytes[i]);
  STRATA_CHECK(budget(t) == 0 || reserved_bytes[i] <= budget(t), "tier budget exceeded",
               tier_text(t), reserved_bytes[i], budget(t));
}

void TieredStore::Impl::uncharge(Tier t, std::uint64_t bytes) {
  const auto i = static_cast<std::size_t>(t);
  STRATA_CHECK(reserved_bytes[i] >= bytes, "tier accounting underflow", tier_text(t));
  reserved_bytes[i] -= bytes;
}

void TieredStore::Impl::sync_host_reserved() {
  const std::uint64_t now = staging->total_bytes() + host_cache->held_bytes();
  const std::uint64_t before = reserved(Tier::kHost);
  if (now > before) {
    charge(Tier::kHost, now - before);
  } else {
    uncharge(Tier::kHost, before - now);
  }
}

std::uint64_t TieredStore::Impl::room_needed(Tier t, const Entry& e) const {
  switch (t) {
    case Tier::kDevice: {
      auto it = device_cache.find(device_bytes(e));
      return it != device_cache.end() && !it->second.empty() ? 0 : device_bytes(e);
    }
    case Tier::kHost:
      return host_cache->growth_for(e.io_bytes);
    case Tier::kNvme:
      return e.io_bytes;
  }
  return 0;
}

Result<TieredStore::Impl::Room> TieredStore::Impl::make_room(Tier t, Entry& target, bool prefetch) {
  const std::uint64_t b = budget(t);
  if (b == 0) return Room::kReady;
  for (;;) {
    const std::uint64_t need = room_needed(t, target);
    if (reserved(t) + need <= b) return Room::kReady;
    if (need > b) {
      return out_of_memory("tensor '" + target.spec.name + "' (" +
                           format_bytes(target.spec.size_bytes) + ") is larger than the " +
                           budget_key(t) + " of " + format_bytes(b));
    }
    if (t == Tier::kHost) {
      const std::uint64_t over = reserved(t) + need - b;
      if (host_cache->trim(over, HostBlockCache::class_bytes(target.io_bytes)) > 0) {
        sync_host_reserved();
        continue;
      }
    }
    if (t == Tier::kDevice && trim_device_cache(reserved(t) + need - b, device_bytes(target)) > 0) {
      continue;
    }
    if (prefetch && t == Tier::kDevice) {
      // Dropped copies may land in the device cache: the next turn trims it.
      if (!drop_victims_for_prefetch(t, target, reserved(t) + need - b)) return Room::kRefused;
      continue;
    }
    Entry* v = pick_victim(t, &target, prefetch);
    if (v != nullptr) {
      if (v->num_valid() > 1) {
        drop_copy(*v, t);
        ++stats.evictions;
        continue;
      }
      STRATA_RETURN_IF_ERROR(
          start_writeback(*v, t, nullptr)
              .status()
              .with_context("making room for '" + target.spec.name + "' on the " + tier_text(t)));
      ++stats.evictions;
      return Room::kWait;
    }
    if (prefetch) return Room::kRefused;
    if (ops_in_flight > 0) return Room::kWait;  // landing fetches become evictable
    std::uint64_t pinned = 0;
    for (const auto& e : entries) {
      if (e->at(t).pins > 0) pinned += e->spec.size_bytes;
    }
    return out_of_memory("no room on the " + tier_text(t) + " for '" + target.spec.name + "' (" +
                         format_bytes(target.spec.size_bytes) + "): the " + budget_key(t) + " of " +
                         format_bytes(b) + " holds " + format_bytes(reserved(t)) + ", of which " +
                         format_bytes(pinned) +
                         " is pinned in use and the rest cannot move; raise the budget or hold "
                         "fewer tensors at once");
  }
}

bool TieredStore::Impl::drop_victims_for_prefetch(Tier t, Entry& target, std::uint64_t over) {
  std::vector<Entry*> chosen;
  std::uint64_t freed = 0;
  while (freed < over) {
    Entry* v = pick_victim(t, &target, /*prefetch=*/true, chosen);
    if (v == nullptr) return false;
    chosen.push_back(v);
    freed += t == Tier::kDevice ? device_bytes(*v) : v->spec.size_bytes;
  }
  for (Entry* v : chosen) {
    drop_copy(*v, t);
    ++stats.evictions;
  }
  return true;
}

TieredStore::Impl::Entry* TieredStore::Impl::pick_victim(Tier t, const Entry* target, bool prefetch,
                                                         const std::vector<Entry*>& exclude) {
  // No target (room for memory outside the store): spare only what is used now.
  const std::uint64_t target_next =
      advisor != nullptr && target != nullptr ? advisor->next_use(target->h) : 0;
  Entry* best = nullptr;
  // Larger is a better victim: used later, clean (no write-back), then least recently used.
  std::tuple<std::uint64_t, int, std::uint64_t> best_key{};
  for (auto& ep : entries) {
    Entry& e = *ep;
    if (&e == target || e.op) continue;
    if (std::find(exclude.begin(), exclude.end(), &e) != exclude.end()) continue;
    const auto& c = e.at(t);
    if (!c.allocated || !c.valid || c.pins > 0 || c.external || e.is_home(t)) continue;
    const bool clean = e.num_valid() > 1;
    if (!clean) {
      if (prefetch) continue;  // a prefetch never waits for a write-back
      // A transient tensor's only copy moves when its owner says (evict): writing it back here
      // could itself need room on the next tier, which this path cannot wait for.
      if (e.spec.transient) continue;
    }
    std::uint64_t next = 0;
    if (advisor != nullptr) {
      next = advisor->next_use(e.h);
      // Belady: evicting what is needed before the tensor being fetched only moves the miss.
      if (prefetch && next <= target_next) continue;
    }
    const auto key = std::make_tuple(next, clean ? 1 : 0, ~e.last_use);
    if (best == nullptr || key > best_key) {
      best = &e;
      best_key = key;
    }
  }
  return best;
}

Status TieredStore::Impl::allocate_copy(Entry& e, Tier t) {
  auto& c = e.at(t);
  STRATA_CHECK(!c.allocated, "copy allocated twice", e.spec.name, tier_text(t));
  switch (t) {
    case Tier::kDevice: {
      const std::uint64_t bytes = device_bytes(e);
      auto it = device_cache.find(bytes);
      if (it != device_cache.end() && !it->second.empty()) {  // already counted in reserved
        c.device_buffer = std::move(it->second.back());
        it->second.pop_back();
      } else {
        STRATA_ASSIGN_OR_RETURN(c.device_buffer, device.allocate(bytes, "'" + e.spec.name + "'",
                                                                 /*reclaim_cache=*/false));
        charge(t, bytes);
      }
      c.data = c.device_buffer.data();
      if (direct_io(e)) {  // O_DIRECT wants a page-aligned buffer: the slack allows for it
        c.data = reinterpret_cast<void*>(
            align_up(reinterpret_cast<std::uintptr_t>(c.data), io::kIoAlignBytes));
      }
      break;
    }
    case Tier::kHost: {
      STRATA_ASSIGN_OR_RETURN(c.data, host_cache->take(e.io_bytes));
      sync_host_reserved();
      break;
    }
    case Tier::kNvme: {
      STRATA_CHECK(swap != nullptr, "an NVMe copy without a swap space", e.spec.name);
      STRATA_ASSIGN_OR_RETURN(c.extent, swap->allocate(e.io_bytes, e.spec.name));
      charge(t, e.io_bytes);
      break;
    }
  }
  c.allocated = true;
  c.valid = false;
  return Status::ok();
}

Result<TieredStore::Impl::Room> TieredStore::Impl::allocate_with_room(Entry& e, Tier t,
                                                                      bool prefetch, Lock& lock) {
  for (;;) {
    STRATA_ASSIGN_OR_RETURN(Room room, make_room(t, e, prefetch));
    if (room == Room::kRefused) return room;
    if (room == Room::kWait) {
      if (prefetch) return Room::kRefused;
      wait_change(lock, &e);
      if (e.op || e.at(t).allocated) return Room::kWait;  // changed under us: caller re-checks
      continue;
    }
    Status st = allocate_copy(e, t);
    if (st.is_ok()) return Room::kReady;
    // The device itself is full (activations live there too): our cached buffers go first.
    if (t == Tier::kDevice && trim_device_cache(device_bytes(e)) > 0) continue;
    if (t != Tier::kDevice || prefetch) return prefetch ? Result<Room>(Room::kRefused) : st;
    // Still full: give up one of our copies.
    Entry* v = pick_victim(t, &e, false);
    if (v != nullptr) {
      ++stats.evictions;
      if (v->num_valid() > 1) {
        drop_copy(*v, t);
        continue;
      }
      STRATA_RETURN_IF_ERROR(start_writeback(*v, t, nullptr).status());
    } else if (ops_in_flight == 0) {
      return st;
    }
    wait_change(lock, &e);
    if (e.op || e.at(t).allocated) return Room::kWait;
  }
}

void TieredStore::Impl::drop_copy(Entry& e, Tier t) {
  auto& c = e.at(t);
  STRATA_CHECK(c.pins == 0, "dropping a pinned copy", e.spec.name, tier_text(t));
  STRATA_CHECK(!c.external, "dropping a caller-owned home", e.spec.name);
  switch (t) {
    case Tier::kDevice:
      // On a real accelerator a kernel may still read it: the next copy into reused memory
      // waits for this point of the compute stream.
      if (!device.host_addressable()) {
        last_device_drop = device.record_event(device.stream(device::StreamKind::kCompute));
      }
      if (auto& cached = device_cache[device_bytes(e)];
          static_cast<int>(cached.size()) < options.device_cache_blocks_per_size) {
        cached.push_back(std::move(c.device_buffer));
      } else {
        c.device_buffer.reset();
        uncharge(t, device_bytes(e));
      }
      break;
    case Tier::kHost:
      host_cache->give(c.data, e.io_bytes);
      break;
    case Tier::kNvme:
      swap->free(c.extent);
      c.extent = io::Extent();
      uncharge(t, e.io_bytes);
      break;
  }
  c.data = nullptr;
  c.allocated = false;
  c.valid = false;
}

std::uint64_t TieredStore::Impl::reclaim_device(std::uint64_t bytes) {
  Lock lock(mu);
  std::uint64_t freed = trim_device_cache(bytes);
  // Then clean copies kept on the device (another tier holds their data), used last first; never
  // one in use, moving, or used now.
  while (freed < bytes) {
    Entry* v = pick_victim(Tier::kDevice, nullptr, /*prefetch=*/true);
    if (v == nullptr) break;
    drop_copy(*v, Tier::kDevice);
    ++stats.evictions;
    freed += trim_device_cache(bytes - freed);
  }
  return freed;
}

std::uint64_t TieredStore::Impl::trim_device_cache(std::uint64_t bytes, std::uint64_t keep) {
  std::uint64_t freed = 0;
  for (auto& [size, blocks] : device_cache) {
    if (size == keep) continue;
    while (!blocks.empty() && freed < bytes) {
      blocks.pop_back();  // returns the memory to the device
      uncharge(Tier::kDevice, size);
      freed += size;
    }
    if (freed >= bytes) break;
  }
  return freed;
}

void TieredStore::Impl::add_stall(std::int64_t begin_ns, const Entry* e) {
  const std::int64_t end = now_ns();
  stall_ns += end - begin_ns;
  if (options.timeline != nullptr) {
    options.timeline->add(Lane::kCompute, e != nullptr ? "wait " + e->spec.name : "wait", begin_ns,
                          end);
  }
}

void TieredStore::Impl::wait_change(Lock& lock, const Entry* for_entry) {
  const std::uint64_t gen = generation;
  const std::int64_t t0 = now_ns();
  cv.wait(lock, [&] { return generation != gen; });
  add_stall(t0, for_entry);
}

void TieredStore::Impl::wait_op(Lock& lock, const std::shared_ptr<Op>& op) {
  std::shared_ptr<Op> keep = op;  // `op` may refer to the entry's member, which finish() resets
  const std::int64_t t0 = now_ns();
  cv.wait(lock, [&] { return keep->completion->is_done(); });
  add_stall(t0, &entry(keep->h));
}

void TieredStore::Impl::wait_idle(Lock& lock, Entry& e) {
  while (e.op) wait_op(lock, e.op);
}

}  // namespace strata::mem
