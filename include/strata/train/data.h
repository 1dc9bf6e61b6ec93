// Token data: files of token ids and a deterministic sampler of fixed-length sequences.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/status.h"

namespace strata::train {

// Token file formats: u16 / u32 raw little-endian arrays; llmc (llm.c .bin: 256 int32 header,
// magic 20240520, version 1 = uint16 tokens, version 2 = uint32, header[2] = token count); text
// (bytes of a text file, vocabulary 256); auto: by the file's name and its first bytes
// (resolve_token_format).
enum class TokenFormat : std::uint8_t { kU16, kU32, kLlmc, kText, kAuto };
inline constexpr std::array<TokenFormat, 5> kTokenFormats = {TokenFormat::kU16, TokenFormat::kU32,
                                                             TokenFormat::kLlmc, TokenFormat::kText,
                                                             TokenFormat::kAuto};
std::string_view token_format_name(TokenFormat format);  // "u16", "u32", "llmc", "text", "auto"

// `format`, or for kAuto the format of the file at `path`: its extension, .u16 and .u32 (what
// strata tokenize writes), .txt, .text and .md (text); else llm.c's header magic makes it llmc.
// A file it cannot tell (a raw .bin, no extension) is refused, naming it and asking for the
// format; `key` names the config key in that message.
Result<TokenFormat> resolve_token_format(const std::string& path, TokenFormat format,
                                         const std::string& key);

class TokenDataset {
 public:
  // Memory-maps the file (`format` resolved as resolve_token_format says, `key` the config key
  // that named it). Errors name the file: missing, empty, size not a multiple of the token size,
  // bad llm.c header, fewer than seq_len + 1 tokens, a format auto cannot tell.
  static Result<std::shared_ptr<TokenDataset>> open(const std::string& path, TokenFormat format,
                                                    const std::string& key = "data");
  ~TokenDataset();
  TokenDataset(const TokenDataset&) = delete;  // owns the mapping
  TokenDataset& operator=(const TokenDataset&) = delete;

  std::int64_t num_tokens() const { return num_tokens_; }
  std::uint32_t token(std::int64_t i) const;
  const std::string& path() const { return path_; }
  TokenFormat format() const { return format_; }  // as resolved

 private:
  TokenDataset() = default;
  std::string path_;
  TokenFormat format_ = TokenFormat::kText;
  int token_bytes_ = 0;
  const std::uint8_t* tokens_ = nullptr;
  std::int64_t num_tokens_ = 0;
  void* map_ = nullptr;
  std::size_t map_bytes_ = 0;
};

// Splits the dataset into non-overlapping windows of seq_len + 1 tokens (stride seq_len) and
// visits them in a per-epoch shuffled order determined by the seed alone. Sequence number g of the
// whole run is therefore a pure function of (seed, g): a global batch is sequences
// [step * batch_size, (step + 1) * batch_size), whatever the rank count or micro-batch size.
class SequenceSampler {
 public:
  SequenceSampler(std::shared_ptr<TokenDataset> dataset, std::int64_t seq_len, std::uint64_t seed);
  // Whether `dataset` yields at least one sequence of seq_len + 1 tokens (and at most 2^32 - 1):
  // an invalid_argument naming the file and the sizes otherwise. sequence() fails the same way,
  // so call this once up front to report the problem before training starts.
  static Status check(const TokenDataset& dataset, std::int64_t seq_len);

  std::int64_t num_windows() const { return num_windows_; }
  // Writes sequence g's inputs (tokens [0, seq_len)) and targets (tokens [1, seq_len]) as int32.
  // A token id >= vocab_size is an error naming the file and the token's position. With a loss
  // mask, targets the mask leaves out are -1 (the model ignores them).
  Status sequence(std::int64_t g, std::int64_t vocab_size, std::int32_t* inputs,
                  std::int32_t* targets);

  // A loss mask (strata tokenize's "<tokens>.mask": one byte per token, 1 where the loss counts
  // predicting the token). Its length must equal the dataset's; errors name both files.
  Status set_mask(std::shared_ptr<TokenDataset> mask);
  bool has_mask() const { return mask_ != nullptr; }
  // How many of sequence g's targets count in the loss (seq_len without a mask). A mask byte
  // other than 0 or 1 is an error naming the file and position.
  Result<std::int64_t> count_targets(std::int64_t g);

 private:
  const std::vector<std::uint32_t>& epoch_order(std::int64_t epoch);
  std::int64_t window_start(std::int64_t g);  // the first token of sequence g
  std::shared_ptr<TokenDataset> dataset_;
  std::shared_ptr<TokenDataset> mask_;
  std::int64_t seq_len_;
  std::uint64_t seed_;
  std::int64_t num_windows_;
  std::int64_t cached_epoch_ = -1;
  std::vector<std::uint32_t> order_;
};

// strata tokenize's loss mask beside the token file at `token_path` (core/token_files.h), if
// there is one, onto `sampler`: the loss then counts only the targets it marks (completions,
// assistant turns). Text has none.
Status attach_loss_mask(const std::string& token_path, TokenFormat format,
                        SequenceSampler* sampler);

}  // namespace strata::train
