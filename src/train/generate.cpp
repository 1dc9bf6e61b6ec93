// Generator: a ParamProvider over the tiered store for decoding, and the sampling loop.
#include "strata/train/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "strata/core/clock.h"
#include "strata/core/json.h"
#include "strata/core/rng.h"
#include "strata/mem/host_memory.h"
#include "strata/mem/tiered_store.h"
#include "strata/model/hf_checkpoint.h"
#include "strata/model/llama.h"
#include "strata/model/param_provider.h"

namespace strata::train {
namespace {

// Parameters homed in host memory in the compute dtype; the store fetches each group to the
// device on acquire and evicts groups no longer pinned when room is needed.
class StoreProvider final : public model::ParamProvider {
 public:
  StoreProvider(mem::TieredStore& store, std::vector<mem::Handle> groups)
      : store_(store), groups_(std::move(groups)) {}
  ~StoreProvider() override {
    if (workspace_ != mem::Handle::kInvalid) drop_workspace().ignore();
  }

  Result<const void*> acquire_params(int group) override {
    STRATA_ASSIGN_OR_RETURN(void* p, store_.acquire(handle(group), Tier::kDevice));
    return static_cast<const void*>(p);
  }
  void release_params(int group) override { store_.unpin(handle(group), Tier::kDevice); }
  void prefetch_params(int group) override { store_.try_prefetch(handle(group), Tier::kDevice); }
  Result<void*> acquire_grads(int) override {
    return failed_precondition("generation computes no gradients");
  }
  Status release_grads(int) override {
    return failed_precondition("generation computes no gradients");
  }
  Result<void*> workspace(std::uint64_t bytes, const std::string& what) override {
    if (workspace_ != mem::Handle::kInvalid) STRATA_RETURN_IF_ERROR(drop_workspace());
    mem::TensorSpec spec;
    spec.name = what;
    spec.size_bytes = bytes;
    spec.scratch = true;
    STRATA_ASSIGN_OR_RETURN(workspace_, store_.add(spec));
    return store_.emplace(workspace_, Tier::kDevice, false);
  }

 private:
  mem::Handle handle(int group) const { return groups_.at(static_cast<std::size_t>(group)); }
  Status drop_workspace() {
    store_.unpin(workspace_, Tier::kDevice);  // emplace pinned it
    return store_.discard(std::exchange(workspace_, mem::Handle::kInvalid));
  }
  mem::TieredStore& store_;
  std::vector<mem::Handle> groups_;
  mem::Handle workspace_ = mem::Handle::kInvalid;
};

}  // namespace

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
  std::unique_ptr<model::ParamLayout> layout;
  std::unique_ptr<device::Device> device;
  std::unique_ptr<mem::TieredStore> store;
  std::unique_ptr<StoreProvider> provider;
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
  impl->layout = std::make_unique<model::ParamLayout>(model::ParamLayout::build(impl->config));
  STRATA_RETURN_IF_ERROR(reader.validate(*impl->layout));

  device::DeviceOptions dopts;
  dopts.kind = options.device;
  dopts.memory_limit_bytes = options.device_memory_limit;
  dopts.compute_threads = options.threads;
  STRATA_ASSIGN_OR_RETURN(impl->device, device::create_device(dopts));
  mem::StoreOptions sopts;
  sopts.budget_bytes[static_cast<std::size_t>(Tier::kDevice)] = options.device_memory_limit;
  STRATA_ASSIGN_OR_RETURN(impl->store, mem::TieredStore::create(*impl->device, nullptr, sopts));

  // Every group into host memory in the compute dtype.
  std::vector<mem::Handle> handles;
  std::vector<float> f32;
  std::vector<std::byte> cast;
  const std::size_t eb = dtype_size(options.dtype);
  for (const auto& group : impl->layout->groups()) {
    f32.resize(static_cast<std::size_t>(group.num_elems));
    STRATA_RETURN_IF_ERROR(reader.read_group(group, f32.data()));
    mem::TensorSpec spec;
    spec.name = "parameters of " + group.name;
    spec.size_bytes = static_cast<std::uint64_t>(group.num_elems) * eb;
    spec.home = Tier::kHost;
    spec.home_initialized = false;
    STRATA_ASSIGN_OR_RETURN(mem::Handle h, impl->store->add(spec));
    cast.resize(spec.size_bytes);
    convert(f32.data(), DType::kF32, cast.data(), options.dtype,
            static_cast<std::size_t>(group.num_elems));
    STRATA_RETURN_IF_ERROR(impl->store->write(h, cast.data(), cast.size()));
    handles.push_back(h);
    impl->parameter_bytes += spec.size_bytes;
  }
  impl->store->trim_host_cache();
  impl->provider = std::make_unique<StoreProvider>(*impl->store, std::move(handles));
  impl->model = std::make_unique<model::LlamaModel>(impl->config, *impl->layout, *impl->device,
                                                    model::ModelOptions{options.dtype, false});
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
  STRATA_ASSIGN_OR_RETURN(const float* logits,
                          s.model->decode(*s.provider, prompt.data(), prompt_len));
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
    STRATA_ASSIGN_OR_RETURN(logits, s.model->decode(*s.provider, &next, 1));
  }
  s.stats.decode_ms = decode_clock.elapsed_ms();
  return Status::ok();
}

const model::LlamaConfig& Generator::config() const { return impl_->config; }
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
         std::to_string(s.config.vocab_size) + ") | " + std::string(dtype_name(s.options.dtype)) +
         " on " + s.device->name() + " | parameters " + format_bytes(s.parameter_bytes) +
         (s.options.device_memory_limit > 0
              ? ", device budget " + format_bytes(s.options.device_memory_limit)
              : std::string());
}

}  // namespace strata::train
