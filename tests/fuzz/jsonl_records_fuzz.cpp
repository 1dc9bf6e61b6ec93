// Training data as `strata tokenize` reads it: a .jsonl file of {"text"}, {"prompt",
// "completion"} and {"messages"} records, tokenized (one thread) with a small tokenizer whose
// chat template is ChatML into a token file and loss mask.
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "strata/core/json.h"
#include "strata/text/tokenize_job.h"
#include "strata/text/tokenizer.h"
#include "tests/fuzz/fuzz_target.h"

STRATA_FUZZ_TARGET(jsonl_records) {
  using namespace strata::fuzz;
  static const auto tokenizer = [] {
    write_input("chat/tokenizer.json", R"({"version":"1.0","added_tokens":[
      {"id":4,"content":"<|im_start|>","special":true},
      {"id":5,"content":"<|im_end|>","special":true}],
      "normalizer":null,"pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,
      "trim_offsets":true,"use_regex":true},"post_processor":null,
      "decoder":{"type":"ByteLevel"},"model":{"type":"BPE","byte_fallback":false,
      "vocab":{"a":0,"b":1,"\u0120":2,"ab":3,"<|im_start|>":4,"<|im_end|>":5},
      "merges":[["a","b"]]}})");
    // The Qwen2.5 ChatML template the tests render against Hugging Face's (a template Strata
    // does not recognize would stop every "messages" record at the first line).
    auto chatml =
        strata::read_json_file(STRATA_SOURCE_DIR "/tests/data/chat_templates/chatml.json");
    if (!chatml.is_ok()) {
      std::fprintf(stderr, "jsonl_records: %s\n", chatml.status().to_string().c_str());
      std::abort();
    }
    const strata::Json config = {{"eos_token", "<|im_end|>"},
                                 {"chat_template", (*chatml)["chat_template"]}};
    write_input("chat/tokenizer_config.json", config.dump());
    auto tok = strata::text::Tokenizer::load(scratch() + "/chat");
    if (!tok.is_ok()) {
      std::fprintf(stderr, "jsonl_records: %s\n", tok.status().to_string().c_str());
      std::abort();
    }
    return std::shared_ptr<strata::text::Tokenizer>(std::move(tok).value());
  }();
  strata::text::TokenizeOptions options;
  options.inputs = {write_input("records.jsonl", as_text(data))};
  options.output = scratch() + "/records.bin";
  options.jobs = 1;
  (void)strata::text::tokenize_files(*tokenizer, options);
}
