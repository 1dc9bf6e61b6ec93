// Held-out evaluation: the mean loss over eval_data, every data-parallel rank its slice of each
// batch, through the pipeline's stages where there are several. Private to train/.
#pragma once

#include <cstdint>
#include <memory>

#include "src/train/pipeline_runner.h"
#include "strata/core/status.h"
#include "strata/dist/process_grid.h"
#include "strata/model/llama.h"
#include "strata/train/config.h"
#include "strata/train/data.h"
#include "strata/train/step_metrics.h"
#include "strata/zero/zero_provider.h"

namespace strata::train {

class Evaluator {
 public:
  // What evaluation runs with; each must outlive the evaluator. `pipeline` is null without
  // pipeline parallelism.
  struct Parts {
    const TrainConfig& config;  // its eval_data is set
    model::LlamaModel& model;
    zero::ZeroProvider& provider;
    dist::ProcessGrid& grid;
    PipelineRunner* pipeline;
  };
  // Opens eval_data (and its loss mask) and reads every sequence an evaluation will read, here
  // on every rank: a bad token met during an evaluation would stop one rank while the others
  // wait in its collectives.
  static Result<std::unique_ptr<Evaluator>> open(const Parts& parts);

  // When step m->step is due (every eval_every steps, and the last): the mean loss over the
  // evaluated sequences' targets into m's eval fields, after the step's update has landed.
  Status maybe_evaluate(StepMetrics* m);

 private:
  explicit Evaluator(const Parts& parts) : p_(parts) {}
  // Batches an evaluation runs: eval_batches, or the whole file once (at least one batch, which
  // may wrap around it).
  std::int64_t batch_count() const;

  Parts p_;
  std::shared_ptr<TokenDataset> dataset_;
  std::unique_ptr<SequenceSampler> sampler_;
};

}  // namespace strata::train
