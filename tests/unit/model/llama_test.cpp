// LlamaModel: every parameter's gradient against finite differences, checkpointing bit-identity,
// bf16 agreement, the provider protocol, the activation budget and input validation.
#include "strata/model/llama.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <string>
#include <vector>

#include "strata/core/aligned.h"
#include "strata/core/clock.h"
#include "tests/unit/model/llama_test_util.h"

namespace strata::model {
namespace {

using testing::fill_params;
using testing::make_device;
using testing::TestProvider;
using testing::tiny_config;

constexpr std::int64_t kBatch = 2, kSeq = 5;

struct Batch {
  std::vector<std::int32_t> inputs, targets;
};

// Random tokens; one target is ignored (-1).
Batch make_batch(std::int64_t vocab, std::int64_t batch, std::int64_t seq, std::uint64_t seed) {
  Rng rng(seed);
  Batch b;
  for (std::int64_t i = 0; i < batch * seq; ++i) {
    b.inputs.push_back(static_cast<std::int32_t>(rng.uniform_int(vocab)));
    b.targets.push_back(static_cast<std::int32_t>(rng.uniform_int(vocab)));
  }
  b.targets[3] = -1;
  return b;
}

struct ModelRig {
  explicit ModelRig(bool tied, bool checkpointing, DType dtype = DType::kF32,
                    std::uint64_t limit = 0)
      : ModelRig(tiny_config(tied), checkpointing, dtype, limit) {}
  ModelRig(const LlamaConfig& c, bool checkpointing, DType dtype = DType::kF32,
           std::uint64_t limit = 0)
      : config(c),
        layout(ParamLayout::build(config)),
        device(make_device(limit)),
        provider(layout, *device, dtype),
        model(config, layout, *device, ModelOptions{dtype, checkpointing, std::nullopt}),
        batch(make_batch(config.vocab_size, kBatch, kSeq, 77)) {
    fill_params(layout, provider, 5);
  }
  float loss() {
    auto r = model.forward_loss(provider, batch.inputs.data(), batch.targets.data(), kBatch, kSeq);
    STRATA_CHECK(r.is_ok(), r.status().to_string());
    return *r;
  }
  float train(float grad_scale = 1.0f) {
    provider.zero_grads();
    auto r = model.forward_backward(provider, batch.inputs.data(), batch.targets.data(), kBatch,
                                    kSeq, grad_scale);
    STRATA_CHECK(r.is_ok(), r.status().to_string());
    return *r;
  }

  LlamaConfig config;
  ParamLayout layout;
  std::unique_ptr<device::Device> device;
  TestProvider provider;
  LlamaModel model;
  Batch batch;
};

// Central difference of the f32 loss at one parameter coordinate.
double numeric_grad(ModelRig& s, float* p, double step) {
  const float p0 = *p;
  *p = static_cast<float>(p0 + step);
  const double up = s.loss();
  *p = static_cast<float>(p0 - step);
  const double down = s.loss();
  const double actual_step = (static_cast<double>(static_cast<float>(p0 + step)) -
                              static_cast<double>(static_cast<float>(p0 - step))) /
                             2;
  *p = p0;
  return (up - down) / (2 * actual_step);
}

// Compares analytic and numeric gradients at `coords` of one tensor. The f32 loss carries
// ~1e-7 relative noise, so with step 2e-3 the differences are good to ~5e-4 of the tensor's
// largest gradient (step 1e-2 trades that noise for ~2e-3 of truncation error). The bound is
// relative to the coordinate plus a floor of 2e-3 of that largest gradient: dropping one
// backward term or flipping a sign fails it (checked by breaking the backward on purpose).
void check_coords(ModelRig& s, const TensorSpec& t, const std::vector<std::int64_t>& coords,
                  float grad_scale, int* checked) {
  const float* g = s.provider.grad(t.name);
  float* p = s.provider.param(t.name);
  double gmax = 0;
  for (std::int64_t i = 0; i < t.num_elems; ++i) gmax = std::max<double>(gmax, std::abs(g[i]));
  gmax /= grad_scale;
  ASSERT_GT(gmax, 1e-4) << t.name << " has no gradient";
  for (std::int64_t i : coords) {
    const double analytic = g[i] / grad_scale;
    // Biases move the loss least (a key bias barely moves softmax at all): their differences
    // take the longer step, whose truncation error (~2e-3 relative) is below the f32 noise a
    // 2e-3 step would leave on gradients this small.
    const double numeric = numeric_grad(s, p + i, t.init == TensorInit::kZeros ? 1e-2 : 2e-3);
    const double tol = 2e-2 * std::abs(analytic) + 2e-3 * gmax + 2e-5;
    EXPECT_NEAR(numeric, analytic, tol) << t.name << "[" << i << "]";
    ++*checked;
  }
}

class LlamaGradientTest : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(LlamaGradientTest, EveryParameterMatchesFiniteDifferences) {
  const auto [tied, checkpointing] = GetParam();
  ModelRig s(tied, checkpointing);
  const float grad_scale = 4.0f;
  s.train(grad_scale);
  EXPECT_FALSE(s.provider.any_held());
  Rng rng(9);
  int checked = 0;
  for (const auto& group : s.layout.groups()) {
    for (const auto& t : group.tensors) {
      std::vector<std::int64_t> coords;
      if (t.init == TensorInit::kOnes) {
        for (std::int64_t i = 0; i < t.num_elems; ++i) coords.push_back(i);
      } else {
        for (int k = 0; k < 30; ++k)
          coords.push_back(static_cast<std::int64_t>(rng.uniform_int(t.num_elems)));
      }
      check_coords(s, t, coords, grad_scale, &checked);
    }
  }
  EXPECT_GT(checked, 300);
}

// The family variants: biases (Llama's attention_bias and mlp_bias, Qwen2's q/k/v), Qwen3's
// per-head q/k norms with a head_dim that is not hidden / heads, sliding windows (Mistral, and
// Qwen's from a layer on), and Llama 3's scaled rotary frequencies. Every tensor, checkpointed
// recomputation included.
struct Variant {
  const char* name;
  LlamaConfig config;
};

std::vector<Variant> family_variants() {
  std::vector<Variant> v;
  LlamaConfig c = tiny_config(false);
  c.qkv_bias = c.o_bias = c.mlp_bias = true;
  v.push_back({"LlamaAllBiases", c});
  c = tiny_config(true);
  c.family = ModelFamily::kQwen2;
  c.qkv_bias = true;
  v.push_back({"Qwen2QkvBias", c});
  c = tiny_config(false);
  c.family = ModelFamily::kQwen3;
  c.qk_norm = true;
  c.explicit_head_dim = 6;  // q_dim 24 != hidden 16
  v.push_back({"Qwen3QkNormHeadDim", c});
  c = tiny_config(false);
  c.family = ModelFamily::kMistral;
  c.sliding_window = 2;
  v.push_back({"MistralWindow", c});
  c = tiny_config(false);
  c.family = ModelFamily::kQwen2;
  c.qkv_bias = true;
  c.sliding_window = 3;
  c.window_layers_from = 1;
  v.push_back({"Qwen2WindowFromLayer1", c});
  c = tiny_config(false);
  c.rope_theta = 500000.0;
  c.rope_scaling = {device::RopeScaling::kLlama3, 8.0, 1.0, 4.0, 16.0};
  v.push_back({"Llama3Rope", c});
  return v;
}

class FamilyGradientTest : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(FamilyGradientTest, EveryParameterMatchesFiniteDifferences) {
  const auto [index, checkpointing] = GetParam();
  const Variant variant = family_variants()[static_cast<std::size_t>(index)];
  ModelRig s(variant.config, checkpointing);
  const float grad_scale = 4.0f;
  s.train(grad_scale);
  Rng rng(19);
  int checked = 0;
  for (const auto& group : s.layout.groups()) {
    for (const auto& t : group.tensors) {
      std::vector<std::int64_t> coords;
      if (t.init == TensorInit::kOnes || t.init == TensorInit::kZeros) {
        for (std::int64_t i = 0; i < t.num_elems; ++i) coords.push_back(i);
      } else {
        for (int k = 0; k < 20; ++k)
          coords.push_back(static_cast<std::int64_t>(rng.uniform_int(t.num_elems)));
      }
      check_coords(s, t, coords, grad_scale, &checked);
    }
  }
  EXPECT_GT(checked, 300);
}

INSTANTIATE_TEST_SUITE_P(
    Families, FamilyGradientTest, ::testing::Combine(::testing::Range(0, 6), ::testing::Bool()),
    [](const auto& info) {
      return std::string(
                 family_variants()[static_cast<std::size_t>(std::get<0>(info.param))].name) +
             (std::get<1>(info.param) ? "Checkpointed" : "Stored");
    });

// A window wider than the sequence changes nothing: the same bits as full attention.
TEST(ParamGroupTest, GapsAreWhatNoTensorCoversUpToTheEnd) {
  ParamGroup g;
  TensorSpec a, b;
  a.offset_elems = 0;
  a.num_elems = 100;
  b.offset_elems = kTensorAlignElems;
  b.num_elems = 10;
  g.tensors = {b, a};  // in any order
  g.num_elems = 2 * kTensorAlignElems;
  using Gaps = std::vector<std::pair<std::int64_t, std::int64_t>>;
  EXPECT_EQ(g.gaps(g.num_elems),
            (Gaps{{100, kTensorAlignElems}, {kTensorAlignElems + 10, 2 * kTensorAlignElems}}));
  // A partitioned buffer's padding past the group is a gap too; an end inside a tensor cuts.
  EXPECT_EQ(g.gaps(3 * kTensorAlignElems),
            (Gaps{{100, kTensorAlignElems}, {kTensorAlignElems + 10, 3 * kTensorAlignElems}}));
  EXPECT_EQ(g.gaps(50), Gaps{});
  EXPECT_EQ(g.gaps(kTensorAlignElems + 5), (Gaps{{100, kTensorAlignElems}}));
  // Every tensor of a real layout's groups, and nothing else, lies outside the gaps.
  const ParamLayout layout = ParamLayout::build(tiny_config(false));
  for (const ParamGroup& group : layout.groups()) {
    std::vector<int> covered(static_cast<std::size_t>(group.num_elems), 0);
    for (const TensorSpec& t : group.tensors) {
      for (std::int64_t i = 0; i < t.num_elems; ++i) ++covered[t.offset_elems + i];
    }
    for (const auto& [first, last] : group.gaps(group.num_elems)) {
      for (std::int64_t i = first; i < last; ++i) ++covered[i];
    }
    EXPECT_TRUE(std::all_of(covered.begin(), covered.end(), [](int c) { return c == 1; }))
        << group.name;
  }
}

TEST(LlamaModelTest, AWindowLongerThanTheSequenceIsFullAttention) {
  LlamaConfig wide = tiny_config(false);
  wide.family = ModelFamily::kMistral;
  wide.sliding_window = kSeq;
  ModelRig a(tiny_config(false), false), b(wide, false);
  EXPECT_EQ(a.train(), b.train());
  wide.sliding_window = kSeq - 1;
  ModelRig c(wide, false);
  EXPECT_NE(a.train(), c.train());
}

// The embedding rows the batch looks up (the input-embedding gradient), every coordinate.
TEST_P(LlamaGradientTest, InputEmbeddingRowsMatchFiniteDifferences) {
  const auto [tied, checkpointing] = GetParam();
  ModelRig s(tied, checkpointing);
  s.train(1.0f);
  const auto loc = s.layout.find("model.embed_tokens.weight");
  const std::int64_t hidden = s.config.hidden_size;
  std::set<std::int32_t> used(s.batch.inputs.begin(), s.batch.inputs.end());
  std::vector<std::int64_t> coords;
  for (std::int32_t id : used) {
    for (std::int64_t j = 0; j < hidden; ++j) coords.push_back(id * hidden + j);
  }
  int checked = 0;
  check_coords(s, *loc->tensor, coords, 1.0f, &checked);
  EXPECT_EQ(checked, static_cast<int>(used.size() * hidden));
}

INSTANTIATE_TEST_SUITE_P(TiedAndCheckpointing, LlamaGradientTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "Tied" : "Untied") +
                                  (std::get<1>(info.param) ? "Checkpointed" : "Stored");
                         });

TEST(LlamaModelTest, CheckpointingIsBitwiseIdentical) {
  for (bool tied : {false, true}) {
    ModelRig plain(tied, false), ckpt(tied, true);
    const float a = plain.train(2.0f), b = ckpt.train(2.0f);
    EXPECT_EQ(std::memcmp(&a, &b, sizeof a), 0) << a << " vs " << b;
    for (std::size_t g = 0; g < plain.provider.grads.size(); ++g) {
      EXPECT_EQ(plain.provider.grads[g], ckpt.provider.grads[g]) << "group " << g;
    }
    EXPECT_LT(ckpt.model.activation_bytes(kBatch, kSeq),
              plain.model.activation_bytes(kBatch, kSeq));
  }
}

TEST(LlamaModelTest, GradientsScaleWithGradScaleAndLossMatchesForwardOnly) {
  ModelRig s(false, false);
  const float loss_only = s.loss();
  const float loss = s.train(1.0f);
  EXPECT_EQ(loss, loss_only);
  const auto g1 = s.provider.grads;
  s.train(8.0f);
  // The backward is linear in the loss gradient, and scaling by a power of two commutes with
  // every rounding (no value here is near overflow or the subnormal range), so the gradients
  // are exactly 8x, bit for bit.
  for (std::size_t g = 0; g < g1.size(); ++g) {
    for (std::size_t i = 0; i < g1[g].size(); ++i) {
      ASSERT_EQ(s.provider.grads[g][i], 8.0f * g1[g][i]) << "group " << g << " element " << i;
    }
  }
  // Mean over the 9 valid targets of a near-uniform model: close to log(vocab).
  EXPECT_GT(loss, 0.5 * std::log(17.0));
  EXPECT_LT(loss, 2.0 * std::log(17.0));
}

TEST(LlamaModelTest, Bf16AgreesWithF32) {
  for (bool tied : {false, true}) {
    ModelRig f32(tied, false, DType::kF32), bf(tied, true, DType::kBF16);
    const float a = f32.train(1.0f), b = bf.train(1.0f);
    EXPECT_NEAR(b, a, 2e-2 * std::abs(a)) << "tied " << tied;
    // Gradients point the same way (per group cosine similarity).
    for (std::size_t g = 0; g < f32.provider.grads.size(); ++g) {
      double dot = 0, na = 0, nb = 0;
      for (std::size_t i = 0; i < f32.provider.grads[g].size(); ++i) {
        const double x = f32.provider.grads[g][i], y = bf.provider.grads[g][i];
        dot += x * y;
        na += x * x;
        nb += y * y;
      }
      EXPECT_GT(dot / std::sqrt(na * nb), 0.99) << "group " << g << " tied " << tied;
    }
  }
}

TEST(LlamaModelTest, ProviderProtocol) {
  for (bool tied : {false, true}) {
    ModelRig s(tied, true);
    s.provider.log.clear();
    s.train();
    EXPECT_FALSE(s.provider.any_held());
    const auto& log = s.provider.log;
    auto pos = [&](const std::string& e) {
      const auto it = std::find(log.begin(), log.end(), e);
      EXPECT_NE(it, log.end()) << e;
      return it - log.begin();
    };
    auto count = [&](const std::string& e) { return std::count(log.begin(), log.end(), e); };
    const int head = s.layout.head_group();
    // Every group's gradient is acquired and released exactly once, head first, embed last.
    for (int g = 0; g < s.layout.num_groups(); ++g) {
      EXPECT_EQ(count("G+" + std::to_string(g)), 1) << g;
      EXPECT_EQ(count("G-" + std::to_string(g)), 1) << g;
    }
    EXPECT_LT(pos("G-" + std::to_string(head)), pos("G+2"));
    EXPECT_LT(pos("G-2"), pos("G+1"));  // layer 1's gradient leaves before layer 0's starts
    EXPECT_EQ(log.back(), "G-0");
    if (tied) {
      EXPECT_LT(pos("G+0"), pos("G-" + std::to_string(head)));
    } else {
      EXPECT_GT(pos("G+0"), pos("G-1"));
    }
    // Layer groups: acquired in forward, again in backward; prefetched before use.
    EXPECT_EQ(count("P+1"), 2);
    EXPECT_EQ(count("P+2"), 2);
    EXPECT_LT(pos("F1"), pos("P+1"));
    EXPECT_LT(pos("F2"), pos("P+2"));
    const auto& t = s.model.last_timings();
    EXPECT_GT(t.forward_ms, 0.0);
    EXPECT_GT(t.backward_ms, 0.0);
    EXPECT_GT(t.wait_params_ms, 0.0);
  }
}

TEST(LlamaModelTest, WorkspaceIsAllocatedOncePerShape) {
  ModelRig s(false, false);
  s.train();
  const auto n1 = s.device->memory_stats().num_allocations;
  s.train();
  s.loss();
  EXPECT_EQ(s.device->memory_stats().num_allocations, n1 + 4);  // only the 4 gradient buffers
  // A new shape replaces the workspace; the old one is returned first.
  Batch b = make_batch(s.config.vocab_size, 1, 3, 5);
  auto r = s.model.forward_loss(s.provider, b.inputs.data(), b.targets.data(), 1, 3);
  ASSERT_TRUE(r.is_ok()) << r.status().to_string();
  std::uint64_t params_bytes = 0;
  for (const auto& g : s.layout.groups())
    params_bytes += align_up(static_cast<std::size_t>(g.num_elems) * 4, 64);
  EXPECT_EQ(s.device->memory_stats().in_use_bytes,
            params_bytes + align_up(s.model.activation_bytes(1, 3), 64));
}

TEST(LlamaModelTest, TooSmallBudgetIsOutOfMemory) {
  for (bool ckpt : {false, true}) {
    const LlamaConfig c = tiny_config(false);
    const ParamLayout layout = ParamLayout::build(c);
    LlamaModel probe(c, layout, *make_device(), ModelOptions{DType::kF32, ckpt, std::nullopt});
    std::uint64_t params_bytes = 0;
    for (const auto& g : layout.groups())
      params_bytes += align_up(static_cast<std::size_t>(g.num_elems) * 4, 64);
    // Parameters, gradients and the small shape's activations fit; the big shape's do not.
    const std::uint64_t limit = 2 * params_bytes + probe.activation_bytes(kBatch, kSeq) + 4096;
    ASSERT_GT(probe.activation_bytes(4, 64), limit);
    ModelRig s(false, ckpt, DType::kF32, limit);
    s.train();
    Batch big = make_batch(c.vocab_size, 4, 64, 1);
    auto r =
        s.model.forward_backward(s.provider, big.inputs.data(), big.targets.data(), 4, 64, 1.0f);
    ASSERT_FALSE(r.is_ok());
    EXPECT_EQ(r.status().code(), StatusCode::kOutOfMemory) << r.status().to_string();
    EXPECT_NE(r.status().message().find("activations"), std::string::npos) << r.status().message();
    EXPECT_FALSE(s.provider.any_held());
    // The model recovers once the shape fits again.
    const float loss = s.train();
    EXPECT_TRUE(std::isfinite(loss));
    EXPECT_LE(s.device->memory_stats().peak_bytes, limit);
  }
}

TEST(LlamaModelTest, ProviderFailurePropagatesAndReleasesHeldGroups) {
  ModelRig s(true, false);
  s.provider.fail_acquire_group = s.layout.head_group();
  auto r = s.model.forward_backward(s.provider, s.batch.inputs.data(), s.batch.targets.data(),
                                    kBatch, kSeq, 1.0f);
  ASSERT_FALSE(r.is_ok());
  EXPECT_EQ(r.status().code(), StatusCode::kIoError);
  EXPECT_NE(r.status().message().find("'head'"), std::string::npos) << r.status().message();
  EXPECT_FALSE(s.provider.any_held());
}

TEST(LlamaModelTest, InvalidInputsAreRejected) {
  ModelRig s(false, false);
  Batch b = s.batch;
  b.inputs[4] = 17;
  auto r = s.model.forward_loss(s.provider, b.inputs.data(), b.targets.data(), kBatch, kSeq);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  b = s.batch;
  b.targets[0] = 99;
  r = s.model.forward_loss(s.provider, b.inputs.data(), b.targets.data(), kBatch, kSeq);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  r = s.model.forward_loss(s.provider, b.inputs.data(), b.targets.data(), 1, 65);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  // All targets ignored: loss 0 and no gradient.
  b = s.batch;
  std::fill(b.targets.begin(), b.targets.end(), -1);
  auto t =
      s.model.forward_backward(s.provider, b.inputs.data(), b.targets.data(), kBatch, kSeq, 1.0f);
  ASSERT_TRUE(t.is_ok());
  EXPECT_EQ(*t, 0.0f);
  for (const auto& g : s.provider.grads) {
    for (float x : g) ASSERT_EQ(x, 0.0f);
  }
}

// Timing only (no assertion); run with --gtest_also_run_disabled_tests.
TEST(LlamaModelTest, DISABLED_ForwardBackwardTiming) {
  LlamaConfig c;
  c.vocab_size = 256;
  c.hidden_size = 128;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.intermediate_size = 344;
  const std::int64_t batch = 8, seq = 128;
  const ParamLayout layout = ParamLayout::build(c);
  for (DType dt : {DType::kF32, DType::kBF16}) {
    for (bool ckpt : {false, true}) {
      auto dev = make_device();
      TestProvider p(layout, *dev, dt);
      fill_params(layout, p, 1, 0.02);
      LlamaModel m(c, layout, *dev, ModelOptions{dt, ckpt, std::nullopt});
      Batch b = make_batch(c.vocab_size, batch, seq, 3);
      double best = 1e30, fwd = 0, bwd = 0, wait = 0;
      for (int it = 0; it < 6; ++it) {
        Stopwatch sw;
        auto r = m.forward_backward(p, b.inputs.data(), b.targets.data(), batch, seq, 1.0f);
        ASSERT_TRUE(r.is_ok());
        if (sw.elapsed_ms() < best) {
          best = sw.elapsed_ms();
          fwd = m.last_timings().forward_ms;
          bwd = m.last_timings().backward_ms;
          wait = m.last_timings().wait_params_ms;
        }
      }
      std::printf(
          "%s ckpt=%d: forward_backward %.2f ms (forward %.2f, backward %.2f, of which test "
          "provider %.2f)\n",
          std::string(dtype_name(dt)).c_str(), ckpt, best, fwd, bwd, wait);
    }
  }
}

}  // namespace
}  // namespace strata::model
