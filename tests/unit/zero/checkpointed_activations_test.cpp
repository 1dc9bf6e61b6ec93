// Checkpointed activations are store tensors with a home the plan chooses: kept on the device, or
// sent down to host memory or NVMe after a block's forward and fetched back for its backward. The
// home changes where the bytes wait, never a bit of the result.
#include <gtest/gtest.h>

#include <vector>

#include "strata/core/aligned.h"
#include "strata/core/rng.h"
#include "strata/mem/host_memory.h"
#include "strata/model/llama.h"
#include "strata/zero/zero_provider.h"
#include "tests/testing/backends.h"

namespace strata::zero {
namespace {

struct Trained {
  std::vector<float> losses;
  std::vector<std::vector<float>> master;  // per group, after the steps
  RankStats stats;
  MemoryPlan plan;
  std::uint64_t checkpoint_bytes = 0;
  int num_checkpoints = 0;
};

Trained train(Tier home, DType dtype) {
  model::LlamaConfig config;
  config.vocab_size = 31;
  config.hidden_size = 16;
  config.intermediate_size = 24;
  config.num_hidden_layers = 3;
  config.num_attention_heads = 2;
  config.num_key_value_heads = 1;
  config.max_position_embeddings = 16;
  const model::ParamLayout layout = model::ParamLayout::build(config);
  auto device = testing::make_cpu_device(8 << 20);
  auto swap = testing::make_swap();
  model::ModelOptions mo;
  mo.compute_dtype = dtype;
  mo.activation_checkpointing = true;
  constexpr std::int64_t kBatch = 2, kSeq = 8;
  ShardOptions o;
  o.offload_optimizer = Tier::kHost;
  o.compute_dtype = dtype;
  o.accumulation_steps = 2;
  o.activation_bytes = model::LlamaModel::activation_bytes(config, mo, kBatch, kSeq);
  o.checkpoint_bytes = model::LlamaModel::checkpoint_bytes(config, mo, kBatch, kSeq);
  o.num_checkpoints = model::LlamaModel::num_checkpoints(config, mo);
  o.checkpoint_home = home;
  auto grid = dist::ProcessGrid::single_rank(*device);
  auto made = ZeroProvider::create(layout, 0, *device, swap.get(), *grid, ZeroOptions{}, o);
  EXPECT_TRUE(made.is_ok()) << made.status().to_string();
  if (!made.is_ok()) return {};
  std::unique_ptr<ZeroProvider> provider = std::move(*made);
  EXPECT_TRUE(provider
                  ->load_master([&](const model::ParamGroup& g, float* dst) {
                    model::init_group(config, g, 7, dst);
                    return Status::ok();
                  })
                  .is_ok());
  model::LlamaModel model(config, layout, *device, mo);
  Trained run;
  run.plan = provider->plan();
  run.checkpoint_bytes = o.checkpoint_bytes;
  run.num_checkpoints = o.num_checkpoints;
  const RankStats before = provider->stats();
  for (int step = 1; step <= 3; ++step) {
    for (std::uint64_t mb = 0; mb < 2; ++mb) {
      Rng rng(10 * static_cast<std::uint64_t>(step) + mb);
      std::vector<std::int32_t> in(kBatch * kSeq), tg(in.size());
      for (auto& x : in) x = static_cast<std::int32_t>(rng.uniform_int(31));
      for (auto& x : tg) x = static_cast<std::int32_t>(rng.uniform_int(31));
      if (mb == 1) provider->begin_last_micro_batch(1e-2, step, false);
      auto loss = model.forward_backward(*provider, in.data(), tg.data(), kBatch, kSeq, 0.5f);
      EXPECT_TRUE(loss.is_ok()) << loss.status().to_string();
      EXPECT_TRUE(provider->finish_micro_batch().is_ok());
      run.losses.push_back(loss.is_ok() ? *loss : -1.0f);
    }
    EXPECT_TRUE(provider->step(1e-2, step, 1.0f).is_ok());
  }
  EXPECT_TRUE(provider->finish_step().is_ok());
  for (const auto& g : layout.groups()) {
    run.master.emplace_back(static_cast<std::size_t>(g.num_elems));
    EXPECT_TRUE(provider->gather_master(g.id, run.master.back().data()).is_ok());
  }
  run.stats = provider->stats().since(before);
  return run;
}

TEST(CheckpointedActivationsTest, EveryHomeGivesTheSameBits) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const Trained device = train(Tier::kDevice, dtype);
    ASSERT_EQ(device.losses.size(), 6u);
    EXPECT_EQ(device.plan.checkpoints, Tier::kDevice);
    for (Tier home : {Tier::kHost, Tier::kNvme}) {
      SCOPED_TRACE(std::string(tier_name(home)));
      const Trained off = train(home, dtype);
      EXPECT_EQ(off.plan.checkpoints, home);
      EXPECT_EQ(off.losses, device.losses);  // bit for bit
      EXPECT_TRUE(off.master == device.master) << "master weights differ";
      // The activations really went down and came back: each one written to the host once per
      // micro-batch and read back (all but the final hidden state, which the head reads in
      // place), and on NVMe each one through the drive as well.
      EXPECT_GT(off.stats.d2h_bytes, device.stats.d2h_bytes);
      EXPECT_GT(off.stats.h2d_bytes, device.stats.h2d_bytes);
      if (home == Tier::kNvme) {
        EXPECT_GT(off.stats.nvme_write_bytes, device.stats.nvme_write_bytes);
        EXPECT_GT(off.stats.nvme_read_bytes, device.stats.nvme_read_bytes);
      }
      // The plan counts them in their home, and three at a time on the device, each as the
      // store allocates a copy that NVMe reads and writes in place on the CPU backend (whole
      // 4096-byte blocks and one more to align them).
      EXPECT_GT(off.plan.kind_bytes(home, TensorKind::kActivations), 0u);
      // Beside the same workspace: all of them on the device, or three copies.
      const auto n = static_cast<std::uint64_t>(off.num_checkpoints);
      const std::uint64_t copy =
          align_up(off.checkpoint_bytes, io::kIoAlignBytes) + io::kIoAlignBytes;
      EXPECT_EQ(
          off.plan.kind_bytes(Tier::kDevice, TensorKind::kActivations) + n * off.checkpoint_bytes,
          device.plan.kind_bytes(Tier::kDevice, TensorKind::kActivations) +
              std::min<std::uint64_t>(3, n) * copy);
    }
  }
}

}  // namespace
}  // namespace strata::zero
