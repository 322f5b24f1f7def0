"""Chat templates: a list of messages rendered the way the model was trained
to read them, with the model's own Jinja template (`chat_template` in
tokenizer_config.json, or chat_template.jinja), as HF transformers'
`apply_chat_template(..., add_generation_prompt=True)` renders it. The
template runs in Jinja's immutable sandbox: a model directory is data, and
its template may not reach anything but the messages (docs/tokenizer.md).

A session turn renders only its new messages: the part of "an earlier
conversation + these messages" that follows the earlier conversation's last
reply and the end-of-turn token that closed it (the model generated both;
they are in the session's history). For templates that render each message
on its own (ChatML, Llama-3, Mistral, ...) the session's tokens then equal
the whole conversation rendered at once, as long as each reply ended with an
end-of-turn token (a reply cut at max_tokens did not)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..model.files import read_model_file

_REPLY = "turbomq-earlier-reply"  # a stand-in for the model's last reply
_EARLIER = [{"role": "user", "content": "turbomq-earlier-turn"},
            {"role": "assistant", "content": _REPLY}]


class ChatTemplateError(ValueError):
    """Messages the template cannot render (it says why), or a broken template."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: Optional[int] = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def check_messages(messages: object) -> list[dict]:
    """A non-empty list of {"role": str, "content": str} maps."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str) or set(m) - {"role", "content"}:
            raise ChatTemplateError(f"messages[{i}] must be {{'role': str, 'content': str}}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template does not parse: {e}") from None
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_dir(cls, path: str | Path) -> Optional["ChatTemplate"]:
        """The model's template, or None when it ships none."""
        config = json.loads(read_model_file(path, "tokenizer_config.json") or "{}")
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if source is None:
            source = read_model_file(path, "chat_template.jinja")
        if not source:
            return None
        return cls(source, _content(config.get("bos_token")), _content(config.get("eos_token")))

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(messages=check_messages(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:  # the sandbox refused something, or a bad template
            raise ChatTemplateError(f"the chat template failed: {e}") from None

    def render_continuation(self, messages: Sequence[dict],
                            end_of_turn: Sequence[str] = ()) -> str:
        """A later turn: what the template writes for `messages` (and the
        generation prompt) after the last reply and the end-of-turn text
        (`end_of_turn`: the texts of the model's end-of-turn tokens) that
        closed it."""
        before = self.render(_EARLIER, add_generation_prompt=False)
        at = before.rfind(_REPLY)
        if at < 0:
            raise ChatTemplateError("this chat template does not show the assistant's replies: "
                                    "send the whole conversation without a session")
        at += len(_REPLY)
        for eot in sorted(end_of_turn, key=len, reverse=True):
            if eot and before.startswith(eot, at):
                at += len(eot)
                break
        whole = self.render(_EARLIER + check_messages(messages), add_generation_prompt=True)
        if not whole.startswith(before[:at]):
            raise ChatTemplateError("this chat template renders a conversation as a whole, not turn "
                                    "by turn: send the whole conversation without a session")
        return whole[at:]


def _content(token: Any) -> str:
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token or ""
