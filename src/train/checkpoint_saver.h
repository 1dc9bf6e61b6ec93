// A run's checkpoints as it saves them: synchronously, or (save_async) on a thread of its own
// beside training, reading the state the provider holds, with its collectives on a grid of its
// own (the same ranks, other communicators) so that they never interleave with training's; at
// most one save in flight; keep_last's pruning after each complete save. Private to train/.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <iosfwd>
#include <memory>
#include <string>

#include "strata/core/clock.h"
#include "strata/core/status.h"
#include "strata/dist/communicator.h"
#include "strata/dist/process_grid.h"
#include "strata/model/param_layout.h"
#include "strata/train/checkpoint.h"
#include "strata/train/config.h"
#include "strata/zero/zero_provider.h"

namespace strata::train {

class CheckpointSaver {
 public:
  // What a save reads and reports to; each must outlive the saver.
  struct Parts {
    const TrainConfig& config;         // save_dir, save_async, keep_last, the model, the adapters
    const model::ParamLayout& layout;  // this rank's
    const model::ParamLayout& whole;   // the model's groups unsplit
    zero::ZeroProvider& provider;
    dist::ProcessGrid& grid;  // training's
    bool prunes;              // this rank removes what keep_last drops (rank 0)
    std::ostream* progress;   // "saved checkpoint ..." when a background save ends; null: silent
    std::function<void(std::int64_t step)> async_save_started;  // tests: on the save's thread
  };
  // `save_grid`: save_async's grid over `save_comm` (null where one rank needs none); both null
  // without save_async.
  CheckpointSaver(const Parts& parts, std::unique_ptr<dist::Communicator> save_comm,
                  std::unique_ptr<dist::ProcessGrid> save_grid);
  // Waits for the save in flight: it reads the provider and the layouts.
  ~CheckpointSaver();
  CheckpointSaver(const CheckpointSaver&) = delete;
  CheckpointSaver& operator=(const CheckpointSaver&) = delete;

  // `state`'s checkpoint: written now, or with save_async started in the background after the
  // save before it has ended (whose error is then this call's). The checkpoint's path.
  Result<std::string> save(const TrainerState& state);
  // Joins the save in flight (if any), reports it and prunes after it; its error.
  Status finish();
  // The same for a save that has ended; nothing while it runs or when there is none.
  Status poll();
  // The newest checkpoint saved whole; empty if none.
  const std::string& last_checkpoint() const { return last_; }

 private:
  // After a complete save: the newest checkpoint, and keep_last's pruning.
  void saved(const std::string& path);

  struct InFlight {
    std::string path;  // the checkpoint it writes
    Stopwatch clock;
    std::future<Result<std::string>> result;  // std::async's: its destructor waits for the save
  };
  Parts p_;
  std::unique_ptr<dist::Communicator> save_comm_;
  std::unique_ptr<dist::ProcessGrid> save_grid_;
  std::unique_ptr<InFlight> saving_;
  std::string last_;
};

}  // namespace strata::train
