"""Fused projections: one GEMM for q/k/v and one for gate/up in each decoder layer.

A decode step reads every weight once; what it costs beyond that is launches
and GEMMs too small to stream at the copy bandwidth. On the Llama-3.1-8B shape
cuBLAS ran k_proj and v_proj (8 MB each) at about 1 TB/s, split-K with a reduce
kernel after each (bench/results/timeline-llama-3.1-8b-shape-2026-11-29.json).
Concatenating the weights that share an input turns three launches into one
larger GEMM and two into one, with the same bytes read.

The fused weight is one arena buffer; its rows are the checkpoint tensors in
order (``parts``), so loading writes each checkpoint tensor into its rows and
tensor parallelism slices each part by its own heads or intermediate rows
(a rank's buffer is ``[q_r; k_r; v_r]``). The module's own forward is replaced
by one that mirrors Transformers' decoder attention / MLP with the projection
fused; only module classes whose forward is known to have exactly this shape
are fused (``ATTENTION_FORWARDS``, ``MLP_CLASSES``); anything else keeps its own
modules and forward (and the recipe base then requires it to be declared eager).
Recipes fuse the projections of their prepared modules with ``fuse_linears``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

# Transformers MLP classes whose forward is gate/up -> act * up -> down.
MLP_CLASSES = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Qwen3_5MLP", "Qwen3MoeMLP", "Qwen3_5MoeMLP", "Qwen3NextMLP"})
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


@dataclass(frozen=True)
class Part:
    """One checkpoint module whose weight rows a fused projection holds."""

    module: str  # attribute name in the owning module, e.g. "k_proj"
    rows: int  # output features of the unsharded module (a TP rank holds rows // tp_size: ``sizes``)


class FusedLinear(nn.Module):
    """``F.linear`` over row-concatenated weights (and biases) of ``parts``; its output
    is the parts' outputs side by side, in order."""

    def __init__(self, parts: tuple[Part, ...], in_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.parts = parts
        rows = sum(p.rows for p in parts)
        self.weight = nn.Parameter(torch.empty(rows, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(rows, dtype=dtype), requires_grad=False) if bias else None

    @property
    def sizes(self) -> list[int]:
        """Output features of each part in the bound weight: a tensor-parallel rank holds
        the same fraction of every part (``parts`` keeps the unsharded counts)."""
        ranks = sum(p.rows for p in self.parts) // self.weight.shape[0]
        return [p.rows // ranks for p in self.parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def fuse_linears(owner: nn.Module, names: tuple[str, ...], fused_name: str) -> bool:
    """Replace ``owner``'s Linear children ``names`` (one input, all with or all without a
    bias) by one FusedLinear ``fused_name``; False (nothing changed) when they do not fit."""
    mods = [getattr(owner, n, None) for n in names]
    if not all(isinstance(m, nn.Linear) for m in mods):
        return False
    if len({m.in_features for m in mods}) != 1 or len({m.bias is None for m in mods}) != 1:
        return False
    first = mods[0]
    fused = FusedLinear(tuple(Part(n, m.out_features) for n, m in zip(names, mods)), first.in_features,
                        first.bias is not None, first.weight.dtype)
    for n in names:
        delattr(owner, n)
    owner.add_module(fused_name, fused)
    return True


# Attention classes whose Transformers forward passes ``config.sliding_window`` on every
# layer (whatever ``layer_types`` says); the others pass their own ``sliding_window``
# attribute (Qwen2/Qwen3: set on windowed layers only) or nothing (Llama, Qwen3.5).
CONFIG_WINDOW_CLASSES = frozenset({"MistralAttention", "MixtralAttention"})


def layer_window(attn) -> int | None:
    """The sliding window Transformers' own forward passes for this attention module."""
    if any(c.__name__ in CONFIG_WINDOW_CLASSES for c in type(attn).__mro__):  # the fused subclasses too
        return getattr(attn.config, "sliding_window", None)
    return getattr(attn, "sliding_window", None)


def kv_window(model) -> int | None:
    """The manifest's ``pages.kv_window``: the largest window of the attention layers that own KV
    pages (``kv_layer``), as their forwards pass it to the paged attention; None where one of them
    reads its whole history (or none owns KV): then no page ever leaves every layer's window. Only
    the fused forwards here pass ``layer_window``; a layer on another forward (Transformers' own,
    which may keep a ``sliding_window`` attribute it never passes) counts as reading its whole history."""
    ours = (_attention_forward, _gated_attention_forward)
    windows = [int(layer_window(m) or 0) if type(m).forward in ours else 0
               for m in model.modules() if hasattr(m, "kv_layer")]
    return max(windows) if windows and min(windows) > 0 else None


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """Transformers' decoder attention forward (Llama / Mistral / Qwen2 / Qwen3) with one
    q/k/v GEMM. Flare never passes a KV cache object: the paged attention function
    writes and reads the page pool itself."""
    from flare.prepare.attention import flare_paged_attention

    kwargs.pop("cache", None)
    kwargs.pop("past_key_values", None)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, k, v = self.qkv_proj(hidden_states).split(self.qkv_proj.sizes, dim=-1)
    q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)
    cos, sin = position_embeddings
    # Qwen3: RMSNorm per head before rotary; in a step whose norms are single launches, the two
    # norms and the rotary in one (``rownorm.qk_norm_rotary``), with the write of the keys and
    # values to the pages on the CUDA path (``_qk_norm_rotary``)
    # (a module's rotary was checked over whole heads: a partial one keeps its own code)
    fused = _qk_norm_rotary(self, q, k, cos, sin, kwargs) if cos.shape[-1] == self.head_dim else None
    if isinstance(fused, str):  # "pages"
        out, weights = flare_paged_attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                                             sliding_window=layer_window(self), flare_qk_rotary=(cos, sin), **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights
    if fused is not None:
        q, k = fused[0].transpose(1, 2), fused[1].transpose(1, 2)
        v = v.transpose(1, 2)
    else:
        if getattr(self, "q_norm", None) is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.flare_rotary(q, k, cos, sin)
    out, weights = flare_paged_attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                                         sliding_window=layer_window(self), **kwargs)
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def _qk_norm_rotary(attn, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kwargs: dict):
    """(q, k) ``[B, T, H, D]`` normalised per head and rotated in one launch
    (``rownorm.qk_norm_rotary``) where the attention's rotary is ``rotate_half``'s
    (``flare_rotate_half``: the fused gated forward's ``rotary_without_cat``, or a module's own
    ``apply_rotary_pos_emb`` found to compute it, ``fuse_projections``) and the step's norms allow;
    "pages" where that launch also writes the keys and values to the page pool (the Triton
    attention's: the attention function takes the raw q, k and v then, ``flare_qk_rotary``), which
    an attention without q/k norms (Llama's) takes in decode and verify steps for its rotary;
    None elsewhere."""
    from flare.prepare.kernels import rownorm

    if not getattr(attn, "flare_rotate_half", False):
        return None
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    paged = kwargs.get("paged")
    if paged is not None and paged.impl == "triton":
        return "pages" if rownorm.qk_norm_rotary_applies(q_norm, k_norm, q, k, cos, sin) else None
    return rownorm.qk_norm_rotary(q_norm, k_norm, q, k, cos, sin) if q_norm is not None else None


def rotates_half(rotary) -> bool:
    """Whether ``rotary(q, k, cos, sin)`` (a Transformers module's ``apply_rotary_pos_emb``, heads
    on dim 1, ``cos``/``sin`` ``[B, T, D]``) is ``rotary_without_cat`` of q and k over the whole
    head: tried once on float64 values (its code is the model's, not known here)."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    cos, sin = (torch.randn(1, 3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    try:
        got = rotary(q, k, cos, sin)
    except Exception:
        return False
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return (isinstance(got, tuple) and len(got) == 2
            and all(isinstance(t, torch.Tensor) and t.shape == x.shape and torch.equal(t, rotary_without_cat(x, c, s))
                    for t, x in zip(got, (q, k))))


def rotary_without_cat(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Transformers' rotary embedding of the first ``r = cos.shape[-1]`` dims of each head
    (``rotate_half`` pairs: d with d + r/2), the other dims passed through, as one expression
    without ``torch.cat``: ``x * cos' + x[partner] * sign * sin'``, ``cos'`` and ``sin'`` padded
    to the head with 1 and 0, the passed dims selected as they are. The same products and sums,
    so the same bits eagerly; compiled,
    the per-head RMSNorm before it and this fuse into one kernel where Transformers' partial
    rotary (``cat([rotated, passed])`` around ``cat((-x2, x1))``) made Inductor emit a
    reduction and two pointwise kernels for each of q and k (the H200 timelines)."""
    r, d = cos.shape[-1], x.shape[-1]
    half = r // 2
    dims = torch.arange(d, device=x.device)
    partner = torch.where(dims < half, dims + half, torch.where(dims < r, dims - half, dims))
    sign = torch.where(dims < half, -1.0, 1.0).to(x.dtype)
    cos = F.pad(cos, (0, d - r), value=1.0)
    sin = F.pad(sin, (0, d - r), value=0.0)
    return torch.where(dims < r, x * cos + x[..., partner] * sign * sin, x)  # passed dims as they are


def _gated_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """Qwen3.5's gated attention forward with one q/k/v GEMM: ``q_proj`` yields each head's
    query followed by its output gate; the attention output is scaled by sigmoid(gate)
    before ``o_proj``. Its partial rotary embedding (Qwen3.5, Qwen3-Next: non-interleaved) is
    ``rotary_without_cat``; the gate stays a view of the projection until that product (a
    reshape of it would copy it in a kernel of its own)."""
    from flare.prepare.attention import flare_paged_attention

    kwargs.pop("cache", None)
    kwargs.pop("past_key_values", None)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q_gate, k, v = self.qkv_proj(hidden_states).split(self.qkv_proj.sizes, dim=-1)
    q, gate = torch.chunk(q_gate.view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
    cos, sin = position_embeddings
    # (in a step whose norms are single launches, the two norms and the rotary in one, and with
    # them the write of the keys and values on the CUDA path)
    fused = _qk_norm_rotary(self, q, k.view(hidden_shape), cos, sin, kwargs)
    if isinstance(fused, str):  # "pages"
        out, weights = flare_paged_attention(self, q, k.view(hidden_shape), v.view(hidden_shape), attention_mask,
                                             dropout=0.0, scaling=self.scaling, sliding_window=layer_window(self),
                                             flare_qk_rotary=(cos, sin), **kwargs)
        out = (out.reshape(hidden_shape) * torch.sigmoid(gate)).reshape(*input_shape, -1)
        return self.o_proj(out), weights
    if fused is not None:
        q, k = fused[0].transpose(1, 2), fused[1].transpose(1, 2)
    else:
        q = self.q_norm(q.reshape(hidden_shape)).transpose(1, 2)
        k = self.k_norm(k.view(hidden_shape)).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # over the heads, as Transformers' unsqueeze_dim=1
        q, k = rotary_without_cat(q, cos, sin), rotary_without_cat(k, cos, sin)
    v = v.view(hidden_shape).transpose(1, 2)
    out, weights = flare_paged_attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                                         sliding_window=layer_window(self), **kwargs)
    out = (out.reshape(hidden_shape) * torch.sigmoid(gate)).reshape(*input_shape, -1)
    return self.o_proj(out), weights


# The projection of a fused mixer forward that alone reads its input (a decoder layer's input
# norm's output), which may take that norm in its loads (``input_norm_projections``).
_attention_forward.flare_input_projection = "qkv_proj"
_gated_attention_forward.flare_input_projection = "qkv_proj"


# Transformers attention classes by the fused forward that mirrors theirs: q/k/v projections
# (+ optional per-head q/k RMSNorm) -> rotary -> attention (-> output gate) -> o_proj.
ATTENTION_FORWARDS = {
    "LlamaAttention": _attention_forward,
    "MistralAttention": _attention_forward,
    "Qwen2Attention": _attention_forward,
    "Qwen3Attention": _attention_forward,
    "Qwen3MoeAttention": _attention_forward,
    "Qwen3_5Attention": _gated_attention_forward,
    "Qwen3_5MoeAttention": _gated_attention_forward,
    "Qwen3NextAttention": _gated_attention_forward,
}


# Transformers' SiLU activations by class name (the Triton kernels compute silu themselves).
SILU_ACTS = ("SiLU", "SiLUActivation")


def hooked(module: nn.Module) -> bool:
    """Whether a forward hook, the module's own or a global one, would see its calls (a
    tensor-parallel all-reduce, for one): a fold that bypasses its forward would skip it."""
    from torch.nn.modules import module as M

    return bool(M._global_forward_hooks or M._global_forward_pre_hooks or module._forward_hooks
                or module._forward_pre_hooks)


def _mlp_forward(self, x, residual=None):
    """gate/up -> act(gate) * up -> down (``+ residual`` when given: ``mlp_residual``)."""
    down, rows = self.down_proj, x.numel() // x.shape[-1]
    # A decode step whose down projection takes the few-row GEMV (``--step-gemms measure``)
    # computes silu(gate) * up in that GEMV's loads (not the tensor-core tile's: ``folds_swiglu``),
    # and the residual add after it: a launch fewer each. Not under a forward hook (a
    # tensor-parallel all-reduce), the module's own or a global one, which the GEMV would bypass.
    fold_tiling = getattr(down, "flare_fold_tiling", None)
    tiling = fold_tiling(rows) if fold_tiling is not None and _folds(self) and not hooked(down) else None
    # Where the down projection does not take the activation in its loads, the gate/up projection's
    # tensor-core GEMV may compute it in its epilogue (``gemm.GLU_TILINGS``): a launch fewer.
    glu = getattr(self.gate_up_proj, "flare_glu_tiling", None)
    if glu is not None and (tiling is None or not down.flare_loads_act(tiling)) and _folds(self) \
            and not hooked(self.gate_up_proj):
        glu_tiling = glu(rows)
        if glu_tiling is not None:
            return _act_down(self, self.gate_up_proj.flare_glu(x, glu_tiling), tiling, residual)
    gate_up = self.gate_up_proj(x)
    if tiling is not None:
        return down.flare_swiglu_down(gate_up, tiling, residual)
    gate, up = gate_up.split(self.gate_up_proj.sizes, dim=-1)
    out = down(self.act_fn(gate) * up)
    return out if residual is None else residual + out


def _act_down(mlp: nn.Module, act: torch.Tensor, tiling, residual: torch.Tensor | None) -> torch.Tensor:
    """The down projection of the activation its gate/up GEMV computed (``_mlp_forward``): on its
    own GEMV ``tiling`` with ``residual`` in the epilogue, or as the layer is (the add apart)."""
    if tiling is not None:
        return mlp.down_proj.flare_act_down(act, tiling, residual)
    out = mlp.down_proj(act)
    return out if residual is None else residual + out


def _norm_glu(norm: nn.Module, mlp: nn.Module, residual: torch.Tensor, x: torch.Tensor):
    """(gate/up GLU tiling, ``gemv.Norm``, down projection's fold tiling) where a step's
    ``norm(residual + x)`` goes into the loads of the MLP's gate/up GEMV (``add_norm_mlp``): a
    fused gated SiLU MLP whose gate/up projection takes the norm at this row count
    (``flare_norm_glu_tiling``) and whose down projection leaves it the activation, a norm that
    offers itself (``flare_gemv_norm``, a step's row-invariant norm), no forward hook on the norm,
    the MLP or its gate/up projection; None elsewhere. A hooked down projection (a tensor-parallel
    all-reduce) runs as its module, the add after it (as ``_mlp_forward`` has it)."""
    if type(mlp).forward is not _mlp_forward or getattr(norm, "flare_gemv_norm", None) is None:
        return None
    up = mlp.gate_up_proj
    norm_tiling = getattr(up, "flare_norm_glu_tiling", None)
    if norm_tiling is None or not _folds(mlp) or hooked(mlp) or hooked(up) or hooked(norm):
        return None
    rows = x.numel() // x.shape[-1]
    fold_tiling = getattr(mlp.down_proj, "flare_fold_tiling", None)
    down = fold_tiling(rows) if fold_tiling is not None and not hooked(mlp.down_proj) else None
    tiling = norm_tiling(rows)
    if tiling is None or (down is not None and mlp.down_proj.flare_loads_act(down)):
        return None
    spec = norm.flare_gemv_norm(x, residual)
    return None if spec is None else (tiling, spec, down)


def add_norm_mlp(norm: nn.Module, mlp: nn.Module, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A decoder layer's residual add after its attention, the norm before its MLP, the MLP and
    the residual add after it (``add_norm`` then ``mlp_residual``). In a step where the MLP's
    gate/up GEMV takes the norm in its loads (``_norm_glu``) the add and the norm go into that
    launch, which also writes the sum, the down projection's residual: a launch fewer; so does a
    mixture-of-experts block's router launch in a decode step (``flare_norm_residual_forward``).
    An MLP that returns a tuple (Qwen3.5-MoE's, Qwen3-Next's: ``add_norm_moe``) gives its first
    element."""
    fold = _norm_glu(norm, mlp, residual, x)
    if fold is not None:
        tiling, spec, down = fold
        act, total = mlp.gate_up_proj.flare_norm_glu(x, tiling, spec)
        return _act_down(mlp, act, down, total)
    # (a mixture-of-experts block: its router's and experts' launches, in a decode step)
    normed = getattr(mlp, "flare_norm_residual_forward", None)
    out = normed(norm, residual, x) if normed is not None and not hooked(mlp) else None
    if out is not None:
        return out
    h, total = add_norm(norm, residual, x)
    return mlp_residual(mlp, h, total)


def _folds(mlp: nn.Module) -> bool:
    """Whether a fused gated MLP's down projection may take the GEMV's folds (``_mlp_forward``)."""
    return (type(mlp).forward is _mlp_forward and type(mlp.act_fn).__name__ in SILU_ACTS
            and mlp.gate_up_proj.sizes[0] == mlp.gate_up_proj.sizes[1])


def _rewrites(layer: nn.Module) -> frozenset[str]:
    """The names of the rewrites ``_rewritten_forward`` made in the layer's forward (under the
    wrappers Transformers' classes put around a forward)."""
    import inspect

    return getattr(inspect.unwrap(type(layer).forward), "flare_rewrites", frozenset())


def residual_down_projections(layers) -> list[nn.Module]:
    """The down projections under ``layers`` that add their decoder layer's residual in a step
    where they take the GEMV (a layer whose forward ``_rewritten_forward`` rewrote with
    ``mlp_residual``, over a fused gated MLP): elsewhere the add is a kernel of its own.
    ``--step-gemms measure`` counts that kernel against the products that leave it
    (``gemm.step_choice``'s ``residual_fold``)."""
    def rewritten(layer) -> bool:
        return bool({"mlp_residual", "add_norm_mlp", "add_norm_moe", "moe_residual"} & _rewrites(layer))

    # (a forward hook on the MLP or its down projection, a tensor-parallel all-reduce, keeps the
    # add apart: ``mlp_residual`` and ``_mlp_forward``)
    mlps = [(layer, getattr(layer, "mlp", None)) for layer in layers]
    return [mlp.down_proj for layer, mlp in mlps
            if mlp is not None and rewritten(layer) and _folds(mlp) and not hooked(mlp) and not hooked(mlp.down_proj)]


def norm_glu_projections(layers) -> list[tuple[nn.Module, nn.Module]]:
    """(gate/up projection, norm) of each gate/up projection (of ``glu_projections``) under
    ``layers`` that may take the norm
    before them, with the residual add before it, in a step's GLU GEMV: their layer's forward was
    rewritten with ``add_norm_mlp`` and its post-attention norm offers itself to a GEMV
    (``flare_gemv_norm``: a step's row-invariant norm, its weight in the projection's dtype, one
    ``gemv.takes_norm`` takes) with no forward hook: where ``_norm_glu`` takes it in a step."""
    from flare.prepare.kernels.gemv import takes_norm

    out = []
    for layer in layers:
        # (a layer whose MLP is no fused gated MLP, a mixture-of-experts block, has no pair)
        glu, norm = glu_projections([layer]), getattr(layer, "post_attention_layernorm", None)
        up = glu[0][0] if glu else None
        if (up is not None and norm is not None and {"add_norm_mlp", "add_norm_moe"} & _rewrites(layer)
                and getattr(norm, "flare_gemv_norm", None) is not None and norm._one_launch() and not hooked(norm)
                and norm.weight.dtype == up.weight.dtype and takes_norm(up.weight.shape[1], norm.weight.dtype)):
            out.append((up, norm))
    return out


def input_norm_projections(layers) -> list[tuple[nn.Module, nn.Module, nn.Module]]:
    """(projection, norm, mixer) for each decoder layer under ``layers`` whose input norm may go
    into the loads of a step's GEMV of the one projection that reads its output: the layer's forward
    was rewritten with ``input_norm``, it has one mixer (``self_attn`` or ``linear_attn``) whose
    forward passes its input to that projection alone (``flare_input_projection``: the fused
    attention forwards, the prepared Gated DeltaNet's; the layer's forward must give the norm's
    output to the mixer alone, as every rewritten layer does: a parallel-block layer, whose MLP
    reads it too, has no such mixer), a plain linear layer without bias; the
    norm offers itself to a GEMV (``flare_gemv_norm``: a step's row-invariant norm, its weight in
    the projection's dtype, one ``gemv.takes_norm`` takes); no forward hook on any of the three."""
    from flare.prepare.kernels.gemv import takes_norm

    out = []
    for layer in layers:
        norm = getattr(layer, "input_layernorm", None)
        mixers = [m for m in (getattr(layer, "self_attn", None), getattr(layer, "linear_attn", None)) if m is not None]
        if norm is None or len(mixers) != 1 or "input_norm" not in _rewrites(layer):
            continue
        mixer = mixers[0]
        proj = getattr(mixer, getattr(type(mixer).forward, "flare_input_projection", ""), None)
        if (isinstance(proj, (nn.Linear, FusedLinear)) and proj.bias is None
                and getattr(norm, "flare_gemv_norm", None) is not None
                and norm._one_launch() and norm.weight.dtype == proj.weight.dtype
                and takes_norm(proj.weight.shape[1], proj.weight.dtype)
                and not (hooked(norm) or hooked(mixer) or hooked(proj))):
            out.append((proj, norm, mixer))
    return out


def link_input_norm(proj: nn.Module, norm: nn.Module, mixer: nn.Module | None) -> None:
    """Link a decoder layer's input norm and the projection that may take it in its loads
    (``input_norm_projections``; ``mixer`` None: unlink them): plain attributes outside the
    module tree (a module attribute would register the norm a second time)."""
    object.__setattr__(proj, "_flare_input_norm", None if mixer is None else norm)
    object.__setattr__(norm, "_flare_consumer", None if mixer is None else (mixer, proj))


def input_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A decoder layer's input norm before its mixer: ``norm(x)``, or ``x`` as it is in a step
    where the one projection that reads the norm's output takes the norm in its loads
    (``flare_deferred_norm``, which the projection asks too with the same rows)."""
    deferred = getattr(norm, "flare_deferred_norm", None)
    if deferred is not None and deferred(x) is not None:
        return x
    return norm(x)


def glu_projections(layers) -> list[tuple[nn.Module, nn.Module]]:
    """(gate/up projection, down projection) of each fused gated SiLU MLP under ``layers`` whose
    gate/up projection may take the activation in a step's GEMV epilogue (``_mlp_forward``: not
    under a forward hook, the MLP's or the projection's)."""
    mlps = [getattr(layer, "mlp", None) for layer in layers]
    return [(mlp.gate_up_proj, mlp.down_proj) for mlp in mlps
            if mlp is not None and _folds(mlp) and not hooked(mlp) and not hooked(mlp.gate_up_proj)]


def mlp_residual(mlp: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + mlp(x)``, a decoder layer's MLP and the residual add after it: a fused gated
    MLP (``_mlp_forward``) without hooks takes the residual into its down projection, whose GEMV
    (in steps where it takes one) adds it in its epilogue; so does a prepared mixture-of-experts
    block (``flare_residual_forward``: its decode kernels add it); anything else runs as written
    (a block returning a tuple gives its first element, as the mixture-of-experts layers that
    ``moe_residual`` rewrites unpack it)."""
    if type(mlp).forward is _mlp_forward and not hooked(mlp):
        return _mlp_forward(mlp, x, residual)
    with_residual = getattr(mlp, "flare_residual_forward", None)
    if with_residual is not None and not hooked(mlp):
        out, added = with_residual(x, residual)
        return out if added else residual + out
    out = mlp(x)
    return residual + (out[0] if isinstance(out, tuple) else out)


def add_norm(norm: nn.Module, residual: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``norm(residual + x)``, ``residual + x``): a decoder layer's residual add after its
    attention and the norm before its MLP. A row-invariant norm in a decode or verify step
    (``rownorm``'s ``flare_add_norm``, ``--step-norms invariant``) does both in one launch;
    anything else (a hooked norm too) runs as written."""
    fused = getattr(norm, "flare_add_norm", None)
    if fused is not None and not hooked(norm):
        out = fused(residual, x)
        if out is not None:
            return out
    total = residual + x
    return norm(total), total


# Statements of a Transformers decoder layer's forward (consecutive, at the top level of its
# body) and the call each rewrite puts in their place.
_ADD_NORM = ("hidden_states = residual + hidden_states", "residual = hidden_states",
             "hidden_states = self.post_attention_layernorm(hidden_states)")
_MLP_ADD = ("hidden_states = self.mlp(hidden_states)", "hidden_states = residual + hidden_states")
# (Qwen3.5-MoE's and Qwen3-Next's layers, whose MLP may be a block returning a tuple)
_MOE_ADD = (_MLP_ADD[0], "if isinstance(hidden_states, tuple):\n    hidden_states, _ = hidden_states", _MLP_ADD[1])
_ADD_NORM_MLP_CALL = ("hidden_states = _flare_add_norm_mlp(self.post_attention_layernorm, self.mlp, residual, "
                      "hidden_states)")
_MLP_ADD_CALL = "hidden_states = _flare_mlp_residual(self.mlp, hidden_states, residual)"
_REWRITES = {
    # (the two below together, where a layer has both one after the other: tried first; the
    # mixture-of-experts layers' with the unpacking of a tuple after the MLP)
    "add_norm_mlp": (_ADD_NORM + _MLP_ADD, _ADD_NORM_MLP_CALL),
    "add_norm_moe": (_ADD_NORM + _MOE_ADD, _ADD_NORM_MLP_CALL),
    "input_norm": (("hidden_states = self.input_layernorm(hidden_states)",),
                   "hidden_states = _flare_input_norm(self.input_layernorm, hidden_states)"),
    "mlp_residual": (_MLP_ADD, _MLP_ADD_CALL),
    "moe_residual": (_MOE_ADD, _MLP_ADD_CALL),
    "add_norm": (_ADD_NORM,
                 "hidden_states, residual = _flare_add_norm(self.post_attention_layernorm, residual, hidden_states)"),
}
_LAYER_FORWARDS: dict[type, object] = {}
_REWRITTEN = "<flare rewritten"  # the file name a rewritten forward's code carries


def _rewritten_forward(cls: type):
    """``cls.forward`` with each of ``_REWRITES`` that it has (once, at the top level of its
    body, and not within one found before) replaced by its call (``input_norm``; ``add_norm_mlp``,
    or ``mlp_residual`` and ``add_norm`` apart: a mixture-of-experts layer unpacks a tuple between
    its MLP call and the add): the same code otherwise,
    compiled from its syntax tree in its module's namespace, with the names of the rewrites
    made in its ``flare_rewrites``. None where the forward has none of them, calls
    ``super()`` or closes over names (no class cell or closure here) or its source is
    unavailable. Its decorators apply again; line numbers are the source's."""
    if cls in _LAYER_FORWARDS:
        return _LAYER_FORWARDS[cls]
    import ast
    import inspect
    import textwrap

    forward = None
    original = inspect.unwrap(cls.forward)
    try:
        lines, first = inspect.getsourcelines(original)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        tree = None
    fn = tree.body[0] if tree is not None and tree.body else None
    if isinstance(fn, ast.FunctionDef) and not original.__code__.co_freevars and not any(
            isinstance(n, ast.Name) and n.id in ("super", "__class__") for n in ast.walk(fn)):
        body = [ast.dump(stmt) for stmt in fn.body]
        found = []  # (index, statements replaced, call, name), on the original body
        for name, (statements, replacement) in _REWRITES.items():
            want = [ast.dump(ast.parse(line).body[0]) for line in statements]
            at = [i for i in range(len(body) - len(want) + 1) if body[i:i + len(want)] == want]
            taken = any(i < at[0] + len(want) and at[0] < i + n for i, n, _, _ in found) if len(at) == 1 else False
            if len(at) == 1 and not taken:  # (not within one found before)
                call = ast.parse(replacement).body[0]
                ast.increment_lineno(call, fn.body[at[0]].lineno - 1)  # the line of the first it replaces
                found.append((at[0], len(want), call, name))
        spans = sorted((i, i + n) for i, n, _, _ in found)
        if found and all(a[1] <= b[0] for a, b in zip(spans, spans[1:])):  # none overlapping
            for i, n, call, _ in sorted(found, key=lambda f: -f[0]):
                fn.body[i:i + n] = [call]
            # The namespace of the module that defines the forward (a copy, with the calls' names).
            namespace = dict(original.__globals__, _flare_mlp_residual=mlp_residual, _flare_add_norm=add_norm,
                             _flare_add_norm_mlp=add_norm_mlp, _flare_input_norm=input_norm)
            module = ast.increment_lineno(ast.Module(body=[fn], type_ignores=[]), first - 1)
            try:  # the decorators run again here; any that fails leaves the forward as it is
                exec(compile(module, f"{_REWRITTEN} {cls.__qualname__}.forward>", "exec"), namespace)
                forward = namespace[fn.name]
                inspect.unwrap(forward).flare_rewrites = frozenset(f[3] for f in found)
            except Exception:
                forward = None
    _LAYER_FORWARDS[cls] = forward
    return forward


_SUBCLASSES: dict[tuple[type, object], type] = {}


def _with_forward(module: nn.Module, forward, **members) -> None:
    """Give ``module`` a subclass of its class whose forward is ``forward`` (a class-level
    override: torch.compile and hooks see an ordinary module). One subclass per class:
    torch.compile guards on a submodule's type, so a class per layer would recompile
    the shared layer code for every layer (and fall back to eager past its limit)."""
    cls = type(module)
    key = (cls, forward)
    if key not in _SUBCLASSES:
        _SUBCLASSES[key] = type(f"Fused{cls.__name__}", (cls,), {"forward": forward, **members})
    module.__class__ = _SUBCLASSES[key]


def is_fused(module: nn.Module) -> bool:
    """Whether the module's forward was replaced by a fused one here."""
    return type(module) in _SUBCLASSES.values()


def fuse_projections(layers: list[nn.Module]) -> int:
    """Fuse q/k/v and gate/up in every layer whose modules are of a known class; returns
    the number of projections fused (0 for an architecture this does not cover)."""
    n = 0
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        forward = ATTENTION_FORWARDS.get(type(attn).__name__)
        if attn is not None and forward is not None and fuse_linears(attn, QKV, "qkv_proj"):
            rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
            _with_forward(attn, forward, flare_rotary=staticmethod(rotary),
                          flare_rotate_half=forward is _gated_attention_forward or rotates_half(rotary))
            n += 1
        if mlp is not None and fuse_mlp(mlp):
            n += 1
        forward = _rewritten_forward(type(layer))
        if forward is not None:
            _with_forward(layer, forward)
    return n


def fuse_mlp(mlp: nn.Module) -> bool:
    """One gate/up GEMM for an MLP of a known class (also one inside another module, such
    as a mixture-of-experts block's shared expert); False when it is not one."""
    if type(mlp).__name__ in MLP_CLASSES and fuse_linears(mlp, GATE_UP, "gate_up_proj"):
        _with_forward(mlp, _mlp_forward)
        return True
    return False


def parts_of(model: nn.Module, param_path: str) -> tuple[tuple[str, int], ...] | None:
    """For a fused parameter path (``...self_attn.qkv_proj.weight``): the checkpoint
    tensor names it holds and their row counts, in order; None for any other parameter."""
    owner_path, _, attr = param_path.rpartition(".")
    owner = model.get_submodule(owner_path)
    if not isinstance(owner, FusedLinear):
        return None
    parent = owner_path.rpartition(".")[0]
    return tuple((f"{parent}.{p.module}.{attr}", p.rows) for p in owner.parts)
