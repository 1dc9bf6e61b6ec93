// DeepSpeed's training config (the file `deepspeed --deepspeed_config` and Hugging Face's
// Trainer's `deepspeed` argument take) read into Strata's config keys, so a DeepSpeed user's
// file runs as it is: `strata train CONFIG --deepspeed ds.json`, or the config's key
// "deepspeed" (a path, or the object inline).
//
// Each key DeepSpeed has is one of four kinds:
// - mapped: the Strata key that does the same (train_micro_batch_size_per_gpu is
//   micro_batch_size, zero_optimization.stage is zero_stage, sizes counted in elements become
//   bytes of the compute dtype, the schedulers are optim::LrSchedule's DeepSpeed kinds);
// - decided by Strata: it tunes what Strata decides itself (overlap_comm, pin_memory,
//   buffer_count, ...); accepted and listed once, in `decided`;
// - refused: it would change the mathematics in a way Strata does not do (amsgrad, Lamb,
//   quantized ZeRO++ collectives), named with what Strata has instead;
// - unknown: not a DeepSpeed key; refused with the nearest known one.
// "auto" (as Hugging Face's Trainer leaves values for itself to fill in) leaves the key to the
// Strata config. A key the DeepSpeed file leaves out keeps the Strata config's value, or
// DeepSpeed's default where DeepSpeed's differs from Strata's (gradient_clipping 0, the
// schedulers' parameters) and the Strata config does not set it either. A key both files set,
// to different values, is refused naming both.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "strata/core/json.h"

namespace strata::train {

struct DeepSpeedJoin {
  Json config;                       // the Strata config with the DeepSpeed file's settings in
  std::vector<std::string> decided;  // the file's keys that only tune what Strata decides
  std::vector<std::string> keys;     // the Strata keys the file set (dotted), for messages
};

// Where a Strata key of `config` was set, for messages: the config file's name, or "--set" for
// a command-line override.
using KeyOrigin = std::function<std::string(const std::string& dotted_key)>;

// Joins the DeepSpeed config `ds` (read from `ds_source`) into the Strata config `config`. Every
// problem is appended to *errors (each a line naming the key and the file); `config` is returned
// with whatever did join.
DeepSpeedJoin join_deepspeed_config(const Json& config, const KeyOrigin& origin, const Json& ds,
                                    const std::string& ds_source, std::vector<std::string>* errors);

}  // namespace strata::train
