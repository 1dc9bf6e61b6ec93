// Training runs on a tiny model for the integration tests: its config, its runs, and the bits a
// run leaves (losses, norms, the saved weights and moments) that the tests compare.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "strata/core/file.h"
#include "strata/device/adam8bit.h"
#include "strata/io/swap.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/train/checkpoint.h"
#include "strata/train/config.h"
#include "strata/train/estimate.h"
#include "strata/train/trainer.h"
#include "strata/zero/partition.h"
#include "strata/zero/plan.h"
#include "tests/integration/train_history.h"
#include "tests/testing/family_models.h"
#include "tests/testing/long_sequence.h"
#include "tests/testing/loss_scale_replay.h"
#include "tests/testing/multirank_runs.h"
#include "tests/testing/temp_dir.h"

namespace strata::train {

namespace fs = std::filesystem;
using testing::TempDir;

inline std::string make_text(std::size_t bytes) {
  std::string s;
  const char* words[] = {"the ",  "model ",   "learns ", "to ",     "predict ", "next ",
                         "byte ", "offload ", "tiers ",  "memory ", "\n"};
  std::uint64_t x = 12345;
  while (s.size() < bytes) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    s += words[(x >> 33) % 11];
  }
  return s;
}

inline Json tiny_config(const TempDir& dir) {
  const std::string data = dir.write("data.txt", make_text(20000));
  Json j = tiny_run();
  j["data"] = {{"path", data}, {"format", "text"}};
  j["save_dir"] = dir.file("ckpt");
  j["swap_paths"] = {dir.file("swap")};
  fs::create_directories(dir.file("swap"));
  return j;
}

inline Result<std::unique_ptr<Trainer>> make_trainer(const Json& j,
                                                     const std::string& resume = "") {
  STRATA_ASSIGN_OR_RETURN(TrainConfig c, parse_train_config(j, "test config"));
  TrainOptions o;
  o.resume_dir = resume;
  return Trainer::create(c, o);
}

inline std::vector<double> losses_of(const Trainer& t) {
  std::vector<double> l;
  for (const auto& m : t.history()) l.push_back(m.loss);
  return l;
}

inline std::vector<double> run(const Json& j) {
  auto t = make_trainer(j);
  EXPECT_TRUE(t.is_ok()) << t.status().message();
  if (!t.is_ok()) return {};
  Status s = (*t)->run();
  EXPECT_TRUE(s.is_ok()) << s.message();
  return losses_of(**t);
}

// What one run leaves that the schedule of its optimizer steps must not change: every step's
// loss, gradient norm and skip (as bits: a skipped step's loss is NaN), and the final weights
// and moments as saved.
struct RunBits {
  std::vector<std::uint64_t> losses, norms;
  std::vector<bool> skipped;
  std::vector<double> scales;                    // fp16's loss scale of each step (0 without)
  std::string model, optimizer;                  // the checkpoint's files, byte for byte
  int guessed = 0, redone = 0, rolled_back = 0;  // steps, under optimizer_overlap "backward"
  double device_step_ms = 0;  // the device's step of the groups it keeps (every step's)
};

inline RunBits run_bits(const Json& j) {
  RunBits b;
  auto t = make_trainer(j);
  EXPECT_TRUE(t.is_ok()) << t.status().message();
  if (!t.is_ok()) return b;
  const Status s = (*t)->run();
  EXPECT_TRUE(s.is_ok()) << s.message();
  for (const auto& m : (*t)->history()) {
    b.losses.push_back(std::bit_cast<std::uint64_t>(m.loss));
    b.norms.push_back(std::bit_cast<std::uint64_t>(m.grad_norm));
    b.skipped.push_back(m.skipped);
    b.scales.push_back(m.loss_scale.value_or(0.0));
    b.guessed += m.guessed ? 1 : 0;
    b.redone += m.redone ? 1 : 0;
    b.rolled_back += m.guessed && m.skipped ? 1 : 0;
    b.device_step_ms += m.optimizer_device_ms;
  }
  const std::string dir = (*t)->last_checkpoint();
  auto slurp = [](const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    EXPECT_TRUE(f.good()) << path;
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  b.model = slurp(dir + "/model/model.safetensors");
  b.optimizer = slurp(dir + "/optimizer-00000-of-00001.safetensors");
  return b;
}

// `j` run with optimizer_overlap "none", "forward" and "backward", each saving under `dir`.
struct Schedules {
  RunBits serial, forward, backward;
};
inline Schedules run_schedules(Json j, const TempDir& dir) {
  Schedules r;
  for (auto [name, into] : {std::pair{"none", &r.serial}, std::pair{"forward", &r.forward},
                            std::pair{"backward", &r.backward}}) {
    j["optimizer_overlap"] = name;
    j["save_dir"] = dir.file(name);
    *into = run_bits(j);
  }
  return r;
}

inline void expect_same_bits(const RunBits& overlap, const RunBits& serial) {
  EXPECT_EQ(overlap.losses, serial.losses);
  EXPECT_EQ(overlap.scales, serial.scales);
  EXPECT_EQ(overlap.norms, serial.norms);
  EXPECT_EQ(overlap.skipped, serial.skipped);
  EXPECT_FALSE(serial.model.empty());
  EXPECT_TRUE(overlap.model == serial.model) << "final weights differ";
  EXPECT_TRUE(overlap.optimizer == serial.optimizer) << "final moments differ";
}

// The checkpoint ckpt/latest names after `j` trained two steps and saved it.
inline std::string save_after_two_steps(const TempDir& dir, const Json& j) {
  {
    auto t = make_trainer(j);
    EXPECT_TRUE(t.is_ok()) << t.status().message();
    if (!t.is_ok()) return "";
    EXPECT_TRUE((*t)->run_steps(2).is_ok());
    EXPECT_TRUE((*t)->save().is_ok());
  }
  std::ifstream latest(dir.file("ckpt/latest"));
  std::string name;
  std::getline(latest, name);
  return name;
}

// Checkpoint `name`'s trainer_state.json, as if format_version `version` had written it.
inline void mark_format_version(const TempDir& dir, const std::string& name, int version) {
  const std::string state_file = dir.file("ckpt/" + name + "/trainer_state.json");
  std::ifstream in(state_file);
  Json st = Json::parse(in);
  st["format_version"] = version;
  std::ofstream(state_file) << st.dump();
}

}  // namespace strata::train
