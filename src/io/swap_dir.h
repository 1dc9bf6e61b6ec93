// One swap directory held by this process: its lock file and its swap file.
#pragma once

#include <cstdint>
#include <string>

#include "strata/core/status.h"
#include "strata/core/unique_fd.h"

namespace strata::io {

inline constexpr const char* kLockFileName = "strata.lock";

// "<dir>/strata-<pid>.swap"
std::string swap_file_path(const std::string& dir, long pid);

// Move-only. While it lives, "<dir>/strata.lock" is flock()ed by this process and names its pid,
// so a second swap space on the directory (in any process) is refused. Destruction deletes the
// swap file and the lock file.
class SwapDir {
 public:
  // Checks that `dir` exists and is writable, takes the lock, deletes swap files left by dead
  // processes, and creates this process's swap file (with O_DIRECT if `direct`, unless the file
  // system refuses it: then buffered, and direct_refused() is true so the caller can warn once).
  // simulate_refusal makes the O_DIRECT open fail as such a file system would (tests).
  static Result<SwapDir> open(const std::string& dir, bool direct, bool simulate_refusal = false);

  SwapDir(SwapDir&&) noexcept = default;
  SwapDir& operator=(SwapDir&&) noexcept;
  SwapDir(const SwapDir&) = delete;
  SwapDir& operator=(const SwapDir&) = delete;
  ~SwapDir();

  const std::string& dir() const { return dir_; }
  const std::string& file_path() const { return file_path_; }
  int fd() const { return file_.get(); }
  bool direct_refused() const { return direct_refused_; }
  // Bytes available to this user on the directory's file system, or -1 if statvfs fails.
  std::int64_t free_bytes() const;

 private:
  SwapDir() = default;
  void release();

  std::string dir_;
  std::string lock_path_;
  std::string file_path_;
  UniqueFd lock_;
  UniqueFd file_;
  bool direct_refused_ = false;
};

}  // namespace strata::io
