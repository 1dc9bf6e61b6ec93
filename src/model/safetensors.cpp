// safetensors reading (header validated against the file, pread + chunked dtype conversion) and
// streaming, atomic writing.
#include "strata/model/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <limits>
#include <set>
#include <tuple>
#include <utility>

#include "strata/core/aligned.h"
#include "strata/core/file.h"
#include "strata/core/json.h"
#include "strata/core/unique_fd.h"
#include "strata/tensor/tensor.h"

namespace strata::model {
namespace {

// The reference implementation refuses headers above 100 MB; so do we (a garbage length would
// otherwise make us allocate gigabytes before noticing the file is not safetensors).
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;
// Conversions go through a bounded staging buffer so a multi-GiB tensor needs no second copy.
constexpr std::size_t kConvertChunkBytes = 4u << 20;
// At most this many header problems are listed in one error.
constexpr std::size_t kMaxReportedErrors = 20;

bool is_float(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

// Reads exactly `size` bytes at `offset`; a short file is data loss (it shrank after open()).
Status pread_full(int fd, void* dst, std::size_t size, std::uint64_t offset,
                  const std::string& path) {
  auto* p = static_cast<std::byte*>(dst);
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd, p + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno_status(errno, "cannot read", path);
    }
    if (n == 0) {
      return data_loss(path + ": unexpected end of file at byte " + std::to_string(offset + done) +
                       " (expected " + std::to_string(size - done) +
                       " more bytes); was the file truncated while in use?");
    }
    done += static_cast<std::size_t>(n);
  }
  return Status::ok();
}

// Parses one tensor's header entry; appends problems to `errors`.
void parse_entry(const std::string& name, const Json& info, std::uint64_t data_bytes,
                 std::vector<std::string>* errors, std::vector<SafetensorsEntry>* entries) {
  const std::string where = "tensor '" + name + "'";
  if (!info.is_object()) {
    errors->push_back(where + ": expected an object with dtype, shape and data_offsets, found " +
                      info.dump());
    return;
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!info.contains(key)) {
      errors->push_back(where + ": missing key '" + key + "'");
      return;
    }
  }
  SafetensorsEntry e;
  e.name = name;
  const Json& dtype = info.at("dtype");
  const std::optional<DType> parsed =
      dtype.is_string() ? parse_dtype(dtype.get<std::string>()) : std::nullopt;
  // parse_dtype also takes Strata spellings ("f32"); a file must use the safetensors ones.
  if (!parsed || safetensors_dtype_name(*parsed) != dtype.get<std::string>()) {
    errors->push_back(where + ": unknown dtype " + dtype.dump() +
                      "; expected one of F32, BF16, F16, U16, U32, I32, I64, U8");
    return;
  }
  e.dtype = *parsed;

  const Json& shape = info.at("shape");
  std::uint64_t numel = 1;
  bool numel_overflow = false;
  bool shape_ok = shape.is_array();
  if (shape_ok) {
    for (const Json& d : shape) {
      if (!d.is_number_unsigned() ||
          d.get<std::uint64_t>() > std::uint64_t{std::numeric_limits<std::int64_t>::max()}) {
        shape_ok = false;
        break;
      }
      e.shape.push_back(d.get<std::int64_t>());
      numel_overflow |= __builtin_mul_overflow(numel, d.get<std::uint64_t>(), &numel);
    }
  }
  if (!shape_ok) {
    errors->push_back(where + ": shape must be a list of non-negative integers, found " +
                      shape.dump());
    return;
  }

  const Json& offsets = info.at("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    errors->push_back(where +
                      ": data_offsets must be two non-negative integers [begin, end], found " +
                      offsets.dump());
    return;
  }
  e.begin = offsets[0].get<std::uint64_t>();
  e.end = offsets[1].get<std::uint64_t>();
  if (e.begin > e.end) {
    errors->push_back(where + ": data_offsets " + offsets.dump() + " has begin > end");
    return;
  }
  if (e.end > data_bytes) {
    errors->push_back(where + ": data_offsets " + offsets.dump() +
                      " ends beyond the data section of " + std::to_string(data_bytes) +
                      " bytes (file truncated?)");
    return;
  }
  std::uint64_t expected_bytes = 0;
  if (numel_overflow || __builtin_mul_overflow(numel, dtype_size(e.dtype), &expected_bytes)) {
    errors->push_back(where + ": shape " + shape_string(e.shape) + " is too large");
    return;
  }
  if (e.end - e.begin != expected_bytes) {
    errors->push_back(where + ": data_offsets " + offsets.dump() + " span " +
                      std::to_string(e.end - e.begin) + " bytes, expected " +
                      std::to_string(expected_bytes) + " for " +
                      std::string(safetensors_dtype_name(e.dtype)) + " " + shape_string(e.shape));
    return;
  }
  entries->push_back(std::move(e));
}

Status header_error(const std::string& path, const std::vector<std::string>& errors) {
  std::string msg = path + ": invalid safetensors header:";
  for (std::size_t i = 0; i < errors.size() && i < kMaxReportedErrors; ++i)
    msg += "\n  " + errors[i];
  if (errors.size() > kMaxReportedErrors)
    msg += "\n  ... and " + std::to_string(errors.size() - kMaxReportedErrors) + " more";
  return data_loss(msg);
}

}  // namespace

Result<SafetensorsReader> SafetensorsReader::open(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return errno_status(errno, "cannot open safetensors file", path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errno_status(errno, "cannot stat", path);
  if (!S_ISREG(st.st_mode)) return invalid_argument(path + " is not a regular file");
  const auto file_bytes = static_cast<std::uint64_t>(st.st_size);
  if (file_bytes < 8) {
    return data_loss(path + ": file is " + std::to_string(file_bytes) +
                     " bytes; a safetensors file starts with an 8-byte header length");
  }
  std::uint8_t len_bytes[8];
  STRATA_RETURN_IF_ERROR(pread_full(fd.get(), len_bytes, 8, 0, path));
  std::uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | len_bytes[i];
  if (header_bytes > kMaxHeaderBytes) {
    return data_loss(path + ": header length " + std::to_string(header_bytes) +
                     " exceeds the 100 MB limit; this is not a safetensors file or it is corrupt");
  }
  if (header_bytes > file_bytes - 8) {
    return data_loss(path + ": header length " + std::to_string(header_bytes) +
                     " is larger than the " + std::to_string(file_bytes - 8) +
                     " bytes after the length field (file truncated?)");
  }
  std::string header(header_bytes, '\0');
  STRATA_RETURN_IF_ERROR(pread_full(fd.get(), header.data(), header.size(), 8, path));

  // Duplicate tensor names would otherwise silently keep the last; the callback sees each key
  // of the top-level object (depth 1).
  std::set<std::string> seen_keys;
  std::vector<std::string> errors;
  Json json;
  try {
    json = Json::parse(header, [&](int depth, Json::parse_event_t event, Json& parsed) {
      if (event == Json::parse_event_t::key && depth == 1 &&
          !seen_keys.insert(parsed.get<std::string>()).second) {
        errors.push_back("key '" + parsed.get<std::string>() + "' appears more than once");
      }
      return true;
    });
  } catch (const Json::exception& e) {
    return data_loss(path + ": header is not valid JSON (" + e.what() + ")");
  }
  if (!json.is_object()) {
    return data_loss(path +
                     ": header must be a JSON object mapping tensor names to "
                     "{dtype, shape, data_offsets}, found a " +
                     std::string(json.type_name()));
  }

  SafetensorsReader reader;
  reader.path_ = path;
  reader.data_offset_ = 8 + header_bytes;
  const std::uint64_t data_bytes = file_bytes - reader.data_offset_;
  for (const auto& [key, value] : json.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) {
        errors.push_back("__metadata__ must be an object of strings, found " + value.dump());
        continue;
      }
      for (const auto& [mkey, mvalue] : value.items()) {
        if (!mvalue.is_string()) {
          errors.push_back("__metadata__ key '" + mkey + "' must be a string, found " +
                           mvalue.dump());
          continue;
        }
        reader.metadata_[mkey] = mvalue.get<std::string>();
      }
      continue;
    }
    parse_entry(key, value, data_bytes, &errors, &reader.entries_);
  }
  if (!errors.empty()) return header_error(path, errors);

  // File order; empty tensors occupy no bytes and cannot overlap anything.
  auto& entries = reader.entries_;
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  const SafetensorsEntry* prev = nullptr;
  for (const auto& e : entries) {
    if (e.begin == e.end) continue;
    if (prev != nullptr && e.begin < prev->end) {
      errors.push_back("tensor '" + e.name + "' bytes [" + std::to_string(e.begin) + ", " +
                       std::to_string(e.end) + ") overlap tensor '" + prev->name + "' bytes [" +
                       std::to_string(prev->begin) + ", " + std::to_string(prev->end) + ")");
    }
    if (prev == nullptr || e.end > prev->end) prev = &e;
  }
  if (!errors.empty()) return header_error(path, errors);
  return reader;
}

const SafetensorsEntry* SafetensorsReader::find(const std::string& name) const {
  for (const auto& e : entries_) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

Status SafetensorsReader::read(const std::string& name,
                               const std::vector<std::int64_t>& expected_shape, void* dst,
                               DType dst_dtype) const {
  std::int64_t numel = 1;
  for (const std::int64_t d : expected_shape) numel *= d;
  return read_range(name, expected_shape, 0, numel, dst, dst_dtype);
}

Status SafetensorsReader::read_range(const std::string& name,
                                     const std::vector<std::int64_t>& expected_shape,
                                     std::int64_t begin, std::int64_t count, void* dst,
                                     DType dst_dtype) const {
  const SafetensorsEntry* e = find(name);
  if (e == nullptr) return not_found(path_ + ": no tensor named '" + name + "'");
  if (e->shape != expected_shape) {
    return invalid_argument(path_ + ": tensor '" + name + "' has shape " + shape_string(e->shape) +
                            ", expected " + shape_string(expected_shape));
  }
  if (e->dtype != dst_dtype && !(is_float(e->dtype) && is_float(dst_dtype))) {
    return invalid_argument(path_ + ": tensor '" + name + "' is " +
                            std::string(safetensors_dtype_name(e->dtype)) +
                            " and cannot be read as " + std::string(dtype_name(dst_dtype)) +
                            "; only f32, bf16 and f16 convert among each other");
  }
  const std::size_t src_size = dtype_size(e->dtype);
  const auto tensor_elems = static_cast<std::int64_t>((e->end - e->begin) / src_size);
  STRATA_CHECK(begin >= 0 && count >= 0 && begin + count <= tensor_elems,
               "safetensors read outside the tensor", name, begin, count, tensor_elems);
  const std::uint64_t total_bytes = static_cast<std::uint64_t>(count) * src_size;
  if (total_bytes == 0) return Status::ok();
  UniqueFd fd(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return errno_status(errno, "cannot open safetensors file", path_);
  const std::uint64_t offset =
      data_offset_ + e->begin + static_cast<std::uint64_t>(begin) * src_size;
  if (e->dtype == dst_dtype) return pread_full(fd.get(), dst, total_bytes, offset, path_);

  const std::uint64_t num_elems = static_cast<std::uint64_t>(count);
  const std::size_t chunk_elems = kConvertChunkBytes / src_size;
  std::vector<std::byte> staging(std::min<std::uint64_t>(num_elems, chunk_elems) * src_size);
  auto* out = static_cast<std::byte*>(dst);
  for (std::uint64_t done = 0; done < num_elems;) {
    const std::size_t n = std::min<std::uint64_t>(chunk_elems, num_elems - done);
    STRATA_RETURN_IF_ERROR(
        pread_full(fd.get(), staging.data(), n * src_size, offset + done * src_size, path_));
    convert(staging.data(), e->dtype, out + done * dtype_size(dst_dtype), dst_dtype, n);
    done += n;
  }
  return Status::ok();
}

void SafetensorsWriter::add(const std::string& name, DType dtype, std::vector<std::int64_t> shape) {
  std::uint64_t bytes = dtype_size(dtype);
  for (const std::int64_t d : shape) {
    STRATA_CHECK(d >= 0, "negative dimension in safetensors tensor", name, d);
    bytes *= static_cast<std::uint64_t>(d);
  }
  SafetensorsEntry e;
  e.name = name;
  e.dtype = dtype;
  e.shape = std::move(shape);
  e.begin = entries_.empty() ? 0 : entries_.back().end;
  e.end = e.begin + bytes;
  entries_.push_back(std::move(e));
}

Status SafetensorsWriter::write(const std::string& path, const FillFn& fill) const {
  // Same bytes as the reference serializer: compact JSON, __metadata__ first, fields in the order
  // dtype, shape, data_offsets, padded with spaces so the data section starts 8-byte aligned.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  std::set<std::string> names;
  std::uint64_t max_bytes = 0;
  for (const auto& e : entries_) {
    if (e.name == "__metadata__" || !names.insert(e.name).second) {
      return invalid_argument("cannot write " + path + ": tensor name '" + e.name +
                              "' is reserved or used twice");
    }
    header[e.name] = {{"dtype", std::string(safetensors_dtype_name(e.dtype))},
                      {"shape", e.shape},
                      {"data_offsets", {e.begin, e.end}}};
    max_bytes = std::max(max_bytes, e.end - e.begin);
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::ordered_json::exception& ex) {
    return invalid_argument("cannot write " + path + ": header is not valid UTF-8 (" + ex.what() +
                            ")");
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  std::byte len_bytes[8];
  for (int i = 0; i < 8; ++i)
    len_bytes[i] = static_cast<std::byte>((text.size() >> (8 * i)) & 0xff);

  STRATA_ASSIGN_OR_RETURN(AtomicFileWriter out, AtomicFileWriter::create(path));
  STRATA_RETURN_IF_ERROR(out.write(len_bytes));
  STRATA_RETURN_IF_ERROR(out.write(std::as_bytes(std::span(text.data(), text.size()))));
  AlignedBuffer buffer(static_cast<std::size_t>(max_bytes), 64);
  for (const auto& e : entries_) {
    const Status filled = fill(e, buffer.data());
    if (!filled.is_ok()) {
      return filled.with_context("writing " + path + " (tensor '" + e.name + "'); " + path +
                                 " was left unchanged");
    }
    STRATA_RETURN_IF_ERROR(out.write(
        std::span<const std::byte>(buffer.data(), static_cast<std::size_t>(e.end - e.begin))));
  }
  return out.commit();
}

}  // namespace strata::model
