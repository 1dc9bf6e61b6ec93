// File helpers that never leave a half-written file under the final name.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "strata/core/status.h"

namespace strata {

Result<std::string> read_file(const std::string& path);
// A path as a shell would expand it: "~" and "~/..." with the home directory ($HOME, else the
// password database's) in place of "~", and $NAME or ${NAME} with the environment variable's
// value ("$$" is one "$"). An error where no home directory is known, or naming a variable that
// is not set.
Result<std::string> expand_path(const std::string& path);
// Writes to "<path>.tmp.<pid>", fsyncs it, renames over path and fsyncs the directory.
Status write_file_atomic(const std::string& path, std::span<const std::byte> data);
Status write_file_atomic(const std::string& path, const std::string& text);
Status fsync_path(const std::string& path);  // file or directory
// Renames a directory into place atomically (fails if the destination exists and is non-empty).
Status rename_synced(const std::string& from, const std::string& to);

// Streams a file into place atomically: bytes go to "<path>.tmp.<pid>"; commit() fsyncs it,
// renames it over `path` and fsyncs the directory. A writer destroyed (or failing) before commit()
// removes its temporary file, so `path` is only ever absent, its old contents, or complete.
class AtomicFileWriter {
 public:
  static Result<AtomicFileWriter> create(const std::string& path);
  AtomicFileWriter(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter();

  // Appends all of `data` (retrying short writes and EINTR).
  Status write(std::span<const std::byte> data);
  // Overwrites bytes already written at `offset` (a header whose fields are known at the end).
  Status write_at(std::uint64_t offset, std::span<const std::byte> data);
  Status commit();
  const std::string& temp_path() const { return tmp_path_; }

 private:
  AtomicFileWriter() = default;
  void abandon();
  // Writes all of `data`, at `offset` when given (pwrite), else where the file stands (write).
  Status write_all(std::span<const std::byte> data, const std::uint64_t* offset);
  std::string path_;
  std::string tmp_path_;
  int fd_ = -1;
};

}  // namespace strata
