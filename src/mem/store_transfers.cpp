// TieredStore transfers: starting fetches and write-backs, the staged NVMe<->device chunk
// pipeline, completion on the lanes, and the synchronous read/write paths.
#include <algorithm>
#include <cstring>
#include <optional>

#include "src/mem/store_impl.h"
#include "strata/core/aligned.h"
#include "strata/core/clock.h"

namespace strata::mem {

namespace {

// The nearest valid copy to copy from, or nullopt.
std::optional<Tier> source_for(const Entry& e, Tier to) {
  auto valid = [&](Tier t) { return e.at(t).valid; };
  switch (to) {
    case Tier::kDevice:
      if (valid(Tier::kHost)) return Tier::kHost;
      if (valid(Tier::kNvme)) return Tier::kNvme;
      break;
    case Tier::kHost:
      if (valid(Tier::kDevice)) return Tier::kDevice;
      if (valid(Tier::kNvme)) return Tier::kNvme;
      break;
    case Tier::kNvme:
      if (valid(Tier::kHost)) return Tier::kHost;
      if (valid(Tier::kDevice)) return Tier::kDevice;
      break;
  }
  return std::nullopt;
}

bool staged(Tier from, Tier to) {
  return (from == Tier::kNvme && to == Tier::kDevice) ||
         (from == Tier::kDevice && to == Tier::kNvme);
}

}  // namespace

std::shared_ptr<Op> TieredStore::Impl::new_op(OpKind kind, Entry& e, Tier from, Tier to) {
  auto op = std::make_shared<Op>();
  op->kind = kind;
  op->h = e.h;
  op->from = from;
  op->to = to;
  op->begin_ns = now_ns();
  e.op = op;
  ++ops_in_flight;
  return op;
}

Result<std::shared_ptr<Op>> TieredStore::Impl::start_fetch(Entry& e, Tier to, bool prefetch,
                                                           Lock& lock) {
  STRATA_CHECK(!e.spec.scratch, "scratch is emplaced, never fetched", e.spec.name);
  if (!source_for(e, to)) {
    return failed_precondition("'" + e.spec.name + "' has no data to fetch to the " +
                               tier_text(to) + " (never written, or discarded)");
  }
  bool fresh = false;
  if (!e.at(to).allocated) {
    STRATA_ASSIGN_OR_RETURN(Room room, allocate_with_room(e, to, prefetch, lock));
    if (room != Room::kReady) return std::shared_ptr<Op>();
    fresh = true;
  }
  const Tier from = *source_for(e, to);
  auto op = new_op(OpKind::kFetch, e, from, to);
  op->fresh_dest = fresh;
  op->prefetch = prefetch;
  ++stats.fetches;
  issue(op);
  return op;
}

Result<std::shared_ptr<Op>> TieredStore::Impl::start_writeback(Entry& e, Tier from, Lock* lock,
                                                               std::optional<Tier> down_to) {
  STRATA_CHECK(!e.op && e.at(from).valid, "write-back of a busy or stale copy", e.spec.name);
  Tier to = e.spec.home;
  if (e.spec.transient) {
    if (from == Tier::kNvme) {
      return invalid_argument("'" + e.spec.name + "' is on nvme, the lowest tier; discard it");
    }
    to = down_to.value_or(static_cast<Tier>(static_cast<int>(from) + 1));  // evict checked it
  }
  if (to == Tier::kNvme && swap == nullptr) {
    return failed_precondition("'" + e.spec.name +
                               "' would be written back to nvme, but there is no swap space");
  }
  bool fresh = false;
  if (!e.at(to).allocated) {
    STRATA_CHECK(lock != nullptr, "a write-back that needs room, started where it cannot wait",
                 e.spec.name);
    STRATA_ASSIGN_OR_RETURN(Room room, allocate_with_room(e, to, false, *lock));
    if (room != Room::kReady) return std::shared_ptr<Op>();
    fresh = true;
  }
  auto op = new_op(OpKind::kWriteback, e, from, to);
  op->drop_source = true;
  op->fresh_dest = fresh;
  issue(op);
  return op;
}

void TieredStore::Impl::record(Lane lane, const Entry& e, const char* verb, std::int64_t begin_ns,
                               std::uint64_t bytes) {
  if (options.timeline == nullptr) return;
  options.timeline->add(lane, std::string(verb) + " " + e.spec.name, begin_ns, now_ns(), bytes);
}

void TieredStore::Impl::issue(const std::shared_ptr<Op>& op) {
  Entry& e = entry(op->h);
  auto& src = e.at(op->from);
  auto& dst = e.at(op->to);
  const std::size_t size = e.spec.size_bytes;
  const char* verb = op->kind == OpKind::kWriteback ? "write back" : "fetch";
  auto& compute = device.stream(device::StreamKind::kCompute);
  auto& h2d = device.stream(device::StreamKind::kHostToDevice);
  auto& d2h = device.stream(device::StreamKind::kDeviceToHost);
  if (staged(op->from, op->to) && !direct_io(e)) {
    op->chunks_total =
        static_cast<int>((e.io_bytes + staging->buffer_bytes() - 1) / staging->buffer_bytes());
    // Every chunk follows these points on its copy stream.
    if (op->from == Tier::kDevice) device.wait_event(d2h, device.record_event(compute));
    if (op->to == Tier::kDevice) device.wait_event(h2d, last_device_drop);
    staging_waiters.push_back(op);
    pump_staging();
    return;
  }
  const auto whole = [this, op] { complete_chunks(op, 1); };
  const auto whole_io = [this, op](Status s) {
    if (!s.is_ok()) fail(*op, s);
    complete_chunks(op, 1);
  };
  if (op->from == Tier::kHost && op->to == Tier::kDevice) {
    device.wait_event(h2d, last_device_drop);
    // A device home may still be read by compute (the optimizer rewrites working copies).
    if (e.is_home(Tier::kDevice)) device.wait_event(h2d, device.record_event(compute));
    device_copy(op, /*to_device=*/true, dst.data, src.data, size, verb, whole);
  } else if (op->from == Tier::kDevice && op->to == Tier::kHost) {
    device.wait_event(d2h, device.record_event(compute));
    device_copy(op, /*to_device=*/false, dst.data, src.data, size, verb, whole);
  } else if (op->from == Tier::kNvme && (op->to == Tier::kHost || op->to == Tier::kDevice)) {
    nvme_io(op, /*read=*/true, src.extent, 0, dst.data, e.io_bytes, verb, whole_io);
  } else if ((op->from == Tier::kHost || op->from == Tier::kDevice) && op->to == Tier::kNvme) {
    // From the device: direct_io (host memory; its compute stream is inline, so done).
    nvme_io(op, /*read=*/false, dst.extent, 0, src.data, e.io_bytes, verb, whole_io);
  } else {
    STRATA_CHECK(false, "no route between tiers", tier_text(op->from), tier_text(op->to));
  }
}

void TieredStore::Impl::device_copy(const std::shared_ptr<Op>& op, bool to_device, void* dst,
                                    const void* src, std::size_t bytes, const char* verb,
                                    std::function<void()> then) {
  const std::int64_t t0 = now_ns();
  auto& stream = device.stream(to_device ? device::StreamKind::kHostToDevice
                                         : device::StreamKind::kDeviceToHost);
  if (to_device) {
    device.copy_to_device(dst, src, bytes, stream);
  } else {
    device.copy_to_host(dst, src, bytes, stream);
  }
  device::Event ev = device.record_event(stream);
  (to_device ? h2d_lane : d2h_lane)->push([this, op, ev, t0, verb, bytes, to_device, then] {
    ev.synchronize();
    Lock lock(mu);
    record(to_device ? Lane::kHostToDevice : Lane::kDeviceToHost, entry(op->h), verb, t0, bytes);
    then();
  });
}

void TieredStore::Impl::nvme_io(const std::shared_ptr<Op>& op, bool read, const io::Extent& extent,
                                std::uint64_t offset, void* buf, std::size_t bytes,
                                const char* verb, std::function<void(Status)> then) {
  const std::int64_t t0 = now_ns();
  io::IoHandle io =
      read ? swap->read(extent, offset, buf, bytes) : swap->write(extent, offset, buf, bytes);
  (read ? read_lane : write_lane)->push([this, op, io, t0, verb, bytes, read, then]() mutable {
    Status s = io.wait();
    Lock lock(mu);
    record(read ? Lane::kNvmeRead : Lane::kNvmeWrite, entry(op->h), verb, t0, bytes);
    then(std::move(s));
  });
}

// Hands free staging buffers to waiting chunked ops, oldest op first (the demand fetch issued
// before its prefetches gets its chunks first).
void TieredStore::Impl::pump_staging() {
  while (!staging_waiters.empty()) {
    std::shared_ptr<Op> op = staging_waiters.front();
    if (op->chunks_issued == op->chunks_total) {
      staging_waiters.pop_front();
      continue;
    }
    if (!op->status.is_ok()) {  // a chunk failed: the rest are not worth moving
      const int skipped = op->chunks_total - op->chunks_issued;
      op->chunks_issued = op->chunks_total;
      staging_waiters.pop_front();
      complete_chunks(op, skipped);
      continue;
    }
    const int buf = staging->take();
    if (buf < 0) return;
    issue_chunk(op, op->chunks_issued++, buf);
  }
}

void TieredStore::Impl::issue_chunk(const std::shared_ptr<Op>& op, int chunk, int buf) {
  Entry& e = entry(op->h);
  const std::uint64_t off = static_cast<std::uint64_t>(chunk) * staging->buffer_bytes();
  const std::size_t io_len =
      static_cast<std::size_t>(std::min<std::uint64_t>(staging->buffer_bytes(), e.io_bytes - off));
  const std::size_t copy_len = static_cast<std::size_t>(
      std::min<std::uint64_t>(staging->buffer_bytes(), e.spec.size_bytes - off));
  if (op->from == Tier::kNvme) {
    nvme_io(op, /*read=*/true, e.at(Tier::kNvme).extent, off, staging->data(buf), io_len, "fetch",
            [this, op, chunk, buf](Status s) { chunk_landed(op, chunk, buf, std::move(s)); });
  } else {
    device_copy(op, /*to_device=*/false, staging->data(buf),
                static_cast<std::byte*>(e.at(Tier::kDevice).data) + off, copy_len, "write back",
                [this, op, chunk, buf] { chunk_staged(op, chunk, buf); });
  }
}

// NVMe -> staging done: copy the chunk to the device.
void TieredStore::Impl::chunk_landed(const std::shared_ptr<Op>& op, int chunk, int buf, Status s) {
  if (!s.is_ok()) fail(*op, s);
  if (!op->status.is_ok()) return chunk_done(op, buf);
  Entry& e = entry(op->h);
  const std::uint64_t off = static_cast<std::uint64_t>(chunk) * staging->buffer_bytes();
  const std::size_t copy_len = static_cast<std::size_t>(
      std::min<std::uint64_t>(staging->buffer_bytes(), e.spec.size_bytes - off));
  device_copy(op, /*to_device=*/true, static_cast<std::byte*>(e.at(Tier::kDevice).data) + off,
              staging->data(buf), copy_len, "fetch", [this, op, buf] { chunk_done(op, buf); });
}

// Device -> staging done: write the chunk to NVMe.
void TieredStore::Impl::chunk_staged(const std::shared_ptr<Op>& op, int chunk, int buf) {
  if (!op->status.is_ok()) return chunk_done(op, buf);
  Entry& e = entry(op->h);
  const std::uint64_t off = static_cast<std::uint64_t>(chunk) * staging->buffer_bytes();
  const std::size_t io_len =
      static_cast<std::size_t>(std::min<std::uint64_t>(staging->buffer_bytes(), e.io_bytes - off));
  nvme_io(op, /*read=*/false, e.at(Tier::kNvme).extent, off, staging->data(buf), io_len,
          "write back", [this, op, buf](Status s) {
            if (!s.is_ok()) fail(*op, s);
            chunk_done(op, buf);
          });
}

// A chunk's last leg ended (or was skipped after a failure): its staging buffer goes back to the
// pool and to the next waiting op.
void TieredStore::Impl::chunk_done(const std::shared_ptr<Op>& op, int buf) {
  staging->give(buf);
  cv.notify_all();
  complete_chunks(op, 1);
  pump_staging();
}

void TieredStore::Impl::complete_chunks(const std::shared_ptr<Op>& op, int n) {
  op->chunks_done += n;
  STRATA_CHECK(op->chunks_done <= op->chunks_total, "more chunks done than exist", op->chunks_done,
               op->chunks_total);
  if (op->chunks_done == op->chunks_total) finish(op);
}

void TieredStore::Impl::fail(Op& op, const Status& s) {
  if (!op.status.is_ok()) return;
  const Entry& e = entry(op.h);
  const char* verb = op.kind == OpKind::kWriteback ? "writing back" : "fetching";
  op.status = s.with_context(std::string(verb) + " '" + e.spec.name + "' from the " +
                             tier_text(op.from) + " to the " + tier_text(op.to));
}

void TieredStore::Impl::finish(const std::shared_ptr<Op>& op) {
  Entry& e = entry(op->h);
  if (op->status.is_ok() && (op->from == Tier::kDevice || op->to == Tier::kDevice)) {
    if (Status d = device.last_error(); !d.is_ok()) fail(*op, d);
  }
  if (op->status.is_ok()) {
    e.at(op->to).valid = true;
    stats.bytes_moved[static_cast<int>(op->from)][static_cast<int>(op->to)] += e.spec.size_bytes;
    if (op->kind == OpKind::kWriteback) ++stats.writebacks;
    if (op->drop_source) drop_copy(e, op->from);
  } else {
    ++stats.failures;
    e.failed = op;
    if (op->fresh_dest) drop_copy(e, op->to);
  }
  retire(e, op, op->status);
}

void TieredStore::Impl::retire(Entry& e, const std::shared_ptr<Op>& op, const Status& st) {
  std::shared_ptr<Op> keep = op;  // `op` may be the entry's member, reset here
  if (e.op == keep) e.op.reset();
  --ops_in_flight;
  ++generation;
  keep->completion->finish(st);
  cv.notify_all();
}

// ---- synchronous paths ----

int TieredStore::Impl::take_staging_blocking(Lock& lock) {
  int buf = -1;
  cv.wait(lock, [&] { return (buf = staging->take()) >= 0; });
  return buf;
}

// A whole-tensor copy between the device and the caller's memory, which need not be pinned: it
// passes through one staging buffer (pinned) a chunk at a time.
Status TieredStore::Impl::staged_device_copy(Entry& e, void* device_data, const void* from_host,
                                             void* to_host, Lock& lock) {
  const bool to_device = from_host != nullptr;
  const int buf = take_staging_blocking(lock);
  lock.unlock();
  const std::size_t chunk = staging->buffer_bytes();
  const std::size_t size = e.spec.size_bytes;
  std::byte* stage = staging->data(buf);
  auto& stream = device.stream(to_device ? device::StreamKind::kHostToDevice
                                         : device::StreamKind::kDeviceToHost);
  for (std::size_t off = 0; off < size; off += chunk) {
    const std::size_t n = std::min(chunk, size - off);
    auto* dev = static_cast<std::byte*>(device_data) + off;
    if (to_device) {
      std::memcpy(stage, static_cast<const std::byte*>(from_host) + off, n);
      device.copy_to_device(dev, stage, n, stream);
      device.record_event(stream).synchronize();
    } else {
      device.copy_to_host(stage, dev, n, stream);
      device.record_event(stream).synchronize();
      std::memcpy(static_cast<std::byte*>(to_host) + off, stage, n);
    }
  }
  Status st = device.last_error();
  lock.lock();
  staging->give(buf);
  pump_staging();
  return st;
}

// Whole-tensor NVMe I/O through staging buffers: every buffer the pool can spare (at least one)
// has a chunk in flight, so the drive sees several requests at once. `data` is the caller's
// memory (size_bytes); a null source for a write means zeros, written from one zeroed buffer.
Status TieredStore::Impl::staged_nvme_io(Entry& e, const io::Extent& x, void* data, bool write,
                                         Lock& lock) {
  const bool zeros = write && data == nullptr;
  std::vector<int> bufs = {take_staging_blocking(lock)};
  for (int b; !zeros && (b = staging->take()) >= 0;) bufs.push_back(b);
  lock.unlock();
  const std::size_t chunk = staging->buffer_bytes();
  const std::size_t size = e.spec.size_bytes;
  // Zeros: one buffer read by up to kZeroWritesInFlight writes at once.
  constexpr std::size_t kZeroWritesInFlight = 8;
  const std::size_t slots = zeros ? kZeroWritesInFlight : bufs.size();
  if (zeros) std::memset(staging->data(bufs[0]), 0, chunk);
  struct InFlight {
    io::IoHandle io;
    std::uint64_t off = 0;
  };
  std::vector<InFlight> ring(slots);
  Status st;
  // Finishes slot i's transfer (a read is copied out).
  auto settle = [&](std::size_t i) {
    InFlight& f = ring[i];
    if (!f.io.valid()) return;
    Status s = f.io.wait();
    f.io = io::IoHandle();
    if (st.is_ok()) st = s;
    if (st.is_ok() && !write) {
      const std::size_t n = std::min<std::uint64_t>(chunk, size - f.off);
      std::memcpy(static_cast<std::byte*>(data) + f.off, staging->data(bufs[i]), n);
    }
  };
  std::size_t k = 0;
  for (std::uint64_t off = 0; off < e.io_bytes && st.is_ok(); off += chunk, ++k) {
    const std::size_t i = k % slots;
    settle(i);
    if (!st.is_ok()) break;
    std::byte* buf = staging->data(bufs[zeros ? 0 : i]);
    const std::size_t io_len = std::min<std::uint64_t>(chunk, e.io_bytes - off);
    if (write && !zeros) {
      const std::size_t n = std::min<std::uint64_t>(chunk, size - off);
      std::memcpy(buf, static_cast<const std::byte*>(data) + off, n);
      std::memset(buf + n, 0, io_len - n);
    }
    ring[i].off = off;
    ring[i].io = write ? swap->write(x, off, buf, io_len) : swap->read(x, off, buf, io_len);
  }
  for (std::size_t i = 0; i < slots; ++i) settle(i);
  lock.lock();
  for (int b : bufs) staging->give(b);
  pump_staging();
  return st;
}

Status TieredStore::Impl::sync_write(Entry& e, const void* src, std::size_t capacity, Lock& lock) {
  for (int i = 0; i < kNumTiers; ++i) {
    const auto t = static_cast<Tier>(i);
    auto& c = e.at(t);
    STRATA_CHECK(c.pins == 0, "write of a tensor whose copy is pinned", e.spec.name, tier_text(t));
    if (!e.is_home(t) && c.allocated) drop_copy(e, t);
  }
  const Tier home = e.spec.home;
  auto& h = e.at(home);
  h.valid = false;
  auto op = new_op(OpKind::kSync, e, Tier::kHost, home);
  const std::size_t size = e.spec.size_bytes;
  const std::int64_t t0 = now_ns();
  Status st;
  Lane lane = Lane::kCompute;
  if (home == Tier::kDevice) {
    lane = Lane::kHostToDevice;
    auto& h2d = device.stream(device::StreamKind::kHostToDevice);
    device.wait_event(h2d, last_device_drop);
    if (src != nullptr) {
      st = staged_device_copy(e, h.data, src, nullptr, lock);
    } else {
      lock.unlock();
      device.fill_zero(h.data, size, h2d);
      device.record_event(h2d).synchronize();
      st = device.last_error();
      lock.lock();
    }
  } else if (home == Tier::kHost) {
    lock.unlock();
    if (src == nullptr) {
      std::memset(h.data, 0, size);
    } else if (src != h.data) {
      std::memcpy(h.data, src, size);
    }
    lock.lock();
  } else {
    lane = Lane::kNvmeWrite;
    const bool direct = src != nullptr &&
                        reinterpret_cast<std::uintptr_t>(src) % io::kIoAlignBytes == 0 &&
                        capacity >= e.io_bytes;
    if (direct) {
      lock.unlock();
      st = swap->write(h.extent, 0, src, e.io_bytes).wait();
      lock.lock();
    } else {
      st = staged_nvme_io(e, h.extent, const_cast<void*>(src), /*write=*/true, lock);
    }
  }
  if (st.is_ok()) {
    h.valid = true;
    if (home != Tier::kHost) stats.bytes_moved[1][static_cast<int>(home)] += size;
  }
  if (lane != Lane::kCompute) record(lane, e, "write", t0, size);
  retire(e, op, st);
  return st.is_ok()
             ? st
             : st.with_context("writing '" + e.spec.name + "' to its " + tier_text(home) + " home");
}

Status TieredStore::Impl::sync_read(Entry& e, void* dst, Lock& lock) {
  std::optional<Tier> from;
  for (Tier t : {Tier::kHost, Tier::kDevice, Tier::kNvme}) {
    if (e.at(t).valid) {
      from = t;
      break;
    }
  }
  if (!from) return failed_precondition("'" + e.spec.name + "' has no data to read");
  auto op = new_op(OpKind::kSync, e, *from, Tier::kHost);
  const auto& c = e.at(*from);
  const std::size_t size = e.spec.size_bytes;
  Status st;
  if (*from == Tier::kHost) {
    lock.unlock();
    std::memcpy(dst, c.data, size);
    lock.lock();
  } else if (*from == Tier::kDevice) {
    auto& d2h = device.stream(device::StreamKind::kDeviceToHost);
    device.wait_event(d2h, device.record_event(device.stream(device::StreamKind::kCompute)));
    st = staged_device_copy(e, c.data, nullptr, dst, lock);
  } else {
    st = staged_nvme_io(e, c.extent, dst, /*write=*/false, lock);
  }
  retire(e, op, st);
  return st.is_ok() ? st : st.with_context("reading '" + e.spec.name + "'");
}

}  // namespace strata::mem
