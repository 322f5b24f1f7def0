// Tensor-core building blocks shared by the kernels that use mma.sync:
// the m16n8k16 16-bit product with fp32 accumulation, packing two floats
// into its 16-bit operand, asynchronous global -> shared copies, and
// ldmatrix loads of operand fragments from shared memory.
#pragma once

#include <type_traits>

#include "common.cuh"

namespace turbomq {
namespace cuda {

// c (16 x 8, fp32) += a (16 x 16, row-major) * b (16 x 8, column-major), T
// operands: a in the four registers of the PTX fragment, b in two.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float* c, const std::uint32_t* a, std::uint32_t b0,
                                             std::uint32_t b1) {
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats rounded to T, low first, as one 32-bit operand register.
template <typename T>
__device__ __forceinline__ std::uint32_t pack_pair(float lo, float hi) {
  if constexpr (std::is_same_v<T, __half>) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<std::uint32_t*>(&h);
  } else {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<std::uint32_t*>(&h);
  }
}

// 16 bytes global -> shared, bypassing L1; zero-filled when !ok (rows past
// the data), so every mma sees finite data.
__device__ __forceinline__ void cp_async16(std::uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(ok ? 16 : 0)
               : "memory");
}
// The same, asking L2 to fetch the 256-byte block around src (a row streamed
// once: the next chunks of the row arrive with this one).
__device__ __forceinline__ void cp_async16_l2_256(std::uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(ok ? 16 : 0)
               : "memory");
}
// 4 bytes, through L1 (cp.async takes 16 only with .cg); zero when !ok.
__device__ __forceinline__ void cp_async4(std::uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src),
               "r"(ok ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Four 8 x 8 16-bit matrices from shared memory: lanes 8i..8i+7 give the row
// addresses of matrix i; lane l receives, of each, row l / 4, columns
// 2 (l % 4) and 2 (l % 4) + 1 (transposed: column l / 4, rows 2 (l % 4), +1).
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t* r, std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t* r, std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

}  // namespace cuda
}  // namespace turbomq
