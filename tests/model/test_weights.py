"""Checkpoint loading: HF (single and sharded), Meta (1 and 2 shards), the converted
form, and clear errors for broken checkpoints. Tensors are compared exactly against
what HF transformers itself holds; logits parity lives with the model tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from turbomq.worker.model.config import ModelConfig, RopeScaling  # noqa: E402
from turbomq.worker.model.weights import (  # noqa: E402
    META_LLAMA3_ROPE, CheckpointError, checkpoint_format, convert_checkpoint, hf_shapes, internal_shapes,
    load_checkpoint, meta_intermediate_size, permute_hf_to_meta, permute_meta_to_hf,
    save_hf_checkpoint, save_meta_checkpoint, to_hf_state_dict, _meta_ffn_params,
)

BASE = dict(vocab_size=259, hidden_size=72, intermediate_size=100, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
VARIANTS = {
    "mha": dict(num_key_value_heads=6),
    "gqa": dict(),
    "mqa": dict(num_key_value_heads=1),
    "tied": dict(tie_word_embeddings=True),
    "llama3_rope": dict(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    "wide_heads": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=97),
}


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> LlamaForCausalLM:
    """A tiny random LlamaForCausalLM; every weight random (norms too), so a swapped
    tensor cannot go unnoticed."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**BASE, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model.to(dtype)


def save_hf(model: LlamaForCausalLM, path: Path, **kw) -> Path:
    model.save_pretrained(path, **kw)
    return path


def expected_tensors(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The internal form written out by hand from HF's own modules."""
    m, cfg = model.model, model.config
    out = {"embed.weight": m.embed_tokens.weight}
    for i, layer in enumerate(m.layers):
        a, f = layer.self_attn, layer.mlp
        out[f"layers.{i}.attn_norm.weight"] = layer.input_layernorm.weight
        out[f"layers.{i}.qkv.weight"] = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        out[f"layers.{i}.o.weight"] = a.o_proj.weight
        out[f"layers.{i}.mlp_norm.weight"] = layer.post_attention_layernorm.weight
        out[f"layers.{i}.gate_up.weight"] = torch.cat([f.gate_proj.weight, f.up_proj.weight])
        out[f"layers.{i}.down.weight"] = f.down_proj.weight
    out["norm.weight"] = m.norm.weight
    out["lm_head.weight"] = model.lm_head.weight
    assert len(out) == 3 + 6 * cfg.num_hidden_layers
    return {k: v.detach() for k, v in out.items()}


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name


def assert_same_config(a: ModelConfig, b: ModelConfig) -> None:
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings")
    assert {f: getattr(a, f) for f in fields} == {f: getattr(b, f) for f in fields}


# --------------------------------------------------------------------------- HF

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_load_matches_transformers(tmp_path, variant):
    model = make_model(**VARIANTS[variant])
    ckpt = load_checkpoint(save_hf(model, tmp_path))
    cfg = model.config
    assert checkpoint_format(tmp_path) == "hf"
    assert ckpt.config.num_heads == cfg.num_attention_heads
    assert ckpt.config.num_kv_heads == cfg.num_key_value_heads
    assert ckpt.config.head_dim == cfg.head_dim
    assert ckpt.config.intermediate_size == cfg.intermediate_size
    assert ckpt.config.tie_word_embeddings == cfg.tie_word_embeddings
    assert ckpt.config.torch_dtype == "float32"
    assert_same_tensors(ckpt.tensors, expected_tensors(model))
    assert {k: tuple(v.shape) for k, v in ckpt.tensors.items()} == internal_shapes(ckpt.config)
    if cfg.tie_word_embeddings:
        assert ckpt.tensors["lm_head.weight"] is ckpt.tensors["embed.weight"]
    else:
        assert ckpt.tensors["lm_head.weight"].data_ptr() != ckpt.tensors["embed.weight"].data_ptr()


def test_hf_llama3_rope_scaling_is_read(tmp_path):
    ckpt = load_checkpoint(save_hf(make_model(**VARIANTS["llama3_rope"]), tmp_path))
    assert ckpt.config.rope_theta == 500000.0
    assert ckpt.config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 64)


def test_hf_sharded_matches_single(tmp_path):
    model = make_model()
    save_hf(model, tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    assert_same_tensors(load_checkpoint(tmp_path / "sharded").tensors, expected_tensors(model))


def test_hf_dtype_kept_or_converted(tmp_path):
    model = make_model(dtype=torch.float16)
    save_hf(model, tmp_path)
    kept = load_checkpoint(tmp_path)
    assert kept.config.torch_dtype == "float16"
    assert_same_tensors(kept.tensors, expected_tensors(model))
    bf = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert bf.config.torch_dtype == "bfloat16"
    assert_same_tensors(bf.tensors, {k: v.to(torch.bfloat16) for k, v in expected_tensors(model).items()})
    with pytest.raises(CheckpointError, match="unsupported dtype"):
        load_checkpoint(tmp_path, dtype=torch.float64)


def test_hf_ignores_rotary_inv_freq_and_reads_pytorch_bin(tmp_path):
    model = make_model()
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(6)
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    torch.save(sd, tmp_path / "pytorch_model.bin")
    assert_same_tensors(load_checkpoint(tmp_path).tensors, expected_tensors(model))


def test_save_hf_checkpoint_loads_in_transformers(tmp_path):
    model = make_model(**VARIANTS["gqa"])
    ckpt = load_checkpoint(save_hf(model, tmp_path / "src"))
    save_hf_checkpoint(ckpt.config, to_hf_state_dict(ckpt), tmp_path / "out", max_shard_bytes=30_000)
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    again = LlamaForCausalLM.from_pretrained(tmp_path / "out")
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    assert_same_tensors(load_checkpoint(tmp_path / "out").tensors, ckpt.tensors)


def test_to_hf_state_dict_round_trip_tied(tmp_path):
    model = make_model(tie_word_embeddings=True)
    ckpt = load_checkpoint(save_hf(model, tmp_path / "src"))
    sd = to_hf_state_dict(ckpt)
    assert "lm_head.weight" not in sd
    missing, unexpected = LlamaForCausalLM(model.config).load_state_dict(sd, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    save_hf_checkpoint(ckpt.config, sd, tmp_path / "out")
    assert_same_tensors(load_checkpoint(tmp_path / "out").tensors, ckpt.tensors)


# --------------------------------------------------------------------------- Meta

def test_permutation_moves_even_rows_first():
    d, heads = 8, 2
    w = torch.arange(heads * d).repeat_interleave(3).reshape(heads * d, 3)
    hf = permute_meta_to_hf(w, heads)
    # per head: Meta rows 0,2,4,6 then 1,3,5,7
    assert hf[:, 0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]
    assert torch.equal(permute_hf_to_meta(hf, heads), w)


@pytest.mark.parametrize("variant,num_shards,embed_split_dim", [
    ("gqa", 1, 1), ("gqa", 2, 1), ("mha", 2, 0), ("mqa", 1, 1), ("llama3_rope", 2, 1)])
def test_meta_round_trip_equals_hf_load(tmp_path, variant, num_shards, embed_split_dim):
    overrides = dict(VARIANTS[variant])
    if num_shards > 1:  # Meta splits output.weight over the vocab
        overrides["vocab_size"] = 258
    if variant == "llama3_rope":  # Meta can only say use_scaled_rope (fixed factors)
        overrides["rope_scaling"] = {**LLAMA3_ROPE, "original_max_position_embeddings": 8192}
    hf = load_checkpoint(save_hf(make_model(**overrides), tmp_path / "hf"))
    save_meta_checkpoint(hf.config, to_hf_state_dict(hf), tmp_path / "meta", num_shards, embed_split_dim)
    files = sorted(p.name for p in (tmp_path / "meta").iterdir())
    assert files == [f"consolidated.{i:02d}.pth" for i in range(num_shards)] + ["params.json"]
    part = torch.load(tmp_path / "meta" / "consolidated.00.pth", weights_only=True)
    assert part["layers.0.attention.wq.weight"].shape[0] == hf.config.q_size // num_shards
    params = json.loads((tmp_path / "meta" / "params.json").read_text())
    assert meta_intermediate_size(params["dim"], params["multiple_of"],
                                  params["ffn_dim_multiplier"]) == hf.config.intermediate_size

    meta = load_checkpoint(tmp_path / "meta")
    assert checkpoint_format(tmp_path / "meta") == "meta"
    assert_same_config(meta.config, hf.config)
    assert_same_tensors(meta.tensors, hf.tensors)


def test_meta_scaled_rope_and_tied(tmp_path):
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=8, rope_theta=500000.0, rope_scaling=META_LLAMA3_ROPE,
                      tie_word_embeddings=True)
    torch.manual_seed(1)
    sd = {n: torch.randn(s) for n, s in hf_shapes(cfg).items()}
    save_meta_checkpoint(cfg, sd, tmp_path)
    assert json.loads((tmp_path / "params.json").read_text())["use_scaled_rope"] is True
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.config.rope_scaling == META_LLAMA3_ROPE
    assert ckpt.config.max_position_embeddings == 131072
    assert ckpt.config.tie_word_embeddings
    assert ckpt.tensors["lm_head.weight"] is ckpt.tensors["embed.weight"]
    assert torch.equal(ckpt.tensors["embed.weight"], sd["model.embed_tokens.weight"])


def test_meta_vocab_from_tensors_when_params_say_minus_one(tmp_path):
    hf = load_checkpoint(save_hf(make_model(vocab_size=258), tmp_path / "hf"))
    save_meta_checkpoint(hf.config, to_hf_state_dict(hf), tmp_path / "meta", num_shards=2)
    params_path = tmp_path / "meta" / "params.json"
    params = json.loads(params_path.read_text())
    params["vocab_size"] = -1
    params_path.write_text(json.dumps(params))
    assert load_checkpoint(tmp_path / "meta").config.vocab_size == 258


def _meta_rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Meta's apply_rotary_emb: complex rotation of pairs (2j, 2j+1). x: [T, heads, d]."""
    T, _, d = x.shape
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(T, dtype=torch.float64), freqs)
    xc = torch.view_as_complex(x.reshape(T, -1, d // 2, 2).contiguous())
    return torch.view_as_real(xc * torch.polar(torch.ones_like(angles), angles)[:, None]).flatten(-2)


def _hf_rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """HF's rotate_half rotation of pairs (j, j + d/2). x: [T, heads, d]."""
    T, _, d = x.shape
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(T, dtype=torch.float64), freqs)
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    return torch.einsum("thd,shd->hts", q, k.repeat_interleave(group, dim=1))


def test_meta_layout_gives_same_attention_scores_as_internal_layout(tmp_path):
    """The file save_meta_checkpoint writes is a true Meta layout (Meta's rotary on it
    gives HF's scores), and the loader turns it into the half-rotation layout."""
    hf = load_checkpoint(save_hf(make_model(dtype=torch.float32), tmp_path / "hf"))
    save_meta_checkpoint(hf.config, to_hf_state_dict(hf), tmp_path / "meta")
    raw = torch.load(tmp_path / "meta" / "consolidated.00.pth", weights_only=True)
    c, theta = hf.config, 10000.0
    ours = load_checkpoint(tmp_path / "meta").tensors["layers.0.qkv.weight"].double()
    wq_meta = raw["layers.0.attention.wq.weight"].double()
    wk_meta = raw["layers.0.attention.wk.weight"].double()
    x = torch.randn(7, c.hidden_size, dtype=torch.float64)

    def heads(w, n):
        return (x @ w.T).reshape(7, n, c.head_dim)

    meta_scores = _scores(_meta_rotary(heads(wq_meta, c.num_heads), theta),
                          _meta_rotary(heads(wk_meta, c.num_kv_heads), theta))
    q, k = ours[: c.q_size], ours[c.q_size: c.q_size + c.kv_size]
    our_scores = _scores(_hf_rotary(heads(q, c.num_heads), theta), _hf_rotary(heads(k, c.num_kv_heads), theta))
    torch.testing.assert_close(our_scores, meta_scores)
    # Without the permutation the two conventions disagree: the check above has teeth.
    wrong = _scores(_hf_rotary(heads(wq_meta, c.num_heads), theta), _hf_rotary(heads(wk_meta, c.num_kv_heads), theta))
    assert not torch.allclose(wrong, meta_scores, atol=1e-3)


@given(dim=st.integers(1, 16384), inter=st.integers(1, 65536))
@settings(max_examples=300, deadline=None)
def test_meta_ffn_params_reproduce_width(dim, inter):
    multiple_of, multiplier = _meta_ffn_params(dim, inter)
    assert meta_intermediate_size(dim, multiple_of, multiplier) == inter


def test_meta_intermediate_size_matches_known_models():
    assert meta_intermediate_size(4096, 256, None) == 11008      # Llama 2 7B
    assert meta_intermediate_size(4096, 1024, 1.3) == 14336      # Llama 3 8B
    assert meta_intermediate_size(8192, 4096, 1.3) == 28672      # Llama 2/3 70B


def test_meta_writer_rejects_what_meta_cannot_express(tmp_path):
    hf = load_checkpoint(save_hf(make_model(**VARIANTS["wide_heads"]), tmp_path / "a"))
    with pytest.raises(CheckpointError, match="head_dim"):
        save_meta_checkpoint(hf.config, to_hf_state_dict(hf), tmp_path / "m1")
    hf = load_checkpoint(save_hf(make_model(**VARIANTS["llama3_rope"]), tmp_path / "b"))
    with pytest.raises(CheckpointError, match="rope_scaling"):
        save_meta_checkpoint(hf.config, to_hf_state_dict(hf), tmp_path / "m2")
    hf = load_checkpoint(save_hf(make_model(**VARIANTS["mqa"]), tmp_path / "c"))
    with pytest.raises(CheckpointError, match="n_kv_heads=1"):
        save_meta_checkpoint(hf.config, to_hf_state_dict(hf), tmp_path / "m3", num_shards=2)


# --------------------------------------------------------------------------- converted form

@pytest.mark.parametrize("variant", ["gqa", "tied"])
def test_convert_round_trip(tmp_path, variant):
    src = save_hf(make_model(**VARIANTS[variant]), tmp_path / "hf")
    (src / "tokenizer.json").write_text('{"fake": true}')
    dst = convert_checkpoint(src, tmp_path / "conv")
    meta = json.loads((dst / "turbomq.json").read_text())
    assert meta["format_version"] == 1 and meta["tp"] == 1
    assert (dst / "tokenizer.json").read_text() == '{"fake": true}'
    assert (dst / "generation_config.json").is_file()
    assert checkpoint_format(dst) == "turbomq"
    hf, conv = load_checkpoint(src), load_checkpoint(dst)
    assert conv.config == hf.config
    assert_same_tensors(conv.tensors, hf.tensors)
    if variant == "tied":
        assert conv.tensors["lm_head.weight"] is conv.tensors["embed.weight"]


def test_convert_sharded_then_reconverted_single_and_dtype(tmp_path):
    src = save_hf(make_model(), tmp_path / "hf")
    hf = load_checkpoint(src)
    dst = convert_checkpoint(src, tmp_path / "conv", max_shard_bytes=50_000)
    assert (dst / "model.safetensors.index.json").is_file()
    assert_same_tensors(load_checkpoint(dst).tensors, hf.tensors)
    # Converting again into the same place must not leave the old shards in charge.
    convert_checkpoint(src, dst, dtype=torch.bfloat16)
    assert sorted(p.name for p in dst.glob("model*")) == ["model.safetensors"]
    conv = load_checkpoint(dst)
    assert conv.config.torch_dtype == "bfloat16"
    assert_same_tensors(conv.tensors, {k: v.to(torch.bfloat16) for k, v in hf.tensors.items()})


def test_convert_from_meta(tmp_path):
    hf = load_checkpoint(save_hf(make_model(vocab_size=258), tmp_path / "hf"))
    save_meta_checkpoint(hf.config, to_hf_state_dict(hf), tmp_path / "meta", num_shards=2)
    assert_same_tensors(load_checkpoint(convert_checkpoint(tmp_path / "meta", tmp_path / "c")).tensors, hf.tensors)


# --------------------------------------------------------------------------- errors

@pytest.fixture
def hf_dir(tmp_path) -> Path:
    return save_hf(make_model(), tmp_path / "hf")


def _rewrite(path: Path, edit) -> None:
    sd = load_file(path)
    edit(sd)
    save_file(sd, path)


def test_error_missing_tensor(hf_dir):
    _rewrite(hf_dir / "model.safetensors", lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing tensor 'model\.layers\.1\.mlp\.up_proj"):
        load_checkpoint(hf_dir)


def test_error_unexpected_tensor(hf_dir):
    _rewrite(hf_dir / "model.safetensors",
             lambda sd: sd.__setitem__("model.layers.0.self_attn.q_proj.bias", torch.zeros(72)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        load_checkpoint(hf_dir)


def test_error_wrong_shape(hf_dir):
    _rewrite(hf_dir / "model.safetensors",
             lambda sd: sd.__setitem__("model.layers.0.mlp.down_proj.weight", torch.zeros(72, 99)))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight' has shape "
                                              r"\[72, 99\], expected \[72, 100\]"):
        load_checkpoint(hf_dir)


def test_error_truncated_safetensors(hf_dir):
    f = hf_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupted"):
        load_checkpoint(hf_dir)


def test_error_garbage_safetensors(hf_dir):
    (hf_dir / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupted"):
        load_checkpoint(hf_dir)


def test_error_missing_shard(tmp_path):
    src = save_hf(make_model(), tmp_path, max_shard_size="40KB")
    shard = sorted(src.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"index\.json: refers to missing shard '{shard.name}'"):
        load_checkpoint(src)


def test_error_index_tensor_not_in_shard(tmp_path):
    src = save_hf(make_model(), tmp_path, max_shard_size="40KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    first, second = sorted(set(index["weight_map"].values()))[:2]
    name = next(n for n, f in index["weight_map"].items() if f == first)
    index["weight_map"][name] = second
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"{second}: has no tensor '{name}'"):
        load_checkpoint(src)


def test_error_unsupported_architecture(hf_dir):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"config\.json: unsupported architecture.*Mistral"):
        load_checkpoint(hf_dir)


def test_error_nothing_to_load(tmp_path):
    with pytest.raises(CheckpointError, match=r"turbomq\.json.*config\.json.*params\.json"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps(make_model().config.to_dict()))
    with pytest.raises(CheckpointError, match=r"no weights; looked for model\.safetensors\.index\.json"):
        load_checkpoint(tmp_path)


@pytest.fixture
def meta_dir(tmp_path) -> Path:
    hf = load_checkpoint(save_hf(make_model(vocab_size=258), tmp_path / "hf"))
    return save_meta_checkpoint(hf.config, to_hf_state_dict(hf), tmp_path / "meta", num_shards=2)


def test_error_meta_missing_shard(meta_dir):
    (meta_dir / "consolidated.01.pth").rename(meta_dir / "consolidated.02.pth")
    with pytest.raises(CheckpointError, match=r"missing Meta shard consolidated\.01\.pth"):
        load_checkpoint(meta_dir)


def test_error_meta_corrupted_shard(meta_dir):
    f = meta_dir / "consolidated.01.pth"
    f.write_bytes(f.read_bytes()[:-2000])
    with pytest.raises(CheckpointError, match=r"consolidated\.01\.pth: corrupted"):
        load_checkpoint(meta_dir)


def test_error_meta_params_field_and_tensor(meta_dir):
    params = json.loads((meta_dir / "params.json").read_text())
    del params["n_heads"]
    (meta_dir / "params.json").write_text(json.dumps(params))
    with pytest.raises(CheckpointError, match=r"params\.json: missing required field 'n_heads'"):
        load_checkpoint(meta_dir)


def test_error_meta_shard_missing_tensor(meta_dir):
    path = meta_dir / "consolidated.01.pth"
    sd = torch.load(path, weights_only=True)
    del sd["layers.1.feed_forward.w2.weight"]
    torch.save(sd, path)
    with pytest.raises(CheckpointError, match=r"consolidated\.01\.pth: tensor set differs.*layers\.1\.feed_forward\.w2"):
        load_checkpoint(meta_dir)


def test_error_meta_wrong_shape(meta_dir):
    for path in meta_dir.glob("consolidated.*.pth"):
        sd = torch.load(path, weights_only=True)
        sd["layers.0.attention.wo.weight"] = torch.zeros(72, 30)
        torch.save(sd, path)
    with pytest.raises(CheckpointError, match=r"'layers\.0\.attention\.wo\.weight' has shape \[72, 60\], "
                                              r"expected \[72, 72\]"):
        load_checkpoint(meta_dir)


def test_error_converted_form(hf_dir, tmp_path):
    dst = convert_checkpoint(hf_dir, tmp_path / "conv")
    meta_path = dst / "turbomq.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "tp": 2}))
    with pytest.raises(CheckpointError, match="tp=2"):
        load_checkpoint(dst)
    meta_path.write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(CheckpointError, match="format_version 99"):
        load_checkpoint(dst)
    meta_path.write_text(json.dumps(meta))
    _rewrite(dst / "model.safetensors", lambda sd: sd.pop("layers.1.qkv.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.1\.qkv\.weight'"):
        load_checkpoint(dst)
    with pytest.raises(CheckpointError, match="must differ"):
        convert_checkpoint(hf_dir, hf_dir)
