// The counters of one training step (step_recorder.h).
#include "src/train/step_recorder.h"

#include <cstddef>

#include "strata/sys/process.h"
#include "strata/zero/plan.h"

namespace strata::train {

dist::CommStats StepRecorder::comm_stats() const {
  dist::CommStats s = rooms_.grid.stats();
  if (rooms_.tensor_group != nullptr) s += rooms_.tensor_group->replica_stats();
  return s;
}

void StepRecorder::begin() {
  provider_before_ = rooms_.provider.stats();
  comm_before_ = comm_stats();
  busy_before_ = rooms_.timeline.busy_ms();
  io_before_ = rooms_.swap != nullptr ? rooms_.swap->stats() : io::IoStats{};
  rooms_.device.reset_peak();
  clock_.reset();
}

double StepRecorder::compute_ms(double model_ms) const {
  return model_ms - rooms_.provider.stats().since(provider_before_).optimizer_exposed_ms;
}

void StepRecorder::finish(std::int64_t tokens, StepMetrics* m) {
  m->step_ms = clock_.elapsed_ms();
  m->tokens_per_s = static_cast<double>(tokens) / (m->step_ms / 1e3);
  const zero::ZeroProvider& provider = rooms_.provider;
  const zero::RankStats d = provider.stats().since(provider_before_);
  m->optimizer_ms = d.optimizer_total_ms;
  m->optimizer_exposed_ms = d.optimizer_exposed_ms;
  m->optimizer_device_ms = d.optimizer_device_ms;
  m->guessed = d.steps_guessed > 0;
  m->redone = d.steps_redone > 0;
  m->optimizer_schedule = zero::optimizer_overlap_name(provider.step_schedule());
  m->schedule_measured = provider.plan().measure_overlap;
  m->wait_ms = d.wait_ms;
  m->stall_ms = d.stall_ms;
  m->save_stall_ms = save_stall_ms_;
  save_stall_ms_ = 0;
  const auto busy = rooms_.timeline.busy_ms();
  auto lane = [](mem::Lane l) { return static_cast<std::size_t>(l); };
  m->h2d_busy_ms =
      busy[lane(mem::Lane::kHostToDevice)] - busy_before_[lane(mem::Lane::kHostToDevice)];
  m->d2h_busy_ms =
      busy[lane(mem::Lane::kDeviceToHost)] - busy_before_[lane(mem::Lane::kDeviceToHost)];
  if (rooms_.swap != nullptr) {
    // The swap space's own clock: every NVMe request, the optimizer's streaming included.
    const io::IoStats io_after = rooms_.swap->stats();
    m->nvme_read_busy_ms = (io_after.read_busy_s - io_before_.read_busy_s) * 1e3;
    m->nvme_write_busy_ms = (io_after.write_busy_s - io_before_.write_busy_s) * 1e3;
  }
  m->h2d_bytes = d.h2d_bytes;
  m->d2h_bytes = d.d2h_bytes;
  m->nvme_read_bytes = d.nvme_read_bytes;
  m->nvme_write_bytes = d.nvme_write_bytes;
  m->peak_device_bytes = rooms_.device.memory_stats().peak_bytes;
  m->peak_host_bytes = d.host_bytes;
  m->peak_nvme_bytes = d.nvme_bytes;
  const dist::CommStats comm_after = comm_stats();
  m->comm_bytes = (comm_after.all_gather_bytes - comm_before_.all_gather_bytes) +
                  (comm_after.reduce_scatter_bytes - comm_before_.reduce_scatter_bytes) +
                  (comm_after.all_reduce_bytes - comm_before_.all_reduce_bytes) +
                  (comm_after.all_to_all_bytes - comm_before_.all_to_all_bytes);
  m->all_to_all_bytes = comm_after.all_to_all_bytes - comm_before_.all_to_all_bytes;
  m->sent_bytes = comm_after.sent_bytes - comm_before_.sent_bytes;
  if (auto mem = sys::read_process_memory(); mem.is_ok()) m->peak_rss_bytes = mem->peak_rss_bytes;
  const Estimate& planned = rooms_.planned;
  m->planned_device_bytes = planned.plan.peak(Tier::kDevice);
  m->planned_host_bytes = planned.plan.peak(Tier::kHost);
  m->planned_nvme_bytes = planned.plan.tier_bytes(Tier::kNvme);
  m->predicted_rss_bytes = planned.rss_bytes;
}

}  // namespace strata::train
