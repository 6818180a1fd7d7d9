#!/usr/bin/env bash
# The README's demo: installs the missing Debian packages, builds the demo into build/
# (Release) and runs a recurrent-attention prefill on the CPU.
#   bash examples/run-demo.sh [T [H [K [V [threads]]]]]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash cmake/install-debian-packages.sh cmake g++ make libeigen3-dev libxsimd-dev catch2 libbenchmark-dev

# Only the demo: tests, benchmarks and CUDA are tests/run-tests.sh's business.
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release \
  -DRECATTN_BUILD_EXAMPLES=ON -DRECATTN_BUILD_TESTS=OFF -DRECATTN_BUILD_BENCH=OFF -DRECATTN_BUILD_CUDA=OFF
cmake --build build --target recattn_demo -j"$(nproc)"
build/examples/recattn_demo "$@"
