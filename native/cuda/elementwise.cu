// Row-wise and element-wise kernels: rms_norm, rotary, silu_mul.
// All are memory-bound: 16-byte vector loads/stores, math in float32, and the
// reference's intermediate roundings reproduced so results match it closely.
#include "common.cuh"
#include "rope_kv.cuh"

namespace turbomq {
namespace cuda {
namespace {

constexpr int kNormThreads = 256;

__device__ __forceinline__ float block_sum(float x) {
  __shared__ float partial[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  x = warp_sum(x);
  if (lane == 0) partial[warp] = x;
  __syncthreads();
  const int warps = blockDim.x / 32;
  x = lane < warps ? partial[lane] : 0.0f;
  return warp_sum(x);  // every warp reduces the partials itself: no second barrier
}

// One block per row. With kVec > 0 (rows of at most kVec * 8 * blockDim
// elements) each thread keeps its kVec vectors of the row in registers and
// loads its weights before the reduction, so the row costs one round trip to
// memory; kVec == 0 loops over any width and reads the row twice.
template <typename T, int kVec>
__global__ void __launch_bounds__(kNormThreads)
rms_norm_kernel(T* __restrict__ out, const T* __restrict__ x, std::int64_t x_stride,
                const T* __restrict__ weight, int hidden, float eps) {
  launch_dependents();
  grid_dependency_wait();  // a programmatic dependent: x may still be being written
  const std::int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  const int nvec = hidden / 8;
  float ss = 0.0f;
  if constexpr (kVec > 0) {
    float f[kVec][8];
    uint4 wraw[kVec];
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      const int i = threadIdx.x + v * kNormThreads;
      if (i < nvec) {
        wraw[v] = __ldg(reinterpret_cast<const uint4*>(weight) + i);
        unpack8<T>(*reinterpret_cast<const uint4*>(xr + 8 * i), f[v]);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += f[v][e] * f[v][e];
      }
    }
    const float inv = rsqrtf(block_sum(ss) / static_cast<float>(hidden) + eps);
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      const int i = threadIdx.x + v * kNormThreads;
      if (i < nvec) {
        float w[8];
        unpack8<T>(wraw[v], w);
#pragma unroll
        for (int e = 0; e < 8; ++e) f[v][e] = w[e] * round_to<T>(f[v][e] * inv);
        *reinterpret_cast<uint4*>(out + row * hidden + 8 * i) = pack8<T>(f[v]);
      }
    }
  } else {
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
      float f[8];
      unpack8<T>(*reinterpret_cast<const uint4*>(xr + 8 * i), f);
#pragma unroll
      for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
    }
    const float inv = rsqrtf(block_sum(ss) / static_cast<float>(hidden) + eps);
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
      float f[8], w[8];
      unpack8<T>(*reinterpret_cast<const uint4*>(xr + 8 * i), f);
      unpack8<T>(*reinterpret_cast<const uint4*>(weight + 8 * i), w);
#pragma unroll
      for (int e = 0; e < 8; ++e) f[e] = w[e] * round_to<T>(f[e] * inv);
      *reinterpret_cast<uint4*>(out + row * hidden + 8 * i) = pack8<T>(f);
    }
  }
}

// Launches the register variant for rows of up to 4 vectors per thread.
template <typename T>
void launch_norm(T* out, const T* x, std::int64_t x_stride, const T* weight, std::int64_t rows,
                 int hidden, float eps, cudaStream_t s) {
  const int per_thread = ceil_div(hidden / 8, kNormThreads);
  const unsigned grid = static_cast<unsigned>(rows);
  auto go = [&](auto kernel) {
    launch_kernel(true, kernel, dim3(grid), kNormThreads, 0, s, "rms_norm_kernel", out, x,
                  x_stride, weight, hidden, eps);
  };
  if (per_thread <= 1) {
    go(rms_norm_kernel<T, 1>);
  } else if (per_thread <= 2) {
    go(rms_norm_kernel<T, 2>);
  } else if (per_thread <= 4) {
    go(rms_norm_kernel<T, 4>);
  } else {
    go(rms_norm_kernel<T, 0>);
  }
}

// One thread per 8 rotation pairs (j, j + d/2) of one (token, head) row; q
// rows first, then k rows. Products and sum are rounded separately, as the
// reference computes x * cos + rotate(x) * sin.
template <typename T>
__global__ void rotary_kernel(T* __restrict__ q_out, T* __restrict__ k_out, const T* __restrict__ q,
                              std::int64_t q_stride_tok, std::int64_t q_stride_head,
                              const T* __restrict__ k, std::int64_t k_stride_tok,
                              std::int64_t k_stride_head, const std::int64_t* __restrict__ positions,
                              const float* __restrict__ cos_sin, std::int64_t items, int num_heads,
                              int num_kv_heads, int head_dim) {
  const int half = head_dim / 2;
  const int vec_per_row = half / 8;
  const int heads = num_heads + num_kv_heads;
  for (std::int64_t item = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       item < items; item += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const int j0 = static_cast<int>(item % vec_per_row) * 8;
    const std::int64_t row = item / vec_per_row;
    const int head = static_cast<int>(row % heads);
    const std::int64_t tok = row / heads;
    const bool is_q = head < num_heads;
    const T* src = is_q ? q + tok * q_stride_tok + head * q_stride_head
                        : k + tok * k_stride_tok + (head - num_heads) * k_stride_head;
    T* dst = is_q ? q_out + (tok * num_heads + head) * head_dim
                  : k_out + (tok * num_kv_heads + head - num_heads) * head_dim;
    const float* cs = cos_sin + positions[tok] * head_dim;
    float lo[8], hi[8], c[8], s[8];
    unpack8<T>(*reinterpret_cast<const uint4*>(src + j0), lo);
    unpack8<T>(*reinterpret_cast<const uint4*>(src + half + j0), hi);
    const float4* cv = reinterpret_cast<const float4*>(cs + j0);
    const float4* sv = reinterpret_cast<const float4*>(cs + half + j0);
    *reinterpret_cast<float4*>(c) = __ldg(cv);
    *reinterpret_cast<float4*>(c + 4) = __ldg(cv + 1);
    *reinterpret_cast<float4*>(s) = __ldg(sv);
    *reinterpret_cast<float4*>(s + 4) = __ldg(sv + 1);
#pragma unroll
    for (int e = 0; e < 8; ++e) rotate_pair<T>(lo[e], hi[e], c[e], s[e]);
    *reinterpret_cast<uint4*>(dst + j0) = pack8<T>(lo);
    *reinterpret_cast<uint4*>(dst + half + j0) = pack8<T>(hi);
  }
}

// silu(gate) is rounded to T before the product, as the reference does.
template <typename T>
__global__ void silu_mul_kernel(T* __restrict__ out, const T* __restrict__ gate_up,
                                std::int64_t in_stride, std::int64_t items, std::int64_t inter) {
  const std::int64_t vec_per_row = inter / 8;
  for (std::int64_t item = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       item < items; item += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t tok = item / vec_per_row;
    const std::int64_t col = (item % vec_per_row) * 8;
    const T* row = gate_up + tok * in_stride;
    float g[8], u[8];
    unpack8<T>(*reinterpret_cast<const uint4*>(row + col), g);
    unpack8<T>(*reinterpret_cast<const uint4*>(row + inter + col), u);
#pragma unroll
    for (int e = 0; e < 8; ++e) g[e] = silu_mul_of<T>(g[e], u[e]);
    *reinterpret_cast<uint4*>(out + tok * inter + col) = pack8<T>(g);
  }
}

int grid_for(std::int64_t items, int threads) {
  // Enough blocks to fill any current GPU; the kernels stride over the rest.
  const std::int64_t blocks = (items + threads - 1) / threads;
  return static_cast<int>(blocks < 65536 ? (blocks > 0 ? blocks : 1) : 65536);
}

void require_16bit(DType dtype, const char* op) {
  require(dtype == DType::kF16 || dtype == DType::kBF16,
          std::string(op) + ": dtype must be float16 or bfloat16");
}

template <typename F>
void dispatch_16bit(DType dtype, F&& f) {
  if (dtype == DType::kF16) {
    f(__half{});
  } else {
    f(__nv_bfloat16{});
  }
}

}  // namespace

void rms_norm(std::uintptr_t out, std::uintptr_t x, std::int64_t x_stride, std::uintptr_t weight,
              std::int64_t rows, std::int64_t hidden, float eps, DType dtype, std::uintptr_t stream) {
  require_16bit(dtype, "rms_norm");
  require(hidden % 8 == 0 && x_stride % 8 == 0, "rms_norm: hidden and row stride must be multiples of 8");
  if (rows == 0) return;
  dispatch_16bit(dtype, [&](auto tag) {
    using T = decltype(tag);
    launch_norm<T>(reinterpret_cast<T*>(out), reinterpret_cast<const T*>(x), x_stride,
                   reinterpret_cast<const T*>(weight), rows, static_cast<int>(hidden), eps,
                   as_stream(stream));
  });
  check_launch("rms_norm_kernel");
}

void rotary(std::uintptr_t q_out, std::uintptr_t k_out, std::uintptr_t q, std::int64_t q_stride_tok,
            std::int64_t q_stride_head, std::uintptr_t k, std::int64_t k_stride_tok,
            std::int64_t k_stride_head, std::uintptr_t positions, std::uintptr_t cos_sin,
            std::int64_t tokens, int num_heads, int num_kv_heads, int head_dim, DType dtype,
            std::uintptr_t stream) {
  require_16bit(dtype, "rotary");
  require(head_dim % 16 == 0, "rotary: head_dim must be a multiple of 16");
  require(q_stride_tok % 8 == 0 && q_stride_head % 8 == 0 && k_stride_tok % 8 == 0 &&
              k_stride_head % 8 == 0,
          "rotary: strides must be multiples of 8 elements");
  const std::int64_t items = tokens * (num_heads + num_kv_heads) * (head_dim / 16);
  if (items == 0) return;
  constexpr int kThreads = 256;
  dispatch_16bit(dtype, [&](auto tag) {
    using T = decltype(tag);
    rotary_kernel<T><<<grid_for(items, kThreads), kThreads, 0, as_stream(stream)>>>(
        reinterpret_cast<T*>(q_out), reinterpret_cast<T*>(k_out), reinterpret_cast<const T*>(q),
        q_stride_tok, q_stride_head, reinterpret_cast<const T*>(k), k_stride_tok, k_stride_head,
        reinterpret_cast<const std::int64_t*>(positions), reinterpret_cast<const float*>(cos_sin),
        items, num_heads, num_kv_heads, head_dim);
  });
  check_launch("rotary_kernel");
}

void silu_mul(std::uintptr_t out, std::uintptr_t gate_up, std::int64_t in_stride,
              std::int64_t tokens, std::int64_t inter, DType dtype, std::uintptr_t stream) {
  require_16bit(dtype, "silu_mul");
  require(inter % 8 == 0 && in_stride % 8 == 0, "silu_mul: sizes must be multiples of 8");
  const std::int64_t items = tokens * (inter / 8);
  if (items == 0) return;
  constexpr int kThreads = 256;
  dispatch_16bit(dtype, [&](auto tag) {
    using T = decltype(tag);
    silu_mul_kernel<T><<<grid_for(items, kThreads), kThreads, 0, as_stream(stream)>>>(
        reinterpret_cast<T*>(out), reinterpret_cast<const T*>(gate_up), in_stride, items, inter);
  });
  check_launch("silu_mul_kernel");
}

}  // namespace cuda
}  // namespace turbomq
