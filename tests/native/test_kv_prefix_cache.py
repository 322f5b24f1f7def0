"""Prefix caching in the KV cache manager: full blocks named by hashes are
reused by any later sequence whose prompt starts the same way; unreferenced
named blocks stay cached in LRU order until the pool needs them."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbomq._native import KVCacheManager, SeqState, SequenceStateError

BS = 4


def written(mgr, seq_id, num_tokens, hashes=()):
    """An ACTIVE sequence with num_tokens of KV written and its first full
    blocks named by `hashes`."""
    mgr.acquire(seq_id)
    assert mgr.reserve(seq_id, num_tokens)
    mgr.set_num_tokens(seq_id, num_tokens)
    mgr.commit_block_hashes(seq_id, 0, list(hashes))


def test_a_later_sequence_takes_the_named_blocks():
    mgr = KVCacheManager(8, BS)
    written(mgr, 1, 10, [11, 12])  # two full blocks named, a partial third
    table = mgr.block_table(1)
    mgr.erase(1)  # a stateless request ends: its named blocks stay cached
    assert mgr.num_free_blocks == 8 and mgr.stats()["cached_free_blocks"] == 2
    mgr.acquire(2)
    assert mgr.match_prefix([11, 12, 13]) == 2
    assert mgr.attach_prefix(2, [11, 12, 13]) == 2
    assert mgr.block_table(2) == table[:2] and mgr.num_tokens(2) == 2 * BS
    assert mgr.stats()["cached_free_blocks"] == 0
    assert mgr.reserve(2, 12)  # the rest is private
    assert mgr.block_table(2)[:2] == table[:2]
    s = mgr.stats()
    assert (s["prefix_queries"], s["prefix_hit_blocks"], s["cached_blocks"]) == (1, 2, 2)
    mgr.check()


def test_the_chain_stops_at_the_first_unknown_block():
    mgr = KVCacheManager(8, BS)
    written(mgr, 1, 12, [1, 2, 3])
    mgr.acquire(2)
    assert mgr.attach_prefix(2, [1, 9, 3]) == 1
    # a shared block has two owners; both tables name it
    assert mgr.block_table(1)[0] == mgr.block_table(2)[0]
    mgr.check()


def test_evicting_a_session_releases_its_blocks_to_the_cache():
    mgr = KVCacheManager(4, BS)
    written(mgr, 1, 8, [1, 2])
    mgr.release(1)
    mgr.evict(1)  # the session keeps only its token ids ...
    assert mgr.state(1) == SeqState.EVICTED
    mgr.acquire(1)  # ... and its next turn finds its blocks by name: a hit
    assert mgr.attach_prefix(1, [1, 2]) == 2 and mgr.num_tokens(1) == 8
    mgr.check()


def test_allocation_prefers_unnamed_blocks_then_the_oldest_cached():
    mgr = KVCacheManager(4, BS)
    written(mgr, 1, 4, [1])
    written(mgr, 2, 4, [2])
    mgr.erase(1)
    mgr.erase(2)  # cached free, oldest first: 1's block, then 2's
    mgr.acquire(3)
    assert mgr.reserve(3, 8)  # the two unnamed free blocks
    assert mgr.match_prefix([1]) == 1 and mgr.match_prefix([2]) == 1
    assert mgr.reserve(3, 12)  # now the oldest cached block is reused ...
    assert mgr.match_prefix([1]) == 0 and mgr.match_prefix([2]) == 1  # ... and forgotten
    assert mgr.stats()["cached_block_evictions"] == 1
    mgr.check()


def test_cached_blocks_are_used_before_any_session_is_evicted():
    mgr = KVCacheManager(4, BS)
    written(mgr, 1, 8, [1, 2])
    mgr.erase(1)
    written(mgr, 2, 8)
    mgr.release(2)  # a resident session
    mgr.acquire(3)
    assert mgr.reserve(3, 8)
    assert mgr.state(2) == SeqState.CACHED and mgr.last_evicted() == []
    assert mgr.reserve(3, 12)  # only now does the session go
    assert mgr.last_evicted() == [2]
    mgr.check()


def test_a_name_is_kept_once():
    mgr = KVCacheManager(8, BS)
    written(mgr, 1, 4, [7])
    written(mgr, 2, 4, [7])  # same content computed twice: the first block keeps the name
    mgr.erase(2)
    mgr.acquire(3)
    assert mgr.attach_prefix(3, [7]) == 1
    assert mgr.block_table(3) == mgr.block_table(1)
    mgr.check()


def test_misuse_is_refused():
    mgr = KVCacheManager(8, BS)
    written(mgr, 1, 6)
    with pytest.raises(ValueError, match="not all full"):
        mgr.commit_block_hashes(1, 0, [1, 2])  # the second block is partial
    with pytest.raises(SequenceStateError, match="already holds"):
        mgr.attach_prefix(1, [1])
    mgr.release(1)
    with pytest.raises(SequenceStateError):
        mgr.attach_prefix(1, [1])
    mgr.check()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4), st.booleans()), max_size=40))
def test_random_prompts_keep_every_invariant(requests):
    """Prompts drawn from a few shared prefixes, on a small pool: whatever is
    attached is exactly the chain of names the pool still holds, and the
    books always balance."""
    mgr = KVCacheManager(6, BS)
    live = []
    for i, (prefix, blocks, keep) in enumerate(requests):
        hashes = [prefix * 100 + j for j in range(blocks)]
        expected = mgr.match_prefix(hashes)
        mgr.acquire(i)
        got = mgr.attach_prefix(i, hashes)
        assert got == expected
        if not mgr.reserve(i, blocks * BS):
            mgr.erase(i)
            continue
        mgr.set_num_tokens(i, blocks * BS)
        mgr.commit_block_hashes(i, got, hashes[got:])
        if keep:
            mgr.release(i)
            live.append(i)
        else:
            mgr.erase(i)
        mgr.check()
    for i in live:
        mgr.erase(i)
    mgr.check()
    assert mgr.num_free_blocks == 6
