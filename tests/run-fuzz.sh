#!/usr/bin/env bash
# Builds the libFuzzer target tests/fuzz/fuzz_forward.cpp (clang 14, -fsanitize=fuzzer,
# address,undefined) and runs it from the seed corpus for a bounded time (issue 7):
#
#   bash tests/run-fuzz.sh [seconds]      (default 60; .ci/run uses the default)
#
# New inputs that grow coverage go to a scratch corpus in the build directory, never into
# tests/fuzz/corpus. A failure leaves crash-<hash> in the build directory and fails the script:
# fix the bug, then copy the input to tests/fuzz/regressions/ (CTest's fuzz_forward_replay
# replays that directory in every build) and add a row to tests/CHECKS.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

seconds="${1:-60}"
bash cmake/install-debian-packages.sh cmake make clang-14 libclang-rt-14-dev libeigen3-dev libxsimd-dev catch2

build="${RECATTN_SANITIZER_BUILD:-build-sanitizers}/asan"
flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
cmake -S . -B "$build" -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g" \
  -DRECATTN_BUILD_TESTS=ON -DRECATTN_BUILD_BENCH=OFF -DRECATTN_BUILD_EXAMPLES=OFF -DRECATTN_BUILD_CUDA=OFF \
  -DRECATTN_BUILD_FUZZERS=ON "-DCMAKE_CXX_FLAGS=$flags" "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined"
cmake --build "$build" -j"$(nproc)" --target fuzz_forward

work="$build/fuzz"
mkdir -p "$work/corpus"
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
start=$SECONDS
# One process; -max_total_time bounds the run. The first directory
# receives new inputs; the seeds and the regressions are read.
status=0
"$build/tests/fuzz_forward" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
  -artifact_prefix="$work/" "$work/corpus" tests/fuzz/corpus tests/fuzz/regressions >"$work/log.txt" 2>&1 || status=$?
grep -E 'INITED|DONE|FAILURE|ERROR|SUMMARY|Test unit written|stat::number_of_executed_units' "$work/log.txt" || true
if [ "$status" -ne 0 ]; then tail -60 "$work/log.txt"; fi
echo "recattn: fuzzed for $((SECONDS - start)) s, $(grep -o 'stat::number_of_executed_units: [0-9]*' "$work/log.txt" | tail -1)"
exit "$status"
