"""Security at the broker, with real processes and sockets: CurveZMQ on both
links (only the keys on the allow-lists get a connection, a rogue worker gets
no dispatch, an unknown client gets nothing, the lists reload without a
restart, plain mode is refused on a non-loopback address) and tenants
(sessions scoped by tenant, per-tenant limits). docs/security.md."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from turbomq.clients import Client, CurveClient, Overloaded, Timeout, UnknownSession
from turbomq.clients import protocol as P
from turbomq.clients.keys import allow_line, is_local_endpoint, load_allow_list, new_keypair

from _service_helpers import Service, expected_echo

pytestmark = pytest.mark.timeout(90)
PY = sys.executable


@pytest.fixture
def keys(tmp_path):
    d = tmp_path / "keys"
    made = {name: new_keypair(d, name)
            for name in ("broker", "w1", "rogue", "alice", "bob", "mallory")}
    (d / "workers.allow").write_text(allow_line(made["w1"][0]) + "\n")
    (d / "clients.allow").write_text(allow_line(made["alice"][0], "tenant-a") + "\n" +
                                     allow_line(made["bob"][0], "tenant-b") + "\n")
    return d, made


def secure_service(tmp_path, keys, **flags) -> Service:
    d, _ = keys
    return Service(tmp_path, **{"curve-secret": d / "broker.key_secret",
                                "client-keys": d / "clients.allow",
                                "worker-keys": d / "workers.allow", **flags})


@pytest.fixture
def secure(tmp_path, keys):
    svc = secure_service(tmp_path, keys)
    yield svc
    svc.close()


def client(d: Path, name: str, front: str, timeout: float = 10.0) -> Client:
    return Client(front, timeout=timeout, ping_interval=0.1,
                  curve=CurveClient.load(d / f"{name}.key_secret", d / "broker.key"))


def echo_worker(svc: Service, d: Path, name: str, worker_id: str):
    proc = svc._spawn([PY, "-m", "turbomq.broker.echo_worker", "--broker", svc.back,
                       "--worker-id", worker_id, "--slots", "2",
                       "--curve-secret", str(d / f"{name}.key_secret"),
                       "--broker-key", str(d / "broker.key")])
    svc.workers[worker_id] = proc
    return proc


def test_keys_command_writes_a_pair_and_an_allow_line(tmp_path):
    out = subprocess.run([PY, "-m", "turbomq.worker.cli", "keys", "new", str(tmp_path), "bob",
                          "--as", "tenant-b"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("tenant-b ") and len(line.split()[1]) == 40
    assert (tmp_path / "bob.key_secret").stat().st_mode & 0o077 == 0  # private
    (tmp_path / "allow").write_text("# a comment\n" + line + "\n\n")
    assert load_allow_list(tmp_path / "allow") == {line.split()[1]: "tenant-b"}


def test_allowed_keys_talk_encrypted(secure, keys):
    d, _ = keys
    echo_worker(secure, d, "w1", "w1")
    with client(d, "alice", secure.front) as c:
        secure.wait_workers(c, 1)
        assert c.generate(input_ids=[5, 6], max_tokens=6).token_ids == expected_echo([5, 6], 6)
        stats = c.stats()
    assert stats["auth_admitted"] >= 2 and stats["auth_refused"] == 0


def test_a_rogue_worker_gets_no_connection_and_no_dispatch(secure, keys):
    d, _ = keys
    echo_worker(secure, d, "rogue", "rogue")  # a valid key pair, not on the list
    with client(d, "alice", secure.front) as c:
        time.sleep(1.0)
        assert c.health()["workers"] == 0
        assert c.stats()["auth_refused"] >= 1
        # Requests wait for a worker; the rogue one never sees them.
        with pytest.raises(Timeout):
            c.generate(input_ids=[1, 2], max_tokens=3, timeout=1.0)
        # A plain (no key) DEALER registering on the back port gets nothing either.
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(secure.back)
        sock.send(P.pack(P.register("forged", "echo", 8, 1000)))
        assert not sock.poll(1000)
        sock.close(0)
        assert c.health()["workers"] == 0


def test_an_unknown_client_gets_nothing(secure, keys):
    d, _ = keys
    echo_worker(secure, d, "w1", "w1")
    with client(d, "mallory", secure.front, timeout=2.0) as c:  # not on the client list
        with pytest.raises(Timeout):
            c.health(timeout=1.0)
    plain = zmq.Context.instance().socket(zmq.DEALER)  # no key at all
    plain.setsockopt(zmq.LINGER, 0)
    plain.connect(secure.front)
    plain.send(P.pack(P.health("h")))
    assert not plain.poll(1000)
    plain.close(0)


def test_allow_lists_reload_without_a_restart(secure, keys):
    d, made = keys
    echo_worker(secure, d, "w1", "w1")
    with client(d, "mallory", secure.front, timeout=2.0) as c:
        with pytest.raises(Timeout):
            c.health(timeout=1.0)
    with open(d / "clients.allow", "a") as f:
        f.write(allow_line(made["mallory"][0], "tenant-m") + "\n")
    time.sleep(0.5)  # a tick or two: the broker reads the changed file
    with client(d, "mallory", secure.front) as c:
        secure.wait_workers(c, 1)
        assert c.generate(input_ids=[9], max_tokens=2).token_ids == [9, 9]


def test_plain_mode_needs_a_flag_off_loopback():
    assert is_local_endpoint("tcp://127.0.0.1:5555") and is_local_endpoint("ipc:///tmp/x")
    assert is_local_endpoint("tcp://[::1]:5555") and is_local_endpoint("tcp://localhost:1")
    assert not is_local_endpoint("tcp://0.0.0.0:5555") and not is_local_endpoint("tcp://*:5555")
    assert not is_local_endpoint("tcp://10.0.0.5:5555")
    out = subprocess.run([PY, "-m", "turbomq.broker", "--front", "tcp://0.0.0.0:0",
                          "--back", "tcp://127.0.0.1:0"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "--allow-plain" in out.stderr
    assert "Traceback" not in out.stderr


def test_tenants_never_meet_in_a_session_id(secure, keys):
    d, _ = keys
    echo_worker(secure, d, "w1", "w1")
    secure.workers["w1"].kill()  # restart it slowly, so a turn stays in flight
    secure.workers["w1"].wait(5)
    secure.workers["w1"] = secure._spawn([PY, "-m", "turbomq.broker.echo_worker", "--broker",
                                          secure.back, "--worker-id", "w1", "--slots", "4",
                                          "--delay", "0.05", "--curve-secret",
                                          str(d / "w1.key_secret"), "--broker-key",
                                          str(d / "broker.key")])
    with client(d, "alice", secure.front) as alice, client(d, "bob", secure.front) as bob:
        secure.wait_workers(alice, 1)
        # The same session id, at the same time: no session_busy across tenants.
        a = alice.generate(input_ids=[1, 2], session_id="chat", max_tokens=20, stream=True)
        b = bob.generate(input_ids=[3, 4], session_id="chat", max_tokens=5)
        assert b.token_ids == expected_echo([3, 4], 5)
        assert [t for e in a if hasattr(e, "token_ids") for t in e.token_ids] == \
            expected_echo([1, 2], 20)
        # Without scoping, Bob's turn would have been refused as session_busy.
        assert "session_busy" not in alice.stats()["requests_by_outcome"]
        # Bob ends "chat": his own. Alice's session of that id is untouched.
        bob.end_session("chat")
        with pytest.raises(UnknownSession):
            bob.end_session("chat")
        alice.end_session("chat")


def test_per_tenant_limits_answer_rate_limited(tmp_path, keys):
    d, _ = keys
    svc = secure_service(tmp_path, keys, **{"tenant-max-inflight": 1})
    try:
        svc._spawn([PY, "-m", "turbomq.broker.echo_worker", "--broker", svc.back,
                    "--worker-id", "w1", "--slots", "4", "--delay", "0.05",
                    "--curve-secret", str(d / "w1.key_secret"), "--broker-key",
                    str(d / "broker.key")])
        with client(d, "alice", svc.front) as alice, client(d, "bob", svc.front) as bob:
            svc.wait_workers(alice, 1)
            running = alice.generate(input_ids=[1], max_tokens=20, stream=True)
            next(running)
            with pytest.raises(Overloaded) as info:
                alice.generate(input_ids=[2], max_tokens=2)
            assert info.value.code == "rate_limited" and info.value.retryable
            assert bob.generate(input_ids=[2], max_tokens=2).token_ids == [2, 2]  # not bob's
            list(running)
            assert alice.generate(input_ids=[2], max_tokens=2).token_ids == [2, 2]
            by_tenant = alice.stats()["tenant_outcomes"]  # the tenant_requests metric's source
            assert by_tenant["tenant-a"] == {"rate_limited": 1, "completed": 2}
            assert by_tenant["tenant-b"] == {"completed": 1}
    finally:
        svc.close()


def test_per_tenant_token_rate(tmp_path, keys):
    d, _ = keys
    svc = secure_service(tmp_path, keys, **{"tenant-tokens-per-s": 10, "tenant-token-burst-s": 2})
    try:
        svc._spawn([PY, "-m", "turbomq.broker.echo_worker", "--broker", svc.back,
                    "--worker-id", "w1", "--slots", "4", "--curve-secret",
                    str(d / "w1.key_secret"), "--broker-key", str(d / "broker.key")])
        with client(d, "alice", svc.front) as alice, client(d, "bob", svc.front) as bob:
            svc.wait_workers(alice, 1)
            assert len(alice.generate(input_ids=[1], max_tokens=40).token_ids) == 40
            with pytest.raises(Overloaded) as info:  # 40 tokens against a bucket of 20
                alice.generate(input_ids=[1], max_tokens=2)
            assert info.value.code == "rate_limited" and "tokens/s" in info.value.message
            assert bob.generate(input_ids=[2], max_tokens=2).token_ids == [2, 2]
    finally:
        svc.close()
