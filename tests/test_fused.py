"""Fused projections (recipes/fused.py) compute what Transformers' own modules compute.

For each decoder family the recipe fuses (Llama, Mistral, Qwen2 with q/k/v biases,
Qwen3 with per-head q/k norms, Qwen3.5 with its output gate), a canonical Transformers layer and the recipe's
fused twin get the same float64 weights: the attention output, the keys and values
written to the page pool, and the MLP output must agree to float64 rounding, eager
and through torch.compile. The built model holds one buffer per fused projection,
and loading writes every checkpoint tensor into its rows.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from flare.prepare import attention as A
from flare.prepare.recipes import by_name
from flare.prepare.recipes.fused import FusedLinear, fuse_projections

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=256, head_dim=16)
FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "qwen2": {},  # q/k/v carry biases
    "qwen3": {},  # RMSNorm per head on q and k
    # Gated attention: q_proj also yields each head's output gate; partial rotary.
    "qwen3_5_text": {"layer_types": ["full_attention"]},
}


def _config(model_type: str):
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, **SMALL, **FAMILIES[model_type])
    cfg._attn_implementation = A.ATTENTION_NAME
    return cfg


def _layer(cfg):
    """The canonical decoder layer (float64, random weights) and its fused twin."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).double().eval()
    canon = model.model.layers[0]
    for p in canon.parameters():
        p.data.normal_(0, 0.2)
    canon.self_attn.kv_layer = 0
    twin = AutoModelForCausalLM.from_config(cfg).double().eval().model.layers[0]
    twin.self_attn.kv_layer = 0
    assert fuse_projections([twin]) == 2
    state = canon.state_dict()
    for owner, fused, parts in ((twin.self_attn, "qkv_proj", ("q_proj", "k_proj", "v_proj")),
                                (twin.mlp, "gate_up_proj", ("gate_proj", "up_proj"))):
        prefix = "self_attn" if owner is twin.self_attn else "mlp"
        mod = getattr(owner, fused)
        mod.weight.data = torch.cat([state[f"{prefix}.{p}.weight"] for p in parts])
        if mod.bias is not None:
            mod.bias.data = torch.cat([state[f"{prefix}.{p}.bias"] for p in parts])
    rest = {k: v for k, v in state.items() if not any(f".{p}." in k for p in
                                                      ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))}
    missing, unexpected = twin.load_state_dict(rest, strict=False)
    assert not unexpected and set(missing) <= {f"self_attn.qkv_proj.{a}" for a in ("weight", "bias")} | {
        f"mlp.gate_up_proj.{a}" for a in ("weight", "bias")}
    return model, canon, twin


def _batch(cfg, T: int) -> A.PagedBatch:
    ps, pages = 8, 6
    kv = torch.zeros(1, 2, pages, ps, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.float64)
    table = torch.zeros(3, pages, dtype=torch.int32)
    table[1, :4] = torch.tensor([3, 1, 5, 2])  # scrambled pages of slot 1
    pos = torch.arange(T)
    slot_mapping = table[1].long()[pos // ps] * ps + pos % ps
    return A.PagedBatch(kv=kv, page_table=table, token_slot=torch.full((T,), 1), positions=pos,
                        slot_mapping=slot_mapping, valid=torch.ones(T, dtype=torch.bool), impl="reference",
                        single_slot=True)


def _run(model, layer, cfg, x: torch.Tensor):
    T = x.shape[1]
    batch = _batch(cfg, T)
    pos = torch.arange(T)[None]
    emb = model.model.rotary_emb(x, pos)
    with torch.no_grad():
        attn, _ = layer.self_attn(hidden_states=x, position_embeddings=emb, attention_mask=None, position_ids=pos,
                                  paged=batch)
        mlp = layer.mlp(x)
    return attn, batch.kv, mlp


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_fused_layer_matches_transformers(model_type):
    cfg = _config(model_type)
    model, canon, twin = _layer(cfg)
    if model_type == "qwen2":
        assert twin.self_attn.qkv_proj.bias is not None
    if model_type in ("qwen3", "qwen3_5_text"):
        assert hasattr(twin.self_attn, "q_norm")
    assert not any(hasattr(twin.self_attn, p) for p in ("q_proj", "k_proj", "v_proj"))
    x = torch.randn(1, 19, cfg.hidden_size, dtype=torch.float64)
    want = _run(model, canon, cfg, x)
    got = _run(model, twin, cfg, x)
    for name, a, b in zip(("attention", "kv pool", "mlp"), want, got):
        assert a.abs().max() > 0, name  # nothing trivially zero
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_fused_layer_compiles(family):
    """The class-level forward override traces through torch.compile (the paged attention
    call is a graph break, as in the unfused layer) and computes the same values; the gated
    attention's rotary (an index and selects built from arange) too."""
    cfg = _config(family)
    model, _, twin = _layer(cfg)
    x = torch.randn(1, 7, cfg.hidden_size, dtype=torch.float64)
    eager = _run(model, twin, cfg, x)
    twin.self_attn.compile(backend="aot_eager", dynamic=False)
    twin.mlp.compile(backend="aot_eager", dynamic=False)
    compiled = _run(model, twin, cfg, x)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_layers_share_one_fused_class():
    """torch.compile guards on submodule types: every layer's fused attention (and MLP)
    must be the same class, or each layer recompiles the shared layer code."""
    cfg = _config("llama")
    cfg.num_hidden_layers = 3
    layers = by_name("decoder").decoder_layers(by_name("decoder").build(cfg, torch.float32).module)
    assert len({type(layer.self_attn) for layer in layers}) == 1
    assert len({type(layer.mlp) for layer in layers}) == 1
    assert type(layers[0].self_attn).__name__ == "FusedLlamaAttention"


def test_compiled_layers_compile_once():
    """All layers of one shape run one compiled frame: no recompilation per layer."""
    import torch._dynamo

    cfg = _config("llama")
    cfg.num_hidden_layers = 3
    recipe = by_name("decoder")
    pm = recipe.build(cfg, torch.float64)
    specs = recipe.weights(pm)
    torch.manual_seed(0)
    recipe.bind(pm, specs, {s.buffer: torch.randn(s.shape, dtype=torch.float64) * 0.1 for s in specs})
    model = pm.module
    counts = {"frames": 0}

    def backend(gm, inputs):
        counts["frames"] += 1
        return gm

    torch._dynamo.reset()
    for layer in recipe.decoder_layers(model):
        layer.compile(backend=backend, dynamic=False)
    x = torch.randn(1, 5, cfg.hidden_size, dtype=torch.float64)
    pos = torch.arange(5)[None]
    emb = model.model.rotary_emb(x, pos)
    batch = _batch(cfg, 5)
    batch.kv = torch.zeros(3, *batch.kv.shape[1:], dtype=torch.float64)
    frames = []
    with torch.no_grad():
        for i, layer in enumerate(recipe.decoder_layers(model)):
            layer.self_attn.kv_layer = i
            x = layer(x, position_embeddings=emb, position_ids=pos, paged=batch)
            x = x[0] if isinstance(x, tuple) else x
            frames.append(counts["frames"])
    torch._dynamo.reset()
    assert frames[0] >= 2  # the layer splits at the paged attention call
    assert frames == [frames[0]] * 3, f"later layers recompiled: frames after each layer {frames}"


def test_recipe_buffers_hold_the_checkpoint_rows():
    """One arena buffer per fused projection; loading by checkpoint name fills its rows in
    part order, and a TP rank holds its slice of every part."""
    from flare.prepare.parallel import Shard, TensorParallel

    recipe = by_name("decoder")
    cfg = _config("llama")
    cfg.num_hidden_layers = 2
    for tp in (TensorParallel(0, 1), TensorParallel(1, 2)):
        pm = recipe.build(cfg, torch.float32, tp=tp)
        specs = {s.buffer: s for s in recipe.weights(pm)}
        assert not any("q_proj" in b or "gate_proj" in b for b in specs)
        qkv = specs["w.model.layers.1.self_attn.qkv_proj.weight"]
        assert [(p.name, p.rows) for p in qkv.parts] == [
            ("model.layers.1.self_attn.q_proj.weight", 64 // tp.size),
            ("model.layers.1.self_attn.k_proj.weight", 32 // tp.size),
            ("model.layers.1.self_attn.v_proj.weight", 32 // tp.size)]
        assert qkv.shape == (128 // tp.size, 64)
        assert {p.shard for p in qkv.parts} == ({None} if tp.size == 1 else {Shard(0, 1, 2)})
        buf = torch.arange(qkv.shape[0] * 64, dtype=torch.float32).view(qkv.shape)
        views = qkv.checkpoint_views(buf)
        assert list(views) == [p.name for p in qkv.parts]
        assert torch.equal(torch.cat(list(views.values())), buf)
        assert all(v.data_ptr() == buf[r:].data_ptr() for v, r in zip(views.values(), (0, 64 // tp.size,
                                                                                         96 // tp.size)))
        gate_up = specs["w.model.layers.0.mlp.gate_up_proj.weight"]
        assert [p.rows for p in gate_up.parts] == [96 // tp.size] * 2
        # Bound, the fused module splits its output into the rank's part sizes.
        recipe.bind(pm, list(specs.values()), {b: torch.zeros(s.shape) for b, s in specs.items()})
        fused = pm.module.model.layers[0].self_attn.qkv_proj
        assert isinstance(fused, FusedLinear) and fused.sizes == [64 // tp.size, 32 // tp.size, 32 // tp.size]


def test_unknown_modules_are_left_alone():
    """A module class the fusion does not know keeps its own projections and forward."""

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

    layer = nn.Module()
    layer.self_attn = Attention()
    assert fuse_projections([layer]) == 0
    assert type(layer.self_attn) is Attention and hasattr(layer.self_attn, "q_proj")


def test_a_layer_class_neither_fused_replaced_nor_eager_is_an_error():
    """The recipe base refuses a decoder layer child it was not told about, instead of
    running it silently as written: here the decoder recipe with its norm class missing
    from ``eager``, and a copy of the hybrid recipe that forgot its gated attention."""
    from flare.prepare.recipes import RecipeError
    from flare.prepare.recipes.decoder import DecoderRecipe
    from flare.prepare.recipes.qwen3_5 import Qwen35Recipe
    from flare.prepare.sources import resolve

    class Forgetful(DecoderRecipe):
        eager = frozenset()

    with pytest.raises(RecipeError, match=r"layer 0\.input_layernorm is a LlamaRMSNorm, which the decoder recipe"):
        Forgetful().build(_config("llama"), torch.float32)

    class NoNorms(Qwen35Recipe):
        eager = frozenset()

    with pytest.raises(RecipeError, match=r"layer 0\.input_layernorm is a Qwen3_5RMSNorm"):
        NoNorms().build(resolve("qwen3_5-tiny").config, torch.float32)
    # The declared recipes build.
    assert by_name("qwen3_5").build(resolve("qwen3_5-tiny").config, torch.float32).module is not None


def test_each_attention_class_gets_the_window_transformers_passes():
    """layer_window: Mistral passes its config's window on every layer (layer_types or
    not); Qwen2 only on the layers layer_types marks sliding; Llama never, even with a
    stray sliding_window in its config."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.mistral.modeling_mistral import MistralAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    from flare.prepare.recipes.fused import layer_window

    small = dict(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2)
    mistral = MistralConfig(sliding_window=24, **small)
    assert [layer_window(MistralAttention(mistral, i)) for i in range(2)] == [24, 24]
    mistral.layer_types = ["full_attention", "sliding_attention"]
    assert [layer_window(MistralAttention(mistral, i)) for i in range(2)] == [24, 24]
    qwen2 = Qwen2Config(sliding_window=24, use_sliding_window=True, max_window_layers=1,
                        layer_types=["full_attention", "sliding_attention"], **small)
    assert [layer_window(Qwen2Attention(qwen2, i)) for i in range(2)] == [None, 24]
    llama = LlamaConfig(**small)
    llama.sliding_window = 24
    assert [layer_window(LlamaAttention(llama, i)) for i in range(2)] == [None, None]


@pytest.mark.parametrize("module", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rotary", [16, 64])
def test_the_rotary_without_cat_is_the_models_own_bit_for_bit(module, dtype, rotary):
    """The gated attention's rotary embedding (``rotary_without_cat``) gives the bits of the
    model's own ``apply_rotary_pos_emb``, partial (a quarter of the head, as Qwen3.5 and
    Qwen3-Next configure it) and whole, for queries and keys of other head counts."""
    import importlib

    from flare.prepare.recipes.fused import rotary_without_cat

    own = importlib.import_module(f"transformers.models.{module}.modeling_{module}").apply_rotary_pos_emb
    g = torch.Generator().manual_seed(rotary)
    q = torch.randn(2, 4, 3, 64, generator=g).to(dtype)
    k = torch.randn(2, 2, 3, 64, generator=g).to(dtype)
    cos, sin = (torch.randn(2, 3, rotary, generator=g).to(dtype) for _ in range(2))
    want_q, want_k = own(q, k, cos, sin)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    assert torch.equal(rotary_without_cat(q, c, s), want_q)
    assert torch.equal(rotary_without_cat(k, c, s), want_k)


def _run_layer(model, layer, cfg, x: torch.Tensor):
    T = x.shape[1]
    pos = torch.arange(T)[None]
    with torch.no_grad():
        return layer(x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=None, position_ids=pos,
                     paged=_batch(cfg, T))


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_mlp_and_its_residual_add_are_one_call(model_type):
    """A decoder layer whose MLP is fused runs Transformers' forward with the residual add after its
    attention, its post-attention norm, its MLP call and the residual add after it as one
    ``add_norm_mlp`` (which a step's gate/up GEMV may take the add and norm into), whose MLP and
    add are one ``mlp_residual`` call where it does not (which a one-row step's GEMV takes in its
    epilogue), and its input norm one ``input_norm`` call (which a step's q/k/v or input projection
    may take into its loads): the layer's output is the canonical layer's, eagerly and compiled;
    the rewritten forward is the class's own but for those six statements, one class for every layer."""
    from flare.prepare.recipes import fused

    cfg = _config(model_type)
    model, canon, twin = _layer(cfg)
    assert type(twin).__name__ == f"Fused{type(canon).__name__}"
    forward = inspect.unwrap(type(twin).forward)  # under Transformers' decorators and checkpointing wrapper
    assert forward.__code__.co_filename.startswith("<flare rewritten")
    assert forward.flare_rewrites == {"input_norm", "add_norm_mlp"}
    calls = []
    real = fused.mlp_residual
    x = torch.randn(1, 11, cfg.hidden_size, dtype=torch.float64)
    want = _run_layer(model, canon, cfg, x)
    try:
        fused.mlp_residual = lambda *a: calls.append(a[0]) or real(*a)  # (add_norm_mlp's call of it)
        got = _run_layer(model, twin, cfg, x)
    finally:
        fused.mlp_residual = real
    assert calls == [twin.mlp]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # --step-gemms measure charges cuBLAS this layer's residual add (its GEMV folds it); not the
    # canonical layer's, whose add stays a kernel of its own whatever its down projection runs.
    assert fused.residual_down_projections([canon, twin]) == [twin.mlp.down_proj]
    _, plain, _ = _layer(cfg)  # a fused MLP in a layer whose forward was not rewritten
    assert fused.fuse_mlp(plain.mlp) and fused.residual_down_projections([plain]) == []
    hook = twin.mlp.down_proj.register_forward_hook(lambda _m, _a, out: out)  # a TP all-reduce
    assert fused.residual_down_projections([twin]) == []
    hook.remove()
    twin.compile(backend="aot_eager", dynamic=False)
    torch.testing.assert_close(_run_layer(model, twin, cfg, x), want, rtol=1e-12, atol=1e-12)


def test_a_layer_whose_forward_has_another_shape_keeps_it():
    """Mixture-of-experts layers unpack a tuple between the MLP call and the add: their forward
    takes its input norm and the add, the post-attention norm, the MLP and the add after it with
    the unpacking in between (``input_norm``, ``add_norm_moe``: not ``add_norm_mlp``, whose
    statements have no unpacking); a forward calling ``super()`` is not rewritten (no class cell
    for it there)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from flare.prepare.recipes.fused import _rewritten_forward

    assert inspect.unwrap(_rewritten_forward(Qwen3_5MoeDecoderLayer)).flare_rewrites == {"input_norm", "add_norm_moe"}

    class Wrapped(LlamaDecoderLayer):
        def forward(self, hidden_states, **kwargs):
            residual = hidden_states
            hidden_states = super().forward(hidden_states, **kwargs)
            hidden_states = self.mlp(hidden_states)
            hidden_states = residual + hidden_states
            return hidden_states

    assert _rewritten_forward(Wrapped) is None and _rewritten_forward(LlamaDecoderLayer) is not None

    class Other(LlamaDecoderLayer):  # neither statement sequence
        def forward(self, hidden_states, **kwargs):
            return self.mlp(self.post_attention_layernorm(hidden_states))

    assert _rewritten_forward(Other) is None


def test_a_modules_rotary_is_taken_for_rotate_half_only_where_it_computes_it():
    """``rotates_half``: Qwen3's ``apply_rotary_pos_emb`` (what the one-launch q/k norms and rotary
    of a step compute, ``rownorm.qk_norm_rotary``) is; an interleaved rotary (pairs 2i, 2i + 1) or
    a function of another signature is not."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    from flare.prepare.recipes.fused import rotates_half

    def interleaved(q, k, cos, sin):
        def rot(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * c + rot(q) * s, k * c + rot(k) * s

    assert rotates_half(apply_rotary_pos_emb)
    assert not rotates_half(interleaved)
    assert not rotates_half(lambda q, k: (q, k))


def test_llama_steps_rotate_and_write_the_pages_in_one_launch(tiny_core, monkeypatch):
    """An attention without q/k norms (Llama's) on the CUDA path under the interpreter: a decode
    step's rotary of q and k and the write of the keys and values to the pages are one
    ``qk_norm_rotary`` launch a layer (no norms; no ``write_kv_triton``), and the tokens and,
    within float32 rounding, the logits are those of the layer's own rotary and write."""
    pytest.importorskip("triton")
    from flare.prepare.kernels import kv_write as KW
    from flare.prepare.kernels import rownorm as R
    from tests.rig import decode_alike, prefilled_rigs

    g = torch.Generator().manual_seed(3)
    stream = torch.randint(100, 40000, (60,), generator=g).tolist()
    one, apart = prefilled_rigs(tiny_core, {1: stream[:21], 2: stream[30:40]}, 2, attention="triton")
    layers = [[layer.self_attn for layer in r.model.model.layers] for r in (one, apart)]
    assert all(a.flare_rotate_half and getattr(a, "q_norm", None) is None for a in layers[0])
    for a in layers[1]:
        a.flare_rotate_half = False
    taken, writes = [], []
    real, write = R.qk_norm_rotary, KW.write_kv_triton

    def counted(*a, **kw):
        out = real(*a, **kw)
        taken.extend([kw.get("pages", (None, None, None))[2]] if out is not None else [])
        return out

    monkeypatch.setattr(R, "qk_norm_rotary", counted)
    monkeypatch.setattr(KW, "write_kv_triton", lambda *a: writes.append(a[1]) or write(*a))
    decode_alike(one, apart, [1, 2], steps=2)
    assert taken == 2 * [a.kv_layer for a in layers[0]]
    assert writes == 2 * [a.kv_layer for a in layers[1]]
