"""Randomised paged-attention cases shared by the CPU (interpreter) and GPU tests.

A case is a page pool filled with noise, a shuffled page table (request slot 0
is the null slot, page 0 the null page: no request owns either), and one step's
tokens: a decode batch (one token per slot) or a prefill chunk (one slot,
positions ``start..start+n-1``, then padded rows). ``run_reference`` and
``run_triton`` perform the step as flare_paged_attention does: write the new
keys/values, then attend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flare.prepare.attention import PagedBatch, attend_reference, write_kv


@dataclass(frozen=True)
class Shape:
    H: int
    KVH: int
    D: int
    page_size: int
    layers: int = 2
    slots: int = 6  # request slots, slot 0 = null
    max_pages: int = 5  # pages per slot

    @property
    def pages(self) -> int:  # page 0 = null page, plus a few never mapped
        return 1 + self.slots * self.max_pages + 3

    @property
    def max_keys(self) -> int:
        return self.max_pages * self.page_size


@dataclass
class Step:
    kv: torch.Tensor
    page_table: torch.Tensor
    token_slot: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layer: int
    single_slot: bool

    @property
    def slot_mapping(self) -> torch.Tensor:
        ps = self.kv.shape[3]
        page = self.page_table[self.token_slot, self.positions // ps].long()
        return torch.where(self.valid, page * ps + self.positions % ps, -1)

    def batch(self, kv: torch.Tensor, impl: str) -> PagedBatch:
        return PagedBatch(kv, self.page_table, self.token_slot, self.positions, self.slot_mapping, self.valid,
                          impl=impl, single_slot=self.single_slot)


def pool(shape: Shape, dtype: torch.dtype, gen: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    s = shape
    kv = torch.randn(s.layers, 2, s.pages, s.page_size, s.KVH, s.D, generator=gen).to(dtype).to(device)
    owned = torch.randperm(s.pages - 1, generator=gen)[: (s.slots - 1) * s.max_pages] + 1
    pt = torch.zeros(s.slots, s.max_pages, dtype=torch.int32)
    pt[1:] = owned.view(s.slots - 1, s.max_pages).int()
    return kv, pt.to(device)


def _new_qkv(shape: Shape, T: int, dtype, gen, device):
    q = torch.randn(T, shape.H, shape.D, generator=gen).to(dtype).to(device)
    # k/v as the model hands them over: [KVH, T, D] transposed, i.e. not contiguous.
    k = torch.randn(shape.KVH, T, shape.D, generator=gen).to(dtype).to(device).transpose(0, 1)
    v = torch.randn(shape.KVH, T, shape.D, generator=gen).to(dtype).to(device).transpose(0, 1)
    return q, k, v


def decode_step(shape: Shape, lengths: list[int | None], dtype, seed: int, device: str) -> Step:
    """One token per live slot; ``None`` in ``lengths`` is a padded row (slot 0, position 0).
    A live row of length ``n`` is the token at position ``n - 1``."""
    gen = torch.Generator().manual_seed(seed)
    kv, pt = pool(shape, dtype, gen, device)
    live = [n for n in lengths if n is not None]
    slots = (torch.randperm(shape.slots - 1, generator=gen)[: len(live)] + 1).tolist()
    token_slot, positions = [], []
    for n in lengths:
        token_slot.append(0 if n is None else slots.pop())
        positions.append(0 if n is None else n - 1)
    T = len(lengths)
    q, k, v = _new_qkv(shape, T, dtype, gen, device)
    return Step(kv, pt, torch.tensor(token_slot, device=device), torch.tensor(positions, device=device),
                torch.tensor([n is not None for n in lengths], device=device), q, k, v,
                layer=seed % shape.layers, single_slot=False)


def prefill_step(shape: Shape, start: int, n: int, chunk: int, dtype, seed: int, device: str,
                 single_slot: bool = True) -> Step:
    """``n`` tokens of one slot at positions ``start..start+n-1`` (history already cached), padded to ``chunk``."""
    gen = torch.Generator().manual_seed(seed)
    kv, pt = pool(shape, dtype, gen, device)
    slot = int(torch.randint(1, shape.slots, (1,), generator=gen))
    idx = torch.arange(chunk, device=device)
    valid = idx < n
    positions = torch.where(valid, start + idx, 0)
    token_slot = torch.tensor([slot], device=device).expand(chunk)  # stride 0, as the prefill program builds it
    q, k, v = _new_qkv(shape, chunk, dtype, gen, device)
    return Step(kv, pt, token_slot, positions, valid, q, k, v, layer=seed % shape.layers, single_slot=single_slot)


def run_reference(step: Step, scaling: float, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    kv = step.kv.clone()
    b = step.batch(kv, "reference")
    write_kv(b, step.layer, step.k, step.v)
    return attend_reference(b, step.layer, step.q, scaling, window), kv


def run_fp32_truth(step: Step, kv_after_write: torch.Tensor, scaling: float, window: int = 0) -> torch.Tensor:
    """The reference in fp32 over the same (already rounded) inputs."""
    b = step.batch(kv_after_write.float(), "reference")
    return attend_reference(b, step.layer, step.q.float(), scaling, window)


def run_triton(step: Step, scaling: float, num_splits: int | None = None,
               window: int = 0, **launch) -> tuple[torch.Tensor, torch.Tensor]:
    from flare.prepare.kernels.kv_write import write_kv_triton
    from flare.prepare.kernels.paged_attention import attend_triton

    kv = step.kv.clone()
    b = step.batch(kv, "triton")
    write_kv_triton(b, step.layer, step.k, step.v)
    return attend_triton(b, step.layer, step.q, scaling, num_splits=num_splits, window=window, **launch), kv
