"""The Gated DeltaNet block grid (recipes/qwen3_5._aligned_prefill) with
flash-linear-attention's chunked rule on the GPU: the CPU tests (tests/test_gdn_grid.py)
stand Transformers' torch rule in for it, and the grid relies on three properties of the
kernel itself: its blocks are the grid's 64 tokens (the chunk size is passed), masked rows
after a partial block change nothing before them, and a block's bits do not depend on how
long the call is. One layer's mixer of the small hybrid shape (float32, eager, as the
hybrid rig test runs it) gets the same 300 tokens in different partitions and through a
copied checkpoint; every output row and state row must be the same bits."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import HYBRID_OPTS, prepare_core
from tests.gpu.conftest import SHAPES
from tests.test_gdn_grid import GDN, Layer, _equal_state

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_partitions_and_checkpoints_on_flash_linear_attention():
    if "qwen3_5-small-shape" not in SHAPES:
        pytest.skip("the hybrid is not among this run's shapes")
    core = prepare_core("qwen3_5-small-shape", HYBRID_OPTS)
    x = Layer(core, "triton", caps=(16, 40, 128), device="cuda")
    g = torch.Generator(device="cuda").manual_seed(7)
    n, dt = 300, x.r.v[GDN[0]].dtype
    mixed = torch.randn(n, x.mod.conv_dim, generator=g, device="cuda").to(dt)
    b = torch.randn(n, x.mod.num_v_heads, generator=g, device="cuda").to(dt)
    a = torch.randn(n, x.mod.num_v_heads, generator=g, device="cuda").to(dt)
    whole = x.run(1, mixed, b, a, [128, 256])
    for slot, cuts in ((2, [37, 101, 170, 257, 299]), (3, [*range(1, 71), 190]), (4, [63, 64, 65, 127, 129])):
        got = x.run(slot, mixed, b, a, cuts)
        assert torch.equal(got, whole), (slot, (got - whole).abs().max().item())
        _equal_state(x, 1, x, slot)
    for slot in (2, 3):  # fresh slots, as admit leaves them
        for name in GDN:
            x.r.v[name][slot].zero_()
        x.len[slot] = 0
    x.run(2, mixed[:101], b[:101], a[:101], [])
    for name in GDN:
        x.r.v[name][3].copy_(x.r.v[name][2])
    x.len[3] = 101
    assert torch.equal(x.run(3, mixed[101:], b[101:], a[101:], []), whole[101:])
    _equal_state(x, 1, x, 3)
