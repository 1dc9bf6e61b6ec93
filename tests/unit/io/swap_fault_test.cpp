// Fault injection through every engine: short transfers completed, errors surfaced with context,
// transient errors retried, the engine usable afterwards; and misaligned requests rejected.
#include <gtest/gtest.h>
#include <unistd.h>

#include <memory>
#include <string>
#include <vector>

#include "tests/unit/io/io_test_util.h"

namespace strata::io {
namespace {

using testing::first_mismatch;
using testing::make_options;
using testing::random_buffer;
using testing::TempDirs;

constexpr std::size_t kFaultBlock = 64 * 1024;

class SwapFaultTest : public ::testing::TestWithParam<std::string> {
 protected:
  SwapOptions options(std::vector<FaultRule> rules, int num_paths = 1) {
    dirs_ = std::make_unique<TempDirs>(num_paths);
    SwapOptions o = make_options(GetParam(), dirs_->paths());
    o.block_size_bytes = kFaultBlock;
    o.fault_injection.rules = std::move(rules);
    return o;
  }
  // The name the engine gives file `i` in messages.
  std::string file_name(int i) const {
    if (GetParam() == "memory") return "memory:" + dirs_->paths()[i];
    return dirs_->paths()[i] + "/strata-" + std::to_string(::getpid()) + ".swap";
  }
  std::unique_ptr<TempDirs> dirs_;
};

FaultRule rule(FaultOp op, FaultKind kind, int error = EIO) {
  FaultRule r;
  r.op = op;
  r.kind = kind;
  r.error = error;
  return r;
}

// Writes `data` to the extent, then reads it back and compares.
void expect_round_trip(SwapSpace& swap, const Extent& e, const AlignedBuffer& data) {
  ASSERT_TRUE(swap.write(e, 0, data.data(), data.size()).wait().is_ok());
  AlignedBuffer back(data.size());
  ASSERT_TRUE(swap.read(e, 0, back.data(), back.size()).wait().is_ok());
  EXPECT_EQ(first_mismatch(back.data(), data.data(), data.size()), -1);
}

TEST_P(SwapFaultTest, ShortWriteIsCompleted) {
  const SwapOptions o = options({rule(FaultOp::kWrite, FaultKind::kShort)});
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  Rng rng(1);
  auto e = swap->allocate(4 * kFaultBlock, "short");
  ASSERT_TRUE(e.is_ok());
  AlignedBuffer data = random_buffer(4 * kFaultBlock, rng);
  expect_round_trip(*swap, *e, data);
  const IoStats st = swap->stats();
  EXPECT_EQ(st.faults_injected, 1u);
  EXPECT_GE(st.retries, 1u);
  EXPECT_EQ(st.errors, 0u);
  EXPECT_EQ(st.bytes_written, 4 * kFaultBlock);
}

TEST_P(SwapFaultTest, ShortReadsAreCompleted) {
  FaultRule r = rule(FaultOp::kRead, FaultKind::kShort);
  r.times = 3;  // three attempts come back half done; their remainders are resubmitted
  const SwapOptions o = options({r});
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  Rng rng(2);
  auto e = swap->allocate(2 * kFaultBlock, "short read");
  ASSERT_TRUE(e.is_ok());
  AlignedBuffer data = random_buffer(2 * kFaultBlock, rng);
  expect_round_trip(*swap, *e, data);
  EXPECT_EQ(swap->stats().faults_injected, 3u);
  EXPECT_GE(swap->stats().retries, 3u);
}

TEST_P(SwapFaultTest, EioSurfacesWithPathAndOffsetAndOtherDataIsIntact) {
  // A comes first at swap offset 0, B after it; the second block of B fails once.
  const std::uint64_t b_offset = 2 * kFaultBlock;
  FaultRule r = rule(FaultOp::kWrite, FaultKind::kError, EIO);
  r.swap_offset_begin = b_offset + kFaultBlock;
  r.swap_offset_end = b_offset + 2 * kFaultBlock;
  const SwapOptions o = options({r});
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  Rng rng(3);
  auto a = swap->allocate(2 * kFaultBlock, "A");
  auto b = swap->allocate(4 * kFaultBlock, "B");
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  ASSERT_EQ(b->offset, b_offset);
  AlignedBuffer a_data = random_buffer(a->size_bytes, rng);
  AlignedBuffer b_data = random_buffer(b->size_bytes, rng);
  ASSERT_TRUE(swap->write(*a, 0, a_data.data(), a_data.size()).wait().is_ok());

  const Status s = swap->write(*b, 0, b_data.data(), b_data.size()).wait();
  ASSERT_EQ(s.code(), StatusCode::kIoError) << s.to_string();
  const std::string expected = "write of 65536 bytes at offset " +
                               std::to_string(b_offset + kFaultBlock) + " to " + file_name(0) +
                               " failed: Input/output error";
  EXPECT_EQ(s.message(), expected);

  // A is untouched and B's other blocks were written.
  AlignedBuffer back(a->size_bytes);
  ASSERT_TRUE(swap->read(*a, 0, back.data(), back.size()).wait().is_ok());
  EXPECT_EQ(first_mismatch(back.data(), a_data.data(), back.size()), -1);
  for (std::uint64_t blk : {0, 2, 3}) {
    AlignedBuffer part(kFaultBlock);
    ASSERT_TRUE(swap->read(*b, blk * kFaultBlock, part.data(), kFaultBlock).wait().is_ok());
    EXPECT_EQ(first_mismatch(part.data(), b_data.data() + blk * kFaultBlock, kFaultBlock), -1)
        << blk;
  }
  // The engine keeps working: the same write now succeeds.
  expect_round_trip(*swap, *b, b_data);
  const IoStats st = swap->stats();
  EXPECT_EQ(st.errors, 1u);
  EXPECT_EQ(st.faults_injected, 1u);
}

TEST_P(SwapFaultTest, EioOnStripedReadNamesTheRightFile) {
  // Three files: swap unit 4 lives in file 4 % 3 = 1 at file offset (4 / 3) * kFaultBlock.
  FaultRule r = rule(FaultOp::kRead, FaultKind::kError, EIO);
  r.swap_offset_begin = 4 * kFaultBlock;
  r.swap_offset_end = 5 * kFaultBlock;
  const SwapOptions o = options({r}, 3);
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  Rng rng(4);
  auto e = swap->allocate(6 * kFaultBlock, "striped");
  ASSERT_TRUE(e.is_ok());
  AlignedBuffer data = random_buffer(e->size_bytes, rng);
  ASSERT_TRUE(swap->write(*e, 0, data.data(), data.size()).wait().is_ok());
  AlignedBuffer back(e->size_bytes);
  const Status s = swap->read(*e, 0, back.data(), back.size()).wait();
  EXPECT_EQ(s.message(), "read of 65536 bytes at offset " + std::to_string(kFaultBlock) + " from " +
                             file_name(1) + " failed: Input/output error");
}

TEST_P(SwapFaultTest, EnospcOnWriteIsReported) {
  const SwapOptions o = options({rule(FaultOp::kWrite, FaultKind::kError, ENOSPC)});
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  Rng rng(5);
  auto e = swap->allocate(kFaultBlock, "full");
  ASSERT_TRUE(e.is_ok());
  AlignedBuffer data = random_buffer(kFaultBlock, rng);
  const Status s = swap->write(*e, 0, data.data(), data.size()).wait();
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_EQ(s.message(), "write of 65536 bytes at offset 0 to " + file_name(0) +
                             " failed: No space left on device");
}

TEST_P(SwapFaultTest, GrowthEnospcIsOutOfMemoryNamingTheDirectory) {
  FaultRule r = rule(FaultOp::kGrow, FaultKind::kError, ENOSPC);
  const SwapOptions o = options({r});
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  auto e = swap->allocate(1 << 20, "layer0.adam_m");
  ASSERT_EQ(e.status().code(), StatusCode::kOutOfMemory) << e.status().to_string();
  const std::string& msg = e.status().message();
  EXPECT_NE(msg.find("layer0.adam_m"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1048576 bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("No space left on device"), std::string::npos) << msg;
  if (GetParam() == "memory") {
    EXPECT_NE(msg.find("in-memory swap is exhausted"), std::string::npos) << msg;
  } else {
    EXPECT_NE(msg.find("swap directory " + dirs_->paths()[0] + " is full"), std::string::npos)
        << msg;
    EXPECT_NE(msg.find("free there"), std::string::npos) << msg;
  }
  EXPECT_EQ(swap->capacity_bytes(), 0u);
  // The rule fired once; the next allocation grows normally.
  auto again = swap->allocate(1 << 20, "layer0.adam_m");
  EXPECT_TRUE(again.is_ok()) << again.status().to_string();
}

TEST_P(SwapFaultTest, TransientErrorsAreRetried) {
  FaultRule again = rule(FaultOp::kAny, FaultKind::kError, EAGAIN);
  again.times = 3;
  FaultRule intr = rule(FaultOp::kAny, FaultKind::kError, EINTR);
  intr.times = 2;
  const SwapOptions o = options({again, intr});
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  Rng rng(6);
  auto e = swap->allocate(3 * kFaultBlock, "retry");
  ASSERT_TRUE(e.is_ok());
  AlignedBuffer data = random_buffer(e->size_bytes, rng);
  expect_round_trip(*swap, *e, data);
  const IoStats st = swap->stats();
  EXPECT_EQ(st.faults_injected, 5u);
  EXPECT_EQ(st.retries, 5u);
  EXPECT_EQ(st.errors, 0u);
}

TEST_P(SwapFaultTest, EndlessEagainGivesUp) {
  FaultRule r = rule(FaultOp::kWrite, FaultKind::kError, EAGAIN);
  r.times = FaultRule::kForever;
  const SwapOptions o = options({r});
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  auto e = swap->allocate(kFaultBlock, "stuck");
  ASSERT_TRUE(e.is_ok());
  AlignedBuffer data(kFaultBlock);
  const Status s = swap->write(*e, 0, data.data(), data.size()).wait();
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("still failing after"), std::string::npos) << s.message();
}

TEST_P(SwapFaultTest, NthChunkFails) {
  FaultRule r = rule(FaultOp::kWrite, FaultKind::kError, EIO);
  r.skip = 2;  // the third chunk
  SwapOptions o = options({r});
  o.queue_depth = 1;  // one chunk at a time, so "third" is well defined on every engine
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  Rng rng(7);
  auto e = swap->allocate(4 * kFaultBlock, "nth");
  ASSERT_TRUE(e.is_ok());
  AlignedBuffer data = random_buffer(e->size_bytes, rng);
  const Status s = swap->write(*e, 0, data.data(), data.size()).wait();
  EXPECT_EQ(s.message(), "write of 65536 bytes at offset " + std::to_string(2 * kFaultBlock) +
                             " to " + file_name(0) + " failed: Input/output error");
}

TEST_P(SwapFaultTest, MisalignedRequestsAreRejected) {
  const SwapOptions o = options({});
  STRATA_CREATE_SWAP_OR_SKIP(swap, o);
  auto e = swap->allocate(4 * kIoAlignBytes, "aligned");
  ASSERT_TRUE(e.is_ok());
  AlignedBuffer buf(8 * kIoAlignBytes);

  Status s = swap->write(*e, 4097, buf.data(), kIoAlignBytes).wait();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "offset 4097 is not aligned to 4096 for O_DIRECT on " + file_name(0) +
                             "; use offsets that are multiples of 4096");

  s = swap->read(*e, 0, buf.data(), 1000).wait();
  EXPECT_EQ(s.message(), "size 1000 bytes is not aligned to 4096 for O_DIRECT on " + file_name(0) +
                             "; use sizes that are multiples of 4096");

  s = swap->read(*e, 0, buf.data() + 512, kIoAlignBytes).wait();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("buffer address 0x"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("is not aligned to 4096"), std::string::npos) << s.message();

  s = swap->write(*e, 2 * kIoAlignBytes, buf.data(), 4 * kIoAlignBytes).wait();
  EXPECT_EQ(s.message(),
            "write of 16384 bytes at offset 8192 runs past the end of its extent of 16384 bytes");

  swap->free(*e);
  s = swap->read(*e, 0, buf.data(), kIoAlignBytes).wait();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("not allocated"), std::string::npos) << s.message();

  EXPECT_EQ(swap->stats().errors, 5u);
  EXPECT_EQ(swap->stats().reads + swap->stats().writes, 0u);
}

INSTANTIATE_TEST_SUITE_P(Engines, SwapFaultTest,
                         ::testing::Values("uring", "uring_caller", "posix", "memory"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace strata::io
