"""GGUF input, proved on a real model: SmolLM2-135M-Instruct (Q4_1) from the
package index. transformers loads the same file (`gguf_file=`) as the oracle:
the configuration, the tokenizer, the chat template's token IDs, the logits
and the greedy tokens all match."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import smollm2_gguf, our_logits
from turbomq.worker import Engine, EngineConfig, SamplingParams
from turbomq.worker.engine.chat_template import ChatTemplate
from turbomq.worker.engine.tokenizer import Tokenizer
from turbomq.worker.model.gguf import unpermute_rotary_rows
from turbomq.worker.model.llama import LlamaModel
from turbomq.worker.model.weights import CheckpointError, load_checkpoint

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CONVERSATIONS = [
    QUESTION,
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Count: 1, 22, 333 — ok?"}],
]
TEXTS = ["Hello world", " leading space", "digits 12345 and 3.14159", "naïve café 東京 🙂",
         "tabs\tand\nnew\n\nlines  double  spaces", "<|im_start|>user\nhi<|im_end|>",
         "x" * 50, "def f(a, b):\n    return a ** b  # comment"]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def hf(gguf_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return tokenizer, model.eval()


@pytest.fixture(scope="module")
def checkpoint(gguf_path):
    return load_checkpoint(gguf_path)


def test_config_matches_transformers(checkpoint, hf):
    ours, theirs = checkpoint.config, hf[1].config
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size, ours.num_layers) == (
        theirs.vocab_size, theirs.hidden_size, theirs.intermediate_size, theirs.num_hidden_layers)
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
        theirs.num_attention_heads, theirs.num_key_value_heads, theirs.head_dim)
    assert ours.num_kv_heads < ours.num_heads and ours.tie_word_embeddings  # GQA, tied
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)


def test_tokenizer_matches_transformers(gguf_path, hf):
    ours, theirs = Tokenizer.from_dir(gguf_path), hf[0]
    assert ours.bos_token_id == 1 and not ours.add_bos_token  # the file says no BOS
    assert 2 in ours.eos_token_ids  # <|im_end|> ends a turn
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text, add_special_tokens=False).input_ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text


def test_chat_template_tokens_match_transformers(gguf_path, hf):
    tokenizer, template = Tokenizer.from_dir(gguf_path), ChatTemplate.from_dir(gguf_path)
    for messages in CONVERSATIONS:
        ours = tokenizer.encode(template.render(messages))
        theirs = hf[0].apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        theirs = theirs["input_ids"] if isinstance(theirs, dict) or hasattr(theirs, "keys") else theirs
        assert ours == list(theirs), messages


def test_logits_match_transformers(checkpoint, hf):
    model = LlamaModel(checkpoint.config, checkpoint.tensors)
    ids = torch.tensor(hf[0].apply_chat_template(CONVERSATIONS[2], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False))
    with torch.no_grad():
        ref = hf[1](ids[None]).logits[0]
    for chunks in ([len(ids)], [20, len(ids) - 23, 1, 1, 1]):
        diff = (our_logits(model, ids, chunks) - ref).abs().max().item()
        assert diff < 2e-3, f"chunks {chunks}: max |logit diff| {diff}"


def test_greedy_answer_matches_transformers(gguf_path, hf):
    tokenizer, model = hf
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    theirs = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    with Engine(EngineConfig(model=gguf_path, max_batch_size=2, block_size=16)) as engine:
        out = engine.generate(messages=[QUESTION], params=SamplingParams(max_tokens=24, temperature=0))[0]
        # the same tokens up to and including the end-of-turn token, where generation stops
        assert out.token_ids == theirs[:len(out.token_ids)]
        assert out.finish_reason == "stop" and out.token_ids[-1] == 2
        assert out.text == "The capital of France is Paris."
        # the same prompt as IDs, without stopping: the whole 24 tokens agree
        free = engine.generate(input_ids=[prompt], params=SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True))[0]
    hf_free = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=24, do_sample=False, eos_token_id=None)[0, len(prompt):]
    assert free.token_ids == hf_free.tolist()


def test_convert_and_generate_from_the_command_line(gguf_path, checkpoint, tmp_path):
    dst = tmp_path / "smollm2"
    cli = [sys.executable, "-m", "turbomq.worker.cli"]
    subprocess.run([*cli, "convert", gguf_path, str(dst)], check=True, capture_output=True)
    converted = load_checkpoint(dst)
    assert converted.config == checkpoint.config
    assert all(torch.equal(converted.tensors[n], t) for n, t in checkpoint.tensors.items())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / name).is_file()
    assert Tokenizer.from_dir(dst).encode(TEXTS[2]) == Tokenizer.from_dir(gguf_path).encode(TEXTS[2])
    (tmp_path / "q.json").write_text(json.dumps(QUESTION))
    done = subprocess.run([*cli, "generate", "--model", str(dst), "--messages", str(tmp_path / "q.json"),
                           "--temperature", "0", "--max-tokens", "16", "--json"],
                          check=True, capture_output=True, text=True)
    assert json.loads(done.stdout)["text"] == "The capital of France is Paris."


def test_unpermute_undoes_llama_cpp_row_order():
    # llama.cpp's converter: per head, rows (j, j + d/2) become (2j, 2j + 1)
    heads, head_dim, cols = 3, 8, 5
    hf_rows = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    gguf_rows = (hf_rows.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2)
                 .reshape(heads * head_dim, cols))
    assert np.array_equal(unpermute_rotary_rows(gguf_rows, heads), hf_rows)


def test_a_broken_gguf_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 12)
    with pytest.raises(CheckpointError, match="broken.gguf"):
        load_checkpoint(bad)
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "missing.gguf")
