"""Tokenizer BOS/EOS policy and the streaming detokenizer's guarantees."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from turbomq.worker.model.demo import BOS_TOKEN, EOS_TOKEN, write_demo_tokenizer
from turbomq.worker.engine.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

FFFD = "\ufffd"
PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _gpt2_byte_chars() -> dict[int, str]:
    """The ByteLevel byte -> symbol table (GPT-2's bytes_to_unicode)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_demo_tokenizer(tmp_path_factory.mktemp("demo_tok"))


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def byte_ids(tok) -> list[int]:
    ids = [tok.hf.token_to_id(ch) for ch in _gpt2_byte_chars().values()]
    assert None not in ids, "every byte must have its own token"
    return [tok.hf.token_to_id(_gpt2_byte_chars()[b]) for b in range(256)]


@pytest.fixture(scope="module")
def merged_ids(tok, byte_ids) -> list[int]:
    merged = sorted(set(range(tok.vocab_size)) - set(byte_ids) - tok.special_token_ids)
    assert len(merged) > 300
    return merged


def stream(tok: Tokenizer, ids, prompt_ids=None, skip_special_tokens=True, check_steps=True) -> list[str]:
    """Push ids one at a time; return the deltas (flush last). Per step, checks that the
    emitted text never runs ahead of a decode of the ids so far, and that it is complete
    whenever that decode ends on a whole character."""
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    deltas, emitted = [], ""
    for k, t in enumerate(ids, 1):
        d = detok.push(t)
        deltas.append(d)
        emitted += d
        if check_steps:
            so_far = tok.decode(ids[:k], skip_special_tokens=skip_special_tokens)
            assert so_far.startswith(emitted), (ids[:k], so_far, emitted)
            if not so_far.endswith(FFFD):
                assert emitted == so_far, (ids[:k], so_far, emitted)
        assert detok.window_len <= 16, "the window must not grow with the stream"
    deltas.append(detok.flush())
    return deltas


def assert_faithful(full: str, deltas: list[str]) -> None:
    assert "".join(deltas) == full
    pos = 0
    for d in deltas:
        for j, ch in enumerate(d):
            if ch == FFFD:  # a replacement char only where the full text has one
                assert full[pos + j] == FFFD
        pos += len(d)


# ---------------------------------------------------------------- properties


@PROPS
@given(data=st.data())
def test_stream_random_bytes_and_merges(tok, byte_ids, merged_ids, data):
    choice = st.one_of(
        st.integers(0, 255).map(lambda b: byte_ids[b]),
        st.integers(0xC0, 0xFF).map(lambda b: byte_ids[b]),  # lead bytes: many incomplete chars
        st.sampled_from(merged_ids),
    )
    ids = data.draw(st.lists(choice, max_size=48))
    assert_faithful(tok.decode(ids), stream(tok, ids))


@PROPS
@given(data=st.data())
def test_stream_with_special_tokens_kept_or_skipped(tok, byte_ids, merged_ids, data):
    specials = sorted(tok.special_token_ids)
    choice = st.one_of(st.integers(0, 255).map(lambda b: byte_ids[b]), st.sampled_from(merged_ids),
                       st.sampled_from(specials))
    ids = data.draw(st.lists(choice, max_size=40))
    skip = data.draw(st.booleans())
    assert_faithful(tok.decode(ids, skip_special_tokens=skip), stream(tok, ids, skip_special_tokens=skip))


MULTIBYTE = st.sampled_from([
    "a", "b", " ", "the", "\n", "é", "e\u0301", "\u0301", "\u0308", "ß", "—", "中", "文", "字", "日本語",
    "한", "😀", "👍🏽", "🇫🇷", "👩\u200d💻", "\U0001F9EA", "ﬁ", "\u200b",
])
TEXT = st.lists(st.one_of(MULTIBYTE, st.characters(blacklist_categories=("Cs",))), max_size=30).map("".join)


@PROPS
@given(text=TEXT, data=st.data())
def test_stream_multibyte_text(tok, text, data):
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == text
    # generated tokens continue a prompt: the split point can fall inside a character
    k = data.draw(st.integers(0, len(ids)))
    prompt, gen = ids[:k], ids[k:]
    deltas = stream(tok, gen, prompt_ids=prompt or None)
    assert_faithful(tok.decode(gen), deltas)
    if not tok.decode(prompt).endswith(FFFD):
        assert tok.decode(prompt) + "".join(deltas) == text


# ---------------------------------------------------------------- streaming examples


def test_multibyte_char_waits_for_its_last_byte(tok, byte_ids):
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(byte_ids[b]) for b in "A中".encode()] == ["A", "", "", "中"]
    assert detok.flush() == ""


def test_truncated_char_comes_out_at_flush(tok, byte_ids):
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(byte_ids[b]) for b in "x😀".encode()[:-1]] == ["x", "", "", ""]
    assert detok.flush() == FFFD


def test_long_invalid_run_keeps_streaming_in_a_short_window(tok, byte_ids):
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.push(byte_ids[0x80]) for _ in range(2000))
    assert len(out) >= 1999 and set(out) == {FFFD}
    assert detok.window_len <= 4
    assert out + detok.flush() == FFFD * 2000


def test_long_text_window_stays_short(tok):
    text = "The lighthouse keeper wrote the weather in her notebook. 中文 😀 " * 40
    ids = tok.encode(text, add_bos=False)
    detok = IncrementalDetokenizer(tok, prompt_ids=tok.encode("Once"))
    widest = 0
    out = []
    for t in ids:
        out.append(detok.push(t))
        widest = max(widest, detok.window_len)
    assert "".join(out) + detok.flush() == text
    assert widest <= 8


def _metaspace_tokenizer() -> Tokenizer:
    """SentencePiece-style pieces: '▁world' renders as ' world' except at the start."""
    hf = HFTokenizer(models.WordLevel({"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}, unk_token="<unk>"))
    hf.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return Tokenizer(hf)


def test_prompt_context_renders_leading_space_like_a_full_decode():
    tok = _metaspace_tokenizer()
    assert tok.decode([2, 3]) == "world!"  # a decode from scratch drops the leading space
    full = tok.decode([1, 2, 3])
    detok = IncrementalDetokenizer(tok, prompt_ids=[1])
    out = "".join([detok.push(2), detok.push(3), detok.flush()])
    assert out == " world!" == full[len(tok.decode([1])):]


def test_prompt_ending_inside_a_character_is_not_used_as_context(tok, byte_ids):
    prompt = tok.encode("hi", add_bos=False) + [byte_ids[0xE4]]
    gen = [byte_ids[0xB8], byte_ids[0xAD], *tok.encode(" ok", add_bos=False)]
    assert "".join(stream(tok, gen, prompt_ids=prompt)) == tok.decode(gen)


def test_push_rejects_unknown_ids(tok):
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        IncrementalDetokenizer(tok).push(tok.vocab_size)


# ---------------------------------------------------------------- encode / decode / BOS


def test_round_trip(tok):
    text = "The market opened at seven. Café, naïve, 中文, 😀👍🏽, e\u0301 and tabs\tand\nlines."
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == BOS_TOKEN + text
    assert tok.encode(text, add_bos=False) == ids[1:]


def test_special_ids_from_config_files(tok):
    assert tok.bos_token_id == tok.hf.token_to_id(BOS_TOKEN)
    assert tok.eos_token_ids == {tok.hf.token_to_id(EOS_TOKEN)}
    assert tok.vocab_size == tok.hf.get_vocab_size(with_added_tokens=True) == 1024


def test_bos_added_once_when_post_processor_adds_it(tok):
    bos = tok.bos_token_id
    assert tok.post_processor_adds_bos
    assert tok.encode("hello")[:2] == [bos, tok.encode("hello", add_bos=False)[0]]
    assert tok.encode("").count(bos) == 1
    assert tok.encode(BOS_TOKEN + "hello").count(bos) == 1
    assert bos not in tok.encode("hello", add_bos=False)


def _copy_with(tok_dir, tmp_path, edit_tokenizer=None, tok_cfg=None, files=None):
    d = tmp_path / "model"
    shutil.copytree(tok_dir, d)
    if edit_tokenizer:
        data = json.loads((d / "tokenizer.json").read_text())
        edit_tokenizer(data)
        (d / "tokenizer.json").write_text(json.dumps(data))
    if tok_cfg is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    for name, content in (files or {}).items():
        (d / name).write_text(json.dumps(content))
    return d


def test_bos_added_by_us_when_post_processor_does_not(tok_dir, tmp_path):
    d = _copy_with(tok_dir, tmp_path, edit_tokenizer=lambda t: t.update(post_processor=None))
    tok = Tokenizer.from_dir(d)
    assert not tok.post_processor_adds_bos
    bos = tok.bos_token_id
    assert tok.encode("hello")[0] == bos and tok.encode("hello").count(bos) == 1
    assert tok.encode(BOS_TOKEN + "hello").count(bos) == 1
    assert tok.encode("") == [bos]


def test_add_bos_token_false_disables_bos(tok_dir, tmp_path):
    d = _copy_with(tok_dir, tmp_path, tok_cfg={"add_bos_token": False, "bos_token": BOS_TOKEN})
    tok = Tokenizer.from_dir(d)
    assert tok.bos_token_id == 0 and tok.bos_token_id not in tok.encode("hello")


def test_bos_and_eos_ids_from_config_and_generation_config(tok_dir, tmp_path):
    d = _copy_with(tok_dir, tmp_path, tok_cfg={},
                   files={"config.json": {"bos_token_id": 0, "eos_token_id": 1},
                          "generation_config.json": {"eos_token_id": [1, 7]}})
    tok = Tokenizer.from_dir(d)
    assert tok.bos_token_id == 0
    assert tok.eos_token_ids == {1, 7}


def test_no_bos_anywhere_means_no_bos(tok_dir, tmp_path):
    d = _copy_with(tok_dir, tmp_path, edit_tokenizer=lambda t: t.update(post_processor=None), tok_cfg={})
    tok = Tokenizer.from_dir(d)
    assert tok.bos_token_id is None and tok.eos_token_ids == set()
    assert tok.encode("hello") == tok.encode("hello", add_bos=False)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_invalid_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 3}}')
    with pytest.raises(TokenizerError, match="not a valid tokenizer"):
        Tokenizer.from_dir(tmp_path)


def test_invalid_tokenizer_config(tok_dir, tmp_path):
    d = _copy_with(tok_dir, tmp_path)
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json is not valid JSON"):
        Tokenizer.from_dir(d)


def test_bos_token_not_in_vocab(tok_dir, tmp_path):
    d = _copy_with(tok_dir, tmp_path, tok_cfg={"bos_token": "<|nope|>"})
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        Tokenizer.from_dir(d)


def test_decode_rejects_out_of_range_ids(tok):
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([5, tok.vocab_size + 3])
    with pytest.raises(TokenizerError):
        tok.decode([-1])


# ------------------------------------------------- pieces between special tokens

@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_text_encoded_piece_by_piece_gives_the_tokenizers_ids(tok, merged_ids, data):
    """Chat-shaped text (special tokens anywhere, pieces long enough to be
    remembered, some repeated) encodes, from the piece cache, to exactly what
    the tokenizer gives for the whole text."""
    assert tok._pieces is not None
    specials = sorted(tok.special_token_ids)
    texts = [tok.decode(data.draw(st.lists(st.sampled_from(merged_ids), min_size=0, max_size=60)))
             for _ in range(3)]
    parts = data.draw(st.lists(st.one_of(st.sampled_from(texts),
                                         st.sampled_from(specials).map(
                                             lambda i: tok.decode([i], skip_special_tokens=False))),
                               max_size=12))
    text = "".join(parts)
    want = tok.hf.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, add_bos=False) == want
    assert tok.encode(text, add_bos=False) == want  # again, from remembered pieces


def test_a_resent_conversation_is_tokenized_only_in_its_new_part(tok):
    from helpers import demo_model_dir
    from turbomq.worker.engine.chat_template import ChatTemplate

    template = ChatTemplate.from_dir(demo_model_dir())
    history = [{"role": "system", "content": "You are a careful assistant. " * 8},
               {"role": "user", "content": "Tell me about the sea and the ships upon it. " * 4},
               {"role": "assistant", "content": "The sea is wide; ships cross it with care. " * 6}]
    tok.encode(template.render(history), add_bos=False)
    cached = len(tok._pieces._ids)
    turn = history + [{"role": "user", "content": "And what of the harbours at night? " * 3}]
    text = template.render(turn)
    assert tok.encode(text, add_bos=False) == tok.hf.encode(text, add_special_tokens=False).ids
    assert len(tok._pieces._ids) == cached + 1  # only the new message was tokenized


def test_no_piece_cache_where_the_first_piece_is_treated_differently(tok_dir, tmp_path):
    doc = json.loads((tok_dir / "tokenizer.json").read_text())
    doc["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
                            "split": True}
    shutil.copytree(tok_dir, tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text(json.dumps(doc))
    assert Tokenizer.from_dir(tmp_path / "m")._pieces is None
