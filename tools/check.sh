#!/usr/bin/env bash
# Installs what is missing, builds everything (warnings are errors; CUDA sources compile where
# nvcc exists) and runs the whole test suite through ctest.
set -euo pipefail
cd "$(dirname "$0")/.."

tools/install-deps.sh
jobs=$(nproc)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_WERROR=ON
cmake --build build -j "$jobs"
# Tests pin their own thread counts; run two at a time on this class of machine.
ctest --test-dir build --output-on-failure -j "$jobs" --timeout 900
