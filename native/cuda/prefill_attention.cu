// Prefill attention over the paged KV cache, FlashAttention-2 style: a block
// owns 64 rows of one sequence and one KV head (row r = (query i, head h),
// r = i * group + h, as in attention.cu, so every K/V element serves all the
// query heads of its KV head), four warps of 16 rows each. Keys come in tiles
// of 64 tokens, gathered through the block table into shared memory with
// cp.async (two stages: the next tile loads while this one is computed) and
// shared by the four warps; the decode kernel instead has every 16-row tile
// read its keys from L2 on its own, which bounds it near 95 TFLOP/s on long
// prompts.
//   S = Q K^T: Q's fragments stay in registers; K's come from shared memory
//     by ldmatrix (rows of K are the B operand's columns).
//   O += P V: P is S's accumulator re-packed to 16 bits; V's fragments come
//     by ldmatrix.trans.
// Online softmax in base 2 per row; causal: query i of n new tokens over a
// context of ctx keys sees keys < ctx - n + i + 1, so history is unmasked
// and only the last tiles need a mask. Rows of shared memory are 16-byte
// chunks XOR-swizzled by row % 8, so an ldmatrix phase hits 8 bank groups.
// 16-bit KV only, head_dim 64 or 128, one pass over all keys (no split-K):
// the caller takes it for prefill whose blocks fill the GPU; INT8 KV, decode
// and short grids stay on attention.cu.
#include "mma.cuh"
#include "paged_batch.cuh"

namespace turbomq {
namespace cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockRows = kPrefillTileRows;
static_assert(kBlockRows == kWarps * 16, "a warp per 16 rows");
constexpr int kTileKeys = 64;

// Every field is the batch's (tiles: (sequence, 64-row tile) pairs).
using Params = PagedBatch;

// Shared-memory byte offset of chunk c of key row `row` in a [kTileKeys][D] tile.
template <int D>
__device__ __forceinline__ std::uint32_t chunk_offset(int row, int c) {
  return static_cast<std::uint32_t>(row * D * 2 + ((c ^ (row & 7)) << 4));
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads) prefill_attention_kernel(const Params p) {
  constexpr int kChunks = D / 8;      // 16-byte chunks per key row
  constexpr int kKSteps = D / 16;     // mma K steps over the head dim (S)
  constexpr int kKeyBlocks = kTileKeys / 8;  // n8 blocks of S per tile
  constexpr int kDimBlocks = D / 8;   // n8 blocks of O
  constexpr std::uint32_t kTileBytes = kTileKeys * D * 2;
  extern __shared__ __align__(128) unsigned char smem[];  // [2 stages][K, V] tiles

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
  const int kvh = blockIdx.y;
  const int seq = p.tiles[2 * blockIdx.x];
  const int row0 = p.tiles[2 * blockIdx.x + 1] * kBlockRows;
  const int q_start = p.cu_q_lens[seq];
  const int n = p.cu_q_lens[seq + 1] - q_start;
  const int ctx = p.context_lens[seq];
  const int rows = min(kBlockRows, n * p.group - row0);
  // Keys the block's first and last rows see.
  const int keys_first = ctx - n + row0 / p.group + 1;
  const int keys_last = ctx - n + (row0 + rows - 1) / p.group + 1;
  const int tiles = (keys_last + kTileKeys - 1) / kTileKeys;

  const int* table = p.block_tables + static_cast<std::int64_t>(seq) * p.max_blocks;
  const int block_mask = (1 << p.block_shift) - 1;
  const std::uint32_t smem_base = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
  auto load_tile = [&](int tile, int stage) {
    const std::uint32_t k_dst = smem_base + stage * 2 * kTileBytes;
    const std::uint32_t v_dst = k_dst + kTileBytes;
    for (int i = threadIdx.x; i < kTileKeys * kChunks; i += kThreads) {
      const int row = i / kChunks, ch = i % kChunks;
      const int tok = tile * kTileKeys + row;
      const bool ok = tok < keys_last;
      std::int64_t off = 0;
      if (ok) {
        const int block = __ldg(table + (tok >> p.block_shift));
        off = ((static_cast<std::int64_t>(block) * p.num_kv_heads + kvh) * (block_mask + 1) +
               (tok & block_mask)) * D + ch * 8;
      }
      cp_async16(k_dst + chunk_offset<D>(row, ch), static_cast<const T*>(p.k_cache) + off, ok);
      cp_async16(v_dst + chunk_offset<D>(row, ch), static_cast<const T*>(p.v_cache) + off, ok);
    }
    cp_async_commit();
  };
  if (tiles > 0) load_tile(0, 0);

  // This lane's rows: g and g + 8 of the warp's 16; their key limits (0: an
  // unused row, every key masked) and Q fragments.
  int limit[2];
  std::uint32_t qf[kKSteps][4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp * 16 + g + 8 * h;
    limit[h] = 0;
    const T* src = nullptr;
    if (r < rows) {
      const int qi = (row0 + r) / p.group;
      const int head = kvh * p.group + (row0 + r) % p.group;
      limit[h] = ctx - n + qi + 1;
      src = static_cast<const T*>(p.q) + (q_start + qi) * p.q_stride_tok + head * p.q_stride_head;
    }
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      // a0/a2: row g, dims 2c and 2c + 8; a1/a3: row g + 8.
      qf[kk][h] = src ? *reinterpret_cast<const std::uint32_t*>(src + 16 * kk + 2 * c) : 0u;
      qf[kk][h + 2] = src ? *reinterpret_cast<const std::uint32_t*>(src + 16 * kk + 8 + 2 * c) : 0u;
    }
  }

  float o[kDimBlocks][4];
#pragma unroll
  for (int j = 0; j < kDimBlocks; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f};
  const int mat = lane / 8, mrow = lane % 8;  // this lane's ldmatrix row address

  for (int t = 0; t < tiles; ++t) {
    if (t + 1 < tiles) {
      load_tile(t + 1, (t + 1) & 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const std::uint32_t k_tile = smem_base + (t & 1) * 2 * kTileBytes;
    const std::uint32_t v_tile = k_tile + kTileBytes;

    // S = Q K^T over this tile's 64 keys.
    float s[kKeyBlocks][4];
#pragma unroll
    for (int b = 0; b < kKeyBlocks; ++b)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[b][e] = 0.0f;
#pragma unroll
    for (int b2 = 0; b2 < kKeyBlocks / 2; ++b2) {
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        // matrices: keys 16 b2 + (0-7 | 8-15) x dim chunks 2 kk | 2 kk + 1
        std::uint32_t kb[4];
        ldmatrix_x4(kb, k_tile + chunk_offset<D>(16 * b2 + (mat >> 1) * 8 + mrow, 2 * kk + (mat & 1)));
        mma_m16n8k16<T>(s[2 * b2], qf[kk], kb[0], kb[1]);
        mma_m16n8k16<T>(s[2 * b2 + 1], qf[kk], kb[2], kb[3]);
      }
    }

    // Online softmax (base 2); element e of block b is key 8 b + 2 c + (e & 1)
    // of row g (e < 2) or g + 8.
    const int key0 = t * kTileKeys;
    const bool masked = key0 + kTileKeys > keys_first || limit[0] == 0 || limit[1] == 0;
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = m[h];
#pragma unroll
      for (int b = 0; b < kKeyBlocks; ++b)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = s[b][2 * h + e] * p.scale_log2;
          if (masked && key0 + 8 * b + 2 * c + e >= limit[h]) x = -INFINITY;
          s[b][2 * h + e] = x;
          mx = fmaxf(mx, x);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float base = mx == -INFINITY ? 0.0f : mx;  // a row with no key yet
      alpha[h] = exp2f(m[h] - base);
      m[h] = mx;
      float sum = 0.0f;
#pragma unroll
      for (int b = 0; b < kKeyBlocks; ++b)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = exp2f(s[b][2 * h + e] - base);
          s[b][2 * h + e] = pe;
          sum += pe;
        }
      l[h] = l[h] * alpha[h] + sum;
    }
#pragma unroll
    for (int j = 0; j < kDimBlocks; ++j) {
      o[j][0] *= alpha[0];
      o[j][1] *= alpha[0];
      o[j][2] *= alpha[1];
      o[j][3] *= alpha[1];
    }

    // O += P V, 16 keys per mma K step.
#pragma unroll
    for (int k2 = 0; k2 < kTileKeys / 16; ++k2) {
      const std::uint32_t pa[4] = {pack_pair<T>(s[2 * k2][0], s[2 * k2][1]),
                                   pack_pair<T>(s[2 * k2][2], s[2 * k2][3]),
                                   pack_pair<T>(s[2 * k2 + 1][0], s[2 * k2 + 1][1]),
                                   pack_pair<T>(s[2 * k2 + 1][2], s[2 * k2 + 1][3])};
#pragma unroll
      for (int j2 = 0; j2 < kDimBlocks / 2; ++j2) {
        // matrices: keys 16 k2 + (0-7 | 8-15) x dim chunks 2 j2 | 2 j2 + 1, transposed
        std::uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_tile + chunk_offset<D>(16 * k2 + (mat & 1) * 8 + mrow,
                                                       2 * j2 + (mat >> 1)));
        mma_m16n8k16<T>(o[2 * j2], pa, vb[0], vb[1]);
        mma_m16n8k16<T>(o[2 * j2 + 1], pa, vb[2], vb[3]);
      }
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }

  // Normalize and store: element e of block j is dim 8 j + 2 c + (e & 1).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = l[h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int r = warp * 16 + g + 8 * h;
    if (r >= rows) continue;
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    const int qi = (row0 + r) / p.group;
    const int head = kvh * p.group + (row0 + r) % p.group;
    T* dst = static_cast<T*>(p.out) +
             (static_cast<std::int64_t>(q_start + qi) * p.num_heads + head) * D + 2 * c;
#pragma unroll
    for (int j = 0; j < kDimBlocks; ++j) {
      *reinterpret_cast<std::uint32_t*>(dst + 8 * j) =
          pack_pair<T>(o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
    }
  }
}

template <typename T, int D>
void launch(const Params& p, int num_tiles, cudaStream_t s) {
  constexpr int kSmem = 2 * 2 * kTileKeys * D * 2;  // two stages of K and V
  static bool opted_in = false;
  if (!opted_in) {
    check_cuda(cudaFuncSetAttribute(prefill_attention_kernel<T, D>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
               "prefill_attention: shared memory opt-in");
    opted_in = true;
  }
  prefill_attention_kernel<T, D><<<dim3(num_tiles, p.num_kv_heads), kThreads, kSmem, s>>>(p);
  check_launch("prefill_attention_kernel");
}

}  // namespace

void prefill_attention(const AttentionArgs& a) {
  require(a.cache_dtype == a.dtype, "prefill_attention: the cache must be 16-bit, q's dtype");
  require(a.tiles != 0, "prefill_attention: takes a tile list");
  const Params p = paged_batch(a, "prefill_attention");
  if (a.num_tiles == 0) return;
  cudaStream_t s = as_stream(a.stream);
  const bool f16 = a.dtype == DType::kF16;
  if (a.head_dim == 128) {
    f16 ? launch<__half, 128>(p, a.num_tiles, s) : launch<__nv_bfloat16, 128>(p, a.num_tiles, s);
  } else {
    f16 ? launch<__half, 64>(p, a.num_tiles, s) : launch<__nv_bfloat16, 64>(p, a.num_tiles, s);
  }
}

}  // namespace cuda
}  // namespace turbomq
