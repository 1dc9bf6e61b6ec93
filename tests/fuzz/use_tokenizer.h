// What the tokenizer harnesses do with a tokenizer that loads: a few texts encoded with and
// without special tokens and decoded back, every id (up to 512) decoded and looked up, ids
// outside the vocabulary decoded.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "strata/text/tokenizer.h"

namespace strata::fuzz {

inline void exercise(const strata::text::Tokenizer& tok) {
  static constexpr std::string_view kTexts[] = {
      "Hello, world! It's 2026.", "  leading and   repeated  spaces\n\ttabs\r\n",
      "caf\xc3\xa9 na\xc3\xafve \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80",
      "\xff\xfe invalid utf-8 \xc3", ""};
  for (const std::string_view text : kTexts) {
    for (const bool special : {true, false}) {
      const auto ids = tok.encode(text, special);
      (void)tok.decode(ids, !special);
    }
  }
  const std::int64_t n = std::min<std::int64_t>(tok.vocab_size(), 512);
  std::vector<std::int32_t> all;
  for (std::int32_t id = 0; id < n; ++id) {
    all.push_back(id);
    const std::string piece = tok.id_to_token(id);
    (void)tok.token_to_id(piece);
    (void)tok.is_special(id);
  }
  (void)tok.decode(all, false);
  (void)tok.decode(all, true);
  const std::int32_t outside[] = {-1, static_cast<std::int32_t>(tok.vocab_size())};
  (void)tok.decode(outside, false);
}

inline void load_and_use(const std::string& path) {
  auto tok = strata::text::Tokenizer::load(path);
  if (tok.is_ok()) exercise(**tok);
}

}  // namespace strata::fuzz
