"""The engine on CUDA: greedy tokens equal to the CPU backend (fp32), CUDA-graph
decode equal to eager decode (bf16, native kernels), prefill graphs against
the eager prefill, INT8 KV on the GPU.

Skipped, with the reason, where there is no CUDA device or the native module
lacks its CUDA kernels."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from turbomq.worker import Engine, EngineConfig, SamplingParams
from turbomq.worker.model.ops import cuda as cuda_ops

_REASON = cuda_ops.unavailable_reason()
if _REASON is not None:
    pytest.skip(f"GPU engine tests skipped: {_REASON}", allow_module_level=True)

GREEDY = dict(temperature=0.0, ignore_eos=True)


def tiny_model(tmp_path, head_dim: int, kv_heads: int, seed: int = 0, heads: int = 4,
               tied: bool = False) -> str:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=heads * head_dim, intermediate_size=384,
                      num_hidden_layers=3, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # spread the logits so greedy picks are not near-ties
        model.lm_head.weight.mul_(20.0)
    path = tmp_path / f"tiny-{heads}-{head_dim}-{kv_heads}{'-tied' if tied else ''}"
    model.save_pretrained(path)
    return str(path)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(1, 300))] for _ in range(n)]


@pytest.mark.parametrize("head_dim,kv_heads", [(64, 4), (64, 1), (128, 2)])
def test_cuda_greedy_equals_cpu_in_fp32(tmp_path, head_dim, kv_heads):
    path = tiny_model(tmp_path, head_dim, kv_heads)
    params = SamplingParams(max_tokens=64, **GREEDY)
    batch = prompts(6, 1)
    cpu = Engine(EngineConfig(model=path, dtype="fp32", block_size=16)).generate(
        input_ids=batch, params=params)
    gpu = Engine(EngineConfig(model=path, device="cuda", dtype="fp32", block_size=16)).generate(
        input_ids=batch, params=params)
    assert [r.token_ids for r in gpu] == [r.token_ids for r in cpu]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_graph_decode_equals_eager(tmp_path, head_dim, kv_dtype):
    path = tiny_model(tmp_path, head_dim, 2)
    params = SamplingParams(max_tokens=48, **GREEDY)
    batch = prompts(12, 2)
    runs = {}
    for graphs in (False, True):  # decode graphs only (prefill and mixed graphs pad their rows)
        eng = Engine(EngineConfig(model=path, device="cuda", dtype="bf16", kv_dtype=kv_dtype,
                                  max_batch_size=8, block_size=64, cuda_graphs=graphs,
                                  prefill_graph_tokens=0, mixed_graph_tokens=0))
        assert (eng.runner.graphs is not None) == graphs
        runs[graphs] = [r.token_ids for r in eng.generate(input_ids=batch, params=params)]
        eng.kv_manager.check()
    same = sum(a == b for a, b in zip(runs[False], runs[True]))
    assert same == len(batch), f"{same}/{len(batch)} sequences identical"


def assert_part_late(eager: list, graphed: list, length: int) -> None:
    """Greedy runs of graphs that pad their rows against eager ones: all but
    one sequence agree on at least their first 8 tokens (bf16 products on
    padded rows round differently, so a sequence may part late)."""
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), length)
             for x, y in zip(eager, graphed)]
    print("first divergence per sequence:", first)
    assert sum(f >= 8 for f in first) >= len(first) - 1


def model_and_two_pools(tmp_path, quantization, kv_dtype: str, width: int, block: int):
    """A tiny bf16 model on the GPU (FP8 weights with `quantization`) and two
    KV pools of width blocks plus a scratch one: one for the eager forward,
    one for the graphs under test."""
    from turbomq.worker.model.kv_cache import PagedKVCache, resolve_kv_dtype
    from turbomq.worker.model.llama import LlamaModel
    from turbomq.worker.model.weights import load_checkpoint

    ckpt = load_checkpoint(tiny_model(tmp_path, 128, 2))
    model = LlamaModel(ckpt.config, ckpt.tensors, "cuda", torch.bfloat16,
                       quantization=quantization)
    cfg = model.config
    kv_type = resolve_kv_dtype(kv_dtype, model.dtype)
    return model, [PagedKVCache(cfg.num_layers, width + 1, block, model.num_kv_heads,
                                cfg.head_dim, kv_type, "cuda") for _ in range(2)]


def assert_same_kv(pools, blocks: torch.Tensor, tol: float) -> None:
    """Both pools hold the same K and V in `blocks` (INT8: the values the
    codes stand for), within tol of each tensor's largest value, twice."""
    for a, b in zip(pools[0].layers, pools[1].layers):
        for x, y, sx, sy in ((a.k, b.k, a.k_scale, b.k_scale), (a.v, b.v, a.v_scale, b.v_scale)):
            x, y = x[blocks].float(), y[blocks].float()
            if sx is not None:
                x, y = x * sx[blocks][..., None], y * sy[blocks][..., None]
            torch.testing.assert_close(y, x, rtol=0, atol=2 * tol * x.abs().max().item())


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_prefill_graph_gives_the_eager_logits_and_kv(tmp_path, kv_dtype, quantization):
    """Prefill graphs replayed with fresh inputs, over history and without,
    new-token counts inside and at the edge of their buckets, on the two
    attention kernels (under and over 64 new tokens): the last token's
    logits and the sequence's KV of the eager forward (bf16: the products
    run on the padded row count, so within rounding). FP8 weights within
    twice that: the padded count may take the FP8 GEMM where the eager rows
    take the GEMV, and one rounding step of x's E4M3 copy (1/16 of a value)
    carries a last-bit difference of one layer into the next."""
    import numpy as np

    from turbomq.worker.model.cuda_graphs import PrefillGraphs
    from turbomq.worker.model.ops import AttentionBatch

    bs, width = 16, 64
    model, pools = model_and_two_pools(tmp_path, quantization, kv_dtype, width, bs)
    cfg = model.config
    graphs = PrefillGraphs(model, pools[1], 512, 1024, scratch_block=width)
    rng = np.random.default_rng(0)
    for history, new in [(0, 5), (0, 16), (0, 100), (37, 2), (37, 64), (300, 33), (300, 200),
                         (0, 130)]:
        table = rng.permutation(width)[None, :].astype(np.int32)
        ids = rng.integers(3, cfg.vocab_size, history + new).tolist()
        ctx = history + new
        for kv in pools:  # the history, eagerly
            if history:
                batch = AttentionBatch.build([history], [history], table, bs, "cuda")
                model.forward(torch.tensor(ids[:history], device="cuda"), batch, kv)
        used = -(-ctx // bs)
        want = model.forward(torch.tensor(ids[history:], device="cuda"),
                             AttentionBatch.build([new], [ctx], table, bs, "cuda"), pools[0])
        got = graphs.run(ids[history:], ctx, np.where(np.arange(width) < used, table[0], -1))
        tol = 4e-2 if quantization else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
        assert got.argmax().item() == want.argmax().item()
        blocks = torch.from_numpy(table[0, :used]).long().cuda()
        assert_same_kv(pools, blocks, tol)
    assert graphs.replays == 8
    assert graphs.captured == 6  # (token, context) buckets: 16, 112, 64, 48, 224 (1024), 160


@pytest.mark.parametrize("quantization", [None, "fp8"])
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_mixed_graphs_give_the_eager_logits_and_kv(tmp_path, kv_dtype, quantization):
    """Steps of several sequences -- prefill chunks over history and without,
    decode rows beside them, token counts inside and at the edge of their
    buckets -- through MixedGraphs (attention launched between the replayed
    pieces): every sequence's last-token logits and KV of the eager forward,
    within the rounding of products on the padded row count (tolerances as
    for prefill graphs)."""
    import numpy as np

    from turbomq.worker.model.cuda_graphs import MixedGraphs
    from turbomq.worker.model.ops import AttentionBatch

    bs, width = 16, 64
    model, pools = model_and_two_pools(tmp_path, quantization, kv_dtype, width, bs)
    cfg = model.config
    graphs = MixedGraphs(model, pools[1], 512, scratch_block=width)
    rng = np.random.default_rng(1)
    steps = [[(0, 5), (0, 11)],  # 16 tokens: a bucket's edge
             [(37, 1), (300, 1), (0, 64), (12, 30)],  # 96
             [(0, 200), (5, 1), (90, 100)],  # 301 -> 320
             [(0, 3), (7, 1), (60, 1)]]  # 5 -> 16
    for step in steps:
        order = rng.permutation(width)
        tables = np.full((len(step), width), -1, dtype=np.int32)
        ids, used = [], []
        for s, (history, new) in enumerate(step):
            n = -(-(history + new) // bs)
            tables[s, :n] = order[sum(used):sum(used) + n]
            used.append(n)
            ids.append(rng.integers(3, cfg.vocab_size, history + new).tolist())
            for kv in pools:  # the history, eagerly
                if history:
                    batch = AttentionBatch.build([history], [history], tables[s:s + 1], bs, "cuda")
                    model.forward(torch.tensor(ids[s][:history], device="cuda"), batch, kv)
        q_lens = [new for _, new in step]
        ctx = [history + new for history, new in step]
        new_ids = torch.tensor([t for (history, _), x in zip(step, ids) for t in x[history:]],
                               device="cuda")
        batch = AttentionBatch.build(q_lens, ctx, tables, bs, "cuda")
        want = model.forward(new_ids, batch, pools[0])
        last = torch.tensor(np.cumsum(q_lens) - 1, device="cuda")
        got = graphs.run(new_ids, AttentionBatch.build(q_lens, ctx, tables, bs, "cuda"), last)
        tol = 4e-2 if quantization else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        blocks = torch.from_numpy(order[:sum(used)]).long().cuda()
        assert_same_kv(pools, blocks, tol)
    assert graphs.replays == 4
    assert graphs.captured == 3 * (cfg.num_layers + 1)  # buckets 16, 96, 320


@pytest.mark.parametrize("shape", [dict(head_dim=64, kv_heads=2),
                                   # SmolLM2's heads (9 over 3 KV heads of 64, hidden 576), tied
                                   dict(head_dim=64, kv_heads=3, heads=9, tied=True)])
def test_engine_mixed_graphs_answer_like_eager(tmp_path, shape):
    """A batch whose prompts prefill in chunks beside other sequences' decode
    rows, through mixed-step graphs: the greedy tokens of eager steps (a
    sequence may part late: bf16 products on padded rows round differently)."""
    path = tiny_model(tmp_path, **shape)
    params = SamplingParams(max_tokens=24, **GREEDY)
    runs, replays = {}, {}
    for tokens in (0, 2048):
        with Engine(EngineConfig(model=path, device="cuda", dtype="bf16", max_batch_size=8,
                                 block_size=16, max_num_batched_tokens=256,
                                 mixed_graph_tokens=tokens)) as eng:
            runs[tokens] = [r.token_ids for r in eng.generate(input_ids=prompts(12, 8),
                                                              params=params)]
            eng.kv_manager.check()
            graphs = eng.runner.mixed_graphs
            replays[tokens] = 0 if graphs is None else graphs.replays
    assert replays[0] == 0 and replays[2048] >= 5
    assert_part_late(runs[0], runs[2048], 24)


def test_engine_prefill_graphs_answer_like_eager(tmp_path):
    """Lone prompts and session turns prefilled by graphs: the greedy tokens
    of eager prefills (a sequence may part late: bf16 products on padded
    rows round differently)."""
    path = tiny_model(tmp_path, 64, 2)
    params = SamplingParams(max_tokens=24, **GREEDY)
    runs, replays = {}, {}
    for tokens in (0, 512):
        with Engine(EngineConfig(model=path, device="cuda", dtype="bf16", max_batch_size=4,
                                 block_size=64, prefill_graph_tokens=tokens,
                                 mixed_graph_tokens=0)) as eng:
            out = [eng.generate(input_ids=[p], params=params)[0].token_ids
                   for p in prompts(10, 5)]
            for turn in range(3):  # a session's turns: a short prefill over its history
                out.append(eng.generate(input_ids=[[5 + turn, 6, 7, 8 + turn]], params=params,
                                        session_id="s")[0].token_ids)
            runs[tokens] = out
            graphs = eng.runner.prefill_graphs
            replays[tokens] = 0 if graphs is None else graphs.replays
    assert replays[0] == 0 and replays[512] >= 12
    assert_part_late(runs[0], runs[512], 24)


def test_graphs_captured_at_start_answer_like_graphs_captured_on_first_use(tmp_path):
    """graphs_at_start: every bucket's decode, prefill and mixed graph is held once
    the engine is up, no step captures another, and the tokens (a batch,
    lone prompts, a session's turns) are those of graphs captured lazily."""
    from turbomq.worker.model.cuda_graphs import batch_buckets, prefill_buckets

    path = tiny_model(tmp_path, 64, 2)
    params = SamplingParams(max_tokens=24, **GREEDY)
    runs = {}
    for at_start in (False, True):
        with Engine(EngineConfig(model=path, device="cuda", dtype="bf16", max_batch_size=8,
                                 block_size=64, max_model_len=1024, host_kv_blocks=0,
                                 mixed_graph_tokens=2048, graphs_at_start=at_start)) as eng:
            decode, prefill, mixed = (eng.runner.graphs, eng.runner.prefill_graphs,
                                      eng.runner.mixed_graphs)
            held = (decode.captured, prefill.captured, mixed.captured)
            out = [r.token_ids for r in eng.generate(input_ids=prompts(12, 6), params=params)]
            out += [eng.generate(input_ids=[p], params=params)[0].token_ids
                    for p in prompts(4, 7)]
            out += [eng.generate(input_ids=[[5 + turn, 6, 7, 8 + turn]], params=params,
                                 session_id="s")[0].token_ids for turn in range(3)]
            eng.kv_manager.check()
            runs[at_start] = out
            after = (decode.captured, prefill.captured, mixed.captured)
        if at_start:  # context buckets 512 and 1024; a mixed bucket: embedding + 3 layers
            assert held == (2 * len(batch_buckets(8)), 2 * len(prefill_buckets(512)),
                            4 * len(prefill_buckets(512)))  # max_num_batched_tokens
            assert after == held
        else:
            assert held == (0, 0, 0) and min(after) > 0
    assert runs[True] == runs[False]


def test_bf16_engine_starts_like_fp32(tmp_path):
    """bf16 rounding makes long greedy runs drift from fp32 on a random model;
    the first tokens must still agree."""
    path = tiny_model(tmp_path, 128, 2)
    params = SamplingParams(max_tokens=32, **GREEDY)
    batch = prompts(8, 3)
    fp32 = Engine(EngineConfig(model=path, device="cuda", dtype="fp32")).generate(input_ids=batch, params=params)
    bf16 = Engine(EngineConfig(model=path, device="cuda", dtype="bf16")).generate(input_ids=batch, params=params)
    first = [next((i for i, (a, b) in enumerate(zip(x.token_ids, y.token_ids)) if a != b), 32)
             for x, y in zip(fp32, bf16)]
    print("bf16 vs fp32 first divergence per sequence:", first)
    assert sum(f >= 1 for f in first) >= 7


def test_overlapped_steps_equal_synchronous(tmp_path):
    """Decode step t+1 launched before step t's tokens are read: the same
    tokens as reading every step first, with rows that stop early (stop ids),
    seeded sampling, a repetition penalty (which reads first), requests
    joining as slots free, and a multi-turn session."""
    path = tiny_model(tmp_path, 64, 2)
    batch = prompts(12, 4)
    stop = list(range(3, 40))
    params = [SamplingParams(max_tokens=20 + 7 * i, temperature=0.0, stop_token_ids=stop)
              if i % 3 == 0 else
              SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=i)
              if i % 3 == 1 else
              SamplingParams(max_tokens=25, repetition_penalty=1.3, **GREEDY)
              for i in range(len(batch))]
    runs = {}
    for overlap in (False, True):
        eng = Engine(EngineConfig(model=path, device="cuda", dtype="bf16", max_batch_size=8,
                                  block_size=64, overlap_steps=overlap))
        ids: list = []
        done = {}
        for prompt, p in zip(batch, params):
            rid = eng.submit(input_ids=prompt, params=p,
                             callback=lambda e: done.setdefault(e.request_id, []).append(e))
            ids.append(rid)
        while eng.has_work():
            eng.step()
        outs = [[t for e in done[r] for t in e.token_ids] for r in ids]
        reasons = [done[r][-1].finish_reason for r in ids]
        turns = [eng.generate(input_ids=[batch[t][:50]], session_id="chat",
                              params=SamplingParams(max_tokens=16, **GREEDY))[0].token_ids
                 for t in range(3)]
        eng.kv_manager.check()
        assert not eng.has_work()
        assert (eng.counters["overlapped_steps"] > 0) == overlap
        runs[overlap] = (outs, reasons, turns)
    assert runs[True] == runs[False]
    assert "stop" in runs[True][1] and "length" in runs[True][1]


def test_close_gives_every_byte_back_and_a_second_engine_starts(tmp_path):
    import gc

    path = tiny_model(tmp_path, 64, 2)
    params = SamplingParams(max_tokens=24, **GREEDY)
    batch = prompts(4, 3)
    gc.collect()  # what earlier tests left for the collector goes first
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    runs = []
    for _ in range(2):  # the second engine in the same process, after the first closed
        with Engine(EngineConfig(model=path, device="cuda", dtype="bf16", max_batch_size=4,
                                 block_size=64, kv_cache_fraction=0.5)) as eng:
            runs.append([r.token_ids for r in eng.generate(input_ids=batch, params=params)])
            assert eng.runner.graphs is not None and torch.cuda.memory_allocated() > before
        gc.collect()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before, "the closed engine still holds memory"
    assert runs[0] == runs[1]


def test_host_tier_and_prefix_cache_on_cuda_give_the_cpu_tokens(tmp_path):
    """Named blocks spilled to pinned host memory and loaded back (async
    copies on the step's stream) under pressure: the same greedy tokens as a
    CPU engine without any cache (fp32, so the reference ops agree)."""
    path = tiny_model(tmp_path, head_dim=64, kv_heads=2)
    rng = random.Random(5)
    prefixes = [[rng.randrange(3, 512) for _ in range(48)] for _ in range(4)]
    work = [rng.choice(prefixes)[:rng.randint(16, 48)] + [rng.randrange(3, 512) for _ in range(8)]
            for _ in range(40)]
    params = SamplingParams(max_tokens=8, **GREEDY)
    cuda = Engine(EngineConfig(model=path, device="cuda", dtype="fp32", block_size=16,
                               num_kv_blocks=10, host_kv_blocks=32))
    got = [cuda.generate(input_ids=[p], params=params)[0].token_ids for p in work]
    stats = cuda.stats()
    cpu = Engine(EngineConfig(model=path, block_size=16, prefix_caching=False))
    want = [cpu.generate(input_ids=[p], params=params)[0].token_ids for p in work]
    assert got == want
    assert stats["host_tier_loaded_blocks"] > 0 and stats["host_tier_stored_blocks"] > 0
    cuda.kv_manager.check()


def test_pinned_zeros_is_page_locked_and_takes_asynchronous_copies():
    """The host tier's memory: pinned (torch sees it so), and asynchronous
    copies in and out of it round-trip."""
    from turbomq.worker.engine.runner import pinned_zeros

    host = pinned_zeros((1000, 3, 7), torch.bfloat16)
    assert host.is_pinned() and host.shape == (1000, 3, 7) and not host.any()
    src = torch.randn(1000, 3, 7, device="cuda").bfloat16()
    host.copy_(src, non_blocking=True)
    back = torch.empty_like(src)
    back.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
