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


@pytest.mark.parametrize("mode,kv_dtype", [("fp8", None), ("fp8-lm-head", None),
                                           ("fp8-lm-head", torch.int8)])
def test_real_model_logits_stay_within_the_documented_error(mode, kv_dtype):
    """SmolLM2-135M-Instruct, fp32 compute: FP8 weights and activations
    against the unquantized model over the fixed prompt set. Measured: top-1
    agreement 59 of 71 positions, KL 0.017-0.055 per prompt; with the LM head
    in FP8 62 of 71, KL 0.037-0.060; that with the 8-bit KV cache too,
    60 of 71, KL 0.047-0.072 (the 8-bit KV cache alone: 70 of 71, KL
    0.0006-0.0013) (docs/weights.md); bounds with some room."""
    path = smollm2_gguf()
    ck = load_checkpoint(path)
    tok = Tokenizer.from_dir(path)
    base = LlamaModel(ck.config, ck.tensors, "cpu", torch.float32)
    fp8 = LlamaModel(ck.config, ck.tensors, "cpu", torch.float32, quantization=mode)
    assert isinstance(fp8.lm_head, Fp8Weight) == (mode == "fp8-lm-head")
    agree = total = 0
    for text in TEXTS:
        ids = torch.tensor(tok.encode(text))
        a, b = our_logits(base, ids, [len(ids)]), our_logits(fp8, ids, [len(ids)], kv_dtype)
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


def write_fp8_checkpoint(src: str, dst, per_tensor: bool = False, method: str = "compressed-tensors"):
    """`src` (an HF directory) as an FP8 checkpoint of the compressed-tensors
    (or fbgemm_fp8) form: E4M3 projections, a scale per output channel
    ([out, 1]) or per tensor, and per-tensor input scales it does not use."""
    import json
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    hf = load_file(str(src / "model.safetensors"))
    for name in [n for n in hf if n.endswith("_proj.weight")]:
        w = hf[name].float()
        if per_tensor:
            scale = (w.abs().max() / FP8_MAX).reshape(1)
            data = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        else:
            q = quantize_weight(w)
            data, scale = q.data, q.scale[:, None]
        hf[name] = data
        hf[name[:-len("weight")] + "weight_scale"] = scale.contiguous()
        hf[name[:-len("weight")] + "input_scale"] = torch.ones(1)
    (dst / "model.safetensors").unlink()
    save_file(hf, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "fbgemm_fp8"} if method == "fbgemm_fp8" else
        {"quant_method": "compressed-tensors", "format": "float-quantized",
         "config_groups": {"group_0": {
             "weights": {"type": "float", "num_bits": 8,
                         "strategy": "tensor" if per_tensor else "channel"},
             "input_activations": {"type": "float", "num_bits": 8, "dynamic": True,
                                   "strategy": "token"},
             "targets": ["Linear"]}}})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("method", ["compressed-tensors", "fbgemm_fp8"])
def test_an_fp8_checkpoint_loads_as_it_is_stored(tmp_path, method):
    from helpers import demo_model_dir

    path = write_fp8_checkpoint(demo_model_dir(), tmp_path / "fp8", method=method)
    ck = load_checkpoint(path)
    assert ck.quantization == "fp8"
    assert ck.tensors["layers.0.qkv.weight"].dtype == torch.float8_e4m3fn
    assert ck.tensors["layers.0.qkv.weight_scale"].shape == (ck.config.q_size + 2 * ck.config.kv_size,)
    # the stored rounding is the one conversion at load makes: the same model
    stored = LlamaModel(ck.config, ck.tensors, "cpu")
    converted = LlamaModel(load_checkpoint(demo_model_dir()).config,
                           load_checkpoint(demo_model_dir()).tensors, "cpu", quantization="fp8")
    assert stored.quantization == "fp8"
    for a, b in zip(stored.layers, converted.layers):
        for k in ("qkv", "o", "gate_up", "down"):
            assert torch.equal(a[k].data.view(torch.uint8), b[k].data.view(torch.uint8))
            assert torch.equal(a[k].scale, b[k].scale)
    ids = [[5, 6, 7, 8, 9]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with Engine(EngineConfig(model=str(path), block_size=16)) as eng:
        got = eng.generate(input_ids=ids, params=params)[0].token_ids
    want = demo_engine(quantization="fp8").generate(input_ids=ids, params=params)[0].token_ids
    assert got == want


def test_per_tensor_scales_and_what_is_refused(tmp_path):
    import json

    from helpers import demo_model_dir
    from turbomq.worker.model.weights import CheckpointError, convert_checkpoint

    path = write_fp8_checkpoint(demo_model_dir(), tmp_path / "t", per_tensor=True)
    ck = load_checkpoint(path)
    scale = ck.tensors["layers.0.o.weight_scale"]
    assert scale.shape == (ck.config.hidden_size,) and torch.all(scale == scale[0])
    with pytest.raises(CheckpointError, match="served as they are"):
        convert_checkpoint(path, tmp_path / "converted")
    with pytest.raises(ValueError, match="deterministic"):
        Engine(EngineConfig(model=str(path), deterministic=True))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "block"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="not supported"):
        load_checkpoint(path)
    config["quantization_config"] = {"quant_method": "gptq"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="not supported"):
        load_checkpoint(path)
