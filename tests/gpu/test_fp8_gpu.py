"""FP8 weights on CUDA (`--quantization fp8`): the fused norm + per-token
quantization kernel bit for bit against rms_norm + the reference's
rounding, the FP8 GEMM (torch._scaled_mm, per-token and per-channel scales
in its epilogue) against the reference's product of the same rounded
operands, the FP8 GEMV of decode (x quantized in its prologue, each
epilogue, the fused qkv + rotary + KV write) against that product and
against the GEMM path, decode graphs equal to eager decode, and the real
model's answer.

Skipped, with the reason, where there is no CUDA device, the native module
lacks its CUDA kernels, or the GPU has no FP8 tensor cores."""

from __future__ import annotations

import pytest
import torch

import sys
from pathlib import Path

from helpers import smollm2_gguf_or_skip
from turbomq.worker import Engine, EngineConfig, SamplingParams
from turbomq.worker.model.ops import cuda as cuda_ops
from turbomq.worker.model.ops.fp8 import fp8_linear_reference, quantize_rows, quantize_weight

sys.path.insert(0, str(Path(__file__).resolve().parent))
_REASON = cuda_ops.unavailable_reason()
if _REASON is None and torch.cuda.get_device_capability() < (8, 9):
    _REASON = "no FP8 tensor cores (compute capability < 8.9)"
if _REASON is not None:
    pytest.skip(f"FP8 GPU tests skipped: {_REASON}", allow_module_level=True)


@pytest.mark.parametrize("hidden", [576, 4096, 14336])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_and_quantize_in_one_launch_equal_the_reference_bit_for_bit(hidden, dtype):
    g = torch.Generator(device="cuda").manual_seed(hidden)
    x = torch.randn(37, hidden, generator=g, device="cuda", dtype=dtype) * 3
    x[5] = 0  # an all-zero row: the smallest scale, zeros out
    norm = (torch.rand(hidden, generator=g, device="cuda", dtype=dtype) + 0.5, 1e-5)
    for given in (None, norm):
        q, scale = cuda_ops.quantize_fp8(x, given)
        xn = x if given is None else cuda_ops.rms_norm(x, *given)
        q_ref, scale_ref = quantize_rows(xn)
        assert torch.equal(scale, scale_ref)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("rows", [1, 3, 64, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_gemm_matches_the_reference(rows, dtype):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 1024, generator=g, device="cuda", dtype=dtype)
    w = quantize_weight(torch.randn(768, 1024, generator=g, device="cuda") * 0.02)
    got = cuda_ops.linear(x, w)
    want = fp8_linear_reference(x.float(), w)
    assert got.dtype == dtype and got.shape == (rows, 768)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    # norm, silu_mul and the residual add around it, as for 16-bit weights
    norm = (torch.rand(1024, device="cuda", dtype=dtype) + 0.5, 1e-5)
    res = torch.randn(rows, 384, generator=g, device="cuda", dtype=dtype)
    fused = cuda_ops.linear(x, w, norm=norm, silu=True, residual=res.clone())
    ref = res.float() + cuda_ops.silu_mul(cuda_ops.linear(cuda_ops.rms_norm(x, *norm), w)).float()
    torch.testing.assert_close(fused.float(), ref, rtol=2e-2, atol=2e-2)


def _exact_fp8_product(x: torch.Tensor, w) -> torch.Tensor:
    """The reference's numbers in float64: the same rounded operands and
    scales, summed exactly (the GEMV sums in fp32, in its own order)."""
    q, sx = quantize_rows(x)
    return (q.double() @ w.data.double().T) * sx.double() * w.scale.double()[None, :]


# Llama-3-8B's qkv and down projections, a K of five 128-byte steps (fewer
# than the block's warps), a tile past n_out, at 1-4 rows; and a K long
# enough (28672: x takes 112 KiB at 4 rows) to fill most of shared memory.
GEMV_CASES = [(rows, n, k) for n, k in [(6144, 4096), (4096, 14336), (3072, 640), (40, 1536)]
              for rows in (1, 2, 3, 4)] + [(4, 264, 28672)]


@pytest.mark.parametrize("rows,n,k", GEMV_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_gemv_equals_the_reference_product(rows, n, k, dtype):
    g = torch.Generator(device="cuda").manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=g, device="cuda", dtype=dtype)
    w = quantize_weight(torch.randn(n, k, generator=g, device="cuda") * 0.02)
    assert cuda_ops._fp8_gemv_ok(x, w, rows, None)
    got = cuda_ops.linear(x, w)
    want = _exact_fp8_product(x, w)
    # one rounding to dtype, plus fp32 summation noise
    torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=2 ** -7,
                               atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (3072, 640)])
def test_fp8_gemv_row_does_not_depend_on_the_rows_beside_it(n, k):
    """Batch invariance: a row's product is the same bits at 1-4 rows."""
    g = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(4, k, generator=g, device="cuda", dtype=torch.bfloat16)
    w = quantize_weight(torch.randn(n, k, generator=g, device="cuda") * 0.02)
    alone = torch.cat([cuda_ops.linear(x[i:i + 1], w) for i in range(4)])
    for rows in (2, 3, 4):
        assert torch.equal(cuda_ops.linear(x[:rows], w), alone[:rows])


def fp8_linear_case(rows: int, mode: str, dtype: torch.dtype):
    """x [rows, 4096], an FP8 weight of 2048 outputs (twice that, gate and
    up, for "silu"), and a function that gives linear()'s keywords for `mode`
    ("norm", "silu": the norm fused in front; "residual": added into a fresh
    copy of one)."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    k, n = 4096, 2048
    x = torch.randn(rows, k, generator=g, device="cuda", dtype=dtype)
    w = quantize_weight(torch.randn(2 * n if mode == "silu" else n, k, generator=g,
                                    device="cuda") * 0.02)
    norm = (torch.rand(k, generator=g, device="cuda", dtype=dtype) + 0.5, 1e-5)
    res = torch.randn(rows, n, generator=g, device="cuda", dtype=dtype)
    return x, w, lambda: {"norm": dict(norm=norm), "silu": dict(norm=norm, silu=True),
                          "residual": dict(residual=res.clone())}[mode]


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("mode", ["norm", "silu", "residual"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_gemv_fused_forms_equal_the_gemm_path(rows, mode, dtype, monkeypatch):
    x, w, keywords = fp8_linear_case(rows, mode, dtype)
    got = cuda_ops.linear(x, w, **keywords())
    monkeypatch.setattr(cuda_ops, "FP8_GEMV_MAX_ROWS", 0)  # quantize_fp8 + _scaled_mm + kernels
    want = cuda_ops.linear(x, w, **keywords())
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2,
                               atol=2e-2 * want.float().abs().max().item())


@pytest.mark.parametrize("rows", [1, 4])
def test_fp8_gemv_qkv_rotary_write_kv_equals_the_unfused_ops(rows, monkeypatch):
    from kernel_checks import rel_err
    from test_kernels import clone_kv, cos_sin_table, make_pool

    dtype, nh, nkv, d, bs, hidden = torch.bfloat16, 32, 8, 128, 64, 4096
    g = torch.Generator(device="cuda").manual_seed(7)
    kv = make_pool(5, nkv, bs, d, dtype, g)
    apart = clone_kv(kv)
    x = torch.randn(rows, hidden, generator=g, device="cuda", dtype=dtype)
    w = quantize_weight(torch.randn((nh + 2 * nkv) * d, hidden, generator=g, device="cuda") * 0.05)
    norm = (torch.rand(hidden, generator=g, device="cuda", dtype=dtype) + 0.5, 1e-5)
    table = cos_sin_table(4096, d)
    positions = torch.randint(0, 4096, (rows,), generator=g, device="cuda")
    slots = torch.randperm(5 * bs, generator=g, device="cuda")[:rows]
    got = cuda_ops.qkv_rotary_write_kv(x, w, norm, positions, table, kv, slots, nh)
    monkeypatch.setattr(cuda_ops, "FP8_GEMV_MAX_ROWS", 0)
    want = cuda_ops.qkv_rotary_write_kv(x, w, norm, positions, table, apart, slots, nh)
    assert rel_err(got, want) < 1e-2
    assert rel_err(kv.k, apart.k) < 1e-2 and rel_err(kv.v, apart.v) < 1e-2


@pytest.mark.parametrize("rows", [5, 64, 256])
@pytest.mark.parametrize("mode", ["norm", "silu", "residual"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_per_tensor_product_scaled_after_equals_the_row_wise_path(rows, mode, dtype,
                                                                      monkeypatch):
    """FP8_TENSORWISE_MAX_ROWS: unit scales in the product, the row and
    channel scales and the epilogue in one launch after it. The same numbers
    as the row-wise epilogue but for the order of fp32 roundings: at most a
    rounding step of the output apart."""
    x, w, keywords = fp8_linear_case(rows, mode, dtype)

    def run(tensorwise_rows: int) -> torch.Tensor:
        monkeypatch.setattr(cuda_ops, "FP8_TENSORWISE_MAX_ROWS", tensorwise_rows)
        return cuda_ops.linear(x, w, **keywords())

    want, got = run(0), run(256)
    assert got.dtype == dtype and got.shape == want.shape == (rows, 2048)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7,
                               atol=2 ** -7 * want.float().abs().max().item())


@pytest.mark.parametrize("tensorwise_rows", [0, 256])
def test_fp8_graph_decode_equals_eager_and_answers(tensorwise_rows, monkeypatch):
    monkeypatch.setattr(cuda_ops, "FP8_TENSORWISE_MAX_ROWS", tensorwise_rows)
    path = smollm2_gguf_or_skip()
    question = [[{"role": "user", "content": "What is the capital of France?"}]]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    runs = []
    for graphs in (True, False):
        with Engine(EngineConfig(model=path, device="cuda", quantization="fp8",
                                 cuda_graphs=graphs, max_batch_size=4)) as eng:
            runs.append(eng.generate(messages=question * 3, params=params))
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
    assert "Paris" in runs[0][0].text
