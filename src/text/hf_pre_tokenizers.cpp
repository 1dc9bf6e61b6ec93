// tokenizer.json pre-tokenizers.
#include <functional>
#include <string>

#include "src/text/hf_components.h"
#include "src/text/regex.h"
#include "src/text/unicode.h"

namespace strata::text::hf {
namespace {

// A span of a piece and whether the pattern matched it.
struct Span {
  std::size_t begin, end;
  bool match;
};

enum class Behavior : std::uint8_t {
  kRemoved,
  kIsolated,
  kMergedWithPrevious,
  kMergedWithNext,
  kContiguous
};

using Finder = std::function<void(std::string_view, std::vector<Span>*)>;

// Spans of `text` from a regex's matches, gaps included (Hugging Face's Pattern for a regex).
void regex_spans(const Regex& regex, std::string_view text, std::vector<Span>* spans) {
  thread_local std::vector<std::pair<std::size_t, std::size_t>> matches;
  matches.clear();
  regex.find_all(text, &matches);
  std::size_t prev = 0;
  for (const auto& [begin, end] : matches) {
    if (prev != begin) spans->push_back({prev, begin, false});
    spans->push_back({begin, end, true});
    prev = end;
  }
  if (prev != text.size()) spans->push_back({prev, text.size(), false});
}

// Spans from a character predicate: each matching character alone, the runs between merged.
void char_spans(const std::function<bool(char32_t)>& pred, std::string_view text,
                std::vector<Span>* spans) {
  std::size_t last = 0;
  std::size_t pos = 0;
  while (pos < text.size()) {
    const std::size_t begin = pos;
    const char32_t c = next_char(text, &pos);
    if (!pred(c)) continue;
    if (last < begin) spans->push_back({last, begin, false});
    spans->push_back({begin, pos, true});
    last = pos;
  }
  if (pos > last) spans->push_back({last, pos, false});
}

// Hugging Face's NormalizedString::split: applies the behavior to the spans and appends the
// kept, non-empty slices of `piece` to *out.
void split_piece(const Piece& piece, const Finder& find, Behavior behavior, bool invert,
                 std::vector<Piece>* out) {
  if (piece.text.empty()) return;
  thread_local std::vector<Span> spans;
  spans.clear();
  find(piece.text, &spans);
  if (invert) {
    for (auto& s : spans) s.match = !s.match;
  }
  // `match` below means "remove".
  std::vector<Span> kept;
  kept.reserve(spans.size());
  switch (behavior) {
    case Behavior::kRemoved:
      kept = spans;
      break;
    case Behavior::kIsolated:
      for (const auto& s : spans) kept.push_back({s.begin, s.end, false});
      break;
    case Behavior::kContiguous: {
      bool previous = false;
      for (const auto& s : spans) {
        if (s.match == previous && !kept.empty()) {
          kept.back().end = s.end;
        } else {
          kept.push_back({s.begin, s.end, false});
        }
        previous = s.match;
      }
      break;
    }
    case Behavior::kMergedWithPrevious: {
      bool previous = false;
      for (const auto& s : spans) {
        if (s.match && !previous && !kept.empty()) {
          kept.back().end = s.end;
        } else {
          kept.push_back({s.begin, s.end, false});
        }
        previous = s.match;
      }
      break;
    }
    case Behavior::kMergedWithNext: {
      bool previous = false;
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->match && !previous && !kept.empty()) {
          kept.back().begin = it->begin;
        } else {
          kept.push_back({it->begin, it->end, false});
        }
        previous = it->match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    }
  }
  for (const auto& s : kept) {
    if (s.match || s.begin == s.end) continue;
    out->push_back({piece.text.substr(s.begin, s.end - s.begin), piece.at_start && s.begin == 0});
  }
}

void split_all(std::vector<Piece>* pieces, const Finder& find, Behavior behavior, bool invert) {
  std::vector<Piece> out;
  out.reserve(pieces->size() * 2);
  for (const auto& piece : *pieces) split_piece(piece, find, behavior, invert, &out);
  *pieces = std::move(out);
}

class SequencePreTokenizer final : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> parts)
      : parts_(std::move(parts)) {}
  void split(std::vector<Piece>* pieces) const override {
    for (const auto& part : parts_) part->split(pieces);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(Regex regex, Behavior behavior, bool invert)
      : regex_(std::move(regex)), behavior_(behavior), invert_(invert) {}
  void split(std::vector<Piece>* pieces) const override {
    split_all(
        pieces, [this](std::string_view t, std::vector<Span>* s) { regex_spans(regex_, t, s); },
        behavior_, invert_);
  }

 private:
  Regex regex_;
  Behavior behavior_;
  bool invert_;
};

class CharSplitPreTokenizer final : public PreTokenizer {
 public:
  CharSplitPreTokenizer(std::function<bool(char32_t)> pred, Behavior behavior)
      : pred_(std::move(pred)), behavior_(behavior) {}
  void split(std::vector<Piece>* pieces) const override {
    split_all(
        pieces, [this](std::string_view t, std::vector<Span>* s) { char_spans(pred_, t, s); },
        behavior_, false);
  }

 private:
  std::function<bool(char32_t)> pred_;
  Behavior behavior_;
};

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, bool use_regex)
      : add_prefix_space_(add_prefix_space), use_regex_(use_regex) {}
  void split(std::vector<Piece>* pieces) const override {
    static const Regex kGpt2 =
        Regex::compile(
            R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)")
            .value();
    if (add_prefix_space_) {
      for (auto& piece : *pieces) {
        if (!piece.text.empty() && piece.text[0] != ' ') piece.text.insert(0, " ");
      }
    }
    if (use_regex_) {
      split_all(
          pieces, [](std::string_view t, std::vector<Span>* s) { regex_spans(kGpt2, t, s); },
          Behavior::kIsolated, false);
    }
    const auto& table = byte_to_char();
    for (auto& piece : *pieces) {
      std::string mapped;
      mapped.reserve(piece.text.size() * 2);
      for (const char c : piece.text) append_utf8(&mapped, table[static_cast<unsigned char>(c)]);
      piece.text = std::move(mapped);
    }
  }

 private:
  bool add_prefix_space_, use_regex_;
};

enum class PrependScheme : std::uint8_t { kAlways, kFirst, kNever };

class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  MetaspacePreTokenizer(std::string replacement, PrependScheme scheme, bool split)
      : replacement_(std::move(replacement)), scheme_(scheme), split_(split) {}
  void split(std::vector<Piece>* pieces) const override {
    for (auto& piece : *pieces) {
      std::string replaced;
      replaced.reserve(piece.text.size() + 8);
      for (const char c : piece.text) {
        if (c == ' ') {
          replaced += replacement_;
        } else {
          replaced += c;
        }
      }
      const bool starts = replaced.compare(0, replacement_.size(), replacement_) == 0;
      if (!starts && !replaced.empty() &&
          (scheme_ == PrependScheme::kAlways ||
           (scheme_ == PrependScheme::kFirst && piece.at_start))) {
        replaced.insert(0, replacement_);
      }
      piece.text = std::move(replaced);
    }
    if (split_) {
      const char32_t rep = [this] {
        std::size_t pos = 0;
        return next_char(replacement_, &pos);
      }();
      split_all(
          pieces,
          [rep](std::string_view t, std::vector<Span>* s) {
            char_spans([rep](char32_t c) { return c == rep; }, t, s);
          },
          Behavior::kMergedWithNext, false);
    }
  }

 private:
  std::string replacement_;
  PrependScheme scheme_;
  bool split_;
};

Result<Behavior> parse_behavior(const Json& json, const std::string& key, Behavior fallback) {
  if (!json.contains("behavior")) return fallback;
  const std::string b = json["behavior"].is_string() ? json["behavior"].get<std::string>() : "";
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  return invalid_argument(key +
                          ".behavior: expected Removed, Isolated, MergedWithPrevious, "
                          "MergedWithNext or Contiguous, got " +
                          json["behavior"].dump());
}

bool flag(const Json& json, const char* field, bool fallback) {
  return json.contains(field) && json[field].is_boolean() ? json[field].get<bool>() : fallback;
}

bool is_ascii_punctuation(char32_t c) {
  return (c >= '!' && c <= '/') || (c >= ':' && c <= '@') || (c >= '[' && c <= '`') ||
         (c >= '{' && c <= '~');
}

}  // namespace

Result<std::unique_ptr<PreTokenizer>> parse_pre_tokenizer(const Json& json,
                                                          const std::string& key) {
  static constexpr std::string_view kImplemented =
      "Sequence, Split, ByteLevel, Metaspace, Whitespace, WhitespaceSplit, Digits, Punctuation, "
      "BertPreTokenizer, CharDelimiterSplit";
  auto type = string_field(json, key, "type");
  if (!type) return type.status();
  const std::string& t = type.value();
  using Ptr = std::unique_ptr<PreTokenizer>;
  if (t == "Sequence") {
    if (!json.contains("pretokenizers") || !json["pretokenizers"].is_array()) {
      return invalid_argument(key + ".pretokenizers: expected an array");
    }
    std::vector<Ptr> parts;
    for (std::size_t i = 0; i < json["pretokenizers"].size(); ++i) {
      auto part = parse_pre_tokenizer(json["pretokenizers"][i],
                                      key + ".pretokenizers[" + std::to_string(i) + "]");
      if (!part) return part.status();
      parts.push_back(std::move(part).value());
    }
    return Ptr(new SequencePreTokenizer(std::move(parts)));
  }
  if (t == "Split") {
    auto pattern = parse_pattern(json.value("pattern", Json()), key + ".pattern");
    if (!pattern) return pattern.status();
    auto behavior = parse_behavior(json, key, Behavior::kIsolated);
    if (!behavior) return behavior.status();
    return Ptr(new SplitPreTokenizer(std::move(pattern).value(), behavior.value(),
                                     flag(json, "invert", false)));
  }
  if (t == "ByteLevel") {
    return Ptr(new ByteLevelPreTokenizer(flag(json, "add_prefix_space", true),
                                         flag(json, "use_regex", true)));
  }
  if (t == "Metaspace") {
    std::string replacement = "\xE2\x96\x81";  // U+2581
    if (json.contains("replacement") && json["replacement"].is_string()) {
      replacement = json["replacement"].get<std::string>();
    }
    if (replacement.empty() ||
        utf8_length(static_cast<unsigned char>(replacement[0])) != replacement.size()) {
      return invalid_argument(key + ".replacement: expected one character, got \"" + replacement +
                              "\"");
    }
    PrependScheme scheme = PrependScheme::kAlways;
    if (json.contains("prepend_scheme") && json["prepend_scheme"].is_string()) {
      const std::string s = json["prepend_scheme"].get<std::string>();
      if (s == "always") {
        scheme = PrependScheme::kAlways;
      } else if (s == "first") {
        scheme = PrependScheme::kFirst;
      } else if (s == "never") {
        scheme = PrependScheme::kNever;
      } else {
        return invalid_argument(key + ".prepend_scheme: expected always, first or never, got \"" +
                                s + "\"");
      }
    } else if (!flag(json, "add_prefix_space", true)) {
      scheme = PrependScheme::kNever;  // the older form of the same setting
    }
    return Ptr(
        new MetaspacePreTokenizer(std::move(replacement), scheme, flag(json, "split", true)));
  }
  if (t == "Whitespace") {
    auto regex = Regex::compile(R"(\w+|[^\w\s]+)");
    return Ptr(new SplitPreTokenizer(std::move(regex).value(), Behavior::kRemoved, true));
  }
  if (t == "WhitespaceSplit") {
    return Ptr(new CharSplitPreTokenizer(is_whitespace, Behavior::kRemoved));
  }
  if (t == "Digits") {
    const bool individual = flag(json, "individual_digits", false);
    return Ptr(new CharSplitPreTokenizer([](char32_t c) { return c >= '0' && c <= '9'; },
                                         individual ? Behavior::kIsolated : Behavior::kContiguous));
  }
  if (t == "Punctuation") {
    auto behavior = parse_behavior(json, key, Behavior::kIsolated);
    if (!behavior) return behavior.status();
    return Ptr(new CharSplitPreTokenizer(
        [](char32_t c) { return is_ascii_punctuation(c) || is_punctuation(c); }, behavior.value()));
  }
  if (t == "BertPreTokenizer") {
    std::vector<Ptr> parts;
    parts.push_back(Ptr(new CharSplitPreTokenizer(is_whitespace, Behavior::kRemoved)));
    parts.push_back(Ptr(new CharSplitPreTokenizer(
        [](char32_t c) { return is_ascii_punctuation(c) || is_punctuation(c); },
        Behavior::kIsolated)));
    return Ptr(new SequencePreTokenizer(std::move(parts)));
  }
  if (t == "CharDelimiterSplit") {
    auto delimiter = string_field(json, key, "delimiter");
    if (!delimiter) return delimiter.status();
    const std::string d = std::move(delimiter).value();
    std::size_t pos = 0;
    if (d.empty() || (next_char(d, &pos), pos != d.size())) {
      return invalid_argument(key + ".delimiter: expected one character, got \"" + d + "\"");
    }
    pos = 0;
    const char32_t c = next_char(d, &pos);
    return Ptr(new CharSplitPreTokenizer([c](char32_t x) { return x == c; }, Behavior::kRemoved));
  }
  return unknown_type(json, key, "pre-tokenizer", kImplemented);
}

}  // namespace strata::text::hf
