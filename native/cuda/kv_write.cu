// write_kv: scatter new tokens' K/V into the paged cache, quantizing to INT8
// on the fly when the cache is int8 (symmetric, one float32 scale per token
// and KV head, as reference.quantize_int8). rotary_write_kv: rotary on q and
// k fused with that write (one launch instead of two).
#include "common.cuh"
#include "rope_kv.cuh"

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
  const std::int64_t row = cache_row(slot, head, a.num_kv_heads, a.block_size);
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

struct RopeWriteArgs {
  void* q_out;
  const void* q;
  std::int64_t q_stride_tok, q_stride_head;
  const void* k;
  std::int64_t k_stride_tok, k_stride_head;
  const void* v;
  std::int64_t v_stride_tok, v_stride_head;
  const std::int64_t* positions;
  const float* cos_sin;
  const std::int64_t* slot_mapping;
  void* k_cache;
  void* v_cache;
  float* k_scale;
  float* v_scale;
  std::int64_t items;  // tokens * (nh + 2 nkv) rows
  int num_heads, num_kv_heads, head_dim, block_size, lanes;  // lanes = head_dim / 16
};

// A group of `lanes` = d/16 threads per (token, row); rows are the q heads,
// then the k heads, then the v heads. Thread `sub` of a group owns dims
// [8 sub, 8 sub + 8) and the same past d/2: the rotation pairs (j, j + d/2).
// q and k are rotated as rotary_kernel does and rounded to T (k is then
// stored from those values, as write_kv would store rotary's output); v is
// copied. INT8: the group's amax (shuffles within the group), then
// write_kv's scale and rounding.
template <typename T, bool kInt8>
__global__ void __launch_bounds__(128) rotary_write_kv_kernel(const RopeWriteArgs a) {
  launch_dependents();
  grid_dependency_wait();  // a programmatic dependent: q, k, v may still be being written
  const std::int64_t tid = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  const int L = a.lanes;
  const std::int64_t item = tid / L;
  if (item >= a.items) return;  // whole groups: items are contiguous
  const int sub = static_cast<int>(tid % L);
  const int rows = a.num_heads + 2 * a.num_kv_heads;
  const std::int64_t tok = item / rows;
  const int row = static_cast<int>(item % rows);
  const int d = a.head_dim, half = d / 2, j0 = 8 * sub;
  const int kind = row < a.num_heads ? 0 : (row < a.num_heads + a.num_kv_heads ? 1 : 2);
  const int head = kind == 0 ? row : (kind == 1 ? row - a.num_heads : row - a.num_heads - a.num_kv_heads);
  const T* src = kind == 0   ? static_cast<const T*>(a.q) + tok * a.q_stride_tok + head * a.q_stride_head
                 : kind == 1 ? static_cast<const T*>(a.k) + tok * a.k_stride_tok + head * a.k_stride_head
                             : static_cast<const T*>(a.v) + tok * a.v_stride_tok + head * a.v_stride_head;
  float lo[8], hi[8];
  unpack8<T>(*reinterpret_cast<const uint4*>(src + j0), lo);
  unpack8<T>(*reinterpret_cast<const uint4*>(src + half + j0), hi);
  if (kind != 2) {
    const float* cs = a.cos_sin + a.positions[tok] * d;
    float c[8], s[8];
    const float4* cv = reinterpret_cast<const float4*>(cs + j0);
    const float4* sv = reinterpret_cast<const float4*>(cs + half + j0);
    *reinterpret_cast<float4*>(c) = __ldg(cv);
    *reinterpret_cast<float4*>(c + 4) = __ldg(cv + 1);
    *reinterpret_cast<float4*>(s) = __ldg(sv);
    *reinterpret_cast<float4*>(s + 4) = __ldg(sv + 1);
#pragma unroll
    for (int e = 0; e < 8; ++e) rotate_pair<T>(lo[e], hi[e], c[e], s[e]);
  }
  if (kind == 0) {
    T* dst = static_cast<T*>(a.q_out) + (tok * a.num_heads + head) * d;
    *reinterpret_cast<uint4*>(dst + j0) = pack8<T>(lo);
    *reinterpret_cast<uint4*>(dst + half + j0) = pack8<T>(hi);
    return;
  }
  const std::int64_t slot = a.slot_mapping[tok];
  if (slot < 0) return;  // the whole group shares the token
  const std::int64_t crow = cache_row(slot, head, a.num_kv_heads, a.block_size);
  const bool is_v = kind == 2;
  if constexpr (!kInt8) {
    T* dst = static_cast<T*>(is_v ? a.v_cache : a.k_cache) + crow * d;
    *reinterpret_cast<uint4*>(dst + j0) = pack8<T>(lo);
    *reinterpret_cast<uint4*>(dst + half + j0) = pack8<T>(hi);
  } else {
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fmaxf(fabsf(lo[e]), fabsf(hi[e])));
    const int lane = threadIdx.x % 32;
    const unsigned mask = L == 32 ? 0xffffffffu : ((1u << L) - 1u) << (lane & ~(L - 1));
    for (int o = L / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(mask, amax, o));
    const float scale = fmaxf(amax, 1e-8f) / 127.0f;
    std::uint32_t ql[2] = {0u, 0u}, qh[2] = {0u, 0u};
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float vl = fminf(fmaxf(rintf(lo[e] / scale), -127.0f), 127.0f);
      const float vh = fminf(fmaxf(rintf(hi[e] / scale), -127.0f), 127.0f);
      ql[e / 4] |= (static_cast<std::uint32_t>(static_cast<int>(vl)) & 0xffu) << (8 * (e % 4));
      qh[e / 4] |= (static_cast<std::uint32_t>(static_cast<int>(vh)) & 0xffu) << (8 * (e % 4));
    }
    std::int8_t* dst = static_cast<std::int8_t*>(is_v ? a.v_cache : a.k_cache) + crow * d;
    *reinterpret_cast<uint2*>(dst + j0) = make_uint2(ql[0], ql[1]);
    *reinterpret_cast<uint2*>(dst + half + j0) = make_uint2(qh[0], qh[1]);
    if (sub == 0) (is_v ? a.v_scale : a.k_scale)[crow] = scale;
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

namespace turbomq {
namespace cuda {

void rotary_write_kv(std::uintptr_t q_out, std::uintptr_t q, std::int64_t q_stride_tok,
                     std::int64_t q_stride_head, std::uintptr_t k, std::int64_t k_stride_tok,
                     std::int64_t k_stride_head, std::uintptr_t v, std::int64_t v_stride_tok,
                     std::int64_t v_stride_head, std::uintptr_t positions, std::uintptr_t cos_sin,
                     std::uintptr_t slot_mapping, std::uintptr_t k_cache, std::uintptr_t v_cache,
                     std::uintptr_t k_scale, std::uintptr_t v_scale, std::int64_t tokens,
                     int num_heads, int num_kv_heads, int head_dim, int block_size, DType dtype,
                     DType cache_dtype, std::uintptr_t stream) {
  require(dtype == DType::kF16 || dtype == DType::kBF16,
          "rotary_write_kv: q/k/v must be float16 or bfloat16");
  const bool int8 = cache_dtype == DType::kI8;
  require(int8 || cache_dtype == dtype, "rotary_write_kv: a 16-bit cache must have k/v's dtype");
  const int lanes = head_dim / 16;
  require(head_dim % 16 == 0 && lanes >= 1 && lanes <= 32 && (lanes & (lanes - 1)) == 0,
          "rotary_write_kv: head_dim / 16 must be a power of two <= 32");
  require(q % 16 == 0 && k % 16 == 0 && v % 16 == 0 && q_out % 16 == 0,
          "rotary_write_kv: q, k, v, q_out must be 16-byte aligned");
  require(q_stride_tok % 8 == 0 && q_stride_head % 8 == 0 && k_stride_tok % 8 == 0 &&
              k_stride_head % 8 == 0 && v_stride_tok % 8 == 0 && v_stride_head % 8 == 0,
          "rotary_write_kv: strides must be multiples of 8 elements");
  require(block_size > 0 && num_heads > 0 && num_kv_heads > 0, "rotary_write_kv: bad sizes");
  const std::int64_t items = tokens * (num_heads + 2 * num_kv_heads);
  if (items == 0) return;
  RopeWriteArgs a{reinterpret_cast<void*>(q_out), reinterpret_cast<const void*>(q), q_stride_tok,
                  q_stride_head, reinterpret_cast<const void*>(k), k_stride_tok, k_stride_head,
                  reinterpret_cast<const void*>(v), v_stride_tok, v_stride_head,
                  reinterpret_cast<const std::int64_t*>(positions),
                  reinterpret_cast<const float*>(cos_sin),
                  reinterpret_cast<const std::int64_t*>(slot_mapping),
                  reinterpret_cast<void*>(k_cache), reinterpret_cast<void*>(v_cache),
                  reinterpret_cast<float*>(k_scale), reinterpret_cast<float*>(v_scale), items,
                  num_heads, num_kv_heads, head_dim, block_size, lanes};
  constexpr int kThreads = 128;
  const std::int64_t threads = items * lanes;
  const std::int64_t blocks = (threads + kThreads - 1) / kThreads;
  require(blocks < (1LL << 31), "rotary_write_kv: too many tokens");
  cudaStream_t s = as_stream(stream);
  const unsigned grid = static_cast<unsigned>(blocks);
  auto go = [&](auto kernel) {
    launch_programmatic(kernel, a, dim3(grid), kThreads, 0, s, "rotary_write_kv_kernel");
  };
  if (dtype == DType::kF16) {
    int8 ? go(rotary_write_kv_kernel<__half, true>) : go(rotary_write_kv_kernel<__half, false>);
  } else {
    int8 ? go(rotary_write_kv_kernel<__nv_bfloat16, true>)
         : go(rotary_write_kv_kernel<__nv_bfloat16, false>);
  }
}

}  // namespace cuda
}  // namespace turbomq
