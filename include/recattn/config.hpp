// recattn: build-time configuration, host/device marker, version.
#pragma once

#define RECATTN_VERSION_MAJOR 0
#define RECATTN_VERSION_MINOR 1
#define RECATTN_VERSION_PATCH 0
#define RECATTN_VERSION_STRING "0.1.0"

// Code shared by host and device (CUTLASS_HOST_DEVICE's role).
#if defined(__CUDACC__)
#define RECATTN_HOST_DEVICE __host__ __device__ __forceinline__
#define RECATTN_DEVICE __device__ __forceinline__
#else
#define RECATTN_HOST_DEVICE inline
#define RECATTN_DEVICE inline
#endif

// Keeps a helper out of line: shared by every specialization instead of copied into each
// (build time), at the cost of a call per row.
#if defined(__GNUC__) || defined(__clang__)
#define RECATTN_NOINLINE __attribute__((noinline)) inline
#else
#define RECATTN_NOINLINE inline
#endif

#if defined(__CUDACC__) && !defined(RECATTN_DISABLE_CUDA)
#define RECATTN_HAS_CUDA 1
#else
#define RECATTN_HAS_CUDA 0
#endif

// Variant caps (flash-attention's FLASHATTENTION_DISABLE_* idea). Every combination of
// gates x direction x layout x state layout x dtype is a compiled specialization; a
// translation unit that does not need some of them can cut them and the build time they
// cost. A call that needs a disabled variant throws recattn::Error naming the macro.
//
//   RECATTN_DISABLE_REVERSE      no reverse = true
//   RECATTN_DISABLE_VARLEN       no cu_seqlens
//   RECATTN_DISABLE_VK_STATE     no [V, K] state layout
//   RECATTN_DISABLE_FLOAT64      no double inputs
//   RECATTN_DISABLE_BFLOAT16     no bfloat16 inputs
//   RECATTN_DISABLE_FLOAT16      no half inputs
//   RECATTN_GATE_MASK_ONLY=m     compile only the gate combination with bit mask m
//                                (bit 0 g, 1 g_gamma, 2 gk, 3 gv)
//   RECATTN_DISABLE_CPU_FORWARD  no CPU forward kernel at all (CUDA-only translation units)

#ifndef RECATTN_DISABLE_CPU_FORWARD
#define RECATTN_DISABLE_CPU_FORWARD 0
#endif
