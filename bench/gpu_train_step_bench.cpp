// Model FLOPs utilization of the training step on the GPU for a 1.1B LLaMA (TinyLlama's shape),
// without offload and with the optimizer offloaded to the CPU, against the bf16 peak that a
// large cuBLASLt GEMM reaches in the same run (measured first, output verified).
//
// MFU = 6 * parameters * tokens / step time / measured peak (attention's own FLOPs are not
// counted, as is usual). Knobs (environment): STRATA_GPU_BENCH_SEQ (2048),
// STRATA_GPU_BENCH_MICRO (micro-batch sequences, 8), STRATA_GPU_BENCH_ACCUM (micro-batches per
// step, 2), STRATA_GPU_BENCH_STEPS (timed steps, 3; one more untimed step warms up),
// STRATA_GPU_BENCH_LAYERS (22).
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/json.h"
#include "strata/device/device.h"
#include "strata/train/config.h"
#include "strata/train/trainer.h"

namespace {

using strata::Json;
namespace dev = strata::device;

std::int64_t env_int(const char* name, std::int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atoll(v) : fallback;
}

struct Shape {
  std::int64_t hidden = 2048, layers = 22, ffn = 5632, heads = 32, kv_heads = 4, vocab = 32000;
  std::int64_t params() const {
    const std::int64_t kv_dim = kv_heads * (hidden / heads);
    const std::int64_t per_layer =
        2 * hidden * hidden + 2 * kv_dim * hidden + 3 * ffn * hidden + 2 * hidden;
    return layers * per_layer + 2 * vocab * hidden + hidden;  // untied embedding and head
  }
};

// ---- bf16 peak: C = A B^T, 8192^3, through the CUDA device's cuBLASLt GEMM.

struct Peak {
  double tflops = 0;
  std::string error;
};

Peak measure_bf16_peak() {
  constexpr std::int64_t kN = 8192;
  Peak peak;
  dev::DeviceOptions o;
  o.kind = strata::device::DeviceKind::kCuda;
  o.memory_limit_bytes = std::uint64_t{1} << 30;
  auto d = dev::create_device(o);
  if (!d.is_ok()) {
    peak.error = d.status().message();
    return peak;
  }
  dev::Device& gpu = **d;
  const std::size_t elems = static_cast<std::size_t>(kN * kN);
  std::vector<strata::bf16> a(elems), b(elems), c(elems);
  std::uint64_t x = 12345;
  auto next = [&x] {  // uniform in [-1, 1), cheap enough for 134M values
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<double>(x >> 11) / 4503599627370496.0 - 1.0);
  };
  for (auto& v : a) v = strata::f32_to_bf16(next());
  for (auto& v : b) v = strata::f32_to_bf16(next());
  auto da = gpu.allocate(elems * 2, "A"), db = gpu.allocate(elems * 2, "B"),
       dc = gpu.allocate(elems * 2, "C");
  if (!da.is_ok() || !db.is_ok() || !dc.is_ok()) {
    peak.error = "cannot allocate the GEMM operands";
    return peak;
  }
  auto& s = gpu.stream(dev::StreamKind::kCompute);
  gpu.copy_to_device(da->data(), a.data(), elems * 2, s);
  gpu.copy_to_device(db->data(), b.data(), elems * 2, s);
  dev::GemmArgs g;
  g.trans_b = true;
  g.m = g.n = g.k = kN;
  g.a = da->data();
  g.lda = kN;
  g.b = db->data();
  g.ldb = kN;
  g.c = dc->data();
  g.ldc = kN;
  g.dtype = strata::DType::kBF16;
  gpu.ops().gemm(g);
  gpu.copy_to_host(c.data(), dc->data(), elems * 2, s);
  s.synchronize();
  // Verify a few elements against a double-precision dot product before timing anything.
  for (std::int64_t t = 0; t < 8; ++t) {
    const std::int64_t i = (t * 1237) % kN, j = (t * 3571 + 17) % kN;
    double want = 0;
    for (std::int64_t p = 0; p < kN; ++p) {
      want += static_cast<double>(strata::bf16_to_f32(a[i * kN + p])) *
              strata::bf16_to_f32(b[j * kN + p]);
    }
    const double got = strata::bf16_to_f32(c[i * kN + j]);
    if (std::abs(got - want) > 1e-2 * std::max(std::abs(want), 30.0)) {
      peak.error = "GEMM verification failed at (" + std::to_string(i) + ", " + std::to_string(j) +
                   "): got " + std::to_string(got) + ", want " + std::to_string(want);
      return peak;
    }
  }
  for (int w = 0; w < 3; ++w) gpu.ops().gemm(g);
  s.synchronize();
  constexpr int kReps = 10;
  const auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < kReps; ++r) gpu.ops().gemm(g);
  s.synchronize();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (const strata::Status err = gpu.last_error(); !err.is_ok()) {
    peak.error = err.to_string();
    return peak;
  }
  peak.tflops = 2.0 * kN * kN * kN * kReps / secs / 1e12;
  return peak;
}

// ---- training steps

std::string token_file(const std::string& dir, std::int64_t vocab) {
  const std::string path = dir + "/tokens.u16";
  if (std::filesystem::exists(path)) return path;
  std::vector<std::uint16_t> tokens(std::size_t{1} << 22);
  std::uint64_t x = 7;
  for (auto& t : tokens) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    t = static_cast<std::uint16_t>((x >> 33) % static_cast<std::uint64_t>(vocab));
  }
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens.data()),
             static_cast<std::streamsize>(tokens.size() * sizeof(std::uint16_t)));
  return path;
}

void BM_GpuTrainStep(benchmark::State& state, const std::string& offload, double peak_tflops) {
  Shape shape;
  shape.layers = env_int("STRATA_GPU_BENCH_LAYERS", shape.layers);
  const std::int64_t seq = env_int("STRATA_GPU_BENCH_SEQ", 2048);
  const std::int64_t micro = env_int("STRATA_GPU_BENCH_MICRO", 8);
  const std::int64_t accum = env_int("STRATA_GPU_BENCH_ACCUM", 2);
  std::size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    state.SkipWithError("cudaMemGetInfo failed");
    return;
  }
  const std::string dir = (std::filesystem::temp_directory_path() / "strata-gpu-bench").string();
  std::filesystem::create_directories(dir);
  Json j = {
      {"model",
       {{"vocab_size", shape.vocab},
        {"hidden_size", shape.hidden},
        {"intermediate_size", shape.ffn},
        {"num_hidden_layers", shape.layers},
        {"num_attention_heads", shape.heads},
        {"num_key_value_heads", shape.kv_heads},
        {"max_position_embeddings", std::max<std::int64_t>(seq, 2048)}}},
      {"data", {{"path", token_file(dir, shape.vocab)}, {"format", "u16"}}},
      {"seq_len", seq},
      {"batch_size", micro * accum},
      {"micro_batch_size", micro},
      {"max_steps", 1000000},
      {"precision", "bf16"},
      {"optimizer", {{"lr", 1e-4}}},
      {"grad_clip", 1.0},
      {"device", "cuda"},
      {"device_memory_limit", static_cast<std::uint64_t>(static_cast<double>(free_bytes) * 0.9)},
      {"offload_param", "none"},
      {"offload_optimizer", offload},
      {"save_dir", dir + "/ckpt"}};
  auto config = strata::train::parse_train_config(j, "gpu bench");
  if (!config.is_ok()) {
    state.SkipWithError(config.status().message().c_str());
    return;
  }
  auto trainer = strata::train::Trainer::create(*config, {});
  if (!trainer.is_ok()) {
    state.SkipWithError(trainer.status().message().c_str());
    return;
  }
  auto& t = **trainer;
  if (const strata::Status s = t.run_steps(1); !s.is_ok()) {  // warm-up: plans, heuristics
    state.SkipWithError(s.message().c_str());
    return;
  }
  const double tokens_per_step = static_cast<double>(micro * accum * seq);
  double step_ms = 0, compute_ms = 0, optim_ms = 0;
  std::int64_t steps = 0;
  for (auto _ : state) {
    if (const strata::Status s = t.run_steps(1); !s.is_ok()) {
      state.SkipWithError(s.message().c_str());
      return;
    }
    const auto& m = t.history().back();
    if (!std::isfinite(m.loss) || m.skipped) {  // a broken step would make any speed meaningless
      state.SkipWithError(("step " + std::to_string(m.step) + " produced loss " +
                           std::to_string(m.loss) + (m.skipped ? " (skipped)" : ""))
                              .c_str());
      return;
    }
    state.SetIterationTime(m.step_ms / 1e3);
    step_ms += m.step_ms;
    compute_ms += m.compute_ms;
    optim_ms += m.optimizer_ms;
    ++steps;
  }
  const double mean_s = step_ms / 1e3 / static_cast<double>(steps);
  const double model_tflops =
      6.0 * static_cast<double>(shape.params()) * tokens_per_step / mean_s / 1e12;
  state.counters["mfu"] = model_tflops / peak_tflops;
  state.counters["model_tflops"] = model_tflops;
  state.counters["peak_tflops"] = peak_tflops;
  state.counters["tokens_per_s"] = tokens_per_step / mean_s;
  state.counters["step_ms"] = step_ms / static_cast<double>(steps);
  state.counters["compute_ms"] = compute_ms / static_cast<double>(steps);
  state.counters["optimizer_ms"] = optim_ms / static_cast<double>(steps);
  state.counters["params_m"] = static_cast<double>(shape.params()) / 1e6;
  state.SetLabel("offload_optimizer=" + offload + " seq=" + std::to_string(seq) +
                 " tokens/step=" + std::to_string(micro * accum * seq));
}

}  // namespace

int main(int argc, char** argv) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    std::printf("SKIPPED gpu_train_step: no GPU (%s)\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "no devices");
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  const Peak peak = measure_bf16_peak();
  if (peak.tflops <= 0) {
    std::fprintf(stderr, "bf16 peak measurement failed: %s\n", peak.error.c_str());
    return 1;
  }
  std::printf("measured bf16 GEMM peak (cuBLASLt, 8192^3): %.1f TFLOP/s\n", peak.tflops);
  const auto steps = env_int("STRATA_GPU_BENCH_STEPS", 3);
  for (const char* offload : {"none", "cpu"}) {
    benchmark::RegisterBenchmark(
        (std::string("BM_GpuTrainStep/offload_optimizer=") + offload).c_str(),
        [offload, p = peak.tflops](benchmark::State& s) { BM_GpuTrainStep(s, offload, p); })
        ->Iterations(steps)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
