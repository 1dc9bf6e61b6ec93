// The parts of a Hugging Face tokenizer.json pipeline: normalizer, pre-tokenizer, model,
// post-processor and decoder. Each parse_* function reads one JSON object by its "type" and
// names the key path and the type in its errors.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "src/text/regex.h"
#include "strata/core/json.h"
#include "strata/core/status.h"

namespace strata::text::hf {

// A pre-token: a slice of one section of the input (the text between added tokens).
// at_start: the slice begins where the input began (Metaspace's prepend_scheme "first").
struct Piece {
  std::string text;
  bool at_start = false;
};

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual void normalize(std::string* text) const = 0;
};

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  // Replaces *pieces by their splits; empty pieces are dropped.
  virtual void split(std::vector<Piece>* pieces) const = 0;
};

class Model {
 public:
  virtual ~Model() = default;
  // Appends the ids of one pre-token.
  virtual void tokenize(std::string_view piece, std::vector<std::int32_t>* ids) const = 0;
  virtual std::int64_t size() const = 0;
  virtual const std::string* id_to_token(std::int32_t id) const = 0;
  virtual std::optional<std::int32_t> token_to_id(std::string_view token) const = 0;
  virtual std::string_view kind() const = 0;  // "BPE", "Unigram"
};

class PostProcessor {
 public:
  virtual ~PostProcessor() = default;
  // Adds the special tokens of a single sequence around *ids (a no-op without add_special).
  virtual void process(std::vector<std::int32_t>* ids, bool add_special) const = 0;
};

class Decoder {
 public:
  virtual ~Decoder() = default;
  virtual void decode_chain(std::vector<std::string>* tokens) const = 0;
};

// `key` is the JSON path of `json` ("normalizer", "pre_tokenizer.pretokenizers[1]"), for errors.
Result<std::unique_ptr<Normalizer>> parse_normalizer(const Json& json, const std::string& key);
Result<std::unique_ptr<PreTokenizer>> parse_pre_tokenizer(const Json& json, const std::string& key);
Result<std::unique_ptr<Model>> parse_model(const Json& json, const std::string& key);
Result<std::unique_ptr<Decoder>> parse_decoder(const Json& json, const std::string& key);
Result<std::unique_ptr<PostProcessor>> parse_post_processor(const Json& json,
                                                            const std::string& key);

// Helpers shared by the parsers.
Status unknown_type(const Json& json, const std::string& key, std::string_view what,
                    std::string_view implemented);
// The largest token id a tokenizer.json may use (vocabularies are far smaller; this bounds the
// id-to-token tables a malformed file could make Strata allocate).
inline constexpr std::int64_t kMaxTokenId = (std::int64_t{1} << 24) - 1;

// A boolean field, `fallback` when absent or null.
bool bool_field(const Json& json, const char* field, bool fallback);

// A pattern object {"String": s} or {"Regex": r}, as Split and Replace write it.
Result<Regex> parse_pattern(const Json& json, const std::string& key);
Result<std::string> string_field(const Json& json, const std::string& key, const char* field);

}  // namespace strata::text::hf
