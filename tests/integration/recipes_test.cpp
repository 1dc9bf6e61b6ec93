// The recipes of examples/recipes/, so that none rots: each is listed here with the ranks it is
// for and says how to check it; each fits the budgets it names at its real size (its model's
// config.json from examples/models/, as strata estimate reads it); and each trains two steps
// with its model shrunk to a tiny inline shape of the same family, on the CPU backend, with the
// rest of the recipe as it is (the tiers, the grid, the finetune method, the DeepSpeed file).
#include <gtest/gtest.h>

#include <filesystem>
#include <set>

#include "strata/build_config.h"
#include "tests/integration/train_runs.h"
#include "tests/testing/cli.h"

namespace strata::train {
namespace {

struct Recipe {
  const char* file;
  int ranks;                   // what it is for (strata estimate --ranks)
  int tiny_ranks;              // the ranks its tiny run has (the grid's, or 2 for data parallelism)
  double active_billions = 0;  // mixture of experts: the parameters active per token
};

constexpr Recipe kRecipes[] = {
    {"llama3.1-8b-lora-24g.json", 1, 1},          {"llama3.1-8b-qlora-12g.json", 1, 1},
    {"llama3.1-70b-qlora-24g.json", 1, 1},        {"llama3.1-8b-full-nvme.json", 1, 1},
    {"llama3.1-8b-sft-chat.json", 1, 1},          {"llama3.1-8b-deepspeed.json", 1, 1},
    {"llama3.1-8b-zero3-multinode.json", 16, 2},  {"llama3.1-8b-tp2-pp2-dp2.json", 8, 8},
    {"qwen3-30b-a3b-qlora-24g.json", 1, 1, 3.35}, {"qwen3-30b-a3b-full-nvme.json", 1, 1, 3.35},
    {"mixtral-8x7b-qlora-24g.json", 1, 1, 12.9},
};

const std::string kRecipeDir = std::string(STRATA_SOURCE_DIR) + "/examples/recipes/";

// The recipe as JSON, its comments read past.
Json recipe_json(const Recipe& r) {
  auto j = read_json_file(kRecipeDir + r.file);
  EXPECT_TRUE(j.is_ok()) << j.status().to_string();
  return j.is_ok() ? *j : Json::object();
}

// examples/models/NAME for a recipe's "~/models/NAME".
std::string model_dir(const Json& recipe) {
  return std::string(STRATA_SOURCE_DIR) + "/examples/models/" +
         fs::path(recipe["model"].get<std::string>()).filename().string();
}

// Paths inside the repository (the DeepSpeed file) are relative to its root, where a user runs
// the recipe from.
struct InSourceDir {
  fs::path was = fs::current_path();
  InSourceDir() { fs::current_path(STRATA_SOURCE_DIR); }
  ~InSourceDir() { fs::current_path(was); }
};

TEST(Recipes, EveryRecipeIsListedAndSaysHowToCheckAndRunIt) {
  std::set<std::string> listed;
  for (const Recipe& r : kRecipes) listed.insert(r.file);
  int found = 0;
  for (const auto& e : fs::directory_iterator(kRecipeDir)) {
    if (e.path().extension() != ".json") continue;
    ++found;
    const std::string name = e.path().filename().string();
    EXPECT_TRUE(listed.count(name)) << name << " is not in kRecipes: add it, with its ranks";
  }
  EXPECT_EQ(found, static_cast<int>(std::size(kRecipes)));
  for (const Recipe& r : kRecipes) {
    SCOPED_TRACE(r.file);
    const std::string text = testing::slurp(kRecipeDir + r.file);
    EXPECT_EQ(text.rfind("// ", 0), 0u) << "a recipe starts with its comment block";
    for (const std::string part : {"// Needs:", "// Check:", "// Expect:"}) {
      EXPECT_NE(text.find(part), std::string::npos) << part;
    }
    const std::string check = "strata estimate examples/recipes/" + std::string(r.file) +
                              (r.ranks > 1 ? " --ranks " + std::to_string(r.ranks) : "");
    EXPECT_NE(text.find(check), std::string::npos) << check;
    EXPECT_TRUE(fs::exists(model_dir(recipe_json(r)) + "/config.json"));
  }
}

TEST(Recipes, EachFitsItsBudgetsAtItsRealSize) {
  const InSourceDir here;
  for (const Recipe& r : kRecipes) {
    SCOPED_TRACE(r.file);
    Json j = recipe_json(r);
    j["model"] = model_dir(j);
    auto c = parse_train_config(j, r.file);
    ASSERT_TRUE(c.is_ok()) << c.status().message();
    // Every rank's plan (pipeline stages and tensor slices differ), the swap paths' free space
    // not this machine's business.
    for (int rank = 0; rank < r.ranks; ++rank) {
      auto e = estimate(*c, r.ranks, EstimateOptions{rank, false});
      ASSERT_TRUE(e.is_ok()) << "rank " << rank << ": " << e.status().message();
      EXPECT_LE(e->device_bytes_needed(), c->device_memory_limit) << "rank " << rank;
      EXPECT_LE(e->plan.peak(Tier::kHost), c->host_memory_limit) << "rank " << rank;
      if (r.active_billions > 0 && rank == 0) {
        EXPECT_NEAR(static_cast<double>(e->active_parameters()) / 1e9, r.active_billions, 0.1);
      }
    }
  }
}

// The recipe's model shrunk, its family and its options kept: 4 layers (2 pipeline stages of 2
// chunks), 4 experts of which 2 are chosen.
Json tiny_model(Json m) {
  m.update(Json{{"vocab_size", 256},
                {"hidden_size", 32},
                {"intermediate_size", 48},
                {"num_hidden_layers", 4},
                {"num_attention_heads", 4},
                {"num_key_value_heads", 2},
                {"max_position_embeddings", 64}});
  m.erase("bos_token_id");
  m.erase("eos_token_id");
  if (m.contains("head_dim")) m["head_dim"] = 8;
  if (m.contains("max_window_layers")) m["max_window_layers"] = 4;
  if (m.contains("num_experts")) {
    m.update(Json{{"num_experts", 4}, {"num_experts_per_tok", 2}, {"moe_intermediate_size", 16}});
  }
  if (m.contains("num_local_experts")) {
    m.update(Json{{"num_local_experts", 4}, {"num_experts_per_tok", 2}});
  }
  return m;
}

TEST(Recipes, EachTrainsTwoStepsShrunkToATinyModel) {
  const InSourceDir here;
  for (const Recipe& r : kRecipes) {
    SCOPED_TRACE(r.file);
    if (r.tiny_ranks > 1 && !STRATA_HAVE_MPI) continue;
    TempDir dir;
    Json j = recipe_json(r);
    auto hf = read_json_file(model_dir(j) + "/config.json");
    ASSERT_TRUE(hf.is_ok()) << hf.status().to_string();
    j["model"] = tiny_model(*hf);
    const std::string text = make_text(20000);
    j["data"] = {{"path", dir.write("train.txt", text)}, {"format", "text"}};
    if (j.contains("eval_data")) {
      j["eval_data"] = {{"path", dir.write("eval.txt", text.substr(0, 4000))}, {"format", "text"}};
      j["eval_every"] = 1;
      j["eval_batches"] = 2;
    }
    j["seq_len"] = 16;
    j["max_steps"] = 2;
    j["threads"] = 1;
    j["device"] = "cpu";
    j.erase("device_memory_limit");
    j.erase("host_memory_limit");
    j.erase("dist_backend");  // MPI between the CPU ranks
    j["save_dir"] = dir.file("ckpt");
    j["metrics_file"] = dir.file("metrics.jsonl");
    if (j.contains("swap_paths")) {
      fs::create_directories(dir.file("nvme"));
      j["swap_paths"] = {dir.file("nvme") + "/strata-{rank}"};  // made by each rank
    }
    if (j.contains("finetune") && j["finetune"].contains("quantized_cache")) {
      j["finetune"]["quantized_cache"] = dir.file("nf4");
    }
    if (j.contains("deepspeed")) {  // its nvme paths, if any, are the machine's
      auto ds = read_json_file(j["deepspeed"].get<std::string>());
      ASSERT_TRUE(ds.is_ok()) << ds.status().to_string();
      j["deepspeed"] = *ds;
    }
    const std::string config = dir.write("recipe.json", j.dump(2));
    const std::string cmd =
        (r.tiny_ranks > 1 ? testing::mpirun(dir, r.tiny_ranks) : std::string()) + STRATA_CLI +
        " train " + config;
    const testing::RunResult run = testing::run_command(dir, cmd);
    ASSERT_EQ(run.exit_code, 0) << cmd << "\n" << run.out << run.err;
    EXPECT_NE(run.out.find("step 2/2"), std::string::npos) << run.out;
    EXPECT_NE(run.out.find("done: 2 steps"), std::string::npos) << run.out;
    if (r.tiny_ranks > 1) {  // the grid the recipe asks for
      EXPECT_NE(run.out.find("resolved: data " +
                             std::to_string(r.tiny_ranks / (j.value("tensor_parallel_size", 1) *
                                                            j.value("pipeline_parallel_size", 1)))),
                std::string::npos)
          << run.out;
    }
  }
}

}  // namespace
}  // namespace strata::train
