// Atomic, synced file writes.
#include "strata/core/file.h"

#include <fcntl.h>
#include <pwd.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

namespace strata {

namespace {

// $NAME, ${NAME} and $$ in `path`.
Result<std::string> expand_variables(const std::string& path) {
  if (path.find('$') == std::string::npos) return path;
  std::string out;
  for (std::size_t i = 0; i < path.size(); ++i) {
    if (path[i] != '$') {
      out += path[i];
      continue;
    }
    if (i + 1 < path.size() && path[i + 1] == '$') {
      out += '$';
      ++i;
      continue;
    }
    const bool braced = i + 1 < path.size() && path[i + 1] == '{';
    std::size_t start = i + (braced ? 2 : 1), end = start;
    const auto name_char = [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_';
    };
    while (end < path.size() && name_char(path[end])) ++end;
    if (end == start || (braced && (end >= path.size() || path[end] != '}'))) {
      return invalid_argument(path +
                              ": a \"$\" that starts no variable name ($NAME or ${NAME}; "
                              "write $$ for a \"$\" of the name)");
    }
    const std::string name = path.substr(start, end - start);
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) {
      return invalid_argument(path + ": the environment variable " + name + " is not set");
    }
    out += value;
    i = braced ? end : end - 1;
  }
  return out;
}

// "~" and "~/...": the home directory in place of "~".
Result<std::string> expand_tilde(const std::string& path) {
  if (path != "~" && path.rfind("~/", 0) != 0) return path;
  std::string home;
  if (const char* h = std::getenv("HOME"); h != nullptr) home = h;
  if (home.empty()) {
    struct passwd pw {};
    struct passwd* found = nullptr;
    std::vector<char> buf(16384);
    if (::getpwuid_r(::getuid(), &pw, buf.data(), buf.size(), &found) == 0 && found != nullptr &&
        found->pw_dir != nullptr) {
      home = found->pw_dir;
    }
  }
  if (home.empty()) {
    return invalid_argument(path +
                            ": no home directory to put in place of \"~\" (HOME is not set "
                            "and the password database has none for this user); write the path "
                            "in full");
  }
  return home + path.substr(1);
}

}  // namespace

Result<std::string> expand_path(const std::string& path) {
  Result<std::string> expanded = expand_variables(path);
  if (!expanded.is_ok()) return expanded;
  return expand_tilde(*expanded);
}

Result<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return errno_status(errno, "cannot open", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return io_error("cannot read " + path);
  return ss.str();
}

Status fsync_path(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno_status(errno, "cannot open for fsync", path);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return errno_status(err, "fsync failed on", path);
  return Status::ok();
}

Status write_file_atomic(const std::string& path, std::span<const std::byte> data) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return errno_status(errno, "cannot create", tmp);
  std::size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return errno_status(err, "cannot write", tmp);
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return errno_status(err, "fsync failed on", tmp);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return errno_status(err, "cannot rename into place", path);
  }
  const std::string dir = std::filesystem::path(path).parent_path().string();
  return fsync_path(dir.empty() ? "." : dir);
}

Status write_file_atomic(const std::string& path, const std::string& text) {
  return write_file_atomic(path, std::as_bytes(std::span(text.data(), text.size())));
}

Status rename_synced(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    return errno_status(errno, "cannot rename " + from + " to", to);
  const std::string dir = std::filesystem::path(to).parent_path().string();
  return fsync_path(dir.empty() ? "." : dir);
}

Result<AtomicFileWriter> AtomicFileWriter::create(const std::string& path) {
  AtomicFileWriter w;
  w.path_ = path;
  w.tmp_path_ = path + ".tmp." + std::to_string(::getpid());
  w.fd_ = ::open(w.tmp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (w.fd_ < 0) return errno_status(errno, "cannot create", w.tmp_path_);
  return w;
}

AtomicFileWriter::AtomicFileWriter(AtomicFileWriter&& other) noexcept
    : path_(std::move(other.path_)),
      tmp_path_(std::move(other.tmp_path_)),
      fd_(std::exchange(other.fd_, -1)) {}

AtomicFileWriter& AtomicFileWriter::operator=(AtomicFileWriter&& other) noexcept {
  if (this != &other) {
    abandon();
    path_ = std::move(other.path_);
    tmp_path_ = std::move(other.tmp_path_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

AtomicFileWriter::~AtomicFileWriter() { abandon(); }

void AtomicFileWriter::abandon() {
  if (fd_ < 0) return;
  ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_path_.c_str());
}

Status AtomicFileWriter::write(std::span<const std::byte> data) { return write_all(data, nullptr); }

Status AtomicFileWriter::write_at(std::uint64_t offset, std::span<const std::byte> data) {
  return write_all(data, &offset);
}

Status AtomicFileWriter::write_all(std::span<const std::byte> data, const std::uint64_t* offset) {
  if (fd_ < 0) return failed_precondition("write to " + tmp_path_ + " after commit or failure");
  std::size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = offset == nullptr ? ::write(fd_, data.data() + done, data.size() - done)
                                        : ::pwrite(fd_, data.data() + done, data.size() - done,
                                                   static_cast<off_t>(*offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      abandon();
      return errno_status(err, "cannot write", tmp_path_);
    }
    done += static_cast<std::size_t>(n);
  }
  return Status::ok();
}

Status AtomicFileWriter::commit() {
  if (fd_ < 0) return failed_precondition("commit of " + tmp_path_ + " after commit or failure");
  if (::fsync(fd_) != 0) {
    const int err = errno;
    abandon();
    return errno_status(err, "fsync failed on", tmp_path_);
  }
  const int rc = ::close(std::exchange(fd_, -1));
  if (rc != 0) {
    const int err = errno;
    ::unlink(tmp_path_.c_str());
    return errno_status(err, "cannot close", tmp_path_);
  }
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp_path_.c_str());
    return errno_status(err, "cannot rename into place", path_);
  }
  const std::string dir = std::filesystem::path(path_).parent_path().string();
  return fsync_path(dir.empty() ? "." : dir);
}

}  // namespace strata
