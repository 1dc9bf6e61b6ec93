#!/usr/bin/env bash
# Installs what is missing, runs the tiered store's and the prefetch scheduler's tests under
# ThreadSanitizer, then builds everything (warnings are errors; CUDA sources compile where nvcc
# exists) and runs the whole test suite through ctest, whose summary is the last thing printed.
set -euo pipefail
cd "$(dirname "$0")/.."

tools/install-deps.sh
jobs=$(nproc)

# ThreadSanitizer over the tiered store and the prefetch scheduler, whose tests drive their
# transfer lanes and several caller threads at once: a second, small build of just those two
# test binaries (about two minutes on two cores, less with ccache), run directly.
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_SANITIZE=thread \
  -DSTRATA_WERROR=ON -DSTRATA_BUILD_BENCH=OFF -DSTRATA_CUDA=OFF
cmake --build build-tsan -j "$jobs" --target strata_mem_tests strata_sched_tests
for t in strata_mem_tests strata_sched_tests; do
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" "build-tsan/tests/$t" --gtest_brief=1
done

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_WERROR=ON
cmake --build build -j "$jobs"
# Tests pin their own thread counts; run two at a time on this class of machine.
ctest --test-dir build --output-on-failure -j "$jobs" --timeout 900
