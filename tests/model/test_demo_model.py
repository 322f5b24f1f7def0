"""The demo checkpoint: deterministic bytes, loadable by HF transformers and by our Tokenizer."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from turbomq.worker.model.config import ModelConfig
from turbomq.worker.model.demo import build_demo_tokenizer, write_demo_model
from turbomq.worker.engine.tokenizer import Tokenizer

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo") / "model", seed=0)


def _digests(d) -> dict[str, str]:
    return {name: hashlib.sha256((d / name).read_bytes()).hexdigest() for name in FILES}


def test_same_seed_same_bytes(demo_dir, tmp_path):
    again = write_demo_model(tmp_path / "again", seed=0)
    assert sorted(p.name for p in again.iterdir()) == FILES
    assert _digests(again) == _digests(demo_dir)


def test_other_seed_other_weights_same_tokenizer(demo_dir, tmp_path):
    other = _digests(write_demo_model(tmp_path / "seed1", seed=1))
    base = _digests(demo_dir)
    assert other["model.safetensors"] != base["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == \
        {k: v for k, v in base.items() if k != "model.safetensors"}


def test_tokenizer_training_is_deterministic_across_processes(demo_dir):
    # Rust hash maps are seeded per process, so train in fresh interpreters too.
    code = ("import hashlib; from turbomq.worker.model.demo import build_demo_tokenizer; "
            "print(hashlib.sha256(build_demo_tokenizer().to_str(pretty=True).encode()).hexdigest())")
    here = hashlib.sha256(build_demo_tokenizer().to_str(pretty=True).encode()).hexdigest()
    for hash_seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": hash_seed})
        assert out.stdout.strip() == here
    assert (demo_dir / "tokenizer.json").read_text() == build_demo_tokenizer().to_str(pretty=True) + "\n"


def test_demo_tokenizer_shape(demo_dir):
    data = json.loads((demo_dir / "tokenizer.json").read_text())
    assert data["pre_tokenizer"]["type"] == "ByteLevel" and data["decoder"]["type"] == "ByteLevel"
    assert 300 <= len(data["model"]["merges"]) <= 1000
    tok = Tokenizer.from_dir(demo_dir)
    assert tok.vocab_size == 1024
    assert tok.hf.id_to_token(tok.bos_token_id) == "<s>"
    assert {tok.hf.id_to_token(i) for i in tok.eos_token_ids} == {"</s>"}
    text = "Martha kept the lighthouse: 灯台 🌊"
    assert tok.decode(tok.encode(text)) == text
    # byte-level: all 256 byte symbols are single tokens
    from tokenizers import pre_tokenizers
    assert all(tok.hf.token_to_id(ch) is not None for ch in pre_tokenizers.ByteLevel.alphabet())


def test_config(demo_dir):
    hf_cfg = json.loads((demo_dir / "config.json").read_text())
    cfg = ModelConfig.from_hf(hf_cfg)
    tok = Tokenizer.from_dir(demo_dir)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size) == (256, 4, 8, 4, 32, 688)
    assert cfg.vocab_size == tok.vocab_size
    assert cfg.bos_token_id == tok.bos_token_id and set(cfg.eos_token_ids) == tok.eos_token_ids
    assert (cfg.rope_theta, cfg.max_position_embeddings, cfg.rms_norm_eps) == (10000.0, 4096, 1e-5)
    assert not cfg.tie_word_embeddings and cfg.torch_dtype == "float32"


def test_safetensors_layout(demo_dir):
    cfg = ModelConfig.from_hf(json.loads((demo_dir / "config.json").read_text()))
    with safe_open(str(demo_dir / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        expected |= {f"{p}.self_attn.{x}_proj.weight" for x in "qkvo"}
        expected |= {f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        expected |= {f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"}
    assert set(tensors) == expected
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (cfg.kv_size, cfg.hidden_size)
    assert tensors["model.layers.3.mlp.down_proj.weight"].shape == (cfg.hidden_size, cfg.intermediate_size)
    assert torch.equal(tensors["model.norm.weight"], torch.ones(cfg.hidden_size))
    assert 0.015 < tensors["model.layers.1.mlp.up_proj.weight"].std() < 0.025
    assert not torch.equal(tensors["model.layers.0.self_attn.q_proj.weight"],
                           tensors["model.layers.1.self_attn.q_proj.weight"])


def test_hf_transformers_loads_it(demo_dir):
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(demo_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tok = Tokenizer.from_dir(demo_dir)
    ids = tok.encode("The harbour town woke slowly")
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), tok.vocab_size)
    assert torch.isfinite(logits).all()
    # the weights are the file's, not a fresh init
    with safe_open(str(demo_dir / "model.safetensors"), framework="pt") as f:
        assert torch.equal(model.lm_head.weight, f.get_tensor("lm_head.weight"))
