// `strata tokenize`: a oneTBB pipeline. One thread reads the inputs into batches of records
// (in order), every core tokenizes batches, and one thread writes them out in input order.
#include "strata/text/tokenize_job.h"

#include <oneapi/tbb/parallel_pipeline.h>
#include <oneapi/tbb/task_arena.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>

#include "src/text/unicode.h"
#include "strata/core/file.h"
#include "strata/core/json.h"
#include "strata/core/token_files.h"
#include "strata/text/chat_template.h"

namespace strata::text {
namespace fs = std::filesystem;

namespace {

// llm.c's headers (dev/data/data_common.py): GPT-2's u16 files, Llama 3's u32 files.
constexpr std::int32_t kLlmcMagicU16 = 20240520, kLlmcVersionU16 = 1;
constexpr std::int32_t kLlmcMagicU32 = 20240801, kLlmcVersionU32 = 7;
constexpr std::size_t kLlmcHeaderWords = 256;
constexpr std::size_t kBatchBytes = 256 * 1024;  // of input per batch

struct Record {
  std::int64_t line = 0;  // 0: a whole .txt file
  std::string text;
};

struct Batch {
  std::size_t file = 0;
  std::vector<Record> records;
  std::int64_t bytes = 0;
  // Filled by the tokenizing stage.
  std::vector<std::int32_t> ids;
  std::vector<std::uint8_t> mask;
  std::int64_t documents = 0;
  std::int64_t supervised = 0;
  std::int64_t boundary_merges = 0;
  Status error;
};

// What every batch needs to encode records; read-only while the pipeline runs.
struct Encoder {
  const Tokenizer& tok;
  const TokenizeOptions& options;
  std::optional<std::int32_t> eos;   // appended after each document
  bool template_eos = false;         // the post-processor already ends sequences with it
  std::size_t special_suffix = 0;    // tokens the post-processor appends (EOS, [SEP])
  std::optional<ChatTemplate> chat;  // recognised up front when the tokenizer has one
  Status chat_error;                 // why not, for the first messages record

  // Ids of `text`; mask `train` for all of them.
  void plain(std::string_view text, Batch* b) const {
    tok.encode(text, true, &b->ids);
    if (eos && !template_eos) b->ids.push_back(*eos);
    b->mask.resize(b->ids.size(), 1);
  }

  // Appends the ids of `full` (encoded with `add_special`) and marks [from, to) of each train
  // range, where each range's bounds are the token counts of `full`'s prefixes.
  void supervised(const std::string& full, bool add_special,
                  const std::vector<std::pair<std::size_t, std::size_t>>& train_chars,
                  bool eos_trains, Batch* b) const {
    std::vector<std::int32_t> ids;
    tok.encode(full, add_special, &ids);
    std::vector<std::uint8_t> mask(ids.size(), 0);
    std::vector<std::int32_t> prefix;
    auto boundary = [&](std::size_t chars) -> std::size_t {
      if (chars >= full.size()) return ids.size();
      prefix.clear();
      tok.encode(std::string_view(full).substr(0, chars), add_special, &prefix);
      // What the post-processor appends to the prefix is not part of the whole text's start.
      if (add_special) prefix.resize(prefix.size() - std::min(prefix.size(), special_suffix));
      std::size_t n = 0;
      while (n < prefix.size() && n < ids.size() && prefix[n] == ids[n]) ++n;
      if (n != prefix.size()) ++b->boundary_merges;
      return n;
    };
    for (const auto& [begin, end] : train_chars) {
      const std::size_t from = boundary(begin);
      const std::size_t to = boundary(end);
      for (std::size_t i = from; i < to; ++i) mask[i] = 1;
    }
    if (template_eos && eos && !ids.empty() && ids.back() == *eos) mask.back() = 1;
    b->ids.insert(b->ids.end(), ids.begin(), ids.end());
    b->mask.insert(b->mask.end(), mask.begin(), mask.end());
    if (eos && !(!ids.empty() && ids.back() == *eos)) {
      b->ids.push_back(*eos);
      b->mask.push_back(eos_trains ? 1 : 0);
    }
  }

  Status record(const std::string& file, const Record& r, Batch* b) const {
    auto where = [&] { return file + ":" + std::to_string(r.line); };
    if (r.line == 0) {
      if (const std::size_t bad = find_invalid_utf8(r.text); bad != std::string_view::npos) {
        return invalid_argument(file + ": not UTF-8 text (invalid byte at offset " +
                                std::to_string(bad) + ")");
      }
      plain(r.text, b);
      ++b->documents;
      return Status::ok();
    }
    Json j;
    try {
      j = Json::parse(r.text);
    } catch (const Json::exception& e) {  // parse_error, or out_of_range for 1e999
      return invalid_argument(where() + ": not a JSON object (" + std::string(e.what()) + ")");
    }
    if (!j.is_object())
      return invalid_argument(where() + ": expected a JSON object, got " + j.dump().substr(0, 60));
    ++b->documents;
    if (j.contains("messages")) {
      const Json& m = j["messages"];
      if (!m.is_array() || m.empty()) {
        return invalid_argument(where() +
                                ": \"messages\" must be a non-empty array of "
                                "{\"role\", \"content\"}");
      }
      std::vector<ChatMessage> messages;
      for (std::size_t i = 0; i < m.size(); ++i) {
        if (!m[i].is_object() || !m[i].contains("role") || !m[i]["role"].is_string() ||
            !m[i].contains("content") || !m[i]["content"].is_string()) {
          return invalid_argument(where() + ": messages[" + std::to_string(i) +
                                  "]: expected {\"role\": string, \"content\": string}");
        }
        messages.push_back({m[i]["role"].get<std::string>(), m[i]["content"].get<std::string>()});
      }
      if (std::none_of(messages.begin(), messages.end(),
                       [](const ChatMessage& x) { return x.role == "assistant"; })) {
        return invalid_argument(where() + ": no assistant message, so nothing to train on");
      }
      if (!chat) return chat_error.with_context(where());
      auto parts = chat->render(messages);
      if (!parts) return parts.status().with_context(where());
      std::string full;
      std::vector<std::pair<std::size_t, std::size_t>> train;
      for (const ChatPart& p : parts.value()) {
        if (p.train) train.emplace_back(full.size(), full.size() + p.text.size());
        full += p.text;
      }
      supervised(full, false, train, false, b);
      ++b->supervised;
      return Status::ok();
    }
    if (j.contains("prompt") || j.contains("completion")) {
      if (!j.contains("prompt") || !j["prompt"].is_string() || !j.contains("completion") ||
          !j["completion"].is_string()) {
        return invalid_argument(where() +
                                ": a supervised record needs both \"prompt\" and "
                                "\"completion\" as strings");
      }
      const std::string prompt = j["prompt"].get<std::string>();
      const std::string full = prompt + j["completion"].get<std::string>();
      supervised(full, true, {{prompt.size(), full.size()}}, true, b);
      ++b->supervised;
      return Status::ok();
    }
    if (!j.contains(options.field)) {
      return invalid_argument(where() + ": no \"" + options.field +
                              "\" field (set --field, or give \"prompt\"/\"completion\" or "
                              "\"messages\")");
    }
    if (!j[options.field].is_string()) {
      return invalid_argument(where() + ": \"" + options.field + "\" must be a string");
    }
    plain(j[options.field].get<std::string>(), b);
    return Status::ok();
  }
};

// Reads the inputs in order, a batch at a time.
class Reader {
 public:
  explicit Reader(const std::vector<std::string>& inputs) : inputs_(inputs) {}

  // nullptr at the end; an error batch when a file cannot be read.
  std::unique_ptr<Batch> next() {
    while (file_ < inputs_.size()) {
      const std::string& path = inputs_[file_];
      auto batch = std::make_unique<Batch>();
      batch->file = file_;
      if (path.ends_with(".txt")) {
        auto text = read_file(path);
        ++file_;
        if (!text) {
          batch->error = text.status();
          return batch;
        }
        batch->bytes = static_cast<std::int64_t>(text.value().size());
        batch->records.push_back({0, std::move(text).value()});
        return batch;
      }
      if (!in_.is_open()) {
        in_.open(path, std::ios::binary);
        line_ = 0;
        if (!in_) {
          batch->error = errno_status(errno, "cannot open", path);
          ++file_;
          return batch;
        }
      }
      std::string line;
      while (batch->bytes < static_cast<std::int64_t>(kBatchBytes) && std::getline(in_, line)) {
        ++line_;
        batch->bytes += static_cast<std::int64_t>(line.size()) + 1;
        if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank line
        batch->records.push_back({line_, std::move(line)});
      }
      if (in_.bad()) {
        batch->error = errno_status(errno, "cannot read", path);
        in_.close();
        ++file_;
        return batch;
      }
      if (in_.eof()) {
        in_.close();
        ++file_;
      }
      if (!batch->records.empty() || batch->bytes > 0) return batch;
    }
    return nullptr;
  }

 private:
  const std::vector<std::string>& inputs_;
  std::size_t file_ = 0;
  std::ifstream in_;
  std::int64_t line_ = 0;
};

Status check_inputs(const TokenizeOptions& options) {
  if (options.inputs.empty()) return invalid_argument("no --input files");
  if (options.output.empty()) return invalid_argument("no --output file");
  std::error_code ec;
  for (const auto& in : options.inputs) {
    if (!in.ends_with(".txt") && !in.ends_with(".jsonl")) {
      return invalid_argument("--input " + in +
                              ": expected a .txt file (one document) or a .jsonl file (one "
                              "record per line)");
    }
    if (!fs::is_regular_file(in, ec)) return not_found("--input " + in + ": no such file");
    if (fs::exists(options.output, ec) && fs::equivalent(in, options.output, ec)) {
      return invalid_argument("--output " + options.output + " is also an input");
    }
  }
  return Status::ok();
}

}  // namespace

Result<TokenizeSummary> tokenize_files(const Tokenizer& tok, const TokenizeOptions& options) {
  if (Status s = check_inputs(options); !s) return s;
  const std::int64_t vocab = tok.vocab_size();
  const bool fits_u16 = vocab <= 65536;
  TokenizeSummary summary;
  summary.format = options.format.value_or(fits_u16 ? OutputFormat::kU16 : OutputFormat::kU32);
  if (summary.format == OutputFormat::kU16 && !fits_u16) {
    return invalid_argument("--format u16 cannot hold the vocabulary of " + std::to_string(vocab) +
                            " tokens (ids up to 65535); use u32 or llmc");
  }
  const int token_bytes =
      summary.format == OutputFormat::kU32 || (summary.format == OutputFormat::kLlmc && !fits_u16)
          ? 4
          : 2;

  Encoder enc{tok,          options,     options.eos ? tok.eos_id() : std::nullopt, false, 0,
              std::nullopt, Status::ok()};
  {
    // The post-processor's special tokens around a text: those after it end every encoding.
    const auto with = tok.encode("a", true), without = tok.encode("a", false);
    std::size_t at = 0;
    while (at + without.size() <= with.size() &&
           !std::equal(without.begin(), without.end(),
                       with.begin() + static_cast<std::ptrdiff_t>(at))) {
      ++at;
    }
    enc.special_suffix = at + without.size() <= with.size() ? with.size() - at - without.size() : 0;
    enc.template_eos = enc.eos && enc.special_suffix > 0 && with.back() == *enc.eos;
  }
  if (tok.chat_template().empty()) {
    enc.chat_error = invalid_argument(
        "a \"messages\" record needs a chat template: pass the model directory (with "
        "tokenizer_config.json's chat_template) as --tokenizer");
  } else {
    const std::string bos = tok.bos_id() ? tok.id_to_token(*tok.bos_id()) : "";
    const std::string eos = tok.eos_id() ? tok.id_to_token(*tok.eos_id()) : "";
    auto chat = ChatTemplate::recognize(tok.chat_template(), bos, eos);
    if (chat) {
      enc.chat = std::move(chat).value();
      summary.chat_template = enc.chat->name();
    } else {
      enc.chat_error = chat.status();
    }
  }

  auto out = AtomicFileWriter::create(options.output);
  if (!out) return out.status();
  AtomicFileWriter writer = std::move(out).value();
  const std::string mask_path = loss_mask_path(options.output);
  // Made at the first supervised record; the tokens before it all train.
  std::optional<AtomicFileWriter> mask_writer;
  auto open_mask = [&]() -> Status {
    auto created = AtomicFileWriter::create(mask_path);
    if (!created) return created.status();
    mask_writer.emplace(std::move(created).value());
    const std::vector<std::uint8_t> ones(std::size_t{1} << 20, 1);
    for (std::int64_t left = summary.tokens; left > 0;) {
      const auto n = static_cast<std::size_t>(std::min<std::int64_t>(left, 1 << 20));
      STRATA_RETURN_IF_ERROR(mask_writer->write(std::as_bytes(std::span(ones.data(), n))));
      left -= static_cast<std::int64_t>(n);
    }
    return Status::ok();
  };
  if (summary.format == OutputFormat::kLlmc) {
    std::vector<std::int32_t> header(kLlmcHeaderWords, 0);
    if (Status s = writer.write(std::as_bytes(std::span(header))); !s) return s;
  }

  const int jobs = options.jobs > 0 ? options.jobs : tbb::this_task_arena::max_concurrency();
  const auto start = std::chrono::steady_clock::now();
  auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  double last_progress = 0.0;
  Reader reader(options.inputs);
  std::atomic<bool> stop{false};
  Status error;
  std::vector<std::uint8_t> packed;

  tbb::task_arena arena(jobs);
  arena.execute([&] {
    tbb::parallel_pipeline(
        static_cast<std::size_t>(jobs) * 4,
        tbb::make_filter<void, Batch*>(tbb::filter_mode::serial_in_order,
                                       [&](tbb::flow_control& fc) -> Batch* {
                                         if (stop.load()) {
                                           fc.stop();
                                           return nullptr;
                                         }
                                         auto batch = reader.next();
                                         if (!batch) {
                                           fc.stop();
                                           return nullptr;
                                         }
                                         return batch.release();
                                       }) &
            tbb::make_filter<Batch*, Batch*>(tbb::filter_mode::parallel,
                                             [&](Batch* b) {
                                               if (!b->error) return b;
                                               const std::string& file = options.inputs[b->file];
                                               for (const Record& r : b->records) {
                                                 if (Status s = enc.record(file, r, b); !s) {
                                                   b->error = s;
                                                   break;
                                                 }
                                               }
                                               b->records.clear();
                                               return b;
                                             }) &
            tbb::make_filter<Batch*, void>(tbb::filter_mode::serial_in_order, [&](Batch* raw) {
              std::unique_ptr<Batch> b(raw);
              if (!error.is_ok() || stop.load()) return;
              if (!b->error) {
                error = b->error;
                stop = true;
                return;
              }
              packed.resize(b->ids.size() * static_cast<std::size_t>(token_bytes));
              for (std::size_t i = 0; i < b->ids.size(); ++i) {
                const auto id = static_cast<std::uint32_t>(b->ids[i]);
                for (int k = 0; k < token_bytes; ++k) {
                  packed[i * static_cast<std::size_t>(token_bytes) + static_cast<std::size_t>(k)] =
                      static_cast<std::uint8_t>(id >> (8 * k));
                }
              }
              Status s = writer.write(std::as_bytes(std::span(packed)));
              if (s && !mask_writer && b->supervised > 0) s = open_mask();
              if (s && mask_writer) s = mask_writer->write(std::as_bytes(std::span(b->mask)));
              if (!s) {
                error = s;
                stop = true;
                return;
              }
              summary.documents += b->documents;
              summary.supervised_documents += b->supervised;
              summary.boundary_merges += b->boundary_merges;
              summary.tokens += static_cast<std::int64_t>(b->ids.size());
              for (const std::uint8_t m : b->mask) summary.trained_tokens += m;
              summary.input_bytes += b->bytes;
              const double now = seconds();
              if (options.progress && now - last_progress >= 0.5) {
                options.progress(summary.documents, summary.tokens, now);
                last_progress = now;
              }
            }));
  });
  if (!error) return error;
  if (summary.tokens == 0) {
    return invalid_argument("the inputs hold no text to tokenize (" + options.inputs.front() +
                            (options.inputs.size() > 1 ? ", ..." : "") + ")");
  }
  if (summary.format == OutputFormat::kLlmc) {
    if (summary.tokens > std::numeric_limits<std::int32_t>::max()) {
      return invalid_argument("llm.c files hold at most 2^31-1 tokens; this run made " +
                              std::to_string(summary.tokens) + " (use u16 or u32)");
    }
    const std::int32_t header[3] = {token_bytes == 2 ? kLlmcMagicU16 : kLlmcMagicU32,
                                    token_bytes == 2 ? kLlmcVersionU16 : kLlmcVersionU32,
                                    static_cast<std::int32_t>(summary.tokens)};
    if (Status s = writer.write_at(0, std::as_bytes(std::span(header))); !s) return s;
  }
  // The old mask goes first (it would no longer line up), then the new mask, then the tokens.
  std::error_code ec;
  fs::remove(mask_path, ec);
  if (ec) return io_error("cannot remove the old loss mask " + mask_path + ": " + ec.message());
  if (mask_writer) {
    if (Status s = mask_writer->commit(); !s) return s;
    summary.mask_path = mask_path;
  } else {
    summary.trained_tokens = summary.tokens;
  }
  if (Status s = writer.commit(); !s) return s;
  summary.seconds = seconds();
  if (options.progress) options.progress(summary.documents, summary.tokens, summary.seconds);
  return summary;
}

}  // namespace strata::text
