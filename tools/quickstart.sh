#!/usr/bin/env bash
# One command from a fresh clone to a training run: installs what is missing, builds Release,
# and trains the small demo model in examples/quickstart.json (25-40 seconds on 2 cores, after
# the first build).
set -euo pipefail
cd "$(dirname "$0")/.."

tools/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --target strata
build/strata train examples/quickstart.json "$@"
