#!/usr/bin/env bash
# Downloads the Debian packages that tools/gpu-check.sh may need on a GPU machine that has no
# package registry (its image has the CUDA toolkit, CMake and ninja, but not the CPU-side
# libraries), into .debs/ at the repository root. Carry .debs/ to that machine (it is
# git-ignored; the device tool's `carry` takes it) and gpu-check.sh unpacks what is missing
# there with `dpkg -x` into a private prefix. Run it on this (Debian 12) machine: the packages
# must match its distribution. About 15 MB.
set -euo pipefail
cd "$(dirname "$0")/.."

# Build-time libraries and their runtime dependencies. gpu-check.sh unpacks a runtime-only
# package (libgfortran5, libquadmath0, libudev1) only if the machine lacks its library.
packages=(
  nlohmann-json3-dev                                          # core: JSON
  libhwloc-dev libhwloc15 libudev1                            # sys: topology
  libtbb-dev libtbb12 libtbbmalloc2 libtbbbind-2-5            # CPU backend: threads
  libopenblas-dev libopenblas-pthread-dev libopenblas0-pthread
  libgfortran5 libquadmath0                                   # CPU backend: BLAS (reference)
  libgtest-dev libgmock-dev                                   # tests
  libbenchmark-dev libbenchmark1debian                        # benchmarks
  pkgconf pkgconf-bin libpkgconf3                             # pkg-config itself
  libcli11-dev liburing-dev liburing2                         # full builds only
)

mkdir -p .debs
cd .debs
if ! apt-get download "${packages[@]}"; then
  echo "apt-get download failed; try 'apt-get update' first" >&2
  exit 1
fi
echo "downloaded $(find . -maxdepth 1 -name '*.deb' | wc -l) packages into .debs/ ($(du -sh . | cut -f1)):"
ls -1 ./*.deb
# The device tool sends at most 64 MiB a call: the working tree and everything carried.
kib=$(du -sk . | cut -f1)
if ((kib > 48 * 1024)); then
  echo "warning: .debs/ is $((kib / 1024)) MiB; with the working tree it must stay under the" \
    "device tool's 64 MiB a call (remove older versions of the same package)" >&2
fi
