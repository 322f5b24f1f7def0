"""EngineConfig: every setting of one engine, passed down to the scheduler
and the model runner. Plain data: building one imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = "cpu"
    dtype: Optional[str] = None  # fp32 | fp16 | bf16; None: the checkpoint's
    max_batch_size: int = 8  # slots of the persistent batch
    block_size: int = 64
    num_kv_blocks: Optional[int] = None  # None: sized from memory
    kv_cache_fraction: float = 0.9  # of free device memory after weights (CUDA)
    kv_dtype: str = "auto"  # auto | fp16 | bf16 | fp32 | int8
    # Token budget of one step (chunked prefill). A step with prefill runs
    # without a CUDA graph and takes as long as its tokens: a small budget
    # keeps both the decodes' inter-token gaps and a new turn's wait short
    # (a 2048 budget doubled the later-turn TTFT p50 of the multi-turn
    # service benchmark, docs/benchmarks/multiturn.md).
    max_num_batched_tokens: int = 512
    max_model_len: Optional[int] = None  # None: the model's max_position_embeddings
    alloc_policy: str = "on_demand"  # upfront | on_demand | reserved
    reserved_tokens: int = 64
    # Reuse the leading KV blocks any earlier request wrote for the same
    # tokens (docs/kv_cache.md, "Prefix caching").
    prefix_caching: bool = True
    # Host-RAM tier: blocks of pinned host memory that keep named KV blocks
    # the GPU pool had to reuse (docs/kv_cache.md, "Host-RAM tier"). None:
    # on CUDA, a quarter of the available RAM up to 4x the GPU pool; on the
    # CPU, none (the pool is host RAM already). 0: off.
    host_kv_blocks: Optional[int] = None
    cuda_graphs: bool = True  # decode steps replay captured graphs (CUDA, fp16/bf16)
    # With graphs: a step that prefills one sequence's 2..N new tokens (a
    # short prompt alone, a chat turn) replays one too, the tokens padded to
    # a bucket (docs/engine.md, "Prefill graphs"; 0: never). Not in
    # deterministic mode.
    prefill_graph_tokens: int = 512
    # With graphs: any other step of up to N new tokens (prefill chunks beside
    # decode rows, several prompts) replays captured pieces between its
    # layers' attention launches, its tokens padded to a bucket (docs/engine.md,
    # "Mixed-step graphs"; 0: never). Capped at max_num_batched_tokens. Not in
    # deterministic mode.
    mixed_graph_tokens: int = 2048
    # With graphs: capture every bucket's graph (decode and prefill) when the
    # KV pool is allocated, so that no step waits for a capture (a device
    # synchronize and two forwards each). False: each on its first use.
    graphs_at_start: bool = True
    # With graphs: launch decode step t+1 before reading step t's tokens, so
    # the host's work between steps overlaps the GPU's.
    overlap_steps: bool = True
    # Ranks (devices) each layer is split over; rank 0 runs in this process on
    # `device`, rank r on the device r after it (engine/ranks.py).
    tensor_parallel: int = 1
    # Batch-invariant kernels (docs/determinism.md): a request's tokens are the
    # same bits whatever else shares its steps, however its prompt is chunked,
    # and whether its KV was resident, evicted and re-prefilled, or rebuilt on
    # another worker. One device only.
    deterministic: bool = False
    # "fp8": the layers' projections in E4M3 with per-channel scales, converted
    # at load; activations quantized per token (docs/weights.md, "FP8").
    # "fp8-lm-head": the LM head too.
    quantization: Optional[str] = None
