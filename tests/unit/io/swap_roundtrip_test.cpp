// Swap space round trips on every engine with one and three paths: random data, byte-exact.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <thread>
#include <vector>

#include "tests/unit/io/io_test_util.h"

namespace strata::io {
namespace {

using testing::first_mismatch;
using testing::make_options;
using testing::random_buffer;
using testing::TempDirs;

struct EngineParam {
  std::string engine;
  int num_paths;
};

std::string param_name(const ::testing::TestParamInfo<EngineParam>& info) {
  return info.param.engine + "_" + std::to_string(info.param.num_paths) + "paths";
}

std::string expected_engine_name(const std::string& engine) {
  return engine.starts_with("uring") ? "io_uring" : engine;
}

class SwapRoundTripTest : public ::testing::TestWithParam<EngineParam> {
 protected:
  SwapOptions options() {
    dirs_ = std::make_unique<TempDirs>(GetParam().num_paths);
    return make_options(GetParam().engine, dirs_->paths());
  }
  std::unique_ptr<TempDirs> dirs_;  // outlives the swap space declared in each test body
};

struct Item {
  Extent extent;
  AlignedBuffer mirror;  // what the extent should hold
};

TEST_P(SwapRoundTripTest, RandomSizesAndOffsets) {
  Rng rng(1000 + GetParam().num_paths);
  const SwapOptions o = options();
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  EXPECT_EQ(swap->engine_name(), expected_engine_name(GetParam().engine));

  std::vector<Item> items;
  std::uint64_t total = 0;
  for (int i = 0; i < 24; ++i) {
    const std::uint64_t size = 1 + rng.uniform_int(300 * 1024);  // rounded up to 4096
    auto e = swap->allocate(size, "tensor" + std::to_string(i));
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    EXPECT_EQ(e->size_bytes % kIoAlignBytes, 0u);
    EXPECT_GE(e->size_bytes, size);
    items.push_back({*e, random_buffer(e->size_bytes, rng)});
    total += e->size_bytes;
  }
  EXPECT_EQ(swap->used_bytes(), total);
  EXPECT_GE(swap->capacity_bytes(), total);

  // All writes in flight at once.
  std::vector<IoHandle> handles;
  for (Item& it : items) {
    handles.push_back(swap->write(it.extent, 0, it.mirror.data(), it.extent.size_bytes));
  }
  for (IoHandle& h : handles) ASSERT_TRUE(h.wait().is_ok());

  // Random aligned overwrites inside extents, each waited so overlapping ones keep their order.
  for (int i = 0; i < 40; ++i) {
    Item& it = items[rng.uniform_int(items.size())];
    const std::uint64_t blocks = it.extent.size_bytes / kIoAlignBytes;
    const std::uint64_t first = rng.uniform_int(blocks);
    const std::uint64_t count = 1 + rng.uniform_int(blocks - first);
    AlignedBuffer data = random_buffer(count * kIoAlignBytes, rng);
    Status s = swap->write(it.extent, first * kIoAlignBytes, data.data(), data.size()).wait();
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    std::memcpy(it.mirror.data() + first * kIoAlignBytes, data.data(), data.size());
  }

  // Random partial reads, all in flight together.
  struct Probe {
    std::size_t item;
    std::uint64_t offset;
    AlignedBuffer buf;
  };
  std::vector<Probe> probes;
  handles.clear();
  for (int i = 0; i < 60; ++i) {
    const std::size_t idx = rng.uniform_int(items.size());
    const std::uint64_t blocks = items[idx].extent.size_bytes / kIoAlignBytes;
    const std::uint64_t first = rng.uniform_int(blocks);
    const std::uint64_t count = 1 + rng.uniform_int(blocks - first);
    probes.push_back({idx, first * kIoAlignBytes, AlignedBuffer(count * kIoAlignBytes)});
  }
  for (Probe& p : probes) {
    handles.push_back(swap->read(items[p.item].extent, p.offset, p.buf.data(), p.buf.size()));
  }
  for (std::size_t i = 0; i < probes.size(); ++i) {
    ASSERT_TRUE(handles[i].wait().is_ok());
    EXPECT_TRUE(handles[i].done());
    const Probe& p = probes[i];
    EXPECT_EQ(first_mismatch(p.buf.data(), items[p.item].mirror.data() + p.offset, p.buf.size()),
              -1)
        << "probe " << i;
  }

  // Whole extents.
  for (Item& it : items) {
    AlignedBuffer back(it.extent.size_bytes);
    ASSERT_TRUE(swap->read(it.extent, 0, back.data(), back.size()).wait().is_ok());
    EXPECT_EQ(first_mismatch(back.data(), it.mirror.data(), back.size()), -1);
  }

  const IoStats st = swap->stats();
  EXPECT_EQ(st.writes, 24u + 40u);
  EXPECT_EQ(st.reads, 60u + 24u);
  EXPECT_GE(st.bytes_written, total);
  EXPECT_GE(st.write_chunks, st.writes);
  EXPECT_GE(st.read_chunks, st.reads);
  EXPECT_EQ(st.errors, 0u);
  EXPECT_GT(st.write_busy_s, 0.0);
  EXPECT_GT(st.read_busy_s, 0.0);
}

TEST_P(SwapRoundTripTest, ManyOutstandingRequests) {
  Rng rng(2000 + GetParam().num_paths);
  SwapOptions o = options();
  o.queue_depth = 4;  // far fewer slots than requests: the engine must queue the rest
  o.block_size_bytes = 16 * 1024;
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);

  constexpr int kRequests = 256;
  std::vector<Item> items;
  for (int i = 0; i < kRequests; ++i) {
    const std::uint64_t size = (1 + rng.uniform_int(16)) * kIoAlignBytes;
    auto e = swap->allocate(size, "many");
    ASSERT_TRUE(e.is_ok());
    items.push_back({*e, random_buffer(size, rng)});
  }
  std::vector<IoHandle> handles;
  for (Item& it : items) {
    handles.push_back(swap->write(it.extent, 0, it.mirror.data(), it.extent.size_bytes));
  }
  for (IoHandle& h : handles) ASSERT_TRUE(h.wait().is_ok());
  std::vector<AlignedBuffer> backs;
  handles.clear();
  for (Item& it : items) {
    backs.emplace_back(it.extent.size_bytes);
    handles.push_back(swap->read(it.extent, 0, backs.back().data(), it.extent.size_bytes));
  }
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(handles[i].wait().is_ok());
    ASSERT_EQ(first_mismatch(backs[i].data(), items[i].mirror.data(), backs[i].size()), -1)
        << "request " << i;
  }
}

// Several threads allocate, write, read back and free at the same time.
TEST_P(SwapRoundTripTest, ConcurrentSubmitters) {
  const SwapOptions o = options();
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  constexpr int kThreads = 4;
  std::vector<std::thread> threads;
  std::vector<int> failures(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Rng rng(3000 + t);
      for (int i = 0; i < 25; ++i) {
        const std::uint64_t size = (1 + rng.uniform_int(48)) * kIoAlignBytes;
        auto e = swap->allocate(size, "thread");
        if (!e.is_ok()) {
          ++failures[t];
          continue;
        }
        AlignedBuffer data = random_buffer(size, rng);
        AlignedBuffer back(size);
        if (!swap->write(*e, 0, data.data(), size).wait().is_ok()) ++failures[t];
        if (!swap->read(*e, 0, back.data(), size).wait().is_ok()) ++failures[t];
        if (first_mismatch(back.data(), data.data(), size) != -1) ++failures[t];
        swap->free(*e);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], 0) << "thread " << t;
  EXPECT_EQ(swap->used_bytes(), 0u);
}

// A training loop allocates the same tensors every step and frees them: space must be reused,
// not grown, and the same sizes land at the same offsets.
TEST_P(SwapRoundTripTest, TrainingLoopReusesSpace) {
  Rng rng(4000);
  const SwapOptions o = options();
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  std::vector<std::uint64_t> sizes;
  for (int i = 0; i < 12; ++i) sizes.push_back(1 + rng.uniform_int(200 * 1024));

  std::vector<Extent> first_step;
  std::uint64_t capacity_after_first = 0;
  for (int step = 0; step < 8; ++step) {
    std::vector<Extent> extents;
    for (std::uint64_t s : sizes) {
      auto e = swap->allocate(s, "step tensor");
      ASSERT_TRUE(e.is_ok());
      extents.push_back(*e);
    }
    // Touch one tensor so I/O interleaves with allocation.
    AlignedBuffer data = random_buffer(extents[step % 12].size_bytes, rng);
    ASSERT_TRUE(swap->write(extents[step % 12], 0, data.data(), data.size()).wait().is_ok());
    // Free in an order that differs from allocation, with a reallocation in between.
    for (std::size_t i = 1; i < extents.size(); i += 2) swap->free(extents[i]);
    auto moment = swap->allocate(sizes[1], "moment");
    ASSERT_TRUE(moment.is_ok());
    swap->free(*moment);
    for (std::size_t i = 0; i < extents.size(); i += 2) swap->free(extents[i]);
    EXPECT_EQ(swap->used_bytes(), 0u);
    if (step == 0) {
      first_step = extents;
      capacity_after_first = swap->capacity_bytes();
    } else {
      EXPECT_EQ(swap->capacity_bytes(), capacity_after_first) << "step " << step;
      for (std::size_t i = 0; i < extents.size(); ++i) {
        EXPECT_EQ(extents[i].offset, first_step[i].offset) << "step " << step << " tensor " << i;
      }
    }
  }
}

TEST_P(SwapRoundTripTest, EmptyRequestsAndHandles) {
  const SwapOptions o = options();
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  IoHandle empty;
  EXPECT_FALSE(empty.valid());
  EXPECT_TRUE(empty.done());
  EXPECT_TRUE(empty.wait().is_ok());
  auto e = swap->allocate(kIoAlignBytes, "x");
  ASSERT_TRUE(e.is_ok());
  AlignedBuffer buf(kIoAlignBytes);
  IoHandle h = swap->write(*e, 0, buf.data(), 0);
  EXPECT_TRUE(h.valid());
  EXPECT_TRUE(h.wait().is_ok());
  auto zero = swap->allocate(0, "nothing");
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
}

// Destroying the swap space with requests in flight finishes them first; handles stay usable.
TEST_P(SwapRoundTripTest, DestructionWaitsForInFlightRequests) {
  Rng rng(5000);
  SwapOptions o = options();
  o.queue_depth = 2;
  std::vector<IoHandle> handles;
  std::vector<AlignedBuffer> buffers;
  {
    STRATA_CREATE_SWAP_OR_SKIP(swap, o);
    for (int i = 0; i < 32; ++i) {
      auto e = swap->allocate(64 * 1024, "t");
      ASSERT_TRUE(e.is_ok());
      buffers.push_back(random_buffer(64 * 1024, rng));
      handles.push_back(swap->write(*e, 0, buffers.back().data(), 64 * 1024));
    }
  }
  for (IoHandle& h : handles) {
    EXPECT_TRUE(h.done());
    EXPECT_TRUE(h.wait().is_ok());
  }
  if (GetParam().engine != "memory") {
    for (const std::string& p : dirs_->paths()) {
      EXPECT_TRUE(std::filesystem::is_empty(p)) << p << " still holds swap or lock files";
    }
  }
}

TEST_P(SwapRoundTripTest, InitialCapacityIsPreallocated) {
  SwapOptions o = options();
  o.initial_capacity_bytes = 1000 * 1000;
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  const std::uint64_t row = o.block_size_bytes * o.paths.size();
  EXPECT_EQ(swap->capacity_bytes(), (o.initial_capacity_bytes + row - 1) / row * row);
  if (GetParam().engine != "memory") {
    for (const std::string& p : dirs_->paths()) {
      const std::string file = p + "/strata-" + std::to_string(::getpid()) + ".swap";
      struct stat st {};
      ASSERT_EQ(::stat(file.c_str(), &st), 0) << file;
      EXPECT_EQ(static_cast<std::uint64_t>(st.st_size), swap->capacity_bytes() / o.paths.size());
      EXPECT_GE(static_cast<std::uint64_t>(st.st_blocks) * 512,
                swap->capacity_bytes() / o.paths.size())
          << "fallocate should have reserved the blocks";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Engines, SwapRoundTripTest,
                         ::testing::Values(EngineParam{"uring", 1}, EngineParam{"uring", 3},
                                           EngineParam{"uring_caller", 1},
                                           EngineParam{"uring_4rings", 3},
                                           EngineParam{"uring_2rings_caller", 3},
                                           EngineParam{"uring_sqpoll", 1}, EngineParam{"posix", 1},
                                           EngineParam{"posix", 3}, EngineParam{"memory", 1},
                                           EngineParam{"memory", 3}),
                         param_name);

// The documented RAID-0 layout, checked against the bytes in the files themselves.
TEST(SwapStripingTest, UnitsAreDealtRoundRobinOverFiles) {
  for (const std::string engine : {"uring", "posix"}) {
    SCOPED_TRACE(engine);
    TempDirs dirs(3);
    SwapOptions o = make_options(engine, dirs.paths());
    auto created = SwapSpace::create(o);
    if (!created.is_ok() && engine == "uring") continue;  // covered by the skip elsewhere
    ASSERT_TRUE(created.is_ok()) << created.status().to_string();
    auto swap = std::move(created).value();
    const std::uint64_t unit = o.block_size_bytes;
    Rng rng(6000);
    auto e = swap->allocate(7 * unit, "striped");
    ASSERT_TRUE(e.is_ok());
    ASSERT_EQ(e->offset, 0u);
    AlignedBuffer data = random_buffer(7 * unit, rng);
    ASSERT_TRUE(swap->write(*e, 0, data.data(), data.size()).wait().is_ok());
    for (std::uint64_t u = 0; u < 7; ++u) {
      const std::string file = o.paths[u % 3] + "/strata-" + std::to_string(::getpid()) + ".swap";
      const int fd = ::open(file.c_str(), O_RDONLY);
      ASSERT_GE(fd, 0) << file;
      std::vector<std::byte> raw(unit);
      const ssize_t n = ::pread(fd, raw.data(), unit, static_cast<off_t>((u / 3) * unit));
      ::close(fd);
      ASSERT_EQ(n, static_cast<ssize_t>(unit));
      EXPECT_EQ(first_mismatch(raw.data(), data.data() + u * unit, unit), -1) << "unit " << u;
    }
  }
}

}  // namespace
}  // namespace strata::io
