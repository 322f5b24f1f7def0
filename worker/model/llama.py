"""LLaMA forward pass over the paged KV cache.

One forward serves every step shape: prefill chunks with history, decode
tokens, or both mixed. Tokens arrive flattened with an AttentionBatch saying
which sequence each belongs to; K/V are written into the pool, then attention
reads each sequence's whole context through its block table."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from .config import QUANTIZATIONS, ModelConfig

from .parallel import shard_weight, vocab_parallel

if TYPE_CHECKING:
    from .parallel import TensorParallel
from .kv_cache import PagedKVCache
from .ops import AttentionBatch, ops_for
from .ops.fp8 import FP8, QUANTIZED, Fp8Weight, quantize_weight
from .ops.invariant import InvariantOps, fold_norm
from .rotary import cos_sin_table

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use fp32, fp16 or bf16") from None


class LlamaModel:
    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor],
                 device: torch.device | str = "cpu", dtype: Optional[torch.dtype] = None,
                 tp: Optional["TensorParallel"] = None, deterministic: bool = False,
                 quantization: Optional[str] = None):
        """With `tp`, this rank's slice of each layer (model/parallel.py).
        `deterministic`: batch-invariant ops (ops/invariant.py), so a token's
        logits do not depend on the rest of the batch. `quantization="fp8"`:
        the layers' projections in E4M3 with per-channel scales (ops/fp8.py);
        "fp8-lm-head": the LM head too. Tensors already on `device` in
        `dtype` are shared, not copied."""
        self.config = config
        self.tp = tp
        ranks = tp.size if tp is not None else 1
        self.num_heads = config.num_heads // ranks  # this rank's heads
        self.num_kv_heads = config.num_kv_heads // ranks
        self.device = torch.device(device)
        self.dtype = dtype or parse_dtype(config.torch_dtype)
        self.deterministic = deterministic
        self.ops = InvariantOps(ops_for(self.device)) if deterministic else ops_for(self.device)
        moved: dict[tuple, torch.Tensor] = {}  # keeps tied tensors shared after the move
        # this rank's vocabulary rows of the lm_head, its logits gathered
        self.gather_logits = tp is not None and vocab_parallel(config, tp.size)
        # Where the caller gathers them itself (the engine's runner: it takes
        # the ranks' argmax for greedy steps instead), logits() returns this
        # rank's columns, in the compute dtype.
        self.defer_gather = False

        def take(name: str) -> torch.Tensor:
            """On the device in the compute dtype; FP8 weights and their float32
            scales (an FP8 checkpoint) keep their dtypes."""
            t = tensors[name]
            # a tied lm_head is split where the embedding is not
            key = (id(t), self.gather_logits and name == "lm_head.weight")
            if key not in moved:
                part = t if tp is None else shard_weight(config, name, t, tp.rank, tp.size)
                keep = t.dtype == FP8 or name.endswith(".weight_scale")
                moved[key] = part.to(device=self.device,
                                     dtype=None if keep else self.dtype).contiguous()
            return moved[key]

        self.embed = take("embed.weight")
        self.layers = [
            {k: take(f"layers.{i}.{k}.weight")
             for k in ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down")}
            for i in range(config.num_layers)]
        if any(t.dtype == FP8 for t in tensors.values()):
            quantization = quantization or "fp8"  # an FP8 checkpoint runs as such
        if quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"unknown quantization {quantization!r}; one of {QUANTIZATIONS}")
        if quantization in QUANTIZATIONS:
            if deterministic:
                raise ValueError("deterministic mode runs 16-bit weights, not fp8")
            for i, layer in enumerate(self.layers):
                for k in QUANTIZED:
                    stored = tensors.get(f"layers.{i}.{k}.weight_scale")
                    layer[k] = (quantize_weight(layer[k]) if stored is None
                                else Fp8Weight(layer[k], take(f"layers.{i}.{k}.weight_scale")))
        self.quantization = quantization
        self.norm = take("norm.weight")
        self.lm_head = take("lm_head.weight")
        if quantization == "fp8-lm-head":  # batch-1 decode reads it every step
            self.lm_head = quantize_weight(self.lm_head)
        if deterministic:  # each norm into the projection that reads it (ops/invariant.py)
            for layer in self.layers:
                layer["qkv"] = fold_norm(layer["qkv"], layer["attn_norm"])
                layer["gate_up"] = fold_norm(layer["gate_up"], layer["mlp_norm"])
            self.lm_head = fold_norm(self.lm_head, self.norm)
        self.cos_sin = cos_sin_table(config, config.max_position_embeddings, self.device)
        self.scale = config.head_dim ** -0.5

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv: PagedKVCache,
                logits_indices: Optional[torch.Tensor | slice] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids: [T]. Returns float32 logits of the rows in `logits_indices`
        (indices, or a slice such as slice(None) for every row; default: the
        last new token of every sequence), [N, vocab]; written into `out`
        where given (a float32 [N, vocab] buffer)."""
        # The residual stream, updated in place by the o and down projections;
        # each norm is fused into the projection that reads it.
        residual = self.embed[input_ids]
        q = self.attention_input(0, residual, batch.positions, batch.slot_mapping, kv)
        for i, layer_kv in enumerate(kv.layers):
            attn = self.ops.paged_attention(q, layer_kv, batch, self.scale)
            q = self.after_attention(i, residual, attn, batch.positions, batch.slot_mapping, kv)
        if logits_indices is None:
            logits_indices = (batch.cu_q_lens[1:] - 1).long()
        return self.logits(residual, logits_indices, out)

    # The forward's pieces between attentions (cuda_graphs.MixedGraphs
    # captures them, attention running between their replays).
    def attention_input(self, i: int, residual: torch.Tensor, positions: torch.Tensor,
                        slot_mapping: torch.Tensor, kv: PagedKVCache,
                        out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Layer i's norm, qkv projection and rotary, its k and v written
        into the pool: its queries [T, heads, head_dim] (in `out` where the
        backend takes one)."""
        layer = self.layers[i]
        extra = {} if out is None else {"out": out}
        return self.ops.qkv_rotary_write_kv(residual, layer["qkv"],
                                            (layer["attn_norm"], self.config.rms_norm_eps),
                                            positions, self.cos_sin, kv.layers[i], slot_mapping,
                                            self.num_heads, **extra)

    def after_attention(self, i: int, residual: torch.Tensor, attn: torch.Tensor,
                        positions: torch.Tensor, slot_mapping: torch.Tensor, kv: PagedKVCache,
                        q_out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Layer i's o projection and MLP added into `residual`, then layer
        i + 1's attention_input (None after the last layer)."""
        layer, eps = self.layers[i], self.config.rms_norm_eps
        self._project_into(residual, attn.reshape(residual.shape[0], -1), layer["o"])
        act = self.ops.linear(residual, layer["gate_up"], norm=(layer["mlp_norm"], eps), silu=True)
        self._project_into(residual, act, layer["down"])
        if i + 1 == len(self.layers):
            return None
        return self.attention_input(i + 1, residual, positions, slot_mapping, kv, q_out)

    def logits(self, residual: torch.Tensor, logits_indices: torch.Tensor | slice,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """float32 logits of the final norm of residual[logits_indices] (in `out`
        where given); with defer_gather, this rank's columns of them in the
        compute dtype."""
        logits = self.ops.linear(residual[logits_indices], self.lm_head,
                                 norm=(self.norm, self.config.rms_norm_eps))
        if self.gather_logits and self.defer_gather:
            return logits if out is None else out.copy_(logits)
        if self.gather_logits:
            logits = self.tp.all_gather_columns(logits)
        return logits.float() if out is None else out.copy_(logits)

    def _project_into(self, residual: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
        """residual += x @ w.T; under tensor parallelism each rank holds a
        partial product, summed across ranks before the add."""
        if self.tp is None:
            self.ops.linear(x, w, residual=residual)
            return
        self.tp.all_reduce_into(residual, self.ops.linear(x, w))
