// Paged attention over block tables: decode (one query per sequence) and
// prefill with history (Q shorter than K, causal in the new part), one kernel.
//
// Work unit: a tile of 16 rows, row r = (query i, head h) of one sequence
// whose heads share one KV head (r = i * group + h), so each K/V element read
// from memory serves every query head of its KV head (GQA). A block of four
// warps takes one (tile, KV head, context partition); the warps stride over
// 16-token groups of the partition with an online softmax each, then combine
// through shared memory. Both products run on tensor cores
// (mma.m16n8k16, fp32 accumulation):
//   S = Q K^T : K fragments come straight from 16-byte global loads. The
//     reduction dimension is permuted so that a lane's 16 contiguous bytes
//     are its B fragment; Q's A fragments use the same permutation.
//   O += P V  : P is S's accumulator re-packed (the FlashAttention-2
//     register reuse); V's B fragments need tokens along the reduction
//     dimension, so each 8x8 sub-tile is transposed in registers
//     (movmatrix) and the output columns come out permuted, which the
//     epilogue undoes.
// INT8 KV is widened to 16-bit exactly (|q| <= 127) in registers; the
// per-token K scale multiplies S, the V scale is folded into P.
// With INT8 a warp loads its next 16-token group while it computes the
// current one (half the bytes per group, so registers allow it).
// Split-K: with several partitions each block writes its normalized partial
// output, max and sum. The last block to finish a (tile, KV head) combines
// them (an atomic counter per (tile, KV head), reset by that block, so a
// replayed graph finds it zero again); without a counter buffer,
// attention_reduce_kernel does it in a second launch. Either way the
// partitions are combined in index order: the result does not depend on
// which block finishes last.
#include "mma.cuh"
#include "paged_batch.cuh"

namespace turbomq {
namespace cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = kAttentionTileRows;  // 16: the mma's M
constexpr int kGroupTokens = 16;           // tokens per warp step: the PV mma's K

struct Params : PagedBatch {
  const float* k_scale;
  const float* v_scale;
  int partition_size, num_parts;
  float* part_o;
  float* part_ml;
  int* counters;           // [num_tiles * nkv] or null: combine in a second kernel
  std::int64_t part_rows;  // num_tiles * nkv * num_parts * kRows: offset of the sums in part_ml
};

// What a tile covers: its sequence, first row, rows in use and key range.
struct Tile {
  int seq, row0, rows, q_start, n, ctx, kmax;
};

__device__ __forceinline__ Tile load_tile(const Params& p, int tile) {
  Tile t;
  int rt = 0;
  t.seq = tile;
  if (p.tiles != nullptr) {
    t.seq = p.tiles[2 * tile];
    rt = p.tiles[2 * tile + 1];
  }
  t.q_start = p.cu_q_lens[t.seq];
  t.n = p.cu_q_lens[t.seq + 1] - t.q_start;
  t.ctx = p.context_lens[t.seq];
  t.row0 = rt * kRows;
  t.rows = min(kRows, t.n * p.group - t.row0);
  // The last query of the tile sees the most keys: it sits at ctx - n + i.
  const int last_query = (t.row0 + t.rows - 1) / p.group;
  t.kmax = t.ctx - t.n + last_query + 1;
  return t;
}

template <typename T>
struct Int8Widen;
template <>
struct Int8Widen<__half> {
  // Four int8 (bytes of w, low first) -> two half2, exactly: 1024 + (x + 128)
  // is built in the mantissa, then 1152 is subtracted.
  __device__ __forceinline__ static void widen_int8(std::uint32_t w, std::uint32_t* out) {
    const std::uint32_t u = w ^ 0x80808080u;
    const __half2 bias = __half2half2(__ushort_as_half(0x6480));  // 1152
    std::uint32_t lo = __byte_perm(u, 0x64646464u, 0x4140);
    std::uint32_t hi = __byte_perm(u, 0x64646464u, 0x4342);
    __half2 a = __hsub2(*reinterpret_cast<__half2*>(&lo), bias);
    __half2 b = __hsub2(*reinterpret_cast<__half2*>(&hi), bias);
    out[0] = *reinterpret_cast<std::uint32_t*>(&a);
    out[1] = *reinterpret_cast<std::uint32_t*>(&b);
  }
};
template <>
struct Int8Widen<__nv_bfloat16> {
  // Four int8 -> two bf16x2, exactly: 2^23 + (x + 128) is built in a float's
  // mantissa, the offset subtracted, and the (exact) upper halves kept.
  __device__ __forceinline__ static void widen_int8(std::uint32_t w, std::uint32_t* out) {
    const std::uint32_t u = w ^ 0x80808080u;
    float f[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[i] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7540 + i)) - 8388736.0f;
    }
    out[0] = __byte_perm(__float_as_uint(f[0]), __float_as_uint(f[1]), 0x7632);
    out[1] = __byte_perm(__float_as_uint(f[2]), __float_as_uint(f[3]), 0x7632);
  }
};

__device__ __forceinline__ std::uint32_t transpose8x8(std::uint32_t x) {
  std::uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// 16 bytes of K or V -> kPairs 32-bit registers of two 16-bit values each.
template <typename T, bool kInt8>
__device__ __forceinline__ void widen(const uint4& raw, std::uint32_t* pairs) {
  const std::uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (kInt8) {
      Int8Widen<T>::widen_int8(w[i], pairs + 2 * i);
    } else {
      pairs[i] = w[i];
    }
  }
}

// Combines the partitions of one (tile, KV head) (paged_batch.cuh).
template <typename T, int D>
__device__ __forceinline__ void combine_partitions(const Params& p, const Tile& tile, int tile_idx,
                                                   int kvh) {
  const int parts = (tile.kmax + p.partition_size - 1) / p.partition_size;
  const std::int64_t prow0 =
      (static_cast<std::int64_t>(tile_idx) * p.num_kv_heads + kvh) * p.num_parts * kRows;
  combine_partials<T, D, kRows, kThreads>(p, Partials{p.part_o, p.part_ml, p.part_rows}, prow0,
                                          parts, tile.row0, tile.rows, tile.q_start, kvh);
}

// Lane (g = lane / 4, c = lane % 4) owns, for chunk j, dims
// [kChunk * (4 * j + c), + kChunk) of a token: one 16-byte load.
// kLoadAhead: a warp loads its next group while it computes the current one
// (as INT8 always does), for 16-bit KV too.
template <typename T, bool kInt8, int D, bool kLoadAhead>
__global__ void __launch_bounds__(kThreads) paged_attention_kernel(const Params p) {
  constexpr int kChunk = kInt8 ? 16 : 8;  // elements per 16-byte load
  constexpr int kJ = D / (4 * kChunk);     // loads per token per lane
  constexpr int kPairs = kChunk / 2;       // 32-bit pairs per chunk
  constexpr int kElem = kInt8 ? 1 : 2;
  static_assert(kJ >= 1 && D % (4 * kChunk) == 0, "head_dim must be a multiple of 4 chunks");

  launch_dependents();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, c = lane & 3;
  const int kvh = blockIdx.y, part = blockIdx.z;
  // The batch's layout (lengths, block tables) is written before the
  // layer's kernels run (host copies, or torch ops, which never start
  // early), so it is read before the wait below.
  const Tile tile = load_tile(p, blockIdx.x);
  const int k_begin = part * p.partition_size;
  if (k_begin >= tile.kmax) return;  // past this tile's keys; the reduce skips it
  const int k_end = min(k_begin + p.partition_size, tile.kmax);
  const int* table = p.block_tables + static_cast<std::int64_t>(tile.seq) * p.max_blocks;
  const int block_mask = (1 << p.block_shift) - 1;
  const char* k_base = static_cast<const char*>(p.k_cache);
  const char* v_base = static_cast<const char*>(p.v_cache);
  // K/V row of token tok (clamped into the range: finite data, masked later).
  auto kv_row = [&](int tok) {
    tok = min(tok, k_end - 1);
    const int block = __ldg(table + (tok >> p.block_shift));
    return (static_cast<std::int64_t>(block) * p.num_kv_heads + kvh) * (block_mask + 1) +
           (tok & block_mask);
  };

  // Launched as a programmatic dependent, the block starts while the kernel
  // before it (the one that writes q and this step's K/V) still runs: it
  // pulls its partition's K/V rows into L2 meanwhile (L2 is where writes
  // meet, so a row written after its prefetch is still read fresh), and
  // waits before its first real load.
  for (int base = k_begin + warp * kGroupTokens; base < k_end; base += kWarps * kGroupTokens) {
    if (c < 2) {
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const std::int64_t row = kv_row(base + 8 * t + g);
        const int off = 128 * c;
        if (off < D * kElem) {
          prefetch_l2(k_base + row * D * kElem + off);
          prefetch_l2(v_base + row * D * kElem + off);
        }
      }
    }
  }
  grid_dependency_wait();

  // Rows g and g + 8 of the tile: their query position (-1: unused row).
  int qpos[2];
  std::uint32_t qa[2][kJ][kPairs];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    qpos[h] = -1;
#pragma unroll
    for (int j = 0; j < kJ; ++j)
#pragma unroll
      for (int i = 0; i < kPairs; ++i) qa[h][j][i] = 0u;
    if (r < tile.rows) {
      const int qi = (tile.row0 + r) / p.group;
      const int head = kvh * p.group + (tile.row0 + r) % p.group;
      qpos[h] = tile.ctx - tile.n + qi;
      const T* src = static_cast<const T*>(p.q) + (tile.q_start + qi) * p.q_stride_tok +
                     head * p.q_stride_head;
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
#pragma unroll
        for (int v = 0; v < kPairs / 4; ++v) {
          const uint4 x = *reinterpret_cast<const uint4*>(src + kChunk * (4 * j + c) + 8 * v);
          qa[h][j][4 * v + 0] = x.x;
          qa[h][j][4 * v + 1] = x.y;
          qa[h][j][4 * v + 2] = x.z;
          qa[h][j][4 * v + 3] = x.w;
        }
      }
    }
  }

  float acc[kJ][kPairs][4];
#pragma unroll
  for (int j = 0; j < kJ; ++j)
#pragma unroll
    for (int i = 0; i < kPairs; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][i][e] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f};

  // Each lane loads token base + 8 * half + g of a 16-token group; tokens
  // past the range are clamped to a valid one (finite data) and masked below.
  auto load_group = [&](int base, uint4 (&kraw)[2][kJ], uint4 (&vraw)[2][kJ], float (&ks)[2],
                        float (&vs)[2]) {
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const std::int64_t row = kv_row(base + 8 * t + g);
      const char* kp = k_base + row * D * kElem;
      const char* vp = v_base + row * D * kElem;
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        kraw[t][j] = __ldg(reinterpret_cast<const uint4*>(kp + (4 * j + c) * 16));
        vraw[t][j] = __ldg(reinterpret_cast<const uint4*>(vp + (4 * j + c) * 16));
      }
      ks[t] = vs[t] = 1.0f;
      if constexpr (kInt8) {
        ks[t] = __ldg(p.k_scale + row);
        vs[t] = __ldg(p.v_scale + row);
      }
    }
  };
  // INT8 groups are half the bytes of 16-bit ones: each warp loads the next
  // group while it computes this one, so as many bytes are in flight.
  constexpr bool kPrefetch = kInt8 || kLoadAhead;
  constexpr int kStep = kWarps * kGroupTokens;
  uint4 kraw[2][kJ], vraw[2][kJ], knext[2][kJ], vnext[2][kJ];
  float ks[2], vs[2], ksnext[2], vsnext[2];
  if (kPrefetch && k_begin + warp * kGroupTokens < k_end) {
    load_group(k_begin + warp * kGroupTokens, knext, vnext, ksnext, vsnext);
  }
  for (int base = k_begin + warp * kGroupTokens; base < k_end; base += kStep) {
    if constexpr (kPrefetch) {
#pragma unroll
      for (int t = 0; t < 2; ++t) {
#pragma unroll
        for (int j = 0; j < kJ; ++j) {
          kraw[t][j] = knext[t][j];
          vraw[t][j] = vnext[t][j];
        }
        ks[t] = ksnext[t];
        vs[t] = vsnext[t];
      }
      if (base + kStep < k_end) load_group(base + kStep, knext, vnext, ksnext, vsnext);
    } else {
      load_group(base, kraw, vraw, ks, vs);
    }

    // S = Q K^T for the two 8-token halves; s[t][0..1]: row g, tokens
    // 8t + 2c + {0,1}; s[t][2..3]: row g + 8.
    float s[2][4];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[t][e] = 0.0f;
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        std::uint32_t kb[kPairs];
        widen<T, kInt8>(kraw[t][j], kb);
#pragma unroll
        for (int st = 0; st < kPairs / 2; ++st) {
          const std::uint32_t a[4] = {qa[0][j][2 * st], qa[1][j][2 * st], qa[0][j][2 * st + 1],
                                      qa[1][j][2 * st + 1]};
          mma_m16n8k16<T>(s[t], a, kb[2 * st], kb[2 * st + 1]);
        }
      }
    }

    // Scale (log2 domain), dequantize K, mask; then the online softmax.
    float vsc[2][2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int src_lane = (2 * c + e) * 4;  // the lane that loaded this token
        const float kscale = kInt8 ? __shfl_sync(0xffffffffu, ks[t], src_lane) : 1.0f;
        vsc[t][e] = kInt8 ? __shfl_sync(0xffffffffu, vs[t], src_lane) : 1.0f;
        const int tok = base + 8 * t + 2 * c + e;
        const float f = p.scale_log2 * kscale;
        s[t][e] = (tok < k_end && tok <= qpos[0]) ? s[t][e] * f : -INFINITY;
        s[t][2 + e] = (tok < k_end && tok <= qpos[1]) ? s[t][2 + e] * f : -INFINITY;
      }
    }
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[h], mx);
      const float ref = m_new == -INFINITY ? 0.0f : m_new;  // all masked so far: keep exp2 finite
      alpha[h] = exp2f(m[h] - ref);
      m[h] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int t = 0; t < 2; ++t) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          s[t][2 * h + e] = exp2f(s[t][2 * h + e] - ref);
          sum += s[t][2 * h + e];
        }
      }
      l[h] = l[h] * alpha[h] + sum;
    }
#pragma unroll
    for (int j = 0; j < kJ; ++j)
#pragma unroll
      for (int i = 0; i < kPairs; ++i) {
        acc[j][i][0] *= alpha[0];
        acc[j][i][1] *= alpha[0];
        acc[j][i][2] *= alpha[1];
        acc[j][i][3] *= alpha[1];
      }

    // P as the A fragment of a k16 step: tokens 0..7 then 8..15.
    const std::uint32_t pa[4] = {
        pack_pair<T>(s[0][0] * vsc[0][0], s[0][1] * vsc[0][1]),
        pack_pair<T>(s[0][2] * vsc[0][0], s[0][3] * vsc[0][1]),
        pack_pair<T>(s[1][0] * vsc[1][0], s[1][1] * vsc[1][1]),
        pack_pair<T>(s[1][2] * vsc[1][0], s[1][3] * vsc[1][1])};

    // O += P V. Pair i of chunk j, transposed across the 8 lanes of each
    // token, gives lane (g, c) tokens 2c, 2c+1 of dim
    // kChunk * (4j + g/2) + 2i + g%2: the B fragment of output column g.
#pragma unroll
    for (int j = 0; j < kJ; ++j) {
      std::uint32_t v0[kPairs], v1[kPairs];
      widen<T, kInt8>(vraw[0][j], v0);
      widen<T, kInt8>(vraw[1][j], v1);
#pragma unroll
      for (int i = 0; i < kPairs; ++i) {
        mma_m16n8k16<T>(acc[j][i], pa, transpose8x8(v0[i]), transpose8x8(v1[i]));
      }
    }
  }

  // Combine the warps: each writes its unnormalized output, max and sum.
  __shared__ __align__(16) float sm_o[kWarps][kRows][D];  // float2 stores
  __shared__ float sm_m[kWarps][kRows];
  __shared__ float sm_l[kWarps][kRows];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    if (c == 0) {
      sm_m[warp][g + 8 * h] = m[h];
      sm_l[warp][g + 8 * h] = l[h];
    }
  }
  // Output column 2c + e of pair i in chunk j is dim kChunk * (4j + c) + 2i + e.
#pragma unroll
  for (int j = 0; j < kJ; ++j)
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      const int dim = kChunk * (4 * j + c) + 2 * i;
      *reinterpret_cast<float2*>(&sm_o[warp][g][dim]) = make_float2(acc[j][i][0], acc[j][i][1]);
      *reinterpret_cast<float2*>(&sm_o[warp][g + 8][dim]) = make_float2(acc[j][i][2], acc[j][i][3]);
    }
  __syncthreads();

  for (int idx = threadIdx.x; idx < tile.rows * D; idx += kThreads) {
    const int r = idx / D, dim = idx % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, sm_m[w][r]);
    float sum = 0.0f, o = 0.0f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float wt = exp2f(sm_m[w][r] - mx);
        sum += sm_l[w][r] * wt;
        o += sm_o[w][r][dim] * wt;
      }
    }
    o = sum > 0.0f ? o / sum : 0.0f;
    if (p.num_parts == 1) {
      const int qi = (tile.row0 + r) / p.group;
      const int head = kvh * p.group + (tile.row0 + r) % p.group;
      T* out = static_cast<T*>(p.out) +
               (static_cast<std::int64_t>(tile.q_start + qi) * p.num_heads + head) * D + dim;
      *out = from_float<T>(o);
    } else {
      const std::int64_t prow =
          ((static_cast<std::int64_t>(blockIdx.x) * p.num_kv_heads + kvh) * p.num_parts + part) *
              kRows + r;
      p.part_o[prow * D + dim] = o;
      if (dim == 0) {
        p.part_ml[prow] = mx;
        p.part_ml[p.part_rows + prow] = sum;
      }
    }
  }

  // Fused combine: the last partition block of this (tile, KV head) to
  // arrive reads every partial (made visible by the fence) and writes out.
  if (p.num_parts > 1 && p.counters != nullptr) {
    const int parts = (tile.kmax + p.partition_size - 1) / p.partition_size;
    int* counter = p.counters + static_cast<std::int64_t>(blockIdx.x) * p.num_kv_heads + kvh;
    if (last_partition(counter, parts)) combine_partitions<T, D>(p, tile, blockIdx.x, kvh);
  }
}

// One block per (tile, KV head): the combine as a second launch.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) attention_reduce_kernel(const Params p) {
  launch_dependents();
  const Tile tile = load_tile(p, blockIdx.x);
  combine_partitions<T, D>(p, tile, blockIdx.x, blockIdx.y);
}

bool g_attention_programmatic = true;

template <typename T, bool kInt8, int D>
void launch(const Params& p, bool load_ahead, int num_tiles, cudaStream_t stream) {
  const dim3 grid(num_tiles, p.num_kv_heads, p.num_parts);
  auto kernel = paged_attention_kernel<T, kInt8, D, false>;
  if constexpr (!kInt8) {
    if (load_ahead) kernel = paged_attention_kernel<T, kInt8, D, true>;
  }
  launch_kernel(g_attention_programmatic, kernel, grid, kThreads, 0, stream,
                "paged_attention_kernel", p);
  if (p.num_parts > 1 && p.counters == nullptr) {
    attention_reduce_kernel<T, D><<<dim3(num_tiles, p.num_kv_heads), kThreads, 0, stream>>>(p);
    check_launch("attention_reduce_kernel");
  }
}

template <typename T>
void dispatch_head_dim(const Params& p, bool int8, bool ahead, int head_dim, int num_tiles,
                       cudaStream_t s) {
  if (head_dim == 128) {
    int8 ? launch<T, true, 128>(p, ahead, num_tiles, s)
         : launch<T, false, 128>(p, ahead, num_tiles, s);
  } else {
    int8 ? launch<T, true, 64>(p, ahead, num_tiles, s)
         : launch<T, false, 64>(p, ahead, num_tiles, s);
  }
}

}  // namespace

void set_attention_programmatic(bool on) { g_attention_programmatic = on; }

void paged_attention(const AttentionArgs& a) {
  Params p{};
  static_cast<PagedBatch&>(p) = paged_batch(a, "paged_attention");
  const bool int8 = a.cache_dtype == DType::kI8;
  require(int8 || a.cache_dtype == a.dtype, "paged_attention: a 16-bit cache must have q's dtype");
  require(a.num_parts >= 1 && a.partition_size > 0 && a.partition_size % kAttentionPartitionAlign == 0,
          "paged_attention: partition_size must be a positive multiple of 64");
  require(a.num_parts == 1 || (a.part_o != 0 && a.part_ml != 0),
          "paged_attention: split-K needs partial buffers");
  require(a.tiles != 0 || p.group <= kRows,
          "paged_attention: more than 16 heads per KV head needs a tile list");
  require(a.num_parts <= 65535, "paged_attention: grid too large");
  if (a.num_tiles == 0) return;
  p.k_scale = reinterpret_cast<const float*>(a.k_scale);
  p.v_scale = reinterpret_cast<const float*>(a.v_scale);
  p.partition_size = a.partition_size;
  p.num_parts = a.num_parts;
  p.part_o = reinterpret_cast<float*>(a.part_o);
  p.part_ml = reinterpret_cast<float*>(a.part_ml);
  p.counters = a.num_parts > 1 ? reinterpret_cast<int*>(a.counters) : nullptr;
  p.part_rows = static_cast<std::int64_t>(a.num_tiles) * a.num_kv_heads * a.num_parts * kRows;
  cudaStream_t s = as_stream(a.stream);
  if (a.dtype == DType::kF16) {
    dispatch_head_dim<__half>(p, int8, a.load_ahead, a.head_dim, a.num_tiles, s);
  } else {
    dispatch_head_dim<__nv_bfloat16>(p, int8, a.load_ahead, a.head_dim, a.num_tiles, s);
  }
}

}  // namespace cuda
}  // namespace turbomq
