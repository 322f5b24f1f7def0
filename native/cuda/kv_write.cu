// write_kv: scatter new tokens' K/V into the paged cache, quantizing to INT8
// on the fly when the cache is int8 (symmetric, one float32 scale per token
// and KV head, as reference.quantize_int8).
#include "common.cuh"

namespace turbomq {
namespace cuda {
namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kMaxPerLane = 8;  // head_dim <= 256 for the int8 path

struct WriteArgs {
  void* k_cache;
  void* v_cache;
  float* k_scale;
  float* v_scale;
  const void* k;
  std::int64_t k_stride_tok, k_stride_head;
  const void* v;
  std::int64_t v_stride_tok, v_stride_head;
  const std::int64_t* slot_mapping;
  std::int64_t tokens;
  int num_kv_heads, head_dim, block_size;
};

// One warp per (token, KV head, K or V). Items are ordered K then V within a
// token-head so neighbouring warps touch neighbouring memory.
template <typename T, bool kInt8>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) write_kv_kernel(const WriteArgs a) {
  const std::int64_t item = blockIdx.x * static_cast<std::int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (item >= a.tokens * a.num_kv_heads * 2) return;
  const bool is_v = item & 1;
  const int head = static_cast<int>((item >> 1) % a.num_kv_heads);
  const std::int64_t tok = (item >> 1) / a.num_kv_heads;
  const std::int64_t slot = a.slot_mapping[tok];
  if (slot < 0) return;
  const std::int64_t block = slot / a.block_size;
  const int offset = static_cast<int>(slot % a.block_size);
  const std::int64_t row = (block * a.num_kv_heads + head) * a.block_size + offset;
  const T* src = static_cast<const T*>(is_v ? a.v : a.k) +
                 tok * (is_v ? a.v_stride_tok : a.k_stride_tok) +
                 head * (is_v ? a.v_stride_head : a.k_stride_head);
  const int d = a.head_dim;
  if constexpr (!kInt8) {
    T* dst = static_cast<T*>(is_v ? a.v_cache : a.k_cache) + row * d;
    for (int i = lane; i < d / 8; i += 32) {
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    }
  } else {
    // Lane owns elements [lane * per, lane * per + per).
    const int per = d / 32;
    float f[kMaxPerLane];
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) {
      f[e] = e < per ? to_float(src[lane * per + e]) : 0.0f;
      amax = fmaxf(amax, fabsf(f[e]));
    }
    amax = warp_max(amax);
    // IEEE division and round-half-even, as the reference's x / scale and torch.round.
    const float scale = fmaxf(amax, 1e-8f) / 127.0f;
    std::int8_t* dst = static_cast<std::int8_t*>(is_v ? a.v_cache : a.k_cache) + row * d;
#pragma unroll
    for (int e = 0; e < kMaxPerLane; ++e) {
      if (e < per) {
        const float qv = fminf(fmaxf(rintf(f[e] / scale), -127.0f), 127.0f);
        dst[lane * per + e] = static_cast<std::int8_t>(qv);
      }
    }
    if (lane == 0) (is_v ? a.v_scale : a.k_scale)[row] = scale;
  }
}

}  // namespace

void write_kv(std::uintptr_t k_cache, std::uintptr_t v_cache, std::uintptr_t k_scale,
              std::uintptr_t v_scale, std::uintptr_t k, std::int64_t k_stride_tok,
              std::int64_t k_stride_head, std::uintptr_t v, std::int64_t v_stride_tok,
              std::int64_t v_stride_head, std::uintptr_t slot_mapping, std::int64_t tokens,
              int num_kv_heads, int head_dim, int block_size, DType dtype, DType cache_dtype,
              std::uintptr_t stream) {
  require(dtype == DType::kF16 || dtype == DType::kBF16, "write_kv: k/v must be float16 or bfloat16");
  const bool int8 = cache_dtype == DType::kI8;
  require(int8 || cache_dtype == dtype, "write_kv: a 16-bit cache must have k/v's dtype");
  if (int8) {
    require(head_dim % 32 == 0 && head_dim <= 32 * kMaxPerLane,
            "write_kv: int8 cache needs head_dim a multiple of 32, at most 256");
  } else {
    require(head_dim % 8 == 0 && k_stride_tok % 8 == 0 && k_stride_head % 8 == 0 &&
                v_stride_tok % 8 == 0 && v_stride_head % 8 == 0,
            "write_kv: head_dim and strides must be multiples of 8");
  }
  require(block_size > 0, "write_kv: block_size must be positive");
  const std::int64_t items = tokens * num_kv_heads * 2;
  if (items == 0) return;
  WriteArgs a{reinterpret_cast<void*>(k_cache), reinterpret_cast<void*>(v_cache),
              reinterpret_cast<float*>(k_scale), reinterpret_cast<float*>(v_scale),
              reinterpret_cast<const void*>(k), k_stride_tok, k_stride_head,
              reinterpret_cast<const void*>(v), v_stride_tok, v_stride_head,
              reinterpret_cast<const std::int64_t*>(slot_mapping), tokens, num_kv_heads, head_dim,
              block_size};
  const unsigned blocks = static_cast<unsigned>((items + kWarpsPerBlock - 1) / kWarpsPerBlock);
  cudaStream_t s = as_stream(stream);
  constexpr int kThreads = kWarpsPerBlock * 32;
  if (dtype == DType::kF16) {
    if (int8) write_kv_kernel<__half, true><<<blocks, kThreads, 0, s>>>(a);
    else write_kv_kernel<__half, false><<<blocks, kThreads, 0, s>>>(a);
  } else {
    if (int8) write_kv_kernel<__nv_bfloat16, true><<<blocks, kThreads, 0, s>>>(a);
    else write_kv_kernel<__nv_bfloat16, false><<<blocks, kThreads, 0, s>>>(a);
  }
  check_launch("write_kv_kernel");
}

}  // namespace cuda
}  // namespace turbomq
