// EstimateReport: strata estimate's figures made once, printed as text or JSON.
#include "strata/train/estimate_report.h"

#include <cstdio>
#include <sstream>
#include <utility>

#include "strata/train/step_probe.h"

namespace strata::train {
namespace {

// The verdict: each budget against what the plan needs of it.
Json budgets_of(const TrainConfig& config, const Estimate& e) {
  const auto budget = [](std::uint64_t limit) { return limit == 0 ? Json() : Json(limit); };
  return Json{{"device",
               {{"needed_bytes", e.device_bytes_needed()},
                {"peak_bytes", e.plan.peak(Tier::kDevice)},
                {"budget_bytes", budget(config.device_memory_limit)}}},
              {"host",
               {{"peak_bytes", e.plan.peak(Tier::kHost)},
                {"budget_bytes", budget(config.host_memory_limit)}}},
              {"nvme", {{"bytes", e.plan.tier_bytes(Tier::kNvme)}}}};
}

std::string verdict_line(const TrainConfig& config, const Estimate& e) {
  const auto of = [](std::uint64_t limit) {
    return limit == 0 ? std::string(" (no budget)") : " of its " + format_bytes(limit);
  };
  std::string s = "fits: device " + format_bytes(e.device_bytes_needed()) +
                  of(config.device_memory_limit) + ", pinned host " +
                  format_bytes(e.plan.peak(Tier::kHost)) + of(config.host_memory_limit);
  if (e.plan.tier_bytes(Tier::kNvme) > 0) {
    s += ", nvme " + format_bytes(e.plan.tier_bytes(Tier::kNvme)) + " of the swap paths";
  }
  return s + "\n";
}

std::string secs(double ms) {
  char b[32];
  std::snprintf(b, sizeof(b), "%.2f s", ms / 1e3);
  return b;
}

std::string rate_line(const char* what, const Rate& r, double unit, const char* units) {
  char b[64];
  if (r.has_spread()) {
    std::snprintf(b, sizeof(b), "%.1f %s (%.1f-%.1f)", r.per_s / unit, units, r.low_per_s / unit,
                  r.high_per_s / unit);
  } else {
    std::snprintf(b, sizeof(b), "%.1f %s", r.per_s / unit, units);
  }
  return "  " + std::string(what) + ": " + (r.per_s > 0 ? std::string(b) + ", " : std::string()) +
         (r.measured ? "measured (" + r.how + ")" : r.how) + "\n";
}

}  // namespace

Result<EstimateReport> estimate_report(const TrainConfig& read, const EstimateRequest& request) {
  const int ranks = request.ranks;
  // "auto" measures the machine's rates (about a second) to choose; a fixed grid and placement are
  // planned first, so that one that cannot run is refused at once.
  ResolveOptions ro;
  ro.world = ranks;
  ro.gpu = request.gpu;
  STRATA_ASSIGN_OR_RETURN(ResolvedConfig resolved, resolve_config(read, ro));
  EstimateReport r;
  const TrainConfig& config = resolved.config;
  // Pipeline stages plan apart (each its layers, the first the embedding, the last the head):
  // every stage's first rank must fit, as its rank checks when training starts.
  const int stage_ranks = ranks / config.pipeline_parallel_size;
  for (int s = 1; s < config.pipeline_parallel_size; ++s) {
    auto st = estimate_with_changes(config, ranks, {s * stage_ranks, true});
    if (!st.is_ok()) {
      return st.status().with_context("pipeline stage " + std::to_string(s) + " (rank " +
                                      std::to_string(s * stage_ranks) + ")");
    }
    r.stages.push_back(std::move(*st));
  }
  // A GPU this machine lacks: a named one's published rate (what "auto" chose by too), or say
  // that compute is not predicted.
  MachineRates rates;
  if (resolved.rates) {
    rates = *resolved.rates;
  } else {
    rates = calibrate(config);
    if (!request.gpu.empty()) STRATA_RETURN_IF_ERROR(use_named_gpu(request.gpu, config, &rates));
  }
  if (request.gpu.empty() && config.device == device::DeviceKind::kCuda &&
      !rates.gemm_flops.measured) {
    rates.gemm_flops.how += std::string(
                                "; compute is not predicted: --gpu NAME predicts with a named "
                                "GPU's published rate (") +
                            kNamedGpus + ")";
  }
  r.step = predict_step(config, resolved.planned, rates);
  // A small model's step is timed: a few steps of 1- and 3-layer variants of the config.
  if (auto t = time_small_step(config, ranks, rates); t.is_ok()) {
    r.step.step_ms = *t;
    r.step.slowest_ms = r.step.fastest_ms = 0;  // the spread is the formula's, not the timed run's
    r.step.schedule =
        "timed: steps of 1- and 3-layer variants of this config, scaled to its layers; the "
        "parts are the model's";
    r.timed = true;
  }
  r.rates = std::move(rates);
  r.resolved = std::move(resolved);
  return r;
}

Json EstimateReport::to_json() const {
  const TrainConfig& c = config();
  Json out = planned().to_json();
  out["fits"] = true;
  out["budgets"] = budgets_of(c, planned());
  out["step_ms"] = step.step_ms;
  out["step_timed"] = timed;
  // false: no compute rate (a GPU this machine lacks, without --gpu): step_ms leaves it out.
  out["step_predicted"] = timed || rates.gemm_flops.per_s > 0;
  out["step"] = step.to_json();
  out["rates"] = rates.to_json();
  out["offload_param"] = zero::offload_name(c.offload_param);
  out["offload_optimizer"] = zero::offload_name(c.offload_optimizer);
  out["offload_optimizer_fraction"] = planned().plan.offload_fraction;
  out["tensor_parallel_size"] = c.tensor_parallel_size;
  out["pipeline_parallel_size"] = c.pipeline_parallel_size;
  if (!stages.empty()) {
    Json later = Json::array();
    for (const Estimate& st : stages) later.push_back(st.to_json());
    out["later_stages"] = later;  // stage 1, 2, ...: each its first rank's plan
  }
  return out;
}

std::string EstimateReport::describe() const {
  const TrainConfig& c = config();
  std::ostringstream o;
  o << verdict_line(c, planned()) << c.deepspeed_line() << resolved.describe()
    << planned().describe();
  for (std::size_t i = 0; i < stages.size(); ++i) {
    const zero::MemoryPlan& p = stages[i].plan;
    o << "pipeline stage " << i + 1 << " (rank " << stages[i].rank << "): device "
      << format_bytes(stages[i].device_bytes_needed()) << " (peak "
      << format_bytes(p.peak(Tier::kDevice)) << "), host "
      << format_bytes(p.tier_bytes(Tier::kHost)) << ", nvme "
      << format_bytes(p.tier_bytes(Tier::kNvme)) << "\n";
  }
  if (rates.gemm_flops.per_s <= 0 && !timed) {
    // No compute rate (a GPU this machine lacks): no step time, only what else it holds.
    o << "predicted step: not predicted, no rate for the compute (--gpu NAME: a named GPU's); "
         "beside it: transfers "
      << secs(step.transfer_ms) << ", optimizer " << secs(step.optimizer_ms) << ", communication "
      << secs(step.comm_ms) << "\n";
  } else {
    o << "predicted step: " << secs(step.step_ms);
    if (step.slowest_ms > 0) {
      o << ", " << secs(step.fastest_ms) << " to " << secs(step.slowest_ms)
        << " over the drive's measured spread";
    }
    o << " (" << step.schedule << "; serial " << secs(step.serial_ms);
    if (step.overlapped_ms > 0) o << ", overlapped " << secs(step.overlapped_ms);
    o << "): compute " << secs(step.compute_ms) << ", transfers " << secs(step.transfer_ms)
      << ", optimizer " << secs(step.optimizer_ms) << ", communication " << secs(step.comm_ms);
    if (step.device_optimizer_ms > 0) {
      o << ", the device's share of the optimizer " << secs(step.device_optimizer_ms);
    }
    if (step.tensor_ms > 0) o << ", tensor-parallel " << secs(step.tensor_ms);
    if (step.expert_ms > 0) o << ", expert exchanges " << secs(step.expert_ms);
    if (c.pipeline_parallel_size > 1) {
      o << ", pipeline bubble " << secs(step.bubble_ms) << ", stage boundaries "
        << secs(step.boundary_ms);
    }
    o << "\n";
  }
  o << "rates:\n" << rate_line("matrix products", rates.gemm_flops, 1e9, "GFLOP/s");
  if (rates.attention_gemm_flops.per_s > 0 || rates.attention_gemm_flops.measured) {
    o << rate_line("attention projections", rates.attention_gemm_flops, 1e9, "GFLOP/s");
  }
  if (rates.head_gemm_flops.per_s > 0 || rates.head_gemm_flops.measured) {
    o << rate_line("the LM head's products", rates.head_gemm_flops, 1e9, "GFLOP/s");
  }
  o << rate_line("decoder layer", rates.layer_passes, 1, "forward+backward passes/s")
    << rate_line("embedding, head and loss", rates.end_passes, 1, "forward+backward passes/s")
    << rate_line("host memory", rates.memory_bytes, 1e9, "GB/s");
  if (rates.device_memory_bytes.measured) {
    o << rate_line("device memory", rates.device_memory_bytes, 1e9, "GB/s");
  }
  o << rate_line("nvme read", rates.nvme_read_bytes, 1e9, "GB/s")
    << rate_line("nvme write", rates.nvme_write_bytes, 1e9, "GB/s");
  if (rates.nvme_mixed_bytes.measured) {
    o << rate_line("nvme reads and writes at once", rates.nvme_mixed_bytes, 1e9, "GB/s each way");
  }
  const int ranks = planned().ranks, per_node = c.ranks_per_node;
  if (ranks > 1) {
    o << rate_line(per_node > 0 && per_node < ranks ? "collectives within a node" : "collectives",
                   rates.comm_bytes, 1e9, "GB/s");
  }
  if (per_node > 0 && per_node < ranks) {
    const std::string what = "a node's link to the others (" + std::to_string(per_node) +
                             " rank(s) a node, ranks_per_node)";
    o << rate_line(what.c_str(), rates.inter_node_bytes, 1e9 / 8, "Gbit/s each way");
  }
  return o.str();
}

Json refusal_json(const Status& status) {
  const int exit_code = status.code() == StatusCode::kInvalidArgument ? 2 : 1;
  return Json{{"fits", false}, {"error", status.message()}, {"exit_code", exit_code}};
}

}  // namespace strata::train
