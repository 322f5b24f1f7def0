"""Is a decode projection's weight stream slowed by the order it reads HBM in?
Pure-read kernels (no arithmetic but an XOR of what they load, one word
stored a block) over the gate/up weight's bytes, each in the access order of
one of the engine's decode projections and in a row-contiguous variant of it:

- gemv16: the 16-bit GEMV (a warp per two 8 KiB rows, each load instruction
  512 contiguous bytes, 16 loads in flight a lane);
- split: the batch-invariant GEMM's split shape (a block per 128 rows x
  1 KiB chunk, a 4-stage cp.async ring of 128 rows x 128 bytes, L2::256B,
  three blocks an SM); split_rows: the same blocks, each stage 16 whole
  1 KiB row chunks;
- fp8: the FP8 GEMV's earlier register ring (two blocks of 8 warps an SM,
  tiles of 8 rows x 4 KiB, a warp's step 8 rows x 128 bytes, a ring of 8
  steps a lane); fp8_rows: the same blocks, tiles and ring, a warp's step
  1 row x 1 KiB; fp8_stage: the same blocks and tiles, the block copying
  its weights with cp.async in stages of 8 rows x 2 KiB (the FP8 GEMV's
  current way), also at three blocks an SM (x3) and a tile a block (t1);
- gemv_q: the batch-invariant GEMM's gemv shape (a block of 4 warps per 8
  rows, a 4-deep ring of 8 KiB stages, about 41 KiB of shared memory so
  five blocks an SM): a stage is a quarter (256 bytes) of each of 4 warps'
  1 KiB chunks of every row, 1 KiB apart; gemv_c: the same blocks and
  stages, a stage 1 KiB contiguous of every row (the 16-bit GEMV's order);
- gemv16s: the 16-bit GEMV's blocks (8 warps over 16 rows, a 4-deep ring of
  stages of 1 KiB of each row), a block a tile; gemv16p: the same stages,
  two blocks an SM over contiguous ranges of tiles.

gate/up's bytes for every order (16-bit and FP8), and down, qkv and o for
the FP8 ones.

Each reads its bytes from HBM (the launches rotate over 1 GiB). Timing: a
CUDA graph of 20 launches, the median of 5 replays (gpu_kernels.time_graph).

    python benchmarks/gpu_stream_patterns.py --out DIR [--case KIND:ROWS:BYTES ...]

Writes stream_patterns.md into DIR. GPU only; builds its kernels with
torch.utils.cpp_extension."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

_spec = importlib.util.spec_from_file_location("gpu_kernels", Path(__file__).with_name("gpu_kernels.py"))
gpu_kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_kernels)

CUDA_SRC = r"""
#include <cstdint>
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ unsigned mix(const uint4& v) { return v.x ^ v.y ^ v.z ^ v.w; }

// gemv16: warp gw owns rows 2 gw, 2 gw + 1 of `row_bytes` each; a ring of 16
// loads a lane, refilled as each is consumed (as the GEMV's registers are).
__global__ void __launch_bounds__(256) gemv16(const uint8_t* w, int rows, int row_bytes, unsigned* out) {
  const int lane = threadIdx.x % 32, gw = (blockIdx.x * 256 + threadIdx.x) / 32;
  const int per_row = row_bytes / 512, items = 2 * gw + 2 <= rows ? 2 * per_row : 0;
  auto addr = [&](int j) {
    return w + static_cast<int64_t>(2 * gw + j / per_row) * row_bytes + 512 * (j % per_row) + 16 * lane;
  };
  uint4 v[16];
#pragma unroll
  for (int u = 0; u < 16; ++u) {
    if (u < items) v[u] = ld_stream(addr(u));
  }
  unsigned acc = 0;
  for (int j0 = 0; j0 < items; j0 += 16) {
#pragma unroll
    for (int u = 0; u < 16; ++u) {
      if (j0 + u < items) {
        acc ^= mix(v[u]);
        if (j0 + u + 16 < items) v[u] = ld_stream(addr(j0 + u + 16));
      }
    }
  }
  if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

__device__ __forceinline__ void cp_async16(void* s, const void* g) {
  const unsigned sa = static_cast<unsigned>(__cvta_generic_to_shared(s));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(sa), "l"(g));
}

// split: block (tile, chunk) of 128 rows x 1 KiB; 8 stages of 16 KiB through a
// 4-deep ring. kRows: a stage is 16 whole row chunks instead of 128 x 128 B.
template <bool kRows>
__global__ void __launch_bounds__(256) split(const uint8_t* w, int row_bytes, int chunks, unsigned* out) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int tile = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
  const uint8_t* base = w + static_cast<int64_t>(tile) * 128 * row_bytes + 1024 * chunk;
  auto issue = [&](int s) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int i = threadIdx.x + 256 * q;
      const int64_t off = kRows ? static_cast<int64_t>(16 * s + i / 64) * row_bytes + 16 * (i % 64)
                                : static_cast<int64_t>(i / 8) * row_bytes + 128 * s + 16 * (i % 8);
      cp_async16(smem + (s % 4) * 16384 + 16 * i, base + off);
    }
    asm volatile("cp.async.commit_group;");
  };
  for (int s = 0; s < 3; ++s) issue(s);
  unsigned acc = 0;
  for (int s = 0; s < 8; ++s) {
    asm volatile("cp.async.wait_group 2;");
    __syncthreads();
    const uint4* st = reinterpret_cast<const uint4*>(smem + (s % 4) * 16384);
#pragma unroll
    for (int q = 0; q < 4; ++q) acc ^= mix(st[threadIdx.x + 256 * q]);
    __syncthreads();
    if (s + 3 < 8) issue(s + 3);
    else asm volatile("cp.async.commit_group;");
  }
  if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

// fp8: tiles of 8 rows x row_bytes over the grid, contiguous ranges a block;
// an item is one of a warp's steps of a tile, loaded as two 16-byte loads a lane.
template <bool kRows>
__global__ void __launch_bounds__(256) fp8(const uint8_t* w, int tiles, int row_bytes, unsigned* out) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const int t0 = static_cast<int>(static_cast<int64_t>(blockIdx.x) * tiles / gridDim.x);
  const int t1 = static_cast<int>(static_cast<int64_t>(blockIdx.x + 1) * tiles / gridDim.x);
  const int per_tile = row_bytes / 128 / 8;  // a warp's steps a tile
  const int items = (t1 - t0) * per_tile;
  auto addr = [&](int j, int which) -> const uint8_t* {
    const int tile = t0 + j / per_tile, step = j % per_tile;
    const uint8_t* tb = w + static_cast<int64_t>(tile) * 8 * row_bytes;
    if (kRows) {  // row `warp`, bytes [1024 step, +1024): a, b its two halves
      return tb + static_cast<int64_t>(warp) * row_bytes + 1024 * step + 512 * which + 16 * lane;
    }
    const int row = g / 2 + 4 * which, s = warp + 8 * step;
    return tb + static_cast<int64_t>(row) * row_bytes + 128 * s + 64 * (g % 2) + 16 * t;
  };
  uint4 va[8], vb[8];
#pragma unroll
  for (int u = 0; u < 8; ++u) {
    if (u < items) { va[u] = ld_stream(addr(u, 0)); vb[u] = ld_stream(addr(u, 1)); }
  }
  unsigned acc = 0;
  for (int j0 = 0; j0 < items; j0 += 8) {
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      if (j0 + u < items) {
        acc ^= mix(va[u]) ^ mix(vb[u]);
        if (j0 + u + 8 < items) { va[u] = ld_stream(addr(j0 + u + 8, 0)); vb[u] = ld_stream(addr(j0 + u + 8, 1)); }
      }
    }
  }
  if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

// The consuming side of a 4-deep cp.async ring of `stages` stages of
// kSlotBytes: three stages in flight; `issue(s)` copies stage s (one commit
// group). kIssueFirst: the next copy right after the stage's barrier (its
// slot's stage was read before it), else after a second barrier.
template <int kThreads, int kSlotBytes, bool kIssueFirst, typename Issue>
__device__ __forceinline__ unsigned read_ring(const uint8_t* smem, int stages, Issue issue) {
  for (int s = 0; s < 3; ++s) issue(s);
  unsigned acc = 0;
  for (int s = 0; s < stages; ++s) {
    asm volatile("cp.async.wait_group 2;");
    __syncthreads();
    if (kIssueFirst) issue(s + 3);
    const uint4* st = reinterpret_cast<const uint4*>(smem + (s % 4) * kSlotBytes);
#pragma unroll
    for (int q = 0; q < kSlotBytes / 16 / kThreads; ++q) acc ^= mix(st[threadIdx.x + kThreads * q]);
    if (!kIssueFirst) {
      __syncthreads();
      issue(s + 3);
    }
  }
  return acc;
}

// Tiles of kTileRows rows, each block a contiguous range of them (a tile a
// block where the grid has as many blocks as tiles), the weights copied by
// the whole block with cp.async in stages of kChunk contiguous bytes of each
// of the tile's rows (16 KiB), a ring of 4, a barrier a stage (as the split
// shape). fp8_stage: the FP8 GEMV's blocks and tiles (8 rows x 2 KiB);
// gemv16s / gemv16p: the 16-bit GEMV's (16 rows x 1 KiB), a block a tile or
// two blocks an SM.
template <int kTileRows, int kChunk>
__global__ void __launch_bounds__(256) row_stages(const uint8_t* w, int tiles, int row_bytes, unsigned* out) {
  static_assert(kTileRows * kChunk == 16384, "a stage is 16 KiB");
  constexpr int kRowChunks = kChunk / 16;  // 16-byte copies a row a stage
  extern __shared__ __align__(128) uint8_t smem[];
  const int t0 = static_cast<int>(static_cast<int64_t>(blockIdx.x) * tiles / gridDim.x);
  const int t1 = static_cast<int>(static_cast<int64_t>(blockIdx.x + 1) * tiles / gridDim.x);
  const int per_tile = row_bytes / kChunk;
  const int stages = (t1 - t0) * per_tile;
  auto issue = [&](int s) {
    if (s < stages) {
      const uint8_t* tb = w + static_cast<int64_t>(t0 + s / per_tile) * kTileRows * row_bytes +
                          kChunk * (s % per_tile);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int i = threadIdx.x + 256 * q;
        cp_async16(smem + (s % 4) * 16384 + 16 * i,
                   tb + static_cast<int64_t>(i / kRowChunks) * row_bytes + 16 * (i % kRowChunks));
      }
    }
    asm volatile("cp.async.commit_group;");
  };
  const unsigned acc = read_ring<256, 16384, false>(smem, stages, issue);
  if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

// gemv_q / gemv_c (kContig): the gemv shape's block over 8 rows.
template <bool kContig>
__global__ void __launch_bounds__(128) gemv_shape(const uint8_t* w, int row_bytes, unsigned* out) {
  extern __shared__ __align__(128) uint8_t smem[];
  const uint8_t* tb = w + static_cast<int64_t>(blockIdx.x) * 8 * row_bytes;
  const int stages = row_bytes / 1024;
  auto issue = [&](int s) {
    if (s < stages) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int i = threadIdx.x + 128 * j;
        int64_t off;
        if (kContig) {
          off = static_cast<int64_t>(i / 64) * row_bytes + 1024 * s + 16 * (i % 64);
        } else {  // warp j's chunk 4 (s / 4) + j, quarter s % 4; row (i % 128) / 16
          off = static_cast<int64_t>(i % 128 / 16) * row_bytes + 1024 * (4 * (s / 4) + j) +
                256 * (s % 4) + 16 * (i % 16);
        }
        cp_async16(smem + (s % 4) * 8192 + 16 * i, tb + off);
      }
    }
    asm volatile("cp.async.commit_group;");
  };
  const unsigned acc = read_ring<128, 8192, true>(smem, stages, issue);
  if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

void run(const std::string& kind, torch::Tensor w, int64_t offset, int64_t rows, int64_t row_bytes,
         torch::Tensor out, int64_t sms) {
  auto s = c10::cuda::getCurrentCUDAStream();
  const uint8_t* p = w.data_ptr<uint8_t>() + offset;
  unsigned* o = reinterpret_cast<unsigned*>(out.data_ptr<int32_t>());
  if (kind == "gemv16") {
    gemv16<<<(rows / 2 + 7) / 8, 256, 0, s>>>(p, rows, row_bytes, o);
  } else if (kind == "split" || kind == "split_rows") {
    auto k = kind == "split" ? split<false> : split<true>;
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536);
    const int chunks = row_bytes / 1024;
    k<<<rows / 128 * chunks, 256, 65536, s>>>(p, row_bytes, chunks, o);
  } else if (kind == "fp8_stage" || kind == "fp8_stage_x3" || kind == "fp8_stage_t1") {
    const int blocks = kind == "fp8_stage" ? 2 * sms : kind == "fp8_stage_x3" ? 3 * sms : rows / 8;
    cudaFuncSetAttribute(row_stages<8, 2048>, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536);
    row_stages<8, 2048><<<blocks, 256, 65536, s>>>(p, rows / 8, row_bytes, o);
  } else if (kind == "gemv16s" || kind == "gemv16p") {
    cudaFuncSetAttribute(row_stages<16, 1024>, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536);
    row_stages<16, 1024><<<kind == "gemv16p" ? 2 * sms : rows / 16, 256, 65536, s>>>(
        p, rows / 16, row_bytes, o);
  } else if (kind == "gemv_q" || kind == "gemv_c") {
    auto k = kind == "gemv_c" ? gemv_shape<true> : gemv_shape<false>;
    cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 41 * 1024);
    k<<<rows / 8, 128, 41 * 1024, s>>>(p, row_bytes, o);
  } else {
    auto k = kind == "fp8" ? fp8<false> : fp8<true>;
    k<<<2 * sms, 256, 0, s>>>(p, rows / 8, row_bytes, o);
  }
}
"""

CPP_SRC = ("void run(const std::string& kind, torch::Tensor w, int64_t offset, int64_t rows, "
           "int64_t row_bytes, torch::Tensor out, int64_t sms);")

# (kind, rows, row bytes): gate/up's bytes, 16-bit (K = 4096) and FP8.
CASES = [("gemv16", 28672, 8192), ("split", 28672, 8192), ("split_rows", 28672, 8192),
         ("fp8", 28672, 4096), ("fp8_rows", 28672, 4096),
         ("fp8_stage", 28672, 4096), ("fp8_stage_x3", 28672, 4096),
         ("fp8_stage_t1", 28672, 4096), ("fp8_stage", 4096, 14336), ("fp8_stage_x3", 4096, 14336),
         ("fp8", 4096, 14336), ("fp8_stage", 6144, 4096), ("fp8", 6144, 4096),
         ("fp8_stage", 4096, 4096), ("fp8", 4096, 4096),
         ("gemv_q", 28672, 8192), ("gemv_c", 28672, 8192), ("gemv_q", 6144, 8192),
         ("gemv_c", 6144, 8192), ("gemv_q", 4096, 8192), ("gemv_c", 4096, 8192)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--case", action="append", default=[], metavar="KIND:ROWS:BYTES",
                    help="time these orders and shapes instead of the default list")
    args = ap.parse_args()
    cases = [(k, int(r), int(b)) for k, r, b in (c.split(":") for c in args.case)] or CASES
    if not torch.cuda.is_available():
        raise SystemExit("gpu_stream_patterns: needs a CUDA device")
    mod = load_inline("stream_patterns", CPP_SRC, cuda_sources=CUDA_SRC, functions=["run"],
                      extra_cuda_cflags=["-O3", "-arch=sm_90a"], verbose=False)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pool = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device="cuda")
    out = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    lines = [f"# Weight streams by access order ({torch.cuda.get_device_name(0)}, {sms} SMs)", "",
             "`python benchmarks/gpu_stream_patterns.py --out DIR`; pure reads of a weight's "
             "bytes (rows x bytes a row) in each projection's order, a CUDA graph of 20 "
             "launches rotating over 1 GiB.", "",
             "| order | rows x bytes | MB a launch | µs | TB/s |", "| --- | --- | ---: | ---: | ---: |"]
    for kind, rows, row_bytes in cases:
        size = rows * row_bytes
        offsets = [(i * size) % ((1 << 30) - size) // 4096 * 4096 for i in range(20)]
        us = 1e6 * gpu_kernels.time_graph(
            lambda i: mod.run(kind, pool, offsets[i], rows, row_bytes, out, sms), len(offsets), reps=5)
        lines.append(f"| {kind} | {rows} x {row_bytes} | {size / 1e6:.1f} | {us:.2f} | {size / us / 1e6:.3f} |")
        print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stream_patterns.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
