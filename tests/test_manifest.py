"""The runtime-core contract: loading a prepared core, and every way a manifest
must be rejected. Invalid manifests are made by editing the JSON of a real
prepared core (``tiny_core``), so each case differs from a valid core in
exactly one respect."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from flare.core import manifest as mf
from flare.core.errors import CoreCompatibilityError, ManifestError


@pytest.fixture(scope="module")
def raw(tiny_core: Path) -> dict:
    return json.loads((tiny_core / mf.MANIFEST_FILE).read_bytes())


def _decode(d: dict) -> mf.Manifest:
    return mf.decode_manifest(json.dumps(d).encode())


def _buffer(d: dict, name: str) -> dict:
    return next(b for b in d["buffers"] if b["name"] == name)


def _reject(d: dict, *, param: str | None, match: str, error=ManifestError) -> ManifestError:
    with pytest.raises(error, match=match) as e:
        _decode(d)
    assert e.value.param == param
    return e.value


def test_load_prepared_core(tiny_core, raw):
    m = mf.load_manifest(tiny_core)
    # Numbers come from TINY_OPTS in conftest.py.
    assert m.abi == mf.ABI_VERSION == 6
    assert m.identity.device == "cpu" and m.identity.compute_capability is None
    c = m.capacities
    assert (c.context_limit, c.prefill_chunk, c.prefill_capacities) == (1024, 128, (128,))
    assert c.decode_capacities == (1, 2, 4, 8) and c.slots == 8
    assert c.max_pages_per_slot == 1024 // 16
    assert (m.pages.page_size, m.pages.num_pages, m.pages.null_page) == (16, 256, 0)
    assert [p.name for p in m.programs] == ["admit.128", "prefill.128", "decode.1", "decode.2", "decode.4", "decode.8",
                                            "score.128", "resume.1", "snapshot.1", "restore.1"]
    assert (c.max_logprobs, c.score_chunk) == (20, 128)
    assert m.buffer("state.page_table").shape == (9, 64)
    # Continuation: an attention-only model carries the hidden vector; snapshot rows + the null row.
    assert c.snapshot_rows == 32
    assert m.continuation == mf.Continuation(state=("state.hidden",), tail="snap.kv_tail")
    assert m.buffer("snap.state.hidden").shape == (33, 64)
    assert m.buffer("snap.kv_tail").shape == (33, 2, 2, 16, 2, 16)  # rows, layers, K|V, page, kv heads, dim
    assert m.buffer("snap.kv_tail").nbytes // 33 == m.pages.bytes_per_page
    # One rank, files at the top level (docs/tensor-parallel.md).
    assert m.parallel == mf.Parallel(tp_size=1, ranks=(mf.RankCore(dir=".", base_address=0),))
    # The decoded struct re-encodes to the same document (no field lost or invented).
    assert json.loads(mf.encode_manifest(m)) == raw


def test_load_missing_directory(tmp_path):
    with pytest.raises(ManifestError, match="cannot read runtime core manifest"):
        mf.load_manifest(tmp_path / "nowhere")


def test_unknown_top_level_field(raw):
    d = {**raw, "extras": 1}
    _reject(d, param=None, match=r"Object contains unknown field `extras`")


def test_unknown_nested_field(raw):
    d = json.loads(json.dumps(raw))
    d["capacities"]["max_batch"] = 4
    _reject(d, param=None, match=r"unknown field `max_batch`.*\$\.capacities")


def test_missing_field(raw):
    d = json.loads(json.dumps(raw))
    del d["capacities"]["slots"]
    _reject(d, param=None, match=r"missing required field `slots`.*\$\.capacities")
    d = {k: v for k, v in raw.items() if k != "pages"}
    _reject(d, param=None, match=r"missing required field `pages`")


def test_abi_mismatch(raw):
    d = {**raw, "abi": mf.ABI_VERSION + 1}
    err = _reject(d, param="abi", match=f"exported with ABI {mf.ABI_VERSION + 1}", error=CoreCompatibilityError)
    assert err.code == "abi_mismatch"
    # The probe runs first: an older or future ABI is reported as such even if the rest of
    # the document would not decode under this ABI's schema (ABI 1 cores have no checkpoints,
    # ABI 2 cores no grammar masks, ABI 3 cores no parallel section, ABI 4 cores no verify room,
    # ABI 5 cores no log-probability flags).
    for abi in (1, 2, 3, 4, 5, 7):
        d = {"abi": abi, "something": "else"}
        err = _reject(d, param="abi", match=f"exported with ABI {abi}", error=CoreCompatibilityError)
        assert err.code == "abi_mismatch"
    assert err.code == "abi_mismatch"


def test_identity_abi_disagrees(raw):
    d = json.loads(json.dumps(raw))
    d["identity"]["abi"] = 0
    _reject(d, param="abi", match="ABI fields disagree")


def test_overlapping_buffers(raw):
    d = json.loads(json.dumps(raw))
    # state.pending starts where state.len starts (both aligned, both in the arena).
    _buffer(d, "state.pending")["offset"] = _buffer(d, "state.len")["offset"]
    _reject(d, param="state.pending", match="buffers 'state.len' and 'state.pending' overlap")


def test_overlap_by_one_alignment_unit(raw):
    d = json.loads(json.dumps(raw))
    kv = _buffer(d, "kv")
    nxt = min((b for b in d["buffers"] if b["offset"] > kv["offset"]), key=lambda b: b["offset"])
    # Move the next buffer back by one alignment unit: it now starts inside kv.
    nxt["offset"] = kv["offset"] + kv["nbytes"] - d["arena"]["alignment"]
    _reject(d, param=nxt["name"], match=f"buffers 'kv' and '{nxt['name']}' overlap")


def test_buffer_outside_arena(raw):
    d = json.loads(json.dumps(raw))
    last = max(d["buffers"], key=lambda b: b["offset"] + b["nbytes"])
    d["arena"]["nbytes"] = last["offset"] + last["nbytes"] - 1
    _reject(d, param=last["name"], match="lies outside the arena")


def test_misaligned_buffer(raw):
    d = json.loads(json.dumps(raw))
    _buffer(d, "state.len")["offset"] += 4
    _reject(d, param="state.len", match="outside the arena or is misaligned")


def test_extent_disagrees_with_shape(raw):
    d = json.loads(json.dumps(raw))
    _buffer(d, "in.tokens")["nbytes"] -= 4
    _reject(d, param="in.tokens", match="extent 508 does not match its shape")


def test_runtime_buffer_with_wrong_shape(raw):
    d = json.loads(json.dumps(raw))
    b = _buffer(d, "state.len")
    # One row short (slots instead of slots + 1), extent kept consistent with the shape.
    b["shape"] = [8]
    b["nbytes"] = 32
    _reject(d, param="state.len", match=r"runtime buffer 'state.len' is state/int32\(8,\), expected state/int32\(9,\)")


def test_runtime_buffer_with_wrong_dtype(raw):
    d = json.loads(json.dumps(raw))
    b = _buffer(d, "state.seed")
    b["dtype"] = "int32"
    b["nbytes"] //= 2
    _reject(d, param="state.seed", match=r"expected state/int64\(9,\)")


def test_missing_runtime_buffer(raw):
    d = json.loads(json.dumps(raw))
    d["buffers"] = [b for b in d["buffers"] if b["name"] != "in.decode_slots"]
    _reject(d, param="in.decode_slots", match="core lacks runtime buffer 'in.decode_slots'")


def test_prefill_capacities_must_follow_the_rule(raw):
    d = json.loads(json.dumps(raw))
    d["capacities"]["prefill_capacities"] = [64, 128]
    _reject(d, param="capacities.prefill_capacities", match=r"\(64, 128\) do not follow the chunk rule for 128")


def test_prefill_programs_must_cover_capacities(raw):
    d = json.loads(json.dumps(raw))
    d["programs"] = [p for p in d["programs"] if p["kind"] != "prefill"]
    _reject(d, param="programs", match="prefill programs do not cover")


def test_score_programs_must_match_the_score_chunk(raw):
    d = json.loads(json.dumps(raw))
    d["programs"] = [p for p in d["programs"] if p["kind"] != "score"]
    _reject(d, param="programs", match="score programs do not match")
    d = json.loads(json.dumps(raw))
    d["capacities"]["max_logprobs"] = 0  # records declared wider than the capacities say
    _reject(d, param="out.prefill_completion", match=r"is output/int32\(1, 45\), expected output/int32\(1, 4\)")


def test_max_pages_per_slot_rule(raw):
    d = json.loads(json.dumps(raw))
    d["capacities"]["max_pages_per_slot"] = 65
    _reject(d, param="capacities.max_pages_per_slot", match=r"ceil\(context_limit / page_size\)")


def test_program_refers_to_unknown_buffer(raw):
    d = json.loads(json.dumps(raw))
    d["programs"][2]["reads"] = [*d["programs"][2]["reads"], "in.nothing"]
    _reject(d, param="decode.1", match="refers to unknown buffer 'in.nothing'")


def _resize_rows(b: dict, rows: int) -> None:
    per_row = b["nbytes"] // b["shape"][0]
    b["shape"][0] = rows
    b["nbytes"] = per_row * rows


def test_continuation_buffer_must_be_per_slot_state(raw):
    d = json.loads(json.dumps(raw))
    d["continuation"]["state"] = ["state.hidden", "state.len"]  # state.len has no snapshot twin
    _reject(d, param="continuation.state", match="needs a snapshot twin 'snap.state.len'")
    d = json.loads(json.dumps(raw))
    d["continuation"]["state"] = ["state.hidden", "in.tokens"]
    _reject(d, param="continuation.state", match="'in.tokens' must be a state buffer")
    d = json.loads(json.dumps(raw))
    d["continuation"]["state"] = []
    _reject(d, param="continuation.state", match="must include state.hidden")


def test_snapshot_twin_must_have_one_row_per_snapshot_row(raw):
    d = json.loads(json.dumps(raw))
    _resize_rows(_buffer(d, "snap.state.hidden"), 32)  # the null row missing
    _reject(d, param="continuation.state", match=r"twin 'snap.state.hidden' of shape \(33, 64\)")


def test_snapshot_twin_must_match_dtype(raw):
    d = json.loads(json.dumps(raw))
    b = _buffer(d, "snap.state.hidden")
    b["dtype"] = "float16"
    b["nbytes"] //= 2
    _reject(d, param="continuation.state", match="needs a snapshot twin")


def test_tail_must_hold_one_kv_page_per_row(raw):
    d = json.loads(json.dumps(raw))
    b = _buffer(d, "snap.kv_tail")
    b["shape"] = [33, 2, 2, 8, 2, 16]  # half a page
    b["nbytes"] //= 2
    _reject(d, param="continuation.tail", match="one KV page per row")
    d = json.loads(json.dumps(raw))
    d["continuation"]["tail"] = "snap.nothing"
    _reject(d, param="continuation.tail", match="one KV page per row")


def test_unaccounted_snapshot_buffer(raw):
    """A snapshot row is fully described by the continuation section: a snapshot buffer
    it does not name is rejected (the runtime would never copy it)."""
    d = json.loads(json.dumps(raw))
    _buffer(d, "w.model.norm.weight")["role"] = "snapshot"
    _reject(d, param="continuation", match=r"snapshot buffers outside the continuation section: \['w.model.norm.weight'\]")
    d = json.loads(json.dumps(raw))
    d["continuation"]["tail"] = "snap.state.hidden"
    _reject(d, param="continuation.tail", match="one KV page per row")


@pytest.mark.parametrize("kind", ["resume", "snapshot", "restore"])
def test_state_programs_are_required(raw, kind):
    d = json.loads(json.dumps(raw))
    d["programs"] = [p for p in d["programs"] if p["kind"] != kind]
    _reject(d, param="programs", match=f"exactly one {kind} program of capacity 1")


def test_parallel_section(raw):
    """TP size, rank list and rank directories must agree; reference rank arenas have
    no address; CUDA rank arenas start at the arena's address and do not overlap."""
    def edit(**parallel):
        d = json.loads(json.dumps(raw))
        d["parallel"].update(parallel)
        return d

    one = raw["parallel"]["ranks"][0]
    _reject(edit(tp_size=0, ranks=[]), param="parallel.tp_size", match="at least 1, got 0")
    _reject(edit(tp_size=2), param="parallel.ranks", match="lists 1 ranks for tp_size 2")
    _reject(edit(ranks=[{**one, "dir": "rank0"}]), param="parallel.ranks[0].dir", match="must be '.'")
    _reject(edit(tp_size=2, ranks=[{**one, "dir": "rank0"}, {**one, "dir": "../elsewhere"}]),
            param="parallel.ranks[1].dir", match="must be 'rank1'")
    _reject(edit(ranks=[{**one, "base_address": 1 << 40}]), param="parallel.ranks",
            match="reference cores have no arena addresses")
    d = edit()
    del d["parallel"]
    _reject(d, param=None, match="missing required field `parallel`")
    # A CUDA core's rank arenas: rank 0 at the arena's address, ranges disjoint.
    base, n = 0x7F0000000000, raw["arena"]["nbytes"]
    d = edit(tp_size=2, ranks=[{"dir": "rank0", "base_address": base}, {"dir": "rank1", "base_address": base + n - 256}])
    d["identity"].update(device="cuda", compute_capability="9.0")
    d["arena"]["base_address"] = base
    d["kernels"] = "kernels.json"
    for prog in d["programs"]:
        prog["graph"] = f"graphs/{prog['name']}.json"
    _reject(d, param="parallel.ranks[1].base_address", match="rank arenas 0 and 1 overlap")
    d["parallel"]["ranks"][1]["base_address"] = base + n
    _decode(d)
    d["parallel"]["ranks"][0]["base_address"] = base + 2 * n
    _reject(d, param="parallel.ranks[0].base_address", match="rank 0's arena address must be the arena's")


def test_missing_rank_image_rejects_the_core(tiny_core, tmp_path):
    import shutil

    core = tmp_path / "core"
    shutil.copytree(tiny_core, core)
    (core / "weights.safetensors").unlink()
    with pytest.raises(ManifestError, match=r"lacks rank 0's arena image \./weights\.safetensors") as e:
        mf.load_manifest(core)
    assert e.value.param == "parallel.ranks[0]"


@pytest.mark.parametrize(
    "chunk,context,expected",
    [
        (64, 64, (64,)),
        (64, 2048, (64,)),
        (128, 2048, (128,)),
        (192, 2048, (128, 192)),
        (512, 2048, (128, 256, 512)),
        (640, 2048, (128, 256, 512, 640)),
        (2048, 2048, (128, 256, 512, 1024, 2048)),
    ],
)
def test_prefill_capacities_rule(chunk, context, expected):
    assert mf.prefill_capacities_for(chunk, context) == expected


@pytest.mark.parametrize("smallest,chunk,expected", [(16, 64, (16, 32, 64)), (16, 512, (16, 32, 64, 128, 256, 512)),
                                                    (64, 192, (64, 128, 192)), (32, 128, (32, 64, 128))])
def test_prefill_capacities_rule_with_small_programs(smallest, chunk, expected):
    assert mf.prefill_capacities_for(chunk, 2048, smallest) == expected
    with pytest.raises(ValueError, match="one of"):
        mf.prefill_capacities_for(chunk, 2048, 48)


def test_small_prefill_programs_must_be_declared(raw):
    d = json.loads(json.dumps(raw))
    d["capacities"]["min_prefill_capacity"] = 32  # the core's programs start at 128
    _reject(d, param="capacities.prefill_capacities", match="do not follow the chunk rule")


@pytest.mark.parametrize("edit,match", [
    ({"pack_capacities": [64]}, "pack programs do not match"),  # declared, none prepared
    ({"pack_capacities": [64, 64]}, "unique and ascending"),
    ({"pack_capacities": [40]}, "multiple of 16"),
    ({"pack_align": 3}, "power of two"),
])
def test_pack_capacities_must_be_consistent(raw, edit, match):
    d = json.loads(json.dumps(raw))
    d["capacities"].update(edit)
    _reject(d, param="capacities.pack_" + next(iter(edit)).split("_", 1)[1], match=match)


@pytest.mark.parametrize("draft_tokens,match", [(3, "verify programs do not match"), (17, "must lie in")])
def test_draft_tokens_must_match_the_verify_programs(raw, draft_tokens, match):
    d = json.loads(json.dumps(raw))
    d["capacities"]["draft_tokens"] = draft_tokens  # declared, none prepared (or past the ceiling)
    _reject(d, param="capacities.draft_tokens", match=match)


@pytest.mark.parametrize("chunk,context", [(96, 2048), (0, 2048), (32, 2048), (256, 128)])
def test_prefill_capacities_rule_rejects(chunk, context):
    with pytest.raises(ValueError, match="multiple of 64"):
        mf.prefill_capacities_for(chunk, context)


def test_check_device(tiny_core):
    m = mf.load_manifest(tiny_core)
    mf.check_device(m, device="cpu", compute_capability=None)
    with pytest.raises(CoreCompatibilityError) as e:
        mf.check_device(m, device="cuda", compute_capability="9.0")
    assert (e.value.code, e.value.param) == ("device_mismatch", "identity.device")

    cuda = msgspec.structs.replace(
        m, identity=msgspec.structs.replace(m.identity, device="cuda", compute_capability="9.0"))
    mf.check_device(cuda, device="cuda", compute_capability="9.0")
    for other in ("12.0", "8.9", None):
        with pytest.raises(CoreCompatibilityError, match="prepared for compute capability 9.0") as e:
            mf.check_device(cuda, device="cuda", compute_capability=other)
        assert (e.value.code, e.value.param) == ("compute_capability_mismatch", "identity.compute_capability")
