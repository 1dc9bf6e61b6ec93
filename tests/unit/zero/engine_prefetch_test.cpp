// The one provider (one rank) over the tiered store: the model's passes are recorded and then
// prefetched from
// the trace without changing a bit of the result, the timeline gets every group's spans, and an
// NVMe fault surfaces as the step's error.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <thread>
#include <vector>

#include "strata/core/rng.h"
#include "strata/dist/communicator.h"
#include "strata/model/llama.h"
#include "strata/zero/zero_provider.h"
#include "tests/testing/backends.h"
#include "tests/testing/family_models.h"
#include "tests/testing/temp_dir.h"

namespace strata::zero {
namespace {

class EnginePrefetchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_.vocab_size = 31;
    config_.hidden_size = 16;
    config_.intermediate_size = 24;
    config_.num_hidden_layers = 3;
    config_.num_attention_heads = 2;
    config_.num_key_value_heads = 1;
    config_.max_position_embeddings = 16;
    layout_ = model::ParamLayout::build(config_);
    device_ = testing::make_cpu_device(4 << 20);
    ASSERT_NE(device_, nullptr);
  }
  void make(io::FaultInjection faults = {}, mem::Timeline* timeline = nullptr,
            OptimizerOverlap overlap = OptimizerOverlap::kNone, Tier optimizer = Tier::kHost,
            Tier params = Tier::kNvme) {
    provider_.reset();
    swap_ = testing::make_swap(std::move(faults), 1 << 20);  // one engine attempt per request
    ASSERT_NE(swap_, nullptr);
    ShardOptions o;
    o.offload_param = params;
    o.offload_optimizer = optimizer;
    o.accumulation_steps = accumulation_;  // passes repeat before a step
    o.prefetch_bytes = 1 << 20;
    o.max_live_bytes = 1 << 20;
    o.max_reuse_distance = 4096;
    o.timeline = timeline;
    o.overlap = overlap;
    o.host_memory_limit_bytes = host_limit_;
    o.schedule_chooser = chooser_;
    o.clock = clock_;
    grid_ = dist::ProcessGrid::single_rank(*device_);
    auto e = ZeroProvider::create(layout_, 100000, *device_, swap_.get(), *grid_, ZeroOptions{}, o);
    ASSERT_TRUE(e.is_ok()) << e.status().to_string();
    provider_ = std::move(*e);
    ASSERT_TRUE(provider_
                    ->load_master([&](const model::ParamGroup& g, float* dst) {
                      model::init_group(config_, g, 7, dst);
                      return Status::ok();
                    })
                    .is_ok());
    model_ = std::make_unique<model::LlamaModel>(config_, layout_, *device_, model::ModelOptions{});
  }
  // EIO on the first NVMe write after load_master's (one per group): the optimizer step's.
  io::FaultInjection write_error_after_loading() const {
    io::FaultRule r;
    r.op = io::FaultOp::kWrite;
    r.kind = io::FaultKind::kError;
    r.error = EIO;
    r.skip = static_cast<std::uint64_t>(layout_.num_groups());
    io::FaultInjection f;
    f.rules.push_back(r);
    return f;
  }
  Result<float> micro_batch(std::uint64_t seed) {
    Rng rng(seed);
    std::vector<std::int32_t> in(2 * 8), tg(in.size());
    for (auto& x : in) x = static_cast<std::int32_t>(rng.uniform_int(31));
    for (auto& x : tg) x = static_cast<std::int32_t>(rng.uniform_int(31));
    auto loss = model_->forward_backward(*provider_, in.data(), tg.data(), 2, 8, 1.0f);
    Status s = provider_->finish_micro_batch();
    if (!loss.is_ok()) return loss;
    if (!s.is_ok()) return s;
    return loss;
  }

  // One step of two micro-batches, the second announced as the step's last (a guess may start
  // with it), then the step with `scale` (0: skipped, as for a non-finite norm).
  Status train_step(int step, float scale) {
    for (std::uint64_t mb = 0; mb < 2; ++mb) {
      if (mb == 1) provider_->begin_last_micro_batch(1e-2, step, true);
      auto loss = micro_batch(10 * static_cast<std::uint64_t>(step) + mb);
      if (!loss.is_ok()) return loss.status();
    }
    return scale == 0.0f ? provider_->zero_grads() : provider_->step(1e-2, step, scale);
  }

  std::uint64_t host_limit_ = 0;         // make()'s host_memory_limit
  std::int64_t accumulation_ = 2;        // make()'s micro-batches a step
  ScheduleChooserOptions chooser_;       // make()'s, for OptimizerOverlap::kAuto
  std::function<std::int64_t()> clock_;  // make()'s step-cycle clock (nullptr: the real one)
  model::LlamaConfig config_;
  model::ParamLayout layout_;
  std::unique_ptr<device::Device> device_;
  std::unique_ptr<io::SwapSpace> swap_;
  std::unique_ptr<dist::ProcessGrid> grid_;
  std::unique_ptr<ZeroProvider> provider_;
  std::unique_ptr<model::LlamaModel> model_;
};

TEST_F(EnginePrefetchTest, ReplayedPassesPrefetchAndComputeTheSameBits) {
  mem::Timeline timeline(/*record_spans=*/true);
  make({}, &timeline);
  auto first = micro_batch(1);
  ASSERT_TRUE(first.is_ok()) << first.status().to_string();
  sched::SchedulerStats st = provider_->shards().prefetch_stats();
  EXPECT_EQ(st.recorded_passes, 1u);
  EXPECT_EQ(st.trace_prefetches, 0u);
  auto second = micro_batch(1);  // same data, nothing stepped: the same loss, bit for bit
  ASSERT_TRUE(second.is_ok());
  EXPECT_EQ(*second, *first);
  st = provider_->shards().prefetch_stats();
  EXPECT_GT(st.trace_prefetches, 0u);
  EXPECT_EQ(st.order_changes, 0u);
  EXPECT_EQ(st.recorded_passes, 1u);
  EXPECT_GT(st.kept, 0u);  // the last layer between its forward and its backward
  // A group in the trace is fetched on demand only at the head of the pass.
  EXPECT_LE(st.demand_fetches, 2u * static_cast<std::uint64_t>(layout_.num_groups()));
  const mem::StoreStats ss = provider_->shards().store_stats();
  EXPECT_EQ(ss.failures, 0u);
  EXPECT_GT(provider_->stats().nvme_read_bytes, 0u);
  EXPECT_GT(provider_->stats().d2h_bytes, 0u);
  // Every group ran forward and backward on the compute row; NVMe reads have their own row.
  int forward = 0, backward = 0, nvme = 0;
  for (const mem::Span& s : timeline.spans()) {
    if (s.lane == mem::Lane::kCompute && s.name.ends_with(" forward")) ++forward;
    if (s.lane == mem::Lane::kCompute && s.name.ends_with(" backward")) ++backward;
    if (s.lane == mem::Lane::kNvmeRead) ++nvme;
  }
  EXPECT_GE(forward, 2 * (config_.num_hidden_layers + 1));
  EXPECT_GE(backward, 2 * config_.num_hidden_layers);
  EXPECT_GT(nvme, 0);
}

// An MoE model's micro-batches route their tokens to other experts each time: the passes still
// follow the first one's trace (a layer's experts are one routed set in it), so the dense groups
// after each MoE layer are fetched ahead, and no pass is re-recorded. Experts no token chose are
// skipped.
TEST_F(EnginePrefetchTest, MoeLayersFollowTheTraceWhateverTheRouterChooses) {
  Json j = testing::family_model("qwen3-moe", 3);
  j["vocab_size"] = 31;
  auto c = model::LlamaConfig::from_json(j, "qwen3-moe");
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  config_ = *c;
  layout_ = model::ParamLayout::build(config_);
  accumulation_ = 4;  // four passes, one step's micro-batches
  make();
  std::int64_t skipped = 0;
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    auto loss = micro_batch(seed);
    ASSERT_TRUE(loss.is_ok()) << loss.status().to_string();
    skipped += model_->take_expert_traffic().skipped;
  }
  const sched::SchedulerStats st = provider_->shards().prefetch_stats();
  EXPECT_EQ(st.passes, 4u);
  EXPECT_EQ(st.recorded_passes, 1u);
  EXPECT_EQ(st.order_changes, 0u);
  EXPECT_GT(st.trace_prefetches, 0u);
  EXPECT_GT(skipped, 0) << "every micro-batch chose every expert: the test proves nothing";
}

TEST_F(EnginePrefetchTest, NvmeReadErrorFailsTheStepAndTheNextOneWorks) {
  io::FaultRule r;
  r.op = io::FaultOp::kRead;
  r.kind = io::FaultKind::kError;
  r.error = EIO;
  r.skip = 2;  // the third parameter fetch
  io::FaultInjection f;
  f.rules.push_back(r);
  make(std::move(f));
  auto loss = micro_batch(1);
  ASSERT_FALSE(loss.is_ok());
  EXPECT_EQ(loss.status().code(), StatusCode::kIoError) << loss.status().to_string();
  EXPECT_NE(loss.status().message().find("Input/output error"), std::string::npos)
      << loss.status().message();
  // The store is consistent: nothing held, and the next micro-batch (fault spent) runs.
  auto again = micro_batch(1);
  ASSERT_TRUE(again.is_ok()) << again.status().to_string();
}

// Four steps of two micro-batches each, under every schedule (the update beside the next
// forward on its own thread, beside the scheduler's prefetches of the updated working copies;
// or started beside backward as a guess), give the losses of the serial schedule bit for bit:
// a step that does not clip (the guess holds), one that clips (the guess is redone), one after
// it (not guessed), and one skipped (the guess is rolled back). tools/check.sh runs this under
// ThreadSanitizer.
TEST_F(EnginePrefetchTest, OverlappedStepsGiveTheSerialBits) {
  for (const Tier optimizer : {Tier::kHost, Tier::kNvme}) {
    SCOPED_TRACE(std::string("optimizer on ") + std::string(tier_name(optimizer)));
    std::vector<float> losses[kOptimizerOverlaps.size()];
    for (const OptimizerOverlap overlap : kOptimizerOverlaps) {
      make({}, nullptr, overlap, optimizer);
      auto& out = losses[static_cast<int>(overlap)];
      const float scales[] = {1.0f, 0.5f, 1.0f, 0.0f};
      for (int step = 1; step <= 4; ++step) {
        for (std::uint64_t mb = 0; mb < 2; ++mb) {
          if (mb == 1) provider_->begin_last_micro_batch(1e-2, step, true);
          auto loss = micro_batch(10 * static_cast<std::uint64_t>(step) + mb);
          ASSERT_TRUE(loss.is_ok()) << loss.status().to_string();
          out.push_back(*loss);
        }
        const float scale = scales[step - 1];
        const Status s =
            scale == 0.0f ? provider_->zero_grads() : provider_->step(1e-2, step, scale);
        ASSERT_TRUE(s.is_ok()) << s.to_string();
      }
      auto last = micro_batch(99);  // sees the third update
      ASSERT_TRUE(last.is_ok()) << last.status().to_string();
      out.push_back(*last);
      ASSERT_TRUE(provider_->finish_step().is_ok());
      const RankStats st = provider_->stats();
      // "auto" measures for more steps than these before it probes the serial schedule.
      if (overlap == OptimizerOverlap::kBackward || overlap == OptimizerOverlap::kAuto) {
        EXPECT_EQ(st.steps_guessed, 3u);  // not the one after the clipped step
        EXPECT_EQ(st.steps_redone, 1u);
        EXPECT_EQ(st.steps_rolled_back, 1u);
      } else {
        EXPECT_EQ(st.steps_guessed, 0u);
      }
      provider_.reset();
    }
    for (std::size_t i = 1; i < kOptimizerOverlaps.size(); ++i) {
      EXPECT_EQ(losses[i], losses[0]) << optimizer_overlap_name(kOptimizerOverlaps[i]);
    }
    EXPECT_NE(losses[0].front(), losses[0].back());  // the steps changed the weights
  }
}

// optimizer_overlap "auto" runs the overlapped schedule, probes the serial one and keeps the one
// whose step cycles measured faster, probing the other again after a hold. A test clock makes
// the serial cycles cheaper, then (from step 6) dearer: the steps go serial after the first
// probe and back to the overlapped schedule at the next. The switch to serial comes at a step
// whose guess was running and clips (so it is redone serially), and every loss is the serial
// schedule's, bit for bit.
TEST_F(EnginePrefetchTest, AutoRunsTheScheduleMeasuredFasterWithTheSerialBits) {
  std::int64_t now_ns = 0;
  clock_ = [&now_ns] { return now_ns; };
  chooser_.samples = 1;
  chooser_.hold_steps = 2;
  constexpr int kSteps = 10;
  const auto scale_of = [](int step) { return step == 3 ? 0.5f : 1.0f; };
  for (const Tier optimizer : {Tier::kHost, Tier::kNvme}) {
    SCOPED_TRACE(std::string("optimizer on ") + std::string(tier_name(optimizer)));
    std::vector<float> serial, automatic;
    std::vector<OptimizerOverlap> schedules;
    for (const OptimizerOverlap overlap : {OptimizerOverlap::kNone, OptimizerOverlap::kAuto}) {
      make({}, nullptr, overlap, optimizer);
      auto& out = overlap == OptimizerOverlap::kNone ? serial : automatic;
      for (int step = 1; step <= kSteps; ++step) {
        for (std::uint64_t mb = 0; mb < 2; ++mb) {
          if (mb == 1) provider_->begin_last_micro_batch(1e-2, step, true);
          auto loss = micro_batch(10 * static_cast<std::uint64_t>(step) + mb);
          ASSERT_TRUE(loss.is_ok()) << loss.status().to_string();
          out.push_back(*loss);
        }
        // The cycle ending now ran the last step's schedule.
        const bool was_serial = provider_->step_schedule() == OptimizerOverlap::kNone;
        now_ns += (was_serial == (step < 6)) ? 50'000'000 : 100'000'000;
        const Status s = provider_->step(1e-2, step, scale_of(step));
        ASSERT_TRUE(s.is_ok()) << s.to_string();
        if (overlap == OptimizerOverlap::kAuto) {
          schedules.push_back(provider_->step_schedule());
        }
      }
      auto last = micro_batch(99);
      ASSERT_TRUE(last.is_ok()) << last.status().to_string();
      out.push_back(*last);
      ASSERT_TRUE(provider_->finish_step().is_ok());
      if (overlap == OptimizerOverlap::kAuto) {
        const RankStats st = provider_->stats();
        // Steps 1-3, and 8-10 (step 7 runs overlapped but was not guessed: the step before it
        // was serial).
        EXPECT_EQ(st.steps_guessed, 6u);
        EXPECT_EQ(st.steps_redone, 1u) << "step 3";
      }
      provider_.reset();
    }
    const auto b = OptimizerOverlap::kBackward, n = OptimizerOverlap::kNone;
    const std::vector<OptimizerOverlap> expected = {b, b, n, n, n, n, b, b, b, b};
    EXPECT_EQ(schedules, expected);
    EXPECT_EQ(automatic, serial);
  }
}

// A guessed update starts as soon as its group's gradient is final, while the gradients of the
// groups before it are still to come: each group's update has ended (its span is in the
// timeline) before the next group's gradient is even released. Without a guess nothing
// updates before the step.
TEST_F(EnginePrefetchTest, AGuessedUpdateStartsBeforeBackwardEnds) {
  mem::Timeline timeline(/*record_spans=*/true);
  make({}, &timeline, OptimizerOverlap::kBackward, Tier::kNvme, Tier::kHost);
  ASSERT_TRUE(micro_batch(1).is_ok());
  provider_->begin_last_micro_batch(1e-2, 1, false);
  const auto updated = [&](int group) {
    const std::string name = "update (guessed) " + layout_.group(group).name;
    for (const mem::Span& sp : timeline.spans()) {
      if (sp.name == name) return true;
    }
    return false;
  };
  const int n = layout_.num_groups();
  for (int g = n - 1; g >= 0; --g) {
    auto grads = provider_->acquire_grads(g, model::GradientWrite::kAdd);
    ASSERT_TRUE(grads.is_ok()) << grads.status().to_string();
    ASSERT_TRUE(provider_->release_grads(g).is_ok());
    if (g + 1 < n) {
      // The accumulated gradient of g + 1 is final once g's came (one transfer is kept in
      // flight behind compute): its update ends without anything more from backward.
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (!updated(g + 1) && std::chrono::steady_clock::now() < give_up) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      ASSERT_TRUE(updated(g + 1)) << layout_.group(g + 1).name;
    }
    EXPECT_FALSE(updated(g)) << layout_.group(g).name << " updated before its gradient was final";
  }
  ASSERT_TRUE(provider_->finish_micro_batch().is_ok());
  ASSERT_TRUE(provider_->step(1e-2, 1, 1.0f).is_ok());
  ASSERT_TRUE(provider_->finish_step().is_ok());
  EXPECT_EQ(provider_->stats().steps_guessed, 1u);
}

// A write error in a guessed update (its state goes to the shadow copy) fails the step, and the
// state committed before it is intact: every group's master weights and moments read back as
// after the last good step, and the working copies the failed step wrote were restored.
TEST_F(EnginePrefetchTest, NvmeWriteErrorInAGuessedStepLeavesTheCommittedState) {
  // Where the fault goes: after the writes of loading and one good step, counted in a run
  // without faults (the same calls make the same writes).
  std::uint64_t writes_before = 0;
  {
    make({}, nullptr, OptimizerOverlap::kBackward, Tier::kNvme, Tier::kHost);
    ASSERT_TRUE(train_step(1, 1.0f).is_ok());
    ASSERT_TRUE(provider_->finish_step().is_ok());
    writes_before = swap_->stats().write_chunks;
  }
  io::FaultRule r;
  r.op = io::FaultOp::kWrite;
  r.kind = io::FaultKind::kError;
  r.error = EIO;
  r.skip = writes_before + 2;  // a few of the second step's writes pass
  io::FaultInjection f;
  f.rules.push_back(r);
  make(std::move(f), nullptr, OptimizerOverlap::kBackward, Tier::kNvme, Tier::kHost);
  ASSERT_TRUE(train_step(1, 1.0f).is_ok());
  ASSERT_TRUE(provider_->finish_step().is_ok());
  const int n = layout_.num_groups();
  std::vector<std::vector<float>> master(n), m(n), v(n);
  const auto read_state = [&](int g, std::vector<float>& ma, std::vector<float>& mm,
                              std::vector<float>& vv) {
    const auto elems = static_cast<std::size_t>(layout_.group(g).num_elems);
    ma.resize(elems);
    // The moments come as this rank's shard, padding included.
    mm.resize(static_cast<std::size_t>(provider_->partition().group(g).shard_elems));
    vv.resize(mm.size());
    ASSERT_TRUE(provider_->gather_master(g, ma.data()).is_ok());
    ASSERT_TRUE(provider_->read_moment_slice(g, mm.data(), vv.data()).is_ok());
  };
  for (int g = 0; g < n; ++g) read_state(g, master[g], m[g], v[g]);
  auto before = micro_batch(5);  // the committed weights' loss
  ASSERT_TRUE(before.is_ok());
  ASSERT_TRUE(provider_->zero_grads().is_ok());

  Status s = train_step(2, 1.0f);
  if (s.is_ok()) s = provider_->finish_step();
  ASSERT_FALSE(s.is_ok()) << "the write error was lost";
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s.to_string();
  EXPECT_GT(swap_->stats().faults_injected, 0u);
  for (int g = 0; g < n; ++g) {
    std::vector<float> ma, mm, vv;
    read_state(g, ma, mm, vv);
    EXPECT_EQ(ma, master[g]) << layout_.group(g).name;
    EXPECT_EQ(mm, m[g]) << layout_.group(g).name;
    EXPECT_EQ(vv, v[g]) << layout_.group(g).name;
  }
  auto after = micro_batch(5);  // the working copies are the committed weights again
  ASSERT_TRUE(after.is_ok()) << after.status().to_string();
  EXPECT_EQ(*after, *before);
}

// Under a host budget the working copies a step writes on their way to NVMe stay in host memory
// as clean copies, and the next forward takes them from there (host -> device moves); without
// a budget nothing is kept, and it reads NVMe.
TEST_F(EnginePrefetchTest, UnderAHostBudgetUpdatedWorkingCopiesStayInHostMemory) {
  for (const std::uint64_t limit : {std::uint64_t{0}, std::uint64_t{64} << 20}) {
    SCOPED_TRACE("host_memory_limit " + std::to_string(limit));
    host_limit_ = limit;
    make({}, nullptr, OptimizerOverlap::kBackward, Tier::kNvme);
    ASSERT_TRUE(train_step(1, 1.0f).is_ok());
    ASSERT_TRUE(provider_->finish_step().is_ok());
    const auto from_host = [&] {
      return provider_->shards().store_stats().bytes_moved[static_cast<int>(Tier::kHost)]
                                                          [static_cast<int>(Tier::kDevice)];
    };
    const std::uint64_t before = from_host();
    ASSERT_TRUE(micro_batch(3).is_ok());
    if (limit == 0) {
      EXPECT_EQ(from_host(), before);
    } else {
      EXPECT_GT(from_host(), before);
      EXPECT_LE(provider_->stats().host_bytes, limit);
    }
    provider_.reset();
  }
  host_limit_ = 0;
}

TEST_F(EnginePrefetchTest, NvmeWriteErrorFailsTheOptimizerStep) {
  make(write_error_after_loading());
  ASSERT_TRUE(micro_batch(1).is_ok());
  Status s = provider_->step(1e-3, 1, 1.0f);
  ASSERT_FALSE(s.is_ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError) << s.to_string();
}

// Overlapped, the step returns as soon as it has started; the failed write of a new working
// copy then ends the next micro-batch (its forward needs that copy) or whoever waits for the
// step first, with the I/O error, and nothing hangs.
TEST_F(EnginePrefetchTest, NvmeWriteErrorDuringAnOverlappedStepEndsTheNextPass) {
  make(write_error_after_loading(), nullptr, OptimizerOverlap::kForward);
  ASSERT_TRUE(micro_batch(1).is_ok());
  ASSERT_TRUE(provider_->step(1e-3, 1, 1.0f).is_ok());  // started, not finished
  auto next = micro_batch(2);
  Status step = provider_->finish_step();
  ASSERT_FALSE(next.is_ok() && step.is_ok()) << "the write error was lost";
  const Status& err = next.is_ok() ? step : next.status();
  EXPECT_EQ(err.code(), StatusCode::kIoError) << err.to_string();
}

}  // namespace
}  // namespace strata::zero
