"""The snapshot, restore and resume programs on the reference path, for an
attention-only core (llama-tiny: continuation = the hidden vector) and the
hybrid core (qwen3_5-tiny: + Gated DeltaNet convolution histories and
recurrent matrices). Bitwise: copies are exact, and a restored slot continues
exactly as the original slot does."""

from __future__ import annotations

import pytest
import torch

from flare.core import interface as io
from flare.core.manifest import snapshot_buffer
from tests.rig import admit, decode, load_rig, prefill, restore, resume, snapshot, tail_page


@pytest.fixture(scope="module", params=["tiny_core", "hybrid_core"])
def rig(request):
    return load_rig(request.getfixturevalue(request.param))


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(97 * i + 13 + salt) % 40000 + 100 for i in range(n)]


def state_names(r) -> list[str]:
    return [b.name for b in r.m.buffers if b.role.value == "state"]


def test_continuation_is_declared(rig):
    names = rig.m.continuation.state
    assert names[0] == "state.hidden"
    if rig.m.reference.recipe == "qwen3_5":
        assert names == ("state.hidden", "state.gdn.conv", "state.gdn.recurrent", "state.gdn.block",
                         "state.gdn.stash", "state.gdn.grid")
        # The block grid is prefill state: no verify twins; the matrices are float32.
        assert rig.m.continuation.prefill_only == ("state.gdn.block", "state.gdn.stash", "state.gdn.grid")
        assert rig.v["state.gdn.recurrent"].dtype == rig.v["state.gdn.block"].dtype == torch.float32
    else:
        assert names == ("state.hidden",)


def test_snapshot_restore_round_trip_is_bitwise(rig):
    v, m = rig.v, rig.m
    cont = m.continuation.state
    P = prompt(45)  # 45 = 2 pages + 13 tokens: a partial tail page
    pages1 = rig.pages(4)
    admit(rig, 1, P, pages1, seed=1)
    prefill(rig, 1, P[:30])
    prefill(rig, 1, P[30:])  # two chunks: the recurrent state came through a chunk boundary
    for t in (5, 6):
        decode(rig, [1], [t])
    S = 47
    assert int(v["state.len"][1]) == S
    live = {n: v[n][1].clone() for n in cont}
    tail = v["kv"][:, :, tail_page(rig, pages1, S)].clone()
    snaps_before = {n: v[snapshot_buffer(n)].clone() for n in cont}
    everything = {n: v[n].clone() for n in state_names(rig)}
    rec = snapshot(rig, 1, 3, tail_page(rig, pages1, S), S)
    assert rec == io.StateCompletion(slot=1, row=3, consumed=S)
    # Only row 3 of each snapshot buffer changed, to exactly the live row; live state untouched.
    for n in cont:
        snap = v[snapshot_buffer(n)]
        assert torch.equal(snap[3], live[n]), n
        assert torch.equal(torch.cat([snap[:3], snap[4:]]), torch.cat([snaps_before[n][:3], snaps_before[n][4:]]))
    assert torch.equal(v[m.continuation.tail][3], tail)
    for n, before in everything.items():
        assert torch.equal(v[n], before), n
    # Another request overwrites slot 1 (admit resets the continuation rows to zero first).
    other = prompt(20, salt=5)
    admit(rig, 1, other, rig.pages(2), seed=2)
    for n in cont:
        assert int(torch.count_nonzero(v[n][1])) == 0, n
    prefill(rig, 1, other)
    # Restore into slot 2: complete pages shared, the tail into a fresh private page.
    pages2 = pages1[: S // 16] + rig.pages(2)
    admit(rig, 2, P + [5, 6], pages2, seed=3)
    snap_after = {n: v[snapshot_buffer(n)].clone() for n in (*cont,)}
    tail_snap = v[m.continuation.tail].clone()
    rec = restore(rig, 2, 3, tail_page(rig, pages2, S), S)
    assert rec == io.StateCompletion(slot=2, row=3, consumed=S)
    for n in cont:
        assert torch.equal(v[n][2], live[n]), n  # bitwise, every continuation buffer
        assert torch.equal(v[snapshot_buffer(n)], snap_after[n]), n  # the source stays immutable
    assert torch.equal(v[m.continuation.tail], tail_snap)
    assert torch.equal(v["kv"][:, :, pages2[S // 16]], tail)
    assert int(v["state.len"][2]) == S


def test_restored_slot_continues_exactly_like_the_original(rig):
    """Decode after a restore (shared complete pages, copied tail, copied state) gives
    bitwise the logits the original slot gives when it continues itself."""
    P = prompt(37, salt=1)
    pages_a = rig.pages(4)
    admit(rig, 1, P, pages_a, seed=1)
    prefill(rig, 1, P)
    S = len(P)
    snapshot(rig, 1, 5, tail_page(rig, pages_a, S), S)
    pages_b = pages_a[: S // 16] + rig.pages(2)
    admit(rig, 2, P, pages_b, seed=1)
    restore(rig, 2, 5, tail_page(rig, pages_b, S), S)
    cont = [7, 8, 9, 10, 11]
    a, b = [], []
    for t in cont:  # the original alone, then the restored one alone: same batch geometry
        a.append(decode(rig, [1], [t])[0][0])
    for t in cont:
        b.append(decode(rig, [2], [t])[0][0])
    assert torch.equal(torch.stack(a), torch.stack(b))


def test_resume_samples_what_the_prefill_sampled(rig):
    P = prompt(29, salt=2)
    pages_a = rig.pages(3)
    admit(rig, 1, P, pages_a, seed=9)
    _, head, record = prefill(rig, 1, P)
    snapshot(rig, 1, 6, tail_page(rig, pages_a, len(P)), len(P))
    pages_b = pages_a[: len(P) // 16] + rig.pages(2)
    admit(rig, 3, P, pages_b, seed=9)
    restore(rig, 3, 6, tail_page(rig, pages_b, len(P)), len(P))
    logits, rec = resume(rig, 3)
    assert torch.equal(logits, head)  # the saved hidden vector through the same head
    assert rec == io.Completion(3, record.token, 1, record.status)
    assert int(rig.v["state.pending"][3]) == record.token and int(rig.v["state.len"][3]) == len(P)


def test_padded_and_finished_rows_keep_their_state(rig):
    """decode.4 with one live slot, one finished slot and two padded rows: every state row
    but the live slot's and the null row is bitwise unchanged (recurrent state included)."""
    v = rig.v
    for s in (1, 2, 3):
        P = prompt(20 + s, salt=s)
        admit(rig, s, P, rig.pages(3), seed=s)
        prefill(rig, s, P)
    v["state.done"][2] = 1
    before = {n: v[n].clone() for n in state_names(rig)}
    v["in.decode_slots"][:] = 0
    v["in.decode_slots"][:2] = torch.tensor([1, 2], dtype=torch.int32)
    rig.run["decode.4"]()
    for n in state_names(rig):
        for row in range(2, v[n].shape[0]):
            assert torch.equal(v[n][row], before[n][row]), f"{n}[{row}] changed"
    for n in rig.m.continuation.state:  # the live slot advanced (what only prefill writes stays)
        assert torch.equal(v[n][1], before[n][1]) == (n in rig.m.continuation.prefill_only), n


def test_branches_share_immutable_pages_and_write_only_their_own(rig):
    """Two branches restore one checkpoint (two shared complete pages, the tail copied
    into each branch's own page), prefill different suffixes and decode side by side in
    one batch. The shared pages stay bitwise unchanged, and each branch computes bitwise
    what a request with the same history and partition in private pages computes."""
    v = rig.v
    P = prompt(45, salt=7)
    S = len(P)
    pages0 = rig.pages(4)
    admit(rig, 1, P, pages0, seed=1)
    prefill(rig, 1, P)
    snapshot(rig, 1, 7, tail_page(rig, pages0, S), S)
    shared = pages0[: S // 16]
    shared_before = v["kv"][:, :, shared].clone()
    suffixes = {2: prompt(11, salt=8), 3: prompt(19, salt=9)}
    forced = [[21, 22, 23, 24], [31, 32, 33, 34]]

    def run(slots_pages, restored: bool):
        for (slot, pages), suffix in zip(slots_pages, suffixes.values()):
            admit(rig, slot, P + suffix, pages, seed=slot)
            if restored:
                restore(rig, slot, 7, tail_page(rig, pages, S), S)
            else:
                prefill(rig, slot, P, sample=False)  # the same partition: the prompt, then the suffix
            prefill(rig, slot, suffix)
        slots = [s for s, _ in slots_pages]
        return [decode(rig, slots, [f[k] for f in forced])[0] for k in range(4)]

    branches = run([(2, shared + rig.pages(3)), (3, shared + rig.pages(3))], restored=True)
    assert torch.equal(v["kv"][:, :, shared], shared_before)
    private = run([(2, rig.pages(5)), (3, rig.pages(5))], restored=False)
    for a, b in zip(branches, private):
        assert torch.equal(a, b)
