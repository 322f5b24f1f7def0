"""What a benchmark sends: prompts and output lengths (ShareGPT-like
synthetic lengths, a ShareGPT JSON file, fixed lengths) and multi-turn
conversations, all drawn from one seed so two runs send the same work."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Optional

# Words of plain English: prompts built of them tokenize to about one token
# per word (with its leading space) in LLaMA-family byte-level BPE vocabularies.
_WORDS = ("the of and to in is was for on that with as by at from his her an it be are this "
          "which or had not but one all were they she there been have their has when who will "
          "more no if out so said what up its about into than them can only other new some "
          "time could these two may then do first any my now such like our over man me even "
          "most made after also did many before must through back years where much your way "
          "well down should because each just those people how too little state good very "
          "make world still own see men work long get here between both life being under "
          "never day same another know while last might us great old year off come since "
          "against go came right used take three river house light window garden morning "
          "ship harbour mountain letter city road winter summer story music paper stone").split()


def text_of(n_tokens: int, rng: random.Random,
            count: Optional[Callable[[str], int]] = None) -> str:
    """About `n_tokens` tokens of text: exactly, by `count` (a tokenizer's
    length function) when given, else one word per token."""
    if count is None:
        return " ".join(rng.choice(_WORDS) for _ in range(max(n_tokens, 1)))
    words: list[str] = []
    while True:
        words.append(rng.choice(_WORDS))
        if count(" ".join(words)) >= n_tokens:
            return " ".join(words)


def tokenizer_counter(path: str) -> Callable[[str], int]:
    """A token counter from a model directory or a tokenizer.json (the
    `tokenizers` library, a core dependency)."""
    from pathlib import Path

    from tokenizers import Tokenizer

    p = Path(path)
    tok = Tokenizer.from_file(str(p / "tokenizer.json" if p.is_dir() else p))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


@dataclass
class Turn:
    text: str  # the user's message (or the prompt)
    output_len: int  # max_tokens of the reply
    input_len: int  # the intended prompt length in tokens (the server's count is reported)


@dataclass
class Conversation:
    id: str
    turns: list  # [Turn]; one for single-turn workloads
    think_times: list = field(default_factory=list)  # seconds before turn i (i >= 1)
    system: str = ""  # a system message that opens the conversation (multi-turn)


def _lognormal(rng: random.Random, median: int, sigma: float, lo: int, hi: int) -> int:
    return int(min(max(round(median * math.exp(rng.gauss(0.0, sigma))), lo), hi))


def synthetic_sharegpt(n: int, rng: random.Random, input_len: int, output_len: int,
                       count=None) -> list[Conversation]:
    """Lengths with ShareGPT's shape: log-normal, long right tail (input
    sigma 1.0, output 0.8), medians `input_len` / `output_len`, each clipped
    to [4, 8 x median]."""
    out = []
    for i in range(n):
        lin = _lognormal(rng, input_len, 1.0, 4, 8 * input_len)
        lout = _lognormal(rng, output_len, 0.8, 4, 8 * output_len)
        out.append(Conversation(f"req-{i}", [Turn(text_of(lin, rng, count), lout, lin)]))
    return out


def fixed(n: int, rng: random.Random, input_len: int, output_len: int,
          count=None) -> list[Conversation]:
    return [Conversation(f"req-{i}", [Turn(text_of(input_len, rng, count), output_len, input_len)])
            for i in range(n)]


def _length(text: str, count) -> int:
    return count(text) if count is not None else max(len(text) // 4, 1)


def load_sharegpt(path: str) -> list[list[tuple[str, str]]]:
    """ShareGPT JSON: [{"conversations": [{"from": "human"|"gpt", "value": ...}, ...]}, ...]
    -> each conversation as (human, gpt) pairs."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of ShareGPT conversations")
    convs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            continue
        pairs = []
        for a, b in zip(turns[::2], turns[1::2]):
            if not (isinstance(a, dict) and isinstance(b, dict)):
                break
            if a.get("from") not in ("human", "user") or b.get("from") not in ("gpt",
                                                                               "assistant"):
                break
            if not (isinstance(a.get("value"), str) and isinstance(b.get("value"), str)):
                break
            pairs.append((a["value"], b["value"]))
        if pairs:
            convs.append(pairs)
    return convs


def sharegpt(n: int, rng: random.Random, path: str, count=None,
             max_input: int = 1024, max_total: int = 2048) -> list[Conversation]:
    """Single-turn requests from a ShareGPT file, filtered as `vllm bench
    serve` does: the first human turn is the prompt, the length of the first
    reply its output length; pairs under 4 tokens either way, prompts over
    `max_input` or pairs over `max_total` are skipped."""
    pairs = [c[0] for c in load_sharegpt(path)]
    rng.shuffle(pairs)
    out = []
    for prompt, reply in pairs:
        lin, lout = _length(prompt, count), _length(reply, count)
        if lin < 4 or lout < 4 or lin > max_input or lin + lout > max_total:
            continue
        out.append(Conversation(f"req-{len(out)}", [Turn(prompt, lout, lin)]))
        if len(out) == n:
            break
    if not out:
        raise ValueError(f"{path}: no usable conversation")
    return out


def multi_turn(n: int, rng: random.Random, turns: int, input_len: int, output_len: int,
               think_time: float, path: Optional[str] = None, count=None,
               system_len: int = 0, output_sigma: float = 0.0) -> list[Conversation]:
    """`n` conversations of `turns` turns: user messages of ShareGPT-like
    lengths around `input_len`, replies of `output_len` (log-normal around it
    with `output_sigma` > 0, clipped to [4, 4 x output_len]) (or, from a ShareGPT
    file, its conversations with at least 2 turns, cut to `turns`); the user
    thinks an exponential time of mean `think_time` before each later turn.
    `system_len` > 0: every conversation opens with the same system message
    of that many tokens (an application's instructions)."""
    convs = []
    system = text_of(system_len, random.Random(rng.random()), count) if system_len > 0 else ""
    if path is not None:
        source = [c for c in load_sharegpt(path) if len(c) >= 2]
        rng.shuffle(source)
        if not source:
            raise ValueError(f"{path}: no conversation with two turns or more")
        for i, pairs in enumerate(source[:n]):
            ts = [Turn(h, max(min(_length(g, count), 4 * output_len), 4), _length(h, count))
                  for h, g in pairs[:turns]]
            convs.append(Conversation(f"conv-{i}", ts))
    else:
        for i in range(n):
            ts = []
            for _ in range(turns):
                lin = _lognormal(rng, input_len, 0.5, 4, 4 * input_len)
                lout = (_lognormal(rng, output_len, output_sigma, 4, 4 * output_len)
                        if output_sigma > 0 else output_len)
                ts.append(Turn(text_of(lin, rng, count), lout, lin))
            convs.append(Conversation(f"conv-{i}", ts))
    for c in convs:
        c.system = system
        c.think_times = [0.0] + [rng.expovariate(1.0 / think_time) if think_time > 0 else 0.0
                                 for _ in c.turns[1:]]
    return convs
