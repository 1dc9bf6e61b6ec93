#!/usr/bin/env bash
# One command from a fresh clone to a training run: installs what is missing, builds Release
# (the CLI and the Python module, which Debian's python3 then imports: a .pth file in its site
# directory names build/python),
# and trains the small demo model in examples/quickstart.json (25-40 seconds on 2 cores, after
# the first build).
set -euo pipefail
cd "$(dirname "$0")/.."

tools/install-deps.sh
# -U: the CUDA architectures at their default (80;89;90) should tools/check.sh, which shares
# build/, have narrowed them to one.
cmake -U STRATA_CUDA_ARCHITECTURES -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
targets=(strata)
grep -q '^build python/strata/_core' build/build.ninja 2>/dev/null && targets+=(strata_python)
cmake --build build --target "${targets[@]}"
# The Python module for Debian's python3, as an editable install makes it: a .pth file naming
# build/python in the interpreter's site directory (where this user may write there), so
# `python3 -c "import strata"` works from any directory and follows rebuilds.
site=$(/usr/bin/python3 -c 'import sysconfig; print(sysconfig.get_path("platlib"))' 2>/dev/null || true)
if [[ -f build/python/strata/__init__.py && -n "$site" && -d "$site" && -w "$site" ]]; then
  echo "$PWD/build/python" >"$site/strata-build.pth"
fi
build/strata train examples/quickstart.json "$@"
