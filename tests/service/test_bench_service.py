"""`turbomq bench` against live services: a real broker, a real CPU worker
(demo model) and a real gateway; small numbers. The benchmark runs as the
`turbomq bench` command and its --out files are read back."""

from __future__ import annotations

import json
import subprocess

from test_gateway import MODEL, stack  # noqa: F401 (the module's live stack)
from helpers import demo_model_dir
from test_service import CHILD_ENV, PY

BENCH = [PY, "-m", "turbomq.worker.cli", "bench", "--no-progress"]


def bench(*args: str) -> subprocess.CompletedProcess:
    out = subprocess.run(BENCH + list(args), capture_output=True, text=True, timeout=300,
                         env=CHILD_ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_multi_turn_sessions_and_resends_through_the_broker(stack, tmp_path):
    svc, _ = stack
    out = bench("--broker", svc.front, "--workload", "multi-turn", "--num-prompts", "3",
                "--turns", "2", "--input-len", "12", "--output-len", "6", "--think-time", "0.05",
                "--multi-turn-mode", "session,resend", "--ignore-eos", "--out", str(tmp_path))
    assert "Serving Benchmark Result: session" in out.stdout
    assert "Serving Benchmark Result: resend" in out.stdout
    runs = {m: json.loads((tmp_path / m / "results.json").read_text()) for m in ("session",
                                                                                 "resend")}
    for mode, doc in runs.items():
        s = doc["summary"]
        assert s["completed"] == 6 and s["failed"] == 0, mode
        assert s["total_output_tokens"] == 36  # ignore_eos: exactly the output length
        assert doc["config"]["multi_turn_mode"] == mode
        assert (tmp_path / mode / "latency_cdf.png").stat().st_size > 0
        assert (tmp_path / mode / "throughput.png").stat().st_size > 0
    # A session's later turns reuse its resident KV; a resend reuses none of it
    assert runs["session"]["summary"]["later_turns_cache_hit_rate"] > 0.3
    assert runs["resend"]["summary"]["later_turns_cache_hit_rate"] == 0
    compare = (tmp_path / "compare.md").read_text()
    assert "| metric | session | resend |" in compare and "--broker " + svc.front in compare
    assert (tmp_path / "compare_latency_cdf.png").is_file()
    # earlier runs side by side, without running anything
    bench("--compare", str(tmp_path / "session" / "results.json"),
          str(tmp_path / "resend" / "results.json"), "--out", str(tmp_path / "again"))
    again = (tmp_path / "again" / "compare.md").read_text()
    assert "| metric | session | resend |" in again and "--multi-turn-mode session,resend" in again


def test_a_shared_system_prompt_is_prefilled_once(stack, tmp_path):
    """Conversations that open with the same system message: the worker's
    prefix cache computes it for the first one only (one worker here)."""
    svc, _ = stack
    bench("--broker", svc.front, "--workload", "multi-turn", "--num-prompts", "4",
          "--turns", "2", "--input-len", "8", "--output-len", "4", "--think-time", "0.05",
          "--system-prompt-len", "200", "--request-rate", "20", "--ignore-eos",
          "--tokenizer", demo_model_dir(), "--out", str(tmp_path))
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["config"]["system_prompt_len"] == 200
    assert doc["summary"]["completed"] == 8
    first = [r for r in doc["requests"] if r["turn"] == 0]
    assert sorted(r["cached_tokens"] > 0 for r in first) == [False, True, True, True]
    assert doc["summary"]["first_turns_without_reuse"] == 1


def test_sharegpt_file_through_the_gateway(stack, tmp_path):
    _, gw = stack
    data = [{"conversations": [{"from": "human", "value": f"Tell me a story number {i} " * 3},
                               {"from": "gpt", "value": "Once upon a time " * 2}]}
            for i in range(6)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    out = bench("--base-url", gw.url + "/v1", "--workload", "sharegpt", "--dataset-path",
                str(path), "--num-prompts", "4", "--request-rate", "50", "--max-concurrency", "2",
                "--goodput", "e2el:600000", "--out", str(tmp_path / "out"))
    assert "Request goodput (req/s):" in out.stdout
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    s = doc["summary"]
    assert s["completed"] == 4 and s["request_goodput"] > 0 and doc["config"]["model"] is None
    assert all(r["prompt_tokens"] > 0 and r["output_tokens"] > 0 for r in doc["requests"])


def test_chat_sessions_through_the_gateway(stack, tmp_path):
    _, gw = stack
    bench("--base-url", gw.url + "/v1", "--model", MODEL, "--workload", "multi-turn",
          "--num-prompts", "2", "--turns", "2", "--input-len", "12", "--output-len", "6",
          "--think-time", "0", "--ignore-eos", "--out", str(tmp_path))
    s = json.loads((tmp_path / "results.json").read_text())["summary"]
    assert s["completed"] == 4 and s["later_turns_cache_hit_rate"] > 0.3


def test_bad_targets_are_clear_errors():
    out = subprocess.run(BENCH + ["--workload", "fixed"], capture_output=True, text=True,
                         timeout=60, env=CHILD_ENV)
    assert out.returncode == 2 and "give one target" in out.stderr
    out = subprocess.run(BENCH + ["--broker", "tcp://127.0.0.1:1", "--workload", "sharegpt"],
                         capture_output=True, text=True, timeout=60, env=CHILD_ENV)
    assert out.returncode == 2 and "--dataset-path" in out.stderr
