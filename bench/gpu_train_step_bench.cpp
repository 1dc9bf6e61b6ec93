// Model FLOPs utilization of the training step on the GPU for a 1.1B LLaMA (TinyLlama's shape),
// as users run it: one run_steps(N) call, so that each step's optimizer update overlaps the next
// step's forward where the schedule allows, timed over the middle steps (the first warms up; the
// last waits for its own update). Cases: no offload; the optimizer offloaded to the CPU at
// accumulation 1 and 2; parameters and optimizer on the host (ZeRO-3).
//
// MFU = 6 * parameters * tokens / step time (attention's own FLOPs are not counted, as is usual),
// against the bf16 peak that a large cuBLASLt GEMM reaches in the same run (measured first,
// output verified) and against the GPU's specified dense bf16 peak (train_run_common.h, by the
// name the driver reports; STRATA_GPU_SPEC_TFLOPS overrides it). Knobs (environment):
// STRATA_GPU_BENCH_SEQ (2048), STRATA_GPU_BENCH_MICRO (micro-batch sequences, 8),
// STRATA_GPU_BENCH_ACCUM (micro-batches per step of the cases that do not fix it, 2),
// STRATA_GPU_BENCH_STEPS (timed steps, 3; under optimizer_overlap "auto" the engine probes the
// serial schedule from the fifth step on, so more mixes the two), STRATA_GPU_BENCH_LAYERS (22),
// STRATA_GPU_BENCH_CLIP (grad_clip, 1.0), STRATA_GPU_BENCH_OVERLAP (optimizer_overlap; unset: the
// config's default), STRATA_GPU_BENCH_CASES ("mfu": the cases above; "long": activation_offload
// "none" and "cpu" at seq 4096, then "cpu" at seq 16384 on a 2 GiB device with the LM head 1024
// tokens at a time, with checkpointing and parameters and optimizer on the host; "all"), and
// STRATA_ATTENTION (the attention kernels: auto, flash2 or simple).
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "bench/train_run_common.h"
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
double env_double(const char* name, double fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atof(v) : fallback;
}
std::string env_string(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::string(v) : fallback;
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

struct Case {
  std::string name;               // "offload=optimizer/accum=2"
  std::string offload_optimizer;  // "none" or "cpu"
  std::string offload_param;      // "none" or "cpu" (ZeRO-3)
  std::int64_t accum = 2;         // micro-batches per optimizer step
  double target_mfu = 0;          // against the measured peak; 0: none set
  // The long-sequence cases: their own sequence length and micro-batch (0: the knobs'), and
  // activation checkpointing with activation_offload this ("": no checkpointing), on a device
  // budget of device_limit bytes (0: 90% of what is free).
  std::int64_t seq = 0, micro = 0;
  std::string activation_offload = "";
  std::uint64_t device_limit = 0;
  std::int64_t head_chunk = 0;  // lm_head_chunk_tokens (0: the config's default)
};

struct Peaks {
  double measured_tflops = 0;
  double spec_tflops = 0;  // 0: this GPU is not in kSpecPeaks
};

// Prints one line on the case as soon as it is measured, so that a run stopped by a timeout
// still shows the cases it finished (Google Benchmark's JSON is complete only at the end).
void BM_GpuTrainStep(benchmark::State& state, const Case& c, const Peaks& peaks) {
  Shape shape;
  shape.layers = env_int("STRATA_GPU_BENCH_LAYERS", shape.layers);
  const std::int64_t seq = c.seq > 0 ? c.seq : env_int("STRATA_GPU_BENCH_SEQ", 2048);
  const std::int64_t micro = c.micro > 0 ? c.micro : env_int("STRATA_GPU_BENCH_MICRO", 8);
  const std::int64_t timed = std::max<std::int64_t>(1, env_int("STRATA_GPU_BENCH_STEPS", 3));
  constexpr std::int64_t kWarmup = 1;
  // The last step waits for its own update (nothing follows to overlap it): not timed either.
  const std::int64_t total = kWarmup + timed + 1;
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
      {"data", {{"path", strata::bench::token_file(dir, shape.vocab)}, {"format", "u16"}}},
      {"seq_len", seq},
      {"batch_size", micro * c.accum},
      {"micro_batch_size", micro},
      {"max_steps", 1000000},
      {"precision", "bf16"},
      {"optimizer", {{"lr", 1e-4}}},
      {"grad_clip", env_double("STRATA_GPU_BENCH_CLIP", 1.0)},
      {"device", "cuda"},
      {"device_memory_limit",
       c.device_limit > 0 ? c.device_limit
                          : static_cast<std::uint64_t>(static_cast<double>(free_bytes) * 0.9)},
      {"offload_param", c.offload_param},
      {"offload_optimizer", c.offload_optimizer},
      {"save_dir", ""}};
  if (c.offload_param != "none") j["zero_stage"] = 3;
  if (!c.activation_offload.empty()) {
    j["activation_checkpointing"] = true;
    j["activation_offload"] = c.activation_offload;
  }
  if (c.head_chunk > 0) j["lm_head_chunk_tokens"] = c.head_chunk;
  if (const std::string overlap = env_string("STRATA_GPU_BENCH_OVERLAP", ""); !overlap.empty()) {
    j["optimizer_overlap"] = overlap;
  }
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
  const double tokens_per_step = static_cast<double>(micro * c.accum * seq);
  struct {
    double step = 0, compute = 0, optimizer = 0, exposed = 0, wait = 0, stall = 0;
    std::uint64_t peak_device = 0, planned_device = 0;
    int overlapped = 0, guessed = 0, redone = 0;
  } sum;
  for (auto _ : state) {  // one iteration: the whole run, as a user's
    if (const strata::Status s = t.run_steps(total); !s.is_ok()) {
      state.SkipWithError(s.message().c_str());
      return;
    }
    const auto& history = t.history();
    if (history.size() != static_cast<std::size_t>(total)) {
      state.SkipWithError(("the run recorded " + std::to_string(history.size()) + " steps, not " +
                           std::to_string(total))
                              .c_str());
      return;
    }
    for (const auto& m : history) {
      if (!std::isfinite(m.loss) || m.skipped) {  // a broken step makes any speed meaningless
        state.SkipWithError(("step " + std::to_string(m.step) + " produced loss " +
                             std::to_string(m.loss) + (m.skipped ? " (skipped)" : ""))
                                .c_str());
        return;
      }
    }
    for (std::int64_t i = kWarmup; i < kWarmup + timed; ++i) {
      const auto& m = history[static_cast<std::size_t>(i)];
      sum.step += m.step_ms;
      sum.compute += m.compute_ms;
      sum.optimizer += m.optimizer_ms;
      sum.exposed += m.optimizer_exposed_ms;
      sum.wait += m.wait_ms;
      sum.stall += m.stall_ms;
      sum.overlapped += m.optimizer_schedule != "none" ? 1 : 0;
      sum.guessed += m.guessed ? 1 : 0;
      sum.redone += m.redone ? 1 : 0;
      sum.peak_device = std::max(sum.peak_device, m.peak_device_bytes);
      sum.planned_device = m.planned_device_bytes;
    }
    state.SetIterationTime(sum.step / 1e3 / static_cast<double>(timed));
  }
  const double n = static_cast<double>(timed);
  const double mean_s = sum.step / 1e3 / n;
  const double model_tflops =
      6.0 * static_cast<double>(shape.params()) * tokens_per_step / mean_s / 1e12;
  const double mfu = model_tflops / peaks.measured_tflops;
  const double mfu_spec = peaks.spec_tflops > 0 ? model_tflops / peaks.spec_tflops : 0.0;
  state.counters["mfu"] = mfu;
  state.counters["mfu_spec"] = mfu_spec;
  state.counters["model_tflops"] = model_tflops;
  state.counters["peak_tflops"] = peaks.measured_tflops;
  state.counters["spec_tflops"] = peaks.spec_tflops;
  state.counters["target_mfu"] = c.target_mfu;
  state.counters["tokens_per_s"] = tokens_per_step / mean_s;
  state.counters["step_ms"] = sum.step / n;
  state.counters["compute_ms"] = sum.compute / n;
  state.counters["optimizer_ms"] = sum.optimizer / n;
  state.counters["exposed_ms"] = sum.exposed / n;
  state.counters["wait_ms"] = sum.wait / n;
  state.counters["stall_ms"] = sum.stall / n;
  state.counters["timed_steps"] = n;
  state.counters["overlapped_steps"] = sum.overlapped;
  state.counters["guessed_steps"] = sum.guessed;
  state.counters["redone_steps"] = sum.redone;
  state.counters["accum"] = static_cast<double>(c.accum);
  state.counters["params_m"] = static_cast<double>(shape.params()) / 1e6;
  state.counters["peak_device_mib"] = static_cast<double>(sum.peak_device) / (1 << 20);
  state.counters["planned_device_mib"] = static_cast<double>(sum.planned_device) / (1 << 20);
  state.counters["device_limit_mib"] = static_cast<double>(config->device_memory_limit) / (1 << 20);
  const std::string attention = env_string("STRATA_ATTENTION", "auto");
  state.SetLabel("seq=" + std::to_string(seq) + " tokens/step=" +
                 std::to_string(micro * c.accum * seq) + " attention=" + attention);
  std::printf(
      "train_step %s: MFU %.3f of the measured %.0f TFLOP/s, %.3f of the specified %.0f; step "
      "%.0f ms (compute %.0f, optimizer %.0f, exposed %.0f, wait %.0f, stall %.0f), %d of %d "
      "timed steps overlapped, attention %s; peak device %.0f MiB (planned %.0f, limit %.0f)\n",
      c.name.c_str(), mfu, peaks.measured_tflops, mfu_spec, peaks.spec_tflops, sum.step / n,
      sum.compute / n, sum.optimizer / n, sum.exposed / n, sum.wait / n, sum.stall / n,
      sum.overlapped, static_cast<int>(timed), attention.c_str(),
      static_cast<double>(sum.peak_device) / (1 << 20),
      static_cast<double>(sum.planned_device) / (1 << 20),
      static_cast<double>(config->device_memory_limit) / (1 << 20));
  std::fflush(stdout);
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
  cudaDeviceProp prop{};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    std::fprintf(stderr, "cannot read the GPU's properties\n");
    return 1;
  }
  Peaks peaks;
  const Peak measured = measure_bf16_peak();
  if (measured.tflops <= 0) {
    std::fprintf(stderr, "bf16 peak measurement failed: %s\n", measured.error.c_str());
    return 1;
  }
  peaks.measured_tflops = measured.tflops;
  peaks.spec_tflops = strata::bench::spec_bf16_tflops(prop.name);
  std::printf("measured bf16 GEMM peak (cuBLASLt, 8192^3): %.1f TFLOP/s\n", peaks.measured_tflops);
  if (peaks.spec_tflops > 0) {
    std::printf("specified dense bf16 peak of %s: %.0f TFLOP/s (measured/specified %.2f)\n",
                prop.name, peaks.spec_tflops, peaks.measured_tflops / peaks.spec_tflops);
  } else {
    std::printf("specified dense bf16 peak of %s: unknown (set STRATA_GPU_SPEC_TFLOPS)\n",
                prop.name);
  }
  const std::int64_t accum = std::max<std::int64_t>(1, env_int("STRATA_GPU_BENCH_ACCUM", 2));
  std::vector<Case> cases;
  const std::string which = env_string("STRATA_GPU_BENCH_CASES", "mfu");
  if (which == "mfu" || which == "all") {
    cases.push_back({"offload=none/accum=" + std::to_string(accum), "none", "none", accum, 0.45});
    cases.push_back({"offload=optimizer/accum=1", "cpu", "none", 1, 0.35});
    cases.push_back({"offload=optimizer/accum=2", "cpu", "none", 2, 0.35});
    cases.push_back(
        {"offload=param+optimizer/accum=" + std::to_string(accum), "cpu", "cpu", accum, 0});
  }
  if (which == "long" || which == "all") {
    // Activation offload's cost where both fit (seq 4096, one sequence), then seq 16384 on a
    // 2 GiB device: parameters and optimizer on the host, checkpointed inputs in host memory.
    for (const char* tier : {"none", "cpu"}) {
      Case c{std::string("activations=") + tier + "/seq=4096", "cpu", "cpu", 1, 0};
      c.seq = 4096;
      c.micro = 1;
      c.activation_offload = tier;
      cases.push_back(c);
    }
    Case c{"activations=cpu/seq=16384/device=2GiB", "cpu", "cpu", 1, 0};
    c.seq = 16384;
    c.micro = 1;
    c.activation_offload = "cpu";
    c.device_limit = std::uint64_t{2} << 30;
    c.head_chunk = 1024;  // the head's logits 62.5 MiB instead of 128: the plan is 1.95 GiB
    cases.push_back(c);
  }
  if (cases.empty()) {
    std::fprintf(stderr, "STRATA_GPU_BENCH_CASES must be mfu, long or all, not '%s'\n",
                 which.c_str());
    return 2;
  }
  for (const Case& c : cases) {
    benchmark::RegisterBenchmark(("BM_GpuTrainStep/" + c.name).c_str(),
                                 [c, peaks](benchmark::State& s) { BM_GpuTrainStep(s, c, peaks); })
        ->Iterations(1)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  std::fflush(stdout);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
