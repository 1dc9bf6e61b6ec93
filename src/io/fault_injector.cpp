// Rule matching for fault injection.
#include "src/io/fault_injector.h"

#include "strata/io/swap.h"

namespace strata::io {

FaultInjector::FaultInjector(const FaultInjection& config) {
  rules_.reserve(config.rules.size());
  for (const FaultRule& rule : config.rules) rules_.push_back({rule, 0});
}

const FaultRule* FaultInjector::match(FaultOp op, int file, std::uint64_t begin, std::uint64_t end,
                                      bool can_shorten) {
  for (RuleState& rs : rules_) {
    const FaultRule& r = rs.rule;
    const bool op_matches = r.op == op || (r.op == FaultOp::kAny && op != FaultOp::kGrow);
    if (!op_matches) continue;
    if (r.file_index >= 0 && r.file_index != file) continue;
    if (op != FaultOp::kGrow && (end <= r.swap_offset_begin || begin >= r.swap_offset_end)) {
      continue;
    }
    if (r.kind == FaultKind::kShort && !can_shorten) continue;
    const std::uint64_t n = rs.matched++;
    if (n < r.skip) continue;
    if (r.times != FaultRule::kForever && n - r.skip >= r.times) continue;
    ++fired_;
    return &r;
  }
  return nullptr;
}

FaultDecision FaultInjector::on_transfer(FaultOp op, int file, std::uint64_t swap_offset,
                                         std::size_t size_bytes) {
  std::lock_guard lock(mu_);
  const bool can_shorten = size_bytes > kIoAlignBytes;
  const FaultRule* r = match(op, file, swap_offset, swap_offset + size_bytes, can_shorten);
  if (r == nullptr) return {0, size_bytes};
  if (r->kind == FaultKind::kError) return {r->error, 0};
  // Half, kept aligned so a shortened O_DIRECT attempt is still a valid one.
  const std::size_t half = size_bytes / 2 / kIoAlignBytes * kIoAlignBytes;
  return {0, half > 0 ? half : kIoAlignBytes};
}

int FaultInjector::on_grow(int file) {
  std::lock_guard lock(mu_);
  const FaultRule* r = match(FaultOp::kGrow, file, 0, 0, false);
  return r != nullptr && r->kind == FaultKind::kError ? r->error : 0;
}

std::uint64_t FaultInjector::fired() const {
  std::lock_guard lock(mu_);
  return fired_;
}

}  // namespace strata::io
