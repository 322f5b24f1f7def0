"""KV cache manager (turbomq._native.KVCacheManager): unit tests and a
stateful comparison against a pure-Python model of the same semantics."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from turbomq._native import (
    KVCacheManager,
    SeqState,
    SequenceNotFoundError,
    SequenceStateError,
)

ACTIVE, CACHED, EVICTED = SeqState.ACTIVE, SeqState.CACHED, SeqState.EVICTED
NO_PREFIX_STATS = dict(prefix_queries=0, prefix_hit_blocks=0, cached_blocks=0,
                       cached_free_blocks=0, cached_block_evictions=0)


def filled(mgr, seq_id, num_tokens):
    """Acquire seq_id, give it num_tokens of written KV, leave it ACTIVE."""
    mgr.acquire(seq_id)
    assert mgr.reserve(seq_id, num_tokens)
    mgr.set_num_tokens(seq_id, num_tokens)


def cached(mgr, seq_id, num_tokens):
    filled(mgr, seq_id, num_tokens)
    mgr.release(seq_id)


# ------------------------------------------------------------------ basics


def test_module_exports_and_exception_mapping():
    assert issubclass(SequenceNotFoundError, KeyError)
    assert issubclass(SequenceStateError, ValueError)
    assert {s.name for s in (ACTIVE, CACHED, EVICTED)} == {"ACTIVE", "CACHED", "EVICTED"}


def test_constructor_and_properties():
    mgr = KVCacheManager(8, 16)
    assert (mgr.num_blocks, mgr.block_size) == (8, 16)
    assert (mgr.num_free_blocks, mgr.num_used_blocks) == (8, 0)
    assert mgr.lru_order() == []
    assert mgr.last_evicted() == []
    assert mgr.stats() == dict(
        evictions=0, cache_hits=0, cache_misses=0, evicted_tokens=0,
        active_sequences=0, cached_sequences=0, evicted_sequences=0, **NO_PREFIX_STATS,
    )
    mgr.check()
    KVCacheManager(0, 1).check()  # an empty pool is legal
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(8, 0)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(-1, 4)


def test_acquire_new_and_active_is_error():
    mgr = KVCacheManager(4, 4)
    assert mgr.acquire(7) == 0
    assert mgr.contains(7) and 7 in mgr and not mgr.contains(8)
    assert mgr.state(7) == ACTIVE
    assert mgr.block_table(7) == []
    with pytest.raises(SequenceStateError, match="already ACTIVE"):
        mgr.acquire(7)
    assert mgr.stats()["cache_hits"] == mgr.stats()["cache_misses"] == 0
    mgr.check()


def test_large_and_negative_ids():
    mgr = KVCacheManager(2, 1)
    for seq_id in (2**63 - 1, -(2**63), -5):
        mgr.acquire(seq_id)
        assert mgr.state(seq_id) == ACTIVE
    mgr.check()


def test_release():
    mgr = KVCacheManager(4, 4)
    filled(mgr, 1, 5)
    filled(mgr, 2, 1)
    mgr.release(2)
    mgr.release(1)
    assert mgr.state(1) == CACHED
    assert mgr.lru_order() == [2, 1]
    assert mgr.num_used_blocks == 3  # cached KV stays resident
    with pytest.raises(SequenceStateError, match="CACHED, expected ACTIVE"):
        mgr.release(1)
    with pytest.raises(SequenceNotFoundError, match="release: unknown sequence 9"):
        mgr.release(9)
    mgr.check()


def test_reserve_grows_by_ceil_and_never_shrinks():
    mgr = KVCacheManager(10, 4)
    mgr.acquire(1)
    assert mgr.reserve(1, 0) and mgr.block_table(1) == []
    assert mgr.reserve(1, 1) and mgr.block_table(1) == [0]
    assert mgr.reserve(1, 4) and mgr.block_table(1) == [0]
    assert mgr.reserve(1, 9) and mgr.block_table(1) == [0, 1, 2]
    assert mgr.reserve(1, 2) and mgr.block_table(1) == [0, 1, 2]
    assert mgr.num_free_blocks == 7
    assert mgr.reserve(1, 40) and len(mgr.block_table(1)) == 10
    assert not mgr.reserve(1, 41)  # more than the whole pool
    assert len(mgr.block_table(1)) == 10
    mgr.check()


def test_reserve_errors():
    mgr = KVCacheManager(4, 4)
    with pytest.raises(SequenceNotFoundError):
        mgr.reserve(1, 4)
    cached(mgr, 1, 4)
    with pytest.raises(SequenceStateError, match="reserve: sequence 1 is CACHED"):
        mgr.reserve(1, 8)
    mgr.acquire(2)
    with pytest.raises(ValueError, match="num_tokens must be >= 0") as info:
        mgr.reserve(2, -1)
    assert type(info.value) is ValueError
    mgr.check()


def test_set_num_tokens_bounds_and_state():
    mgr = KVCacheManager(4, 4)
    mgr.acquire(1)
    mgr.reserve(1, 5)  # capacity 8
    mgr.set_num_tokens(1, 8)
    assert mgr.num_tokens(1) == 8
    mgr.set_num_tokens(1, 3)  # rolling back is allowed
    assert mgr.num_tokens(1) == 3
    with pytest.raises(ValueError, match=r"outside \[0, 8\]"):
        mgr.set_num_tokens(1, 9)
    with pytest.raises(ValueError):
        mgr.set_num_tokens(1, -1)
    mgr.release(1)
    with pytest.raises(SequenceStateError):
        mgr.set_num_tokens(1, 2)
    with pytest.raises(SequenceNotFoundError):
        mgr.set_num_tokens(5, 0)
    with pytest.raises(SequenceNotFoundError):
        mgr.num_tokens(5)
    assert mgr.num_tokens(1) == 3
    mgr.check()


# ----------------------------------------------------------- hits / misses


def test_hits_and_misses():
    mgr = KVCacheManager(4, 4)
    cached(mgr, 1, 6)
    assert mgr.acquire(1) == 6  # hit: resident tokens come back
    mgr.release(1)
    mgr.evict(1)
    assert mgr.state(1) == EVICTED and mgr.num_tokens(1) == 0
    assert mgr.acquire(1) == 0  # miss
    mgr.release(1)  # CACHED with nothing resident
    assert mgr.acquire(1) == 0  # neither hit nor miss
    s = mgr.stats()
    assert (s["cache_hits"], s["cache_misses"]) == (1, 1)
    assert (s["evictions"], s["evicted_tokens"]) == (1, 6)
    mgr.check()


# ---------------------------------------------------------------- eviction


def test_eviction_follows_lru_order():
    mgr = KVCacheManager(4, 2)
    for seq_id in (1, 2, 3, 4):
        cached(mgr, seq_id, 2)  # one block each; pool now full
    assert mgr.lru_order() == [1, 2, 3, 4]
    assert mgr.acquire(1) == 2  # 1 is now in use, so 2 is the oldest
    mgr.release(1)
    assert mgr.lru_order() == [2, 3, 4, 1]

    mgr.acquire(10)
    assert mgr.reserve(10, 3)  # needs two blocks
    assert mgr.last_evicted() == [2, 3]
    assert mgr.state(2) == mgr.state(3) == EVICTED
    assert mgr.block_table(2) == []
    assert mgr.lru_order() == [4, 1]
    s = mgr.stats()
    assert (s["evictions"], s["evicted_tokens"]) == (2, 4)
    assert (s["active_sequences"], s["cached_sequences"], s["evicted_sequences"]) == (1, 2, 2)

    assert mgr.reserve(10, 4)  # already covered: no eviction
    assert mgr.last_evicted() == []  # reset by every reserve call
    mgr.check()


def test_active_sequences_are_never_evicted():
    mgr = KVCacheManager(3, 1)
    filled(mgr, 1, 2)  # active, holds 2 blocks
    cached(mgr, 2, 1)
    mgr.acquire(3)
    assert mgr.reserve(3, 1)  # the cached one goes, the active one stays
    assert mgr.last_evicted() == [2]
    assert not mgr.reserve(3, 2)
    assert mgr.state(1) == ACTIVE and len(mgr.block_table(1)) == 2
    mgr.check()


def test_reserve_is_all_or_nothing():
    mgr = KVCacheManager(6, 1)
    filled(mgr, 1, 2)  # active: pinned
    cached(mgr, 2, 1)
    cached(mgr, 3, 1)
    mgr.acquire(4)
    before = (mgr.num_free_blocks, mgr.lru_order(), mgr.stats())
    # 2 free + 2 from the cached ones = 4 < 5: must fail without evicting.
    assert not mgr.reserve(4, 5)
    assert (mgr.num_free_blocks, mgr.lru_order(), mgr.stats()) == before
    assert mgr.last_evicted() == []
    assert mgr.block_table(4) == []
    assert mgr.state(2) == mgr.state(3) == CACHED
    assert mgr.reserve(4, 4)  # exactly fits after evicting both
    assert mgr.last_evicted() == [2, 3]
    mgr.check()


def test_all_or_nothing_counts_only_blocks_that_would_be_freed():
    # The cached sequence's blocks are shared with an active fork, so
    # evicting it frees nothing; counting its table size would be wrong.
    mgr = KVCacheManager(4, 2)
    cached(mgr, 1, 4)  # blocks [0, 1]
    mgr.fork(1, 2, 4)  # active 2 shares both
    mgr.acquire(3)
    assert mgr.num_free_blocks == 2
    assert not mgr.reserve(3, 5)  # needs 3 blocks; only 2 can ever be free
    assert mgr.state(1) == CACHED and mgr.num_tokens(1) == 4
    assert mgr.stats()["evictions"] == 0
    mgr.check()


def test_evict_op():
    mgr = KVCacheManager(4, 2)
    filled(mgr, 1, 3)
    with pytest.raises(SequenceStateError, match="ACTIVE, expected CACHED"):
        mgr.evict(1)
    mgr.release(1)
    mgr.evict(1)
    assert mgr.state(1) == EVICTED and mgr.num_free_blocks == 4
    assert mgr.lru_order() == []
    with pytest.raises(SequenceStateError):
        mgr.evict(1)
    with pytest.raises(SequenceNotFoundError):
        mgr.evict(2)
    assert mgr.stats()["evicted_tokens"] == 3
    mgr.check()


def test_erase_any_state():
    mgr = KVCacheManager(6, 2)
    filled(mgr, 1, 3)
    cached(mgr, 2, 3)
    cached(mgr, 3, 3)
    mgr.evict(3)
    for seq_id in (1, 2, 3):
        mgr.erase(seq_id)
        assert not mgr.contains(seq_id)
        mgr.check()
    assert mgr.num_free_blocks == 6 and mgr.lru_order() == []
    with pytest.raises(SequenceNotFoundError):
        mgr.erase(1)
    with pytest.raises(SequenceNotFoundError):
        mgr.state(1)
    assert mgr.acquire(1) == 0  # a forgotten id comes back as new: no miss
    assert mgr.stats()["cache_misses"] == 0


# ------------------------------------------------------------------- fork


def test_fork_shares_full_blocks_only():
    mgr = KVCacheManager(8, 4)
    filled(mgr, 1, 10)  # blocks [0, 1, 2], last one partial
    mgr.fork(1, 2, 10)
    assert mgr.state(2) == ACTIVE
    assert mgr.block_table(2) == [0, 1]
    assert mgr.num_tokens(2) == 8
    assert mgr.num_used_blocks == 3
    assert mgr.reserve(2, 12)
    assert mgr.block_table(2) == [0, 1, 3]  # appends land in a fresh block
    mgr.fork(1, 3, 3)  # less than one full block: nothing shared
    assert mgr.block_table(3) == [] and mgr.num_tokens(3) == 0
    mgr.check()


def test_fork_from_cached_touches_lru():
    mgr = KVCacheManager(8, 2)
    cached(mgr, 1, 4)
    cached(mgr, 2, 4)
    assert mgr.lru_order() == [1, 2]
    mgr.fork(1, 3, 4)
    assert mgr.lru_order() == [2, 1]
    assert mgr.state(1) == CACHED
    mgr.check()


def test_fork_into_evicted_destination():
    mgr = KVCacheManager(4, 2)
    cached(mgr, 1, 4)
    cached(mgr, 2, 2)
    mgr.evict(2)
    mgr.fork(1, 2, 4)
    assert mgr.state(2) == ACTIVE and mgr.block_table(2) == mgr.block_table(1)
    s = mgr.stats()
    assert (s["cache_misses"], s["evicted_sequences"], s["active_sequences"]) == (0, 0, 1)
    mgr.check()


def test_fork_errors():
    mgr = KVCacheManager(8, 2)
    filled(mgr, 1, 4)
    filled(mgr, 2, 2)
    with pytest.raises(SequenceNotFoundError):
        mgr.fork(9, 3, 0)
    with pytest.raises(ValueError, match="same"):
        mgr.fork(1, 1, 2)
    with pytest.raises(ValueError, match=r"outside \[0, 4\]") as info:
        mgr.fork(1, 3, 5)
    assert type(info.value) is ValueError
    with pytest.raises(ValueError):
        mgr.fork(1, 3, -1)
    with pytest.raises(SequenceStateError, match="destination sequence 2 is ACTIVE"):
        mgr.fork(1, 2, 2)
    mgr.release(2)
    with pytest.raises(SequenceStateError, match="destination sequence 2 is CACHED"):
        mgr.fork(1, 2, 2)
    mgr.evict(2)
    with pytest.raises(SequenceStateError, match="source sequence 2 is EVICTED"):
        mgr.fork(2, 3, 0)
    assert not mgr.contains(3)  # failed forks create nothing
    mgr.check()


def test_shared_blocks_survive_eviction_of_one_owner():
    mgr = KVCacheManager(6, 2)
    filled(mgr, 1, 6)  # [0, 1, 2]
    mgr.fork(1, 2, 4)  # shares [0, 1]
    mgr.release(1)
    mgr.release(2)
    mgr.acquire(3)
    # 3 free blocks; needs 4: evicting 1 frees only its private block 2.
    assert mgr.reserve(3, 8)
    assert mgr.last_evicted() == [1]
    assert mgr.state(2) == CACHED and mgr.block_table(2) == [0, 1]
    assert mgr.acquire(2) == 4  # the shared prefix is still resident: a hit
    assert mgr.stats()["cache_hits"] == 1
    mgr.check()
    mgr.erase(2)
    assert mgr.num_free_blocks == 2  # now the shared blocks go back
    mgr.check()


# ------------------------------------------------------------ block_tables


def test_block_tables_batched():
    mgr = KVCacheManager(8, 2)
    filled(mgr, 1, 5)
    filled(mgr, 2, 1)
    mgr.acquire(3)
    table = mgr.block_tables([2, 1, 3], 4)
    assert table.dtype == np.int32 and table.shape == (3, 4)
    assert table.tolist() == [[3, -1, -1, -1], [0, 1, 2, -1], [-1, -1, -1, -1]]
    assert mgr.block_tables(np.array([1], dtype=np.int64), 3).tolist() == [[0, 1, 2]]
    assert mgr.block_tables([], 5).shape == (0, 5)
    assert mgr.block_tables([1], 2).tolist() == [[0, 1]]  # rows keep the first `width` blocks
    with pytest.raises(ValueError):
        mgr.block_tables([1], -1)
    with pytest.raises(SequenceNotFoundError):
        mgr.block_tables([1, 9], 4)


# ---------------------------------------------------- model-based testing


class ModelError(Exception):
    def __init__(self, kind):
        super().__init__(kind.__name__)
        self.kind = kind


class ModelSeq:
    def __init__(self, state):
        self.state = state
        self.blocks = []  # abstract block ids, never reused
        self.num_tokens = 0


class KVModel:
    """Straightforward reference of the manager's semantics."""

    def __init__(self, num_blocks, block_size):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcount = {}  # live abstract block -> owners
        self.next_block = 0
        self.seqs = {}
        self.lru = []  # oldest first
        self.counters = Counter()
        self.last_evicted = []

    @property
    def num_free(self):
        return self.num_blocks - len(self.refcount)

    def _get(self, seq_id):
        if seq_id not in self.seqs:
            raise ModelError(SequenceNotFoundError)
        return self.seqs[seq_id]

    def _require(self, seq, *states):
        if seq.state not in states:
            raise ModelError(SequenceStateError)

    def _drop_blocks(self, seq):
        for b in seq.blocks:
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                del self.refcount[b]
        seq.blocks = []
        seq.num_tokens = 0

    def _evict(self, seq_id):
        seq = self.seqs[seq_id]
        self.lru.remove(seq_id)
        self.counters["evictions"] += 1
        self.counters["evicted_tokens"] += seq.num_tokens
        self._drop_blocks(seq)
        seq.state = EVICTED

    def acquire(self, seq_id):
        seq = self.seqs.get(seq_id)
        if seq is None:
            self.seqs[seq_id] = ModelSeq(ACTIVE)
            return 0
        self._require(seq, CACHED, EVICTED)
        if seq.state == CACHED:
            self.lru.remove(seq_id)
            if seq.num_tokens > 0:
                self.counters["cache_hits"] += 1
        else:
            self.counters["cache_misses"] += 1
        seq.state = ACTIVE
        return seq.num_tokens

    def release(self, seq_id):
        seq = self._get(seq_id)
        self._require(seq, ACTIVE)
        seq.state = CACHED
        self.lru.append(seq_id)

    def reserve(self, seq_id, num_tokens):
        self.last_evicted = []
        seq = self._get(seq_id)
        self._require(seq, ACTIVE)
        if num_tokens < 0:
            raise ModelError(ValueError)
        needed = -(-num_tokens // self.block_size) - len(seq.blocks)
        if needed <= 0:
            return True
        if needed > self.num_free:
            cached_refs = Counter(b for i in self.lru for b in self.seqs[i].blocks)
            freeable = sum(1 for b, n in cached_refs.items() if n == self.refcount[b])
            if needed > self.num_free + freeable:
                return False
            while self.num_free < needed:
                victim = self.lru[0]
                self._evict(victim)
                self.last_evicted.append(victim)
        for _ in range(needed):
            self.refcount[self.next_block] = 1
            seq.blocks.append(self.next_block)
            self.next_block += 1
        return True

    def set_num_tokens(self, seq_id, num_tokens):
        seq = self._get(seq_id)
        self._require(seq, ACTIVE)
        if not 0 <= num_tokens <= len(seq.blocks) * self.block_size:
            raise ModelError(ValueError)
        seq.num_tokens = num_tokens

    def fork(self, src_id, dst_id, num_tokens):
        if src_id == dst_id:
            raise ModelError(ValueError)
        src = self._get(src_id)
        self._require(src, ACTIVE, CACHED)
        if not 0 <= num_tokens <= src.num_tokens:
            raise ModelError(ValueError)
        if dst_id in self.seqs:
            self._require(self.seqs[dst_id], EVICTED)
        dst = self.seqs.setdefault(dst_id, ModelSeq(ACTIVE))
        dst.state = ACTIVE
        full = num_tokens // self.block_size
        dst.blocks = src.blocks[:full]
        for b in dst.blocks:
            self.refcount[b] += 1
        dst.num_tokens = full * self.block_size
        if src.state == CACHED:
            self.lru.remove(src_id)
            self.lru.append(src_id)

    def evict(self, seq_id):
        seq = self._get(seq_id)
        self._require(seq, CACHED)
        self._evict(seq_id)

    def erase(self, seq_id):
        seq = self._get(seq_id)
        if seq.state == CACHED:
            self.lru.remove(seq_id)
        self._drop_blocks(seq)
        del self.seqs[seq_id]

    def stats(self):
        states = Counter(s.state for s in self.seqs.values())
        return dict(
            evictions=self.counters["evictions"],
            cache_hits=self.counters["cache_hits"],
            cache_misses=self.counters["cache_misses"],
            evicted_tokens=self.counters["evicted_tokens"],
            active_sequences=states[ACTIVE],
            cached_sequences=states[CACHED],
            evicted_sequences=states[EVICTED],
            **NO_PREFIX_STATS,  # the model runs without block names
        )


ID_SPACE = st.integers(0, 7)


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(0, 8), block_size=st.integers(1, 3))
    def setup(self, num_blocks, block_size):
        self.real = KVCacheManager(num_blocks, block_size)
        self.model = KVModel(num_blocks, block_size)
        self.real_block_of = {}  # abstract model block -> real block id

    def pick(self, data, *states):
        """Mostly an id in one of `states`; sometimes any id, to hit errors."""
        candidates = sorted(i for i, s in self.model.seqs.items() if s.state in states)
        if candidates and data.draw(st.integers(0, 9), label="valid") < 8:
            return data.draw(st.sampled_from(candidates), label="id")
        return data.draw(ID_SPACE, label="id")

    def apply(self, op, *args):
        try:
            expected = getattr(self.model, op)(*args)
        except ModelError as e:
            with pytest.raises(Exception) as info:
                getattr(self.real, op)(*args)
            assert type(info.value) is e.kind, (op, args, info.value)
        else:
            assert getattr(self.real, op)(*args) == expected, (op, args)
        self.real.check()  # after every operation, failed ones included

    def check_last_evicted(self):
        assert self.real.last_evicted() == self.model.last_evicted
        if self.model.last_evicted:
            event("reserve evicted")  # shown by --hypothesis-show-statistics

    @rule(data=st.data())
    def acquire(self, data):
        if data.draw(st.booleans()):
            self.apply("acquire", self.pick(data, CACHED, EVICTED))
        else:
            self.apply("acquire", data.draw(ID_SPACE))

    @rule(data=st.data())
    def release(self, data):
        self.apply("release", self.pick(data, ACTIVE))

    @rule(data=st.data())
    def reserve(self, data):
        seq_id = self.pick(data, ACTIVE)
        limit = (self.model.num_blocks + 1) * self.model.block_size
        self.apply("reserve", seq_id, data.draw(st.integers(-1, limit)))
        self.check_last_evicted()

    @rule(data=st.data())
    def set_num_tokens(self, data):
        seq_id = self.pick(data, ACTIVE)
        seq = self.model.seqs.get(seq_id)
        capacity = len(seq.blocks) * self.model.block_size if seq else 0
        self.apply("set_num_tokens", seq_id, data.draw(st.integers(-1, capacity + 1)))

    @rule(data=st.data())
    def grow_and_write(self, data):
        """The engine's step: reserve, then record the written tokens."""
        self.grow(self.pick(data, ACTIVE), data)

    def grow(self, seq_id, data):
        seq = self.model.seqs.get(seq_id)
        if seq is None or seq.state != ACTIVE:
            return
        target = seq.num_tokens + data.draw(st.integers(1, 2 * self.model.block_size))
        self.apply("reserve", seq_id, target)
        self.check_last_evicted()
        if len(seq.blocks) * self.model.block_size >= target:
            self.apply("set_num_tokens", seq_id, target)

    @rule(data=st.data())
    def fork(self, data):
        src = self.pick(data, ACTIVE, CACHED)
        dst = self.pick(data, EVICTED) if data.draw(st.booleans()) else data.draw(ID_SPACE)
        resident = self.model.seqs[src].num_tokens if src in self.model.seqs else 0
        self.apply("fork", src, dst, data.draw(st.integers(-1, resident + 1)))

    @rule(data=st.data())
    def evict_or_erase(self, data):
        op = data.draw(st.sampled_from(["evict", "erase"]))
        states = (CACHED,) if op == "evict" else (ACTIVE, CACHED, EVICTED)
        self.apply(op, self.pick(data, *states))

    @rule(data=st.data())
    def turn(self, data):
        """A whole turn of a session: acquire, append tokens, release. Keeps
        the LRU full of resident sequences so reserves keep evicting."""
        seq_id = self.pick(data, CACHED, EVICTED)
        if seq_id in self.model.seqs and self.model.seqs[seq_id].state == ACTIVE:
            return
        self.apply("acquire", seq_id)
        self.grow(seq_id, data)
        self.apply("release", seq_id)

    @invariant()
    def matches_model(self):
        real, model = self.real, self.model
        real.check()
        assert real.num_free_blocks == model.num_free
        assert real.num_used_blocks == model.num_blocks - model.num_free
        assert real.lru_order() == model.lru
        assert real.stats() == model.stats()
        for seq_id in range(8):
            assert real.contains(seq_id) == (seq_id in model.seqs)
        ids = sorted(model.seqs)
        width = max((len(model.seqs[i].blocks) for i in ids), default=0)
        batched = real.block_tables(ids, width)
        for row, seq_id in enumerate(ids):
            seq = model.seqs[seq_id]
            assert real.state(seq_id) == seq.state
            assert real.num_tokens(seq_id) == seq.num_tokens
            table = real.block_table(seq_id)
            assert len(table) == len(seq.blocks)
            assert batched[row].tolist() == table + [-1] * (width - len(table))
            # Each abstract block keeps one real block for its whole life,
            # so shared prefixes and untouched tables are checked exactly.
            for abstract, block in zip(seq.blocks, table):
                assert self.real_block_of.setdefault(abstract, block) == block
        self.real_block_of = {
            a: b for a, b in self.real_block_of.items() if a in model.refcount
        }
        assert len(set(self.real_block_of.values())) == len(self.real_block_of)


TestKVCacheMachine = KVCacheMachine.TestCase
TestKVCacheMachine.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
