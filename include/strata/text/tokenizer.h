// Tokenizers: text to token ids and back, exactly as Hugging Face computes them.
//
// Three sources, chosen by Tokenizer::load from the path:
//   tokenizer.json   Hugging Face's tokenizers format (BPE and Unigram models, their
//                    normalizers, pre-tokenizers, post-processors and decoders), implemented
//                    here on PCRE2 and utf8proc. A component this implementation lacks is an
//                    error that names it, never an approximation.
//   tokenizer.model  a SentencePiece model, through libsentencepiece.
//   a directory      a Hugging Face model directory: its tokenizer.json (preferred) or
//                    tokenizer.model, with tokenizer_config.json for the BOS/EOS tokens and
//                    add_bos_token / add_eos_token, as AutoTokenizer reads them.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/status.h"

namespace strata::text {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Errors name the path and what is wrong: missing file, malformed JSON, an unknown or
  // unimplemented component (by its JSON key and "type").
  static Result<std::unique_ptr<Tokenizer>> load(const std::string& path);

  // Appends the ids of `text` (UTF-8) to *ids. With add_special_tokens the post-processor's
  // special tokens (a BOS, say) are added, as Hugging Face's encode(text,
  // add_special_tokens=True). Bytes that are not UTF-8 are each maximal invalid sequence one
  // U+FFFD, as Python's bytes.decode("utf-8", "replace") reads them (Hugging Face's tokenizers
  // take only valid text). Thread-safe: one tokenizer may encode on many threads at once.
  void encode(std::string_view text, bool add_special_tokens, std::vector<std::int32_t>* ids) const;
  std::vector<std::int32_t> encode(std::string_view text, bool add_special_tokens = true) const {
    std::vector<std::int32_t> ids;
    encode(text, add_special_tokens, &ids);
    return ids;
  }
  // Ids to text, as Hugging Face's decode(ids, skip_special_tokens). An id outside the
  // vocabulary is an invalid_argument naming it.
  virtual Result<std::string> decode(std::span<const std::int32_t> ids,
                                     bool skip_special_tokens) const = 0;

  // One past the largest id (model vocabulary and added tokens).
  virtual std::int64_t vocab_size() const = 0;
  virtual std::optional<std::int32_t> token_to_id(std::string_view token) const = 0;
  // The token's string, or "" for an id outside the vocabulary.
  virtual std::string id_to_token(std::int32_t id) const = 0;
  virtual bool is_special(std::int32_t id) const = 0;

  std::optional<std::int32_t> bos_id() const { return bos_id_; }
  std::optional<std::int32_t> eos_id() const { return eos_id_; }
  // What was loaded, for messages: "tokenizer.json (BPE, 128256 tokens)".
  const std::string& description() const { return description_; }
  // The file the ids come from (tokenizer.json or tokenizer.model).
  const std::string& path() const { return path_; }
  // tokenizer_config.json's chat_template (a model directory only); empty if none.
  const std::string& chat_template() const { return chat_template_; }

 protected:
  // encode() of text known to be valid UTF-8.
  virtual void encode_utf8(std::string_view text, bool add_special_tokens,
                           std::vector<std::int32_t>* ids) const = 0;

  std::optional<std::int32_t> bos_id_;
  std::optional<std::int32_t> eos_id_;
  std::string description_;
  std::string path_;
  std::string chat_template_;

  friend class TokenizerLoader;
};

}  // namespace strata::text
