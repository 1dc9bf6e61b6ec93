// End-to-end training runs on a tiny model: offload placement never changes the numbers,
// resume is bit-identical, budgets hold, and bad input fails cleanly.
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
#include "tests/testing/family_models.h"
#include "tests/testing/long_sequence.h"
#include "tests/testing/loss_scale_replay.h"
#include "tests/testing/multirank_runs.h"
#include "tests/testing/temp_dir.h"

namespace strata::train {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

std::string make_text(std::size_t bytes) {
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

Json tiny_config(const TempDir& dir) {
  const std::string data = dir.write("data.txt", make_text(20000));
  Json j = Json::parse(R"({
    "model": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64},
    "seq_len": 16, "batch_size": 4, "micro_batch_size": 2, "max_steps": 4,
    "precision": "fp32",
    "optimizer": {"lr": 0.01, "betas": [0.9, 0.95], "weight_decay": 0.1},
    "lr_schedule": {"type": "cosine", "warmup_steps": 1, "min_lr": 0.001},
    "grad_clip": 0.5, "threads": 1
  })");
  j["data"] = {{"path", data}, {"format", "text"}};
  j["save_dir"] = dir.file("ckpt");
  j["swap_paths"] = {dir.file("swap")};
  fs::create_directories(dir.file("swap"));
  return j;
}

Result<std::unique_ptr<Trainer>> make_trainer(const Json& j, const std::string& resume = "") {
  STRATA_ASSIGN_OR_RETURN(TrainConfig c, parse_train_config(j, "test config"));
  TrainOptions o;
  o.resume_dir = resume;
  return Trainer::create(c, o);
}

std::vector<double> losses_of(const Trainer& t) {
  std::vector<double> l;
  for (const auto& m : t.history()) l.push_back(m.loss);
  return l;
}

std::vector<double> run(const Json& j) {
  auto t = make_trainer(j);
  EXPECT_TRUE(t.is_ok()) << t.status().message();
  if (!t.is_ok()) return {};
  Status s = (*t)->run();
  EXPECT_TRUE(s.is_ok()) << s.message();
  return losses_of(**t);
}

// The smallest host_memory_limit the memory plan accepts for config `j` (one rank): there the
// plan must move the gradients to NVMe, since they no longer fit beside the rest.
std::uint64_t smallest_host_limit(const Json& j) {
  auto c = parse_train_config(j, "test config");
  EXPECT_TRUE(c.is_ok()) << c.status().message();
  const model::ParamLayout full = model::ParamLayout::build(c->model);
  const zero::Partition partition(full, 0, 1, c->param_persistence_threshold);
  // The trainer's own plan options (the CPU backend: host-addressable, no device budget).
  zero::PlanOptions po = zero::plan_options(shard_options(*c, 1), 0, /*has_swap=*/true,
                                            /*host_addressable_device=*/true);
  po.zero = zero_options(*c);
  std::uint64_t lo = 1, hi = std::uint64_t{1} << 30;  // make_plan fails at lo, succeeds at hi
  while (hi - lo > 1) {
    po.host_budget_bytes = lo + (hi - lo) / 2;
    (zero::make_plan(partition, po).is_ok() ? hi : lo) = po.host_budget_bytes;
  }
  po.host_budget_bytes = hi;
  auto plan = zero::make_plan(partition, po);
  EXPECT_TRUE(plan.is_ok());
  EXPECT_EQ(plan->gradients, Tier::kNvme) << plan->describe();
  return hi;
}

class OffloadEquivalence : public ::testing::TestWithParam<std::string> {};

// Two micro-batches per step (fp32 accumulators) and one (each gradient kept as computed until
// the step).
TEST_P(OffloadEquivalence, SameLossesForEveryPlacement) {
  for (const int micro : {2, 4}) {
    SCOPED_TRACE("micro_batch_size " + std::to_string(micro));
    TempDir dir;
    Json base = tiny_config(dir);
    base["precision"] = GetParam();
    base["micro_batch_size"] = micro;
    base["offload_param"] = "none";
    base["offload_optimizer"] = "none";
    base["save_dir"] = "";
    const std::vector<double> reference = run(base);
    ASSERT_EQ(reference.size(), 4u);
    EXPECT_LT(reference.back(), reference.front());
    const std::vector<std::pair<std::string, std::string>> placements = {
        {"none", "cpu"}, {"cpu", "cpu"}, {"nvme", "cpu"}, {"none", "nvme"}, {"nvme", "nvme"}};
    for (const auto& [param, opt] : placements) {
      // Gradients summed in host memory, and (micro-batch size 2: two per step) on the device,
      // sent to host memory once per step.
      for (const std::string accumulate : {"host", "device"}) {
        if (accumulate == "device" && micro == 4) continue;  // one micro-batch: nothing to sum
        SCOPED_TRACE("offload_param=" + param + " offload_optimizer=" + opt +
                     " grad_accumulation=" + accumulate);
        Json j = base;
        j["offload_param"] = param;
        j["offload_optimizer"] = opt;
        j["grad_accumulation"] = accumulate;
        EXPECT_EQ(run(j), reference);  // bit-identical, not merely close
      }
    }
  }
}

// With too little host memory for every gradient the plan puts them on NVMe (kept as computed,
// or as fp32 accumulators read, added and written per micro-batch), and the store keeps to the
// budget the plan was made for: the smallest one the plan accepts.
TEST_P(OffloadEquivalence, GradientsOnNvmeUnderAShortHostBudget) {
  for (const int micro : {2, 4}) {
    SCOPED_TRACE("micro_batch_size " + std::to_string(micro));
    TempDir dir;
    Json base = tiny_config(dir);
    base["model"]["num_hidden_layers"] = 8;  // gradients outweigh the staging
    base["precision"] = GetParam();
    base["micro_batch_size"] = micro;
    base["save_dir"] = "";
    // Small sub-groups: on a model this small the optimizer's staging for streamed gradients
    // would otherwise take more than the gradients themselves.
    base["sub_group_size"] = 2048;
    const std::vector<double> reference = run(base);
    ASSERT_EQ(reference.size(), 4u);
    for (const std::string param : {"none", "nvme"}) {
      SCOPED_TRACE("offload_param=" + param);
      Json j = base;
      j["offload_param"] = param;
      j["offload_optimizer"] = "nvme";
      j["host_memory_limit"] = smallest_host_limit(j);
      auto t = make_trainer(j);
      ASSERT_TRUE(t.is_ok()) << t.status().message();
      EXPECT_NE((*t)->describe().find("on nvme\n"), std::string::npos) << (*t)->describe();
      const Status st = (*t)->run();
      ASSERT_TRUE(st.is_ok()) << st.message();
      EXPECT_EQ(losses_of(**t), reference);
      for (const auto& m : (*t)->history()) {
        EXPECT_LE(m.peak_host_bytes, j["host_memory_limit"].get<std::uint64_t>());
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Precisions, OffloadEquivalence, ::testing::Values("fp32", "bf16", "fp16"));

// What one run leaves that the schedule of its optimizer steps must not change: every step's
// loss, gradient norm and skip (as bits: a skipped step's loss is NaN), and the final weights
// and moments as saved.
struct RunBits {
  std::vector<std::uint64_t> losses, norms;
  std::vector<bool> skipped;
  std::vector<double> scales;                    // fp16's loss scale of each step (0 without)
  std::string model, optimizer;                  // the checkpoint's files, byte for byte
  int guessed = 0, redone = 0, rolled_back = 0;  // steps, under optimizer_overlap "backward"
};

RunBits run_bits(const Json& j) {
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
Schedules run_schedules(Json j, const TempDir& dir) {
  Schedules r;
  for (auto [name, into] : {std::pair{"none", &r.serial}, std::pair{"forward", &r.forward},
                            std::pair{"backward", &r.backward}}) {
    j["optimizer_overlap"] = name;
    j["save_dir"] = dir.file(name);
    *into = run_bits(j);
  }
  return r;
}

void expect_same_bits(const RunBits& overlap, const RunBits& serial) {
  EXPECT_EQ(overlap.losses, serial.losses);
  EXPECT_EQ(overlap.scales, serial.scales);
  EXPECT_EQ(overlap.norms, serial.norms);
  EXPECT_EQ(overlap.skipped, serial.skipped);
  EXPECT_FALSE(serial.model.empty());
  EXPECT_TRUE(overlap.model == serial.model) << "final weights differ";
  EXPECT_TRUE(overlap.optimizer == serial.optimizer) << "final moments differ";
}

// optimizer_overlap "forward" runs each update beside the next forward, and "backward" starts
// it beside backward, guessing that the step does not clip; both must give the very bits of
// the serial schedule: every placement with the optimizer off the device, gradient clipping that
// triggers (the guess is redone), that is on but does not trigger (the guess holds, gradients
// kept for a redo that never comes) and that is off, one micro-batch per step and two, and a
// run whose steps are skipped for non-finite gradients (the guess is rolled back).
TEST(OptimizerOverlap, EveryScheduleIsBitIdenticalToTheSerialStep) {
  struct Case {
    const char* param;
    const char* opt;
    const char* accumulate = "host";  // grad_accumulation
  };
  const Case placements[] = {{"none", "cpu"},           {"cpu", "cpu"},   {"nvme", "cpu"},
                             {"none", "nvme"},          {"nvme", "nvme"}, {"none", "cpu", "device"},
                             {"nvme", "nvme", "device"}};
  bool clipped = false;
  int guessed = 0, redone = 0;
  for (const Case& c : placements) {
    for (const double clip : {0.5, 1e6, 0.0}) {
      for (const int micro : {2, 4}) {
        if (std::string(c.accumulate) == "device" && micro == 4) continue;  // nothing to sum
        SCOPED_TRACE(std::string("offload_param ") + c.param + ", offload_optimizer " + c.opt +
                     ", grad_accumulation " + c.accumulate + ", grad_clip " + std::to_string(clip) +
                     ", micro_batch_size " + std::to_string(micro));
        TempDir dir;
        Json j = tiny_config(dir);
        j["offload_param"] = c.param;
        j["offload_optimizer"] = c.opt;
        j["grad_accumulation"] = c.accumulate;
        j["grad_clip"] = clip;
        j["micro_batch_size"] = micro;
        const Schedules r = run_schedules(j, dir);
        ASSERT_EQ(r.serial.losses.size(), 4u);
        expect_same_bits(r.forward, r.serial);
        expect_same_bits(r.backward, r.serial);
        EXPECT_EQ(r.serial.guessed + r.forward.guessed, 0);
        bool any_clipped = false;
        for (std::uint64_t n : r.serial.norms) {
          any_clipped |= clip > 0 && std::bit_cast<double>(n) > clip;
        }
        clipped |= any_clipped;
        // A step that clipped is redone, and the step after it does not guess.
        EXPECT_EQ(r.backward.redone > 0, any_clipped);
        if (!any_clipped) {
          EXPECT_EQ(r.backward.guessed, 4);
        }
        guessed += r.backward.guessed;
        redone += r.backward.redone;
      }
    }
  }
  EXPECT_TRUE(clipped) << "no step clipped: lower grad_clip";
  EXPECT_GT(guessed, redone);
  EXPECT_GT(redone, 0);

  // An enormous learning rate: the first update blows the weights up, and the steps after it
  // are skipped for non-finite gradients.
  for (const char* opt : {"cpu", "nvme"}) {
    SCOPED_TRACE(std::string("skipped steps, offload_optimizer ") + opt);
    TempDir dir;
    Json j = tiny_config(dir);
    j["offload_optimizer"] = opt;
    j["grad_clip"] = 0.0;
    j["optimizer"]["lr"] = 1e30;
    j["lr_schedule"]["type"] = "constant";
    const Schedules r = run_schedules(j, dir);
    ASSERT_EQ(r.serial.skipped.size(), 4u);
    EXPECT_TRUE(r.serial.skipped.back()) << "no step was skipped: raise the learning rate";
    expect_same_bits(r.forward, r.serial);
    expect_same_bits(r.backward, r.serial);
    EXPECT_EQ(r.backward.rolled_back, 1) << "the first skipped step was guessed, the rest not";
  }
}

// In the Chrome trace of an overlapped run, each group's update starts only after that group's
// last backward of the step (its final gradient), and the next forward of the group starts
// only after its update ended: the forward waits for exactly what it needs.
TEST(OptimizerOverlap, UpdatesFollowTheirGradientsAndPrecedeTheirNextForward) {
  for (const char* overlap : {"forward", "backward"}) {
    SCOPED_TRACE(std::string("optimizer_overlap ") + overlap);
    TempDir dir;
    Json j = tiny_config(dir);
    j["offload_param"] = "nvme";
    j["offload_optimizer"] = "nvme";
    j["optimizer_overlap"] = overlap;
    j["grad_clip"] = 0.0;  // every backward step guesses
    j["save_dir"] = "";
    j["trace_file"] = dir.file("trace.json");
    run(j);
    auto text = read_file(dir.file("trace.json"));
    ASSERT_TRUE(text.is_ok()) << text.status().message();
    const Json trace = Json::parse(*text);
    struct Span {
      double begin, end;
    };
    std::map<std::string, std::vector<Span>> backward, forward, update;
    int guessed = 0;
    for (const Json& e : trace["traceEvents"]) {
      if (e.value("ph", "") != "X") continue;
      const std::string name = e["name"];
      const double b = e["ts"].get<double>(), d = e["dur"].get<double>();
      auto strip = [&](const std::string& suffix, std::map<std::string, std::vector<Span>>& into) {
        if (name.size() > suffix.size() &&
            name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
          into[name.substr(0, name.size() - suffix.size())].push_back({b, b + d});
        }
      };
      strip(" backward", backward);
      strip(" forward", forward);
      for (const std::string prefix : {"update ", "update (guessed) "}) {
        if (name.rfind(prefix, 0) == 0 && name.find('(', prefix.size()) == std::string::npos) {
          update[name.substr(prefix.size())].push_back({b, b + d});
          guessed += prefix.size() > 7 ? 1 : 0;
        }
      }
    }
    ASSERT_FALSE(update.empty()) << "no update spans in the trace";
    EXPECT_EQ(guessed > 0, std::string(overlap) == "backward");
    int checked = 0;
    for (const auto& [group, updates] : update) {
      for (const Span& u : updates) {
        for (const Span& bw : backward[group]) {
          if (bw.begin < u.begin) {
            EXPECT_LE(bw.end, u.begin) << group << ": updated mid-backward";
          }
        }
        for (const Span& fw : forward[group]) {
          if (fw.end > u.begin) {
            EXPECT_GE(fw.begin, u.end) << group << ": forward before its update ended";
            ++checked;
          }
        }
      }
    }
    EXPECT_GT(checked, 0);
    // (That a guessed update starts before the rest of backward is done is tested on the engine,
    // where the test controls when each gradient comes: EnginePrefetchTest.)
  }
}

TEST(TrainTest, ResumeIsBitIdenticalToUninterrupted) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["max_steps"] = 6;
  j["offload_param"] = "cpu";
  j["offload_optimizer"] = "nvme";
  const std::vector<double> full = run(j);
  ASSERT_EQ(full.size(), 6u);

  // The first run stops after step 3 (as Ctrl-C would) with the same schedule, then resumes.
  Json first = j;
  first["save_dir"] = dir.file("resume");
  {
    auto t = make_trainer(first);
    ASSERT_TRUE(t.is_ok()) << t.status().message();
    ASSERT_TRUE((*t)->run_steps(3).is_ok());
    ASSERT_TRUE((*t)->save().is_ok());
  }
  ASSERT_TRUE(fs::exists(dir.file("resume/latest")));

  Json second = j;
  second["save_dir"] = dir.file("resume");
  auto t = make_trainer(second, dir.file("resume"));
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  EXPECT_EQ((*t)->step(), 3);
  ASSERT_TRUE((*t)->run().is_ok());
  const std::vector<double> tail = losses_of(**t);
  ASSERT_EQ(tail.size(), 3u);
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(tail[static_cast<std::size_t>(i)], full[static_cast<std::size_t>(3 + i)]) << i;
}

// The checkpoint ckpt/latest names after `j` trained two steps and saved it.
std::string save_after_two_steps(const TempDir& dir, const Json& j) {
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
void mark_format_version(const TempDir& dir, const std::string& name, int version) {
  const std::string state_file = dir.file("ckpt/" + name + "/trainer_state.json");
  std::ifstream in(state_file);
  Json st = Json::parse(in);
  st["format_version"] = version;
  std::ofstream(state_file) << st.dump();
}

// A checkpoint of format_version 1 (a group's tensors on 64-element boundaries in the saved
// moments) resumes where every group's tensors still lie where they lay then, to the bits of the
// same checkpoint marked version 2, and is refused, naming the file, the version and the group,
// where they moved (hidden 32: a norm of 32 elements moved the projections after it); no moment
// is read from the wrong place.
TEST(TrainTest, AVersionOneCheckpointResumesOnlyWhereItsLayoutStands) {
  for (const bool moved : {true, false}) {
    SCOPED_TRACE(moved ? "tensors moved" : "tensors in place");
    TempDir dir;
    Json j = tiny_config(dir);
    if (!moved) {  // every tensor a multiple of 256 elements: the same offsets either way
      j["model"]["hidden_size"] = 256;
      j["model"]["intermediate_size"] = 256;
      j["model"]["num_key_value_heads"] = 4;
    }
    const std::string name = save_after_two_steps(dir, j);
    ASSERT_FALSE(name.empty());
    const auto mark = [&](int version) { mark_format_version(dir, name, version); };
    Json resumed = j;
    resumed["save_dir"] = "";  // the checkpoint stays the latest
    const auto resumed_losses = [&]() -> Result<std::vector<double>> {
      STRATA_ASSIGN_OR_RETURN(auto t, make_trainer(resumed, dir.file("ckpt")));
      STRATA_RETURN_IF_ERROR(t->run());
      return losses_of(*t);
    };
    mark(1);
    auto old = resumed_losses();
    if (moved) {
      ASSERT_FALSE(old.is_ok());
      EXPECT_NE(old.status().message().find(dir.file("ckpt/" + name)), std::string::npos)
          << old.status().message();
      EXPECT_NE(old.status().message().find("format_version 1"), std::string::npos);
      EXPECT_NE(old.status().message().find("group layers.0's tensors on 64-element"),
                std::string::npos)
          << old.status().message();
      continue;
    }
    ASSERT_TRUE(old.is_ok()) << old.status().message();
    mark(2);
    auto now = resumed_losses();
    ASSERT_TRUE(now.is_ok()) << now.status().message();
    EXPECT_EQ(*old, *now);
    EXPECT_EQ(old->size(), 2u);
  }
}

TEST(TrainTest, ActivationCheckpointingDoesNotChangeLosses) {
  TempDir dir;
  Json j = tiny_config(dir);
  const auto plain = run(j);
  j["activation_checkpointing"] = true;
  j["save_dir"] = dir.file("ckpt2");
  EXPECT_EQ(run(j), plain);
}

// activation_offload: each checkpointed layer input waits for its backward in host memory or on
// NVMe. The same bits as keeping them on the device, for every family's layers, every ZeRO stage
// and the optimizer step overlapped with backward; and the device holds a few layers' inputs
// whatever the depth (the plan's device activations fall by the rest).
TEST(TrainTest, ActivationOffloadKeepsTheBitsAndFreesTheDevice) {
  for (const std::string& family : testing::families()) {
    for (const int stage : {1, 2, 3}) {
      TempDir dir;
      Json base = tiny_config(dir);
      base["model"] = testing::family_model(family, 10);
      base["activation_checkpointing"] = true;
      base["seq_len"] = 64;
      base["zero_stage"] = stage;
      base["offload_optimizer"] = "cpu";
      base["optimizer_overlap"] = "backward";
      SCOPED_TRACE(family + " zero_stage " + std::to_string(stage));
      std::map<std::string, std::pair<std::vector<double>, std::string>> runs;
      std::map<std::string, std::uint64_t> activations;  // the plan's on the device
      for (const char* home : {"none", "cpu", "nvme"}) {
        Json j = base;
        j["activation_offload"] = home;
        j["save_dir"] = dir.file(std::string("ckpt-") + home);
        auto t = make_trainer(j);
        ASSERT_TRUE(t.is_ok()) << t.status().message();
        ASSERT_TRUE((*t)->run().is_ok());
        auto weights = read_file((*t)->last_checkpoint() + "/model/model.safetensors");
        ASSERT_TRUE(weights.is_ok()) << weights.status().message();
        runs[home] = {losses_of(**t), *weights};
        auto config = parse_train_config(j, "test config");
        ASSERT_TRUE(config.is_ok());
        auto planned = estimate(*config, 1);
        ASSERT_TRUE(planned.is_ok()) << planned.status().message();
        activations[home] = planned->plan.kind_bytes(Tier::kDevice, zero::TensorKind::kActivations);
        if (std::string(home) != "none") {
          EXPECT_NE((*t)->describe().find(std::string("checkpointed activations wait for the "
                                                      "backward on ") +
                                          (std::string(home) == "cpu" ? "host" : "nvme")),
                    std::string::npos)
              << (*t)->describe();
        }
      }
      EXPECT_EQ(runs["cpu"], runs["none"]);
      EXPECT_EQ(runs["nvme"], runs["none"]);
      // The plan keeps 3 of the 9 inner layer inputs on the device (the one written, the one
      // read, the one arriving); on the CPU backend a copy NVMe reads and writes in place takes
      // whole O_DIRECT blocks and one more.
      const std::uint64_t input = 2 * 64 * 32 * 4;  // micro-batch 2 x seq 64 x hidden 32, fp32
      EXPECT_EQ(activations["cpu"] + 6 * input, activations["none"]);
      EXPECT_EQ(activations["nvme"] + 6 * input, activations["none"] + 3 * io::kIoAlignBytes);
    }
  }
  // Nothing to move without checkpointing.
  TempDir dir;
  Json j = tiny_config(dir);
  j["activation_offload"] = "cpu";
  auto refused = make_trainer(j);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find(
                "'activation_offload': \"cpu\" moves checkpointed activations; it needs "
                "activation_checkpointing true"),
            std::string::npos)
      << refused.status().message();
}

// An NVMe failure while checkpointed activations move there ends the run with the I/O error,
// naming what was being written; the checkpoint saved before it, and `latest`, are untouched.
TEST(TrainTest, ANvmeFailureOfOffloadedActivationsIsReportedAndSparesTheCheckpoint) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["activation_checkpointing"] = true;
  j["activation_offload"] = "nvme";
  j["offload_optimizer"] = "cpu";
  j["max_steps"] = 2;
  ASSERT_EQ(run(j).size(), 2u);
  const std::string ckpt = dir.file("ckpt/step-00000002");
  auto weights = read_file(ckpt + "/model/model.safetensors");
  auto latest = read_file(dir.file("ckpt/latest"));
  ASSERT_TRUE(weights.is_ok() && latest.is_ok());
  j["max_steps"] = 4;
  auto config = parse_train_config(j, "test config");
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  TrainOptions o;
  o.resume_dir = dir.file("ckpt");
  io::FaultRule eio;
  eio.op = io::FaultOp::kWrite;
  eio.times = io::FaultRule::kForever;
  o.swap_faults.rules = {eio};
  auto t = Trainer::create(*config, o);
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  const Status s = (*t)->run();
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find("Input/output error"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("activation"), std::string::npos) << s.message();
  auto weights_after = read_file(ckpt + "/model/model.safetensors");
  auto latest_after = read_file(dir.file("ckpt/latest"));
  ASSERT_TRUE(weights_after.is_ok() && latest_after.is_ok());
  EXPECT_EQ(*weights_after, *weights);
  EXPECT_EQ(*latest_after, *latest);
  EXPECT_FALSE(fs::exists(dir.file("ckpt/step-00000003")));
}

// The LM head and the loss a chunk of tokens at a time: every token's loss and input gradient
// are its own row's (the same arithmetic), and lm_head's weight gradient sums the chunks' products
// in another order than one product over all tokens, as data-parallel ranks sum micro-batches;
// so the losses stay within the multi-rank runs' 1e-5 and the weights within their bound. The
// plan's activations shrink by the logits the chunks leave out, and for Llama 3's vocabulary at
// 8K tokens the head's buffers are under an eighth of the unchunked ones'.
TEST(TrainTest, LmHeadChunksTrackTheWholeHead) {
  TempDir dir;
  Json base = tiny_config(dir);
  base["max_steps"] = 3;
  const auto trained = [&](std::int64_t chunk) {
    Json j = base;
    j["lm_head_chunk_tokens"] = chunk;
    j["save_dir"] = dir.file("ckpt-" + std::to_string(chunk));
    auto t = make_trainer(j);
    EXPECT_TRUE(t.is_ok()) << t.status().message();
    EXPECT_TRUE((*t)->run().is_ok());
    return std::pair{losses_of(**t), testing::weights((*t)->last_checkpoint() + "/model")};
  };
  const auto whole = trained(32);  // micro-batch 2 x seq 16: every token at once
  ASSERT_EQ(whole.first.size(), 3u);
  for (const std::int64_t chunk : {1, 5, 0}) {
    SCOPED_TRACE("lm_head_chunk_tokens " + std::to_string(chunk));
    const auto chunked = trained(chunk);
    testing::expect_close(chunked.first, whole.first, 1e-5);
    testing::expect_weights_close(chunked.second, whole.second, 0.01, 3);
  }

  auto small = parse_train_config(base, "test config");
  ASSERT_TRUE(small.is_ok());
  model::ModelOptions whole_head = small->model_options(), auto_head = whole_head;
  whole_head.lm_head_chunk_tokens = 2 * 16;
  const auto acts = [&](const model::ModelOptions& o) {
    return model::LlamaModel::activation_bytes(small->model, o, 2, 16);
  };
  // vocab 256 over hidden 32: chunks of 2 x 32 x 32 / 256 = 8 tokens, 24 rows of logits fewer.
  EXPECT_EQ(acts(whole_head) - acts(auto_head), 24u * 256 * 4);

  model::LlamaConfig llama3 = small->model;
  llama3.vocab_size = 128256;
  llama3.hidden_size = 4096;
  llama3.num_attention_heads = 32;
  llama3.num_key_value_heads = 8;
  llama3.intermediate_size = 14336;
  llama3.max_position_embeddings = 8192;
  model::ModelOptions bf16 = auto_head, bf16_whole = auto_head;
  bf16.compute_dtype = bf16_whole.compute_dtype = DType::kBF16;
  bf16_whole.lm_head_chunk_tokens = 8192;
  const std::uint64_t chunked = model::LlamaModel::head_bytes(llama3, bf16, 1, 8192);
  const std::uint64_t unchunked = model::LlamaModel::head_bytes(llama3, bf16_whole, 1, 8192);
  EXPECT_LE(8 * chunked, unchunked) << chunked << " of " << unchunked;
}

// A 32K-token sequence through forward and backward, with Llama 3's rope scaling (positions
// past the original 8K context take the scaled frequencies): attention runs in blocks of query
// rows, so the plan's activations grow with the tokens, not their square; and, attention being
// causal, the first 16K targets of a 32K sequence (a loss mask leaves out the rest) have the loss
// a 16K run of the same tokens has (within the rounding of attention blocked another way).
TEST(TrainTest, A32kSequenceTrainsAndItsFirstHalfIsA16kRun) {
  TempDir dir;
  constexpr std::int64_t kLong = 32768, kShort = kLong / 2;
  const std::string tokens = testing::long_sequence_u16(kLong);
  std::string mask;
  for (std::int64_t i = 0; i <= kLong; ++i) {
    mask += static_cast<char>(i <= kShort ? 1 : 0);  // the targets of positions 0 .. 16K-1
  }
  dir.write("long.u16", tokens);
  dir.write("long.u16.mask", mask);
  dir.write("short.u16", tokens.substr(0, static_cast<std::size_t>(2 * (kShort + 1))));
  Json j = tiny_config(dir);
  j["model"] = testing::long_context_model(32, 48, 4, 2);
  j["batch_size"] = 1;
  j["micro_batch_size"] = 1;
  j["max_steps"] = 1;
  j["threads"] = 0;
  j["save_dir"] = "";
  const auto loss = [&](const std::string& file, std::int64_t seq) {
    Json k = j;
    k["data"] = {{"path", dir.file(file)}, {"format", "u16"}};
    k["seq_len"] = seq;
    const auto l = run(k);
    EXPECT_EQ(l.size(), 1u);
    return l.empty() ? 0.0 : l.front();
  };
  const double long_loss = loss("long.u16", kLong), short_loss = loss("short.u16", kShort);
  ASSERT_TRUE(std::isfinite(long_loss));
  EXPECT_NEAR(long_loss, short_loss, 1e-5 * short_loss);

  auto c = parse_train_config(j, "test config");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  const model::ModelOptions o = c->model_options();
  const auto acts = [&](std::int64_t seq) {
    return static_cast<double>(model::LlamaModel::activation_bytes(c->model, o, 1, seq));
  };
  EXPECT_LT(acts(kLong), 2.01 * acts(kShort));
}

TEST(TrainTest, DeviceBudgetIsNeverExceeded) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["offload_param"] = "cpu";
  j["offload_optimizer"] = "cpu";
  const std::uint64_t limit = 400 * 1024;
  j["device_memory_limit"] = limit;
  auto t = make_trainer(j);
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  ASSERT_TRUE((*t)->run().is_ok());
  for (const auto& m : (*t)->history()) {
    EXPECT_LE(m.peak_device_bytes, limit);
    EXPECT_GT(m.peak_device_bytes, 0u);
    EXPECT_GT(m.h2d_bytes, 0u);  // parameters really moved to the device
    EXPECT_GT(m.d2h_bytes, 0u);  // and gradients off it
  }
}

TEST(TrainTest, TooSmallDeviceBudgetIsAClearError) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["offload_param"] = "cpu";
  j["offload_optimizer"] = "cpu";
  j["device_memory_limit"] = 20000;
  auto t = make_trainer(j);
  Status s = t.is_ok() ? (*t)->run() : t.status();
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kOutOfMemory) << s.message();
  EXPECT_NE(s.message().find("device_memory_limit"), std::string::npos) << s.message();
}

TEST(TrainTest, HostBudgetIsAClearError) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["offload_optimizer"] = "cpu";
  j["host_memory_limit"] = 4096;
  auto t = make_trainer(j);
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("host_memory_limit"), std::string::npos)
      << t.status().message();
}

TEST(TrainTest, TokenIdOutOfVocabularyNamesTheFile) {
  TempDir dir;
  Json j = tiny_config(dir);
  std::vector<std::uint16_t> tokens(200, 7);
  tokens[3] = 300;
  const std::string path = dir.write(
      "tokens.u16", std::string(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 2));
  j["data"] = {{"path", path}, {"format", "u16"}};
  j["batch_size"] = 8;  // visits every window in the first step
  j["micro_batch_size"] = 8;
  auto t = make_trainer(j);
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  Status s = (*t)->run();
  ASSERT_FALSE(s.is_ok());
  EXPECT_NE(s.message().find(path), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("300"), std::string::npos) << s.message();
}

TEST(TrainTest, NcclOnTheCpuBackendIsAClearError) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["dist_backend"] = "nccl";
  auto t = make_trainer(j);
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("nccl"), std::string::npos) << t.status().message();
}

TEST(TrainTest, MissingSwapDirectoryNamesIt) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["offload_optimizer"] = "nvme";
  j["swap_paths"] = {dir.file("no-such-dir")};
  auto t = make_trainer(j);
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find(dir.file("no-such-dir")), std::string::npos)
      << t.status().message();
}

// save_dir "" runs without writing any checkpoint, and says so; save_every then has nowhere to
// write and is refused when the config is read.
TEST(TrainTest, EmptySaveDirWritesNoCheckpoint) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["save_dir"] = "";
  j["max_steps"] = 2;
  auto t = make_trainer(j);
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  ASSERT_TRUE((*t)->run().is_ok());
  EXPECT_EQ((*t)->step(), 2);
  EXPECT_EQ((*t)->last_checkpoint(), "");
  EXPECT_FALSE(fs::exists(dir.file("ckpt")));
  auto saved = (*t)->save();
  ASSERT_FALSE(saved.is_ok());
  EXPECT_NE(saved.status().message().find("save_dir"), std::string::npos);
  j["save_every"] = 1;
  auto refused = make_trainer(j);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("save_every"), std::string::npos)
      << refused.status().message();
}

TEST(TrainTest, SavedModelLoadsBackAsModelPath) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["max_steps"] = 2;
  run(j);
  const std::string model_dir = dir.file("ckpt/step-00000002/model");
  ASSERT_TRUE(fs::exists(model_dir + "/model.safetensors"));
  Json k = tiny_config(dir);
  k["model"] = model_dir;
  k["max_steps"] = 1;
  k["save_dir"] = dir.file("ckpt-finetune");
  auto t = make_trainer(k);
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  ASSERT_TRUE((*t)->run().is_ok());
}

TEST(TrainTest, CorruptCheckpointIsRejectedAndEarlierOneSurvives) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["max_steps"] = 2;
  j["save_every"] = 1;
  run(j);
  const std::string good = dir.file("ckpt/step-00000001/model/model.safetensors");
  const std::string bad = dir.file("ckpt/step-00000002/model/model.safetensors");
  auto before = read_file(good);
  ASSERT_TRUE(before.is_ok());
  {  // the header claims far more bytes than the file holds
    std::fstream f(bad, std::ios::in | std::ios::out | std::ios::binary);
    const std::uint64_t huge = 1ull << 40;
    f.write(reinterpret_cast<const char*>(&huge), 8);
  }
  auto t = make_trainer(j, dir.file("ckpt"));
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find(bad), std::string::npos) << t.status().message();
  // The earlier checkpoint is untouched and still resumable.
  EXPECT_EQ(*read_file(good), *before);
  auto t2 = make_trainer(j, dir.file("ckpt/step-00000001"));
  ASSERT_TRUE(t2.is_ok()) << t2.status().message();
  EXPECT_EQ((*t2)->step(), 1);
}

// keep_last N (Hugging Face's save_total_limit): after each save the newest N checkpoints stay;
// a directory that only looks like one (no trainer_state.json), another name, and the one
// `latest` names are never touched; a crash between hiding a pruned checkpoint and removing it
// (a real one: the child process exits there) leaves `latest` resumable, and the next prune
// clears the hidden leftover. keep_last without save_dir, or negative, is refused by name.
TEST(TrainTest, KeepLastPrunesOldCheckpointsAndSurvivesACrashWhilePruning) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["max_steps"] = 5;
  j["save_every"] = 1;
  j["keep_last"] = 2;
  fs::create_directories(dir.file("ckpt/step-00000000"));  // no trainer_state.json: not ours
  fs::create_directories(dir.file("ckpt/notes"));
  dir.write("ckpt/notes/keep.txt", "mine");
  const std::vector<double> losses = run(j);
  ASSERT_EQ(losses.size(), 5u);
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir.file("ckpt"))) {
    left.push_back(e.path().filename().string());
  }
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"latest", "notes", "step-00000000", "step-00000004",
                                            "step-00000005"}));
  EXPECT_EQ(*read_file(dir.file("ckpt/notes/keep.txt")), "mine");
  auto resumed = make_trainer(j, dir.file("ckpt"));
  ASSERT_TRUE(resumed.is_ok()) << resumed.status().message();
  EXPECT_EQ((*resumed)->step(), 5);

  // `latest` is never pruned, even when it is not among the newest by step.
  dir.write("ckpt/latest", "step-00000004\n");
  auto kept = prune_checkpoints(dir.file("ckpt"), 1);
  ASSERT_TRUE(kept.is_ok()) << kept.status().message();
  EXPECT_TRUE(kept->empty());
  EXPECT_TRUE(fs::exists(dir.file("ckpt/step-00000004")));
  dir.write("ckpt/latest", "step-00000005\n");

  // A crash after step-00000004 is hidden and before it is removed.
  EXPECT_EXIT(
      {
        auto p = prune_checkpoints(dir.file("ckpt"), 1, [](const std::string&) { std::_Exit(3); });
        (void)p;
      },
      ::testing::ExitedWithCode(3), "");
  EXPECT_FALSE(fs::exists(dir.file("ckpt/step-00000004")));
  EXPECT_TRUE(fs::exists(dir.file("ckpt/.step-00000004.pruned")));
  auto after_crash = make_trainer(j, dir.file("ckpt"));
  ASSERT_TRUE(after_crash.is_ok()) << after_crash.status().message();
  EXPECT_EQ((*after_crash)->step(), 5);
  auto again = prune_checkpoints(dir.file("ckpt"), 1);
  ASSERT_TRUE(again.is_ok()) << again.status().message();
  EXPECT_FALSE(fs::exists(dir.file("ckpt/.step-00000004.pruned")));
  EXPECT_TRUE(fs::exists(dir.file("ckpt/step-00000005")));

  for (const auto& [value, why] :
       {std::pair{Json(-1), "keep_last"}, std::pair{Json(2), "save_dir"}}) {
    Json bad = tiny_config(dir);
    bad["keep_last"] = value;
    if (value == 2) bad["save_dir"] = "";
    auto refused = parse_train_config(bad, "test config");
    ASSERT_FALSE(refused.is_ok());
    EXPECT_NE(refused.status().message().find(why), std::string::npos)
        << refused.status().message();
  }
}

// save_async: each checkpoint holds the bytes a synchronous save of the same step writes, and
// training the same bits, with the optimizer on the host and on NVMe, under each schedule. Step
// 2's save is slowed down (async_save_started sleeps 300 ms): steps 3 and 4 run beside it,
// writing every copy of the state but the one it holds, and its checkpoint still holds step 2's
// state; step 4's save waits for it (at most one in flight: save_stall_ms).
TEST(TrainTest, AsynchronousSavesWriteTheSynchronousBytes) {
  for (const char* offload : {"cpu", "nvme"}) {
    for (const char* overlap : {"none", "forward", "backward"}) {
      SCOPED_TRACE(std::string(offload) + " " + overlap);
      testing::TempDir dir;
      Json j = tiny_config(dir);
      j["offload_optimizer"] = offload;
      j["optimizer_overlap"] = overlap;
      j["max_steps"] = 6;
      j["save_every"] = 2;
      j["save_dir"] = dir.file("sync");
      auto sync = make_trainer(j);
      ASSERT_TRUE(sync.is_ok()) << sync.status().message();
      ASSERT_TRUE((*sync)->run().is_ok());
      const std::vector<double> sync_losses = losses_of(**sync);
      sync->reset();  // its swap directory is the next run's
      j["save_async"] = true;
      j["save_dir"] = dir.file("async");
      auto c = parse_train_config(j, "test config");
      ASSERT_TRUE(c.is_ok()) << c.status().message();
      TrainOptions o;
      o.async_save_started = [](std::int64_t step) {
        if (step == 2) std::this_thread::sleep_for(std::chrono::milliseconds(300));
      };
      auto async = Trainer::create(*c, o);
      ASSERT_TRUE(async.is_ok()) << async.status().message();
      ASSERT_TRUE((*async)->run().is_ok());
      EXPECT_EQ(losses_of(**async), sync_losses);
      for (int step = 2; step <= 6; step += 2) {
        const std::string name = step_name(step);
        EXPECT_GT(
            testing::expect_same_checkpoint(dir.file("async/" + name), dir.file("sync/" + name),
                                            {"save_async", "save_dir"}),
            3);
      }
      EXPECT_EQ(read_file(dir.file("async/latest")).value(), "step-00000006\n");
      double stalled = 0;
      for (const auto& m : (*async)->history()) stalled += m.save_stall_ms;
      EXPECT_GT(stalled, 100.0);
      EXPECT_EQ((*async)->last_checkpoint(), dir.file("async/step-00000006"));
    }
  }
}

TEST(TrainTest, AsynchronousSavesNeedTheOptimizerOffTheDeviceAndACheckpointDirectory) {
  testing::TempDir dir;
  Json j = tiny_config(dir);
  j["save_async"] = true;
  j["offload_optimizer"] = "none";
  auto c = parse_train_config(j, "test config");
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("'save_async'"), std::string::npos) << c.status().message();
  EXPECT_NE(c.status().message().find("offload_optimizer"), std::string::npos);
  j["offload_optimizer"] = "cpu";
  j["save_dir"] = "";
  auto d = parse_train_config(j, "test config");
  ASSERT_FALSE(d.is_ok());
  EXPECT_NE(d.status().message().find("save_dir is \"\""), std::string::npos)
      << d.status().message();
  // A host budget without room for the held copy: refused, naming the bytes and the way out.
  j["save_dir"] = dir.file("ckpt");
  j["host_memory_limit"] = "600KiB";
  j["offload_param"] = "cpu";
  auto t = make_trainer(j);
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("too small for save_async"), std::string::npos)
      << t.status().message();
}

// Found by the trainer_state fuzzer: a `latest` naming a file too long for the file system made
// the checks throw; every malformed `latest` is an error naming it.
TEST(TrainTest, AMalformedLatestIsAnErrorNamingIt) {
  testing::TempDir dir;
  for (const std::string& name :
       {std::string(5000, 'x'), std::string(".."), std::string("a/b"), std::string("\n")}) {
    dir.write("ckpt/latest", name);
    auto r = resolve_checkpoint(dir.file("ckpt"));
    ASSERT_FALSE(r.is_ok()) << name;
    EXPECT_NE(r.status().message().find(dir.file("ckpt")), std::string::npos)
        << r.status().message();
  }
}

TEST(TrainTest, IncompleteCheckpointIsRejected) {
  TempDir dir;
  Json j = tiny_config(dir);
  fs::create_directories(dir.file("empty/step-00000001"));
  dir.write("empty/latest", "step-00000001\n");
  auto t = make_trainer(j, dir.file("empty"));
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("incomplete"), std::string::npos) << t.status().message();
}

}  // namespace
}  // namespace strata::train

namespace strata::train {
namespace {

// fp16 with a dynamic loss scale that starts too high: the first steps overflow and are
// skipped, each halving the scale (hysteresis 1), and after two clean steps (the window) it
// doubles and may overflow again; each step's scale is what optim::LossScaler gives for the
// run's own skips, and every optimizer schedule gives the serial step's bits (a guessed step
// that overflows is rolled back; one that holds runs on with the unscaling multiplier).
TEST(Fp16Training, TheLossScaleFollowsTheOverflowsUnderEverySchedule) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["precision"] = "fp16";
  j["fp16"] = {{"initial_scale_power", 20}, {"hysteresis", 1}, {"loss_scale_window", 2}};
  j["max_steps"] = 10;
  j["grad_clip"] = 0.0;  // a step that does not overflow holds its guess
  j["offload_optimizer"] = "cpu";
  const Schedules r = run_schedules(j, dir);
  ASSERT_EQ(r.serial.scales.size(), 10u);
  expect_same_bits(r.forward, r.serial);
  expect_same_bits(r.backward, r.serial);
  optim::LossScalerConfig lc;
  lc.initial_scale_power = 20;
  lc.hysteresis = 1;
  lc.loss_scale_window = 2;
  const int skipped =
      testing::expect_scales_follow_overflows(lc, r.serial.scales, r.serial.skipped);
  EXPECT_GT(skipped, 0) << "no step overflowed: raise initial_scale_power";
  EXPECT_LT(skipped, 10) << "every step overflowed: lower initial_scale_power";
  EXPECT_GT(r.backward.rolled_back, 0) << "no guessed step overflowed";
  EXPECT_GT(r.backward.guessed, r.backward.rolled_back) << "no guess held";
}

// An overflow on one rank's gradients (injected: its loss gradient times infinity) skips the
// step, lowers the scale once the hysteresis is spent, and leaves the weights as they were:
// the run goes on exactly as one whose scaler met that overflow.
TEST(Fp16Training, AnInjectedOverflowSkipsTheStepAndLowersTheScale) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["precision"] = "fp16";
  j["fp16"] = {{"initial_scale_power", 8}, {"hysteresis", 2}};
  j["save_dir"] = "";
  j["max_steps"] = 5;
  auto config = parse_train_config(j, "test config");
  ASSERT_TRUE(config.is_ok()) << config.status().message();
  TrainOptions o;
  o.overflow_at = [](int, std::int64_t step) { return step == 2 || step == 4; };
  auto t = Trainer::create(*config, o);
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  ASSERT_TRUE((*t)->run().is_ok());
  const auto& h = (*t)->history();
  ASSERT_EQ(h.size(), 5u);
  const bool want_skipped[] = {false, true, false, true, false};
  // The first overflow spends the hysteresis, the second halves.
  const double want_scale[] = {256, 256, 256, 256, 128};
  for (std::size_t i = 0; i < h.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    EXPECT_EQ(h[i].skipped, want_skipped[i]);
    EXPECT_EQ(h[i].loss_scale.value_or(0), want_scale[i]);
    EXPECT_FALSE(std::isfinite(h[i].grad_norm) && want_skipped[i]);
  }
}

// Two ranks, the overflow on rank 1 only: both skip the step (the norm is summed over every
// rank), and both lower the scale alike.
TEST(Fp16Training, AnOverflowOnOneRankSkipsTheStepOnEveryRank) {
  TempDir dir;
  Json j = testing::config(dir, "fp16");
  j["precision"] = "fp16";
  j["fp16"] = {{"initial_scale_power", 8}, {"hysteresis", 1}};
  j["max_steps"] = 3;
  j["metrics_file"] = dir.file("fp16/metrics-{rank}.jsonl");
  ASSERT_EQ(testing::run_train(dir, j, "fp16", 2, "--inject-fault overflow:1:2"), 0)
      << std::ifstream(dir.file("fp16/err.txt")).rdbuf();
  for (const char* rank : {"0", "1"}) {
    SCOPED_TRACE(std::string("rank ") + rank);
    std::ifstream in(dir.file(std::string("fp16/metrics-") + rank + ".jsonl"));
    std::vector<Json> steps;
    for (std::string line; std::getline(in, line);) steps.push_back(Json::parse(line));
    ASSERT_EQ(steps.size(), 3u);
    EXPECT_FALSE(steps[0]["skipped"].get<bool>());
    EXPECT_TRUE(steps[1]["skipped"].get<bool>());
    EXPECT_FALSE(steps[2]["skipped"].get<bool>());
    EXPECT_EQ(steps[1]["loss_scale"].get<double>(), 256.0);
    EXPECT_EQ(steps[2]["loss_scale"].get<double>(), 128.0);
  }
}

// A resumed fp16 run takes up the saved scaler: its steps are the uninterrupted run's, bit for
// bit, scales and skips included.
TEST(Fp16Training, ResumeRestoresTheLossScale) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["precision"] = "fp16";
  j["fp16"] = {{"initial_scale_power", 24}, {"hysteresis", 1}, {"loss_scale_window", 2}};
  j["max_steps"] = 6;
  j["save_every"] = 3;
  const RunBits whole = run_bits(j);
  ASSERT_EQ(whole.scales.size(), 6u);
  ASSERT_NE(whole.scales[3], std::ldexp(1.0, 24)) << "the scale never moved before the save";
  Json k = j;
  k["save_dir"] = dir.file("resumed");
  auto t = make_trainer(k, dir.file("ckpt/step-00000003"));
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  ASSERT_TRUE((*t)->run().is_ok());
  const auto& h = (*t)->history();
  ASSERT_EQ(h.size(), 3u);
  for (std::size_t i = 0; i < h.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 4));
    EXPECT_EQ(std::bit_cast<std::uint64_t>(h[i].loss), whole.losses[i + 3]);
    EXPECT_EQ(h[i].loss_scale.value_or(0), whole.scales[i + 3]);
    EXPECT_EQ(h[i].skipped, whole.skipped[i + 3]);
  }
}

}  // namespace
}  // namespace strata::train

namespace strata::train {
namespace {

// `bytes` as NVMe homes hold them: whole O_DIRECT blocks.
std::uint64_t blocks(std::uint64_t bytes) {
  return (bytes + io::kIoAlignBytes - 1) / io::kIoAlignBytes * io::kIoAlignBytes;
}

// `saving` (4 steps) saved at step 2 under `ckpt` and resumed from there: its steps 3 and 4 are
// `reference`'s, bit for bit.
void expect_resume_continues(Json saving, const std::string& ckpt,
                             const std::vector<double>& reference) {
  saving["save_dir"] = ckpt;
  saving["save_every"] = 2;
  ASSERT_EQ(run(saving), reference);
  auto t = make_trainer(saving, ckpt + "/step-00000002");
  ASSERT_TRUE(t.is_ok()) << t.status().message();
  ASSERT_TRUE((*t)->run().is_ok());
  EXPECT_EQ(losses_of(**t), std::vector<double>(reference.begin() + 2, reference.end()));
}

// `j` with the optimizer on NVMe, serial: its last step read and wrote exactly the sum over the
// trainable groups of `bytes(n)` for a group of n elements. Returns the trainer's describe().
std::string expect_streamed_bytes(Json j,
                                  const std::function<std::uint64_t(std::uint64_t)>& bytes) {
  j["offload_optimizer"] = "nvme";
  j["optimizer_overlap"] = "none";
  auto t = make_trainer(j);
  EXPECT_TRUE(t.is_ok()) << t.status().message();
  if (!t.is_ok()) return "";
  EXPECT_TRUE((*t)->run().is_ok());
  auto config = parse_train_config(j, "test config");
  EXPECT_TRUE(config.is_ok());
  std::uint64_t want = 0;
  const model::ParamLayout layout = model::ParamLayout::build(config->model);
  for (const auto& g : layout.groups()) {
    want += bytes(static_cast<std::uint64_t>(g.num_elems));
  }
  EXPECT_EQ((*t)->history().back().nvme_read_bytes, want);
  EXPECT_EQ((*t)->history().back().nvme_write_bytes, want);
  return (*t)->describe();
}

// `j` is refused when read, its message holding each of `words`.
void expect_refused(const Json& j, std::initializer_list<const char*> words) {
  auto refused = parse_train_config(j, "test config");
  ASSERT_FALSE(refused.is_ok());
  for (const char* w : words) {
    EXPECT_NE(refused.status().message().find(w), std::string::npos) << refused.status().message();
  }
}

// optimizer.state_dtype "bf16": Adam's moments in bf16 in every tier (half the moment bytes in
// the plan, and across the drive), the same bits whether the optimizer lives on the device, the
// host or NVMe and under every schedule, a resume that continues the run to the bit (the
// checkpoint holds them widened to fp32, exactly), losses near fp32 moments', and a clear refusal
// of a dtype there is no path for.
TEST(CompactStates, Bf16MomentsKeepTheirBitsInEveryTierAndAcrossResume) {
  TempDir dir;
  Json base = tiny_config(dir);
  base["optimizer"]["state_dtype"] = "bf16";
  base["save_dir"] = "";
  const std::vector<double> reference = run(base);
  ASSERT_EQ(reference.size(), 4u);
  for (const char* opt : {"cpu", "nvme"}) {
    for (const char* overlap : {"none", "forward", "backward"}) {
      SCOPED_TRACE(std::string("offload_optimizer ") + opt + ", optimizer_overlap " + overlap);
      Json j = base;
      j["offload_optimizer"] = opt;
      j["optimizer_overlap"] = overlap;
      EXPECT_EQ(run(j), reference);
    }
  }
  Json fp32 = base;
  fp32["optimizer"]["state_dtype"] = "fp32";
  const std::vector<double> wide = run(fp32);
  ASSERT_EQ(wide.size(), reference.size());
  EXPECT_NE(wide, reference) << "bf16 moments changed nothing: are they bf16?";
  for (std::size_t i = 0; i < wide.size(); ++i) {
    EXPECT_NEAR(reference[i], wide[i], 1e-2 * wide[i]) << "step " << i + 1;
  }

  // The plan's moments: each group's two, n x 2 bytes (a whole number of 4 KiB blocks apart,
  // for their NVMe homes), in the optimizer's tier.
  const auto moments = [](const Json& j) {
    auto c = parse_train_config(j, "test config");
    EXPECT_TRUE(c.is_ok()) << c.status().message();
    auto e = estimate(*c, 1);
    EXPECT_TRUE(e.is_ok()) << e.status().message();
    return e->plan.kind_bytes(Tier::kHost, zero::TensorKind::kMoments);
  };
  Json host = base, host32 = fp32;
  host["offload_optimizer"] = host32["offload_optimizer"] = "cpu";
  auto config = parse_train_config(host, "test config");
  ASSERT_TRUE(config.is_ok());
  std::uint64_t want_bf16 = 0, want_fp32 = 0;
  const model::ParamLayout layout = model::ParamLayout::build(config->model);
  for (const auto& g : layout.groups()) {
    const auto n = static_cast<std::uint64_t>(g.num_elems);
    // Two moments, each twice: the state and the shadow copy an overlapped step writes.
    want_bf16 += 4 * blocks(2 * n);
    want_fp32 += 4 * blocks(4 * n);
  }
  EXPECT_EQ(moments(host), want_bf16);
  EXPECT_EQ(moments(host32), want_fp32);

  // A step streams each trainable group's master weights and moments from NVMe and back once:
  // the metrics' NVMe bytes are exactly those (4 + 2 x 2 bytes a parameter, each array a whole
  // number of 4 KiB blocks), half the moments' share of fp32's (4 + 2 x 4).
  for (const auto& [state, moment_size] : {std::pair{"bf16", 2}, std::pair{"fp32", 4}}) {
    SCOPED_TRACE(std::string("state_dtype ") + state);
    Json j = base;
    j["optimizer"]["state_dtype"] = state;
    const std::uint64_t m = moment_size;
    expect_streamed_bytes(j, [m](std::uint64_t n) { return blocks(4 * n) + 2 * blocks(m * n); });
  }

  Json saving = base;
  saving["offload_optimizer"] = "nvme";
  expect_resume_continues(saving, dir.file("bf16-ckpt"), reference);

  Json bad = base;
  bad["optimizer"]["state_dtype"] = "int4";
  expect_refused(bad, {"'optimizer.state_dtype'", "fp32"});
}

}  // namespace
}  // namespace strata::train

namespace strata::train {
namespace {

// optimizer.master_dtype "bf16" (stochastic rounding) with bf16 moments: 6 bytes of optimizer
// state a parameter, the same bits in every tier and schedule and across a resume (the rounding's
// random bits come from the seed, the step, the group and each element's place in it), losses
// near fp32 state's; the settings that do not apply are refused naming the key.
TEST(CompactStates, Bf16MasterWeightsRoundAlikeEverywhereAndMoveSixBytes) {
  TempDir dir;
  Json base = tiny_config(dir);
  base["optimizer"]["state_dtype"] = "bf16";
  base["optimizer"]["master_dtype"] = "bf16";
  base["save_dir"] = "";
  const std::vector<double> reference = run(base);
  ASSERT_EQ(reference.size(), 4u);
  for (const char* opt : {"cpu", "nvme"}) {
    for (const char* overlap : {"none", "backward"}) {
      SCOPED_TRACE(std::string("offload_optimizer ") + opt + ", optimizer_overlap " + overlap);
      Json j = base;
      j["offload_optimizer"] = opt;
      j["optimizer_overlap"] = overlap;
      EXPECT_EQ(run(j), reference);
    }
  }
  Json fp32 = base;
  fp32["optimizer"]["state_dtype"] = "fp32";
  fp32["optimizer"]["master_dtype"] = "fp32";
  const std::vector<double> wide = run(fp32);
  ASSERT_EQ(wide.size(), reference.size());
  EXPECT_NE(wide, reference);
  for (std::size_t i = 0; i < wide.size(); ++i) {
    EXPECT_NEAR(reference[i], wide[i], 1e-2 * wide[i]) << "step " << i + 1;
  }

  // A step's NVMe traffic: master (2 bytes) and two moments (2 each) a parameter.
  expect_streamed_bytes(base, [](std::uint64_t n) { return 3 * blocks(2 * n); });

  Json saving = base;
  saving["offload_optimizer"] = "cpu";
  expect_resume_continues(saving, dir.file("master-ckpt"), reference);

  Json unknown = base;
  unknown["optimizer"]["master_rounding"] = "round";
  expect_refused(unknown, {"'optimizer.master_rounding'", "kahan"});
  Json stray = fp32;
  stray["optimizer"]["master_rounding"] = "stochastic";
  expect_refused(stray, {"applies to master_dtype \"bf16\" only"});
}

}  // namespace
}  // namespace strata::train

namespace strata::train {
namespace {

// optimizer.state_dtype "int8" (block-wise 8-bit moments) and master_rounding "kahan" (bf16
// master weights with a bf16 compensation): each alone and together, the same bits in every tier
// and schedule; together, a step moves each plane of each array once each way (2 + 2 bytes of
// master weights and 1 + 4/64 of each moment a parameter), the plan says 6.12 bytes a
// parameter, a resume continues to the bit (checkpoints hold fp32 values that split and quantize
// back to the same bytes), and losses stay near fp32 state's.
// A checkpoint keeps fp32 moments whatever the run kept; a resume that keeps them otherwise says
// how it converts them: another state_dtype, or 8-bit blocks of 256 (format_version 2 and before)
// quantized anew in blocks of 64.
TEST(CompactStates, AResumeSaysHowItConvertsTheMoments) {
  TempDir dir;
  Json j = tiny_config(dir);
  j["optimizer"]["state_dtype"] = "int8";
  const std::string name = save_after_two_steps(dir, j);
  ASSERT_FALSE(name.empty());
  const auto resume_log = [&](const std::string& state_dtype) {
    Json resumed = j;
    resumed["save_dir"] = "";  // the checkpoint stays the latest
    resumed["optimizer"]["state_dtype"] = state_dtype;
    ::testing::internal::CaptureStderr();
    auto t = make_trainer(resumed, dir.file("ckpt"));
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_TRUE(t.is_ok()) << t.status().message();
    return log;
  };
  const std::string requantized =
      "the checkpoint's 8-bit Adam moments were kept in blocks of 256; they continue in blocks "
      "of " +
      std::to_string(device::kAdam8BlockElems);
  EXPECT_EQ(resume_log("int8").find(requantized), std::string::npos);
  mark_format_version(dir, name, 2);
  EXPECT_NE(resume_log("int8").find(requantized), std::string::npos);
  const std::string widened = resume_log("fp32");
  EXPECT_NE(widened.find("the checkpoint's Adam moments were kept in int8; they continue in fp32 "
                         "(widened exactly)"),
            std::string::npos)
      << widened;
  EXPECT_EQ(widened.find(requantized), std::string::npos);
}

TEST(CompactStates, Int8MomentsAndKahanMastersKeepTheirBitsEverywhere) {
  TempDir dir;
  Json base = tiny_config(dir);
  base["save_dir"] = "";
  Json fp32 = base;
  const std::vector<double> wide = run(fp32);
  const std::pair<const char*, const char*> settings[] = {
      {"int8", "fp32"}, {"fp32", "kahan"}, {"int8", "kahan"}};
  std::vector<double> reference;
  for (const auto& [state, master] : settings) {
    SCOPED_TRACE(std::string("moments ") + state + ", master " + master);
    Json j = base;
    j["optimizer"]["state_dtype"] = state;
    if (std::string(master) == "kahan") {
      j["optimizer"]["master_dtype"] = "bf16";
      j["optimizer"]["master_rounding"] = "kahan";
    }
    reference = run(j);
    ASSERT_EQ(reference.size(), wide.size());
    EXPECT_NE(reference, wide) << "the compact state changed nothing";
    for (std::size_t i = 0; i < wide.size(); ++i) {
      EXPECT_NEAR(reference[i], wide[i], 1e-2 * wide[i]) << "step " << i + 1;
    }
    for (const auto& [opt, overlap] :
         {std::pair{"cpu", "backward"}, std::pair{"nvme", "none"}, std::pair{"nvme", "backward"}}) {
      SCOPED_TRACE(std::string("offload_optimizer ") + opt + ", optimizer_overlap " + overlap);
      Json o = j;
      o["offload_optimizer"] = opt;
      o["optimizer_overlap"] = overlap;
      EXPECT_EQ(run(o), reference);
    }
    base = j;  // the last setting, int8 + kahan, for what follows
  }

  // Each plane of each array once each way: the master weights and their compensation (2 + 2
  // bytes), each moment's codes and its block scales (1 + 4/64).
  const std::string plan = expect_streamed_bytes(base, [](std::uint64_t n) {
    const auto block = static_cast<std::uint64_t>(device::kAdam8BlockElems);
    return 2 * blocks(2 * n) + 2 * (blocks(n) + blocks((n + block - 1) / block * 4));
  });
  EXPECT_NE(plan.find("optimizer state: 6.12 bytes a trained parameter: master weights bf16 + "
                      "Kahan compensation bf16 4 + moments int8 + block scales 2 x 1.06"),
            std::string::npos)
      << plan;

  Json saving = base;
  saving["offload_optimizer"] = "nvme";
  expect_resume_continues(saving, dir.file("int8-ckpt"), reference);

  Json bad = base;
  bad["optimizer"]["state_dtype"] = "int4";
  expect_refused(bad, {"int8"});
}

}  // namespace
}  // namespace strata::train
