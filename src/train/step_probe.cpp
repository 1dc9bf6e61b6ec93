// Timing a small model's step by training variants of its config (step_probe.h).
#include "strata/train/step_probe.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <vector>

#include "strata/model/param_layout.h"
#include "strata/train/trainer.h"

namespace strata::train {
Result<double> time_small_step(const TrainConfig& config, int ranks, const MachineRates& rates) {
  const model::LlamaConfig& model = config.model;
  if (!rates.layer_passes.measured) {
    return failed_precondition("layers this large are predicted from their FLOPs");
  }
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() /
                       ("strata-step-probe-" + std::to_string(static_cast<long>(::getpid())));
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return io_error("cannot make " + dir.string() + ": " + ec.message());
  struct Cleanup {
    fs::path dir;
    ~Cleanup() {
      std::error_code ignored;
      fs::remove_all(dir, ignored);
    }
  } cleanup{dir};
  // Random tokens below the vocabulary, enough for every step's sequences.
  constexpr int kSteps = 6;
  // One data-parallel rank's share, on one rank whose layers are whole: a split rank does 1/T of
  // their work, a pipeline stage its layers' (below).
  const int tensor = config.tensor_parallel_size, stages = config.pipeline_parallel_size;
  const int data_ranks = ranks / (tensor * stages);
  const std::int64_t batch = config.batch_size / data_ranks;
  const std::size_t tokens = static_cast<std::size_t>((batch * kSteps + 1) * (config.seq_len + 1));
  std::vector<std::uint32_t> ids(tokens);
  for (std::size_t i = 0; i < tokens; ++i) {
    ids[i] = static_cast<std::uint32_t>((i * 2654435761u) %
                                        static_cast<std::uint64_t>(model.vocab_size));
  }
  const fs::path data = dir / "tokens.u32";
  {
    std::ofstream out(data, std::ios::binary);
    out.write(reinterpret_cast<const char*>(ids.data()),
              static_cast<std::streamsize>(ids.size() * sizeof(std::uint32_t)));
    if (!out) return io_error("cannot write " + data.string());
  }
  const auto run = [&](int layers) -> Result<double> {
    TrainConfig c = config;
    model::LlamaConfig m = model;
    m.num_hidden_layers = layers;
    c.model = m;
    c.model_path.clear();  // random weights: the checkpoint's shape only
    c.data = DataConfig{data.string(), TokenFormat::kU32};
    c.batch_size = batch;
    c.tensor_parallel_size = 1;
    c.sequence_parallel = false;
    c.pipeline_parallel_size = 1;
    c.pipeline_schedule = PipelineSchedule::k1F1B;
    c.virtual_stages = 1;
    c.pipeline_layers.clear();
    c.expert_parallel_size = 1;
    c.max_steps = kSteps;
    c.save_dir.clear();
    c.metrics_file.clear();
    c.trace_file.clear();
    c.offload_param_auto = c.offload_optimizer_auto = false;
    c.dist_backend = dist::CommBackend::kSingle;
    TrainOptions o;
    STRATA_ASSIGN_OR_RETURN(auto trainer, Trainer::create(c, o));
    STRATA_RETURN_IF_ERROR(trainer->run());
    return trainer->steady_step_ms();
  };
  // Two layers apart, so that the noise of either run is not multiplied by every layer.
  STRATA_ASSIGN_OR_RETURN(const double one, run(1));
  STRATA_ASSIGN_OR_RETURN(const double three, run(3));
  const double layer_ms = std::max((three - one) / 2, 0.0);
  const double step_ms =
      (std::max(one - layer_ms, 0.0) + layer_ms * model.num_hidden_layers) / tensor;
  const double params = static_cast<double>(model::ParamLayout::build(model).num_parameters());
  const double stretch = config.pipeline_stretch(data_ranks);
  return (step_ms / stages + tensor_parallel_ms(config, ranks, rates) +
          expert_parallel_ms(config, ranks, rates)) *
             stretch +
         pipeline_boundary_ms(config, ranks, rates) + zero_comm_ms(config, params, ranks, rates) +
         pipeline_traffic_ms(config, ranks, rates);
}

}  // namespace strata::train
