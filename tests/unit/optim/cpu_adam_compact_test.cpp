// CpuAdam's compact states on every SIMD path: bf16 moments, bf16 master weights (Kahan and
// stochastic rounding) and 8-bit moments give the reference's bits and bytes, at every
// threshold of the 8-bit codes.

#include "tests/unit/optim/cpu_adam_paths.h"

namespace strata::optim {
namespace {

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

}  // namespace
}  // namespace strata::optim
