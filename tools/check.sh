#!/usr/bin/env bash
# Installs what is missing, runs the tiered store's and the prefetch scheduler's tests under
# ThreadSanitizer, then builds everything (warnings are errors; CUDA sources compile where nvcc
# exists) and runs the whole test suite through ctest, whose summary is the last thing printed.
set -euo pipefail
cd "$(dirname "$0")/.."

tools/install-deps.sh
jobs=$(nproc)

# ThreadSanitizer over the code whose tests drive several threads at once: the tiered store and
# the prefetch scheduler (transfer lanes and caller threads), the swap engine (io_uring driver
# threads, buffer registration) and the NVMe-streamed optimizer step. A second, small build of
# just those test binaries (about three minutes on two cores, less with ccache), run directly;
# of the optimizer's tests only the streamed ones (the SIMD ones take minutes under TSan).
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTRATA_SANITIZE=thread \
  -DSTRATA_WERROR=ON -DSTRATA_BUILD_BENCH=OFF -DSTRATA_CUDA=OFF
cmake --build build-tsan -j "$jobs" \
  --target strata_mem_tests strata_sched_tests strata_io_tests strata_optim_tests
tsan=(env TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1")
for t in strata_mem_tests strata_sched_tests strata_io_tests; do
  "${tsan[@]}" "build-tsan/tests/$t" --gtest_brief=1
done
"${tsan[@]}" build-tsan/tests/strata_optim_tests --gtest_brief=1 --gtest_filter='*Streamed*'

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_WERROR=ON
cmake --build build -j "$jobs"
# Tests pin their own thread counts; run two at a time on this class of machine.
ctest --test-dir build --output-on-failure -j "$jobs" --timeout 900
