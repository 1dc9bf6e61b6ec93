// The built-in chat templates against Jinja's renderings of the real templates
// (tests/data/chat_templates/, from tools/golden/chat_template_golden.sh).
#include "strata/text/chat_template.h"

#include <gtest/gtest.h>

#include "strata/core/json.h"
#include "tests/testing/test_name.h"

namespace strata::text {
namespace {

const std::string kDir = std::string(STRATA_TEST_DATA_DIR) + "/chat_templates";

class ChatTemplateGoldenTest
    : public ::testing::TestWithParam<std::pair<std::string, std::string>> {};

TEST_P(ChatTemplateGoldenTest, RendersAsJinjaDoesAndRefusesWhatItRefuses) {
  const auto& [file, expected_name] = GetParam();
  auto golden = read_json_file(kDir + "/" + file + ".json");
  ASSERT_TRUE(golden.is_ok()) << golden.status().to_string();
  const Json& g = golden.value();
  auto tmpl =
      ChatTemplate::recognize(g["chat_template"].get<std::string>(),
                              g["bos_token"].is_string() ? g["bos_token"].get<std::string>() : "",
                              g["eos_token"].get<std::string>());
  ASSERT_TRUE(tmpl.is_ok()) << tmpl.status().to_string();
  EXPECT_EQ(tmpl.value().name(), expected_name);
  for (const Json& c : g["cases"]) {
    std::vector<ChatMessage> messages;
    for (const Json& m : c["messages"]) {
      messages.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
    }
    auto parts = tmpl.value().render(messages);
    const std::string id = c["id"].get<std::string>();
    if (c.contains("error")) {
      EXPECT_FALSE(parts.is_ok()) << id << ": Jinja raised \"" << c["error"].get<std::string>()
                                  << "\"";
      continue;
    }
    ASSERT_TRUE(parts.is_ok()) << id << ": " << parts.status().to_string();
    std::string rendered, trained;
    for (const ChatPart& p : parts.value()) {
      rendered += p.text;
      if (p.train) trained += p.text;
    }
    EXPECT_EQ(rendered, c["rendered"].get<std::string>()) << id;
    // What trains is the assistants' replies: every trained part is an assistant's content
    // (as the template writes it) with its end-of-turn marker.
    for (const ChatPart& p : parts.value()) {
      if (!p.train) continue;
      bool from_assistant = false;
      for (const auto& m : messages) {
        from_assistant =
            from_assistant ||
            (m.role == "assistant" &&
             p.text.find(m.content.substr(m.content.find_first_not_of(" \n\t") == std::string::npos
                                              ? 0
                                              : m.content.find_first_not_of(" \n\t"),
                                          3)) != std::string::npos);
      }
      EXPECT_TRUE(from_assistant) << id << ": trained part \"" << p.text << "\"";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Templates, ChatTemplateGoldenTest,
    ::testing::Values(std::make_pair("llama3", "llama3"), std::make_pair("llama3.1", "llama3.1"),
                      std::make_pair("chatml", "chatml"), std::make_pair("chatml-qwen2", "chatml"),
                      std::make_pair("llama2", "llama2"), std::make_pair("mistral", "mistral")),
    [](const auto& info) { return strata::testing::test_name(info.param.first); });

TEST(ChatTemplateTest, ToolRolesAndLaterMistralTemplatesAreRefused) {
  auto golden = read_json_file(kDir + "/chatml.json");
  ASSERT_TRUE(golden.is_ok());
  auto chatml =
      ChatTemplate::recognize(golden.value()["chat_template"].get<std::string>(), "", "<|im_end|>");
  ASSERT_TRUE(chatml.is_ok());
  const std::vector<ChatMessage> tool = {
      {"user", "weather?"}, {"tool", "{\"t\": 20}"}, {"assistant", "20 degrees"}};
  auto r = chatml.value().render(tool);
  ASSERT_FALSE(r.is_ok());
  EXPECT_NE(r.status().message().find("messages[1].role \"tool\""), std::string::npos);
  // Mistral's later revisions take a system prompt: not the v0.1 template Strata renders.
  auto later = ChatTemplate::recognize(
      "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] "
      "%}{%- endif %}{{- bos_token }}{%- for message in loop_messages %}{%- if message['role'] "
      "== 'user' %}{{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' "
      "[/INST]' }}{%- endif %}{%- endfor %}",
      "<s>", "</s>");
  EXPECT_FALSE(later.is_ok());
}

// Found by the chat_template fuzzer: a content ending inside a UTF-8 sequence was read past its
// end when trimmed.
TEST(ChatTemplateTest, ContentThatIsNotUtf8IsRefusedNamingTheMessage) {
  auto json = read_json_file(kDir + "/llama3.json");
  ASSERT_TRUE(json.is_ok());
  auto t = ChatTemplate::recognize((*json)["chat_template"].get<std::string>(), "<s>", "</s>");
  ASSERT_TRUE(t.is_ok()) << t.status().to_string();
  const ChatMessage messages[] = {{"user", "hi"}, {"assistant", "caf\xC3"}};
  auto parts = t->render(messages);
  ASSERT_FALSE(parts.is_ok());
  EXPECT_NE(parts.status().message().find("messages[1].content is not UTF-8 (byte 3)"),
            std::string::npos)
      << parts.status().message();
}

TEST(ChatTemplateTest, AnUnknownTemplateIsRefusedListingTheBuiltInOnes) {
  auto t = ChatTemplate::recognize("{% for m in messages %}<|user|>{{ m.content }}{% endfor %}",
                                   "<s>", "</s>");
  ASSERT_FALSE(t.is_ok());
  EXPECT_NE(t.status().message().find("built-in: llama3, llama3.1, chatml, llama2, mistral"),
            std::string::npos)
      << t.status().message();
}

}  // namespace
}  // namespace strata::text
