// The pipeline schedules: every stage runs each micro-batch's forward and backward of each of its
// chunks once, forward first, holding at most what 1F1B promises; all stages together never
// deadlock; and the simulated bubble is exactly the theory's for both (1F1B's makespan is
// (M + P - 1) (f + b); interleaving's P - 1 idle slots are of chunk size).
#include "strata/train/pipeline_schedule.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace strata::train {
namespace {

struct Case {
  PipelineSchedule schedule;
  PipelineShape shape;
};

std::string describe(const Case& c) {
  return std::string(pipeline_schedule_name(c.schedule)) + " P " + std::to_string(c.shape.stages) +
         " M " + std::to_string(c.shape.micro_batches) + " V " +
         std::to_string(c.shape.virtual_stages);
}

const Case kCases[] = {
    {PipelineSchedule::k1F1B, {1, 3, 1}},         {PipelineSchedule::k1F1B, {2, 4, 1}},
    {PipelineSchedule::k1F1B, {4, 8, 1}},         {PipelineSchedule::k1F1B, {4, 4, 1}},
    {PipelineSchedule::k1F1B, {4, 2, 1}},         {PipelineSchedule::k1F1B, {8, 16, 1}},
    {PipelineSchedule::kInterleaved, {2, 4, 2}},  {PipelineSchedule::kInterleaved, {4, 8, 2}},
    {PipelineSchedule::kInterleaved, {4, 4, 2}},  {PipelineSchedule::kInterleaved, {2, 6, 3}},
    {PipelineSchedule::kInterleaved, {4, 16, 4}},
};

TEST(PipelineScheduleTest, EveryStageRunsEachPassOnceForwardFirst) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(describe(c));
    ASSERT_TRUE(pipeline_shape_problems(c.schedule, c.shape).empty());
    for (int s = 0; s < c.shape.stages; ++s) {
      SCOPED_TRACE("stage " + std::to_string(s));
      const auto passes = stage_passes(c.schedule, c.shape, s);
      ASSERT_EQ(passes.size(),
                static_cast<std::size_t>(2 * c.shape.micro_batches * c.shape.virtual_stages));
      std::map<std::pair<int, int>, int> seen;  // (micro-batch, chunk) -> passes run
      for (const PipelinePass& p : passes) {
        ASSERT_GE(p.micro_batch, 0);
        ASSERT_LT(p.micro_batch, c.shape.micro_batches);
        ASSERT_GE(p.chunk, 0);
        ASSERT_LT(p.chunk, c.shape.virtual_stages);
        int& n = seen[{p.micro_batch, p.chunk}];
        EXPECT_EQ(n, p.forward ? 0 : 1) << "micro-batch " << p.micro_batch << " chunk " << p.chunk;
        ++n;
      }
      for (const auto& [key, n] : seen) EXPECT_EQ(n, 2);
      if (c.schedule == PipelineSchedule::k1F1B) {
        // 1F1B's memory promise: stage s holds at most P - s micro-batches' activations.
        EXPECT_EQ(peak_in_flight(passes), std::min(c.shape.stages - s, c.shape.micro_batches));
      }
    }
  }
}

// Every tensor a stage sends to another arrives in the order the receiver asks for it (the
// trainer posts each receive just before the pass that reads it): the order NCCL matches
// point-to-point operations in, with no tags.
TEST(PipelineScheduleTest, EachStageReceivesInTheOrderItsPeerSends) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(describe(c));
    const int p = c.shape.stages, last = c.shape.virtual_count() - 1;
    // (from, to) -> the messages in order: (gradient?, micro-batch, sender's virtual stage).
    std::map<std::pair<int, int>, std::vector<std::tuple<bool, int, int>>> sent, received;
    for (int s = 0; s < p; ++s) {
      for (const PipelinePass& pass : stage_passes(c.schedule, c.shape, s)) {
        const int v = pass.chunk * p + s;
        if (pass.forward) {
          if (v > 0) received[{(v - 1) % p, s}].emplace_back(false, pass.micro_batch, v - 1);
          if (v < last) sent[{s, (v + 1) % p}].emplace_back(false, pass.micro_batch, v);
        } else {
          if (v < last) received[{(v + 1) % p, s}].emplace_back(true, pass.micro_batch, v + 1);
          if (v > 0) sent[{s, (v - 1) % p}].emplace_back(true, pass.micro_batch, v);
        }
      }
    }
    EXPECT_EQ(sent, received);
  }
}

// Micro-batch m may use activation set m % peak_micro_batches: no two it holds at once share one.
TEST(PipelineScheduleTest, MicroBatchesHeldAtOnceNeverShareASlot) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(describe(c));
    for (int s = 0; s < c.shape.stages; ++s) {
      const auto passes = stage_passes(c.schedule, c.shape, s);
      const int slots = peak_micro_batches(passes);
      ASSERT_GE(slots, 1);
      ASSERT_LE(slots, c.shape.micro_batches);
      std::map<int, int> holder;  // slot -> the micro-batch in it
      for (const PipelinePass& pass : passes) {
        const int slot = pass.micro_batch % slots;
        if (pass.forward && pass.chunk == 0) {
          EXPECT_EQ(holder.count(slot), 0u) << "stage " << s << " micro-batch " << pass.micro_batch;
          holder[slot] = pass.micro_batch;
        } else {
          EXPECT_EQ(holder.at(slot), pass.micro_batch) << "stage " << s;
          if (!pass.forward && pass.chunk == 0) holder.erase(slot);
        }
      }
      if (c.schedule == PipelineSchedule::k1F1B) {
        EXPECT_EQ(slots, std::min(c.shape.stages - s, c.shape.micro_batches));
      }
    }
  }
}

TEST(PipelineScheduleTest, TheSimulatedBubbleIsTheTheorys) {
  for (const Case& c : kCases) {
    SCOPED_TRACE(describe(c));
    // A backward costs twice a forward; an interleaved chunk does 1/V of a stage's layers.
    const double v = c.shape.virtual_stages;
    auto t = simulate(c.schedule, c.shape, 1.0 / v, 2.0 / v);
    ASSERT_TRUE(t.is_ok()) << t.status().message();
    const double bubble = t->bubble(c.shape.stages);
    const double theory = theoretical_bubble(c.schedule, c.shape);
    if (c.schedule == PipelineSchedule::k1F1B) {
      EXPECT_NEAR(t->makespan, (c.shape.micro_batches + c.shape.stages - 1) * 3.0, 1e-9);
      EXPECT_NEAR(bubble, theory, 1e-12);
    } else {
      EXPECT_NEAR(bubble, theory, 1e-12);
      // Interleaving shrinks 1F1B's bubble for the same stages and micro-batches.
      PipelineShape plain = c.shape;
      plain.virtual_stages = 1;
      auto base = simulate(PipelineSchedule::k1F1B, plain, 1.0, 2.0);
      ASSERT_TRUE(base.is_ok());
      EXPECT_LT(bubble, base->bubble(c.shape.stages));
    }
  }
}

// The balanced split against every split of a few small models: no split has a cheaper costliest
// stage, every stage holds a layer, and the counts add up.
TEST(PipelineScheduleTest, BalancedStagesAreTheCheapestSplit) {
  struct Model {
    int layers, stages;
    double first, last;
  };
  for (const Model& m : {Model{8, 2, 0.1, 0.0}, Model{8, 4, 0.2, 2.5}, Model{7, 3, 0.0, 1.0},
                         Model{22, 4, 0.3, 3.2}, Model{5, 5, 0.5, 0.5}}) {
    SCOPED_TRACE(std::to_string(m.layers) + " layers, " + std::to_string(m.stages) + " stages");
    const std::vector<int> counts = balance_stages(m.layers, m.stages, 1.0, m.first, m.last);
    ASSERT_EQ(counts.size(), static_cast<std::size_t>(m.stages));
    int sum = 0;
    double worst = 0;
    for (int s = 0; s < m.stages; ++s) {
      const int k = counts[static_cast<std::size_t>(s)];
      EXPECT_GE(k, 1);
      sum += k;
      worst = std::max(worst, k + (s == 0 ? m.first : 0) + (s == m.stages - 1 ? m.last : 0));
    }
    EXPECT_EQ(sum, m.layers);
    // Every split: compositions of `layers` into `stages` positive parts.
    double best = 1e30;
    std::vector<int> split(static_cast<std::size_t>(m.stages), 1);
    const auto visit = [&](auto&& self, int s, int left) -> void {
      if (s == m.stages - 1) {
        split.back() = left;
        double w = 0;
        for (int i = 0; i < m.stages; ++i) {
          w = std::max(w, split[static_cast<std::size_t>(i)] + (i == 0 ? m.first : 0) +
                              (i == m.stages - 1 ? m.last : 0));
        }
        best = std::min(best, w);
        return;
      }
      for (int k = 1; k <= left - (m.stages - 1 - s); ++k) {
        split[static_cast<std::size_t>(s)] = k;
        self(self, s + 1, left - k);
      }
    };
    visit(visit, 0, m.layers);
    EXPECT_DOUBLE_EQ(worst, best);
  }
}

TEST(PipelineScheduleTest, ShapesThatCannotRunAreNamed) {
  const auto first = [](PipelineSchedule s, PipelineShape shape) {
    const auto p = pipeline_shape_problems(s, shape);
    return p.empty() ? std::string() : p.front();
  };
  EXPECT_NE(first(PipelineSchedule::k1F1B, {2, 4, 2}).find("virtual_stages 2"), std::string::npos);
  EXPECT_NE(first(PipelineSchedule::kInterleaved, {2, 4, 1}).find("needs 2 or more chunks"),
            std::string::npos);
  EXPECT_NE(first(PipelineSchedule::kInterleaved, {4, 6, 2}).find("use a multiple of 4"),
            std::string::npos);
  EXPECT_NE(first(PipelineSchedule::k1F1B, {0, 4, 1}).find("pipeline stages 0"), std::string::npos);
}

}  // namespace
}  // namespace strata::train
