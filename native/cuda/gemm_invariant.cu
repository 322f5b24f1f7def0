// Batch-invariant GEMM: y[M, N] = x[M, K] @ w[N, K]^T (fp16/bf16, fp32
// accumulation) whose row m is bit-identical whatever M is and whatever the
// other rows hold: the same token gives the same logits in a decode batch of
// 1 or 64, or inside an 8192-row prefill (deterministic mode).
//
// The reduction over K has one fixed shape, independent of M, N and of the
// launch configuration:
//   K is cut into chunks of kGemmInvariantChunk (KC) elements. Chunk s of
//   output (m, n) is accumulated from zero by the mma.m16n8k16 sequence over
//   its k16 steps in increasing k (zero-filled past K). The chunk sums are
//   then folded in chunk order, total = c_0; total += c_1; ... with plain
//   fp32 adds (__fadd_rn: never contracted into an FMA), and the total is
//   rounded once to the output dtype.
// A tensor-core mma computes each output element from its own row of A, its
// own column of B and its own accumulator, so a row's value does not depend
// on where it sits in the tile nor on its neighbours.
//
// Two launch shapes compute exactly that:
//   tiled: a block owns an MT x 128 output tile and walks all of K through a
//     4-stage cp.async pipeline (64-wide k tiles, ldmatrix from XOR-swizzled
//     shared memory), keeping two accumulator sets: the chunk's, and the
//     running total it is folded into at each chunk's end. Large M.
//   split: a block owns one (tile, chunk) and writes the chunk sum (fp32) to
//     a workspace [chunks, M, N]; the last block of a tile to finish (an
//     atomic counter, reset by that block) or a second kernel folds the
//     partials in chunk order. Small M: the weights are read once by
//     chunks x N/128 blocks, enough to fill the GPU even at M = 1.
// Both run the same main loop (Mainloop below), so chunk sums agree bit for
// bit, and the folds add the same operands in the same order. A third, gemv
// (a few rows: decode at batch 1), streams whole weight rows through
// shared-memory stages as the default GEMV does and runs the same mma
// sequence and fold in its own loop (below, "gemv shape"). The host picks
// the shape (any M works with tiled and split); the tests check they agree.
//
// The MMA itself is mma.sync m16n8k16 by default, or on Hopper wgmma m64nNk16
// (set_gemm_invariant_wgmma): the same k16 steps in the same order, each a
// warpgroup's 64 rows at once, read straight from the swizzled stages (no
// ldmatrix), with one k tile's MMAs in flight while the next are issued.
// Each shape takes its kind (set_gemm_invariant_wgmma(tiled, split)). Mixing
// them keeps the shapes' chunk sums equal only where the two kinds give the
// same bits, as they do on the H100 (tests/gpu/test_batch_invariant_gemm.py
// holds any GPU it runs on to it).
//
// Optional fused residual add: with a residual [M, N], the store of every
// shape (the tiled epilogue, the fold of either kind) writes
// y = T(float(residual) + float(T(total))) instead of T(total): the output
// rounded to T first, exactly as the plain store rounds it, then the add that
// a separate elementwise kernel would run (one __fadd_rn, one rounding), so
// the result is bit for bit that of the GEMM followed by residual += y. The
// thread that reads a residual element writes the same element, so y may be
// the residual itself (in place).
//
// Optional fused silu_mul: w stacks the gate rows [0, I) over the up rows
// [I, 2I) and y is [M, I] = silu_mul(gate, up) with silu_mul_kernel's
// roundings: gate and up rounded to T (as the plain store rounds them), then
// silu_mul_of. A block then owns 64 output columns: its 128 weight rows are
// 8 gate rows, the 8 up rows of the same columns, 8 gate rows, ... (tile row
// t is column c0 + 8 (t / 16) + t % 8, up when (t / 8) is odd), so each
// thread holds a gate total in n8 tile j and its up total in tile j + 1.
// Every element is still the mma sequence over its own x row and w row, the
// chunks folded in order: only where a w row sits in the tile changes, and
// an mma's output element does not depend on its position.
//
// Optional folded RMSNorm (norm_eps > 0): w's columns already carry the norm
// weight (w[n, k] * g[k], folded at load), and every shape multiplies a row's
// total by r = rsqrt(mean(x^2) + eps) before the store (one __fmul_rn). r's
// sum of squares has one fixed order (row_sq_sum below): the gemv shape
// computes it from the x rows it holds anyway, the other shapes read it from
// gemm_row_scale_kernel, launched in front of them with the same code. So
// the norm costs no launch at decode and the bits stay the shapes' common ones.
#include "mma.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace turbomq {
namespace cuda {
namespace {

constexpr int kChunk = kGemmInvariantChunk;
constexpr int kBK = 64;      // k per pipeline stage: a 128-byte shared-memory row
constexpr int kNT = kGemmInvariantTile;  // output columns per block (the tiled wgmma shape: or 64)
constexpr int kThreads = 256;
constexpr int kGroupM = 8;   // tiled: row tiles per raster group (L2 reuse of w)
constexpr int kRowBytes = kBK * 2;
static_assert(kChunk % kBK == 0, "a chunk is whole k tiles: chunk boundaries are tile boundaries");

// Warp layout of a block: an MT x NT tile over 8 warps (NT = 128, or 64 for
// the tiled shape on wgmma at 64 rows).
// mma.sync (kWg false): MT = 128 (large M): 2 x 4 warps of 64 x 32; MT <= 64:
//   1 x 8 warps of MT x 16 (the few rows are shared, the weight columns split).
// wgmma (kWg true; MT 64 or 128): each of the two warpgroups runs one m64nN
//   MMA per k16 step: MT = 128: warpgroup g the rows 64 g.., all NT columns;
//   MT = 64: all 64 rows, the columns NT / 2 g... Warp w of a warpgroup holds
//   16 rows of it (wgmma.cuh), so a warp is again a 16 x N block of n8 tiles.
template <int MT, bool kWg = false, int NT = kNT>
struct Shape {
  static_assert(NT == 128 || (kWg && MT == 64 && NT == 64), "128-wide tiles, or 64 x 64 on wgmma");
  static constexpr int kWarpsM = kWg ? (MT == 128 ? 8 : 4) : (MT == 128 ? 2 : 1);
  static constexpr int kWarpsN = 8 / kWarpsM;
  static constexpr int kWarpM = MT / kWarpsM;
  static constexpr int kWarpN = NT / kWarpsN;
  static constexpr int kMi = kWarpM / 16;  // m16 tiles per warp
  static constexpr int kNj = kWarpN / 8;   // n8 tiles per warp
  // k tiles per stage ring, and how far ahead of the MMAs they are loaded:
  // with wgmma one k tile's MMAs stay in flight while the next are issued,
  // so the stage they read is reloaded one step later. (wgmma at 64 rows:
  // 4 stages of 128 columns or 6 of 64, 97 KiB, two blocks per SM.)
  static constexpr int kStages = kWg && MT == 128 ? 5 : NT == 64 ? 6 : 4;
  static constexpr int kAhead = kWg ? kStages - 2 : kStages - 1;
  static constexpr int kStageBytes = (MT + NT) * kRowBytes;
  // wgmma: + 1 KiB to start the ring on a 1024-byte boundary (the swizzle atom)
  static constexpr int kSmemBytes = kStages * kStageBytes + (kWg ? 1024 : 0);
  static_assert(kWarpsM * kWarpsN * 32 == kThreads, "8 warps");
  static_assert(kMi >= 1 && kNj % 2 == 0, "ldmatrix.x4 loads two n8 tiles at once");
  static_assert(!kWg || ((MT == 64 || MT == 128) && kMi == 1), "wgmma: 64 or 128 rows");
  static_assert(kStageBytes % 1024 == 0, "stages keep the 1024-byte alignment");
  // A warp's block of the tile: its row and column indices (in warps).
  __device__ static int warp_m(int warp) { return kWg ? warp % kWarpsM : warp / kWarpsN; }
  __device__ static int warp_n(int warp) { return kWg ? warp / kWarpsM : warp % kWarpsN; }
};

// Byte offset of 16-byte column chunk `c` (0..7) of `row` in a stage: rows of
// 128 bytes, chunks XOR-swizzled by row % 8 so the 8 rows an ldmatrix phase
// reads hit 8 different bank groups.
__device__ __forceinline__ std::uint32_t swizzle(int row, int c) {
  return static_cast<std::uint32_t>(row * kRowBytes + ((c ^ (row & 7)) << 4));
}

struct Params {
  void* y;                 // [M, N]
  const void* residual;    // [M, N] added into the output, or null
  const void* x;           // [M, K]
  const void* w;           // [N_w, K]: N_w = N, or 2N with silu (gate rows, then up rows)
  float* partial;          // split: [chunks, M, N_w]
  int* counters;           // split: [m_tiles * n_tiles] or null (second kernel folds)
  int m, n, k;
  int n_w;                 // weight rows
  int inter;               // silu: N (the up rows' offset), else 0
  int m_tiles, n_tiles, k_tiles, chunks;
  float norm_eps;          // > 0: the folded norm (row scales below, or the gemv shape's own)
  const float* row_scale;  // [M] r of each row (gemm_row_scale_kernel), or null
};

// The folded norm's sum of squares of one row (k a multiple of 8), in the
// one order every shape uses: thread t of 128 adds the squares of 16-byte
// vectors t, t + 128, ... (fmaf, the vector's 8 values in order), then an
// xor-shuffle reduction in the warp. rms_scale adds the four warps' sums in
// warp order and gives rsqrt(sum / k + eps).
template <typename T>
__device__ __forceinline__ float row_sq_sum(const T* row, int k, int tid) {
  float s = 0.0f;
  for (int v = tid; v < k / 8; v += 128) {
    const uint4 u = *reinterpret_cast<const uint4*>(row + 8 * v);
    const T* e = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float f = to_float(e[i]);
      s = fmaf(f, f, s);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, o));
  return s;
}
__device__ __forceinline__ float rms_scale(const float* warp_sums, int k, float eps) {
  const float s = __fadd_rn(__fadd_rn(__fadd_rn(warp_sums[0], warp_sums[1]), warp_sums[2]),
                            warp_sums[3]);
  return rsqrtf(__fadd_rn(__fdiv_rn(s, static_cast<float>(k)), eps));
}

// r of every row for the tiled and split shapes: a block of 128 threads a row.
template <typename T>
__global__ void __launch_bounds__(128) gemm_row_scale_kernel(const T* x, int k, float eps,
                                                             float* row_scale) {
  __shared__ float sums[4];
  launch_dependents();
  grid_dependency_wait();
  const float s = row_sq_sum(x + static_cast<std::int64_t>(blockIdx.x) * k, k, threadIdx.x);
  if (threadIdx.x % 32 == 0) sums[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x == 0) row_scale[blockIdx.x] = rms_scale(sums, k, eps);
}

// A row's scale in the stores: 1 (exact, so no change) without the norm.
__device__ __forceinline__ float row_scale_of(const Params& p, int m) {
  return p.row_scale != nullptr ? p.row_scale[m] : 1.0f;
}

// The tiled shape on wgmma with TMA loads: the kernel's parameters and the
// tensor maps over x ([M, K], boxes of 64 x MT) and w ([N_w, K], boxes of
// 64 x 128, or with silu 64 x 8: the interleaved gate / up row groups).
struct TmaParams {
  Params p;
  CUtensorMap x, w;
};
constexpr int kTmaBarrierBytes = 64;  // a stage's mbarrier each, past the ring

// One thread's share of loading a tile of kRowsTile rows of a [rows, K]
// matrix into a stage: 16-byte chunk c = tid % 8 of tile rows tid / 8 + 32 i,
// which are matrix rows `row` + i * row_step (row_step 32, or 16 for the silu
// layout), the first `count` of them present (the rest zero-filled). The
// tile row's swizzle (row % 8) is the same for every i, so the shared
// offsets are one base plus 4 KiB steps; the global pointer is set up once.
template <int kRowsTile>
struct RowLoader {
  static constexpr int kPerThread = (kRowsTile * 8 + kThreads - 1) / kThreads;
  static constexpr int kRowStep = kThreads / 8;  // 32 tile rows between a thread's chunks
  const std::uint16_t* g;    // the matrix: a valid address for zero-filled chunks
  const std::uint16_t* src;  // the thread's first row, column 8 (tid % 8)
  std::int64_t step;         // elements between a thread's rows
  std::uint32_t dst;         // offset in a stage of its first chunk
  int count;                 // how many of its rows exist
  int col;                   // its column within a k tile
  bool l2_256;               // ask L2 for 256 bytes a row (the split shape's weights)

  // rows_left: how far the thread's first row is from the limit, in units
  // of which a row takes row_step.
  __device__ __forceinline__ RowLoader(const std::uint16_t* matrix, int row, int rows_left,
                                       int row_step, int k, bool l2_256 = false)
      : g(matrix), l2_256(l2_256) {
    const int r = threadIdx.x / 8, c = threadIdx.x % 8;
    src = g + static_cast<std::int64_t>(row) * k + c * 8;
    step = static_cast<std::int64_t>(row_step) * k;
    dst = swizzle(r, c);
    count = rows_left <= 0 ? 0 : (rows_left + row_step - 1) / row_step;
    col = c * 8;
  }
  __device__ __forceinline__ void load(std::uint32_t stage, int kt, int k) const {
    const int kk = kt * kBK;
    const bool k_ok = kk + col < k;  // K % 8 == 0: a chunk is all in or all out
    const std::uint16_t* p = src + kk;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      if (kRowsTile * 8 % kThreads != 0 && threadIdx.x / 8 + i * kRowStep >= kRowsTile) break;
      const bool ok = k_ok && i < count;
      const std::uint32_t to = stage + dst + i * kRowStep * kRowBytes;
      if (l2_256) {
        cp_async16_l2_256(to, ok ? p : g, ok);
      } else {
        cp_async16(to, ok ? p : g, ok);
      }
      p += step;
    }
  }
};

// Output columns per block: NT, or NT / 2 with silu (NT weight rows either way).
template <int NT = kNT>
__device__ __forceinline__ int tile_cols(const Params& p) { return p.inter ? NT / 2 : NT; }

// The weight rows of the block whose output columns start at n0: rows
// n0 + t, or with silu the interleaved gate / up rows (see the top).
// l2_256: the split shape's loads ask L2 for 256 bytes a row (each block
// streams its rows' chunk once; on the H100 the deterministic decode step
// went 5.979 -> 5.853 ms with it, while the tiled shape, whose rows other
// blocks read again, ran 1-3% slower).
template <int NT>
__device__ __forceinline__ RowLoader<NT> weight_loader(const Params& p, int n0, bool l2_256) {
  const int r = threadIdx.x / 8;
  const auto* w = static_cast<const std::uint16_t*>(p.w);
  constexpr int kStep = RowLoader<NT>::kRowStep;
  if (p.inter == 0) return RowLoader<NT>(w, n0 + r, p.n - n0 - r, kStep, p.k, l2_256);
  // Tile rows r + 32 i: columns col + 16 i, all gate or all up rows.
  const int col = n0 + (r / 16) * 8 + r % 8;
  return RowLoader<NT>(w, col + ((r / 8) & 1) * p.inter, p.n - col, kStep / 2, p.k, l2_256);
}

// The main loop of one output tile over chunks [s_begin, s_end): a cp.async
// pipeline of 64-wide k tiles that runs on across chunk boundaries, and
// chunk(s, acc), which zeroes acc and runs the chunk's k16 steps through the
// mma in increasing k (the last chunk may be shorter; loads past K are
// zeros). Both launch shapes compute their chunk sums with exactly this,
// which is what makes them identical. `split`: the split shape's block, whose
// weight copies ask L2 for 256 bytes a row (weight_loader).
// kTma (wgmma only): thread 0 fills each stage by TMA instead, completing on
// the stage's mbarrier, which every thread waits on; the boxes land in the
// layout the cp.async chunks write (128-byte rows, 128-byte swizzle, rows
// past M or N_w and columns past K zero), so the MMAs read the same bits.
template <typename T, int MT, bool kWg, bool kTma = false, int NT = kNT>
struct Mainloop {
  static_assert(!kTma || kWg, "TMA loads feed wgmma");
  using S = Shape<MT, kWg, NT>;
  using Acc = float[S::kMi][S::kNj][4];
  static constexpr int kTilesPerChunk = kChunk / kBK;

  RowLoader<MT> load_x;
  RowLoader<NT> load_w;
  std::uint32_t base;  // shared address of stage 0
  std::uint32_t a_off, b_off;
  std::uint64_t a_desc, b_desc;  // wgmma: the warpgroup's operands in stage 0
  int key, a_half, b_half;
  int kt_begin, kt_end, k;
  // kTma: the maps, this tile's first row and column, the up rows' offset
  const CUtensorMap* x_map;
  const CUtensorMap* w_map;
  int m0, n0, inter;

  __device__ __forceinline__ Mainloop(const Params& p, std::uint32_t smem, int m0, int n0,
                                      int s_begin, int s_end, bool split = false,
                                      const CUtensorMap* x_map = nullptr,
                                      const CUtensorMap* w_map = nullptr)
      : load_x(static_cast<const std::uint16_t*>(p.x), m0 + threadIdx.x / 8,
               p.m - m0 - static_cast<int>(threadIdx.x / 8), RowLoader<MT>::kRowStep, p.k),
        load_w(weight_loader<NT>(p, n0, split)),
        base(kWg ? (smem + 1023u) & ~1023u : smem),
        kt_begin(s_begin * kTilesPerChunk),
        kt_end(min(s_end * kTilesPerChunk, p.k_tiles)),
        k(p.k),
        x_map(x_map),
        w_map(w_map),
        m0(m0),
        n0(n0),
        inter(p.inter) {
    // Per-lane ldmatrix rows and chunk halves (the fragment layouts of
    // mma.m16n8k16): A: lanes 0-15 rows 0-15 at k 0-7, lanes 16-31 at k 8-15;
    // B: lanes 0-7 / 8-15 give n 0-7 at k 0-7 / 8-15, lanes 16-31 the same
    // for n 8-15. Every row a lane reads is lane % 8 modulo 8 (tiles are
    // multiples of 16 rows), so its swizzle key is lane % 8 throughout: row
    // offsets become immediates, only the chunk term follows the k16 step.
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int warp_m = S::warp_m(warp), warp_n = S::warp_n(warp);
    key = lane & 7;
    a_off = (warp_m * S::kWarpM + (lane & 15)) * kRowBytes;
    b_off = (MT + warp_n * S::kWarpN + (lane & 7) + ((lane >> 4) << 3)) * kRowBytes;
    a_half = lane >> 4;
    b_half = (lane >> 3) & 1;
    // wgmma: the warpgroup's first warp's rows of x, and its weight rows.
    const int wg_warp = warp & ~3;
    a_desc = wgmma_desc(base + S::warp_m(wg_warp) * S::kWarpM * kRowBytes);
    b_desc = wgmma_desc(base + (MT + S::warp_n(wg_warp) * S::kWarpN) * kRowBytes);
    if constexpr (kTma) {
      // The first kAhead k tiles, weights first (they do not depend on the
      // previous kernel), x once it is done; each stage's mbarrier counts
      // both.
      if (threadIdx.x == 0) {
        for (int s = 0; s < S::kStages; ++s) mbarrier_init(bar(s));
        fence_mbarrier_init();
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        for (int i = 0; i < S::kAhead; ++i) {
          if (kt_begin + i >= kt_end) break;
          mbarrier_expect_bytes(bar(i), S::kStageBytes);
          tma_w(kt_begin + i);
        }
      }
      grid_dependency_wait();
      if (threadIdx.x == 0) {
        for (int i = 0; i < S::kAhead; ++i) {
          if (kt_begin + i < kt_end) tma_x(kt_begin + i);
        }
      }
    } else {
      // The first kAhead k tiles in flight: one commit group each (empty
      // past the end, so the wait counts stay uniform). Their weights first:
      // they do not depend on the previous kernel, which may still be
      // running (a programmatic launch); x only after it is done. The first
      // group then holds every prologue weight tile and x's first: waiting
      // for it waits for a little more than needed, never less.
#pragma unroll
      for (int i = 0; i < S::kAhead; ++i) {
        if (kt_begin + i < kt_end) {
          load_w.load(stage(kt_begin + i) + MT * kRowBytes, kt_begin + i, k);
        }
      }
      grid_dependency_wait();
#pragma unroll
      for (int i = 0; i < S::kAhead; ++i) {
        if (kt_begin + i < kt_end) load_x.load(stage(kt_begin + i), kt_begin + i, k);
        cp_async_commit();
      }
    }
  }

  __device__ __forceinline__ std::uint32_t stage(int kt) const {
    return base + static_cast<unsigned>(kt - kt_begin) % S::kStages * S::kStageBytes;
  }
  // kTma: stage s's mbarrier, past the ring.
  __device__ __forceinline__ std::uint32_t bar(int s) const {
    return base + S::kStages * S::kStageBytes + 8 * s;
  }
  // kTma, thread 0: k tile kt's x rows m0.. (one box), and its weight rows:
  // n0.. (one box), or with silu the 16 groups of 8 rows of the tile layout
  // (group g: columns n0 + 8 (g / 2).., gate rows for even g, up rows for odd).
  __device__ __forceinline__ void tma_x(int kt) const {
    const int i = (kt - kt_begin) % S::kStages;
    tma_load_2d(stage(kt), x_map, kt * kBK, m0, bar(i));
  }
  __device__ __forceinline__ void tma_w(int kt) const {
    const int i = (kt - kt_begin) % S::kStages;
    const std::uint32_t dst = stage(kt) + MT * kRowBytes;
    if (inter == 0) {
      tma_load_2d(dst, w_map, kt * kBK, n0, bar(i));
      return;
    }
    for (int g = 0; g < NT / 8; ++g) {
      tma_load_2d(dst + g * 8 * kRowBytes, w_map, kt * kBK, n0 + 8 * (g / 2) + (g & 1) * inter,
                  bar(i));
    }
  }
  __device__ __forceinline__ void load(int kt) const {
    load_x.load(stage(kt), kt, k);
    load_w.load(stage(kt) + MT * kRowBytes, kt, k);
  }

  __device__ __forceinline__ void chunk(int s, Acc& acc) const {
#pragma unroll
    for (int i = 0; i < S::kMi; ++i)
#pragma unroll
      for (int j = 0; j < S::kNj; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
    const int end = min((s + 1) * kTilesPerChunk, kt_end);
    if constexpr (kWg) {
      wgmma_chunk(s, end, acc);
    } else {
      mma_chunk(s, end, acc);
    }
  }

  // mma.sync: per k tile, per k16 step, the warp's fragments by ldmatrix and
  // its m16n8k16 MMAs.
  __device__ __forceinline__ void mma_chunk(int s, int end, Acc& acc) const {
    for (int kt = s * kTilesPerChunk; kt < end; ++kt) {
      cp_async_wait<S::kAhead - 1>();  // k tile kt has landed (for this thread)...
      __syncthreads();                 // ...for every thread; and stage kt - 1 is free
      if (kt + S::kAhead < kt_end) load(kt + S::kAhead);
      cp_async_commit();
      const std::uint32_t st = stage(kt);
#pragma unroll
      for (int ks = 0; ks < kBK / 16; ++ks) {
        std::uint32_t a[S::kMi][4], b[S::kNj][2];
#pragma unroll
        for (int i = 0; i < S::kMi; ++i) {
          ldmatrix_x4(a[i], st + a_off + i * 16 * kRowBytes + (((2 * ks + a_half) ^ key) << 4));
        }
#pragma unroll
        for (int j = 0; j < S::kNj; j += 2) {
          std::uint32_t r[4];
          ldmatrix_x4(r, st + b_off + j * 8 * kRowBytes + (((2 * ks + b_half) ^ key) << 4));
          b[j][0] = r[0];
          b[j][1] = r[1];
          b[j + 1][0] = r[2];
          b[j + 1][1] = r[3];
        }
#pragma unroll
        for (int i = 0; i < S::kMi; ++i)
#pragma unroll
          for (int j = 0; j < S::kNj; ++j) mma_m16n8k16<T>(acc[i][j], a[i], b[j][0], b[j][1]);
      }
    }
  }

  // The same k16 steps through wgmma: per k tile, the four m64nN MMAs of the
  // warpgroup, in increasing k, into the accumulator zeroed above. One k
  // tile's MMAs run on while the next tile's are issued (wait_group 1), so
  // the stage reloaded at step kt is the one read at kt - 2 (kAhead =
  // kStages - 2), which every warpgroup has finished by the barrier.
  __device__ __forceinline__ void wgmma_chunk(int s, int end, Acc& acc) const {
    float* d = &acc[0][0][0];
    for (int kt = s * kTilesPerChunk; kt < end; ++kt) {
      if constexpr (kTma) {
        const int fill = kt - kt_begin;
        mbarrier_wait(bar(fill % S::kStages), (fill / S::kStages) & 1);
        __syncthreads();  // and every warpgroup is done with the stage refilled next
        if (threadIdx.x == 0 && kt + S::kAhead < kt_end) {
          const int next = kt + S::kAhead;
          mbarrier_expect_bytes(bar((next - kt_begin) % S::kStages), S::kStageBytes);
          tma_w(next);
          tma_x(next);
        }
      } else {
        cp_async_wait<S::kAhead - 1>();
        fence_proxy_async();  // the cp.async data, to the MMAs' (async) proxy
        __syncthreads();
        if (kt + S::kAhead < kt_end) load(kt + S::kAhead);
        cp_async_commit();
      }
      const std::uint64_t st = (stage(kt) - base) >> 4;  // in descriptor units
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kBK / 16; ++ks) {
        wgmma_m64k16<T, S::kWarpN>(d, a_desc + st + 2 * ks, b_desc + st + 2 * ks);
      }
      wgmma_commit();
      wgmma_wait<1>();
    }
    wgmma_wait<0>();  // the chunk sum is in acc
  }

  // Nothing left in flight when the block moves on or exits (TMA: every
  // stage filled has been waited for).
  __device__ __forceinline__ void drain() const {
    if constexpr (!kTma) cp_async_wait<0>();
  }
};

__device__ __forceinline__ std::uint32_t dynamic_smem() {
  extern __shared__ __align__(128) unsigned char smem[];
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
}

// Accumulator element e of m16 tile i, n8 tile j of this lane: row and column
// in the block's tile (the mma's C layout: rows g and g + 8, columns 2c, 2c + 1).
template <int MT, bool kWg, int NT = kNT>
__device__ __forceinline__ int acc_row(int i, int e) {
  using S = Shape<MT, kWg, NT>;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  return S::warp_m(warp) * S::kWarpM + i * 16 + lane / 4 + (e >= 2 ? 8 : 0);
}
template <int MT, bool kWg, int NT = kNT>
__device__ __forceinline__ int acc_col(int j) {
  using S = Shape<MT, kWg, NT>;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  return S::warp_n(warp) * S::kWarpN + j * 8 + (lane % 4) * 2;
}

__device__ __forceinline__ std::uint32_t pack2(__half lo, __half hi) {
  return static_cast<std::uint32_t>(__half_as_ushort(lo)) |
         (static_cast<std::uint32_t>(__half_as_ushort(hi)) << 16);
}
__device__ __forceinline__ std::uint32_t pack2(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  return static_cast<std::uint32_t>(__bfloat16_as_ushort(lo)) |
         (static_cast<std::uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}

// silu layout: the output column (in the block's 64) of the gate total in
// n8 tile j (even) of this lane; its up total is in tile j + 1.
template <int MT, bool kWg, int NT>
__device__ __forceinline__ int silu_col(int j) {
  using S = Shape<MT, kWg, NT>;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  return S::warp_n(warp) * (S::kWarpN / 2) + (j / 2) * 8 + (lane % 4) * 2;
}

// silu_mul of a gate and an up total, each rounded to T first (the plain
// store's rounding), rounded to T: silu_mul_kernel on the unfused output.
template <typename T>
__device__ __forceinline__ T silu_out(float gate, float up) {
  return from_float<T>(silu_mul_of<T>(round_to<T>(gate), round_to<T>(up)));
}

// Two adjacent outputs as stored: the totals rounded to T, and with a
// residual (r: its two elements at the same place, packed) the unfused add
// T(float(r) + float(T(total))), the output's rounding kept before the add.
template <typename T>
__device__ __forceinline__ std::uint32_t out2(float lo, float hi) {
  return pack2(from_float<T>(lo), from_float<T>(hi));
}
template <typename T>
__device__ __forceinline__ std::uint32_t out2(float lo, float hi, std::uint32_t r) {
  const T r_lo = *reinterpret_cast<const T*>(&r);
  const T r_hi = *(reinterpret_cast<const T*>(&r) + 1);
  return pack2(from_float<T>(__fadd_rn(to_float(r_lo), round_to<T>(lo))),
               from_float<T>(__fadd_rn(to_float(r_hi), round_to<T>(hi))));
}

// Large M: one block per output tile, all chunks; grouped raster order so a
// wave of blocks shares kGroupM row tiles of x and a band of w in L2.
template <typename T, int MT, bool kWg, bool kTma, int NT>
__device__ __forceinline__ void gemm_tiled(const Params& p, const CUtensorMap* x_map,
                                           const CUtensorMap* w_map) {
  using S = Shape<MT, kWg, NT>;
  launch_dependents();  // a following programmatic launch may start fetching its weights
  const int per_group = kGroupM * p.n_tiles;
  const int group = blockIdx.x / per_group;
  const int first_m = group * kGroupM;
  const int group_m = min(p.m_tiles - first_m, kGroupM);
  const int in_group = blockIdx.x % per_group;
  const int m0 = (first_m + in_group % group_m) * MT;
  const int n0 = (in_group / group_m) * tile_cols<NT>(p);

  // total = c_0 (chunk 0 straight into it, from zero), then total += c_s:
  // the fold of fold_partials, in registers.
  Mainloop<T, MT, kWg, kTma, NT> loop(p, dynamic_smem(), m0, n0, 0, p.chunks, /*split=*/false,
                                      x_map, w_map);
  float total[S::kMi][S::kNj][4], acc[S::kMi][S::kNj][4];
  loop.chunk(0, total);
  for (int s = 1; s < p.chunks; ++s) {
    loop.chunk(s, acc);
#pragma unroll
    for (int i = 0; i < S::kMi; ++i)
#pragma unroll
      for (int j = 0; j < S::kNj; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) total[i][j][e] = __fadd_rn(total[i][j][e], acc[i][j][e]);
  }
  loop.drain();

  T* y = static_cast<T*>(p.y);
  if (p.inter != 0) {
#pragma unroll
    for (int i = 0; i < S::kMi; ++i)
#pragma unroll
      for (int j = 0; j < S::kNj; j += 2) {
        const int n = n0 + silu_col<MT, kWg, NT>(j);
        if (n >= p.n) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int m = m0 + acc_row<MT, kWg, NT>(i, 2 * h);
          if (m >= p.m) continue;
          const float r = row_scale_of(p, m);
          *reinterpret_cast<std::uint32_t*>(y + static_cast<std::int64_t>(m) * p.n + n) =
              pack2(silu_out<T>(__fmul_rn(total[i][j][2 * h], r),
                                __fmul_rn(total[i][j + 1][2 * h], r)),
                    silu_out<T>(__fmul_rn(total[i][j][2 * h + 1], r),
                                __fmul_rn(total[i][j + 1][2 * h + 1], r)));
        }
      }
    return;
  }
  const T* res = static_cast<const T*>(p.residual);
#pragma unroll
  for (int i = 0; i < S::kMi; ++i)
#pragma unroll
    for (int j = 0; j < S::kNj; ++j) {
      const int n = n0 + acc_col<MT, kWg, NT>(j);
      if (n >= p.n) continue;  // N % 8 == 0: columns n and n + 1 are both in or both out
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = m0 + acc_row<MT, kWg, NT>(i, 2 * h);
        if (m >= p.m) continue;
        const std::int64_t off = static_cast<std::int64_t>(m) * p.n + n;
        const float r = row_scale_of(p, m);
        const float lo = __fmul_rn(total[i][j][2 * h], r), hi = __fmul_rn(total[i][j][2 * h + 1], r);
        *reinterpret_cast<std::uint32_t*>(y + off) =
            res == nullptr
                ? out2<T>(lo, hi)
                : out2<T>(lo, hi, *reinterpret_cast<const std::uint32_t*>(res + off));
      }
    }
}

template <typename T, int MT, bool kWg, int NT>
__global__ void __launch_bounds__(kThreads, MT == 128 ? 1 : 2)
    gemm_tiled_kernel(const Params p) {
  gemm_tiled<T, MT, kWg, false, NT>(p, nullptr, nullptr);
}

template <typename T, int MT, int NT>
__global__ void __launch_bounds__(kThreads, MT == 128 ? 1 : 2)
    gemm_tiled_tma_kernel(const __grid_constant__ TmaParams tp) {
  gemm_tiled<T, MT, true, true, NT>(tp.p, &tp.x, &tp.w);
}

// The fold of one output tile from the partials, in chunk order: total = p_0,
// total += p_1, ..., rounded once (and added to the residual, if any, as
// out2 does; or with silu, the gate and up columns folded alike and
// combined). Four columns per thread (N % 8 == 0).
__device__ __forceinline__ float4 fold4(const Params& p, std::int64_t off, std::int64_t plane,
                                        float r) {
  float4 t = __ldcg(reinterpret_cast<const float4*>(p.partial + off));
#pragma unroll 4
  for (int s = 1; s < p.chunks; ++s) {
    const float4 u = __ldcg(reinterpret_cast<const float4*>(p.partial + s * plane + off));
    t.x = __fadd_rn(t.x, u.x);
    t.y = __fadd_rn(t.y, u.y);
    t.z = __fadd_rn(t.z, u.z);
    t.w = __fadd_rn(t.w, u.w);
  }
  return make_float4(__fmul_rn(t.x, r), __fmul_rn(t.y, r), __fmul_rn(t.z, r), __fmul_rn(t.w, r));
}

template <typename T, int MT>
__device__ __forceinline__ void fold_partials(const Params& p, int m_tile, int n_tile) {
  const int cols = tile_cols(p);
  const int m0 = m_tile * MT, n0 = n_tile * cols;
  const int rows = min(MT, p.m - m0);
  const std::int64_t plane = static_cast<std::int64_t>(p.m) * p.n_w;
  const int quads = cols / 4;
  for (int i = threadIdx.x; i < rows * quads; i += kThreads) {
    const int n = n0 + (i % quads) * 4;
    if (n >= p.n) continue;
    const int m = m0 + i / quads;
    const std::int64_t off = static_cast<std::int64_t>(m) * p.n_w + n;  // in the partials
    const float r = row_scale_of(p, m);
    const float4 t = fold4(p, off, plane, r);
    uint2 out;
    if (p.inter != 0) {
      const float4 u = fold4(p, off + p.inter, plane, r);  // the up columns
      out.x = pack2(silu_out<T>(t.x, u.x), silu_out<T>(t.y, u.y));
      out.y = pack2(silu_out<T>(t.z, u.z), silu_out<T>(t.w, u.w));
      *reinterpret_cast<uint2*>(static_cast<T*>(p.y) + static_cast<std::int64_t>(m) * p.n + n) =
          out;
      continue;
    }
    if (p.residual == nullptr) {
      out.x = out2<T>(t.x, t.y);
      out.y = out2<T>(t.z, t.w);
    } else {
      const uint2 r = *reinterpret_cast<const uint2*>(static_cast<const T*>(p.residual) + off);
      out.x = out2<T>(t.x, t.y, r.x);
      out.y = out2<T>(t.z, t.w, r.y);
    }
    *reinterpret_cast<uint2*>(static_cast<T*>(p.y) + off) = out;
  }
}

// Small M: block (chunk, column tile, row tile) writes one chunk sum; the
// last of a tile's blocks folds them (with counters).
template <typename T, int MT, bool kWg>
__global__ void __launch_bounds__(kThreads, MT == 128 ? 1 : 2)
    gemm_split_kernel(const Params p) {
  using S = Shape<MT, kWg>;
  launch_dependents();
  const int s = blockIdx.x, n_tile = blockIdx.y, m_tile = blockIdx.z;
  const int m0 = m_tile * MT, n0 = n_tile * tile_cols(p);
  Mainloop<T, MT, kWg> loop(p, dynamic_smem(), m0, n0, s, s + 1, /*split=*/true);
  float acc[S::kMi][S::kNj][4];
  loop.chunk(s, acc);
  loop.drain();
  float* out = p.partial + static_cast<std::int64_t>(s) * p.m * p.n_w;
#pragma unroll
  for (int i = 0; i < S::kMi; ++i)
#pragma unroll
    for (int j = 0; j < S::kNj; ++j) {
      // Output column n; the partial's column is the weight row.
      const int t = acc_col<MT, kWg>(j);
      int n = n0 + t, wn = n;
      if (p.inter != 0) {
        n = n0 + (t / 16) * 8 + t % 8;
        wn = n + ((t / 8) & 1) * p.inter;
      }
      if (n >= p.n) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = m0 + acc_row<MT, kWg>(i, 2 * h);
        if (m >= p.m) continue;
        __stcg(reinterpret_cast<float2*>(out + static_cast<std::int64_t>(m) * p.n_w + wn),
               make_float2(acc[i][j][2 * h], acc[i][j][2 * h + 1]));
      }
    }
  if (p.counters == nullptr) return;

  // Last block of the tile: every partial is visible once its count is seen
  // (each writer fences before its block counts).
  __shared__ int s_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    int* counter = p.counters + static_cast<std::int64_t>(m_tile) * p.n_tiles + n_tile;
    const bool last = atomicAdd(counter, 1) + 1 == p.chunks;
    if (last) atomicExch(counter, 0);  // zero again for the next launch or graph replay
    s_last = last;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  fold_partials<T, MT>(p, m_tile, n_tile);
}

// The fold as a second launch (no counter buffer): one block per tile.
template <typename T, int MT>
__global__ void __launch_bounds__(kThreads) gemm_fold_kernel(const Params p) {
  fold_partials<T, MT>(p, blockIdx.y, blockIdx.x);
}

// ------------------------------------------------------------ gemv shape
// A few rows (decode at small batch): the weights streamed once through a
// ring of shared-memory stages as the default GEMV streams them (gemv.cu),
// the chunk sums computed by the same mma.m16n8k16 sequence as the other
// shapes. A block owns kGemvTiles tiles of 8 weight rows (an mma's n8: 8
// output columns, or with silu 4 gate rows over the 4 up rows of the same 4
// columns); its items are (tile, chunk) pairs, item i taken by warp
// i % kWarps. A stage gives each warp a quarter of its item (8 rows x 128 k,
// 2 KiB, 16-byte chunks XOR-swizzled by row), copied by the whole block with
// cp.async; the warp runs the quarter's eight k16 steps in increasing k
// (x rows as the mma's A rows, zero past M; the weight rows as B by
// ldmatrix), starting from zero at the chunk's first quarter, and at its
// last writes the chunk sum to shared memory. After the last stage the
// block folds each output's chunk sums in chunk order (total = c_0;
// total += c_1 ...) and stores as the other shapes store: the same
// operands through the same mma sequence and the same fold, so the same
// bits. x rows are staged in shared memory (a pitch of 2K + 16 bytes keeps
// the rows' fragment reads on different banks).
constexpr int kGemvQuarter = 128;  // k per stage a warp
constexpr int kGemvQuarters = kChunk / kGemvQuarter;
constexpr int kGemvRingStages = 4;
constexpr int kGemvWarpStageBytes = 8 * kGemvQuarter * 2;  // 8 rows x 256 bytes
static_assert(kChunk % kGemvQuarter == 0 && kGemvQuarter % kBK == 0, "quarters are whole k tiles");

// x's rows in shared memory: k tiles' worth of columns (zero past K, as the
// other shapes zero-fill x), 16 bytes more than a multiple of 128.
__host__ __device__ __forceinline__ int gemv_x_pitch(int k) { return (k + kBK - 1) / kBK * kBK * 2 + 16; }

// The gemv shape's dynamic shared memory: the ring, x's rows, the chunk sums,
// the folded norm's four warp sums a row.
__host__ __device__ __forceinline__ int gemv_smem_bytes(int warps, int tiles, int m, int k,
                                                        int chunks) {
  return kGemvRingStages * warps * kGemvWarpStageBytes + m * gemv_x_pitch(k) +
         (tiles * chunks * 8 + 4) * m * static_cast<int>(sizeof(float));
}

template <typename T, int kWarps, int kTiles>
__global__ void __launch_bounds__(kWarps * 32) gemm_gemv_kernel(const Params p) {
  constexpr int kThreads = kWarps * 32;
  constexpr int kStageBytes = kWarps * kGemvWarpStageBytes;
  constexpr int kPieces = kStageBytes / 16 / kThreads;  // 16-byte copies a thread a stage
  static_assert(kPieces * kThreads * 16 == kStageBytes, "whole stages");
  extern __shared__ __align__(128) unsigned char smem[];
  launch_dependents();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int all_tiles = p.n_w / 8;
  const int tile0 = blockIdx.x * kTiles;
  const int tiles = min(kTiles, all_tiles - tile0);
  const int items = tiles * p.chunks;
  const int rounds = (items + kWarps - 1) / kWarps;
  const int n_stages = rounds * kGemvQuarters;
  const int x_pitch = gemv_x_pitch(p.k);
  const std::uint32_t ring = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
  unsigned char* xs = smem + kGemvRingStages * kStageBytes;
  float* sums = reinterpret_cast<float*>(xs + p.m * x_pitch);  // [items][m][8]
  float* norm_sums = sums + tiles * p.chunks * p.m * 8;         // [m][4]

  // Item i of the block: (tile, chunk) = (i / chunks, i % chunks), by
  // comparisons (kTiles is 1 or 2; a division costs tens of instructions,
  // and the loop is issue-bound: Nsight Compute counted 2.6x the default
  // GEMV's instructions on the o projection before this).
  auto tile_of = [&](int item) {
    int tl = 0;
#pragma unroll
    for (int i = 1; i < kTiles; ++i) tl += item >= i * p.chunks;
    return tl;
  };
  // A thread copies the same 16-byte column c of the same row r in every
  // stage (piece % 128 does not change with j): its rows' first elements
  // in each block tile and its shared-memory offsets, worked out once.
  const auto* w = static_cast<const std::uint16_t*>(p.w);
  const int my_r = threadIdx.x % 128 / 16, my_c = threadIdx.x % 16;
  const std::uint16_t* my_rows[kTiles];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    const int tile = tile0 + min(t, tiles - 1);
    const int row = p.inter == 0 ? tile * 8 + my_r
                                 : tile * 4 + (my_r & 3) + (my_r >> 2) * p.inter;
    my_rows[t] = w + static_cast<std::int64_t>(row) * p.k + my_c * 8;
  }
  const std::uint32_t my_slot_off = my_r * 256 + ((my_c ^ my_r) << 4);
  // Stage s: the block's copies, one commit group (empty past the last).
  auto issue = [&](int s, int slot) {
    if (s < n_stages) {
      const int round = s / kGemvQuarters, q = s % kGemvQuarters;
#pragma unroll
      for (int j = 0; j < kPieces; ++j) {
        const int wp = (threadIdx.x + kThreads * j) / 128;
        const int item = round * kWarps + wp;
        const int tl = tile_of(item);
        const int k = (item - tl * p.chunks) * kChunk + q * kGemvQuarter;
        const bool ok = item < items && k + my_c * 8 < p.k;
        const std::uint16_t* row = my_rows[0];
#pragma unroll
        for (int i = 1; i < kTiles; ++i) row = tl == i ? my_rows[i] : row;
        cp_async16_l2_256(ring + slot * kStageBytes + wp * kGemvWarpStageBytes + my_slot_off,
                          ok ? row + k : w, ok);
      }
    }
    cp_async_commit();
  };
  for (int s = 0; s < kGemvRingStages - 1; ++s) issue(s, s);  // weights: before the wait

  grid_dependency_wait();
  {  // x's rows, pitch x_pitch, zeros past K
    const int vecs = p.k / 8, padded = p.k_tiles * (kBK / 8);
    const auto* xg = static_cast<const uint4*>(p.x);
    const auto xs_addr = static_cast<std::uint32_t>(__cvta_generic_to_shared(xs));
    for (int i = threadIdx.x; i < p.m * padded; i += kThreads) {
      const int m = i / padded, v = i % padded;
      cp_async16(xs_addr + m * x_pitch + 16 * v, xg + (v < vecs ? m * vecs + v : 0), v < vecs);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
  }
  // The folded norm: the rows' sums of squares from x's copy, in row_sq_sum's
  // order (the first 128 threads), read back after the stages' last barrier.
  if (p.norm_eps > 0.0f && threadIdx.x < 128) {
    for (int m = 0; m < p.m; ++m) {
      const float s = row_sq_sum(reinterpret_cast<const T*>(xs + m * x_pitch), p.k, threadIdx.x);
      if (lane == 0) norm_sums[m * 4 + warp] = s;
    }
  }

  const int g = lane / 4, t = lane % 4;
  const bool row_lo = g < p.m, row_hi = g + 8 < p.m;
  const unsigned char* x_lo = xs + g * x_pitch + 4 * t;
  const unsigned char* x_hi = xs + (g + 8) * x_pitch + 4 * t;
  // ldmatrix: lane l gives row l % 8 of matrix l / 8 (k 8 (l / 8)..: two k16 steps).
  const std::uint32_t b_row = warp * kGemvWarpStageBytes + (lane % 8) * 256;
  const int b_key = lane % 8, b_mat = lane / 8;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int s = 0; s < n_stages; ++s) {
    cp_async_wait<kGemvRingStages - 2>();
    __syncthreads();  // stage s landed everywhere; stage s - 1's slot is free
    issue(s + kGemvRingStages - 1, (s + kGemvRingStages - 1) % kGemvRingStages);
    const int round = s / kGemvQuarters, q = s % kGemvQuarters;
    const int item = round * kWarps + warp;
    if (item >= items) continue;  // the same for the whole warp
    const int chunk = item - tile_of(item) * p.chunks;
    if (q == 0) acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
    // The quarter's k tiles that exist (the others, past K, run no MMA, as
    // in the other shapes).
    const int kt0 = chunk * (kChunk / kBK) + q * (kGemvQuarter / kBK);
    const int tiles_here = min(kGemvQuarter / kBK, p.k_tiles - kt0);
    const std::uint32_t st = ring + (s % kGemvRingStages) * kStageBytes + b_row;
    const int kq = chunk * kChunk + q * kGemvQuarter;  // the quarter's first k
#pragma unroll
    for (int pair = 0; pair < kGemvQuarter / 32; ++pair) {
      if (pair * 32 >= tiles_here * kBK) break;
      std::uint32_t b[4];
      ldmatrix_x4(b, st + (((4 * pair + b_mat) ^ b_key) << 4));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int kb = 2 * (kq + 32 * pair + 16 * h);  // byte offset in an x row
        std::uint32_t a[4] = {0u, 0u, 0u, 0u};
        if (row_lo) {
          a[0] = *reinterpret_cast<const std::uint32_t*>(x_lo + kb);
          a[2] = *reinterpret_cast<const std::uint32_t*>(x_lo + kb + 16);
        }
        if (row_hi) {
          a[1] = *reinterpret_cast<const std::uint32_t*>(x_hi + kb);
          a[3] = *reinterpret_cast<const std::uint32_t*>(x_hi + kb + 16);
        }
        mma_m16n8k16<T>(acc, a, b[2 * h], b[2 * h + 1]);
      }
    }
    if (q == kGemvQuarters - 1) {
      float* out = sums + static_cast<std::int64_t>(item) * p.m * 8;
      if (row_lo) {
        out[g * 8 + 2 * t] = acc[0];
        out[g * 8 + 2 * t + 1] = acc[1];
      }
      if (row_hi) {
        out[(g + 8) * 8 + 2 * t] = acc[2];
        out[(g + 8) * 8 + 2 * t + 1] = acc[3];
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // The fold and the store: a thread per (tile, output column, x row).
  const int cols = p.inter ? 4 : 8;
  T* y = static_cast<T*>(p.y);
  const T* res = static_cast<const T*>(p.residual);
  auto fold = [&](int tl, int m, int r) {
    const float* c = sums + (static_cast<std::int64_t>(tl) * p.chunks * p.m + m) * 8 + r;
    float total = c[0];
    for (int ch = 1; ch < p.chunks; ++ch) total = __fadd_rn(total, c[ch * p.m * 8]);
    return p.norm_eps > 0.0f ? __fmul_rn(total, rms_scale(norm_sums + m * 4, p.k, p.norm_eps))
                             : total;
  };
  for (int i = threadIdx.x; i < tiles * cols * p.m; i += kThreads) {
    const int tl = i / (cols * p.m), col = i / p.m % cols, m = i % p.m;
    const std::int64_t off = static_cast<std::int64_t>(m) * p.n + (tile0 + tl) * cols + col;
    if (p.inter != 0) {
      y[off] = silu_out<T>(fold(tl, m, col), fold(tl, m, col + 4));
    } else if (res != nullptr) {
      y[off] = from_float<T>(__fadd_rn(to_float(res[off]), round_to<T>(fold(tl, m, col))));
    } else {
      y[off] = from_float<T>(fold(tl, m, col));
    }
  }
}

template <typename T, int kWarps, int kTiles>
void launch_gemv_shape(const Params& p, cudaStream_t stream) {
  auto kernel = gemm_gemv_kernel<T, kWarps, kTiles>;
  static bool opted_in = false;
  opt_in_smem(kernel, kGemmInvariantGemvSmemBytes, opted_in,
              "gemm_invariant: shared memory opt-in");
  const int blocks = ceil_div(p.n_w / 8, kTiles);
  launch_programmatic(kernel, p, dim3(blocks), kWarps * 32,
                      gemv_smem_bytes(kWarps, kTiles, p.m, p.k, p.chunks), stream,
                      "gemm_gemv_kernel");
}

// Long rows (the down projection's K = 14336) take 8 warps and two tiles a
// block, as the default GEMV takes 8 warps there. Grids of many waves (at
// one tile a block: ten blocks an SM or more; gate/up and the LM head) take
// two tiles a block: half the blocks, so half the x copies and block starts
// (H100, deterministic decode step: gate/up 82.8 -> 80.0 µs, the LM head
// 347 -> 337; qkv and o, about a wave, lost 5-8 µs each with two).
template <typename T>
void dispatch_gemv_shape(const Params& p, cudaStream_t stream) {
  if (p.k > 8192) return launch_gemv_shape<T, 8, 2>(p, stream);
  if (p.n_w / 8 >= 10 * sm_count()) return launch_gemv_shape<T, 4, 2>(p, stream);
  launch_gemv_shape<T, 4, 1>(p, stream);
}

bool g_tma_tiled = false;  // set_gemm_invariant_tma
// Rows from which the tiled shape loads by TMA when it is on: the prefill
// sizes, where it ran 10-20% faster alone on the H100; with it at decode
// batches too (65-256 rows) the deterministic offline run was slower.
constexpr std::int64_t kTmaMinRows = 512;

// NT: the tiled shape's columns per block (the split shape's are kNT).
template <typename T, int MT, bool kWg, int NT = kNT>
void launch(Params p, bool split, cudaStream_t stream) {
  static_assert(NT == kNT || kWg, "64-wide tiles: the tiled shape on wgmma");
  using S = Shape<MT, kWg, NT>;
  p.m_tiles = ceil_div(p.m, MT);
  if (!split) p.n_tiles = ceil_div(p.n_w, NT);
  if constexpr (kWg) {
    if (!split && g_tma_tiled && p.m >= kTmaMinRows) {
      const DType dtype = std::is_same_v<T, __half> ? DType::kF16 : DType::kBF16;
      TmaParams tp{};
      tp.p = p;
      // x's maps from a bounded cache (activations move), the weights' kept.
      tp.x = transient_tensor_map_2d(reinterpret_cast<std::uintptr_t>(p.x), p.m, p.k, dtype, MT);
      tp.w = tensor_map_2d(reinterpret_cast<std::uintptr_t>(p.w), p.n_w, p.k, dtype,
                           p.inter ? 8 : NT);
      auto kernel = gemm_tiled_tma_kernel<T, MT, NT>;
      static bool opted_in = false;
      opt_in_smem(kernel, S::kSmemBytes + kTmaBarrierBytes, opted_in,
                  "gemm_invariant: shared memory opt-in");
      const std::int64_t blocks = static_cast<std::int64_t>(p.m_tiles) * p.n_tiles;
      launch_programmatic(kernel, tp, dim3(static_cast<unsigned>(blocks)), kThreads,
                          S::kSmemBytes + kTmaBarrierBytes, stream, "gemm_tiled_tma_kernel");
      return;
    }
  }
  if (!split) {
    auto kernel = gemm_tiled_kernel<T, MT, kWg, NT>;
    static bool opted_in = false;  // per instantiation, as gemv
    opt_in_smem(kernel, S::kSmemBytes, opted_in, "gemm_invariant: shared memory opt-in");
    const std::int64_t blocks = static_cast<std::int64_t>(p.m_tiles) * p.n_tiles;
    launch_programmatic(kernel, p, dim3(static_cast<unsigned>(blocks)), kThreads, S::kSmemBytes,
                        stream, "gemm_tiled_kernel");
    return;
  }
  auto kernel = gemm_split_kernel<T, MT, kWg>;
  static bool opted_in = false;
  opt_in_smem(kernel, S::kSmemBytes, opted_in, "gemm_invariant: shared memory opt-in");
  launch_programmatic(kernel, p, dim3(p.chunks, p.n_tiles, p.m_tiles), kThreads, S::kSmemBytes,
                      stream, "gemm_split_kernel");
  if (p.counters == nullptr) {
    gemm_fold_kernel<T, MT><<<dim3(p.n_tiles, p.m_tiles), kThreads, 0, stream>>>(p);
    check_launch("gemm_fold_kernel");
  }
}

bool g_wgmma_tiled = false, g_wgmma_split = false;  // set_gemm_invariant_wgmma

// Rows per block. mma.sync: the smallest of 16, 32, 64 that holds M, else
// 128 (kGemmInvariantTile); wgmma: 64 up to 64 rows, else 128. Either way a
// tiled launch whose 128-row tiles would leave SMs idle takes 64-row tiles
// (twice the blocks); on wgmma, if those still would, 64 x 64 tiles (twice
// again: decode batches of 65-260 rows on 4096 columns). The split shape's
// tile rows are block_rows() (its counters).
template <typename T>
void dispatch_rows(const Params& p, bool split, cudaStream_t stream) {
  const int sms = sm_count();
  const bool narrow = p.m <= 64 || (!split && ceil_div(p.m, 128) * p.n_tiles < sms);
  if (split ? g_wgmma_split : g_wgmma_tiled) {
    if (!narrow) return launch<T, 128, true>(p, split, stream);
    if (!split && ceil_div(p.m, 64) * p.n_tiles < sms) return launch<T, 64, true, 64>(p, split, stream);
    return launch<T, 64, true>(p, split, stream);
  }
  if (p.m <= 16) return launch<T, 16, false>(p, split, stream);
  if (p.m <= 32) return launch<T, 32, false>(p, split, stream);
  if (narrow) return launch<T, 64, false>(p, split, stream);
  launch<T, 128, false>(p, split, stream);
}

int block_rows(std::int64_t rows) { return rows <= 16 ? 16 : rows <= 32 ? 32 : rows <= 64 ? 64 : 128; }

bool resolve_split(std::int64_t rows, GemmInvariantPath path) {
  if (path == GemmInvariantPath::kAuto) return rows <= kGemmInvariantSplitMaxRows;
  return path == GemmInvariantPath::kSplit;
}

// The gemv shape's largest block for K: (warps, tiles) (dispatch_gemv_shape
// takes one tile instead of two for grids of few waves).
std::pair<int, int> gemv_block(std::int64_t k_in) {
  return k_in > 8192 ? std::pair<int, int>{8, 2} : std::pair<int, int>{4, 2};
}

void check_shape(std::int64_t rows, std::int64_t n_out, std::int64_t k_in) {
  require(rows >= 1 && n_out >= 1 && k_in >= 1, "gemm_invariant: empty shape");
  require(n_out % 8 == 0 && k_in % 8 == 0, "gemm_invariant: N and K must be multiples of 8");
  require(rows < (1LL << 31) && n_out < (1LL << 31) && k_in < (1LL << 31),
          "gemm_invariant: sizes too large");
}

}  // namespace

bool gemm_invariant_gemv_fits(std::int64_t rows, std::int64_t k_in) {
  if (rows < 1 || rows > kGemmInvariantGemvMaxRows || k_in < 8 || k_in > (1 << 20)) return false;
  const auto [warps, tiles] = gemv_block(k_in);
  const int chunks = static_cast<int>((k_in + kChunk - 1) / kChunk);
  return gemv_smem_bytes(warps, tiles, static_cast<int>(rows), static_cast<int>(k_in), chunks) <=
         kGemmInvariantGemvSmemBytes;
}

void set_gemm_invariant_wgmma(bool tiled, bool split) {
  g_wgmma_tiled = tiled;
  g_wgmma_split = split;
}
std::pair<bool, bool> gemm_invariant_wgmma() { return {g_wgmma_tiled, g_wgmma_split}; }
void set_gemm_invariant_tma(bool on) { g_tma_tiled = on; }
bool gemm_invariant_tma() { return g_tma_tiled; }

std::int64_t gemm_invariant_workspace(std::int64_t rows, std::int64_t n_out, std::int64_t k_in,
                                      GemmInvariantPath path) {
  check_shape(rows, n_out, k_in);
  if (!resolve_split(rows, path)) return 0;
  const std::int64_t chunks = (k_in + kChunk - 1) / kChunk;
  return chunks * rows * n_out * static_cast<std::int64_t>(sizeof(float));
}

std::int64_t gemm_invariant_counters(std::int64_t rows, std::int64_t n_out,
                                     GemmInvariantPath path) {
  require(rows >= 1 && n_out >= 1, "gemm_invariant: empty shape");
  if (!resolve_split(rows, path)) return 0;
  return ((rows + block_rows(rows) - 1) / block_rows(rows)) * ((n_out + kNT - 1) / kNT);
}

void gemm_invariant(std::uintptr_t y, std::uintptr_t x, std::uintptr_t w, std::int64_t rows,
                    std::int64_t n_out, std::int64_t k_in, DType dtype, std::uintptr_t workspace,
                    std::int64_t workspace_bytes, std::uintptr_t stream,
                    GemmInvariantPath path, std::uintptr_t counters, std::uintptr_t residual,
                    bool silu_mul, float norm_eps, std::uintptr_t row_scale) {
  require(dtype == DType::kF16 || dtype == DType::kBF16,
          "gemm_invariant: dtype must be float16 or bfloat16");
  check_shape(rows, n_out, k_in);
  require(x % 16 == 0 && w % 16 == 0 && y % 16 == 0,
          "gemm_invariant: x, w and y must be 16-byte aligned");
  require(path != GemmInvariantPath::kGemv || gemm_invariant_gemv_fits(rows, k_in),
          "gemm_invariant: the gemv shape takes at most " +
              std::to_string(kGemmInvariantGemvMaxRows) +
              " rows, and x's rows must fit its shared memory");
  const bool split = resolve_split(rows, path);
  const std::int64_t need = gemm_invariant_workspace(rows, n_out, k_in, path);
  require(workspace_bytes >= need, "gemm_invariant: workspace too small (" +
                                       std::to_string(workspace_bytes) + " < " +
                                       std::to_string(need) + " bytes)");
  require(!split || workspace % 16 == 0, "gemm_invariant: workspace must be 16-byte aligned");
  require(counters % 4 == 0, "gemm_invariant: counters must be 4-byte aligned");
  require(residual % 16 == 0, "gemm_invariant: residual must be 16-byte aligned");
  require(!silu_mul || (n_out % 16 == 0 && residual == 0),
          "gemm_invariant: silu_mul needs N a multiple of 16 and no residual");
  require(norm_eps >= 0.0f, "gemm_invariant: norm_eps must be >= 0");
  require(norm_eps == 0.0f || path == GemmInvariantPath::kGemv ||
              (row_scale != 0 && row_scale % 4 == 0),
          "gemm_invariant: the folded norm needs a float32 row_scale buffer of `rows` "
          "entries outside the gemv shape");
  Params p{};
  p.y = reinterpret_cast<void*>(y);
  p.residual = reinterpret_cast<const void*>(residual);
  p.x = reinterpret_cast<const void*>(x);
  p.w = reinterpret_cast<const void*>(w);
  p.partial = reinterpret_cast<float*>(workspace);
  p.counters = reinterpret_cast<int*>(counters);
  p.m = static_cast<int>(rows);
  p.n_w = static_cast<int>(n_out);
  p.n = silu_mul ? p.n_w / 2 : p.n_w;
  p.inter = silu_mul ? p.n : 0;
  p.k = static_cast<int>(k_in);
  p.n_tiles = ceil_div(n_out, kNT);  // with silu: ceil(N / 64) blocks of 64 columns, the same
  p.k_tiles = ceil_div(k_in, kBK);
  p.chunks = ceil_div(k_in, kChunk);
  p.norm_eps = norm_eps;
  const std::int64_t m_tiles = ceil_div(rows, block_rows(rows));
  if (split) {
    require(p.n_tiles <= 65535 && m_tiles <= 65535, "gemm_invariant: too many tiles to split");
  } else {
    require(m_tiles * p.n_tiles < (1LL << 31), "gemm_invariant: too many tiles");
  }
  if (path == GemmInvariantPath::kGemv) {
    if (dtype == DType::kF16) return dispatch_gemv_shape<__half>(p, as_stream(stream));
    return dispatch_gemv_shape<__nv_bfloat16>(p, as_stream(stream));
  }
  if (norm_eps > 0.0f) {
    auto* scales = reinterpret_cast<float*>(row_scale);
    if (dtype == DType::kF16) {
      launch_kernel(true, gemm_row_scale_kernel<__half>, dim3(p.m), 128, 0, as_stream(stream),
                    "gemm_row_scale_kernel", static_cast<const __half*>(p.x), p.k, norm_eps,
                    scales);
    } else {
      launch_kernel(true, gemm_row_scale_kernel<__nv_bfloat16>, dim3(p.m), 128, 0,
                    as_stream(stream), "gemm_row_scale_kernel",
                    static_cast<const __nv_bfloat16*>(p.x), p.k, norm_eps, scales);
    }
    p.row_scale = scales;
  }
  if (dtype == DType::kF16) {
    dispatch_rows<__half>(p, split, as_stream(stream));
  } else {
    dispatch_rows<__nv_bfloat16>(p, split, as_stream(stream));
  }
}

}  // namespace cuda
}  // namespace turbomq
