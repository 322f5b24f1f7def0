"""The host-RAM KV tier: named blocks the GPU pool has to reuse are copied to
host memory first, and a later prompt that misses in the pool but hits there
is loaded back instead of prefilled. Greedy tokens stay exactly those of an
engine without any cache (fp32 and INT8 KV)."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import demo_engine as engine, random_tokens
from turbomq.worker import SamplingParams
from turbomq.worker.engine.block_hash import extend_block_hashes

BLOCK = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_a_prefix_pushed_out_of_the_pool_comes_back_from_host_ram():
    rng = random.Random(0)
    system = random_tokens(rng, 96)  # 6 full blocks
    eng = engine(num_kv_blocks=10, host_kv_blocks=32)
    first = eng.generate(input_ids=[system + random_tokens(rng, 5)], params=GREEDY)[0]
    for _ in range(3):  # other traffic reuses every block of the pool
        eng.generate(input_ids=[random_tokens(rng, 120)], params=GREEDY)
    names: list[int] = []
    extend_block_hashes(names, system, BLOCK, 6, eng.scheduler.config.hash_seed)
    assert eng.kv_manager.match_prefix(names) == 0  # none of it is on the "GPU" any more
    again = eng.generate(input_ids=[system + random_tokens(rng, 5)], params=GREEDY)[0]
    assert again.usage.cached_tokens == 96  # all six blocks, loaded from host RAM
    stats = eng.stats()
    assert stats["host_tier_loaded_blocks"] == 6 and stats["host_tier_stored_blocks"] >= 6
    assert stats["host_tier_bytes"] > 0
    assert first.usage.cached_tokens == 0
    eng.kv_manager.check()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_tokens_equal_a_cache_free_engine_under_pressure(kv_dtype):
    rng = random.Random(1)
    prefixes = [random_tokens(rng, 48) for _ in range(4)]
    work = []
    turns: dict[str, int] = {}
    for _ in range(30):
        session = f"s{rng.randrange(6)}" if rng.random() < 0.4 else None
        if session is not None and turns.get(session, 0) >= 2:
            session = None  # sessions stay within the context limit
        if session is not None and turns.get(session):
            prompt = random_tokens(rng, rng.randint(1, 16))  # a later turn: new tokens only
        else:
            prompt = rng.choice(prefixes)[:rng.randint(16, 48)] + random_tokens(rng, rng.randint(1, 24))
        if session is not None:
            turns[session] = turns.get(session, 0) + 1
        work.append((session, prompt))
    runs = []
    for overrides in (dict(num_kv_blocks=14, host_kv_blocks=24), dict(prefix_caching=False)):
        eng = engine(kv_dtype=kv_dtype, **overrides)
        runs.append([eng.generate(input_ids=[p], params=GREEDY, session_id=s)[0].token_ids
                     for s, p in work])
        eng.kv_manager.check()
        if "host_kv_blocks" in overrides:
            stats = eng.stats()
            assert stats["host_tier_loaded_blocks"] > 0 and stats["host_tier_stored_blocks"] > 0
    assert runs[0] == runs[1]


def _system_pushed_to_host_ram(rng: random.Random):
    """An engine whose pool no longer holds `system` (6 blocks), and host
    RAM does; and the names of those blocks."""
    system = random_tokens(rng, 96)
    eng = engine(num_kv_blocks=10, host_kv_blocks=32)
    eng.generate(input_ids=[system + random_tokens(rng, 5)], params=GREEDY)
    for _ in range(3):
        eng.generate(input_ids=[random_tokens(rng, 120)], params=GREEDY)
    names: list[int] = []
    extend_block_hashes(names, system, BLOCK, 6, eng.scheduler.config.hash_seed)
    assert eng.kv_manager.match_prefix(names) == 0
    return eng, system, names


def test_a_request_loading_from_host_ram_joins_the_batch_once_its_blocks_land():
    rng = random.Random(2)
    eng, system, names = _system_pushed_to_host_ram(rng)
    prompt = system + random_tokens(rng, 5)
    events = []
    eng.submit(input_ids=prompt, params=GREEDY, callback=events.append)
    plans = []
    eng.step_observer = lambda plan, _s: plans.append(plan)
    eng.step()  # admitted: slot and blocks held, copies issued, left out of the step
    (seq,) = eng.scheduler.running
    assert seq.loading is not None and seq.num_computed == 96 and not plans
    assert eng.kv_manager.match_prefix(names) == 0  # not named before they land
    eng.step()  # landed: named, and its last tokens are prefilled
    assert seq.loading is None and eng.kv_manager.match_prefix(names) == 6
    assert [(i.seq, i.num_new_tokens) for i in plans[0].scheduled] == [(seq, 5)]
    while not (events and events[-1].finished):
        eng.step()
    want = engine(prefix_caching=False).generate(input_ids=[prompt], params=GREEDY)[0]
    assert [t for e in events for t in e.token_ids] == want.token_ids
    assert events[-1].usage.cached_tokens == 96
    eng.kv_manager.check()


def test_a_request_cancelled_while_loading_leaves_the_pool_sound():
    rng = random.Random(3)
    eng, system, names = _system_pushed_to_host_ram(rng)
    prompt = system + random_tokens(rng, 5)
    events = []
    rid = eng.submit(input_ids=prompt, params=GREEDY, callback=events.append)
    eng.step()
    assert eng.scheduler.running[0].loading is not None
    eng.cancel(rid)
    eng.step()
    assert events[-1].finish_reason == "cancelled" and not eng.scheduler.has_work()
    eng.kv_manager.check()
    again = eng.generate(input_ids=[prompt], params=GREEDY)[0]  # takes the loaded blocks by name
    want = engine(prefix_caching=False).generate(input_ids=[prompt], params=GREEDY)[0]
    assert again.token_ids == want.token_ids and again.usage.cached_tokens == 96
    eng.kv_manager.check()


def test_the_tier_is_off_on_the_cpu_by_default():
    assert engine(num_kv_blocks=10).host_tier is None


def test_a_loaded_block_leaves_the_tier_and_its_slot_frees_after_the_step():
    from turbomq.worker.engine.host_tier import HostTier

    tier = HostTier(2)
    a, b = tier.store(10), tier.store(11)
    assert {a, b} == {0, 1} and tier.store(10) is None  # held already: touched, no copy
    assert tier.lookup_chain([10, 11, 12]) == [a, b]
    tier.take([10])  # being loaded this step
    assert tier.lookup_chain([10]) == [] and len(tier) == 1 and tier.loaded_blocks == 1
    # while the load runs its slot is not reused: the LRU block's slot is
    assert tier.store(12) == b and tier.lookup_chain([11]) == []
    tier.end_step()
    assert tier.store(13) == a  # free again from the next step
    assert tier.stats()["host_tier_blocks_used"] == 2 and tier.stored_blocks == 4


@pytest.mark.parametrize("shape,dtype", [((0,), torch.uint8), ((17,), torch.uint8),
                                         ((5, 3, 7), torch.bfloat16), ((1 << 20, 3), torch.int8),
                                         ((1000, 9), torch.float32)])
def test_host_zeros_fault_in_every_byte(shape, dtype):
    """The host tier's memory before it is registered with the driver: every
    chunk the threads share zeroed, whatever the size."""
    from turbomq.worker.engine.runner import host_zeros

    # freed just before, dirty: the allocator hands such memory back, so
    # a chunk left unzeroed shows
    dirty = torch.empty(shape, dtype=dtype)
    dirty.view(-1).view(torch.uint8).fill_(0xFF)
    del dirty
    t = host_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.view(-1).view(torch.uint8).any()
