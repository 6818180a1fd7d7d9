#!/usr/bin/env bash
# The CPU test suite under sanitizers (issue 7), run by .ci/run after tests/run-tests.sh:
#
#   1. AddressSanitizer + UndefinedBehaviorSanitizer (clang 14, -O1 -g, every report fatal):
#      the CPU suite through CTest (everything but the `cuda` and `consumer` labels), except
#      two executables left out to bound the build (about a quarter of its compile time):
#      test_backward_finite_differences (float64 backward, finite differences) and
#      test_backward_low_precision (bfloat16 / float16 backward). The backward kernel runs
#      under ASan through its float32 instantiations (test_backward_reference,
#      test_backward_invariants, the reliability tests, the fuzz corpus): what is not run
#      under ASan is the float64 and 16-bit instantiations of the backward, and the
#      finite-difference check. RECATTN_ASAN_SKIP (a ;-list, may be empty) overrides the list.
#   2. ThreadSanitizer: the tests labelled `threads`, built without OpenMP so that recattn's
#      own std::thread fallback (cpu/parallel.hpp) runs: TSan does not model libgomp's
#      barriers and would report races that are not there.
#
#   bash tests/run-sanitizers.sh [asan|tsan]...     (default: both)
#
# Build directories: build-sanitizers/{asan,tsan} (RECATTN_SANITIZER_BUILD overrides the
# root). tests/run-fuzz.sh builds the libFuzzer target in the asan directory.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bash cmake/install-debian-packages.sh cmake make clang-14 libclang-rt-14-dev libeigen3-dev libxsimd-dev catch2

root="${RECATTN_SANITIZER_BUILD:-build-sanitizers}"
jobs="$(nproc)"
stages=("$@")
[ "${#stages[@]}" -eq 0 ] && stages=(asan tsan)

common=(-DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14
        -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g"
        -DRECATTN_BUILD_TESTS=ON -DRECATTN_BUILD_BENCH=OFF -DRECATTN_BUILD_EXAMPLES=OFF
        -DRECATTN_BUILD_CUDA=OFF)

# Every report is an error: a sanitizer finding fails the test that triggered it.
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}"

for stage in "${stages[@]}"; do
  start=$SECONDS
  case "$stage" in
    asan)
      flags="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
      skip="${RECATTN_ASAN_SKIP-test_backward_finite_differences;test_backward_low_precision}"
      cmake -S . -B "$root/asan" "${common[@]}" "-DCMAKE_CXX_FLAGS=$flags" \
        "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined" -DRECATTN_BUILD_FUZZERS=ON \
        "-DRECATTN_TESTS_SKIP=$skip"
      cmake --build "$root/asan" -j"$jobs"
      # The skipped executables' CTest entries are <name>_NOT_BUILT-<hash>.
      (cd "$root/asan" && ctest --output-on-failure -LE 'cuda|consumer' -E '_NOT_BUILT-' -j"$jobs")
      ;;
    tsan)
      flags="-fsanitize=thread -fno-omit-frame-pointer"
      cmake -S . -B "$root/tsan" "${common[@]}" "-DCMAKE_CXX_FLAGS=$flags" \
        "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread" -DCMAKE_DISABLE_FIND_PACKAGE_OpenMP=ON
      cmake --build "$root/tsan" -j"$jobs" --target recattn_threaded_tests
      (cd "$root/tsan" && ctest --output-on-failure -L threads -LE 'cuda|consumer' -j"$jobs")
      ;;
    *)
      echo "run-sanitizers.sh: unknown stage '$stage' (asan or tsan)" >&2
      exit 2
      ;;
  esac
  echo "recattn: sanitizer stage $stage took $((SECONDS - start)) s"
done
