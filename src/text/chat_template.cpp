// The built-in chat templates, rendered natively.
#include "strata/text/chat_template.h"

#include "src/text/unicode.h"

namespace strata::text {
namespace {

// Python's str.strip() (Jinja's trim): Unicode whitespace at both ends.
std::string trim(std::string_view s) {
  std::size_t begin = 0;
  while (begin < s.size()) {
    std::size_t next = begin;
    if (!is_whitespace(next_char(s, &next))) break;
    begin = next;
  }
  std::size_t end = s.size();
  while (end > begin) {
    std::size_t start = end - 1;
    while (start > begin && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
    std::size_t probe = start;
    if (!is_whitespace(next_char(s, &probe))) break;
    end = start;
  }
  return std::string(s.substr(begin, end - begin));
}

bool contains(std::string_view hay, std::string_view needle) {
  return hay.find(needle) != std::string_view::npos;
}

// The text of the Jinja string literal that starts right after `marker` in `jinja`, up to the
// closing `terminator`, with \n and \' unescaped. Empty when the marker is absent.
std::string literal_after(std::string_view jinja, std::string_view marker,
                          std::string_view terminator) {
  const std::size_t at = jinja.find(marker);
  if (at == std::string_view::npos) return {};
  const std::size_t begin = at + marker.size();
  const std::size_t end = jinja.find(terminator, begin);
  if (end == std::string_view::npos) return {};
  std::string out;
  for (std::size_t i = begin; i < end; ++i) {
    if (jinja[i] == '\\' && i + 1 < end) {
      const char n = jinja[++i];
      out += n == 'n' ? '\n' : n == 't' ? '\t' : n;
    } else {
      out += jinja[i];
    }
  }
  return out;
}

Status alternation_error(std::size_t i) {
  return invalid_argument("messages[" + std::to_string(i) +
                          "]: Conversation roles must alternate user/assistant/user/assistant/...");
}

// The system prompt of a ChatML template's default system message: the first Jinja literal
// '<|im_start|>system\n...<|im_end|>' whose text is plain (no Jinja in between).
std::string default_chatml_system(std::string_view jinja) {
  // Templates escape the newline inside the Jinja string ("\\n"); some copies hold a real one.
  for (const std::string_view marker :
       {std::string_view("<|im_start|>system\\n"), std::string_view("<|im_start|>system\n")}) {
    for (std::size_t at = jinja.find(marker); at != std::string_view::npos;
         at = jinja.find(marker, at + 1)) {
      const std::size_t begin = at + marker.size();
      const std::size_t end = jinja.find("<|im_end|>", begin);
      if (end == std::string_view::npos) break;
      const std::string_view body = jinja.substr(begin, end - begin);
      if (body.find_first_of("'\"{}") != std::string_view::npos) continue;
      return literal_after(jinja.substr(at), marker, "<|im_end|>");
    }
  }
  return {};
}

}  // namespace

std::vector<std::string_view> ChatTemplate::builtin_names() {
  return {"llama3", "llama3.1", "chatml", "llama2", "mistral"};
}

Result<ChatTemplate> ChatTemplate::recognize(std::string_view jinja, std::string bos_token,
                                             std::string eos_token) {
  ChatTemplate t;
  t.bos_ = std::move(bos_token);
  t.eos_ = std::move(eos_token);
  if (contains(jinja, "<|start_header_id|>") && contains(jinja, "<|eot_id|>") &&
      !contains(jinja, "ipython") && !contains(jinja, "Cutting Knowledge Date")) {
    t.name_ = "llama3";
    // The first Llama 3 revision ends every rendering with the assistant's header.
    t.trailing_header_ = !contains(jinja, "add_generation_prompt");
  } else if (contains(jinja, "<|start_header_id|>") && contains(jinja, "Cutting Knowledge Date")) {
    t.name_ = "llama3.1";
  } else if (contains(jinja, "<|im_start|>") && !contains(jinja, "<think>")) {
    t.name_ = "chatml";
    t.default_system_ = default_chatml_system(jinja);
  } else if (contains(jinja, "[INST]") && contains(jinja, "<<SYS>>")) {
    t.name_ = "llama2";
  } else if (contains(jinja, "'[INST] ' + message['content'] + ' [/INST]'") &&
             !contains(jinja, "[AVAILABLE_TOOLS]") && !contains(jinja, "[SYSTEM_PROMPT]") &&
             !contains(jinja, "system_message")) {
    t.name_ = "mistral";  // v0.1's: later revisions add system prompts and tools
    t.space_after_eos_ = contains(jinja, "eos_token + ' '");
  } else {
    std::string names;
    for (const auto n : builtin_names()) names += (names.empty() ? "" : ", ") + std::string(n);
    return invalid_argument(
        "the tokenizer's chat_template is not one Strata renders (built-in: " + names +
        "); render the conversations into {\"prompt\", \"completion\"} records instead");
  }
  if ((t.name_ == "llama3" || t.name_ == "llama3.1" || t.name_ == "llama2" ||
       t.name_ == "mistral") &&
      t.bos_.empty()) {
    return invalid_argument("the " + t.name_ +
                            " chat template needs bos_token in tokenizer_config.json");
  }
  if ((t.name_ == "llama2" || t.name_ == "mistral") && t.eos_.empty()) {
    return invalid_argument("the " + t.name_ +
                            " chat template needs eos_token in tokenizer_config.json");
  }
  return t;
}

Result<std::vector<ChatPart>> ChatTemplate::render(std::span<const ChatMessage> messages) const {
  // Tool calls and other roles render differently in each template's later branches; only the
  // three roles every built-in template shares are rendered.
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role != "system" && role != "user" && role != "assistant") {
      return invalid_argument("messages[" + std::to_string(i) + "].role \"" + role +
                              "\": Strata renders system, user and assistant messages (the " +
                              name_ + " template)");
    }
    if (const std::size_t bad = find_invalid_utf8(messages[i].content);
        bad != std::string_view::npos) {
      return invalid_argument("messages[" + std::to_string(i) + "].content is not UTF-8 (byte " +
                              std::to_string(bad) + ")");
    }
  }
  std::vector<ChatPart> parts;
  auto add = [&](std::string text, bool train) {
    if (!text.empty()) parts.push_back({std::move(text), train});
  };
  if (name_ == "llama3" || name_ == "llama3.1") {
    add(bos_, false);
    std::size_t first = 0;
    if (name_ == "llama3.1") {
      std::string system;
      if (!messages.empty() && messages[0].role == "system") {
        system = trim(messages[0].content);
        first = 1;
      }
      add("<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
          "Today Date: 26 Jul 2024\n\n" +
              system + "<|eot_id|>",
          false);
    }
    for (std::size_t i = first; i < messages.size(); ++i) {
      const std::string& role = messages[i].role;
      add("<|start_header_id|>" + role + "<|end_header_id|>\n\n", false);
      add(trim(messages[i].content) + "<|eot_id|>", role == "assistant");
    }
    if (trailing_header_) add("<|start_header_id|>assistant<|end_header_id|>\n\n", false);
    return parts;
  }
  if (name_ == "chatml") {
    if (!default_system_.empty() && (messages.empty() || messages[0].role != "system")) {
      add("<|im_start|>system\n" + default_system_ + "<|im_end|>\n", false);
    }
    for (const auto& m : messages) {
      add("<|im_start|>" + m.role + "\n", false);
      add(m.content + "<|im_end|>", m.role == "assistant");
      add("\n", false);
    }
    return parts;
  }
  if (name_ == "llama2") {
    std::size_t first = 0;
    bool has_system = false;
    std::string system;
    if (!messages.empty() && messages[0].role == "system") {
      system = messages[0].content;
      has_system = true;
      first = 1;
    }
    for (std::size_t i = first; i < messages.size(); ++i) {
      const ChatMessage& m = messages[i];
      if ((m.role == "user") != ((i - first) % 2 == 0)) return alternation_error(i);
      std::string content = m.content;
      if (i == first && has_system) content = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + content;
      if (m.role == "user") {
        add(bos_ + "[INST] " + trim(content) + " [/INST]", false);
      } else if (m.role == "assistant") {
        add(" ", false);
        add(trim(content) + " " + eos_, true);
      }
    }
    return parts;
  }
  // mistral
  add(bos_, false);
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if ((m.role == "user") != (i % 2 == 0)) return alternation_error(i);
    if (m.role == "user") {
      add("[INST] " + m.content + " [/INST]", false);
    } else if (m.role == "assistant") {
      add(m.content + eos_, true);
      if (space_after_eos_) add(" ", false);
    } else {
      return invalid_argument("messages[" + std::to_string(i) + "].role \"" + m.role +
                              "\": Only user and assistant roles are supported!");
    }
  }
  return parts;
}

}  // namespace strata::text
