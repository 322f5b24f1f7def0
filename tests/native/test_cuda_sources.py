"""CPU-side checks of the CUDA backend. `make cuda-check` compiles every
native/cuda/*.cu with nvcc for sm_90a; these tests make sure it has sources to
compile, and that worker.ops.cuda stays importable and falls back to the
reference where its kernels cannot run (no GPU, CPU tensors)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_cuda_check_has_sources():
    sources = sorted((ROOT / "native" / "cuda").glob("*.cu"))
    assert sources, "native/cuda has no .cu files for `make cuda-check`"
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"ls native/cuda/\*\.cu \| xargs", makefile), \
        "cuda-check no longer compiles every native/cuda/*.cu"


def test_nvcc_present_for_cuda_check():
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH: `make cuda-check` cannot compile the CUDA sources here")


def test_cpu_tensors_fall_back_to_reference():
    from turbomq.worker.model.ops import LayerKV
    from turbomq.worker.model.ops import cuda as cuda_ops
    from turbomq.worker.model.ops import reference as ref
    from turbomq.worker.model.ops.attention_batch import AttentionBatch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g)
    w = torch.randn(64, generator=g)
    assert torch.equal(cuda_ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    assert torch.equal(cuda_ops.silu_mul(x), ref.silu_mul(x))
    k = torch.zeros(4, 2, 16, 32)
    kv = LayerKV(k, k.clone(), None, None)
    batch = AttentionBatch.build([1, 2], [5, 9], np.array([[0, -1], [1, 2]]), 16)
    q = torch.randn(3, 4, 32, generator=g)
    new = torch.randn(3, 2, 32, generator=g)
    cuda_ops.write_kv(kv, new, new, batch.slot_mapping)
    torch.testing.assert_close(cuda_ops.paged_attention(q, kv, batch, 0.2),
                               ref.paged_attention(q, kv, batch, 0.2))


def test_linear_invariant_reference_and_cpu_fallback():
    """The reference of the batch-invariant GEMM is x @ w.T (one float32
    accumulation, one rounding), and CPU tensors go to it."""
    from turbomq.worker.model.ops import cuda as cuda_ops
    from turbomq.worker.model.ops import reference as ref

    g = torch.Generator().manual_seed(0)
    k = 1032
    x = torch.randn(2, 3, k, generator=g)
    w = torch.randn(24, k, generator=g)
    got = ref.linear_invariant(x, w)
    assert got.shape == (2, 3, 24) and got.dtype == x.dtype
    torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-4)
    xb, wb = x.bfloat16(), w.bfloat16()
    torch.testing.assert_close(ref.linear_invariant(xb, wb).float(),
                               xb.float() @ wb.float().T, rtol=1e-2, atol=1e-1)
    assert torch.equal(cuda_ops.linear_invariant(xb, wb), ref.linear_invariant(xb, wb))


def test_linear_invariant_residual_reference_and_cpu_fallback():
    """linear_invariant(residual=r) on the reference and the CPU fallback is
    r += linear_invariant(x, w) in place, bit for bit, returning r;
    InvariantOps.linear on the reference keeps the separate add."""
    from turbomq.worker.model.ops import cuda as cuda_ops
    from turbomq.worker.model.ops import reference as ref
    from turbomq.worker.model.ops.invariant import InvariantOps

    g = torch.Generator().manual_seed(1)
    k = 576
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(2, 3, k, generator=g).to(dtype)
        w = (torch.randn(40, k, generator=g) * 0.05).to(dtype)
        res = (torch.randn(2, 3, 40, generator=g) * 3).to(dtype)
        want = res.clone().add_(ref.linear_invariant(x, w))
        for fn in (ref.linear_invariant, cuda_ops.linear_invariant):
            r = res.clone()
            got = fn(x, w, residual=r)
            assert got is r
            assert torch.equal(got, want), (fn.__module__, dtype)
        r = res.clone()
        got = InvariantOps(ref).linear(x, w, residual=r)
        assert got is r and torch.equal(got, want)


def test_linear_invariant_silu_cpu_fallback():
    """linear_invariant(silu=True) on CPU tensors is silu_mul of the
    reference GEMM, bit for bit (into `out` when given)."""
    from turbomq.worker.model.ops import cuda as cuda_ops
    from turbomq.worker.model.ops import reference as ref
    from turbomq.worker.model.ops.invariant import InvariantOps

    g = torch.Generator().manual_seed(2)
    k = 576
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(2, 3, k, generator=g).to(dtype)
        w = (torch.randn(48, k, generator=g) * 0.05).to(dtype)
        want = ref.silu_mul(ref.linear_invariant(x, w))
        assert want.shape == (2, 3, 24)
        assert torch.equal(cuda_ops.linear_invariant(x, w, silu=True), want)
        out = torch.empty_like(want)
        assert cuda_ops.linear_invariant(x, w, silu=True, out=out) is out
        assert torch.equal(out, want)
        assert torch.equal(InvariantOps(ref).linear(x, w, silu=True), want)


def test_prefill_partitions_keep_the_launch_to_one_wave():
    """The prefill kernel splits over keys only where its blocks would fill
    under half a wave, into as many partitions as keep the launch within one
    wave of `per_sm` blocks an SM, each of at least PREFILL_MIN_PARTITION
    keys (a multiple of 64) of the longest context."""
    from turbomq.worker.model.ops import cuda as cuda_ops

    plan = cuda_ops.plan_prefill_partitions
    least = cuda_ops.PREFILL_MIN_PARTITION
    assert plan(264, 8192, 132) == (0, 1)  # a long fresh prompt: its tiles fill the GPU
    assert plan(512, 8192, 132, per_sm=3) == (0, 1)  # a 1024-token chunk
    assert plan(1000, 100, 132) == (0, 1)
    # A 129-row turn on an 8k session, 8 KV heads: 9 tiles x 8 KV heads.
    assert plan(72, 8192, 132, per_sm=3) == (least, 5)  # 360 blocks <= 396
    assert plan(72, 8192, 132, per_sm=2) == (least, 3)  # 216 blocks <= 264
    assert plan(72, 16384, 132, per_sm=3) == (least, 5)
    assert plan(64, 300, 132) == (0, 1)  # too few keys to split into 512-key parts
    assert plan(64, 1100, 132) == (least, 3)
    for blocks in range(1, 400):
        for per_sm in (2, 3):
            size, parts = plan(blocks, 8320, 132, per_sm)
            if parts == 1:
                assert size == 0 and 2 * blocks > per_sm * 132
                continue
            assert size == least and least % 64 == 0
            assert parts * least < 8320 + least  # each partition holds its least keys
            assert blocks * parts <= per_sm * 132  # one wave


def test_attention_lengths_are_converted_once_a_step_and_split_by_prompt_length():
    """paged_attention's per-step host data: the longest context of the
    prefill-kernel sequences (>= PREFILL_MIN_Q_LEN new tokens) and of the
    rest, kept on the batch so that later layers reuse it."""
    from turbomq.worker.model.ops import cuda as cuda_ops
    from turbomq.worker.model.ops.attention_batch import AttentionBatch

    long_q = cuda_ops.PREFILL_MIN_Q_LEN
    q_lens, ctx = [1, long_q, 1, long_q + 3], [900, long_q + 40, 70, long_q + 3]
    tables = np.arange(4 * 8).reshape(4, 8)
    batch = AttentionBatch.build(q_lens, ctx, tables, block_size=128)
    assert cuda_ops._max_context(batch, "long") == long_q + 40
    assert cuda_ops._max_context(batch, "short") == 900
    assert cuda_ops._selected(batch, "long").tolist() == [False, True, False, True]
    batch.q_lens_host[0] = 10_000  # not read again this step
    assert cuda_ops._max_context(batch, "short") == 900
    assert cuda_ops._lens(batch)[0].tolist() == q_lens
    only_decode = AttentionBatch.build([1, 1], [5, 9], tables[:2], block_size=128)
    assert cuda_ops._max_context(only_decode, "long") == 1  # no sequence: 1
