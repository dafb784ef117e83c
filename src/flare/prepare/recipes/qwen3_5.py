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

A prefill chunk (one slot) runs the canonical chunked delta rule from the
slot's state over the chunk; tokens past the chunk's count enter with zero
q/k/v, zero decay and zero beta, which leaves the recurrence unchanged, and the
convolution history is cut at the count. A decode batch runs one recurrent
step per row from that row's own state; rows that are not live (padding,
finished requests) keep their state bitwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flare.core.manifest import DType
from flare.prepare.attention import PagedBatch
from flare.prepare.recipes.base import KVGeometry, Recipe, Replacement, StateBuffer

CONV_STATE = "state.gdn.conv"
RECURRENT_STATE = "state.gdn.recurrent"
LINEAR = "linear_attention"


def _prepared_gdn(base: type) -> type:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as q

    class PagedGatedDeltaNet(base):
        """Qwen3.5's Gated DeltaNet over packed tokens and per-slot state rows.
        ``state_index`` (set by the recipe base) is this layer's index among GDN layers."""

        state_index: int

        def forward(self, hidden_states, cache=None, attention_mask=None, paged: PagedBatch | None = None, **kwargs):
            if paged is None or paged.state is None:
                raise RuntimeError("PagedGatedDeltaNet needs the 'paged' batch with state buffers")
            x = hidden_states[0]  # [T, H]
            T = x.shape[0]
            conv_rows = paged.state[CONV_STATE].select(1, self.state_index)  # [rows, conv_dim, K-1]
            rec_rows = paged.state[RECURRENT_STATE].select(1, self.state_index)  # [rows, Hv, Dk, Dv]
            valid = paged.valid
            mixed = self.in_proj_qkv(x)  # [T, conv_dim]
            z = self.in_proj_z(x).reshape(T, -1, self.head_v_dim)
            b = self.in_proj_b(x)
            a = self.in_proj_a(x)
            weight = self.conv1d.weight  # [conv_dim, 1, K]
            history = self.conv_kernel_size - 1
            if paged.single_slot:
                slot = paged.token_slot[:1]
                conv = conv_rows.index_select(0, slot)[0]  # [conv_dim, K-1]
                seq = torch.cat([conv, mixed.transpose(0, 1).to(conv.dtype)], dim=1)  # [conv_dim, K-1+T]
                out = F.conv1d(seq[None].to(weight.dtype), weight, self.conv1d.bias, groups=self.conv_dim)[0]
                count = valid.sum()
                keep = torch.arange(history, device=x.device) + count  # the last K-1 valid inputs
                conv_rows.index_copy_(0, slot, seq.index_select(1, keep)[None])
                mixed = F.silu(out).transpose(0, 1).to(x.dtype)  # [T, conv_dim]
            else:
                slots = paged.token_slot
                conv = conv_rows.index_select(0, slots)  # [T, conv_dim, K-1]
                seq = torch.cat([conv, mixed[:, :, None].to(conv.dtype)], dim=2)  # [T, conv_dim, K]
                out = F.conv1d(seq.to(weight.dtype), weight, self.conv1d.bias, groups=self.conv_dim)[:, :, 0]
                conv_rows.index_copy_(0, slots, torch.where(valid[:, None, None], seq[:, :, 1:], conv))
                mixed = F.silu(out).to(x.dtype)
            query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
            query = query.reshape(T, -1, self.head_k_dim)
            key = key.reshape(T, -1, self.head_k_dim)
            value = value.reshape(T, -1, self.head_v_dim)
            beta = b.sigmoid()
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
            # Rows that are not valid enter with zero inputs, zero decay and zero beta:
            # the recurrence passes through them unchanged.
            m = valid[:, None]
            query, key, value = (torch.where(m[:, :, None], t, torch.zeros_like(t)) for t in (query, key, value))
            beta = torch.where(m, beta, torch.zeros_like(beta))
            g = torch.where(m, g, torch.zeros_like(g))
            if paged.single_slot:
                initial = rec_rows.index_select(0, slot)  # [1, Hv, Dk, Dv]
                core, final = q.torch_chunk_gated_delta_rule(
                    query[None], key[None], value[None], g=g[None], beta=beta[None], initial_state=initial,
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
                rec_rows.index_copy_(0, slot, final.to(rec_rows.dtype))
                core = core[0]
            else:
                initial = rec_rows.index_select(0, slots)  # [T, Hv, Dk, Dv]
                core, final = q.torch_recurrent_gated_delta_rule(
                    query[:, None], key[:, None], value[:, None], g=g[:, None], beta=beta[:, None],
                    initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)
                rec_rows.index_copy_(0, slots, torch.where(valid[:, None, None, None], final.to(rec_rows.dtype),
                                                           initial))
                core = core[:, 0]
            core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
            return self.out_proj(core.reshape(1, T, -1))

    return PagedGatedDeltaNet


def _gdn_state(config, dtype: DType) -> list[StateBuffer]:
    t = config.get_text_config()
    layers = sum(1 for kind in t.layer_types if kind == LINEAR)
    conv_dim = 2 * t.linear_num_key_heads * t.linear_key_head_dim + t.linear_num_value_heads * t.linear_value_head_dim
    return [
        StateBuffer(CONV_STATE, dtype, (layers, conv_dim, t.linear_conv_kernel_dim - 1)),
        # The delta rule accumulates in float32 whatever the model dtype (as Transformers does).
        StateBuffer(RECURRENT_STATE, DType.float32,
                    (layers, t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim)),
    ]


class Qwen35Recipe(Recipe):
    name = "qwen3_5"
    model_types = ("qwen3_5", "qwen3_5_text")
    # Gated attention (its q_proj also produces the output gate) and the MLP run as
    # written; no tensor-parallel sharding is declared yet.
    eager = frozenset({"Qwen3_5RMSNorm", "Qwen3_5Attention", "Qwen3_5MLP"})
    replacements = (Replacement("Qwen3_5GatedDeltaNet", _prepared_gdn, _gdn_state),)

    def kv_geometry(self, config, tp_size: int = 1) -> KVGeometry:
        t = config.get_text_config()
        attn = sum(1 for kind in t.layer_types if kind != LINEAR)
        return KVGeometry(attn, t.num_key_value_heads, t.head_dim)
