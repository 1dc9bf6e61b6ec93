// CpuAdam: every SIMD path, forced through the options, is bit-identical to
// device::adamw_reference (lengths off the vector width, unaligned starts, hard values, every
// dtype, both modes, gradient scales, one and two threads); NaN/Inf gradients change nothing.
#include "strata/optim/cpu_adam.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "src/optim/cpu_adam_kernels.h"
#include "strata/core/rng.h"
#include "strata/device/adam8bit.h"
#include "tests/testing/scoped_env.h"
#include "tests/unit/optim/adam_test_util.h"

namespace strata::optim {
namespace {

using sys::cpu_supports;
using sys::cpu_supports_avx512_bf16;
using testing::AdamState;
using testing::compare_states;
using testing::hyper;
using testing::make_state;
using testing::PackedState;

struct PathCase {
  std::string simd;  // as given to CpuAdamOptions
  bool native_bf16;
  int threads;
  std::int64_t tile_elems;
};

void PrintTo(const PathCase& c, std::ostream* os) {
  *os << c.simd << (c.native_bf16 ? "+bf16" : "") << ", " << c.threads << " threads, tile "
      << c.tile_elems;
}

std::string path_case_name(const ::testing::TestParamInfo<PathCase>& info) {
  const PathCase& c = info.param;
  return c.simd + (c.simd == "avx512" ? (c.native_bf16 ? "_nativebf16" : "_intbf16") : "") + "_" +
         std::to_string(c.threads) + "threads_tile" + std::to_string(c.tile_elems);
}

// The kernels of a case's path, to call directly.
detail::KernelSet kernels_of(const PathCase& c) {
  detail::KernelSet kernels{};
  if (c.simd == "avx512") {
    detail::fill_avx512_kernels(&kernels, c.native_bf16);
  } else if (c.simd == "avx2") {
    detail::fill_avx2_kernels(&kernels);
  } else {
    detail::fill_scalar_kernels(&kernels);
  }
  return kernels;
}

class CpuAdamPathTest : public ::testing::TestWithParam<PathCase> {
 protected:
  void SetUp() override {
    const PathCase& c = GetParam();
    const SimdPath path = c.simd == "avx512" ? SimdPath::kAvx512
                          : c.simd == "avx2" ? SimdPath::kAvx2
                                             : SimdPath::kScalar;
    if (!cpu_supports(path)) {
      GTEST_SKIP() << "this CPU lacks " << c.simd << " (CPUID), so that path cannot run here";
    }
    if (c.native_bf16 && !cpu_supports_avx512_bf16()) {
      GTEST_SKIP() << "this CPU lacks avx512_bf16; the integer-rounding variant is tested instead";
    }
    CpuAdamOptions o;
    o.simd = c.simd;
    o.native_bf16 = c.native_bf16;
    o.threads = c.threads;
    o.tile_elems = c.tile_elems;
    // Two-thread cases stream their stores on every span of 64 elements or more and prefetch;
    // one-thread cases store regularly without prefetch (whatever kAuto would pick on this CPU,
    // every kind runs on every path).
    if (c.threads > 1) {
      o.stores = CpuAdamOptions::Stores::kStreaming;
      o.prefetch = CpuAdamOptions::Prefetch::kOn;
      o.nontemporal_min_elems = 64;
    } else {
      o.stores = CpuAdamOptions::Stores::kRegular;
      o.prefetch = CpuAdamOptions::Prefetch::kOff;
    }
    auto adam = CpuAdam::create(o);
    ASSERT_TRUE(adam.is_ok()) << adam.status().to_string();
    adam_ = std::make_unique<CpuAdam>(std::move(*adam));
    ASSERT_EQ(adam_->simd(), path);
    ASSERT_EQ(adam_->uses_native_bf16(), c.native_bf16);
  }

  // Runs the reference on one copy and the path on another; returns the first difference.
  std::string run_and_compare(std::int64_t n, int offset, DType grad_dtype, DType out_dtype,
                              bool has_out, const device::AdamWArgs& h, std::uint64_t seed) {
    AdamState want = make_state(n, offset, grad_dtype, out_dtype, has_out, seed);
    AdamState got = want;
    device::adamw_reference(want.args(h));
    EXPECT_EQ(adam_->step(got.args(h)), StepOutcome::kUpdated);
    return compare_states(got, want);
  }

  std::unique_ptr<CpuAdam> adam_;
};

constexpr DType kGradDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
constexpr DType kOutDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};

TEST_P(CpuAdamPathTest, BitIdenticalToReferenceOnShortAndUnalignedSpans) {
  std::uint64_t seed = 1;
  for (std::int64_t n : {0, 1, 7, 15, 16, 17, 31, 33, 63, 65, 257}) {
    for (int offset : {0, 1, 3}) {
      for (DType gd : kGradDtypes) {
        for (int out = 0; out < 4; ++out) {
          const bool has_out = out < 3;
          const DType od = has_out ? kOutDtypes[out] : DType::kBF16;
          for (bool adamw : {true, false}) {
            for (float scale : {1.0f, 0.37f}) {
              const std::string diff =
                  run_and_compare(n, offset, gd, od, has_out, hyper(adamw, scale), ++seed);
              ASSERT_EQ(diff, "") << "n=" << n << " offset=" << offset << " grad " << dtype_name(gd)
                                  << " out " << (has_out ? dtype_name(od) : "none")
                                  << " adamw_mode=" << adamw << " grad_scale=" << scale;
            }
          }
        }
      }
    }
  }
}

// Long enough for several tiles per thread and the streaming-store path; every gradient dtype
// with the bf16 copy, every output dtype with an f32 gradient, and Adam+L2.
TEST_P(CpuAdamPathTest, BitIdenticalToReferenceOnALongSpan) {
  struct Combo {
    DType grad, out;
  };
  const Combo combos[] = {{DType::kF32, DType::kBF16},
                          {DType::kBF16, DType::kBF16},
                          {DType::kF16, DType::kBF16},
                          {DType::kF32, DType::kF32},
                          {DType::kF32, DType::kF16}};
  std::uint64_t seed = 1000;
  for (const Combo& c : combos) {
    const std::string diff =
        run_and_compare(1000003, 1, c.grad, c.out, true, hyper(true, 0.5f, 7), ++seed);
    ASSERT_EQ(diff, "") << "grad " << dtype_name(c.grad) << " out " << dtype_name(c.out);
  }
  const std::string l2 =
      run_and_compare(1000003, 2, DType::kBF16, DType::kBF16, true, hyper(false, 2.0f, 1), 7);
  ASSERT_EQ(l2, "") << "adamw_mode=false";
}

TEST_P(CpuAdamPathTest, BitIdenticalAcrossSeveralSteps) {
  AdamState want = make_state(4099, 1, DType::kF32, DType::kBF16, true, 77);
  AdamState got = want;
  for (std::int64_t step = 1; step <= 5; ++step) {
    device::adamw_reference(want.args(hyper(true, 1.0f, step)));
    ASSERT_EQ(adam_->step(got.args(hyper(true, 1.0f, step))), StepOutcome::kUpdated);
    ASSERT_EQ(compare_states(got, want), "") << "step " << step;
  }
}

// Out of place (the shadow state): the step reads one copy of the state and writes another; the
// results are the in-place step's bits and the copy read is untouched. Lengths around the blocks
// and the vector width, unaligned starts, and a long span for the streaming-store path.
TEST_P(CpuAdamPathTest, OutOfPlaceWritesTheInPlaceBitsAndLeavesItsInputs) {
  std::uint64_t seed = 500;
  for (std::int64_t n : {1, 17, 63, 64, 65, 129, 4099, 300001}) {
    for (int offset : {0, 1}) {
      for (DType gd : kGradDtypes) {
        SCOPED_TRACE("n=" + std::to_string(n) + " offset=" + std::to_string(offset) + " grad " +
                     std::string(dtype_name(gd)));
        AdamState want = make_state(n, offset, gd, DType::kBF16, true, ++seed);
        AdamState input = want;  // read by the out-of-place step, which must not change it
        AdamState got = make_state(n, offset + 1, gd, DType::kBF16, true, seed + 1000);
        const AdamState before = input;
        device::adamw_reference(want.args(hyper(true, 0.5f, 3)));
        device::AdamWArgs a = got.args(hyper(true, 0.5f, 3));
        a.grad = input.g();  // the same gradient as the reference's
        a.param_in = input.p();
        a.exp_avg_in = input.m();
        a.exp_avg_sq_in = input.v();
        ASSERT_EQ(adam_->step(a), StepOutcome::kUpdated);
        const auto same = [](const float* x, const float* y, std::int64_t len) {
          return std::memcmp(x, y, static_cast<std::size_t>(len) * sizeof(float)) == 0;
        };
        EXPECT_TRUE(same(got.p(), want.p(), n)) << "parameters";
        EXPECT_TRUE(same(got.m(), want.m(), n)) << "exp_avg";
        EXPECT_TRUE(same(got.v(), want.v(), n)) << "exp_avg_sq";
        EXPECT_EQ(std::memcmp(got.o(), want.o(), static_cast<std::size_t>(n) * 2), 0) << "copy";
        EXPECT_TRUE(input.param == before.param && input.exp_avg == before.exp_avg &&
                    input.exp_avg_sq == before.exp_avg_sq)
            << "the state read was written";
      }
    }
  }
}

// bf16 moments (optimizer.state_dtype "bf16"): widened, stepped in f32 and rounded back by
// every path as the reference does, in place and out of place, across tiles and the 2048-element
// chunks the paths widen at a time, with every gradient dtype.
TEST_P(CpuAdamPathTest, Bf16MomentsGiveTheReferencesBits) {
  std::uint64_t seed = 900;
  for (std::int64_t n : {1, 63, 2047, 2049, 4099, 70001}) {
    for (int offset : {0, 3}) {
      for (DType gd : kGradDtypes) {
        for (const bool out_of_place : {false, true}) {
          SCOPED_TRACE("n=" + std::to_string(n) + " offset=" + std::to_string(offset) + " grad " +
                       std::string(dtype_name(gd)) + (out_of_place ? " out of place" : ""));
          AdamState want = make_state(n, offset, gd, DType::kBF16, true, ++seed);
          // Moments in bf16: the state's f32 values rounded, stored where the f32 ones were.
          const auto size = static_cast<std::size_t>(n);
          std::vector<std::uint16_t> m(size + 8), v(size + 8);
          for (std::size_t i = 0; i < size; ++i) {
            m[i + static_cast<std::size_t>(offset)] = f32_to_bf16(want.m()[i]).bits;
            v[i + static_cast<std::size_t>(offset)] = f32_to_bf16(std::abs(want.v()[i])).bits;
          }
          std::vector<std::uint16_t> m_want = m, v_want = v, m_got = m, v_got = v;
          AdamState got = want;
          device::AdamWArgs r = want.args(hyper(true, 0.5f, 3));
          r.state_dtype = DType::kBF16;
          r.exp_avg = m_want.data() + offset;
          r.exp_avg_sq = v_want.data() + offset;
          device::adamw_reference(r);
          device::AdamWArgs a = got.args(hyper(true, 0.5f, 3));
          a.state_dtype = DType::kBF16;
          a.exp_avg = m_got.data() + offset;
          a.exp_avg_sq = v_got.data() + offset;
          std::vector<float> p_in;
          if (out_of_place) {  // the state read from the untouched copies, written to others
            p_in.assign(got.p(), got.p() + n);
            a.param_in = p_in.data();
            a.exp_avg_in = m.data() + offset;
            a.exp_avg_sq_in = v.data() + offset;
            std::fill(m_got.begin(), m_got.end(), 0x7fc1);
            std::fill(v_got.begin(), v_got.end(), 0x7fc1);
          }
          ASSERT_EQ(adam_->step(a), StepOutcome::kUpdated);
          EXPECT_EQ(std::memcmp(got.p(), want.p(), size * sizeof(float)), 0) << "parameters";
          EXPECT_EQ(std::memcmp(got.o(), want.o(), size * 2), 0) << "copy";
          EXPECT_TRUE(std::equal(m_got.begin() + offset, m_got.begin() + offset + n,
                                 m_want.begin() + offset))
              << "exp_avg";
          EXPECT_TRUE(std::equal(v_got.begin() + offset, v_got.begin() + offset + n,
                                 v_want.begin() + offset))
              << "exp_avg_sq";
        }
      }
    }
  }
}

// bf16 master weights (optimizer.master_dtype "bf16"): widened, stepped in f32 and stored by
// stochastic rounding, with the reference's random bits (from the seed and each element's place
// in its group, element_offset + i), the copy converted from the value stored; with f32 and bf16
// moments, in place and out of place, every output dtype.
TEST_P(CpuAdamPathTest, Bf16MasterWeightsRoundAsTheReferenceDoes) {
  std::uint64_t seed = 1300;
  for (std::int64_t n : {1, 2047, 2049, 70001}) {
    for (DType state : {DType::kF32, DType::kBF16}) {
      for (DType out : {DType::kF32, DType::kBF16, DType::kF16}) {
        for (const bool out_of_place : {false, true}) {
          SCOPED_TRACE("n=" + std::to_string(n) + " moments " + std::string(dtype_name(state)) +
                       " copy " + std::string(dtype_name(out)) +
                       (out_of_place ? " out of place" : ""));
          AdamState want = make_state(n, 1, DType::kBF16, out, true, ++seed);
          const auto size = static_cast<std::size_t>(n);
          const auto halve = [&](const float* x, bool nonneg) {
            std::vector<std::uint16_t> h(size);
            for (std::size_t i = 0; i < size; ++i) {
              h[i] = f32_to_bf16(nonneg ? std::abs(x[i]) : x[i]).bits;
            }
            return h;
          };
          const std::vector<std::uint16_t> p0 = halve(want.p(), false);
          const std::vector<std::uint16_t> m0 = halve(want.m(), false), v0 = halve(want.v(), true);
          std::vector<float> mf(want.m(), want.m() + n), vf(want.v(), want.v() + n);
          for (float& x : vf) x = std::abs(x);
          // The reference and the path each on copies of the same start.
          std::vector<std::uint16_t> p_ref = p0, m_ref = m0, v_ref = v0;
          std::vector<std::uint16_t> p_got = p0, m_got = m0, v_got = v0;
          std::vector<float> mf_ref = mf, vf_ref = vf, mf_got = mf, vf_got = vf;
          AdamState got = want;
          const auto args = [&](AdamState& st, std::vector<std::uint16_t>& p,
                                std::vector<std::uint16_t>& m, std::vector<std::uint16_t>& v,
                                std::vector<float>& m32, std::vector<float>& v32) {
            device::AdamWArgs a = st.args(hyper(true, 0.5f, 3));
            a.master_dtype = DType::kBF16;
            a.rounding_seed = 0x5eed + static_cast<std::uint64_t>(n);
            a.element_offset = 12345;
            a.param = p.data();
            a.state_dtype = state;
            a.exp_avg = state == DType::kBF16 ? static_cast<void*>(m.data()) : m32.data();
            a.exp_avg_sq = state == DType::kBF16 ? static_cast<void*>(v.data()) : v32.data();
            return a;
          };
          device::adamw_reference(args(want, p_ref, m_ref, v_ref, mf_ref, vf_ref));
          device::AdamWArgs a = args(got, p_got, m_got, v_got, mf_got, vf_got);
          const std::vector<std::uint16_t> p_in = p0, m_in = m0, v_in = v0;
          const std::vector<float> mf_in = mf, vf_in = vf;
          if (out_of_place) {
            a.param_in = p_in.data();
            a.exp_avg_in =
                state == DType::kBF16 ? static_cast<const void*>(m_in.data()) : mf_in.data();
            a.exp_avg_sq_in =
                state == DType::kBF16 ? static_cast<const void*>(v_in.data()) : vf_in.data();
            std::fill(p_got.begin(), p_got.end(), 0x7fc1);
          }
          ASSERT_EQ(adam_->step(a), StepOutcome::kUpdated);
          EXPECT_EQ(p_got, p_ref) << "master weights";
          EXPECT_EQ(std::memcmp(got.o(), want.o(), size * dtype_size(out)), 0) << "copy";
          if (state == DType::kBF16) {
            EXPECT_EQ(m_got, m_ref) << "exp_avg";
            EXPECT_EQ(v_got, v_ref) << "exp_avg_sq";
          } else {
            EXPECT_EQ(std::memcmp(mf_got.data(), mf_ref.data(), size * 4), 0) << "exp_avg";
            EXPECT_EQ(std::memcmp(vf_got.data(), vf_ref.data(), size * 4), 0) << "exp_avg_sq";
          }
        }
      }
    }
  }
}

// Every compact setting (optimizer.state_dtype bf16 or int8, master_dtype bf16 with stochastic or
// Kahan rounding, and their mixes) gives the reference's bytes: master weights and their
// compensation, moments and their block scales, and the copy; in place and out of place, over
// lengths off the 64-element blocks, the 2048-element chunks and the tiles; 8-bit moments also
// beside f32 and f16 gradients and with L2 weight decay (the kernels that read their bytes
// themselves are instantiated for each).
TEST_P(CpuAdamPathTest, CompactStatesGiveTheReferencesBytes) {
  using device::MasterRounding;
  const DType kInt8 = device::kAdam8StateDType;
  struct Setting {
    DType master;
    MasterRounding rounding;
    DType state;
  };
  const Setting settings[] = {
      {DType::kF32, MasterRounding::kStochastic, kInt8},
      {DType::kBF16, MasterRounding::kKahan, DType::kF32},
      {DType::kBF16, MasterRounding::kKahan, DType::kBF16},
      {DType::kBF16, MasterRounding::kKahan, kInt8},
      {DType::kBF16, MasterRounding::kStochastic, kInt8},
  };
  struct Grads {
    DType dtype;
    bool adamw_mode;
  };
  struct Copy {
    DType dtype;
    bool has;
  };
  std::uint64_t seed = 2100;
  for (const Setting& set : settings) {
    std::vector<Grads> grads = {{DType::kBF16, true}};
    if (set.state == kInt8) grads.insert(grads.end(), {{DType::kF32, false}, {DType::kF16, true}});
    for (const Grads& grad : grads) {
      for (std::int64_t n : {1, 255, 257, 2049, 70001}) {
        for (const Copy copy : {Copy{DType::kBF16, true}, Copy{DType::kF32, true},
                                Copy{DType::kF16, true}, Copy{DType::kBF16, false}}) {
          const DType out = copy.dtype;
          for (const bool out_of_place : {false, true}) {
            SCOPED_TRACE("master " + std::string(dtype_name(set.master)) +
                         (set.rounding == MasterRounding::kKahan ? " kahan" : "") + ", moments " +
                         std::string(dtype_name(set.state)) + ", n=" + std::to_string(n) +
                         (copy.has ? ", copy " + std::string(dtype_name(out)) : ", no copy") +
                         (out_of_place ? ", out of place" : "") + ", " +
                         std::string(dtype_name(grad.dtype)) + " gradients" +
                         (grad.adamw_mode ? "" : ", L2 decay"));
            AdamState want = make_state(n, 0, grad.dtype, out, copy.has, ++seed);
            if (grad.dtype == DType::kF32) {
              // Ordinary gradients (hard values' 1e30s overflow the second moment, and a block
              // holding one has scale 0), and NaN ones (a step without the finite check), whose
              // moments a block's maximum skips and which quantize to byte 0: one after a larger
              // element in its lane (66 and 114 share a block and a lane), so a maximum that
              // kept the NaN would lose it.
              Rng gentle(seed);
              for (std::int64_t i = 0; i < n; ++i) {
                const auto x = static_cast<float>(gentle.normal() * 1e-2);
                std::memcpy(want.g() + i * 4, &x, 4);
              }
              const float nan = std::numeric_limits<float>::quiet_NaN(), big = 30.0f;
              if (n > 114) std::memcpy(want.g() + 66 * 4, &big, 4);
              for (const std::int64_t i : {std::int64_t{5}, std::int64_t{114}, n - 1}) {
                if (i < n) std::memcpy(want.g() + i * 4, &nan, 4);
              }
            }
            AdamState got = want;
            const PackedState start(want, set.master, set.rounding, set.state);
            PackedState ref = start, mine = start;
            device::AdamWArgs r = want.args(hyper(grad.adamw_mode, 0.5f, 3));
            r.rounding_seed = 0xabc + static_cast<std::uint64_t>(n);
            r.element_offset = 4096;
            device::AdamWArgs a = r;
            a.param_out = got.o();
            ref.point(r);
            device::adamw_reference(r);
            mine.point(a);
            if (out_of_place) {
              start.point_in(a);
              std::fill(mine.master.begin(), mine.master.end(), std::byte{0x5a});
              std::fill(mine.exp_avg.begin(), mine.exp_avg.end(), std::byte{0x5a});
              std::fill(mine.exp_avg_sq.begin(), mine.exp_avg_sq.end(), std::byte{0x5a});
            }
            ASSERT_EQ(adam_->step(a, /*check_finite=*/false), StepOutcome::kUpdated);
            EXPECT_TRUE(mine.same_master(ref)) << "master weights";
            EXPECT_TRUE(mine.same_moments(ref)) << "moments";
            if (copy.has) {
              EXPECT_EQ(
                  std::memcmp(got.o(), want.o(), static_cast<std::size_t>(n) * dtype_size(out)), 0)
                  << "copy";
            }
          }
        }
      }
    }
  }
}

// The 8-bit quantizers and dequantizers themselves give the reference's bytes where rounding is
// decided: every threshold of both codes, the floats beside it, both signs (a tie takes the
// smaller magnitude either way), zeros, whole and partial blocks; and between the thresholds
// (every 4099th f32 in [0, 1], where AVX-512 finds the byte by arithmetic, not by a search);
// every byte dequantized at an ordinary and at a tiny scale.
TEST_P(CpuAdamPathTest, EightBitKernelsGiveTheReferencesBytesAtEveryThreshold) {
  const PathCase& c = GetParam();
  if (c.threads != 1) GTEST_SKIP() << "the kernels run on one thread; the 1-thread cases test them";
  const detail::KernelSet kernels = kernels_of(c);
  for (const bool second : {false, true}) {
    const device::Adam8Search& search = device::adam8_search(second);
    const detail::Quant8Search q = detail::quant8_search(second);
    const float* code = q.value;
    std::vector<float> ys = {0.0f, -0.0f, 1.0f, -1.0f};
    for (const float t : search.threshold) {
      if (!std::isfinite(t)) break;
      for (const float y : {std::nextafter(t, 0.0f), t, std::nextafter(t, 2.0f)}) {
        ys.push_back(y);
        if (!second) ys.push_back(-y);
      }
    }
    for (std::uint32_t bits = 0; bits <= 0x3f800000u; bits += 4099) {
      ys.push_back(std::bit_cast<float>(bits));
      if (!second) ys.push_back(-ys.back());
    }
    for (std::size_t at = 0; at < ys.size(); at += device::kAdam8BlockElems - 1) {
      // A whole block and a partial one, each with 1 (the scale) last.
      for (const std::size_t len : {std::size_t{device::kAdam8BlockElems - 1}, std::size_t{36}}) {
        std::vector<float> x(
            ys.begin() + static_cast<std::ptrdiff_t>(at),
            ys.begin() + static_cast<std::ptrdiff_t>(std::min(ys.size(), at + len)));
        x.push_back(1.0f);
        if (second) {
          for (float& e : x) e = e * e;  // v whose root is y
        }
        const auto n = static_cast<std::int64_t>(x.size());
        std::vector<std::uint8_t> want(x.size()), got(x.size(), 0xaa);
        float want_scale = 0, got_scale = -1;
        second ? device::adam8_quantize_v(x.data(), n, want.data(), &want_scale)
               : device::adam8_quantize_m(x.data(), n, want.data(), &want_scale);
        kernels.quant8(q, x.data(), n, got.data(), &got_scale);
        ASSERT_EQ(got_scale, want_scale);
        ASSERT_EQ(got, want) << (second ? "unsigned" : "signed") << " code, values from " << at;
      }
    }
    // A NaN (a step without the finite check) is skipped by the block's maximum, as std::max
    // skips it in the reference, and takes byte 0, in whichever lane and vector it falls: here
    // after the largest element in its lane, and before.
    for (std::size_t at = 0; at < device::kAdam8BlockElems; ++at) {
      std::vector<float> x(device::kAdam8BlockElems, 0.25f);
      x[3] = second ? 9.0f : -3.0f;
      if (at == 3) continue;
      x[at] = std::numeric_limits<float>::quiet_NaN();
      std::vector<std::uint8_t> want(x.size()), got(x.size(), 0xaa);
      float want_scale = 0, got_scale = -1;
      const auto n = static_cast<std::int64_t>(x.size());
      second ? device::adam8_quantize_v(x.data(), n, want.data(), &want_scale)
             : device::adam8_quantize_m(x.data(), n, want.data(), &want_scale);
      kernels.quant8(q, x.data(), n, got.data(), &got_scale);
      ASSERT_EQ(want_scale, 3.0f);
      ASSERT_EQ(got_scale, want_scale) << "NaN at " << at;
      ASSERT_EQ(got, want) << "NaN at " << at;
    }
    std::vector<std::uint8_t> bytes(256);
    for (int b = 0; b < 256; ++b) bytes[static_cast<std::size_t>(b)] = static_cast<std::uint8_t>(b);
    for (const float scale : {0.37f, 3e-20f}) {
      for (const std::int64_t n : {std::int64_t{256}, std::int64_t{77}}) {
        std::vector<float> want(256, 0.0f), got(256, 5.0f);
        second ? device::adam8_dequantize_v(bytes.data(), scale, n, want.data())
               : device::adam8_dequantize_m(bytes.data(), scale, n, want.data());
        std::fill(want.begin() + n, want.end(), 5.0f);  // past n: untouched
        kernels.dequant8(code, bytes.data(), scale, n, second, got.data());
        ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * 4), 0)
            << (second ? "unsigned" : "signed") << " code, scale " << scale << ", n " << n;
      }
    }
  }
}

// The stochastic-rounding kernel gives the scalar loop's bits (device::adamw_reference's), its
// random draws included, on ordinary values and on infinities, NaNs, zeros and subnormals, from
// any first element, over whole vectors and a partial one.
TEST_P(CpuAdamPathTest, StochasticRoundingKernelGivesTheReferencesBits) {
  const PathCase& c = GetParam();
  if (c.threads != 1) GTEST_SKIP() << "the kernels run on one thread; the 1-thread cases test them";
  const detail::KernelSet kernels = kernels_of(c);
  const std::uint32_t edges[] = {0x7f800000u, 0xff800000u, 0x7fc12345u, 0xff812345u, 0x00000000u,
                                 0x80000000u, 0x00012345u, 0x7f7fffffu, 0x3f80ffffu, 0xbf808000u};
  Rng rng(77);
  std::vector<float> x(1000);
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = i % 7 == 3 ? std::bit_cast<float>(edges[(i / 7) % std::size(edges)])
                      : static_cast<float>(rng.normal());
  }
  for (const std::uint64_t first :
       {std::uint64_t{0}, std::uint64_t{4097}, std::uint64_t{1} << 40}) {
    for (const std::int64_t n : {std::int64_t{1000}, std::int64_t{37}}) {
      std::vector<float> want(x.begin(), x.begin() + n), got = want;
      std::vector<std::uint16_t> want_bits(static_cast<std::size_t>(n)), got_bits(want_bits.size());
      detail::round_stochastic_scalar(want.data(), n, 0x5eedull, first, want_bits.data());
      kernels.round_stochastic(got.data(), n, 0x5eedull, first, got_bits.data());
      ASSERT_EQ(got_bits, want_bits) << "first " << first << ", n " << n;
      ASSERT_EQ(std::memcmp(got.data(), want.data(), want.size() * 4), 0);
    }
  }
  // The scalar loop is the reference's statement.
  const std::vector<float> values = {1.001f, -3.5f, 7e-30f, 65504.7f};
  std::vector<float> y = values;
  std::vector<std::uint16_t> bits(values.size());
  detail::round_stochastic_scalar(y.data(), 4, 9, 100, bits.data());
  for (std::size_t j = 0; j < values.size(); ++j) {
    const auto r = static_cast<std::uint32_t>(splitmix64_at(9, 100 + j));
    EXPECT_EQ(bits[j], f32_to_bf16_stochastic(values[j], r).bits) << j;
    EXPECT_EQ(y[j], bf16_to_f32(bf16{bits[j]})) << j;
  }
}

// With lr = 0 the update leaves param unchanged (p * 1 - 0), so param_out is exactly the
// conversion of chosen values: ties, subnormals, overflow, NaN payloads, signed zeros.
TEST_P(CpuAdamPathTest, HalfPrecisionEdgeCasesMatchTheScalarConversions) {
  const std::uint32_t edges[] = {
      0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x3f807fffu,  // bf16 ties and near-ties
      0x00012345u, 0x80012345u, 0x007fffffu, 0x807fffffu,  // f32 subnormals
      0x00008000u, 0x00007fffu, 0x00018000u, 0x00000001u,  // bf16 subnormal ties
      0x7f7fffffu, 0xff7fffffu, 0x7f7f8000u, 0x7f7f7fffu,  // bf16 overflow to Inf and not
      0x477fe000u, 0x477fefffu, 0x477ff000u, 0x477ff001u,  // f16 65504, just below/at 65520
      0x501502f9u, 0xd01502f9u, 0x7f800000u, 0xff800000u,  // 1e10 -> Inf, Inf itself
      0x33000000u, 0x33000001u, 0x33c00000u, 0x33a00000u,  // f16 subnormal ties: 2^-25 ...
      0x387fc000u, 0x387fe000u, 0x38800000u, 0x387ff000u,  // around the f16 normal minimum
      0x7fc12345u, 0xffc00001u, 0x7f800001u, 0xff812345u,  // NaN payloads (quiet, signalling)
      0x00000000u, 0x80000000u, 0x3f800000u, 0xbf800000u,  // zeros, +-1
  };
  constexpr std::int64_t kEdges = std::size(edges);
  for (DType od : kOutDtypes) {
    for (int offset : {0, 1, 5}) {
      const std::int64_t n = 3 * kEdges + 5;  // vector body and masked tail both see edges
      AdamState want = make_state(n, offset, DType::kF32, od, true, 99);
      for (std::int64_t i = 0; i < n; ++i) want.p()[i] = std::bit_cast<float>(edges[i % kEdges]);
      AdamState got = want;
      device::AdamWArgs h = hyper(true, 1.0f);
      h.lr = 0.0f;
      device::adamw_reference(want.args(h));
      ASSERT_EQ(adam_->step(got.args(h)), StepOutcome::kUpdated);
      ASSERT_EQ(compare_states(got, want), "") << "out " << dtype_name(od) << " offset " << offset;
    }
  }
  // And the scalar conversions themselves are what they should be.
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f808000u)).bits, 0x3f80);  // tie to even
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x3f818000u)).bits, 0x3f82);
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x007fffffu)).bits, 0x0080);  // subnormal rounds up
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x7f7fffffu)).bits, 0x7f80);  // overflow to Inf
  EXPECT_EQ(f32_to_f16(65520.0f).bits, 0x7c00);
  EXPECT_EQ(f32_to_f16(65519.0f).bits, 0x7bff);
  EXPECT_EQ(f32_to_f16(std::bit_cast<float>(0x33000000u)).bits, 0x0000);  // 2^-25 ties to 0
  EXPECT_EQ(f32_to_f16(std::bit_cast<float>(0x33c00000u)).bits, 0x0002);  // 3*2^-25 -> even
}

TEST_P(CpuAdamPathTest, NonFiniteGradientLeavesEveryBufferUntouched) {
  struct Bad {
    DType dtype;
    std::uint32_t bits;
  };
  const Bad bads[] = {
      {DType::kF32, 0x7fc00000u}, {DType::kF32, 0x7f800000u}, {DType::kF32, 0xff800000u},
      {DType::kF32, 0x7f800001u}, {DType::kBF16, 0x7fc0u},    {DType::kBF16, 0xff80u},
      {DType::kF16, 0x7e00u},     {DType::kF16, 0x7c00u},     {DType::kF16, 0xfc00u}};
  std::uint64_t seed = 500;
  for (const Bad& bad : bads) {
    for (std::int64_t n : {1, 17, 100003}) {
      for (std::int64_t where : {std::int64_t{0}, n / 2, n - 1}) {
        AdamState before = make_state(n, 1, bad.dtype, DType::kBF16, true, ++seed);
        std::memcpy(before.g() + where * static_cast<std::int64_t>(dtype_size(bad.dtype)),
                    &bad.bits, dtype_size(bad.dtype));
        AdamState s = before;
        ASSERT_FALSE(adam_->all_finite(s.g(), bad.dtype, n));
        ASSERT_EQ(adam_->step(s.args(hyper(true, 1.0f))), StepOutcome::kSkippedNonFinite);
        ASSERT_EQ(compare_states(s, before), "")
            << dtype_name(bad.dtype) << " 0x" << std::hex << bad.bits << std::dec << " at " << where
            << " of " << n;
      }
    }
  }
}

TEST_P(CpuAdamPathTest, FiniteScanAcceptsSubnormalsAndMaxima) {
  for (DType gd : kGradDtypes) {
    AdamState s = make_state(1037, 0, gd, DType::kF32, false, 3);
    EXPECT_TRUE(adam_->all_finite(s.g(), gd, s.n)) << dtype_name(gd);
    const std::uint32_t max_bits = gd == DType::kF32    ? 0x7f7fffffu
                                   : gd == DType::kBF16 ? 0x7f7fu
                                                        : 0x7bffu;
    std::memcpy(s.g() + (s.n - 1) * static_cast<std::int64_t>(dtype_size(gd)), &max_bits,
                dtype_size(gd));
    EXPECT_TRUE(adam_->all_finite(s.g(), gd, s.n)) << dtype_name(gd);
  }
}

TEST_P(CpuAdamPathTest, RooflineMovesTheSameArraysWithATrivialCombine) {
  AdamState s = make_state(1003, 1, DType::kF32, DType::kF32, true, 11);
  std::vector<float> p0(s.p(), s.p() + s.n), m0(s.m(), s.m() + s.n);
  adam_->memory_roofline(s.args(hyper(true, 1.0f)));
  const auto* g = reinterpret_cast<const float*>(s.g());
  for (std::int64_t i = 0; i < s.n; ++i) {
    ASSERT_EQ(std::bit_cast<std::uint32_t>(s.p()[i]), std::bit_cast<std::uint32_t>(p0[i] + g[i]));
    ASSERT_EQ(std::bit_cast<std::uint32_t>(s.m()[i]), std::bit_cast<std::uint32_t>(m0[i] + g[i]));
    ASSERT_EQ(std::bit_cast<std::uint32_t>(reinterpret_cast<float*>(s.o())[i]),
              std::bit_cast<std::uint32_t>(s.p()[i]));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Paths, CpuAdamPathTest,
    ::testing::Values(PathCase{"scalar", false, 1, 1 << 15}, PathCase{"avx2", false, 1, 1 << 15},
                      PathCase{"avx512", false, 1, 1 << 15}, PathCase{"avx512", true, 1, 1 << 15},
                      PathCase{"scalar", false, 2, 64}, PathCase{"avx2", false, 2, 64},
                      PathCase{"avx512", false, 2, 64}, PathCase{"avx512", true, 2, 1024}),
    path_case_name);

// Non-temporal stores only change how bytes reach memory, never which bytes.
TEST(CpuAdamOptions, NontemporalStoresGiveTheSameBytes) {
  for (const char* simd : {"avx2", "avx512"}) {
    const SimdPath path = std::string(simd) == "avx2" ? SimdPath::kAvx2 : SimdPath::kAvx512;
    if (!cpu_supports(path)) continue;
    CpuAdamOptions o;
    o.simd = simd;
    o.stores = CpuAdamOptions::Stores::kStreaming;
    o.nontemporal_min_elems = 0;
    o.threads = 2;
    o.tile_elems = 4096;
    auto adam = CpuAdam::create(o);
    ASSERT_TRUE(adam.is_ok()) << adam.status().to_string();
    for (int offset : {0, 1, 7}) {
      AdamState want = make_state(100003, offset, DType::kBF16, DType::kBF16, true, 5);
      AdamState got = want;
      device::adamw_reference(want.args(hyper(true, 1.0f)));
      ASSERT_EQ(adam->step(got.args(hyper(true, 1.0f))), StepOutcome::kUpdated);
      ASSERT_EQ(compare_states(got, want), "") << simd << " offset " << offset;
    }
  }
}

// kAuto times the open variants on the first large steps and keeps the fastest, once per
// process; explicit choices are kept as given and need no timing. Every variant's bytes are the
// reference's, on spans long enough to stream.
TEST(CpuAdamOptions, AutoChoosesOnTheFirstLargeStepsAndKeepsTheFastest) {
  if (!cpu_supports(SimdPath::kAvx2)) GTEST_SKIP() << "no SIMD path: nothing to choose";
  using Stores = CpuAdamOptions::Stores;
  using Prefetch = CpuAdamOptions::Prefetch;
  const std::int64_t n = (1 << 20) + 77;
  const auto step_matches_reference = [&](CpuAdam& adam, std::uint64_t seed) {
    AdamState want = make_state(n, 0, DType::kF32, DType::kBF16, true, seed);
    AdamState got = want;
    device::adamw_reference(want.args(hyper(true, 1.0f)));
    EXPECT_EQ(adam.step(got.args(hyper(true, 1.0f))), StepOutcome::kUpdated);
    return compare_states(got, want);
  };
  // AVX2 (explicit, so STRATA_SIMD cannot change it), threads 2 and regular stores: a kind of
  // its own, so no other test has tuned it already.
  const CpuAdamOptions kind{
      .threads = 2, .simd = "avx2", .stores = Stores::kRegular, .prefetch = Prefetch::kAuto};
  auto first = CpuAdam::create(kind);
  ASSERT_TRUE(first.is_ok());
  if (first->calibration() != nullptr) GTEST_SKIP() << "already tuned in this process (repeat)";
  AdamState small = make_state(1000, 0, DType::kF32, DType::kBF16, true, 3);
  EXPECT_EQ(first->step(small.args(hyper(true, 1.0f))), StepOutcome::kUpdated);
  EXPECT_EQ(first->calibration(), nullptr) << "a short span is not timed";
  EXPECT_FALSE(first->uses_prefetch()) << "the baseline until the choice is made";
  int steps = 0;
  while (first->calibration() == nullptr && steps < 20) {
    EXPECT_EQ(step_matches_reference(*first, 10 + static_cast<std::uint64_t>(steps)), "");
    ++steps;
  }
  const KernelCalibration* c = first->calibration();
  ASSERT_NE(c, nullptr) << "two open variants, five samples each, at most 10 steps";
  EXPECT_LE(steps, 2 * 5);
  EXPECT_GT(c->ns_per_elem[0][0], 0.0);
  EXPECT_GT(c->ns_per_elem[0][1], 0.0);
  EXPECT_EQ(c->ns_per_elem[1][0], 0.0) << "streaming was not open, so not timed";
  EXPECT_FALSE(c->streaming);
  if (c->prefetch) {
    EXPECT_LT(c->ns_per_elem[0][1], c->ns_per_elem[0][0]);
  }
  EXPECT_EQ(first->uses_prefetch(), c->prefetch);
  EXPECT_EQ(step_matches_reference(*first, 99), "");
  // A second instance of the same kind starts from the choice.
  auto second = CpuAdam::create(kind);
  ASSERT_TRUE(second.is_ok());
  EXPECT_EQ(second->calibration(), c);
  EXPECT_EQ(second->uses_prefetch(), c->prefetch) << "adopted at creation, before any step";
  EXPECT_EQ(step_matches_reference(*second, 100), "");
  for (auto stores : {Stores::kRegular, Stores::kStreaming}) {
    for (auto prefetch : {Prefetch::kOff, Prefetch::kOn}) {
      auto fixed = CpuAdam::create(
          CpuAdamOptions{.threads = 2, .simd = "avx2", .stores = stores, .prefetch = prefetch});
      ASSERT_TRUE(fixed.is_ok());
      EXPECT_EQ(fixed->uses_streaming_stores(), stores == Stores::kStreaming);
      EXPECT_EQ(fixed->uses_prefetch(), prefetch == Prefetch::kOn);
      EXPECT_EQ(step_matches_reference(*fixed, 7), "");
      EXPECT_EQ(fixed->calibration(), nullptr);
    }
  }
}

// Without the scan, NaN and Inf flow through exactly as in the reference, on every path.
TEST(CpuAdamOptions, CheckFiniteOffPropagatesNonFiniteLikeTheReference) {
  for (const char* simd : {"scalar", "avx2", "avx512"}) {
    auto adam = CpuAdam::create(CpuAdamOptions{.simd = simd});
    if (!adam.is_ok()) continue;  // a path this CPU lacks
    for (DType od : kOutDtypes) {
      AdamState want = make_state(100, 1, DType::kF32, od, true, 8);
      const float specials[] = {
          std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity(), std::bit_cast<float>(0xffc12345u)};
      for (int k = 0; k < 4; ++k) std::memcpy(want.g() + 4 * (10 + 17 * k), &specials[k], 4);
      AdamState got = want;
      device::adamw_reference(want.args(hyper(true, 1.0f)));
      EXPECT_EQ(adam->step(got.args(hyper(true, 1.0f)), /*check_finite=*/false),
                StepOutcome::kUpdated);
      EXPECT_TRUE(std::isnan(got.p()[10]));
      EXPECT_EQ(compare_states(got, want), "") << simd << " out " << dtype_name(od);
    }
  }
}

TEST(CpuAdamOptions, RejectsUnknownPathsAndBadSizes) {
  CpuAdamOptions o;
  o.simd = "sse9";
  auto bad = CpuAdam::create(o);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("'sse9'"), std::string::npos) << bad.status().message();
  o.simd = "auto";
  o.tile_elems = 100;
  EXPECT_FALSE(CpuAdam::create(o).is_ok());
  o.tile_elems = 1 << 15;
  o.threads = -1;
  EXPECT_FALSE(CpuAdam::create(o).is_ok());
}

TEST(CpuAdamOptions, EnvironmentOverridesAutoButNotAnExplicitChoice) {
  ::strata::testing::ScopedEnv simd("STRATA_SIMD", "scalar");
  auto from_env = CpuAdam::create({});
  auto explicit_choice = CpuAdam::create(CpuAdamOptions{.simd = "avx2"});
  simd.set("bogus");
  auto bogus = CpuAdam::create({});
  simd.unset();
  ASSERT_TRUE(from_env.is_ok()) << from_env.status().to_string();
  EXPECT_EQ(from_env->simd(), SimdPath::kScalar);
  if (cpu_supports(SimdPath::kAvx2)) {
    ASSERT_TRUE(explicit_choice.is_ok());
    EXPECT_EQ(explicit_choice->simd(), SimdPath::kAvx2);
  } else {
    EXPECT_EQ(explicit_choice.status().code(), StatusCode::kUnavailable);
  }
  ASSERT_FALSE(bogus.is_ok());
  EXPECT_NE(bogus.status().message().find("STRATA_SIMD"), std::string::npos);
  auto defaults = CpuAdam::create({});
  ASSERT_TRUE(defaults.is_ok());
  const SimdPath best = cpu_supports(SimdPath::kAvx512) ? SimdPath::kAvx512
                        : cpu_supports(SimdPath::kAvx2) ? SimdPath::kAvx2
                                                        : SimdPath::kScalar;
  EXPECT_EQ(defaults->simd(), best);
  EXPECT_GE(defaults->threads(), 1);
}

}  // namespace
}  // namespace strata::optim

namespace strata::optim {
namespace {

// Stochastic rounding to bf16 rounds up (away from zero) for exactly the dropped fraction of
// the 65,536 values its 16 random bits take, so its mean is the value itself; bf16 values stay.
TEST(StochasticRounding, RoundsUpForExactlyTheDroppedFractionOfTheRandomBits) {
  for (const float x : {1.0f + 0x1p-9f, -3.14159f, 1e-30f, 65504.25f, -0x1p-126f, 0.1f}) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
    const std::uint16_t down = static_cast<std::uint16_t>(u >> 16);
    std::uint32_t ups = 0;
    for (std::uint32_t r = 0; r < 65536; ++r) {
      const std::uint16_t b = f32_to_bf16_stochastic(x, r).bits;
      ASSERT_TRUE(b == down || b == down + 1) << x << " " << r;
      ups += b != down ? 1u : 0u;
    }
    EXPECT_EQ(ups, u & 0xffffu) << x;
  }
  for (const float x : {1.0f, -2.5f, 0.0f, -0.0f}) {  // bf16 values: never moved
    for (std::uint32_t r : {0u, 1u, 0xffffu, 0x12345678u}) {
      EXPECT_EQ(f32_to_bf16_stochastic(x, r).bits, f32_to_bf16(x).bits) << x;
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(f32_to_bf16_stochastic(inf, 0xffff).bits, f32_to_bf16(inf).bits);
  EXPECT_EQ(f32_to_bf16_stochastic(std::nanf(""), 0xffff).bits, f32_to_bf16(std::nanf("")).bits);
}

}  // namespace
}  // namespace strata::optim
