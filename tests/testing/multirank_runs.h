// Runs of `strata train` on several ranks under mpirun, for the integration tests that compare
// them: a small model's config, its losses and saved weights, and the bounds runs on different
// grids must meet.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <sstream>
#include <string>
#include <vector>

#include "strata/core/json.h"
#include "strata/model/safetensors.h"
#include "tests/testing/temp_dir.h"

namespace strata::testing {

namespace multirank_fs = std::filesystem;

inline int run(const std::string& cmd) {
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// Each mpirun gets its own session directory: concurrent mpiruns sharing /tmp/ompi.* race when
// one removes the shared parent while another creates its own entry in it.
inline std::string mpirun(const TempDir& dir, int np) {
  return "OMPI_MCA_orte_tmpdir_base=" + dir.path() +
         " mpirun --allow-run-as-root --oversubscribe --bind-to none --mca btl self,vader -np " +
         std::to_string(np) + " ";
}

inline Json config(const TempDir& dir, const std::string& name) {
  std::string text;
  for (int i = 0; i < 300; ++i) text += "partitioned shards gather and scatter across ranks. ";
  Json j = Json::parse(R"({
    "model": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64},
    "seq_len": 16, "batch_size": 8, "micro_batch_size": 2, "max_steps": 3,
    "precision": "fp32", "optimizer": {"lr": 0.01, "weight_decay": 0.1}, "grad_clip": 0.5,
    "threads": 1, "param_persistence_threshold": 0, "dist_timeout_s": 60
  })");
  // On for one rank too ("auto" turns it on for several only), so every rank count's run is
  // comparable to the bit.
  j["deterministic_reduction"] = true;
  if (!multirank_fs::exists(dir.file("data.txt"))) dir.write("data.txt", text);
  j["data"] = {{"path", dir.file("data.txt")}, {"format", "text"}};
  j["save_dir"] = dir.file(name + "/ckpt");
  j["metrics_file"] = dir.file(name + "/metrics.jsonl");
  j["swap_paths"] = {dir.file(name + "/swap-{rank}")};
  return j;
}

inline std::vector<double> losses(const std::string& metrics) {
  std::vector<double> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) out.push_back(Json::parse(line)["loss"].get<double>());
  return out;
}

// Every tensor of a safetensors file, in its order, as fp32.
inline std::vector<float> tensors(const std::string& file) {
  auto r = model::SafetensorsReader::open(file);
  EXPECT_TRUE(r.is_ok()) << r.status().message();
  std::vector<float> all;
  if (!r.is_ok()) return all;
  for (const auto& e : r->entries()) {
    std::vector<float> t(static_cast<std::size_t>((e.end - e.begin) / 4));
    EXPECT_TRUE(r->read(e.name, e.shape, t.data(), DType::kF32).is_ok());
    all.insert(all.end(), t.begin(), t.end());
  }
  return all;
}

// Expects every file of checkpoint `a` in `b` with the same bytes, trainer_state.json compared as
// JSON without the config keys `ignored` (those the two runs were given differently). Returns
// how many files were compared.
inline int expect_same_checkpoint(const std::string& a, const std::string& b,
                                  std::initializer_list<const char*> ignored) {
  namespace fs = multirank_fs;
  int files = 0;
  for (const auto& e : fs::recursive_directory_iterator(a)) {
    if (!e.is_regular_file()) continue;
    const fs::path rel = fs::relative(e.path(), a);
    SCOPED_TRACE(rel.string());
    EXPECT_TRUE(fs::exists(fs::path(b) / rel));
    std::stringstream x, y;
    x << std::ifstream(e.path(), std::ios::binary).rdbuf();
    y << std::ifstream(fs::path(b) / rel, std::ios::binary).rdbuf();
    if (rel == "trainer_state.json") {
      Json jx = Json::parse(x.str()), jy = Json::parse(y.str());
      for (const char* key : ignored) {
        jx["config"].erase(key);
        jy["config"].erase(key);
      }
      EXPECT_TRUE(jx == jy) << jx.dump() << "\n" << jy.dump();
    } else {
      EXPECT_TRUE(x.str() == y.str()) << "differs";
    }
    ++files;
  }
  return files;
}

inline std::vector<float> weights(const std::string& model_dir) {
  return tensors(model_dir + "/model.safetensors");
}

// Trains `j` with np ranks (np = 1 runs without mpirun); returns the exit code.
inline int run_train(const TempDir& dir, const Json& j, const std::string& name, int np,
                     const std::string& extra = "") {
  multirank_fs::create_directories(dir.file(name));
  for (int r = 0; r < 4; ++r)
    multirank_fs::create_directories(dir.file(name + "/swap-" + std::to_string(r)));
  dir.write(name + "/config.json", j.dump());
  const std::string cmd = (np > 1 ? mpirun(dir, np) : std::string()) + STRATA_CLI + " train " +
                          dir.file(name + "/config.json") + " " + extra + " >" +
                          dir.file(name + "/out.txt") + " 2>" + dir.file(name + "/err.txt");
  return run(cmd);
}

inline void expect_close(const std::vector<double>& a, const std::vector<double>& b, double rel) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i], b[i], rel * std::abs(b[i])) << "step " << i + 1;
}

// Weights after `steps` AdamW steps at learning rate `lr`, trained with different world sizes:
// the ranks sum the micro-batch gradients in another order ((a+b)+(c+d) instead of
// ((a+b)+c)+d), and so do different BLAS kernels, which moves a gradient by an ulp of partial
// sums that may nearly cancel. Adam turns that into an update difference that does not scale
// with |w|: a gradient near eps (1e-8) gets lr * eps * dg / (|g| + eps)^2, and every step moves
// any weight by about lr whatever its size. Measured: up to 1e-3 * lr over 3 steps between world
// sizes and OpenBLAS kernels. A real bug (a lost micro-batch, a wrong shard) moves weights by
// about lr per step, so the bound is 1% of lr per step, plus the weights' own rounding (an ulp
// per step). The losses are checked tightly beside this. (A gradient scaled uniformly, as by
// wrong averaging, moves no weight: Adam and clipping are invariant to it.)
inline void expect_weights_close(const std::vector<float>& a, const std::vector<float>& b,
                                 double lr, int steps) {
  ASSERT_EQ(a.size(), b.size());
  std::size_t bad = 0, worst_at = 0;
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double ulp = std::abs(std::nextafter(b[i], INFINITY) - b[i]);
    const double bound = steps * (0.01 * lr + ulp);
    const double err = std::abs(static_cast<double>(a[i]) - b[i]);
    if (err / bound > worst) worst = err / bound, worst_at = i;
    if (!(err <= bound)) ++bad;
  }
  EXPECT_EQ(bad, 0u) << "of " << a.size() << " weights, worst " << worst << "x its bound (weight "
                     << worst_at << ": " << a[worst_at] << ", want " << b[worst_at] << ")";
}

// Bit for bit: the losses (as the metrics file prints them, every digit of a double) and every
// weight's bits.
inline void expect_same_bits(const std::vector<double>& loss, const std::vector<double>& ref_loss,
                             const std::vector<float>& w, const std::vector<float>& ref_w) {
  ASSERT_EQ(loss.size(), ref_loss.size());
  for (std::size_t i = 0; i < loss.size(); ++i) {
    EXPECT_EQ(std::bit_cast<std::uint64_t>(loss[i]), std::bit_cast<std::uint64_t>(ref_loss[i]))
        << "step " << i + 1 << ": loss " << loss[i] << ", want " << ref_loss[i];
  }
  ASSERT_EQ(w.size(), ref_w.size());
  std::size_t differ = 0, first = 0;
  for (std::size_t i = 0; i < w.size(); ++i) {
    if (std::bit_cast<std::uint32_t>(w[i]) == std::bit_cast<std::uint32_t>(ref_w[i])) continue;
    if (differ++ == 0) first = i;
  }
  EXPECT_EQ(differ, 0u) << "of " << w.size() << " weights; the first, " << first << ": "
                        << (differ ? w[first] : 0.0f) << ", want "
                        << (differ ? ref_w[first] : 0.0f);
}

// Trains `j` as run `name` on np ranks (its own checkpoints, metrics and swap) and expects the
// losses and 3-step weights of the one-rank run: bit for bit (deterministic_reduction, the
// default, without tensor parallelism, with the reference's micro-batches: `same_micro_batches`),
// or within the bounds of another summation order.
inline void expect_same_run_as(const TempDir& dir, Json j, const std::string& name, int np,
                               const std::vector<double>& ref_loss, const std::vector<float>& ref_w,
                               bool same_micro_batches = true) {
  j["save_dir"] = dir.file(name + "/ckpt");
  j["metrics_file"] = dir.file(name + "/metrics.jsonl");
  j["swap_paths"] = {dir.file(name + "/swap-{rank}")};
  ASSERT_EQ(run_train(dir, j, name, np), 0) << std::ifstream(dir.file(name + "/err.txt")).rdbuf();
  const std::vector<double> loss = losses(dir.file(name + "/metrics.jsonl"));
  const std::vector<float> w = weights(dir.file(name + "/ckpt/step-00000003/model"));
  // Tensor parallelism splits each GEMM's sums: bit for bit on the data-parallel axis alone.
  if (same_micro_batches && j.contains("deterministic_reduction") &&
      j["deterministic_reduction"] == true && j.value("tensor_parallel_size", 1) == 1) {
    expect_same_bits(loss, ref_loss, w, ref_w);
    return;
  }
  expect_close(loss, ref_loss, 1e-5);
  expect_weights_close(w, ref_w, j["optimizer"]["lr"].get<double>(), 3);
}

// Two ranks train until `fault` (strata train --inject-fault KIND:1:3: rank 1, step 3)
// strikes; returns how the job ended.
struct FaultedRun {
  int rc = 0;
  double seconds = 0;
  std::string err;
};
inline FaultedRun run_with_fault(TempDir& dir, const std::string& name, const std::string& fault,
                                 int timeout_s, const Json& changes = Json::object()) {
  Json j = config(dir, name);
  j["max_steps"] = 100000;
  j["dist_timeout_s"] = timeout_s;
  j.merge_patch(changes);
  multirank_fs::create_directories(dir.file(name));
  dir.write(name + "/config.json", j.dump());
  const std::string cmd = mpirun(dir, 2) + STRATA_CLI + " train " +
                          dir.file(name + "/config.json") + " --inject-fault " + fault + ":1:3 >" +
                          dir.file(name + "/out.txt") + " 2>" + dir.file(name + "/err.txt");
  FaultedRun r;
  const auto start = std::chrono::steady_clock::now();
  r.rc = run(cmd);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::stringstream err;
  err << std::ifstream(dir.file(name + "/err.txt")).rdbuf();
  r.err = err.str();
  return r;
}

}  // namespace strata::testing
