"""`turbomq bench` without a server: the figures computed as `vllm bench
serve` defines them, arrivals, workloads from a seed and from a ShareGPT
file, the terminal table and the comparison table. (tests/service/test_bench_service.py
runs it against a live broker and gateway.)"""

from __future__ import annotations

import json
import random

import pytest

from turbomq.clients.bench import workloads as W
from turbomq.clients.bench.backends import RequestResult
from turbomq.clients.bench.metrics import format_summary, parse_goodput, summarize
from turbomq.clients.bench.report import compare_table
from turbomq.clients.bench.runner import arrival_times


def result(conv: str, turn: int, start: float, times: list, prompt: int, cached: int = 0,
           ok: bool = True) -> RequestResult:
    """A request sent at `start` whose tokens (one per chunk) came at `times`."""
    r = RequestResult(conv, turn, start, success=ok)
    if ok:
        r.chunk_times, r.chunk_tokens = list(times), [1] * len(times)
        r.ttft = times[0] - start
        r.itl = [b - a for a, b in zip(times, times[1:])]
        r.latency = times[-1] - start
        r.prompt_tokens, r.cached_tokens, r.output_tokens = prompt, cached, len(times)
    return r


def test_figures_are_vllms():
    results = [result("a", 0, 0.0, [0.1, 0.2, 0.4], prompt=10),
               result("b", 0, 0.0, [0.3, 0.5], prompt=20),
               result("c", 0, 0.0, [], prompt=5, ok=False)]
    s = summarize(results, duration=2.0, start=0.0, percentiles=(50, 99),
                  slos={"ttft": 200, "tpot": 200})
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 5
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["total_token_throughput"] == pytest.approx(17.5)
    assert s["mean_ttft_ms"] == pytest.approx(200.0)  # 100 and 300
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    # TPOT per request: (latency - ttft) / (tokens - 1): 150 and 200 ms
    assert s["mean_tpot_ms"] == pytest.approx(175.0)
    # ITL: every gap pooled: 100, 200 (a) and 200 (b)
    assert s["mean_itl_ms"] == pytest.approx(500.0 / 3)
    assert s["mean_e2el_ms"] == pytest.approx(450.0)
    assert s["p99_e2el_ms"] == pytest.approx(400 + 0.99 * 100)  # numpy's linear percentile
    assert s["request_goodput"] == pytest.approx(0.5)  # only a meets ttft <= 200 ms
    assert s["max_output_tokens_per_s"] == 5  # every token within the first second


def test_multi_turn_figures():
    results = [result("a", 0, 0.0, [0.5, 0.6], prompt=10),
               result("a", 1, 1.0, [1.1, 1.2], prompt=30, cached=12),
               result("b", 0, 0.0, [0.3, 0.4], prompt=10),
               result("b", 1, 1.0, [1.2, 1.3], prompt=30, cached=12)]
    s = summarize(results, 2.0, 0.0, multi_turn=True)
    assert s["cache_hit_rate"] == pytest.approx(24 / 80)
    assert s["later_turns_cache_hit_rate"] == pytest.approx(24 / 60)
    assert s["mean_ttft_first_turn_ms"] == pytest.approx(400.0)
    assert s["mean_ttft_later_turns_ms"] == pytest.approx(150.0)
    text = format_summary(s)
    for label in ("Successful requests:", "Request throughput (req/s):", "Mean TTFT (ms):",
                  "P99 ITL (ms):", "Median E2EL (ms):", "Cache hit rate (later turns):"):
        assert label in text
    table = compare_table({"session": {"summary": s}, "resend": {"summary": s}})
    assert table.splitlines()[0] == "| metric | session | resend |"
    assert "| Cache hit rate (later turns) | 0.400 | 0.400 |" in table


def test_goodput_slos():
    assert parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:0"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_arrivals():
    assert arrival_times(4, float("inf"), 1.0, random.Random(0)) == [0.0] * 4
    times = arrival_times(20000, 50.0, 1.0, random.Random(1))
    assert times == arrival_times(20000, 50.0, 1.0, random.Random(1))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.05)


def test_workloads_come_from_the_seed():
    a = W.synthetic_sharegpt(50, random.Random(3), 64, 32)
    b = W.synthetic_sharegpt(50, random.Random(3), 64, 32)
    assert [c.turns[0].text for c in a] == [c.turns[0].text for c in b]
    lengths = sorted(c.turns[0].output_len for c in a)
    assert 4 <= lengths[0] and lengths[-1] <= 8 * 32 and lengths[0] < lengths[-1]
    fixed = W.fixed(3, random.Random(0), 10, 7)
    assert all(len(c.turns[0].text.split()) == 10 and c.turns[0].output_len == 7 for c in fixed)
    convs = W.multi_turn(4, random.Random(0), 3, 16, 8, think_time=2.0)
    assert all(len(c.turns) == 3 and c.think_times[0] == 0 and len(c.think_times) == 3
               for c in convs)
    assert {t.output_len for c in convs for t in c.turns} == {8}  # replies of one length
    spread = W.multi_turn(20, random.Random(0), 3, 16, 100, think_time=0.0, output_sigma=0.5)
    replies = sorted(t.output_len for c in spread for t in c.turns)
    assert 4 <= replies[0] < 100 < replies[-1] <= 400  # around 100, not all alike
    counter = lambda text: len(text.split()) * 2  # noqa: E731  a stand-in tokenizer
    assert counter(W.text_of(9, random.Random(0), counter)) == 10  # the first length >= 9


def test_sharegpt_file(tmp_path):
    data = [{"id": "1", "conversations": [
                {"from": "human", "value": "word " * 40}, {"from": "gpt", "value": "x" * 400},
                {"from": "human", "value": "again " * 10}, {"from": "gpt", "value": "y" * 80}]},
            {"id": "2", "conversations": [{"from": "human", "value": "hi"},
                                          {"from": "gpt", "value": "z" * 100}]},  # too short
            {"id": "3", "conversations": [{"from": "system", "value": "s"}]},
            "not a conversation"]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    single = W.sharegpt(10, random.Random(0), str(path))
    assert len(single) == 1 and single[0].turns[0].output_len == 100
    multi = W.multi_turn(5, random.Random(0), 4, 16, 8, 0.0, path=str(path))
    assert len(multi) == 1 and [t.text for t in multi[0].turns] == ["word " * 40, "again " * 10]
    with pytest.raises(ValueError):
        W.sharegpt(1, random.Random(0), str(tmp_path / "sharegpt.json"), max_input=1)
