"""Running a workload against a backend: arrivals (Poisson at a request
rate, gamma with burstiness, or all at once), a cap on requests in flight,
conversations with think time sent as sessions or as full-history resends,
and a progress bar."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from typing import Optional, Sequence

from .backends import RequestResult
from .workloads import Conversation

MODES = ("session", "resend")


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Offsets (s) of `n` arrivals: gaps drawn from a gamma distribution of
    mean 1/rate and shape `burstiness` (1: Poisson), as vLLM draws them;
    rate inf: all at 0."""
    if rate == float("inf"):
        return [0.0] * n
    theta = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out


async def run_workload(backend, conversations: Sequence[Conversation], *, request_rate: float,
                       max_concurrency: Optional[int], seed: int, burstiness: float = 1.0,
                       mode: Optional[str] = None, chat: bool = False,
                       sampling: Optional[dict] = None, progress: bool = True
                       ) -> tuple[list[RequestResult], float, float]:
    """Send every turn of every conversation; returns (results, duration s,
    start time). Single-turn conversations send a prompt (`chat`: one user
    message); multi-turn ones send chat messages, as a session (`mode`
    "session": each turn's new message, or the whole history to an OpenAI
    server, with a session id) or as full-history resends."""
    sampling = dict(sampling or {})
    rng = random.Random(seed)
    offsets = arrival_times(len(conversations), request_rate, burstiness, rng)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    total = sum(len(c.turns) for c in conversations)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="req", dynamic_ncols=True, leave=False)
    results: list[RequestResult] = []
    run_id = uuid.uuid4().hex[:8]
    multi = any(len(c.turns) > 1 for c in conversations)
    start = time.monotonic()

    async def converse(conv: Conversation, offset: float) -> None:
        await asyncio.sleep(max(start + offset - time.monotonic(), 0.0))
        history: list[dict] = [{"role": "system", "content": conv.system}] if conv.system else []
        session = f"bench-{run_id}-{conv.id}" if multi and mode == "session" else None
        for i, turn in enumerate(conv.turns):
            if i and conv.think_times[i] > 0:
                await asyncio.sleep(conv.think_times[i])
            history.append({"role": "user", "content": turn.text})
            if multi:
                if session is not None and backend.name == "turbomq" and i:
                    prompt, messages = None, [history[-1]]  # the session holds the rest
                else:
                    prompt, messages = None, list(history)
            elif chat:
                prompt, messages = None, [history[-1]]
            else:
                prompt, messages = turn.text, None
            if limit is not None:
                await limit.acquire()
            try:
                result = RequestResult(conv.id, i, time.monotonic())
                await backend.send(result, prompt=prompt, messages=messages, session_id=session,
                                   max_tokens=turn.output_len, sampling=sampling)
            finally:
                if limit is not None:
                    limit.release()
            results.append(result)
            if bar is not None:
                bar.update(1)
            if not result.success:
                break  # a conversation cannot go on without its reply
            history.append({"role": "assistant", "content": result.text})
        if session is not None:
            await backend.end_session(session)

    try:
        await asyncio.gather(*(converse(c, o) for c, o in zip(conversations, offsets)))
    finally:
        if bar is not None:
            bar.close()
    end = max((r.start + r.latency for r in results if r.success), default=time.monotonic())
    return results, max(end - start, 1e-9), start
