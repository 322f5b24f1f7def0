// Host-side entry points of the CUDA kernels. Plain C++ (no CUDA headers), so
// the pybind11 layer compiles with the host compiler. Tensors cross as raw
// device addresses plus shapes; `stream` is the caller's cudaStream_t as an
// integer. Every function checks its launch and throws std::runtime_error on
// a CUDA error or an unsupported shape.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace turbomq {
namespace cuda {

// Where a qkv store that fuses rotary and the KV write puts its rows: q
// [rows, num_heads, head_dim], rotated, into its output; k (rotated) and v
// into the paged caches [blocks, num_kv_heads, block_size, head_dim] at
// slots[m] (none where negative); positions [rows] index cos_sin
// [max_pos, head_dim] = cat(cos, sin). head_dim 0: no such store.
struct RopeKV {
  const std::int64_t* positions = nullptr;
  const float* cos_sin = nullptr;
  const std::int64_t* slots = nullptr;
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int num_heads = 0, num_kv_heads = 0, head_dim = 0, block_size = 0;
};

// Element types, numbered as the Python wrapper passes them.
enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2, kI8 = 3 };

// out[r] = weight * to_dtype(x[r] * rsqrt(mean(x[r]^2) + eps)); rows of `hidden`
// elements, x rows `x_stride` elements apart, out contiguous.
void rms_norm(std::uintptr_t out, std::uintptr_t x, std::int64_t x_stride, std::uintptr_t weight,
              std::int64_t rows, std::int64_t hidden, float eps, DType dtype, std::uintptr_t stream);

// Half-rotation rotary embedding of q [T, nh, d] and k [T, nkv, d] (token and
// head strides in elements, dims contiguous) into contiguous q_out, k_out.
// cos_sin: float32 [max_pos, d] = cat(cos, sin) of d/2 frequencies.
void rotary(std::uintptr_t q_out, std::uintptr_t k_out, std::uintptr_t q, std::int64_t q_stride_tok,
            std::int64_t q_stride_head, std::uintptr_t k, std::int64_t k_stride_tok,
            std::int64_t k_stride_head, std::uintptr_t positions, std::uintptr_t cos_sin,
            std::int64_t tokens, int num_heads, int num_kv_heads, int head_dim, DType dtype,
            std::uintptr_t stream);

// out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]; gate_up rows `in_stride` apart.
void silu_mul(std::uintptr_t out, std::uintptr_t gate_up, std::int64_t in_stride,
              std::int64_t tokens, std::int64_t inter, DType dtype, std::uintptr_t stream);

// Scatter k, v [T, nkv, d] (token/head strides in elements) into the paged
// cache [num_blocks, nkv, block_size, d] at slot_mapping (int64 [T]); with
// cache_dtype kI8, quantize symmetric per (token, head) and store float32
// scales [num_blocks, nkv, block_size]. Negative slots are skipped.
void write_kv(std::uintptr_t k_cache, std::uintptr_t v_cache, std::uintptr_t k_scale,
              std::uintptr_t v_scale, std::uintptr_t k, std::int64_t k_stride_tok,
              std::int64_t k_stride_head, std::uintptr_t v, std::int64_t v_stride_tok,
              std::int64_t v_stride_head, std::uintptr_t slot_mapping, std::int64_t tokens,
              int num_kv_heads, int head_dim, int block_size, DType dtype, DType cache_dtype,
              std::uintptr_t stream);

// Rotary on q and k, then k and v scattered into the paged cache, in one
// launch: q_out = rotary(q) (contiguous [T, nh, d]); the rotated k (rounded to
// the dtype, as rotary's output) and v go to the cache exactly as write_kv
// writes them (INT8: quantized per (token, head), scales stored). Equals
// rotary followed by write_kv. head_dim / 16 must be a power of two <= 32.
void rotary_write_kv(std::uintptr_t q_out, std::uintptr_t q, std::int64_t q_stride_tok,
                     std::int64_t q_stride_head, std::uintptr_t k, std::int64_t k_stride_tok,
                     std::int64_t k_stride_head, std::uintptr_t v, std::int64_t v_stride_tok,
                     std::int64_t v_stride_head, std::uintptr_t positions, std::uintptr_t cos_sin,
                     std::uintptr_t slot_mapping, std::uintptr_t k_cache, std::uintptr_t v_cache,
                     std::uintptr_t k_scale, std::uintptr_t v_scale, std::int64_t tokens,
                     int num_heads, int num_kv_heads, int head_dim, int block_size, DType dtype,
                     DType cache_dtype, std::uintptr_t stream);

// y [rows, N] = x [rows, K] @ w[N, K]^T for 1 <= rows <= kGemvMaxRows (decode
// at small batch): fp32 accumulation, one rounding to the dtype. x, w, y
// contiguous and 16-byte aligned, K a multiple of 8.
// norm_weight != 0 normalizes x first, exactly as rms_norm(x, norm_weight,
// eps) would (x then must fit in shared memory: rows * K * 2 <= 64 KiB).
// The epilogue stores y, adds into y in place (y = y + x w^T, rounded as a
// separate add: the residual stream), or with kSiluMul treats w as [2N, K]
// and writes y [rows, N] = silu(x w[:N]^T) * (x w[N:]^T), as silu_mul.
// With programmatic launch on (the default), the GEMV is launched with
// programmatic stream serialization: it starts while the previous kernel
// runs (the other kernels here signal it early), copies its first weight
// stages, and waits for that kernel before reading x.
// w_scale != 0: w is E4M3 [N, K] with a float32 scale per row at w_scale (K
// a multiple of 128, at most 4 rows, (rows + 1) * K (* 3 with the norm) <=
// kGemvFp8XBytes: x's E4M3 copy, a zero row and, with the norm, the staged
// 16-bit x and the norm weight live in shared memory, beside a ring of
// weight stages; on the tensor cores); x is quantized per row in
// the kernel exactly as quantize_fp8, and y is fp8_linear_reference's
// product (before the epilogue, which is as above).
constexpr int kGemvMaxRows = 8;
constexpr int kGemvMaxFusedRows = 4;  // with a norm or a non-store epilogue
constexpr int kGemvSmemBytes = 64 * 1024;  // x staged in shared memory up to this size
// FP8: x (and, with the norm, its 16-bit copy and the norm weight)
constexpr int kGemvFp8XBytes = 144 * 1024;
enum class GemvEpilogue : int { kStore = 0, kAddInto = 1, kSiluMul = 2 };
void set_programmatic_launch(bool on);
bool programmatic_launch();
// The paged-attention kernel as a programmatic dependent too (where
// programmatic_launch() is on): it prefetches its K/V rows into L2 while the
// kernel before it runs.
void set_attention_programmatic(bool on);
void gemv(std::uintptr_t y, std::uintptr_t x, std::uintptr_t w, std::int64_t rows,
          std::int64_t n_out, std::int64_t k_in, DType dtype, std::uintptr_t stream,
          std::uintptr_t norm_weight = 0, float eps = 0.0f,
          GemvEpilogue epilogue = GemvEpilogue::kStore, std::uintptr_t w_scale = 0);

// The qkv projection of decode at 1-4 rows with rms_norm in front and
// rotary_write_kv behind, in one launch: w [(nh + 2 nkv) * d, K]; q_out
// [rows, nh, d] gets rotated q; rotated k and v go to the 16-bit paged caches
// at slot_mapping (int64, negative: skipped), exactly as rotary_write_kv
// stores them. positions int64 [rows]; cos_sin float32 [max_pos, d].
void gemv_qkv_rope(std::uintptr_t q_out, std::uintptr_t x, std::uintptr_t w, std::int64_t rows,
                   std::int64_t k_in, std::uintptr_t norm_weight, float eps,
                   std::uintptr_t positions, std::uintptr_t cos_sin, std::uintptr_t slot_mapping,
                   std::uintptr_t k_cache, std::uintptr_t v_cache, int num_heads,
                   int num_kv_heads, int head_dim, int block_size, DType dtype,
                   std::uintptr_t stream, std::uintptr_t w_scale = 0);

// Batch-invariant GEMM (deterministic mode): y [rows, N] = x [rows, K] @
// w[N, K]^T, fp32 accumulation, one rounding to the dtype, such that row m
// of y is bit-identical whatever `rows` is and whatever the other rows hold.
// Output (m, n) is one fp32 accumulation, from zero, of the tensor-core k16
// steps over K in increasing k; no chunk sums, no split-K. Two launch shapes
// compute exactly that (Hopper, sm_90a): the tiled one (a persistent wgmma kernel
// whose tile follows rows) and the transposed one (at most
// kGemmInvariantTransposedMaxRows rows: y^T = w x^T on mma.sync, a warp per
// 16 weight rows), which gemm_invariant_tiling picks up to that many rows.
// `tiling` forces one (the tests compare them): {0, 32 or 64} the transposed
// shape with 2 or 4 warps a block; {64, 128}, {128, 64 to 256 by 32} or
// {256, 128} a tiled one's rows x weight rows; rows -1: gemm_invariant_tiling.
// x, w, y contiguous and 16-byte aligned; N and K multiples of 8.
// With `residual` ([rows, N] contiguous, the dtype, 16-byte aligned; may be
// y itself for an in-place add) the store writes
// y = T(float(residual) + float(T(total))): bit for bit the plain launch
// followed by an elementwise residual += y.
// With silu_mul, w's n_out rows (a multiple of 16) are the gate rows over
// the up rows and y is [rows, n_out / 2] = silu_mul(gate, up), bit for bit
// the plain launch followed by silu_mul (no residual then).
// With norm_eps > 0 (the folded RMSNorm: w's columns already multiplied by
// the norm weight) every row's totals are multiplied by rsqrt(mean(x^2) +
// eps) before the store, its sum of squares in one fixed order: the
// transposed shape computes it in the block; the tiled one needs
// `row_scale`, a float32 buffer of `rows` entries that a kernel launched
// first fills.
// Both shapes launch as programmatic dependents (as the GEMV, where
// programmatic_launch() is on): the first k tiles' weights load while the
// previous kernel finishes; x and the residual are read only after it.
constexpr int kGemmInvariantTransposedMaxRows = 8;
struct GemmInvariantTiling {
  int rows;  // tile rows (64, 128, 256); 0: the transposed shape; -1: choose
  int cols;  // tile weight rows (128; with 128 rows 64 to 256 by 32); transposed: 32 or 64
};
// residual: the product adds into a residual; silu: silu_mul (the transposed
// shape's width depends on them: two warps a block with either, four without).
GemmInvariantTiling gemm_invariant_tiling(std::int64_t rows, std::int64_t n_out,
                                          std::int64_t k_in, bool residual = false,
                                          bool silu = false);
// The qkv projection's store fused with rotary and the KV write (16-bit
// pools), the transposed shape only (decode): w's rows are the q, k and v
// heads ([(num_heads + 2 num_kv_heads) head_dim, K]); y is q
// [rows, num_heads, head_dim], rotated; k (rotated) and v go to the paged
// caches at slots[m] (RopeKV). Bit for bit the plain launch followed by
// rotary_write_kv.
void gemm_invariant(std::uintptr_t y, std::uintptr_t x, std::uintptr_t w, std::int64_t rows,
                    std::int64_t n_out, std::int64_t k_in, DType dtype, std::uintptr_t stream,
                    std::uintptr_t residual = 0, bool silu_mul = false, float norm_eps = 0.0f,
                    std::uintptr_t row_scale = 0, GemmInvariantTiling tiling = {-1, 0},
                    const RopeKV& rope = {});

// Per-row FP8 (E4M3) quantization of x [rows, hidden] (rows x_stride elements
// apart, 16-byte aligned; hidden a multiple of 8), after rms_norm(x,
// norm_weight, eps) when norm_weight != 0 (exactly rms_norm's result): scale
// [rows] float32 = max(amax(row) / 448, 1e-12), q [rows, hidden] E4M3 =
// round-to-nearest-even(row * (1 / scale)), saturating. The input of an FP8 GEMM.
void quantize_fp8(std::uintptr_t q, std::uintptr_t scale, std::uintptr_t x, std::int64_t x_stride,
                  std::uintptr_t norm_weight, std::int64_t rows, std::int64_t hidden, float eps,
                  DType dtype, std::uintptr_t stream);

// The per-tensor FP8 product's scales applied after it, with a GEMV
// epilogue: out[m, n] (out [rows, n_out], 16-bit) = y[m, n] * sx[m] * sw[n]
// (y [rows, >= n_out] fp32, y_stride apart; sx [rows], sw [n_out] float32),
// rounded once (kStore); rounded and added into out as the separate add
// rounds (kAddInto); or, with y holding gate | up n_out apart and sw their
// scales, silu_mul of the two rounded values (kSiluMul). n_out and y_stride
// multiples of 4.
void fp8_scale(std::uintptr_t out, std::uintptr_t y, std::int64_t y_stride, std::uintptr_t sx,
               std::uintptr_t sw, std::int64_t rows, std::int64_t n_out, GemvEpilogue epilogue,
               DType dtype, std::uintptr_t stream);

// Paged attention over block tables, decode and prefill-with-history alike.
// A "tile" is up to 16 rows (query token, query head) of one sequence sharing
// one KV head. tiles: int32 [num_tiles, 2] = (sequence, row tile), or 0 when
// every sequence has one query and heads-per-KV-head <= 16 (tile = sequence).
// With num_parts > 1 the context is split into partitions of partition_size
// keys; partials go to part_o [num_tiles, nkv, num_parts, 16, d] and
// part_ml [2, num_tiles, nkv, num_parts, 16] (float32) and are combined
// into out. With `counters` (int32 [num_tiles * nkv], all zero) the last
// block to finish each (tile, KV head) combines them in the same launch and
// sets its counter back to zero; without, a second kernel does. Launches that
// share a counter buffer must not run concurrently.
struct AttentionArgs {
  std::uintptr_t out = 0;  // [T, nh, d] contiguous, q's dtype
  std::uintptr_t q = 0;
  std::int64_t q_stride_tok = 0, q_stride_head = 0;
  std::uintptr_t k_cache = 0, v_cache = 0, k_scale = 0, v_scale = 0;
  std::uintptr_t block_tables = 0;  // int32 [S, max_blocks]
  int max_blocks = 0;
  std::uintptr_t cu_q_lens = 0;     // int32 [S + 1]
  std::uintptr_t context_lens = 0;  // int32 [S]
  std::uintptr_t tiles = 0;
  int num_tiles = 0;
  int num_heads = 0, num_kv_heads = 0, head_dim = 0, block_size = 0;
  float scale = 1.0f;
  int partition_size = 0, num_parts = 1;
  std::uintptr_t part_o = 0, part_ml = 0;
  std::uintptr_t counters = 0;  // int32 [num_tiles * nkv], zero: fuse the combine
  std::int64_t cache_blocks = 0;  // blocks in the pool (the prefill kernel's TMA maps; 0: unknown)
  DType dtype = DType::kBF16, cache_dtype = DType::kBF16;
  std::uintptr_t stream = 0;
  bool load_ahead = false;  // paged_attention, 16-bit KV: each warp loads its next group early
};
void paged_attention(const AttentionArgs& args);

// Prefill (Q of many rows per sequence) over a 16-bit or INT8 cache,
// FlashAttention-2 style: `tiles` lists (sequence, 64-row tile) pairs,
// num_tiles of them; split-K as paged_attention's, except that each tile
// cuts its own keys into the num_parts partitions (in 64-key tiles, at
// least partition_size keys each, a multiple of 64); partials of 64-row
// tiles, combined by the last block when `counters` is given, else by a
// second kernel.
// Same result as paged_attention up to the order of the sums.
// set_prefill_attention_wgmma(true) runs the same tiles on Hopper's wgmma
// (a warpgroup per tile, Q and K/V in 128-byte-swizzled shared memory).
void prefill_attention(const AttentionArgs& args);
void set_prefill_attention_wgmma(bool on);
bool prefill_attention_wgmma();
// On wgmma, 16-bit K/V tiles loaded by TMA (one thread, an mbarrier per
// stage) where the pool's blocks hold whole 64-key tiles (block size >= 64)
// and cache_blocks is given; else by cp.async as without it.
void set_prefill_attention_tma(bool on);
bool prefill_attention_tma();
// Blocks of the prefill kernel that fit on an SM of the current device, for
// the form a launch with these arguments takes (mma.sync, wgmma, TMA): the
// occupancy calculator's count from its registers and shared memory.
int prefill_attention_blocks_per_sm(int head_dim, DType dtype, DType cache_dtype,
                                    int block_size);
constexpr int kPrefillTileRows = 64;

// Rows of one tile and warps of one attention block (for the caller's sizing).
constexpr int kAttentionTileRows = 16;
constexpr int kAttentionPartitionAlign = 64;

// Tensor-parallel all-reduce over peer memory (one-shot, for small
// messages). Each rank allocates a buffer for messages of up to `capacity`
// bytes from each of `ranks` ranks, shares it with ipc_handle, maps the peers' with ipc_open, then on
// every rank in the same order calls all_reduce with every rank's buffer (its
// own and the mapped ones, in rank order): out = in summed over the ranks,
// or with `residual` != 0, out = residual + that (out may be in or
// residual). 16-bit elements, 16-byte aligned, 16-byte multiples. Every
// rank pushes its input into every peer's buffer (the default) or, with
// set_all_reduce_push(false) and for every message over 12 MiB, reads the
// peers' inputs from theirs; all ranks must agree. Messages of at most
// set_all_reduce_ll_bytes (0: none; within kAllReduceLLMaxBytes) take the
// low-latency kernel (the data and the call number in each line pushed: no
// flag barrier); all ranks must agree on that too.
constexpr int kAllReduceMaxRanks = 8;
constexpr int kAllReduceMaxBlocks = 128;
constexpr std::int64_t kAllReduceLLMaxBytes = 256 << 10;
void set_all_reduce_ll_bytes(std::int64_t bytes);
std::int64_t all_reduce_ll_bytes();
std::size_t all_reduce_buffer_bytes(std::int64_t capacity, int ranks);
std::uintptr_t all_reduce_buffer_alloc(std::int64_t capacity, int ranks);
void set_all_reduce_push(bool on);
bool all_reduce_push();
void all_reduce_buffer_free(std::uintptr_t buffer);
std::string ipc_handle(std::uintptr_t buffer);
std::uintptr_t ipc_open(const std::string& handle);
void ipc_close(std::uintptr_t mapped);
void all_reduce(std::uintptr_t out, std::uintptr_t in, std::uintptr_t residual,
                std::int64_t elements, DType dtype, const std::vector<std::uintptr_t>& buffers,
                int rank, std::int64_t capacity, std::uintptr_t stream);

}  // namespace cuda
}  // namespace turbomq
