"""The side files of a model (config.json, tokenizer.json, ...), from a HF
directory or from the GGUF file that stands for one."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Optional

from .gguf import GGUFModel, is_gguf


@lru_cache(maxsize=4)
def open_gguf(path: str) -> GGUFModel:
    """One reader per file and process: the tokenizer, the chat template and
    the loader all ask for the same file."""
    return GGUFModel(path)


def read_model_file(model: str | Path, name: str) -> Optional[str]:
    """The text of `name` (config.json, tokenizer.json, ...) in a model directory,
    or of the file a GGUF stands for; None when there is none."""
    model = Path(model)
    if is_gguf(model):
        return open_gguf(str(model.resolve())).side_file(name)
    path = model / name
    return path.read_text(encoding="utf-8") if path.is_file() else None


def has_model_file(model: str | Path, name: str) -> bool:
    if is_gguf(model):
        return read_model_file(model, name) is not None
    return (Path(model) / name).is_file()
