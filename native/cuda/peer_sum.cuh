// The peer-memory buffers of the tensor-parallel all-reduce (all_reduce.cu)
// and what the GEMV needs of them to fuse the all-reduce into its
// neighbours (gemv.cu): a projection that yields a partial sum pushes its
// output into its slot of every rank's buffer and signals the peers when its
// last block is done; the next projection, in its x prologue, waits for
// every rank's signal and sums the slots (then the residual add and the
// norm). That removes the all-reduce's own launch and barrier from every
// o and down projection but the last.
//
// Layout of each rank's buffer (zeroed at allocation): the flags peers set
// at the all-reduce kernel's barrier ([block][rank]), the fused pushes'
// flags ([rank]), this rank's call counter and two block counts (read only
// by this rank), then two data halves of one `capacity`-byte slot per rank.
// Call n (an all-reduce kernel, or a push and the sum that consumes it)
// uses half n % 2: a rank can only start call n + 2 after every peer has
// finished call n + 1, so after it is done with call n (kernels on one
// stream run in order), and no peer still reads or writes that half. The
// counter lives on the device so that CUDA graphs replay with fresh flags:
// the last block of the kernel that completes a call advances it (every
// block has read it by then).
#pragma once

#include "common.cuh"

namespace turbomq {
namespace cuda {

struct PeerHeader {
  std::uint32_t flags[kAllReduceMaxBlocks][kAllReduceMaxRanks];  // all_reduce_kernel's barrier
  std::uint32_t push_flags[kAllReduceMaxRanks];  // rank r's push of call n is complete: n
  std::uint32_t counter;       // the last completed call
  std::uint32_t blocks_done;   // blocks of the completing kernel past their reads
  std::uint32_t pushes_done;   // blocks of the pushing GEMV done with their stores
};
constexpr std::size_t kPeerDataOffset = (sizeof(PeerHeader) + 255) / 256 * 256;

// acc[0..8) += the eight values of v (a slot's vector, in rank order).
template <typename T>
__device__ __forceinline__ void add8(float* acc, const uint4& v) {
  float f[8];
  unpack8<T>(v, f);
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] += f[e];
}

// Every rank's buffer, mapped here, and which one is this rank's.
struct PeerLink {
  char* buffers[kAllReduceMaxRanks];
  std::int64_t capacity;  // bytes of one slot
  int rank, ranks;
};

__device__ __forceinline__ void store_release(std::uint32_t* p, std::uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ std::uint32_t load_acquire(const std::uint32_t* p) {
  std::uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ PeerHeader* peer_header(const PeerLink& l, int b) {
  return reinterpret_cast<PeerHeader*>(l.buffers[b]);
}

// The call this kernel serves (read after grid_dependency_wait: the previous
// call's completing kernel advanced the counter).
__device__ __forceinline__ std::uint32_t peer_call(const PeerLink& l) {
  return *reinterpret_cast<volatile std::uint32_t*>(&peer_header(l, l.rank)->counter) + 1;
}

// Slot s of rank b's buffer in call `call`'s half.
__device__ __forceinline__ char* peer_slot(const PeerLink& l, int b, int s, std::uint32_t call) {
  const std::int64_t half = static_cast<std::int64_t>(call & 1) * l.ranks * l.capacity;
  return l.buffers[b] + kPeerDataOffset + half + s * l.capacity;
}

// The completing kernel's last block to get here advances the counter.
__device__ __forceinline__ void peer_complete_call(const PeerLink& l, std::uint32_t call) {
  if (threadIdx.x != 0) return;
  PeerHeader* self = peer_header(l, l.rank);
  __threadfence();
  if (atomicAdd(&self->blocks_done, 1u) == gridDim.x - 1) {
    self->blocks_done = 0;
    self->counter = call;
  }
}

// After a block's pushes (every thread's stores to the peers' slots): the
// last block of the grid sets this rank's push flag in every buffer.
__device__ __forceinline__ void peer_signal_push(const PeerLink& l, std::uint32_t call) {
  __syncthreads();
  if (threadIdx.x != 0) return;
  PeerHeader* self = peer_header(l, l.rank);
  __threadfence_system();  // this block's stores, before its count
  if (atomicAdd(&self->pushes_done, 1u) == gridDim.x - 1) {
    self->pushes_done = 0;
    __threadfence_system();  // every block's stores (their counts came first), before the flags
    for (int r = 0; r < l.ranks; ++r) store_release(&peer_header(l, r)->push_flags[l.rank], call);
  }
}

// Until every rank's push of `call` is in this rank's buffer (threads
// 0..ranks-1 wait, the block syncs).
__device__ __forceinline__ void peer_wait_pushes(const PeerLink& l, std::uint32_t call) {
  if (threadIdx.x < l.ranks) {
    const std::uint32_t* flag = &peer_header(l, l.rank)->push_flags[threadIdx.x];
    while (load_acquire(flag) < call) {
    }
  }
  __syncthreads();
}

}  // namespace cuda
}  // namespace turbomq
