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

Status check_roles(std::span<const ChatMessage> messages, bool system_first_only) {
  bool any_assistant = false;
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const std::string& role = messages[i].role;
    if (role != "system" && role != "user" && role != "assistant") {
      return invalid_argument("messages[" + std::to_string(i) + "].role \"" + role +
                              "\": expected system, user or assistant");
    }
    if (role == "system" && i > 0 && system_first_only) {
      return invalid_argument("messages[" + std::to_string(i) +
                              "]: a system message must come first");
    }
    any_assistant = any_assistant || role == "assistant";
  }
  if (!any_assistant) {
    return invalid_argument("messages: no assistant message, so nothing to train on");
  }
  return Status::ok();
}

// [INST] templates: after an optional system message, user and assistant alternate.
Status check_alternating(std::span<const ChatMessage> messages, std::size_t first) {
  for (std::size_t i = first; i < messages.size(); ++i) {
    const bool user_turn = (i - first) % 2 == 0;
    if ((messages[i].role == "user") != user_turn || messages[i].role == "system") {
      return invalid_argument("messages[" + std::to_string(i) + "].role \"" + messages[i].role +
                              "\": this template needs user and assistant turns to alternate, "
                              "starting with user");
    }
  }
  return Status::ok();
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
  } else if (contains(jinja, "<|start_header_id|>") && contains(jinja, "Cutting Knowledge Date")) {
    t.name_ = "llama3.1";
  } else if (contains(jinja, "<|im_start|>") && !contains(jinja, "<think>")) {
    t.name_ = "chatml";
    t.default_system_ = literal_after(jinja, "<|im_start|>system\\n", "<|im_end|>");
  } else if (contains(jinja, "[INST]") && contains(jinja, "<<SYS>>")) {
    t.name_ = "llama2";
  } else if (contains(jinja, "[INST]") && !contains(jinja, "[AVAILABLE_TOOLS]") &&
             !contains(jinja, "[SYSTEM_PROMPT]")) {
    t.name_ = "mistral";
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
  std::vector<ChatPart> parts;
  auto add = [&](std::string text, bool train) {
    if (!text.empty()) parts.push_back({std::move(text), train});
  };
  if (name_ == "llama3" || name_ == "llama3.1") {
    if (Status s = check_roles(messages, name_ == "llama3.1"); !s) return s;
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
      const bool assistant = messages[i].role == "assistant";
      add("<|start_header_id|>" + messages[i].role + "<|end_header_id|>\n\n", false);
      add(trim(messages[i].content) + "<|eot_id|>", assistant);
    }
    return parts;
  }
  if (name_ == "chatml") {
    if (Status s = check_roles(messages, true); !s) return s;
    if (!default_system_.empty() && (messages.empty() || messages[0].role != "system")) {
      add("<|im_start|>system\n" + default_system_ + "<|im_end|>\n", false);
    }
    for (const auto& m : messages) {
      const bool assistant = m.role == "assistant";
      add("<|im_start|>" + m.role + "\n", false);
      add(m.content + "<|im_end|>", assistant);
      add("\n", false);
    }
    return parts;
  }
  // llama2 / mistral
  if (Status s = check_roles(messages, true); !s) return s;
  std::size_t first = 0;
  std::string system;
  if (!messages.empty() && messages[0].role == "system") {
    if (name_ == "mistral") {
      return invalid_argument("messages[0]: the mistral template has no system role");
    }
    system = messages[0].content;
    first = 1;
  }
  if (Status s = check_alternating(messages, first); !s) return s;
  if (name_ == "mistral") add(bos_, false);
  for (std::size_t i = first; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (name_ == "llama2") {
      if (m.role == "user") {
        std::string content = m.content;
        if (i == first && first == 1) {
          content = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + content;
        }
        add(bos_ + "[INST] " + trim(content) + " [/INST]", false);
      } else {
        add(" ", false);
        add(trim(m.content) + " " + eos_, true);
      }
    } else {
      if (m.role == "user") {
        add("[INST] " + m.content + " [/INST]", false);
      } else {
        add(m.content + eos_, true);
      }
    }
  }
  return parts;
}

}  // namespace strata::text
