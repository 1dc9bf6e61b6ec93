// What `strata estimate` reports of a config, as the CLI prints it and the Python module's
// strata.estimate returns it: the config resolved ("auto" grid and placement chosen), rank 0's
// plan and each later pipeline stage's, the machine's rates (or a named GPU's), and the step
// time predicted (or, for a small model, timed).
#pragma once

#include <string>
#include <vector>

#include "strata/core/json.h"
#include "strata/core/status.h"
#include "strata/train/config.h"
#include "strata/train/estimate.h"
#include "strata/train/resolve.h"
#include "strata/train/step_time.h"

namespace strata::train {

struct EstimateRequest {
  int ranks = 1;    // plan rank 0 of a job of this many ranks
  std::string gpu;  // a named GPU's published rate for a device this machine lacks ("" none)
};

struct EstimateReport {
  ResolvedConfig resolved;       // resolved.config: the config as it would run
  std::vector<Estimate> stages;  // pipeline stages 1, 2, ...: each its first rank's plan
  MachineRates rates;
  StepTime step;
  bool timed = false;  // step.step_ms timed on 1- and 3-layer variants, not predicted

  const TrainConfig& config() const { return resolved.config; }
  const Estimate& planned() const { return resolved.planned; }
  // strata estimate --json's object ("fits": true, the plan, the budgets, the step, the rates).
  Json to_json() const;
  // strata estimate's text: the verdict line first, then the plan, the step and the rates.
  std::string describe() const;
};

// The report of `config` (read, not yet resolved). Errors: the config's, a plan that cannot run
// (with what would fit), an unknown GPU name, --gpu with a CPU config.
Result<EstimateReport> estimate_report(const TrainConfig& config, const EstimateRequest& request);
// A refusal as --json reports it: {"fits": false, "error": message, "exit_code": code}, the code
// the CLI exits with: 2 for a bad config or argument, 1 for a plan that cannot run.
Json refusal_json(const Status& status);

}  // namespace strata::train
