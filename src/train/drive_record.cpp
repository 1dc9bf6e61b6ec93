// The swap drive's sustained rates, learned from a run's step metrics.
#include "strata/train/drive_record.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <filesystem>

#include "strata/core/json.h"

namespace strata::train {
namespace {

constexpr std::uint64_t kLeastBytesPerStep = std::uint64_t{64} << 20;

std::string utc_now() {
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

Json rate_json(const Rate& r) {
  return Json{{"per_s", r.per_s}, {"low_per_s", r.low_per_s}, {"high_per_s", r.high_per_s}};
}

}  // namespace

std::optional<DriveRecord> drive_record(const std::vector<StepMetrics>& history,
                                        const std::string& engine) {
  std::vector<double> reads, writes, mixed;
  DriveRecord rec;
  for (std::size_t i = history.size() > 1 ? 1 : 0; i < history.size(); ++i) {
    const StepMetrics& m = history[i];
    if (m.nvme_read_bytes < kLeastBytesPerStep || m.nvme_write_bytes < kLeastBytesPerStep ||
        m.nvme_read_busy_ms <= 0 || m.nvme_write_busy_ms <= 0) {
      continue;
    }
    const auto r = static_cast<double>(m.nvme_read_bytes);
    const auto w = static_cast<double>(m.nvme_write_bytes);
    reads.push_back(r / (m.nvme_read_busy_ms / 1e3));
    writes.push_back(w / (m.nvme_write_busy_ms / 1e3));
    mixed.push_back(std::max(r, w) / (std::max(m.nvme_read_busy_ms, m.nvme_write_busy_ms) / 1e3));
    rec.bytes += m.nvme_read_bytes + m.nvme_write_bytes;
    ++rec.steps;
  }
  if (rec.steps == 0) return std::nullopt;
  rec.read = median_rate(reads, "");
  rec.write = median_rate(writes, "");
  rec.mixed = median_rate(mixed, "");
  rec.engine = engine;
  rec.date = utc_now();
  return rec;
}

Status write_drive_record(const std::string& dir, const DriveRecord& record) {
  const Json j{{"read_bytes_per_s", rate_json(record.read)},
               {"write_bytes_per_s", rate_json(record.write)},
               {"mixed_bytes_per_s", rate_json(record.mixed)},
               {"steps", record.steps},
               {"bytes", record.bytes},
               {"engine", record.engine},
               {"date", record.date}};
  return write_json_file((std::filesystem::path(dir) / kDriveRecordFile).string(), j, 2);
}

Result<std::optional<DriveRecord>> read_drive_record(const std::string& dir,
                                                     const std::string& engine) {
  const std::string path = (std::filesystem::path(dir) / kDriveRecordFile).string();
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::optional<DriveRecord>();
  STRATA_ASSIGN_OR_RETURN(const Json j, read_json_file(path));
  const auto bad = [&](const std::string& key, const std::string& expected) {
    return data_loss(path + ": key '" + key + "' must be " + expected +
                     " (a record strata train writes; delete the file to probe the drive instead)");
  };
  if (!j.is_object()) return bad("(top level)", "an object");
  DriveRecord rec;
  const std::string how_prefix = "learned from ";
  for (const auto& [key, rate] :
       {std::pair{"read_bytes_per_s", &rec.read}, std::pair{"write_bytes_per_s", &rec.write},
        std::pair{"mixed_bytes_per_s", &rec.mixed}}) {
    const auto it = j.find(key);
    if (it == j.end() || !it->is_object())
      return bad(key, "an object of per_s, low_per_s, high_per_s");
    for (const auto& [field, out] :
         {std::pair{"per_s", &rate->per_s}, std::pair{"low_per_s", &rate->low_per_s},
          std::pair{"high_per_s", &rate->high_per_s}}) {
      const auto f = it->find(field);
      if (f == it->end() || !f->is_number() || f->get<double>() < 0) {
        return bad(std::string(key) + "." + field, "a number >= 0");
      }
      *out = f->get<double>();
    }
    if (rate->per_s <= 0) return bad(std::string(key) + ".per_s", "a number > 0");
    rate->measured = true;
  }
  const auto text = [&](const char* key, std::string* out) -> Status {
    const auto it = j.find(key);
    if (it == j.end() || !it->is_string()) return bad(key, "a string");
    *out = it->get<std::string>();
    return Status::ok();
  };
  STRATA_RETURN_IF_ERROR(text("engine", &rec.engine));
  STRATA_RETURN_IF_ERROR(text("date", &rec.date));
  const auto steps = j.find("steps");
  const auto bytes = j.find("bytes");
  if (steps == j.end() || !steps->is_number_unsigned()) return bad("steps", "a count");
  if (bytes == j.end() || !bytes->is_number_unsigned()) return bad("bytes", "a count");
  rec.steps = steps->get<int>();
  rec.bytes = bytes->get<std::uint64_t>();
  if (rec.engine != engine) return std::optional<DriveRecord>();
  const std::string how = "learned from " + std::to_string(rec.steps) + " steps of a run on " +
                          rec.date + " that moved " + format_bytes(rec.bytes) + " through " +
                          rec.engine + " (" + path + ")";
  rec.read.how = "read, " + how;
  rec.write.how = "write, " + how;
  rec.mixed.how = "each direction, reading and writing at once, " + how;
  return std::optional<DriveRecord>(std::move(rec));
}

}  // namespace strata::train
