"""Copy proposals (runtime/proposer.py) against a brute-force search, and on the kind of
text agents repeat."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flare.runtime.proposer import CopyProposer


def brute_force(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The longest suffix n-gram (max..min) with an earlier occurrence, its latest one."""
    end = len(tokens)
    for n in range(min(max_ngram, end), min_ngram - 1, -1):
        suffix = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):  # occurrences ending before the history's end
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=60), st.integers(1, 6), st.integers(1, 3), st.integers(0, 3),
       st.integers(0, 60))
def test_proposals_equal_a_brute_force_search(tokens, k, min_ngram, extra, split):
    """Whatever the history and however it was appended (built at once, or in two parts),
    the proposal is the brute-force one; a small alphabet makes repeats and overlaps common."""
    max_ngram = min_ngram + extra
    whole = CopyProposer(tokens, max_ngram=max_ngram, min_ngram=min_ngram)
    parts = CopyProposer(tokens[:split], max_ngram=max_ngram, min_ngram=min_ngram)
    parts.extend(tokens[split:])
    want = brute_force(tokens, k, max_ngram, min_ngram)
    assert whole.propose(k) == want and parts.propose(k) == want


def test_a_rewritten_text_is_proposed_from_its_first_copy():
    """The model rewrites a 40-token passage it was given: once it has produced the first
    few tokens of it, every proposal is the passage's next tokens."""
    passage = list(range(1000, 1040))
    p = CopyProposer([1, 2, 3, *passage, 4, 5])
    assert p.propose(5) == []  # nothing repeats yet
    for i in range(2, 35):
        p.extend([passage[i - 2], passage[i - 1]] if i == 2 else [passage[i - 1]])
        assert p.propose(5) == passage[i : i + 5], i


def test_bad_ngram_lengths_are_refused():
    import pytest

    with pytest.raises(ValueError):
        CopyProposer(max_ngram=2, min_ngram=3)


def test_speculation_adapts_drafts_and_backs_off():
    """runtime/speculation.py: drafts follow the request's history after its pending token;
    their number grows after full acceptance and falls to accepted + 1; a miss (nothing to
    copy, no room, or every draft rejected) skips the next 1, 2, 4 ... steps (at most
    MAX_BACKOFF) and an accepted draft resets it; the room caps drafts; log-probabilities or
    a grammar: none."""
    import msgspec

    from flare.runtime.request import Request, SamplingParams
    from flare.runtime.speculation import MAX_BACKOFF, Speculation

    spec = Speculation(4)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                            presence_penalty=0.0, frequency_penalty=0.0, seed=1, max_tokens=100)
    req = Request([1, 2, 3, 4, 5, 6, 1, 2], params)
    req.output = [3]  # pending: the history ends ... 1 2 3, seen before followed by 4 5 6

    def step(*tokens):  # a step completed: its tokens join the output
        req.output += list(tokens)

    assert spec.propose(req, 10) == [4, 5, 6, 1]
    assert spec.propose(req, 2) == [4, 5]  # the room caps it
    step(4, 5, 6, 1, 2)
    spec.observe(req, 4, 4)  # all accepted: stays at the ceiling of 4
    assert spec.propose(req, 10) == [3, 4, 5, 6]  # ... 6 1 2, seen before followed by 3 4 5 6
    step(3, 4, 7)
    spec.observe(req, 4, 2)  # two accepted: next time 3
    assert spec.propose(req, 10) == []  # ... 4 7: nothing to copy: skips the next step
    step(8)  # the plain step that was about to run
    assert not spec.wants(req)
    step(9)  # the skipped one
    assert spec.wants(req) and spec.propose(req, 10) == []  # a second miss: two steps
    step(1)
    assert not spec.wants(req)
    step(2)
    assert not spec.wants(req)
    step(3)  # ... 1 2 3: copies its latest earlier continuation, 3 drafts
    assert spec.wants(req) and spec.propose(req, 10) == [4, 7, 8]
    step(5)
    spec.observe(req, 3, 0)  # all rejected: a miss (the backoff doubles to 4), one draft next
    for _ in range(4):
        assert not spec.wants(req)
        step(6)
    assert spec.wants(req) and len(spec.propose(req, 10)) <= 1
    for _ in range(20):
        spec.miss(req)
    assert spec._states[req.id].backoff == MAX_BACKOFF
    for kw in ({"logprobs": 0}, {}):
        other = Request([1, 2, 1], msgspec.structs.replace(params, **kw), grammar=None if kw else object())
        other.output = [2]
        assert not spec.wants(other) and spec.propose(other, 10) == []


def test_speculation_verifies_only_where_it_pays():
    """The cost model: unmeasured steps verify (to measure); with verify.1 measured at twice
    decode.1 a request needs more than one expected accepted draft per row (first-draft
    rate x mean accepted run), and one that cannot pay does not ask for drafts; the rate
    also learns from decode tokens (shadow: did the proposal before a token predict it)."""
    from flare.runtime.request import Request, SamplingParams
    from flare.runtime.speculation import Speculation

    spec = Speculation(4)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                            presence_penalty=0.0, frequency_penalty=0.0, seed=1, max_tokens=100)
    req = Request([1, 2, 3, 4, 5, 6, 1, 2], params)
    req.output = [3]
    drafts = spec.propose(req, 10)
    assert spec.pays("decode.1", "verify.1", [req], [drafts])  # nothing measured yet
    for _ in range(3):
        spec.timed("decode.1", 10.0)
        spec.timed("verify.1", 20.0)
    assert spec.step_ms == {"decode.1": 10.0, "verify.1": 20.0}
    assert not spec.pays("decode.1", "verify.1", [req], [drafts])  # prior: 0.5 x 2 = 1, not > 1
    assert not spec.wants(req)
    spec.observe(req, 4, 4)  # a run of 4 accepted: rate and run go up
    spec.observe(req, 4, 4)
    assert spec.pays("decode.1", "verify.1", [req], [drafts]) and spec.wants(req)
    for _ in range(6):  # decode tokens the history's proposal did not predict
        spec.shadow(req, 99)
    assert not spec.wants(req)
