// tokenizer.json models: BPE (merges by rank, byte fallback) and Unigram (Viterbi over the
// vocabulary's log-probabilities), each with a per-thread cache of pre-tokens already seen.
#include <oneapi/tbb/enumerable_thread_specific.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <limits>
#include <queue>
#include <string>
#include <unordered_map>

#include "src/text/hf_components.h"
#include "src/text/unicode.h"

namespace strata::text::hf {
namespace {

// Per-thread memo of pre-token -> ids, owned by its model (freed with it).
class WordCache {
 public:
  static constexpr std::size_t kMaxEntries = 1 << 17;
  static constexpr std::size_t kMaxWordBytes = 256;

  const std::vector<std::int32_t>* find(std::string_view word) const {
    auto& map = maps_.local();
    auto it = map.find(word);
    return it == map.end() ? nullptr : &it->second;
  }
  void insert(std::string_view word, std::span<const std::int32_t> ids) const {
    if (word.size() > kMaxWordBytes) return;
    auto& map = maps_.local();
    if (map.size() >= kMaxEntries) map.clear();
    map.emplace(std::string(word), std::vector<std::int32_t>(ids.begin(), ids.end()));
  }

 private:
  struct Hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
  };
  using Map = std::unordered_map<std::string, std::vector<std::int32_t>, Hash, std::equal_to<>>;
  mutable tbb::enumerable_thread_specific<Map> maps_;
};

struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>()(s); }
};
using Vocab = std::unordered_map<std::string, std::int32_t, StringHash, std::equal_to<>>;

std::string byte_token(unsigned char b) {
  char buf[8];
  std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
  return buf;
}

// A model's vocabulary both ways: token -> id, and id -> token (ids may have gaps, which name no
// token), with the ids of the byte-fallback tokens <0x00>..<0xFF> (-1 where one is missing).
class TokenTable {
 public:
  explicit TokenTable(Vocab vocab) : vocab_(std::move(vocab)) {
    std::int32_t max_id = -1;
    for (const auto& [token, id] : vocab_) max_id = std::max(max_id, id);
    tokens_.resize(static_cast<std::size_t>(max_id + 1));
    for (const auto& [token, id] : vocab_) tokens_[static_cast<std::size_t>(id)] = token;
    find_bytes();
  }
  // Id i is tokens[i]; a token listed twice keeps its first id.
  explicit TokenTable(std::vector<std::string> tokens) : tokens_(std::move(tokens)) {
    vocab_.reserve(tokens_.size());
    for (std::size_t i = 0; i < tokens_.size(); ++i) {
      vocab_.emplace(tokens_[i], static_cast<std::int32_t>(i));
    }
    find_bytes();
  }

  std::optional<std::int32_t> find(std::string_view token) const {
    auto it = vocab_.find(token);
    if (it == vocab_.end()) return std::nullopt;
    return it->second;
  }
  const std::string* token(std::int32_t id) const {
    if (id < 0 || static_cast<std::size_t>(id) >= tokens_.size()) return nullptr;
    const std::string& t = tokens_[static_cast<std::size_t>(id)];
    return t.empty() ? nullptr : &t;
  }
  std::int64_t size() const { return static_cast<std::int64_t>(tokens_.size()); }
  const Vocab& entries() const { return vocab_; }
  std::int32_t byte_id(unsigned char b) const { return byte_ids_[b]; }

 private:
  void find_bytes() {
    for (int b = 0; b < 256; ++b) {
      byte_ids_[static_cast<std::size_t>(b)] =
          find(byte_token(static_cast<unsigned char>(b))).value_or(-1);
    }
  }
  Vocab vocab_;
  std::vector<std::string> tokens_;
  std::array<std::int32_t, 256> byte_ids_{};
};

class BpeModel final : public Model {
 public:
  struct Options {
    std::optional<std::string> unk_token;
    std::string continuing_subword_prefix;
    std::string end_of_word_suffix;
    bool fuse_unk = false;
    bool byte_fallback = false;
    bool ignore_merges = false;
  };

  BpeModel(Vocab vocab,
           std::unordered_map<std::uint64_t, std::pair<std::int32_t, std::int32_t>> merges,
           Options options)
      : table_(std::move(vocab)), merges_(std::move(merges)), options_(std::move(options)) {
    if (options_.unk_token) unk_id_ = table_.find(*options_.unk_token);
    // Single characters by code point, for the common case without prefix or suffix.
    simple_chars_ =
        options_.continuing_subword_prefix.empty() && options_.end_of_word_suffix.empty();
    if (simple_chars_) {
      char_ids_.assign(kCharTable, -1);
      for (const auto& [token, id] : table_.entries()) {
        std::size_t pos = 0;
        if (token.empty()) continue;
        const char32_t c = next_char(token, &pos);
        if (pos == token.size() && c < kCharTable) char_ids_[c] = id;
      }
    }
  }

  void tokenize(std::string_view word, std::vector<std::int32_t>* ids) const override {
    if (word.empty()) return;
    if (const auto* hit = cache_.find(word)) {
      ids->insert(ids->end(), hit->begin(), hit->end());
      return;
    }
    const std::size_t first = ids->size();
    if (options_.ignore_merges) {
      if (auto id = table_.find(word)) {
        ids->push_back(*id);
        cache_.insert(word, {ids->data() + first, 1});
        return;
      }
    }
    thread_local std::vector<std::int32_t> symbols;
    symbols.clear();
    initial_symbols(word, &symbols);
    merge(&symbols);
    ids->insert(ids->end(), symbols.begin(), symbols.end());
    cache_.insert(word, {ids->data() + first, ids->size() - first});
  }

  std::int64_t size() const override { return table_.size(); }
  const std::string* id_to_token(std::int32_t id) const override { return table_.token(id); }
  std::optional<std::int32_t> token_to_id(std::string_view token) const override {
    return table_.find(token);
  }
  std::string_view kind() const override { return "BPE"; }

 private:
  static constexpr char32_t kCharTable = 0x30000;

  std::optional<std::int32_t> char_id(std::string_view word, std::size_t begin, std::size_t end,
                                      char32_t c) const {
    if (simple_chars_) {
      if (c < kCharTable) {
        const std::int32_t id = char_ids_[c];
        if (id >= 0) return id;
        return std::nullopt;
      }
      return token_to_id(word.substr(begin, end - begin));
    }
    std::string s;
    if (begin > 0) s += options_.continuing_subword_prefix;
    s.append(word.substr(begin, end - begin));
    if (end == word.size()) s += options_.end_of_word_suffix;
    return token_to_id(s);
  }

  void initial_symbols(std::string_view word, std::vector<std::int32_t>* symbols) const {
    bool last_unk = false;
    std::size_t pos = 0;
    while (pos < word.size()) {
      const std::size_t begin = pos;
      const char32_t c = next_char(word, &pos);
      if (auto id = char_id(word, begin, pos, c)) {
        symbols->push_back(*id);
        last_unk = false;
        continue;
      }
      if (options_.byte_fallback) {
        bool all = true;
        for (std::size_t i = begin; i < pos; ++i) {
          all = all && table_.byte_id(static_cast<unsigned char>(word[i])) >= 0;
        }
        if (all) {
          for (std::size_t i = begin; i < pos; ++i) {
            symbols->push_back(table_.byte_id(static_cast<unsigned char>(word[i])));
          }
          last_unk = false;
          continue;
        }
      }
      if (unk_id_) {
        if (!(options_.fuse_unk && last_unk)) symbols->push_back(*unk_id_);
        last_unk = true;
      }
      // Without an unknown token, Hugging Face drops the character.
    }
  }

  std::optional<std::pair<std::int32_t, std::int32_t>> lookup(std::int32_t a,
                                                              std::int32_t b) const {
    auto it = merges_.find((static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) |
                           static_cast<std::uint32_t>(b));
    if (it == merges_.end()) return std::nullopt;
    return it->second;
  }

  // Applies merges lowest rank first, leftmost first among equal ranks.
  void merge(std::vector<std::int32_t>* symbols) const {
    auto& s = *symbols;
    if (s.size() < 2) return;
    if (s.size() <= 48) {
      while (s.size() > 1) {
        std::int32_t best_rank = std::numeric_limits<std::int32_t>::max();
        std::size_t best = 0;
        std::int32_t best_id = -1;
        for (std::size_t i = 0; i + 1 < s.size(); ++i) {
          if (auto m = lookup(s[i], s[i + 1]); m && m->first < best_rank) {
            best_rank = m->first;
            best = i;
            best_id = m->second;
          }
        }
        if (best_id < 0) return;
        s[best] = best_id;
        s.erase(s.begin() + static_cast<std::ptrdiff_t>(best) + 1);
      }
      return;
    }
    // Long words: a linked list and a heap of candidate merges.
    const std::size_t n = s.size();
    std::vector<std::int64_t> prev(n), next(n);
    std::vector<bool> alive(n, true);
    for (std::size_t i = 0; i < n; ++i) {
      prev[i] = static_cast<std::int64_t>(i) - 1;
      next[i] = i + 1 < n ? static_cast<std::int64_t>(i + 1) : -1;
    }
    struct Candidate {
      std::int32_t rank;
      std::size_t pos;
      std::int32_t new_id;
      bool operator>(const Candidate& o) const {
        return rank != o.rank ? rank > o.rank : pos > o.pos;
      }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap;
    for (std::size_t i = 0; i + 1 < n; ++i) {
      if (auto m = lookup(s[i], s[i + 1])) heap.push({m->first, i, m->second});
    }
    while (!heap.empty()) {
      const Candidate top = heap.top();
      heap.pop();
      if (!alive[top.pos] || next[top.pos] < 0) continue;
      const auto right = static_cast<std::size_t>(next[top.pos]);
      auto m = lookup(s[top.pos], s[right]);
      if (!m || m->second != top.new_id || m->first != top.rank) continue;
      s[top.pos] = top.new_id;
      alive[right] = false;
      next[top.pos] = next[right];
      if (next[right] >= 0)
        prev[static_cast<std::size_t>(next[right])] = static_cast<std::int64_t>(top.pos);
      if (prev[top.pos] >= 0) {
        const auto p = static_cast<std::size_t>(prev[top.pos]);
        if (auto pm = lookup(s[p], s[top.pos])) heap.push({pm->first, p, pm->second});
      }
      if (next[top.pos] >= 0) {
        const auto q = static_cast<std::size_t>(next[top.pos]);
        if (auto nm = lookup(s[top.pos], s[q])) heap.push({nm->first, top.pos, nm->second});
      }
    }
    std::vector<std::int32_t> out;
    for (std::int64_t i = 0; i >= 0; i = next[static_cast<std::size_t>(i)]) {
      out.push_back(s[static_cast<std::size_t>(i)]);
    }
    s = std::move(out);
  }

  TokenTable table_;
  std::unordered_map<std::uint64_t, std::pair<std::int32_t, std::int32_t>> merges_;
  Options options_;
  std::optional<std::int32_t> unk_id_;
  bool simple_chars_ = false;
  std::vector<std::int32_t> char_ids_;
  WordCache cache_;
};

// A byte trie over the vocabulary for common-prefix search.
class Trie {
 public:
  void insert(std::string_view key, std::int32_t id) {
    std::int32_t node = 0;
    for (const char c : key) {
      const std::uint64_t k = edge(node, c);
      auto it = edges_.find(k);
      if (it == edges_.end()) {
        ids_.push_back(-1);
        it = edges_.emplace(k, static_cast<std::int32_t>(ids_.size() - 1)).first;
      }
      node = it->second;
    }
    ids_[static_cast<std::size_t>(node)] = id;
  }
  // Calls fn(length, id) for each vocabulary entry that is a prefix of `text`.
  template <typename Fn>
  void prefixes(std::string_view text, Fn fn) const {
    std::int32_t node = 0;
    for (std::size_t i = 0; i < text.size(); ++i) {
      auto it = edges_.find(edge(node, text[i]));
      if (it == edges_.end()) return;
      node = it->second;
      if (ids_[static_cast<std::size_t>(node)] >= 0)
        fn(i + 1, ids_[static_cast<std::size_t>(node)]);
    }
  }

 private:
  static std::uint64_t edge(std::int32_t node, char c) {
    return (static_cast<std::uint64_t>(node) << 8) | static_cast<unsigned char>(c);
  }
  std::unordered_map<std::uint64_t, std::int32_t> edges_;
  std::vector<std::int32_t> ids_{-1};
};

class UnigramModel final : public Model {
 public:
  UnigramModel(std::vector<std::string> pieces, std::vector<double> scores,
               std::optional<std::int32_t> unk_id, bool byte_fallback)
      : table_(std::move(pieces)),
        scores_(std::move(scores)),
        unk_id_(unk_id),
        byte_fallback_(byte_fallback) {
    for (std::int32_t id = 0; id < table_.size(); ++id) {
      if (const std::string* piece = table_.token(id)) trie_.insert(*piece, id);
    }
    const double min_score =
        scores_.empty() ? 0.0 : *std::min_element(scores_.begin(), scores_.end());
    unk_score_ = min_score - 10.0;  // Hugging Face's kUnkPenalty
  }

  void tokenize(std::string_view text, std::vector<std::int32_t>* ids) const override {
    if (text.empty()) return;
    if (const auto* hit = cache_.find(text)) {
      ids->insert(ids->end(), hit->begin(), hit->end());
      return;
    }
    const std::size_t first = ids->size();
    // Best path ending at each byte offset.
    struct Node {
      std::int32_t id = -1;
      double score = 0.0;
      std::int64_t starts_at = -1;
    };
    const std::size_t size = text.size();
    std::vector<Node> best(size + 1);
    std::size_t starts_at = 0;
    while (starts_at < size) {
      const double till_here = best[starts_at].score;
      const std::size_t char_len = utf8_length(static_cast<unsigned char>(text[starts_at]));
      bool has_single = false;
      trie_.prefixes(text.substr(starts_at), [&](std::size_t length, std::int32_t id) {
        Node& target = best[starts_at + length];
        const double candidate = scores_[static_cast<std::size_t>(id)] + till_here;
        if (target.starts_at < 0 || candidate > target.score) {
          target = {id, candidate, static_cast<std::int64_t>(starts_at)};
        }
        if (length == char_len) has_single = true;
      });
      if (!has_single) {
        Node& target = best[starts_at + char_len];
        const double candidate = unk_score_ + till_here;
        if (target.starts_at < 0 || candidate > target.score) {
          target = {unk_id_.value_or(-1), candidate, static_cast<std::int64_t>(starts_at)};
        }
      }
      starts_at += char_len;
    }
    // Walk back; consecutive unknown pieces fuse into one.
    std::vector<std::pair<std::size_t, std::size_t>> spans;  // reversed
    std::size_t ends_at = size;
    std::size_t unk_begin = 0;
    bool in_unk = false;
    std::size_t unk_end = 0;
    while (ends_at > 0) {
      const Node& node = best[ends_at];
      const auto begin = static_cast<std::size_t>(node.starts_at);
      const bool is_unk = unk_id_ && node.id == *unk_id_;
      if (is_unk) {
        if (!in_unk) unk_end = ends_at;
        in_unk = true;
        unk_begin = begin;
      } else {
        if (in_unk) spans.emplace_back(unk_begin, unk_end);
        in_unk = false;
        spans.emplace_back(begin, ends_at);
      }
      ends_at = begin;
    }
    if (in_unk) spans.emplace_back(unk_begin, unk_end);
    for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
      const std::string_view piece = text.substr(it->first, it->second - it->first);
      if (auto found = table_.find(piece)) {
        ids->push_back(*found);
        continue;
      }
      if (byte_fallback_) {
        bool all = true;
        for (const char c : piece) all = all && table_.byte_id(static_cast<unsigned char>(c)) >= 0;
        if (all) {
          for (const char c : piece) ids->push_back(table_.byte_id(static_cast<unsigned char>(c)));
          continue;
        }
      }
      if (unk_id_) ids->push_back(*unk_id_);
    }
    cache_.insert(text, {ids->data() + first, ids->size() - first});
  }

  std::int64_t size() const override { return table_.size(); }
  const std::string* id_to_token(std::int32_t id) const override { return table_.token(id); }
  std::optional<std::int32_t> token_to_id(std::string_view token) const override {
    return table_.find(token);
  }
  std::string_view kind() const override { return "Unigram"; }

 private:
  TokenTable table_;
  std::vector<double> scores_;  // by id
  Trie trie_;
  std::optional<std::int32_t> unk_id_;
  bool byte_fallback_;
  double unk_score_ = 0.0;
  WordCache cache_;
};

class WordLevelModel final : public Model {
 public:
  WordLevelModel(Vocab vocab, std::string unk) : table_(std::move(vocab)), unk_(std::move(unk)) {}
  void tokenize(std::string_view word, std::vector<std::int32_t>* ids) const override {
    auto id = table_.find(word);
    if (!id) id = table_.find(unk_);
    if (id) ids->push_back(*id);
  }
  std::int64_t size() const override { return table_.size(); }
  const std::string* id_to_token(std::int32_t id) const override { return table_.token(id); }
  std::optional<std::int32_t> token_to_id(std::string_view token) const override {
    return table_.find(token);
  }
  std::string_view kind() const override { return "WordLevel"; }

 private:
  TokenTable table_;
  std::string unk_;
};

Result<Vocab> parse_vocab_object(const Json& json, const std::string& key) {
  if (!json.is_object()) return invalid_argument(key + ": expected an object of token: id");
  Vocab vocab;
  vocab.reserve(json.size());
  for (const auto& [token, id] : json.items()) {
    if (!id.is_number_integer() || id.get<std::int64_t>() < 0 ||
        id.get<std::int64_t>() > kMaxTokenId) {
      return invalid_argument(key + "[\"" + token + "\"]: expected a token id from 0 to " +
                              std::to_string(kMaxTokenId) + ", got " + id.dump());
    }
    vocab.emplace(token, id.get<std::int32_t>());
  }
  return vocab;
}

std::optional<std::string> optional_string(const Json& json, const char* field) {
  if (json.contains(field) && json[field].is_string()) return json[field].get<std::string>();
  return std::nullopt;
}

Result<std::unique_ptr<Model>> parse_bpe(const Json& json, const std::string& key) {
  if (json.contains("dropout") && json["dropout"].is_number() &&
      json["dropout"].get<double>() > 0) {
    return invalid_argument(key + ".dropout: BPE dropout (" + json["dropout"].dump() +
                            ") makes encoding random; Strata encodes without it (set it to null)");
  }
  auto vocab = parse_vocab_object(json.value("vocab", Json()), key + ".vocab");
  if (!vocab) return vocab.status();
  BpeModel::Options options;
  options.unk_token = optional_string(json, "unk_token");
  options.continuing_subword_prefix =
      optional_string(json, "continuing_subword_prefix").value_or("");
  options.end_of_word_suffix = optional_string(json, "end_of_word_suffix").value_or("");
  options.fuse_unk = bool_field(json, "fuse_unk", false);
  options.byte_fallback = bool_field(json, "byte_fallback", false);
  options.ignore_merges = bool_field(json, "ignore_merges", false);
  if (options.unk_token && !vocab.value().count(*options.unk_token)) {
    return invalid_argument(key + ".unk_token: \"" + *options.unk_token +
                            "\" is not in the vocabulary");
  }
  const Json& merges = json.contains("merges") ? json["merges"] : Json::array();
  if (!merges.is_array()) return invalid_argument(key + ".merges: expected an array");
  std::unordered_map<std::uint64_t, std::pair<std::int32_t, std::int32_t>> table;
  table.reserve(merges.size());
  const Vocab& v = vocab.value();
  const std::size_t prefix_len = options.continuing_subword_prefix.size();
  for (std::size_t rank = 0; rank < merges.size(); ++rank) {
    const Json& m = merges[rank];
    std::string a, b;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const std::size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        return invalid_argument(key + ".merges[" + std::to_string(rank) +
                                "]: expected \"a b\", got \"" + s + "\"");
      }
      a = s.substr(0, space);
      b = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      return invalid_argument(key + ".merges[" + std::to_string(rank) +
                              "]: expected \"a b\" or [\"a\", \"b\"], got " + m.dump());
    }
    auto ia = v.find(a);
    auto ib = v.find(b);
    const std::string merged =
        a + (b.compare(0, prefix_len, options.continuing_subword_prefix) == 0 ? b.substr(prefix_len)
                                                                              : b);
    auto im = v.find(merged);
    if (ia == v.end() || ib == v.end() || im == v.end()) {
      return invalid_argument(key + ".merges[" + std::to_string(rank) + "]: \"" + a + "\" + \"" +
                              b + "\" names a token missing from the vocabulary");
    }
    // A pair listed twice keeps its last rank, as Hugging Face's map of merges does.
    table.insert_or_assign(
        (static_cast<std::uint64_t>(static_cast<std::uint32_t>(ia->second)) << 32) |
            static_cast<std::uint32_t>(ib->second),
        std::make_pair(static_cast<std::int32_t>(rank), im->second));
  }
  return std::unique_ptr<Model>(new BpeModel(std::move(vocab).value(), std::move(table), options));
}

Result<std::unique_ptr<Model>> parse_unigram(const Json& json, const std::string& key) {
  const Json& vocab = json.contains("vocab") ? json["vocab"] : Json();
  if (!vocab.is_array())
    return invalid_argument(key + ".vocab: expected an array of [piece, score]");
  std::vector<std::string> pieces;
  std::vector<double> scores;
  pieces.reserve(vocab.size());
  scores.reserve(vocab.size());
  for (std::size_t i = 0; i < vocab.size(); ++i) {
    const Json& p = vocab[i];
    if (!p.is_array() || p.size() != 2 || !p[0].is_string() || !p[1].is_number()) {
      return invalid_argument(key + ".vocab[" + std::to_string(i) +
                              "]: expected [piece, score], got " + p.dump());
    }
    pieces.push_back(p[0].get<std::string>());
    scores.push_back(p[1].get<double>());
  }
  std::optional<std::int32_t> unk_id;
  if (json.contains("unk_id") && json["unk_id"].is_number_integer()) {
    const auto id = json["unk_id"].get<std::int64_t>();
    if (id < 0 || id >= static_cast<std::int64_t>(pieces.size())) {
      return invalid_argument(key + ".unk_id: " + std::to_string(id) +
                              " is outside the vocabulary of " + std::to_string(pieces.size()));
    }
    unk_id = static_cast<std::int32_t>(id);
  }
  return std::unique_ptr<Model>(new UnigramModel(std::move(pieces), std::move(scores), unk_id,
                                                 bool_field(json, "byte_fallback", false)));
}

}  // namespace

Result<std::unique_ptr<Model>> parse_model(const Json& json, const std::string& key) {
  auto type = string_field(json, key, "type");
  if (!type) {
    // Old files leave out the model's type; BPE is the one with merges.
    if (json.is_object() && json.contains("merges")) return parse_bpe(json, key);
    return type.status();
  }
  if (type.value() == "BPE") return parse_bpe(json, key);
  if (type.value() == "Unigram") return parse_unigram(json, key);
  if (type.value() == "WordLevel") {
    auto vocab = parse_vocab_object(json.value("vocab", Json()), key + ".vocab");
    if (!vocab) return vocab.status();
    return std::unique_ptr<Model>(new WordLevelModel(
        std::move(vocab).value(), optional_string(json, "unk_token").value_or("")));
  }
  return unknown_type(json, key, "model", "BPE, Unigram, WordLevel");
}

}  // namespace strata::text::hf
