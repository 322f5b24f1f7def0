"""Tokenizer for the worker: HF `tokenizer.json` plus the model's BOS/EOS policy,
and an incremental detokenizer for streaming text out token by token.

See docs/tokenizer.md for the BOS policy and the streaming guarantee.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from tokenizers import Tokenizer as HFTokenizer

from ..model.files import read_model_file

REPLACEMENT_CHAR = "\ufffd"


class TokenizerError(ValueError):
    """A model directory has no usable tokenizer, or token ids are out of range."""


def _read_optional_json(model: Path, name: str) -> dict[str, Any]:
    """The JSON object in the model's file `name`, or {} when it is absent. Invalid
    JSON is an error: silently ignoring a broken config would change BOS/EOS
    handling without notice."""
    path = model / name
    try:
        text = read_model_file(model, name)
        data = {} if text is None else json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> Optional[str]:
    """tokenizer_config.json spells special tokens as a string or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


class Tokenizer:
    """Text <-> token ids for one model.

    `encode(text)` starts with exactly one BOS when the model uses one (whether the
    tokenizer's own post-processor adds it or we do); `decode` drops special tokens
    by default.
    """

    def __init__(self, hf: HFTokenizer, bos_token_id: Optional[int] = None,
                 eos_token_ids: Iterable[int] = (), add_bos_token: bool = True) -> None:
        self.hf = hf
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        for tid in [*([bos_token_id] if bos_token_id is not None else []), *eos_token_ids]:
            if not 0 <= tid < self.vocab_size:
                raise TokenizerError(f"special token id {tid} is outside the vocabulary (size {self.vocab_size})")
        self.bos_token_id: Optional[int] = bos_token_id
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.special_token_ids: frozenset[int] = frozenset(
            tid for tid, tok in hf.get_added_tokens_decoder().items() if tok.special)
        # Probe once whether the post-processor (e.g. a TemplateProcessing "<s> $A")
        # already inserts BOS, so encode() never adds a second one.
        probe_with = hf.encode("a", add_special_tokens=True).ids
        probe_without = hf.encode("a", add_special_tokens=False).ids
        self.post_processor_adds_bos = (
            bos_token_id is not None and probe_with[:1] == [bos_token_id]
            and probe_without[:1] != [bos_token_id])
        self._pieces = _PieceCache.for_tokenizer(hf)


    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load `tokenizer.json` from a HF model directory (or a GGUF file, read as one).

        BOS: `tokenizer_config.json` `bos_token`, else `bos_token_id` from config.json,
        then generation_config.json. `add_bos_token: false` in tokenizer_config.json turns
        BOS off. EOS: the union of every id those three files name, since chat models
        often list several stop tokens in generation_config.json only.
        """
        path = Path(path)
        tok_file = path / "tokenizer.json"
        text = read_model_file(path, "tokenizer.json")
        if text is None:
            raise TokenizerError(f"no tokenizer.json in {path}: the model directory needs a HF fast tokenizer")
        try:
            hf = HFTokenizer.from_str(text)
        except Exception as e:  # the Rust side raises a bare Exception with the parse error
            raise TokenizerError(f"{tok_file} is not a valid tokenizer: {e}") from None

        tok_cfg = _read_optional_json(path, "tokenizer_config.json")
        cfg = _read_optional_json(path, "config.json")
        gen_cfg = _read_optional_json(path, "generation_config.json")

        def token_id(name: str) -> Optional[int]:
            content = _token_content(tok_cfg.get(name))
            if content is None:
                return None
            tid = hf.token_to_id(content)
            if tid is None:
                raise TokenizerError(f"tokenizer_config.json names {name} {content!r}, which is not in the vocabulary")
            return tid

        bos = token_id("bos_token")
        if bos is None:
            bos = next((int(c["bos_token_id"]) for c in (cfg, gen_cfg) if c.get("bos_token_id") is not None), None)

        eos: set[int] = set()
        for c in (gen_cfg, cfg):
            eos.update(_as_id_list(c.get("eos_token_id")))
        tok_eos = token_id("eos_token")
        if tok_eos is not None:
            eos.add(tok_eos)

        return cls(hf, bos_token_id=bos, eos_token_ids=eos,
                   add_bos_token=bool(tok_cfg.get("add_bos_token", True)))

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`. With `add_bos`, the ids start with exactly one BOS when
        the model has one; a BOS the text itself spells out counts as that one."""
        if not add_bos or not self.add_bos_token:
            if self._pieces is not None:
                return self._pieces.encode(text)
            return self.hf.encode(text, add_special_tokens=False).ids
        ids = self.hf.encode(text, add_special_tokens=True).ids
        bos = self.bos_token_id
        if ids[:1] != [bos]:
            return [bos, *ids]
        if self.post_processor_adds_bos and ids[1:2] == [bos]:
            return ids[1:]  # the template's BOS plus one spelled out in the text
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise TokenizerError(f"token id {bad} is outside the vocabulary (size {self.vocab_size})")
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)


class _PieceCache:
    """Encodes text piece by piece between special tokens, remembering the
    pieces it has seen. A chat client that resends the whole conversation
    every turn sends the same messages again and again; only the new ones
    are tokenized. Exact: the tokenizer itself cuts text at its added tokens
    and tokenizes each piece on its own, so the pieces' ids joined are the
    whole text's. Used only where that holds for the cuts made here (no
    normalizer, no pre-tokenizer that treats the first piece differently,
    special tokens matched verbatim and not inside a longer added token)."""

    MAX_PIECES = 4096
    MIN_CACHED_CHARS = 64  # shorter pieces are cheaper to encode than to remember

    def __init__(self, hf: HFTokenizer, markers: dict[str, int]) -> None:
        self.hf = hf
        self.markers = markers
        self.split = re.compile("|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)))
        self._ids: "OrderedDict[str, list[int]]" = OrderedDict()
        self._lock = threading.Lock()  # the socket thread and the step thread both encode

    @classmethod
    def for_tokenizer(cls, hf: HFTokenizer) -> Optional["_PieceCache"]:
        doc = json.loads(hf.to_str())
        pre = json.dumps(doc.get("pre_tokenizer"))
        if doc.get("normalizer") is not None or "Metaspace" in pre or "prepend_scheme" in pre:
            return None
        added = hf.get_added_tokens_decoder()
        markers = {t.content: i for i, t in added.items()
                   if t.special and t.content and not (t.lstrip or t.rstrip or t.single_word
                                                       or t.normalized)}
        if not markers:
            return None
        cache = cls(hf, markers)
        if any(t.content not in markers and cache.split.search(t.content) for t in added.values()):
            return None  # a marker inside a longer added token: the cuts could differ
        return cache

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        for m in self.split.finditer(text):
            if m.start() > pos:
                ids += self._piece(text[pos:m.start()])
            ids.append(self.markers[m.group()])
            pos = m.end()
        if pos < len(text):
            ids += self._piece(text[pos:])
        return ids

    def _piece(self, piece: str) -> list[int]:
        if len(piece) < self.MIN_CACHED_CHARS:
            return self.hf.encode(piece, add_special_tokens=False).ids
        with self._lock:
            ids = self._ids.get(piece)
            if ids is not None:
                self._ids.move_to_end(piece)
                return ids
        ids = self.hf.encode(piece, add_special_tokens=False).ids
        with self._lock:
            self._ids[piece] = ids
            if len(self._ids) > self.MAX_PIECES:
                self._ids.popitem(last=False)
        return ids


# How many prompt tokens give context to the first generated tokens: enough for a
# leading-space marker or a merge across the boundary to render as in a full decode.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Streams text for generated tokens, one token at a time.

    Guarantees (for decoders whose output depends only on the local byte stream,
    e.g. ByteLevel BPE as in LLaMA-3 and the demo model):
      * push() never returns a character broken by an incomplete UTF-8 sequence;
      * "".join(push outputs) + flush() == tokenizer.decode(generated ids).

    State is a short window of ids: `ids[:read]` is text already emitted, kept
    only as left context; `ids[read:]` is pending. Each push decodes the window
    and emits the text past the emitted part, unless it ends in U+FFFD (possibly
    an incomplete character): then it waits for more tokens.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Optional[Sequence[int]] = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        if skip_special_tokens:
            context = [t for t in context if t not in tokenizer.special_token_ids]
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character; generated bytes that complete it would
            # rewrite prompt text, which we do not own. Stream the generated part alone.
            context, context_text = [], ""
        self._ids: list[int] = context
        self._read = len(context)
        self._prefix_text = context_text

    @property
    def window_len(self) -> int:
        """Ids held (context + pending): bounds the cost of each push."""
        return len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, read: int) -> None:
        """Mark ids[:read] as emitted; keep the chunk emitted last as left context."""
        del self._ids[:self._read]  # ids no window will read again
        self._read = read - self._read
        self._prefix_text = self._decode(self._ids[:self._read])

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly stable text (possibly '')."""
        if not 0 <= token_id < self.tokenizer.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (size {self.tokenizer.vocab_size})")
        if self.skip_special_tokens and token_id in self.tokenizer.special_token_ids:
            return ""  # decodes to nothing; keeping it would only grow the window
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if not text.startswith(self._prefix_text):
            return ""  # the new token rewrote emitted context; wait (flush settles it)
        if not text.endswith(REPLACEMENT_CHAR):
            out = text[len(self._prefix_text):]
            if out:
                self._advance(len(self._ids))
            return out
        return self._emit_settled(text)

    def _emit_settled(self, text: str) -> str:
        """The window ends in U+FFFD. If everything before the newest token decodes the
        same on its own, the boundary before that token is final (a later byte can only
        change a character that is cut by the end of the stream), so emit up to there.
        This keeps the window short through long runs of invalid bytes."""
        cut = len(self._ids) - 1
        if cut <= self._read:
            return ""
        head = self._decode(self._ids[:cut])
        if head + self._decode(self._ids[cut:]) != text or len(head) <= len(self._prefix_text):
            return ""
        out = head[len(self._prefix_text):]
        self._advance(cut)
        return out

    def flush(self) -> str:
        """The rest of the text at the end of the stream, held-back bytes included."""
        text = self._decode(self._ids)
        out = text[len(self._prefix_text):]
        self._advance(len(self._ids))
        return out
