"""Client and AsyncClient against a real broker and echo workers."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import zmq

from turbomq.clients import (AsyncClient, Client, Delta, Final, InvalidRequest, ServerError,
                             Timeout, TurbomqError, errors)

from _service_helpers import Service, expected_echo

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    s = Service(tmp_path_factory.mktemp("client-svc"))
    s.add_worker("w1", slots=4, delay=0.005)
    s.add_worker("w2", slots=4, delay=0.005)
    with Client(s.front, timeout=10) as c:
        s.wait_workers(c, 2)
    yield s
    s.close()


def test_bad_arguments_fail_locally_without_a_broker():
    # Nothing listens here: the errors must come before any send.
    with Client("tcp://127.0.0.1:9", timeout=0.5) as c:
        with pytest.raises(InvalidRequest) as info:
            c.generate("x", max_tokens=0)
        assert info.value.code == "invalid_field" and not info.value.retryable
        with pytest.raises(InvalidRequest):
            c.generate("x", input_ids=[1])
        with pytest.raises(InvalidRequest):
            c.generate("x", top_P=0.5)
        with pytest.raises(Timeout):
            c.health()


def test_error_codes_map_to_exception_types():
    assert isinstance(errors.error_for("overloaded", ""), errors.Overloaded)
    assert isinstance(errors.error_for("no_workers", ""), errors.Unavailable)
    assert isinstance(errors.error_for("prompt_too_long", ""), errors.InvalidRequest)
    assert isinstance(errors.error_for("session_busy", ""), errors.SessionBusy)
    e = errors.error_for("something_new", "m")
    assert isinstance(e, ServerError) and isinstance(e, TurbomqError) and e.code == "something_new"


def test_generate_stream_and_result(svc):
    with Client(svc.front, timeout=10, ping_interval=0.1) as c:
        r = c.generate("hey", max_tokens=5, temperature=0.0, seed=3)
        assert r.token_ids == expected_echo([ord(ch) for ch in "hey"], 5) and r.text == "heyhe"
        assert r.finish_reason == "length" and r.usage.completion_tokens == 5
        events = list(c.generate(input_ids=[40, 41], max_tokens=4, stream=True))
        assert all(isinstance(e, Delta) for e in events[:-1]) and isinstance(events[-1], Final)
        assert "".join(e.text for e in events[:-1]) == "()()"
        # Two interleaved streams on one client each get their own events.
        a = c.generate(input_ids=[1], max_tokens=6, stream=True)
        b = c.generate(input_ids=[2], max_tokens=6, stream=True)
        got_a, got_b = list(a), list(b)
        assert [t for e in got_a[:-1] for t in e.token_ids] == [1] * 6
        assert [t for e in got_b[:-1] for t in e.token_ids] == [2] * 6


def test_closing_a_stream_early_cancels_it(svc):
    with Client(svc.front, timeout=10, ping_interval=0.1) as c:
        before = len(svc.events("cancel"))
        with c.generate(input_ids=[3], max_tokens=5000, stream=True) as s:
            next(s)
        svc.wait_event("cancel", before + 1)
        assert c.generate(input_ids=[5], max_tokens=1).token_ids == [5]  # socket still in sync


def test_chat_session_keeps_its_id(svc):
    with Client(svc.front, timeout=10) as c:
        with c.session(max_tokens=2) as chat:
            chat.send("ab")
            chat.send([7])
            sid = chat.session_id
        assert [e["session_id"] for e in svc.events("dispatch")[-2:]] == [sid, sid]
        assert svc.events("end_session")[-1]["session_id"] == sid


def test_health_and_stats(svc):
    with Client(svc.front) as c:
        h = c.health()
        assert h["status"] == "ok" and h["workers"] == 2
        assert c.stats()["workers_alive"] == 2


def test_async_client_concurrent_requests(svc):
    async def main():
        async with AsyncClient(svc.front, timeout=10, ping_interval=0.1) as c:
            results = await asyncio.gather(*(c.generate(input_ids=[i + 1], max_tokens=3)
                                             for i in range(6)))
            assert [r.token_ids for r in results] == [[i + 1] * 3 for i in range(6)]
            events = [e async for e in c.generate(input_ids=[9, 8], max_tokens=4, stream=True)]
            assert [t for e in events[:-1] for t in e.token_ids] == [9, 8, 9, 8]
            assert events[-1].finish_reason == "length"
            assert (await c.health())["workers"] == 2
            with pytest.raises(InvalidRequest):
                c.generate(input_ids=[1], temperature=-1)
            async with c.session(max_tokens=1) as chat:
                assert (await chat.send([4])).token_ids == [4]
    asyncio.run(main())


def test_async_cancel_racing_a_reply_is_never_swallowed():
    """A request cancelled in the very step its reply lands is cancelled: a
    swallowed cancel (asyncio.wait_for before 3.12) once kept the gateway's
    health loop, and so the gateway, running after SIGTERM."""
    async def main():
        async with AsyncClient("tcp://127.0.0.1:9", timeout=5) as c:
            q: asyncio.Queue = asyncio.Queue()
            waiting = asyncio.ensure_future(c._next("r", q, time.monotonic() + 5))
            await asyncio.sleep(0)  # it waits on the queue now
            q.put_nowait({"kind": "health"})
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            with pytest.raises(Timeout):  # and a deadline still ends the wait
                await c._next("r", asyncio.Queue(), time.monotonic() + 0.05)
    asyncio.run(main())


def test_malformed_reply_becomes_server_error():
    fake = zmq.Context.instance().socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")

    def answer_with_garbage():
        if fake.poll(5000):
            ident, _ = fake.recv_multipart()
            fake.send_multipart([ident, b"\xc1garbage"])

    t = threading.Thread(target=answer_with_garbage)
    t.start()
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=5) as c:
            with pytest.raises(ServerError) as info:
                c.health()
            assert info.value.code == "bad_frame"
    finally:
        t.join()
        fake.close(0)
