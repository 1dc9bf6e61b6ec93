// Per-op time of the CPU backend's op table, for benchmarks: every CPU device created while
// the environment has STRATA_OP_PROFILE=1 wraps its ops in a timer (the CPU backend's ops
// finish before they return, so wall time is the op's time). Off, nothing is timed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace strata::device {

struct OpTime {
  std::string op;  // "gemm", "attention_forward", ...
  std::uint64_t calls = 0;
  double seconds = 0;
  double flops = 0;  // multiply-adds count 2 (GEMM and attention's products only)
  double bytes = 0;  // tensors read and written once each, at their storage size
};

// Totals over every profiled device in this process since the last reset, slowest op first.
std::vector<OpTime> op_profile();
void reset_op_profile();

}  // namespace strata::device
