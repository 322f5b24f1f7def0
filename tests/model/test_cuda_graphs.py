"""The inputs a prefill graph replays with: a lone sequence's new tokens
padded to their bucket give the logits and the KV of the unpadded forward;
mixed-step graphs' pieces, run between attentions over static buffers,
give those of the forward (run here through the reference ops, each piece
run where a graph would replay; tests/gpu replays the graphs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import make_hf_model
from turbomq.worker.model.cuda_graphs import (MixedGraphs, batch_buckets, context_bucket,
                                              context_buckets, fill_prefill_inputs,
                                              prefill_buckets)
from turbomq.worker.model.kv_cache import PagedKVCache
from turbomq.worker.model.llama import LlamaModel
from turbomq.worker.model.ops import AttentionBatch
from turbomq.worker.model.weights import load_checkpoint

BLOCK = 8


def test_buckets():
    assert prefill_buckets(512) == [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256,
                                    320, 384, 448, 512]
    assert prefill_buckets(100) == [16, 32, 48, 64, 80, 96, 100]
    assert prefill_buckets(0) == []
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert [context_bucket(c, 4096) for c in (1, 512, 513, 3000, 5000)] == [512, 512, 1024,
                                                                           4096, 4096]
    # what graphs at start capture: every bucket context_bucket can give
    assert context_buckets(4096) == [512, 1024, 2048, 4096]
    assert context_buckets(3000) == [512, 1024, 2048, 3000]
    assert context_buckets(100) == [100]
    for top in (100, 3000, 4096):
        assert {context_bucket(c, top) for c in range(1, top + 1)} == set(context_buckets(top))


def empty_inputs(tokens: int, width: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.zeros(tokens, np.int64), "positions": np.zeros(tokens, np.int64),
            "slot_mapping": np.zeros(tokens, np.int64), "logits_row": np.zeros(1, np.int64),
            "q_lens": np.zeros(1, np.int32), "cu_q_lens": np.zeros(2, np.int32),
            "context_lens": np.zeros(1, np.int32), "block_tables": np.zeros((1, width), np.int32)}


def forward(model, kv, ids, q_lens, ctx_lens, table, rows, q_host=None, ctx_host=None,
            slots=None, positions=None):
    batch = AttentionBatch.build(q_lens, ctx_lens, table, BLOCK) if slots is None else \
        AttentionBatch(q_lens=torch.tensor(q_lens, dtype=torch.int32),
                       cu_q_lens=torch.tensor([0, q_lens[0]], dtype=torch.int32),
                       context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
                       block_tables=torch.from_numpy(table.astype(np.int32)),
                       slot_mapping=torch.from_numpy(slots), positions=torch.from_numpy(positions),
                       q_lens_host=q_host, context_lens_host=ctx_host, max_q_len=q_host[0],
                       max_context_len=ctx_host[0])
    with torch.no_grad():
        return model.forward(torch.tensor(ids), batch, kv, torch.tensor(rows))


@pytest.mark.parametrize("history,new,bucket", [(0, 5, 16), (0, 16, 16), (13, 20, 32),
                                                (24, 2, 16), (40, 33, 64)])
def test_padded_prefill_gives_the_unpadded_logits_and_kv(tmp_path, history, new, bucket):
    _, path = make_hf_model("gqa_llama3_rope", tmp_path)
    ckpt = load_checkpoint(path)
    model = LlamaModel(ckpt.config, ckpt.tensors)
    cfg = model.config
    width = 20  # block-table columns (160 positions)
    scratch = width  # the pool's last block: no sequence owns it
    rng = np.random.default_rng(history + new)
    table = rng.permutation(width)[None, :]  # a scattered table
    ids = rng.integers(3, cfg.vocab_size, history + new).tolist()
    pools = [PagedKVCache(cfg.num_layers, width + 1, BLOCK, model.num_kv_heads, cfg.head_dim,
                          model.dtype) for _ in range(2)]
    for kv in pools:  # the history, eagerly
        if history:
            forward(model, kv, ids[:history], [history], [history], table, [history - 1])
    ctx = history + new
    used = -(-ctx // BLOCK)
    seq_table = np.where(np.arange(width) < used, table, -1)  # columns it owns
    want = forward(model, pools[0], ids[history:], [new], [ctx], seq_table, [new - 1])

    h = empty_inputs(64, width)
    padded = fill_prefill_inputs(h, ids[history:], ctx, seq_table[0, :used], bucket, BLOCK, scratch)
    assert padded == history + bucket and h["context_lens"][0] == padded
    assert h["q_lens"][0] == bucket and list(h["cu_q_lens"]) == [0, bucket]
    assert list(h["positions"][:bucket]) == list(range(history, padded))
    assert (h["slot_mapping"][new:bucket] == scratch * BLOCK).all()  # the padding rows
    assert (h["block_tables"][0, used:] == scratch).all()
    got = forward(model, pools[1], h["input_ids"][:bucket].tolist(), [bucket], [padded],
                  h["block_tables"], [int(h["logits_row"][0])], q_host=[bucket],
                  ctx_host=[padded], slots=h["slot_mapping"][:bucket].copy(),
                  positions=h["positions"][:bucket].copy())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the sequence's blocks hold the same KV; only the scratch block saw the padding
    for a, b in zip(pools[0].layers, pools[1].layers):
        for x, y in ((a.k, b.k), (a.v, b.v)):
            torch.testing.assert_close(x[:width], y[:width], rtol=1e-5, atol=1e-5)


def test_idle_prefill_inputs_touch_only_the_scratch_block(tmp_path):
    """A prefill graph captured at start warms up on inputs of no sequence:
    every block they read or write is the scratch one, and the logits land
    in the buffer the graphs share."""
    _, path = make_hf_model("gqa_llama3_rope", tmp_path)
    ckpt = load_checkpoint(path)
    model = LlamaModel(ckpt.config, ckpt.tensors)
    cfg = model.config
    width, bucket = 20, 32
    scratch = width
    kv = PagedKVCache(cfg.num_layers, width + 1, BLOCK, model.num_kv_heads, cfg.head_dim,
                      model.dtype)
    before = [(layer.k.clone(), layer.v.clone()) for layer in kv.layers]
    h = empty_inputs(64, width)
    padded = fill_prefill_inputs(h, [0], 1, np.full(1, -1, dtype=np.int32), bucket, BLOCK,
                                 scratch)
    assert padded == bucket and (h["block_tables"] == scratch).all()
    assert (h["slot_mapping"][:bucket] == scratch * BLOCK).all()
    batch = AttentionBatch(q_lens=torch.tensor([bucket], dtype=torch.int32),
                           cu_q_lens=torch.tensor([0, bucket], dtype=torch.int32),
                           context_lens=torch.tensor([padded], dtype=torch.int32),
                           block_tables=torch.from_numpy(h["block_tables"].copy()),
                           slot_mapping=torch.from_numpy(h["slot_mapping"][:bucket].copy()),
                           positions=torch.from_numpy(h["positions"][:bucket].copy()),
                           q_lens_host=[bucket], context_lens_host=[padded], max_q_len=bucket,
                           max_context_len=padded)
    out = torch.full((1, cfg.vocab_size), float("nan"))
    with torch.no_grad():
        got = model.forward(torch.from_numpy(h["input_ids"][:bucket].copy()), batch, kv,
                            torch.from_numpy(h["logits_row"].copy()), out)
        want = model.forward(torch.from_numpy(h["input_ids"][:bucket].copy()), batch, kv,
                             torch.from_numpy(h["logits_row"].copy()))
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for layer, (k, v) in zip(kv.layers, before):
        assert torch.equal(layer.k[:width], k[:width]) and torch.equal(layer.v[:width], v[:width])
        assert not torch.equal(layer.k[scratch], k[scratch])


class _EagerPiece:
    """Stands for a captured piece on the CPU: replay() runs it."""

    def __init__(self, graphs: MixedGraphs, bucket: int, i: int):
        self.replay = lambda: graphs._piece(bucket, i)


def test_mixed_step_pieces_give_the_forward_logits_and_kv(tmp_path, monkeypatch):
    """Steps of several sequences (prefill chunks over history and without,
    decode rows beside them) padded to a bucket and run piece by piece with
    attention between: each sequence's logits and KV of the forward, and the
    padding rows touch only the scratch block."""
    monkeypatch.setattr(MixedGraphs, "_capture", lambda self, bucket: [
        _EagerPiece(self, bucket, i) for i in range(len(self.kv_cache.layers) + 1)])
    _, path = make_hf_model("gqa_llama3_rope", tmp_path)
    ckpt = load_checkpoint(path)
    model = LlamaModel(ckpt.config, ckpt.tensors)
    cfg = model.config
    width = 40  # blocks of the pool but the scratch one
    pools = [PagedKVCache(cfg.num_layers, width + 1, BLOCK, model.num_kv_heads, cfg.head_dim,
                          model.dtype) for _ in range(2)]
    graphs = MixedGraphs(model, pools[1], 128, scratch_block=width)
    rng = np.random.default_rng(3)
    for step in ([(0, 5), (0, 11)], [(37, 1), (60, 1), (0, 40), (12, 30)], [(0, 3), (7, 1)]):
        order = rng.permutation(width)
        tables = np.full((len(step), width), -1, dtype=np.int32)
        ids, used = [], 0
        for s, (history, new) in enumerate(step):
            n = -(-(history + new) // BLOCK)
            tables[s, :n] = order[used:used + n]
            used += n
            ids.append(rng.integers(3, cfg.vocab_size, history + new).tolist())
            for kv in pools:  # the history, eagerly
                if history:
                    forward(model, kv, ids[s][:history], [history], [history],
                            tables[s:s + 1], [history - 1])
        q_lens = [new for _, new in step]
        ctx = [history + new for history, new in step]
        new_ids = [t for (history, _), x in zip(step, ids) for t in x[history:]]
        rows = list(np.cumsum(q_lens) - 1)
        want = forward(model, pools[0], new_ids, q_lens, ctx, tables, rows)
        scratch = [(layer.k[width].clone(), layer.v[width].clone()) for layer in pools[1].layers]
        with torch.no_grad():
            got = graphs.run(torch.tensor(new_ids), AttentionBatch.build(q_lens, ctx, tables, BLOCK),
                             torch.tensor(rows))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b, (k, v) in zip(pools[0].layers, pools[1].layers, scratch):
            torch.testing.assert_close(b.k[:width], a.k[:width], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(b.v[:width], a.v[:width], rtol=1e-5, atol=1e-5)
            if len(new_ids) not in graphs.buckets:  # padded: only the scratch block took them
                assert not torch.equal(b.k[width], k)
    assert graphs.replays == 3 and sorted(graphs._graphs) == [16, 80]
