// tokenizer.json (Hugging Face's tokenizers format: BPE, Unigram, WordLevel models, their
// normalizers, pre-tokenizers, post-processors and decoders), loaded as Tokenizer::load loads a
// file and used (use_tokenizer.h).
#include "tests/fuzz/fuzz_target.h"
#include "tests/fuzz/use_tokenizer.h"

STRATA_FUZZ_TARGET(tokenizer_json) {
  strata::fuzz::load_and_use(
      strata::fuzz::write_input("tokenizer.json", strata::fuzz::as_text(data)));
}
