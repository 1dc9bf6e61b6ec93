// tokenizer.json normalizers.
#include <string>

#include "src/text/hf_components.h"
#include "src/text/regex.h"
#include "src/text/unicode.h"
#include "strata/core/check.h"

namespace strata::text::hf {

Status unknown_type(const Json& json, const std::string& key, std::string_view what,
                    std::string_view implemented) {
  const std::string type = json.contains("type") && json["type"].is_string()
                               ? json["type"].get<std::string>()
                               : json.dump().substr(0, 80);
  return invalid_argument(
      key + ": " + std::string(what) + " \"" + type +
      "\" is not implemented by Strata (implemented: " + std::string(implemented) + ")");
}

Result<std::string> string_field(const Json& json, const std::string& key, const char* field) {
  if (!json.is_object() || !json.contains(field) || !json[field].is_string()) {
    return invalid_argument(key + "." + field + ": expected a string");
  }
  return json[field].get<std::string>();
}

bool bool_field(const Json& json, const char* field, bool fallback) {
  return json.is_object() && json.contains(field) && json[field].is_boolean()
             ? json[field].get<bool>()
             : fallback;
}

namespace {

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> parts)
      : parts_(std::move(parts)) {}
  void normalize(std::string* text) const override {
    for (const auto& part : parts_) part->normalize(text);
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

class UnicodeNormalizer final : public Normalizer {
 public:
  explicit UnicodeNormalizer(NormalForm form) : form_(form) {}
  void normalize(std::string* text) const override { *text = text::normalize(*text, form_); }

 private:
  NormalForm form_;
};

class LowercaseNormalizer final : public Normalizer {
 public:
  void normalize(std::string* text) const override { *text = lowercase(*text); }
};

class StripNormalizer final : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  void normalize(std::string* text) const override {
    std::size_t begin = 0;
    std::size_t end = text->size();
    if (left_) {
      while (begin < end) {
        std::size_t next = begin;
        if (!is_whitespace(next_char(*text, &next))) break;
        begin = next;
      }
    }
    if (right_) {
      while (end > begin) {
        std::size_t start = end - 1;
        while (start > begin && ((*text)[start] & 0xC0) == 0x80) --start;
        std::size_t probe = start;
        if (!is_whitespace(next_char(*text, &probe))) break;
        end = start;
      }
    }
    *text = text->substr(begin, end - begin);
  }

 private:
  bool left_, right_;
};

class StripAccentsNormalizer final : public Normalizer {
 public:
  void normalize(std::string* text) const override {
    std::string out;
    out.reserve(text->size());
    std::size_t pos = 0;
    while (pos < text->size()) {
      const char32_t c = next_char(*text, &pos);
      if (is_mark(c)) continue;
      append_utf8(&out, c);
    }
    *text = std::move(out);
  }
};

class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(Regex pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void normalize(std::string* text) const override {
    std::vector<std::pair<std::size_t, std::size_t>> matches;
    pattern_.find_all(*text, &matches);
    if (matches.empty()) return;
    std::string out;
    out.reserve(text->size());
    std::size_t prev = 0;
    for (const auto& [begin, end] : matches) {
      out.append(*text, prev, begin - prev);
      out += content_;
      prev = end;
    }
    out.append(*text, prev, std::string::npos);
    *text = std::move(out);
  }

 private:
  Regex pattern_;
  std::string content_;
};

class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prefix) : prefix_(std::move(prefix)) {}
  void normalize(std::string* text) const override {
    if (!text->empty()) text->insert(0, prefix_);
  }

 private:
  std::string prefix_;
};

class BertNormalizer final : public Normalizer {
 public:
  BertNormalizer(bool clean_text, bool chinese, bool strip_accents, bool lower)
      : clean_text_(clean_text), chinese_(chinese), strip_accents_(strip_accents), lower_(lower) {}
  void normalize(std::string* text) const override {
    std::string out;
    out.reserve(text->size());
    std::size_t pos = 0;
    while (pos < text->size()) {
      const char32_t c = next_char(*text, &pos);
      if (clean_text_) {
        if (c == 0 || c == 0xFFFD || is_bert_control(c)) continue;
        if (is_whitespace(c)) {
          out += ' ';
          continue;
        }
      }
      if (chinese_ && is_cjk(c)) {
        out += ' ';
        append_utf8(&out, c);
        out += ' ';
        continue;
      }
      append_utf8(&out, c);
    }
    if (strip_accents_) {  // BERT's: nonspacing marks (Mn) only
      out = text::normalize(out, NormalForm::kNfd);
      std::string kept;
      kept.reserve(out.size());
      std::size_t pos = 0;
      while (pos < out.size()) {
        const char32_t c = next_char(out, &pos);
        if (!is_nonspacing_mark(c)) append_utf8(&kept, c);
      }
      out = std::move(kept);
    }
    if (lower_) out = lowercase(out);
    *text = std::move(out);
  }

 private:
  bool clean_text_, chinese_, strip_accents_, lower_;
};

class ByteLevelNormalizer final : public Normalizer {
 public:
  void normalize(std::string* text) const override {
    std::string out;
    out.reserve(text->size() * 2);
    for (const char c : *text) append_utf8(&out, byte_to_char()[static_cast<unsigned char>(c)]);
    *text = std::move(out);
  }
};

}  // namespace

Result<Regex> parse_pattern(const Json& json, const std::string& key) {
  if (json.is_object() && json.contains("String") && json["String"].is_string()) {
    return Regex::literal(json["String"].get<std::string>());
  }
  if (json.is_object() && json.contains("Regex") && json["Regex"].is_string()) {
    auto regex = Regex::compile(json["Regex"].get<std::string>());
    if (!regex) return regex.status().with_context(key);
    return regex;
  }
  return invalid_argument(key + ": expected {\"String\": ...} or {\"Regex\": ...}");
}

Result<std::unique_ptr<Normalizer>> parse_normalizer(const Json& json, const std::string& key) {
  static constexpr std::string_view kImplemented =
      "Sequence, NFC, NFD, NFKC, NFKD, Lowercase, Strip, StripAccents, Replace, Prepend, "
      "BertNormalizer, ByteLevel";
  auto type = string_field(json, key, "type");
  if (!type) return type.status();
  const std::string& t = type.value();
  if (t == "Sequence") {
    if (!json.contains("normalizers") || !json["normalizers"].is_array()) {
      return invalid_argument(key + ".normalizers: expected an array");
    }
    std::vector<std::unique_ptr<Normalizer>> parts;
    for (std::size_t i = 0; i < json["normalizers"].size(); ++i) {
      auto part =
          parse_normalizer(json["normalizers"][i], key + ".normalizers[" + std::to_string(i) + "]");
      if (!part) return part.status();
      parts.push_back(std::move(part).value());
    }
    return std::unique_ptr<Normalizer>(new SequenceNormalizer(std::move(parts)));
  }
  if (t == "NFC") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNfc));
  if (t == "NFD") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNfd));
  if (t == "NFKC") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNfkc));
  if (t == "NFKD") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormalForm::kNfkd));
  if (t == "Lowercase") return std::unique_ptr<Normalizer>(new LowercaseNormalizer());
  if (t == "Strip") {
    return std::unique_ptr<Normalizer>(new StripNormalizer(bool_field(json, "strip_left", true),
                                                           bool_field(json, "strip_right", true)));
  }
  if (t == "StripAccents") return std::unique_ptr<Normalizer>(new StripAccentsNormalizer());
  if (t == "Replace") {
    auto pattern = parse_pattern(json.value("pattern", Json()), key + ".pattern");
    if (!pattern) return pattern.status();
    auto content = string_field(json, key, "content");
    if (!content) return content.status();
    return std::unique_ptr<Normalizer>(
        new ReplaceNormalizer(std::move(pattern).value(), std::move(content).value()));
  }
  if (t == "Prepend") {
    auto prepend = string_field(json, key, "prepend");
    if (!prepend) return prepend.status();
    return std::unique_ptr<Normalizer>(new PrependNormalizer(std::move(prepend).value()));
  }
  if (t == "BertNormalizer") {
    const bool lower = bool_field(json, "lowercase", true);
    const bool strip = json.contains("strip_accents") && json["strip_accents"].is_boolean()
                           ? json["strip_accents"].get<bool>()
                           : lower;  // null: follows lowercase
    return std::unique_ptr<Normalizer>(
        new BertNormalizer(bool_field(json, "clean_text", true),
                           bool_field(json, "handle_chinese_chars", true), strip, lower));
  }
  if (t == "ByteLevel") return std::unique_ptr<Normalizer>(new ByteLevelNormalizer());
  return unknown_type(json, key, "normalizer", kImplemented);
}

}  // namespace strata::text::hf
