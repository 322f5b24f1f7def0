"""What the clients keep to survive a lost broker (clients/resume.py): the
stream the application sees stays contiguous across resends, retryable
errors wait, and a broker is judged silent only after an unanswered ping."""

from __future__ import annotations

import pytest

from turbomq.clients import ServerError
from turbomq.clients import protocol as P
from turbomq.clients.resume import DEADLINE_GRACE_S, BrokerWatch, InFlight


def inflight(deadline: float = 100.0, stream: bool = True) -> InFlight:
    msg = P.generate("r", input_ids=[1, 2], params={"max_tokens": 8}, stream=stream)
    return InFlight("r", msg, deadline)


def delta(seq: int, index: int, ids: list, text: str = "") -> dict:
    return P.delta("r", seq, index, ids, text or "".join(chr(65 + i % 26) for i in ids))


def test_resend_carries_what_the_application_has():
    req = inflight()
    first = P.decode_client_request(req.frame(0.0))
    assert "resume_tokens" not in first and first["timeout"] == pytest.approx(100 - DEADLINE_GRACE_S)
    req.accept(delta(0, 0, [3, 4]), 1.0)
    again = P.decode_client_request(req.frame(10.0))
    assert again["resume_tokens"] == [3, 4] and again["resume_text"] == "DE"
    assert again["request_id"] == "r" and again["timeout"] == pytest.approx(89.0)


def test_stream_stays_contiguous_across_a_resend():
    req = inflight()
    out = [req.accept(delta(0, 0, [1, 2]), 0), req.accept(delta(1, 2, [3]), 0)]
    # A new broker numbers its deltas from 0 again and starts at the resume point.
    out.append(req.accept(delta(0, 3, [4, 5]), 0))
    assert [m["seq"] for m in out] == [0, 1, 2]
    assert req.tokens == [1, 2, 3, 4, 5]
    assert req.accept(delta(1, 1, [2, 3]), 0) is None  # already delivered
    final = req.accept(P.final("r", 0, "length", P.usage(2, 0, 5), [], ""), 0)
    assert final["seq"] == 3
    with pytest.raises(ServerError):
        req.accept(delta(2, 9, [7]), 0)  # a gap is never papered over


def test_retryable_errors_wait_until_the_deadline():
    req = inflight(deadline=10.0)
    busy = P.error("r", P.Code.SESSION_STORE_UNAVAILABLE, "redis down")
    assert req.accept(busy, 1.0) is None and req.retry_at == pytest.approx(1.05)
    assert req.accept(busy, 2.0) is None and req.retry_at == pytest.approx(2.1)
    assert req.accept(busy, 8.9) == busy  # no time left: the application sees it
    overloaded = P.error("r", P.Code.OVERLOADED, "full")
    assert inflight().accept(overloaded, 0.0) == overloaded  # back-pressure is not retried


def test_duplicate_request_after_a_resend_means_the_broker_has_it():
    req = inflight()
    dup = P.error("r", P.Code.DUPLICATE_REQUEST, "already in flight")
    req.frame(0.0)
    assert req.accept(dup, 0.0) == dup  # sent once: a real client bug
    req.frame(1.0)
    assert req.accept(dup, 1.0) is None


def test_broker_watch():
    watch = BrokerWatch(["tcp://a:1", "tcp://b:2"], ping_interval=0.5, liveness=3)
    assert not watch.silent(1000.0)  # nothing asked yet: no verdict
    watch.pinged(10.0)
    assert not watch.silent(11.0) and watch.silent(11.6)
    watch.heard(11.7)
    assert not watch.silent(20.0)
    assert watch.next_endpoint(20.0) == "tcp://b:2" and watch.next_endpoint(21.0) == "tcp://a:1"
    a, b, c = inflight(), inflight(), inflight()
    a.broker_id, b.broker_id = "old", "new"
    lost = watch.lost_by_pong("new", [a, b, c])
    assert lost == [a] and c.broker_id == "new" and watch.broker_id == "new"
