# Reliability tests (issue 7), included by tests/CMakeLists.txt: concurrency, 64-bit offsets,
# the fuzz corpus replayed without libFuzzer, and (RECATTN_BUILD_FUZZERS, clang) the libFuzzer
# target itself. tests/run-sanitizers.sh runs the whole suite under ASan + UBSan and the
# `threads` label under TSan; tests/run-fuzz.sh runs the fuzzer. Each executable is one
# translation unit cut to the variants it runs (see the note at the top of CMakeLists.txt).

option(RECATTN_BUILD_FUZZERS "Build the libFuzzer target tests/fuzz/fuzz_forward (clang only)" OFF)
# Test executables left out of the default build target (their CTest entries then read
# <name>_NOT_BUILT-...): tests/run-sanitizers.sh uses it to bound its ASan build.
set(RECATTN_TESTS_SKIP "" CACHE STRING "Test executables left out of the default build (;-list)")

# Many threads calling forward, backward and step at once, and state pools with disjoint
# slots (forward in place, step): every gate present, both directions, dense and varlen,
# float32 state storage.
recattn_add_test(test_concurrency
  SOURCES test_concurrency.cpp
  DEFINES ${recattn_float_only} RECATTN_GATE_MASK_ONLY=15 RECATTN_DISABLE_VK_STATE=1 RECATTN_DISABLE_BF16_STATE=1
  LABELS cpu threads)
# What tests/run-sanitizers.sh builds for its ThreadSanitizer stage (the `threads` label).
add_custom_target(recattn_threaded_tests DEPENDS test_concurrency)

# Views whose offsets pass 2^31 elements (a sparse ~9 GiB mapping), forward and backward.
recattn_add_test(test_size_limits
  SOURCES test_size_limits.cpp
  DEFINES ${recattn_float_only} RECATTN_GATE_MASK_ONLY=15 RECATTN_DISABLE_VK_STATE=1 RECATTN_DISABLE_REVERSE=1
          RECATTN_DISABLE_VARLEN=1
  LABELS cpu size_limits)

# The catalog's checks that no other test proves (tests/CHECKS.md), and the variant caps'
# own error: every cap on, so one forward, one backward and one step specialization.
recattn_add_test(test_checks
  SOURCES test_checks.cpp
  DEFINES ${recattn_float_only} RECATTN_GATE_MASK_ONLY=15 RECATTN_DISABLE_VK_STATE=1 RECATTN_DISABLE_REVERSE=1
          RECATTN_DISABLE_VARLEN=1 RECATTN_DISABLE_BF16_STATE=1
  LABELS cpu checks)

# The fuzz target is built for float32 and the [K, V] state with float32 storage (every gate
# combination, both directions, dense and varlen: 64 forward, 64 backward and 16 step
# specializations, which bounds its compile time): other dtypes, the [V, K] layout and a
# bfloat16 pool reach the library's checks and then its "compiled without" error, which the
# fuzzer accepts for them only.
set(recattn_fuzz_defines ${recattn_float_only} RECATTN_DISABLE_VK_STATE=1 RECATTN_DISABLE_BF16_STATE=1)

# The fuzz target's translation unit, compiled once: the replay executable below (CTest) and,
# with RECATTN_BUILD_FUZZERS, the libFuzzer binary link the same object.
add_library(recattn_fuzz_forward OBJECT fuzz/fuzz_forward.cpp)
target_include_directories(recattn_fuzz_forward PRIVATE ${CMAKE_CURRENT_SOURCE_DIR})
target_compile_definitions(recattn_fuzz_forward PRIVATE ${recattn_fuzz_defines})
target_compile_features(recattn_fuzz_forward PRIVATE cxx_std_17)
recattn_target_defaults(recattn_fuzz_forward)
# -O1 in every build type: 144 specializations at -O3 cost minutes of compile on two cores,
# and the replay of a few hundred small inputs takes well under a second either way.
if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  target_compile_options(recattn_fuzz_forward PRIVATE -O1)
endif()
if(RECATTN_BUILD_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "RECATTN_BUILD_FUZZERS needs clang (libFuzzer); CMAKE_CXX_COMPILER is ${CMAKE_CXX_COMPILER_ID}")
  endif()
  # Coverage instrumentation without libFuzzer's main (the sanitizer runtime has no-op hooks
  # for the replay executable); the build's own -fsanitize flags add ASan and UBSan.
  # The harness's checking loops, the test support, the scalar reference and the standard
  # library are left uninstrumented (tests/fuzz/coverage-ignorelist.txt says why).
  target_compile_options(recattn_fuzz_forward PRIVATE -fsanitize=fuzzer-no-link
    "-fsanitize-coverage-ignorelist=${CMAKE_CURRENT_SOURCE_DIR}/fuzz/coverage-ignorelist.txt")
endif()

# The corpus and every regression input, replayed through the fuzz target's entry point.
add_executable(fuzz_forward_replay fuzz/replay.cpp $<TARGET_OBJECTS:recattn_fuzz_forward>)
target_compile_features(fuzz_forward_replay PRIVATE cxx_std_17)
recattn_target_defaults(fuzz_forward_replay)
add_test(NAME fuzz_forward_replay
         COMMAND fuzz_forward_replay ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/corpus ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/regressions)
set_tests_properties(fuzz_forward_replay PROPERTIES LABELS "cpu;fuzz")

if(RECATTN_BUILD_FUZZERS)
  add_executable(fuzz_forward EXCLUDE_FROM_ALL $<TARGET_OBJECTS:recattn_fuzz_forward>)
  recattn_target_defaults(fuzz_forward)
  target_link_options(fuzz_forward PRIVATE -fsanitize=fuzzer)
endif()

foreach(skipped IN LISTS RECATTN_TESTS_SKIP)
  if(NOT TARGET ${skipped})
    message(FATAL_ERROR "RECATTN_TESTS_SKIP: no test executable named ${skipped}")
  endif()
  set_target_properties(${skipped} PROPERTIES EXCLUDE_FROM_ALL ON)
endforeach()
