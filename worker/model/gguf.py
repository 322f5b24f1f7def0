"""GGUF files (llama.cpp's format) read as a Hugging Face model directory.

A `.gguf` file holds the weights (often quantized), the configuration and the
tokenizer in one file. `GGUFModel` turns it into what a HF LLaMA directory
would hold: `config.json`, `tokenizer.json`, `tokenizer_config.json` (with the
chat template) and `generation_config.json` as texts, and the weights as float32
arrays under HF names, dequantized and with llama.cpp's rotary row order undone.
Everything downstream (loader, tokenizer, chat template) then sees one format.

No torch here: the tokenizer side is needed by torch-free code.
docs/weights.md describes the mapping.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

import numpy as np

GGUF_SUFFIX = ".gguf"

# llama.cpp tensor names -> HF LlamaForCausalLM names.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4

# How each `tokenizer.ggml.pre` splits text before byte-level BPE; the merges
# were learned on text split this way. Absent: GPT-2's split (ByteLevel's own).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
               "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
# Pre-tokenizers that split digits one by one before GPT-2's split.
_DIGIT_SPLIT_PRES = ("smollm", "starcoder", "refact")


class GGUFError(ValueError):
    """A GGUF file cannot be read as a LLaMA checkpoint; the message names the file and the field."""


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix == GGUF_SUFFIX


class GGUFModel:
    """One `.gguf` file, opened (memory-mapped) once."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader  # optional dependency, only for GGUF input

        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: GGUF file not found")
        try:
            self._reader = GGUFReader(str(self.path))
        except Exception as e:  # the reader raises ValueError/struct errors on a bad header
            raise GGUFError(f"{self.path}: not a readable GGUF file: {e}") from None
        self._fields: dict[str, Any] = {}
        self._side_files: dict[str, Optional[str]] = {}
        arch = self.field("general.architecture")
        if arch != "llama":
            raise GGUFError(f"{self.path}: general.architecture is {arch!r}; only 'llama' is supported")
        if self.field("split.count", 1) > 1:
            raise GGUFError(f"{self.path}: split GGUF files are not supported; merge the parts "
                            "with llama.cpp's gguf-split --merge first")

    # ------------------------------------------------------------------ metadata

    def field(self, key: str, default: Any = None) -> Any:
        if key not in self._fields:
            f = self._reader.fields.get(key)
            self._fields[key] = None if f is None else f.contents()
        value = self._fields[key]
        return default if value is None else value

    def _need(self, key: str) -> Any:
        value = self.field(key)
        if value is None:
            raise GGUFError(f"{self.path}: metadata field {key!r} is missing")
        return value

    def hf_config(self) -> dict[str, Any]:
        """config.json of the equivalent HF LlamaForCausalLM."""
        tensor_names = {t.name for t in self._reader.tensors}
        if "rope_freqs.weight" in tensor_names:
            raise GGUFError(f"{self.path}: per-frequency rope factors (rope_freqs.weight, Llama 3.1 "
                            "rope scaling) are not supported in GGUF input; use the HF checkpoint")
        heads = int(self._need("llama.attention.head_count"))
        hidden = int(self._need("llama.embedding_length"))
        head_dim = int(self.field("llama.attention.key_length")
                       or self.field("llama.rope.dimension_count") or hidden // heads)
        vocab = self.field("llama.vocab_size") or len(self._need("tokenizer.ggml.tokens"))
        config: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._need("llama.feed_forward_length")),
            "num_hidden_layers": int(self._need("llama.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.field("llama.attention.head_count_kv") or heads),
            "head_dim": head_dim,
            "rms_norm_eps": float(self.field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(self.field("llama.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.field("llama.context_length", 4096)),
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "torch_dtype": "float32",
        }
        scaling = self.field("llama.rope.scaling.type")
        if scaling not in (None, "none"):
            if scaling != "linear":
                raise GGUFError(f"{self.path}: rope scaling {scaling!r} is not supported in GGUF input")
            config["rope_scaling"] = {"rope_type": "linear",
                                      "factor": float(self._need("llama.rope.scaling.factor"))}
        for key in ("bos", "eos"):
            tid = self.field(f"tokenizer.ggml.{key}_token_id")
            if tid is not None:
                config[f"{key}_token_id"] = int(tid)
        return config

    def _special_ids(self) -> dict[str, Optional[int]]:
        return {name: self.field(f"tokenizer.ggml.{key}_token_id")
                for name, key in (("bos_token", "bos"), ("eos_token", "eos"),
                                  ("unk_token", "unknown"), ("pad_token", "padding"))}

    def end_of_turn_ids(self) -> list[int]:
        """Every token that ends generation: EOS plus end-of-turn / end-of-message tokens."""
        ids = [self.field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return sorted({int(i) for i in ids if i is not None})

    def tokenizer_config(self) -> dict[str, Any]:
        tokens = self._need("tokenizer.ggml.tokens")
        out: dict[str, Any] = {name: tokens[tid] for name, tid in self._special_ids().items()
                               if tid is not None}
        out["add_bos_token"] = bool(self.field("tokenizer.ggml.add_bos_token",
                                               self.field("tokenizer.ggml.model") == "llama"))
        template = self.field("tokenizer.chat_template")
        if template:
            out["chat_template"] = template
        return out

    def generation_config(self) -> dict[str, Any]:
        out: dict[str, Any] = {"eos_token_id": self.end_of_turn_ids()}
        bos = self.field("tokenizer.ggml.bos_token_id")
        if bos is not None:
            out["bos_token_id"] = int(bos)
        return out

    def tokenizer_json(self) -> str:
        """tokenizer.json for the `tokenizers` library."""
        kind = self.field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise GGUFError(f"{self.path}: tokenizer.ggml.model {kind!r} is not supported; "
                            "GGUF input takes byte-level BPE ('gpt2') tokenizers")
        return _byte_level_bpe(self._need("tokenizer.ggml.tokens"),
                               self._need("tokenizer.ggml.merges"),
                               self.field("tokenizer.ggml.token_type") or [],
                               self.field("tokenizer.ggml.pre")).to_str()

    def side_file(self, name: str) -> Optional[str]:
        """The text of the HF file `name` this GGUF stands for (None for any other name)."""
        makers = {
            "config.json": lambda: json.dumps(self.hf_config(), indent=2),
            "tokenizer.json": self.tokenizer_json,
            "tokenizer_config.json": lambda: json.dumps(self.tokenizer_config(), indent=2),
            "generation_config.json": lambda: json.dumps(self.generation_config(), indent=2),
        }
        if name not in self._side_files:
            self._side_files[name] = makers[name]() if name in makers else None
        return self._side_files[name]

    # ------------------------------------------------------------------ tensors

    def hf_tensors(self) -> dict[str, np.ndarray]:
        """Every weight as float32 under its HF name, Q/K rows back in HF order."""
        from gguf import quants

        config = self.hf_config()
        heads = {"self_attn.q_proj": config["num_attention_heads"],
                 "self_attn.k_proj": config["num_key_value_heads"]}
        out: dict[str, np.ndarray] = {}
        for t in self._reader.tensors:
            name = _hf_name(t.name)
            if name is None:
                raise GGUFError(f"{self.path}: unexpected tensor {t.name!r} for a llama model")
            try:
                w = np.array(quants.dequantize(t.data, t.tensor_type), dtype=np.float32,
                             copy=None)
            except NotImplementedError:
                raise GGUFError(f"{self.path}: tensor {t.name}: quantization type "
                                f"{t.tensor_type.name} cannot be dequantized") from None
            for suffix, n_heads in heads.items():
                if name.endswith(suffix + ".weight"):
                    w = unpermute_rotary_rows(w, n_heads)
            # float32 tensors come back as views of the read-only file mapping
            out[name] = w if w.flags.writeable else w.copy()
        return out


def _hf_name(gguf_name: str) -> Optional[str]:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def unpermute_rotary_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores W_q / W_k rows per head as interleaved rotary pairs
    (2j, 2j+1); HF (and our kernels) use half rotation (j, j + d/2). Per head,
    even rows first, then odd rows."""
    rows, cols = w.shape
    return (w.reshape(n_heads, rows // n_heads // 2, 2, cols)
            .swapaxes(1, 2).reshape(rows, cols))


def _byte_level_bpe(tokens: list[str], merges: list[str], token_types: list[int],
                    pre: Optional[str]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    if pre in _PRE_SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in _DIGIT_SPLIT_PRES:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) are matched whole and are special;
    # user-defined ones (<think>, ...) are matched whole and decoded as text.
    special = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, token_types) if kind == _CONTROL]
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    return tok
