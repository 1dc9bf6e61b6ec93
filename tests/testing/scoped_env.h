// An environment variable set for one test: the previous value (or its absence) comes back when
// the test ends, however it ends.
#pragma once

#include <stdlib.h>

#include <optional>
#include <utility>
#include <string>

namespace strata::testing {

class ScopedEnv {
 public:
  ScopedEnv(std::string name, const std::string& value) : name_(std::move(name)) {
    const char* old = ::getenv(name_.c_str());  // NOLINT(concurrency-mt-unsafe)
    if (old != nullptr) saved_ = old;
    set(value);
  }
  ~ScopedEnv() {
    if (saved_) {
      ::setenv(name_.c_str(), saved_->c_str(), 1);  // NOLINT(concurrency-mt-unsafe)
    } else {
      ::unsetenv(name_.c_str());  // NOLINT(concurrency-mt-unsafe)
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

  void set(const std::string& value) {
    ::setenv(name_.c_str(), value.c_str(), 1);  // NOLINT(concurrency-mt-unsafe)
  }
  void unset() { ::unsetenv(name_.c_str()); }  // NOLINT(concurrency-mt-unsafe)

 private:
  std::string name_;
  std::optional<std::string> saved_;
};

}  // namespace strata::testing
