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
    copy, or every draft rejected) backs off 1, 2, 4 ... tokens (at most MAX_BACKOFF) and an
    accepted draft resets it; the room caps drafts; log-probabilities or a grammar: none."""
    import msgspec

    from flare.runtime.request import Request, SamplingParams
    from flare.runtime.speculation import MAX_BACKOFF, Speculation

    spec = Speculation(4)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                            presence_penalty=0.0, frequency_penalty=0.0, seed=1, max_tokens=100)
    req = Request([1, 2, 3, 4, 5, 6, 1, 2], params)
    req.output = [3]  # pending: the history ends ... 1 2 3, seen before followed by 4 5 6
    assert spec.propose(req, 10) == [4, 5, 6, 1]
    assert spec.propose(req, 2) == [4, 5]  # the room caps it
    spec.observe(req, 4, 4)  # all accepted: stays at the ceiling of 4
    spec.observe(req, 4, 1)  # one accepted: next time 2
    assert spec.propose(req, 10) == [4, 5]
    req.output += [9]  # ... 3 9: nothing to copy; a miss backs off one token
    assert spec.propose(req, 10) == [] and not spec.wants(req)
    req.output += [8]
    assert spec.wants(req) and spec.propose(req, 10) == []  # a second miss: two tokens
    req.output += [7]
    assert not spec.wants(req)
    req.output += [1, 2]  # ... 1 2: once the backoff has passed, its latest occurrence's 3 9
    assert spec.propose(req, 10) == [3, 9]
    spec.observe(req, 2, 0)  # all rejected: a miss (backoff 4 now), and one draft next time
    assert not spec.wants(req)
    req.output += [3, 4, 5, 6]
    assert spec.propose(req, 10) == [1]
    spec.observe(req, 1, 1)  # accepted: the backoff resets, drafts grow
    for _ in range(20):
        spec._miss(req, spec._state(req))
    assert spec._state(req).backoff == MAX_BACKOFF
    for kw in ({"logprobs": 0}, {}):
        other = Request([1, 2, 1], msgspec.structs.replace(params, **kw), grammar=None if kw else object())
        other.output = [2]
        assert not spec.wants(other) and spec.propose(other, 10) == []
