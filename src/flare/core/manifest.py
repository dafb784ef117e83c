"""The runtime-core contract: the manifest shared by preparation and runtime.

Torch-free and behaviour-free. Preparation writes a ``Manifest``; the runtime
loads it with :func:`load_manifest`, which rejects missing or unknown fields,
a different ABI, and any layout that does not hold together. Everything the
runtime does is derived from these numbers, never from the model's identity.

Arena map (offsets grow downward, every buffer aligned to ``arena.alignment``)::

    +--------------------------+ 0
    | weights (role=weight)    |  persistent: stored in the arena image
    +--------------------------+
    | kv pages (role=kv)       |  runtime-owned, zero-filled at load
    | request state (state)    |  row 0 of every state buffer is the null slot
    | snapshots (snapshot)     |  checkpoint rows; row 0 is the null row
    | inputs  (role=input)     |  written by the runtime before a launch
    | outputs (role=output)    |  completion records, logits, hidden rows
    | scratch (role=scratch)   |  torch's pool on CUDA cores: graph intermediates,
    |                          |  compiled constants, library workspaces (in the image)
    +--------------------------+ arena.nbytes
"""

from __future__ import annotations

import enum
import math
from pathlib import Path
from typing import Mapping

import msgspec

from flare.core import interface as io
from flare.core.errors import CoreCompatibilityError, ManifestError
from flare.core.sampling_params import INTEGER_STATE, SAMPLING_COLUMNS, SAMPLING_NAMES, SAMPLING_PARAMS

ABI_VERSION = 6
MANIFEST_FILE = "manifest.json"


class _Frozen(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class DType(str, enum.Enum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"
    int32 = "int32"
    int64 = "int64"
    uint8 = "uint8"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]


_ITEMSIZE = {
    DType.float32: 4,
    DType.float16: 2,
    DType.bfloat16: 2,
    DType.int32: 4,
    DType.int64: 8,
    DType.uint8: 1,
}


class BufferRole(str, enum.Enum):
    weight = "weight"  # persistent bytes from the arena image
    kv = "kv"  # paged attention history
    state = "state"  # per-slot request / continuation state
    snapshot = "snapshot"  # immutable checkpoint rows
    input = "input"  # host-written before a launch
    output = "output"  # device-written, read back by the host
    scratch = "scratch"  # graph pool and operator workspaces (persistent: stored in the image)


class Buffer(_Frozen):
    name: str
    role: BufferRole
    dtype: DType
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ProgramKind(str, enum.Enum):
    admit = "admit"  # initialise a slot's penalty histogram from prompt tokens
    prefill = "prefill"  # one request's chunk of up to C tokens
    decode = "decode"  # B running requests, one token each
    resume = "resume"  # sample from a saved final hidden vector (full-prompt cache hit)
    snapshot = "snapshot"  # live continuation row (+ KV tail page) -> immutable snapshot row
    restore = "restore"  # snapshot row -> live continuation row (+ private KV tail page)
    score = "score"  # a prefill chunk that also scores each of its tokens (prompt log-probabilities)
    pack = "pack"  # prefill chunks of several slots in one program (short prompts arriving together)
    verify = "verify"  # B running requests, each its pending token and up to draft_tokens drafts (speculation)


class Program(_Frozen):
    name: str  # e.g. "decode.4"
    kind: ProgramKind
    capacity: int
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    completion: str | None  # output buffer holding this program's completion records
    graph: str | None  # exported graph file (GPU cores); None on reference cores


class CompletionLayout(_Frozen):
    """Completion records are int32 rows; ``fields`` names the columns in order."""

    fields: tuple[str, ...]
    status_codes: Mapping[str, int]


class PageGeometry(_Frozen):
    page_size: int  # tokens per physical page
    num_pages: int  # including the null page
    null_page: int  # never allocated; unused page-table entries point here
    bytes_per_page: int  # over every layer, for memory reporting
    # Sliding windows: no attention layer reads a key more than kv_window - 1 positions before its
    # query (the largest of the layers' windows), so the scheduler releases a request's pages that lie
    # wholly before that for its next position; None: some layer reads its whole history, none is released.
    kv_window: int | None = None


class Capacities(_Frozen):
    context_limit: int
    prefill_chunk: int
    prefill_capacities: tuple[int, ...]
    decode_capacities: tuple[int, ...]
    slots: int  # live request slots; state buffers have slots + 1 rows (row 0 = null)
    max_pages_per_slot: int
    stop_ids: int  # per-slot stop-token capacity
    vocab_size: int  # logits width
    sampling_vocab: int  # ids >= this are never sampled (padded vocabularies)
    hidden_size: int
    snapshot_rows: int  # checkpoint rows; snapshot buffers have snapshot_rows + 1 rows (row 0 = null)
    max_logprobs: int = 0  # top log-probabilities each sampling record carries (0: none, not even the sampled one's)
    score_chunk: int = 0  # tokens per score program (prompt log-probabilities); 0: no score programs
    min_prefill_capacity: int = 128  # the smallest prefill program (prefill_capacities_for)
    # Rows of each pack program (prefill chunks of up to max(decode_capacities) slots at
    # once, and decode steps that carry a prefill chunk), ascending; none by default.
    pack_capacities: tuple[int, ...] = ()
    # Query rows per attention tile of a pack: a segment continuing a history starts and ends
    # on a multiple of it, so that no tile mixes its rows with another slot's.
    pack_align: int = 1
    # Drafts a verify program checks per request (speculative decoding); 0: no verify programs.
    draft_tokens: int = 0
    # Learned drafts: a core prepared with the model's multi-token-prediction (MTP) head
    # (flare-prepare --mtp) ends each verify program with a chain of this many greedy drafts
    # for each row's next step, appended to its record; 0: none (drafts come from the host).
    mtp_drafts: int = 0


class Continuation(_Frozen):
    """What a resumable endpoint holds besides its complete KV pages.

    ``state`` names the per-slot state buffers whose rows are continuation state
    (the saved final hidden vector, and for recurrent models every recurrent and
    convolution history). Each has a snapshot twin named ``snapshot_buffer(name)``
    with the same dtype and row shape and ``snapshot_rows + 1`` rows. ``tail``
    names the snapshot buffer holding one whole KV page per row: the partial tail
    page of an endpoint that is not page-aligned. The ``snapshot`` and ``restore``
    programs copy exactly these rows, so the runtime needs no model knowledge.
    ``prefill_only`` names those of ``state`` that decode and verify steps never advance
    (prefill chunks do; admit resets and restore copies them like the rest): verify
    programs keep no per-position rows of them."""

    state: tuple[str, ...]
    tail: str
    prefill_only: tuple[str, ...] = ()


def stepped_state(cont: Continuation) -> tuple[str, ...]:
    """The recurrent state a decode or verify step advances: continuation state besides the
    hidden vector and the prefill-only buffers (each has a per-position verify twin)."""
    return tuple(n for n in cont.state if n != "state.hidden" and n not in cont.prefill_only)


class ToolParser(str, enum.Enum):
    none = "none"
    hermes = "hermes"  # <tool_call>{json}</tool_call>
    json_array = "json_array"  # [{"name": ..., "arguments": ...}]


class ReasoningParser(str, enum.Enum):
    none = "none"
    think = "think"  # <think>...</think>


class Frontend(_Frozen):
    served_name: str
    tokenizer: str  # file name inside the core
    chat_template: str | None  # file name inside the core
    special_tokens: Mapping[str, str]  # bos_token, eos_token, ...: passed to the template
    eos_ids: tuple[int, ...]
    tool_parser: ToolParser
    reasoning_parser: ReasoningParser


class Range(_Frozen):
    lo: float
    hi: float


# Complete defaults, one field per sampling parameter (``flare.core.sampling_params``),
# ``ranges`` bounding request values (out-of-range values clamp; a parameter without a
# range is fixed at its default), and where the defaults came from (``source``: a named
# config's [sampling], a checkpoint's generation_config.json, flare-prepare --sampling
# over either, or neutral; 'unknown' in cores made before it was recorded). Informational:
# the runtime uses the values, not the source.
SamplingDefaults = msgspec.defstruct(
    "SamplingDefaults",
    [*((p.name, p.type) for p in SAMPLING_PARAMS), ("ranges", Mapping[str, Range]), ("source", str, "unknown")],
    bases=(_Frozen,),
    module=__name__,
)


class Identity(_Frozen):
    abi: int
    fingerprint: str  # sha256 over config, weights and tokenizer
    model_type: str  # informational only: runtime policy never reads it
    recipe: str
    device: str  # "cpu" or "cuda"
    device_name: str
    compute_capability: str | None  # "9.0"
    versions: Mapping[str, str]


class Arena(_Frozen):
    nbytes: int
    alignment: int
    base_address: int  # fixed virtual address on CUDA cores; 0 on reference cores
    image: str  # safetensors file: one tensor per weight buffer, raw bytes


class Reference(_Frozen):
    """What the eager reference executor needs to rebuild the programs in torch.
    Opaque to the runtime: it is handed to the reference worker as is."""

    recipe: str
    config: str  # the model's Hugging Face config, JSON
    dtype: str


class RankCore(_Frozen):
    """Where one tensor-parallel rank's files live and where its arena sits."""

    dir: str  # relative to the core; "." for TP=1, "rank<r>" otherwise
    base_address: int  # this rank's arena address (CUDA); 0 on reference cores


class Parallel(_Frozen):
    """Tensor parallelism over the GPUs of one host (ABI 4). Every rank's arena has
    the manifest's buffer layout; per-rank files (``arena.image``, program graphs, the
    kernel table) are named relative to ``ranks[r].dir``. See docs/tensor-parallel.md."""

    tp_size: int
    ranks: tuple[RankCore, ...]


def rank_dir(rank: int, tp_size: int) -> str:
    """The contract's naming rule for a rank's directory inside the core."""
    return "." if tp_size == 1 else f"rank{rank}"


class Manifest(_Frozen):
    abi: int
    identity: Identity
    arena: Arena
    buffers: tuple[Buffer, ...]
    programs: tuple[Program, ...]
    completion: CompletionLayout
    pages: PageGeometry
    capacities: Capacities
    frontend: Frontend
    sampling: SamplingDefaults
    reference: Reference
    continuation: Continuation
    kernels: str | None  # kernel table file (CUDA cores); None on reference cores
    parallel: Parallel

    def buffer(self, name: str) -> Buffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise ManifestError(f"core has no buffer {name!r}", param=name)

    def program(self, name: str) -> Program:
        for p in self.programs:
            if p.name == name:
                return p
        raise ManifestError(f"core has no program {name!r}", param=name)

    def programs_of(self, kind: ProgramKind) -> tuple[Program, ...]:
        return tuple(sorted((p for p in self.programs if p.kind == kind), key=lambda p: p.capacity))


# ---------------------------------------------------------------------------
# The runtime-facing buffers every core provides. Shapes are functions of the
# capacities so that loading can check them; model-specific buffers (weights,
# kv layout, recurrent state) are opaque to the runtime apart from their role.

# Row layouts of program inputs and records: owned by flare.core.interface.
COMPLETION_FIELDS = io.Completion._fields
STATUS_CODES = {s.name: int(s) for s in io.Status}
SNAPSHOT_PREFIX = "snap."
# Capacity of the maintenance programs (one slot per launch).
STATE_PROGRAM_CAPACITY = 1
# Prompt tokens set this bit in the penalty histogram; output tokens count in the low bits.
HIST_PROMPT_BIT = 1 << 24
# Grammar masks: ``state.mask_on[slot]`` (written at admission) says whether the slot's
# sampling row is constrained; ``in.token_mask[slot]`` holds that row's allowed-token
# bitmask, written by the host before every program that samples for the slot.


def runtime_buffer_shapes(c: Capacities) -> dict[str, tuple[BufferRole, DType, tuple[int, ...]]]:
    rows = c.slots + 1
    cmax = max(c.prefill_capacities)
    bmax = max(c.decode_capacities)
    ncomp = len(COMPLETION_FIELDS) + io.logprob_columns(c.max_logprobs)
    return {
        "state.len": (BufferRole.state, DType.int32, (rows,)),
        "state.pending": (BufferRole.state, DType.int32, (rows,)),
        "state.generated": (BufferRole.state, DType.int32, (rows,)),
        "state.max_new": (BufferRole.state, DType.int32, (rows,)),
        "state.done": (BufferRole.state, DType.int32, (rows,)),
        "state.seed": (BufferRole.state, DType.int64, (rows,)),
        "state.counter": (BufferRole.state, DType.int64, (rows,)),
        **{buf: (BufferRole.state, DType.int32, (rows,)) for buf in INTEGER_STATE.values()},
        "state.sampling": (BufferRole.state, DType.float32, (rows, len(SAMPLING_COLUMNS))),
        "state.stop_ids": (BufferRole.state, DType.int32, (rows, c.stop_ids)),
        "state.page_table": (BufferRole.state, DType.int32, (rows, c.max_pages_per_slot)),
        "state.hist": (BufferRole.state, DType.int32, (rows, c.vocab_size)),
        "state.mask_on": (BufferRole.state, DType.int32, (rows,)),
        io.LOGPROBS_ON: (BufferRole.state, DType.int32, (rows,)),
        io.TOKENS: (BufferRole.input, DType.int32, (cmax,)),
        io.PrefillInput.buffer: (BufferRole.input, DType.int32, (len(io.PrefillInput._fields),)),
        io.AdmitInput.buffer: (BufferRole.input, DType.int32, (len(io.AdmitInput._fields),)),
        io.DECODE_SLOTS: (BufferRole.input, DType.int32, (bmax,)),
        "in.token_mask": (BufferRole.input, DType.int32, (rows, mask_words(c.vocab_size))),
        io.StateInput.buffer: (BufferRole.input, DType.int32, (len(io.StateInput._fields),)),
        io.PREFILL_COMPLETION: (BufferRole.output, DType.int32, (1, ncomp)),
        io.STATE_COMPLETION: (BufferRole.output, DType.int32, (1, len(io.StateCompletion._fields))),
        io.DECODE_COMPLETION: (BufferRole.output, DType.int32, (bmax, ncomp)),
        "out.logits": (BufferRole.output, DType.float32, (bmax, c.vocab_size)),
        **({io.SCORES: (BufferRole.output, DType.int32, (c.score_chunk, io.logprob_columns(c.max_logprobs)))}
           if c.score_chunk else {}),
        **({io.PACK_INPUT: (BufferRole.input, DType.int32, (bmax, len(io.PackSegment._fields))),
            io.PACK_COMPLETION: (BufferRole.output, DType.int32, (bmax, ncomp))} if c.pack_capacities else {}),
        **({io.VERIFY_INPUT: (BufferRole.input, DType.int32, (bmax, len(io.VerifyInput._fields))),
            io.DRAFTS: (BufferRole.input, DType.int32, (bmax, c.draft_tokens)),
            io.VERIFY_COMPLETION: (BufferRole.output, DType.int32,
                                   (bmax, len(io.VerifyCompletion._fields) + c.draft_tokens + 1
                                    + c.mtp_drafts))}
           if c.draft_tokens else {}),
    }


def mask_words(vocab_size: int) -> int:
    """int32 words per grammar mask row: bit j of word w allows token 32 * w + j."""
    return -(-vocab_size // 32)


def snapshot_buffer(state: str) -> str:
    """The snapshot twin of a continuation state buffer (the contract's naming rule)."""
    return SNAPSHOT_PREFIX + state


VERIFY_PREFIX = "verify."


def verify_buffer(state: str) -> str:
    """A recurrent state buffer's per-position twin in verify programs: ``[B, W, *row]``, the
    state of each verified row after each of its positions (the commit keeps the accepted one)."""
    return VERIFY_PREFIX + state


def pack_capacity_error(capacities: tuple[int, ...], prefill_chunk: int) -> str | None:
    """Why pack capacities are not valid (ascending, unique multiples of 16 in [16, the
    prefill chunk]), or None."""
    if list(capacities) != sorted(set(capacities)):
        return f"must be unique and ascending, got {list(capacities)}"
    bad = [c for c in capacities if not (16 <= c <= prefill_chunk and c % 16 == 0)]
    return f"each must be a multiple of 16 in [16, {prefill_chunk}] (the prefill chunk), got {bad}" if bad else None


PREFILL_SMALLEST = (16, 32, 64, 128)  # the smallest prefill capacities a core may declare


# Verify programs exist for the decode capacities up to this batch (at least the smallest):
# speculation pays at small batches, and a verify program of B rows holds B x (D + 1)
# positions' logits and sorts.
MAX_VERIFY_BATCH = 16


def verify_capacities(decode_capacities: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(b for b in decode_capacities if b <= MAX_VERIFY_BATCH) or decode_capacities[:1]


def prefill_capacities_for(chunk: int, context_limit: int, smallest: int = 128) -> tuple[int, ...]:
    """The capacity rule (docs/core.md): powers of two from ``smallest`` (16, 32, 64 or 128;
    128 unless prepared with --min-prefill-capacity) below the chunk limit, plus the exact
    limit; a limit of 64 with the default captures one 64-token program."""
    if chunk % 64 or not 64 <= chunk <= context_limit:
        raise ValueError(f"prefill chunk size must be a multiple of 64 in [64, {context_limit}], got {chunk}")
    if smallest not in PREFILL_SMALLEST:
        raise ValueError(f"the smallest prefill capacity must be one of {PREFILL_SMALLEST}, got {smallest}")
    caps = []
    c = smallest
    while c < chunk:
        caps.append(c)
        c *= 2
    caps.append(chunk)
    return tuple(caps)


# ---------------------------------------------------------------------------
# Loading and validation


class _AbiProbe(msgspec.Struct):
    abi: int


def load_manifest(core_dir: str | Path) -> Manifest:
    path = Path(core_dir) / MANIFEST_FILE
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ManifestError(f"cannot read runtime core manifest {path}: {e.strerror}", param=str(path)) from e
    m = decode_manifest(raw)
    rank_images(core_dir, m)
    return m


def rank_images(core_dir: str | Path, m: Manifest) -> list[Path]:
    """Each rank's arena image, in rank order; a missing one rejects the core."""
    paths = []
    for r, rank in enumerate(m.parallel.ranks):
        path = Path(core_dir) / rank.dir / m.arena.image
        if not path.is_file():
            raise ManifestError(f"core lacks rank {r}'s arena image {rank.dir}/{m.arena.image}",
                                param=f"parallel.ranks[{r}]")
        paths.append(path)
    return paths


def decode_manifest(raw: bytes) -> Manifest:
    try:
        probe = msgspec.json.decode(raw, type=_AbiProbe)
    except msgspec.DecodeError as e:
        raise ManifestError(f"manifest is not valid: {e}") from e
    if probe.abi != ABI_VERSION:
        raise CoreCompatibilityError(
            f"core was exported with ABI {probe.abi}; this runtime loads ABI {ABI_VERSION}",
            param="abi",
            code="abi_mismatch",
        )
    try:
        m = msgspec.json.decode(raw, type=Manifest)
    except msgspec.ValidationError as e:
        raise ManifestError(f"manifest does not match the contract: {e}") from e
    except msgspec.DecodeError as e:
        raise ManifestError(f"manifest is not valid JSON: {e}") from e
    validate(m)
    return m


def encode_manifest(m: Manifest) -> bytes:
    validate(m)
    return msgspec.json.format(msgspec.json.encode(m), indent=1)


def _fail(msg: str, param: str | None = None) -> None:
    raise ManifestError(msg, param=param)


def validate(m: Manifest) -> None:
    """Check that every number in the manifest is consistent with every other."""
    if m.abi != ABI_VERSION or m.identity.abi != m.abi:
        _fail(f"ABI fields disagree: {m.abi} / {m.identity.abi}", "abi")
    c = m.capacities
    for name in ("context_limit", "prefill_chunk", "slots", "max_pages_per_slot", "vocab_size", "hidden_size"):
        if getattr(c, name) <= 0:
            _fail(f"capacities.{name} must be positive", f"capacities.{name}")
    if c.min_prefill_capacity not in PREFILL_SMALLEST:
        _fail(f"capacities.min_prefill_capacity must be one of {PREFILL_SMALLEST}", "capacities.min_prefill_capacity")
    if c.prefill_capacities != prefill_capacities_for(c.prefill_chunk, c.context_limit, c.min_prefill_capacity):
        _fail(
            f"prefill capacities {c.prefill_capacities} do not follow the chunk rule for {c.prefill_chunk}",
            "capacities.prefill_capacities",
        )
    if not c.decode_capacities or list(c.decode_capacities) != sorted(set(c.decode_capacities)):
        _fail("decode capacities must be unique and ascending", "capacities.decode_capacities")
    if c.decode_capacities[0] < 1 or c.decode_capacities[-1] > c.slots:
        _fail("decode capacities must lie in [1, slots]", "capacities.decode_capacities")
    pack_error = pack_capacity_error(c.pack_capacities, c.prefill_chunk)
    if pack_error:
        _fail(f"capacities.pack_capacities: {pack_error}", "capacities.pack_capacities")
    if c.pack_align < 1 or c.pack_align & (c.pack_align - 1):
        _fail("capacities.pack_align must be a power of two", "capacities.pack_align")
    if c.pack_capacities and set(m.continuation.state) - {"state.hidden"}:
        _fail("pack programs need a model without recurrent state", "capacities.pack_capacities")
    if tuple(p.capacity for p in m.programs_of(ProgramKind.pack)) != c.pack_capacities:
        _fail(f"pack programs do not match capacities.pack_capacities {list(c.pack_capacities)}",
              "capacities.pack_capacities")
    if not 0 <= c.draft_tokens <= io.MAX_DRAFT_TOKENS:
        _fail(f"capacities.draft_tokens must lie in [0, {io.MAX_DRAFT_TOKENS}]", "capacities.draft_tokens")
    if c.mtp_drafts not in (0, c.draft_tokens):
        _fail("capacities.mtp_drafts must be 0 or capacities.draft_tokens", "capacities.mtp_drafts")
    names = {b.name for b in m.buffers}
    for name in sorted(stepped_state(m.continuation)) if c.draft_tokens else ():
        if verify_buffer(name) not in names:
            _fail(f"verify programs of a recurrent model need the buffer {verify_buffer(name)}", "buffers")
    want = verify_capacities(c.decode_capacities) if c.draft_tokens else ()
    if tuple(p.capacity for p in m.programs_of(ProgramKind.verify)) != want:
        _fail(f"verify programs do not match the verify capacities {list(want)}", "capacities.draft_tokens")
    if not 0 < c.sampling_vocab <= c.vocab_size:
        _fail("sampling_vocab must lie in (0, vocab_size]", "capacities.sampling_vocab")
    if c.stop_ids < len(m.frontend.eos_ids) + 1:
        _fail("stop_ids capacity must hold the EOS set plus one request stop id", "capacities.stop_ids")
    if c.snapshot_rows < 0:
        _fail("snapshot_rows must not be negative", "capacities.snapshot_rows")

    p = m.pages
    if p.page_size <= 0 or p.num_pages < 2 or not 0 <= p.null_page < p.num_pages:
        _fail("page geometry is inconsistent", "pages")
    if p.kv_window is not None and p.kv_window < 1:
        _fail("kv_window must be at least 1 (or absent: every layer reads its whole history)", "pages.kv_window")
    if c.max_pages_per_slot != -(-c.context_limit // p.page_size):
        _fail("max_pages_per_slot must equal ceil(context_limit / page_size)", "capacities.max_pages_per_slot")

    if m.completion.fields != COMPLETION_FIELDS or dict(m.completion.status_codes) != STATUS_CODES:
        _fail("completion record layout differs from this runtime's", "completion")

    a = m.arena
    if a.alignment <= 0 or a.alignment & (a.alignment - 1):
        _fail("arena alignment must be a power of two", "arena.alignment")
    names: set[str] = set()
    spans = []
    for b in m.buffers:
        if b.name in names:
            _fail(f"buffer {b.name!r} declared twice", b.name)
        names.add(b.name)
        if any(d <= 0 for d in b.shape):
            _fail(f"buffer {b.name!r} has an empty dimension", b.name)
        if b.nbytes != b.numel * b.dtype.itemsize:
            _fail(f"buffer {b.name!r} extent {b.nbytes} does not match its shape", b.name)
        if b.offset % a.alignment or b.offset < 0 or b.offset + b.nbytes > a.nbytes:
            _fail(f"buffer {b.name!r} lies outside the arena or is misaligned", b.name)
        spans.append((b.offset, b.offset + b.nbytes, b.name))
    spans.sort()
    for (s0, e0, n0), (s1, _, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            _fail(f"buffers {n0!r} and {n1!r} overlap", n1)

    for name, (role, dtype, shape) in runtime_buffer_shapes(c).items():
        if name not in names:
            _fail(f"core lacks runtime buffer {name!r}", name)
        b = m.buffer(name)
        if (b.role, b.dtype, b.shape) != (role, dtype, shape):
            _fail(f"runtime buffer {name!r} is {b.role.value}/{b.dtype.value}{b.shape}, "
                  f"expected {role.value}/{dtype.value}{shape}", name)
    if not any(b.role == BufferRole.kv for b in m.buffers):
        _fail("core declares no kv buffer", "buffers")

    seen_programs: set[str] = set()
    for prog in m.programs:
        if prog.name in seen_programs:
            _fail(f"program {prog.name!r} declared twice", prog.name)
        seen_programs.add(prog.name)
        for ref in (*prog.reads, *prog.writes, *((prog.completion,) if prog.completion else ())):
            if ref not in names:
                _fail(f"program {prog.name!r} refers to unknown buffer {ref!r}", prog.name)
        if (prog.graph is None) != (m.identity.device == "cpu"):
            _fail(f"program {prog.name!r}: graphs are required on CUDA cores and absent on reference cores", prog.name)
    caps = {k: tuple(p.capacity for p in m.programs_of(k)) for k in ProgramKind}
    if caps[ProgramKind.prefill] != c.prefill_capacities:
        _fail("prefill programs do not cover the declared prefill capacities", "programs")
    if caps[ProgramKind.decode] != c.decode_capacities:
        _fail("decode programs do not cover the declared decode capacities", "programs")
    if (m.kernels is None) != (m.identity.device == "cpu"):
        _fail("CUDA cores need a kernel table; reference cores have none", "kernels")
    if m.identity.device == "cuda" and not m.arena.base_address:
        _fail("CUDA cores need a fixed arena base address", "arena.base_address")
    if caps[ProgramKind.admit] != (max(c.prefill_capacities),):
        _fail("core needs exactly one admit program at the prefill chunk capacity", "programs")
    if caps[ProgramKind.score] != ((c.score_chunk,) if c.score_chunk else ()):
        _fail("score programs do not match the declared score chunk", "programs")
    if c.score_chunk and not c.max_logprobs:
        _fail("score programs need log-probability columns (max_logprobs)", "capacities.score_chunk")
    for kind in (ProgramKind.resume, ProgramKind.snapshot, ProgramKind.restore):
        if caps[kind] != (STATE_PROGRAM_CAPACITY,):
            _fail(f"core needs exactly one {kind.value} program of capacity {STATE_PROGRAM_CAPACITY}", "programs")
    _validate_continuation(m)
    _validate_parallel(m)

    s = m.sampling
    if s.temperature <= 0:
        _fail("default temperature must be positive", "sampling.temperature")
    for name, r in s.ranges.items():
        if name not in SAMPLING_NAMES:
            _fail(f"range for unknown sampling parameter {name!r}", f"sampling.ranges.{name}")
        if r.lo > r.hi:
            _fail(f"empty range for {name!r}", f"sampling.ranges.{name}")
        if not r.lo <= float(getattr(s, name)) <= r.hi:
            _fail(f"default {name} lies outside its range", f"sampling.ranges.{name}")
    if "temperature" in s.ranges and s.ranges["temperature"].lo <= 0:
        _fail("temperature range must be positive", "sampling.ranges.temperature")
    if any(not 0 <= t < c.vocab_size for t in m.frontend.eos_ids):
        _fail("EOS ids must lie inside the vocabulary", "frontend.eos_ids")


def _validate_continuation(m: Manifest) -> None:
    """Every continuation buffer is a per-slot state buffer with a snapshot twin of the
    same dtype and row shape; the tail rows hold exactly one KV page; and nothing else
    has the snapshot role (a snapshot row is fully described by this section)."""
    c, cont = m.capacities, m.continuation
    by_name = {b.name: b for b in m.buffers}
    if "state.hidden" not in cont.state:
        _fail("continuation state must include state.hidden (resume samples from it)", "continuation.state")
    if len(set(cont.state)) != len(cont.state):
        _fail("continuation state names a buffer twice", "continuation.state")
    if len(set(cont.prefill_only)) != len(cont.prefill_only) \
            or not set(cont.prefill_only) <= set(cont.state) - {"state.hidden"}:
        _fail("continuation.prefill_only must name distinct recurrent continuation buffers",
              "continuation.prefill_only")
    expected = {cont.tail}
    for name in cont.state:
        b = by_name.get(name)
        if b is None or b.role != BufferRole.state or b.shape[0] != c.slots + 1:
            _fail(f"continuation buffer {name!r} must be a state buffer with one row per slot", "continuation.state")
        twin = by_name.get(snapshot_buffer(name))
        if twin is None or twin.role != BufferRole.snapshot or twin.dtype != b.dtype \
                or twin.shape != (c.snapshot_rows + 1, *b.shape[1:]):
            _fail(f"continuation buffer {name!r} needs a snapshot twin {snapshot_buffer(name)!r} "
                  f"of shape {(c.snapshot_rows + 1, *b.shape[1:])}", "continuation.state")
        expected.add(twin.name)
    tail = by_name.get(cont.tail)
    kv = [b for b in m.buffers if b.role == BufferRole.kv]
    if tail is None or tail.role != BufferRole.snapshot or tail.shape[0] != c.snapshot_rows + 1 \
            or tail.nbytes // tail.shape[0] != m.pages.bytes_per_page or tail.dtype != kv[0].dtype:
        _fail(f"continuation tail {cont.tail!r} must be a snapshot buffer of one KV page per row", "continuation.tail")
    extra = sorted(b.name for b in m.buffers if b.role == BufferRole.snapshot and b.name not in expected)
    if extra:
        _fail(f"snapshot buffers outside the continuation section: {extra}", "continuation")


def _validate_parallel(m: Manifest) -> None:
    """Ranks are named by the contract's rule, one per TP rank; reference arenas have
    no address, CUDA rank arenas are disjoint fixed ranges with rank 0's the arena's."""
    par = m.parallel
    if par.tp_size < 1:
        _fail(f"parallel.tp_size must be at least 1, got {par.tp_size}", "parallel.tp_size")
    if len(par.ranks) != par.tp_size:
        _fail(f"parallel.ranks lists {len(par.ranks)} ranks for tp_size {par.tp_size}", "parallel.ranks")
    for r, rank in enumerate(par.ranks):
        if rank.dir != rank_dir(r, par.tp_size):
            _fail(f"rank {r}'s directory must be {rank_dir(r, par.tp_size)!r}, got {rank.dir!r}",
                  f"parallel.ranks[{r}].dir")
    bases = [rank.base_address for rank in par.ranks]
    if m.identity.device == "cpu":
        if any(bases):
            _fail("reference cores have no arena addresses", "parallel.ranks")
        return
    if bases[0] != m.arena.base_address:
        _fail("rank 0's arena address must be the arena's", "parallel.ranks[0].base_address")
    spans = sorted((b, r) for r, b in enumerate(bases))
    for (b0, r0), (b1, r1) in zip(spans, spans[1:]):
        if b1 < b0 + m.arena.nbytes:
            _fail(f"rank arenas {r0} and {r1} overlap", f"parallel.ranks[{r1}].base_address")


def check_device(m: Manifest, *, device: str, compute_capability: str | None) -> None:
    """Reject a core prepared for another device kind or compute capability."""
    if m.identity.device != device:
        raise CoreCompatibilityError(
            f"core was prepared for {m.identity.device}; this executor runs on {device}",
            param="identity.device",
            code="device_mismatch",
        )
    if device == "cuda" and m.identity.compute_capability != compute_capability:
        raise CoreCompatibilityError(
            f"core was prepared for compute capability {m.identity.compute_capability}; "
            f"this GPU is {compute_capability}",
            param="identity.compute_capability",
            code="compute_capability_mismatch",
        )
