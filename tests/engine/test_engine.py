"""The engine: persistent batch, sessions through the LRU KV cache, eviction
equivalence, INT8 KV, streaming and bad input."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

from helpers import demo_model_dir
from turbomq.worker import Engine, EngineConfig, SamplingParams
from turbomq.worker.engine import errors
from turbomq.worker.engine.sampling_params import InvalidParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def engine(**overrides) -> Engine:
    cfg = dict(model=demo_model_dir(), max_batch_size=8, block_size=16)
    cfg.update(overrides)
    return Engine(EngineConfig(**cfg))


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 1024) for _ in range(n)]


def mixed_params(rng: random.Random, i: int) -> SamplingParams:
    kind = i % 4
    if kind == 0:
        return SamplingParams(max_tokens=rng.randint(1, 24), **GREEDY)
    if kind == 1:
        return SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.9, top_k=50,
                              top_p=0.9, seed=rng.randrange(1 << 30), ignore_eos=True)
    if kind == 2:
        return SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0,
                              repetition_penalty=1.3, ignore_eos=True)
    return SamplingParams(max_tokens=24, temperature=0.7, min_p=0.05, seed=i,
                          stop_token_ids=[rng.randrange(2, 1024) for _ in range(50)])


def test_concurrent_requests_equal_solo_runs():
    rng = random.Random(0)
    prompts = [random_prompt(rng, rng.choice([1, 3, 17, 64, 150])) for _ in range(64)]
    params = [mixed_params(rng, i) for i in range(64)]
    # a small step budget forces chunked prefill mixed with decode
    batched = engine(max_num_batched_tokens=64)
    futures = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        futures[i] = batched.submit(input_ids=p, params=sp, callback=_collector(futures, i))
    while batched.has_work():
        batched.step()
    solo = engine(max_batch_size=1)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        alone = solo.generate(input_ids=[p], params=sp)[0]
        got = futures[("result", i)]
        assert got["tokens"] == alone.token_ids, f"request {i} differs from its solo run"
        assert got["reason"] == alone.finish_reason
    stats = batched.stats()
    assert stats["slots_active"] == 0 and stats["kv_blocks_used"] == 0
    batched.kv_manager.check()


def _collector(store: dict, i: int):
    store[("result", i)] = {"tokens": [], "reason": None}

    def on_event(event) -> None:
        store[("result", i)]["tokens"].extend(event.token_ids)
        if event.finished:
            store[("result", i)]["reason"] = event.finish_reason

    return on_event


def test_session_turns_hit_the_cache_and_equal_full_history_runs():
    eng = engine()
    scratch = engine()
    rng = random.Random(1)
    history: list[int] = []
    for turn in range(5):
        new = random_prompt(rng, rng.randint(3, 30))
        params = SamplingParams(max_tokens=12, **GREEDY)
        result = eng.generate(input_ids=[new], params=params, session_id="chat")[0]
        expected = scratch.generate(input_ids=[history + new], params=params)[0]
        assert result.token_ids == expected.token_ids, f"turn {turn}"
        assert result.usage.prompt_tokens == len(history) + len(new)
        if turn > 0:
            # everything but the last generated token of the previous turn was resident
            assert result.usage.cached_tokens == len(history) - 1
        history += new + result.token_ids
    stats = eng.stats()
    assert stats["cache_hits"] == 4 and stats["cache_misses"] == 0
    # a forced eviction releases the session's blocks to the prefix cache:
    # its next turn takes back every full block and gives the same tokens
    eng.evict_session("chat")
    new = random_prompt(rng, 5)
    params = SamplingParams(max_tokens=12, **GREEDY)
    result = eng.generate(input_ids=[new], params=params, session_id="chat")[0]
    assert result.token_ids == scratch.generate(input_ids=[history + new], params=params)[0].token_ids
    block = eng.config.block_size
    assert result.usage.cached_tokens == (len(history) - 1) // block * block
    assert eng.stats()["cache_misses"] == 0
    history += new + result.token_ids
    assert eng.session_store.get_tokens("chat") == history
    eng.end_session("chat")
    assert eng.session_store.get_tokens("chat") is None
    with pytest.raises(errors.UnknownSession):
        eng.end_session("chat")
    eng.kv_manager.check()


def session_schedule(sessions: int, turns: int, round_size: int, seed: int) -> list[list[str]]:
    """Rounds of distinct session ids; every session appears `turns` times.
    Half the picks revisit a recently used session (likely resident: a hit),
    the rest pick at random (likely evicted: a miss)."""
    rng = random.Random(seed)
    left = {f"s{i}": turns for i in range(sessions)}
    recent: list[str] = []
    rounds = []
    while left:
        chosen: list[str] = []
        while len(chosen) < round_size and len(chosen) < len(left):
            hot = [sid for sid in recent[-3:] if sid in left and sid not in chosen]
            pool = hot if hot and rng.random() < 0.5 else [x for x in left if x not in chosen]
            chosen.append(rng.choice(pool))
        for sid in chosen:
            left[sid] -= 1
            if not left[sid]:
                del left[sid]
            recent.append(sid)
        rounds.append(chosen)
    return rounds


def run_sessions(eng: Engine, rounds: list[list[str]]) -> dict:
    rng = random.Random(7)
    turn_of: dict = {}
    out: dict = {}
    params = SamplingParams(max_tokens=10, **GREEDY)
    for chosen in rounds:
        results: dict = {}
        for sid in chosen:
            turn_of[sid] = turn_of.get(sid, -1) + 1
            prompt = random_prompt(rng, rng.randint(4, 24))
            eng.submit(input_ids=prompt, params=params, session_id=sid,
                       callback=_collector(results, sid))
        while eng.has_work():
            eng.step()
        for sid in chosen:
            out[(sid, turn_of[sid])] = results[("result", sid)]["tokens"]
    return out


@pytest.mark.parametrize("round_size", [1, 6], ids=["sequential", "concurrent"])
def test_eviction_equivalence(round_size):
    # 50 sessions x 4 turns reach ~150 tokens each (10 blocks of 16): the small
    # pool holds about three sessions, the large one never evicts.
    rounds = session_schedule(50, 4, round_size, seed=round_size)
    small = engine(num_kv_blocks=30, max_batch_size=3)
    large = engine(num_kv_blocks=4000)
    pressured = run_sessions(small, rounds)
    reference = run_sessions(large, rounds)
    assert pressured == reference
    stats = small.stats()
    assert stats["evictions"] > 0 and stats["cache_misses"] > 0 and stats["cache_hits"] > 0, stats
    assert large.stats()["evictions"] == 0
    small.kv_manager.check()


def test_int8_kv_logits_close_to_full_precision():
    """Tolerance (docs/engine.md): symmetric per-token int8 rounds each element
    by at most amax/254, so logits move by a small fraction of their spread;
    we require max |diff| under 3% of the logits' standard deviation."""
    rng = random.Random(3)
    prompts = [random_prompt(rng, n) for n in (5, 40, 200)]
    logits = {}
    for kv_dtype in ("fp32", "int8"):
        eng = engine(kv_dtype=kv_dtype)
        batch = []
        for p in prompts:
            eng.kv_manager.acquire(1)
            eng.kv_manager.reserve(1, len(p))
            from turbomq.worker.model.ops import AttentionBatch
            table = eng.kv_manager.block_tables([1], (len(p) + 15) // 16)
            ab = AttentionBatch.build([len(p)], [len(p)], table, 16)
            batch.append(eng.runner.model.forward(torch.tensor(p), ab, eng.runner.kv_cache, torch.arange(len(p))))
            eng.kv_manager.erase(1)
        logits[kv_dtype] = torch.cat(batch)
    diff = (logits["int8"] - logits["fp32"]).abs().max().item()
    spread = logits["fp32"].std().item()
    print(f"int8 vs fp32 KV: max |logit diff| {diff:.4f} (logit std {spread:.2f})")
    assert diff < 0.03 * spread


def test_int8_greedy_agreement_is_reported():
    prompt = random_prompt(random.Random(4), 32)
    params = SamplingParams(max_tokens=256, **GREEDY)
    ref = engine(kv_dtype="fp32").generate(input_ids=[prompt], params=params)[0].token_ids
    q8 = engine(kv_dtype="int8").generate(input_ids=[prompt], params=params)[0].token_ids
    first_diff = next((i for i, (a, b) in enumerate(zip(ref, q8)) if a != b), len(ref))
    print(f"int8 KV greedy agreement: first {first_diff} of 256 tokens identical")
    assert len(q8) == 256
    assert first_diff >= 32  # a broken quantizer diverges within a few tokens


def test_stop_strings_and_eos():
    eng = engine()
    full = eng.generate(prompts=["Once upon a time"], params=SamplingParams(max_tokens=40, **GREEDY))[0]
    stop = full.text[10:13]
    assert len(stop) == 3
    cut = eng.generate(prompts=["Once upon a time"],
                       params=SamplingParams(max_tokens=40, stop=[stop], **GREEDY))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.index(stop)]
    assert stop not in cut.text
    # a stop token id ends generation and is reported
    stop_id = full.token_ids[5]
    by_id = eng.generate(prompts=["Once upon a time"],
                         params=SamplingParams(max_tokens=40, stop_token_ids=[stop_id], **GREEDY))[0]
    assert by_id.token_ids == full.token_ids[:full.token_ids.index(stop_id) + 1]
    assert by_id.finish_reason == "stop"


def test_seeded_sampling_is_reproducible():
    eng = engine()
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    a = eng.generate(prompts=["Hello"], params=params)[0].token_ids
    b = eng.generate(prompts=["Hello", "Something else entirely", "Hello"], params=params)
    assert b[0].token_ids == a and b[2].token_ids == a


def test_async_stream_and_cancel():
    eng = engine()

    async def main():
        events = []
        async for ev in eng.stream(prompt="Once upon a time",
                                   params=SamplingParams(max_tokens=16, **GREEDY)):
            events.append(ev)
        # break out early: the request is cancelled and its slot freed
        async for ev in eng.stream(prompt="Hello", params=SamplingParams(max_tokens=1000, **GREEDY)):
            break
        return events

    try:
        events = asyncio.run(main())
        assert events[-1].finished and events[-1].finish_reason == "length"
        assert sum(len(e.token_ids) for e in events) == 16
        for _ in range(200):
            if eng.stats()["slots_active"] == 0:
                break
            time.sleep(0.01)
        assert eng.stats()["slots_active"] == 0
    finally:
        eng.stop()


def test_bad_input_gets_typed_errors_and_engine_keeps_serving():
    eng = engine(max_model_len=256)
    good = SamplingParams(max_tokens=8, **GREEDY)
    expected = eng.generate(prompts=["Hello"], params=good)[0].token_ids
    with pytest.raises(errors.InvalidRequest):
        eng.generate(input_ids=[[]], params=good)
    with pytest.raises(errors.InvalidRequest):
        eng.submit(input_ids=[], params=good)
    with pytest.raises(errors.PromptTooLong):
        eng.generate(input_ids=[[5] * 300], params=good)
    with pytest.raises(errors.InvalidRequest):
        eng.generate(input_ids=[[5, 99999]], params=good)
    with pytest.raises(errors.InvalidRequest):
        eng.generate(input_ids=[["a", "b"]], params=good)
    with pytest.raises(InvalidParams):
        SamplingParams(temperature=-1.0)
    with pytest.raises(InvalidParams):
        SamplingParams(max_tokens=0)
    with pytest.raises(InvalidParams):
        eng.generate(prompts=["x"], params=SamplingParams(stop_token_ids=[10 ** 6]))
    with pytest.raises(errors.UnknownSession):
        eng.end_session("never-seen")
    rid = eng.submit(prompt="Hello", params=good)
    while eng.has_work():
        eng.step()
    with pytest.raises(errors.UnknownRequest):
        eng.cancel(rid)
    # a session turn is refused while the previous one is in flight
    eng.submit(prompt="Hi", params=good, session_id="busy")
    with pytest.raises(errors.SessionBusy):
        eng.submit(prompt="again", params=good, session_id="busy")
    while eng.has_work():
        eng.step()
    assert eng.generate(prompts=["Hello"], params=good)[0].token_ids == expected
    eng.kv_manager.check()


def test_cancel_frees_the_slot():
    eng = engine()
    events = []
    rid = eng.submit(prompt="Hello", params=SamplingParams(max_tokens=500, **GREEDY),
                     callback=events.append)
    for _ in range(3):
        eng.step()
    eng.cancel(rid)
    eng.step()
    assert events[-1].finished and events[-1].finish_reason == "cancelled"
    assert eng.stats()["slots_active"] == 0 and eng.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("policy", ["upfront", "on_demand", "reserved"])
def test_allocation_policies_give_the_same_tokens(policy):
    rng = random.Random(5)
    prompts = [random_prompt(rng, n) for n in (3, 30, 90)]
    params = SamplingParams(max_tokens=20, **GREEDY)
    ref = engine().generate(input_ids=prompts, params=params)
    got = engine(alloc_policy=policy, num_kv_blocks=12).generate(input_ids=prompts, params=params)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=20, **GREEDY),
                                    SamplingParams(max_tokens=20, temperature=1.0, seed=9,
                                                   ignore_eos=True)], ids=["greedy", "seeded"])
def test_resume_continues_a_generation(params):
    """A request moved to another worker continues from the delivered tokens."""
    eng = engine()
    full = eng.generate(prompts=["Once upon a time"], params=params)[0]
    events = []
    eng.submit(prompt="Once upon a time", params=params, resume_tokens=full.token_ids[:7],
               callback=events.append)
    while eng.has_work():
        eng.step()
    assert [t for e in events for t in e.token_ids] == full.token_ids[7:]
    assert events[-1].usage.completion_tokens == 20


def test_steps_launched_ahead_equal_steps_read_first():
    """Every step launched before the previous step's tokens are read (the
    rows in flight take their input on the device; prefill chunks and
    admissions included) gives the tokens of reading every step first: rows
    that stop early (stop ids), seeded sampling, a repetition penalty (its
    steps read first), long prompts prefilled in chunks beside decodes,
    requests joining as slots free, and a multi-turn session."""
    rng = random.Random(5)
    batch = [[rng.randrange(3, 500) for _ in range(rng.choice([3, 40, 130]))] for _ in range(12)]
    stop = list(range(3, 60))
    params = [SamplingParams(max_tokens=10 + 3 * i, temperature=0.0, stop_token_ids=stop)
              if i % 3 == 0 else
              SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=i)
              if i % 3 == 1 else
              SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3)
              for i in range(len(batch))]
    runs = {}
    for overlap in (False, True):
        started = time.perf_counter()
        eng = Engine(EngineConfig(model=demo_model_dir(), max_batch_size=4, block_size=16,
                                  max_num_batched_tokens=64, overlap_steps=overlap))
        done: dict = {}
        ids = [eng.submit(input_ids=p, params=sp,
                          callback=lambda e: done.setdefault(e.request_id, []).append(e))
               for p, sp in zip(batch, params)]
        while eng.has_work():
            eng.step()
        outs = [[t for e in done[r] for t in e.token_ids] for r in ids]
        reasons = [done[r][-1].finish_reason for r in ids]
        turns = [eng.generate(input_ids=[batch[t][:30]], session_id="chat",
                              params=SamplingParams(max_tokens=8, temperature=0.0))[0].token_ids
                 for t in range(3)]
        eng.kv_manager.check()
        assert (eng.counters["overlapped_steps"] > 0) == overlap
        assert 0 < eng.counters["token_wait_seconds"] < time.perf_counter() - started
        runs[overlap] = (outs, reasons, turns)
    assert runs[True] == runs[False]
    assert "stop" in runs[True][1] and "length" in runs[True][1]
