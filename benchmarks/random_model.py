"""A model directory with a Llama-3-8B-shaped network and random bf16 weights,
for benchmarks that run the whole service (`turbomq up`, `turbomq bench`) on
a GPU without a real checkpoint.

The tokenizer is the demo model's (byte-level BPE with a chat template), its
vocabulary padded with reserved tokens up to the network's 128,256 entries,
so any token the random network picks decodes, and encodes back to itself.
The network never picks what a real model would not write alone: lone
bytes of a multi-byte character (they decode to U+FFFD, which encodes back
as other ids) and the special tokens (they decode to nothing). Their output
rows are zero, so their logit 0 never tops 128k random ones, and a client
that resends a reply's text sends the ids the model generated, as with a
real model.
Prompts tokenize with the demo's merges: fine for timing, meaningless as text.

    python benchmarks/random_model.py DIR [--tiny] [--device cuda]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine import LLAMA3_8B  # noqa: E402

from turbomq.worker.model.config import ModelConfig  # noqa: E402
from turbomq.worker.model.demo import BOS_TOKEN, EOS_TOKEN, write_demo_tokenizer  # noqa: E402
from turbomq.worker.model.weights import Checkpoint, internal_shapes, to_hf_state_dict  # noqa: E402

TINY = ModelConfig(vocab_size=128256, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, torch_dtype="bfloat16")


def pad_vocabulary(tokenizer_json: Path, size: int) -> tuple[int, int]:
    """Reserved tokens up to `size` ids, as added (not special) tokens, so the
    text of a reply encodes back to the same ids when a client resends it;
    returns the (BOS, EOS) ids."""
    doc = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    taken = set(doc["model"]["vocab"].values()) | {t["id"] for t in doc["added_tokens"]}
    doc["added_tokens"] += [{"id": i, "content": f"<|reserved_{i}|>", "single_word": False,
                             "lstrip": False, "rstrip": False, "normalized": False,
                             "special": False} for i in range(size) if i not in taken]
    tokenizer_json.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    ids = {t["content"]: t["id"] for t in doc["added_tokens"]}
    return ids[BOS_TOKEN], ids[EOS_TOKEN]


def random_weights(cfg: ModelConfig, device: str) -> dict[str, torch.Tensor]:
    """Internal tensors: N(0, 0.02) projections and embeddings, unit norms."""
    g = torch.Generator(device=device).manual_seed(0)
    out = {}
    for name, shape in internal_shapes(cfg).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=torch.bfloat16, device=device)
        else:
            out[name] = torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16) * 0.02
    return out


def unwritten_ids(model_dir: Path, vocab_size: int) -> list[int]:
    """Ids whose text alone does not encode back to them: lone bytes of a
    multi-byte character and special tokens."""
    from turbomq.worker.engine.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(model_dir)
    texts = (tok.decode([i]) for i in range(vocab_size))
    return [i for i, text in enumerate(texts) if not text or "\ufffd" in text]


def write_random_model(out: Path, cfg: ModelConfig, device: str) -> Path:
    write_demo_tokenizer(out)
    bos, eos = pad_vocabulary(out / "tokenizer.json", cfg.vocab_size)
    cfg = dataclasses.replace(cfg, bos_token_id=bos, eos_token_ids=(eos,))
    weights = random_weights(cfg, device)
    weights["lm_head.weight"][unwritten_ids(out, cfg.vocab_size)] = 0
    (out / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": eos}) + "\n")
    hf = to_hf_state_dict(Checkpoint(cfg, weights))
    save_file({k: v.to("cpu").contiguous() for k, v in hf.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="a tiny network (to check this on a CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where to draw the weights (a GPU is much faster)")
    args = ap.parse_args()
    write_random_model(args.out, TINY if args.tiny else LLAMA3_8B, args.device)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
