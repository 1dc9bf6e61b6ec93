// What the swap drive sustained during a run, kept beside the run's swap files so that the next
// `strata estimate` on that drive predicts a step from a real step's traffic rather than from a
// probe's burst: a virtual disk can serve a short probe at twice the rate it sustains under a
// step's tens of gigabytes.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "strata/core/status.h"
#include "strata/train/step_time.h"
#include "strata/train/trainer.h"

namespace strata::train {

// The file's name in the first swap path.
inline constexpr const char* kDriveRecordFile = "strata-drive-rates.json";

struct DriveRecord {
  // Each step's NVMe bytes over the time its reads (writes) were in flight, the median step's
  // with the spread over steps: reads and writes ran at once, as a step runs them. `mixed`: the
  // busier direction's bytes over the longer of the two busy times, the rate at which a step's
  // reads and writes overlapped (MachineRates::nvme_mixed_bytes).
  Rate read, write, mixed;
  int steps = 0;            // the steps measured
  std::uint64_t bytes = 0;  // read and written in them
  std::string engine;       // the swap engine that ran them ("io_uring", "posix")
  std::string date;         // when, UTC, ISO 8601
};

// The record of a run's steps after the first (which starts cold; the only one when the run had
// one), those that moved at least 64 MiB each way; nullopt when none did.
std::optional<DriveRecord> drive_record(const std::vector<StepMetrics>& history,
                                        const std::string& engine);

// Writes `record` to dir/kDriveRecordFile (a temporary file, synced, then renamed).
Status write_drive_record(const std::string& dir, const DriveRecord& record);

// The record in `dir` for `engine`: nullopt when there is none or it was made with another
// engine; an error naming the file and the key when it is not a record.
Result<std::optional<DriveRecord>> read_drive_record(const std::string& dir,
                                                     const std::string& engine);

}  // namespace strata::train
