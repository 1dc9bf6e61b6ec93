// Memory-mapped token files (raw u16/u32, llm.c .bin, raw text) and the seeded window sampler.
#include "strata/train/data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <limits>
#include <numeric>
#include <utility>

#include "strata/core/logging.h"
#include "strata/core/rng.h"
#include "strata/core/token_files.h"
#include "strata/core/unique_fd.h"

namespace strata::train {
namespace {

// llm.c's dev/data/data_common.py: 256 int32 header words, then the tokens. GPT-2 files: magic
// 20240520, version 1, uint16 tokens (version 2: uint32, as earlier Strata wrote); Llama 3
// files: magic 20240801, version 7, uint32 tokens.
constexpr std::int32_t kLlmcMagic = 20240520;
constexpr std::int32_t kLlmcMagicLlama3 = 20240801;
constexpr std::size_t kLlmcHeaderBytes = 256 * sizeof(std::int32_t);

std::int32_t load_le_i32(const std::uint8_t* p) {
  return static_cast<std::int32_t>(std::uint32_t{p[0]} | std::uint32_t{p[1]} << 8 |
                                   std::uint32_t{p[2]} << 16 | std::uint32_t{p[3]} << 24);
}

Status bad_mask(const TokenDataset& mask, std::int64_t index, std::uint32_t value) {
  return data_loss("loss mask " + mask.path() + ": entry " + std::to_string(index) + " is " +
                   std::to_string(value) + ", expected 0 or 1; is this a mask file?");
}

std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

std::string_view token_format_name(TokenFormat format) {
  switch (format) {
    case TokenFormat::kU16:
      return "u16";
    case TokenFormat::kU32:
      return "u32";
    case TokenFormat::kLlmc:
      return "llmc";
    case TokenFormat::kText:
      return "text";
    case TokenFormat::kAuto:
      return "auto";
  }
  return "?";
}

Result<TokenFormat> resolve_token_format(const std::string& path, TokenFormat format,
                                         const std::string& key) {
  if (format != TokenFormat::kAuto) return format;
  // The name first: raw tokens may begin with the magic's bytes by chance.
  const std::string ext = std::filesystem::path(path).extension().string();
  if (ext == ".u16") return TokenFormat::kU16;
  if (ext == ".u32") return TokenFormat::kU32;
  if (ext == ".txt" || ext == ".text" || ext == ".md") return TokenFormat::kText;
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return errno_status(errno, "cannot open token file", path);
  std::uint8_t head[4] = {};
  if (::pread(fd.get(), head, sizeof(head), 0) == static_cast<ssize_t>(sizeof(head))) {
    const std::int32_t magic = load_le_i32(head);
    if (magic == kLlmcMagic || magic == kLlmcMagicLlama3) return TokenFormat::kLlmc;
  }
  return invalid_argument(
      "'" + key + ".format' is \"auto\", but " + path + " has no llm.c header and its name (" +
      (ext.empty() ? std::string("no extension") : "\"" + ext + "\"") +
      ") does not say what it holds; set " + key + ".format to u16, u32, llmc or text");
}

Result<std::shared_ptr<TokenDataset>> TokenDataset::open(const std::string& path,
                                                         TokenFormat format,
                                                         const std::string& key) {
  STRATA_ASSIGN_OR_RETURN(format, resolve_token_format(path, format, key));
  const bool llmc = format == TokenFormat::kLlmc;
  int token_bytes = format == TokenFormat::kU16    ? 2
                    : format == TokenFormat::kU32  ? 4
                    : format == TokenFormat::kText ? 1
                                                   : 0;  // llmc: from its header

  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return errno_status(errno, "cannot open token file", path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return errno_status(errno, "cannot stat token file", path);
  if (!S_ISREG(st.st_mode))
    return invalid_argument("token file " + path + " is not a regular file");
  const auto file_bytes = static_cast<std::uint64_t>(st.st_size);
  if (file_bytes == 0) return data_loss("token file " + path + " is empty");

  std::uint64_t header_bytes = 0;
  if (llmc) {
    if (file_bytes < kLlmcHeaderBytes) {
      return data_loss("token file " + path + " is " + std::to_string(file_bytes) +
                       " bytes, smaller than the 1024-byte llm.c header");
    }
    header_bytes = kLlmcHeaderBytes;
  } else if (file_bytes % static_cast<std::uint64_t>(token_bytes) != 0) {
    return data_loss("token file " + path + " is " + std::to_string(file_bytes) +
                     " bytes, not a multiple of the " + std::to_string(token_bytes) + "-byte " +
                     std::string(token_format_name(format)) +
                     " token size; is the format right (u16, u32, llmc, text)?");
  }

  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (map == MAP_FAILED) return errno_status(errno, "cannot mmap token file", path);
  // From here the dataset owns the mapping, so every early return unmaps it.
  std::shared_ptr<TokenDataset> ds(new TokenDataset());
  ds->path_ = path;
  ds->format_ = format;
  ds->map_ = map;
  ds->map_bytes_ = file_bytes;
  const auto* bytes = static_cast<const std::uint8_t*>(map);

  if (llmc) {
    const std::int32_t magic = load_le_i32(bytes);
    const std::int32_t version = load_le_i32(bytes + 4);
    const std::int32_t count = load_le_i32(bytes + 8);
    if (magic != kLlmcMagic && magic != kLlmcMagicLlama3) {
      return data_loss("token file " + path + ": llm.c header magic is " + std::to_string(magic) +
                       ", expected " + std::to_string(kLlmcMagic) + " or " +
                       std::to_string(kLlmcMagicLlama3) +
                       "; is this a raw token array (use format u16 or u32)?");
    }
    if (magic == kLlmcMagic ? (version != 1 && version != 2) : version != 7) {
      return data_loss(
          "token file " + path + ": llm.c header version is " + std::to_string(version) +
          ", expected " +
          (magic == kLlmcMagic ? "1 (uint16 tokens) or 2 (uint32 tokens)" : "7 (uint32 tokens)"));
    }
    token_bytes = magic == kLlmcMagic && version == 1 ? 2 : 4;
    const std::uint64_t payload = file_bytes - kLlmcHeaderBytes;
    if (count < 0 || static_cast<std::uint64_t>(count) * token_bytes != payload) {
      return data_loss("token file " + path + ": llm.c header says " + std::to_string(count) +
                       " tokens (" +
                       std::to_string(static_cast<std::int64_t>(count) * token_bytes) +
                       " bytes), but the file has " + std::to_string(payload) +
                       " bytes after the header; the file is truncated or corrupt");
    }
    if (count == 0) return data_loss("token file " + path + " contains no tokens");
  }
  ds->token_bytes_ = token_bytes;
  ds->tokens_ = bytes + header_bytes;
  ds->num_tokens_ = static_cast<std::int64_t>((file_bytes - header_bytes) /
                                              static_cast<std::uint64_t>(token_bytes));
  return ds;
}

TokenDataset::~TokenDataset() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

std::uint32_t TokenDataset::token(std::int64_t i) const {
  STRATA_CHECK(i >= 0 && i < num_tokens_, "token index out of range", i, num_tokens_, path_);
  const std::uint8_t* p = tokens_ + static_cast<std::size_t>(i) * token_bytes_;
  switch (token_bytes_) {
    case 1:
      return p[0];
    case 2:
      return std::uint32_t{p[0]} | std::uint32_t{p[1]} << 8;
    default:
      return std::uint32_t{p[0]} | std::uint32_t{p[1]} << 8 | std::uint32_t{p[2]} << 16 |
             std::uint32_t{p[3]} << 24;
  }
}

SequenceSampler::SequenceSampler(std::shared_ptr<TokenDataset> dataset, std::int64_t seq_len,
                                 std::uint64_t seed)
    : dataset_(std::move(dataset)), seq_len_(seq_len), seed_(seed) {
  STRATA_CHECK(dataset_ != nullptr, "SequenceSampler needs a dataset");
  num_windows_ = seq_len_ > 0 ? (dataset_->num_tokens() - 1) / seq_len_ : 0;
}

Status SequenceSampler::check(const TokenDataset& dataset, std::int64_t seq_len) {
  if (seq_len <= 0) {
    return invalid_argument("sequence length must be positive, got " + std::to_string(seq_len));
  }
  if (dataset.num_tokens() < seq_len + 1) {
    return invalid_argument(
        "token file " + dataset.path() + " has " + std::to_string(dataset.num_tokens()) +
        " tokens, fewer than the seq_len + 1 = " + std::to_string(seq_len + 1) +
        " needed for one training sequence; use more data or a shorter seq_len");
  }
  const std::int64_t windows = (dataset.num_tokens() - 1) / seq_len;
  if (windows > std::int64_t{std::numeric_limits<std::uint32_t>::max()}) {
    return invalid_argument(
        "token file " + dataset.path() + " splits into " + std::to_string(windows) +
        " sequences of " + std::to_string(seq_len) +
        " tokens, more than the sampler's limit of 2^32 - 1; use a longer seq_len");
  }
  return Status::ok();
}

const std::vector<std::uint32_t>& SequenceSampler::epoch_order(std::int64_t epoch) {
  if (epoch == cached_epoch_) return order_;
  order_.resize(static_cast<std::size_t>(num_windows_));
  std::iota(order_.begin(), order_.end(), 0u);
  Rng rng(mix64(mix64(seed_) + static_cast<std::uint64_t>(epoch)));
  for (std::size_t i = order_.size(); i > 1; --i) {
    const std::size_t j = rng.uniform_int(i);
    std::swap(order_[i - 1], order_[j]);
  }
  cached_epoch_ = epoch;
  return order_;
}

Status SequenceSampler::sequence(std::int64_t g, std::int64_t vocab_size, std::int32_t* inputs,
                                 std::int32_t* targets) {
  STRATA_CHECK(g >= 0, "negative sequence number", g);
  STRATA_CHECK(vocab_size > 0 && vocab_size <= std::numeric_limits<std::int32_t>::max(),
               "vocab_size out of range", vocab_size);
  STRATA_RETURN_IF_ERROR(check(*dataset_, seq_len_));
  const std::int64_t start = window_start(g);
  for (std::int64_t i = 0; i <= seq_len_; ++i) {
    const std::uint32_t t = dataset_->token(start + i);
    if (t >= static_cast<std::uint64_t>(vocab_size)) {
      return invalid_argument("token file " + dataset_->path() + ": token at index " +
                              std::to_string(start + i) + " is " + std::to_string(t) +
                              ", not below the model's vocab_size " + std::to_string(vocab_size) +
                              "; was the data tokenized for a different vocabulary?");
    }
    if (i < seq_len_) inputs[i] = static_cast<std::int32_t>(t);
    if (i > 0) targets[i - 1] = static_cast<std::int32_t>(t);
  }
  if (mask_) {
    for (std::int64_t i = 1; i <= seq_len_; ++i) {
      const std::uint32_t m = mask_->token(start + i);
      if (m > 1) return bad_mask(*mask_, start + i, m);
      if (m == 0) targets[i - 1] = -1;
    }
  }
  return Status::ok();
}

std::int64_t SequenceSampler::window_start(std::int64_t g) {
  const std::vector<std::uint32_t>& order = epoch_order(g / num_windows_);
  return std::int64_t{order[static_cast<std::size_t>(g % num_windows_)]} * seq_len_;
}

Status SequenceSampler::set_mask(std::shared_ptr<TokenDataset> mask) {
  if (mask && mask->num_tokens() != dataset_->num_tokens()) {
    return invalid_argument("loss mask " + mask->path() + " has " +
                            std::to_string(mask->num_tokens()) + " entries but token file " +
                            dataset_->path() + " has " + std::to_string(dataset_->num_tokens()) +
                            " tokens; tokenize the data again (strata tokenize writes both)");
  }
  mask_ = std::move(mask);
  return Status::ok();
}

Result<std::int64_t> SequenceSampler::count_targets(std::int64_t g) {
  if (!mask_) return seq_len_;
  STRATA_RETURN_IF_ERROR(check(*dataset_, seq_len_));
  const std::int64_t start = window_start(g);
  std::int64_t n = 0;
  for (std::int64_t i = 1; i <= seq_len_; ++i) {
    const std::uint32_t m = mask_->token(start + i);
    if (m > 1) return bad_mask(*mask_, start + i, m);
    n += m;
  }
  return n;
}

Status attach_loss_mask(const std::string& token_path, TokenFormat format,
                        SequenceSampler* sampler) {
  const std::string path = loss_mask_path(token_path);
  std::error_code ec;
  if (format == TokenFormat::kText || !std::filesystem::exists(path, ec)) return Status::ok();
  STRATA_ASSIGN_OR_RETURN(auto mask, TokenDataset::open(path, TokenFormat::kText));
  STRATA_RETURN_IF_ERROR(sampler->set_mask(std::move(mask)));
  log_info("loss mask " + path + ": the loss counts only the targets it marks");
  return Status::ok();
}

}  // namespace strata::train
