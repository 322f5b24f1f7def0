"""`turbomq chat`: a terminal conversation with the service, one session,
streamed; each line goes as a chat message (the model's chat template renders
it), or as plain text to a model without a template. `/reset` starts a new
session, `/quit` (or end of input) leaves. Uses turbomq.clients only (no torch)."""

from __future__ import annotations

import sys
import uuid
from typing import Optional, TextIO

from turbomq.clients import Client, CurveClient, Final, InvalidRequest, TurbomqError


def _end(client: Client, session_id: str, started: bool) -> None:
    if not started:
        return
    try:
        client.end_session(session_id)
    except TurbomqError as e:
        print(f"[could not end the session: {e.code}: {e.message}]", file=sys.stderr)


def _turn(client: Client, text: str, chat: dict, **kw):
    """One turn's events: the user's line as a chat message (rendered with the
    model's template), or as plain text for a model that has none."""
    if chat["messages"]:
        try:
            events = client.generate(messages=[{"role": "user", "content": text}], **kw)
            first = next(events)
        except InvalidRequest as e:
            if "no chat template" not in e.message:
                raise
            chat["messages"] = False
        else:
            yield first
            yield from events
            return
    yield from client.generate(text, **kw)


def run_chat(broker: str, max_tokens: int = 64, temperature: float = 0.8,
             seed: Optional[int] = None, timeout: float = 120.0,
             stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout,
             curve: Optional[CurveClient] = None) -> int:
    with Client(broker.split(","), timeout=timeout, curve=curve) as client:
        session_id, started = uuid.uuid4().hex, False
        chat = {"messages": True}  # until the model says it has no chat template
        print("turbomq chat: /reset starts over, /quit leaves", file=stdout, flush=True)
        while True:
            print("you> ", end="", file=stdout, flush=True)
            line = stdin.readline()
            if not line or line.strip() == "/quit":
                _end(client, session_id, started)
                return 0
            text = line.rstrip("\n")
            if text.strip() == "/reset":
                _end(client, session_id, started)
                session_id, started = uuid.uuid4().hex, False
                print("[new session]", file=stdout, flush=True)
                continue
            if not text.strip():
                continue
            print("model> ", end="", file=stdout, flush=True)
            try:
                for event in _turn(client, text, chat, session_id=session_id,
                                   max_tokens=max_tokens, temperature=temperature, seed=seed,
                                   stream=True):
                    if isinstance(event, Final):
                        started = True
                        print(f"\n[{event.finish_reason}]", file=stdout, flush=True)
                    else:
                        print(event.text, end="", file=stdout, flush=True)
            except TurbomqError as e:
                print(f"\n[error {e.code}: {e.message}]", file=stdout, flush=True)
