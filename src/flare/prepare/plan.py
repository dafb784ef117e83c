"""The plan of a core: capacities, the arena's buffers, the program table and the
manifest that describes them. Pure functions of the options, the recipe's
geometry and the model source; ``build.prepare`` executes the plan.
"""

from __future__ import annotations

import math
import platform
import sys
from dataclasses import dataclass, field

import torch

from flare.core import interface as io
from flare.core import manifest as mf
from flare.core.manifest import BufferRole, DType, ProgramKind
from flare.core.sampling_params import SAMPLING_PARAMS
from flare.prepare.attention import TICKETS_BUFFER, query_tile_tokens
from flare.prepare.layout import BufferRequest
from flare.prepare.programs import TORCH_DTYPES
from flare.prepare.sources import ModelSource

STOP_IDS_CAPACITY = 16
GiB = 1 << 30


SCORE_CHUNK = 256  # tokens per score program: [SCORE_CHUNK, vocab] float32 logits at once


class PrepareError(ValueError):
    """A requested capacity or feature that this preparation cannot provide."""


@dataclass
class Options:
    device: str = "cpu"
    dtype: str | None = None  # default: float32 on cpu, bfloat16 on cuda
    prefill_chunk_size: int | None = None
    decode_capacities: tuple[int, ...] = (1, 2, 4)
    context_limit: int | None = None
    page_size: int = 16
    kv_pages: int | None = None
    kv_memory_gib: float | None = None
    snapshot_rows: int | None = None  # prefix-cache checkpoint rows (default: 4 per slot)
    min_prefill_capacity: int = 128  # smallest prefill program: 16, 32 or 64 add programs for short prompts
    max_logprobs: int = io.MAX_LOGPROBS  # top log-probabilities per sampled token (0: no log-probabilities)
    pack_capacities: tuple[int, ...] = ()  # rows of each pack program (several slots' chunks at once)
    draft_tokens: int = 0  # drafts per verify program row (speculative decoding); 0: no verify programs
    mtp: bool = False  # keep the checkpoint's MTP head: verify programs end with learned drafts (recipes/mtp.py)
    attention: str | None = None  # reference | triton
    compile: bool = True
    # CUDA: Inductor's combo kernels (independent kernels in one launch, such as the q and k rotary
    # or Qwen3.5's q/k norms; each element computed as before), for everything compiled
    # during the preparation (the setting is Inductor's, process-wide)
    combo_kernels: bool = False
    # CUDA: prompt programs keep cuBLAS's split-K GEMMs (faster short prefills; a prompt prefilled in
    # pieces may then differ from the prompt prefilled whole, cache on against off: kernels/gemm.py)
    split_prompt_gemms: bool = False
    # CUDA: decode and verify steps' linear layers: "cublas", or "measure" (the unsplit Triton
    # GEMM or, without a bias, the few-row GEMV, at the row counts and layers where it times
    # faster than cuBLAS: kernels/gemm.py, kernels/gemv.py)
    step_gemms: str = "cublas"
    # CUDA: where prompt programs take the unsplit Triton GEMM (a layer cuBLAS splits at that row
    # count), its tiling: "default" (kernels/gemm.tiles') or "measure" (the fastest of
    # gemm.PROMPT_TILINGS timed at preparation, at each such row count; the same bits)
    prompt_gemms: str = "default"
    # CUDA: decode and verify steps' RMS norms: "compiled" (Inductor's reduction, its blocks and
    # warps picked per program, by timing above 1,024 values a row) or "invariant" (the mean of
    # squares from kernels/rownorm.py, as prompt programs take it: a row's bits the same in every
    # step; one launch more a norm)
    step_norms: str = "compiled"
    # CUDA: the sampler's filters and draw after the sort and the log-probability block:
    # "kernel" (Triton, kernels/sampler.py) or "ops" (the tensor operations of sampling.py and
    # sampling.logprob_block, some 65 kernels)
    sampler: str = "kernel"
    # CUDA: decode steps' router and expert kernels launched dependent ("on": Hopper's programmatic
    # dependent launch, each waiting in the kernel for the one before: kernels/moe.py) or not ("off")
    dependent_launch: str = "off"
    scratch_memory_gib: float | None = None  # CUDA: arena tail for torch's pool (default: scratch_gib)
    reserve_gib: float = 4.0  # CUDA: device memory left free when sizing KV pages from free memory
    qualify: int = 0  # CUDA: golden replays per program recorded for the runtime to reproduce
    tp_size: int = 1  # tensor-parallel ranks; this process prepares rank tp_rank
    tp_rank: int = 0
    tp_addr: str | None = None  # host:port of rank 0's gloo store (TP > 1)
    served_name: str | None = None
    sampling: dict = field(default_factory=dict)  # flare-prepare --sampling: over the source's defaults
    extra: dict = field(default_factory=dict)

    def resolved_dtype(self) -> str:
        return self.dtype or ("bfloat16" if self.device == "cuda" else "float32")


def scratch_gib(opts: Options, weights_bytes: int) -> float:
    """The arena tail torch's pool may use while programs are warmed up and captured (graph
    intermediates, workspaces; only the used part stays in the core): ``--scratch-memory``, or
    by default 6 GiB or a fifth of the weights, whichever is larger. What the programs use grows
    with the model (on the H200: 3.1 GiB for the Qwen3-30B-A3B shape at 24 layers, 31 GB of
    weights; 4.7 GiB for the Qwen3.5-35B-A3B shape at 20 layers, 36 GB, where 4 GiB ran out;
    4.55 GiB for the Qwen3.5-9B shape, 17.9 GB, since its prompt programs keep the block grid's
    states: 4 GiB ran out there on 2026-12-04)."""
    if opts.scratch_memory_gib is not None:
        return opts.scratch_memory_gib
    return max(6.0, 0.2 * weights_bytes / GiB)


def _dtype_enum(t: torch.dtype) -> DType:
    for k, v in TORCH_DTYPES.items():
        if v == t:
            return DType(k)
    raise PrepareError(f"unsupported dtype {t}")


def plan_capacities(src: ModelSource, recipe, opts: Options, *, specs, free_bytes: int | None) -> tuple[mf.Capacities, int]:
    """Capacities from the options; KV pages from --kv-pages, --kv-memory, or (CUDA)
    the device's free memory minus weights, scratch and the declared reserve."""
    cfg = src.config.get_text_config()
    model_max = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 20)
    context = opts.context_limit or min(model_max, 8192 if opts.device == "cpu" else 32768)
    if context > model_max:
        raise PrepareError(f"--context-limit {context} exceeds the model's max_position_embeddings {model_max}")
    if context < 64:
        raise PrepareError("--context-limit must be at least 64")
    chunk = opts.prefill_chunk_size or min(context, 512 if opts.device == "cpu" else 2048) // 64 * 64
    try:
        prefill_caps = mf.prefill_capacities_for(chunk, context, opts.min_prefill_capacity)
    except ValueError as e:
        raise PrepareError(str(e)) from None
    decode_caps = tuple(sorted(set(opts.decode_capacities)))
    if not decode_caps or decode_caps[0] < 1 or decode_caps[-1] > 256:
        raise PrepareError(f"decode capacities must lie in [1, 256], got {opts.decode_capacities}")
    if opts.page_size < 1 or opts.page_size & (opts.page_size - 1):
        raise PrepareError(f"--page-size must be a power of two, got {opts.page_size}")
    vocab = recipe.vocab_size(src.config)
    snapshot_rows = 4 * decode_caps[-1] if opts.snapshot_rows is None else opts.snapshot_rows
    if snapshot_rows < 0:
        raise PrepareError(f"--snapshot-rows must not be negative, got {snapshot_rows}")
    if not 0 <= opts.max_logprobs <= io.MAX_LOGPROBS:
        raise PrepareError(f"--max-logprobs must lie in [0, {io.MAX_LOGPROBS}], got {opts.max_logprobs}")
    pack_caps = tuple(sorted(set(opts.pack_capacities)))
    if pack_caps:
        error = mf.pack_capacity_error(pack_caps, chunk)
        if error:
            raise PrepareError(f"--pack-capacities: {error}")
        # A packed program runs several slots' chunks as rows of one batch: a recurrence
        # (whose chunk kernels read and write one slot's state) cannot take that.
        if recipe.state_buffers(src.config, DType(opts.resolved_dtype())):
            raise PrepareError(f"--pack-capacities: {recipe.name} keeps recurrent state per slot, "
                               f"which packed prefill cannot carry")
        if opts.attention == "gather":  # it would gather every page of every row's slot
            raise PrepareError("--pack-capacities needs the reference or the triton attention, not gather")
    if not 0 <= opts.draft_tokens <= io.MAX_DRAFT_TOKENS:
        raise PrepareError(f"--draft-tokens must lie in [0, {io.MAX_DRAFT_TOKENS}], got {opts.draft_tokens}")
    mtp = recipe.mtp_layers(src.config) > 0
    if mtp and (not opts.draft_tokens or pack_caps or opts.tp_size > 1):
        raise PrepareError("--mtp needs --draft-tokens (its drafts are verified by the verify programs), and "
                           "supports neither --pack-capacities nor --tp yet")
    caps = mf.Capacities(
        context_limit=context,
        prefill_chunk=chunk,
        prefill_capacities=prefill_caps,
        decode_capacities=decode_caps,
        slots=decode_caps[-1],
        max_pages_per_slot=-(-context // opts.page_size),
        stop_ids=STOP_IDS_CAPACITY,
        vocab_size=vocab,
        sampling_vocab=min(vocab, src.frontend.tokenizer_vocab),
        hidden_size=recipe.hidden_size(src.config),
        snapshot_rows=snapshot_rows,
        max_logprobs=min(opts.max_logprobs, vocab, src.frontend.tokenizer_vocab),  # topk over sampling_vocab
        # Scoring a prompt (echo) keeps every row's logits: a shorter chunk bounds them.
        score_chunk=min(chunk, SCORE_CHUNK) if opts.max_logprobs else 0,
        min_prefill_capacity=opts.min_prefill_capacity,
        pack_capacities=pack_caps,
        pack_align=query_tile_tokens(cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None)
                                     or cfg.num_attention_heads) if pack_caps else 1,
        draft_tokens=opts.draft_tokens,
        mtp_drafts=opts.draft_tokens if mtp else 0,
    )
    geo = recipe.kv_geometry(src.config, opts.tp_size)
    itemsize = TORCH_DTYPES[opts.resolved_dtype()].itemsize
    bytes_per_page = geo.layers * 2 * opts.page_size * geo.kv_heads * geo.head_dim * itemsize
    if opts.kv_pages is not None:
        pages = opts.kv_pages
    elif opts.kv_memory_gib is not None or free_bytes is None:
        budget = (opts.kv_memory_gib if opts.kv_memory_gib is not None else 0.5) * GiB
        pages = int(budget // bytes_per_page)
    else:
        weights = sum(math.prod(s.shape) * s.dtype.itemsize for s in specs)
        # Checkpoint rows: one KV tail page plus one copy of every continuation row each.
        rows = sum(math.prod(shape) * dt.itemsize for _, dt, shape in
                   continuation_rows(recipe, src.config, caps, DType(opts.resolved_dtype()), opts.tp_size))
        snapshots = (caps.snapshot_rows + 1) * (bytes_per_page + rows)
        budget = free_bytes - weights - snapshots - (scratch_gib(opts, weights) + opts.reserve_gib) * GiB
        pages = int(budget // bytes_per_page)
    # One request at full context must fit, plus the null page.
    if pages < caps.max_pages_per_slot + 1:
        raise PrepareError(
            f"{pages} KV pages cannot hold one request at the context limit "
            f"({caps.max_pages_per_slot} pages of {opts.page_size} tokens + the null page); "
            f"raise --kv-pages/--kv-memory or lower --context-limit"
        )
    return caps, pages


KV_TAIL = "snap.kv_tail"


def continuation_rows(recipe, config, caps: mf.Capacities, dtype: DType,
                      tp_size: int = 1) -> list[tuple[str, DType, tuple[int, ...]]]:
    """Continuation state, one row per slot: the saved final hidden vector, then whatever
    the recipe declares (recurrent matrices, convolution histories: one rank's share of
    them). (name, dtype, row shape)."""
    return [("state.hidden", dtype, (caps.hidden_size,)),
            *((b.name, b.dtype, b.row) for b in recipe.state_buffers(config, dtype, tp_size))]


def prefill_only_state(recipe, config, dtype: DType) -> tuple[str, ...]:
    """The recipe's continuation buffers that only prefill programs write (``StateBuffer.prefill_only``)."""
    return tuple(b.name for b in recipe.state_buffers(config, dtype) if b.prefill_only)


def buffer_requests(src, recipe, model, caps: mf.Capacities, pages: int, opts: Options, specs) -> list[BufferRequest]:
    dtype = DType(opts.resolved_dtype())
    reqs = [BufferRequest(s.buffer, BufferRole.weight, _dtype_enum(s.dtype), s.shape) for s in specs]
    geo = recipe.kv_geometry(src.config, opts.tp_size)
    page_shape = (geo.layers, 2, opts.page_size, geo.kv_heads, geo.head_dim)
    reqs.append(BufferRequest("kv", BufferRole.kv, dtype, (geo.layers, 2, pages, opts.page_size, geo.kv_heads, geo.head_dim)))
    for name, (role, dt, shape) in mf.runtime_buffer_shapes(caps).items():
        reqs.append(BufferRequest(name, role, dt, shape))
    prefill_only = prefill_only_state(recipe, src.config, dtype)
    for name, dt, row in continuation_rows(recipe, src.config, caps, dtype, opts.tp_size):
        reqs.append(BufferRequest(name, BufferRole.state, dt, (caps.slots + 1, *row)))
        reqs.append(BufferRequest(mf.snapshot_buffer(name), BufferRole.snapshot, dt, (caps.snapshot_rows + 1, *row)))
        # A recurrent state's rows after each verified position (none for what only prefill writes).
        if caps.draft_tokens and name != "state.hidden" and name not in prefill_only:
            rows = max(mf.verify_capacities(caps.decode_capacities))
            reqs.append(BufferRequest(mf.verify_buffer(name), BufferRole.state, dt,
                                      (rows, caps.draft_tokens + 1, *row)))
    reqs.append(BufferRequest(KV_TAIL, BufferRole.snapshot, dtype, (caps.snapshot_rows + 1, *page_shape)))
    reqs.append(
        BufferRequest("out.prefill_hidden", BufferRole.output, dtype, (max(caps.prefill_capacities), caps.hidden_size))
    )
    if opts.device == "cuda" and opts.tp_size > 1:
        reqs += collective_buffers(caps, opts.tp_size, TORCH_DTYPES[opts.resolved_dtype()].itemsize)
    if opts.device == "cuda":
        # The split GEMVs' ticket counters (kernels/gemv.py), which the routers of decode steps
        # take too (kernels/moe.py's router_gemv): zeroed by the runtime like every state buffer,
        # back at zero after every call.
        from flare.prepare.kernels.gemv import TICKET_COUNTERS

        reqs.append(BufferRequest(GEMV_TICKETS, BufferRole.state, DType.int32, (TICKET_COUNTERS,)))
    return reqs


GEMV_TICKETS = TICKETS_BUFFER


TP_EXCHANGE, TP_FLAGS, TP_PEERS = "tp.exchange", "tp.flags", "tp.peers"


def collective_buffers(caps: mf.Capacities, size: int, itemsize: int) -> list[BufferRequest]:
    """A CUDA TP rank's collective buffers: two exchange slots as large as the largest
    payload (a prefill chunk's hidden rows, a decode batch's logit shard), the flag
    words (zeroed by the runtime like every state buffer), and the peers' arena offsets
    (a weight: written once, stored in the image)."""
    from flare.prepare.kernels.collective import BLOCKS

    rows = max(*caps.prefill_capacities, *caps.decode_capacities)
    slot = max(rows * caps.hidden_size, max(caps.decode_capacities) * caps.vocab_size // size) * itemsize
    slot = max(slot, rows * 8)  # sampled tokens (int64) from rank 0
    slot = -(-slot // 256) * 256
    return [BufferRequest(TP_EXCHANGE, BufferRole.state, DType.uint8, (2 * slot,)),
            BufferRequest(TP_FLAGS, BufferRole.state, DType.int32, (BLOCKS,)),
            BufferRequest(TP_PEERS, BufferRole.weight, DType.int64, (size,))]


def program_table(caps: mf.Capacities, graphs: dict[str, str] | None,
                  continuation: mf.Continuation) -> tuple[mf.Program, ...]:
    state = ("state.len", "state.pending", "state.generated", "state.max_new", "state.done", "state.seed",
             "state.counter", "state.top_k", "state.sampling", "state.stop_ids", "state.page_table",
             "state.hist", *continuation.state)
    # grammar masks and the log-probability flags: read by every sampling program
    mask = ("state.mask_on", "in.token_mask", io.LOGPROBS_ON)
    snaps = (*(mf.snapshot_buffer(n) for n in continuation.state), continuation.tail)
    progs = []

    def add(kind, cap, reads, writes, completion):
        name = f"{kind.value}.{cap}"
        progs.append(mf.Program(name=name, kind=kind, capacity=cap, reads=reads, writes=writes,
                                completion=completion, graph=(graphs or {}).get(name)))

    cmax = max(caps.prefill_capacities)
    add(ProgramKind.admit, cmax, ("in.admit", "in.tokens", "state.hist"), ("state.hist", *continuation.state), None)
    for c in caps.prefill_capacities:
        add(ProgramKind.prefill, c, ("in.prefill", "in.tokens", "kv", *state, *mask),
            ("kv", *state, "out.logits", "out.prefill_hidden", "out.prefill_completion"), "out.prefill_completion")
    for b in caps.decode_capacities:
        add(ProgramKind.decode, b, ("in.decode_slots", "kv", *state, *mask),
            ("kv", *state, "out.logits", "out.decode_completion"), "out.decode_completion")
    if caps.score_chunk:
        add(ProgramKind.score, caps.score_chunk, ("in.prefill", "in.tokens", "kv", *state, *mask),
            ("kv", *state, "out.logits", "out.prefill_hidden", "out.prefill_completion", io.SCORES),
            "out.prefill_completion")
    for c in caps.pack_capacities:
        add(ProgramKind.pack, c, (io.PACK_INPUT, "in.tokens", "kv", *state, *mask),
            ("kv", *state, "out.logits", "out.prefill_hidden", io.PACK_COMPLETION), io.PACK_COMPLETION)
    if caps.draft_tokens:
        for b in mf.verify_capacities(caps.decode_capacities):
            per_position = tuple(mf.verify_buffer(n) for n in mf.stepped_state(continuation))
            add(ProgramKind.verify, b, (io.VERIFY_INPUT, io.DRAFTS, "kv", *state, *mask),
                ("kv", *state, *per_position, "out.logits", io.VERIFY_COMPLETION), io.VERIFY_COMPLETION)
    one = mf.STATE_PROGRAM_CAPACITY
    add(ProgramKind.resume, one, ("in.prefill", *state, *mask), (*state, "out.logits", "out.prefill_completion"),
        "out.prefill_completion")
    add(ProgramKind.snapshot, one, ("in.state", "kv", "state.len", *continuation.state),
        (*snaps, "out.state_completion"), "out.state_completion")
    add(ProgramKind.restore, one, ("in.state", *snaps), ("kv", "state.len", *continuation.state, "out.state_completion"),
        "out.state_completion")
    return tuple(progs)


def _rank_base(base: int, rank: int, r: int) -> int:
    """Rank r's arena address seen from rank ``rank``'s (0 on reference cores)."""
    if not base:
        return 0
    from flare.prepare.cuda.session import rank_base

    return rank_base(rank_base(base, -rank), r)


def sampling_ranges(src, sampling_vocab: int) -> dict[str, tuple[float, float]]:
    """The ranges the manifest carries: the source's, top_k's bounded by the vocabulary
    the sampler draws from."""
    ranges = dict(src.ranges)
    if "top_k" in ranges:
        ranges["top_k"] = (ranges["top_k"][0], min(ranges["top_k"][1], sampling_vocab))
    return ranges


def sampling_defaults(src, opts: Options, sampling_vocab: int) -> tuple[dict, str]:
    """The core's sampling defaults and their source: the model source's (a named config's
    [sampling], a checkpoint's generation_config.json, or neutral), then ``--sampling``
    over them. Every default must lie inside the range the manifest will carry, and the
    temperature be positive: a request could never reproduce a default outside them."""
    s = {**src.sampling, **opts.sampling}
    source = f"--sampling over {src.sampling_source}" if opts.sampling else src.sampling_source
    ranges = sampling_ranges(src, sampling_vocab)
    for k, v in s.items():
        lo, hi = ranges.get(k, (v, v))
        if not lo <= v <= hi or (k == "temperature" and v <= 0):
            origin = "--sampling" if k in opts.sampling else src.sampling_source
            raise PrepareError(f"sampling default {k}={v} (from {origin}) is outside the range [{lo}, {hi}]"
                               + (" or not positive" if k == "temperature" else ""))
    return s, source


def partial_manifest(src, recipe, opts, caps, pages, buffers, nbytes, table, continuation, *, base,
                      device, sampling: tuple[dict, str], kv_window: int | None = None) -> mf.Manifest:
    """``sampling``: ``sampling_defaults``' (defaults, source), checked before the build; ``kv_window``:
    ``recipes.fused.kv_window``'s."""
    import transformers

    from flare import __version__

    s, source = sampling
    ranges = {k: mf.Range(lo=lo, hi=hi) for k, (lo, hi) in sampling_ranges(src, caps.sampling_vocab).items()}
    return mf.Manifest(
        abi=mf.ABI_VERSION,
        identity=mf.Identity(
            abi=mf.ABI_VERSION,
            fingerprint="",
            model_type=src.config.model_type,
            recipe=recipe.name,
            device=opts.device,
            device_name=device.name if device else (platform.processor() or platform.machine()),
            compute_capability=device.compute_capability if device else None,
            versions={
                "flare": __version__,
                "torch": str(torch.__version__),
                "transformers": transformers.__version__,
                "python": sys.version.split()[0],
            },
        ),
        arena=mf.Arena(nbytes=nbytes, alignment=256, base_address=base, image="weights.safetensors"),
        buffers=buffers,
        programs=table,
        completion=mf.CompletionLayout(fields=mf.COMPLETION_FIELDS, status_codes=mf.STATUS_CODES),
        pages=mf.PageGeometry(
            page_size=opts.page_size,
            num_pages=pages,
            null_page=0,
            bytes_per_page=[b for b in buffers if b.role == BufferRole.kv][0].nbytes // pages,
            kv_window=kv_window,
        ),
        capacities=caps,
        frontend=mf.Frontend(
            served_name=opts.served_name or src.name,
            tokenizer="tokenizer.json",
            chat_template="chat_template.jinja" if src.frontend.chat_template is not None else None,
            special_tokens=src.frontend.special_tokens,
            eos_ids=src.frontend.eos_ids,
            tool_parser=mf.ToolParser(src.tool_parser),
            reasoning_parser=mf.ReasoningParser(src.reasoning_parser),
        ),
        sampling=mf.SamplingDefaults(**{p.name: p.type(s[p.name]) for p in SAMPLING_PARAMS}, ranges=ranges,
                                     source=source),
        reference=mf.Reference(recipe=recipe.name, config=recipe.config_json(src.config), dtype=opts.resolved_dtype()),
        continuation=continuation,
        kernels="kernels.json" if device else None,
        parallel=mf.Parallel(tp_size=opts.tp_size, ranks=tuple(
            mf.RankCore(dir=mf.rank_dir(r, opts.tp_size), base_address=_rank_base(base, opts.tp_rank, r))
            for r in range(opts.tp_size))),
    )
