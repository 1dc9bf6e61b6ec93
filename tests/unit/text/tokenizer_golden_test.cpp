// Every id, against Hugging Face's tokenizers and SentencePiece: the golden files in
// tests/data/tokenizers/ come from tools/golden/tokenizer_golden.sh, which runs the reference
// implementations on tests/data/tokenizers/texts.json.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "strata/core/json.h"
#include "strata/text/tokenizer.h"
#include "tests/testing/test_name.h"

namespace strata::text {
namespace {

const std::string kGoldenDir = std::string(STRATA_TEST_DATA_DIR) + "/tokenizers";

std::string show_ids(const std::vector<std::int32_t>& ids) {
  std::string s = "[";
  for (std::size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

class GoldenTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenTest, IdsAndDecodingMatchTheReference) {
  const std::string dir = kGoldenDir + "/" + GetParam();
  auto texts = read_json_file(kGoldenDir + "/texts.json");
  ASSERT_TRUE(texts.is_ok()) << texts.status().to_string();
  auto golden = read_json_file(dir + "/golden.json");
  ASSERT_TRUE(golden.is_ok()) << golden.status().to_string();
  auto tok = Tokenizer::load(dir + "/" + golden.value()["tokenizer"].get<std::string>());
  ASSERT_TRUE(tok.is_ok()) << tok.status().to_string();
  const Tokenizer& t = *tok.value();
  const Json& cases = golden.value()["cases"];
  ASSERT_EQ(cases.size(), texts.value().size());
  int failures = 0;
  for (const Json& c : cases) {
    const std::string text = texts.value()[c["text"].get<std::size_t>()].get<std::string>();
    const auto ids = c["ids"].get<std::vector<std::int32_t>>();
    const auto plain = c["ids_plain"].get<std::vector<std::int32_t>>();
    const auto got = t.encode(text, true);
    const auto got_plain = t.encode(text, false);
    EXPECT_EQ(got, ids) << "text " << c["text"] << ": " << Json(text).dump() << "\n  want "
                        << show_ids(ids) << "\n  got  " << show_ids(got);
    EXPECT_EQ(got_plain, plain) << "text " << c["text"] << " without special tokens";
    auto decoded = t.decode(ids, false);
    ASSERT_TRUE(decoded.is_ok()) << decoded.status().to_string();
    EXPECT_EQ(decoded.value(), c["decoded"].get<std::string>())
        << "decoding text " << c["text"] << ": got " << Json(decoded.value()).dump();
    auto skipped = t.decode(ids, true);
    ASSERT_TRUE(skipped.is_ok()) << skipped.status().to_string();
    EXPECT_EQ(skipped.value(), c["decoded_skip"].get<std::string>())
        << "decoding text " << c["text"] << " without special tokens: got "
        << Json(skipped.value()).dump();
    if (got != ids && ++failures > 8) break;
  }
}

std::vector<std::string> golden_dirs() {
  std::vector<std::string> dirs;
  for (const auto& entry : std::filesystem::directory_iterator(kGoldenDir)) {
    if (entry.is_directory() && std::filesystem::exists(entry.path() / "golden.json")) {
      dirs.push_back(entry.path().filename().string());
    }
  }
  std::sort(dirs.begin(), dirs.end());
  return dirs;
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, GoldenTest, ::testing::ValuesIn(golden_dirs()),
                         [](const auto& info) { return strata::testing::test_name(info.param); });

TEST(GoldenDataTest, EveryTokenizerFamilyHasGoldenIds) {
  const auto dirs = golden_dirs();
  for (const char* family : {"llama3", "bytelevel-bpe", "llama2-bpe", "llama2-bpe-legacy",
                             "unigram", "sentencepiece-bpe", "sentencepiece-unigram"}) {
    EXPECT_NE(std::find(dirs.begin(), dirs.end(), family), dirs.end()) << family;
  }
}

}  // namespace
}  // namespace strata::text
