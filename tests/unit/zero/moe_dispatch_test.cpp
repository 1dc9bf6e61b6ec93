// Expert parallelism in the MoE layer: G ranks (threads) of T tokens each, every rank holding
// experts / G of the experts, against one rank running all G T tokens as one micro-batch with
// every expert. Each expert then sees the same rows in the same order, so its products are the
// same calls: the outputs, the experts' weight gradients and the input gradients' expert part
// are equal to the bit. The router's logits are exact (dyadic inputs and weights), so both pick
// the same experts; only the router's share of the input gradient is a product over a different
// number of rows, bounded by the arithmetic (2 gamma_E sum |dlogits| |router|).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "src/model/moe_mlp.h"
#include "strata/core/rng.h"
#include "strata/device/device.h"
#include "strata/zero/expert_group.h"
#include "tests/testing/in_process_ranks.h"

namespace strata::model::detail {
namespace {

constexpr std::int64_t kTokens = 16, kHidden = 32, kExperts = 8, kTopK = 2, kFfn = 24;

// Every expert's weights (the same on every rank: one seed) and this holder's gradients of them.
class TestExperts final : public ExpertSource {
 public:
  explicit TestExperts(device::Device& d) {
    Rng rng(7);
    const std::int64_t n = kExperts * 3 * kFfn * kHidden;
    weights_ = *d.allocate(static_cast<std::size_t>(n) * 4, "experts");
    grads_ = *d.allocate(static_cast<std::size_t>(n) * 4, "expert gradients");
    auto* w = static_cast<float*>(weights_.data());
    for (std::int64_t i = 0; i < n; ++i) w[i] = static_cast<float>(0.2 * rng.normal());
    std::memset(grads_.data(), 0, grads_.size());
  }
  void prefetch(std::int64_t) override {}
  Result<ExpertWeights> acquire(std::int64_t e) override {
    acquired.push_back(e);
    ExpertWeights w;
    w.w = {at(weights_, e, 0), at(weights_, e, 1), at(weights_, e, 2)};
    return w;
  }
  void release(std::int64_t) override {}
  bool trains() const override { return true; }
  Result<ExpertGrads> acquire_grads(std::int64_t e, bool) override {
    ExpertGrads g;
    g.w = {at(grads_, e, 0), at(grads_, e, 1), at(grads_, e, 2)};
    return g;
  }
  Status release_grads(std::int64_t) override { return Status::ok(); }
  Status sum_rows(std::vector<double>&) override { return Status::ok(); }  // one data replica
  std::uint64_t bytes() const override { return 0; }
  bool gathers(std::int64_t) const override { return false; }

  const float* grad(std::int64_t e) const {
    return static_cast<const float*>(grads_.data()) + e * 3 * kFfn * kHidden;
  }
  std::vector<std::int64_t> acquired;

 private:
  static void* at(const device::DeviceBuffer& b, std::int64_t e, int which) {
    return static_cast<float*>(b.data()) + (e * 3 + which) * kFfn * kHidden;
  }
  device::DeviceBuffer weights_, grads_;
};

// One MoE layer over `tokens` tokens with its activations, scratch and buffers; expert
// parallelism over `comm` where given.
struct Layer {
  Layer(device::Device& d, std::int64_t tokens, const std::vector<float>& router,
        dist::Communicator* comm)
      : device(d), experts(d), tokens(tokens) {
    if (comm != nullptr) group = zero::make_expert_group(*comm);
    const std::int64_t n = tokens * kTopK;
    const std::int64_t rows = group != nullptr ? group->size() * n : n;
    const auto f32 = [&](std::int64_t elems) {
      buffers.push_back(*d.allocate(static_cast<std::size_t>(elems) * 4, "test"));
      std::memset(buffers.back().data(), 0, buffers.back().size());
      return buffers.back().data();
    };
    const auto pinned = [&](std::int64_t bytes) {
      host.push_back(*d.allocate_pinned(static_cast<std::size_t>(bytes), "test"));
      return host.back().data();
    };
    router_w = static_cast<float*>(f32(kExperts * kHidden));
    std::memcpy(router_w, router.data(), router.size() * 4);
    a.probs = static_cast<float*>(f32(tokens * kExperts));
    a.chosen = static_cast<std::int32_t*>(f32(n));
    a.weights = static_cast<float*>(f32(n));
    a.tokens = static_cast<std::int32_t*>(f32(n));
    a.slots = static_cast<std::int32_t*>(f32(n));
    a.row_weights = static_cast<float*>(f32(n));
    a.gate = f32(rows * kFfn);
    a.up = f32(rows * kFfn);
    a.m = f32(rows * kFfn);
    a.out = f32(n * kHidden);
    offsets.resize(kExperts + 1);
    rows_all.resize(kExperts);
    a.offsets = offsets.data();
    a.rows_all = rows_all.data();
    s.logits = f32(tokens * kExperts);
    s.logits_f32 = static_cast<float*>(f32(tokens * kExperts));
    s.rows_in = f32(n * kHidden);
    s.rows_grad = f32(n * kHidden);
    s.dweights = static_cast<float*>(f32(n));
    s.prob_sums = static_cast<float*>(f32(kExperts));
    s.aux_grad = static_cast<float*>(f32(kExperts));
    s.place_host(static_cast<std::byte*>(pinned(
                     static_cast<std::int64_t>(MoeScratch::host_bytes(tokens, kExperts, kTopK)))),
                 tokens, kExperts, kTopK);
    dm = f32(rows * kFfn);
    x = static_cast<float*>(f32(tokens * kHidden));
    dy = static_cast<float*>(f32(tokens * kHidden));
    y = static_cast<float*>(f32(tokens * kHidden));
    dx = static_cast<float*>(f32(tokens * kHidden));
    if (group != nullptr) {
      ep.group = group.get();
      ep.capacity = rows;
      counts.resize(static_cast<std::size_t>(group->size() * kExperts));
      a.ep_in = f32(rows * kHidden);
      a.ep_counts = counts.data();
      s.ep_a = f32(rows * kHidden);
      s.ep_b = f32(rows * kHidden);
      s.ep_index = static_cast<std::int32_t*>(f32(2 * rows));
      s.host_ep_index = static_cast<std::int32_t*>(pinned(2 * rows * 4));
    }
    mlp.device = &d;
    mlp.tokens = tokens;
    mlp.hidden = kHidden;
    mlp.experts = kExperts;
    mlp.k = kTopK;
    mlp.ffn = kFfn;
    mlp.normalize = true;
    mlp.router = router_w;
    mlp.source = &experts;
    mlp.base = &base;
    mlp.lora = &spec;
    mlp.num_layers = 1;
    mlp.ep = group != nullptr ? &ep : nullptr;
  }
  Status step() {
    STRATA_RETURN_IF_ERROR(mlp.forward(device.ops(), x, a, s, y, nullptr));
    return mlp.backward(device.ops(), x, a, s, dy, dm, nullptr, {}, false, dx);
  }

  device::Device& device;
  TestExperts experts;
  std::unique_ptr<ExpertGroup> group;
  std::int64_t tokens;
  std::vector<device::DeviceBuffer> buffers;
  std::vector<device::PinnedBuffer> host;
  std::vector<std::int64_t> offsets, rows_all, counts;
  float* router_w = nullptr;
  float *x = nullptr, *dy = nullptr, *y = nullptr, *dx = nullptr;
  void* dm = nullptr;
  MoeActs a;
  MoeScratch s;
  BaseFormat base;
  AdapterSpec spec;
  ExpertParallel ep;
  MoeMlp mlp;
};

std::unique_ptr<device::Device> one_thread_device() {
  device::DeviceOptions o;
  o.compute_threads = 1;  // as each in-process rank's
  return std::move(*device::create_device(o));
}

void expert_parallel_matches_one_rank(int ranks) {
  SCOPED_TRACE(std::to_string(ranks) + " ranks");
  const std::int64_t all = ranks * kTokens;
  // Dyadic inputs and router: every logit an exact sum, whatever the order of its terms.
  Rng rng(11);
  std::vector<float> router(static_cast<std::size_t>(kExperts * kHidden));
  for (float& r : router) r = static_cast<float>(static_cast<int>(rng.uniform() * 9) - 4) / 8;
  std::vector<float> x(static_cast<std::size_t>(all * kHidden)), dy(x.size());
  for (float& v : x) v = static_cast<float>(static_cast<int>(rng.uniform() * 17) - 8) / 8;
  for (float& v : dy) v = static_cast<float>(rng.normal());

  const std::unique_ptr<device::Device> one = one_thread_device();
  Layer ref(*one, all, router, nullptr);
  std::memcpy(ref.x, x.data(), x.size() * 4);
  std::memcpy(ref.dy, dy.data(), dy.size() * 4);
  ASSERT_TRUE(ref.step().is_ok());

  auto g = ::strata::testing::make_in_process_ranks(ranks);
  g.run([&](int r) {
    dist::Communicator& comm = *g.comms[static_cast<std::size_t>(r)];
    Layer layer(*g.devices[static_cast<std::size_t>(r)], kTokens, router, &comm);
    const std::size_t at = static_cast<std::size_t>(r * kTokens * kHidden);
    const std::size_t n = static_cast<std::size_t>(kTokens * kHidden);
    std::memcpy(layer.x, x.data() + at, n * 4);
    std::memcpy(layer.dy, dy.data() + at, n * 4);
    const Status s = layer.step();
    ASSERT_TRUE(s.is_ok()) << s.message();
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(layer.y[i], ref.y[at + i]) << "rank " << r << " output " << i;
    }
    // The router's share of dx is a product over E terms: two orders differ by at most
    // 2 gamma_E sum_j |dlogits_j| |router_j| (dlogits are left in s.logits), and the sum into dx
    // rounds once more.
    const double u = std::numeric_limits<float>::epsilon() / 2;
    const double gamma = kExperts * u / (1 - kExperts * u);
    const auto* dlogits = static_cast<const float*>(layer.s.logits);
    for (std::int64_t t = 0; t < kTokens; ++t) {
      for (std::int64_t h = 0; h < kHidden; ++h) {
        double bound = 0;
        for (std::int64_t j = 0; j < kExperts; ++j) {
          bound += std::fabs(dlogits[t * kExperts + j]) * std::fabs(router[j * kHidden + h]);
        }
        const std::size_t i = static_cast<std::size_t>(t * kHidden + h);
        bound = 2 * gamma * bound + 2 * u * std::fabs(ref.dx[at + i]);
        EXPECT_LE(std::fabs(layer.dx[i] - ref.dx[at + i]), bound) << "rank " << r << " dx " << i;
      }
    }
    // This rank's experts: the one rank's gradients to the bit; the others never asked for.
    const std::int64_t local = kExperts / ranks;
    const std::size_t per = static_cast<std::size_t>(3 * kFfn * kHidden);
    for (std::int64_t e = 0; e < kExperts; ++e) {
      const bool mine = e / local == r;
      const float* got = layer.experts.grad(e);
      for (std::size_t i = 0; i < per; ++i) {
        ASSERT_EQ(got[i], mine ? ref.experts.grad(e)[i] : 0.0f) << "rank " << r << " expert " << e;
      }
    }
    for (const std::int64_t e : layer.experts.acquired) EXPECT_EQ(e / local, r) << e;
    // What left the rank: each row sent to another rank's expert goes and its output comes
    // back, in forward and again in backward, H f32 each way.
    std::int64_t away = 0;
    for (int q = 0; q < ranks; ++q) {
      if (q == r) continue;
      for (std::int64_t l = 0; l < local; ++l) {
        away += layer.counts[static_cast<std::size_t>(r * kExperts + q * local + l)];  // sent
        away += layer.counts[static_cast<std::size_t>(q * kExperts + r * local + l)];  // back
      }
    }
    EXPECT_GT(away, 0);
    EXPECT_EQ(comm.stats().all_to_all_bytes, static_cast<std::uint64_t>(2 * away * kHidden * 4));
  });
}

TEST(MoeDispatch, ExpertParallelRanksComputeWhatOneRankDoesOverAllTheirTokens) {
  for (const int ranks : {2, 4}) expert_parallel_matches_one_rank(ranks);
}

// Experts that do not split over the group are refused, naming both counts.
TEST(MoeDispatch, ExpertsThatDoNotSplitOverTheRanksAreRefused) {
  auto g = ::strata::testing::make_in_process_ranks(3);
  std::vector<float> router(static_cast<std::size_t>(kExperts * kHidden), 0.0f);
  g.run([&](int r) {
    Layer layer(*g.devices[static_cast<std::size_t>(r)], kTokens, router,
                g.comms[static_cast<std::size_t>(r)].get());
    const Status s =
        layer.mlp.forward(layer.device.ops(), layer.x, layer.a, layer.s, layer.y, nullptr);
    EXPECT_NE(s.message().find("over 3 ranks: 8 experts do not split evenly"), std::string::npos)
        << s.message();
  });
}

}  // namespace
}  // namespace strata::model::detail
