// Token files in every format, their error messages, and the seeded sequence sampler.
#include "strata/train/data.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "tests/testing/temp_dir.h"

namespace strata::train {
namespace {

namespace fs = std::filesystem;

using testing::TempDir;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

void append_le(std::string* s, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

std::string token_bytes(const std::vector<std::uint32_t>& tokens, int width) {
  std::string s;
  for (auto t : tokens) append_le(&s, t, width);
  return s;
}

std::string llmc_bytes(std::int32_t magic, std::int32_t version, std::int32_t count,
                       const std::vector<std::uint32_t>& tokens, int width) {
  std::string s;
  std::vector<std::int32_t> header(256, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = count;
  for (auto h : header) append_le(&s, static_cast<std::uint32_t>(h), 4);
  return s + token_bytes(tokens, width);
}

void expect_error(const Result<std::shared_ptr<TokenDataset>>& r, StatusCode code,
                  const std::string& path, const std::string& needle) {
  ASSERT_FALSE(r.is_ok()) << "expected an error mentioning: " << needle;
  EXPECT_EQ(r.status().code(), code) << r.status().to_string();
  EXPECT_NE(r.status().message().find(path), std::string::npos) << r.status().message();
  EXPECT_NE(r.status().message().find(needle), std::string::npos)
      << "message: " << r.status().message() << "\nexpected to contain: " << needle;
}

TEST(TokenDataset, ReadsRawU16AndU32) {
  TempDir dir;
  write_bytes(dir.file("a.u16"), token_bytes({1, 2, 65535, 300}, 2));
  auto u16 = TokenDataset::open(dir.file("a.u16"), TokenFormat::kU16);
  ASSERT_TRUE(u16.is_ok()) << u16.status().to_string();
  ASSERT_EQ((*u16)->num_tokens(), 4);
  EXPECT_EQ((*u16)->token(0), 1u);
  EXPECT_EQ((*u16)->token(2), 65535u);
  EXPECT_EQ((*u16)->token(3), 300u);
  EXPECT_EQ((*u16)->path(), dir.file("a.u16"));

  write_bytes(dir.file("a.u32"), token_bytes({70000, 0, 4000000000u}, 4));
  auto u32 = TokenDataset::open(dir.file("a.u32"), TokenFormat::kU32);
  ASSERT_TRUE(u32.is_ok()) << u32.status().to_string();
  ASSERT_EQ((*u32)->num_tokens(), 3);
  EXPECT_EQ((*u32)->token(0), 70000u);
  EXPECT_EQ((*u32)->token(2), 4000000000u);
}

TEST(TokenDataset, ReadsTextAsBytes) {
  TempDir dir;
  write_bytes(dir.file("t.txt"), "hi\n\xff");
  auto ds = TokenDataset::open(dir.file("t.txt"), TokenFormat::kText);
  ASSERT_TRUE(ds.is_ok()) << ds.status().to_string();
  ASSERT_EQ((*ds)->num_tokens(), 4);
  EXPECT_EQ((*ds)->token(0), static_cast<std::uint32_t>('h'));
  EXPECT_EQ((*ds)->token(2), static_cast<std::uint32_t>('\n'));
  EXPECT_EQ((*ds)->token(3), 255u);
}

TEST(TokenDataset, ReadsLlmcVersions) {
  TempDir dir;
  write_bytes(dir.file("v1.bin"), llmc_bytes(20240520, 1, 3, {50256, 7, 9}, 2));
  auto v1 = TokenDataset::open(dir.file("v1.bin"), TokenFormat::kLlmc);
  ASSERT_TRUE(v1.is_ok()) << v1.status().to_string();
  ASSERT_EQ((*v1)->num_tokens(), 3);
  EXPECT_EQ((*v1)->token(0), 50256u);
  EXPECT_EQ((*v1)->token(2), 9u);

  write_bytes(dir.file("v2.bin"), llmc_bytes(20240520, 2, 2, {128000, 5}, 4));
  auto v2 = TokenDataset::open(dir.file("v2.bin"), TokenFormat::kLlmc);
  ASSERT_TRUE(v2.is_ok()) << v2.status().to_string();
  ASSERT_EQ((*v2)->num_tokens(), 2);
  EXPECT_EQ((*v2)->token(0), 128000u);
  EXPECT_EQ((*v2)->token(1), 5u);
}

// format "auto" (the default): llm.c's header magic under any name; else the extension
// (.u16/.u32 as strata tokenize writes them, .txt/.text/.md as text); a file it cannot tell
// (raw tokens in a .bin, no extension) is refused, naming the file and the key to set.
TEST(TokenDataset, AutoTellsTheFormatByHeaderOrNameAndRefusesTheRest) {
  TempDir dir;
  write_bytes(dir.file("a.u16"), token_bytes({1, 2, 300}, 2));
  write_bytes(dir.file("a.u32"), token_bytes({70000, 5}, 4));
  write_bytes(dir.file("t.md"), "# hi");
  write_bytes(dir.file("v3.bin"), llmc_bytes(20240801, 7, 2, {128000, 5}, 4));
  write_bytes(dir.file("shard"), llmc_bytes(20240520, 1, 2, {50256, 7}, 2));
  const std::pair<const char*, TokenFormat> cases[] = {{"a.u16", TokenFormat::kU16},
                                                       {"a.u32", TokenFormat::kU32},
                                                       {"t.md", TokenFormat::kText},
                                                       {"v3.bin", TokenFormat::kLlmc},
                                                       {"shard", TokenFormat::kLlmc}};
  for (const auto& [name, want] : cases) {
    SCOPED_TRACE(name);
    auto ds = TokenDataset::open(dir.file(name), TokenFormat::kAuto);
    ASSERT_TRUE(ds.is_ok()) << ds.status().to_string();
    EXPECT_EQ((*ds)->format(), want);
  }
  auto u16 = TokenDataset::open(dir.file("a.u16"), TokenFormat::kAuto);
  EXPECT_EQ((*u16)->token(2), 300u);
  write_bytes(dir.file("raw.bin"), token_bytes({1, 2, 3, 4}, 2));
  write_bytes(dir.file("raw"), token_bytes({1, 2, 3, 4}, 2));
  for (const char* name : {"raw.bin", "raw"}) {
    auto ds = TokenDataset::open(dir.file(name), TokenFormat::kAuto, "eval_data");
    ASSERT_FALSE(ds.is_ok()) << name;
    const std::string& m = ds.status().message();
    EXPECT_NE(m.find(dir.file(name)), std::string::npos) << m;
    EXPECT_NE(m.find("set eval_data.format to u16, u32, llmc or text"), std::string::npos) << m;
  }
}

TEST(TokenDataset, FileErrorsNameTheFile) {
  TempDir dir;
  expect_error(TokenDataset::open(dir.file("missing.bin"), TokenFormat::kU16),
               StatusCode::kNotFound, dir.file("missing.bin"), "cannot open token file");
  write_bytes(dir.file("empty.bin"), "");
  expect_error(TokenDataset::open(dir.file("empty.bin"), TokenFormat::kU16), StatusCode::kDataLoss,
               dir.file("empty.bin"), "is empty");
  write_bytes(dir.file("odd.bin"), "abc");
  expect_error(TokenDataset::open(dir.file("odd.bin"), TokenFormat::kU16), StatusCode::kDataLoss,
               dir.file("odd.bin"), "3 bytes, not a multiple of the 2-byte u16 token size");
  write_bytes(dir.file("six.bin"), "abcdef");
  expect_error(TokenDataset::open(dir.file("six.bin"), TokenFormat::kU32), StatusCode::kDataLoss,
               dir.file("six.bin"), "not a multiple of the 4-byte u32 token size");
}

TEST(TokenDataset, LlmcHeaderErrors) {
  TempDir dir;
  const std::string p = dir.file("x.bin");
  write_bytes(p, std::string(100, '\0'));
  expect_error(TokenDataset::open(p, TokenFormat::kLlmc), StatusCode::kDataLoss, p,
               "100 bytes, smaller than the 1024-byte llm.c header");
  write_bytes(p, llmc_bytes(20240519, 1, 2, {1, 2}, 2));
  expect_error(TokenDataset::open(p, TokenFormat::kLlmc), StatusCode::kDataLoss, p,
               "magic is 20240519, expected 20240520");
  write_bytes(p, llmc_bytes(20240520, 3, 2, {1, 2}, 2));
  expect_error(TokenDataset::open(p, TokenFormat::kLlmc), StatusCode::kDataLoss, p,
               "version is 3, expected 1 (uint16 tokens) or 2 (uint32 tokens)");
  write_bytes(p, llmc_bytes(20240520, 1, 3, {1, 2}, 2));
  expect_error(TokenDataset::open(p, TokenFormat::kLlmc), StatusCode::kDataLoss, p,
               "header says 3 tokens (6 bytes), but the file has 4 bytes after the header");
  write_bytes(p, llmc_bytes(20240520, 2, 2, {1, 2}, 2));  // v2 wants 4-byte tokens
  expect_error(TokenDataset::open(p, TokenFormat::kLlmc), StatusCode::kDataLoss, p,
               "header says 2 tokens (8 bytes)");
  write_bytes(p, llmc_bytes(20240520, 1, -1, {}, 2));
  expect_error(TokenDataset::open(p, TokenFormat::kLlmc), StatusCode::kDataLoss, p,
               "header says -1 tokens");
  write_bytes(p, llmc_bytes(20240520, 1, 0, {}, 2));
  expect_error(TokenDataset::open(p, TokenFormat::kLlmc), StatusCode::kDataLoss, p,
               "contains no tokens");
}

// A u32 dataset whose token i is i, so a window is identified by its first token.
std::shared_ptr<TokenDataset> identity_dataset(const TempDir& dir, std::uint32_t n) {
  std::vector<std::uint32_t> tokens(n);
  for (std::uint32_t i = 0; i < n; ++i) tokens[i] = i;
  const std::string p = dir.file("identity.u32");
  write_bytes(p, token_bytes(tokens, 4));
  auto ds = TokenDataset::open(p, TokenFormat::kU32);
  STRATA_CHECK(ds.is_ok(), ds.status().to_string());
  return *ds;
}

TEST(SequenceSampler, WindowsCoverEveryWindowOncePerEpoch) {
  TempDir dir;
  constexpr std::int64_t kSeqLen = 8;
  auto ds = identity_dataset(dir, 8 * 37 + 5);  // 37 windows and a tail too short for another
  ASSERT_TRUE(SequenceSampler::check(*ds, kSeqLen).is_ok());
  SequenceSampler sampler(ds, kSeqLen, 1234);
  ASSERT_EQ(sampler.num_windows(), 37);
  std::vector<std::int32_t> in(kSeqLen), tgt(kSeqLen);
  std::vector<std::vector<std::int32_t>> epoch_starts(3);
  for (std::int64_t g = 0; g < 3 * 37; ++g) {
    ASSERT_TRUE(sampler.sequence(g, 1 << 20, in.data(), tgt.data()).is_ok());
    const std::int32_t start = in[0];
    ASSERT_EQ(start % kSeqLen, 0);
    for (std::int64_t i = 0; i < kSeqLen; ++i) {
      ASSERT_EQ(in[i], start + i);
      ASSERT_EQ(tgt[i], start + i + 1);
    }
    epoch_starts[g / 37].push_back(start / kSeqLen);
  }
  for (auto& starts : epoch_starts) {
    std::vector<std::int32_t> sorted = starts;
    std::sort(sorted.begin(), sorted.end());
    for (std::int32_t w = 0; w < 37; ++w) ASSERT_EQ(sorted[w], w);
  }
  EXPECT_NE(epoch_starts[0], epoch_starts[1]);  // reshuffled every epoch
  EXPECT_NE(epoch_starts[1], epoch_starts[2]);
}

std::vector<std::int32_t> first_tokens(SequenceSampler& s, const std::vector<std::int64_t>& gs,
                                       std::int64_t seq_len) {
  std::vector<std::int32_t> in(seq_len), tgt(seq_len), out;
  for (auto g : gs) {
    const Status st = s.sequence(g, 1 << 20, in.data(), tgt.data());
    STRATA_CHECK(st.is_ok(), st.to_string());
    out.push_back(in[0]);
  }
  return out;
}

TEST(SequenceSampler, DeterministicInSeedAndSequenceNumber) {
  TempDir dir;
  auto ds = identity_dataset(dir, 4 * 50 + 1);
  std::vector<std::int64_t> all(150);
  for (std::int64_t g = 0; g < 150; ++g) all[g] = g;
  SequenceSampler a(ds, 4, 99), b(ds, 4, 99), c(ds, 4, 100);
  const auto seq_a = first_tokens(a, all, 4);
  EXPECT_EQ(seq_a, first_tokens(b, all, 4));
  EXPECT_NE(seq_a, first_tokens(c, all, 4));

  // Visiting out of order, across epochs and back, gives the same sequences.
  const std::vector<std::int64_t> jumps = {149, 3, 77, 0, 120, 50, 49};
  SequenceSampler d(ds, 4, 99);
  const auto seq_d = first_tokens(d, jumps, 4);
  for (std::size_t i = 0; i < jumps.size(); ++i) EXPECT_EQ(seq_d[i], seq_a[jumps[i]]) << jumps[i];
}

TEST(SequenceSampler, ExactlyOneWindow) {
  TempDir dir;
  auto ds = identity_dataset(dir, 9);
  SequenceSampler s(ds, 8, 5);
  EXPECT_EQ(s.num_windows(), 1);
  std::vector<std::int32_t> in(8), tgt(8);
  ASSERT_TRUE(s.sequence(3, 100, in.data(), tgt.data()).is_ok());
  EXPECT_EQ(in[0], 0);
  EXPECT_EQ(tgt[7], 8);
}

TEST(SequenceSampler, DatasetShorterThanOneSequence) {
  TempDir dir;
  auto ds = identity_dataset(dir, 8);
  const Status s = SequenceSampler::check(*ds, 8);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find(ds->path()), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("has 8 tokens, fewer than the seq_len + 1 = 9"), std::string::npos)
      << s.message();
  SequenceSampler sampler(ds, 8, 1);  // constructing is fine; using it reports the same error
  EXPECT_EQ(sampler.num_windows(), 0);
  std::vector<std::int32_t> in(8), tgt(8);
  const Status seq = sampler.sequence(0, 100, in.data(), tgt.data());
  EXPECT_EQ(seq.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(seq.message(), s.message());
  EXPECT_EQ(SequenceSampler::check(*ds, 0).code(), StatusCode::kInvalidArgument);
}

TEST(SequenceSampler, TokenOutsideVocabularyNamesFileIndexAndValue) {
  TempDir dir;
  const std::string p = dir.file("bad.u16");
  write_bytes(p, token_bytes({1, 2, 3, 4, 900, 5, 6, 7, 8}, 2));
  auto ds = TokenDataset::open(p, TokenFormat::kU16);
  ASSERT_TRUE(ds.is_ok());
  SequenceSampler s(*ds, 8, 0);
  std::vector<std::int32_t> in(8), tgt(8);
  const Status st = s.sequence(0, 512, in.data(), tgt.data());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find(p), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("token at index 4 is 900, not below the model's vocab_size 512"),
            std::string::npos)
      << st.message();
  EXPECT_TRUE(s.sequence(0, 901, in.data(), tgt.data()).is_ok());
}

}  // namespace
}  // namespace strata::train
