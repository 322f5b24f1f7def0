"""Tensor parallelism on the CPU backend (gloo): ranks are real processes, and
an engine split over 2 or 4 of them gives the tokens of one that is not, with
batching, chunked prefill, sessions and eviction pressure; greedy steps
(the ranks reduce their argmax) and sampled ones (rank 0 gathers the logits
and samples) alike."""

from __future__ import annotations

import random

import pytest

from helpers import demo_model_dir, make_hf_model
from turbomq.worker import Engine, EngineConfig, SamplingParams
from turbomq.worker.model.parallel import shard_weight

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def run(model: str, tp: int, prompts: list, counters: dict = None, params=GREEDY,
        **config) -> list:
    engine = Engine(EngineConfig(model=model, max_batch_size=4, block_size=16,
                                 max_num_batched_tokens=48, tensor_parallel=tp, **config))
    try:
        out = [r.token_ids for r in engine.generate(input_ids=prompts, params=params)]
        if counters is not None:
            counters.update(engine.counters)
        return out
    finally:
        engine.close()


def prompts(seed: int, n: int, vocab: int) -> list:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 90))] for _ in range(n)]


@pytest.mark.parametrize("name", ["mha", "gqa_llama3_rope"])
def test_two_ranks_give_the_tokens_of_one(name, tmp_path):
    _, path = make_hf_model(name, tmp_path)
    batch = prompts(1, 7, 250)  # more than the 4 slots, prompts over the 48-token step budget
    counters = {}
    assert run(path, 2, batch, counters) == run(path, 1, batch)
    # Steps launched before the previous step's tokens reached the host: every
    # rank took them from the device (its own argmax of the ranks' maxima).
    assert counters["overlapped_steps"] > 0


def test_greedy_steps_gathering_the_logits_give_the_same_tokens(tmp_path, monkeypatch):
    """GREEDY_ARGMAX off (rank 0 decides for every rank): greedy steps gather
    the logits and broadcast the tokens, as sampled steps do; the tokens
    of the argmax path."""
    from turbomq.worker.engine import runner

    _, path = make_hf_model("gqa_llama3_rope", tmp_path)
    batch = prompts(3, 5, 250)
    want = run(path, 2, batch)
    monkeypatch.setattr(runner, "GREEDY_ARGMAX", False)
    assert run(path, 2, batch) == want


def test_two_ranks_sample_the_tokens_of_one(tmp_path):
    """Seeded sampling (rank 0 gathers the ranks' logits, samples, and
    broadcasts the tokens) and a repetition penalty on greedy rows (which
    needs the whole logits too): the tokens of one rank."""
    _, path = make_hf_model("gqa_llama3_rope", tmp_path)
    batch = prompts(2, 6, 250)
    for params in (SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=5,
                                  ignore_eos=True),
                   SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3,
                                  ignore_eos=True)):
        assert run(path, 2, batch, params=params) == run(path, 1, batch, params=params)


def test_four_ranks_sessions_under_eviction_pressure():
    """Multi-turn sessions through a pool too small to keep them resident:
    four ranks evict and re-prefill in step and give the tokens of one
    unpressured rank."""
    model = demo_model_dir()
    rng = random.Random(3)
    turns = [[[rng.randrange(3, 1000) for _ in range(rng.randint(5, 30))] for _ in range(3)]
             for _ in range(3)]  # 3 sessions x 3 turns

    def sessions(tp: int, num_kv_blocks: int) -> list:
        engine = Engine(EngineConfig(model=model, max_batch_size=2, block_size=16,
                                     tensor_parallel=tp, num_kv_blocks=num_kv_blocks))
        try:
            out = []
            for t in range(3):
                for s, session in enumerate(turns):
                    r = engine.generate(input_ids=[session[t]], params=GREEDY,
                                        session_id=f"s{s}")[0]
                    assert r.error is None, r.error
                    out.append(r.token_ids)
            stats = engine.stats()
            return out, stats
        finally:
            engine.close()

    pressured, stats = sessions(4, num_kv_blocks=12)
    relaxed, _ = sessions(1, num_kv_blocks=512)
    assert pressured == relaxed
    assert stats["evictions"] > 0


def test_sizes_that_do_not_divide_the_heads_are_refused(tmp_path):
    _, path = make_hf_model("mqa_tied", tmp_path)  # one KV head
    with pytest.raises(ValueError, match="num_kv_heads"):
        Engine(EngineConfig(model=path, tensor_parallel=2))


def test_shards_tile_each_weight():
    """Concatenated over the ranks, the slices give back each weight (with the
    q, k, v and gate, up stackings kept per rank)."""
    import torch
    from turbomq.worker.model.config import ModelConfig

    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=12, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=4)
    qkv = torch.arange((16 + 8 + 8) * 16, dtype=torch.float32).reshape(32, 16)
    gate_up = torch.arange(24 * 16, dtype=torch.float32).reshape(24, 16)
    down = torch.arange(16 * 12, dtype=torch.float32).reshape(16, 12)
    parts = {rank: {n: shard_weight(cfg, f"layers.0.{n}.weight", w, rank, 2)
                    for n, w in (("qkv", qkv), ("gate_up", gate_up), ("down", down))}
             for rank in range(2)}
    q, k, v = qkv.split([16, 8, 8])
    for rank in range(2):
        want = torch.cat([q[rank * 8:(rank + 1) * 8], k[rank * 4:(rank + 1) * 4],
                          v[rank * 4:(rank + 1) * 4]])
        assert torch.equal(parts[rank]["qkv"], want)
    assert torch.equal(torch.cat([parts[r]["down"] for r in range(2)], dim=1), down)
    gate, up = gate_up.chunk(2)
    assert torch.equal(torch.cat([parts[r]["gate_up"][:6] for r in range(2)]), gate)
    assert torch.equal(torch.cat([parts[r]["gate_up"][6:] for r in range(2)]), up)
    # the lm_head by vocabulary rows where the ranks divide the vocabulary
    head = torch.arange(32 * 16, dtype=torch.float32).reshape(32, 16)
    assert torch.equal(torch.cat([shard_weight(cfg, "lm_head.weight", head, r, 2)
                                  for r in range(2)]), head)
    assert shard_weight(cfg, "lm_head.weight", head, 0, 2).shape == (16, 16)
    assert shard_weight(cfg, "lm_head.weight", head, 1, 3) is head
