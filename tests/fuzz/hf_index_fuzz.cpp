// A Hugging Face model directory's model.safetensors.index.json (the tensor-to-shard map of a
// sharded checkpoint) beside a valid config.json and one shard. Input: the index file.
#include "strata/model/hf_checkpoint.h"
#include "tests/fuzz/fuzz_target.h"

STRATA_FUZZ_TARGET(hf_index) {
  using namespace strata::fuzz;
  static const bool prepared = [] {
    write_input("hf/config.json",
                R"({"model_type":"llama","vocab_size":8,"hidden_size":4,"intermediate_size":8,)"
                R"("num_hidden_layers":1,"num_attention_heads":1})");
    strata::model::SafetensorsWriter shard;  // the tensors the seeds' index maps
    shard.add("a", strata::DType::kF32, {2});
    shard.add("b", strata::DType::kBF16, {1});
    write_safetensors("hf/model-00001-of-00001.safetensors", shard);
    return true;
  }();
  (void)prepared;
  write_input("hf/model.safetensors.index.json", as_text(data));
  (void)strata::model::HfCheckpointReader::open(scratch() + "/hf");
}
