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

}  // namespace cuda
}  // namespace turbomq
