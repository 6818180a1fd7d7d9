# The CUDA benchmarks, included by bench/CMakeLists.txt when RECATTN_BUILD_CUDA is on (after
# recattn_add_bench is defined there). bf16 and float inputs only: the caps cut the variants
# the binaries never run from their build.
#
#   ./cuda_forward --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#   ./cuda_forward --tune          every candidate cfg of each case
#   ./cuda_step --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
function(recattn_add_cuda_bench name)
  recattn_add_bench(${name} ${ARGN})
  target_compile_features(${name} PRIVATE cxx_std_17)
  target_compile_options(${name} PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>
    # Eigen's headers under nvcc: explicitly defaulted __host__ __device__ members (noise).
    $<$<COMPILE_LANGUAGE:CUDA>:-diag-suppress=20012,20015>)
endfunction()

# The CUDA forward pass (issue 5's table, issue 8's chunked rows).
recattn_add_cuda_bench(cuda_forward SOURCES ${CMAKE_CURRENT_LIST_DIR}/cuda_forward.cu
  DEFINES RECATTN_DISABLE_CPU_FORWARD=1 RECATTN_DISABLE_FLOAT64=1 RECATTN_DISABLE_FLOAT16=1 RECATTN_DISABLE_REVERSE=1
          RECATTN_DISABLE_VK_STATE=1)

# The decode step (issue 6): bf16 and float inputs, float and bf16 state, pool + indices.
recattn_add_cuda_bench(cuda_step SOURCES ${CMAKE_CURRENT_LIST_DIR}/cuda_step.cu
  DEFINES RECATTN_DISABLE_CPU_FORWARD=1 RECATTN_DISABLE_FLOAT64=1 RECATTN_DISABLE_FLOAT16=1 RECATTN_DISABLE_REVERSE=1
          RECATTN_DISABLE_VK_STATE=1 RECATTN_DISABLE_VARLEN=1)
