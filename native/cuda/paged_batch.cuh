// What both attention kernels (attention.cu, prefill_attention.cu) read of a
// batch: q, the paged K/V cache, the block tables and per-sequence lengths,
// and the tile list, as device pointers and sizes, checked once here.
#pragma once

#include "common.cuh"

namespace turbomq {
namespace cuda {

struct PagedBatch {
  void* out;
  const void* q;
  std::int64_t q_stride_tok, q_stride_head;
  const void* k_cache;
  const void* v_cache;
  const int* block_tables;
  int max_blocks;
  const int* cu_q_lens;
  const int* context_lens;
  const int* tiles;
  int num_heads, num_kv_heads, group, block_shift;
  float scale_log2;  // softmax scale * log2(e): the kernels work in base 2
};

// The shared checks of `who`'s arguments, then its PagedBatch.
inline PagedBatch paged_batch(const AttentionArgs& a, const std::string& who) {
  require(a.dtype == DType::kF16 || a.dtype == DType::kBF16,
          who + ": q must be float16 or bfloat16");
  require(a.head_dim == 64 || a.head_dim == 128, who + ": head_dim must be 64 or 128");
  require(a.num_kv_heads > 0 && a.num_heads % a.num_kv_heads == 0,
          who + ": num_heads must be a multiple of num_kv_heads");
  require(a.block_size > 0 && (a.block_size & (a.block_size - 1)) == 0,
          who + ": block_size must be a power of two");
  require(a.q_stride_tok % 8 == 0 && a.q_stride_head % 8 == 0 && a.q % 16 == 0,
          who + ": q rows must be 16-byte aligned");
  require(a.num_kv_heads <= 65535, who + ": grid too large");
  PagedBatch b{};
  b.out = reinterpret_cast<void*>(a.out);
  b.q = reinterpret_cast<const void*>(a.q);
  b.q_stride_tok = a.q_stride_tok;
  b.q_stride_head = a.q_stride_head;
  b.k_cache = reinterpret_cast<const void*>(a.k_cache);
  b.v_cache = reinterpret_cast<const void*>(a.v_cache);
  b.block_tables = reinterpret_cast<const int*>(a.block_tables);
  b.max_blocks = a.max_blocks;
  b.cu_q_lens = reinterpret_cast<const int*>(a.cu_q_lens);
  b.context_lens = reinterpret_cast<const int*>(a.context_lens);
  b.tiles = reinterpret_cast<const int*>(a.tiles);
  b.num_heads = a.num_heads;
  b.num_kv_heads = a.num_kv_heads;
  b.group = a.num_heads / a.num_kv_heads;
  while ((1 << b.block_shift) < a.block_size) ++b.block_shift;
  b.scale_log2 = a.scale * 1.4426950408889634f;
  return b;
}

// Split-K partials of one (tile, KV head): partition q's normalized output
// rows at part_o[(prow0 + q * kRowsT + r) * D], its max (base 2) at
// part_ml[prow0 + q * kRowsT + r] and its sum part_rows further on.
struct Partials {
  float* o;
  float* ml;
  std::int64_t rows;  // where the sums start in ml
};

// Partitions whose weights combine_partials keeps in shared memory; with
// more, it reads each partition's max and sum again for every output.
constexpr int kCombineParts = 8;

// Combines `parts` partitions of the tile rows [0, rows) (row r is query
// (row0 + r) / group, head kvh * group + (row0 + r) % group of the sequence
// starting at q_start) in index order: partition q weighs sum_q *
// 2^(max_q - M); partitions with no visible key (sum 0) are skipped. Loads go
// through L2 (__ldcg): in the fused path other blocks wrote them. All
// kThreadsT threads of the block call it. Up to kCombineParts partitions,
// each row's weights are worked out once, and a thread issues the partial
// rows' loads of two outputs at once: the combine is a few L2 round trips,
// not two a partition and output, which on a short turn over a long history
// left the tile's last block running alone for microseconds.
template <typename T, int D, int kRowsT, int kThreadsT>
__device__ __forceinline__ void combine_partials(const PagedBatch& p, const Partials& part,
                                                 std::int64_t prow0, int parts, int row0,
                                                 int rows, int q_start, int kvh) {
  __shared__ float s_max[kRowsT], s_inv[kRowsT];
  __shared__ float s_w[kRowsT][kCombineParts];
  const float* ml = part.ml;
  const float* ll = part.ml + part.rows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool few = parts <= kCombineParts;
  // Row r's largest max over partitions with keys, and 1 / total weight.
  for (int r = warp; r < rows; r += kThreadsT / 32) {
    float mx = -INFINITY;
    for (int q = lane; q < parts; q += 32) {
      const std::int64_t prow = prow0 + q * kRowsT + r;
      const float lq = __ldcg(ll + prow), mq = __ldcg(ml + prow);
      if (lq > 0.0f) mx = fmaxf(mx, mq);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int q = lane; q < parts; q += 32) {
      const std::int64_t prow = prow0 + q * kRowsT + r;
      const float lq = __ldcg(ll + prow), mq = __ldcg(ml + prow);
      const float wt = lq > 0.0f ? lq * exp2f(mq - mx) : 0.0f;
      if (few) s_w[r][q] = wt;
      sum += wt;
    }
    sum = warp_sum(sum);
    if (lane == 0) {
      s_max[r] = mx;
      s_inv[r] = sum > 0.0f ? 1.0f / sum : 0.0f;
    }
  }
  __syncthreads();
  constexpr int kVec = D / 4;
  auto store = [&](int r, int c4, const float (&o)[4]) {
    const float inv = s_inv[r];
    const int qi = (row0 + r) / p.group;
    const int head = kvh * p.group + (row0 + r) % p.group;
    T* out = static_cast<T*>(p.out) +
             (static_cast<std::int64_t>(q_start + qi) * p.num_heads + head) * D + 4 * c4;
#pragma unroll
    for (int e = 0; e < 4; ++e) out[e] = from_float<T>(o[e] * inv);
  };
  if (few) {
    constexpr int kAtOnce = 2;  // outputs a thread loads together
    for (int base = threadIdx.x; base < rows * kVec; base += kAtOnce * kThreadsT) {
      float4 v[kAtOnce][kCombineParts];
#pragma unroll
      for (int k = 0; k < kAtOnce; ++k) {
        const int idx = base + k * kThreadsT, r = idx / kVec, c4 = idx % kVec;
#pragma unroll
        for (int q = 0; q < kCombineParts; ++q) {
          if (idx < rows * kVec && q < parts) {
            v[k][q] = __ldcg(reinterpret_cast<const float4*>(
                                 part.o + (prow0 + q * kRowsT + r) * D) + c4);
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kAtOnce; ++k) {
        const int idx = base + k * kThreadsT, r = idx / kVec, c4 = idx % kVec;
        if (idx >= rows * kVec) continue;
        float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int q = 0; q < kCombineParts; ++q) {
          if (q < parts) {
            const float wt = s_w[r][q];
            o[0] += wt * v[k][q].x;
            o[1] += wt * v[k][q].y;
            o[2] += wt * v[k][q].z;
            o[3] += wt * v[k][q].w;
          }
        }
        store(r, c4, o);
      }
    }
    return;
  }
  for (int idx = threadIdx.x; idx < rows * kVec; idx += kThreadsT) {
    const int r = idx / kVec, c4 = idx % kVec;
    const float mx = s_max[r];
    float o[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
    for (int q = 0; q < parts; ++q) {
      const std::int64_t prow = prow0 + q * kRowsT + r;
      const float lq = __ldcg(ll + prow), mq = __ldcg(ml + prow);
      const float4 v = __ldcg(reinterpret_cast<const float4*>(part.o + prow * D) + c4);
      const float wt = lq > 0.0f ? lq * exp2f(mq - mx) : 0.0f;
      o[0] += wt * v.x;
      o[1] += wt * v.y;
      o[2] += wt * v.z;
      o[3] += wt * v.w;
    }
    store(r, c4, o);
  }
}

// Whether this block is the last of the `parts` blocks of its (tile, KV
// head) to finish (an atomic counter, reset by that block so a replayed
// graph finds it zero); its partials, and every other block's, are then
// visible to it. Every thread calls it after writing its partials.
__device__ __forceinline__ bool last_partition(int* counter, int parts) {
  __shared__ int s_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const int last = atomicAdd(counter, 1) + 1 == parts;
    if (last) atomicExch(counter, 0);  // ready for the next launch
    s_last = last;
  }
  __syncthreads();
  if (s_last) __threadfence();
  return s_last;
}

}  // namespace cuda
}  // namespace turbomq
