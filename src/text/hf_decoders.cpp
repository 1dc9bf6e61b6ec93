// tokenizer.json decoders (token strings back to text) and post-processors (special tokens
// around a sequence).
#include <string>

#include "src/text/hf_components.h"
#include "src/text/unicode.h"

namespace strata::text::hf {
namespace {

// Bytes to text as Rust's String::from_utf8_lossy: each maximal invalid sequence becomes U+FFFD.
std::string from_utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  std::size_t i = 0;
  while (i < bytes.size()) {
    const std::size_t bad = find_invalid_utf8(bytes.substr(i));
    if (bad == std::string_view::npos) {
      out.append(bytes.substr(i));
      break;
    }
    out.append(bytes.substr(i, bad));
    i += bad;
    // Skip the longest prefix of a valid sequence (at least one byte), as the WHATWG/Rust rule.
    const auto lead = static_cast<unsigned char>(bytes[i]);
    std::size_t skip = 1;
    const std::size_t need = lead >= 0xC2 && lead <= 0xDF   ? 2
                             : lead >= 0xE0 && lead <= 0xEF ? 3
                             : lead >= 0xF0 && lead <= 0xF4 ? 4
                                                            : 1;
    while (skip < need && i + skip < bytes.size()) {
      const auto c = static_cast<unsigned char>(bytes[i + skip]);
      unsigned char lo = 0x80, hi = 0xBF;
      if (skip == 1) {
        if (lead == 0xE0) lo = 0xA0;
        if (lead == 0xED) hi = 0x9F;
        if (lead == 0xF0) lo = 0x90;
        if (lead == 0xF4) hi = 0x8F;
      }
      if (c < lo || c > hi) break;
      ++skip;
    }
    out += "\xEF\xBF\xBD";
    i += skip;
  }
  return out;
}

class SequenceDecoder final : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> parts)
      : parts_(std::move(parts)) {}
  void decode_chain(std::vector<std::string>* tokens) const override {
    for (const auto& part : parts_) part->decode_chain(tokens);
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
};

class ByteLevelDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>* tokens) const override {
    std::string bytes;
    for (const auto& token : *tokens) {
      std::string mapped;
      bool all = true;
      std::size_t pos = 0;
      while (pos < token.size()) {
        const int b = char_to_byte(next_char(token, &pos));
        if (b < 0) {
          all = false;
          break;
        }
        mapped += static_cast<char>(b);
      }
      bytes += all ? mapped : token;
    }
    *tokens = {from_utf8_lossy(bytes)};
  }
};

class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(std::string replacement, bool strip_first)
      : replacement_(std::move(replacement)), strip_first_(strip_first) {}
  void decode_chain(std::vector<std::string>* tokens) const override {
    for (std::size_t i = 0; i < tokens->size(); ++i) {
      std::string& t = (*tokens)[i];
      std::string out;
      std::size_t pos = 0;
      while (pos < t.size()) {
        if (t.compare(pos, replacement_.size(), replacement_) == 0) {
          if (!(i == 0 && strip_first_)) out += ' ';
          pos += replacement_.size();
        } else {
          out += t[pos++];
        }
      }
      t = std::move(out);
    }
  }

 private:
  std::string replacement_;
  bool strip_first_;
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(Regex pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  void decode_chain(std::vector<std::string>* tokens) const override {
    std::vector<std::pair<std::size_t, std::size_t>> matches;
    for (auto& t : *tokens) {
      matches.clear();
      pattern_.find_all(t, &matches);
      if (matches.empty()) continue;
      std::string out;
      std::size_t prev = 0;
      for (const auto& [b, e] : matches) {
        out.append(t, prev, b - prev);
        out += content_;
        prev = e;
      }
      out.append(t, prev, std::string::npos);
      t = std::move(out);
    }
  }

 private:
  Regex pattern_;
  std::string content_;
};

class ByteFallbackDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>* tokens) const override {
    std::vector<std::string> out;
    std::string pending;
    std::size_t pending_count = 0;
    auto flush = [&] {
      if (pending_count == 0) return;
      if (find_invalid_utf8(pending) == std::string_view::npos) {
        out.push_back(pending);
      } else {
        for (std::size_t i = 0; i < pending_count; ++i) out.emplace_back("\xEF\xBF\xBD");
      }
      pending.clear();
      pending_count = 0;
    };
    for (auto& t : *tokens) {
      if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' &&
          std::isxdigit(static_cast<unsigned char>(t[3])) &&
          std::isxdigit(static_cast<unsigned char>(t[4]))) {
        pending += static_cast<char>(std::stoi(t.substr(3, 2), nullptr, 16));
        ++pending_count;
        continue;
      }
      flush();
      out.push_back(std::move(t));
    }
    flush();
    *tokens = std::move(out);
  }
};

class FuseDecoder final : public Decoder {
 public:
  void decode_chain(std::vector<std::string>* tokens) const override {
    std::string all;
    for (const auto& t : *tokens) all += t;
    *tokens = {all};
  }
};

class StripDecoder final : public Decoder {
 public:
  StripDecoder(std::string content, std::size_t start, std::size_t stop)
      : content_(std::move(content)), start_(start), stop_(stop) {}
  void decode_chain(std::vector<std::string>* tokens) const override {
    for (auto& t : *tokens) {
      std::size_t begin = 0;
      for (std::size_t i = 0; i < start_ && t.compare(begin, content_.size(), content_) == 0; ++i) {
        begin += content_.size();
      }
      std::size_t end = t.size();
      for (std::size_t i = 0; i < stop_ && end >= begin + content_.size() &&
                              t.compare(end - content_.size(), content_.size(), content_) == 0;
           ++i) {
        end -= content_.size();
      }
      t = t.substr(begin, end - begin);
    }
  }

 private:
  std::string content_;
  std::size_t start_, stop_;
};

class BpeSuffixDecoder final : public Decoder {
 public:
  explicit BpeSuffixDecoder(std::string suffix) : suffix_(std::move(suffix)) {}
  void decode_chain(std::vector<std::string>* tokens) const override {
    for (std::size_t i = 0; i < tokens->size(); ++i) {
      std::string& t = (*tokens)[i];
      const std::string with = i + 1 == tokens->size() ? "" : " ";
      std::string out;
      std::size_t pos = 0;
      while (pos < t.size()) {
        if (!suffix_.empty() && t.compare(pos, suffix_.size(), suffix_) == 0) {
          out += with;
          pos += suffix_.size();
        } else {
          out += t[pos++];
        }
      }
      t = std::move(out);
    }
  }

 private:
  std::string suffix_;
};

// TemplateProcessing's single-sequence template as ids: -1 stands for the sequence.
class TemplateProcessor final : public PostProcessor {
 public:
  explicit TemplateProcessor(std::vector<std::int32_t> layout) : layout_(std::move(layout)) {}
  void process(std::vector<std::int32_t>* ids, bool add_special) const override {
    if (!add_special) return;
    std::vector<std::int32_t> out;
    out.reserve(ids->size() + layout_.size());
    for (const std::int32_t id : layout_) {
      if (id == -1) {
        out.insert(out.end(), ids->begin(), ids->end());
      } else {
        out.push_back(id);
      }
    }
    *ids = std::move(out);
  }

 private:
  std::vector<std::int32_t> layout_;
};

class SequenceProcessor final : public PostProcessor {
 public:
  explicit SequenceProcessor(std::vector<std::unique_ptr<PostProcessor>> parts)
      : parts_(std::move(parts)) {}
  void process(std::vector<std::int32_t>* ids, bool add_special) const override {
    for (const auto& part : parts_) part->process(ids, add_special);
  }

 private:
  std::vector<std::unique_ptr<PostProcessor>> parts_;
};

class NoopProcessor final : public PostProcessor {
 public:
  void process(std::vector<std::int32_t>*, bool) const override {}
};

// ["<s>", 0] as Roberta/Bert processors write a special token.
Result<std::int32_t> token_pair_id(const Json& json, const std::string& key) {
  if (!json.is_array() || json.size() != 2 || !json[1].is_number_integer()) {
    return invalid_argument(key + ": expected [token, id], got " + json.dump());
  }
  return json[1].get<std::int32_t>();
}

}  // namespace

Result<std::unique_ptr<Decoder>> parse_decoder(const Json& json, const std::string& key) {
  static constexpr std::string_view kImplemented =
      "Sequence, ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, BPEDecoder";
  auto type = string_field(json, key, "type");
  if (!type) return type.status();
  const std::string& t = type.value();
  using Ptr = std::unique_ptr<Decoder>;
  if (t == "Sequence") {
    if (!json.contains("decoders") || !json["decoders"].is_array()) {
      return invalid_argument(key + ".decoders: expected an array");
    }
    std::vector<Ptr> parts;
    for (std::size_t i = 0; i < json["decoders"].size(); ++i) {
      auto part = parse_decoder(json["decoders"][i], key + ".decoders[" + std::to_string(i) + "]");
      if (!part) return part.status();
      parts.push_back(std::move(part).value());
    }
    return Ptr(new SequenceDecoder(std::move(parts)));
  }
  if (t == "ByteLevel") return Ptr(new ByteLevelDecoder());
  if (t == "Metaspace") {
    std::string replacement = json.contains("replacement") && json["replacement"].is_string()
                                  ? json["replacement"].get<std::string>()
                                  : "\xE2\x96\x81";
    bool strip_first = true;
    if (json.contains("prepend_scheme") && json["prepend_scheme"].is_string()) {
      strip_first = json["prepend_scheme"].get<std::string>() != "never";
    } else if (json.contains("add_prefix_space") && json["add_prefix_space"].is_boolean()) {
      strip_first = json["add_prefix_space"].get<bool>();
    }
    return Ptr(new MetaspaceDecoder(std::move(replacement), strip_first));
  }
  if (t == "Replace") {
    auto pattern = parse_pattern(json.value("pattern", Json()), key + ".pattern");
    if (!pattern) return pattern.status();
    auto content = string_field(json, key, "content");
    if (!content) return content.status();
    return Ptr(new ReplaceDecoder(std::move(pattern).value(), std::move(content).value()));
  }
  if (t == "ByteFallback") return Ptr(new ByteFallbackDecoder());
  if (t == "Fuse") return Ptr(new FuseDecoder());
  if (t == "Strip") {
    auto content = string_field(json, key, "content");
    if (!content) return content.status();
    auto count = [&](const char* field) -> std::size_t {
      return json.contains(field) && json[field].is_number_unsigned()
                 ? json[field].get<std::size_t>()
                 : 0;
    };
    return Ptr(new StripDecoder(std::move(content).value(), count("start"), count("stop")));
  }
  if (t == "BPEDecoder")
    return Ptr(new BpeSuffixDecoder(json.contains("suffix") && json["suffix"].is_string()
                                        ? json["suffix"].get<std::string>()
                                        : std::string("</w>")));
  return unknown_type(json, key, "decoder", kImplemented);
}

Result<std::unique_ptr<PostProcessor>> parse_post_processor(const Json& json,
                                                            const std::string& key) {
  static constexpr std::string_view kImplemented =
      "TemplateProcessing, ByteLevel, RobertaProcessing, BertProcessing, Sequence";
  auto type = string_field(json, key, "type");
  if (!type) return type.status();
  const std::string& t = type.value();
  using Ptr = std::unique_ptr<PostProcessor>;
  if (t == "ByteLevel") return Ptr(new NoopProcessor());
  if (t == "Sequence") {
    if (!json.contains("processors") || !json["processors"].is_array()) {
      return invalid_argument(key + ".processors: expected an array");
    }
    std::vector<Ptr> parts;
    for (std::size_t i = 0; i < json["processors"].size(); ++i) {
      auto part = parse_post_processor(json["processors"][i],
                                       key + ".processors[" + std::to_string(i) + "]");
      if (!part) return part.status();
      parts.push_back(std::move(part).value());
    }
    return Ptr(new SequenceProcessor(std::move(parts)));
  }
  if (t == "RobertaProcessing" || t == "BertProcessing") {
    auto cls = token_pair_id(json.value("cls", Json()), key + ".cls");
    if (!cls) return cls.status();
    auto sep = token_pair_id(json.value("sep", Json()), key + ".sep");
    if (!sep) return sep.status();
    return Ptr(new TemplateProcessor({cls.value(), -1, sep.value()}));
  }
  if (t == "TemplateProcessing") {
    const Json& single = json.contains("single") ? json["single"] : Json();
    const Json& specials =
        json.contains("special_tokens") ? json["special_tokens"] : Json::object();
    if (!single.is_array()) return invalid_argument(key + ".single: expected an array");
    std::vector<std::int32_t> layout;
    for (std::size_t i = 0; i < single.size(); ++i) {
      const Json& piece = single[i];
      const std::string where = key + ".single[" + std::to_string(i) + "]";
      if (piece.contains("Sequence")) {
        layout.push_back(-1);
      } else if (piece.contains("SpecialToken") && piece["SpecialToken"].contains("id") &&
                 piece["SpecialToken"]["id"].is_string()) {
        const std::string name = piece["SpecialToken"]["id"].get<std::string>();
        if (!specials.contains(name) || !specials[name].contains("ids") ||
            !specials[name]["ids"].is_array()) {
          return invalid_argument(where + ": special token \"" + name + "\" is missing from " +
                                  key + ".special_tokens");
        }
        for (const auto& id : specials[name]["ids"]) {
          if (!id.is_number_integer() || id.get<std::int64_t>() < 0 ||
              id.get<std::int64_t>() > kMaxTokenId) {
            return invalid_argument(key + ".special_tokens." + name +
                                    ".ids: expected token ids, got " + id.dump());
          }
          layout.push_back(id.get<std::int32_t>());
        }
      } else {
        return invalid_argument(where +
                                ": expected {\"Sequence\": ...} or {\"SpecialToken\": ...}, got " +
                                piece.dump());
      }
    }
    return Ptr(new TemplateProcessor(std::move(layout)));
  }
  return unknown_type(json, key, "post-processor", kImplemented);
}

}  // namespace strata::text::hf
