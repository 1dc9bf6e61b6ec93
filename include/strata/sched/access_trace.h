// AccessTrace: the order in which tensors were used in one pass (a micro-batch's forward and
// backward), with an index for "when is this tensor used next, and how many bytes of other
// accesses lie in between".
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "strata/mem/tiered_store.h"

namespace strata::sched {

class AccessTrace {
 public:
  static constexpr std::size_t kNone = static_cast<std::size_t>(-1);

  void clear();
  void push(mem::Handle h, std::uint64_t bytes);
  // Adds `bytes` to the last access (a routed set's entry: every member its run acquired).
  void add_to_last(std::uint64_t bytes) { prefix_.back() += bytes; }

  std::size_t size() const { return order_.size(); }
  bool empty() const { return order_.empty(); }
  mem::Handle at(std::size_t i) const { return order_[i]; }
  std::uint64_t bytes_at(std::size_t i) const { return prefix_[i + 1] - prefix_[i]; }
  const std::vector<mem::Handle>& order() const { return order_; }
  // Every handle in the trace once, in first-use order.
  const std::vector<mem::Handle>& distinct() const { return distinct_; }

  // First position >= `from` where `h` is used, or kNone.
  std::size_t next_use(mem::Handle h, std::size_t from) const;
  // Bytes of the accesses at positions [begin, end).
  std::uint64_t bytes_between(std::size_t begin, std::size_t end) const {
    return prefix_[end] - prefix_[begin];
  }
  bool same_order(const AccessTrace& other) const { return order_ == other.order_; }

 private:
  std::vector<mem::Handle> order_;
  std::vector<std::uint64_t> prefix_{0};  // prefix_[i] = bytes of positions [0, i)
  std::vector<mem::Handle> distinct_;
  std::unordered_map<std::uint32_t, std::vector<std::size_t>> positions_;
};

}  // namespace strata::sched
