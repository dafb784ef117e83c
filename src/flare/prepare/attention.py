"""Paged attention: the one module the decoder recipes replace.

The canonical Transformers attention module computes q/k/v, q/k norms and
RoPE; then it calls the registered attention function ``flare_paged`` with a
``paged`` keyword argument (a :class:`PagedBatch`). That function writes the
new keys/values into the page pool at ``slot_mapping`` (negative entries write
nothing) and attends each query token over its own request's pages.

Sliding windows: a layer that Transformers calls with ``sliding_window=W`` (Mistral's
every layer; Qwen2/3, gpt-oss and others per ``layer_types``) attends only to the
keys at positions ``> position - W``, as Transformers' ``sliding_window_overlay``;
every attention path below honours it (``window``, 0 = the whole history).

Tokens are packed: a program hands the model ``T`` tokens, each with its own
request slot and position. Prefill packs one request's chunk; decode packs one
token of each of ``B`` requests. The same function serves both.

KV layout (one buffer for every attention layer; ``module.kv_layer`` indexes it)::

    kv[layer, 0|1, page, offset_in_page, kv_head, head_dim]      0 = K, 1 = V
    slot_mapping = page * page_size + offset_in_page             (-1 = no write)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "flare_paged"
# The state buffer of a CUDA core's ticket counters (kernels/gemv.py's ``TICKET_COUNTERS``, which
# the routers of decode steps and the attention's decode launches take too; ``plan.GEMV_TICKETS``)
TICKETS_BUFFER = "gemv.tickets"


@dataclass
class PagedBatch:
    kv: torch.Tensor  # [L, 2, P, page_size, KVH, D]
    page_table: torch.Tensor  # [S, max_pages] int32, row per request slot
    token_slot: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, -1 for rows that must not write
    valid: torch.Tensor  # [T] bool
    impl: str = "reference"  # "reference" (eager), "gather" (capture-safe torch), "triton" (CUDA kernels)
    # Every valid row belongs to token_slot[0] (a prefill chunk): kernels may tile
    # query tokens. The Triton kernels stay correct when it is wrong; gather relies on it.
    single_slot: bool = False
    # Rows come in runs of one slot (a pack of prefill chunks): the Triton kernel may tile
    # query tokens; it checks each tile's slots and takes a tile of mixed slots token by token.
    tiles: bool = False
    # Per-slot recurrent state of the model (``manifest.continuation``), by buffer name:
    # recurrent layers read and write their rows; attention never touches it.
    state: dict[str, torch.Tensor] | None = None
    # A verify program: rows come in runs of ``verify_width`` positions of one slot each
    # (row b * W + j is slot b's j-th position). Recurrent layers then leave the slots' state
    # as it is and write the state after each position into ``verify_state`` (by state buffer
    # name, [B, W, *row]); the program's commit keeps the accepted position's.
    verify_width: int = 0
    verify_state: dict[str, torch.Tensor] | None = None
    # Zeroed int32 ticket counters that every call leaves at zero (a CUDA core's
    # ``gemv.tickets``): a Triton decode launch folds its splits in its last program with them.
    tickets: torch.Tensor | None = None

    @property
    def page_size(self) -> int:
        return self.kv.shape[3]


QUERY_TILE_ROWS = 64  # query rows (tokens x padded heads of one kv head) per tiled attention program


def query_tile_tokens(heads: int, kv_heads: int, rows: int | None = None) -> int:
    """Tokens per tile when the Triton kernel tiles query tokens (kernels/paged_attention.py):
    its ``rows`` (default ``QUERY_TILE_ROWS``) over the kv head's query heads, padded to a
    power of two."""
    group = max(1, heads // kv_heads)
    return max(1, (rows or QUERY_TILE_ROWS) // (1 << (group - 1).bit_length()))


def write_kv(batch: PagedBatch, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter the chunk's keys/values (``[T, KVH, D]``) into the page pool.

    Rows with a negative slot mapping are redirected into the null page (page
    0), which is never allocated to a request and never read for a valid
    token, so a padded row changes no state anybody can observe. This keeps the
    scatter capture-safe: no boolean indexing, no host synchronisation.
    """
    kv = batch.kv
    flat_k = kv[layer, 0].view(-1, kv.shape[-2], kv.shape[-1])
    flat_v = kv[layer, 1].view(-1, kv.shape[-2], kv.shape[-1])
    # Null page is page 0: its rows are garbage by contract. Padded rows write there.
    dst = torch.where(batch.slot_mapping >= 0, batch.slot_mapping, torch.zeros_like(batch.slot_mapping))
    flat_k.index_copy_(0, dst, k.to(flat_k.dtype))
    flat_v.index_copy_(0, dst, v.to(flat_v.dtype))


def visible(keys: torch.Tensor, pos: torch.Tensor, window: int) -> torch.Tensor:
    """``[rows, keys]``: which key positions each query position attends to."""
    seen = keys[None, :] <= pos[:, None]
    return seen & (keys[None, :] > pos[:, None] - window) if window else seen


def attend_reference(batch: PagedBatch, layer: int, q: torch.Tensor, scaling: float,
                     window: int = 0) -> torch.Tensor:
    """Eager attention over the page pool. ``q``: ``[T, H, D]`` -> ``[T, H, D]``.

    Reads lengths on the host, so it is for the reference executor only (never
    captured). Each request's keys are gathered from its pages up to its
    furthest query position; token ``i`` sees positions ``<= positions[i]``.
    """
    kv = batch.kv
    ps = kv.shape[3]
    out = torch.zeros_like(q)
    valid = batch.valid
    slots = batch.token_slot[valid].unique().tolist()
    for s in slots:
        rows = torch.nonzero(valid & (batch.token_slot == s)).flatten()
        pos = batch.positions[rows]
        n_keys = int(pos.max()) + 1
        n_pages = -(-n_keys // ps)
        pages = batch.page_table[s, :n_pages].long()
        k = kv[layer, 0].index_select(0, pages).reshape(n_pages * ps, kv.shape[-2], kv.shape[-1])[:n_keys]
        v = kv[layer, 1].index_select(0, pages).reshape(n_pages * ps, kv.shape[-2], kv.shape[-1])[:n_keys]
        mask = visible(torch.arange(n_keys, device=q.device), pos, window)  # [r, n_keys]
        o = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None].to(k.dtype),  # [1, H, r, D]
            k.transpose(0, 1)[None],  # [1, KVH, n, D]
            v.transpose(0, 1)[None],
            attn_mask=mask[None, None],
            scale=scaling,
            enable_gqa=True,
        )
        out[rows] = o[0].transpose(0, 1).to(out.dtype)
    return out


def attend_gather(batch: PagedBatch, layer: int, q: torch.Tensor, scaling: float, window: int = 0) -> torch.Tensor:
    """Capture-safe attention in plain torch: gathers every page of the slot's page
    table (the whole context capacity) and masks by position. Memory and time grow
    with the context limit, not the history, so it is a fallback and a GPU
    cross-check for the Triton kernels, not the fast path."""
    kv = batch.kv
    L, _, P, ps, kvh, d = kv.shape
    T = q.shape[0]
    keys = torch.arange(batch.page_table.shape[1] * ps, device=q.device)
    if batch.single_slot:
        pages = batch.page_table.index_select(0, batch.token_slot[:1]).long()[0]  # [MP]
        k = kv[layer, 0].index_select(0, pages).reshape(-1, kvh, d)  # [MP*ps, KVH, D]
        v = kv[layer, 1].index_select(0, pages).reshape(-1, kvh, d)
        mask = visible(keys, batch.positions, window) & batch.valid[:, None]  # [T, keys]
        mask[:, 0] |= ~batch.valid  # padded rows attend to one key: finite output
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None].to(k.dtype), k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask[None, None], scale=scaling, enable_gqa=True)
        return o[0].transpose(0, 1).to(q.dtype)
    pages = batch.page_table.index_select(0, batch.token_slot).long()  # [T, MP]
    k = kv[layer, 0][pages].reshape(T, -1, kvh, d)  # [T, MP*ps, KVH, D]
    v = kv[layer, 1][pages].reshape(T, -1, kvh, d)
    # Padded rows attend to key 0 (a finite output); valid rows see their window only.
    mask = visible(keys, batch.positions, window) | ((keys[None, :] == 0) & ~batch.valid[:, None])  # [T, keys]
    o = F.scaled_dot_product_attention(
        q[:, :, None, :].to(k.dtype), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None, None, :], scale=scaling, enable_gqa=True)  # [T, H, 1, D]
    return o[:, :, 0, :].to(q.dtype)


@torch.compiler.disable
def flare_paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, paged=None, **kwargs):
    """Transformers attention-interface entry. Excluded from torch.compile: the compiled
    regions end and resume around it, so the KV pool (mutated in place by the writes)
    never becomes a compiled graph's input and no layer index is specialised on.
    Shapes: query ``[1, H, T, D]``, key/value ``[1, KVH, T, D]``; returns ``([1, T, H, D], None)``."""
    if paged is None:
        raise RuntimeError("flare_paged attention needs the 'paged' batch argument")
    layer = module.kv_layer  # index into the kv buffer (set by the recipe: not every layer attends)
    window = int(kwargs.get("sliding_window") or 0)  # this layer's, as Transformers passes it
    rotary = kwargs.get("flare_qk_rotary")
    if rotary is not None:
        # (fused forwards) query/key/value are the projection's [B, T, H, D] views before the
        # per-head norms and the rotary: those and the write of the keys and values to the pages
        # are one launch (``rownorm.qk_norm_rotary`` with ``pages``), or, where it does not
        # apply, the norms' and rotary's own launch before the write as below.
        from flare.prepare.kernels import rownorm

        cos, sin = rotary
        q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
        if paged.impl == "triton":
            q = rownorm.qk_norm_rotary(q_norm, k_norm, query, key, cos, sin, pages=(value, paged, layer))
            if q is not None:
                from flare.prepare.kernels.paged_attention import attend_triton

                return attend_triton(paged, layer, q[0], scaling, window=window)[None], None
        if q_norm is None:  # (the module's own rotary)
            query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
            query, key = module.flare_rotary(query, key, cos, sin)
        else:
            fused = rownorm.qk_norm_rotary(q_norm, k_norm, query, key, cos, sin)
            if fused is None:
                raise RuntimeError("flare_qk_rotary passed where rownorm.qk_norm_rotary does not apply")
            query, key, value = fused[0].transpose(1, 2), fused[1].transpose(1, 2), value.transpose(1, 2)
    q = query[0].transpose(0, 1)
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    if paged.impl == "triton":
        from flare.prepare.kernels.kv_write import write_kv_triton
        from flare.prepare.kernels.paged_attention import attend_triton

        write_kv_triton(paged, layer, k, v)
        out = attend_triton(paged, layer, q, scaling, window=window)
    elif paged.impl == "gather":
        write_kv(paged, layer, k, v)
        out = attend_gather(paged, layer, q, scaling, window)
    else:
        write_kv(paged, layer, k, v)
        out = attend_reference(paged, layer, q, scaling, window)
    return out[None], None


AttentionInterface.register(ATTENTION_NAME, flare_paged_attention)
