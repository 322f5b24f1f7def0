// gemv: y[m, n] = sum_k x[m, k] * w[n, k] for a few rows m (decode at small
// batch), i.e. F.linear(x, w) with M <= 8. Memory-bound on w: every weight is
// read once with 16-byte streaming loads (no L1 allocation), 16 loads in
// flight per lane. Launched as a programmatic dependent, it issues its first
// weight loads while the previous kernel is still running, then waits for it
// and stages the few x rows in shared memory. A warp owns R output rows
// and reduces over all of K: lane l takes 16-byte chunks l, l + 32, ... of
// each row (512 contiguous bytes per warp load), accumulates in fp32, and a
// warp reduction finishes. Each (m, n) sums in the same order whatever M and
// R are, so a row's result does not depend on the batch it is in. At batch 1
// the decoder layer is six launches: these fusions remove the norm, add and
// silu_mul kernels (and their launch gaps) between the projections.
//
// FP8 weights (E4M3, a float scale per output channel) take the same kernel
// with 16 weights per 16-byte load, half the bytes of 16-bit weights. The
// staged x rows are quantized per row in the prologue (after the norm, if
// any) exactly as quantize_fp8 does, so each product is the reference's
// q_x * q_w, summed in fp32 and scaled by (x scale) * (weight scale) before
// the epilogue: fp8_linear_reference's numbers, one launch per projection.
#include <type_traits>

#include "common.cuh"

namespace turbomq {
namespace cuda {
namespace {

constexpr int kInFlight = 16;  // 16-byte weight loads in flight per lane

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

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

// 16 E4M3 values -> float.
__device__ __forceinline__ void widen16_fp8(const uint4& v, float* f) {
  const std::uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
          static_cast<__nv_fp8x2_storage_t>(w[i] >> (16 * j)), __NV_E4M3);
      const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&h));
      f[4 * i + 2 * j] = p.x;
      f[4 * i + 2 * j + 1] = p.y;
    }
  }
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

// A 16-byte chunk of weights -> its 8 (16-bit) or 16 (FP8) values.
template <typename TW>
__device__ __forceinline__ void widen_weights(const uint4& v, float* f) {
  if constexpr (std::is_same_v<TW, __nv_fp8_e4m3>) {
    widen16_fp8(v, f);
  } else {
    widen8<TW>(v, f);
  }
}

// Loads chunk `base + 32 u` of each of the R rows (zero past the row).
template <int kU, int R>
__device__ __forceinline__ void load_weights(uint4 (&wv)[kU][R], const uint4* const (&wr)[R], int base,
                                             int kv) {
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    const int k = base + 32 * u;
#pragma unroll
    for (int r = 0; r < R; ++r) wv[u][r] = k < kv ? load_stream(wr[r] + k) : make_uint4(0, 0, 0, 0);
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

// kRopeKV: where the rotated heads go.
struct RopeKV {
  const std::int64_t* positions;  // [rows]
  const float* cos_sin;           // [max_pos, d] = cat(cos, sin)
  const std::int64_t* slots;      // [rows]; negative: not stored
  void* k_cache;                  // [blocks, nkv, block_size, d]
  void* v_cache;
  int num_heads, num_kv_heads, head_dim, block_size;
};

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

// x is read only after grid_dependency_wait (the previous kernel may still be
// writing it when this one starts): through L2 (__ldcg), staged once per
// block in shared memory when it fits (kSmemX), else per use.
template <typename T, typename TW, int M, int R, int W, bool kSmemX, Prologue P, Epilogue E>
__global__ void __launch_bounds__(W * 32) gemv_kernel(const GemvArgs<T, TW> a) {
  constexpr bool kFp8 = std::is_same_v<TW, __nv_fp8_e4m3>;
  static_assert(P == Prologue::kNone || kSmemX, "the norm prologue works on staged x");
  static_assert(!kFp8 || kSmemX, "FP8 quantizes the staged x");
  constexpr int kE = 16 / sizeof(TW);  // weights per 16-byte chunk
  constexpr int kXv = kE / 8;          // x vectors (8 values) per chunk
  static_assert((E != Epilogue::kSiluMul && E != Epilogue::kRopeKV) || R == 2,
                "silu_mul and rope pair two rows per warp");
  constexpr bool kPaired = E == Epilogue::kSiluMul || E == Epilogue::kRopeKV;
  constexpr int kThreads = W * 32;
  constexpr int kU = kInFlight / R;  // chunks per row per iteration
  extern __shared__ uint4 xs[];      // [M][kv] with kSmemX
  __shared__ float partial[W][M];    // kRmsNorm: per-warp sums of squares
  launch_dependents();               // a following GEMV may start fetching its weights
  const int lane = threadIdx.x % 32;
  const int warp_id = blockIdx.x * W + threadIdx.x / 32;
  // First output column of this warp (may be past n_out: no writes) and its weight rows.
  const int n0 = kPaired ? warp_id : warp_id * R;
  const int kv = a.k_in / kE;  // 16-byte weight chunks per row
  const int kxv = a.k_in / 8;  // 8-value x vectors per row
  const uint4* wr[R];
  float ws[R];  // FP8: the rows' scales
#pragma unroll
  for (int r = 0; r < R; ++r) {
    int row;
    if constexpr (E == Epilogue::kSiluMul) {
      row = min(n0, a.n_out - 1) + r * a.n_out;
    } else if constexpr (E == Epilogue::kRopeKV) {
      row = rope_row(min(n0, a.n_out - 1), a.rope.head_dim) + r * (a.rope.head_dim / 2);
    } else {
      row = min(n0 + r, a.n_out - 1);
    }
    wr[r] = reinterpret_cast<const uint4*>(a.w) + static_cast<std::int64_t>(row) * kv;
    ws[r] = kFp8 ? __ldg(a.w_scale + row) : 1.0f;
  }
  uint4 wv[kU][R];
  int base = lane;
  load_weights<kU, R>(wv, wr, base, kv);  // independent of the previous kernel

  grid_dependency_wait();
  const uint4* xv = reinterpret_cast<const uint4*>(a.x);
  if constexpr (kSmemX) {
    for (int i = threadIdx.x; i < M * kxv; i += kThreads) xs[i] = __ldcg(xv + i);
    __syncthreads();
  }
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
    const uint4* nw = reinterpret_cast<const uint4*>(a.norm_w);
    for (int i = threadIdx.x; i < kxv; i += kThreads) {
      float g[8];
      widen8<T>(__ldg(nw + i), g);
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

  float sx[M];  // FP8: each row's scale
  if constexpr (kFp8) {
    // x[m] <- e4m3(x[m] / scale[m]) (held exactly in T), as quantize_fp8.
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float amax = 0.0f;
      for (int i = threadIdx.x; i < kxv; i += kThreads) {
        float f[8];
        widen8<T>(xs[m * kxv + i], f);
#pragma unroll
        for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(f[e]));
      }
      amax = warp_max(amax);
      if (lane == 0) partial[threadIdx.x / 32][m] = amax;
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < W; ++i) amax = fmaxf(amax, partial[i][m]);
      sx[m] = fp8_scale(amax);
    }
    for (int i = threadIdx.x; i < M * kxv; i += kThreads) {
      float f[8];
      widen8<T>(xs[i], f);
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = fp8_round(f[e], sx[i / kxv]);
      xs[i] = pack8<T>(f);
    }
    __syncthreads();
  }

  float acc[M][R];
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;
  while (true) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int k = base + 32 * u;
      if (k < kv) {
        float wf[R][kE];
#pragma unroll
        for (int r = 0; r < R; ++r) widen_weights<TW>(wv[u][r], wf[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          float xf[kE];
#pragma unroll
          for (int j = 0; j < kXv; ++j) {
            const int xi = m * kxv + k * kXv + j;
            widen8<T>(kSmemX ? xs[xi] : __ldcg(xv + xi), xf + 8 * j);
          }
#pragma unroll
          for (int r = 0; r < R; ++r) {
            float s = acc[m][r];
#pragma unroll
            for (int e = 0; e < kE; ++e) s = fmaf(xf[e], wf[r][e], s);
            acc[m][r] = s;
          }
        }
      }
    }
    base += 32 * kU;
    if (base >= kv) break;
    load_weights<kU, R>(wv, wr, base, kv);
  }
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      acc[m][r] = warp_sum(acc[m][r]);
      if constexpr (kFp8) acc[m][r] = acc[m][r] * sx[m] * ws[r];  // as the reference
    }
  if constexpr (E == Epilogue::kRopeKV) {
    // Lane m rotates (m, pair n0) as rotary does (products and sum rounded
    // apart) and stores it as rotary_write_kv would.
    const RopeKV& rp = a.rope;
    const int half = rp.head_dim / 2, head = n0 / half, j = n0 % half;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (lane != m || n0 >= a.n_out) continue;
      float lo = round_to<T>(acc[m][0]), hi = round_to<T>(acc[m][1]);
      if (head < rp.num_heads + rp.num_kv_heads) {
        const float* cs = rp.cos_sin + rp.positions[m] * rp.head_dim;
        const float c = cs[j], sn = cs[half + j];
        const float l = __fadd_rn(__fmul_rn(lo, c), __fmul_rn(-hi, sn));
        hi = __fadd_rn(__fmul_rn(hi, c), __fmul_rn(lo, sn));
        lo = l;
      }
      T* dst;
      if (head < rp.num_heads) {
        dst = a.y + (static_cast<std::int64_t>(m) * rp.num_heads + head) * rp.head_dim;
      } else {
        const std::int64_t slot = rp.slots[m];
        if (slot < 0) continue;
        const bool is_k = head < rp.num_heads + rp.num_kv_heads;
        const int kvh = head - rp.num_heads - (is_k ? 0 : rp.num_kv_heads);
        const std::int64_t block = slot / rp.block_size;
        dst = static_cast<T*>(is_k ? rp.k_cache : rp.v_cache) +
              ((block * rp.num_kv_heads + kvh) * rp.block_size + slot % rp.block_size) *
                  rp.head_dim;
      }
      dst[j] = from_float<T>(lo);
      dst[j + half] = from_float<T>(hi);
    }
  } else if constexpr (E == Epilogue::kSiluMul) {
    // Lane m writes (m, n0): silu rounded to T before the product, as silu_mul.
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (lane == m && n0 < a.n_out) {
        const float g = round_to<T>(acc[m][0]), u = round_to<T>(acc[m][1]);
        a.y[static_cast<std::int64_t>(m) * a.n_out + n0] =
            from_float<T>(round_to<T>(g / (1.0f + expf(-g))) * u);
      }
    }
  } else {
    // Lane m * R + r writes output (m, n0 + r).
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (lane == m * R + r && n0 + r < a.n_out) {
          T* dst = a.y + static_cast<std::int64_t>(m) * a.n_out + n0 + r;
          float v = acc[m][r];
          if constexpr (E == Epilogue::kAddInto) v = round_to<T>(v) + to_float(*dst);
          *dst = from_float<T>(v);
        }
      }
  }
}

bool g_programmatic_launch = true;

template <typename T, typename TW, int M, int W, bool kSmemX, Prologue P, Epilogue E>
void launch_gemv_x(const GemvArgs<T, TW>& a, cudaStream_t s) {
  constexpr bool kPaired = E == Epilogue::kSiluMul || E == Epilogue::kRopeKV;
  constexpr int R = (kPaired || M > 2) ? 2 : 1;
  constexpr int kColsPerWarp = kPaired ? 1 : R;
  auto kernel = gemv_kernel<T, TW, M, R, W, kSmemX, P, E>;
  const std::size_t smem = kSmemX ? static_cast<std::size_t>(M) * a.k_in * sizeof(T) : 0;
  if (smem > 48 * 1024) {
    static bool opted_in = false;  // one instantiation, one attribute call
    if (!opted_in) {
      check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      kGemvSmemBytes),
                 "gemv: shared memory opt-in");
      opted_in = true;
    }
  }
  const int warps = (a.n_out + kColsPerWarp - 1) / kColsPerWarp;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((warps + W - 1) / W);
  cfg.blockDim = dim3(W * 32);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = g_programmatic_launch ? 1 : 0;
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, a), "gemv_kernel");
}

// Long rows (the down projection's K = 14336) take 8 warps a block, so one
// staged copy of x serves twice the rows and the grid fits in one wave.
template <typename T, typename TW, int M, Prologue P, Epilogue E>
void launch_gemv(const GemvArgs<T, TW>& a, cudaStream_t s) {
  constexpr bool kFp8 = std::is_same_v<TW, __nv_fp8_e4m3>;
  const bool smem_x = static_cast<std::int64_t>(M) * a.k_in * sizeof(T) <= kGemvSmemBytes;
  if constexpr (P == Prologue::kNone && !kFp8) {
    if (!smem_x) return launch_gemv_x<T, TW, M, 4, false, P, E>(a, s);
  }
  require(smem_x, std::string("gemv: ") + (kFp8 ? "FP8 weights need" : "the fused norm needs") +
                      " rows * K * 2 <= " + std::to_string(kGemvSmemBytes) + " bytes");
  if (a.k_in > 8192) return launch_gemv_x<T, TW, M, 8, true, P, E>(a, s);
  launch_gemv_x<T, TW, M, 4, true, P, E>(a, s);
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
  require(w_scale == 0 || k_in % 16 == 0, "gemv: FP8 weights need K a multiple of 16");
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
