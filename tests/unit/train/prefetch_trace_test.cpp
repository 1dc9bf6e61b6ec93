// The prefetch keys (prefetch_bytes, max_live_bytes, max_reuse_distance) and trace_file: strict
// parsing, and a run that writes a Chrome trace with a row per stream and reports busy and
// stall times.
#include <gtest/gtest.h>

#include <set>

#include "strata/core/file.h"
#include "strata/train/config.h"
#include "strata/train/trainer.h"
#include "tests/testing/temp_dir.h"

namespace strata::train {
namespace {

Json minimal() {
  return Json::parse(R"({"model": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
                         "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "max_position_embeddings": 32},
                         "seq_len": 16, "data": {"path": "x.txt", "format": "text"}})");
}

TEST(PrefetchConfig, BytesAcceptSizesAndDefaultsAreSet) {
  auto d = parse_train_config(minimal(), "t.json");
  ASSERT_TRUE(d.is_ok());
  EXPECT_EQ(d->prefetch_bytes, 256u << 20);
  EXPECT_EQ(d->max_live_bytes, 1u << 30);
  EXPECT_EQ(d->max_reuse_distance, 1u << 30);
  EXPECT_EQ(d->trace_file, "");
  Json j = minimal();
  j["prefetch_bytes"] = "64MiB";
  j["max_live_bytes"] = 123456789;
  j["max_reuse_distance"] = "0";
  j["trace_file"] = "run/trace.json";
  auto c = parse_train_config(j, "t.json");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->prefetch_bytes, 64u << 20);
  EXPECT_EQ(c->max_live_bytes, 123456789u);
  EXPECT_EQ(c->max_reuse_distance, 0u);
  EXPECT_EQ(c->trace_file, "run/trace.json");
  // to_json keeps them, so a checkpoint's config parses back the same.
  auto back = parse_train_config(c->to_json(), "back");
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  EXPECT_EQ(back->prefetch_bytes, c->prefetch_bytes);
  EXPECT_EQ(back->trace_file, c->trace_file);
}

TEST(PrefetchConfig, BadValuesAreAllReported) {
  Json j = minimal();
  j["prefetch_bytes"] = "lots";
  j["max_live_bytes"] = -1;
  j["max_reuse_distance"] = true;
  j["trace_file"] = 3;
  auto c = parse_train_config(j, "t.json");
  ASSERT_FALSE(c.is_ok());
  const std::string& m = c.status().message();
  for (const char* key :
       {"'prefetch_bytes'", "'max_live_bytes'", "'max_reuse_distance'", "'trace_file'"}) {
    EXPECT_NE(m.find(key), std::string::npos) << key << " missing from: " << m;
  }
}

TEST(TraceFile, RunWritesOneRowPerStreamAndMetricsHaveBusyTimes) {
  testing::TempDir dir;
  std::string text;
  for (int i = 0; i < 400; ++i) text += "offload the layers to the tiers and back again ";
  Json j = minimal();
  j["data"] = {{"path", dir.write("data.txt", text)}, {"format", "text"}};
  j["seq_len"] = 16;
  j["batch_size"] = 2;
  j["max_steps"] = 2;
  j["threads"] = 1;
  j["offload_param"] = "nvme";
  j["offload_optimizer"] = "cpu";
  // The serial step: the store counts every thread's waits as stalls, so under an overlapped
  // schedule the optimizer thread's waits for gradients would count too, and the bound below
  // (the compute thread's waits fit in its step) would not hold by construction.
  j["optimizer_overlap"] = "none";
  j["swap_paths"] = {dir.path()};
  j["save_dir"] = dir.file("ckpt");
  j["trace_file"] = dir.file("out/trace.json");
  auto c = parse_train_config(j, "t.json");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  auto t = Trainer::create(*c, TrainOptions{});
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  ASSERT_TRUE((*t)->run().is_ok());
  for (const StepMetrics& m : (*t)->history()) {
    EXPECT_GT(m.d2h_busy_ms, 0.0);  // gradients leaving the device
    // No host_memory_limit: the working copies the optimizer writes are not kept in host
    // memory, so every step reads its parameters from NVMe.
    EXPECT_GT(m.nvme_read_busy_ms, 0.0);
    // Stalls are time the compute thread spent blocked inside the step: never more than the step
    // (a stall counted per waiting lane instead of once would exceed it).
    EXPECT_LE(m.stall_ms, m.step_ms);
    EXPECT_LE(m.wait_ms, m.step_ms);
    const Json js = m.to_json();
    for (const char* k :
         {"stall_ms", "h2d_busy_ms", "d2h_busy_ms", "nvme_read_busy_ms", "nvme_write_busy_ms"}) {
      EXPECT_TRUE(js.contains(k)) << k;
    }
  }
  auto trace = read_file(dir.file("out/trace.json"));
  ASSERT_TRUE(trace.is_ok()) << trace.status().to_string();
  const Json tj = Json::parse(*trace);
  std::set<std::string> rows_with_spans;
  std::map<int, std::string> names;
  bool layer_forward = false, layer_backward = false;
  for (const Json& e : tj["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") {
      names[e["tid"].get<int>()] = e["args"]["name"].get<std::string>();
    }
  }
  for (const Json& e : tj["traceEvents"]) {
    if (e["ph"] != "X") continue;
    rows_with_spans.insert(names[e["tid"].get<int>()]);
    const std::string n = e["name"].get<std::string>();
    layer_forward |= n == "layers.1 forward";
    layer_backward |= n == "layers.1 backward";
  }
  EXPECT_TRUE(layer_forward);
  EXPECT_TRUE(layer_backward);
  // Every row is named; on the CPU backend NVMe reads land in device memory directly, so the
  // h2d row may stay empty with parameters on NVMe.
  EXPECT_EQ(names.size(), 6u);
  for (const char* row : {"compute", "d2h", "nvme read", "nvme write", "cpu optimizer"}) {
    EXPECT_TRUE(rows_with_spans.count(row)) << "no spans on the " << row << " row";
  }
}

}  // namespace
}  // namespace strata::train
