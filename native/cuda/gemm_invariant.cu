// Batch-invariant GEMM: y[M, N] = x[M, K] @ w[N, K]^T (fp16/bf16, fp32
// accumulation) whose row m is bit-identical whatever M is and whatever the
// other rows hold: the same token gives the same logits in a decode batch of
// 1 or 64, or inside an 8192-row prefill (deterministic mode).
//
// The product has one definition, independent of M, N and of the launch:
//   output (m, n) is ONE fp32 accumulation, from zero, of the tensor-core
//   k16 steps over K in increasing k (zero-filled past K), rounded once to
//   the output dtype.
// A tensor-core MMA computes each output element from its own row of x, its
// own row of w and its own accumulator, so an element's value depends
// neither on where it sits in the tile nor on its neighbours, nor on which
// operand the weights are (the H100 adds the same bits either way: the GPU
// test holds it). Without chunk sums or split-K there is nothing else to
// fix, so the tile is free to follow M, as cuBLAS's does:
//   tiled: a persistent wgmma kernel. A producer warpgroup (one thread)
//     TMA-loads 64-wide k tiles of x's MT rows and w's NT rows (128-byte
//     swizzle; rows past M or N and columns past K read as zeros) into a
//     ring of stages that flows from one output tile into the next; one or
//     two consumer warpgroups run m64nNk16 MMAs over them into one
//     accumulator set. MT x NT is 64 x 128, 128 x 64 to 128 x 256 (by 32:
//     the width that fills the last round of tiles) or 256 x 128, whichever
//     a cost model says finishes first (gemm_invariant_tiling).
//   transposed: at most 8 rows (decode). An m64 tile would spend 63 of its
//     64 MMA rows on padding and run one accumulator chain per 64 weight
//     rows; transposed, y^T = w x^T, mma.sync m16n8k16 takes 16 weight rows
//     as A and x's rows as the n8 columns, a warp per 16 weight rows, so
//     N / 16 chains share the GPU. A producer warp TMA-loads the block's
//     weight rows and x's 8 rows (zero past M) into a ring of stages.
// Both launch as programmatic dependents: the producer loads the first
// stages' weights before it waits for the previous kernel, x after.
//
// Optional fused residual add: with a residual [M, N], the store writes
// y = T(float(residual) + float(T(total))): the output rounded to T first,
// exactly as the plain store rounds it, then the add that a separate
// elementwise kernel would run (one __fadd_rn, one rounding), so the result
// is bit for bit that of the GEMM followed by residual += y. The thread that
// reads a residual element writes the same element, so y may be the
// residual itself (in place).
//
// Optional fused silu_mul: w stacks the gate rows [0, I) over the up rows
// [I, 2I) and y is [M, I] = silu_mul(gate, up) with silu_mul_kernel's
// roundings (gate and up rounded to T, as the plain store rounds them, then
// silu_mul_of). A tile's weight rows are then its columns' gate rows and
// the same columns' up rows (two boxes), so the thread holding a column's
// gate total holds its up total too: tiled, n8 tiles j and j + NT / 16;
// transposed, accumulator rows g and g + 8.
//
// Optional folded RMSNorm (norm_eps > 0): w's columns already carry the norm
// weight (w[n, k] * g[k], folded at load), and both shapes multiply a row's
// total by r = rsqrt(mean(x^2) + eps) before the store (one __fmul_rn). r's
// sum of squares has one fixed order (row_sq_sum): the tiled shape reads r
// from gemm_row_scale_kernel, launched in front of it; the transposed shape
// computes it in the block with the same code (no launch at decode).
#include <algorithm>

#include "mma.cuh"
#include "rope_kv.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace turbomq {
namespace cuda {
namespace {

constexpr int kBK = 64;  // k per stage: a 128-byte shared-memory row
constexpr int kRowBytes = kBK * 2;
constexpr int kGroupM = 8;  // tiled: row tiles per raster group (L2 reuse of w)

struct Params {
  void* y;               // [M, N]
  const void* residual;  // [M, N] added into the output, or null
  const void* x;         // [M, K]
  int m, n, k;
  int n_w;               // weight rows: N, or 2N with silu (gate rows, then up rows)
  int inter;             // silu: N (the up rows' offset), else 0
  int m_tiles, n_tiles, k_tiles;
  float norm_eps;          // > 0: the folded norm
  const float* row_scale;  // tiled: [M] r of each row (gemm_row_scale_kernel), or null
  RopeKV rope;  // transposed: rotary and the KV write in the store (head_dim > 0)
  bool trigger_at_start;  // transposed: launch dependents at the start, not after the last load
  CUtensorMap x_map, w_map;
};

// The folded norm's sum of squares of one row (k a multiple of 8), in the
// one order both shapes use: thread t of 128 adds the squares of 16-byte
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

// r of every row for the tiled shape: a block of 128 threads a row.
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

// One output element as stored: the total times the row's scale (1 without
// the norm: exact), rounded to T; with a residual (its value as a float) the
// unfused add T(residual + float(T(value))).
template <typename T>
__device__ __forceinline__ T out_value(float total, float scale, float residual, bool add) {
  const float v = __fmul_rn(total, scale);
  if (!add) return from_float<T>(v);
  return from_float<T>(__fadd_rn(residual, round_to<T>(v)));
}
// silu_mul of a gate and an up total (each scaled, then rounded to T: the
// plain store's rounding), rounded to T: silu_mul_kernel on the unfused output.
template <typename T>
__device__ __forceinline__ T silu_out(float gate, float up, float scale) {
  return from_float<T>(
      silu_mul_of<T>(round_to<T>(__fmul_rn(gate, scale)), round_to<T>(__fmul_rn(up, scale))));
}
template <typename T>
__device__ __forceinline__ std::uint32_t pack(T lo, T hi) {
  return static_cast<std::uint32_t>(*reinterpret_cast<const std::uint16_t*>(&lo)) |
         (static_cast<std::uint32_t>(*reinterpret_cast<const std::uint16_t*>(&hi)) << 16);
}

__device__ __forceinline__ std::uint32_t smem_base() {
  extern __shared__ __align__(128) unsigned char smem[];
  // 1024-byte aligned: the 128-byte swizzle's 8-row atoms
  return (static_cast<std::uint32_t>(__cvta_generic_to_shared(smem)) + 1023u) & ~1023u;
}
__device__ __forceinline__ void mbarrier_init_count(std::uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(std::uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
template <int kRegs, bool kIncrease>
__device__ __forceinline__ void set_max_registers() {
  if constexpr (kIncrease) {
    TURBOMQ_WGMMA_ASM("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
  } else {
    TURBOMQ_WGMMA_ASM("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
  }
}
// The full (bytes landed) and empty (consumers done) mbarriers of a ring of
// kStages stages, past the stages.
template <int kStages>
struct Ring {
  std::uint32_t full, empty;
  __device__ __forceinline__ Ring(std::uint32_t past_stages, int consumers)
      : full(past_stages), empty(past_stages + 8 * kStages) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < kStages; ++s) {
        mbarrier_init(full + 8 * s);
        mbarrier_init_count(empty + 8 * s, consumers);
      }
      fence_mbarrier_init();
    }
    __syncthreads();
  }
};
constexpr int ring_barrier_bytes(int stages) { return 16 * stages; }

// ------------------------------------------------------------ tiled shape
// kMT x rows by kNT weight rows a tile; kWG consumer warpgroups split its
// rows. As many stages as fit in shared memory, up to 8.
template <int kMT, int kNT, int kWG>
struct Tile {
  static constexpr int kRowsWG = kMT / kWG;  // rows a consumer warpgroup owns
  static constexpr int kSub = kRowsWG / 64;  // its m64 sub-tiles
  static constexpr int kThreads = (kWG + 1) * 128;
  static constexpr int kStageBytes = (kMT + kNT) * kRowBytes;
  static constexpr int kStages = std::min(8, (227 * 1024 - 1024) / (kStageBytes + 16));
  static constexpr int kSmemBytes = 1024 + kStages * kStageBytes + ring_barrier_bytes(kStages);
  static_assert(kSub >= 1 && kRowsWG % 64 == 0, "m64 sub-tiles");
  static_assert(kNT % 32 == 0 && kNT <= 256, "wgmma n32..n256 (n / 2 each half with silu)");
  static_assert(kSub * kNT <= 256, "accumulators: at most 128 registers a thread");
  static_assert(kStages >= 3 && kSmemBytes <= 227 * 1024, "shared memory");
};

// Tile t's first row and first output column, in grouped raster order (a
// wave of tiles shares kGroupM row tiles of x and a band of w in L2).
__device__ __forceinline__ void tile_origin(const Params& p, int t, int mt, int cols, int& m0,
                                            int& c0) {
  const int per_group = kGroupM * p.n_tiles;
  const int first = t / per_group * kGroupM;
  const int group_m = min(p.m_tiles - first, kGroupM);
  const int in_group = t % per_group;
  m0 = (first + in_group % group_m) * mt;
  c0 = (in_group / group_m) * cols;
}

template <typename T, int kMT, int kNT, int kWG>
__global__ void __launch_bounds__(Tile<kMT, kNT, kWG>::kThreads, 1)
    gemm_tiled_kernel(const __grid_constant__ Params p) {
  using S = Tile<kMT, kNT, kWG>;
  constexpr int kStages = S::kStages;
  const int tiles = p.m_tiles * p.n_tiles;
  const int my_tiles = blockIdx.x < tiles ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const int cols = p.inter ? kNT / 2 : kNT;  // output columns a tile
  const std::uint32_t base = smem_base();
  const Ring<kStages> ring(base + kStages * S::kStageBytes, kWG);

  if (threadIdx.x >= kWG * 128) {
    // setmaxnreg in both branches also tells ptxas that the consumer branch
    // is warpgroup-uniform; without it, it serializes the wgmmas.
    set_max_registers<40, false>();
    if (threadIdx.x != kWG * 128) return;
    const int steps = my_tiles * p.k_tiles;
    // k tile kt of tile t's weight rows: kNT rows from c0, or with silu
    // kNT / 2 gate rows from c0 and the same columns' up rows.
    const auto load_w = [&](std::uint32_t st, int c0, int kt, std::uint32_t bar) {
      const std::uint32_t dst = st + kMT * kRowBytes;
      tma_load_2d(dst, &p.w_map, kt * kBK, c0, bar);
      if (p.inter) tma_load_2d(dst + kNT / 2 * kRowBytes, &p.w_map, kt * kBK, p.inter + c0, bar);
    };
    // The first stages' weights do not depend on the previous kernel.
    const int early = min(kStages, steps);
    int m0, c0;
    for (int step = 0; step < early; ++step) {
      tile_origin(p, blockIdx.x + step / p.k_tiles * gridDim.x, kMT, cols, m0, c0);
      mbarrier_expect_bytes(ring.full + 8 * step, S::kStageBytes);
      load_w(base + step * S::kStageBytes, c0, step % p.k_tiles, ring.full + 8 * step);
    }
    grid_dependency_wait();
    int step = 0;
    for (int t = 0; t < my_tiles; ++t) {
      tile_origin(p, blockIdx.x + t * gridDim.x, kMT, cols, m0, c0);
      for (int kt = 0; kt < p.k_tiles; ++kt, ++step) {
        const int s = step % kStages;
        const std::uint32_t st = base + s * S::kStageBytes, full = ring.full + 8 * s;
        if (step >= early) {
          mbarrier_wait(ring.empty + 8 * s, (step / kStages - 1) & 1);
          mbarrier_expect_bytes(full, S::kStageBytes);
          load_w(st, c0, kt, full);
        }
        tma_load_2d(st, &p.x_map, kt * kBK, m0, full);
      }
    }
    launch_dependents();
    return;
  }

  set_max_registers<232, true>();
  grid_dependency_wait();  // the residual and the row scales come from earlier kernels
  const int wg = threadIdx.x / 128;
  // Warpgroup wg: rows kRowsWG wg.. as kSub m64 sub-tiles; all kNT weight rows.
  std::uint64_t a[S::kSub];
#pragma unroll
  for (int i = 0; i < S::kSub; ++i) {
    a[i] = wgmma_desc(base + (S::kRowsWG * wg + 64 * i) * kRowBytes);
  }
  const std::uint64_t b = wgmma_desc(base + kMT * kRowBytes);
  T* y = static_cast<T*>(p.y);
  const T* res = static_cast<const T*>(p.residual);
  const int lane = threadIdx.x % 32, w4 = (threadIdx.x / 32) % 4;
  int step = 0;
  for (int t = 0; t < my_tiles; ++t) {
    // Zeroed here, after the last tile's MMAs have completed: a write to
    // the accumulators between MMAs makes ptxas serialize them.
    float acc[S::kSub][kNT / 2];
#pragma unroll
    for (int i = 0; i < S::kSub; ++i) {
#pragma unroll
      for (int r = 0; r < kNT / 2; ++r) acc[i][r] = 0.0f;
    }
    for (int kt = 0; kt < p.k_tiles; ++kt, ++step) {
      const int s = step % kStages;
      mbarrier_wait(ring.full + 8 * s, (step / kStages) & 1);
      const std::uint64_t st = static_cast<std::uint64_t>(s * S::kStageBytes) >> 4;
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kBK / 16; ++ks) {
#pragma unroll
        for (int i = 0; i < S::kSub; ++i) {
          wgmma_m64k16<T, kNT>(acc[i], a[i] + st + 2 * ks, b + st + 2 * ks);
        }
      }
      wgmma_commit();
      wgmma_wait<1>();
      // The previous k tile's MMAs are done: its stage is free.
      if (kt > 0 && threadIdx.x % 128 == 0) {
        mbarrier_arrive(ring.empty + 8 * ((step - 1) % kStages));
      }
    }
    wgmma_wait<0>();
    if (threadIdx.x % 128 == 0) mbarrier_arrive(ring.empty + 8 * ((step - 1) % kStages));

    // The m64nN accumulator: warp w4 of the warpgroup holds rows
    // 16 w4 + lane / 4 (+ 8); n8 tile j at columns 8 j + 2 (lane % 4), + 1.
    int m0, c0;
    tile_origin(p, blockIdx.x + t * gridDim.x, kMT, cols, m0, c0);
#pragma unroll
    for (int i = 0; i < S::kSub; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = m0 + S::kRowsWG * wg + 64 * i + 16 * w4 + lane / 4 + 8 * h;
        if (m >= p.m) continue;
        const float r = p.row_scale != nullptr ? p.row_scale[m] : 1.0f;
        T* y_row = y + static_cast<std::int64_t>(m) * p.n;
        if (p.inter) {
#pragma unroll
          for (int j = 0; j < kNT / 16; ++j) {
            const int n = c0 + 8 * j + 2 * (lane % 4);
            if (n >= p.n) continue;  // N % 8 == 0: n and n + 1 are both in or both out
            const float* g = &acc[i][4 * j + 2 * h];
            const float* u = &acc[i][4 * (j + kNT / 16) + 2 * h];
            *reinterpret_cast<std::uint32_t*>(y_row + n) =
                pack<T>(silu_out<T>(g[0], u[0], r), silu_out<T>(g[1], u[1], r));
          }
          continue;
        }
#pragma unroll
        for (int j = 0; j < kNT / 8; ++j) {
          const int n = c0 + 8 * j + 2 * (lane % 4);
          if (n >= p.n) continue;
          const std::int64_t off = static_cast<std::int64_t>(m) * p.n + n;
          const float* v = &acc[i][4 * j + 2 * h];
          const bool add = res != nullptr;
          const float res0 = add ? to_float(res[off]) : 0.0f;
          const float res1 = add ? to_float(res[off + 1]) : 0.0f;
          *reinterpret_cast<std::uint32_t*>(y_row + n) =
              pack<T>(out_value<T>(v[0], r, res0, add), out_value<T>(v[1], r, res1, add));
        }
      }
    }
  }
}

// ------------------------------------------------------- transposed shape
// A stage holds two 64-wide k tiles (each: the block's weight rows, then
// x's 8 rows): each weight row's 256 contiguous bytes are asked for at once,
// and the ring's hand-overs cost half as much a byte.
template <int kWarps, int kStages>
struct Transposed {
  static constexpr int kWRows = 16 * kWarps;  // weight rows a block
  static constexpr int kWBytes = kWRows * kRowBytes;
  static constexpr int kHalfBytes = kWBytes + 8 * kRowBytes;  // + x's 8 rows
  static constexpr int kStageBytes = 2 * kHalfBytes;
  static constexpr int kSmemBytes = 1024 + kStages * kStageBytes + ring_barrier_bytes(kStages);
  static constexpr int kThreads = (kWarps + 1) * 32;
};

// Byte offset of 16-byte chunk c of row r in a 128-byte-swizzled region.
__device__ __forceinline__ std::uint32_t swizzled(int r, int c) {
  return static_cast<std::uint32_t>(r * kRowBytes + ((c ^ (r % 8)) << 4));
}

// A block: kWarps warps of 16 weight rows and a producer warp. Without silu
// its weight rows are n0 = 16 kWarps blockIdx.x.. and warp w's are 16 w..
// of them; with silu they are 8 kWarps gate rows from column c0 = 8 kWarps
// blockIdx.x, then the same columns' up rows, and warp w's 16 are gate rows
// 8 w.. over up rows 8 w.. (accumulator rows g and g + 8: one column).
template <typename T, int kWarps, int kStages>
__global__ void __launch_bounds__(Transposed<kWarps, kStages>::kThreads)
    gemm_transposed_kernel(const __grid_constant__ Params p) {
  using S = Transposed<kWarps, kStages>;
  const std::uint32_t base = smem_base();
  const Ring<kStages> ring(base + kStages * S::kStageBytes, kWarps);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Paired rows (silu: gate and up; rope: the rows of rotation pairs, j and
  // j + d/2 of a head): the block's first rows from row0, their partners
  // from row1. A block's 8 kWarps pairs lie in one half of a head.
  const int half = p.rope.head_dim / 2;
  const int pair0 = 8 * kWarps * blockIdx.x;
  const int row0 = p.rope.head_dim ? (pair0 / half) * p.rope.head_dim + pair0 % half
                   : p.inter   ? pair0
                               : S::kWRows * blockIdx.x;
  const int row1 = p.rope.head_dim ? row0 + half : p.inter + row0;
  const bool paired = p.inter || p.rope.head_dim;

  const int stages = (p.k_tiles + 1) / 2;  // of two k tiles; past K, TMA reads zeros
  if (warp == kWarps) {
    if (lane != 0) return;
    const auto load_w = [&](std::uint32_t st, int ks, std::uint32_t bar) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const std::uint32_t dst = st + h * S::kHalfBytes;
        const int k0 = (2 * ks + h) * kBK;
        tma_load_2d(dst, &p.w_map, k0, row0, bar);
        if (paired) tma_load_2d(dst + S::kWBytes / 2, &p.w_map, k0, row1, bar);
      }
    };
    const int early = min(kStages, stages);
    if (p.trigger_at_start) launch_dependents();
    for (int ks = 0; ks < early; ++ks) {
      mbarrier_expect_bytes(ring.full + 8 * ks, S::kStageBytes);
      load_w(base + ks * S::kStageBytes, ks, ring.full + 8 * ks);
    }
    grid_dependency_wait();
    for (int ks = 0; ks < stages; ++ks) {
      const int s = ks % kStages;
      const std::uint32_t st = base + s * S::kStageBytes, full = ring.full + 8 * s;
      if (ks >= early) {
        mbarrier_wait(ring.empty + 8 * s, (ks / kStages - 1) & 1);
        mbarrier_expect_bytes(full, S::kStageBytes);
        load_w(st, ks, full);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        tma_load_2d(st + h * S::kHalfBytes + S::kWBytes, &p.x_map, (2 * ks + h) * kBK, 0, full);
      }
    }
    if (!p.trigger_at_start) launch_dependents();
    return;
  }

  grid_dependency_wait();  // x (the norm's sums) and the residual
  // The residual the store adds into (o, down), read now: under the weight
  // streams an L2 round trip takes microseconds, and at the store it would
  // sit on the kernel's tail. The lane's outputs (m, n) of the m16n8
  // accumulator: rows (weight rows) n = lane / 4 and + 8 (h), columns (x
  // rows) m = 2 (lane % 4) and + 1 (e); res_in[2 h + e].
  const T* res = static_cast<const T*>(p.residual);
  float res_in[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (res != nullptr) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int m = 2 * (lane % 4) + e;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = row0 + 16 * warp + lane / 4 + 8 * h;
        if (m < p.m && n < p.n) res_in[2 * h + e] = to_float(res[static_cast<std::int64_t>(m) * p.n + n]);
      }
    }
  }
  // The folded norm's row sums, in row_sq_sum's order: the 128 threads of
  // gemm_row_scale_kernel are 4 virtual warps, shared among the kWarps. Done
  // first, from L2, while the producer's first weight stages stream in.
  __shared__ float warp_sums[8][4];
  if (p.norm_eps > 0.0f) {
    for (int m = 0; m < p.m; ++m) {
      const T* row = static_cast<const T*>(p.x) + static_cast<std::int64_t>(m) * p.k;
      for (int v = warp; v < 4; v += kWarps) {
        const float sq = row_sq_sum(row, p.k, 32 * v + lane);
        if (lane == 0) warp_sums[m][v] = sq;
      }
    }
    asm volatile("bar.sync 1, %0;" ::"n"(kWarps * 32) : "memory");  // the consumer warps
  }
  // ldmatrix addresses. A's four 8 x 8 matrices: (rows 0-7, 8-15) x (k
  // chunks 2 ks, 2 ks + 1), lane l giving row l % 8 of matrix l / 8. x's:
  // its 8 rows at chunks 4 pair .. 4 pair + 3, two k16 steps' B.
  const int a_mat_row = (lane / 8) % 2 * 8 + lane % 8;
  const int a_row = paired ? (a_mat_row / 8) * (S::kWRows / 2) + 8 * warp + a_mat_row % 8
                           : 16 * warp + a_mat_row;
  const int a_chunk = lane / 16;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int ks = 0; ks < stages; ++ks) {
    const int s = ks % kStages;
    mbarrier_wait(ring.full + 8 * s, (ks / kStages) & 1);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // A k tile past K adds no step (zeros would turn a -0 total into +0).
      if (2 * ks + half >= p.k_tiles) break;
      const std::uint32_t st = base + s * S::kStageBytes + half * S::kHalfBytes;
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        std::uint32_t bx[4];
        ldmatrix_x4(bx, st + S::kWBytes + swizzled(lane % 8, 4 * pair + lane / 8));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          std::uint32_t a[4];
          ldmatrix_x4(a, st + swizzled(a_row, 2 * (2 * pair + h) + a_chunk));
          mma_m16n8k16<T>(acc, a, bx[2 * h], bx[2 * h + 1]);
        }
      }
    }
    __syncwarp();
    if (lane == 0) mbarrier_arrive(ring.empty + 8 * s);
  }

  T* y = static_cast<T*>(p.y);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int m = 2 * (lane % 4) + e;
    if (m >= p.m) continue;
    const float r = p.norm_eps > 0.0f ? rms_scale(warp_sums[m], p.k, p.norm_eps) : 1.0f;
    if (p.rope.head_dim) {
      const int n = pair0 + 8 * warp + lane / 4;
      rope_store<T>(p.rope, y, m, n, round_to<T>(__fmul_rn(acc[e], r)),
                    round_to<T>(__fmul_rn(acc[2 + e], r)), rope_in(p.rope, m, n));
      continue;
    }
    if (p.inter) {
      const int n = row0 + 8 * warp + lane / 4;
      if (n < p.n) y[static_cast<std::int64_t>(m) * p.n + n] = silu_out<T>(acc[e], acc[2 + e], r);
      continue;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = row0 + 16 * warp + lane / 4 + 8 * h;
      const std::int64_t off = static_cast<std::int64_t>(m) * p.n + n;
      if (n < p.n) y[off] = out_value<T>(acc[2 * h + e], r, res_in[2 * h + e], res != nullptr);
    }
  }
}

// ------------------------------------------------------------------ host
template <typename T, int kMT, int kNT, int kWG>
void launch_tiled(Params p, DType dtype, cudaStream_t stream) {
  using S = Tile<kMT, kNT, kWG>;
  p.m_tiles = ceil_div(p.m, kMT);
  p.n_tiles = ceil_div(p.n_w, kNT);
  // x's maps from a bounded cache (activations move), the weights' kept.
  p.x_map = transient_tensor_map_2d(reinterpret_cast<std::uintptr_t>(p.x), p.m, p.k, dtype, kMT);
  auto kernel = gemm_tiled_kernel<T, kMT, kNT, kWG>;
  static bool opted_in = false;
  opt_in_smem(kernel, S::kSmemBytes, opted_in, "gemm_invariant: shared memory opt-in");
  const std::int64_t tiles = static_cast<std::int64_t>(p.m_tiles) * p.n_tiles;
  const int blocks = static_cast<int>(std::min<std::int64_t>(tiles, sm_count()));
  launch_programmatic(kernel, p, dim3(blocks), S::kThreads, S::kSmemBytes, stream,
                      "gemm_tiled_kernel");
}

// The transposed shape's grid: a block per 16 x warps weight rows (8 x warps
// row pairs with silu or rope).
int transposed_blocks(const Params& p, int warps) {
  return p.inter || p.rope.head_dim ? ceil_div(p.n_w / 2, 8 * warps) : ceil_div(p.n_w, 16 * warps);
}

template <typename T, int kWarps, int kStages>
void launch_transposed(const Params& p, cudaStream_t stream) {
  using S = Transposed<kWarps, kStages>;
  auto kernel = gemm_transposed_kernel<T, kWarps, kStages>;
  static bool opted_in = false;
  opt_in_smem(kernel, S::kSmemBytes, opted_in, "gemm_invariant: shared memory opt-in");
  launch_programmatic(kernel, p, dim3(transposed_blocks(p, kWarps)), S::kThreads, S::kSmemBytes,
                      stream, "gemm_transposed_kernel");
}

void check_shape(std::int64_t rows, std::int64_t n_out, std::int64_t k_in) {
  require(rows >= 1 && n_out >= 1 && k_in >= 1, "gemm_invariant: empty shape");
  require(n_out % 8 == 0 && k_in % 8 == 0, "gemm_invariant: N and K must be multiples of 8");
  require(rows < (1LL << 31) && n_out < (1LL << 31) && k_in < (1LL << 31),
          "gemm_invariant: sizes too large");
}

template <typename T>
void dispatch(Params& p, const GemmInvariantTiling& t, DType dtype, cudaStream_t stream) {
  if (t.rows == 0) {  // transposed: 2 or 4 warps (gemm_invariant_tiling)
    // o (a residual add over K <= 8192) launches its dependents at the
    // start, so that a gate/up block sits beside each of its blocks and
    // fetches its first stages meanwhile; at qkv, gate/up and down that
    // measured slower (docs/determinism.md).
    const bool o_shape = p.residual != nullptr && p.k <= 8192;
    p.trigger_at_start = o_shape && t.cols == 32;
    p.x_map = transient_tensor_map_2d(reinterpret_cast<std::uintptr_t>(p.x), p.m, p.k, dtype, 8);
    if (t.cols == 32) {
      // Two warps: gate/up a ring of 3 stages (31 KiB), so that seven blocks
      // fit an SM and its grid runs in one wave (896 blocks at Llama-3-8B);
      // down 16 stages (160 KiB, one block an SM); o 8.
      if (p.inter) return launch_transposed<T, 2, 3>(p, stream);
      if (p.residual != nullptr && !o_shape) return launch_transposed<T, 2, 16>(p, stream);
      return launch_transposed<T, 2, 8>(p, stream);
    }
    // Four warps: a ring of 8 stages (144 KiB) where the grid is one block an
    // SM or less (qkv, down at Llama-3-8B), else 6, so that two blocks fit.
    return transposed_blocks(p, 4) <= sm_count() ? launch_transposed<T, 4, 8>(p, stream)
                                                 : launch_transposed<T, 4, 6>(p, stream);
  }
  if (t.rows == 64) return launch_tiled<T, 64, 128, 1>(p, dtype, stream);
  if (t.rows == 256) return launch_tiled<T, 256, 128, 2>(p, dtype, stream);
  switch (t.cols) {  // 128 rows: a consumer warpgroup's m64 by t.cols
    case 64: return launch_tiled<T, 128, 64, 2>(p, dtype, stream);
    case 96: return launch_tiled<T, 128, 96, 2>(p, dtype, stream);
    case 128: return launch_tiled<T, 128, 128, 2>(p, dtype, stream);
    case 160: return launch_tiled<T, 128, 160, 2>(p, dtype, stream);
    case 192: return launch_tiled<T, 128, 192, 2>(p, dtype, stream);
    case 224: return launch_tiled<T, 128, 224, 2>(p, dtype, stream);
    default: return launch_tiled<T, 128, 256, 2>(p, dtype, stream);
  }
}

}  // namespace

// The tile that finishes first by a model fitted to the H100's sweep at
// Llama-3-8B shapes (docs/benchmarks/gemm_invariant_wide_tiles.md): the tiles
// run in rounds of one per SM, a round costing (K / 4096 left out, common to
// all) 0.0755 (MT + NT) + 0.94 MT NT / 1024 us -- loads plus MMAs; a one-
// warpgroup 64-row tile 10% less. No tiling beats streaming the weights once
// (~3 TB/s): below that floor the fewest MMAs win. Up to 64 rows a 128-row
// tile would be half empty, so 64 x 128. Wide tiles fill the last round:
// gate_up at 256 rows is 2 x 128 tiles of 128 x 224, where 128 x 128 runs
// 3.4 rounds. Decode rows take the transposed shape: two warps a block for
// the projections with a store of their own (o and down, which add into the
// residual; gate/up, silu_mul), four for the plain ones (qkv, the LM head),
// each with the ring dispatch() gives it (measured in the decode graph,
// docs/determinism.md).
GemmInvariantTiling gemm_invariant_tiling(std::int64_t rows, std::int64_t n_out,
                                          std::int64_t k_in, bool residual, bool silu) {
  check_shape(rows, n_out, k_in);
  if (rows <= kGemmInvariantTransposedMaxRows) return {0, residual || silu ? 32 : 64};
  if (rows <= 64) return {64, 128};
  const std::int64_t sms = sm_count();
  const double floor_us = static_cast<double>(n_out) * 2 * 4096 / 3.0e6;
  GemmInvariantTiling best{64, 128};
  double best_cost = -1.0;
  const auto consider = [&](int mt, int nt) {
    const std::int64_t tiles = (rows + mt - 1) / mt * ((n_out + nt - 1) / nt);
    const double round_us = (0.0755 * (mt + nt) + 0.94 * mt * nt / 1024) * (mt == 64 ? 0.9 : 1.0);
    const double work = static_cast<double>((tiles + sms - 1) / sms) * round_us;
    const double cost = std::max(work, floor_us) + 0.01 * work;
    if (best_cost < 0.0 || cost < best_cost) {
      best = {mt, nt};
      best_cost = cost;
    }
  };
  for (int nt = 64; nt <= 256; nt += 32) consider(128, nt);  // ties: the narrowest
  consider(64, 128);
  consider(256, 128);
  return best;
}

void gemm_invariant(std::uintptr_t y, std::uintptr_t x, std::uintptr_t w, std::int64_t rows,
                    std::int64_t n_out, std::int64_t k_in, DType dtype, std::uintptr_t stream,
                    std::uintptr_t residual, bool silu_mul,
                    float norm_eps, std::uintptr_t row_scale, GemmInvariantTiling tiling,
                    const RopeKV& rope) {
  require(dtype == DType::kF16 || dtype == DType::kBF16,
          "gemm_invariant: dtype must be float16 or bfloat16");
  check_shape(rows, n_out, k_in);
  require(x % 16 == 0 && w % 16 == 0 && y % 16 == 0,
          "gemm_invariant: x, w and y must be 16-byte aligned");
  require(residual % 16 == 0, "gemm_invariant: residual must be 16-byte aligned");
  require(!silu_mul || (n_out % 16 == 0 && residual == 0),
          "gemm_invariant: silu_mul needs N a multiple of 16 and no residual");
  require(norm_eps >= 0.0f, "gemm_invariant: norm_eps must be >= 0");
  if (tiling.rows == -1) tiling = gemm_invariant_tiling(rows, n_out, k_in, residual != 0, silu_mul);
  const bool transposed = tiling.rows == 0;
  require(!transposed || rows <= kGemmInvariantTransposedMaxRows,
          "gemm_invariant: the transposed shape takes at most " +
              std::to_string(kGemmInvariantTransposedMaxRows) + " rows");
  require(transposed ? tiling.cols == 32 || tiling.cols == 64
                     : ((tiling.rows == 64 || tiling.rows == 256) && tiling.cols == 128) ||
                           (tiling.rows == 128 && tiling.cols % 32 == 0 && tiling.cols >= 64 &&
                            tiling.cols <= 256),
          "gemm_invariant: no such tiling");
  if (rope.head_dim > 0) {
    const int pairs_a_block = 8 * (tiling.cols == 64 ? 4 : 2);
    require(transposed && !silu_mul && residual == 0,
            "gemm_invariant: the rope store is the transposed shape's, without silu or residual");
    require(rope.num_heads > 0 && rope.num_kv_heads > 0 && rope.block_size > 0 &&
                rope.head_dim % 2 == 0 && (rope.head_dim / 2) % pairs_a_block == 0 &&
                n_out == static_cast<std::int64_t>(rope.num_heads + 2 * rope.num_kv_heads) *
                             rope.head_dim,
            "gemm_invariant: rope needs N = (heads + 2 kv heads) head_dim, head_dim / 2 a "
            "multiple of " + std::to_string(pairs_a_block));
    require(rope.positions != nullptr && rope.cos_sin != nullptr && rope.slots != nullptr &&
                rope.k_cache != nullptr && rope.v_cache != nullptr,
            "gemm_invariant: rope needs positions, cos_sin, slots and both caches");
  }
  require(norm_eps == 0.0f || transposed || (row_scale != 0 && row_scale % 4 == 0),
          "gemm_invariant: the folded norm needs a float32 row_scale buffer of `rows` "
          "entries outside the transposed shape");
  Params p{};
  p.y = reinterpret_cast<void*>(y);
  p.residual = reinterpret_cast<const void*>(residual);
  p.x = reinterpret_cast<const void*>(x);
  p.m = static_cast<int>(rows);
  p.n_w = static_cast<int>(n_out);
  p.n = silu_mul ? p.n_w / 2 : p.n_w;
  p.inter = silu_mul ? p.n : 0;
  p.k = static_cast<int>(k_in);
  p.k_tiles = ceil_div(p.k, kBK);
  p.norm_eps = norm_eps;
  p.rope = rope;
  // The weights' boxes: a tile's or block's rows, halved with silu (its gate
  // rows, then its up rows).
  const int box = tiling.cols;  // transposed: 16 weight rows a warp
  // streamed once along k: L2 fetches 256 bytes a row
  const bool paired = silu_mul || rope.head_dim > 0;  // two boxes of half the rows
  p.w_map = tensor_map_2d(w, p.n_w, p.k, dtype, paired ? box / 2 : box, /*l2_256=*/true);
  cudaStream_t s = as_stream(stream);
  if (norm_eps > 0.0f && !transposed) {
    auto* scales = reinterpret_cast<float*>(row_scale);
    if (dtype == DType::kF16) {
      launch_kernel(true, gemm_row_scale_kernel<__half>, dim3(p.m), 128, 0, s,
                    "gemm_row_scale_kernel", static_cast<const __half*>(p.x), p.k, norm_eps,
                    scales);
    } else {
      launch_kernel(true, gemm_row_scale_kernel<__nv_bfloat16>, dim3(p.m), 128, 0, s,
                    "gemm_row_scale_kernel", static_cast<const __nv_bfloat16*>(p.x), p.k,
                    norm_eps, scales);
    }
    p.row_scale = scales;
  }
  if (dtype == DType::kF16) {
    dispatch<__half>(p, tiling, dtype, s);
  } else {
    dispatch<__nv_bfloat16>(p, tiling, dtype, s);
  }
}

}  // namespace cuda
}  // namespace turbomq
