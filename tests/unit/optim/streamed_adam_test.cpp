// StreamedAdam: the NVMe-streamed step gives exactly the bytes of the in-memory step for every
// sub_group_size (dividing the segments or not) and staging depth, over every swap engine; NaN
// segments are skipped without I/O; injected EIO surfaces as an error naming the segment.
#include "strata/optim/streamed_adam.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "strata/build_config.h"
#include "strata/core/aligned.h"
#include "strata/device/adam8bit.h"
#include "strata/sys/host_mapping.h"
#include "tests/testing/backends.h"
#include "tests/testing/temp_dir.h"
#include "tests/unit/optim/adam_test_util.h"

namespace strata::optim {
namespace {

using testing::AdamState;
using testing::compare_bytes;
using testing::hyper;
using testing::make_state;
using testing::PackedState;

constexpr std::uint64_t kBlockBytes = 16 * 1024;  // the swap engine's chunk size here

// Segment sizes: not multiples of 1024, one exactly 4096, one tiny, one empty.
const std::int64_t kSizes[] = {5000, 1, 4096, 12345, 0, 2047};

// The segments' arrays in swap extents (what the tiered store's NVMe homes are underneath):
// state read from `extents` (3 per segment) and written to `out` where given, gradients read
// from `grads`.
class ExtentStorage final : public SegmentStorage {
 public:
  ExtentStorage(io::SwapSpace& swap, std::vector<io::Extent> extents)
      : swap_(swap), extents_(std::move(extents)) {}
  io::IoHandle read(std::size_t s, StreamedArray a, std::uint64_t offset, void* dst,
                    std::size_t bytes) override {
    const io::Extent& x = a == StreamedArray::kGrad ? grads.at(s) : extents_[s * 3 + index(a)];
    EXPECT_LE(offset + bytes, x.size_bytes) << "a read past the array";
    return swap_.read(x, offset, dst, bytes);
  }
  io::IoHandle write(std::size_t s, StreamedArray a, std::uint64_t offset, const void* src,
                     std::size_t bytes) override {
    EXPECT_NE(a, StreamedArray::kGrad) << "the step wrote a gradient";
    const io::Extent& x = out.empty() ? extents_[s * 3 + index(a)] : out[s * 3 + index(a)];
    EXPECT_LE(offset + bytes, x.size_bytes) << "a write past the array";
    return swap_.write(x, offset, const_cast<void*>(src), bytes);
  }
  std::vector<io::Extent> out;    // 3 per segment; empty: written over what was read
  std::vector<io::Extent> grads;  // 1 per segment, for streamed gradients

 private:
  static std::size_t index(StreamedArray a) { return static_cast<std::size_t>(a); }
  io::SwapSpace& swap_;
  std::vector<io::Extent> extents_;
};

struct Fixture {
  std::unique_ptr<::strata::testing::TempDir> dir;
  std::unique_ptr<io::SwapSpace> swap;
  std::vector<AdamState> states;    // in-memory copies (offset 0)
  std::vector<io::Extent> extents;  // 3 per segment
  std::vector<std::string> names;
  std::unique_ptr<ExtentStorage> storage;
};

// A StreamedAdam with staging of its own (in Strata, the tiered store's range staging).
struct Streamed {
  sys::HostMapping staging;
  std::optional<StreamedAdam> adam;
};

std::unique_ptr<Streamed> make_streamed(CpuAdam& adam, const StreamedAdamOptions& options) {
  auto s = std::make_unique<Streamed>();
  s->staging = sys::HostMapping(StreamedAdam::staging_bytes_for(options));
  auto created = StreamedAdam::create(adam, options, s->staging.bytes());
  EXPECT_TRUE(created.is_ok()) << created.status().to_string();
  if (created.is_ok()) s->adam.emplace(std::move(*created));
  return s;
}

// Writes every segment's master weights and moments (f.states) to its swap extents.
void write_state(Fixture& f) {
  for (std::size_t s = 0; s < f.states.size(); ++s) {
    AdamState& st = f.states[s];
    const float* arrays[3] = {st.p(), st.m(), st.v()};
    for (int k = 0; k < 3; ++k) {
      const io::Extent& x = f.extents[s * 3 + static_cast<std::size_t>(k)];
      AlignedBuffer buf(x.size_bytes, io::kIoAlignBytes);
      std::memcpy(buf.data(), arrays[k], static_cast<std::size_t>(st.n) * 4);
      EXPECT_TRUE(f.swap->write(x, 0, buf.data(), buf.size()).wait().is_ok());
    }
  }
}

// Creates a swap space, random state per segment, and writes master and moments to swap.
// Returns an empty swap when io_uring was asked for and is unavailable.
Fixture make_fixture(const std::string& engine, std::vector<io::FaultRule> rules = {}) {
  Fixture f;
  f.dir = std::make_unique<::strata::testing::TempDir>();
  io::SwapOptions so;
  so.engine = *io::parse_swap_engine(engine);
  so.paths = {f.dir->path()};
  so.block_size_bytes = kBlockBytes;
  so.queue_depth = 4;
  so.fault_injection.rules = std::move(rules);
  auto swap = io::SwapSpace::create(so);
  if (!swap.is_ok()) {
    EXPECT_TRUE(engine == "uring" && swap.status().code() == StatusCode::kUnavailable)
        << swap.status().to_string();
    return f;
  }
  f.swap = std::move(*swap);
  std::uint64_t seed = 40;
  for (std::int64_t n : kSizes) {
    const DType gd = n == 12345 ? DType::kBF16 : DType::kF32;  // one bf16-gradient segment
    f.states.push_back(make_state(n, 0, gd, DType::kBF16, true, ++seed));
    f.names.push_back("group" + std::to_string(f.names.size()));
    const std::uint64_t bytes = std::max<std::uint64_t>(static_cast<std::uint64_t>(n) * 4, 1);
    for (int k = 0; k < 3; ++k) {
      auto x = f.swap->allocate(bytes, f.names.back());
      EXPECT_TRUE(x.is_ok()) << x.status().to_string();
      f.extents.push_back(*x);
    }
  }
  write_state(f);
  f.storage = std::make_unique<ExtentStorage>(*f.swap, f.extents);
  return f;
}

std::vector<StreamedSegment> segments_of(Fixture& f, std::vector<AdamState>& outs) {
  std::vector<StreamedSegment> segs;
  for (std::size_t s = 0; s < f.states.size(); ++s) {
    StreamedSegment seg;
    seg.name = f.names[s];
    seg.grad = outs[s].g();
    seg.grad_dtype = outs[s].grad_dtype;
    seg.num_elems = outs[s].n;
    seg.param_out = outs[s].o();
    seg.out_dtype = outs[s].out_dtype;
    segs.push_back(seg);
  }
  return segs;
}

// Reads a segment's three arrays back from swap.
std::vector<std::vector<float>> read_back(Fixture& f, std::size_t s) {
  std::vector<std::vector<float>> out;
  for (int k = 0; k < 3; ++k) {
    const io::Extent& x = f.extents[s * 3 + static_cast<std::size_t>(k)];
    AlignedBuffer buf(x.size_bytes, io::kIoAlignBytes);
    EXPECT_TRUE(f.swap->read(x, 0, buf.data(), buf.size()).wait().is_ok());
    const auto n = static_cast<std::size_t>(f.states[s].n);
    out.emplace_back(buf.as<float>(), buf.as<float>() + n);
  }
  return out;
}

// The expected result: `states` after one in-memory step.
std::vector<AdamState> stepped_in_memory(CpuAdam& adam, std::vector<AdamState> states,
                                         const device::AdamWArgs& h) {
  for (AdamState& st : states) EXPECT_EQ(adam.step(st.args(h)), StepOutcome::kUpdated);
  return states;
}

// Every segment's state read back from swap, and its param_out, equal the in-memory step's.
void expect_same_as(Fixture& f, std::vector<AdamState>& want, const std::vector<AdamState>& got) {
  for (std::size_t s = 0; s < want.size(); ++s) {
    const auto back = read_back(f, s);
    const std::int64_t n = want[s].n;
    EXPECT_EQ(compare_bytes("master", back[0].data(), want[s].p(), 4, n), "") << "segment " << s;
    EXPECT_EQ(compare_bytes("exp_avg", back[1].data(), want[s].m(), 4, n), "") << "segment " << s;
    EXPECT_EQ(compare_bytes("exp_avg_sq", back[2].data(), want[s].v(), 4, n), "")
        << "segment " << s;
    EXPECT_EQ(compare_bytes("param_out", got[s].out.data(), want[s].out.data(), 1,
                            static_cast<std::int64_t>(want[s].out.size())),
              "")
        << "segment " << s;
  }
}

class StreamedAdamTest : public ::testing::TestWithParam<std::string> {};

TEST_P(StreamedAdamTest, SameBytesAsTheInMemoryStepForEverySubGroupSize) {
  auto adam = CpuAdam::create(CpuAdamOptions{.threads = 2});
  ASSERT_TRUE(adam.is_ok());
  const device::AdamWArgs h = hyper(true, 0.5f, 2);
  for (std::int64_t sub : {1024, 3072, 1000, 5000, 1 << 20}) {
    for (int buffers : {2, 3, 4}) {
      SCOPED_TRACE("sub_group_size " + std::to_string(sub) + ", " + std::to_string(buffers) +
                   " buffers, engine " + GetParam());
      Fixture f = make_fixture(GetParam());
      if (f.swap == nullptr) GTEST_SKIP() << "io_uring is unavailable here";
      // In memory: the expected result.
      std::vector<AdamState> want = stepped_in_memory(*adam, f.states, h);
      // Streamed: gradients and outputs from a copy whose state arrays are ignored.
      std::vector<AdamState> got = f.states;
      std::vector<StreamedSegment> segs = segments_of(f, got);
      StreamedAdamOptions so;
      so.sub_group_size = sub;
      so.num_buffers = buffers;
      so.max_segment_elems = 12345;
      auto streamed = make_streamed(*adam, so);
      ASSERT_TRUE(streamed->adam);
      EXPECT_EQ(streamed->adam->sub_group_elems() % 2048, 0);
      std::vector<std::size_t> done;
      auto report = streamed->adam->step(segs, *f.storage, h, [&](std::size_t s) {
        done.push_back(s);
        return Status::ok();
      });
      ASSERT_TRUE(report.is_ok()) << report.status().to_string();
      EXPECT_TRUE(report->skipped_segments.empty());
      EXPECT_EQ(done, (std::vector<std::size_t>{0, 1, 2, 3, 4, 5}));
      EXPECT_EQ(report->bytes_read, report->bytes_written);
      expect_same_as(f, want, got);
    }
  }
}

// bf16 moments (state_dtype bf16): 2-byte arrays in swap, each sub-group's share read and
// written at its own offsets, give the in-memory step's bytes.
TEST_P(StreamedAdamTest, Bf16MomentsStreamTheirOwnBytes) {
  auto adam = CpuAdam::create(CpuAdamOptions{.threads = 2});
  ASSERT_TRUE(adam.is_ok());
  device::AdamWArgs h = hyper(true, 0.5f, 2);
  h.state_dtype = DType::kBF16;
  Fixture f = make_fixture(GetParam());
  if (f.swap == nullptr) GTEST_SKIP() << "io_uring is unavailable here";
  // Each segment's moments as bf16, in memory and in 2-byte extents of their own.
  std::vector<std::vector<std::uint16_t>> m(f.states.size()), v(f.states.size());
  std::vector<io::Extent> extents;
  for (std::size_t s = 0; s < f.states.size(); ++s) {
    AdamState& st = f.states[s];
    const auto n = static_cast<std::size_t>(st.n);
    m[s].resize(n);
    v[s].resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      m[s][i] = f32_to_bf16(st.m()[i]).bits;
      v[s][i] = f32_to_bf16(std::abs(st.v()[i])).bits;
    }
    extents.push_back(f.extents[s * 3]);  // the master weights as written by the fixture
    for (const auto* half : {&m[s], &v[s]}) {
      auto x = f.swap->allocate(std::max<std::uint64_t>(n * 2, 1), f.names[s]);
      ASSERT_TRUE(x.is_ok()) << x.status().to_string();
      AlignedBuffer buf(x->size_bytes, io::kIoAlignBytes);
      std::memcpy(buf.data(), half->data(), n * 2);
      ASSERT_TRUE(f.swap->write(*x, 0, buf.data(), buf.size()).wait().is_ok());
      extents.push_back(*x);
    }
  }
  ExtentStorage storage(*f.swap, extents);
  std::vector<AdamState> want = f.states, got = f.states;
  auto want_m = m, want_v = v;
  for (std::size_t s = 0; s < want.size(); ++s) {
    device::AdamWArgs a = want[s].args(h);
    a.exp_avg = want_m[s].data();
    a.exp_avg_sq = want_v[s].data();
    ASSERT_EQ(adam->step(a), StepOutcome::kUpdated);
  }
  StreamedAdamOptions so;
  so.sub_group_size = 2048;
  so.max_segment_elems = 12345;
  so.moment_layout = moment_layout(DType::kBF16);
  auto streamed = make_streamed(*adam, so);
  ASSERT_TRUE(streamed->adam);
  std::vector<StreamedSegment> segs = segments_of(f, got);
  auto report = streamed->adam->step(segs, storage, h);
  ASSERT_TRUE(report.is_ok()) << report.status().to_string();
  for (std::size_t s = 0; s < want.size(); ++s) {
    const std::int64_t n = want[s].n;
    const io::Extent* x = &extents[s * 3];
    AlignedBuffer master(x[0].size_bytes, io::kIoAlignBytes),
        mb(x[1].size_bytes, io::kIoAlignBytes), vb(x[2].size_bytes, io::kIoAlignBytes);
    ASSERT_TRUE(f.swap->read(x[0], 0, master.data(), master.size()).wait().is_ok());
    ASSERT_TRUE(f.swap->read(x[1], 0, mb.data(), mb.size()).wait().is_ok());
    ASSERT_TRUE(f.swap->read(x[2], 0, vb.data(), vb.size()).wait().is_ok());
    EXPECT_EQ(compare_bytes("master", master.as<float>(), want[s].p(), 4, n), "") << s;
    EXPECT_EQ(compare_bytes("exp_avg", mb.data(), want_m[s].data(), 2, n), "") << s;
    EXPECT_EQ(compare_bytes("exp_avg_sq", vb.data(), want_v[s].data(), 2, n), "") << s;
    EXPECT_EQ(compare_bytes("param_out", got[s].out.data(), want[s].out.data(), 1,
                            static_cast<std::int64_t>(want[s].out.size())),
              "")
        << s;
  }
}

// 8-bit moments and Kahan master weights: each array's second plane (block scales,
// compensation) streams as a range of its own, sub-groups are whole multiples of a 4 KiB page of
// block scales (65,536 elements) so both planes start on 4096-byte boundaries, and the bytes
// equal the in-memory step's.
TEST_P(StreamedAdamTest, CompactPlanesStreamAsTheirOwnRanges) {
  // One thread: these segments span many tiles, and ThreadSanitizer (which runs this test) cannot
  // see oneTBB's own synchronization when it splits them (libtbb is not instrumented). CpuAdam's
  // threads are tested in cpu_adam_test.
  auto adam = CpuAdam::create(CpuAdamOptions{.threads = 1});
  ASSERT_TRUE(adam.is_ok());
  Fixture f = make_fixture(GetParam());
  if (f.swap == nullptr) GTEST_SKIP() << "io_uring is unavailable here";
  device::AdamWArgs h = hyper(true, 0.5f, 2);
  h.master_dtype = DType::kBF16;
  h.master_rounding = device::MasterRounding::kKahan;
  h.state_dtype = device::kAdam8StateDType;
  const StateLayout ml = master_layout(h.master_dtype, h.master_rounding);
  const StateLayout sl = moment_layout(h.state_dtype);
  // A 4 KiB page of f32 block scales.
  const std::int64_t page = 4096 / 4 * device::kAdam8BlockElems;
  EXPECT_EQ(sl.align_elems(), page);
  const std::int64_t sizes[] = {600000, 300, page + 5, 0};
  std::vector<AdamState> states;
  std::vector<PackedState> want, start;
  std::vector<io::Extent> extents;
  std::uint64_t seed = 70;
  for (std::int64_t n : sizes) {
    states.push_back(make_state(n, 0, DType::kF32, DType::kBF16, true, ++seed));
    start.emplace_back(states.back(), h.master_dtype, h.master_rounding, h.state_dtype);
    const std::vector<std::byte>* arrays[3] = {&start.back().master, &start.back().exp_avg,
                                               &start.back().exp_avg_sq};
    for (int k = 0; k < 3; ++k) {
      const StateLayout& l = k == 0 ? ml : sl;
      auto x = f.swap->allocate(std::max<std::uint64_t>(l.bytes(n), 1), "segment");
      ASSERT_TRUE(x.is_ok()) << x.status().to_string();
      AlignedBuffer buf(x->size_bytes, io::kIoAlignBytes);
      std::memcpy(buf.data(), arrays[k]->data(), l.bytes(n));
      ASSERT_TRUE(f.swap->write(*x, 0, buf.data(), buf.size()).wait().is_ok());
      extents.push_back(*x);
    }
  }
  want = start;
  std::vector<AdamState> want_states = states, got_states = states;
  for (std::size_t s = 0; s < want.size(); ++s) {
    device::AdamWArgs a = want_states[s].args(h);
    want[s].point(a);
    ASSERT_EQ(adam->step(a), StepOutcome::kUpdated);
  }
  ExtentStorage storage(*f.swap, extents);
  StreamedAdamOptions so;
  so.sub_group_size = 2048;  // rounded up to a page of scales
  so.master_layout = ml;
  so.moment_layout = sl;
  auto streamed = make_streamed(*adam, so);
  ASSERT_TRUE(streamed->adam);
  EXPECT_EQ(streamed->adam->sub_group_elems(), page);
  std::vector<StreamedSegment> segs;
  for (std::size_t s = 0; s < got_states.size(); ++s) {
    StreamedSegment seg;
    seg.name = "segment";
    seg.grad = got_states[s].g();
    seg.num_elems = got_states[s].n;
    seg.param_out = got_states[s].o();
    segs.push_back(seg);
  }
  auto report = streamed->adam->step(segs, storage, h);
  ASSERT_TRUE(report.is_ok()) << report.status().to_string();
  for (std::size_t s = 0; s < want.size(); ++s) {
    SCOPED_TRACE("segment of " + std::to_string(sizes[s]));
    PackedState got = start[s];
    std::vector<std::byte>* arrays[3] = {&got.master, &got.exp_avg, &got.exp_avg_sq};
    for (int k = 0; k < 3; ++k) {
      const io::Extent& x = extents[s * 3 + static_cast<std::size_t>(k)];
      AlignedBuffer buf(x.size_bytes, io::kIoAlignBytes);
      ASSERT_TRUE(f.swap->read(x, 0, buf.data(), buf.size()).wait().is_ok());
      std::memcpy(arrays[k]->data(), buf.data(), (k == 0 ? ml : sl).bytes(sizes[s]));
    }
    EXPECT_TRUE(got.same_master(want[s])) << "master weights";
    EXPECT_TRUE(got.same_moments(want[s])) << "moments";
    EXPECT_EQ(compare_bytes("param_out", got_states[s].out.data(), want_states[s].out.data(), 1,
                            static_cast<std::int64_t>(want_states[s].out.size())),
              "");
  }
  // The step moved each plane once each way, whole 4096-byte blocks at a time.
  EXPECT_EQ(report->bytes_read, report->bytes_written);
}

// Gradients in swap extents (f32, and bf16 for segment 3) read with the state as a fourth
// array, and outputs placed per segment by the begin hook: the same bytes as in memory.
TEST_P(StreamedAdamTest, GradientsStreamedFromSwapGiveTheSameBytes) {
  auto adam = CpuAdam::create(CpuAdamOptions{.threads = 2});
  ASSERT_TRUE(adam.is_ok());
  const device::AdamWArgs h = hyper(true, 0.5f, 3);
  for (std::int64_t sub : {2048, 6144, 1 << 20}) {
    SCOPED_TRACE("sub_group_size " + std::to_string(sub));
    Fixture f = make_fixture(GetParam());
    if (f.swap == nullptr) GTEST_SKIP() << "io_uring is unavailable here";
    std::vector<AdamState> want = stepped_in_memory(*adam, f.states, h);
    std::vector<AdamState> got = f.states;
    std::vector<StreamedSegment> segs = segments_of(f, got);
    for (std::size_t i = 0; i < segs.size(); ++i) {
      const std::size_t bytes = static_cast<std::size_t>(got[i].n) * dtype_size(got[i].grad_dtype);
      auto x = f.swap->allocate(std::max<std::size_t>(bytes, 1), "gradient");
      ASSERT_TRUE(x.is_ok());
      AlignedBuffer buf(x->size_bytes, io::kIoAlignBytes);
      std::memcpy(buf.data(), got[i].g(), bytes);
      ASSERT_TRUE(f.swap->write(*x, 0, buf.data(), buf.size()).wait().is_ok());
      segs[i].grad = nullptr;
      segs[i].grad_streamed = true;
      f.storage->grads.push_back(*x);
      segs[i].param_out = nullptr;  // given by the begin hook instead
    }
    StreamedAdamOptions so;
    so.sub_group_size = sub;
    so.stream_grads = true;
    so.check_finite = false;
    auto streamed = make_streamed(*adam, so);
    ASSERT_TRUE(streamed->adam);
    std::vector<std::size_t> begun;
    auto report =
        streamed->adam->step(segs, *f.storage, h, {}, [&](std::size_t i) -> Result<void*> {
          begun.push_back(i);
          return static_cast<void*>(got[i].o());
        });
    ASSERT_TRUE(report.is_ok()) << report.status().to_string();
    EXPECT_EQ(begun, (std::vector<std::size_t>{0, 1, 2, 3, 4, 5}));
    EXPECT_GT(report->bytes_read, report->bytes_written);  // the gradients were read too
    expect_same_as(f, want, got);
  }
}

// State written to other extents (master_out, exp_avg_out, exp_avg_sq_out) leaves the extents
// read as they were, and gradients supplied as each segment becomes ready (reads ahead never
// wait for one; the update does) give the same bytes as in memory.
TEST_P(StreamedAdamTest, ShadowExtentsAndGradientsSuppliedWhenReady) {
  auto adam = CpuAdam::create(CpuAdamOptions{.threads = 2});
  ASSERT_TRUE(adam.is_ok());
  const device::AdamWArgs h = hyper(true, 0.5f, 3);
  for (std::int64_t sub : {2048, 1 << 20}) {
    SCOPED_TRACE("sub_group_size " + std::to_string(sub));
    Fixture f = make_fixture(GetParam());
    if (f.swap == nullptr) GTEST_SKIP() << "io_uring is unavailable here";
    std::vector<AdamState> want = stepped_in_memory(*adam, f.states, h);
    std::vector<AdamState> got = f.states;
    std::vector<StreamedSegment> segs = segments_of(f, got);
    std::vector<io::Extent> shadow;
    for (std::size_t i = 0; i < segs.size(); ++i) {
      segs[i].grad = nullptr;  // supplied when ready
      for (int k = 0; k < 3; ++k) {
        auto x = f.swap->allocate(f.extents[i * 3].size_bytes, "shadow");
        ASSERT_TRUE(x.is_ok());
        shadow.push_back(*x);
      }
    }
    f.storage->out = shadow;
    StreamedAdamOptions so;
    so.sub_group_size = sub;
    so.check_finite = false;
    auto streamed = make_streamed(*adam, so);
    ASSERT_TRUE(streamed->adam);
    // Segment i's gradient "arrives" once segment i - 1 is done, as in a backward pass.
    std::size_t done = 0;
    std::vector<std::pair<std::size_t, bool>> asked;
    auto report = streamed->adam->step(
        segs, *f.storage, h,
        [&](std::size_t i) {
          EXPECT_EQ(i, done);
          ++done;
          return Status::ok();
        },
        {},
        [&](std::size_t i, bool wait) -> Result<std::optional<StreamedAdam::SegmentGrad>> {
          asked.emplace_back(i, wait);
          if (!wait && i > done) return std::optional<StreamedAdam::SegmentGrad>();
          EXPECT_LE(i, done) << "asked to wait for a gradient the step does not need yet";
          return std::optional(StreamedAdam::SegmentGrad{got[i].g(), false});
        });
    ASSERT_TRUE(report.is_ok()) << report.status().to_string();
    EXPECT_EQ(done, segs.size());
    bool waited = false;
    for (const auto& [i, wait] : asked) waited |= wait;
    EXPECT_TRUE(waited);
    // The extents read still hold the state before the step; the shadows hold the step's.
    for (std::size_t i = 0; i < f.states.size(); ++i) {
      const auto before = read_back(f, i);
      EXPECT_EQ(compare_bytes("master", before[0].data(), f.states[i].p(), 4, f.states[i].n), "");
      EXPECT_EQ(compare_bytes("exp_avg", before[1].data(), f.states[i].m(), 4, f.states[i].n), "");
    }
    std::swap(f.extents, shadow);
    expect_same_as(f, want, got);
  }
}

TEST_P(StreamedAdamTest, NonFiniteSegmentIsSkippedWithoutIo) {
  Fixture f = make_fixture(GetParam());
  if (f.swap == nullptr) GTEST_SKIP() << "io_uring is unavailable here";
  auto adam = CpuAdam::create({});
  ASSERT_TRUE(adam.is_ok());
  std::vector<AdamState> got = f.states;
  const std::uint16_t bf16_inf = 0x7f80;  // segment 3 has a bf16 gradient
  std::memcpy(got[3].g() + 2 * 100, &bf16_inf, 2);
  std::vector<StreamedSegment> segs = segments_of(f, got);
  auto streamed = make_streamed(*adam, StreamedAdamOptions{.sub_group_size = 2048});
  ASSERT_TRUE(streamed->adam);
  auto report = streamed->adam->step(segs, *f.storage, hyper(true, 1.0f));
  ASSERT_TRUE(report.is_ok()) << report.status().to_string();
  EXPECT_EQ(report->skipped_segments, (std::vector<std::size_t>{3}));
  const auto back = read_back(f, 3);
  EXPECT_EQ(compare_bytes("master", back[0].data(), f.states[3].p(), 4, f.states[3].n), "");
  EXPECT_EQ(compare_bytes("param_out", got[3].out.data(), f.states[3].out.data(), 1,
                          static_cast<std::int64_t>(got[3].out.size())),
            "");
}

// EIO on the exp_avg of segment 3 (reads), then on the master of segment 0 (write-back).
TEST_P(StreamedAdamTest, InjectedEioSurfacesNamingTheSegment) {
  for (io::FaultOp op : {io::FaultOp::kRead, io::FaultOp::kWrite}) {
    Fixture probe = make_fixture(GetParam());
    if (probe.swap == nullptr) GTEST_SKIP() << "io_uring is unavailable here";
    const io::Extent target =
        op == io::FaultOp::kRead ? probe.extents[3 * 3 + 1] : probe.extents[0];
    io::FaultRule r;
    r.op = op;
    r.kind = io::FaultKind::kError;
    r.error = EIO;
    r.swap_offset_begin = target.offset;
    r.swap_offset_end = target.offset + target.size_bytes;
    // The fixture's own write of the initial state (one attempt per 16 KiB block) must pass.
    r.skip = op == io::FaultOp::kWrite ? (target.size_bytes + kBlockBytes - 1) / kBlockBytes : 0;
    Fixture f = make_fixture(GetParam(), {r});
    ASSERT_EQ(f.extents[0].offset, probe.extents[0].offset);
    auto adam = CpuAdam::create({});
    ASSERT_TRUE(adam.is_ok());
    std::vector<AdamState> got = f.states;
    std::vector<StreamedSegment> segs = segments_of(f, got);
    auto streamed = make_streamed(*adam, StreamedAdamOptions{.sub_group_size = 2048});
    ASSERT_TRUE(streamed->adam);
    auto report = streamed->adam->step(segs, *f.storage, hyper(true, 1.0f));
    ASSERT_FALSE(report.is_ok()) << "the injected EIO was not reported";
    EXPECT_EQ(report.status().code(), StatusCode::kIoError) << report.status().to_string();
    const std::string& msg = report.status().message();
    if (op == io::FaultOp::kRead) {
      EXPECT_NE(msg.find("reading exp_avg of 'group3'"), std::string::npos) << msg;
    } else {
      EXPECT_NE(msg.find("writing master weights of 'group0'"), std::string::npos) << msg;
    }
    EXPECT_NE(msg.find("Input/output error"), std::string::npos) << msg;
  }
}

// update = false moves every byte of the step and changes none: the state in swap and the
// output copy stay as they were.
TEST_P(StreamedAdamTest, WithoutUpdateTheSameBytesMoveAndNothingChanges) {
  auto adam = CpuAdam::create(CpuAdamOptions{.threads = 1});
  ASSERT_TRUE(adam.is_ok());
  Fixture f = make_fixture(GetParam());
  if (f.swap == nullptr) GTEST_SKIP() << "io_uring is unavailable here";
  StreamedAdamOptions so{.sub_group_size = 2048, .max_segment_elems = 12345};
  auto updating = make_streamed(*adam, so);
  so.update = false;
  auto io_only = make_streamed(*adam, so);
  ASSERT_TRUE(updating->adam && io_only->adam);
  std::vector<AdamState> got = f.states;
  std::vector<StreamedSegment> segs = segments_of(f, got);
  auto moved = io_only->adam->step(segs, *f.storage, hyper(true, 0.5f, 2));
  ASSERT_TRUE(moved.is_ok()) << moved.status().to_string();
  EXPECT_EQ(moved->compute_s, 0.0);
  for (std::size_t s = 0; s < f.states.size(); ++s) {
    const auto back = read_back(f, s);
    const std::int64_t n = f.states[s].n;
    EXPECT_EQ(compare_bytes("master", back[0].data(), f.states[s].p(), 4, n), "") << s;
    EXPECT_EQ(compare_bytes("exp_avg_sq", back[2].data(), f.states[s].v(), 4, n), "") << s;
    EXPECT_EQ(got[s].out, f.states[s].out) << s;
  }
  auto updated = updating->adam->step(segs, *f.storage, hyper(true, 0.5f, 2));
  ASSERT_TRUE(updated.is_ok());
  EXPECT_EQ(moved->bytes_read, updated->bytes_read);
  EXPECT_EQ(moved->bytes_written, updated->bytes_written);
}

TEST(StreamedAdamOptions, RejectsBadSizesAndStagingTooSmall) {
  auto adam = CpuAdam::create({});
  ASSERT_TRUE(adam.is_ok());
  sys::HostMapping staging(1 << 20);
  EXPECT_FALSE(
      StreamedAdam::create(*adam, StreamedAdamOptions{.sub_group_size = 0}, staging.bytes())
          .is_ok());
  EXPECT_FALSE(
      StreamedAdam::create(*adam, StreamedAdamOptions{.num_buffers = 1}, staging.bytes()).is_ok());
  StreamedAdamOptions o;
  o.sub_group_size = 1 << 20;
  o.max_segment_elems = 3000;
  EXPECT_EQ(StreamedAdam::staging_bytes_for(o), 3u * 3 * 4096 * 4);  // 3000 rounded up to 2048s
  o.stream_grads = true;
  EXPECT_EQ(StreamedAdam::staging_bytes_for(o), 3u * 4 * 4096 * 4);  // a gradient slot too
  o.stream_grads = false;
  EXPECT_TRUE(StreamedAdam::create(*adam, o, staging.bytes().first(3 * 3 * 4096 * 4)).is_ok());
  auto small = StreamedAdam::create(*adam, o, staging.bytes().first(3 * 3 * 4096 * 4 - 4096));
  ASSERT_FALSE(small.is_ok());
  EXPECT_EQ(small.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(small.status().message().find("it needs 147456 bytes"), std::string::npos)
      << small.status().message();
  EXPECT_FALSE(StreamedAdam::create(*adam, o, staging.bytes().subspan(8)).is_ok());  // unaligned
}

INSTANTIATE_TEST_SUITE_P(Engines, StreamedAdamTest, ::testing::Values("memory", "posix", "uring"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace strata::optim
