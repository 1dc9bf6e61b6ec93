// PrefetchScheduler: the trace-driven parameter coordinator (DeepSpeed stage 3's, in spirit).
//
// During the first pass (a micro-batch's forward and backward) it records the order in which
// tensors are acquired and fetches on demand (plus the model's one-ahead hints). From then on it
// replays the trace: every acquire starts the fetches of the tensors that come next, in order,
// as far as three bounds allow:
//   prefetch_bytes      bytes of its fetches in flight (one fetch is always allowed),
//   max_live_bytes      bytes of its tensors resident or arriving on the device,
//   max_reuse_distance  a released tensor stays resident when it is used again within this many
//                       bytes of other accesses (the last layers between forward and backward).
// An acquire that does not match the trace is an order change: the rest of the pass runs on
// demand and the pass is recorded as the new trace. The scheduler is also the store's eviction
// advisor: the trace gives every tensor's next use (Belady's rule). Copies of tensors nothing
// rewrites (PrefetchOptions::stable: a frozen base) stay between passes while the device has
// room, so a base that fits beside the rest is fetched once, and one that does not, only its
// excess each pass.
//
// Routed sets (a mixture-of-experts layer's experts): the tensors of a set are used in no fixed
// order and not all of them each pass (those a router chose). The trace holds one entry for each
// run of a set's acquires, so a pass that chooses other experts still follows it. Replaying, the
// trace fetches a set whole ahead where its bounds allow the whole set, and stops there
// otherwise; the model's hints (the experts chosen, known once the router has run) are followed
// for a set's tensors even while replaying.
//
// One caller thread drives acquire/release/hint/end_pass; next_use may be called by the store
// from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "strata/mem/tiered_store.h"
#include "strata/sched/access_trace.h"

namespace strata::sched {

struct PrefetchOptions {
  std::uint64_t prefetch_bytes = std::uint64_t{256} << 20;  // 0 = no prefetch, demand only
  std::uint64_t max_live_bytes = std::uint64_t{1} << 30;    // 0 = bounded by the store only
  std::uint64_t max_reuse_distance = std::uint64_t{1} << 30;
  Tier tier = Tier::kDevice;
  bool follow_hints = true;  // while recording, honour the model's one-ahead hints
  // At the end of a pass, start fetching the next pass's first tensors. Only where the data does
  // not change between passes (accumulation micro-batches, evaluation, benchmarks): a write in
  // between makes the store drop those copies again, which is correct but wasted work.
  bool prefetch_across_passes = false;
  // Tensors whose data nothing rewrites between passes (a frozen base, as LoRA's, or every
  // tensor in generation). A released copy of one stays on the device whatever the reuse
  // distance, and past the pass's end, while the store has room: the store evicts such copies by
  // their next use, counted on into the next pass (Belady's rule over the passes). Kept and
  // unpinned, they are a cache and count toward no bound. Every other copy kept is dropped at the
  // end of a pass (an optimizer step may rewrite it). null: none.
  std::function<bool(mem::Handle)> stable;
  // Called for every fetch the scheduler starts: the tensor, the sequence point (acquires and
  // releases so far in this pass: acquiring the k-th tensor is point 2k-1, releasing it 2k when
  // uses do not nest), and whether the trace (not a hint) asked for it. Tests and tracing only.
  std::function<void(mem::Handle, std::size_t sequence_point, bool from_trace)> on_issue;
  // Whether `h` may be fetched ahead now (null: always). False holds back it and, in trace
  // order, what follows it: an optimizer step still writing the new working copies.
  std::function<bool(mem::Handle)> may_prefetch;
  // Each routed set's tensors (a tensor in one set at most).
  std::vector<std::vector<mem::Handle>> routed_sets;
};

enum class SchedulerMode : std::uint8_t { kRecording, kReplaying };

struct SchedulerStats {
  std::uint64_t passes = 0;
  std::uint64_t recorded_passes = 0;  // passes whose order became the trace
  std::uint64_t order_changes = 0;    // replayed passes that left the trace
  std::uint64_t trace_prefetches = 0;
  std::uint64_t hint_prefetches = 0;
  std::uint64_t demand_fetches = 0;  // acquires of a tensor neither resident nor arriving
  std::uint64_t kept = 0;            // releases that kept the copy (a reuse soon, or stable)
  std::uint64_t dropped = 0;         // releases that dropped it
};

class PrefetchScheduler final : public mem::EvictionAdvisor {
 public:
  // Registers itself as `store`'s eviction advisor until destroyed.
  PrefetchScheduler(mem::TieredStore& store, PrefetchOptions options);
  ~PrefetchScheduler() override;
  PrefetchScheduler(const PrefetchScheduler&) = delete;
  PrefetchScheduler& operator=(const PrefetchScheduler&) = delete;

  // Records the access, starts `h`'s own fetch and the fetches ahead, then waits for `h` and pins
  // it on the tier; returns its address.
  Result<void*> acquire(mem::Handle h);
  // Unpins, then keeps the copy for a reuse within max_reuse_distance (a stable one always, while
  // the store has room) or drops it.
  void release(mem::Handle h);
  // The model says `h` comes soon. Used only while recording (a trace knows better).
  void hint(mem::Handle h);
  // End of a pass: waits for the fetches it started, adopts a new recording as the trace, and
  // drops every copy it kept but the stable ones (the optimizer may change the data before the
  // next pass); with prefetch_across_passes, then starts the next pass's first fetches.
  void end_pass();

  std::uint64_t next_use(mem::Handle h) const override;

  SchedulerMode mode() const;
  const AccessTrace& trace() const { return trace_; }
  std::size_t position() const;
  SchedulerStats stats() const { return stats_; }

 private:
  struct InFlight {
    mem::Handle h;
    std::uint64_t bytes;
    mem::Completion done;
  };
  bool resident_or_arriving(mem::Handle h) const;
  // The routed set `h` belongs to, or -1.
  int set_of(mem::Handle h) const {
    const auto it = set_of_.find(mem::handle_index(h));
    return it == set_of_.end() ? -1 : it->second;
  }
  // What the trace holds for `h`: its set's entry (the set's first tensor) for a routed tensor,
  // else itself.
  mem::Handle entry_of(mem::Handle h) const {
    const int set = set_of(h);
    return set < 0 ? h : options_.routed_sets[static_cast<std::size_t>(set)].front();
  }
  // Starts the fetches of a routed set's members not resident or arriving, if all of them fit
  // within the bounds; whether they did.
  bool prefetch_set(int set, std::size_t* count, std::uint64_t* inflight, std::uint64_t* live);
  // Bytes of its tensors allocated on the tier, but stable copies kept after use (a cache).
  std::uint64_t live_bytes() const;
  // acquire's fetch (on demand where the copy is neither resident nor arriving), the fetches
  // ahead, and the pin.
  Result<void*> fetch_and_pin(mem::Handle h);
  bool is_stable(mem::Handle h) const { return options_.stable && options_.stable(h); }
  std::uint64_t inflight_bytes(std::size_t* count);
  void issue_ahead();
  bool start_prefetch(mem::Handle h, bool from_trace);

  mem::TieredStore& store_;
  const PrefetchOptions options_;
  AccessTrace recording_;
  std::vector<InFlight> inflight_;
  std::unordered_set<std::uint32_t> known_;  // every handle it has seen
  std::vector<mem::Handle> known_order_;
  std::unordered_set<std::uint32_t> kept_stable_;  // stable copies released and kept, not since
                                                   // acquired (some evicted since: harmless)
  std::unordered_map<std::uint32_t, int> set_of_;  // routed tensors' sets
  int in_set_ = -1;  // the routed set whose acquires this pass is in the middle of, or -1
  SchedulerStats stats_;

  // What next_use reads, guarded because the store may ask from another thread. Never held while
  // calling into the store.
  mutable std::mutex mu_;
  AccessTrace trace_;
  bool has_trace_ = false;
  bool replaying_ = false;  // this pass follows trace_ so far
  std::size_t pos_ = 0;     // acquires so far in this pass
  std::size_t events_ = 0;  // acquires and releases so far in this pass
  // The tensor an acquire is fetching ahead for before it pins it (its entry): used now.
  mem::Handle acquiring_ = mem::Handle::kInvalid;
};

}  // namespace strata::sched
