// SummationTree: the canonical tree's sums as a stack of perfect subtrees (a binary counter).
#include "strata/core/summation_tree.h"

#include <algorithm>

#include "strata/core/check.h"

namespace strata {

SummationTree::SummationTree(std::int64_t leaves, bool canonical)
    : leaves_(leaves), canonical_(canonical) {
  STRATA_CHECK(leaves >= 1, "a summation tree needs a leaf", leaves);
  if (canonical) {
    for (int level = 62; level >= 0; --level) {
      if ((leaves >> level) & 1) block_levels_.push_back(level);
    }
  }
}

int SummationTree::buffers_needed(std::int64_t leaves, bool canonical) {
  SummationTree tree(leaves, canonical);
  std::size_t most = 0;
  for (std::int64_t leaf = 0; leaf < leaves; ++leaf) {
    (void)tree.arrive(leaf);
    most = std::max(most, tree.busy_.size());
  }
  return static_cast<int>(std::max<std::size_t>(most, 1));
}

void SummationTree::reset() {
  block_ = 0;
  next_ = 0;
  stack_.clear();
  std::fill(busy_.begin(), busy_.end(), false);
  acc_ = kZero;
}

std::vector<SummationTree::Op> SummationTree::arrive(std::int64_t leaf) {
  STRATA_CHECK(leaf >= next_ && leaf < leaves_, "leaves arrive in order, once each", leaf, next_,
               leaves_);
  std::vector<Op> ops;
  while (next_ < leaf) step(kZero, ops);
  step(kArrival, ops);
  return ops;
}

std::vector<SummationTree::Op> SummationTree::finish() {
  std::vector<Op> ops;
  while (next_ < leaves_) step(kZero, ops);
  return ops;
}

void SummationTree::step(int leaf, std::vector<Op>& ops) {
  // Without the canonical tree every leaf is a block of its own: a running sum.
  const int target = canonical_ ? block_levels_[block_] : 0;
  Entry carry{0, leaf};
  while (carry.level < target && !stack_.empty() && stack_.back().level == carry.level) {
    carry = Entry{carry.level + 1, combine(stack_.back().buffer, carry.buffer, ops)};
    stack_.pop_back();
  }
  if (carry.level == target) {  // a block is whole: into the sum of the blocks before it
    acc_ = held(combine(acc_, carry.buffer, ops), ops);
    ++block_;
  } else {
    stack_.push_back(Entry{carry.level, held(carry.buffer, ops)});
  }
  ++next_;
}

int SummationTree::combine(int a, int b, std::vector<Op>& ops) {
  if (b == kZero) return a;
  if (a == kZero) return b;
  if (b == kArrival) {
    ops.push_back(Op{Op::Kind::kAdd, a, -1});
    return a;
  }
  ops.push_back(Op{Op::Kind::kMerge, a, b});
  busy_[static_cast<std::size_t>(b)] = false;
  return a;
}

int SummationTree::held(int sum, std::vector<Op>& ops) {
  if (sum != kArrival) return sum;
  const int buffer = take();
  ops.push_back(Op{Op::Kind::kStore, buffer, -1});
  return buffer;
}

int SummationTree::take() {
  for (std::size_t i = 0; i < busy_.size(); ++i) {
    if (!busy_[i]) {
      busy_[i] = true;
      return static_cast<int>(i);
    }
  }
  busy_.push_back(true);
  return static_cast<int>(busy_.size() - 1);
}

}  // namespace strata
