"""The OpenAI-compatible gateway end to end: a real broker, a real CPU worker
on the demo model, a real `turbomq gateway` process, and the official
`openai` package (sync, async, streaming, errors). Expected output comes from
the turbomq client through the same broker (greedy)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

import httpx
import openai
import pytest

from conftest import wait_until
from test_service import CHILD_ENV, GREEDY, PY, Cluster
from turbomq.clients import Client
from turbomq.clients.keys import allow_line, new_keypair

MODEL = "demo"
LIFETIME_S = 180


class GatewayProc:
    """A `turbomq gateway` process with a hard lifetime, on a free port."""

    def __init__(self, broker: str, *flags: str):
        cmd = ["timeout", "-s", "KILL", str(LIFETIME_S), PY, "-m", "turbomq.worker.cli",
               "gateway", "--broker", broker, "--port", "0", "--served-model-name", MODEL,
               "--log-level", "WARNING", *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=CHILD_ENV,
                                     start_new_session=True)
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError("the gateway did not start")
        self.url = json.loads(line)["gateway"]

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def wait_workers(self, n: int) -> None:
        def ready() -> bool:
            status, body = self.get("/health")
            return json.loads(body).get("workers") == n
        wait_until(ready, 60, f"the gateway sees {n} worker(s)")

    def metrics(self) -> dict:
        from prometheus_client.parser import text_string_to_metric_families
        out = {}
        for family in text_string_to_metric_families(self.get("/metrics")[1]):
            for s in family.samples:
                out[(s.name,) + tuple(sorted(s.labels.items()))] = s.value
        return out

    def openai(self, key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def async_openai(self, key: str = "none") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One broker, one CPU worker, one gateway (no API keys), shared by the
    tests of this module."""
    svc = Cluster(tmp_path_factory.mktemp("gateway"), client_timeout=30)
    gw = None
    try:
        with Client(svc.front, timeout=60) as client:
            svc.start_workers(client, 1)
        gw = GatewayProc(svc.front)
        gw.wait_workers(1)
        yield svc, gw
    finally:
        if gw is not None:
            gw.close()
        svc.close()


def reference(front: str, **kw) -> tuple[str, dict]:
    with Client(front, timeout=60) as client:
        r = client.generate(**kw, **GREEDY)
    return r.text, r.usage


# ----------------------------------------------------------------- basics
def test_models_health_and_metrics(stack):
    svc, gw = stack
    models = gw.openai().models.list()
    assert [m.id for m in models.data] == [MODEL]
    status, body = gw.get("/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, text = gw.get("/metrics")
    assert status == 200 and "turbomq_gateway_requests_total" in text


def test_completions_and_chat_match_the_client(stack):
    svc, gw = stack
    client = gw.openai()
    want, usage = reference(svc.front, prompt="The lighthouse keeper", max_tokens=12)
    r = client.completions.create(model=MODEL, prompt="The lighthouse keeper", max_tokens=12,
                                  temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == usage_reason(r)
    assert r.usage.prompt_tokens == usage.prompt_tokens
    assert r.usage.completion_tokens == usage.completion_tokens == 12
    assert r.usage.total_tokens == usage.prompt_tokens + 12
    assert r.usage.prompt_tokens_details.cached_tokens == 0

    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Tell me about boats."}]
    want, usage = reference(svc.front, messages=messages, max_tokens=10)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                       temperature=0, seed=3, top_p=1.0, stop=["\x00never"])
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.usage.prompt_tokens == usage.prompt_tokens


def usage_reason(r) -> str:
    return "length" if r.usage.completion_tokens == 12 else "stop"


def test_streaming_sync(stack):
    svc, gw = stack
    client = gw.openai()
    messages = [{"role": "user", "content": "Once upon a time"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == whole.choices[0].finish_reason and not any(reasons[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # without include_usage: no usage chunk
    plain = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                           temperature=0, stream=True))
    assert all(c.choices for c in plain) and plain[-1].choices[0].finish_reason == "length"


def test_async_concurrent_streams(stack):
    svc, gw = stack

    async def one(client, i: int) -> tuple[str, str]:
        prompt = f"Story number {i}:"
        whole = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                temperature=0)
        parts = []
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                 temperature=0, stream=True)
        async for c in stream:
            parts.append(c.choices[0].text)
        return whole.choices[0].text, "".join(parts)

    async def main():
        async with gw.async_openai() as client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))

    for whole, streamed in asyncio.run(main()):
        assert whole == streamed


def test_session_keeps_kv_resident_across_turns(stack):
    svc, gw = stack
    client = gw.openai()
    history = [{"role": "user", "content": "Let us talk about the sea."}]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8,
                                           temperature=0, extra_body={"session_id": "sea"})
    # The client sends the whole history, as OpenAI clients do; the session
    # already holds it up to the last assistant message.
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And the tides?"}]
    second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8,
                                            temperature=0, extra_body={"session_id": "sea"})
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert second.usage.prompt_tokens > cached
    # Without the session, the same history is prefilled from scratch.
    fresh = client.chat.completions.create(model=MODEL, messages=history[:1], max_tokens=8,
                                           temperature=0)
    assert fresh.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens
    with Client(svc.front) as c:
        c.end_session("sea")


# ----------------------------------------------------------------- errors
def test_errors_are_openai_errors(stack):
    svc, gw = stack
    client = gw.openai()
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=msgs)
    assert e.value.code == "model_not_found"
    bad = [dict(temperature=-1), dict(n=2), dict(presence_penalty=0.5),
           dict(frequency_penalty=1.0), dict(logprobs=True, top_logprobs=2),
           dict(extra_body={"top_P": 0.5}), dict(tools=[{"type": "function", "function":
                                                        {"name": "f", "parameters": {}}}]),
           # the engine's own check: a stop token outside the vocabulary
           dict(extra_body={"stop_token_ids": [10 ** 9]})]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, **kw)
        assert e.value.body["message"], kw
    # a deadline that passes on the worker: 504, and the worker is free again
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt="Once", max_tokens=4000, temperature=0,
                                  extra_body={"timeout": 0.05, "ignore_eos": True})
    assert e.value.status_code == 504 and e.value.code == "timeout"
    wait_until(lambda: svc.metrics("w0")[("turbomq_batch_slots_active",)] == 0, 10,
               "the timed-out request left its slot")
    # malformed JSON, by hand: the official package cannot send it
    r = httpx.post(gw.url + "/v1/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_no_capacity_is_503_and_overload_is_429(tmp_path):
    # a second broker, with no queue, and no worker behind it yet
    svc = Cluster(tmp_path, queue_bound=0)
    gw = GatewayProc(svc.front)
    try:
        wait_until(lambda: gw.get("/health")[0] == 503 and
                   json.loads(gw.get("/health")[1])["status"] == "degraded", 20,
                   "the gateway learnt the broker has no worker")
        with pytest.raises(openai.InternalServerError) as e:
            gw.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert e.value.status_code == 503 and e.value.code == "no_capacity"
        # one slot (a model-free echo worker), taken by a stream: the next
        # request finds every worker full and no room to queue
        svc._spawn([PY, "-m", "turbomq.broker.echo_worker", "--broker", svc.back,
                    "--slots", "1", "--delay", "0.05"])
        gw.wait_workers(1)
        client = gw.openai()
        stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4000,
                                           stream=True)
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert e.value.status_code == 429 and e.value.code == "overloaded"
        stream.close()
    finally:
        gw.close()
        svc.close()


def test_disconnect_cancels_on_the_worker(stack):
    svc, gw = stack
    before = svc.metrics("w0")[("turbomq_requests_finished_total", ("reason", "cancelled"))]
    client = gw.openai()
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4000,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert svc.metrics("w0")[("turbomq_batch_slots_active",)] == 1
    stream.close()  # the HTTP connection closes mid-stream

    def freed() -> bool:
        m = svc.metrics("w0")
        return (m[("turbomq_batch_slots_active",)] == 0 and
                m[("turbomq_requests_finished_total", ("reason", "cancelled"))] == before + 1)

    wait_until(freed, 15, "the worker cancelled the abandoned stream")
    assert svc.metrics("w0")[("turbomq_generated_tokens_total",)] < 4000
    m = gw.metrics()
    assert m[("turbomq_gateway_client_disconnects_total",)] >= 1
    assert m[("turbomq_gateway_requests_total", ("endpoint", "completions"),
              ("status", "499"))] >= 1
    assert m[("turbomq_gateway_requests_in_flight",)] == 0


def test_disconnect_cancels_a_non_streaming_request(stack):
    svc, gw = stack
    before = svc.metrics("w0")[("turbomq_requests_finished_total", ("reason", "cancelled"))]
    # The client gives up waiting (its own timeout) and closes the connection.
    client = gw.openai(timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4000,
                                  temperature=0, extra_body={"ignore_eos": True})

    def freed() -> bool:
        m = svc.metrics("w0")
        return (m[("turbomq_batch_slots_active",)] == 0 and
                m[("turbomq_requests_finished_total", ("reason", "cancelled"))] == before + 1)

    wait_until(freed, 15, "the worker cancelled the abandoned request")
    assert gw.metrics()[("turbomq_gateway_requests_in_flight",)] == 0


# ---------------------------------------------------------------- tenants
def test_api_keys_map_to_tenants_over_curve(tmp_path):
    keys = tmp_path / "keys"
    made = {n: new_keypair(keys, n) for n in ("broker", "w0", "tenant-a", "tenant-b")}
    (keys / "workers.allow").write_text(allow_line(made["w0"][0]) + "\n")
    (keys / "clients.allow").write_text(allow_line(made["tenant-a"][0]) + "\n" +
                                        allow_line(made["tenant-b"][0]) + "\n")
    key_a, key_b = "sk-alpha-0123456789abcdef", "sk-bravo-0123456789abcdef"
    api_keys = tmp_path / "api.keys"
    api_keys.write_text(f"# tenant key\ntenant-a {key_a}\ntenant-b {key_b}\n")
    svc = Cluster(tmp_path, curve_secret=keys / "broker.key_secret",
                  client_keys=keys / "clients.allow", worker_keys=keys / "workers.allow",
                  tenant_max_inflight=1)
    gw = None
    try:
        svc.start_worker("w0", extra=("--curve-secret", str(keys / "w0.key_secret"),
                                      "--broker-key", str(keys / "broker.key")))
        svc.wait_ready("w0")
        gw = GatewayProc(svc.front, "--api-keys", str(api_keys), "--tenant-keys", str(keys),
                         "--broker-key", str(keys / "broker.key"))
        gw.wait_workers(1)
        with pytest.raises(openai.AuthenticationError) as e:
            gw.openai("sk-wrong-0123456789abcdef").models.list()
        assert e.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            gw.openai().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        a, b = gw.openai(key_a), gw.openai(key_b)
        chat = lambda c, text: c.completions.create(  # noqa: E731
            model=MODEL, prompt=text, max_tokens=6, temperature=0,
            extra_body={"session_id": "chat"})
        a1 = chat(a, "The glacier moved an inch a year.")
        a2 = chat(a, " Below it the valley waited")
        b1 = chat(b, " Below it the valley waited")
        # the same session id, two sessions: B's turn sees none of A's history
        assert a2.usage.prompt_tokens > a1.usage.prompt_tokens + a1.usage.completion_tokens
        assert b1.usage.prompt_tokens < a2.usage.prompt_tokens - a1.usage.prompt_tokens
        assert b1.usage.prompt_tokens_details.cached_tokens == 0
        # each tenant's limits are its own: A at its one request in flight gets
        # 429 while B is served
        stream = a.completions.create(model=MODEL, prompt="Once", max_tokens=4000,
                                      temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as e:
            a.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert e.value.code == "rate_limited"
        assert b.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage
        stream.close()
    finally:
        if gw is not None:
            gw.close()
        svc.close()


def test_plain_broker_refuses_several_tenants(tmp_path):
    api_keys = tmp_path / "api.keys"
    api_keys.write_text("tenant-a sk-alpha-0123456789abcdef\ntenant-b sk-bravo-0123456789abcdef\n")
    out = subprocess.run([PY, "-m", "turbomq.worker.cli", "gateway", "--broker",
                          "tcp://127.0.0.1:1", "--port", "0", "--api-keys", str(api_keys)],
                         capture_output=True, text=True, timeout=60, env=CHILD_ENV)
    assert out.returncode == 2
    assert "plain broker sees every client as one tenant" in out.stderr


def test_sigterm_cuts_a_stalled_stream_after_the_grace(tmp_path):
    """SIGTERM while a stream is in flight whose client reads nothing: the
    gateway lets it run for --shutdown-grace seconds, then cuts it and exits
    (it used to wait for the stream to end, minutes here)."""
    svc = Cluster(tmp_path)
    svc._spawn([PY, "-m", "turbomq.broker.echo_worker", "--broker", svc.back,
                "--slots", "1", "--delay", "0.05"])
    gw = GatewayProc(svc.front, "--shutdown-grace", "1")
    sock = None
    try:
        gw.wait_workers(1)
        url = urlparse(gw.url)
        body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 4000, "stream": True})
        sock = socket.create_connection((url.hostname, url.port))
        sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
                      "Content-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
        wait_until(lambda: gw.metrics()[("turbomq_gateway_requests_in_flight",)] == 1, 20,
                   "the stream is in flight")
        start = time.monotonic()
        os.killpg(gw.proc.pid, signal.SIGTERM)
        gw.proc.wait(20)  # TimeoutExpired: it waited for the stream to end
        assert time.monotonic() - start < 10
    finally:
        if sock is not None:
            sock.close()
        gw.close()
        svc.close()
