"""Prefix routing (docs/broker.md): requests without a session go to the
worker their leading content hashes to, bounded by load.

First the data plane's two steps as pure functions (the key of a frame, the
rendezvous pick), then real broker and echo-worker processes on loopback,
where every dispatch is checked against what those functions predict."""

from __future__ import annotations

import random
import time
import urllib.request

import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from turbomq import _native
from turbomq.broker.config import BrokerConfig
from turbomq.broker.main import build_parser, config_from_args
from turbomq.clients import Client

from _service_helpers import Service
from test_broker import client_for, service  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(60)

B = _native.broker
K = 256  # the broker's default --prefix-bytes
SYSTEM = ("You are the harbour master's assistant. Answer questions about tides, berths, "
          "pilotage and the weather in the bay; be brief, cite the harbour bylaws where they "
          "apply, and never guess a tide time: say so when a table is missing. ") * 2
assert len(SYSTEM.encode()) > K


def frame(**fields) -> bytes:
    return msgpack.packb({"v": 1, "kind": "generate", "request_id": "r", **fields})


def key(tenant: str = "", prefix_bytes: int = K, **fields) -> int:
    return B.prefix_key(frame(**fields), tenant, prefix_bytes)


def chat(*contents: str, system: str = SYSTEM) -> list:
    roles = ["user", "assistant"] * len(contents)
    return [{"role": "system", "content": system}] + [
        {"role": r, "content": c} for r, c in zip(roles, contents)]


def order(k: int, workers: list) -> list:
    """The key's rendezvous order over (worker_id, slots): first choice first."""
    left = [(w, s, 0) for w, s in workers]
    out = []
    while left:
        _, first = B.rendezvous_pick(k, left, 0.5)
        out.append(left.pop(first)[0])
    return out


# ------------------------------------------------------------------- keys
def test_key_covers_the_leading_bytes_of_a_prompt():
    a, b = SYSTEM + "When is high water?", SYSTEM + "Where do I moor?"
    assert key(prompt=a) == key(prompt=b)  # the same first 256 bytes
    assert key(prompt=a, prefix_bytes=len(SYSTEM) + 5) != key(prompt=b, prefix_bytes=len(SYSTEM) + 5)
    assert key(prompt="x" + a) != key(prompt=a)
    assert key(prompt="short") == key(prompt="short") != key(prompt="short!")
    # Tenants never share a key (their workers' prefix caches are apart too).
    assert key(prompt=a) != key("acme", prompt=a) != key("globex", prompt=a)
    # The same characters as token ids or as a chat are other keys.
    assert key(prompt="abc") != key(input_ids=[97, 98, 99])
    assert key(prompt="abc") != key(messages=[{"role": "user", "content": "abc"}])


def test_key_covers_the_first_token_ids():
    ids = list(range(1000, 1100))
    assert key(input_ids=ids) == key(input_ids=ids[:K // 4] + [7, 7, 7])  # the first 64 ids
    assert key(input_ids=ids) != key(input_ids=ids[:K // 4 - 1] + [7])
    assert key(input_ids=[1, 2]) != key(input_ids=[1, 2, 3])


def test_key_of_a_conversation_stays_with_its_first_messages():
    turn1 = chat("When is high water today?")
    turn3 = chat("When is high water today?", "At 14:10.", "And low water?", "At 20:25.", "Thanks")
    assert key(messages=turn1) == key(messages=turn3)  # sent again with its history
    # Another first question is another conversation, even after a system
    # prompt longer than the key's bytes: each message counts its own bytes.
    assert key(messages=chat("Where do I moor?")) != key(messages=turn1)
    assert key(messages=chat("When is high water today?", system="Be terse.")) != key(messages=turn1)
    # Without a system message the first user message alone is the key.
    assert key(messages=turn1[1:]) == key(messages=turn3[1:]) != key(messages=turn1)
    assert key(messages=turn1, prefix_bytes=8) == key(messages=chat("When is the office open?"),
                                                          prefix_bytes=8)


def test_keys_and_picks_are_pinned():
    """The same request goes to the same worker on every broker, whatever the
    machine or version: an active-active pair (or one being upgraded) agrees
    only while these stay. Changing them moves every key once; say so in the
    release notes."""
    assert key(prompt="hello") == 4338643051740853510
    assert key("acme", input_ids=[1, 2, 3]) == 4268562700744914434
    assert key(messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]) \
        == 13854241462342358985
    k = key(prompt="hello")
    assert B.rendezvous_pick(k, [("w0", 4, 0), ("w1", 4, 0), ("w2", 4, 0)], 0.5) == (0, 0)
    assert B.rendezvous_pick(k, [("w0", 2, 0), ("w1", 4, 0), ("w2", 8, 0)], 0.5) == (2, 2)


# ----------------------------------------------------------- rendezvous
WORKERS4 = [("w0", 4), ("w1", 4), ("w2", 4), ("w3", 4)]


def test_rendezvous_spreads_keys_by_weight_whatever_the_worker_order():
    keys = [key(prompt=f"conversation {i}") for i in range(4000)]
    firsts = [order(k, WORKERS4)[0] for k in keys]
    for w, _ in WORKERS4:
        assert 850 <= firsts.count(w) <= 1150, (w, firsts.count(w))  # 1000 expected each
    shuffled = WORKERS4[::-1]
    assert [order(k, shuffled)[0] for k in keys[:200]] == firsts[:200]
    # A worker with three times the slots gets three times the keys.
    weighted = [order(k, [("small", 1), ("big", 3)])[0] for k in keys]
    assert 2800 <= weighted.count("big") <= 3200


def test_a_worker_leaving_or_joining_moves_only_its_keys():
    keys = [key(prompt=f"conversation {i}") for i in range(2000)]
    before = {k: order(k, WORKERS4)[0] for k in keys}
    after = {k: order(k, WORKERS4[:2] + WORKERS4[3:])[0] for k in keys}  # w2 left
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "w2" for k in moved)
    assert len(moved) == sum(1 for k in keys if before[k] == "w2")
    joined = {k: order(k, WORKERS4 + [("w4", 4)])[0] for k in keys}
    moved = [k for k in keys if before[k] != joined[k]]
    assert moved and all(joined[k] == "w4" for k in moved)


def test_pick_is_the_first_worker_in_order_within_the_load_bound():
    rng = random.Random(7)
    for trial in range(3000):
        n = rng.randint(1, 5)
        workers = [(f"w{i}", rng.choice([1, 2, 4, 8]), 0) for i in range(n)]
        workers = [(w, s, rng.randint(0, s)) for w, s, _ in workers]
        balance = rng.choice([0.0, 0.25, 0.5, 2.0])
        k = rng.getrandbits(64)
        chosen, first = B.rendezvous_pick(k, workers, balance)
        ranked = order(k, [(w, s) for w, s, _ in workers])
        assert workers[first][0] == ranked[0]
        total_slots = sum(s for _, s, _ in workers)
        total = sum(i for _, _, i in workers)

        def fits(w):
            _, s, inflight = w
            return inflight < s and inflight * total_slots < (1 + balance) * (total + 1) * s

        by_id = {w[0]: w for w in workers}
        expected = next((w for w in ranked if fits(by_id[w])), None)
        if expected is None:
            # Only when every worker is full: a free slot anywhere is always taken.
            assert chosen == -1 and all(i == s for _, s, i in workers), workers
        else:
            assert workers[chosen][0] == expected, (trial, workers, balance)


# ------------------------------------------------ through a real broker
def start(service, client_for, workers: dict, delay: float = 0.0, **flags):
    """A broker with echo workers {worker_id: slots}, all registered, and a client."""
    svc = service(**flags)
    for worker_id, slots in workers.items():
        svc.add_worker(worker_id, slots=slots, delay=delay)
    c = client_for(svc)
    svc.wait_workers(c, len(workers))
    return svc, c


def dispatched(svc: Service) -> list:
    """The workers of every dispatch so far, in the broker's order (its request keys)."""
    events = sorted(svc.events("dispatch"), key=lambda e: int(e["request_id"], 16))
    return [e["worker_id"] for e in events]


def served_by(svc: Service, c: Client, **request) -> str:
    """Run one request to its end; the worker its (only) dispatch went to."""
    n = len(svc.events("dispatch"))
    c.generate(max_tokens=2, **request)
    (dispatch,) = svc.events("dispatch")[n:]
    return dispatch["worker_id"]


def test_equal_prefixes_share_a_worker_and_others_spread(service, client_for):
    workers = {"w1": 4, "w2": 4, "w3": 4}
    svc, c = start(service, client_for, workers)
    pool = list(workers.items())
    # One system prompt, many questions: one worker, the key's first choice.
    prompts = [SYSTEM + f"Question {i}: when is high water?" for i in range(5)]
    got = {served_by(svc, c, prompt=p) for p in prompts}
    assert got == {order(key(prompt=prompts[0]), pool)[0]}
    # Other prefixes: each to its own first choice, over every worker.
    others = [f"Passage plan {i}: " + "leave on the ebb, " * 20 for i in range(18)]
    seen = []
    for p in others:
        seen.append(served_by(svc, c, prompt=p))
        assert seen[-1] == order(key(prompt=p), pool)[0]
    assert set(seen) == set(workers)
    # Token ids too; and a prompt sent again goes where it went.
    for i in range(6):
        ids = [100 + i] * 70
        assert served_by(svc, c, input_ids=ids) == order(key(input_ids=ids), pool)[0]
    assert served_by(svc, c, prompt=others[0]) == seen[0]
    routing = c.stats()["routing"]
    assert routing["prefix"] == 5 + 18 + 6 + 1 and "stateless" not in routing


def test_a_resent_conversation_keeps_its_worker(service, client_for):
    workers = {"w1": 4, "w2": 4, "w3": 4}
    svc, c = start(service, client_for, workers)
    pool = list(workers.items())
    firsts = [f"Conversation {i}: when is high water at the north quay?" for i in range(9)]
    homes = {}
    for turn in range(3):
        for i, first in enumerate(firsts):
            history = [first]
            for t in range(turn):
                history += [f"Answer {t}.", f"Follow-up {t} of conversation {i}."]
            w = served_by(svc, c, messages=chat(*history))
            assert homes.setdefault(i, w) == w
    assert [homes[i] for i in range(9)] == [order(key(messages=chat(f)), pool)[0] for f in firsts]
    assert len(set(homes.values())) > 1
    # A session's first turn goes where its prompt's key says (its system
    # prompt is likely cached there); later turns follow affinity.
    for name in ("kept", "other"):
        n = len(svc.events("dispatch"))
        with c.session(name, max_tokens=2) as s:
            s.send(name + ": " + SYSTEM)
            s.send("and then?")
        first, second = (e["worker_id"] for e in svc.events("dispatch")[n:n + 2])
        assert first == order(key(prompt=name + ": " + SYSTEM), pool)[0] and second == first
    routing = c.stats()["routing"]
    assert routing["prefix"] == 27 and routing["new"] == 2 and routing["affinity"] == 2


def test_a_full_first_choice_sends_the_request_to_the_next_without_waiting(service, client_for):
    workers = {"w1": 1, "w2": 1, "w3": 1}
    svc, c = start(service, client_for, workers, delay=0.02)
    ranked = order(key(prompt=SYSTEM), list(workers.items()))
    # Three long streams of one prompt: each worker's single slot in turn,
    # in the key's order; none waits in the queue while a worker is free.
    streams = [c.generate(prompt=SYSTEM, max_tokens=400, stream=True) for _ in range(3)]
    for s in streams:
        next(s)  # each is running
    stats = c.stats()
    assert stats["queue_depth"] == 0 and stats["slots_free"] == 0
    assert dispatched(svc) == ranked
    assert stats["routing"] == {"prefix": 1, "stateless": 2}
    # Every worker is full now: the next one waits for the first slot that frees.
    late = c.generate(prompt=SYSTEM, max_tokens=2, stream=True)
    assert c.stats()["queue_depth"] == 1
    streams[1].close()  # cancelled: the second choice's slot frees
    assert list(late)[-1].finish_reason == "length"
    assert dispatched(svc)[-1] == ranked[1]
    for s in (streams[0], streams[2]):
        s.close()


@pytest.mark.parametrize("balance,split", [(0.5, [3, 3, 0]), (100, [4, 2, 0])])
def test_a_busy_first_choice_shares_its_key_within_the_load_bound(service, client_for, balance, split):
    # 3 workers x 4 slots, 6 streams of one prompt. With --prefix-balance 0.5 a
    # worker takes a key while inflight < 1.5 x (inflight + 1) x 4 / 12, so the
    # first and second choice alternate; with a large one only a full worker
    # passes the key on.
    workers = {"w1": 4, "w2": 4, "w3": 4}
    svc, c = start(service, client_for, workers, delay=0.02, **{"prefix-balance": balance})
    ranked = order(key(prompt=SYSTEM), list(workers.items()))
    streams = [c.generate(prompt=SYSTEM, max_tokens=400, stream=True) for _ in range(6)]
    for s in streams:
        next(s)
    workers_used = dispatched(svc)
    assert [workers_used.count(w) for w in ranked] == split
    assert c.stats()["routing"] == {"prefix": split[0], "stateless": split[1]}
    for s in streams:
        s.close()


def test_a_worker_leaving_or_joining_moves_only_its_prompts(service, client_for):
    workers = {"w1": 4, "w2": 4, "w3": 4}
    svc, c = start(service, client_for, workers)
    prompts = [f"Tide table {i}: " + "springs and neaps, " * 16 for i in range(24)]
    before = [served_by(svc, c, prompt=p) for p in prompts]
    gone = max(workers, key=before.count)  # the worker with most prompts leaves
    svc.kill_worker(gone)
    deadline = time.monotonic() + 10
    while c.health()["workers"] != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    after = [served_by(svc, c, prompt=p) for p in prompts]
    for b, a in zip(before, after):
        assert a == b if b != gone else a != gone
    svc.add_worker("w4", slots=4)
    svc.wait_workers(c, 3)
    joined = [served_by(svc, c, prompt=p) for p in prompts]
    assert any(j == "w4" for j in joined)
    for a, j in zip(after, joined):
        assert j in (a, "w4")
    pool = [(w, 4) for w in ("w1", "w2", "w3", "w4") if w != gone]
    assert joined == [order(key(prompt=p), pool)[0] for p in prompts]


def test_prefix_routing_off_counts_stateless(service, client_for):
    svc, c = start(service, client_for, {"w1": 2, "w2": 2}, **{"prefix-routing": "off"})
    for _ in range(4):
        served_by(svc, c, prompt=SYSTEM)
    assert c.stats()["routing"] == {"stateless": 4}


def test_routing_decisions_reach_the_metrics(service, client_for):
    svc, c = start(service, client_for, {"w1": 1, "w2": 1}, delay=0.02, **{"metrics-port": 0})
    running = c.generate(prompt=SYSTEM, max_tokens=400, stream=True)
    next(running)  # the prompt's first choice is full now ...
    served_by(svc, c, prompt=SYSTEM)  # ... so this one goes to the other: stateless
    running.close()
    with c.session("s1", max_tokens=2) as s:
        s.send("hello")
    want = {"prefix": 1, "stateless": 1, "new": 1, "affinity": 0, "moved": 0}

    def decisions() -> dict:
        url = f"http://127.0.0.1:{svc.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
        return {s.labels["decision"]: s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == "turbomq_broker_routing_decisions_total"}

    deadline = time.monotonic() + 10
    while decisions() != want and time.monotonic() < deadline:
        time.sleep(0.1)  # copied into the metrics once per tick
    assert decisions() == want


def test_prefix_routing_flags():
    config = config_from_args(build_parser().parse_args(
        ["--prefix-routing", "off", "--prefix-bytes", "512", "--prefix-balance", "0.25"]))
    assert (config.prefix_routing, config.prefix_bytes, config.prefix_balance) == (False, 512, 0.25)
    default = config_from_args(build_parser().parse_args([]))
    assert (default.prefix_routing, default.prefix_bytes, default.prefix_balance) == (True, 256, 0.5)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--prefix-routing", "maybe"])
    for bad in ({"prefix_bytes": 0}, {"prefix_balance": -0.1}):
        with pytest.raises(ValueError):
            BrokerConfig(**bad)
