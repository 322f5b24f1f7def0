"""turbomq.worker: one GPU worker of the service, in four rooms that follow
the data flow (docs/architecture.md):

    cli/      the `turbomq` command: worker, generate, up, chat, convert, ...
    service/  the broker link, the service loop, the Redis session store
    engine/   the engine: requests, sessions, the persistent batch, the
              scheduler, streaming; the model runner, the one owner of tensors
    model/    the LLaMA forward, ops (CUDA kernels or the PyTorch reference),
              weights, KV tensors, CUDA graphs, tensor-parallel slices, sampler

Imports run one way: cli -> service -> engine -> model -> ops -> native.
Names are imported lazily so that light entry points (the CLI's broker
command) do not pay for importing torch."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Engine", "EngineConfig", "GenerationResult", "StreamEvent", "Usage",
           "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in __all__:  # turbomq.worker.engine resolves them, lazily too
        return getattr(importlib.import_module(f"{__name__}.engine"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
