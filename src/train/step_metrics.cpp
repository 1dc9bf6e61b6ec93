// A step's metrics as a JSON line and as progress lines.
#include "strata/train/step_metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "strata/core/json.h"

namespace strata::train {

Json StepMetrics::to_json() const {
  Json j{{"step", step},
         {"loss", loss},
         {"lr", lr},
         {"grad_norm", grad_norm},
         {"skipped", skipped},
         {"tokens_per_s", tokens_per_s},
         {"step_ms", step_ms},
         {"compute_ms", compute_ms},
         {"wait_ms", wait_ms},
         {"stall_ms", stall_ms},
         {"save_stall_ms", save_stall_ms},
         {"optimizer_ms", optimizer_ms},
         {"optimizer_exposed_ms", optimizer_exposed_ms},
         {"optimizer_device_ms", optimizer_device_ms},
         {"optimizer_guessed", guessed},
         {"optimizer_redone", redone},
         {"optimizer_schedule", optimizer_schedule},
         {"h2d_busy_ms", h2d_busy_ms},
         {"d2h_busy_ms", d2h_busy_ms},
         {"nvme_read_busy_ms", nvme_read_busy_ms},
         {"nvme_write_busy_ms", nvme_write_busy_ms},
         {"h2d_bytes", h2d_bytes},
         {"d2h_bytes", d2h_bytes},
         {"nvme_read_bytes", nvme_read_bytes},
         {"nvme_write_bytes", nvme_write_bytes},
         {"peak_device_bytes", peak_device_bytes},
         {"peak_host_bytes", peak_host_bytes},
         {"peak_nvme_bytes", peak_nvme_bytes},
         {"peak_rss_bytes", peak_rss_bytes},
         {"planned_device_bytes", planned_device_bytes},
         {"planned_host_bytes", planned_host_bytes},
         {"planned_nvme_bytes", planned_nvme_bytes},
         {"predicted_rss_bytes", predicted_rss_bytes},
         {"comm_bytes", comm_bytes},
         {"all_to_all_bytes", all_to_all_bytes},
         {"sent_bytes", sent_bytes},
         {"loss_tokens", loss_tokens},
         {"elapsed_s", elapsed_s},
         {"eta_s", eta_s}};
  if (loss_scale) j["loss_scale"] = *loss_scale;
  if (aux_loss) {
    j["aux_loss"] = *aux_loss;
    j["experts_run"] = experts_run;
    j["experts_skipped"] = experts_skipped;
    j["expert_bytes"] = expert_bytes;
  }
  if (eval_loss) {
    j["eval_loss"] = *eval_loss;
    j["eval_ppl"] = *eval_ppl;
    j["eval_tokens"] = eval_tokens;
    j["eval_ms"] = eval_ms;
  }
  return j;
}

std::string format_scale(double scale) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.15g", scale);
  return buf;
}

std::string format_duration(double seconds) {
  const auto s = static_cast<long long>(std::llround(std::max(0.0, seconds)));
  char buf[48];
  if (s < 60) {
    std::snprintf(buf, sizeof(buf), "%llds", s);
  } else if (s < 3600) {
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", s / 60, s % 60);
  } else {
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", s / 3600, (s % 3600) / 60);
  }
  return buf;
}

std::string progress_line(const StepMetrics& m, std::int64_t max_steps) {
  char buf[768];
  std::snprintf(
      buf, sizeof(buf),
      "step %lld/%lld | loss %.4f | lr %.2e | grad_norm %.3f%s | %.0f tok/s | %.0f ms "
      "(compute %.0f, wait %.0f, stall %.0f, optim %.0f, hidden %.0f, exposed %.0f%s) | "
      "busy ms h2d %.0f d2h %.0f nvme r %.0f w %.0f | moved h2d %s d2h %s nvme r %s w %s | "
      "peak device %s host %s nvme %s rss %s | comm %s",
      static_cast<long long>(m.step), static_cast<long long>(max_steps), m.loss, m.lr, m.grad_norm,
      m.skipped ? " (skipped)" : "", m.tokens_per_s, m.step_ms, m.compute_ms, m.wait_ms, m.stall_ms,
      m.optimizer_ms, std::max(0.0, m.optimizer_ms - m.optimizer_exposed_ms),
      m.optimizer_exposed_ms,
      m.redone                                                ? ", redone"
      : m.guessed                                             ? ", beside backward"
      : m.schedule_measured && m.optimizer_schedule == "none" ? ", serial (auto)"
                                                              : "",
      m.h2d_busy_ms, m.d2h_busy_ms, m.nvme_read_busy_ms, m.nvme_write_busy_ms,
      format_bytes(m.h2d_bytes).c_str(), format_bytes(m.d2h_bytes).c_str(),
      format_bytes(m.nvme_read_bytes).c_str(), format_bytes(m.nvme_write_bytes).c_str(),
      format_bytes(m.peak_device_bytes).c_str(), format_bytes(m.peak_host_bytes).c_str(),
      format_bytes(m.peak_nvme_bytes).c_str(), format_bytes(m.peak_rss_bytes).c_str(),
      format_bytes(m.comm_bytes).c_str());
  std::string line = buf;
  // MoE models: the load-balancing loss beside the language model's.
  if (m.aux_loss) {
    char aux[48];
    std::snprintf(aux, sizeof(aux), " | aux_loss %.4f", *m.aux_loss);
    const std::size_t at = line.find(" | lr ");
    line.insert(at == std::string::npos ? line.size() : at, aux);
  }
  // Pipeline stages: what this rank sent across its boundaries.
  if (m.sent_bytes > 0) line += ", sent " + format_bytes(m.sent_bytes);
  // MoE models: the experts run and skipped, and the bytes of those run.
  if (m.aux_loss) {
    line += " | experts " + std::to_string(m.experts_run) + " run, " +
            std::to_string(m.experts_skipped) + " skipped, " + format_bytes(m.expert_bytes);
  }
  // fp16: the loss scale the step ran with.
  if (m.loss_scale) line += " | loss scale " + format_scale(*m.loss_scale);
  line += " | " + format_duration(m.elapsed_s) + " elapsed";
  if (m.step < max_steps) line += ", ETA " + format_duration(m.eta_s);
  return line;
}

std::string eval_line(const StepMetrics& m, std::int64_t max_steps) {
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                "eval at step %lld/%lld | loss %.4f | perplexity %.2f | %lld targets | %.0f ms",
                static_cast<long long>(m.step), static_cast<long long>(max_steps), *m.eval_loss,
                *m.eval_ppl, static_cast<long long>(m.eval_tokens), m.eval_ms);
  return buf;
}

StepPeaks peaks_of(const std::vector<StepMetrics>& history) {
  StepPeaks p;
  for (const StepMetrics& m : history) {
    p.device = std::max(p.device, m.peak_device_bytes);
    p.host = std::max(p.host, m.peak_host_bytes);
    p.nvme = std::max(p.nvme, m.peak_nvme_bytes);
    p.rss = std::max(p.rss, m.peak_rss_bytes);
  }
  return p;
}

double steady_step_ms(const std::vector<StepMetrics>& history) {
  if (history.size() < 2) return 0;
  std::vector<double> steps;
  for (std::size_t i = 1; i < history.size(); ++i) steps.push_back(history[i].step_ms);
  std::sort(steps.begin(), steps.end());
  return steps[steps.size() / 2];
}

}  // namespace strata::train
