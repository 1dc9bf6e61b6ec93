// Decides, attempt by attempt, whether an engine operation is shortened or failed (tests only).
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "strata/io/fault_injection.h"

namespace strata::io {

struct FaultDecision {
  int error = 0;               // nonzero: fail the attempt with this errno, touching nothing
  std::size_t size_bytes = 0;  // otherwise: transfer this many bytes (less than asked: short)
};

// Thread-safe. Engines call it once per attempt, in the order they issue attempts.
class FaultInjector {
 public:
  explicit FaultInjector(const FaultInjection& config);

  // op is kRead or kWrite; swap_offset is where the attempt starts in swap-space coordinates.
  FaultDecision on_transfer(FaultOp op, int file, std::uint64_t swap_offset,
                            std::size_t size_bytes);
  // Returns an errno to fail the growth of `file` with, or 0.
  int on_grow(int file);
  std::uint64_t fired() const;

 private:
  struct RuleState {
    FaultRule rule;
    std::uint64_t matched = 0;
  };
  // Returns the rule that fires for this attempt, or null.
  const FaultRule* match(FaultOp op, int file, std::uint64_t begin, std::uint64_t end,
                         bool can_shorten);

  mutable std::mutex mu_;
  std::vector<RuleState> rules_;
  std::uint64_t fired_ = 0;
};

}  // namespace strata::io
