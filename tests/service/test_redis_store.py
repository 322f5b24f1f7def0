"""RedisSessionStore against a real redis-server (see tests/conftest.py)."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import redis

from conftest import RedisServer

from turbomq.worker.service.redis_store import (RedisSessionStore, SessionModelMismatch,
                                        pack_tokens, unpack_tokens)
from turbomq.worker.engine.session_store import (SessionConflict, SessionFull, SessionHistory,
                                                 SessionStoreError, TenantQuotaExceeded,
                                                 TurnRecord)

MODEL = "tiny-llama"


@pytest.fixture
def store(redis_server):
    s = RedisSessionStore(redis_server.url, MODEL)
    yield s
    s.close()


def test_round_trip_and_unknown(store):
    assert store.get_tokens("nope") is None
    assert store.append_tokens("s1", [1, 2, 3]) == 3
    assert store.append_tokens("s1", [0, 2**32 - 1]) == 5
    assert store.get_tokens("s1") == [1, 2, 3, 0, 2**32 - 1]
    assert store.get_tokens("nope") is None


def test_layout_is_compact_little_endian(store, redis_server):
    store.append_tokens("s1", [1, 258])
    raw = redis.Redis.from_url(redis_server.url)
    assert raw.get("turbomq:session:{s1}:tokens") == b"\x01\x00\x00\x00\x02\x01\x00\x00"
    meta = raw.hgetall("turbomq:session:{s1}:meta")
    assert meta[b"model"] == MODEL.encode() and meta[b"length"] == b"2"
    raw.close()


def test_pack_rejects_bad_tokens():
    assert unpack_tokens(pack_tokens([5, 7])) == [5, 7]
    for bad in ([-1], [2**32], ["a"]):
        with pytest.raises(ValueError):
            pack_tokens(bad)


def test_bad_tokens_change_nothing(store):
    store.append_tokens("s", [1])
    with pytest.raises(ValueError):
        store.append_tokens("s", [2, -3])
    assert store.get_tokens("s") == [1]


def test_empty_append_creates_session(store):
    assert store.append_tokens("s", []) == 0
    assert store.get_tokens("s") == []


def test_concurrent_appends_are_atomic(redis_server):
    # Four "workers" append 4-token chunks to one session at once: every chunk
    # lands whole (never interleaved) and length always equals the token count.
    stores = [RedisSessionStore(redis_server.url, MODEL) for _ in range(4)]
    n = 50

    def work(w: int) -> None:
        for i in range(n):
            stores[w].append_tokens("shared", [w * 1000 + i] * 4)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tokens = stores[0].get_tokens("shared")
    assert len(tokens) == 4 * n * 4
    chunks = [tokens[i:i + 4] for i in range(0, len(tokens), 4)]
    assert all(len(set(c)) == 1 for c in chunks)
    assert sorted(c[0] for c in chunks) == sorted(w * 1000 + i for w in range(4) for i in range(n))
    for w in range(4):  # each worker's own chunks stay in its order
        mine = [c[0] for c in chunks if c[0] // 1000 == w]
        assert mine == sorted(mine)
    assert stores[0].metadata("shared").length == len(tokens)
    for s in stores:
        s.close()


def test_turns_commit_once_onto_the_history_they_read(store):
    assert store.append_turn("t", [1, 2, 3], TurnRecord("a", 0, 2, "stop")) is True
    assert store.get_session("t") == SessionHistory([1, 2, 3], TurnRecord("a", 0, 2, "stop"))
    # The same turn again (sent twice, or run by two workers): nothing appended.
    assert store.append_turn("t", [1, 2, 9], TurnRecord("a", 0, 2, "length")) is False
    # Another turn computed on the old history: the session moved on.
    with pytest.raises(SessionConflict):
        store.append_turn("t", [4], TurnRecord("b", 0, 1, "stop"))
    assert store.get_tokens("t") == [1, 2, 3]
    # The same id on the new history is a new turn.
    assert store.append_turn("t", [4, 5], TurnRecord("a", 3, 1, "length")) is True
    assert store.get_session("t") == SessionHistory([1, 2, 3, 4, 5], TurnRecord("a", 3, 1, "length"))
    assert store.metadata("t").length == 5
    assert store.get_session("unknown") is None


def test_drop(store):
    store.append_tokens("s", [1, 2])
    store.set_holder("s", "w1")
    assert store.drop("s") is True
    assert store.get_tokens("s") is None
    assert store.metadata("s") is None
    assert store.drop("s") is False


def test_metadata_and_holder(store):
    before = time.time()
    store.append_tokens("s", [1, 2, 3])
    meta = store.metadata("s")
    assert meta.model_id == MODEL and meta.length == 3 and meta.holder is None
    assert before - 1 <= meta.created <= meta.last_use <= time.time() + 1

    store.set_holder("s", "worker-a")
    assert store.metadata("s").holder == "worker-a"
    assert store.release_holder("s", "worker-b") is False  # not the holder
    assert store.metadata("s").holder == "worker-a"
    assert store.release_holder("s", "worker-a") is True
    assert store.metadata("s").holder is None
    store.set_holder("s", "worker-b")
    store.set_holder("s", None)
    assert store.metadata("s").holder is None
    assert store.get_tokens("s") == [1, 2, 3]


def test_holder_before_first_append(store):
    store.set_holder("new", "w1")
    assert store.get_tokens("new") == []
    assert store.metadata("new").length == 0
    assert store.append_tokens("new", [9]) == 1
    meta = store.metadata("new")
    assert (meta.holder, meta.length) == ("w1", 1)


def test_two_workers_share_sessions(redis_server):
    a = RedisSessionStore(redis_server.url, MODEL)
    b = RedisSessionStore(redis_server.url, MODEL)
    a.append_tokens("s", [1, 2])
    a.set_holder("s", "worker-a")
    assert b.get_tokens("s") == [1, 2]
    assert b.metadata("s").holder == "worker-a"
    b.append_tokens("s", [3])
    b.set_holder("s", "worker-b")
    assert a.get_tokens("s") == [1, 2, 3]
    assert a.release_holder("s", "worker-a") is False
    assert a.metadata("s").holder == "worker-b"
    assert b.drop("s") and a.get_tokens("s") is None
    a.close()
    b.close()


def test_model_mismatch(redis_server):
    a = RedisSessionStore(redis_server.url, "llama-7b")
    b = RedisSessionStore(redis_server.url, "llama-13b")
    a.append_tokens("s", [1, 2])
    with pytest.raises(SessionModelMismatch, match="belongs to model 'llama-7b'"):
        b.get_tokens("s")
    with pytest.raises(SessionModelMismatch):
        b.append_tokens("s", [3])
    with pytest.raises(SessionModelMismatch):
        b.set_holder("s", "w")
    assert isinstance(SessionModelMismatch("x"), SessionStoreError)
    assert a.get_tokens("s") == [1, 2]  # untouched
    a.close()
    b.close()


def test_prefix_isolates(redis_server):
    a = RedisSessionStore(redis_server.url, MODEL, prefix="blue")
    b = RedisSessionStore(redis_server.url, MODEL, prefix="green")
    a.append_tokens("s", [1])
    assert b.get_tokens("s") is None
    a.close()
    b.close()


def test_ttl_expires_whole_session(redis_server):
    store = RedisSessionStore(redis_server.url, MODEL, ttl_seconds=0.3)
    store.append_tokens("s", [1])
    store.set_holder("s", "w")
    raw = redis.Redis.from_url(redis_server.url)
    assert 0 < raw.pttl("turbomq:session:{s}:tokens") <= 300
    assert 0 < raw.pttl("turbomq:session:{s}:meta") <= 300
    time.sleep(0.45)
    assert store.get_tokens("s") is None and store.metadata("s") is None
    raw.close()
    store.close()


def test_observe_hook(store, redis_server):
    seen = []
    store.observe = lambda op, seconds, ok: seen.append((op, ok, seconds))
    store.append_tokens("s", [1])
    store.get_tokens("s")
    redis_server.stop()
    with pytest.raises(SessionStoreError):
        store.get_tokens("s")
    assert [(op, ok) for op, ok, _ in seen] == [("append_tokens", True), ("get_tokens", True),
                                                ("get_tokens", False)]
    assert all(s >= 0 for _, _, s in seen)

    store.observe = lambda *a: 1 / 0  # a broken hook must not break the store
    redis_server.start()
    assert store.get_tokens("s") == [1]


def test_redis_down_fails_fast_then_recovers(store, redis_server):
    assert store.append_tokens("s", [1, 2, 3]) == 3  # acknowledged
    redis_server.kill()  # crash: only what was fsynced survives
    for call in (lambda: store.get_tokens("s"), lambda: store.append_tokens("s", [4]),
                 lambda: store.drop("s"), lambda: store.set_holder("s", "w"),
                 lambda: store.metadata("s"), store.ping):
        t0 = time.monotonic()
        with pytest.raises(SessionStoreError, match=r"redis://127\.0\.0\.1:\d+/0 failed on"):
            call()
        assert time.monotonic() - t0 < 2.0
    redis_server.start()
    # The same store object reconnects on its own; the acknowledged turn is there.
    assert store.get_tokens("s") == [1, 2, 3]
    assert store.append_tokens("s", [4]) == 4
    store.ping()


def test_graceful_restart_keeps_pooled_store_working(store, redis_server):
    store.append_tokens("s", [7])
    redis_server.restart()  # pooled connections are now closed by the server
    assert store.get_tokens("s") == [7]
    assert store.append_tokens("s", [8]) == 2
    assert store.metadata("s").length == 2


def test_hung_redis_times_out(redis_server):
    # A Redis that accepts connections but never answers (SIGSTOP): the socket
    # timeout, not a hang, ends the call.
    store = RedisSessionStore(redis_server.url, MODEL, timeout=0.3)
    store.append_tokens("s", [1])
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(SessionStoreError, match="Timeout"):
            store.get_tokens("s")
        assert time.monotonic() - t0 < 2.0
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    assert store.get_tokens("s") == [1]
    store.close()


def test_bad_url_is_a_store_error():
    store = RedisSessionStore("redis://:secret@127.0.0.1:1/0", MODEL, timeout=0.2)
    with pytest.raises(SessionStoreError) as info:
        store.get_tokens("s")
    assert "secret" not in str(info.value) and "***" in str(info.value)


@pytest.mark.timeout(90)  # bounded even if the engine regresses into a hang
def test_engines_share_sessions_through_redis(redis_server):
    # Two engines ("workers") on one Redis: the second rebuilds the first's
    # session by re-prefilling, and yields exactly what one engine would.
    from helpers import demo_model_dir
    from turbomq.worker.engine import errors
    from turbomq.worker import Engine, EngineConfig
    from turbomq.worker.engine.sampling_params import SamplingParams

    config = EngineConfig(model=demo_model_dir(), num_kv_blocks=32, block_size=16)
    greedy = SamplingParams(max_tokens=6, temperature=0)
    stores = [RedisSessionStore(redis_server.url, "demo") for _ in range(2)]
    a, b = (Engine(config, session_store=s) for s in stores)
    alone = Engine(config)
    turn1, turn2 = [5, 6, 7, 8], [9, 10]

    first = a.generate(input_ids=[turn1], params=greedy, session_id="s")[0]
    assert first.error is None
    assert stores[1].get_tokens("s") == turn1 + first.token_ids  # durable before the reply
    second = b.generate(input_ids=[turn2], params=greedy, session_id="s")[0]
    assert second.error is None
    assert b.stats()["reprefilled_tokens"] > 0

    ref = [alone.generate(input_ids=[t], params=greedy, session_id="s")[0].token_ids
           for t in (turn1, turn2)]
    assert [first.token_ids, second.token_ids] == ref
    assert stores[0].get_tokens("s") == turn1 + ref[0] + turn2 + ref[1]

    redis_server.kill()
    with pytest.raises(errors.SessionStoreUnavailable, match="failed on get_tokens"):
        a.generate(input_ids=[[11]], params=greedy, session_id="s")
    redis_server.start()
    third = a.generate(input_ids=[[11]], params=greedy, session_id="s")[0]
    assert third.error is None
    assert len(stores[1].get_tokens("s")) == 4 + 6 + 2 + 6 + 1 + 6
    for s in stores:
        s.close()


def test_acl_user_with_password_and_no_password_in_errors(tmp_path):
    server = RedisServer(tmp_path / "acl", user="turbomq", password="s3cret-pw")
    server.dir.mkdir()
    server.start()
    try:
        store = RedisSessionStore(server.url, model_id="demo")
        assert store.append_tokens("s", [1, 2]) == 2 and store.get_tokens("s") == [1, 2]
        assert "s3cret-pw" not in store.url and "***" in store.url
        store.close()
        for url in (server.url.replace("s3cret-pw", "wrong-pw"),  # a wrong password
                    f"redis://127.0.0.1:{server.port}/0"):  # none: the default user is off
            bad = RedisSessionStore(url, model_id="demo")
            with pytest.raises(SessionStoreError) as info:
                bad.get_tokens("s")
            assert "s3cret-pw" not in str(info.value) and "wrong-pw" not in str(info.value)
            bad.close()
    finally:
        server.kill()


def test_tls(tmp_path):
    server = RedisServer(tmp_path / "tls", tls=True)
    server.dir.mkdir()
    server.start()
    try:
        store = RedisSessionStore(server.url, model_id="demo")  # rediss://, checked certificate
        assert store.append_tokens("s", [7]) == 1 and store.get_tokens("s") == [7]
        store.close()
        plain = RedisSessionStore(f"redis://127.0.0.1:{server.port}/0", model_id="demo")
        with pytest.raises(SessionStoreError):  # plain text to a TLS port gets nowhere
            plain.get_tokens("s")
        plain.close()
    finally:
        server.kill()


def test_a_session_never_grows_past_its_bound(redis_server):
    store = RedisSessionStore(redis_server.url, model_id="demo", max_session_tokens=5)
    try:
        assert store.append_tokens("s", [1, 2, 3]) == 3
        with pytest.raises(SessionFull):
            store.append_tokens("s", [4, 5, 6])
        with pytest.raises(SessionFull):
            store.append_turn("s", [4, 5, 6], TurnRecord("t", 3, 1, "stop"))
        assert store.get_tokens("s") == [1, 2, 3]  # nothing written
        assert store.append_turn("s", [4, 5], TurnRecord("t", 3, 1, "stop"))
        assert store.metadata("s").length == 5
    finally:
        store.close()


def test_workers_keep_sessions_a_week_by_default():
    from turbomq.worker import EngineConfig
    from turbomq.worker.service.loop import WorkerConfig
    assert WorkerConfig(engine=EngineConfig(model="m")).session_ttl == 7 * 24 * 3600


def test_per_tenant_bounds_on_sessions_and_tokens(redis_server):
    store = RedisSessionStore(redis_server.url, model_id="demo", tenant_max_sessions=2,
                              tenant_max_tokens=10)
    try:
        assert store.append_turn("a:s1", [1, 2, 3], TurnRecord("t1", 0, 1, "stop"))
        assert store.append_turn("a:s2", [1, 2, 3], TurnRecord("t2", 0, 1, "stop"))
        with pytest.raises(TenantQuotaExceeded, match="sessions"):  # a third session
            store.append_turn("a:s3", [1], TurnRecord("t3", 0, 1, "stop"))
        with pytest.raises(TenantQuotaExceeded, match="tokens"):  # s1 at 8 + s2 at 3 > 10
            store.append_turn("a:s1", [4, 5, 6, 7, 8], TurnRecord("t4", 3, 1, "stop"))
        assert store.get_tokens("a:s1") == [1, 2, 3]  # refused: nothing written
        assert store.append_turn("b:s1", [1, 2, 3], TurnRecord("t5", 0, 1, "stop"))  # not a's
        assert store.drop("a:s2")  # room again
        assert store.append_turn("a:s3", [1], TurnRecord("t6", 0, 1, "stop"))
        assert store.append_turn("a:s1", [4, 5, 6], TurnRecord("t7", 3, 1, "stop"))  # 6 + 1 <= 10
    finally:
        store.close()


def test_a_tenant_index_forgets_expired_sessions(redis_server):
    store = RedisSessionStore(redis_server.url, model_id="demo", ttl_seconds=0.5,
                              tenant_max_sessions=1)
    try:
        assert store.append_turn("a:s1", [1], TurnRecord("t1", 0, 1, "stop"))
        time.sleep(0.8)  # idle past the ttl: gone from Redis and, at the next turn, the index
        assert store.get_tokens("a:s1") is None
        assert store.append_turn("a:s2", [1], TurnRecord("t2", 0, 1, "stop"))
    finally:
        store.close()
