// gemv: y[m, n] = sum_k x[m, k] * w[n, k] for a few rows m (decode at small
// batch), i.e. F.linear(x, w) with M <= 8. Memory-bound on w: every weight is
// read once with 16-byte streaming loads (no L1 allocation), 16 loads in
// flight per lane. Launched as a programmatic dependent, it issues its first
// weight loads while the previous kernel is still running, then waits for it
// and stages the few x rows in shared memory. A warp owns R output rows
// and reduces over all of K: lane l takes 16-byte chunks l, l + 32, ... of
// each row (512 contiguous bytes per warp load), accumulates in fp32, and a
// warp reduction finishes. Each (m, n) sums in the same order whatever M and
// R are, so a row's result does not depend on the batch it is in.
#include "common.cuh"

namespace turbomq {
namespace cuda {
namespace {

constexpr int kGemvWarps = 4;
constexpr int kGemvThreads = kGemvWarps * 32;
constexpr int kInFlight = 16;  // 16-byte weight loads in flight per lane
constexpr int kGemvSmemBytes = 48 * 1024;  // x staged in shared memory up to this size

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

// x is read only after grid_dependency_wait (the previous kernel may still be
// writing it when this one starts): through L2 (__ldcg), staged once per
// block in shared memory when it fits (kSmemX), else per use.
template <typename T, int M, int R, bool kSmemX>
__global__ void __launch_bounds__(kGemvThreads)
gemv_kernel(T* __restrict__ y, const T* x, const T* __restrict__ w, int n_out, int k_in) {
  constexpr int kU = kInFlight / R;  // chunks per row per iteration
  extern __shared__ uint4 xs[];      // [M][kv] with kSmemX
  const int lane = threadIdx.x % 32;
  const int n0 = (blockIdx.x * kGemvWarps + threadIdx.x / 32) * R;  // may be past n_out: no writes
  const int kv = k_in / 8;  // 16-byte chunks per row
  const uint4* wr[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    wr[r] = reinterpret_cast<const uint4*>(w) + static_cast<std::int64_t>(min(n0 + r, n_out - 1)) * kv;
  }
  uint4 wv[kU][R];
  int base = lane;
  load_weights<kU, R>(wv, wr, base, kv);  // independent of the previous kernel

  grid_dependency_wait();
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  if constexpr (kSmemX) {
    for (int i = threadIdx.x; i < M * kv; i += kGemvThreads) xs[i] = __ldcg(xv + i);
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
        float wf[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) widen8<T>(wv[u][r], wf[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          float xf[8];
          const int xi = m * kv + k;
          widen8<T>(kSmemX ? xs[xi] : __ldcg(xv + xi), xf);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            float s = acc[m][r];
#pragma unroll
            for (int e = 0; e < 8; ++e) s = fmaf(xf[e], wf[r][e], s);
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
    for (int r = 0; r < R; ++r) acc[m][r] = warp_sum(acc[m][r]);
  // Lane m * R + r writes output (m, n0 + r).
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (lane == m * R + r && n0 + r < n_out) {
        y[static_cast<std::int64_t>(m) * n_out + n0 + r] = from_float<T>(acc[m][r]);
      }
    }
}

bool g_programmatic_launch = true;

template <typename T, int M, bool kSmemX>
void launch_gemv_x(T* y, const T* x, const T* w, int n, int k, cudaStream_t s) {
  constexpr int R = M <= 2 ? 1 : 2;
  const int warps = (n + R - 1) / R;
  const int blocks = (warps + kGemvWarps - 1) / kGemvWarps;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(kGemvThreads);
  cfg.dynamicSmemBytes = kSmemX ? static_cast<std::size_t>(M) * k * sizeof(T) : 0;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = g_programmatic_launch ? 1 : 0;
  check_cuda(cudaLaunchKernelEx(&cfg, gemv_kernel<T, M, R, kSmemX>, y, x, w, n, k), "gemv_kernel");
}

template <typename T, int M>
void launch_gemv(T* y, const T* x, const T* w, int n, int k, cudaStream_t s) {
  if (static_cast<std::int64_t>(M) * k * sizeof(T) <= kGemvSmemBytes) {
    launch_gemv_x<T, M, true>(y, x, w, n, k, s);
  } else {
    launch_gemv_x<T, M, false>(y, x, w, n, k, s);
  }
}

template <typename T>
void dispatch_rows(T* y, const T* x, const T* w, int m, int n, int k, cudaStream_t s) {
  switch (m) {
    case 1: launch_gemv<T, 1>(y, x, w, n, k, s); break;
    case 2: launch_gemv<T, 2>(y, x, w, n, k, s); break;
    case 3: launch_gemv<T, 3>(y, x, w, n, k, s); break;
    case 4: launch_gemv<T, 4>(y, x, w, n, k, s); break;
    case 5: launch_gemv<T, 5>(y, x, w, n, k, s); break;
    case 6: launch_gemv<T, 6>(y, x, w, n, k, s); break;
    case 7: launch_gemv<T, 7>(y, x, w, n, k, s); break;
    default: launch_gemv<T, 8>(y, x, w, n, k, s); break;
  }
}

}  // namespace

void set_programmatic_launch(bool on) { g_programmatic_launch = on; }
bool programmatic_launch() { return g_programmatic_launch; }

void gemv(std::uintptr_t y, std::uintptr_t x, std::uintptr_t w, std::int64_t rows,
          std::int64_t n_out, std::int64_t k_in, DType dtype, std::uintptr_t stream) {
  require(dtype == DType::kF16 || dtype == DType::kBF16, "gemv: dtype must be float16 or bfloat16");
  require(rows >= 1 && rows <= kGemvMaxRows, "gemv: rows must be 1..8");
  require(k_in > 0 && k_in % 8 == 0 && n_out > 0, "gemv: K must be a positive multiple of 8");
  require(x % 16 == 0 && w % 16 == 0, "gemv: x and w must be 16-byte aligned");
  require(n_out < (1LL << 31) && k_in < (1LL << 31), "gemv: sizes too large");
  cudaStream_t s = as_stream(stream);
  const int m = static_cast<int>(rows), n = static_cast<int>(n_out), k = static_cast<int>(k_in);
  if (dtype == DType::kF16) {
    dispatch_rows(reinterpret_cast<__half*>(y), reinterpret_cast<const __half*>(x),
                  reinterpret_cast<const __half*>(w), m, n, k, s);
  } else {
    dispatch_rows(reinterpret_cast<__nv_bfloat16*>(y), reinterpret_cast<const __nv_bfloat16*>(x),
                  reinterpret_cast<const __nv_bfloat16*>(w), m, n, k, s);
  }
}

}  // namespace cuda
}  // namespace turbomq
