// UTF-8 repair: invalid bytes read as Python's bytes.decode("utf-8", "replace") reads them, and
// tokenizers encode such bytes as the repaired text.
#include "src/text/unicode.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>

#include "strata/text/tokenizer.h"

namespace strata::text {
namespace {

TEST(Utf8RepairTest, EachMaximalInvalidSubpartIsOneReplacementAsPythonReadsIt) {
  // Expected values: CPython 3's bytes.decode("utf-8", "replace") of each input, re-encoded.
  const std::string r = "\xEF\xBF\xBD";
  const std::pair<std::string, std::string> cases[] = {
      {"plain ascii", "plain ascii"},
      {"\xE4\xB8\xAD\xF0\x9F\x98\x80", "\xE4\xB8\xAD\xF0\x9F\x98\x80"},
      {"\xFF\xFE invalid utf-8 \xC3", r + r + " invalid utf-8 " + r},
      {"\xE4\xB8", r},                           // a truncated 3-byte sequence: one
      {"\xE4\xB8\xAD\xE4", "\xE4\xB8\xAD" + r},  // a whole one, then a lone lead
      {"\xED\xA0\x80", r + r + r},               // a surrogate: ED's second byte stops at 9F
      {"\xF0\x80\x80\x80", r + r + r + r},       // overlong: F0's second byte starts at 90
      {"\xF4\x90\x80\x80", r + r + r + r},       // above U+10FFFF
      {"\xC0\xAF", r + r},                       // C0 is never a lead byte
      {"\xF0\x9F\x98", r},
      {"a\x80"
       "b",
       "a" + r + "b"},
      {"\xE0\xA0", r},
  };
  for (const auto& [in, want] : cases) {
    EXPECT_EQ(replace_invalid_utf8(in), want) << in;
    EXPECT_EQ(find_invalid_utf8(replace_invalid_utf8(in)), std::string_view::npos) << in;
  }
}

TEST(Utf8RepairTest, TokenizersEncodeInvalidBytesAsTheRepairedText) {
  const std::string dir = std::string(STRATA_TEST_DATA_DIR) + "/tokenizers/";
  for (const char* name : {"bytelevel-bpe/tokenizer.json", "llama2-bpe/tokenizer.json",
                           "sentencepiece-bpe/tokenizer.model"}) {
    auto tok = Tokenizer::load(dir + name);
    ASSERT_TRUE(tok.is_ok()) << tok.status().to_string();
    const std::string bad = "caf\xC3 \xFF\xFEok \xE4\xB8";
    EXPECT_EQ((*tok)->encode(bad), (*tok)->encode(replace_invalid_utf8(bad))) << name;
    EXPECT_FALSE((*tok)->encode(bad, false).empty()) << name;
  }
}

}  // namespace
}  // namespace strata::text
