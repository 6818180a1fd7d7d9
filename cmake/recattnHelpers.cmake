# Helpers for recattn's own targets (tests, benchmarks, examples). Not installed: the
# library itself carries no compiler flags.

# recattn_target_defaults(<target>)
#   Links recattn::recattn and OpenMP (when found), turns on warnings, and with
#   RECATTN_NATIVE compiles for the build machine (-march=native) so that xsimd picks the
#   widest instruction set it has (AVX-512 / AVX2 / NEON). CUDA sources get the same flags
#   through -Xcompiler.
function(recattn_target_defaults target)
  target_link_libraries(${target} PRIVATE recattn::recattn)
  if(TARGET OpenMP::OpenMP_CXX)
    # FindOpenMP's flags apply to C++ sources only; nvcc's host compiler needs them too.
    target_link_libraries(${target} PRIVATE OpenMP::OpenMP_CXX)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-fopenmp>)
  endif()
  if(MSVC)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:/W4>)
    return()
  endif()
  target_compile_options(${target} PRIVATE
    "$<$<COMPILE_LANGUAGE:CXX>:-Wall;-Wextra>"
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 12.3)
    # GCC 12.2's AVX-512 headers trip -Wmaybe-uninitialized on their own self-initialised
    # placeholders (`__m512i __Y = __Y;`, GCC bug 105593, fixed in 12.3): noise, not recattn.
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wno-maybe-uninitialized>)
  endif()
  if(RECATTN_NATIVE)
    target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:-march=native>
      $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-march=native>)
  endif()
endfunction()
