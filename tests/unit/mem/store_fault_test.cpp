// Swap faults (injected EIO on NVMe reads and writes) surface as errors, leave the store
// consistent (budgets released, staging buffers back) and never lose dirty data that had not
// been written.
#include <gtest/gtest.h>

#include "strata/core/aligned.h"
#include "strata/mem/tiered_store.h"
#include "tests/unit/mem/store_test_util.h"

namespace strata::mem {
namespace {

using testing::first_mismatch;
using testing::make_cpu_device;
using testing::make_memory_swap;
using testing::random_bytes;
using testing::small_options;

io::FaultInjection eio(io::FaultOp op, std::uint64_t skip = 0, std::uint64_t times = 1) {
  io::FaultRule r;
  r.op = op;
  r.kind = io::FaultKind::kError;
  r.error = EIO;
  r.skip = skip;
  r.times = times;
  io::FaultInjection f;
  f.rules.push_back(r);
  return f;
}

class StoreFaultTest : public ::testing::Test {
 protected:
  // One engine attempt per request (1 MiB blocks), so the rules count requests.
  // `direct`: NVMe <-> device without staging (one request per move) or in staged chunks.
  void make(io::FaultInjection faults, bool direct = false) {
    device_ = make_cpu_device();
    swap_ = make_memory_swap(std::move(faults), 1 << 20);
    StoreOptions o = small_options(0, 0);
    o.direct_device_io = direct;
    auto s = TieredStore::create(*device_, swap_.get(), o);
    ASSERT_TRUE(s.is_ok());
    store_ = std::move(*s);
    TensorSpec spec{"layer", 30000, Tier::kNvme};
    auto h = store_->add(spec);
    ASSERT_TRUE(h.is_ok());
    h_ = *h;
  }
  void check_consistent() {
    store_->drain();
    store_->trim_device_cache();
    // Nothing in flight, every buffer back: the device tier holds only resident copies.
    const Residency r = store_->residency(h_);
    EXPECT_FALSE(r.in_flight);
    if (r.allocated[0]) {
      EXPECT_GE(store_->usage(Tier::kDevice).reserved_bytes, 30000u);
    } else {
      EXPECT_EQ(store_->usage(Tier::kDevice).reserved_bytes, 0u);
    }
    EXPECT_EQ(store_->usage(Tier::kHost).reserved_bytes, store_->staging_bytes());
  }
  // Random contents in an aligned buffer: the store writes it to NVMe in one direct request.
  AlignedBuffer aligned(const std::vector<std::byte>& v) {
    AlignedBuffer b(align_up(v.size(), io::kIoAlignBytes));
    std::memcpy(b.data(), v.data(), v.size());
    return b;
  }
  Status write_direct(const std::vector<std::byte>& v) {
    AlignedBuffer b = aligned(v);
    return store_->write(h_, b.data(), b.size());
  }
  std::vector<std::byte> content() {
    std::vector<std::byte> v(30000);
    EXPECT_TRUE(store_->read(h_, v.data()).is_ok());
    return v;
  }

  std::unique_ptr<device::Device> device_;
  std::unique_ptr<io::SwapSpace> swap_;
  std::unique_ptr<TieredStore> store_;
  Handle h_ = Handle::kInvalid;
};

TEST_F(StoreFaultTest, FailedWriteBackKeepsTheDirtyCopy) {
  // Write #1 (the initial write) passes; the write-back's second chunk fails.
  make(eio(io::FaultOp::kWrite, /*skip=*/2));
  Rng rng(1);
  const auto first = random_bytes(30000, rng);
  ASSERT_TRUE(write_direct(first).is_ok());
  auto p = store_->acquire(h_, Tier::kDevice);
  ASSERT_TRUE(p.is_ok());
  const auto fresh = random_bytes(30000, rng);
  std::memcpy(*p, fresh.data(), fresh.size());
  store_->mark_dirty(h_, Tier::kDevice);
  store_->unpin(h_, Tier::kDevice);

  auto c = store_->evict(h_, Tier::kDevice);
  ASSERT_TRUE(c.is_ok());
  Status s = store_->wait(*c);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s.to_string();
  EXPECT_NE(s.message().find("'layer'"), std::string::npos) << s.message();
  check_consistent();
  const Residency r = store_->residency(h_);
  EXPECT_TRUE(r.valid[0]);
  EXPECT_TRUE(r.dirty);
  EXPECT_EQ(first_mismatch(content().data(), fresh.data(), 30000), -1);
  // The fault is gone: the retry saves the data.
  c = store_->evict(h_, Tier::kDevice);
  ASSERT_TRUE(c.is_ok());
  ASSERT_TRUE(store_->wait(*c).is_ok());
  EXPECT_FALSE(store_->residency(h_).dirty);
  EXPECT_EQ(first_mismatch(content().data(), fresh.data(), 30000), -1);
  check_consistent();
}

TEST_F(StoreFaultTest, FailedFetchReleasesItsDestinationAndCanBeRetried) {
  make(eio(io::FaultOp::kRead, /*skip=*/1));  // the fetch's second chunk fails
  Rng rng(2);
  const auto data = random_bytes(30000, rng);
  ASSERT_TRUE(write_direct(data).is_ok());
  auto c = store_->fetch(h_, Tier::kDevice);
  ASSERT_TRUE(c.is_ok());
  Status s = store_->wait(*c);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  check_consistent();
  EXPECT_FALSE(store_->residency(h_).allocated[0]);
  EXPECT_EQ(store_->stats().failures, 1u);
  auto p = store_->acquire(h_, Tier::kDevice);  // reported already: this one retries
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(first_mismatch(*p, data.data(), data.size()), -1);
  store_->unpin(h_, Tier::kDevice);
}

TEST_F(StoreFaultTest, FailedPrefetchIsReportedByTheNextAcquireOnce) {
  make(eio(io::FaultOp::kRead));
  Rng rng(3);
  const auto data = random_bytes(30000, rng);
  ASSERT_TRUE(write_direct(data).is_ok());
  auto c = store_->try_prefetch(h_, Tier::kDevice);
  ASSERT_TRUE(c.has_value());
  (void)c->wait();  // done, but nobody looked at the status through the store
  auto p = store_->acquire(h_, Tier::kDevice);
  ASSERT_FALSE(p.is_ok());
  EXPECT_EQ(p.status().code(), StatusCode::kIoError) << p.status().to_string();
  check_consistent();
  p = store_->acquire(h_, Tier::kDevice);
  ASSERT_TRUE(p.is_ok());
  EXPECT_EQ(first_mismatch(*p, data.data(), data.size()), -1);
  store_->unpin(h_, Tier::kDevice);
}

TEST_F(StoreFaultTest, FailedWriteLeavesNoStaleCopyBehind) {
  make(eio(io::FaultOp::kWrite, /*skip=*/1));
  Rng rng(4);
  const auto data = random_bytes(30000, rng);
  ASSERT_TRUE(write_direct(data).is_ok());
  ASSERT_TRUE(store_->acquire(h_, Tier::kDevice).is_ok());
  store_->unpin(h_, Tier::kDevice);
  const auto fresh = random_bytes(30000, rng);
  Status s = write_direct(fresh);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  // The old device copy must not be served as if it were the new data.
  const Residency r = store_->residency(h_);
  EXPECT_EQ(r.num_valid(), 0);
  EXPECT_FALSE(store_->acquire(h_, Tier::kDevice).is_ok());
  check_consistent();
}

TEST_F(StoreFaultTest, DirectDeviceReadAndWriteFailuresToo) {
  io::FaultInjection f = eio(io::FaultOp::kRead);                    // the first read fails
  f.rules.push_back(eio(io::FaultOp::kWrite, /*skip=*/1).rules[0]);  // and the second write
  make(std::move(f), /*direct=*/true);
  Rng rng(5);
  const auto data = random_bytes(30000, rng);
  ASSERT_TRUE(write_direct(data).is_ok());
  auto p = store_->acquire(h_, Tier::kDevice);  // the direct read fails
  ASSERT_FALSE(p.is_ok());
  EXPECT_EQ(p.status().code(), StatusCode::kIoError);
  check_consistent();
  p = store_->acquire(h_, Tier::kDevice);
  ASSERT_TRUE(p.is_ok()) << p.status().to_string();
  EXPECT_EQ(first_mismatch(*p, data.data(), data.size()), -1);
  const auto fresh = random_bytes(30000, rng);
  std::memcpy(*p, fresh.data(), fresh.size());
  store_->mark_dirty(h_, Tier::kDevice);
  store_->unpin(h_, Tier::kDevice);
  auto c = store_->evict(h_, Tier::kDevice);  // the direct write fails
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(store_->wait(*c).code(), StatusCode::kIoError);
  EXPECT_TRUE(store_->residency(h_).dirty);
  EXPECT_EQ(first_mismatch(content().data(), fresh.data(), 30000), -1);
}

}  // namespace
}  // namespace strata::mem
