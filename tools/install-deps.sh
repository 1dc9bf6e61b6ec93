#!/usr/bin/env bash
# Installs the Debian packages Strata builds with, only those that are missing.
# Usage: tools/install-deps.sh
set -euo pipefail

packages=(build-essential cmake ninja-build pkg-config ccache git
          liburing-dev libhwloc-dev libtbb-dev libopenblas-dev
          libopenmpi-dev openmpi-bin nlohmann-json3-dev libcli11-dev
          libgtest-dev libgmock-dev libbenchmark-dev libxxhash-dev fio
          libpcre2-dev libutf8proc-dev libsentencepiece-dev libdnnl-dev
          iproute2 nftables      # tools/cluster.sh: nodes as network namespaces, lossy links
          clang libclang-rt-dev  # clang and its libFuzzer: tools/fuzz.sh
          python3-matplotlib     # strata plot
          # the strata Python module and its tests (python3-torch also makes the golden data)
          python3-dev pybind11-dev python3-pybind11 python3-pytest python3-torch python3-numpy)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  exit 0
fi

echo "strata: installing missing packages: ${missing[*]}"
sudo_cmd=()
if [[ $(id -u) -ne 0 ]]; then
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
