// A chat template (tokenizer_config.json's chat_template) as ChatTemplate::recognize tells the
// built-in ones apart, and a conversation rendered with it. Input: the template's text, then a
// line "---" and the conversation as "role: content" lines (no "---": a fixed conversation).
#include <vector>

#include "strata/text/chat_template.h"
#include "tests/fuzz/fuzz_target.h"

STRATA_FUZZ_TARGET(chat_template) {
  using namespace strata::fuzz;
  using strata::text::ChatMessage;
  const auto [jinja, lines] = split_once(as_text(data), "\n---\n");
  auto chat = strata::text::ChatTemplate::recognize(jinja, "<s>", "</s>");
  if (!chat.is_ok()) return;
  std::vector<ChatMessage> messages;
  std::string_view rest = lines;
  while (!rest.empty()) {
    auto [line, after] = split_once(rest, "\n");
    auto [role, content] = split_once(line, ": ");
    messages.push_back({std::string(role), std::string(content)});
    if (after.empty() && line == rest) break;
    rest = after;
  }
  if (messages.empty()) {
    messages = {{"system", "Be brief."},
                {"user", "Hi"},
                {"assistant", "Hello."},
                {"user", "Bye"},
                {"assistant", "Bye."}};
  }
  (void)chat->render(messages);
  // Every prefix: templates refuse some orders (a system message last, two users in a row).
  for (std::size_t n = 0; n < messages.size() && n < 8; ++n) {
    (void)chat->render(std::span<const ChatMessage>(messages.data(), n));
  }
}
