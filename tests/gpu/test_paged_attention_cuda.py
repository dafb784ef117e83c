"""Triton paged attention on CUDA: bf16 accuracy, a 4096-token prefill, no host
synchronisation, and CUDA-graph capture replayed with new positions, page
tables, slots and padding.

bf16 bound: the kernel's scores and softmax state are fp32; it rounds P to
bf16 before P@V (relative error <= 2^-9 per weight) and the output to bf16
(<= 2^-9 relative). Since the output is a convex combination of V rows, the
error against fp32 attention over the same bf16 inputs is at most about
2^-8 * max|v| (~0.016 for N(0, 1) values, max|v| ~ 4); assert 2e-2 absolute
+ 2^-7 relative. The bf16 eager reference carries errors of the same kind, so
the two are compared with twice that.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1: kernels are interpreted"),
]

from tests.paged_cases import Shape, decode_step, prefill_step, run_fp32_truth, run_reference, run_triton  # noqa: E402

BF16_TOL = dict(atol=2e-2, rtol=2**-7)
BF16_VS_REF_TOL = dict(atol=4e-2, rtol=2**-6)
SHAPES = [
    Shape(H=9, KVH=3, D=64, page_size=16, slots=9, max_pages=40),  # SmolLM2-135M
    Shape(H=32, KVH=8, D=128, page_size=16, slots=9, max_pages=40),  # Llama-3-8B
    Shape(H=16, KVH=2, D=128, page_size=64, slots=9, max_pages=12),  # GQA 8
    Shape(H=8, KVH=8, D=64, page_size=32, slots=9, max_pages=20),  # MHA
    Shape(H=16, KVH=4, D=256, page_size=16, slots=9, max_pages=40),  # Qwen3.5-9B gated attention
]
IDS = [f"H{s.H}-KVH{s.KVH}-D{s.D}-ps{s.page_size}" for s in SHAPES]


def check_bf16(step, shape):
    scaling = shape.D**-0.5
    ref, kv_ref = run_reference(step, scaling)
    out, kv_tri = run_triton(step, scaling)
    assert torch.equal(kv_tri[:, :, 1:], kv_ref[:, :, 1:])
    assert torch.equal(kv_tri[:, :, 0], step.kv[:, :, 0])
    assert torch.isfinite(out).all()
    assert not out[~step.valid].any()
    truth = run_fp32_truth(step, kv_ref, scaling)
    torch.testing.assert_close(out.float(), truth, **BF16_TOL)
    torch.testing.assert_close(out.float(), ref.float(), **BF16_VS_REF_TOL)
    return (out.float() - truth).abs().max().item()


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_bf16_decode(shape):
    ps, full = shape.page_size, shape.max_keys
    lengths = [1, ps - 1, ps, ps + 1, None, full // 2, full, 3 * ps + 5, None, 2]
    check_bf16(decode_step(shape, lengths, torch.bfloat16, 1, "cuda"), shape)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_bf16_prefill_chunk_with_history(shape):
    start = shape.max_keys // 3 + 1
    n = min(200, shape.max_keys - start)
    check_bf16(prefill_step(shape, start, n, 256, torch.bfloat16, 2, "cuda"), shape)


def test_bf16_prefill_4096_tokens():
    shape = Shape(H=32, KVH=8, D=128, page_size=16, slots=3, max_pages=300, layers=1)
    step = prefill_step(shape, start=300, n=4000, chunk=4096, dtype=torch.bfloat16, seed=3, device="cuda")
    check_bf16(step, shape)


@pytest.mark.parametrize("window", [0, 1000])
def test_bf16_prompt_rows_are_the_same_bits_in_a_short_and_a_long_program(window):
    """Rows 2048..2063 of one slot (the same queries over the same cached keys), in bf16 at
    Llama-8B's attention geometry: computed as a 16-row chunk after 2,048 cached tokens (the
    prefix-cache hit: the device splits its keys over many programs), as the tail of a
    1,040-row chunk in a 2,048-row program and of a 64-row chunk in a 128-row program, they
    are the same bits. The prefix cache's exactness rests on this for every attention layer."""
    from flare.prepare.kernels.paged_attention import attend_triton

    shape = Shape(H=32, KVH=8, D=128, page_size=16, slots=3, max_pages=136, layers=1)
    qs = torch.randn(2064, shape.H, shape.D, generator=torch.Generator().manual_seed(9)).bfloat16().cuda()
    outs = []
    for start, n, chunk in [(2048, 16, 16), (1024, 1040, 2048), (2000, 64, 128), (2048, 16, 128)]:
        step = prefill_step(shape, start=start, n=n, chunk=chunk, dtype=torch.bfloat16, seed=11, device="cuda")
        q = step.q.clone()
        q[:n] = qs[start:start + n]
        out = attend_triton(step.batch(step.kv.clone(), "triton"), step.layer, q, shape.D**-0.5, window=window)
        outs.append(out[2048 - start:2064 - start])
    assert outs[0].abs().sum() > 0
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_fp32_decode_is_tight_on_gpu():
    shape = SHAPES[1]
    step = decode_step(shape, [1, 17, None, 300, 640], torch.float32, 4, "cuda")
    ref, _ = run_reference(step, 0.1)
    out, _ = run_triton(step, 0.1)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_no_host_synchronisation():
    from flare.prepare.kernels.kv_write import write_kv_triton
    from flare.prepare.kernels.paged_attention import attend_triton

    shape = SHAPES[0]
    steps = [decode_step(shape, [5, None, 70], torch.bfloat16, 5, "cuda"),
             prefill_step(shape, 20, 100, 128, torch.bfloat16, 6, "cuda")]
    batches = [step.batch(step.kv.clone(), "triton") for step in steps]
    for step in steps:
        run_triton(step, 0.125)  # compile first: compilation is not what we check
        run_triton(step, 0.125, num_splits=4)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step, batch in zip(steps, batches):
            write_kv_triton(batch, step.layer, step.k, step.v)
            attend_triton(batch, step.layer, step.q, 0.125)
            attend_triton(batch, step.layer, step.q, 0.125, num_splits=4)
    finally:
        torch.cuda.set_sync_debug_mode("default")


class Captured:
    """Static input buffers, one captured write + attend over them (as a prepared program does)."""

    def __init__(self, shape: Shape, T: int, single_slot: bool):
        from flare.prepare.attention import PagedBatch
        from flare.prepare.kernels.kv_write import write_kv_triton
        from flare.prepare.kernels.paged_attention import attend_triton

        dev, s = "cuda", shape
        self.shape, self.layer = shape, 1
        self.kv = torch.zeros(s.layers, 2, s.pages, s.page_size, s.KVH, s.D, dtype=torch.bfloat16, device=dev)
        self.page_table = torch.zeros(s.slots, s.max_pages, dtype=torch.int32, device=dev)
        self.token_slot = torch.zeros(T, dtype=torch.long, device=dev)
        self.positions = torch.zeros(T, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((T,), -1, dtype=torch.long, device=dev)
        self.valid = torch.zeros(T, dtype=torch.bool, device=dev)
        self.q = torch.zeros(T, s.H, s.D, dtype=torch.bfloat16, device=dev)
        self.k = torch.zeros(T, s.KVH, s.D, dtype=torch.bfloat16, device=dev)
        self.v = torch.zeros(T, s.KVH, s.D, dtype=torch.bfloat16, device=dev)
        batch = PagedBatch(self.kv, self.page_table, self.token_slot, self.positions, self.slot_mapping,
                           self.valid, impl="triton", single_slot=single_slot)

        def program():
            write_kv_triton(batch, self.layer, self.k, self.v)
            return attend_triton(batch, self.layer, self.q, s.D**-0.5)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            program()  # compile outside the capture
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = program()

    def replay_and_check(self, step) -> None:
        """Load ``step`` into the static buffers, replay, compare with the eager reference."""
        step.layer = self.layer  # the layer is baked into the capture
        self.kv.copy_(step.kv)
        for name in ("page_table", "token_slot", "positions", "slot_mapping", "valid", "q", "k", "v"):
            getattr(self, name).copy_(getattr(step, name))
        ref, kv_ref = run_reference(step, self.shape.D**-0.5)
        self.graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(self.kv[:, :, 1:], kv_ref[:, :, 1:])
        assert torch.equal(self.kv[:, :, 0], step.kv[:, :, 0])
        assert not self.out[~step.valid].any()
        truth = run_fp32_truth(step, kv_ref, self.shape.D**-0.5)
        torch.testing.assert_close(self.out.float(), truth, **BF16_TOL)
        torch.testing.assert_close(self.out.float(), ref.float(), **BF16_VS_REF_TOL)


def test_decode_graph_replays_with_new_slots_positions_and_tables():
    shape = SHAPES[0]
    ps = shape.page_size
    graph = Captured(shape, T=8, single_slot=False)
    for seed, lengths in enumerate([
        [1, 2, 3, 4, 5, 6, 7, 8],
        [ps, None, ps + 1, 300, None, None, ps - 1, shape.max_keys],
        [None] * 8,
        [shape.max_keys - 1, 33, 1, None, 129, 64, 65, 200],
    ]):
        graph.replay_and_check(decode_step(shape, lengths, torch.bfloat16, 100 + seed, "cuda"))


def test_prefill_graph_replays_with_new_history_and_lengths():
    shape = SHAPES[1]
    graph = Captured(shape, T=256, single_slot=True)
    for seed, (start, n) in enumerate([(0, 256), (17, 100), (400, 1), (shape.max_keys - 256, 256), (0, 0)]):
        graph.replay_and_check(prefill_step(shape, start, n, 256, torch.bfloat16, 200 + seed, "cuda"))
