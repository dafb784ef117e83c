"""Gated DeltaNet Triton kernels (decode step, causal conv, gates) against float64
references of the recipe's reference path, and against Transformers' own delta rule.

Without CUDA the kernels run in Triton's CPU interpreter (conftest.py sets
TRITON_INTERPRET=1), so the shapes are tiny. Every call starts from poisoned
outputs and fresh random state; rows that are not live, and slots no row owns,
must keep their state bitwise.

bfloat16 is checked loosely: the interpreter truncates fp32 -> bf16 casts
instead of rounding to nearest, so beta and the outputs can differ from torch's
rounding by one bf16 ulp; float32 is checked tightly.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda"

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from flare.prepare.kernels.gdn import (  # noqa: E402
    conv1d_decode_step,
    conv1d_prefill_chunk,
    conv1d_verify_steps,
    gated_rms_norm,
    gdn_decode_step,
    gdn_prefill_gates,
    gdn_prefill_recurrent,
    gdn_verify_steps,
)

F64 = torch.float64
TIGHT = dict(atol=2e-6, rtol=2e-5)
LOOSE = dict(atol=3e-2, rtol=3e-2)
ROWS = 7  # state rows: the null row 0 and six slots


def transformers_rule(name):
    """Transformers' torch delta rule, never the flash-linear-attention kernel that its
    hub-kernel decorator substitutes when ``fla`` is importable."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    return inspect.unwrap(getattr(hf, name))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=F64) * scale).to(dtype).to(DEVICE)


def gates_reference(a, b, A_log, dt_bias):
    """The recipe's gates: g in float32 math (here float64), beta rounded to b's dtype."""
    g = -A_log.to(F64).exp() * F.softplus(a.to(F64) + dt_bias.to(F64))
    return g, b.sigmoid().to(F64)


def delta_step(S, q, k, v, g, beta):
    """One gated delta-rule step in float64. S [B, Hv, Dk, Dv]; q, k [B, Hk, Dk]; v [B, Hv, Dv]."""
    group = v.shape[1] // k.shape[1]
    q, k = (t.to(F64).repeat_interleave(group, dim=1) for t in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    S = S.to(F64) * g.exp()[..., None, None]
    delta = (v.to(F64) - (S * k[..., None]).sum(-2)) * beta[..., None]
    S = S + k[..., None] * delta[..., None, :]
    return (S * q[..., None]).sum(-2), S


class Geometry:
    def __init__(self, Hk, Hv, Dk, Dv):
        self.Hk, self.Hv, self.Dk, self.Dv = Hk, Hv, Dk, Dv

    def __repr__(self):
        return f"Hk{self.Hk}-Hv{self.Hv}-Dk{self.Dk}-Dv{self.Dv}"


GEOMETRIES = [Geometry(2, 4, 16, 16), Geometry(2, 2, 16, 8), Geometry(1, 3, 8, 12)]


def decode_inputs(geo, B, dtype, seed):
    gen = _gen(seed)
    q, k = (_randn(gen, B, geo.Hk, geo.Dk, dtype=dtype) for _ in range(2))
    v = _randn(gen, B, geo.Hv, geo.Dv, dtype=dtype)
    a, b = (_randn(gen, B, geo.Hv, dtype=dtype) for _ in range(2))
    A_log = (torch.rand(geo.Hv, generator=gen, dtype=F64) * 2 - 1).float().to(DEVICE)
    dt_bias = _randn(gen, geo.Hv, dtype=dtype)
    state = _randn(gen, ROWS, geo.Hv, geo.Dk, geo.Dv, scale=0.5)
    return q, k, v, a, b, A_log, dt_bias, state


@pytest.mark.parametrize("geo", GEOMETRIES, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_step_updates_owned_rows_in_place(geo, dtype):
    cases = [([3], [True]), ([5, 0], [True, False]), ([2, 6, 0, 1], [True, True, False, True]),
             ([6, 4, 1, 3], [True, True, True, True]), ([0, 0], [False, False])]
    for seed, (slots, live) in enumerate(cases):
        B = len(slots)
        q, k, v, a, b, A_log, dt_bias, state = decode_inputs(geo, B, dtype, 100 + seed)
        before = state.clone()
        slots_t = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
        live_t = torch.tensor(live, device=DEVICE)
        out = torch.full((B, geo.Hv, geo.Dv), float("nan"), dtype=dtype, device=DEVICE)
        gdn_decode_step(q, k, v, a, b, A_log, dt_bias, state, slots_t, live_t, out=out, block_v=8)

        g, beta = gates_reference(a, b, A_log, dt_bias)
        ref_out, ref_state = delta_step(before[slots_t.long()], q, k, v, g, beta)
        tol = TIGHT if dtype == torch.float32 else LOOSE
        owned = [s for s, lv in zip(slots, live) if lv]
        for i, (s, lv) in enumerate(zip(slots, live)):
            if lv:
                torch.testing.assert_close(out[i].to(F64), ref_out[i], **tol)
                torch.testing.assert_close(state[s].to(F64), ref_state[i], **TIGHT if dtype == torch.float32 else tol)
            else:
                assert torch.equal(out[i], torch.zeros_like(out[i]))
        for s in range(ROWS):
            if s not in owned:
                assert torch.equal(state[s], before[s]), f"row {s} changed"


def test_decode_step_matches_transformers_recurrent_rule():
    """Three decode steps of one row against Transformers' torch_recurrent_gated_delta_rule
    over the same three tokens (float32, GVA 2 -> 4)."""
    geo, steps, slot = GEOMETRIES[0], 3, 4
    q, k, v, a, b, A_log, dt_bias, state = decode_inputs(geo, steps, torch.float32, 7)
    initial = state[slot].clone()
    one = torch.ones(1, dtype=torch.bool, device=DEVICE)
    outs = [gdn_decode_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], a[t:t + 1], b[t:t + 1], A_log, dt_bias, state,
                            torch.tensor([slot], device=DEVICE), one, block_v=16) for t in range(steps)]
    g = -A_log.exp() * F.softplus(a + dt_bias)
    ref_out, ref_state = transformers_rule("torch_recurrent_gated_delta_rule")(
        q[None], k[None], v[None], g=g[None], beta=b.sigmoid()[None], initial_state=initial[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(torch.cat(outs), ref_out[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[slot], ref_state[0], atol=1e-5, rtol=1e-5)


def conv_inputs(D, W, B_or_T, dtype, seed, bias=True):
    gen = _gen(seed)
    x = _randn(gen, B_or_T, D, dtype=dtype)
    weight = _randn(gen, D, 1, W, dtype=dtype, scale=0.5)
    b = _randn(gen, D, dtype=dtype, scale=0.1) if bias else None
    conv_state = _randn(gen, ROWS, D, W - 1, dtype=dtype)
    return x, weight, b, conv_state


def conv_reference(history, x, weight, bias):
    """The recipe's convolution over (history ++ x): conv1d in the weight dtype, then SiLU."""
    seq = torch.cat([history, x.transpose(0, 1).to(history.dtype)], dim=1)  # [D, W-1+T]
    if x.shape[0] == 0:
        return x.clone(), seq
    out = F.conv1d(seq[None].to(weight.dtype), weight, bias, groups=weight.shape[0])[0]
    return F.silu(out).transpose(0, 1).to(x.dtype), seq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("W", [4, 2])
def test_conv_decode_step_shifts_owned_history(dtype, W):
    D = 40  # not a multiple of the channel block
    for seed, (slots, live, bias) in enumerate([([2, 0, 5], [True, False, True], True), ([1], [True], False),
                                                ([3, 6, 0, 4], [True, True, False, True], True)]):
        B = len(slots)
        x, weight, b, conv_state = conv_inputs(D, W, B, dtype, 200 + seed, bias)
        before = conv_state.clone()
        out = torch.full((B, D), float("nan"), dtype=dtype, device=DEVICE)
        conv1d_decode_step(x, conv_state, weight, b, torch.tensor(slots, device=DEVICE),
                           torch.tensor(live, device=DEVICE), out=out, block_c=16)
        for i, (s, lv) in enumerate(zip(slots, live)):
            if not lv:
                assert torch.equal(out[i], torch.zeros_like(out[i]))
                continue
            ref, seq = conv_reference(before[s], x[i:i + 1], weight, b)
            torch.testing.assert_close(out[i].to(F64), ref[0].to(F64), **TIGHT if dtype == torch.float32 else LOOSE)
            assert torch.equal(conv_state[s], seq[:, 1:])
        owned = {s for s, lv in zip(slots, live) if lv}
        for s in set(range(ROWS)) - owned:
            assert torch.equal(conv_state[s], before[s]), f"row {s} changed"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_conv_prefill_chunk_continues_history_and_cuts_at_count(dtype):
    D, W, T, slot = 40, 4, 20, 3  # 3 token blocks of 8 (the last partial), 3 channel blocks of 16
    for seed, n in enumerate([0, 1, 2, 3, 4, 13, 19, 20]):
        x, weight, b, conv_state = conv_inputs(D, W, T, dtype, 300 + seed)
        before = conv_state.clone()
        out = torch.full((T, D), float("nan"), dtype=dtype, device=DEVICE)
        conv1d_prefill_chunk(x, conv_state, weight, b, torch.tensor([slot], device=DEVICE),
                             torch.tensor(n, device=DEVICE), out=out, block_t=8, block_c=16)
        ref, seq = conv_reference(before[slot], x[:n], weight, b)
        torch.testing.assert_close(out[:n].to(F64), ref.to(F64), **TIGHT if dtype == torch.float32 else LOOSE)
        assert torch.equal(out[n:], torch.zeros_like(out[n:]))
        assert torch.equal(conv_state[slot], seq[:, n:])  # the last W-1 inputs of (history ++ x[:n])
        for s in set(range(ROWS)) - {slot}:
            assert torch.equal(conv_state[s], before[s])


def test_conv_prefill_then_decode_equals_one_convolution():
    """A chunk of 9 valid tokens (of 16) then 3 decode steps: the outputs are the
    convolution of the whole 12-token sequence from the initial history."""
    D, W, slot = 24, 4, 5
    x, weight, b, conv_state = conv_inputs(D, W, 16, torch.float32, 400)
    steps = _randn(_gen(401), 3, D)
    initial = conv_state[slot].clone()
    s = torch.tensor([slot], device=DEVICE)
    one = torch.ones(1, dtype=torch.bool, device=DEVICE)
    first = conv1d_prefill_chunk(x, conv_state, weight, b, s, torch.tensor([9], device=DEVICE), block_t=4)
    rest = [conv1d_decode_step(steps[i:i + 1], conv_state, weight, b, s, one) for i in range(3)]
    ref, seq = conv_reference(initial, torch.cat([x[:9], steps]), weight, b)
    torch.testing.assert_close(torch.cat([first[:9], *rest]), ref, **TIGHT)
    assert torch.equal(conv_state[slot], seq[:, -(W - 1):])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_gates_match_recipe_and_zero_past_count(dtype):
    T, H = 37, 6
    for seed, n in enumerate([0, 1, 36, 37]):
        gen = _gen(500 + seed)
        a, b = (_randn(gen, T, H, dtype=dtype, scale=3.0) for _ in range(2))
        a[0, 0] = 25.0  # softplus's linear branch
        A_log = (torch.rand(H, generator=gen, dtype=F64) * 3 - 1).float().to(DEVICE)
        dt_bias = _randn(gen, H, dtype=dtype)
        g, beta = gdn_prefill_gates(a, b, A_log, dt_bias, torch.tensor([n], device=DEVICE),
                                    g_out=torch.full((T, H), float("nan"), device=DEVICE),
                                    beta_out=torch.full((T, H), float("nan"), dtype=dtype, device=DEVICE))
        assert g.dtype == torch.float32 and beta.dtype == dtype
        g_ref, beta_ref = gates_reference(a, b, A_log, dt_bias)
        torch.testing.assert_close(g[:n].to(F64), g_ref[:n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(beta[:n].to(F64), beta_ref[:n], **TIGHT if dtype == torch.float32 else LOOSE)
        assert torch.equal(g[n:], torch.zeros_like(g[n:]))
        assert torch.equal(beta[n:], torch.zeros_like(beta[n:]))


def test_prefill_pieces_with_chunk_rule_equal_decode_steps():
    """The prefill composition the recipe would run (conv chunk, gates zeroed past the
    count, Transformers' chunked rule over the padded chunk) leaves the same recurrent
    state as decode steps over the valid tokens; the padded tokens change nothing."""
    geo, W, T, n, slot = GEOMETRIES[0], 4, 12, 7, 2
    D = 2 * geo.Hk * geo.Dk + geo.Hv * geo.Dv
    x, weight, _, conv_state = conv_inputs(D, W, T, torch.float32, 600, bias=False)
    _, _, _, a, b, A_log, dt_bias, state = decode_inputs(geo, T, torch.float32, 601)
    conv_dec, state_dec = conv_state.clone(), state.clone()
    s = torch.tensor([slot], device=DEVICE)

    mixed = conv1d_prefill_chunk(x, conv_state, weight, None, s, torch.tensor(n, device=DEVICE), block_t=4)
    g, beta = gdn_prefill_gates(a, b, A_log, dt_bias, torch.tensor(n, device=DEVICE))
    q, k, v = torch.split(mixed, [geo.Hk * geo.Dk, geo.Hk * geo.Dk, geo.Hv * geo.Dv], dim=-1)
    q, k, v = q.reshape(T, geo.Hk, geo.Dk), k.reshape(T, geo.Hk, geo.Dk), v.reshape(T, geo.Hv, geo.Dv)
    core, final = transformers_rule("torch_chunk_gated_delta_rule")(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=state[slot][None],
        output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=4)

    one = torch.ones(1, dtype=torch.bool, device=DEVICE)
    outs = []
    for t in range(n):
        m = conv1d_decode_step(x[t:t + 1], conv_dec, weight, None, s, one)
        qt, kt, vt = torch.split(m, [geo.Hk * geo.Dk, geo.Hk * geo.Dk, geo.Hv * geo.Dv], dim=-1)
        outs.append(gdn_decode_step(qt.reshape(1, geo.Hk, geo.Dk), kt.reshape(1, geo.Hk, geo.Dk),
                                    vt.reshape(1, geo.Hv, geo.Dv), a[t:t + 1], b[t:t + 1], A_log, dt_bias,
                                    state_dec, s, one, block_v=8))
    assert torch.equal(conv_state, conv_dec)
    torch.testing.assert_close(core[0, :n], torch.cat(outs), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final[0], state_dec[slot], atol=1e-5, rtol=1e-5)


def _recurrent(q, k, v, g, beta, state, slot, n, **kw):
    out = torch.full(v.shape, float("nan"), dtype=v.dtype, device=DEVICE)
    return gdn_prefill_recurrent(q, k, v, g, beta, state, torch.tensor([slot], device=DEVICE),
                                 torch.tensor([n], dtype=torch.int32, device=DEVICE), out=out, **kw)


@pytest.mark.parametrize("geo", GEOMETRIES, ids=repr)
def test_prefill_recurrent_matches_float64_steps_and_zeroes_past_count(geo):
    """The chunk's valid tokens follow the float64 recurrence from the slot's state; the
    state of every other row is untouched; outputs past the count are zeros."""
    T, n, slot = 9, 6, 3
    q, k, v, a, b, A_log, dt_bias, state = decode_inputs(geo, T, torch.float32, 700)
    g, beta = gdn_prefill_gates(a, b, A_log, dt_bias, torch.tensor(n, device=DEVICE))
    before = state.clone()
    out = _recurrent(q, k, v, g, beta, state, slot, n, block_v=8)
    S = before[slot][None].to(F64)
    for t in range(n):
        o, S = delta_step(S, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1].to(F64), beta[t:t + 1].to(F64))
        torch.testing.assert_close(out[t].to(F64), o[0], **TIGHT)
    torch.testing.assert_close(state[slot].to(F64), S[0], **TIGHT)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    others = [r for r in range(ROWS) if r != slot]
    assert torch.equal(state[others], before[others])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_recurrent_is_bitwise_invariant_to_where_chunks_split(dtype):
    """What makes a hybrid prefix hit exact: a prompt prefilled in one chunk and the same
    prompt restored at a boundary and continued (another chunk start, another capacity,
    padding) leave bitwise the same state and outputs."""
    geo, n, slot = GEOMETRIES[0], 11, 2
    q, k, v, a, b, A_log, dt_bias, state = decode_inputs(geo, 16, dtype, 701)
    g, beta = gdn_prefill_gates(a, b, A_log, dt_bias, torch.tensor(16, device=DEVICE))
    whole = state.clone()
    out_whole = _recurrent(q[:16], k[:16], v[:16], g, beta, whole, slot, n)
    for cut in (1, 4, 7):
        split = state.clone()
        first = _recurrent(q[:8], k[:8], v[:8], g[:8], beta[:8], split, slot, cut)
        rest = slice(cut, 16)  # a padded chunk from the cut
        second = _recurrent(q[rest], k[rest], v[rest], g[rest], beta[rest], split, slot, n - cut)
        assert torch.equal(split, whole), cut
        assert torch.equal(torch.cat([first[:cut], second[:n - cut]]), out_whole[:n]), cut


def test_rejects_bad_shapes():
    geo = GEOMETRIES[0]
    q, k, v, a, b, A_log, dt_bias, state = decode_inputs(geo, 2, torch.float32, 9)
    slots, live = torch.tensor([1, 2], device=DEVICE), torch.ones(2, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match="state"):
        gdn_decode_step(q, k, v, a, b, A_log, dt_bias, state.double(), slots, live)
    with pytest.raises(ValueError, match="q .* k"):
        gdn_decode_step(q, k[:, :1], v, a, b, A_log, dt_bias, state, slots, live)
    with pytest.raises(ValueError, match="slots"):
        gdn_decode_step(q, k, v, a, b, A_log, dt_bias, state, slots[:1], live)
    g = torch.zeros(2, geo.Hv, device=DEVICE)
    with pytest.raises(ValueError, match="beta"):
        gdn_prefill_recurrent(q, k, v, g, b[:1], state, slots, slots)
    with pytest.raises(ValueError, match="state"):
        gdn_prefill_recurrent(q, k, v, g, b, state[:, :1], slots, slots)
    x, weight, bias, conv_state = conv_inputs(8, 4, 2, torch.float32, 10)
    with pytest.raises(ValueError, match="conv_state"):
        conv1d_decode_step(x, conv_state[:, :, :2], weight, bias, slots, live)
    with pytest.raises(ValueError, match="block_t"):
        conv1d_prefill_chunk(x, conv_state, weight, bias, slots, slots, block_t=2)


# Verify programs: rows of W positions (the pending token and its drafts); a position past
# a row's drafts is not valid. Row 2 is padding (the null slot, no valid position).
VERIFY_ROWS = ([3, 5, 0, 1], [[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]])


@pytest.mark.parametrize("geo", GEOMETRIES[:2], ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_verify_steps_are_the_bits_of_decode_steps_in_a_row(geo, dtype):
    """gdn_verify_steps over B rows of W positions in one launch: the outputs and the state
    after every position are the bits of W gdn_decode_step calls on a copy of each row's
    slot state; positions past a row's drafts leave the state and output zeros; the slots'
    own rows are untouched."""
    slots, valid = VERIFY_ROWS
    B, W = len(slots), len(valid[0])
    q, k, v, a, b, A_log, dt_bias, state = decode_inputs(geo, B * W, dtype, 400)
    before = state.clone()
    slots_t = torch.tensor(slots, device=DEVICE)
    valid_t = torch.tensor([x == 1 for row in valid for x in row], device=DEVICE)
    steps = torch.full((B, W, geo.Hv, geo.Dk, geo.Dv), float("nan"), device=DEVICE)
    out = gdn_verify_steps(q, k, v, a, b, A_log, dt_bias, state, slots_t, valid_t, steps, block_v=8)
    assert torch.equal(state, before)
    work = before.index_select(0, slots_t)
    rows = torch.arange(B, device=DEVICE)
    for j in range(W):
        at = rows * W + j
        want = gdn_decode_step(q[at], k[at], v[at], a[at], b[at], A_log, dt_bias, work, rows, valid_t[at], block_v=8)
        assert torch.equal(out[at], want), j
        assert torch.equal(steps[:, j], work), j
    assert not torch.equal(steps[0, 2], steps[0, 1]) and torch.equal(steps[1, 2], steps[1, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("W", [4, 3, 2])
def test_conv_verify_steps_are_the_bits_of_decode_steps_in_a_row(dtype, W):
    """conv1d_verify_steps likewise against W conv1d_decode_step calls, kernels 2 to 4 wide."""
    slots, valid = VERIFY_ROWS
    B, width, D = len(slots), len(valid[0]), 40
    x, weight, bias, conv_state = conv_inputs(D, W, B * width, dtype, 500 + W)
    before = conv_state.clone()
    slots_t = torch.tensor(slots, device=DEVICE)
    valid_t = torch.tensor([v == 1 for row in valid for v in row], device=DEVICE)
    steps = torch.full((B, width, D, W - 1), float("nan"), dtype=dtype, device=DEVICE)
    out = conv1d_verify_steps(x, conv_state, weight, bias, slots_t, valid_t, steps, block_c=16)
    assert torch.equal(conv_state, before)
    work = before.index_select(0, slots_t)
    rows = torch.arange(B, device=DEVICE)
    for j in range(width):
        at = rows * width + j
        want = conv1d_decode_step(x[at], work, weight, bias, rows, valid_t[at], block_c=16)
        assert torch.equal(out[at], want), j
        assert torch.equal(steps[:, j], work), j


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_is_the_modules_norm(dtype):
    """``gated_rms_norm`` over [T, H, D] heads with the gate a strided view (as the input
    projection's z columns are): Transformers' Qwen3.5 gated norm, head by head, to float32
    rounding (bfloat16 loosely: the interpreter truncates its casts); heads of other scales, a
    head of zeros stays zero; shapes that do not match are refused."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    g = torch.Generator().manual_seed(21)
    T, H, D = 3, 5, 32
    norm = Qwen3_5RMSNormGated(D, eps=1e-6)
    norm.weight.data = torch.rand(D, generator=g) + 0.5
    norm = norm.to(DEVICE, dtype)
    x = (torch.randn(T, H, D, generator=g) * torch.logspace(-2, 1, H)[:, None]).to(DEVICE, dtype)
    x[1, 2] = 0
    proj = torch.randn(T, H * D + 7, generator=g).to(DEVICE, dtype)  # z | other columns, like in_proj's split
    z = proj[:, : H * D].unflatten(-1, (H, D))
    with torch.no_grad():
        want = norm(x.reshape(-1, D), z.reshape(-1, D)).reshape(T, H, D)
    got = gated_rms_norm(x, z, norm.weight, 1e-6)
    torch.testing.assert_close(got, want, **(TIGHT if dtype == torch.float32 else LOOSE))
    assert not got[1, 2].any() and got.abs().max() > 0.1
    with pytest.raises(ValueError, match="expected"):
        gated_rms_norm(x, z[:, :, :-1], norm.weight, 1e-6)
