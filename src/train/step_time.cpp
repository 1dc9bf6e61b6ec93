// Short probes of this machine's rates, and a step's predicted time from them and the plan.
#include "strata/train/step_time.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <vector>

#include "strata/core/clock.h"
#include "strata/core/host_mapping.h"
#include "strata/device/device.h"
#include "strata/dist/communicator.h"
#include "strata/dist/process_grid.h"
#include "strata/io/swap.h"
#include "strata/model/llama.h"
#include "strata/model/param_layout.h"
#include "strata/model/param_provider.h"
#include "strata/train/trainer.h"
#include "strata/zero/zero_provider.h"

namespace strata::train {
namespace {

constexpr double kGemmProbeSeconds = 0.3;
constexpr double kLayerProbeSeconds = 0.3;  // each model's runs, after at least 4
// The FLOPs of a 2-layer model's forward and backward up to which layers are timed.
constexpr double kLayerProbeFlops = 8e9;
constexpr double kMemoryProbeSeconds = 0.15;
constexpr std::size_t kMemoryProbeBytes = std::size_t{64} << 20;
constexpr std::size_t kSwapProbeBytes = std::size_t{256} << 20;
// What a node's MPI over shared memory moves per rank in a collective; not measurable from one
// process, so it is said to be assumed.
constexpr double kAssumedCommBytesPerS = 5e9;

Rate gemm_rate(const TrainConfig& config, device::Device* given) {
  constexpr std::int64_t n = 1024;
  const DType dt = config.precision;
  const std::size_t bytes = static_cast<std::size_t>(n * n) * dtype_size(dt);
  std::unique_ptr<device::Device> own;
  if (given == nullptr) {
    device::DeviceOptions o = config.device_options();
    o.memory_limit_bytes = 3 * bytes + (std::size_t{1} << 20);  // the probe's, not the run's
    auto made = device::create_device(o);
    if (!made.is_ok()) return {0, false, "not measured: " + made.status().message()};
    own = std::move(*made);
  }
  device::Device* device = given != nullptr ? given : own.get();
  auto a = device->allocate(bytes, "GEMM probe");
  auto b = device->allocate(bytes, "GEMM probe");
  auto c = device->allocate(bytes, "GEMM probe");
  if (!a.is_ok() || !b.is_ok() || !c.is_ok()) {
    return {0, false,
            "not measured: the GEMM probe's 3 x " + format_bytes(bytes) +
                " do not fit device_memory_limit"};
  }
  device::Stream& s = device->stream(device::StreamKind::kCompute);
  for (void* p : {a->data(), b->data(), c->data()}) device->fill_zero(p, bytes, s);
  device::GemmArgs g;
  g.m = g.n = g.k = n;
  g.a = a->data();
  g.b = b->data();
  g.c = c->data();
  g.lda = g.ldb = g.ldc = n;
  g.dtype = dt;
  device->ops().gemm(g);  // warm up: thread pools, packing buffers
  s.synchronize();
  Stopwatch t;
  int reps = 0;
  while (t.elapsed_ms() < kGemmProbeSeconds * 1e3) {
    device->ops().gemm(g);
    s.synchronize();
    ++reps;
  }
  const double flops = 2.0 * n * n * n * reps;
  return {flops / (t.elapsed_ms() / 1e3), true,
          std::string(precision_name(dt)) + " GEMM 1024^3 on " + device->name() + ", " +
              std::to_string(reps) + " runs"};
}

// `model` cut to `layers` decoder layers, ready to run forward and backward at the run's
// micro-batch on `device`.
class ProbeModel {
 public:
  static Result<std::unique_ptr<ProbeModel>> create(const TrainConfig& config,
                                                    model::LlamaConfig model, int layers,
                                                    device::Device& device) {
    model.num_hidden_layers = layers;
    std::unique_ptr<ProbeModel> p(new ProbeModel(config, model, device));
    // Everything on the device, as initialized: a one-rank ZeroProvider with nothing offloaded.
    p->grid_ = dist::ProcessGrid::single_rank(device);
    zero::ShardOptions so;
    so.compute_dtype = config.precision;
    STRATA_ASSIGN_OR_RETURN(p->provider_,
                            zero::ZeroProvider::create(p->layout_, 0, device, nullptr, *p->grid_,
                                                       zero::ZeroOptions{}, so));
    STRATA_RETURN_IF_ERROR(p->provider_->load_master([&](const model::ParamGroup& g, float* dst) {
      model::init_group(model, g, /*seed=*/1, dst);
      return Status::ok();
    }));
    for (std::size_t i = 0; i < p->inputs_.size(); ++i) {
      const auto vocab = static_cast<std::size_t>(model.vocab_size);
      p->inputs_[i] = static_cast<std::int32_t>((i * 7919) % vocab);
      p->targets_[i] = static_cast<std::int32_t>((i * 104729 + 1) % vocab);
    }
    return p;
  }
  // Milliseconds of one forward and backward.
  Result<double> time_once() {
    Stopwatch t;
    STRATA_RETURN_IF_ERROR(
        model_.forward_backward(*provider_, inputs_.data(), targets_.data(), batch_, seq_, 1.0f)
            .status());
    return t.elapsed_ms();
  }

 private:
  static model::ModelOptions options(const TrainConfig& config) {
    model::ModelOptions mo;
    mo.compute_dtype = config.precision;
    mo.activation_checkpointing = config.activation_checkpointing;
    return mo;
  }
  ProbeModel(const TrainConfig& config, const model::LlamaConfig& model, device::Device& device)
      : layout_(model::ParamLayout::build(model)),
        model_(model, layout_, device, options(config)),
        batch_(config.micro_batch_size),
        seq_(config.seq_len),
        inputs_(static_cast<std::size_t>(batch_ * seq_)),
        targets_(inputs_.size()) {}
  model::ParamLayout layout_;
  model::LlamaModel model_;
  std::unique_ptr<dist::ProcessGrid> grid_;
  std::unique_ptr<zero::ZeroProvider> provider_;
  std::int64_t batch_, seq_;
  std::vector<std::int32_t> inputs_, targets_;
};

// A decoder layer's forward and backward at the run's micro-batch, and the embedding, head and
// loss's, timed on the device as the difference of a 2-layer and a 1-layer model of the run's
// shape, where a layer is small enough to time in a moment (at most kLayerProbeFlops); per-op
// overheads and the operations that are not matrix products dominate such layers. Larger ones
// run at the GEMM rate and are left unmeasured.
void layer_rates(const TrainConfig& config, const model::LlamaConfig& model, device::Device* given,
                 Rate* layers, Rate* ends) {
  const double tokens = static_cast<double>(config.micro_batch_size * config.seq_len);
  const double h = static_cast<double>(model.hidden_size);
  const double layer_params =
      h * (2 * h + 2 * h * model.num_key_value_heads / model.num_attention_heads) +
      3.0 * h * static_cast<double>(model.intermediate_size);
  const double flops =
      2 * (6 * layer_params * tokens) + 6 * h * static_cast<double>(model.vocab_size) * tokens;
  if (flops > kLayerProbeFlops) {
    *layers = *ends = {0, false, "not measured: layers this large run at the GEMM rate"};
    return;
  }
  std::unique_ptr<device::Device> own;
  if (given == nullptr) {
    device::DeviceOptions o = config.device_options();
    o.memory_limit_bytes = 0;  // the probe's own: on the CPU backend, as much as it takes
    auto made = device::create_device(o);
    if (!made.is_ok()) {
      *layers = *ends = {0, false, "not measured: " + made.status().message()};
      return;
    }
    own = std::move(*made);
  }
  device::Device& device = given != nullptr ? *given : *own;
  // The two models run in turn, so that a machine busy for a moment slows both alike; each
  // one's median, after a warm-up run.
  std::unique_ptr<ProbeModel> one, two;
  Status failed;
  for (int layers : {1, 2}) {
    auto made = ProbeModel::create(config, model, layers, device);
    if (!made.is_ok()) {
      failed = made.status();
      break;
    }
    (layers == 1 ? one : two) = std::move(*made);
  }
  std::vector<double> ones, twos;
  Stopwatch total;
  for (int run = 0;
       failed.is_ok() && run < 16 && (run < 5 || total.elapsed_ms() < 2 * kLayerProbeSeconds * 1e3);
       ++run) {
    auto a = one->time_once();
    if (!a.is_ok()) {
      failed = a.status();
      break;
    }
    auto b = two->time_once();
    failed = b.status();
    if (failed.is_ok() && run > 0) {
      ones.push_back(*a);
      twos.push_back(*b);
    }
  }
  if (!failed.is_ok()) {
    *layers = *ends = {0, false, "not measured: " + failed.message()};
    return;
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double one_ms = median(ones), two_ms = median(twos);
  // No difference: the layer is lost in the noise of either run, and says nothing.
  if (two_ms <= one_ms) {
    *layers = *ends = {0, false, "not measured: a layer's time was lost in the probe's noise"};
    return;
  }
  const double layer_ms = two_ms - one_ms;
  const double ends_ms = std::max(one_ms - layer_ms, 1e-3);
  const std::string how = "forward and backward of models of 1 and 2 layers on " + device.name() +
                          ", micro-batch " + std::to_string(config.micro_batch_size) + " x " +
                          std::to_string(config.seq_len);
  *layers = {1e3 / layer_ms, true, how};
  *ends = {1e3 / ends_ms, true, how};
}

Rate memory_rate() {
  HostMapping src(kMemoryProbeBytes), dst(kMemoryProbeBytes);
  std::memset(src.data(), 1, kMemoryProbeBytes);
  Stopwatch t;
  int reps = 0;
  while (t.elapsed_ms() < kMemoryProbeSeconds * 1e3) {
    std::memcpy(dst.data(), src.data(), kMemoryProbeBytes);
    ++reps;
  }
  // A copy reads and writes each byte.
  const double moved = 2.0 * static_cast<double>(kMemoryProbeBytes) * reps;
  return {moved / (t.elapsed_ms() / 1e3), true, "memcpy of 64 MiB, one thread"};
}

void swap_rates(const TrainConfig& config, Rate* read, Rate* write) {
  const bool automatic = config.offload_param_auto || config.offload_optimizer_auto;
  const bool nvme = config.offload_param == Tier::kNvme ||
                    config.offload_optimizer == Tier::kNvme ||
                    (automatic && !config.swap_paths.empty());
  if (!nvme) {
    *read = *write = {0, false, "not needed: nothing lives on nvme"};
    return;
  }
  // Recorded by strata io-bench --write-config: sustained figures, where a short probe may see a
  // drive's or a virtual disk's cache.
  if (config.swap_read_bytes_per_s > 0 && config.swap_write_bytes_per_s > 0) {
    *read = {config.swap_read_bytes_per_s, true,
             "recorded by strata io-bench (swap_read_bytes_per_s)"};
    *write = {config.swap_write_bytes_per_s, true,
              "recorded by strata io-bench (swap_write_bytes_per_s)"};
    return;
  }
  io::SwapOptions o = swap_options(config, 0);
  o.paths.resize(std::min<std::size_t>(o.paths.size(), 1));  // the first drive, as configured
  o.log_warnings = false;
  auto swap = io::SwapSpace::create(o);
  if (!swap.is_ok()) {
    *read = *write = {0, false, "not measured: " + swap.status().message()};
    return;
  }
  auto extent = (*swap)->allocate(kSwapProbeBytes, "swap probe");
  if (!extent.is_ok()) {
    *read = *write = {0, false, "not measured: " + extent.status().message()};
    return;
  }
  HostMapping buf(kSwapProbeBytes);
  for (std::size_t i = 0; i < kSwapProbeBytes; i += 4096) buf.data()[i] = std::byte(i >> 12);
  const std::string where = (*swap)->engine_name() + " on " + o.paths.front() + ", " +
                            format_bytes(kSwapProbeBytes) + " in " +
                            format_bytes(config.swap_block_size) + " requests";
  // The first write allocates the file's blocks; training overwrites them, so time the second.
  Status s = (*swap)->write(*extent, 0, buf.data(), kSwapProbeBytes).wait();
  Stopwatch tw;
  if (s.is_ok()) s = (*swap)->write(*extent, 0, buf.data(), kSwapProbeBytes).wait();
  const double write_s = tw.elapsed_ms() / 1e3;
  Stopwatch tr;
  if (s.is_ok()) s = (*swap)->read(*extent, 0, buf.data(), kSwapProbeBytes).wait();
  const double read_s = tr.elapsed_ms() / 1e3;
  (*swap)->free(*extent);
  if (!s.is_ok()) {
    *read = *write = {0, false, "not measured: " + s.message()};
    return;
  }
  *write = {static_cast<double>(kSwapProbeBytes) / write_s, true, "write, " + where};
  *read = {static_cast<double>(kSwapProbeBytes) / read_s, true, "read, " + where};
}

Json rate_json(const Rate& r) {
  return Json{{"per_s", r.per_s}, {"measured", r.measured}, {"how", r.how}};
}

double ms(double bytes_or_flops, const Rate& r) {
  return r.per_s > 0 ? bytes_or_flops / r.per_s * 1e3 : 0.0;
}

// Variants of a config that the caller compares itself: no suggestions; with the swap paths'
// free space, or without (what a placement would need on NVMe).
const EstimateOptions kVariant{0, false, true};
const EstimateOptions kVariantUnchecked{0, false, false};

std::string placement_name(Tier param, Tier optimizer) {
  return std::string(zero::offload_name(param)) + "/" + std::string(zero::offload_name(optimizer));
}

// The placements a config leaves open ("auto" keys range over every tier), each with the reason
// it cannot run whatever the budgets, or none.
struct Candidate {
  Tier param, optimizer;
  std::string refused;
};
std::vector<Candidate> candidates(const TrainConfig& config) {
  const std::vector<Tier> all = {Tier::kDevice, Tier::kHost, Tier::kNvme};
  const std::vector<Tier> params =
      config.offload_param_auto ? all : std::vector{config.offload_param};
  const std::vector<Tier> optimizers =
      config.offload_optimizer_auto ? all : std::vector{config.offload_optimizer};
  std::vector<Candidate> out;
  for (Tier p : params) {
    for (Tier o : optimizers) {
      if (p != Tier::kDevice && o == Tier::kDevice) continue;  // not a placement
      Candidate c{p, o, ""};
      if (p != Tier::kDevice && config.zero_stage != 3) {
        c.refused = "parameter offload needs zero_stage 3";
      }
      if ((p == Tier::kNvme || o == Tier::kNvme) && config.swap_paths.empty()) {
        c.refused = "no swap_paths";
      }
      out.push_back(std::move(c));
    }
  }
  return out;
}

// `config` with the candidate's placement.
TrainConfig placed(const TrainConfig& config, const Candidate& c) {
  TrainConfig out = config;
  out.offload_param = c.param;
  out.offload_optimizer = c.optimizer;
  out.offload_param_auto = out.offload_optimizer_auto = false;
  return out;
}

// The placement at the least memory it can run with: without a shadow optimizer state, which a
// plan drops when a budget or the swap space cannot hold it.
TrainConfig least(const TrainConfig& config, const Candidate& c) {
  TrainConfig out = placed(config, c);
  if (out.optimizer_overlap != zero::OptimizerOverlap::kNone) {
    out.optimizer_overlap = zero::OptimizerOverlap::kForward;
  }
  return out;
}

// `bytes` as format_bytes prints it, rounded up (not to the nearest) so that the printed size,
// set as a budget, holds `bytes`.
std::string bytes_at_least(std::uint64_t bytes) {
  const double unit = bytes >= (1ull << 30)   ? double(1ull << 30)
                      : bytes >= (1ull << 20) ? double(1ull << 20)
                                              : 1024.0;
  const double hundredths = std::ceil(static_cast<double>(bytes) / unit * 100.0);
  return format_bytes(static_cast<std::uint64_t>(std::ceil(hundredths / 100.0 * unit)));
}

// What each open placement needs of the device, the host and NVMe with no budgets, and the
// smallest raise of either budget, the free swap space a placement that fits both budgets lacks,
// or the largest micro-batch, that would let one of them run.
std::string smallest_changes(const TrainConfig& config, const model::LlamaConfig& model, int ranks,
                             const std::vector<Candidate>& open) {
  // The device, host and NVMe bytes `c` needs with `micro_batch` sequences per micro-batch.
  const auto needs = [&](const Candidate& c, std::int64_t micro_batch, std::uint64_t* device,
                         std::uint64_t* host, std::uint64_t* nvme = nullptr) {
    TrainConfig unbounded = least(config, c);
    unbounded.micro_batch_size = micro_batch;
    unbounded.device_memory_limit = 0;
    unbounded.host_memory_limit = 0;
    auto e = estimate(unbounded, model, ranks, kVariantUnchecked);
    if (!e.is_ok()) return false;
    *device = e->device_bytes_needed();
    *host = e->plan.tier_bytes(Tier::kHost);
    if (nvme != nullptr) *nvme = e->plan.tier_bytes(Tier::kNvme);
    return true;
  };
  const auto within = [](std::uint64_t need, std::uint64_t budget) {
    return budget == 0 || need <= budget;
  };
  std::uint64_t device_need = 0, host_need = 0;
  std::string device_with, host_with;
  // Neither budget alone: both, for the placement that needs the least of the two together.
  std::uint64_t both_device = 0, both_host = 0;
  std::string both_with;
  // Both budgets hold it, but the swap paths have too little free: the least NVMe to free.
  const std::uint64_t swap_free = config.swap_paths.empty() ? 0 : swap_free_bytes(config, 0);
  std::uint64_t nvme_need = 0;
  std::string nvme_with;
  for (const Candidate& c : open) {
    std::uint64_t device = 0, host = 0, nvme = 0;
    if (!c.refused.empty()) continue;
    // Planned within both budgets as they are (gradients go to NVMe when the host cannot hold
    // them), short only of free swap space.
    if (swap_free != 0) {
      auto within_budgets = estimate(least(config, c), model, ranks, kVariantUnchecked);
      const std::uint64_t n =
          within_budgets.is_ok() ? within_budgets->plan.tier_bytes(Tier::kNvme) : 0;
      if (within_budgets.is_ok() &&
          within(within_budgets->device_bytes_needed(), config.device_memory_limit) &&
          n > swap_free && (nvme_need == 0 || n < nvme_need)) {
        nvme_need = n;
        nvme_with = placement_name(c.param, c.optimizer);
      }
    }
    if (!needs(c, config.micro_batch_size, &device, &host, &nvme)) continue;
    if (swap_free != 0 && nvme > swap_free) continue;  // no budget raise makes it fit
    if (both_with.empty() || device + host < both_device + both_host) {
      both_device = device;
      both_host = host;
      both_with = placement_name(c.param, c.optimizer);
    }
    if (within(host, config.host_memory_limit) && (device_need == 0 || device < device_need)) {
      device_need = device;
      device_with = placement_name(c.param, c.optimizer);
    }
    if (within(device, config.device_memory_limit) && (host_need == 0 || host < host_need)) {
      host_need = host;
      host_with = placement_name(c.param, c.optimizer);
    }
  }
  std::string out;
  const auto add = [&](const std::string& s) { out += (out.empty() ? "" : ", or ") + s; };
  if (nvme_need != 0) {
    add("swap_paths with " + bytes_at_least(nvme_need) + " free (" + nvme_with + "; they have " +
        format_bytes(swap_free) + ")");
  }
  if (device_need != 0) {
    add("raise device_memory_limit to " + bytes_at_least(device_need) + " (" + device_with + ")");
  }
  if (host_need != 0) {
    add("raise host_memory_limit to " + bytes_at_least(host_need) + " (" + host_with + ")");
  }
  if (device_need == 0 && host_need == 0 && !both_with.empty()) {
    add("raise device_memory_limit to " + bytes_at_least(both_device) +
        " and host_memory_limit to " + bytes_at_least(both_host) + " (" + both_with + ")");
  }
  // Fewer sequences per micro-batch shrink the activations; the same batch accumulates more.
  for (std::int64_t mb = config.micro_batch_size / 2; mb >= 1; mb /= 2) {
    if (config.batch_size % (mb * ranks) != 0) continue;
    const bool fits = std::any_of(open.begin(), open.end(), [&](const Candidate& c) {
      std::uint64_t device = 0, host = 0, nvme = 0;
      return c.refused.empty() && needs(c, mb, &device, &host, &nvme) &&
             within(device, config.device_memory_limit) && within(host, config.host_memory_limit) &&
             (swap_free == 0 || nvme <= swap_free);
    });
    if (fits) {
      add("micro_batch_size " + std::to_string(mb));
      break;
    }
  }
  return out.empty() ? "" : "; to fit: " + out;
}

}  // namespace

MachineRates calibrate(const TrainConfig& config, device::Device* device) {
  MachineRates r;
  try {
    r.gemm_flops = gemm_rate(config, device);
    if (auto model = read_model_config(config, nullptr); model.is_ok()) {
      layer_rates(config, *model, device, &r.layer_passes, &r.end_passes);
    } else {
      r.layer_passes = r.end_passes = {0, false, "not measured: " + model.status().message()};
    }
    r.memory_bytes = memory_rate();
    swap_rates(config, &r.nvme_read_bytes, &r.nvme_write_bytes);
    r.nvme_mixed_bytes =
        config.swap_mixed_bytes_per_s > 0
            ? Rate{config.swap_mixed_bytes_per_s, true,
                   "recorded by strata io-bench (swap_mixed_bytes_per_s)"}
            : Rate{0, false, "not recorded (strata io-bench --op all --write-config records it)"};
  } catch (const std::bad_alloc&) {
    r.memory_bytes = {0, false, "not measured: no host memory for the probe"};
  }
  r.comm_bytes = {kAssumedCommBytesPerS, false,
                  "assumed (MPI over shared memory; one process cannot time a collective)"};
  return r;
}

Result<double> time_small_step(const TrainConfig& config, const model::LlamaConfig& model,
                               int ranks, const MachineRates& rates) {
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
  const std::int64_t batch = config.batch_size / ranks;
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
    c.model = m.to_json();
    c.data = DataConfig{data.string(), TokenFormat::kU32};
    c.batch_size = batch;
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
  double step_ms = std::max(one - layer_ms, 0.0) + layer_ms * model.num_hidden_layers;
  if (ranks > 1) {
    const double params = static_cast<double>(model::ParamLayout::build(model).num_parameters());
    step_ms +=
        ms(3.0 * params * dtype_size(config.precision) * (ranks - 1) / ranks, rates.comm_bytes);
  }
  return step_ms;
}

std::string changes_to_fit(const TrainConfig& config, const model::LlamaConfig& model, int ranks) {
  std::string out = smallest_changes(config, model, ranks, candidates(config));
  if (config.offload_param_auto && config.offload_optimizer_auto) return out;
  // Another placement that fits the budgets as they are: the one that offloads least.
  TrainConfig any = config;
  any.offload_param_auto = any.offload_optimizer_auto = true;
  for (const Candidate& c : candidates(any)) {
    if (!c.refused.empty() ||
        (c.param == config.offload_param && c.optimizer == config.offload_optimizer)) {
      continue;
    }
    auto e = estimate(placed(config, c), model, ranks, kVariant);
    if (!e.is_ok() || (config.device_memory_limit != 0 &&
                       e->device_bytes_needed() > config.device_memory_limit)) {
      continue;
    }
    const std::string change = "offload_param " + std::string(zero::offload_name(c.param)) +
                               " and offload_optimizer " +
                               std::string(zero::offload_name(c.optimizer));
    return out.empty() ? "; to fit: " + change : out + ", or " + change;
  }
  return out;
}

Json MachineRates::to_json() const {
  return Json{{"gemm_flops", rate_json(gemm_flops)},
              {"layer_passes", rate_json(layer_passes)},
              {"end_passes", rate_json(end_passes)},
              {"memory_bytes", rate_json(memory_bytes)},
              {"nvme_read_bytes", rate_json(nvme_read_bytes)},
              {"nvme_write_bytes", rate_json(nvme_write_bytes)},
              {"nvme_mixed_bytes", rate_json(nvme_mixed_bytes)},
              {"comm_bytes", rate_json(comm_bytes)}};
}

StepTime predict_step(const TrainConfig& config, const Estimate& e, const MachineRates& rates) {
  StepTime st;
  const model::LlamaConfig& m = e.model;
  const double ranks = e.ranks;
  const double tokens = static_cast<double>(config.batch_size) / ranks * config.seq_len;
  const double accum = static_cast<double>(config.accumulation_steps(e.ranks));
  const double dsize = static_cast<double>(dtype_size(config.precision));
  // Matrix products: 2 FLOPs per parameter and token forward, 4 backward (the embedding is a
  // lookup, not a product); attention 4 x seq x hidden per token and layer forward, 8 backward.
  // Checkpointing runs the forward again.
  const double params = static_cast<double>(e.parameters);
  const double matmul_params = params - static_cast<double>(m.vocab_size * m.hidden_size);
  const double passes = config.activation_checkpointing ? 4.0 : 3.0;
  const double flops = passes * 2.0 * matmul_params * tokens +
                       passes * 4.0 * static_cast<double>(m.num_hidden_layers) * config.seq_len *
                           static_cast<double>(m.hidden_size) * tokens;
  st.compute_ms = ms(flops, rates.gemm_flops);
  if (rates.layer_passes.measured && rates.end_passes.measured) {
    // Timed at the run's micro-batch, recompute included: per micro-batch, every layer and the
    // two ends.
    st.compute_ms =
        accum * (static_cast<double>(m.num_hidden_layers) * 1e3 / rates.layer_passes.per_s +
                 1e3 / rates.end_passes.per_s);
  }

  // The rank's working copies, gradients and optimizer state, as its shard store holds them.
  const double work =
      static_cast<double>(e.plan.kind_bytes(config.offload_param, zero::TensorKind::kParameters));
  const double elems = work / dsize;
  // Parameters fetched to the device for forward and backward of each micro-batch, from the
  // host (a copy) or NVMe; what the host caches under a host budget comes from there.
  if (config.offload_param != Tier::kDevice) {
    const double fetched = 2.0 * accum * work;
    st.transfer_ms += ms(2.0 * fetched, rates.memory_bytes);  // the copy to the device
    if (config.offload_param == Tier::kNvme) {
      const double cached = std::clamp((static_cast<double>(e.plan.peak(Tier::kHost)) -
                                        static_cast<double>(e.plan.tier_bytes(Tier::kHost))) /
                                           std::max(work, 1.0),
                                       0.0, 1.0);
      st.transfer_ms += ms(fetched * (1.0 - cached), rates.nvme_read_bytes);
    }
  }
  // Gradients leave the device once per micro-batch.
  if (config.offload_optimizer != Tier::kDevice) {
    st.transfer_ms += ms(2.0 * accum * elems * dsize, rates.memory_bytes);
    if (e.plan.gradients == Tier::kNvme) {
      st.transfer_ms += ms(accum * elems * dsize, rates.nvme_write_bytes);
    }
  }
  // The update reads and writes fp32 master weights and both moments, reads the gradient and
  // writes the new working copy: (12 + 12) B + gradient + working copy per element.
  const double grad_bytes = e.plan.keep_gradients ? dsize : 4.0;
  st.optimizer_ms = ms(elems * (24.0 + grad_bytes + dsize), rates.memory_bytes);
  if (config.offload_optimizer == Tier::kNvme) {
    double read = elems * 12.0, write = elems * 12.0;
    if (e.plan.gradients == Tier::kNvme) read += elems * grad_bytes;
    if (config.offload_param == Tier::kNvme) write += elems * dsize;
    // Reads and writes in turn at their own rates, or at once at the mixed rate where recorded.
    const double streamed =
        rates.nvme_mixed_bytes.measured
            ? ms(std::max(read, write), rates.nvme_mixed_bytes)
            : ms(read, rates.nvme_read_bytes) + ms(write, rates.nvme_write_bytes);
    st.optimizer_ms = std::max(st.optimizer_ms, streamed);
  }
  // ZeRO-3 moves the parameters twice (forward and backward all-gathers) and the gradients once.
  if (e.ranks > 1) {
    st.comm_ms = ms(3.0 * params * dsize * (ranks - 1) / ranks, rates.comm_bytes);
  }
  st.serial_ms = std::max({st.compute_ms, st.transfer_ms, st.comm_ms}) + st.optimizer_ms;
  if (e.plan.overlap == zero::OptimizerOverlap::kNone) {
    st.step_ms = st.serial_ms;
    st.schedule = "serial";
  } else {
    st.overlapped_ms = std::max({st.compute_ms, st.transfer_ms + st.optimizer_ms, st.comm_ms});
    st.step_ms =
        e.plan.measure_overlap ? std::min(st.overlapped_ms, st.serial_ms) : st.overlapped_ms;
    st.schedule =
        e.plan.measure_overlap ? "auto: the faster of serial and overlapped" : "overlapped";
  }
  return st;
}

Json StepTime::to_json() const {
  return Json{
      {"step_ms", step_ms},       {"serial_ms", serial_ms},     {"overlapped_ms", overlapped_ms},
      {"compute_ms", compute_ms}, {"transfer_ms", transfer_ms}, {"optimizer_ms", optimizer_ms},
      {"comm_ms", comm_ms},       {"schedule", schedule}};
}

Result<PlacementChoice> choose_placement(const TrainConfig& config, int ranks,
                                         const MachineRates& rates) {
  STRATA_ASSIGN_OR_RETURN(const model::LlamaConfig model, read_model_config(config, nullptr));
  const std::vector<Candidate> open = candidates(config);
  // Free space of the swap paths, for NVMe homes.
  const std::uint64_t swap_free = swap_free_bytes(config, 0);
  std::optional<PlacementChoice> best;
  std::string others;
  for (const Candidate& cand : open) {
    const std::string n = placement_name(cand.param, cand.optimizer);
    std::string refused = cand.refused;
    std::optional<StepTime> st;
    if (refused.empty()) {
      const TrainConfig c = placed(config, cand);
      auto est = estimate(c, model, ranks, kVariant);
      if (!est.is_ok()) {
        refused = est.status().message();
      } else if (config.device_memory_limit != 0 &&
                 est->device_bytes_needed() > config.device_memory_limit) {
        refused = "device " + format_bytes(est->device_bytes_needed()) + " > device_memory_limit " +
                  format_bytes(config.device_memory_limit);
      } else if (swap_free != 0 && est->plan.tier_bytes(Tier::kNvme) > swap_free) {
        refused = "nvme " + format_bytes(est->plan.tier_bytes(Tier::kNvme)) + " > " +
                  format_bytes(swap_free) + " free in swap_paths";
      } else {
        st = predict_step(c, *est, rates);
      }
    }
    if (!refused.empty()) {
      others += "; " + n + ": " + refused;
      continue;
    }
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.3f s", st->step_ms / 1e3);
    if (best && st->step_ms >= best->step.step_ms) {
      others += "; " + n + ": " + buf;
      continue;
    }
    // `why` holds the predicted step's text until the end.
    if (best) others += "; " + placement_name(best->param, best->optimizer) + ": " + best->why;
    best = PlacementChoice{cand.param, cand.optimizer, *st, std::string(buf)};
  }
  if (!best) {
    return out_of_memory("no placement fits the budgets" +
                         (others.empty() ? "" : ":" + others.substr(1)) +
                         smallest_changes(config, model, ranks, open));
  }
  best->why = "offload_param " + std::string(zero::offload_name(best->param)) +
              ", offload_optimizer " + std::string(zero::offload_name(best->optimizer)) +
              ": predicted step " + best->why + ", the fastest that fits" +
              (others.empty() ? "" : " (" + others.substr(2) + ")");
  return *best;
}

}  // namespace strata::train
