// The canonical order of a step's gradient sums: one tree over the global batch's micro-batches,
// whatever the number of data-parallel ranks, so a run on 1, 2 or 4 ranks sums the same numbers
// in the same pairs and gets the same bits.
//
// The tree over n leaves (in order): n cut into blocks of the powers of two of its binary digits,
// largest first (12 = 8 + 4: leaves 0-7, then 8-11); each block a perfect binary tree (pairs,
// then pairs of pairs); the blocks' sums added left to right. Every aligned run of 2^k leaves
// inside a block of at least 2^k is a subtree, so with D ranks (a power of two dividing the
// number of micro-batches M; rank r runs micro-batches r, D + r, 2D + r, ...) each cross-rank
// reduction of the micro-batches at one local step sums a subtree of D leaves (dist::tree_fold
// pairs the ranks so), and a rank's local sums of those, in this same tree over its M / D steps,
// complete the rest of the tree: the binary digits of M / D are those of M shifted by log2 D.
#pragma once

#include <cstdint>
#include <vector>

namespace strata {

// Sums a rank's micro-batch gradients, as they arrive, into a pool of fp32 buffers in the
// canonical tree's order (or left to right, a running sum, when not `canonical`). Says what to do
// with each arrival; holds no memory itself. A micro-batch that brings a group no gradient (an
// expert no token chose) is a zero leaf: nothing is added for it, and adding a zero would not
// change a bit (every sum starts from +0, as a fresh accumulator does).
class SummationTree {
 public:
  struct Op {
    enum class Kind : std::uint8_t {
      kStore,  // buffer `into` = +0 + the arrival (a fresh accumulator)
      kAdd,    // buffer `into` += the arrival
      kMerge,  // buffer `into` += buffer `from`; `from` is free afterwards
    };
    Kind kind = Kind::kStore;
    int into = 0;
    int from = -1;
  };

  // Over `leaves` leaves (a rank's micro-batches in a step, >= 1).
  SummationTree(std::int64_t leaves, bool canonical);

  // The most buffers the sums take at once (every leaf present: the worst case).
  static int buffers_needed(std::int64_t leaves, bool canonical);

  // Leaf `leaf` arrives (increasing within a step; any skipped are zeros): what to do with it.
  std::vector<Op> arrive(std::int64_t leaf);
  // Every leaf not arrived yet is a zero: the merges still owed (may be none).
  std::vector<Op> finish();
  // The first leaf that may still arrive.
  std::int64_t next() const { return next_; }
  // The buffer that holds the sum once finish() ran: 0 (the first buffer stored into is the
  // bottom of the tree, which every later sum joins), or -1 when every leaf was a zero.
  int result() const { return acc_; }
  // A new step: every buffer free, no leaf arrived.
  void reset();

 private:
  struct Entry {
    int level = 0;
    int buffer = -1;  // -1: a sum of zeros
  };
  static constexpr int kZero = -1;     // a sum of zero leaves: no buffer
  static constexpr int kArrival = -2;  // the leaf arriving now, not yet in a buffer
  // Moves the tree past leaf next_, which is `leaf` (kArrival or kZero).
  void step(int leaf, std::vector<Op>& ops);
  // a + b (a a buffer or kZero; b any): the buffer or leaf that holds the sum.
  int combine(int a, int b, std::vector<Op>& ops);
  // `sum` in a buffer: the arrival stored into a free one.
  int held(int sum, std::vector<Op>& ops);
  int take();

  std::int64_t leaves_;
  bool canonical_;
  std::vector<int> block_levels_;  // log2 of each block's size, largest first
  std::size_t block_ = 0;          // the block the next leaf belongs to
  std::int64_t next_ = 0;          // the next leaf
  std::vector<Entry> stack_;
  std::vector<bool> busy_;  // by buffer: holds a sum now
  int acc_ = -1;
};

// The canonical tree's sum of `leaves` f32 values all at hand (leaf(i) gives the i-th), in f32,
// each leaf starting from +0: what SummationTree's ops make of them, for one element. Keeps a
// binary counter's stack of partial sums (one per level, 63 levels at most).
template <typename Leaf>
float canonical_sum(std::int64_t leaves, Leaf leaf) {
  float partial[64];
  int level[64];
  int depth = 0;
  float sum = 0.0f;
  bool any = false;
  std::int64_t next = 0;
  for (int block = 62; block >= 0; --block) {  // blocks by the binary digits, largest first
    if (((leaves >> block) & 1) == 0) continue;
    for (const std::int64_t end = next + (std::int64_t{1} << block); next < end; ++next) {
      float carry = 0.0f + leaf(next);
      int at = 0;
      while (depth > 0 && level[depth - 1] == at) {
        carry = partial[--depth] + carry;
        ++at;
      }
      partial[depth] = carry;
      level[depth++] = at;
    }
    sum = any ? sum + partial[--depth] : partial[--depth];  // the block's perfect tree
    any = true;
  }
  return sum;
}

}  // namespace strata
