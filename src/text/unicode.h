// UTF-8 and Unicode character classes as Hugging Face's tokenizers (Rust's char methods) see
// them, on utf8proc's tables. Text handed to these functions is valid UTF-8: callers that read
// files check it first (text::validate_utf8).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace strata::text {

// Decodes the character at byte `pos` and advances `pos` past it.
char32_t next_char(std::string_view s, std::size_t* pos);
// The length in bytes of the UTF-8 sequence that starts with byte `lead`.
inline std::size_t utf8_length(unsigned char lead) {
  return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
}
void append_utf8(std::string* out, char32_t c);

// The byte offset of the first invalid UTF-8 sequence, or std::string_view::npos.
std::size_t find_invalid_utf8(std::string_view s);
// `s` with each maximal subpart of an invalid sequence (Unicode 15, section 3.9: the longest
// start of a well-formed sequence, else one byte) replaced by U+FFFD, as Python's
// bytes.decode("utf-8", "replace") and WHATWG's decoder read it.
std::string replace_invalid_utf8(std::string_view s);

bool is_whitespace(char32_t c);       // Unicode White_Space (Rust char::is_whitespace)
bool is_punctuation(char32_t c);      // general category P*
bool is_mark(char32_t c);             // general category M*
bool is_bert_control(char32_t c);     // BERT's "other": Cc, Cf, Cn, Co, but not \t \n \r
bool is_nonspacing_mark(char32_t c);  // general category Mn
bool is_word(char32_t c);             // Oniguruma's \w: L, M, Nd, Pc
bool is_cjk(char32_t c);              // the CJK ideograph blocks BERT's normalizer spaces out

enum class NormalForm : std::uint8_t { kNfc, kNfd, kNfkc, kNfkd };
std::string normalize(std::string_view s, NormalForm form);
// Rust's char::to_lowercase per character (full mappings, no context).
std::string lowercase(std::string_view s);

// GPT-2's byte-level alphabet: each byte's stand-in character, and back (-1: not one).
const std::array<char32_t, 256>& byte_to_char();
int char_to_byte(char32_t c);

}  // namespace strata::text
