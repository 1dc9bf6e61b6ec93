// DeepSpeed config files joined into Strata's config: each mapped key lands on its Strata key,
// "auto" and absent keys leave the Strata config's, keys that only tune are listed, keys that
// change the mathematics are refused, keys set differently in both files are refused naming both,
// and DeepSpeed's three schedulers give the lrs DeepSpeed's own code gives.
#include "strata/train/deepspeed_config.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <limits>

#include "strata/train/config.h"
#include "tests/testing/temp_dir.h"

namespace strata::train {
namespace {

Json minimal_deepspeed() {
  return Json::parse(R"({"model": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
                         "num_hidden_layers": 2, "num_attention_heads": 4},
                         "data": {"path": "x.txt", "format": "text"}})");
}

Result<TrainConfig> with_ds(Json config, const Json& ds) {
  config["deepspeed"] = ds;
  return parse_train_config(config, "train.json");
}

std::string error_of(const Result<TrainConfig>& c) {
  EXPECT_FALSE(c.is_ok());
  return c.is_ok() ? "" : c.status().message();
}

bool has(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

// A ZeRO-3 NVMe config as DeepSpeed's documentation writes one lands on Strata's keys: counts in
// elements become bytes of the compute dtype (2 in bf16), the batch follows DeepSpeed's rule.
TEST(DeepSpeedConfig, EveryMappedKeyLandsOnItsStrataKey) {
  const Json ds = Json::parse(R"({
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.7, "steps_per_print": 2000,
    "bf16": {"enabled": true},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": 2e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupCosineLR",
                  "params": {"total_num_steps": 50, "warmup_num_steps": 5,
                             "warmup_min_ratio": 0.1, "cos_min_ratio": 0.02,
                             "warmup_type": "linear"}},
    "zero_optimization": {
      "stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme0", "pin_memory": true,
                            "buffer_count": 4, "ratio": 0.3},
      "offload_param": {"device": "nvme", "nvme_path": "/nvme1", "buffer_size": 1e8},
      "sub_group_size": 1e8, "reduce_bucket_size": 1e7, "allgather_bucket_size": 2e7,
      "stage3_prefetch_bucket_size": 5e6, "stage3_max_live_parameters": 1e8,
      "stage3_max_reuse_distance": 1e8, "stage3_param_persistence_threshold": 1e4,
      "overlap_comm": true, "contiguous_gradients": true},
    "aio": {"block_size": 262144, "queue_depth": 16, "intra_op_parallelism": 2,
            "single_submit": false, "overlap_events": true},
    "activation_checkpointing": {"cpu_checkpointing": true, "partition_activations": false}
  })");
  auto c = with_ds(minimal_deepspeed(), ds);
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->deepspeed_source, "train.json's \"deepspeed\"");
  EXPECT_EQ(c->micro_batch_size, 2);
  EXPECT_EQ(c->gradient_accumulation_steps, 4);
  EXPECT_EQ(c->batch_size, 0);  // micro x accumulation x the ranks, once they are known
  ASSERT_TRUE(c->resolve_batch(2).is_ok());
  EXPECT_EQ(c->batch_size, 16);
  EXPECT_EQ(c->accumulation_steps(2), 4);
  EXPECT_EQ(c->grad_clip, 0.7);
  EXPECT_EQ(c->log_every, 1);  // steps_per_print is Strata's to decide (progress every step)
  EXPECT_EQ(c->precision, DType::kBF16);
  EXPECT_EQ(c->optimizer.lr, 2e-4);
  EXPECT_EQ(c->optimizer.beta2, 0.95);
  EXPECT_EQ(c->optimizer.eps, 1e-6);
  EXPECT_EQ(c->optimizer.weight_decay, 0.1);
  EXPECT_TRUE(c->optimizer.adamw_mode);
  EXPECT_EQ(c->lr_schedule.type, optim::ScheduleKind::kWarmupCosine);
  EXPECT_EQ(c->lr_schedule.warmup_steps, 5);
  EXPECT_EQ(c->lr_schedule.total_steps, 50);
  EXPECT_EQ(c->lr_schedule.warmup_min_ratio, 0.1);
  EXPECT_EQ(c->lr_schedule.cos_min_ratio, 0.02);
  EXPECT_EQ(c->lr_schedule.warmup_type, optim::WarmupType::kLinear);
  EXPECT_EQ(c->zero_stage, 3);
  EXPECT_EQ(c->offload_optimizer, Tier::kNvme);
  EXPECT_EQ(c->offload_param, Tier::kNvme);
  EXPECT_EQ(c->offload_optimizer_fraction, 0.3);  // ZeRO-3's partial offload
  // A folder for each rank in each node's nvme_path (param's first).
  EXPECT_EQ(c->swap_paths,
            (std::vector<std::string>{"/nvme1/strata-{rank}", "/nvme0/strata-{rank}"}));
  EXPECT_EQ(c->sub_group_size, 100000000);
  EXPECT_EQ(c->reduce_bucket_bytes, 20000000u);
  EXPECT_EQ(c->allgather_bucket_bytes, 40000000u);
  EXPECT_EQ(c->prefetch_bytes, 10000000u);
  EXPECT_EQ(c->max_live_bytes, 200000000u);
  EXPECT_EQ(c->max_reuse_distance, 200000000u);
  EXPECT_EQ(c->param_persistence_threshold, 10000);
  EXPECT_EQ(c->swap_block_size, 262144u);
  EXPECT_EQ(c->swap_queue_depth, 16);
  EXPECT_EQ(c->swap_threads, 2);
  EXPECT_TRUE(c->activation_checkpointing);
  EXPECT_EQ(c->activation_offload, Tier::kHost);
  for (const char* k :
       {"steps_per_print", "zero_optimization.offload_optimizer.pin_memory",
        "zero_optimization.offload_optimizer.buffer_count",
        "zero_optimization.offload_param.buffer_size", "zero_optimization.overlap_comm",
        "zero_optimization.contiguous_gradients", "aio.single_submit", "aio.overlap_events",
        "activation_checkpointing.partition_activations"}) {
    EXPECT_TRUE(has(c->deepspeed_decided, k)) << k;
  }
  EXPECT_NE(c->deepspeed_line().find("decided by Strata: "), std::string::npos);
  // The checkpoint's config is Strata's keys alone.
  EXPECT_FALSE(c->to_json().contains("deepspeed"));
}

// "auto" (Hugging Face's Trainer's placeholder) and absent keys leave the Strata config's values;
// DeepSpeed's own defaults apply where they differ from Strata's and neither file sets the key.
TEST(DeepSpeedConfig, AutoAndAbsentKeysLeaveTheStrataConfigs) {
  Json config = minimal_deepspeed();
  config["batch_size"] = 8;
  config["micro_batch_size"] = 4;
  config["optimizer"] = {{"lr", 5e-5}};
  config["precision"] = "bf16";
  const Json ds = Json::parse(R"({
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                 "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}
  })");
  auto c = with_ds(config, ds);
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->batch_size, 8);
  EXPECT_EQ(c->micro_batch_size, 4);
  EXPECT_EQ(c->optimizer.lr, 5e-5);
  EXPECT_EQ(c->precision, DType::kBF16);
  EXPECT_EQ(c->grad_clip, 1.0);  // "auto": the Strata config's (here its default)
  EXPECT_EQ(c->lr_schedule.type, optim::ScheduleKind::kWarmup);
  EXPECT_EQ(c->lr_schedule.warmup_steps, 0);  // "auto": Strata's (DeepSpeed raises it to 2)
  EXPECT_EQ(c->reduce_bucket_bytes, zero::kDefaultReduceBucketBytes);
  EXPECT_EQ(c->zero_stage, 2);

  // gradient_clipping left out: DeepSpeed does not clip, unless the Strata config says to.
  auto off = with_ds(minimal_deepspeed(), Json{{"zero_optimization", {{"stage", 1}}}});
  ASSERT_TRUE(off.is_ok()) << off.status().message();
  EXPECT_EQ(off->grad_clip, 0.0);
  Json clipped = minimal_deepspeed();
  clipped["grad_clip"] = 0.3;
  auto kept = with_ds(clipped, Json{{"zero_optimization", {{"stage", 1}}}});
  ASSERT_TRUE(kept.is_ok()) << kept.status().message();
  EXPECT_EQ(kept->grad_clip, 0.3);
  // WarmupLR's warmup_num_steps left out is DeepSpeed's 1000.
  auto warm = with_ds(minimal_deepspeed(), Json{{"scheduler", {{"type", "WarmupLR"}}}});
  ASSERT_TRUE(warm.is_ok()) << warm.status().message();
  EXPECT_EQ(warm->lr_schedule.warmup_steps, 1000);
  EXPECT_EQ(warm->lr_schedule.warmup_type, optim::WarmupType::kLog);
}

// The same setting in both files is fine (bytes by value, "64MiB" against elements); different
// settings are refused naming both places, a --set override by its flag.
TEST(DeepSpeedConfig, AKeySetDifferentlyInBothIsRefusedNamingBoth) {
  Json config = minimal_deepspeed();
  config["zero_stage"] = 3;
  config["reduce_bucket_bytes"] = "64MiB";
  config["optimizer"] = {{"lr", 1e-4}};
  auto same = with_ds(config, Json::parse(R"({"zero_optimization": {"stage": 3,
                                             "reduce_bucket_size": 16777216},
                                             "optimizer": {"type": "Adam",
                                                           "params": {"lr": 1e-4}}})"));
  ASSERT_TRUE(same.is_ok()) << same.status().message();
  EXPECT_EQ(same->reduce_bucket_bytes, std::uint64_t{64} << 20);  // 16Mi fp32 elements

  const std::string m = error_of(
      with_ds(config, Json::parse(R"({"zero_optimization": {"stage": 2}, "scheduler": {"type":
                              "WarmupDecayLR", "params": {"total_num_steps": 10}}})")));
  EXPECT_NE(m.find("'zero_optimization.stage' makes 'zero_stage' 2, but train.json makes it 3"),
            std::string::npos)
      << m;
  // WarmupDecayLR runs at its warmup_max_lr, 0.001 when left out, whatever the optimizer's lr.
  EXPECT_NE(m.find("WarmupDecayLR's default)' makes 'optimizer.lr' 0.001, but train.json makes "
                   "it 0.0001"),
            std::string::npos)
      << m;

  testing::TempDir dir;
  const std::string ds = dir.write("ds.json", R"({"zero_optimization": {"stage": 2}})");
  Json file = minimal_deepspeed();
  file["deepspeed"] = ds;
  const std::string path = dir.write("train.json", file.dump());
  auto set = load_train_config(path, {"zero_stage=3"});
  ASSERT_FALSE(set.is_ok());
  EXPECT_NE(set.status().message().find(
                "ds.json's 'zero_optimization.stage' makes 'zero_stage' 2, but --set zero_stage "
                "makes it 3"),
            std::string::npos)
      << set.status().message();
  // --deepspeed (a flag's key) reads the same file.
  auto flag = load_train_config(dir.write("plain.json", minimal_deepspeed().dump()), {},
                                Json{{"deepspeed", ds}});
  ASSERT_TRUE(flag.is_ok()) << flag.status().message();
  EXPECT_EQ(flag->zero_stage, 2);
  EXPECT_EQ(flag->deepspeed_source, ds);
  // The config naming one DeepSpeed file and --deepspeed another: refused, naming both.
  const std::string other = dir.write("other.json", R"({"zero_optimization": {"stage": 1}})");
  auto both = load_train_config(path, {}, Json{{"deepspeed", other}});
  ASSERT_FALSE(both.is_ok());
  EXPECT_NE(both.status().message().find("its 'deepspeed' is \"" + ds +
                                         "\" and --deepspeed gives \"" + other + "\"; keep one"),
            std::string::npos)
      << both.status().message();
}

// Keys that would change the mathematics are refused by name with what Strata has instead; an
// unknown key gets the nearest DeepSpeed key; every problem at once.
TEST(DeepSpeedConfig, KeysThatChangeTheMathematicsAreRefusedByName) {
  const std::string m = error_of(with_ds(minimal_deepspeed(), Json::parse(R"({
    "optimizer": {"type": "Lamb", "params": {"amsgrad": true, "bias_correction": false}},
    "scheduler": {"type": "OneCycle"},
    "fp16": {"enabled": true}, "bf16": {"enabled": true},
    "zero_optimization": {"stage": 3, "zero_quantized_gradients": true},
    "zero_optimisation": {}, "sparse_attention": {"mode": "fixed"},
    "amp": {"enabled": false}
  })")));
  for (const char* part :
       {"train.json's \"deepspeed\": 'optimizer.type': \"Lamb\" is not an optimizer Strata runs",
        "'optimizer.params.amsgrad': true: Strata's Adam has no AMSGrad variant",
        "'optimizer.params.bias_correction': false",
        "'scheduler.type': \"OneCycle\" is not a schedule Strata runs",
        "'fp16': and bf16 are both enabled",
        "'zero_optimization.zero_quantized_gradients': quantizes the reduced gradients",
        "'zero_optimisation': unknown key; did you mean 'zero_optimization'?",
        "'sparse_attention': Strata's attention is dense"}) {
    EXPECT_NE(m.find(part), std::string::npos) << part << "\n" << m;
  }
  EXPECT_EQ(m.find("'amp'"), std::string::npos) << m;  // off: nothing to refuse
  // Not a file, or not JSON: named.
  Json missing = minimal_deepspeed();
  missing["deepspeed"] = "/nonexistent/ds.json";
  const std::string n = error_of(parse_train_config(missing, "train.json"));
  EXPECT_NE(n.find("'deepspeed': "), std::string::npos) << n;
  EXPECT_NE(n.find("/nonexistent/ds.json"), std::string::npos) << n;
}

// offload_optimizer.ratio is a share: outside 0 to 1 it is refused by its DeepSpeed name.
TEST(DeepSpeedConfig, AnOffloadRatioOutsideZeroToOneIsRefused) {
  const std::string m = error_of(with_ds(minimal_deepspeed(), Json::parse(R"({
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}
  })")));
  EXPECT_NE(m.find("'zero_optimization.offload_optimizer.ratio': expected a share from 0 to 1, "
                   "got 1.5"),
            std::string::npos)
      << m;
}

// DeepSpeed's Adam is AdamW unless adam_w_mode is false, which is Adam with L2 decay; the name
// AdamW decays decoupled whatever adam_w_mode says; stage 0 runs as stage 1.
TEST(DeepSpeedConfig, AdamsModesAndStageZero) {
  auto l2 = with_ds(minimal_deepspeed(), Json::parse(R"({"optimizer": {"type": "Adam", "params":
                                              {"adam_w_mode": false, "weight_decay": 0.01}},
                                              "zero_optimization": {"stage": 0}})"));
  ASSERT_TRUE(l2.is_ok()) << l2.status().message();
  EXPECT_FALSE(l2->optimizer.adamw_mode);
  EXPECT_EQ(l2->zero_stage, 1);
  EXPECT_TRUE(has(l2->deepspeed_decided, "zero_optimization.stage 0 (run as stage 1)"));
  // A Strata config that asks for L2 decay meets DeepSpeed's AdamW (whatever adam_w_mode says)
  // and its Adam (AdamW by default): both refused, naming the key.
  Json l2_config = minimal_deepspeed();
  l2_config["optimizer"] = {{"adamw_mode", false}};
  const std::string w = error_of(with_ds(l2_config, Json::parse(R"({"optimizer": {"type":
                                         "AdamW", "params": {"adam_w_mode": false}}})")));
  EXPECT_NE(w.find("'optimizer.type' makes 'optimizer.adamw_mode' true, but train.json makes "
                   "it false"),
            std::string::npos)
      << w;
  const std::string a = error_of(with_ds(l2_config, Json::parse(R"({"optimizer": {"type":
                                         "adam"}})")));
  EXPECT_NE(a.find("'optimizer.type' makes 'optimizer.adamw_mode' true"), std::string::npos) << a;
}

// DeepSpeed's train_batch_size rule over the data-parallel ranks: any two of the three give the
// third; all three must agree.
TEST(DeepSpeedConfig, TheBatchFollowsDeepSpeedsRuleOverTheRanks) {
  auto from_batch = with_ds(minimal_deepspeed(), Json::parse(R"({"train_batch_size": 32,
                                                      "gradient_accumulation_steps": 2})"));
  ASSERT_TRUE(from_batch.is_ok()) << from_batch.status().message();
  EXPECT_FALSE(from_batch->check_batch_split(3).is_ok());  // 32 is not 2 x 3 x m
  ASSERT_TRUE(from_batch->resolve_batch(4).is_ok());
  EXPECT_EQ(from_batch->micro_batch_size, 4);

  // One of train_batch_size and the micro-batch alone: DeepSpeed accumulates once.
  auto train_only = with_ds(minimal_deepspeed(), Json{{"train_batch_size", 16}});
  ASSERT_TRUE(train_only.is_ok()) << train_only.status().message();
  ASSERT_TRUE(train_only->resolve_batch(4).is_ok());
  EXPECT_EQ(train_only->micro_batch_size, 4);
  EXPECT_EQ(train_only->accumulation_steps(4), 1);
  auto micro_only = with_ds(minimal_deepspeed(), Json{{"train_micro_batch_size_per_gpu", 3}});
  ASSERT_TRUE(micro_only.is_ok()) << micro_only.status().message();
  ASSERT_TRUE(micro_only->resolve_batch(2).is_ok());
  EXPECT_EQ(micro_only->batch_size, 6);
  // ... unless the Strata config gives the other: then its accumulation stands.
  Json batch8 = minimal_deepspeed();
  batch8["batch_size"] = 8;
  auto with_batch = with_ds(batch8, Json{{"train_micro_batch_size_per_gpu", 2}});
  ASSERT_TRUE(with_batch.is_ok()) << with_batch.status().message();
  EXPECT_EQ(with_batch->accumulation_steps(2), 2);

  auto all = with_ds(minimal_deepspeed(), Json::parse(R"({"train_batch_size": 32,
                                               "train_micro_batch_size_per_gpu": 4,
                                               "gradient_accumulation_steps": 2})"));
  ASSERT_TRUE(all.is_ok()) << all.status().message();
  EXPECT_TRUE(all->check_batch_split(4).is_ok());
  const Status wrong = all->check_batch_split(2);
  ASSERT_FALSE(wrong.is_ok());
  EXPECT_NE(wrong.message().find("batch_size 32 must be micro_batch_size 4 x "
                                 "gradient_accumulation_steps 2 x 2 data-parallel ranks = 16"),
            std::string::npos)
      << wrong.message();

  const std::string m =
      error_of(with_ds(minimal_deepspeed(), Json::parse(R"({"gradient_accumulation_steps": 2})")));
  EXPECT_NE(m.find("needs batch_size or micro_batch_size"), std::string::npos) << m;
}

// DeepSpeed's schedulers give the lr DeepSpeed's own lr_schedules.py gives at every step
// (tests/data/deepspeed_lr.json, tools/golden/deepspeed_lr_golden.py), read through the
// scheduler block of a DeepSpeed config. The formulas are DeepSpeed's operations in its order;
// log and cos are libm's, correctly rounded to within an ulp or so on every x86-64 path, so
// each lr is within a few ulps: the bound is 8 ulps of the lr.
TEST(DeepSpeedConfig, SchedulersMatchDeepSpeedsOwnCode) {
  std::ifstream in(std::string(STRATA_TEST_DATA_DIR) + "/deepspeed_lr.json");
  ASSERT_TRUE(in) << "tests/data/deepspeed_lr.json";
  const Json golden = Json::parse(in);
  ASSERT_GE(golden["cases"].size(), 9u);
  for (const Json& g : golden["cases"]) {
    const std::string name = g["type"].get<std::string>() + " " + g["params"].dump();
    Json config = minimal_deepspeed();
    config["max_steps"] = g["lrs"].size();
    // The optimizer's lr as DeepSpeed's file gives it; warmup_max_lr supersedes it, as there.
    auto c = with_ds(
        config, Json{{"optimizer", {{"type", "AdamW"}, {"params", {{"lr", g["optimizer_lr"]}}}}},
                     {"scheduler", {{"type", g["type"]}, {"params", g["params"]}}}});
    ASSERT_TRUE(c.is_ok()) << name << ": " << c.status().message();
    const optim::LrSchedule s = c->schedule();
    for (std::size_t k = 0; k < g["lrs"].size(); ++k) {
      const double want = g["lrs"][k].get<double>();
      const double got = s.lr_at(static_cast<std::int64_t>(k));
      EXPECT_NEAR(got, want, 8 * std::numeric_limits<double>::epsilon() * std::abs(want))
          << name << " step " << k;
    }
  }
}

// Hugging Face's fp16 block ("enabled": "auto") keeps its loss-scaling keys for a Strata config
// in fp16; fp16 off beside bf16 "auto" leaves Strata's bf16; two keys of the file for one
// Strata key must agree; an error on a key the file set is blamed on the file.
TEST(DeepSpeedConfig, AutoPrecisionKeepsTheScalerAndTheFileIsBlamedForItsKeys) {
  Json fp16 = minimal_deepspeed();
  fp16["precision"] = "fp16";
  auto c = with_ds(fp16, Json::parse(R"({"fp16": {"enabled": "auto", "loss_scale_window": 500,
                                                  "hysteresis": 3}})"));
  ASSERT_TRUE(c.is_ok()) << c.status().message();
  EXPECT_EQ(c->precision, DType::kF16);
  EXPECT_EQ(c->loss_scaler.loss_scale_window, 500);
  EXPECT_EQ(c->loss_scaler.hysteresis, 3);
  Json bf16 = minimal_deepspeed();
  bf16["precision"] = "bf16";
  auto b = with_ds(bf16, Json::parse(R"({"fp16": {"enabled": false, "loss_scale": 0},
                                         "bf16": {"enabled": "auto"}})"));
  ASSERT_TRUE(b.is_ok()) << b.status().message();
  EXPECT_EQ(b->precision, DType::kBF16);
  EXPECT_TRUE(has(b->deepspeed_decided, "fp16.loss_scale (fp16 is off)"));

  const std::string m = error_of(with_ds(minimal_deepspeed(), Json::parse(R"({
    "zero_optimization": {"stage": 2, "cpu_offload": true,
                          "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"},
                          "offload_param": {"device": "cpu"}},
    "gradient_allreduce_op": "sum"})")));
  EXPECT_NE(m.find("'zero_optimization.offload_optimizer.device' and 'zero_optimization."
                   "cpu_offload' both set 'offload_optimizer', to \"nvme\" and \"cpu\"; keep one"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("'gradient_allreduce_op': \"sum\": Strata averages"), std::string::npos) << m;
  // offload_param came from the file; the stage 2 it contradicts too.
  EXPECT_NE(m.find("'offload_param' (from train.json's \"deepspeed\"): parameter offload needs "
                   "zero_stage 3"),
            std::string::npos)
      << m;
}

}  // namespace
}  // namespace strata::train
