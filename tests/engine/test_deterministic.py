"""Deterministic mode (docs/determinism.md) on the CPU: the engine runs the
batch-invariant op structure, and a request's tokens do not depend on its
batch, on how its prompt is chunked, or on whether its session's KV was
evicted. The bit-for-bit promise is the CUDA kernels' (on the CPU the
reference ops share matmuls across rows):
tests/gpu/test_deterministic_gpu.py holds it."""

from __future__ import annotations

import random

import pytest
from helpers import demo_engine as engine, demo_model_dir, random_tokens
from turbomq.worker import Engine, EngineConfig, SamplingParams
from turbomq.worker.model.ops.invariant import InvariantOps

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=seed, ignore_eos=True)


def run_all(eng: Engine, prompts, params) -> list[list[int]]:
    """Every prompt submitted at once: they share steps."""
    return [r.token_ids for r in eng.generate(input_ids=prompts, params=params)]


def test_the_engine_runs_the_invariant_ops():
    eng = engine(deterministic=True)
    assert isinstance(eng.runner.model.ops, InvariantOps)
    assert not isinstance(engine().runner.model.ops, InvariantOps)


@pytest.mark.parametrize("params", [GREEDY, seeded(7)], ids=["greedy", "seeded"])
def test_tokens_do_not_depend_on_the_batch(params):
    rng = random.Random(0)
    prompts = [random_tokens(rng, rng.randint(5, 70)) for _ in range(12)]
    eng = engine(deterministic=True, max_batch_size=8, max_num_batched_tokens=64)
    alone = [run_all(eng, [x], params)[0] for x in prompts]
    assert run_all(eng, prompts, params) == alone
    assert run_all(eng, prompts[::-1], params) == alone[::-1]


def test_tokens_do_not_depend_on_chunking():
    rng = random.Random(1)
    prompts = [random_tokens(rng, rng.randint(40, 120)) for _ in range(6)]
    runs = [run_all(engine(deterministic=True, max_batch_size=6, max_num_batched_tokens=n),
                    prompts, GREEDY) for n in (8, 37, 4096)]
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_turn_after_eviction_equals_the_resident_turn(kv_dtype):
    rng = random.Random(2)
    first, second = random_tokens(rng, 50), random_tokens(rng, 9)
    outs = []
    for evict in (False, True):
        eng = engine(deterministic=True, kv_dtype=kv_dtype)
        eng.generate(input_ids=[first], params=GREEDY, session_id="s")
        if evict:
            eng.evict_session("s")
        outs.append(eng.generate(input_ids=[second], params=GREEDY, session_id="s")[0])
    assert outs[1].usage.cached_tokens < outs[0].usage.cached_tokens  # it really re-prefilled
    assert outs[0].token_ids == outs[1].token_ids


def test_deterministic_mode_refuses_tensor_parallelism():
    with pytest.raises(ValueError, match="one device"):
        Engine(EngineConfig(model=demo_model_dir(), deterministic=True, tensor_parallel=2))


def test_norms_fold_into_the_projections_that_read_them():
    """Deterministic mode folds each RMSNorm's weight into the projection
    after it (qkv, gate/up, LM head) and applies the row's rsqrt(mean(x^2) +
    eps) to the product: within rounding of the norm then the projection; a
    tied embedding keeps its own values."""
    import torch
    from turbomq.worker.model.ops import reference as ref
    from turbomq.worker.model.ops.invariant import NormFolded, fold_norm

    model = engine(deterministic=True).runner.model
    plain = engine().runner.model
    layer, base = model.layers[0], plain.layers[0]
    for name, norm in (("qkv", "attn_norm"), ("gate_up", "mlp_norm")):
        assert isinstance(layer[name], NormFolded)
        want = (base[name].float() * base[norm].float()[None, :]).to(base[name].dtype)
        assert torch.equal(layer[name].weight, want)
    assert isinstance(model.lm_head, NormFolded) and torch.equal(model.embed, plain.embed)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=gen) * 5
    w = torch.randn(32, 64, generator=gen) * 0.1
    g = torch.rand(64, generator=gen) + 0.5
    ops = InvariantOps(ref)
    got = ops.linear(x, fold_norm(w, g), norm=(g, 1e-5))
    want = ref.linear(ref.rms_norm(x, g, 1e-5), w)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
