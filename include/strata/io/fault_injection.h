// Fault injection for swap I/O tests: make chosen requests come back short or fail with an errno.
#pragma once

#include <cerrno>
#include <cstdint>
#include <limits>
#include <vector>

namespace strata::io {

// Which engine operation a rule applies to. kGrow is the fallocate that extends a swap file.
enum class FaultOp : std::uint8_t { kRead, kWrite, kAny, kGrow };

enum class FaultKind : std::uint8_t {
  kShort,  // the attempt transfers only half its bytes (aligned down to 4096); the engine must
           // resubmit the rest. Attempts of 4096 bytes or less cannot be shortened and never match.
  kError,  // the attempt fails with `error` (EIO, ENOSPC; EINTR and EAGAIN exercise the retries)
};

// One rule. An "attempt" is one chunk the engine hands to the kernel (a request is split into
// block_size_bytes chunks at stripe boundaries; a resubmitted remainder is a new attempt).
// Attempts are matched in the order the engine issues them, so with one submitting thread and
// queue_depth 1 the Nth attempt is deterministic.
struct FaultRule {
  FaultOp op = FaultOp::kWrite;
  FaultKind kind = FaultKind::kError;
  int error = EIO;
  int file_index = -1;  // index into SwapOptions::paths; -1 matches every file
  // Swap-space byte range (Extent::offset coordinates) the attempt must overlap. Ignored for kGrow.
  std::uint64_t swap_offset_begin = 0;
  std::uint64_t swap_offset_end = std::numeric_limits<std::uint64_t>::max();
  std::uint64_t skip = 0;  // let this many matching attempts pass first (skip = N: the N+1th fails)
  std::uint64_t times = 1;  // then fire this many times; kForever keeps firing
  static constexpr std::uint64_t kForever = std::numeric_limits<std::uint64_t>::max();
};

// Rules are checked in order; the first one that fires decides the attempt. Empty: no faults.
struct FaultInjection {
  std::vector<FaultRule> rules;
  // Setting up an io_uring ring fails with EPERM, as under a seccomp profile that blocks it:
  // engine "auto" must fall back to posix (saying so), engine "uring" must refuse.
  bool fail_uring_setup = false;
  // Opening a swap file with O_DIRECT fails with EINVAL, as on a file system without it: the
  // swap space must continue with buffered I/O (saying so).
  bool refuse_direct = false;
  bool empty() const { return rules.empty() && !fail_uring_setup && !refuse_direct; }
};

}  // namespace strata::io
