// The swap drive's record: learned from a run's steps, written beside the swap files, read back
// by strata estimate, and refused with the file and key when it is not a record.
#include "strata/train/drive_record.h"

#include <gtest/gtest.h>

#include <fstream>

#include "tests/testing/temp_dir.h"

namespace strata::train {
namespace {

constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;

StepMetrics step(std::uint64_t read_mib, double read_ms, std::uint64_t write_mib, double write_ms) {
  StepMetrics m;
  m.nvme_read_bytes = read_mib * kMiB;
  m.nvme_read_busy_ms = read_ms;
  m.nvme_write_bytes = write_mib * kMiB;
  m.nvme_write_busy_ms = write_ms;
  return m;
}

TEST(DriveRecordTest, StepsAfterTheFirstGiveEachDirectionsRateAndTheSpread) {
  // The first step (cold) is left out; so is one that moved too little to time.
  const std::vector<StepMetrics> history = {
      step(1000, 100, 1000, 100),  // 10.5 GB/s: cold, not counted
      step(1024, 1000, 512, 500),  // read 1.07 GB/s, write 1.07 GB/s; mixed 1024 MiB / 1 s
      step(1024, 2000, 512, 250),  // read 0.54, write 2.15; mixed 1024 MiB / 2 s
      step(1024, 500, 512, 1000),  // read 2.15, write 0.54; mixed 1024 MiB / 1 s
      step(8, 10, 8, 10),          // too little to time
  };
  const auto rec = drive_record(history, "io_uring");
  ASSERT_TRUE(rec.has_value());
  EXPECT_EQ(rec->steps, 3);
  EXPECT_EQ(rec->bytes, 3 * 1536 * kMiB);
  const double gib = static_cast<double>(1024 * kMiB);
  EXPECT_DOUBLE_EQ(rec->read.per_s, gib / 1.0);  // the median of 1, 2 and 0.5 seconds per GiB
  EXPECT_DOUBLE_EQ(rec->read.low_per_s, gib / 2.0);
  EXPECT_DOUBLE_EQ(rec->read.high_per_s, gib / 0.5);
  EXPECT_DOUBLE_EQ(rec->write.per_s, gib / 1.0);
  EXPECT_DOUBLE_EQ(rec->mixed.per_s, gib / 1.0);  // the busier direction over the longer busy time
  EXPECT_DOUBLE_EQ(rec->mixed.low_per_s, gib / 2.0);
  EXPECT_DOUBLE_EQ(rec->mixed.high_per_s, gib / 1.0);
  // A run that moved nothing worth timing has no record.
  EXPECT_FALSE(drive_record({step(1, 1, 1, 1), step(1, 1, 1, 1)}, "io_uring").has_value());
  EXPECT_FALSE(drive_record({}, "io_uring").has_value());
}

TEST(DriveRecordTest, WrittenAndReadBackForItsEngineOnly) {
  testing::TempDir dir;
  const auto rec = drive_record({step(1024, 1000, 1024, 500)}, "io_uring");
  ASSERT_TRUE(rec.has_value());
  ASSERT_TRUE(write_drive_record(dir.path(), *rec).is_ok());
  auto back = read_drive_record(dir.path(), "io_uring");
  ASSERT_TRUE(back.is_ok()) << back.status().message();
  ASSERT_TRUE(back->has_value());
  EXPECT_DOUBLE_EQ((*back)->read.per_s, rec->read.per_s);
  EXPECT_DOUBLE_EQ((*back)->write.per_s, rec->write.per_s);
  EXPECT_DOUBLE_EQ((*back)->mixed.per_s, rec->mixed.per_s);
  EXPECT_TRUE((*back)->read.measured);
  EXPECT_NE((*back)->mixed.how.find("learned from 1 steps of a run"), std::string::npos)
      << (*back)->mixed.how;
  // Another engine's figures say nothing of this one; no file, no record.
  auto other = read_drive_record(dir.path(), "posix");
  ASSERT_TRUE(other.is_ok());
  EXPECT_FALSE(other->has_value());
  testing::TempDir empty;
  auto none = read_drive_record(empty.path(), "io_uring");
  ASSERT_TRUE(none.is_ok());
  EXPECT_FALSE(none->has_value());
}

TEST(DriveRecordTest, ABadRecordNamesTheFileAndTheKey) {
  testing::TempDir dir;
  const std::string path = dir.file(kDriveRecordFile);
  struct Case {
    const char* text;
    const char* says;
  };
  const Case cases[] = {
      {"not json", "is not valid JSON"},
      {"[1]", "key '(top level)' must be an object"},
      {R"({"read_bytes_per_s": 5})", "key 'read_bytes_per_s' must be an object"},
      {R"({"read_bytes_per_s": {"per_s": -1, "low_per_s": 0, "high_per_s": 0}})",
       "key 'read_bytes_per_s.per_s' must be a number >= 0"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    std::ofstream(path) << c.text;
    auto r = read_drive_record(dir.path(), "io_uring");
    ASSERT_FALSE(r.is_ok());
    EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find(c.says), std::string::npos) << r.status().message();
  }
}

}  // namespace
}  // namespace strata::train
