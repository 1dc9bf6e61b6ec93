// A SentencePiece tokenizer.model through libsentencepiece (internal; use Tokenizer::load).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "strata/text/tokenizer.h"

namespace sentencepiece {
class SentencePieceProcessor;
}

namespace strata::text {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  static Result<std::unique_ptr<SentencePieceTokenizer>> load(const std::string& path);
  ~SentencePieceTokenizer() override;

  Result<std::string> decode(std::span<const std::int32_t> ids,
                             bool skip_special_tokens) const override;
  std::int64_t vocab_size() const override;
  std::optional<std::int32_t> token_to_id(std::string_view token) const override;
  std::string id_to_token(std::int32_t id) const override;
  bool is_special(std::int32_t id) const override;

  void set_added(bool add_bos, bool add_eos) {
    add_bos_ = add_bos;
    add_eos_ = add_eos;
  }
  // As transformers' LlamaTokenizer (legacy) from a model directory: the special pieces (<s>,
  // </s>, <unk> and other control pieces) written in the text are those tokens, and the text
  // between them is encoded section by section.
  void split_special_pieces();
  void set_special_ids(std::optional<std::int32_t> bos, std::optional<std::int32_t> eos) {
    bos_id_ = bos;
    eos_id_ = eos;
  }

 protected:
  // As SentencePieceProcessor.encode(text); with add_special_tokens, add_bos / add_eos say
  // what to add (a bare model adds nothing; a Llama directory adds the BOS).
  void encode_utf8(std::string_view text, bool add_special_tokens,
                   std::vector<std::int32_t>* ids) const override;

 private:
  SentencePieceTokenizer();
  std::unique_ptr<sentencepiece::SentencePieceProcessor> sp_;
  bool add_bos_ = false;
  bool add_eos_ = false;
  std::vector<std::pair<std::string, int>> specials_;  // longest first; empty: no splitting
};

}  // namespace strata::text
