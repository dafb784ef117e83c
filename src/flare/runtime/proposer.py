"""Copy proposals for speculative decoding (issue 20): draft tokens taken from the
request's own history (its prompt, which holds the conversation's earlier turns and tool
results, and its output so far). Agent turns repeat text: a tool result quoted back, a
file rewritten with one line changed, JSON re-emitted.

The proposer keeps a *copy source*: the position in the history whose token it expects
next. While each new token is the one the source predicts, the source moves on with it, so
a copy of a long passage keeps following that passage however often its short n-grams
occur elsewhere (re-emitting a JSON list, the latest occurrence of ``"owner": "`` is the
record just written, not the one being copied).

A token the source did not predict is taken for a substitution when the source had
predicted at least as many tokens in a row as the longest earlier match of the history's
new suffix: the copy goes on after the replaced token. A pair seen twice is remembered, so a
consistent rewrite (a document re-indented, a name renamed) is predicted from then on
(records whose values differ make pairs seen once); a pair is forgotten when the copy shows
the original token again. Otherwise (a short run: a source found by a short n-gram may be
the wrong one of several records) it re-anchors: after the most recent *earlier*
occurrence of the history's last ``n`` tokens, for the longest ``n`` from ``max_ngram``
down to ``min_ngram`` (prompt lookup decoding, as vLLM's n-gram proposer).

An index from each n-gram to the end of its latest earlier occurrence makes each new token
O(max_ngram) and a proposal O(k): no scan of the history. A new token's suffix n-grams are
built once: looked up now, indexed when the next token makes them earlier occurrences.

Torch-free and host-side: the verification programs (captured, ``flare-prepare
--draft-tokens``) are what decide, exactly (``prepare/sampling.verify_chain``); a proposal
only costs a wasted position when it is wrong.
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
        self.source: int | None = None  # where the next token is expected (None: no copy)
        self.run = 0  # tokens the source predicted in a row (since it was found or passed a miss)
        self.substitutions: dict[int, int] = {}  # source token -> the token the copy writes for it
        self._seen: dict[int, int] = {}  # substitutions seen once (a second sighting confirms one)
        self._suffix: list[tuple[int, ...]] = []  # the history's last max..min_ngram tokens, longest first
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append accepted tokens (never drafts: the history is what the model committed)."""
        subs = self.substitutions
        index, history = self._index, self.tokens
        for t in tokens:
            t = int(t)
            end, source = len(history), self.source
            # The n-grams ending at the current end become earlier occurrences.
            for gram in self._suffix:
                index[gram] = end
            history.append(t)
            self._suffix = [tuple(history[end + 1 - n :]) for n in range(self.max_ngram, self.min_ngram - 1, -1)
                            if n <= end + 1]
            if source is None:
                self.source, self.run = self._lookup()[0], 0
                continue
            original = history[source]
            if subs.get(original, original) == t:
                self.source, self.run = source + 1, self.run + 1
            elif original == t:  # the copy keeps this token after all
                del subs[original]
                self._seen.pop(original, None)
                self.source, self.run = source + 1, self.run + 1
            else:
                found, n = self._lookup()
                if self.run and self.run >= n:  # the copy held longer than any match of the new token
                    if self._seen.get(original) == t:
                        subs[original] = t
                    self._seen[original] = t
                    self.source, self.run = source + 1, 0
                else:
                    self.source, self.run = found, 0

    def _lookup(self) -> tuple[int | None, int]:
        """The end of the latest earlier occurrence of the longest suffix n-gram, and n
        (None, 0: none)."""
        for gram in self._suffix:  # longest first
            at = self._index.get(gram)
            if at is not None:
                return at, len(gram)
        return None, 0

    def propose(self, k: int) -> list[int]:
        """``k`` draft tokens, or none without a copy source. A source close to the end (a
        repetition: its period is the distance) goes on through the drafts themselves."""
        if self.source is None:
            return []
        subs, history, end = self.substitutions, self.tokens, len(self.tokens)
        drafts = []
        for at in range(self.source, self.source + k):
            t = history[at] if at < end else drafts[at - end]
            drafts.append(subs.get(t, t))
        return drafts
