// A Hugging Face model directory's model.safetensors.index.json (the tensor-to-shard map of a
// sharded checkpoint) beside a valid config.json and one shard. Input: the index file.
#include "strata/model/hf_checkpoint.h"
#include "tests/fuzz/fuzz_target.h"

namespace {

// A 2-tensor shard: "a" (F32 [2]) and "b" (BF16 [1]).
std::string shard_bytes() {
  const std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("b":{"dtype":"BF16","shape":[1],"data_offsets":[8,10]}})";
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return file + header + std::string(10, '\x3f');
}

}  // namespace

STRATA_FUZZ_TARGET(hf_index) {
  using namespace strata::fuzz;
  static const bool prepared = [] {
    write_input("hf/config.json",
                R"({"model_type":"llama","vocab_size":8,"hidden_size":4,"intermediate_size":8,)"
                R"("num_hidden_layers":1,"num_attention_heads":1})");
    write_input("hf/model-00001-of-00001.safetensors", shard_bytes());
    return true;
  }();
  (void)prepared;
  write_input("hf/model.safetensors.index.json", as_text(data));
  (void)strata::model::HfCheckpointReader::open(scratch() + "/hf");
}
