// A DeepSpeed config file trains the same bits as the Strata keys it maps to: the batch by
// DeepSpeed's rule, Adam with L2 decay (adam_w_mode false), WarmupDecayLR, clipping, ZeRO-3 with
// both offloads.
#include <gtest/gtest.h>

#include "tests/integration/train_runs.h"

namespace strata::train {
namespace {

TEST(DeepSpeedTrain, ADeepSpeedConfigTrainsTheBitsOfItsStrataKeys) {
  TempDir dir;
  Json base = tiny_config(dir);
  for (const char* k :
       {"batch_size", "micro_batch_size", "optimizer", "lr_schedule", "grad_clip"}) {
    base.erase(k);
  }
  Json strata = base;
  strata.update(Json::parse(R"({
    "batch_size": 4, "micro_batch_size": 2,
    "optimizer": {"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                  "adamw_mode": false},
    "lr_schedule": {"type": "warmup_decay", "warmup_steps": 2, "warmup_type": "linear",
                    "warmup_min_lr": 0.001, "total_steps": 4},
    "grad_clip": 0.5, "zero_stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"
  })"));
  strata["save_dir"] = dir.file("strata");
  Json ds = base;
  ds["deepspeed"] = dir.write("ds_config.json", R"({
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
    "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8,
                                             "weight_decay": 0.1, "adam_w_mode": false}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 0.001, "warmup_max_lr": "auto",
                             "warmup_num_steps": 2, "warmup_type": "linear",
                             "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": true},
                          "offload_optimizer": {"device": "cpu", "pin_memory": true},
                          "overlap_comm": true, "contiguous_gradients": true}
  })");
  ds["save_dir"] = dir.file("deepspeed");
  const RunBits a = run_bits(strata), b = run_bits(ds);
  ASSERT_EQ(a.losses.size(), 4u);
  expect_same_bits(a, b);
  // Adam's L2 decay is not AdamW's: the mode reaches the optimizer.
  Json adamw = strata;
  adamw["optimizer"]["adamw_mode"] = true;
  adamw["save_dir"] = dir.file("adamw");
  EXPECT_NE(run_bits(adamw).model, a.model);
}

}  // namespace
}  // namespace strata::train
