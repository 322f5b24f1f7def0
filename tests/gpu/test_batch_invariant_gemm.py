"""The batch-invariant GEMM (native/cuda/gemm_invariant.cu, ops.linear_invariant):
within tolerance of the reference and of cuBLAS, and bit-identical row by
row whatever the batch: a row alone, the first rows, gathered subsets
(rows at new positions), the same rows among random others, sizes either
side of every tiling switch, each tiling forced (the transposed shape's few
rows, and every tile of the tiled shape: one accumulation over K gives them
all the same bits), eager or replayed in a CUDA graph. The fused residual
add and silu_mul stores equal the GEMM followed by the separate kernel, bit
for bit, and stay batch-invariant. The folded norm (each row's totals times
rsqrt(mean(x^2) + eps), its sum of squares in one order) gives the same
bits in every tiling, the transposed shape's own sums included.

Skipped, with the reason, where there is no CUDA device or turbomq._native was
built without CUDA (TURBOMQ_CUDA=ON)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from turbomq.worker.model.ops import cuda as cuda_ops
from turbomq.worker.model.ops import reference as ref

_REASON = cuda_ops.unavailable_reason()
if _REASON is not None:
    pytest.skip(f"CUDA kernel tests skipped: {_REASON}", allow_module_level=True)

from kernel_checks import DEV, DTYPES, TOL, gen, poisoned, randn, rel_err  # noqa: E402,F401

# Llama-3-8B's projections (qkv, o, gate_up, down, LM head) as (N, K).
SHAPES = [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
ROWS = [1, 3, 8, 9, 64, 65, 200, 1024, 4096]
MAX_MACS = 6e11  # rows x N x K per case: keeps the reference's float32 matmul quick
TRANSPOSED = ["transposed", "transposed4"]
TILED = ["64x128", "256x128"] + [f"128x{c}" for c in range(64, 257, 32)]
FEW = cuda_ops._k.GEMM_INVARIANT_TRANSPOSED_MAX_ROWS


def tilings(rows: int) -> list[str]:
    """The tilings that take `rows` rows."""
    return (TRANSPOSED if rows <= FEW else []) + TILED


def assert_rows_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    same = (got.view(torch.int16) == want.view(torch.int16)).all(dim=-1)
    bad = (~same).nonzero().flatten().tolist()
    assert not bad, f"{what}: {len(bad)} rows differ, first {bad[:8]}"


def test_tiling_choice():
    """The transposed shape up to FEW rows (two warps a block with a residual
    add or silu_mul, four without), 64 x 128 to 64 rows, then the tile whose
    rounds finish first (H100: 132 SMs)."""
    t = cuda_ops._k.gemm_invariant_tiling
    assert t(1, 4096, 4096) == (0, 64) and t(FEW, 6144, 4096) == (0, 64)
    assert t(1, 4096, 4096, residual=True) == (0, 32)
    assert t(FEW, 4096, 14336, residual=True) == (0, 32)
    assert t(1, 28672, 4096, silu=True) == (0, 32)
    assert t(FEW + 1, 4096, 4096) == (64, 128) and t(128, 4096, 4096) == (64, 128)
    assert t(8192, 6144, 4096) == (128, 256)
    assert t(300, 4096, 4096)[0] == 128
    assert t(256, 28672, 4096) == (128, 224)  # 2 x 128 tiles: one round on 132 SMs
    with pytest.raises(ValueError):
        t(3, 4100, 4096)  # N not a multiple of 8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k", [(r, n, k) for n, k in SHAPES for r in ROWS
                                      if r * n * k <= MAX_MACS])
def test_matches_reference(dtype, rows, n, k, gen):
    x = randn((rows, k), dtype, gen)
    w = randn((n, k), dtype, gen, 0.02)
    out = poisoned((rows, n), dtype)
    got = cuda_ops.linear_invariant(x, w, out=out)
    assert got is out
    assert rel_err(got, ref.linear_invariant(x, w)) < TOL[dtype]
    assert rel_err(got, F.linear(x, w)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k", [(1, 520, 1032), (5, 136, 200), (37, 520, 1032),
                                      (200, 1000, 8), (65, 136, 11008), (300, 8, 520),
                                      (8, 4104, 72)])
def test_odd_shapes(dtype, rows, n, k, gen):
    """N not a multiple of any tile, K not a multiple of the 64-wide k tile:
    every tiling agrees bit for bit, within tolerance of the reference."""
    x = randn((rows, k), dtype, gen)
    w = randn((n, k), dtype, gen, 0.05)
    want = cuda_ops.linear_invariant(x, w, out=poisoned((rows, n), dtype), tiling="64x128")
    assert rel_err(want, ref.linear_invariant(x, w)) < TOL[dtype]
    for tiling in tilings(rows):
        got = cuda_ops.linear_invariant(x, w, out=poisoned((rows, n), dtype), tiling=tiling)
        assert_rows_equal(got, want, f"{tiling} vs 64x128")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 14336)])
def test_rows_bit_identical_whatever_the_batch(dtype, n, k, gen):
    total = 4096
    x = randn((total, k), dtype, gen)
    w = randn((n, k), dtype, gen, 0.02)
    full = cuda_ops.linear_invariant(x, w)
    # Leading rows, sizes either side of every tiling switch.
    for rows in (1, 2, 8, 9, 15, 63, 64, 65, 127, 128, 129, 200, 512, 513, 1000):
        assert_rows_equal(cuda_ops.linear_invariant(x[:rows], w), full[:rows], f"first {rows} rows")
    perm = torch.randperm(total, generator=gen, device=DEV)
    for rows in (1, 7, 64, 65, 300):
        idx = perm[:rows]
        # Gathered: each row sits at a new position in a smaller batch.
        assert_rows_equal(cuda_ops.linear_invariant(x[idx], w), full[idx], f"{rows} gathered rows")
        # In place among random rows: same positions, other neighbours.
        size = int(idx.max().item()) + 1
        mixed = randn((size, k), dtype, gen, 10.0)
        mixed[idx] = x[idx]
        got = cuda_ops.linear_invariant(mixed, w)
        assert_rows_equal(got[idx], full[idx], f"{rows} rows among {size} random ones")
    # A row alone anywhere in the batch.
    for r in (0, 1, 17, 4095):
        assert_rows_equal(cuda_ops.linear_invariant(x[r:r + 1], w), full[r:r + 1], f"row {r} alone")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 64, 65, 200, 1024])
@pytest.mark.parametrize("mode", ["plain", "residual", "silu", "norm", "silu+norm"])
def test_tilings_agree(dtype, rows, mode, gen):
    """Every tiling gives the bits of the 64 x 128 tiles, for the plain
    store, the fused residual add, silu_mul and the folded norm; K of both
    transposed blocks (up to 8192, and the down projection's 14336)."""
    silu, norm = "silu" in mode, 1e-5 if "norm" in mode else None
    shapes = ([(2 * 768, 4096), (2 * 264, 1032), (2 * 512, 14336)] if silu
              else [(1536, 4096), (4096, 14336), (136, 200)])
    for n, k in shapes:
        x = randn((rows, k), dtype, gen) * 3.0
        w = randn((n, k), dtype, gen, 0.05)
        res = randn((rows, n), dtype, gen)

        def run(tiling: str) -> torch.Tensor:
            if mode == "residual":
                return cuda_ops.linear_invariant(x, w, residual=res.clone(), tiling=tiling)
            out = poisoned((rows, n // 2 if silu else n), dtype)
            got = cuda_ops.linear_invariant(x, w, out=out, silu=silu, norm_eps=norm,
                                            tiling=tiling)
            assert got is out
            return got

        want = run("64x128")
        for tiling in tilings(rows):
            assert_rows_equal(run(tiling), want, f"{tiling} vs 64x128, {mode}, N {n}, K {k}")


def test_transposed_limits():
    """The transposed shape takes at most FEW rows; forced past that, a clear
    error; an unknown tiling, too."""
    x = torch.zeros((FEW + 1, 4096), dtype=torch.bfloat16, device=DEV)
    w = torch.zeros((64, 4096), dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="transposed"):
        cuda_ops.linear_invariant(x, w, tiling="transposed")
    with pytest.raises(ValueError, match="tiling"):
        cuda_ops.linear_invariant(x, w, tiling="32x32")


def test_rows_as_leading_dims_and_views(gen):
    dtype, n, k = torch.bfloat16, 1024, 2048
    w = randn((n, k), dtype, gen, 0.02)
    x = randn((2, 5, k), dtype, gen)
    got = cuda_ops.linear_invariant(x, w)
    assert got.shape == (2, 5, n)
    assert_rows_equal(got.reshape(10, n), cuda_ops.linear_invariant(x.reshape(10, k), w), "3-d")
    wide = randn((10, 2 * k), dtype, gen)
    view = wide[:, 8:8 + k]  # strided rows, offset start: copied before the launch
    assert_rows_equal(cuda_ops.linear_invariant(view, w),
                      cuda_ops.linear_invariant(view.contiguous(), w), "strided view")


@pytest.mark.parametrize("rows", [1, 8, 64, 96, 1024])
def test_graph_replay(rows, gen):
    """Captured once, replayed with fresh inputs: equal to eager calls."""
    dtype, n, k = torch.bfloat16, 6144, 4096
    w = randn((n, k), dtype, gen, 0.02)
    x = randn((rows, k), dtype, gen)
    cuda_ops.linear_invariant(x, w)  # warm-up: the kernel's shared memory opt-in
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cuda_ops.linear_invariant(x, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_ops.linear_invariant(x, w)
    for _ in range(3):
        x.copy_(randn((rows, k), dtype, gen))
        out.fill_(float("nan"))
        graph.replay()
        assert_rows_equal(out, cuda_ops.linear_invariant(x, w), "replay vs eager")


def test_unsupported_inputs_fall_back_to_reference(gen):
    x = randn((3, 100), torch.float32, gen)
    w = randn((64, 100), torch.float32, gen)
    assert torch.equal(cuda_ops.linear_invariant(x, w), ref.linear_invariant(x, w))
    xb, wb = x.bfloat16(), randn((60, 100), torch.bfloat16, gen)  # N, K not multiples of 8
    assert torch.equal(cuda_ops.linear_invariant(xb, wb), ref.linear_invariant(xb, wb))


def unfused_add(x, w, residual, **kw):
    """The sequence the fused store replaces: y rounded to the dtype, then an
    elementwise residual += y (float32 add, one rounding)."""
    return residual.add_(cuda_ops.linear_invariant(x, w, **kw))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64, 200, 1024])
def test_fused_residual_add_matches_unfused(dtype, rows, gen):
    """linear_invariant(residual=r) adds in the GEMM's store, bit for bit as
    the GEMM followed by r += y, in every tiling; N not a multiple of the
    tile and K not of the k tile included."""
    for n, k in ((1536, 4096), (520, 1032)):
        x = randn((rows, k), dtype, gen)
        w = randn((n, k), dtype, gen, 0.02)
        res = randn((rows, n), dtype, gen, 4.0)
        for tiling in tilings(rows):
            want = unfused_add(x, w, res.clone(), tiling=tiling)
            r = res.clone()
            got = cuda_ops.linear_invariant(x, w, residual=r, tiling=tiling)
            assert got is r
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (n, k, tiling)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_residual_add_batch_invariant(dtype, gen):
    """Row subsets (leading rows, gathered rows, a row alone) give the rows of
    the full batch's fused result."""
    total, n, k = 1024, 2048, 4096
    x = randn((total, k), dtype, gen)
    w = randn((n, k), dtype, gen, 0.02)
    res = randn((total, n), dtype, gen)
    full = cuda_ops.linear_invariant(x, w, residual=res.clone())
    for rows in (1, 7, 16, 17, 64, 65, 200, 1000):
        got = cuda_ops.linear_invariant(x[:rows], w, residual=res[:rows].clone())
        assert_rows_equal(got, full[:rows], f"first {rows} rows")
    perm = torch.randperm(total, generator=gen, device=DEV)
    for rows in (1, 7, 64, 65, 300):
        idx = perm[:rows]
        got = cuda_ops.linear_invariant(x[idx], w, residual=res[idx].clone())
        assert_rows_equal(got, full[idx], f"{rows} gathered rows")
    for r in (0, 513, total - 1):
        got = cuda_ops.linear_invariant(x[r:r + 1], w, residual=res[r:r + 1].clone())
        assert_rows_equal(got, full[r:r + 1], f"row {r} alone")


def test_fused_residual_add_unaligned_and_graph(gen):
    """A residual the kernel does not take (a strided view) gets the add
    after the GEMM, same bits; a captured fused launch replays like eager."""
    dtype, rows, n, k = torch.bfloat16, 8, 1024, 2048
    x = randn((rows, k), dtype, gen)
    w = randn((n, k), dtype, gen, 0.02)
    wide = randn((rows, 2 * n), dtype, gen)
    view = wide[:, 8:8 + n]
    want = unfused_add(x, w, view.clone())
    got = cuda_ops.linear_invariant(x, w, residual=view)
    assert got is view
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError):
        cuda_ops.linear_invariant(x, w, out=torch.empty_like(want), residual=want)

    res = randn((rows, n), dtype, gen)
    cuda_ops.linear_invariant(x, w, residual=res.clone())  # warm-up
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cuda_ops.linear_invariant(x, w, residual=res.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda_ops.linear_invariant(x, w, residual=res)
    for _ in range(3):
        x.copy_(randn((rows, k), dtype, gen))
        start = randn((rows, n), dtype, gen)
        res.copy_(start)
        graph.replay()
        assert_rows_equal(res, unfused_add(x, w, start.clone()), "replay vs unfused")


def test_invariant_ops_linear_fuses_the_residual_add(gen):
    """InvariantOps.linear with a residual (the o and down projections) gives
    the bits of the separate add."""
    from turbomq.worker.model.ops.invariant import InvariantOps

    ops = InvariantOps(cuda_ops)
    dtype, rows, n, k = torch.bfloat16, 5, 1024, 2048
    x = randn((rows, k), dtype, gen)
    w = randn((n, k), dtype, gen, 0.02)
    norm = (randn((k,), dtype, gen), 1e-5)
    res = randn((rows, n), dtype, gen)
    want = res.clone().add_(cuda_ops.linear_invariant(cuda_ops.rms_norm(x, *norm), w))
    r = res.clone()
    got = ops.linear(x, w, norm=norm, residual=r)
    assert got is r
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 64, 200, 1024])
def test_fused_silu_mul_matches_unfused(dtype, rows, gen):
    """linear_invariant(silu=True) on stacked gate / up rows gives the bits of
    the GEMM followed by silu_mul, in every tiling; I not a multiple of a
    tile's columns and K not of the k tile included."""
    for inter, k in ((768, 4096), (264, 1032)):
        x = randn((rows, k), dtype, gen)
        w = randn((2 * inter, k), dtype, gen, 0.05)
        for tiling in tilings(rows):
            want = cuda_ops.silu_mul(cuda_ops.linear_invariant(x, w, tiling=tiling))
            out = poisoned((rows, inter), dtype)
            got = cuda_ops.linear_invariant(x, w, out=out, silu=True, tiling=tiling)
            assert got is out and got.shape == (rows, inter)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (inter, k, tiling)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_silu_mul_batch_invariant(dtype, gen):
    total, inter, k = 1024, 1536, 4096
    x = randn((total, k), dtype, gen)
    w = randn((2 * inter, k), dtype, gen, 0.02)
    full = cuda_ops.linear_invariant(x, w, silu=True)
    for rows in (1, 7, 16, 17, 64, 65, 200, 1000):
        assert_rows_equal(cuda_ops.linear_invariant(x[:rows], w, silu=True), full[:rows],
                          f"first {rows} rows")
    perm = torch.randperm(total, generator=gen, device=DEV)
    for rows in (1, 7, 64, 65, 300):
        idx = perm[:rows]
        assert_rows_equal(cuda_ops.linear_invariant(x[idx], w, silu=True), full[idx],
                          f"{rows} gathered rows")


def test_invariant_ops_linear_fuses_silu_mul(gen):
    from turbomq.worker.model.ops.invariant import InvariantOps

    ops = InvariantOps(cuda_ops)
    dtype, rows, inter, k = torch.bfloat16, 5, 512, 2048
    x = randn((rows, k), dtype, gen)
    w = randn((2 * inter, k), dtype, gen, 0.02)
    norm = (randn((k,), dtype, gen), 1e-5)
    want = cuda_ops.silu_mul(cuda_ops.linear_invariant(cuda_ops.rms_norm(x, *norm), w))
    got = ops.linear(x, w, norm=norm, silu=True)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 65, 200])
@pytest.mark.parametrize("mode", ["plain", "silu"])
def test_folded_norm_matches_reference(dtype, rows, mode, gen):
    """The folded norm (each row's totals times rsqrt(mean(x^2) + eps)):
    within tolerance of the reference in every tiling (their bits agree:
    test_tilings_agree)."""
    silu = mode == "silu"
    for n, k in ([(2 * 768, 4096), (2 * 264, 1032), (2 * 7168, 4096)] if silu
                 else [(1536, 4096), (136, 200), (4096, 14336), (10568, 1032)]):
        x = randn((rows, k), dtype, gen) * 3.0
        w = randn((n, k), dtype, gen, 0.05)
        expect = ref.linear_invariant(x, w, norm_eps=1e-5)
        expect = cuda_ops.silu_mul(expect) if silu else expect
        for tiling in tilings(rows):
            got = cuda_ops.linear_invariant(x, w, silu=silu, tiling=tiling, norm_eps=1e-5)
            assert rel_err(got, expect) < TOL[dtype], f"{tiling} vs reference, N {n}, K {k}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_folded_norm_batch_invariant(dtype, gen):
    """A row's folded-norm projection is the same alone (the transposed
    shape), in a decode batch and in a prefill (tiled), and in a CUDA graph."""
    total, n, k = 1024, 1536, 4096
    x = randn((total, k), dtype, gen)
    w = randn((n, k), dtype, gen, 0.05)
    full = cuda_ops.linear_invariant(x, w, norm_eps=1e-6)
    perm = torch.randperm(total, generator=gen, device=DEV)
    for rows in (1, 2, 7, 64, 65, 300):
        idx = perm[:rows]
        assert_rows_equal(cuda_ops.linear_invariant(x[idx], w, norm_eps=1e-6), full[idx],
                          f"{rows} gathered rows")
    xs = x[:8].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cuda_ops.linear_invariant(xs, w, norm_eps=1e-6)
    graph.replay()
    assert_rows_equal(y, full[:8], "graph replay")


def test_invariant_ops_linear_runs_the_folded_norm(gen):
    """InvariantOps.linear on a NormFolded weight: the GEMM with the folded
    norm, within tolerance of rms_norm then the unfolded projection."""
    from turbomq.worker.model.ops.invariant import InvariantOps, fold_norm

    ops = InvariantOps(cuda_ops)
    dtype, k, inter = torch.bfloat16, 4096, 1024
    w = randn((2 * inter, k), dtype, gen, 0.02)
    g = randn((k,), dtype, gen, 0.3) + 1.0
    folded = fold_norm(w, g)
    for rows in (1, 5, 300):
        x = randn((rows, k), dtype, gen) * 4.0
        got = ops.linear(x, folded, norm=(g, 1e-5), silu=True)
        want = cuda_ops.silu_mul(cuda_ops.linear_invariant(cuda_ops.rms_norm(x, g, 1e-5), w))
        assert rel_err(got, want) < 2 * TOL[dtype], f"{rows} rows"
        one = ops.linear(x[:1], folded, norm=(g, 1e-5), silu=True)
        assert_rows_equal(got[:1], one, f"first of {rows} rows vs alone")



@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,k", [(128, 4096), (64, 1024), (128, 14336)])
def test_qkv_rope_store_equals_the_two_launches(dtype, d, k, gen):
    """The transposed shape's rotary + KV-write store: q, and the pool after
    it, bit for bit linear_invariant followed by rotary_write_kv, at 1-8
    rows, with and without the folded norm, a slot of -1 left unwritten; and
    the same q for a row whether it is decoded alone or among others."""
    from turbomq.worker.model.ops.layer_kv import LayerKV

    nh, nkv, bs, blocks = 8, 2, 16, 8
    w = randn(((nh + 2 * nkv) * d, k), dtype, gen, 0.05)
    half = d // 2
    inv = 1.0 / (10000.0 ** (torch.arange(half, device=DEV, dtype=torch.float32) / half))
    ang = torch.arange(512, device=DEV, dtype=torch.float32)[:, None] * inv[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1).contiguous()
    for rows in (1, 3, 8):
        for eps in (None, 1e-5):
            x = randn((rows, k), dtype, gen) * 2.0
            positions = torch.randint(0, 512, (rows,), generator=gen, device=DEV)
            slots = torch.randperm(blocks * bs, generator=gen, device=DEV)[:rows]
            slots[0] = -1
            pool = LayerKV(randn((blocks, nkv, bs, d), dtype, gen),
                           randn((blocks, nkv, bs, d), dtype, gen), None, None)
            want_kv = LayerKV(pool.k.clone(), pool.v.clone(), None, None)
            qkv = cuda_ops.linear_invariant(x, w, norm_eps=eps)
            q, kk, v = qkv.split([nh * d, nkv * d, nkv * d], dim=-1)
            want = cuda_ops.rotary_write_kv(q.reshape(rows, nh, d), kk.reshape(rows, nkv, d),
                                            v.reshape(rows, nkv, d), positions, cos_sin,
                                            want_kv, slots)
            got = cuda_ops.qkv_rotary_write_kv_invariant(x, w, eps, positions, cos_sin, pool,
                                                         slots, nh)
            what = f"{rows} rows, eps {eps}"
            assert got is not None, what
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), what
            assert torch.equal(pool.k.view(torch.int16), want_kv.k.view(torch.int16)), what
            assert torch.equal(pool.v.view(torch.int16), want_kv.v.view(torch.int16)), what
            alone = cuda_ops.qkv_rotary_write_kv_invariant(x[-1:], w, eps, positions[-1:],
                                                           cos_sin, pool, slots[-1:], nh)
            assert torch.equal(alone.view(torch.int16), got[-1:].view(torch.int16)), what
    # more rows than the transposed shape takes, or an INT8 pool: not this launch
    x = randn((9, k), dtype, gen)
    pool = LayerKV(randn((blocks, nkv, bs, d), dtype, gen),
                   randn((blocks, nkv, bs, d), dtype, gen), None, None)
    nine = torch.zeros(9, dtype=torch.int64, device=DEV)
    assert cuda_ops.qkv_rotary_write_kv_invariant(x, w, None, nine, cos_sin, pool, nine,
                                                  nh) is None
    shape = (blocks, nkv, bs, d)
    int8_pool = LayerKV(torch.zeros(shape, dtype=torch.int8, device=DEV),
                        torch.zeros(shape, dtype=torch.int8, device=DEV),
                        torch.ones(shape[:-1], device=DEV), torch.ones(shape[:-1], device=DEV))
    assert cuda_ops.qkv_rotary_write_kv_invariant(x[:1], w, None, nine[:1], cos_sin, int8_pool,
                                                  nine[:1], nh) is None
