"""The broker with echo workers, all real processes on loopback sockets."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time

import msgpack
import pytest
import zmq

from turbomq.clients import AsyncClient, Client, Delta, Final, Overloaded, Timeout, UnknownSession
from turbomq.clients import protocol as P

from _service_helpers import Service, expected_echo

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def service(tmp_path):
    services = []

    def start(**broker_flags) -> Service:
        folder = tmp_path / f"svc{len(services)}"
        folder.mkdir()
        s = Service(folder, **broker_flags)
        services.append(s)
        return s

    yield start
    for s in services:
        s.close()


@pytest.fixture
def client_for():
    clients = []

    def make(svc: Service, **kw) -> Client:
        c = Client(svc.front, timeout=kw.pop("timeout", 10.0), ping_interval=0.1, **kw)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


def test_routes_by_load_and_queues(service, client_for):
    # The free-capacity rule alone (prefix routing: tests/broker/test_prefix_routing.py).
    svc = service(**{"prefix-routing": "off"})
    svc.add_worker("w1", slots=2, delay=0.02)
    svc.add_worker("w2", slots=2, delay=0.02)
    c = client_for(svc)
    svc.wait_workers(c, 2)
    streams = [c.generate(input_ids=[i + 1, 7], max_tokens=10, stream=True) for i in range(6)]
    # Same socket, so the broker has seen all six before this.
    assert c.stats()["queue_depth"] == 2
    results = {}
    for s in streams:
        events = list(s)
        results[s.request_id] = [t for e in events[:-1] for t in e.token_ids]
        assert events[-1].finish_reason == "length"
    for i, s in enumerate(streams):
        assert results[s.request_id] == expected_echo([i + 1, 7], 10)
    first_four = sorted(svc.events("dispatch"), key=lambda e: int(e["request_id"], 16))[:4]
    # The most free slots wins: the first four alternate between the workers.
    assert sorted(e["worker_id"] for e in first_four) == ["w1", "w1", "w2", "w2"]
    stats = c.stats()
    assert stats["routing"]["stateless"] == 6
    assert stats["requests_by_outcome"]["completed"] == 6
    assert stats["queue_depth"] == 0 and stats["inflight"] == 0


def test_session_affinity_then_moved_when_owner_full(service, client_for):
    svc = service()
    svc.add_worker("w1", slots=1, delay=0.05)
    svc.add_worker("w2", slots=1, delay=0.05)
    c = client_for(svc)
    svc.wait_workers(c, 2)
    chat = c.session("chat-1", max_tokens=2)
    chat.send([5, 6])
    chat.send([5, 6])
    owner = svc.events("dispatch")[-1]["worker_id"]
    assert [e["worker_id"] for e in svc.events("dispatch")] == [owner, owner]
    # Occupy the owner's only slot, then the session must move.
    blocker = None
    for attempt in range(8):  # each prompt its own key (prefix routing): one lands there
        s = c.generate(input_ids=[1 + attempt], max_tokens=40, stream=True)
        next(s)
        if svc.events("dispatch")[-1]["worker_id"] == owner:
            blocker = s
            break
        s.close()
        time.sleep(0.3)  # let the cancel free that slot
    assert blocker is not None
    chat.send([5, 6])
    assert svc.events("dispatch")[-1]["worker_id"] != owner
    blocker.close()
    routing = c.stats()["routing"]
    assert routing["new"] == 1 and routing["affinity"] == 1 and routing["moved"] == 1
    chat.end()
    assert svc.events("end_session")[-1]["worker_id"] != owner  # where it last ran
    with pytest.raises(UnknownSession):
        c.end_session("never-existed")


def test_overloaded_past_queue_bound(service, client_for):
    svc = service(**{"queue-bound": 1})
    svc.add_worker("w1", slots=1, delay=0.02)
    c = client_for(svc)
    svc.wait_workers(c, 1)
    running = c.generate(input_ids=[1], max_tokens=15, stream=True)
    queued = c.generate(input_ids=[2], max_tokens=3, stream=True)
    with pytest.raises(Overloaded) as info:
        c.generate(input_ids=[3], max_tokens=3)
    assert info.value.retryable and info.value.code == "overloaded"
    assert list(running)[-1].finish_reason == "length"
    assert [t for e in list(queued)[:-1] for t in e.token_ids] == [2, 2, 2]
    assert c.stats()["requests_by_outcome"]["overloaded"] == 1


def test_cancel_is_forwarded(service, client_for):
    svc = service()
    svc.add_worker("w1", slots=2, delay=0.02)
    c = client_for(svc)
    svc.wait_workers(c, 1)
    stream = c.generate(input_ids=[9], max_tokens=200, stream=True)
    first = [next(stream), next(stream)]
    stream.cancel()
    rest = list(stream)
    final = rest[-1]
    assert final.finish_reason == "cancelled"
    assert final.usage.completion_tokens < 200
    assert svc.wait_event("cancel")[0]["request_id"] == svc.events("dispatch")[0]["request_id"]
    indices = [e.index for e in first + rest[:-1]]
    assert indices == list(range(len(indices)))
    assert c.stats()["requests_by_outcome"]["cancelled"] == 1


def test_client_disconnect_and_silence_cancel(service, client_for):
    svc = service(**{"client-timeout": 0.5})
    svc.add_worker("w1", slots=4, delay=0.02)
    c = client_for(svc)
    svc.wait_workers(c, 1)
    ctx = zmq.Context.instance()
    # 1) a streaming client that closes its socket: the next delta finds it gone.
    gone = ctx.socket(zmq.DEALER)
    gone.connect(svc.front)
    gone.send(P.pack(P.generate("r1", input_ids=[1], params={"max_tokens": 500}, stream=True)))
    assert gone.poll(5000)
    gone.recv()
    gone.close(0)
    svc.wait_event("cancel", 1)
    # 2) a non-streaming client that stops sending pings.
    silent = ctx.socket(zmq.DEALER)
    silent.setsockopt(zmq.LINGER, 0)
    silent.connect(svc.front)
    silent.send(P.pack(P.generate("r2", input_ids=[2], params={"max_tokens": 500})))
    cancels = svc.wait_event("cancel", 2, within=5.0)
    silent.close(0)
    assert {e["request_id"] for e in cancels} == {e["request_id"] for e in svc.events("dispatch")}
    assert c.stats()["requests_by_outcome"]["client_gone"] == 2


def test_deadline_cancels_with_timeout(service, client_for):
    svc = service()
    svc.add_worker("w1", slots=1, delay=0.05)
    c = client_for(svc)
    svc.wait_workers(c, 1)
    with pytest.raises(Timeout) as info:
        c.generate(input_ids=[1], max_tokens=1000, timeout=0.3)
    assert info.value.code == "timeout"
    svc.wait_event("cancel")
    assert c.generate(input_ids=[4], max_tokens=2).token_ids == [4, 4]  # the slot came back


def test_sigkill_mid_stream_resumes_without_gap_or_duplicate(service, client_for):
    svc = service()
    svc.add_worker("w1", slots=2, delay=0.02)
    svc.add_worker("w2", slots=2, delay=0.02)
    c = client_for(svc)
    svc.wait_workers(c, 2)
    source = [11, 12, 13]
    stream = c.generate(input_ids=source, max_tokens=60, stream=True)
    events = [next(stream) for _ in range(10)]
    victim = svc.events("dispatch")[0]["worker_id"]
    svc.kill_worker(victim)
    events += list(stream)
    final, deltas = events[-1], events[:-1]
    assert final.finish_reason == "length" and final.usage.completion_tokens == 60
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    assert [d.index for d in deltas] == list(range(60))
    assert [t for d in deltas for t in d.token_ids] == expected_echo(source, 60)
    second = svc.events("dispatch")[1]
    assert second["worker_id"] != victim and second["attempt"] == 2 and second["resume"] >= 10
    stats = c.stats()
    assert stats["redispatches_resumed"] == 1 and stats["workers_lost"] == 1


def test_crash_before_and_during_non_streaming(service, client_for):
    svc = service()
    # The crashing worker has the most free slots, so it is picked first.
    svc.add_worker("crashy", slots=8, delay=0.0, die_after=3)
    svc.add_worker("steady", slots=1, delay=0.0)
    c = client_for(svc)
    svc.wait_workers(c, 2)
    result = c.generate(input_ids=[3, 4], max_tokens=20)
    assert result.token_ids == expected_echo([3, 4], 20)
    assert result.text == "".join(chr(t) if t >= 32 else f"<{t}>" for t in result.token_ids)
    assert result.usage.completion_tokens == 20
    attempts = [(e["worker_id"], e["attempt"]) for e in svc.events("dispatch")]
    assert attempts == [("crashy", 1), ("steady", 2)]


def test_no_worker_window_waits_for_a_worker(service, client_for):
    # The only worker dies mid-stream: the request waits in the queue, and so
    # does a new one, until a worker comes back; both then complete in full.
    svc = service()
    svc.add_worker("first", slots=2, delay=0.02)
    c = client_for(svc, timeout=20.0)
    svc.wait_workers(c, 1)
    stream = c.generate(input_ids=[1, 2, 3], max_tokens=60, stream=True)
    first = next(stream)
    svc.kill_worker("first")
    c2 = client_for(svc, timeout=20.0)
    waiting = c2.generate(input_ids=[7], max_tokens=5, stream=True)
    time.sleep(1.0)  # no worker at all for a while
    assert c2.health()["workers"] == 0
    svc.add_worker("second", slots=2, delay=0.0)
    events = [first] + list(stream)
    deltas = [e for e in events if isinstance(e, Delta)]
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == expected_echo([1, 2, 3], 60)
    assert isinstance(events[-1], Final) and events[-1].finish_reason == "length"
    assert [t for e in waiting if isinstance(e, Delta) for t in e.token_ids] == [7] * 5
    stats = c.stats()
    assert stats["redispatches"] >= 1 and stats["requests_by_outcome"]["completed"] == 2


def test_no_worker_deadline_ends_with_timeout(service, client_for):
    svc = service()
    c = client_for(svc, timeout=10.0)
    with pytest.raises(Timeout) as info:
        c.generate(input_ids=[1], max_tokens=3, timeout=0.5)
    assert info.value.code == "timeout"


def test_broker_restart_resumes_streams_without_gap_or_duplicate(service, client_for):
    # SIGKILL the broker mid-stream and start a new one on the same ports:
    # the clients notice (a pong from another broker id), send again with the
    # tokens they have, and every stream ends complete and contiguous.
    svc = service()
    svc.add_worker("w", slots=8, delay=0.03)
    clients = [client_for(svc, timeout=20.0) for _ in range(4)]
    svc.wait_workers(clients[0], 1)
    streams = [c.generate(input_ids=[i + 1, i + 2], max_tokens=40, stream=True)
               for i, c in enumerate(clients[:3])]
    plain_source = [9, 8, 7]
    firsts = [next(s) for s in streams]
    svc.restart_broker(down_s=0.3)
    result = clients[3].generate(input_ids=plain_source, max_tokens=12)  # sent after the kill
    assert result.token_ids == expected_echo(plain_source, 12)
    for i, (stream, first) in enumerate(zip(streams, firsts)):
        events = [first] + list(stream)
        deltas = [e for e in events if isinstance(e, Delta)]
        assert [d.seq for d in deltas] == list(range(len(deltas)))
        assert [d.index for d in deltas] == [sum(len(x.token_ids) for x in deltas[:k])
                                             for k in range(len(deltas))]
        assert [t for d in deltas for t in d.token_ids] == expected_echo([i + 1, i + 2], 40)
        assert events[-1].finish_reason == "length" and events[-1].usage.completion_tokens == 40
    stats = clients[0].stats()  # the new broker's
    assert stats["requests_resumed"] >= 3


def test_async_client_fails_over_to_the_other_broker(service, client_for):
    # Two brokers with the same echo worker behind both; the async client
    # streams through the first, which is SIGKILLed: the stream ends
    # complete through the second.
    svc = service()
    other = service()
    svc.add_worker("w", slots=4, delay=0.03)
    other.workers["w"] = svc._spawn([sys.executable, "-m", "turbomq.broker.echo_worker",
                                     "--broker", other.back, "--worker-id", "w2",
                                     "--slots", "4", "--delay", "0.03"])
    svc.wait_workers(client_for(svc), 1)
    other.wait_workers(client_for(other), 1)

    async def run() -> list:
        async with AsyncClient([svc.front, other.front], timeout=20.0, ping_interval=0.1) as c:
            events = []
            async for event in await_stream(c):
                events.append(event)
                if len(events) == 3:
                    os.killpg(svc.broker.pid, signal.SIGKILL)
            assert c.watch.failovers == 1
            return events

    def await_stream(c):
        return c.generate(input_ids=[4, 5], max_tokens=50, stream=True)

    events = asyncio.run(run())
    deltas = [e for e in events if isinstance(e, Delta)]
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    assert [t for d in deltas for t in d.token_ids] == expected_echo([4, 5], 50)
    assert isinstance(events[-1], Final) and events[-1].usage.completion_tokens == 50


def test_stalled_worker_never_delivers_twice_or_out_of_order(service, client_for):
    # SIGSTOP the worker running a stream past its liveness, SIGCONT it after
    # the broker moved the stream: whatever the old attempt sends then is
    # dropped, and the stream stays contiguous. Routed by free slots, so the
    # stream goes to the worker with more of them.
    svc = service(**{"prefix-routing": "off"})
    svc.add_worker("stalls", slots=4, delay=0.02)
    c = client_for(svc, timeout=20.0)
    svc.wait_workers(c, 1)
    svc.add_worker("steady", slots=1, delay=0.02)  # fewer free slots: picked second
    svc.wait_workers(c, 2)
    stream = c.generate(input_ids=[5, 6, 7], max_tokens=80, stream=True)
    events = [next(stream) for _ in range(3)]
    pid = svc.workers["stalls"].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(1.2)  # past heartbeat_interval * liveness (0.5 s): re-dispatched
    finally:
        os.kill(pid, signal.SIGCONT)
    events += list(stream)
    deltas = [e for e in events if isinstance(e, Delta)]
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    assert [t for d in deltas for t in d.token_ids] == expected_echo([5, 6, 7], 80)
    assert events[-1].usage.completion_tokens == 80
    stats = c.stats()
    assert stats["redispatches_resumed"] >= 1
    # It was dropped, came back (its late deltas answered with reconnect, not
    # forwarded) and registered again.
    assert stats["workers_lost"] == 1
    wait_for = time.monotonic() + 5
    while c.stats()["workers_registered"] < 3 and time.monotonic() < wait_for:
        time.sleep(0.05)
    assert c.stats()["workers_registered"] == 3


def _map_with_repeated_key(pairs: list) -> bytes:
    """A msgpack map written pair by pair, so a key may repeat."""
    packer = msgpack.Packer(use_bin_type=True)
    return packer.pack_map_header(len(pairs)) + b"".join(
        packer.pack(k) + packer.pack(v) for k, v in pairs)


def test_repeated_keys_and_near_limit_frames_get_a_clear_error(service, client_for):
    # Three frames that once got no answer, or two verdicts: each is now
    # answered with an error at once, and the broker serves on.
    svc = service(**{"max-frame-bytes": 4096})
    svc.add_worker("w", slots=2)
    c = client_for(svc)
    svc.wait_workers(c, 1)
    deep: object = 1
    for _ in range(40):
        deep = [deep]
    base = [("v", 1), ("kind", "generate"), ("request_id", "r"), ("input_ids", [1, 2])]
    frames = [
        # the first copy of a repeated key nests deeper than the native reader goes
        _map_with_repeated_key(base + [("params", {"stop": deep}), ("params", {"max_tokens": 2})]),
        # the first copy holds a map with a non-string key
        _map_with_repeated_key(base + [("params", {1: 2}), ("params", {"max_tokens": 2})]),
        # a generate a few bytes under the limit: the broker's dispatch would be over it
        P.pack(P.generate("r", prompt="x" * (4096 - 75), params={"max_tokens": 2})),
    ]
    assert len(frames[2]) <= 4096
    for frame in frames:
        [reply] = raw_replies(svc.front, [frame], 1)
        assert reply["kind"] == "error", reply
    assert [r["code"] for r in (raw_replies(svc.front, [f], 1)[0] for f in frames)] == \
        ["bad_frame", "bad_frame", "frame_too_large"]
    assert c.generate(input_ids=[3], max_tokens=2).token_ids == [3, 3]
    assert c.stats()["inflight"] == 0  # no slot held by any of them


def raw_replies(front: str, frames: list, n: int, within: float = 5.0) -> list:
    """Send frames on a bare DEALER and read n replies (no client-side retries)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(front)
    try:
        for f in frames:
            sock.send(f)
        out = []
        while len(out) < n and sock.poll(within * 1000):
            out.append(P.decode_client_reply(sock.recv()))
        return out
    finally:
        sock.close(0)


def test_fail_fast_refuses_without_workers(service, client_for):
    svc = service(**{"fail-fast": True})
    svc.add_worker("only", slots=1, delay=0.05)
    c = client_for(svc)
    svc.wait_workers(c, 1)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(svc.front)
    sock.send(P.pack(P.generate("a", input_ids=[1], params={"max_tokens": 100}, stream=True)))
    assert P.decode_client_reply(sock.recv())["kind"] == "delta"
    svc.kill_worker("only")
    while (msg := P.decode_client_reply(sock.recv()))["kind"] == "delta":
        pass
    sock.close(0)
    assert msg["kind"] == "error" and msg["code"] == "worker_lost" and msg["retryable"]
    [reply] = raw_replies(svc.front, [P.pack(P.generate("b", input_ids=[1]))], 1)
    assert reply["kind"] == "error" and reply["code"] == "no_workers"


def _malformed_frames(rng: random.Random) -> list:
    valid = P.generate("ok", input_ids=[1, 2], params={"max_tokens": 2})
    frames = [rng.randbytes(rng.randint(0, 64)) for _ in range(60)]
    frames += [msgpack.packb(x) for x in (None, 1, "generate", [1, 2], {"v": 1}, {"kind": "x"},
                                          {"v": 2, "kind": "generate"}, {"v": "1", "kind": "health"},
                                          {"v": 1, "kind": "nope", "request_id": "a"})]
    for _ in range(60):
        m = dict(valid)
        key = rng.choice(list(m))
        m[key] = rng.choice([None, -1, 2 ** 40, "x" * 300, [1.5], {"a": 1}, b"\x00", True])
        frame = msgpack.packb(m, use_bin_type=True)
        try:
            P.decode_client_request(frame)
        except P.ProtocolError:
            frames.append(frame)  # only the ones that are really malformed
    frames.append(P.pack({**valid, "input_ids": list(range(400_000))}))  # > 1 MiB
    return frames


def test_front_fuzz_then_valid_request(service, client_for):
    svc = service()
    svc.add_worker("w1", slots=2)
    c = client_for(svc)
    svc.wait_workers(c, 1)
    frames = _malformed_frames(random.Random(1234))
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(svc.front)
    for f in frames:
        sock.send(f)
    sock.send_multipart([b"two", b"frames"])
    replies = []
    deadline = time.monotonic() + 10
    while len(replies) < len(frames) + 1 and time.monotonic() < deadline:
        if sock.poll(200):
            replies.append(P.decode_client_reply(sock.recv()))
    sock.close(0)
    assert len(replies) == len(frames) + 1
    assert all(r["kind"] == "error" and r["code"] in P.ALL_CODES for r in replies)
    assert {"bad_frame", "bad_version", "unknown_kind", "invalid_field",
            "frame_too_large"} <= {r["code"] for r in replies}
    assert c.generate(input_ids=[8], max_tokens=3).token_ids == [8, 8, 8]
    assert sum(c.stats()["frames_rejected"].values()) == len(frames) + 1


def test_without_spinning(service, client_for):
    """--spin-us 0: the loop blocks in poll right after each burst."""
    svc = service(**{"spin-us": 0})
    svc.add_worker("w1", slots=2)
    c = client_for(svc)
    svc.wait_workers(c, 1)
    assert c.generate(input_ids=[3, 4], max_tokens=5).token_ids == expected_echo([3, 4], 5)
    events = list(c.generate(input_ids=[9], max_tokens=3, stream=True))
    assert [t for e in events[:-1] for t in e.token_ids] == [9, 9, 9]
    time.sleep(1.0)  # several liveness spans: heartbeats keep going while idle
    assert c.health()["workers"] == 1


def test_malformed_worker_frames_are_counted_and_dropped(service, client_for):
    svc = service()
    c = client_for(svc)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(svc.back)
    sock.send(P.pack(P.register("raw", "m", 1, 10)))
    assert sock.poll(5000) and P.decode_broker_command(sock.recv())["kind"] == "registered"
    usage = P.usage(1, 0, 1)
    bad = [b"\xc1", P.pack(P.worker_delta("k", 1, 0, [-1], "x")),
           P.pack({**P.worker_delta("k", 1, 0, [1], "x"), "extra": 1}),
           P.pack(P.worker_final("k", 1, "exploded", usage, [], "")),
           P.pack({**P.worker_final("k", 1, "stop", usage, [], ""), "usage": {"x": 1}}),
           P.pack({**P.worker_delta("k", 1, 0, [1], "x"), "text": msgpack.ExtType(1, b"")})]
    for frame in bad:
        sock.send(frame)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if sum(c.stats()["worker_frames_rejected"].values()) == len(bad):
            break
        time.sleep(0.05)
    assert sum(c.stats()["worker_frames_rejected"].values()) == len(bad)
    # The broker goes on (registered again, as this raw worker does not heartbeat):
    # a well-formed final for an unknown request is stale, not an error.
    sock.send(P.pack(P.register("raw", "m", 1, 10)))
    while sock.poll(5000) and P.decode_broker_command(sock.recv())["kind"] != "registered":
        pass
    sock.send(P.pack(P.worker_final("k", 1, "stop", usage, [], "")))
    deadline = time.monotonic() + 5
    while c.stats()["stale_dropped"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.stats()["stale_dropped"] == 1
    sock.close(0)


def test_unknown_worker_is_told_to_reconnect(service):
    svc = service()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(svc.back)
    sock.send(P.pack(P.heartbeat(free_slots=1, free_kv_blocks=1, queue_len=0)))
    assert sock.poll(5000)
    assert P.decode_broker_command(sock.recv())["kind"] == "reconnect"
    sock.send(P.pack(P.register("raw", "m", 1, 10)))
    assert sock.poll(5000)
    reg = P.decode_broker_command(sock.recv())
    assert reg["kind"] == "registered" and reg["heartbeat_interval"] == 0.1
    sock.close(0)


def test_broker_and_client_do_not_import_torch():
    import subprocess
    code = ("import sys, turbomq.broker, turbomq.broker.echo_worker, turbomq.clients; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 0


def test_back_socket_fuzz_from_rogue_dealers_harms_nothing(service, client_for):
    # Fuzz frames at the back from a DEALER that never registered and from
    # one that did: dropped and counted; the broker serves on, and nothing a
    # rogue sends reaches a client.
    from protocol_corpus import fuzz_frames

    svc = service()
    svc.add_worker("w", slots=2)
    c = client_for(svc)
    svc.wait_workers(c, 1)
    ctx = zmq.Context.instance()
    socks = [ctx.socket(zmq.DEALER) for _ in range(2)]
    for s in socks:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(svc.back)
    socks[1].send(P.pack(P.register("rogue", "echo", 0, 0)))  # registered, with no slots
    frames = [f for f in fuzz_frames(random.Random(29)) if isinstance(f, bytes)][:3000]
    for i, frame in enumerate(frames):
        socks[i % 2].send(frame)
    socks[1].send(P.pack(P.worker_final("k1", 1, "stop", P.usage(1, 0, 1), [5], "x")))
    time.sleep(0.5)
    assert c.generate(input_ids=[4, 2], max_tokens=4).token_ids == [4, 2, 4, 2]
    stats = c.stats()
    assert sum(stats["worker_frames_rejected"].values()) > 100
    assert stats["requests_by_outcome"] == {"completed": 1}
    for s in socks:
        s.close(0)
