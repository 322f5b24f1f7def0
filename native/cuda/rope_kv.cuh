// Rotary and the paged-KV write, one definition for rotary_kernel,
// rotary_write_kv_kernel and the qkv stores that fuse them (the GEMV's, the
// batch-invariant GEMM's): the rotation's roundings and the cache layout live
// here, so the fused stores give the separate kernels' bits.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace turbomq {
namespace cuda {

// The row of a paged cache [blocks, num_kv_heads, block_size, d] that holds
// KV head `head` of the token at `slot`.
__device__ __forceinline__ std::int64_t cache_row(std::int64_t slot, int head, int num_kv_heads,
                                                  int block_size) {
  const std::int64_t block = slot / block_size;
  return (block * num_kv_heads + head) * block_size + slot % block_size;
}

// Elements j and j + d/2 of a q or k head (lo, hi), rotated by cos c and sin
// s as rotary rounds: products and sum rounded apart, then rounded to T.
template <typename T>
__device__ __forceinline__ void rotate_pair(float& lo, float& hi, float c, float s) {
  const float l = round_to<T>(__fadd_rn(__fmul_rn(lo, c), __fmul_rn(-hi, s)));
  hi = round_to<T>(__fadd_rn(__fmul_rn(hi, c), __fmul_rn(lo, s)));
  lo = l;
}

// What a fused store of rotation pair n (head n / (d/2), element n % (d/2))
// of row m needs besides its outputs: cos and sin at the row's position (q
// and k heads) and its cache slot (k and v heads). Read early, so that the
// dependent round trips (position, then cos and sin) stay off the tail.
struct RopeIn {
  float c = 0.0f, s = 0.0f;
  std::int64_t slot = -1;
};
__device__ __forceinline__ RopeIn rope_in(const RopeKV& rp, int m, int n) {
  const int half = rp.head_dim / 2, head = n / half, j = n % half;
  RopeIn r;
  if (head < rp.num_heads + rp.num_kv_heads) {
    const float* cs = rp.cos_sin + rp.positions[m] * rp.head_dim;
    r.c = cs[j];
    r.s = cs[half + j];
  }
  if (head >= rp.num_heads) r.slot = rp.slots[m];
  return r;
}

// Stores rotation pair n of row m from its two outputs, each rounded to T as
// a plain store rounds it: q rotated into q_out [rows, num_heads, d], k
// rotated and v as they are into the paged caches (none at a negative slot).
template <typename T>
__device__ __forceinline__ void rope_store(const RopeKV& rp, T* q_out, int m, int n, float lo,
                                           float hi, const RopeIn& rin) {
  const int half = rp.head_dim / 2, head = n / half, j = n % half;
  if (head >= rp.num_heads + 2 * rp.num_kv_heads) return;
  if (head < rp.num_heads + rp.num_kv_heads) rotate_pair<T>(lo, hi, rin.c, rin.s);
  T* dst;
  if (head < rp.num_heads) {
    dst = q_out + (static_cast<std::int64_t>(m) * rp.num_heads + head) * rp.head_dim;
  } else {
    if (rin.slot < 0) return;
    const bool is_k = head < rp.num_heads + rp.num_kv_heads;
    const int kvh = head - rp.num_heads - (is_k ? 0 : rp.num_kv_heads);
    dst = static_cast<T*>(is_k ? rp.k_cache : rp.v_cache) +
          cache_row(rin.slot, kvh, rp.num_kv_heads, rp.block_size) * rp.head_dim;
  }
  dst[j] = from_float<T>(lo);
  dst[j + half] = from_float<T>(hi);
}

}  // namespace cuda
}  // namespace turbomq
