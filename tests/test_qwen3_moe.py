"""Numerical acceptance of the routed-expert recipe: the qwen3-moe-tiny core's programs
(routed experts through ``recipes/moe.py``, a dense MLP layer, paged attention) against
Transformers' own ``Qwen3MoeForCausalLM`` on the same weights, teacher-forced.

Bound as in ``test_qwen3_5.py``: ``err32 = max |hf32 - hf64|`` is the rounding error of
one float32 evaluation; Flare evaluates the same function in float32 in another order,
so ``|flare - hf32| <= 4 * err32`` (+ 1e-6). The router is part of the function: a token
whose k-th and (k+1)-th router probabilities were within rounding of each other could
route differently in the two evaluations, and the bound would fail loudly at that row;
``routing_agreement`` counts such near-ties and requires Flare's router to pick
Transformers' float64 experts for every other token.
The CUDA path's grouped expert kernels (``paged.impl == "triton"``, here under Triton's
CPU interpreter) are compared with the reference path on one core (the same, with prefill
programs of 64 rows: conftest.INTERPRETER_CHUNK)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from flare.core.manifest import BufferRole, load_manifest
from tests.conftest import INTERPRETER_CHUNK, QUALIFIED, TINY_OPTS, prepare_core
from tests.rig import admit, decode, decode_alike, load_rig, prefill, prefilled_rigs, transformers_model

LENGTHS = (5, 16, 17, 40, 129)
DECODE_STEPS = 4


@pytest.fixture(scope="module")
def moe_core():
    return QUALIFIED["qwen3-moe-tiny"]()  # TINY_OPTS (with golden replays)


@pytest.fixture(scope="module")
def rig(moe_core):
    return load_rig(moe_core)


@pytest.fixture(scope="module")
def stream() -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, 40000, (max(LENGTHS) + DECODE_STEPS,), generator=g).tolist()


def hf_model(rig, dtype):
    """Transformers' model of the core's recipe on the core's weights (``tests.rig``)."""
    return transformers_model(rig.core, rig.m, dtype)


@pytest.fixture(scope="module")
def hf_models(rig):
    return [hf_model(rig, dtype) for dtype in (torch.float32, torch.float64)]


def router_calls(model, x: torch.Tensor, layers) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(router input, router logits) of ``layers`` in one forward of ``model`` over ``x``."""
    captured = []
    hooks = [model.model.layers[i].mlp.gate.register_forward_hook(lambda m, a, out: captured.append((a[0], out[0])))
             for i in layers]
    model(input_ids=x)
    for h in hooks:
        h.remove()
    return captured


def teacher_forced_errors(rig, stream, lengths, steps, l32, groups, split: bool = False) -> dict:
    """Max |flare - hf32| over every prefill row (each prompt in its own slot, cut at a third
    of its length when ``split``) and over ``steps`` decode steps of the slot ``groups``."""
    head = rig.model.lm_head.weight.detach().double()
    worst = {"prefill": 0.0, "decode": 0.0}
    for slot, L in enumerate(lengths, start=1):
        admit(rig, slot, stream[:L], rig.pages(-(-(L + steps) // 16)), seed=slot)
        hidden, _, _ = prefill(rig, slot, stream[:L], splits=(L // 3,) if split else ())
        worst["prefill"] = max(worst["prefill"], float((hidden.double() @ head.T - l32[:L]).abs().max()))
    for step in range(steps):
        for group in groups:
            logits, _ = decode(rig, group, [stream[lengths[s - 1] + step] for s in group])
            for row, s in enumerate(group):
                pos = lengths[s - 1] + step
                worst["decode"] = max(worst["decode"], float((logits[row].double() - l32[pos]).abs().max()))
    return worst


def routing_agreement(calls32, calls64, gates) -> dict:
    """Flare's router (``kernels.moe.route``, float32) on each layer's router input against
    Transformers' float64 top-k: the expert sets must be equal for every token whose k-th
    and (k+1)-th float64 probabilities differ by more than twice the float32 router's own
    error (measured: Transformers' float32 probabilities against float64); closer ties
    are counted, not judged."""
    from flare.prepare.kernels.moe import route

    err = max(float((torch.softmax(o32.double(), -1) - torch.softmax(o64, -1)).abs().max())
              for (_, o32), (_, o64) in zip(calls32, calls64))
    tokens = near = bad = 0
    for (x64, o64), gate in zip(calls64, gates):
        p = torch.softmax(o64, dim=-1)
        top, ids64 = p.sort(dim=-1, descending=True, stable=True)
        k = gate.top_k
        _, ids = route(x64.float(), gate.weight.float(), k, True)
        same = (ids.sort(-1).values == ids64[:, :k].sort(-1).values).all(-1)
        clear = (top[:, k - 1] - top[:, k]) > 2 * err
        tokens += len(same)
        near += int((~clear).sum())
        bad += int((~same & clear).sum())
    return {"tokens": tokens, "router_err_hf32": err, "near_ties": near, "disagreements_outside_rounding": bad}


def test_prepared_model_routes_through_the_prepared_block(rig):
    from flare.prepare.recipes.moe import Qwen3MoeRecipe

    assert rig.m.reference.recipe == Qwen3MoeRecipe.name
    mlps = [type(layer.mlp).__name__ for layer in rig.model.model.layers]
    assert mlps == ["PreparedSparseMoe", "FusedQwen3MoeMLP"]  # layer 1 is in mlp_only_layers


def test_step_gemm_choice_passes_the_expert_block(rig, monkeypatch):
    """--step-gemms measure over a model with expert layers: each layer's gate/up projection that
    may take its norm is listed, none for a layer whose MLP is the prepared expert block (no
    ``gate_up_proj``: that raised AttributeError on the H100 preparing qwen3-30b-a3b-shape,
    2026-12-06), the dense layer's pair still; and the whole choice runs through both kinds of
    layer (on copies of the rig's layers, with the norms switched as a step's preparation does,
    every candidate timed alike)."""
    from flare.prepare.kernels import gemm, rownorm
    from flare.prepare.recipes import fused

    layers = copy.deepcopy(list(rig.model.model.layers))
    for layer in layers:
        rownorm.make_norms_row_invariant(layer, steps=True)
    dense = layers[1]
    assert fused.norm_glu_projections(layers) == [(dense.mlp.gate_up_proj, dense.post_attention_layernorm)]
    calls = []
    monkeypatch.setattr(gemm, "split_rows", lambda w, b, counts, remedy="": frozenset())
    monkeypatch.setattr(gemm, "_same_rows", lambda *a: True)  # (each candidate's bits: tests/test_gemm_rows.py)
    found = gemm.choose_step_gemms(layers, [1, 2], timer=lambda fn: calls.append(fn) or 1.0)
    names = dict(nn.ModuleList(layers).named_modules())
    assert calls and set(found) <= set(names), found


def test_logits_match_transformers_and_routing_gaps_exceed_rounding(rig, hf_models, stream):
    hf32, hf64 = hf_models
    with torch.inference_mode():
        x = torch.tensor([stream])
        l32 = hf32(input_ids=x).logits[0].double()
        l64 = hf64(input_ids=x).logits[0]
        calls = [router_calls(model, x, [0]) for model in (hf32, hf64)]  # layer 0 routes
    routing = routing_agreement(*calls, [hf64.model.layers[0].mlp.gate])
    err32 = float((l32 - l64).abs().max())
    slots = list(range(1, len(LENGTHS) + 1))
    # Decode batches of 4 and 1 (the capacities 4 and 1).
    worst = teacher_forced_errors(rig, stream, LENGTHS, DECODE_STEPS, l32, (slots[:4], slots[4:]))
    bound = 4 * err32 + 1e-6
    print("\nqwen3_moe acceptance:", json.dumps({"err_hf32": err32, "bound": bound, "routing": routing,
                                                  "max|flare-hf32|": worst, "logit_scale": float(l64.abs().max())}))
    assert routing["disagreements_outside_rounding"] == 0, routing
    assert worst["prefill"] <= bound and worst["decode"] <= bound, (worst, bound)


def triton_matches_reference(model: str, opts: list[str], stream, tickets: bool = False,
                             step_norms: bool = False) -> None:
    """The CUDA path (Triton kernels, under the CPU interpreter here) against the reference
    path on one core of ``model`` (``opts`` with prefill programs of 64 rows,
    conftest.INTERPRETER_CHUNK): two prefills, the first cut inside a chunk (the second's cut
    took the same path: under the interpreter each prefill program costs seconds), then two
    decode steps of a batch. ``tickets``: the mixture-of-experts blocks and the attention get ticket
    counters, as a CUDA core's (decode steps route in the router's launch, the attention's last
    programs fold its splits), left zeroed; ``step_norms``: the norms are a step's row-invariant
    launches (``--step-norms invariant``: a decode step's post-attention norm goes into the router's
    and the experts' loads, the q/k norms into the launch that writes the keys and values)."""
    from flare.prepare.attention import TICKETS_BUFFER
    from flare.prepare.kernels.rownorm import make_norms_row_invariant

    core = prepare_core(model, [*opts, *INTERPRETER_CHUNK], name=f"{model}-prefill64")
    rigs = {impl: load_rig(core, seed=3, attention=impl) for impl in ("reference", "triton")}
    assert rigs["triton"].m.capacities.prefill_capacities == (64,)
    counters = torch.zeros(64, dtype=torch.int32)
    if tickets:
        blocks = [m for m in rigs["triton"].model.modules() if hasattr(type(m), "flare_route_tickets")]
        assert blocks
        for block in blocks:
            block.flare_route_tickets = counters
        rigs["triton"].v[TICKETS_BUFFER] = counters
    if step_norms:
        make_norms_row_invariant(rigs["triton"].model, steps=True)
    out = {}
    for impl, r in rigs.items():
        logits = []
        for slot, L in ((1, 37), (2, 9)):
            admit(r, slot, stream[:L], r.pages(4), seed=slot)
            logits.append(prefill(r, slot, stream[:L], splits=(5,) if slot == 1 else ())[1][None])
        for step in range(2):
            logits.append(decode(r, [1, 2], [stream[100 + step], stream[120 + step]])[0])
        out[impl] = torch.cat(logits)
    torch.testing.assert_close(out["triton"], out["reference"], atol=2e-4, rtol=1e-4)
    assert not counters.any()


def test_triton_experts_match_the_reference_path(stream, monkeypatch):
    """... and the CUDA path routes every program a token at a time (``route_rows``): decode
    steps and prefill chunks alike, so a token's weights do not depend on the capacity."""
    from flare.prepare.kernels import moe as K

    calls, added = [], []
    rows, experts = K.route_rows, K.experts_decode
    monkeypatch.setattr(K, "route_rows",
                        lambda logits, *a, **kw: calls.append(logits.shape[0]) or rows(logits, *a, **kw))
    monkeypatch.setattr(K, "experts_decode",
                        lambda *a, **kw: added.append(kw.get("residual") is not None) or experts(*a, **kw))
    triton_matches_reference("qwen3-moe-tiny", TINY_OPTS, stream)
    decodes = set(calls) - {64}  # prefill.64, and the decode capacities the stream ran
    assert 64 in calls and decodes and decodes <= {1, 2, 4, 8}, calls
    # (the decode kernels add the decoder layer's residual: its forward rewritten with add_norm_mlp)
    assert added and all(added), added


def test_tp2_splits_the_experts_and_matches_tp1(moe_core, hf_models):
    """TP=2 (each rank half the experts and half the heads; the router replicated; partial
    expert outputs all-reduced) against TP=1 through the runtime executor, teacher-forced:
    within 6 x the float32 rounding of the network (test_tensor_parallel.py's bound), and
    the same greedy tokens."""
    import asyncio

    import numpy as np
    from safetensors.numpy import load_file

    from flare.core.manifest import load_manifest, rank_images
    from tests.test_tensor_parallel import FORCED_STEPS, _drive, _prompts

    tp2 = prepare_core("qwen3-moe-tiny", [*TINY_OPTS, "--tp", "2"])
    m = load_manifest(moe_core)
    rank0 = load_file(str(rank_images(tp2, load_manifest(tp2))[0]))
    assert rank0["w.model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4  # of 8 experts
    assert rank0["w.model.layers.0.mlp.gate.weight"].shape[0] == 8  # the router sees all of them
    prompts = _prompts(m.capacities.sampling_vocab)
    rng = np.random.default_rng(8)
    forced = [rng.integers(3, m.capacities.sampling_vocab, FORCED_STEPS).tolist() for _ in prompts]
    r1, r2 = asyncio.run(_drive(moe_core, prompts, forced)), asyncio.run(_drive(tp2, prompts, forced))
    hf32, hf64 = hf_models
    with torch.inference_mode():
        err32 = max(float((hf32(torch.tensor([p + f])).logits[0].double()
                           - hf64(torch.tensor([p + f])).logits[0]).abs().max()) for p, f in zip(prompts, forced))
    bound = 6 * err32 + 1e-6
    pairs = list(zip(r1["prefill_logits"], r2["prefill_logits"])) + list(zip(r1["decode_logits"], r2["decode_logits"]))
    worst = max(float(np.abs(a.astype(np.float64) - b).max()) for a, b in pairs)
    print(f"\nqwen3_moe TP=2 vs TP=1: err32 {err32:.3g}, bound {bound:.3g}, max {worst:.3g}")
    assert worst <= bound
    assert r1["greedy"] == r2["greedy"]


def test_active_bytes_roofline_reads_only_the_routed_experts(moe_core):
    """bench.collect's bytes of a decode step: one row reads its k of E experts per layer,
    more rows the expected union of theirs, never more than every expert; the rest of the
    weights as the dense cores count them."""
    from bench.collect import step_bytes

    m = load_manifest(moe_core)
    weights = [b for b in m.buffers if b.role == BufferRole.weight]
    experts = sum(b.nbytes for b in weights if ".mlp.experts." in b.name)
    embed = next(b for b in weights if b.name.endswith("embed_tokens.weight"))
    dense = sum(b.nbytes for b in weights) - experts - embed.nbytes  # untied: embedding by rows
    one, four, many = (step_bytes(m, c) for c in (1, 4, 4096))
    assert one["routed_experts_all"] == experts > 0
    assert one["routed_experts"] == round(experts * 2 / 8)  # top-2 of 8 in every sparse layer
    assert one["weights"] == dense + one["routed_experts"]
    assert one["routed_experts"] < four["routed_experts"] < many["routed_experts"] <= experts
    assert many["routed_experts"] == pytest.approx(experts, rel=1e-6)
    assert four["total"] == four["weights"] + four["embedding_rows"] + four["state_read_write"]


def test_step_q_and_k_norms_and_the_rotary_in_one_launch(stream, monkeypatch):
    """Qwen3's attention (Transformers' ``apply_rotary_pos_emb``, found to be ``rotate_half``'s)
    with ``--step-norms invariant`` on the CUDA path under the interpreter: a decode step's
    per-head q and k norms and rotary are one ``qk_norm_rotary`` launch a layer, which also writes
    the keys and values to the pages (no ``write_kv_triton`` launch), and the tokens
    and, within float32 rounding, the logits are those of the same norms with the layer's own
    code (each norm a launch, the rotary apart). The first core's experts also route in the
    router's launch (ticket counters, as a CUDA core's; no shared expert here), the other's with
    ``route_rows``; its attention's decode launches fold their splits in their last programs with
    the same counters (no combine launch), and its sparse layer's add and post-attention norm go
    into the router's and the experts' loads (no norm launch)."""
    from flare.prepare.attention import TICKETS_BUFFER
    from flare.prepare.kernels import kv_write as KW
    from flare.prepare.kernels import moe as K
    from flare.prepare.kernels import paged_attention as A
    from flare.prepare.kernels import rownorm as R

    core = prepare_core("qwen3-moe-tiny", [*TINY_OPTS, *INTERPRETER_CHUNK], name="qwen3-moe-tiny-prefill64")
    one, apart = prefilled_rigs(core, {1: stream[:21], 2: stream[30:40]}, 2, attention="triton")
    for rig in (one, apart):
        R.make_norms_row_invariant(rig.model, steps=True)
    attention = [layer.self_attn for layer in one.model.model.layers]
    assert all(a.flare_rotate_half for a in attention)
    apart_attention = [layer.self_attn for layer in apart.model.model.layers]
    for a in apart_attention:
        a.flare_rotate_half = False
    counters = torch.zeros(64, dtype=torch.int32)
    blocks = [m for m in one.model.modules() if hasattr(type(m), "flare_route_tickets")]
    for block in blocks:
        block.flare_route_tickets = counters
    one.v[TICKETS_BUFFER] = counters  # (the attention's decode launches fold their splits with them too)
    combines, combine = [], A._combine_kernel
    monkeypatch.setattr(A, "_combine_kernel", type("Counted", (), {
        "__getitem__": lambda self, grid: combines.append(grid) or combine[grid]})())
    routed_apart, rows = [], K.route_rows
    monkeypatch.setattr(K, "route_rows", lambda logits, *a, **kw: routed_apart.append(logits.shape[0])
                        or rows(logits, *a, **kw))
    taken, real = [], R.qk_norm_rotary

    def counted(*a, **kw):
        out = real(*a, **kw)
        taken.extend([a[0]] if out is not None else [])
        return out

    monkeypatch.setattr(R, "qk_norm_rotary", counted)
    writes, write = [], KW.write_kv_triton
    monkeypatch.setattr(KW, "write_kv_triton", lambda *a: writes.append(a[1]) or write(*a))
    added, norm = [], R.rms_norm
    monkeypatch.setattr(R, "rms_norm", lambda x, w, *a, **kw: added.extend([w] if "residual" in kw else [])
                        or norm(x, w, *a, **kw))
    decode_alike(one, apart, [1, 2], steps=2)
    # The add and the post-attention norm: in the router's and the experts' loads in the first core's
    # sparse layer (layer 0), a launch of their own in its dense layer and in every layer of the other.
    post = [[layer.post_attention_layernorm.weight for layer in rig.model.model.layers] for rig in (one, apart)]
    assert [id(w) for w in added] == 2 * [id(post[0][1]), id(post[1][0]), id(post[1][1])]
    assert taken == 2 * [a.q_norm for a in attention]
    # (the keys and values go to the pages in that launch: the rig apart writes them in a launch of its own)
    assert writes == 2 * [a.kv_layer for a in apart_attention]
    assert len(combines) == len(writes)  # (the rig apart's: the other's last programs fold the splits)
    assert blocks and len(routed_apart) == 2 * len(blocks) and not counters.any()  # (the other core's only)
