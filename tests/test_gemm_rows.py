"""kernels/gemm.py: the unsplit GEMM and the choice of which linear layers use it.

On the CPU the kernel runs in Triton's interpreter (float32: its bfloat16 ``tl.dot`` is
wrong), which checks its arithmetic and masking; that its rows are the same bits whatever
the row count, and equal to cuBLAS's unsplit kernels, is a property of the GPU
(bench/gemm_invariance.py, tests/gpu). The choice is tested with the layers' own
``F.linear`` standing in for cuBLAS."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F

pytest.importorskip("triton", reason="triton is not installed")

import triton  # noqa: E402

from flare.prepare import prompt_rows  # noqa: E402
from flare.prepare.kernels import gemm  # noqa: E402
from flare.prepare.kernels.gemv import ticket_counters  # noqa: E402
from flare.prepare.recipes.fused import FusedLinear, Part  # noqa: E402
from tests.conftest import count_calls  # noqa: E402

# The interpreter on the CPU (conftest.py sets TRITON_INTERPRET=1 without CUDA), the GPU on the device.
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda"


@pytest.mark.parametrize("rows,k,n,bias", [(1, 64, 40, False), (37, 96, 50, True), (130, 200, 129, True)])
def test_nonsplit_linear_is_a_linear_layer(rows, k, n, bias):
    """Masked edges (rows, K and N not multiples of the tiles), both tilings, the bias
    added before the rounding, leading dimensions kept."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, k, generator=g, dtype=torch.float64).float()
    w = torch.randn(n, k, generator=g, dtype=torch.float64).float()
    b = torch.randn(n, generator=g).float().to(DEVICE) if bias else None
    x, w = x.to(DEVICE), w.to(DEVICE)
    y = gemm.nonsplit_linear(x, w, b)
    assert y.shape == (2, rows, n)
    torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("tiling", [(16, 64, 128, 4), (32, 32, 64, 4, 4)])
def test_whole_tiles_load_without_masks_and_give_the_same_bits(tiling):
    """K a multiple of BK and N of BN: the kernel drops the loads' K masks and the weight's
    (EVEN_K, EVEN_N, what ``launch`` passes); the rows are the bits of the masked loads."""
    bm, bn, bk, warps = tiling[:4]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(37, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (torch.randn(128, 256, generator=g) / 16).to(torch.bfloat16).to(DEVICE)
    out = torch.empty((37, 128), dtype=x.dtype, device=DEVICE)
    passed = []

    class Recording:  # the kernel as launch() launches it, its constexprs recorded
        def __getitem__(self, grid):
            def run(*args, **kw):
                passed.append((kw["EVEN_K"], kw["EVEN_N"]))
                return gemm.nonsplit_kernel[grid](*args, **kw)
            return run

    gemm.launch(x, w, None, out, tiling, kernel=Recording())
    assert passed == [(True, True)]
    gemm.launch(x, w[:100], None, torch.empty((37, 100), dtype=x.dtype, device=DEVICE), tiling, kernel=Recording())
    assert passed[-1] == (True, False)  # 100 columns: the weight's loads keep their column mask
    masked = torch.empty_like(out)
    gemm.nonsplit_kernel[(triton.cdiv(37, bm), triton.cdiv(128, bn))](
        x, w, w, masked, 37, 128, 256, x.stride(0), w.stride(0), masked.stride(0), BM=bm, BN=bn, BK=bk,
        PRECISION="tf32", HAS_BIAS=False, EVEN_K=False, EVEN_N=False, num_warps=warps)
    assert torch.equal(out, masked)
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)


def test_linear_layers_switch_only_in_prompt_programs_at_their_split_row_counts(monkeypatch):
    """``make_row_invariant`` measures each shape once, swaps the class of the layers that
    split (plain and fused linears), and their forward takes the unsplit kernel only while a
    prompt program runs at one of those row counts."""
    calls = []
    measured = []

    def fake_split_rows(weight, bias, counts):
        measured.append(tuple(weight.shape))
        return frozenset({16, 64}) if weight.shape[1] == 96 else frozenset()

    monkeypatch.setattr(gemm, "split_rows", fake_split_rows)
    real = gemm.nonsplit_linear
    monkeypatch.setattr(gemm, "nonsplit_linear",
                        lambda x, w, b=None, t=None: calls.append(x.shape[:-1]) or real(x, w, b, t))
    fused = FusedLinear((Part("q_proj", 24), Part("k_proj", 8)), 96, True, torch.float32)
    nn.init.normal_(fused.weight)
    nn.init.normal_(fused.bias)
    layers = [nn.ModuleDict({"o": nn.Linear(96, 32), "down": nn.Linear(48, 32), "qkv": fused}).to(DEVICE),
              nn.ModuleDict({"o": nn.Linear(96, 32)}).to(DEVICE)]
    found = gemm.make_row_invariant(layers, [16, 64, 128])
    assert sorted(found) == ["0.o", "0.qkv", "1.o"] and found["0.o"] == frozenset({16, 64})
    assert sorted(measured) == [(32, 48), (32, 96)]  # one measurement per (shape, dtype), the fused one too
    assert type(layers[0]["down"]) is nn.Linear and type(layers[0]["o"]).__name__ == "RowInvariantLinear"
    assert isinstance(layers[0]["qkv"], FusedLinear)
    o = layers[0]["o"]
    x = torch.randn(1, 16, 96, device=DEVICE)
    plain = F.linear(x, o.weight, o.bias)
    assert torch.equal(o(x), plain) and not calls  # not a prompt program
    with prompt_rows.marked(True):
        o(torch.randn(1, 128, 96, device=DEVICE))  # a prompt program at a row count cuBLAS does not split
        assert not calls
        torch.testing.assert_close(o(x), plain, atol=1e-4, rtol=1e-5)
        layers[0]["qkv"](torch.randn(64, 96, device=DEVICE))
    assert calls == [(1, 16), (64,)]
    assert not prompt_rows.active()
    assert gemm.make_row_invariant(layers, [16]) == {}  # already switched: left as they are


def test_program_set_marks_prompt_programs_while_they_run():
    """``ProgramSet.callable`` marks prefill, pack and score programs (their rows are prompt
    tokens) while they run, and no other kind."""
    from flare.core.manifest import ProgramKind
    from flare.prepare.programs import ProgramSet

    seen = {}
    programs = object.__new__(ProgramSet)  # only the dispatch is exercised: no model is built
    for kind in ProgramKind:
        setattr(programs, kind.value, lambda capacity, kind=kind: seen.__setitem__(kind, prompt_rows.active()))
    for kind in ProgramKind:
        programs.callable(kind, 1)()
    assert {k for k, on in seen.items() if on} == {ProgramKind.prefill, ProgramKind.pack, ProgramKind.score}
    assert len(seen) == len(ProgramKind) and not prompt_rows.active()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuBLAS's split-K choice is the GPU's")
@pytest.mark.parametrize("measure", [False, True])
def test_prompt_rows_are_the_same_bits_at_every_capacity_on_the_gpu(measure):
    """On the GPU, compiled as the programs are (one graph, no break): an o_proj-like layer
    (K large against N, which the H200's cuBLAS splits for 16-64 rows), one with a bias and
    a wide one, made row invariant for the capacities 16 ... 512, give every row the same
    bits at each capacity inside a prompt program; outside one they are cuBLAS's. ``measure``
    (``--prompt-gemms measure``): with the tilings timed fastest at each split count, too."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4096, 2048, bias=False), nn.Linear(2048, 2048), nn.Linear(2048, 5120, bias=False))
    block = block.to(dev, torch.bfloat16)
    capacities = (16, 32, 64, 128, 256, 512)
    found = gemm.make_row_invariant([block], capacities, measure=measure)
    print("tilings timed:", {i: m.flare_split_tiling for i, m in enumerate(block) if hasattr(m, "flare_split_tiling")})
    assert found.get("0.0"), found  # bench/results/gemm-row-invariance-2026-12-02.json: split at 16-64 rows
    compiled = torch.compile(block, dynamic=False, fullgraph=True)
    x = torch.randn(512, 4096, device=dev, dtype=torch.bfloat16)
    with torch.inference_mode():
        with prompt_rows.marked(True):
            outs = {c: compiled(x[:c]) for c in capacities}
        plain = x[:16]
        for layer in block:
            plain = F.linear(plain, layer.weight, layer.bias)
        assert torch.equal(compiled(x[:16]), plain)  # a decode-sized step outside a prompt program
    for c in capacities:
        assert torch.equal(outs[c], outs[512][:c]), c


def test_prompt_rows_take_the_unsplit_tiling_that_times_fastest_with_the_same_bits(monkeypatch):
    """Where cuBLAS splits a layer at a prompt row count, preparation on a GPU (here: a timer
    given) times ``PROMPT_TILINGS`` against ``tiles``' tiling and takes the fastest under 0.97 x
    its time; a tiling whose rows differ is never timed nor taken; the layer's prompt rows then
    run with it."""
    slow_bits = (64, 64, 64, 4, 4)  # made to give other bits below: the fastest, never taken
    times = {(64, slow_bits): 0.1, (64, (16, 128, 128, 4, 4)): 0.5, (64, (32, 64, 128, 4, 4)): 0.6,
             (16, (16, 32, 128, 4, 4)): 0.98}  # at 16 rows within the margin: tiles' stays
    real = gemm.nonsplit_linear
    seen, timed = [], []

    def nonsplit(x, w, b=None, t=None):
        seen.append((x.shape[0], t))
        y = real(x, w, b, t)
        return y + 1 if t == slow_bits else y

    def timer(fn):
        fn()
        timed.append(seen[-1])
        return times.get(seen[-1], 1.0)

    monkeypatch.setattr(gemm, "nonsplit_linear", nonsplit)
    monkeypatch.setattr(gemm, "split_rows", lambda w, b, counts, remedy="": frozenset({16, 64}))
    layers = [nn.ModuleDict({"down": nn.Linear(160, 48, bias=False)}).to(DEVICE)]
    assert gemm.make_row_invariant(layers, [16, 64, 128], measure=True, timer=timer) == {"0.down": frozenset({16, 64})}
    down = layers[0]["down"]
    assert down.flare_split_tiling == {64: (16, 128, 128, 4, 4)}
    # Timed at 64 rows: tiles' own first, then each tiling whose rows are its bits (on the GPU every
    # one should be; the interpreter rounds each K step's dot, so there only those of its K step).
    base = gemm.tiles(64, 160)
    w, _, x = gemm._random_operands(down.weight, None, 64, seed=3)
    same = [t for t in gemm.PROMPT_TILINGS if t not in ((*base, 3), slow_bits)
            and torch.equal(real(x, w, None, t), real(x, w, None, base))]
    assert [t for rows, t in timed if rows == 64] == [base, *same] and (16, 128, 128, 4, 4) in same
    seen.clear()
    with prompt_rows.marked(True):
        x = torch.randn(64, 160, device=DEVICE)
        assert torch.equal(down(x), real(x, down.weight, None))
        down(torch.randn(16, 160, device=DEVICE))
    assert seen == [(64, (16, 128, 128, 4, 4)), (16, None)]


@pytest.mark.parametrize("tiling", gemm.STEP_TILINGS)
def test_every_step_tiling_is_a_linear_layer(tiling):
    """The tilings tried for decode and verify steps, at step-sized row counts."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(70, 200, generator=g, dtype=torch.float64).float().to(DEVICE)
    b = torch.randn(70, generator=g).float().to(DEVICE)
    for rows in (1, 3, 4):
        x = torch.randn(rows, 200, generator=g, dtype=torch.float64).float().to(DEVICE)
        torch.testing.assert_close(gemm.nonsplit_linear(x, w, b, tiling), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_step_gemms_switch_where_they_time_faster_than_cublas(monkeypatch):
    """``choose_step_gemms`` times cuBLAS and each tiling once per (shape, dtype, rows) and gives
    a layer one family for all its step row counts (``step_choice``) where its summed time is at
    most 0.97 x cuBLAS's: the unsplit GEMM at each count, or cuBLAS at a count where it does not
    split K (the same bits); the layer then runs decode-sized rows outside prompt programs with
    that tiling, and everything else as before."""
    k = len(gemm.STEP_TILINGS)
    # Measurement order: layer o at 1 then 4 rows, layer down at 1 then 4 rows (cuBLAS first).
    groups = iter([[10, 9, 5, 8, 8, 8], [9.5] + [9.9] * k, [1] + [2] * k, [10, 4] + [5] * (k - 1)])
    pending = []

    def timer(fn):
        if not pending:
            pending.extend(next(groups))
        return pending.pop(0)

    # cuBLAS splits o's K at four rows (other bits than the unsplit GEMM), down's nowhere.
    monkeypatch.setattr(gemm, "split_rows",
                        lambda w, b, counts, remedy="": frozenset({4}) if w.shape[1] == 96 else frozenset())
    monkeypatch.setattr(gemm, "_cublas_same_rows", lambda *a: True)
    layers = [nn.ModuleDict({"o": nn.Linear(96, 32), "down": nn.Linear(48, 32)}).to(DEVICE)]
    found = gemm.choose_step_gemms(layers, [4, 1], timer=timer)
    # o: 5 + 9.9 unsplit against cuBLAS's 19.5 (and at four rows the unsplit GEMM, not cuBLAS,
    # though cuBLAS is faster there, 9.5: its split rows would differ from the one-row step's);
    # down: cuBLAS at one row (unsplit there, and faster), the GEMM at four.
    assert found == {"0.o": {1: gemm.STEP_TILINGS[1], 4: gemm.STEP_TILINGS[0]}, "0.down": {4: gemm.STEP_TILINGS[0]}}
    assert not pending and next(groups, None) is None
    calls = []
    real = gemm.nonsplit_linear
    monkeypatch.setattr(gemm, "nonsplit_linear", lambda x, w, b=None, t=None: calls.append((x.shape[0], t))
                        or real(x, w, b, t))
    o, down = layers[0]["o"], layers[0]["down"]
    one, two = torch.randn(1, 96, device=DEVICE), torch.randn(2, 96, device=DEVICE)
    torch.testing.assert_close(o(one), F.linear(one, o.weight, o.bias), atol=1e-4, rtol=1e-5)
    assert torch.equal(o(two), F.linear(two, o.weight, o.bias))  # not a step row count of this core
    with prompt_rows.marked(True):  # a prompt program: no step tiling
        assert torch.equal(o(one), F.linear(one, o.weight, o.bias))
    down(torch.randn(4, 48, device=DEVICE))
    down(torch.randn(1, 48, device=DEVICE))
    assert calls == [(1, gemm.STEP_TILINGS[1]), (4, gemm.STEP_TILINGS[0])]
    # Prompt rows still measured for the layers switched here (the two choices compose).
    monkeypatch.setattr(gemm, "split_rows", lambda w, b, counts: frozenset({16}) if w.shape[1] == 96 else frozenset())
    assert gemm.make_row_invariant(layers, [16]) == {"0.o": frozenset({16})}
    assert o.flare_step_tiling == {1: gemm.STEP_TILINGS[1], 4: gemm.STEP_TILINGS[0]}


def _gemvs_for(k: int) -> list:
    """The GEMV tilings offered for a weight of K = ``k`` (a split must leave no slice empty)."""
    return [t for t in gemm.STEP_GEMV_TILINGS if t.fits(k)]


def test_a_layer_without_bias_can_take_the_gemv_at_step_rows(monkeypatch):
    """Without a bias, ``step_tiling`` also times ``STEP_GEMV_TILINGS``; where one is fastest
    the layer's step rows go through ``gemv_linear`` (the custom op compiled layers call),
    within float32 rounding of ``F.linear``; a layer with a bias is never offered one."""
    from flare.prepare.kernels.gemv import GemvTiling

    gemvs = _gemvs_for(96)
    k, v = len(gemm.STEP_TILINGS), len(gemvs)
    times = iter([10] + [9] * k + [8] * (v - 1) + [3])  # cuBLAS, the GEMMs, the GEMVs: the last wins
    layers = [nn.ModuleDict({"o": nn.Linear(96, 32, bias=False)}).to(DEVICE)]
    counters = ticket_counters(DEVICE)  # the core's, which its steps' split GEMVs take
    found = gemm.choose_step_gemms(layers, [2], timer=lambda fn: next(times), tickets=counters)
    assert found == {"0.o": {2: gemvs[-1]}} and isinstance(found["0.o"][2], GemvTiling)
    assert next(times, None) is None
    o = layers[0]["o"]
    x = torch.randn(2, 96, device=DEVICE)
    calls = []
    real = gemm.gemv_linear
    monkeypatch.setattr(gemm, "gemv_linear", lambda x, w, t, **kw: calls.append((x.shape[0], t, kw)) or real(x, w, t, **kw))
    eager = o(x)
    assert calls == [(2, gemvs[-1], {"tickets": counters})] and not counters.any()
    torch.testing.assert_close(eager, F.linear(x, o.weight), atol=1e-4, rtol=1e-5)
    if torch.cuda.is_available():  # compiled as the programs are (in inference mode: the custom op
        # has no autograd formula): one graph, the same bits (the CPU interpreter cannot run a
        # Triton op under torch.compile)
        with torch.inference_mode():
            assert torch.equal(torch.compile(o, dynamic=False, fullgraph=True)(x), eager)
    biased = nn.Linear(96, 32).to(DEVICE)
    _, measured = gemm.step_tiling(biased.weight, biased.bias, 2, timer=lambda fn: 1.0)
    assert not any(isinstance(t, GemvTiling) for t in measured)
    # More rows than the GEMV holds (a verify step's 24): never offered, and refused if asked.
    _, measured = gemm.step_tiling(o.weight, None, 24, timer=lambda fn: 1.0)
    assert not any(isinstance(t, GemvTiling) for t in measured)
    with pytest.raises(ValueError, match="at most 8 rows"):
        real(torch.randn(24, 96, device=DEVICE), o.weight, gemm.STEP_GEMV_TILINGS[0])


def test_a_gemv_faster_at_one_row_only_is_taken_at_every_count_or_not_at_all(monkeypatch):
    """A row's bits must not depend on its step's row count: the GEMV that wins at one row takes
    the four-row steps too where its summed time wins (never the GEMV at one row and cuBLAS or
    the GEMM at four, as choosing per count did); where its four-row time makes it lose, the
    unsplit GEMM takes both counts; a GEMV tiling is offered only where every count fits it."""
    gemvs = _gemvs_for(96)
    k, v = len(gemm.STEP_TILINGS), len(gemvs)
    monkeypatch.setattr(gemm, "split_rows", lambda w, b, counts, remedy="": frozenset(counts))
    weight = torch.randn(32, 96, device=DEVICE)
    last = gemvs[-1]
    one = [10] + [9] * k + [8] * (v - 1) + [3]
    for four, want in (([10] + [9] * k + [20] * (v - 1) + [12], {1: last, 4: last}),
                       ([10] + [9] * k + [20] * (v - 1) + [17], {1: gemm.STEP_TILINGS[0], 4: gemm.STEP_TILINGS[0]})):
        times = iter(one + four)
        chosen, _ = gemm.step_choice(weight, None, [1, 4], timer=lambda fn: next(times))
        assert chosen == want and next(times, None) is None
    # A verify step of 24 rows: no GEMV offered, not even the 16-row tensor-core tile (the GEMMs
    # win here: cuBLAS 2, the rest 1).
    times = iter([2.0] + [1.0] * (k + v) + [2.0] + [1.0] * k)
    chosen, measured = gemm.step_choice(weight, None, [4, 24], timer=lambda fn: next(times))
    assert chosen == {4: gemm.STEP_TILINGS[0], 24: gemm.STEP_TILINGS[0]} and next(times, None) is None
    assert not any(isinstance(t, gemm.GemvTiling) for t in measured[24])


def test_a_down_projection_that_folds_the_residual_charges_cublas_the_add(monkeypatch):
    """``residual_fold``: cuBLAS and the unsplit GEMM pay the residual add's kernel too (timed
    after the products, at each count), the GEMV, whose epilogue adds it, does not: a GEMV 2 %
    slower than cuBLAS alone wins against cuBLAS plus the add, and loses without the fold."""
    gemvs = _gemvs_for(96)
    k, v = len(gemm.STEP_TILINGS), len(gemvs)
    monkeypatch.setattr(gemm, "split_rows", lambda w, b, counts, remedy="": frozenset())
    monkeypatch.setattr(gemm, "_cublas_same_rows", lambda *a: True)
    weight = torch.randn(32, 96, device=DEVICE)
    products = [10.0] + [20.0] * k + [20.0] * (v - 1) + [10.2]
    times = iter(products + [2.0])
    chosen, measured = gemm.step_choice(weight, None, [1], timer=lambda fn: next(times), residual_fold=True)
    assert chosen == {1: gemvs[-1]} and next(times, None) is None
    assert measured[1]["add"] == 2.0 and measured["sums"] == {"cublas_ms": 12.0, "chosen_ms": 10.2}
    times = iter(products)
    chosen, measured = gemm.step_choice(weight, None, [1], timer=lambda fn: next(times))
    assert chosen == {} and measured["sums"] == {"cublas_ms": 10.0, "chosen_ms": 10.0}


def test_where_cublas_rows_differ_between_counts_another_family_is_taken(monkeypatch):
    """cuBLAS as it is counts as one family only where its rows have the same bits at every
    count: where they differ (it splits K at some counts), the unsplit GEMM is taken even when
    it is no faster than cuBLAS."""
    k = len(gemm.STEP_TILINGS)
    monkeypatch.setattr(gemm, "split_rows", lambda w, b, counts, remedy="": frozenset())
    weight, bias = torch.randn(32, 96, device=DEVICE), torch.randn(32, device=DEVICE)
    monkeypatch.setattr(gemm, "_cublas_same_rows", lambda *a: True)
    times = iter([1.0] * (2 * (k + 1)))
    assert gemm.step_choice(weight, bias, [1, 4], timer=lambda fn: next(times))[0] == {}  # a tie: cuBLAS stays
    monkeypatch.setattr(gemm, "_cublas_same_rows", lambda *a: False)
    times = iter([1.0] * (2 * (k + 1)))
    # cuBLAS's rows differ between one row and four: the unsplit GEMM at both, though it only ties.
    assert gemm.step_choice(weight, bias, [1, 4], timer=lambda fn: next(times))[0] == {
        1: gemm.STEP_TILINGS[0], 4: gemm.STEP_TILINGS[0]}


def test_forced_gemv_takes_every_step_row_count():
    """``--step-gemms gemv``: every layer without a bias on ``FORCED_GEMV`` at each step row
    count (one family, so a row's bits do not depend on its batch); refused where a count
    exceeds the GEMV's rows (a verify step of several drafts); layers with a bias keep cuBLAS."""
    layers = [nn.ModuleDict({"o": nn.Linear(96, 32, bias=False), "b": nn.Linear(96, 32)}).to(DEVICE)]
    with pytest.raises(ValueError, match="exceed the GEMV"):
        gemm.force_step_gemv(layers, [4, 24])
    assert gemm.force_step_gemv(layers, [4, 1, 2]) == {"0.o": {c: gemm.FORCED_GEMV for c in (1, 2, 4)}}
    assert not hasattr(layers[0]["b"], "flare_step_tiling")


@pytest.mark.parametrize("tiling", gemm.STEP_GEMV_TILINGS)
def test_every_step_gemv_tiling_is_a_linear_layer(tiling):
    from flare.prepare.kernels.gemv import gemv_linear

    g = torch.Generator().manual_seed(4)
    k = 200 if tiling.split == 1 else 3000  # every slice of a split filled
    w = torch.randn(70, k, generator=g, dtype=torch.float64).float().to(DEVICE)
    for rows in (1, 3, 4):
        x = torch.randn(rows, k, generator=g, dtype=torch.float64).float().to(DEVICE)
        torch.testing.assert_close(gemv_linear(x, w, tiling), F.linear(x, w), atol=1e-4, rtol=1e-5)


def _replays_bitwise(layer: nn.Module, cases, check=lambda: True) -> None:
    """``layer`` compiled as the step programs are (one graph, no break), run on a side stream,
    captured in a CUDA graph on the first case's input, then replayed with each case's input
    written into it: each gives that case's eager output bit for bit (and ``check()`` holds)."""
    compiled = torch.compile(layer, dynamic=False, fullgraph=True)
    static = cases[0][0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        assert torch.equal(compiled(static), cases[0][1])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = compiled(static)
    for src, want in cases:
        static.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles and captures a CUDA graph")
@pytest.mark.parametrize("tickets", [False, True])
def test_a_split_step_gemv_compiles_and_replays_in_a_cuda_graph(tickets, monkeypatch):
    """A layer on a split tensor-core GEMV (its partial sums allocated inside the op, a second
    launch adding them, or its last programs with the core's ticket counters) compiled as the
    programs are and captured in a CUDA graph: each replay the eager bits, for the captured
    input and for new values written into it, the counters back at zero after each."""
    from flare.prepare.kernels.gemv import GemvTiling

    torch.manual_seed(0)
    layer = nn.Linear(4096, 512, bias=False).to("cuda", torch.bfloat16)
    gemm._switch(layer)
    layer.flare_step_tiling = {2: GemvTiling(32, 128, 4, dot=1, stages=4, split=4)}
    counters = ticket_counters("cuda")
    x = torch.randn(2, 4096, device="cuda", dtype=torch.bfloat16)
    other = torch.randn_like(x)
    calls = []
    real = gemm.gemv_linear
    monkeypatch.setattr(gemm, "gemv_linear", lambda *a, **kw: calls.append(kw["tickets"]) or real(*a, **kw))
    with torch.inference_mode():
        apart = layer(x)  # the slices added by a second launch
        layer.flare_tickets = counters if tickets else None
        eager, eager_other = layer(x), layer(other)
        assert len(calls) == 3 and calls[0] is None and all(c is layer.flare_tickets for c in calls[1:])
        assert torch.equal(eager, apart)
        torch.testing.assert_close(eager, F.linear(x, layer.weight), atol=0.05, rtol=0.02)
        _replays_bitwise(layer, [(x, eager), (other, eager_other), (x, eager)], lambda: not counters.any())


def test_a_deferred_step_gemv_tiling_reaches_the_kernel():
    """``GemvTiling``'s ``defer`` is the kernel's: the custom op gives the bits of ``gemv`` with
    the lanes kept through the loop, not those reduced at every step (float32, K over several
    steps: the two orders differ here)."""
    from flare.prepare.kernels import gemv as G

    g = torch.Generator().manual_seed(5)
    w = torch.randn(40, 3000, generator=g).to(DEVICE)
    x = torch.randn(2, 3000, generator=g).to(DEVICE)
    got = G.gemv_linear(x, w, G.GemvTiling(8, 256, 4, 1))
    deferred = G.gemv(x, w, torch.empty(2, 40, device=DEVICE), (8, 256, 1, 4, 1, 1))
    stepwise = G.gemv(x, w, torch.empty(2, 40, device=DEVICE), (8, 256, 1, 4, 1, 0))
    assert torch.equal(got, deferred) and not torch.equal(got, stepwise)


def _gated_mlp_pair():
    """A Llama MLP and its fused twin ([gate; up] in one weight), the same weights."""
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from flare.prepare.recipes.fused import fuse_mlp

    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=96)
    torch.manual_seed(0)
    plain = LlamaMLP(cfg).to(DEVICE)
    mlp = LlamaMLP(cfg).to(DEVICE)
    mlp.load_state_dict(plain.state_dict())
    assert fuse_mlp(mlp)
    mlp.gate_up_proj.weight.data = torch.cat([plain.gate_proj.weight, plain.up_proj.weight]).to(DEVICE)
    return plain, mlp


def test_a_gated_mlp_whose_down_projection_takes_the_gemv_folds_its_activation(monkeypatch):
    """A fused gated MLP (recipes/fused.py) at a step row count where ``down_proj`` takes the
    GEMV runs the down projection with silu(gate) * up computed in the GEMV's loads (one
    launch fewer), within float32 rounding of the MLP as written; not in a prompt program,
    at another row count, under a forward hook (a tensor-parallel all-reduce), or with a
    GEMV of fewer than ``FOLD_MIN_BN`` columns a program; the tensor-core tile (``dot``) takes
    the activation computed apart."""
    from flare.prepare import prompt_rows
    from flare.prepare.kernels.gemv import GemvTiling
    from flare.prepare.recipes.fused import mlp_residual as fused_mlp_residual

    plain, mlp = _gated_mlp_pair()
    gemm._switch(mlp.down_proj)
    tiling = GemvTiling(8, 64, 4, 1)
    mlp.down_proj.flare_step_tiling = {2: tiling}
    calls = []
    real = gemm.gemv_linear
    monkeypatch.setattr(gemm, "gemv_linear", lambda *a, **kw: calls.append((a[0].shape, kw)) or real(*a, **kw))
    x = torch.randn(2, 64, device=DEVICE)
    with torch.no_grad():
        want = plain(x)
        torch.testing.assert_close(mlp(x), want, atol=1e-4, rtol=1e-5)
        assert calls == [((2, 192), {"swiglu": True, "residual": None, "tickets": None})]
        calls.clear()
        with prompt_rows.marked(True):
            torch.testing.assert_close(mlp(x), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mlp(x[:1]), want[:1], atol=1e-5, rtol=1e-5)
        assert calls == []
        hook = mlp.down_proj.register_forward_hook(lambda _m, _a, out: out)
        mlp(x)
        assert calls == [((2, 96), {"tickets": None})]  # the down projection's own GEMV, after the activation
        hook.remove()
        calls.clear()
        # A GEMV of fewer columns a program would compute the activation too many times.
        mlp.down_proj.flare_step_tiling = {2: GemvTiling(gemm.FOLD_MIN_BN // 2, 64, 4)}
        torch.testing.assert_close(mlp(x), want, atol=1e-4, rtol=1e-5)
        assert calls == [((2, 96), {"tickets": None})]
        calls.clear()
        # The tensor-core tile takes the activation computed apart (each of its 16 rows would
        # compute it), the residual still in its epilogue.
        mlp.down_proj.flare_step_tiling = {2: GemvTiling(16, 32, 4, dot=1)}
        r = torch.randn(2, 64, device=DEVICE)
        torch.testing.assert_close(fused_mlp_residual(mlp, x, r), r + want, atol=1e-4, rtol=1e-5)
        assert len(calls) == 1 and calls[0][0] == (2, 96) and calls[0][1]["residual"] is r



@pytest.mark.parametrize("down_loads_act", [False, True])
def test_a_gate_up_projection_takes_the_activation_where_its_down_projection_leaves_it(monkeypatch, down_loads_act):
    """``choose_step_gemms`` decides the down projections first; a fused gated MLP whose down
    projection leaves the activation to a kernel of its own (a tensor-core GEMV, ``dot``) is
    offered the ``GLU_TILINGS`` for its [gate; up] projection, every other family charged the
    activation's kernel (here the plain tensor-core GEMV, faster than the GLU one by itself,
    loses once charged): the step computes the activation in that GEMV's epilogue
    (``flare_glu``) and gives the MLP's output within float32 rounding; where the down
    projection takes the activation in its loads (a GEMV of 8+ columns a program without
    ``dot``), the GLU tilings are not offered. The gate/up projection comes first among the
    MLP's modules here: the choice still decides its down projection first."""
    from flare.prepare.kernels.gemv import GemvTiling

    plain, mlp = _gated_mlp_pair()
    mlp._modules["down_proj"] = mlp._modules.pop("down_proj")  # (fusing put gate_up_proj last)
    assert list(mlp._modules)[-2:] == ["gate_up_proj", "down_proj"]
    down_pick = GemvTiling(8, 512, 4, 0, 1) if down_loads_act else GemvTiling(32, 128, 4, dot=1, stages=4)
    glu_pick = GemvTiling(32, 128, 4, dot=1, stages=4, glu=1)
    offered = []

    def step_tiling(weight, bias, rows, *, timer=None, margin=0.97, glu=False):
        offered.append((tuple(weight.shape), glu))
        times = {"cublas": 10.0, **{t: 9.5 for t in gemm.STEP_TILINGS}}
        for t in (*gemm.STEP_GEMV_TILINGS, *(gemm.GLU_TILINGS if glu else ())):
            if rows <= t.max_rows and t.fits(weight.shape[1]):
                times[t] = {down_pick: 1.0, glu_pick: 1.2}.get(t, 9.0)
        return None, times

    monkeypatch.setattr(gemm, "step_tiling", step_tiling)
    monkeypatch.setattr(gemm, "_add_ms", lambda *a, **kw: 0.5)
    # (each tiling's rows across counts: tests/test_gemv.py; under the interpreter 20 s a layer here)
    monkeypatch.setattr(gemm, "_gemv_same_rows", lambda *a: True)
    found = gemm.choose_step_gemms([nn.ModuleDict({"mlp": mlp})], [1, 2])
    assert found["0.mlp.down_proj"] == {1: down_pick, 2: down_pick}
    # The down projection first, then the gate/up projection, offered the GLU tilings only where
    # the down projection leaves the activation.
    assert offered == [((64, 96), False)] * 2 + [((192, 64), not down_loads_act)] * 2
    gate_up = found["0.mlp.gate_up_proj"]
    if down_loads_act:
        assert not any(t.glu for t in gate_up.values())
        return
    assert gate_up == {1: glu_pick, 2: glu_pick}
    calls = []
    real = gemm.gemv_linear
    monkeypatch.setattr(gemm, "gemv_linear", lambda x, w, t, **kw: calls.append((tuple(w.shape), t.glu)) or real(x, w, t, **kw))
    x = torch.randn(2, 64, device=DEVICE)
    with torch.no_grad():
        want = plain(x)
        torch.testing.assert_close(mlp(x), want, atol=1e-4, rtol=1e-5)
        assert calls == [((192, 64), 1), ((64, 96), 0)]  # the activation in gate/up's epilogue, then down
        calls.clear()
        torch.testing.assert_close(mlp.gate_up_proj(x), F.linear(x, mlp.gate_up_proj.weight), atol=1e-4, rtol=1e-5)
        assert calls == [((192, 64), 0)]  # called as a linear layer: the projection itself
        calls.clear()
        with prompt_rows.marked(True):
            torch.testing.assert_close(mlp(x), want, atol=1e-5, rtol=1e-5)
        assert calls == []


def test_step_choice_offers_the_glu_tilings_with_the_activation_charged(monkeypatch):
    """``step_choice(act_fold=True)`` on a [gate; up] weight: ``step_tiling`` times the GLU tilings
    too (never its own best), the activation's kernel is timed at each count and charged to every
    other family, and the GLU tiling, whose rows are checked across the counts with the real
    kernel, wins at equal product times; without ``act_fold`` it is not offered."""
    from flare.prepare.kernels.gemv import GemvTiling

    plain_dot, glu = GemvTiling(16, 32, 4, dot=1, stages=2), GemvTiling(16, 32, 4, dot=1, stages=2, glu=1)
    monkeypatch.setattr(gemm, "STEP_GEMV_TILINGS", (plain_dot,))
    monkeypatch.setattr(gemm, "GLU_TILINGS", (glu,))
    w = torch.randn(80, 64, device=DEVICE)
    best, times = gemm.step_choice(w, None, [1, 2], timer=lambda fn: 1.0, act_fold=True)
    assert best == {1: glu, 2: glu}
    assert all(times[c]["act"] == 1.0 and glu in times[c] and plain_dot in times[c] for c in (1, 2))
    assert times["sums"] == {"cublas_ms": 4.0, "chosen_ms": 2.0}
    assert gemm.step_tiling(w, None, 1, timer=lambda fn: 1.0, glu=True)[0] != glu
    best, times = gemm.step_choice(w, None, [1, 2], timer=lambda fn: 1.0)
    assert glu not in times[1] and "act" not in times[1] and not any(getattr(t, "glu", 0) for t in best.values())


def test_a_gdn_input_projection_charges_the_other_families_its_convolution(monkeypatch):
    """``conv_fold``: a Gated DeltaNet's input projection, whose GEMV without a split takes the decode
    step's convolution in its epilogue, is timed with the convolution in that GEMV at the decode
    counts and charges every other family (cuBLAS, the unsplit GEMM, a split GEMV) the convolution's
    kernel there (``_conv_ms``, ``_conv_gemv_ms``: the real kernels), not at a verify count: at equal
    times the unsplit GEMV wins. ``choose_step_gemms`` finds such projections by their module's
    ``flare_conv_fold`` and passes the fold for them alone, only with decode counts to fold;
    ``check_conv_folds`` takes the fold at those counts where ``conv_fold_same`` holds."""
    from flare.prepare.kernels.gemv import GemvTiling

    unsplit, split = GemvTiling(16, 32, 4, dot=1, stages=2), GemvTiling(16, 32, 4, dot=1, stages=2, split=2)
    monkeypatch.setattr(gemm, "STEP_GEMV_TILINGS", (split, unsplit))
    monkeypatch.setattr(gemm, "split_rows", lambda w, b, counts, remedy="": frozenset())
    monkeypatch.setattr(gemm, "_cublas_same_rows", lambda *a: True)
    w = torch.randn(80, 64, device=DEVICE)
    fold = gemm.ConvFold(48, 4, frozenset({1, 2}))
    timed = []
    monkeypatch.setattr(gemm, "_conv_gemv_ms", lambda w, rows, t, f, timer: timed.append((rows, t)) or 1.0)
    best, times = gemm.step_choice(w, None, [1, 2, 8], timer=lambda fn: 1.0, conv_fold=fold)
    assert best == {1: unsplit, 2: unsplit, 8: unsplit}
    # at the decode counts the unsplit GEMV is timed with the convolution in it; not at a verify count
    assert sorted(timed) == [(1, unsplit), (2, unsplit)]
    assert all(times[c]["conv"] == 1.0 for c in (1, 2)) and "conv" not in times[8]
    assert times["sums"] == {"cublas_ms": 5.0, "chosen_ms": 3.0}
    best, times = gemm.step_choice(w, None, [1, 2], timer=lambda fn: 1.0)
    assert best == {} and "conv" not in times[1]  # a tie with cuBLAS without the charge
    monkeypatch.undo()
    assert gemm._conv_ms(w, 2, fold, timer=lambda fn: (fn(), 0.5)[1]) == 0.5  # the kernel runs at these sizes
    assert gemm._conv_gemv_ms(w, 2, unsplit, fold, timer=lambda fn: (fn(), 0.5)[1]) == 0.5  # and the fold
    assert gemm.conv_fold_same(w, unsplit, fold)  # the fold's bits here (the interpreter, float32)
    monkeypatch.setattr(gemm, "STEP_GEMV_TILINGS", (split, unsplit))

    class Gdn(nn.Module):
        def __init__(self):
            super().__init__()
            self.in_proj, self.out_proj = nn.Linear(64, 80, bias=False), nn.Linear(64, 64, bias=False)

        def flare_conv_fold(self):
            return self.in_proj, 48, 4

    seen = {}

    def step_choice(weight, bias, counts, **kw):
        seen[tuple(weight.shape)] = kw["conv_fold"]
        return {c: unsplit for c in counts}, {"sums": {"cublas_ms": 1.0, "chosen_ms": 1.0}}

    monkeypatch.setattr(gemm, "step_choice", step_choice)
    layers = [nn.ModuleDict({"linear_attn": Gdn()})]
    gemm.choose_step_gemms(layers, [1, 2, 8], conv_counts=[1, 2])
    assert seen == {(80, 64): gemm.ConvFold(48, 4, frozenset({1, 2})), (64, 64): None}
    seen.clear()
    gemm.choose_step_gemms(layers, [1, 2, 8])  # no decode counts to fold (not the CUDA path): no charge
    assert seen == {(80, 64): None, (64, 64): None}
    # The fold is taken at the decode counts where the device gives the kernel's bits, else kept apart.
    proj = layers[0]["linear_attn"].in_proj
    monkeypatch.setattr(gemm, "conv_fold_same", lambda *a: True)
    assert gemm.check_conv_folds(layers, [1, 2]) == {"0.linear_attn.in_proj": [1, 2]}
    assert proj.flare_conv_tiling(1) == unsplit and proj.flare_conv_tiling(8) is None
    lines = []
    monkeypatch.setattr(gemm, "conv_fold_same", lambda *a: False)
    assert gemm.check_conv_folds(layers, [1, 2], log=lines.append) == {} and len(lines) == 1
    assert proj.flare_conv_tiling(1) is None


class _PostAttention(nn.Module):
    """The statements of a Transformers decoder layer's forward after its attention (Llama's, Qwen3.5's)."""

    def forward(self, hidden_states, residual):
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


@pytest.mark.parametrize("norm_wins", [True, False])
def test_a_gate_up_projection_takes_the_add_and_norm_before_it(monkeypatch, norm_wins):
    """A decoder layer's residual add, post-attention norm, MLP and add (one rewrite,
    ``add_norm_mlp``) with a step's row-invariant norm: ``choose_step_gemms`` offers its gate/up
    projection the GLU tilings timed with the add and norm in their loads, every other family
    charged the add-and-norm kernel; where a GLU tiling wins the step computes the add and norm in
    that launch (``gemv_norm_linear``: no ``rms_norm`` launch), the down projection adding the sum
    it wrote, and gives the layer's output within float32 rounding; where it loses (the norm's
    kernel cheap, the fold dear) the GLU tiling without it still wins and the norm stays its own
    launch. Timed in the norm's form (Llama's here). Prompt programs keep the norm; a hooked down
    projection runs as its module."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from flare.prepare.kernels import rownorm
    from flare.prepare.kernels.gemv import GemvTiling
    from flare.prepare.recipes import fused

    plain, mlp = _gated_mlp_pair()
    layer = _PostAttention()
    layer.mlp, layer.post_attention_layernorm = mlp, LlamaRMSNorm(64, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        layer.post_attention_layernorm.weight.normal_()
    reference = LlamaRMSNorm(64, eps=1e-6).to(DEVICE)
    reference.load_state_dict(layer.post_attention_layernorm.state_dict())
    forward = fused._rewritten_forward(_PostAttention)
    assert inspect_rewrites(forward) == {"add_norm_mlp"}
    fused._with_forward(layer, forward)
    rownorm.make_norms_row_invariant(layer, steps=True)
    assert fused.norm_glu_projections([layer]) == [(mlp.gate_up_proj, layer.post_attention_layernorm)]
    down_pick, glu_pick = GemvTiling(32, 128, 4, dot=1, stages=4), GemvTiling(32, 128, 4, dot=1, stages=4, glu=1)

    def step_tiling(weight, bias, rows, *, timer=None, margin=0.97, glu=False):
        times = {"cublas": 10.0, **{t: 9.5 for t in gemm.STEP_TILINGS}}
        for t in (*gemm.STEP_GEMV_TILINGS, *(gemm.GLU_TILINGS if glu else ())):
            if rows <= t.max_rows and t.fits(weight.shape[1]):
                times[t] = {down_pick: 1.0, glu_pick: 1.2}.get(t, 9.0)
        return None, times

    timed = []
    monkeypatch.setattr(gemm, "step_tiling", step_tiling)
    monkeypatch.setattr(gemm, "_add_ms", lambda *a, **kw: 0.5)
    monkeypatch.setattr(gemm, "_norm_ms", lambda *a, **kw: 0.5 if norm_wins else 0.01)
    monkeypatch.setattr(gemm, "_norm_gemv_ms", lambda w, rows, t, fold, conv=None, timer=None: timed.append((rows, t, fold))
                        or (1.3 if norm_wins and t == glu_pick else 9.9))
    # (the rows' bits across counts: tests/test_gemv.py; float32 tiles of these tilings outgrow a
    # GPU's shared memory)
    monkeypatch.setattr(gemm, "_gemv_same_rows", lambda *a: True)
    monkeypatch.setattr(gemm, "_norm_same_rows", lambda *a: True)
    found = gemm.choose_step_gemms([layer], [1, 2])
    assert found["0.mlp.down_proj"] == {1: down_pick, 2: down_pick}
    assert sorted(t for _, t, _ in timed) == sorted([glu_pick] * 2 + [t for t in gemm.GLU_TILINGS if t != glu_pick] * 2)
    assert {fold for _, _, fold in timed} == {gemm.NormFold(zero_centred=False)}
    assert found["0.mlp.gate_up_proj"] == {1: glu_pick, 2: glu_pick}
    assert mlp.gate_up_proj.flare_norm_rows == (frozenset({1, 2}) if norm_wins else frozenset())
    calls = {"norm_glu": 0, "rms_norm": 0}
    count_calls(monkeypatch, gemm, "gemv_norm_linear", calls, "norm_glu")
    count_calls(monkeypatch, rownorm, "rms_norm", calls, "rms_norm")
    x, r = torch.randn(2, 64, device=DEVICE), torch.randn(2, 64, device=DEVICE)
    with torch.no_grad():
        want = (r + x) + plain(reference(r + x))
        torch.testing.assert_close(layer(x, r), want, atol=1e-4, rtol=1e-5)
        assert calls == ({"norm_glu": 1, "rms_norm": 0} if norm_wins else {"norm_glu": 0, "rms_norm": 1})
        calls.update(norm_glu=0, rms_norm=0)
        with prompt_rows.marked(True):
            torch.testing.assert_close(layer(x, r), want, atol=1e-4, rtol=1e-5)
        assert calls["norm_glu"] == 0
        # A hook on the down projection (a tensor-parallel all-reduce) runs; the norm stays in the GEMV.
        handle = mlp.down_proj.register_forward_hook(lambda module, args, out: 2 * out)
        try:
            calls.update(norm_glu=0, rms_norm=0)
            torch.testing.assert_close(layer(x, r), (r + x) + 2 * plain(reference(r + x)), atol=1e-4, rtol=1e-5)
            assert calls == ({"norm_glu": 1, "rms_norm": 0} if norm_wins else {"norm_glu": 0, "rms_norm": 1})
        finally:
            handle.remove()


@pytest.mark.parametrize("add", [True, False])
def test_the_norm_folds_timing_and_row_check_run(add):
    """``measure``'s helpers for the norm folds, which the choice tests stand in for: the row check
    of a ``dot`` tiling (and a GLU one with the add) with the norm in its loads holds (the same
    program at every count), and the timing runs the GEMV with the norm, and with the convolution
    too, each call with the norm (a timer that calls what it times)."""
    from flare.prepare.kernels.gemv import GemvTiling

    w = torch.randn(96, 64, device=DEVICE)
    x = torch.randn(4, 64, device=DEVICE)
    fold = gemm.NormFold(zero_centred=True, add=add)
    tiling = GemvTiling(16, 32, 4, dot=1, stages=2, glu=int(add))
    assert gemm._norm_same_rows(w, x, tiling, [1, 2, 4], fold)
    calls = []
    ms = gemm._norm_gemv_ms(w, 2, tiling, fold, timer=lambda fn: calls.append(fn()) or 1.5)
    assert ms == 1.5 and calls[0][0].shape == (2, 48 if add else 96) and (calls[0][1] is not None) == add
    if not add:  # (the input norm of a Gated DeltaNet's in_proj, with its convolution in the epilogue)
        conv = gemm.ConvFold(channels=32, width=4, counts=frozenset({2}))
        ms = gemm._norm_gemv_ms(w, 2, tiling, fold, conv, timer=lambda fn: calls.append(fn()) or 2.5)
        assert ms == 2.5 and calls[-1].shape == (2, 96)


class _Mixer(nn.Module):
    """A mixer whose forward passes its input to one projection alone (as the fused attention and
    Gated DeltaNet forwards do)."""

    def __init__(self, proj):
        super().__init__()
        self.proj = proj

    def forward(self, hidden_states):
        return self.proj(hidden_states)

    forward.flare_input_projection = "proj"


class _PreMixer(nn.Module):
    """The statements of a Transformers decoder layer's forward up to its mixer's residual add."""

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


@pytest.mark.parametrize("norm_wins,split", [(True, 1), (False, 1), (True, 2)])
def test_a_mixer_projection_takes_the_input_norm_before_it(monkeypatch, norm_wins, split):
    """A decoder layer's input norm (the ``input_norm`` rewrite) before a mixer whose input goes to
    one projection: ``choose_step_gemms`` offers that projection its ``dot`` GEMVs, with a split or
    without, timed with the norm in their loads (Llama's form here, no add), every other family
    charged the norm's kernel; where such a family wins the two are linked and a step's norm is no
    launch of its own (the layer passes ``x`` on, the projection's ``gemv_norm_linear`` applies it,
    a split one with the core's ticket counters), the layer's output within float32 rounding; where
    it loses, under a hook on the mixer, or on a split tiling without counters, the norm is its own
    launch. Prompt programs keep the norm."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from flare.prepare.kernels import rownorm
    from flare.prepare.kernels.gemv import GemvTiling
    from flare.prepare.recipes import fused

    torch.manual_seed(3)
    h = 256  # (K that two slices of 128 fill)
    plain = nn.Linear(h, h, bias=False).to(DEVICE)
    layer = _PreMixer()
    layer.self_attn = _Mixer(nn.Linear(h, h, bias=False).to(DEVICE))
    layer.self_attn.proj.weight.data.copy_(plain.weight)
    layer.input_layernorm = LlamaRMSNorm(h, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        layer.input_layernorm.weight.normal_()
    reference = LlamaRMSNorm(h, eps=1e-6).to(DEVICE)
    reference.load_state_dict(layer.input_layernorm.state_dict())
    forward = fused._rewritten_forward(_PreMixer)
    assert inspect_rewrites(forward) == {"input_norm"}
    fused._with_forward(layer, forward)
    rownorm.make_norms_row_invariant(layer, steps=True)
    proj, norm = layer.self_attn.proj, layer.input_layernorm
    assert fused.input_norm_projections([layer]) == [(proj, norm, layer.self_attn)]
    pick = GemvTiling(32, 128, 4, dot=1, stages=4, split=split)
    tickets = ticket_counters(DEVICE)

    def step_tiling(weight, bias, rows, *, timer=None, margin=0.97, glu=False):
        times = {"cublas": 10.0, **{t: 9.5 for t in gemm.STEP_TILINGS}}
        for t in gemm.STEP_GEMV_TILINGS:
            if rows <= t.max_rows and t.fits(weight.shape[1]):
                times[t] = 1.0 if t == pick else 9.0
        return None, times

    timed = []
    monkeypatch.setattr(gemm, "step_tiling", step_tiling)
    monkeypatch.setattr(gemm, "_norm_ms", lambda *a, **kw: 0.5 if norm_wins else 0.01)
    monkeypatch.setattr(gemm, "_norm_gemv_ms", lambda w, rows, t, fold, conv=None, timer=None:
                        timed.append((rows, t, fold, conv)) or (1.1 if norm_wins and t == pick else 9.9))
    monkeypatch.setattr(gemm, "_gemv_same_rows", lambda *a: True)
    monkeypatch.setattr(gemm, "_norm_same_rows", lambda *a: True)  # (as above)
    found = gemm.choose_step_gemms([layer], [1, 2], tickets=tickets)
    assert found["0.self_attn.proj"] == {1: pick, 2: pick}
    assert {fold for _, _, fold, _ in timed} == {gemm.NormFold(zero_centred=False, add=False)}
    assert {t for _, t, _, _ in timed} == {t for t in gemm.STEP_GEMV_TILINGS if t.dot and t.fits(h)}
    assert proj.flare_norm_rows == (frozenset({1, 2}) if norm_wins else frozenset())
    calls = {"norm_gemv": 0, "rms_norm": 0}
    count_calls(monkeypatch, gemm, "gemv_norm_linear", calls, "norm_gemv")
    count_calls(monkeypatch, rownorm, "rms_norm", calls, "rms_norm")
    x = torch.randn(2, h, device=DEVICE)
    with torch.no_grad():
        want = x + plain(reference(x))
        torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-5)
        assert calls == ({"norm_gemv": 1, "rms_norm": 0} if norm_wins else {"norm_gemv": 0, "rms_norm": 1})
        assert not tickets.any()
        if split > 1:  # (a split GEMV without the core's counters leaves the norm apart)
            proj.flare_tickets = None
            calls.update(norm_gemv=0, rms_norm=0)
            torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-5)
            assert calls == {"norm_gemv": 0, "rms_norm": 1}
            proj.flare_tickets = tickets
        calls.update(norm_gemv=0, rms_norm=0)
        with prompt_rows.marked(True):
            torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-5)
        assert calls["norm_gemv"] == 0
        handle = layer.self_attn.register_forward_pre_hook(lambda module, args: None)
        try:
            calls.update(norm_gemv=0, rms_norm=0)
            torch.testing.assert_close(layer(x), want, atol=1e-4, rtol=1e-5)
            assert calls == {"norm_gemv": 0, "rms_norm": 1}
        finally:
            handle.remove()
    # A later choice without the norm's family unlinks them; without the core's counters no split
    # tiling is offered the norm.
    offered = []
    monkeypatch.setattr(gemm, "_norm_gemv_ms", lambda w, rows, t, *a, **kw: offered.append(t) or 99.0)
    gemm.choose_step_gemms([layer], [1, 2])
    assert proj.flare_norm_rows == frozenset() and norm._flare_consumer is None
    assert offered and all(t.split == 1 for t in offered)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles and captures a CUDA graph")
@pytest.mark.parametrize("split", [1, 2])
def test_the_norm_folds_compile_and_replay_in_a_cuda_graph(monkeypatch, split):
    """A layer's input norm in its mixer projection's GEMV (unsplit, or in two slices of K added by
    the last ticket's program) and its add and post-attention norm in
    its gate/up GEMV (bfloat16, Qwen3.5's zero-centred norms) compiled as the step programs are
    (one graph, no break) and captured in a CUDA graph: each replay the eager bits, without an
    ``rms_norm`` launch, within bfloat16 rounding of the layer with its norms apart."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    from flare.prepare.kernels import rownorm
    from flare.prepare.kernels.gemv import GemvTiling
    from flare.prepare.recipes import fused

    class Layer(nn.Module):
        def forward(self, hidden_states):
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
            hidden_states = self.self_attn(hidden_states)
            hidden_states = residual + hidden_states
            residual = hidden_states
            hidden_states = self.post_attention_layernorm(hidden_states)
            hidden_states = self.mlp(hidden_states)
            hidden_states = residual + hidden_states
            return hidden_states

    torch.manual_seed(0)
    _, mlp = _gated_mlp_pair()
    layer = Layer()
    layer.self_attn = _Mixer(nn.Linear(64, 64, bias=False))
    layer.mlp = mlp
    layer.input_layernorm, layer.post_attention_layernorm = Qwen3_5RMSNorm(64, eps=1e-6), Qwen3_5RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        layer.input_layernorm.weight.normal_()
        layer.post_attention_layernorm.weight.normal_()
    layer.to("cuda", torch.bfloat16)
    fused._with_forward(layer, fused._rewritten_forward(Layer))
    assert inspect_rewrites(type(layer).forward) == {"input_norm", "add_norm_mlp"}
    rownorm.make_norms_row_invariant(layer, steps=True)
    x = torch.randn(2, 64, device="cuda", dtype=torch.bfloat16)
    other = torch.randn_like(x)
    with torch.inference_mode():
        apart = layer(x)
        proj, up, down = layer.self_attn.proj, mlp.gate_up_proj, mlp.down_proj
        # (the input norm's GEMV in two slices of K with the core's counters, or unsplit)
        proj_tiling = GemvTiling(16, 64 // split, 4, dot=1, stages=2, split=split)
        for module, tiling in ((proj, proj_tiling), (up, GemvTiling(16, 64, 4, dot=1, stages=2, glu=1)),
                               (down, GemvTiling(32, 64, 4, dot=1, stages=2))):
            gemm._switch(module)
            module.flare_step_tiling = {2: tiling}
        proj.flare_tickets = ticket_counters("cuda")
        proj.flare_norm_rows = up.flare_norm_rows = frozenset({2})
        fused.link_input_norm(proj, layer.input_layernorm, layer.self_attn)
        calls = {"rms_norm": 0}
        count_calls(monkeypatch, rownorm, "rms_norm", calls, "rms_norm")
        eager, eager_other = layer(x), layer(other)
        assert calls["rms_norm"] == 0 and not proj.flare_tickets.any()
        torch.testing.assert_close(eager, apart, atol=0.06, rtol=0.02)
        _replays_bitwise(layer, [(x, eager), (other, eager_other)], lambda: not proj.flare_tickets.any())


def inspect_rewrites(forward) -> set[str]:
    import inspect

    return set(inspect.unwrap(forward).flare_rewrites)


def test_a_timing_rotates_through_enough_weight_copies_but_not_tens_of_thousands():
    """``_copies``: a weight's copies together exceed the GPU's L2 (``ROTATE_BYTES``), so a timed
    product streams its weight as a step does, but a tiny weight (a mixture-of-experts block's
    one-column shared-expert gate, 4 KB) takes at most ``MAX_COPIES``: a timing captures a call for
    each, and 65,536 a timing held the 35B shape's preparation for minutes."""
    assert gemm._copies(200 << 20) == 2 and gemm._copies(33 << 20) == 8
    assert gemm._copies(4096) == gemm.MAX_COPIES == 512
    assert gemm._copies(1) == gemm.MAX_COPIES
