// tokenizer.model (a SentencePiece model), loaded as Tokenizer::load loads a file and used
// (use_tokenizer.h).
#include "tests/fuzz/fuzz_target.h"
#include "tests/fuzz/use_tokenizer.h"

STRATA_FUZZ_TARGET(sentencepiece) {
  strata::fuzz::load_and_use(
      strata::fuzz::write_input("tokenizer.model", strata::fuzz::as_text(data)));
}
