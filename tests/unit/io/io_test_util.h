// Shared helpers for the io tests: temporary swap directories, random buffers, engine lists.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "strata/build_config.h"
#include "strata/core/aligned.h"
#include "strata/core/rng.h"
#include "strata/io/swap.h"

namespace strata::io::testing {

// A fresh directory under /tmp, removed with everything in it at the end of the test.
class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/strata-io-test-XXXXXX";
    const char* made = ::mkdtemp(tmpl);
    EXPECT_NE(made, nullptr) << "mkdtemp failed: " << std::strerror(errno);
    path_ = made != nullptr ? made : "";
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// Several temp dirs, one per simulated drive.
class TempDirs {
 public:
  explicit TempDirs(int n) : dirs_(n) {}
  std::vector<std::string> paths() const {
    std::vector<std::string> out;
    for (const TempDir& d : dirs_) out.push_back(d.path());
    return out;
  }
  const TempDir& operator[](int i) const { return dirs_[i]; }

 private:
  std::vector<TempDir> dirs_;
};

inline void fill_random(std::byte* p, std::size_t n, Rng& rng) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const std::uint64_t v = rng.next_u64();
    std::memcpy(p + i, &v, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<std::byte>(rng.next_u64());
}

inline AlignedBuffer random_buffer(std::size_t n, Rng& rng) {
  AlignedBuffer buf(n);
  fill_random(buf.data(), n, rng);
  return buf;
}

// First index where two byte ranges differ, or -1: a readable failure instead of a memcmp bool.
inline std::int64_t first_mismatch(const std::byte* a, const std::byte* b, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    if (a[i] != b[i]) return static_cast<std::int64_t>(i);
  }
  return -1;
}

inline bool uring_compiled() { return STRATA_HAVE_URING != 0; }

// Every engine a test should cover; "uring" is skipped by the test itself when unavailable.
inline std::vector<std::string> all_engines() { return {"uring", "posix", "memory"}; }

// Options for `engine` over `paths`; memory ignores the directories except for naming. Besides
// the engine names, "uring_caller" is io_uring driven by the callers' threads, "uring_4rings"
// io_uring with four rings and driver threads, "uring_2rings_caller" both, "uring_sqpoll" one
// ring with an SQPOLL kernel thread.
inline SwapOptions make_options(const std::string& engine, std::vector<std::string> paths) {
  SwapOptions o;
  o.engine = parse_swap_engine(engine).value_or(SwapEngine::kUring);
  o.paths = std::move(paths);
  o.block_size_bytes = 64 * 1024;
  o.queue_depth = 8;
  if (engine.starts_with("uring_")) {
    o.engine = SwapEngine::kUring;
    o.caller_driven = engine.ends_with("_caller");
    o.sqpoll = engine == "uring_sqpoll";
    if (engine.starts_with("uring_4rings")) o.thread_count = 4;
    if (engine.starts_with("uring_2rings")) o.thread_count = 2;
  }
  return o;
}

// Creates a swap space, or skips the test when io_uring was asked for and cannot run here.
#define STRATA_CREATE_SWAP_OR_SKIP(var, options)                                       \
  auto var##_result = ::strata::io::SwapSpace::create(options);                        \
  if (!var##_result.is_ok() && (options).engine == ::strata::io::SwapEngine::kUring && \
      var##_result.status().code() == ::strata::StatusCode::kUnavailable) {            \
    GTEST_SKIP() << "io_uring unavailable: " << var##_result.status().message();       \
  }                                                                                    \
  ASSERT_TRUE(var##_result.is_ok()) << var##_result.status().to_string();              \
  std::unique_ptr<::strata::io::SwapSpace> var = std::move(var##_result).value()

}  // namespace strata::io::testing
