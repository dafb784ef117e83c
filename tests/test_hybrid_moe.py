"""Numerical acceptance of the hybrid mixture-of-experts recipes, Qwen3.5-MoE and
Qwen3-Next (Gated DeltaNet + gated attention + routed experts with a gated shared
expert; Qwen3-Next groups its GDN projections per key head): each tiny core's programs
against Transformers' ``Qwen3_5MoeForCausalLM`` / ``Qwen3NextForCausalLM`` on the same
weights, teacher-forced, with the
bound of ``test_qwen3_5.py`` (``|flare - hf32| <= 4 * err32``, the float64 model with
float64 delta rule and norms); the router's decisions must not be within rounding. Then
the CUDA path (GDN and grouped expert kernels under Triton's CPU interpreter) against
the reference path on one core (the same, with prefill programs of 64 rows:
conftest.INTERPRETER_CHUNK)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import HYBRID_OPTS, QUALIFIED, prepare_core
from tests.rig import load_rig
from tests.test_qwen3_5 import float64_islands
from tests.test_qwen3_moe import (hf_model, router_calls, routing_agreement, teacher_forced_errors,
                                  triton_matches_reference)

LENGTHS = (7, 16, 65, 130)
DECODE_STEPS = 4


# config -> (Transformers module, its class prefix): for the float64 delta rule and norms.
FAMILIES = {"qwen3_5-moe-tiny": ("qwen3_5_moe", "Qwen3_5Moe"), "qwen3-next-tiny": ("qwen3_next", "Qwen3Next")}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    # (qwen3_5-moe-tiny: the replay test's core of these options)
    return request.param, QUALIFIED[request.param]() if request.param in QUALIFIED else prepare_core(request.param,
                                                                                                    HYBRID_OPTS)


@pytest.fixture(scope="module")
def stream() -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, 40000, (max(LENGTHS) + DECODE_STEPS,), generator=g).tolist()


def test_logits_match_transformers(family, stream):
    name, core = family
    rig = load_rig(core)
    assert [type(layer.mlp).__name__ for layer in rig.model.model.layers] == ["PreparedSparseMoe"] * 4
    assert all(hasattr(layer.mlp.shared_expert, "gate_up_proj") for layer in rig.model.model.layers)  # one GEMM
    hf32, hf64 = hf_model(rig, torch.float32), hf_model(rig, torch.float64)
    x = torch.tensor([stream])
    with torch.inference_mode():
        l32 = hf32(input_ids=x).logits[0].double()
        with float64_islands(hf64, *FAMILIES[name]):
            l64 = hf64(input_ids=x).logits[0]
            calls = [router_calls(model, x, range(4)) for model in (hf32, hf64)]  # every layer routes
    routing = routing_agreement(*calls, [layer.mlp.gate for layer in hf64.model.layers])
    err32 = float((l32 - l64).abs().max())
    slots = list(range(1, len(LENGTHS) + 1))
    worst = teacher_forced_errors(rig, stream, LENGTHS, DECODE_STEPS, l32, (slots,), split=True)
    bound = 4 * err32 + 1e-6
    print(f"\n{name} acceptance:", json.dumps({"err_hf32": err32, "bound": bound, "routing": routing,
                                                    "max|flare-hf32|": worst}))
    assert routing["disagreements_outside_rounding"] == 0, routing
    assert worst["prefill"] <= bound and worst["decode"] <= bound, (worst, bound)


def test_triton_path_matches_the_reference_path(family, stream, monkeypatch):
    """... with the decode steps running the shared expert inside the routed decode kernels
    (one more pair of every token), which add the decoder layer's residual too (the layer's
    forward rewritten with ``add_norm_moe``), and the prefill chunks running it apart; with
    ticket counters (a CUDA core's), decode steps route in the router's launch, which takes the
    add and the post-attention norm in its loads where the step's norms are row-invariant launches
    (``--step-norms invariant``: Qwen3-Next's here; Qwen3.5-MoE's keep the compiled norms)."""
    from flare.prepare.kernels import moe as K

    calls, routes = [], []
    decode, rows = K.experts_decode, K.route_rows
    monkeypatch.setattr(K, "experts_decode",
                        lambda x, *a, **kw: calls.append((x.shape[0], kw.get("shared") is not None,
                                                          kw.get("residual") is not None, kw.get("norm") is not None))
                        or decode(x, *a, **kw))
    monkeypatch.setattr(K, "route_rows", lambda logits, *a, **kw: routes.append(logits.shape[0])
                        or rows(logits, *a, **kw))
    # (Qwen3-Next's with the step norms row-invariant launches, as the GPU suite prepares its shape:
    # the post-attention norm in the router's and experts' loads, the layer's forward rewritten with
    # add_norm_moe; Qwen3.5-MoE's with the compiled norms, which keep their launch)
    step_norms = family[0] == "qwen3-next-tiny"
    triton_matches_reference(family[0], HYBRID_OPTS, stream, tickets=True, step_norms=step_norms)
    assert calls and all(folded and added and normed == step_norms for _, folded, added, normed in calls), calls
    assert routes and set(routes) == {64}, routes  # prefill chunks only


def test_the_folded_shared_expert_compiles_through_the_graph_break(family):
    """The block inside a compiled layer: a decode step returns the folded output and no gate
    from the compiler-disabled experts call, a prompt program the routed output and the gate
    (the shared expert then runs in the compiled code). torch.compile (aot_eager: the same
    kernels, traced by Dynamo across the graph break) gives eager's bits either way, and the
    two paths agree to float32 rounding."""
    from types import SimpleNamespace

    from flare.prepare import prompt_rows
    from flare.prepare.recipes.fused import mlp_residual

    rig = load_rig(family[1], attention="triton")
    block = rig.model.model.layers[0].mlp
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 1, block.gate.weight.shape[1], generator=g) * 0.5
    block.flare_paged = SimpleNamespace(impl="triton", valid=torch.tensor([True, False, True]))
    compiled = torch.compile(block, backend="aot_eager", dynamic=False)
    out = {}
    with torch.inference_mode():
        for prompt in (False, True):
            with prompt_rows.marked(prompt):
                eager = block(x)
                assert torch.equal(compiled(x), eager)
                out[prompt] = eager
            # The decoder layer's residual: added by the decode kernels (the bits of the add apart),
            # left to the caller in a prompt program (``fused.mlp_residual`` adds it after the
            # block's frame, so that the block's output is rounded before the add as it was).
            residual = torch.randn(x.shape, generator=g)
            with_residual = torch.compile(block.flare_residual_forward, backend="aot_eager", dynamic=False)
            with prompt_rows.marked(prompt):
                for got, added in (block.flare_residual_forward(x, residual), with_residual(x, residual)):
                    assert added is not prompt
                    assert torch.equal(got, residual + out[prompt] if added else out[prompt])
                assert torch.equal(mlp_residual(block, x, residual), residual + out[prompt])
    valid = block.flare_paged.valid
    torch.testing.assert_close(out[False][valid], out[True][valid], atol=1e-5, rtol=1e-5)
    assert not out[False][~valid].any()  # a padded decode row reads no expert, the shared one included


def test_the_shared_expert_folds_only_where_the_kernels_compute_it(family):
    """``_folds_shared``: a single rank, a fused gate/up of SiLU without biases; a
    tensor-parallel rank (a shard of the shared expert), a bias or another activation
    keep it apart."""
    import copy
    from types import SimpleNamespace

    from flare.prepare.recipes.moe import _folds_shared

    block = load_rig(family[1]).model.model.layers[0].mlp
    assert _folds_shared(block)
    tp = copy.copy(block)
    tp.flare_tp = SimpleNamespace(active=True)
    assert not _folds_shared(tp)
    for attr, value in (("down_proj", SimpleNamespace(bias=torch.zeros(1))), ("act_fn", torch.nn.GELU())):
        shared = copy.copy(block.shared_expert)
        object.__setattr__(shared, attr, value)  # shadows the submodule on this copy only
        other = copy.copy(block)
        other._modules = {**block._modules, "shared_expert": shared}
        assert not _folds_shared(other), attr
