// Training-step benchmark on a small model: tokens/s and the split of the step into compute,
// parameter wait (transfer) and optimizer, for each offload placement.
#include <benchmark/benchmark.h>

#include <filesystem>
#include <string>

#include "bench_data.h"
#include "strata/train/config.h"
#include "strata/train/trainer.h"

namespace {

using strata::Json;

// args: offload (0 none, 1 cpu, 2 nvme), precision (0 fp32, 1 bf16)
void BM_TrainStep(benchmark::State& state) {
  const char* offloads[] = {"none", "cpu", "nvme"};
  const std::string offload = offloads[state.range(0)];
  Json j = Json::parse(R"({
    "model": {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 688,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
              "max_position_embeddings": 256},
    "seq_len": 128, "batch_size": 8, "micro_batch_size": 8, "max_steps": 1000000,
    "optimizer": {"lr": 1e-3}, "grad_clip": 1.0
  })");
  j["precision"] = state.range(1) == 0 ? "fp32" : "bf16";
  j["data"] = {{"path", strata::bench::text_data_file()}, {"format", "text"}};
  j["offload_param"] = offload == "none" ? "none" : offload;
  j["offload_optimizer"] = offload;
  const std::string swap = (std::filesystem::temp_directory_path() / "strata-bench-swap").string();
  std::filesystem::create_directories(swap);
  j["swap_paths"] = {swap};
  j["save_dir"] = (std::filesystem::temp_directory_path() / "strata-bench-ckpt").string();
  auto config = strata::train::parse_train_config(j, "bench");
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
  double compute = 0, wait = 0, optim = 0, step_ms = 0, tokens = 0;
  std::int64_t steps = 0;
  for (auto _ : state) {
    const strata::Status s = t.run_steps(1);
    if (!s.is_ok()) {
      state.SkipWithError(s.message().c_str());
      return;
    }
    const auto& m = t.history().back();
    compute += m.compute_ms;
    wait += m.wait_ms;
    optim += m.optimizer_ms;
    step_ms += m.step_ms;
    tokens += static_cast<double>(config->batch_size * config->seq_len);
    ++steps;
  }
  state.counters["tokens_per_s"] = benchmark::Counter(tokens, benchmark::Counter::kIsRate);
  state.counters["compute_ms"] = compute / static_cast<double>(steps);
  state.counters["transfer_wait_ms"] = wait / static_cast<double>(steps);
  state.counters["optimizer_ms"] = optim / static_cast<double>(steps);
  state.counters["other_ms"] = (step_ms - compute - optim) / static_cast<double>(steps);
  state.SetLabel(offload + "/" + std::string(state.range(1) == 0 ? "fp32" : "bf16"));
}

BENCHMARK(BM_TrainStep)
    ->ArgsProduct({{0, 1, 2}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
