"""Model configuration: the one description of a LLaMA-family network that the
loader produces and the model, the KV cache and the engine consume."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

# Weight quantizations at load (ops/fp8.py): "fp8" the layers' projections,
# "fp8-lm-head" the LM head too.
QUANTIZATIONS = ("fp8", "fp8-lm-head")


class ConfigError(ValueError):
    """A checkpoint's configuration is missing a field or asks for something unsupported."""


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling. `rope_type` is one of SUPPORTED_ROPE_TYPES."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config field {name!r} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_scaling.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope_scaling type {self.rope_scaling.rope_type!r}; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["rope_scaling"] = RopeScaling(**d.get("rope_scaling") or {})
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Parse a HF `config.json` dict of a LlamaForCausalLM."""
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ConfigError(f"unsupported architecture {archs}; supported: {SUPPORTED_ARCHITECTURES}")
        if cfg.get("model_type", "llama") != "llama":
            raise ConfigError(f"unsupported model_type {cfg.get('model_type')!r}; expected 'llama'")
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ConfigError("attention_bias / mlp_bias are not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported hidden_act {cfg.get('hidden_act')!r}; expected 'silu'")

        def need(name: str) -> Any:
            if name not in cfg or cfg[name] is None:
                raise ConfigError(f"config.json is missing required field {name!r}")
            return cfg[name]

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=_parse_rope_scaling(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )

    def to_hf(self) -> dict[str, Any]:
        """A HF `config.json` dict for this model (used by the demo model and tests)."""
        out: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": self.torch_dtype,
        }
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            out["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        rs = self.rope_scaling
        if rs.rope_type == "llama3":
            out["rope_scaling"] = {
                "rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                "high_freq_factor": rs.high_freq_factor,
                "original_max_position_embeddings": rs.original_max_position_embeddings}
        elif rs.rope_type == "linear":
            out["rope_scaling"] = {"rope_type": "linear", "factor": rs.factor}
        return out


def _parse_rope_scaling(cfg: dict[str, Any]) -> RopeScaling:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return RopeScaling()
    rope_type = rs.get("rope_type") or rs.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return RopeScaling()
    return RopeScaling(
        rope_type=rope_type,
        factor=float(rs.get("factor", 1.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
    )


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
