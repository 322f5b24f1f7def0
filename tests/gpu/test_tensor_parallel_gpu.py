"""Tensor parallelism over two GPUs (NCCL): the tokens of one GPU.

Skipped, with the reason, without two CUDA devices or the native kernels."""

from __future__ import annotations

import pytest
import torch

from turbomq.worker import Engine, EngineConfig, SamplingParams
from turbomq.worker.model.ops import cuda as cuda_ops

_REASON = cuda_ops.unavailable_reason()
if _REASON is None and torch.cuda.device_count() < 2:
    _REASON = f"tensor parallel needs 2 CUDA devices, found {torch.cuda.device_count()}"
if _REASON is not None:
    pytest.skip(f"tensor-parallel GPU tests skipped: {_REASON}", allow_module_level=True)

from test_engine_gpu import prompts, tiny_model  # noqa: E402 (after the skip: it skips too)


def run(path: str, tp: int, dtype: str, batch: list, **config) -> list:
    engine = Engine(EngineConfig(model=path, device="cuda", dtype=dtype, block_size=16,
                                 tensor_parallel=tp, **config))
    try:
        params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
        return [r.token_ids for r in engine.generate(input_ids=batch, params=params)]
    finally:
        engine.close()


@pytest.mark.parametrize("head_dim,kv_heads", [(64, 2), (128, 4)])
def test_two_gpus_give_the_tokens_of_one_in_fp32(tmp_path, head_dim, kv_heads):
    path = tiny_model(tmp_path, head_dim, kv_heads)
    batch = prompts(6, 2)
    assert run(path, 2, "fp32", batch) == run(path, 1, "fp32", batch, cuda_graphs=False)


def test_two_gpus_bf16_with_int8_kv_and_eviction(tmp_path):
    """bf16 with an INT8 pool too small for the whole batch at once: every
    request completes, and the split run agrees with the whole one at the
    start of each sequence (bf16 rounds the split sums differently, so a
    long run may part later)."""
    path = tiny_model(tmp_path, 64, 2)
    batch = prompts(6, 3)
    split = run(path, 2, "bf16", batch, kv_dtype="int8", num_kv_blocks=40)
    whole = run(path, 1, "bf16", batch, kv_dtype="int8", cuda_graphs=False)
    assert all(len(x) == 48 for x in split)
    assert sum(x[:8] == y[:8] for x, y in zip(split, whole)) >= 5


def test_two_gpus_graph_decode_equals_eager(tmp_path):
    """Under tensor parallelism every rank captures and replays the same decode
    graphs, all-reduces inside them: the tokens of eager steps, exactly."""
    path = tiny_model(tmp_path, 128, 2)
    batch = prompts(8, 4)
    graphed = run(path, 2, "bf16", batch, max_batch_size=8, prefill_graph_tokens=0,
                  mixed_graph_tokens=0)
    eager = run(path, 2, "bf16", batch, max_batch_size=8, cuda_graphs=False)
    assert graphed == eager


def test_two_gpus_prefill_graphs_answer_like_eager(tmp_path):
    """Lone prompts prefilled by graphs on both ranks (all-reduces inside):
    the greedy tokens of eager prefills (bf16 products on padded rows may
    round apart late in a sequence)."""
    path = tiny_model(tmp_path, 128, 2)
    batch = prompts(6, 7)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    runs = {}
    for tokens in (512, 0):
        engine = Engine(EngineConfig(model=path, device="cuda", dtype="bf16", block_size=16,
                                     tensor_parallel=2, max_batch_size=4,
                                     prefill_graph_tokens=tokens, mixed_graph_tokens=0))
        try:
            runs[tokens] = [engine.generate(input_ids=[p], params=params)[0].token_ids
                            for p in batch]
            if tokens:
                assert engine.runner.prefill_graphs.replays == len(batch)
        finally:
            engine.close()
    assert sum(a[:16] == b[:16] for a, b in zip(runs[512], runs[0])) >= len(batch) - 1



def test_two_gpus_mixed_graphs_answer_like_eager(tmp_path):
    """Steps of prefill chunks beside decode rows through mixed-step graphs on
    both ranks (all-reduces inside the pieces, attention between them): the
    greedy tokens of eager steps (bf16 on padded rows may round apart late)."""
    path = tiny_model(tmp_path, 128, 2)
    batch = prompts(8, 9)
    graphed = run(path, 2, "bf16", batch, max_batch_size=8, max_num_batched_tokens=256,
                  mixed_graph_tokens=2048)
    eager = run(path, 2, "bf16", batch, max_batch_size=8, max_num_batched_tokens=256,
                mixed_graph_tokens=0)
    assert sum(a[:16] == b[:16] for a, b in zip(graphed, eager)) >= len(batch) - 1


def _peer_all_reduce_rank(tp, rank: int, mode: str) -> None:
    """One rank: the peer-memory all-reduce against NCCL's, bit for bit (two
    ranks: one rounding of a + b either way), over messages of changing size
    (each a different grid), with the residual add fused, and replayed from a
    CUDA graph with fresh inputs (up to 2048 rows: several vectors a thread,
    and past 12 MiB pulled whatever the mode). "ll": messages up to 256 KiB
    (32 rows) take the low-latency kernel, larger ones the pushing kernel,
    interleaved."""
    from turbomq.worker.model.ops import cuda as cuda_ops

    cuda_ops._k.set_all_reduce_push(mode != "pull")
    cuda_ops._k.set_all_reduce_ll_bytes(cuda_ops._k.ALL_REDUCE_LL_MAX_BYTES if mode == "ll" else 0)
    assert tp.peer is not None, "no peer all-reduce between the two GPUs"
    g = torch.Generator(device="cuda").manual_seed(rank)
    for rows, dtype in [(1, torch.bfloat16), (3, torch.float16), (64, torch.bfloat16),
                        (1, torch.float16), (128, torch.bfloat16), (2, torch.bfloat16),
                        (32, torch.bfloat16), (33, torch.float16), (1024, torch.bfloat16),
                        (777, torch.float16), (2048, torch.bfloat16)] * 3:
        x = torch.randn(rows, 4096, generator=g, device="cuda", dtype=dtype)
        res = torch.randn(rows, 4096, generator=g, device="cuda", dtype=dtype)
        assert tp.peer.fits(x)
        want = x.clone()
        dist_all_reduce(want)
        got = x.clone()
        tp.all_reduce(got)
        assert torch.equal(got, want), f"all_reduce, {rows} rows"
        fused = res.clone()
        tp.all_reduce_into(fused, x.clone())
        assert torch.equal(fused, res + want), f"all_reduce_into, {rows} rows"
    # captured once, replayed with new inputs: the flags live on the device
    x = torch.zeros(4, 4096, device="cuda", dtype=torch.bfloat16)
    res = torch.zeros_like(x)
    graph = _captured(lambda: tp.all_reduce_into(res, x))
    for step in range(20):
        new_x = torch.randn(x.shape, generator=g, device="cuda", dtype=x.dtype)
        new_res = torch.randn(x.shape, generator=g, device="cuda", dtype=x.dtype)
        x.copy_(new_x)
        res.copy_(new_res)
        graph.replay()
        want = new_x.clone()
        dist_all_reduce(want)
        assert torch.equal(res, new_res + want), f"graph replay {step}"
    torch.cuda.synchronize()


def dist_all_reduce(t: torch.Tensor) -> None:
    import torch.distributed as dist

    dist.all_reduce(t)


@pytest.mark.parametrize("mode", ["push", "pull", "ll"])
def test_peer_all_reduce_equals_nccl_and_replays_in_graphs(mode, monkeypatch):
    monkeypatch.setenv("TURBOMQ_PEER_ALL_REDUCE_BYTES", str(16 << 20))  # 2048 rows (the ranks read it)
    _spawn_ranks(_peer_all_reduce_rank, mode)


def _spawn_ranks(body, *args) -> None:
    """Runs body(tp, rank, *args) on two spawned ranks of a tensor-parallel
    group; fails with what they reported."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    failures = ctx.SimpleQueue()
    procs = [ctx.Process(target=_run_rank, args=(body, r, port, args, failures)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    errors = []
    while not failures.empty():
        errors.append(failures.get())
    assert not errors, errors
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def _run_rank(body, rank: int, port: int, args: tuple, failures) -> None:
    from turbomq.worker.model.parallel import ParallelConfig, TensorParallel

    tp = TensorParallel(ParallelConfig(2, rank, f"tcp://127.0.0.1:{port}"),
                        torch.device("cuda", rank))
    try:
        body(tp, rank, *args)
    except BaseException as exc:  # reported to the test, which fails on it
        failures.put(f"rank {rank}: {exc!r}")
        raise
    finally:
        tp.leave()


def _captured(fn) -> torch.cuda.CUDAGraph:
    """fn() captured once into a CUDA graph, after a warm-up run on a side
    stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph
