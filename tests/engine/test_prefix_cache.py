"""Prefix caching through the engine: a request reuses the leading KV blocks
any earlier request wrote for the same tokens (same tenant), whether it came
from a session, a stateless request or an evicted session; and the greedy
tokens are exactly those of an engine without the cache."""

from __future__ import annotations

import random

from helpers import demo_engine as engine, random_tokens
from turbomq.worker import SamplingParams

BLOCK = 16
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def test_a_shared_system_prompt_is_prefilled_once():
    rng = random.Random(0)
    system = random_tokens(rng, 100)
    prompts = [system + random_tokens(rng, rng.randint(1, 30)) for _ in range(6)]
    cached, plain = engine(), engine(prefix_caching=False)
    first = cached.generate(input_ids=prompts[:1], params=GREEDY)[0]
    rest = cached.generate(input_ids=prompts[1:], params=GREEDY)
    assert first.usage.cached_tokens == 0
    assert all(r.usage.cached_tokens == 100 // BLOCK * BLOCK for r in rest)
    expected = plain.generate(input_ids=prompts, params=GREEDY)
    assert [r.token_ids for r in [first, *rest]] == [r.token_ids for r in expected]
    assert all(r.usage.cached_tokens == 0 for r in expected)
    cached.kv_manager.check()


def test_resending_the_whole_history_reuses_it():
    # an OpenAI-style client: no session id, every turn sends everything
    rng = random.Random(1)
    cached, plain = engine(), engine(prefix_caching=False)
    history: list[int] = []
    for turn in range(4):
        prompt = history + random_tokens(rng, rng.randint(5, 40))
        got = cached.generate(input_ids=[prompt], params=GREEDY)[0]
        want = plain.generate(input_ids=[prompt], params=GREEDY)[0]
        assert got.token_ids == want.token_ids, f"turn {turn}"
        if turn:  # every full block of the previous turn's computed tokens
            assert got.usage.cached_tokens == (len(history) - 1) // BLOCK * BLOCK
        history = prompt + got.token_ids
    cached.kv_manager.check()


def test_under_eviction_pressure_tokens_equal_a_cache_free_engine():
    """Sessions and stateless requests with shared prefixes on a pool too small
    for them: blocks are named, dropped, reused and evicted all the time."""
    rng = random.Random(2)
    prefixes = [random_tokens(rng, 40) for _ in range(3)]
    work = []
    for i in range(24):
        prompt = rng.choice(prefixes)[:rng.randint(10, 40)] + random_tokens(rng, rng.randint(1, 20))
        work.append((f"s{rng.randrange(4)}" if rng.random() < 0.5 else None, prompt))
    results, stats = [], []
    for eng in (engine(num_kv_blocks=14), engine(prefix_caching=False)):
        out = [eng.generate(input_ids=[p], params=GREEDY, session_id=s)[0].token_ids
               for s, p in work]
        eng.kv_manager.check()
        results.append(out)
        stats.append(eng.kv_manager.stats())
    assert results[0] == results[1]
    # the cache was exercised: reused, pushed out, and sessions evicted
    assert stats[0]["prefix_hit_blocks"] > 0 and stats[0]["cached_block_evictions"] > 0
    assert stats[0]["evictions"] > 0


def test_tenants_do_not_share_cached_blocks():
    rng = random.Random(3)
    prompt = random_tokens(rng, 70)
    eng = engine()
    seen = {}

    def run(salt: str) -> int:
        def on_event(event):
            if event.finished:
                seen[salt] = event.usage.cached_tokens
        eng.submit(input_ids=prompt, params=GREEDY, callback=on_event, cache_salt=salt)
        while salt not in seen:
            eng.step()
        return seen.pop(salt)

    assert run("acme") == 0
    assert run("globex") == 0  # another tenant's blocks are not visible
    assert run("acme") == 64  # the same tenant's are


def test_without_the_cache_an_evicted_session_is_a_miss():
    rng = random.Random(4)
    eng = engine(prefix_caching=False)
    first = random_tokens(rng, 40)
    eng.generate(input_ids=[first], params=GREEDY, session_id="chat")
    eng.evict_session("chat")
    second = eng.generate(input_ids=[random_tokens(rng, 5)], params=GREEDY, session_id="chat")[0]
    assert second.usage.cached_tokens == 0
    stats = eng.stats()
    assert stats["cache_misses"] == 1 and stats["reprefilled_tokens"] == 50
