// The estimate tests' small model and their comparisons of a prediction with a measurement.
#pragma once

#include <gtest/gtest.h>
#include <malloc.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "strata/device/adam8bit.h"
#include "strata/device/nf4.h"
#include "strata/model/param_layout.h"
#include "strata/train/config.h"
#include "strata/train/estimate.h"
#include "strata/train/step_probe.h"
#include "strata/train/step_time.h"
#include "strata/train/trainer.h"
#include "tests/testing/temp_dir.h"

namespace strata::train {

namespace fs = std::filesystem;
using testing::TempDir;

inline Json small_config(const TempDir& dir) {
  std::string text;
  for (int i = 0; text.size() < 12000; ++i) text += "tier " + std::to_string(i % 97) + " moves\n";
  Json j = Json::parse(R"({
    "model": {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
              "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64},
    "seq_len": 32, "batch_size": 4, "micro_batch_size": 2, "max_steps": 3,
    "precision": "fp32", "threads": 1, "save_dir": ""
  })");
  j["data"] = {{"path", dir.write("data.txt", text)}, {"format", "text"}};
  j["swap_paths"] = {dir.file("swap")};
  fs::create_directories(dir.file("swap"));
  return j;
}

inline Result<TrainConfig> config_of(const Json& j) { return parse_train_config(j, "test config"); }

// Within `rel` of `want`, in either direction, and up to `above_bytes` more above and
// `below_bytes` more below.
inline void expect_near_rel(std::uint64_t got, std::uint64_t want, double rel, const char* what,
                            std::uint64_t above_bytes = 0, std::uint64_t below_bytes = 0) {
  EXPECT_LE(static_cast<double>(got),
            static_cast<double>(want) * (1 + rel) + static_cast<double>(above_bytes))
      << what << ": measured " << got << ", predicted " << want;
  EXPECT_GE(static_cast<double>(got),
            static_cast<double>(want) * (1 - rel) - static_cast<double>(below_bytes))
      << what << ": measured " << got << ", predicted " << want;
}

}  // namespace strata::train
