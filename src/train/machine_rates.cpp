// Short probes of this machine's rates: a GEMM, a decoder layer, host memory and the swap drive.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "strata/core/clock.h"
#include "strata/device/device.h"
#include "strata/dist/process_grid.h"
#include "strata/io/swap.h"
#include "strata/model/llama.h"
#include "strata/model/param_layout.h"
#include "strata/sys/host_mapping.h"
#include "strata/train/drive_record.h"
#include "strata/train/step_time.h"
#include "strata/zero/zero_provider.h"

namespace strata::train {

std::int64_t head_rows_of(const TrainConfig& config) {
  const std::int64_t rows = std::max<std::int64_t>(config.micro_batch_size * config.seq_len, 1);
  const std::int64_t hidden = config.model.hidden_size;
  const std::int64_t vocab = config.model.vocab_size / config.tensor_parallel_size;
  if (config.lm_head_chunk_tokens > 0) return std::min(config.lm_head_chunk_tokens, rows);
  if (vocab <= 2 * hidden) return rows;
  return std::clamp<std::int64_t>((2 * hidden * rows + vocab - 1) / vocab, 1, rows);
}

namespace {

constexpr double kGemmProbeSeconds = 0.3;
constexpr double kLayerProbeSeconds = 0.3;  // each model's runs, after at least 4
// The FLOPs of a 2-layer model's forward and backward up to which layers are timed.
constexpr double kLayerProbeFlops = 8e9;
constexpr double kMemoryProbeSeconds = 0.15;
constexpr std::size_t kMemoryProbeBytes = std::size_t{64} << 20;
// Each of the swap probe's two extents; timed in this many chunks.
constexpr std::size_t kSwapProbeBytes = std::size_t{512} << 20;
constexpr std::size_t kSwapProbeIntervals = 8;
// What a node's MPI over shared memory moves per rank in a collective; not measurable from one
// process, so it is said to be assumed.
constexpr double kAssumedCommBytesPerS = 5e9;

// The products of a decoder layer's MLP at the run's micro-batch, as the model runs them:
// forward (tokens x intermediate, over hidden), the input's gradient (tokens x hidden, over
// intermediate) and the weight's (intermediate x hidden, over tokens), each a third of a layer's
// matrix FLOPs. A square 1024^3 product runs faster than the thin ones of a small micro-batch.
// The GEMMs of one linear layer of `hidden` inputs and `inter` outputs over `tokens` rows,
// forward and both gradients, in the config's compute dtype; `what` names the layer.
Rate gemm_rate(const TrainConfig& config, device::Device* given, std::int64_t tokens,
               std::int64_t hidden, std::int64_t inter, const std::string& what) {
  const DType dt = config.precision;
  struct Shape {
    bool trans_a, trans_b;
    std::int64_t m, n, k;
  };
  const Shape shapes[] = {{false, true, tokens, inter, hidden},
                          {false, false, tokens, hidden, inter},
                          {true, false, inter, hidden, tokens}};
  const std::size_t dsize = dtype_size(dt);
  const auto elems = [](std::int64_t rows, std::int64_t cols) {
    return static_cast<std::size_t>(rows * cols);
  };
  // Three buffers serve every shape: tokens x hidden, tokens x intermediate, intermediate x hidden.
  const std::size_t sizes[] = {elems(tokens, hidden) * dsize, elems(tokens, inter) * dsize,
                               elems(inter, hidden) * dsize};
  std::unique_ptr<device::Device> own;
  if (given == nullptr) {
    device::DeviceOptions o = config.device_options();
    o.memory_limit_bytes = sizes[0] + sizes[1] + sizes[2] + (std::size_t{1} << 20);  // the probe's
    auto made = device::create_device(o);
    if (!made.is_ok()) return {0, false, "not measured: " + made.status().message()};
    own = std::move(*made);
  }
  device::Device* device = given != nullptr ? given : own.get();
  auto x = device->allocate(sizes[0], "GEMM probe");
  auto y = device->allocate(sizes[1], "GEMM probe");
  auto w = device->allocate(sizes[2], "GEMM probe");
  if (!x.is_ok() || !y.is_ok() || !w.is_ok()) {
    return {0, false,
            "not measured: the GEMM probe's " + format_bytes(sizes[0] + sizes[1] + sizes[2]) +
                " do not fit device_memory_limit"};
  }
  device::Stream& s = device->stream(device::StreamKind::kCompute);
  device->fill_zero(x->data(), sizes[0], s);
  device->fill_zero(y->data(), sizes[1], s);
  device->fill_zero(w->data(), sizes[2], s);
  // Forward: y = x w^T; input gradient: x = y w; weight gradient: w = y^T x.
  device::GemmArgs g[3];
  const struct {
    void *a, *b, *c;
  } operands[] = {{x->data(), w->data(), y->data()},
                  {y->data(), w->data(), x->data()},
                  {y->data(), x->data(), w->data()}};
  for (int i = 0; i < 3; ++i) {
    const Shape& sh = shapes[i];
    g[i].trans_a = sh.trans_a;
    g[i].trans_b = sh.trans_b;
    g[i].m = sh.m;
    g[i].n = sh.n;
    g[i].k = sh.k;
    g[i].a = operands[i].a;
    g[i].b = operands[i].b;
    g[i].c = operands[i].c;
    g[i].lda = sh.trans_a ? sh.m : sh.k;
    g[i].ldb = sh.trans_b ? sh.k : sh.n;
    g[i].ldc = sh.n;
    g[i].dtype = dt;
    device->ops().gemm(g[i]);  // warm up: thread pools, packing buffers
  }
  s.synchronize();
  Stopwatch t;
  int rounds = 0;
  while (rounds == 0 || t.elapsed_ms() < kGemmProbeSeconds * 1e3) {
    for (const device::GemmArgs& one : g) device->ops().gemm(one);
    s.synchronize();
    ++rounds;
  }
  const double flops = 3 * 2.0 * static_cast<double>(tokens) * static_cast<double>(hidden) *
                       static_cast<double>(inter) * rounds;
  return {flops / (t.elapsed_ms() / 1e3), true,
          std::string(precision_name(dt)) + " GEMMs of " + what + " (" + std::to_string(tokens) +
              " tokens, " + std::to_string(hidden) + " in, " + std::to_string(inter) +
              " out; forward and both gradients) on " + device->name() + ", " +
              std::to_string(rounds) + " rounds"};
}

// A decoder layer's MLP at the run's micro-batch.
Rate layer_gemm_rate(const TrainConfig& config, device::Device* given) {
  const std::int64_t tokens = std::max<std::int64_t>(config.micro_batch_size * config.seq_len, 1);
  return gemm_rate(config, given, tokens, config.model.hidden_size, config.model.intermediate_size,
                   "a decoder layer's MLP");
}

// A decoder layer's query projection at the run's micro-batch: the attention's products (q, k, v
// and o), narrower than the MLP's.
Rate attention_gemm_rate(const TrainConfig& config, device::Device* given) {
  const std::int64_t tokens = std::max<std::int64_t>(config.micro_batch_size * config.seq_len, 1);
  return gemm_rate(config, given, tokens, config.model.hidden_size,
                   config.model.q_dim() / config.tensor_parallel_size,
                   "a decoder layer's query projection");
}

// The LM head as the model runs it: head_rows_of's chunks of tokens against this rank's rows of
// the vocabulary (at most 256 MiB of them: a wider head runs at the same rate).
Rate head_gemm_rate(const TrainConfig& config, device::Device* given) {
  const std::int64_t hidden = config.model.hidden_size;
  const std::int64_t vocab = config.model.vocab_size / config.tensor_parallel_size;
  const std::int64_t cap =
      std::max<std::int64_t>((std::int64_t{256} << 20) /
                                 (hidden * static_cast<std::int64_t>(dtype_size(config.precision))),
                             1);
  return gemm_rate(config, given, head_rows_of(config), hidden, std::min(vocab, cap),
                   "the LM head's chunk");
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
  // Milliseconds of one forward and backward; its gradients are then dropped, so every pass is
  // a step's one micro-batch.
  Result<double> time_once() {
    Stopwatch t;
    STRATA_RETURN_IF_ERROR(
        model_.forward_backward(*provider_, inputs_.data(), targets_.data(), batch_, seq_, 1.0f)
            .status());
    const double ms = t.elapsed_ms();
    STRATA_RETURN_IF_ERROR(provider_->finish_micro_batch());
    STRATA_RETURN_IF_ERROR(provider_->zero_grads());
    return ms;
  }

 private:
  ProbeModel(const TrainConfig& config, const model::LlamaConfig& model, device::Device& device)
      : layout_(model::ParamLayout::build(model, config.lora(), config.nf4_base())),
        model_(model, layout_, device, unsplit(config.model_options())),
        batch_(config.micro_batch_size),
        seq_(config.seq_len),
        inputs_(static_cast<std::size_t>(batch_ * seq_)),
        targets_(inputs_.size()) {}
  // The probe times a whole layer on one rank (a tensor-parallel rank computes a share of it,
  // a pipeline stage some of the layers; an expert-parallel rank runs its experts over as many
  // rows as the layer's, under balanced routing).
  static model::ModelOptions unsplit(model::ModelOptions o) {
    o.tensor_parallel = {};
    o.pipeline = {};
    o.expert_parallel = {};
    return o;
  }
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
  sys::HostMapping src(kMemoryProbeBytes), dst(kMemoryProbeBytes);
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

// The device's memory bandwidth, as its element-wise ops see it: fp32 adds (two arrays read, one
// written) over 16 MiB arrays on `given` (nullptr: a device of the config's kind made for the
// probe).
Rate device_memory_rate(const TrainConfig& config, device::Device* given) {
  constexpr std::size_t kBytes = std::size_t{16} << 20;
  const auto n = static_cast<std::int64_t>(kBytes / sizeof(float));
  std::unique_ptr<device::Device> own;
  if (given == nullptr) {
    device::DeviceOptions o = config.device_options();
    o.memory_limit_bytes = 3 * kBytes + (std::size_t{1} << 20);
    auto made = device::create_device(o);
    if (!made.is_ok()) return {0, false, "not measured: " + made.status().message()};
    own = std::move(*made);
  }
  device::Device* device = given != nullptr ? given : own.get();
  auto a = device->allocate(kBytes, "memory probe");
  auto b = device->allocate(kBytes, "memory probe");
  auto c = device->allocate(kBytes, "memory probe");
  if (!a.is_ok() || !b.is_ok() || !c.is_ok()) {
    return {0, false, "not measured: the probe's 48 MiB do not fit the device"};
  }
  device::Stream& s = device->stream(device::StreamKind::kCompute);
  device->fill_zero(a->data(), kBytes, s);
  device->fill_zero(b->data(), kBytes, s);
  device->ops().add(a->data(), b->data(), c->data(), n, DType::kF32);  // warm up
  s.synchronize();
  Stopwatch t;
  int reps = 0;
  while (reps == 0 || t.elapsed_ms() < kMemoryProbeSeconds * 1e3) {
    device->ops().add(a->data(), b->data(), c->data(), n, DType::kF32);
    s.synchronize();
    ++reps;
  }
  const double moved = 3.0 * static_cast<double>(kBytes) * reps;
  return {
      moved / (t.elapsed_ms() / 1e3), true,
      "fp32 adds of 16 MiB arrays on " + device->name() + ", " + std::to_string(reps) + " rounds"};
}

// The rate of `bytes` moved in each of `seconds`.
Rate interval_rate(std::size_t bytes, const std::vector<double>& seconds, std::string how) {
  std::vector<double> rates;
  for (double s : seconds) rates.push_back(static_cast<double>(bytes) / std::max(s, 1e-9));
  return median_rate(std::move(rates), std::move(how));
}

// The drive's rates through the configured swap engine on the first swap path: writing, reading,
// and reading one extent while writing another at once, as the NVMe optimizer step does (it reads
// the next sub-group while the last one's results go back). Each is timed over
// kSwapProbeIntervals chunks, so a drive or virtual disk whose rate swings under sustained
// traffic shows the spread a step will see, not only its burst.
void swap_rates(const TrainConfig& config, MachineRates& r) {
  const bool automatic = config.offload_param_auto || config.offload_optimizer_auto;
  const bool nvme = config.uses_nvme() || (automatic && !config.swap_paths.empty());
  if (!nvme) {
    r.nvme_read_bytes = r.nvme_write_bytes =
        r.nvme_mixed_bytes = {0, false, "not needed: nothing lives on nvme"};
    return;
  }
  // Recorded by strata io-bench --write-config: sustained figures at the chosen request size.
  if (config.swap_read_bytes_per_s > 0 && config.swap_write_bytes_per_s > 0) {
    r.nvme_read_bytes = {config.swap_read_bytes_per_s, true,
                         "recorded by strata io-bench (swap_read_bytes_per_s)"};
    r.nvme_write_bytes = {config.swap_write_bytes_per_s, true,
                          "recorded by strata io-bench (swap_write_bytes_per_s)"};
    r.nvme_mixed_bytes =
        config.swap_mixed_bytes_per_s > 0
            ? Rate{config.swap_mixed_bytes_per_s, true,
                   "recorded by strata io-bench (swap_mixed_bytes_per_s)"}
            : Rate{0, false, "not recorded (strata io-bench --op all --write-config records it)"};
    return;
  }
  const auto unmeasured = [&](const std::string& why) {
    r.nvme_read_bytes = r.nvme_write_bytes =
        r.nvme_mixed_bytes = {0, false, "not measured: " + why};
  };
  io::SwapOptions o = swap_options(config, 0);
  o.paths.resize(std::min<std::size_t>(o.paths.size(), 1));  // the first drive, as configured
  o.log_warnings = false;
  auto swap = io::SwapSpace::create(o);
  if (!swap.is_ok()) return unmeasured(swap.status().message());
  // What a run sustained on this drive, where strata train recorded it: a step's own traffic.
  std::string ignored;
  auto learned = read_drive_record(o.paths.front(), (*swap)->engine_name());
  if (learned.is_ok() && learned->has_value()) {
    r.nvme_read_bytes = (*learned)->read;
    r.nvme_write_bytes = (*learned)->write;
    r.nvme_mixed_bytes = (*learned)->mixed;
    return;
  }
  if (!learned.is_ok()) ignored = "; ignored " + learned.status().message();
  auto a = (*swap)->allocate(kSwapProbeBytes, "swap probe");
  if (!a.is_ok()) return unmeasured(a.status().message());
  auto b = (*swap)->allocate(kSwapProbeBytes, "swap probe (second extent)");
  if (!b.is_ok()) {
    (*swap)->free(*a);
    return unmeasured(b.status().message());
  }
  constexpr std::size_t chunk = kSwapProbeBytes / kSwapProbeIntervals;
  sys::HostMapping rbuf(chunk), wbuf(chunk);
  for (std::size_t i = 0; i < chunk; i += 4096) wbuf.data()[i] = std::byte(i >> 12);
  std::vector<double> write_s, read_s, mixed_s;
  Status s;
  // The first writes allocate the files' blocks; training overwrites them, so time the later ones.
  for (std::size_t at = 0; s.is_ok() && at < kSwapProbeBytes; at += chunk) {
    s = (*swap)->write(*a, at, wbuf.data(), chunk).wait();
    if (s.is_ok()) s = (*swap)->write(*b, at, wbuf.data(), chunk).wait();
  }
  for (std::size_t at = 0; s.is_ok() && at < kSwapProbeBytes; at += chunk) {
    Stopwatch t;
    s = (*swap)->write(*a, at, wbuf.data(), chunk).wait();
    write_s.push_back(t.elapsed_ms() / 1e3);
  }
  for (std::size_t at = 0; s.is_ok() && at < kSwapProbeBytes; at += chunk) {
    Stopwatch t;
    s = (*swap)->read(*a, at, rbuf.data(), chunk).wait();
    read_s.push_back(t.elapsed_ms() / 1e3);
  }
  for (std::size_t at = 0; s.is_ok() && at < kSwapProbeBytes; at += chunk) {
    Stopwatch t;
    io::IoHandle reading = (*swap)->read(*a, at, rbuf.data(), chunk);
    Status w = (*swap)->write(*b, at, wbuf.data(), chunk).wait();
    s = reading.wait();
    if (s.is_ok()) s = w;
    mixed_s.push_back(t.elapsed_ms() / 1e3);
  }
  (*swap)->free(*a);
  (*swap)->free(*b);
  if (!s.is_ok()) return unmeasured(s.message());
  const std::string where = (*swap)->engine_name() + " on " + o.paths.front() + ", " +
                            format_bytes(kSwapProbeBytes) + " in " +
                            std::to_string(kSwapProbeIntervals) + " timed chunks of " +
                            format_bytes(config.swap_block_size) + " requests" + ignored;
  r.nvme_write_bytes = interval_rate(chunk, write_s, "write, " + where);
  r.nvme_read_bytes = interval_rate(chunk, read_s, "read, " + where);
  r.nvme_mixed_bytes =
      interval_rate(chunk, mixed_s, "each direction, reading and writing at once, " + where);
}

Json rate_json(const Rate& r) {
  Json j{{"per_s", r.per_s}, {"measured", r.measured}, {"how", r.how}};
  if (r.low_per_s > 0) j["low_per_s"] = r.low_per_s;
  if (r.high_per_s > 0) j["high_per_s"] = r.high_per_s;
  return j;
}

}  // namespace

Rate median_rate(std::vector<double> rates, std::string how) {
  if (rates.empty()) return Rate{0, false, std::move(how)};
  std::sort(rates.begin(), rates.end());
  const std::size_t n = rates.size();
  Rate r{n % 2 == 1 ? rates[n / 2] : (rates[n / 2 - 1] + rates[n / 2]) / 2, true, std::move(how)};
  if (n > 1) {
    r.low_per_s = rates.front();
    r.high_per_s = rates.back();
  }
  return r;
}

Result<Rate> named_gpu_gemm_rate(const std::string& gpu, const TrainConfig& config) {
  struct Gpu {
    const char* name;
    const char* full_name;
    double half, tf32, fp32;  // published dense peaks, TFLOP/s (bf16/fp16 with fp32 accumulation)
  };
  static constexpr Gpu kGpus[] = {{"h100", "H100 SXM", 989.4, 494.7, 66.9},
                                  {"h200", "H200 SXM", 989.4, 494.7, 66.9},
                                  {"a100", "A100 SXM", 312.0, 156.0, 19.5},
                                  {"l40s", "L40S", 362.05, 183.0, 91.6},
                                  {"4090", "GeForce RTX 4090", 165.2, 82.6, 82.6},
                                  {"3090", "GeForce RTX 3090", 35.6, 35.6, 35.6}};
  constexpr double kReached = 776.0 / 989.4;  // cuBLASLt's share of the peak on an H200
  for (const Gpu& g : kGpus) {
    if (gpu != g.name) continue;
    const bool half = config.precision != DType::kF32;
    const double peak = half ? g.half : config.allow_tf32 ? g.tf32 : g.fp32;
    char how[192];
    std::snprintf(how, sizeof(how),
                  "assumed: %s's published dense %s peak, %.0f TFLOP/s, times %.2f (the share "
                  "cuBLAS reached on an H200)",
                  g.full_name,
                  half                ? "bf16/fp16"
                  : config.allow_tf32 ? "TF32"
                                      : "fp32",
                  peak, kReached);
    return Rate{peak * 1e12 * kReached, false, how};
  }
  return invalid_argument("--gpu " + gpu + ": expected one of " + kNamedGpus);
}

Status use_named_gpu(const std::string& gpu, const TrainConfig& config, MachineRates* rates) {
  STRATA_ASSIGN_OR_RETURN(Rate named, named_gpu_gemm_rate(gpu, config));
  if (config.device != device::DeviceKind::kCuda) {
    return invalid_argument("--gpu " + gpu +
                            " predicts a GPU run, but the config's device is \"cpu\"; set "
                            "device \"cuda\"");
  }
  rates->gemm_flops = std::move(named);
  rates->layer_passes = {0, false, "not measured: layers this large run at the GEMM rate"};
  rates->end_passes = rates->layer_passes;
  return Status::ok();
}

MachineRates calibrate(const TrainConfig& config, device::Device* device) {
  MachineRates r;
  try {
    r.gemm_flops = layer_gemm_rate(config, device);
    r.head_gemm_flops = head_gemm_rate(config, device);
    r.attention_gemm_flops = attention_gemm_rate(config, device);
    layer_rates(config, config.model, device, &r.layer_passes, &r.end_passes);
    r.memory_bytes = memory_rate();
    // The device's AdamW's bound, where part of the optimizer may stay there.
    if (config.offload_optimizer_fraction_auto || config.offload_optimizer_fraction < 1.0) {
      r.device_memory_bytes = device_memory_rate(config, device);
    } else {
      r.device_memory_bytes = {0, false, "not measured: the optimizer is not split"};
    }
    swap_rates(config, r);
  } catch (const std::bad_alloc&) {
    r.memory_bytes = {0, false, "not measured: no host memory for the probe"};
  }
  r.comm_bytes = config.intra_node_bytes_per_s > 0
                     ? Rate{config.intra_node_bytes_per_s, false, "given by intra_node_bytes_per_s"}
                     : Rate{kAssumedCommBytesPerS, false,
                            "assumed (MPI over shared memory; one process cannot time a "
                            "collective; intra_node_bytes_per_s gives it)"};
  r.inter_node_bytes =
      config.inter_node_bytes_per_s > 0
          ? Rate{config.inter_node_bytes_per_s, false, "given by inter_node_bytes_per_s"}
          : Rate{r.comm_bytes.per_s, false,
                 "not given (inter_node_bytes_per_s): taken as the rate within a node"};
  return r;
}

Json MachineRates::to_json() const {
  return Json{{"gemm_flops", rate_json(gemm_flops)},
              {"head_gemm_flops", rate_json(head_gemm_flops)},
              {"attention_gemm_flops", rate_json(attention_gemm_flops)},
              {"layer_passes", rate_json(layer_passes)},
              {"end_passes", rate_json(end_passes)},
              {"memory_bytes", rate_json(memory_bytes)},
              {"device_memory_bytes", rate_json(device_memory_bytes)},
              {"nvme_read_bytes", rate_json(nvme_read_bytes)},
              {"nvme_write_bytes", rate_json(nvme_write_bytes)},
              {"nvme_mixed_bytes", rate_json(nvme_mixed_bytes)},
              {"comm_bytes", rate_json(comm_bytes)},
              {"inter_node_bytes", rate_json(inter_node_bytes)}};
}

}  // namespace strata::train
