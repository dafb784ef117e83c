"""Copy proposals (runtime/proposer.py) against a brute-force search, and on the kind of
text agents repeat."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from flare.runtime.proposer import CopyProposer


def latest_earlier(tokens: list[int], max_ngram: int, min_ngram: int) -> tuple[int | None, int]:
    """Where the continuation of the longest suffix n-gram (max..min) with an earlier
    occurrence starts, for its latest one, and n."""
    end = len(tokens)
    for n in range(min(max_ngram, end), min_ngram - 1, -1):
        suffix = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):  # occurrences ending before the history's end
            if tokens[start : start + n] == suffix:
                return start + n, n
    return None, 0


def brute_force(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The copy source replayed token by token (the proposer's rules, with a search of the
    whole history where it looks an n-gram up): it moves on while each token is the one it
    predicts, past a miss after a run as long as the new suffix's match as a substitution
    (remembered when seen twice), and is searched for
    (``latest_earlier``) otherwise."""
    source, run, subs, seen = None, 0, {}, {}
    for end in range(1, len(tokens) + 1):
        t = tokens[end - 1]
        if source is not None and subs.get(tokens[source], tokens[source]) == t:
            source, run = source + 1, run + 1
        elif source is not None and tokens[source] == t:
            del subs[t]
            seen.pop(t, None)
            source, run = source + 1, run + 1
        else:
            found, n = latest_earlier(tokens[:end], max_ngram, min_ngram)
            if source is not None and run and run >= n:
                if seen.get(tokens[source]) == t:
                    subs[tokens[source]] = t
                seen[tokens[source]] = t
                source, run = source + 1, 0
            else:
                source, run = found, 0
    if source is None:
        return []
    history = list(tokens)  # a source near the end copies on through the drafts
    for i in range(k):
        history.append(subs.get(history[source + i], history[source + i]))
    return history[len(tokens) :]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=60), st.integers(1, 6), st.integers(1, 3), st.integers(0, 3),
       st.integers(0, 60))
@example([0, 1, 1, 1, 0, 1, 1], 3, 2, 0, 3)  # the source moving on proposes [1, 0, 1], a re-search [0, 1, 1]
def test_proposals_equal_a_brute_force_search(tokens, k, min_ngram, extra, split):
    """Whatever the history and however it was appended (built at once, or in two parts),
    the proposal is the brute-force one; a small alphabet makes repeats and overlaps common."""
    max_ngram = min_ngram + extra
    whole = CopyProposer(tokens, max_ngram=max_ngram, min_ngram=min_ngram)
    parts = CopyProposer(tokens[:split], max_ngram=max_ngram, min_ngram=min_ngram)
    parts.extend(tokens[split:])
    want = brute_force(tokens, k, max_ngram, min_ngram)
    assert whole.propose(k) == want and parts.propose(k) == want


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=50), st.integers(1, 6))
# Learned substitutions 0 -> 1 and 1 -> 2 (a chain) with a repetition continued through its drafts.
@example([1, 0, 1, 3, 2, 0, 1, 3, 2, 1, 0, 1, 2, 1, 0, 2, 2, 1, 1, 2, 2, 2, 0, 3, 0, 3], 4)
def test_a_proposal_is_what_single_steps_would_propose_as_its_drafts_are_accepted(tokens, k):
    """propose(k) equals k rounds of propose(1), each draft then accepted (extend): the
    proposer's own state machine, not a restatement of it, decides every draft."""
    whole, steps = CopyProposer(tokens, max_ngram=3), CopyProposer(tokens, max_ngram=3)
    drafts = whole.propose(k)
    for _ in range(len(drafts)):
        (d,) = steps.propose(1)
        steps.extend([d])
    assert drafts == steps.tokens[len(tokens) :]
    assert len(drafts) in (0, k)


def test_a_rewritten_text_is_proposed_from_its_first_copy():
    """The model rewrites a 40-token passage it was given: once it has produced the first
    few tokens of it, every proposal is the passage's next tokens."""
    passage = list(range(1000, 1040))
    p = CopyProposer([1, 2, 3, *passage, 4, 5])
    assert p.propose(5) == []  # nothing repeats yet
    for i in range(2, 35):
        p.extend([passage[i - 2], passage[i - 1]] if i == 2 else [passage[i - 1]])
        assert p.propose(5) == passage[i : i + 5], i


def test_records_that_share_their_structure_are_copied_from_the_record_being_copied():
    """Re-emitting a list of records that share their keys (a JSON document): the record
    just written holds every key n-gram too, and the document's own records repeat each
    other's owners, but the proposals follow the record being copied, values included, and
    go on past a changed value."""
    keys = [[7, 8, 9], [10, 11], [12, 13, 14]]  # '"id": ', ', "owner": "', ', "points": '
    doc = []
    for i in range(8):
        doc += [*keys[0], 100 + i, *keys[1], 200 + i % 3, *keys[2], 300 + i]
    p = CopyProposer([1, 2, *doc, 3])
    p.extend(doc[:4])  # the model has begun the copy
    changed = doc.index(304)  # the model writes 999 instead of record 4's points, 304
    for at in range(4, len(doc)):
        if at != changed:  # (at the change, the document's value is proposed)
            assert p.propose(5)[: len(doc) - at] == doc[at : at + 5], at
        p.extend([999 if at == changed else doc[at]])


def test_a_consistent_substitution_is_learned_and_forgotten():
    """A passage re-emitted with one token always replaced (a document re-indented): the
    first two replacements are misses, then the replacement is proposed; when the copy
    writes the original token again, that is one miss and the pair is forgotten."""
    passage = [t for i in range(12) for t in (50, 1000 + 3 * i, 1001 + 3 * i, 1002 + 3 * i)]  # 50: the indent
    p = CopyProposer([1, 2, *passage, 3])
    p.extend(passage[:3])
    misses = []
    for at in range(3, len(passage)):
        t = 60 if passage[at] == 50 and at < 30 else passage[at]  # re-indented up to position 30
        if p.propose(1) != [t]:
            misses.append(at)
        p.extend([t])
    assert misses == [4, 8, 32], misses  # the first two indents, then the first original one again
    assert p.substitutions == {}


def test_bad_ngram_lengths_are_refused():
    import pytest

    with pytest.raises(ValueError):
        CopyProposer(max_ngram=2, min_ngram=3)


def _params(max_tokens: int):
    """Unfiltered sampling at temperature 1 (the speculation tests' requests)."""
    from flare.runtime.request import SamplingParams

    return SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0,
                          presence_penalty=0.0, frequency_penalty=0.0, seed=1, max_tokens=max_tokens)


def _copier(params):
    """A request whose pending token 3 ends ... 1 2 3, seen before followed by 4 5 6: it copies."""
    from flare.runtime.request import Request

    req = Request([1, 2, 3, 4, 5, 6, 1, 2], params)
    req.output = [3]
    return req


def test_speculation_adapts_drafts_and_backs_off():
    """runtime/speculation.py: drafts follow the request's history after its pending token;
    their number grows after full acceptance and falls to accepted + 1; a miss (nothing to
    copy, no room, or every draft rejected) skips the next 1, 2, 4 ... steps (at most
    MAX_BACKOFF) and an accepted draft resets it; the room caps drafts; log-probabilities or
    a grammar: none."""
    import msgspec

    from flare.runtime.request import Request
    from flare.runtime.speculation import MAX_BACKOFF, Speculation

    spec = Speculation(4)
    params = _params(100)
    req = _copier(params)  # pending: the history ends ... 1 2 3, seen before followed by 4 5 6

    def step(*tokens):  # a step completed: its tokens join the output
        req.output += list(tokens)

    assert spec.propose(req, 10) == [4, 5, 6, 1]
    assert spec.propose(req, 2) == [4, 5]  # the room caps it
    step(4, 5, 6, 1, 2)
    spec.observe(req, 4, 4)  # all accepted: stays at the ceiling of 4
    assert spec.propose(req, 10) == [3, 4, 5, 6]  # ... 6 1 2, seen before followed by 3 4 5 6
    step(3, 4, 7)
    spec.observe(req, 4, 2)  # two accepted: next time 3
    assert spec.propose(req, 10) == [6, 1, 2]  # 7 replaced the copy's 5: the copy goes on after it
    step(8)  # not 6: a second miss in a row, and ... 7 8 never occurred: nothing to copy
    spec.observe(req, 3, 0)  # all rejected: a miss: skips the next step, one draft next
    assert not spec.wants(req)
    step(9)  # the skipped one
    assert spec.wants(req) and spec.propose(req, 10) == []  # nothing to copy, a second miss: two steps
    step(1)
    assert not spec.wants(req)
    step(2)
    assert not spec.wants(req)
    step(3)  # ... 1 2 3: copies its latest earlier continuation, one draft
    assert spec.wants(req) and spec.propose(req, 10) == [4]
    step(5)
    spec.observe(req, 1, 0)  # rejected: a miss (the backoff doubles to 4)
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
    from flare.runtime.speculation import Speculation

    spec = Speculation(4)
    params = _params(100)
    req = _copier(params)
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


def test_the_decode_step_after_a_verify_step_charges_its_wait_to_the_verify_program():
    """A decode step right after a verify step starts on an idle device (it could not be
    submitted ahead): its excess over the steady decode time is the verify step's cost, in
    the verify program's mean with the weight the verify sample had, and out of decode's."""
    from flare.runtime.speculation import TIME_WEIGHT, Speculation

    spec = Speculation(4)
    spec.timed("decode.4", 10.0)
    spec.timed("decode.4", 10.0)
    spec.timed("verify.4", 15.0)
    spec.timed("decode.4", 13.0)  # 3 ms waiting for the verify step's outcome
    assert spec.step_ms == {"decode.4": 10.0, "verify.4": 18.0}
    spec.timed("decode.4", 13.0)  # a steady step again: decode's own
    assert spec.step_ms["decode.4"] == 10.0 + TIME_WEIGHT * 3.0
    spec.timed("verify.4", 18.0)
    spec.timed("decode.4", 8.0)  # faster than steady: charges nothing
    assert spec.step_ms["verify.4"] == 18.0 and spec.step_ms["decode.4"] == 10.6
    spec.timed("verify.4", 16.0)
    spec.timed("verify.4", 17.0)  # a verify step after a verify step: its own interval only
    spec.timed("decode.4", 12.6)
    want = 18.0 + TIME_WEIGHT * (16.0 - 18.0)
    want += TIME_WEIGHT * (17.0 - want) + TIME_WEIGHT * 2.0
    assert abs(spec.step_ms["verify.4"] - want) < 1e-9 and spec.step_ms["decode.4"] == 10.6
    spec.timed("verify.4", want)
    spec.other_step()  # a prefill chunk ran between: the decode step after it waited for that
    spec.timed("decode.4", 13.0)  # its own sample, nothing charged
    assert abs(spec.step_ms["verify.4"] - want) < 1e-9 and abs(spec.step_ms["decode.4"] - 11.08) < 1e-9


def test_a_batch_that_cannot_pay_for_a_verify_step_may_run_ahead():
    """may_verify (whether the scheduler must wait to decide the next step instead of
    submitting a decode step ahead): not while no request wants drafts; yes while the
    batch's programs are unmeasured; then only where the wanting requests' expected gain
    pays for the batch's verify step: one copier among four streams does not, four do."""
    from flare.runtime.request import Request
    from flare.runtime.speculation import REFRESH, Speculation

    spec = Speculation(4)
    params = _params(100)
    copier = _copier(params)
    others = [Request([10 + i, 20 + i, 30 + i], params) for i in range(3)]
    for r in others:
        r.output = [40]
        for _ in range(3):
            spec.miss(r)  # nothing to copy: backing off
    batch = [copier, *others]
    assert spec.may_verify(batch, "decode.4", "verify.4")  # nothing measured yet
    assert not spec.may_verify(others, "decode.4", "verify.4")  # nobody wants drafts
    spec.timed("decode.4", 10.0)
    spec.timed("verify.4", 20.0)
    spec.timed("decode.1", 10.0)
    spec.timed("verify.1", 12.0)
    spec.observe(copier, 4, 4)  # a run of four accepted: its gain is over 2.5 drafts a step
    spec.observe(copier, 4, 4)
    assert spec.wants(copier) and spec.may_verify([copier], "decode.1", "verify.1")
    assert not spec.may_verify(batch, "decode.4", "verify.4")  # 4 rows x (2 - 1) > its gain
    for r in others:  # all four copy: their gains together pay
        r.output = [1, 2, 3, 4, 5, 6, 1, 2, 3]
        spec.observe(r, 4, 4)
        spec.observe(r, 4, 4)
        spec._states[r.id].resume_at = 0
    assert spec.may_verify(batch, "decode.4", "verify.4")
    for r in others:
        spec._states[r.id].resume_at = 100  # back to backing off
    spec.timed("verify.4", 20.0)  # a verify step ran: the count of decisions against it restarts
    for _ in range(REFRESH - 1):  # each "no" is a decision against the verify program ...
        assert not spec.may_verify(batch, "decode.4", "verify.4")
    # ... and after REFRESH of them it re-measures, but three of the four rows have no drafts:
    # they wait for it within the fair-share budget only, which 20 ms of decode steps cannot pay.
    assert not spec.may_verify(batch, "decode.4", "verify.4")
    assert not spec.pays("decode.4", "verify.4", batch, [[1], [], [], []]) and spec.refused_for_share
    for _ in range(40):  # 400 ms of decode steps: 10 ms of budget, a verify step's excess
        spec.timed("decode.4", 10.0)
    assert spec.may_verify(batch, "decode.4", "verify.4")
    saved = spec._share_ms
    assert spec.pays("decode.4", "verify.4", batch, [[1], [], [], []])
    assert abs(saved - spec._share_ms - 10.0) < 1e-9  # charged its excess


def test_decode_tokens_the_proposal_predicted_grow_the_drafts():
    """A request cut to one draft (its verify steps rejected them) cannot pay for a verify
    step that costs 2.5 decode steps, whatever its rate: the decode tokens its proposal
    predicts grow its drafts again (shadow), up to the ceiling, their streaks its expected
    accepted run, and then it pays."""
    from flare.runtime.request import Request
    from flare.runtime.speculation import PRIOR_RUN, Speculation

    spec = Speculation(4)
    params = _params(100)
    req = Request([5, 7, 7], params)
    req.output = [7]
    spec.timed("decode.1", 10.0)
    spec.timed("verify.1", 25.0)
    assert spec.propose(req, 10) == [7, 7, 7, 7]  # ... 7 7: a repetition, copied on through the drafts
    spec.observe(req, 4, 0)  # rejected: one draft next
    spec.observe(req, 1, 0)
    state = spec._states[req.id]
    assert state.drafts == 1
    for _ in range(8):  # the repetition goes on under plain decode steps
        spec.shadow(req, 7)
        req.output.append(7)
    drafts = spec.propose(req, 10)
    assert state.drafts == 4 and drafts == [7, 7, 7, 7]
    assert state.run > PRIOR_RUN  # two streaks of 4 predicted tokens: the run a verify step would accept
    assert spec.pays("decode.1", "verify.1", [req], [drafts])


def test_requests_without_drafts_lose_at_most_their_fair_share_to_verify_steps():
    """A verify step that carries requests without drafts (bystanders) makes them wait its
    excess over a decode step: such steps run only on a budget of FAIR_SHARE of decode time,
    so bystanders lose about that share at most however much the copier gains; a batch whose
    every request drafts needs no budget."""
    from flare.runtime.request import Request
    from flare.runtime.speculation import FAIR_SHARE, SHARE_WINDOW, Speculation

    spec = Speculation(4)
    params = _params(10_000)
    copier = _copier(params)
    others = [Request([10 + i, 20 + i, 30 + i], params) for i in range(3)]
    batch = [copier, *others]
    spec.timed("decode.4", 10.0)
    spec.timed("verify.4", 12.0)  # 2 ms more than a decode step, for every row
    for _ in range(3):
        spec.observe(copier, 4, 4)  # the copier's expected gain pays for the batch's verify step
    drafts = [[4, 5, 6, 1], [], [], []]
    # The budget starts from the decode steps seen so far: 0.25 ms, not the 2 ms a step costs.
    assert not spec.pays("decode.4", "verify.4", batch, drafts)
    for r in others:
        r.output = [40]
        spec.miss(r)
    assert not spec.may_verify(batch, "decode.4", "verify.4")  # so the batch runs ahead meanwhile
    for _ in range(8):
        spec.timed("decode.4", 10.0)
    assert spec.may_verify(batch, "decode.4", "verify.4")  # 2.25 ms saved up
    assert spec.pays("decode.4", "verify.4", batch, drafts)
    assert not spec.pays("decode.4", "verify.4", batch, drafts)  # spent
    assert spec.pays("decode.4", "verify.4", batch, [[4]] * 4)  # nobody stands by: the gain decides
    # Over a long run the bystanders' time goes to verify steps at FAIR_SHARE at most.
    plain = verified = 0
    for _ in range(5000):
        if spec.pays("decode.4", "verify.4", batch, drafts):
            spec.timed("verify.4", 12.0)
            verified += 1
        else:
            plain += 1
        spec.timed("decode.4", 10.0)  # the step after (or instead)
    lost = verified * 2.0 / ((plain + verified) * 10.0 + verified * 2.0)
    assert verified > 0 and FAIR_SHARE * 0.8 < lost <= FAIR_SHARE * 1.01
    # Saving up is bounded: a long spell without verify steps does not buy a burst of them.
    for _ in range(10 * SHARE_WINDOW):
        spec.timed("decode.4", 10.0)
    burst = 0
    while spec.pays("decode.4", "verify.4", batch, drafts):
        burst += 1
    assert abs(burst - FAIR_SHARE * SHARE_WINDOW * 10.0 / 2.0) <= 1  # 12.5 steps of 2 ms, to rounding


def test_re_measuring_verify_steps_with_bystanders_are_paid_from_the_fair_share():
    """A verify step that re-measures the cost (after REFRESH decisions against the program)
    and carries a request without drafts is charged to the fair-share budget like any
    other: with a verify step 20 ms over a decode step, the budget pays for one per 80
    decode steps, so decisions against it reach REFRESH in between; uncharged, those
    re-measuring steps would have cost the bystander another 3 % on top of FAIR_SHARE."""
    from flare.runtime.request import Request
    from flare.runtime.speculation import FAIR_SHARE, Speculation

    spec = Speculation(8)
    copier = _copier(_params(100_000))
    batch = [copier, Request([10, 20], _params(100_000))]
    drafts = [[4, 5, 6, 1, 4, 5, 6, 1], []]
    spec.timed("decode.2", 10.0)
    spec.timed("verify.2", 30.0)
    for _ in range(20):
        spec.observe(copier, 8, 8)  # its expected gain (about 8 drafts) pays for two rows at 2 steps each
    verified = total = 0
    for _ in range(20_000):
        if spec.pays("decode.2", "verify.2", batch, drafts):
            spec.timed("verify.2", 30.0)
            verified, total = verified + 1, total + 30.0
        spec.timed("decode.2", 10.0)
        total += 10.0
    lost = verified * 20.0 / total
    assert verified > 0 and FAIR_SHARE * 0.8 < lost <= FAIR_SHARE, (verified, lost)


def test_the_fair_share_budget_keeps_no_debt_and_its_cap_follows_the_running_decode_time():
    """The budget never goes into debt (a verify step it cannot pay for does not run, one
    that re-measures after REFRESH decisions included); bystanders lose about
    FAIR_SHARE; a refusal for the budget alone is flagged (the scheduler then does not back
    the drafts off), one for the cost is not; the saved budget is capped by the running
    decode time, so one fast step of another batch size does not wipe it out."""
    from flare.runtime.request import Request
    from flare.runtime.speculation import FAIR_SHARE, SHARE_WINDOW, Speculation

    spec = Speculation(4)
    params = _params(10_000)
    copier = _copier(params)
    batch = [copier, Request([10, 20], params)]
    drafts = [[4, 5, 6, 1], []]
    spec.timed("decode.2", 10.0)
    spec.timed("verify.2", 25.0)  # 15 ms more than a decode step: the copier's gain pays for it
    for _ in range(20):
        spec.observe(copier, 4, 4)
    verified = 0
    for _ in range(3000):
        if spec.pays("decode.2", "verify.2", batch, drafts):
            verified += 1
            spec.timed("verify.2", 25.0)
            assert not spec.pays("decode.2", "verify.2", batch, drafts) and spec.refused_for_share
        spec.timed("decode.2", 10.0)
        assert spec._share_ms >= 0.0
    lost = verified * 15.0 / (3000 * 10.0 + verified * 15.0)
    assert verified > 0 and lost <= FAIR_SHARE
    assert not spec.pays("decode.2", "verify.2", batch, [[4], [4]]) and not spec.refused_for_share  # cost
    for _ in range(2 * SHARE_WINDOW):
        spec.timed("decode.2", 10.0)
    full = spec._share_ms
    assert abs(full - FAIR_SHARE * SHARE_WINDOW * 10.0) < 1e-6
    spec.timed("decode.1", 1.0)  # a fast step of another batch size: the cap is the running maximum
    assert spec._share_ms == full
