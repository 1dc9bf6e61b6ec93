// A Hugging Face config.json (every family: Llama, Mistral, Qwen2, Qwen3), read as a model
// directory's; a config that reads is then laid out (every tensor's shape and the groups),
// split for 2-way tensor parallelism and cut into pipeline stages as a run would.
#include "strata/model/hf_checkpoint.h"
#include "strata/model/param_layout.h"
#include "strata/model/pipeline_stage.h"
#include "tests/fuzz/fuzz_target.h"

STRATA_FUZZ_TARGET(hf_config) {
  using namespace strata::fuzz;
  write_input("model/config.json", as_text(data));
  auto config = strata::model::HfCheckpointReader::read_config(scratch() + "/model");
  if (!config.is_ok()) return;
  (void)strata::model::tensor_parallel_problems(*config, 2);
  // A layout holds shapes, not values: it is small whatever the sizes say.
  const auto layout = strata::model::ParamLayout::build(*config);
  (void)layout.num_groups();
  (void)strata::model::pipeline_layers_problems({}, 2, 1, config->num_hidden_layers);
}
