#!/usr/bin/env bash
# One command from a fresh clone to a training run: installs what is missing, builds Release
# (the CLI and the Python module: PYTHONPATH=build/python /usr/bin/python3 -c "import strata"),
# and trains the small demo model in examples/quickstart.json (25-40 seconds on 2 cores, after
# the first build).
set -euo pipefail
cd "$(dirname "$0")/.."

tools/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
targets=(strata)
grep -q '^build python/strata/_core' build/build.ninja 2>/dev/null && targets+=(strata_python)
cmake --build build --target "${targets[@]}"
build/strata train examples/quickstart.json "$@"
