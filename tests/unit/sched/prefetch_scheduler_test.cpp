// PrefetchScheduler: records the first pass, then fetches ahead of use within its byte bounds,
// keeps tensors reused soon, notices an order change and re-records. Timing is checked on a
// manual clock (a simulated link and compute), never with sleeps.
#include "strata/sched/prefetch_scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <thread>

#include "tests/unit/mem/store_test_util.h"

namespace strata::sched {
namespace {

using mem::Handle;
using mem::testing::first_mismatch;
using mem::testing::kUnderTsan;
using mem::testing::make_cpu_device;
using mem::testing::make_memory_swap;
using mem::testing::random_bytes;

constexpr std::size_t kLayerBytes = 64 * 1024;

class SchedulerTest : public ::testing::Test {
 protected:
  void make(int layers, Tier home = Tier::kHost, std::uint64_t device_budget = 0,
            bool direct = true) {
    device_ = make_cpu_device();
    swap_ = make_memory_swap();
    mem::StoreOptions o;
    o.budget_bytes = {device_budget, 0, 0};
    o.staging_buffer_bytes = 16 * 1024;
    o.num_staging_buffers = 4;
    o.direct_device_io = direct;
    auto s = mem::TieredStore::create(*device_, swap_.get(), o);
    ASSERT_TRUE(s.is_ok());
    store_ = std::move(*s);
    Rng rng(5);
    for (int i = 0; i < layers; ++i) {
      mem::TensorSpec spec{"layer" + std::to_string(i), kLayerBytes, home};
      auto h = store_->add(spec);
      ASSERT_TRUE(h.is_ok());
      layers_.push_back(*h);
      data_.push_back(random_bytes(kLayerBytes, rng));
      ASSERT_TRUE(store_->write(*h, data_.back().data(), kLayerBytes).is_ok());
    }
  }
  PrefetchOptions options(int prefetch_layers, int live_layers, int reuse_layers = 0) {
    PrefetchOptions o;
    o.prefetch_bytes = static_cast<std::uint64_t>(prefetch_layers) * kLayerBytes;
    o.max_live_bytes = static_cast<std::uint64_t>(live_layers) * kLayerBytes;
    o.max_reuse_distance = static_cast<std::uint64_t>(reuse_layers) * kLayerBytes;
    o.follow_hints = false;
    o.on_issue = [this](Handle h, std::size_t pos, bool from_trace) {
      issued_.push_back({h, pos, from_trace});
    };
    return o;
  }
  int layer_of(Handle h) const {
    return static_cast<int>(std::find(layers_.begin(), layers_.end(), h) - layers_.begin());
  }
  // Runs one pass over `order`, checking every layer's bytes on the device.
  void pass(PrefetchScheduler& s, const std::vector<int>& order,
            const std::function<void(int step, int layer)>& during = {}) {
    for (std::size_t k = 0; k < order.size(); ++k) {
      const int l = order[k];
      auto p = s.acquire(layers_[static_cast<std::size_t>(l)]);
      ASSERT_TRUE(p.is_ok()) << p.status().to_string();
      ASSERT_EQ(first_mismatch(*p, data_[static_cast<std::size_t>(l)].data(), kLayerBytes), -1);
      if (during) during(static_cast<int>(k), l);
      s.release(layers_[static_cast<std::size_t>(l)]);
    }
    s.end_pass();
  }

  struct Issue {
    Handle h;
    std::size_t position;
    bool from_trace;
  };
  std::unique_ptr<device::Device> device_;
  std::unique_ptr<io::SwapSpace> swap_;
  std::unique_ptr<mem::TieredStore> store_;
  std::vector<Handle> layers_;
  std::vector<std::vector<std::byte>> data_;
  std::vector<Issue> issued_;
};

std::vector<int> forward_backward(int n) {
  std::vector<int> order;
  for (int i = 0; i < n; ++i) order.push_back(i);
  for (int i = n - 1; i >= 0; --i) order.push_back(i);
  return order;
}

TEST_F(SchedulerTest, RecordsTheFirstPassThenFetchesAheadWithinItsBounds) {
  make(8, Tier::kNvme, 0, /*direct=*/false);  // staged NVMe -> device chunks
  PrefetchScheduler s(*store_, options(/*prefetch=*/2, /*live=*/3));
  std::vector<int> order;
  for (int i = 0; i < 8; ++i) order.push_back(i);
  pass(s, order);
  EXPECT_EQ(s.stats().demand_fetches, 8u);
  EXPECT_TRUE(issued_.empty());
  EXPECT_EQ(s.mode(), SchedulerMode::kReplaying);
  EXPECT_EQ(s.trace().size(), 8u);

  pass(s, order, [&](int step, int layer) {
    // While layer i computes (pinned), at most i+1 and i+2 are resident or arriving.
    for (int j = layer + 3; j < 8; ++j) {
      const mem::Residency r = store_->residency(layers_[static_cast<std::size_t>(j)]);
      EXPECT_FALSE(r.allocated[0])
          << "layer " << j << " fetched beyond max_live_bytes at step " << step;
    }
  });
  EXPECT_EQ(s.stats().demand_fetches, 8u + 1u);  // only layer 0: nothing precedes it
  // Every other layer was issued before its own acquire, at the acquire of an earlier layer.
  // Every other layer was issued before its own acquire (sequence point 2l+1), and no earlier
  // than max_live_bytes allows: once layer l-3 was released (point 2l-4).
  std::map<int, std::size_t> issued_at;
  for (const Issue& i : issued_) {
    EXPECT_TRUE(i.from_trace);
    issued_at[layer_of(i.h)] = i.position;
  }
  for (int l = 1; l < 8; ++l) {
    ASSERT_TRUE(issued_at.count(l)) << "layer " << l << " was never prefetched";
    EXPECT_LE(issued_at[l], static_cast<std::size_t>(2 * l)) << "layer " << l;
    EXPECT_GE(static_cast<int>(issued_at[l]), std::max(1, 2 * l - 4)) << "layer " << l;
  }
  EXPECT_EQ(s.stats().order_changes, 0u);
}

// A manual clock: compute takes C units per layer, the link moves one layer in T units, one
// transfer at a time. Layer i is acquired (sequence point 2i+1) when layer i-1's compute ends and
// released (point 2i+2) when its own ends; a fetch issued at a point starts on the link then, or
// when the link frees. Returns how long compute waited in all.
std::int64_t simulated_stall(const std::vector<std::size_t>& issued_at, std::int64_t c,
                             std::int64_t t) {
  const std::size_t n = issued_at.size();
  std::vector<std::int64_t> arrival(n, -1);
  std::int64_t link_free = 0, now = 0, stall = 0;
  auto issue_at = [&](std::size_t point, std::int64_t time) {
    for (std::size_t i = 0; i < n; ++i) {
      if (issued_at[i] != point) continue;
      arrival[i] = std::max(link_free, time) + t;
      link_free = arrival[i];
    }
  };
  for (std::size_t i = 0; i < n; ++i) {
    issue_at(2 * i + 1, now);
    EXPECT_GE(arrival[i], 0) << "layer " << i << " was never fetched";
    const std::int64_t start = std::max(now, arrival[i]);
    stall += start - now;
    now = start + c;
    issue_at(2 * i + 2, now);
  }
  return stall;
}

TEST_F(SchedulerTest, FetchesIssuedAheadHideTransfersOnAManualClock) {
  make(6);
  // max_live_bytes (two layers: the one computing and the next) is the binding bound, so the
  // issue points do not depend on how fast this machine copies.
  PrefetchScheduler s(*store_, options(/*prefetch=*/4, /*live=*/2));
  const std::vector<int> order = {0, 1, 2, 3, 4, 5};
  pass(s, order);  // recording: everything on demand, each layer at its own acquire
  std::vector<std::size_t> demand(6);
  for (std::size_t i = 0; i < 6; ++i) demand[i] = 2 * i + 1;
  pass(s, order);
  std::vector<std::size_t> replay = demand;  // layer 0 stays on demand
  for (const Issue& i : issued_) replay[static_cast<std::size_t>(layer_of(i.h))] = i.position;
  EXPECT_EQ(replay, (std::vector<std::size_t>{1, 1, 2, 4, 6, 8}));
  // Compute 10 units per layer, transfer 8: on demand every layer waits for its transfer;
  // replayed, only the first does.
  EXPECT_EQ(simulated_stall(demand, 10, 8), 6 * 8);
  EXPECT_EQ(simulated_stall(replay, 10, 8), 8);
  // Transfer slower than compute (12 vs 10): the link is the bottleneck; each later layer waits
  // the difference.
  EXPECT_EQ(simulated_stall(replay, 10, 12), 12 + 5 * 2);
}

TEST_F(SchedulerTest, KeepsLayersReusedWithinTheReuseDistance) {
  make(4);
  // Forward 0 1 2 3 then backward 3 2 1 0. Releasing 3 in forward: reused at once (0 bytes in
  // between); 2: two layer-uses in between (3, 3); 1: four. Distance 2 layers keeps 3 and 2.
  PrefetchScheduler s(*store_, options(/*prefetch=*/1, /*live=*/8, /*reuse=*/2));
  const auto order = forward_backward(4);
  pass(s, order);
  EXPECT_EQ(s.stats().kept, 0u);  // recording: no trace to judge by
  std::vector<bool> resident_after_forward;
  pass(s, order, [&](int step, int) {
    if (step != 4) return;  // the first backward acquire
    for (Handle h : layers_) resident_after_forward.push_back(store_->residency(h).valid[0]);
  });
  EXPECT_EQ(s.stats().kept, 2u);
  ASSERT_EQ(resident_after_forward.size(), 4u);
  EXPECT_TRUE(resident_after_forward[2]);
  EXPECT_TRUE(resident_after_forward[3]);
  // Everything kept is dropped at the end of the pass.
  for (Handle h : layers_) EXPECT_FALSE(store_->residency(h).allocated[0]);
}

// Stable tensors (a frozen base: nothing rewrites them) stay on the device past a pass's end
// and count toward no bound while kept: with room for all of them, the first pass fetches each
// once and no later pass fetches anything, though max_live_bytes is one layer.
TEST_F(SchedulerTest, StableCopiesStayBetweenPassesWhereThereIsRoom) {
  make(4);
  PrefetchOptions o = options(/*prefetch=*/1, /*live=*/1);
  o.stable = [](Handle) { return true; };
  PrefetchScheduler s(*store_, o);
  const auto order = forward_backward(4);
  pass(s, order);
  EXPECT_EQ(s.stats().demand_fetches, 4u);
  for (Handle h : layers_) EXPECT_TRUE(store_->residency(h).valid[0]);
  issued_.clear();
  for (int p = 0; p < 3; ++p) pass(s, order);
  EXPECT_EQ(s.stats().demand_fetches, 4u);
  EXPECT_TRUE(issued_.empty());
}

// With room for 2 of 4 stable layers, the store evicts by next use counted into the next pass
// (Belady's rule over the passes). A pass, forward 0 1 2 3 then backward 3 2 1 0, starts with
// 1 and 0 kept (the last used); 2 evicts 0 (used last of all), 3 evicts 1, 3 and 2 are kept;
// backward's 1 evicts 3 (the next pass's 3 comes after its 2), 0 evicts 2: 4 fetches a pass,
// 2 x (layers - room). Dropped at every release instead (not stable, no reuse distance), a pass
// fetches every use but the second 3's: 7.
TEST_F(SchedulerTest, StableCopiesBeyondTheRoomAreEvictedByTheirNextUseOverThePasses) {
  for (const bool stable : {true, false}) {
    SCOPED_TRACE(stable ? "stable" : "not stable");
    store_.reset();  // before the device it allocated on
    layers_.clear();
    data_.clear();
    make(4, Tier::kHost, 2 * kLayerBytes, /*direct=*/false);
    PrefetchOptions o = options(/*prefetch=*/1, /*live=*/2);
    if (stable) o.stable = [](Handle) { return true; };
    PrefetchScheduler s(*store_, o);
    const auto order = forward_backward(4);
    pass(s, order);
    pass(s, order);  // the first replay settles which layers a pass starts with
    const auto fetches = [&] {
      const SchedulerStats st = s.stats();
      return st.demand_fetches + st.trace_prefetches + st.hint_prefetches;
    };
    const std::uint64_t before = fetches();
    pass(s, order);
    pass(s, order);
    EXPECT_EQ(fetches() - before, stable ? 8u : 14u);
  }
}

TEST_F(SchedulerTest, NoticesAnOrderChangeFallsBackToDemandAndReRecords) {
  make(6);
  PrefetchScheduler s(*store_, options(/*prefetch=*/2, /*live=*/4));
  const std::vector<int> a = {0, 1, 2, 3, 4, 5}, b = {0, 1, 4, 3, 2, 5};
  pass(s, a);
  pass(s, a);
  EXPECT_EQ(s.stats().order_changes, 0u);
  const std::size_t before = issued_.size();
  std::size_t issued_after_change = 0;
  pass(s, b, [&](int step, int) {
    if (step == 2) {
      EXPECT_EQ(s.mode(), SchedulerMode::kRecording);
      EXPECT_EQ(s.stats().order_changes, 1u);
      issued_after_change = issued_.size();
    }
    if (step > 2) {
      EXPECT_EQ(issued_.size(), issued_after_change) << "prefetched off the trace";
    }
  });
  EXPECT_GT(issued_.size(), before);  // the matching prefix still prefetched
  EXPECT_EQ(s.mode(), SchedulerMode::kReplaying);
  std::vector<Handle> want;
  for (int l : b) want.push_back(layers_[static_cast<std::size_t>(l)]);
  EXPECT_EQ(s.trace().order(), want);
  EXPECT_EQ(s.stats().recorded_passes, 2u);
  // The new order replays cleanly; a pass that stops early is a change too.
  const std::uint64_t demand = s.stats().demand_fetches;
  pass(s, b);
  EXPECT_EQ(s.stats().demand_fetches, demand + 1);
  EXPECT_EQ(s.stats().order_changes, 1u);
  pass(s, {0, 1, 4});
  EXPECT_EQ(s.stats().order_changes, 2u);
  EXPECT_EQ(s.trace().size(), 3u);
}

TEST_F(SchedulerTest, AdvisesTheStoreWithTheTrace) {
  make(5);
  PrefetchScheduler s(*store_, options(1, 8));
  const std::vector<int> order = {0, 1, 2, 3, 4, 2};
  pass(s, order);
  EXPECT_EQ(s.next_use(layers_[0]), 0u);
  EXPECT_EQ(s.next_use(layers_[2]), 2u);
  auto p = s.acquire(layers_[0]);
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(s.next_use(layers_[0]), mem::kNeverUsed);  // not again in this pass
  EXPECT_EQ(s.next_use(layers_[2]), 1u);
  s.release(layers_[0]);
}

TEST_F(SchedulerTest, HintsPrefetchWhileRecording) {
  make(3);
  PrefetchOptions o = options(2, 4);
  o.follow_hints = true;
  PrefetchScheduler s(*store_, o);
  s.hint(layers_[0]);
  ASSERT_EQ(issued_.size(), 1u);
  EXPECT_FALSE(issued_[0].from_trace);
  pass(s, {0, 1, 2});
  EXPECT_EQ(s.stats().hint_prefetches, 1u);
  EXPECT_EQ(s.stats().demand_fetches, 2u);
  s.hint(layers_[0]);  // replaying now: the trace decides
  EXPECT_EQ(s.stats().hint_prefetches, 1u);
}

TEST_F(SchedulerTest, PrefetchAcrossPassesStartsTheNextPassEarly) {
  make(4);
  PrefetchOptions o = options(/*prefetch=*/1, /*live=*/2);
  o.prefetch_across_passes = true;
  PrefetchScheduler s(*store_, o);
  const std::vector<int> order = {0, 1, 2, 3};
  pass(s, order);  // records; its end, with the trace in hand, starts the next pass's layer 0
  EXPECT_TRUE(store_->residency(layers_[0]).allocated[0]);
  EXPECT_EQ(s.stats().demand_fetches, 4u);
  const std::uint64_t demand = s.stats().demand_fetches;
  pass(s, order);
  EXPECT_EQ(s.stats().demand_fetches, demand);  // not even the first layer waited on demand
}

// Routed sets: layers 0-3 are dense, 4-9 one MoE layer's experts (set 0), of which each pass's
// router chooses some, in no fixed order. A pass: 0 1, the chosen experts, 2 3, then backward
// 3 2, the chosen experts again, 1 0. `hint`: the model hints the chosen ones once "routed".
class RoutedSetTest : public SchedulerTest {
 protected:
  PrefetchOptions routed_options(int prefetch_layers, int live_layers, bool hints) {
    PrefetchOptions o = options(prefetch_layers, live_layers);
    o.follow_hints = hints;
    o.routed_sets = {std::vector<Handle>(layers_.begin() + 4, layers_.end())};
    return o;
  }
  // Returns the experts' demand fetches (acquires of an expert neither resident nor arriving).
  int moe_pass(PrefetchScheduler& s, const std::vector<int>& chosen, bool hint) {
    int expert_demands = 0;
    const auto use = [&](int l) {
      const Handle h = layers_[static_cast<std::size_t>(l)];
      const mem::Residency r = store_->residency(h);
      if (l >= 4 && !(r.valid[0] || r.in_flight)) ++expert_demands;
      auto p = s.acquire(h);
      ASSERT_TRUE(p.is_ok()) << p.status().to_string();
      ASSERT_EQ(first_mismatch(*p, data_[static_cast<std::size_t>(l)].data(), kLayerBytes), -1);
      s.release(h);
    };
    const auto experts = [&](bool backward) {
      std::vector<int> order = chosen;
      if (backward) std::reverse(order.begin(), order.end());
      if (hint) {
        for (int e : order) s.hint(layers_[static_cast<std::size_t>(e)]);
      }
      for (int e : order) use(e);
    };
    use(0);
    use(1);
    experts(false);
    use(2);
    use(3);
    use(3);
    use(2);
    experts(true);
    use(1);
    use(0);
    s.end_pass();
    return expert_demands;
  }
  // Whether dense layer `l` was fetched ahead from the trace since issued_[from].
  bool traced(int l, std::size_t from) const {
    for (std::size_t i = from; i < issued_.size(); ++i) {
      if (issued_[i].from_trace && layer_of(issued_[i].h) == l) return true;
    }
    return false;
  }
};

// Passes whose routers choose other experts follow the trace: no order change, no re-recording,
// and the dense layers after the MoE layer are still fetched ahead.
TEST_F(RoutedSetTest, PassesThatChooseOtherExpertsStillFollowTheTrace) {
  make(10);
  PrefetchScheduler s(*store_, routed_options(/*prefetch=*/2, /*live=*/4, /*hints=*/false));
  moe_pass(s, {4, 6}, false);
  ASSERT_EQ(s.mode(), SchedulerMode::kReplaying);
  // 0 1 [set] 2 3 3 2 [set] 1 0: the set is one entry each time.
  EXPECT_EQ(s.trace().size(), 10u);
  for (const std::vector<int>& chosen : {std::vector{5, 9, 7}, std::vector{8}, std::vector{4, 6}}) {
    const std::size_t from = issued_.size();
    moe_pass(s, chosen, false);
    EXPECT_TRUE(traced(2, from) && traced(3, from)) << "the layers after the experts waited";
  }
  EXPECT_EQ(s.stats().order_changes, 0u);
  EXPECT_EQ(s.stats().recorded_passes, 1u);
  // A pass that leaves the dense order is still a change.
  pass(s, {0, 2, 1});
  EXPECT_EQ(s.stats().order_changes, 1u);
}

// Where the bounds allow the whole set, the trace fetches every expert ahead of the router (the
// chosen ones never wait); where they do not, the router's hints fetch the chosen ones, even
// while replaying.
TEST_F(RoutedSetTest, FetchesTheSetWholeWhereItFitsElseTheChosenByHint) {
  make(10);
  {
    PrefetchScheduler s(*store_, routed_options(/*prefetch=*/8, /*live=*/10, /*hints=*/false));
    moe_pass(s, {4, 6}, false);
    EXPECT_EQ(moe_pass(s, {5, 9, 7}, false), 0);  // never chosen before, yet fetched ahead
    EXPECT_EQ(s.stats().order_changes, 0u);
  }
  issued_.clear();
  {
    PrefetchScheduler s(*store_, routed_options(/*prefetch=*/2, /*live=*/4, /*hints=*/false));
    moe_pass(s, {4, 6}, false);
    // Six experts never fit two layers in flight: the chosen wait, forward and backward.
    EXPECT_EQ(moe_pass(s, {5, 9, 7}, false), 6);
  }
  issued_.clear();
  {
    PrefetchScheduler s(*store_, routed_options(/*prefetch=*/2, /*live=*/4, /*hints=*/true));
    moe_pass(s, {4, 6}, true);
    ASSERT_EQ(s.mode(), SchedulerMode::kReplaying);
    const std::uint64_t hinted = s.stats().hint_prefetches;
    moe_pass(s, {5, 9}, true);
    EXPECT_GT(s.stats().hint_prefetches, hinted) << "the router's hints were ignored";
    EXPECT_EQ(s.stats().order_changes, 0u);
  }
}

// The store's advisor sees a routed tensor's next use at its set's next entry.
TEST_F(RoutedSetTest, AdvisesTheStoreOfAnExpertsNextUseAtItsSet) {
  make(10);
  PrefetchScheduler s(*store_, routed_options(1, 8, false));
  moe_pass(s, {4, 6}, false);
  // Trace: 0 1 [set] 2 3 3 2 [set] 1 0.
  EXPECT_EQ(s.next_use(layers_[6]), 2u);
  EXPECT_EQ(s.next_use(layers_[9]), 2u);  // never chosen yet: a member all the same
  EXPECT_EQ(s.next_use(layers_[2]), 3u);
}

// Another thread uses the same store (and so asks the advisor) while passes replay.
TEST_F(SchedulerTest, ConcurrentStoreUseWhileReplaying) {
  make(6, Tier::kNvme, /*device_budget=*/5 * kLayerBytes);
  Rng rng(9);
  std::vector<Handle> others;
  for (int i = 0; i < 3; ++i) {
    auto h = store_->add(mem::TensorSpec{"other" + std::to_string(i), 20000, Tier::kHost});
    ASSERT_TRUE(h.is_ok());
    auto v = random_bytes(20000, rng);
    ASSERT_TRUE(store_->write(*h, v.data(), v.size()).is_ok());
    others.push_back(*h);
  }
  PrefetchScheduler s(*store_, options(2, 3, 1));
  const int passes = kUnderTsan ? 6 : 30;
  std::atomic<bool> done{false};
  std::thread t([&] {
    Rng r(10);
    while (!done.load()) {
      const Handle h = others[r.uniform_int(others.size())];
      auto p = store_->acquire(h, Tier::kDevice);
      if (p.is_ok()) {
        store_->unpin(h, Tier::kDevice);
        store_->release(h, Tier::kDevice).ignore();
      }
    }
  });
  for (int i = 0; i < passes; ++i) pass(s, forward_backward(6));
  done = true;
  t.join();
  EXPECT_LE(store_->usage(Tier::kDevice).peak_bytes, 5 * kLayerBytes);
  EXPECT_GT(s.stats().trace_prefetches, 0u);
}

}  // namespace
}  // namespace strata::sched
