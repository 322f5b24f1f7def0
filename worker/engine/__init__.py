"""turbomq.worker.engine: the engine of one worker.

Owns requests and sessions, the inbox and the step loop (`engine.Engine`),
the persistent batch's bookkeeping (`scheduler`: ints and lists, no torch),
sampling parameters and per-request RNGs (`sampling_params`, no torch),
tokenization and streamed text (`tokenizer`, `output`), the session-store
interface with its in-memory form (`session_store`), the engine's errors,
and the model runner (`runner`: the one owner of tensors; the same code on
every tensor-parallel rank, started by `ranks`).

Names are imported lazily: importing the scheduler imports no torch."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "engine", "GenerationResult": "engine", "StreamEvent": "engine", "Usage": "engine",
    "EngineConfig": "config", "SamplingParams": "sampling_params",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
