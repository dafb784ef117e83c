"""Speculative decoding's host policy (issue 20): which running requests get copy drafts in
the next step, and how many.

A request's drafts come from its own history (``proposer.CopyProposer`` over its prompt and
its output so far); a ``verify`` program checks them exactly (``prepare/sampling.verify_chain``),
so a draft only ever costs a wasted position. What speculation can cost is elsewhere: a
verify step is not submitted ahead of its predecessor (how many tokens it emits is known only
when it completes), and it runs W positions per row. So a request asks for drafts only while
drafting pays:

* the number of drafts follows acceptance: after a step that accepted every draft it grows by
  one (up to ``max_drafts``), after one that accepted none it halves, otherwise it becomes
  the accepted count plus one;
* a step verifies only when it is expected to pay. A request's expected accepted drafts are
  r x min(L, k): r the rate at which its first draft is accepted, L its mean accepted run
  when the first one is (copies come in runs: measured, a per-draft rate would
  underestimate them), k its drafts; each a running mean. A verify step of B rows pays
  when the sum exceeds B (t_verify / t_decode - 1), the step times measured on this
  machine for this batch size (a verify step runs first to measure it, and again after
  REFRESH decisions against it; its time includes the wait it imposes on the decode step
  after it, which could not be submitted ahead: on the H200 with real SmolLM2 and four
  streams, a verify step's gap between tokens was 2.3-2.7 ms against 1.2-1.3 ms for a steady
  decode step, where the programs alone cost 2.2 and 1.5 ms). Otherwise the batch decodes plainly and its drafting
  requests back off. A request whose own expected gain (at max_drafts) cannot pay for its
  row at the cheapest measured batch size does not ask for drafts at all (its batch keeps
  running ahead);
  r learns from verify steps and, between them, from every token a decode step emits:
  whether the first draft the history proposed before it is that token (for a sampled
  request that happens with probability p(draft), the acceptance probability itself); such
  a hit also grows k by one, as a verify step would (a request cut to one draft would
  otherwise never pay for a verify step again where one costs over twice a decode step),
  and L learns from the hits' streaks (up to ``max_drafts``: the run a verify step would
  have accepted);
* a verify step that also carries requests without drafts of their own (bystanders) makes
  them wait its excess over a decode step for one token: the batch may pay on the whole
  while they lose (on the H200, four SmolLM2 streams of which one copied: the other three
  came out 7 % slower). Such a step runs only while a budget allows, one that grows by
  FAIR_SHARE of every decode step's time (at most SHARE_WINDOW steps of the running decode
  time) and that each such step spends by its excess: bystanders lose at most about
  FAIR_SHARE of their time (2.5 %: the budget spends running estimates of the excess, and
  issue 20 allows 3 %). The steps that re-measure a verify program (one per REFRESH
  decisions against it) are paid from it too when they carry bystanders: uncharged, they
  came on top of it (on the H200 with real SmolLM2, four streams of which one copied now
  and then, the three others lost 0.6-4.4 % on a 3 % budget). A step refused for the
  budget alone is no miss: its drafts do not back off;
* a request whose history offers no proposal, or whose drafts were all rejected, backs off:
  it is not considered again for ``backoff`` more tokens, a backoff that doubles on each
  consecutive miss (up to ``MAX_BACKOFF``) and resets on an accepted draft. While every
  request of a batch is backing off the decode steps run ahead as without speculation.

Requests that ask for log-probabilities or carry a grammar never draft (a verify record has
no log-probability block, and a grammar mask is known for the first position only).

**Learned drafts** (``learned``: ``--speculative mtp`` on a core prepared with ``--mtp``): the
drafts are the model's MTP head's, which each verify program computes at its end for the row's
next step (``LearnedDrafts``), so a request has drafts only right after a verify step. The
policy above holds with that difference: a request that wants drafts but holds none (its first
step, or after decode steps) counts as drafting, at its expected gain, in the decision for a
verify step (its row verifies none this time and brings drafts for the next one), and is no
bystander. While the head's drafts pay, every step verifies; when they do not (a head whose
drafts are rejected: random weights), the batch decodes as without speculation, and the
verify steps that re-measure (one per REFRESH decisions) bring fresh drafts, which the decode
step after them checks (``shadow``), so a head that starts to pay is noticed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from flare.runtime.proposer import CopyProposer
from flare.runtime.request import Request

MAX_BACKOFF = 32  # tokens a request waits before it proposes again, at most
PRIOR_RATE = 0.5  # a request's first-draft acceptance rate before anything is known
PRIOR_RUN = 2.0  # its mean accepted run (given the first draft accepted) before a verify step
RATE_WEIGHT = 0.3  # weight of a step's outcome in a request's running acceptance rate
TIME_WEIGHT = 0.2  # weight of a step's duration in a program's running step time
REFRESH = 64  # decisions against a verify program after which one runs anyway (re-measures it)
FAIR_SHARE = 0.025  # of decode time, what verify steps may cost requests without drafts that share them
SHARE_WINDOW = 100  # decode steps of that share that can be saved up, at most


class LearnedDrafts:
    """A request's latest MTP drafts, valid while its history is the one they continue (the
    proposer interface of ``CopyProposer``: ``extend`` with accepted tokens, ``propose``)."""

    def __init__(self):
        self.length = 0  # history tokens seen
        self.drafts: list[int] = []
        self.at = -1  # the history length they continue

    def extend(self, tokens: Iterable[int]) -> None:
        self.length += len(list(tokens))

    def offer(self, drafts: list[int]) -> None:
        self.drafts, self.at = drafts, self.length

    def propose(self, k: int) -> list[int]:
        return self.drafts[:k] if self.at == self.length else []


@dataclass
class _State:
    proposer: CopyProposer | LearnedDrafts
    drafts: int  # how many to ask for next
    backoff: int = 0  # current backoff length (0: none yet)
    resume_at: int = 0  # output length from which it proposes again
    fed: int = 0  # history tokens (prompt, then output) already in the proposer
    rate: float = PRIOR_RATE  # running fraction of first drafts accepted
    run: float = PRIOR_RUN  # running mean of accepted drafts when the first one was
    streak: int = 0  # decode tokens in a row the history's proposal predicted (shadow)


class Speculation:
    def __init__(self, max_drafts: int, *, always: bool = False, learned: bool = False):
        """``always``: verify whenever there are drafts (no cost model; backoff after misses
        still applies): ``flare-serve --speculative copy-always``, for measurement and tests.
        ``learned``: the drafts of the core's MTP head (module docstring)."""
        if max_drafts < 1:
            raise ValueError(f"speculation needs at least one draft token, got {max_drafts}")
        self.max_drafts = max_drafts
        self.always = always
        self.learned = learned
        self._states: dict[str, _State] = {}
        self.step_ms: dict[str, float] = {}  # program name -> running step time
        self._ratio: float | None = None  # the smallest measured t_verify / t_decode (cached)
        self._declines: dict[str, int] = {}  # verify program -> decisions against it since it last ran
        self._last_verify: str | None = None  # the previous step timed, when it was a verify step
        self._verify_weight: dict[str, float] = {}  # the weight its latest sample had in its mean
        self._share_ms = 0.0  # what verify steps may still cost bystanders (FAIR_SHARE)
        self.refused_for_share = False  # the last ``pays`` said no for the fair share alone

    def timed(self, program: str, ms: float) -> None:
        """A step's measured duration (the scheduler's: from its predecessor's completion while
        steps follow one another, from its decision after the engine was idle).

        A verify step also costs the decode step after it: that one could not be submitted
        ahead (what to decode was known only when the verify step completed), so it starts
        with the host's turn-around on an idle device. Its excess over the steady decode time
        is charged to the verify program (and left out of the decode program's mean)."""
        after_verify, self._last_verify = self._last_verify, None
        old = self.step_ms.get(program)
        if after_verify is not None and program.startswith("decode.") and old is not None:
            excess = max(0.0, ms - old)
            weight = self._verify_weight.pop(after_verify, TIME_WEIGHT)
            self.step_ms[after_verify] += weight * excess  # as if its own sample had been that much longer
        else:
            self.step_ms[program] = ms if old is None else _running(old, ms, TIME_WEIGHT)
        if program.startswith("decode."):
            cap = FAIR_SHARE * SHARE_WINDOW * max(self.step_ms[d] for d in self.step_ms if d.startswith("decode."))
            self._share_ms = min(self._share_ms + FAIR_SHARE * ms, cap)
        if program.startswith("verify."):
            self._declines[program] = 0
            self._last_verify = program
            self._verify_weight[program] = 1.0 if old is None else TIME_WEIGHT
        # Optimistic across batch sizes: a request does not know the batch it will run in
        # (``pays`` then checks the batch's own pair).
        ratios = [self.step_ms[v] / max(self.step_ms[d], 1e-6) for d, v in self._pairs() if d in self.step_ms]
        self._ratio = min(ratios) if ratios else None

    def other_step(self) -> None:
        """A step of another kind completed (prefill, pack, admit, state copies): a decode
        step after it waited for that step, not for a verify step before it."""
        self._last_verify = None

    def pays(self, decode: str, verify: str, batch: list[Request], drafts: list[list[int]]) -> bool:
        """Whether verifying ``drafts`` for ``batch`` (program ``verify``) is expected to emit
        tokens faster than the ``decode`` program would; a first verify step measures."""
        t_decode, t_verify = self.step_ms.get(decode), self.step_ms.get(verify)
        if self.always or t_decode is None or t_verify is None:
            return True
        # A cost measured once would never be measured again once it declines every step:
        # every REFRESH decisions against a verify program, one runs anyway.
        n = self._declines.get(verify, 0) + 1
        self._declines[verify] = n
        self.refused_for_share = False
        drafting = [bool(d) or self._draws_drafts(req) for req, d in zip(batch, drafts)]
        if n < REFRESH:  # (a step that re-measures runs whatever its expected gain)
            gain = sum(_gain(self._state(req), len(d) or self._state(req).drafts)
                       for req, d, ok in zip(batch, drafts, drafting) if ok)
            if not _pays(gain, len(batch), t_decode, t_verify):
                return False
        if not all(drafting):  # bystanders wait for it: within the fair share only, re-measuring too
            if self._share_ms < _excess(t_decode, t_verify):
                self.refused_for_share = True
                return False
            self._share_ms -= _excess(t_decode, t_verify)
        return True

    def verifies(self, batch: list[Request], drafts: list[list[int]]) -> bool:
        """Whether a verify step is worth considering: some request has drafts, or (learned
        drafts) wants them and would get them from it."""
        return any(drafts) or any(self._draws_drafts(r) for r in batch)

    def _draws_drafts(self, req: Request) -> bool:
        """A request without drafts now that a verify step gives drafts for its next step."""
        return self.learned and self.wants(req)

    def eligible(self, req: Request) -> bool:
        return req.grammar is None and req.params.logprobs < 0

    def wants(self, req: Request) -> bool:
        """Whether the request may draft in its next step: not backing off, and its expected
        accepted drafts pay for its row at the measured cost of a verify step."""
        if not self.eligible(req):
            return False
        s = self._states.get(req.id)
        if s is None:
            return True
        if len(req.output) < s.resume_at:
            return False
        return self.always or self._ratio is None or _gain(s, self.max_drafts) > self._ratio - 1

    def may_verify(self, batch: list[Request], decode: str, verify: str) -> bool:
        """Whether the batch's next step could be a verify step (``verify``, against its
        ``decode``): some request wants drafts and, once both programs are measured, the
        expected gain of those that want them (each at ``max_drafts``) could pay for the
        batch's verify step. When it could not, the scheduler submits the next decode step
        ahead instead of waiting to decide: one request that could pay for a verify row of
        its own must not cost a whole batch its step ahead at every token (measured on the
        H200: four streams, one wanting drafts, 6.5 % slower with no verify step paying).
        Nor while requests that do not want drafts would share a verify step the fair-share
        budget cannot pay for (module docstring).
        A "no" counts as a decision against the verify program, so that after REFRESH of
        them the batch decides once more and a verify step re-measures the cost."""
        wanting = [r for r in batch if self.wants(r)]
        if not wanting:
            return False
        t_decode, t_verify = self.step_ms.get(decode), self.step_ms.get(verify)
        if self.always or t_decode is None or t_verify is None:
            return True
        affordable = len(wanting) == len(batch) or self._share_ms >= _excess(t_decode, t_verify)
        if affordable and (self._declines.get(verify, 0) + 1 >= REFRESH or _pays(
                sum(_gain(self._state(r), self.max_drafts) for r in wanting), len(batch), t_decode, t_verify)):
            return True
        self._declines[verify] = self._declines.get(verify, 0) + 1  # a decision against it, as in pays
        return False

    def shadow(self, req: Request, token: int) -> None:
        """A decode step emitted ``token`` for the request (not yet in its output): the rate
        learns whether the history's proposal before it was that token."""
        if self.always or not self.eligible(req):
            return
        s = self._state(req)
        self._sync(req, s)
        guess = s.proposer.propose(1)
        if not guess:
            self._end_streak(s)
            return
        hit = guess[0] == token
        s.rate = _running(s.rate, float(hit), RATE_WEIGHT)
        if hit:  # a draft would have been accepted: one more next time, as after a verify step
            s.drafts = min(self.max_drafts, s.drafts + 1)
            s.streak += 1
        if not hit or s.streak == self.max_drafts:
            self._end_streak(s)

    @staticmethod
    def _end_streak(s: _State) -> None:
        """A streak of predicted decode tokens is the run a verify step would have accepted."""
        if s.streak:
            s.run = _running(s.run, s.streak, RATE_WEIGHT)
            s.streak = 0

    def propose(self, req: Request, room: int) -> list[int]:
        """Drafts that continue the request's history after its pending token (at most
        ``room``, the positions its pages and its limits allow); [] when it does not draft."""
        if room <= 0 or not self.wants(req):
            return []
        s = self._state(req)
        self._sync(req, s)
        drafts = s.proposer.propose(min(s.drafts, room))
        if not drafts and not self.learned:
            self.miss(req)
        return drafts

    def learned_drafts(self, req: Request, drafts: list[int]) -> None:
        """A verify step's MTP drafts for the request's next step (its tokens are in its output)."""
        s = self._state(req)
        self._sync(req, s)
        s.proposer.offer(drafts)

    def observe(self, req: Request, drafted: int, accepted: int) -> None:
        """A verify step's outcome for the request (called once its tokens are in its output):
        ``accepted`` of its ``drafted`` drafts."""
        s = self._state(req)
        s.streak = 0  # the step's tokens did not pass through shadow: a streak ends unrecorded
        if drafted <= 0:
            return
        s.rate = _running(s.rate, float(accepted > 0), RATE_WEIGHT)
        if accepted:
            s.run = _running(s.run, accepted, RATE_WEIGHT)
        if accepted == 0:
            if not (self.learned and self.always):  # mtp-always: the next step verifies anyway
                self._back_off(s, len(req.output))
            s.drafts = max(1, s.drafts // 2)
            return
        s.backoff = 0
        s.drafts = min(self.max_drafts, s.drafts + 1) if accepted == drafted else accepted + 1

    def _pairs(self):
        for name in self.step_ms:
            if name.startswith("verify."):
                yield "decode." + name.split(".", 1)[1], name

    @staticmethod
    def _sync(req: Request, s: _State) -> None:
        """Feed the proposer the history it has not seen (it only grows: a preempted request
        keeps its prompt and output)."""
        n = len(req.prompt)
        if s.fed < n:
            s.proposer.extend(req.prompt[s.fed :])
            s.fed = n
        s.proposer.extend(req.output[s.fed - n :])
        s.fed = n + len(req.output)

    def forget(self, req: Request) -> None:
        self._states.pop(req.id, None)

    def _state(self, req: Request) -> _State:
        s = self._states.get(req.id)
        if s is None:
            s = self._states[req.id] = _State(LearnedDrafts() if self.learned else CopyProposer(), self.max_drafts)
        return s

    def miss(self, req: Request) -> None:
        """The request will not draft in the step about to run (nothing to copy, no room, or
        drafts not worth a verify step): it backs off from the output it will have after it."""
        self._back_off(self._state(req), len(req.output) + 1)

    @staticmethod
    def _back_off(s: _State, base: int) -> None:
        """Skip the next ``backoff`` tokens' steps counted from an output length of ``base``."""
        s.backoff = min(MAX_BACKOFF, max(1, 2 * s.backoff))
        s.resume_at = base + s.backoff


def _pays(gain: float, rows: int, t_decode: float, t_verify: float) -> bool:
    """Whether ``gain`` expected accepted drafts pay for a verify step of ``rows`` rows: each
    row costs t_verify / t_decode - 1 decode steps more."""
    return gain > rows * (t_verify / max(t_decode, 1e-6) - 1)


def _excess(t_decode: float, t_verify: float) -> float:
    """What a verify step makes a request without drafts wait beyond a decode step, ms."""
    return max(0.0, t_verify - t_decode)


def _gain(s: _State, drafts: int) -> float:
    """Expected accepted drafts of a request's next ``drafts`` (module docstring)."""
    return s.rate * min(s.run, drafts) if drafts else 0.0


def _running(mean: float, value: float, weight: float) -> float:
    """An exponentially weighted running mean after one more ``value``."""
    return (1 - weight) * mean + weight * value
