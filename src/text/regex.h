// A compiled PCRE2 pattern (UTF, Unicode properties, JIT) that finds matches the way
// Hugging Face's tokenizers do with Oniguruma: left to right, an empty match never right after
// the previous match.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "strata/core/status.h"

namespace strata::text {

class Regex {
 public:
  // `pattern` in Oniguruma's (Ruby) syntax as tokenizer.json writes it; the few constructs whose
  // meaning differs in PCRE2 are rewritten. Errors quote the pattern and PCRE2's message.
  static Result<Regex> compile(std::string_view pattern);
  // A pattern that matches `literal` exactly.
  static Regex literal(std::string_view literal);

  // Every match as a [begin, end) byte range, in order.
  void find_all(std::string_view text, std::vector<std::pair<std::size_t, std::size_t>>* out) const;

 private:
  struct Code;
  std::shared_ptr<const Code> code_;
  std::string pattern_;
};

}  // namespace strata::text
