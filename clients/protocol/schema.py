"""What the protocol is made of: the version, message kinds, error codes,
finish reasons, size limits, `ProtocolError`, and the fields each message
kind may carry. Plain data: no checks, no msgpack."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

PROTOCOL_VERSION = 1


class Kind:
    GENERATE = "generate"
    CANCEL = "cancel"
    END_SESSION = "end_session"
    HEALTH = "health"
    STATS = "stats"
    PING = "ping"
    DELTA = "delta"
    FINAL = "final"
    ERROR = "error"
    SESSION_ENDED = "session_ended"
    REGISTER = "register"
    REGISTERED = "registered"
    HEARTBEAT = "heartbeat"
    DISPATCH = "dispatch"
    RECONNECT = "reconnect"
    PONG = "pong"


class Code:
    """Stable error codes. Clients branch on these, never on messages."""

    # malformed input (protocol level)
    BAD_FRAME = "bad_frame"
    BAD_VERSION = "bad_version"
    UNKNOWN_KIND = "unknown_kind"
    INVALID_FIELD = "invalid_field"
    FRAME_TOO_LARGE = "frame_too_large"
    DUPLICATE_REQUEST = "duplicate_request"
    # service state
    OVERLOADED = "overloaded"
    NO_WORKERS = "no_workers"
    TIMEOUT = "timeout"
    UNKNOWN_REQUEST = "unknown_request"
    WORKER_LOST = "worker_lost"
    INTERNAL = "internal"
    # the engine's codes, passed through from workers
    INVALID_REQUEST = "invalid_request"
    PROMPT_TOO_LONG = "prompt_too_long"
    UNKNOWN_SESSION = "unknown_session"
    SESSION_BUSY = "session_busy"
    SESSION_STORE_UNAVAILABLE = "session_store_unavailable"
    RATE_LIMITED = "rate_limited"  # the client's tenant is at one of its limits
    INVALID_PARAMS = "invalid_params"


ALL_CODES = frozenset(v for k, v in vars(Code).items() if k.isupper())
# Retrying the same request later may succeed.
RETRYABLE_CODES = frozenset({Code.OVERLOADED, Code.NO_WORKERS, Code.TIMEOUT, Code.WORKER_LOST,
                             Code.SESSION_BUSY, Code.SESSION_STORE_UNAVAILABLE, Code.RATE_LIMITED})

FINISH_REASONS = frozenset({"stop", "length", "cancelled"})

MAX_TOKEN_ID = (1 << 31) - 1


class ProtocolError(Exception):
    """A frame that is not a valid message. `request_id` is set when the frame
    was readable enough to name one, so the error reply can carry it."""

    def __init__(self, code: str, message: str, request_id: Optional[str] = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.request_id = request_id

    def __repr__(self) -> str:
        return f"ProtocolError({self.code!r}, {self.message!r})"


@dataclass(frozen=True)
class Limits:
    """Size bounds every decoder enforces. Broker, workers and clients share
    the defaults; a deployment may raise them (all sides alike)."""

    max_frame_bytes: int = 1 << 20
    max_prompt_tokens: int = 65536
    max_prompt_chars: int = 262144  # a prompt's, or all its messages' contents
    max_messages: int = 1024  # messages in one chat prompt
    max_id_chars: int = 128  # request ids, session ids, worker ids, model ids
    max_tenant_chars: int = 64  # tenant names (the client key's name on the broker's list)
    max_new_tokens: int = 65536  # bound on params.max_tokens and on resume_tokens
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # per stop string
    max_stop_token_ids: int = 256
    max_delta_tokens: int = 65536  # token_ids in one delta / final
    max_text_chars: int = 1 << 19  # text in one delta / final
    max_message_chars: int = 4096  # error messages
    max_heartbeat_sessions: int = 1024  # per list in one heartbeat
    max_timeout_s: float = 86400.0


DEFAULT_LIMITS = Limits()


# ------------------------------------------------- the fields of each kind
# Every message may carry exactly `v`, `kind` and the fields named here; any
# other is `invalid_field`. A suffix names the direction where a kind has
# more than one: _C and _R broker -> client, _W worker -> broker, _B broker -> worker.
def _fields(*names: str) -> frozenset:
    return frozenset(("v", "kind") + names)


_NO_FIELDS = _fields()  # ping; heartbeat and reconnect to a worker
_REQUEST_ID_ONLY = _fields("request_id")  # cancel, health, stats from a client
_END_SESSION = _fields("request_id", "session_id")  # end_session and session_ended, all ways
_END_SESSION_B = _fields("request_id", "session_id", "tenant")  # end_session, broker -> worker

# client -> broker
_GENERATE = _fields("request_id", "prompt", "input_ids", "messages", "session_id", "params",
                    "stream", "timeout", "resume_tokens", "resume_text")

# broker -> client
_DELTA_C = _fields("request_id", "seq", "index", "token_ids", "text")
_FINAL_C = _fields("request_id", "seq", "finish_reason", "usage", "token_ids", "text")
_ERROR = _fields("request_id", "code", "message", "retryable", "attempt")  # also worker -> broker
_HEALTH_R = _fields("request_id", "status", "workers", "queue_depth", "inflight")
_STATS_R = _fields("request_id", "stats")
_PONG_R = _fields("broker_id")

# worker -> broker
_REGISTER = _fields("worker_id", "model", "slots", "kv_blocks", "metrics_port")
_HEARTBEAT_W = _fields("free_slots", "free_kv_blocks", "queue_len", "sessions_reset",
                       "sessions_added", "sessions_removed")
_DELTA_W = _fields("request_id", "attempt", "index", "token_ids", "text")
_FINAL_W = _fields("request_id", "attempt", "finish_reason", "usage", "token_ids", "text")

# broker -> worker
_REGISTERED_B = _fields("heartbeat_interval", "liveness", "broker_id")
_DISPATCH = _fields("request_id", "attempt", "prompt", "input_ids", "messages", "session_id",
                    "params",
                    "resume_tokens", "resume_text", "timeout", "turn_id", "tenant")
_CANCEL_B = _fields("request_id", "attempt")

# the `usage` map of a final (not a message: no v, no kind)
_USAGE_KEYS = frozenset(("prompt_tokens", "cached_tokens", "completion_tokens"))
