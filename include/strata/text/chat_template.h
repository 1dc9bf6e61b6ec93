// Chat templates: a conversation ({"role", "content"} messages) rendered as the model's
// tokenizer_config.json chat_template renders it, for the templates Strata recognises.
// Rendering is native (no Jinja engine): recognize() tells the built-in templates apart by their
// text and refuses any other, listing the built-in ones.
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/core/status.h"

namespace strata::text {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

// A piece of the rendered conversation. `train`: the loss counts its tokens (the assistant's
// replies and the end-of-turn token after each).
struct ChatPart {
  std::string text;
  bool train = false;
};

class ChatTemplate {
 public:
  // `jinja` is tokenizer_config.json's chat_template; bos/eos the config's bos_token/eos_token.
  static Result<ChatTemplate> recognize(std::string_view jinja, std::string bos_token,
                                        std::string eos_token);
  // The built-in templates, for messages: "llama3", "llama3.1", "chatml", "llama2", "mistral".
  static std::vector<std::string_view> builtin_names();

  const std::string& name() const { return name_; }
  // As the template renders `messages`; where the template raises an error (roles that must
  // alternate, a role it does not support), so does this, naming the message. Contents must be
  // UTF-8 (an error names the message otherwise).
  Result<std::vector<ChatPart>> render(std::span<const ChatMessage> messages) const;

 private:
  std::string name_;
  std::string bos_, eos_;
  std::string default_system_;    // chatml: the system prompt the template adds when none is given
  bool trailing_header_ = false;  // llama3's first revision: the assistant header closes it
  bool space_after_eos_ = false;  // mistral's first revision: "</s> " after each reply
};

}  // namespace strata::text
