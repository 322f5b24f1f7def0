"""How a benchmark request is sent and timed: to a turbomq broker through
AsyncClient, or to any OpenAI-compatible HTTP server (the turbomq gateway,
vLLM, ...) through httpx, streamed either way. Each returns a RequestResult
with the times the metrics need."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RequestResult:
    conversation: str
    turn: int  # 0-based turn of its conversation
    start: float  # monotonic send time
    success: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds to the first token
    latency: float = 0.0  # seconds to the last byte
    itl: list = field(default_factory=list)  # seconds between token-bearing chunks
    chunk_times: list = field(default_factory=list)  # monotonic arrival of each chunk
    chunk_tokens: list = field(default_factory=list)  # tokens each chunk carried
    prompt_tokens: int = 0  # as the server counted them (0: not reported)
    cached_tokens: int = 0  # of those, served from resident KV
    output_tokens: int = 0
    text: str = ""  # the reply (multi-turn resends it)

    def add_chunk(self, now: float, tokens: int, text: str) -> None:
        """A token-bearing chunk arrived at `now`: TTFT or an inter-token gap."""
        if not self.chunk_times:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.chunk_times[-1])
        self.chunk_times.append(now)
        self.chunk_tokens.append(tokens)
        self.text += text


class TurbomqBackend:
    """Straight to a broker: `generate(..., stream=True)`; a session turn
    sends only its new message, a resend the whole history."""

    name = "turbomq"

    def __init__(self, broker: list, curve=None, timeout: float = 600.0):
        from turbomq.clients import AsyncClient
        self.client = AsyncClient(broker, timeout=timeout, curve=curve)

    async def send(self, result: RequestResult, *, prompt: Optional[str], messages: Optional[list],
                   session_id: Optional[str], max_tokens: int, sampling: dict) -> RequestResult:
        from turbomq.clients import Delta, TurbomqError

        kwargs = dict(messages=messages) if messages is not None else dict(prompt=prompt)
        try:
            async for ev in self.client.generate(**kwargs, session_id=session_id,
                                                 max_tokens=max_tokens, stream=True, **sampling):
                now = time.monotonic()
                if isinstance(ev, Delta):
                    if ev.token_ids:
                        result.add_chunk(now, len(ev.token_ids), ev.text)
                else:
                    result.latency = now - result.start
                    u = ev.usage
                    result.prompt_tokens, result.cached_tokens = u.prompt_tokens, u.cached_tokens
                    result.output_tokens = u.completion_tokens
                    result.success = True
        except TurbomqError as e:
            result.error = f"{e.code}: {e.message}"
        return result

    async def end_session(self, session_id: str) -> None:
        from turbomq.clients import TurbomqError
        try:
            await self.client.end_session(session_id)
        except TurbomqError:
            pass

    async def close(self) -> None:
        await self.client.close()


class OpenAIBackend:
    """Any OpenAI-compatible server: `/v1/completions` or `/v1/chat/completions`,
    streamed (SSE), with `stream_options.include_usage` for the server's token
    counts. Chat resends the whole history each turn; a session turn adds
    `session_id` (turbomq's gateway keeps the KV; other servers ignore or refuse it)."""

    name = "openai"

    def __init__(self, base_url: str, model: Optional[str], api_key: Optional[str],
                 endpoint: str = "chat", timeout: float = 600.0, max_connections: int = 4096):
        import httpx

        self.base_url = base_url.rstrip("/")
        self.endpoint = endpoint
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            headers=headers, timeout=httpx.Timeout(timeout, connect=30.0),
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections))
        self.model = model

    async def resolve_model(self) -> str:
        import httpx

        if self.model is None:
            try:
                r = await self.http.get(self.base_url + "/models")
                r.raise_for_status()
                self.model = r.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
                raise ValueError(f"cannot list the models at {self.base_url}/models "
                                 f"(give --model): {e}") from None
        return self.model

    async def send(self, result: RequestResult, *, prompt: Optional[str], messages: Optional[list],
                   session_id: Optional[str], max_tokens: int, sampling: dict) -> RequestResult:
        import httpx

        chat = self.endpoint == "chat"
        body: dict = {"model": self.model, "stream": True, "max_tokens": max_tokens,
                      "stream_options": {"include_usage": True}, **sampling}
        if chat:
            body["messages"] = messages if messages is not None else [
                {"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt if prompt is not None else "\n".join(
                m["content"] for m in messages)
        if session_id is not None:
            body["session_id"] = session_id
        url = self.base_url + ("/chat/completions" if chat else "/completions")
        try:
            async with self.http.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")
                    result.error = f"HTTP {r.status_code}: {text[:300]}"
                    return result
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    now = time.monotonic()
                    if "error" in obj:
                        result.error = str(obj["error"].get("message", obj["error"]))
                        return result
                    if obj.get("usage"):
                        u = obj["usage"]
                        result.prompt_tokens = u.get("prompt_tokens") or 0
                        result.output_tokens = u.get("completion_tokens") or 0
                        details = u.get("prompt_tokens_details") or {}
                        result.cached_tokens = details.get("cached_tokens") or 0
                    for choice in obj.get("choices") or ():
                        piece = (choice.get("delta") or {}).get("content") if chat \
                            else choice.get("text")
                        if piece:
                            result.add_chunk(now, 1, piece)
            result.latency = time.monotonic() - result.start
            if not result.output_tokens:  # no usage from the server: count chunks
                result.output_tokens = len(result.chunk_times)
            elif result.chunk_tokens:  # spread the server's count over the chunks
                share = result.output_tokens / len(result.chunk_tokens)
                result.chunk_tokens = [share] * len(result.chunk_tokens)
            result.success = True
        except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
            result.error = f"{type(e).__name__}: {e}"
        return result

    async def end_session(self, session_id: str) -> None:
        pass  # the OpenAI API has no call for it; sessions expire idle

    async def close(self) -> None:
        await self.http.aclose()
