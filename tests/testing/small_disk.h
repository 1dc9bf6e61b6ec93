// A small disk for tests of what happens when one fills: a tmpfs mounted for the test's lifetime.
#pragma once

#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/statvfs.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

namespace strata::testing {

// A tmpfs mounted at `dir` for the test's lifetime: a disk that fills. Mounting needs root (or
// CAP_SYS_ADMIN) and a kernel that allows it; `why` says why not where it cannot.
class SmallDisk {
 public:
  SmallDisk(std::string dir, std::uint64_t size_bytes) : dir_(std::move(dir)) {
    std::filesystem::create_directories(dir_);
    const std::string opts = "size=" + std::to_string(size_bytes);
    if (::mount("tmpfs", dir_.c_str(), "tmpfs", 0, opts.c_str()) != 0) {
      why_ = "cannot mount a tmpfs at " + dir_ + ": " + std::strerror(errno) +
             " (needs root or CAP_SYS_ADMIN)";
    }
  }
  ~SmallDisk() {
    if (why_.empty()) ::umount2(dir_.c_str(), MNT_DETACH);
  }
  SmallDisk(const SmallDisk&) = delete;
  SmallDisk& operator=(const SmallDisk&) = delete;

  const std::string& why_not() const { return why_; }
  std::uint64_t page_bytes() const { return vfs().f_bsize; }
  // Fills the disk, leaving `pages` pages free (as the file system counts them).
  void leave_free(std::uint64_t pages) const {
    const struct statvfs v = vfs();
    ASSERT_GE(v.f_bavail, pages);
    std::ofstream f(dir_ + "/filler", std::ios::binary);
    const std::string page(v.f_bsize, 'x');
    for (std::uint64_t i = 0; i < v.f_bavail - pages; ++i) f << page;
    f.close();
    ASSERT_TRUE(f.good());
    ASSERT_EQ(vfs().f_bavail, pages);
  }
  void unfill() const { std::filesystem::remove(dir_ + "/filler"); }

 private:
  struct statvfs vfs() const {
    struct statvfs v {};
    ::statvfs(dir_.c_str(), &v);
    return v;
  }
  std::string dir_, why_;
};

}  // namespace strata::testing
