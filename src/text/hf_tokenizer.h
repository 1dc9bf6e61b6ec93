// The tokenizer.json pipeline (internal; use text::Tokenizer::load).
#pragma once

#include <memory>
#include <string>
#include <unordered_map>

#include "src/text/hf_components.h"
#include "strata/text/tokenizer.h"

namespace strata::text {

struct AddedToken {
  std::int32_t id = 0;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool special = false;
};

class HfTokenizer final : public Tokenizer {
 public:
  // Reads and checks tokenizer.json at `path`.
  static Result<std::unique_ptr<HfTokenizer>> load(const std::string& path);

  Result<std::string> decode(std::span<const std::int32_t> ids,
                             bool skip_special_tokens) const override;
  std::int64_t vocab_size() const override { return vocab_size_; }
  std::optional<std::int32_t> token_to_id(std::string_view token) const override;
  std::string id_to_token(std::int32_t id) const override;
  bool is_special(std::int32_t id) const override;

  // Replaces the post-processor by `[bos] $A [eos]`, as transformers' Llama-family tokenizers
  // rebuild it from add_bos_token / add_eos_token.
  void set_template(std::optional<std::int32_t> bos, std::optional<std::int32_t> eos);
  void set_special_ids(std::optional<std::int32_t> bos, std::optional<std::int32_t> eos) {
    bos_id_ = bos;
    eos_id_ = eos;
  }

 protected:
  void encode_utf8(std::string_view text, bool add_special_tokens,
                   std::vector<std::int32_t>* ids) const override;

 private:
  // Leftmost-longest matcher over a set of added tokens.
  struct Matcher {
    // Each token with the text it matches: its content, or for a `normalized` token its
    // content through the normalizer (as Hugging Face's added vocabulary refreshes them).
    std::vector<std::pair<std::string, const AddedToken*>> tokens;  // longest first
    std::array<bool, 256> first_byte{};
    bool empty() const { return tokens.empty(); }
  };
  struct Section {
    std::size_t begin, end;
    std::int32_t id;  // -1: text
  };
  void split_added(std::string_view text, const Matcher& matcher,
                   std::vector<Section>* sections) const;
  void encode_text(std::string_view text, bool at_start, std::vector<std::int32_t>* ids) const;

  std::unique_ptr<hf::Normalizer> normalizer_;
  std::unique_ptr<hf::PreTokenizer> pre_tokenizer_;
  std::unique_ptr<hf::Model> model_;
  std::unique_ptr<hf::PostProcessor> post_processor_;
  std::unique_ptr<hf::Decoder> decoder_;
  std::vector<AddedToken> added_;
  std::unordered_map<std::string, std::int32_t> added_by_content_;
  std::unordered_map<std::int32_t, std::size_t> added_by_id_;
  Matcher raw_matcher_, normalized_matcher_;
  std::int64_t vocab_size_ = 0;
};

}  // namespace strata::text
