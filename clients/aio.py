"""The asyncio client. One AsyncClient per event loop: a reader task sorts
replies into per-request queues, so many requests may run concurrently."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Awaitable, Optional, Sequence, Union

import zmq
import zmq.asyncio

from . import protocol as P
from .common import (DEADLINE_GRACE_S, PromptLike, decode_reply, encode_checked,
                     generate_frame, new_id, reply_error, sampling_params, to_event, to_result)
from .errors import ServerError, Timeout, TurbomqError
from .types import Delta, Final, Result

_PING = P.pack(P.ping())


class AsyncClient:
    """    async with AsyncClient("tcp://127.0.0.1:5555") as c:
            result = await c.generate("Hello", max_tokens=8)
            async for event in c.generate("Hello", stream=True):
                ...
    """

    def __init__(self, address: str = "tcp://127.0.0.1:5555", *, timeout: float = 60.0,
                 ping_interval: float = 2.0, limits: P.Limits = P.DEFAULT_LIMITS,
                 context: Optional[zmq.asyncio.Context] = None):
        self.address = address
        self.timeout = timeout
        self.ping_interval = ping_interval
        self.limits = limits
        self._sock = (context or zmq.asyncio.Context.instance()).socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: Optional[asyncio.Task] = None
        self._reader_error: Optional[BaseException] = None
        self.closed = False

    # ------------------------------------------------------------ plumbing
    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        last_ping = time.monotonic()
        try:
            while True:
                if await self._sock.poll(self.ping_interval * 1000.0):
                    while True:
                        try:
                            frame = self._sock.recv(zmq.NOBLOCK)
                            frame = frame.result() if isinstance(frame, asyncio.Future) else frame
                        except zmq.Again:
                            break
                        self._route(frame)
                now = time.monotonic()
                if self._queues and now - last_ping >= self.ping_interval:
                    await self._sock.send(_PING)
                    last_ping = now
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # wake every waiter rather than hang them
            self._reader_error = e
            for q in self._queues.values():
                q.put_nowait(None)

    def _route(self, frame: bytes) -> None:
        try:
            msg = decode_reply(frame, self.limits)
        except ServerError:
            return  # an unreadable reply names no request we could fail
        rid = msg.get("request_id")
        if rid is None and len(self._queues) == 1:
            rid = next(iter(self._queues))
        q = self._queues.get(rid)
        if q is not None:
            q.put_nowait(msg)

    async def _open(self, rid: str, frame: bytes) -> asyncio.Queue:
        self._ensure_reader()
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        try:
            await self._sock.send(frame)
        except BaseException:
            del self._queues[rid]
            raise
        return q

    async def _next(self, rid: str, q: asyncio.Queue, deadline: float) -> dict:
        remaining = deadline - time.monotonic()
        try:
            msg = await asyncio.wait_for(q.get(), max(remaining, 0.0))
        except asyncio.TimeoutError:
            raise Timeout(P.Code.TIMEOUT, "no reply from the broker in time", True, rid) from None
        if msg is None:
            raise ServerError(P.Code.INTERNAL, f"client reader failed: {self._reader_error!r}")
        return msg

    async def _call(self, rid: str, frame: bytes, timeout: Optional[float]) -> dict:
        q = await self._open(rid, frame)
        try:
            return await self._next(rid, q, time.monotonic() + (timeout or self.timeout))
        finally:
            self._queues.pop(rid, None)

    # ---------------------------------------------------------------- API
    def generate(self, prompt: PromptLike = None, *, input_ids: Optional[Sequence[int]] = None,
                 session_id: Optional[str] = None, max_tokens: int = 16,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 stop: Union[str, Sequence[str], None] = None, seed: Optional[int] = None,
                 stream: bool = False, timeout: Optional[float] = None,
                 request_id: Optional[str] = None,
                 **params: Any) -> Union[Awaitable[Result], AsyncIterator[Union[Delta, Final]]]:
        """`await c.generate(...)` -> Result; `async for e in c.generate(..., stream=True)`.
        Bad arguments raise InvalidRequest at once."""
        timeout = timeout or self.timeout
        rid, frame = generate_frame(
            prompt, input_ids, session_id,
            sampling_params(max_tokens, temperature, top_p, top_k, stop, seed, params),
            stream, timeout, request_id, self.limits)
        deadline_in = timeout + DEADLINE_GRACE_S
        if stream:
            return self._stream(rid, frame, deadline_in)
        return self._complete(rid, frame, deadline_in)

    async def _complete(self, rid: str, frame: bytes, deadline_in: float) -> Result:
        q = await self._open(rid, frame)
        try:
            return to_result(await self._next(rid, q, time.monotonic() + deadline_in))
        except (Timeout, asyncio.CancelledError):
            await self.cancel(rid)
            raise
        finally:
            self._queues.pop(rid, None)

    async def _stream(self, rid: str, frame: bytes,
                      deadline_in: float) -> AsyncIterator[Union[Delta, Final]]:
        q = await self._open(rid, frame)
        deadline = time.monotonic() + deadline_in
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
            self._queues.pop(rid, None)
            if not finished and not self.closed:
                await self.cancel(rid)

    async def cancel(self, request_id: str) -> None:
        await self._sock.send(P.pack(P.cancel(request_id)))

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
