"""Sampling: parameter validation, greedy, per-request reproducibility, the
top-k/top-p/min-p masks, the sampled distribution and the repetition penalty."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from turbomq.worker.engine.sampling_params import InvalidParams, SamplingParams, SeedRNG
from turbomq.worker.model.sampler import apply_repetition_penalty, sample

# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.0),
        ("max_tokens", True),
        ("max_tokens", "16"),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "1"),
        ("temperature", None),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("top_p", "0.9"),
        ("top_k", -2),
        ("top_k", 1.0),
        ("top_k", False),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("min_p", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("seed", 1.5),
        ("seed", "7"),
        ("seed", True),
        ("stop", ""),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop", 5),
        ("stop", None),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", 3),
        ("stop_token_ids", [True]),
        ("ignore_eos", 1),
        ("skip_special_tokens", "yes"),
    ],
)
def test_invalid_field_is_rejected_with_its_name(field, value):
    with pytest.raises(InvalidParams, match=field):
        SamplingParams(**{field: value})


def test_invalid_params_is_a_value_error_listing_every_bad_field():
    with pytest.raises(ValueError) as exc:
        SamplingParams(max_tokens=0, top_p=2.0)
    assert isinstance(exc.value, InvalidParams)
    assert len(exc.value.errors) == 2
    assert "max_tokens" in str(exc.value) and "top_p" in str(exc.value)


def test_validate_checks_stop_token_ids_against_vocab():
    p = SamplingParams(stop_token_ids=[0, 9])
    p.validate(vocab_size=10)
    with pytest.raises(InvalidParams, match=r"stop_token_ids.*\[0, 10\).*10"):
        SamplingParams(stop_token_ids=[3, 10]).validate(vocab_size=10)


def test_mutated_params_are_caught_by_validate():
    p = SamplingParams()
    p.temperature = -1
    with pytest.raises(InvalidParams, match="temperature"):
        p.validate()


def test_defaults_and_normalization():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (16, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.seed, p.stop, p.stop_token_ids) == (1.0, None, (), ())
    assert (p.ignore_eos, p.skip_special_tokens) == (False, True)
    q = SamplingParams(stop="###", stop_token_ids=[2, 3], temperature=1, top_k=-1)
    assert q.stop == ("###",) and q.stop_token_ids == (2, 3)
    assert isinstance(q.temperature, float)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy
    assert not SamplingParams().is_greedy


def test_from_dict_round_trip_and_unknown_keys():
    p = SamplingParams.from_dict({"max_tokens": 5, "top_p": 0.5, "stop": ["x"], "seed": 3})
    assert p == SamplingParams(max_tokens=5, top_p=0.5, stop=("x",), seed=3)
    assert SamplingParams.from_dict(p.to_dict()) == p
    with pytest.raises(InvalidParams, match="top_P"):
        SamplingParams.from_dict({"top_P": 0.5})
    with pytest.raises(InvalidParams, match="mapping"):
        SamplingParams.from_dict([("top_p", 0.5)])
    with pytest.raises(InvalidParams, match="temperature"):
        SamplingParams.from_dict({"temperature": -1})
    with pytest.raises(InvalidParams, match="stop_token_ids"):
        SamplingParams.from_dict({"stop_token_ids": [50]}, vocab_size=50)


# ---------------------------------------------------------------- greedy

GREEDY = SamplingParams(temperature=0)


def test_greedy_is_argmax_and_consumes_no_randomness():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    rngs = [SeedRNG(i) for i in range(6)]
    out = sample(logits, [GREEDY] * 6, rngs)
    assert out.dtype == torch.int64 and out.shape == (6,)
    assert torch.equal(out, logits.argmax(-1))
    assert all(r.draws == 0 for r in rngs)
    assert torch.equal(sample(logits, [GREEDY] * 6, [None] * 6), out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_greedy_ties_go_to_lowest_id_in_any_dtype(dtype):
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0]], dtype=dtype)
    assert sample(logits, [GREEDY] * 2, [None] * 2).tolist() == [1, 0]


def test_top_k_1_equals_greedy_even_with_ties():
    torch.manual_seed(1)
    logits = torch.randint(-3, 3, (64, 12)).float()  # many exact ties
    p = SamplingParams(top_k=1, temperature=1.3)
    rngs = [SeedRNG(i) for i in range(64)]
    for _ in range(5):
        assert torch.equal(sample(logits, [p] * 64, rngs), logits.argmax(-1))
    assert all(r.draws == 5 for r in rngs)


def test_sampled_rows_need_an_rng():
    with pytest.raises(ValueError, match="SeedRNG"):
        sample(torch.zeros(2, 5), [GREEDY, SamplingParams()], [None, None])


def test_batch_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="params"):
        sample(torch.zeros(3, 5), [GREEDY] * 2, [None] * 2)
    with pytest.raises(ValueError, match="vocab"):
        sample(torch.zeros(5), [GREEDY], [None])


def test_repetition_penalty_without_histories_is_an_error():
    with pytest.raises(ValueError, match="token_histories"):
        sample(torch.zeros(1, 5), [SamplingParams(repetition_penalty=1.2)], [SeedRNG(0)])


# ---------------------------------------------------------------- reproducibility


def _request_logits(request: int, step: int, vocab: int) -> torch.Tensor:
    """The logits request `request` would see at `step`, whatever its batch."""
    g = torch.Generator().manual_seed(request * 100_003 + step)
    return torch.randn(vocab, generator=g) * 2.0


def _run(target: SamplingParams, position: int, neighbours: list[SamplingParams], steps: int, vocab: int):
    """Decode `target` for `steps` steps at row `position` among `neighbours`;
    neighbours join and leave on a fixed pattern to vary the batch shape."""
    rngs = {i: SeedRNG(n.seed) if n.seed is not None else SeedRNG() for i, n in enumerate(neighbours)}
    target_rng = SeedRNG(target.seed)
    history: list[int] = [1, 2, 3]
    tokens = []
    for step in range(steps):
        active = [i for i in range(len(neighbours)) if (step + i) % 3 != 0]
        rows = [("n", i) for i in active]
        rows.insert(min(position, len(rows)), ("t", 0))
        logits = torch.stack(
            [_request_logits(0 if kind == "t" else 1 + i, step, vocab) for kind, i in rows]
        )
        params = [target if kind == "t" else neighbours[i] for kind, i in rows]
        rs = [target_rng if kind == "t" else rngs[i] for kind, i in rows]
        hists = [history if kind == "t" else [i, i + 1] for kind, i in rows]
        out = sample(logits, params, rs, hists)
        tok = int(out[[k for k, _ in rows].index("t")])
        tokens.append(tok)
        history.append(tok)
    return tokens


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(seed=1234),
        SamplingParams(seed=7, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02),
        SamplingParams(seed=99, temperature=1.5, repetition_penalty=1.3),
    ],
)
def test_same_seed_same_tokens_whatever_the_batch(target):
    vocab, steps = 300, 40
    crowd = [
        SamplingParams(temperature=0),
        SamplingParams(seed=5, top_p=0.5),
        SamplingParams(),  # unseeded: fresh entropy every run
        SamplingParams(top_k=3, repetition_penalty=1.5, temperature=2.0),
        SamplingParams(min_p=0.3, temperature=0.3),
    ]
    alone = _run(target, 0, [], steps, vocab)
    assert len(set(alone)) > 10, "the target must actually sample, or the test proves nothing"
    assert _run(target, 0, crowd, steps, vocab) == alone
    assert _run(target, 3, crowd, steps, vocab) == alone
    assert _run(target, 9, list(reversed(crowd)), steps, vocab) == alone
    assert _run(target, 1, crowd[1:3], steps, vocab) == alone
    other_seed = SamplingParams(**{**target.to_dict(), "seed": target.seed + 1})
    assert _run(other_seed, 0, crowd, steps, vocab) != alone


def test_seed_rng_advance_resumes_the_stream():
    a = SeedRNG(42)
    first = [a.uniform() for _ in range(10)]
    b = SeedRNG(42).advance(4)
    assert [b.uniform() for _ in range(6)] == first[4:]
    assert b.draws == 10
    assert SeedRNG().seed != SeedRNG().seed


# ---------------------------------------------------------------- masks


def _reference_allowed(logits, p: SamplingParams, slack: float = 0.0) -> set[int]:
    """Pure-Python top-k -> top-p -> min-p, in float64. `slack` loosens the
    top-p and min-p thresholds to absorb float32 rounding at the boundary."""
    v = len(logits)
    order = sorted(range(v), key=lambda i: (-logits[i], i))
    z = [logits[i] / p.temperature for i in order]
    m = max(z)
    e = [math.exp(a - m) for a in z]
    total = sum(e)
    probs = [a / total for a in e]

    k = v if p.top_k <= 0 else min(p.top_k, v)
    kept = list(range(k))
    if p.top_p < 1.0:
        mass = sum(probs[r] for r in kept)
        before, out = 0.0, []
        for r in kept:
            if before / mass < p.top_p + slack:
                out.append(r)
            before += probs[r]
        kept = out
    kept = [r for r in kept if probs[r] >= (p.min_p - slack) * probs[0]] or [0]
    return {order[r] for r in kept}


logit_lists = st.integers(1, 40).flatmap(
    lambda v: st.lists(
        st.one_of(st.floats(-20, 20, width=32), st.sampled_from([0.0, 1.0, 5.0])),
        min_size=v,
        max_size=v,
    )
)
params_strategy = st.builds(
    SamplingParams,
    temperature=st.floats(0.05, 3.0),
    top_k=st.one_of(st.just(0), st.just(-1), st.integers(1, 45)),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    seed=st.integers(0, 2**32),
)


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(st.tuples(logit_lists, params_strategy), min_size=1, max_size=4), data=st.data())
def test_filters_never_sample_a_masked_token(rows, data):
    vocab = max(len(lg) for lg, _ in rows)
    # Pad short rows with a very low logit so every row has the same vocab.
    padded = [lg + [-1e4] * (vocab - len(lg)) for lg, _ in rows]
    params = [p for _, p in rows]
    rngs = [SeedRNG(p.seed) for p in params]
    logits = torch.tensor(padded, dtype=torch.float32)
    allowed = [_reference_allowed(lg, p, slack=1e-5) for lg, p in zip(logits.tolist(), params)]
    strict_k = [
        {i for i in range(vocab)} if p.top_k <= 0 else set(sorted(range(vocab), key=lambda i: (-lg[i], i))[: p.top_k])
        for lg, p in zip(logits.tolist(), params)
    ]
    for _ in range(data.draw(st.integers(1, 5))):
        out = sample(logits, params, rngs).tolist()
        for row, tok in enumerate(out):
            assert tok in allowed[row], (row, tok, sorted(allowed[row]))
            assert tok in strict_k[row]


def test_top_p_keeps_smallest_set_reaching_top_p():
    # probs 0.5, 0.3, 0.2: top_p=0.5 keeps {0}; 0.6 keeps {0, 1}; 0.8 keeps {0, 1}; 0.81 keeps all.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    for top_p, expect in [(0.5, {0}), (0.6, {0, 1}), (0.79, {0, 1}), (0.81, {0, 1, 2})]:
        p = SamplingParams(top_p=top_p)
        rng = SeedRNG(0)
        seen = {int(sample(logits, [p], [rng])) for _ in range(300)}
        assert seen == expect, (top_p, seen)


def test_min_p_keeps_tokens_above_fraction_of_max():
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.26, 0.14]]))
    p = SamplingParams(min_p=0.5)  # keeps prob >= 0.25
    rng = SeedRNG(3)
    seen = {int(sample(logits, [p], [rng])) for _ in range(300)}
    assert seen == {1, 2}


# ---------------------------------------------------------------- distribution


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * q) ** 2 / (n * q) for c, q in zip(counts, probs) if q > 0)


def _empirical(logits: torch.Tensor, p: SamplingParams, n: int) -> list[int]:
    rng = SeedRNG(2024)  # one stream shared by all rows: n independent draws
    out = sample(logits.expand(n, -1), [p] * n, [rng] * n)
    return torch.bincount(out, minlength=logits.shape[-1]).tolist()


def test_temperature_1_samples_from_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    probs = torch.softmax(logits.double(), -1).tolist()
    counts = _empirical(logits, SamplingParams(), 40_000)
    # df = 7; P(chi2 > 40) ~ 1e-6. The seed is fixed, so the figure is too.
    assert _chi_square(counts, probs) < 40
    # A wrong sampler is far outside that bound: uniform counts score in the thousands.
    assert _chi_square([5000] * 8, probs) > 1000


def test_filtered_samples_follow_renormalized_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    p = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    allowed = _reference_allowed(logits.tolist(), p)
    z = torch.softmax(logits.double() / 0.7, -1)
    mass = sum(z[i] for i in allowed)
    probs = [float(z[i] / mass) if i in allowed else 0.0 for i in range(8)]
    counts = _empirical(logits, p, 40_000)
    assert all(counts[i] == 0 for i in range(8) if i not in allowed)
    assert _chi_square(counts, probs) < 40  # df <= 4


# ---------------------------------------------------------------- repetition penalty


def test_repetition_penalty_matches_hf():
    gen = torch.Generator().manual_seed(0)
    vocab, batch = 37, 6
    logits = torch.randn(batch, vocab, generator=gen) * 3
    penalties = [1.0, 1.3, 0.7, 2.0, 1.1, 5.0]
    rnd = random.Random(0)
    histories = [[rnd.randrange(vocab) for _ in range(rnd.randrange(1, 30))] for _ in range(batch)]
    histories[4] = []
    ours = apply_repetition_penalty(logits, penalties, histories)
    for r in range(batch):
        expect = logits[r : r + 1].clone()
        if histories[r]:
            hf = RepetitionPenaltyLogitsProcessor(penalties[r])
            expect = hf(torch.tensor([histories[r]]), expect)
        torch.testing.assert_close(ours[r : r + 1], expect, rtol=0, atol=0)
    assert torch.equal(ours[0], logits[0])  # penalty 1.0 touches nothing
    assert not torch.equal(ours[1], logits[1])


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, -1.0], [3.0, 2.9, -1.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=1.5), GREEDY]
    out = sample(logits, params, [None, None], [[0, 0], [0]])
    assert out.tolist() == [1, 0]
