// `strata tokenize`: text and JSON-lines files to a token file (and, for supervised data, a loss
// mask beside it), streamed and tokenized on all cores.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "strata/core/status.h"
#include "strata/text/tokenizer.h"

namespace strata::text {

// u16 / u32: raw little-endian arrays; llmc: llm.c's .bin (256 int32 header words, then u16 or
// u32 tokens by the vocabulary's size).
enum class OutputFormat : std::uint8_t { kU16, kU32, kLlmc };

struct TokenizeOptions {
  std::vector<std::string> inputs;  // .txt (one document each) or .jsonl (one per line)
  std::string output;
  std::optional<OutputFormat> format;  // default: u16 if the vocabulary fits, else u32
  std::string field = "text";          // the text field of plain JSON-lines records
  bool eos = true;                     // the EOS id after each document
  int jobs = 0;                        // threads; 0: every core
  // Called from one thread about twice a second, and once at the end.
  std::function<void(std::int64_t documents, std::int64_t tokens, double seconds)> progress;
};

// The loss mask goes beside the output, named by strata::loss_mask_path (core/token_files.h).
struct TokenizeSummary {
  std::int64_t documents = 0;
  std::int64_t supervised_documents = 0;  // prompt/completion and messages records
  std::int64_t tokens = 0;
  std::int64_t trained_tokens = 0;  // tokens the mask marks (all of them without a mask)
  std::int64_t input_bytes = 0;
  // Supervised records whose prompt tokenizes differently alone than followed by its answer;
  // the mask boundary then falls where the two first differ.
  std::int64_t boundary_merges = 0;
  double seconds = 0.0;
  OutputFormat format = OutputFormat::kU16;
  std::string mask_path;      // empty when no record was supervised
  std::string chat_template;  // the built-in template used for messages records, if any
};

// Records in .jsonl files:
//   {"<field>": "..."}                          a document; every token trains
//   {"prompt": "...", "completion": "..."}       trains on the completion (and EOS)
//   {"messages": [{"role": ..., "content": ...}, ...]}
//                                                rendered with the tokenizer's chat template;
//                                                trains on the assistant turns
// Errors name the file and line. The output (and mask) are written under temporary names and
// renamed into place only when every input succeeded; a stale mask from an earlier run is
// removed when this run writes none.
Result<TokenizeSummary> tokenize_files(const Tokenizer& tokenizer, const TokenizeOptions& options);

}  // namespace strata::text
