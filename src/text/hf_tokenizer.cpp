#include "src/text/hf_tokenizer.h"

#include <algorithm>

#include "src/text/unicode.h"
#include "strata/core/json.h"

namespace strata::text {

namespace {

// Oniguruma's \w, which Hugging Face's single_word check uses: letters, marks, decimal digits
// and connector punctuation.
bool is_word_char(char32_t c) { return is_word(c); }

char32_t last_char(std::string_view s) {
  std::size_t start = s.size() - 1;
  while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
  return next_char(s, &start);
}

}  // namespace

Result<std::unique_ptr<HfTokenizer>> HfTokenizer::load(const std::string& path) {
  auto json = read_json_file(path);
  if (!json) return json.status();
  const Json& root = json.value();
  auto fail = [&](const Status& s) { return s.with_context(path); };
  if (!root.is_object() || !root.contains("model")) {
    return invalid_argument(path + ": not a tokenizer.json (no \"model\" object)");
  }
  std::unique_ptr<HfTokenizer> tok(new HfTokenizer());
  tok->path_ = path;
  if (root.contains("normalizer") && !root["normalizer"].is_null()) {
    auto n = hf::parse_normalizer(root["normalizer"], "normalizer");
    if (!n) return fail(n.status());
    tok->normalizer_ = std::move(n).value();
  }
  if (root.contains("pre_tokenizer") && !root["pre_tokenizer"].is_null()) {
    auto p = hf::parse_pre_tokenizer(root["pre_tokenizer"], "pre_tokenizer");
    if (!p) return fail(p.status());
    tok->pre_tokenizer_ = std::move(p).value();
  }
  auto model = hf::parse_model(root["model"], "model");
  if (!model) return fail(model.status());
  tok->model_ = std::move(model).value();
  if (root.contains("post_processor") && !root["post_processor"].is_null()) {
    auto p = hf::parse_post_processor(root["post_processor"], "post_processor");
    if (!p) return fail(p.status());
    tok->post_processor_ = std::move(p).value();
  }
  if (root.contains("decoder") && !root["decoder"].is_null()) {
    auto d = hf::parse_decoder(root["decoder"], "decoder");
    if (!d) return fail(d.status());
    tok->decoder_ = std::move(d).value();
  }
  tok->vocab_size_ = tok->model_->size();
  if (root.contains("added_tokens")) {
    const Json& added = root["added_tokens"];
    if (!added.is_array()) return fail(invalid_argument("added_tokens: expected an array"));
    for (std::size_t i = 0; i < added.size(); ++i) {
      const Json& a = added[i];
      const std::string key = "added_tokens[" + std::to_string(i) + "]";
      if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() ||
          !a.contains("content") || !a["content"].is_string() ||
          a["content"].get<std::string>().empty()) {
        return fail(
            invalid_argument(key + ": expected {\"id\": int, \"content\": non-empty string, ...}"));
      }
      const std::int64_t id = a["id"].get<std::int64_t>();
      if (id < 0 || id > hf::kMaxTokenId) {
        return fail(invalid_argument(key + ".id: " + std::to_string(id) +
                                     " is not a token id (0 to " + std::to_string(hf::kMaxTokenId) +
                                     ")"));
      }
      AddedToken t;
      t.id = static_cast<std::int32_t>(id);
      t.content = a["content"].get<std::string>();
      t.single_word = hf::bool_field(a, "single_word", false);
      t.lstrip = hf::bool_field(a, "lstrip", false);
      t.rstrip = hf::bool_field(a, "rstrip", false);
      t.normalized = hf::bool_field(a, "normalized", false);
      t.special = hf::bool_field(a, "special", false);
      tok->vocab_size_ = std::max<std::int64_t>(tok->vocab_size_, std::int64_t{t.id} + 1);
      tok->added_by_content_[t.content] = t.id;
      tok->added_.push_back(std::move(t));
    }
  }
  for (std::size_t i = 0; i < tok->added_.size(); ++i) tok->added_by_id_[tok->added_[i].id] = i;
  for (const auto& t : tok->added_) {
    const bool normalized = t.normalized && tok->normalizer_;
    Matcher& m = normalized ? tok->normalized_matcher_ : tok->raw_matcher_;
    std::string text = t.content;
    if (normalized) tok->normalizer_->normalize(&text);
    if (text.empty()) continue;
    m.first_byte[static_cast<unsigned char>(text[0])] = true;
    m.tokens.emplace_back(std::move(text), &t);
  }
  for (Matcher* m : {&tok->raw_matcher_, &tok->normalized_matcher_}) {
    std::stable_sort(m->tokens.begin(), m->tokens.end(),
                     [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  }
  tok->description_ = "tokenizer.json (" + std::string(tok->model_->kind()) + ", " +
                      std::to_string(tok->vocab_size_) + " tokens)";
  return tok;
}

void HfTokenizer::split_added(std::string_view text, const Matcher& matcher,
                              std::vector<Section>* sections) const {
  if (matcher.empty()) {
    sections->push_back({0, text.size(), -1});
    return;
  }
  // All leftmost-longest matches first, as the Aho-Corasick scan finds them.
  struct Match {
    std::size_t begin, end;
    const AddedToken* token;
  };
  std::vector<Match> matches;
  for (std::size_t i = 0; i < text.size();) {
    if (!matcher.first_byte[static_cast<unsigned char>(text[i])]) {
      ++i;
      continue;
    }
    const std::pair<std::string, const AddedToken*>* found = nullptr;
    for (const auto& t : matcher.tokens) {
      if (text.compare(i, t.first.size(), t.first) == 0) {
        found = &t;
        break;
      }
    }
    if (found == nullptr) {
      ++i;
      continue;
    }
    matches.push_back({i, i + found->first.size(), found->second});
    i += found->first.size();
  }
  std::size_t start_offset = 0;
  for (Match m : matches) {
    const AddedToken& t = *m.token;
    if (t.single_word) {
      const bool start_space = m.begin == 0 || !is_word_char(last_char(text.substr(0, m.begin)));
      std::size_t probe = m.end;
      const bool stop_space = m.end == text.size() || !is_word_char(next_char(text, &probe));
      if (!start_space || !stop_space) continue;
    }
    if (t.lstrip) {
      std::size_t left = m.begin;
      while (left > 0) {
        std::size_t start = left - 1;
        while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
        std::size_t probe = start;
        if (!is_whitespace(next_char(text, &probe))) break;
        left = start;
      }
      m.begin = std::max(left, start_offset);
    }
    if (t.rstrip) {
      while (m.end < text.size()) {
        std::size_t probe = m.end;
        if (!is_whitespace(next_char(text, &probe))) break;
        m.end = probe;
      }
    }
    if (start_offset < m.begin) sections->push_back({start_offset, m.begin, -1});
    sections->push_back({m.begin, m.end, t.id});
    start_offset = m.end;
  }
  if (start_offset < text.size()) sections->push_back({start_offset, text.size(), -1});
}

void HfTokenizer::encode_text(std::string_view text, bool at_start,
                              std::vector<std::int32_t>* ids) const {
  std::vector<hf::Piece> pieces;
  pieces.push_back({std::string(text), at_start});
  if (pre_tokenizer_) pre_tokenizer_->split(&pieces);
  for (const auto& piece : pieces) model_->tokenize(piece.text, ids);
}

void HfTokenizer::encode_utf8(std::string_view text, bool add_special_tokens,
                              std::vector<std::int32_t>* out) const {
  std::vector<std::int32_t> ids;
  std::vector<Section> raw;
  split_added(text, raw_matcher_, &raw);
  std::vector<Section> inner;
  for (const Section& s : raw) {
    if (s.id >= 0) {
      ids.push_back(s.id);
      continue;
    }
    std::string normalized(text.substr(s.begin, s.end - s.begin));
    if (normalizer_) normalizer_->normalize(&normalized);
    inner.clear();
    split_added(normalized, normalized_matcher_, &inner);
    for (const Section& n : inner) {
      if (n.id >= 0) {
        ids.push_back(n.id);
      } else if (n.end > n.begin) {
        encode_text(std::string_view(normalized).substr(n.begin, n.end - n.begin),
                    s.begin == 0 && n.begin == 0, &ids);
      }
    }
  }
  if (post_processor_) post_processor_->process(&ids, add_special_tokens);
  out->insert(out->end(), ids.begin(), ids.end());
}

Result<std::string> HfTokenizer::decode(std::span<const std::int32_t> ids,
                                        bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const std::int32_t id : ids) {
    auto added = added_by_id_.find(id);
    if (added != added_by_id_.end()) {
      if (skip_special_tokens && added_[added->second].special) continue;
      tokens.push_back(added_[added->second].content);
      continue;
    }
    const std::string* token = model_->id_to_token(id);
    if (token == nullptr) {
      return invalid_argument("token id " + std::to_string(id) + " is outside " + path_ +
                              "'s vocabulary of " + std::to_string(vocab_size_));
    }
    tokens.push_back(*token);
  }
  if (!decoder_) {
    std::string joined;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      if (i > 0) joined += ' ';
      joined += tokens[i];
    }
    return joined;
  }
  decoder_->decode_chain(&tokens);
  std::string joined;
  for (const auto& t : tokens) joined += t;
  return joined;
}

std::optional<std::int32_t> HfTokenizer::token_to_id(std::string_view token) const {
  auto it = added_by_content_.find(std::string(token));
  if (it != added_by_content_.end()) return it->second;
  return model_->token_to_id(token);
}

std::string HfTokenizer::id_to_token(std::int32_t id) const {
  auto added = added_by_id_.find(id);
  if (added != added_by_id_.end()) return added_[added->second].content;
  const std::string* token = model_->id_to_token(id);
  return token ? *token : std::string();
}

bool HfTokenizer::is_special(std::int32_t id) const {
  auto added = added_by_id_.find(id);
  return added != added_by_id_.end() && added_[added->second].special;
}

void HfTokenizer::set_template(std::optional<std::int32_t> bos, std::optional<std::int32_t> eos) {
  Json single = Json::array();
  Json specials = Json::object();
  auto add_special = [&](std::int32_t id) {
    const std::string name = id_to_token(id);
    single.push_back({{"SpecialToken", {{"id", name}, {"type_id", 0}}}});
    specials[name] = {{"id", name}, {"ids", {id}}, {"tokens", {name}}};
  };
  if (bos) add_special(*bos);
  single.push_back({{"Sequence", {{"id", "A"}, {"type_id", 0}}}});
  if (eos) add_special(*eos);
  auto processor = hf::parse_post_processor(
      {{"type", "TemplateProcessing"}, {"single", single}, {"special_tokens", specials}},
      "post_processor");
  post_processor_ = std::move(processor).value();
}

}  // namespace strata::text
