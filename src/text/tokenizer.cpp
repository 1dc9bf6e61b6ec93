// Tokenizer::load: which file, and what tokenizer_config.json adds.
#include "strata/text/tokenizer.h"

#include <filesystem>
#include <fstream>

#include "src/text/hf_tokenizer.h"
#include "src/text/sentencepiece_tokenizer.h"
#include "src/text/unicode.h"
#include "strata/core/json.h"

namespace strata::text {

namespace fs = std::filesystem;

class TokenizerLoader {
 public:
  static void describe(Tokenizer* tok, const std::string& extra) { tok->description_ += extra; }
  static void set_chat_template(Tokenizer* tok, std::string jinja) {
    tok->chat_template_ = std::move(jinja);
  }
};

namespace {

// transformers' tokenizer classes that rebuild the post-processor from add_bos_token (default
// true) and add_eos_token (default false).
bool llama_family(const std::string& tokenizer_class) {
  for (const char* name : {"LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer",
                           "CodeLlamaTokenizerFast", "GemmaTokenizer", "GemmaTokenizerFast"}) {
    if (tokenizer_class == name) return true;
  }
  return false;
}

// bos_token / eos_token: a string, {"content": ...}, or null.
Result<std::optional<std::string>> token_name(const Json& config, const std::string& path,
                                              const char* key) {
  if (!config.contains(key) || config[key].is_null()) return std::optional<std::string>();
  const Json& v = config[key];
  if (v.is_string()) return std::optional<std::string>(v.get<std::string>());
  if (v.is_object() && v.contains("content") && v["content"].is_string()) {
    return std::optional<std::string>(v["content"].get<std::string>());
  }
  return invalid_argument(path + ": " + key + ": expected a string or {\"content\": ...}, got " +
                          v.dump());
}

Result<std::optional<std::int32_t>> token_id(const Tokenizer& tok, const Json& config,
                                             const std::string& path, const char* key) {
  auto name = token_name(config, path, key);
  if (!name) return name.status();
  if (!name.value()) return std::optional<std::int32_t>();
  auto id = tok.token_to_id(*name.value());
  if (!id) {
    return invalid_argument(path + ": " + key + " \"" + *name.value() + "\" is not in " +
                            tok.path() + "'s vocabulary");
  }
  return std::optional<std::int32_t>(*id);
}

Result<bool> optional_bool(const Json& config, const std::string& path, const char* key,
                           bool fallback) {
  if (!config.contains(key) || config[key].is_null()) return fallback;
  if (!config[key].is_boolean()) {
    return invalid_argument(path + ": " + key + ": expected true or false, got " +
                            config[key].dump());
  }
  return config[key].get<bool>();
}

// A bare tokenizer.json names no BOS/EOS: take the special token with a conventional name.
std::optional<std::int32_t> guess_special(const Tokenizer& tok,
                                          std::initializer_list<const char*> names) {
  for (const char* name : names) {
    if (auto id = tok.token_to_id(name); id && tok.is_special(*id)) return id;
  }
  return std::nullopt;
}

bool looks_like_json(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char c = 0;
  while (in.get(c)) {
    if (c != ' ' && c != '\n' && c != '\r' && c != '\t') return c == '{';
  }
  return false;
}

Status apply_config(Tokenizer* tok, const std::string& config_path) {
  auto config = read_json_file(config_path);
  if (!config) return config.status();
  const Json& c = config.value();
  if (!c.is_object()) return invalid_argument(config_path + ": expected a JSON object");
  const std::string cls = c.contains("tokenizer_class") && c["tokenizer_class"].is_string()
                              ? c["tokenizer_class"].get<std::string>()
                              : "";
  auto bos = token_id(*tok, c, config_path, "bos_token");
  if (!bos) return bos.status();
  auto eos = token_id(*tok, c, config_path, "eos_token");
  if (!eos) return eos.status();
  const bool llama = llama_family(cls);
  auto add_bos = optional_bool(c, config_path, "add_bos_token", llama);
  if (!add_bos) return add_bos.status();
  auto add_eos = optional_bool(c, config_path, "add_eos_token", false);
  if (!add_eos) return add_eos.status();
  if (add_bos.value() && !bos.value()) {
    return invalid_argument(config_path + ": add_bos_token is true but bos_token is not set");
  }
  if (add_eos.value() && !eos.value()) {
    return invalid_argument(config_path + ": add_eos_token is true but eos_token is not set");
  }
  if (auto* hf = dynamic_cast<HfTokenizer*>(tok)) {
    hf->set_special_ids(bos.value(), eos.value());
    if (llama) {
      hf->set_template(add_bos.value() ? bos.value() : std::nullopt,
                       add_eos.value() ? eos.value() : std::nullopt);
    }
  } else if (auto* sp = dynamic_cast<SentencePieceTokenizer*>(tok)) {
    // transformers converts a tokenizer.model to a fast tokenizer; with "legacy": false the text
    // after a special token gets no "▁" prefix, which SentencePiece alone cannot reproduce.
    if (c.contains("legacy") && c["legacy"] == false) {
      return invalid_argument(config_path +
                              ": \"legacy\": false with only a tokenizer.model "
                              "is not supported; use the model's tokenizer.json");
    }
    sp->set_special_ids(bos.value() ? bos.value() : tok->bos_id(),
                        eos.value() ? eos.value() : tok->eos_id());
    sp->set_added(add_bos.value(), add_eos.value());
    sp->split_special_pieces();
  }
  if (c.contains("chat_template")) {
    const Json& t = c["chat_template"];
    if (t.is_string()) {
      TokenizerLoader::set_chat_template(tok, t.get<std::string>());
    } else if (t.is_array()) {  // named templates: [{"name": "default", "template": ...}, ...]
      for (const Json& named : t) {
        if (named.is_object() && named.contains("name") && named["name"] == "default" &&
            named.contains("template") && named["template"].is_string()) {
          TokenizerLoader::set_chat_template(tok, named["template"].get<std::string>());
        }
      }
    } else if (!t.is_null()) {
      return invalid_argument(config_path +
                              ": chat_template: expected a string or a list of "
                              "{\"name\", \"template\"}");
    }
  }
  TokenizerLoader::describe(tok, cls.empty() ? ", with tokenizer_config.json"
                                             : ", with tokenizer_config.json (" + cls + ")");
  return Status::ok();
}

}  // namespace

void Tokenizer::encode(std::string_view text, bool add_special_tokens,
                       std::vector<std::int32_t>* ids) const {
  if (find_invalid_utf8(text) == std::string_view::npos) {
    encode_utf8(text, add_special_tokens, ids);
  } else {
    encode_utf8(replace_invalid_utf8(text), add_special_tokens, ids);
  }
}

Result<std::unique_ptr<Tokenizer>> Tokenizer::load(const std::string& path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st)) return not_found(path + ": no such tokenizer file or directory");
  std::string file = path;
  std::string config;
  if (fs::is_directory(st)) {
    const fs::path dir(path);
    if (fs::exists(dir / "tokenizer.json")) {
      file = (dir / "tokenizer.json").string();
    } else if (fs::exists(dir / "tokenizer.model")) {
      file = (dir / "tokenizer.model").string();
    } else {
      return not_found(path + ": a model directory needs tokenizer.json or tokenizer.model");
    }
    if (fs::exists(dir / "tokenizer_config.json"))
      config = (dir / "tokenizer_config.json").string();
  }
  std::unique_ptr<Tokenizer> tok;
  if (looks_like_json(file)) {
    auto hf = HfTokenizer::load(file);
    if (!hf) return hf.status();
    tok = std::move(hf).value();
  } else {
    auto sp = SentencePieceTokenizer::load(file);
    if (!sp) return sp.status();
    tok = std::move(sp).value();
  }
  if (!config.empty()) {
    if (Status s = apply_config(tok.get(), config); !s) return s;
  } else if (auto* hf = dynamic_cast<HfTokenizer*>(tok.get())) {
    hf->set_special_ids(
        guess_special(*hf, {"<s>", "<|begin_of_text|>", "<bos>", "<|bos|>"}),
        guess_special(*hf, {"</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<|eos|>"}));
  }
  return tok;
}

}  // namespace strata::text
