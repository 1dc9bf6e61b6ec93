// The memory plan: which tier each kind of tensor gets, from the placements and the budgets, the
// bytes it counts, and the errors when they cannot work.
#include "strata/zero/plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "strata/core/json.h"
#include "strata/device/nf4.h"
#include "strata/zero/partition.h"

namespace strata::zero {
namespace {

// TinyLlama's shape at 2 layers: large enough that gradients outweigh the staging.
model::LlamaConfig tiny_llama() {
  model::LlamaConfig c;
  c.vocab_size = 32000;
  c.hidden_size = 2048;
  c.intermediate_size = 5632;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 32;
  c.num_key_value_heads = 4;
  return c;
}

model::ParamLayout layout() { return model::ParamLayout::build(tiny_llama()); }

PlanOptions nvme_options() {
  PlanOptions o;
  o.params = Tier::kNvme;
  o.optimizer = Tier::kNvme;
  o.compute_dtype = DType::kBF16;
  o.has_swap = true;
  return o;
}

std::uint64_t sum_bytes(const model::ParamLayout& l, std::size_t elem_bytes) {
  std::uint64_t s = 0;
  for (const auto& g : l.groups()) {
    s += (static_cast<std::uint64_t>(g.num_elems) * elem_bytes + 4095) / 4096 * 4096;
  }
  return s;
}

TEST(PlanTest, OffloadNamesAreTheConfigs) {
  EXPECT_EQ(offload_name(Tier::kDevice), "none");
  EXPECT_EQ(offload_name(Tier::kHost), "cpu");
  EXPECT_EQ(offload_name(Tier::kNvme), "nvme");
}

// ZeRO's own device buffers are the plan's too: none on one rank; on two, stages 1-2 hold every
// partitioned group's full parameters, stage 3 at least the two largest groups gathered at once
// (the one in use and the one ahead), and each is part of the device's peak, not of its homes.
TEST(PlanTest, CollectiveBuffersArePartOfTheDevicePeak) {
  const auto l = layout();
  PlanOptions o;
  o.compute_dtype = DType::kBF16;
  auto one = make_plan(l, o);
  ASSERT_TRUE(one.is_ok()) << one.status().message();
  EXPECT_EQ(one->collective_bytes, 0u);
  EXPECT_EQ(
      one->peak(Tier::kDevice),
      one->tier_bytes(Tier::kDevice) + one->cache_bytes[static_cast<std::size_t>(Tier::kDevice)]);
  EXPECT_EQ(one->describe().find("collective"), std::string::npos);

  std::vector<std::uint64_t> full;  // each group's full parameters on two ranks, largest first
  const Partition two_ranks(l, {0, 2}, 0);
  for (const auto& g : two_ranks.groups())
    full.push_back(static_cast<std::uint64_t>(g.padded_elems) * 2);
  std::sort(full.rbegin(), full.rend());
  std::uint64_t all = 0;
  for (std::uint64_t b : full) all += b;
  for (int stage : {1, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    o.zero.stage = stage;
    auto plan = make_plan(two_ranks, o);
    ASSERT_TRUE(plan.is_ok()) << plan.status().message();
    EXPECT_GE(plan->collective_bytes, stage < 3 ? all : full[0] + full[1]);
    EXPECT_EQ(plan->peak(Tier::kDevice), plan->tier_bytes(Tier::kDevice) + plan->collective_bytes);
    EXPECT_NE(
        plan->describe().find("ZeRO's collective buffers " + format_bytes(plan->collective_bytes)),
        std::string::npos)
        << plan->describe();
  }
}

TEST(PlanTest, EveryHomeIsCountedOnceInItsTier) {
  const auto l = layout();
  auto plan = make_plan(l, nvme_options());
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  EXPECT_EQ(plan->gradients, Tier::kHost);  // no host limit: gradients stay in memory
  EXPECT_TRUE(plan->keep_gradients);        // one micro-batch, step off the device
  EXPECT_EQ(plan->kind_bytes(Tier::kNvme, TensorKind::kParameters), sum_bytes(l, 2));
  EXPECT_EQ(plan->kind_bytes(Tier::kNvme, TensorKind::kMasterWeights), sum_bytes(l, 4));
  EXPECT_EQ(plan->kind_bytes(Tier::kNvme, TensorKind::kMoments), 2 * sum_bytes(l, 4));
  EXPECT_EQ(plan->kind_bytes(Tier::kHost, TensorKind::kGradients), sum_bytes(l, 2));
  EXPECT_GT(plan->optimizer_staging_bytes, 0u);
  EXPECT_NE(plan->describe().find("gradients kept as computed on host"), std::string::npos)
      << plan->describe();
}

// Frozen groups (a base under adapters) keep a working copy and nothing else: no gradient, no
// master weights, no moments, and their own group needs no gradient's room on the device.
TEST(PlanTest, FrozenGroupsHoldOnlyTheirWorkingCopies) {
  const model::ParamLayout all = layout();
  std::vector<model::ParamGroup> groups = all.groups();
  for (auto& g : groups) g.frozen = g.id != 1;  // only layers.0 trains
  const model::ParamLayout part = model::ParamLayout::from_groups(groups);
  const model::ParamLayout trained = model::ParamLayout::from_groups({all.group(1)});
  for (const PlanOptions& o : {nvme_options(), PlanOptions{}}) {
    auto plan = make_plan(part, o);
    auto reference = make_plan(trained, o);
    ASSERT_TRUE(plan.is_ok() && reference.is_ok()) << plan.status().message();
    const Tier opt = o.optimizer;
    EXPECT_EQ(plan->kind_bytes(o.params, TensorKind::kParameters),
              o.params == Tier::kDevice
                  ? static_cast<std::uint64_t>(all.total_elems()) * dtype_size(o.compute_dtype)
                  : sum_bytes(all, dtype_size(o.compute_dtype)));
    EXPECT_EQ(plan->kind_bytes(opt, TensorKind::kMasterWeights),
              reference->kind_bytes(opt, TensorKind::kMasterWeights));
    EXPECT_EQ(plan->kind_bytes(opt, TensorKind::kMoments),
              reference->kind_bytes(opt, TensorKind::kMoments));
    for (Tier t : {Tier::kDevice, Tier::kHost, Tier::kNvme}) {
      EXPECT_EQ(plan->kind_bytes(t, TensorKind::kGradients),
                reference->kind_bytes(t, TensorKind::kGradients))
          << tier_name(t);
    }
  }
  // Every group frozen (generation): the parameters may live off the device without an
  // optimizer to take there, and a group needs only its own room on the device.
  for (auto& g : groups) g.frozen = true;
  const model::ParamLayout none = model::ParamLayout::from_groups(groups);
  PlanOptions o;
  o.params = Tier::kHost;
  std::int64_t largest = 0;
  for (const auto& g : none.groups()) largest = std::max(largest, g.num_elems);
  o.device_budget_bytes = static_cast<std::uint64_t>(largest) * 4 + 1;  // no room for a gradient
  auto plan = make_plan(none, o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  EXPECT_EQ(plan->kind_bytes(Tier::kDevice, TensorKind::kGradients), 0u);
  EXPECT_EQ(plan->kind_bytes(Tier::kHost, TensorKind::kMasterWeights), 0u);
}

// LoRA's base anywhere: with the optimizer on the device, offload_param places the frozen groups
// and the trained ones stay on the device beside their optimizer; with nothing frozen it would
// place nothing, and is refused.
TEST(PlanTest, AFrozenBaseGoesWhereOffloadParamSaysWithTheOptimizerOnTheDevice) {
  auto groups = layout().groups();
  for (auto& g : groups) g.frozen = true;
  groups[1].frozen = false;  // one trained group, as adapters are
  const model::ParamLayout mixed = model::ParamLayout::from_groups(groups);
  for (Tier base : {Tier::kHost, Tier::kNvme}) {
    PlanOptions o;
    o.params = base;
    o.has_swap = true;
    auto plan = make_plan(mixed, o);
    ASSERT_TRUE(plan.is_ok()) << plan.status().message();
    EXPECT_EQ(plan->params, base);
    EXPECT_EQ(plan->trained_params, Tier::kDevice);
    EXPECT_EQ(plan->home_of(true), base);
    EXPECT_EQ(plan->home_of(false), Tier::kDevice);
    std::uint64_t frozen_io = 0, largest_frozen = 0;
    for (const auto& g : groups) {
      if (!g.frozen) continue;
      const auto bytes = static_cast<std::uint64_t>(g.num_elems) * 4;
      frozen_io += (bytes + 4095) / 4096 * 4096;
      largest_frozen = std::max(largest_frozen, bytes);
    }
    // In host memory beside the base: the trained group's copy on its way to the device when
    // loaded, two at a time.
    const std::uint64_t trained_io =
        (static_cast<std::uint64_t>(groups[1].num_elems) * 4 + 4095) / 4096 * 4096;
    EXPECT_EQ(plan->kind_bytes(base, TensorKind::kParameters),
              frozen_io + (base == Tier::kHost ? 2 * trained_io : 0));
    EXPECT_EQ(plan->kind_bytes(Tier::kDevice, TensorKind::kParameters),
              static_cast<std::uint64_t>(groups[1].num_elems) * 4);
    // The optimizer and the sums stay on the device; only frozen groups are fetched there.
    EXPECT_EQ(plan->kind_bytes(Tier::kDevice, TensorKind::kMasterWeights),
              static_cast<std::uint64_t>(groups[1].num_elems) * 4);
    EXPECT_EQ(plan->gradients, Tier::kDevice);
    EXPECT_EQ(plan->group_in_use_bytes, largest_frozen);
    EXPECT_NE(plan->describe().find("(the trained ones on device)"), std::string::npos)
        << plan->describe();
  }
  for (auto& g : groups) g.frozen = false;
  PlanOptions o;
  o.params = Tier::kHost;
  auto refused = make_plan(model::ParamLayout::from_groups(groups), o);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("needs offload_optimizer"), std::string::npos);
}

TEST(PlanTest, TheModelsWorkspaceIsCountedOnTheDeviceOnly) {
  const model::ParamLayout l = layout();
  PlanOptions o = nvme_options();
  auto without = make_plan(l, o);
  o.activation_bytes = 123 << 20;
  auto with = make_plan(l, o);
  ASSERT_TRUE(without.is_ok() && with.is_ok());
  EXPECT_EQ(with->kind_bytes(Tier::kDevice, TensorKind::kActivations), 123u << 20);
  EXPECT_EQ(with->tier_bytes(Tier::kDevice), without->tier_bytes(Tier::kDevice) + (123u << 20));
  EXPECT_EQ(with->tier_bytes(Tier::kHost), without->tier_bytes(Tier::kHost));
  EXPECT_NE(with->kinds_text(Tier::kDevice).find("activations 123.00 MiB"), std::string::npos)
      << with->kinds_text(Tier::kDevice);
}

TEST(PlanTest, AShortHostBudgetMovesGradientsToNvmeAndTheHostNoLongerGrowsWithThem) {
  const auto l = layout();
  for (std::int64_t accumulation : {1, 4}) {
    SCOPED_TRACE("accumulation_steps " + std::to_string(accumulation));
    PlanOptions o = nvme_options();
    o.accumulation_steps = accumulation;
    o.grad_accumulation = GradAccumulation::kHost;
    auto roomy = make_plan(l, o);
    ASSERT_TRUE(roomy.is_ok());
    o.host_budget_bytes = roomy->tier_bytes(Tier::kHost) - 1;
    auto tight = make_plan(l, o);
    ASSERT_TRUE(tight.is_ok()) << tight.status().message();
    EXPECT_EQ(tight->gradients, Tier::kNvme);
    EXPECT_EQ(tight->keep_gradients, accumulation == 1);
    EXPECT_LE(tight->tier_bytes(Tier::kHost), o.host_budget_bytes);
    // Kept bf16 gradients, or four micro-batches' fp32 sums in the canonical tree (two buffers).
    EXPECT_EQ(tight->kind_bytes(Tier::kNvme, TensorKind::kGradients),
              sum_bytes(l, accumulation == 1 ? 2 : 8));
    // What stays on the host is bounded by the largest groups, not their number.
    EXPECT_LT(tight->kind_bytes(Tier::kHost, TensorKind::kGradients),
              tight->kind_bytes(Tier::kNvme, TensorKind::kGradients));
  }
}

TEST(PlanTest, AccumulationUsesFp32AccumulatorsBesideTheOptimizer) {
  const auto l = layout();
  PlanOptions o;
  o.compute_dtype = DType::kBF16;
  o.accumulation_steps = 2;
  o.grad_accumulation = GradAccumulation::kHost;
  for (Tier opt : {Tier::kDevice, Tier::kHost}) {
    o.optimizer = opt;
    auto plan = make_plan(l, o);
    ASSERT_TRUE(plan.is_ok());
    EXPECT_FALSE(plan->keep_gradients);
    EXPECT_FALSE(plan->accumulate_on_device());
    EXPECT_EQ(plan->gradients, opt);
  }
  o.optimizer = Tier::kDevice;
  o.accumulation_steps = 1;  // the device optimizer always accumulates in fp32
  EXPECT_FALSE(make_plan(l, o)->keep_gradients);
}

// offload_optimizer_fraction: the groups whose gradients are final first in backward (the head,
// the last layers) go to the optimizer's tier while at least half of each falls within the
// fraction; the rest keep their master weights, moments and fp32 sums on the device, one copy
// (the shadow state is the offloaded groups' alone), and the plan counts them there.
TEST(PlanTest, AFractionOfTheOptimizerStaysOnTheDeviceForTheGroupsBackwardEndsWith) {
  const auto l = layout();
  PlanOptions o;
  o.compute_dtype = DType::kBF16;
  o.optimizer = Tier::kHost;
  o.accumulation_steps = 2;
  o.grad_accumulation = GradAccumulation::kHost;
  o.overlap = OptimizerOverlap::kBackward;
  const auto whole = make_plan(l, o);
  ASSERT_TRUE(whole.is_ok());
  EXPECT_TRUE(whole->device_steps.empty());
  EXPECT_EQ(whole->offload_fraction, 1.0);
  const auto io = [](std::uint64_t b) { return (b + 4095) / 4096 * 4096; };
  const auto& groups = l.groups();
  for (const double fraction : {0.0, 0.25, 0.5, 0.75}) {
    SCOPED_TRACE("offload_fraction " + std::to_string(fraction));
    o.offload_fraction = fraction;
    const auto plan = make_plan(l, o);
    ASSERT_TRUE(plan.is_ok()) << plan.status().message();
    ASSERT_EQ(plan->device_steps.size(), groups.size());
    std::uint64_t on_device = 0, offloaded = 0, host_master = 0, total = 0;
    for (std::size_t i = groups.size(); i-- > 0;) {
      const auto n = static_cast<std::uint64_t>(groups[i].num_elems);
      total += n;
      if (plan->device_steps[i]) {
        on_device += n;
        EXPECT_EQ(plan->optimizer_of(i), Tier::kDevice);
        EXPECT_EQ(plan->home_of(i, false), Tier::kDevice);
        EXPECT_FALSE(plan->shadowed(i));
      } else {
        // Backward order: once a group stays, so do all before it.
        EXPECT_TRUE(on_device == 0) << "group " << i << " offloaded after one kept";
        offloaded += n;
        host_master += io(4 * n);
        EXPECT_EQ(plan->optimizer_of(i), Tier::kHost);
        EXPECT_TRUE(plan->shadowed(i));
      }
    }
    // Each group goes where at least half of it falls: the share is within half the largest
    // group of the fraction asked for.
    std::uint64_t largest = 0;
    for (const auto& g : groups) largest = std::max<std::uint64_t>(largest, g.num_elems);
    EXPECT_NEAR(static_cast<double>(offloaded), fraction * static_cast<double>(total),
                static_cast<double>(largest) / 2);
    EXPECT_DOUBLE_EQ(plan->offload_fraction,
                     static_cast<double>(offloaded) / static_cast<double>(total));
    EXPECT_EQ(plan->any_device_steps(), on_device != 0);
    // The kept state, one copy on the device; the offloaded state with its shadow on the host,
    // beside the loading pass's one group of fp32 master weights.
    EXPECT_EQ(plan->kind_bytes(Tier::kDevice, TensorKind::kMasterWeights), 4 * on_device);
    EXPECT_EQ(plan->kind_bytes(Tier::kDevice, TensorKind::kMoments), 8 * on_device);
    EXPECT_GE(plan->kind_bytes(Tier::kDevice, TensorKind::kGradients),
              static_cast<std::uint64_t>(plan->accumulators) * 4 * on_device);
    std::uint64_t max_f32 = 0;
    for (const auto& g : groups) max_f32 = std::max(max_f32, io(4 * g.num_elems));
    EXPECT_EQ(plan->kind_bytes(Tier::kHost, TensorKind::kMasterWeights),
              2 * host_master + (on_device != 0 ? max_f32 : 0));
    EXPECT_LT(plan->tier_bytes(Tier::kHost), whole->tier_bytes(Tier::kHost));
    EXPECT_GT(plan->tier_bytes(Tier::kDevice), whole->tier_bytes(Tier::kDevice));
    EXPECT_NE(plan->describe().find("stepped there"), std::string::npos) << plan->describe();
  }
  // Every group kept on the device under fraction 0; the head alone offloaded at a small one.
  o.offload_fraction = 0.0;
  EXPECT_TRUE(std::all_of(make_plan(l, o)->device_steps.begin(),
                          make_plan(l, o)->device_steps.end(), [](bool d) { return d; }));
  // save_async sets the state aside in the optimizer's tier: refused with part of it kept.
  o.offload_fraction = 0.5;
  o.hold_state = true;
  const auto held = make_plan(l, o);
  ASSERT_FALSE(held.is_ok());
  EXPECT_NE(held.status().message().find("offload_optimizer_fraction"), std::string::npos)
      << held.status().message();
  // With the optimizer on the device the fraction has nothing to split.
  o.hold_state = false;
  o.optimizer = Tier::kDevice;
  o.overlap = OptimizerOverlap::kNone;
  EXPECT_TRUE(make_plan(l, o)->device_steps.empty());
}

// Several micro-batches with the optimizer off a GPU: where the device budget holds the fp32
// sums beside everything else they are homed there and go to host memory once per step (the
// plan counts them in both tiers and says so); where it does not, "auto" sums in host memory and
// "device" is refused, naming the bytes. On the CPU backend "auto" never sums on the device.
TEST(PlanTest, GradientsAreSummedOnTheDeviceWhereItsBudgetHoldsThem) {
  const auto l = layout();
  PlanOptions o;
  o.params = Tier::kHost;
  o.optimizer = Tier::kHost;
  o.compute_dtype = DType::kBF16;
  o.accumulation_steps = 4;
  o.device_budget_bytes = std::uint64_t{64} << 30;
  auto plan = make_plan(l, o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  EXPECT_TRUE(plan->accumulate_on_device());
  EXPECT_EQ(plan->gradients, Tier::kDevice);
  // The sums' homes on the device (two fp32 buffers a group: four micro-batches summed in the
  // canonical tree hold a pair's sum while the next pair is made), their copies for the step in
  // host memory, and one widened gradient on the device.
  std::uint64_t f32 = 0;
  for (const auto& g : l.groups()) f32 += static_cast<std::uint64_t>(g.num_elems) * 4;
  EXPECT_EQ(plan->accumulators, 2);
  EXPECT_EQ(plan->kind_bytes(Tier::kDevice, TensorKind::kGradients),
            2 * f32 + plan->gradient_transit_bytes);
  EXPECT_EQ(plan->kind_bytes(Tier::kHost, TensorKind::kGradients), sum_bytes(l, 4));
  EXPECT_GT(plan->kind_bytes(Tier::kDevice, TensorKind::kStaging), 0u);
  EXPECT_NE(plan->describe().find("accumulated in fp32 (the canonical tree: 2 partial sums a "
                                  "group at once) on device, sent to host once per step"),
            std::string::npos)
      << plan->describe();

  // A budget a little short of that: summed in host memory, or refused when asked for.
  const std::uint64_t needed = plan->tier_bytes(Tier::kDevice) + plan->group_in_use_bytes;
  o.device_budget_bytes = needed - 1;
  plan = make_plan(l, o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  EXPECT_FALSE(plan->accumulate_on_device());
  EXPECT_EQ(plan->gradients, Tier::kHost);
  o.grad_accumulation = GradAccumulation::kDevice;
  plan = make_plan(l, o);
  ASSERT_FALSE(plan.is_ok());
  EXPECT_EQ(plan.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(
      plan.status().message().find("grad_accumulation 'device' needs " + format_bytes(needed)),
      std::string::npos)
      << plan.status().message();

  // The CPU backend: only when asked for.
  o.device_budget_bytes = 0;
  o.host_addressable_device = true;
  o.grad_accumulation = GradAccumulation::kAuto;
  EXPECT_FALSE(make_plan(l, o)->accumulate_on_device());
  o.grad_accumulation = GradAccumulation::kDevice;
  EXPECT_TRUE(make_plan(l, o)->accumulate_on_device());
  // One micro-batch per step: gradients are kept as computed, nothing is summed.
  o.accumulation_steps = 1;
  plan = make_plan(l, o);
  EXPECT_FALSE(plan->accumulate_on_device());
  EXPECT_TRUE(plan->keep_gradients);
}

// optimizer_overlap "backward" needs the shadow state: a second master and pair of moments in the
// optimizer's tier. On NVMe it is swap space; in host memory the budget must hold it, and where
// it does not the plan falls back to "forward" and says why; a device optimizer never overlaps.
TEST(PlanTest, TheGuessedStepsShadowStateIsCountedOrTheScheduleFallsBack) {
  const model::ParamLayout l = layout();
  const std::uint64_t f32 = sum_bytes(l, 4);
  PlanOptions o = nvme_options();
  o.overlap = OptimizerOverlap::kBackward;
  auto nvme = make_plan(l, o);
  ASSERT_TRUE(nvme.is_ok()) << nvme.status().message();
  EXPECT_TRUE(nvme->shadow_state);
  EXPECT_EQ(nvme->overlap, OptimizerOverlap::kBackward);
  EXPECT_EQ(nvme->kind_bytes(Tier::kNvme, TensorKind::kMasterWeights), 2 * f32);
  EXPECT_EQ(nvme->kind_bytes(Tier::kNvme, TensorKind::kMoments), 4 * f32);
  EXPECT_NE(nvme->describe().find("overlaps: backward (shadow optimizer state)"), std::string::npos)
      << nvme->describe();

  o.params = Tier::kHost;
  o.optimizer = Tier::kHost;
  auto roomy = make_plan(l, o);  // no host budget: the shadow fits
  ASSERT_TRUE(roomy.is_ok());
  EXPECT_TRUE(roomy->shadow_state);
  const std::uint64_t with_shadow = roomy->tier_bytes(Tier::kHost);
  // A budget that holds the plan without the shadow but not with it.
  o.host_budget_bytes = with_shadow - f32;
  auto tight = make_plan(l, o);
  ASSERT_TRUE(tight.is_ok()) << tight.status().message();
  EXPECT_FALSE(tight->shadow_state);
  EXPECT_EQ(tight->overlap, OptimizerOverlap::kForward);
  EXPECT_LE(tight->tier_bytes(Tier::kHost), o.host_budget_bytes);
  EXPECT_NE(tight->overlap_note.find("does not fit host_memory_limit"), std::string::npos)
      << tight->overlap_note;
  EXPECT_NE(tight->describe().find("overlaps: forward; a second copy"), std::string::npos)
      << tight->describe();

  o.params = Tier::kDevice;
  o.optimizer = Tier::kDevice;
  o.host_budget_bytes = 0;
  o.overlap = OptimizerOverlap::kAuto;  // nothing to measure either
  auto device = make_plan(l, o);
  ASSERT_TRUE(device.is_ok());
  EXPECT_EQ(device->overlap, OptimizerOverlap::kNone);
  EXPECT_FALSE(device->shadow_state);
  EXPECT_FALSE(device->measure_overlap);
  EXPECT_FALSE(device->overlap_note.empty());
}

// optimizer_overlap "auto" is "backward" (or its fallback, "forward") with the schedule measured
// against the serial one (with the optimizer on the device, above, there is nothing to measure).
// NVMe plans fit the swap paths' free space: the shadow optimizer state goes first (the update
// then overlaps the next forward only), and a plan that does not fit without it is refused,
// naming the free space and what it needs.
TEST(PlanTest, TheSwapPathsFreeSpaceDropsTheShadowStateOrRefuses) {
  const model::ParamLayout l = layout();
  PlanOptions o = nvme_options();
  o.overlap = OptimizerOverlap::kBackward;
  auto with_shadow = make_plan(l, o);
  ASSERT_TRUE(with_shadow.is_ok());
  ASSERT_TRUE(with_shadow->shadow_state);
  const std::uint64_t shadowed = with_shadow->tier_bytes(Tier::kNvme);
  const std::uint64_t copy = with_shadow->kind_bytes(Tier::kNvme, TensorKind::kMasterWeights) / 2 +
                             with_shadow->kind_bytes(Tier::kNvme, TensorKind::kMoments) / 2;

  o.swap_free_bytes = shadowed;  // exactly enough
  auto fits = make_plan(l, o);
  ASSERT_TRUE(fits.is_ok());
  EXPECT_TRUE(fits->shadow_state);

  o.swap_free_bytes = shadowed - 1;
  auto dropped = make_plan(l, o);
  ASSERT_TRUE(dropped.is_ok()) << dropped.status().message();
  EXPECT_FALSE(dropped->shadow_state);
  EXPECT_EQ(dropped->overlap, OptimizerOverlap::kForward);
  EXPECT_EQ(dropped->tier_bytes(Tier::kNvme), shadowed - copy);
  EXPECT_NE(dropped->overlap_note.find("free in swap_paths"), std::string::npos)
      << dropped->overlap_note;

  o.swap_free_bytes = shadowed - copy - 1;
  auto refused = make_plan(l, o);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(
      refused.status().message().find("swap_paths have " + format_bytes(o.swap_free_bytes) +
                                      " free: this plan needs " + format_bytes(shadowed - copy)),
      std::string::npos)
      << refused.status().message();
}

TEST(PlanTest, AutoResolvesToAnOverlappedScheduleThatIsMeasured) {
  const model::ParamLayout l = layout();
  PlanOptions o = nvme_options();
  o.overlap = OptimizerOverlap::kAuto;
  auto nvme = make_plan(l, o);
  ASSERT_TRUE(nvme.is_ok()) << nvme.status().message();
  EXPECT_EQ(nvme->overlap, OptimizerOverlap::kBackward);
  EXPECT_TRUE(nvme->shadow_state);
  EXPECT_TRUE(nvme->measure_overlap);
  EXPECT_NE(nvme->describe().find("overlaps: backward (shadow optimizer state), or none while "
                                  "that measures faster"),
            std::string::npos)
      << nvme->describe();

  o.params = Tier::kHost;
  o.optimizer = Tier::kHost;
  auto roomy = make_plan(l, o);
  ASSERT_TRUE(roomy.is_ok());
  o.host_budget_bytes = roomy->tier_bytes(Tier::kHost) - sum_bytes(l, 4);
  auto tight = make_plan(l, o);
  ASSERT_TRUE(tight.is_ok()) << tight.status().message();
  EXPECT_EQ(tight->overlap, OptimizerOverlap::kForward);
  EXPECT_TRUE(tight->measure_overlap);

  o = nvme_options();
  o.overlap = OptimizerOverlap::kBackward;
  auto fixed = make_plan(l, o);
  ASSERT_TRUE(fixed.is_ok());
  EXPECT_FALSE(fixed->measure_overlap);
}

TEST(PlanTest, ContradictionsAndShortBudgetsAreErrorsThatSayWhat) {
  const auto l = layout();
  PlanOptions o;
  o.params = Tier::kHost;  // with the optimizer on the device
  auto a = make_plan(l, o);
  ASSERT_FALSE(a.is_ok());
  EXPECT_NE(a.status().message().find("needs offload_optimizer cpu or nvme"), std::string::npos);
  o = nvme_options();
  o.has_swap = false;
  auto b = make_plan(l, o);
  ASSERT_FALSE(b.is_ok());
  EXPECT_NE(b.status().message().find("swap_paths"), std::string::npos);
  o = nvme_options();
  o.host_budget_bytes = 64 << 20;
  auto c = make_plan(l, o);
  ASSERT_FALSE(c.is_ok());
  EXPECT_EQ(c.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(c.status().message().find("host_memory_limit 64.00 MiB is too small"),
            std::string::npos)
      << c.status().message();
  EXPECT_NE(c.status().message().find("staging"), std::string::npos);
  o = nvme_options();
  o.device_budget_bytes = 100 << 20;  // the embedding and its gradient need 250 MiB
  auto d = make_plan(l, o);
  ASSERT_FALSE(d.is_ok());
  EXPECT_NE(d.status().message().find("'embed'"), std::string::npos) << d.status().message();
}

// QLoRA's layout: each block's projections NF4, its norms and biases in the compute dtype, each
// tensor from a 256-byte boundary; the plan counts those bytes for the frozen base, and ZeRO
// keeps the quantized groups whole on every rank.
TEST(PlanTest, AQuantizedBaseIsCountedByItsBytesAndReplicated) {
  model::LlamaConfig c = tiny_llama();
  c.qkv_bias = true;
  model::LoraConfig lora;
  lora.r = 8;
  const auto plain = model::ParamLayout::build(c, lora);
  const auto quantized = model::ParamLayout::build(c, lora, /*nf4_base=*/true);
  std::uint64_t base_bytes = 0;
  for (const auto& g : quantized.groups()) {
    const bool block = g.name.find("layers.") == 0 && g.name.find(".lora") == std::string::npos;
    EXPECT_EQ(g.quantized(), block) << g.name;
    std::uint64_t want = 0;
    for (const auto& t : g.tensors) {
      EXPECT_EQ(t.format == model::TensorFormat::kNf4, block && t.shape.size() == 2) << t.name;
      if (!block) continue;
      EXPECT_EQ(model::working_offset(g, t, DType::kBF16) % model::kQuantizedAlignBytes, 0u);
      EXPECT_EQ(model::working_offset(g, t, DType::kBF16), want) << t.name;
      const std::uint64_t bytes = t.format == model::TensorFormat::kNf4
                                      ? device::nf4_bytes(t.num_elems)
                                      : static_cast<std::uint64_t>(t.num_elems) * 2;
      want = (want + bytes + 255) / 256 * 256;
    }
    const std::uint64_t bytes = model::working_bytes(g, DType::kBF16);
    if (block) {
      EXPECT_EQ(bytes, want) << g.name;
      // About a quarter of bf16 (0.516 of 2 bytes a weight).
      EXPECT_LT(bytes, static_cast<std::uint64_t>(g.num_elems) * 2 * 27 / 100) << g.name;
    } else {
      EXPECT_EQ(bytes, static_cast<std::uint64_t>(g.num_elems) * 2) << g.name;
    }
    base_bytes += g.frozen ? bytes : 0;
  }
  PlanOptions o;
  o.compute_dtype = DType::kBF16;
  o.params = Tier::kHost;
  o.optimizer = Tier::kHost;
  const Partition one(quantized, {0, 1}, 0);
  auto plan = make_plan(one, o);
  ASSERT_TRUE(plan.is_ok()) << plan.status().message();
  const std::uint64_t params = plan->kind_bytes(Tier::kHost, TensorKind::kParameters);
  std::uint64_t adapters = 0;
  for (const auto& g : quantized.groups()) {
    adapters += g.frozen ? 0 : static_cast<std::uint64_t>(g.num_elems) * 2;
  }
  EXPECT_GE(params, base_bytes + adapters);
  EXPECT_LE(params, base_bytes + adapters + 4096 * quantized.groups().size());
  auto plain_plan = make_plan(Partition(plain, {0, 1}, 0), o);
  ASSERT_TRUE(plain_plan.is_ok());
  // Less by exactly what quantizing the blocks saves, each working copy in whole 4 KiB pages
  // (the bf16 embedding and head stay as they are).
  std::uint64_t saved = 0;
  const auto pages = [](std::uint64_t b) { return (b + 4095) / 4096 * 4096; };
  for (const auto& g : quantized.groups()) {
    if (g.quantized()) {
      saved += pages(static_cast<std::uint64_t>(g.num_elems) * 2) -
               pages(model::working_bytes(g, DType::kBF16));
    }
  }
  EXPECT_EQ(plain_plan->kind_bytes(Tier::kHost, TensorKind::kParameters) - params, saved);

  const Partition four(quantized, {1, 4}, 0);
  for (const auto& g : quantized.groups()) {
    const GroupPartition& p = four.group(g.id);
    EXPECT_EQ(p.replicated, g.quantized()) << g.name;
    if (!g.quantized()) continue;
    const auto& local = four.local_layout().group(g.id);
    EXPECT_EQ(model::working_bytes(local, DType::kBF16), model::working_bytes(g, DType::kBF16));
  }
}

}  // namespace
}  // namespace strata::zero
