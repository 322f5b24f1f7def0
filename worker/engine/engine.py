"""The engine: a persistent batch over the paged LRU KV cache.

One step thread owns the scheduler, the KV manager and the model; other
threads talk to it through an inbox (submissions, cancels) and get tokens back
through per-request callbacks invoked at the end of every step."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import uuid
from pathlib import Path
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional, Sequence as Seq, Union

import numpy as np

from . import errors, ranks
from .block_hash import hash_seed
from .host_tier import HostTier
from .chat_template import ChatTemplate, ChatTemplateError
from .config import EngineConfig
from .output import TextStream
from .runner import LoadTicket, ModelRunner, SampledTokens, StepInputs
from .sampling_params import SamplingParams, SeedRNG
from .scheduler import AllocPolicy, Scheduler, SchedulerConfig, Sequence, SeqStatus, StepPlan
from .session_store import (InMemorySessionStore, SessionConflict, SessionFull, SessionHistory,
                            SessionModelMismatch, SessionStore, SessionStoreError,
                            TenantQuotaExceeded, TurnRecord)
from .tokenizer import Tokenizer
from ..model.files import has_model_file
from ..model.weights import load_checkpoint
from ..._native import KVCacheManager, SeqState

log = logging.getLogger("turbomq.engine")


@dataclass(frozen=True)
class _Messages:
    """A chat prompt, rendered by the model's template when tokenized."""
    messages: Seq[dict]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int  # session history + this turn's prompt
    cached_tokens: int  # of those, reused from resident KV
    completion_tokens: int


@dataclass
class StreamEvent:
    request_id: str
    token_ids: list[int]  # new since the last event
    text: str  # new text since the last event
    finished: bool = False
    finish_reason: Optional[str] = None  # stop | length | cancelled | error
    usage: Optional[Usage] = None
    error: Optional[errors.EngineError] = None


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: Optional[str]
    usage: Optional[Usage]
    error: Optional[errors.EngineError] = None


Callback = Callable[[StreamEvent], None]


@dataclass
class _EndSession:
    session_id: str
    had_kv: bool = False
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class _Launched:
    """A step on the device whose sampled tokens the host has not read."""
    plan: StepPlan
    seqs: list[Sequence]  # the rows that sample, in order
    tokens: SampledTokens  # theirs
    graphed: bool  # a decode graph step, whose successor may launch before it is read


@dataclass(eq=False)
class _Request:
    seq: Sequence
    text: TextStream
    rng: SeedRNG
    callback: Callback
    turn_id: str = ""  # a session turn's name across re-sends (session_store.TurnRecord)
    cancelled: bool = False
    emitted_tokens: int = 0
    submitted: float = field(default_factory=time.monotonic)


class Engine:
    def __init__(self, config: EngineConfig, session_store: Optional[SessionStore] = None,
                 model=None):
        """`model` injects an already built LlamaModel (benchmarks with random
        weights); otherwise it is loaded from `config.model`."""
        self.config = config
        if config.tensor_parallel < 1:
            raise ValueError("tensor_parallel must be >= 1")
        if config.deterministic and config.tensor_parallel > 1:
            raise ValueError("deterministic mode runs on one device: the all-reduce of tensor "
                             "parallelism does not promise a fixed summation order")
        if model is not None and (model.deterministic, model.quantization) != (
                config.deterministic, config.quantization):
            raise ValueError(f"the injected model was built with deterministic="
                             f"{model.deterministic}, quantization={model.quantization}; the "
                             f"config asks for {config.deterministic}, {config.quantization}")
        self.ranks: Optional[ranks.Ranks] = None
        checkpoint = None
        if model is None:
            checkpoint = load_checkpoint(config.model)
            if config.tensor_parallel > 1:
                self.ranks = ranks.start(config, checkpoint.config)
        elif config.tensor_parallel > 1:
            raise ValueError("tensor_parallel > 1 loads its model from config.model")
        self.runner = ModelRunner(config, tp=self.ranks.tp if self.ranks else None,
                                  checkpoint=checkpoint, model=model)
        del checkpoint
        self.model_config = self.runner.model.config
        # A model without tokenizer.json still serves token IDs (no text).
        self.tokenizer = (Tokenizer.from_dir(config.model)
                          if has_model_file(config.model, "tokenizer.json") else None)
        self.chat_template = (ChatTemplate.from_dir(config.model)
                              if self.tokenizer is not None else None)
        self.eos_ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            self.eos_ids |= set(self.tokenizer.eos_token_ids)
        # The texts of the end-of-turn tokens, for rendering later chat turns.
        self._end_of_turn = ([self.tokenizer.decode([t], skip_special_tokens=False)
                              for t in sorted(self.eos_ids)] if self.tokenizer else [])
        self.max_model_len = self.runner.max_model_len
        num_blocks = self.runner.kv_blocks_that_fit()
        if self.ranks is not None:
            self.ranks.send_pool(num_blocks)
        self.runner.allocate_kv(num_blocks)
        self.kv_manager = KVCacheManager(num_blocks, config.block_size)
        self.host_tier = self._host_tier()
        self.scheduler = Scheduler(SchedulerConfig(
            max_batch_size=config.max_batch_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, block_size=config.block_size,
            alloc_policy=AllocPolicy(config.alloc_policy),
            reserved_tokens=config.reserved_tokens, prefix_caching=config.prefix_caching,
            hash_seed=hash_seed(Path(config.model).name, repr(self.model_config),
                                str(self.runner.model.dtype), str(self.runner.kv_dtype))),
            self.kv_manager, self.host_tier)
        self.session_store: SessionStore = session_store or InMemorySessionStore()

        self._inbox: "queue.SimpleQueue[tuple[str, object]]" = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _live and _busy_sessions
        self._live: dict[str, _Request] = {}
        self._busy_sessions: set[str] = set()
        self._session_keys: dict[str, int] = {}
        self._session_kv_tokens: dict[str, list[int]] = {}  # tokens whose KV is resident
        self._keys = itertools.count(1)
        self._wakeup = threading.Event()
        self._launched: Optional[_Launched] = None
        # Host-tier loads in flight, oldest first: (ticket, their sequences).
        self._loading: list[tuple[LoadTicket, list[Sequence]]] = []
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        # Called on the step thread after every step that did something, with
        # (plan or None, seconds): the one safe place to read engine state for
        # metrics and heartbeats. plan is None when no step was launched (the
        # inbox drained, or the last step's tokens read).
        self.step_observer: Optional[Callable[[Optional[StepPlan], float], None]] = None
        self.counters = {"requests_finished": 0, "prompt_tokens": 0, "generated_tokens": 0,
                         "reused_tokens": 0, "reprefilled_tokens": 0, "steps": 0,
                         "overlapped_steps": 0, "requests_replayed": 0, "host_tier_bytes": 0,
                         # time the step thread spent blocked on the device
                         # for launched steps' tokens: near 0, the host sets the pace
                         "token_wait_seconds": 0.0}

    def _host_tier(self) -> Optional[HostTier]:
        """The host-RAM tier, where configured (single-device engines)."""
        blocks = self.config.host_kv_blocks
        if blocks is None:
            blocks = self.runner.host_kv_blocks_default()
        if blocks <= 0 or not self.config.prefix_caching:
            return None
        if self.ranks is not None:
            log.warning("the host-RAM KV tier is not used with tensor parallelism yet")
            return None
        self.runner.allocate_host_kv(blocks)
        return HostTier(blocks)

    @property
    def max_tokens_in_pool(self) -> int:
        return self.kv_manager.num_blocks * self.config.block_size

    # ------------------------------------------------------------ public API
    def submit(self, input_ids: Optional[Seq[int]] = None, params: Optional[SamplingParams] = None,
               session_id: Optional[str] = None, callback: Optional[Callback] = None,
               prompt: Optional[str] = None, request_id: Optional[str] = None,
               resume_tokens: Seq[int] = (), turn_id: Optional[str] = None,
               messages: Optional[Seq[dict]] = None, cache_salt: str = "") -> str:
        """Queue one request; tokens reach `callback` from the step thread.
        `resume_tokens` continues a generation that another worker started:
        those tokens count as already generated and delivered (they are not
        streamed again) and the seeded sampler skips their draws. `turn_id`
        names a session turn however often it is sent (default: request_id):
        a turn the session has committed already is answered from the store.
        `messages` ([{"role", "content"}, ...]) is rendered with the model's
        chat template; in a session with history, only these new messages.
        `cache_salt` (the tenant) keeps cached prefix blocks apart: requests
        reuse only blocks written under the same salt.
        Raises a typed EngineError for bad input; nothing is queued then."""
        params = params or SamplingParams()
        params.validate(self.model_config.vocab_size)
        if sum(x is not None for x in (input_ids, prompt, messages)) != 1:
            raise errors.InvalidRequest("give exactly one of prompt, input_ids or messages")
        if messages is not None:
            if self.chat_template is None:
                raise errors.InvalidRequest("this model has no chat template: send a prompt")
            prompt = _Messages(messages)
        if params.stop and self.tokenizer is None:
            raise errors.InvalidRequest("stop strings need a model with a tokenizer")
        if prompt is not None:
            if self.tokenizer is None:
                raise errors.InvalidRequest("this model has no tokenizer: send input_ids")
            if not isinstance(prompt, (str, _Messages)):
                raise errors.InvalidRequest("prompt must be a string")
        if session_id is not None and not isinstance(session_id, str):
            raise errors.InvalidRequest("session_id must be a string")
        resume = self._check_ids(resume_tokens, allow_empty=True)
        if len(resume) >= params.max_tokens:
            raise errors.InvalidRequest(
                f"{len(resume)} resumed tokens already reach max_tokens={params.max_tokens}")
        request_id = request_id or uuid.uuid4().hex
        if session_id is not None:
            with self._lock:
                if session_id in self._busy_sessions:
                    raise errors.SessionBusy(f"session {session_id!r} already has a request in flight")
                self._busy_sessions.add(session_id)
        try:
            return self._queue(request_id, turn_id or request_id, session_id, prompt, input_ids,
                               resume, params, callback, cache_salt)
        except BaseException:  # nothing queued: the session is free again
            if session_id is not None:
                self._release_session(session_id)
            raise

    def _release_session(self, session_id: str) -> None:
        with self._lock:
            self._busy_sessions.discard(session_id)

    def _queue(self, request_id: str, turn_id: str, session_id: Optional[str], prompt,
               input_ids, resume: list[int], params: SamplingParams,
               callback: Optional[Callback], cache_salt: str = "") -> str:
        """The rest of submit, with the session (if any) claimed."""
        history: list[int] = []
        if session_id is not None:
            record = self._read_session(session_id)
            if record is not None and self._is_committed(record, turn_id, prompt, input_ids):
                return self._replay(record, request_id, session_id, resume, params, callback)
            history = record.tokens if record is not None else []
            new_prompt = self._prompt_ids(prompt, input_ids, add_bos=not history)
        else:
            new_prompt = self._prompt_ids(prompt, input_ids, add_bos=True)
        tokens = history + new_prompt + resume
        limit = min(self.max_model_len, self.max_tokens_in_pool)
        if len(tokens) >= limit:
            raise errors.PromptTooLong(
                f"prompt of {len(new_prompt)} tokens plus {len(history)} session tokens leaves no "
                f"room to generate within the context limit of {limit} tokens")
        prompt_len = len(history) + len(new_prompt)
        seq = Sequence(request_id=request_id, kv_key=0, session_id=session_id, tokens=tokens,
                       prompt_len=prompt_len, params=params, history_len=len(history),
                       cache_salt=cache_salt)
        text = TextStream(self.tokenizer, tokens[max(prompt_len - 8, 0):prompt_len], params.stop)
        for token in resume:  # already delivered: only advance the detokenizer
            text.push(token)
        req = _Request(seq=seq, text=text,
                       rng=SeedRNG(params.seed).advance(0 if params.is_greedy else len(resume)),
                       callback=callback or (lambda _e: None), turn_id=turn_id,
                       emitted_tokens=len(resume))
        with self._lock:
            if request_id in self._live:
                raise errors.InvalidRequest(f"request id {request_id!r} is already in use")
            self._live[request_id] = req
        self._inbox.put(("submit", req))
        self._wakeup.set()
        return request_id

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id not in self._live:
                raise errors.UnknownRequest(f"no request {request_id!r} in flight (finished or never submitted)")
        self._inbox.put(("cancel", request_id))
        self._wakeup.set()

    def end_session(self, session_id: str) -> None:
        """Forget a session: its KV blocks and its stored token IDs."""
        with self._lock:
            if session_id in self._busy_sessions:
                raise errors.SessionBusy(f"session {session_id!r} has a request in flight")
        try:
            in_store = self.session_store.drop(session_id)
        except SessionStoreError as e:
            raise errors.SessionStoreUnavailable(str(e)) from e
        ending = self._on_step_thread("end_session", session_id)
        if not (in_store or ending.had_kv):
            raise errors.UnknownSession(f"no session {session_id!r}")

    def _on_step_thread(self, kind: str, session_id: str) -> _EndSession:
        """Have the step thread (or this one, without it) end or evict a
        session's KV; returns when it is done."""
        ending = _EndSession(session_id)
        self._inbox.put((kind, ending))
        self._wakeup.set()
        if self._thread is None:
            self._drain_inbox()
        ending.done.wait()
        return ending

    def evict_session(self, session_id: str) -> None:
        """Drop a cached session's KV (its token IDs stay in the store): its
        next turn is a miss and re-prefills. For forced moves and tests."""
        ending = self._on_step_thread("evict_session", session_id)
        if not ending.had_kv:
            raise errors.UnknownSession(f"session {session_id!r} has no cached KV here")

    def generate(self, prompts: Optional[Union[str, Seq[str]]] = None,
                 input_ids: Optional[Seq[Seq[int]]] = None,
                 params: Optional[SamplingParams] = None,
                 session_id: Optional[str] = None,
                 messages: Optional[Seq[Seq[dict]]] = None) -> list[GenerationResult]:
        """Offline batch generation; one result per input, in order. `messages`
        holds one conversation ([{"role", "content"}, ...]) per input."""
        given = {"prompt": prompts, "input_ids": input_ids, "messages": messages}
        given = {k: v for k, v in given.items() if v is not None}
        if len(given) != 1:
            raise errors.InvalidRequest("give exactly one of prompts, input_ids or messages")
        (kind, inputs), = given.items()
        inputs = [inputs] if isinstance(inputs, str) else list(inputs)
        if session_id is not None and len(inputs) != 1:
            raise errors.InvalidRequest("a session takes one input per call")
        results: dict[str, GenerationResult] = {}
        done = threading.Event()
        ids: list[str] = []

        def collect(event: StreamEvent) -> None:
            r = results[event.request_id]
            r.token_ids.extend(event.token_ids)
            r.text += event.text
            if event.finished:
                r.finish_reason, r.usage, r.error = event.finish_reason, event.usage, event.error
                if all(results[i].finish_reason is not None for i in ids):
                    done.set()

        for item in inputs:
            rid = uuid.uuid4().hex
            results[rid] = GenerationResult(rid, [], "", None, None)
            ids.append(rid)
            try:
                self.submit(params=params, session_id=session_id, callback=collect,
                            request_id=rid, **{kind: item})
            except Exception:
                # all or nothing: withdraw what this call already queued
                ids.pop()
                for submitted in ids:
                    self.cancel(submitted)
                self._wait(done, ids, results)
                raise
        self._wait(done, ids, results)
        return [results[i] for i in ids]

    async def stream(self, input_ids: Optional[Seq[int]] = None,
                     params: Optional[SamplingParams] = None, session_id: Optional[str] = None,
                     prompt: Optional[str] = None) -> AsyncIterator[StreamEvent]:
        """Async streaming form: yields an event per step until the request finishes.
        Runs the step loop in its background thread."""
        self.start()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[StreamEvent] = asyncio.Queue()
        rid = self.submit(input_ids=input_ids, params=params, session_id=session_id, prompt=prompt,
                          callback=lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
        try:
            while True:
                event = await events.get()
                yield event
                if event.finished:
                    return
        finally:
            with self._lock:
                live = rid in self._live
            if live:
                self.cancel(rid)

    def stats(self) -> dict:
        kv = self.kv_manager.stats()
        return {
            "evictions": kv["evictions"],
            "evicted_tokens": kv["evicted_tokens"],
            "cache_hits": self.scheduler.cache_hits,
            "cache_misses": self.scheduler.cache_misses,
            "preemptions": self.scheduler.preemptions,
            "slots_total": self.config.max_batch_size,
            "slots_active": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_blocks_total": self.kv_manager.num_blocks,
            "kv_tokens_capacity": self.max_tokens_in_pool,
            "kv_blocks_used": self.kv_manager.num_used_blocks,
            "sessions_active": kv["active_sequences"], "sessions_cached": kv["cached_sequences"],
            "sessions_evicted": kv["evicted_sequences"],
            "prefix_cache_queries": kv["prefix_queries"],
            "prefix_cache_hit_blocks": kv["prefix_hit_blocks"],
            "prefix_cache_blocks": kv["cached_blocks"],
            "prefix_cache_free_blocks": kv["cached_free_blocks"],
            "prefix_cache_evictions": kv["cached_block_evictions"],
            **(self.host_tier.stats() if self.host_tier else HostTier(0).stats()),
            **self.counters,
        }

    # ------------------------------------------------------- step thread
    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="turbomq-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stopping = True
            self._wakeup.set()
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stop, end the other tensor-parallel ranks and give back every tensor
        (weights, KV pool, graphs): the engine is done. Also `with Engine(...)`."""
        self.stop()
        if self.ranks is not None:
            self.runner.release_graphs()
            self.ranks.close()
            self.ranks = None
        self.runner.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _loop(self) -> None:
        while not self._stopping:
            if not self.step():
                self._wakeup.wait(0.05)
                self._wakeup.clear()

    def _wait(self, done: threading.Event, ids: list[str], results: dict) -> None:
        if not ids:
            return
        if self._thread is not None:
            done.wait()
            return
        while not done.is_set():
            self.step()

    def has_work(self) -> bool:
        return (not self._inbox.empty() or self.scheduler.has_work()
                or self._launched is not None or bool(self._loading))

    def step(self) -> bool:
        """Run one step; False when there was nothing to do.

        A step is left running: the next call schedules and launches its
        successor first (a decode row takes its input token on the device,
        on every rank) and only then reads the tokens and streams them out.
        A repetition penalty (it needs the token history) or
        overlap_steps=False reads the previous step's tokens first."""
        drained = self._drain_inbox()
        self._land_loads()
        prev = self._launched
        if prev is not None and not self.config.overlap_steps:
            self._settle()
            prev = None
        if not self.scheduler.has_work():
            settled = self._launched is not None
            self._settle()  # the last step's tokens (or one whose sequences were all cancelled)
            if drained or settled:  # what they finished shows in the stats at once
                self._observe(None, 0.0)
            return False
        plan = self.scheduler.schedule()
        self._order_dropped_loads()
        if plan.spills or plan.loads:  # before anything reads or reuses those blocks
            moved, ticket = self.runner.move_blocks(plan.spills, plan.loads)
            self.counters["host_tier_bytes"] += moved
            if plan.loading:
                self._loading.append((ticket, plan.loading))
        if prev is not None and not self._runs_ahead(plan):
            self._settle()  # may finish sequences the plan holds
            prev = None
            plan.scheduled = [i for i in plan.scheduled if i.seq.status is SeqStatus.RUNNING]
        if plan.empty:
            if prev is not None:
                self._settle()
                self._observe(None, 0.0)  # what it finished shows in the stats at once
            elif self._loading and not self._inbox.qsize():
                self._loading[0][0].wait()  # nothing to run until a load lands
            return True
        start = time.perf_counter()
        if prev is not None:
            self.counters["overlapped_steps"] += 1
        try:
            self._launched = self._launch(plan, prev)
        except Exception as exc:  # a failed forward fails its requests, not the engine
            self._launched = None
            self._fail_plan(plan, exc)
        else:
            self.scheduler.commit(plan)
        if prev is not None:
            self._deliver(prev)
        if (self._launched is not None and not self._launched.graphed
                and not self.config.overlap_steps):
            self._settle()
        self.counters["steps"] += 1
        self._observe(plan, time.perf_counter() - start)
        return True

    def _land_loads(self) -> None:
        """Sequences whose host-tier blocks are in the pool join the batch
        (copies land in the order they were issued)."""
        while self._loading and self._loading[0][0].done():
            ticket, seqs = self._loading.pop(0)
            ticket.order()
            for seq in seqs:
                if seq.loading is not None:
                    self.scheduler.loaded(seq)

    def _order_dropped_loads(self) -> None:
        """A sequence that left while its blocks were loading (cancelled,
        preempted) gave those blocks back: the compute stream waits for the
        copies before anything may reuse them."""
        for ticket, seqs in self._loading:
            if any(seq.loading is None for seq in seqs):
                ticket.order()

    def _runs_ahead(self, plan: StepPlan) -> bool:
        """Whether `plan` may launch before the previous step's tokens are
        read: one whose sampling needs no token history (a decode row reads
        its input token on the device, whether a graph or the eager forward
        runs the step)."""
        return self.config.overlap_steps and all(i.seq.params.repetition_penalty == 1.0
                                        for i in plan.scheduled)

    def _graphed(self, plan: StepPlan) -> bool:
        """A decode-only step (one sampled token per sequence) that a captured
        graph runs."""
        items = plan.scheduled
        return (bool(items) and all(i.num_new_tokens == 1 and i.samples for i in items)
                and self.runner.graphable(len(items), max(i.seq.num_computed + 1 for i in items)))

    def _settle(self) -> None:
        launched, self._launched = self._launched, None
        if launched is not None:
            self._deliver(launched)

    def _fail_plan(self, plan: StepPlan, exc: Exception) -> None:
        log.exception("step failed")
        for item in plan.scheduled:
            req = self._live.get(item.seq.request_id)
            if req is not None and item.seq.status is not SeqStatus.FINISHED:
                self._finish(req, "error", keep_kv=False,
                             error=errors.EngineError(f"step failed: {exc}"))

    def _observe(self, plan: Optional[StepPlan], seconds: float) -> None:
        if self.step_observer is not None:
            try:
                self.step_observer(plan, seconds)
            except Exception:  # a metrics bug must not stop the batch
                log.exception("step observer failed")

    def resident_sessions(self) -> set[str]:
        """Sessions whose KV is resident (active or cached). Step thread only
        (e.g. from step_observer): it reads the KV manager."""
        kv = self.kv_manager
        return {sid for sid, key in self._session_keys.items()
                if kv.contains(key) and kv.state(key) != SeqState.EVICTED}

    def _launch(self, plan: StepPlan, prev: Optional[_Launched]) -> _Launched:
        """Queue the step's forward and sampling on the device. A sequence whose
        input token is still in flight (in `prev`) reads it on the device."""
        bs = self.config.block_size
        q_lens, ctx_lens, ids, keys = [], [], [], []
        prev_rows: Optional[list[int]] = None
        in_prev = {id(s): r for r, s in enumerate(prev.seqs)} if prev is not None else {}
        for item in plan.scheduled:
            seq = item.seq
            start = seq.num_computed
            known = seq.tokens[start:start + item.num_new_tokens]
            if len(known) < item.num_new_tokens:  # decode of the token in flight
                if prev_rows is None:
                    prev_rows = [-1] * len(keys)
                prev_rows.append(in_prev[id(seq)])
                known = [0]
            elif prev_rows is not None:
                prev_rows.append(-1)
            ids.extend(known)
            q_lens.append(item.num_new_tokens)
            ctx_lens.append(start + item.num_new_tokens)
            keys.append(seq.kv_key)
        width = (max(ctx_lens) + bs - 1) // bs
        rows = [i for i, item in enumerate(plan.scheduled) if item.samples]
        seqs = [plan.scheduled[i].seq for i in rows]
        params = [s.params for s in seqs]
        step = StepInputs(ids, q_lens, ctx_lens, self.kv_manager.block_tables(keys, width),
                          self._graphed(plan), prev_rows, len(rows),
                          self.runner.greedy_step(params))
        if self.ranks is not None:  # the other ranks run this forward with us
            self.ranks.send_step(step)
        reqs = [self._live[s.request_id] for s in seqs]
        tokens = self.runner.launch(step, rows, params, [r.rng for r in reqs],
                                    [s.tokens for s in seqs])
        return _Launched(plan, seqs, tokens, step.graphed)

    def _deliver(self, launched: _Launched) -> None:
        """Read a launched step's tokens and stream them out; a sequence
        finished meanwhile (stopped, cancelled) drops its token."""
        start = time.perf_counter()
        try:
            tokens = launched.tokens.read()
        except Exception as exc:
            self._fail_plan(launched.plan, exc)
            return
        finally:
            self.counters["token_wait_seconds"] += time.perf_counter() - start
        for seq, token in zip(launched.seqs, tokens):
            if seq.status is SeqStatus.FINISHED:
                continue
            self.scheduler.deliver(seq, token)
            self._on_token(self._live[seq.request_id], token)

    def _on_token(self, req: _Request, token: int) -> None:
        seq, params = req.seq, req.seq.params
        delta, hit_stop = req.text.push(token)
        reason = None
        if hit_stop or token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos):
            reason = "stop"
        elif seq.num_generated >= params.max_tokens or len(seq.tokens) >= self.max_model_len:
            reason = "length"
        if reason is None:
            self._emit(req, delta)
            return
        if not hit_stop:
            delta += req.text.finish()
        self._finish(req, reason, keep_kv=seq.session_id is not None, delta=delta)

    def _emit(self, req: _Request, delta: str, **final) -> None:
        new = req.seq.generated[req.emitted_tokens:]
        req.emitted_tokens += len(new)
        event = StreamEvent(req.seq.request_id, new, delta, **final)
        try:
            req.callback(event)
        except Exception:  # a consumer's bug must not stop the batch
            log.exception("stream callback failed for %s", req.seq.request_id)

    def _finish(self, req: _Request, reason: str, keep_kv: bool, delta: str = "",
                error: Optional[errors.EngineError] = None) -> None:
        seq = req.seq
        session = seq.session_id
        if session is not None and error is None and reason != "cancelled":
            # The turn is durable before its final event reaches anyone. A
            # turn committed already (sent again after a lost broker; another
            # worker finished it) stands as stored.
            turn = TurnRecord(req.turn_id, seq.history_len, seq.prompt_len - seq.history_len, reason)
            try:
                self.session_store.append_turn(session, seq.tokens[seq.history_len:], turn)
            except TenantQuotaExceeded as e:
                error, reason, keep_kv = errors.RateLimited(str(e)), "error", False
            except SessionFull as e:
                error, reason, keep_kv = errors.PromptTooLong(str(e)), "error", False
            except SessionConflict as e:
                error, reason, keep_kv = errors.SessionBusy(f"session {session!r} moved on: {e}"), \
                    "error", False
            except SessionStoreError as e:
                error, reason, keep_kv = errors.SessionStoreUnavailable(str(e)), "error", False
        if session is not None:
            if keep_kv and error is None and reason != "cancelled":
                self._session_kv_tokens[session] = seq.tokens[:seq.num_computed]
            else:
                self._forget_session_kv(session, seq)
                keep_kv = False
        self.scheduler.finish(seq, reason, keep_kv=keep_kv)
        self.counters["requests_finished"] += 1
        self.counters["prompt_tokens"] += seq.prompt_len
        self.counters["generated_tokens"] += seq.num_generated
        self.counters["reprefilled_tokens"] += seq.reprefilled_tokens
        self.counters["reused_tokens"] += seq.cached_tokens
        usage = Usage(seq.prompt_len, seq.cached_tokens, seq.num_generated)
        with self._lock:
            self._live.pop(seq.request_id, None)
            if session is not None:
                self._busy_sessions.discard(session)
        self._emit(req, delta, finished=True, finish_reason=reason, usage=usage, error=error)

    def _forget_session_kv(self, session: str, seq: Sequence) -> None:
        self._session_kv_tokens.pop(session, None)
        key = self._session_keys.pop(session, None)
        if key is not None and key != seq.kv_key and self.kv_manager.contains(key):
            self.kv_manager.erase(key)

    # ----------------------------------------------------------- inbox
    def _drain_inbox(self) -> bool:
        """Handle queued submissions and commands; True if there were any."""
        drained = False
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return drained
            drained = True
            if kind == "submit":
                self._admit_request(payload)
            elif kind == "replay":
                session_id, callback, event = payload
                self._release_session(session_id)
                self.counters["requests_replayed"] += 1
                try:
                    callback(event)
                except Exception:  # a consumer's bug must not stop the batch
                    log.exception("stream callback failed for %s", event.request_id)
            elif kind == "cancel":
                req = self._live.get(payload)
                if req is not None and req.seq.status is not SeqStatus.FINISHED:
                    self._finish(req, "cancelled", keep_kv=False)
            elif kind == "evict_session":
                key = self._session_keys.get(payload.session_id)
                payload.had_kv = (key is not None and self.kv_manager.contains(key) and
                                  self.kv_manager.state(key) == SeqState.CACHED)
                if payload.had_kv:
                    self.kv_manager.evict(key)
                payload.done.set()
            elif kind == "end_session":
                key = self._session_keys.pop(payload.session_id, None)
                self._session_kv_tokens.pop(payload.session_id, None)
                payload.had_kv = key is not None
                if key is not None and self.kv_manager.contains(key):
                    self.kv_manager.erase(key)
                payload.done.set()

    def _admit_request(self, req: _Request) -> None:
        seq = req.seq
        sid = seq.session_id
        if sid is None:
            seq.kv_key = next(self._keys)
        else:
            key = self._session_keys.get(sid)
            resident = self._session_kv_tokens.get(sid)
            history = seq.tokens[:seq.history_len]
            if key is not None and (resident is None or history[:len(resident)] != resident):
                # The session moved on elsewhere (or was rebuilt): our KV is stale.
                if self.kv_manager.contains(key):
                    self.kv_manager.erase(key)
                key = None
            if key is None:
                key = next(self._keys)
                self._session_keys[sid] = key
            seq.kv_key = key
        self.scheduler.add(seq)

    # ----------------------------------------------------------- helpers
    def _read_session(self, session_id: str) -> Optional[SessionHistory]:
        try:
            return self.session_store.get_session(session_id)
        except SessionModelMismatch as e:
            raise errors.InvalidRequest(str(e)) from e
        except SessionStoreError as e:
            raise errors.SessionStoreUnavailable(str(e)) from e

    def _prompt_ids(self, prompt, input_ids: object, add_bos: bool) -> list[int]:
        """The prompt's token ids. `add_bos` says the prompt opens its
        sequence (no session history): a text gets BOS, messages render as a
        whole conversation rather than a continuation."""
        if isinstance(prompt, _Messages):
            try:
                text = (self.chat_template.render(prompt.messages) if add_bos
                        else self.chat_template.render_continuation(prompt.messages,
                                                                    self._end_of_turn))
            except ChatTemplateError as e:
                raise errors.InvalidRequest(str(e)) from None
            input_ids = self.tokenizer.encode(text, add_bos=False)  # the template writes BOS
        elif prompt is not None:
            input_ids = self.tokenizer.encode(prompt, add_bos=add_bos)
        return self._check_ids(input_ids)

    def _is_committed(self, record: SessionHistory, turn_id: str, prompt: Optional[str],
                      input_ids: object) -> bool:
        """Whether this turn is the session's last committed one: the same id
        and the same prompt tokens."""
        turn = record.last_turn
        if turn is None or turn.turn_id != turn_id:
            return False
        ids = self._prompt_ids(prompt, input_ids, add_bos=turn.start == 0)
        return record.tokens[turn.start:turn.start + turn.prompt_len] == ids

    def _replay(self, record: SessionHistory, request_id: str, session_id: str,
                resume: list[int], params: SamplingParams, callback: Optional[Callback]) -> str:
        """Answer a committed turn from the store: its output after what the
        client already has, as one final event from the step thread."""
        turn = record.last_turn
        start = turn.start + turn.prompt_len
        output = record.tokens[start:]
        if output[:len(resume)] != resume:
            raise errors.InvalidRequest("resume_tokens do not match the committed turn")
        text = ""
        if self.tokenizer is not None:
            whole = self.tokenizer.decode(output, skip_special_tokens=params.skip_special_tokens)
            text = whole[len(self.tokenizer.decode(resume, skip_special_tokens=params.skip_special_tokens)):]
        event = StreamEvent(request_id, output[len(resume):], text, finished=True,
                            finish_reason=turn.finish_reason,
                            usage=Usage(start, 0, len(output)))
        self._inbox.put(("replay", (session_id, callback or (lambda _e: None), event)))
        self._wakeup.set()
        return request_id

    def _check_ids(self, input_ids: object, allow_empty: bool = False) -> list[int]:
        if isinstance(input_ids, (str, bytes)) or not hasattr(input_ids, "__iter__"):
            raise errors.InvalidRequest("input_ids must be a list of integers")
        ids = list(input_ids)
        if not ids and not allow_empty:
            raise errors.InvalidRequest("prompt is empty")
        vocab = self.model_config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise errors.InvalidRequest(f"input_ids must be integers, got {type(t).__name__}")
            if not 0 <= t < vocab:
                raise errors.InvalidRequest(f"token id {t} outside the vocabulary [0, {vocab})")
        return [int(t) for t in ids]
