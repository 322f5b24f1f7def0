// Experiment, built by benchmarks/gpu_gemm_sequential.py (torch's extension
// loader, native/cuda on the include path): the product as ONE accumulation
// over K, y[m, n] = round(sum of every k16 step in increasing k, from zero),
// on Hopper at cuBLAS's tile size. docs/determinism.md ("Next: one
// accumulation over all of K") says why: without chunk sums there is no
// second accumulator set, so a block holds a 256 x 128 tile (128 fp32
// registers a consumer thread) instead of 128 x 128. This measures whether
// that tile reaches ~0.9x cuBLAS before the other shapes are rewritten.
//
// Block: 384 threads (optionally in clusters of two row tiles that share
// the weight tile, each loading half and multicasting it). Warpgroup 2 is
// the producer (one thread issues TMA
// loads into a ring of kStages stages: x's 256 rows and w's 128 rows of a
// 64-wide k tile, 128-byte swizzle); warpgroups 0 and 1 each own 128 rows
// of the tile as two m64n128 accumulators. Stages are handed over by
// mbarriers: `full` (bytes landed), `empty` (both consumers done).
//
// And the same definition for a few rows (gemv_sequential_kernel, decode):
// each warp owns whole tiles of 8 weight rows and walks all of K, the tile's
// rows streamed through the warp's own cp.async ring (quarters of 8 rows x
// 128 k), x's rows (at most 8) staged in shared memory, one mma.m16n8k16
// per k16 step into one accumulator. No chunk sums, no fold, no block-wide
// barrier after the start. Both kernels run every k16 step in the same
// order into one accumulator, so a row should come out with the same bits
// from either (the benchmark checks it).
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

#include "mma.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace turbomq {
namespace cuda {
namespace {

constexpr int kSeqMT = 256, kSeqNT = 128, kSeqBK = 64;
constexpr int kSeqRowBytes = kSeqBK * 2;
constexpr int kSeqStages = 4;
constexpr int kSeqThreads = 384;
constexpr int kSeqGroupM = 8;  // row tiles a raster group (L2 reuse of w)
constexpr int kSeqStageBytes = (kSeqMT + kSeqNT) * kSeqRowBytes;  // 48 KiB
constexpr int kSeqSmemBytes = 1024 + kSeqStages * kSeqStageBytes + 2 * 8 * kSeqStages;

struct SeqParams {
  void* y;
  int m, n, k;
  int m_tiles, n_tiles, k_tiles;
  CUtensorMap x, w;  // boxes of 64 x 256 (x) and 64 x 128 (w)
};

__device__ __forceinline__ std::uint32_t seq_smem() {
  extern __shared__ __align__(128) unsigned char smem[];
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
}

template <int kRegs, bool kIncrease>
__device__ __forceinline__ void set_max_registers() {
  if constexpr (kIncrease) {
    TURBOMQ_WGMMA_ASM("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
  } else {
    TURBOMQ_WGMMA_ASM("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
  }
}

__device__ __forceinline__ void seq_arrive(std::uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Cluster helpers (pairs): this block's rank; an arrival on the mbarrier at
// `bar` in block `rank` of the cluster, released at CTA scope (a
// cluster-scope release measured 3x slower, docs/kernels.md); a barrier of
// the cluster's threads; a TMA box multicast into the blocks of `mask`.
__device__ __forceinline__ int seq_cluster_rank() {
  std::uint32_t r = 0;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return static_cast<int>(r);
}
__device__ __forceinline__ void seq_arrive_in(std::uint32_t bar, int rank) {
  asm volatile(
      "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar), "r"(rank)
      : "memory");
}
__device__ __forceinline__ void seq_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
__device__ __forceinline__ void seq_tma_multicast(std::uint32_t dst, const CUtensorMap* map, int x,
                                                  int y, std::uint32_t bar, std::uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(x), "r"(y), "r"(bar), "h"(mask)
      : "memory");
}

// kPaired: clusters of two blocks on row tiles 2 u and 2 u + 1 of the same
// columns; each loads half of the weight tile (64 rows: the w map's boxes)
// and multicasts it into both, and a stage is refilled once all four
// consumer warpgroups of the pair are done with it.
template <typename T, bool kPaired>
__device__ __forceinline__ void gemm_sequential_body(const SeqParams& p) {
  constexpr int kBlocks = kPaired ? 2 : 1, kGroup = kSeqGroupM / kBlocks;
  const int rank = kPaired ? seq_cluster_rank() : 0;
  // Grouped raster order, as the invariant GEMM's tiled shape.
  const int units = (p.m_tiles + kBlocks - 1) / kBlocks;
  const int unit = blockIdx.x / kBlocks;
  const int per_group = kGroup * p.n_tiles;
  const int first = unit / per_group * kGroup;
  const int group_m = min(units - first, kGroup);
  const int in_group = unit % per_group;
  const int m0 = ((first + in_group % group_m) * kBlocks + rank) * kSeqMT;
  const int n0 = (in_group / group_m) * kSeqNT;

  const std::uint32_t base = (seq_smem() + 1023u) & ~1023u;
  const std::uint32_t full = base + kSeqStages * kSeqStageBytes, empty = full + 8 * kSeqStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kSeqStages; ++s) {
      mbarrier_init(full + 8 * s);
      // each consumer warpgroup (of the pair)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(empty + 8 * s),
                   "r"(2 * kBlocks)
                   : "memory");
    }
    fence_mbarrier_init();
  }
  if constexpr (kPaired) {
    seq_cluster_sync();  // the peer's barriers exist before anything lands on them
  } else {
    __syncthreads();
  }

  if (threadIdx.x >= 256) {
    set_max_registers<40, false>();
    if (threadIdx.x == 256) {
      for (int kt = 0; kt < p.k_tiles; ++kt) {
        const int s = kt % kSeqStages;
        if (kt >= kSeqStages) mbarrier_wait(empty + 8 * s, (kt / kSeqStages - 1) & 1);
        const std::uint32_t st = base + s * kSeqStageBytes;
        mbarrier_expect_bytes(full + 8 * s, kSeqStageBytes);
        tma_load_2d(st, &p.x, kt * kSeqBK, m0, full + 8 * s);
        if constexpr (kPaired) {
          seq_tma_multicast(st + (kSeqMT + 64 * rank) * kSeqRowBytes, &p.w, kt * kSeqBK,
                            n0 + 64 * rank, full + 8 * s, 0b11);
        } else {
          tma_load_2d(st + kSeqMT * kSeqRowBytes, &p.w, kt * kSeqBK, n0, full + 8 * s);
        }
      }
    }
    if constexpr (kPaired) seq_cluster_sync();  // the peer still arrives on our barriers
    return;
  }

  set_max_registers<232, true>();
  const int wg = threadIdx.x / 128;
  // Warpgroup wg: rows 128 wg.. as two m64 halves; all 128 columns.
  const std::uint64_t a0 = wgmma_desc(base + (128 * wg) * kSeqRowBytes);
  const std::uint64_t a1 = wgmma_desc(base + (128 * wg + 64) * kSeqRowBytes);
  const std::uint64_t b = wgmma_desc(base + kSeqMT * kSeqRowBytes);
  float acc0[64], acc1[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) acc0[i] = acc1[i] = 0.0f;
  for (int kt = 0; kt < p.k_tiles; ++kt) {
    const int s = kt % kSeqStages;
    mbarrier_wait(full + 8 * s, (kt / kSeqStages) & 1);
    const std::uint64_t st = static_cast<std::uint64_t>(s * kSeqStageBytes) >> 4;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kSeqBK / 16; ++ks) {
      wgmma_m64k16<T, 128>(acc0, a0 + st + 2 * ks, b + st + 2 * ks);
      wgmma_m64k16<T, 128>(acc1, a1 + st + 2 * ks, b + st + 2 * ks);
    }
    wgmma_commit();
    wgmma_wait<1>();
    if (kt > 0 && threadIdx.x % 128 == 0) {
      const std::uint32_t bar = empty + 8 * ((kt - 1) % kSeqStages);
      if constexpr (kPaired) {
        seq_arrive_in(bar, 0);
        seq_arrive_in(bar, 1);
      } else {
        seq_arrive(bar);
      }
    }
  }
  wgmma_wait<0>();

  // The m64n128 accumulator layout: warp w%4 of the warpgroup holds rows
  // 16 (w%4) + lane/4 (+ 8), n8 tile j at columns 8 j + 2 (lane%4).
  T* y = static_cast<T*>(p.y);
  const int lane = threadIdx.x % 32, w4 = (threadIdx.x / 32) % 4;
  const auto store = [&](const float* acc, int row0) {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int n = n0 + 8 * j + 2 * (lane % 4);
      if (n >= p.n) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int m = row0 + 16 * w4 + lane / 4 + 8 * h;
        if (m >= p.m) continue;
        *reinterpret_cast<std::uint32_t*>(y + static_cast<std::int64_t>(m) * p.n + n) =
            pack_pair<T>(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
      }
    }
  };
  store(acc0, m0 + 128 * wg);
  store(acc1, m0 + 128 * wg + 64);
  if constexpr (kPaired) seq_cluster_sync();
}

template <typename T>
__global__ void __launch_bounds__(kSeqThreads, 1)
    gemm_sequential_kernel(const __grid_constant__ SeqParams p) {
  gemm_sequential_body<T, false>(p);
}
template <typename T>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kSeqThreads, 1)
    gemm_sequential_pair_kernel(const __grid_constant__ SeqParams p) {
  gemm_sequential_body<T, true>(p);
}

// ----------------------------------------------------------- few rows
constexpr int kNarrowQuarter = 128;                      // k per ring stage
constexpr int kNarrowStageBytes = 8 * kNarrowQuarter * 2;  // 8 rows x 256 bytes
constexpr int kNarrowMaxRows = 8;

struct NarrowParams {
  void* y;
  const void* x;
  const void* w;
  int m, n, k;
  int tiles;          // n / 8
  int tiles_per_warp;
  int x_pitch;        // elements between x rows in shared memory (k + 8: banks)
};

// Byte offset of 16-byte chunk c (0-15) of row r (0-7) in a stage: rows of
// 256 bytes, the chunk XOR-swizzled by the row within its 128-byte half, so
// the 8 rows an ldmatrix phase reads hit 8 bank groups.
__device__ __forceinline__ std::uint32_t narrow_swizzle(int r, int c) {
  return static_cast<std::uint32_t>(r * 256 + ((c ^ r) << 4));
}

template <typename T, int kWarps, int kRing>
__global__ void __launch_bounds__(kWarps * 32) gemv_sequential_kernel(const NarrowParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const std::uint32_t base = static_cast<std::uint32_t>(__cvta_generic_to_shared(smem));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int quarters = p.k / kNarrowQuarter;
  const std::uint32_t x_bytes = (static_cast<std::uint32_t>(p.m * p.x_pitch * 2) + 127u) & ~127u;
  const std::uint32_t ring = base + x_bytes + warp * kRing * kNarrowStageBytes;
  const int first_tile = (blockIdx.x * kWarps + warp) * p.tiles_per_warp;
  const int steps = max(0, min(p.tiles_per_warp, p.tiles - first_tile)) * quarters;
  const auto* w = static_cast<const std::uint16_t*>(p.w);

  // x's rows, once per block.
  const auto* x = static_cast<const std::uint16_t*>(p.x);
  for (int i = threadIdx.x; i < p.m * (p.k / 8); i += kWarps * 32) {
    const int row = i / (p.k / 8), c = i % (p.k / 8);
    cp_async16(base + (row * p.x_pitch + c * 8) * 2,
               x + static_cast<std::int64_t>(row) * p.k + c * 8, true);
  }
  cp_async_commit();

  // Step s: quarter s % quarters of tile first_tile + s / quarters; a lane
  // copies 4 of its 128 chunks.
  const auto load = [&](int s) {
    if (s < steps) {
      const int tile = first_tile + s / quarters, q = s % quarters;
      const std::uint32_t dst = ring + (s % kRing) * kNarrowStageBytes;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int chunk = lane + 32 * j, r = chunk / 16, c = chunk % 16;
        cp_async16_l2_256(dst + narrow_swizzle(r, c),
                          w + static_cast<std::int64_t>(tile * 8 + r) * p.k + q * kNarrowQuarter +
                              c * 8,
                          true);
      }
    }
    cp_async_commit();  // empty past the end: the wait counts stay uniform
  };
#pragma unroll
  for (int s = 0; s < kRing - 1; ++s) load(s);
  cp_async_wait<kRing - 1>();  // this thread's x copies (its first group)
  __syncthreads();             // everyone's

  const int g = lane / 4, c = lane % 4;
  const bool row_ok = g < p.m;
  const std::uint32_t x_row = base + (row_ok ? g : 0) * p.x_pitch * 2;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  T* y = static_cast<T*>(p.y);
  for (int s = 0; s < steps; ++s) {
    cp_async_wait<kRing - 2>();  // step s has landed (this lane's part)...
    __syncwarp();                // ...every lane's; and stage s - 1 is free
    load(s + kRing - 1);
    const std::uint32_t st = ring + (s % kRing) * kNarrowStageBytes;
    const int kq = (s % quarters) * kNarrowQuarter;
#pragma unroll
    for (int pair = 0; pair < kNarrowQuarter / 32; ++pair) {
      std::uint32_t b[4];  // two k16 steps: (b0, b1) of step 2 pair, then of 2 pair + 1
      ldmatrix_x4(b, st + narrow_swizzle(lane % 8, 4 * pair + lane / 8));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int k0 = kq + 32 * pair + 16 * h;
        std::uint32_t a[4] = {0u, 0u, 0u, 0u};  // rows g + 8 are past any M here
        if (row_ok) {
          asm volatile("ld.shared.b32 %0, [%1];" : "=r"(a[0]) : "r"(x_row + (k0 + 2 * c) * 2));
          asm volatile("ld.shared.b32 %0, [%1];" : "=r"(a[2]) : "r"(x_row + (k0 + 8 + 2 * c) * 2));
        }
        mma_m16n8k16<T>(acc, a, b[2 * h], b[2 * h + 1]);
      }
    }
    if (s % quarters == quarters - 1) {  // the tile's last quarter: store its rows
      const int n = (first_tile + s / quarters) * 8 + 2 * c;
      if (row_ok) {
        *reinterpret_cast<std::uint32_t*>(y + static_cast<std::int64_t>(g) * p.n + n) =
            pack_pair<T>(acc[0], acc[1]);
      }
      acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
    }
  }
  cp_async_wait<0>();
}
}  // namespace

// y = x w^T for 2D bf16/fp16 CUDA tensors (x [M, K], w [N, K], K and N
// multiples of 8, 16-byte aligned rows), on the current stream; `paired`:
// in clusters of two row tiles sharing the weight tile.
torch::Tensor gemm_sequential(torch::Tensor x, torch::Tensor w, bool paired) {
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && x.dim() == 2 && w.dim() == 2, "2D CUDA tensors");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
                  (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf),
              "bf16 or fp16, both the same");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.size(1) == w.size(1), "shapes");
  TORCH_CHECK(x.size(1) % 8 == 0 && w.size(0) % 8 == 0, "N and K multiples of 8");
  const bool half = x.scalar_type() == torch::kHalf;
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  SeqParams p{};
  p.y = y.data_ptr();
  p.m = static_cast<int>(x.size(0));
  p.n = static_cast<int>(w.size(0));
  p.k = static_cast<int>(x.size(1));
  p.m_tiles = ceil_div(p.m, kSeqMT);
  p.n_tiles = ceil_div(p.n, kSeqNT);
  p.k_tiles = ceil_div(p.k, kSeqBK);
  const DType dtype = half ? DType::kF16 : DType::kBF16;
  p.x = transient_tensor_map_2d(reinterpret_cast<std::uintptr_t>(x.data_ptr()), p.m, p.k, dtype,
                                kSeqMT);
  p.w = tensor_map_2d(reinterpret_cast<std::uintptr_t>(w.data_ptr()), p.n, p.k, dtype,
                      paired ? kSeqNT / 2 : kSeqNT);
  const unsigned blocks =
      static_cast<unsigned>(paired ? 2 * ceil_div(p.m_tiles, 2) : p.m_tiles) * p.n_tiles;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto kernel = paired ? gemm_sequential_pair_kernel<__nv_bfloat16>
                       : gemm_sequential_kernel<__nv_bfloat16>;
  if (half) kernel = paired ? gemm_sequential_pair_kernel<__half> : gemm_sequential_kernel<__half>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  kSeqSmemBytes),
             "gemm_sequential: shared memory opt-in");
  kernel<<<blocks, kSeqThreads, kSeqSmemBytes, stream>>>(p);
  check_cuda(cudaGetLastError(), "gemm_sequential_kernel");
  return y;
}

// y = x w^T for at most 8 rows of x: kWarps warps a block (4 or 8), each
// taking tiles_per_warp tiles of 8 weight rows; K a multiple of 128.
torch::Tensor gemv_sequential(torch::Tensor x, torch::Tensor w, int warps, int tiles_per_warp) {
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && x.dim() == 2 && w.dim() == 2, "2D CUDA tensors");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
                  (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf),
              "bf16 or fp16, both the same");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.size(1) == w.size(1), "shapes");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kNarrowMaxRows, "1 to 8 rows");
  TORCH_CHECK(x.size(1) % kNarrowQuarter == 0 && w.size(0) % 8 == 0, "K % 128, N % 8");
  TORCH_CHECK((warps == 4 || warps == 8) && tiles_per_warp >= 1, "4 or 8 warps");
  const bool half = x.scalar_type() == torch::kHalf;
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  NarrowParams p{};
  p.y = y.data_ptr();
  p.x = x.data_ptr();
  p.w = w.data_ptr();
  p.m = static_cast<int>(x.size(0));
  p.n = static_cast<int>(w.size(0));
  p.k = static_cast<int>(x.size(1));
  p.tiles = p.n / 8;
  p.tiles_per_warp = tiles_per_warp;
  p.x_pitch = p.k + 8;
  constexpr int kRing = 6;
  const int x_bytes = (p.m * p.x_pitch * 2 + 127) & ~127;
  const int smem = x_bytes + warps * kRing * kNarrowStageBytes;
  const int blocks = ceil_div(p.tiles, warps * tiles_per_warp);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto launch = [&](auto kernel) {
    check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
               "gemv_sequential: shared memory opt-in");
    kernel<<<blocks, warps * 32, smem, stream>>>(p);
    check_cuda(cudaGetLastError(), "gemv_sequential_kernel");
  };
  if (half) {
    warps == 4 ? launch(gemv_sequential_kernel<__half, 4, kRing>)
               : launch(gemv_sequential_kernel<__half, 8, kRing>);
  } else {
    warps == 4 ? launch(gemv_sequential_kernel<__nv_bfloat16, 4, kRing>)
               : launch(gemv_sequential_kernel<__nv_bfloat16, 8, kRing>);
  }
  return y;
}

}  // namespace cuda
}  // namespace turbomq

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm_sequential", &turbomq::cuda::gemm_sequential, "y = x w^T, one accumulation over K",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("paired") = false);
  m.def("gemv_sequential", &turbomq::cuda::gemv_sequential,
        "y = x w^T for at most 8 rows, one accumulation over K");
}
