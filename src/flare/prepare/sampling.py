"""The sampler that runs inside every sampling program.

One path for temperature, top-k, top-p, min-p and repetition / presence /
frequency penalties, built from plain tensor operations so it captures into
a CUDA graph and runs eagerly on the CPU alike. Nothing is decided on the host.

Random stream: a request's draw ``n`` uses one uniform derived from its seed
and its counter ``n`` only (a counter-based hash), then inverse-CDF selection
over its own filtered distribution. Nothing in a row's computation reads
another row, so batch composition and position never change a request's
stream. Torch generators are never used: a raw graph launch would bypass
their bookkeeping.

Penalty histogram encoding (int32 per vocabulary entry): prompt tokens set
``HIST_PROMPT_BIT``; each sampled output token adds one to the low 24 bits.
Repetition penalty applies to any token seen in prompt or output; presence and
frequency penalties apply to output tokens (vLLM / OpenAI semantics).
"""

from __future__ import annotations

import torch

from flare.core.manifest import HIST_PROMPT_BIT

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x < 2**32, without overflowing int64."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (the 'lowbias32' finaliser)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """A float32 in [0, 1) from (seed, counter), both int64 tensors of one shape."""
    s_lo = seed & _MASK32
    s_hi = (seed >> 32) & _MASK32
    c_lo = counter & _MASK32
    c_hi = (counter >> 32) & _MASK32
    h = _mix32(s_lo ^ 0x9E3779B9)
    h = _mix32(h ^ s_hi)
    h = _mix32(h ^ c_lo)
    h = _mix32(h ^ c_hi)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def apply_token_mask(logits: torch.Tensor, words: torch.Tensor, on: torch.Tensor) -> torch.Tensor:
    """Grammar masks: rows with ``on != 0`` keep only the tokens whose bit is set in
    ``words`` (int32 ``[B, ceil(V / 32)]``, bit j of word w = token 32 * w + j); the others
    become -inf. Bits are unpacked with shifts (the arithmetic shift of a negative word
    still yields its bit 31 after ``& 1``): no host sync, no data-dependent shapes."""
    V = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = ((words[:, :, None] >> shifts) & 1).reshape(words.shape[0], -1)[:, :V]
    allowed = (bits != 0) | (on == 0)[:, None]
    return torch.where(allowed, logits, torch.full_like(logits, float("-inf")))


def apply_penalties(
    logits: torch.Tensor,
    hist: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    out_count = (hist & (HIST_PROMPT_BIT - 1)).to(logits.dtype)
    seen = hist != 0
    rep = repetition[:, None]
    x = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return x - presence[:, None] * (out_count > 0).to(logits.dtype) - frequency[:, None] * out_count


def scores(
    logits: torch.Tensor,  # [B, V] float32
    hist: torch.Tensor,  # [B, V] int32
    temperature: torch.Tensor,  # [B]
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    sampling_vocab: int,
) -> torch.Tensor:
    """Penalised, temperature-scaled logits over the sampling vocabulary: elementwise
    only, so a row's values never depend on the other rows or on how the work is
    split (compiled or not, any batch size)."""
    x = logits[:, :sampling_vocab].float()
    x = apply_penalties(x, hist[:, :sampling_vocab], repetition, presence, frequency)
    # Padded rows carry the null slot's parameters; keep their arithmetic finite.
    return x / temperature.clamp(min=1e-5)[:, None]


def choose(
    x: torch.Tensor,  # [B, V] scores
    top_k: torch.Tensor,  # [B] int, <= 0 disables
    top_p: torch.Tensor,  # [B], >= 1 disables
    min_p: torch.Tensor,  # [B]
    u: torch.Tensor,  # [B] uniform draws in [0, 1)
    kernel: bool = False,
) -> torch.Tensor:
    """Filters and the inverse-CDF draw: the sampled token ids, int64 ``[B]``.

    Filters keep a prefix of the tokens sorted by probability; the kept prefix is
    then widened to every token tied with its last member, so a threshold tie is
    never cut at an arbitrary candidate count. Its reductions (softmax, sort, scans)
    stay eager ATen kernels, whose per-row results do not depend on the batch size.
    ``kernel``: everything after the sort in one Triton program a row
    (``kernels/sampler.py``: the same definitions, summed in blocks; the CUDA default, ``flare-prepare --sampler``).
    """
    if kernel:
        from flare.prepare.kernels.sampler import draw_sorted

        return draw_sorted(*_sorted(x, kernel=True), top_k, top_p, min_p, u)
    return _draw(*filtered(x, top_k, top_p, min_p), u)


def logprob_block(logits: torch.Tensor, tok: torch.Tensor, n: int, vocab: int, kernel: bool = False,
                  wants: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """A log-probability block per row (``interface.logprob_columns``): log_softmax of the
    raw logits over the first ``vocab`` columns, token ``tok``'s value and the ``n`` largest
    (torch.topk: exact ties in a fixed but unspecified order), float32 bits then ids as int32.
    Per-row reductions (eager ATen, as :func:`choose`): a row's values never depend on the
    batch it shares. ``kernel``: two Triton kernels instead (``kernels/sampler.logprob_block``:
    equal logits ordered by ascending id; the CUDA default, ``flare-prepare --sampler``).
    ``wants``: (the rows' slots, ``state.logprobs_on``): a row whose slot asks for no
    log-probabilities gets zeros (the kernels then skip its work)."""
    if kernel:
        from flare.prepare.kernels.sampler import logprob_block as block

        return block(logits.float(), tok, n, vocab, wants=wants)
    lp = torch.log_softmax(logits[:, :vocab].float(), dim=-1)
    chosen = lp.gather(1, tok.clamp(0, vocab - 1)[:, None])
    top, ids = torch.topk(lp, n, dim=-1, sorted=True)
    out = torch.cat([torch.cat([chosen, top], dim=-1).view(torch.int32), ids.int()], dim=-1)
    if wants is not None:
        slots, on = wants
        out = torch.where(on.index_select(0, slots)[:, None] != 0, out, 0)
    return out


def _sorted(x: torch.Tensor, kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's probabilities sorted descending (ties in token order) and their token ids.
    ``kernel``: the softmax split over programs (``kernels/sampler.softmax_rows``), not ATen's
    one block a row."""
    if kernel:
        from flare.prepare.kernels.sampler import softmax_rows

        p = softmax_rows(x.float().contiguous())
    else:
        p = torch.softmax(x, dim=-1)
    return torch.sort(p, dim=-1, descending=True, stable=True)


def _draw(kept: torch.Tensor, si: torch.Tensor, n_keep: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`choose`'s inverse-CDF draw over :func:`filtered`'s output."""
    cdf = torch.cumsum(kept, dim=-1)
    target = u * cdf[:, -1]
    idx = torch.minimum((cdf <= target[:, None]).sum(dim=-1), n_keep - 1)
    return si.gather(1, idx[:, None])[:, 0]


def filtered(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The filters of :func:`choose`: (probabilities sorted descending with the filtered-out
    ones zeroed, unnormalised ``[B, V]``; their token ids ``[B, V]``; kept count ``[B]``)."""
    return filter_sorted(*_sorted(x), top_k, top_p, min_p)


def filter_sorted(sp: torch.Tensor, si: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`filtered` over probabilities already sorted descending and their ids. A top-p
    of 1 or more keeps every token (as top-k <= 0 does): the mass before the last tokens can
    round to 1 in float32, which would otherwise drop them."""
    v = sp.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v)).long()
    kth = sp.gather(1, (k - 1)[:, None])
    before = torch.cumsum(sp, dim=-1) - sp  # mass strictly before each token
    nucleus = (before < top_p[:, None]) | (top_p[:, None] >= 1)
    keep = (sp >= kth) & nucleus & (sp >= min_p[:, None] * sp[:, :1])
    n_keep = keep.sum(dim=-1).clamp(min=1)
    threshold = sp.gather(1, (n_keep - 1)[:, None])
    kept = torch.where(sp >= threshold, sp, torch.zeros_like(sp))
    return kept, si, (sp >= threshold).sum(dim=-1).clamp(min=1)


def verify_draft(
    x: torch.Tensor,  # [B, V] scores (after masks, penalties, temperature)
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    proposal: torch.Tensor,  # [B] int64: a deterministic draft token per row
    u_accept: torch.Tensor,  # [B] uniform draws
    u_draw: torch.Tensor,  # [B] uniform draws, independent of u_accept
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative verification that keeps the sampling distribution exact: with p the
    row's filtered, renormalised distribution (:func:`filtered`), the proposal x is accepted
    when ``u_accept < p(x)``; otherwise the token is drawn from p with x removed and
    renormalised (inverse CDF with ``u_draw``). Then P(token = x) = p(x) and, for y != x,
    P(token = y) = (1 - p(x)) p(y) / (1 - p(x)) = p(y): the output follows p whatever the
    proposal. Returns (tokens int64 ``[B]``, accepted bool ``[B]``). Plain tensor ops, as
    ``choose``: capturable, and a row never reads another row."""
    kept, si, _ = filtered(x, top_k, top_p, min_p)
    return _verify(kept, si, proposal, u_accept, u_draw)


def _verify(kept: torch.Tensor, si: torch.Tensor, proposal: torch.Tensor, u_accept: torch.Tensor,
            u_draw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify_draft` over :func:`filtered`'s output."""
    at_x = si == proposal[:, None]
    p_x = torch.where(at_x, kept, torch.zeros_like(kept)).sum(dim=-1) / kept.sum(dim=-1)
    accepted = u_accept < p_x
    rest = torch.where(at_x, torch.zeros_like(kept), kept)
    cdf = torch.cumsum(rest, dim=-1)
    target = u_draw * cdf[:, -1]
    # The first position whose mass ends past the target; rounding at the top falls back
    # to the last position that still has mass (never the removed proposal).
    positions = torch.arange(rest.shape[-1], device=rest.device)
    last = torch.where(rest > 0, positions, torch.zeros_like(positions)).amax(dim=-1)
    idx = torch.minimum((cdf <= target[:, None]).sum(dim=-1), last)
    drawn = si.gather(1, idx[:, None])[:, 0]
    return torch.where(accepted, proposal, drawn), accepted


# The second uniform of a verified position (the draw after a rejection) comes from the
# request's seed with these bits flipped: an independent hash stream on the same counter.
REJECT_STREAM = 0x5A5A5A5A


def verify_chain(
    logits: torch.Tensor,  # [B, W, V] float32: position j's raw logits, given the drafts before it
    drafts: torch.Tensor,  # [B, W - 1] int64: the proposals for positions 0 .. W - 2
    count: torch.Tensor,  # [B] int: how many of a row's drafts to verify (0 .. W - 1)
    live: torch.Tensor,  # [B] bool
    hist: torch.Tensor,  # [B, V] int32 penalty histograms
    samp: dict[str, torch.Tensor],  # [B] each: temperature, top_k, top_p, min_p, repetition, presence, frequency
    seed: torch.Tensor,  # [B] int64
    counter: torch.Tensor,  # [B] int64: the row's next draw
    stop_ids: torch.Tensor,  # [B, S] int, -1 unused
    generated: torch.Tensor,  # [B] int: tokens generated before this step
    max_new: torch.Tensor,  # [B] int
    sampling_vocab: int,
    kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A speculative step's tokens: position j verifies draft j (:func:`verify_draft`, draws
    ``uniform(seed, counter + j)`` and the same counter on ``seed ^ REJECT_STREAM``) while
    j < count, and samples plainly (:func:`choose` with ``uniform(seed, counter + j)``,
    ordinary decode's draw) at the first position past the drafts. The chain ends at the
    first rejected draft, at a stop id, or at ``max_new``; each position's penalties count the
    tokens emitted before it in the step. So the emitted tokens follow, position by position,
    the request's sampling distribution given everything before them, and a row with no
    drafts emits exactly what a decode step would. Returns (tokens ``[B, W]`` int64, -1 past the
    emitted ones; emitted count ``[B]`` int64; the histograms with the emitted tokens added).

    All W positions are scored, sorted and drawn in one pass over ``B * W`` rows, not one
    pass per position: a position is emitted only when every draft before it was accepted,
    so the tokens before it in the step are exactly those drafts, known before anything is
    drawn, and its histogram is the row's plus them. (The sampler's sort and scans over the
    vocabulary, once per position, made a step of six positions cost three decode steps on
    the H200 for a 135M model.) Each row's arithmetic is the one a pass of its own would do:
    elementwise, or row-wise reductions (softmax, sort, scans, sums). On the CPU a row's
    bits do not depend on how many rows run together; on CUDA, ATen may split a long row's
    sum or scan over a number of blocks that depends on the row count, so a probability
    can round differently than in a pass of B rows (as between decode capacities). With
    ``kernel`` (``flare-prepare --sampler kernel``, the CUDA default) the filters and draws after the sort are
    one Triton program a row (``kernels/sampler.py``), whose sums do not depend on the row count.
    Preconditions, as the verify program guarantees: drafts are token ids below
    ``sampling_vocab`` (those past ``count`` too) and ``count <= W - 1``. Plain tensor ops
    (and the kernel): capturable, and no row reads another."""
    B, W, _ = logits.shape
    dev = logits.device
    j = torch.arange(W, device=dev)
    hist_v = hist[:, :sampling_vocab]
    at = hist_v[:, None, :].repeat(1, W, 1)  # [B, W, V]: position j's histogram
    if W > 1:
        before = (j[:, None] > j[None, : W - 1]).to(hist.dtype)  # [W, W - 1]: draft i precedes position j
        at.scatter_add_(2, drafts[:, None, :].expand(B, W, W - 1), before[None].expand(B, W, W - 1))
    per = lambda t: t.repeat_interleave(W)  # noqa: E731  [B] -> [B * W], a row's positions together
    x = scores(logits.reshape(B * W, -1), at.reshape(B * W, -1), per(samp["temperature"]), per(samp["repetition"]),
               per(samp["presence"]), per(samp["frequency"]), sampling_vocab)
    filters = per(samp["top_k"]), per(samp["top_p"]), per(samp["min_p"])
    steps = (counter[:, None] + j[None, :]).reshape(-1)
    u = uniform(per(seed), steps)
    u_rej = uniform(per(seed ^ REJECT_STREAM), steps)
    # The last position has no draft: its verdict is computed against a stand-in and unused.
    proposal = torch.cat([drafts, drafts[:, :1]], dim=1).reshape(-1)
    if kernel:
        from flare.prepare.kernels.sampler import draw_sorted

        plain, tok_v, acc = draw_sorted(*_sorted(x, kernel=True), *filters, u, proposal, u_rej)
    else:
        kept, si, n_keep = filtered(x, *filters)
        plain = _draw(kept, si, n_keep, u)
        tok_v, acc = _verify(kept, si, proposal, u, u_rej)
    plain = plain.reshape(B, W)
    checked = (count[:, None] > j[None, :]) & (j[None, :] < W - 1)  # the last position has no draft
    tok = torch.where(checked, tok_v.reshape(B, W), plain)
    accepted = checked & acc.reshape(B, W)
    # Position j emitted: the row's (j + 1)-th token of the step.
    stop = (stop_ids.long()[:, None, :] == tok[:, :, None]).any(dim=-1) | (
        generated.long()[:, None] + j[None, :] + 1 >= max_new.long()[:, None])
    go_on = (accepted & ~stop).long()
    reached = torch.cumprod(torch.cat([torch.ones_like(go_on[:, :1]), go_on[:, :-1]], dim=1), dim=1) > 0
    alive = live[:, None] & reached
    out = torch.where(alive, tok, torch.full_like(tok, -1))
    hist = hist.clone()
    hist.scatter_add_(1, tok, alive.to(hist.dtype))
    return out, alive.long().sum(dim=-1), hist


def sample(
    logits: torch.Tensor,  # [B, V] float32
    hist: torch.Tensor,  # [B, V] int32
    temperature: torch.Tensor,  # [B]
    top_k: torch.Tensor,  # [B] int, <= 0 disables
    top_p: torch.Tensor,  # [B]
    min_p: torch.Tensor,  # [B]
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    seed: torch.Tensor,  # [B] int64
    counter: torch.Tensor,  # [B] int64
    sampling_vocab: int,
) -> torch.Tensor:
    """Returns the sampled token ids, int64 ``[B]``: :func:`scores`, then
    :func:`choose` with the request's draw :func:`uniform` (seed, counter)."""
    x = scores(logits, hist, temperature, repetition, presence, frequency, sampling_vocab)
    return choose(x, top_k, top_p, min_p, uniform(seed, counter))
