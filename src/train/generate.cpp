// Generator: the model's parameters, frozen, in a ZeroProvider (split over the launch's ranks
// under mpirun); the sampling loop.
#include "strata/train/generate.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <optional>
#include <utility>

#include "strata/core/clock.h"
#include "strata/core/json.h"
#include "strata/core/rng.h"
#include "strata/dist/communicator.h"
#include "strata/dist/process_grid.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/model/llama.h"
#include "strata/model/peft_adapter.h"
#include "strata/zero/tensor_group.h"
#include "strata/zero/zero_provider.h"

namespace strata::train {

std::int32_t pick_token(std::span<const float> logits, double temperature, std::int64_t top_k,
                        double top_p, double u) {
  const auto n = static_cast<std::int64_t>(logits.size());
  if (temperature <= 0 || n == 1) {
    return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) -
                                     logits.begin());
  }
  std::vector<std::int32_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  // Most likely first; ties by lower id, so the draw is reproducible.
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
    return logits[static_cast<std::size_t>(a)] > logits[static_cast<std::size_t>(b)];
  });
  std::size_t keep = order.size();
  if (top_k > 0) keep = std::min<std::size_t>(keep, static_cast<std::size_t>(top_k));
  std::vector<double> p(keep);
  const double top = logits[static_cast<std::size_t>(order[0])];
  double sum = 0;
  for (std::size_t i = 0; i < keep; ++i) {
    p[i] = std::exp((logits[static_cast<std::size_t>(order[i])] - top) / temperature);
    sum += p[i];
  }
  if (top_p < 1.0) {
    double cum = 0;
    std::size_t cut = keep;
    for (std::size_t i = 0; i < keep; ++i) {
      cum += p[i] / sum;
      if (cum >= top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    sum = std::accumulate(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(keep), 0.0);
  }
  double target = u * sum;
  for (std::size_t i = 0; i < keep; ++i) {
    target -= p[i];
    if (target < 0) return order[i];
  }
  return order[keep - 1];
}

struct Generator::Impl {
  GenerateOptions options;
  model::LlamaConfig config;
  std::optional<model::LoraConfig> lora;       // the adapter's, applied unmerged
  std::unique_ptr<model::ParamLayout> layout;  // every group frozen
  std::unique_ptr<device::Device> device;
  std::unique_ptr<dist::Communicator> comm;  // the launch's ranks: one, or mpirun's
  std::unique_ptr<dist::ProcessGrid> grid;   // every rank of the launch a tensor-parallel one
  std::unique_ptr<zero::CommTensorGroup> tensor_group;  // split only
  std::unique_ptr<zero::ZeroProvider> provider;
  std::unique_ptr<model::LlamaModel> model;
  std::uint64_t parameter_bytes = 0;
  GenerateStats stats;
};

Generator::Generator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Generator::~Generator() = default;

Result<std::unique_ptr<Generator>> Generator::open(const GenerateOptions& options) {
  if (options.dtype != DType::kF32 && options.dtype != DType::kBF16) {
    return invalid_argument("generation computes in fp32 or bf16");
  }
  if (options.max_new_tokens < 1) {
    return invalid_argument("max_new_tokens must be at least 1, got " +
                            std::to_string(options.max_new_tokens));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  STRATA_ASSIGN_OR_RETURN(auto reader, model::HfCheckpointReader::open(options.model_dir));
  impl->config = reader.config();
  std::unique_ptr<model::PeftAdapterReader> adapter;
  if (!options.adapter_dir.empty()) {
    STRATA_ASSIGN_OR_RETURN(auto opened, model::PeftAdapterReader::open(options.adapter_dir));
    adapter = std::make_unique<model::PeftAdapterReader>(std::move(opened));
    impl->lora = adapter->config();
    const auto problems = model::lora_problems(impl->config, *impl->lora);
    if (!problems.empty()) {
      std::string msg = options.adapter_dir + "/" + model::kAdapterConfigFile +
                        " does not fit the base " + options.model_dir + ":";
      for (const auto& p : problems) msg += "\n  " + p.key + ": " + p.text;
      return invalid_argument(msg);
    }
  }
  device::DeviceOptions dopts;
  dopts.kind = options.device;
  dopts.memory_limit_bytes = options.device_memory_limit;
  dopts.compute_threads = options.threads;
  STRATA_ASSIGN_OR_RETURN(impl->device, device::create_device(dopts));
  // Launched on several ranks (mpirun -np N), the model is split over all of them.
  STRATA_ASSIGN_OR_RETURN(impl->comm, dist::create_communicator({}, *impl->device));
  const int tp = impl->comm->world_size(), rank = impl->comm->rank();
  if (const auto problems = model::tensor_parallel_problems(impl->config, tp); !problems.empty()) {
    std::string msg = options.model_dir + ": the model does not split over the launch's " +
                      std::to_string(tp) + " ranks (tensor parallelism):";
    for (const auto& p : problems) msg += "\n  " + p;
    return invalid_argument(msg);
  }
  STRATA_ASSIGN_OR_RETURN(impl->grid,
                          dist::ProcessGrid::create(*impl->comm, {1, tp, 1}, *impl->device));
  {
    // Every group frozen: working copies only, no gradients, no optimizer state; split, this
    // rank's slices.
    STRATA_RETURN_IF_ERROR(reader.validate(model::ParamLayout::build(impl->config)));
    const model::ParamLayout full = model::ParamLayout::build(impl->config, impl->lora);
    if (adapter) STRATA_RETURN_IF_ERROR(adapter->validate(full));
    impl->layout = std::make_unique<model::ParamLayout>(
        model::ParamLayout::build(impl->config, impl->lora, false, {tp, rank}).all_frozen());
  }
  // Without a device budget the parameters live on the device. With one they live in host
  // memory and stay on the device between tokens while the budget has room, evicted by their
  // next use in the recorded order when it does not.
  zero::ShardOptions so;
  so.compute_dtype = options.dtype;
  so.offload_param = options.device_memory_limit == 0 ? Tier::kDevice : Tier::kHost;
  so.offload_optimizer = Tier::kHost;  // nothing trains: no optimizer state anywhere
  so.max_live_bytes = 0;               // bounded by the device budget alone
  so.max_reuse_distance = std::numeric_limits<std::uint64_t>::max();
  so.cpu_adam.threads = options.threads;
  STRATA_ASSIGN_OR_RETURN(impl->provider,
                          zero::ZeroProvider::create(*impl->layout, 0, *impl->device, nullptr,
                                                     *impl->grid, zero::ZeroOptions{}, so));
  // What the adapter holds (its pairs and modules_to_save) from it, the rest from the base.
  const model::GroupSource base = [&](const model::ParamGroup& g, float* dst) {
    return reader.read_group(g, dst);
  };
  STRATA_RETURN_IF_ERROR(impl->provider->load_master(adapter ? adapter->over(base) : base));
  impl->parameter_bytes = impl->layout->total_elems() * dtype_size(options.dtype);
  model::ModelOptions mopts{options.dtype, false, impl->lora};
  if (tp > 1) {
    STRATA_ASSIGN_OR_RETURN(impl->tensor_group,
                            zero::make_tensor_group(impl->grid->tensor(), *impl->device,
                                                    impl->config.num_key_value_heads));
    mopts.tensor_parallel = {tp, rank};
    mopts.tensor_group = impl->tensor_group.get();
  }
  impl->model =
      std::make_unique<model::LlamaModel>(impl->config, *impl->layout, *impl->device, mopts);
  return std::unique_ptr<Generator>(new Generator(std::move(impl)));
}

Status Generator::generate(std::span<const std::int32_t> prompt,
                           std::span<const std::int32_t> stop_ids,
                           const std::function<bool(std::int32_t)>& on_token) {
  Impl& s = *impl_;
  if (prompt.empty()) return invalid_argument("the prompt is empty: give at least one token");
  const auto prompt_len = static_cast<std::int64_t>(prompt.size());
  const std::int64_t positions =
      std::min(prompt_len + s.options.max_new_tokens, s.config.max_position_embeddings);
  if (prompt_len >= positions) {
    return invalid_argument("the prompt's " + std::to_string(prompt_len) +
                            " tokens leave no room below max_position_embeddings " +
                            std::to_string(s.config.max_position_embeddings));
  }
  STRATA_RETURN_IF_ERROR(s.model->begin_decode(*s.provider, positions, prompt_len));
  const std::uint64_t budget = s.options.device_memory_limit;
  s.stats = GenerateStats{};
  s.stats.prompt_tokens = prompt_len;
  s.stats.streamed =
      budget > 0 && s.parameter_bytes + s.model->decode_bytes(positions, prompt_len) > budget;
  Rng rng(s.options.seed);
  Stopwatch clock;
  // Each decode call is one pass over the parameters; ending it lets the prefetcher replay the
  // recorded order on the next.
  const auto decode = [&](const std::int32_t* ids, std::int64_t n) -> Result<const float*> {
    STRATA_ASSIGN_OR_RETURN(const float* out, s.model->decode(*s.provider, ids, n));
    STRATA_RETURN_IF_ERROR(s.provider->finish_micro_batch());
    return out;
  };
  STRATA_ASSIGN_OR_RETURN(const float* logits, decode(prompt.data(), prompt_len));
  s.stats.prefill_ms = clock.elapsed_ms();
  Stopwatch decode_clock;
  const auto vocab = static_cast<std::size_t>(s.config.vocab_size);
  while (true) {
    const std::int32_t next = pick_token({logits, vocab}, s.options.temperature, s.options.top_k,
                                         s.options.top_p, rng.uniform());
    ++s.stats.generated_tokens;
    const bool more = on_token(next);
    const bool stop = std::find(stop_ids.begin(), stop_ids.end(), next) != stop_ids.end();
    if (!more || stop || s.stats.generated_tokens >= s.options.max_new_tokens ||
        s.model->decoded_positions() >= positions) {
      break;
    }
    STRATA_ASSIGN_OR_RETURN(logits, decode(&next, 1));
  }
  s.stats.decode_ms = decode_clock.elapsed_ms();
  return Status::ok();
}

const model::LlamaConfig& Generator::config() const { return impl_->config; }
int Generator::rank() const { return impl_->comm->rank(); }
const GenerateStats& Generator::stats() const { return impl_->stats; }

std::vector<std::int32_t> Generator::eos_ids() const {
  std::vector<std::int32_t> ids;
  const Json& src = impl_->config.source;
  if (!src.is_object() || !src.contains("eos_token_id")) return ids;
  const Json& e = src["eos_token_id"];
  if (e.is_number_integer()) ids.push_back(e.get<std::int32_t>());
  if (e.is_array()) {
    for (const auto& x : e) {
      if (x.is_number_integer()) ids.push_back(x.get<std::int32_t>());
    }
  }
  return ids;
}

std::string Generator::describe() const {
  const Impl& s = *impl_;
  return "model: " + std::to_string(s.layout->num_parameters()) + " parameters (" +
         std::string(model::model_type_name(s.config.family)) + ", " +
         std::to_string(s.config.num_hidden_layers) + " layers, vocab " +
         std::to_string(s.config.vocab_size) + ")" +
         (s.lora ? " + LoRA adapter " + s.options.adapter_dir + " (r " + std::to_string(s.lora->r) +
                       ", unmerged)"
                 : std::string()) +
         " | " + std::string(dtype_name(s.options.dtype)) + " on " + s.device->name() +
         (s.comm->world_size() > 1
              ? " | split over " + std::to_string(s.comm->world_size()) + " tensor-parallel ranks"
              : std::string()) +
         " | parameters " + format_bytes(s.parameter_bytes) +
         (s.comm->world_size() > 1 ? " a rank" : "") +
         (s.options.device_memory_limit > 0
              ? ", device budget " + format_bytes(s.options.device_memory_limit)
              : std::string());
}

}  // namespace strata::train
