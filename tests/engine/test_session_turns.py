"""Session turns commit once: a turn sent again (its client lost the broker)
is answered from the store, never appended twice; a turn whose session grew
meanwhile fails with the retryable session_busy (docs/sessions.md, "Turns")."""

from __future__ import annotations

from helpers import demo_model_dir
from turbomq.worker import Engine, EngineConfig, SamplingParams
from turbomq.worker.engine import errors
from turbomq.worker.engine.session_store import InMemorySessionStore, TurnRecord

GREEDY = dict(temperature=0.0, ignore_eos=True)


def engine(store=None) -> Engine:
    return Engine(EngineConfig(model=demo_model_dir(), max_batch_size=4, block_size=16),
                  session_store=store)


def run(eng: Engine, **kw):
    events = []
    eng.submit(callback=events.append, **kw)
    while not (events and events[-1].finished):
        eng.step()
    return [t for e in events for t in e.token_ids], "".join(e.text for e in events), events[-1]


def test_a_resent_committed_turn_is_answered_from_the_store():
    store = InMemorySessionStore()
    eng = engine(store)
    params = SamplingParams(max_tokens=12, **GREEDY)
    first, text, final = run(eng, prompt="The tide came in", session_id="s", params=params,
                             request_id="r1", turn_id="turn-1")
    history = store.get_tokens("s")
    # The same turn again (another broker, another engine request id): the
    # stored output, nothing appended.
    again, again_text, again_final = run(eng, prompt="The tide came in", session_id="s",
                                         params=params, request_id="r2", turn_id="turn-1")
    assert again == first and again_text == text
    assert again_final.finish_reason == final.finish_reason
    assert again_final.usage.completion_tokens == 12
    assert store.get_tokens("s") == history
    assert eng.stats()["requests_replayed"] == 1
    # Sent again with the tokens the client already had: only the rest.
    rest, rest_text, _ = run(eng, prompt="The tide came in", session_id="s", params=params,
                             request_id="r3", turn_id="turn-1", resume_tokens=first[:5])
    assert rest == first[5:] and text.endswith(rest_text)
    assert store.get_tokens("s") == history
    # A new turn id runs and appends as usual.
    run(eng, prompt=" and went out", session_id="s", params=params, request_id="r4",
        turn_id="turn-2")
    assert len(store.get_tokens("s")) > len(history)


def test_a_turn_id_with_another_prompt_is_a_new_turn():
    store = InMemorySessionStore()
    eng = engine(store)
    params = SamplingParams(max_tokens=4, **GREEDY)
    run(eng, prompt="Hello there", session_id="s", params=params, turn_id="same")
    n = len(store.get_tokens("s"))
    run(eng, prompt="Something else", session_id="s", params=params, turn_id="same")
    assert len(store.get_tokens("s")) > n  # a reused id with a new prompt is not a replay


def test_a_turn_on_a_session_that_grew_meanwhile_is_refused():
    store = InMemorySessionStore()
    eng = engine(store)
    params = SamplingParams(max_tokens=8, **GREEDY)
    events = []
    eng.submit(prompt="First words", session_id="s", params=params, callback=events.append,
               turn_id="mine")
    eng.step()  # it read the (empty) history and started
    # Another worker commits a turn to the same session meanwhile.
    store.append_turn("s", [5, 6, 7], TurnRecord("theirs", 0, 2, "stop"))
    while not (events and events[-1].finished):
        eng.step()
    final = events[-1]
    assert final.finish_reason == "error" and isinstance(final.error, errors.SessionBusy)
    assert final.error.retryable
    assert store.get_tokens("s") == [5, 6, 7]  # nothing of ours appended
    # Sent again, it runs on the new history.
    tokens, _, final = run(eng, prompt="First words", session_id="s", params=params,
                           turn_id="mine")
    assert final.finish_reason == "length" and store.get_tokens("s")[:3] == [5, 6, 7]


def test_resume_tokens_that_do_not_match_the_committed_turn_are_refused():
    store = InMemorySessionStore()
    eng = engine(store)
    params = SamplingParams(max_tokens=6, **GREEDY)
    tokens, _, _ = run(eng, prompt="Once", session_id="s", params=params, turn_id="t")
    wrong = [(tokens[0] + 1) % 1000]
    try:
        run(eng, prompt="Once", session_id="s", params=params, turn_id="t", resume_tokens=wrong)
    except errors.InvalidRequest as e:
        assert "do not match" in str(e)
    else:
        raise AssertionError("mismatched resume_tokens were accepted")
    # The session is not left busy.
    run(eng, prompt=" again", session_id="s", params=params, turn_id="t2")
