// Hopper's tensor memory accelerator (TMA, sm_90a): 2D tiles copied from
// global to shared memory by one thread, completion counted in bytes on a
// shared-memory mbarrier that the other threads wait on; and, on the host,
// the tensor maps that describe the global tensors (encoded through the
// driver entry point, so the extension links no libcuda).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>

#include "common.cuh"
#include "wgmma.cuh"

namespace turbomq {
namespace cuda {

// mbarrier at shared address `bar`, expecting one arrival per phase.
__device__ __forceinline__ void mbarrier_init(std::uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}
// Makes initialized mbarriers visible to the copies that complete on them
// (the block syncs after it).
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// The arrival of this phase, and the bytes the copies will complete on it.
__device__ __forceinline__ void mbarrier_expect_bytes(std::uint32_t bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
// Until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(std::uint32_t bar, int parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "TURBOMQ_MBARRIER_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra TURBOMQ_MBARRIER_WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// The box of `map` at (x: inner, y: outer) into shared `dst`, completing
// on `bar`. The map's swizzle lays it out (128 bytes: wgmma's panels).
__device__ __forceinline__ void tma_load_2d(std::uint32_t dst, const CUtensorMap* map, int x, int y,
                                            std::uint32_t bar) {
  TURBOMQ_WGMMA_ASM(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

// A 2D tensor map over `rows` rows of `cols` 16-bit elements (rows 2 cols
// bytes apart) at `base`, boxes of 64 x `box_rows` elements (128-byte rows,
// the 128-byte swizzle); elements past the tensor read as zeros. l2_256:
// a load asks L2 for 256 bytes around each 128-byte row (rows streamed
// once, along k: the next box's half arrives with this one).
inline CUtensorMap encode_tensor_map_2d(std::uintptr_t base, std::uint64_t rows, int cols,
                                        DType dtype, int box_rows, bool l2_256 = false) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    cudaDriverEntryPointQueryResult status;
    void* fn = nullptr;
    check_cuda(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                cudaEnableDefault, &status),
               "tensor map: driver entry point");
    require(fn != nullptr && status == cudaDriverEntryPointSuccess,
            "tensor map: cuTensorMapEncodeTiled not found");
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), rows};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode(
      &map, dtype == DType::kF16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
      2, reinterpret_cast<void*>(base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      l2_256 ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B : CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  require(r == CUDA_SUCCESS, "tensor map: cuTensorMapEncodeTiled failed");
  return map;
}

using TensorMapCache =
    std::map<std::tuple<std::uintptr_t, std::uint64_t, int, int, int, bool>, CUtensorMap>;

// The map of (base, rows, cols, dtype, box rows, l2_256) from `cache`,
// encoded on a miss; the cache is emptied first when it holds `bound` maps.
inline const CUtensorMap& cached_tensor_map_2d(TensorMapCache& cache, std::size_t bound,
                                               std::uintptr_t base, std::uint64_t rows, int cols,
                                               DType dtype, int box_rows, bool l2_256 = false) {
  const auto key = std::make_tuple(base, rows, cols, static_cast<int>(dtype), box_rows, l2_256);
  const auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  if (cache.size() >= bound) cache.clear();
  return cache.emplace(key, encode_tensor_map_2d(base, rows, cols, dtype, box_rows, l2_256))
      .first->second;
}

// For tensors that stay where they are (the KV pool, weights): every map
// kept, so the reference stays valid.
inline const CUtensorMap& tensor_map_2d(std::uintptr_t base, std::uint64_t rows, int cols,
                                        DType dtype, int box_rows = 64, bool l2_256 = false) {
  static TensorMapCache cache;
  return cached_tensor_map_2d(cache, SIZE_MAX, base, rows, cols, dtype, box_rows, l2_256);
}

// For activations, returned by value: their buffers come and go (the
// allocator reuses a few addresses, the row count changes with every
// batch), so the cache is emptied past 4096 maps. An eager prefill launches
// hundreds of GEMMs, and encoding each one's map (a driver call) would add
// its cost to every launch.
inline CUtensorMap transient_tensor_map_2d(std::uintptr_t base, std::uint64_t rows, int cols,
                                           DType dtype, int box_rows) {
  static TensorMapCache cache;
  return cached_tensor_map_2d(cache, 4096, base, rows, cols, dtype, box_rows);
}

}  // namespace cuda
}  // namespace turbomq
