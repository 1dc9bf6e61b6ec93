// CpuAdam: every SIMD path, forced through the options, is bit-identical to
// device::adamw_reference (lengths off the vector width, unaligned starts, hard values, every
// dtype, both modes, gradient scales, one and two threads); NaN/Inf gradients change nothing.

#include "tests/unit/optim/cpu_adam_paths.h"

namespace strata::optim {
namespace {

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
