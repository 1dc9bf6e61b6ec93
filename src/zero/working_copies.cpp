// WorkingCopies: the parameters the model computes with, served from their home or fetched ahead,
// and written anew from fp32 values.
#include "strata/zero/working_copies.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "strata/core/clock.h"
#include "strata/device/nf4.h"

namespace strata::zero {

WorkingCopies::WorkingCopies(mem::TieredStore& store, const std::vector<ShardGroup>& groups,
                             const device::HostArrays& arrays, const WorkingCopyOptions& options)
    : store_(store), groups_(groups), arrays_(arrays), options_(options) {}

Result<std::unique_ptr<WorkingCopies>> WorkingCopies::create(mem::TieredStore& store,
                                                             const std::vector<ShardGroup>& groups,
                                                             const device::HostArrays& arrays,
                                                             const WorkingCopyOptions& options) {
  std::unique_ptr<WorkingCopies> w(new WorkingCopies(store, groups, arrays, options));
  w->work_.assign(groups.size(), mem::Handle::kInvalid);
  w->span_begin_ns_.assign(groups.size(), 0);
  std::unordered_map<std::uint32_t, int> group_of_work;
  std::unordered_set<std::uint32_t> frozen_work;    // the fetched copies of frozen groups
  std::map<int, std::vector<mem::Handle>> experts;  // by MoE layer, those fetched
  bool any_fetched = false;
  for (std::size_t gi = 0; gi < groups.size(); ++gi) {
    const ShardGroup& g = groups[gi];
    if (g.empty()) continue;  // another stage's: nothing asks for it
    const Tier home = g.frozen() ? options.home
                      : gi < options.device_homed.size() && options.device_homed[gi]
                          ? Tier::kDevice
                          : options.trained_home;
    STRATA_ASSIGN_OR_RETURN(w->work_[gi],
                            add_tensor(store, "parameters of " + g.name(), g.work_bytes, home));
    if (home == Tier::kDevice) continue;
    any_fetched = true;
    group_of_work[mem::handle_index(w->work_[gi])] = static_cast<int>(gi);
    if (g.frozen()) frozen_work.insert(mem::handle_index(w->work_[gi]));
    if (g.spec->expert_layer >= 0) experts[g.spec->expert_layer].push_back(w->work_[gi]);
  }
  if (any_fetched) {
    sched::PrefetchOptions po;
    po.prefetch_bytes = options.prefetch_bytes;
    po.max_live_bytes = options.max_live_bytes;
    po.max_reuse_distance = options.max_reuse_distance;
    // A frozen group's copy: nothing rewrites it, so it stays on the device between passes.
    po.stable = [frozen = std::move(frozen_work)](mem::Handle h) {
      return frozen.count(mem::handle_index(h)) != 0;
    };
    // While an overlapped step runs, a working copy is fetched ahead (from the trace or a hint)
    // only once it is updated.
    WorkingCopies* self = w.get();
    po.may_prefetch = [self, group_of_work = std::move(group_of_work)](mem::Handle h) {
      return self->gate_ == nullptr ||
             self->gate_->update_done(group_of_work.at(mem::handle_index(h)));
    };
    // An MoE layer's experts are a routed set: acquired as its router chooses.
    for (auto& [layer, handles] : experts) po.routed_sets.push_back(std::move(handles));
    w->sched_ = std::make_unique<sched::PrefetchScheduler>(store, po);
  }
  return w;
}

std::uint64_t WorkingCopies::acquire_device_bytes(int group) const {
  return fetched(group) ? store_.device_bytes(handle(group)) : 0;
}

sched::SchedulerStats WorkingCopies::prefetch_stats() const {
  return sched_ ? sched_->stats() : sched::SchedulerStats{};
}

void WorkingCopies::prefetch(int group) {
  if (fetched(group)) sched_->hint(handle(group));
}

Result<const void*> WorkingCopies::acquire(int group) {
  const mem::Handle h = handle(group);
  Stopwatch wait;
  auto p = fetched(group) ? sched_->acquire(h) : store_.acquire(h, Tier::kDevice);
  wait_ms_ += wait.elapsed_ms();
  if (!p.is_ok()) return p.status();
  span_begin_ns_[static_cast<std::size_t>(group)] = now_ns();
  return static_cast<const void*>(*p);
}

void WorkingCopies::release(int group) {
  std::int64_t& begin = span_begin_ns_.at(static_cast<std::size_t>(group));
  if (options_.timeline != nullptr && begin != 0) {
    options_.timeline->add(mem::Lane::kCompute,
                           this->group(group).name() + (backward_ ? " backward" : " forward"),
                           begin, now_ns());
  }
  begin = 0;
  if (fetched(group)) {
    sched_->release(handle(group));
  } else {
    store_.unpin(handle(group), Tier::kDevice);
  }
}

void WorkingCopies::end_pass() {
  if (sched_) sched_->end_pass();
  backward_ = false;
}

Result<void*> WorkingCopies::open(int group, Tier tier) {
  // The output replaces every copy: the home itself when it lives on `tier`.
  return store_.emplace(handle(group), tier, /*zero_fill=*/false);
}

void WorkingCopies::abandon(int group, Tier tier) { store_.unpin(handle(group), tier); }

Status WorkingCopies::close(int group, Tier tier, std::vector<mem::Completion>& writebacks,
                            bool keep_host_copy) {
  const mem::Handle h = handle(group);
  store_.mark_dirty(h, tier);
  store_.unpin(h, tier);
  const Tier home = store_.spec(h).home;
  if (home == tier) return Status::ok();
  // Home on the copy streams (NVMe, or the device) while the next group is updated. Under a
  // host budget a step's host copy on its way to NVMe stays as a clean copy, so the next forward
  // can take it from host memory while the budget has room (clean copies go first when room is
  // needed). Without one it goes: parameters on NVMe must not fill the host unbounded.
  const bool keep =
      keep_host_copy && home == Tier::kNvme && tier == Tier::kHost && options_.host_budget;
  STRATA_ASSIGN_OR_RETURN(mem::Completion done,
                          keep ? store_.fetch(h, Tier::kNvme) : store_.evict(h, tier));
  writebacks.push_back(std::move(done));
  return Status::ok();
}

Status WorkingCopies::write(int group, const float* values,
                            std::vector<mem::Completion>& writebacks) {
  STRATA_ASSIGN_OR_RETURN(void* out, open(group, Tier::kHost));
  const Fp32Pieces whole = [values](std::int64_t begin, std::int64_t) -> Result<const float*> {
    return values + begin;
  };
  if (Status s = fill(group, whole, this->group(group).n, out); !s.is_ok()) {
    abandon(group, Tier::kHost);
    return s;
  }
  return close(group, Tier::kHost, writebacks);
}

Status WorkingCopies::load_frozen(int group, const model::GroupSource& source,
                                  WorkingCopyCache* cache, const model::GroupRangeSource& pieces,
                                  std::vector<mem::Completion>& writebacks) {
  const ShardGroup& g = this->group(group);
  STRATA_ASSIGN_OR_RETURN(void* out, open(group, Tier::kHost));
  Status s = [&]() -> Status {
    const bool cached = cache != nullptr && g.spec->quantized();
    if (cached) {
      STRATA_ASSIGN_OR_RETURN(const bool hit, cache->read(*g.spec, out, g.work_bytes));
      if (hit) return Status::ok();
    }
    std::vector<float> values;
    if (pieces) {
      // 16 Mi elements (64 MiB of fp32) at a time beside the working copy.
      constexpr std::int64_t kPieceElems = std::int64_t{1} << 24;
      const Fp32Pieces from_pieces = [&](std::int64_t begin,
                                         std::int64_t count) -> Result<const float*> {
        values.resize(static_cast<std::size_t>(count));
        STRATA_RETURN_IF_ERROR(pieces(*g.spec, begin, count, values.data()));
        return static_cast<const float*>(values.data());
      };
      STRATA_RETURN_IF_ERROR(fill(group, from_pieces, kPieceElems, out));
    } else {
      values.assign(static_cast<std::size_t>(g.n), 0.0f);
      STRATA_RETURN_IF_ERROR(source(*g.spec, values.data()));
      const Fp32Pieces whole = [&](std::int64_t begin, std::int64_t) -> Result<const float*> {
        return static_cast<const float*>(values.data() + begin);
      };
      STRATA_RETURN_IF_ERROR(fill(group, whole, g.n, out));
    }
    return cached ? cache->write(*g.spec, out, g.work_bytes) : Status::ok();
  }();
  if (!s.is_ok()) {
    abandon(group, Tier::kHost);
    return s;
  }
  return close(group, Tier::kHost, writebacks);
}

Status WorkingCopies::fill(int group, const Fp32Pieces& values, std::int64_t piece_elems,
                           void* out) {
  const ShardGroup& g = this->group(group);
  const DType dtype = options_.compute_dtype;
  const std::size_t dsize = dtype_size(dtype);
  // Elements [begin, begin + count) of the group converted to `at`, a piece at a time.
  const auto convert = [&](std::int64_t begin, std::int64_t count, std::byte* at) -> Status {
    for (std::int64_t k = 0; k < count; k += piece_elems) {
      const std::int64_t m = std::min(piece_elems, count - k);
      STRATA_ASSIGN_OR_RETURN(const float* v, values(begin + k, m));
      arrays_.convert(v, DType::kF32, at + static_cast<std::size_t>(k) * dsize, dtype, m);
    }
    return Status::ok();
  };
  if (!g.spec->quantized()) return convert(0, g.n, static_cast<std::byte*>(out));
  // Tensor by tensor: NF4 projections whole (their block maxima's mean is the tensor's) and
  // quantized, the rest converted; the gaps zero.
  std::memset(out, 0, g.work_bytes);
  for (const auto& t : g.spec->tensors) {
    auto* at = static_cast<std::byte*>(out) + model::working_offset(*g.spec, t, dtype);
    if (t.format != model::TensorFormat::kNf4) {
      STRATA_RETURN_IF_ERROR(convert(t.offset_elems, t.num_elems, at));
      continue;
    }
    STRATA_ASSIGN_OR_RETURN(const float* v, values(t.offset_elems, t.num_elems));
    STRATA_RETURN_IF_ERROR(device::nf4_quantize(v, t.num_elems, at, t.name.c_str()));
  }
  return Status::ok();
}

Status WorkingCopies::read(int group, float* dst) {
  const ShardGroup& g = this->group(group);
  if (g.empty()) return Status::ok();
  const DType dtype = options_.compute_dtype;
  std::vector<std::byte> work(g.work_bytes);
  STRATA_RETURN_IF_ERROR(store_.read(handle(group), work.data()));
  if (!g.spec->quantized()) {
    arrays_.convert(work.data(), dtype, dst, DType::kF32, g.n);
    return Status::ok();
  }
  std::fill_n(dst, g.n, 0.0f);
  for (const auto& t : g.spec->tensors) {
    const std::byte* at = work.data() + model::working_offset(*g.spec, t, dtype);
    if (t.format == model::TensorFormat::kNf4) {
      device::nf4_dequantize_reference(at, t.num_elems, dst + t.offset_elems);
    } else {
      arrays_.convert(at, dtype, dst + t.offset_elems, DType::kF32, t.num_elems);
    }
  }
  return Status::ok();
}

}  // namespace strata::zero
