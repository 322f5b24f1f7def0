"""The persistent batch: N slots and a waiting queue. Pure bookkeeping — no
tensors. Each step it decides which sequences run and how many new tokens
each feeds; the KV cache manager (native) decides which blocks hold them.

Policy (see docs/engine.md):
- Decode first: every running sequence past its prompt gets one token.
- Then prefill chunks: running sequences still prefilling, oldest first, then
  waiting requests in arrival order (FCFS) while slots and token budget last.
  The head of the queue is never overtaken, so a long prompt cannot starve.
- When the pool is short, the manager evicts least recently used cached
  sessions; if that is not enough, the newest running sequence is preempted
  (its KV dropped, re-prefilled later from its token IDs).
- A request admitted with blocks to load from the host-RAM tier holds its
  slot and blocks but is left out of the batch until the engine reports the
  copies landed (`loaded`), so the batch never waits for PCIe.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from .block_hash import extend_block_hashes, salted
from .host_tier import HostTier
from .sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class AllocPolicy(str, enum.Enum):
    UPFRONT = "upfront"  # blocks for prompt + max_tokens at admission
    ON_DEMAND = "on_demand"  # blocks for each step's tokens only
    RESERVED = "reserved"  # prompt + a reserved minimum at admission, then on demand


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = 8
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    block_size: int = 64
    alloc_policy: AllocPolicy = AllocPolicy.ON_DEMAND
    reserved_tokens: int = 64
    # Full blocks are named by their content, and a sequence that starts
    # without resident KV takes the leading blocks the pool already holds.
    prefix_caching: bool = True
    hash_seed: int = 0  # names depend on the model and KV dtype (block_hash.py)


@dataclass(eq=False)
class Sequence:
    request_id: str
    kv_key: int  # id in the KV cache manager
    session_id: Optional[str]
    tokens: list[int]  # full context: session history + new prompt + generated
    prompt_len: int  # len(tokens) before generation
    params: SamplingParams
    history_len: int = 0  # session tokens from earlier turns
    arrival: float = field(default_factory=time.monotonic)
    status: SeqStatus = SeqStatus.WAITING
    slot: Optional[int] = None
    num_computed: int = 0  # tokens whose KV is in the pool
    # Tokens sampled on the GPU whose values the host has not read yet (0 or
    # 1): they follow `tokens` and are appended when delivered.
    inflight: int = 0
    cached_tokens: int = 0  # tokens reused at admission (resident session or prefix cache)
    reprefilled_tokens: int = 0  # history recomputed after an eviction
    cache_salt: str = ""  # keeps one tenant's cached blocks from another's
    block_hashes: list[int] = field(default_factory=list)  # names of full blocks of tokens
    named_blocks: int = 0  # leading blocks the KV manager knows by name
    finish_reason: Optional[str] = None
    first_admitted: Optional[float] = None
    admit_order: int = -1  # position in the running order, set on admission
    # Host-tier blocks on their way into the pool: (first block, names).
    # Left out of every step until they land.
    loading: Optional[tuple[int, list[int]]] = None

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_tokens(self) -> int:
        """Known tokens plus the one in flight, if any."""
        return len(self.tokens) + self.inflight

    @property
    def in_decode(self) -> bool:
        return self.num_computed == self.num_tokens - 1


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the known tokens, so its last
        logits give the next token."""
        return self.seq.num_computed + self.num_new_tokens == self.seq.num_tokens


@dataclass
class StepPlan:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]
    # Host-RAM tier copies to make before the forward, in this order:
    # (GPU block, host slot) out, then (host slot, GPU block) in; `loading`
    # the sequences those loads are for (they wait for `loaded`).
    spills: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)
    loading: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager,
                 host_tier: Optional[HostTier] = None) -> None:
        self.config = config
        self.kv = kv_manager
        self.host = host_tier if config.prefix_caching else None
        if self.host is not None:
            kv_manager.set_record_reclaimed(True)
        self._loads: list[tuple[int, int]] = []
        self._loading: list[Sequence] = []
        self.slots: list[Optional[Sequence]] = [None] * config.max_batch_size
        self._free_slots = list(range(config.max_batch_size - 1, -1, -1))  # stack, lowest on top
        self.waiting: deque[Sequence] = deque()
        # running sequences in admission order: iteration is oldest first and
        # the newest (the preemption victim) is the last entry
        self._running: dict[int, Sequence] = {}
        self._admit_order = itertools.count()
        self.cache_hits = 0
        self.cache_misses = 0
        self.preemptions = 0

    # -- queries -------------------------------------------------------------
    @property
    def running(self) -> list[Sequence]:
        return list(self._running.values())

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self._running)

    def max_tokens_in_pool(self) -> int:
        return self.kv.num_blocks * self.config.block_size

    # -- requests ------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)

    # -- one step ------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan([], [])
        budget = self.config.max_num_batched_tokens

        decoding, prefilling = [], []  # both oldest first
        for seq in self._running.values():
            if seq.loading is not None:
                continue  # its history is still being copied in
            if seq.inflight and self._last_token_in_flight(seq):
                continue  # finishes when that token is delivered
            (decoding if seq.in_decode else prefilling).append(seq)
        scheduled = plan.scheduled
        reserve = self.kv.reserve
        # 1. one decode token for every running sequence past its prompt
        for seq in decoding:
            if budget < 1:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted by an earlier reservation this step
            if not reserve(seq.kv_key, seq.num_computed + 1) and not self._reserve(
                    seq, seq.num_computed + 1, plan):
                continue  # seq itself was preempted
            scheduled.append(ScheduledSeq(seq, 1))
            budget -= 1

        # 2. prefill chunks of running sequences still in their prompt
        for seq in prefilling:
            if budget < 1:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue
            n = min(len(seq.tokens) - seq.num_computed, budget)
            if not self._reserve(seq, seq.num_computed + n, plan):
                continue
            plan.scheduled.append(ScheduledSeq(seq, n))
            budget -= n

        # 3. admit waiting requests, FCFS, while slots and budget last
        computing: set[int] = set()  # names of blocks this step's admissions compute
        while self.waiting and budget >= 1 and self.num_free_slots:
            seq = self.waiting[0]
            if seq.inflight:
                break  # preempted with a token in flight: admitted once it is delivered
            if computing and self._next_block_in(seq, computing):
                break  # it would compute a block again: take it by name next step
            if not self._admit(seq):
                break  # head of line waits for blocks; nobody overtakes it
            self.waiting.popleft()
            if seq.loading is not None:
                continue  # computes once its blocks from host RAM land
            if self.config.prefix_caching:
                computing.update(seq.block_hashes[seq.named_blocks:])
            # _admit reserved blocks for all known tokens, so any chunk fits
            n = min(len(seq.tokens) - seq.num_computed, budget)
            plan.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        if self.host is not None:
            self._plan_host_copies(plan)
        return plan

    def _plan_host_copies(self, plan: StepPlan) -> None:
        """Named blocks the pool gave new content this step go to host RAM
        first (unless it holds them already); loads admitted this step
        follow. Slots being loaded are not reused for this step's spills."""
        plan.loads, self._loads = self._loads, []
        plan.loading, self._loading = self._loading, []
        for block, name in self.kv.take_reclaimed():
            slot = self.host.store(name)
            if slot is not None:
                plan.spills.append((block, slot))
        self.host.end_step()

    def commit(self, plan: StepPlan) -> None:
        """Record a launched forward: each scheduled chunk's KV is (being)
        written, and sequences that sample have a token in flight until
        `deliver` hands it over."""
        set_num_tokens = self.kv.set_num_tokens
        for item in plan.scheduled:
            seq = item.seq
            if seq.status is not SeqStatus.RUNNING:
                continue  # cancelled while the step ran
            samples = item.samples
            seq.num_computed += item.num_new_tokens
            set_num_tokens(seq.kv_key, seq.num_computed)
            if samples:
                seq.inflight += 1
            self._name_blocks(seq)

    def loaded(self, seq: Sequence) -> None:
        """The host-tier blocks of `seq`'s admission are in the pool: name
        them (from now on other requests may take them) and let it run."""
        first, names = seq.loading
        seq.loading = None
        self.kv.commit_block_hashes(seq.kv_key, first, names)
        seq.named_blocks = first + len(names)

    def deliver(self, seq: Sequence, token: int) -> None:
        """The sampled token of `seq`'s step in flight."""
        seq.inflight -= 1
        seq.tokens.append(token)

    def finish(self, seq: Sequence, reason: str, keep_kv: bool) -> None:
        """Free the slot at once. A session's KV stays cached for its next turn;
        anything else is erased."""
        if seq.status is SeqStatus.WAITING:
            if seq in self.waiting:
                self.waiting.remove(seq)
            if self.kv.contains(seq.kv_key) and not keep_kv:
                self.kv.erase(seq.kv_key)
        elif seq.status is SeqStatus.RUNNING:
            seq.loading = None  # the engine orders its copies before the pool's next use
            self._leave_slot(seq)
            self._name_blocks(seq)
            if keep_kv:
                self.kv.release(seq.kv_key)
            else:
                self.kv.erase(seq.kv_key)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.slot = None

    # -- internals -------------------------------------------------------------
    def _last_token_in_flight(self, seq: Sequence) -> bool:
        """Its token in flight reaches max_tokens or the context limit, so it
        is the last whatever its value (the engine's length rule)."""
        return (seq.num_generated + seq.inflight >= seq.params.max_tokens
                or seq.num_tokens >= self.config.max_model_len)

    def _take_slot(self, seq: Sequence) -> None:
        seq.slot = self._free_slots.pop()
        self.slots[seq.slot] = seq
        seq.admit_order = next(self._admit_order)
        self._running[seq.admit_order] = seq
        seq.status = SeqStatus.RUNNING

    def _leave_slot(self, seq: Sequence) -> None:
        self.slots[seq.slot] = None
        self._free_slots.append(seq.slot)
        del self._running[seq.admit_order]
        seq.slot = None

    def _admission_target(self, seq: Sequence) -> int:
        """Tokens to hold blocks for at admission, by allocation policy."""
        cfg = self.config
        if cfg.alloc_policy is AllocPolicy.UPFRONT:
            want = seq.prompt_len + seq.params.max_tokens
        elif cfg.alloc_policy is AllocPolicy.RESERVED:
            want = len(seq.tokens) + cfg.reserved_tokens
        else:
            want = len(seq.tokens)
        return min(want, cfg.max_model_len, self.max_tokens_in_pool())

    def _admit(self, seq: Sequence) -> bool:
        kv, bs = self.kv, self.config.block_size
        existed = kv.contains(seq.kv_key)
        resident = kv.acquire(seq.kv_key)
        missed = resident == 0  # a session turn whose KV was not resident here
        on_gpu, in_host = 0, []
        if missed and self.config.prefix_caching:
            # Leading blocks the pool holds by name: from this session before
            # it was evicted, or from any request that began the same way;
            # then what host RAM holds of the chain, loaded into new blocks.
            # The last token is always computed, for its logits.
            hashes = self._hashes(seq, (len(seq.tokens) - 1) // bs)
            on_gpu = kv.attach_prefix(seq.kv_key, hashes)
            if self.host is not None:
                in_host = self.host.lookup_chain(hashes[on_gpu:])
            resident = (on_gpu + len(in_host)) * bs
        # Never trust more resident KV than this turn's tokens explain, and keep
        # at least one token to compute so there are logits to sample from.
        resident = min(resident, len(seq.tokens) - 1)
        if not kv.reserve(seq.kv_key, max(self._admission_target(seq), resident + 1)):
            self._unadmit_kv(seq, existed)
            return False
        kv.set_num_tokens(seq.kv_key, resident)
        if in_host:  # copied in beside the compute; named once they land
            blocks = kv.block_table(seq.kv_key)[on_gpu:on_gpu + len(in_host)]
            self._loads.extend(zip(in_host, blocks))
            names = seq.block_hashes[on_gpu:on_gpu + len(in_host)]
            self.host.take(names)
            seq.loading = (on_gpu, list(names))
            self._loading.append(seq)
        if seq.session_id is not None and seq.first_admitted is None:
            if seq.history_len > 0:
                if resident > 0:
                    self.cache_hits += 1
                else:
                    self.cache_misses += 1
                if missed:  # history the prefix cache did not hold is recomputed
                    seq.reprefilled_tokens = max(seq.history_len - resident, 0)
        if seq.first_admitted is None:
            seq.first_admitted = time.monotonic()
            seq.cached_tokens = resident
        seq.num_computed = resident
        # A resident session's full blocks were named when they were written.
        seq.named_blocks = on_gpu if in_host else resident // bs
        self._take_slot(seq)
        return True

    def _next_block_in(self, seq: Sequence, names: set[int]) -> bool:
        """Whether the first block `seq` would have to compute is one a request
        admitted this step computes (a system prompt shared by a burst of new
        conversations): it then waits a step and takes it by name."""
        kv = self.kv
        if kv.contains(seq.kv_key) and kv.num_tokens(seq.kv_key) > 0:
            return False  # resident: nothing to look up
        hashes = self._hashes(seq, (len(seq.tokens) - 1) // self.config.block_size)
        found = kv.match_prefix(hashes)
        return found < len(hashes) and hashes[found] in names

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Names of `seq`'s first `num_blocks` full blocks (cached on seq)."""
        if len(seq.block_hashes) < num_blocks:
            extend_block_hashes(seq.block_hashes, seq.tokens, self.config.block_size,
                                num_blocks, salted(self.config.hash_seed, seq.cache_salt))
        return seq.block_hashes[:num_blocks]

    def _name_blocks(self, seq: Sequence) -> None:
        """Name the blocks that are full, written and of known tokens (a
        sampled token in flight is known only once delivered)."""
        if not self.config.prefix_caching:
            return
        full = min(seq.num_computed, len(seq.tokens)) // self.config.block_size
        if full > seq.named_blocks:
            hashes = self._hashes(seq, full)
            self.kv.commit_block_hashes(seq.kv_key, seq.named_blocks, hashes[seq.named_blocks:])
            seq.named_blocks = full

    def _unadmit_kv(self, seq: Sequence, existed: bool) -> None:
        if existed and seq.session_id is not None:
            self.kv.release(seq.kv_key)
        else:
            self.kv.erase(seq.kv_key)

    def _reserve(self, seq: Sequence, num_tokens: int, plan: StepPlan) -> bool:
        """Blocks for `num_tokens` of `seq`; preempts the newest running
        sequences when even evicting every cached session is not enough.
        False if `seq` itself had to give way."""
        while not self.kv.reserve(seq.kv_key, num_tokens):
            victim = next(reversed(self._running.values()))  # the newest
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Drop a running sequence's KV and put it back at the head of the queue;
        it is re-prefilled from its token IDs when it is admitted again."""
        self.preemptions += 1
        plan.scheduled = [item for item in plan.scheduled if item.seq is not seq]
        plan.preempted.append(seq)
        seq.loading = None  # the engine orders its copies before the pool's next use
        self._leave_slot(seq)
        self._name_blocks(seq)
        self.kv.release(seq.kv_key)
        self.kv.evict(seq.kv_key)
        seq.num_computed = 0
        seq.named_blocks = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
