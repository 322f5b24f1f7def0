"""CUDA backend: the reference's op signatures, run by the native kernels of
turbomq._native.cuda (native/cuda/*.cu). Tensors cross as device addresses,
sizes and the current stream; inputs the kernels do not cover (fp32, odd
sizes, misaligned views, head_dim other than 64/128 for attention) fall back
to the reference, so every call is correct on any CUDA tensor.

Each op also takes keyword-only `out` buffers (tests poison them to catch
unwritten elements); the model never passes them."""

from __future__ import annotations

from typing import Optional

import os

import numpy as np
import torch
import torch.nn.functional as F

from .layer_kv import LayerKV
from . import reference
from .fp8 import Fp8Weight, fp8_linear_reference, quantize_rows
from .attention_batch import AttentionBatch, to_device

try:
    from turbomq import _native as _native_module
except ImportError as exc:  # built without the extension
    _native_module = None
    _IMPORT_ERROR: Optional[str] = f"turbomq._native is not importable: {exc}"
else:
    _IMPORT_ERROR = None

_k = getattr(_native_module, "cuda", None)

# Split-K planning, fitted to a sweep of forced partition sizes on an H100
# (docs/kernels.md): aim for ~6 blocks per multiprocessor, but keep
# partitions >= 512 keys, since a block's fixed costs (q load, combining its
# warps, the reduce) outweigh extra parallelism below that. Only a grid that
# would not give every multiprocessor one block goes down to 64 keys (batch 1
# over 256 keys: 9.3 us at 64 against 11.1 us at 128). An INT8 pool aims for
# 3 blocks per multiprocessor: its warps prefetch the next 16 keys, so longer
# partitions keep more bytes in flight (32 x 4096: 123 us at 2048 keys
# against 137 us at 1024).
BLOCKS_PER_SM = 6
BLOCKS_PER_SM_INT8 = 3
MIN_PARTITION = 512
MIN_PARTITION_TINY = 64

# Split-K attention combines its partitions inside the attention kernel (the
# last block of each (tile, KV head) to finish), not in a second launch.
FUSED_SPLITK_COMBINE = True
# always_combine (deterministic mode's fixed partition): at most this many
# bytes of split-K partials per launch; larger batches launch over their
# tiles in turn.
ATTENTION_PARTIALS_MAX_BYTES = 1 << 30

# rotary_write_kv runs as one kernel (False: rotary then write_kv, for A/B runs).
FUSED_ROTARY_WRITE_KV = True

# linear() runs the native GEMV for inputs of at most GEMV_MAX_ROWS rows
# (decode at small batch; 0 turns it off), and for rows longer than
# GEMV_MAX_K (the down projection's 14336) only at one row; cuBLAS (F.linear)
# otherwise. Measured on an H100 (docs/kernels.md): at 1-4 rows the GEMV
# matches or beats cuBLAS on the 4096-wide projections and the LM head, and
# it starts loading weights while the previous kernel runs; with longer rows
# cuBLAS's split-K wins from 2 rows, and at 8 rows.
# TURBOMQ_GEMV_MAX_ROWS / TURBOMQ_GEMV_MAX_K override.
GEMV_MAX_ROWS = int(os.environ.get("TURBOMQ_GEMV_MAX_ROWS", "4"))
GEMV_MAX_K = int(os.environ.get("TURBOMQ_GEMV_MAX_K", "8192"))

# linear()'s norm / silu_mul / residual add run inside the GEMV (False: as
# separate kernels around it, for A/B runs) for inputs of at most
# FUSED_GEMV_MAX_ROWS rows. Measured decode graph replays on an H100
# (docs/kernels.md): batch 1 5.94 ms fused against 6.18 ms apart; batch 4
# 7.43 ms fused against 6.71 ms apart, so only one row fuses.
FUSED_GEMV = True
FUSED_GEMV_MAX_ROWS = 1


# FP8 projections run on torch._scaled_mm (cuBLASLt's FP8 GEMM, Hopper and
# later) where this PyTorch has it; at most FP8_GEMV_MAX_ROWS rows (decode at
# small batch) take the native GEMV instead: FP8 weights read once, x
# quantized, the norm and the epilogue fused, one launch per projection.
# TURBOMQ_FP8_GEMV_MAX_ROWS overrides (0: never).
_FP8_GEMM = hasattr(torch, "_scaled_mm")
FP8_GEMV_MAX_ROWS = int(os.environ.get("TURBOMQ_FP8_GEMV_MAX_ROWS", "4"))
# Past the GEMV, up to this many rows the FP8 product runs with one scale
# per tensor and an fp32 result, the row and channel scales applied after it
# with the epilogue (`fp8_scale`): cuBLASLt offers row-wise scaling a single
# configuration (128 x 128 tiles), which leaves most SMs idle at decode's
# rows. On an H100 a decode step's projections as the engine runs them took
# 4.36 ms against row-wise's 4.69 at 128 rows, 5.43 against 5.60 at 256
# (benchmarks/gpu_decode_gemms.py, docs/benchmarks/decode_gemms.md).
# TURBOMQ_FP8_TENSORWISE_MAX_ROWS overrides (0: never).
FP8_TENSORWISE_MAX_ROWS = int(os.environ.get("TURBOMQ_FP8_TENSORWISE_MAX_ROWS", "256"))
# Paged attention launched as a programmatic dependent (where TURBOMQ_PDL is
# on): it pulls its K/V rows into L2 while the qkv projection runs.
ATTENTION_PDL = os.environ.get("TURBOMQ_ATTENTION_PDL", "1") != "0"


def _on_hopper(variable: str) -> bool:
    """A wgmma switch: on where the GPU is a Hopper (sm_90) unless `variable`
    says 0; 1 forces it on."""
    value = os.environ.get(variable, "")
    if value in ("0", "1"):
        return value == "1"
    return (_k is not None and torch.cuda.is_available()
            and torch.cuda.get_device_capability()[0] == 9)


# The prefill attention kernel (PREFILL_ATTENTION, below) on Hopper's wgmma:
# a warpgroup per 64-row tile. On by default on Hopper
# (TURBOMQ_PREFILL_WGMMA=0 keeps mma.sync).
PREFILL_WGMMA = _on_hopper("TURBOMQ_PREFILL_WGMMA")
# On wgmma, 16-bit K/V tiles loaded by TMA where the pool's blocks hold
# 64-key tiles (block size >= 64, the default): 469 against 282 TFLOP/s on
# 8k causal (docs/benchmarks/kernels_prefill.md). TURBOMQ_PREFILL_TMA=0
# keeps cp.async.
PREFILL_TMA = _on_hopper("TURBOMQ_PREFILL_TMA")
def unavailable_reason() -> Optional[str]:
    """Why the native kernels cannot run here, or None when they can."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if _k is None:
        return "turbomq._native was built without CUDA (rebuild with TURBOMQ_CUDA=ON)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def available() -> bool:
    return unavailable_reason() is None


if _k is not None:
    # Programmatic dependent launch of the GEMV and the invariant GEMM
    # (TURBOMQ_PDL=0 turns it off).
    _k.set_programmatic_launch(os.environ.get("TURBOMQ_PDL", "1") != "0")
    # and of paged attention (TURBOMQ_ATTENTION_PDL=0: attention alone off)
    _k.set_attention_programmatic(ATTENTION_PDL)
    _k.set_prefill_attention_wgmma(PREFILL_WGMMA)
    _k.set_prefill_attention_tma(PREFILL_TMA)
    _DTYPES = {torch.float16: _k.DType.F16, torch.bfloat16: _k.DType.BF16,
               torch.int8: _k.DType.I8, torch.float32: _k.DType.F32}
else:
    _DTYPES = {}

_HALF = (torch.float16, torch.bfloat16)


def _stream(t: torch.Tensor) -> int:
    """The raw handle of the current stream on t's device. Read straight from
    the C++ side: torch.cuda.current_stream builds a Stream object each call,
    and a step asks about 200 times (every launch of every layer)."""
    return torch._C._cuda_getCurrentRawStream(t.get_device())


def _aligned(t: torch.Tensor, *strides: int) -> bool:
    """16-byte aligned start and strides (in 2-byte elements) multiples of 8."""
    return t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in strides)


def _native_ok(*tensors: torch.Tensor) -> bool:
    return _k is not None and all(t.is_cuda for t in tensors)


class _on_device:
    """Makes `t`'s device current (kernels launch on the current device)."""

    def __init__(self, t: torch.Tensor):
        self.index = t.get_device()
        self.prev: Optional[int] = None

    def __enter__(self) -> None:
        cur = torch.cuda.current_device()
        if cur != self.index:
            self.prev = cur
            torch.cuda.set_device(self.index)

    def __exit__(self, *exc) -> None:
        if self.prev is not None:
            torch.cuda.set_device(self.prev)


# --------------------------------------------------------------- norms
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    h = x.shape[-1]
    if not (_native_ok(x, weight) and x.dtype in _HALF and weight.dtype == x.dtype
            and weight.is_contiguous() and h % 8 == 0 and x.numel() > 0):
        return reference.rms_norm(x, weight, eps)
    x2 = x.reshape(-1, h)
    if x2.stride(1) != 1 or not _aligned(x2, x2.stride(0)):
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    with _on_device(x):
        _k.rms_norm(out.data_ptr(), x2.data_ptr(), x2.stride(0), weight.data_ptr(), x2.shape[0], h,
                    float(eps), _DTYPES[x.dtype], _stream(x))
    return out


# -------------------------------------------------------------- rotary
def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, *,
           q_out: Optional[torch.Tensor] = None,
           k_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    t, nh, d = q.shape
    nkv = k.shape[1]
    if not (_native_ok(q, k, positions, cos_sin) and q.dtype in _HALF and k.dtype == q.dtype
            and cos_sin.dtype == torch.float32 and cos_sin.shape[-1] == d and d % 16 == 0
            and k.shape[0] == t and k.shape[2] == d and t > 0):
        return reference.rotary(q, k, positions, cos_sin)
    if q.stride(2) != 1 or not _aligned(q, q.stride(0), q.stride(1)):
        q = q.contiguous()
    if k.stride(2) != 1 or not _aligned(k, k.stride(0), k.stride(1)):
        k = k.contiguous()
    positions = positions.to(torch.int64).contiguous()
    cos_sin = cos_sin.contiguous()
    if q_out is None:
        q_out = torch.empty((t, nh, d), dtype=q.dtype, device=q.device)
    if k_out is None:
        k_out = torch.empty((t, nkv, d), dtype=k.dtype, device=k.device)
    with _on_device(q):
        _k.rotary(q_out.data_ptr(), k_out.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1),
                  k.data_ptr(), k.stride(0), k.stride(1), positions.data_ptr(),
                  cos_sin.data_ptr(), t, nh, nkv, d, _DTYPES[q.dtype], _stream(q))
    return q_out, k_out


# ------------------------------------------------------------ silu_mul
def silu_mul(gate_up: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    two_i = gate_up.shape[-1]
    inter = two_i // 2
    if not (_native_ok(gate_up) and gate_up.dtype in _HALF and two_i % 16 == 0
            and gate_up.numel() > 0):
        return reference.silu_mul(gate_up)
    x2 = gate_up.reshape(-1, two_i)
    if x2.stride(1) != 1 or not _aligned(x2, x2.stride(0)):
        x2 = x2.contiguous()
    if out is None:
        out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    with _on_device(gate_up):
        _k.silu_mul(out.data_ptr(), x2.data_ptr(), x2.stride(0), x2.shape[0], inter,
                    _DTYPES[gate_up.dtype], _stream(gate_up))
    return out


# ------------------------------------------------------------ write_kv
def write_kv(kv: LayerKV, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    t, nkv, d = k.shape
    cache_dtype = kv.k.dtype
    ok = (_native_ok(kv.k, k, v, slot_mapping) and k.dtype in _HALF and v.dtype == k.dtype
          and v.shape == k.shape and kv.k.is_contiguous() and kv.v.is_contiguous() and t > 0)
    if ok and cache_dtype == torch.int8:
        ok = d % 32 == 0 and d <= 256 and kv.k_scale.is_contiguous() and kv.v_scale.is_contiguous()
    elif ok:
        ok = cache_dtype == k.dtype and d % 8 == 0
    if not ok:
        reference.write_kv(kv, k, v, slot_mapping)
        return
    if k.stride(2) != 1 or not _aligned(k, k.stride(0), k.stride(1)):
        k = k.contiguous()
    if v.stride(2) != 1 or not _aligned(v, v.stride(0), v.stride(1)):
        v = v.contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    quant = cache_dtype == torch.int8
    with _on_device(k):
        _k.write_kv(kv.k.data_ptr(), kv.v.data_ptr(),
                    kv.k_scale.data_ptr() if quant else 0, kv.v_scale.data_ptr() if quant else 0,
                    k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
                    slots.data_ptr(), t, nkv, d, kv.block_size, _DTYPES[k.dtype],
                    _DTYPES[cache_dtype], _stream(k))


# ---------------------------------------------------- rotary + write_kv
def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin: torch.Tensor, kv: LayerKV, slot_mapping: torch.Tensor, *,
                    q_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As reference.rotary_write_kv, in one launch, the rotated q in q_out
    where given; inputs that kernel does not cover go through rotary() then
    write_kv()."""
    t, nh, d = q.shape
    nkv = k.shape[1]
    cache_dtype = kv.k.dtype
    lanes = d // 16
    ok = (FUSED_ROTARY_WRITE_KV and _native_ok(q, k, v, positions, cos_sin, slot_mapping, kv.k)
          and q.dtype in _HALF
          and k.dtype == q.dtype and v.dtype == q.dtype and k.shape == v.shape
          and k.shape[0] == t and k.shape[2] == d and cos_sin.dtype == torch.float32
          and cos_sin.shape[-1] == d and d % 16 == 0 and 1 <= lanes <= 32
          and lanes & (lanes - 1) == 0 and t > 0
          and kv.k.is_contiguous() and kv.v.is_contiguous()
          and q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
          and _aligned(q, q.stride(0), q.stride(1)) and _aligned(k, k.stride(0), k.stride(1))
          and _aligned(v, v.stride(0), v.stride(1)))
    if ok and cache_dtype == torch.int8:
        ok = kv.k_scale.is_contiguous() and kv.v_scale.is_contiguous()
    elif ok:
        ok = cache_dtype == q.dtype
    if not ok:
        q, k = rotary(q, k, positions, cos_sin)
        write_kv(kv, k, v, slot_mapping)
        return q if q_out is None else q_out.copy_(q)
    positions = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    cos_sin = cos_sin.contiguous()
    if q_out is None:
        q_out = torch.empty((t, nh, d), dtype=q.dtype, device=q.device)
    quant = cache_dtype == torch.int8
    with _on_device(q):
        _k.rotary_write_kv(q_out.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1),
                           k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
                           v.stride(1), positions.data_ptr(), cos_sin.data_ptr(), slots.data_ptr(),
                           kv.k.data_ptr(), kv.v.data_ptr(),
                           kv.k_scale.data_ptr() if quant else 0,
                           kv.v_scale.data_ptr() if quant else 0, t, nh, nkv, d, kv.block_size,
                           _DTYPES[q.dtype], _DTYPES[cache_dtype], _stream(q))
    return q_out


# -------------------------------------------------------------- linear
def linear(x: torch.Tensor, weight: torch.Tensor, *,
           norm: Optional[tuple[torch.Tensor, float]] = None, silu: bool = False,
           residual: Optional[torch.Tensor] = None,
           out: Optional[torch.Tensor] = None, native: Optional[bool] = None) -> torch.Tensor:
    """As reference.linear: x @ weight.T, optionally after rms_norm(x, *norm),
    followed by silu_mul, or added into `residual` in place. Inputs the GEMV
    takes (GEMV_MAX_ROWS rows of 16-bit data; see GEMV_MAX_K) run as one
    launch with the norm, silu_mul or add fused; the rest as cuBLAS plus the
    separate kernels. native=True takes the GEMV up to its own limits
    whatever the policy; False never."""
    if isinstance(weight, Fp8Weight):
        return _linear_fp8(x, weight, norm, silu, residual)
    k_in = x.shape[-1]
    rows = x.numel() // k_in if k_in else 0
    fused = norm is not None or silu or residual is not None
    if _k is None or native is False:
        max_rows = 0
    elif native:
        max_rows = _k.GEMV_MAX_FUSED_ROWS if fused else _k.GEMV_MAX_ROWS
    else:
        max_rows = min(GEMV_MAX_ROWS, FUSED_GEMV_MAX_ROWS if fused else _k.GEMV_MAX_ROWS)
        if k_in > GEMV_MAX_K:
            max_rows = min(max_rows, 1)
    n_out = weight.shape[0] // 2 if silu else weight.shape[0]
    ok = (0 < rows <= max_rows and _native_ok(x, weight) and x.dtype in _HALF
          and weight.dtype == x.dtype and weight.dim() == 2 and weight.shape[1] == k_in
          and k_in % 8 == 0 and weight.is_contiguous() and weight.data_ptr() % 16 == 0
          and (not silu or weight.shape[0] % 2 == 0))
    if ok and norm is not None:
        ok = (norm[0].dtype == x.dtype and norm[0].is_contiguous() and norm[0].numel() == k_in
              and norm[0].data_ptr() % 16 == 0 and rows * k_in * 2 <= _k.GEMV_SMEM_BYTES)
    if ok and residual is not None:
        ok = (residual.dtype == x.dtype and residual.is_contiguous()
              and residual.shape == (*x.shape[:-1], n_out))
    if not fused and not ok:
        return F.linear(x, weight)
    if not ok or (fused and not FUSED_GEMV and native is None):
        return _linear_unfused(x, weight, norm, silu, residual, native)
    return _run_gemv(x, rows, n_out, weight.data_ptr(), norm, silu, residual, out)


def _run_gemv(x: torch.Tensor, rows: int, n_out: int, weight_ptr: int,
              norm: Optional[tuple[torch.Tensor, float]], silu: bool,
              residual: Optional[torch.Tensor], out: Optional[torch.Tensor] = None,
              w_scale_ptr: int = 0) -> torch.Tensor:
    """One GEMV launch over checked inputs: 16-bit weights, or E4M3 weights
    with their scales at w_scale_ptr."""
    if silu and residual is not None:  # no single epilogue does both
        return residual.add_(_run_gemv(x, rows, n_out, weight_ptr, norm, True, None,
                                       w_scale_ptr=w_scale_ptr))
    k_in = x.shape[-1]
    x2 = x.reshape(rows, k_in)
    if not x2.is_contiguous() or x2.data_ptr() % 16 != 0:
        x2 = x2.clone(memory_format=torch.contiguous_format)  # fresh, so aligned
    if residual is not None:
        out, epilogue = residual, _k.GemvEpilogue.ADD_INTO
    else:
        epilogue = _k.GemvEpilogue.SILU_MUL if silu else _k.GemvEpilogue.STORE
        if out is None:
            out = torch.empty((*x.shape[:-1], n_out), dtype=x.dtype, device=x.device)
    with _on_device(x):
        _k.gemv(out.data_ptr(), x2.data_ptr(), weight_ptr, rows, n_out, k_in,
                _DTYPES[x.dtype], _stream(x), norm[0].data_ptr() if norm is not None else 0,
                float(norm[1]) if norm is not None else 0.0, epilogue, w_scale_ptr)
    return out


def _rope_store_ok(x: torch.Tensor, weight, kv: LayerKV, cos_sin: torch.Tensor,
                   num_heads: int) -> bool:
    """Whether a qkv kernel's store can rotate q and k and write k and v into
    the pool itself: 16-bit x and pool alike, the q, k and v heads' rows in
    weight, contiguous aligned x and pool, a float32 cat(cos, sin) table."""
    nkv, d = kv.k.shape[1], kv.k.shape[3]
    return (_native_ok(x, kv.k) and x.dtype in _HALF and kv.k.dtype == x.dtype
            and weight.shape == ((num_heads + 2 * nkv) * d, x.shape[-1])
            and x.is_contiguous() and x.data_ptr() % 16 == 0
            and kv.k.is_contiguous() and kv.v.is_contiguous()
            and cos_sin.dtype == torch.float32 and cos_sin.is_contiguous()
            and cos_sin.shape[-1] == d)


def qkv_rotary_write_kv(x: torch.Tensor, weight: torch.Tensor, norm: tuple[torch.Tensor, float],
                        positions: torch.Tensor, cos_sin: torch.Tensor, kv: LayerKV,
                        slot_mapping: torch.Tensor, num_heads: int, *,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As reference.qkv_rotary_write_kv. At one row with a 16-bit pool (decode
    at batch 1; FP8 weights: up to FP8_GEMV_MAX_ROWS rows) one GEMV launch does
    it all: norm in front, rotary and the KV write behind. Otherwise linear()
    then rotary_write_kv()."""
    t, k_in = x.shape
    nkv, bs, d = kv.k.shape[1:]
    fp8 = isinstance(weight, Fp8Weight)
    if fp8:
        weight_ok = _fp8_gemv_ok(x, weight, t, norm)
    else:
        weight_ok = (FUSED_GEMV and 0 < t <= FUSED_GEMV_MAX_ROWS and _native_ok(x, weight)
                     and weight.dtype == x.dtype and weight.is_contiguous()
                     and weight.data_ptr() % 16 == 0 and t * k_in * 2 <= _k.GEMV_SMEM_BYTES
                     and k_in % 8 == 0)
    fused = (weight_ok and _rope_store_ok(x, weight, kv, cos_sin, num_heads)
             and norm[0].dtype == x.dtype and norm[0].is_contiguous()
             and norm[0].data_ptr() % 16 == 0)
    if not fused:
        qkv = linear(x, weight, norm=norm)
        q, k, v = qkv.split([num_heads * d, nkv * d, nkv * d], dim=-1)
        return rotary_write_kv(q.reshape(t, num_heads, d), k.reshape(t, nkv, d),
                               v.reshape(t, nkv, d), positions, cos_sin, kv, slot_mapping,
                               q_out=out)
    positions = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    if out is None:
        out = torch.empty((t, num_heads, d), dtype=x.dtype, device=x.device)
    with _on_device(x):
        _k.gemv_qkv_rope(out.data_ptr(), x.data_ptr(),
                         (weight.data if fp8 else weight).data_ptr(), t, k_in,
                         norm[0].data_ptr(), float(norm[1]), positions.data_ptr(),
                         cos_sin.data_ptr(), slots.data_ptr(), kv.k.data_ptr(), kv.v.data_ptr(),
                         num_heads, nkv, d, bs, _DTYPES[x.dtype], _stream(x),
                         weight.scale.data_ptr() if fp8 else 0)
    return out


def quantize_fp8(x: torch.Tensor, norm: Optional[tuple[torch.Tensor, float]] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [rows, K] E4M3, scale [rows, 1] float32) of rms_norm(x, *norm) (or
    of x), per row: as reference quantize_rows of that, bit for bit; one
    launch with the norm fused where the native kernel takes x."""
    k_in = x.shape[-1]
    x2 = x.reshape(-1, k_in)
    ok = (_native_ok(x) and x.dtype in _HALF and k_in % 8 == 0 and x2.stride(1) == 1
          and _aligned(x2, x2.stride(0))
          and (norm is None or (norm[0].dtype == x.dtype and norm[0].is_contiguous()
                                and norm[0].data_ptr() % 16 == 0)))
    if not ok:
        if norm is not None:
            x2 = rms_norm(x2, norm[0], norm[1])
        return quantize_rows(x2)
    rows = x2.shape[0]
    q = torch.empty((rows, k_in), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    with _on_device(x):
        _k.quantize_fp8(q.data_ptr(), scale.data_ptr(), x2.data_ptr(), x2.stride(0),
                        norm[0].data_ptr() if norm is not None else 0, rows, k_in,
                        float(norm[1]) if norm is not None else 0.0, _DTYPES[x.dtype], _stream(x))
    return q, scale


def _fp8_gemv_ok(x: torch.Tensor, w: Fp8Weight, rows: int,
                 norm: Optional[tuple[torch.Tensor, float]]) -> bool:
    """Whether the FP8 GEMV takes x (its rows quantized in shared memory, and
    staged there with the norm weight for the norm) and w."""
    k_in = x.shape[-1]
    return (0 < rows <= min(FP8_GEMV_MAX_ROWS, _k.GEMV_MAX_FUSED_ROWS if _k else 0)
            and _native_ok(x, w.data) and x.dtype in _HALF and k_in % 128 == 0
            and (rows + 1) * k_in * (1 if norm is None else 3) <= _k.GEMV_FP8_X_BYTES
            and w.data.dim() == 2 and w.data.shape[1] == k_in and w.data.is_contiguous()
            and w.data.data_ptr() % 16 == 0 and w.scale.dtype == torch.float32
            and w.scale.is_contiguous() and w.scale.numel() == w.data.shape[0]
            and (norm is None or (norm[0].dtype == x.dtype and norm[0].is_contiguous()
                                  and norm[0].numel() == k_in and norm[0].data_ptr() % 16 == 0)))


def _linear_fp8(x: torch.Tensor, w: Fp8Weight, norm: Optional[tuple[torch.Tensor, float]],
                silu: bool, residual: Optional[torch.Tensor]) -> torch.Tensor:
    """An FP8 projection on Hopper's FP8 tensor cores: x normalized and
    quantized per token in one launch, cuBLASLt's FP8 GEMM with both scales
    applied in its epilogue (row-wise scaling gives bf16; an fp16 model
    casts; up to FP8_TENSORWISE_MAX_ROWS rows, unit scales in the product
    and both after it, with the epilogue, in one launch). Decode at a few
    rows: the FP8 GEMV, norm, quantization and epilogue in one launch.
    Elsewhere: the reference."""
    k_in, n_out = x.shape[-1], w.data.shape[0]
    rows = x.numel() // k_in if k_in else 0
    n = n_out // 2 if silu else n_out
    if _fp8_gemv_ok(x, w, rows, norm) and (not silu or n_out % 2 == 0) and (
            residual is None or (residual.dtype == x.dtype and residual.is_contiguous()
                                 and residual.shape == (*x.shape[:-1], n))):
        return _run_gemv(x, rows, n, w.data.data_ptr(), norm, silu, residual,
                         w_scale_ptr=w.scale.data_ptr())
    if not (x.is_cuda and _FP8_GEMM and k_in % 16 == 0 and n_out % 16 == 0):
        if norm is not None:
            x = rms_norm(x, norm[0], norm[1])
        y = fp8_linear_reference(x, w)
    else:
        q, sx = quantize_fp8(x, norm)
        if (rows <= FP8_TENSORWISE_MAX_ROWS and w.scale.data_ptr() % 16 == 0
                and (x.get_device() in _ONE or not torch.cuda.is_current_stream_capturing())):
            return _fp8_tensorwise(q, sx, w, x.dtype, (*x.shape[:-1], n), silu, residual)
        y = torch._scaled_mm(q, w.data.t(), scale_a=sx, scale_b=w.scale[None, :],
                             out_dtype=torch.bfloat16)
        y = y.to(x.dtype).reshape(*x.shape[:-1], n_out)
    if silu:
        y = silu_mul(y)
    if residual is not None:
        return residual.add_(y)
    return y


# device index -> a float32 1, the per-tensor scales. Made outside any
# capture (a graph's warm-up runs eagerly first): a tensor filled inside one
# would hold its value only once the graph replays.
_ONE: dict[int, torch.Tensor] = {}


def _fp8_tensorwise(q: torch.Tensor, sx: torch.Tensor, w: Fp8Weight, dtype: torch.dtype,
                    shape: tuple[int, ...], silu: bool,
                    residual: Optional[torch.Tensor]) -> torch.Tensor:
    """The FP8 product with unit per-tensor scales into fp32, then one launch
    that scales it by sx[m] * w.scale[n] and stores it `shape` (or adds it
    into `residual`, or pairs gate and up through silu_mul): the row-wise
    path's numbers, rounded as its epilogue and the separate ops round them."""
    if residual is not None and (silu or residual.dtype != dtype or not residual.is_contiguous()
                                 or tuple(residual.shape) != shape):
        return residual.add_(_fp8_tensorwise(q, sx, w, dtype, shape, silu, None))
    dev = q.get_device()
    one = _ONE.get(dev)
    if one is None:
        one = _ONE[dev] = torch.ones((), dtype=torch.float32, device=q.device)
    y = torch._scaled_mm(q, w.data.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    if residual is not None:
        out, epilogue = residual, _k.GemvEpilogue.ADD_INTO
    else:
        out = torch.empty(shape, dtype=dtype, device=q.device)
        epilogue = _k.GemvEpilogue.SILU_MUL if silu else _k.GemvEpilogue.STORE
    with _on_device(q):
        _k.fp8_scale(out.data_ptr(), y.data_ptr(), y.stride(0), sx.data_ptr(), w.scale.data_ptr(),
                     y.shape[0], shape[-1], epilogue, _DTYPES[dtype], _stream(q))
    return out


def _linear_unfused(x: torch.Tensor, weight: torch.Tensor,
                    norm: Optional[tuple[torch.Tensor, float]], silu: bool,
                    residual: Optional[torch.Tensor], native: Optional[bool]) -> torch.Tensor:
    if norm is not None:
        x = rms_norm(x, norm[0], norm[1])
    y = linear(x, weight, native=native)  # the plain GEMV where the policy takes it
    if silu:
        y = silu_mul(y)
    if residual is not None:
        return residual.add_(y)
    return y


# ------------------------------------------------------ all-reduce
def all_reduce_fits(x: torch.Tensor, capacity: int) -> bool:
    """Whether the peer-memory all-reduce takes x (a message of <= capacity bytes)."""
    return (_native_ok(x) and x.dtype in _HALF and x.is_contiguous() and x.data_ptr() % 16 == 0
            and 0 < x.nbytes <= capacity and x.nbytes % 16 == 0)


def all_reduce_peer(x: torch.Tensor, buffers: list[int], rank: int, capacity: int,
                    residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x summed over the ranks through their peer-mapped buffers (every rank
    calls it with the same shape); with `residual`, residual += that in
    place. Returns the tensor written."""
    out = residual if residual is not None else x
    with _on_device(x):
        _k.all_reduce(out.data_ptr(), x.data_ptr(),
                      residual.data_ptr() if residual is not None else 0, x.numel(),
                      _DTYPES[x.dtype], buffers, rank, capacity, _stream(x))
    return out


# ----------------------------------------------------------- attention
# Prefill whose longest new-token run is at least PREFILL_MIN_Q_LEN runs
# native/cuda/prefill_attention.cu (64-row tiles, K/V tiles in shared memory
# shared by four warps) instead of attention.cu's 16-row tiles, split over the
# keys where its tiles alone would not fill the GPU (plan_prefill_partitions);
# 16-bit or INT8 KV. Faster at every prompt length measured
# (docs/benchmarks/prefill.md); TURBOMQ_PREFILL_ATTENTION=0 keeps attention.cu.
PREFILL_ATTENTION = os.environ.get("TURBOMQ_PREFILL_ATTENTION", "1") == "1"
# On Hopper it runs on wgmma (PREFILL_WGMMA) with TMA loads (PREFILL_TMA).
PREFILL_MIN_Q_LEN = 64
PREFILL_MIN_PARTITION = 512  # keys per split-K partition of the prefill kernel, at least
_SM_COUNT: dict[int, int] = {}
_PREFILL_BLOCKS_PER_SM: dict[tuple, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


_COUNTERS: dict[int, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown counter and workspace buffers captured graphs may use


def _counters(device: torch.device, n: int) -> Optional[torch.Tensor]:
    """A zeroed int32 buffer of >= n counters for the fused split-K combine
    of attention and linear_invariant (one per device; every kernel leaves
    its counters at zero, and launches on one stream never overlap). None
    while a graph is being captured and the buffer would have to grow: a
    capture cannot zero new memory, so that launch combines in a second
    kernel."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    buf = _COUNTERS.get(index)
    if buf is None or buf.numel() < n:
        if torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[index] = buf
    return buf


def _lens(batch: AttentionBatch) -> tuple[np.ndarray, np.ndarray]:
    """The batch's new-token and context lengths as arrays, converted once a
    step (every layer's attention asks; at 512 sequences each conversion of
    the host lists costs tens of microseconds)."""
    cache = batch.backend_cache
    if "lens" not in cache:
        cache["lens"] = (np.asarray(batch.q_lens_host, dtype=np.int64),
                         np.asarray(batch.context_lens_host, dtype=np.int64))
    return cache["lens"]


def _selected(batch: AttentionBatch, which: Optional[str]) -> np.ndarray:
    """Which sequences `which` names: all (None), those of at least
    PREFILL_MIN_Q_LEN new tokens ("long"), or the others ("short")."""
    q = _lens(batch)[0]
    if which is None:
        return np.ones(len(q), dtype=bool)
    return (q >= PREFILL_MIN_Q_LEN) == (which == "long")


def _max_context(batch: AttentionBatch, which: str) -> int:
    """The longest context among the sequences `which` names (1 if none);
    once a step."""
    cache = batch.backend_cache.setdefault("max_context", {})
    if which not in cache:
        ctx = _lens(batch)[1][_selected(batch, which)]
        cache[which] = int(ctx.max()) if len(ctx) else 1
    return cache[which]


def _tiles(batch: AttentionBatch, group: int, device: torch.device, rows: Optional[int] = None,
           which: Optional[str] = None, listed: bool = False):
    """(tile tensor or None, number of tiles) of `rows` rows each (default:
    attention.cu's 16) over the sequences `which` selects (_selected);
    cached on the batch, which every layer of a step shares. None: decode, a
    tile per sequence (unless `listed`: a launch over some of the tiles)."""
    rows = rows or _k.ATTENTION_TILE_ROWS
    cache = batch.backend_cache.setdefault("cuda_tiles", {})
    if (group, rows, which, listed) in cache:
        return cache[group, rows, which, listed]
    if (which is None and rows == _k.ATTENTION_TILE_ROWS and batch.max_q_len == 1
            and group <= rows and not listed):
        result = (None, batch.num_seqs)
    else:
        q = _lens(batch)[0]
        per_seq = np.where(_selected(batch, which), (q * group + rows - 1) // rows, 0)
        total = int(per_seq.sum())
        seq = np.repeat(np.arange(len(q)), per_seq)
        first = np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
        pairs = np.stack([seq, np.arange(total) - first], axis=1).astype(np.int32)
        result = (to_device(pairs, torch.int32, device), total)
    cache[group, rows, which, listed] = result
    return result


def plan_partitions(blocks: int, max_context: int, sm_count: int,
                    partition_size: Optional[int] = None,
                    int8: bool = False) -> tuple[int, int]:
    """(partition_size, num_parts) for split-K over `blocks` (tiles x KV
    heads); `int8`: the pool is INT8."""
    align = _k.ATTENTION_PARTITION_ALIGN if _k is not None else 64
    max_context = max(1, max_context)
    blocks = max(1, blocks)
    if partition_size is None:
        parts = -(-(BLOCKS_PER_SM_INT8 if int8 else BLOCKS_PER_SM) * sm_count // blocks)
        tiny = blocks * -(-max_context // MIN_PARTITION) < sm_count
        floor = MIN_PARTITION_TINY if tiny else MIN_PARTITION
        partition_size = max(floor, -(-max_context // parts))
    partition_size = max(align, -(-partition_size // align) * align)
    return partition_size, -(-max_context // partition_size)


def prefill_blocks_per_sm(q: torch.Tensor, kv: LayerKV) -> int:
    """The prefill kernel's blocks resident on an SM of q's device, for the
    form a launch over `kv` takes (mma.sync, wgmma, TMA loads): the CUDA
    occupancy calculator's count from the kernel's registers and shared
    memory (two on mma.sync, three on wgmma on an H100), asked once a form."""
    key = (q.device.index, q.shape[-1], q.dtype, kv.k.dtype, kv.block_size,
           _k.prefill_attention_wgmma(), _k.prefill_attention_tma())
    if key not in _PREFILL_BLOCKS_PER_SM:
        with torch.cuda.device(q.device):
            _PREFILL_BLOCKS_PER_SM[key] = max(1, _k.prefill_attention_blocks_per_sm(
                q.shape[-1], _DTYPES[q.dtype], _DTYPES[kv.k.dtype], kv.block_size))
    return _PREFILL_BLOCKS_PER_SM[key]


def plan_prefill_partitions(blocks: int, max_context: int, sm_count: int,
                            per_sm: int = 2) -> tuple[int, int]:
    """(least keys a partition, partitions) for the prefill kernel, whose
    blocks fit `per_sm` to an SM: as many partitions as keep the (64-row
    tile, KV head, partition) blocks within one wave, each of at least
    PREFILL_MIN_PARTITION keys of the longest context (a 128-token turn on a
    long session); one partition where the blocks alone fill half a wave or
    more. The kernel cuts each tile's own keys into the partitions. Within
    the wave the busiest SM runs `per_sm` blocks whatever their count, so
    the most partitions make the launch shortest; past it, blocks run after
    the wave, and each partition has a fixed cost (its queries' load, its
    partial rows, their combine) (docs/benchmarks/prefill_partitions.md)."""
    align = _k.ATTENTION_PARTITION_ALIGN if _k is not None else 64
    blocks, max_context = max(1, blocks), max(1, max_context)
    least = -(-PREFILL_MIN_PARTITION // align) * align
    parts = min(per_sm * sm_count // blocks, -(-max_context // least))
    return (least, parts) if parts > 1 else (0, 1)


def _attention_native(q: torch.Tensor, kv: LayerKV) -> bool:
    bs = kv.block_size
    return (_native_ok(q, kv.k) and q.dtype in _HALF and kv.k.dtype in (q.dtype, torch.int8)
            and q.shape[-1] in (64, 128) and bs > 0 and bs & (bs - 1) == 0
            and q.shape[1] % kv.k.shape[1] == 0 and kv.k.is_contiguous() and kv.v.is_contiguous()
            and (kv.k_scale is None or (kv.k_scale.is_contiguous() and kv.v_scale.is_contiguous())))


def paged_attention(q: torch.Tensor, kv: LayerKV, batch: AttentionBatch, scale: float, *,
                    out: Optional[torch.Tensor] = None,
                    partition_size: Optional[int] = None,
                    fused_combine: Optional[bool] = None,
                    always_combine: bool = False,
                    load_ahead: bool = False) -> torch.Tensor:
    """As reference.paged_attention. `partition_size` forces the split-K
    partition (a multiple of 64 keys); by default it is planned from the grid.
    `fused_combine` (default FUSED_SPLITK_COMBINE) combines the partitions in
    the attention kernel itself rather than in a second launch.
    `always_combine` takes the split-K path even when one partition would
    hold every key (a partition's output is normalized again when combined,
    so a row must take the same path whatever the batch's longest context).
    `load_ahead` (16-bit KV; INT8 always does): each warp loads its next
    16-token group while it computes the current one, where the launch's
    blocks fit the GPU at two an SM (the same bits; its registers allow two
    blocks an SM, not three, which a full batch's launch would lose)."""
    if not _attention_native(q, kv) or q.shape[0] == 0:
        return reference.paged_attention(q, kv, batch, scale, out=out)
    t, nh, d = q.shape
    nkv = kv.k.shape[1]
    if q.stride(2) != 1 or not _aligned(q, q.stride(0), q.stride(1)):
        q = q.contiguous()
    which, max_context = None, batch.max_context_len
    if (PREFILL_ATTENTION and batch.max_q_len >= PREFILL_MIN_Q_LEN
            and partition_size is None and not always_combine):
        # Sequences of >= PREFILL_MIN_Q_LEN new tokens on the prefill kernel;
        # the rest of the batch (decode rows beside a prefill chunk) on
        # attention.cu, into the other rows of the same output.
        tiles, num_tiles = _tiles(batch, nh // nkv, q.device, _k.PREFILL_TILE_ROWS, "long")
        per_sm = batch.backend_cache.get("prefill_per_sm")  # every layer's is the same
        if per_sm is None:
            per_sm = batch.backend_cache["prefill_per_sm"] = prefill_blocks_per_sm(q, kv)
        part_size, parts = plan_prefill_partitions(
            num_tiles * nkv, _max_context(batch, "long"), _sm_count(q.device), per_sm)
        partials, counters = _partials(q.device, num_tiles * nkv, parts,
                                       _k.PREFILL_TILE_ROWS, d, fused_combine)
        out = _launch_attention(out, q, kv, batch, scale, tiles, num_tiles, part_size, parts,
                                partials, counters, prefill=True)
        if _lens(batch)[0].min() >= PREFILL_MIN_Q_LEN:
            return out
        which, max_context = "short", _max_context(batch, "short")
    tiles, num_tiles = _tiles(batch, nh // nkv, q.device, None, which)
    part_size, parts = plan_partitions(num_tiles * nkv, max_context,
                                       _sm_count(q.device), partition_size,
                                       int8=kv.k.dtype == torch.int8)
    step = num_tiles  # tiles per launch
    if always_combine:
        parts = max(parts, 2)  # the second partition holds no key: the combine skips it
        # A fixed partition gives a long prefill many partials: launch over
        # as many tiles at a time as keep them under the cap (a row's result
        # does not depend on the tiles beside it).
        per_tile = nkv * parts * _k.ATTENTION_TILE_ROWS * d * 4
        step = max(1, ATTENTION_PARTIALS_MAX_BYTES // per_tile)
        if num_tiles > step:
            tiles, num_tiles = _tiles(batch, nh // nkv, q.device, None, which, listed=True)
    partials, counters = _partials(q.device, min(step, num_tiles) * nkv, parts,
                                   _k.ATTENTION_TILE_ROWS, d, fused_combine)
    load_ahead = load_ahead and min(step, num_tiles) * nkv * parts <= 2 * _sm_count(q.device)
    if num_tiles <= step:
        return _launch_attention(out, q, kv, batch, scale, tiles, num_tiles, part_size, parts,
                                 partials, counters, load_ahead=load_ahead)
    if out is None:
        out = torch.empty((t, nh, d), dtype=q.dtype, device=q.device)
    for first in range(0, num_tiles, step):
        n = min(step, num_tiles - first)
        _launch_attention(out, q, kv, batch, scale, tiles[first:first + n], n, part_size, parts,
                          partials, counters, load_ahead=load_ahead)
    return out


def _partials(device: torch.device, blocks: int, parts: int, rows: int, d: int,
              fused_combine: Optional[bool]):
    """Split-K's buffers for `blocks` (tile, KV head) pairs of `rows` rows:
    ((partial outputs, maxima and sums), counters or None); None for one
    partition. The caller holds them until the launch is queued (then the
    caching allocator hands their memory only to later work on the stream)."""
    if parts <= 1:
        return None, None
    part_o = torch.empty(blocks * parts * rows * d, dtype=torch.float32, device=device)
    part_ml = torch.empty(2 * blocks * parts * rows, dtype=torch.float32, device=device)
    fused = FUSED_SPLITK_COMBINE if fused_combine is None else fused_combine
    return (part_o, part_ml), _counters(device, blocks) if fused else None


def _launch_attention(out, q, kv, batch, scale, tiles, num_tiles, part_size, parts, partials,
                      counters, prefill: bool = False, load_ahead: bool = False) -> torch.Tensor:
    t, nh, d = q.shape
    if out is None:
        out = torch.empty((t, nh, d), dtype=q.dtype, device=q.device)
    tables = batch.block_tables
    if tables.dtype != torch.int32 or not tables.is_contiguous():
        tables = tables.to(torch.int32).contiguous()
    quant = kv.k_scale is not None
    with _on_device(q):
        _k.paged_attention(
            out.data_ptr(), q.data_ptr(), q.stride(0), q.stride(1), kv.k.data_ptr(),
            kv.v.data_ptr(), kv.k_scale.data_ptr() if quant else 0,
            kv.v_scale.data_ptr() if quant else 0, tables.data_ptr(), tables.shape[1],
            batch.cu_q_lens.data_ptr(), batch.context_lens.data_ptr(),
            0 if tiles is None else tiles.data_ptr(), num_tiles, nh, kv.k.shape[1], d,
            kv.block_size, float(scale), part_size, parts,
            *((0, 0) if partials is None else (t.data_ptr() for t in partials)),
            _DTYPES[q.dtype], _DTYPES[kv.k.dtype], _stream(q),
            0 if counters is None else counters.data_ptr(), prefill, kv.k.shape[0], load_ahead)
    return out


# ------------------------------------------------ batch-invariant linear
# linear_invariant (deterministic mode) runs native/cuda/gemm_invariant.cu:
# row m of the result is bit-identical whatever the number of rows and
# whatever the other rows hold. Every output is one float32 accumulation of
# the tensor-core k16 steps over K in increasing k, so any tiling gives the
# same bits and the tile follows the number of rows (gemm_invariant_tiling):
# - transposed (up to GEMM_INVARIANT_TRANSPOSED_MAX_ROWS rows: decode at
#   small batch): y^T = w x^T on mma.sync, a warp per 16 weight rows;
# - tiled: a persistent wgmma kernel, tiles of 64 x 128, 128 x 64 to
#   128 x 256 (by 32) and 256 x 128.
_TILINGS = {None: (-1, 0), "transposed": (0, 32), "transposed4": (0, 64),
            "64x128": (64, 128), "256x128": (256, 128),
            **{f"128x{c}": (128, c) for c in range(64, 257, 32)}}


def qkv_rotary_write_kv_invariant(x: torch.Tensor, weight: torch.Tensor,
                                  norm_eps: Optional[float], positions: torch.Tensor,
                                  cos_sin: torch.Tensor, kv: LayerKV,
                                  slot_mapping: torch.Tensor,
                                  num_heads: int) -> Optional[torch.Tensor]:
    """The rotated q [T, num_heads, d] of linear_invariant(x, weight,
    norm_eps=norm_eps) followed by rotary_write_kv, bit for bit, in one launch
    (the transposed shape's store does the rotation and the KV write); None
    where that launch does not apply -- more than
    GEMM_INVARIANT_TRANSPOSED_MAX_ROWS rows, an INT8 pool, a layout it does
    not take -- and the caller runs the two ops."""
    t, k_in = x.shape
    nkv, bs, d = kv.k.shape[1:]
    if not (_native_ok(x, weight) and _rope_store_ok(x, weight, kv, cos_sin, num_heads)
            and 0 < t <= _k.GEMM_INVARIANT_TRANSPOSED_MAX_ROWS and weight.dtype == x.dtype
            and k_in % 8 == 0 and weight.is_contiguous() and weight.data_ptr() % 16 == 0
            and d % 64 == 0  # a block's 32 rotation pairs inside half a head
            and (norm_eps is None or norm_eps > 0)):
        return None
    positions = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    out = torch.empty((t, num_heads, d), dtype=x.dtype, device=x.device)
    with _on_device(x):
        _k.gemm_invariant_qkv_rope(out.data_ptr(), x.data_ptr(), weight.data_ptr(), t, k_in,
                                   _DTYPES[x.dtype], _stream(x),
                                   0.0 if norm_eps is None else float(norm_eps),
                                   positions.data_ptr(), cos_sin.data_ptr(), slots.data_ptr(),
                                   kv.k.data_ptr(), kv.v.data_ptr(), num_heads, nkv, d, bs)
    return out


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, *,
                     out: Optional[torch.Tensor] = None, tiling: Optional[str] = None,
                     residual: Optional[torch.Tensor] = None,
                     silu: bool = False, norm_eps: Optional[float] = None) -> torch.Tensor:
    """As reference.linear_invariant (x @ weight.T, every output one float32
    accumulation over K in increasing k), batch-invariant bit for bit.
    `tiling` forces a launch shape (a key of _TILINGS: "transposed" takes
    at most GEMM_INVARIANT_TRANSPOSED_MAX_ROWS rows; all give the same bits).
    Inputs the kernel does not take (not 16-bit, N or K not a multiple of 8,
    weight not contiguous and 16-byte aligned, CPU tensors) go to the
    reference; that choice depends on the weight and the dtype only, never
    on the number of rows.

    With `residual` (shape x.shape[:-1] + (N,), x's dtype) the result is added
    into it in place and residual is returned, bit for bit as
    residual.add_(linear_invariant(x, weight)): the kernel's store does the
    add (y rounded to the dtype first, one float32 add, one rounding) when
    residual is contiguous and 16-byte aligned, else the add runs after it.
    `out` and `residual` exclude each other.

    With `silu`, weight stacks the gate rows over the up rows ([2I, K]) and
    the result is silu_mul(linear_invariant(x, weight)) ([..., I]) bit for
    bit, computed in the kernel's store when 2I is a multiple of 16 (else by
    the separate silu_mul). It excludes `residual`.

    With `norm_eps`, the folded RMSNorm as reference.linear_invariant has it
    (weight's columns already multiplied by the norm weight): both shapes
    scale a row's totals by rsqrt(mean(x^2) + eps) in their store, the sum of
    squares in one fixed order; the transposed shape computes it itself, the
    tiled one takes it from a small kernel launched first."""
    if residual is not None and out is not None:
        raise ValueError("linear_invariant: pass out or residual, not both")
    if silu and residual is not None:
        raise ValueError("linear_invariant: silu and residual exclude each other")
    k_in = x.shape[-1]
    n_out = weight.shape[0] if weight.dim() == 2 else -1
    if not (_native_ok(x, weight) and x.dtype in _HALF and weight.dtype == x.dtype
            and weight.dim() == 2 and weight.shape[1] == k_in and k_in % 8 == 0 and k_in > 0
            and n_out % 8 == 0 and n_out > 0 and weight.is_contiguous()
            and weight.data_ptr() % 16 == 0 and (norm_eps is None or norm_eps > 0)):
        if silu:
            y = silu_mul(reference.linear_invariant(x, weight, norm_eps=norm_eps))
            return y if out is None else out.copy_(y)
        return reference.linear_invariant(x, weight, residual=residual, norm_eps=norm_eps)
    if silu and n_out % 16 != 0:
        y = silu_mul(linear_invariant(x, weight, tiling=tiling, norm_eps=norm_eps))
        return y if out is None else out.copy_(y)
    rows = x.numel() // k_in
    shape = (*x.shape[:-1], n_out // 2 if silu else n_out)
    if residual is not None and not (residual.dtype == x.dtype and residual.shape == shape
                                     and residual.is_contiguous()
                                     and residual.data_ptr() % 16 == 0):
        return residual.add_(linear_invariant(x, weight, tiling=tiling, norm_eps=norm_eps))
    if rows == 0:
        return residual if residual is not None else torch.empty(shape, dtype=x.dtype,
                                                                 device=x.device)
    x2 = x.reshape(rows, k_in)
    if not x2.is_contiguous() or x2.data_ptr() % 16 != 0:
        x2 = x2.clone(memory_format=torch.contiguous_format)  # fresh, so aligned
    y = out if residual is None else residual
    if y is None or not (y.dtype == x.dtype and y.is_contiguous() and y.shape == shape
                         and y.data_ptr() % 16 == 0):
        y = torch.empty(shape, dtype=x.dtype, device=x.device)
    if tiling not in _TILINGS:
        raise ValueError(f"tiling must be one of {sorted(t for t in _TILINGS if t)} or None, "
                         f"not {tiling!r}")
    with _on_device(x):
        tile_rows, tile_cols = _TILINGS[tiling]
        if tile_rows == -1:
            tile_rows, tile_cols = _k.gemm_invariant_tiling(rows, n_out, k_in,
                                                            residual=residual is not None,
                                                            silu=silu)
        scales = None  # the folded norm's row scales, for the tiled shape
        if norm_eps is not None and tile_rows != 0:
            scales = torch.empty(rows, dtype=torch.float32, device=x.device)
        _k.gemm_invariant(y.data_ptr(), x2.data_ptr(), weight.data_ptr(), rows, n_out, k_in,
                          _DTYPES[x.dtype], _stream(x),
                          residual=0 if residual is None else residual.data_ptr(), silu_mul=silu,
                          norm_eps=0.0 if norm_eps is None else float(norm_eps),
                          row_scale=0 if scales is None else scales.data_ptr(),
                          tile_rows=tile_rows, tile_cols=tile_cols)
    if out is not None and y is not out:
        out.copy_(y)
        return out
    return y
