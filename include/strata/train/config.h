// The training config: one JSON object whose keys read like DeepSpeed's, validated strictly
// (every unknown key, wrong type and out-of-range value reported at once).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/core/json.h"
#include "strata/core/status.h"

namespace strata::train {

struct DataConfig {
  std::string path;
  std::string format = "text";  // u16 | u32 | llmc | text
};

struct OptimizerConfig {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

struct LrScheduleConfig {
  std::string type = "constant";  // constant | cosine
  std::int64_t warmup_steps = 0;
  double min_lr = 0.0;
};

struct TrainConfig {
  Json model;  // a path (string) to an HF checkpoint directory, or an inline HF config object
  std::uint64_t seed = 1234;
  DataConfig data;
  std::int64_t seq_len = 128;
  std::int64_t batch_size = 8;        // global, in sequences
  std::int64_t micro_batch_size = 0;  // per rank; 0 = batch_size
  std::int64_t max_steps = 100;
  std::string precision = "fp32";  // fp32 | bf16
  OptimizerConfig optimizer;
  LrScheduleConfig lr_schedule;
  double grad_clip = 1.0;  // max global gradient norm; 0 = off
  bool activation_checkpointing = false;
  int zero_stage = 3;
  std::int64_t param_persistence_threshold = 100000;  // groups smaller than this stay whole
  std::string dist_backend = "auto";                   // auto | single | mpi | nccl
  std::int64_t dist_timeout_s = 300;                   // a collective slower than this ends the run
  std::string offload_optimizer = "none";  // none | cpu | nvme
  std::string offload_param = "none";      // none | cpu | nvme
  std::vector<std::string> swap_paths;
  std::string swap_engine = "auto";       // auto | uring | posix | memory
  std::string device = "cpu";             // cpu | cuda
  std::uint64_t device_memory_limit = 0;  // bytes; 0 = no limit (cpu backend only)
  std::uint64_t host_memory_limit = 0;    // bytes; 0 = no limit
  int threads = 0;                        // compute threads on the cpu backend; 0 = all cores
  std::string save_dir = "checkpoints";
  std::int64_t save_every = 0;  // steps; 0 = only at the end and on Ctrl-C
  std::string metrics_file;     // JSON lines; empty = none
  std::int64_t log_every = 1;

  std::int64_t accumulation_steps() const { return batch_size / micro_batch_size; }
  // The config as JSON with every key (defaults filled in): saved in checkpoints.
  Json to_json() const;
};

// Parses and validates. `source` names the file in messages.
Result<TrainConfig> parse_train_config(const Json& json, const std::string& source);
Result<TrainConfig> load_train_config(const std::string& path,
                                      const std::vector<std::string>& overrides);
// Applies one "--set key=value" override: dotted keys address nested objects; the value is
// parsed as JSON when it is valid JSON, else taken as a string.
Status apply_override(Json& json, const std::string& assignment);

}  // namespace strata::train
