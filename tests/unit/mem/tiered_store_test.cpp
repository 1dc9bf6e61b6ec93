// TieredStore: residency rules, every route between tiers, budgets, victim choice and errors.
#include "strata/mem/tiered_store.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>

#include "strata/core/aligned.h"
#include "tests/testing/backends.h"
#include "tests/testing/temp_dir.h"
#include "tests/unit/mem/store_test_util.h"

namespace strata::mem {
namespace {

using testing::first_mismatch;
using testing::make_cpu_device;
using testing::make_memory_swap;
using testing::random_bytes;
using testing::small_options;

class StoreTest : public ::testing::Test {
 protected:
  void make(StoreOptions o) {
    store_.reset();  // before the device and swap space it uses
    device_ = make_cpu_device();
    swap_ = make_memory_swap();
    auto s = TieredStore::create(*device_, swap_.get(), o);
    ASSERT_TRUE(s.is_ok()) << s.status().to_string();
    store_ = std::move(*s);
  }
  Handle add(const std::string& name, std::size_t bytes, Tier home, bool transient = false) {
    TensorSpec spec;
    spec.name = name;
    spec.size_bytes = bytes;
    spec.home = home;
    spec.transient = transient;
    auto h = store_->add(spec);
    EXPECT_TRUE(h.is_ok()) << h.status().to_string();
    return h.is_ok() ? *h : Handle::kInvalid;
  }
  // Writes random data as the tensor's content and returns it.
  std::vector<std::byte> fill(Handle h, std::uint64_t seed) {
    Rng rng(seed);
    auto v = random_bytes(store_->spec(h).size_bytes, rng);
    EXPECT_TRUE(store_->write(h, v.data(), v.size()).is_ok());
    return v;
  }
  void expect_content(Handle h, const std::vector<std::byte>& want) {
    std::vector<std::byte> got(want.size());
    ASSERT_TRUE(store_->read(h, got.data()).is_ok());
    EXPECT_EQ(first_mismatch(got.data(), want.data(), want.size()), -1);
  }

  std::unique_ptr<device::Device> device_;
  std::unique_ptr<io::SwapSpace> swap_;
  std::unique_ptr<TieredStore> store_;
};

TEST_F(StoreTest, FetchesFromEveryHomeToTheDeviceAndBack) {
  make(small_options(0, 0));
  // Sizes that are not multiples of a page or of the 8 KiB staging chunk.
  std::map<Tier, Handle> hs = {{Tier::kHost, add("host", 20000, Tier::kHost)},
                               {Tier::kNvme, add("nvme", 30001, Tier::kNvme)},
                               {Tier::kDevice, add("dev", 5000, Tier::kDevice)}};
  for (auto [home, h] : hs) {
    SCOPED_TRACE(std::string(tier_name(home)));
    const auto data = fill(h, 7 + static_cast<int>(home));
    auto c = store_->fetch(h, Tier::kDevice);
    ASSERT_TRUE(c.is_ok());
    ASSERT_TRUE(store_->wait(*c).is_ok());
    auto p = store_->acquire(h, Tier::kDevice);
    ASSERT_TRUE(p.is_ok()) << p.status().to_string();
    EXPECT_EQ(first_mismatch(*p, data.data(), data.size()), -1);
    const Residency r = store_->residency(h);
    EXPECT_TRUE(r.valid[0]);
    EXPECT_TRUE(r.valid[static_cast<int>(home)]);
    EXPECT_FALSE(r.dirty);
    EXPECT_EQ(r.pins[0], 1);
    store_->unpin(h, Tier::kDevice);
    if (home != Tier::kDevice) {
      ASSERT_TRUE(store_->release(h, Tier::kDevice).is_ok());
      EXPECT_FALSE(store_->residency(h).allocated[0]);
    }
  }
  const StoreStats st = store_->stats();
  EXPECT_EQ(st.bytes_moved[1][0], 20000u + 5000u);  // the fetch, and the write of "dev"
  EXPECT_EQ(st.bytes_moved[2][0], 30001u);
}

TEST_F(StoreTest, DirtyDeviceCopyIsWrittenBackToItsHomeOnEvict) {
  make(small_options(0, 0));
  for (Tier home : {Tier::kHost, Tier::kNvme}) {
    SCOPED_TRACE(std::string(tier_name(home)));
    const Handle h = add(std::string(tier_name(home)), 25000, home);
    fill(h, 1);
    auto p = store_->acquire(h, Tier::kDevice);
    ASSERT_TRUE(p.is_ok());
    Rng rng(99);
    const auto fresh = random_bytes(25000, rng);
    std::memcpy(*p, fresh.data(), fresh.size());
    store_->mark_dirty(h, Tier::kDevice);
    Residency r = store_->residency(h);
    EXPECT_TRUE(r.dirty);
    EXPECT_EQ(r.num_valid(), 1);
    store_->unpin(h, Tier::kDevice);
    // The only valid copy may not be released, only evicted.
    EXPECT_EQ(store_->release(h, Tier::kDevice).code(), StatusCode::kFailedPrecondition);
    auto c = store_->evict(h, Tier::kDevice);
    ASSERT_TRUE(c.is_ok());
    ASSERT_TRUE(store_->wait(*c).is_ok());
    r = store_->residency(h);
    EXPECT_FALSE(r.allocated[0]);
    EXPECT_FALSE(r.dirty);
    expect_content(h, fresh);
  }
}

TEST_F(StoreTest, TransientTensorDrainsFromDeviceToHostAndNvme) {
  make(small_options(0, 0));
  const Handle g = add("grad", 12345, Tier::kHost, /*transient=*/true);
  EXPECT_EQ(store_->fetch(g, Tier::kDevice).status().code(), StatusCode::kFailedPrecondition);
  auto p = store_->emplace(g, Tier::kDevice, /*zero_fill=*/true);
  ASSERT_TRUE(p.is_ok());
  std::vector<std::byte> zeros(12345);
  EXPECT_EQ(first_mismatch(*p, zeros.data(), zeros.size()), -1);
  Rng rng(3);
  const auto data = random_bytes(12345, rng);
  std::memcpy(*p, data.data(), data.size());
  store_->unpin(g, Tier::kDevice);
  auto c = store_->evict(g, Tier::kDevice);
  ASSERT_TRUE(c.is_ok());
  ASSERT_TRUE(store_->wait(*c).is_ok());
  Residency r = store_->residency(g);
  EXPECT_TRUE(r.valid[1]);
  EXPECT_FALSE(r.allocated[0]);
  EXPECT_TRUE(r.dirty);
  // Host to NVMe, then back to the device.
  c = store_->evict(g, Tier::kHost);
  ASSERT_TRUE(c.is_ok());
  ASSERT_TRUE(store_->wait(*c).is_ok());
  EXPECT_TRUE(store_->residency(g).valid[2]);
  auto back = store_->acquire(g, Tier::kDevice);
  ASSERT_TRUE(back.is_ok());
  EXPECT_EQ(first_mismatch(*back, data.data(), data.size()), -1);
  store_->unpin(g, Tier::kDevice);
  ASSERT_TRUE(store_->discard(g).is_ok());
  EXPECT_EQ(store_->residency(g).num_valid(), 0);
  EXPECT_EQ(store_->usage(Tier::kNvme).reserved_bytes, 0u);
}

TEST_F(StoreTest, TensorLargerThanATierBudgetIsRejectedAtRegistration) {
  make(small_options(64 * 1024, 256 * 1024));
  TensorSpec spec;
  spec.name = "model.layers.3";
  spec.size_bytes = 100 * 1024;
  spec.home = Tier::kNvme;
  auto h = store_->add(spec);
  ASSERT_FALSE(h.is_ok());
  EXPECT_EQ(h.status().code(), StatusCode::kOutOfMemory);
  const std::string& m = h.status().message();
  EXPECT_NE(m.find("model.layers.3"), std::string::npos) << m;
  EXPECT_NE(m.find("100.00 KiB"), std::string::npos) << m;
  EXPECT_NE(m.find("64.00 KiB"), std::string::npos) << m;
  EXPECT_NE(m.find("device"), std::string::npos) << m;
}

TEST_F(StoreTest, HomesBeyondTheHostBudgetAreRejectedNotOvercommitted) {
  // 3 staging buffers of 8 KiB + two 32 KiB homes fit in 96 KiB; a third does not.
  make(small_options(0, 96 * 1024));
  add("a", 32 * 1024, Tier::kHost);
  add("b", 32 * 1024, Tier::kHost);
  TensorSpec spec{"c", 32 * 1024, Tier::kHost};
  auto h = store_->add(spec);
  ASSERT_FALSE(h.is_ok());
  EXPECT_EQ(h.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(h.status().message().find("'c'"), std::string::npos);
  EXPECT_LE(store_->usage(Tier::kHost).peak_bytes, 96u * 1024);
}

TEST_F(StoreTest, LeastRecentlyUsedIsEvictedWithoutAnAdvisor) {
  make(small_options(3 * 10000, 0));
  std::vector<Handle> hs;
  for (int i = 0; i < 4; ++i) {
    hs.push_back(add("t" + std::to_string(i), 10000, Tier::kHost));
    fill(hs.back(), static_cast<std::uint64_t>(i));
  }
  for (int i : {0, 1, 2, 0}) {  // t1 is now the least recently used
    ASSERT_TRUE(store_->acquire(hs[static_cast<std::size_t>(i)], Tier::kDevice).is_ok());
    store_->unpin(hs[static_cast<std::size_t>(i)], Tier::kDevice);
  }
  ASSERT_TRUE(store_->acquire(hs[3], Tier::kDevice).is_ok());
  store_->unpin(hs[3], Tier::kDevice);
  EXPECT_TRUE(store_->residency(hs[0]).valid[0]);
  EXPECT_FALSE(store_->residency(hs[1]).allocated[0]);
  EXPECT_TRUE(store_->residency(hs[2]).valid[0]);
  EXPECT_LE(store_->usage(Tier::kDevice).peak_bytes, 30000u);
  EXPECT_EQ(store_->stats().evictions, 1u);
}

// Device memory asked for outside the store (a backend's op scratch) takes what the store keeps
// only as a cache: a clean, unpinned device copy goes (its data stays at home), never a pinned
// one; the store's own allocations skip the reclaimers (it makes room its own way).
TEST_F(StoreTest, DeviceMemoryAskedForOutsideTheStoreTakesItsKeptCopies) {
  constexpr std::size_t kBytes = 10240;  // a multiple of the CPU device's 64-byte rounding
  store_.reset();
  device_ = make_cpu_device(4 * kBytes);
  swap_ = make_memory_swap();
  auto created = TieredStore::create(*device_, swap_.get(), small_options(0, 0));
  ASSERT_TRUE(created.is_ok()) << created.status().to_string();
  store_ = std::move(*created);
  std::vector<Handle> hs;
  std::vector<std::vector<std::byte>> data;
  for (int i = 0; i < 4; ++i) {
    hs.push_back(add("t" + std::to_string(i), kBytes, Tier::kHost));
    data.push_back(fill(hs.back(), static_cast<std::uint64_t>(i)));
    ASSERT_TRUE(store_->acquire(hs.back(), Tier::kDevice).is_ok());
    store_->unpin(hs.back(), Tier::kDevice);  // kept: the device is full of copies
  }
  EXPECT_FALSE(device_->allocate(kBytes, "without reclaiming", false).is_ok());
  auto scratch = device_->allocate(kBytes, "op scratch");
  ASSERT_TRUE(scratch.is_ok()) << scratch.status().to_string();
  // The least recently used copy went (no advisor); its data is still at home.
  EXPECT_FALSE(store_->residency(hs[0]).allocated[0]);
  for (int i = 1; i < 4; ++i) EXPECT_TRUE(store_->residency(hs[i]).valid[0]) << i;
  expect_content(hs[0], data[0]);
  // Pinned copies stay: with every copy in use there is nothing to reclaim.
  for (int i = 1; i < 4; ++i) ASSERT_TRUE(store_->acquire(hs[i], Tier::kDevice).is_ok());
  EXPECT_FALSE(device_->allocate(kBytes, "more op scratch").is_ok());
  for (int i = 1; i < 4; ++i) {
    EXPECT_TRUE(store_->residency(hs[i]).valid[0]) << i;
    store_->unpin(hs[i], Tier::kDevice);
  }
  // Once the scratch is given back, the store fetches the dropped copy again.
  scratch->reset();
  auto again = store_->acquire(hs[0], Tier::kDevice);
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
  EXPECT_EQ(first_mismatch(*again, data[0].data(), kBytes), -1);
  store_->unpin(hs[0], Tier::kDevice);
}

// Next use from a fixed table: Belady evicts the copy needed last.
class TableAdvisor final : public EvictionAdvisor {
 public:
  std::map<std::uint32_t, std::uint64_t> next;
  std::uint64_t next_use(Handle h) const override {
    auto it = next.find(handle_index(h));
    return it == next.end() ? kNeverUsed : it->second;
  }
};

TEST_F(StoreTest, BeladyEvictsTheFarthestNextUseAndPrefetchNeverEvictsSooner) {
  make(small_options(3 * 10000, 0));
  TableAdvisor advisor;
  store_->set_advisor(&advisor);
  std::vector<Handle> hs;
  for (int i = 0; i < 4; ++i) {
    hs.push_back(add("t" + std::to_string(i), 10000, Tier::kHost));
    fill(hs.back(), static_cast<std::uint64_t>(i));
  }
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(store_->acquire(hs[static_cast<std::size_t>(i)], Tier::kDevice).is_ok());
    store_->unpin(hs[static_cast<std::size_t>(i)], Tier::kDevice);
  }
  advisor.next = {{0, 5}, {1, 1}, {2, 9}, {3, 3}};
  // t3 (next use 3) may push out only copies used later: t2 (9) and t0 (5); t2 goes first.
  auto c = store_->try_prefetch(hs[3], Tier::kDevice);
  ASSERT_TRUE(c.has_value());
  ASSERT_TRUE(store_->wait(*c).is_ok());
  EXPECT_FALSE(store_->residency(hs[2]).allocated[0]);
  EXPECT_TRUE(store_->residency(hs[0]).valid[0]);
  // t2 now comes at 2: evicting t0 (5) is fine, t1 (1) and t3 (3) are needed sooner.
  advisor.next = {{0, 5}, {1, 1}, {2, 2}, {3, 3}};
  c = store_->try_prefetch(hs[2], Tier::kDevice);
  ASSERT_TRUE(c.has_value());
  ASSERT_TRUE(store_->wait(*c).is_ok());
  EXPECT_FALSE(store_->residency(hs[0]).allocated[0]);
  // t0 at 4 is needed after everything resident: a prefetch is refused rather than evict sooner.
  advisor.next = {{0, 4}, {1, 1}, {2, 2}, {3, 3}};
  EXPECT_FALSE(store_->try_prefetch(hs[0], Tier::kDevice).has_value());
  EXPECT_EQ(store_->stats().prefetches_refused, 1u);
  // A demand fetch still gets its room: the farthest (t3) goes.
  ASSERT_TRUE(store_->acquire(hs[0], Tier::kDevice).is_ok());
  EXPECT_FALSE(store_->residency(hs[3]).allocated[0]);
  store_->unpin(hs[0], Tier::kDevice);
  store_->set_advisor(nullptr);
}

TEST_F(StoreTest, PinnedCopiesAreNeverEvictedAndAFullTierIsAClearError) {
  make(small_options(2 * 10000, 0));
  const Handle a = add("a", 10000, Tier::kHost), b = add("b", 10000, Tier::kHost),
               c = add("c", 10000, Tier::kHost);
  for (Handle h : {a, b, c}) fill(h, 1);
  ASSERT_TRUE(store_->acquire(a, Tier::kDevice).is_ok());
  ASSERT_TRUE(store_->acquire(b, Tier::kDevice).is_ok());
  auto r = store_->acquire(c, Tier::kDevice);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(r.status().message().find("pinned"), std::string::npos) << r.status().message();
  EXPECT_EQ(store_->residency(a).pins[0], 1);
  store_->unpin(b, Tier::kDevice);
  ASSERT_TRUE(store_->acquire(c, Tier::kDevice).is_ok());
  EXPECT_FALSE(store_->residency(b).allocated[0]);
  store_->unpin(a, Tier::kDevice);
  store_->unpin(c, Tier::kDevice);
}

TEST_F(StoreTest, DemandFetchWaitsForAWriteBackToMakeRoom) {
  make(small_options(2 * 20000, 0));
  const Handle a = add("a", 20000, Tier::kNvme), b = add("b", 20000, Tier::kNvme),
               c = add("c", 20000, Tier::kNvme);
  std::vector<std::vector<std::byte>> fresh;
  for (Handle h : {a, b}) {
    fill(h, 5);
    auto p = store_->acquire(h, Tier::kDevice);
    ASSERT_TRUE(p.is_ok());
    Rng rng(handle_index(h) + 50);
    fresh.push_back(random_bytes(20000, rng));
    std::memcpy(*p, fresh.back().data(), 20000);
    store_->mark_dirty(h, Tier::kDevice);
    store_->unpin(h, Tier::kDevice);
  }
  const auto cdata = fill(c, 6);
  auto p = store_->acquire(c, Tier::kDevice);  // both residents are dirty: one is written back
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(first_mismatch(*p, cdata.data(), cdata.size()), -1);
  store_->unpin(c, Tier::kDevice);
  EXPECT_GE(store_->stats().writebacks, 1u);
  expect_content(a, fresh[0]);
  expect_content(b, fresh[1]);
  EXPECT_LE(store_->usage(Tier::kDevice).peak_bytes, 40000u);
}

// A checkpointed activation homed on NVMe: the device copy goes straight down in one
// asynchronous write-back (through staging), never through a host copy; an evict that would go
// up, or that names a tier for a homed tensor, is refused.
TEST_F(StoreTest, TransientTensorGoesFromDeviceStraightToNvme) {
  for (const bool direct : {true, false}) {
    SCOPED_TRACE(direct ? "device copies read directly" : "staged chunks");
    StoreOptions o = small_options(0, 0);
    o.direct_device_io = direct;
    make(o);
    const Handle g = add("activation", 20001, Tier::kHost, /*transient=*/true);
    auto p = store_->emplace(g, Tier::kDevice, /*zero_fill=*/false);
    ASSERT_TRUE(p.is_ok());
    Rng rng(5);
    const auto data = random_bytes(20001, rng);
    std::memcpy(*p, data.data(), data.size());
    store_->unpin(g, Tier::kDevice);
    EXPECT_EQ(store_->evict(g, Tier::kDevice, Tier::kDevice).status().code(),
              StatusCode::kInvalidArgument);
    auto c = store_->evict(g, Tier::kDevice, Tier::kNvme);
    ASSERT_TRUE(c.is_ok()) << c.status().to_string();
    ASSERT_TRUE(store_->wait(*c).is_ok());
    const Residency r = store_->residency(g);
    EXPECT_TRUE(r.valid[2]);
    EXPECT_FALSE(r.allocated[0]);
    EXPECT_FALSE(r.allocated[1]);  // no host copy on the way
    const StoreStats st = store_->stats();
    EXPECT_EQ(st.bytes_moved[0][2], 20001u);
    EXPECT_EQ(st.bytes_moved[0][1], 0u);
    auto back = store_->acquire(g, Tier::kDevice);
    ASSERT_TRUE(back.is_ok());
    EXPECT_EQ(first_mismatch(*back, data.data(), data.size()), -1);
    store_->unpin(g, Tier::kDevice);
    const Handle homed = add("homed", 4096, Tier::kHost);
    fill(homed, 1);
    ASSERT_TRUE(store_->acquire(homed, Tier::kDevice).is_ok());
    store_->unpin(homed, Tier::kDevice);
    EXPECT_EQ(store_->evict(homed, Tier::kDevice, Tier::kNvme).status().code(),
              StatusCode::kInvalidArgument);
  }
}

TEST_F(StoreTest, WriteDropsCachedCopiesAndReadSeesTheNewData) {
  make(small_options(0, 0));
  const Handle h = add("w", 9000, Tier::kNvme);
  fill(h, 1);
  ASSERT_TRUE(store_->acquire(h, Tier::kDevice).is_ok());
  store_->unpin(h, Tier::kDevice);
  auto c = store_->fetch(h, Tier::kHost);
  ASSERT_TRUE(c.is_ok());
  ASSERT_TRUE(store_->wait(*c).is_ok());
  EXPECT_EQ(store_->residency(h).num_valid(), 3);
  // Unaligned source: staged write.
  Rng rng(4);
  auto v = random_bytes(9001, rng);
  ASSERT_TRUE(store_->write(h, v.data() + 1, 9000).is_ok());
  const Residency r = store_->residency(h);
  EXPECT_EQ(r.num_valid(), 1);
  EXPECT_TRUE(r.valid[2]);
  expect_content(h, std::vector<std::byte>(v.begin() + 1, v.end()));
}

TEST_F(StoreTest, DeviceAllocatorFullOfOtherDataStillServesDemandFetches) {
  // The device holds 30000 bytes in all; someone else (activations) holds 10000 of them.
  device_ = make_cpu_device(30000);
  swap_ = make_memory_swap();
  auto s = TieredStore::create(*device_, swap_.get(), small_options(0, 0));
  ASSERT_TRUE(s.is_ok());
  store_ = std::move(*s);
  auto other = device_->allocate(10000, "activations");
  ASSERT_TRUE(other.is_ok());
  const Handle a = add("a", 9000, Tier::kHost), b = add("b", 9000, Tier::kHost),
               c = add("c", 9000, Tier::kHost);
  for (Handle h : {a, b, c}) fill(h, 2);
  for (Handle h : {a, b, c}) {
    ASSERT_TRUE(store_->acquire(h, Tier::kDevice).is_ok());
    store_->unpin(h, Tier::kDevice);
  }
  EXPECT_GE(store_->stats().evictions, 1u);
  EXPECT_LE(device_->memory_stats().peak_bytes, 30000u);
}

TEST_F(StoreTest, DroppedDeviceBuffersAreReusedWithinTheBudget) {
  make(small_options(30000, 0));
  const Handle a = add("a", 10000, Tier::kHost), b = add("b", 10000, Tier::kHost),
               c = add("c", 10000, Tier::kHost), d = add("d", 20000, Tier::kHost);
  for (Handle h : {a, b, c, d}) fill(h, 3);
  for (Handle h : {a, b}) {
    ASSERT_TRUE(store_->acquire(h, Tier::kDevice).is_ok());
    store_->unpin(h, Tier::kDevice);
  }
  const std::uint64_t allocations = device_->memory_stats().num_allocations;
  ASSERT_TRUE(store_->release(a, Tier::kDevice).is_ok());
  EXPECT_EQ(store_->usage(Tier::kDevice).reserved_bytes, 20000u);  // a's buffer, cached
  ASSERT_TRUE(store_->acquire(c, Tier::kDevice).is_ok());          // takes it
  store_->unpin(c, Tier::kDevice);
  EXPECT_EQ(device_->memory_stats().num_allocations, allocations);
  // A size with no cached buffer: the cache (b's, once dropped) and then b itself make room.
  ASSERT_TRUE(store_->release(b, Tier::kDevice).is_ok());
  ASSERT_TRUE(store_->acquire(d, Tier::kDevice).is_ok());
  store_->unpin(d, Tier::kDevice);
  EXPECT_LE(store_->usage(Tier::kDevice).peak_bytes, 30000u);
  EXPECT_LE(device_->memory_stats().peak_bytes, 30000u + 3 * 64);  // the allocator's rounding
  store_->trim_device_cache();
  EXPECT_EQ(store_->usage(Tier::kDevice).reserved_bytes, 30000u);  // c and d, nothing cached
}

TEST_F(StoreTest, FillZeroZeroesEveryHomeAndDropsOtherCopies) {
  make(small_options(0, 0));
  for (Tier home : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
    SCOPED_TRACE(std::string(tier_name(home)));
    const Handle h = add(std::string(tier_name(home)), 30001, home);
    fill(h, 3);
    if (home != Tier::kDevice) {
      auto p = store_->acquire(h, Tier::kDevice);  // a second copy, to be dropped
      ASSERT_TRUE(p.is_ok());
      store_->unpin(h, Tier::kDevice);
    }
    ASSERT_TRUE(store_->fill_zero(h).is_ok());
    const Residency r = store_->residency(h);
    EXPECT_EQ(r.num_valid(), 1);
    EXPECT_TRUE(r.valid[static_cast<int>(home)]);
    expect_content(h, std::vector<std::byte>(30001, std::byte{0}));
  }
}

// Discarding a homed tensor (a gradient the optimizer has used) drops every copy without a
// write-back: the home stays allocated but holds no data, a fetch says so, and a write makes it
// whole again.
TEST_F(StoreTest, DiscardOfAHomedTensorDropsItsDataWithoutWritingBack) {
  make(small_options(0, 0));
  for (Tier home : {Tier::kHost, Tier::kNvme}) {
    SCOPED_TRACE(std::string(tier_name(home)));
    const Handle h = add(std::string("gradient on ") + std::string(tier_name(home)), 30001, home);
    fill(h, 5);
    auto p = store_->emplace(h, Tier::kDevice, /*zero_fill=*/true);  // a newer, dirty copy
    ASSERT_TRUE(p.is_ok());
    store_->unpin(h, Tier::kDevice);
    const std::uint64_t written = store_->stats().bytes_moved[0][static_cast<int>(home)];
    ASSERT_TRUE(store_->discard(h).is_ok());
    EXPECT_EQ(store_->stats().bytes_moved[0][static_cast<int>(home)], written) << "written back";
    const Residency r = store_->residency(h);
    EXPECT_EQ(r.num_valid(), 0);
    EXPECT_TRUE(r.allocated[static_cast<int>(home)]);
    EXPECT_FALSE(r.allocated[static_cast<int>(Tier::kDevice)]);
    auto again = store_->acquire(h, Tier::kDevice);
    ASSERT_FALSE(again.is_ok());
    EXPECT_NE(again.status().message().find("has no data"), std::string::npos)
        << again.status().message();
    const auto v = fill(h, 6);
    expect_content(h, v);
  }
}

StoreOptions with_range_staging(std::size_t bytes) {
  StoreOptions o = small_options(0, 0);
  o.range_io_bytes = bytes;
  return o;
}

TEST_F(StoreTest, RangesOfAnNvmeHomeWriteBackANewerCopyFirstAndHoldTheTensor) {
  make(with_range_staging(32768));
  const Handle h = add("state", 30001, Tier::kNvme);
  fill(h, 5);
  // A newer copy on the host: the ranges must see it on NVMe.
  Rng rng(9);
  const auto newer = random_bytes(30001, rng);
  auto p = store_->emplace(h, Tier::kHost, false);
  ASSERT_TRUE(p.is_ok());
  std::memcpy(*p, newer.data(), newer.size());
  store_->unpin(h, Tier::kHost);
  const Status opened = store_->open_ranges(h);
  ASSERT_TRUE(opened.is_ok()) << opened.to_string();
  Residency r = store_->residency(h);
  EXPECT_FALSE(r.allocated[static_cast<int>(Tier::kHost)]);  // dropped once written back
  EXPECT_TRUE(r.in_flight);                                  // held until close_ranges
  const std::size_t io_bytes = strata::align_up(std::size_t{30001}, io::kIoAlignBytes);
  std::byte* buf = store_->range_staging().data();
  const StoreStats before = store_->stats();
  // Two ranges, as an optimizer's sub-groups.
  ASSERT_TRUE(store_->read_range(h, 0, buf, 16384).wait().is_ok());
  ASSERT_TRUE(store_->read_range(h, 16384, buf + 16384, io_bytes - 16384).wait().is_ok());
  EXPECT_EQ(first_mismatch(buf, newer.data(), newer.size()), -1);
  // The caller rewrites the home in place; the store takes that as the data, and counts it.
  std::memset(buf, 0x5a, io_bytes);
  ASSERT_TRUE(store_->write_range(h, 0, buf, io_bytes).wait().is_ok());
  store_->close_ranges(h, /*wrote=*/true, /*ok=*/true);
  const StoreStats after = store_->stats();
  const int nvme = static_cast<int>(Tier::kNvme), host = static_cast<int>(Tier::kHost);
  EXPECT_EQ(after.bytes_moved[nvme][host] - before.bytes_moved[nvme][host], io_bytes);
  EXPECT_EQ(after.bytes_moved[host][nvme] - before.bytes_moved[host][nvme], io_bytes);
  EXPECT_FALSE(store_->residency(h).in_flight);
  expect_content(h, std::vector<std::byte>(30001, std::byte{0x5a}));
  // A failed write loses the data: the tensor then has none to fetch.
  ASSERT_TRUE(store_->open_ranges(h).is_ok());
  store_->close_ranges(h, /*wrote=*/true, /*ok=*/false);
  EXPECT_FALSE(store_->fetch(h, Tier::kDevice).is_ok());
}

TEST_F(StoreTest, RangesOpenAHomeNeverWrittenForWriting) {
  make(with_range_staging(8192));
  TensorSpec spec;
  spec.name = "fresh";
  spec.size_bytes = 8192;
  spec.home = Tier::kNvme;
  spec.home_initialized = false;
  auto h = store_->add(spec);
  ASSERT_TRUE(h.is_ok());
  EXPECT_FALSE(store_->fetch(*h, Tier::kHost).is_ok());  // nothing to fetch yet
  ASSERT_TRUE(store_->open_ranges(*h).is_ok());
  std::byte* buf = store_->range_staging().data();
  std::memset(buf, 7, 8192);
  ASSERT_TRUE(store_->write_range(*h, 0, buf, 8192).wait().is_ok());
  store_->close_ranges(*h, true, true);
  expect_content(*h, std::vector<std::byte>(8192, std::byte{7}));
}

// The range staging is part of the one staging pool: counted in the host budget (a pool that
// does not fit is refused, naming the optimizer's part), and registered with the swap space with
// the rest of the pool, so every range transfer uses io_uring's fixed buffers.
TEST(StoreRangeStaging, CountedInTheHostBudgetAndRegisteredWithThePool) {
  auto device = make_cpu_device();
  {
    auto swap = make_memory_swap();
    StoreOptions o = with_range_staging(1 << 20);
    o.budget_bytes[static_cast<int>(Tier::kHost)] = (1 << 20) + 8192;  // < range + 3 buffers
    auto refused = TieredStore::create(*device, swap.get(), o);
    ASSERT_FALSE(refused.is_ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kOutOfMemory);
    EXPECT_NE(refused.status().message().find("optimizer's sub-groups"), std::string::npos)
        << refused.status().message();
    o.budget_bytes[static_cast<int>(Tier::kHost)] = 0;
    auto store = TieredStore::create(*device, swap.get(), o);
    ASSERT_TRUE(store.is_ok());
    EXPECT_EQ((*store)->usage(Tier::kHost).reserved_bytes, (*store)->staging_bytes());
    EXPECT_EQ((*store)->staging_bytes(), (1u << 20) + 3u * 8192);
  }
  ::strata::testing::TempDir dir;
  io::SwapOptions so;
  so.engine = io::SwapEngine::kUring;
  so.paths = {dir.path()};
  auto swap = io::SwapSpace::create(so);
  if (!swap.is_ok()) GTEST_SKIP() << "io_uring is unavailable here";
  auto store = TieredStore::create(*device, swap->get(), with_range_staging(1 << 20));
  ASSERT_TRUE(store.is_ok());
  TensorSpec spec;
  spec.name = "state";
  spec.size_bytes = 1 << 20;
  spec.home = Tier::kNvme;
  spec.home_initialized = false;
  auto h = (*store)->add(spec);
  ASSERT_TRUE(h.is_ok());
  ASSERT_TRUE((*store)->open_ranges(*h).is_ok());
  std::byte* buf = (*store)->range_staging().data();
  const io::IoStats before = (*swap)->stats();
  ASSERT_TRUE((*store)->write_range(*h, 0, buf, 1 << 19).wait().is_ok());
  ASSERT_TRUE((*store)->read_range(*h, 0, buf + (1 << 19), 1 << 19).wait().is_ok());
  (*store)->close_ranges(*h, true, true);
  const io::IoStats after = (*swap)->stats();
  const std::uint64_t chunks =
      after.read_chunks + after.write_chunks - before.read_chunks - before.write_chunks;
  EXPECT_GT(chunks, 0u);
  EXPECT_EQ(after.fixed_chunks - before.fixed_chunks, chunks);
}

}  // namespace
}  // namespace strata::mem

namespace strata::mem {
namespace {

// With swap files behind io_uring, NVMe <-> device chunks through the staging pool use the
// pool's registered (fixed) buffers, like the optimizer's staging.
TEST(StoreStagingTest, StagedNvmeMovesUseRegisteredBuffersWithIoUring) {
  ::strata::testing::TempDir dir;
  auto device = make_cpu_device();
  auto swap = ::strata::testing::make_swap({}, 16 * 1024, dir.path());
  ASSERT_NE(swap, nullptr);
  if (swap->engine_name().find("uring") == std::string::npos) {
    GTEST_SKIP() << "swap engine " << swap->engine_name() << " has no registered buffers";
  }
  StoreOptions o = small_options(0, 0);
  o.direct_device_io = false;  // through the staging pool
  auto store = TieredStore::create(*device, swap.get(), o);
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  TensorSpec spec;
  spec.name = "w";
  spec.size_bytes = 3 * o.staging_buffer_bytes + 100;
  spec.home = Tier::kNvme;
  auto h = (*store)->add(spec);
  ASSERT_TRUE(h.is_ok());
  Rng rng(5);
  const auto data = random_bytes(spec.size_bytes, rng);
  ASSERT_TRUE((*store)->write(*h, data.data(), data.size()).is_ok());
  const std::uint64_t before = swap->stats().fixed_chunks;
  auto p = (*store)->acquire(*h, Tier::kDevice);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(first_mismatch(*p, data.data(), data.size()), -1);
  (*store)->unpin(*h, Tier::kDevice);
  EXPECT_GE(swap->stats().fixed_chunks - before, 4u) << "one per staged chunk at least";
}

}  // namespace
}  // namespace strata::mem
