"""Triton paged attention and KV write against the eager reference.

Without CUDA this runs the kernels in Triton's CPU interpreter
(TRITON_INTERPRET=1, set by conftest.py before anything imports Triton); with
CUDA it runs the same cases compiled on the GPU. tests/gpu/ adds bf16, a large
prefill and CUDA-graph capture.

bf16 attention is checked on the GPU only: Triton's interpreter truncates fp32 -> bf16 casts
(3.6 to 3.9; its bf16 tl.dot, which multiplied the raw uint16 bits, is replaced by
``kernels/_interpreter.exact_dots``).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda"

triton = pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from flare.prepare.attention import PagedBatch, flare_paged_attention  # noqa: E402
from flare.prepare.kernels.kv_write import write_kv_triton  # noqa: E402
from flare.prepare.kernels.paged_attention import attend_triton, plan_launch  # noqa: E402
from flare.runtime.pages import window_released  # noqa: E402
from tests.paged_cases import Shape, decode_step, prefill_step, run_fp32_truth, run_reference, run_triton  # noqa: E402

SHAPES = [
    Shape(H=4, KVH=4, D=64, page_size=16),  # MHA
    Shape(H=9, KVH=3, D=64, page_size=16),  # SmolLM2-135M: GQA 3, 9 heads
    Shape(H=8, KVH=1, D=128, page_size=32),  # GQA 8, D 128
    Shape(H=8, KVH=2, D=64, page_size=64, max_pages=3),  # GQA 4, big pages
    Shape(H=4, KVH=2, D=80, page_size=16),  # head_dim not a power of two
    Shape(H=8, KVH=2, D=256, page_size=16),  # Qwen3.5's gated attention: head_dim 256
]
IDS = [f"H{s.H}-KVH{s.KVH}-D{s.D}-ps{s.page_size}" for s in SHAPES]

# fp32: ieee dots, so only summation order differs from the reference.
# fp16: the kernel rounds P to fp16 before P@V and the output to fp16 (2^-11 each).
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}
DTYPES = [torch.float32, torch.float16]


def scale(shape: Shape) -> float:
    return shape.D**-0.5


def check_step(step, shape, dtype, num_splits=None, window=0):
    ref, kv_ref = run_reference(step, scale(shape), window)
    out, kv_tri = run_triton(step, scale(shape), num_splits=num_splits, window=window)
    # The write: identical outside the null page; the null page untouched (padded rows write nothing).
    assert torch.equal(kv_tri[:, :, 1:], kv_ref[:, :, 1:])
    assert torch.equal(kv_tri[:, :, 0], step.kv[:, :, 0])
    assert out.dtype == step.q.dtype and out.shape == step.q.shape
    assert torch.isfinite(out).all()
    assert torch.equal(out[~step.valid], torch.zeros_like(out[~step.valid]))
    truth = ref if dtype == torch.float32 else run_fp32_truth(step, kv_ref, scale(shape), window)
    torch.testing.assert_close(out.float(), truth.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_decode_matches_reference(shape, dtype):
    ps = shape.page_size
    # Lengths straddling page boundaries, a full table, a single key, and padded rows.
    lengths = [1, ps - 1, None, ps, ps + 1, shape.max_keys, None]
    for seed, splits in ((1, None), (2, 1), (3, 3)):
        check_step(decode_step(shape, lengths, dtype, seed, DEVICE), shape, dtype, num_splits=splits)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_prefill_chunks_match_reference(shape):
    ps = shape.page_size
    dtype = torch.float32
    chunk = 20
    # Each start (history length) with one launch variant; together they cover
    # tiled / untiled and split / unsplit.
    starts = (0, ps - 1, ps + 1, shape.max_keys - 16)
    variants = ((True, 1), (True, 2), (False, None), (True, None))
    for seed, (start, (single_slot, splits)) in enumerate(zip(starts, variants)):
        n = min(16, shape.max_keys - start)
        step = prefill_step(shape, start, n, chunk, dtype, 10 + seed, DEVICE, single_slot=single_slot)
        check_step(step, shape, dtype, num_splits=splits)


@pytest.mark.parametrize("shape", SHAPES[1:4], ids=IDS[1:4])
@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_sliding_windows_match_the_masked_reference(shape, window):
    """A sliding window (keys at positions > position - window) in decode batches and in
    prefill chunks that start before, inside and past the window, split and not: the
    kernel skips the key blocks before the tile's earliest window and masks the rest."""
    ps = shape.page_size
    lengths = [1, window, window + 1, ps + 3, None, shape.max_keys]
    for seed, splits in ((21, None), (22, 1), (23, 3)):
        check_step(decode_step(shape, lengths, torch.float32, seed, DEVICE), shape, torch.float32,
                   num_splits=splits, window=window)
    for seed, (start, splits) in enumerate(((0, 1), (window // 2, None), (shape.max_keys - 20, 2))):
        step = prefill_step(shape, start, min(16, shape.max_keys - start), 16, torch.float32, 30 + seed, DEVICE)
        check_step(step, shape, torch.float32, num_splits=splits, window=window)


def _released(step, window: int):
    """``step`` with the page-table entries the scheduler releases (``Scheduler._release_window``)
    pointing at the null page 0: each slot's pages that end a page before the window of its earliest
    query row."""
    pt = step.page_table.clone()
    ps = step.kv.shape[3]
    released = 0
    for slot in step.token_slot[step.valid].unique().tolist():
        first = int(step.positions[step.valid & (step.token_slot == slot)].min())
        before = window_released(first, window, ps)
        if before > 0:
            pt[slot, :before] = 0
            released += before
    return dataclasses.replace(step, page_table=pt), released


@pytest.mark.parametrize("shape", SHAPES[1:3], ids=IDS[1:3])
@pytest.mark.parametrize("window", [5, 37])
def test_pages_released_before_the_window_change_no_bit(shape, window):
    """The pages the scheduler gives back when they leave every layer's window (the page table's
    entries then the null page, whose rows hold other keys and values) change no bit of a decode
    batch or a prefill chunk, split or not, in the kernel (which skips the key blocks before a tile's
    earliest window and masks a block across it) and in the reference."""
    ps, top = shape.page_size, shape.max_keys
    steps = [decode_step(shape, [min(window + 3 * ps, top), None, top, min(2 * window + ps + 1, top)], torch.float32,
                         41, DEVICE),
             prefill_step(shape, top - 20, 16, 16, torch.float32, 42, DEVICE),
             prefill_step(shape, min(window + 2 * ps + 3, top - 16), 16, 16, torch.float32, 43, DEVICE)]
    total = 0
    for step, splits in zip(steps, (3, None, 2)):
        cut, released = _released(step, window)
        total += released
        for run in (lambda st: run_triton(st, scale(shape), num_splits=splits, window=window)[0],
                    lambda st: run_reference(st, scale(shape), window)[0]):
            assert torch.equal(run(step), run(cut))
    assert total > 0


def test_a_window_changes_attention_only_beyond_it():
    """The masked reference is the definition: with a window longer than every history it
    equals full attention, and with a shorter one a long history's output differs."""
    shape = SHAPES[1]
    step = decode_step(shape, [3, 40, shape.max_keys], torch.float32, 9, DEVICE)
    full, _ = run_reference(step, scale(shape))
    assert torch.equal(run_reference(step, scale(shape), shape.max_keys + 1)[0], full)
    short = run_reference(step, scale(shape), 4)[0]
    assert torch.equal(short[0], full[0]) and not torch.allclose(short[2], full[2])


WHOLE_BLOCKS = [Shape(H=4, KVH=1, D=64, page_size=16, max_pages=16),  # 256 keys: 4 blocks of 64
                Shape(H=2, KVH=1, D=80, page_size=16, max_pages=12)]  # head dim 80: the loads keep a mask


@pytest.mark.parametrize("shape, window, prefill, decode", [
    (WHOLE_BLOCKS[0], 100, (130, 40, None), [3, None, 18, 1, 256]),
    (WHOLE_BLOCKS[1], 0, (162, 30, 1), None)], ids=["D64-w100", "D80"])
def test_unmasked_key_blocks_give_the_masked_bits(shape, window, prefill, decode):
    """Key blocks every row of a tile sees whole run without the causal/window masks
    (``full_blocks``): the same bits as masking every block, in a prefill chunk after a
    history of several whole blocks (a partial last tile with padded rows; split and
    not), decode rows (padded rows; a tile of mixed slots, whose per-token passes keep the
    masks), under a window longer than a block (whole blocks inside it) and at a head dim
    the loads must mask. Fails with the unmasked range a block too wide at either end. On
    the GPU also where the compiler could fuse the unmasked scores' arithmetic."""
    start, n, splits = prefill
    steps = [(prefill_step(shape, start, n, 48, torch.float32, 40, DEVICE), splits)]
    if decode:
        steps.append((decode_step(shape, decode, torch.float32, 45, DEVICE), None))
        tiled = decode_step(shape, decode, torch.float32, 46, DEVICE)
        tiled.single_slot = True  # mixed slots: one pass per token, masked
        steps.append((tiled, 2))
    for step, splits in steps:
        full, _ = run_triton(step, scale(shape), num_splits=splits, window=window, full_blocks=True)
        masked, _ = run_triton(step, scale(shape), num_splits=splits, window=window, full_blocks=False)
        assert torch.equal(full, masked)
        assert torch.equal(full[~step.valid], torch.zeros_like(full[~step.valid]))


def test_prefill_fp16_crossing_pages():
    shape = SHAPES[1]
    step = prefill_step(shape, start=shape.page_size - 3, n=30, chunk=32, dtype=torch.float16, seed=7, device=DEVICE)
    check_step(step, shape, torch.float16, num_splits=2)


@pytest.mark.parametrize("shape", SHAPES[:3], ids=IDS[:3])
def test_tiling_hint_wrong_is_still_correct(shape):
    """single_slot=True over a decode batch (mixed slots): the kernel detects the
    mixed tile on the device and makes one pass per token."""
    step = decode_step(shape, [3, None, shape.page_size + 2, 1, 2 * shape.page_size], torch.float32, 5, DEVICE)
    step.single_slot = True
    check_step(step, shape, torch.float32, num_splits=2)


def test_all_rows_padded_write_nothing_and_return_zeros():
    shape = SHAPES[1]
    step = decode_step(shape, [None, None, None], torch.float32, 4, DEVICE)
    out, kv_after = run_triton(step, scale(shape))
    assert torch.equal(kv_after, step.kv)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_write_kv_is_exact_and_skips_padded_rows(dtype):
    shape = SHAPES[2]
    step = decode_step(shape, [5, None, 40, 1, None, 33], dtype, 6, DEVICE)
    kv = step.kv.clone()
    write_kv_triton(step.batch(kv, "triton"), step.layer, step.k, step.v)
    sm = step.slot_mapping
    live = sm >= 0
    flat = kv[step.layer].view(2, -1, shape.KVH, shape.D)
    assert torch.equal(flat[0, sm[live]], step.k[live])
    assert torch.equal(flat[1, sm[live]], step.v[live])
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[sm[live]] = False
    assert torch.equal(flat[:, untouched], step.kv[step.layer].view(2, -1, shape.KVH, shape.D)[:, untouched])
    other = 1 - step.layer
    assert torch.equal(kv[other], step.kv[other])


def test_flare_paged_attention_triton_matches_reference():
    """The transformers entry point with impl='triton' (write + attend) against impl='reference'."""
    shape = SHAPES[1]
    step = prefill_step(shape, start=5, n=12, chunk=16, dtype=torch.float32, seed=8, device=DEVICE)
    module = type("Attn", (), {"kv_layer": step.layer})()  # the recipe sets kv_layer on attention modules
    query = step.q.transpose(0, 1)[None]
    key, value = step.k.transpose(0, 1)[None], step.v.transpose(0, 1)[None]
    outs = {}
    for impl in ("reference", "triton"):
        kv = step.kv.clone()
        outs[impl], _ = flare_paged_attention(module, query, key, value, None, scaling=scale(shape),
                                              paged=step.batch(kv, impl))
        outs[impl + "_kv"] = kv
    assert torch.equal(outs["triton_kv"][:, :, 1:], outs["reference_kv"][:, :, 1:])
    torch.testing.assert_close(outs["triton"], outs["reference"], **TOL[torch.float32])


def test_launch_plan_depends_on_shapes_only():
    # Decode: one token per program, the GQA group padded to tl.dot's 16 rows. The most
    # splits are what one active token would need to fill 132 SMs twice (ceil(264 / 3)),
    # within the 16 key blocks of a slot.
    lc = plan_launch(T=8, H=9, KVH=3, D=64, max_pages=64, page_size=16, tile_tokens=False, sm_count=132)
    assert (lc.block_t, lc.heads, lc.rows, lc.block_n, lc.target) == (1, 16, 16, 64, 264)
    assert lc.splits == 16 and not lc.full_blocks  # (decode rows mask every key block)
    # Prefill: 16 tokens x 4 (padded group of 3) rows per program, in every prompt program;
    # keys in segments of 4 blocks (256 key blocks: 64 segments). The partials of every
    # segment of a tile take 16 x 9 x 64 x 66 floats (2.3 MiB): 55 tiles fit 128 MiB, so
    # a launch with at most 55 tiles holding tokens may split, one with more does not.
    for T in (16, 4096):
        lc = plan_launch(T=T, H=9, KVH=3, D=64, max_pages=1024, page_size=16, tile_tokens=True, sm_count=132)
        assert (lc.block_t, lc.heads, lc.rows, lc.splits, lc.seg, lc.nseg) == (16, 4, 64, 32, 4, 64), T
        assert lc.rtiles == min(T // 16, 55), T
        assert lc.full_blocks, T  # whole key blocks unmasked
    # Llama-3.1-8B at a 131,072-token context: segments of 16 blocks (1,024 keys), the same in
    # every prompt program; 3 tiles of 16 tokens (48 tokens) may split.
    for T in (16, 64, 2048):
        lc = plan_launch(T=T, H=32, KVH=8, D=128, max_pages=8192, page_size=16, tile_tokens=True, sm_count=132)
        assert (lc.block_t, lc.splits, lc.seg, lc.nseg, lc.rtiles) == (16, 32, 16, 128, min(T // 16, 3)), T
    # Llama-3.1-8B decode: 32 splits at most; never more than the key blocks a slot can have.
    assert plan_launch(T=4, H=32, KVH=8, D=128, max_pages=4096, page_size=16, tile_tokens=False,
                       sm_count=132).splits == 32
    lc = plan_launch(T=1, H=8, KVH=8, D=128, max_pages=2, page_size=16, tile_tokens=False, sm_count=132)
    assert lc.splits == 1


LONG = Shape(H=8, KVH=2, D=64, page_size=16, max_pages=24)  # 384 keys: 6 key blocks of 64


@pytest.mark.parametrize("target", [1, 5, 10**6], ids=["one-split", "some", "all-splits"])
@pytest.mark.parametrize("n", [1, 17, 32])
def test_splits_chosen_on_the_device_are_exact(n, target):
    """A short chunk after a long cached history (a prefix hit's tail) and a full one,
    with the device choosing 1, some, or all of 6 splits: every variant is the
    reference (one split writes the output directly; otherwise partials of the valid
    rows are combined and padded rows are zeros). One token (one tile of 16 holding
    tokens), 17 (a full tile and a partial one) and 32 (two full tiles)."""
    step = prefill_step(LONG, start=300, n=min(n, LONG.max_keys - 300), chunk=32, dtype=torch.float32,
                        seed=20 + n, device=DEVICE)
    ref, kv_ref = run_reference(step, scale(LONG))
    kv = step.kv.clone()
    b = step.batch(kv, "triton")
    write_kv_triton(b, step.layer, step.k, step.v)
    out = attend_triton(b, step.layer, step.q, scale(LONG), num_splits=6, target=target)
    assert torch.equal(kv[:, :, 1:], kv_ref[:, :, 1:])  # the reference also writes padded rows to the null page
    assert torch.equal(out[~step.valid], torch.zeros_like(out[~step.valid]))
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("window", [0, 150])
@pytest.mark.parametrize("target", [8, 10**6], ids=["fold-in-place-when-together", "split-always"])
def test_a_decode_row_with_segments_is_the_same_bits_whatever_shares_its_step(target, window):
    """Decode launches with ``segments=True``: each live row's output is the same bits alone
    (one live row: more programs share its keys) and among four (fewer, or one that folds
    its segments itself), with and without a sliding window, and the reference's within
    tolerance; padded rows are zeros."""
    step = decode_step(LONG, [384, 300, 17, 384], torch.float32, 41, DEVICE)
    ref, _ = run_reference(step, scale(LONG), window)
    kv = step.kv.clone()
    b = step.batch(kv, "triton")
    write_kv_triton(b, step.layer, step.k, step.v)
    together = attend_triton(b, step.layer, step.q, scale(LONG), num_splits=6, target=target, segments=True,
                             window=window)
    torch.testing.assert_close(together, ref, **TOL[torch.float32])
    for r in range(4):
        alone_valid = torch.zeros_like(step.valid)
        alone_valid[r] = True
        alone = attend_triton(dataclasses.replace(b, valid=alone_valid), step.layer, step.q, scale(LONG),
                              num_splits=6, target=target, segments=True, window=window)
        assert torch.equal(alone[r], together[r]), r
        assert torch.equal(alone[~alone_valid], torch.zeros_like(alone[~alone_valid]))


def test_decode_splits_follow_the_live_rows():
    """A decode batch whose rows are mostly padding gets more splits per live row; any
    mix is exact, and padded rows are zeros."""
    for lengths, target in (([None, None, 300, None], 10**6), ([300, 1, 17, 384], 5), ([None, 2, None, 384], 1)):
        step = decode_step(LONG, lengths, torch.float32, 31, DEVICE)
        ref, _ = run_reference(step, scale(LONG))
        kv = step.kv.clone()
        b = step.batch(kv, "triton")
        write_kv_triton(b, step.layer, step.k, step.v)
        out = attend_triton(b, step.layer, step.q, scale(LONG), num_splits=6, target=target)
        assert torch.equal(out[~step.valid], torch.zeros_like(out[~step.valid]))
        torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("window", [0, 150])
def test_decode_splits_folded_by_the_last_program(window, monkeypatch):
    """With ticket counters (a CUDA core's, ``PagedBatch.tickets``) a decode launch's last program
    of each tile folds its splits, the same way whoever it is: no combine launch, the
    reference's output within tolerance and the combine kernel's within float32 rounding (blocks
    of splits summed in turn where the combine sums them in one tensor), padded rows zeros, every
    counter back at zero, and the same bits on a second call; two splits or one a block, the same
    within float32 rounding."""
    from flare.prepare.kernels import paged_attention as A

    combines = []
    real = A._combine_kernel
    monkeypatch.setattr(A, "_combine_kernel", type("Counted", (), {
        "__getitem__": lambda self, grid: combines.append(grid) or real[grid]})())
    for lengths, target in (([None, None, 300, None], 10**6), ([300, 1, 17, 384], 5), ([None, 2, None, 384], 1)):
        step = decode_step(LONG, lengths, torch.float32, 37, DEVICE)
        ref, _ = run_reference(step, scale(LONG), window)
        kv = step.kv.clone()
        b = step.batch(kv, "triton")
        write_kv_triton(b, step.layer, step.k, step.v)
        apart = attend_triton(b, step.layer, step.q, scale(LONG), num_splits=6, target=target, window=window)
        assert len(combines) == 1
        combines.clear()
        tickets = torch.zeros(16, dtype=torch.int32, device=DEVICE)
        folded = dataclasses.replace(b, tickets=tickets)
        out = attend_triton(folded, step.layer, step.q, scale(LONG), num_splits=6, target=target, window=window)
        assert not combines and not tickets.any()
        assert torch.equal(out[~step.valid], torch.zeros_like(out[~step.valid]))
        torch.testing.assert_close(out, ref, **TOL[torch.float32])
        torch.testing.assert_close(out, apart, atol=1e-6, rtol=1e-6)
        again = attend_triton(folded, step.layer, step.q, scale(LONG), num_splits=6, target=target, window=window)
        assert torch.equal(again, out) and not tickets.any()
        rows = A.plan_launch(4, LONG.H, LONG.KVH, LONG.D, LONG.max_pages, LONG.page_size, tile_tokens=False,
                             sm_count=1, num_splits=6).rows  # (the launch's query rows: heads padded)
        assert A.fold_splits(rows, 64, 6) == 8  # (the 6 splits in one block; below 2 and 1 a block)
        for block, per in ((2 * rows * 64, 2), (1, 1)):
            with monkeypatch.context() as m:
                m.setattr(A, "FOLD_BLOCK", block)
                assert A.fold_splits(rows, 64, 6) == per
                blocks = attend_triton(folded, step.layer, step.q, scale(LONG), num_splits=6, target=target,
                                       window=window)
            torch.testing.assert_close(blocks, out, atol=1e-6, rtol=1e-6)
            assert not tickets.any()


@pytest.mark.parametrize("window", [0, 150])
def test_a_decode_split_works_on_at_least_split_blocks_key_blocks(window):
    """A decode tile's keys go to at most one split for each ``split_blocks`` key blocks they
    span: a row whose keys span no more (17 keys: one block of 64; 100: two; 384 under the
    150-key window: blocks 3-5) is one program's work, the bits of an unsplit launch, with the
    combine kernel and with ticket counters (the fold, whose counters stay at zero); the other rows
    split, within float32 rounding of the split without the limit (``split_blocks=0``: every
    program the launch offers), and every row within the reference's tolerance; padded rows zeros."""
    step = decode_step(LONG, [17, None, 100, 384], torch.float32, 43, DEVICE)
    ref, _ = run_reference(step, scale(LONG), window)
    kv = step.kv.clone()
    b = step.batch(kv, "triton")
    write_kv_triton(b, step.layer, step.k, step.v)
    whole = attend_triton(b, step.layer, step.q, scale(LONG), num_splits=1, window=window)
    unlimited = attend_triton(b, step.layer, step.q, scale(LONG), num_splits=6, target=10**6, window=window,
                              split_blocks=0)
    spans = {0: 1, 2: 2, 3: 3 if window else 6}  # row -> key blocks its keys span
    tickets = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    for split_blocks in (1, 2, 3):
        for batch in (b, dataclasses.replace(b, tickets=tickets)):
            out = attend_triton(batch, step.layer, step.q, scale(LONG), num_splits=6, target=10**6, window=window,
                                split_blocks=split_blocks)
            assert not tickets.any()
            assert torch.equal(out[~step.valid], torch.zeros_like(out[~step.valid]))
            torch.testing.assert_close(out, ref, **TOL[torch.float32])
            torch.testing.assert_close(out, unlimited, atol=1e-6, rtol=1e-6)
            for row, span in spans.items():
                if span <= split_blocks:
                    assert torch.equal(out[row], whole[row]), (split_blocks, row)
                elif split_blocks == 1 and batch is b:  # a block a split, the combine's sum as without the limit
                    assert torch.equal(out[row], unlimited[row]), row


# Rows 300..316 under a window of 100 see keys from 201 on, of 150 from 151 on: in segments of 3
# blocks (192 keys) the first segment is skipped whole or cut; in one segment, or in segments of 2
# blocks (128 keys), both windows start inside the same segment (the second: 150 alone covers it).
PROMPT_ROW_CASES = {"one-segment": (128, 4, 128 << 20), "segments-of-3-blocks": (2, 1, 128 << 20),
                    "segments-of-2-no-room": (3, 1, 1)}


@pytest.mark.parametrize("window, seg_count, seg_min, partial_bytes", [
    pytest.param(window, *PROMPT_ROW_CASES[name], id=f"{window}-{name}")
    for window, names in ((0, PROMPT_ROW_CASES), (100, ["segments-of-3-blocks"]), (150, PROMPT_ROW_CASES))
    for name in names])
def test_a_prompt_row_is_the_same_bits_however_its_keys_are_split_or_tiled(window, seg_count, seg_min,
                                                                            partial_bytes, monkeypatch):
    """Prompt programs fold key segments at fixed positions in order: rows 300..316 of one
    slot (the same queries and cached keys) get the same bits whether the device splits
    their keys over 1, some or all 6 programs (a short chunk after a cached prefix takes
    many, a long chunk few; before segments, the split count changed the bits), whether
    the partials have room for the launch's tiles (else it does not split), and whether
    they are the whole chunk or rows of a longer one, in 1 to 3 tiles holding tokens (a
    program of 48 rows: three tiles of 16 tokens, the last empty for 17 rows). Keys
    in one segment, in segments of 3 blocks and of 2 (windows crossing them). Rows in
    other tiles of a launch: on the GPU also where those tiles start (Triton's interpreter
    multiplies through numpy, whose rows round by where they sit in the matrix)."""
    from flare.prepare.kernels import paged_attention as A

    monkeypatch.setattr(A, "_SEG_COUNT", seg_count)
    monkeypatch.setattr(A, "_SEG_MIN", seg_min)
    monkeypatch.setattr(A, "_SEG_PARTIAL_BYTES", partial_bytes)
    g = torch.Generator().manual_seed(4)
    qs = torch.randn(LONG.max_keys, LONG.H, LONG.D, generator=g).to(DEVICE)
    cases = [(300, 17, 1, None), (300, 17, 5, None), (300, 17, 10**6, None), (300, 17, 10**6, 1),
             (300, 40, 10**6, None), (300, 40, 2, None)]
    if DEVICE == "cuda":
        cases += [(290, 27, 1, None), (290, 27, 10**6, None), (283, 34, 3, None)]
    outs = []
    for start, n, target, splits in cases:
        step = prefill_step(LONG, start=start, n=n, chunk=48, dtype=torch.float32, seed=20, device=DEVICE)
        q = step.q.clone()
        q[:n] = qs[start:start + n]
        out = attend_triton(step.batch(step.kv.clone(), "triton"), step.layer, q, scale(LONG),
                            num_splits=splits or 6, target=target, window=window)
        outs.append(out[300 - start:317 - start])
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_rejects_bad_shapes():
    shape = SHAPES[1]
    step = decode_step(shape, [3], torch.float32, 9, DEVICE)
    b = step.batch(step.kv, "triton")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attend_triton(b, 0, torch.zeros(1, 4, shape.D, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        attend_triton(b, 0, torch.zeros(1, shape.H, 32, device=DEVICE), 1.0)
    with pytest.raises(ValueError, match="layer"):
        attend_triton(b, 5, step.q, 1.0)
    bad = PagedBatch(step.kv, step.page_table, step.token_slot[:0], step.positions, step.slot_mapping, step.valid)
    with pytest.raises(ValueError, match="token_slot"):
        attend_triton(bad, 0, step.q, 1.0)


def test_the_gather_path_honours_windows_too():
    """The capture-safe torch path (single-slot prefill and multi-slot decode) against the
    masked reference: a padded row's extra key must not leak into valid rows' windows."""
    from flare.prepare.attention import attend_gather

    shape = SHAPES[1]
    for step in (decode_step(shape, [3, 40, None, shape.max_keys], torch.float32, 41, DEVICE),
                 prefill_step(shape, 30, 16, 16, torch.float32, 42, DEVICE)):
        ref, kv = run_reference(step, scale(shape), 8)
        out = attend_gather(step.batch(kv, "gather"), step.layer, step.q, scale(shape), 8)
        torch.testing.assert_close(out[step.valid], ref[step.valid], **TOL[torch.float32])
