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
// INT8 KV: the tiles land in a staging ring with their per-token scales and
// are widened, exactly (|x| <= 127), into one 16-bit tile before the MMAs;
// the K scale multiplies S, the V scale P (after the row sum), as in
// attention.cu. Head_dim 64 or 128. Split-K over long histories: with
// num_parts > 1, a tile's keys are cut into num_parts partitions of P keys
// (its own key count over num_parts in 64-key tiles, at least
// partition_size), and block z of the tile reads keys [z P, (z + 1) P) only
// and writes its normalized partial rows, max and sum; the last block of the
// tile to finish (or a second kernel) combines them in partition order, as
// attention.cu does (paged_batch.cuh). The caller takes it for prefill
// (Q of >= 64 rows); decode stays on attention.cu.
#include "mma.cuh"
#include "paged_batch.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace turbomq {
namespace cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockRows = kPrefillTileRows;
static_assert(kBlockRows == kWarps * 16, "a warp per 16 rows");
constexpr int kTileKeys = 64;

// The batch's fields (tiles: (sequence, 64-row tile) pairs) and split-K's.
struct Params : PagedBatch {
  const float* k_scale;  // INT8 KV: per-token scales [blocks, KV heads, block size]
  const float* v_scale;
  int partition_size, num_parts;  // least keys a partition (a multiple of 64), partitions
  Partials part;                  // num_parts > 1: [tiles][KV heads][parts][64 rows]
  int* counters;                  // [tiles * KV heads] or null: combine in a second kernel
};

// Shared-memory byte offset of chunk c of key row `row` in a [kTileKeys][D] tile.
template <int D>
__device__ __forceinline__ std::uint32_t chunk_offset(int row, int c) {
  return static_cast<std::uint32_t>(row * D * 2 + ((c ^ (row & 7)) << 4));
}

// The block's tile: its sequence, rows, and the keys its rows see.
struct Tile {
  int idx;                    // in the tile list
  int kvh, seq, row0, q_start, n, ctx, rows;
  int keys_first, keys_last;  // keys the first and the last row see
  int tiles;                  // 64-key K/V tiles up to keys_last
  int parts;                  // partitions holding keys (1 without split-K)
  int t_begin, t_end;         // this block's K/V tiles: its partition's
};

__device__ __forceinline__ Tile tile_of(const Params& p) {
  Tile b;
  // The list in reverse: a sequence's last tiles see the most keys, and the
  // longest blocks go first so that none of them runs alone at the end.
  b.idx = gridDim.x - 1 - blockIdx.x;
  b.kvh = blockIdx.y;
  b.seq = p.tiles[2 * b.idx];
  b.row0 = p.tiles[2 * b.idx + 1] * kBlockRows;
  b.q_start = p.cu_q_lens[b.seq];
  b.n = p.cu_q_lens[b.seq + 1] - b.q_start;
  b.ctx = p.context_lens[b.seq];
  b.rows = min(kBlockRows, b.n * p.group - b.row0);
  b.keys_first = b.ctx - b.n + b.row0 / p.group + 1;
  b.keys_last = b.ctx - b.n + (b.row0 + b.rows - 1) / p.group + 1;
  b.tiles = (b.keys_last + kTileKeys - 1) / kTileKeys;
  b.parts = 1;
  b.t_begin = 0;
  b.t_end = b.tiles;
  if (p.num_parts > 1) {
    // The tile's own keys spread over the launch's partitions, at least
    // partition_size keys each: a graph captured for its bucket's longest
    // context splits a shorter one as finely as an eager launch would.
    const int per_part =
        max(p.partition_size / kTileKeys, (b.tiles + p.num_parts - 1) / p.num_parts);
    b.parts = (b.tiles + per_part - 1) / per_part;
    b.t_begin = blockIdx.z * per_part;
    b.t_end = min(b.t_begin + per_part, b.tiles);
  }
  return b;
}

// Row index of the tile's partition q, row 0 in the partials.
__device__ __forceinline__ std::int64_t partial_row0(const Params& p, int tile_idx, int kvh) {
  return (static_cast<std::int64_t>(tile_idx) * p.num_kv_heads + kvh) * p.num_parts * kBlockRows;
}

// Row r of the tile: its key limit (0: an unused row, every key masked) and
// its q vector (null for an unused row).
template <typename T>
__device__ __forceinline__ const T* row_q(const Params& p, const Tile& b, int r, int& limit) {
  limit = 0;
  if (r >= b.rows) return nullptr;
  const int qi = (b.row0 + r) / p.group;
  const int head = b.kvh * p.group + (b.row0 + r) % p.group;
  limit = b.ctx - b.n + qi + 1;
  return static_cast<const T*>(p.q) + (b.q_start + qi) * p.q_stride_tok + head * p.q_stride_head;
}

// Index of key `tok`'s row of this KV head in the cache ([blocks, KV heads,
// block size] rows; its scales have the same layout), or false past the keys
// the tile reads.
__device__ __forceinline__ bool key_row(const Params& p, const Tile& b, const int* table, int tok,
                                        std::int64_t& row) {
  row = 0;
  if (tok >= b.keys_last) return false;
  const int block_mask = (1 << p.block_shift) - 1;
  const int block = __ldg(table + (tok >> p.block_shift));
  row = (static_cast<std::int64_t>(block) * p.num_kv_heads + b.kvh) * (block_mask + 1) +
        (tok & block_mask);
  return true;
}

// Shared-memory byte offset of 16-byte chunk `ch` (of D / 8) of row `r` of a
// 64-row 16-bit tile: rows of 2 D bytes (kPanels false: ldmatrix's layout) or
// panels of 64 dims, rows of 128 bytes (true: wgmma's); chunks XOR-swizzled
// by r % 8 either way.
template <int D, bool kPanels>
__device__ __forceinline__ std::uint32_t tile_offset(int r, int ch) {
  if constexpr (kPanels) {
    return static_cast<std::uint32_t>((ch >> 3) * kTileKeys * 128 + r * 128 +
                                      (((ch & 7) ^ (r & 7)) << 4));
  } else {
    return chunk_offset<D>(r, ch);
  }
}

// Where a block's K/V tiles come from, in shared memory at `base` (a shared
// address; `gbase` the same bytes as a generic pointer):
//   16-bit KV: a ring of two stages [K tile][V tile], cp.async straight in;
//   INT8 KV: one 16-bit [K][V] tile the MMAs read, then a ring of two stages
//     [K int8][V int8][K scales][V scales]; ready() widens a landed stage
//     into the 16-bit tile.
template <typename T, int D, bool kInt8_, bool kPanels>
struct KvTiles {
  static constexpr bool kInt8 = kInt8_;
  static constexpr int kTile16 = kTileKeys * D * 2;
  static constexpr int kTile8 = kTileKeys * D;
  static constexpr int kStage8 = 2 * kTile8 + 2 * kTileKeys * 4;
  static constexpr int kBytes = kInt8 ? 2 * kTile16 + 2 * kStage8 : 2 * 2 * kTile16;
  std::uint32_t base;
  unsigned char* gbase;

  __device__ __forceinline__ void load(const Params& p, const Tile& b, const int* table,
                                       int tile, int stage) const {
    if constexpr (!kInt8) {
      const std::uint32_t k_dst = base + stage * 2 * kTile16;
      for (int i = threadIdx.x; i < kTileKeys * (D / 8); i += kThreads) {
        const int row = i / (D / 8), ch = i % (D / 8);
        std::int64_t kr;
        const bool ok = key_row(p, b, table, tile * kTileKeys + row, kr);
        const std::int64_t off = kr * D + ch * 8;
        cp_async16(k_dst + tile_offset<D, kPanels>(row, ch), static_cast<const T*>(p.k_cache) + off, ok);
        cp_async16(k_dst + kTile16 + tile_offset<D, kPanels>(row, ch),
                   static_cast<const T*>(p.v_cache) + off, ok);
      }
    } else {
      const std::uint32_t dst = base + 2 * kTile16 + stage * kStage8;
      for (int i = threadIdx.x; i < kTileKeys * (D / 16); i += kThreads) {
        const int row = i / (D / 16), ch = i % (D / 16);
        std::int64_t kr;
        const bool ok = key_row(p, b, table, tile * kTileKeys + row, kr);
        const std::int64_t off = kr * D + ch * 16;
        cp_async16(dst + row * D + ch * 16, static_cast<const std::int8_t*>(p.k_cache) + off, ok);
        cp_async16(dst + kTile8 + row * D + ch * 16,
                   static_cast<const std::int8_t*>(p.v_cache) + off, ok);
      }
      if (threadIdx.x < kTileKeys) {
        std::int64_t kr;
        const bool ok = key_row(p, b, table, tile * kTileKeys + threadIdx.x, kr);
        cp_async4(dst + 2 * kTile8 + threadIdx.x * 4, p.k_scale + kr, ok);
        cp_async4(dst + 2 * kTile8 + (kTileKeys + threadIdx.x) * 4, p.v_scale + kr, ok);
      }
    }
    cp_async_commit();
  }

  // The 16-bit K tile of a landed stage (V follows at + kTile16). INT8: every
  // thread widens its share first; the caller then needs a barrier (and, for
  // wgmma, fence_proxy_async before it) before the tile is read.
  __device__ __forceinline__ std::uint32_t ready(int stage) const {
    if constexpr (!kInt8) {
      return base + stage * 2 * kTile16;
    } else {
      const unsigned char* src = gbase + 2 * kTile16 + stage * kStage8;
      for (int i = threadIdx.x; i < 2 * kTileKeys * (D / 16); i += kThreads) {
        const int kv = i / (kTileKeys * (D / 16)), j = i % (kTileKeys * (D / 16));
        const int row = j / (D / 16), ch = j % (D / 16);
        const uint4 raw = *reinterpret_cast<const uint4*>(src + kv * kTile8 + row * D + ch * 16);
        const signed char* x = reinterpret_cast<const signed char*>(&raw);
        T w[16];
#pragma unroll
        for (int e = 0; e < 16; ++e) w[e] = from_float<T>(static_cast<float>(x[e]));
        unsigned char* dst = gbase + kv * kTile16;
        *reinterpret_cast<uint4*>(dst + tile_offset<D, kPanels>(row, 2 * ch)) =
            *reinterpret_cast<const uint4*>(w);
        *reinterpret_cast<uint4*>(dst + tile_offset<D, kPanels>(row, 2 * ch + 1)) =
            *reinterpret_cast<const uint4*>(w + 8);
      }
      return base;
    }
  }

  // INT8: the K and V scales of a landed stage's 64 keys.
  __device__ __forceinline__ const float* k_scales(int stage) const {
    return reinterpret_cast<const float*>(gbase + 2 * kTile16 + stage * kStage8 + 2 * kTile8);
  }
  __device__ __forceinline__ const float* v_scales(int stage) const {
    return k_scales(stage) + kTileKeys;
  }
};

// 16-bit K/V tiles by TMA, for the wgmma kernel: two stages [K][V] of
// 128-byte-swizzled panels (the layout KvTiles<..., true> writes), each
// filled by one thread's copies of 64-key x 64-dim boxes through the K and
// V tensor maps (rows: the pool's [blocks, KV heads, block size] key rows)
// and completed on the stage's mbarrier. A 64-key tile lies inside one pool
// block (block size >= 64). Keys past the tile's end are whatever the block
// holds: their scores are masked, and wait() zeroes their V rows, so that
// P's zeros never meet a NaN.
template <typename T, int D>
struct TmaTiles {
  static constexpr bool kInt8 = false;
  static constexpr int kTile16 = kTileKeys * D * 2;
  static constexpr int kPanelBytes = kTileKeys * 128;
  static constexpr int kBytes = 2 * 2 * kTile16 + 2 * 8;  // the stages, two mbarriers
  std::uint32_t base;
  unsigned char* gbase;
  const CUtensorMap* k_map;
  const CUtensorMap* v_map;

  __device__ __forceinline__ std::uint32_t bar(int stage) const {
    return base + 2 * 2 * kTile16 + 8 * stage;
  }
  // Thread 0 sets up the mbarriers; the caller then syncs the block.
  __device__ __forceinline__ void init() const {
    if (threadIdx.x == 0) {
      mbarrier_init(bar(0));
      mbarrier_init(bar(1));
      fence_mbarrier_init();
    }
  }
  // Thread 0 starts tile `tile` into `stage`.
  __device__ __forceinline__ void load(const Params& p, const Tile& b, const int* table, int tile,
                                       int stage) const {
    if (threadIdx.x != 0) return;
    const int tok = tile * kTileKeys;
    const int block = __ldg(table + (tok >> p.block_shift));
    const int row = ((block * p.num_kv_heads + b.kvh) << p.block_shift) +
                    (tok & ((1 << p.block_shift) - 1));
    const std::uint32_t dst = base + stage * 2 * kTile16;
    mbarrier_expect_bytes(bar(stage), 2 * kTile16);
#pragma unroll
    for (int panel = 0; panel < D / 64; ++panel) {
      tma_load_2d(dst + panel * kPanelBytes, k_map, panel * 64, row, bar(stage));
      tma_load_2d(dst + kTile16 + panel * kPanelBytes, v_map, panel * 64, row, bar(stage));
    }
  }
  // Every thread: until tile t (its stage's use-th fill) has landed; then
  // the V rows at and past `valid` zeroed. Returns the K tile (V follows at
  // + kTile16); the caller fences and syncs before the MMAs read it.
  __device__ __forceinline__ std::uint32_t wait(int stage, int use, int valid) const {
    mbarrier_wait(bar(stage), use & 1);
    if (valid < kTileKeys) {
      unsigned char* v = gbase + stage * 2 * kTile16 + kTile16;
      const int row_chunks = (kTileKeys - valid) * 8;  // 16-byte chunks of a panel's rows
      for (int i = threadIdx.x; i < (D / 64) * row_chunks; i += kThreads) {
        const int panel = i / row_chunks, j = i % row_chunks;
        *reinterpret_cast<uint4*>(v + panel * kPanelBytes + valid * 128 + j * 16) =
            make_uint4(0, 0, 0, 0);
      }
    }
    return base + stage * 2 * kTile16;
  }
};

// INT8 KV: S's columns times their keys' K scales (before the softmax), and
// P's times their V scales (after its row sums: O = sum p (v scale) v).
// Element e of block b of this lane is key 8 b + 2 c + (e & 1).
__device__ __forceinline__ void scale_keys(float (&s)[kTileKeys / 8][4], const float* scales,
                                           int c) {
#pragma unroll
  for (int b = 0; b < kTileKeys / 8; ++b)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[b][e] *= scales[8 * b + 2 * c + (e & 1)];
}


// Online softmax (base 2) of one 64-key tile of S for this lane's rows g and
// g + 8: element e of block b is key 8 b + 2 c + (e & 1) of row g (e < 2) or
// g + 8. S becomes P (unnormalized), m and l advance, alpha rescales O.
__device__ __forceinline__ void softmax_tile(float (&s)[kTileKeys / 8][4], float (&m)[2],
                                             float (&l)[2], float (&alpha)[2],
                                             const int (&limit)[2], bool masked, int key0, int c,
                                             float scale_log2) {
// The max is taken over the raw scores and scaled once (the scale is
// positive); each exponent is one fma of the score with the scale.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float raw = -INFINITY;
#pragma unroll
    for (int b = 0; b < kTileKeys / 8; ++b)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (masked && key0 + 8 * b + 2 * c + e >= limit[h]) s[b][2 * h + e] = -INFINITY;
        raw = fmaxf(raw, s[b][2 * h + e]);
      }
    raw = fmaxf(raw, __shfl_xor_sync(0xffffffffu, raw, 1));
    raw = fmaxf(raw, __shfl_xor_sync(0xffffffffu, raw, 2));
    const float mx = fmaxf(m[h], raw * scale_log2);
    const float base = mx == -INFINITY ? 0.0f : mx;  // a row with no key yet
    alpha[h] = exp2f(m[h] - base);
    m[h] = mx;
    float sum = 0.0f;
#pragma unroll
    for (int b = 0; b < kTileKeys / 8; ++b)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pe = exp2f(fmaf(s[b][2 * h + e], scale_log2, -base));
        s[b][2 * h + e] = pe;
        sum += pe;
      }
    l[h] = l[h] * alpha[h] + sum;
  }
}

// One K/V tile's softmax for this lane's rows, given S of tile t: S
// becomes P (INT8: K scales before, V scales after), m and l advance, and O
// is rescaled to the new maxima. The mask is needed only on tiles that
// reach past the first row's keys, or with an unused row.
template <int D, typename Kv>
__device__ __forceinline__ void softmax_step(const Params& p, const Tile& b, const Kv& kv,
                                             int stage, int t, const int (&limit)[2], int c,
                                             float (&s)[kTileKeys / 8][4], float (&m)[2],
                                             float (&l)[2], float (&o)[D / 8][4]) {
  const int key0 = t * kTileKeys;
  const bool masked = key0 + kTileKeys > b.keys_first || limit[0] == 0 || limit[1] == 0;
  float alpha[2];
  if constexpr (Kv::kInt8) scale_keys(s, kv.k_scales(stage), c);
  softmax_tile(s, m, l, alpha, limit, masked, key0, c, p.scale_log2);
  if constexpr (Kv::kInt8) scale_keys(s, kv.v_scales(stage), c);
#pragma unroll
  for (int j = 0; j < D / 8; ++j) {
    o[j][0] *= alpha[0];
    o[j][1] *= alpha[0];
    o[j][2] *= alpha[1];
    o[j][3] *= alpha[1];
  }
}


// P's A fragment for the k16 step over keys 16 k2..: S's accumulator layout
// re-packed to 16 bits (mma.m16n8k16 and wgmma share this A layout).
template <typename T>
__device__ __forceinline__ void p_fragment(const float (&s)[kTileKeys / 8][4], int k2,
                                           std::uint32_t (&pa)[4]) {
  pa[0] = pack_pair<T>(s[2 * k2][0], s[2 * k2][1]);
  pa[1] = pack_pair<T>(s[2 * k2][2], s[2 * k2][3]);
  pa[2] = pack_pair<T>(s[2 * k2 + 1][0], s[2 * k2 + 1][1]);
  pa[3] = pack_pair<T>(s[2 * k2 + 1][2], s[2 * k2 + 1][3]);
}

// Waits for K/V tile t (of this block's [t_begin, t_end)) and starts tile
// t + 1 into the other stage; returns t's stage.
template <typename Load>
__device__ __forceinline__ int await_tile(const Tile& b, int t, const Load& load_tile) {
  const int stage = (t - b.t_begin) & 1;
  if (t + 1 < b.t_end) {
    load_tile(t + 1, stage ^ 1);
    cp_async_wait<1>();
  } else {
    cp_async_wait<0>();
  }
  return stage;
}

template <int D>
__device__ __forceinline__ void zero(float (&o)[D / 8][4]) {
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] = 0.0f;
}

// The block's rows done (element e of O block j is dim 8 j + 2 c + (e & 1)
// of row warp_row + g (e < 2) or + 8), normalized: stored, or with split-K
// written as partition blockIdx.z's partials with their max and sum, the
// last partition block of the tile to finish combining them.
template <typename T, int D>
__device__ __forceinline__ void finish_rows(const Params& p, const Tile& b,
                                            const float (&o)[D / 8][4], const float (&m)[2],
                                            const float (&l)[2], int warp_row, int g, int c) {
  const bool split = p.num_parts > 1;
  const std::int64_t prow0 = split ? partial_row0(p, b.idx, b.kvh) : 0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = l[h];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int r = warp_row + g + 8 * h;
    if (r >= b.rows) continue;
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    if (!split) {
      const int qi = (b.row0 + r) / p.group;
      const int head = b.kvh * p.group + (b.row0 + r) % p.group;
      T* dst = static_cast<T*>(p.out) +
               (static_cast<std::int64_t>(b.q_start + qi) * p.num_heads + head) * D + 2 * c;
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        *reinterpret_cast<std::uint32_t*>(dst + 8 * j) =
            pack_pair<T>(o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
      }
      continue;
    }
    const std::int64_t prow = prow0 + blockIdx.z * kBlockRows + r;
    float* dst = p.part.o + prow * D + 2 * c;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      __stcg(reinterpret_cast<float2*>(dst + 8 * j),
             make_float2(o[j][2 * h] * inv, o[j][2 * h + 1] * inv));
    }
    if (c == 0) {
      p.part.ml[prow] = m[h];
      p.part.ml[p.part.rows + prow] = sum;
    }
  }
  if (!split || p.counters == nullptr) return;
  int* counter = p.counters + static_cast<std::int64_t>(b.idx) * p.num_kv_heads + b.kvh;
  if (last_partition(counter, b.parts)) {
    combine_partials<T, D, kBlockRows, kThreads>(p, p.part, prow0, b.parts, b.row0, b.rows,
                                                 b.q_start, b.kvh);
  }
}

// This lane's rows of the block (g and g + 8 of warp w's 16): their key
// limits and Q's fragments in mma.m16n8k16's A layout, one per k16 step over
// the head dims (zeros for unused rows). wgmma takes the same A layout.
template <typename T, int D>
__device__ __forceinline__ void load_q(const Params& p, const Tile& b, int warp, int g, int c,
                                       int (&limit)[2], std::uint32_t (&qf)[D / 16][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const T* src = row_q<T>(p, b, warp * 16 + g + 8 * h, limit[h]);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      // a0/a2: row g, dims 2c and 2c + 8; a1/a3: row g + 8.
      qf[kk][h] = src ? *reinterpret_cast<const std::uint32_t*>(src + 16 * kk + 2 * c) : 0u;
      qf[kk][h + 2] = src ? *reinterpret_cast<const std::uint32_t*>(src + 16 * kk + 8 + 2 * c) : 0u;
    }
  }
}

template <typename T, int D, bool kInt8>
__global__ void __launch_bounds__(kThreads) prefill_attention_kernel(const Params p) {
  constexpr int kKSteps = D / 16;     // mma K steps over the head dim (S)
  constexpr int kKeyBlocks = kTileKeys / 8;  // n8 blocks of S per tile
  constexpr int kDimBlocks = D / 8;   // n8 blocks of O
  using Kv = KvTiles<T, D, kInt8, false>;
  extern __shared__ __align__(128) unsigned char smem[];  // the K/V tiles (KvTiles)

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
  const Tile b = tile_of(p);
  if (static_cast<int>(blockIdx.z) >= b.parts) return;  // a partition past the tile's keys
  const int* table = p.block_tables + static_cast<std::int64_t>(b.seq) * p.max_blocks;
  const Kv kv{static_cast<std::uint32_t>(__cvta_generic_to_shared(smem)), smem};
  auto load_tile = [&](int tile, int stage) { kv.load(p, b, table, tile, stage); };
  if (b.t_begin < b.t_end) load_tile(b.t_begin, 0);

  int limit[2];
  std::uint32_t qf[kKSteps][4];
  load_q<T, D>(p, b, warp, g, c, limit, qf);

  float o[kDimBlocks][4];
  zero<D>(o);
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f};
  const int mat = lane / 8, mrow = lane % 8;  // this lane's ldmatrix row address

  for (int t = b.t_begin; t < b.t_end; ++t) {
    const int stage = await_tile(b, t, load_tile);
    __syncthreads();
    const std::uint32_t k_tile = kv.ready(stage);
    const std::uint32_t v_tile = k_tile + Kv::kTile16;
    if constexpr (kInt8) __syncthreads();  // the widened tile, for every warp

    // S = Q K^T over this tile's 64 keys.
    float s[kKeyBlocks][4];
#pragma unroll
    for (int kb2 = 0; kb2 < kKeyBlocks; ++kb2)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[kb2][e] = 0.0f;
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

    softmax_step<D>(p, b, kv, stage, t, limit, c, s, m, l, o);

    // O += P V, 16 keys per mma K step.
#pragma unroll
    for (int k2 = 0; k2 < kTileKeys / 16; ++k2) {
      std::uint32_t pa[4];
      p_fragment<T>(s, k2, pa);
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
  finish_rows<T, D>(p, b, o, m, l, warp * 16, g, c);
}

// The same tile on Hopper's wgmma: the block's four warps are one
// warpgroup, and each product is one warpgroup MMA per k16 step.
//   Q stays in registers in the A layout above (wgmma's A from registers);
//   shared memory holds the K/V tiles in 128-byte-swizzled panels of 64 head
//   dims ([D / 64 panels][rows][128 bytes], chunk c of row r at c ^ (r % 8)):
//   K-major for S = Q K^T (m64n64, D / 16 steps), and the same V panels read
//   N-major (rows are keys) for O += P V (m64nD, P from registers, 4 steps
//   of 16 keys).
//   Each warp's accumulators come out in mma.m16n8k16's C layout for its 16
//   rows, so the softmax, P's fragments and the store are those above.
//   Tiles are double-buffered as above, loaded by cp.async (KvTiles) or,
//   with kTma, by TMA (TmaTiles). Each product waits for its MMAs before the
//   softmax or the next tile reads their results: the overlap comes from
//   the other blocks on the SM, three of them (65 KiB of shared memory
//   each, registers capped to fit).
template <typename T, int D, bool kInt8, bool kTma>
using WgmmaTiles = std::conditional_t<kTma, TmaTiles<T, D>, KvTiles<T, D, kInt8, true>>;

template <typename T, int D, bool kInt8, bool kTma>
constexpr int wgmma_smem_bytes() {
  return WgmmaTiles<T, D, kInt8, kTma>::kBytes + 1024;  // K/V, alignment
}

template <typename T, int D, bool kInt8, bool kTma>
__global__ void __launch_bounds__(kThreads, 3)
    prefill_attention_wgmma_kernel(const Params p, const __grid_constant__ CUtensorMap k_map,
                                   const __grid_constant__ CUtensorMap v_map) {
  static_assert(!(kTma && kInt8), "TMA loads 16-bit tiles");
  constexpr int kPanelBytes = kTileKeys * 128;  // a 64-row panel of a K/V tile
  using Kv = WgmmaTiles<T, D, kInt8, kTma>;
  static_assert(Kv::kTile16 % 1024 == 0, "the panels stay 1024-aligned");
  extern __shared__ __align__(128) unsigned char smem[];  // the K/V tiles

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
  const Tile b = tile_of(p);
  if (static_cast<int>(blockIdx.z) >= b.parts) return;  // a partition past the tile's keys
  const int* table = p.block_tables + static_cast<std::int64_t>(b.seq) * p.max_blocks;
  const std::uint32_t raw = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
  const std::uint32_t kv_base = (raw + 1023u) & ~1023u;
  Kv kv{kv_base, smem + (kv_base - raw)};
  if constexpr (kTma) {
    kv.k_map = &k_map;
    kv.v_map = &v_map;
    kv.init();
    __syncthreads();
  }
  auto load_tile = [&](int tile, int stage) { kv.load(p, b, table, tile, stage); };
  if (b.t_begin < b.t_end) load_tile(b.t_begin, 0);

  int limit[2];
  std::uint32_t qf[D / 16][4];
  load_q<T, D>(p, b, warp, g, c, limit, qf);

  float o[D / 8][4];
  zero<D>(o);
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.0f, 0.0f};

  for (int t = b.t_begin; t < b.t_end; ++t) {
    int stage;
    std::uint32_t k_tile;
    if constexpr (kTma) {
      stage = (t - b.t_begin) & 1;
      if (t + 1 < b.t_end) load_tile(t + 1, stage ^ 1);  // its stage's readers synced below
      // Each thread waits on the mbarrier itself; the block syncs only
      // where wait() zeroed V rows (a tile past the keys' end).
      const int valid = b.keys_last - t * kTileKeys;
      k_tile = kv.wait(stage, (t - b.t_begin) >> 1, valid);
      if (valid < kTileKeys) {
        fence_proxy_async();  // the zeroed V rows, to the MMAs' (async) proxy
        __syncthreads();
      }
    } else {
      stage = await_tile(b, t, load_tile);
      fence_proxy_async();  // the cp.async data, to the MMAs' (async) proxy
      __syncthreads();
      k_tile = kv.ready(stage);
      if constexpr (kInt8) {  // the widened tile (st.shared), for every warp and the MMAs
        fence_proxy_async();
        __syncthreads();
      }
    }
    const std::uint64_t k_desc = wgmma_desc(k_tile);
    const std::uint64_t v_desc = wgmma_desc_mn(k_tile + Kv::kTile16, kPanelBytes);

    // S = Q K^T: k16 step ks is 32 bytes into panel ks / 4 of K.
    float s[kTileKeys / 8][4];
#pragma unroll
    for (int kb = 0; kb < kTileKeys / 8; ++kb)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[kb][e] = 0.0f;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const std::uint64_t step = ((ks >> 2) * kPanelBytes + (ks & 3) * 32) >> 4;
      wgmma_m64k16_rs<T, kTileKeys, true>(&s[0][0], qf[ks], k_desc + step);
    }
    wgmma_commit();
    wgmma_wait<0>();

    softmax_step<D>(p, b, kv, stage, t, limit, c, s, m, l, o);

    // O += P V: the k16 step over keys 16 k2.. is two 8-key atoms further.
    std::uint32_t pa[kTileKeys / 16][4];
#pragma unroll
    for (int k2 = 0; k2 < kTileKeys / 16; ++k2) p_fragment<T>(s, k2, pa[k2]);
    wgmma_fence();
#pragma unroll
    for (int k2 = 0; k2 < kTileKeys / 16; ++k2) {
      wgmma_m64k16_rs<T, D>(&o[0][0], pa[k2], v_desc + ((k2 * 16 * 128) >> 4));
    }
    wgmma_commit();
    wgmma_wait<0>();
    __syncthreads();  // every warp is done with this stage before it is refilled
  }
  finish_rows<T, D>(p, b, o, m, l, warp * 16, g, c);
}

// One block per (tile, KV head): split-K's combine as a second launch.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) prefill_combine_kernel(const Params p) {
  const Tile b = tile_of(p);
  combine_partials<T, D, kBlockRows, kThreads>(p, p.part, partial_row0(p, b.idx, b.kvh),
                                               b.parts, b.row0, b.rows, b.q_start, b.kvh);
}

bool g_wgmma = false;  // set_prefill_attention_wgmma
bool g_tma = false;    // set_prefill_attention_tma

template <typename T, int D, bool kInt8, bool kTma>
void launch_wgmma(const Params& p, const dim3& grid, cudaStream_t s, const CUtensorMap& k_map,
                  const CUtensorMap& v_map) {
  constexpr int kSmem = wgmma_smem_bytes<T, D, kInt8, kTma>();
  static bool opted_in = false;
  opt_in_smem(prefill_attention_wgmma_kernel<T, D, kInt8, kTma>, kSmem, opted_in,
              "prefill_attention: shared memory opt-in");
  prefill_attention_wgmma_kernel<T, D, kInt8, kTma><<<grid, kThreads, kSmem, s>>>(p, k_map, v_map);
  check_launch("prefill_attention_wgmma_kernel");
}

template <typename T, int D, bool kInt8>
void launch_tiles(const Params& p, int num_tiles, std::int64_t cache_blocks, DType dtype,
                  cudaStream_t s) {
  const dim3 grid(num_tiles, p.num_kv_heads, p.num_parts);
  if (g_wgmma) {
    if constexpr (!kInt8) {
      if (g_tma && p.block_shift >= 6 && cache_blocks > 0) {
        const std::uint64_t rows =
            static_cast<std::uint64_t>(cache_blocks * p.num_kv_heads) << p.block_shift;
        launch_wgmma<T, D, false, true>(
            p, grid, s, tensor_map_2d(reinterpret_cast<std::uintptr_t>(p.k_cache), rows, D, dtype),
            tensor_map_2d(reinterpret_cast<std::uintptr_t>(p.v_cache), rows, D, dtype));
        return;
      }
    }
    const CUtensorMap none{};
    launch_wgmma<T, D, kInt8, false>(p, grid, s, none, none);
    return;
  }
  constexpr int kSmem = KvTiles<T, D, kInt8, false>::kBytes;
  static bool opted_in = false;
  opt_in_smem(prefill_attention_kernel<T, D, kInt8>, kSmem, opted_in,
              "prefill_attention: shared memory opt-in");
  prefill_attention_kernel<T, D, kInt8><<<grid, kThreads, kSmem, s>>>(p);
  check_launch("prefill_attention_kernel");
}

template <typename T, int D>
void launch(const Params& p, int num_tiles, bool int8, std::int64_t cache_blocks, DType dtype,
            cudaStream_t s) {
  int8 ? launch_tiles<T, D, true>(p, num_tiles, cache_blocks, dtype, s)
       : launch_tiles<T, D, false>(p, num_tiles, cache_blocks, dtype, s);
  if (p.num_parts > 1 && p.counters == nullptr) {
    prefill_combine_kernel<T, D><<<dim3(num_tiles, p.num_kv_heads), kThreads, 0, s>>>(p);
    check_launch("prefill_combine_kernel");
  }
}

// How many blocks of `kernel` with `smem` bytes of shared memory fit on an
// SM of the current device, as the occupancy calculator counts them.
template <typename K>
int resident_blocks(K kernel, int smem) {
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
             "prefill_attention: shared memory opt-in");
  int blocks = 0;
  check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, smem),
             "prefill_attention: occupancy");
  return blocks;
}

// The kernel launch_tiles would take (TMA where `tma`), and its blocks an SM.
template <typename T, int D, bool kInt8>
int blocks_per_sm(bool tma) {
  if (g_wgmma) {
    if constexpr (!kInt8) {
      if (tma) {
        return resident_blocks(prefill_attention_wgmma_kernel<T, D, false, true>,
                               wgmma_smem_bytes<T, D, false, true>());
      }
    }
    return resident_blocks(prefill_attention_wgmma_kernel<T, D, kInt8, false>,
                           wgmma_smem_bytes<T, D, kInt8, false>());
  }
  return resident_blocks(prefill_attention_kernel<T, D, kInt8>,
                         KvTiles<T, D, kInt8, false>::kBytes);
}

template <typename T, int D>
int blocks_per_sm(bool int8, bool tma) {
  return int8 ? blocks_per_sm<T, D, true>(false) : blocks_per_sm<T, D, false>(tma);
}

}  // namespace

int prefill_attention_blocks_per_sm(int head_dim, DType dtype, DType cache_dtype,
                                    int block_size) {
  require(head_dim == 64 || head_dim == 128, "prefill_attention: head_dim must be 64 or 128");
  require(dtype == DType::kF16 || dtype == DType::kBF16,
          "prefill_attention: q must be float16 or bfloat16");
  const bool int8 = cache_dtype == DType::kI8;
  require(cache_dtype == dtype || int8,
          "prefill_attention: the cache must be INT8 or q's 16-bit dtype");
  const bool tma = g_tma && !int8 && block_size >= kTileKeys;  // as launch_tiles takes it
  const bool f16 = dtype == DType::kF16;
  if (head_dim == 128) {
    return f16 ? blocks_per_sm<__half, 128>(int8, tma)
               : blocks_per_sm<__nv_bfloat16, 128>(int8, tma);
  }
  return f16 ? blocks_per_sm<__half, 64>(int8, tma) : blocks_per_sm<__nv_bfloat16, 64>(int8, tma);
}

void set_prefill_attention_wgmma(bool on) { g_wgmma = on; }
bool prefill_attention_wgmma() { return g_wgmma; }
void set_prefill_attention_tma(bool on) { g_tma = on; }
bool prefill_attention_tma() { return g_tma; }

void prefill_attention(const AttentionArgs& a) {
  const bool int8 = a.cache_dtype == DType::kI8;
  require(a.cache_dtype == a.dtype || int8,
          "prefill_attention: the cache must be INT8 or q's 16-bit dtype");
  require(!int8 || (a.k_scale != 0 && a.v_scale != 0),
          "prefill_attention: an INT8 cache needs its scales");
  require(a.tiles != 0, "prefill_attention: takes a tile list");
  require(a.num_parts >= 1 && a.num_parts <= 65535, "prefill_attention: bad num_parts");
  require(a.num_parts == 1 || (a.partition_size > 0 && a.partition_size % kTileKeys == 0 &&
                               a.part_o != 0 && a.part_ml != 0),
          "prefill_attention: split-K needs partitions of a multiple of 64 keys and buffers");
  Params p{};
  static_cast<PagedBatch&>(p) = paged_batch(a, "prefill_attention");
  p.num_parts = a.num_parts;
  p.partition_size = a.num_parts > 1 ? a.partition_size : 0;
  p.part = Partials{reinterpret_cast<float*>(a.part_o), reinterpret_cast<float*>(a.part_ml),
                    static_cast<std::int64_t>(a.num_tiles) * a.num_kv_heads * a.num_parts *
                        kBlockRows};
  p.counters = a.num_parts > 1 ? reinterpret_cast<int*>(a.counters) : nullptr;
  p.k_scale = reinterpret_cast<const float*>(a.k_scale);
  p.v_scale = reinterpret_cast<const float*>(a.v_scale);
  if (a.num_tiles == 0) return;
  cudaStream_t s = as_stream(a.stream);
  const int n = a.num_tiles;
  const bool f16 = a.dtype == DType::kF16;
  const std::int64_t blocks = a.cache_blocks;
  if (a.head_dim == 128) {
    f16 ? launch<__half, 128>(p, n, int8, blocks, a.dtype, s)
        : launch<__nv_bfloat16, 128>(p, n, int8, blocks, a.dtype, s);
  } else {
    f16 ? launch<__half, 64>(p, n, int8, blocks, a.dtype, s)
        : launch<__nv_bfloat16, 64>(p, n, int8, blocks, a.dtype, s);
  }
}

}  // namespace cuda
}  // namespace turbomq
