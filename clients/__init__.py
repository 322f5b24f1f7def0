"""turbomq.clients: the wire protocol and the client library (pyzmq + msgpack only).

    from turbomq.clients import Client
    with Client("tcp://127.0.0.1:5555") as c:
        print(c.generate("Hello", max_tokens=8).text)
"""

from .aio import AsyncChatSession, AsyncClient
from .client import ChatSession, Client, Stream
from .errors import (InvalidRequest, Overloaded, PromptTooLong, ServerError, SessionBusy, Timeout,
                     TurbomqError, Unavailable, UnknownRequest, UnknownSession)
from .keys import CurveClient, KeyPair
from .protocol import PROTOCOL_VERSION, ProtocolError
from .types import Delta, Final, Result, Usage

__all__ = [
    "AsyncChatSession", "AsyncClient", "ChatSession", "Client", "Stream", "CurveClient", "KeyPair",
    "InvalidRequest", "Overloaded", "PromptTooLong", "ServerError", "SessionBusy", "Timeout",
    "TurbomqError", "Unavailable", "UnknownRequest", "UnknownSession",
    "PROTOCOL_VERSION", "ProtocolError", "Delta", "Final", "Result", "Usage",
]
