// CpuAdam: the host AdamW step over one contiguous span, vectorized (AVX-512, AVX2 or scalar,
// chosen at run time) and parallel over pinned oneTBB workers, bit-identical to
// device::adamw_reference.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "strata/core/dtype.h"
#include "strata/core/status.h"
#include "strata/device/ops.h"
#include "strata/sys/cpu_features.h"

namespace strata::optim {

using sys::SimdPath;

struct CpuAdamOptions {
  int threads = 0;  // worker threads including the caller; 0 = one per physical core (hwloc)
  // "auto" | "scalar" | "avx2" | "avx512". An explicit value wins; "auto" reads the environment
  // variable STRATA_SIMD (same values) and otherwise takes the widest path this CPU supports.
  std::string simd = "auto";
  // Use vcvtneps2bf16 when the CPU has avx512_bf16 (its input-subnormal flush is fixed up, so
  // results do not change); false forces the integer rounding path (tests cover both).
  bool native_bf16 = true;
  bool pin_threads = true;  // bind each oneTBB worker to one core (hwloc) while it is in the arena
  // Elements per tile: the unit of the static partition and of the finite-gradient scan.
  std::int64_t tile_elems = 1 << 15;
  // How the step stores master, moments and the half-precision copy on spans of at least
  // nontemporal_min_elems elements whose arrays are mutually aligned (page-aligned buffers are):
  // non-temporal (streaming) stores skip the read-for-ownership of lines that are only written,
  // but whether that is faster depends on the CPU (3-5% faster on an AMD Zen 5, 1.5-2.2x slower
  // on an AMD Zen 3: bench/RESULTS.md "CPU Adam"). Below the threshold a span's data may still be
  // in cache for whoever reads it next, so stores stay regular; tiles whose arrays are not
  // mutually aligned store regularly whatever this says.
  enum class Stores : std::uint8_t { kAuto, kRegular, kStreaming };
  Stores stores = Stores::kAuto;
  std::int64_t nontemporal_min_elems = 1 << 20;
  // Software prefetch of the f32 input arrays' lines 1 KiB ahead: 1.1-1.35x faster on an AMD
  // Zen 3, slower on an AMD Zen 5 (bench/RESULTS.md "CPU Adam").
  enum class Prefetch : std::uint8_t { kAuto, kOff, kOn };
  Prefetch prefetch = Prefetch::kAuto;
  // kAuto (either) lets the first steps of at least max(nontemporal_min_elems, 1M) elements
  // choose: they run the open variants in turn and time them, and the fastest is kept for the
  // rest of the process (KernelCalibration); shorter steps meanwhile run the baseline (regular
  // stores, no prefetch, or what the options fixed). Every variant writes the same bytes.
};

// What kAuto measured on the first large steps, shared by every CpuAdam of the same path, bf16
// conversion, thread count and store and prefetch options in the process. Samples are times per
// element of whichever large spans came first (any dtypes and sizes): the engine's first steps.
struct KernelCalibration {
  // Median time per element, [streaming][prefetch]; 0 for a variant the options excluded. A
  // variant more than 15% slower than the fastest in the first round is timed only once.
  double ns_per_elem[2][2] = {};
  // The choice: the fastest variant, when it beats regular stores without prefetch (or the
  // first variant open, when that one is closed) by more than 1%.
  bool streaming = false;
  bool prefetch = false;
};

enum class StepOutcome : std::uint8_t {
  kUpdated,
  kSkippedNonFinite,  // the gradient held a NaN or Inf: nothing was written
};

// Move-only. One instance owns a oneTBB arena of `threads` slots; use it from one thread at a
// time (steps are not reentrant).
class CpuAdam {
 public:
  // Errors: an unknown simd name (from the options or STRATA_SIMD), or a path this CPU lacks.
  static Result<CpuAdam> create(const CpuAdamOptions& options = {});
  CpuAdam(CpuAdam&&) noexcept;
  CpuAdam& operator=(CpuAdam&&) noexcept;
  ~CpuAdam();

  // One AdamW step over args.n elements (device::AdamWArgs: f32 param and moments, grad in
  // f32/bf16/f16 multiplied by grad_scale, optional param_out in f32/bf16/f16 rounded to nearest
  // even). Results are bit-identical to device::adamw_reference for every path and thread count.
  //
  // check_finite: first scan the gradient (vectorized, parallel) and, if any element is NaN or
  // Inf, return kSkippedNonFinite with every buffer untouched. The scan is a separate pass
  // because the update is in place: a fused check could only find the bad element after earlier
  // tiles were already written. It costs one extra read of the gradient (4 of the 30 bytes per
  // element moved with an f32 gradient and bf16 output, 2 of 28 with a bf16 gradient). A
  // training loop that already computed the global gradient norm and skips the step when it is
  // not finite (Strata's trainer does, see ZeroProvider::grad_norm) passes false and pays
  // nothing; then non-finite gradients propagate exactly as in the reference.
  [[nodiscard]] StepOutcome step(const device::AdamWArgs& args, bool check_finite = true);

  // True when no element of grad[0, n) is NaN or Inf. Vectorized and parallel.
  bool all_finite(const void* grad, DType grad_dtype, std::int64_t n);

  // For benchmarks: moves exactly the bytes step() moves (reads param, grad, moments; writes
  // param, moments and param_out in the same dtypes, with the same threads, tiles and store
  // kind) with a trivial combine instead of Adam's arithmetic. Overwrites the buffers.
  void memory_roofline(const device::AdamWArgs& args);

  SimdPath simd() const;
  bool uses_native_bf16() const;
  // Whether large spans are stored with streaming stores, and whether the step prefetches: the
  // options' choice, or kAuto's once made (the baseline while it is still choosing).
  bool uses_streaming_stores() const;
  bool uses_prefetch() const;
  // kAuto's measurement once it has chosen, else null (and always null without kAuto).
  const KernelCalibration* calibration() const;
  int threads() const;
  const CpuAdamOptions& options() const;

 private:
  struct Impl;
  explicit CpuAdam(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::optim
