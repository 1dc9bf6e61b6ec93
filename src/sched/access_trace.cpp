// AccessTrace: recorded order plus per-handle position lists and byte prefix sums.
#include "strata/sched/access_trace.h"

#include <algorithm>

namespace strata::sched {

void AccessTrace::clear() {
  order_.clear();
  prefix_.assign(1, 0);
  distinct_.clear();
  positions_.clear();
}

void AccessTrace::push(mem::Handle h, std::uint64_t bytes) {
  auto& pos = positions_[mem::handle_index(h)];
  if (pos.empty()) distinct_.push_back(h);
  pos.push_back(order_.size());
  order_.push_back(h);
  prefix_.push_back(prefix_.back() + bytes);
}

std::size_t AccessTrace::next_use(mem::Handle h, std::size_t from) const {
  auto it = positions_.find(mem::handle_index(h));
  if (it == positions_.end()) return kNone;
  const auto& pos = it->second;
  auto p = std::lower_bound(pos.begin(), pos.end(), from);
  return p == pos.end() ? kNone : *p;
}

}  // namespace strata::sched
