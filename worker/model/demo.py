"""A small, deterministic LLaMA checkpoint in HF format for tests, demos and CI.

`write_demo_model(dir, seed)` writes `tokenizer.json` (byte-level BPE trained on
the built-in corpus below), `tokenizer_config.json`, `generation_config.json`,
`config.json` and `model.safetensors`. The same seed gives byte-identical files,
so tests can compare runs and other tools can rebuild the model anywhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from .config import ModelConfig

if TYPE_CHECKING:
    import torch

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
DEMO_VOCAB_SIZE = 1024

# Plain English prose, written for this module. It only has to contain enough
# distinct words for a few hundred BPE merges.
DEMO_CORPUS = """\
The harbour town woke slowly on the first cold morning of autumn. Fishing boats
rocked against the pier, their ropes creaking, while gulls argued over the
scraps left on the stones. A baker opened his shutters and the smell of warm
bread drifted down the narrow street toward the water.

Martha kept the lighthouse on the northern point. Every evening she climbed the
hundred and twelve steps, cleaned the great lens, and lit the lamp before the
sun went down. She wrote the weather in a small notebook: wind from the west,
light rain, a grey sea with long slow waves. Nobody had ever asked to read it,
but she believed that one day the numbers would tell a story.

In the school by the market, the children were learning about rivers. Their
teacher drew a mountain on the board, then a stream that joined another stream,
then a wide river that wandered through fields and forests until it reached the
ocean. Water is patient, she told them. It finds the lowest path and follows it,
and over thousands of years it can cut a valley through solid rock.

The railway station was quiet between trains. A porter swept the platform and
checked the clock, which was always two minutes fast. Travellers came with
heavy suitcases and light hearts, or with light bags and heavy thoughts. The
timetable promised a train to the capital at noon, and for once it arrived on
time, its engine humming and its windows bright in the pale sunshine.

Computers read numbers, not words, so every sentence must first be broken into
pieces. A tokenizer splits text into small units and gives each unit a number.
Common words become a single piece, while rare words are built from several
smaller pieces. The model then predicts the next piece, one step at a time,
and the pieces are joined again to make readable text for the person waiting.

On the hill above the town there was an old garden with apple trees, a stone
wall, and a wooden bench facing the sea. In spring the trees were covered with
white flowers; in summer the grass grew tall and full of insects; in autumn the
apples fell and the wasps grew lazy and slow. Visitors often sat on the bench
for an hour without speaking, watching the ships move along the horizon.

The market opened at seven. Farmers arranged potatoes, carrots, onions and
cabbages in neat rows, and the cheese seller cut thin slices for anyone who
wanted to taste. Prices were written in chalk on small black boards. When it
rained, everyone pulled canvas covers over their tables and kept talking,
because the market was as much about news and friendship as about food.

Late at night, the library still had one light burning. An old man was reading
about the history of clocks: water clocks, sand glasses, pendulums, springs and
finally quartz crystals that vibrate thousands of times each second. He thought
it strange that people had worked so hard to measure time, and even stranger
that they always seemed to have too little of it.

Winter arrived with a storm that lasted three days. The harbour was closed, the
boats stayed tied to the pier, and the waves threw spray over the sea wall.
Martha kept the lamp burning through every night of the storm, and on the
fourth morning the sky was clear, the wind had dropped, and the whole town came
out to see what the sea had left on the beach: driftwood, shells, a broken oar,
and a green glass bottle with no message inside.
"""


def build_demo_tokenizer() -> HFTokenizer:
    """Train the demo byte-level BPE. Deterministic: same corpus, same JSON."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=DEMO_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        # all 256 byte symbols, so any input (and any byte sequence) is encodable
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(DEMO_CORPUS.splitlines(keepends=True), trainer=trainer)
    bos = tok.token_to_id(BOS_TOKEN)
    # LLaMA-3 style: the post-processor adds BOS (so our Tokenizer must not add a second one).
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B:1",
            special_tokens=[(BOS_TOKEN, bos)],
        ),
    ])
    return tok


def _write_json(path: Path, data: dict[str, Any]) -> None:
    # sorted keys and a fixed layout keep the files byte-identical across runs
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


DEMO_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ bos_token }}{{ message['role'] }}: "
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant: {% endif %}")


def write_demo_tokenizer(out_dir: str | Path) -> Path:
    """Write `tokenizer.json` and `tokenizer_config.json` of the demo tokenizer."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_demo_tokenizer()
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    _write_json(out / "tokenizer_config.json", {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast",
        # A small chat template: each message "<s>role: content</s>", then the
        # generation prompt "<s>assistant: " (docs/tokenizer.md, Chat templates).
        "chat_template": DEMO_CHAT_TEMPLATE,
    })
    return out


def demo_config(vocab_size: int, bos_token_id: int, eos_token_id: int) -> ModelConfig:
    """The demo network: tiny, but with GQA (8 query heads over 4 KV heads)."""
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=688, num_layers=4,
        num_heads=8, num_kv_heads=4, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=bos_token_id, eos_token_ids=(eos_token_id,), torch_dtype="float32")


# Projections get a small std as in LLaMA init. With an embedding much larger
# than the layers' output (std 1.0), the residual stream ignores context and greedy
# text loops on one token within a few steps; 0.3 keeps context in play. The lm_head
# is wide so logits spread (std ~8): greedy choices do not hinge on float noise.
PROJ_STD = 0.02
EMBED_STD = 0.3
LM_HEAD_STD = 0.5


def demo_weights(cfg: ModelConfig, seed: int) -> dict[str, "torch.Tensor"]:
    """HF LlamaForCausalLM tensors, drawn in a fixed order from one seeded generator."""
    import torch  # lazily: the tokenizer half of this module must not need torch

    g = torch.Generator().manual_seed(seed)

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g, dtype=torch.float32) * std

    h, inter = cfg.hidden_size, cfg.intermediate_size
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(cfg.vocab_size, h, EMBED_STD)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        w[f"{p}.self_attn.q_proj.weight"] = normal(cfg.q_size, h, PROJ_STD)
        w[f"{p}.self_attn.k_proj.weight"] = normal(cfg.kv_size, h, PROJ_STD)
        w[f"{p}.self_attn.v_proj.weight"] = normal(cfg.kv_size, h, PROJ_STD)
        w[f"{p}.self_attn.o_proj.weight"] = normal(h, cfg.q_size, PROJ_STD)
        w[f"{p}.mlp.gate_proj.weight"] = normal(inter, h, PROJ_STD)
        w[f"{p}.mlp.up_proj.weight"] = normal(inter, h, PROJ_STD)
        w[f"{p}.mlp.down_proj.weight"] = normal(h, inter, PROJ_STD)
        w[f"{p}.input_layernorm.weight"] = torch.ones(h)
        w[f"{p}.post_attention_layernorm.weight"] = torch.ones(h)
    w["model.norm.weight"] = torch.ones(h)
    w["lm_head.weight"] = normal(cfg.vocab_size, h, LM_HEAD_STD)
    return w


def write_demo_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the demo checkpoint into `out_dir` (created if needed) and return it.
    The same seed always gives byte-identical files."""
    from safetensors.torch import save_file

    out = write_demo_tokenizer(out_dir)
    tok = HFTokenizer.from_file(str(out / "tokenizer.json"))
    bos, eos = tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)
    cfg = demo_config(tok.get_vocab_size(with_added_tokens=True), bos, eos)
    _write_json(out / "config.json", cfg.to_hf())
    _write_json(out / "generation_config.json", {
        "bos_token_id": bos, "eos_token_id": eos, "do_sample": False, "max_new_tokens": 64})
    save_file(demo_weights(cfg, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
