// End-to-end training runs on a tiny model: offload placement and the optimizer's schedule never
// change the numbers, activations kept or offloaded keep them, budgets hold, and bad input fails
// cleanly.

#include "tests/integration/train_runs.h"

namespace strata::train {
namespace {

// The smallest host_memory_limit the memory plan accepts for config `j` (one rank): there the
// plan must move the gradients to NVMe, since they no longer fit beside the rest.
std::uint64_t smallest_host_limit(const Json& j) {
  auto c = parse_train_config(j, "test config");
  EXPECT_TRUE(c.is_ok()) << c.status().message();
  const model::ParamLayout full = model::ParamLayout::build(c->model);
  const zero::Partition partition(full, {0, 1}, c->param_persistence_threshold);
  // The trainer's own plan options (the CPU backend: host-addressable, no device budget).
  zero::PlanOptions po = zero::plan_options(shard_options(*c, 1), 0, /*has_swap=*/true,
                                            /*host_addressable_device=*/true);
  po.zero = zero_options(*c, 1);
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

// optimizer_overlap "forward" runs each update beside the next forward, and "backward" starts
// it beside backward, guessing that the step does not clip; both must give the very bits of
// the serial schedule: every placement with the optimizer off the device, gradient clipping that
// triggers (the guess is redone), that is on but does not trigger (the guess holds, gradients
// kept for a redo that never comes) and that is off, one micro-batch per step and two, and a
// run whose steps are skipped for non-finite gradients (the guess is rolled back).
// offload_optimizer_fraction below 1 keeps the groups whose gradients are final last (the
// embedding, the first layers) on the device, stepped there by the device's AdamW after the
// global norm while the host steps the rest, in every schedule: the very bits of the whole
// optimizer offloaded (losses, norms, final weights and moments), with clipping that triggers (a
// guess redone) and none (a guess that holds), one micro-batch a step and two, the sums of
// the host's groups in host memory or on the device, 16-bit gradients too. Half and none of it
// offloaded; the device's step is timed in the metrics.
TEST(OptimizerOverlap, APartOfTheStateOnTheDeviceChangesNoBit) {
  struct Case {
    const char* param;
    const char* opt;
    const char* accumulate = "host";
    const char* precision = "fp32";
    // A tied embedding, the largest group, kept on the device: the NVMe step's staging is sized
    // by the largest group it streams, not by every group.
    bool tied_large_vocab = false;
  };
  const Case cases[] = {{"none", "cpu"},
                        {"cpu", "cpu"},
                        {"nvme", "nvme"},
                        {"none", "cpu", "device"},
                        {"none", "cpu", "host", "bf16"},
                        {"cpu", "nvme", "device", "bf16"},
                        {"none", "nvme", "host", "fp32", true}};
  for (const Case& c : cases) {
    for (const double clip : {0.5, 0.0}) {
      for (const int micro : {2, 4}) {
        if (std::string(c.accumulate) == "device" && micro == 4) continue;  // nothing to sum
        TempDir dir;
        Json j = tiny_config(dir);
        j["offload_param"] = c.param;
        j["offload_optimizer"] = c.opt;
        j["grad_accumulation"] = c.accumulate;
        j["precision"] = c.precision;
        j["grad_clip"] = clip;
        j["micro_batch_size"] = micro;
        j["optimizer_overlap"] = "none";
        j["save_dir"] = dir.file("whole");
        if (c.tied_large_vocab) {
          j["model"]["tie_word_embeddings"] = true;
          j["model"]["vocab_size"] = 1024;
        }
        const RunBits whole = run_bits(j);
        ASSERT_EQ(whole.losses.size(), 4u);
        EXPECT_EQ(whole.device_step_ms, 0.0);
        for (const double fraction : {0.5, 0.0}) {
          SCOPED_TRACE(std::string("offload_param ") + c.param + ", offload_optimizer " + c.opt +
                       ", grad_accumulation " + c.accumulate + ", " + c.precision + ", grad_clip " +
                       std::to_string(clip) + ", micro_batch_size " + std::to_string(micro) +
                       ", offload_optimizer_fraction " + std::to_string(fraction));
          j["offload_optimizer_fraction"] = fraction;
          TempDir runs;
          const Schedules r = run_schedules(j, runs);
          expect_same_bits(r.serial, whole);
          expect_same_bits(r.forward, whole);
          expect_same_bits(r.backward, whole);
          EXPECT_GT(r.serial.device_step_ms, 0.0);
          EXPECT_GT(r.backward.device_step_ms, 0.0);
          if (clip == 0.0) {
            EXPECT_EQ(r.backward.guessed, 4);
          }
        }
      }
    }
  }
}

// The checkpoint holds the optimizer state whatever its tier: a run saved with part of it on the
// device resumes with all of it offloaded, and the other way round, to the losses of the run
// that was never interrupted, bit for bit.
TEST(OptimizerOverlap, ACheckpointResumesUnderAnotherFraction) {
  for (const auto& [saved, resumed] : {std::pair{0.5, 1.0}, std::pair{1.0, 0.0}}) {
    SCOPED_TRACE("saved at offload_optimizer_fraction " + std::to_string(saved) + ", resumed at " +
                 std::to_string(resumed));
    TempDir dir;
    Json j = tiny_config(dir);
    j["offload_optimizer"] = "cpu";
    j["offload_optimizer_fraction"] = resumed;
    j["save_dir"] = "";
    const std::vector<double> whole = run(j);
    ASSERT_EQ(whole.size(), 4u);
    Json first = j;
    first["save_dir"] = dir.file("ckpt");
    first["offload_optimizer_fraction"] = saved;
    ASSERT_FALSE(save_after_two_steps(dir, first).empty());
    auto t = make_trainer(j, dir.file("ckpt"));
    ASSERT_TRUE(t.is_ok()) << t.status().message();
    const Status s = (*t)->run();
    ASSERT_TRUE(s.is_ok()) << s.message();
    EXPECT_EQ(losses_of(**t), std::vector<double>(whole.begin() + 2, whole.end()));
  }
}

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

}  // namespace
}  // namespace strata::train
