"""Deterministic mode through the service on one GPU: a real broker and two
CUDA workers started with --deterministic; the worker running more of the
streams is SIGKILLed mid-run. The broker sends its requests on to the other
worker with the tokens their clients already have, and every stream ends
with exactly the tokens of a fault-free engine run in this process, greedy
and seeded, whichever worker computed which part and in what batch.

Skipped, with the reason, where there is no CUDA device, the native module
lacks its CUDA kernels or the broker's data plane, or pyzmq is missing."""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest

from turbomq.worker.model.ops import cuda as cuda_ops

_REASON = cuda_ops.unavailable_reason()
if _REASON is None:
    from turbomq import _native
    if not hasattr(_native, "broker"):
        _REASON = "turbomq._native was built without the broker (TURBOMQ_BROKER=ON)"
if _REASON is not None:
    pytest.skip(f"deterministic failover GPU test skipped: {_REASON}", allow_module_level=True)
pytest.importorskip("zmq", reason="the service needs pyzmq")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
from conftest import wait_until  # noqa: E402
from test_deterministic_gpu import SAMPLING, VOCAB, engine, model_dir  # noqa: E402
from test_service import client_for, cluster, read_streams_killing_a_worker  # noqa: E402,F401

WORKER_FLAGS = ("--model", model_dir(), "--device", "cuda", "--dtype", "bf16", "--deterministic",
                "--block-size", "16", "--num-kv-blocks", "2048")


@pytest.mark.parametrize("sampling", SAMPLING)
def test_a_worker_killed_mid_stream_changes_no_token(cluster, client_for, sampling):
    # Long enough that the kill lands while both workers still generate: a
    # GPU finishes 24 tokens before the client has read a few.
    params = dataclasses.replace(SAMPLING[sampling], max_tokens=400)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.choice([5, 60, 300]))]
               for _ in range(20)]
    want = [r.token_ids for r in engine("auto").generate(input_ids=prompts, params=params)]
    svc = cluster()
    client = client_for(svc.front, timeout=120)
    for wid in ("w0", "w1"):
        svc.start_worker(wid, slots=16, extra=WORKER_FLAGS)
    for wid in ("w0", "w1"):
        svc.wait_ready(wid, timeout=120)
    wait_until(lambda: client.health()["workers"] == 2, 60, "2 workers registered")
    sample = {"temperature": params.temperature, "top_p": params.top_p, "seed": params.seed}
    streams = [client.generate(input_ids=p, max_tokens=params.max_tokens, ignore_eos=True,
                               stream=True, **{k: v for k, v in sample.items() if v is not None})
               for p in prompts]
    tokens, _ = read_streams_killing_a_worker(svc, streams, 12, 4)
    assert tokens == want
    stats = client.stats()
    assert stats["workers_lost"] == 1 and stats["redispatches_resumed"] >= 1
