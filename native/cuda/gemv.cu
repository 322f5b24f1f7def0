// gemv: y[m, n] = sum_k x[m, k] * w[n, k] for a few rows m (decode at small
// batch), i.e. F.linear(x, w) with M <= 8. Memory-bound on w: every weight is
// read once, copied by the block into a ring of shared-memory stages with
// cp.async (`L2::256B`, bypassing L1). Launched as a programmatic dependent,
// it copies its first stages while the previous kernel is still running,
// then waits for it and stages the few x rows in shared memory. A warp owns
// R = 2 output rows (kGemvRowsPerWarp) and reduces over all of K: lane l
// takes 16-byte chunks l, l + 32, ... of each row, accumulates in fp32, and
// a warp reduction finishes. Each (m, n) sums in the same order whatever M
// and R are, so a row's result does not depend on the batch it is in. At
// batch 1 the decoder layer is six launches: these fusions remove the
// norm, add and silu_mul kernels (and their launch gaps) between the
// projections.
//
// FP8 weights (E4M3, a float scale per output channel) take their own
// kernel on the tensor cores (mma.sync m16n8k32): converting 16 weights per
// 16-byte load to float on the CUDA cores costs more issue slots than the
// load itself. x is quantized per row (after the norm, if any) exactly as
// quantize_fp8 does, once per block; weights go through shared-memory
// stages (below, "FP8, staged weights"); each step's sum of 64
// products is added into fp32 registers (the tensor cores' own
// accumulation is kept that short), and the fixed-order sum is scaled by
// (x scale) * (weight scale) before the same epilogues as the 16-bit GEMV:
// fp8_linear_reference's numbers, one launch per projection.
#include <algorithm>
#include <type_traits>

#include "common.cuh"
#include "mma.cuh"
#include "rope_kv.cuh"

namespace turbomq {
namespace cuda {
namespace {

// Two 16-bit values of a 32-bit word -> float2.
template <typename T>
__device__ __forceinline__ float2 widen2(std::uint32_t u);
template <>
__device__ __forceinline__ float2 widen2<__nv_bfloat16>(std::uint32_t u) {
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}
template <>
__device__ __forceinline__ float2 widen2<__half>(std::uint32_t u) {
  return __half22float2(*reinterpret_cast<__half2*>(&u));
}

template <typename T>
__device__ __forceinline__ void widen8(const uint4& v, float* f) {
  const std::uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = widen2<T>(w[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

// What the GEMV does around the product. The prologue may RMS-normalize the
// staged x rows (the rms_norm op fused in front: every block normalizes its
// own copy, cheaper than a launch); the epilogue may add the result into y
// in place (the residual stream: y = y + x w^T, rounded as the separate add
// rounds) or pair rows c and c + N of w and write silu(x w_c) * (x w_{c+N})
// (the gate/up projection fused with silu_mul), or, for the qkv projection,
// pair rows j and j + d/2 of each head, rotate q and k and store q, and k and
// v into the paged cache (rotary_write_kv fused in, 16-bit caches).
enum class Prologue { kNone, kRmsNorm };
enum class Epilogue { kStore, kAddInto, kSiluMul, kRopeKV };

template <typename T, typename TW>
struct GemvArgs {
  T* y;
  const T* x;
  const TW* w;        // T, or E4M3 with w_scale
  const float* w_scale;  // FP8: [rows of w]
  int n_out;  // output columns (kSiluMul: w has 2 * n_out rows; kRopeKV: row pairs)
  int k_in;
  const T* norm_w;  // kRmsNorm
  float eps;
  RopeKV rope;  // kRopeKV; y is q [rows, num_heads, d]
};

// Rows j and j + d/2 of one head: the rotation pair p.
__device__ __forceinline__ int rope_row(int p, int head_dim) {
  const int half = head_dim / 2;
  return (p / half) * head_dim + p % half;
}

// Copies n 16-byte vectors from global src to shared dst with cp.async, as
// one commit group: every copy is in flight at once, so the whole copy costs
// one L2 round trip (a load loop pays one per unrolled group, and under the
// other blocks' weight streams a round trip takes microseconds). Every
// thread of the block takes part; cp_async_wait and a barrier make it visible.
template <int kThreads>
__device__ __forceinline__ void copy_async(uint4* dst, const uint4* src, int n) {
  const auto base = static_cast<std::uint32_t>(__cvta_generic_to_shared(dst));
  for (int i = threadIdx.x; i < n; i += kThreads) cp_async16(base + 16 * i, src + i, true);
  cp_async_commit();
}

// kRmsNorm: the norm weight's copy into shared memory `nws`, issued with the
// first weight loads (before grid_dependency_wait: it is a weight).
template <typename T, typename TW, int W, Prologue P>
__device__ __forceinline__ void prefetch_norm_weight(const GemvArgs<T, TW>& a, uint4* nws) {
  if constexpr (P == Prologue::kRmsNorm) {
    copy_async<W * 32>(nws, reinterpret_cast<const uint4*>(a.norm_w), a.k_in / 8);
  }
}

// Stages the M x rows in shared memory (x is read only after
// grid_dependency_wait: the previous kernel may still be writing it; cp.async
// reads through L2) and, with kRmsNorm, normalizes them in place with the
// norm weight prefetched into `nws`. Every thread of the block takes part;
// `partial` is the block's [W][M] scratch.
template <typename T, typename TW, int M, int W, Prologue P>
__device__ __forceinline__ void stage_x(const GemvArgs<T, TW>& a, uint4* xs, const uint4* nws,
                                        float (&partial)[W][M]) {
  constexpr int kThreads = W * 32;
  const int lane = threadIdx.x % 32;
  const int kxv = a.k_in / 8;  // 8-value x vectors per row
  copy_async<kThreads>(xs, reinterpret_cast<const uint4*>(a.x), M * kxv);
  cp_async_wait<0>();  // x, and the norm weight
  __syncthreads();
  if constexpr (P == Prologue::kRmsNorm) {
    // x[m] <- norm_w * to_T(x[m] * rsqrt(mean(x[m]^2) + eps)), as rms_norm.
    float ss[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      ss[m] = 0.0f;
      for (int i = threadIdx.x; i < kxv; i += kThreads) {
        float f[8];
        widen8<T>(xs[m * kxv + i], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss[m] += f[e] * f[e];
      }
      ss[m] = warp_sum(ss[m]);
      if (lane == 0) partial[threadIdx.x / 32][m] = ss[m];
    }
    __syncthreads();
    float inv[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float total = 0.0f;
#pragma unroll
      for (int i = 0; i < W; ++i) total += partial[i][m];
      inv[m] = rsqrtf(total / static_cast<float>(a.k_in) + a.eps);
    }
    for (int i = threadIdx.x; i < kxv; i += kThreads) {
      float g[8];
      widen8<T>(nws[i], g);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float f[8];
        widen8<T>(xs[m * kxv + i], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = g[e] * round_to<T>(f[e] * inv[m]);
        xs[m * kxv + i] = pack8<T>(f);
      }
    }
    __syncthreads();
  }
}

// One output (m, n) of the epilogue, from the fp32 product v and v2: for the
// paired epilogues the up row of silu_mul or the second row of rotation pair
// n; for kAddInto the residual y[m, n] as a float (the caller reads it early,
// right after grid_dependency_wait, so that the read is off the kernel's
// tail); kRopeKV takes `rin` = rope_in(a.rope, m, n).
template <typename T, typename TW, Epilogue E>
__device__ __forceinline__ void store_output(const GemvArgs<T, TW>& a, int m, int n, float v,
                                             float v2, const RopeIn& rin = RopeIn{}) {
  if constexpr (E == Epilogue::kRopeKV) {
    rope_store<T>(a.rope, a.y, m, n, round_to<T>(v), round_to<T>(v2), rin);
  } else if constexpr (E == Epilogue::kSiluMul) {
    // silu rounded to T before the product, as silu_mul.
    const float g = round_to<T>(v), u = round_to<T>(v2);
    a.y[static_cast<std::int64_t>(m) * a.n_out + n] =
        from_float<T>(round_to<T>(g / (1.0f + expf(-g))) * u);
  } else {
    T* dst = a.y + static_cast<std::int64_t>(m) * a.n_out + n;
    if constexpr (E == Epilogue::kAddInto) v = round_to<T>(v) + v2;
    *dst = from_float<T>(v);
  }
}

// kAddInto: the residual y[m, n] the epilogue adds into, as a float.
template <typename T, typename TW>
__device__ __forceinline__ float residual(const GemvArgs<T, TW>& a, int m, int n) {
  return to_float(__ldcg(a.y + static_cast<std::int64_t>(m) * a.n_out + n));
}

// Weight row of a warp's (16-bit) or tile's (FP8) r-th row pairing, for the
// output column n (clamped into range: a column past n_out is computed but
// not written): silu_mul pairs gate row n with up row n + n_out, rope pairs
// the rows of rotation pair n.
template <Epilogue E>
__device__ __forceinline__ int weight_row(int n, int second, int n_out, int head_dim) {
  n = min(n, n_out - 1);
  if constexpr (E == Epilogue::kSiluMul) {
    return n + second * n_out;
  } else if constexpr (E == Epilogue::kRopeKV) {
    return rope_row(n, head_dim) + second * (head_dim / 2);
  } else {
    return n;
  }
}

// Weight rows a warp (the paired epilogues' two rows of a pair, else two
// output columns) at every M: at one row the o and down projections (4096
// outputs) then run in one wave, every block resident and fetching from the
// start (one row a warp took 1.5-2 waves: the second wave's loads began only
// as the first wave's blocks left). Decode step 5.575 -> 5.494 ms on the
// H100 (docs/kernels.md). Row sums do not depend on it.
constexpr int kGemvRowsPerWarp = 2;

// The weights' way in: the block's rows (W warps x R rows) are copied with
// cp.async into a ring of kGemvStages stages of kGemvStageChunks 16-byte
// chunks of each row (1 KiB), every thread a share; after a stage's barrier,
// lane l of a warp reads chunks l, l + 32, ... of its rows from it. Shared
// memory: the ring ([kGemvStages][W * R][kGemvStageChunks] chunks), then x's
// rows (kSmemX), then the norm weight. It replaced 16-byte loads straight
// into registers, 16 in flight a lane, with the same sums: on the H100 the
// batch-1 decode step went from 5.475 to 5.294 ms (o 17.4 -> 10.7 µs a
// layer, down 45.1 -> 39.1; gate/up 72.6 -> 75.9, qkv 17.1 -> 20.4;
// docs/kernels.md, "Weights through shared memory").
constexpr int kGemvStageChunks = 64;
constexpr int kGemvStages = 4;
constexpr int kGemvSmemOptIn = 219 * 1024;  // the ring, x and the norm weight

template <typename T, int M, int W, bool kSmemX, Prologue P, Epilogue E>
__global__ void __launch_bounds__(W * 32) gemv_kernel(const GemvArgs<T, T> a) {
  static_assert(P == Prologue::kNone || kSmemX, "the norm prologue works on staged x");
  constexpr int R = kGemvRowsPerWarp, kRows = W * R, kC = kGemvStageChunks;
  constexpr int kStage = kRows * kC;              // chunks a stage
  constexpr int kPieces = kStage / (W * 32);      // chunks a thread copies a stage
  static_assert(kPieces * W * 32 == kStage, "whole stages");
  constexpr bool kPaired = E == Epilogue::kSiluMul || E == Epilogue::kRopeKV;
  extern __shared__ __align__(16) uint4 smem16[];
  __shared__ float partial[W][M];
  launch_dependents();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int kv = a.k_in / 8;
  constexpr int stages = kGemvStages;
  uint4* xs = smem16 + stages * kStage;
  uint4* nws = xs + (kSmemX ? M * kv : 0);
  auto row_of = [&](int j) {  // block row j: row j % R of warp j / R
    const int warp_id = blockIdx.x * W + j / R;
    const int n0 = kPaired ? warp_id : warp_id * R;
    const int row = kPaired ? weight_row<E>(n0, j % R, a.n_out, a.rope.head_dim)
                            : weight_row<E>(n0 + j % R, 0, a.n_out, a.rope.head_dim);
    return reinterpret_cast<const uint4*>(a.w) + static_cast<std::int64_t>(row) * kv;
  };
  // The copy: chunk threadIdx.x % kC of block rows threadIdx.x / kC + (W * 32 / kC) q.
  const int c_chunk = threadIdx.x % kC;
  const uint4* c_row[kPieces];
#pragma unroll
  for (int q = 0; q < kPieces; ++q) c_row[q] = row_of(threadIdx.x / kC + (W * 32 / kC) * q);
  const std::uint32_t ring = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem16));
  const int n_stages = (kv + kC - 1) / kC;
  int next_stage = 0;
  auto issue = [&](int slot) {  // one commit group, empty past the last stage
    if (next_stage < n_stages) {
      const int k = next_stage * kC + c_chunk;
#pragma unroll
      for (int q = 0; q < kPieces; ++q) {
        cp_async16_l2_256(ring + 16 * (slot * kStage + threadIdx.x + W * 32 * q),
                          c_row[q] + (k < kv ? k : 0), k < kv);
      }
    }
    ++next_stage;
    cp_async_commit();
  };
  for (int s = 0; s < stages - 1; ++s) issue(s);  // independent of the previous kernel
  prefetch_norm_weight<T, T, W, P>(a, nws);

  const int n0 = kPaired ? blockIdx.x * W + warp : (blockIdx.x * W + warp) * R;
  grid_dependency_wait();
  float resid = 0.0f;
  if constexpr (E == Epilogue::kAddInto) {
    if (lane < M * R && n0 + lane % R < a.n_out) resid = residual(a, lane / R, n0 + lane % R);
  }
  RopeIn rin{};
  if constexpr (E == Epilogue::kRopeKV) {
    if (lane < M && n0 < a.n_out) rin = rope_in(a.rope, lane, n0);
  }
  const uint4* xv = reinterpret_cast<const uint4*>(a.x);
  if constexpr (kSmemX) stage_x<T, T, M, W, P>(a, xs, nws, partial);

  float acc[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
  for (int s = 0, slot = 0; s < n_stages; ++s) {
    cp_async_wait<stages - 2>();
    __syncthreads();  // stage s landed everywhere; stage s - 1's slot is free
    issue(slot == 0 ? stages - 1 : slot - 1);
    const uint4* st = smem16 + slot * kStage + warp * R * kC;
#pragma unroll
    for (int u = 0; u < kC / 32; ++u) {
      const int k = s * kC + lane + 32 * u;
      if (k < kv) {
        float wf[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) widen8<T>(st[r * kC + lane + 32 * u], wf[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          float xf[8];
          widen8<T>(kSmemX ? xs[m * kv + k] : __ldcg(xv + m * kv + k), xf);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            float v = acc[m][r];
#pragma unroll
            for (int e = 0; e < 8; ++e) v = fmaf(xf[e], wf[r][e], v);
            acc[m][r] = v;
          }
        }
      }
    }
    slot = slot + 1 == stages ? 0 : slot + 1;
  }
  cp_async_wait<0>();
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = warp_sum(acc[m][r]);
#pragma unroll
  for (int m = 0; m < M; ++m) {
    if constexpr (kPaired) {
      if (lane == m && n0 < a.n_out) store_output<T, T, E>(a, m, n0, acc[m][0], acc[m][1], rin);
    } else {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (lane == m * R + r && n0 + r < a.n_out) store_output<T, T, E>(a, m, n0 + r, acc[m][r], resid);
      }
    }
  }
}

// ------------------------------------------------------------ FP8 weights
using Fp8 = __nv_fp8_e4m3;
// d = A (16 x 32 E4M3, row-major) * B (32 x 8 E4M3, column-major) + c, fp32.
__device__ __forceinline__ void mma_e4m3(float (&d)[4], std::uint32_t a0, std::uint32_t a1,
                                         std::uint32_t a2, std::uint32_t a3, std::uint32_t b0,
                                         std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Dynamic shared memory (the static part, x's partials, stays under sm_90's 227 KiB).
constexpr int kFp8SmemBytes = 219 * 1024;

// Bytes of x's E4M3 copy per row in shared memory: K rounded up to 128, plus
// 64, so that lanes reading x rows m and m + 1 hit different banks.
__host__ __device__ __forceinline__ int fp8_x_pitch(int k_in) { return (k_in + 127) / 128 * 128 + 64; }

// x rows staged in `xs` (where `staged`; always with kRmsNorm, which
// normalizes them there, as stage_x) and quantized per row into `xq` (rows
// fp8_x_pitch bytes apart), exactly as quantize_fp8; every thread of the
// block takes part and gets the scales.
template <typename T, int M, int W, Prologue P>
__device__ __forceinline__ void quantize_x(const GemvArgs<T, Fp8>& a, bool staged, uint4* xs,
                                           const uint4* nws, std::uint8_t* xq,
                                           float (&partial)[W][M], float (&scale)[M]) {
  constexpr int kThreads = W * 32;
  const int lane = threadIdx.x % 32;
  const int kxv = a.k_in / 8;
  staged = staged || P == Prologue::kRmsNorm;
  if (staged) stage_x<T, Fp8, M, W, P>(a, xs, nws, partial);
  const uint4* src = staged ? xs : reinterpret_cast<const uint4*>(a.x);
  auto value = [&](int i) { return staged ? src[i] : __ldcg(src + i); };
  uint2* q = reinterpret_cast<uint2*>(xq);
  const int pitch = fp8_x_pitch(a.k_in) / 8;  // in 8-byte E4M3 groups
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float amax = 0.0f;
    for (int i = threadIdx.x; i < kxv; i += kThreads) {
      float f[8];
      widen8<T>(value(m * kxv + i), f);
#pragma unroll
      for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(f[e]));
    }
    amax = warp_max(amax);
    if (lane == 0) partial[threadIdx.x / 32][m] = amax;
  }
  __syncthreads();
  float inv[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < W; ++i) amax = fmaxf(amax, partial[i][m]);
    scale[m] = fp8_scale(amax);
    inv[m] = __frcp_rn(scale[m]);
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    for (int i = threadIdx.x; i < kxv; i += kThreads) {
      float f[8];
      widen8<T>(value(m * kxv + i), f);
      q[m * pitch + i] = fp8_pack8(f, inv[m]);
    }
  }
  __syncthreads();
}

// ------------------------------------------------------ FP8, staged weights
// The block copies its weights into a ring of shared-memory stages with
// cp.async (every thread a share, `L2::256B`), and each warp reads its mma A
// fragments from there; every piece a lane reads covers whole 128-byte lines:
// the mma's 16 A rows are 8 weight rows times two 64-byte K segments, and its
// 8 B columns are x's rows (at most 4) times the same two segments. Lane
// (g, t) takes bytes [16 t, 16 t + 16) of segment g % 2 of weight row g / 2
// (and of row 4 + g / 2). Of each 16 x 8 product only the entries whose row
// and column segments agree are sums of the GEMV; the two segments are added
// in order at the end. A tile is 8 weight rows (8 output columns, or 4 row
// pairs for silu_mul and rope) over all of K in 128-byte steps; a block takes
// a contiguous range of tiles and its warps take steps warp, warp + W, ... of
// each, so x is normalized and quantized once per block and a tile's sum is
// the same whatever the block, the grid and the number of x rows: per warp,
// steps in order (each the tensor cores' sum of 64 products added into
// fp32), then the segments, then the warps in order. A stage holds two of
// each warp's steps (16 KiB), so a barrier a stage serves 16 mma pairs.
// Measured on the H100 (docs/kernels.md, "FP8 activations"): the same reads
// as 16-byte loads into a register ring a lane streamed at 2.45 TB/s on the
// gate/up shape, through the block's cp.async stages at 2.9
// (benchmarks/gpu_stream_patterns.py).
constexpr int kFp8Warps = 8;
constexpr int kFp8StageBytes = 2 * kFp8Warps * 1024;  // two 8-row x 128-byte steps a warp
// The ring's most stages (fp8_layout). Three beat four on the H100 by a
// little (docs/kernels.md): the next projection's blocks find room sooner.
constexpr int kFp8MaxStages = 3;
constexpr int kFp8MaxTiles = 32;  // tiles per block (their partial sums stay in shared memory)

// Shared memory past which two FP8 GEMV blocks no longer fit an SM (228 KiB,
// 1 KiB reserved a block, the static partials).
constexpr int kFp8TwoBlockSmemBytes = 112 * 1024;

// The FP8 GEMV's dynamic shared memory, byte offsets in order: a ring of
// `stages` weight stages; the tiles' weight-row table ([kFp8MaxTiles + 1][8]
// int64); x's E4M3 rows and a row of zeros (the B columns past M); x staged
// in 16 bits; the norm weight (kRmsNorm); the warps' sums per tile. x is
// staged always with the norm, otherwise where two blocks with a ring of two
// stages still fit an SM (else quantize_x reads x from L2 twice); the ring's
// depth is fp8_layout's.
struct Fp8Smem {
  int table, x_q, x_16, norm_w, sums, bytes, stages;
  bool staged;
};
__host__ __device__ __forceinline__ Fp8Smem fp8_smem(int m, int k_in, int t_bytes, bool norm,
                                                     int tiles_per_block, int warps, int stages) {
  const int table_bytes = (kFp8MaxTiles + 1) * 8 * static_cast<int>(sizeof(std::int64_t));
  const int x_q_bytes = (m + 1) * fp8_x_pitch(k_in), x_bytes = m * k_in * t_bytes;
  const int norm_bytes = norm ? k_in * t_bytes : 0;
  const int sums_bytes = tiles_per_block * warps * 32 * static_cast<int>(sizeof(float));
  Fp8Smem l{};
  l.staged = norm || table_bytes + x_q_bytes + x_bytes + norm_bytes + sums_bytes +
                             2 * kFp8StageBytes <= kFp8TwoBlockSmemBytes;
  l.stages = stages;
  l.table = stages * kFp8StageBytes;
  l.x_q = l.table + table_bytes;
  l.x_16 = l.x_q + x_q_bytes;
  l.norm_w = l.x_16 + (l.staged ? x_bytes : 0);
  l.sums = l.norm_w + norm_bytes;
  l.bytes = l.sums + sums_bytes;
  return l;
}

// The ring's depth: kFp8MaxStages where two blocks an SM still fit, else
// fewer, at least two. The host (launch) and the kernel both take it from here.
__host__ __device__ __forceinline__ Fp8Smem fp8_layout(int m, int k_in, int t_bytes, bool norm,
                                                       int tiles_per_block, int warps) {
  int stages = kFp8MaxStages;
  while (stages > 2 && fp8_smem(m, k_in, t_bytes, norm, tiles_per_block, warps, stages).bytes >
                           kFp8TwoBlockSmemBytes) {
    --stages;
  }
  return fp8_smem(m, k_in, t_bytes, norm, tiles_per_block, warps, stages);
}

template <typename T, int M, Prologue P, Epilogue E>
__global__ void __launch_bounds__(kFp8Warps * 32) gemv_fp8_kernel(const GemvArgs<T, Fp8> a) {
  static_assert(M <= 4, "x rows times two segments are the mma's 8 columns");
  constexpr int W = kFp8Warps;
  constexpr bool kPaired = E == Epilogue::kSiluMul || E == Epilogue::kRopeKV;
  constexpr int kCols = kPaired ? 4 : 8;  // output columns per tile
  constexpr int kStride = 128 * W;        // bytes from a warp's step to its next
  static_assert(kFp8StageBytes == 2 * W * 1024, "a stage: two 1 KiB steps a warp");
  extern __shared__ __align__(128) std::uint8_t smem[];
  __shared__ float partial[W][M];
  launch_dependents();
  const int x_pitch = fp8_x_pitch(a.k_in);
  const int tiles = (a.n_out + kCols - 1) / kCols;
  const Fp8Smem layout = fp8_layout(M, a.k_in, sizeof(T), P == Prologue::kRmsNorm,
                                    (tiles + gridDim.x - 1) / gridDim.x, W);
  auto* row_at = reinterpret_cast<std::int64_t*>(smem + layout.table);
  std::uint8_t* xq = smem + layout.x_q;
  uint4* xs = reinterpret_cast<uint4*>(smem + layout.x_16);
  uint4* nws = reinterpret_cast<uint4*>(smem + layout.norm_w);
  float* sums = reinterpret_cast<float*>(smem + layout.sums);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int hd = a.rope.head_dim;
  const int t_begin = static_cast<int>(static_cast<std::int64_t>(blockIdx.x) * tiles / gridDim.x);
  const int n_tiles =
      static_cast<int>(static_cast<std::int64_t>(blockIdx.x + 1) * tiles / gridDim.x) - t_begin;
  for (int i = threadIdx.x; i < (n_tiles + 1) * 8; i += W * 32) {
    const int tile = t_begin + i / 8, r = i % 8;
    const int row = i >= n_tiles * 8 ? 0
                    : kPaired        ? weight_row<E>(tile * kCols + r % 4, r / 4, a.n_out, hd)
                                     : weight_row<E>(tile * kCols + r, 0, a.n_out, hd);
    row_at[i] = static_cast<std::int64_t>(row) * a.k_in;
  }
  for (int i = threadIdx.x; i < x_pitch / 16; i += W * 32) {
    reinterpret_cast<uint4*>(xq + M * x_pitch)[i] = make_uint4(0, 0, 0, 0);
  }
  __syncthreads();
  const int steps = a.k_in / 128;
  auto mine_of = [&](int wi) { return steps > wi ? (steps - wi + W - 1) / W : 0; };
  const int mine = mine_of(warp);  // this warp's steps a tile
  const int items = n_tiles * mine;
  const int n_stages = (n_tiles * mine_of(0) + 1) / 2;  // warp 0 has the most steps
  const int g = lane / 4, t = lane % 4;
  // The copy: piece i = threadIdx.x + 256 q (q < 4) of a stage is 16 bytes of
  // warp i / 128's step (i / 64) % 2 of the stage, tile row (i % 64) / 8,
  // bytes 16 (i % 8) of the step's 128; a step is 1 KiB in shared memory, its
  // 8 rows of 128 bytes in order. Each q's warp walks its items (tile, step)
  // two at a time.
  const std::uint32_t ring = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
  const int c_u = threadIdx.x / 64 % 2, c_row = threadIdx.x % 64 / 8;
  const std::uint8_t* c_w = reinterpret_cast<const std::uint8_t*>(a.w) + 16 * (threadIdx.x % 8);
  int c_tile[4], c_k[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int m = mine_of(threadIdx.x / 128 + 2 * q);
    c_tile[q] = m > 0 ? c_u / m : n_tiles;  // a warp past K's steps copies nothing
    c_k[q] = m > 0 ? c_u % m : 0;
  }
  auto issue = [&](int slot) {  // the next stage: one commit group, empty past the last
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int wi = threadIdx.x / 128 + 2 * q, m = mine_of(wi);
      if (c_tile[q] < n_tiles) {
        cp_async16_l2_256(ring + slot * kFp8StageBytes + 16 * (threadIdx.x + 256 * q),
                          c_w + row_at[c_tile[q] * 8 + c_row] + 128 * (wi + W * c_k[q]), true);
        c_k[q] += 2;
        while (c_k[q] >= m) {
          c_k[q] -= m;
          ++c_tile[q];
        }
      }
    }
    cp_async_commit();
  };
  for (int s = 0; s < layout.stages - 1; ++s) issue(s);  // independent of the previous kernel

  prefetch_norm_weight<T, Fp8, W, P>(a, nws);
  // The epilogue's first output of this thread (i = threadIdx.x: tile
  // i / kPer, column i % kPer / M, x row i % M): its weight scales are read
  // now, with the weights, and its residual (kAddInto) right after
  // grid_dependency_wait, so that neither round trip is on the kernel's tail.
  constexpr int kPer = kCols * M;
  auto out_col = [&](int i) { return (t_begin + i / kPer) * kCols + i % kPer / M; };
  auto w_scale_of = [&](int i, int second) {
    return __ldg(a.w_scale + weight_row<E>(out_col(i), second, a.n_out, hd));
  };
  const bool first_out = threadIdx.x < n_tiles * kPer && out_col(threadIdx.x) < a.n_out;
  float first_scale[2] = {0.0f, 0.0f};
  if (first_out) {
    first_scale[0] = w_scale_of(threadIdx.x, 0);
    if constexpr (kPaired) first_scale[1] = w_scale_of(threadIdx.x, 1);
  }

  grid_dependency_wait();
  float first_resid = 0.0f;
  RopeIn first_rope{};
  if (first_out) {
    if constexpr (E == Epilogue::kAddInto) first_resid = residual(a, threadIdx.x % M, out_col(threadIdx.x));
    if constexpr (E == Epilogue::kRopeKV) first_rope = rope_in(a.rope, threadIdx.x % M, out_col(threadIdx.x));
  }
  float sx[M];
  quantize_x<T, M, W, P>(a, layout.staged, xs, nws, xq, partial, sx);

  // This lane's B column g: segment g / 4 of x row g % 4 (the zero row past M).
  const std::uint8_t* x_first =
      xq + min(g % 4, M) * x_pitch + 64 * (g / 4) + 16 * t + 128 * warp;
  const std::uint8_t* xk = x_first;
  float* out = sums + warp * 32;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int c_step = 0, item = 0;
  // A lane's A pieces within a step: rows g / 2 and 4 + g / 2, segment g % 2.
  const int a_off = (g / 2) * 128 + 64 * (g % 2) + 16 * t;
  for (int s = 0, slot = 0; s < n_stages; ++s) {
    static_assert(kFp8MaxStages <= 3, "one wait for each ring depth");
    if (layout.stages == 3) {
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // stage s landed everywhere; stage s - 1's slot is free
    const int next = slot == 0 ? layout.stages - 1 : slot - 1;
    issue(next);  // stage s + stages - 1
    const std::uint8_t* st = smem + slot * kFp8StageBytes + warp * 2048 + a_off;
#pragma unroll
    for (int u = 0; u < 2; ++u, ++item) {
      if (item < items) {  // the same for the whole warp
        const uint4 va = *reinterpret_cast<const uint4*>(st + 1024 * u);
        const uint4 vb = *reinterpret_cast<const uint4*>(st + 1024 * u + 512);
        const uint4 b = *reinterpret_cast<const uint4*>(xk);
        xk += kStride;
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma_e4m3(d, va.x, vb.x, va.y, vb.y, b.x, b.y);
        mma_e4m3(d, va.z, vb.z, va.w, vb.w, b.z, b.w);
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[j] += d[j];
        if (++c_step == mine) {
          // The tile's end: lane 8 r + h (h < 2) adds segment 1 (lane + 6) to
          // segment 0 for tile rows r and 4 + r, x rows 2 h and 2 h + 1.
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const float v = acc[j] + __shfl_down_sync(0xffffffffu, acc[j], 6);
            if (lane % 8 < 2) out[(lane / 8 + 4 * (j / 2)) * 4 + 2 * (lane % 8) + j % 2] = v;
            acc[j] = 0.0f;
          }
          out += W * 32;
          xk = x_first;
          c_step = 0;
        }
      }
    }
    slot = slot + 1 == layout.stages ? 0 : slot + 1;
  }
  cp_async_wait<0>();
  __syncthreads();
  // The epilogue: a thread per (tile, column, x row) adds the warps' sums in order.
  const int warps = min(W, steps);
  for (int i = threadIdx.x; i < n_tiles * kPer; i += W * 32) {
    const int tl = i / kPer, c = i % kPer / M, m = i % M;
    const int col = out_col(i);
    if (col >= a.n_out) continue;
    const bool first = i == threadIdx.x;
    auto total = [&](int r) {
      float v = 0.0f;
      for (int wi = 0; wi < warps; ++wi) v += sums[(tl * W + wi) * 32 + r * 4 + m];
      return v;
    };
    const float lo = total(c) * sx[m] * (first ? first_scale[0] : w_scale_of(i, 0));
    float hi = 0.0f;
    if constexpr (kPaired) hi = total(c + 4) * sx[m] * (first ? first_scale[1] : w_scale_of(i, 1));
    if constexpr (E == Epilogue::kAddInto) hi = first ? first_resid : residual(a, m, col);
    RopeIn rin{};
    if constexpr (E == Epilogue::kRopeKV) rin = first ? first_rope : rope_in(a.rope, m, col);
    store_output<T, Fp8, E>(a, m, col, lo, hi, rin);
  }
}

bool g_programmatic_launch = true;

// Launches `kernel` as a programmatic dependent (where on) with `smem` bytes
// of dynamic shared memory; the first launch opts the kernel in to
// `max_smem` (past 48 KiB, static shared memory included, a launch needs it).
template <typename K, typename A>
void launch(K kernel, const A& a, int blocks, int threads, std::size_t smem, std::size_t max_smem,
            bool& opted_in, cudaStream_t s, const char* name) {
  opt_in_smem(kernel, max_smem, opted_in, "gemv: shared memory opt-in");
  launch_programmatic(kernel, a, dim3(blocks), threads, smem, s, name);
}

template <typename T, int M, int W, bool kSmemX, Prologue P, Epilogue E>
void launch_gemv_x(const GemvArgs<T, T>& a, cudaStream_t s) {
  constexpr bool kPaired = E == Epilogue::kSiluMul || E == Epilogue::kRopeKV;
  constexpr int kColsPerWarp = kPaired ? 1 : kGemvRowsPerWarp;
  static bool opted_in = false;  // one instantiation, one attribute call
  // x's rows, then (kRmsNorm) the norm weight.
  const int x_rows = M + (P == Prologue::kRmsNorm ? 1 : 0);
  const std::size_t smem = kSmemX ? static_cast<std::size_t>(x_rows) * a.k_in * sizeof(T) : 0;
  const int warps = (a.n_out + kColsPerWarp - 1) / kColsPerWarp;
  const std::size_t ring =
      static_cast<std::size_t>(kGemvStages) * W * kGemvRowsPerWarp * kGemvStageChunks * 16;
  launch(gemv_kernel<T, M, W, kSmemX, P, E>, a, (warps + W - 1) / W, W * 32, ring + smem,
         kGemvSmemOptIn, opted_in, s, "gemv_kernel");
}

// Two blocks an SM (the ring's depth is chosen so that their shared memory
// fits), more where a block would take over kFp8MaxTiles tiles.
template <typename T, int M, Prologue P, Epilogue E>
void launch_gemv_fp8(const GemvArgs<T, Fp8>& a, cudaStream_t s) {
  constexpr int kCols = (E == Epilogue::kSiluMul || E == Epilogue::kRopeKV) ? 4 : 8;
  static bool opted_in = false;
  const int tiles = (a.n_out + kCols - 1) / kCols;
  const int blocks =
      std::min(tiles, std::max(2 * sm_count(), (tiles + kFp8MaxTiles - 1) / kFp8MaxTiles));
  const int per_block = (tiles + blocks - 1) / blocks;
  const std::size_t smem =
      fp8_layout(M, a.k_in, sizeof(T), P == Prologue::kRmsNorm, per_block, kFp8Warps).bytes;
  launch(gemv_fp8_kernel<T, M, P, E>, a, blocks, kFp8Warps * 32, smem, kFp8SmemBytes, opted_in,
         s, "gemv_fp8_kernel");
}

// Long rows (the down projection's K = 14336) take 8 warps a block, so one
// staged copy of x serves twice the rows and the grid fits in one wave.
// FP8 weights take their own kernel.
template <typename T, typename TW, int M, Prologue P, Epilogue E>
void launch_gemv(const GemvArgs<T, TW>& a, cudaStream_t s) {
  if constexpr (std::is_same_v<TW, Fp8>) {
    // x's E4M3 rows and the zero row, and with the norm x's 16-bit rows and the norm weight.
    require(static_cast<std::int64_t>(M + 1) * a.k_in *
                    (P == Prologue::kRmsNorm ? 1 + sizeof(T) : 1) <= kGemvFp8XBytes,
            "gemv: FP8 weights need (rows + 1) * K (* 3 with the norm) <= " +
                std::to_string(kGemvFp8XBytes) + " bytes");
    return launch_gemv_fp8<T, M, P, E>(a, s);
  } else {
    const bool smem_x = static_cast<std::int64_t>(M) * a.k_in * sizeof(T) <= kGemvSmemBytes;
    if constexpr (P == Prologue::kNone) {
      if (!smem_x) return launch_gemv_x<T, M, 4, false, P, E>(a, s);
    }
    require(smem_x, "gemv: the fused norm needs rows * K * 2 <= " +
                        std::to_string(kGemvSmemBytes) + " bytes");
    if (a.k_in > 8192) return launch_gemv_x<T, M, 8, true, P, E>(a, s);
    launch_gemv_x<T, M, 4, true, P, E>(a, s);
  }
}

// The fused forms, and FP8 weights, serve decode at batch 1-4 only (fewer
// instantiations).
template <typename T, typename TW, Prologue P, Epilogue E>
void dispatch_rows(const GemvArgs<T, TW>& a, int m, cudaStream_t s) {
  constexpr bool kPlain =
      P == Prologue::kNone && E == Epilogue::kStore && !std::is_same_v<TW, __nv_fp8_e4m3>;
  require(kPlain || m <= kGemvMaxFusedRows,
          "gemv: fused forms and FP8 weights take at most 4 rows");
  switch (m) {
    case 1: return launch_gemv<T, TW, 1, P, E>(a, s);
    case 2: return launch_gemv<T, TW, 2, P, E>(a, s);
    case 3: return launch_gemv<T, TW, 3, P, E>(a, s);
    case 4: return launch_gemv<T, TW, 4, P, E>(a, s);
  }
  if constexpr (kPlain) {
    switch (m) {
      case 5: return launch_gemv<T, TW, 5, P, E>(a, s);
      case 6: return launch_gemv<T, TW, 6, P, E>(a, s);
      case 7: return launch_gemv<T, TW, 7, P, E>(a, s);
      default: return launch_gemv<T, TW, 8, P, E>(a, s);
    }
  }
}

template <typename T, typename TW, Prologue P>
void dispatch_epilogue(const GemvArgs<T, TW>& a, int m, GemvEpilogue epilogue, cudaStream_t s) {
  switch (epilogue) {
    case GemvEpilogue::kStore: return dispatch_rows<T, TW, P, Epilogue::kStore>(a, m, s);
    case GemvEpilogue::kAddInto: return dispatch_rows<T, TW, P, Epilogue::kAddInto>(a, m, s);
    case GemvEpilogue::kSiluMul: return dispatch_rows<T, TW, P, Epilogue::kSiluMul>(a, m, s);
  }
}

template <typename T, typename TW>
void dispatch_gemv(const GemvArgs<T, TW>& a, int m, bool norm, GemvEpilogue epilogue,
                   cudaStream_t s) {
  if (norm) {
    dispatch_epilogue<T, TW, Prologue::kRmsNorm>(a, m, epilogue, s);
  } else {
    dispatch_epilogue<T, TW, Prologue::kNone>(a, m, epilogue, s);
  }
}

}  // namespace

void set_programmatic_launch(bool on) { g_programmatic_launch = on; }
bool programmatic_launch() { return g_programmatic_launch; }
namespace {

void check_gemv_args(std::uintptr_t x, std::uintptr_t w, std::int64_t rows, std::int64_t n_out,
                     std::int64_t k_in, DType dtype, std::uintptr_t norm_weight,
                     std::uintptr_t w_scale) {
  require(dtype == DType::kF16 || dtype == DType::kBF16, "gemv: dtype must be float16 or bfloat16");
  require(rows >= 1 && rows <= kGemvMaxRows, "gemv: rows must be 1..8");
  require(k_in > 0 && k_in % 8 == 0 && n_out > 0, "gemv: K must be a positive multiple of 8");
  require(w_scale == 0 || k_in % 128 == 0, "gemv: FP8 weights need K a multiple of 128");
  require(x % 16 == 0 && w % 16 == 0 && norm_weight % 16 == 0 && w_scale % 4 == 0,
          "gemv: x, w and the norm weight must be 16-byte aligned, the scales 4-byte");
  require(n_out < (1LL << 30) && k_in < (1LL << 31), "gemv: sizes too large");
}

// Builds the arguments for T (and FP8 weights where w_scale != 0) and runs f(args).
template <typename F>
void with_gemv_args(DType dtype, std::uintptr_t y, std::uintptr_t x, std::uintptr_t w,
                    std::uintptr_t w_scale, std::int64_t n_out, std::int64_t k_in,
                    std::uintptr_t norm_weight, float eps, const RopeKV& rope, F&& f) {
  auto run = [&](auto tag, auto weight_tag) {
    using T = decltype(tag);
    using TW = decltype(weight_tag);
    f(GemvArgs<T, TW>{reinterpret_cast<T*>(y), reinterpret_cast<const T*>(x),
                      reinterpret_cast<const TW*>(w), reinterpret_cast<const float*>(w_scale),
                      static_cast<int>(n_out), static_cast<int>(k_in),
                      reinterpret_cast<const T*>(norm_weight), eps, rope});
  };
  if (dtype == DType::kF16) {
    if (w_scale != 0) return run(__half{}, __nv_fp8_e4m3{});
    run(__half{}, __half{});
  } else {
    if (w_scale != 0) return run(__nv_bfloat16{}, __nv_fp8_e4m3{});
    run(__nv_bfloat16{}, __nv_bfloat16{});
  }
}

}  // namespace

void gemv(std::uintptr_t y, std::uintptr_t x, std::uintptr_t w, std::int64_t rows,
          std::int64_t n_out, std::int64_t k_in, DType dtype, std::uintptr_t stream,
          std::uintptr_t norm_weight, float eps, GemvEpilogue epilogue, std::uintptr_t w_scale) {
  check_gemv_args(x, w, rows, n_out, k_in, dtype, norm_weight, w_scale);
  with_gemv_args(dtype, y, x, w, w_scale, n_out, k_in, norm_weight, eps, RopeKV{},
                 [&](const auto& a) {
                   dispatch_gemv(a, static_cast<int>(rows), norm_weight != 0, epilogue,
                                 as_stream(stream));
                 });
}

void gemv_qkv_rope(std::uintptr_t q_out, std::uintptr_t x, std::uintptr_t w, std::int64_t rows,
                   std::int64_t k_in, std::uintptr_t norm_weight, float eps,
                   std::uintptr_t positions, std::uintptr_t cos_sin, std::uintptr_t slot_mapping,
                   std::uintptr_t k_cache, std::uintptr_t v_cache, int num_heads,
                   int num_kv_heads, int head_dim, int block_size, DType dtype,
                   std::uintptr_t stream, std::uintptr_t w_scale) {
  require(norm_weight != 0, "gemv_qkv_rope: takes the norm weight");
  require(rows <= kGemvMaxFusedRows, "gemv_qkv_rope: at most 4 rows");
  require(head_dim % 2 == 0 && block_size > 0, "gemv_qkv_rope: bad head_dim or block_size");
  const std::int64_t pairs = static_cast<std::int64_t>(num_heads + 2 * num_kv_heads) * head_dim / 2;
  check_gemv_args(x, w, rows, pairs, k_in, dtype, norm_weight, w_scale);
  const RopeKV rope{reinterpret_cast<const std::int64_t*>(positions),
                    reinterpret_cast<const float*>(cos_sin),
                    reinterpret_cast<const std::int64_t*>(slot_mapping),
                    reinterpret_cast<void*>(k_cache), reinterpret_cast<void*>(v_cache),
                    num_heads, num_kv_heads, head_dim, block_size};
  with_gemv_args(dtype, q_out, x, w, w_scale, pairs, k_in, norm_weight, eps, rope,
                 [&](const auto& a) {
                   using T = std::remove_const_t<std::remove_pointer_t<decltype(a.x)>>;
                   using TW = std::remove_const_t<std::remove_pointer_t<decltype(a.w)>>;
                   dispatch_rows<T, TW, Prologue::kRmsNorm, Epilogue::kRopeKV>(
                       a, static_cast<int>(rows), as_stream(stream));
                 });
}

}  // namespace cuda
}  // namespace turbomq
