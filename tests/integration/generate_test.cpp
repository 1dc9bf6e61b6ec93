// strata generate: greedy decoding with the KV cache reproduces float64 PyTorch's greedy decode
// (full recomputation) token for token for every family, resident or streamed through a device
// budget smaller than the model; sampling is reproducible for a seed; the CLI runs on a training
// checkpoint, whose model directory carries the tokenizer it was trained with.
#include "strata/train/generate.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "strata/build_config.h"
#include "strata/core/json.h"
#include "strata/model/hf_checkpoint.h"
#include "tests/testing/cli.h"
#include "tests/testing/multirank_runs.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/test_name.h"

namespace strata::train {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

// The golden case's trained weights as a checkpoint directory; returns its parameter bytes.
std::uint64_t write_trained(const Json& g, const std::string& dir) {
  auto config = model::LlamaConfig::from_json(g.at("config"), "golden");
  STRATA_CHECK(config.is_ok(), config.status().to_string());
  const model::ParamLayout layout = model::ParamLayout::build(*config);
  Status s = model::write_hf_checkpoint(
      dir, *config, layout, DType::kF32, [&](const model::ParamGroup& group, float* dst) {
        std::fill(dst, dst + group.num_elems, 0.0f);
        for (const auto& t : group.tensors) {
          const Json& w = g.at("trained_weights").at(t.name);
          for (std::int64_t i = 0; i < t.num_elems; ++i) {
            dst[t.offset_elems + i] = w[static_cast<std::size_t>(i)].get<float>();
          }
        }
        return Status::ok();
      });
  STRATA_CHECK(s.is_ok(), s.to_string());
  return static_cast<std::uint64_t>(layout.total_elems()) * 4;
}

class GenerateGoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GenerateGoldenTest, GreedyDecodeMatchesPyTorchResidentAndStreamed) {
  auto read =
      read_json_file(std::string(STRATA_TEST_DATA_DIR) + "/families/" + GetParam() + ".json");
  ASSERT_TRUE(read.is_ok());
  const Json& g = read.value();
  TempDir dir;
  const std::uint64_t param_bytes = write_trained(g, dir.file("model"));
  const auto prompt = g.at("greedy").at("prompt").get<std::vector<std::int32_t>>();
  const auto want = g.at("greedy").at("generated").get<std::vector<std::int32_t>>();
  // Resident, then with a budget of the parameters' size: with the KV cache and activations
  // beside them they do not all fit, so layers are fetched and evicted as each token runs.
  for (std::uint64_t budget : {std::uint64_t{0}, param_bytes}) {
    SCOPED_TRACE("device budget " + std::to_string(budget));
    GenerateOptions options;
    options.model_dir = dir.file("model");
    options.max_new_tokens = static_cast<std::int64_t>(want.size());
    options.device_memory_limit = budget;
    options.threads = 1;
    auto gen = Generator::open(options);
    ASSERT_TRUE(gen.is_ok()) << gen.status().to_string();
    std::vector<std::int32_t> got;
    Status s = gen.value()->generate(prompt, {}, [&](std::int32_t id) {
      got.push_back(id);
      return true;
    });
    ASSERT_TRUE(s.is_ok()) << s.to_string();
    EXPECT_EQ(got, want);
    EXPECT_EQ(gen.value()->stats().streamed, budget > 0);
    EXPECT_EQ(gen.value()->stats().generated_tokens, static_cast<std::int64_t>(want.size()));
  }
}

INSTANTIATE_TEST_SUITE_P(Families, GenerateGoldenTest,
                         ::testing::Values("llama3", "llama-linear", "qwen2", "qwen2-window",
                                           "qwen3", "mistral", "qwen3-moe", "mixtral"),
                         [](const auto& info) { return strata::testing::test_name(info.param); });

TEST(GenerateTest, SamplingIsReproducibleAndItsFiltersNarrowTheChoice) {
  const std::vector<float> logits = {0.1f, 2.0f, 1.9f, -3.0f, 0.5f};
  EXPECT_EQ(pick_token(logits, 0.0, 0, 1.0, 0.99), 1) << "temperature 0: the largest";
  EXPECT_EQ(pick_token(logits, 1.0, 1, 1.0, 0.99), 1) << "top_k 1 leaves only the largest";
  EXPECT_EQ(pick_token(logits, 1.0, 0, 0.3, 0.99), 1) << "top_p below the largest's share";
  // Two candidates under top_k 2: the draw lands on the first for small u, the second for large.
  EXPECT_EQ(pick_token(logits, 1.0, 2, 1.0, 0.01), 1);
  EXPECT_EQ(pick_token(logits, 1.0, 2, 1.0, 0.99), 2);
  // Every token is reachable without filters, in proportion to exp(logit).
  std::vector<int> seen(logits.size());
  for (int i = 0; i < 1000; ++i)
    ++seen[static_cast<std::size_t>(pick_token(logits, 1.0, 0, 1.0, (i + 0.5) / 1000))];
  EXPECT_GT(seen[3], 0);
  EXPECT_GT(seen[1], seen[0]);

  auto read = read_json_file(std::string(STRATA_TEST_DATA_DIR) + "/families/qwen3.json");
  ASSERT_TRUE(read.is_ok());
  TempDir dir;
  write_trained(read.value(), dir.file("model"));
  auto sample = [&](std::uint64_t seed) {
    GenerateOptions options;
    options.model_dir = dir.file("model");
    options.max_new_tokens = 16;
    options.temperature = 1.0;
    options.seed = seed;
    options.threads = 1;
    auto gen = Generator::open(options);
    EXPECT_TRUE(gen.is_ok());
    std::vector<std::int32_t> got;
    const std::vector<std::int32_t> prompt = {1, 2, 3};
    EXPECT_TRUE(gen.value()
                    ->generate(prompt, {},
                               [&](std::int32_t id) {
                                 got.push_back(id);
                                 return true;
                               })
                    .is_ok());
    return got;
  };
  EXPECT_EQ(sample(7), sample(7));
  EXPECT_NE(sample(7), sample(8));
}

// From a model directory with a tokenizer to a checkpoint that strata generate reads alone.
TEST(GenerateCliTest, ACheckpointCarriesItsTokenizerAndGenerates) {
  TempDir dir;
  const std::string ex = std::string(STRATA_SOURCE_DIR) + "/examples";
  // A base model directory: random weights (one step of the example) plus the example tokenizer.
  auto r = testing::run_cli(
      dir,
      "train " + ex + "/sft.json --set max_steps=1 --set save_dir=\"" + dir.file("base") +
          "\" --set eval_data=null --set eval_every=0 --set metrics_file=\"\" --set data.path=\"" +
          ex + "/../tests/data/tokenizers/texts.json\" --set data.format=text 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string base = dir.file("base/step-00000001/model");
  fs::copy_file(ex + "/sft/tokenizer.json", base + "/tokenizer.json");
  // Fine-tune from it; the checkpoint gets the tokenizer.
  r = testing::run_cli(
      dir,
      "train " + ex + "/sft.json --set max_steps=1 --set model=\"" + base + "\" --set save_dir=\"" +
          dir.file("tuned") +
          "\" --set eval_data=null --set eval_every=0 --set metrics_file=\"\" --set data.path=\"" +
          ex + "/../tests/data/tokenizers/texts.json\" --set data.format=text");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const std::string tuned = dir.file("tuned/step-00000001/model");
  EXPECT_TRUE(fs::exists(tuned + "/tokenizer.json"));
  r = testing::run_cli(dir, "generate --model " + tuned +
                                " --prompt \"Question: what is 1 plus 2?\" --max-new-tokens 4");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("Question: what is 1 plus 2?", 0), 0u) << r.out;
  EXPECT_NE(r.err.find("tokens/s"), std::string::npos) << r.err;
  // Ids in, ids out without a tokenizer; a bad id list is a usage error naming it.
  r = testing::run_cli(dir,
                       "generate --model " + tuned +
                           " --prompt-ids 5,6,7 --max-new-tokens 3 --temperature 0.9 --seed 1");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = testing::run_cli(dir, "generate --model " + tuned + " --prompt-ids 5,x");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("--prompt-ids: 'x' is not a token id"), std::string::npos) << r.err;
}

// A model trained on raw bytes (data.format "text", as the quick start) has no tokenizer: its
// 256-token vocabulary reads the prompt as bytes and writes bytes back.
TEST(GenerateCliTest, AByteLevelModelNeedsNoTokenizer) {
  TempDir dir;
  const std::string ex = std::string(STRATA_SOURCE_DIR) + "/examples";
  auto r = testing::run_cli(
      dir, "train " + ex + "/quickstart.json --set max_steps=1 --set save_dir=\"" + dir.file("q") +
               "\" --set metrics_file=\"\" --set data.path=\"" + ex + "/data/gpl-3.0.txt\"");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = testing::run_cli(dir, "generate --model " + dir.file("q/step-00000001/model") +
                                " --prompt \"This License\" --max-new-tokens 5");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.rfind("This License", 0), 0u) << r.out;
  EXPECT_EQ(r.out.size(), std::string("This License").size() + 5 + 1) << "5 bytes and a newline";
  EXPECT_NE(r.err.find("read as raw bytes"), std::string::npos) << r.err;
}

// Under mpirun the model splits over the ranks (tensor parallelism): two ranks decode PyTorch's
// greedy tokens and rank 0 alone prints them, for a dense model and for both mixtures of experts
// (their MoE layers whole on each rank); three ranks, which the golden's heads do not divide
// among, are refused with the reason.
TEST(GenerateCliTest, UnderMpirunTheModelSplitsOverTheRanks) {
  if (!STRATA_HAVE_MPI) GTEST_SKIP() << "built without MPI";
  for (const std::string family : {"llama3", "mixtral", "qwen3-moe"}) {
    SCOPED_TRACE(family);
    auto read = read_json_file(std::string(STRATA_TEST_DATA_DIR) + "/families/" + family + ".json");
    ASSERT_TRUE(read.is_ok());
    const Json& g = read.value();
    TempDir dir;
    write_trained(g, dir.file("model"));
    const auto prompt = g.at("greedy").at("prompt").get<std::vector<std::int32_t>>();
    const auto want = g.at("greedy").at("generated").get<std::vector<std::int32_t>>();
    std::string ids, want_out;
    for (std::size_t i = 0; i < prompt.size(); ++i) {
      ids += (i ? "," : "") + std::to_string(prompt[i]);
    }
    for (std::size_t i = 0; i < want.size(); ++i) {
      want_out += (i ? "," : "") + std::to_string(want[i]);
    }
    const std::string args = std::string(STRATA_CLI) + " generate --model " + dir.file("model") +
                             " --prompt-ids " + ids + " --max-new-tokens " +
                             std::to_string(want.size()) + " --threads 1";
    auto r = testing::run_command(dir, testing::mpirun(dir, 2) + args);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out, want_out + "\n") << "rank 0 alone prints, PyTorch's tokens";
    EXPECT_NE(r.err.find("split over 2 tensor-parallel ranks"), std::string::npos) << r.err;
    if (family != "llama3") continue;
    r = testing::run_command(dir, testing::mpirun(dir, 3) + args);
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.err.find("does not split over the launch's 3 ranks"), std::string::npos) << r.err;
  }
}

}  // namespace
}  // namespace strata::train
