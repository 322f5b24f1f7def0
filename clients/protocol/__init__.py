"""The turbomq wire protocol: the one definition of every message.

Every frame is one msgpack map with `v` (protocol version) and `kind`. Four
directions, each with its own decoder:

    client -> broker   generate, cancel, end_session, health, stats, ping
    broker -> client   delta, final, error, health, stats, session_ended
    worker -> broker   register, heartbeat, delta, final, error, session_ended
    broker -> worker   registered, heartbeat, dispatch, cancel, end_session, reconnect

Decoders validate types, ranges and sizes and raise `ProtocolError(code, message)`
for anything malformed, never another exception. docs/protocol.md documents
each field. This package depends on msgpack only. Import from here
(`from turbomq.clients import protocol as P`); the modules are:

    schema     version, Kind, Code and the code sets, finish reasons, Limits,
               ProtocolError, and the fields each kind may carry
    validate   the field checks, the per-direction check tables (kind -> check)
               and the broker's fast-path predicates
    codec      pack/unpack and the decode_* entry points
    messages   the builders, one per kind and direction
"""

from .codec import (_decode, decode_broker_command, decode_client_reply, decode_client_request,
                    decode_worker_message, pack, unpack)
from .messages import (cancel, delta, dispatch, end_session, error, final, generate, health,
                       health_reply, heartbeat, ping, pong, reconnect, register, registered,
                       session_ended, stats, stats_reply, usage, worker_delta, worker_final)
from .schema import (ALL_CODES, DEFAULT_LIMITS, FINISH_REASONS, MAX_TOKEN_ID, PROTOCOL_VERSION,
                     RETRYABLE_CODES, Code, Kind, Limits, ProtocolError)
from .validate import (BROKER_COMMAND_CHECKS, CLIENT_REPLY_CHECKS, CLIENT_REQUEST_CHECKS,
                       SAMPLING_CHECKS, SAMPLING_FIELDS, WORKER_MESSAGE_CHECKS)

# _decode (the full path without the fast ones) is here for
# tests/clients/test_protocol.py, which holds the decoders' fast paths to it.
__all__ = [
    "PROTOCOL_VERSION", "Kind", "Code", "ALL_CODES", "RETRYABLE_CODES", "FINISH_REASONS",
    "MAX_TOKEN_ID", "ProtocolError", "Limits", "DEFAULT_LIMITS",
    "SAMPLING_CHECKS", "SAMPLING_FIELDS", "CLIENT_REQUEST_CHECKS", "CLIENT_REPLY_CHECKS",
    "WORKER_MESSAGE_CHECKS", "BROKER_COMMAND_CHECKS",
    "pack", "unpack", "decode_client_request", "decode_client_reply", "decode_worker_message",
    "decode_broker_command",
    "generate", "cancel", "end_session", "health", "stats", "ping", "delta", "final", "error",
    "health_reply", "pong", "stats_reply", "session_ended", "usage", "register", "heartbeat",
    "worker_delta", "worker_final", "registered", "dispatch", "reconnect",
]
