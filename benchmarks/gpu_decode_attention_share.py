"""What the attention launch costs one batch-1 decode step, per weight mode,
on a Llama-3-8B-shaped model (random weights, 256-token context), one GPU:
the batch-1 decode graph as the engine runs it, then with each layer's
attention replaced by a copy of q (a trivial launch between the qkv and o
projections) and by nothing at all (o reads q: no launch). The last two
give wrong tokens and exist only to bound what any faster attention, or
one fused into a projection, could save.

    python benchmarks/gpu_decode_attention_share.py --out DIR [--modes bf16 fp8-lm-head]

Step: mean of 300 replays (CUDA events), three rounds. Writes
decode_attention_share.md and decode_attention_share.json into DIR.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
from pathlib import Path

import torch

from turbomq.worker.model.llama import LlamaModel

_spec = importlib.util.spec_from_file_location("gpu_engine", Path(__file__).with_name("gpu_engine.py"))
gpu_engine = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_engine)
CFG = gpu_engine.LLAMA3_8B


class _Ops:
    """The model's ops with paged_attention replaced."""

    def __init__(self, base, attention):
        self._base = base
        self.paged_attention = attention

    def __getattr__(self, name):
        return getattr(self._base, name)


def _copy(q, kv, batch, scale, out=None, **_):
    return q.clone() if out is None else out.copy_(q)


def _nothing(q, kv, batch, scale, out=None, **_):
    return q if out is None else out


def step_ms(mode: str) -> dict[str, list[float]]:
    model = LlamaModel(CFG, gpu_engine.random_tensors(CFG), "cuda", torch.bfloat16,
                       quantization=None if mode == "bf16" else mode)
    base = model.ops
    forms = {"attention": base.paged_attention, "a copy of q": _copy, "nothing": _nothing}
    out = {}
    for name, attention in forms.items():
        model.ops = _Ops(base, attention)
        graphs, graph, kv = gpu_engine.batch1_decode_graph(model, 256)
        out[name] = [gpu_engine.mean_replay_ms(graph, 300) for _ in range(3)]
        print(mode, name, " ".join(f"{m:.4f}" for m in out[name]), flush=True)
        del graphs, graph, kv
        gc.collect()
        torch.cuda.empty_cache()
    del model, base
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--modes", nargs="+", default=["bf16", "fp8-lm-head"])
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    res = {mode: step_ms(mode) for mode in args.modes}
    layers = CFG.num_layers
    lines = [f"# What the attention launch costs a batch-1 decode step ({device})", "",
             "`python benchmarks/gpu_decode_attention_share.py --out DIR`: the batch-1",
             "decode graph (256-token context), ms a step (best of three means of 300",
             "replays); the copy and nothing forms are timing only (wrong tokens).", "",
             "| mode | attention | a copy of q | nothing | attention's work, µs a layer "
             "| the launch between qkv and o, µs a layer |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for mode, r in res.items():
        a, c, n = (min(r[k]) for k in ("attention", "a copy of q", "nothing"))
        lines.append(f"| {mode} | {a:.3f} | {c:.3f} | {n:.3f} | {(a - c) / layers * 1e3:.1f} "
                     f"| {(c - n) / layers * 1e3:.1f} |")
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_attention_share.json").write_text(
        json.dumps({"device": device, "context": 256, "step_ms": res}, indent=2) + "\n")
    (out / "decode_attention_share.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
