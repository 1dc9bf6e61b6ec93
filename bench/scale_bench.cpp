// The jobs Strata exists for at the user's scale, one case a run (tools/gpu-check.sh --phase
// scale runs each in its own process under its own timeout): Llama-3-8B's shape with LoRA and
// QLoRA r 16 on every projection, a full fine-tune with int8 moments and bf16 master weights on
// the host at one micro-batch a step (offload_optimizer_fraction "auto" and 1), slices of
// Llama-3.1-70B (QLoRA, a 24 GiB device) and Qwen3-30B-A3B (QLoRA) timed at two depths and
// extrapolated to the whole model (a slice's device budget keeps the share of its frozen base on
// the device that the whole model's budget keeps of the whole base, so that a slice's layer
// fetches what one of the whole model's would), and the 1.1B cases of the first GPU run. Weights
// are seeded
// (the shapes come from examples/models/*/config.json), the data random tokens.
//
// Each case prints one line and appends one JSON object to --out: tokens/s, the step and its
// parts (the mean over the timed steps: the first warms up, the last waits for its own update),
// the peak device memory against the plan, and MFU: the model's FLOPs a token (2 x the active
// parameters forward, 2 x again for the input gradients, 2 x the active trained ones for the
// weight gradients; attention's own and recomputation's not counted) x tokens/s, against the
// GPU's specified dense bf16 peak (train_run_common.h; STRATA_GPU_SPEC_TFLOPS overrides it).
//
// --shrink runs every case at a toy shape on the CPU backend (hidden 64, two layers and one,
// 8 experts): CI rehearses the cases so, so that GPU time goes to measuring.
//
// Usage: bench_scale --list | CASE [--shrink] [--steps N] [--out FILE] [--models DIR]
//                                  [--device-limit BYTES]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/train_run_common.h"
#include "strata/core/json.h"
#include "strata/train/config.h"
#include "strata/train/estimate.h"
#include "strata/train/step_time.h"
#include "strata/train/trainer.h"

namespace {

using strata::Json;

struct Case {
  const char* name;
  const char* model;  // examples/models/<model>/config.json
  const char* what;
  const char* method = "full";  // finetune.method
  const char* offload_param = "none";
  const char* offload_optimizer = "none";
  const char* fraction = "";  // offload_optimizer_fraction ("auto", "1"); "": the default
  const char* state_dtype = "fp32";
  const char* master_dtype = "fp32";
  std::int64_t micro = 1, accum = 1, seq = 2048;
  double device_gib = 0;  // device_memory_limit; 0: 90% of the device's memory
  // A slice: the model cut to these two depths, each timed, the layers' time extrapolated to
  // the whole model's depth (0: the whole model).
  int slice_lo = 0, slice_hi = 0;
  double target_mfu = 0;  // 0: none set
};

constexpr Case kCases[] = {
    {"8b-lora", "Llama-3.1-8B-Instruct", "Llama-3-8B, LoRA r 16 on every projection, bf16 base",
     "lora", "none", "cpu", "", "fp32", "fp32", 2},
    {"8b-qlora", "Llama-3.1-8B-Instruct", "Llama-3-8B, QLoRA r 16 on every projection", "qlora",
     "none", "cpu", "", "fp32", "fp32", 2},
    {"8b-full-auto", "Llama-3.1-8B-Instruct",
     "Llama-3-8B full, optimizer on the host (int8 moments, bf16 master), fraction auto", "full",
     "none", "cpu", "auto", "int8", "bf16", 2},
    {"8b-full-host", "Llama-3.1-8B-Instruct",
     "Llama-3-8B full, optimizer on the host (int8 moments, bf16 master), fraction 1", "full",
     "none", "cpu", "1", "int8", "bf16", 2},
    {"70b-qlora-24g", "Llama-3.1-70B-Instruct",
     "Llama-3.1-70B slice, QLoRA r 16, 24 GiB device, base on the host", "qlora", "cpu", "cpu", "",
     "fp32", "fp32", 1, 1, 2048, 24, 2, 4},
    {"30b-a3b-qlora", "Qwen3-30B-A3B", "Qwen3-30B-A3B slice, QLoRA r 16, base on the host", "qlora",
     "cpu", "cpu", "", "fp32", "fp32", 1, 1, 2048, 0, 2, 4},
    {"1.1b-host-accum1-auto", "", "1.1B, optimizer on the host, accumulation 1, fraction auto",
     "full", "none", "cpu", "auto", "fp32", "fp32", 8, 1, 2048, 0, 0, 0, 0.40},
    {"1.1b-host-accum1", "", "1.1B, optimizer on the host, accumulation 1, fraction 1", "full",
     "none", "cpu", "1", "fp32", "fp32", 8, 1},
    {"1.1b-host-accum2", "", "1.1B, optimizer on the host, accumulation 2", "full", "none", "cpu",
     "", "fp32", "fp32", 8, 2, 2048, 0, 0, 0, 0.40},
};

// Published single-GPU fine-tuning throughput to set the 8B cases beside: torchtune's
// Llama-3.1-8B on one RTX 4090 (bf16 peak 165.2 TFLOP/s, train_run_common.h). A case's report
// scales it by this GPU's specified bf16 peak over the 4090's, as a compute-bound job would
// scale; the parts of a step that memory or PCIe bound scale less (an H100's HBM is 3.3 times
// a 4090's memory bandwidth, its peak 6 times), so the scaled figure is the higher bar.
struct Published {
  const char* case_prefix;  // the cases it applies to
  double tokens_per_s;
  const char* what;
};
constexpr Published kPublished[] = {
    {"8b-lora", 3083, "torchtune LoRA"},
    {"8b-qlora", 2413, "torchtune QLoRA"},
    {"8b-full", 1650, "torchtune full, 8-bit optimizer"},
};
constexpr double kPublishedPeakTflops = 165.2;  // RTX 4090, dense bf16

struct Options {
  bool shrink = false;
  int steps = 3;  // timed
  std::string out, models = "examples/models";
  std::uint64_t device_limit = 0;  // the GPU's device_memory_limit where a case sets none
};

// The model's config: its config.json, or TinyLlama's shape for the 1.1B cases.
Json model_of(const Case& c, const Options& o, int layers) {
  Json m;
  if (*c.model == '\0') {
    m = {{"model_type", "llama"},    {"vocab_size", 32000},
         {"hidden_size", 2048},      {"intermediate_size", 5632},
         {"num_hidden_layers", 22},  {"num_attention_heads", 32},
         {"num_key_value_heads", 4}, {"max_position_embeddings", 2048}};
  } else {
    const std::string path = o.models + "/" + c.model + "/config.json";
    std::ifstream f(path);
    if (!f) throw std::runtime_error("cannot read " + path);
    m = Json::parse(f, nullptr, true, /*ignore_comments=*/true);
  }
  if (layers > 0) m["num_hidden_layers"] = layers;
  if (o.shrink) {
    m["vocab_size"] = 512;
    m["hidden_size"] = 64;
    m["intermediate_size"] = 128;
    m["num_attention_heads"] = 4;
    m["num_key_value_heads"] = 2;
    if (m.contains("head_dim")) m["head_dim"] = 16;
    if (m.contains("num_experts")) {
      m["num_experts"] = 8;
      m["num_experts_per_tok"] = 2;
      m["moe_intermediate_size"] = 32;
    }
    if (layers == 0) m["num_hidden_layers"] = 2;
  }
  return m;
}

struct Measured {
  double tokens_per_s = 0, step_ms = 0, compute_ms = 0, optimizer_ms = 0, exposed_ms = 0;
  double device_ms = 0, flops_per_token = 0;
  std::uint64_t peak_device = 0, planned_device = 0;
  double fraction = 1;
  std::string device;
  double resident_share = 1;  // of the frozen base, on the device between passes (a slice: the
                              // whole model's, which its budget keeps)
  std::uint64_t device_limit = 0;
};

strata::train::TrainConfig parsed(const Json& j, const Case& c) {
  auto config = strata::train::parse_train_config(j, std::string("case ") + c.name);
  if (!config.is_ok()) throw std::runtime_error(config.status().message());
  return *config;
}

strata::train::Estimate planned_of(const strata::train::TrainConfig& config) {
  auto e = strata::train::estimate(config, 1);
  if (!e.is_ok()) throw std::runtime_error(e.status().message());
  return *e;
}

Measured run(const Case& c, const Options& o, int layers) {
  const std::int64_t seq = o.shrink ? 64 : c.seq;
  const std::string dir = (std::filesystem::temp_directory_path() / "strata-bench-scale").string();
  Json model = model_of(c, o, layers);
  Json j = {
      {"model", model},
      {"data", {{"path", strata::bench::token_file(dir, model["vocab_size"].get<std::int64_t>())}}},
      {"seq_len", seq},
      {"micro_batch_size", c.micro},
      {"batch_size", c.micro * c.accum},
      {"max_steps", 1000000},
      {"precision", "bf16"},
      {"optimizer",
       {{"lr", 1e-4}, {"state_dtype", c.state_dtype}, {"master_dtype", c.master_dtype}}},
      // As users run the large models; the 1.1B cases as the first GPU run ran them.
      {"activation_checkpointing", *c.model != '\0'},
      {"offload_param", c.offload_param},
      {"offload_optimizer", c.offload_optimizer},
      {"device", o.shrink ? "cpu" : "cuda"},
      {"save_dir", ""}};
  if (std::string(c.method) != "full") {
    j["finetune"] = {
        {"method", c.method}, {"r", 16}, {"lora_alpha", 32}, {"target_modules", "all-linear"}};
  }
  if (std::string(c.offload_param) != "none") j["zero_stage"] = 3;
  if (*c.fraction != '\0') {
    j["offload_optimizer_fraction"] =
        std::string(c.fraction) == "auto" ? Json("auto") : Json(std::atof(c.fraction));
  }
  if (!o.shrink) {
    if (c.device_gib == 0 && o.device_limit == 0) {
      throw std::runtime_error(
          "a GPU needs --device-limit BYTES (tools/gpu-check.sh gives 90% "
          "of its free memory)");
    }
    j["device_memory_limit"] =
        c.device_gib > 0 ? static_cast<std::uint64_t>(c.device_gib * (1ull << 30)) : o.device_limit;
  }
  // The whole model, for a slice's budget.
  const auto whole_model = [&] {
    Json whole = j;
    whole["model"] = model_of(c, o, 0);
    return parsed(whole, c);
  };
  if (o.shrink && c.device_gib > 0) {
    // Rehearsed, a case's device budget is one that keeps half of the whole (shrunk) model's
    // base on the device, as the 70B's 24 GiB keeps part of its base.
    const strata::train::TrainConfig w = whole_model();
    const strata::train::Estimate e = planned_of(w);
    const strata::train::FrozenResidency base = strata::train::frozen_residency(w, e);
    j["device_memory_limit"] = e.device_bytes_needed() + w.prefetch_bytes +
                               static_cast<std::uint64_t>(base.frozen_bytes / 2);
  }
  strata::train::TrainConfig config = parsed(j, c);
  strata::train::Estimate planned = planned_of(config);
  const strata::train::FrozenResidency base = strata::train::frozen_residency(config, planned);
  Measured m;
  m.resident_share = base.resident_share();
  if (c.slice_hi > 0 && config.device_memory_limit > 0) {
    // The whole model's share of its base on the device, at the case's budget; the slice's
    // budget then keeps that share of its own base.
    const strata::train::TrainConfig w = whole_model();
    m.resident_share = strata::train::frozen_residency(w, planned_of(w)).resident_share();
    if (m.resident_share < 1 && base.frozen_bytes > 0) {
      config.device_memory_limit = config.device_memory_limit -
                                   static_cast<std::uint64_t>(base.room_bytes) +
                                   static_cast<std::uint64_t>(m.resident_share * base.frozen_bytes);
      planned = planned_of(config);
    }
  }
  m.device_limit = config.device_memory_limit;
  const double active = static_cast<double>(planned.active_parameters());
  const double trained =
      static_cast<double>(planned.trainable_parameters - planned.inactive_trainable);
  auto trainer = strata::train::Trainer::create(config, {});
  if (!trainer.is_ok()) throw std::runtime_error(trainer.status().message());
  strata::train::Trainer& t = **trainer;
  const std::int64_t total = 1 + o.steps + 1;
  if (const strata::Status s = t.run_steps(total); !s.is_ok()) {
    throw std::runtime_error(s.message());
  }
  m.flops_per_token = 4 * active + 2 * trained;
  m.fraction = t.resolved_config().offload_optimizer_fraction;
  m.device = t.device_name();
  const auto& h = t.history();
  for (std::int64_t i = 1; i <= o.steps; ++i) {
    const auto& s = h.at(static_cast<std::size_t>(i));
    if (!std::isfinite(s.loss) || s.skipped) {
      throw std::runtime_error("step " + std::to_string(s.step) + " gave loss " +
                               std::to_string(s.loss));
    }
    m.step_ms += s.step_ms / o.steps;
    m.compute_ms += s.compute_ms / o.steps;
    m.optimizer_ms += s.optimizer_ms / o.steps;
    m.exposed_ms += s.optimizer_exposed_ms / o.steps;
    m.device_ms += s.optimizer_device_ms / o.steps;
    m.peak_device = std::max(m.peak_device, s.peak_device_bytes);
    m.planned_device = s.planned_device_bytes;
  }
  m.tokens_per_s = static_cast<double>(c.micro * c.accum * seq) / (m.step_ms / 1e3);
  return m;
}

int run_case(const Case& c, const Options& o) {
  Json out = {{"case", c.name}, {"what", c.what}, {"shrunk", o.shrink}};
  try {
    Measured m;
    double layer_ms = 0;
    int depth = 0;
    if (c.slice_hi > 0) {
      const int lo = o.shrink ? 1 : c.slice_lo, hi = o.shrink ? 2 : c.slice_hi;
      const Measured a = run(c, o, lo);
      m = run(c, o, hi);
      layer_ms = (m.step_ms - a.step_ms) / (hi - lo);
      depth = model_of(c, o, 0)["num_hidden_layers"].get<int>();
      if (o.shrink) depth = 2;
      out["slice_layers"] = {lo, hi};
      out["slice_step_ms"] = {a.step_ms, m.step_ms};
      out["layer_ms"] = layer_ms;
      out["model_layers"] = depth;
      out["extrapolated_step_ms"] = m.step_ms + layer_ms * (depth - hi);
    } else {
      m = run(c, o, 0);
    }
    const double peak = strata::bench::spec_bf16_tflops(m.device);
    const double model_tflops = m.flops_per_token * m.tokens_per_s / 1e12;
    const double ratio = m.planned_device > 0 ? static_cast<double>(m.peak_device) /
                                                    static_cast<double>(m.planned_device)
                                              : 0;
    out.update({{"device", m.device},
                {"tokens_per_s", m.tokens_per_s},
                {"step_ms", m.step_ms},
                {"compute_ms", m.compute_ms},
                {"optimizer_ms", m.optimizer_ms},
                {"optimizer_exposed_ms", m.exposed_ms},
                {"optimizer_device_ms", m.device_ms},
                {"offload_optimizer_fraction", m.fraction},
                {"model_tflops", model_tflops},
                {"spec_tflops", peak},
                {"mfu", peak > 0 ? model_tflops / peak : 0.0},
                {"target_mfu", c.target_mfu},
                {"peak_device_bytes", m.peak_device},
                {"planned_device_bytes", m.planned_device},
                {"peak_over_plan", ratio},
                {"device_memory_limit", m.device_limit},
                {"frozen_resident_share", m.resident_share}});
    std::printf(
        "scale %s: %.0f tok/s, MFU %.3f (%.0f TFLOP/s of %.0f), step %.0f ms (compute %.0f, "
        "optimizer %.0f, exposed %.0f, on the device %.0f; fraction %.3g), peak device %s / "
        "planned %s (%.2f)",
        c.name, m.tokens_per_s, peak > 0 ? model_tflops / peak : 0.0, model_tflops, peak, m.step_ms,
        m.compute_ms, m.optimizer_ms, m.exposed_ms, m.device_ms, m.fraction,
        strata::format_bytes(m.peak_device).c_str(), strata::format_bytes(m.planned_device).c_str(),
        ratio);
    if (depth > 0) {
      std::printf("; %.0f ms a layer, %d layers: %.2f s a step", layer_ms, depth,
                  out["extrapolated_step_ms"].get<double>() / 1e3);
    }
    for (const Published& p : kPublished) {
      if (std::strncmp(c.name, p.case_prefix, std::strlen(p.case_prefix)) != 0) continue;
      const double scaled = peak > 0 ? p.tokens_per_s * peak / kPublishedPeakTflops : 0;
      out["published"] = {{"what", p.what},
                          {"gpu", "RTX 4090"},
                          {"tokens_per_s", p.tokens_per_s},
                          {"scale", peak / kPublishedPeakTflops},
                          {"scaled_tokens_per_s", scaled},
                          {"ratio", scaled > 0 ? m.tokens_per_s / scaled : 0.0}};
      std::printf(
          "; %s on one RTX 4090: %.0f tok/s, x %.2f by bf16 peak: %.0f (this run %.2f of it)",
          p.what, p.tokens_per_s, peak / kPublishedPeakTflops, scaled,
          scaled > 0 ? m.tokens_per_s / scaled : 0.0);
    }
    std::printf("\n");
  } catch (const std::exception& e) {
    out["error"] = e.what();
    std::printf("scale %s: FAILED: %s\n", c.name, e.what());
  }
  std::fflush(stdout);
  if (!o.out.empty()) std::ofstream(o.out, std::ios::app) << out.dump() << "\n";
  return out.contains("error") ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  std::optional<std::string> name;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_scale: %s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--list") {
      for (const Case& c : kCases) std::printf("%s\t%s\n", c.name, c.what);
      return 0;
    } else if (a == "--shrink") {
      o.shrink = true;
    } else if (a == "--steps") {
      o.steps = std::max(1, std::atoi(value().c_str()));
    } else if (a == "--out") {
      o.out = value();
    } else if (a == "--models") {
      o.models = value();
    } else if (a == "--device-limit") {
      o.device_limit = std::strtoull(value().c_str(), nullptr, 10);
    } else if (!a.starts_with("-") && !name) {
      name = a;
    } else {
      std::fprintf(stderr,
                   "bench_scale: unknown argument '%s'\nusage: bench_scale --list | CASE "
                   "[--shrink] [--steps N] [--out FILE] [--models DIR] [--device-limit BYTES]\n",
                   a.c_str());
      return 2;
    }
  }
  if (!name) {
    std::fprintf(stderr, "bench_scale: name a case (--list shows them)\n");
    return 2;
  }
  for (const Case& c : kCases) {
    if (*name == c.name) return run_case(c, o);
  }
  std::fprintf(stderr, "bench_scale: no case '%s' (--list shows them)\n", name->c_str());
  return 2;
}
