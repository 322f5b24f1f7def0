// Experiment, built by benchmarks/gpu_gemm_sequential.py (torch's extension
// loader, native/cuda on the include path): the product as ONE accumulation
// over K, y[m, n] = round(sum of every k16 step in increasing k, from zero),
// on Hopper. docs/determinism.md ("Next: one accumulation over all of K")
// says why: without chunk sums there is no second accumulator set, so a
// block can hold cuBLAS's 256 x 128 tile; and since every tile runs the
// same k16 steps into one accumulator, the tile may follow M freely -- a
// 64 x 16 tile for a decode row gives that row the bits a 256 x 128 tile
// gives it in a prefill.
//
// One kernel template, persistent (a block walks tiles blockIdx.x,
// + gridDim.x, ...; its stage ring flows from one tile into the next):
// kMT x kNT tiles, kWG consumer warpgroups each owning kMT / kWG rows as
// m64 sub-tiles, and a producer warpgroup whose one thread issues TMA loads
// (x's kMT rows and w's kNT rows of a 64-wide k tile, 128-byte swizzle; x's
// rows past M read as zeros) into a ring of kStages stages handed over by
// mbarriers: `full` (bytes landed), `empty` (every consumer warpgroup done).
// Launched as a programmatic dependent: the producer loads the first
// stages' weights before it waits for the previous kernel, then x.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <vector>

#include "mma.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace turbomq {
namespace cuda {
namespace {

constexpr int kSeqBK = 64;
constexpr int kSeqRowBytes = kSeqBK * 2;
constexpr int kSeqGroupM = 8;  // row tiles a raster group (L2 reuse of w)
constexpr int kSeqSmemLimit = 227 * 1024;

template <int kMT, int kNT, int kWG, int kStages>
struct SeqTile {
  static constexpr int kRowsWG = kMT / kWG;  // rows a consumer warpgroup owns
  static constexpr int kSub = kRowsWG / 64;  // its m64 sub-tiles
  static constexpr int kThreads = (kWG + 1) * 128;
  static constexpr int kStageBytes = (kMT + kNT) * kSeqRowBytes;
  static constexpr int kSmemBytes = 1024 + kStages * kStageBytes + 2 * 8 * kStages;
  static constexpr int kBlocksPerSm = 2 * kSmemBytes <= kSeqSmemLimit ? 2 : 1;
  static_assert(kSub >= 1 && kRowsWG % 64 == 0, "m64 sub-tiles");
  static_assert(kNT % 8 == 0 && kNT <= 128, "wgmma n8..n128");
  static_assert(kSmemBytes <= kSeqSmemLimit, "shared memory");
};

struct SeqParams {
  void* y;
  int m, n, k;
  int m_tiles, n_tiles, k_tiles;
  CUtensorMap x, w;  // boxes of 64 x kMT (x) and 64 x kNT (w)
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

// Tile t's first row and column, in grouped raster order (as the invariant
// GEMM's tiled shape).
__device__ __forceinline__ void seq_tile(const SeqParams& p, int t, int mt, int nt, int& m0,
                                         int& n0) {
  const int per_group = kSeqGroupM * p.n_tiles;
  const int first = t / per_group * kSeqGroupM;
  const int group_m = min(p.m_tiles - first, kSeqGroupM);
  const int in_group = t % per_group;
  m0 = (first + in_group % group_m) * mt;
  n0 = (in_group / group_m) * nt;
}

template <typename T, int kMT, int kNT, int kWG, int kStages>
__global__ void __launch_bounds__(SeqTile<kMT, kNT, kWG, kStages>::kThreads,
                                  SeqTile<kMT, kNT, kWG, kStages>::kBlocksPerSm)
    gemm_sequential_kernel(const __grid_constant__ SeqParams p) {
  using S = SeqTile<kMT, kNT, kWG, kStages>;
  const int tiles = p.m_tiles * p.n_tiles;
  const int my_tiles = blockIdx.x < tiles ? (tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const int steps = my_tiles * p.k_tiles;  // k tiles this block walks, over all its tiles

  const std::uint32_t base = (seq_smem() + 1023u) & ~1023u;
  const std::uint32_t full = base + kStages * S::kStageBytes, empty = full + 8 * kStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full + 8 * s);
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(empty + 8 * s), "r"(kWG)
                   : "memory");
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  if (threadIdx.x >= kWG * 128) {
    set_max_registers<40, false>();
    if (threadIdx.x == kWG * 128) {
      // The first stages' weights do not depend on the previous kernel: they
      // are loaded before the wait, x after it.
      const int early = min(kStages, steps);
      int m0, n0;
      for (int step = 0; step < early; ++step) {
        seq_tile(p, blockIdx.x + step / p.k_tiles * gridDim.x, kMT, kNT, m0, n0);
        mbarrier_expect_bytes(full + 8 * step, S::kStageBytes);
        tma_load_2d(base + step * S::kStageBytes + kMT * kSeqRowBytes, &p.w,
                    step % p.k_tiles * kSeqBK, n0, full + 8 * step);
      }
      grid_dependency_wait();
      int step = 0;
      for (int t = 0; t < my_tiles; ++t) {
        seq_tile(p, blockIdx.x + t * gridDim.x, kMT, kNT, m0, n0);
        for (int kt = 0; kt < p.k_tiles; ++kt, ++step) {
          const int s = step % kStages;
          const std::uint32_t st = base + s * S::kStageBytes;
          if (step >= early) {
            mbarrier_wait(empty + 8 * s, (step / kStages - 1) & 1);
            mbarrier_expect_bytes(full + 8 * s, S::kStageBytes);
            tma_load_2d(st + kMT * kSeqRowBytes, &p.w, kt * kSeqBK, n0, full + 8 * s);
          }
          tma_load_2d(st, &p.x, kt * kSeqBK, m0, full + 8 * s);
        }
      }
      launch_dependents();
    }
    return;
  }

  // (Also with one consumer warpgroup: the aligned instruction tells ptxas
  // the branch is warpgroup-uniform, else it serializes the wgmmas.)
  set_max_registers<S::kBlocksPerSm == 2 ? 208 : 232, true>();
  const int wg = threadIdx.x / 128;
  // Warpgroup wg: rows kRowsWG wg.. as kSub m64 sub-tiles; all kNT columns.
  std::uint64_t a[S::kSub];
#pragma unroll
  for (int i = 0; i < S::kSub; ++i) {
    a[i] = wgmma_desc(base + (S::kRowsWG * wg + 64 * i) * kSeqRowBytes);
  }
  const std::uint64_t b = wgmma_desc(base + kMT * kSeqRowBytes);
  T* y = static_cast<T*>(p.y);
  const int lane = threadIdx.x % 32, w4 = (threadIdx.x / 32) % 4;
  int step = 0;
  for (int t = 0; t < my_tiles; ++t) {
    // Zeroed outside the k loop, after the last tile's MMAs have completed:
    // a write to the accumulators between MMAs makes ptxas serialize them.
    float acc[S::kSub][kNT / 2];
#pragma unroll
    for (int i = 0; i < S::kSub; ++i) {
#pragma unroll
      for (int r = 0; r < kNT / 2; ++r) acc[i][r] = 0.0f;
    }
    for (int kt = 0; kt < p.k_tiles; ++kt, ++step) {
      const int s = step % kStages;
      mbarrier_wait(full + 8 * s, (step / kStages) & 1);
      const std::uint64_t st = static_cast<std::uint64_t>(s * S::kStageBytes) >> 4;
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kSeqBK / 16; ++ks) {
#pragma unroll
        for (int i = 0; i < S::kSub; ++i) {
          wgmma_m64k16<T, kNT>(acc[i], a[i] + st + 2 * ks, b + st + 2 * ks);
        }
      }
      wgmma_commit();
      wgmma_wait<1>();
      // The previous k tile's MMAs are done: its stage is free.
      if (kt > 0 && threadIdx.x % 128 == 0) seq_arrive(empty + 8 * ((step - 1) % kStages));
    }
    wgmma_wait<0>();
    if (threadIdx.x % 128 == 0) seq_arrive(empty + 8 * ((step - 1) % kStages));
    // The m64nN accumulator layout: warp w%4 of the warpgroup holds rows
    // 16 (w%4) + lane/4 (+ 8), n8 tile j at columns 8 j + 2 (lane%4).
    int m0, n0;
    seq_tile(p, blockIdx.x + t * gridDim.x, kMT, kNT, m0, n0);
#pragma unroll
    for (int i = 0; i < S::kSub; ++i) {
#pragma unroll
      for (int j = 0; j < kNT / 8; ++j) {
        const int n = n0 + 8 * j + 2 * (lane % 4);
        if (n >= p.n) continue;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int m = m0 + S::kRowsWG * wg + 64 * i + 16 * w4 + lane / 4 + 8 * h;
          if (m >= p.m) continue;
          *reinterpret_cast<std::uint32_t*>(y + static_cast<std::int64_t>(m) * p.n + n) =
              pack_pair<T>(acc[i][4 * j + 2 * h], acc[i][4 * j + 2 * h + 1]);
        }
      }
    }
  }
}

// The tilings the experiment times: (kMT, kNT, kWG, kStages).
#define TURBOMQ_SEQ_TILINGS(X) \
  X(256, 128, 2, 4)            \
  X(128, 128, 2, 6)            \
  X(128, 64, 2, 8)             \
  X(64, 128, 1, 8)             \
  X(64, 64, 1, 12)             \
  X(64, 32, 1, 8)              \
  X(64, 32, 1, 16)             \
  X(64, 16, 1, 8)              \
  X(64, 16, 1, 16)             \
  X(64, 8, 1, 16)

int sm_count() {
  int device = 0, sms = 0;
  check_cuda(cudaGetDevice(&device), "device");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
  return sms;
}

template <typename T, int kMT, int kNT, int kWG, int kStages>
void launch_sequential(SeqParams& p, const torch::Tensor& x, const torch::Tensor& w, DType dtype,
                       int max_blocks, bool pdl) {
  using S = SeqTile<kMT, kNT, kWG, kStages>;
  p.m_tiles = ceil_div(p.m, kMT);
  p.n_tiles = ceil_div(p.n, kNT);
  p.k_tiles = ceil_div(p.k, kSeqBK);
  p.x = transient_tensor_map_2d(reinterpret_cast<std::uintptr_t>(x.data_ptr()), p.m, p.k, dtype,
                                kMT);
  p.w = tensor_map_2d(reinterpret_cast<std::uintptr_t>(w.data_ptr()), p.n, p.k, dtype, kNT);
  auto kernel = gemm_sequential_kernel<T, kMT, kNT, kWG, kStages>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  S::kSmemBytes),
             "gemm_sequential: shared memory opt-in");
  const int resident = sm_count() * S::kBlocksPerSm;
  const int tiles = p.m_tiles * p.n_tiles;
  cudaLaunchConfig_t cfg = {};
  const int blocks =
      max_blocks < 0 ? tiles : std::min({tiles, resident, max_blocks > 0 ? max_blocks : tiles});
  cfg.gridDim = dim3(static_cast<unsigned>(std::max(1, blocks)));
  cfg.blockDim = dim3(S::kThreads);
  cfg.dynamicSmemBytes = S::kSmemBytes;
  cfg.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, p), "gemm_sequential_kernel");
}

// ------------------------------------------------- a few rows, transposed
// At M <= 8 the m64 tiles above spend 63 of 64 MMA rows on padding and run
// one accumulator chain per 64 weight rows. Transposed, the same products
// come out of mma.sync m16n8k16 with the weights as A (16 weight rows) and
// x as B (its 8 rows as the n8 columns): y^T = w x^T, every output still the
// k16 steps in increasing k into one fp32 accumulator. A warp owns 16 weight
// rows, so N / 16 independent chains share the GPU. A block: kWarps such
// warps and a producer warp whose one thread TMA-loads each 64-wide k tile
// (the warps' 16 kWarps weight rows, and x's 8 rows, zero past M) into a
// ring of kStages stages; a stage is free once every warp is done with it.
struct TrParams {
  void* y;
  int m, n, k;
  int k_tiles;
  CUtensorMap x, w;  // boxes of 64 x 8 (x) and 64 x 16 kWarps (w)
};

// Byte offset of 16-byte chunk c of row r in a 128-byte-swizzled region.
__device__ __forceinline__ std::uint32_t swizzled(int r, int c) {
  return static_cast<std::uint32_t>(r * 128 + ((c ^ (r % 8)) << 4));
}

template <int kWarps, int kStages>
struct TrTile {
  static constexpr int kWBytes = 16 * kWarps * kSeqRowBytes;
  static constexpr int kStageBytes = kWBytes + 8 * kSeqRowBytes;
  static constexpr int kSmemBytes = 1024 + kStages * kStageBytes + 2 * 8 * kStages;
};

template <typename T, int kWarps, int kStages>
__global__ void __launch_bounds__((kWarps + 1) * 32)
    gemv_transposed_kernel(const __grid_constant__ TrParams p) {
  using S = TrTile<kWarps, kStages>;
  const std::uint32_t base = (seq_smem() + 1023u) & ~1023u;
  const std::uint32_t full = base + kStages * S::kStageBytes, empty = full + 8 * kStages;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = blockIdx.x * 16 * kWarps;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full + 8 * s);
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(empty + 8 * s), "r"(kWarps)
                   : "memory");
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  if (warp == kWarps) {
    if (lane == 0) {
      const int early = min(kStages, p.k_tiles);
      for (int kt = 0; kt < early; ++kt) {
        mbarrier_expect_bytes(full + 8 * kt, S::kStageBytes);
        tma_load_2d(base + kt * S::kStageBytes, &p.w, kt * kSeqBK, n0, full + 8 * kt);
      }
      grid_dependency_wait();
      for (int kt = 0; kt < p.k_tiles; ++kt) {
        const int s = kt % kStages;
        const std::uint32_t st = base + s * S::kStageBytes;
        if (kt >= early) {
          mbarrier_wait(empty + 8 * s, (kt / kStages - 1) & 1);
          mbarrier_expect_bytes(full + 8 * s, S::kStageBytes);
          tma_load_2d(st, &p.w, kt * kSeqBK, n0, full + 8 * s);
        }
        tma_load_2d(st + S::kWBytes, &p.x, kt * kSeqBK, 0, full + 8 * s);
      }
      launch_dependents();
    }
    return;
  }

  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  // ldmatrix row addresses: A's four 8 x 8 matrices are (rows 0-7, 8-15) x
  // (k chunk 2 ks, 2 ks + 1); x's are its 8 rows at chunks 4 pair .. + 3.
  const int a_row = 16 * warp + (lane / 8) % 2 * 8 + lane % 8, a_chunk = lane / 16;
  for (int kt = 0; kt < p.k_tiles; ++kt) {
    const int s = kt % kStages;
    mbarrier_wait(full + 8 * s, (kt / kStages) & 1);
    const std::uint32_t st = base + s * S::kStageBytes;
#pragma unroll
    for (int pair = 0; pair < 2; ++pair) {
      std::uint32_t b[4];
      ldmatrix_x4(b, st + S::kWBytes + swizzled(lane % 8, 4 * pair + lane / 8));
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int ks = 2 * pair + h;
        std::uint32_t a[4];
        ldmatrix_x4(a, st + swizzled(a_row, 2 * ks + a_chunk));
        mma_m16n8k16<T>(acc, a, b[2 * h], b[2 * h + 1]);
      }
    }
    __syncwarp();
    if (lane == 0) seq_arrive(empty + 8 * s);
  }
  // The m16n8 accumulator: rows (weight rows) lane / 4 and + 8, columns (x
  // rows) 2 (lane % 4) and + 1.
  T* y = static_cast<T*>(p.y);
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int n = n0 + 16 * warp + lane / 4 + 8 * (e / 2), m = 2 * (lane % 4) + e % 2;
    if (n < p.n && m < p.m) y[static_cast<std::int64_t>(m) * p.n + n] = from_float<T>(acc[e]);
  }
}

#define TURBOMQ_TR_TILINGS(X) \
  X(1, 8)                     \
  X(1, 16)                    \
  X(2, 8)                     \
  X(2, 16)                    \
  X(4, 8)                     \
  X(4, 12)

template <typename T, int kWarps, int kStages>
void launch_transposed(TrParams& p, const torch::Tensor& x, const torch::Tensor& w, DType dtype) {
  using S = TrTile<kWarps, kStages>;
  p.k_tiles = ceil_div(p.k, kSeqBK);
  p.x = transient_tensor_map_2d(reinterpret_cast<std::uintptr_t>(x.data_ptr()), p.m, p.k, dtype,
                                8);
  p.w = tensor_map_2d(reinterpret_cast<std::uintptr_t>(w.data_ptr()), p.n, p.k, dtype,
                      16 * kWarps);
  auto kernel = gemv_transposed_kernel<T, kWarps, kStages>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  S::kSmemBytes),
             "gemv_transposed: shared memory opt-in");
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(ceil_div(p.n, 16 * kWarps)));
  cfg.blockDim = dim3((kWarps + 1) * 32);
  cfg.dynamicSmemBytes = S::kSmemBytes;
  cfg.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, p), "gemv_transposed_kernel");
}
}  // namespace

// y = x w^T for 2D bf16/fp16 CUDA tensors (x [M, K], w [N, K], K and N
// multiples of 8, 16-byte aligned rows), on the current stream, in tiles of
// mt x nt (TURBOMQ_SEQ_TILINGS) with `stages` stages, at most max_blocks
// persistent blocks (0: as many as are resident at once; -1: a block a
// tile, left to the hardware's scheduler), as a programmatic dependent
// where `pdl`.
torch::Tensor gemm_sequential(torch::Tensor x, torch::Tensor w, int mt, int nt, int wg, int stages,
                              int max_blocks, bool pdl) {
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
  const DType dtype = half ? DType::kF16 : DType::kBF16;
  bool found = false;
#define TURBOMQ_SEQ_LAUNCH(MT, NT, WG, ST)                                              \
  if (!found && mt == MT && nt == NT && wg == WG && stages == ST) {                     \
    found = true;                                                                       \
    if (half) {                                                                         \
      launch_sequential<__half, MT, NT, WG, ST>(p, x, w, dtype, max_blocks, pdl);              \
    } else {                                                                            \
      launch_sequential<__nv_bfloat16, MT, NT, WG, ST>(p, x, w, dtype, max_blocks, pdl);     \
    }                                                                                   \
  }
  TURBOMQ_SEQ_TILINGS(TURBOMQ_SEQ_LAUNCH)
#undef TURBOMQ_SEQ_LAUNCH
  TORCH_CHECK(found, "no such tiling");
  return y;
}

std::vector<std::vector<int>> tilings() {
  std::vector<std::vector<int>> out;
#define TURBOMQ_SEQ_LIST(MT, NT, WG, ST) out.push_back({MT, NT, WG, ST});
  TURBOMQ_SEQ_TILINGS(TURBOMQ_SEQ_LIST)
#undef TURBOMQ_SEQ_LIST
  return out;
}


// y = x w^T for at most 8 rows of x, transposed (gemv_transposed_kernel):
// blocks of `warps` warps of 16 weight rows, `stages` stages.
torch::Tensor gemv_transposed(torch::Tensor x, torch::Tensor w, int warps, int stages) {
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && x.dim() == 2 && w.dim() == 2, "2D CUDA tensors");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() &&
                  (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf),
              "bf16 or fp16, both the same");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.size(1) == w.size(1), "shapes");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= 8, "1 to 8 rows");
  TORCH_CHECK(x.size(1) % 8 == 0 && w.size(0) % 8 == 0, "N and K multiples of 8");
  const bool half = x.scalar_type() == torch::kHalf;
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  TrParams p{};
  p.y = y.data_ptr();
  p.m = static_cast<int>(x.size(0));
  p.n = static_cast<int>(w.size(0));
  p.k = static_cast<int>(x.size(1));
  const DType dtype = half ? DType::kF16 : DType::kBF16;
  bool found = false;
#define TURBOMQ_TR_LAUNCH(W, ST)                                         \
  if (!found && warps == W && stages == ST) {                            \
    found = true;                                                        \
    if (half) {                                                          \
      launch_transposed<__half, W, ST>(p, x, w, dtype);                  \
    } else {                                                             \
      launch_transposed<__nv_bfloat16, W, ST>(p, x, w, dtype);           \
    }                                                                    \
  }
  TURBOMQ_TR_TILINGS(TURBOMQ_TR_LAUNCH)
#undef TURBOMQ_TR_LAUNCH
  TORCH_CHECK(found, "no such tiling");
  return y;
}

std::vector<std::vector<int>> transposed_tilings() {
  std::vector<std::vector<int>> out;
#define TURBOMQ_TR_LIST(W, ST) out.push_back({W, ST});
  TURBOMQ_TR_TILINGS(TURBOMQ_TR_LIST)
#undef TURBOMQ_TR_LIST
  return out;
}

}  // namespace cuda
}  // namespace turbomq

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm_sequential", &turbomq::cuda::gemm_sequential, "y = x w^T, one accumulation over K",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("mt"), pybind11::arg("nt"),
        pybind11::arg("wg"), pybind11::arg("stages"), pybind11::arg("max_blocks") = 0,
        pybind11::arg("pdl") = true);
  m.def("gemv_transposed", &turbomq::cuda::gemv_transposed,
        "y = x w^T for at most 8 rows, one accumulation over K, transposed");
  m.def("transposed_tilings", &turbomq::cuda::transposed_tilings, "(warps, stages) of each");
  m.def("tilings", &turbomq::cuda::tilings, "(mt, nt, wg, stages) of each tiling");
}
