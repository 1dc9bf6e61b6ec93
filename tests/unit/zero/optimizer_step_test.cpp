// The optimizer step's three implementations (device AdamW op, host CPU Adam, NVMe-streamed CPU
// Adam) over the same state and gradients give the same bits, in every tensor they write, for
// fp32 and bf16 gradients and working copies; the streamed one reads and writes each state
// array once. On the CPU backend the device tier runs CpuAdam too.
#include "strata/zero/optimizer_step.h"

#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <vector>

#include "strata/core/rng.h"
#include "strata/device/op_profile.h"
#include "strata/optim/adamw.h"
#include "strata/optim/streamed_adam.h"
#include "strata/zero/step_target.h"
#include "tests/testing/backends.h"
#include "tests/testing/scoped_env.h"

namespace strata::zero {
namespace {

const std::vector<std::int64_t> kGroupElems = {1000, 5000, 70};

struct Result3 {
  std::vector<std::vector<std::byte>> master, exp_avg, exp_avg_sq, out;
};

std::vector<std::byte> random_f32(std::int64_t n, Rng& rng, double scale) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = static_cast<float>(rng.normal() * scale);
  std::vector<std::byte> b(v.size() * sizeof(float));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

std::vector<std::byte> in_dtype(const std::vector<std::byte>& f32, DType dtype) {
  const std::size_t n = f32.size() / sizeof(float);
  std::vector<std::byte> b(n * dtype_size(dtype));
  convert(f32.data(), DType::kF32, b.data(), dtype, n);
  return b;
}

// The step's target over the test's tensors: each group's output is its `outs` tensor; with
// `asked`, gradient_ready records the groups in the order asked.
class TestTarget final : public StoreStepTarget {
 public:
  TestTarget(mem::TieredStore& store, std::vector<StepGroup> groups,
             std::vector<StepTensors> tensors, DType dtype, std::vector<std::size_t> order,
             const std::vector<mem::Handle>& outs, std::vector<std::size_t>* asked)
      : StoreStepTarget(store, std::move(groups), std::move(tensors), dtype, dtype,
                        std::move(order)),
        outs_(outs),
        asked_(asked) {}

  Result<bool> gradient_ready(std::size_t gi, bool) override {
    if (asked_ != nullptr && (asked_->empty() || asked_->back() != gi)) asked_->push_back(gi);
    return true;
  }
  Result<void*> open_output(std::size_t gi, Tier t) override {
    ++opened;
    return store().emplace(outs_[gi], t, false);
  }
  Status close_output(std::size_t gi, Tier t) override {
    ++closed;
    store().mark_dirty(outs_[gi], t);
    store().unpin(outs_[gi], t);
    return Status::ok();
  }
  int opened = 0, closed = 0;

 private:
  const std::vector<mem::Handle>& outs_;
  std::vector<std::size_t>* asked_;
};

// `shadow`: the state goes to a second set of tensors (in reverse group order, each group asked
// for by `gradient_ready` first), and the state read must be left as it was.
Result3 run_step(Tier tier, DType dtype, bool shadow = false) {
  Result3 r;
  auto device = testing::make_cpu_device();
  auto swap = testing::make_swap();
  OptimizerStepOptions oo;
  oo.sub_group_size = 2048;  // several sub-groups in the largest group
  oo.max_group_elems = 5000;
  oo.stream_grads = true;
  mem::StoreOptions so;
  so.range_io_bytes =
      optim::StreamedAdam::staging_bytes_for({.sub_group_size = oo.sub_group_size,
                                              .max_segment_elems = oo.max_group_elems,
                                              .stream_grads = true});
  auto store = mem::TieredStore::create(*device, swap.get(), so);
  EXPECT_TRUE(store.is_ok()) << store.status().to_string();
  if (!store.is_ok()) return r;
  mem::TieredStore& st = **store;
  Rng rng(42);
  std::vector<StepGroup> groups;
  std::vector<StepTensors> tensors;
  std::vector<mem::Handle> outs;
  for (std::size_t g = 0; g < kGroupElems.size(); ++g) {
    const std::int64_t n = kGroupElems[g];
    const auto f32_bytes = static_cast<std::uint64_t>(n) * sizeof(float);
    auto add = [&](const std::string& name, std::uint64_t bytes, Tier home,
                   const std::vector<std::byte>& data) {
      mem::TensorSpec spec;
      spec.name = name + std::to_string(g);
      spec.size_bytes = bytes;
      spec.home = home;
      auto h = st.add(spec);
      EXPECT_TRUE(h.is_ok()) << h.status().to_string();
      EXPECT_TRUE(st.write(*h, data.data(), data.size()).is_ok());
      return *h;
    };
    StepGroup sg;
    sg.name = "g" + std::to_string(g);
    sg.num_elems = n;
    StepTensors t;
    t.state[0] = add("master", f32_bytes, tier, random_f32(n, rng, 1.0));
    t.state[1] = add("exp_avg", f32_bytes, tier, random_f32(n, rng, 0.01));
    auto v = random_f32(n, rng, 0.001);
    for (std::size_t i = 0; i < v.size(); i += sizeof(float)) {  // exp_avg_sq is never negative
      v[i + 3] &= std::byte{0x7f};
    }
    t.state[2] = add("exp_avg_sq", f32_bytes, tier, v);
    if (shadow) {
      const std::vector<std::byte> junk(f32_bytes, std::byte{0x5a});
      t.out[0] = add("master (shadow)", f32_bytes, tier, junk);
      t.out[1] = add("exp_avg (shadow)", f32_bytes, tier, junk);
      t.out[2] = add("exp_avg_sq (shadow)", f32_bytes, tier, junk);
    }
    const auto grad = in_dtype(random_f32(n, rng, 0.1), dtype);
    t.grad = add("grad", grad.size(), tier, grad);
    groups.push_back(sg);
    tensors.push_back(t);
    outs.push_back(add("out", static_cast<std::uint64_t>(n) * dtype_size(dtype), Tier::kHost,
                       std::vector<std::byte>(static_cast<std::size_t>(n) * dtype_size(dtype))));
  }
  optim::AdamWHyper hyper;
  const device::AdamWArgs base = optim::make_adamw_args(hyper, 1e-3, 3, 0.5f);
  auto step = make_optimizer_step(tier, *device, st.range_staging(), oo);
  EXPECT_TRUE(step.is_ok()) << step.status().to_string();
  if (!step.is_ok()) return r;
  std::vector<std::vector<std::byte>> before;
  auto read = [&](mem::Handle h) {
    std::vector<std::byte> b(st.spec(h).size_bytes);
    EXPECT_TRUE(st.read(h, b.data()).is_ok());
    return b;
  };
  for (const StepTensors& t : tensors) {
    for (mem::Handle h : t.state) before.push_back(read(h));
  }
  const std::vector<std::size_t> reversed = {2, 1, 0};
  std::vector<std::size_t> asked;
  TestTarget target(st, groups, tensors, dtype, shadow ? reversed : std::vector<std::size_t>{},
                    outs, shadow ? &asked : nullptr);
  const Status s = (*step)->run(target, base);
  EXPECT_TRUE(s.is_ok()) << s.to_string();
  EXPECT_EQ(target.opened, 3);
  EXPECT_EQ(target.closed, 3);
  if (shadow) {
    EXPECT_EQ(asked, reversed);
    for (std::size_t g = 0; g < groups.size(); ++g) {  // the state read is intact
      for (std::size_t k = 0; k < 3; ++k) {
        EXPECT_EQ(read(tensors[g].state[k]), before[3 * g + k]);
      }
      tensors[g].state = tensors[g].out;
    }
  }
  std::uint64_t state_bytes = 0;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    r.master.push_back(read(tensors[g].state[0]));
    r.exp_avg.push_back(read(tensors[g].state[1]));
    r.exp_avg_sq.push_back(read(tensors[g].state[2]));
    r.out.push_back(read(outs[g]));
    state_bytes += 3 * r.master.back().size();
  }
  if (tier == Tier::kNvme) {
    // Each state array read once and written once, each gradient read once (4096-byte rounding
    // at most per array).
    std::uint64_t grad_bytes = 0;
    for (const auto& t : tensors) grad_bytes += st.spec(t.grad).size_bytes;
    EXPECT_GE((*step)->bytes_read(), state_bytes + grad_bytes);
    EXPECT_LE((*step)->bytes_read(), state_bytes + grad_bytes + 4 * 3 * 4096);
    EXPECT_GE((*step)->bytes_written(), state_bytes);
    EXPECT_LE((*step)->bytes_written(), state_bytes + 3 * 3 * 4096);
  } else {
    EXPECT_EQ((*step)->bytes_read(), 0u);
  }
  return r;
}

class OptimizerStepTest : public ::testing::TestWithParam<DType> {};

TEST_P(OptimizerStepTest, EveryTierWritesTheSameBits) {
  const DType dtype = GetParam();
  const Result3 device = run_step(Tier::kDevice, dtype);
  ASSERT_EQ(device.master.size(), kGroupElems.size());
  for (const Tier tier : {Tier::kHost, Tier::kNvme}) {
    SCOPED_TRACE(tier == Tier::kHost ? "host" : "nvme");
    const Result3 r = run_step(tier, dtype);
    EXPECT_EQ(r.master, device.master);
    EXPECT_EQ(r.exp_avg, device.exp_avg);
    EXPECT_EQ(r.exp_avg_sq, device.exp_avg_sq);
    EXPECT_EQ(r.out, device.out);
    SCOPED_TRACE("shadow state");
    const Result3 shadowed = run_step(tier, dtype, /*shadow=*/true);
    EXPECT_EQ(shadowed.master, device.master);
    EXPECT_EQ(shadowed.exp_avg, device.exp_avg);
    EXPECT_EQ(shadowed.exp_avg_sq, device.exp_avg_sq);
    EXPECT_EQ(shadowed.out, device.out);
  }
  // The step changed something: the master weights moved.
  Rng rng(42);
  EXPECT_NE(device.master[0], random_f32(kGroupElems[0], rng, 1.0));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, OptimizerStepTest, ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& info) {
                           return std::string(info.param == DType::kF32 ? "f32" : "bf16");
                         });

// On the CPU backend device memory is host memory, so the device tier's step runs CpuAdam there
// (the same bits as the adamw op, several times faster) and never calls the op: a profiled
// device counts no adamw.
TEST(OptimizerStepCpuTest, TheDeviceTierOnTheCpuBackendRunsCpuAdam) {
  const testing::ScopedEnv profile("STRATA_OP_PROFILE", "1");
  device::reset_op_profile();
  const Result3 r = run_step(Tier::kDevice, DType::kF32);
  // The control: an op of a device made the same way is counted.
  auto control = testing::make_cpu_device();
  std::vector<float> x(64, 1.0f);
  control->ops().add(x.data(), x.data(), x.data(), 64, DType::kF32);
  const std::vector<device::OpTime> ops = device::op_profile();
  ASSERT_EQ(r.master.size(), kGroupElems.size());
  bool counted_add = false;
  for (const device::OpTime& op : ops) {
    counted_add = counted_add || (op.op == "add" && op.calls == 1);
    EXPECT_NE(op.op, "adamw") << op.calls << " adamw op calls";
  }
  EXPECT_TRUE(counted_add);
}

}  // namespace
}  // namespace strata::zero
