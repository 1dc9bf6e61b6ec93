// zero_device_bytes: the device memory a ZeroProvider holds, walked through a step as the
// provider runs it, without a provider (strata estimate plans with it).
#include <algorithm>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "strata/zero/zero_provider.h"

namespace strata::zero {

namespace {

// Device buffers taken and given back, with the store's cache of given-back blocks by size.
class DeviceTally {
 public:
  explicit DeviceTally(int keep) : keep_(keep) {}
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

}  // namespace

std::uint64_t zero_device_bytes(const Partition& partition, const ZeroOptions& options,
                                bool params_offloaded, int cache_blocks_per_size) {
  const int world = partition.world();
  const auto& groups = partition.groups();
  bool any = false;
  for (const auto& p : groups) any = any || !p.replicated;
  if (world == 1 || !any) return 0;
  const std::uint64_t d = dtype_size(options.compute_dtype);
  DeviceTally t(cache_blocks_per_size);
  const auto full = [&](const GroupPartition& p) {
    return static_cast<std::uint64_t>(p.padded_elems) * d;
  };
  const auto local = [&](const GroupPartition& p) {
    return static_cast<std::uint64_t>(p.local_elems()) * d;
  };

  // Parameters. Stages 1-2 hold every group's; stage 3 gathers each in use, one ahead.
  const std::int64_t gather_cap = bucket_cap_elems(options.allgather_bucket_bytes, d, world);
  std::int64_t widest = 0;
  for (const auto& p : groups) widest = p.replicated ? widest : std::max(widest, p.shard_elems);
  const std::uint64_t staging = static_cast<std::uint64_t>(std::min(gather_cap, widest)) *
                                static_cast<std::uint64_t>(world) * d;
  // A group above the cap is gathered in chunks through two staging buffers of its own.
  const auto chunked = [&](const GroupPartition& p) { return p.shard_elems > gather_cap; };
  const int n = static_cast<int>(groups.size());
  const auto group = [&](int g) -> const GroupPartition& {
    return groups[static_cast<std::size_t>(g)];
  };
  const auto gather = [&](int g) {
    if (g < 0 || g >= n || group(g).replicated) return;
    if (params_offloaded) {  // the shard's working copy, fetched for the gather and dropped
      t.take(local(group(g)));
      t.give(local(group(g)));
    }
    t.take(full(group(g)));
    for (int i = 0; chunked(group(g)) && i < 2; ++i) t.take(staging);
  };
  const auto ungather = [&](int g) {
    if (g < 0 || g >= n || group(g).replicated) return;
    for (int i = 0; chunked(group(g)) && i < 2; ++i) t.give(staging);
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
  BucketPacker replicated(bucket_cap_elems(options.reduce_bucket_bytes, d, 1));
  BucketPacker partitioned(bucket_cap_elems(options.reduce_bucket_bytes, d, world));
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
    Pending p;
    p.partitioned = is_partitioned;
    const bool whole = bucket.whole_group();
    const auto block = static_cast<std::uint64_t>(bucket.block_elems);
    if (!whole) {
      p.send = block * static_cast<std::uint64_t>(is_partitioned ? world : 1) * d;
      t.take(p.send);
      if (is_partitioned && options.stage != 1) {
        p.recv = block * d;
        t.take(p.recv);
      }
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
      Held& h = held[static_cast<std::size_t>(g)];
      if (options.stage == 3) {  // backward: the group, and the one below gathered ahead
        if (g == n - 1 || !options.gather_ahead) gather(g);
        if (options.gather_ahead) gather(g - 1);
      }
      if (p.replicated) {
        h.local = local(p);
        t.take(h.local);
      } else {
        h.full = full(p);
        t.take(h.full);
        h.local = local(p);
        t.take(h.local);
      }
      BucketPacker& mine = p.replicated ? replicated : partitioned;
      BucketPacker& other = p.replicated ? partitioned : replicated;
      if (auto b = other.flush()) issue(p.replicated, std::move(*b));
      for (Bucket& b : mine.add(g, p.local_elems())) issue(!p.replicated, std::move(b));
      if (options.stage == 3) ungather(g);
    }
    if (auto b = replicated.flush()) issue(false, std::move(*b));
    if (auto b = partitioned.flush()) issue(true, std::move(*b));
    finish();
    t.trim();
    if (options.stage < 3) {  // after the step, the new parameters' all-gathers, bucketed
      std::vector<std::pair<int, std::int64_t>> shards;
      for (const auto& p : groups) {
        if (!p.replicated) shards.emplace_back(p.group, p.shard_elems);
      }
      for (const Bucket& b : plan_buckets(shards, gather_cap)) {
        if (b.whole_group()) continue;  // straight into the group's full parameters
        const auto block = static_cast<std::uint64_t>(b.block_elems) * d;
        t.take(block);
        t.take(block * static_cast<std::uint64_t>(world));
        t.give(block * static_cast<std::uint64_t>(world));
        t.give(block);
      }
    }
  }
  return t.peak();
}

}  // namespace strata::zero
