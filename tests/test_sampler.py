"""The sampler (``flare.prepare.sampling``), called directly with torch tensors."""

from __future__ import annotations

import math

import pytest
import torch

from flare.core.manifest import HIST_PROMPT_BIT
from flare.prepare.sampling import (REJECT_STREAM, apply_penalties, apply_token_mask, filtered, sample, scores,
                                    uniform, verify_chain, verify_draft)

# A row of sampling parameters: everything ``sample`` takes besides logits and vocab.
FIELDS = ("hist", "temperature", "top_k", "top_p", "min_p", "repetition", "presence", "frequency", "seed", "counter")


def rows(n: int, V: int, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition=1.0, presence=0.0,
         frequency=0.0, seed=0, counter=None, hist=None) -> dict[str, torch.Tensor]:
    """n rows with the same parameters; counters 0..n-1 unless given."""
    return {
        "hist": torch.zeros(n, V, dtype=torch.int32) if hist is None else hist.expand(n, V).clone(),
        "temperature": torch.full((n,), temperature, dtype=torch.float32),
        "top_k": torch.full((n,), top_k, dtype=torch.int32),
        "top_p": torch.full((n,), top_p, dtype=torch.float32),
        "min_p": torch.full((n,), min_p, dtype=torch.float32),
        "repetition": torch.full((n,), repetition, dtype=torch.float32),
        "presence": torch.full((n,), presence, dtype=torch.float32),
        "frequency": torch.full((n,), frequency, dtype=torch.float32),
        "seed": torch.full((n,), seed, dtype=torch.int64),
        "counter": (torch.arange(n, dtype=torch.int64) if counter is None
                    else torch.full((n,), counter, dtype=torch.int64)),
    }


def draw(logits: torch.Tensor, p: dict, sampling_vocab: int | None = None) -> torch.Tensor:
    n = p["seed"].shape[0]
    lg = logits.expand(n, -1) if logits.dim() == 1 else logits
    return sample(lg, p["hist"], temperature=p["temperature"], top_k=p["top_k"], top_p=p["top_p"],
                  min_p=p["min_p"], repetition=p["repetition"], presence=p["presence"], frequency=p["frequency"],
                  seed=p["seed"], counter=p["counter"], sampling_vocab=sampling_vocab or lg.shape[1])


def random_row(g: torch.Generator, V: int) -> tuple[torch.Tensor, dict]:
    """A logits row and parameters with every filter and penalty enabled."""
    logits = torch.randn(V, generator=g) * 3
    hist = torch.randint(0, 3, (V,), generator=g, dtype=torch.int32)
    hist |= (torch.rand(V, generator=g) < 0.3).int() * HIST_PROMPT_BIT
    u = lambda lo, hi: lo + (hi - lo) * float(torch.rand(1, generator=g))  # noqa: E731
    p = rows(1, V, temperature=u(0.3, 1.5), top_k=int(torch.randint(1, V + 1, (1,), generator=g)),
             top_p=u(0.5, 1.0), min_p=u(0.0, 0.1), repetition=u(1.0, 1.5), presence=u(-0.5, 0.5),
             frequency=u(-0.3, 0.3), seed=int(torch.randint(-(1 << 62), 1 << 62, (1,), generator=g)),
             counter=int(torch.randint(0, 1 << 40, (1,), generator=g)), hist=hist[None])
    return logits, p


def null_row(V: int) -> tuple[torch.Tensor, dict]:
    """What a padded row carries: the null slot's all-zero parameters."""
    p = rows(1, V, temperature=0.0, top_k=0, top_p=0.0, min_p=0.0, repetition=0.0, seed=0, counter=0)
    return torch.zeros(V), p


def stack(parts: list[tuple[torch.Tensor, dict]]) -> tuple[torch.Tensor, dict]:
    return (torch.stack([lg for lg, _ in parts]),
            {k: torch.cat([p[k] for _, p in parts]) for k in FIELDS})


# ---------------------------------------------------------------------------
# (a) a row's draw depends on its logits, parameters, seed and counter only


def test_batch_position_and_neighbours_never_change_a_draw():
    V = 96
    g = torch.Generator().manual_seed(1234)
    pool = [random_row(g, V) for _ in range(48)] + [null_row(V) for _ in range(8)]
    checked = 0
    for trial in range(200):
        logits, p = random_row(g, V)
        alone = int(draw(logits[None], p)[0])
        for B in range(1, 9):
            pos = int(torch.randint(0, B, (1,), generator=g))
            parts = [pool[int(i)] for i in torch.randint(0, len(pool), (B,), generator=g)]
            parts[pos] = (logits, p)
            lg, pp = stack(parts)
            got = draw(lg, pp)
            assert int(got[pos]) == alone, f"trial {trial}: batch {B}, position {pos}: {int(got[pos])} != {alone}"
            checked += 1
    assert checked == 200 * 8


def test_streams_differ_across_seeds_and_counters():
    # The (seed, counter) -> uniform map is not degenerate: distinct inputs give distinct numbers.
    seeds = torch.tensor([0, 1, -1, 1 << 40, -(1 << 62)], dtype=torch.int64).repeat_interleave(200)
    counters = torch.arange(200, dtype=torch.int64).repeat(5) + (1 << 33)
    u = uniform(seeds, counters)
    assert u.dtype == torch.float32 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert len(set(u.tolist())) == 1000
    assert torch.equal(uniform(seeds, counters), u)


# ---------------------------------------------------------------------------
# (b) the empirical distribution


def chi2_threshold(dof: int, alpha: float) -> float:
    """x with P(X > x) = alpha for X ~ chi-square(dof), dof even, from the closed form
    P(X > x) = exp(-x/2) * sum_{j < dof/2} (x/2)^j / j!  (solved by bisection)."""
    assert dof % 2 == 0

    def sf(x):
        t = x / 2
        return math.exp(-t) * sum(t**j / math.factorial(j) for j in range(dof // 2))

    lo, hi = 0.0, 1000.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sf(mid) > alpha else (lo, mid)
    return hi


def pearson(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = float(counts.sum())
    expected = probs * n
    return float(((counts.double() - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature,seed", [(1.0, 7), (0.6, 123456789), (1.7, -5)])
def test_distribution_matches_softmax_over_temperature(temperature, seed):
    """N = 40,000 draws (counters 0..N-1 of one seed) over a 5-token vocabulary.

    Bound: under the null hypothesis (draws are independent samples of
    softmax(logits / T)), Pearson's statistic X^2 = sum (O - E)^2 / E is
    chi-square with V - 1 = 4 degrees of freedom (every E >= 1,000, so the
    asymptotic law is accurate). We reject above x with P(X^2 > x) = 1e-9,
    x = 47.8 from the closed-form survival function e^(-x/2)(1 + x/2): a correct
    sampler fails with probability 1e-9, while a sampler off by a 1 % shift of
    mass between two tokens would give X^2 ~ N * 0.01^2 * (1/p_i + 1/p_j) > 48.
    The negative control checks the test has that power: the same counts
    against softmax(logits) at T = 1 +/- 0.3 must exceed the bound.
    """
    V, N = 5, 40_000
    logits = torch.tensor([1.0, 0.2, -0.5, 0.7, -1.3])
    counts = torch.bincount(draw(logits, rows(N, V, temperature=temperature, seed=seed)), minlength=V)
    probs = torch.softmax(logits.double() / temperature, dim=0)
    assert float((probs * N).min()) >= 400
    bound = chi2_threshold(V - 1, 1e-9)
    assert 47.5 < bound < 48.0
    x2 = pearson(counts, probs)
    assert x2 < bound, f"X^2 = {x2:.1f} >= {bound:.1f}: counts {counts.tolist()} vs expected {(probs * N).tolist()}"
    wrong = torch.softmax(logits.double() / (temperature + 0.3), dim=0)
    assert pearson(counts, wrong) > bound


def test_distribution_after_top_k_is_renormalised():
    """top_k = 3 of 5 tokens: draws follow the top three probabilities renormalised.
    Same bound construction with 3 - 1 = 2 degrees of freedom: P(X^2 > x) = e^(-x/2)."""
    V, N = 5, 30_000
    logits = torch.tensor([1.0, 0.2, -0.5, 0.7, -1.3])
    counts = torch.bincount(draw(logits, rows(N, V, top_k=3, seed=99)), minlength=V)
    assert counts[2] == 0 and counts[4] == 0
    kept = torch.tensor([0, 3, 1])
    probs = torch.softmax(logits.double()[kept], dim=0)
    bound = chi2_threshold(2, 1e-9)
    assert abs(bound - 2 * math.log(1e9)) < 1e-6
    assert pearson(counts[kept], probs) < bound


# ---------------------------------------------------------------------------
# (c) filters


def sampled_set(logits: torch.Tensor, N: int = 4000, **kw) -> set[int]:
    """Tokens drawn over N counters. Every kept token in these cases has renormalised
    probability >= 0.04 (>= 0.002 where N = 20,000), so the chance that one is never
    drawn is below 0.96^4000 ~ 1e-71 (0.998^20000 ~ 1e-17)."""
    return set(draw(logits, rows(N, logits.shape[0], **kw)).tolist())


def test_top_k_keeps_exactly_the_k_most_likely():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 1.9, 0.0, -3.0, 1.0])
    order = [1, 4, 3, 7, 0, 5, 2, 6]  # descending
    for k in (1, 2, 3, 4):
        # Low temperature would starve the tail; T = 1 keeps every kept token >= 0.05.
        assert sampled_set(logits, top_k=k, seed=k) == set(order[:k])
    assert sampled_set(logits, top_k=0, seed=3, N=20000) == set(range(8))  # 0 disables
    assert sampled_set(logits, top_k=100, seed=3, N=20000) == set(range(8))  # k > V keeps all


def test_top_k_keeps_exact_ties_at_the_threshold():
    logits = torch.tensor([3.0, 1.0, 3.0, 0.0, 3.0, 1.0])
    assert sampled_set(logits, top_k=1, seed=1) == {0, 2, 4}
    assert sampled_set(logits, top_k=2, seed=2) == {0, 2, 4}
    assert sampled_set(logits, top_k=4, seed=3) == {0, 1, 2, 4, 5}


def test_top_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()  # probabilities 0.5, 0.3, 0.15, 0.05
    # Smallest prefix whose mass reaches top_p: mass before each token is 0, 0.5, 0.8, 0.95.
    assert sampled_set(logits, top_p=0.4, seed=1) == {0}
    assert sampled_set(logits, top_p=0.55, seed=1) == {0, 1}
    assert sampled_set(logits, top_p=0.75, seed=1) == {0, 1}
    assert sampled_set(logits, top_p=0.85, seed=1) == {0, 1, 2}
    assert sampled_set(logits, top_p=0.97, seed=1, N=20000) == {0, 1, 2, 3}
    # Temperature applies first: at T = 0.5 the probabilities are 0.685, 0.247, 0.062, 0.007,
    # so top_p = 0.9 keeps two tokens where T = 1 keeps three.
    assert sampled_set(logits, top_p=0.9, seed=2) == {0, 1, 2}
    assert sampled_set(logits, top_p=0.9, temperature=0.5, seed=2) == {0, 1}


def test_min_p():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    # Keeps p >= min_p * p_max (p_max = 0.5).
    assert sampled_set(logits, min_p=0.05, seed=1, N=20000) == {0, 1, 2, 3}
    assert sampled_set(logits, min_p=0.25, seed=1) == {0, 1, 2}
    assert sampled_set(logits, min_p=0.55, seed=1) == {0, 1}
    assert sampled_set(logits, min_p=0.7, seed=1) == {0}


def test_filters_combine_as_an_intersection():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert sampled_set(logits, top_k=3, top_p=0.75, seed=1) == {0, 1}
    assert sampled_set(logits, top_k=2, min_p=0.05, seed=1) == {0, 1}
    assert sampled_set(logits, top_k=3, top_p=0.97, min_p=0.55, seed=1) == {0, 1}


# ---------------------------------------------------------------------------
# (d) penalties


def test_penalties_change_logits_exactly_as_documented():
    """Repetition divides positive / multiplies negative logits of every token seen in
    prompt or output; presence subtracts once and frequency per occurrence, for output
    tokens only. The prompt bit never counts as an occurrence. Dyadic values: exact."""
    P = HIST_PROMPT_BIT
    logits = torch.tensor([[2.0, -2.0, 3.0, -1.0, 0.5, 1.0, 0.0, -0.5]])
    hist = torch.tensor([[P, P + 2, 3, 0, 1, 0, P, P + 1]], dtype=torch.int32)
    out = apply_penalties(logits, hist, repetition=torch.tensor([2.0]), presence=torch.tensor([0.5]),
                          frequency=torch.tensor([0.25]))
    expected = torch.tensor([[
        2.0 / 2,  # prompt only: repetition
        -2.0 * 2 - 0.5 - 2 * 0.25,  # prompt + 2 outputs, negative logit
        3.0 / 2 - 0.5 - 3 * 0.25,  # 3 outputs
        -1.0,  # unseen
        0.5 / 2 - 0.5 - 0.25,  # 1 output
        1.0,  # unseen
        0.0,  # prompt, zero logit: unchanged by repetition
        -0.5 * 2 - 0.5 - 0.25,  # prompt + 1 output
    ]])
    assert torch.equal(out, expected)
    # Neutral parameters change nothing, bit for bit.
    neutral = apply_penalties(logits, hist, torch.tensor([1.0]), torch.tensor([0.0]), torch.tensor([0.0]))
    assert torch.equal(neutral, logits)


def test_penalties_apply_inside_sample():
    """top_k = 1 makes the draw the argmax of the penalised logits."""
    P = HIST_PROMPT_BIT
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0])
    one = lambda **kw: int(draw(logits, rows(1, 4, top_k=1, **kw))[0])  # noqa: E731
    assert one() == 0
    hist = torch.tensor([[P, 0, 0, 0]], dtype=torch.int32)
    assert one(hist=hist, repetition=1.1) == 0  # 3 / 1.1 = 2.73 still the largest
    assert one(hist=hist, repetition=1.5) == 1  # 3 / 1.5 = 2.0 < 2.5
    assert one(hist=hist, presence=2.0) == 0  # presence ignores prompt tokens
    hist = torch.tensor([[1, 0, 0, 0]], dtype=torch.int32)
    assert one(hist=hist, presence=0.6) == 1  # 3 - 0.6 = 2.4 < 2.5
    hist = torch.tensor([[2, 3, 0, 0]], dtype=torch.int32)
    assert one(hist=hist, frequency=0.6) == 2  # 3 - 1.2 = 1.8 and 2.5 - 1.8 = 0.7 against 2.0
    hist = torch.tensor([[1, 3, 0, 0]], dtype=torch.int32)
    assert one(hist=hist, frequency=-0.3) == 1  # negative frequency rewards repetition: 3.3 vs 3.4


# ---------------------------------------------------------------------------
# (e) padded vocabularies


def test_tokens_beyond_sampling_vocab_are_never_sampled():
    V, SV, N = 12, 7, 5000
    logits = torch.zeros(V)
    logits[SV:] = 50.0  # padded ids carry the largest logits
    p = rows(N, V, seed=31)
    toks = draw(logits, p, sampling_vocab=SV)
    assert int(toks.max()) < SV and set(toks.tolist()) == set(range(SV))
    # Identical to sampling from the truncated row: the padded columns are not even seen.
    assert torch.equal(toks, draw(logits[:SV], {**p, "hist": p["hist"][:, :SV]}))


# ---------------------------------------------------------------------------
# (f) the null slot


def test_null_slot_row_yields_an_in_range_index():
    V = 50
    for logits in (torch.zeros(V), torch.randn(V, generator=torch.Generator().manual_seed(0)) * 30,
                   torch.full((V,), -1e30)):
        lg, p = null_row(V)
        tok = draw(logits[None], p)
        assert tok.shape == (1,) and 0 <= int(tok[0]) < V
    # Zero temperature keeps only the maximum: the null row is well defined.
    logits = torch.arange(V, dtype=torch.float32)
    _, p = null_row(V)
    assert int(draw(logits[None], p)[0]) == V - 1
    # Padded rows of a real batch: live rows are unaffected (see the batch test), the
    # padded ones stay in range even with a sampling vocabulary below the logits width.
    lg, pp = stack([null_row(V) for _ in range(4)])
    toks = draw(lg, pp, sampling_vocab=30)
    assert ((toks >= 0) & (toks < 30)).all()


# ---------------------------------------------------------------------------
# (g) grammar masks


def pack(allowed: set[int], V: int) -> torch.Tensor:
    """The host's bitmask layout (llguidance's): bit j of int32 word w = token 32 * w + j."""
    words = [0] * (-(-V // 32))
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def test_token_mask_keeps_exactly_the_allowed_tokens():
    V = 70  # three words, the last one partial
    allowed = {0, 5, 31, 32, 63, 69}  # bit 31 is the int32 sign bit
    logits = torch.arange(V, dtype=torch.float32)[None].repeat(3, 1)
    words = torch.stack([pack(allowed, V), pack(set(), V), pack(set(range(V)), V)])
    on = torch.tensor([1, 0, 1], dtype=torch.int32)
    out = apply_token_mask(logits, words, on)
    assert [i for i in range(V) if out[0, i] != float("-inf")] == sorted(allowed)
    assert torch.equal(out[0, sorted(allowed)], logits[0, sorted(allowed)])
    assert torch.equal(out[1], logits[1])  # mask off: the (empty) row is ignored
    assert torch.equal(out[2], logits[2])  # everything allowed


def test_masked_draws_follow_the_renormalised_distribution():
    """With penalties, temperature and top-k after the mask, draws land only on allowed
    tokens, in proportion to their softmax restricted to the allowed set."""
    V, N = 40, 20000
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(V, generator=g)
    allowed = {3, 17, 31, 38}
    masked = apply_token_mask(logits[None], pack(allowed, V)[None], torch.ones(1, dtype=torch.int32))[0]
    p = rows(N, V, seed=5, temperature=0.7, top_k=30, repetition=1.3)
    toks = draw(masked, p)
    assert set(toks.tolist()) == allowed
    expected = torch.softmax(logits[sorted(allowed)] / 0.7, dim=0)
    freq = torch.tensor([(toks == t).sum().item() / N for t in sorted(allowed)])
    assert float((freq - expected).abs().max()) < 0.02


# ---------------------------------------------------------------------------
# (e) speculative verification (issue 20's acceptance rule)


def verify_rows(logits: torch.Tensor, p: dict, proposal: int) -> tuple[torch.Tensor, torch.Tensor]:
    """verify_draft over N rows sharing parameters: the two uniforms per row come from the
    row's counter on two seeds (independent hash streams)."""
    n = p["seed"].shape[0]
    x = scores(logits.expand(n, -1), p["hist"], p["temperature"], p["repetition"], p["presence"], p["frequency"],
               logits.shape[0])
    return verify_draft(x, p["top_k"], p["top_p"], p["min_p"], torch.full((n,), proposal, dtype=torch.int64),
                        uniform(p["seed"], p["counter"]), uniform(p["seed"] ^ REJECT_STREAM, p["counter"]))


@pytest.mark.parametrize("proposal,filters", [
    (1, {}),  # a likely proposal
    (4, {}),  # an unlikely one
    (0, {"temperature": 0.7, "repetition": 1.3, "presence": 0.4}),  # with penalties on tokens 0 and 2
    (3, {"top_k": 3, "top_p": 0.9, "min_p": 0.05}),  # inside the filtered set
    (4, {"top_k": 3}),  # outside it: never accepted, the draw follows the filtered distribution
])
def test_verification_keeps_the_sampling_distribution_exact(proposal, filters):
    """N = 40,000 rows (counters 0..N-1) verify one fixed proposal: the tokens that come out
    must follow the filtered, penalised, tempered distribution p whatever the proposal
    (Pearson chi-square against p at P = 1e-9, as above), and the proposal must be accepted
    at rate p(proposal) (within 6 binomial standard deviations). A rule that accepted and
    then drew from p unchanged would put (1 - p(x)) p(x) extra mass on x and fail."""
    V, N = 5, 40_000
    logits = torch.tensor([1.0, 0.2, -0.5, 0.7, -1.3])
    hist = torch.tensor([HIST_PROMPT_BIT, 0, 2, 0, 0], dtype=torch.int32)
    p = rows(N, V, seed=31, hist=hist, **filters)
    tokens, accepted = verify_rows(logits, p, proposal)
    # p from the same scores and filters, computed independently of the rule under test
    x = scores(logits[None], hist[None], p["temperature"][:1], p["repetition"][:1], p["presence"][:1],
               p["frequency"][:1], V)
    kept, si, _ = filtered(x, p["top_k"][:1], p["top_p"][:1], p["min_p"][:1])
    probs = torch.zeros(V, dtype=torch.float64).index_put_((si[0],), kept[0].double())
    probs /= probs.sum()
    support = probs > 0
    counts = torch.bincount(tokens, minlength=V)
    assert (counts[~support] == 0).all()
    bound = chi2_threshold(int(support.sum()) - 1 + (int(support.sum()) - 1) % 2, 1e-9)
    assert pearson(counts[support], probs[support]) < bound, (counts.tolist(), (probs * N).tolist())
    rate, want = accepted.double().mean().item(), probs[proposal].item()
    assert abs(rate - want) <= 6 * math.sqrt(max(want * (1 - want), 1e-12) / N) + 1e-12, (rate, want)
    assert torch.equal(tokens[accepted], torch.full_like(tokens[accepted], proposal))
    assert not (tokens[~accepted] == proposal).any()  # a rejected proposal is never drawn again
    if probs[proposal] > 0:  # the test's power: drawing from p unchanged after a rejection fails it
        naive = torch.where(accepted, tokens, draw(logits, {**p, "seed": p["seed"] + 7}))  # an independent draw
        assert pearson(torch.bincount(naive, minlength=V)[support], probs[support]) > bound


def test_verification_rows_are_independent_of_their_batch():
    """A row's verdict depends on its own row only: the same row inside a batch of other
    rows and alone gives the same token and verdict."""
    g = torch.Generator().manual_seed(4)
    V = 12
    logits = torch.randn(6, V, generator=g)
    p = rows(6, V, top_k=4, temperature=0.8, seed=2)
    args = lambda sl: (logits[sl], p["top_k"][sl], p["top_p"][sl], p["min_p"][sl],  # noqa: E731
                       torch.arange(6)[sl] % V, uniform(p["seed"][sl], p["counter"][sl]),
                       uniform(p["seed"][sl] + 1, p["counter"][sl]))
    both = verify_draft(*args(slice(0, 6)))
    for i in range(6):
        one = verify_draft(*args(slice(i, i + 1)))
        assert one[0].item() == both[0][i].item() and one[1].item() == both[1][i].item()


SAMP = ("temperature", "top_k", "top_p", "min_p", "repetition", "presence", "frequency")


def chain(logits: torch.Tensor, p: dict, drafts, count, *, stop_ids=None, generated=0, max_new=1000):
    """verify_chain over N rows sharing parameters and per-position logits ``[W, V]``."""
    n = p["seed"].shape[0]
    W, V = logits.shape
    d = torch.as_tensor(drafts, dtype=torch.int64).reshape(1, W - 1).expand(n, -1)
    stops = torch.as_tensor(stop_ids if stop_ids is not None else [-1]).reshape(1, -1).expand(n, -1)
    return verify_chain(logits[None].expand(n, -1, -1), d, torch.full((n,), count), torch.ones(n, dtype=torch.bool),
                        p["hist"], {k: p[k] for k in SAMP}, p["seed"], p["counter"], stops,
                        torch.full((n,), generated), torch.full((n,), max_new), V)


def _probs(logits_row: torch.Tensor, hist_row: torch.Tensor, p: dict) -> torch.Tensor:
    """The filtered, renormalised distribution of one position, computed with the sampler's pieces."""
    V = logits_row.shape[0]
    x = scores(logits_row[None], hist_row[None], *(p[k][:1] for k in ("temperature", "repetition", "presence",
                                                                         "frequency")), V)
    kept, si, _ = filtered(x, p["top_k"][:1], p["top_p"][:1], p["min_p"][:1])
    probs = torch.zeros(V, dtype=torch.float64).index_put_((si[0],), kept[0].double())
    return probs / probs.sum()


def test_a_chain_without_drafts_is_a_decode_step():
    """count 0: one token, ordinary decode's draw (same counter, same stream), and the
    histogram gains it; counts 1 and 2 with drafts that cannot be accepted (filtered out)
    still emit exactly one token per row."""
    g = torch.Generator().manual_seed(5)
    V, N = 16, 64
    logits = torch.randn(3, V, generator=g) * 2
    p = rows(N, V, temperature=0.9, top_k=6, presence=0.3, seed=17)
    tokens, emitted, hist = chain(logits, p, [0, 0], 0)
    assert emitted.tolist() == [1] * N and (tokens[:, 1:] == -1).all()
    assert torch.equal(tokens[:, 0], draw(logits[0], p))
    assert torch.equal(hist - p["hist"], torch.nn.functional.one_hot(tokens[:, 0], V).int())
    worst = int(torch.argmin(logits[0]))  # outside the top 6: never accepted
    for count in (1, 2):
        _, emitted, _ = chain(logits, p, [worst, worst], count)
        assert emitted.tolist() == [1] * N


@pytest.mark.parametrize("filters", [
    {"temperature": 1.0},
    {"temperature": 0.8, "repetition": 1.3, "presence": 0.5, "frequency": 0.4},  # penalties see the accepted draft
    {"top_k": 4, "top_p": 0.9, "min_p": 0.05},
])
def test_a_verified_chain_samples_each_position_exactly(filters):
    """N = 40,000 rows verify drafts (d0, d1) over two positions with fixed logits, then a
    third position samples. Position 0's token follows p0 (chi-square at P = 1e-9) and is
    d0 at rate p0(d0); where d0 was accepted, position 1's token follows p1 with the
    histogram counting d0 (presence and frequency penalties move it), and only those rows
    go on; a rejected row emits its one token. The test fails a chain whose penalties
    ignore the step's earlier tokens (the penalised case)."""
    V, N = 6, 40_000
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.7, -1.3, 0.1], [0.3, 1.1, -0.2, 0.9, 0.0, -0.6],
                           [0.0, 0.5, 0.5, -0.5, 0.2, 0.1]])
    hist = torch.tensor([HIST_PROMPT_BIT, 0, 2, 0, 0, 0], dtype=torch.int32)
    p = rows(N, V, seed=23, hist=hist, **filters)
    d0, d1 = 0, 3
    tokens, emitted, _ = chain(logits, p, [d0, d1], 2)
    p0 = _probs(logits[0], hist, p)
    acc0 = tokens[:, 0] == d0
    assert torch.equal(emitted[~acc0], torch.ones_like(emitted[~acc0]))
    bound = lambda probs: chi2_threshold(int((probs > 0).sum()) - 1 + (int((probs > 0).sum()) - 1) % 2, 1e-9)  # noqa
    support = p0 > 0
    assert pearson(torch.bincount(tokens[:, 0], minlength=V)[support], p0[support]) < bound(p0)
    after = hist.clone()
    after[d0] += 1
    p1 = _probs(logits[1], after, p)
    t1 = tokens[acc0, 1]
    support = p1 > 0
    assert (t1 >= 0).all() and pearson(torch.bincount(t1, minlength=V)[support], p1[support]) < bound(p1)
    rate = (t1 == d1).double().mean().item()
    assert abs(rate - p1[d1].item()) <= 6 * math.sqrt(p1[d1].item() * (1 - p1[d1].item()) / len(t1)) + 1e-12
    both = acc0 & (tokens[:, 1] == d1)
    assert torch.equal(emitted[both], torch.full_like(emitted[both], 3)) and (tokens[both, 2] >= 0).all()
    if filters.get("presence"):  # the power: p1 without d0 in the histogram is another distribution
        assert pearson(torch.bincount(t1, minlength=V)[support], _probs(logits[1], hist, p)[support]) > bound(p1)


def test_a_chain_ends_at_a_stop_id_and_at_max_new():
    """Greedy (temperature near 0): drafts equal to the argmax are all accepted and the
    bonus position samples; an accepted stop id ends the chain after itself; max_new ends
    it at the limit; a wrong draft at position j emits j + 1 tokens, the last the argmax."""
    logits = torch.tensor([[0.0, 5.0, 0.0, 0.0], [0.0, 0.0, 5.0, 0.0], [5.0, 0.0, 0.0, 0.0],
                           [0.0, 0.0, 0.0, 5.0]])
    p = rows(1, 4, temperature=1e-6, seed=3)
    tokens, emitted, _ = chain(logits, p, [1, 2, 0], 3)
    assert tokens.tolist() == [[1, 2, 0, 3]] and emitted.tolist() == [4]
    assert chain(logits, p, [1, 2, 0], 3, stop_ids=[2])[0].tolist() == [[1, 2, -1, -1]]
    assert chain(logits, p, [1, 2, 0], 3, generated=8, max_new=10)[0].tolist() == [[1, 2, -1, -1]]
    for j in range(3):
        wrong = [1, 2, 0]
        wrong[j] = 3
        tokens, emitted, _ = chain(logits, p, wrong, 3)
        assert emitted.tolist() == [j + 1] and tokens[0, : j + 1].tolist() == [1, 2, 0][: j + 1]


def test_chain_rows_are_independent_of_their_batch():
    g = torch.Generator().manual_seed(8)
    V, B, W = 10, 5, 3
    logits = torch.randn(B, W, V, generator=g) * 2
    p = rows(B, V, temperature=0.7, top_p=0.9, frequency=0.2, seed=4)
    drafts = torch.randint(0, V, (B, W - 1), generator=g)
    count = torch.tensor([0, 1, 2, 2, 1])
    args = lambda sl: (logits[sl], drafts[sl], count[sl], torch.ones(B, dtype=torch.bool)[sl], p["hist"][sl],  # noqa
                       {k: p[k][sl] for k in SAMP}, p["seed"][sl], p["counter"][sl],
                       torch.full((B, 1), -1)[sl], torch.zeros(B)[sl], torch.full((B,), 100)[sl], V)
    both = verify_chain(*args(slice(0, B)))
    for i in range(B):
        one = verify_chain(*args(slice(i, i + 1)))
        assert all(torch.equal(a, b[i : i + 1]) for a, b in zip(one, both))


def _chain_position_by_position(logits, drafts, count, live, hist, samp, seed, counter, stop_ids, generated,
                                max_new, V):
    """A speculative chain as a sequence of ordinary draws: position j is scored with the
    histogram of everything emitted before it in the step, then either verifies draft j
    (``verify_draft``) or samples (``choose``'s draw, ``sample``); the chain stops at the
    first rejection, stop id or ``max_new``."""
    B, W, _ = logits.shape
    alive, emitted, hist, out = live.clone(), torch.zeros(B, dtype=torch.long), hist.clone(), []
    for j in range(W):
        u = uniform(seed, counter + j)
        x = scores(logits[:, j], hist, samp["temperature"], samp["repetition"], samp["presence"], samp["frequency"], V)
        plain = sample(logits[:, j], hist, samp["temperature"], samp["top_k"], samp["top_p"], samp["min_p"],
                       samp["repetition"], samp["presence"], samp["frequency"], seed, counter + j, V)
        tok, accepted = plain, torch.zeros_like(alive)
        if j < W - 1:
            tok_v, acc = verify_draft(x, samp["top_k"], samp["top_p"], samp["min_p"], drafts[:, j], u,
                                      uniform(seed ^ REJECT_STREAM, counter + j))
            tok, accepted = torch.where(count > j, tok_v, plain), (count > j) & acc
        out.append(torch.where(alive, tok, -1))
        emitted += alive.long()
        hist.scatter_add_(1, tok[:, None], alive[:, None].to(hist.dtype))
        stop = (stop_ids == tok[:, None]).any(dim=-1) | (generated + emitted >= max_new)
        alive = alive & accepted & ~stop
    return torch.stack(out, dim=1), emitted, hist


def test_a_chain_is_the_same_bits_as_its_positions_drawn_one_by_one():
    """verify_chain scores and draws all W positions in one pass (each position's histogram
    counting the drafts before it); drawn one position at a time, with the histogram grown
    by each emitted token, 600 rows with every filter and penalty, drafts that are often
    accepted (the argmax), sometimes not, counts 0..5, stop ids and max_new limits give the
    same tokens, counts and histograms."""
    g = torch.Generator().manual_seed(21)
    V, B, W = 24, 600, 6
    parts = [random_row(g, V) for _ in range(B)]
    _, p = stack(parts)
    logits = torch.randn(B, W, V, generator=g) * 3
    drafts = logits[:, : W - 1].argmax(dim=-1)
    wrong = torch.rand(B, W - 1, generator=g) < 0.15
    drafts = torch.where(wrong, torch.randint(0, V, (B, W - 1), generator=g), drafts)
    p["temperature"] = torch.where(torch.rand(B, generator=g) < 0.5, torch.full((B,), 0.05), p["temperature"])
    count = torch.randint(0, W, (B,), generator=g)
    live = torch.rand(B, generator=g) < 0.9
    stop_ids = torch.where(torch.rand(B, 2, generator=g) < 0.3, torch.randint(0, V, (B, 2), generator=g), -1)
    generated = torch.randint(0, 20, (B,), generator=g)
    max_new = generated + torch.randint(1, 8, (B,), generator=g)
    args = (logits, drafts, count, live, p["hist"], {k: p[k] for k in SAMP}, p["seed"], p["counter"], stop_ids,
            generated, max_new, V)
    ours = verify_chain(*args)
    ref = _chain_position_by_position(*args)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    emitted = ours[1]
    assert (emitted >= 3).sum() > 50 and (emitted == 1).sum() > 50 and (emitted == 0).sum() > 20
