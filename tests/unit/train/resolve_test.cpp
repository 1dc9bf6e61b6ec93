// resolve_config: the one place a config is resolved for a run and for strata estimate (the grid,
// the placement, {rank} paths, this rank's plan), and the line both print.
#include "strata/train/resolve.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "strata/device/device.h"
#include "strata/dist/communicator.h"

namespace strata::train {
namespace {

ResolveOptions opts(int world, int rank, dist::Communicator* comm = nullptr) {
  ResolveOptions o;
  o.world = world;
  o.rank = rank;
  o.comm = comm;
  return o;
}

TrainConfig config_of(const Json& changes = Json::object()) {
  Json j = Json::parse(R"({"model": {"vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
                           "num_hidden_layers": 2, "num_attention_heads": 4,
                           "max_position_embeddings": 64},
                           "data": {"path": "x.txt", "format": "text"},
                           "seq_len": 16, "batch_size": 8, "micro_batch_size": 2,
                           "offload_param": "cpu", "offload_optimizer": "cpu",
                           "save_dir": "", "threads": 1})");
  j.merge_patch(changes);
  auto c = parse_train_config(j, "test.json");
  EXPECT_TRUE(c.is_ok()) << c.status().message();
  return c.is_ok() ? *c : TrainConfig{};
}

// {rank} in metrics_file and trace_file becomes the rank; a path without it is rank 0's alone.
// The plan is the rank's own, and the line says the grid, the tiers and the accumulation.
TEST(ResolveConfig, RankPathsThePlanAndTheLineAreTheRanks) {
  const TrainConfig c =
      config_of({{"metrics_file", "metrics-{rank}.jsonl"}, {"trace_file", "trace.json"}});
  for (const int rank : {0, 1}) {
    SCOPED_TRACE(rank);
    auto r = resolve_config(c, opts(2, rank));
    ASSERT_TRUE(r.is_ok()) << r.status().message();
    EXPECT_EQ(r->config.metrics_file, "metrics-" + std::to_string(rank) + ".jsonl");
    EXPECT_EQ(r->config.trace_file, rank == 0 ? "trace.json" : "");
    EXPECT_EQ(r->planned.rank, rank);
    EXPECT_EQ(r->planned.ranks, 2);
    EXPECT_EQ(r->shape.data, 2);
    EXPECT_TRUE(r->choices.empty());
    EXPECT_FALSE(r->rates.has_value()) << "nothing was \"auto\": no probe";
    EXPECT_EQ(r->describe(),
              "resolved: data 2 x tensor 1 x pipeline 1 | offload param cpu, optimizer cpu | 2 "
              "micro-batches of 2 a step on each data-parallel rank, gradients summed on the "
              "host\n");
  }
  auto one = resolve_config(config_of({{"micro_batch_size", 8}}), opts(1, 0));
  ASSERT_TRUE(one.is_ok()) << one.status().message();
  EXPECT_NE(one->describe().find("1 micro-batch of 8 a step on each data-parallel rank, gradients "
                                 "summed nowhere (one micro-batch: kept as computed)"),
            std::string::npos)
      << one->describe();
}

// A run checks its grid against its ranks in its own words; an estimate leaves it to the plan,
// which names --ranks.
TEST(ResolveConfig, ARunChecksItsGridAgainstItsRanks) {
  const TrainConfig c = config_of({{"tensor_parallel_size", 2}});
  auto device = device::create_device({});
  ASSERT_TRUE(device.is_ok()) << device.status().message();
  const std::unique_ptr<dist::Communicator> comm = dist::make_single_rank_communicator(**device);
  auto run = resolve_config(c, opts(1, 0, comm.get()));
  ASSERT_FALSE(run.is_ok());
  EXPECT_EQ(run.status().message(), "tensor_parallel_size 2 must divide the 1 ranks this run has");
  auto estimate = resolve_config(c, opts(1, 0));
  ASSERT_FALSE(estimate.is_ok());
  EXPECT_NE(
      estimate.status().message().find("--ranks 1 must be a multiple of tensor_parallel_size"),
      std::string::npos)
      << estimate.status().message();
}

// "auto" tiers: the rates measured once, the choice applied and said.
TEST(ResolveConfig, AutoPlacementIsChosenAppliedAndSaid) {
  auto r = resolve_config(config_of({{"offload_param", "auto"}, {"offload_optimizer", "auto"}}),
                          opts(1, 0));
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  ASSERT_TRUE(r->rates.has_value());
  ASSERT_EQ(r->choices.size(), 1u);
  EXPECT_EQ(r->choices[0].rfind("placement: ", 0), 0u) << r->choices[0];
  EXPECT_EQ(r->describe().rfind(r->choices[0] + "\nresolved: ", 0), 0u) << r->describe();
  EXPECT_EQ(r->planned.plan.params, r->config.offload_param);
}

}  // namespace
}  // namespace strata::train
