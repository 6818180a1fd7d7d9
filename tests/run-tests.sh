#!/usr/bin/env bash
# The README's test command (and .ci/run): installs the missing Debian packages, builds
# everything into build/ (Release) and runs the CTest suite. Tests labelled `cuda` need a
# GPU: they are compiled when nvcc is found, and not run here.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash cmake/install-debian-packages.sh cmake g++ make libeigen3-dev libxsimd-dev catch2 libbenchmark-dev

cuda=(-DRECATTN_BUILD_CUDA=OFF)
nvcc="$(command -v nvcc || true)"
if [ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  nvcc=/usr/local/cuda/bin/nvcc
fi
if [ -n "$nvcc" ]; then
  cuda=(-DRECATTN_BUILD_CUDA=ON "-DCMAKE_CUDA_COMPILER=$nvcc")
fi

cmake -S . -B build -DCMAKE_BUILD_TYPE=Release \
  -DRECATTN_BUILD_TESTS=ON -DRECATTN_BUILD_BENCH=ON -DRECATTN_BUILD_EXAMPLES=ON "${cuda[@]}"
cmake --build build -j"$(nproc)"
cd build
ctest --output-on-failure -LE cuda -j2
