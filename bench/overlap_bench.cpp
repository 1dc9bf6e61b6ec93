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
// GPU's copy engines; NVMe reads land in device memory by DMA.
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
#include "strata/io/swap.h"
#include "strata/mem/tiered_store.h"
#include "strata/sched/prefetch_scheduler.h"

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

void layer_compute(Rig& rig) {
  device::GemmArgs g;
  g.m = g.n = g.k = kGemmN;
  g.a = rig.a.data();
  g.b = rig.b.data();
  g.c = rig.c.data();
  g.lda = g.ldb = g.ldc = kGemmN;
  rig.device->ops().gemm(g);
  rig.sink += rig.c.as<float>()[7];
}

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

}  // namespace

BENCHMARK_MAIN();
