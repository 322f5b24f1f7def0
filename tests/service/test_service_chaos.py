"""Faults under load, with real processes: a worker SIGKILLed mid-stream and
Redis stopped and restarted mid-run. The fixtures and the reference
(fault-free, greedy) come from test_service."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from conftest import wait_until

from test_service import (GREEDY, client_for, cluster, expected_session,  # noqa: F401 (fixtures)
                          expected_tokens, read_stream, read_streams_killing_a_worker,
                          reference_engine)
from turbomq.worker import SamplingParams
from turbomq.clients import Unavailable
from turbomq.clients import protocol as P
from turbomq.worker.service.loop import session_key
from turbomq.worker.service.redis_store import RedisSessionStore


def test_sigkill_mid_stream_every_stream_completes_unchanged(cluster, client_for):
    svc = cluster()
    client = client_for(svc.front)
    # Every stream has a slot from the start: the reader takes the streams in
    # turn, so a queued one would hold it back until the others had finished.
    svc.start_workers(client, 2, slots=10)
    prompts = [f"Request {i}: the lighthouse keeper" for i in range(16)]
    # Long enough that the workers are still generating when the reader,
    # which may get little CPU on a loaded machine, has seen 2 tokens of 12.
    n = 320
    want = expected_tokens(prompts, n, ignore_eos=True)
    streams = [client.generate(p, max_tokens=n, ignore_eos=True, stream=True, **GREEDY)
               for p in prompts]
    tokens, finals = read_streams_killing_a_worker(svc, streams, 12, 2)
    assert all(f.finish_reason == "length" and f.usage.completion_tokens == n for f in finals)
    assert tokens == want
    stats = client.stats()
    assert stats["workers_lost"] == 1 and stats["redispatches_resumed"] >= 1
    assert stats["requests_by_outcome"]["completed"] == 16


def test_redis_down_then_back(cluster, client_for, redis_server):
    svc = cluster(redis_server.url)
    client = client_for(svc.front)
    svc.start_workers(client, 2)
    turns = ["The railway station was quiet.", " A porter swept the platform",
             " The timetable promised a train", " It arrived on time"]
    want = expected_session("ref-chaos", turns, 6)
    session = client.session("chat", max_tokens=6, **GREEDY)
    acknowledged = [session.send(turns[0]).token_ids, session.send(turns[1]).token_ids]
    assert acknowledged == want[:2]

    redis_server.kill()
    # The worker answers a session turn with the retryable
    # session_store_unavailable (a bare socket sees it) ...
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(svc.front)
    sock.send(P.pack(P.generate("raw", prompt=turns[2], session_id="chat",
                                params={"max_tokens": 6, **GREEDY})))
    assert sock.poll(10_000), "no answer while Redis is down"
    reply = P.decode_client_reply(sock.recv())
    sock.close(0)
    assert reply["kind"] == "error" and reply["code"] == "session_store_unavailable"
    assert reply["retryable"]
    with pytest.raises(Unavailable) as e:
        client.end_session("other")
    assert e.value.code == "session_store_unavailable"
    # Stateless requests do not need Redis.
    assert client.generate(turns[2], max_tokens=6, **GREEDY).token_ids == expected_tokens([turns[2]], 6)[0]

    # ... and the client library retries it until its deadline: the turn waits
    # for Redis instead of failing.
    box = []
    waiting = threading.Thread(target=lambda: box.append(session.send(turns[2]).token_ids))
    waiting.start()
    time.sleep(1.5)
    assert waiting.is_alive() and not box
    redis_server.start()
    waiting.join(30)
    assert box == [want[2]]  # both acknowledged turns were still there
    assert session.send(turns[3]).token_ids == want[3]
    store = RedisSessionStore(redis_server.url, model_id="demo")
    try:
        history = store.get_tokens(session_key("", "chat"))  # plain mode: tenant ""
    finally:
        store.close()
    assert history is not None and history[-6:] == want[3]
    assert all(svc.workers[w].poll() is None for w in ("w0", "w1"))


def test_broker_restart_mid_turn_every_turn_once(cluster, client_for, redis_server):
    # The broker is SIGKILLed while session turns stream, and a new one starts
    # on the same ports: every turn completes with the fault-free tokens, no
    # stream has a gap or repeat, and each turn is in the session once.
    svc = cluster(redis_server.url)
    client = client_for(svc.front)
    svc.start_workers(client, 2)
    turns = ["The orchard was heavy with fruit.", " A ladder leaned on the oldest tree",
             " By noon the baskets were full"]
    names = [f"orchard-{i}" for i in range(6)]
    # Even sessions greedy, odd ones seeded sampling: both continue exactly.
    sampling = [GREEDY if i % 2 == 0 else {"temperature": 0.9, "top_k": 50, "seed": 11}
                for i in range(len(names))]
    want = [expected_session(f"ref-restart-{i % 2}", turns, 24, sampling[i])
            for i in range(len(names))]
    sessions = [client_for(svc.front).session(name, max_tokens=24, **sampling[i])
                for i, name in enumerate(names)]
    for chat, w in zip(sessions, want):
        assert chat.send(turns[0]).token_ids == w[0]
    streams = [chat.send(turns[1], stream=True) for chat in sessions]
    firsts = [next(s) for s in streams]  # every turn is running
    svc.restart_broker(down_s=0.2)
    for stream, first, w in zip(streams, firsts, want):
        tokens, final = read_stream(_chain(first, stream))
        assert tokens == w[1] and final.finish_reason in ("length", "stop")
    for chat, w in zip(sessions, want):
        assert chat.send(turns[2]).token_ids == w[2]
    # The new broker learned where each session's KV is from heartbeats.
    assert client.stats()["routing"].get("affinity", 0) >= len(names)
    store = RedisSessionStore(redis_server.url, model_id="demo")
    try:
        histories = [store.get_tokens(session_key("", name)) for name in names]
    finally:
        store.close()
    reference = reference_engine()
    for kind in (0, 1):
        for turn in turns:
            reference.generate(prompts=turn, session_id=f"ref-history-{kind}",
                               params=SamplingParams(max_tokens=24, **sampling[kind]))
    want_history = [reference.session_store.get_tokens(f"ref-history-{i % 2}")
                    for i in range(len(names))]
    for kind in (0, 1):
        reference.end_session(f"ref-history-{kind}")
    assert histories == want_history  # every turn in each session once


def _chain(first, rest):
    yield first
    yield from rest


def test_broker_pair_loses_one_broker_and_gets_it_back(cluster, client_for, redis_server):
    # Two brokers, active-active: every worker registers with both, the client
    # knows both fronts. SIGKILL the one carrying the turns: every turn ends
    # complete through the other. The killed one restarts on its ports and
    # rejoins without a restart of anything else.
    svc = cluster(redis_server.url)
    front_b, _ = svc.add_broker()
    probe_a, probe_b = client_for(svc.front), client_for(front_b)
    svc.start_workers(probe_a, 2)
    wait_until(lambda: probe_b.health()["workers"] == 2, 30, "2 workers on broker B")
    turns = ["The river bent around the mill.", " Its wheel turned all night"]
    want = expected_session("ref-pair", turns, 20)
    names = [f"mill-{i}" for i in range(6)]
    chats = [client_for([svc.front, front_b]).session(name, max_tokens=20, **GREEDY)
             for name in names]
    for chat in chats:
        assert chat.send(turns[0]).token_ids == want[0]
    streams = [chat.send(turns[1], stream=True) for chat in chats]
    firsts = [next(s) for s in streams]
    svc.kill_broker(0)
    for stream, first in zip(streams, firsts):
        tokens, final = read_stream(_chain(first, stream))
        assert tokens == want[1]
    assert all(chat.client.watch.failovers >= 1 for chat in chats)
    assert probe_b.stats()["requests_resumed"] >= len(names)
    # Broker A comes back on its ports; the workers register with it again.
    svc.add_broker(svc.brokers[0]["front"], svc.brokers[0]["back"], index=0)
    wait_until(lambda: probe_a.health()["workers"] == 2, 30, "the workers back on broker A")
    assert client_for(svc.front).generate(turns[0], max_tokens=20, **GREEDY).token_ids == \
        expected_tokens([turns[0]], 20)[0]
