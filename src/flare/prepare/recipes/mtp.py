"""Multi-token prediction (MTP) heads: the learned drafter some checkpoints carry beside the
model (Qwen3.5 ``mtp_num_hidden_layers``, Qwen3-Next ``num_nextn_predict_layers``; the
weights under ``mtp.``), for speculative decoding (``flare-prepare --mtp``, issue 20).

The head predicts the token after next. Its input for the token at position t is that token
and the target model's final-normed hidden vector at t - 1 (which predicted it)::

    x = fc([pre_fc_norm_embedding(embed(token[t])), pre_fc_norm_hidden(hidden[t - 1])])
    x = layers[0](x at position t)          # a full-attention decoder layer of the model's kind
    out = norm(x)                           # lm_head(out): the logits of token t + 1

Its decoder layer attends like every other attention layer: it owns one more KV layer of the
page pool (after the model's own), and the head's row for token t lies in t's own KV row, so
every program that consumes tokens writes the head's rows with the model's, at the same
positions and in the same pages (``programs.ProgramSet._mtp_rows``; the hidden vector before a
program's first token of a slot is the slot's saved one). vLLM places input t at position
t - 1 instead; a uniform shift leaves rotary attention unchanged, and this way no row of the
head waits for a later program (which would write into a page a prefix-cache hit shares).
The first token of a history has no hidden vector before it: its row takes zeros (the slot's
state after admission) where vLLM has no row at all, one more key the head attends to. A
verify program then chains the head from the last emitted token: greedy drafts for the
request's next step, each fed the head's own output and the draft before it (as vLLM and
SGLang chain one MTP layer).

The embedding and the LM head are the model's own (the checkpoints share them).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

# Config keys that declare MTP layers, by family.
MTP_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


def declared_layers(config) -> int:
    """MTP layers the model's config declares (0: none)."""
    text = config.get_text_config()
    return max(int(getattr(text, k, 0) or 0) for k in MTP_KEYS)


def without_mtp(config) -> None:
    """Drop the declaration (in place): the core is prepared without the head."""
    for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
        for k in MTP_KEYS:
            if getattr(cfg, k, None):
                setattr(cfg, k, 0)


class MtpHead(nn.Module):
    """One MTP layer, built from the model's own classes: its full-attention decoder layer
    (with the model's MLP or experts) and its RMS norm."""

    def __init__(self, model: nn.Module, config, dtype: torch.dtype):
        super().__init__()
        text = config.get_text_config()
        inner = model.model
        layer_cls = type(next(layer for layer in inner.layers if hasattr(layer, "self_attn")))
        norm_cls = type(inner.norm)
        cfg = copy.deepcopy(text)
        cfg.layer_types = ["full_attention"]  # the head's one layer is layer 0 of its own stack
        cfg._attn_implementation = text._attn_implementation
        hidden, eps = text.hidden_size, text.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=eps)
        self.layers = nn.ModuleList([layer_cls(cfg, 0)])
        self.norm = norm_cls(hidden, eps=eps)
        self.to(dtype)


def attach(model: nn.Module, config, dtype: torch.dtype) -> None:
    """Give the prepared model its head as ``model.mtp`` (weights ``mtp.*``, as checkpoints
    name them)."""
    if declared_layers(config) != 1:
        raise ValueError(f"the config declares {declared_layers(config)} MTP layers; Flare chains exactly one")
    model.mtp = MtpHead(model, config, dtype)


def forward(model: nn.Module, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
            batch, rotary_sections: int = 0) -> torch.Tensor:
    """The head's final-normed output ``[T, H]`` for inputs (``tokens[r]``, ``hidden[r]``: the
    hidden vector before that token) at ``positions[r]``; its attention writes and reads the
    head's KV layer through ``batch``."""
    head, inner = model.mtp, model.model
    x = torch.cat([head.pre_fc_norm_embedding(inner.embed_tokens(tokens)), head.pre_fc_norm_hidden(hidden)], -1)
    x = head.fc(x)[None]
    pos = positions[None]
    # The rotary table takes position ids as the model's forward hands them: one row per
    # multimodal section where the model has them (Qwen3.5: three, all equal for text).
    ids = pos[None].expand(rotary_sections, -1, -1) if rotary_sections else pos
    x = head.layers[0](x, position_embeddings=inner.rotary_emb(x, ids), attention_mask=None, position_ids=pos,
                       paged=batch)
    return head.norm(x)[0]
