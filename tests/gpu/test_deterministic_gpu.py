"""Deterministic mode on CUDA (docs/determinism.md), bf16 with bf16 and INT8
KV: a row's logits are the same bits alone, beside other sequences, decoded
after its prefill or prefilled in chunks; and a request's tokens (greedy and
seeded, 36 mixed requests, CUDA graphs on) are the same whatever the batch,
the step's token budget, whether its session's KV was resident, evicted and
re-prefilled, or rebuilt by another engine from the session store, and when
another engine continues its stream mid-way (a failover's resume_tokens).

Skipped, with the reason, where there is no CUDA device or the native module
lacks its CUDA kernels."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from turbomq.worker import Engine, EngineConfig, SamplingParams
from turbomq.worker.engine.session_store import InMemorySessionStore
from turbomq.worker.model.ops import AttentionBatch
from turbomq.worker.model.ops import cuda as cuda_ops

_REASON = cuda_ops.unavailable_reason()
if _REASON is not None:
    pytest.skip(f"deterministic GPU tests skipped: {_REASON}", allow_module_level=True)

VOCAB = 4096
KV_DTYPES = ["auto", "int8"]
SAMPLING = {
    "greedy": SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=11,
                             ignore_eos=True),
}


@functools.lru_cache(maxsize=None)
def model_dir() -> str:
    """Widths that take both shapes of the batch-invariant GEMM (a 1024-wide
    hidden state, a 2816-wide MLP, a 4096-token vocabulary), 128-wide heads,
    4 query heads per KV head. Logits spread so greedy picks are not ties."""
    import tempfile
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    path = tempfile.mkdtemp(prefix="turbomq-det-")
    model.save_pretrained(path)
    return path


def engine(kv_dtype: str, store=None, **overrides) -> Engine:
    cfg = dict(model=model_dir(), device="cuda", dtype="bf16", kv_dtype=kv_dtype,
               deterministic=True, block_size=16, num_kv_blocks=2048, max_batch_size=40,
               max_num_batched_tokens=512)
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg), session_store=store)


@functools.lru_cache(maxsize=None)
def shared_engine(kv_dtype: str) -> Engine:
    return engine(kv_dtype)


def work(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.choice([1, 7, 30, 64, 150, 400]))]
            for _ in range(n)]


def tokens(eng: Engine, prompts, params: SamplingParams) -> list[list[int]]:
    return [r.token_ids for r in eng.generate(input_ids=prompts, params=params)]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_rows_logits_are_the_same_bits_in_any_step(kv_dtype):
    eng = engine(kv_dtype, cuda_graphs=False)
    model, kv, bs = eng.runner.model, eng.runner.kv_cache, 16
    rng = random.Random(0)
    ids = [rng.randrange(3, VOCAB) for _ in range(300)]
    blocks = list(range(0, 19))

    def forward(seqs):
        """seqs: (new tokens, context length after them, blocks); last rows' logits."""
        width = max(len(b) for _, _, b in seqs)
        tables = [b + [-1] * (width - len(b)) for _, _, b in seqs]
        batch = AttentionBatch.build([len(t) for t, _, _ in seqs], [c for _, c, _ in seqs],
                                     tables, bs, "cuda")
        flat = torch.tensor([x for t, _, _ in seqs for x in t], device="cuda")
        return model.forward(flat, batch, kv)

    alone = forward([(ids, 300, blocks)])
    others = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 45, 129, 700)]
    starts = [20, 40, 60, 80]
    beside = forward([(o, len(o), list(range(s, s + -(-len(o) // bs))))
                      for o, s in zip(others, starts)] + [(ids, 300, blocks)])[-1:]
    assert torch.equal(alone, beside)
    # the same context computed in chunks of 37, then its last token decoded
    start = 0
    for end in [*range(37, 299, 37), 299]:
        forward([(ids[start:end], end, blocks)])
        start = end
    decoded = forward([(others[1][:3], 3, [100]), (ids[299:], 300, blocks)])[-1:]
    assert torch.equal(alone, decoded)


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_tokens_alone_equal_tokens_in_a_batch_of_36(kv_dtype, sampling):
    eng, params = shared_engine(kv_dtype), SAMPLING[sampling]
    prompts = work(36, 1)
    alone = [tokens(eng, [p], params)[0] for p in prompts]
    assert tokens(eng, prompts, params) == alone
    assert tokens(eng, prompts[::-1], params) == alone[::-1]
    assert eng.stats()["overlapped_steps"] > 0  # decode graphs ran


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_tokens_do_not_depend_on_the_step_budget(kv_dtype):
    params = SAMPLING["greedy"]
    prompts = work(36, 2)
    want = tokens(shared_engine(kv_dtype), prompts, params)
    for budget in (48, 4096):
        assert tokens(engine(kv_dtype, max_num_batched_tokens=budget), prompts, params) == want


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_session_turn_is_the_same_resident_evicted_or_rebuilt_elsewhere(kv_dtype):
    """Prefix caching off, so an evicted session really is computed again."""
    store = InMemorySessionStore()
    a = engine(kv_dtype, store, prefix_caching=False)
    b = engine(kv_dtype, store, prefix_caching=False)
    params = SAMPLING["greedy"]
    first, second = work(2, 3)

    def turns(sid: str, evict: bool, other: Engine):
        a.generate(input_ids=[first], params=params, session_id=sid)
        if evict:
            a.evict_session(sid)
        return other.generate(input_ids=[second], params=params, session_id=sid)[0]

    resident = turns("resident", False, a)
    evicted = turns("evicted", True, a)
    rebuilt = turns("rebuilt", False, b)
    assert resident.usage.cached_tokens > 0
    assert evicted.usage.cached_tokens == rebuilt.usage.cached_tokens == 0
    assert resident.token_ids == evicted.token_ids == rebuilt.token_ids


@pytest.mark.parametrize("sampling", SAMPLING)
def test_a_stream_continued_by_another_engine_is_the_same(sampling):
    """A failover: the broker sends the request to another worker with the
    tokens the client already has (resume_tokens)."""
    params = SAMPLING[sampling]
    prompt = work(1, 4)[0]
    a, b = shared_engine("auto"), engine("auto")
    full = tokens(a, [prompt], params)[0]
    got: list[int] = []
    done = []
    b.submit(input_ids=prompt, params=params, resume_tokens=full[:9],
             callback=lambda e: (got.extend(e.token_ids), e.finished and done.append(e)))
    while not done:
        b.step()
    assert full[:9] + got == full
