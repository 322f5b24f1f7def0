"""Prefix routing end to end: a real broker, two real CPU workers on the demo
model, the real client. Conversations sent again with their whole history and
no session (as OpenAI-style clients send them) go back to the worker that
served their first turn, so every later turn finds its history in that
worker's prefix cache."""

from __future__ import annotations

import pytest

from conftest import wait_until
from test_service import GREEDY, Cluster, client_for, cluster  # noqa: F401 (fixtures)

pytestmark = pytest.mark.timeout(240)

SYSTEM = ("You are the harbour master's assistant. Answer questions about tides, berths and "
          "pilotage in the bay, briefly, and never guess a tide time.")
BLOCK = 16  # the workers' --block-size, so short conversations fill blocks


def test_resent_conversations_hit_the_prefix_cache_of_their_first_worker(cluster, client_for):
    c = cluster()
    for wid in ("w0", "w1"):
        c.start_worker(wid, slots=4, extra=("--block-size", str(BLOCK)))
    client = client_for(c.front)
    for wid in ("w0", "w1"):
        c.wait_ready(wid)
    wait_until(lambda: client.health()["workers"] == 2, 30, "2 workers registered")

    firsts = [f"Conversation {i}: when is high water at the north quay on day {i}?" for i in range(6)]
    histories = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f}] for f in firsts]
    prompt_tokens = [0] * len(firsts)
    for turn in range(3):
        for i, history in enumerate(histories):  # turns interleaved across conversations
            r = client.generate(messages=history, max_tokens=4, **GREEDY)
            if turn > 0:
                # The earlier turns' full blocks (their prompt, at least) come
                # from the cache of the worker that served them.
                assert r.usage.cached_tokens >= (prompt_tokens[i] // BLOCK - 1) * BLOCK > 0, \
                    (turn, i, r.usage, prompt_tokens[i])
            prompt_tokens[i] = r.usage.prompt_tokens
            history += [{"role": "assistant", "content": r.text},
                        {"role": "user", "content": f"And on day {i + turn + 1}?"}]
    routing = client.stats()["routing"]
    assert routing == {"prefix": 18}
    # The conversations were spread: both workers served some.
    for wid in ("w0", "w1"):
        finished = sum(v for k, v in c.metrics(wid).items() if k[0] == "turbomq_requests_finished_total")
        assert 0 < finished < 18 and finished % 3 == 0, (wid, finished)
