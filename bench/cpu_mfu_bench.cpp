// Model FLOPs utilization of a training step on the CPU backend: the peak of a large GEMM per
// dtype, then forward + backward of the issue-17 LLaMA model (hidden 1024, 8 layers, ffn 2816,
// 16/4 heads, vocab 32000, batch 4 x seq 256, offload none) in the same process, and
// MFU = 6 x parameters x tokens / compute time / that peak (mfu: every parameter, as the issue
// counts; mfu_non_embedding: without the embedding table, which is looked up, not multiplied).
// Attention's own FLOPs (QK^T and PV) are not counted, as in the 6PT rule.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "bench_data.h"
#include "strata/device/device.h"
#include "strata/device/op_profile.h"
#include "strata/model/llama_config.h"
#include "strata/model/param_layout.h"
#include "strata/train/config.h"
#include "strata/train/trainer.h"

namespace {

using strata::DType;
using strata::Json;

std::map<int, double> g_peak_gflops;  // by dtype index (0 fp32, 1 bf16), from BM_CpuGemmPeak

DType dtype_of(std::int64_t i) { return i == 0 ? DType::kF32 : DType::kBF16; }
const char* dtype_name_of(std::int64_t i) { return i == 0 ? "fp32" : "bf16"; }

// C = A B at 2048^3 through the CPU backend's op table: the same GEMM path training uses.
void BM_CpuGemmPeak(benchmark::State& state) {
  constexpr std::int64_t n = 2048;
  const DType dt = dtype_of(state.range(0));
  strata::device::DeviceOptions o;
  auto dev = strata::device::create_device(o);
  if (!dev.is_ok()) {
    state.SkipWithError(dev.status().message().c_str());
    return;
  }
  const std::size_t bytes = static_cast<std::size_t>(n * n) * strata::dtype_size(dt);
  auto a = (*dev)->allocate(bytes, "a"), b = (*dev)->allocate(bytes, "b"),
       c = (*dev)->allocate(bytes, "c");
  std::memset(a->data(), 0x3c, bytes);  // small finite values in f32 and bf16
  std::memset(b->data(), 0x3c, bytes);
  strata::device::GemmArgs g;
  g.dtype = dt;
  g.m = g.n = g.k = g.lda = g.ldb = g.ldc = n;
  g.a = a->data();
  g.b = b->data();
  g.c = c->data();
  (*dev)->ops().gemm(g);  // warm-up
  double best_s = 1e30;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    (*dev)->ops().gemm(g);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best_s = std::min(best_s, s);
    state.SetIterationTime(s);
  }
  const double gflops = 2.0 * n * n * n / best_s / 1e9;
  g_peak_gflops[static_cast<int>(state.range(0))] = gflops;
  state.counters["GFLOP_per_s"] = gflops;
  state.SetLabel(dtype_name_of(state.range(0)));
}

void BM_CpuTrainStepMfu(benchmark::State& state) {
  Json j = Json::parse(R"({
    "model": {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
              "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
              "max_position_embeddings": 256},
    "seq_len": 256, "batch_size": 4, "micro_batch_size": 4, "max_steps": 1000000,
    "offload_param": "none", "offload_optimizer": "none", "optimizer": {"lr": 1e-4}
  })");
  j["precision"] = dtype_name_of(state.range(0));
  j["data"] = {{"path", strata::bench::text_data_file()}, {"format", "text"}};
  j["save_dir"] = "";
  auto config = strata::train::parse_train_config(j, "bench");
  if (!config.is_ok()) {
    state.SkipWithError(config.status().message().c_str());
    return;
  }
  auto model = strata::model::LlamaConfig::from_json(j["model"], "bench model");
  const double params =
      static_cast<double>(strata::model::ParamLayout::build(*model).num_parameters());
  setenv("STRATA_OP_PROFILE", "1", 1);  // the per-op split below
  auto trainer = strata::train::Trainer::create(*config, {});
  unsetenv("STRATA_OP_PROFILE");
  if (!trainer.is_ok()) {
    state.SkipWithError(trainer.status().message().c_str());
    return;
  }
  auto& t = **trainer;
  if (const strata::Status s = t.run_steps(1); !s.is_ok()) {  // warm-up, untimed
    state.SkipWithError(s.message().c_str());
    return;
  }
  strata::device::reset_op_profile();  // the timed steps only
  std::vector<double> compute_ms;
  for (auto _ : state) {
    if (const strata::Status s = t.run_steps(1); !s.is_ok()) {
      state.SkipWithError(s.message().c_str());
      return;
    }
    compute_ms.push_back(t.history().back().compute_ms);
    state.SetIterationTime(compute_ms.back() / 1e3);
  }
  std::sort(compute_ms.begin(), compute_ms.end());
  const double median_s = compute_ms[compute_ms.size() / 2] / 1e3;
  const double tokens = static_cast<double>(config->batch_size * config->seq_len);
  const double model_gflops = 6.0 * params * tokens / median_s / 1e9;
  state.counters["compute_ms"] = median_s * 1e3;
  state.counters["params"] = params;
  state.counters["model_GFLOP_per_s"] = model_gflops;
  // The embedding table is looked up, not multiplied: the usual count leaves it out.
  const double embedding = static_cast<double>(model->vocab_size * model->hidden_size);
  const double gflops_non_embedding = 6.0 * (params - embedding) * tokens / median_s / 1e9;
  const auto peak = g_peak_gflops.find(static_cast<int>(state.range(0)));
  if (peak != g_peak_gflops.end()) {
    state.counters["mfu"] = model_gflops / peak->second;
    state.counters["mfu_non_embedding"] = gflops_non_embedding / peak->second;
  }
  state.SetLabel(dtype_name_of(state.range(0)));

  // Per op, per step: time, its share of all op time (forward, backward and the optimizer's
  // adamw and norms), and the rate it reached (FLOP/s for the products, bytes/s for the rest,
  // the memory-bound ones).
  const double steps = static_cast<double>(compute_ms.size());
  const std::vector<strata::device::OpTime> ops = strata::device::op_profile();
  double total_ms = 0;
  for (const auto& o : ops) total_ms += o.seconds * 1e3 / steps;
  std::printf("per-op split, %s (ms per step; compute %.0f ms, ops %.0f ms):\n",
              dtype_name_of(state.range(0)), median_s * 1e3, total_ms);
  std::printf("  %-20s %8s %10s %7s %14s %10s\n", "op", "calls", "ms", "share", "GFLOP/s", "GB/s");
  for (const auto& o : ops) {
    const double ms = o.seconds * 1e3 / steps;
    std::printf("  %-20s %8.0f %10.1f %6.1f%% %14.1f %10.1f\n", o.op.c_str(),
                static_cast<double>(o.calls) / steps, ms, 100.0 * ms / total_ms,
                o.flops / o.seconds / 1e9, o.bytes / o.seconds / 1e9);
  }
}

BENCHMARK(BM_CpuGemmPeak)
    ->Arg(0)
    ->Arg(1)
    ->Iterations(3)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_CpuTrainStepMfu)
    ->Arg(0)
    ->Arg(1)
    ->Iterations(3)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
