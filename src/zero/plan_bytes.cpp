// The memory plan's byte counts: every tier's bytes by kind, the store's caches, ZeRO's
// collective buffers walked through two steps, and the tiers' peaks.
#include "src/zero/plan_bytes.h"

#include <algorithm>
#include <array>
#include <map>
#include <utility>
#include <vector>

#include "strata/core/aligned.h"
#include "strata/io/swap.h"
#include "strata/mem/host_memory.h"
#include "strata/mem/tiered_store.h"

namespace strata::zero::detail {
namespace {

// The blocks a cache of freed buffers by size holds at its peak: a freed block serves the next
// request of its size, so per size the cache ends up holding the most blocks of that size that
// were ever in use at one moment, up to `keep` (the device cache's cap per size).
class CacheDemand {
 public:
  explicit CacheDemand(int keep) : keep_(keep) {}
  // Blocks of these sizes in use at one moment.
  void at_once(const std::vector<std::uint64_t>& sizes) {
    std::map<std::uint64_t, int> now;
    for (std::uint64_t b : sizes) ++now[b];
    for (const auto& [size, count] : now) most_[size] = std::max(most_[size], count);
  }
  std::uint64_t held() const {
    std::uint64_t sum = 0;
    for (const auto& [size, count] : most_) {
      sum += size * static_cast<std::uint64_t>(std::min(count, keep_));
    }
    return sum;
  }

 private:
  int keep_;
  std::map<std::uint64_t, int> most_;
};

// Bytes a device copy of a tensor of `bytes` takes: on a host-addressable device with swap, a
// tensor that touches NVMe is whole O_DIRECT blocks (TieredStore's direct_device_io).
std::uint64_t device_bytes_of(const PlanOptions& o, std::uint64_t bytes, bool touches_nvme) {
  return o.host_addressable_device && o.has_swap && touches_nvme
             ? align_up(bytes, io::kIoAlignBytes) + io::kIoAlignBytes
             : bytes;
}

// ... of a group of `n` elements.
std::uint64_t device_copy_bytes(const PlanOptions& o, std::uint64_t n, bool touches_nvme) {
  return device_bytes_of(o, n * dtype_size(o.compute_dtype), touches_nvme);
}

// The largest working copy, in whole O_DIRECT blocks, of the groups not homed on `tier`.
std::uint64_t max_work_io_off(const Sizes& z, const MemoryPlan& plan, Tier tier) {
  std::uint64_t most = 0;
  for (std::size_t i = 0; i < z.work_bytes.size(); ++i) {
    if (plan.home_of(i, z.frozen[i]) != tier) {
      most = std::max(most, align_up(z.work_bytes[i], io::kIoAlignBytes));
    }
  }
  return most;
}

// What the store's caches keep of the transient tensors count_bytes counts (at the most in
// flight at once, of the largest group), beyond what it counts of them. Loading passes the groups
// through one at a time; backward makes them in reverse order, and a tensor that leaves a tier
// while the next group's is made there holds two groups' blocks at once.
void count_caches(const Sizes& z, const PlanOptions& o, MemoryPlan& plan) {
  const std::uint64_t dsize = dtype_size(o.compute_dtype);
  const std::uint64_t gsize = o.zero.wide_gradients ? 4 : dsize;  // a landing gradient's
  const bool on_device = plan.optimizer == Tier::kDevice;
  const bool summed_on_device = plan.sums_on_device();  // no gradient leaves before the step
  const std::size_t groups = z.elems.size();
  const auto host_class = [](std::uint64_t bytes) {
    return static_cast<std::uint64_t>(mem::HostBlockCache::class_bytes(bytes));
  };

  // Host: the block cache keeps every freed block until the budget needs the room, or until
  // loading ends (load_master gives its blocks back).
  CacheDemand loading(std::numeric_limits<int>::max());
  CacheDemand host(std::numeric_limits<int>::max());
  bool master_through = false;
  for (std::size_t i = 0; i < z.elems.size(); ++i) {
    const std::uint64_t n = z.elems[i];
    std::vector<std::uint64_t> now;
    if (plan.optimizer_of(i) != Tier::kHost && !z.frozen[i]) {
      master_through = true;
      now.push_back(host_class(n * 4));
    }
    if (plan.home_of(i, z.frozen[i]) != Tier::kHost) now.push_back(host_class(z.work_bytes[i]));
    loading.at_once(now);
  }
  const bool grads_through = !summed_on_device && !plan.keep_gradients;
  const std::vector<std::uint64_t>& tg = z.trained;
  for (std::size_t i = 0; i < tg.size(); ++i) {  // backward
    std::vector<std::uint64_t> now;
    for (std::size_t g : {i, i + 1}) {  // this group's and the one leaving before it
      if (g >= tg.size() || !grads_through) continue;
      now.push_back(host_class(tg[g] * gsize));
      if (plan.gradients == Tier::kNvme) now.push_back(host_class(tg[g] * 4));
    }
    // The host optimizer's new working copies, on their way home while the next group is
    // updated: to NVMe, or to the device from an update paced by the drive.
    for (std::size_t g : {i, i + 1}) {
      if (g < tg.size() && !on_device &&
          (plan.params == Tier::kNvme ||
           (plan.params == Tier::kDevice && plan.optimizer == Tier::kNvme))) {
        now.push_back(host_class(tg[g] * dsize));
      }
    }
    host.at_once(now);
  }
  // From an update in host memory to the device: it may run ahead of the copy stream by every
  // group.
  if (plan.params == Tier::kDevice && plan.optimizer == Tier::kHost) {
    std::vector<std::uint64_t> now;
    for (std::uint64_t n : tg) now.push_back(host_class(n * dsize));
    host.at_once(now);
  }
  std::uint64_t counted = 0;
  if (master_through) counted += z.max_f32_io;
  counted += 2 * max_work_io_off(z, plan, Tier::kHost);
  if (grads_through) {
    counted += 2 * z.max_grad_io_off;
    if (plan.gradients == Tier::kNvme) counted += 2 * z.max_f32_io_off;
  }
  const std::uint64_t held = std::max(loading.held(), host.held());
  plan.cache_bytes[static_cast<std::size_t>(Tier::kHost)] = held > counted ? held - counted : 0;

  // Device: the gradients, made from the head down to the embedding, one at a time into a
  // device accumulator, else one made while the last leaves. The embedding's gradient, made
  // last, reuses the block of its working copy, dropped after the forward, where parameters are
  // offloaded and the two copies have one size.
  const auto device_block = [&](std::uint64_t n, bool touches_nvme) {
    return device_copy_bytes(o, n, touches_nvme);
  };
  const Tier first_home = plan.home_of(0, z.frozen.front());
  const bool reuses_working = first_home != Tier::kDevice && !o.tied_embeddings &&
                              !z.frozen.front() &&
                              device_block(z.elems.front(), first_home == Tier::kNvme) ==
                                  device_block(z.elems.front(), true);
  CacheDemand device(mem::StoreOptions{}.device_cache_blocks_per_size);
  std::size_t next = groups;  // the trainable group whose gradient was made before this one's
  for (std::size_t i = groups; i-- > 0;) {
    if (z.frozen[i]) continue;
    std::vector<std::uint64_t> now;
    if (!(i == 0 && reuses_working)) now.push_back(device_block(z.elems[i], true));
    if (next < groups && !plan.sums_on_device(next)) {
      now.push_back(device_block(z.elems[next], true));
    }
    if (o.tied_embeddings && i != 0) now.push_back(device_block(z.elems.front(), true));
    device.at_once(now);
    next = i;
  }
  const std::uint64_t device_held = device.held();
  plan.cache_bytes[static_cast<std::size_t>(Tier::kDevice)] =
      device_held > z.max_grad_io ? device_held - z.max_grad_io : 0;
}

// Device blocks taken and given back, as the store's device cache keeps given-back blocks by size
// (up to `keep` of each) for the next request of their size.
class DeviceBlocks {
 public:
  explicit DeviceBlocks(int keep) : keep_(keep) {}
  void take(std::uint64_t bytes) {
    if (bytes == 0) return;
    if (int& c = cached_[bytes]; c > 0) {
      --c;
    } else {
      held_ += bytes;
    }
    peak_ = std::max(peak_, held_);
  }
  void give(std::uint64_t bytes) {
    if (bytes == 0) return;
    if (int& c = cached_[bytes]; c < keep_) {
      ++c;
    } else {
      held_ -= bytes;
    }
  }
  void trim() {  // the cache given back (the engine's end of a pass)
    for (auto& [size, count] : cached_) held_ -= size * static_cast<std::uint64_t>(count);
    cached_.clear();
  }
  std::uint64_t peak() const { return peak_; }

 private:
  int keep_;
  std::map<std::uint64_t, int> cached_;
  std::uint64_t held_ = 0, peak_ = 0;
};

// ZeRO's device buffers at their peak, walked through two steps as ZeroProvider runs them (the
// second starts with what the first left in the store's device cache): gathered parameters,
// full gradients, packed buckets and the gradient buffers reductions land in. Covers every
// gradient buffer on the device, the shard store's gradient in transit included. With
// parameters offloaded, so are the working copies of partitioned groups: each is fetched for
// its gather and dropped after it, leaving its block to the cache (`offloaded`, by group). 0 when
// nothing is partitioned (one rank).
std::uint64_t collective_peak_bytes(const Partition& partition, const PlanOptions& plan_options,
                                    const std::vector<bool>& offloaded, int cache_blocks_per_size) {
  const ZeroOptions& options = plan_options.zero;  // its dtype is the plan's compute_dtype
  const auto& groups = partition.groups();
  // Nothing to gather or reduce on one rank; over several, even replicated groups all-gather
  // every rank's gradient to sum it.
  bool any = false;
  for (const auto& p : groups) any = any || !p.replicated || p.world > 1;
  if (!any) return 0;
  const std::uint64_t d = dtype_size(plan_options.compute_dtype);
  DeviceBlocks t(cache_blocks_per_size);
  const auto full = [&](const GroupPartition& p) {
    return static_cast<std::uint64_t>(p.padded_elems) * d;
  };
  const auto local = [&](const GroupPartition& p) {
    return static_cast<std::uint64_t>(p.local_elems()) * d;
  };
  // A reduced gradient's element: the compute dtype's, or f32 (wide gradients).
  const std::uint64_t gd = options.wide_gradients ? 4 : d;
  const auto reduced = [&](const GroupPartition& p) {
    return static_cast<std::uint64_t>(p.local_elems()) * gd;
  };

  // Parameters. Stages 1-2 hold every group's; stage 3 gathers each in use, one ahead. Each axis
  // (data-parallel; an expert's groups' expert-data) has its own world, cap and staging.
  const auto gather_cap = [&](const GroupPartition& p) {
    return bucket_cap_elems(options.allgather_bucket_bytes, d, p.world);
  };
  std::array<std::int64_t, 2> widest{};
  for (const auto& p : groups) {
    std::int64_t& w = widest[p.experts ? 1 : 0];
    if (!p.replicated) w = std::max(w, p.shard_elems);
  }
  const auto staging = [&](const GroupPartition& p) {
    return static_cast<std::uint64_t>(std::min(gather_cap(p), widest[p.experts ? 1 : 0])) *
           static_cast<std::uint64_t>(p.world) * d;
  };
  // A group above the cap is gathered in chunks through two staging buffers of its own.
  const auto chunked = [&](const GroupPartition& p) { return p.shard_elems > gather_cap(p); };
  const int n = static_cast<int>(groups.size());
  const auto group = [&](int g) -> const GroupPartition& {
    return groups[static_cast<std::size_t>(g)];
  };
  const auto gather = [&](int g) {
    if (g < 0 || g >= n || group(g).replicated) return;
    if (offloaded[static_cast<std::size_t>(g)]) {  // the shard, fetched for the gather and dropped
      t.take(local(group(g)));
      t.give(local(group(g)));
    }
    t.take(full(group(g)));
    for (int i = 0; chunked(group(g)) && i < 2; ++i) t.take(staging(group(g)));
  };
  const auto ungather = [&](int g) {
    if (g < 0 || g >= n || group(g).replicated) return;
    for (int i = 0; chunked(group(g)) && i < 2; ++i) t.give(staging(group(g)));
    t.give(full(group(g)));
  };
  if (options.stage < 3) {  // the full parameters, gathered in buckets (below) after each step
    for (const auto& p : groups) {
      if (!p.replicated) t.take(full(p));
    }
  }

  // Gradients, from the head down, through the reduction buckets as release_grads and
  // issue_reduce run them.
  struct Held {
    std::uint64_t full = 0;   // the model's full gradient (partitioned), until packed
    std::uint64_t local = 0;  // the engine's buffer, until its reduction is unpacked
  };
  std::vector<Held> held(groups.size());
  // Per axis: replicated, then partitioned.
  std::array<int, 2> worlds{1, 1};
  for (const auto& p : groups) worlds[p.experts ? 1 : 0] = p.world;
  std::array<BucketPacker, 4> packers{
      BucketPacker(bucket_cap_elems(options.reduce_bucket_bytes, d, 1)),
      BucketPacker(bucket_cap_elems(options.reduce_bucket_bytes, d, worlds[0])),
      BucketPacker(bucket_cap_elems(options.reduce_bucket_bytes, d, 1)),
      BucketPacker(bucket_cap_elems(options.reduce_bucket_bytes, d, worlds[1]))};
  struct Pending {
    Bucket bucket;
    std::uint64_t send = 0, recv = 0;
    bool partitioned = false;
  };
  std::optional<Pending> pending;
  const auto finish = [&] {
    if (!pending) return;
    for (const BucketPiece& piece : pending->bucket.pieces) {
      if (!piece.last) continue;
      Held& h = held[static_cast<std::size_t>(piece.group)];
      t.give(std::exchange(h.full, 0));
      t.give(std::exchange(h.local, 0));
    }
    t.give(pending->send);
    t.give(pending->recv);
    pending.reset();
  };
  const auto issue = [&](bool is_partitioned, Bucket bucket) {
    finish();
    const int world = group(bucket.pieces.front().group).world;
    Pending p;
    p.partitioned = is_partitioned;
    const bool whole = bucket.whole_group();
    const auto block = static_cast<std::uint64_t>(bucket.block_elems);
    if (!whole) {
      p.send = block * static_cast<std::uint64_t>(is_partitioned ? world : 1) * d;
      t.take(p.send);
    }
    // Partitioned: this rank's reduced block (a whole group's lands in its own buffer).
    // Replicated: every rank's copy, all-gathered to be summed here (with wide gradients into
    // packed f32 sums, or the group's own buffer).
    p.recv = is_partitioned ? (whole ? 0 : block * gd)
                            : block * static_cast<std::uint64_t>(world) * d +
                                  (options.wide_gradients && !whole ? block * 4 : 0);
    t.take(p.recv);
    if (!whole) {
      for (const BucketPiece& piece : bucket.pieces) {
        if (is_partitioned && piece.last) {
          t.give(std::exchange(held[static_cast<std::size_t>(piece.group)].full, 0));
        }
      }
    }
    p.bucket = std::move(bucket);
    pending = std::move(p);
  };
  // Two steps: the second starts with what the first left in the cache, as every later one does.
  for (int pass = 0; pass < 2; ++pass) {
    if (options.stage == 3) {
      for (int g = 0; g < n; ++g) {  // forward: the group, and the next one gathered ahead
        if (g == 0 || !options.gather_ahead) gather(g);
        if (options.gather_ahead) gather(g + 1);
        ungather(g);
      }
    }
    for (int g = n - 1; g >= 0; --g) {
      const GroupPartition& p = group(g);
      if (p.full_elems == 0) continue;  // another pipeline stage's group
      Held& h = held[static_cast<std::size_t>(g)];
      if (options.stage == 3) {  // backward: the group, and the one below gathered ahead
        if (g == n - 1 || !options.gather_ahead) gather(g);
        if (options.gather_ahead) gather(g - 1);
      }
      if (p.replicated && !options.wide_gradients) {  // the model writes the engine's buffer
        h.local = local(p);
        t.take(h.local);
      } else {  // the model's full gradient, and the engine's buffer the reduction lands in
        h.full = p.replicated ? local(p) : full(p);
        t.take(h.full);
        h.local = reduced(p);
        t.take(h.local);
      }
      BucketPacker& mine = packers[(p.experts ? 2 : 0) + (p.replicated ? 0 : 1)];
      BucketPacker& other = packers[(p.experts ? 2 : 0) + (p.replicated ? 1 : 0)];
      if (auto b = other.flush()) issue(p.replicated, std::move(*b));
      for (Bucket& b : mine.add(g, p.local_elems())) issue(!p.replicated, std::move(b));
      if (options.stage == 3) ungather(g);
    }
    for (std::size_t i = 0; i < packers.size(); ++i) {
      if (auto b = packers[i].flush()) issue(i % 2 == 1, std::move(*b));
    }
    finish();
    t.trim();
    // After the step (stages 1-2), the new parameters' all-gathers, bucketed on each axis.
    for (const bool experts : {false, true}) {
      if (options.stage == 3) break;
      std::vector<std::pair<int, std::int64_t>> shards;
      for (const auto& p : groups) {
        if (!p.replicated && p.shard_elems > 0 && p.experts == experts) {
          shards.emplace_back(p.group, p.shard_elems);
        }
      }
      if (shards.empty()) continue;
      const GroupPartition& first = group(shards.front().first);
      for (const Bucket& b : plan_buckets(shards, gather_cap(first))) {
        if (b.whole_group()) continue;  // straight into the group's full parameters
        const auto block = static_cast<std::uint64_t>(b.block_elems) * d;
        t.take(block);
        t.take(block * static_cast<std::uint64_t>(first.world));
        t.give(block * static_cast<std::uint64_t>(first.world));
        t.give(block);
      }
    }
  }
  return t.peak();
}

}  // namespace

// Fills plan.bytes for the placements already in `plan`.
void count_bytes(const Sizes& z, const PlanOptions& o, MemoryPlan& plan) {
  plan.bytes = {};
  auto add = [&](Tier t, TensorKind k, std::uint64_t b) {
    plan.bytes[static_cast<std::size_t>(t)][static_cast<std::size_t>(k)] += b;
  };
  const bool on_device = plan.optimizer == Tier::kDevice;
  // Homes.
  for (std::size_t i = 0; i < z.work_bytes.size(); ++i) {
    const Tier home = plan.home_of(i, z.frozen[i]);
    add(home, TensorKind::kParameters,
        home == Tier::kDevice ? z.work_bytes[i] : align_up(z.work_bytes[i], io::kIoAlignBytes));
  }
  const std::uint64_t copies = plan.state_copies();
  add(plan.optimizer, TensorKind::kMasterWeights, copies * (on_device ? z.master : z.master_io));
  add(plan.optimizer, TensorKind::kMoments, copies * 2 * (on_device ? z.moment : z.moment_io));
  // The groups the device steps (device_steps): their state there, one copy, and their sums.
  add(Tier::kDevice, TensorKind::kMasterWeights, z.on_device.master);
  add(Tier::kDevice, TensorKind::kMoments, 2 * z.on_device.moment);
  const bool summed_on_device = plan.sums_on_device();
  // Kept gradients, or each group's fp32 sums (the summation tree's partial sums at their most).
  const auto sums = static_cast<std::uint64_t>(plan.accumulators);
  add(plan.gradients, TensorKind::kGradients,
      plan.keep_gradients ? z.grad_work_io : sums * (summed_on_device ? z.f32 : z.f32_io));
  add(Tier::kDevice, TensorKind::kGradients, sums * z.on_device.f32);
  // Summed on the device for a host step: every group's sum is copied to host memory for it.
  if (plan.accumulate_on_device()) add(Tier::kHost, TensorKind::kGradients, z.f32_io);
  // In flight: one group's gradient being made on the device, the working copies the host
  // optimizer writes on their way to another tier (two at a time), gradients landing on the
  // host to be accumulated there (two at a time) and accumulators passing through it.
  // (On a host-addressable device with swap, a whole O_DIRECT block more: TieredStore's
  // direct_device_io.)
  plan.gradient_transit_bytes =
      z.any_trainable()
          ? z.max_grad_io + (o.host_addressable_device && o.has_swap ? io::kIoAlignBytes : 0)
          : 0;
  add(Tier::kDevice, TensorKind::kGradients, plan.gradient_transit_bytes);
  plan.group_in_use_bytes = 0;
  for (std::size_t i = 0; i < z.work_bytes.size(); ++i) {
    const Tier home = plan.home_of(i, z.frozen[i]);
    if (home == Tier::kDevice) continue;
    plan.group_in_use_bytes =
        std::max(plan.group_in_use_bytes, device_bytes_of(o, z.work_bytes[i], home == Tier::kNvme));
  }
  add(Tier::kDevice, TensorKind::kActivations, o.activation_bytes);
  // The gradients' sums of squares (one double per group): pinned in host memory, and on a
  // device that cannot address it in device scratch too.
  const std::uint64_t norm_bytes = gradient_norm_bytes(z.elems.size());
  add(Tier::kHost, TensorKind::kStaging,
      static_cast<std::uint64_t>(mem::HostBlockCache::class_bytes(norm_bytes)));
  if (!o.host_addressable_device) add(Tier::kDevice, TensorKind::kStaging, norm_bytes);
  // The model's pinned host buffer.
  if (o.host_io_bytes != 0) {
    add(Tier::kHost, TensorKind::kStaging,
        static_cast<std::uint64_t>(mem::HostBlockCache::class_bytes(o.host_io_bytes)));
  }
  // Checkpointed activations: all of them in their home tier; off the device, three there at
  // once (the one being written, the last one on its way down, the one fetched back ahead).
  const auto checkpoints = static_cast<std::uint64_t>(o.num_checkpoints);
  if (plan.checkpoints == Tier::kDevice) {
    add(Tier::kDevice, TensorKind::kActivations, checkpoints * o.checkpoint_bytes);
  } else {
    const std::uint64_t host_block =
        static_cast<std::uint64_t>(mem::HostBlockCache::class_bytes(o.checkpoint_bytes));
    // A transient tensor's device copy, as the store allocates it (whole O_DIRECT blocks where
    // NVMe reads and writes it in place); on NVMe it goes down and comes back directly, never
    // through a host copy.
    const std::uint64_t device_copy =
        device_bytes_of(o, o.checkpoint_bytes, /*touches_nvme=*/true);  // transient: may drain
    add(Tier::kDevice, TensorKind::kActivations,
        std::min<std::uint64_t>(3, checkpoints) * device_copy);
    add(plan.checkpoints, TensorKind::kActivations,
        checkpoints * (plan.checkpoints == Tier::kHost
                           ? host_block
                           : align_up(o.checkpoint_bytes, io::kIoAlignBytes)));
  }
  if ((summed_on_device || z.on_device.elems != 0) && o.compute_dtype != DType::kF32) {
    add(Tier::kDevice, TensorKind::kStaging, z.max_f32_io);  // the widened gradient
  }
  // Loading passes each group through the host: its master weights (when they live elsewhere)
  // beside its working copy (likewise); the host optimizer's output copies take the latter's
  // place later.
  if (plan.optimizer != Tier::kHost || z.on_device.elems != 0) {
    add(Tier::kHost, TensorKind::kMasterWeights, z.max_f32_io);
  }
  add(Tier::kHost, TensorKind::kParameters, 2 * max_work_io_off(z, plan, Tier::kHost));
  if (!summed_on_device && !plan.keep_gradients) {
    add(Tier::kHost, TensorKind::kGradients, 2 * z.max_grad_io_off);
    // Sums homed on NVMe pass through host memory: two groups' at once, and a merge of two
    // partial sums pins both.
    if (plan.gradients == Tier::kNvme) {
      add(Tier::kHost, TensorKind::kGradients, (sums > 1 ? 3 : 2) * z.max_f32_io_off);
    }
  }
  add(Tier::kHost, TensorKind::kStaging,
      static_cast<std::uint64_t>(plan.staging_buffer_bytes) * plan.num_staging_buffers +
          plan.optimizer_staging_bytes);
  count_caches(z, o, plan);
}

void count_peaks(const Partition& partition, const PlanOptions& o, MemoryPlan& plan) {
  const std::uint64_t working = plan.kind_bytes(plan.params, TensorKind::kParameters);
  const auto capped = [](std::uint64_t bytes, std::uint64_t budget) {
    return budget == 0 ? bytes : std::min(bytes, budget);
  };
  const auto cache = [&](Tier t) { return plan.cache_bytes[static_cast<std::size_t>(t)]; };
  const auto tier = [](Tier t) { return static_cast<std::size_t>(t); };
  // Host: the block cache, and clean copies of working copies that live on NVMe.
  const std::uint64_t host = plan.tier_bytes(Tier::kHost);
  std::uint64_t host_cached = cache(Tier::kHost);
  if (plan.params == Tier::kNvme && o.host_budget_bytes != 0) host_cached += working;
  plan.peak_bytes[tier(Tier::kHost)] =
      std::max(host, capped(host + host_cached, o.host_budget_bytes));
  // Device: the cache of dropped blocks and clean working copies fetched for compute (those
  // homed off it: on the params tier, whose parameters are only theirs).
  const bool offloaded = plan.params != Tier::kDevice;
  std::uint64_t device = plan.tier_bytes(Tier::kDevice);
  std::uint64_t device_cached = cache(Tier::kDevice) + (offloaded ? working : 0);
  const model::ParamLayout& local = partition.local_layout();
  std::vector<bool> group_offloaded;
  for (const GroupPartition& g : partition.groups()) {
    group_offloaded.push_back(plan.home_of(static_cast<std::size_t>(g.group),
                                           local.group(g.group).frozen) != Tier::kDevice);
  }
  const std::uint64_t collectives = collective_peak_bytes(
      partition, o, group_offloaded, mem::StoreOptions{}.device_cache_blocks_per_size);
  if (collectives != 0) {
    // ZeRO's buffers hold the gradients in transit, the shard store's included, and the working
    // copies of partitioned groups; the replicated ones stay cached as on one rank.
    plan.collective_bytes =
        collectives > plan.gradient_transit_bytes ? collectives - plan.gradient_transit_bytes : 0;
    device += plan.collective_bytes;
    device_cached = 0;
    for (const GroupPartition& g : partition.groups()) {
      if (group_offloaded[static_cast<std::size_t>(g.group)] && g.replicated) {
        device_cached += align_up(model::working_bytes(local.group(g.group), o.compute_dtype),
                                  io::kIoAlignBytes);
      }
    }
  }
  plan.peak_bytes[tier(Tier::kDevice)] =
      std::max(device, capped(device + device_cached, o.device_budget_bytes));
  plan.peak_bytes[tier(Tier::kNvme)] = plan.tier_bytes(Tier::kNvme);
  plan.device_is_host_memory = o.host_addressable_device;
}

}  // namespace strata::zero::detail
