"""Faults under load, with real processes: a worker SIGKILLed mid-stream and
Redis stopped and restarted mid-run. The fixtures and the reference
(fault-free, greedy) come from test_service."""

from __future__ import annotations

import pytest

from conftest import wait_until
from test_service import (GREEDY, client_for, cluster, expected_session,  # noqa: F401 (fixtures)
                          expected_tokens)
from turbomq.clients import Delta, Unavailable
from turbomq.worker.service.redis_store import RedisSessionStore


def test_sigkill_mid_stream_every_stream_completes_unchanged(cluster, client_for):
    svc = cluster()
    client = client_for(svc.front)
    svc.start_workers(client, 2)
    prompts = [f"Request {i}: the lighthouse keeper" for i in range(20)]
    want = expected_tokens(prompts, 160, ignore_eos=True)
    streams = [client.generate(p, max_tokens=160, ignore_eos=True, stream=True, **GREEDY)
               for p in prompts]
    tokens = [[] for _ in streams]
    seqs = [0] * len(streams)
    done = [False] * len(streams)
    killed = False
    while not all(done):
        for i, stream in enumerate(streams):
            if done[i]:
                continue
            event = next(stream)
            if isinstance(event, Delta):
                assert event.seq == seqs[i] and event.index == len(tokens[i]), (i, event)
                seqs[i] += 1
                tokens[i].extend(event.token_ids)
            else:
                assert event.finish_reason == "length"
                assert event.usage.completion_tokens == 160
                done[i] = True
        if not killed and sum(map(len, tokens)) >= 40:
            svc.kill_worker("w0")  # mid-run: both workers have streams half done
            killed = True
    assert killed
    assert tokens == want
    stats = client.stats()
    assert stats["workers_lost"] == 1 and stats["redispatches_resumed"] >= 1
    assert stats["requests_by_outcome"]["completed"] == 20


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

    redis_server.stop()
    for _ in range(3):  # a clear, retryable error for each session request
        with pytest.raises(Unavailable) as e:
            session.send(turns[2])
        assert e.value.code == "session_store_unavailable" and e.value.retryable
    with pytest.raises(Unavailable) as e:
        client.end_session("other")
    assert e.value.code == "session_store_unavailable"
    # Stateless requests do not need Redis.
    assert client.generate(turns[2], max_tokens=6, **GREEDY).token_ids == expected_tokens([turns[2]], 6)[0]

    redis_server.start()
    box = []

    def turn_succeeds() -> bool:
        try:
            box.append(session.send(turns[2]).token_ids)
            return True
        except Unavailable:
            return False

    wait_until(turn_succeeds, 15, "the session to work again", interval=0.3)
    assert box[-1] == want[2]  # both acknowledged turns were still there
    assert session.send(turns[3]).token_ids == want[3]
    store = RedisSessionStore(redis_server.url, model_id="demo")
    try:
        history = store.get_tokens("chat")
    finally:
        store.close()
    assert history is not None and history[-6:] == want[3]
    assert all(svc.workers[w].poll() is None for w in ("w0", "w1"))
