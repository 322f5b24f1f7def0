"""A real checkpoint on the GPU: SmolLM2-135M-Instruct (the GGUF file `make
serve` serves) on CUDA gives the logits and greedy tokens of the CPU path and
of transformers (fp32), and the same answer at its default GPU dtype (fp16)
with the native kernels and CUDA graphs.

Skipped, with the reason, where there is no CUDA device or the native module
lacks its CUDA kernels."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import our_logits, smollm2_gguf_or_skip
from turbomq.worker import Engine, EngineConfig, SamplingParams
from turbomq.worker.model.llama import LlamaModel
from turbomq.worker.model.ops import cuda as cuda_ops
from turbomq.worker.model.weights import load_checkpoint

_REASON = cuda_ops.unavailable_reason()
if _REASON is not None:
    pytest.skip(f"GPU real-model tests skipped: {_REASON}", allow_module_level=True)

QUESTIONS = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Name three primary colours."}],
             [{"role": "system", "content": "You are terse."},
              {"role": "user", "content": "What is 2 + 2?"}]]
FREE = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path() -> str:
    return smollm2_gguf_or_skip()


@pytest.fixture(scope="module")
def prompts(path) -> list[list[int]]:
    with Engine(EngineConfig(model=path, max_batch_size=1, num_kv_blocks=8)) as engine:
        return [engine.tokenizer.encode(engine.chat_template.render(q)) for q in QUESTIONS]


@pytest.fixture(scope="module")
def cpu_tokens(path, prompts) -> list[list[int]]:
    with Engine(EngineConfig(model=path, max_batch_size=4, block_size=16)) as engine:
        return [r.token_ids for r in engine.generate(input_ids=prompts, params=FREE)]


def test_cuda_logits_match_the_cpu_path_and_transformers(path, prompts):
    from transformers import AutoModelForCausalLM

    ckpt = load_checkpoint(path)
    ids = torch.tensor(prompts[2])
    cpu = our_logits(LlamaModel(ckpt.config, ckpt.tensors), ids, [len(ids)])
    gpu_model = LlamaModel(ckpt.config, ckpt.tensors, device="cuda")
    gpu = our_logits(gpu_model, ids.cuda(), [len(ids) - 4, 1, 1, 1, 1]).cpu()
    folder, name = os.path.split(path)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).cuda()
    with torch.no_grad():
        ref = hf(ids[None].cuda()).logits[0].float().cpu()
    assert (gpu - cpu).abs().max().item() < 2e-3
    assert (gpu - ref).abs().max().item() < 2e-3


def test_cuda_fp32_greedy_tokens_equal_the_cpu_path(path, prompts, cpu_tokens):
    config = EngineConfig(model=path, device="cuda", max_batch_size=4, block_size=16)
    with Engine(config) as engine:
        got = [r.token_ids for r in engine.generate(input_ids=prompts, params=FREE)]
    assert got == cpu_tokens


def test_default_dtype_kernels_and_graphs_give_the_answer(path, prompts, cpu_tokens):
    config = EngineConfig(model=path, device="cuda", max_batch_size=8)
    with Engine(config) as engine:
        assert engine.runner.model.dtype == torch.float16  # a GGUF's default on the GPU
        answer = engine.generate(messages=[QUESTIONS[0]], params=SamplingParams(
            max_tokens=32, temperature=0))[0]
        assert answer.text == "The capital of France is Paris."
        # eight copies at once (one decode graph for the whole batch): identical rows
        batch = engine.generate(input_ids=[prompts[1]] * 8, params=FREE)
    assert all(r.token_ids == batch[0].token_ids for r in batch)
    # fp16 rounds differently from fp32: the first tokens still agree
    assert batch[0].token_ids[:8] == cpu_tokens[1][:8]
