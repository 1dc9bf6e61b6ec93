// One pipeline stage's part of a step: its micro-batches' passes in the schedule's order, the
// activations and their gradients sent to and received from the neighbouring stages, a tied
// embedding's copy and gradient parts between the first and last stage; and evaluation's forward
// through every stage. Private to train/.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "src/train/step_batch.h"
#include "src/train/step_recorder.h"
#include "strata/core/status.h"
#include "strata/dist/process_grid.h"
#include "strata/mem/timeline.h"
#include "strata/model/llama.h"
#include "strata/train/config.h"
#include "strata/zero/zero_provider.h"

namespace strata::train {

class PipelineRunner {
 public:
  // What the stage runs with; each must outlive the runner. `stage` is the model's.
  struct Parts {
    const TrainConfig& config;
    model::LlamaModel& model;
    zero::ZeroProvider& provider;
    dist::ProcessGrid& grid;
    mem::Timeline& timeline;
    const model::PipelineStage& stage;
  };
  explicit PipelineRunner(const Parts& parts) : p_(parts) {}

  // The step's micro-batches through this stage in its schedule's order. `last_pass` is called
  // before the stage's last backward pass (its gradients are final as they come: the update may
  // start). Each micro-batch's loss (share weighted, the last stage's; 0 elsewhere) goes to
  // (*losses)[micro-batch] (micros.size() of them), its load-balancing loss (MoE models, share
  // weighted, the last stage's) to (*aux)[micro-batch], the model's time to *compute_ms.
  Status run_step(const std::vector<StepMicroBatch>& micros, const std::function<void()>& last_pass,
                  std::vector<double>* losses, std::vector<double>* aux, double* compute_ms);
  // Forward only, one micro-batch through every stage (evaluation): its loss on the last stage,
  // 0 on the others.
  Result<float> forward(const model::LlamaModel::MicroBatch& mb);
  // The tied embedding changed (a step of a trained one): the last stage's copy is stale.
  void embedding_changed() { embedding_copy_current_ = false; }
  // "pipeline: ..." (a line): the stages' layers, the schedule and its bubble, and this rank's
  // place; empty without pipeline parallelism.
  std::string describe() const;

 private:
  // Tied embeddings cut into stages: the first stage sends the last the embedding its head reads,
  // before a pass that reads it, unless the copy there is current (both stages decide alike:
  // after every step of a trained embedding, once for a frozen one).
  Status share_embedding();

  Parts p_;
  bool embedding_copy_current_ = false;
};

}  // namespace strata::train
