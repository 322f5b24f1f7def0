"""The synchronous client. One Client per thread: it owns one DEALER socket
and ZeroMQ sockets are not thread-safe."""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Iterator, Optional, Sequence, Union

import zmq

from . import protocol as P
from .common import (connect_dealer, decode_reply, encode_checked, generate_message, new_id,
                     PromptLike, reply_error, sampling_params, to_event, to_result)
from .errors import ServerError, Timeout
from .keys import CurveClient
from .resume import DEADLINE_GRACE_S, BrokerWatch, InFlight
from .types import Delta, Final, Result

_PING = P.pack(P.ping())


class Client:
    """Talks to a turbomq broker, or to the first live one of several.

        with Client("tcp://127.0.0.1:5555") as c:
            print(c.generate("Hello", max_tokens=8).text)
            for event in c.generate("Hello", stream=True):
                ...

    A generate outlives its broker: when the broker goes silent for
    `ping_interval * liveness` seconds, or restarts, the client sends the
    request again (to the next address when given several) with the tokens
    it already has, and the stream continues without gap or duplicate.
    """

    def __init__(self, address: Union[str, Sequence[str]] = "tcp://127.0.0.1:5555", *,
                 timeout: float = 60.0, ping_interval: float = 0.5, liveness: int = 3,
                 limits: P.Limits = P.DEFAULT_LIMITS, context: Optional[zmq.Context] = None,
                 curve: Optional[CurveClient] = None):
        self.watch = BrokerWatch([address] if isinstance(address, str) else address,
                                 ping_interval, liveness)
        self.timeout = timeout  # default deadline of one request, seconds
        self.ping_interval = ping_interval  # keeps the broker from cancelling our requests
        self.limits = limits
        self.curve = curve  # CurveZMQ keys: encrypted, authenticated links (docs/security.md)
        self._ctx = context or zmq.Context.instance()
        self._sock = self._connect(self.watch.endpoint)
        self._inbox: dict[str, deque] = {}  # open request id -> replies not yet read
        self._inflight: dict[str, InFlight] = {}  # open generates, to send again
        self._last_send = 0.0
        self.closed = False

    @property
    def address(self) -> str:
        return self.watch.endpoint

    # ------------------------------------------------------------ plumbing
    def _connect(self, endpoint: str) -> zmq.Socket:
        return connect_dealer(self._ctx, endpoint, self.curve)

    def _send(self, frame: bytes) -> None:
        """Send, or drop the frame when the broker cannot take it within
        SEND_TIMEOUT_S (no connection: e.g. it refused our key, or it is
        gone); the silence that follows makes the client fail over and send
        its open requests again."""
        try:
            self._sock.send(frame)
        except zmq.Again:
            self.watch.pinged(time.monotonic())
        self._last_send = time.monotonic()

    def _ping(self) -> None:
        self._send(_PING)
        self.watch.pinged(self._last_send)

    def _open(self, rid: str, frame: bytes) -> None:
        self._inbox[rid] = deque()
        try:
            self._send(frame)
        except BaseException:
            del self._inbox[rid]
            raise

    def _open_generate(self, msg: dict, deadline: float) -> str:
        rid = msg["request_id"]
        req = InFlight(rid, msg, deadline, broker_id=self.watch.broker_id)
        self._open(rid, req.frame(time.monotonic()))
        self._inflight[rid] = req
        if self.watch.broker_id is None:
            self._ping()  # the pong names the broker that has it
        return rid

    def _close_request(self, rid: str) -> None:
        self._inbox.pop(rid, None)
        self._inflight.pop(rid, None)

    def _resend(self, reqs, now: float) -> None:
        for req in reqs:
            req.broker_id, req.retry_at = self.watch.broker_id, None
            self._send(req.frame(now))

    def _failover(self, now: float) -> None:
        """The broker went silent: connect to the next one and send every
        open generate again."""
        self._sock.close(0)
        self._sock = self._connect(self.watch.next_endpoint(now))
        self._resend(list(self._inflight.values()), now)
        self._ping()

    def _next_reply(self, rid: str, deadline: float) -> dict:
        """The next reply for `rid`, reading (and sorting) the socket as needed."""
        box = self._inbox[rid]
        self._read_available(rid)  # what came while nobody read: before judging silence
        while not box:
            now = time.monotonic()
            if now >= deadline:
                raise Timeout(P.Code.TIMEOUT, "no reply from the broker in time", True, rid)
            if self._inflight and self.watch.silent(now):
                self._failover(now)
            self._resend([r for r in self._inflight.values()
                          if r.retry_at is not None and r.retry_at <= now], now)
            if now - self._last_send >= self.ping_interval:
                self._ping()
            wait = min([deadline - now, self.ping_interval] +
                       [r.retry_at - now for r in self._inflight.values() if r.retry_at is not None])
            if self._sock.poll(max(wait, 0.0) * 1000.0):
                self._read_available(rid)
        return box.popleft()

    def _read_available(self, waiting_rid: str) -> None:
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            now = time.monotonic()
            self.watch.heard(now)
            msg = decode_reply(frame, self.limits)
            if msg["kind"] == P.Kind.PONG:
                lost = self.watch.lost_by_pong(msg["broker_id"], list(self._inflight.values()))
                self._resend(lost, now)  # the broker restarted: it holds none of them
                continue
            rid = msg.get("request_id")
            # An error naming no request answers the one we are waiting on.
            rid = rid if rid is not None else waiting_rid
            req = self._inflight.get(rid)
            if req is not None:
                try:
                    msg = req.accept(msg, now)
                except ServerError as e:  # for its own reader, not whoever waits now
                    msg = P.error(rid, e.code, e.message, False)
                if msg is None:
                    continue
            box = self._inbox.get(rid)
            if box is not None:
                box.append(msg)
            # else: a late reply for a request we stopped reading: drop it

    def _call(self, rid: str, frame: bytes, timeout: Optional[float] = None) -> dict:
        self._open(rid, frame)
        try:
            return self._next_reply(rid, time.monotonic() + (timeout or self.timeout))
        finally:
            self._close_request(rid)

    # ---------------------------------------------------------------- API
    def generate(self, prompt: PromptLike = None, *, input_ids: Optional[Sequence[int]] = None,
                 session_id: Optional[str] = None, max_tokens: int = 16,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                 stop: Union[str, Sequence[str], None] = None, seed: Optional[int] = None,
                 stream: bool = False, timeout: Optional[float] = None,
                 request_id: Optional[str] = None, messages: Optional[Sequence[dict]] = None,
                 **params: Any) -> Union[Result, "Stream"]:
        """Generate from a text prompt, token ids or chat `messages`
        ([{"role", "content"}, ...], rendered with the model's chat template;
        in a session, a turn's new messages only). `**params`: any other
        SamplingParams field (min_p, repetition_penalty, stop_token_ids, ...).
        stream=False returns a Result; stream=True a Stream of Delta ending with a Final."""
        timeout = timeout or self.timeout
        msg = generate_message(
            prompt, input_ids, session_id,
            sampling_params(max_tokens, temperature, top_p, top_k, stop, seed, params),
            stream, timeout, request_id, self.limits, messages)
        deadline = time.monotonic() + timeout + DEADLINE_GRACE_S
        rid = self._open_generate(msg, deadline)
        if stream:
            return Stream(self, rid, deadline)
        try:
            return to_result(self._next_reply(rid, deadline))
        except Timeout:
            self.cancel(rid)
            raise
        finally:
            self._close_request(rid)

    def cancel(self, request_id: str) -> None:
        """Ask the broker to stop a request. A stream then ends with a Final
        whose finish_reason is 'cancelled'."""
        self._send(P.pack(P.cancel(request_id)))

    def end_session(self, session_id: str, timeout: Optional[float] = None) -> None:
        """Drop a session's KV and stored tokens. Raises UnknownSession if none."""
        rid = new_id()
        reply = self._call(rid, encode_checked(P.end_session(rid, session_id), self.limits), timeout)
        if reply["kind"] != P.Kind.SESSION_ENDED:
            raise reply_error(reply)

    def health(self, timeout: Optional[float] = None) -> dict:
        """{'status': 'ok'|'degraded', 'workers': n, 'queue_depth': n, 'inflight': n}"""
        rid = new_id()
        reply = self._call(rid, P.pack(P.health(rid)), timeout)
        if reply["kind"] != P.Kind.HEALTH:
            raise reply_error(reply)
        return {k: reply[k] for k in ("status", "workers", "queue_depth", "inflight")}

    def stats(self, timeout: Optional[float] = None) -> dict:
        rid = new_id()
        reply = self._call(rid, P.pack(P.stats(rid)), timeout)
        if reply["kind"] != P.Kind.STATS:
            raise reply_error(reply)
        return reply["stats"]

    def session(self, session_id: Optional[str] = None, **defaults: Any) -> "ChatSession":
        """A multi-turn conversation whose KV stays on one worker when it can."""
        return ChatSession(self, session_id or new_id(), defaults)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._sock.close(0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Stream:
    """Iterator over one streaming request's events: Delta..., then a Final.
    Closing it (or leaving a `with` block) before the Final cancels the request."""

    def __init__(self, client: Client, request_id: str, deadline: float):
        self.client = client
        self.request_id = request_id
        self._deadline = deadline
        self.done = False

    def __iter__(self) -> Iterator[Union[Delta, Final]]:
        return self

    def __next__(self) -> Union[Delta, Final]:
        if self.done:
            raise StopIteration
        try:
            event = to_event(self.client._next_reply(self.request_id, self._deadline))
        except BaseException:
            self.close()
            raise
        if isinstance(event, Final):
            self.done = True
            self.client._close_request(self.request_id)
        return event

    def cancel(self) -> None:
        """Ask for a stop but keep reading: the stream ends with a cancelled Final."""
        if not self.done:
            self.client.cancel(self.request_id)

    def close(self) -> None:
        if not self.done:
            self.done = True
            if not self.client.closed:
                self.client.cancel(self.request_id)
            self.client._close_request(self.request_id)

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class ChatSession:
    """Keeps one session id across turns. `send` takes the new turn only; the
    worker prepends the session's history."""

    def __init__(self, client: Client, session_id: str, defaults: dict):
        self.client = client
        self.session_id = session_id
        self.defaults = defaults

    def send(self, text_or_ids: PromptLike, **params: Any) -> Union[Result, Stream]:
        return self.client.generate(text_or_ids, session_id=self.session_id,
                                    **{**self.defaults, **params})

    def end(self) -> None:
        self.client.end_session(self.session_id)

    def __enter__(self) -> "ChatSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        from .errors import TurbomqError
        try:
            self.end()
        except TurbomqError:
            pass  # never used, or the service is gone: nothing to free
