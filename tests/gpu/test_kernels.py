"""Every CUDA kernel against the PyTorch reference (worker/ops/reference.py) on
fresh random inputs: relative error ||out - ref|| / ||ref|| within the storage
dtype's tolerance, outputs poisoned first so unwritten elements show.

Skipped, with the reason, where there is no CUDA device or turbomq._native was
built without CUDA (TURBOMQ_CUDA=ON)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from turbomq.worker.model.ops import LayerKV
from turbomq.worker.model.ops import cuda as cuda_ops
from turbomq.worker.model.ops import reference as ref
from turbomq.worker.model.ops.attention_batch import AttentionBatch

_REASON = cuda_ops.unavailable_reason()
if _REASON is not None:
    pytest.skip(f"CUDA kernel tests skipped: {_REASON}", allow_module_level=True)

from kernel_checks import DEV, DTYPES, TOL, gen, poisoned, randn, rel_err  # noqa: E402,F401


# ------------------------------------------------------------------ norms
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 4096), (33, 4104), (5, 8192)])
def test_rms_norm(dtype, rows, hidden, gen):
    x = randn((rows, hidden), dtype, gen, 3.0)
    w = randn((hidden,), dtype, gen)
    out = poisoned((rows, hidden), dtype)
    got = cuda_ops.rms_norm(x, w, 1e-5, out=out)
    assert got is out
    assert rel_err(got, ref.rms_norm(x, w, 1e-5)) < TOL[dtype]


def test_norm_falls_back_on_odd_sizes(gen):
    x = randn((3, 100), torch.bfloat16, gen)
    w = randn((100,), torch.bfloat16, gen)
    assert rel_err(cuda_ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5)) < 1e-6


# ----------------------------------------------------------------- rotary
def cos_sin_table(max_pos: int, d: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,nh,nkv,d", [(1, 4, 4, 64), (37, 32, 8, 128), (5, 8, 1, 64)])
def test_rotary(dtype, tokens, nh, nkv, d, gen):
    # q and k as the model makes them: strided views of one fused qkv row.
    qkv = randn((tokens, (nh + 2 * nkv) * d), dtype, gen)
    q, k, _ = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
    q, k = q.reshape(tokens, nh, d), k.reshape(tokens, nkv, d)
    table = cos_sin_table(4096, d)
    positions = torch.randint(0, 4096, (tokens,), generator=gen, device=DEV)
    q_out, k_out = poisoned((tokens, nh, d), dtype), poisoned((tokens, nkv, d), dtype)
    got_q, got_k = cuda_ops.rotary(q, k, positions, table, q_out=q_out, k_out=k_out)
    expect_q, expect_k = ref.rotary(q, k, positions, table)
    assert rel_err(got_q, expect_q) < TOL[dtype]
    assert rel_err(got_k, expect_k) < TOL[dtype]


# --------------------------------------------------------------- silu_mul
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 64), (17, 14336), (4, 1032)])
def test_silu_mul(dtype, tokens, inter, gen):
    gate_up = randn((tokens, 2 * inter), dtype, gen, 2.0)
    out = poisoned((tokens, inter), dtype)
    got = cuda_ops.silu_mul(gate_up, out=out)
    assert rel_err(got, ref.silu_mul(gate_up)) < TOL[dtype]


# --------------------------------------------------------------- write_kv
def make_pool(num_blocks, nkv, bs, d, kv_dtype, gen):
    """A pool full of finite junk, so unwritten slots differ from written ones."""
    shape = (num_blocks, nkv, bs, d)
    if kv_dtype == torch.int8:
        k = torch.randint(-127, 128, shape, generator=gen, device=DEV, dtype=torch.int8)
        v = torch.randint(-127, 128, shape, generator=gen, device=DEV, dtype=torch.int8)
        ks = torch.rand(shape[:-1], generator=gen, device=DEV) * 0.02 + 0.002
        vs = torch.rand(shape[:-1], generator=gen, device=DEV) * 0.02 + 0.002
        return LayerKV(k, v, ks, vs)
    return LayerKV(randn(shape, kv_dtype, gen), randn(shape, kv_dtype, gen), None, None)


def clone_kv(kv: LayerKV) -> LayerKV:
    return LayerKV(kv.k.clone(), kv.v.clone(),
                   None if kv.k_scale is None else kv.k_scale.clone(),
                   None if kv.v_scale is None else kv.v_scale.clone())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("nkv,d,bs", [(8, 128, 64), (2, 64, 16), (1, 128, 32)])
def test_write_kv(dtype, quantized, nkv, d, bs, gen):
    tokens, num_blocks = 45, 9
    kv = make_pool(num_blocks, nkv, bs, d, torch.int8 if quantized else dtype, gen)
    expect = clone_kv(kv)
    kv_in = randn((tokens, 2 * nkv * d), dtype, gen, 3.0)
    k, v = kv_in.split([nkv * d, nkv * d], dim=-1)
    k = k.contiguous().reshape(tokens, nkv, d)
    v = v.reshape(tokens, nkv, d)  # a strided view, as in the model
    slots = torch.randperm(num_blocks * bs, generator=gen, device=DEV)[:tokens]
    cuda_ops.write_kv(kv, k, v, slots)
    ref.write_kv(expect, k, v, slots)
    torch.cuda.synchronize()
    if not quantized:
        assert torch.equal(kv.k, expect.k) and torch.equal(kv.v, expect.v)
        return
    for got, want in ((kv.k, expect.k), (kv.v, expect.v)):
        diff = (got.int() - want.int()).abs()
        # Same math as the reference; a rounding tie may land one step apart.
        assert diff.max().item() <= 1 and (diff > 0).float().mean().item() < 1e-3
    torch.testing.assert_close(kv.k_scale, expect.k_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(kv.v_scale, expect.v_scale, rtol=1e-6, atol=0)


# --------------------------------------------------------- rotary_write_kv
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("tokens,nh,nkv,d,bs", [(1, 32, 8, 128, 64), (37, 8, 2, 64, 16),
                                                  (5, 4, 1, 128, 32), (3, 6, 3, 32, 16)])
def test_rotary_write_kv(dtype, quantized, tokens, nh, nkv, d, bs, gen):
    """Fused rotary + write_kv: equal to the CUDA rotary then write_kv (same
    math), and to the reference within its tolerances."""
    num_blocks = 9
    kv = make_pool(num_blocks, nkv, bs, d, torch.int8 if quantized else dtype, gen)
    composed, expect = clone_kv(kv), clone_kv(kv)
    qkv = randn((tokens, (nh + 2 * nkv) * d), dtype, gen, 2.0)
    q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
    q, k, v = q.reshape(tokens, nh, d), k.reshape(tokens, nkv, d), v.reshape(tokens, nkv, d)
    table = cos_sin_table(4096, d)
    positions = torch.randint(0, 4096, (tokens,), generator=gen, device=DEV)
    slots = torch.randperm(num_blocks * bs, generator=gen, device=DEV)[:tokens]
    q_out = poisoned((tokens, nh, d), dtype)
    got_q = cuda_ops.rotary_write_kv(q, k, v, positions, table, kv, slots, q_out=q_out)
    assert got_q is q_out
    cq, ck = cuda_ops.rotary(q, k, positions, table)
    cuda_ops.write_kv(composed, ck, v, slots)
    eq = ref.rotary_write_kv(q, k, v, positions, table, expect, slots)
    torch.cuda.synchronize()
    assert torch.equal(got_q, cq)
    assert rel_err(got_q, eq) < TOL[dtype]
    for got, same in ((kv.k, composed.k), (kv.v, composed.v)):
        assert torch.equal(got, same)
    if quantized:
        assert torch.equal(kv.k_scale, composed.k_scale) and torch.equal(kv.v_scale, composed.v_scale)
        for got, want in ((kv.k, expect.k), (kv.v, expect.v)):
            diff = (got.int() - want.int()).abs()
            assert diff.max().item() <= 1 and (diff > 0).float().mean().item() < 1e-3
        torch.testing.assert_close(kv.k_scale, expect.k_scale, rtol=1e-6, atol=0)
    else:
        assert torch.equal(kv.k, expect.k) and torch.equal(kv.v, expect.v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nh,nkv,d,bs,hidden", [(32, 8, 128, 64, 4096), (8, 2, 64, 16, 1024)])
@pytest.mark.parametrize("skip_slot", [False, True])
def test_qkv_rotary_write_kv_fused(dtype, nh, nkv, d, bs, hidden, skip_slot, gen):
    """One GEMV launch (norm, qkv projection, rotary, KV write) equals the
    same ops launched apart, bit for bit, and the reference within tolerance."""
    num_blocks = 5
    kv = make_pool(num_blocks, nkv, bs, d, dtype, gen)
    apart, expect = clone_kv(kv), clone_kv(kv)
    x = randn((1, hidden), dtype, gen)
    w = randn(((nh + 2 * nkv) * d, hidden), dtype, gen, 0.05)
    norm = (randn((hidden,), dtype, gen), 1e-5)
    table = cos_sin_table(4096, d)
    positions = torch.randint(0, 4096, (1,), generator=gen, device=DEV)
    slots = torch.randint(0, num_blocks * bs, (1,), generator=gen, device=DEV)
    if skip_slot:
        slots[0] = -1
    args = (positions, table)
    got = cuda_ops.qkv_rotary_write_kv(x, w, norm, *args, kv, slots, nh,
                                       out=poisoned((1, nh, d), dtype))
    cuda_ops.FUSED_GEMV = False
    try:
        want = cuda_ops.qkv_rotary_write_kv(x, w, norm, *args, apart, slots, nh)
    finally:
        cuda_ops.FUSED_GEMV = True
    assert torch.equal(got, want)
    assert torch.equal(kv.k, apart.k) and torch.equal(kv.v, apart.v)
    if skip_slot:  # the reference has no skipped slots; the kernels' contract
        return
    eq = ref.qkv_rotary_write_kv(x, w, norm, *args, expect, slots, nh)
    assert rel_err(got, eq) < TOL[dtype]
    assert rel_err(kv.k, expect.k) < TOL[dtype] and rel_err(kv.v, expect.v) < TOL[dtype]


@pytest.mark.parametrize("quantized", [False, True])
def test_rotary_write_kv_skips_negative_slots(quantized, gen):
    dtype, tokens, nh, nkv, d, bs, num_blocks = torch.bfloat16, 6, 8, 2, 128, 16, 4
    kv = make_pool(num_blocks, nkv, bs, d, torch.int8 if quantized else dtype, gen)
    composed = clone_kv(kv)
    qkv = randn((tokens, (nh + 2 * nkv) * d), dtype, gen)
    q, k, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
    q, k, v = q.reshape(tokens, nh, d), k.reshape(tokens, nkv, d), v.reshape(tokens, nkv, d)
    table = cos_sin_table(512, d)
    positions = torch.randint(0, 512, (tokens,), generator=gen, device=DEV)
    slots = torch.randperm(num_blocks * bs, generator=gen, device=DEV)[:tokens]
    slots[::2] = -1
    got_q = cuda_ops.rotary_write_kv(q, k, v, positions, table, kv, slots)
    cq, ck = cuda_ops.rotary(q, k, positions, table)
    cuda_ops.write_kv(composed, ck, v, slots)
    assert torch.equal(got_q, cq)
    assert torch.equal(kv.k, composed.k) and torch.equal(kv.v, composed.v)
    if quantized:
        assert torch.equal(kv.k_scale, composed.k_scale) and torch.equal(kv.v_scale, composed.v_scale)


# ------------------------------------------------------------------ gemv
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 14336), (37, 8), (515, 1032)])
def test_gemv(dtype, rows, n, k, gen):
    x = randn((rows, k), dtype, gen)
    w = randn((n, k), dtype, gen, 0.05)
    out = poisoned((rows, n), dtype)
    got = cuda_ops.linear(x, w, out=out, native=True)
    assert got is out
    expect = (x.double() @ w.double().T)
    assert rel_err(got, expect) < TOL[dtype]
    # A row's result does not depend on the other rows (graph buckets pad the batch).
    single = cuda_ops.linear(x[rows - 1:], w, native=True)
    assert torch.equal(single[0], got[rows - 1])


@pytest.mark.parametrize("programmatic", [True, False])
def test_gemv_after_norm_in_graph(programmatic, gen):
    """The GEMV starts while the norm that writes its input still runs
    (programmatic launch) and must wait for it: eager and graph replays with
    fresh inputs, against the reference."""
    dtype, h = torch.bfloat16, 4096
    k = cuda_ops._k
    before = k.programmatic_launch()
    k.set_programmatic_launch(programmatic)
    try:
        w1, w2 = randn((h,), dtype, gen), randn((h,), dtype, gen)
        p1, p2 = randn((6144, h), dtype, gen, 0.02), randn((h, 6144), dtype, gen, 0.02)
        x = randn((2, h), dtype, gen)

        def step():
            a = cuda_ops.linear(cuda_ops.rms_norm(x, w1, 1e-5), p1, native=True)
            b = cuda_ops.rms_norm(a[:, :h], w2, 1e-5)
            return cuda_ops.linear(torch.cat([b, b[:, :6144 - h]], dim=1), p2, native=True)

        def expect():
            a = ref.linear(ref.rms_norm(x, w1, 1e-5), p1)
            b = ref.rms_norm(a[:, :h], w2, 1e-5)
            return ref.linear(torch.cat([b, b[:, :6144 - h]], dim=1), p2)

        assert rel_err(step(), expect()) < TOL[dtype]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for _ in range(3):
            x.copy_(randn((2, h), dtype, gen))
            out.fill_(float("nan"))
            graph.replay()
            assert rel_err(out, expect()) < TOL[dtype]
    finally:
        k.set_programmatic_launch(before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["norm", "silu", "norm+silu", "add", "silu+add"])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 14336), (40, 8), (515, 1032)])
def test_gemv_fused(dtype, rows, mode, n, k, gen):
    """The norm prologue, silu_mul and add-into epilogues against the
    reference composition in the same dtype (the same intermediate roundings;
    in float64 a short K leaves them no room to average out), and batch
    invariance."""
    if "norm" in mode and rows * k * 2 > cuda_ops._k.GEMV_SMEM_BYTES:
        pytest.skip("the fused norm needs x in shared memory")
    x = randn((rows, k), dtype, gen)
    w = randn((2 * n if "silu" in mode else n, k), dtype, gen, 0.05)
    norm = (randn((k,), dtype, gen), 1e-5) if "norm" in mode else None
    silu = "silu" in mode
    residual = randn((rows, n), dtype, gen) if "add" in mode else None
    start = residual.clone() if residual is not None else None
    out = None if residual is not None else poisoned((rows, n), dtype)
    got = cuda_ops.linear(x, w, norm=norm, silu=silu, residual=residual, out=out, native=True)
    assert got is (residual if residual is not None else out)
    expect = ref.linear(x, w, norm=norm, silu=silu,
                        residual=start.clone() if start is not None else None)
    assert rel_err(got, expect) < TOL[dtype]
    last = start[rows - 1:].clone() if start is not None else None
    single = cuda_ops.linear(x[rows - 1:], w, norm=norm, silu=silu, residual=last, native=True)
    assert torch.equal(single[0], got[rows - 1])


@pytest.mark.parametrize("programmatic", [True, False])
def test_fused_gemv_chain_in_graph(programmatic, gen):
    """A decoder layer's projections as fused GEMVs back to back: each starts
    while the previous one runs (programmatic launch), reads the residual
    stream the previous one updated in place; eager and graph replays with
    fresh inputs, against the reference."""
    dtype, h, inter = torch.bfloat16, 4096, 1536
    k = cuda_ops._k
    before = k.programmatic_launch()
    k.set_programmatic_launch(programmatic)
    try:
        n1, n2 = (randn((h,), dtype, gen), 1e-5), (randn((h,), dtype, gen), 1e-5)
        wqkv, wo = randn((1536, h), dtype, gen, 0.02), randn((h, 1024), dtype, gen, 0.02)
        wgu, wd = randn((2 * inter, h), dtype, gen, 0.02), randn((h, inter), dtype, gen, 0.02)
        res = randn((2, h), dtype, gen)

        def step(ops, r):
            a = ops.linear(r, wqkv, norm=n1)
            ops.linear(a[:, :1024].contiguous(), wo, residual=r)
            act = ops.linear(r, wgu, norm=n2, silu=True)
            ops.linear(act, wd, residual=r)
            return r

        start = res.clone()
        assert rel_err(step(cuda_ops, res), step(ref, start.clone())) < TOL[dtype]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(cuda_ops, res)
        for _ in range(3):
            start = randn((2, h), dtype, gen)
            res.copy_(start)
            graph.replay()
            assert rel_err(res, step(ref, start.clone())) < TOL[dtype]
    finally:
        k.set_programmatic_launch(before)


def test_linear_policy(gen):
    x = randn((9, 256), torch.bfloat16, gen)
    w = randn((64, 256), torch.bfloat16, gen)
    assert torch.equal(cuda_ops.linear(x, w), torch.nn.functional.linear(x, w))  # cuBLAS
    x3 = randn((2, 3, 256), torch.bfloat16, gen)  # 6 rows as [2, 3, K]: the GEMV, shaped back
    got = cuda_ops.linear(x3, w, native=True)
    assert got.shape == (2, 3, 64)
    assert rel_err(got, x3.double() @ w.double().T) < TOL[torch.bfloat16]
    x1 = randn((1, 256), torch.bfloat16, gen)
    assert rel_err(cuda_ops.linear(x1, w), x1.double() @ w.double().T) < TOL[torch.bfloat16]


# -------------------------------------------------------- paged attention
def make_attention_case(q_lens, ctx_lens, nkv, group, d, bs, dtype, kv_dtype, gen, spare=3):
    """Random q and pool; each sequence's blocks drawn at random from the pool
    (non-contiguous), tables padded with -1 past their end."""
    nblocks = [math.ceil(c / bs) for c in ctx_lens]
    num_blocks = sum(nblocks) + spare
    order = torch.randperm(num_blocks, generator=gen, device=DEV).tolist()
    width = max(nblocks) + 2
    tables = np.full((len(ctx_lens), width), -1, dtype=np.int64)
    used = 0
    for s, n in enumerate(nblocks):
        tables[s, :n] = order[used:used + n]
        used += n
    kv = make_pool(num_blocks, nkv, bs, d, kv_dtype, gen)
    batch = AttentionBatch.build(q_lens, ctx_lens, tables, bs, device=DEV)
    q = randn((sum(q_lens), nkv * group, d), dtype, gen)
    return q, kv, batch


def check_attention(q, kv, batch, dtype, partition_size=None, fused_combine=None):
    d = q.shape[-1]
    scale = d ** -0.5
    out = poisoned(q.shape, dtype)
    got = cuda_ops.paged_attention(q, kv, batch, scale, out=out, partition_size=partition_size,
                                   fused_combine=fused_combine)
    assert got is out
    expect = ref.paged_attention(q, kv, batch, scale)
    err = rel_err(got, expect)
    assert err < TOL[dtype], f"relative error {err:.2e}"


KV_KINDS = ["same", "int8"]


@pytest.mark.parametrize("partition_size", [None, 64])
@pytest.mark.parametrize("kv_kind", KV_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_attention(group, d, dtype, kv_kind, partition_size, gen):
    bs = random.choice([16, 32, 64])
    ctx = [1, 17, bs + 1, random.randint(100, 900), random.randint(1500, 3000)]
    random.shuffle(ctx)
    q, kv, batch = make_attention_case([1] * len(ctx), ctx, 2, group, d, bs, dtype,
                                       dtype if kv_kind == "same" else torch.int8, gen)
    check_attention(q, kv, batch, dtype, partition_size)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_kind", KV_KINDS)
def test_decode_attention_long_split(dtype, kv_kind, gen):
    """Few sequences, long contexts: the planner splits the context."""
    ctx = [8191, 5000]
    q, kv, batch = make_attention_case([1, 1], ctx, 8, 4, 128, 64, dtype,
                                       dtype if kv_kind == "same" else torch.int8, gen)
    check_attention(q, kv, batch, dtype)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kv_kind", KV_KINDS)
def test_split_k_combine_in_kernel_and_in_second_launch(fused, kv_kind, gen):
    """Split-K forced (64-key partitions) with the combine fused into the
    attention kernel or in the reduce kernel; prefill rows too."""
    dtype = torch.bfloat16
    q, kv, batch = make_attention_case([1, 5, 1, 1], [1, 300, 777, 64], 8, 4, 128, 64, dtype,
                                       dtype if kv_kind == "same" else torch.int8, gen)
    for _ in range(2):  # the counters must be back at zero for the second call
        check_attention(q, kv, batch, dtype, partition_size=64, fused_combine=fused)


@pytest.mark.parametrize("kv_kind", KV_KINDS)
def test_split_k_graph_replay_with_shorter_contexts(kv_kind, gen):
    """As the decode graphs use it: partitions planned for a context bucket,
    captured once, replayed with shorter contexts (empty partitions)."""
    dtype, nkv, group, d, bs = torch.bfloat16, 8, 4, 128, 64
    q, kv, big = make_attention_case([1, 1, 1], [1024, 1024, 1024], nkv, group, d, bs, dtype,
                                     dtype if kv_kind == "same" else torch.int8, gen)
    tables = big.block_tables.cpu().numpy()
    scale = d ** -0.5
    out = poisoned(q.shape, dtype)
    cuda_ops.paged_attention(q, kv, big, scale, out=out)  # warm-up: counters exist
    _, parts = cuda_ops.plan_partitions(3 * nkv, 1024, cuda_ops._sm_count(DEV))
    assert parts > 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda_ops.paged_attention(q, kv, big, scale, out=out)
    for ctx in ([300, 40, 1], [1024, 1, 129], [65, 700, 1000], [300, 40, 1]):
        big.context_lens.copy_(torch.tensor(ctx, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        actual = AttentionBatch.build([1, 1, 1], ctx, tables, bs, device=DEV)
        err = rel_err(out, ref.paged_attention(q, kv, actual, scale))
        assert err < TOL[dtype], f"contexts {ctx}: relative error {err:.2e}"


@pytest.mark.parametrize("kv_kind", KV_KINDS)
@pytest.mark.parametrize("nkv,group", [(1, 32), (2, 16), (1, 12)])
def test_attention_many_heads_per_kv_head(nkv, group, kv_kind, gen):
    """More than 16 query heads per KV head spans several row tiles."""
    dtype = torch.bfloat16
    q, kv, batch = make_attention_case([1, 1, 3], [300, 77, 129], nkv, group, 128, 16, dtype,
                                       dtype if kv_kind == "same" else torch.int8, gen)
    check_attention(q, kv, batch, dtype)


@pytest.mark.parametrize("partition_size", [None, 64])
@pytest.mark.parametrize("kv_kind", KV_KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_with_history(group, d, dtype, kv_kind, partition_size, gen):
    """Mixed batch: decode rows, prefill without history, prefill after history."""
    bs = random.choice([16, 64])
    q_lens = [1, 7, 33, 64, 5]
    hist = [200, 0, 50, 333, 0]
    ctx = [n + h for n, h in zip(q_lens, hist)]
    q, kv, batch = make_attention_case(q_lens, ctx, 2, group, d, bs, dtype,
                                       dtype if kv_kind == "same" else torch.int8, gen)
    check_attention(q, kv, batch, dtype, partition_size)


@pytest.fixture(params=["mma.sync", "wgmma", "wgmma+tma"])
def prefill_mma(request):
    """The prefill kernel on either kind of MMA (set_prefill_attention_wgmma),
    and on wgmma with its 16-bit tiles loaded by TMA (block size >= 64)."""
    wgmma, tma = request.param != "mma.sync", request.param == "wgmma+tma"
    cuda_ops._k.set_prefill_attention_wgmma(wgmma)
    cuda_ops._k.set_prefill_attention_tma(tma)
    assert cuda_ops._k.prefill_attention_wgmma() == wgmma
    assert cuda_ops._k.prefill_attention_tma() == tma
    yield request.param
    cuda_ops._k.set_prefill_attention_wgmma(cuda_ops.PREFILL_WGMMA)
    cuda_ops._k.set_prefill_attention_tma(cuda_ops.PREFILL_TMA)


@pytest.mark.parametrize("kv_kind", KV_KINDS)
@pytest.mark.parametrize("bs", [16, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_kernel_with_history(group, d, dtype, bs, kv_kind, gen, monkeypatch,
                                     prefill_mma):
    """prefill_attention.cu (forced on whatever the grid), on mma.sync and on
    wgmma, 16-bit and INT8 KV: fresh prompts, prompts after a history (Q
    shorter than K), row counts that do not fill the last 64-row tile, 64-key
    tiles cut short; and beside them sequences of a few new tokens, which
    attention.cu writes into the same output."""
    monkeypatch.setattr(cuda_ops, "PREFILL_ATTENTION", True)
    monkeypatch.setattr(cuda_ops, "_sm_count", lambda device: 1)
    q_lens = [1, 7, 70, 64, 129, 200]
    hist = [300, 0, 50, 333, 0, 1000]
    ctx = [n + h for n, h in zip(q_lens, hist)]
    q, kv, batch = make_attention_case(q_lens, ctx, 2, group, d, bs, dtype,
                                       dtype if kv_kind == "same" else torch.int8, gen)
    check_attention(q, kv, batch, dtype)


@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("kv_kind", KV_KINDS)
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_kernel_split_over_keys(group, fused, kv_kind, bs, gen, monkeypatch,
                                        prefill_mma):
    """Split-K in the prefill kernel (a turn on a long session, few tiles):
    partitions of 64 keys and more, a last one cut short, partitions past a
    tile's keys, combined in the last block or in a second kernel."""
    monkeypatch.setattr(cuda_ops, "PREFILL_ATTENTION", True)
    monkeypatch.setattr(cuda_ops, "PREFILL_MIN_PARTITION", 64)
    monkeypatch.setattr(cuda_ops, "_sm_count", lambda device: 4096)
    q_lens = [128, 64, 70, 200]
    hist = [8000, 1000, 5, 300]
    ctx = [n + h for n, h in zip(q_lens, hist)]
    q, kv, batch = make_attention_case(q_lens, ctx, 2, group, 128, bs, torch.bfloat16,
                                       torch.bfloat16 if kv_kind == "same" else torch.int8, gen)
    nkv = 2
    tiles, num_tiles = cuda_ops._tiles(batch, group, q.device, cuda_ops._k.PREFILL_TILE_ROWS,
                                       "long")
    _, parts = cuda_ops.plan_prefill_partitions(num_tiles * nkv, batch.max_context_len, 4096)
    assert parts > 8
    check_attention(q, kv, batch, torch.bfloat16, fused_combine=fused)


@pytest.mark.parametrize("kv_kind", KV_KINDS)
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("d", [64, 128])
def test_prefill_blocks_an_sm_are_the_occupancy_of_the_form_launched(d, bs, kv_kind,
                                                                     prefill_mma):
    """The split plan's blocks an SM come from the occupancy calculator, for
    the form the launch takes (mma.sync, wgmma, TMA only for 16-bit KV in
    blocks of >= 64 keys): at least one for every form, and on Hopper at
    head_dim 128 the counts the kernels are built for (three on wgmma, two
    on mma.sync)."""
    kv_dtype = torch.int8 if kv_kind == "int8" else torch.bfloat16
    q = torch.empty((1, 8, d), dtype=torch.bfloat16, device=DEV)
    shape = (4, 2, bs, d)
    scales = (torch.ones(shape[:-1], device=DEV),) * 2 if kv_kind == "int8" else (None, None)
    kv = LayerKV(torch.zeros(shape, dtype=kv_dtype, device=DEV),
                 torch.zeros(shape, dtype=kv_dtype, device=DEV), *scales)
    per_sm = cuda_ops.prefill_blocks_per_sm(q, kv)
    assert per_sm >= 1
    assert cuda_ops.prefill_blocks_per_sm(q, kv) == per_sm  # asked once a form
    if d == 128 and torch.cuda.get_device_capability() == (9, 0):
        assert per_sm == (2 if prefill_mma == "mma.sync" else 3)


def test_prefill_kernel_long_prompt_and_fallbacks(gen, monkeypatch, prefill_mma):
    """A 4k-token prompt on the prefill kernel; INT8 KV on it too, and forced
    partitions (deterministic mode) on attention.cu (all against the
    reference)."""
    monkeypatch.setattr(cuda_ops, "PREFILL_ATTENTION", True)
    dtype = torch.bfloat16
    q, kv, batch = make_attention_case([4096], [4096], 8, 4, 128, 64, dtype, dtype, gen)
    check_attention(q, kv, batch, dtype)
    q, kv, batch = make_attention_case([300, 100], [400, 100], 8, 4, 128, 64, dtype, torch.int8,
                                       gen)
    check_attention(q, kv, batch, dtype)
    check_attention(q, kv, batch, dtype, partition_size=64)


@pytest.mark.parametrize("d", [64, 128])
def test_prefill_kernel_ignores_what_lies_past_the_keys(d, gen, monkeypatch, prefill_mma):
    """The cache rows past each sequence's last key, in its last block, hold
    NaN (what a reused block may hold): the TMA path loads them with the
    tile, and its zeroed V rows keep them out of the output; every path
    matches the reference run on a clean copy."""
    monkeypatch.setattr(cuda_ops, "PREFILL_ATTENTION", True)
    dtype, bs = torch.bfloat16, 64
    q_lens, hist = [70, 64, 130], [0, 37, 100]
    ctx = [n + h for n, h in zip(q_lens, hist)]
    q, kv, batch = make_attention_case(q_lens, ctx, 2, 4, d, bs, dtype, dtype, gen)
    clean = clone_kv(kv)
    tables = batch.block_tables.cpu()
    for s, c in enumerate(ctx):
        last = int(tables[s, (c - 1) // bs])
        kv.k[last, :, c % bs or bs:] = float("nan")
        kv.v[last, :, c % bs or bs:] = float("nan")
    scale = d ** -0.5
    got = cuda_ops.paged_attention(q, kv, batch, scale)
    assert torch.isfinite(got).all()
    assert rel_err(got, ref.paged_attention(q, clean, batch, scale)) < TOL[dtype]


@pytest.mark.parametrize("q_lens", [[1] * 7, [1, 9, 40, 1, 3]])
@pytest.mark.parametrize("kv_kind", KV_KINDS)
def test_fixed_partition_launches_over_tiles_in_turn(q_lens, kv_kind, gen, monkeypatch):
    """Deterministic mode's attention (a fixed partition, always combined)
    under a cap on its partials launches over a few tiles at a time: the
    same bits as one launch, decode and prefill rows alike."""
    dtype, d = torch.bfloat16, 128
    ctx = [q + c for q, c in zip(q_lens, [700, 1, 300, 64, 1000, 130, 5])]
    q, kv, batch = make_attention_case(q_lens, ctx, 2, 4, d, 16, dtype,
                                       dtype if kv_kind == "same" else torch.int8, gen)
    outs = []
    for cap in (1 << 40, 1):  # one launch; one tile per launch
        monkeypatch.setattr(cuda_ops, "ATTENTION_PARTIALS_MAX_BYTES", cap)
        outs.append(cuda_ops.paged_attention(q, kv, batch, d ** -0.5, partition_size=64,
                                             always_combine=True))
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[1], ref.paged_attention(q, kv, batch, d ** -0.5)) < TOL[dtype]


@pytest.mark.parametrize("q_lens", [[1] * 7, [1, 9, 40, 1, 3]])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("partition_size", [None, 128])
def test_load_ahead_gives_the_same_bits(q_lens, dtype, d, partition_size, gen):
    """Loading each warp's next group early (16-bit KV) changes when the
    loads happen, not the arithmetic: the same bits as loading in turn,
    split or not, decode and prefill rows."""
    ctx = [q + c for q, c in zip(q_lens, [700, 1, 300, 64, 1000, 130, 5])]
    q, kv, batch = make_attention_case(q_lens, ctx, 2, 4, d, 16, dtype, dtype, gen)
    outs = [cuda_ops.paged_attention(q, kv, batch, d ** -0.5, partition_size=partition_size,
                                     always_combine=partition_size is not None,
                                     load_ahead=ahead)
            for ahead in (False, True)]
    assert torch.equal(outs[0], outs[1])
    assert rel_err(outs[1], ref.paged_attention(q, kv, batch, d ** -0.5)) < TOL[dtype]


def test_attention_after_write_kv(gen):
    """write_kv then attention through the same pool, int8, as a model step does."""
    dtype, nkv, group, d, bs = torch.bfloat16, 4, 4, 128, 16
    q_lens, ctx = [1, 9], [40, 9]
    q, kv, batch = make_attention_case(q_lens, ctx, nkv, group, d, bs, dtype, torch.int8, gen)
    k = randn((sum(q_lens), nkv, d), dtype, gen)
    v = randn((sum(q_lens), nkv, d), dtype, gen)
    expect_kv = clone_kv(kv)
    cuda_ops.write_kv(kv, k, v, batch.slot_mapping)
    ref.write_kv(expect_kv, k, v, batch.slot_mapping)
    got = cuda_ops.paged_attention(q, kv, batch, d ** -0.5)
    expect = ref.paged_attention(q, expect_kv, batch, d ** -0.5)
    assert rel_err(got, expect) < TOL[dtype]


@pytest.mark.parametrize("programmatic", [True, False])
def test_attention_after_the_fused_qkv_gemv_in_graph(programmatic, gen):
    """A decode step's qkv GEMV writes q and the new token's K/V; attention,
    launched while it may still run (programmatic launch: it prefetches its
    K/V rows meanwhile), must read both fresh: graph replays with new inputs
    against the reference ops."""
    dtype, nkv, group, d, bs, hidden = torch.bfloat16, 8, 4, 128, 64, 1024
    nh = nkv * group
    k = cuda_ops._k
    before = k.programmatic_launch()
    k.set_programmatic_launch(programmatic)
    try:
        _, kv, batch = make_attention_case([1], [300], nkv, group, d, bs, dtype, dtype, gen)
        w = randn(((nh + 2 * nkv) * d, hidden), dtype, gen, 0.05)
        norm = (randn((hidden,), dtype, gen), 1e-5)
        table = cos_sin_table(512, d)
        positions = torch.tensor([299], device=DEV)
        x = randn((1, hidden), dtype, gen)

        def step(ops, pool):
            q = ops.qkv_rotary_write_kv(x, w, norm, positions, table, pool, batch.slot_mapping, nh)
            return ops.paged_attention(q, pool, batch, d ** -0.5)

        graph = torch.cuda.CUDAGraph()
        step(cuda_ops, kv)  # warm-up outside the graph
        with torch.cuda.graph(graph):
            out = step(cuda_ops, kv)
        for _ in range(3):
            x.copy_(randn((1, hidden), dtype, gen))
            out.fill_(float("nan"))
            expect_pool = clone_kv(kv)
            graph.replay()
            expect = step(ref, expect_pool)
            assert rel_err(out, expect) < TOL[dtype]
    finally:
        k.set_programmatic_launch(before)


def test_fp32_falls_back_to_reference(gen):
    q, kv, batch = make_attention_case([1, 3], [20, 30], 2, 2, 64, 16, torch.float32,
                                       torch.float32, gen)
    got = cuda_ops.paged_attention(q, kv, batch, 0.125)
    assert rel_err(got, ref.paged_attention(q, kv, batch, 0.125)) < 1e-6


@pytest.mark.parametrize("vocab", [128256, 32000, 50257, 259])
def test_argmax_rows_first_maximum(vocab, gen):
    """The sampler's two-stage argmax equals torch.argmax, ties included."""
    from turbomq.worker.model.sampler import argmax_rows

    x = randn((5, vocab), torch.float32, gen)
    x[1, 3] = x[1, vocab - 2] = 50.0  # a tie across chunks: the lowest id wins
    x[2, :] = 0.0  # all tied
    x[3, vocab // 2] = x[3, vocab // 2 + 1] = 60.0  # a tie inside one chunk
    assert torch.equal(argmax_rows(x), torch.argmax(x, dim=-1))


def test_sampling_queues_without_waiting_for_the_stream(gen):
    """Sampling rows with temperature, top-k/p, min-p and a repetition
    penalty never synchronizes the stream (the engine queues the next step
    while this one runs); the greedy row is the argmax, the same seeds draw
    the same tokens again."""
    from turbomq.worker.engine.sampling_params import SamplingParams, SeedRNG
    from turbomq.worker.model.sampler import sample

    x = randn((4, 32000), torch.float32, gen) * 4
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=50),
              SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05),
              SamplingParams(temperature=0.7, repetition_penalty=1.3)]
    histories = [[1, 2], [3], [4, 5, 6], [7, 8, 9, 31999]]

    def draw(logits):
        return sample(logits, params, [SeedRNG(11 + i) for i in range(4)], histories)

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = draw(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    tokens = got.tolist()
    assert tokens[0] == int(torch.argmax(x[0]))
    assert all(0 <= t < 32000 for t in tokens)
    assert draw(x).tolist() == tokens
