// A model directory's tokenizer_config.json (bos/eos tokens, add_bos_token / add_eos_token,
// tokenizer_class, chat_template) beside a small tokenizer.json, loaded as `strata tokenize
// --tokenizer DIR` loads it; the tokenizer is used (use_tokenizer.h) and its chat template,
// when it has one, recognized.
#include "strata/text/chat_template.h"
#include "tests/fuzz/fuzz_target.h"
#include "tests/fuzz/use_tokenizer.h"

STRATA_FUZZ_TARGET(tokenizer_config) {
  using namespace strata::fuzz;
  static const bool prepared = [] {
    // Four byte tokens and two special ones; ByteLevel pieces for 'a', 'b', ' ' (Ġ) and "ab".
    write_input("tok/tokenizer.json", R"({"version":"1.0","added_tokens":[
      {"id":4,"content":"<s>","special":true},{"id":5,"content":"</s>","special":true}],
      "normalizer":null,"pre_tokenizer":{"type":"ByteLevel","add_prefix_space":false,
      "trim_offsets":true,"use_regex":true},"post_processor":null,
      "decoder":{"type":"ByteLevel"},"model":{"type":"BPE","vocab":{"a":0,"b":1,"\u0120":2,
      "ab":3,"<s>":4,"</s>":5},"merges":[["a","b"]]}})");
    return true;
  }();
  (void)prepared;
  write_input("tok/tokenizer_config.json", as_text(data));
  auto tok = strata::text::Tokenizer::load(scratch() + "/tok");
  if (!tok.is_ok()) return;
  exercise(**tok);
  if (!(*tok)->chat_template().empty()) {
    const auto& t = **tok;
    (void)strata::text::ChatTemplate::recognize(t.chat_template(),
                                                t.bos_id() ? t.id_to_token(*t.bos_id()) : "",
                                                t.eos_id() ? t.id_to_token(*t.eos_id()) : "");
  }
}
