#include "src/text/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cctype>

#include "src/text/unicode.h"
#include "strata/core/check.h"

namespace strata::text {

struct Regex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

namespace {

// Per-thread match state: match data and a JIT stack large enough for long runs of whitespace
// under patterns like \s+(?!\S).
struct MatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(64 * 1024, 8 * 1024 * 1024, nullptr);
  MatchState() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~MatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
  MatchState(const MatchState&) = delete;
  MatchState& operator=(const MatchState&) = delete;
};

MatchState& match_state() {
  thread_local MatchState state;
  return state;
}

// Oniguruma's \s (with Unicode) is the White_Space property, which includes U+0085 (NEL);
// PCRE2's \s under UCP is Z + \t\n\v\f\r, which does not. Oniguruma's \w is letters, marks,
// decimal digits and connector punctuation; PCRE2's adds other numbers and leaves out spacing
// marks. Rewrites \s, \S, \w and \W (in and outside classes) to Oniguruma's meaning.
std::string to_pcre2(std::string_view pattern) {
  static constexpr std::string_view kSpace =
      "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
      "\\x{202F}\\x{205F}\\x{3000}";
  static constexpr std::string_view kWord = "\\p{L}\\p{M}\\p{Nd}\\p{Pc}";
  std::string out;
  bool in_class = false;
  for (std::size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char n = pattern[i + 1];
      ++i;
      if (n == 's' || n == 'w') {
        const std::string_view set = n == 's' ? kSpace : kWord;
        out += in_class ? std::string(set) : "[" + std::string(set) + "]";
      } else if ((n == 'S' || n == 'W') && !in_class) {
        out += "[^" + std::string(n == 'S' ? kSpace : kWord) + "]";
      } else {
        out += '\\';
        out += n;
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

}  // namespace

Result<Regex> Regex::compile(std::string_view pattern) {
  const std::string translated = to_pcre2(pattern);
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                    PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &error, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    return invalid_argument(
        "regular expression \"" + std::string(pattern) + "\" does not compile (PCRE2: " +
        reinterpret_cast<const char*>(message) + " at offset " + std::to_string(offset) + ")");
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if JIT fails
  Regex regex;
  auto owned = std::make_shared<Code>();
  owned->code = code;
  regex.code_ = std::move(owned);
  regex.pattern_ = std::string(pattern);
  return regex;
}

Regex Regex::literal(std::string_view literal) {
  std::string quoted;
  for (const char c : literal) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u)) quoted += '\\';
    quoted += c;
  }
  auto compiled = compile(quoted);
  STRATA_CHECK(compiled.is_ok(), "a quoted literal must compile: " + compiled.status().message());
  Regex regex = std::move(compiled).value();
  regex.pattern_ = std::string(literal);
  return regex;
}

void Regex::find_all(std::string_view text,
                     std::vector<std::pair<std::size_t, std::size_t>>* out) const {
  MatchState& state = match_state();
  std::size_t search_from = 0;
  bool have_last = false;
  std::size_t last_end = 0;
  while (search_from <= text.size()) {
    const int rc = pcre2_match(code_->code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(),
                               search_from, PCRE2_NO_UTF_CHECK, state.data, state.context);
    if (rc == PCRE2_ERROR_NOMATCH) return;
    STRATA_CHECK(rc >= 0,
                 "pcre2_match failed (" + std::to_string(rc) + ") on \"" + pattern_ + "\"");
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
    const std::size_t begin = ovector[0];
    const std::size_t end = ovector[1];
    if (begin == end && have_last && last_end == end) {
      // An empty match right after the previous one: step one character and search again.
      if (search_from >= text.size()) return;
      search_from += utf8_length(static_cast<unsigned char>(text[search_from]));
      continue;
    }
    out->emplace_back(begin, end);
    have_last = true;
    last_end = end;
    search_from = end;
  }
}

}  // namespace strata::text
