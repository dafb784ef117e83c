"""Preparation: from a resolved model source to an exported runtime core.

Runs inside the preparation subprocess (``flare.prepare.worker``). Steps
(``prepare``): choose the recipe and build its model on the meta device, plan
capacities and the arena (``prepare/plan.py``), allocate the arena on its
target (a host tensor for the CPU reference path, the fixed-address device
arena of a CUDA session), bind the model to arena views and stream the weights
in, build the programs, finish them on the target (CPU: run each once and
record golden replays; CUDA: capture and export every graph), then write the
core directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Callable

import msgspec
import torch

from flare.core import manifest as mf
from flare.core.image import persistent_buffers, write_image
from flare.core.manifest import BufferRole, DType
from flare.core.sampling_params import NEUTRAL
from flare.prepare import recipes
from flare.prepare.recipes import fused
from flare.prepare.layout import align, plan
from flare.prepare.parallel import SINGLE, ShardingError, TensorParallel
from flare.prepare.plan import (GEMV_TICKETS, GiB, KV_TAIL, TP_EXCHANGE, TP_FLAGS, TP_PEERS, Options, PrepareError,
                                buffer_requests, continuation_rows, partial_manifest, plan_capacities,
                                prefill_only_state, program_table, sampling_defaults, scratch_gib)
from flare.prepare.programs import PROMPT_PROGRAMS, TORCH_DTYPES, ProgramSet, arena_views
from flare.prepare.sources import ModelSource

__all__ = ["Options", "PrepareError", "prepare"]


def prepare(src: ModelSource, opts: Options, out: Path, progress: Callable[[str], None], session=None,
            tp: TensorParallel = SINGLE, started: float | None = None) -> mf.Manifest | None:
    """Prepare and export a core. ``session`` is a CudaSession for --device cuda
    (begun before torch initialised CUDA), None for the CPU reference path. With
    tensor parallelism every rank calls this with its group; each writes its rank's
    image, rank 0 the manifest and the shared files (other ranks return None).
    ``started``: when the flare-prepare command started (time.time()), so the times
    reported count its imports, the CUDA session and the model's loading too."""
    t0 = started if started is not None else time.time()
    recipe = _recipe_for(src)
    _check_request(opts, session, tp)
    _mtp_choice(src, recipe, opts)
    target = _CudaArena(session, opts, tp) if opts.device == "cuda" else _CpuArena()
    dtype = DType(opts.resolved_dtype())

    progress(f"building {src.config.model_type} ({recipe.name} recipe) on the meta device"
             + (f", rank {tp.rank} of {tp.size}" if tp.active else ""))
    try:
        model = recipe.build(src.config, TORCH_DTYPES[dtype.value], tp=tp)
    except (ShardingError, recipes.RecipeError) as e:
        raise PrepareError(str(e)) from None
    specs = recipe.weights(model)
    caps, pages = plan_capacities(src, recipe, opts, specs=specs, free_bytes=target.free_bytes())
    # Checked before anything is loaded or captured: the manifest would refuse them at the end.
    sampling = sampling_defaults(src, opts, caps.sampling_vocab)
    shown = {k: v for k, v in sampling[0].items() if k == "temperature" or v != NEUTRAL[k]}
    progress(f"sampling defaults ({sampling[1]}): " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    window = recipe.sliding_window(src.config)
    kv_window = fused.kv_window(model.module) if window is not None else None
    if window is not None:
        progress(f"sliding-window attention: {window} tokens" + (
            f" (pages wholly before every layer's window, {kv_window} tokens, are released)" if kv_window else
            " (a layer reads its whole history: every KV page is kept)"))
    buffers, planned = plan(buffer_requests(src, recipe, model, caps, pages, opts, specs))
    continuation = mf.Continuation(state=tuple(n for n, _, _ in continuation_rows(recipe, src.config, caps, dtype)),
                                   tail=KV_TAIL, prefill_only=prefill_only_state(recipe, src.config, dtype))
    sizes = _plan_sizes(buffers, caps, pages)
    progress(f"plan: weights {sizes['weights_bytes'] / GiB:.2f} GiB, kv {pages} pages x {opts.page_size} tokens "
             f"({sizes['kv_bytes'] / GiB:.2f} GiB), state and io {sizes['state_io_bytes'] / 2**20:.1f} MiB, "
             f"{caps.snapshot_rows} snapshot rows ({sizes['snapshot_bytes'] / 2**20:.1f} MiB)")

    views = target.allocate(buffers, planned)
    with target.pool():
        recipe.bind(model, specs, views)
    with target.load_pool():
        progress("loading weights into the arena")
        _load_weights(src, specs, views)
    target.after_load()
    # Outside the pool: the measurement's random operands would stay in the arena.
    target.row_invariance(recipe, model, caps, opts, continuation, progress)
    with target.pool():
        recipe.compute_constants(model, specs, views)
        progress("building programs")
        programs = target.programs(recipe, model, views, caps, opts, continuation)
        table = program_table(caps, target.graph_files(caps, continuation), continuation)
        partial = partial_manifest(src, recipe, opts, caps, pages, buffers, planned, table, continuation,
                                   base=target.base, device=target.device, sampling=sampling, kv_window=kv_window)
        out.mkdir(parents=True, exist_ok=True)
    partial, report = target.finish(programs, partial, views, out / mf.rank_dir(tp.rank, tp.size), opts, progress)
    return _write_core(src, recipe, partial, target, out, tp, progress, t0, {**sizes, **report})


def _recipe_for(src: ModelSource) -> recipes.Recipe:
    try:
        return recipes.for_model_type(src.config.model_type)
    except recipes.UnsupportedArchitecture as e:
        raise PrepareError(str(e)) from None


def _mtp_choice(src: ModelSource, recipe: recipes.Recipe, opts: Options) -> None:
    """Keep the config's MTP declaration with --mtp (the recipe then builds the head), drop it
    otherwise (in place: the manifest's config says what the core holds)."""
    from flare.prepare.recipes import mtp

    if not opts.mtp:
        mtp.without_mtp(src.config)
    elif not recipe.mtp_layers(src.config):
        raise PrepareError(f"--mtp: {src.name} declares no MTP head the {recipe.name} recipe can build "
                           f"(config keys {', '.join(mtp.MTP_KEYS)})")


def _check_request(opts: Options, session, tp: TensorParallel) -> None:
    if opts.device == "cuda" and session is None:
        raise PrepareError("--device cuda requested but no CUDA session is available")
    if tp.size != opts.tp_size or tp.rank != opts.tp_rank:
        raise PrepareError(f"rank {tp.rank} of {tp.size} was asked to prepare rank {opts.tp_rank} of {opts.tp_size}")
    if tp.active and opts.qualify:
        raise PrepareError("--qualify records golden replays of one rank; it is not supported with --tp > 1")
    if opts.step_norms == "invariant" and opts.split_prompt_gemms:
        raise PrepareError("--step-norms invariant takes the prompt programs' row-invariant norms, which "
                           "--split-prompt-gemms leaves to the compiler")
    if opts.prompt_gemms == "measure" and opts.split_prompt_gemms:
        raise PrepareError("--prompt-gemms measure times the unsplit GEMM of prompt programs, which "
                           "--split-prompt-gemms leaves to cuBLAS")
    if opts.dependent_launch not in ("off", "on"):
        raise PrepareError(f"--dependent-launch {opts.dependent_launch!r}: expected off or on")
    if opts.dependent_launch == "on" and opts.device != "cuda":
        raise PrepareError("--dependent-launch on is a CUDA option (Hopper's programmatic dependent launch)")


def _plan_sizes(buffers, caps: mf.Capacities, pages: int) -> dict[str, int]:
    def total(*roles):
        return sum(b.nbytes for b in buffers if b.role in roles)

    return {"weights_bytes": total(BufferRole.weight), "kv_bytes": total(BufferRole.kv), "kv_pages": pages,
            "state_io_bytes": total(BufferRole.state, BufferRole.input, BufferRole.output),
            "snapshot_rows": caps.snapshot_rows, "snapshot_bytes": total(BufferRole.snapshot)}


class _CpuArena:
    """The reference path: the arena is a host tensor; programs run eagerly."""

    base = 0
    device = None

    def free_bytes(self) -> int | None:
        return None

    def allocate(self, buffers, planned: int) -> dict[str, torch.Tensor]:
        self.arena = torch.zeros(planned, dtype=torch.uint8)
        self.numpy = self.arena.numpy()
        return arena_views(self.arena, buffers)

    def pool(self):
        return contextlib.nullcontext()

    load_pool = pool

    def after_load(self) -> None:
        pass

    def row_invariance(self, recipe, model, caps, opts: Options, continuation, progress) -> None:
        pass  # the CPU reference path's GEMMs are not captured programs

    def programs(self, recipe, model, views, caps, opts: Options, continuation) -> ProgramSet:
        return ProgramSet(recipe, model, views, caps, opts.page_size, opts.attention or "reference", continuation)

    def graph_files(self, caps, continuation) -> None:
        return None

    def finish(self, programs: ProgramSet, partial: mf.Manifest, views, rank_out: Path, opts: Options,
               progress) -> tuple[mf.Manifest, dict]:
        """Every program executes once (on the null slot); ``--qualify`` records golden replays."""
        calls = {p.name: programs.callable(p.kind, p.capacity) for p in partial.programs}
        for call in calls.values():
            call()
        if opts.qualify:
            from flare.prepare.golden import record

            golden = record(partial, views, lambda name: calls[name](), opts.qualify)
            rank_out.mkdir(parents=True, exist_ok=True)
            (rank_out / "qualification.json").write_bytes(msgspec.json.encode(golden))
        return partial, {}

    def read(self, b: mf.Buffer):
        return memoryview(self.numpy[b.offset : b.offset + b.nbytes])


class _CudaArena:
    """A CUDA session: the arena is mapped at its fixed address and torch allocates from
    a pool at its tail; programs are compiled, captured and exported as graphs."""

    def __init__(self, session, opts: Options, tp: TensorParallel):
        self.session, self.opts, self.tp = session, opts, tp
        self.base = session.base
        self.device = session.device

    def free_bytes(self) -> int:
        return _free_per_rank(self.session, self.tp) if self.tp.active else self.session.free_at_start

    def allocate(self, buffers, planned: int) -> dict[str, torch.Tensor]:
        self.pool_offset = align(planned, 2 << 20)
        weights = sum(b.nbytes for b in buffers if b.role == BufferRole.weight)
        self.session.map(self.pool_offset + int(scratch_gib(self.opts, weights) * GiB))
        with torch.cuda.device(0):
            self.arena = self.session.start_torch(self.pool_offset)
        views = self.session.buffer_tensors(buffers)
        if self.tp.active:
            from flare.prepare.parallel import CudaTransport

            self.tp.attach_cuda(CudaTransport(views[TP_EXCHANGE], views[TP_FLAGS], views[TP_PEERS]))
        self.tickets = views.get(GEMV_TICKETS)
        return views

    def pool(self):
        return torch.cuda.use_mem_pool(self.session.pool)

    def load_pool(self):
        # A TP rank loads outside the arena's pool: it reads its sharded tensors whole, and
        # the pool never gives memory back, so inside it they would stay in every rank's arena.
        return contextlib.nullcontext() if self.tp.active else self.pool()

    def after_load(self) -> None:
        if self.tp.active:
            torch.cuda.empty_cache()

    def row_invariance(self, recipe, model, caps, opts: Options, continuation, progress) -> None:
        """Linear layers that cuBLAS would split at a prompt program's row count compute
        those programs with the unsplit Triton GEMM (kernels/gemm.py), and the RMS norms take
        their mean of squares from a row-invariant kernel there (kernels/rownorm.py)."""
        if opts.step_gemms not in ("cublas", "measure", "gemv"):
            raise ValueError(f"step_gemms {opts.step_gemms!r}: expected cublas, measure or gemv")
        if opts.prompt_gemms not in ("default", "measure"):
            raise ValueError(f"prompt_gemms {opts.prompt_gemms!r}: expected default or measure")
        # A mixture-of-experts block's decode steps route in the router's launch (its last
        # program for each token, by the core's ticket counters; recipes/moe.py).
        routers = [m for m in model.module.modules() if hasattr(type(m), "flare_route_tickets")]
        for block in routers:
            block.flare_route_tickets = self.tickets
        if routers and self.tickets is not None:
            progress(f"decode steps route in the router's launch ({len(routers)} layers)")
        if opts.dependent_launch == "on":
            from flare.prepare.kernels.moe import dependent_launch

            device = torch.device("cuda", torch.cuda.current_device())
            if not dependent_launch(device):
                raise PrepareError(f"--dependent-launch on needs compiled Triton on a GPU of compute capability 9.0 "
                                   f"or later (this one: {torch.cuda.get_device_capability(device)})")
            for block in routers:
                block.flare_dependent_launch = True
            progress(f"decode steps launch the router and the experts dependent ({len(routers)} layers)"
                     if routers else "--dependent-launch on: no mixture-of-experts block, nothing launched dependent")
        if opts.step_norms not in ("compiled", "invariant"):
            raise ValueError(f"step_norms {opts.step_norms!r}: expected compiled or invariant")
        if not opts.split_prompt_gemms:
            # (before the step GEMMs: a step's row-invariant norm may go into the next GEMV's loads)
            from flare.prepare.kernels.rownorm import make_norms_row_invariant

            switched, left = make_norms_row_invariant(model.module, steps=opts.step_norms == "invariant")
            if switched:
                progress(f"row-invariant mean of squares in prompt programs"
                         f"{' and decode/verify steps' if opts.step_norms == 'invariant' else ''} for " +
                         ", ".join(f"{n} ({k})" for n, k in sorted(switched.items())))
            if left:
                progress(f"norms left to the compiler (their code is not one rownorm knows): {', '.join(left)}")
        if opts.step_gemms != "cublas":
            self._step_gemms(recipe, model, caps, continuation, progress, forced=opts.step_gemms == "gemv",
                             fold_convs=(opts.attention or "triton") == "triton")
        if opts.split_prompt_gemms:
            return
        from flare.prepare.kernels.gemm import make_row_invariant

        rows = {p.capacity for p in program_table(caps, None, continuation) if p.kind in PROMPT_PROGRAMS}
        by_name: dict[str, set[int]] = {}
        for name, counts in make_row_invariant(recipe.decoder_layers(model.module), rows,
                                               measure=opts.prompt_gemms == "measure").items():
            by_name.setdefault(name.split(".", 1)[1], set()).update(counts)  # over the layers
        for name, counts in sorted(by_name.items()):
            progress(f"unsplit GEMM for {name} at {', '.join(map(str, sorted(counts)))} rows of prompt programs")
        timed: dict[str, dict[int, tuple]] = {}
        for layer in recipe.decoder_layers(model.module):
            for name, module in layer.named_modules():
                timed.setdefault(name, {}).update(getattr(module, "flare_split_tiling", {}))
        for name, tilings in sorted((n, t) for n, t in timed.items() if t):
            progress(f"unsplit GEMM tilings timed for {name}: "
                     + ", ".join(f"{c} rows {t}" for c, t in sorted(tilings.items())))

    def _step_gemms(self, recipe, model, caps, continuation, progress, forced: bool = False,
                    fold_convs: bool = True) -> None:
        """Decode and verify steps: each linear layer takes one product at all their row counts,
        the unsplit Triton GEMM or a GEMV where it measured faster than cuBLAS
        (kernels/gemm.choose_step_gemms), or (``forced``) the GEMV (kernels/gemm.force_step_gemv).
        ``fold_convs`` (the CUDA path): a Gated DeltaNet's input projection on a GEMV without a split
        takes the decode steps' convolution in it, where that gives the kernel's bits on this device
        (kernels/gemm.check_conv_folds)."""
        from flare.prepare.kernels.gemm import check_conv_folds, choose_step_gemms, force_step_gemv

        steps = [p for p in program_table(caps, None, continuation)
                 if p.kind in (mf.ProgramKind.decode, mf.ProgramKind.verify)]
        rows = {p.capacity * (caps.draft_tokens + 1 if p.kind == mf.ProgramKind.verify else 1) for p in steps}
        decode_rows = {p.capacity for p in steps if p.kind == mf.ProgramKind.decode} if fold_convs else set()
        layers = recipe.decoder_layers(model.module)
        by_name: dict[str, set] = {}
        chosen_gemms = (force_step_gemv(layers, rows) if forced
                        else choose_step_gemms(layers, rows, log=progress, tickets=self.tickets,
                                               conv_counts=decode_rows))
        for name, chosen in chosen_gemms.items():
            by_name.setdefault(name.split(".", 1)[1], set()).update(chosen.items())
        for name, chosen in sorted(by_name.items()):
            progress(f"step GEMM for {name}: " + ", ".join(f"{r} rows {t}" for r, t in sorted(chosen)))
        folds = check_conv_folds(layers, decode_rows, log=progress)
        for name in sorted({n.split(".", 1)[1] for n in folds}):
            progress(f"the decode steps' convolution in the GEMV of {name} at "
                     f"{', '.join(map(str, sorted(decode_rows)))} rows ({len(folds)} layers)")

    def programs(self, recipe, model, views, caps, opts: Options, continuation) -> ProgramSet:
        if opts.compile:
            _compile_layers(recipe, model.module, combo=opts.combo_kernels)
        programs = ProgramSet(recipe, model, views, caps, opts.page_size, opts.attention or "triton", continuation,
                              sampler_kernel=opts.sampler == "kernel")
        if opts.compile:
            programs.compile_glue()
        return programs

    def graph_files(self, caps, continuation) -> dict[str, str]:
        return {p.name: f"graphs/{p.name}.json" for p in program_table(caps, None, continuation)}

    def finish(self, programs: ProgramSet, partial: mf.Manifest, views, rank_out: Path, opts: Options,
               progress) -> tuple[mf.Manifest, dict]:
        # Outside use_mem_pool: graph capture routes its allocations to the same pool itself.
        from flare.prepare.cuda.finish import capture_and_export

        extra = capture_and_export(self.session, programs, partial, views, self.pool_offset, rank_out, opts,
                                   progress, self.tp)
        partial = msgspec.structs.replace(
            partial, buffers=partial.buffers + tuple(extra["buffers"]),
            arena=msgspec.structs.replace(partial.arena, nbytes=extra["arena_nbytes"]))
        if self.tp.active:
            # The graphs are captured: the peers' offsets replace the loopback zeros.
            bases = [r.base_address for r in partial.parallel.ranks]
            views[TP_PEERS].copy_(torch.tensor([b - bases[self.tp.rank] for b in bases], dtype=torch.int64))
            torch.cuda.synchronize()
        return partial, extra.get("report", {})

    def read(self, b: mf.Buffer) -> bytes:
        return self.arena[b.offset : b.offset + b.nbytes].cpu().numpy().tobytes()


def _write_core(src: ModelSource, recipe, partial: mf.Manifest, target, out: Path, tp: TensorParallel, progress,
                t0: float, report: dict) -> mf.Manifest | None:
    """Every rank writes its arena image; rank 0 also the frontend files, the manifest
    (fingerprinted over the config, every rank's image and the frontend) and the report."""
    progress(f"writing runtime core to {out}")
    rank_out = out / mf.rank_dir(tp.rank, tp.size)
    rank_out.mkdir(parents=True, exist_ok=True)
    digest = write_image(rank_out / partial.arena.image, persistent_buffers(partial), target.read)
    # Every rank must have planned the same layout (one buffer list describes all ranks).
    layout = hashlib.sha256(msgspec.json.encode(partial.buffers)).hexdigest()
    digests = tp.gather_strings(f"{layout} {digest}")
    if len({d.split()[0] for d in digests}) != 1:
        raise PrepareError("tensor-parallel ranks planned different arena layouts")
    if tp.rank != 0:
        progress(f"rank {tp.rank}: image written in {time.time() - t0:.1f} s")
        return None
    (out / "tokenizer.json").write_text(src.frontend.tokenizer_json)
    if src.frontend.chat_template is not None:
        (out / "chat_template.jinja").write_text(src.frontend.chat_template)
    fp = hashlib.sha256()
    for part in (recipe.config_json(src.config), *(d.split()[1] for d in digests), src.frontend.tokenizer_json,
                 src.frontend.chat_template or ""):
        fp.update(part.encode())
    final = msgspec.structs.replace(partial, identity=msgspec.structs.replace(partial.identity,
                                                                              fingerprint=fp.hexdigest()))
    (out / mf.MANIFEST_FILE).write_bytes(mf.encode_manifest(final))
    report = {**report, "arena_bytes": final.arena.nbytes, "seconds": round(time.time() - t0, 2)}
    (out / "prepare_report.json").write_text(json.dumps(report, indent=1))
    progress(f"done in {time.time() - t0:.1f} s")
    return final


def _free_per_rank(session, tp: TensorParallel) -> int:
    """Device memory one rank may plan with: ranks that share a GPU (more ranks than
    GPUs) split its free memory, and every rank plans with the smallest share so all
    ranks plan the same pages. Also checks that every rank got its own arena address."""
    from flare.prepare.cuda.session import device_uuid, rank_base

    entries = [e.split() for e in tp.gather_strings(f"{device_uuid(session.device)} {session.free_at_start} "
                                                    f"{session.base}")]
    if len({rank_base(int(base), -r) for r, (_, _, base) in enumerate(entries)}) != 1:
        raise PrepareError("tensor-parallel ranks could not reserve their arenas at matching fixed addresses")
    uuids = [u for u, _, _ in entries]
    return min(int(free) // uuids.count(u) for u, free, _ in entries)


SHARD_BATCH_BYTES = 1 << 30  # whole tensors of sharded weights read per loader call


def _load_weights(src: ModelSource, specs, views: dict[str, torch.Tensor]) -> None:
    """Checkpoint tensors into their arena views (a fused buffer's parts into its rows).
    A sharded tensor is read whole into a tensor on the arena's device and this rank's
    slice copied in (the random source then gives every rank exactly its slice of the
    TP=1 weights), a batch of at most SHARD_BATCH_BYTES of whole tensors at a time."""
    direct, sharded = {}, []
    for s in specs:
        if not s.from_checkpoint:
            continue
        for name, view, shard in s.destinations(views[s.buffer]):
            if shard is None:
                direct[name] = view
            else:
                sharded.append((name, view, shard, s.dtype))
    if direct or not sharded:
        src.load_weights(direct)
    batch: dict[str, tuple] = {}
    held = 0

    def flush() -> None:
        nonlocal held
        if batch:
            src.load_weights({name: whole for name, (whole, _, _) in batch.items()})
            for whole, view, shard in batch.values():
                view.copy_(shard.of(whole))
        batch.clear()
        held = 0

    for name, view, shard, dtype in sharded:
        shape = shard.full(tuple(view.shape))
        nbytes = math.prod(shape) * dtype.itemsize
        if batch and held + nbytes > SHARD_BATCH_BYTES:
            flush()
        # On the view's device: the random source draws on the destination's device,
        # so a rank's slice is exactly the TP=1 weights of that device.
        batch[name] = (torch.empty(shape, dtype=dtype, device=view.device), view, shard)
        held += nbytes
    flush()


def _compile_layers(recipe, model, combo: bool = False) -> None:
    """torch.compile (Inductor) on every decoder layer. Layers share their code, and
    nn-module inlining makes their weights graph inputs, so each program capacity
    compiles once for all layers; attention itself stays outside (see attention.py).
    ``combo``: Inductor's combo kernels (``flare-prepare --combo-kernels``): a process-wide
    setting, read when each compiled piece first runs (at capture), so it covers the sampling
    glue compiled after the layers too."""
    import torch._dynamo
    import torch._inductor.config as ic

    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    # Kernels must load through Triton's launcher, whose loads are recorded exactly
    # (the static launcher loads cubins itself).
    ic.use_static_cuda_launcher = False
    ic.combo_kernels = combo
    for layer in recipe.decoder_layers(model):
        layer.compile(dynamic=False)
    # The rotary table lookup runs once per step before the layers (eager: a float32
    # GEMM, cos, sin, cat and casts, ~10 kernels).
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if isinstance(rotary, torch.nn.Module):
        rotary.compile(dynamic=False)
    # The final norm runs once per step after the layers (eager: a cast, pow, mean, add, rsqrt
    # and three more elementwise kernels, nine launches in the H200 timelines' tails).
    norm = getattr(getattr(model, "model", None), "norm", None)
    if isinstance(norm, torch.nn.Module):
        norm.compile(dynamic=False)


