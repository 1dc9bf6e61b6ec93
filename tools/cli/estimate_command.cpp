// `strata estimate CONFIG [--set k=v]... [--ranks N] [--json]`: the memory plan of a config,
// without allocating the model.
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "strata/train/config.h"
#include "strata/train/estimate.h"
#include "strata/train/resolve.h"
#include "strata/train/step_probe.h"
#include "strata/train/step_time.h"
#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

struct EstimateArgs {
  std::string config_path, deepspeed, gpu;
  std::vector<std::string> sets;
  int ranks = 1;
  bool json = false;
};

// The verdict: each budget against what the plan needs of it.
Json budgets_of(const train::TrainConfig& config, const train::Estimate& e) {
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

std::string verdict_line(const train::TrainConfig& config, const train::Estimate& e) {
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

int run_estimate(const EstimateArgs& a) {
  // A config that cannot run: the reasons on stderr, one a line; under --json also a JSON
  // object on stdout ({"fits": false, "error": ...}), so a script reads every outcome alike.
  const auto fail = [&a](const Status& s) {
    std::fprintf(stderr, "strata estimate: %s\n", s.message().c_str());
    const int code = s.code() == StatusCode::kInvalidArgument ? kExitUsage : kExitError;
    if (a.json) {
      std::cout << Json{{"fits", false}, {"error", s.message()}, {"exit_code", code}}.dump()
                << "\n";
    }
    return code;
  };
  Json keys = Json::object();
  if (!a.deepspeed.empty()) keys["deepspeed"] = a.deepspeed;
  auto config = train::load_train_config(a.config_path, a.sets, keys);
  if (!config.is_ok()) return fail(config.status());
  // "auto" measures the machine's rates (about a second) to choose; a fixed grid and placement are
  // planned first, so that one that cannot run is refused at once.
  auto resolved = train::resolve_config(*config, {a.ranks, 0});
  if (!resolved.is_ok()) return fail(resolved.status());
  *config = resolved->config;
  const train::Estimate* e = &resolved->planned;
  // Pipeline stages plan apart (each its layers, the first the embedding, the last the head):
  // every stage's first rank must fit, as its rank checks when training starts.
  std::vector<train::Estimate> stages;
  const int stage_ranks = a.ranks / config->pipeline_parallel_size;
  for (int s = 1; s < config->pipeline_parallel_size; ++s) {
    auto st = train::estimate_with_changes(*config, a.ranks, {s * stage_ranks, true});
    if (!st.is_ok()) {
      return fail(st.status().with_context("pipeline stage " + std::to_string(s) + " (rank " +
                                           std::to_string(s * stage_ranks) + ")"));
    }
    stages.push_back(std::move(*st));
  }
  if (!resolved->rates) resolved->rates = train::calibrate(*config);
  // A GPU this machine lacks: a named one's published rate, or say that compute is not
  // predicted.
  if (!a.gpu.empty()) {
    auto named = train::named_gpu_gemm_rate(a.gpu, *config);
    if (!named.is_ok()) return fail(named.status());
    if (config->device != device::DeviceKind::kCuda) {
      return fail(invalid_argument("--gpu " + a.gpu +
                                   " predicts a GPU run, but the config's "
                                   "device is \"cpu\"; set device \"cuda\""));
    }
    resolved->rates->gemm_flops = *named;
    resolved->rates->layer_passes = {0, false,
                                     "not measured: layers this large run at the GEMM rate"};
    resolved->rates->end_passes = resolved->rates->layer_passes;
  } else if (config->device == device::DeviceKind::kCuda && !resolved->rates->gemm_flops.measured) {
    resolved->rates->gemm_flops.how +=
        std::string(
            "; compute is not predicted: --gpu NAME predicts with a named GPU's "
            "published rate (") +
        train::kNamedGpus + ")";
  }
  const train::MachineRates& rates = *resolved->rates;
  train::StepTime step = train::predict_step(*config, *e, rates);
  // A small model's step is timed: a few steps of 1- and 3-layer variants of the config.
  bool timed = false;
  if (auto t = train::time_small_step(*config, a.ranks, rates); t.is_ok()) {
    step.step_ms = *t;
    step.slowest_ms = step.fastest_ms = 0;  // the spread is the formula's, not the timed run's
    step.schedule =
        "timed: steps of 1- and 3-layer variants of this config, scaled to its "
        "layers; the parts are the model's";
    timed = true;
  }
  if (a.json) {
    Json out = e->to_json();
    out["fits"] = true;
    out["budgets"] = budgets_of(*config, *e);
    out["step_ms"] = step.step_ms;
    out["step_timed"] = timed;
    // false: no compute rate (a GPU this machine lacks, without --gpu): step_ms leaves it out.
    out["step_predicted"] = timed || rates.gemm_flops.per_s > 0;
    out["step"] = step.to_json();
    out["rates"] = rates.to_json();
    out["offload_param"] = zero::offload_name(config->offload_param);
    out["offload_optimizer"] = zero::offload_name(config->offload_optimizer);
    out["tensor_parallel_size"] = config->tensor_parallel_size;
    out["pipeline_parallel_size"] = config->pipeline_parallel_size;
    if (!stages.empty()) {
      Json later = Json::array();
      for (const train::Estimate& st : stages) later.push_back(st.to_json());
      out["later_stages"] = later;  // stage 1, 2, ...: each its first rank's plan
    }
    std::cout << out.dump() << "\n";
    return kExitOk;
  }
  std::cout << verdict_line(*config, *e) << config->deepspeed_line() << resolved->describe()
            << e->describe();
  for (std::size_t i = 0; i < stages.size(); ++i) {
    const zero::MemoryPlan& p = stages[i].plan;
    std::cout << "pipeline stage " << i + 1 << " (rank " << stages[i].rank << "): device "
              << format_bytes(stages[i].device_bytes_needed()) << " (peak "
              << format_bytes(p.peak(Tier::kDevice)) << "), host "
              << format_bytes(p.tier_bytes(Tier::kHost)) << ", nvme "
              << format_bytes(p.tier_bytes(Tier::kNvme)) << "\n";
  }
  const auto secs = [](double ms) {
    char b[32];
    std::snprintf(b, sizeof(b), "%.2f s", ms / 1e3);
    return std::string(b);
  };
  if (rates.gemm_flops.per_s <= 0 && !timed) {
    // No compute rate (a GPU this machine lacks): no step time, only what else it holds.
    std::cout << "predicted step: not predicted, no rate for the compute (--gpu NAME: a named "
                 "GPU's); beside it: transfers "
              << secs(step.transfer_ms) << ", optimizer " << secs(step.optimizer_ms)
              << ", communication " << secs(step.comm_ms) << "\n";
  } else {
    std::cout << "predicted step: " << secs(step.step_ms);
    if (step.slowest_ms > 0) {
      std::cout << ", " << secs(step.fastest_ms) << " to " << secs(step.slowest_ms)
                << " over the drive's measured spread";
    }
    std::cout << " (" << step.schedule << "; serial " << secs(step.serial_ms);
    if (step.overlapped_ms > 0) std::cout << ", overlapped " << secs(step.overlapped_ms);
    std::cout << "): compute " << secs(step.compute_ms) << ", transfers " << secs(step.transfer_ms)
              << ", optimizer " << secs(step.optimizer_ms) << ", communication "
              << secs(step.comm_ms);
    if (step.tensor_ms > 0) std::cout << ", tensor-parallel " << secs(step.tensor_ms);
    if (config->pipeline_parallel_size > 1) {
      std::cout << ", pipeline bubble " << secs(step.bubble_ms) << ", stage boundaries "
                << secs(step.boundary_ms);
    }
    std::cout << "\n";
  }
  const auto rate = [](const char* what, const train::Rate& r, double unit, const char* units) {
    char b[64];
    if (r.has_spread()) {
      std::snprintf(b, sizeof(b), "%.1f %s (%.1f-%.1f)", r.per_s / unit, units, r.low_per_s / unit,
                    r.high_per_s / unit);
    } else {
      std::snprintf(b, sizeof(b), "%.1f %s", r.per_s / unit, units);
    }
    std::cout << "  " << what << ": " << (r.per_s > 0 ? std::string(b) + ", " : std::string())
              << (r.measured ? "measured (" + r.how + ")" : r.how) << "\n";
  };
  std::cout << "rates:\n";
  rate("matrix products", rates.gemm_flops, 1e9, "GFLOP/s");
  if (rates.attention_gemm_flops.per_s > 0 || rates.attention_gemm_flops.measured) {
    rate("attention projections", rates.attention_gemm_flops, 1e9, "GFLOP/s");
  }
  if (rates.head_gemm_flops.per_s > 0 || rates.head_gemm_flops.measured) {
    rate("the LM head's products", rates.head_gemm_flops, 1e9, "GFLOP/s");
  }
  rate("decoder layer", rates.layer_passes, 1, "forward+backward passes/s");
  rate("embedding, head and loss", rates.end_passes, 1, "forward+backward passes/s");
  rate("host memory", rates.memory_bytes, 1e9, "GB/s");
  rate("nvme read", rates.nvme_read_bytes, 1e9, "GB/s");
  rate("nvme write", rates.nvme_write_bytes, 1e9, "GB/s");
  if (rates.nvme_mixed_bytes.measured) {
    rate("nvme reads and writes at once", rates.nvme_mixed_bytes, 1e9, "GB/s each way");
  }
  if (e->ranks > 1) rate("collectives", rates.comm_bytes, 1e9, "GB/s");
  return kExitOk;
}

}  // namespace

Runner add_estimate_command(CLI::App& app) {
  auto args = std::make_shared<EstimateArgs>();
  auto* cmd = app.add_subcommand(
      "estimate",
      "Print where a config's tensors will live and the bytes of each memory tier, without "
      "allocating the model");
  cmd->add_option("config", args->config_path, "JSON config file")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--set", args->sets, "Override a config key, as for train (repeatable)")
      ->allow_extra_args(false);
  cmd->add_option("--ranks", args->ranks, "Plan rank 0 of a job of this many ranks (default 1)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--json", args->json, "One JSON object instead of the text");
  cmd->add_option(
      "--gpu", args->gpu,
      std::string("With device \"cuda\" on a machine without that GPU: predict the step "
                  "with a named GPU's published rate (") +
          train::kNamedGpus + ")");
  cmd->add_option("--deepspeed", args->deepspeed,
                  "A DeepSpeed config file whose keys join the config's, as for train");
  return [args] { return run_estimate(*args); };
}

}  // namespace strata::cli
