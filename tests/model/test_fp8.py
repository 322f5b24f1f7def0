"""FP8 weights (ops/fp8.py, `--quantization fp8`) on the CPU reference: the
rounding is E4M3's, the product is the rounded operands' exact product, and
on a real model (SmolLM2-135M-Instruct) the logits stay within the error
docs/weights.md documents against the unquantized model."""

from __future__ import annotations

import pytest
import torch

from helpers import demo_engine, our_logits, smollm2_gguf
from turbomq.worker import Engine, EngineConfig, SamplingParams
from turbomq.worker.engine.tokenizer import Tokenizer
from turbomq.worker.model.llama import LlamaModel
from turbomq.worker.model.ops import reference
from turbomq.worker.model.ops.fp8 import (FP8_MAX, Fp8Weight, fp8_linear_reference,
                                          quantize_rows, quantize_weight)
from turbomq.worker.model.weights import load_checkpoint

# The fixed prompt set of docs/weights.md, "FP8".
TEXTS = ["The capital of France is Paris, and the capital of Italy is Rome. Both cities",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
         "Water boils at 100 degrees Celsius at sea level. At higher altitudes,",
         "Once upon a time, in a small village by the sea, there lived an old fisherman who"]


def test_weights_round_to_e4m3_per_output_channel():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-3, 1, 64)[:, None]
    q = quantize_weight(w)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.shape == (64,)
    # each row's largest magnitude maps onto the largest E4M3 value
    assert torch.equal(q.data.float().abs().amax(dim=1), torch.full((64,), FP8_MAX))
    # E4M3 keeps 3 mantissa bits: relative error at most 2^-4 above its normal range
    deq = q.dequantize()
    normal = q.data.float().abs() >= 2.0 ** -6
    assert ((deq - w).abs() <= w.abs() * 2.0 ** -4 + 1e-12)[normal].all()


def test_the_product_is_that_of_the_rounded_operands():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 96, generator=g), quantize_weight(torch.randn(40, 96, generator=g))
    xq, sx = quantize_rows(x)
    exact = (xq.float() * sx) @ w.dequantize().T
    assert torch.allclose(fp8_linear_reference(x, w), exact, rtol=1e-5, atol=1e-5)
    # and the reference op takes it wherever it takes a weight
    assert torch.equal(reference.linear(x, w), fp8_linear_reference(x, w))
    assert isinstance(w, Fp8Weight) and w.shape == (40, 96)


def test_fp8_engine_runs_and_refuses_what_it_cannot_do():
    eng = demo_engine(quantization="fp8")
    layer = eng.runner.model.layers[0]
    assert all(isinstance(layer[k], Fp8Weight) for k in ("qkv", "o", "gate_up", "down"))
    out = eng.generate(input_ids=[[5, 6, 7, 8]], params=SamplingParams(max_tokens=6,
                                                                       temperature=0.0))[0]
    assert len(out.token_ids) > 0
    with pytest.raises(ValueError, match="deterministic"):
        demo_engine(quantization="fp8", deterministic=True)
    with pytest.raises(ValueError, match="unknown quantization"):
        demo_engine(quantization="int4")


def test_real_model_logits_stay_within_the_documented_error():
    """SmolLM2-135M-Instruct, fp32 compute: FP8 weights and activations
    against the unquantized model over the fixed prompt set. Measured: top-1
    agreement 60 of 71 positions, KL 0.018-0.069 per prompt (docs/weights.md);
    bounds with some room."""
    path = smollm2_gguf()
    ck = load_checkpoint(path)
    tok = Tokenizer.from_dir(path)
    base = LlamaModel(ck.config, ck.tensors, "cpu", torch.float32)
    fp8 = LlamaModel(ck.config, ck.tensors, "cpu", torch.float32, quantization="fp8")
    agree = total = 0
    for text in TEXTS:
        ids = torch.tensor(tok.encode(text))
        a, b = our_logits(base, ids, [len(ids)]), our_logits(fp8, ids, [len(ids)])
        kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True,
                                        reduction="batchmean").item()
        assert kl < 0.1, text
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
    assert agree / total >= 0.75


def test_real_model_answers_the_same_in_fp8():
    with Engine(EngineConfig(model=smollm2_gguf(), quantization="fp8", max_batch_size=2,
                             block_size=16)) as eng:
        out = eng.generate(messages=[[{"role": "user", "content": "What is the capital of France?"}]],
                           params=SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert "Paris" in out.text
