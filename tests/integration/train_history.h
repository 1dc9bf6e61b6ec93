// The GPU training tests' tiny config, and one trainer's run for the tests that compare runs step
// by step: its steps' losses, gradient norms, skips and loss scales, its device peak and its
// traffic. A failure to create or run the trainer is the test's failure (and an empty history).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "strata/core/json.h"
#include "strata/train/config.h"
#include "strata/train/trainer.h"
#include "tests/testing/gpu_rehearsal.h"
#include "tests/testing/temp_dir.h"

namespace strata::train {

inline std::string gpu_text(std::size_t bytes) {
  std::string s;
  const char* words[] = {"the ", "gpu ", "trains ", "a ", "tiny ", "model ", "on ", "bytes ", "\n"};
  std::uint64_t x = 99;
  while (s.size() < bytes) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    s += words[(x >> 33) % 9];
  }
  return s;
}

// The tests' tiny model (hidden 32 / 4 heads: head_dim 8, the GPU's simple attention kernels),
// 4 steps of 2 micro-batches, fp32; no data yet.
inline Json tiny_run() {
  return Json::parse(R"({
    "model": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64},
    "seq_len": 16, "batch_size": 4, "micro_batch_size": 2, "max_steps": 4,
    "precision": "fp32",
    "optimizer": {"lr": 0.01, "betas": [0.9, 0.95], "weight_decay": 0.1},
    "lr_schedule": {"type": "cosine", "warmup_steps": 1, "min_lr": 0.001},
    "grad_clip": 0.5, "threads": 1
  })");
}

// The GPU tests' tiny run, on a 256 MiB device where the config names a GPU.
inline Json gpu_tiny_config(const testing::TempDir& dir) {
  Json j = tiny_run();
  j["device_memory_limit"] = "256MiB";
  j["data"] = {{"path", dir.write("data.txt", gpu_text(20000))}, {"format", "text"}};
  j["save_dir"] = dir.file("ckpt");
  return j;
}

struct History {
  std::vector<double> loss, grad_norm;
  std::vector<bool> skipped;
  std::vector<double> loss_scale;  // fp16's, else 0
  std::uint64_t peak_device_bytes = 0;
  std::uint64_t sent_bytes = 0, all_to_all_bytes = 0;  // over the steps
};

using strata::testing::rehearsing_gpu_tests;

// Trains `j`'s max_steps with `options` (device "cuda" on the CPU backend when rehearsing).
inline History train_history(Json j, const TrainOptions& options = {}) {
  if (rehearsing_gpu_tests() && j.value("device", "") == "cuda") j["device"] = "cpu";
  History r;
  auto c = parse_train_config(j, "test config");
  EXPECT_TRUE(c.is_ok()) << c.status().message();
  if (!c.is_ok()) return r;
  auto t = Trainer::create(*c, options);
  EXPECT_TRUE(t.is_ok()) << t.status().message();
  if (!t.is_ok()) return r;
  const Status s = (*t)->run_steps(c->max_steps);
  EXPECT_TRUE(s.is_ok()) << s.message();
  for (const StepMetrics& m : (*t)->history()) {
    r.loss.push_back(m.loss);
    r.grad_norm.push_back(m.grad_norm);
    r.skipped.push_back(m.skipped);
    r.loss_scale.push_back(m.loss_scale.value_or(0.0));
    r.peak_device_bytes = std::max(r.peak_device_bytes, m.peak_device_bytes);
    r.sent_bytes += m.sent_bytes;
    r.all_to_all_bytes += m.all_to_all_bytes;
  }
  return r;
}

}  // namespace strata::train
