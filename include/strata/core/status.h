// Status and Result<T>: how failures from outside the program (config, files, I/O) travel upward.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

#include "strata/core/check.h"

namespace strata {

enum class StatusCode : std::uint8_t {
  kOk = 0,
  kInvalidArgument,  // bad config value, bad flag
  kNotFound,         // missing file or key
  kDataLoss,         // malformed or truncated file
  kIoError,          // read/write/fsync failed
  kOutOfMemory,      // a tier's budget or the host is exhausted
  kFailedPrecondition,
  kUnavailable,  // backend not present (no GPU, no io_uring)
  kCancelled,    // Ctrl-C
  kInternal,
};

std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return Status(); }
  bool is_ok() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return is_ok(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "<code>: <message>"
  std::string to_string() const;
  // Prefixes context ("while loading X: ") to the message; keeps the code.
  Status with_context(std::string_view context) const;
  void ignore() const {}

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string msg) {
  return {StatusCode::kInvalidArgument, std::move(msg)};
}
inline Status not_found(std::string msg) { return {StatusCode::kNotFound, std::move(msg)}; }
inline Status data_loss(std::string msg) { return {StatusCode::kDataLoss, std::move(msg)}; }
inline Status io_error(std::string msg) { return {StatusCode::kIoError, std::move(msg)}; }
inline Status out_of_memory(std::string msg) { return {StatusCode::kOutOfMemory, std::move(msg)}; }
inline Status failed_precondition(std::string msg) {
  return {StatusCode::kFailedPrecondition, std::move(msg)};
}
inline Status unavailable(std::string msg) { return {StatusCode::kUnavailable, std::move(msg)}; }
inline Status cancelled(std::string msg) { return {StatusCode::kCancelled, std::move(msg)}; }
inline Status internal_error(std::string msg) { return {StatusCode::kInternal, std::move(msg)}; }

// Errno-based I/O error: "<what> <path>: <strerror(err)>".
Status errno_status(int err, std::string_view what, std::string_view path);

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    STRATA_CHECK(!std::get<Status>(v_).is_ok(), "Result constructed from an OK status");
  }

  bool is_ok() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return is_ok(); }
  const Status& status() const {
    static const Status kOkStatus;
    return is_ok() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & {
    STRATA_CHECK(is_ok(), "value() on an error Result", status().to_string());
    return std::get<T>(v_);
  }
  const T& value() const& {
    STRATA_CHECK(is_ok(), "value() on an error Result", status().to_string());
    return std::get<T>(v_);
  }
  T&& value() && {
    STRATA_CHECK(is_ok(), "value() on an error Result", status().to_string());
    return std::get<T>(std::move(v_));
  }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace strata

#define STRATA_CONCAT_INNER_(a, b) a##b
#define STRATA_CONCAT_(a, b) STRATA_CONCAT_INNER_(a, b)

#define STRATA_RETURN_IF_ERROR(expr)                    \
  do {                                                  \
    ::strata::Status strata_status_ = (expr);           \
    if (!strata_status_.is_ok()) return strata_status_; \
  } while (0)

#define STRATA_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.is_ok()) return tmp.status();              \
  lhs = std::move(tmp).value()

// STRATA_ASSIGN_OR_RETURN(auto x, make_x()); returns the error status if make_x() failed.
#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_ASSIGN_OR_RETURN_IMPL_(STRATA_CONCAT_(strata_result_, __LINE__), lhs, expr)
