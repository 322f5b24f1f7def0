"""Shared test helpers: the demo model is written once per test process."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path


@functools.lru_cache(maxsize=None)
def demo_model_dir() -> str:
    from turbomq.worker.demo import write_demo_model

    path = Path(tempfile.mkdtemp(prefix="turbomq-demo-")) / "demo"
    write_demo_model(path, seed=0)
    return str(path)
