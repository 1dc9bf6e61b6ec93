// `strata generate`: what a checkpoint says, streamed as it decodes.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "strata/core/json.h"
#include "strata/text/tokenizer.h"
#include "strata/train/generate.h"
#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

struct GenerateArgs {
  std::string model, adapter, tokenizer, prompt, prompt_file, prompt_ids;
  std::int64_t max_new_tokens = 128;
  double temperature = 0.0, top_p = 1.0;
  std::int64_t top_k = 0;
  std::uint64_t seed = 0;
  std::string device = "cpu", device_memory_limit, dtype = "fp32";
  int threads = 0;
};

int fail(const Status& s) {
  std::fprintf(stderr, "strata generate: %s\n", s.message().c_str());
  return s.code() == StatusCode::kInvalidArgument ? kExitUsage : kExitError;
}

int run_generate(const GenerateArgs& a) {
  const int prompts = !a.prompt.empty() + !a.prompt_file.empty() + !a.prompt_ids.empty();
  if (prompts != 1) {
    return fail(invalid_argument("give exactly one of --prompt, --prompt-file, --prompt-ids"));
  }
  train::GenerateOptions options;
  options.model_dir = a.model;
  options.adapter_dir = a.adapter;
  options.max_new_tokens = a.max_new_tokens;
  options.temperature = a.temperature;
  options.top_k = a.top_k;
  options.top_p = a.top_p;
  options.seed = a.seed;
  options.threads = a.threads;
  options.dtype = a.dtype == "bf16" ? DType::kBF16 : DType::kF32;
  options.device = a.device == "cuda" ? device::DeviceKind::kCuda : device::DeviceKind::kCpu;
  if (!a.device_memory_limit.empty()) {
    auto bytes = parse_bytes(a.device_memory_limit);
    if (!bytes) {
      return fail(invalid_argument("--device-memory-limit '" + a.device_memory_limit +
                                   "' is not a byte size (e.g. 8GiB)"));
    }
    options.device_memory_limit = *bytes;
  }

  auto gen = train::Generator::open(options);
  if (!gen) return fail(gen.status());
  // Under mpirun every rank decodes the same tokens; rank 0 alone prints them.
  const bool reports = gen.value()->rank() == 0;

  // The tokenizer: --tokenizer, else the model directory's own (a training checkpoint carries
  // the one it was trained with), else, for a 256-token vocabulary, raw bytes (a model trained
  // on data.format "text"). Only --prompt-ids works without any.
  std::unique_ptr<text::Tokenizer> tok;
  bool bytes = false;
  const std::string tok_path = a.tokenizer.empty() ? a.model : a.tokenizer;
  auto loaded = text::Tokenizer::load(tok_path);
  if (loaded) {
    tok = std::move(loaded).value();
  } else if (a.tokenizer.empty() && gen.value()->config().vocab_size == 256) {
    bytes = true;
    if (reports)
      std::fprintf(stderr,
                   "strata generate: no tokenizer in %s; its 256-token vocabulary is read "
                   "as raw bytes, as data.format \"text\" trains it\n",
                   a.model.c_str());
  } else if (!a.tokenizer.empty() || a.prompt_ids.empty()) {
    return fail(loaded.status().with_context(
        a.tokenizer.empty() ? "no tokenizer in the model directory (pass --tokenizer, or "
                              "--prompt-ids)"
                            : "--tokenizer"));
  }

  std::vector<std::int32_t> prompt;
  if (!a.prompt_ids.empty()) {
    std::stringstream ss(a.prompt_ids);
    std::string item;
    while (std::getline(ss, item, ',')) {
      try {
        std::size_t used = 0;
        const long long v = std::stoll(item, &used);
        if (used != item.size() || v < 0 || v > 0x7fffffff) throw std::invalid_argument(item);
        prompt.push_back(static_cast<std::int32_t>(v));
      } catch (const std::exception&) {
        return fail(invalid_argument("--prompt-ids: '" + item +
                                     "' is not a token id (expected e.g. 1,2,3)"));
      }
    }
  } else {
    std::string text = a.prompt;
    if (!a.prompt_file.empty()) {
      std::ifstream in(a.prompt_file, std::ios::binary);
      if (!in) return fail(not_found("--prompt-file " + a.prompt_file + ": cannot open"));
      text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    if (bytes) {
      for (const unsigned char c : text) prompt.push_back(c);
    } else {
      prompt = tok->encode(text, true);
    }
  }

  if (reports) std::fprintf(stderr, "%s\n", gen.value()->describe().c_str());
  std::vector<std::int32_t> stops = gen.value()->eos_ids();
  if (tok && tok->eos_id()) stops.push_back(*tok->eos_id());

  // Streams text as it comes: the decoded continuation is printed up to what is complete (a
  // character split over byte tokens waits for its last byte).
  std::vector<std::int32_t> generated;
  std::string printed;
  auto on_token = [&](std::int32_t id) {
    generated.push_back(id);
    if (!reports) return true;
    if (bytes) {
      std::fputc(static_cast<unsigned char>(id), stdout);
      std::fflush(stdout);
      return true;
    }
    if (!tok) {
      std::printf("%s%d", generated.size() > 1 ? "," : "", id);
      std::fflush(stdout);
      return true;
    }
    auto text = tok->decode(generated, true);
    if (!text) return true;
    const std::string& t = text.value();
    if (t.size() >= 3 && t.compare(t.size() - 3, 3, "\xEF\xBF\xBD") == 0) return true;
    if (t.compare(0, printed.size(), printed) == 0) {
      std::fputs(t.c_str() + printed.size(), stdout);
    } else {
      std::fputs(("\n" + t).c_str(), stdout);  // a decoder rewrote earlier text
    }
    std::fflush(stdout);
    printed = t;
    return true;
  };
  if (reports && (tok || bytes) && a.prompt_ids.empty()) {
    std::fputs(a.prompt_file.empty() ? a.prompt.c_str() : "", stdout);
  }
  Status s = gen.value()->generate(prompt, stops, on_token);
  if (reports) std::printf("\n");
  if (!s) return fail(s);
  if (!reports) return kExitOk;
  const auto& st = gen.value()->stats();
  std::fprintf(
      stderr, "prompt: %lld tokens in %.0f ms | generated %lld tokens in %.2f s (%.1f tokens/s)\n",
      static_cast<long long>(st.prompt_tokens), st.prefill_ms,
      static_cast<long long>(st.generated_tokens), st.decode_ms / 1e3,
      st.decode_ms > 0 ? static_cast<double>(st.generated_tokens) / (st.decode_ms / 1e3) : 0.0);
  return kExitOk;
}

}  // namespace

Runner add_generate_command(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate text from a checkpoint, streamed");
  cmd->add_option("--model", a->model,
                  "Hugging Face checkpoint directory (a training run's step-*/model included)")
      ->required();
  cmd->add_option("--adapter", a->adapter,
                  "a PEFT LoRA adapter directory (a LoRA run's checkpoint) applied unmerged");
  cmd->add_option("--tokenizer", a->tokenizer,
                  "tokenizer.json, tokenizer.model or a model directory (default: --model's)");
  cmd->add_option("--prompt", a->prompt, "prompt text");
  cmd->add_option("--prompt-file", a->prompt_file, "file holding the prompt text");
  cmd->add_option("--prompt-ids", a->prompt_ids, "prompt as token ids: 1,2,3");
  cmd->add_option("--max-new-tokens", a->max_new_tokens, "tokens to generate at most")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  cmd->add_option("--temperature", a->temperature, "0 = greedy")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 100.0));
  cmd->add_option("--top-k", a->top_k, "sample among the k most likely tokens (0 = all)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30));
  cmd->add_option("--top-p", a->top_p, "nucleus sampling: the smallest set reaching p")
      ->capture_default_str()
      ->check(CLI::Range(1e-9, 1.0));
  cmd->add_option("--seed", a->seed, "seed of the sampling")->capture_default_str();
  cmd->add_option("--device", a->device, "cpu or cuda")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--device-memory-limit", a->device_memory_limit,
                  "device budget (required on cuda); layers that do not fit are fetched from "
                  "host memory as they are needed");
  cmd->add_option("--dtype", a->dtype, "fp32 or bf16")
      ->capture_default_str()
      ->check(CLI::IsMember({"fp32", "bf16"}));
  cmd->add_option("--threads", a->threads, "CPU backend threads (0 = every core)");
  return [a] { return run_generate(*a); };
}

}  // namespace strata::cli
