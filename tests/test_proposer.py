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
