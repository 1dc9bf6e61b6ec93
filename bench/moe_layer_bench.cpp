// A mixture-of-experts MLP's forward + backward on the CPU backend against a dense SwiGLU MLP of
// the same active FLOPs (intermediate = experts_per_token x expert intermediate), at 2,048
// tokens, each the model's own code (MoeMlp, DenseMlp), alternated pair by pair in one process:
// dense, MoE, dense, MoE... The MoE layer routes (router GEMM, softmax and top-k), permutes the
// tokens by expert, runs one SwiGLU per expert over its block of rows, and adds the weighted
// outputs back; its backward adds the router's gradient and the load-balancing loss's. Reported:
// each's median milliseconds and the median of the pairs' ratios MoE / dense.
//   bench_moe_layer [--benchmark_filter=...]   (STRATA_BENCH_PAIRS: pairs, default 5;
//   STRATA_OP_PROFILE=1: each layer's time op by op, after the pairs)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "src/model/dense_mlp.h"
#include "src/model/moe_mlp.h"
#include "strata/device/device.h"
#include "strata/device/op_profile.h"

namespace {

using strata::DType;
using strata::Result;
using strata::Status;
using namespace strata::model::detail;  // NOLINT: the model's private layers, benched
using strata::model::LoraTarget;

constexpr std::int64_t kTokens = 2048;

struct Shape {
  const char* name;
  std::int64_t hidden, experts, k, ffn;
};
// Qwen3-30B-A3B's MoE layer whole; Mixtral-8x7B's routing (8 experts, top 2, ffn 3.5 hidden) at
// a quarter of its width.
const Shape kShapes[] = {{"qwen3-30b-a3b", 2048, 128, 8, 768},
                         {"mixtral-quarter", 1024, 8, 2, 3584}};

class Buffers {
 public:
  explicit Buffers(strata::device::Device& dev) : dev_(dev) {}
  // `elems` elements of `bytes` each, zero-filled.
  void* take(std::int64_t elems, std::size_t bytes) {
    auto b = dev_.allocate(static_cast<std::size_t>(elems) * bytes, "bench");
    if (!b.is_ok()) std::abort();
    void* p = b->data();
    dev_.fill_zero(p, static_cast<std::size_t>(elems) * bytes,
                   dev_.stream(strata::device::StreamKind::kCompute));
    owned_.push_back(std::move(*b));
    return p;
  }
  float* f32(std::int64_t n) { return static_cast<float*>(take(n, 4)); }
  std::int32_t* i32(std::int64_t n) { return static_cast<std::int32_t*>(take(n, 4)); }

 private:
  strata::device::Device& dev_;
  std::vector<strata::device::DeviceBuffer> owned_;
};

void fill_normal(float* p, std::int64_t n, float stddev, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, stddev);
  for (std::int64_t i = 0; i < n; ++i) p[i] = d(rng);
}

// The experts as one array of weights and one of gradients, always resident.
class ArrayExperts final : public ExpertSource {
 public:
  ArrayExperts(float* w, float* g, std::int64_t ffn, std::int64_t hidden)
      : w_(w), g_(g), n_(ffn * hidden) {}
  void prefetch(std::int64_t) override {}
  Result<ExpertWeights> acquire(std::int64_t e) override {
    float* base = w_ + 3 * n_ * e;
    ExpertWeights w;
    w.w = {base, base + n_, base + 2 * n_};
    return w;
  }
  void release(std::int64_t) override {}
  bool trains() const override { return true; }
  Result<ExpertGrads> acquire_grads(std::int64_t e, bool) override {
    float* base = g_ + 3 * n_ * e;
    ExpertGrads g;
    g.w = {base, base + n_, base + 2 * n_};
    return g;
  }
  Status release_grads(std::int64_t) override { return Status::ok(); }
  Status sum_rows(std::vector<double>&) override { return Status::ok(); }
  std::uint64_t bytes() const override { return static_cast<std::uint64_t>(3 * n_) * 4; }
  bool gathers(std::int64_t) const override { return false; }

 private:
  float* w_;
  float* g_;
  std::int64_t n_;
};

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void BM_MoeVsDenseMlp(benchmark::State& state) {
  const Shape& sh = kShapes[state.range(0)];
  const std::int64_t T = kTokens, H = sh.hidden, E = sh.experts, K = sh.k, F = sh.ffn, N = T * K;
  const std::int64_t dense_ffn = K * F;  // the same active FLOPs
  auto dev_or = strata::device::create_device(strata::device::DeviceOptions{});
  if (!dev_or.is_ok()) {
    state.SkipWithError(dev_or.status().message().c_str());
    return;
  }
  strata::device::Device& dev = **dev_or;
  const strata::device::Ops& ops = dev.ops();
  Buffers buf(dev);

  // Input, output gradient and the two layers' weights (small normal values, so the router
  // spreads the tokens as a trained one's load-balancing loss makes it).
  float* x = buf.f32(T * H);
  float* dy = buf.f32(T * H);
  fill_normal(x, T * H, 1.0f, 1);
  fill_normal(dy, T * H, 1e-3f, 2);
  float* router = buf.f32(E * H);
  fill_normal(router, E * H, 0.02f, 3);
  float* experts_w = buf.f32(3 * E * F * H);
  fill_normal(experts_w, 3 * E * F * H, 0.02f, 4);
  float* experts_g = buf.f32(3 * E * F * H);
  float* router_g = buf.f32(E * H);
  float* dense_w = buf.f32(3 * dense_ffn * H);
  fill_normal(dense_w, 3 * dense_ffn * H, 0.02f, 5);
  float* dense_g = buf.f32(3 * dense_ffn * H);
  float* out = buf.f32(T * H);
  float* dx = buf.f32(T * H);

  // The MoE layer, its kept activations and its scratch.
  ArrayExperts source(experts_w, experts_g, F, H);
  BaseFormat base;
  MoeMlp moe;
  moe.device = &dev;
  moe.tokens = T;
  moe.hidden = H;
  moe.experts = E;
  moe.k = K;
  moe.ffn = F;
  moe.normalize = true;
  moe.router = router;
  moe.source = &source;
  moe.base = &base;
  AdapterSpec no_adapters;
  moe.lora = &no_adapters;
  MoeActs a;
  a.probs = buf.f32(T * E);
  a.chosen = buf.i32(N);
  a.weights = buf.f32(N);
  a.tokens = buf.i32(N);
  a.slots = buf.i32(N);
  a.row_weights = buf.f32(N);
  a.gate = buf.f32(N * F);
  a.up = buf.f32(N * F);
  a.m = buf.f32(N * F);
  a.out = buf.f32(N * H);
  std::vector<std::int64_t> host_counts(static_cast<std::size_t>(2 * E + 1));
  a.offsets = host_counts.data();
  a.rows_all = host_counts.data() + E + 1;
  MoeScratch s;
  s.logits = buf.f32(T * E);
  s.logits_f32 = buf.f32(T * E);
  s.rows_in = buf.f32(N * H);
  s.rows_grad = buf.f32(N * H);
  s.dweights = buf.f32(N);
  s.prob_sums = buf.f32(E);
  s.aux_grad = buf.f32(E);
  auto host = dev.allocate_pinned(MoeScratch::host_bytes(T, E, K), "bench routing");
  if (!host.is_ok()) std::abort();
  s.place_host(static_cast<std::byte*>(host->data()), T, E, K);
  float* moe_dm = buf.f32(N * F);
  MoeAux aux;

  // The dense MLP of the same active FLOPs, on one rank, without adapters or biases.
  TensorSplit split;
  split.rows = split.local_rows = T;
  const auto linear = [&](LoraTarget target, std::int64_t o, std::int64_t i, const float* w) {
    Linear l;
    l.target = target;
    l.rows = T;
    l.out = o;
    l.in = i;
    l.w = w;
    l.lora = &no_adapters;
    l.base = &base;
    return l;
  };
  DenseMlp dense;
  dense.gate_up.split = &split;
  dense.gate_up.parts = {linear(LoraTarget::kGate, dense_ffn, H, dense_w),
                         linear(LoraTarget::kUp, dense_ffn, H, dense_w + dense_ffn * H)};
  dense.down.split = &split;
  dense.down.part = linear(LoraTarget::kDown, H, dense_ffn, dense_w + 2 * dense_ffn * H);
  MlpActs da{buf.f32(T * dense_ffn), buf.f32(T * dense_ffn), buf.f32(T * dense_ffn)};
  MlpGrads dg;
  dg.wg = dense_g;
  dg.wu = dense_g + dense_ffn * H;
  dg.wd = dense_g + 2 * dense_ffn * H;
  float* dense_dm = buf.f32(T * dense_ffn);
  auto& stream = dev.stream(strata::device::StreamKind::kCompute);

  const auto run_dense = [&]() {
    const auto t0 = std::chrono::steady_clock::now();
    Status st = dense.forward(ops, x, da, nullptr, out, out);
    if (st.is_ok()) st = dense.backward(ops, x, da, dg, dy, dense_dm, dx, dx, nullptr, {}, nullptr);
    stream.synchronize();
    if (!st.is_ok()) std::abort();
    return ms_since(t0);
  };
  const auto run_moe = [&]() {
    const auto t0 = std::chrono::steady_clock::now();
    aux.reset(E);
    Status st = moe.forward(ops, x, a, s, out, &aux);
    if (st.is_ok()) st = moe.backward(ops, x, a, s, dy, moe_dm, router_g, {}, true, dx);
    stream.synchronize();
    if (!st.is_ok()) std::abort();
    return ms_since(t0);
  };
  run_dense();  // warm-up: first touches, BLAS threads
  run_moe();

  const char* env = std::getenv("STRATA_BENCH_PAIRS");
  const int pairs = env != nullptr ? std::max(1, std::atoi(env)) : 5;
  std::vector<double> dense_ms, moe_ms, ratios;
  for (auto _ : state) {
    for (int p = 0; p < pairs; ++p) {
      dense_ms.push_back(run_dense());
      moe_ms.push_back(run_moe());
      ratios.push_back(moe_ms.back() / dense_ms.back());
    }
    state.SetIterationTime(1e-3 * (median(dense_ms) + median(moe_ms)));
  }
  // With STRATA_OP_PROFILE=1: where each layer's time goes, op by op.
  if (std::getenv("STRATA_OP_PROFILE") != nullptr) {
    for (const auto& [dense_run, label] : {std::pair{true, "dense"}, std::pair{false, "moe"}}) {
      strata::device::reset_op_profile();
      dense_run ? run_dense() : run_moe();
      std::printf("%s %s:\n", sh.name, label);
      for (const auto& t : strata::device::op_profile()) {
        std::printf("  %-22s %6llu calls %9.1f ms %8.1f GFLOP/s\n", t.op.c_str(),
                    static_cast<unsigned long long>(t.calls), t.seconds * 1e3,
                    t.seconds > 0 ? t.flops / t.seconds / 1e9 : 0.0);
      }
    }
  }
  std::int64_t used = 0;
  for (std::int64_t e = 0; e < E; ++e) used += a.rows_all[e] > 0 ? 1 : 0;
  const double flops = 6.0 * 3.0 * static_cast<double>(T) * H * dense_ffn;  // fwd + bwd
  state.counters["dense_ms"] = median(dense_ms);
  state.counters["moe_ms"] = median(moe_ms);
  state.counters["moe_over_dense"] = median(ratios);
  state.counters["ratio_min"] = *std::min_element(ratios.begin(), ratios.end());
  state.counters["ratio_max"] = *std::max_element(ratios.begin(), ratios.end());
  state.counters["dense_GFLOP_per_s"] = flops / median(dense_ms) / 1e6;
  state.counters["experts_used"] = static_cast<double>(used);
  state.SetLabel(std::string(sh.name) + " tokens 2048 hidden " + std::to_string(H) + " experts " +
                 std::to_string(E) + " top " + std::to_string(K) + " ffn " + std::to_string(F) +
                 " vs dense ffn " + std::to_string(dense_ffn));
}

BENCHMARK(BM_MoeVsDenseMlp)
    ->Arg(0)
    ->Arg(1)
    ->Iterations(1)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
