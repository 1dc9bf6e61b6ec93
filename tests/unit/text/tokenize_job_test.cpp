// strata tokenize's job: formats, EOS, supervised masks, errors, and thread-count independence.
#include "strata/text/tokenize_job.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "strata/core/file.h"
#include "strata/core/json.h"
#include "strata/core/token_files.h"
#include "strata/text/chat_template.h"
#include "tests/testing/temp_dir.h"

namespace strata::text {
namespace {

const std::string kTokDir = std::string(STRATA_TEST_DATA_DIR) + "/tokenizers";

std::unique_ptr<Tokenizer> load(const std::string& path) {
  auto tok = Tokenizer::load(path);
  EXPECT_TRUE(tok.is_ok()) << tok.status().to_string();
  return std::move(tok).value();
}

std::vector<std::uint32_t> read_tokens(const std::string& path, int bytes, std::size_t skip = 0) {
  auto data = read_file(path);
  EXPECT_TRUE(data.is_ok()) << data.status().to_string();
  std::vector<std::uint32_t> ids;
  const std::string& d = data.value();
  for (std::size_t i = skip; i + static_cast<std::size_t>(bytes) <= d.size();
       i += static_cast<std::size_t>(bytes)) {
    std::uint32_t v = 0;
    for (int k = 0; k < bytes; ++k)
      v |= std::uint32_t{static_cast<unsigned char>(d[i + static_cast<std::size_t>(k)])} << (8 * k);
    ids.push_back(v);
  }
  return ids;
}

std::vector<std::uint32_t> as_u32(const std::vector<std::int32_t>& v) {
  return {v.begin(), v.end()};
}

TEST(TokenizeJobTest, DocumentsAreEncodedInOrderEachFollowedByEos) {
  testing::TempDir dir;
  auto tok = load(kTokDir + "/bytelevel-bpe/tokenizer.json");
  ASSERT_TRUE(tok->eos_id().has_value());
  const std::string txt = dir.write("a.txt", "A whole file is one document.\nTwo lines.\n");
  const std::string jsonl =
      dir.write("b.jsonl", "{\"text\": \"first record\"}\n\n{\"text\": \"second \\u00e9\"}\n");
  dir.write("out.bin.mask", "stale");
  TokenizeOptions options;
  options.inputs = {txt, jsonl};
  options.output = dir.file("out.bin");
  auto summary = tokenize_files(*tok, options);
  ASSERT_TRUE(summary.is_ok()) << summary.status().to_string();
  EXPECT_EQ(summary.value().format, OutputFormat::kU16);
  EXPECT_EQ(summary.value().documents, 3);
  std::vector<std::int32_t> want;
  for (const char* doc :
       {"A whole file is one document.\nTwo lines.\n", "first record", "second \xC3\xA9"}) {
    tok->encode(doc, true, &want);
    want.push_back(*tok->eos_id());
  }
  EXPECT_EQ(read_tokens(options.output, 2), as_u32(want));
  EXPECT_EQ(summary.value().tokens, static_cast<std::int64_t>(want.size()));
  EXPECT_EQ(summary.value().trained_tokens, summary.value().tokens);
  EXPECT_FALSE(std::filesystem::exists(dir.file("out.bin.mask")))
      << "a mask from an earlier run must not survive a run without supervised records";

  options.eos = false;
  ASSERT_TRUE(tokenize_files(*tok, options).is_ok());
  std::vector<std::int32_t> no_eos;
  for (const char* doc :
       {"A whole file is one document.\nTwo lines.\n", "first record", "second \xC3\xA9"}) {
    tok->encode(doc, true, &no_eos);
  }
  EXPECT_EQ(read_tokens(options.output, 2), as_u32(no_eos));
}

TEST(TokenizeJobTest, FormatsFollowTheVocabulary) {
  testing::TempDir dir;
  auto llama3 = load(kTokDir + "/llama3/tokenizer.json");
  TokenizeOptions options;
  options.inputs = {dir.write("a.jsonl", "{\"text\": \"Hello world\"}\n")};
  options.output = dir.file("out.bin");
  options.format = OutputFormat::kU16;
  auto refused = tokenize_files(*llama3, options);
  ASSERT_FALSE(refused.is_ok());
  EXPECT_NE(refused.status().message().find("u16 cannot hold the vocabulary of 128256"),
            std::string::npos)
      << refused.status().message();
  EXPECT_FALSE(std::filesystem::exists(options.output));

  options.format.reset();
  auto u32 = tokenize_files(*llama3, options);
  ASSERT_TRUE(u32.is_ok()) << u32.status().to_string();
  EXPECT_EQ(u32.value().format, OutputFormat::kU32);
  std::vector<std::int32_t> want = llama3->encode("Hello world");
  want.push_back(*llama3->eos_id());
  EXPECT_EQ(read_tokens(options.output, 4), as_u32(want));

  options.format = OutputFormat::kLlmc;
  ASSERT_TRUE(tokenize_files(*llama3, options).is_ok());
  const auto header = read_tokens(options.output, 4);
  ASSERT_GE(header.size(), 256u);
  EXPECT_EQ(header[0], 20240801u) << "u32 tokens: llm.c's Llama 3 header";
  EXPECT_EQ(header[1], 7u);
  EXPECT_EQ(header[2], want.size());
  EXPECT_EQ(read_tokens(options.output, 4, 1024), as_u32(want));
}

TEST(TokenizeJobTest, PromptCompletionTrainsOnTheCompletionAndEos) {
  testing::TempDir dir;
  auto tok = load(kTokDir + "/llama3/tokenizer.json");
  TokenizeOptions options;
  options.inputs = {dir.write("sft.jsonl",
                              "{\"prompt\": \"Question: what is 2+2?\\nAnswer:\", \"completion\": "
                              "\" 4\"}\n{\"text\": \"plain\"}\n")};
  options.output = dir.file("out.bin");
  auto summary = tokenize_files(*tok, options);
  ASSERT_TRUE(summary.is_ok()) << summary.status().to_string();
  EXPECT_EQ(summary.value().supervised_documents, 1);
  ASSERT_EQ(summary.value().mask_path, dir.file("out.bin.mask"));
  const auto prompt = tok->encode("Question: what is 2+2?\nAnswer:");
  auto full = tok->encode("Question: what is 2+2?\nAnswer: 4");
  full.push_back(*tok->eos_id());
  const std::size_t plain = tok->encode("plain").size() + 1;
  const auto ids = read_tokens(options.output, 4);
  ASSERT_EQ(ids.size(), full.size() + plain);
  auto mask = read_file(summary.value().mask_path);
  ASSERT_TRUE(mask.is_ok());
  ASSERT_EQ(mask.value().size(), ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const bool train = i >= prompt.size();
    EXPECT_EQ(mask.value()[i], train ? 1 : 0) << "token " << i;
  }
  EXPECT_EQ(summary.value().trained_tokens,
            static_cast<std::int64_t>(full.size() - prompt.size() + plain));
}

TEST(TokenizeJobTest, PlainDocumentsBeforeTheFirstSupervisedOneTrainEverywhere) {
  testing::TempDir dir;
  auto tok = load(kTokDir + "/bytelevel-bpe/tokenizer.json");
  TokenizeOptions options;
  options.inputs = {dir.write("a.txt", "plain text first"),
                    dir.write("b.jsonl", "{\"prompt\": \"Q?\", \"completion\": \" A\"}\n")};
  options.output = dir.file("out.bin");
  auto summary = tokenize_files(*tok, options);
  ASSERT_TRUE(summary.is_ok()) << summary.status().to_string();
  const std::size_t plain = tok->encode("plain text first").size() + 1;
  auto mask = read_file(summary.value().mask_path);
  ASSERT_TRUE(mask.is_ok());
  ASSERT_GT(mask.value().size(), plain);
  for (std::size_t i = 0; i < plain; ++i) EXPECT_EQ(mask.value()[i], 1) << i;
  EXPECT_EQ(mask.value().size(), read_tokens(options.output, 2).size());
}

// A post-processor that appends (Llama's add_eos_token) is not part of the prompt's tokens at
// the start of the whole record, so the mask starts where the prompt ends.
TEST(TokenizeJobTest, TheMaskBoundaryIgnoresTokensThePostProcessorAppends) {
  testing::TempDir dir;
  std::filesystem::copy_file(kTokDir + "/llama2-bpe/tokenizer.json", dir.file("tokenizer.json"));
  dir.write("tokenizer_config.json", R"({"tokenizer_class": "LlamaTokenizer",
      "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": true, "add_eos_token": true})");
  auto tok = load(dir.path());
  TokenizeOptions options;
  options.inputs = {dir.write(
      "sft.jsonl", "{\"prompt\": \"Question: two plus two?\", \"completion\": \" four\"}\n")};
  options.output = dir.file("out.bin");
  options.eos = false;
  auto summary = tokenize_files(*tok, options);
  ASSERT_TRUE(summary.is_ok()) << summary.status().to_string();
  EXPECT_EQ(summary.value().boundary_merges, 0);
  const auto full = tok->encode("Question: two plus two? four");
  const auto prompt = tok->encode("Question: two plus two?");
  ASSERT_EQ(read_tokens(options.output, 2), as_u32(full));
  auto mask = read_file(summary.value().mask_path);
  ASSERT_TRUE(mask.is_ok());
  for (std::size_t i = 0; i < full.size(); ++i) {
    EXPECT_EQ(mask.value()[i], i + 1 >= prompt.size() ? 1 : 0) << i;  // prompt minus its </s>
  }
}

TEST(TokenizeJobTest, MessagesAreRenderedWithTheChatTemplateAndTrainOnAssistantTurns) {
  testing::TempDir dir;
  auto tok = load(kTokDir + "/llama3");  // a directory: tokenizer_config.json's chat_template
  ASSERT_FALSE(tok->chat_template().empty());
  TokenizeOptions options;
  options.inputs = {dir.write(
      "chat.jsonl",
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}, {"role": "assistant", "content": " See you. "}]})"
      "\n")};
  options.output = dir.file("out.bin");
  auto summary = tokenize_files(*tok, options);
  ASSERT_TRUE(summary.is_ok()) << summary.status().to_string();
  EXPECT_EQ(summary.value().chat_template, "llama3");
  const std::string rendered =
      "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\nSee you.<|eot_id|>"
      // This copy is the first Llama 3 revision, whose template always ends with the header.
      "<|start_header_id|>assistant<|end_header_id|>\n\n";
  auto want = tok->encode(rendered, false);
  want.push_back(*tok->eos_id());
  const auto ids = read_tokens(options.output, 4);
  ASSERT_EQ(ids, as_u32(want));
  auto mask = read_file(summary.value().mask_path);
  ASSERT_TRUE(mask.is_ok());
  std::string trained;
  std::vector<std::int32_t> run;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (mask.value()[i] == 1) run.push_back(static_cast<std::int32_t>(ids[i]));
  }
  auto text = tok->decode(run, false);
  ASSERT_TRUE(text.is_ok());
  EXPECT_EQ(text.value(), "Hello!<|eot_id|>See you.<|eot_id|>");
  EXPECT_EQ(summary.value().boundary_merges, 0);
}

TEST(TokenizeJobTest, AMalformedRecordNamesFileAndLineAndKeepsTheOldOutput) {
  testing::TempDir dir;
  auto tok = load(kTokDir + "/bytelevel-bpe/tokenizer.json");
  const std::string out = dir.write("out.bin", "old contents");
  struct Case {
    std::string line;
    std::string expect;
  };
  for (const Case& c : std::vector<Case>{
           {"{\"text\": \"ok\"\n", "bad.jsonl:2: not a JSON object"},
           {"[1, 2]", "bad.jsonl:2: expected a JSON object"},
           {"{\"body\": \"x\"}", "bad.jsonl:2: no \"text\" field"},
           {"{\"prompt\": \"x\"}", "bad.jsonl:2: a supervised record needs both"},
           {"{\"messages\": [{\"role\": \"user\"}]}", "bad.jsonl:2: messages[0]: expected"},
           {"{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", "
            "\"content\": \"b\"}]}",
            "bad.jsonl:2: a \"messages\" record needs a chat template"},
       }) {
    TokenizeOptions options;
    options.inputs = {dir.write("bad.jsonl", "{\"text\": \"fine\"}\n" + c.line + "\n")};
    options.output = out;
    auto r = tokenize_files(*tok, options);
    ASSERT_FALSE(r.is_ok()) << c.line;
    EXPECT_NE(r.status().message().find(c.expect), std::string::npos)
        << "got: " << r.status().message();
    auto kept = read_file(out);
    ASSERT_TRUE(kept.is_ok());
    EXPECT_EQ(kept.value(), "old contents");
  }
  TokenizeOptions options;
  options.inputs = {dir.write("bad.txt", std::string("ok \xFF\xFE bytes"))};
  options.output = out;
  auto r = tokenize_files(*tok, options);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("bad.txt: not UTF-8 text (invalid byte at offset 3)"),
            std::string::npos)
      << r.status().message();
  options.inputs = {dir.write("data.csv", "a,b\n")};
  r = tokenize_files(*tok, options);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("expected a .txt file"), std::string::npos);
}

TEST(TokenizeJobTest, OutputDoesNotDependOnTheThreadCount) {
  testing::TempDir dir;
  auto tok = load(kTokDir + "/llama2-bpe/tokenizer.json");
  // Several batches' worth of records (batches are 256 KiB of input).
  std::string jsonl;
  for (int i = 0; jsonl.size() < 900 * 1024; ++i) {
    jsonl += "{\"text\": \"record " + std::to_string(i) + ": the quick brown fox " +
             std::to_string(i * 7919) + " jumps\"}\n";
    if (i % 3 == 0) {
      jsonl += "{\"prompt\": \"Q" + std::to_string(i) + "?\", \"completion\": \" A" +
               std::to_string(i) + "\"}\n";
    }
  }
  const std::string in = dir.write("many.jsonl", jsonl);
  std::string first, first_mask;
  for (int jobs : {1, 2, 3}) {
    TokenizeOptions options;
    options.inputs = {in};
    options.output = dir.file("out" + std::to_string(jobs) + ".bin");
    options.jobs = jobs;
    auto summary = tokenize_files(*tok, options);
    ASSERT_TRUE(summary.is_ok()) << summary.status().to_string();
    auto data = read_file(options.output);
    auto mask = read_file(loss_mask_path(options.output));
    ASSERT_TRUE(data.is_ok() && mask.is_ok());
    if (jobs == 1) {
      first = data.value();
      first_mask = mask.value();
      EXPECT_GT(summary.value().documents, 10000);
    } else {
      EXPECT_TRUE(data.value() == first) << jobs << " threads";
      EXPECT_TRUE(mask.value() == first_mask) << jobs << " threads";
    }
  }
}

}  // namespace
}  // namespace strata::text
