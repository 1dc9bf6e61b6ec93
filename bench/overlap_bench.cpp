// bench_overlap: how well the tiered store and the prefetch scheduler hide transfers behind
// compute. A synthetic model of L layers; each layer has one weight on NVMe and one in host RAM
// that must reach the device, and a fixed busy sgemm as its compute. Every iteration times, back
// to back (the machine's memory bandwidth changes mode every few tens of seconds, so only
// figures from one iteration are compared):
//   compute   the L sgemms with nothing to move,
//   transfer  a scheduler pass with no compute: every weight fetched, prefetched ahead,
//   step      the real thing: prefetched pass with compute.
// overlap_ratio = step / max(compute, transfer): 1.0 is perfect overlap. The transfer size is
// calibrated so that transfer takes `transfer_pct`% of compute (100 = balanced). With
// `across_passes` 0 (the training engine's setting) each pass fetches its first layer on demand,
// a floor of about 1 + 1/layers when balanced; 1 lets the scheduler start the next pass's first
// fetches at the end of a pass (data unchanged between passes, as in gradient accumulation).
// `nvme_pct` is the share of the bytes that comes from NVMe (the rest from host RAM). On the CPU
// backend a host->device copy is a memcpy on one of the two cores the sgemm also needs, unlike a
// GPU's copy engines; NVMe reads land in device memory by DMA. BM_OptimizerOverlap (below) does
// the same for the training engine's whole step, the optimizer included.
#include <benchmark/benchmark.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numeric>
#include <vector>

#include "strata/core/aligned.h"
#include "strata/core/clock.h"
#include "strata/device/device.h"
#include "strata/dist/process_grid.h"
#include "strata/io/swap.h"
#include "strata/mem/tiered_store.h"
#include "strata/sched/prefetch_scheduler.h"
#include "strata/zero/zero_provider.h"

namespace {

using namespace strata;  // NOLINT: a benchmark's main file

constexpr int kGemmN = 1024;  // a compute-bound sgemm: 2.1 GFLOP, tens of ms on one core

struct Rig {
  std::unique_ptr<device::Device> device;
  std::unique_ptr<io::SwapSpace> swap;
  std::unique_ptr<mem::TieredStore> store;
  std::unique_ptr<sched::PrefetchScheduler> sched;
  std::vector<mem::Handle> nvme, host;
  std::vector<std::uint8_t> pattern;  // the byte each layer's weights are filled with
  device::DeviceBuffer a, b, c;
  std::uint64_t bytes_per_pass = 0;
  float sink = 0;
};

std::string swap_dir() {
  const auto p = std::filesystem::temp_directory_path() / "strata-bench-overlap-swap";
  std::filesystem::create_directories(p);
  return p.string();
}

Result<std::unique_ptr<Rig>> make_rig(int layers, std::size_t nvme_bytes, std::size_t host_bytes,
                                      bool across_passes) {
  auto rig = std::make_unique<Rig>();
  device::DeviceOptions dopts;
  dopts.kind = strata::device::DeviceKind::kCpu;
  dopts.compute_threads = 1;  // the other core moves data
  STRATA_ASSIGN_OR_RETURN(rig->device, device::create_device(dopts));
  io::SwapOptions sopts;
  sopts.paths = {swap_dir()};
  sopts.block_size_bytes = 1 << 20;
  sopts.queue_depth = 16;
  STRATA_ASSIGN_OR_RETURN(rig->swap, io::SwapSpace::create(sopts));
  const std::uint64_t layer_bytes = nvme_bytes + host_bytes;
  mem::StoreOptions so;
  // Room for five layers' weights: the one computing and a few arriving.
  so.budget_bytes = {5 * layer_bytes, 0, 0};
  so.staging_buffer_bytes = 8 << 20;
  so.num_staging_buffers = 4;
  STRATA_ASSIGN_OR_RETURN(rig->store, mem::TieredStore::create(*rig->device, rig->swap.get(), so));
  AlignedBuffer fill(align_up(std::max(nvme_bytes, host_bytes), io::kIoAlignBytes));
  for (int l = 0; l < layers; ++l) {
    const auto byte = static_cast<std::uint8_t>(17 + l);
    rig->pattern.push_back(byte);
    std::memset(fill.data(), byte, fill.size());
    STRATA_ASSIGN_OR_RETURN(
        mem::Handle n,
        rig->store->add(mem::TensorSpec{"nvme." + std::to_string(l), nvme_bytes, Tier::kNvme}));
    STRATA_ASSIGN_OR_RETURN(
        mem::Handle h,
        rig->store->add(mem::TensorSpec{"host." + std::to_string(l), host_bytes, Tier::kHost}));
    STRATA_RETURN_IF_ERROR(rig->store->write(n, fill.data(), fill.size()));
    STRATA_RETURN_IF_ERROR(rig->store->write(h, fill.data(), fill.size()));
    rig->nvme.push_back(n);
    rig->host.push_back(h);
  }
  rig->bytes_per_pass = static_cast<std::uint64_t>(layers) * layer_bytes;
  sched::PrefetchOptions po;
  po.prefetch_bytes = 2 * layer_bytes;
  po.max_live_bytes = 4 * layer_bytes;
  po.max_reuse_distance = 0;
  po.follow_hints = false;
  po.prefetch_across_passes = across_passes;
  rig->sched = std::make_unique<sched::PrefetchScheduler>(*rig->store, po);
  const std::size_t g = static_cast<std::size_t>(kGemmN) * kGemmN * sizeof(float);
  STRATA_ASSIGN_OR_RETURN(rig->a, rig->device->allocate(g, "gemm a"));
  STRATA_ASSIGN_OR_RETURN(rig->b, rig->device->allocate(g, "gemm b"));
  STRATA_ASSIGN_OR_RETURN(rig->c, rig->device->allocate(g, "gemm c"));
  for (int i = 0; i < kGemmN * kGemmN; ++i) {
    rig->a.as<float>()[i] = static_cast<float>(i % 7) * 0.01f;
    rig->b.as<float>()[i] = static_cast<float>(i % 5) * 0.01f;
  }
  return rig;
}

// One layer's compute: the busy sgemm, its result folded into `sink`.
void sgemm(device::Device& device, device::DeviceBuffer& a, device::DeviceBuffer& b,
           device::DeviceBuffer& c, float& sink) {
  device::GemmArgs g;
  g.m = g.n = g.k = kGemmN;
  g.a = a.data();
  g.b = b.data();
  g.c = c.data();
  g.lda = g.ldb = g.ldc = kGemmN;
  device.ops().gemm(g);
  sink += c.as<float>()[7];
}

void layer_compute(Rig& rig) { sgemm(*rig.device, rig.a, rig.b, rig.c, rig.sink); }

// One pass through the layers; `verify` checks every byte that arrived.
Status pass(Rig& rig, bool compute, bool verify) {
  for (std::size_t l = 0; l < rig.nvme.size(); ++l) {
    STRATA_ASSIGN_OR_RETURN(void* wn, rig.sched->acquire(rig.nvme[l]));
    STRATA_ASSIGN_OR_RETURN(void* wh, rig.sched->acquire(rig.host[l]));
    if (verify) {
      for (auto [p, h] : {std::pair{wn, rig.nvme[l]}, std::pair{wh, rig.host[l]}}) {
        const auto* bytes = static_cast<const std::uint8_t*>(p);
        const std::size_t n = rig.store->spec(h).size_bytes;
        if (std::any_of(bytes, bytes + n, [&](std::uint8_t x) { return x != rig.pattern[l]; })) {
          return data_loss("layer " + std::to_string(l) + " arrived with wrong bytes");
        }
      }
    }
    rig.sink += static_cast<float>(static_cast<const std::uint8_t*>(wn)[0]);
    if (compute) layer_compute(rig);
    rig.sched->release(rig.nvme[l]);
    rig.sched->release(rig.host[l]);
  }
  rig.sched->end_pass();
  return Status::ok();
}

double compute_pass_ms(Rig& rig, int layers) {
  Stopwatch sw;
  for (int l = 0; l < layers; ++l) layer_compute(rig);
  return sw.elapsed_ms();
}

double cpu_ms() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto ms = [](const timeval& t) { return t.tv_sec * 1e3 + t.tv_usec * 1e-3; };
  return ms(u.ru_utime) + ms(u.ru_stime);
}

// Wall milliseconds of one pass; *cpu gets the process's CPU milliseconds in it.
double timed_pass_ms(Rig& rig, bool compute, Status* st, double* cpu = nullptr) {
  const double c0 = cpu_ms();
  Stopwatch sw;
  *st = pass(rig, compute, false);
  const double wall = sw.elapsed_ms();
  if (cpu != nullptr) *cpu = cpu_ms() - c0;
  return wall;
}

// args: layers, transfer time as a percentage of compute time, prefetch across passes, share
// of the bytes from NVMe in percent
void BM_Overlap(benchmark::State& state) {
  const int layers = static_cast<int>(state.range(0));
  const double target = static_cast<double>(state.range(1)) / 100.0;
  const bool across_passes = state.range(2) != 0;
  // Calibrate: size the layer's NVMe and host weights (in the ratio nvme_pct) from the measured
  // transfer rate so that transfer takes `target` of compute (medians of three passes each).
  const std::size_t nvme_pct = static_cast<std::size_t>(state.range(3));
  std::size_t nvme_bytes = std::max<std::size_t>(4096, (std::size_t{32} << 20) * nvme_pct / 100);
  std::size_t host_bytes =
      std::max<std::size_t>(4096, (std::size_t{32} << 20) * (100 - nvme_pct) / 100);
  std::unique_ptr<Rig> rig;
  auto median3 = [](double a, double b, double c) {
    return std::max(std::min(a, b), std::min(std::max(a, b), c));
  };
  for (int round = 0; round < 4; ++round) {
    auto r = make_rig(layers, nvme_bytes, host_bytes, across_passes);
    if (!r.is_ok()) {
      state.SkipWithError(r.status().to_string().c_str());
      return;
    }
    rig = std::move(*r);
    Status st = pass(*rig, false, true);  // records the trace and checks every byte
    if (st.is_ok()) st = pass(*rig, true, true);
    if (!st.is_ok()) {
      state.SkipWithError(st.to_string().c_str());
      return;
    }
    const double c = median3(compute_pass_ms(*rig, layers), compute_pass_ms(*rig, layers),
                             compute_pass_ms(*rig, layers));
    const double t = median3(timed_pass_ms(*rig, false, &st), timed_pass_ms(*rig, false, &st),
                             timed_pass_ms(*rig, false, &st));
    const double scale = std::clamp(target * c / t, 0.1, 10.0);
    if (std::abs(scale - 1.0) < 0.05 || round == 3) break;
    nvme_bytes = align_up(static_cast<std::size_t>(static_cast<double>(nvme_bytes) * scale), 4096);
    host_bytes = align_up(static_cast<std::size_t>(static_cast<double>(host_bytes) * scale), 4096);
    rig.reset();
  }
  double sum_step = 0, sum_compute = 0, sum_transfer = 0, sum_stall = 0, sum_ratio = 0;
  double sum_transfer_cpu = 0;
  int n = 0;
  for (auto _ : state) {
    state.PauseTiming();
    const double c = compute_pass_ms(*rig, layers);
    Status st;
    double t_cpu = 0;
    const double t = timed_pass_ms(*rig, false, &st, &t_cpu);
    sum_transfer_cpu += t_cpu;
    const double stall0 = rig->store->stats().stall_ms;
    state.ResumeTiming();
    const double s = timed_pass_ms(*rig, true, &st);
    if (!st.is_ok()) {
      state.SkipWithError(st.to_string().c_str());
      return;
    }
    state.PauseTiming();
    sum_stall += rig->store->stats().stall_ms - stall0;
    sum_step += s;
    sum_compute += c;
    sum_transfer += t;
    sum_ratio += s / std::max(c, t);
    ++n;
    state.ResumeTiming();
  }
  benchmark::DoNotOptimize(rig->sink);
  const sched::SchedulerStats ss = rig->sched->stats();
  state.counters["overlap_ratio"] = sum_ratio / n;
  state.counters["stall_ms"] = sum_stall / n;
  state.counters["step_ms"] = sum_step / n;
  state.counters["compute_ms"] = sum_compute / n;
  state.counters["transfer_ms"] = sum_transfer / n;
  // CPU time the transfers cost on their own: on the CPU backend they share its two cores.
  state.counters["transfer_cpu_ms"] = sum_transfer_cpu / n;
  state.counters["MB_per_pass"] = static_cast<double>(rig->bytes_per_pass) / 1e6;
  state.counters["transfer_MBps"] =
      static_cast<double>(rig->bytes_per_pass) / 1e3 / (sum_transfer / n);
  state.counters["order_changes"] = static_cast<double>(ss.order_changes);
  state.SetBytesProcessed(static_cast<std::int64_t>(rig->bytes_per_pass) * n);
}

BENCHMARK(BM_Overlap)
    ->ArgNames({"layers", "transfer_pct", "across_passes", "nvme_pct"})
    ->Args({16, 100, 0, 75})
    ->Args({16, 100, 1, 75})
    ->Args({16, 100, 0, 100})
    ->Args({16, 100, 1, 100})
    ->Args({16, 50, 0, 75})
    ->Args({16, 200, 0, 75})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(8)
    ->UseRealTime();

// ---- BM_OptimizerOverlap: the training engine's step, optimizer included ----
//
// One rank's ZeroProvider (its shard store and optimizer schedule) over L layer groups (parameters
// and optimizer state on NVMe, bf16 working copies and gradients, the CPU Adam streamed from NVMe),
// driven as a model would: a forward pass acquiring each group, a backward pass in reverse
// acquiring each group and its gradient, then the gradient norm and the step. Each layer's compute
// is the sgemm above (once in forward, twice in backward). Every iteration times, back to back:
//   compute    the 3L sgemms alone,
//   serial     a training step without compute, optimizer_overlap "none": the transfers and
//              the optimizer (the step's floor on this disk),
//   step       training steps with compute under the benchmark's schedule (the mean of two, as
//              an overlapped update runs on into the next step's forward).
// overlap_ratio = step / max(compute, serial). The group size is calibrated so that serial takes
// `optimizer_pct`% of compute.

struct EngineRig {
  std::unique_ptr<device::Device> device;
  std::unique_ptr<io::SwapSpace> swap;
  model::ParamLayout layout;
  std::unique_ptr<dist::ProcessGrid> grid;
  std::unique_ptr<zero::ZeroProvider> engine;
  device::DeviceBuffer a, b, c;
  std::int64_t step = 0;
  float sink = 0;
};

Result<std::unique_ptr<EngineRig>> make_engine_rig(int layers, std::int64_t elems,
                                                   zero::OptimizerOverlap overlap,
                                                   const std::string& name) {
  auto rig = std::make_unique<EngineRig>();
  device::DeviceOptions dopts;
  dopts.kind = strata::device::DeviceKind::kCpu;
  dopts.compute_threads = 1;  // the other core runs the optimizer and moves data
  dopts.memory_limit_bytes = static_cast<std::uint64_t>(8 * elems) * 2 + (std::uint64_t{64} << 20);
  STRATA_ASSIGN_OR_RETURN(rig->device, device::create_device(dopts));
  // Each rig its own directory: a swap directory serves one swap space at a time.
  const std::string dir = swap_dir() + "/" + name;
  std::filesystem::create_directories(dir);
  io::SwapOptions sopts;
  sopts.paths = {dir};
  sopts.block_size_bytes = 1 << 20;
  sopts.queue_depth = 16;
  STRATA_ASSIGN_OR_RETURN(rig->swap, io::SwapSpace::create(sopts));
  std::vector<model::ParamGroup> groups;
  for (int l = 0; l < layers; ++l) {
    model::ParamGroup g;
    g.name = "layers." + std::to_string(l);
    g.tensors.push_back(
        model::TensorSpec{g.name + ".weight", {elems}, 0, elems, model::TensorInit::kNormal});
    g.num_elems = elems;
    groups.push_back(std::move(g));
  }
  rig->layout = model::ParamLayout::from_groups(std::move(groups));
  zero::ShardOptions eo;
  eo.offload_param = Tier::kNvme;
  eo.offload_optimizer = Tier::kNvme;
  eo.compute_dtype = DType::kBF16;
  eo.overlap = overlap;
  eo.cpu_adam.threads = 1;
  eo.sub_group_size = 1 << 20;
  eo.prefetch_bytes = static_cast<std::uint64_t>(2 * elems) * 2;
  eo.max_live_bytes = static_cast<std::uint64_t>(4 * elems) * 2;
  rig->grid = dist::ProcessGrid::single_rank(*rig->device);
  STRATA_ASSIGN_OR_RETURN(rig->engine,
                          zero::ZeroProvider::create(rig->layout, 0, *rig->device, rig->swap.get(),
                                                     *rig->grid, zero::ZeroOptions{}, eo));
  STRATA_RETURN_IF_ERROR(rig->engine->load_master([](const model::ParamGroup& g, float* dst) {
    for (std::int64_t i = 0; i < g.num_elems; ++i) dst[i] = 0.01f * static_cast<float>(i % 13);
    return Status::ok();
  }));
  const std::size_t gb = static_cast<std::size_t>(kGemmN) * kGemmN * sizeof(float);
  STRATA_ASSIGN_OR_RETURN(rig->a, rig->device->allocate(gb, "gemm a"));
  STRATA_ASSIGN_OR_RETURN(rig->b, rig->device->allocate(gb, "gemm b"));
  STRATA_ASSIGN_OR_RETURN(rig->c, rig->device->allocate(gb, "gemm c"));
  std::memset(rig->a.data(), 0, gb);
  std::memset(rig->b.data(), 0, gb);
  return rig;
}

void engine_gemm(EngineRig& rig) { sgemm(*rig.device, rig.a, rig.b, rig.c, rig.sink); }

// One training step: forward, backward (gradients of 1e-3, announced as the step's last
// micro-batch), the norm and the update.
Status engine_step(EngineRig& rig, bool compute) {
  zero::ZeroProvider& e = *rig.engine;
  const int n = rig.layout.num_groups();
  ++rig.step;
  e.begin_last_micro_batch(1e-4, rig.step, false);
  for (int l = 0; l < n; ++l) {
    STRATA_ASSIGN_OR_RETURN(const void* p, e.acquire_params(l));
    if (l + 1 < n) e.prefetch_params(l + 1);
    rig.sink += static_cast<float>(static_cast<const std::uint8_t*>(p)[0]);
    if (compute) engine_gemm(rig);
    e.release_params(l);
  }
  for (int l = n - 1; l >= 0; --l) {
    STRATA_ASSIGN_OR_RETURN(const void* p, e.acquire_params(l));
    if (l > 0) e.prefetch_params(l - 1);
    STRATA_ASSIGN_OR_RETURN(void* grad, e.acquire_grads(l, model::GradientWrite::kWrite));
    rig.sink += static_cast<float>(static_cast<const std::uint8_t*>(p)[0]);
    const auto elems = static_cast<std::size_t>(rig.layout.group(l).num_elems);
    // A small constant gradient in bf16 (0x3a83 ~ 1e-3): written as a kernel would.
    std::fill_n(static_cast<std::uint16_t*>(grad), elems, std::uint16_t{0x3a83});
    if (compute) {
      engine_gemm(rig);
      engine_gemm(rig);
    }
    e.release_params(l);
    STRATA_RETURN_IF_ERROR(e.release_grads(l));
  }
  STRATA_RETURN_IF_ERROR(e.finish_micro_batch());
  STRATA_ASSIGN_OR_RETURN(const double norm, e.grad_norm());
  rig.sink += static_cast<float>(norm);
  return e.step(1e-4, rig.step, 1.0f);
}

// args: layers, serial time (transfers + optimizer) as a percentage of compute, schedule
// (0 none, 2 backward)
void BM_OptimizerOverlap(benchmark::State& state) {
  const int layers = static_cast<int>(state.range(0));
  const double target = static_cast<double>(state.range(1)) / 100.0;
  const auto overlap = static_cast<zero::OptimizerOverlap>(state.range(2));
  std::int64_t elems = 1 << 21;
  std::unique_ptr<EngineRig> serial, rig;
  Status st;
  const auto timed = [&](EngineRig& r, bool compute, int steps) -> double {
    Stopwatch sw;
    for (int i = 0; i < steps && st.is_ok(); ++i) st = engine_step(r, compute);
    if (st.is_ok()) st = r.engine->finish_step();
    return sw.elapsed_ms() / steps;
  };
  const auto compute_ms = [&](EngineRig& r) {
    Stopwatch sw;
    for (int i = 0; i < 3 * layers; ++i) engine_gemm(r);
    return sw.elapsed_ms();
  };
  for (int round = 0; round < 3; ++round) {
    serial.reset();
    auto r = make_engine_rig(layers, elems, zero::OptimizerOverlap::kNone, "serial");
    if (!r.is_ok()) {
      state.SkipWithError(r.status().to_string().c_str());
      return;
    }
    serial = std::move(*r);
    timed(*serial, false, 1);  // records the prefetch trace
    const double t = timed(*serial, false, 2), c = compute_ms(*serial);
    if (!st.is_ok()) {
      state.SkipWithError(st.to_string().c_str());
      return;
    }
    const double scale = std::clamp(target * c / t, 0.1, 10.0);
    if (std::abs(scale - 1.0) < 0.1 || round == 2) break;
    elems = static_cast<std::int64_t>(align_up(
        static_cast<std::size_t>(static_cast<double>(elems) * scale), std::size_t{1} << 16));
  }
  auto r = make_engine_rig(layers, elems, overlap, "step");
  if (!r.is_ok()) {
    state.SkipWithError(r.status().to_string().c_str());
    return;
  }
  rig = std::move(*r);
  timed(*rig, true, 1);
  double sum_ratio = 0, sum_step = 0, sum_compute = 0, sum_serial = 0, sum_exposed = 0;
  int n = 0;
  for (auto _ : state) {
    state.PauseTiming();
    const double c = compute_ms(*rig);
    const double t = timed(*serial, false, 2);
    const double exposed0 = rig->engine->stats().optimizer_exposed_ms;
    state.ResumeTiming();
    const double s = timed(*rig, true, 2);
    state.PauseTiming();
    if (!st.is_ok()) {
      state.SkipWithError(st.to_string().c_str());
      return;
    }
    sum_exposed += (rig->engine->stats().optimizer_exposed_ms - exposed0) / 2;
    sum_ratio += s / std::max(c, t);
    sum_step += s;
    sum_compute += c;
    sum_serial += t;
    ++n;
    state.ResumeTiming();
  }
  benchmark::DoNotOptimize(rig->sink);
  state.counters["overlap_ratio"] = sum_ratio / n;
  state.counters["step_ms"] = sum_step / n;
  state.counters["compute_ms"] = sum_compute / n;
  state.counters["serial_ms"] = sum_serial / n;
  state.counters["exposed_ms"] = sum_exposed / n;
  state.counters["group_MB"] = static_cast<double>(elems) * 28 / 1e6;  // state, bf16 copies
}

BENCHMARK(BM_OptimizerOverlap)
    ->ArgNames({"layers", "optimizer_pct", "overlap"})
    ->Args({12, 100, 0})
    ->Args({12, 100, 2})
    ->Unit(benchmark::kMillisecond)
    ->Iterations(4)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
