"""Tenants through the whole service: a real broker with CurveZMQ, a real CPU
worker with its key, real Redis. Two tenants using the same session id get
two sessions: their own histories, in Redis under their own keys."""

from __future__ import annotations

import pytest

from conftest import wait_until
from test_service import GREEDY, client_for, cluster, expected_session  # noqa: F401 (fixtures)
from turbomq.clients import CurveClient, UnknownSession
from turbomq.clients.keys import allow_line, new_keypair
from turbomq.worker.service.redis_store import RedisSessionStore


def test_two_tenants_one_session_id_two_sessions(cluster, client_for, redis_server, tmp_path):
    keys = tmp_path / "keys"
    made = {n: new_keypair(keys, n) for n in ("broker", "w0", "alice", "bob")}
    (keys / "workers.allow").write_text(allow_line(made["w0"][0]) + "\n")
    (keys / "clients.allow").write_text(allow_line(made["alice"][0], "tenant-a") + "\n" +
                                        allow_line(made["bob"][0], "tenant-b") + "\n")
    svc = cluster(redis_server.url, curve_secret=keys / "broker.key_secret",
                  client_keys=keys / "clients.allow", worker_keys=keys / "workers.allow")
    svc.start_worker("w0", extra=("--curve-secret", str(keys / "w0.key_secret"),
                                  "--broker-key", str(keys / "broker.key")))
    svc.wait_ready("w0")
    alice = client_for(svc.front, curve=CurveClient.load(keys / "alice.key_secret",
                                                         keys / "broker.key"))
    bob = client_for(svc.front, curve=CurveClient.load(keys / "bob.key_secret",
                                                       keys / "broker.key"))
    wait_until(lambda: alice.health()["workers"] == 1, 30, "the worker registered")
    a_turns = ["The glacier moved an inch a year.", " Below it the valley waited"]
    b_turns = ["A parrot learned six words.", " It used them all at dinner"]
    want_a = expected_session("ref-a", a_turns, 8)
    want_b = expected_session("ref-b", b_turns, 8)
    a_chat = alice.session("chat", max_tokens=8, **GREEDY)
    b_chat = bob.session("chat", max_tokens=8, **GREEDY)
    got = [a_chat.send(a_turns[0]).token_ids, b_chat.send(b_turns[0]).token_ids,
           a_chat.send(a_turns[1]).token_ids, b_chat.send(b_turns[1]).token_ids]
    assert got == [want_a[0], want_b[0], want_a[1], want_b[1]]  # each its own history
    store = RedisSessionStore(redis_server.url, model_id="demo")
    try:
        a_len, b_len = (len(store.get_tokens(f"tenant-{t}:chat")) for t in "ab")
        assert store.get_tokens("chat") is None  # nothing under the bare id
    finally:
        store.close()
    assert a_len > 16 and b_len > 16
    b_chat.end()  # Bob's "chat" only
    with pytest.raises(UnknownSession):
        b_chat.end()
    assert a_chat.send(" Then spring came").usage.prompt_tokens > a_len  # Alice's lives on
