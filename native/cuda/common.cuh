// Shared helpers of the CUDA kernels: error checks, element conversions,
// warp reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels.h"

namespace turbomq {
namespace cuda {

inline void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(err) + ": " +
                             cudaGetErrorString(err));
  }
}

// A launch reports configuration errors through the last error; asynchronous
// faults surface at the next synchronizing call.
inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

// Launches `kernel(args)` on `grid` x `block` with `smem` bytes of dynamic
// shared memory, as a programmatic dependent where `programmatic` and
// programmatic_launch() are on (kernels.h): it may start while the previous
// kernel runs, so it must call grid_dependency_wait (below) before reading
// anything that kernel wrote. A failed launch's error is not left for the caller's next call.
template <typename... P, typename... A>
void launch_kernel(bool programmatic, void (*kernel)(P...), dim3 grid, int block,
                   std::size_t smem, cudaStream_t stream, const char* name, const A&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = programmatic && programmatic_launch() ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, args...);
  if (err != cudaSuccess) cudaGetLastError();
  check_cuda(err, name);
}
// The same, always programmatic where on, for a kernel of one (parameter struct) argument.
template <typename K, typename A>
void launch_programmatic(K kernel, const A& args, dim3 grid, int block, std::size_t smem,
                         cudaStream_t stream, const char* name) {
  launch_kernel(true, kernel, grid, block, smem, stream, name, args);
}

// The current device's SM count, asked once per device (launch planning on
// every call would otherwise pay two runtime queries).
inline int sm_count() {
  constexpr int kCached = 64;  // devices whose count is kept
  static int counts[kCached] = {};
  int device = 0;
  check_cuda(cudaGetDevice(&device), "current device");
  if (device < kCached && counts[device] != 0) return counts[device];
  int sms = 0;
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  if (device < kCached) counts[device] = sms;
  return sms;
}

// Opts `kernel` in to `bytes` of dynamic shared memory (past 48 KiB, static
// shared memory included, a launch needs it), once: `done` is the caller's
// flag for this kernel instantiation.
template <typename K>
void opt_in_smem(K kernel, std::size_t bytes, bool& done, const char* what) {
  if (done) return;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)),
             what);
  done = true;
}

inline void require(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument(what);
}

inline cudaStream_t as_stream(std::uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

inline int ceil_div(std::int64_t a, std::int64_t b) { return static_cast<int>((a + b - 1) / b); }

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Rounds to T and back: reproduces the reference's intermediate roundings.
template <typename T>
__device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

// silu(g) * u for g, u already of T (widened): silu rounded to T before the
// product, as the reference does; the caller rounds the product to T. The one
// expression of silu_mul_kernel and the batch-invariant GEMM's silu epilogue.
template <typename T>
__device__ __forceinline__ float silu_mul_of(float g, float u) {
  return round_to<T>(g / (1.0f + expf(-g))) * u;
}

// 8 elements of a 16-byte vector <-> float.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float* f) {
  const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = to_float(e[i]);
}
template <typename T>
__device__ __forceinline__ uint4 pack8(const float* f) {
  uint4 v;
  T* e = reinterpret_cast<T*>(&v);
#pragma unroll
  for (int i = 0; i < 8; ++i) e[i] = from_float<T>(f[i]);
  return v;
}

// Programmatic dependent launch (sm_90). A kernel calls launch_dependents
// early so that the next kernel, if launched with programmatic stream
// serialization (the GEMV), can start and fetch what does not depend on this
// one (its weights) while this one runs. That next kernel calls
// grid_dependency_wait before it reads anything this one wrote. Both are
// no-ops when no such launch is involved.
__device__ __forceinline__ void launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
// Brings the line at p into L2 (not L1: nothing stale stays near the SM).
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
// Per-row FP8 (E4M3) activation scale: max(amax * (1/448), 1e-12). A
// multiply, as the reference's (torch divides by a scalar so on CUDA).
constexpr float kFp8MaxInv = 1.0f / 448.0f;

__device__ __forceinline__ float fp8_scale(float amax) { return fmaxf(amax * kFp8MaxInv, 1e-12f); }

// f[0..8) * inv (inv = 1 / scale, rounded once: __frcp_rn) rounded to E4M3
// (nearest even, saturating), as eight bytes in order: the reference's
// quantize_rows. A multiply, not a division per value: quantizing x is every
// FP8 GEMV block's prologue.
__device__ __forceinline__ uint2 fp8_pack8(const float* f, float inv) {
  std::uint32_t pair[4];  // bytes 2p, 2p + 1
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    pair[p] = __nv_cvt_float2_to_fp8x2(
        make_float2(__fmul_rn(f[2 * p], inv), __fmul_rn(f[2 * p + 1], inv)), __NV_SATFINITE,
        __NV_E4M3);
  }
  return make_uint2(pair[0] | (pair[1] << 16), pair[2] | (pair[3] << 16));
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

}  // namespace cuda
}  // namespace turbomq
