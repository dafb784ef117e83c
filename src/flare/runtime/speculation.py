"""Speculative decoding's host policy (issue 20): which running requests get copy drafts in
the next step, and how many.

A request's drafts come from its own history (``proposer.CopyProposer`` over its prompt and
its output so far); a ``verify`` program checks them exactly (``prepare/sampling.verify_chain``),
so a draft only ever costs a wasted position. What speculation can cost is elsewhere: a
verify step is not submitted ahead of its predecessor (how many tokens it emits is known only
when it completes), and it runs W positions per row. So a request asks for drafts only while
drafting pays:

* the number of drafts follows acceptance: after a step that accepted every draft it grows by
  one (up to ``max_drafts``), otherwise it becomes the accepted count plus one;
* a request whose history offers no proposal, or whose drafts were all rejected, backs off:
  it is not considered again for ``backoff`` more tokens, a backoff that doubles on each
  consecutive miss (up to ``MAX_BACKOFF``) and resets on an accepted draft. While every
  request of a batch is backing off the decode steps run ahead as without speculation.

Requests that ask for log-probabilities or carry a grammar never draft (a verify record has
no log-probability block, and a grammar mask is known for the first position only).
"""

from __future__ import annotations

from dataclasses import dataclass

from flare.runtime.proposer import CopyProposer
from flare.runtime.request import Request

MAX_BACKOFF = 32  # tokens a request waits before it proposes again, at most


@dataclass
class _State:
    proposer: CopyProposer
    drafts: int  # how many to ask for next
    backoff: int = 0  # current backoff length (0: none yet)
    resume_at: int = 0  # output length from which it proposes again
    fed: int = 0  # history tokens (prompt, then output) already in the proposer


class Speculation:
    def __init__(self, max_drafts: int):
        if max_drafts < 1:
            raise ValueError(f"speculation needs at least one draft token, got {max_drafts}")
        self.max_drafts = max_drafts
        self._states: dict[str, _State] = {}

    def eligible(self, req: Request) -> bool:
        return req.grammar is None and req.params.logprobs < 0

    def wants(self, req: Request) -> bool:
        """Whether the request may draft in its next step (not backing off)."""
        if not self.eligible(req):
            return False
        s = self._states.get(req.id)
        return s is None or len(req.output) >= s.resume_at

    def propose(self, req: Request, room: int) -> list[int]:
        """Drafts that continue the request's history after its pending token (at most
        ``room``, the positions its pages and its limits allow); [] when it does not draft."""
        if room <= 0 or not self.wants(req):
            return []
        s = self._state(req)
        # The history only grows (a preempted request keeps its prompt and output): feed the new part.
        n = len(req.prompt)
        if s.fed < n:
            s.proposer.extend(req.prompt[s.fed :])
            s.fed = n
        s.proposer.extend(req.output[s.fed - n :])
        s.fed = n + len(req.output)
        drafts = s.proposer.propose(min(s.drafts, room))
        if not drafts:
            self.miss(req)
        return drafts

    def observe(self, req: Request, drafted: int, accepted: int) -> None:
        """A verify step's outcome for the request (called once its tokens are in its output):
        ``accepted`` of its ``drafted`` drafts."""
        if drafted <= 0:
            return
        s = self._state(req)
        if accepted == 0:
            self._back_off(s, len(req.output))
            s.drafts = 1
            return
        s.backoff = 0
        s.drafts = min(self.max_drafts, s.drafts + 1) if accepted == drafted else accepted + 1

    def forget(self, req: Request) -> None:
        self._states.pop(req.id, None)

    def _state(self, req: Request) -> _State:
        s = self._states.get(req.id)
        if s is None:
            s = self._states[req.id] = _State(CopyProposer(), self.max_drafts)
        return s

    def miss(self, req: Request) -> None:
        """The request could not draft for the step about to run (nothing to copy, no room):
        it backs off from the output it will have after that step."""
        self._back_off(self._state(req), len(req.output) + 1)

    @staticmethod
    def _back_off(s: _State, base: int) -> None:
        """Skip the next ``backoff`` tokens' steps counted from an output length of ``base``."""
        s.backoff = min(MAX_BACKOFF, max(1, 2 * s.backoff))
        s.resume_at = base + s.backoff
