"""turbomq.worker: the engine (persistent batch + paged LRU KV cache), the
LLaMA model, weights, tokenizer, sampling and the worker service.

Names are imported lazily so that light entry points (the CLI's broker
command) do not pay for importing torch."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "engine", "EngineConfig": "engine", "GenerationResult": "engine",
    "StreamEvent": "engine", "Usage": "engine", "SamplingParams": "sampling",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
