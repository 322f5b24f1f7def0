// One-shot all-reduce over peer memory (NVLink), for the small messages of
// tensor-parallel decode (a 4096-wide row is 8 KiB). Every rank's buffer is
// mapped by every peer (CUDA IPC) and holds a slot per rank. Pushing (the
// default up to kPushMaxBytes): every rank writes its input into its slot of
// every peer's buffer, meets the peers at a flag barrier, then sums its own
// input and the peers' slots of its own buffer. Pulling: every rank writes
// its input into its slot of its own buffer and, after the barrier, reads
// each peer's slot from the peer's buffer. One kernel, no NCCL launch, no
// ring steps; pushing leaves only posted NVLink writes before the barrier and
// local reads after it, where pulling waits for a read round trip over
// NVLink. Every rank sums in rank order in fp32 and rounds once, so all
// ranks hold the same bits, whatever the grid. The residual add of the
// projection it completes is fused (out = residual + round(sum)), rounded as
// the separate add rounds.
//
// Layout of each rank's buffer (zeroed at allocation): the flags peers set
// at the barrier ([block][rank] uint32), this rank's call counter and block
// count (read only by this rank), then two data halves of one `capacity`
// byte slot per rank, then two LL halves of one kLLSlotBytes slot per rank.
// Call n uses half n % 2: a rank can only start call n + 2 after every peer
// has arrived at call n + 1, i.e. finished call n (kernels on one stream run
// in order), so no peer still reads or writes that half. The counter lives
// on the device so that CUDA graphs replay the kernel with fresh flags; the
// last block of a call to finish advances it (every block has read it by
// then).
// Small messages (up to set_all_reduce_ll_bytes, within
// kAllReduceLLMaxBytes) take the low-latency kernel instead: each 16-byte
// line a rank pushes carries 8 bytes of data and the call number twice
// ({d0, call, d1, call}), so a reader spins on the lines themselves until
// both numbers are this call's. No fence, no flag barrier: one NVLink trip
// from a rank's store to its peer's sum, at twice the bytes on the link.
// The LL lines live in their own area past the data halves (two halves by
// call parity, as the data), so no data store can leave a stale line that
// looks like a later call's.
// Launched as a programmatic dependent (where programmatic_launch() is on),
// it waits for the projection before anything else and lets the next
// kernel start at once, so the next GEMV fetches its weights while this one
// waits at the barrier.
#include <algorithm>
#include <cstring>

#include "common.cuh"

namespace turbomq {
namespace cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // vectors a thread loads before it pushes them
constexpr std::int64_t kPushMaxBytes = 12 << 20;  // larger messages are pulled

struct Header {
  std::uint32_t flags[kAllReduceMaxBlocks][kAllReduceMaxRanks];
  std::uint32_t counter;
  std::uint32_t blocks_done;
};
constexpr std::size_t kDataOffset = (sizeof(Header) + 255) / 256 * 256;
constexpr std::int64_t kLLSlotBytes = 2 * kAllReduceLLMaxBytes;  // a line per 8 data bytes
static_assert(kAllReduceLLMaxBytes / 16 <= static_cast<std::int64_t>(kAllReduceMaxBlocks) * kThreads,
              "an LL message is one vector a thread");

std::size_t ll_offset(std::int64_t capacity, int ranks) {
  return kDataOffset + 2 * static_cast<std::size_t>(ranks) * static_cast<std::size_t>(capacity);
}

struct AllReduceArgs {
  char* buffers[kAllReduceMaxRanks];  // every rank's buffer, mapped here
  std::int64_t ll;                    // offset of the LL area in each buffer
  const uint4* in;
  uint4* out;
  const uint4* residual;  // or null
  std::int64_t vectors;   // 16-byte vectors of the message
  std::int64_t capacity;  // bytes of one data half
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

__device__ __forceinline__ void store_volatile(uint4* p, const uint4& v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ uint4 load_volatile(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

template <typename T>
__device__ __forceinline__ void add8(float* acc, const uint4& v) {
  float f[8];
  unpack8<T>(v, f);
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] += f[e];
}

// The last block of a call to finish advances the call counter (every block
// has read it by then; within a block, the caller's barrier says so). A lone
// block has no other to count: it writes the counter, and the kernel's end
// orders that before the next call reads it.
__device__ __forceinline__ void finish_call(Header* self, std::uint32_t call) {
  if (gridDim.x == 1) {
    if (threadIdx.x == 0) self->counter = call;
    return;
  }
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&self->blocks_done, 1u) == gridDim.x - 1) {
      self->blocks_done = 0;
      self->counter = call;
    }
  }
}

template <typename T, int R, bool kPush>
__global__ void __launch_bounds__(kThreads) all_reduce_kernel(const AllReduceArgs a) {
  grid_dependency_wait();  // the input, the residual and the last call's counter
  launch_dependents();
  Header* self = reinterpret_cast<Header*>(a.buffers[a.rank]);
  const std::uint32_t call = *reinterpret_cast<volatile std::uint32_t*>(&self->counter) + 1;
  const std::int64_t half = static_cast<std::int64_t>(call & 1) * R * a.capacity;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kThreads;
  const std::int64_t first = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  // Slot s of rank b's buffer in this call's half.
  auto slot = [&](int b, int s) {
    return reinterpret_cast<uint4*>(a.buffers[b] + kDataOffset + half + s * a.capacity);
  };
  // Each block copies and later reduces the same vectors on every rank, so
  // it needs only the same block of each peer at the barrier. Pushing, a
  // rank's own input stays where it is (it sums it from `in`); the loads
  // go kUnroll at a time so that more of them are in flight per thread.
  for (std::int64_t v0 = first; v0 < a.vectors; v0 += kUnroll * stride) {
    uint4 x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::int64_t v = v0 + u * stride;
      if (v < a.vectors) x[u] = a.in[v];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::int64_t v = v0 + u * stride;
      if (v >= a.vectors) break;
      if constexpr (kPush) {
#pragma unroll
        for (int r = 0; r < R; ++r)
          if (r != a.rank) slot(r, a.rank)[v] = x[u];
      } else {
        slot(a.rank, a.rank)[v] = x[u];
      }
    }
  }
  __syncthreads();
  if (threadIdx.x < R) {
    Header* peer = reinterpret_cast<Header*>(a.buffers[threadIdx.x]);
    store_release(&peer->flags[blockIdx.x][a.rank], call);
    while (load_acquire(&self->flags[blockIdx.x][threadIdx.x]) < call) {
    }
  }
  __syncthreads();
  const uint4* data[R];
#pragma unroll
  for (int r = 0; r < R; ++r)
    data[r] = kPush && r == a.rank ? a.in : slot(kPush ? a.rank : r, r);
  for (std::int64_t v = first; v < a.vectors; v += stride) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < R; ++r) add8<T>(acc, __ldcg(data[r] + v));  // past L1: peers wrote it
    if (a.residual != nullptr) {
      float res[8];
      unpack8<T>(a.residual[v], res);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = round_to<T>(acc[e]) + res[e];
    }
    a.out[v] = pack8<T>(acc);
  }
  finish_call(self, call);
}

// The low-latency kernel: one 16-byte vector of the message a thread. It
// pushes the vector to every peer as two LL lines, then sums the ranks'
// vectors in rank order (its own from its input), spinning on each peer's
// lines until they carry this call's number.
template <typename T, int R>
__global__ void __launch_bounds__(kThreads) all_reduce_ll_kernel(const AllReduceArgs a) {
  grid_dependency_wait();  // the input, the residual and the last call's counter
  launch_dependents();
  Header* self = reinterpret_cast<Header*>(a.buffers[a.rank]);
  const std::uint32_t call = *reinterpret_cast<volatile std::uint32_t*>(&self->counter) + 1;
  const std::int64_t half = a.ll + static_cast<std::int64_t>(call & 1) * R * kLLSlotBytes;
  // Rank s's lines in rank b's buffer, this call's half.
  auto lines = [&](int b, int s) {
    return reinterpret_cast<uint4*>(a.buffers[b] + half + s * kLLSlotBytes);
  };
  const std::int64_t v = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (v < a.vectors) {
    const uint4 x = a.in[v];
    const uint4 res = a.residual != nullptr ? a.residual[v] : uint4{};  // read before the wait
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r == a.rank) continue;
      store_volatile(lines(r, a.rank) + 2 * v, make_uint4(x.x, call, x.y, call));
      store_volatile(lines(r, a.rank) + 2 * v + 1, make_uint4(x.z, call, x.w, call));
    }
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (r == a.rank) {
        add8<T>(acc, x);
        continue;
      }
      const uint4* src = lines(a.rank, r) + 2 * v;
      uint4 lo, hi;
      do {
        lo = load_volatile(src);
        hi = load_volatile(src + 1);
      } while (lo.y != call || lo.w != call || hi.y != call || hi.w != call);
      add8<T>(acc, make_uint4(lo.x, lo.z, hi.x, hi.z));
    }
    if (a.residual != nullptr) {
      float r[8];
      unpack8<T>(res, r);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = round_to<T>(acc[e]) + r[e];
    }
    a.out[v] = pack8<T>(acc);
  }
  __syncthreads();  // every thread has read the counter
  finish_call(self, call);
}

bool g_push = true;  // set_all_reduce_push
std::int64_t g_ll_bytes = 0;  // set_all_reduce_ll_bytes

template <typename T, int R>
void launch_ranks(const AllReduceArgs& a, int blocks, cudaStream_t s) {
  const char* name = "all_reduce_kernel";
  if (a.vectors * 16 <= std::min(g_ll_bytes, kAllReduceLLMaxBytes)) {
    launch_programmatic(all_reduce_ll_kernel<T, R>, a, dim3(blocks), kThreads, 0, s,
                        "all_reduce_ll_kernel");
    return;
  }
  // Past kPushMaxBytes pulling is faster on 2 x H200 (16 MiB: 66.8 against
  // 70.6 us pushing; 64 MiB: 240 against 274; docs/benchmarks/all_reduce.md).
  const bool push = g_push && a.vectors * 16 <= kPushMaxBytes;
  push ? launch_programmatic(all_reduce_kernel<T, R, true>, a, dim3(blocks), kThreads, 0, s, name)
       : launch_programmatic(all_reduce_kernel<T, R, false>, a, dim3(blocks), kThreads, 0, s, name);
}

template <typename T>
void launch_all_reduce(const AllReduceArgs& a, int blocks, cudaStream_t s) {
  switch (a.ranks) {
    case 2: launch_ranks<T, 2>(a, blocks, s); break;
    case 4: launch_ranks<T, 4>(a, blocks, s); break;
    case 8: launch_ranks<T, 8>(a, blocks, s); break;
    default: require(false, "all_reduce: 2, 4 or 8 ranks");
  }
}

}  // namespace

void set_all_reduce_push(bool on) { g_push = on; }
bool all_reduce_push() { return g_push; }
void set_all_reduce_ll_bytes(std::int64_t bytes) {
  require(bytes >= 0, "all_reduce: the LL threshold must be >= 0");
  g_ll_bytes = bytes;
}
std::int64_t all_reduce_ll_bytes() { return g_ll_bytes; }

std::size_t all_reduce_buffer_bytes(std::int64_t capacity, int ranks) {
  return ll_offset(capacity, ranks) + 2 * static_cast<std::size_t>(ranks) * kLLSlotBytes;
}

std::uintptr_t all_reduce_buffer_alloc(std::int64_t capacity, int ranks) {
  require(capacity > 0 && capacity % 16 == 0, "all_reduce: capacity must be a multiple of 16");
  require(ranks >= 2 && ranks <= kAllReduceMaxRanks, "all_reduce: 2 to 8 ranks");
  void* p = nullptr;
  const std::size_t bytes = all_reduce_buffer_bytes(capacity, ranks);
  check_cuda(cudaMalloc(&p, bytes), "all_reduce: cudaMalloc");
  check_cuda(cudaMemset(p, 0, bytes), "all_reduce: cudaMemset");
  check_cuda(cudaDeviceSynchronize(), "all_reduce: zeroing");
  return reinterpret_cast<std::uintptr_t>(p);
}

void all_reduce_buffer_free(std::uintptr_t buffer) {
  check_cuda(cudaFree(reinterpret_cast<void*>(buffer)), "all_reduce: cudaFree");
}

std::string ipc_handle(std::uintptr_t buffer) {
  cudaIpcMemHandle_t h;
  check_cuda(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(buffer)), "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

std::uintptr_t ipc_open(const std::string& handle) {
  require(handle.size() == sizeof(cudaIpcMemHandle_t), "ipc_open: not a CUDA IPC handle");
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* p = nullptr;
  check_cuda(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
  return reinterpret_cast<std::uintptr_t>(p);
}

void ipc_close(std::uintptr_t mapped) {
  check_cuda(cudaIpcCloseMemHandle(reinterpret_cast<void*>(mapped)), "cudaIpcCloseMemHandle");
}

void all_reduce(std::uintptr_t out, std::uintptr_t in, std::uintptr_t residual,
                std::int64_t elements, DType dtype, const std::vector<std::uintptr_t>& buffers,
                int rank, std::int64_t capacity, std::uintptr_t stream) {
  const int ranks = static_cast<int>(buffers.size());
  require(ranks >= 2 && ranks <= kAllReduceMaxRanks && rank >= 0 && rank < ranks,
          "all_reduce: bad rank or number of ranks");
  require(dtype == DType::kF16 || dtype == DType::kBF16, "all_reduce: float16 or bfloat16");
  const std::int64_t bytes = elements * 2;
  require(elements > 0 && bytes % 16 == 0 && bytes <= capacity,
          "all_reduce: the message must be a multiple of 16 bytes, at most the capacity");
  require(out % 16 == 0 && in % 16 == 0 && residual % 16 == 0,
          "all_reduce: pointers must be 16-byte aligned");
  AllReduceArgs a{};
  for (int r = 0; r < ranks; ++r) a.buffers[r] = reinterpret_cast<char*>(buffers[r]);
  a.in = reinterpret_cast<const uint4*>(in);
  a.out = reinterpret_cast<uint4*>(out);
  a.residual = reinterpret_cast<const uint4*>(residual);
  a.vectors = bytes / 16;
  a.capacity = capacity;
  a.ll = static_cast<std::int64_t>(ll_offset(capacity, ranks));
  a.rank = rank;
  a.ranks = ranks;
  const int blocks = static_cast<int>(
      std::min<std::int64_t>((a.vectors + kThreads - 1) / kThreads, kAllReduceMaxBlocks));
  if (dtype == DType::kF16) {
    launch_all_reduce<__half>(a, blocks, as_stream(stream));
  } else {
    launch_all_reduce<__nv_bfloat16>(a, blocks, as_stream(stream));
  }
}

}  // namespace cuda
}  // namespace turbomq
