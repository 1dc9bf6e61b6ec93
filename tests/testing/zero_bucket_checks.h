// ZeroProvider's bucketed collectives, checked on one rank of any group (tests/mpi under mpirun,
// tests/unit/zero with in-process ranks): with reduce and all-gather buckets that split large
// groups and coalesce small ones, every rank gathers exactly the parameters and reduces exactly
// the gradients that one collective per group gives, in as many collectives as the bucket plan
// says and with the same communication volume; and stage 3's gather-ahead is decided alike on
// every rank under a tight device budget.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "strata/core/rng.h"
#include "strata/device/device.h"
#include "strata/dist/communicator.h"
#include "strata/dist/process_grid.h"
#include "strata/zero/bucket.h"
#include "strata/zero/partition.h"
#include "strata/zero/shard_store.h"
#include "strata/zero/zero_provider.h"

namespace strata::zero::bucket_checks {

// One rank's device and grid (data-parallel over every rank of the group).
struct Rank {
  device::Device& device;
  dist::ProcessGrid& grid;
};

// Group sizes (elements): large ones split by a small bucket, small ones coalesced, and three
// below the persistence threshold that stay whole on every rank (all-reduced, not scattered).
inline const std::vector<std::int64_t> kGroupElems = {3000, 130, 5000, 70, 900, 12000, 40, 40, 600};
constexpr std::int64_t kPersistenceThreshold = 100;

inline float param_value(int group, std::int64_t i) {
  Rng rng(static_cast<std::uint64_t>(group) * 7919u + static_cast<std::uint64_t>(i));
  return static_cast<float>(rng.normal());
}
// The gradient rank r produces in micro-batch mb: known to every rank, so each can check sums.
inline float grad_value(int mb, int rank, int group, std::int64_t i) {
  Rng rng(static_cast<std::uint64_t>(mb) * 1000003u + static_cast<std::uint64_t>(rank) * 104729u +
          static_cast<std::uint64_t>(group) * 65537u + static_cast<std::uint64_t>(i));
  return static_cast<float>(rng.normal());
}

// One group per kGroupElems entry, named g0, g1, ...
inline model::ParamLayout make_layout() {
  std::vector<model::ParamGroup> groups;
  for (std::size_t g = 0; g < kGroupElems.size(); ++g) {
    model::ParamGroup pg;
    pg.name = "g" + std::to_string(g);
    pg.num_elems = kGroupElems[g];
    groups.push_back(std::move(pg));
  }
  return model::ParamLayout::from_groups(std::move(groups));
}

struct Run {
  model::ParamLayout layout;
  std::unique_ptr<ZeroProvider> provider;
};

inline std::unique_ptr<Run> make_run(Rank& e, int stage, std::uint64_t reduce_bytes,
                                     std::uint64_t gather_bytes) {
  auto run = std::make_unique<Run>();
  run->layout = make_layout();
  ShardOptions eo;
  eo.accumulation_steps = 2;  // two micro-batches a step
  eo.adam.beta1 = 0.5;        // the first step's exp_avg is then exactly half the gradient
  eo.adam.weight_decay = 0.0;
  ZeroOptions zo;
  zo.stage = stage;
  zo.reduce_bucket_bytes = reduce_bytes;
  zo.allgather_bucket_bytes = gather_bytes;
  auto provider =
      ZeroProvider::create(run->layout, kPersistenceThreshold, e.device, nullptr, e.grid, zo, eo);
  EXPECT_TRUE(provider.is_ok()) << provider.status().message();
  if (!provider.is_ok()) return nullptr;
  run->provider = std::move(*provider);
  return run;
}

// Collectives the provider should issue for one backward (groups released last to first): runs
// of partitioned and of replicated groups are bucketed separately, each with its own blocks.
inline std::int64_t expected_reduce_collectives(const Partition& part, std::uint64_t reduce_bytes) {
  const int world = part.world();
  if (world == 1) return 0;
  std::int64_t n = 0;
  std::vector<std::pair<int, std::int64_t>> run;
  bool run_partitioned = false;
  auto close = [&] {
    if (run.empty()) return;
    n += static_cast<std::int64_t>(
        plan_buckets(run, bucket_cap_elems(reduce_bytes, 4, run_partitioned ? world : 1)).size());
    run.clear();
  };
  for (int g = static_cast<int>(part.groups().size()) - 1; g >= 0; --g) {
    const GroupPartition& p = part.group(g);
    if (p.replicated != !run_partitioned) close();
    run_partitioned = !p.replicated;
    run.emplace_back(g, p.replicated ? p.full_elems : p.shard_elems);
  }
  close();
  return n;
}

// Stage 3: all-gathers of one pass over the parameters (one per cap-sized range of each shard).
inline std::int64_t expected_gather_collectives(const Partition& part, std::uint64_t gather_bytes) {
  const std::int64_t cap = bucket_cap_elems(gather_bytes, 4, part.world());
  std::int64_t n = 0;
  for (const auto& p : part.groups()) {
    if (!p.replicated) n += (p.shard_elems + cap - 1) / cap;
  }
  return n;
}

// Stages 1-2: all-gathers of the re-gather after a step (shards coalesced into buckets).
inline std::int64_t expected_refresh_collectives(const Partition& part,
                                                 std::uint64_t gather_bytes) {
  std::vector<std::pair<int, std::int64_t>> shards;
  for (const auto& p : part.groups()) {
    if (!p.replicated) shards.emplace_back(p.group, p.shard_elems);
  }
  if (shards.empty()) return 0;
  return static_cast<std::int64_t>(
      plan_buckets(shards, bucket_cap_elems(gather_bytes, 4, part.world())).size());
}

// What one configuration observed on this rank.
struct Observed {
  std::vector<std::vector<float>> exp_avg;  // per group: this rank's slice after one step
  std::uint64_t reduce_collectives = 0, reduce_bytes = 0;
  std::uint64_t gather_collectives = 0, gather_bytes = 0;
};

inline void expect_params(ZeroProvider& provider, const Partition& part, int group) {
  auto p = provider.acquire_params(group);
  ASSERT_TRUE(p.is_ok()) << p.status().message();
  const auto* v = static_cast<const float*>(*p);
  for (std::int64_t i = 0; i < part.group(group).full_elems; ++i) {
    ASSERT_EQ(v[i], param_value(group, i)) << "group " << group << " element " << i;
  }
  provider.release_params(group);
}

inline Observed train_one_step(Rank& e, int stage, std::uint64_t reduce_bytes,
                               std::uint64_t gather_bytes) {
  dist::Communicator& comm = e.grid.data();
  const dist::CommStats& stats = comm.stats();
  Observed obs;
  auto run = make_run(e, stage, reduce_bytes, gather_bytes);
  if (!run) return obs;
  ZeroProvider& provider = *run->provider;
  const Partition& part = run->provider->partition();
  const int num_groups = static_cast<int>(kGroupElems.size());

  const std::uint64_t c0 = stats.collectives, g0 = stats.all_gather_bytes;
  EXPECT_TRUE(provider
                  .load_master([](const model::ParamGroup& g, float* dst) {
                    for (std::int64_t i = 0; i < g.num_elems; ++i) dst[i] = param_value(g.id, i);
                    return Status::ok();
                  })
                  .is_ok());
  if (stage < 3) {
    EXPECT_EQ(static_cast<std::int64_t>(stats.collectives - c0),
              expected_refresh_collectives(part, gather_bytes));
    for (int g = 0; g < num_groups; ++g) expect_params(provider, part, g);
  } else {
    // A forward pass that prefetches the next group while checking this one.
    provider.prefetch_params(0);
    for (int g = 0; g < num_groups; ++g) {
      if (g + 1 < num_groups) provider.prefetch_params(g + 1);
      expect_params(provider, part, g);
    }
    EXPECT_EQ(static_cast<std::int64_t>(stats.collectives - c0),
              expected_gather_collectives(part, gather_bytes));
  }
  obs.gather_collectives = stats.collectives - c0;
  obs.gather_bytes = stats.all_gather_bytes - g0;

  // Two micro-batches of backward, last group first, as the model releases them.
  const std::uint64_t r0 = stats.collectives;
  // Partitioned groups reduce-scatter; replicated ones are all-gathered and summed on each rank.
  const std::uint64_t b0 = stats.reduce_scatter_bytes + stats.all_gather_bytes;
  for (int mb = 0; mb < 2; ++mb) {
    for (int g = num_groups - 1; g >= 0; --g) {
      // Written whole, so unfilled: the padding past the group, reduced with it, still zeros.
      auto buf = provider.acquire_grads(g, model::GradientWrite::kWrite);
      EXPECT_TRUE(buf.is_ok()) << buf.status().message();
      if (!buf.is_ok()) return obs;
      auto* grad = static_cast<float*>(*buf);
      if (!part.group(g).replicated) {
        for (std::int64_t i = part.group(g).full_elems; i < part.group(g).padded_elems; ++i) {
          EXPECT_EQ(grad[i], 0.0f) << "padding element " << i << " of group " << g;
        }
      }
      for (std::int64_t i = 0; i < part.group(g).full_elems; ++i) {
        grad[i] = grad_value(mb, comm.rank(), g, i);
      }
      EXPECT_TRUE(provider.release_grads(g).is_ok());
    }
    EXPECT_TRUE(provider.finish_micro_batch().is_ok());
  }
  obs.reduce_collectives = stats.collectives - r0;
  obs.reduce_bytes = stats.reduce_scatter_bytes + stats.all_gather_bytes - b0;
  EXPECT_EQ(static_cast<std::int64_t>(obs.reduce_collectives),
            2 * expected_reduce_collectives(part, reduce_bytes));

  EXPECT_TRUE(provider.step(1e-3, 1, 1.0f).is_ok());
  for (int g = 0; g < num_groups; ++g) {
    const GroupPartition& p = part.group(g);
    std::vector<float> m(static_cast<std::size_t>(p.shard_elems)), v(m.size());
    EXPECT_TRUE(provider.read_moment_slice(g, m.data(), v.data()).is_ok());
    obs.exp_avg.push_back(std::move(m));
  }
  if (stage < 3) {
    // The re-gather after the step hands every rank the updated parameters, as rank 0's master.
    for (int g = 0; g < num_groups; ++g) {
      const GroupPartition& p = part.group(g);
      std::vector<float> master(comm.rank() == 0 ? static_cast<std::size_t>(p.full_elems) : 0);
      EXPECT_TRUE(provider.gather_master(g, master.data()).is_ok());
      auto params = provider.acquire_params(g);
      EXPECT_TRUE(params.is_ok());
      if (!params.is_ok()) return obs;
      std::vector<float> mine(static_cast<const float*>(*params),
                              static_cast<const float*>(*params) + p.full_elems);
      provider.release_params(g);
      std::vector<float> root = mine;
      EXPECT_TRUE(comm.broadcast(root.data(), p.full_elems, DType::kF32, 0, "test").wait().is_ok());
      EXPECT_EQ(mine, root) << "group " << g << ": ranks disagree on the re-gathered parameters";
      if (comm.rank() == 0) {
        EXPECT_EQ(mine, master) << "group " << g;
      }
    }
  }
  return obs;
}

struct Caps {
  const char* name;
  std::uint64_t reduce_bytes;
  std::uint64_t gather_bytes;
};
// tiny: every group split into many collectives; small: large groups split and small ones
// coalesced; large: everything coalesced (the defaults).
inline const Caps kCaps[] = {{"tiny", 256, 512},
                             {"small", 8 << 10, 6 << 10},
                             {"large", kDefaultReduceBucketBytes, kDefaultAllgatherBucketBytes}};

// One step at every bucket size gives the same values and volume, in as many collectives as
// the bucket plan says.
inline void check_bucket_sizes(Rank& e, int stage) {
  dist::Communicator& comm = e.grid.data();
  const int world = comm.world_size();
  const int rank = comm.rank();
  std::map<std::string, Observed> seen;
  for (const Caps& caps : kCaps) {
    SCOPED_TRACE(std::string("buckets ") + caps.name);
    seen[caps.name] = train_one_step(e, stage, caps.reduce_bytes, caps.gather_bytes);
    if (::testing::Test::HasFatalFailure()) return;
  }
  // The reduced gradients against a serial reference: exp_avg = gradient / 2 after one step.
  const Observed& ref = seen["large"];
  ASSERT_EQ(ref.exp_avg.size(), kGroupElems.size());
  for (int g = 0; g < static_cast<int>(kGroupElems.size()); ++g) {
    const std::int64_t unit = world * kShardAlignElems;
    const std::int64_t shard = (kGroupElems[g] + unit - 1) / unit * unit / world;
    const std::int64_t begin = rank * shard;  // this rank's slice, replicated groups' too
    const auto& got = ref.exp_avg[static_cast<std::size_t>(g)];
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(got.size()); ++i) {
      const std::int64_t j = begin + i;
      float want = 0.0f;
      double abs_sum = 0.0;
      if (j < kGroupElems[g]) {
        for (int mb = 0; mb < 2; ++mb) {
          float sum = 0.0f;
          for (int r = 0; r < world; ++r) {
            sum += grad_value(mb, r, g, j);
            abs_sum += std::abs(grad_value(mb, r, g, j));
          }
          want += sum;
        }
      }
      // Two ranks sum in the one possible order; more may pair the ranks differently. Either
      // side's f32 sum of 2 * world terms rounds 2 * world - 1 times, each at most 2^-24 of
      // sum |terms|.
      const double tol = world <= 2 ? 0.0 : 2.0 * (2 * world - 1) * 0x1p-24 * abs_sum;
      ASSERT_NEAR(2.0 * got[static_cast<std::size_t>(i)], want, tol)
          << "group " << g << " element " << j;
    }
  }
  for (const Caps& caps : kCaps) {
    SCOPED_TRACE(std::string("buckets ") + caps.name);
    const Observed& o = seen[caps.name];
    EXPECT_EQ(o.reduce_bytes, ref.reduce_bytes) << "bucketing changed the reduction volume";
    EXPECT_EQ(o.gather_bytes, ref.gather_bytes) << "bucketing changed the all-gather volume";
    if (world <= 2) {
      EXPECT_EQ(o.exp_avg, ref.exp_avg) << "not bitwise equal to one bucket per group";
    }
  }
  if (world > 1) {
    // Fewer collectives than groups with large buckets, more with tiny ones.
    const auto groups = static_cast<std::uint64_t>(kGroupElems.size());
    EXPECT_LT(seen["large"].reduce_collectives, 2 * groups);
    EXPECT_GT(seen["tiny"].reduce_collectives, 2 * groups);
    EXPECT_LT(seen["large"].reduce_collectives, seen["small"].reduce_collectives);
    EXPECT_LT(seen["small"].reduce_collectives, seen["tiny"].reduce_collectives);
    EXPECT_GT(seen["tiny"].gather_collectives, seen["large"].gather_collectives);
    if (stage < 3) {
      EXPECT_EQ(seen["large"].gather_collectives, 1u);
    }
  } else {
    for (const auto& [name, o] : seen) EXPECT_EQ(o.reduce_collectives, 0u) << name;
  }
}

// Stage 3's gather-ahead under a device budget that holds one group's gather at a time for the
// largest group, but not that and the group before it: every rank must start or skip each
// prefetched all-gather alike (a rank that skipped one the others issued would hang them), and
// the decision must not depend on how far each rank's transfers have got, so the ranks' timing
// is made to differ. The parameters still arrive exactly.
inline void check_gather_ahead(Rank& e) {
  dist::Communicator& comm = e.grid.data();
  const int world = comm.world_size();
  if (world < 2) return;  // one rank gathers nothing
  const int rank = comm.rank();
  const model::ParamLayout layout = make_layout();
  const Partition part(layout, {rank, world}, kPersistenceThreshold);
  int largest = 0;
  for (int g = 0; g < layout.num_groups(); ++g) {
    if (part.group(g).padded_elems > part.group(largest).padded_elems) largest = g;
  }
  ASSERT_GT(largest, 0);
  ASSERT_FALSE(part.group(largest - 1).replicated);
  auto bytes = [&](int g) {  // one gather's device bytes: the full group and this rank's shard
    const GroupPartition& p = part.group(g);
    return static_cast<std::uint64_t>(p.padded_elems + p.shard_elems) * sizeof(float);
  };
  // Room for the largest gather plus less than the group before it holds while gathered ahead.
  const std::uint64_t margin = bytes(largest - 1) / 2;
  device::DeviceOptions dopts;
  dopts.memory_limit_bytes = bytes(largest) + margin;
  auto device = device::create_device(dopts);
  ASSERT_TRUE(device.is_ok());
  ShardOptions eo;
  eo.offload_param = Tier::kHost;  // shards arrive by asynchronous fetches from the host
  eo.offload_optimizer = Tier::kHost;
  ZeroOptions zo;
  auto provider =
      ZeroProvider::create(layout, kPersistenceThreshold, **device, nullptr, e.grid, zo, eo);
  ASSERT_TRUE(provider.is_ok()) << provider.status().message();
  ZeroProvider& zp = **provider;
  ASSERT_TRUE(zp.load_master([](const model::ParamGroup& g, float* dst) {
                  for (std::int64_t i = 0; i < g.num_elems; ++i) dst[i] = param_value(g.id, i);
                  return Status::ok();
                }).is_ok());
  Rng jitter(static_cast<std::uint64_t>(rank) + 1);
  const int num_groups = layout.num_groups();
  for (int pass = 0; pass < 3; ++pass) {
    zp.prefetch_params(0);
    for (int g = 0; g < num_groups; ++g) {
      std::this_thread::sleep_for(std::chrono::microseconds(jitter.uniform_int(300)));
      if (g + 1 < num_groups) zp.prefetch_params(g + 1);
      expect_params(zp, part, g);
      if (::testing::Test::HasFatalFailure()) return;
    }
    ASSERT_TRUE(zp.finish_micro_batch().is_ok());
  }
  const RankStats st = zp.stats();
  EXPECT_GT(st.gathers_ahead, 0u);
  EXPECT_GT(st.gathers_ahead_refused, 0u) << "the budget no longer refuses the largest group";
  const std::vector<float> mine = {static_cast<float>(st.gathers_ahead),
                                   static_cast<float>(st.gathers_ahead_refused)};
  std::vector<float> root = mine;
  ASSERT_TRUE(comm.broadcast(root.data(), 2, DType::kF32, 0, "test").wait().is_ok());
  EXPECT_EQ(mine, root) << "rank " << rank << " started other all-gathers ahead than rank 0";
}

}  // namespace strata::zero::bucket_checks
