// The placements a config leaves open and what would make one fit: the smallest budget raises,
// free swap space or micro-batch, another placement, the changes to the training itself, and
// the fastest placement that fits ("auto").
#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "strata/device/adam8bit.h"
#include "strata/train/step_time.h"
#include "strata/zero/plan.h"

namespace strata::train {
namespace {

// The list of changes that would fit, one a line: "\nto fit, any one of:\n  - raise ...".
constexpr const char* kToFit = "\nto fit, any one of:";

// Variants of a config that the caller compares itself: no suggestions; with the swap paths'
// free space, or without (what a placement would need on NVMe).
const EstimateOptions kVariant{0, true};
const EstimateOptions kVariantUnchecked{0, false};

std::string placement_name(Tier param, Tier optimizer) {
  return std::string(zero::offload_name(param)) + "/" + std::string(zero::offload_name(optimizer));
}

// The placements a config leaves open ("auto" keys range over every tier), each with the reason
// it cannot run whatever the budgets, or none.
struct Candidate {
  Tier param, optimizer;
  std::string refused;
};
std::vector<Candidate> candidates(const TrainConfig& config) {
  const std::vector<Tier> all = {Tier::kDevice, Tier::kHost, Tier::kNvme};
  const std::vector<Tier> params =
      config.offload_param_auto ? all : std::vector{config.offload_param};
  const std::vector<Tier> optimizers =
      config.offload_optimizer_auto ? all : std::vector{config.offload_optimizer};
  std::vector<Candidate> out;
  for (Tier p : params) {
    for (Tier o : optimizers) {
      // Parameters off the device with the optimizer on it: only a frozen base moves.
      if (p != Tier::kDevice && o == Tier::kDevice && !config.lora()) continue;
      Candidate c{p, o, ""};
      if (p != Tier::kDevice && config.zero_stage != 3) {
        c.refused = "parameter offload needs zero_stage 3";
      }
      if ((p == Tier::kNvme || o == Tier::kNvme) && config.swap_paths.empty()) {
        c.refused = "no swap_paths";
      }
      out.push_back(std::move(c));
    }
  }
  return out;
}

// `config` with the candidate's placement.
TrainConfig placed(const TrainConfig& config, const Candidate& c) {
  TrainConfig out = config;
  out.offload_param = c.param;
  out.offload_optimizer = c.optimizer;
  out.offload_param_auto = out.offload_optimizer_auto = false;
  return out;
}

// The placement at the least memory it can run with: without a shadow optimizer state, which a
// plan drops when a budget or the swap space cannot hold it.
TrainConfig least(const TrainConfig& config, const Candidate& c) {
  TrainConfig out = placed(config, c);
  if (out.optimizer_overlap != zero::OptimizerOverlap::kNone) {
    out.optimizer_overlap = zero::OptimizerOverlap::kForward;
  }
  return out;
}

// `bytes` as format_bytes prints it, rounded up (not to the nearest) so that the printed size,
// set as a budget, holds `bytes`.
std::string bytes_at_least(std::uint64_t bytes) {
  const double unit = bytes >= (1ull << 30)   ? double(1ull << 30)
                      : bytes >= (1ull << 20) ? double(1ull << 20)
                                              : 1024.0;
  const double hundredths = std::ceil(static_cast<double>(bytes) / unit * 100.0);
  return format_bytes(static_cast<std::uint64_t>(std::ceil(hundredths / 100.0 * unit)));
}

// What each open placement needs of the device, the host and NVMe with no budgets, and the
// smallest raise of either budget, the free swap space a placement that fits both budgets lacks,
// or the largest micro-batch, that would let one of them run.
std::string smallest_changes(const TrainConfig& config, int ranks,
                             const std::vector<Candidate>& open) {
  // The device, host and NVMe bytes `c` needs with `micro_batch` sequences per micro-batch, with
  // no budgets, or keeping the host budget as it is (under which the plan may send gradients to
  // NVMe instead of asking for more host memory).
  const auto needs = [&](const Candidate& c, std::int64_t micro_batch, bool keep_host,
                         std::uint64_t* device, std::uint64_t* host,
                         std::uint64_t* nvme = nullptr) {
    TrainConfig unbounded = least(config, c);
    if (unbounded.micro_batch_size != micro_batch) {
      unbounded.micro_batch_size = micro_batch;
      unbounded.gradient_accumulation_steps = 0;  // the batch stays; the accumulation grows
    }
    unbounded.device_memory_limit = 0;
    if (!keep_host) unbounded.host_memory_limit = 0;
    auto e = estimate(unbounded, ranks, kVariantUnchecked);
    if (!e.is_ok()) return false;
    *device = e->device_bytes_needed();
    *host = e->plan.tier_bytes(Tier::kHost);
    if (nvme != nullptr) *nvme = e->plan.tier_bytes(Tier::kNvme);
    return true;
  };
  // The smallest host_memory_limit `c` plans under with the device budget as it is (the plan
  // moves gradients to NVMe before it needs more host memory); nullopt when the device budget
  // does not hold it.
  const auto host_needed = [&](const Candidate& c) -> std::optional<std::uint64_t> {
    TrainConfig t = least(config, c);
    t.host_memory_limit = 0;
    auto e = estimate(t, ranks, kVariantUnchecked);
    if (!e.is_ok()) return std::nullopt;
    std::uint64_t lo = 0, hi = e->plan.tier_bytes(Tier::kHost);  // fits at hi
    while (hi - lo > 4096) {
      t.host_memory_limit = lo + (hi - lo) / 2;
      (estimate(t, ranks, kVariantUnchecked).is_ok() ? hi : lo) = t.host_memory_limit;
    }
    return hi;
  };
  const auto within = [](std::uint64_t need, std::uint64_t budget) {
    return budget == 0 || need <= budget;
  };
  std::uint64_t device_need = 0, host_need = 0;
  std::string device_with, host_with;
  // Neither budget alone: both, for the placement that needs the least of the two together.
  std::uint64_t both_device = 0, both_host = 0;
  std::string both_with;
  // Both budgets hold it, but the swap paths have too little free: the least NVMe to free.
  const std::uint64_t swap_free = config.swap_paths.empty() ? 0 : swap_free_bytes(config, 0);
  std::uint64_t nvme_need = 0;
  std::string nvme_with;
  for (const Candidate& c : open) {
    std::uint64_t device = 0, host = 0, nvme = 0;
    if (!c.refused.empty()) continue;
    // Planned within both budgets as they are (gradients go to NVMe when the host cannot hold
    // them), short only of free swap space.
    if (swap_free != 0) {
      auto within_budgets = estimate(least(config, c), ranks, kVariantUnchecked);
      const std::uint64_t n =
          within_budgets.is_ok() ? within_budgets->plan.tier_bytes(Tier::kNvme) : 0;
      if (within_budgets.is_ok() &&
          within(within_budgets->device_bytes_needed(), config.device_memory_limit) &&
          n > swap_free && (nvme_need == 0 || n < nvme_need)) {
        nvme_need = n;
        nvme_with = placement_name(c.param, c.optimizer);
      }
    }
    if (!needs(c, config.micro_batch_size, false, &device, &host, &nvme)) continue;
    if (swap_free != 0 && nvme > swap_free) continue;  // no budget raise makes it fit
    if (both_with.empty() || device + host < both_device + both_host) {
      both_device = device;
      both_host = host;
      both_with = placement_name(c.param, c.optimizer);
    }
    // The device alone: what it needs under the host budget as it is.
    std::uint64_t kept_device = 0, kept_host = 0, kept_nvme = 0;
    if (needs(c, config.micro_batch_size, true, &kept_device, &kept_host, &kept_nvme) &&
        (swap_free == 0 || kept_nvme <= swap_free) &&
        (device_need == 0 || kept_device < device_need)) {
      device_need = kept_device;
      device_with = placement_name(c.param, c.optimizer);
    }
    // The host alone: the least host budget it plans under with the device budget as it is.
    if (const auto h = host_needed(c); h && (host_need == 0 || *h < host_need)) {
      host_need = *h;
      host_with = placement_name(c.param, c.optimizer);
    }
  }
  std::string out;
  const auto add = [&](const std::string& s) { out += "\n  - " + s; };
  if (nvme_need != 0) {
    add("swap_paths with " + bytes_at_least(nvme_need) + " free (" + nvme_with + "; they have " +
        format_bytes(swap_free) + ")");
  }
  if (device_need != 0) {
    add("raise device_memory_limit to " + bytes_at_least(device_need) + " (" + device_with + ")");
  }
  if (host_need != 0) {
    add("raise host_memory_limit to " + bytes_at_least(host_need) + " (" + host_with + ")");
  }
  if (device_need == 0 && host_need == 0 && !both_with.empty()) {
    add("raise device_memory_limit to " + bytes_at_least(both_device) +
        " and host_memory_limit to " + bytes_at_least(both_host) + " (" + both_with + ")");
  }
  // Fewer sequences per micro-batch shrink the activations; the same batch accumulates more.
  for (std::int64_t mb = config.micro_batch_size / 2; mb >= 1; mb /= 2) {
    if (config.batch_size % (mb * ranks) != 0) continue;
    const bool fits = std::any_of(open.begin(), open.end(), [&](const Candidate& c) {
      std::uint64_t device = 0, host = 0, nvme = 0;
      return c.refused.empty() && needs(c, mb, true, &device, &host, &nvme) &&
             within(device, config.device_memory_limit) && (swap_free == 0 || nvme <= swap_free);
    });
    if (fits) {
      add("micro_batch_size " + std::to_string(mb) +
          (config.gradient_accumulation_steps > 0
               ? " (gradient_accumulation_steps left out: the batch stays)"
               : ""));
      break;
    }
  }
  return out.empty() ? "" : std::string(kToFit) + out;
}

}  // namespace

Result<Estimate> estimate_with_changes(const TrainConfig& config, int ranks,
                                       const EstimateOptions& options) {
  Result<Estimate> e = estimate(config, ranks, options);
  if (e.is_ok() || e.status().code() != StatusCode::kOutOfMemory) return e;
  return out_of_memory(e.status().message() + changes_to_fit(config, ranks) +
                       other_changes(config, ranks));
}

std::string other_changes(const TrainConfig& config, int ranks) {
  // Each change at the config's placement (the first open one under "auto"), and what the plan
  // then needs with no budgets, against what it needs now.
  const std::vector<Candidate> open = candidates(config);
  const auto first =
      std::find_if(open.begin(), open.end(), [](const Candidate& c) { return c.refused.empty(); });
  if (first == open.end()) return "";
  const auto needs = [&](TrainConfig c) -> std::optional<std::pair<std::uint64_t, std::uint64_t>> {
    c = least(c, *first);
    c.device_memory_limit = 0;
    c.host_memory_limit = 0;
    auto e = estimate(c, ranks, kVariantUnchecked);
    if (!e.is_ok()) return std::nullopt;
    return std::pair{e->device_bytes_needed(), e->plan.tier_bytes(Tier::kHost)};
  };
  const auto now = needs(config);
  if (!now) return "";
  struct Change {
    std::string what;
    TrainConfig config;
  };
  std::vector<Change> changes;
  const auto add = [&](std::string what, const std::function<void(TrainConfig&)>& change) {
    TrainConfig c = config;
    change(c);
    changes.push_back({std::move(what), std::move(c)});
  };
  if (config.offload_optimizer_fraction < 1.0 && !config.offload_optimizer_fraction_auto) {
    add("offload_optimizer_fraction 1 (all of the optimizer state offloaded, none kept on the "
        "device)",
        [](TrainConfig& c) { c.offload_optimizer_fraction = 1.0; });
  }
  if (config.optimizer.state_dtype == DType::kF32 || config.optimizer.master_dtype == DType::kF32) {
    add("optimizer.state_dtype \"int8\" and master_dtype \"bf16\" (4.125 bytes of optimizer "
        "state a trained parameter instead of 12)",
        [](TrainConfig& c) {
          c.optimizer.state_dtype = device::kAdam8StateDType;
          c.optimizer.master_dtype = DType::kBF16;
        });
  }
  if (config.finetune.method == FinetuneMethod::kFull) {
    add("finetune {\"method\": \"lora\", \"r\": 16, \"target_modules\": \"all-linear\"} "
        "(adapters on a frozen base)",
        [](TrainConfig& c) {
          c.finetune.method = FinetuneMethod::kLora;
          c.finetune.lora.targets = model::LoraConfig::all_linear();
        });
  }
  if (config.finetune.method != FinetuneMethod::kQlora) {
    add("finetune {\"method\": \"qlora\", \"r\": 16, \"target_modules\": \"all-linear\"} (adapters "
        "on a 4-bit base)",
        [](TrainConfig& c) {
          c.finetune.method = FinetuneMethod::kQlora;
          c.finetune.lora.targets = model::LoraConfig::all_linear();
        });
  }
  const int data = ranks / (config.tensor_parallel_size * config.pipeline_parallel_size);
  if (config.accumulation_steps(data) > 1 && config.pipeline_parallel_size == 1) {
    add("micro_batch_size " + std::to_string(config.batch_size / data) +
            " (one micro-batch a step: no fp32 gradient sums, more activations)",
        [&](TrainConfig& c) {
          c.micro_batch_size = c.batch_size / data;
          c.gradient_accumulation_steps = 0;
        });
  }
  if (config.deterministic_reduction && config.accumulation_steps(data) >= 4) {
    add("deterministic_reduction false (one running fp32 sum a group instead of the summation "
        "tree's partial sums; rank counts then agree within rounding, not to the bit)",
        [](TrainConfig& c) {
          c.deterministic_reduction = false;
          c.deterministic_reduction_auto = false;
        });
  }
  if (!config.activation_checkpointing) {
    add("activation_checkpointing true (each layer's input kept, the layer recomputed)",
        [](TrainConfig& c) { c.activation_checkpointing = true; });
  } else if (config.activation_offload == Tier::kDevice) {
    add("activation_offload \"cpu\" (the checkpointed inputs in host memory)",
        [](TrainConfig& c) { c.activation_offload = Tier::kHost; });
  }
  if (config.swap_paths.empty()) {
    add("swap_paths [an NVMe drive's directory] with offload_param and offload_optimizer "
        "\"nvme\"",
        [](TrainConfig& c) {
          c.swap_paths = {"/nvme"};
          c.offload_param = c.offload_optimizer = Tier::kNvme;
          c.offload_param_auto = c.offload_optimizer_auto = false;
          if (c.zero_stage != 3) c.zero_stage = 3;
        });
  }
  std::string out;
  for (Change& c : changes) {
    // The swap paths change is planned at its own placement.
    const bool own_placement = !c.config.swap_paths.empty() && config.swap_paths.empty();
    std::optional<std::pair<std::uint64_t, std::uint64_t>> then;
    if (own_placement) {
      TrainConfig t = c.config;
      t.device_memory_limit = 0;
      t.host_memory_limit = 0;
      if (auto e = estimate(t, ranks, kVariantUnchecked); e.is_ok()) {
        then = std::pair{e->device_bytes_needed(), e->plan.tier_bytes(Tier::kHost)};
      }
    } else {
      then = needs(c.config);
    }
    if (!then || (then->first >= now->first && then->second >= now->second)) continue;  // no use
    const auto saved = [](std::uint64_t before, std::uint64_t after) {
      return after < before ? format_bytes(before - after) + " less" : "no less";
    };
    const bool fits =
        (config.device_memory_limit == 0 || then->first <= config.device_memory_limit) &&
        (config.host_memory_limit == 0 || then->second <= config.host_memory_limit);
    out += "\n  - " + c.what + ": device " + format_bytes(then->first) + " (" +
           saved(now->first, then->first) + "), host " + format_bytes(then->second) + " (" +
           saved(now->second, then->second) + ")" + (fits ? ", fits the budgets" : "");
  }
  return out.empty() ? "" : "\nother changes, each alone, and what the plan then needs:" + out;
}

std::string changes_to_fit(const TrainConfig& config, int ranks) {
  std::string out = smallest_changes(config, ranks, candidates(config));
  if (config.offload_param_auto && config.offload_optimizer_auto) return out;
  // Another placement that fits the budgets as they are: the one that offloads least.
  TrainConfig any = config;
  any.offload_param_auto = any.offload_optimizer_auto = true;
  for (const Candidate& c : candidates(any)) {
    if (!c.refused.empty() ||
        (c.param == config.offload_param && c.optimizer == config.offload_optimizer)) {
      continue;
    }
    auto e = estimate(placed(config, c), ranks, kVariant);
    if (!e.is_ok() || (config.device_memory_limit != 0 &&
                       e->device_bytes_needed() > config.device_memory_limit)) {
      continue;
    }
    const std::string change = "offload_param " + std::string(zero::offload_name(c.param)) +
                               " and offload_optimizer " +
                               std::string(zero::offload_name(c.optimizer));
    return (out.empty() ? std::string(kToFit) : out) + "\n  - " + change;
  }
  return out;
}

Result<PlacementChoice> choose_placement(const TrainConfig& config, int ranks,
                                         const MachineRates& rates) {
  const std::vector<Candidate> open = candidates(config);
  // Free space of the swap paths, for NVMe homes.
  const std::uint64_t swap_free = swap_free_bytes(config, 0);
  std::optional<PlacementChoice> best;
  std::string others;
  std::vector<std::string> refusals;  // every placement's, where none fits
  for (const Candidate& cand : open) {
    const std::string n = placement_name(cand.param, cand.optimizer);
    std::string refused = cand.refused;
    std::optional<StepTime> st;
    if (refused.empty()) {
      const TrainConfig c = placed(config, cand);
      auto est = estimate(c, ranks, kVariant);
      if (!est.is_ok()) {
        refused = est.status().message();
      } else if (config.device_memory_limit != 0 &&
                 est->device_bytes_needed() > config.device_memory_limit) {
        refused = "device " + format_bytes(est->device_bytes_needed()) + " > device_memory_limit " +
                  format_bytes(config.device_memory_limit);
      } else if (swap_free != 0 && est->plan.tier_bytes(Tier::kNvme) > swap_free) {
        refused = "nvme " + format_bytes(est->plan.tier_bytes(Tier::kNvme)) + " > " +
                  format_bytes(swap_free) + " free in swap_paths";
      } else {
        st = predict_step(c, *est, rates);
      }
    }
    if (!refused.empty()) {
      others += "; " + n + ": " + refused;
      refusals.push_back(n + ": " + refused);
      continue;
    }
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.3f s", st->step_ms / 1e3);
    if (best && st->step_ms >= best->step.step_ms) {
      others += "; " + n + ": " + buf;
      continue;
    }
    // `why` holds the predicted step's text until the end.
    if (best) others += "; " + placement_name(best->param, best->optimizer) + ": " + best->why;
    best = PlacementChoice{cand.param, cand.optimizer, *st, std::string(buf)};
  }
  if (!best) {
    // Each placement's reason on a line of its own.
    std::string lines;
    for (const std::string& r : refusals) lines += "\n  " + r;
    return out_of_memory("no placement fits the budgets" + (lines.empty() ? "" : ":" + lines) +
                         smallest_changes(config, ranks, open));
  }
  best->why = "offload_param " + std::string(zero::offload_name(best->param)) +
              ", offload_optimizer " + std::string(zero::offload_name(best->optimizer)) +
              ": predicted step " + best->why + ", the fastest that fits" +
              (others.empty() ? "" : " (" + others.substr(2) + ")");
  return *best;
}

}  // namespace strata::train

namespace strata::train {

Result<FractionChoice> choose_offload_fraction(const TrainConfig& config, int ranks,
                                               const MachineRates& rates,
                                               std::uint64_t device_budget_bytes) {
  constexpr int kSteps = 16;
  std::optional<FractionChoice> best;
  std::string refused;  // the smaller fractions the device could not hold
  for (int i = kSteps; i >= 0; --i) {
    TrainConfig c = config;
    c.offload_optimizer_fraction = static_cast<double>(i) / kSteps;
    c.offload_optimizer_fraction_auto = false;
    auto est = estimate(c, ranks, kVariant);
    // All of it offloaded does not plan: that refusal is the config's, whatever the fraction.
    if (!est.is_ok() && i == kSteps) return est.status();
    if (!est.is_ok() ||
        (device_budget_bytes != 0 && est->device_bytes_needed() > device_budget_bytes)) {
      // Less offloaded needs more of the device: no smaller fraction fits either.
      refused = est.is_ok() ? format_bytes(est->device_bytes_needed()) + " on the device > " +
                                  format_bytes(device_budget_bytes)
                            : est.status().message();
      break;
    }
    const StepTime st = predict_step(c, *est, rates);
    // The larger fraction on a tie: the state it leaves on the device costs memory for nothing.
    if (!best || st.step_ms < best->step.step_ms) {
      best = FractionChoice{c.offload_optimizer_fraction, st, "", est->plan.offload_fraction};
    }
  }
  if (!best) {
    return out_of_memory(
        "offload_optimizer_fraction \"auto\": even all of the optimizer state "
        "offloaded does not fit: " +
        refused);
  }
  char buf[320];
  if (best->fraction < 1.0) {
    std::snprintf(buf, sizeof buf,
                  "%.3g of the optimizer state on the %s, the rest stepped on the device: "
                  "predicted step %.3f s (host update %.3f s beside compute %.3f s, device "
                  "update %.3f s)",
                  best->planned, std::string(tier_name(config.offload_optimizer)).c_str(),
                  best->step.step_ms / 1e3, best->step.optimizer_ms / 1e3,
                  best->step.compute_ms / 1e3, best->step.device_optimizer_ms / 1e3);
  } else {
    std::snprintf(buf, sizeof buf,
                  "1, all of the optimizer state on the %s: predicted step %.3f s (host update "
                  "%.3f s, compute %.3f s); none kept on the device would be faster",
                  std::string(tier_name(config.offload_optimizer)).c_str(),
                  best->step.step_ms / 1e3, best->step.optimizer_ms / 1e3,
                  best->step.compute_ms / 1e3);
  }
  best->why = buf;
  if (!refused.empty()) best->why += "; less would not fit (" + refused + ")";
  return *best;
}

}  // namespace strata::train
