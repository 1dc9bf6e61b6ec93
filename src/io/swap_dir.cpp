// Swap directory ownership: checks, the pid lock file, stale-file reclaim and the swap file.
#include "src/io/swap_dir.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <filesystem>
#include <string_view>
#include <utility>

#include "src/io/errno_text.h"
#include "strata/core/logging.h"

namespace strata::io {
namespace {

bool process_alive(long pid) {
  // EPERM: it exists but belongs to someone else, which still means "alive".
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

// "strata-<pid>.swap" -> pid, or -1.
long parse_swap_file_pid(std::string_view name) {
  constexpr std::string_view kPrefix = "strata-";
  constexpr std::string_view kSuffix = ".swap";
  if (name.size() <= kPrefix.size() + kSuffix.size() || !name.starts_with(kPrefix) ||
      !name.ends_with(kSuffix)) {
    return -1;
  }
  const std::string_view digits =
      name.substr(kPrefix.size(), name.size() - kPrefix.size() - kSuffix.size());
  long pid = -1;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), pid);
  if (ec != std::errc() || end != digits.data() + digits.size() || pid <= 0) return -1;
  return pid;
}

// The pid written in a lock file, or -1 if it holds none.
long read_lock_pid(int fd) {
  char buf[32] = {};
  const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return -1;
  long pid = -1;
  const auto [end, ec] = std::from_chars(buf, buf + n, pid);
  return ec == std::errc() && pid > 0 ? pid : -1;
}

Status not_writable(const std::string& dir, int err, const std::string& detail) {
  return failed_precondition("swap directory " + dir + " is not writable (" + detail + ": " +
                             errno_text(err) + "); fix its permissions or change swap_paths");
}

Status check_directory(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ENOENT) {
      return not_found("swap directory " + dir + " does not exist; create it or change swap_paths");
    }
    return io_error("cannot inspect swap directory " + dir + ": " + errno_text(err));
  }
  if (!S_ISDIR(st.st_mode)) {
    return invalid_argument("swap path " + dir +
                            " is not a directory; swap_paths takes one directory per drive");
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return not_writable(dir, errno, "access check");
  }
  return Status::ok();
}

// Opens and flocks "<dir>/strata.lock". flock (not fcntl) locks belong to the open file, so a
// second swap space in the same process is refused just like one in another process, and the
// kernel drops the lock when its holder dies: a leftover file with no lock is simply stale.
Result<UniqueFd> take_lock(const std::string& dir, const std::string& lock_path) {
  for (int attempt = 0; attempt < 16; ++attempt) {
    UniqueFd fd(::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
    if (!fd.valid()) return not_writable(dir, errno, "cannot create " + lock_path);
    int rc;
    do {
      rc = ::flock(fd.get(), LOCK_EX | LOCK_NB);
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) {
      if (errno != EWOULDBLOCK) return io_error("flock " + lock_path + ": " + errno_text(errno));
      const long pid = read_lock_pid(fd.get());
      const std::string who = pid > 0 ? "process " + std::to_string(pid) : "another process";
      return failed_precondition(
          "swap directory " + dir + " is already in use by " + who + " (it holds " + lock_path +
          "); give each run its own directory in swap_paths, or stop " + who);
    }
    // The previous holder deletes the lock file on exit; if it did so between our open and our
    // flock, we hold a lock on a file nobody else will ever open. Start over on the new one.
    struct stat held {};
    struct stat named {};
    if (::fstat(fd.get(), &held) != 0) {
      return io_error("fstat " + lock_path + ": " + errno_text(errno));
    }
    if (::stat(lock_path.c_str(), &named) == 0 && named.st_ino == held.st_ino &&
        named.st_dev == held.st_dev) {
      return fd;
    }
  }
  return io_error("could not lock " + lock_path + ": it was replaced repeatedly while locking");
}

// With the lock held no live Strata process owns the directory, so swap files there belong to
// dead processes. A file whose pid is alive (not us) is left alone in case of a foreign tool.
void reclaim_stale_swap_files(const std::string& dir) {
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) return;  // the swap file's creation will report a real problem
  const long self = ::getpid();
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const long pid = parse_swap_file_pid(name);
    if (pid < 0) continue;
    const std::string path = dir + "/" + name;
    if (pid != self && process_alive(pid)) {
      log_warning("leaving " + path + " in place: process " + std::to_string(pid) +
                  " is running but does not hold " + dir + "/" + kLockFileName);
      continue;
    }
    if (::unlink(path.c_str()) == 0) {
      log_info("removed stale swap file " + path + " left by process " + std::to_string(pid) +
               ", which is no longer running");
    } else if (errno != ENOENT) {
      log_warning("cannot remove stale swap file " + path + ": " + errno_text(errno));
    }
  }
}

}  // namespace

std::uint64_t stale_swap_bytes(const std::string& dir) {
  std::uint64_t bytes = 0;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) return 0;
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) {
    const long pid = parse_swap_file_pid(it->path().filename().string());
    struct stat st {};
    if (pid < 0 || process_alive(pid) || ::stat(it->path().c_str(), &st) != 0) continue;
    bytes += static_cast<std::uint64_t>(st.st_blocks) * 512;  // what the file holds on disk
  }
  return bytes;
}

std::string swap_file_path(const std::string& dir, long pid) {
  return dir + "/strata-" + std::to_string(pid) + ".swap";
}

Result<SwapDir> SwapDir::open(const std::string& dir, bool direct, bool simulate_refusal) {
  STRATA_RETURN_IF_ERROR(check_directory(dir));
  SwapDir sd;
  sd.dir_ = dir;
  sd.lock_path_ = dir + "/" + kLockFileName;
  STRATA_ASSIGN_OR_RETURN(sd.lock_, take_lock(dir, sd.lock_path_));

  const long self = ::getpid();
  const long previous = read_lock_pid(sd.lock_.get());
  if (previous > 0 && previous != self) {
    log_info("reclaiming swap directory " + dir + " from process " + std::to_string(previous) +
             ", which no longer holds its lock");
  }
  const std::string pid_text = std::to_string(self) + "\n";
  if (::ftruncate(sd.lock_.get(), 0) != 0 ||
      ::pwrite(sd.lock_.get(), pid_text.data(), pid_text.size(), 0) !=
          static_cast<ssize_t>(pid_text.size())) {
    return not_writable(dir, errno, "cannot write " + sd.lock_path_);
  }
  reclaim_stale_swap_files(dir);

  sd.file_path_ = swap_file_path(dir, self);
  const int flags = O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC;
  if (direct && simulate_refusal) {
    errno = EINVAL;
  } else {
    sd.file_ = UniqueFd(::open(sd.file_path_.c_str(), flags | (direct ? O_DIRECT : 0), 0600));
  }
  if (!sd.file_.valid() && direct && errno == EINVAL) {
    // The file system has no O_DIRECT (older tmpfs, some FUSE and network file systems).
    sd.direct_refused_ = true;
    sd.file_ = UniqueFd(::open(sd.file_path_.c_str(), flags, 0600));
  }
  if (!sd.file_.valid()) {
    const int err = errno;
    if (err == EACCES || err == EROFS || err == EPERM) {
      return not_writable(dir, err, "cannot create " + sd.file_path_);
    }
    return io_error("cannot create swap file " + sd.file_path_ + ": " + errno_text(err));
  }
  return sd;
}

SwapDir& SwapDir::operator=(SwapDir&& other) noexcept {
  if (this != &other) {
    release();
    dir_ = std::move(other.dir_);
    lock_path_ = std::move(other.lock_path_);
    file_path_ = std::move(other.file_path_);
    lock_ = std::move(other.lock_);
    file_ = std::move(other.file_);
    direct_refused_ = other.direct_refused_;
  }
  return *this;
}

SwapDir::~SwapDir() { release(); }

void SwapDir::release() {
  if (file_.valid()) {
    file_.reset();
    if (::unlink(file_path_.c_str()) != 0 && errno != ENOENT) {
      log_warning("cannot remove swap file " + file_path_ + ": " + errno_text(errno));
    }
  }
  if (lock_.valid()) {
    // Unlink while still holding the lock, so nobody can lock the old file in between; a
    // process that opened it already notices the replaced inode (see take_lock).
    ::unlink(lock_path_.c_str());
    lock_.reset();
  }
}

std::int64_t SwapDir::free_bytes() const {
  struct statvfs vfs {};
  if (::statvfs(dir_.c_str(), &vfs) != 0) return -1;
  return static_cast<std::int64_t>(vfs.f_bavail) * static_cast<std::int64_t>(vfs.f_frsize);
}

}  // namespace strata::io
