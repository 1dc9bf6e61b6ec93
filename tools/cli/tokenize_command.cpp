// `strata tokenize`: text and JSON-lines files to token files, with Hugging Face's ids.
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "strata/text/tokenize_job.h"
#include "strata/text/tokenizer.h"
#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

struct TokenizeArgs {
  std::string tokenizer;
  std::vector<std::string> inputs;
  std::string output;
  std::string format;
  std::string field = "text";
  bool no_eos = false;
  int jobs = 0;
};

std::string with_commas(std::int64_t n) {
  std::string s = std::to_string(n);
  for (int i = static_cast<int>(s.size()) - 3; i > 0; i -= 3)
    s.insert(static_cast<std::size_t>(i), ",");
  return s;
}

std::string rate(double per_s) {
  char buf[32];
  if (per_s >= 1e6) {
    std::snprintf(buf, sizeof(buf), "%.2fM", per_s / 1e6);
  } else if (per_s >= 1e3) {
    std::snprintf(buf, sizeof(buf), "%.1fk", per_s / 1e3);
  } else {
    std::snprintf(buf, sizeof(buf), "%.0f", per_s);
  }
  return buf;
}

const char* format_name(text::OutputFormat f) {
  switch (f) {
    case text::OutputFormat::kU16:
      return "u16";
    case text::OutputFormat::kU32:
      return "u32";
    case text::OutputFormat::kLlmc:
      return "llmc";
  }
  return "?";
}

int run_tokenize(const TokenizeArgs& a) {
  auto tok = text::Tokenizer::load(a.tokenizer);
  if (!tok) {
    std::fprintf(stderr, "strata tokenize: %s\n", tok.status().message().c_str());
    return tok.status().code() == StatusCode::kNotFound ? kExitError : kExitUsage;
  }
  std::fprintf(stderr, "strata tokenize: %s from %s\n", tok.value()->description().c_str(),
               tok.value()->path().c_str());
  text::TokenizeOptions options;
  options.inputs = a.inputs;
  options.output = a.output;
  options.field = a.field;
  options.eos = !a.no_eos;
  options.jobs = a.jobs;
  if (a.format == "u16") options.format = text::OutputFormat::kU16;
  if (a.format == "u32") options.format = text::OutputFormat::kU32;
  if (a.format == "llmc") options.format = text::OutputFormat::kLlmc;
  const bool tty = ::isatty(2) != 0;
  if (tty) {
    options.progress = [](std::int64_t docs, std::int64_t tokens, double seconds) {
      std::fprintf(stderr, "\r  %s documents, %s tokens, %s tokens/s   ", with_commas(docs).c_str(),
                   with_commas(tokens).c_str(), rate(seconds > 0 ? tokens / seconds : 0).c_str());
    };
  }
  if (options.eos && !tok.value()->eos_id()) {
    std::fprintf(stderr,
                 "strata tokenize: the tokenizer defines no EOS token; documents are "
                 "written back to back without one\n");
  }
  auto summary = text::tokenize_files(*tok.value(), options);
  if (tty) std::fprintf(stderr, "\n");
  if (!summary) {
    std::fprintf(stderr, "strata tokenize: %s\n", summary.status().message().c_str());
    return summary.status().code() == StatusCode::kInvalidArgument ? kExitUsage : kExitError;
  }
  const auto& s = summary.value();
  std::printf(
      "tokenized %s documents (%s bytes) into %s tokens in %.2f s (%s tokens/s, %d "
      "threads)\n",
      with_commas(s.documents).c_str(), with_commas(s.input_bytes).c_str(),
      with_commas(s.tokens).c_str(), s.seconds,
      rate(s.seconds > 0 ? s.tokens / s.seconds : 0).c_str(),
      a.jobs > 0 ? a.jobs : static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)));
  std::printf("wrote %s (%s)\n", a.output.c_str(), format_name(s.format));
  if (!s.mask_path.empty()) {
    std::printf(
        "wrote %s: %s of %s documents supervised, the loss counts %s of %s tokens%s\n",
        s.mask_path.c_str(), with_commas(s.supervised_documents).c_str(),
        with_commas(s.documents).c_str(), with_commas(s.trained_tokens).c_str(),
        with_commas(s.tokens).c_str(),
        s.chat_template.empty() ? "" : (" (chat template " + s.chat_template + ")").c_str());
    if (s.boundary_merges > 0) {
      std::printf(
          "note: in %s records the prompt's last token merged with the answer's first; "
          "the mask starts at the merged token\n",
          with_commas(s.boundary_merges).c_str());
    }
  }
  return kExitOk;
}

}  // namespace

Runner add_tokenize_command(CLI::App& app) {
  auto args = std::make_shared<TokenizeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "tokenize",
      "Tokenize .txt / .jsonl files into a token file for training, with Hugging Face's ids");
  cmd->add_option("--tokenizer", args->tokenizer,
                  "tokenizer.json, a SentencePiece tokenizer.model, or a Hugging Face model "
                  "directory (tokenizer.json or tokenizer.model, with tokenizer_config.json)")
      ->required();
  cmd->add_option("--input", args->inputs,
                  ".txt (a whole file is one document) or .jsonl (one record per line: "
                  "{\"text\"}, {\"prompt\", \"completion\"} or {\"messages\"}); repeatable")
      ->required();
  cmd->add_option("--output", args->output,
                  "token file to write; supervised data also writes OUTPUT.mask")
      ->required();
  cmd->add_option("--format", args->format,
                  "u16 (default when the vocabulary fits), u32, or llmc (llm.c .bin)")
      ->check(CLI::IsMember({"u16", "u32", "llmc"}));
  cmd->add_option("--field", args->field, "the text field of plain .jsonl records")
      ->capture_default_str();
  cmd->add_flag("--no-eos", args->no_eos, "do not append the EOS token after each document");
  cmd->add_option("--jobs", args->jobs, "threads (default: every core)")
      ->check(CLI::Range(1, 1024));
  return [args] { return run_tokenize(*args); };
}

}  // namespace strata::cli
