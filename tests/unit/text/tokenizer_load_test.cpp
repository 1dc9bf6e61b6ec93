// Tokenizer::load: files, directories, tokenizer_config.json, and errors that name the problem.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>

#include "strata/core/file.h"
#include "strata/core/json.h"
#include "strata/text/tokenizer.h"
#include "tests/testing/temp_dir.h"

namespace strata::text {
namespace {

const std::string kLoadTokDir = std::string(STRATA_TEST_DATA_DIR) + "/tokenizers";

std::string error_of(const std::string& path) {
  auto tok = Tokenizer::load(path);
  EXPECT_FALSE(tok.is_ok()) << path;
  return tok.is_ok() ? "" : tok.status().message();
}

TEST(TokenizerLoadTest, ADirectoryPrefersTokenizerJsonAndReadsItsConfig) {
  auto tok = Tokenizer::load(kLoadTokDir + "/llama3");
  ASSERT_TRUE(tok.is_ok()) << tok.status().to_string();
  EXPECT_EQ(tok.value()->path(), kLoadTokDir + "/llama3/tokenizer.json");
  EXPECT_EQ(tok.value()->vocab_size(), 128256);
  EXPECT_EQ(tok.value()->bos_id(), 128000);
  EXPECT_NE(tok.value()->description().find("tokenizer_config.json"), std::string::npos);
  EXPECT_FALSE(tok.value()->chat_template().empty());
}

TEST(TokenizerLoadTest, LlamaClassConfigAddsBosAndEosAsTransformersDoes) {
  testing::TempDir dir;
  std::filesystem::copy_file(kLoadTokDir + "/llama2-bpe/tokenizer.json",
                             dir.file("tokenizer.json"));
  auto bare = Tokenizer::load(dir.file("tokenizer.json"));
  ASSERT_TRUE(bare.is_ok());
  const auto plain = bare.value()->encode("Hello", false);
  const auto bos = bare.value()->token_to_id("<s>");
  const auto eos = bare.value()->token_to_id("</s>");
  ASSERT_TRUE(bos && eos);
  // The file's own post-processor adds <s>.
  EXPECT_EQ(bare.value()->encode("Hello").front(), *bos);

  dir.write("tokenizer_config.json", R"({"tokenizer_class": "LlamaTokenizer",
      "bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": false,
      "add_eos_token": true})");
  auto configured = Tokenizer::load(dir.path());
  ASSERT_TRUE(configured.is_ok()) << configured.status().to_string();
  auto want = plain;
  want.push_back(*eos);
  EXPECT_EQ(configured.value()->encode("Hello"), want);
  EXPECT_EQ(configured.value()->eos_id(), eos);

  dir.write("tokenizer_config.json", R"({"tokenizer_class": "LlamaTokenizerFast",
      "bos_token": "<s>", "eos_token": "</s>"})");  // defaults: BOS yes, EOS no
  configured = Tokenizer::load(dir.path());
  ASSERT_TRUE(configured.is_ok());
  want = plain;
  want.insert(want.begin(), *bos);
  EXPECT_EQ(configured.value()->encode("Hello"), want);
}

TEST(TokenizerLoadTest, SentencePieceModelsLoadFromFileOrDirectory) {
  auto tok = Tokenizer::load(kLoadTokDir + "/sentencepiece-bpe/tokenizer.model");
  ASSERT_TRUE(tok.is_ok()) << tok.status().to_string();
  EXPECT_EQ(tok.value()->vocab_size(), 1000);
  ASSERT_TRUE(tok.value()->eos_id().has_value());
  const auto ids = tok.value()->encode("Hello world");
  EXPECT_FALSE(ids.empty());
  EXPECT_NE(ids.front(), tok.value()->bos_id().value_or(-1)) << "a bare model adds no BOS";

  testing::TempDir dir;
  std::filesystem::copy_file(kLoadTokDir + "/sentencepiece-bpe/tokenizer.model",
                             dir.file("tokenizer.model"));
  dir.write("tokenizer_config.json",
            R"({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>"})");
  auto llama = Tokenizer::load(dir.path());
  ASSERT_TRUE(llama.is_ok()) << llama.status().to_string();
  auto want = ids;
  want.insert(want.begin(), *llama.value()->bos_id());
  EXPECT_EQ(llama.value()->encode("Hello world"), want);
}

TEST(TokenizerLoadTest, ErrorsNameTheFileAndTheProblem) {
  testing::TempDir dir;
  EXPECT_NE(error_of(dir.file("missing.json")).find("no such tokenizer file"), std::string::npos);
  EXPECT_NE(error_of(dir.path()).find("needs tokenizer.json or tokenizer.model"),
            std::string::npos);
  const std::string broken = dir.write("broken.json", "{\"model\": ");
  EXPECT_NE(error_of(broken).find("broken.json"), std::string::npos);

  auto json = read_json_file(kLoadTokDir + "/bytelevel-bpe/tokenizer.json");
  ASSERT_TRUE(json.is_ok());
  Json j = json.value();
  j["pre_tokenizer"] = {{"type", "UnicodeScripts"}};
  ASSERT_TRUE(write_json_file(dir.file("scripts.json"), j).is_ok());
  const std::string e = error_of(dir.file("scripts.json"));
  EXPECT_NE(e.find("pre_tokenizer: pre-tokenizer \"UnicodeScripts\" is not implemented"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("scripts.json"), std::string::npos) << e;

  j = json.value();
  j["model"]["merges"][0] = "onlyonepart";
  ASSERT_TRUE(write_json_file(dir.file("merges.json"), j).is_ok());
  EXPECT_NE(error_of(dir.file("merges.json")).find("model.merges[0]: expected \"a b\""),
            std::string::npos);

  j = json.value();
  j["model"]["unk_token"] = "<nope>";
  ASSERT_TRUE(write_json_file(dir.file("unk.json"), j).is_ok());
  EXPECT_NE(error_of(dir.file("unk.json")).find("model.unk_token: \"<nope>\" is not in"),
            std::string::npos);

  j = json.value();
  j["added_tokens"][0]["id"] = 1ll << 40;
  ASSERT_TRUE(write_json_file(dir.file("bigid.json"), j).is_ok());
  EXPECT_NE(error_of(dir.file("bigid.json")).find("added_tokens[0].id"), std::string::npos);

  j = json.value();
  j["model"]["dropout"] = 0.1;
  ASSERT_TRUE(write_json_file(dir.file("dropout.json"), j).is_ok());
  EXPECT_NE(error_of(dir.file("dropout.json")).find("model.dropout"), std::string::npos);

  j = json.value();
  j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "Precompiled"}}}}};
  ASSERT_TRUE(write_json_file(dir.file("precompiled.json"), j).is_ok());
  EXPECT_NE(error_of(dir.file("precompiled.json"))
                .find("normalizer.normalizers[0]: normalizer \"Precompiled\" is not implemented"),
            std::string::npos);

  std::filesystem::create_directories(dir.file("model"));
  std::filesystem::copy_file(kLoadTokDir + "/bytelevel-bpe/tokenizer.json",
                             dir.file("model/tokenizer.json"));
  dir.write("model/tokenizer_config.json", R"({"eos_token": "<|nope|>"})");
  EXPECT_NE(error_of(dir.file("model")).find("eos_token \"<|nope|>\" is not in"),
            std::string::npos);

  const std::string not_spm = dir.write("tokenizer.model", "not a protobuf");
  EXPECT_NE(error_of(not_spm).find("not a SentencePiece model"), std::string::npos);
}

// An added token marked `normalized` matches the text the normalizer makes of its content, as
// Hugging Face's added vocabulary does: with Llama's Prepend("▁") + Replace(" ", "▁") layout,
// "<x>" is found after a space ("▁<x>") but not glued to a word.
TEST(TokenizerLoadTest, NormalizedAddedTokensMatchTheirNormalizedContent) {
  testing::TempDir dir;
  auto json = read_json_file(kLoadTokDir + "/llama2-bpe-legacy/tokenizer.json");
  ASSERT_TRUE(json.is_ok());
  Json j = json.value();
  j["added_tokens"].push_back({{"id", 1459},
                               {"content", "<x>"},
                               {"single_word", false},
                               {"lstrip", false},
                               {"rstrip", false},
                               {"normalized", true},
                               {"special", false}});
  ASSERT_TRUE(write_json_file(dir.file("tokenizer.json"), j).is_ok());
  auto tok = Tokenizer::load(dir.file("tokenizer.json"));
  ASSERT_TRUE(tok.is_ok()) << tok.status().to_string();
  auto contains = [](const std::vector<std::int32_t>& ids, std::int32_t id) {
    return std::find(ids.begin(), ids.end(), id) != ids.end();
  };
  EXPECT_TRUE(contains(tok.value()->encode("a <x>", false), 1459));
  EXPECT_FALSE(contains(tok.value()->encode("a<x>", false), 1459));
}

TEST(TokenizerLoadTest, ASentencePieceModelDirectoryReadsSpecialPiecesInTheText) {
  const std::string model = kLoadTokDir + "/sentencepiece-bpe/tokenizer.model";
  auto bare = Tokenizer::load(model);
  ASSERT_TRUE(bare.is_ok());
  const std::int32_t eos = *bare.value()->eos_id();
  auto ids = bare.value()->encode("Hi</s>", false);
  EXPECT_EQ(std::find(ids.begin(), ids.end(), eos), ids.end())
      << "SentencePiece alone never reads </s> as the token";

  testing::TempDir dir;
  std::filesystem::copy_file(model, dir.file("tokenizer.model"));
  dir.write("tokenizer_config.json",
            R"({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>"})");
  auto llama = Tokenizer::load(dir.path());
  ASSERT_TRUE(llama.is_ok());
  ids = llama.value()->encode("Hi</s>", false);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids.back(), eos) << "as transformers' LlamaTokenizer reads a model directory";

  dir.write("tokenizer_config.json", R"({"tokenizer_class": "LlamaTokenizer", "legacy": false,
      "bos_token": "<s>", "eos_token": "</s>"})");
  EXPECT_NE(error_of(dir.path()).find("\"legacy\": false with only a tokenizer.model"),
            std::string::npos);
}

TEST(TokenizerLoadTest, DecodingAnIdOutsideTheVocabularyIsAnError) {
  auto tok = Tokenizer::load(kLoadTokDir + "/bytelevel-bpe/tokenizer.json");
  ASSERT_TRUE(tok.is_ok());
  const std::vector<std::int32_t> ids = {1, 999999};
  auto text = tok.value()->decode(ids, false);
  ASSERT_FALSE(text.is_ok());
  EXPECT_NE(text.status().message().find("token id 999999 is outside"), std::string::npos);
}

}  // namespace
}  // namespace strata::text
