// A run's checkpoints as it saves them (checkpoint_saver.h).
#include "src/train/checkpoint_saver.h"

#include <chrono>
#include <filesystem>
#include <iomanip>
#include <ostream>
#include <utility>

#include "strata/core/logging.h"

namespace strata::train {

CheckpointSaver::CheckpointSaver(const Parts& parts, std::unique_ptr<dist::Communicator> save_comm,
                                 std::unique_ptr<dist::ProcessGrid> save_grid)
    : p_(parts), save_comm_(std::move(save_comm)), save_grid_(std::move(save_grid)) {}

CheckpointSaver::~CheckpointSaver() {
  if (saving_) saving_->result.wait();
}

Result<std::string> CheckpointSaver::save(const TrainerState& state) {
  const TrainConfig& c = p_.config;
  if (!c.save_async) {
    auto path = save_checkpoint(c.save_dir, c.model, p_.layout, p_.whole, c.lora(), p_.provider,
                                p_.grid, state);
    STRATA_RETURN_IF_ERROR(path.status());
    saved(*path);
    return path;
  }
  // At most one save in flight: the one before ends first (its error is this save's).
  STRATA_RETURN_IF_ERROR(finish());
  STRATA_RETURN_IF_ERROR(p_.provider.hold_state());
  auto job = std::make_unique<InFlight>();
  job->path = (std::filesystem::path(c.save_dir) / step_name(state.step)).string();
  job->result = std::async(std::launch::async, [this, state] {
    if (p_.async_save_started) p_.async_save_started(state.step);
    const TrainConfig& config = p_.config;
    auto path = save_checkpoint(config.save_dir, config.model, p_.layout, p_.whole, config.lora(),
                                p_.provider, *save_grid_, state, /*held_state=*/true);
    p_.provider.release_state();
    return path;
  });
  saving_ = std::move(job);
  return saving_->path;
}

void CheckpointSaver::saved(const std::string& path) {
  last_ = path;
  const TrainConfig& c = p_.config;
  if (c.keep_last > 0 && p_.prunes) {
    // The new checkpoint is complete and `latest` names it; a failed prune costs disk, not data.
    auto pruned = prune_checkpoints(c.save_dir, c.keep_last);
    if (!pruned.is_ok()) {
      log_warning("keep_last " + std::to_string(c.keep_last) + ": " + pruned.status().message());
    } else {
      for (const std::string& dir : *pruned) log_info("keep_last: removed " + dir);
    }
  }
}

Status CheckpointSaver::finish() {
  if (!saving_) return Status::ok();
  const std::unique_ptr<InFlight> done = std::move(saving_);
  const Result<std::string> path = done->result.get();
  if (!path.is_ok()) return path.status();
  saved(*path);
  if (p_.progress != nullptr) {
    *p_.progress << "saved checkpoint " << *path << " (" << std::fixed << std::setprecision(1)
                 << done->clock.elapsed_ms() / 1e3 << " s in the background)" << std::endl;
  }
  return Status::ok();
}

Status CheckpointSaver::poll() {
  if (!saving_ || saving_->result.wait_for(std::chrono::seconds(0)) != std::future_status::ready) {
    return Status::ok();
  }
  return finish();
}

}  // namespace strata::train
