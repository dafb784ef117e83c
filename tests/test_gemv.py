"""The few-row decode GEMM (``kernels/gemv.py``): against float64 within float32 rounding,
deterministic, row-invariant, split-K reduced in a fixed order, counters left at zero.
Without CUDA it runs in Triton's CPU interpreter."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from flare.prepare.kernels import gemv as G  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# (rows, split, (defer, rowloop, dot)): every rows x split pair for the plain product, three for
# each variant (the split's reduction is the same code in all).
VARIANT_CASES = ([(r, s, (0, 0, 0)) for r in (1, 3, 4) for s in (1, 3, 4)]
                 + [(r, s, v) for v in ((1, 0, 0), (0, 1, 0), (0, 0, 1)) for r, s in ((1, 1), (3, 4), (4, 3))])


@pytest.mark.parametrize("rows,split,variant", VARIANT_CASES)
def test_a_few_rows_times_a_weight(rows, split, variant):
    """N not a multiple of the tile, K not a multiple of the slices: masked edges; every row
    within float32 rounding of float64; the same bits on a second call (the counters were
    reset) and for the row alone (row-invariant: also a row at a time, ``rowloop``, and one
    tensor-core tile, ``dot``); the counters end at zero."""
    g = torch.Generator().manual_seed(rows * 10 + split)
    n, k = 100, 300
    # The CPU interpreter's tl.dot takes no bfloat16 operands (it returns garbage): float32 there.
    dt = torch.float32 if variant[2] and DEVICE == "cpu" else torch.bfloat16
    w = torch.randn(n, k, generator=g).to(DEVICE, dt)
    x = torch.randn(rows, k, generator=g).to(DEVICE, dt)
    tiling = (16, 32, split, 4, 2, *variant)
    space = G.workspace(rows, n, split, 16, DEVICE, dot=bool(variant[2]))
    out = G.gemv(x, w, torch.empty(rows, n, device=DEVICE, dtype=torch.float32), tiling, space)
    want = x.double() @ w.double().T
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
    again = G.gemv(x, w, torch.empty_like(out), tiling, space)
    assert torch.equal(again, out)
    assert not space[1].any()
    for r in range(rows):
        alone = G.gemv(x[r : r + 1].clone(), w, torch.empty(1, n, device=DEVICE, dtype=torch.float32), tiling)
        assert torch.equal(alone[0], out[r])


@pytest.mark.parametrize("defer", [0, 1])
def test_the_slices_are_summed_in_order(defer):
    """With SPLIT slices the result is slice 0 + slice 1 + ... in float32, in that order:
    the unsplit kernel over each slice of K, summed the same way, gives the same bits."""
    g = torch.Generator().manual_seed(7)
    n, k, split, bk = 48, 256, 4, 32
    w = torch.randn(n, k, generator=g).to(DEVICE, torch.bfloat16)
    x = torch.randn(2, k, generator=g).to(DEVICE, torch.bfloat16)
    out = G.gemv(x, w, torch.empty(2, n, device=DEVICE, dtype=torch.float32), (16, bk, split, 4, 2, defer))
    ks = k // split
    total = torch.zeros(2, n, device=DEVICE, dtype=torch.float32)
    for s in range(split):
        part = G.gemv(x[:, s * ks : (s + 1) * ks].contiguous(), w[:, s * ks : (s + 1) * ks].contiguous(),
                      torch.empty(2, n, device=DEVICE, dtype=torch.float32), (16, bk, 1, 4, 2, defer))
        total += part
    assert torch.equal(out, total)


def test_a_split_that_leaves_a_slice_empty_or_a_workspace_of_other_sizes_is_refused():
    w = torch.zeros(16, 64, device=DEVICE, dtype=torch.bfloat16)
    x = torch.zeros(1, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="slices"):
        G.gemv(x, w, torch.empty(1, 16, device=DEVICE), (16, 32, 4, 4, 2))
    with pytest.raises(ValueError, match="workspace"):
        G.gemv(x, w, torch.empty(1, 16, device=DEVICE), (16, 32, 2, 4, 2), G.workspace(1, 8, 2, 16, DEVICE))
    with pytest.raises(ValueError, match="outputs"):
        G.gemv(x, w, torch.empty(1, 32, device=DEVICE)[:, ::2], (16, 32, 1, 4, 2))


@pytest.mark.parametrize("rows", [1, 3])
def test_the_gated_activation_in_the_loads(rows):
    """``swiglu``: the rows are [gate | up] and the product is (silu(gate) * up) @ w.T with the
    activation rounded to the rows' dtype once: within float32 rounding of the GEMV of that
    activation computed apart, and of float64; rows of another width are refused. bfloat16 on
    the GPU; float32 in the CPU interpreter, whose float32 -> bfloat16 conversion truncates
    where the GPU's rounds to nearest."""
    g = torch.Generator().manual_seed(11)
    n, k = 72, 200
    dt = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    w = torch.randn(n, k, generator=g).to(DEVICE, dt)
    gu = torch.randn(rows, 2 * k, generator=g).to(DEVICE, dt)
    tiling = (8, 64, 1, 4, 1, 1)
    fused = G.gemv(gu, w, torch.empty(rows, n, device=DEVICE, dtype=torch.float32), tiling, swiglu=True)
    gate, up = gu.float().split(k, dim=1)
    act = (gate * torch.sigmoid(gate) * up).to(dt)
    apart = G.gemv(act, w, torch.empty(rows, n, device=DEVICE, dtype=torch.float32), tiling)
    torch.testing.assert_close(fused, apart, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fused.double(), act.double() @ w.double().T, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="gate \\| up"):
        G.gemv(gu[:, :-2].contiguous(), w, torch.empty(rows, n, device=DEVICE), tiling, swiglu=True)


def test_the_residual_in_the_epilogue():
    """``residual``: the output is residual + the product, the product rounded to the output's
    dtype first and the sum rounded again: the same bits as the GEMV's output added apart in
    float32 (the decoder layer's add), with and without a split of K and with the activation
    in the loads; a residual of another shape is refused. bfloat16 on the GPU, float32 in the
    CPU interpreter (whose float32 -> bfloat16 conversion truncates)."""
    g = torch.Generator().manual_seed(17)
    n, k, rows = 40, 192, 3
    dt = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    w = torch.randn(n, k, generator=g).to(DEVICE, dt)
    x = torch.randn(rows, 2 * k, generator=g).to(DEVICE, dt)
    r = torch.randn(rows, n, generator=g).to(DEVICE, dt)
    for split, swiglu, rowloop, dot in ((1, False, 0, 0), (3, False, 0, 0), (1, True, 0, 0), (1, True, 1, 0),
                                        (1, False, 0, 1), (1, True, 0, 1)):
        xs = x if swiglu else x[:, :k].contiguous()
        bn = 16 if dot else 8
        tiling = (bn, 32, split, 4, 1, 0, rowloop, dot)
        space = G.workspace(rows, n, split, bn, DEVICE, dot=bool(dot))
        plain = G.gemv(xs, w, torch.empty(rows, n, device=DEVICE, dtype=dt), tiling, space, swiglu=swiglu)
        got = G.gemv(xs, w, torch.empty(rows, n, device=DEVICE, dtype=dt), tiling, space, swiglu=swiglu, residual=r)
        assert torch.equal(got, (r.float() + plain.float()).to(dt)), (split, swiglu, rowloop, dot)
        assert not torch.equal(got, plain)
    with pytest.raises(ValueError, match="residual"):
        G.gemv(x[:, :k].contiguous(), w, torch.empty(rows, n, device=DEVICE), (8, 32, 1, 4, 1), residual=r[:, :-1])


def test_a_row_loop_with_the_activation_and_the_lanes_kept_is_refused():
    """``rowloop`` with the activation in its loads: within float32 rounding of the activation
    computed apart, the same bits for a row alone; ``rowloop`` with ``defer`` is refused (the
    lanes of every row would stay in registers)."""
    g = torch.Generator().manual_seed(19)
    n, k, rows = 24, 160, 3
    w = torch.randn(n, k, generator=g).to(DEVICE, torch.float32)
    gu = torch.randn(rows, 2 * k, generator=g).to(DEVICE, torch.float32)
    tiling = (8, 64, 1, 4, 1, 0, 1)
    fused = G.gemv(gu, w, torch.empty(rows, n, device=DEVICE), tiling, swiglu=True)
    gate, up = gu.split(k, dim=1)
    torch.testing.assert_close(fused, (gate * torch.sigmoid(gate) * up) @ w.T, rtol=1e-5, atol=1e-4)
    alone = G.gemv(gu[1:2].clone(), w, torch.empty(1, n, device=DEVICE), tiling, swiglu=True)
    assert torch.equal(alone[0], fused[1])
    with pytest.raises(ValueError, match="one at most"):
        G.gemv(gu[:, :k].contiguous(), w, torch.empty(rows, n, device=DEVICE), (8, 64, 1, 4, 1, 1, 1))


def test_the_tensor_core_tile_serves_up_to_its_rows():
    """``dot``: 16 rows (a verify step of 4 slots and 3 drafts) within float32 rounding of
    float64 (of the activation rounded to the rows' dtype), each row the same bits as alone and
    at 9 rows, with the activation in the loads; 17 rows, or a BN under tl.dot's 16, refused.
    bfloat16 tensor cores on the GPU, float32 in the CPU interpreter (its tl.dot's only)."""
    g = torch.Generator().manual_seed(23)
    n, k = 48, 96
    dt = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    w = torch.randn(n, k, generator=g).to(DEVICE, dt)
    gu = torch.randn(17, 2 * k, generator=g).to(DEVICE, dt)
    tiling = (16, 32, 1, 4, 1, 0, 0, 1)
    full = G.gemv(gu[:16], w, torch.empty(16, n, device=DEVICE), tiling, swiglu=True)
    gate, up = gu[:16].float().split(k, dim=1)
    act = (gate * torch.sigmoid(gate) * up).to(dt).double()
    torch.testing.assert_close(full.double(), act @ w.double().T, rtol=1e-5, atol=1e-4)
    nine = G.gemv(gu[:9].clone(), w, torch.empty(9, n, device=DEVICE), tiling, swiglu=True)
    alone = G.gemv(gu[5:6].clone(), w, torch.empty(1, n, device=DEVICE), tiling, swiglu=True)
    assert torch.equal(nine, full[:9]) and torch.equal(alone[0], full[5])
    with pytest.raises(ValueError, match="at most 16 rows"):
        G.gemv(gu, w, torch.empty(17, n, device=DEVICE), tiling, swiglu=True)
    with pytest.raises(ValueError, match="BN, BK of 16"):
        G.gemv(gu[:2].clone(), w, torch.empty(2, n, device=DEVICE), (8, 32, 1, 4, 1, 0, 0, 1), swiglu=True)


@pytest.mark.parametrize("dot", [0, 1])
def test_slices_added_by_a_second_launch_are_the_tickets_sums(dot):
    """``tickets=False`` (what a captured program runs: no counters): the slices' partial sums
    added in order by ``sum_slices_kernel`` are the same bits as the last ticket's sums, with
    and without the residual; the same through ``gemv_linear`` with a split ``GemvTiling`` (the
    partial sums allocated by the op, its last programs adding them where given the core's ticket
    counters), and each row the same bits alone (``dot``)."""
    g = torch.Generator().manual_seed(29)
    rows, n, k, split = 3, 40, 384, 3
    dt = torch.float32 if dot and DEVICE == "cpu" else torch.bfloat16
    w = torch.randn(n, k, generator=g).to(DEVICE, dt)
    x = torch.randn(rows, k, generator=g).to(DEVICE, dt)
    r = torch.randn(rows, n, generator=g).to(DEVICE, dt)
    tiling = (16, 32, split, 4, 2, 0, 0, dot)
    for residual in (None, r):
        space = G.workspace(rows, n, split, 16, DEVICE, dot=bool(dot))
        want = G.gemv(x, w, torch.empty(rows, n, device=DEVICE, dtype=dt), tiling, space, residual=residual)
        part = torch.empty_like(space[0])
        got = G.gemv(x, w, torch.empty(rows, n, device=DEVICE, dtype=dt), tiling, (part, part), residual=residual,
                     tickets=False)
        assert torch.equal(got, want)
        op = G.gemv_linear(x, w, G.GemvTiling(16, 32, 4, dot=dot, stages=2, split=split), residual=residual)
        assert torch.equal(op, want)
        # With a core's ticket counters: one launch, the same bits, the counters back at zero.
        counters = G.ticket_counters(DEVICE)
        for _ in range(2):
            op = G.gemv_linear(x, w, G.GemvTiling(16, 32, 4, dot=dot, stages=2, split=split), residual=residual,
                               tickets=counters)
            assert torch.equal(op, want) and not counters.any()
    if dot:
        alone = G.gemv_linear(x[1:2].clone(), w, G.GemvTiling(16, 32, 4, dot=1, stages=2, split=split))
        assert torch.equal(alone[0], G.gemv_linear(x, w, G.GemvTiling(16, 32, 4, dot=1, stages=2, split=split))[1])


def test_ticket_counters_too_few_for_the_column_tiles_are_refused():
    w = torch.zeros(64, 32, device=DEVICE)
    with pytest.raises(ValueError, match="column tiles"):
        G.gemv_linear(torch.zeros(1, 32, device=DEVICE), w, G.GemvTiling(16, 16, 4, split=2),
                      tickets=torch.zeros(3, dtype=torch.int32, device=DEVICE))


def test_the_gated_activation_in_the_epilogue():
    """``glu``: over a gated MLP's [gate; up] weight the dot GEMV gives ``silu(gate) * up`` of the
    two products as the projection stores them (rounded to the output's dtype: a no-op in the
    CPU run's float32), within the activation's rounding, each row the same bits alone and among
    others; refused without ``dot``, with a split, a residual or an odd row count."""
    g = torch.Generator().manual_seed(31)
    n, k = 40, 160  # (the last tile of 16 columns half past N)
    dt = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    w = torch.randn(2 * n, k, generator=g).to(DEVICE, dt)
    x = torch.randn(5, k, generator=g).to(DEVICE, dt)
    tiling = (16, 32, 1, 4, 2, 0, 0, 1)
    act = G.gemv(x, w, torch.empty(5, n, device=DEVICE, dtype=dt), tiling, glu=True)
    gate = G.gemv(x, w[:n], torch.empty(5, n, device=DEVICE, dtype=dt), tiling).float()
    up = G.gemv(x, w[n:], torch.empty(5, n, device=DEVICE, dtype=dt), tiling).float()
    torch.testing.assert_close(act.float(), (F.silu(gate) * up).to(dt).float(), rtol=2**-7 if dt != torch.float32
                               else 1e-6, atol=1e-5)
    alone = G.gemv(x[3:4].clone(), w, torch.empty(1, n, device=DEVICE, dtype=dt), tiling, glu=True)
    assert torch.equal(alone[0], act[3])
    op = G.gemv_linear(x, w, G.GemvTiling(16, 32, 4, dot=1, stages=2, glu=1))
    assert torch.equal(op, act)
    for bad, kw in (((16, 32, 1, 4, 2), {}), ((16, 32, 2, 4, 2, 0, 0, 1), {}),
                    (tiling, {"residual": torch.zeros(5, n, device=DEVICE, dtype=dt)})):
        with pytest.raises(ValueError, match="glu"):
            G.gemv(x, w, torch.empty(5, n, device=DEVICE, dtype=dt), bad, glu=True, **kw)
    with pytest.raises(ValueError, match="glu"):
        G.gemv(x, w[:-1], torch.empty(5, n, device=DEVICE, dtype=dt), tiling, glu=True)


@pytest.mark.parametrize("variant,width,bias", [((0, 0, 0), 4, False), ((0, 0, 1), 4, True), ((0, 1, 0), 3, False),
                                                ((0, 0, 1), 2, False)])
def test_the_convolution_in_the_epilogue(variant, width, bias):
    """``conv``: the first D outputs go through a decode step's causal convolution in the GEMV's
    epilogue with the bits of ``gdn.conv1d_decode_step`` run on the product after it, and leave the
    same history rows (shifted in place); the other columns are the product as it is; a row that
    is not live gets zeros there and leaves every history as it was, as do slots of no row; the
    same through ``gemv_conv_linear`` (with the dot variant, also with an input norm in the loads:
    the convolution of the normed product); refused with a split, ``glu``, a residual, a history
    of other shape or a kernel wider than 4."""
    from flare.prepare.kernels import gdn as K

    g = torch.Generator().manual_seed(41 + width)
    n, k, d = 70, 96, 40  # the third tile of 16 columns holds channels and other columns
    dt = torch.float32 if variant[2] and DEVICE == "cpu" else torch.bfloat16
    w = torch.randn(n, k, generator=g).to(DEVICE, dt)
    x = torch.randn(4, k, generator=g).to(DEVICE, dt)
    cw = torch.randn(d, width, generator=g).to(DEVICE, dt)
    cb = torch.randn(d, generator=g).to(DEVICE, dt) if bias else None
    state = torch.randn(6, d, width - 1, generator=g).to(DEVICE, dt)
    slots = torch.tensor([4, 1, 0, 5], device=DEVICE)
    live = torch.tensor([True, True, False, True], device=DEVICE)
    tiling = (16, 32, 1, 4, 2, *variant)

    product = G.gemv(x, w, torch.empty(4, n, device=DEVICE, dtype=dt), tiling)
    want, want_state = product.clone(), state.clone()
    want[:, :d] = K.conv1d_decode_step(product[:, :d], want_state, cw, cb, slots, live)
    got_state = state.clone()
    got = G.gemv(x, w, torch.empty(4, n, device=DEVICE, dtype=dt), tiling,
                 conv=G.Conv(got_state, cw, cb, slots, live))
    assert torch.equal(got, want)
    assert torch.equal(got_state, want_state)
    assert not got[2, :d].any() and torch.equal(got[2, d:], product[2, d:])  # the row that is not live
    assert torch.equal(got_state[[0, 2, 3]], state[[0, 2, 3]])  # its slot's history, and slots of no row
    assert not torch.equal(got_state[[1, 4, 5]], state[[1, 4, 5]])  # the live rows' histories moved
    linear = G.gemv_conv_linear(x, w, G.GemvTiling(16, 32, 4, *variant, stages=2), G.Conv(state, cw, cb, slots, live))
    assert torch.equal(linear, want) and torch.equal(state, want_state)

    conv = G.Conv(state, cw, cb, slots, live)
    out = torch.empty(4, n, device=DEVICE, dtype=dt)
    for bad, kw in (((16, 32, 2, 4, 2, *variant), {}), (tiling, {"residual": torch.zeros(4, n, device=DEVICE, dtype=dt)}),
                    ((16, 32, 1, 4, 2, 0, 0, 1), {"glu": True})):
        with pytest.raises(ValueError, match="convolution"):
            G.gemv(x, w if not kw.get("glu") else torch.cat([w, w]), out, bad, conv=conv, **kw)
    for bad_conv in (conv._replace(state=state[:, :-1]), conv._replace(weight=torch.zeros(d, 5, device=DEVICE, dtype=dt)),
                     conv._replace(live=live[:3])):
        with pytest.raises(ValueError, match="convolution"):
            G.gemv(x, w, out, tiling, conv=bad_conv)
    with pytest.raises(ValueError, match="split"):
        G.gemv_conv_linear(x, w, G.GemvTiling(16, 32, 4, split=2), conv)
    if variant[2]:  # the dot variant: a decoder layer's input norm in the loads too
        nw = torch.randn(k, generator=g).to(DEVICE, dt)
        norm = G.Norm(nw, 1e-6, True)
        normed = G.gemv(x, w, torch.empty(4, n, device=DEVICE, dtype=dt), tiling, norm=norm)
        want_state = state.clone()
        want = normed.clone()
        want[:, :d] = K.conv1d_decode_step(normed[:, :d], want_state, cw, cb, slots, live)
        got = G.gemv_conv_linear(x, w, G.GemvTiling(16, 32, 4, *variant, stages=2), G.Conv(state, cw, cb, slots, live),
                                 norm=norm)
        assert torch.equal(got, want) and torch.equal(state, want_state) and not torch.equal(got, linear)
        with pytest.raises(ValueError, match="residual"):
            G.gemv_conv_linear(x, w, G.GemvTiling(16, 32, 4, *variant, stages=2), G.Conv(state, cw, cb, slots, live),
                               norm=norm._replace(residual=x))


@pytest.mark.parametrize("split,conv,norm", [(1, False, False), (2, False, False), (1, True, False), (1, False, True)])
def test_every_kernel_parameter_is_passed(split, conv, norm):
    """``gemv`` names every parameter of its kernels, defaults included: Inductor's wrapper of a
    user Triton kernel (``wrap_triton`` under torch.compile, how a captured step calls it) refuses
    a call that leaves a constexpr out ("Incorrect number of arguments", seen on the H200 when
    the convolution's two constexprs were left to their defaults)."""
    import inspect

    calls = []

    class Recorder:
        def __init__(self, fn):
            self.names = list(inspect.signature(fn.fn).parameters)

        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append((self.names, len(args), set(kw) - {"num_warps", "num_stages"}))

    n, k, d = 32, 64, 16
    x, w = torch.randn(2, k), torch.randn(n, k)
    c = G.Conv(torch.zeros(3, d, 3), torch.zeros(d, 4), None, torch.tensor([0, 1]),
               torch.tensor([True, True])) if conv else None
    nm = G.Norm(torch.ones(k), 1e-6, True, torch.zeros(2, k), torch.empty(2, k)) if norm else None
    G.gemv(x, w, torch.empty(2, n), (16, 32, split, 4, 1) + ((0, 0, 1) if norm else ()), kernel=Recorder(G.gemv_kernel),
           tickets=False, sum_kernel=Recorder(G.sum_slices_kernel), conv=c, norm=nm)
    assert len(calls) == (2 if split > 1 else 1)
    for names, positional, keywords in calls:
        assert set(names[:positional]) | keywords == set(names), set(names) - set(names[:positional]) - keywords


@pytest.mark.parametrize("zero_centred,add,glu", [(True, True, True), (False, True, True), (True, False, False)])
def test_the_norm_in_the_loads(zero_centred, add, glu):
    """``norm``: the dot GEMV of rows put through an RMS norm in its loads (with a residual, of
    ``residual + x``, that sum written bit for bit) gives the product of the norm's output within
    the rounding of the two orders, each row the same bits alone and among others, through
    ``gemv`` and ``gemv_norm_linear``; refused with a split without ticket counters, without
    ``dot``, with the activation in the loads, with a weight of another length, in float16 (whose
    range the scaled rows may leave before the RMS scales them) or writing the sum over an input."""
    g = torch.Generator().manual_seed(57)
    n, k, rows, eps = 40, 150, 5, 1e-6  # (K not a multiple of the K step: its tail masked)
    dt = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    w = (torch.randn(2 * n if glu else n, k, generator=g) * k ** -0.5).to(DEVICE, dt)  # (outputs of order 1)
    x = (3 * torch.randn(rows, k, generator=g)).to(DEVICE, dt)
    r = torch.randn(rows, k, generator=g).to(DEVICE, dt) if add else None
    nw = (0.5 * torch.randn(k, generator=g)).to(DEVICE, dt)
    tiling = (16, 32, 1, 4, 2, 0, 0, 1)

    h = ((r.float() + x.float()).to(dt) if add else x).float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = (y * (1 + nw.float()) if zero_centred else y.to(dt).float() * nw.float()).to(dt)
    want = G.gemv(y, w, torch.empty(rows, n, device=DEVICE, dtype=dt), tiling, glu=glu).float()

    def run(xs, rs):
        total = torch.empty_like(xs) if add else None
        out = G.gemv(xs, w, torch.empty(xs.shape[0], n, device=DEVICE, dtype=dt), tiling, glu=glu,
                     norm=G.Norm(nw, eps, zero_centred, rs, total))
        return out, total

    got, total = run(x, r)
    tol = {"rtol": 2**-6, "atol": 2**-6} if dt != torch.float32 else {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(got.float(), want, **tol)
    assert not torch.equal(got.float(), G.gemv(x, w, torch.empty(rows, n, device=DEVICE, dtype=dt), tiling,
                                               glu=glu).float())  # (the norm is applied)
    if add:
        assert torch.equal(total, (r.float() + x.float()).to(dt))
    alone, _ = run(x[3:4].clone(), None if r is None else r[3:4].clone())
    assert torch.equal(alone[0], got[3])
    op, op_total = G.gemv_norm_linear(x, w, G.GemvTiling(16, 32, 4, dot=1, stages=2, glu=int(glu)),
                                      G.Norm(nw, eps, zero_centred, r))
    assert torch.equal(op, got) and (op_total is None if not add else torch.equal(op_total, total))

    out = torch.empty(rows, n, device=DEVICE, dtype=dt)
    for bad, kw in (((16, 32, 2, 4, 2, 0, 0, 1), {"tickets": False}), ((16, 32, 1, 4, 2), {})):
        with pytest.raises(ValueError, match="norm"):
            G.gemv(x, w, out, bad, glu=glu and bad[2] == 1 and len(bad) > 5, norm=G.Norm(nw, eps, zero_centred), **kw)
    with pytest.raises(ValueError, match="norm"):
        G.gemv(torch.cat([x, x], -1), w, out, tiling[:5] + (0, 0, 1), swiglu=True, norm=G.Norm(nw, eps, zero_centred))
    with pytest.raises(ValueError, match="norm"):
        G.gemv(x, w, out, tiling, glu=glu, norm=G.Norm(nw[:-1], eps, zero_centred))
    with pytest.raises(ValueError, match="norm"):
        G.gemv(x.half(), w.half(), out.half(), tiling, glu=glu, norm=G.Norm(nw.half(), eps, zero_centred))
    if add:
        with pytest.raises(ValueError, match="norm"):
            G.gemv(x, w, out, tiling, glu=glu, norm=G.Norm(nw, eps, zero_centred, r, x))


@pytest.mark.parametrize("zero_centred,add,split", [(True, True, 2), (False, True, 3), (False, False, 4)])
def test_the_norm_in_the_loads_with_a_split(zero_centred, add, split):
    """A split dot GEMV with the norm in its loads: each slice's sums of squares added with its
    partial sums by the last ticket's program, then scaled: the unsplit product within float32
    rounding (another order), the sum written bit for bit by the slices of column tile 0, each row
    the same bits alone and among others, run to run, the counters left at zero; through
    ``gemv_norm_linear`` with the core's counters the same bits; refused there without counters or
    with ``glu``, and by ``gemv`` with a sums-of-squares workspace of other sizes."""
    g = torch.Generator().manual_seed(58)
    n, k, rows, eps = 72, 200, 4, 1e-6  # (3 column tiles; K's last slice partly masked)
    dt = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(DEVICE, dt)
    x = (3 * torch.randn(rows, k, generator=g)).to(DEVICE, dt)
    r = torch.randn(rows, k, generator=g).to(DEVICE, dt) if add else None
    nw = (0.5 * torch.randn(k, generator=g)).to(DEVICE, dt)
    tiling = (32, 32, split, 4, 2, 0, 0, 1)
    assert G.fills_slices(k, split, 32)

    def run(xs, rs, t=tiling, space=None):
        total = torch.empty_like(xs) if add else None
        out = G.gemv(xs, w, torch.empty(xs.shape[0], n, device=DEVICE, dtype=dt), t, space=space,
                     norm=G.Norm(nw, eps, zero_centred, rs, total))
        return out, total

    space = G.workspace(rows, n, split, 32, DEVICE, dot=True, norm=True)
    got, total = run(x, r, space=space)
    assert not space[1].any()  # (the counters back at zero)
    unsplit, unsplit_total = run(x, r, t=(32, 32, 1, 4, 2, 0, 0, 1))
    tol = {"rtol": 2**-7, "atol": 2**-7} if dt != torch.float32 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got.float(), unsplit.float(), **tol)
    if add:
        assert torch.equal(total, unsplit_total) and torch.equal(total, (r.float() + x.float()).to(dt))
    again, _ = run(x, r, space=space)
    assert torch.equal(again, got)
    alone, _ = run(x[2:3].clone(), None if r is None else r[2:3].clone())
    assert torch.equal(alone[0], got[2])
    tickets = G.ticket_counters(DEVICE)
    op, op_total = G.gemv_norm_linear(x, w, G.GemvTiling(32, 32, 4, dot=1, stages=2, split=split),
                                      G.Norm(nw, eps, zero_centred, r), tickets=tickets)
    assert torch.equal(op, got) and (op_total is None if not add else torch.equal(op_total, total))
    assert not tickets.any()
    with pytest.raises(ValueError, match="needs ticket counters"):
        G.gemv_norm_linear(x, w, G.GemvTiling(32, 32, 4, dot=1, stages=2, split=split), G.Norm(nw, eps, zero_centred))
    with pytest.raises(ValueError, match="glu takes no split"):
        G.gemv_norm_linear(x, w, G.GemvTiling(32, 32, 4, dot=1, stages=2, split=split, glu=1),
                           G.Norm(nw, eps, zero_centred), tickets=tickets)
    with pytest.raises(ValueError, match="sums of squares"):
        run(x, r, space=(*space[:2], space[2][:, :2]))
