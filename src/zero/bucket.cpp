// Bucket planning for ZeRO's collectives: which ranges of which groups share one collective.
#include "strata/zero/bucket.h"

#include <algorithm>

#include "strata/core/check.h"

namespace strata::zero {

std::int64_t bucket_cap_elems(std::uint64_t cap_bytes, std::size_t elem_bytes, int blocks) {
  STRATA_CHECK(elem_bytes > 0 && blocks > 0, "bucket_cap_elems: bad shape", elem_bytes, blocks);
  const std::uint64_t per_block = cap_bytes / (elem_bytes * static_cast<std::uint64_t>(blocks));
  return std::max<std::int64_t>(
      1, static_cast<std::int64_t>(std::min<std::uint64_t>(per_block, std::uint64_t{1} << 62)));
}

BucketPacker::BucketPacker(std::int64_t cap_elems) : cap_elems_(cap_elems) {
  STRATA_CHECK(cap_elems > 0, "bucket cap must be positive", cap_elems);
}

std::vector<Bucket> BucketPacker::add(int group, std::int64_t block_elems) {
  STRATA_CHECK(block_elems > 0, "bucketed group must not be empty", group, block_elems);
  std::vector<Bucket> done;
  if (has_open() && open_.block_elems + block_elems > cap_elems_) done.push_back(*flush());
  for (std::int64_t begin = 0; begin < block_elems;) {
    const std::int64_t take = std::min(cap_elems_ - open_.block_elems, block_elems - begin);
    open_.pieces.push_back(
        BucketPiece{group, begin, take, open_.block_elems, begin + take == block_elems});
    open_.block_elems += take;
    begin += take;
    if (open_.block_elems == cap_elems_) done.push_back(*flush());
  }
  return done;
}

std::optional<Bucket> BucketPacker::flush() {
  if (!has_open()) return std::nullopt;
  Bucket b = std::move(open_);
  open_ = Bucket{};
  return b;
}

std::vector<Bucket> plan_buckets(const std::vector<std::pair<int, std::int64_t>>& groups,
                                 std::int64_t cap_elems) {
  BucketPacker packer(cap_elems);
  std::vector<Bucket> out;
  for (const auto& [group, elems] : groups) {
    for (auto& b : packer.add(group, elems)) out.push_back(std::move(b));
  }
  if (auto b = packer.flush()) out.push_back(std::move(*b));
  return out;
}

std::uint64_t effective_bucket_bytes(std::uint64_t configured, std::uint64_t device_limit_bytes) {
  if (device_limit_bytes == 0) return configured;
  return std::max<std::uint64_t>(1, std::min(configured, device_limit_bytes / 16));
}

}  // namespace strata::zero
