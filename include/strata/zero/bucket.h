// Bucketing of ZeRO's collectives (reduce_bucket_bytes, allgather_bucket_bytes): consecutive
// groups are coalesced into one collective and groups larger than the cap are split, so every
// collective moves at most the cap and small groups do not each pay a collective's latency.
//
// A collective over `blocks` ranks sees each bucket as `blocks` rank blocks of block_elems
// elements. A group contributes a block of the same size per rank (its shard, or the whole group
// when blocks == 1), and a piece of the group is one range [begin, begin + count) of that block,
// taken from every rank's block at once. Rank block r of the bucket holds, piece after piece,
// elements [r * group_block + begin, ... + count) of the group's full layout, so one
// reduce-scatter (or all-gather) delivers (or takes) each rank's pieces as one contiguous range.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace strata::zero {

// Defaults for reduce_bucket_bytes and allgather_bucket_bytes. DeepSpeed's 5e8-element buckets
// are 1-2 GB of device memory that an offloading run's budget rarely has to spare; 64 MiB
// collectives already run at full bandwidth over NVLink, InfiniBand or shared memory (their
// latency is tens of microseconds against milliseconds of transfer).
inline constexpr std::uint64_t kDefaultReduceBucketBytes = std::uint64_t{64} << 20;
inline constexpr std::uint64_t kDefaultAllgatherBucketBytes = std::uint64_t{64} << 20;
// The largest either may be: a bucket lives in device memory, and MPI counts elements in an int.
inline constexpr std::uint64_t kMaxBucketBytes = std::uint64_t{1} << 30;

// The bucket size a run uses: the configured one, but at most 1/16 of the device budget (when
// there is one), so a bucket's memory (up to about twice its size: the open bucket's gradients
// and the packed copy) leaves the rest of the device to parameters and activations. Depends
// only on the config, which every rank shares, so every rank buckets the same way.
std::uint64_t effective_bucket_bytes(std::uint64_t configured, std::uint64_t device_limit_bytes);

struct BucketPiece {
  int group = 0;
  std::int64_t begin = 0;   // first element of the piece within the group's block
  std::int64_t count = 0;   // elements of the piece per rank block
  std::int64_t offset = 0;  // where the piece starts within each rank block of the bucket
  bool last = false;        // the group's final piece: the group is done once this one is
};

struct Bucket {
  std::vector<BucketPiece> pieces;
  std::int64_t block_elems = 0;  // elements per rank block: the collective's per-rank count
  // Exactly one whole group: its own buffer can take the collective, with no packing.
  bool whole_group() const {
    return pieces.size() == 1 && pieces.front().begin == 0 && pieces.front().last;
  }
};

// Elements per rank block that keep a collective over `blocks` rank blocks of `elem_bytes`-byte
// elements within cap_bytes; at least 1.
std::int64_t bucket_cap_elems(std::uint64_t cap_bytes, std::size_t elem_bytes, int blocks);

// Packs groups, in the order they are added, into buckets of at most cap_elems per rank block.
// A group that does not fit in the open bucket closes it first; a group larger than the cap is
// split into cap-sized buckets of its own, and its remainder opens the next bucket. A bucket is
// handed out as soon as it is full.
class BucketPacker {
 public:
  explicit BucketPacker(std::int64_t cap_elems);

  // Adds a group of block_elems (> 0) elements per rank block; returns the buckets it completes.
  std::vector<Bucket> add(int group, std::int64_t block_elems);
  // Closes the open bucket and returns it; nullopt when none is open.
  std::optional<Bucket> flush();
  bool has_open() const { return !open_.pieces.empty(); }
  std::int64_t cap_elems() const { return cap_elems_; }

 private:
  std::int64_t cap_elems_;
  Bucket open_;
};

// Every bucket of a sequence of (group, block_elems), the partial last one included.
std::vector<Bucket> plan_buckets(const std::vector<std::pair<int, std::int64_t>>& groups,
                                 std::int64_t cap_elems);

}  // namespace strata::zero
