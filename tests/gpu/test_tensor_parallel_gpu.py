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
    graphed = run(path, 2, "bf16", batch, max_batch_size=8)
    eager = run(path, 2, "bf16", batch, max_batch_size=8, cuda_graphs=False)
    assert graphed == eager

