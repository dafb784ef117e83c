"""Recipe for Qwen3.5 hybrid decoders (``qwen3_5``): Gated DeltaNet layers mixed
with gated full-attention layers.

Built by the recipe base (``recipes/base.py``): the canonical Transformers
module tree on the meta device, weights bound to arena views. Full-attention
layers call the shared paged attention (``flare_paged``); only they own KV, so
attention layer ``j`` of the stack owns KV layer ``j``. Each Gated DeltaNet
module is replaced (the base's ``Replacement`` hook) by
``PagedGatedDeltaNet``: its projections, convolution, gates and gated norm are
Transformers' own, but its convolution history and recurrent matrix live in
per-slot state buffers instead of a Transformers cache.

Continuation state (declared to the manifest, copied by snapshot/restore)::

    state.gdn.conv       [slots+1, gdn_layers, conv_dim, kernel-1]   model dtype
    state.gdn.recurrent  [slots+1, gdn_layers, v_heads, k_dim, v_dim] float32
    state.gdn.block      [slots+1, gdn_layers, v_heads, k_dim, v_dim] float32  (prefill only)
    state.gdn.stash      [slots+1, gdn_layers, 64, conv_dim + 2 v_heads] model dtype  (prefill only)
    state.gdn.grid       [slots+1, gdn_layers, 2]                     int32  (prefill only)

A prefill chunk (one slot) runs the canonical chunked delta rule on the slot's grid of
64-token blocks (``_aligned_prefill``): it re-runs the inputs of the block under way
(the stash) from the matrix at that block's start, then its own tokens, so every block
is computed the same however the prompt was cut into chunks (a cache hit restores a
message end and prefills from there). Tokens past the chunk's count enter with zero
q/k/v, zero decay and zero beta, which leaves the recurrence unchanged, and the
convolution history is cut at the count. A decode batch runs one recurrent step per row
from that row's own state (a chunk after decode steps starts a grid of its own); rows
that are not live (padding, finished requests) keep their state bitwise.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

from flare.core.manifest import DType
from flare.prepare.attention import PagedBatch
from flare.prepare.recipes.base import KVGeometry, Recipe, RecipeError, Replacement, StateBuffer
from flare.prepare.recipes.decoder import DECODER_SHARDING
from flare.prepare.recipes.fused import fuse_linears, hooked
from flare.prepare.recipes.moe import check_moe, prepared_moe

CONV_STATE = "state.gdn.conv"
RECURRENT_STATE = "state.gdn.recurrent"
BLOCK_STATE = "state.gdn.block"
STASH = "state.gdn.stash"
GRID = "state.gdn.grid"
LINEAR = "linear_attention"


def _qwen3_5_inputs(mod, x: torch.Tensor):
    """Qwen3.5: one fused projection whose columns are q|k|v (the convolution's input),
    z, b, a."""
    return mod.in_proj(x).split(mod.in_proj.sizes, dim=-1)


def _qwen3_next_inputs(mod, x: torch.Tensor):
    """Qwen3-Next: the fused in_proj_qkvz|in_proj_ba, grouped per key head as Transformers'
    ``fix_query_key_value_ordering`` reads them; returns q|k|v (the convolution's input),
    z, b, a as Qwen3.5's projection gives them."""
    T = x.shape[0]
    qkvz, ba = mod.in_proj(x).split(mod.in_proj.sizes, dim=-1)
    q, k, v, z, b, a = mod.fix_query_key_value_ordering(qkvz[None], ba[None])
    return torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1), z[0], b[0], a[0]


def _prepared_gdn_with(inputs, conv_first: bool):
    def prepared(base: type) -> type:
        class PagedGatedDeltaNet(base):
            """A Gated DeltaNet (Qwen3.5, Qwen3-Next) over packed tokens and per-slot state
            rows. ``state_index`` (set by the recipe base) is this layer's index among GDN
            layers. ``flare_conv_first``: its fused input projection's first outputs are the
            convolution's channels (Qwen3.5's q|k|v, z, b, a; not Qwen3-Next's, grouped per key
            head), so a decode step may take the convolution in that projection's GEMV
            (``_conv_fold_tiling``)."""

            state_index: int
            flare_conv_first = conv_first

            def flare_conv_fold(self) -> tuple[nn.Module, int, int] | None:
                """(the input projection, the convolution's channels, its width) where a decode
                step's GEMV of that projection may take the convolution (``gemv.Conv``: kernels up
                to 4 wide); None where it may not. ``--step-gemms measure`` charges the products
                that leave it apart its kernel."""
                channels, width = self.conv1d.weight.shape[0], self.conv1d.weight.shape[-1]
                if not self.flare_conv_first or not 2 <= width <= 4 or self.in_proj.sizes[0] != channels:
                    return None
                return self.in_proj, channels, width

            def forward(self, hidden_states, cache=None, attention_mask=None, paged: PagedBatch | None = None,
                        **kwargs):
                if paged is None or paged.state is None:
                    raise RuntimeError("PagedGatedDeltaNet needs the 'paged' batch with state buffers")
                x = hidden_states[0]  # [T, H]
                T = x.shape[0]
                fold = _conv_fold_tiling(self, paged, T)
                if fold is not None:  # the convolution in the projection's GEMV: q|k|v come convolved
                    # (whether in_proj takes the layer's input norm: decided here, in the traced code
                    # where the layer decided to pass its input on, not again in the eager call)
                    normed = self.in_proj.flare_input_norm(x) is not None
                    mixed, z, b, a = _convolved_inputs(self, paged, x, fold, normed)
                else:
                    mixed, z, b, a = inputs(self, x)  # q|k|v, z, b, a
                mix = _mix_triton if paged.impl == "triton" else _mix_torch
                if mix is _mix_triton and _norms_in_step(self, paged, mixed):
                    core = _step_triton_normed(self, paged, mixed, b, a, z, fold is not None)  # normed and gated
                else:
                    core = _mix_triton(self, paged, mixed, b, a, True) if fold is not None else \
                        mix(self, paged, mixed, b, a)  # [T, Hv, Dv]
                    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
                return self.out_proj(core.reshape(1, T, -1))

            # (its input goes to the input projection alone, which may take the layer's input norm)
            forward.flare_input_projection = "in_proj"

        return PagedGatedDeltaNet

    return prepared


_prepared_gdn = _prepared_gdn_with(_qwen3_5_inputs, conv_first=True)
_prepared_next_gdn = _prepared_gdn_with(_qwen3_next_inputs, conv_first=False)


def _conv_fold_tiling(mod, paged: PagedBatch, rows: int):
    """The GEMV tiling with which a decode step (CUDA path, one token a row, not a verify step's
    several) computes this layer's input projection and its convolution in one launch
    (``gemv.gemv_conv_linear``): where ``--step-gemms`` put the projection on a GEMV without a split
    at this row count (``flare_conv_tiling``), its first outputs are the convolution's channels
    (``flare_conv_fold``) and no forward hook would see the projection's call; else None."""
    if paged.impl != "triton" or paged.single_slot or paged.verify_width or hooked(mod.in_proj):
        return None
    # (the projection's fold counts are set only where ``flare_conv_fold`` offered it: check_conv_folds)
    conv_tiling = getattr(mod.in_proj, "flare_conv_tiling", None)
    return None if conv_tiling is None else conv_tiling(rows)


@torch.compiler.disable
def _convolved_inputs(mod, paged: PagedBatch, x: torch.Tensor, tiling, normed: bool = False):
    """A decode step's input projection with the convolution step of each live row in its GEMV's
    epilogue (its history updated in place), and the layer's input norm in its loads where it takes
    it (``normed``, decided by the caller): q|k|v convolved, z, b, a (``_conv_fold_tiling``)."""
    from flare.prepare.kernels.gemv import Conv, gemv_conv_linear

    conv_rows, _ = _state_rows(mod, paged)
    weight = mod.conv1d.weight
    conv = Conv(conv_rows, weight.reshape(weight.shape[0], -1), mod.conv1d.bias, paged.token_slot, paged.valid)
    # (the layer's input norm too, where the projection takes it, ``normed``: ``fused.input_norm``)
    norm = mod.in_proj._flare_input_norm.flare_gemv_norm(x) if normed else None
    if normed and norm is None:
        raise RuntimeError("the input projection was to take the layer's input norm but cannot")
    return gemv_conv_linear(x, mod.in_proj.weight, tiling, conv, norm=norm).split(mod.in_proj.sizes, dim=-1)


def _state_rows(mod, paged: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """This layer's convolution history [rows, conv_dim, K-1] and recurrent matrices
    [rows, Hv, Dk, Dv] (views of the per-slot state buffers)."""
    return (paged.state[CONV_STATE].select(1, mod.state_index),
            paged.state[RECURRENT_STATE].select(1, mod.state_index))


def _split_heads(mod, mixed: torch.Tensor):
    """The convolution's output as q, k [T, Hk, Dk] and v [T, Hv, Dv] (views)."""
    T = mixed.shape[0]
    query, key, value = torch.split(mixed, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
    return (query.reshape(T, -1, mod.head_k_dim), key.reshape(T, -1, mod.head_k_dim),
            value.reshape(T, -1, mod.head_v_dim))


# The mixers read and write the slots' state rows in place, so torch.compile must not
# trace them (a mutated state buffer would become a compiled graph's input and output):
# the compiled layer ends and resumes around them, as around the paged attention.


@torch.compiler.disable
def _mix_torch(mod, paged: PagedBatch, mixed, b, a) -> torch.Tensor:
    """The reference path: Transformers' convolution and delta rules in torch."""
    if paged.verify_width:
        return _verify(mod, paged, mixed, b, a, _decode_torch)
    conv_rows, rec_rows = _state_rows(mod, paged)
    if not paged.single_slot:
        return _decode_torch(mod, conv_rows, rec_rows, paged.token_slot, paged.valid, mixed, b, a)
    weight = mod.conv1d.weight  # [conv_dim, 1, K]
    history = mod.conv_kernel_size - 1
    slot = paged.token_slot[:1]
    conv = conv_rows.index_select(0, slot)[0]  # [conv_dim, K-1]
    seq = torch.cat([conv, mixed.transpose(0, 1).to(conv.dtype)], dim=1)  # [conv_dim, K-1+T]
    out = F.conv1d(seq[None].to(weight.dtype), weight, mod.conv1d.bias, groups=mod.conv_dim)[0]
    keep = torch.arange(history, device=mixed.device) + paged.valid.sum()  # the last K-1 valid inputs
    conv_rows.index_copy_(0, slot, seq.index_select(1, keep)[None])
    mixed = F.silu(out).transpose(0, 1).to(mixed.dtype)  # [T, conv_dim]

    def inputs(rows, count):
        valid = torch.arange(rows.shape[0], device=rows.device) < count
        query, key, value, beta, g = _gated_inputs(mod, *_split_rows(mod, rows), valid)
        return query, key, value, g, beta

    return _aligned_prefill(mod, paged, mixed, b, a, inputs, _torch_delta_rules()[0])


BLOCK = 64  # the chunked delta rule's block: a slot's prefill blocks start on its grid of BLOCK tokens


def _split_rows(mod, rows: torch.Tensor):
    """Stash rows (the convolution's output | b | a) back into their three parts."""
    Hv = mod.num_v_heads
    return rows[:, :mod.conv_dim], rows[:, mod.conv_dim:mod.conv_dim + Hv], rows[:, mod.conv_dim + Hv:]


def _on_grid(rule, q, k, v, g, beta, initial):
    """One call of the chunked rule over a run of the grid's rows from ``initial``: (output
    rows, final matrix in float32). The rule's blocks are the grid's: its chunk size is
    given, not left to its default."""
    core, final = rule(q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=initial,
                       output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=BLOCK)
    return core[0], final.to(torch.float32)


def _aligned_prefill(mod, paged: PagedBatch, mixed, b, a, inputs, rule) -> torch.Tensor:
    """One slot's prefill chunk through the chunked delta rule on the slot's block grid, so
    that every block of BLOCK tokens is computed the same whatever the chunks were: a
    follow-up turn restored at a message end computes the bits the same prompt prefilled
    whole computes (the chunked rule rounds by where its blocks start).

    The slot keeps, besides its recurrent matrix at the consumed count S, the matrix at the
    start of S's block (``state.gdn.block``), the convolution output, b and a of the tokens
    from there to S (``state.gdn.stash``, r rows) and (S, r) (``state.gdn.grid``). A chunk
    re-runs those r rows before its own: one call of the rule over the complete blocks,
    whose final state is the new block start, and one over the partial block after them,
    whose final state is the matrix at the new S. Where the grid does not end at the chunk's
    start (decode steps consumed tokens since: they keep no stash), the chunk starts a grid
    of its own from the recurrent matrix. That test relies on a slot's consumed count only
    growing between prefill chunks; a restore sets count and rows together from one
    snapshot, so its grid ends at the restored count. ``inputs(rows, count)`` gives q, k, v, g, beta
    of stash-layout rows with rows from ``count`` on entering as no update."""
    _, rec_rows = _state_rows(mod, paged)
    block_rows = paged.state[BLOCK_STATE].select(1, mod.state_index)  # [rows, Hv, Dk, Dv]
    stash_rows = paged.state[STASH].select(1, mod.state_index)  # [rows, BLOCK, width]
    grid_rows = paged.state[GRID].select(1, mod.state_index)  # [rows, 2] int32: (S, r)
    dev, T = mixed.device, mixed.shape[0]
    slot = paged.token_slot[:1]
    count = paged.valid.sum()
    start = paged.positions[0]
    grid = grid_rows.index_select(0, slot)[0].long()
    on_grid = grid[0] == start
    r = torch.where(on_grid, grid[1], 0)
    initial = torch.where(on_grid, block_rows.index_select(0, slot), rec_rows.index_select(0, slot))
    rows = torch.cat([mixed, b.to(mixed.dtype), a.to(mixed.dtype)], dim=-1)  # [T, width]
    whole = -(-T // BLOCK) * BLOCK  # the first call's length: every complete block fits
    i = torch.arange(whole + BLOCK, device=dev)
    stash = stash_rows.index_select(0, slot)[0].to(rows.dtype)
    seq = torch.where((i < r)[:, None], stash.index_select(0, i.clamp(max=BLOCK - 1)),
                      rows.index_select(0, (i - r).clamp(0, T - 1)))  # stash ++ chunk, on the grid
    total = r + count
    edge = total // BLOCK * BLOCK  # the start of the last (partial) block

    def run(part, valid, initial):
        return _on_grid(rule, *inputs(part, valid), initial)

    whole_core, block = run(seq[:whole], edge, initial)  # complete blocks; final state: the new block start
    tail_rows = seq.index_select(0, edge + torch.arange(BLOCK, device=dev))
    tail_core, final = run(tail_rows, total - edge, block)
    at = torch.arange(T, device=dev) + r
    core = torch.where((at < edge)[:, None, None], whole_core.index_select(0, at.clamp(max=whole - 1)),
                       tail_core.index_select(0, (at - edge).clamp(0, BLOCK - 1)))
    live = count > 0  # a chunk without tokens leaves the slot's state as it is

    def keep(rows, new):
        rows.index_copy_(0, slot, torch.where(live, new[None].to(rows.dtype), rows.index_select(0, slot)))

    keep(rec_rows, final[0])
    keep(block_rows, block[0])
    keep(stash_rows, tail_rows)
    keep(grid_rows, torch.stack([start + count, total - edge]))
    return core


def _gated_inputs(mod, mixed, b, a, valid):
    """q, k, v, beta and the decay g of the convolution's output; rows that are not valid
    enter with zero inputs, zero decay and zero beta: the recurrence passes through them
    unchanged."""
    query, key, value = _split_heads(mod, mixed)
    beta = b.sigmoid()
    g = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)
    m = valid[:, None]
    query, key, value = (torch.where(m[:, :, None], t, torch.zeros_like(t)) for t in (query, key, value))
    return (query, key, value, torch.where(m, beta, torch.zeros_like(beta)), torch.where(m, g, torch.zeros_like(g)))


def _decode_torch(mod, conv_rows, rec_rows, slots, valid, mixed, b, a) -> torch.Tensor:
    """One token for each row, each on its slot's state rows (updated in place where valid)."""
    weight = mod.conv1d.weight
    conv = conv_rows.index_select(0, slots)  # [T, conv_dim, K-1]
    seq = torch.cat([conv, mixed[:, :, None].to(conv.dtype)], dim=2)  # [T, conv_dim, K]
    out = F.conv1d(seq.to(weight.dtype), weight, mod.conv1d.bias, groups=mod.conv_dim)[:, :, 0]
    conv_rows.index_copy_(0, slots, torch.where(valid[:, None, None], seq[:, :, 1:], conv))
    query, key, value, beta, g = _gated_inputs(mod, F.silu(out).to(mixed.dtype), b, a, valid)
    _, recurrent_rule = _torch_delta_rules()
    initial = rec_rows.index_select(0, slots)  # [T, Hv, Dk, Dv]
    core, final = recurrent_rule(query[:, None], key[:, None], value[:, None], g=g[:, None], beta=beta[:, None],
                                 initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
    rec_rows.index_copy_(0, slots, torch.where(valid[:, None, None, None], final.to(rec_rows.dtype), initial))
    return core[:, 0]


def _verify(mod, paged: PagedBatch, mixed, b, a, step) -> torch.Tensor:
    """A verify program's rows (``PagedBatch.verify_width`` positions per slot): the decode
    step ``step`` position by position on a copy of each slot's state rows, the copy after
    each position stored in the per-position buffers; the slots' own rows are not touched
    (the program's commit writes the accepted position's)."""
    W = paged.verify_width
    conv_rows, rec_rows = _state_rows(mod, paged)
    slots = paged.token_slot[::W]
    rows = torch.arange(slots.shape[0], device=slots.device)
    conv_work, rec_work = conv_rows.index_select(0, slots), rec_rows.index_select(0, slots)
    conv_out = paged.verify_state[CONV_STATE].select(2, mod.state_index)  # [B, W, conv_dim, K-1]
    rec_out = paged.verify_state[RECURRENT_STATE].select(2, mod.state_index)  # [B, W, Hv, Dk, Dv]
    cores = []
    for j in range(W):
        at = rows * W + j
        cores.append(step(mod, conv_work, rec_work, rows, paged.valid[at], mixed[at], b[at], a[at]))
        conv_out[:, j].copy_(conv_work)
        rec_out[:, j].copy_(rec_work)
    return torch.stack(cores, dim=1).flatten(0, 1)  # back to row b * W + j


def _chunk_rule(device: torch.device):
    if device.type != "cuda":
        return _torch_delta_rules()[0]
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as e:
        raise RecipeError("the qwen3_5 recipe's CUDA path needs flash-linear-attention's chunked delta rule: "
                          "pip install 'flare[cuda]' (fla-core)") from e
    return chunk_gated_delta_rule


def _torch_delta_rules():
    """Transformers' torch chunked and recurrent gated delta rules, over q/k/v in
    [B, T, heads, dim]. Transformers swaps in flash-linear-attention's kernels for them
    when ``fla`` is importable; the reference path is the torch arithmetic on any
    device, so it unwraps them. Value heads read key head h // (Hv / Hk): the query and
    key heads are repeated here, since Transformers' torch rules repeat them only from
    5.23 on (before, its layer did)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q

    def repeated(rule):
        def run(query, key, value, *args, **kwargs):
            group = value.shape[2] // query.shape[2]
            return rule(query.repeat_interleave(group, dim=2), key.repeat_interleave(group, dim=2), value,
                        *args, **kwargs)
        return run

    return (repeated(inspect.unwrap(q.torch_chunk_gated_delta_rule)),
            repeated(inspect.unwrap(q.torch_recurrent_gated_delta_rule)))


@torch.compiler.disable
def _mix_triton(mod, paged: PagedBatch, mixed, b, a, convolved: bool = False) -> torch.Tensor:
    """The CUDA path (kernels/gdn.py, docs/gpu.md). Decode: the convolution step (unless
    ``convolved``: the input projection's GEMV took it) and the delta-rule step update each live
    row's state in place. Prefill: the chunk's
    convolution (zero past the count, the history cut at it) and gates, then
    flash-linear-attention's chunked delta rule from the slot's state (Transformers'
    torch rule under Triton's CPU interpreter, where the Triton pieces are tested)."""
    from flare.prepare.kernels import gdn as K

    if not paged.single_slot and not paged.verify_width:
        conv_rows, rec_rows = _state_rows(mod, paged)
        return _decode_triton(mod, conv_rows, rec_rows, paged.token_slot, paged.valid, mixed, b, a, convolved)
    if convolved:  # (``_conv_fold_tiling`` folds decode steps only)
        raise RuntimeError("a verify step or prefill chunk came convolved")
    if paged.verify_width:
        return _verify_triton(mod, paged, mixed, b, a)
    conv_rows, rec_rows = _state_rows(mod, paged)
    weight, bias = mod.conv1d.weight, mod.conv1d.bias
    slot = paged.token_slot[:1]
    count = paged.valid.sum(dtype=torch.int32).reshape(1)
    mixed = K.conv1d_prefill_chunk(mixed, conv_rows, weight, bias, slot, count)  # zero past the count
    return _aligned_prefill_triton(mod, paged, torch.cat([mixed, b.to(mixed.dtype), a.to(mixed.dtype)], dim=-1),
                                   slot, count, _chunk_rule(mixed.device))


def _aligned_prefill_triton(mod, paged: PagedBatch, rows, slot, count, rule) -> torch.Tensor:
    """``_aligned_prefill`` with its data movement in three launches (``kernels/gdn_grid.py``):
    the same rule calls on the same inputs, the same output and state rows."""
    from flare.prepare.kernels import gdn as K
    from flare.prepare.kernels import gdn_grid as G

    _, rec_rows = _state_rows(mod, paged)
    block_rows = paged.state[BLOCK_STATE].select(1, mod.state_index)
    stash_rows = paged.state[STASH].select(1, mod.state_index)
    grid_rows = paged.state[GRID].select(1, mod.state_index)
    T = rows.shape[0]
    whole = -(-T // BLOCK) * BLOCK
    start = paged.positions[:1]
    seq, meta = G.grid_rows(rows, stash_rows, grid_rows, slot, start, count, whole, BLOCK)

    def run(part, valid, initial):
        mixed, b, a = _split_rows(mod, part)  # rows past the valid count are zero
        g, beta = K.gdn_prefill_gates(a, b, mod.A_log, mod.dt_bias, valid)  # zero past the count
        core, final = _on_grid(rule, *_split_heads(mod, mixed), g, beta, initial)
        return core.contiguous(), final.contiguous()

    whole_core, block = run(seq[:whole], meta[0:1], G.grid_initial(block_rows, rec_rows, slot, meta))
    tail_core, final = run(seq[whole:], meta[1:2], block)
    return G.grid_commit(whole_core, tail_core, final, block, seq, rec_rows, block_rows, stash_rows, grid_rows,
                         slot, start, count, meta, T)


def _norms_in_step(mod, paged: PagedBatch, mixed: torch.Tensor) -> bool:
    """Whether a step's gated norm runs in ``_step_triton_normed`` (one launch after the delta
    rule, where Inductor compiles the module into two before the few-row GEMV): decode and
    verify steps of the CUDA path (both, so that a row's bits are the same in either), with
    Transformers' gated norm (``rownorm.is_gated_norm``) in the model's dtype and no hook on
    it. Prompt programs keep the module."""
    from flare.prepare.kernels.rownorm import is_gated_norm

    norm = mod.norm
    return (not paged.single_slot and is_gated_norm(norm) and norm.weight.dtype == mixed.dtype
            and not hooked(norm))


@torch.compiler.disable
def _step_triton_normed(mod, paged: PagedBatch, mixed, b, a, z, convolved: bool = False) -> torch.Tensor:
    """A decode or verify step's convolution (unless ``convolved``) and delta rule
    (``_mix_triton``), then the gated norm of its output heads (``gdn.gated_rms_norm``):
    ``[T, Hv * Dv]``."""
    from flare.prepare.kernels import gdn as K

    core = _mix_triton(mod, paged, mixed, b, a, convolved)  # [T, Hv, Dv]
    gate = z.reshape(core.shape) if z.dim() == 3 else z.unflatten(-1, core.shape[1:])  # a view
    out = K.gated_rms_norm(core, gate, mod.norm.weight, mod.norm.variance_epsilon)
    return out.reshape(core.shape[0], -1)


def _decode_triton(mod, conv_rows, rec_rows, slots, live, mixed, b, a, convolved: bool = False) -> torch.Tensor:
    """The convolution step (unless ``convolved``: ``mixed`` is its output) and the delta-rule
    step of each live row, its state updated in place."""
    from flare.prepare.kernels import gdn as K

    if not convolved:
        mixed = K.conv1d_decode_step(mixed, conv_rows, mod.conv1d.weight, mod.conv1d.bias, slots, live)
    query, key, value = _split_heads(mod, mixed)
    return K.gdn_decode_step(query, key, value, a, b, mod.A_log, mod.dt_bias, rec_rows, slots, live)


def _verify_triton(mod, paged: PagedBatch, mixed, b, a) -> torch.Tensor:
    """``_verify`` with ``_decode_triton``'s steps, the W positions of each row in one launch
    of each kernel (``gdn.conv1d_verify_steps``, ``gdn.gdn_verify_steps``): the same
    arithmetic, the state after each position written to the per-position buffers, the
    slots' own rows untouched."""
    from flare.prepare.kernels import gdn as K

    conv_rows, rec_rows = _state_rows(mod, paged)
    slots = paged.token_slot[::paged.verify_width]
    mixed = K.conv1d_verify_steps(mixed, conv_rows, mod.conv1d.weight, mod.conv1d.bias, slots, paged.valid,
                                  paged.verify_state[CONV_STATE].select(2, mod.state_index))
    query, key, value = _split_heads(mod, mixed)
    return K.gdn_verify_steps(query, key, value, a, b, mod.A_log, mod.dt_bias, rec_rows, slots, paged.valid,
                              paged.verify_state[RECURRENT_STATE].select(2, mod.state_index))


def _gdn_state(config, dtype: DType, tp_size: int = 1) -> list[StateBuffer]:
    """The Gated DeltaNet layers' state rows of one rank (``1 / tp_size`` of the heads)."""
    t = config.get_text_config()
    layers = sum(1 for kind in t.layer_types if kind == LINEAR)
    hv = t.linear_num_value_heads // tp_size
    conv_dim = sum(_qkv_blocks(t)) // tp_size
    matrix = (layers, hv, t.linear_key_head_dim, t.linear_value_head_dim)
    return [
        StateBuffer(CONV_STATE, dtype, (layers, conv_dim, t.linear_conv_kernel_dim - 1)),
        # The delta rule accumulates in float32 whatever the model dtype (as Transformers does).
        StateBuffer(RECURRENT_STATE, DType.float32, matrix),
        # The slot's block grid (_aligned_prefill): written by prefill chunks only.
        StateBuffer(BLOCK_STATE, DType.float32, matrix, prefill_only=True),
        StateBuffer(STASH, dtype, (layers, BLOCK, conv_dim + 2 * hv), prefill_only=True),
        StateBuffer(GRID, DType.int32, (layers, 2), prefill_only=True),
    ]


def _qkv_blocks(t) -> tuple[int, int, int]:
    """The rows of a Gated DeltaNet's q | k | v projection (and its convolution's channels)."""
    key = t.linear_num_key_heads * t.linear_key_head_dim
    return key, key, t.linear_num_value_heads * t.linear_value_head_dim


# Tensor parallelism of the hybrid: attention heads, MLP intermediates and vocabulary as the
# decoder's; each Gated DeltaNet keeps 1 / N of its key and value heads: its q | k | v
# projection and convolution by blocks (a rank takes its slice of q, of k and of v), z, b,
# a, A_log and dt_bias by value heads (Qwen3-Next's projections are grouped per key head,
# so contiguous slices are whole groups), its output projection row-parallel (all-reduced).
# The value heads of a key head stay on its rank (value head h reads key head h // (Hv / Hk)).
HYBRID_SHARDING = {
    **DECODER_SHARDING,
    "linear_attn.in_proj_qkv": 0,
    "linear_attn.in_proj_z": 0,
    "linear_attn.in_proj_b": 0,
    "linear_attn.in_proj_a": 0,
    "linear_attn.in_proj_qkvz": 0,
    "linear_attn.in_proj_ba": 0,
    "linear_attn.conv1d": 0,
    "linear_attn": 0,  # A_log, dt_bias
    "linear_attn.out_proj": 1,
}
HYBRID_BLOCKS = {"linear_attn.in_proj_qkv": _qkv_blocks, "linear_attn.conv1d": _qkv_blocks}
# The experts split across ranks as Qwen3-MoE's (the router replicated), the shared expert
# as a dense MLP (its one-column gate replicated).
HYBRID_MOE_SHARDING = {
    **HYBRID_SHARDING,
    "mlp.experts": 0,
    "mlp.shared_expert.gate_proj": 0,
    "mlp.shared_expert.up_proj": 0,
    "mlp.shared_expert.down_proj": 1,
}
GDN_SHARDED = ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim")


def _fuse_gdn_inputs(gdn) -> None:
    """One GEMM for the four input projections of a Gated DeltaNet layer (they share
    their input): q/k/v for the convolution, the output gate z, beta's b and the decay's a."""
    if not fuse_linears(gdn, GDN_INPUTS, "in_proj"):
        raise RecipeError(f"{type(gdn).__name__}: its input projections {GDN_INPUTS} cannot be fused")


GDN_INPUTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
NEXT_GDN_INPUTS = ("in_proj_qkvz", "in_proj_ba")


def _fuse_next_gdn_inputs(gdn) -> None:
    """One GEMM for Qwen3-Next's two input projections (they share their input)."""
    if not fuse_linears(gdn, NEXT_GDN_INPUTS, "in_proj"):
        raise RecipeError(f"{type(gdn).__name__}: its input projections {NEXT_GDN_INPUTS} cannot be fused")


class Qwen35Recipe(Recipe):
    name = "qwen3_5"
    model_types = ("qwen3_5", "qwen3_5_text")
    # Gated attention and the MLP are fused (recipes/fused.py).
    sharding = HYBRID_SHARDING
    shard_blocks = HYBRID_BLOCKS
    divided_dims = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "linear_num_key_heads",
                    "linear_num_value_heads", "vocab_size")
    eager = frozenset({"Qwen3_5RMSNorm"})
    replacements = (Replacement("Qwen3_5GatedDeltaNet", _prepared_gdn, _gdn_state, _fuse_gdn_inputs),)
    mtp = True  # Qwen3.5, Qwen3.5-MoE and Qwen3-Next checkpoints carry one MTP layer (recipes/mtp.py)
    rotary_sections = 3  # interleaved multimodal RoPE: temporal, height, width

    def kv_geometry(self, config, tp_size: int = 1) -> KVGeometry:
        t = config.get_text_config()
        attn = sum(1 for kind in t.layer_types if kind != LINEAR)
        return KVGeometry(attn + self.mtp_layers(config), t.num_key_value_heads // tp_size, t.head_dim)

    def shard_modules(self, model, tp) -> None:
        """Each Gated DeltaNet computes with its rank's heads: the counts and widths its
        forward (and Transformers' ``fix_query_key_value_ordering``) splits by."""
        for module in model.modules():
            if type(module).__name__ == "PagedGatedDeltaNet":
                for attr in GDN_SHARDED:
                    setattr(module, attr, getattr(module, attr) // tp.size)


class Qwen35MoeRecipe(Qwen35Recipe):
    """Qwen3.5-MoE (Qwen3.5/3.6-35B-A3B): the hybrid's Gated DeltaNet and gated attention,
    and in every layer routed experts with a gated shared expert (``recipes/moe.py``)."""

    name = "qwen3_5_moe"
    model_types = ("qwen3_5_moe", "qwen3_5_moe_text")
    sharding = HYBRID_MOE_SHARDING
    divided_dims = ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
                    "num_experts", "shared_expert_intermediate_size", "vocab_size")
    eager = frozenset({"Qwen3_5MoeRMSNorm"})
    replacements = (Replacement("Qwen3_5MoeGatedDeltaNet", _prepared_gdn, _gdn_state, _fuse_gdn_inputs),
                    Replacement("Qwen3_5MoeSparseMoeBlock", prepared_moe, setup=check_moe))


class Qwen3NextRecipe(Qwen35Recipe):
    """Qwen3-Next (Qwen3-Next-80B-A3B): Gated DeltaNet layers (their q/k/v/z and b/a
    projections grouped per key head) and gated attention, 3 to 1, and routed experts
    (top 10 of 512) with a gated shared expert in every sparse layer."""

    name = "qwen3_next"
    model_types = ("qwen3_next",)
    sharding = HYBRID_MOE_SHARDING
    divided_dims = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "linear_num_key_heads",
                    "linear_num_value_heads", "num_experts", "shared_expert_intermediate_size", "vocab_size")
    rotary_sections = 0
    eager = frozenset({"Qwen3NextRMSNorm"})
    replacements = (Replacement("Qwen3NextGatedDeltaNet", _prepared_next_gdn, _gdn_state, _fuse_next_gdn_inputs),
                    Replacement("Qwen3NextSparseMoeBlock", prepared_moe, setup=check_moe))

