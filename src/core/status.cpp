// Status formatting and the STRATA_CHECK failure path.
#include "strata/core/status.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "strata/core/check.h"

namespace strata {

std::string_view status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return "ok";
    case StatusCode::kInvalidArgument:
      return "invalid argument";
    case StatusCode::kNotFound:
      return "not found";
    case StatusCode::kDataLoss:
      return "data loss";
    case StatusCode::kIoError:
      return "I/O error";
    case StatusCode::kOutOfMemory:
      return "out of memory";
    case StatusCode::kFailedPrecondition:
      return "failed precondition";
    case StatusCode::kUnavailable:
      return "unavailable";
    case StatusCode::kCancelled:
      return "cancelled";
    case StatusCode::kInternal:
      return "internal error";
  }
  return "unknown";
}

std::string Status::to_string() const {
  if (is_ok()) return "ok";
  return std::string(status_code_name(code_)) + ": " + message_;
}

Status Status::with_context(std::string_view context) const {
  if (is_ok()) return *this;
  return Status(code_, std::string(context) + ": " + message_);
}

Status errno_status(int err, std::string_view what, std::string_view path) {
  StatusCode code = StatusCode::kIoError;
  if (err == ENOENT) code = StatusCode::kNotFound;
  if (err == ENOMEM) code = StatusCode::kOutOfMemory;
  return Status(code, std::string(what) + " " + std::string(path) + ": " + std::strerror(err));
}

namespace detail {

namespace {
std::atomic<int> check_rank{0};
}  // namespace

void set_check_rank(int rank) { check_rank.store(rank, std::memory_order_relaxed); }

[[noreturn]] void check_failed(const char* expr, const char* file, int line,
                               const std::string& detail) {
  std::fprintf(stderr, "STRATA_CHECK failed: %s%s at %s:%d (rank %d)\n", expr, detail.c_str(), file,
               line, check_rank.load(std::memory_order_relaxed));
  std::fflush(stderr);
  std::abort();
}

}  // namespace detail
}  // namespace strata
