"""The asyncio client. One AsyncClient per event loop: a reader task sorts
replies into per-request queues, so many requests may run concurrently."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Awaitable, Optional, Sequence, Union

import zmq
import zmq.asyncio

from . import protocol as P
from .common import (connect_dealer, decode_reply, encode_checked, generate_message, new_id,
                     PromptLike, reply_error, sampling_params, to_event, to_result)
from .errors import ServerError, Timeout, TurbomqError
from .keys import CurveClient
from .resume import DEADLINE_GRACE_S, BrokerWatch, InFlight
from .types import Delta, Final, Result

_PING = P.pack(P.ping())
_TIMED_OUT = object()


async def _get_until(q: asyncio.Queue, deadline: float) -> Any:
    """The queue's next item, or _TIMED_OUT at `deadline`. Unlike
    asyncio.wait_for before Python 3.12, a cancellation that races the
    item's arrival is never swallowed: the caller is cancelled, always (a
    swallowed cancel kept the gateway's health task, and so the gateway,
    alive after SIGTERM)."""
    getter = asyncio.ensure_future(q.get())
    try:
        await asyncio.wait((getter,), timeout=max(deadline - time.monotonic(), 0.0))
    finally:
        if not getter.done():
            getter.cancel()
    return getter.result() if getter.done() and not getter.cancelled() else _TIMED_OUT


class AsyncClient:
    """    async with AsyncClient("tcp://127.0.0.1:5555") as c:
            result = await c.generate("Hello", max_tokens=8)
            async for event in c.generate("Hello", stream=True):
                ...

    Like Client, a generate outlives its broker (clients/resume.py): given
    several addresses, the client fails over between them.
    """

    def __init__(self, address: Union[str, Sequence[str]] = "tcp://127.0.0.1:5555", *,
                 timeout: float = 60.0, ping_interval: float = 0.5, liveness: int = 3,
                 limits: P.Limits = P.DEFAULT_LIMITS,
                 context: Optional[zmq.asyncio.Context] = None,
                 curve: Optional[CurveClient] = None):
        self.watch = BrokerWatch([address] if isinstance(address, str) else address,
                                 ping_interval, liveness)
        self.timeout = timeout
        self.ping_interval = ping_interval
        self.limits = limits
        self.curve = curve  # CurveZMQ keys: encrypted, authenticated links (docs/security.md)
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock = self._connect(self.watch.endpoint)
        self._queues: dict[str, asyncio.Queue] = {}
        self._inflight: dict[str, InFlight] = {}  # open generates, to send again
        self._reader: Optional[asyncio.Task] = None
        self._reader_error: Optional[BaseException] = None
        self.closed = False

    @property
    def address(self) -> str:
        return self.watch.endpoint

    # ------------------------------------------------------------ plumbing
    def _connect(self, endpoint: str) -> zmq.asyncio.Socket:
        return connect_dealer(self._ctx, endpoint, self.curve)

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        last_ping = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                due = [r for r in self._inflight.values() if r.retry_at is not None]
                wait = min([self.ping_interval] + [r.retry_at - now for r in due])
                if await self._sock.poll(max(wait, 0.0) * 1000.0):
                    while True:
                        try:
                            frame = self._sock.recv(zmq.NOBLOCK)
                            frame = frame.result() if isinstance(frame, asyncio.Future) else frame
                        except zmq.Again:
                            break
                        await self._route(frame)
                now = time.monotonic()
                if self._inflight and self.watch.silent(now):
                    await self._failover(now)
                    last_ping = now
                await self._resend([r for r in self._inflight.values()
                                    if r.retry_at is not None and r.retry_at <= now], now)
                if self._queues and now - last_ping >= self.ping_interval:
                    await self._ping()
                    last_ping = now
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # wake every waiter rather than hang them
            self._reader_error = e
            for q in self._queues.values():
                q.put_nowait(None)

    async def _send(self, frame: bytes) -> None:
        """Send, or drop the frame when the broker cannot take it (see
        Client._send): the silence that follows makes the client fail over."""
        try:
            await self._sock.send(frame)
        except zmq.Again:
            self.watch.pinged(time.monotonic())

    async def _ping(self) -> None:
        await self._send(_PING)
        self.watch.pinged(time.monotonic())

    async def _resend(self, reqs, now: float) -> None:
        for req in reqs:
            req.broker_id, req.retry_at = self.watch.broker_id, None
            await self._send(req.frame(now))

    async def _failover(self, now: float) -> None:
        """The broker went silent: connect to the next one and send every
        open generate again."""
        self._sock.close(0)
        self._sock = self._connect(self.watch.next_endpoint(now))
        await self._resend(list(self._inflight.values()), now)
        await self._ping()

    async def _route(self, frame: bytes) -> None:
        now = time.monotonic()
        self.watch.heard(now)
        try:
            msg = decode_reply(frame, self.limits)
        except ServerError:
            return  # an unreadable reply names no request we could fail
        if msg["kind"] == P.Kind.PONG:
            lost = self.watch.lost_by_pong(msg["broker_id"], list(self._inflight.values()))
            await self._resend(lost, now)  # the broker restarted: it holds none of them
            return
        rid = msg.get("request_id")
        if rid is None and len(self._queues) == 1:
            rid = next(iter(self._queues))
        req = self._inflight.get(rid)
        if req is not None:
            try:
                msg = req.accept(msg, now)
            except ServerError as e:
                msg = P.error(rid, e.code, e.message, False)
            if msg is None:
                return
        q = self._queues.get(rid)
        if q is not None:
            q.put_nowait(msg)

    async def _open(self, rid: str, frame: bytes) -> asyncio.Queue:
        self._ensure_reader()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        try:
            await self._send(frame)
        except BaseException:
            del self._queues[rid]
            raise
        return q

    async def _open_generate(self, msg: dict, deadline: float) -> asyncio.Queue:
        rid = msg["request_id"]
        req = InFlight(rid, msg, deadline, broker_id=self.watch.broker_id)
        q = await self._open(rid, req.frame(time.monotonic()))
        self._inflight[rid] = req
        if self.watch.broker_id is None:
            await self._ping()  # the pong names the broker that has it
        return q

    def _close_request(self, rid: str) -> None:
        self._queues.pop(rid, None)
        self._inflight.pop(rid, None)

    async def _next(self, rid: str, q: asyncio.Queue, deadline: float) -> dict:
        if not q.empty():  # already here: no timer, no task (the common case under load)
            msg = q.get_nowait()
        else:
            msg = await _get_until(q, deadline)
            if msg is _TIMED_OUT:
                raise Timeout(P.Code.TIMEOUT, "no reply from the broker in time", True, rid)
        if msg is None:
            raise ServerError(P.Code.INTERNAL, f"client reader failed: {self._reader_error!r}")
        return msg

    async def _call(self, rid: str, frame: bytes, timeout: Optional[float]) -> dict:
        q = await self._open(rid, frame)
        try:
            return await self._next(rid, q, time.monotonic() + (timeout or self.timeout))
        finally:
            self._close_request(rid)

    # ---------------------------------------------------------------- API
    def generate(self, prompt: PromptLike = None, *, input_ids: Optional[Sequence[int]] = None,
                 session_id: Optional[str] = None, max_tokens: int = 16,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 stop: Union[str, Sequence[str], None] = None, seed: Optional[int] = None,
                 stream: bool = False, timeout: Optional[float] = None,
                 request_id: Optional[str] = None, messages: Optional[Sequence[dict]] = None,
                 **params: Any) -> Union[Awaitable[Result], AsyncIterator[Union[Delta, Final]]]:
        """`await c.generate(...)` -> Result; `async for e in c.generate(..., stream=True)`.
        Bad arguments raise InvalidRequest at once."""
        timeout = timeout or self.timeout
        msg = generate_message(
            prompt, input_ids, session_id,
            sampling_params(max_tokens, temperature, top_p, top_k, stop, seed, params),
            stream, timeout, request_id, self.limits, messages)
        deadline_in = timeout + DEADLINE_GRACE_S
        if stream:
            return self._stream(msg, deadline_in)
        return self._complete(msg, deadline_in)

    async def _complete(self, msg: dict, deadline_in: float) -> Result:
        rid, deadline = msg["request_id"], time.monotonic() + deadline_in
        q = await self._open_generate(msg, deadline)
        try:
            return to_result(await self._next(rid, q, deadline))
        except (Timeout, asyncio.CancelledError):
            await self.cancel(rid)
            raise
        finally:
            self._close_request(rid)

    async def _stream(self, msg: dict, deadline_in: float) -> AsyncIterator[Union[Delta, Final]]:
        rid, deadline = msg["request_id"], time.monotonic() + deadline_in
        q = await self._open_generate(msg, deadline)
        finished = False
        try:
            while True:
                msg = await self._next(rid, q, deadline)
                if msg["kind"] != P.Kind.DELTA:
                    finished = True  # a final or an error: the broker is done with it
                event = to_event(msg)
                yield event
                if finished:
                    return
        finally:
            self._close_request(rid)
            if not finished and not self.closed:
                await self.cancel(rid)

    async def cancel(self, request_id: str) -> None:
        await self._send(P.pack(P.cancel(request_id)))

    async def end_session(self, session_id: str, timeout: Optional[float] = None) -> None:
        rid = new_id()
        reply = await self._call(rid, encode_checked(P.end_session(rid, session_id), self.limits),
                                 timeout)
        if reply["kind"] != P.Kind.SESSION_ENDED:
            raise reply_error(reply)

    async def health(self, timeout: Optional[float] = None) -> dict:
        rid = new_id()
        reply = await self._call(rid, P.pack(P.health(rid)), timeout)
        if reply["kind"] != P.Kind.HEALTH:
            raise reply_error(reply)
        return {k: reply[k] for k in ("status", "workers", "queue_depth", "inflight")}

    async def stats(self, timeout: Optional[float] = None) -> dict:
        rid = new_id()
        reply = await self._call(rid, P.pack(P.stats(rid)), timeout)
        if reply["kind"] != P.Kind.STATS:
            raise reply_error(reply)
        return reply["stats"]

    def session(self, session_id: Optional[str] = None, **defaults: Any) -> "AsyncChatSession":
        return AsyncChatSession(self, session_id or new_id(), defaults)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        self._sock.close(0)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class AsyncChatSession:
    def __init__(self, client: AsyncClient, session_id: str, defaults: dict):
        self.client = client
        self.session_id = session_id
        self.defaults = defaults

    def send(self, text_or_ids: PromptLike, **params: Any):
        """Like AsyncClient.generate, with this session's id."""
        return self.client.generate(text_or_ids, session_id=self.session_id,
                                    **{**self.defaults, **params})

    async def end(self) -> None:
        await self.client.end_session(self.session_id)

    async def __aenter__(self) -> "AsyncChatSession":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.end()
        except TurbomqError:
            pass
