#!/usr/bin/env bash
# tools/fuzz.sh [SECONDS] [HARNESS...]: builds the libFuzzer harnesses of tests/fuzz (clang,
# AddressSanitizer and UndefinedBehaviorSanitizer, in build-fuzz) and runs each for SECONDS
# (default 60) on one core, as many at once as there are cores, from its seeds (tests/fuzz/corpus/<harness>) and what earlier runs
# found (build-fuzz/corpus/<harness>, kept between runs). Every harness runs by default.
#
# A crash, a sanitizer report, an input that runs over 10 s, or one that makes the process
# allocate more than 2 GiB stops that harness; the input is saved as
# build-fuzz/artifacts/<harness>-crash-<sha1> (or -timeout-, -oom-), the script goes on with the
# others and exits 1 at the end. Fix the parser, then copy the input into
# tests/fuzz/regressions/<harness>/ with a name that says what it was: the ordinary suite
# (strata_fuzz_replay) runs it from then on.
#
# Prints a line a harness: executions, executions a second, corpus units, and the outcome.
# Environment: FUZZ_SEED (default 1, so a run is repeatable), FUZZ_JOBS (build jobs; default nproc),
# FUZZ_PARALLEL (harnesses run at once; default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-60}
shift || true
[[ "$seconds" =~ ^[0-9]+$ && "$seconds" -gt 0 ]] || {
  echo "tools/fuzz.sh: SECONDS must be a positive whole number, got '$seconds'" >&2
  exit 2
}
all=()
for f in tests/fuzz/*_fuzz.cpp; do
  n=$(basename "$f" .cpp)
  all+=("${n%_fuzz}")
done
harnesses=("$@")
[[ ${#harnesses[@]} -gt 0 ]] || harnesses=("${all[@]}")
for h in "${harnesses[@]}"; do
  [[ " ${all[*]} " == *" $h "* ]] || {
    echo "tools/fuzz.sh: no harness '$h'; the harnesses: ${all[*]}" >&2
    exit 2
  }
done

command -v clang++ >/dev/null || tools/install-deps.sh
# Only what the parsers link: no CUDA, MPI, io_uring or oneDNN, no tests or benchmarks.
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DSTRATA_SANITIZE=fuzzer -DSTRATA_WERROR=ON -DSTRATA_CUDA=OFF -DSTRATA_MPI=OFF \
  -DSTRATA_URING=OFF -DSTRATA_ONEDNN=OFF -DSTRATA_BUILD_TESTS=OFF -DSTRATA_BUILD_BENCH=OFF >/dev/null
env CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=true \
  cmake --build build-fuzz -j "${FUZZ_JOBS:-$(nproc)}" --target "${harnesses[@]/#/strata_fuzz_}"

mkdir -p build-fuzz/artifacts
# One harness: its libFuzzer run, its log, and its exit status in build-fuzz/fuzz-<harness>.rc.
run_harness() {
  local h=$1 rc=0
  local work=build-fuzz/corpus/$h
  mkdir -p "$work"
  # UBSan's reports abort (the build has -fno-sanitize-recover); a leak is a finding too.
  UBSAN_OPTIONS=print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
    "build-fuzz/tests/fuzz/strata_fuzz_$h" -seed="${FUZZ_SEED:-1}" -max_total_time="$seconds" -print_funcs=0 \
    -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="build-fuzz/artifacts/$h-" "$work" "tests/fuzz/corpus/$h" \
    >"build-fuzz/fuzz-$h.log" 2>&1 || rc=$?
  echo "$rc" >"build-fuzz/fuzz-$h.rc"
}
# Each harness is one process on one core: FUZZ_PARALLEL of them at once (default nproc), the
# lines printed in the harnesses' order once all have run.
parallel=${FUZZ_PARALLEL:-$(nproc)}
running=0
for h in "${harnesses[@]}"; do
  if [[ $running -ge $parallel ]]; then
    wait -n
    running=$((running - 1))
  fi
  run_harness "$h" &
  running=$((running + 1))
done
wait
failed=()
for h in "${harnesses[@]}"; do
  work=build-fuzz/corpus/$h
  log=build-fuzz/fuzz-$h.log
  rc=$(cat "build-fuzz/fuzz-$h.rc")
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  units=$(find "$work" -type f | wc -l)
  if [[ $rc -eq 0 ]]; then
    printf 'fuzz %-17s %9s runs %6s/s %5s corpus  ok\n' "$h" "${execs:-?}" "${rate:-?}" "$units"
  else
    artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n 1)
    printf 'fuzz %-17s %9s runs %6s/s %5s corpus  FAILED: %s\n' "$h" "${execs:-?}" "${rate:-?}" \
      "$units" "${artifact:-see $log}"
    grep -E '^(==[0-9]+==ERROR|SUMMARY|.*runtime error)' "$log" | head -n 5 || true
    failed+=("$h")
  fi
done
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "tools/fuzz.sh: ${#failed[@]} harness(es) failed: ${failed[*]} (logs: build-fuzz/fuzz-<harness>.log)"
  exit 1
fi
