// One rank's share (ShardStore, updated by its OptimizerSchedule, under a one-rank ZeroProvider):
// every placement stores, serves and updates the same numbers.
#include "strata/zero/shard_store.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <future>
#include <thread>
#include <vector>

#include "strata/core/rng.h"
#include "strata/dist/process_grid.h"
#include "strata/zero/zero_provider.h"
#include "tests/testing/backends.h"
#include "tests/testing/temp_dir.h"

namespace strata::zero {
namespace {

struct Placement {
  Tier param;
  Tier opt;
  DType dtype;
};

std::string name_of(const ::testing::TestParamInfo<Placement>& info) {
  return std::string(offload_name(info.param.param)) + "_" +
         std::string(offload_name(info.param.opt)) + "_" +
         std::string(dtype_name(info.param.dtype));
}

class ShardStoreTest : public ::testing::TestWithParam<Placement> {
 protected:
  void SetUp() override {
    config_.vocab_size = 19;
    config_.hidden_size = 8;
    config_.intermediate_size = 12;
    config_.num_hidden_layers = 2;
    config_.num_attention_heads = 2;
    config_.num_key_value_heads = 1;
    layout_ = model::ParamLayout::build(config_);
    device_ = testing::make_cpu_device(1 << 20);
    ASSERT_NE(device_, nullptr);
    if (GetParam().param == Tier::kNvme || GetParam().opt == Tier::kNvme) {
      swap_ = testing::make_swap({}, 1 << 20, dir_.path());  // files, the real engine
      ASSERT_NE(swap_, nullptr);
    }
    make_engine(1);
  }

  // `frozen`: the groups made frozen (no gradient, no optimizer state); `overlap`: the schedule.
  // `tp`: the layout of one tensor-parallel rank's slices.
  void make_engine(std::int64_t accumulation_steps, std::vector<int> frozen = {},
                   OptimizerOverlap overlap = OptimizerOverlap::kNone,
                   model::TensorParallel tp = {}, bool hold_state = false) {
    provider_.reset();
    std::vector<model::ParamGroup> groups =
        model::ParamLayout::build(config_, std::nullopt, false, tp).groups();
    for (int g : frozen) groups.at(static_cast<std::size_t>(g)).frozen = true;
    layout_ = model::ParamLayout::from_groups(std::move(groups));
    ShardOptions o;
    o.overlap = overlap;
    o.offload_param = GetParam().param;
    o.offload_optimizer = GetParam().opt;
    o.compute_dtype = GetParam().dtype;
    o.accumulation_steps = accumulation_steps;
    o.adam.weight_decay = 0.1;
    o.hold_state = hold_state;
    o.grad_accumulation = grad_accumulation_;
    if (!grid_) grid_ = dist::ProcessGrid::single_rank(*device_);
    auto e = ZeroProvider::create(layout_, 0, *device_, swap_.get(), *grid_, ZeroOptions{}, o);
    ASSERT_TRUE(e.is_ok()) << e.status().message();
    provider_ = std::move(*e);
  }

  // Loads master weights, checks the working copies, feeds `micro` micro-batches of gradients,
  // steps, and compares master weights and moments with the reference AdamW on the fp32 sum.
  // The groups in `silent_last` get no gradient in the last micro-batch (an expert no token
  // reached): their earlier ones still count.
  void check_step(int micro_batches, const std::vector<int>& silent_last = {});

  // The group's moments as read_moment_slice gives them: the rank's shard, whose padding beyond
  // the real elements must be zero; returned without it.
  void read_moments(int group, std::vector<float>* m, std::vector<float>* v) {
    const auto shard = static_cast<std::size_t>(provider_->partition().group(group).shard_elems);
    const auto real = static_cast<std::size_t>(layout_.group(group).num_elems);
    m->assign(shard, 1.0f);
    v->assign(shard, 1.0f);
    ASSERT_TRUE(provider_->read_moment_slice(group, m->data(), v->data()).is_ok());
    for (std::size_t i = real; i < shard; ++i) {
      ASSERT_EQ((*m)[i], 0.0f) << "padding " << i << " of group " << group;
      ASSERT_EQ((*v)[i], 0.0f) << "padding " << i << " of group " << group;
    }
    m->resize(real);
    v->resize(real);
  }

  std::vector<float> values(int group, std::uint64_t seed) {
    std::vector<float> v(static_cast<std::size_t>(layout_.group(group).num_elems));
    Rng rng(seed + static_cast<std::uint64_t>(group));
    for (auto& x : v) x = static_cast<float>(rng.normal());
    return v;
  }

  GradAccumulation grad_accumulation_ = GradAccumulation::kAuto;  // make_engine's
  testing::TempDir dir_;
  model::LlamaConfig config_;
  model::ParamLayout layout_;
  std::unique_ptr<device::Device> device_;
  std::unique_ptr<io::SwapSpace> swap_;
  std::unique_ptr<dist::ProcessGrid> grid_;
  std::unique_ptr<ZeroProvider> provider_;
};

void ShardStoreTest::check_step(int micro_batches, const std::vector<int>& silent_last) {
  const auto silent = [&](int micro, int g) {
    return micro == micro_batches - 1 &&
           std::find(silent_last.begin(), silent_last.end(), g) != silent_last.end();
  };
  const DType dtype = GetParam().dtype;
  ASSERT_TRUE(provider_
                  ->load_master([&](const model::ParamGroup& g, float* dst) {
                    auto v = values(g.id, 1);
                    std::copy(v.begin(), v.end(), dst);
                    return Status::ok();
                  })
                  .is_ok());
  // The working copy the model sees is the master weights in the compute dtype.
  for (int g = 0; g < layout_.num_groups(); ++g) {
    provider_->prefetch_params(g);
    auto p = provider_->acquire_params(g);
    ASSERT_TRUE(p.is_ok()) << p.status().message();
    const auto expect = values(g, 1);
    for (std::size_t i = 0; i < expect.size(); ++i) {
      const float want = dtype == DType::kF32 ? expect[i] : bf16_to_f32(f32_to_bf16(expect[i]));
      ASSERT_EQ(load_as_f32(*p, dtype, i), want) << "group " << g << " elem " << i;
    }
    provider_->release_params(g);
  }
  // Micro-batches of gradients accumulate in fp32 (one: the gradient is kept as it is).
  for (int micro = 0; micro < micro_batches; ++micro) {
    if (micro == micro_batches - 1) provider_->begin_last_micro_batch(1e-2, 1, true);
    for (int g = layout_.num_groups() - 1; g >= 0; --g) {
      if (layout_.group(g).frozen) {
        auto refused = provider_->acquire_grads(g, model::GradientWrite::kAdd);
        ASSERT_FALSE(refused.is_ok());
        EXPECT_NE(refused.status().message().find("'" + layout_.group(g).name + "' is frozen"),
                  std::string::npos)
            << refused.status().message();
        continue;
      }
      if (silent(micro, g)) continue;
      auto buf = provider_->acquire_grads(g, model::GradientWrite::kWrite);
      ASSERT_TRUE(buf.is_ok());
      // Written tensor by tensor, the buffer comes unfilled but for the gaps between tensors
      // (after the first micro-batch often memory that held the last one's gradient).
      for (const auto& [first, last] : layout_.group(g).gaps(layout_.group(g).num_elems)) {
        for (std::int64_t i = first; i < last; ++i) {
          ASSERT_EQ(load_as_f32(*buf, dtype, i), 0.0f) << "gap element " << i << " of group " << g;
        }
      }
      const auto grad = values(g, 100 + static_cast<std::uint64_t>(micro));
      convert(grad.data(), DType::kF32, *buf, dtype, grad.size());
      ASSERT_TRUE(provider_->release_grads(g).is_ok());
    }
    ASSERT_TRUE(provider_->finish_micro_batch().is_ok());
  }
  double sq = 0;
  std::vector<std::vector<float>> acc(static_cast<std::size_t>(layout_.num_groups()));
  for (int g = 0; g < layout_.num_groups(); ++g) {
    auto& s = acc[static_cast<std::size_t>(g)];
    s.assign(static_cast<std::size_t>(layout_.group(g).num_elems), 0.0f);
    for (int micro = 0; micro < micro_batches && !layout_.group(g).frozen; ++micro) {
      if (silent(micro, g)) continue;
      const auto a = values(g, 100 + static_cast<std::uint64_t>(micro));
      for (std::size_t i = 0; i < a.size(); ++i) {
        s[i] += dtype == DType::kF32 ? a[i] : bf16_to_f32(f32_to_bf16(a[i]));
      }
    }
    // Tensor-parallel duplicates count on another rank.
    const auto counted = static_cast<std::size_t>(layout_.group(g).duplicate_begin);
    for (std::size_t i = 0; i < counted; ++i) sq += static_cast<double>(s[i]) * s[i];
  }
  auto norm = provider_->grad_norm();
  ASSERT_TRUE(norm.is_ok());
  EXPECT_NEAR(*norm, std::sqrt(sq), 1e-9 * std::sqrt(sq));

  ASSERT_TRUE(provider_->step(1e-2, 1, 0.5f).is_ok());
  for (int g = 0; g < layout_.num_groups(); ++g) {
    auto p = values(g, 1);
    std::vector<float> m(p.size()), v(p.size());
    if (layout_.group(g).frozen) {  // untouched: its working copy widened, no moments
      for (float& x : p) x = dtype == DType::kF32 ? x : bf16_to_f32(f32_to_bf16(x));
      std::vector<float> got(p.size()), gm, gv;
      ASSERT_TRUE(provider_->gather_master(g, got.data()).is_ok());
      read_moments(g, &gm, &gv);
      EXPECT_EQ(got, p) << "frozen group " << g;
      EXPECT_EQ(gm, m);
      EXPECT_EQ(gv, v);
      continue;
    }
    device::AdamWArgs a =
        optim::make_adamw_args(optim::AdamWHyper{1e-2, 0.9, 0.999, 1e-8, 0.1, true}, 1e-2, 1, 0.5f);
    a.param = p.data();
    a.grad = acc[static_cast<std::size_t>(g)].data();
    a.exp_avg = m.data();
    a.exp_avg_sq = v.data();
    a.n = static_cast<std::int64_t>(p.size());
    device::adamw_reference(a);
    std::vector<float> got(p.size()), gm, gv;
    ASSERT_TRUE(provider_->gather_master(g, got.data()).is_ok());
    read_moments(g, &gm, &gv);
    EXPECT_EQ(got, p) << "group " << g;
    EXPECT_EQ(gm, m);
    EXPECT_EQ(gv, v);
  }
  // Gradients were zeroed by the step.
  auto zero = provider_->grad_norm();
  ASSERT_TRUE(zero.is_ok());
  EXPECT_EQ(*zero, 0.0);
}

TEST_P(ShardStoreTest, ServesMasterAsWorkingCopyAndUpdatesLikeTheReference) {
  check_step(1);  // the gradient kept as made, wherever the plan keeps gradients
}

TEST_P(ShardStoreTest, AccumulatesMicroBatchesInFp32) {
  make_engine(3);
  check_step(3);
}

// The embedding and the head frozen (a base under trainable layers): their weights stay, their
// gradients are refused by name, and the trainable groups step like the reference, under the
// serial schedule and (off the device) a guess beside backward that clipping makes redo.
TEST_P(ShardStoreTest, FrozenGroupsKeepTheirWeightsAndRefuseGradients) {
  const int head = layout_.num_groups() - 1;
  make_engine(1, {0, head});
  check_step(1);
  if (GetParam().opt == Tier::kDevice) return;
  make_engine(2, {0, head}, OptimizerOverlap::kBackward);
  check_step(2);
}

// One tensor-parallel rank's slices (rank 1 of 2: its norms, and the kv head it shares with
// rank 0, are duplicates): the gradient norm leaves the duplicates out wherever the gradients
// are summed (on the device, kept, on the host, beside a guessed update).
TEST_P(ShardStoreTest, TensorParallelDuplicatesAreLeftOutOfTheNorm) {
  config_.vocab_size = 20;
  make_engine(1, {}, OptimizerOverlap::kNone, {2, 1});
  std::int64_t duplicates = 0;
  for (const auto& g : layout_.groups()) duplicates += g.num_elems - g.duplicate_begin;
  ASSERT_GT(duplicates, 0);
  check_step(1);
  make_engine(3, {}, OptimizerOverlap::kNone, {2, 1});
  check_step(3);
  if (GetParam().opt == Tier::kDevice) return;
  make_engine(2, {}, OptimizerOverlap::kBackward, {2, 1});
  check_step(2);
}

// A group whose gradient stops before the last micro-batch (a mixture-of-experts expert no
// token reached) keeps what it accumulated: in its update and in the norm, wherever the
// gradients are summed, serially and beside a guessed update.
TEST_P(ShardStoreTest, AGroupSilentInTheLastMicroBatchKeepsItsEarlierGradients) {
  make_engine(2);
  check_step(2, {1, 3});
  if (GetParam().opt == Tier::kDevice) return;
  for (GradAccumulation where : {GradAccumulation::kHost, GradAccumulation::kDevice}) {
    grad_accumulation_ = where;
    make_engine(2, {}, OptimizerOverlap::kBackward);
    check_step(2, {1, 3});
  }
}

TEST_P(ShardStoreTest, ASecondGradientWithoutAccumulationIsAnError) {
  if (GetParam().opt == Tier::kDevice) GTEST_SKIP() << "the device optimizer always accumulates";
  const int g = layout_.num_groups() - 1;
  for (int micro = 0; micro < 2; ++micro) {
    auto buf = provider_->acquire_grads(g, model::GradientWrite::kAdd);
    if (micro == 1) {
      ASSERT_FALSE(buf.is_ok());
      EXPECT_NE(buf.status().message().find("accumulation"), std::string::npos)
          << buf.status().message();
      return;
    }
    ASSERT_TRUE(buf.is_ok());
    ASSERT_TRUE(provider_->release_grads(g).is_ok());
    ASSERT_TRUE(provider_->finish_micro_batch().is_ok());
  }
}

TEST_P(ShardStoreTest, MomentsRoundTrip) {
  ASSERT_TRUE(
      provider_
          ->load_moments([&](int g, std::int64_t begin, std::int64_t count, float* m, float* v) {
            EXPECT_EQ(begin, 0);
            EXPECT_EQ(count, layout_.group(g).num_elems);
            const auto em = values(g, 7), ev = values(g, 8);
            std::copy(em.begin(), em.end(), m);
            std::copy(ev.begin(), ev.end(), v);
            return Status::ok();
          })
          .is_ok());
  for (int g = 0; g < layout_.num_groups(); ++g) {
    const auto m = values(g, 7), v = values(g, 8);
    std::vector<float> m2, v2;
    read_moments(g, &m2, &v2);
    EXPECT_EQ(m, m2);
    EXPECT_EQ(v, v2);
  }
}

// The state held for an asynchronous save (ZeroProvider::hold_state): three more steps commit
// while it is held (the first writes the shadow copy, the others alternate with the third copy,
// never the held one), then another thread reads it: the state as it was held.
TEST_P(ShardStoreTest, HeldStateReadsAsHeldWhileStepsRun) {
  if (GetParam().opt == Tier::kDevice)
    GTEST_SKIP() << "save_async needs the optimizer off the device";
  make_engine(1, {}, OptimizerOverlap::kNone, {}, /*hold_state=*/true);
  ASSERT_TRUE(provider_->plan().shadow_state);
  check_step(1);
  const int n = layout_.num_groups();
  std::vector<std::vector<float>> master(n), m(n), v(n);
  for (int g = 0; g < n; ++g) {
    master[g].resize(static_cast<std::size_t>(layout_.group(g).num_elems));
    ASSERT_TRUE(provider_->gather_master(g, master[g].data()).is_ok());
    read_moments(g, &m[g], &v[g]);
  }
  ASSERT_TRUE(provider_->hold_state().is_ok());
  std::vector<std::vector<float>> got_master(n), got_m(n), got_v(n);
  std::promise<void> stepped;
  std::thread reader([&, ready = stepped.get_future()] {
    ready.wait();
    const StateSnapshot held{true, nullptr};
    for (int g = 0; g < n; ++g) {
      const auto shard = static_cast<std::size_t>(provider_->partition().group(g).shard_elems);
      got_master[g].resize(static_cast<std::size_t>(layout_.group(g).num_elems));
      got_m[g].resize(shard);
      got_v[g].resize(shard);
      EXPECT_TRUE(provider_->gather_master(g, got_master[g].data(), held).is_ok());
      EXPECT_TRUE(provider_->read_moment_slice(g, got_m[g].data(), got_v[g].data(), held).is_ok());
      got_m[g].resize(m[g].size());
      got_v[g].resize(v[g].size());
    }
    provider_->release_state();
  });
  for (int step = 2; step <= 4; ++step) {
    provider_->begin_last_micro_batch(1e-2, step, true);
    for (int g = n - 1; g >= 0; --g) {
      auto buf = provider_->acquire_grads(g, model::GradientWrite::kWrite);
      ASSERT_TRUE(buf.is_ok());
      const auto grad = values(g, 200 + static_cast<std::uint64_t>(step));
      convert(grad.data(), DType::kF32, *buf, GetParam().dtype, grad.size());
      ASSERT_TRUE(provider_->release_grads(g).is_ok());
    }
    ASSERT_TRUE(provider_->finish_micro_batch().is_ok());
    ASSERT_TRUE(provider_->grad_norm().is_ok());
    ASSERT_TRUE(provider_->step(1e-2, step, 1.0f).is_ok());
    ASSERT_TRUE(provider_->finish_step().is_ok());
  }
  stepped.set_value();
  reader.join();
  for (int g = 0; g < n; ++g) {
    EXPECT_EQ(got_master[g], master[g]) << "group " << g;
    EXPECT_EQ(got_m[g], m[g]) << "group " << g;
    EXPECT_EQ(got_v[g], v[g]) << "group " << g;
  }
  // The state moved on: three steps later the live master weights are not the held ones.
  std::vector<float> now(master[1].size());
  ASSERT_TRUE(provider_->gather_master(1, now.data()).is_ok());
  EXPECT_NE(now, master[1]);
}

INSTANTIATE_TEST_SUITE_P(Placements, ShardStoreTest,
                         ::testing::Values(Placement{Tier::kDevice, Tier::kDevice, DType::kF32},
                                           Placement{Tier::kDevice, Tier::kHost, DType::kF32},
                                           Placement{Tier::kHost, Tier::kHost, DType::kBF16},
                                           Placement{Tier::kNvme, Tier::kHost, DType::kF32},
                                           Placement{Tier::kDevice, Tier::kNvme, DType::kBF16},
                                           Placement{Tier::kNvme, Tier::kNvme, DType::kF32},
                                           Placement{Tier::kDevice, Tier::kDevice, DType::kBF16}),
                         name_of);

TEST(ShardStoreErrors, ParamOffloadNeedsOptimizerOffload) {
  model::LlamaConfig c;
  auto layout = model::ParamLayout::build(c);
  auto dev = device::create_device(device::DeviceOptions{});
  ASSERT_TRUE(dev.is_ok());
  ShardOptions o;
  o.offload_param = Tier::kHost;
  auto grid = dist::ProcessGrid::single_rank(**dev);
  auto e = ZeroProvider::create(layout, 0, **dev, nullptr, *grid, ZeroOptions{}, o);
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.status().message().find("needs offload_optimizer"), std::string::npos);
}

TEST(ShardStoreErrors, GroupLargerThanDeviceBudgetNamesIt) {
  model::LlamaConfig c;  // embedding group: 256 x 128 floats = 128 KiB
  auto layout = model::ParamLayout::build(c);
  auto dev = testing::make_cpu_device(100 * 1024);
  ASSERT_NE(dev, nullptr);
  ShardOptions o;
  o.offload_param = Tier::kHost;
  o.offload_optimizer = Tier::kHost;
  auto grid = dist::ProcessGrid::single_rank(*dev);
  auto e = ZeroProvider::create(layout, 0, *dev, nullptr, *grid, ZeroOptions{}, o);
  ASSERT_FALSE(e.is_ok());
  EXPECT_NE(e.status().message().find("'embed'"), std::string::npos) << e.status().message();
  EXPECT_NE(e.status().message().find("device_memory_limit"), std::string::npos);
}

}  // namespace
}  // namespace strata::zero
