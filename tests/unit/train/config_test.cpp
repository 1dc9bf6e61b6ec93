// Config parsing: every problem reported at once, with the key and the expected value.
#include "strata/train/config.h"

#include <gtest/gtest.h>

#include "tests/testing/scoped_env.h"
#include "tests/testing/temp_dir.h"

namespace strata::train {
namespace {

Json minimal() {
  return Json::parse(R"({"model": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
                         "num_hidden_layers": 2, "num_attention_heads": 4},
                         "data": {"path": "x.txt", "format": "text"}})");
}

TEST(ConfigTest, DefaultsFillIn) {
  auto c = parse_train_config(minimal(), "test.json");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->micro_batch_size, c->batch_size);
  EXPECT_EQ(c->accumulation_steps(), 1);
  EXPECT_EQ(c->precision, DType::kF32);
  EXPECT_EQ(c->offload_optimizer, Tier::kDevice);
}

// The model is resolved once, when the config is read: an inline config or a checkpoint
// directory's config.json become the typed config, and a model that cannot be read, or a seq_len
// it cannot hold, are reported with the config's other problems.
TEST(ConfigTest, TheModelIsResolvedOnceAndItsProblemsReportedWithTheRest) {
  auto c = parse_train_config(minimal(), "test.json");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->model.hidden_size, 32);
  EXPECT_TRUE(c->model_path.empty());
  EXPECT_EQ(c->to_json()["model"]["hidden_size"], 32);

  testing::TempDir dir;
  Json hf = minimal()["model"];
  hf["max_position_embeddings"] = 64;
  dir.write("ckpt/config.json", hf.dump());
  Json k = minimal();
  k["model"] = dir.file("ckpt");
  k["seq_len"] = 64;
  auto from_dir = parse_train_config(k, "test.json");
  ASSERT_TRUE(from_dir.is_ok()) << from_dir.status().message();
  EXPECT_EQ(from_dir->model.intermediate_size, 64);
  EXPECT_EQ(from_dir->model_path, dir.file("ckpt"));
  EXPECT_EQ(from_dir->to_json()["model"], dir.file("ckpt"));  // saved as the user gave it

  k["seq_len"] = 65;
  k["batch_size"] = 0;
  auto too_long = parse_train_config(k, "test.json");
  ASSERT_FALSE(too_long.is_ok());
  const std::string& m = too_long.status().message();
  EXPECT_NE(m.find("'seq_len': 65 exceeds the model's max_position_embeddings 64"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("'batch_size'"), std::string::npos) << m;

  k = minimal();
  k["model"] = dir.file("missing");
  k["seed"] = "x";
  auto missing = parse_train_config(k, "test.json");
  ASSERT_FALSE(missing.is_ok());
  const std::string& mm = missing.status().message();
  EXPECT_NE(mm.find("'model': checkpoint directory " + dir.file("missing") + " does not exist"),
            std::string::npos)
      << mm;
  EXPECT_NE(mm.find("'seed'"), std::string::npos) << mm;

  k["model"] = {{"hidden_size", 32}};
  auto incomplete = parse_train_config(k, "test.json");
  ASSERT_FALSE(incomplete.is_ok());
  EXPECT_NE(
      incomplete.status().message().find("'model': invalid model config in config key 'model'"),
      std::string::npos)
      << incomplete.status().message();
}

TEST(ConfigTest, UnknownKeyNamesItAndTheValidOnes) {
  Json j = minimal();
  j["learning_rate"] = 0.1;
  j["optimizer"] = {{"lr", 0.1}, {"momentum", 0.9}};
  auto c = parse_train_config(j, "test.json");
  ASSERT_FALSE(c.is_ok());
  const std::string& m = c.status().message();
  EXPECT_NE(m.find("test.json"), std::string::npos) << m;
  EXPECT_NE(m.find("'learning_rate': unknown key"), std::string::npos) << m;
  // The top level's sixty keys are not repeated: the error says where they are listed.
  EXPECT_NE(m.find("'learning_rate': unknown key (strata train --list-keys lists every key)"),
            std::string::npos)
      << m;
  EXPECT_EQ(m.find("max_steps"), std::string::npos) << m;
  // A small object's keys are.
  EXPECT_NE(m.find("'optimizer.momentum': unknown key; valid keys here are: adamw_mode, betas"),
            std::string::npos)
      << m;
}

// A mistyped key is answered with the valid key nearest to it (a few edits away), named by its
// full path; a key near none lists the valid ones.
TEST(ConfigTest, AMistypedKeyGetsTheNearestValidOne) {
  Json j = minimal();
  j["optmizer"] = {{"lr", 0.1}};
  j["seq_lne"] = 8;
  j["lr_schedule"] = {{"tpye", "cosine"}};
  auto c = parse_train_config(j, "test.json");
  ASSERT_FALSE(c.is_ok());
  const std::string& m = c.status().message();
  EXPECT_NE(m.find("'optmizer': unknown key; did you mean 'optimizer'?"), std::string::npos) << m;
  EXPECT_NE(m.find("'seq_lne': unknown key; did you mean 'seq_len'?"), std::string::npos) << m;
  EXPECT_NE(m.find("'lr_schedule.tpye': unknown key; did you mean 'lr_schedule.type'?"),
            std::string::npos)
      << m;
  EXPECT_EQ(m.find("valid keys here are"), std::string::npos) << "no list beside a suggestion";
}

// finetune takes PEFT's adapter_config.json names too (lora_alpha, lora_dropout), one of each
// pair.
TEST(ConfigTest, FinetuneTakesPeftsNames) {
  Json j = minimal();
  j["finetune"] = {{"method", "lora"}, {"r", 8}, {"lora_alpha", 16}, {"lora_dropout", 0.05}};
  auto c = parse_train_config(j, "test.json");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->finetune.lora.alpha, 16);
  EXPECT_EQ(c->finetune.lora.dropout, 0.05);
  j["finetune"]["alpha"] = 32;
  c = parse_train_config(j, "test.json");
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("'finetune.lora_alpha': is PEFT's name for 'alpha', which "
                                      "is set too; keep one"),
            std::string::npos)
      << c.status().message();
}

// An adapter trained on other target modules is refused naming them as the model's family does
// (Mixtral's experts: w1, w3, w2), and the config written back names them so too.
TEST(ConfigTest, AdapterMismatchesNameTheFamilysModules) {
  FinetuneConfig f;
  f.method = FinetuneMethod::kLora;
  f.adapter = "/adapters/mixtral";
  f.lora.targets = {};
  f.lora.targets[static_cast<int>(model::LoraTarget::kGate)] = true;
  f.lora.targets[static_cast<int>(model::LoraTarget::kDown)] = true;
  model::LoraConfig trained = f.lora;
  trained.targets[static_cast<int>(model::LoraTarget::kDown)] = false;
  trained.targets[static_cast<int>(model::LoraTarget::kUp)] = true;
  const Status mixtral = f.check_adapter(trained, model::ModelFamily::kMixtral);
  EXPECT_NE(mixtral.message().find(
                "finetune.target_modules is [\"w1\",\"w2\"], the adapter's is [\"w1\",\"w3\"]"),
            std::string::npos)
      << mixtral.message();
  const Status llama = f.check_adapter(trained, model::ModelFamily::kLlama);
  EXPECT_NE(llama.message().find("finetune.target_modules is [\"gate_proj\",\"down_proj\"], "
                                 "the adapter's is [\"gate_proj\",\"up_proj\"]"),
            std::string::npos)
      << llama.message();
  EXPECT_TRUE(f.check_adapter(f.lora, model::ModelFamily::kMixtral).is_ok());
  EXPECT_EQ(f.to_json(model::ModelFamily::kMixtral)["target_modules"], Json({"w1", "w2"}));
}

TEST(ConfigTest, WrongTypesAndRangesAllReported) {
  Json j = minimal();
  j["seq_len"] = "long";
  j["batch_size"] = -3;
  j["precision"] = "fp8";
  j["offload_optimizer"] = "disk";
  j["optimizer"] = {{"betas", {0.9}}};
  auto c = parse_train_config(j, "test.json");
  ASSERT_FALSE(c.is_ok());
  const std::string& m = c.status().message();
  EXPECT_NE(m.find("'seq_len': expected an integer, got \"long\""), std::string::npos) << m;
  EXPECT_NE(m.find("'batch_size': must be >= 1, got -3"), std::string::npos) << m;
  EXPECT_NE(m.find("'precision': got 'fp8'; expected one of fp32|bf16|fp16"), std::string::npos)
      << m;
  EXPECT_NE(m.find("'offload_optimizer': got 'disk'"), std::string::npos) << m;
  EXPECT_NE(m.find("'optimizer.betas'"), std::string::npos) << m;
}

// fp16's loss scaling: DeepSpeed's "fp16" block and defaults; it needs precision "fp16", and its
// keys are checked like every other.
TEST(ConfigTest, Fp16TakesDeepSpeedsLossScalerKeys) {
  Json j = minimal();
  j["precision"] = "fp16";
  auto c = parse_train_config(j, "t.json");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->precision, DType::kF16);
  EXPECT_EQ(c->loss_scaler.loss_scale, 0.0);  // dynamic
  EXPECT_EQ(c->loss_scaler.initial_scale_power, 16);
  EXPECT_EQ(c->loss_scaler.loss_scale_window, 1000);
  EXPECT_EQ(c->loss_scaler.hysteresis, 2);
  EXPECT_EQ(c->loss_scaler.min_loss_scale, 1.0);
  j["fp16"] = {{"enabled", true},         {"loss_scale", 0}, {"initial_scale_power", 12},
               {"loss_scale_window", 50}, {"hysteresis", 1}, {"consecutive_hysteresis", true},
               {"min_loss_scale", 0.25}};
  c = parse_train_config(j, "t.json");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->loss_scaler.initial_scale_power, 12);
  EXPECT_EQ(c->loss_scaler.loss_scale_window, 50);
  EXPECT_EQ(c->loss_scaler.hysteresis, 1);
  EXPECT_TRUE(c->loss_scaler.consecutive_hysteresis);
  EXPECT_EQ(c->loss_scaler.min_loss_scale, 0.25);
  // The config as saved reads back the same.
  auto again = parse_train_config(c->to_json(), "saved");
  ASSERT_TRUE(again.is_ok()) << again.status().message();
  EXPECT_EQ(again->loss_scaler.min_loss_scale, 0.25);

  j["fp16"] = {{"loss_scale_windows", 50}, {"min_loss_scale", 0}, {"hysteresis", 0}};
  c = parse_train_config(j, "t.json");
  ASSERT_FALSE(c.is_ok());
  std::string m = c.status().message();
  EXPECT_NE(m.find("'fp16.loss_scale_windows': unknown key"), std::string::npos) << m;
  EXPECT_NE(m.find("'fp16.min_loss_scale'"), std::string::npos) << m;
  EXPECT_NE(m.find("'fp16.hysteresis'"), std::string::npos) << m;
  j["precision"] = "bf16";
  j["fp16"] = {{"loss_scale", 128}};
  c = parse_train_config(j, "t.json");
  ASSERT_FALSE(c.is_ok());
  m = c.status().message();
  EXPECT_NE(m.find("'fp16': sets fp16's loss scaling, but precision is \"bf16\""),
            std::string::npos)
      << m;
}

TEST(ConfigTest, MicroBatchMustDivideBatch) {
  Json j = minimal();
  j["batch_size"] = 10;
  j["micro_batch_size"] = 4;
  auto c = parse_train_config(j, "t.json");
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("must divide batch_size 10"), std::string::npos);
  j["micro_batch_size"] = 5;
  c = parse_train_config(j, "t.json");
  ASSERT_TRUE(c.is_ok());
  EXPECT_EQ(c->accumulation_steps(), 2);
}

TEST(ConfigTest, ByteSizesAcceptUnits) {
  Json j = minimal();
  j["device_memory_limit"] = "2GiB";
  j["host_memory_limit"] = 1048576;
  auto c = parse_train_config(j, "t.json");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->device_memory_limit, 2ull << 30);
  EXPECT_EQ(c->host_memory_limit, 1ull << 20);
  j["device_memory_limit"] = "2 parsecs";
  c = parse_train_config(j, "t.json");
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find("'device_memory_limit'"), std::string::npos);
}

TEST(ConfigTest, BucketSizesAreBytesAndMustBePositive) {
  auto d = parse_train_config(minimal(), "t.json");
  ASSERT_TRUE(d.is_ok()) << d.status().message();
  EXPECT_EQ(d->reduce_bucket_bytes, std::uint64_t{64} << 20);
  EXPECT_EQ(d->allgather_bucket_bytes, std::uint64_t{64} << 20);
  EXPECT_EQ(d->to_json()["reduce_bucket_bytes"], std::uint64_t{64} << 20);

  Json j = minimal();
  j["reduce_bucket_bytes"] = "4KiB";
  j["allgather_bucket_bytes"] = 3000;
  auto c = parse_train_config(j, "t.json");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->reduce_bucket_bytes, 4096u);
  EXPECT_EQ(c->allgather_bucket_bytes, 3000u);

  // Both bad values reported at once, each naming its key.
  j["reduce_bucket_bytes"] = 0;
  j["allgather_bucket_bytes"] = -5;
  auto bad = parse_train_config(j, "t.json");
  ASSERT_FALSE(bad.is_ok());
  const std::string& m = bad.status().message();
  EXPECT_NE(m.find("'reduce_bucket_bytes': must be positive, got 0"), std::string::npos) << m;
  EXPECT_NE(m.find("'allgather_bucket_bytes': byte size -5 is negative"), std::string::npos) << m;
  j["reduce_bucket_bytes"] = "2GiB";
  const std::string big = parse_train_config(j, "t.json").status().message();
  EXPECT_NE(big.find("'reduce_bucket_bytes': must be at most 1GiB (1073741824), got 2147483648"),
            std::string::npos)
      << big;
  j["allgather_bucket_bytes"] = "lots";
  const std::string m2 = parse_train_config(j, "t.json").status().message();
  EXPECT_NE(m2.find("'allgather_bucket_bytes': 'lots' is not a byte size"), std::string::npos)
      << m2;
}

TEST(ConfigTest, NvmeNeedsSwapPathsAndParamOffloadNeedsOptimizerOffload) {
  Json j = minimal();
  j["offload_optimizer"] = "nvme";
  j["offload_param"] = "cpu";
  EXPECT_NE(parse_train_config(j, "t.json").status().message().find("'swap_paths'"),
            std::string::npos);
  j["offload_optimizer"] = "none";
  j["swap_paths"] = {"/tmp"};
  EXPECT_NE(parse_train_config(j, "t.json").status().message().find("needs offload_optimizer"),
            std::string::npos);
  // A frozen base goes where offload_param says; its adapters' optimizer stays on the device.
  j["finetune"] = {{"method", "lora"}, {"r", 4}};
  auto lora = parse_train_config(j, "t.json");
  ASSERT_TRUE(lora.is_ok()) << lora.status().message();
  EXPECT_EQ(lora->offload_param, Tier::kHost);
  EXPECT_EQ(lora->offload_optimizer, Tier::kDevice);
}

// offload_optimizer_fraction: a share from 0 to 1 or "auto", of an offloaded optimizer only, and
// not with save_async (which sets the state aside in the optimizer's tier).
TEST(ConfigTest, OffloadOptimizerFractionIsAShareOfAnOffloadedOptimizer) {
  Json j = minimal();
  EXPECT_EQ(parse_train_config(j, "t.json")->offload_optimizer_fraction, 1.0);
  j["offload_optimizer"] = "cpu";
  j["offload_optimizer_fraction"] = 0.25;
  auto c = parse_train_config(j, "t.json");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->offload_optimizer_fraction, 0.25);
  EXPECT_FALSE(c->offload_optimizer_fraction_auto);
  j["offload_optimizer_fraction"] = "auto";
  EXPECT_TRUE(parse_train_config(j, "t.json")->offload_optimizer_fraction_auto);
  for (const Json& bad : {Json(1.5), Json(-0.1), Json("half"), Json(true)}) {
    j["offload_optimizer_fraction"] = bad;
    const std::string m = parse_train_config(j, "t.json").status().message();
    EXPECT_NE(m.find("'offload_optimizer_fraction'"), std::string::npos) << m;
    EXPECT_NE(m.find("expected a number from 0 to 1 or \"auto\", got " + bad.dump()),
              std::string::npos)
        << m;
  }
  j["offload_optimizer_fraction"] = 0.5;
  j["offload_optimizer"] = "none";
  std::string m = parse_train_config(j, "t.json").status().message();
  EXPECT_NE(m.find("offload_optimizer is \"none\""), std::string::npos) << m;
  j["offload_optimizer"] = "cpu";
  j["save_dir"] = "ckpt";
  j["save_async"] = true;
  m = parse_train_config(j, "t.json").status().message();
  EXPECT_NE(m.find("'save_async'"), std::string::npos) << m;
  EXPECT_NE(m.find("offload_optimizer_fraction"), std::string::npos) << m;
}

TEST(ConfigTest, OverridesSetNestedKeysAndParseJson) {
  Json j = minimal();
  ASSERT_TRUE(apply_override(j, "optimizer.lr=1e-4").is_ok());
  ASSERT_TRUE(apply_override(j, "optimizer.betas=[0.8,0.9]").is_ok());
  ASSERT_TRUE(apply_override(j, "data.path=other.txt").is_ok());
  ASSERT_TRUE(apply_override(j, "model.hidden_size=64").is_ok());
  ASSERT_TRUE(apply_override(j, "swap_paths=[\"/a\",\"/b\"]").is_ok());
  auto c = parse_train_config(j, "t.json");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_DOUBLE_EQ(c->optimizer.lr, 1e-4);
  EXPECT_DOUBLE_EQ(c->optimizer.beta1, 0.8);
  EXPECT_EQ(c->data.path, "other.txt");
  EXPECT_EQ(c->model.hidden_size, 64);
  EXPECT_EQ(c->swap_paths.size(), 2u);
  EXPECT_FALSE(apply_override(j, "novalue").is_ok());
  EXPECT_FALSE(apply_override(j, "data.path.x=1").is_ok());  // path is a string
}

// Found by the train_config fuzzer: a number beyond double's range is JSON's syntax but not
// nlohmann's value (an out_of_range exception, not a parse_error) and used to end the process.
TEST(ConfigTest, ANumberBeyondDoublesRangeIsAnErrorNotACrash) {
  testing::TempDir dir;
  dir.write("t.json", R"({"model": {"rms_norm_eps": 1e99999}})");
  auto c = load_train_config(dir.file("t.json"), {});
  ASSERT_FALSE(c.is_ok());
  EXPECT_NE(c.status().message().find(dir.file("t.json") + " is not valid JSON"), std::string::npos)
      << c.status().message();
  Json j = minimal();
  // Found next: an override that is not UTF-8 became a string no message could print.
  EXPECT_NE(apply_override(j,
                           "optimizer.lr=1e\x9c"
                           "4")
                .message()
                .find("not UTF-8"),
            std::string::npos);
  ASSERT_TRUE(apply_override(j, "optimizer.lr=1e99999").is_ok());  // kept as the text it is
  auto o = parse_train_config(j, "t.json");
  ASSERT_FALSE(o.is_ok());
  EXPECT_NE(o.status().message().find("optimizer.lr"), std::string::npos) << o.status().message();
}

// "~" at a path's start is the home directory, as a shell would have it, in every path key (the
// model's config.json is read through it); "~user" and a "~" inside a path are left as written.
TEST(ConfigTest, TildeInAPathIsTheHomeDirectory) {
  testing::TempDir home;
  const testing::ScopedEnv env("HOME", home.path());
  Json hf = minimal()["model"];
  hf["max_position_embeddings"] = 256;
  home.write("models/tiny/config.json", hf.dump());
  Json j = minimal();
  j["model"] = "~/models/tiny";
  j["data"]["path"] = "~/data.txt";
  j["eval_data"] = {{"path", "~/eval.txt"}, {"format", "text"}};
  j["swap_paths"] = {"~/swap-{rank}", "/mnt/a~/swap"};
  j["save_dir"] = "~";
  j["metrics_file"] = "~other/metrics.jsonl";
  j["trace_file"] = "~/trace.json";
  auto c = parse_train_config(j, "test.json");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->model_path, home.file("models/tiny"));
  EXPECT_EQ(c->model.hidden_size, 32);
  EXPECT_EQ(c->data.path, home.file("data.txt"));
  EXPECT_EQ(c->eval_data->path, home.file("eval.txt"));
  EXPECT_EQ(c->swap_paths, (std::vector<std::string>{home.file("swap-{rank}"), "/mnt/a~/swap"}));
  EXPECT_EQ(c->save_dir, home.path());
  EXPECT_EQ(c->metrics_file, "~other/metrics.jsonl");
  EXPECT_EQ(c->trace_file, home.file("trace.json"));
}

// $NAME and ${NAME} are the environment's values, as a shell would have them ("$$" a "$"); an
// unset variable, or a "$" that starts no name, is an error naming the key and the variable.
TEST(ConfigTest, EnvironmentVariablesInAPathAreExpanded) {
  const testing::ScopedEnv scratch("STRATA_TEST_SCRATCH", "/scratch/a");
  Json j = minimal();
  j["data"]["path"] = "$STRATA_TEST_SCRATCH/data.txt";
  j["swap_paths"] = {"${STRATA_TEST_SCRATCH}_nvme/swap-{rank}", "/mnt/$$x"};
  auto c = parse_train_config(j, "test.json");
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->data.path, "/scratch/a/data.txt");
  EXPECT_EQ(c->swap_paths, (std::vector<std::string>{"/scratch/a_nvme/swap-{rank}", "/mnt/$x"}));
  j["save_dir"] = "$STRATA_TEST_UNSET/ckpt";
  j["metrics_file"] = "${STRATA_TEST_SCRATCH/m.jsonl";
  auto bad = parse_train_config(j, "test.json");
  ASSERT_FALSE(bad.is_ok());
  const std::string& m = bad.status().message();
  EXPECT_NE(m.find("'save_dir': $STRATA_TEST_UNSET/ckpt: the environment variable "
                   "STRATA_TEST_UNSET is not set"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("'metrics_file': ${STRATA_TEST_SCRATCH/m.jsonl: a \"$\" that starts no "
                   "variable name"),
            std::string::npos)
      << m;
}
}  // namespace
}  // namespace strata::train
