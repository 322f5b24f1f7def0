"""The `turbomq` command and the README's `make serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers import demo_model_dir

ROOT = Path(__file__).resolve().parents[2]
TURBOMQ = [sys.executable, "-m", "turbomq.worker.cli"]


def run(args, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, **kw)


def test_help_lists_commands():
    out = run(TURBOMQ + ["--help"])
    assert out.returncode == 0
    for command in ("generate", "demo-model", "convert", "broker", "worker", "up", "chat",
                    "gateway", "bench"):
        assert command in out.stdout


def test_generate_json_contract():
    out = run(TURBOMQ + ["generate", "--model", demo_model_dir(), "--input-ids", "0,5,6,7",
                         "--max-tokens", "7", "--temperature", "0", "--json"])
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert len(result["token_ids"]) <= 7 and isinstance(result["text"], str)
    assert result["usage"]["prompt_tokens"] == 4


def test_generate_bad_input_is_a_clear_error():
    out = run(TURBOMQ + ["generate", "--model", demo_model_dir(), "--input-ids", "5,999999",
                         "--max-tokens", "3"])
    assert out.returncode == 2 and "outside the vocabulary" in out.stderr
    out = run(TURBOMQ + ["generate", "--model", "/nonexistent", "--prompt", "x"])
    assert out.returncode == 2 and "error" in out.stderr


def test_convert_then_generate_same_tokens(tmp_path):
    dst = tmp_path / "converted"
    out = run(TURBOMQ + ["convert", demo_model_dir(), str(dst)])
    assert out.returncode == 0, out.stderr
    args = ["--input-ids", "0,9,10", "--max-tokens", "8", "--temperature", "0", "--json"]
    a = json.loads(run(TURBOMQ + ["generate", "--model", demo_model_dir()] + args).stdout)
    b = json.loads(run(TURBOMQ + ["generate", "--model", str(dst)] + args).stdout)
    assert a["token_ids"] == b["token_ids"]


def test_make_serve_answers_with_a_real_model():
    # --smoke: broker + 2 workers + redis serving SmolLM2-135M-Instruct (make's
    # default model); one chat question streamed through the client; exit.
    out = run(["make", "-s", "serve", "SERVE_ARGS=--smoke"], cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "Clients connect to tcp://127.0.0.1:" in out.stdout
    assert "The capital of France is Paris." in out.stdout
    assert "[stop;" in out.stdout


def test_up_with_a_broker_pair_and_the_gateway(tmp_path):
    # --brokers 2: two brokers, each worker registers with both, the smoke
    # client is given both fronts; --gateway-port: the gateway too, given both
    # fronts, and the smoke sends one completion through it.
    out = run(TURBOMQ + ["up", "--model", demo_model_dir(), "--workers", "1", "--brokers", "2",
                         "--gateway-port", "0", "--smoke"])
    assert out.returncode == 0, out.stderr
    fronts = out.stdout.split("Clients connect to ", 1)[1].splitlines()[0].split(", ")
    assert len(fronts) == 2 and all(f.startswith("tcp://127.0.0.1:") for f in fronts)
    assert out.stdout.count("  broker   front ") == 2
    assert "[length;" in out.stdout or "[stop;" in out.stdout
    assert "  gateway  OpenAI API at http://127.0.0.1:" in out.stdout
    assert "[gateway: length; 16 tokens]" in out.stdout or "[gateway: stop;" in out.stdout


def test_generate_over_two_ranks_gives_the_same_tokens():
    args = ["generate", "--model", demo_model_dir(), "--input-ids", "0,5,6,7", "--max-tokens", "9",
            "--temperature", "0", "--json"]
    one = run(TURBOMQ + args)
    two = run(TURBOMQ + args + ["--tensor-parallel", "2"])
    assert two.returncode == 0, two.stderr
    assert json.loads(two.stdout)["token_ids"] == json.loads(one.stdout)["token_ids"]


def test_a_missing_extra_is_named_in_one_line():
    # torch absent (made unimportable): `turbomq generate` says which extra brings it.
    code = ("import sys; sys.modules['torch'] = None\n"
            "from turbomq.worker.cli.main import main\n"
            f"sys.exit(main(['generate', '--model', {demo_model_dir()!r}, '--input-ids', '1,2', "
            "'--max-tokens', '2']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'turbomq[worker]'" in lines[0], out.stderr


def test_the_gateway_without_its_extra_is_named_in_one_line():
    for module in ("starlette", "prometheus_client"):
        code = (f"import sys; sys.modules[{module!r}] = None\n"
                "from turbomq.worker.cli.main import main\n"
                "sys.exit(main(['gateway', '--broker', 'tcp://127.0.0.1:1', '--port', '0']))")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "pip install 'turbomq[gateway]'" in lines[0], out.stderr


def test_the_bench_without_its_extra_is_named_in_one_line():
    code = ("import sys; sys.modules['httpx'] = None\n"
            "from turbomq.worker.cli.main import main\n"
            "sys.exit(main(['bench', '--base-url', 'http://127.0.0.1:1/v1', '--no-progress']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'turbomq[bench]'" in lines[0], out.stderr
