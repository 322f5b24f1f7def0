// pybind11 bindings of the CUDA kernels (turbomq._native.cuda). Compiled only
// when the build has CUDA. Arguments are device addresses, sizes and the
// caller's stream as integers: the extension never links against torch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "kernels.h"

namespace py = pybind11;

namespace turbomq {

void bind_cuda(py::module_& parent) {
  using cuda::DType;
  py::module_ m = parent.def_submodule("cuda", "CUDA kernels (raw device pointers)");
  py::enum_<DType>(m, "DType")
      .value("F32", DType::kF32)
      .value("F16", DType::kF16)
      .value("BF16", DType::kBF16)
      .value("I8", DType::kI8);
  m.attr("ATTENTION_TILE_ROWS") = cuda::kAttentionTileRows;
  m.attr("ATTENTION_PARTITION_ALIGN") = cuda::kAttentionPartitionAlign;
  m.attr("PREFILL_TILE_ROWS") = cuda::kPrefillTileRows;
  m.attr("GEMV_MAX_ROWS") = cuda::kGemvMaxRows;
  m.attr("GEMV_MAX_FUSED_ROWS") = cuda::kGemvMaxFusedRows;
  m.attr("GEMV_SMEM_BYTES") = cuda::kGemvSmemBytes;
  m.attr("GEMV_FP8_X_BYTES") = cuda::kGemvFp8XBytes;

  m.def("rms_norm", &cuda::rms_norm, py::arg("out"), py::arg("x"), py::arg("x_stride"),
        py::arg("weight"), py::arg("rows"), py::arg("hidden"), py::arg("eps"), py::arg("dtype"),
        py::arg("stream"));
  m.def("rotary", &cuda::rotary, py::arg("q_out"), py::arg("k_out"), py::arg("q"),
        py::arg("q_stride_tok"), py::arg("q_stride_head"), py::arg("k"), py::arg("k_stride_tok"),
        py::arg("k_stride_head"), py::arg("positions"), py::arg("cos_sin"), py::arg("tokens"),
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("dtype"),
        py::arg("stream"));
  m.def("quantize_fp8", &cuda::quantize_fp8, py::arg("q"), py::arg("scale"), py::arg("x"),
        py::arg("x_stride"), py::arg("norm_weight"), py::arg("rows"), py::arg("hidden"),
        py::arg("eps"), py::arg("dtype"), py::arg("stream"));
  m.def("fp8_scale", &cuda::fp8_scale, py::arg("out"), py::arg("y"), py::arg("y_stride"),
        py::arg("sx"), py::arg("sw"), py::arg("rows"), py::arg("n_out"), py::arg("epilogue"),
        py::arg("dtype"), py::arg("stream"));
  m.def("silu_mul", &cuda::silu_mul, py::arg("out"), py::arg("gate_up"), py::arg("in_stride"),
        py::arg("tokens"), py::arg("inter"), py::arg("dtype"), py::arg("stream"));
  m.def("write_kv", &cuda::write_kv, py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"),
        py::arg("v_scale"), py::arg("k"), py::arg("k_stride_tok"), py::arg("k_stride_head"),
        py::arg("v"), py::arg("v_stride_tok"), py::arg("v_stride_head"), py::arg("slot_mapping"),
        py::arg("tokens"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"),
        py::arg("dtype"), py::arg("cache_dtype"), py::arg("stream"));
  m.def("rotary_write_kv", &cuda::rotary_write_kv, py::arg("q_out"), py::arg("q"),
        py::arg("q_stride_tok"), py::arg("q_stride_head"), py::arg("k"), py::arg("k_stride_tok"),
        py::arg("k_stride_head"), py::arg("v"), py::arg("v_stride_tok"), py::arg("v_stride_head"),
        py::arg("positions"), py::arg("cos_sin"), py::arg("slot_mapping"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"), py::arg("tokens"),
        py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"),
        py::arg("dtype"), py::arg("cache_dtype"), py::arg("stream"));
  m.attr("ALL_REDUCE_MAX_RANKS") = cuda::kAllReduceMaxRanks;
  m.def("all_reduce_buffer_alloc", &cuda::all_reduce_buffer_alloc, py::arg("capacity"),
        py::arg("ranks"));
  m.def("set_all_reduce_push", &cuda::set_all_reduce_push, py::arg("on"));
  m.def("all_reduce_push", &cuda::all_reduce_push);
  m.def("set_all_reduce_ll_bytes", &cuda::set_all_reduce_ll_bytes, py::arg("bytes"));
  m.def("all_reduce_ll_bytes", &cuda::all_reduce_ll_bytes);
  m.attr("ALL_REDUCE_LL_MAX_BYTES") = cuda::kAllReduceLLMaxBytes;
  m.def("all_reduce_buffer_free", &cuda::all_reduce_buffer_free, py::arg("buffer"));
  m.def("ipc_handle", [](std::uintptr_t buffer) { return py::bytes(cuda::ipc_handle(buffer)); },
        py::arg("buffer"));
  m.def("ipc_open", &cuda::ipc_open, py::arg("handle"));
  m.def("ipc_close", &cuda::ipc_close, py::arg("mapped"));
  m.def("all_reduce", &cuda::all_reduce, py::arg("out"), py::arg("input"), py::arg("residual"),
        py::arg("elements"), py::arg("dtype"), py::arg("buffers"), py::arg("rank"),
        py::arg("capacity"), py::arg("stream"));
  m.def("set_programmatic_launch", &cuda::set_programmatic_launch, py::arg("on"));
  m.def("programmatic_launch", &cuda::programmatic_launch);
  m.def("set_attention_programmatic", &cuda::set_attention_programmatic, py::arg("on"));
  py::enum_<cuda::GemvEpilogue>(m, "GemvEpilogue")
      .value("STORE", cuda::GemvEpilogue::kStore)
      .value("ADD_INTO", cuda::GemvEpilogue::kAddInto)
      .value("SILU_MUL", cuda::GemvEpilogue::kSiluMul);
  m.def("gemv", &cuda::gemv, py::arg("y"), py::arg("x"), py::arg("w"), py::arg("rows"),
        py::arg("n_out"), py::arg("k_in"), py::arg("dtype"), py::arg("stream"),
        py::arg("norm_weight") = 0, py::arg("eps") = 0.0f,
        py::arg("epilogue") = cuda::GemvEpilogue::kStore, py::arg("w_scale") = 0);
  m.def("gemv_qkv_rope", &cuda::gemv_qkv_rope, py::arg("q_out"), py::arg("x"), py::arg("w"),
        py::arg("rows"), py::arg("k_in"), py::arg("norm_weight"), py::arg("eps"),
        py::arg("positions"), py::arg("cos_sin"), py::arg("slot_mapping"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
        py::arg("block_size"), py::arg("dtype"), py::arg("stream"), py::arg("w_scale") = 0);

  m.attr("GEMM_INVARIANT_TRANSPOSED_MAX_ROWS") = cuda::kGemmInvariantTransposedMaxRows;
  m.def("set_prefill_attention_wgmma", &cuda::set_prefill_attention_wgmma, py::arg("on"));
  m.def("prefill_attention_wgmma", &cuda::prefill_attention_wgmma);
  m.def("set_prefill_attention_tma", &cuda::set_prefill_attention_tma, py::arg("on"));
  m.def("prefill_attention_tma", &cuda::prefill_attention_tma);
  m.def("prefill_attention_blocks_per_sm", &cuda::prefill_attention_blocks_per_sm,
        py::arg("head_dim"), py::arg("dtype"), py::arg("cache_dtype"), py::arg("block_size"));
  m.def(
      "gemm_invariant_tiling",
      [](std::int64_t rows, std::int64_t n_out, std::int64_t k_in, bool residual, bool silu) {
        const auto t = cuda::gemm_invariant_tiling(rows, n_out, k_in, residual, silu);
        return std::make_pair(t.rows, t.cols);
      },
      py::arg("rows"), py::arg("n_out"), py::arg("k_in"), py::arg("residual") = false,
      py::arg("silu") = false);
  m.def(
      "gemm_invariant",
      [](std::uintptr_t y, std::uintptr_t x, std::uintptr_t w, std::int64_t rows,
         std::int64_t n_out, std::int64_t k_in, cuda::DType dtype, std::uintptr_t stream,
         std::uintptr_t residual, bool silu_mul, float norm_eps,
         std::uintptr_t row_scale, int tile_rows, int tile_cols) {
        cuda::gemm_invariant(y, x, w, rows, n_out, k_in, dtype, stream, residual, silu_mul,
                             norm_eps, row_scale, {tile_rows, tile_cols});
      },
      py::arg("y"), py::arg("x"), py::arg("w"), py::arg("rows"), py::arg("n_out"),
      py::arg("k_in"), py::arg("dtype"), py::arg("stream"),
      py::arg("residual") = 0,
      py::arg("silu_mul") = false, py::arg("norm_eps") = 0.0f, py::arg("row_scale") = 0,
      py::arg("tile_rows") = -1, py::arg("tile_cols") = 0);

  m.def(
      "gemm_invariant_qkv_rope",
      [](std::uintptr_t y, std::uintptr_t x, std::uintptr_t w, std::int64_t rows,
         std::int64_t k_in, cuda::DType dtype, std::uintptr_t stream, float norm_eps,
         std::uintptr_t positions, std::uintptr_t cos_sin, std::uintptr_t slots,
         std::uintptr_t k_cache, std::uintptr_t v_cache, int num_heads, int num_kv_heads,
         int head_dim, int block_size) {
        cuda::RopeKV rope;
        rope.positions = reinterpret_cast<const std::int64_t*>(positions);
        rope.cos_sin = reinterpret_cast<const float*>(cos_sin);
        rope.slots = reinterpret_cast<const std::int64_t*>(slots);
        rope.k_cache = reinterpret_cast<void*>(k_cache);
        rope.v_cache = reinterpret_cast<void*>(v_cache);
        rope.num_heads = num_heads;
        rope.num_kv_heads = num_kv_heads;
        rope.head_dim = head_dim;
        rope.block_size = block_size;
        const std::int64_t n_out =
            static_cast<std::int64_t>(num_heads + 2 * num_kv_heads) * head_dim;
        cuda::gemm_invariant(y, x, w, rows, n_out, k_in, dtype, stream, 0, false, norm_eps, 0,
                             {-1, 0}, rope);
      },
      py::arg("y"), py::arg("x"), py::arg("w"), py::arg("rows"), py::arg("k_in"),
      py::arg("dtype"), py::arg("stream"), py::arg("norm_eps"), py::arg("positions"),
      py::arg("cos_sin"), py::arg("slots"), py::arg("k_cache"), py::arg("v_cache"),
      py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
      py::arg("block_size"));
  m.def(
      "paged_attention",
      [](std::uintptr_t out, std::uintptr_t q, std::int64_t q_stride_tok,
         std::int64_t q_stride_head, std::uintptr_t k_cache, std::uintptr_t v_cache,
         std::uintptr_t k_scale, std::uintptr_t v_scale, std::uintptr_t block_tables,
         int max_blocks, std::uintptr_t cu_q_lens, std::uintptr_t context_lens,
         std::uintptr_t tiles, int num_tiles, int num_heads, int num_kv_heads, int head_dim,
         int block_size, float scale, int partition_size, int num_parts, std::uintptr_t part_o,
         std::uintptr_t part_ml, DType dtype, DType cache_dtype, std::uintptr_t stream,
         std::uintptr_t counters, bool prefill, std::int64_t cache_blocks, bool load_ahead) {
        cuda::AttentionArgs a;
        a.out = out;
        a.q = q;
        a.q_stride_tok = q_stride_tok;
        a.q_stride_head = q_stride_head;
        a.k_cache = k_cache;
        a.v_cache = v_cache;
        a.k_scale = k_scale;
        a.v_scale = v_scale;
        a.block_tables = block_tables;
        a.max_blocks = max_blocks;
        a.cu_q_lens = cu_q_lens;
        a.context_lens = context_lens;
        a.tiles = tiles;
        a.num_tiles = num_tiles;
        a.num_heads = num_heads;
        a.num_kv_heads = num_kv_heads;
        a.head_dim = head_dim;
        a.block_size = block_size;
        a.scale = scale;
        a.partition_size = partition_size;
        a.num_parts = num_parts;
        a.part_o = part_o;
        a.part_ml = part_ml;
        a.dtype = dtype;
        a.cache_dtype = cache_dtype;
        a.stream = stream;
        a.counters = counters;
        a.cache_blocks = cache_blocks;
        a.load_ahead = load_ahead;
        if (prefill) {
          cuda::prefill_attention(a);
        } else {
          cuda::paged_attention(a);
        }
      },
      py::arg("out"), py::arg("q"), py::arg("q_stride_tok"), py::arg("q_stride_head"),
      py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"),
      py::arg("block_tables"), py::arg("max_blocks"), py::arg("cu_q_lens"),
      py::arg("context_lens"), py::arg("tiles"), py::arg("num_tiles"), py::arg("num_heads"),
      py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"), py::arg("scale"),
      py::arg("partition_size"), py::arg("num_parts"), py::arg("part_o"), py::arg("part_ml"),
      py::arg("dtype"), py::arg("cache_dtype"), py::arg("stream"), py::arg("counters") = 0,
      py::arg("prefill") = false, py::arg("cache_blocks") = 0,
      py::arg("load_ahead") = false);
}

}  // namespace turbomq
