// Causal GQA attention throughput of every variant the config key `attention` chooses from
// (kernels/launchers.h: kFlash2, mma.sync with register-resident softmax and cp.async; kSimple,
// one block per row, the fallback), forward,
// backward and both, at TinyLlama's shape (batch 1, seq 2048, 32 heads, 4 kv heads, head_dim 64)
// and at head_dim 128, in TFLOP/s: 4 b h s^2 d / 2 for the causal forward (two products over
// half the score matrix), 2.5 times that for the backward (five products). The variants race in
// the same run; the last lines print each shape's figures, flash2's speedup over the simple
// kernels and the fastest variant ("auto" runs flash2 where it applies). The first flash variant
// (WMMA through shared memory) was removed after this bench measured flash2 at 3.2-4.0 times its
// speed on an H200.
//
// Before timing, each variant's output is verified on sampled rows (two heads, rows at tile
// edges, the first and the last) against a double-precision reference within the error bounds
// of its arithmetic (those of tests/unit/device/attention_reference.h): out and lse, and dq
// computed from the variant's own out and lse.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/launchers.h"
#include "strata/core/dtype.h"

namespace {

namespace k = strata::kernels;
using k::AttentionKernel;

constexpr double kU = 0x1p-24;     // f32 unit roundoff
constexpr double kUBf16 = 0x1p-8;  // bf16 rounding of outputs, P and dS
// Relative error of an f32 sum of n terms against sum|terms| (f32_sum_error in the tests).
double sum_error(std::int64_t n) {
  const double t = static_cast<double>(std::max<std::int64_t>(n, 1));
  return std::min(t, 6.0 * std::sqrt(t)) * kU + 2 * kU;
}

struct Shape {
  std::int64_t batch = 1, seq = 2048, heads = 32, kv_heads = 4, head_dim = 64;
  k::AttentionDims dims() const { return {batch, seq, heads, kv_heads, head_dim, 0}; }
  std::int64_t q_elems() const { return batch * seq * heads * head_dim; }
  std::int64_t kv_elems() const { return batch * seq * kv_heads * head_dim; }
  double forward_flops() const {
    return 4.0 * static_cast<double>(batch * heads) * static_cast<double>(seq) *
           static_cast<double>(seq) * static_cast<double>(head_dim) / 2.0;
  }
};

// One shape's inputs (host copies, filled once) and device buffers.
struct Buffers {
  Shape shape;
  std::vector<strata::bf16> q, k, v, dout;
  struct {
    void *q = nullptr, *k = nullptr, *v = nullptr, *dout = nullptr, *out = nullptr;
    void *dq = nullptr, *dk = nullptr, *dv = nullptr, *scratch = nullptr;
    float* lse = nullptr;
  } dev;
  std::string error;

  explicit Buffers(const Shape& s) : shape(s) {
    std::uint64_t x = 0x9e3779b97f4a7c15ull;
    auto fill = [&x](std::vector<strata::bf16>& t, std::int64_t n, float lo, float hi) {
      t.resize(static_cast<std::size_t>(n));
      for (auto& e : t) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        const double u = static_cast<double>(x >> 11) / 9007199254740992.0;
        e = strata::f32_to_bf16(static_cast<float>(lo + (hi - lo) * u));
      }
    };
    fill(q, s.q_elems(), -1.5f, 1.5f);  // scores of a few units, as in the attention test
    fill(k, s.kv_elems(), -1.5f, 1.5f);
    fill(v, s.kv_elems(), -1.0f, 1.0f);
    fill(dout, s.q_elems(), -1.0f, 1.0f);
    const std::size_t qb = static_cast<std::size_t>(s.q_elems()) * 2;
    const std::size_t kb = static_cast<std::size_t>(s.kv_elems()) * 2;
    const std::size_t rows = static_cast<std::size_t>(s.batch * s.heads * s.seq);
    bool ok =
        cudaMalloc(&dev.q, qb) == cudaSuccess && cudaMalloc(&dev.k, kb) == cudaSuccess &&
        cudaMalloc(&dev.v, kb) == cudaSuccess && cudaMalloc(&dev.dout, qb) == cudaSuccess &&
        cudaMalloc(&dev.out, qb) == cudaSuccess && cudaMalloc(&dev.dq, qb) == cudaSuccess &&
        cudaMalloc(&dev.dk, kb) == cudaSuccess && cudaMalloc(&dev.dv, kb) == cudaSuccess &&
        cudaMalloc(reinterpret_cast<void**>(&dev.lse), rows * 4) == cudaSuccess &&
        cudaMalloc(&dev.scratch, k::attention_backward_scratch_bytes(s.dims())) == cudaSuccess;
    ok = ok && cudaMemcpy(dev.q, q.data(), qb, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaMemcpy(dev.k, k.data(), kb, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaMemcpy(dev.v, v.data(), kb, cudaMemcpyHostToDevice) == cudaSuccess &&
         cudaMemcpy(dev.dout, dout.data(), qb, cudaMemcpyHostToDevice) == cudaSuccess;
    if (!ok) error = "cannot allocate or fill the attention buffers";
  }
  ~Buffers() {
    for (void* p : {dev.q, dev.k, dev.v, dev.dout, dev.out, dev.dq, dev.dk, dev.dv,
                    static_cast<void*>(dev.lse), dev.scratch}) {
      if (p != nullptr) cudaFree(p);
    }
  }
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
};

struct Gpu {
  cudaStream_t stream = nullptr;
  k::LaunchContext ctx;
};

int run_forward(const Gpu& g, Buffers& b, AttentionKernel kernel) {
  return k::attention_forward(g.ctx, b.dev.q, b.dev.k, b.dev.v, b.dev.out, b.dev.lse,
                              b.shape.dims(), k::Elem::kBF16, kernel);
}
int run_backward(const Gpu& g, Buffers& b, AttentionKernel kernel) {
  return k::attention_backward(g.ctx, b.dev.dout, b.dev.q, b.dev.k, b.dev.v, b.dev.out, b.dev.lse,
                               b.dev.dq, b.dev.dk, b.dev.dv, b.shape.dims(), k::Elem::kBF16, kernel,
                               b.dev.scratch);
}

double at(const std::vector<strata::bf16>& t, std::int64_t i) {
  return strata::bf16_to_f32(t[static_cast<std::size_t>(i)]);
}

// Checks row i of head h (batch 0) of out, lse and dq; returns "" or what failed.
std::string verify_row(const Buffers& b, const std::vector<strata::bf16>& out,
                       const std::vector<float>& lse, const std::vector<strata::bf16>& dq,
                       std::int64_t h, std::int64_t i) {
  const Shape& s = b.shape;
  const std::int64_t D = s.head_dim, g = h / (s.heads / s.kv_heads);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const std::int64_t qo = (i * s.heads + h) * D;
  auto ko = [&](std::int64_t j) { return (j * s.kv_heads + g) * D; };
  // Forward: the reference's per-row error model (scores, normalisation, P and out rounding).
  std::vector<double> sc(static_cast<std::size_t>(i + 1)), serr(sc.size());
  double mx = -INFINITY, serr_max = 0;
  for (std::int64_t j = 0; j <= i; ++j) {
    double dot = 0, dabs = 0;
    for (std::int64_t x = 0; x < D; ++x) {
      const double t = at(b.q, qo + x) * at(b.k, ko(j) + x);
      dot += t;
      dabs += std::abs(t);
    }
    sc[static_cast<std::size_t>(j)] = dot * scale;
    serr[static_cast<std::size_t>(j)] = sum_error(D) * scale * dabs + kU * std::abs(dot * scale);
    serr_max = std::max(serr_max, serr[static_cast<std::size_t>(j)]);
    mx = std::max(mx, dot * scale);
  }
  double sum = 0;
  for (std::int64_t j = 0; j <= i; ++j) sum += std::exp(sc[static_cast<std::size_t>(j)] - mx);
  const double g_n = sum_error(i + 1);
  const double want_lse = mx + std::log(sum);
  const double lse_got = lse[static_cast<std::size_t>(h * s.seq + i)];
  if (!(std::abs(lse_got - want_lse) <= serr_max + g_n + kU * std::abs(want_lse))) {
    return "lse[h " + std::to_string(h) + ", row " + std::to_string(i) +
           "] = " + std::to_string(lse_got) + ", want " + std::to_string(want_lse);
  }
  for (std::int64_t x = 0; x < D; ++x) {
    double o = 0, bound = 0;
    for (std::int64_t j = 0; j <= i; ++j) {
      const double p = std::exp(sc[static_cast<std::size_t>(j)] - mx) / sum;
      const double vj = at(b.v, ko(j) + x);
      o += p * vj;
      bound += p * std::abs(vj) * (g_n + 2 * (serr[static_cast<std::size_t>(j)] + g_n) + kUBf16);
    }
    bound += kUBf16 * std::abs(o);
    if (!(std::abs(at(out, qo + x) - o) <= bound)) {
      return "out[h " + std::to_string(h) + ", row " + std::to_string(i) + ", " +
             std::to_string(x) + "] = " + std::to_string(at(out, qo + x)) + ", want " +
             std::to_string(o);
    }
  }
  // dq from the variant's own out and lse (inputs here, so their errors do not enter): P and
  // dS carry their fp32 products' errors, the exp2 prescaling's (2u |lse|) and bf16 rounding.
  double di = 0, di_abs = 0;
  for (std::int64_t x = 0; x < D; ++x) {
    di += at(b.dout, qo + x) * at(out, qo + x);
    di_abs += std::abs(at(b.dout, qo + x) * at(out, qo + x));
  }
  std::vector<double> want(static_cast<std::size_t>(D)), bound(want.size());
  for (std::int64_t j = 0; j <= i; ++j) {
    double dot = 0, dabs = 0, dp = 0, dp_abs = 0;
    for (std::int64_t x = 0; x < D; ++x) {
      dot += at(b.q, qo + x) * at(b.k, ko(j) + x);
      dabs += std::abs(at(b.q, qo + x) * at(b.k, ko(j) + x));
      dp += at(b.dout, qo + x) * at(b.v, ko(j) + x);
      dp_abs += std::abs(at(b.dout, qo + x) * at(b.v, ko(j) + x));
    }
    const double p = std::exp(dot * scale - lse_got);
    const double ds = p * (dp - di) * scale;
    const double p_rel = sum_error(D) * scale * dabs + kU * std::abs(dot * scale) +
                         2 * kU * std::abs(lse_got) + 2 * kU + kUBf16;
    const double ds_err =
        scale * p * sum_error(D) * (dp_abs + di_abs) + std::abs(ds) * (p_rel + kUBf16);
    for (std::int64_t x = 0; x < D; ++x) {
      const double kx = at(b.k, ko(j) + x);
      want[static_cast<std::size_t>(x)] += ds * kx;
      bound[static_cast<std::size_t>(x)] += (g_n * std::abs(ds) + ds_err) * std::abs(kx);
    }
  }
  for (std::int64_t x = 0; x < D; ++x) {
    const double w = want[static_cast<std::size_t>(x)];
    if (!(std::abs(at(dq, qo + x) - w) <=
          bound[static_cast<std::size_t>(x)] + kUBf16 * std::abs(w))) {
      return "dq[h " + std::to_string(h) + ", row " + std::to_string(i) + ", " + std::to_string(x) +
             "] = " + std::to_string(at(dq, qo + x)) + ", want " + std::to_string(w);
    }
  }
  return "";
}

// Runs forward and backward once and checks sampled rows; "" or what failed.
std::string verify(const Gpu& g, Buffers& b, AttentionKernel kernel) {
  if (int e = run_forward(g, b, kernel); e != 0) return "forward: " + k::error_text(e);
  if (int e = run_backward(g, b, kernel); e != 0) return "backward: " + k::error_text(e);
  if (cudaStreamSynchronize(g.stream) != cudaSuccess) return "the kernels faulted";
  const Shape& s = b.shape;
  std::vector<strata::bf16> out(static_cast<std::size_t>(s.q_elems())), dq(out.size());
  std::vector<float> lse(static_cast<std::size_t>(s.batch * s.heads * s.seq));
  if (cudaMemcpy(out.data(), b.dev.out, out.size() * 2, cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemcpy(dq.data(), b.dev.dq, dq.size() * 2, cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemcpy(lse.data(), b.dev.lse, lse.size() * 4, cudaMemcpyDeviceToHost) != cudaSuccess) {
    return "cannot download the results";
  }
  for (std::int64_t h : {std::int64_t{0}, s.heads - 1}) {
    for (std::int64_t i : {std::int64_t{0}, std::int64_t{1}, std::int64_t{63}, std::int64_t{64},
                           std::int64_t{65}, s.seq / 2 + 7, s.seq - 1}) {
      if (std::string why = verify_row(b, out, lse, dq, h, i); !why.empty()) return why;
    }
  }
  return "";
}

enum class Pass { kForward, kBackward, kBoth };

// The variants as the config key `attention` names them.
constexpr std::pair<const char*, AttentionKernel> kVariants[] = {
    {"flash2", AttentionKernel::kFlash2},
    {"simple", AttentionKernel::kSimple},
};

using Results = std::map<std::string, double>;  // "hd64/flash2/fwd_bwd" -> TFLOP/s

void BM_Attention(benchmark::State& state, const Gpu& g, Buffers& b, AttentionKernel kernel,
                  Pass pass, const std::string& key, Results& results) {
  if (const std::string why = verify(g, b, kernel); !why.empty()) {
    state.SkipWithError(("verification failed: " + why).c_str());
    return;
  }
  cudaEvent_t start = nullptr, stop = nullptr;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  double seconds = 0;
  // Several passes between the two events, so the host's launch work (attribute queries, a
  // few microseconds a launch) overlaps the GPU's instead of being timed as idle GPU time.
  constexpr int kPassesPerIteration = 10;
  const auto enqueue = [&] {
    int e = 0;
    if (pass != Pass::kBackward) e = run_forward(g, b, kernel);
    if (e == 0 && pass != Pass::kForward) e = run_backward(g, b, kernel);
    return e;
  };
  int e = enqueue();  // warm-up, and a launch already queued before `start`
  for (auto _ : state) {
    cudaEventRecord(start, g.stream);
    for (int i = 0; i < kPassesPerIteration && e == 0; ++i) e = enqueue();
    cudaEventRecord(stop, g.stream);
    if (e != 0 || cudaEventSynchronize(stop) != cudaSuccess) {
      state.SkipWithError(("launch failed: " + k::error_text(e)).c_str());
      break;
    }
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    state.SetIterationTime(ms / 1e3 / kPassesPerIteration);
    seconds += ms / 1e3 / kPassesPerIteration;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (state.iterations() == 0 || seconds <= 0) return;
  const double f = b.shape.forward_flops();
  const double flops = pass == Pass::kForward ? f : pass == Pass::kBackward ? 2.5 * f : 3.5 * f;
  const double tflops = flops * static_cast<double>(state.iterations()) / seconds / 1e12;
  state.counters["tflops"] = tflops;
  results[key] = tflops;
}

}  // namespace

int main(int argc, char** argv) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    std::printf("SKIPPED gpu_attention: no GPU (%s)\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "no devices");
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  Gpu g;
  int device = 0, smem = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess ||
      cudaStreamCreateWithFlags(&g.stream, cudaStreamNonBlocking) != cudaSuccess) {
    std::fprintf(stderr, "cannot set up the GPU\n");
    return 1;
  }
  g.ctx.stream = g.stream;
  g.ctx.max_smem_optin_bytes = static_cast<std::size_t>(smem);
  Results results;
  std::vector<std::unique_ptr<Buffers>> shapes;
  for (std::int64_t hd : {64, 128}) {
    Shape s;
    s.head_dim = hd;
    shapes.push_back(std::make_unique<Buffers>(s));
    if (!shapes.back()->error.empty()) {
      std::fprintf(stderr, "%s\n", shapes.back()->error.c_str());
      return 1;
    }
  }
  const struct {
    const char* name;
    Pass pass;
  } passes[] = {{"fwd", Pass::kForward}, {"bwd", Pass::kBackward}, {"fwd_bwd", Pass::kBoth}};
  for (auto& b : shapes) {
    const std::string hd = "hd" + std::to_string(b->shape.head_dim);
    for (const auto& p : passes) {
      for (const auto& variant : kVariants) {
        const AttentionKernel kernel = variant.second;
        const std::string key = hd + "/" + variant.first + "/" + p.name;
        Buffers* buf = b.get();
        benchmark::RegisterBenchmark(
            ("BM_Attention/b1_s2048_h32_kv4_" + key).c_str(),
            [&g, &results, buf, kernel, pass = p.pass, key](benchmark::State& s) {
              BM_Attention(s, g, *buf, kernel, pass, key, results);
            })
            ->UseManualTime()
            ->MinTime(0.3)
            ->Unit(benchmark::kMillisecond);
      }
    }
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  for (const char* hd : {"hd64", "hd128"}) {
    for (const char* pass : {"fwd", "bwd", "fwd_bwd"}) {
      std::string line, fastest;
      double best = 0;
      for (const auto& variant : kVariants) {
        const auto it = results.find(std::string(hd) + "/" + variant.first + "/" + pass);
        if (it == results.end()) continue;
        char figure[96];
        std::snprintf(figure, sizeof(figure), "%s%s %.1f", line.empty() ? "" : ", ", variant.first,
                      it->second);
        line += figure;
        if (it->second > best) {
          best = it->second;
          fastest = variant.first;
        }
      }
      if (line.empty()) continue;
      const auto simple = results.find(std::string(hd) + "/simple/" + pass);
      const auto flash2 = results.find(std::string(hd) + "/flash2/" + pass);
      char ratio[64] = "";
      if (simple != results.end() && flash2 != results.end()) {
        std::snprintf(ratio, sizeof(ratio), "; flash2/simple %.2fx",
                      flash2->second / simple->second);
      }
      std::printf("attention %s %s: %s TFLOP/s%s; fastest %s\n", hd, pass, line.c_str(), ratio,
                  fastest.c_str());
    }
  }
  shapes.clear();
  cudaStreamDestroy(g.stream);
  return 0;
}
