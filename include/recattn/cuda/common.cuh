// CUDA plumbing shared by the kernels and the launcher: error checks that throw
// recattn::Error, pointer queries, device properties, asynchronous copies, conversions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "../dtype.hpp"
#include "../error.hpp"

namespace recattn::cuda {

namespace detail {

/// Throws recattn::Error naming the call and the CUDA error string; clears the (non-sticky)
/// error so that later calls in the same thread are not blamed for it.
inline void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  throw Error(recattn::detail::cat("cuda: ", what, " failed: ", cudaGetErrorName(e), ": ", cudaGetErrorString(e)));
}

}  // namespace detail

/// True when `p` is memory a kernel can read: device or managed memory. Host memory,
/// null and "no CUDA device" give false.
inline bool is_device_pointer(const void* p) {
  if (!p) return false;
  cudaPointerAttributes a{};
  const cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged;
}

namespace detail {

/// Multiprocessor count of the current device, cached per device.
inline int sm_count() {
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  static std::mutex m;
  static std::vector<int> cache;
  std::lock_guard<std::mutex> lock(m);
  if (std::size_t(dev) >= cache.size()) cache.resize(std::size_t(dev) + 1, 0);
  if (cache[std::size_t(dev)] == 0) {
    int n = 0;
    check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute(MultiProcessorCount)");
    cache[std::size_t(dev)] = n;
  }
  return cache[std::size_t(dev)];
}

/// Largest dynamic shared memory a block of the current device may opt into.
inline int max_smem_optin() {
  int dev = 0, n = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
        "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  return n;
}

// ---- device side -------------------------------------------------------------------------

/// cp.async of `Bytes` (4, 8 or 16) bytes, the last `Bytes - src_bytes` zero-filled.
/// Both addresses are aligned to Bytes.
template <int Bytes>
__device__ __forceinline__ void cp_async(void* smem_dst, const void* gmem_src, int src_bytes) {
  const unsigned dst = unsigned(__cvta_generic_to_shared(smem_dst));
  if constexpr (Bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(gmem_src), "n"(Bytes), "r"(src_bytes)
                 : "memory");
  }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

/// Element conversions on the device (round to nearest even, as the host types do).
template <class Acc, class T>
__device__ __forceinline__ Acc to_acc(T x) {
  if constexpr (std::is_same<T, bfloat16>::value) {
    return Acc(__uint_as_float(unsigned(x.bits) << 16));
  } else if constexpr (std::is_same<T, half>::value) {
    __half_raw r;
    r.x = x.bits;
    return Acc(__half2float(__half(r)));
  } else {
    return Acc(x);
  }
}

template <class T, class Acc>
__device__ __forceinline__ T from_acc(Acc x) {
  if constexpr (std::is_same<T, bfloat16>::value) {
    const __nv_bfloat16 b = __float2bfloat16_rn(float(x));
    bfloat16 out;
    out.bits = __bfloat16_as_ushort(b);
    return out;
  } else if constexpr (std::is_same<T, half>::value) {
    const __half b = __float2half_rn(float(x));
    half out;
    out.bits = __half_as_ushort(b);
    return out;
  } else {
    return T(x);
  }
}

/// Reads element i of an untyped floating-point array of dtype t.
template <class Acc>
__device__ __forceinline__ Acc load_any(const void* p, dtype t, std::int64_t i) {
  switch (t) {
    case dtype::float32: return Acc(static_cast<const float*>(p)[i]);
    case dtype::float64: return Acc(static_cast<const double*>(p)[i]);
    case dtype::bfloat16: return to_acc<Acc>(static_cast<const bfloat16*>(p)[i]);
    case dtype::float16: return to_acc<Acc>(static_cast<const half*>(p)[i]);
    default: return Acc(0);
  }
}

template <class Acc>
__device__ __forceinline__ Acc exp_acc(Acc x) {
  if constexpr (std::is_same<Acc, double>::value) return ::exp(x);
  else return ::expf(x);
}

/// N consecutive Acc in shared memory, read as one (or two) wide loads.
template <class A, int N>
struct alignas(sizeof(A) * N) avec {
  A v[N];
};

}  // namespace detail
}  // namespace recattn::cuda
