"""FP8 weights on CUDA (`--quantization fp8`): the fused norm + per-token
quantization kernel bit for bit against rms_norm + the reference's
rounding, the FP8 GEMM (torch._scaled_mm, per-token and per-channel scales
in its epilogue) against the reference's product of the same rounded
operands, decode graphs equal to eager decode, and the real model's answer.

Skipped, with the reason, where there is no CUDA device, the native module
lacks its CUDA kernels, or the GPU has no FP8 tensor cores."""

from __future__ import annotations

import pytest
import torch

from helpers import smollm2_gguf_or_skip
from turbomq.worker import Engine, EngineConfig, SamplingParams
from turbomq.worker.model.ops import cuda as cuda_ops
from turbomq.worker.model.ops.fp8 import fp8_linear_reference, quantize_rows, quantize_weight

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


def test_fp8_graph_decode_equals_eager_and_answers():
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
