// Randomized model-based test of the tiered store: thousands of random fetch / acquire / write /
// release / evict / emplace / discard / wait / fill_zero / direct I/O operations (the offload
// engine's: ranged I/O on NVMe homes, fresh copies of homed tensors sent home) and device
// scratch taken and given back (ZeRO's buffers) over random sizes and budgets, checked after
// every step against a reference model of each tensor's contents and pins. Every byte read back
// must equal what was last written, no tier's reserved bytes (transfers in flight included) may
// ever exceed its budget, and device_fits must follow from the model's pins, homes and scratch
// alone (never from the timing of transfers), with an admitted scratch always finding room. Runs
// single-threaded and with two threads sharing one store (also under ThreadSanitizer; see
// tools/check.sh).
#include <gtest/gtest.h>

#include <deque>
#include <map>
#include <span>
#include <thread>

#include "strata/core/aligned.h"
#include "strata/mem/tiered_store.h"
#include "tests/unit/mem/store_test_util.h"

namespace strata::mem {
namespace {

using testing::first_mismatch;
using testing::kUnderTsan;
using testing::make_cpu_device;
using testing::make_memory_swap;
using testing::random_bytes;

// What the test knows about one tensor, independent of where the store keeps it.
struct ModelTensor {
  Handle h = Handle::kInvalid;
  std::size_t size = 0;
  bool transient = false;
  bool scratch = false;  // device working memory: held (pinned) from emplace to discard
  Tier home = Tier::kHost;
  bool has_data = false;
  std::vector<std::byte> data;  // the latest contents when has_data
  std::array<int, kNumTiers> pins{};
  int total_pins() const { return pins[0] + pins[1] + pins[2]; }
};

struct Outstanding {
  std::size_t tensor;
  Completion c;
};

class Driver {
 public:
  // `alone`: no other driver shares the store, so the model knows every pin and device_fits
  // can be checked exactly. `ranges`: this driver's part of the store's range staging.
  Driver(TieredStore& store, std::span<std::byte> ranges, std::vector<ModelTensor>& tensors,
         std::uint64_t seed, const std::array<std::uint64_t, kNumTiers>& budgets, bool alone)
      : store_(store),
        ranges_(ranges),
        tensors_(tensors),
        rng_(seed),
        budgets_(budgets),
        alone_(alone) {}

  void run(int steps) {
    for (int step = 0; step < steps && !::testing::Test::HasFatalFailure(); ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      one_step();
      check_invariants();
    }
    // Settle: wait for everything, drop every pin, and verify every tensor's data once more.
    for (auto& o : outstanding_) (void)store_.wait(o.c);
    outstanding_.clear();
    for (auto& t : tensors_) {
      if (t.scratch) {
        if (t.has_data) scratch_step(t);  // gives it back
        continue;
      }
      for (int i = 0; i < kNumTiers; ++i) {
        while (t.pins[static_cast<std::size_t>(i)] > 0) {
          store_.unpin(t.h, static_cast<Tier>(i));
          --t.pins[static_cast<std::size_t>(i)];
        }
      }
      verify_read(t);
    }
    check_invariants();
  }

  std::uint64_t ops = 0;
  std::uint64_t scratch_taken = 0, scratch_refused = 0;

 private:
  std::size_t pick() { return rng_.uniform_int(tensors_.size()); }
  Tier pick_tier(bool with_nvme) { return static_cast<Tier>(rng_.uniform_int(with_nvme ? 3 : 2)); }

  void expect_ok_or_oom(const Status& s, const char* what) {
    EXPECT_TRUE(s.is_ok() || s.code() == StatusCode::kOutOfMemory) << what << ": " << s.to_string();
  }

  void verify_bytes(const ModelTensor& t, const void* p) {
    ASSERT_TRUE(t.has_data);
    ASSERT_EQ(first_mismatch(p, t.data.data(), t.size), -1)
        << "contents of " << store_.spec(t.h).name << " differ";
  }

  void verify_read(const ModelTensor& t) {
    std::vector<std::byte> buf(t.size);
    Status s = store_.read(t.h, buf.data());
    if (!t.has_data) {
      EXPECT_FALSE(s.is_ok());
      return;
    }
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    verify_bytes(t, buf.data());
  }

  void one_step() {
    ++ops;
    const std::size_t i = pick();
    ModelTensor& t = tensors_[i];
    if (t.scratch) return scratch_step(t);
    switch (rng_.uniform_int(13)) {
      case 0:
      case 1: {  // asynchronous fetch
        const Tier to = pick_tier(true);
        auto c = store_.fetch(t.h, to);
        if (!t.has_data) {
          EXPECT_FALSE(c.is_ok());
          break;
        }
        expect_ok_or_oom(c.status(), "fetch");
        if (c.is_ok()) outstanding_.push_back({i, *c});
        break;
      }
      case 2: {  // wait for an outstanding completion
        if (outstanding_.empty()) break;
        const std::size_t k = rng_.uniform_int(outstanding_.size());
        EXPECT_TRUE(store_.wait(outstanding_[k].c).is_ok());
        outstanding_.erase(outstanding_.begin() + static_cast<std::ptrdiff_t>(k));
        break;
      }
      case 3:
      case 4: {  // acquire, check the bytes, then keep it pinned, unpin, or write new data
        if (!t.has_data || t.total_pins() >= 2) break;
        const Tier tier = pick_tier(false);
        auto p = store_.acquire(t.h, tier);
        expect_ok_or_oom(p.status(), "acquire");
        if (!p.is_ok()) break;
        ++t.pins[static_cast<std::size_t>(tier)];
        verify_bytes(t, *p);
        const auto choice = rng_.uniform_int(3);
        if (choice == 2 && t.total_pins() == 1) {
          t.data = random_bytes(t.size, rng_);
          std::memcpy(*p, t.data.data(), t.size);
          store_.mark_dirty(t.h, tier);
        }
        if (choice >= 1) {
          store_.unpin(t.h, tier);
          --t.pins[static_cast<std::size_t>(tier)];
        }
        break;
      }
      case 5: {  // unpin something held
        for (int k = 0; k < kNumTiers; ++k) {
          if (t.pins[static_cast<std::size_t>(k)] > 0) {
            store_.unpin(t.h, static_cast<Tier>(k));
            --t.pins[static_cast<std::size_t>(k)];
            break;
          }
        }
        break;
      }
      case 6: {  // release
        const Tier tier = pick_tier(true);
        const Residency before = store_.residency(t.h);
        Status s = store_.release(t.h, tier);
        if (s.is_ok()) {
          EXPECT_FALSE(store_.residency(t.h).allocated[static_cast<std::size_t>(tier)]);
        } else {
          EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition) << s.to_string();
          const bool home = !t.transient && t.home == tier;
          const bool only = before.valid[static_cast<std::size_t>(tier)] && before.num_valid() == 1;
          EXPECT_TRUE(home || t.pins[static_cast<std::size_t>(tier)] > 0 || only ||
                      before.in_flight)
              << s.to_string();
        }
        break;
      }
      case 7: {  // evict
        const Tier tier = pick_tier(true);
        auto c = store_.evict(t.h, tier);
        if (c.is_ok()) {
          outstanding_.push_back({i, *c});
        } else {
          const auto code = c.status().code();
          EXPECT_TRUE(code == StatusCode::kInvalidArgument ||
                      code == StatusCode::kFailedPrecondition || code == StatusCode::kOutOfMemory)
              << c.status().to_string();
        }
        break;
      }
      case 8: {  // whole-tensor write (homed) or fresh data in place (transient)
        if (t.total_pins() > 0) break;
        if (!t.transient && rng_.uniform_int(2) == 0) {
          auto v = random_bytes(t.size, rng_);
          Status s = store_.write(t.h, v.data(), v.size());
          ASSERT_TRUE(s.is_ok()) << s.to_string();
          t.data = std::move(v);
          t.has_data = true;
        } else {  // a homed tensor's fresh copy is its only data until evicted home
          const Tier tier = pick_tier(false);
          auto p = store_.emplace(t.h, tier, rng_.uniform_int(2) == 0);
          expect_ok_or_oom(p.status(), "emplace");
          if (!p.is_ok()) {
            t.has_data = false;  // emplace discarded the old data before it found no room
            break;
          }
          t.data = random_bytes(t.size, rng_);
          std::memcpy(*p, t.data.data(), t.size);
          t.has_data = true;
          store_.unpin(t.h, tier);
        }
        break;
      }
      case 9: {  // discard a transient tensor
        if (!t.transient || t.total_pins() > 0) break;
        ASSERT_TRUE(store_.discard(t.h).is_ok());
        t.has_data = false;
        break;
      }
      case 10: {  // synchronous read
        if (t.total_pins() > 0 && rng_.uniform_int(2) == 0) break;
        verify_read(t);
        break;
      }
      case 11: {  // zero a homed tensor
        if (t.transient || t.total_pins() > 0) break;
        Status s = store_.fill_zero(t.h);
        ASSERT_TRUE(s.is_ok()) << s.to_string();
        t.data.assign(t.size, std::byte{0});
        t.has_data = true;
        break;
      }
      case 12: {  // ranged I/O straight on an NVMe home, as the streamed optimizer does
        if (t.transient || t.home != Tier::kNvme || t.total_pins() > 0) break;
        const Status opened = store_.open_ranges(t.h);
        ASSERT_TRUE(opened.is_ok()) << opened.to_string();
        EXPECT_TRUE(store_.residency(t.h).in_flight);
        const std::size_t io_bytes = align_up(t.size, io::kIoAlignBytes);
        ASSERT_LE(io_bytes, ranges_.size());
        std::byte* buf = ranges_.data();
        // Two halves at a 4096-byte boundary, as sub-groups are.
        const std::size_t half = align_up(io_bytes / 2, io::kIoAlignBytes);
        if (t.has_data) {
          ASSERT_TRUE(store_.read_range(t.h, 0, buf, half).wait().is_ok());
          if (half < io_bytes) {
            ASSERT_TRUE(store_.read_range(t.h, half, buf + half, io_bytes - half).wait().is_ok());
          }
          verify_bytes(t, buf);
        }
        const bool write = rng_.uniform_int(2) == 0;
        if (write) {
          t.data = random_bytes(t.size, rng_);
          std::memcpy(buf, t.data.data(), t.size);
          ASSERT_TRUE(store_.write_range(t.h, 0, buf, io_bytes).wait().is_ok());
          t.has_data = true;
        }
        store_.close_ranges(t.h, write, /*ok=*/true);
        break;
      }
    }
  }

  // Scratch is only taken and given back: taken when device_fits admits it (or, half the time,
  // without asking, when the store must make room or fail with out_of_memory).
  void scratch_step(ModelTensor& t) {
    if (t.has_data) {
      verify_bytes(t, held_scratch_.at(t.h));
      store_.unpin(t.h, Tier::kDevice);
      t.pins[0] = 0;
      ASSERT_TRUE(store_.discard(t.h).is_ok());
      t.has_data = false;
      held_scratch_.erase(t.h);
      return;
    }
    const bool ask = rng_.uniform_int(2) == 0;
    const bool fits = store_.device_fits(store_.device_bytes(t.h));
    if (!fits) ++scratch_refused;
    if (ask && !fits) return;
    auto p = store_.emplace(t.h, Tier::kDevice, rng_.uniform_int(2) == 0);
    if (fits && alone_) {
      ASSERT_TRUE(p.is_ok()) << "device_fits admitted it: " << p.status().to_string();
    }
    expect_ok_or_oom(p.status(), "scratch");
    if (!p.is_ok()) return;
    t.data = random_bytes(t.size, rng_);
    std::memcpy(*p, t.data.data(), t.size);
    t.has_data = true;
    t.pins[0] = 1;
    held_scratch_[t.h] = *p;
    ++scratch_taken;
  }

  // What device_fits must count, from the model alone.
  std::uint64_t expected_held_device_bytes() const {
    std::uint64_t held = 0;
    for (const ModelTensor& t : tensors_) {
      const Residency r = store_.residency(t.h);
      const bool stranded = t.transient && r.valid[0] && r.num_valid() == 1 && !r.in_flight;
      if (t.pins[0] > 0 || (!t.transient && t.home == Tier::kDevice) || t.scratch || stranded) {
        if (r.allocated[0]) held += store_.device_bytes(t.h);
      }
    }
    return held;
  }

  void check_invariants() {
    const std::uint64_t device_budget = budgets_[0];
    if (alone_ && device_budget != 0) {
      const std::uint64_t held = expected_held_device_bytes();
      ASSERT_LE(held, device_budget);
      ASSERT_TRUE(store_.device_fits(device_budget - held));
      ASSERT_FALSE(store_.device_fits(device_budget - held + 1));
    }
    for (int k = 0; k < kNumTiers; ++k) {
      const TierUsage u = store_.usage(static_cast<Tier>(k));
      if (budgets_[static_cast<std::size_t>(k)] != 0) {
        ASSERT_LE(u.reserved_bytes, budgets_[static_cast<std::size_t>(k)]) << "tier " << k;
        ASSERT_LE(u.peak_bytes, budgets_[static_cast<std::size_t>(k)]) << "tier " << k;
      }
    }
    for (const ModelTensor& t : tensors_) {
      const Residency r = store_.residency(t.h);
      for (int k = 0; k < kNumTiers; ++k) {
        ASSERT_EQ(r.pins[static_cast<std::size_t>(k)], t.pins[static_cast<std::size_t>(k)]);
        if (t.pins[static_cast<std::size_t>(k)] > 0) {
          ASSERT_TRUE(r.valid[static_cast<std::size_t>(k)]) << "a pinned copy lost validity";
        }
      }
      if (t.has_data) {
        ASSERT_GE(r.num_valid(), 1) << store_.spec(t.h).name << " lost its data";
      }
      if (!t.transient) {
        ASSERT_TRUE(r.allocated[static_cast<std::size_t>(t.home)]);
      }
    }
  }

  TieredStore& store_;
  std::span<std::byte> ranges_;
  std::vector<ModelTensor>& tensors_;
  Rng rng_;
  std::array<std::uint64_t, kNumTiers> budgets_;
  bool alone_;
  std::deque<Outstanding> outstanding_;
  std::map<Handle, void*> held_scratch_;
};

// Random tensors and budgets: every tensor fits each tier alone, not all of them at once.
std::vector<ModelTensor> make_tensors(TieredStore& store, Rng& rng, int n, std::size_t max_size,
                                      const std::string& prefix) {
  std::vector<ModelTensor> out;
  for (int i = 0; i < n; ++i) {
    ModelTensor t;
    t.size = 1 + rng.uniform_int(max_size);
    const auto kind = i < 2 ? 5 : rng.uniform_int(6);  // at least two scratch tensors
    t.transient = kind >= 4;
    t.scratch = kind == 5;
    t.home = kind == 0 ? Tier::kDevice : kind <= 2 ? Tier::kNvme : Tier::kHost;
    TensorSpec spec;
    spec.name = prefix + std::to_string(i);
    spec.size_bytes = t.size;
    spec.home = t.home;
    spec.transient = t.transient;
    spec.scratch = t.scratch;
    auto h = store.add(spec);
    if (!h.is_ok()) {
      // The budgets are random: a home may not fit next to the others. That is the one
      // registration error allowed here.
      EXPECT_EQ(h.status().code(), StatusCode::kOutOfMemory) << h.status().to_string();
      continue;
    }
    t.h = *h;
    if (!t.transient) {
      t.data = random_bytes(t.size, rng);
      EXPECT_TRUE(store.write(t.h, t.data.data(), t.size).is_ok());
      t.has_data = true;
    }
    out.push_back(std::move(t));
  }
  return out;
}

class StoreRandomTest : public ::testing::TestWithParam<int> {};

TEST_P(StoreRandomTest, MatchesTheModelAndNeverExceedsABudget) {
  const std::uint64_t seed = 1000 + static_cast<std::uint64_t>(GetParam());
  Rng rng(seed);
  const std::size_t max_size = 4096 + rng.uniform_int(40000);
  StoreOptions o;
  o.staging_buffer_bytes = 4096 * (1 + rng.uniform_int(4));
  o.direct_device_io = GetParam() % 2 == 0;  // staged chunks on odd seeds
  o.num_staging_buffers = 1 + static_cast<int>(rng.uniform_int(3));
  o.range_io_bytes = align_up(max_size, io::kIoAlignBytes);
  const std::uint64_t staging = o.staging_buffer_bytes * o.num_staging_buffers + o.range_io_bytes;
  // Between one and a few largest tensors per tier (host: plus the staging pool).
  o.budget_bytes = {max_size + rng.uniform_int(3 * max_size),
                    staging + 2 * max_size + 8192 + rng.uniform_int(4 * max_size),
                    rng.uniform_int(2) == 0 ? 0 : 20 * max_size};
  auto device = make_cpu_device();
  auto swap = make_memory_swap();
  auto store = TieredStore::create(*device, swap.get(), o);
  ASSERT_TRUE(store.is_ok()) << store.status().to_string();
  auto tensors = make_tensors(**store, rng, 10, max_size, "t");
  ASSERT_FALSE(tensors.empty());
  Driver driver(**store, (*store)->range_staging(), tensors, seed * 7, o.budget_bytes,
                /*alone=*/true);
  driver.run(kUnderTsan ? 1500 : 3000);
  const StoreStats st = (*store)->stats();
  EXPECT_GT(st.fetches, 0u);
  EXPECT_GT(st.evictions, 0u);  // the budgets really were tight
  EXPECT_EQ(st.failures, 0u);
  EXPECT_GT(driver.scratch_taken, 0u);
  EXPECT_GT(driver.scratch_refused, 0u);
}

INSTANTIATE_TEST_SUITE_P(Seeds, StoreRandomTest, ::testing::Range(0, 6));

// Two threads drive disjoint tensors of one store: their evictions and budgets interact, and
// the lanes run concurrently with both (ThreadSanitizer's case).
TEST(StoreConcurrency, TwoDriversShareOneStore) {
  Rng rng(77);
  StoreOptions o;
  o.staging_buffer_bytes = 8192;
  o.num_staging_buffers = 2;
  const std::size_t max_size = 30000;
  const std::size_t range_bytes = align_up(max_size, io::kIoAlignBytes);
  o.range_io_bytes = 2 * range_bytes;  // one part per driver
  o.budget_bytes = {4 * max_size, 16384 + o.range_io_bytes + 6 * max_size, 0};
  auto device = make_cpu_device();
  auto swap = make_memory_swap();
  auto store = TieredStore::create(*device, swap.get(), o);
  ASSERT_TRUE(store.is_ok());
  auto a = make_tensors(**store, rng, 6, max_size, "a");
  auto b = make_tensors(**store, rng, 6, max_size, "b");
  const std::span<std::byte> ranges = (*store)->range_staging();
  Driver da(**store, ranges.first(range_bytes), a, 1, o.budget_bytes, false);
  Driver db(**store, ranges.subspan(range_bytes), b, 2, o.budget_bytes, false);
  const int steps = kUnderTsan ? 1000 : 2000;
  std::thread other([&] { db.run(steps); });
  da.run(steps);
  other.join();
  EXPECT_EQ((*store)->stats().failures, 0u);
}

}  // namespace
}  // namespace strata::mem
