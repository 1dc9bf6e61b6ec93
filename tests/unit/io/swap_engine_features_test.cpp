// Engine features on every engine: registered buffers, completion callbacks with bytes and
// elapsed time, poll, batched submission, and where callbacks run (driver or caller threads).
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "tests/unit/io/io_test_util.h"

namespace strata::io {
namespace {

using testing::first_mismatch;
using testing::make_options;
using testing::random_buffer;
using testing::TempDirs;

constexpr std::size_t kBlock = 64 * 1024;

class SwapFeatureTest : public ::testing::TestWithParam<std::string> {
 protected:
  SwapOptions options(int num_paths = 1) {
    dirs_ = std::make_unique<TempDirs>(num_paths);
    SwapOptions o = make_options(GetParam(), dirs_->paths());
    o.block_size_bytes = kBlock;
    return o;
  }
  bool is_uring() const { return GetParam().starts_with("uring"); }
  bool caller_driven() const { return GetParam().ends_with("_caller"); }
  std::unique_ptr<TempDirs> dirs_;
};

std::span<const std::span<std::byte>> one(const std::span<std::byte>& b) { return {&b, 1}; }

// Requests inside a registered pool go through fixed buffers on io_uring; requests outside it,
// or straddling its end, still work the ordinary way. Other engines accept and ignore the pool.
TEST_P(SwapFeatureTest, RegisteredBuffersRoundTrip) {
  const SwapOptions o = options(3);
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  Rng rng(11);
  AlignedBuffer pool(16 * kBlock);
  const std::span<std::byte> whole = pool.bytes();
  auto first = swap->register_buffers(one(whole));
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();

  auto e = swap->allocate(8 * kBlock, "pooled");
  ASSERT_TRUE(e.is_ok());
  AlignedBuffer data = random_buffer(8 * kBlock, rng);
  std::memcpy(pool.data(), data.data(), data.size());
  ASSERT_TRUE(swap->write(*e, 0, pool.data(), 8 * kBlock).wait().is_ok());
  ASSERT_TRUE(swap->read(*e, 0, pool.data() + 8 * kBlock, 8 * kBlock).wait().is_ok());
  EXPECT_EQ(first_mismatch(pool.data() + 8 * kBlock, data.data(), data.size()), -1);
  const std::uint64_t chunks = swap->stats().write_chunks + swap->stats().read_chunks;
  EXPECT_EQ(chunks, 16u);
  EXPECT_EQ(swap->stats().fixed_chunks, is_uring() ? chunks : 0u);

  // Outside the pool: ordinary requests, same bytes.
  AlignedBuffer outside(8 * kBlock);
  ASSERT_TRUE(swap->read(*e, 0, outside.data(), outside.size()).wait().is_ok());
  EXPECT_EQ(first_mismatch(outside.data(), data.data(), data.size()), -1);
  EXPECT_EQ(swap->stats().fixed_chunks, is_uring() ? chunks : 0u);

  // A second registration adds to the first: both pools go through fixed buffers.
  AlignedBuffer pool2(8 * kBlock);
  AlignedBuffer pool3(4 * kBlock);
  const std::span<std::byte> two[] = {pool2.bytes(), pool3.bytes()};
  auto second = swap->register_buffers(two);
  ASSERT_TRUE(second.is_ok()) << second.status().to_string();
  ASSERT_TRUE(swap->read(*e, 0, pool.data(), 8 * kBlock).wait().is_ok());
  ASSERT_TRUE(swap->read(*e, 0, pool2.data(), 8 * kBlock).wait().is_ok());
  ASSERT_TRUE(swap->read(*e, 4 * kBlock, pool3.data(), 4 * kBlock).wait().is_ok());
  EXPECT_EQ(first_mismatch(pool.data(), data.data(), 8 * kBlock), -1);
  EXPECT_EQ(first_mismatch(pool2.data(), data.data(), 8 * kBlock), -1);
  EXPECT_EQ(first_mismatch(pool3.data(), data.data() + 4 * kBlock, 4 * kBlock), -1);
  std::uint64_t fixed = chunks + 20;
  EXPECT_EQ(swap->stats().fixed_chunks, is_uring() ? fixed : 0u);

  // Releasing the first leaves the second registered; the first pool is ordinary memory again.
  first->reset();
  EXPECT_FALSE(first->active());
  ASSERT_TRUE(swap->read(*e, 0, pool.data(), 8 * kBlock).wait().is_ok());
  ASSERT_TRUE(swap->read(*e, 0, pool2.data(), 8 * kBlock).wait().is_ok());
  EXPECT_EQ(first_mismatch(pool.data(), data.data(), 8 * kBlock), -1);
  EXPECT_EQ(first_mismatch(pool2.data(), data.data(), 8 * kBlock), -1);
  fixed += 8;
  EXPECT_EQ(swap->stats().fixed_chunks, is_uring() ? fixed : 0u);

  // A moved registration still owns its buffers; destroying the last owner releases them.
  {
    BufferRegistration moved = std::move(*second);
    EXPECT_FALSE(second->active());
    EXPECT_TRUE(moved.active());
  }
  ASSERT_TRUE(swap->read(*e, 0, pool2.data(), 8 * kBlock).wait().is_ok());
  EXPECT_EQ(swap->stats().fixed_chunks, is_uring() ? fixed : 0u);
  EXPECT_EQ(swap->stats().errors, 0u);
}

TEST_P(SwapFeatureTest, CallbacksReportBytesAndTimeOnce) {
  const SwapOptions o = options();
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  Rng rng(12);
  constexpr int kRequests = 12;
  std::vector<Extent> extents;
  std::vector<AlignedBuffer> bufs;
  for (int i = 0; i < kRequests; ++i) {
    auto e = swap->allocate((i + 1) * kIoAlignBytes * 5, "cb");
    ASSERT_TRUE(e.is_ok());
    extents.push_back(*e);
    bufs.push_back(random_buffer(e->size_bytes, rng));
  }
  std::vector<std::atomic<int>> calls(kRequests);
  std::vector<IoCompletion> seen(kRequests);
  std::mutex mu;
  const std::thread::id self = std::this_thread::get_id();
  std::atomic<int> on_caller_thread{0};
  std::vector<IoHandle> handles;
  for (int i = 0; i < kRequests; ++i) {
    handles.push_back(
        swap->write(extents[i], 0, bufs[i].data(), bufs[i].size(), [&, i](const IoCompletion& c) {
          calls[i].fetch_add(1);
          if (std::this_thread::get_id() == self) ++on_caller_thread;
          std::lock_guard lock(mu);
          seen[i] = c;
        }));
  }
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(handles[i].wait().is_ok());
    // The callback has run by the time wait() returns.
    EXPECT_EQ(calls[i].load(), 1) << i;
    std::lock_guard lock(mu);
    EXPECT_TRUE(seen[i].status.is_ok());
    EXPECT_EQ(seen[i].op, IoOp::kWrite);
    EXPECT_EQ(seen[i].bytes, bufs[i].size());
    EXPECT_GT(seen[i].elapsed_s, 0.0);
    EXPECT_EQ(handles[i].bytes(), bufs[i].size());
    EXPECT_DOUBLE_EQ(handles[i].elapsed_s(), seen[i].elapsed_s);
  }
  // Caller-driven rings run callbacks in the threads that drive them: here, this one.
  if (caller_driven()) {
    EXPECT_EQ(on_caller_thread.load(), kRequests);
  } else if (GetParam() != "memory") {
    EXPECT_EQ(on_caller_thread.load(), 0);
  }
  for (auto& c : calls) EXPECT_EQ(c.load(), 1);

  // A request rejected up front calls back at once, inside write().
  int rejected_calls = 0;
  Status rejected_status;
  IoHandle bad =
      swap->write(extents[0], 100, bufs[0].data(), kIoAlignBytes, [&](const IoCompletion& c) {
        ++rejected_calls;
        rejected_status = c.status;
      });
  EXPECT_EQ(rejected_calls, 1);
  EXPECT_EQ(rejected_status.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(bad.done());
  EXPECT_EQ(bad.bytes(), 0u);
}

// Each completion submits the next request from inside its callback, as io-bench does.
TEST_P(SwapFeatureTest, CallbacksMaySubmitMoreRequests) {
  const SwapOptions o = options(2);
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  Rng rng(13);
  constexpr int kChain = 40;
  auto e = swap->allocate(kChain * kBlock, "chain");
  ASSERT_TRUE(e.is_ok());
  AlignedBuffer data = random_buffer(e->size_bytes, rng);
  std::mutex mu;
  IoHandle latest;  // the newest request's handle, which is the one still to finish
  int latest_index = -1;
  std::atomic<int> finished{0};
  std::function<void(int)> issue = [&](int i) {
    IoHandle h = swap->write(*e, i * kBlock, data.data() + i * kBlock, kBlock,
                             [&, i](const IoCompletion& c) {
                               EXPECT_TRUE(c.status.is_ok()) << c.status.to_string();
                               finished.fetch_add(1);
                               if (i + 1 < kChain) issue(i + 1);
                             });
    std::lock_guard lock(mu);
    if (i > latest_index) {
      latest = h;
      latest_index = i;
    }
  };
  issue(0);
  while (finished.load() < kChain) {
    IoHandle h;
    {
      std::lock_guard lock(mu);
      h = latest;
    }
    // Waiting drives caller-driven rings; other engines make progress on their own.
    h.wait().ignore();
    if (finished.load() < kChain) std::this_thread::yield();
  }
  AlignedBuffer back(e->size_bytes);
  ASSERT_TRUE(swap->read(*e, 0, back.data(), back.size()).wait().is_ok());
  EXPECT_EQ(first_mismatch(back.data(), data.data(), back.size()), -1);
}

TEST_P(SwapFeatureTest, PollFinishesWithoutWait) {
  const SwapOptions o = options();
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  Rng rng(14);
  auto e = swap->allocate(4 * kBlock, "poll");
  ASSERT_TRUE(e.is_ok());
  AlignedBuffer data = random_buffer(e->size_bytes, rng);
  IoHandle h = swap->write(*e, 0, data.data(), data.size());
  while (!h.poll()) {
  }
  EXPECT_TRUE(h.done());
  EXPECT_EQ(h.bytes(), data.size());
  IoHandle empty;
  EXPECT_TRUE(empty.poll());
}

TEST_P(SwapFeatureTest, SubmitBatchKeepsOrderAndRejectsOnlyTheBadOne) {
  const SwapOptions o = options(3);
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  Rng rng(15);
  constexpr int kN = 10;
  std::vector<Extent> extents;
  std::vector<AlignedBuffer> data;
  std::vector<IoRequest> writes;
  for (int i = 0; i < kN; ++i) {
    auto e = swap->allocate((1 + rng.uniform_int(40)) * kIoAlignBytes, "batch");
    ASSERT_TRUE(e.is_ok());
    extents.push_back(*e);
    data.push_back(random_buffer(e->size_bytes, rng));
    writes.push_back({IoOp::kWrite, *e, 0, data.back().data(), e->size_bytes, {}});
  }
  writes[4].offset_in_extent = 512;  // misaligned: rejected, the rest go ahead
  std::vector<IoHandle> handles = swap->submit_batch(writes);
  ASSERT_EQ(handles.size(), static_cast<std::size_t>(kN));
  for (int i = 0; i < kN; ++i) {
    const Status s = handles[i].wait();
    EXPECT_EQ(s.is_ok(), i != 4) << i << ": " << s.to_string();
  }
  ASSERT_TRUE(swap->write(extents[4], 0, data[4].data(), data[4].size()).wait().is_ok());
  std::vector<AlignedBuffer> back;
  std::vector<IoRequest> reads;
  for (int i = 0; i < kN; ++i) {
    back.emplace_back(extents[i].size_bytes);
    reads.push_back({IoOp::kRead, extents[i], 0, back.back().data(), extents[i].size_bytes, {}});
  }
  handles = swap->submit_batch(reads);
  for (int i = 0; i < kN; ++i) {
    ASSERT_TRUE(handles[i].wait().is_ok()) << i;
    EXPECT_EQ(first_mismatch(back[i].data(), data[i].data(), back[i].size()), -1) << i;
  }
  EXPECT_TRUE(swap->submit_batch({}).empty());
}

INSTANTIATE_TEST_SUITE_P(Engines, SwapFeatureTest,
                         ::testing::Values("uring", "uring_caller", "uring_4rings",
                                           "uring_2rings_caller", "posix", "memory"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

// Several threads waiting on requests of one caller-driven swap space take turns driving it.
TEST(SwapCallerDrivenTest, ManyWaitingThreadsShareTheRings) {
  TempDirs dirs(2);
  SwapOptions o = make_options("uring_2rings_caller", dirs.paths());
  o.queue_depth = 2;
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  constexpr int kThreads = 4;
  std::vector<int> failures(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Rng rng(100 + t);
      for (int i = 0; i < 20; ++i) {
        const std::uint64_t size = (1 + rng.uniform_int(40)) * kIoAlignBytes;
        auto e = swap->allocate(size, "shared");
        if (!e.is_ok()) {
          ++failures[t];
          continue;
        }
        AlignedBuffer data = random_buffer(size, rng);
        AlignedBuffer back(size);
        IoHandle w = swap->write(*e, 0, data.data(), size);
        if (i % 2 == 0) {
          while (!w.poll()) {
          }
        }
        if (!w.wait().is_ok()) ++failures[t];
        if (!swap->read(*e, 0, back.data(), size).wait().is_ok()) ++failures[t];
        if (first_mismatch(back.data(), data.data(), size) != -1) ++failures[t];
        swap->free(*e);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], 0) << "thread " << t;
}

}  // namespace
}  // namespace strata::io
