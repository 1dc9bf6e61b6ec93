#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU: builds only what the GPU checks need
# (Release, this GPU's architecture, -DSTRATA_GPU_CHECK_ONLY=ON), runs every GPU test (unit and
# training-step), runs the GPU benchmarks (bf16 GEMM peak, training-step MFU for a 1.1B model
# with and without optimizer offload, host<->device copy bandwidth) and prints a table last.
# Designed to finish in under 6 minutes: every phase runs under a timeout drawn from one budget.
#
# The machine may have no package registry. Libraries it lacks are unpacked from Debian
# packages in .debs/ (made here by tools/fetch-gpu-debs.sh and carried along) into a private
# prefix inside the build directory; nothing is installed system-wide.
#
# Usage: tools/gpu-check.sh [--configure-only] [--phase all|tests|bench] [--no-bench]
#   --phase tests: build, then the GPU tests only (correctness); --phase bench: build (a no-op
#   when the same machine built before), then the benchmarks only. Two device calls can so split
#   the check when one would not fit its time limit. --no-bench is --phase tests.
# Environment: GPU_CHECK_BUILD_DIR (build-gpu; logs and results in its gpu-check/),
# GPU_CHECK_OUT (a few key results are copied there at the end; default $OUT when set, as on
# the device tool's machines), GPU_CHECK_JOBS (nproc), GPU_CHECK_ARCH (e.g. 90; default from
# nvidia-smi), GPU_CHECK_BUDGET_S (345), GPU_CHECK_FORCE_DEBS (1: use .debs even for what the
# system has), and the benchmark knobs in bench/gpu_train_step_bench.cpp (STRATA_GPU_BENCH_*).
# STRATA_CUDA_SYNC=1 makes every CUDA op synchronize and check, so a faulting kernel names itself.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root=$PWD
start=$(date +%s)
budget=${GPU_CHECK_BUDGET_S:-345}
configure_only=0
run_bench=1
run_tests=1
while (($#)); do
  case "$1" in
    --configure-only) configure_only=1 ;;
    --no-bench) run_bench=0 ;;
    --phase)
      shift
      case "${1:-}" in
        all) ;;
        tests) run_bench=0 ;;
        bench) run_tests=0 ;;
        *) echo "--phase takes all, tests or bench, not '${1:-}'" >&2; exit 2 ;;
      esac
      ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

build=${GPU_CHECK_BUILD_DIR:-$root/build-gpu}
out=$build/gpu-check                     # every log and result
export_dir=${GPU_CHECK_OUT:-${OUT:-}}    # a few key files copied here at the end (the device
jobs=${GPU_CHECK_JOBS:-$(nproc)}         # tool brings back at most 8 files from $OUT)
rm -rf "$out"
mkdir -p "$build" "$out"
summary=$out/summary.txt
: >"$summary"
export_results() {
  [[ -z "$export_dir" ]] && return 0
  mkdir -p "$export_dir"
  local f
  for f in table.txt summary.txt build.log device_tests.log integration_tests.log \
    train_step_bench.json copy_bench.json attention_bench.log; do
    [[ -f "$out/$f" ]] && cp "$out/$f" "$export_dir/"
  done
  return 0
}
trap export_results EXIT

note() { printf '[gpu-check %4ds] %s\n' "$(($(date +%s) - start))" "$*"; }
record() { printf '%s|%s|%s\n' "$1" "$2" "${3:-}" >>"$summary"; }
# Seconds a phase may take: its own cap, or what is left of the budget less a reserve for the
# summary, whichever is smaller.
phase_limit() {
  local want=$1 left
  left=$((budget - ($(date +%s) - start) - 15))
  ((left < want)) && want=$left
  ((want < 1)) && want=1
  echo "$want"
}

# ---- toolchain and GPU
nvcc=$(command -v nvcc || true)
[[ -z "$nvcc" && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
if [[ -z "$nvcc" ]]; then
  echo "gpu-check: nvcc not found (PATH or /usr/local/cuda/bin)" >&2
  exit 1
fi
gpu_name=unknown
arch=${GPU_CHECK_ARCH:-}
if command -v nvidia-smi >/dev/null; then
  gpu_name=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
  [[ -z "$arch" ]] && arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
    head -1 | tr -d '. ')
fi
[[ -z "$arch" ]] && arch=90
note "GPU: $gpu_name, building for sm_$arch with $("$nvcc" --version | tail -1)"
record "GPU" "$gpu_name" "sm_$arch"
((!run_tests)) && record "phase" "bench" "tests skipped (--phase bench)"
((!run_bench)) && record "phase" "tests" "benchmarks skipped (--phase tests)"

# ---- libraries: use the system's, else unpack carried .debs into $prefix
prefix=$build/deps
mkdir -p "$prefix"
extract() {  # package names; a missing .deb stops the check: the configure would fail anyway
  local pkg f tmp
  for pkg in "$@"; do
    f=$(find "$root/.debs" -maxdepth 1 -name "${pkg}_*.deb" 2>/dev/null | head -1)
    if [[ -z "$f" ]]; then
      echo "gpu-check: this machine lacks $pkg and .debs/ has no ${pkg}_*.deb." >&2
      echo "gpu-check: run tools/fetch-gpu-debs.sh on the Debian machine and carry .debs" \
        "(the device tool's carry: [\".debs\"]); see README, 'Running the GPU check'." >&2
      record "dependencies" "FAILED" "no .deb for $pkg"
      exit 1
    fi
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$f" "$prefix"
    else  # no dpkg: a .deb is an ar archive holding data.tar.*
      tmp=$(mktemp -d)
      (cd "$tmp" && ar x "$f" && tar -xf data.tar.* -C "$prefix")
      rm -rf "$tmp"
    fi
    note "unpacked $(basename "$f")"
  done
}
# GPU_CHECK_FORCE_DEBS=1 ignores the system's copies (to test the .debs path on any machine).
force_debs=${GPU_CHECK_FORCE_DEBS:-0}
have_lib() { ((!force_debs)) && ldconfig -p 2>/dev/null | grep -q "$1"; }
have_cmake_config() {  # e.g. TBB -> a TBBConfig.cmake or tbb-config.cmake under the usual roots
  ((force_debs)) && return 1
  local lower
  lower=$(echo "$1" | tr '[:upper:]' '[:lower:]')
  find /usr/lib /usr/lib64 /usr/share /usr/local /opt -maxdepth 6 \
    \( -name "$1Config.cmake" -o -name "${lower}-config.cmake" \) 2>/dev/null | grep -q .
}
pkg_config=$(command -v pkg-config || command -v pkgconf || true)
if [[ -z "$pkg_config" ]] || ((force_debs)); then
  extract pkgconf-bin libpkgconf3
  pkg_config=$prefix/usr/bin/pkgconf
fi
export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu:$prefix/usr/lib/x86_64-linux-gnu/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PKG_CONFIG_PATH="$prefix/usr/lib/x86_64-linux-gnu/pkgconfig:$prefix/usr/lib/x86_64-linux-gnu/openblas-pthread/pkgconfig:$prefix/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
have_pc() { ((!force_debs)) && "$pkg_config" --exists "$1" 2>/dev/null; }

if ((force_debs)) || [[ ! -f /usr/include/nlohmann/json.hpp && ! -f /usr/local/include/nlohmann/json.hpp ]]; then
  extract nlohmann-json3-dev
fi
if ! have_pc hwloc; then
  extract libhwloc-dev libhwloc15
  have_lib libudev.so.1 || extract libudev1
fi
have_cmake_config TBB || extract libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5
if ! have_pc openblas; then
  extract libopenblas-dev libopenblas-pthread-dev libopenblas0-pthread
  have_lib libgfortran.so.5 || extract libgfortran5
  have_lib libquadmath.so.0 || extract libquadmath0
fi
have_cmake_config GTest || extract libgtest-dev libgmock-dev
have_cmake_config benchmark || extract libbenchmark-dev libbenchmark1debian
# Unpacked .pc files still say prefix=/usr; point them at the private prefix (once).
find "$prefix" -name '*.pc' 2>/dev/null | while read -r pc; do
  grep -q "$prefix" "$pc" || sed -i "s#=/usr#=$prefix/usr#g" "$pc"
done

cmake_args=(
  -S "$root" -B "$build" -G Ninja
  -DCMAKE_BUILD_TYPE=Release
  -DSTRATA_GPU_CHECK_ONLY=ON -DSTRATA_CUDA=ON -DSTRATA_MPI=OFF -DSTRATA_URING=OFF
  -DSTRATA_CUDA_ARCHITECTURES="$arch"
  -DCMAKE_CUDA_COMPILER="$nvcc"
  -DCMAKE_PREFIX_PATH="$prefix/usr"
  -DPKG_CONFIG_EXECUTABLE="$pkg_config"
)
for cfg in TBB GTest benchmark nlohmann_json; do  # distros without lib/<triplet> in CMake's search
  dir=$(find "$prefix" -name "${cfg}Config.cmake" -printf '%h\n' 2>/dev/null | head -1)
  [[ -n "$dir" ]] && cmake_args+=("-D${cfg}_DIR=$dir")
done
# cuBLAS may come only as a pip wheel (nvidia-cublas) beside a bare nvcc.
cuda_lib_dirs=("$(dirname "$nvcc")/../lib64" "$(dirname "$nvcc")/../targets/x86_64-linux/lib")
if ! find "${cuda_lib_dirs[@]}" -maxdepth 1 -name 'libcublasLt.so*' 2>/dev/null | grep -q .; then
  wheel=$(python3 -c 'import nvidia.cublas as m; print(m.__path__[0])' 2>/dev/null || true)
  if [[ -n "$wheel" && -d "$wheel/lib" ]]; then
    lt=$(find "$wheel/lib" -name 'libcublasLt.so*' | head -1)
    bl=$(find "$wheel/lib" -name 'libcublas.so*' | head -1)
    note "cuBLAS from the pip wheel at $wheel"
    cmake_args+=(-DCUDA_cublasLt_LIBRARY="$lt" -DCUDA_cublas_LIBRARY="$bl"
      -DCMAKE_CXX_FLAGS="-I$wheel/include" -DCMAKE_CUDA_FLAGS="-I$wheel/include")
    export LD_LIBRARY_PATH="$wheel/lib:$LD_LIBRARY_PATH"
  fi
fi

# NCCL may come only as a pip wheel (nvidia-nccl-cu13: libnccl.so.2, no unversioned link). One
# process runs NCCL's collectives with no MPI, so the check builds without MPI and still runs
# them (CudaNcclTest).
if ! find "${cuda_lib_dirs[@]}" /usr/lib/x86_64-linux-gnu -maxdepth 1 -name 'libnccl.so*' \
  2>/dev/null | grep -q .; then
  wheel=$(python3 -c 'import nvidia.nccl as m; print(m.__path__[0])' 2>/dev/null || true)
  if [[ -n "$wheel" && -f "$wheel/include/nccl.h" ]]; then
    lib=$(find "$wheel/lib" -name 'libnccl.so*' | head -1)
    note "NCCL from the pip wheel at $wheel"
    cmake_args+=(-DNCCL_LIBRARY="$lib" -DNCCL_INCLUDE_DIR="$wheel/include")
    export LD_LIBRARY_PATH="$wheel/lib:$LD_LIBRARY_PATH"
  fi
fi

# ---- configure and build
t0=$(date +%s)
if ! timeout "$(phase_limit 60)" cmake "${cmake_args[@]}" >"$out/configure.log" 2>&1; then
  tail -30 "$out/configure.log"
  record "configure" "FAILED" "see configure.log"
  exit 1
fi
grep "Strata:" "$out/configure.log"
if grep -q "NCCL=1" "$out/configure.log"; then
  record "NCCL" "built" "CudaNcclTest runs its collectives on one GPU"
else
  record "NCCL" "NOT FOUND" "no libnccl/nccl.h: the NCCL tests are not built"
fi
if ((configure_only)); then
  note "configured $build"
  exit 0
fi
targets=()
((run_tests)) && targets+=(strata_device_tests strata_cuda_integration_tests)
((run_bench)) && grep -q "bench_gpu_train_step" "$build/build.ninja" &&
  targets+=(bench_gpu_copy bench_gpu_attention bench_gpu_train_step)
if ! timeout "$(phase_limit 200)" cmake --build "$build" -j "$jobs" --target "${targets[@]}" \
  >"$out/build.log" 2>&1; then
  grep -E "error|FAILED" "$out/build.log" | head -30
  record "build" "FAILED" "see build.log"
  exit 1
fi
record "build" "ok" "$(($(date +%s) - t0)) s, ${#targets[@]} targets"
note "built in $(($(date +%s) - t0)) s"

# ---- tests
run_tests() {  # name binary filter
  local name=$1 bin=$2 filter=$3 rc
  note "running $name"
  timeout "$(phase_limit 120)" "$bin" --gtest_filter="$filter" \
    --gtest_output="json:$out/$name.json" >"$out/$name.log" 2>&1
  rc=$?
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |tests? ran" "$out/$name.log" | tail -8
  ((rc == 124)) && record "$name" "TIMEOUT" "see $name.log"
  return 0
}
if ((run_tests)); then
  run_tests device_tests "$build/tests/strata_device_tests" '*Cuda*'
  run_tests integration_tests "$build/tests/strata_cuda_integration_tests" '*'
fi

# ---- benchmarks
run_bench() {  # what name cap_s: bench/bench_gpu_<name> -> <name>_bench.{json,log}
  local what=$1 name=$2 cap=$3
  note "$what"
  timeout "$(phase_limit "$cap")" "$build/bench/bench_gpu_$name" \
    --benchmark_out="$out/${name}_bench.json" --benchmark_out_format=json \
    >"$out/${name}_bench.log" 2>&1 ||
    record "$name bench" "FAILED/TIMEOUT" "see ${name}_bench.log"
}
if ((run_bench)) && [[ -x "$build/bench/bench_gpu_copy" ]]; then
  run_bench "copy bandwidth" copy 40
  run_bench "flash attention variants" attention 60
  grep -E "^attention " "$out/attention_bench.log" || true
  run_bench "training-step MFU (1.1B)" train_step 240
  grep -E "measured bf16" "$out/train_step_bench.log" || true
fi

# ---- the table
record "total time" "$(($(date +%s) - start)) s" "budget ${budget} s"
python3 - "$out" >"$out/table.txt" <<'EOF' || cp "$summary" "$out/table.txt"
import json, os, sys
out = sys.argv[1]
rows = [l.rstrip("\n").split("|", 2) for l in open(os.path.join(out, "summary.txt"))]
bench_only = any(r[0] == "phase" and r[1] == "bench" for r in rows)

def tests(name):
    p = os.path.join(out, name + ".json")
    if not os.path.exists(p):
        return None
    d = json.load(open(p))
    passed = failed = skipped = 0
    failures = []
    for suite in d.get("testsuites", []):
        for t in suite.get("testsuite", []):
            if t.get("failures"):
                failed += 1
                failures.append(suite["name"] + "." + t["name"])
            elif t.get("result") == "SKIPPED" or t.get("status") == "NOTRUN":
                skipped += 1
            else:
                passed += 1
    return passed, failed, skipped, failures

def benches(name):
    p = os.path.join(out, name + ".json")
    if not os.path.exists(p):
        return {}
    return {b["name"]: b for b in json.load(open(p)).get("benchmarks", [])}

def why_not_run(name):  # the benchmark's own skip line ("SKIPPED ...: no GPU (...)"), if any
    p = os.path.join(out, name + ".log")
    if os.path.exists(p):
        for line in open(p):
            if line.startswith("SKIPPED"):
                return line.strip()[:70]
    return ""

table = []
for r in rows:
    if r[0] in ("total time",):
        continue
    table.append((r[0], r[1], r[2] if len(r) > 2 else ""))
for name, label in (("device_tests", "GPU unit tests (*Cuda*)"),
                    ("integration_tests", "GPU training tests")):
    t = tests(name)
    if t is None:
        if not bench_only:  # the bench phase runs no tests
            table.append((label, "not run", ""))
        continue
    p, f, s, fails = t
    table.append((label, "FAIL" if f else "ok", f"{p} passed, {f} failed, {s} skipped"))
    for x in fails[:8]:
        table.append(("  failed", x, ""))

ts = benches("train_step_bench")
peak = None
for key, target, label in (("BM_GpuTrainStep/offload_optimizer=none", 0.45, "MFU, no offload"),
                           ("BM_GpuTrainStep/offload_optimizer=cpu", 0.35,
                            "MFU, optimizer offload cpu")):
    b = next((v for k, v in ts.items() if k.startswith(key)), None)
    if b is None:
        table.append((label, "not run", why_not_run("train_step_bench")))
        continue
    if b.get("error_occurred"):
        table.append((label, "ERROR", b.get("error_message", "")[:60]))
        continue
    peak = b.get("peak_tflops", peak)
    mfu = b["mfu"]
    table.append((label, f"{mfu:.3f}", f"target >= {target}: {'PASS' if mfu >= target else 'MISS'}"
                  f"; {b['tokens_per_s']:.0f} tok/s, step {b['step_ms']:.0f} ms"
                  f" (optimizer {b['optimizer_ms']:.0f})"))
if peak:
    table.insert(len(table) - 2, ("bf16 GEMM peak (cuBLASLt 8192^3)", f"{peak:.0f} TFLOP/s", ""))

att = os.path.join(out, "attention_bench.log")
if os.path.exists(att):  # the bench's own summary lines: which flash variant wins
    for line in open(att):
        if line.startswith("attention "):
            what, _, figures = line[len("attention "):].partition(": ")
            table.append(("attention " + what, "", figures.strip()))

cp = benches("copy_bench")
for d in ("h2d", "d2h"):
    def bw(path):
        b = next((v for k, v in cp.items() if k.startswith(f"BM_Copy/{d}/{path}/")), None)
        return None if b is None or b.get("error_occurred") else b["bytes_per_second"]
    dev, plain, pageable = bw("device_pinned"), bw("plain_cudaMemcpyAsync"), bw("device_pageable")
    if dev and plain:
        table.append((f"copy {d}: device path / plain", f"{dev / plain:.3f}",
                      f"target >= 0.9: {'PASS' if dev / plain >= 0.9 else 'MISS'}; "
                      f"{dev / 1e9:.1f} vs {plain / 1e9:.1f} GB/s"
                      + (f"; pageable {pageable / 1e9:.1f} GB/s" if pageable else "")))
    else:
        table.append((f"copy {d}", "not run", why_not_run("copy_bench")))
for r in rows:
    if r[0] == "total time":
        table.append((r[0], r[1], r[2] if len(r) > 2 else ""))

w = max(len(a) for a, _, _ in table)
print()
print("=" * 100)
print("Strata GPU check  (results in %s)" % out)
print("-" * 100)
for a, b, c in table:
    print(f"{a:<{w}}  {b:<14} {c}")
print("=" * 100)
EOF
cat "$out/table.txt"
