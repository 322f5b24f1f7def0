"""Session store over Redis, shared by every worker (see docs/sessions.md).

Per session two keys share one cluster hash tag, so they live on one shard
and can change in one atomic step:

    {prefix}:session:{<id>}:tokens   string, uint32 little-endian token IDs
    {prefix}:session:{<id>}:meta     hash: model, length, created, last_use, holder,
                                     and the last turn: turn_id, turn_start,
                                     turn_prompt, turn_finish

Writes run as Lua scripts: atomic like MULTI/EXEC, and unlike MULTI they can
refuse a write to a session that belongs to another model before changing
anything. `append_tokens` returns only after Redis replied, so a turn the
engine reports as finished is in Redis.
"""

from __future__ import annotations

import sys
import time
from array import array
from dataclasses import dataclass
from typing import Callable, Optional
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..engine.session_store import (SessionConflict, SessionFull, SessionHistory,
                                   SessionModelMismatch, SessionStoreError, TenantQuotaExceeded,
                                   TurnRecord)

# Called after every store operation: (op, seconds, ok). Metrics plug in here.
Observer = Callable[[str, float, bool], None]

_TOKEN_BYTES = 4
assert array("I").itemsize == _TOKEN_BYTES

# The end of both append scripts: the creation time once, the idle TTL
# renewed on both keys (ARGV[3] now, ARGV[4] ttl_ms), the new length back.
_CREATED_AND_TTL = """
redis.call('HSETNX', KEYS[2], 'created', ARGV[3])
local ttl = tonumber(ARGV[4])
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return {1, n}
"""

# KEYS: tokens, meta. ARGV: model, packed tokens, now, ttl_ms, max tokens (0:
# none). Returns {1, length}, {0, other model} or {4, length} (it would grow
# past the bound; nothing written).
_APPEND = """
local model = redis.call('HGET', KEYS[2], 'model')
if model and model ~= ARGV[1] then return {0, model} end
local have = math.floor(redis.call('STRLEN', KEYS[1]) / 4)
local bound = tonumber(ARGV[5])
if bound > 0 and have + string.len(ARGV[2]) / 4 > bound then return {4, have} end
local n = math.floor(redis.call('APPEND', KEYS[1], ARGV[2]) / 4)
redis.call('HSET', KEYS[2], 'model', ARGV[1], 'length', n, 'last_use', ARGV[3])
""" + _CREATED_AND_TTL

# KEYS: tokens, meta. ARGV: model, packed tokens, now, ttl_ms, turn_id, start,
# prompt_len, finish_reason, max tokens (0: none). Returns {1, length}
# (committed), {0, other model}, {2, length} (this turn, the same id on the
# same start, is committed already), {3, length} (the session does not have
# `start` tokens: another turn came first) or {4, length} (past the bound).
_APPEND_TURN = """
local model = redis.call('HGET', KEYS[2], 'model')
if model and model ~= ARGV[1] then return {0, model} end
local n = math.floor(redis.call('STRLEN', KEYS[1]) / 4)
local last = redis.call('HMGET', KEYS[2], 'turn_id', 'turn_start')
if last[1] == ARGV[5] and last[2] == ARGV[6] then return {2, n} end
if n ~= tonumber(ARGV[6]) then return {3, n} end
local bound = tonumber(ARGV[9])
if bound > 0 and n + string.len(ARGV[2]) / 4 > bound then return {4, n} end
n = math.floor(redis.call('APPEND', KEYS[1], ARGV[2]) / 4)
redis.call('HSET', KEYS[2], 'model', ARGV[1], 'length', n, 'last_use', ARGV[3],
           'turn_id', ARGV[5], 'turn_start', ARGV[6], 'turn_prompt', ARGV[7],
           'turn_finish', ARGV[8])
""" + _CREATED_AND_TTL

# Per tenant: how many sessions and tokens it keeps (three keys under the
# tenant's hash tag). KEYS: sizes (hash session -> tokens), used (zset
# session -> last use), total (tokens). ARGV: session, its new length, now (s),
# idle ttl (s, 0: none), max sessions, max tokens (0: none). Sessions idle past
# the ttl (expired in Redis) leave the index first. Returns {0} (recorded),
# {1, sessions} or {2, tokens} (refused: nothing changed).
_TENANT_ADMIT = """
local now, ttl = tonumber(ARGV[3]), tonumber(ARGV[4])
if ttl > 0 then
  for _, s in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl)) do
    redis.call('DECRBY', KEYS[3], tonumber(redis.call('HGET', KEYS[1], s) or '0'))
    redis.call('HDEL', KEYS[1], s)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - ttl)
end
local old = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local new = tonumber(ARGV[2])
local max_sessions, max_tokens = tonumber(ARGV[5]), tonumber(ARGV[6])
local sessions = redis.call('HLEN', KEYS[1])
if old == 0 and max_sessions > 0 and sessions >= max_sessions then return {1, sessions} end
local total = tonumber(redis.call('GET', KEYS[3]) or '0')
if max_tokens > 0 and total - old + new > max_tokens then return {2, total} end
redis.call('HSET', KEYS[1], ARGV[1], new)
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('INCRBY', KEYS[3], new - old)
return {0, 0}
"""

# KEYS: sizes, used, total. ARGV: session. Forget it in its tenant's index.
_TENANT_FORGET = """
redis.call('DECRBY', KEYS[3], tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0'))
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 0
"""

# KEYS: tokens, meta. ARGV: model, worker ('' clears), now, ttl_ms, expected holder
# ('' = any). Returns {1, length}, {0, other model}, or {2, actual holder}.
_HOLDER = """
local model = redis.call('HGET', KEYS[2], 'model')
if model and model ~= ARGV[1] then return {0, model} end
local holder = redis.call('HGET', KEYS[2], 'holder') or ''
if ARGV[5] ~= '' and holder ~= ARGV[5] then return {2, holder} end
local n = math.floor(redis.call('STRLEN', KEYS[1]) / 4)
if not model then
  redis.call('HSET', KEYS[2], 'model', ARGV[1], 'length', n, 'created', ARGV[3])
end
redis.call('HSET', KEYS[2], 'last_use', ARGV[3])
if ARGV[2] == '' then
  redis.call('HDEL', KEYS[2], 'holder')
else
  redis.call('HSET', KEYS[2], 'holder', ARGV[2])
end
local ttl = tonumber(ARGV[4])
if ttl > 0 then
  if n > 0 then redis.call('PEXPIRE', KEYS[1], ttl) end
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return {1, n}
"""


@dataclass(frozen=True)
class SessionMeta:
    model_id: str
    length: int
    created: float
    last_use: float
    holder: Optional[str]


def pack_tokens(tokens: list[int]) -> bytes:
    try:
        packed = array("I", tokens)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token IDs must be integers in [0, 2**32): {e}") from None
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    if len(data) % _TOKEN_BYTES:
        raise ValueError(f"token string of {len(data)} bytes is not a multiple of 4")
    packed = array("I")
    packed.frombytes(data)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


def _redact(url: str) -> str:
    """The URL without its password, for error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


class RedisSessionStore:
    """SessionStore over Redis. Thread-safe (redis-py pools connections)."""

    def __init__(self, url: str, model_id: str, ttl_seconds: Optional[float] = None,
                 timeout: float = 0.5, prefix: str = "turbomq",
                 observe: Optional[Observer] = None,
                 max_session_tokens: Optional[int] = None,
                 tenant_max_sessions: int = 0, tenant_max_tokens: int = 0) -> None:
        """max_session_tokens: no session grows past it (SessionFull).
        tenant_max_sessions / tenant_max_tokens (0: none): what one tenant
        (the part of a session id before its first ':') may keep in the store
        (TenantQuotaExceeded)."""
        if not model_id:
            raise ValueError("model_id must be a non-empty string")
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError("ttl_seconds must be positive (or None for no expiry)")
        self.url = _redact(url)
        self.model_id = model_id
        self.ttl_ms = 0 if ttl_seconds is None else max(1, int(ttl_seconds * 1000))
        self.max_session_tokens = max_session_tokens or 0
        self.tenant_max_sessions = tenant_max_sessions
        self.tenant_max_tokens = tenant_max_tokens
        self.prefix = prefix
        self.observe = observe
        # Fail fast: short timeouts and no retries. A retried APPEND whose first
        # reply was lost would store the turn twice. A connection closed by a
        # Redis restart is replaced when it is taken from the pool, so recovery
        # needs no retry.
        self._redis = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False)
        self._append = self._redis.register_script(_APPEND)
        self._append_turn = self._redis.register_script(_APPEND_TURN)
        self._tenant_admit = self._redis.register_script(_TENANT_ADMIT)
        self._tenant_forget = self._redis.register_script(_TENANT_FORGET)
        self._holder = self._redis.register_script(_HOLDER)

    # ------------------------------------------------------------- keys
    def _keys(self, session_id: str) -> tuple[str, str]:
        if not isinstance(session_id, str) or not session_id:
            raise ValueError("session_id must be a non-empty string")
        base = f"{self.prefix}:session:{{{session_id}}}"
        return f"{base}:tokens", f"{base}:meta"

    # ---------------------------------------------------- SessionStore
    def get_tokens(self, session_id: str) -> Optional[list[int]]:
        tokens_key, meta_key = self._keys(session_id)

        def read():
            pipe = self._redis.pipeline(transaction=True)
            pipe.get(tokens_key)
            pipe.hget(meta_key, "model")
            return pipe.execute()

        data, model = self._call("get_tokens", session_id, read)
        if data is None and model is None:
            return None
        self._check_model(session_id, model)
        try:
            return unpack_tokens(data or b"")
        except ValueError as e:
            raise SessionStoreError(f"session {session_id!r} in {self.url} is corrupt: {e}") from None

    def append_tokens(self, session_id: str, tokens: list[int]) -> int:
        keys = self._keys(session_id)
        packed = pack_tokens(list(tokens))
        args = [self.model_id, packed, repr(time.time()), self.ttl_ms, self.max_session_tokens]
        status, value = self._call("append_tokens", session_id, lambda: self._append(keys, args))
        if status == 0:
            self._check_model(session_id, value)
        self._check_bound(session_id, status, value, len(tokens))
        return int(value)

    def get_session(self, session_id: str) -> Optional[SessionHistory]:
        tokens_key, meta_key = self._keys(session_id)

        def read():
            pipe = self._redis.pipeline(transaction=True)
            pipe.get(tokens_key)
            pipe.hmget(meta_key, "model", "turn_id", "turn_start", "turn_prompt", "turn_finish")
            return pipe.execute()

        data, (model, *turn) = self._call("get_tokens", session_id, read)
        if data is None and model is None:
            return None
        self._check_model(session_id, model)
        try:
            tokens = unpack_tokens(data or b"")
            last = (None if turn[0] is None else
                    TurnRecord(turn[0].decode(), int(turn[1]), int(turn[2]), turn[3].decode()))
        except (ValueError, TypeError, AttributeError) as e:
            raise SessionStoreError(f"session {session_id!r} in {self.url} is corrupt: {e}") from None
        return SessionHistory(tokens, last)

    def append_turn(self, session_id: str, tokens: list[int], turn: TurnRecord) -> bool:
        keys = self._keys(session_id)
        self._admit_for_tenant(session_id, turn.start + len(tokens))
        args = [self.model_id, pack_tokens(list(tokens)), repr(time.time()), self.ttl_ms,
                turn.turn_id, turn.start, turn.prompt_len, turn.finish_reason,
                self.max_session_tokens]
        status, value = self._call("append_tokens", session_id,
                                   lambda: self._append_turn(keys, args))
        if status == 0:
            self._check_model(session_id, value)
        self._check_bound(session_id, status, value, len(tokens))
        if status == 3:
            raise SessionConflict(f"session {session_id!r} has {int(value)} tokens, not the "
                                  f"{turn.start} this turn was computed on")
        return status == 1

    def drop(self, session_id: str) -> bool:
        keys = self._keys(session_id)
        if self._tenant_limited:
            self._call("drop", session_id, lambda: self._tenant_forget(
                self._tenant_keys(session_id), [session_id]))
        return self._call("drop", session_id, lambda: self._redis.delete(*keys)) > 0

    # -------------------------------------------------------- metadata
    def set_holder(self, session_id: str, worker_id: Optional[str]) -> None:
        """Record which worker holds the session's KV (None: nobody)."""
        if worker_id == "":
            raise ValueError("worker_id must be non-empty (None clears the holder)")
        self._run_holder(session_id, worker_id or "", expected="")

    def release_holder(self, session_id: str, worker_id: str) -> bool:
        """Clear the holder only if it is still `worker_id` (another worker may
        have taken the session since); True if it was cleared."""
        if not worker_id:
            raise ValueError("worker_id must be non-empty")
        return self._run_holder(session_id, "", expected=worker_id)

    def metadata(self, session_id: str) -> Optional[SessionMeta]:
        _, meta_key = self._keys(session_id)
        raw = self._call("metadata", session_id, lambda: self._redis.hgetall(meta_key))
        if not raw:
            return None
        meta = {k.decode(): v.decode() for k, v in raw.items()}
        return SessionMeta(model_id=meta.get("model", ""), length=int(meta.get("length", 0)),
                           created=float(meta.get("created", 0)),
                           last_use=float(meta.get("last_use", 0)), holder=meta.get("holder"))

    def ping(self) -> None:
        """Raise SessionStoreError unless Redis answers (readiness checks)."""
        self._call("ping", "-", self._redis.ping)

    def close(self) -> None:
        self._redis.close()

    # --------------------------------------------------------- helpers
    def _run_holder(self, session_id: str, worker: str, expected: str) -> bool:
        keys = self._keys(session_id)
        args = [self.model_id, worker, repr(time.time()), self.ttl_ms, expected]
        status, value = self._call("set_holder", session_id, lambda: self._holder(keys, args))
        if status == 0:
            self._check_model(session_id, value)
        return status == 1

    @property
    def _tenant_limited(self) -> bool:
        return bool(self.tenant_max_sessions or self.tenant_max_tokens)

    def _tenant_keys(self, session_id: str) -> list[str]:
        tenant = session_id.split(":", 1)[0] if ":" in session_id else ""
        base = f"{self.prefix}:tenant:{{{tenant}}}"
        return [f"{base}:sizes", f"{base}:used", f"{base}:total"]

    def _admit_for_tenant(self, session_id: str, new_length: int) -> None:
        """Record the session's new size in its tenant's index, or refuse the
        turn if the tenant would keep more sessions or tokens than it may."""
        if not self._tenant_limited:
            return
        ttl_s = self.ttl_ms / 1000.0
        args = [session_id, new_length, repr(time.time()), ttl_s, self.tenant_max_sessions,
                self.tenant_max_tokens]
        status, value = self._call("append_tokens", session_id, lambda: self._tenant_admit(
            self._tenant_keys(session_id), args))
        if status == 1:
            raise TenantQuotaExceeded(f"the tenant keeps {int(value)} sessions in the store, "
                                      f"its limit; end one to start another")
        if status == 2:
            raise TenantQuotaExceeded(f"the tenant keeps {int(value)} tokens in the store; this "
                                      f"session at {new_length} tokens would pass its limit "
                                      f"of {self.tenant_max_tokens}")

    def _check_bound(self, session_id: str, status: int, length, adding: int) -> None:
        if status == 4:
            raise SessionFull(f"session {session_id!r} holds {int(length)} tokens; {adding} more "
                              f"would pass its bound of {self.max_session_tokens}")

    def _check_model(self, session_id: str, model: Optional[bytes]) -> None:
        if model is not None and model.decode() != self.model_id:
            raise SessionModelMismatch(
                f"session {session_id!r} belongs to model {model.decode()!r}, "
                f"not {self.model_id!r}; start a new session for this model")

    def _call(self, op: str, session_id: str, fn):
        start = time.perf_counter()
        ok = False
        try:
            result = fn()
            ok = True
            return result
        except redis.RedisError as e:
            raise SessionStoreError(
                f"session store {self.url} failed on {op} for session {session_id!r}: "
                f"{type(e).__name__}: {e}") from e
        finally:
            if self.observe is not None:
                try:
                    self.observe(op, time.perf_counter() - start, ok)
                except Exception:  # a metrics bug must not fail a session write
                    pass
