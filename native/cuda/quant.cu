// Per-row FP8 (E4M3) quantization of activations, with the layer's RMSNorm
// in front when it has one: the input of an FP8 projection in one launch.
// One block per row, three passes over it (it stays in L1/L2): the sum of
// squares, the largest magnitude of the normalized row, the quantized row.
// The norm is rms_norm's exactly (the same per-thread order and block
// reduction, the same two roundings), so the result equals rms_norm followed
// by the reference's quantize_rows bit for bit: scale = amax * (1/448) (at least
// 1e-12), q = e4m3(y * (1 / scale)) rounded to nearest even, saturating.
#include <algorithm>

#include "common.cuh"

namespace turbomq {
namespace cuda {
namespace {

constexpr int kThreads = 256;  // rms_norm's block, so its reduction order

__device__ __forceinline__ float block_reduce(float x, bool is_max) {
  __shared__ float partial[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  x = is_max ? warp_max(x) : warp_sum(x);
  if (lane == 0) partial[warp] = x;
  __syncthreads();
  x = lane < kThreads / 32 ? partial[lane] : 0.0f;
  x = is_max ? warp_max(x) : warp_sum(x);
  __syncthreads();  // partial is reused by the next reduction
  return x;
}

// Vector i of the row after the norm (or as it is), rounded to T.
template <typename T>
__device__ __forceinline__ void normalized8(const T* xr, const T* weight, float inv, int i,
                                            float* f) {
  unpack8<T>(*reinterpret_cast<const uint4*>(xr + 8 * i), f);
  if (weight == nullptr) return;
  float w[8];
  unpack8<T>(__ldg(reinterpret_cast<const uint4*>(weight) + i), w);
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = round_to<T>(w[e] * round_to<T>(f[e] * inv));
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
quantize_fp8_kernel(__nv_fp8_e4m3* __restrict__ q, float* __restrict__ scale,
                    const T* __restrict__ x, std::int64_t x_stride, const T* __restrict__ weight,
                    int hidden, float eps) {
  launch_dependents();
  const std::int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  const int nvec = hidden / 8;
  float inv = 1.0f;
  if (weight != nullptr) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < nvec; i += kThreads) {
      float f[8];
      unpack8<T>(*reinterpret_cast<const uint4*>(xr + 8 * i), f);
#pragma unroll
      for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
    }
    inv = rsqrtf(block_reduce(ss, false) / static_cast<float>(hidden) + eps);
  }
  float amax = 0.0f;
  for (int i = threadIdx.x; i < nvec; i += kThreads) {
    float f[8];
    normalized8<T>(xr, weight, inv, i, f);
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(f[e]));
  }
  const float s = fp8_scale(block_reduce(amax, true));
  if (threadIdx.x == 0) scale[row] = s;
  const float s_inv = __frcp_rn(s);
  for (int i = threadIdx.x; i < nvec; i += kThreads) {
    float f[8];
    normalized8<T>(xr, weight, inv, i, f);
    *reinterpret_cast<uint2*>(q + row * hidden + 8 * i) = fp8_pack8(f, s_inv);
  }
}

// The scales of a per-tensor FP8 product applied after it: v = y[m, n] *
// sx[m] * sw[n] in fp32 (the row-wise epilogue's numbers), then one of the
// GEMV's epilogues, rounded as the separate ops round. Four outputs a
// thread; kSiluMul pairs gate column j with up column j + n_out of y.
template <typename T, GemvEpilogue E>
__global__ void fp8_scale_kernel(T* __restrict__ out, const float* __restrict__ y,
                                 std::int64_t y_stride, const float* __restrict__ sx,
                                 const float* __restrict__ sw, std::int64_t rows, int n_out) {
  const int quads = n_out / 4;
  const std::int64_t items = rows * quads;
  for (std::int64_t item = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       item < items; item += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t m = item / quads;
    const int n = static_cast<int>(item % quads) * 4;
    const float* yr = y + m * y_stride;
    const float s = sx[m];
    const float4 a = *reinterpret_cast<const float4*>(yr + n);
    const float4 wa = __ldg(reinterpret_cast<const float4*>(sw + n));
    float v[4] = {a.x * s * wa.x, a.y * s * wa.y, a.z * s * wa.z, a.w * s * wa.w};
    T* o = out + m * n_out + n;
    if constexpr (E == GemvEpilogue::kSiluMul) {
      const float4 b = *reinterpret_cast<const float4*>(yr + n_out + n);
      const float4 wb = __ldg(reinterpret_cast<const float4*>(sw + n_out + n));
      const float u[4] = {b.x * s * wb.x, b.y * s * wb.y, b.z * s * wb.z, b.w * s * wb.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = silu_mul_of<T>(round_to<T>(v[e]), round_to<T>(u[e]));
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (E == GemvEpilogue::kAddInto) v[e] = round_to<T>(v[e]) + to_float(o[e]);
      o[e] = from_float<T>(v[e]);
    }
  }
}

}  // namespace

void quantize_fp8(std::uintptr_t q, std::uintptr_t scale, std::uintptr_t x, std::int64_t x_stride,
                  std::uintptr_t norm_weight, std::int64_t rows, std::int64_t hidden, float eps,
                  DType dtype, std::uintptr_t stream) {
  require(hidden > 0 && hidden % 8 == 0, "quantize_fp8: hidden must be a positive multiple of 8");
  require(x % 16 == 0 && x_stride % 8 == 0 && q % 8 == 0 && norm_weight % 16 == 0,
          "quantize_fp8: x rows must be 16-byte aligned, q 8-byte aligned");
  if (rows == 0) return;
  const unsigned grid = static_cast<unsigned>(rows);
  auto* qp = reinterpret_cast<__nv_fp8_e4m3*>(q);
  auto* sp = reinterpret_cast<float*>(scale);
  const int h = static_cast<int>(hidden);
  if (dtype == DType::kBF16) {
    quantize_fp8_kernel<__nv_bfloat16><<<grid, kThreads, 0, as_stream(stream)>>>(
        qp, sp, reinterpret_cast<const __nv_bfloat16*>(x), x_stride,
        reinterpret_cast<const __nv_bfloat16*>(norm_weight), h, eps);
  } else if (dtype == DType::kF16) {
    quantize_fp8_kernel<__half><<<grid, kThreads, 0, as_stream(stream)>>>(
        qp, sp, reinterpret_cast<const __half*>(x), x_stride,
        reinterpret_cast<const __half*>(norm_weight), h, eps);
  } else {
    throw std::invalid_argument("quantize_fp8: x must be fp16 or bf16");
  }
  check_launch("quantize_fp8");
}

void fp8_scale(std::uintptr_t out, std::uintptr_t y, std::int64_t y_stride, std::uintptr_t sx,
               std::uintptr_t sw, std::int64_t rows, std::int64_t n_out, GemvEpilogue epilogue,
               DType dtype, std::uintptr_t stream) {
  require(n_out > 0 && n_out % 4 == 0 && y_stride % 4 == 0 && y % 16 == 0 && sw % 16 == 0,
          "fp8_scale: n_out and y's row stride multiples of 4, y and sw 16-byte aligned");
  const std::int64_t items = rows * (n_out / 4);
  if (items == 0) return;
  constexpr int kThreads = 256;
  const unsigned grid = static_cast<unsigned>(std::min<std::int64_t>((items + kThreads - 1) / kThreads, 4096));
  const int n = static_cast<int>(n_out);
  auto* yp = reinterpret_cast<const float*>(y);
  auto* sxp = reinterpret_cast<const float*>(sx);
  auto* swp = reinterpret_cast<const float*>(sw);
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    T* o = reinterpret_cast<T*>(out);
    switch (epilogue) {
      case GemvEpilogue::kStore:
        fp8_scale_kernel<T, GemvEpilogue::kStore><<<grid, kThreads, 0, as_stream(stream)>>>(
            o, yp, y_stride, sxp, swp, rows, n);
        break;
      case GemvEpilogue::kAddInto:
        fp8_scale_kernel<T, GemvEpilogue::kAddInto><<<grid, kThreads, 0, as_stream(stream)>>>(
            o, yp, y_stride, sxp, swp, rows, n);
        break;
      case GemvEpilogue::kSiluMul:
        fp8_scale_kernel<T, GemvEpilogue::kSiluMul><<<grid, kThreads, 0, as_stream(stream)>>>(
            o, yp, y_stride, sxp, swp, rows, n);
        break;
    }
  };
  if (dtype == DType::kBF16) {
    launch(__nv_bfloat16{});
  } else if (dtype == DType::kF16) {
    launch(__half{});
  } else {
    throw std::invalid_argument("fp8_scale: out must be fp16 or bf16");
  }
  check_launch("fp8_scale");
}

}  // namespace cuda
}  // namespace turbomq
