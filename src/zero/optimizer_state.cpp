// OptimizerState: master weights and moments as stored, their shadow and held copies, and their
// conversions to and from fp32.
#include "strata/zero/optimizer_state.h"

#include <algorithm>
#include <utility>

#include "strata/device/adam8bit.h"

namespace strata::zero {

struct OptimizerState::Group {
  // The state; the shadow copy (plan.shadow_state): what the next step writes, swapped with the
  // state when that step commits; the third copy (plan.held_copy): where a held state is set
  // aside while steps alternate between the other two. Each: master weights, exp_avg,
  // exp_avg_sq.
  std::array<mem::Handle, 3> now{mem::Handle::kInvalid, mem::Handle::kInvalid,
                                 mem::Handle::kInvalid};
  std::array<mem::Handle, 3> next = now;
  std::array<mem::Handle, 3> spare = now;
  std::size_t master_bytes = 0;  // as optim::master_layout says
  std::size_t moment_bytes = 0;  // one moment's, as optim::moment_layout says
};

OptimizerState::OptimizerState(mem::TieredStore& store, const std::vector<ShardGroup>& groups,
                               const device::HostArrays& arrays, const optim::AdamWHyper& adam,
                               const MemoryPlan& plan, std::vector<std::int64_t> shard_offsets)
    : store_(store),
      shapes_(groups),
      arrays_(arrays),
      adam_(adam),
      plan_(plan),
      shard_offsets_(std::move(shard_offsets)),
      master_layout_(optim::master_layout(adam.master_dtype, adam.master_rounding)),
      moment_layout_(optim::moment_layout(adam.state_dtype)),
      groups_(groups.size()) {}

OptimizerState::~OptimizerState() = default;

Result<std::unique_ptr<OptimizerState>> OptimizerState::create(
    mem::TieredStore& store, const std::vector<ShardGroup>& groups,
    const device::HostArrays& arrays, const optim::AdamWHyper& adam, const MemoryPlan& plan,
    std::vector<std::int64_t> shard_offsets) {
  std::unique_ptr<OptimizerState> s(
      new OptimizerState(store, groups, arrays, adam, plan, std::move(shard_offsets)));
  STRATA_RETURN_IF_ERROR(s->add_tensors());
  return s;
}

Status OptimizerState::add_tensors() {
  for (std::size_t gi = 0; gi < shapes_.size(); ++gi) {
    const ShardGroup& s = shapes_[gi];
    if (!s.trains()) continue;  // no optimizer state (here)
    const Tier tier = plan_.optimizer_of(gi);
    Group& g = groups_[gi];
    g.master_bytes = master_layout_.bytes(s.n);
    g.moment_bytes = moment_layout_.bytes(s.n);
    const auto add = [&](std::array<mem::Handle, 3>& copy, const std::string& suffix) -> Status {
      STRATA_ASSIGN_OR_RETURN(copy[0], add_tensor(store_, "master weights of " + s.name() + suffix,
                                                  g.master_bytes, tier));
      STRATA_ASSIGN_OR_RETURN(
          copy[1], add_tensor(store_, "exp_avg of " + s.name() + suffix, g.moment_bytes, tier));
      STRATA_ASSIGN_OR_RETURN(
          copy[2], add_tensor(store_, "exp_avg_sq of " + s.name() + suffix, g.moment_bytes, tier));
      return Status::ok();
    };
    STRATA_RETURN_IF_ERROR(add(g.now, ""));
    if (plan_.shadowed(gi)) STRATA_RETURN_IF_ERROR(add(g.next, " (shadow)"));
    if (plan_.held(gi)) STRATA_RETURN_IF_ERROR(add(g.spare, " (for saves)"));
  }
  return Status::ok();
}

Status OptimizerState::load(int group, const model::GroupSource& source, WorkingCopies& copies,
                            std::vector<mem::Completion>& writebacks) {
  const ShardGroup& s = shapes_.at(static_cast<std::size_t>(group));
  const Group& g = groups_[static_cast<std::size_t>(group)];
  const mem::Handle master_h = g.now[0];
  // The master weights' host copy (its home, or a fresh copy on its way home), filled by the
  // source; the working copy converted from it the same way.
  STRATA_ASSIGN_OR_RETURN(void* master, store_.emplace(master_h, Tier::kHost, true));
  Status st;
  if (adam_.master_dtype == DType::kF32) {
    st = source(*s.spec, static_cast<float*>(master));
  } else {
    // bf16 master weights: the source rounded to nearest (with Kahan, what that dropped kept
    // beside); the working copy is made from the values stored, as every step's is.
    std::vector<float> wide(static_cast<std::size_t>(s.n));
    st = source(*s.spec, wide.data());
    if (st.is_ok()) master_from_f32(wide.data(), master, s.n);
  }
  if (st.is_ok()) st = copies.write(group, widened_master(group, master), writebacks);
  store_.unpin(master_h, Tier::kHost);
  STRATA_RETURN_IF_ERROR(st);
  if (store_.spec(master_h).home != Tier::kHost) {
    STRATA_ASSIGN_OR_RETURN(mem::Completion done, store_.evict(master_h, Tier::kHost));
    writebacks.push_back(std::move(done));
  }
  STRATA_RETURN_IF_ERROR(store_.fill_zero(g.now[1]));
  return store_.fill_zero(g.now[2]);
}

Status OptimizerState::restore_working_copy(int group, WorkingCopies& copies,
                                            std::vector<mem::Completion>& writebacks) {
  const mem::Handle master_h = groups_.at(static_cast<std::size_t>(group)).now[0];
  STRATA_ASSIGN_OR_RETURN(void* master, store_.acquire(master_h, Tier::kHost));
  Status s = copies.write(group, widened_master(group, master), writebacks);
  store_.unpin(master_h, Tier::kHost);
  return s;
}

const float* OptimizerState::widened_master(int group, const void* master) {
  if (adam_.master_dtype == DType::kF32) return static_cast<const float*>(master);
  const std::int64_t n = shapes_[static_cast<std::size_t>(group)].n;
  wide_master_.resize(static_cast<std::size_t>(n));
  master_to_f32(master, wide_master_.data(), n);
  return wide_master_.data();
}

void OptimizerState::master_to_f32(const void* stored, float* dst, std::int64_t n) const {
  arrays_.convert(stored, adam_.master_dtype, dst, DType::kF32, n);
  if (!master_layout_.has_aux()) return;
  // Kahan: each weight is the pair's f32 sum.
  const auto* comp = reinterpret_cast<const bf16*>(static_cast<const std::byte*>(stored) +
                                                   master_layout_.aux_offset(n));
  for (std::int64_t i = 0; i < n; ++i) dst[i] += bf16_to_f32(comp[i]);
}

void OptimizerState::master_from_f32(const float* src, void* stored, std::int64_t n) const {
  // bf16: rounded to nearest (a loaded or resumed weight; steps round as master_rounding says).
  arrays_.convert(src, DType::kF32, stored, adam_.master_dtype, n);
  if (!master_layout_.has_aux()) return;
  // Kahan: what rounding dropped, rounded toward zero, so the pair sums back to src's split.
  const auto* hi = static_cast<const bf16*>(stored);
  auto* comp =
      reinterpret_cast<bf16*>(static_cast<std::byte*>(stored) + master_layout_.aux_offset(n));
  for (std::int64_t i = 0; i < n; ++i)
    comp[i] = f32_to_bf16_toward_zero(src[i] - bf16_to_f32(hi[i]));
}

void OptimizerState::moment_to_f32(const void* stored, bool second, float* dst,
                                   std::int64_t n) const {
  const DType sd = adam_.state_dtype;
  if (sd != device::kAdam8StateDType) {
    arrays_.convert(stored, sd, dst, DType::kF32, n);
    return;
  }
  const auto* codes = static_cast<const std::uint8_t*>(stored);
  const auto* scales = reinterpret_cast<const float*>(codes + moment_layout_.aux_offset(n));
  device::adam8_dequantize_array(codes, scales, n, second, dst);
}

void OptimizerState::moment_from_f32(const float* src, bool second, void* stored,
                                     std::int64_t n) const {
  const DType sd = adam_.state_dtype;
  if (sd != device::kAdam8StateDType) {
    arrays_.convert(src, DType::kF32, stored, sd, n);
    return;
  }
  auto* codes = static_cast<std::uint8_t*>(stored);
  auto* scales = reinterpret_cast<float*>(codes + moment_layout_.aux_offset(n));
  device::adam8_quantize_array(src, n, second, codes, scales);
}

Status OptimizerState::read_master(int group, float* dst, bool held) {
  const ShardGroup& s = shapes_.at(static_cast<std::size_t>(group));
  STRATA_CHECK(s.trains(), "master weights of a group with no optimizer state", s.name());
  const mem::Handle master = handles(group, held)[0];
  if (adam_.master_dtype == DType::kF32) return store_.read(master, dst);
  std::vector<std::byte> stored(groups_[static_cast<std::size_t>(group)].master_bytes);
  STRATA_RETURN_IF_ERROR(store_.read(master, stored.data()));
  master_to_f32(stored.data(), dst, s.n);
  return Status::ok();
}

Status OptimizerState::read_moments(int group, float* exp_avg, float* exp_avg_sq, bool held) {
  const ShardGroup& s = shapes_.at(static_cast<std::size_t>(group));
  if (!s.trains()) {  // no optimizer state (here): zeros, as before a first step
    std::fill_n(exp_avg, s.n, 0.0f);
    std::fill_n(exp_avg_sq, s.n, 0.0f);
    return Status::ok();
  }
  const auto h = handles(group, held);
  if (adam_.state_dtype == DType::kF32) {
    STRATA_RETURN_IF_ERROR(store_.read(h[1], exp_avg));
    return store_.read(h[2], exp_avg_sq);
  }
  // Compact moments: read as stored, widened (exactly: 8-bit ones decoded) for the caller.
  std::vector<std::byte> stored(groups_[static_cast<std::size_t>(group)].moment_bytes);
  STRATA_RETURN_IF_ERROR(store_.read(h[1], stored.data()));
  moment_to_f32(stored.data(), false, exp_avg, s.n);
  STRATA_RETURN_IF_ERROR(store_.read(h[2], stored.data()));
  moment_to_f32(stored.data(), true, exp_avg_sq, s.n);
  return Status::ok();
}

Status OptimizerState::write_moments(int group, const float* exp_avg, const float* exp_avg_sq) {
  const ShardGroup& s = shapes_.at(static_cast<std::size_t>(group));
  if (!s.trains()) return Status::ok();  // no optimizer state (here) to set
  const Group& g = groups_[static_cast<std::size_t>(group)];
  if (adam_.state_dtype == DType::kF32) {
    const std::size_t bytes = static_cast<std::size_t>(s.n) * sizeof(float);
    STRATA_RETURN_IF_ERROR(store_.write(g.now[1], exp_avg, bytes));
    return store_.write(g.now[2], exp_avg_sq, bytes);
  }
  // Compact moments: rounded to bf16 (nearest, ties to even) or quantized to 8 bits (a block's
  // largest element exactly, so moments read from this store come back the same bytes).
  std::vector<std::byte> stored(g.moment_bytes);
  moment_from_f32(exp_avg, false, stored.data(), s.n);
  STRATA_RETURN_IF_ERROR(store_.write(g.now[1], stored.data(), g.moment_bytes));
  moment_from_f32(exp_avg_sq, true, stored.data(), s.n);
  return store_.write(g.now[2], stored.data(), g.moment_bytes);
}

std::array<mem::Handle, 3> OptimizerState::handles(int group, bool held) const {
  const Group& g = groups_.at(static_cast<std::size_t>(group));
  std::lock_guard lock(held_mu_);  // a commit swaps them on the training side
  STRATA_CHECK(!held || held_, "the held state is read but none is held",
               shapes_[static_cast<std::size_t>(group)].name());
  return held && held_is_spare_ ? g.spare : g.now;
}

void OptimizerState::hold() {
  STRATA_CHECK(plan_.held_copy, "hold_state needs the plan's held copy (hold_state option)");
  std::lock_guard lock(held_mu_);
  STRATA_CHECK(!held_, "the state is already held");
  held_ = true;
  held_is_spare_ = false;
}

void OptimizerState::release() {
  std::lock_guard lock(held_mu_);
  held_ = false;
}

void OptimizerState::commit() {
  if (!plan_.shadow_state) return;
  std::lock_guard lock(held_mu_);  // a save's thread may be reading the held copy's handles
  // The step's state is the state (the groups the device steps have one copy, written in place).
  for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
    if (plan_.shadowed(gi)) std::swap(groups_[gi].now, groups_[gi].next);
  }
  if (held_ && !held_is_spare_) {  // the held copy is the shadow now: set it aside
    for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
      if (plan_.held(gi)) std::swap(groups_[gi].next, groups_[gi].spare);
    }
    held_is_spare_ = true;
  }
}

OptimizerState::StepGroups OptimizerState::step_groups(const GradientLanding& grads,
                                                       bool device_steps) const {
  StepGroups s;
  for (std::size_t gi = 0; gi < shapes_.size(); ++gi) {
    const ShardGroup& shape = shapes_[gi];
    if (!shape.trains()) continue;
    if (plan_.optimizer != Tier::kDevice && plan_.steps_on_device(gi) != device_steps) continue;
    const Group& g = groups_[gi];
    StepGroup sg;
    sg.name = shape.name();
    sg.num_elems = shape.n;
    sg.id = static_cast<int>(gi);
    sg.element_offset =
        gi < shard_offsets_.size() ? static_cast<std::uint64_t>(shard_offsets_[gi]) : 0;
    StepTensors t;
    t.state = g.now;
    if (plan_.shadowed(gi)) t.out = g.next;
    t.grad = grads.step_grad(static_cast<int>(gi));
    s.groups.push_back(std::move(sg));
    s.tensors.push_back(t);
    s.ids.push_back(static_cast<int>(gi));
  }
  return s;
}

}  // namespace strata::zero
