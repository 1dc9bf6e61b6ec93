#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU, in one call: a preflight of the machine, a
# build of only what the GPU checks need (Release, this GPU's architecture,
# -DSTRATA_GPU_CHECK_ONLY=ON), then, each under its own timeout drawn from one budget: the GPU
# unit tests, the training-step MFU benchmark (1.1B model; no offload, optimizer offload at
# accumulation 1 and 2, parameters and optimizer on the host), the training integration tests,
# the attention and copy benchmarks, and the NCCL tests last (a hang there loses nothing else).
# A table comes last. Every log, the preflight and the results are packed into
# gpu-check.tar.gz, also when the check stops early; that and the table are what it exports.
#
# The machine may have no package registry. Libraries it lacks are unpacked from Debian
# packages in .debs/ (made here by tools/fetch-gpu-debs.sh and carried along) into a private
# prefix inside the build directory; nothing is installed system-wide.
#
# Usage: tools/gpu-check.sh [--phase all|PHASES] [--no-bench] [--benches LIST]
#                           [--scale-cases LIST] [--configure-only|--build-only] [--rehearse]
#   --phase: all (tests and bench, the default) or a comma list of tests, bench and scale, run
#   in one call under one budget (tests,scale: the GPU tests, then the jobs at scale, with no
#   idle gap between two calls in which the machine could go back); --no-bench drops bench;
#   tests: the GPU tests; bench: the benchmarks; scale: the jobs at the user's scale
#   (bench/scale_bench.cpp: 8B LoRA, QLoRA and full, 70B and 30B-A3B slices, the 1.1B cases),
#   each case in its own process under its own timeout; --scale-cases: which of them (a comma
#   list; default all, most wanted first), e.g. those a first call did not reach; with
#   --rehearse, the scale cases shrunk on the CPU backend with the build in GPU_CHECK_BUILD_DIR
#   as it is (no GPU, nothing built: CI runs it so). --benches: which benchmarks run, a comma
#   list of train_step (the 1.1B MFU), long (the 1.1B step at long sequences with activation
#   offload), attention and copy (default: all). --configure-only: stop after CMake;
#   --build-only: stop after the build (CI builds the check so, with GPU_CHECK_ARCH=90, to know
#   it links before a GPU is lent).
#   The build is skipped when a stamp of the sources' content (not their times, which a copy to
#   another machine changes) matches the last build's and its binaries are there.
# Environment: GPU_CHECK_BUILD_DIR (build-gpu; logs and results in its gpu-check/),
# GPU_CHECK_OUT (where table.txt and gpu-check.tar.gz go at the end; default $OUT when set, as on
# the device tool's machines), GPU_CHECK_JOBS (nproc), GPU_CHECK_ARCH (e.g. 90; default from
# nvidia-smi), GPU_CHECK_BUDGET_S (540 s for the whole check), GPU_CHECK_NVCC (default: nvcc on
# the PATH, else /usr/local/cuda/bin/nvcc), GPU_CHECK_WERROR (1: warnings are errors, as in CI),
# GPU_CHECK_FORCE_DEBS (1: use .debs even for what the system has), the benchmark knobs in
# bench/gpu_train_step_bench.cpp (STRATA_GPU_BENCH_*), STRATA_ATTENTION (auto, flash2 or
# simple: the training step's attention kernels), and STRATA_CUDA_SYNC=1 (every CUDA op
# synchronizes and checks, so a faulting kernel names itself).
# shellcheck disable=SC2317  # finish and write_table run from the EXIT trap
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root=$PWD
start=$(date +%s)

usage() { sed -n '15,31p' "$0" | sed 's/^# \{0,1\}//'; }

mode=all  # all, configure (--configure-only) or build (--build-only)
run_bench=1
run_tests=1
run_scale=0
rehearse=0
no_bench=0
benches=train_step,long,attention,copy
# The scale phase's cases, most wanted first, each with its cap in seconds on a GPU (shrunk on
# the CPU backend under --rehearse, each takes a few); --scale-cases keeps some of them.
scale_cases=(1.1b-host-accum1-auto:45 1.1b-host-accum1:45 8b-lora:90 8b-qlora:90
  8b-full-auto:100 8b-full-host:90 70b-qlora-24g:100 30b-a3b-qlora:100 1.1b-host-accum2:45)
scale_only=""  # --scale-cases
nccl_cap=45    # the NCCL tests' cap, which the scale cases keep when the tests run too
while (($#)); do
  case "$1" in
    --benches)
      shift
      benches=${1:-}
      for b in ${benches//,/ }; do
        case "$b" in
          train_step | long | attention | copy) ;;
          *)
            echo "gpu-check: --benches takes train_step, long, attention and copy, not '$b'" >&2
            exit 2
            ;;
        esac
      done
      ;;
    --configure-only) mode=configure ;;
    --build-only) mode=build ;;
    --no-bench) no_bench=1 ;;
    --rehearse) rehearse=1 ;;
    --phase)
      shift
      run_tests=0 run_bench=0 run_scale=0
      phases=${1:-}
      [[ "$phases" == all ]] && phases=tests,bench
      [[ -n "$phases" ]] || phases=none
      for p in ${phases//,/ }; do
        case "$p" in
          tests) run_tests=1 ;;
          bench) run_bench=1 ;;
          scale) run_scale=1 ;;
          *)
            echo "gpu-check: --phase takes all or a comma list of tests, bench and scale," \
              "not '${1:-}'" >&2
            exit 2
            ;;
        esac
      done
      ;;
    --scale-cases)
      shift
      scale_only=${1:-}
      [[ -n "$scale_only" ]] || scale_only=none
      ;;
    -h | --help)
      usage
      exit 0
      ;;
    *)
      echo "gpu-check: unknown argument '$1'" >&2
      usage >&2
      exit 2
      ;;
  esac
  shift
done
((no_bench)) && run_bench=0
if ((!run_tests && !run_bench && !run_scale)) && [[ "$mode" == all ]]; then
  echo "gpu-check: nothing to run: --phase with --no-bench leaves no phase" >&2
  exit 2
fi
if ((rehearse && (!run_scale || run_tests || run_bench))); then
  echo "gpu-check: --rehearse goes with --phase scale alone" >&2
  exit 2
fi
if [[ -n "$scale_only" ]] && ((!run_scale)); then
  echo "gpu-check: --scale-cases goes with a --phase that has scale" >&2
  exit 2
fi
if [[ -n "$scale_only" ]]; then
  chosen=()
  for c in ${scale_only//,/ }; do
    found=""
    for entry in "${scale_cases[@]}"; do [[ "${entry%%:*}" == "$c" ]] && found=$entry; done
    if [[ -z "$found" ]]; then
      echo "gpu-check: --scale-cases takes a comma list of ${scale_cases[*]%%:*}, not '$c'" \
        "(in '$scale_only')" >&2
      exit 2
    fi
  done
  for entry in "${scale_cases[@]}"; do  # the script's order, most wanted first
    [[ ",$scale_only," == *",${entry%%:*},"* ]] && chosen+=("$entry")
  done
  if ((${#chosen[@]} == 0)); then
    echo "gpu-check: --scale-cases '$scale_only' names no case" >&2
    exit 2
  fi
  scale_cases=("${chosen[@]}")
fi
budget=${GPU_CHECK_BUDGET_S:-540}
if [[ ! "$budget" =~ ^[0-9]+$ ]] || ((budget < 60)); then
  echo "gpu-check: GPU_CHECK_BUDGET_S must be a whole number of seconds, at least 60, not" \
    "'$budget'" >&2
  exit 2
fi
arch=${GPU_CHECK_ARCH:-}
if [[ -n "$arch" && ! "$arch" =~ ^[0-9]+[a-z]?$ ]]; then
  echo "gpu-check: GPU_CHECK_ARCH must be an architecture such as 90 or 90a, not '$arch'" >&2
  exit 2
fi

build=${GPU_CHECK_BUILD_DIR:-$root/build-gpu}
out=$build/gpu-check                   # every log and result; packed into $tarball at the end
tarball=$build/gpu-check.tar.gz
export_dir=${GPU_CHECK_OUT:-${OUT:-}}  # table.txt and the tarball are copied here at the end (the
jobs=${GPU_CHECK_JOBS:-$(nproc)}       # device tool brings back at most 8 files from $OUT)
rm -rf "$out" "$tarball"
mkdir -p "$out"
summary=$out/summary.txt  # key|value|detail rows, the table's source
: >"$summary"

note() { printf '[gpu-check %4ds] %s\n' "$(($(date +%s) - start))" "$*"; }
record() { printf '%s|%s|%s\n' "$1" "$2" "${3:-}" >>"$summary"; }
# A failed step's first error lines, printed under the table.
record_errors() {  # log pattern
  {
    echo "---- ${1##*/}:"
    grep -E "$2" "$1" | head -25
  } >>"$out/errors.txt" 2>/dev/null
}

record_run() {  # name exit-status
  local status
  case $2 in
    0) status=ok ;;
    1) status=FAILED ;;
    124 | 137) status=TIMEOUT ;;
    *) status="CRASHED ($2)" ;;
  esac
  record "run:$1" "$status" ""
}

# Seconds a phase may take: its own cap, or what the budget leaves after `keep` seconds for
# phases that must still run and a reserve for the table and the tarball, whichever is smaller.
reserve=25
phase_limit() {  # cap_s [keep_s]
  local want=$1 keep=${2:-0} left
  left=$((budget - ($(date +%s) - start) - reserve - keep))
  ((left < want)) && want=$left
  ((want < 1)) && want=1
  echo "$want"
}

# ---- the scale phase: each case of bench/scale_bench.cpp in its own process, in this order
# (most wanted first; the cases chosen above), each under its own cap
run_scale() {
  local entry name cap lim free_mib failed=0 args=()
  if ((rehearse)); then
    args+=(--shrink)
  else  # 90% of what the GPU has free, for the cases that set no device budget of their own
    free_mib=$(timeout 20 nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits \
      2>/dev/null | head -1 | tr -d ' ')
    [[ "$free_mib" =~ ^[0-9]+$ ]] && args+=(--device-limit "$((free_mib * 1048576 * 9 / 10))")
  fi
  : >"$out/scale.jsonl"
  for entry in "${scale_cases[@]}"; do
    name=${entry%%:*} cap=${entry##*:}
    ((rehearse)) && cap=120
    lim=$(phase_limit "$cap" "$((run_tests ? nccl_cap : 0))")
    note "scale case $name, up to $lim s"
    timeout -k 10 "$lim" "$build/bench/bench_scale" "$name" --out "$out/scale.jsonl" \
      --models "$root/examples/models" "${args[@]}" >"$out/scale_$name.log" 2>&1
    local rc=$?
    record_run "scale_$name" "$rc"
    ((rc == 0)) || failed=1
    grep -E "^scale " "$out/scale_$name.log"
  done
  return "$failed"
}

# ---- the table and the tarball, however the check ends
dmon_pid=""
stop_dmon() {
  [[ -z "$dmon_pid" ]] && return 0
  kill "$dmon_pid" 2>/dev/null
  wait "$dmon_pid" 2>/dev/null
  dmon_pid=""
}
write_table() {
  python3 - "$out" >"$out/table.txt" 2>"$out/table.err" <<'EOF' || cp "$summary" "$out/table.txt"
import json, os, sys
out = sys.argv[1]

def read(name):
    p = os.path.join(out, name)
    return open(p, errors="replace").read() if os.path.exists(p) else None

rows = [l.split("|", 2) for l in (read("summary.txt") or "").splitlines() if l]
rows = [(r + ["", ""])[:3] for r in rows]
runs = {r[0][4:]: (r[1], r[2]) for r in rows if r[0].startswith("run:")}
table = [r for r in rows if not r[0].startswith("run:") and r[0] != "total time"]

def last_line(name):
    lines = [l for l in (read(name + ".log") or "").splitlines() if l.strip()]
    return lines[-1].strip()[:70] if lines else ""

def tests(name, label):
    if name not in runs:
        return
    status, _ = runs[name]
    d = None
    try:
        d = json.loads(read(name + ".json") or "null")
    except ValueError:
        pass
    if d is None:
        table.append((label, status if status != "ok" else "no result", last_line(name)))
        return
    passed = failed = skipped = 0
    failures, skips = [], []
    for suite in d.get("testsuites", []):
        for t in suite.get("testsuite", []):
            full = suite["name"] + "." + t["name"]
            if t.get("failures"):
                failed += 1
                failures.append(full)
            elif t.get("result") == "SKIPPED" or t.get("status") == "NOTRUN":
                skipped += 1
                skips.append(full)
            else:
                passed += 1
    verdict = "FAIL" if failed else ("ok" if status == "ok" else status)
    if passed + failed + skipped == 0:
        verdict = "none ran"
    table.append((label, verdict, f"{passed} passed, {failed} failed, {skipped} skipped"))
    for x in failures[:8]:
        table.append(("  failed", x, ""))
    if skipped and not passed and not failed:
        table.append(("  skipped, e.g.", skips[0], ""))

def benches(name):
    try:
        d = json.loads(read(name + ".json") or "null")
    except ValueError:
        d = None
    return [] if d is None else d.get("benchmarks", [])

def bench_missing(name, label):
    status = runs.get(name, ("not run", ""))[0]
    for line in (read(name + ".log") or "").splitlines():
        if line.startswith("SKIPPED"):  # the benchmark's own reason: "SKIPPED ...: no GPU (...)"
            return table.append((label, "not run", line.strip()[:70]))
    table.append((label, status if status != "ok" else "no result", last_line(name)))

tests("device_tests", "GPU unit tests (*Cuda*)")

ts = [b for b in benches("train_step_bench") if b["name"].startswith("BM_GpuTrainStep/")]
if "train_step_bench" in runs and not ts:  # stopped early: the cases it printed as it went
    for line in (read("train_step_bench.log") or "").splitlines():
        if line.startswith("train_step "):
            case, _, figures = line[len("train_step "):].partition(": ")
            table.append(("MFU " + case, "", figures[:100]))
    bench_missing("train_step_bench", "training-step MFU")
peak = spec = None
for b in ts:
    label = "MFU " + b["name"].split("/iterations:")[0][len("BM_GpuTrainStep/"):]
    if b.get("error_occurred"):
        table.append((label, "ERROR", b.get("error_message", "")[:70]))
        continue
    peak, spec = b.get("peak_tflops", peak), b.get("spec_tflops", spec)
    mfu, target = b["mfu"], b.get("target_mfu", 0)
    verdict = (f"target >= {target:.2f}: {'PASS' if mfu >= target else 'MISS'}; " if target
               else "")
    table.append((label, f"{mfu:.3f}",
                  verdict + f"of spec {b.get('mfu_spec', 0):.3f}; {b['tokens_per_s']:.0f} tok/s"))
    table.append(("", "", f"step {b['step_ms']:.0f} ms: compute {b['compute_ms']:.0f}, optimizer "
                  f"{b['optimizer_ms']:.0f}, exposed {b.get('exposed_ms', 0):.0f}, wait "
                  f"{b.get('wait_ms', 0):.0f}, stall {b.get('stall_ms', 0):.0f}; "
                  f"{b.get('overlapped_steps', 0):.0f}/{b.get('timed_steps', 0):.0f} overlapped"))
if peak:
    table.append(("bf16 GEMM peak (cuBLASLt 8192^3)", f"{peak:.0f} TFLOP/s",
                  f"specified {spec:.0f} TFLOP/s, measured/specified {peak / spec:.2f}" if spec
                  else "specified peak unknown (STRATA_GPU_SPEC_TFLOPS)"))

dmon = read("dmon.log")
if dmon:  # nvidia-smi dmon during the training-step benchmark
    cols, data = [], []
    for line in dmon.splitlines():
        if line.startswith("# gpu"):
            cols = line[1:].split()
        elif cols and line.strip() and not line.startswith("#"):
            data.append(dict(zip(cols, line.split())))
    def stat(col, f):
        v = [float(r[col]) for r in data if r.get(col, "-").replace(".", "", 1).isdigit()]
        return f(v) if v else None
    parts = []
    for col, what, f, unit in (("pwr", "power max", max, " W"), ("sm", "SM busy mean",
                               lambda v: sum(v) / len(v), "%"), ("pclk", "SM clock max", max,
                               " MHz"), ("mclk", "memory clock", max, " MHz")):
        x = stat(col, f)
        if x is not None:
            parts.append(f"{what} {x:.0f}{unit}")
    if parts:
        table.append(("GPU during MFU (dmon)", f"{len(data)} s", ", ".join(parts)))

tests("integration_tests", "GPU training tests")

if "attention_bench" in runs:
    lines = [l for l in (read("attention_bench.log") or "").splitlines()
             if l.startswith("attention ")]
    for line in lines:  # the bench's own summary: every variant's TFLOP/s and the fastest
        what, _, figures = line[len("attention "):].partition(": ")
        table.append(("attention " + what, "", figures.strip()))
    if not lines:
        bench_missing("attention_bench", "attention variants")

if "copy_bench" in runs:
    cp = {b["name"]: b for b in benches("copy_bench")}
    for d in ("h2d", "d2h"):
        def bw(path):
            b = next((v for k, v in cp.items() if k.startswith(f"BM_Copy/{d}/{path}/")), None)
            return None if b is None or b.get("error_occurred") else b["bytes_per_second"]
        dev, plain = bw("device_pinned"), bw("plain_cudaMemcpyAsync")
        pageable = bw("device_pageable")
        if dev and plain:
            table.append((f"copy {d}: device path / plain", f"{dev / plain:.3f}",
                          f"target >= 0.9: {'PASS' if dev / plain >= 0.9 else 'MISS'}; "
                          f"{dev / 1e9:.1f} vs {plain / 1e9:.1f} GB/s"
                          + (f"; pageable {pageable / 1e9:.1f} GB/s" if pageable else "")))
        else:
            bench_missing("copy_bench", f"copy {d}")

tests("nccl_tests", "NCCL tests (one GPU)")

# The scale phase: a row a case (what bench_scale appended), or the case's run status.
scale = {}
for line in (read("scale.jsonl") or "").splitlines():
    try:
        d = json.loads(line)
        scale[d["case"]] = d
    except (ValueError, KeyError):
        pass
for name, (status, _) in runs.items():
    if not name.startswith("scale_"):
        continue
    case = name[len("scale_"):]
    d = scale.get(case)
    if d is None or "error" in d:
        why = d["error"][:70] if d else last_line("scale_" + case)
        table.append(("scale " + case, status if status != "ok" else "FAILED", why))
        continue
    mfu, target, ratio = d.get("mfu", 0), d.get("target_mfu", 0), d.get("peak_over_plan", 0)
    verdict = f"target >= {target:.2f}: {'PASS' if mfu >= target else 'MISS'}; " if target else ""
    table.append(("scale " + case, f"{d['tokens_per_s']:.0f} tok/s",
                  verdict + f"MFU {mfu:.3f} of {d.get('spec_tflops', 0):.0f} TFLOP/s; "
                  f"fraction {d.get('offload_optimizer_fraction', 1):.3g}"))
    line2 = (f"step {d['step_ms']:.0f} ms: compute {d['compute_ms']:.0f}, optimizer "
             f"{d['optimizer_ms']:.0f}, exposed {d['optimizer_exposed_ms']:.0f}, on the device "
             f"{d['optimizer_device_ms']:.0f}; peak/plan {ratio:.2f} "
             f"({'PASS' if 0.9 <= ratio <= 1.1 else 'MISS'}: within 10%)")
    if d.get("frozen_resident_share", 1) < 1:
        line2 += f"; base kept on the device {d['frozen_resident_share']:.2f}"
    if "extrapolated_step_ms" in d:
        line2 += (f"; {d['layer_ms']:.0f} ms a layer, {d['model_layers']} layers: "
                  f"{d['extrapolated_step_ms'] / 1e3:.2f} s")
    table.append(("", "", line2))
    p = d.get("published")
    if p:
        table.append(("", "", f"beside {p['what']} on one {p['gpu']}: {p['tokens_per_s']:.0f} "
                      f"tok/s, x {p['scale']:.2f} by bf16 peak = {p['scaled_tokens_per_s']:.0f}; "
                      f"this run {p['ratio']:.2f} of it"))
table += [r for r in rows if r[0] == "total time"]

w = max([len(a) for a, _, _ in table] + [10])
print("=" * 100)
print("Strata GPU check  (everything in gpu-check.tar.gz: %s)" % out)
print("-" * 100)
for a, b, c in table:
    print(f"{a:<{w}}  {b:<14} {c}".rstrip())
print("=" * 100)
errors = read("errors.txt")
if errors:
    print("first errors:")
    print(errors.rstrip())
EOF
}
finish() {
  local rc=$?
  trap - EXIT
  stop_dmon
  record "total time" "$(($(date +%s) - start)) s" "budget ${budget} s; exit status $rc"
  write_table
  [[ -s "$out/table.err" ]] || rm -f "$out/table.err"
  echo
  cat "$out/table.txt"
  tar -czf "$tarball" -C "$build" gpu-check 2>/dev/null || echo "gpu-check: could not pack $out"
  if [[ -n "$export_dir" ]]; then
    mkdir -p "$export_dir" && cp "$out/table.txt" "$export_dir/" &&
      { [[ ! -f "$tarball" ]] || cp "$tarball" "$export_dir/"; }
  fi
  exit "$rc"
}
trap finish EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

# ---- preflight: what the machine has, before anything can fail
nvcc=${GPU_CHECK_NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
show() {  # title command...: one section of the preflight, each command under a timeout
  local title=$1
  shift
  printf '\n== %s: %s\n' "$title" "$*"
  timeout 20 "$@" 2>&1 || printf '(exit status %d)\n' "$?"
}
{
  echo "Strata GPU check preflight, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), in $root"
  show "OS" cat /etc/os-release
  show "kernel" uname -srm
  show "nvcc on the PATH" which -a nvcc
  show "nvcc chosen ($nvcc)" "$nvcc" --version
  show "CUDA libraries ldconfig knows" sh -c \
    "ldconfig -p | grep -E 'libcudart|libcublas|libcublasLt|libnccl' || echo none of them"
  show "CUDA toolkit libraries beside nvcc" sh -c "ls -l '$(dirname "$nvcc")'/../lib64/ \
    '$(dirname "$nvcc")'/../lib/ 2>/dev/null | grep -E 'cudart|cublas|nccl' || echo none"
  show "nccl.h" sh -c "find /usr/include /usr/local/include '$(dirname "$nvcc")/../include' \
    -maxdepth 2 -name nccl.h 2>/dev/null"
  show "python3's NVIDIA wheels (cuBLAS, NCCL)" sh -c "python3 -c 'import nvidia, os; \
[print(p) for p in nvidia.__path__]' 2>&1; python3 -m pip list 2>/dev/null | grep -iE \
'nvidia-(cublas|nccl|cuda-runtime)' || true"
  show "gcc" gcc --version
  show "cmake" cmake --version
  show "ninja" ninja --version
  show "python3" python3 --version
  show "nvidia-smi" nvidia-smi
  show "clocks" nvidia-smi -q -d CLOCK
  show "GPU" nvidia-smi --format=csv --query-gpu=name,driver_version,compute_cap,memory.total,\
clocks.max.sm,clocks.max.mem,power.limit
  show "disk" df -h "$root" "$build" /tmp
  show "memory" free -m
  show "cores" nproc
  show "environment" sh -c "env | grep -E '^(PATH|LD_LIBRARY_PATH|CUDA|NCCL|STRATA|GPU_CHECK)' |
    sort"
} >"$out/preflight.txt" 2>&1
note "preflight in $out/preflight.txt"
if ((rehearse)); then  # the scale cases, shrunk, on what GPU_CHECK_BUILD_DIR built
  record "phase" "scale, rehearsed" "shrunk cases on the CPU backend (--rehearse)"
  if [[ ! -x "$build/bench/bench_scale" ]]; then
    record "bench_scale" "NOT BUILT" "$build/bench/bench_scale"
    exit 1
  fi
  run_scale
  exit $?
fi

# ---- toolchain and GPU
if [[ ! -x "$nvcc" ]]; then
  echo "gpu-check: nvcc not found (${GPU_CHECK_NVCC:+GPU_CHECK_NVCC=$nvcc; }PATH or" \
    "/usr/local/cuda/bin); see preflight.txt" >&2
  record "nvcc" "NOT FOUND" "${GPU_CHECK_NVCC:-PATH or /usr/local/cuda/bin}"
  exit 1
fi
record "nvcc" "$("$nvcc" --version 2>&1 | grep -o 'release [0-9.]*' | head -1)" "$nvcc"
gpu_name="none (no nvidia-smi)"
if command -v nvidia-smi >/dev/null; then
  gpu_name=$(timeout 20 nvidia-smi --query-gpu=name,driver_version --format=csv,noheader \
    2>/dev/null | head -1)
  [[ -z "$arch" ]] && arch=$(timeout 20 nvidia-smi --query-gpu=compute_cap \
    --format=csv,noheader 2>/dev/null | head -1 | tr -d '. ')
fi
[[ -z "$arch" ]] && arch=90
note "GPU: ${gpu_name:-unknown}; building for sm_$arch with $("$nvcc" --version | tail -1)"
record "GPU" "${gpu_name:-unknown}" "sm_$arch"
[[ "$mode" != all ]] && record "mode" "--$mode-only" "nothing runs"
phases=""
((run_tests)) && phases+=",tests"
((run_bench)) && phases+=",bench"
((run_scale)) && phases+=",scale"
phases=${phases#,}
if [[ "$mode" == all && "$phases" != tests,bench ]]; then
  what="--phase $phases"
  ((run_scale)) && what+="; scale: ${#scale_cases[@]} cases, ${scale_cases[0]%%:*} first"
  record "phase" "$phases" "$what"
fi

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
  -DSTRATA_GPU_CHECK_ONLY=ON -DSTRATA_CUDA=ON
  -DSTRATA_MPI=OFF -DSTRATA_URING=OFF -DSTRATA_ONEDNN=OFF
  -DSTRATA_WERROR="$([[ ${GPU_CHECK_WERROR:-0} == 1 ]] && echo ON || echo OFF)"
  -DSTRATA_CUDA_ARCHITECTURES="$arch"
  -DCMAKE_CUDA_COMPILER="$nvcc"
  -DCMAKE_PREFIX_PATH="$prefix/usr"
  -DPKG_CONFIG_EXECUTABLE="$pkg_config"
)
for cfg in TBB GTest benchmark nlohmann_json; do  # distros without lib/<triplet> in CMake's search
  dir=$(find "$prefix" -name "${cfg}Config.cmake" -printf '%h\n' 2>/dev/null | head -1)
  [[ -n "$dir" ]] && cmake_args+=("-D${cfg}_DIR=$dir")
done

# ---- cuBLAS and NCCL: from the CUDA toolkit, else from python3's NVIDIA wheels (nvidia-cublas,
# nvidia-nccl-cu13), whose CUDA 12 builds keep each library in nvidia/<name>/{lib,include} and
# CUDA 13 builds in nvidia/cu13/{lib,include}, with versioned names only (libnccl.so.2).
cuda_root=$(cd "$(dirname "$nvcc")/.." && pwd)
cuda_lib_dirs=("$cuda_root/lib64" "$cuda_root/lib" "$cuda_root/targets/x86_64-linux/lib")
cuda_inc_dirs=("$cuda_root/include" "$cuda_root/targets/x86_64-linux/include")
first_match() {  # name-pattern dir...: the first file so named directly in one of the dirs
  local pattern=$1
  shift
  find "$@" -maxdepth 1 -name "$pattern" 2>/dev/null | LC_ALL=C sort | head -1
}
wheel_roots=()
while IFS= read -r dir; do
  [[ -n "$dir" ]] && wheel_roots+=("$dir")
done < <(timeout 30 python3 - 2>/dev/null <<'EOF'
import os, site, sys
dirs = list(sys.path) + list(getattr(site, "getsitepackages", lambda: [])())
seen = []
for d in dirs:
    n = os.path.realpath(os.path.join(d, "nvidia"))
    if os.path.isdir(n) and n not in seen:
        seen.append(n)
print("\n".join(seen))
EOF
)
in_wheels() {  # name-pattern: the first file so named in the wheels' nvidia/ trees
  ((${#wheel_roots[@]})) || return 0
  find "${wheel_roots[@]}" -maxdepth 4 -name "$1" 2>/dev/null | LC_ALL=C sort | head -1
}
extra_includes=()
if [[ -n "$(first_match 'libcublasLt.so*' "${cuda_lib_dirs[@]}")" ]]; then
  record "cuBLAS" "toolkit" "$cuda_root"
else
  lt=$(in_wheels 'libcublasLt.so*')
  header=$(dirname "$(dirname "$lt")")/include/cublasLt.h  # beside the library, else anywhere
  [[ -n "$lt" && -f "$header" ]] || header=$(in_wheels cublasLt.h)
  if [[ -n "$lt" && -n "$header" ]]; then
    libdir=$(dirname "$lt")
    cmake_args+=(-DCUDA_cublasLt_LIBRARY="$lt"
      -DCUDA_cublas_LIBRARY="$(first_match 'libcublas.so*' "$libdir")")
    extra_includes+=("-I$(dirname "$header")")
    export LD_LIBRARY_PATH="$libdir:$LD_LIBRARY_PATH"
    record "cuBLAS" "pip wheel" "$libdir"
    note "cuBLAS from the pip wheel at $libdir"
  else
    record "cuBLAS" "NOT FOUND" "not beside nvcc, not in python3's nvidia/ wheels"
  fi
fi
nccl_lib=$(first_match 'libnccl.so*' "${cuda_lib_dirs[@]}" /usr/lib/x86_64-linux-gnu /usr/lib64)
nccl_h=$(first_match nccl.h "${cuda_inc_dirs[@]}" /usr/include /usr/local/include)
nccl_from=system
if [[ -z "$nccl_lib" || -z "$nccl_h" ]]; then
  wheel_lib=$(in_wheels 'libnccl.so*')
  wheel_h=$(in_wheels nccl.h)
  if [[ -n "$wheel_lib" && -n "$wheel_h" ]]; then
    nccl_lib=$wheel_lib nccl_h=$wheel_h nccl_from="pip wheel"
    LD_LIBRARY_PATH="$(dirname "$wheel_lib"):$LD_LIBRARY_PATH"
  fi
fi
nccl_searched=""
if [[ -n "$nccl_lib" && -n "$nccl_h" ]]; then
  cmake_args+=(-DNCCL_LIBRARY="$nccl_lib" -DNCCL_INCLUDE_DIR="$(dirname "$nccl_h")")
  nccl_found="$nccl_from: $nccl_lib"
else
  nccl_found="CMake's own search"
  nccl_searched="library ${nccl_lib:-not found}, nccl.h ${nccl_h:-not found}"
  nccl_searched+=" (in the toolkit, the system and the wheels)"
fi
if ((${#extra_includes[@]})); then
  cmake_args+=(-DCMAKE_CXX_FLAGS="${extra_includes[*]}" -DCMAKE_CUDA_FLAGS="${extra_includes[*]}")
fi

# ---- configure
t0=$(date +%s)
if [[ "$mode" == all ]]; then
  configure_cap=90 build_cap=330
else  # CI's build on two cores: no GPU time to save
  configure_cap=600 build_cap=3600 budget=$((budget > 7200 ? budget : 7200))
fi
# The MFU benchmark and the unit tests before it keep their time whatever the build takes.
unit_cap=60 mfu_cap=190
# With the scale phase in the same call, the tests keep time for its first three cases.
scale_keep=0
if ((run_scale)); then
  for entry in "${scale_cases[@]:0:3}"; do scale_keep=$((scale_keep + ${entry##*:})); done
fi
keep_for_runs=0
((run_tests)) && keep_for_runs=$((keep_for_runs + unit_cap))
((run_bench)) && [[ ",$benches," == *",train_step,"* ]] && keep_for_runs=$((keep_for_runs + mfu_cap))
((run_scale)) && keep_for_runs=$((keep_for_runs + scale_keep))  # its first cases
[[ "$mode" != all ]] && keep_for_runs=0
if ! timeout "$(phase_limit "$configure_cap" "$keep_for_runs")" cmake "${cmake_args[@]}" \
  >"$out/configure.log" 2>&1; then
  tail -30 "$out/configure.log"
  record "configure" "FAILED" "see configure.log"
  record_errors "$out/configure.log" 'Error|error|not found|NOTFOUND'
  exit 1
fi
grep "Strata:" "$out/configure.log"
if grep -q "NCCL=1" "$out/configure.log"; then
  record "NCCL" "built" "$nccl_found"
else
  record "NCCL" "NOT BUILT" \
    "${nccl_searched:-CMake refused $nccl_found}: the NCCL tests are skipped"
fi
if [[ "$mode" == configure ]]; then
  note "configured $build"
  exit 0
fi

# ---- build, unless the sources' content is what the last build was made from
targets=(strata_device_tests strata_cuda_integration_tests)
binaries=("$build/tests/strata_device_tests" "$build/tests/strata_cuda_integration_tests")
if grep -q "bench_gpu_train_step" "$build/build.ninja" 2>/dev/null; then
  for b in gpu_train_step gpu_attention gpu_copy scale; do
    targets+=("bench_$b")
    binaries+=("$build/bench/bench_$b")
  done
else
  record "benchmarks" "NOT BUILT" "Google Benchmark not found (configure.log)"
fi
source_stamp() {
  {
    printf '%s\n' "${cmake_args[@]}" "${targets[@]}"
    "$nvcc" --version 2>&1 | tail -1
    (cd "$root" && find CMakeLists.txt cmake src include kernels tests bench -type f \
      \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.inc' \
      -o -name '*.in' -o -name '*.cmake' -o -name 'CMakeLists.txt' \) -print0 |
      LC_ALL=C sort -z | xargs -0 sha256sum)
  } | sha256sum | cut -d' ' -f1
}
stamp_file=$build/gpu-check.stamp
stamp=$(source_stamp)
built=1
for b in "${binaries[@]}"; do [[ -x "$b" ]] || built=0; done
t0=$(date +%s)
if ((built)) && [[ -n "$stamp" && -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp" ]]; then
  record "build" "skipped" "sources unchanged since the last build (content stamp)"
  note "build skipped: the sources' content matches the last build's"
else
  rm -f "$stamp_file"
  if ! timeout "$(phase_limit "$build_cap" "$keep_for_runs")" \
    cmake --build "$build" -j "$jobs" --target "${targets[@]}" >"$out/build.log" 2>&1; then
    grep -E "error|FAILED" "$out/build.log" | head -30
    record "build" "FAILED" "after $(($(date +%s) - t0)) s; see build.log"
    record_errors "$out/build.log" 'error|FAILED|Error'
    exit 1
  fi
  echo "$stamp" >"$stamp_file"
  record "build" "ok" "$(($(date +%s) - t0)) s, ${#targets[@]} targets, -j $jobs"
  note "built in $(($(date +%s) - t0)) s"
fi

# ---- register use of the kernels: with cuobjdump (the toolkit's), also each spilling kernel's
# STL/LDL instructions in context; without it, the script's own reading of the cubins
register_use() { timeout 60 "$root/tools/cuda-register-use.sh" --arch "$arch" "$@" "$build"; }
if register_use --sass >"$out/register_use.txt" 2>&1 ||
  register_use >"$out/register_use.txt" 2>&1; then
  record "register use" "$(grep -c ' SPILL ' "$out/register_use.txt") spilling" \
    "$(head -1 "$out/register_use.txt"); register_use.txt"
else
  record "register use" "FAILED" "$(tail -1 "$out/register_use.txt" | cut -c1-70)"
fi
if [[ "$mode" == build ]]; then
  note "built $build"
  exit 0
fi

# ---- runs, each under its own timeout, in the order that keeps the most if one hangs
run_gtest() {  # name what binary filter cap_s keep_s [VAR=value...]
  local name=$1 what=$2 bin=$3 filter=$4 lim
  lim=$(phase_limit "$5" "$6")
  shift 6
  note "$what, up to $lim s"
  timeout -k 10 "$lim" env "$@" "$bin" --gtest_filter="$filter" \
    --gtest_output="json:$out/$name.json" >"$out/$name.log" 2>&1
  record_run "$name" "$?"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |tests? ran" "$out/$name.log" | tail -8
}
run_bench() {  # name what cap_s keep_s: bench/bench_gpu_<name> -> <name>_bench.{json,log}
  local name=$1 what=$2 lim
  lim=$(phase_limit "$3" "$4")
  note "$what, up to $lim s"
  timeout -k 10 "$lim" "$build/bench/bench_gpu_$name" \
    --benchmark_out="$out/${name}_bench.json" --benchmark_out_format=json \
    >"$out/${name}_bench.log" 2>&1
  record_run "${name}_bench" "$?"
}
# Built, and asked for (--benches): the binary of `long` is train_step's.
have_bench() {
  [[ ",$benches," == *",$1,"* ]] || return 1
  [[ -x "$build/bench/bench_gpu_${2:-$1}" ]]
}

if ((run_tests)); then
  run_gtest device_tests "GPU unit tests" "$build/tests/strata_device_tests" '*Cuda*' \
    "$unit_cap" "$((scale_keep + (run_bench ? mfu_cap : 0)))"
fi
if ((run_bench)) && have_bench train_step; then
  if command -v nvidia-smi >/dev/null; then
    timeout "$((mfu_cap + 30))" nvidia-smi dmon -s pucm -d 1 >"$out/dmon.log" 2>&1 &
    dmon_pid=$!
  fi
  run_bench train_step "training-step MFU (1.1B)" "$mfu_cap" 0
  stop_dmon
  grep -E "^(measured|specified|train_step)" "$out/train_step_bench.log"
fi
if ((run_bench)) && have_bench long train_step; then
  # The training and NCCL tests after it keep their time.
  lim=$(phase_limit 200 $((run_tests ? 195 : 0)))
  note "the 1.1B step at long sequences with activation offload, up to $lim s"
  STRATA_GPU_BENCH_CASES=long timeout -k 10 "$lim" "$build/bench/bench_gpu_train_step" \
    --benchmark_out="$out/long_bench.json" --benchmark_out_format=json >"$out/long_bench.log" 2>&1
  record_run long_bench "$?"
  grep -E "^train_step" "$out/long_bench.log"
fi
if ((run_tests)); then
  run_gtest integration_tests "GPU training tests" "$build/tests/strata_cuda_integration_tests" \
    '-CudaNcclTest.*' 150 "$scale_keep"
fi
if ((run_bench)) && have_bench attention; then
  run_bench attention "attention variants (flash2, simple)" 120 0
  grep -E "^attention " "$out/attention_bench.log"
fi
if ((run_bench)) && have_bench copy; then
  run_bench copy "host-device copy bandwidth" 30 0
fi
if ((run_scale)); then
  run_scale
fi
if ((run_tests)); then  # last: an NCCL that hangs costs nothing else
  run_gtest nccl_tests "NCCL tests" "$build/tests/strata_cuda_integration_tests" \
    'CudaNcclTest.*' "$nccl_cap" 0 NCCL_SOCKET_IFNAME=lo NCCL_DEBUG=WARN
fi
exit 0
