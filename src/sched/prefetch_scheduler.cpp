// PrefetchScheduler: record, replay, fetch ahead under byte bounds, keep for reuse, detect change.
#include "strata/sched/prefetch_scheduler.h"

#include <algorithm>

#include "strata/core/logging.h"

namespace strata::sched {

PrefetchScheduler::PrefetchScheduler(mem::TieredStore& store, PrefetchOptions options)
    : store_(store), options_(std::move(options)) {
  for (std::size_t set = 0; set < options_.routed_sets.size(); ++set) {
    STRATA_CHECK(!options_.routed_sets[set].empty(), "an empty routed set", set);
    for (mem::Handle h : options_.routed_sets[set]) {
      set_of_[mem::handle_index(h)] = static_cast<int>(set);
    }
  }
  store_.set_advisor(this);
}

PrefetchScheduler::~PrefetchScheduler() {
  // Fetches still arriving keep their tensors busy; an error stays with the tensor.
  for (const InFlight& f : inflight_) f.done.wait().ignore();
  store_.set_advisor(nullptr);
}

SchedulerMode PrefetchScheduler::mode() const {
  std::lock_guard lock(mu_);
  return replaying_ ? SchedulerMode::kReplaying : SchedulerMode::kRecording;
}

std::size_t PrefetchScheduler::position() const {
  std::lock_guard lock(mu_);
  return pos_;
}

std::uint64_t PrefetchScheduler::next_use(mem::Handle h) const {
  const bool stable = is_stable(h);
  h = entry_of(h);
  std::lock_guard lock(mu_);
  if (h == acquiring_) return 0;  // used now: the fetches it starts must not evict it
  if (!replaying_) return mem::kNeverUsed;
  const std::size_t q = trace_.next_use(h, pos_);
  if (q != AccessTrace::kNone) return static_cast<std::uint64_t>(q - pos_);
  // Not again this pass: a stable copy stays for the next, which follows the trace from its
  // start; every other copy kept is dropped at the pass's end.
  const std::size_t first = stable ? trace_.next_use(h, 0) : AccessTrace::kNone;
  return first == AccessTrace::kNone ? mem::kNeverUsed
                                     : static_cast<std::uint64_t>(trace_.size() - pos_ + first);
}

bool PrefetchScheduler::resident_or_arriving(mem::Handle h) const {
  const mem::Residency r = store_.residency(h);
  return r.valid[static_cast<std::size_t>(options_.tier)] || r.in_flight;
}

std::uint64_t PrefetchScheduler::live_bytes() const {
  std::uint64_t live = 0;
  for (mem::Handle h : known_order_) {
    const mem::Residency r = store_.residency(h);
    const auto t = static_cast<std::size_t>(options_.tier);
    if (!r.allocated[t] || (r.pins[t] == 0 && kept_stable_.count(mem::handle_index(h)) != 0)) {
      continue;
    }
    live += store_.spec(h).size_bytes;
  }
  return live;
}

std::uint64_t PrefetchScheduler::inflight_bytes(std::size_t* count) {
  std::erase_if(inflight_, [](const InFlight& f) { return f.done.done(); });
  std::uint64_t bytes = 0;
  for (const InFlight& f : inflight_) bytes += f.bytes;
  *count = inflight_.size();
  return bytes;
}

bool PrefetchScheduler::start_prefetch(mem::Handle h, bool from_trace) {
  if (options_.may_prefetch && !options_.may_prefetch(h)) return false;
  std::optional<mem::Completion> c = store_.try_prefetch(h, options_.tier);
  if (!c) return false;
  inflight_.push_back({h, store_.spec(h).size_bytes, *c});
  ++(from_trace ? stats_.trace_prefetches : stats_.hint_prefetches);
  if (options_.on_issue) {
    std::size_t point = 0;
    {
      std::lock_guard lock(mu_);
      point = events_;
    }
    options_.on_issue(h, point, from_trace);
  }
  return true;
}

bool PrefetchScheduler::prefetch_set(int set, std::size_t* count, std::uint64_t* inflight,
                                     std::uint64_t* live) {
  std::vector<mem::Handle> missing;
  std::uint64_t bytes = 0;
  for (mem::Handle m : options_.routed_sets[static_cast<std::size_t>(set)]) {
    if (resident_or_arriving(m)) continue;
    missing.push_back(m);
    bytes += store_.spec(m).size_bytes;
  }
  if (missing.empty()) return true;
  // No first-fetch exception here (as issue_ahead makes for one tensor): the chosen members come
  // by the router's hints, so a set larger than the bound waits for them.
  if (*inflight + bytes > options_.prefetch_bytes) return false;
  if (options_.max_live_bytes != 0 && *live + bytes > options_.max_live_bytes) return false;
  for (mem::Handle m : missing) {
    if (!start_prefetch(m, /*from_trace=*/true)) return false;
    const std::uint64_t b = store_.spec(m).size_bytes;
    *inflight += b;
    *live += b;
    ++*count;
  }
  return true;
}

// Starts the fetches of the tensors the trace uses next, in order, until a bound says stop.
void PrefetchScheduler::issue_ahead() {
  if (options_.prefetch_bytes == 0) return;
  std::size_t from = 0;
  {
    std::lock_guard lock(mu_);
    if (!replaying_) return;
    from = pos_;
  }
  std::size_t count = 0;
  std::uint64_t inflight = inflight_bytes(&count);
  std::uint64_t live = live_bytes();
  std::unordered_set<std::uint32_t> seen;
  for (std::size_t q = from; q < trace_.size(); ++q) {
    const mem::Handle h = trace_.at(q);
    if (!seen.insert(mem::handle_index(h)).second) continue;
    if (const int set = set_of(h); set >= 0) {
      // A routed set whole, or nothing more: its chosen members come by the model's hints.
      if (!prefetch_set(set, &count, &inflight, &live)) break;
      continue;
    }
    if (resident_or_arriving(h)) continue;
    const std::uint64_t bytes = store_.spec(h).size_bytes;
    if (count > 0 && inflight + bytes > options_.prefetch_bytes) break;
    if (options_.max_live_bytes != 0 && live + bytes > options_.max_live_bytes) break;
    if (!start_prefetch(h, /*from_trace=*/true)) break;
    inflight += bytes;
    live += bytes;
    ++count;
  }
}

Result<void*> PrefetchScheduler::acquire(mem::Handle h) {
  const std::uint64_t bytes = store_.spec(h).size_bytes;
  if (known_.insert(mem::handle_index(h)).second) known_order_.push_back(h);
  // A routed set's acquires after its first in a row are one trace entry with it.
  const int set = set_of(h);
  const mem::Handle entry = entry_of(h);
  const bool same_run = set >= 0 && set == in_set_;
  in_set_ = set;
  {
    std::lock_guard lock(mu_);
    if (!same_run) {
      if (replaying_ && (pos_ >= trace_.size() || trace_.at(pos_) != entry)) {
        replaying_ = false;  // left the trace: on demand for the rest of the pass, re-record it
        ++stats_.order_changes;
        log_debug("prefetch: access order changed at position " + std::to_string(pos_) +
                  "; fetching on demand and recording the new order");
      }
      ++pos_;
    }
    ++events_;
    acquiring_ = entry;
  }
  // A set's entry carries the bytes of every member its run acquired (the reuse distance).
  if (same_run) {
    recording_.add_to_last(bytes);
  } else {
    recording_.push(entry, bytes);
  }
  kept_stable_.erase(mem::handle_index(h));  // in use again
  Result<void*> p = fetch_and_pin(h);
  {
    std::lock_guard lock(mu_);
    acquiring_ = mem::Handle::kInvalid;
  }
  return p;
}

Result<void*> PrefetchScheduler::fetch_and_pin(mem::Handle h) {
  if (!resident_or_arriving(h)) {
    ++stats_.demand_fetches;
    // Its own fetch first, so it is ahead of the prefetches in every queue.
    STRATA_ASSIGN_OR_RETURN(mem::Completion c, store_.fetch(h, options_.tier));
    (void)c;
  }
  issue_ahead();
  return store_.acquire(h, options_.tier);
}

void PrefetchScheduler::release(mem::Handle h) {
  store_.unpin(h, options_.tier);
  bool keep = false;
  {
    std::lock_guard lock(mu_);
    ++events_;
    if (replaying_) {
      const std::size_t q = trace_.next_use(entry_of(h), pos_);
      keep =
          q != AccessTrace::kNone && trace_.bytes_between(pos_, q) <= options_.max_reuse_distance;
    }
  }
  // A stable copy stays while the store has room (it evicts by next use), a cache no bound counts.
  if (is_stable(h)) {
    keep = true;
    kept_stable_.insert(mem::handle_index(h));
  } else if (keep && options_.max_live_bytes != 0 && live_bytes() > options_.max_live_bytes) {
    keep = false;
  }
  const mem::Residency r = store_.residency(h);
  const auto t = static_cast<std::size_t>(options_.tier);
  if (keep) {
    ++stats_.kept;
  } else if (r.pins[t] == 0 && r.allocated[t]) {
    // Fails only for a copy that is its own home or the only valid one: then it stays.
    Status s = store_.release(h, options_.tier);
    if (s.is_ok()) ++stats_.dropped;
  }
  issue_ahead();
}

void PrefetchScheduler::hint(mem::Handle h) {
  if (!options_.follow_hints || options_.prefetch_bytes == 0) return;
  if (known_.insert(mem::handle_index(h)).second) known_order_.push_back(h);
  // A routed tensor's hint is the router's choice, which no trace knows: followed always.
  const bool routed = set_of(h) >= 0;
  if ((mode() == SchedulerMode::kReplaying && !routed) || resident_or_arriving(h)) return;
  std::size_t count = 0;
  const std::uint64_t inflight = inflight_bytes(&count);
  const std::uint64_t bytes = store_.spec(h).size_bytes;
  if (count > 0 && inflight + bytes > options_.prefetch_bytes) return;
  if (options_.max_live_bytes != 0 && live_bytes() + bytes > options_.max_live_bytes) return;
  start_prefetch(h, /*from_trace=*/false);
}

void PrefetchScheduler::end_pass() {
  // Settle what is still arriving; an error stays with the tensor for its next acquire.
  for (const InFlight& f : inflight_) f.done.wait().ignore();
  inflight_.clear();
  {
    std::lock_guard lock(mu_);
    const bool matched = replaying_ && pos_ == trace_.size();
    if (pos_ > 0 && !matched) {
      if (replaying_) ++stats_.order_changes;  // the pass ended early
      if (!has_trace_ || !trace_.same_order(recording_)) ++stats_.recorded_passes;
      trace_ = recording_;
      has_trace_ = true;
    }
    if (pos_ > 0) ++stats_.passes;
    pos_ = 0;
    events_ = 0;
    replaying_ = has_trace_;
  }
  in_set_ = -1;
  recording_.clear();
  const auto t = static_cast<std::size_t>(options_.tier);
  for (mem::Handle h : known_order_) {
    if (is_stable(h)) continue;
    const mem::Residency r = store_.residency(h);
    if (r.allocated[t] && r.pins[t] == 0 && r.num_valid() > 1) {
      store_.release(h, options_.tier).ignore();
    }
  }
  if (options_.prefetch_across_passes) issue_ahead();  // from position 0 of the next pass
}

}  // namespace strata::sched
