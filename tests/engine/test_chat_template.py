"""Chat templates render as transformers' apply_chat_template renders them
(real-world templates stored under tests/data/chat_templates), in a sandbox;
a session turn renders only its new messages, and the conversation's text is
the whole conversation rendered at once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from helpers import demo_model_dir
from turbomq.worker import Engine, EngineConfig, SamplingParams
from turbomq.worker.engine import errors
from turbomq.worker.engine.chat_template import ChatTemplate, ChatTemplateError
from turbomq.worker.engine.tokenizer import Tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
# name -> (bos, eos, end of turn as the model generates it)
SPECIAL = {"llama3": ("<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
           "mistral": ("<s>", "</s>", "</s>"),
           "chatml": ("", "<|im_end|>", "<|im_end|>")}
CONVERSATION = [{"role": "user", "content": "Hello, who are you?"},
                {"role": "assistant", "content": "A helpful model."},
                {"role": "user", "content": "Tell me about the sea."}]


SPECIAL_TOKENS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The demo tokenizer with the templates' special tokens, as chat models have them."""
    from tokenizers import Tokenizer as HFTokenizer
    out = tmp_path_factory.mktemp("chat-tokenizer")
    hf = HFTokenizer.from_file(str(Path(demo_model_dir()) / "tokenizer.json"))
    hf.add_special_tokens(SPECIAL_TOKENS)
    hf.save(str(out / "tokenizer.json"))
    return out


def template(name: str) -> ChatTemplate:
    bos, eos, _ = SPECIAL[name]
    return ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(), bos, eos)


@pytest.mark.parametrize("name", list(SPECIAL))
@pytest.mark.parametrize("messages", [CONVERSATION[:1], CONVERSATION])
def test_token_ids_equal_transformers(name, messages, tokenizer_dir):
    bos, eos, _ = SPECIAL[name]
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"),
                                 bos_token=bos or None, eos_token=eos)
    hf.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want  # newer releases: a dict
    ours = Tokenizer.from_dir(tokenizer_dir).encode(template(name).render(messages),
                                                     add_bos=False)
    assert ours == list(want)


@pytest.mark.parametrize("name", list(SPECIAL))
def test_a_later_turn_renders_only_its_messages(name):
    t, (_, _, eot) = template(name), SPECIAL[name]
    first = t.render(CONVERSATION[:1])
    reply = CONVERSATION[1]["content"] + eot  # as the model generates it
    later = t.render_continuation(CONVERSATION[2:], [eot])
    assert first + reply + later == t.render(CONVERSATION)


def test_template_errors_are_clear_and_sandboxed():
    with pytest.raises(ChatTemplateError, match="alternate"):
        template("mistral").render([{"role": "assistant", "content": "first"}])
    with pytest.raises(ChatTemplateError, match="failed"):  # no way out of the sandbox
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render(CONVERSATION)
    for bad in ([], [{"role": "user"}], [{"role": "user", "content": 3}], "hi"):
        with pytest.raises(ChatTemplateError):
            template("chatml").render(bad)


def test_engine_takes_messages_and_session_turns(tmp_path):
    model = tmp_path / "demo"
    shutil.copytree(demo_model_dir(), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / "chatml.jinja").read_text()
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with Engine(EngineConfig(model=str(model), max_batch_size=2, block_size=16)) as eng:
        text = eng.chat_template.render(CONVERSATION[:1])
        by_messages = eng.generate(input_ids=[eng.tokenizer.encode(text, add_bos=False)],
                                   params=params)[0]
        events = []
        eng.submit(messages=CONVERSATION[:1], params=params, callback=events.append,
                   session_id="chat")
        while not (events and events[-1].finished):
            eng.step()
        assert [t for e in events for t in e.token_ids] == by_messages.token_ids
        # A second turn: the session's history plus only the new messages.
        events.clear()
        eng.submit(messages=CONVERSATION[2:], params=params, callback=events.append,
                   session_id="chat")
        while not (events and events[-1].finished):
            eng.step()
        history = eng.session_store.get_tokens("chat")
        cont = eng.tokenizer.encode(eng.chat_template.render_continuation(
            CONVERSATION[2:], eng._end_of_turn), add_bos=False)
        assert history[-(len(cont) + 6):-6] == cont
        with pytest.raises(errors.InvalidRequest):
            eng.submit(messages=[{"role": "user"}], params=params)
        with pytest.raises(errors.InvalidRequest):
            eng.submit(messages=CONVERSATION, prompt="both", params=params)


def test_the_demo_model_has_a_template_and_a_model_without_one_refuses_messages(tmp_path):
    with Engine(EngineConfig(model=demo_model_dir(), max_batch_size=1, block_size=16)) as eng:
        text = eng.chat_template.render(CONVERSATION)
        assert text.startswith("<s>user: Hello, who are you?</s>\n")
        assert text.endswith("<s>assistant: ")
        assert eng.chat_template.render_continuation(CONVERSATION[2:], eng._end_of_turn) == \
            "\n<s>user: Tell me about the sea.</s>\n<s>assistant: "
    model = tmp_path / "plain"
    shutil.copytree(demo_model_dir(), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with Engine(EngineConfig(model=str(model), max_batch_size=1, block_size=16)) as eng:
        assert eng.chat_template is None
        with pytest.raises(errors.InvalidRequest, match="no chat template"):
            eng.submit(messages=CONVERSATION[:1])
