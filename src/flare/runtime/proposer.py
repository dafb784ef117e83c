"""Copy proposals for speculative decoding (issue 20): draft tokens taken from the
request's own history (its prompt, which holds the conversation's earlier turns and tool
results, and its output so far). Agent turns repeat text: a tool result quoted back, a
file rewritten with one line changed, JSON re-emitted.

The proposal for the next tokens is the continuation of the most recent *earlier*
occurrence of the history's last ``n`` tokens, for the longest ``n`` from ``max_ngram``
down to ``min_ngram`` that occurred before (prompt lookup decoding, as vLLM's n-gram
proposer). An index from each n-gram to the end of its latest earlier occurrence makes a
proposal O(max_ngram) and each new token O(max_ngram): no scan of the history.

Torch-free and host-side: the verification programs (captured, ``flare-prepare
--draft-tokens``) are what decide, exactly (``prepare/sampling.verify_draft``); a
proposal only costs a wasted position when it is wrong.
"""

from __future__ import annotations

from typing import Iterable


class CopyProposer:
    def __init__(self, tokens: Iterable[int] = (), *, max_ngram: int = 4, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        # n-gram -> end (exclusive) of its latest occurrence that ends before the history's end
        self._index: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append accepted tokens (never drafts: the history is what the model committed)."""
        for t in tokens:
            end = len(self.tokens)
            # The n-grams ending at the current end become earlier occurrences.
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._index[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(int(t))

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` draft tokens (fewer, or none, when no earlier occurrence continues)."""
        end = len(self.tokens)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            at = self._index.get(tuple(self.tokens[end - n : end]))
            if at is not None:
                return self.tokens[at : at + k]
        return []
