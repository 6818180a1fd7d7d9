#!/usr/bin/env bash
# Builds the CUDA tests and benchmarks on this (CPU-only) machine for a GPU machine that has
# the CUDA driver but none of the Debian packages: nvcc for sm_90, libstdc++/libgcc linked
# statically, the CUDA runtime static (CMake's default), rpath $ORIGIN, and
# libbenchmark.so.1debian copied beside the binaries. No -march=native: the GPU host's CPU
# may lack this machine's AVX-512.
#
#   bash tests/cuda/build-for-device.sh [build-dir] [targets...]
#
# Default build dir: build-cuda-dev (ignored by git); binaries land in <build-dir>/bin,
# together with run-on-device.sh, which runs them (tests, compute-sanitizer, benchmarks).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
dir="${1:-build-cuda-dev}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(test_cuda_forward test_cuda_layouts cuda_forward)
fi
nvcc="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release -DRECATTN_NATIVE=OFF \
  -DRECATTN_BUILD_CUDA=ON "-DCMAKE_CUDA_COMPILER=$nvcc" -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DRECATTN_BUILD_EXAMPLES=OFF \
  "-DCMAKE_EXE_LINKER_FLAGS=-static-libstdc++ -static-libgcc -Wl,-rpath,\$ORIGIN" >/dev/null
cmake --build "$dir" -j"$(nproc)" --target "${targets[@]}"
mkdir -p "$dir/bin"
for t in "${targets[@]}"; do
  f="$(find "$dir" -path "$dir/bin" -prune -o -type f -name "$t" -perm -u+x -print | head -1)"
  cp "$f" "$dir/bin/"
done
cp "$(ldconfig -p | awk '/libbenchmark.so.1debian/ {print $NF; exit}')" "$dir/bin/"
cp tests/cuda/run-on-device.sh "$dir/bin/"
ls -la "$dir/bin"
