// Whole training steps on the CUDA backend against the CPU backend on tiny models: the same
// losses (fp32: 1e-4 relative) with the optimizer on the GPU and offloaded to the host, the
// adapters (LoRA, QLoRA), the mixtures of experts, the flash-attention path in bf16, every
// attention variant, fp16 with its loss scale, activations offloaded to host memory and NVMe, a
// 32K-token sequence, and clear errors for device "cuda" where there is no GPU and for an attention
// variant that does not exist (those run everywhere).
#include "strata/build_config.h"
#if STRATA_HAVE_CUDA

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "kernels/runtime.h"
#include "strata/train/config.h"
#include "strata/train/trainer.h"
#include "tests/integration/train_history.h"
#include "tests/testing/family_models.h"
#include "tests/testing/long_sequence.h"
#include "tests/testing/loss_scale_replay.h"
#include "tests/testing/scoped_env.h"
#include "tests/testing/temp_dir.h"

namespace strata::train {
namespace {

using testing::TempDir;

bool gpu_present() { return kernels::query_gpus().count > 0; }

// `j` trained on `device`.
History train_on(Json j, const std::string& device) {
  j["device"] = device;
  return train_history(j);
}

void expect_close(const std::vector<double>& got, const std::vector<double>& want, double rtol,
                  const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_NEAR(got[i], want[i], rtol * std::abs(want[i])) << what << " at step " << i + 1;
  }
}

TEST(CudaTrainProbeTest, DeviceCudaWithoutGpuIsAClearError) {
  if (gpu_present()) GTEST_SKIP() << "a GPU is present; this checks the message without one";
  TempDir dir;
  Json j = gpu_tiny_config(dir);
  j["device"] = "cuda";
  auto c = parse_train_config(j, "test config");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  auto t = Trainer::create(*c, {});
  ASSERT_FALSE(t.is_ok());
  EXPECT_EQ(t.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(t.status().message().find("no GPU"), std::string::npos) << t.status().message();
}

// The config key `attention` takes only the variants there are, and says which; "flash", the
// first flash variant, was removed (flash2 serves every call it served).
TEST(CudaTrainProbeTest, AnUnknownAttentionVariantIsRefusedNamingTheChoices) {
  TempDir dir;
  Json j = gpu_tiny_config(dir);
  for (const char* gone : {"flash3", "flash"}) {
    j["attention"] = gone;
    auto c = parse_train_config(j, "test config");
    ASSERT_FALSE(c.is_ok());
    EXPECT_NE(c.status().message().find("'attention': got '" + std::string(gone) +
                                        "'; expected one of auto|flash2|simple"),
              std::string::npos)
        << c.status().message();
  }
  j["attention"] = "flash2";
  auto ok = parse_train_config(j, "test config");
  ASSERT_TRUE(ok.is_ok()) << ok.status().message();
  EXPECT_EQ(ok->attention, device::AttentionVariant::kFlash2);
  EXPECT_EQ(ok->to_json()["attention"].get<std::string>(), "flash2");
}

// STRATA_ATTENTION overrides the config for benchmarks; a value that names no variant stops the
// device's creation, GPU or not, naming the variable, the value and the choices.
TEST(CudaTrainProbeTest, ABadStrataAttentionIsRefusedNamingTheVariable) {
  const testing::ScopedEnv attention("STRATA_ATTENTION", "fastest");
  TempDir dir;
  Json j = gpu_tiny_config(dir);
  j["device"] = "cuda";
  auto c = parse_train_config(j, "test config");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  auto t = Trainer::create(*c, {});
  ASSERT_FALSE(t.is_ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << t.status().message();
  EXPECT_NE(t.status().message().find("STRATA_ATTENTION 'fastest' is not an attention variant; "
                                      "expected one of auto|flash2|simple"),
            std::string::npos)
      << t.status().message();
}

// `j` on the CPU backend, 4 steps, and on the GPU: the GPU's losses and gradient norms within
// `rtol` of the CPU's. Both runs' histories, the CPU's first.
std::pair<History, History> expect_gpu_tracks_cpu(const Json& j, double rtol) {
  History cpu = train_on(j, "cpu");
  EXPECT_EQ(cpu.loss.size(), 4u);
  History gpu = train_on(j, "cuda");
  expect_close(gpu.loss, cpu.loss, rtol, "loss");
  expect_close(gpu.grad_norm, cpu.grad_norm, rtol, "grad_norm");
  return {std::move(cpu), std::move(gpu)};
}

class CudaTrainTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const kernels::GpuInfo info = kernels::query_gpus();
    if (info.count == 0 && !rehearsing_gpu_tests()) GTEST_SKIP() << "no GPU: " << info.error;
  }
};

TEST_F(CudaTrainTest, Fp32LossesMatchTheCpuBackend) {
  TempDir dir;
  const auto [cpu, gpu] = expect_gpu_tracks_cpu(gpu_tiny_config(dir), 1e-4);
  ASSERT_FALSE(gpu.loss.empty());
  EXPECT_LT(gpu.loss.back(), gpu.loss.front());
}

// Parameters and optimizer offloaded to host RAM, then to NVMe: exercises the copy streams, events
// and the deferred reuse of freed device blocks, with CPU Adam updating the master weights.
TEST_F(CudaTrainTest, Fp32OffloadedLossesMatchTheCpuBackend) {
  TempDir dir;
  Json base = gpu_tiny_config(dir);
  base["offload_param"] = "cpu";
  base["offload_optimizer"] = "cpu";
  const History cpu = train_on(base, "cpu");
  const History gpu = train_on(base, "cuda");
  expect_close(gpu.loss, cpu.loss, 1e-4, "loss");
  // And with activation checkpointing (recomputation in backward).
  base["activation_checkpointing"] = true;
  expect_close(train_on(base, "cuda").loss, cpu.loss, 1e-4, "loss with checkpointing");
  // And with parameters and optimizer on NVMe: the swap space reads into pinned buffers and the
  // copy stream takes them on (placement changes no bit on the CPU backend, so the same losses).
  base["activation_checkpointing"] = false;
  base["offload_param"] = "nvme";
  base["offload_optimizer"] = "nvme";
  base["swap_paths"] = {dir.file("swap")};
  std::filesystem::create_directories(dir.file("swap"));
  expect_close(train_on(base, "cuda").loss, cpu.loss, 1e-4, "loss with NVMe");
}

// Compact optimizer state with the optimizer on the GPU (its own AdamW: 8-bit or bf16 moments,
// bf16 master weights with Kahan or stochastic rounding) trains as the CPU backend does, and
// as compact state on the host does on the GPU (the same step, bit for bit, in either place).
TEST_F(CudaTrainTest, CompactStateOnTheGpuMatchesTheCpuBackendAndTheHost) {
  struct Setting {
    const char* state;
    const char* master;
    const char* rounding;  // bf16 master weights only
  };
  for (const Setting& set : {Setting{"int8", "fp32", ""}, Setting{"int8", "bf16", "kahan"},
                             Setting{"bf16", "bf16", "stochastic"}}) {
    SCOPED_TRACE(std::string(set.state) + " moments, " + set.master + " master " + set.rounding);
    TempDir dir;
    Json base = gpu_tiny_config(dir);
    base["optimizer"]["state_dtype"] = set.state;
    base["optimizer"]["master_dtype"] = set.master;
    if (*set.rounding != '\0') base["optimizer"]["master_rounding"] = set.rounding;
    const History cpu = train_on(base, "cpu");
    ASSERT_EQ(cpu.loss.size(), 4u);
    const History gpu = train_on(base, "cuda");
    expect_close(gpu.loss, cpu.loss, 1e-4, "loss");
    expect_close(gpu.grad_norm, cpu.grad_norm, 1e-4, "grad_norm");
    // The GPU's AdamW against CPU Adam on the host: the same step, so the same bits where the
    // GPU's forward and backward repeat their own (else as close as two such runs).
    const bool deterministic = train_on(base, "cuda").loss == gpu.loss;
    base["offload_optimizer"] = "cpu";
    const History host = train_on(base, "cuda");
    if (deterministic) {
      EXPECT_EQ(host.loss, gpu.loss);
    } else {
      expect_close(host.loss, gpu.loss, 1e-6, "loss with the optimizer on the host");
    }
    EXPECT_LT(gpu.loss.back(), gpu.loss.front());
  }
}

// offload_optimizer_fraction below 1 on the GPU: the groups backward reaches last keep their
// state on the GPU and its AdamW steps them after the global norm, the rest CPU Adam on the host,
// beside backward too: the bits of the whole optimizer on the host where two such runs agree bit
// for bit (deterministic kernels), else as close as two such runs.
TEST_F(CudaTrainTest, APartOfTheOptimizerOnTheGpuGivesTheLossesOfAllOnTheHost) {
  TempDir dir;
  Json base = gpu_tiny_config(dir);
  base["offload_optimizer"] = "cpu";
  for (const char* overlap : {"none", "backward"}) {
    SCOPED_TRACE(std::string("optimizer_overlap ") + overlap);
    base["optimizer_overlap"] = overlap;
    base["offload_optimizer_fraction"] = 1.0;
    const History host = train_on(base, "cuda");
    const bool deterministic = train_on(base, "cuda").loss == host.loss;
    for (const double fraction : {0.5, 0.0}) {
      SCOPED_TRACE("offload_optimizer_fraction " + std::to_string(fraction));
      base["offload_optimizer_fraction"] = fraction;
      const History split = train_on(base, "cuda");
      if (deterministic) {
        EXPECT_EQ(split.loss, host.loss);
        EXPECT_EQ(split.grad_norm, host.grad_norm);
      } else {
        expect_close(split.loss, host.loss, 1e-6, "loss");
      }
    }
  }
}

// bf16 with head_dim 64: flash attention and bf16 cuBLASLt GEMMs. bf16 rounding differs between
// the backends (fused kernels round less often), so losses agree to bf16 precision.
TEST_F(CudaTrainTest, Bf16FlashPathTracksTheCpuBackend) {
  TempDir dir;
  Json base = gpu_tiny_config(dir);
  base["model"] = Json::parse(R"({"vocab_size": 256, "hidden_size": 128,
      "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
      "num_key_value_heads": 1, "max_position_embeddings": 128})");
  base["seq_len"] = 100;
  base["precision"] = "bf16";
  const History cpu = train_on(base, "cpu");
  const History gpu = train_on(base, "cuda");
  expect_close(gpu.loss, cpu.loss, 2e-2, "loss");
  EXPECT_LT(gpu.loss.back(), gpu.loss.front());
}

// Every attention variant the config can choose trains as the CPU backend does: in bf16 with
// head_dim 64 each runs its own kernels; in fp32 with head_dim 8, where the flash kernels do not
// apply, flash2 leaves the calls to the simple kernels instead of failing them.
TEST_F(CudaTrainTest, EveryAttentionVariantTracksTheCpuBackend) {
  testing::ScopedEnv no_override("STRATA_ATTENTION", "");
  no_override.unset();  // the config's choice, not the environment's
  TempDir dir;
  const Json fp32 = gpu_tiny_config(dir);
  Json bf16 = fp32;
  bf16["model"] = Json::parse(R"({"vocab_size": 256, "hidden_size": 128,
      "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
      "num_key_value_heads": 1, "max_position_embeddings": 128})");
  bf16["seq_len"] = 100;
  bf16["precision"] = "bf16";
  const History cpu_fp32 = train_on(fp32, "cpu");
  const History cpu_bf16 = train_on(bf16, "cpu");
  for (const char* variant : {"auto", "flash2", "simple"}) {
    SCOPED_TRACE(variant);
    Json f = fp32, b = bf16;
    f["attention"] = variant;
    b["attention"] = variant;
    expect_close(train_on(f, "cuda").loss, cpu_fp32.loss, 1e-4, "fp32 loss");
    expect_close(train_on(b, "cuda").loss, cpu_bf16.loss, 2e-2, "bf16 loss");
  }
}

// The families' differences on the GPU: biases (add_bias / bias_grad kernels), Qwen3's q/k norms
// with an explicit head_dim, llama3 rope scaling, and sliding windows in the simple kernels.
TEST_F(CudaTrainTest, Fp32FamiliesMatchTheCpuBackend) {
  TempDir dir;
  const Json base = gpu_tiny_config(dir);
  const char* models[] = {
      R"({"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 12, "attention_bias": true, "mlp_bias": true, "rope_theta": 500000.0,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
          "max_position_embeddings": 64})",
      R"({"model_type": "qwen2", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "tie_word_embeddings": true, "use_sliding_window": true, "sliding_window": 5,
          "max_window_layers": 1, "max_position_embeddings": 64})",
      R"({"model_type": "qwen3", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 64})",
      R"({"model_type": "mistral", "vocab_size": 256, "hidden_size": 32,
          "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "sliding_window": 3, "max_position_embeddings": 64})"};
  for (const char* model : models) {
    Json j = base;
    j["model"] = Json::parse(model);
    SCOPED_TRACE(j["model"]["model_type"].get<std::string>());
    expect_gpu_tracks_cpu(j, 1e-4);
  }
}

// LoRA and QLoRA on the GPU: adapters on every projection beside a frozen base on the device and
// on the host, with dropout on the adapters' inputs and the embedding trained whole beside them;
// QLoRA's base in NF4, decoded by the GPU's kernels (the CPU's bits: CudaOpsTest).
TEST_F(CudaTrainTest, Fp32LoraAndQloraMatchTheCpuBackend) {
  TempDir dir;
  const Json base = gpu_tiny_config(dir);
  struct Case {
    const char* method;
    const char* base_on;  // offload_param: where the frozen base lives
    double dropout;
    bool trained_embedding;
  };
  for (const Case& c : {Case{"lora", "none", 0.0, false}, Case{"lora", "cpu", 0.1, true},
                        Case{"qlora", "none", 0.0, false}, Case{"qlora", "cpu", 0.1, true}}) {
    SCOPED_TRACE(std::string(c.method) + ", base on " + c.base_on +
                 (c.dropout > 0 ? ", dropout" : "") + (c.trained_embedding ? ", embedding" : ""));
    Json j = base;
    j["finetune"] = {{"method", c.method},
                     {"r", 4},
                     {"alpha", 8},
                     {"dropout", c.dropout},
                     {"target_modules", "all-linear"}};
    if (c.trained_embedding) j["finetune"]["modules_to_save"] = {"embed_tokens"};
    j["offload_param"] = c.base_on;
    if (std::string(c.base_on) != "none") j["offload_optimizer"] = c.base_on;
    const History cpu = expect_gpu_tracks_cpu(j, 1e-4).first;
    ASSERT_FALSE(cpu.loss.empty());
    EXPECT_LT(cpu.loss.back(), cpu.loss.front());
  }
}

// Mixtures of experts on the GPU (moe.cu's routing, the experts' grouped products, the aux
// loss): Qwen3-MoE (a dense layer among the MoE ones) and Mixtral, with the experts on the device,
// with parameters and optimizer on the host, and with LoRA on every projection and the router.
TEST_F(CudaTrainTest, Fp32MixturesOfExpertsMatchTheCpuBackend) {
  TempDir dir;
  const Json base = gpu_tiny_config(dir);
  for (const std::string& family : strata::testing::moe_families()) {
    for (const char* placement : {"device", "host", "lora"}) {
      SCOPED_TRACE(family + ", " + placement);
      Json j = base;
      j["model"] = strata::testing::family_model(family, 2);
      if (std::string(placement) == "host") {
        j["offload_param"] = "cpu";
        j["offload_optimizer"] = "cpu";
      } else if (std::string(placement) == "lora") {
        j["finetune"] = {{"method", "lora"},
                         {"r", 4},
                         {"alpha", 8},
                         {"target_modules",
                          {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                           "down_proj", "gate"}}};
      }
      expect_gpu_tracks_cpu(j, 1e-4);
    }
  }
}

// bf16, head_dim 64, a window of 37 over 100 positions: the flash kernels skip and mask tiles.
TEST_F(CudaTrainTest, Bf16FlashWithASlidingWindowTracksTheCpuBackend) {
  TempDir dir;
  Json base = gpu_tiny_config(dir);
  base["model"] = Json::parse(R"({"model_type": "mistral", "vocab_size": 256,
      "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
      "num_attention_heads": 2, "num_key_value_heads": 1, "sliding_window": 37,
      "max_position_embeddings": 128})");
  base["seq_len"] = 100;
  base["precision"] = "bf16";
  const History cpu = train_on(base, "cpu");
  const History gpu = train_on(base, "cuda");
  expect_close(gpu.loss, cpu.loss, 2e-2, "loss");
}

// The model the bf16 tests use: head_dim 64, where the flash kernels apply.
Json head_dim_64_model() {
  return Json::parse(R"({"vocab_size": 256, "hidden_size": 128,
      "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
      "num_key_value_heads": 1, "max_position_embeddings": 128})");
}

// fp16: cuBLASLt's fp16 GEMMs (tensor cores, fp32 accumulation) and every kernel's f16 storage,
// against the CPU backend's fp16, to the bf16 test's tolerance scaled by the formats' unit
// roundoffs (2^-11 / 2^-8); and a dynamic loss scale that starts too high follows the run's own
// overflows exactly as optim::LossScaler replays them.
TEST_F(CudaTrainTest, Fp16TracksTheCpuBackendAndItsLossScale) {
  TempDir dir;
  Json base = gpu_tiny_config(dir);
  base["model"] = head_dim_64_model();
  base["seq_len"] = 100;
  base["precision"] = "fp16";
  const History cpu = train_on(base, "cpu");
  const History gpu = train_on(base, "cuda");
  ASSERT_EQ(cpu.skipped, std::vector<bool>(4, false)) << "the default scale overflowed on the CPU";
  EXPECT_EQ(gpu.skipped, cpu.skipped);
  expect_close(gpu.loss, cpu.loss, 2e-2 * (0x1p-11 / 0x1p-8), "loss");
  EXPECT_LT(gpu.loss.back(), gpu.loss.front());

  base["fp16"] = {{"initial_scale_power", 24}, {"hysteresis", 1}, {"loss_scale_window", 2}};
  base["max_steps"] = 10;
  const History scaled = train_on(base, "cuda");
  ASSERT_EQ(scaled.loss_scale.size(), 10u);
  optim::LossScalerConfig lc;
  lc.initial_scale_power = 24;
  lc.hysteresis = 1;
  lc.loss_scale_window = 2;
  const int skipped =
      testing::expect_scales_follow_overflows(lc, scaled.loss_scale, scaled.skipped);
  EXPECT_GT(skipped, 0) << "2^24 never overflowed";
  EXPECT_LT(skipped, 10) << "the scale never came down far enough";
}

// activation_offload on the GPU: each layer's checkpointed input leaves the device on the copy
// stream as soon as the next layer has read it and comes back ahead of its backward. The losses
// are "none"'s: bit for bit where two "none" runs agree bit for bit (deterministic kernels),
// else to 1e-6.
TEST_F(CudaTrainTest, OffloadedActivationsGiveTheLossesOfNone) {
  for (const char* precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    TempDir dir;
    Json base = gpu_tiny_config(dir);
    if (std::string(precision) == "bf16") {
      base["model"] = head_dim_64_model();
      base["seq_len"] = 100;
    }
    base["precision"] = precision;
    base["activation_checkpointing"] = true;
    base["offload_param"] = "cpu";
    base["offload_optimizer"] = "cpu";
    base["swap_paths"] = {dir.file("swap")};
    std::filesystem::create_directories(dir.file("swap"));
    const History none = train_on(base, "cuda");
    const bool deterministic = train_on(base, "cuda").loss == none.loss;
    for (const char* tier : {"cpu", "nvme"}) {
      SCOPED_TRACE(std::string("activation_offload ") + tier);
      Json j = base;
      j["activation_offload"] = tier;
      const History moved = train_on(j, "cuda");
      if (deterministic) {
        EXPECT_EQ(moved.loss, none.loss);
      } else {
        expect_close(moved.loss, none.loss, 1e-6, "loss");
      }
    }
  }
}

// A 32K-token sequence through forward and backward on the GPU in bf16 (head_dim 64: the flash
// kernels), on a 1 GiB device: one head's fp32 score matrix alone would be 4 GiB, so nothing
// quadratic is kept. Its loss is the CPU backend's to the bf16 tolerance.
TEST_F(CudaTrainTest, A32kSequenceTrainsWithoutAQuadraticBuffer) {
  TempDir dir;
  constexpr std::int64_t kLong = 32768;
  Json j = gpu_tiny_config(dir);
  j["model"] = testing::long_context_model(128, 256, 2, 1);
  j["data"] = {{"path", dir.write("long.u16", testing::long_sequence_u16(kLong))},
               {"format", "u16"}};
  j["precision"] = "bf16";
  j["seq_len"] = kLong;
  j["batch_size"] = 1;
  j["micro_batch_size"] = 1;
  j["max_steps"] = 1;
  j["threads"] = 0;
  j["save_dir"] = "";
  j["device_memory_limit"] = "1GiB";
  const History gpu = train_on(j, "cuda");
  ASSERT_EQ(gpu.loss.size(), 1u);
  EXPECT_TRUE(std::isfinite(gpu.loss[0]));
  EXPECT_LE(gpu.peak_device_bytes, std::uint64_t{1} << 30);
  const History cpu = train_on(j, "cpu");
  expect_close(gpu.loss, cpu.loss, 2e-2, "loss");
}

}  // namespace
}  // namespace strata::train

#endif  // STRATA_HAVE_CUDA
