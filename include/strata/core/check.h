// STRATA_CHECK: always-on invariant checks. A failed check is a bug and aborts with context.
#pragma once

#include <sstream>
#include <string>

namespace strata::detail {

[[noreturn]] void check_failed(const char* expr, const char* file, int line,
                               const std::string& detail);
// The rank a failed check names: this process's, set when its communicator is made (0 before).
void set_check_rank(int rank);

inline void append_values(std::ostringstream&) {}
template <typename T, typename... Rest>
void append_values(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << ' ' << v;
  append_values(os, rest...);
}

template <typename... Values>
std::string format_values(const Values&... values) {
  std::ostringstream os;
  append_values(os, values...);
  return os.str();
}

}  // namespace strata::detail

// STRATA_CHECK(cond, "message", value1, value2...). Never put side effects in cond.
#define STRATA_CHECK(cond, ...)                                                     \
  do {                                                                              \
    if (!(cond)) [[unlikely]] {                                                     \
      ::strata::detail::check_failed(#cond, __FILE__, __LINE__,                     \
                                     ::strata::detail::format_values(__VA_ARGS__)); \
    }                                                                               \
  } while (0)
