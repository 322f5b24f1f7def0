"""Checkpoint loading: HF, Meta and our converted form, all into one internal layout.

Every loader ends in a `Checkpoint` whose tensors carry the internal names listed
by `internal_shapes` (fused qkv and gate_up, HF "half rotation" rotary layout).
docs/weights.md describes the names, the Meta permutation and the converted form.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ConfigError, ModelConfig, RopeScaling, read_json
from .files import open_gguf, read_model_file
from .gguf import GGUFError, is_gguf

PathLike = Union[str, Path]

FORMAT_VERSION = 1
CONVERTED_CONFIG = "turbomq.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "special_tokens_map.json", "tokenizer.model")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
FP8 = torch.float8_e4m3fn
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# Meta's use_scaled_rope means these fixed llama3 factors (llama-models' apply_scaling).
META_LLAMA3_ROPE = RopeScaling(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                               high_freq_factor=4.0, original_max_position_embeddings=8192)
# Meta's params.json carries no context length; llama3-scaled models are 128k ones.
META_SCALED_ROPE_MAX_POSITIONS = 131072

_ST_SINGLE, _ST_INDEX = "model.safetensors", "model.safetensors.index.json"
_BIN_SINGLE, _BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
_HF_WEIGHT_FILES = (_ST_INDEX, _ST_SINGLE, _BIN_INDEX, _BIN_SINGLE)
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_META_SHARD_RE = re.compile(r"consolidated\.(\d+)\.pth")


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded or written; the message names the file and the tensor or field."""


@dataclass
class Checkpoint:
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    # What to compute in on a GPU when no dtype is asked for, where the stored
    # float32 is only the result of dequantizing (GGUF): fp16, llama.cpp's own
    # float type (bf16's 8-bit mantissa flips near-tied greedy picks of small
    # models). None: the stored dtype.
    gpu_dtype: Optional[torch.dtype] = None
    # "fp8": the layers' projections are stored in E4M3, each internal
    # "layers.{i}.{qkv,o,gate_up,down}.weight" with a float32
    # "...weight_scale" [out] beside it (an FP8 checkpoint, loaded as is).
    quantization: Optional[str] = None


# --------------------------------------------------------------------------- names and shapes

def internal_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every internal tensor name with its shape, in load order."""
    c, H = config, config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (c.vocab_size, H)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        shapes[p + "attn_norm.weight"] = (H,)
        shapes[p + "qkv.weight"] = (c.q_size + 2 * c.kv_size, H)
        shapes[p + "o.weight"] = (H, c.q_size)
        shapes[p + "mlp_norm.weight"] = (H,)
        shapes[p + "gate_up.weight"] = (2 * c.intermediate_size, H)
        shapes[p + "down.weight"] = (H, c.intermediate_size)
    shapes["norm.weight"] = (H,)
    shapes["lm_head.weight"] = (c.vocab_size, H)
    return shapes


def hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF LlamaForCausalLM tensor names with shapes; lm_head is absent when tied."""
    c, H, I = config, config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, H)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "self_attn.q_proj.weight"] = (c.q_size, H)
        shapes[p + "self_attn.k_proj.weight"] = (c.kv_size, H)
        shapes[p + "self_attn.v_proj.weight"] = (c.kv_size, H)
        shapes[p + "self_attn.o_proj.weight"] = (H, c.q_size)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        shapes[p + "mlp.gate_proj.weight"] = (I, H)
        shapes[p + "mlp.up_proj.weight"] = (I, H)
        shapes[p + "mlp.down_proj.weight"] = (H, I)
    shapes["model.norm.weight"] = (H,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, H)
    return shapes


# Meta name <-> HF name. Per-layer suffixes follow "layers.{i}." / "model.layers.{i}.".
_META_HF_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight",
                "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_META_HF_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_HF_META_TOP = {v: k for k, v in _META_HF_TOP.items()}
_HF_META_LAYER = {v: k for k, v in _META_HF_LAYER.items()}
# Model-parallel concat dim per Meta module (tok_embeddings is decided by shape).
_META_SPLIT_DIM = {"wq": 0, "wk": 0, "wv": 0, "w1": 0, "w3": 0, "output": 0, "wo": 1, "w2": 1}


def _meta_to_hf_name(name: str) -> Optional[str]:
    if name in _META_HF_TOP:
        return _META_HF_TOP[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _META_HF_LAYER:
        return f"model.layers.{m.group(1)}.{_META_HF_LAYER[m.group(2)]}"
    return None


def _hf_to_meta_name(name: str) -> str:
    if name in _HF_META_TOP:
        return _HF_META_TOP[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if not m or m.group(2) not in _HF_META_LAYER:
        raise CheckpointError(f"tensor {name!r} has no Meta-format name")
    return f"layers.{m.group(1)}.{_HF_META_LAYER[m.group(2)]}"


# --------------------------------------------------------------------------- rotary permutation

def permute_meta_to_hf(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a Meta wq/wk (interleaved pairs (2j, 2j+1)) into half rotation (j, j+d/2).

    Per head, even rows come first, then odd rows: HF row j = Meta row 2j and
    HF row j + d/2 = Meta row 2j+1 (what HF's convert_llama_weights_to_hf does)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def permute_hf_to_meta(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of permute_meta_to_hf."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def meta_intermediate_size(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    """FFN width the way Meta's FeedForward computes it."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


# --------------------------------------------------------------------------- reading files

class _TensorFile:
    """One weight file (.safetensors, .bin or .pth), opened once; errors name the file."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():
            raise CheckpointError(f"{path}: weight file not found")
        # safetensors and torch.load raise many exception types on damaged files;
        # any of them means the same thing here.
        try:
            if path.suffix == ".safetensors":
                handle = safe_open(str(path), framework="pt")
                self.names = list(handle.keys())
                self._get: Callable[[str], torch.Tensor] = handle.get_tensor
            else:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                self.names, self._get = self._check_state_dict(state), state.__getitem__
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{path}: corrupted or unreadable weight file: {e}") from e

    def _check_state_dict(self, state: Any) -> list[str]:
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{self.path}: expected a dict of tensors")
        return list(state)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise CheckpointError(f"{self.path}: has no tensor {name!r}")
        try:
            return self._get(name)
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot read tensor {name!r}: {e}") from e


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = read_json(path)
    except ConfigError as e:
        raise CheckpointError(str(e)) from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _weight_map(root: Path, index_name: str, single_name: str) -> Optional[dict[str, Path]]:
    """Tensor name -> file, from an index (checking every shard exists) or a single file."""
    index = root / index_name
    if index.is_file():
        wm = _read_json(index).get("weight_map")
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index}: missing 'weight_map'")
        out = {name: root / shard for name, shard in wm.items()}
        for name, shard in out.items():
            if not shard.is_file():
                raise CheckpointError(f"{index}: refers to missing shard {shard.name!r} (tensor {name!r})")
        return out
    if (root / single_name).is_file():
        f = _TensorFile(root / single_name)
        return {name: f.path for name in f.names}
    return None


def _read_mapped(weight_map: dict[str, Path], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Read the named tensors, opening each file once."""
    files: dict[Path, _TensorFile] = {}
    out = {}
    for name in names:
        path = weight_map[name]
        if path not in files:
            files[path] = _TensorFile(path)
        out[name] = files[path].get(name)
    return out


# --------------------------------------------------------------------------- validation

def _preview(names: Iterable[str], limit: int = 5) -> str:
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def _check_names(found: Iterable[str], expected: dict[str, tuple[int, ...]],
                 locate: Callable[[str], str], missing_at: str) -> None:
    found = set(found)
    missing = [n for n in expected if n not in found]
    if missing:
        raise CheckpointError(f"{missing_at}: missing tensor {_preview(missing)}")
    unexpected = sorted(found - set(expected))
    if unexpected:
        raise CheckpointError(f"{locate(unexpected[0])}: unexpected tensor {_preview(unexpected)}")


def _check_shapes(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                  locate: Callable[[str], str]) -> None:
    for name, want in expected.items():
        got = tuple(tensors[name].shape)
        if got != want:
            raise CheckpointError(
                f"{locate(name)}: tensor {name!r} has shape {list(got)}, expected {list(want)}")


def _target_dtype(requested: Optional[torch.dtype], declared: Optional[str],
                  stored: torch.dtype, where: str) -> torch.dtype:
    """Requested dtype, else the config's torch_dtype, else the stored one."""
    if requested is not None:
        if requested not in _DTYPE_NAMES:
            raise CheckpointError(f"unsupported dtype {requested}; supported: {', '.join(DTYPES)}")
        return requested
    if declared in DTYPES:
        return DTYPES[declared]
    if stored in _DTYPE_NAMES:
        return stored
    raise CheckpointError(f"{where}: weights are stored as {stored}; pass dtype= one of {', '.join(DTYPES)}")


def _with_dtype(config: ModelConfig, dtype: torch.dtype) -> ModelConfig:
    return dataclasses.replace(config, torch_dtype=_DTYPE_NAMES[dtype])


def _config(make: Callable[[], ModelConfig], where: Path) -> ModelConfig:
    try:
        return make()
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: {e}") from e


# --------------------------------------------------------------------------- fusing

def fuse_hf_state_dict(config: ModelConfig, hf: dict[str, torch.Tensor],
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named tensors (half rotation) into internal names. Pops from `hf` so the
    unfused copies are freed as each layer is fused. FP8 projections stay FP8,
    their per-channel scales fused alongside (`..._proj.weight_scale`)."""
    def take(name: str) -> torch.Tensor:
        t = hf.pop(name)
        return (t if t.dtype == FP8 else t.to(dtype)).contiguous()

    def fuse(q: str, parts: list[str]) -> None:
        out[q + ".weight"] = torch.cat([take(n + ".weight") for n in parts])
        if parts[0] + ".weight_scale" in hf:
            out[q + ".weight_scale"] = torch.cat([hf.pop(n + ".weight_scale") for n in parts])

    out = {"embed.weight": take("model.embed_tokens.weight")}
    for i in range(config.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        out[q + "attn_norm.weight"] = take(p + "input_layernorm.weight")
        fuse(q + "qkv", [p + f"self_attn.{x}_proj" for x in "qkv"])
        fuse(q + "o", [p + "self_attn.o_proj"])
        out[q + "mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
        fuse(q + "gate_up", [p + "mlp.gate_proj", p + "mlp.up_proj"])
        fuse(q + "down", [p + "mlp.down_proj"])
    out["norm.weight"] = take("model.norm.weight")
    out["lm_head.weight"] = out["embed.weight"] if config.tie_word_embeddings else take("lm_head.weight")
    return out


def to_hf_state_dict(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """Internal tensors back to HF names (independent copies; lm_head omitted when tied)."""
    c, t = checkpoint.config, checkpoint.tensors
    out = {"model.embed_tokens.weight": t["embed.weight"].clone()}
    for i in range(c.num_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        out[p + "input_layernorm.weight"] = t[q + "attn_norm.weight"].clone()
        qw, kw, vw = t[q + "qkv.weight"].split([c.q_size, c.kv_size, c.kv_size])
        out[p + "self_attn.q_proj.weight"] = qw.clone()
        out[p + "self_attn.k_proj.weight"] = kw.clone()
        out[p + "self_attn.v_proj.weight"] = vw.clone()
        out[p + "self_attn.o_proj.weight"] = t[q + "o.weight"].clone()
        out[p + "post_attention_layernorm.weight"] = t[q + "mlp_norm.weight"].clone()
        gate, up = t[q + "gate_up.weight"].split([c.intermediate_size] * 2)
        out[p + "mlp.gate_proj.weight"] = gate.clone()
        out[p + "mlp.up_proj.weight"] = up.clone()
        out[p + "mlp.down_proj.weight"] = t[q + "down.weight"].clone()
    out["model.norm.weight"] = t["norm.weight"].clone()
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = t["lm_head.weight"].clone()
    return out


# --------------------------------------------------------------------------- detection

def checkpoint_format(path: PathLike) -> str:
    """'turbomq', 'hf' or 'meta', decided by which config file the directory holds,
    or 'gguf' for a .gguf file."""
    root = Path(path)
    if is_gguf(root) and root.is_file():
        return "gguf"
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory not found")
    if (root / CONVERTED_CONFIG).is_file():
        return "turbomq"
    if (root / "config.json").is_file():
        return "hf"
    if (root / "params.json").is_file():
        return "meta"
    raise CheckpointError(
        f"{root}: no checkpoint found; looked for {CONVERTED_CONFIG} (turbomq converted form), "
        f"config.json with {' / '.join(_HF_WEIGHT_FILES)} (Hugging Face), "
        f"params.json with consolidated.NN.pth (Meta)")


def load_checkpoint(path: PathLike, dtype: Optional[torch.dtype] = None) -> Checkpoint:
    """Load any supported checkpoint directory into the internal form.

    dtype=None keeps the checkpoint's dtype (config torch_dtype, else as stored)."""
    root = Path(path)
    loaders = {"turbomq": _load_converted, "hf": _load_hf, "meta": _load_meta, "gguf": _load_gguf}
    loader = loaders[checkpoint_format(root)]
    return loader(root, dtype)


# --------------------------------------------------------------------------- HF

def _load_hf(root: Path, dtype: Optional[torch.dtype]) -> Checkpoint:
    raw = _read_json(root / "config.json")
    config = _config(lambda: ModelConfig.from_hf(raw), root / "config.json")
    weight_map = _weight_map(root, _ST_INDEX, _ST_SINGLE)
    if weight_map is None:
        weight_map = _weight_map(root, _BIN_INDEX, _BIN_SINGLE)
    if weight_map is None:
        raise CheckpointError(f"{root}: config.json found but no weights; looked for {', '.join(_HF_WEIGHT_FILES)}")
    index = next((root / n for n in (_ST_INDEX, _BIN_INDEX) if (root / n).is_file()), None)
    missing_at = str(index or next(iter(weight_map.values()), root))

    def locate(name: str) -> str:
        return str(weight_map.get(name, missing_at))

    fp8 = _fp8_checkpoint(raw.get("quantization_config"), root / "config.json")
    # Rotary caches are derived data; a tied checkpoint may still store lm_head;
    # static activation scales of an FP8 checkpoint are not used (activations
    # are quantized per token).
    names = [n for n in weight_map if not n.endswith("rotary_emb.inv_freq")
             and not (config.tie_word_embeddings and n == "lm_head.weight")
             and not (fp8 and n.endswith(".input_scale"))]
    expected = hf_shapes(config)
    scales = {n[:-len("weight")] + "weight_scale": (s[0],) for n, s in expected.items()
              if fp8 and n.endswith("_proj.weight")}
    _check_names(names, {**expected, **scales}, locate, missing_at)
    hf = _read_mapped(weight_map, [*expected, *scales])
    _check_shapes(hf, expected, locate)
    for name, (rows,) in scales.items():
        hf[name] = _channel_scales(hf[name], rows, locate(name), name)
        if hf[name[:-len("_scale")]].dtype != FP8:
            raise CheckpointError(f"{locate(name)}: {name[:-len('_scale')]!r} is not stored as "
                                  "float8_e4m3fn, as the quantization_config says")
    declared = raw.get("torch_dtype") or raw.get("dtype")
    target = _target_dtype(dtype, declared, hf["model.embed_tokens.weight"].dtype, missing_at)
    return Checkpoint(_with_dtype(config, target), fuse_hf_state_dict(config, hf, target),
                      quantization="fp8" if fp8 else None)


def _fp8_checkpoint(qc: Any, where: Path) -> bool:
    """Whether `quantization_config` describes FP8 (E4M3) weights with one scale
    per output channel or per tensor, the form loaded as is: compressed-tensors'
    "float-quantized" and fbgemm_fp8. Other quantizations are refused."""
    if qc is None:
        return False
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method == "fbgemm_fp8":
        return True
    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        for group in groups.values():
            w = (group or {}).get("weights") or {}
            if (w.get("type"), w.get("num_bits"), w.get("strategy")) not in (
                    ("float", 8, "channel"), ("float", 8, "tensor")):
                raise CheckpointError(f"{where}: compressed-tensors weights {w!r} are not "
                                      "supported; FP8 with channel or tensor scales is")
        if groups:
            return True
    raise CheckpointError(f"{where}: quantization_config {method or qc!r} is not supported; "
                          "FP8 checkpoints (compressed-tensors float-quantized, fbgemm_fp8) are, "
                          "and --quantization fp8 converts a 16-bit checkpoint at load")


def _channel_scales(scale: torch.Tensor, rows: int, where: str, name: str) -> torch.Tensor:
    """A weight's scale as float32 [rows]: per channel ([rows] or [rows, 1]) or
    one for the whole tensor ([] or [1]), repeated."""
    if scale.numel() == 1:
        return scale.float().reshape(1).expand(rows).contiguous()
    if scale.numel() == rows:
        return scale.float().reshape(rows).contiguous()
    raise CheckpointError(f"{where}: {name!r} has shape {list(scale.shape)}; expected one scale "
                          f"per output channel ({rows}) or one per tensor")


# --------------------------------------------------------------------------- GGUF

def _load_gguf(path: Path, dtype: Optional[torch.dtype]) -> Checkpoint:
    """A llama.cpp GGUF file, dequantized to float32 (or `dtype`)."""
    try:
        gguf = open_gguf(str(path.resolve()))
        config = _config(lambda: ModelConfig.from_hf(gguf.hf_config()), path)
        arrays = gguf.hf_tensors()
    except GGUFError as e:
        raise CheckpointError(str(e)) from None
    hf = {name: torch.from_numpy(a) for name, a in arrays.items()}
    expected = hf_shapes(config)
    _check_names(hf, expected, lambda name: str(path), str(path))
    _check_shapes(hf, expected, lambda name: str(path))
    target = dtype or torch.float32
    return Checkpoint(_with_dtype(config, target), fuse_hf_state_dict(config, hf, target),
                      gpu_dtype=None if dtype else torch.float16)


def _plan_shards(tensors: dict[str, torch.Tensor], max_bytes: Optional[int]) -> list[list[str]]:
    """Greedy split in name order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if max_bytes is not None and shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _clear_weight_files(out_dir: Path) -> None:
    """Drop our earlier outputs so a stale index or shard cannot shadow the new ones."""
    for p in out_dir.iterdir():
        if p.name in (_ST_SINGLE, _ST_INDEX, CONVERTED_CONFIG) or _SHARD_RE.fullmatch(p.name):
            p.unlink()


def _write_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path,
                       max_shard_bytes: Optional[int]) -> None:
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    shards = _plan_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, str(out_dir / _ST_SINGLE), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / _ST_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _checked_hf_input(config: ModelConfig, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict's required tensors in canonical order, or a CheckpointError."""
    sd = {k: v for k, v in hf_state_dict.items() if not k.endswith("rotary_emb.inv_freq")
          and not (config.tie_word_embeddings and k == "lm_head.weight")}
    expected = hf_shapes(config)
    _check_names(sd, expected, lambda n: "state dict", "state dict")
    _check_shapes(sd, expected, lambda n: "state dict")
    return {name: sd[name] for name in expected}


def save_hf_checkpoint(config: ModelConfig, hf_state_dict: dict[str, torch.Tensor], out_dir: PathLike,
                       max_shard_bytes: Optional[int] = None) -> Path:
    """Write config.json and model.safetensors (or shards plus an index) in HF layout."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sd = _checked_hf_input(config, hf_state_dict)
    _clear_weight_files(out)
    (out / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    _write_safetensors(sd, out, max_shard_bytes)
    return out


# --------------------------------------------------------------------------- Meta

def _meta_shard_paths(root: Path) -> list[Path]:
    found = {}
    for p in root.iterdir():
        m = _META_SHARD_RE.fullmatch(p.name)
        if m:
            found[int(m.group(1))] = p
    if not found:
        raise CheckpointError(f"{root}: params.json found but no consolidated.NN.pth weight files")
    for i in range(max(found) + 1):
        if i not in found:
            raise CheckpointError(f"{root}: missing Meta shard consolidated.{i:02d}.pth "
                                  f"(found {len(found)} shards up to {found[max(found)].name})")
    return [found[i] for i in range(len(found))]


def _merge_meta(name: str, parts: list[torch.Tensor], dim: int, files: list[Path]) -> torch.Tensor:
    """Undo Meta's model-parallel split of one tensor."""
    if len(parts) == 1:
        return parts[0]
    module = name.split(".")[-2]
    if module == "tok_embeddings":
        # llama 1/2 split the embedding along dim 1, llama 3 along the vocab.
        cat_dim = 0 if parts[0].dim() == 2 and parts[0].shape[1] == dim else 1
    else:
        cat_dim = _META_SPLIT_DIM.get(module)
    if cat_dim is None:  # norms are replicated on every rank
        return parts[0]
    try:
        return torch.cat(parts, dim=cat_dim)
    except RuntimeError as e:
        shapes = ", ".join(f"{f.name}: {list(p.shape)}" for f, p in zip(files, parts))
        raise CheckpointError(f"{files[0].parent}: tensor {name!r} shards do not fit together ({shapes})") from e


def _meta_config(params: dict[str, Any], merged: dict[str, torch.Tensor], where: Path) -> ModelConfig:
    def need(key: str) -> Any:
        if params.get(key) is None:
            raise CheckpointError(f"{where}: missing required field {key!r}")
        return params[key]

    dim, n_heads = int(need("dim")), int(need("n_heads"))
    vocab = int(params.get("vocab_size") or -1)
    embed = merged.get("tok_embeddings.weight")
    if vocab <= 0:  # llama 1 leaves it to the tokenizer
        if embed is None:
            raise CheckpointError(f"{where}: vocab_size is {vocab} and tok_embeddings.weight is missing")
        vocab = embed.shape[0]
    w1 = merged.get("layers.0.feed_forward.w1.weight")
    inter = w1.shape[0] if w1 is not None else meta_intermediate_size(
        dim, int(params.get("multiple_of", 256)), params.get("ffn_dim_multiplier"))
    scaled = bool(params.get("use_scaled_rope"))
    output = merged.get("output.weight")
    tied = output is None or (embed is not None and output.shape == embed.shape and torch.equal(output, embed))
    return _config(lambda: ModelConfig(
        vocab_size=vocab, hidden_size=dim, intermediate_size=int(inter),
        num_layers=int(need("n_layers")), num_heads=n_heads,
        num_kv_heads=int(params.get("n_kv_heads") or n_heads),
        head_dim=dim // n_heads, rms_norm_eps=float(params.get("norm_eps", 1e-5)),
        rope_theta=float(params.get("rope_theta", 10000.0)),
        rope_scaling=META_LLAMA3_ROPE if scaled else RopeScaling(),
        max_position_embeddings=int(params.get("max_seq_len")
                                    or (META_SCALED_ROPE_MAX_POSITIONS if scaled else 4096)),
        tie_word_embeddings=tied,
        torch_dtype=_DTYPE_NAMES.get(embed.dtype if embed is not None else None, "float32"),
    ), where)


def _load_meta(root: Path, dtype: Optional[torch.dtype]) -> Checkpoint:
    params_path = root / "params.json"
    params = _read_json(params_path)
    paths = _meta_shard_paths(root)
    shards = [_TensorFile(p) for p in paths]
    names = [n for n in shards[0].names if n != "rope.freqs"]  # rope.freqs: llama 1's rotary cache
    for s in shards[1:]:
        other = [n for n in s.names if n != "rope.freqs"]
        if set(other) != set(names):
            odd = set(names) ^ set(other)
            raise CheckpointError(f"{s.path}: tensor set differs from {paths[0].name}: {_preview(odd)}")
    dim = int(params.get("dim") or 0)
    merged = {n: _merge_meta(n, [s.get(n) for s in shards], dim, paths) for n in names}
    config = _meta_config(params, merged, params_path)
    if config.tie_word_embeddings:
        merged.pop("output.weight", None)

    where = str(paths[0]) if len(paths) == 1 else f"{root}/consolidated.*.pth"
    expected = {_hf_to_meta_name(n): s for n, s in hf_shapes(config).items()}
    _check_names(merged, expected, lambda n: where, where)
    _check_shapes(merged, expected, lambda n: where)

    hf = {}
    for name, t in merged.items():
        if name.endswith(("attention.wq.weight", "attention.wk.weight")):
            heads = config.num_heads if name.endswith("wq.weight") else config.num_kv_heads
            t = permute_meta_to_hf(t, heads)
        hf[_meta_to_hf_name(name)] = t
    target = _target_dtype(dtype, None, hf["model.embed_tokens.weight"].dtype, where)
    return Checkpoint(_with_dtype(config, target), fuse_hf_state_dict(config, hf, target))


def _meta_ffn_params(dim: int, intermediate: int) -> tuple[int, Optional[float]]:
    """(multiple_of, ffn_dim_multiplier) for which Meta's formula yields `intermediate`."""
    if meta_intermediate_size(dim, 256, None) == intermediate:
        return 256, None
    # Rounding up to a multiple of the width itself gives the width from any
    # multiplier that lands in [1, width]; float error can leave the product a hair
    # under an integer (truncated to 0 for width 1), so step up by ulps until exact.
    multiplier = intermediate / int(2 * (4 * dim) / 3)
    for _ in range(64):
        if meta_intermediate_size(dim, intermediate, multiplier) == intermediate:
            return intermediate, multiplier
        multiplier = math.nextafter(multiplier, math.inf)
    raise CheckpointError(f"no Meta ffn_dim_multiplier gives intermediate_size {intermediate} for dim {dim}")


def _meta_params(config: ModelConfig) -> dict[str, Any]:
    c = config
    if c.hidden_size % c.num_heads or c.head_dim != c.hidden_size // c.num_heads:
        raise CheckpointError(f"Meta format needs head_dim == dim / n_heads; got head_dim {c.head_dim}, "
                              f"dim {c.hidden_size}, n_heads {c.num_heads}")
    rs = c.rope_scaling
    if rs.rope_type not in ("default", "llama3") or (rs.rope_type == "llama3" and rs != META_LLAMA3_ROPE):
        raise CheckpointError(f"Meta format cannot express rope_scaling {rs}; only none or "
                              f"use_scaled_rope ({META_LLAMA3_ROPE})")
    multiple_of, multiplier = _meta_ffn_params(c.hidden_size, c.intermediate_size)
    params: dict[str, Any] = {
        "dim": c.hidden_size, "n_layers": c.num_layers, "n_heads": c.num_heads,
        "n_kv_heads": c.num_kv_heads, "vocab_size": c.vocab_size, "multiple_of": multiple_of,
        "ffn_dim_multiplier": multiplier, "norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
    }
    if rs.rope_type == "llama3":
        params["use_scaled_rope"] = True
    return params


def _check_meta_split(config: ModelConfig, num_shards: int, embed_split_dim: int) -> None:
    c = config
    # output is split over the vocab; tok_embeddings over dim (llama 1/2) or the vocab (llama 3)
    sizes = {"n_heads": c.num_heads, "n_kv_heads": c.num_kv_heads,
             "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size}
    if embed_split_dim == 1:
        sizes["dim"] = c.hidden_size
    bad = [f"{k}={v}" for k, v in sizes.items() if v % max(num_shards, 1)]
    if num_shards < 1 or embed_split_dim not in (0, 1) or bad:
        raise CheckpointError(f"cannot split into {num_shards} Meta shards (embed_split_dim={embed_split_dim}): "
                              f"not divisible: {', '.join(bad) or '-'}")


def save_meta_checkpoint(config: ModelConfig, hf_state_dict: dict[str, torch.Tensor], out_dir: PathLike,
                         num_shards: int = 1, embed_split_dim: int = 1) -> Path:
    """Write params.json + consolidated.NN.pth in Meta's layout (interleaved rotary rows,
    model-parallel splits). embed_split_dim=1 is llama 1/2's embedding split, 0 llama 3's."""
    out = Path(out_dir)
    params = _meta_params(config)
    _check_meta_split(config, num_shards, embed_split_dim)
    sd = _checked_hf_input(config, hf_state_dict)
    if config.tie_word_embeddings:  # Meta checkpoints always carry output.weight
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(num_shards)]
    for hf_name, t in sd.items():
        name = _hf_to_meta_name(hf_name)
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if hf_name.endswith("q_proj.weight") else config.num_kv_heads
            t = permute_hf_to_meta(t, heads)
        module = name.split(".")[-2]
        split = embed_split_dim if module == "tok_embeddings" else _META_SPLIT_DIM.get(module)
        parts = [t] * num_shards if split is None else list(t.chunk(num_shards, dim=split))
        for shard, part in zip(shards, parts):
            # clone: torch.save of a view would write the whole underlying storage
            shard[name] = part.detach().clone().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    for p in out.glob("consolidated.*.pth"):
        p.unlink()
    for i, shard in enumerate(shards):
        torch.save(shard, out / f"consolidated.{i:02d}.pth")
    (out / "params.json").write_text(json.dumps(params, indent=2) + "\n")
    return out


# --------------------------------------------------------------------------- converted form

def _load_converted(root: Path, dtype: Optional[torch.dtype]) -> Checkpoint:
    meta_path = root / CONVERTED_CONFIG
    meta = _read_json(meta_path)
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: unsupported format_version {meta.get('format_version')!r}; "
                              f"this build reads {FORMAT_VERSION}")
    if meta.get("tp", 1) != 1:
        raise CheckpointError(f"{meta_path}: tp={meta.get('tp')} sharded checkpoints are not supported yet")
    if not isinstance(meta.get("config"), dict):
        raise CheckpointError(f"{meta_path}: missing 'config'")
    config = _config(lambda: ModelConfig.from_dict(meta["config"]), meta_path)
    weight_map = _weight_map(root, _ST_INDEX, _ST_SINGLE)
    if weight_map is None:
        raise CheckpointError(f"{root}: {CONVERTED_CONFIG} found but no {_ST_SINGLE} or {_ST_INDEX}")
    missing_at = str(root / (_ST_INDEX if (root / _ST_INDEX).is_file() else _ST_SINGLE))

    def locate(name: str) -> str:
        return str(weight_map.get(name, missing_at))

    expected = internal_shapes(config)
    if config.tie_word_embeddings:  # stored once, as embed.weight
        del expected["lm_head.weight"]
    _check_names(weight_map, expected, locate, missing_at)
    raw = _read_mapped(weight_map, expected)
    _check_shapes(raw, expected, locate)
    target = _target_dtype(dtype, config.torch_dtype, raw["embed.weight"].dtype, missing_at)
    tensors = {name: t.to(target).contiguous() for name, t in raw.items()}
    if config.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["embed.weight"]
    return Checkpoint(_with_dtype(config, target), tensors)


def save_converted(checkpoint: Checkpoint, out_dir: PathLike, max_shard_bytes: Optional[int] = None) -> Path:
    """Write a Checkpoint in the converted form (turbomq.json is written last, so a
    directory interrupted mid-write is not taken for a checkpoint)."""
    if checkpoint.quantization is not None:
        raise CheckpointError(f"{checkpoint.quantization} checkpoints are served as they are; "
                              "the converted form holds 16- and 32-bit weights")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _clear_weight_files(out)
    tensors = dict(checkpoint.tensors)
    if checkpoint.config.tie_word_embeddings:
        tensors.pop("lm_head.weight")
    _write_safetensors(tensors, out, max_shard_bytes)
    meta = {"format": "turbomq", "format_version": FORMAT_VERSION, "tp": 1,
            "config": checkpoint.config.to_dict()}
    (out / CONVERTED_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def convert_checkpoint(src: PathLike, dst: PathLike, dtype: Optional[torch.dtype] = None,
                       max_shard_bytes: Optional[int] = None) -> Path:
    """Load any supported checkpoint and write it in the converted form, with its tokenizer files."""
    src, dst = Path(src), Path(dst)
    if dst.exists() and dst.resolve() == src.resolve():
        raise CheckpointError(f"{dst}: convert destination must differ from the source")
    checkpoint = load_checkpoint(src, dtype)
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if is_gguf(src):
            text = read_model_file(src, name)
            if text is not None:
                (dst / name).write_text(text, encoding="utf-8")
        elif (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    return save_converted(checkpoint, dst, max_shard_bytes)
