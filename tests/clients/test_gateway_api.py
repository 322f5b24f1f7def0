"""The gateway's OpenAI side without HTTP: request bodies checked and turned
into generate calls, errors mapped to statuses, replies and chunks, the API
key file. (tests/service/test_gateway.py runs the whole gateway.)"""

from __future__ import annotations

import os
import time

import pytest

from turbomq.clients import protocol as P
from turbomq.clients.errors import error_for
from turbomq.clients.gateway.config import ApiKeys, ConfigError, load_api_keys
from turbomq.clients.gateway.openai_api import (ApiError, chunk, from_service, parse_chat,
                                                parse_completion, response)
from turbomq.clients.types import Usage

MSG = [{"role": "user", "content": "Hi"}]


def test_completion_body_to_a_call():
    call = parse_completion({"model": "m", "prompt": "Hello", "max_tokens": 7, "temperature": 0,
                             "top_p": 0.9, "stop": "\n", "seed": 5, "top_k": 4,
                             "repetition_penalty": 1.1, "ignore_eos": True})
    assert call.inputs == {"prompt": "Hello"} and not call.chat and not call.stream
    assert call.params == {"max_tokens": 7, "temperature": 0.0, "top_p": 0.9, "stop": ["\n"],
                           "seed": 5, "top_k": 4, "repetition_penalty": 1.1, "ignore_eos": True}
    assert parse_completion({"model": "m", "prompt": [[1, 2, 3]]}).inputs == {"input_ids": [1, 2, 3]}
    assert parse_completion({"model": "m", "prompt": ["one"]}).inputs == {"prompt": "one"}
    # no max_tokens: as many as the context allows
    assert parse_completion({"model": "m", "prompt": "x"}).params["max_tokens"] == \
        P.DEFAULT_LIMITS.max_new_tokens


def test_chat_body_to_a_call():
    call = parse_chat({"model": "m", "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text",
                                                                        "text": "there"}]}],
        "max_completion_tokens": 3, "max_tokens": 9, "stream": True,
        "stream_options": {"include_usage": True}})
    assert call.inputs["messages"] == [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Hi there"}]
    assert call.params["max_tokens"] == 3 and call.stream and call.include_usage


def test_a_session_turn_sends_the_messages_after_the_last_reply():
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
               {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    call = parse_chat({"model": "m", "messages": history, "session_id": "x"})
    assert call.inputs["messages"] == [{"role": "user", "content": "c"}]
    assert parse_chat({"model": "m", "messages": history}).inputs["messages"] == history
    with pytest.raises(ApiError):
        parse_chat({"model": "m", "messages": history[:3], "session_id": "x"})


@pytest.mark.parametrize("body,param", [
    ({"n": 2}, "n"), ({"presence_penalty": 0.1}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"), ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"), ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"temperature": 2.5}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"stop": ["a"] * 17}, "stop"),
    ({"top_P": 0.5}, "top_P"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"session_id": ""}, "session_id"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_what_the_engine_cannot_do_is_a_clear_400(body, param):
    with pytest.raises(ApiError) as e:
        parse_chat({"model": "m", "messages": MSG, **body})
    assert e.value.status == 400 and e.value.param == param and e.value.message


def test_zero_penalties_and_ignored_fields_are_accepted():
    call = parse_chat({"model": "m", "messages": MSG, "presence_penalty": 0,
                       "frequency_penalty": 0.0, "logprobs": False, "n": 1, "user": "u",
                       "tool_choice": "none"})
    assert call.inputs == {"messages": MSG}


@pytest.mark.parametrize("code,status", [
    ("overloaded", 429), ("rate_limited", 429), ("no_workers", 503), ("worker_lost", 503),
    ("timeout", 504), ("invalid_params", 400), ("prompt_too_long", 400), ("internal", 500),
    ("session_busy", 409), ("something_new", 500),
])
def test_service_errors_map_to_statuses(code, status):
    err = from_service(error_for(code, "why"))
    assert err.status == status
    body = err.body()["error"]
    assert body["message"] == "why" and body["type"]


def test_replies_and_chunks():
    call = parse_chat({"model": "m", "messages": MSG, "stream": True,
                       "stream_options": {"include_usage": True}})
    usage = Usage(10, 4, 3)
    whole = response(call, "abc", "length", usage)
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["content"] == "abc"
    assert whole["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                              "prompt_tokens_details": {"cached_tokens": 4}}
    first = chunk(call, text="", role=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["usage"] is None  # include_usage: null until the last chunk
    last = chunk(call, usage=usage)
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 13
    call = parse_completion({"model": "m", "prompt": "p", "stream": True})
    c = chunk(call, reason="cancelled")
    assert c["object"] == "text_completion" and c["choices"][0]["finish_reason"] == "stop"
    assert "usage" not in c


def test_api_key_file(tmp_path):
    path = tmp_path / "api.keys"
    path.write_text("# comment\nalpha sk-0123456789abcdef\nbeta sk-fedcba9876543210\n")
    keys = ApiKeys(str(path), interval=0.0)
    assert keys.tenant("sk-0123456789abcdef") == "alpha" and keys.tenant("nope") is None
    assert keys.tenants == {"alpha", "beta"}
    for bad in ("alpha", "alpha short", "bad:name sk-0123456789abcdef",
                "a sk-0123456789abcdef\nb sk-0123456789abcdef"):
        path2 = tmp_path / "bad.keys"
        path2.write_text(bad + "\n")
        with pytest.raises(ConfigError):
            load_api_keys(str(path2))
    # changed: read again; broken: the loaded version stays
    path.write_text("gamma sk-gggggggggggggggg\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10 ** 9))
    keys.refresh()
    assert keys.tenant("sk-gggggggggggggggg") == "gamma" and keys.tenant("sk-0123456789abcdef") is None
    path.write_text("broken\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 2 * 10 ** 9))
    keys.refresh()
    assert keys.tenant("sk-gggggggggggggggg") == "gamma"
