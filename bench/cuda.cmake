# The CUDA forward benchmark (issue 5's table), included by bench/CMakeLists.txt when
# RECATTN_BUILD_CUDA is on. Needs Google Benchmark (benchmark::benchmark).
#
#   ./cuda_forward --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#   ./cuda_forward --tune          every candidate cfg of each case
#
# bf16 inputs only: the caps cut the variants the binary never runs from its build.
add_executable(cuda_forward ${CMAKE_CURRENT_LIST_DIR}/cuda_forward.cu)
target_link_libraries(cuda_forward PRIVATE benchmark::benchmark)
if(COMMAND recattn_target_defaults)
  recattn_target_defaults(cuda_forward)
else()
  target_link_libraries(cuda_forward PRIVATE recattn::recattn)
endif()
target_compile_features(cuda_forward PRIVATE cxx_std_17)
target_compile_definitions(cuda_forward PRIVATE
  RECATTN_DISABLE_FLOAT64=1 RECATTN_DISABLE_FLOAT16=1 RECATTN_DISABLE_REVERSE=1 RECATTN_DISABLE_VK_STATE=1)
target_compile_options(cuda_forward PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>
  $<$<COMPILE_LANGUAGE:CUDA>:-diag-suppress=20012,20015>)

# The CUDA decode step (issue 6): bf16 and float inputs, float and bf16 state, pool + indices.
#   ./cuda_step --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
add_executable(cuda_step ${CMAKE_CURRENT_LIST_DIR}/cuda_step.cu)
target_link_libraries(cuda_step PRIVATE benchmark::benchmark)
if(COMMAND recattn_target_defaults)
  recattn_target_defaults(cuda_step)
else()
  target_link_libraries(cuda_step PRIVATE recattn::recattn)
endif()
target_compile_features(cuda_step PRIVATE cxx_std_17)
target_compile_definitions(cuda_step PRIVATE
  RECATTN_DISABLE_FLOAT64=1 RECATTN_DISABLE_FLOAT16=1 RECATTN_DISABLE_REVERSE=1 RECATTN_DISABLE_VK_STATE=1
  RECATTN_DISABLE_VARLEN=1)
target_compile_options(cuda_step PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>
  $<$<COMPILE_LANGUAGE:CUDA>:-diag-suppress=20012,20015>)
