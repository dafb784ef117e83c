"""A prepared core's programs run in-process, as the reference worker runs them.

The arena is one anonymous shared mapping filled from the core's image (only
the pages a program touches are ever backed), the recipe's model is bound to
views of it, and programs are driven with the writes the scheduler stages
(``StepEncoder.admission`` / ``prefill`` / ``decode`` and the
checkpoint steps). Shared by the program, hybrid-recipe and snapshot tests.
"""

from __future__ import annotations

import mmap
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from flare.core import interface as io
from flare.core.image import iter_image
from flare.core.manifest import Manifest, ProgramKind, load_manifest
from flare.core.sampling_params import NEUTRAL
from flare.prepare.programs import ProgramSet, arena_views


@dataclass
class Rig:
    core: Path
    m: Manifest
    arena: torch.Tensor
    v: dict[str, torch.Tensor]
    run: dict
    model: torch.nn.Module  # the Transformers module tree, bound to the arena
    specs: list
    free_pages: list[int] = field(default_factory=list)
    # Frontend pieces, set by tests that build prompts from text (TextCodec, ChatTemplate).
    codec: Any = None
    template: Any = None

    def pages(self, n: int) -> list[int]:
        out, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        assert len(out) == n
        return out


def load_rig(core: Path, seed: int = 0, *, compiled: bool = False, attention: str = "reference",
             device: str = "cpu", sampler_kernel: bool = False) -> Rig:
    """``attention``: the PagedBatch implementation the programs run (``triton``: the CUDA
    kernels, under Triton's CPU interpreter on the CPU); ``device``: where the arena lives
    (a reference core's programs run eagerly on a GPU too); ``sampler_kernel``: the sampler's
    and the commit's Triton kernels (``flare-prepare --sampler kernel``, the CUDA default)."""
    m = load_manifest(core)
    mapping = mmap.mmap(-1, m.arena.nbytes)
    arena = torch.frombuffer(mapping, dtype=torch.uint8)
    host = memoryview(mapping)
    image = core / m.arena.image
    with image.open("rb") as f:
        for b, off, n in iter_image(image, m):
            f.seek(off)
            assert f.readinto(host[b.offset : b.offset + n]) == n
    if device != "cpu":
        arena = arena.to(device)
    views = arena_views(arena, m.buffers)
    programs = ProgramSet.for_core(m, views, attention)
    programs.sampler_kernel = sampler_kernel
    if compiled:
        programs.compile_glue()
    run = {p.name: programs.callable(p.kind, p.capacity) for p in m.programs}
    r = Rig(core, m, arena, views, run, programs.model.module, programs.recipe.weights(programs.model))
    # Pages in a scrambled order: page tables are never the identity or contiguous.
    r.free_pages = random.Random(seed).sample(range(1, m.pages.num_pages), m.pages.num_pages - 1)
    return r


def copy_rig(src: Rig, dst: Rig) -> None:
    """Make ``dst`` (a rig of the same core) hold what ``src`` holds: its whole arena (state,
    KV pages, buffers) and its free pages, as if it had run the same programs."""
    dst.arena.copy_(src.arena)
    dst.free_pages = list(src.free_pages)


def prefilled_rigs(core: Path, prompts: dict[int, list[int]], n: int, *, attention: str = "reference",
                   pages: int = 4, prefilled: dict[int, int] | None = None, sample: bool = True) -> list[Rig]:
    """``n`` rigs of ``core`` on the ``attention`` path, each in the state that admitting
    ``prompts`` ({slot: tokens}, seed = slot, ``pages`` pages each) and prefilling them (only the
    first ``prefilled[slot]`` tokens of the slots named there, when given; sampling if
    ``sample``) leaves: the prefills run once, in a reference rig whose arena (weights, KV
    pages, every state row) and free pages each rig copies. For tests whose subject comes after
    those prefills, from this one state: under Triton's interpreter each prefill is a padded
    prefill program of several seconds, and what it leaves is not what they check."""
    base = load_rig(core)
    for slot, prompt in prompts.items():
        admit(base, slot, prompt, base.pages(pages), seed=slot)
    for slot, prompt in prompts.items():
        if prefilled is None or slot in prefilled:
            prefill(base, slot, prompt[: len(prompt) if prefilled is None else prefilled[slot]], sample=sample)
    rigs = [load_rig(core, attention=attention) for _ in range(n)]
    for r in rigs:
        copy_rig(base, r)
    return rigs


def write_rows(r: Rig, slot: int, rows: dict) -> None:
    for name, value in rows.items():
        r.v[name][slot] = torch.as_tensor(value)


def write_input(r: Rig, row) -> None:
    """A program input row (``flare.core.interface``) into its buffer."""
    r.v[row.buffer][:] = torch.from_numpy(io.pack(row))


def admit(r: Rig, slot: int, prompt: list[int], pages: list[int], seed: int, *, top_k: int = 1,
          chunks: int | None = None, sampling: dict | None = None, logprobs: bool = True) -> None:
    """Write the slot's state rows and run the admit programs over the prompt (only its
    first ``chunks`` admit chunks when given). Sampling is neutral but for ``top_k``
    (1 = greedy: the sampled token is the argmax of out.logits) and ``sampling``;
    ``logprobs``: whether the slot's records carry log-probability blocks (zeros otherwise)."""
    c = r.m.capacities
    write_rows(r, slot, io.slot_state(
        pending=0, generated=0, max_new=4096, seed=seed, sampling={**NEUTRAL, "top_k": top_k, **(sampling or {})},
        stop_ids=r.m.frontend.eos_ids, stop_capacity=c.stop_ids, pages=pages, max_pages=c.max_pages_per_slot,
        mask_on=False, logprobs=logprobs))
    C = r.m.programs_of(ProgramKind.admit)[0].capacity
    for i in range(0, max(len(prompt), 1), C)[:chunks]:
        chunk = prompt[i : i + C]
        r.v[io.TOKENS][: len(chunk)] = torch.tensor(chunk, dtype=torch.int32)
        write_input(r, io.AdmitInput(slot, len(chunk), int(i == 0), io.AdmitMode.prompt))
        r.run[f"admit.{C}"]()


def prefill(r: Rig, slot: int, tokens: list[int], *, sample: bool = True, splits: tuple[int, ...] = ()):
    """Prefill ``tokens`` after whatever the slot already holds, in chunks of at most
    the prefill chunk, also cut at the (relative) positions in ``splits``. Returns
    (hidden rows [L, H], out.logits row of the last token, completion record)."""
    v, C = r.v, r.m.capacities.prefill_chunk
    cuts = sorted({0, len(tokens), *[s for s in splits if 0 < s < len(tokens)]})
    bounds = []
    for a, b in zip(cuts, cuts[1:]):
        bounds += [(s, min(s + C, b)) for s in range(a, b, C)]
    start_len = int(v["state.len"][slot])
    rows = []
    for a, b in bounds:
        n = b - a
        cap = next(c for c in r.m.capacities.prefill_capacities if c >= n)
        v[io.TOKENS][:n] = torch.tensor(tokens[a:b], dtype=torch.int32)
        write_input(r, io.PrefillInput(slot, n, int(sample and b == len(tokens))))
        r.run[f"prefill.{cap}"]()
        rows.append(v["out.prefill_hidden"][:n].clone())
        assert int(v["state.len"][slot]) == start_len + b
    return torch.cat(rows), v["out.logits"][0].clone(), completion(r, io.PREFILL_COMPLETION)[0]


def completion(r: Rig, buffer: str, n: int = 1) -> list[io.Completion]:
    return [io.completion(row) for row in r.v[buffer][:n]]


def decode(r: Rig, slots: list[int], tokens: list[int]) -> tuple[torch.Tensor, list[io.Completion]]:
    """One teacher-forced decode step: each slot consumes the given token."""
    v = r.v
    cap = next(c for c in r.m.capacities.decode_capacities if c >= len(slots))
    batch = torch.zeros(max(r.m.capacities.decode_capacities), dtype=torch.int32)
    batch[: len(slots)] = torch.tensor(slots, dtype=torch.int32)
    for s, t in zip(slots, tokens):
        v["state.pending"][s] = t
        v["state.done"][s] = 0
    v[io.DECODE_SLOTS][:] = batch
    r.run[f"decode.{cap}"]()
    return v["out.logits"][: len(slots)].clone(), completion(r, io.DECODE_COMPLETION, len(slots))


def _state_program(r: Rig, name: str, slot: int, row: int, page: int, count: int) -> io.StateCompletion:
    write_input(r, io.StateInput(slot, row, page, count))
    r.run[name]()
    return io.unpack(io.StateCompletion, r.v[io.STATE_COMPLETION][0])


def snapshot(r: Rig, slot: int, row: int, page: int, count: int) -> io.StateCompletion:
    return _state_program(r, "snapshot.1", slot, row, page, count)


def restore(r: Rig, slot: int, row: int, page: int, count: int) -> io.StateCompletion:
    return _state_program(r, "restore.1", slot, row, page, count)


def resume(r: Rig, slot: int) -> tuple[torch.Tensor, io.Completion]:
    write_input(r, io.PrefillInput(slot, 0, 1))
    r.run["resume.1"]()
    return r.v["out.logits"][0].clone(), completion(r, io.PREFILL_COMPLETION)[0]


def tail_page(r: Rig, pages: list[int], count: int) -> int:
    """The page holding an endpoint's partial tail, or the null page when aligned."""
    ps = r.m.pages.page_size
    return pages[count // ps] if count % ps else r.m.pages.null_page


def transformers_model(core: Path, m: Manifest, dtype: torch.dtype) -> torch.nn.Module:
    """Transformers' model of the core's recipe on the core's weights (its image file), in
    ``dtype``, with eager attention and expert loops as written (grouped_mm has no float64)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from flare.prepare.recipes import by_name

    recipe = by_name(m.reference.recipe)
    config = recipe.config_from_json(m.reference.config)
    for c in (config, config.get_text_config()):
        c._attn_implementation = "eager"
        c._experts_implementation = "eager"
    state = recipe.checkpoint_state(m.reference.config, load_file(str(core / m.arena.image)))
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    tied = getattr(config.get_text_config(), "tie_word_embeddings", False)
    assert not unexpected and all("rotary" in k or ("lm_head" in k and tied) for k in missing), (missing, unexpected)
    model.tie_weights()
    return model.eval()


def greedy_continuation(r: Rig, slots: list[int], steps: int) -> dict[int, list[int]]:
    """Each slot's pending token, then ``steps`` tokens decoded for all the slots together
    (greedy requests: their true continuation, for drafts to be judged against)."""
    out = {s: [int(r.v["state.pending"][s])] for s in slots}
    for _ in range(steps):
        _, recs = decode(r, slots, [out[s][-1] for s in slots])
        for rec in recs:
            out[rec.slot].append(rec.token)
    return out


# Per-slot request state a decode or verify step advances (besides model state): two rigs
# that consumed the same tokens hold these bitwise equal.
STEP_STATE = ("state.len", "state.pending", "state.generated", "state.counter", "state.hist", "state.done")


def decode_alike(a: Rig, b: Rig, slots: list[int], steps: int = 2) -> None:
    """``steps`` greedy decode steps of ``slots`` in both rigs, each slot feeding its own
    pending token: the same tokens, logits within float32 tolerance."""
    for _ in range(steps):
        a_logits, x = decode(a, slots, [int(a.v["state.pending"][s]) for s in slots])
        b_logits, y = decode(b, slots, [int(b.v["state.pending"][s]) for s in slots])
        assert x == y
        torch.testing.assert_close(a_logits, b_logits, atol=1e-4, rtol=1e-4)
