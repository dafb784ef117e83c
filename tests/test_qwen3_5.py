"""Numerical acceptance of the hybrid recipe: the qwen3_5-tiny core's programs
(paged attention layers, Gated DeltaNet over per-slot state rows) against
Transformers' own ``Qwen3_5ForCausalLM`` on the same weights, teacher-forced.

Bound (derived as in ``test_programs.py``): the float64 model stands for the
exact logits z; ``err32 = max |hf32 - hf64|`` is the rounding error of one valid
float32 evaluation of this network on these inputs. Flare evaluates the same
function in float32 in another order (paged KV, prefill chunks of 128 relative
to each call, the chunked delta rule for prefill but its per-token recurrent
form for decode, batched decode rows), so its own error is a sum of rounding
terms of the same sizes; allowing up to 3 * err32 for it, the triangle
inequality gives ``|flare - hf32| <= 4 * err32`` (+ 1e-6). For hf64 to be a
float64 evaluation, the reference's float32 islands are lifted: Transformers
runs the delta rule and both RMS norms in float32 whatever the model dtype, so
the float64 model uses an independent float64 delta rule (the per-token
definition, not the chunked algorithm under test) and float64 norms. Measured
numbers are printed (``pytest -s``).
"""

from __future__ import annotations

import contextlib
import json
import types

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import HYBRID_OPTS, INTERPRETER_CHUNK, count_calls, prepare_core
from tests.rig import admit, decode, decode_alike, load_rig, prefill, prefilled_rigs

LENGTHS = (15, 16, 17, 63, 64, 65, 127, 128, 129, 200, 290)  # pages of 16, delta-rule chunks of 64, prefill 128
DECODE_STEPS = 8
GROUPS = ((0, 1, 2, 3), (4, 5, 6), (7, 8), (9,), (10,))


def exact_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, **kwargs):
    """The gated delta rule by its per-token definition, in float64."""
    dt = torch.float64
    hk, hv = key.shape[2], value.shape[2]
    if hk != hv:
        query = query.repeat_interleave(hv // hk, dim=2)
        key = key.repeat_interleave(hv // hk, dim=2)
    q, k, v, b, gg = (x.transpose(1, 2).to(dt) for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    B, H, T, Dk = k.shape
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=dt) if initial_state is None else initial_state.to(dt)
    out = torch.zeros_like(v)
    for t in range(T):
        S = S * gg[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (S * k[:, :, t, :, None]).sum(-2)) * b[:, :, t, None]
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (S * q[:, :, t, :, None]).sum(-2)
    return out.transpose(1, 2).to(query.dtype), (S if output_final_state else None)


def _norm64(self, x):
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)) * (1.0 + self.weight)


def _gated_norm64(self, x, gate):
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x * F.silu(gate)


@contextlib.contextmanager
def float64_islands(model, module: str = "qwen3_5", family: str = "Qwen3_5"):
    """``module``: Transformers' model folder (``qwen3_5``, ``qwen3_5_moe``); ``family``: its
    class prefix (``Qwen3_5``, ``Qwen3_5Moe``)."""
    import importlib

    q = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    saved = q.torch_chunk_gated_delta_rule
    q.torch_chunk_gated_delta_rule = exact_delta_rule
    for mod in model.modules():
        if isinstance(mod, getattr(q, f"{family}RMSNorm")):
            mod.forward = types.MethodType(_norm64, mod)
        elif isinstance(mod, getattr(q, f"{family}RMSNormGated")):
            mod.forward = types.MethodType(_gated_norm64, mod)
    try:
        yield
    finally:
        q.torch_chunk_gated_delta_rule = saved


@pytest.fixture(scope="module")
def rig(hybrid_core):
    return load_rig(hybrid_core)


@pytest.fixture(scope="module")
def hf_models(rig):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from flare.prepare.recipes import by_name

    weights = load_file(str(rig.core / rig.m.arena.image))
    config = by_name(rig.m.reference.recipe).config_from_json(rig.m.reference.config)
    config._attn_implementation = "eager"
    config.get_text_config()._attn_implementation = "eager"
    models = []
    for dtype in (torch.float32, torch.float64):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        state = {}
        for spec in rig.specs:
            if spec.from_checkpoint:
                state.update(spec.checkpoint_views(weights[spec.buffer].to(dtype)))
        model.load_state_dict(state, strict=True, assign=True)
        model.model.rotary_emb = Qwen3_5TextRotaryEmbedding(config=config.get_text_config())
        models.append(model.to(dtype).eval())
    return models


@pytest.fixture(scope="module")
def stream() -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(100, 40000, (max(LENGTHS) + DECODE_STEPS,), generator=g).tolist()


@pytest.fixture(scope="module")
def comparison(rig, hf_models, stream):
    hf32, hf64 = hf_models
    with torch.inference_mode():
        x = torch.tensor([stream])
        l32 = hf32(input_ids=x).logits[0].double()
        with float64_islands(hf64):
            l64 = hf64(input_ids=x).logits[0]
    head = rig.model.lm_head.weight.detach().double()
    pre_d, dec_d, err32, mism = 0.0, 0.0, float((l32 - l64).abs().max()), []
    rows = {"prefill": 0, "decode": 0}
    for group in GROUPS:
        slots = list(range(1, len(group) + 1))
        for slot, i in zip(slots, group):
            L = LENGTHS[i]
            admit(rig, slot, stream[:L], rig.pages(-(-(L + DECODE_STEPS) // 16)), seed=i)
            hidden, _, _ = prefill(rig, slot, stream[:L])
            lf = hidden.double() @ head.T
            pre_d = max(pre_d, float((lf - l32[:L]).abs().max()))
            rows["prefill"] += L
        for step in range(DECODE_STEPS):
            logits, _ = decode(rig, slots, [stream[LENGTHS[i] + step] for i in group])
            for k, i in enumerate(group):
                pos = LENGTHS[i] + step
                dec_d = max(dec_d, float((logits[k].double() - l32[pos]).abs().max()))
                a, b = int(logits[k].argmax()), int(l64[pos].argmax())
                if a != b:
                    mism.append((LENGTHS[i], pos, a, b, float(l64[pos, b] - l64[pos, a])))
                rows["decode"] += 1
    bound = 4 * err32 + 1e-6
    report = {"err_hf32": err32, "bound": bound, "max|flare-hf32| prefill": pre_d, "max|flare-hf32| decode": dec_d,
              "rows": rows, "argmax_mismatches": mism, "logit_scale": float(l64.abs().max())}
    print("\nqwen3_5 acceptance:", json.dumps(report, indent=1))
    return report


def test_reference_error_is_measured(comparison):
    assert 1e-8 < comparison["err_hf32"] < 1e-2


def test_prefill_and_decode_logits_match_transformers(comparison):
    c = comparison
    assert c["rows"] == {"prefill": sum(LENGTHS), "decode": DECODE_STEPS * len(LENGTHS)}
    assert c["max|flare-hf32| prefill"] <= c["bound"], c
    assert c["max|flare-hf32| decode"] <= c["bound"], c


def test_argmax_agrees_except_proven_near_ties(comparison):
    bad = [x for x in comparison["argmax_mismatches"] if x[4] > comparison["bound"]]
    assert not bad, bad


def test_recurrent_state_shapes_the_logits(rig, stream):
    """The test could not fail if the recurrence did not matter: zeroing one slot's
    recurrent state before a decode step must move its logits far beyond the bound."""
    L = 40
    admit(rig, 1, stream[:L], rig.pages(4), seed=0)
    prefill(rig, 1, stream[:L])
    saved = {n: rig.v[n][1].clone() for n in ("state.gdn.recurrent", "state.gdn.conv", "state.len")}
    a, _ = decode(rig, [1], [stream[L]])
    for n, t in saved.items():
        rig.v[n][1] = t
    rig.v["state.gdn.recurrent"][1] = 0
    b, _ = decode(rig, [1], [stream[L]])
    assert float((a - b).abs().max()) > 1e-2


def test_triton_path_matches_the_reference_path(stream):
    """The CUDA path of the hybrid (kernels/gdn.py's convolution, gate and in-place
    delta-rule kernels, the Triton paged attention) under Triton's CPU interpreter
    against the reference path, program by program on one core (prefill programs of 64
    rows, conftest.INTERPRETER_CHUNK): prefill chunks cut inside delta-rule chunks (one
    crossing a block's end; the other two prompts in one chunk each: under the interpreter a
    prefill program costs seconds, and their cuts took the same paths), then decode steps of a
    batch with a padded row. Logits and
    every slot's state rows agree to float32 rounding; the null slot and slots outside
    the batch are left bitwise as they were."""
    core = prepare_core("qwen3_5-tiny", [*HYBRID_OPTS, *INTERPRETER_CHUNK], name="qwen3_5-tiny-prefill64")
    rigs = {impl: load_rig(core, seed=3, attention=impl) for impl in ("reference", "triton")}
    assert rigs["triton"].m.capacities.prefill_capacities == (64,)
    prompts = {1: stream[:37], 2: stream[50:120], 4: stream[130:139]}
    out = {}
    for impl, r in rigs.items():
        untouched = {(n, s): r.v[n][s].clone() for n in ("state.gdn.conv", "state.gdn.recurrent") for s in (0, 3)}
        logits = []
        for slot, p in prompts.items():
            admit(r, slot, p, r.pages(8), seed=slot)
            logits.append(prefill(r, slot, p, splits=(5, 21) if slot == 2 else ())[1])
        for step in range(3):
            rows, _ = decode(r, [1, 2, 4], [stream[200 + step], stream[250 + step], stream[280 + step]])
            logits.append(rows)
        for (n, s), t in untouched.items():
            assert torch.equal(r.v[n][s], t), (impl, n, s)
        out[impl] = (logits, {n: r.v[n][[0, 1, 2, 4]].clone() for n in ("state.gdn.conv", "state.gdn.recurrent")})
    (ref_logits, ref_state), (tri_logits, tri_state) = out["reference"], out["triton"]
    for a, b in zip(ref_logits, tri_logits):
        torch.testing.assert_close(b, a, atol=2e-4, rtol=1e-4)
    for n in ref_state:
        torch.testing.assert_close(tri_state[n], ref_state[n], atol=1e-4, rtol=1e-4, msg=n)
    assert float(ref_state["state.gdn.recurrent"].abs().max()) > 1e-3  # the states are not trivially zero


def test_decode_steps_take_the_convolution_in_the_input_projections_gemv(stream, monkeypatch):
    """With each Gated DeltaNet's input projection on a GEMV without a split (``--step-gemms``), a
    decode step computes the layer's convolution in that GEMV's epilogue (``gemv_conv_linear``, no
    ``conv1d_decode_step`` launch; ``check_conv_folds`` takes it at the decode counts) and gives the
    logits, the tokens and every state row bit for bit as the same GEMVs with the convolution apart,
    at two rows and at one (one rig, its arena put back between the two runs). Only the Gated
    DeltaNets' projections take the GEMV: the other layers' products are the same in both runs
    (their GEMVs in every projection: test_one_row_steps_on_the_gemv_fold_the_activation_and_the_
    residual), and under the interpreter each of their GEMV programs costs as much."""
    from flare.prepare.kernels import gdn as K
    from flare.prepare.kernels import gemm, gemv
    from flare.prepare.recipes import qwen3_5 as Q

    core = prepare_core("qwen3_5-tiny", [*HYBRID_OPTS, *INTERPRETER_CHUNK], name="qwen3_5-tiny-prefill64")
    (r,) = prefilled_rigs(core, {1: stream[:21], 2: stream[30:47]}, 1, attention="triton")
    # (the GEMV's rows across counts: tests/test_gemv.py; under the interpreter 12 s here)
    monkeypatch.setattr(gemm, "_gemv_same_rows", lambda *a: True)
    layers = list(r.model.model.layers)
    mixers = [layer.linear_attn for layer in layers if hasattr(layer, "linear_attn")]
    assert gemm.force_step_gemv(mixers, [1, 2, 4])
    gdn = len(mixers)
    assert len(gemm.check_conv_folds(layers, [1, 2])) == gdn  # (its bits checked here, the interpreter's)
    calls = {"fold": 0, "conv": 0}
    count_calls(monkeypatch, gemv, "gemv_conv_linear", calls, "fold")
    count_calls(monkeypatch, K, "conv1d_decode_step", calls, "conv")
    steps = ([1, 2], [2])
    start = r.arena.clone()
    start_rows = {n: r.v[n].clone() for n in (Q.CONV_STATE, Q.RECURRENT_STATE)}
    out = {}
    for name in ("apart", "folded"):
        r.arena.copy_(start)
        with monkeypatch.context() as m:
            if name == "apart":
                m.setattr(Q, "_conv_fold_tiling", lambda *a: None)
            runs = [decode(r, slots, [int(r.v["state.pending"][s]) for s in slots]) for slots in steps]
        out[name] = runs, {n: r.v[n].clone() for n in (Q.CONV_STATE, Q.RECURRENT_STATE)}
        want = (0, len(steps) * gdn) if name == "apart" else (len(steps) * gdn, 0)
        assert (calls["fold"], calls["conv"]) == want, (name, calls)
        calls.update(fold=0, conv=0)
    for (a_logits, a_done), (b_logits, b_done) in zip(out["apart"][0], out["folded"][0]):
        assert torch.equal(a_logits, b_logits) and a_done == b_done
    for n, t in out["apart"][1].items():
        assert torch.equal(out["folded"][1][n], t), n
        assert not torch.equal(t, start_rows[n]), n  # the steps moved the state


def test_one_row_steps_on_the_gemv_fold_the_activation_and_the_residual(stream, monkeypatch):
    """``--step-gemms gemv`` (kernels/gemm.force_step_gemv) on the CUDA path under Triton's
    interpreter: one-row decode steps take the GEMV for every projection without a bias, with
    each MLP's activation in down_proj's loads and the layer's residual add in its epilogue (the
    folds the 9B shape's measured step GEMMs take on the H200), and give the tokens and, within
    float32 rounding, the logits of the same core without them; each Gated DeltaNet layer's
    gated norm runs as one kernel after its delta rule (gdn.gated_rms_norm) in every decode step."""
    from flare.prepare.kernels import gemm

    core = prepare_core("qwen3_5-tiny", [*HYBRID_OPTS, *INTERPRETER_CHUNK], name="qwen3_5-tiny-prefill64")
    plain, folded = prefilled_rigs(core, {1: stream[:21]}, 2, attention="triton")
    layers = list(folded.model.model.layers)
    # (force_step_gemv's check that a row's bits do not depend on the row count, which would run
    # the GEMV 4 to 8 times a weight shape here: tests/test_gemv.py checks the GEMV's rows and
    # test_gemm_rows.test_forced_gemv_takes_every_step_row_count the check itself, as the other
    # GEMV tests here take them)
    monkeypatch.setattr(gemm, "_gemv_same_rows", lambda *a: True)
    chosen = gemm.force_step_gemv(layers, [1, 2, 4])
    assert chosen and all(c == {r: gemm.FORCED_GEMV for r in (1, 2, 4)} for c in chosen.values())
    from flare.prepare.kernels import gdn as K

    calls, norms = [], []
    real, real_norm = gemm.gemv_linear, K.gated_rms_norm
    monkeypatch.setattr(gemm, "gemv_linear", lambda *a, **kw: calls.append(sorted(k for k, v in kw.items() if v is not None))
                        or real(*a, **kw))
    monkeypatch.setattr(K, "gated_rms_norm", lambda *a, **kw: norms.append(a[0].shape) or real_norm(*a, **kw))
    decode_alike(plain, folded, [1], steps=2)
    gdn = sum(1 for layer in layers if hasattr(layer, "linear_attn"))
    assert 0 < gdn < len(layers)
    assert len(norms) == 2 * 2 * gdn  # both rigs, two steps
    assert calls.count(["residual", "swiglu"]) == 2 * len(layers)
    assert [] in calls  # the projections without a fold (in_proj, q/k/v, o_proj) took it too


def test_step_norms_in_one_launch_with_the_residual_add(stream, monkeypatch):
    """``--step-norms invariant`` (kernels/rownorm.make_norms_row_invariant(steps=True)) on the
    CUDA path under Triton's interpreter: in decode steps every decoder layer's residual add
    after its mixer and its post-attention norm are one ``rms_norm`` launch (the rewritten
    layer forward's ``add_norm``), the input norms and the final norm one launch each without
    the add, the attention layers' per-head q/k norms and rotary one ``qk_norm_rotary`` launch,
    and the tokens and, within float32 rounding, the logits are those of the same core without
    them; without that launch (each q/k norm one ``rms_norm`` launch, the rotary compiled) the
    same."""
    from flare.prepare.kernels import kv_write as KW
    from flare.prepare.kernels import rownorm as R

    core = prepare_core("qwen3_5-tiny", [*HYBRID_OPTS, *INTERPRETER_CHUNK], name="qwen3_5-tiny-prefill64")
    plain, switched, apart = prefilled_rigs(core, {1: stream[:21], 2: stream[30:40]}, 3, attention="triton")
    layers = list(switched.model.model.layers)
    for rig in (switched, apart):
        R.make_norms_row_invariant(rig.model, steps=True)
    for layer in apart.model.model.layers:
        if hasattr(layer, "self_attn"):
            layer.self_attn.flare_rotate_half = False  # (this layer's own code: norms, then the rotary)
    calls, qk = [], []
    real, real_qk = R.rms_norm, R.qk_norm_rotary
    monkeypatch.setattr(R, "rms_norm", lambda *a, **kw: calls.append("residual" in kw) or real(*a, **kw))


    def counted(*a, **kw):  # (the q norms of the calls that took the launch)
        out = real_qk(*a, **kw)
        qk.extend([a[0]] if out is not None else [])
        return out

    monkeypatch.setattr(R, "qk_norm_rotary", counted)
    writes, write = [], KW.write_kv_triton
    monkeypatch.setattr(KW, "write_kv_triton", lambda *a: writes.append(a[1]) or write(*a))
    attention = [layer.self_attn.q_norm for layer in layers if hasattr(layer, "self_attn")]
    assert 0 < len(attention) < len(layers)
    for _ in range(2):  # two steps of each rig, every rig feeding its own pending tokens
        calls.clear()
        qk.clear()
        logits, tokens = zip(*(decode(r, [1, 2], [int(r.v["state.pending"][s]) for s in (1, 2)])
                               for r in (plain, switched, apart)))
        assert tokens[0] == tokens[1] == tokens[2]
        for other in (logits[0], logits[2]):
            torch.testing.assert_close(other, logits[1], atol=1e-4, rtol=1e-4)
        # (the switched rig's: its add and norms, its q/k launches; the rig apart's: the same adds
        # and norms, and each q/k norm a launch of its own)
        assert calls.count(True) == 2 * len(layers) and qk == attention
        # (the switched rig writes the keys and values in its q/k launch; the other two apart)
        assert len(writes) == 2 * len(attention)
        writes.clear()
        assert calls.count(False) == 2 * (len(layers) + 1) + 2 * len(attention)


def test_steps_with_the_activation_in_the_gate_up_gemv(stream, monkeypatch):
    """A gated MLP's [gate; up] projection on a tensor-core GEMV with the activation in its
    epilogue (``gemm.GLU_TILINGS``) and its down projection on the tensor-core GEMV with the
    residual in its epilogue, at every step row count, on the CUDA path under Triton's
    interpreter: every layer's MLP is those two launches in decode steps, and the tokens and,
    within float32 rounding, the logits are those of the same core without them (a float32 core:
    in bfloat16 the GEMV rounds the activation once where the compiled MLP may differ by an ulp)."""
    from flare.prepare.kernels import gemm
    from flare.prepare.kernels.gemv import GemvTiling

    core = prepare_core("qwen3_5-tiny", [*HYBRID_OPTS, *INTERPRETER_CHUNK], name="qwen3_5-tiny-prefill64")
    plain, glu = prefilled_rigs(core, {1: stream[:21], 2: stream[30:40]}, 2, attention="triton")
    layers = list(glu.model.model.layers)
    for layer in layers:
        for proj, tiling in ((layer.mlp.gate_up_proj, GemvTiling(16, 32, 4, dot=1, stages=2, glu=1)),
                             (layer.mlp.down_proj, GemvTiling(16, 32, 4, dot=1, stages=2))):
            gemm._switch(proj)
            proj.flare_step_tiling = {c: tiling for c in (1, 2, 4)}
    calls = []
    real = gemm.gemv_linear
    monkeypatch.setattr(gemm, "gemv_linear", lambda x, w, t, **kw: calls.append((t.glu, kw.get("residual") is not None))
                        or real(x, w, t, **kw))
    decode_alike(plain, glu, [1, 2], steps=2)
    assert calls == [(1, False), (0, True)] * (2 * len(layers))  # two steps


def test_steps_with_the_add_and_norm_in_the_gate_up_gemv(stream, monkeypatch):
    """The GLU steps above with the step norms switched (``--step-norms invariant``) and each gate/up
    projection taking the add and the post-attention norm before it in its loads
    (``flare_norm_rows``, ``fused.add_norm_mlp``): every layer's add, norm and MLP are those two
    launches in decode steps (no add-and-norm ``rms_norm`` launch; the input norms keep theirs),
    and the tokens and, within float32 rounding, the logits are those of the same core without
    them."""
    from flare.prepare.kernels import gemm
    from flare.prepare.kernels import rownorm as R
    from flare.prepare.kernels.gemv import GemvTiling

    core = prepare_core("qwen3_5-tiny", [*HYBRID_OPTS, *INTERPRETER_CHUNK], name="qwen3_5-tiny-prefill64")
    plain, folded = prefilled_rigs(core, {1: stream[:21], 2: stream[30:40]}, 2, attention="triton")
    layers = list(folded.model.model.layers)
    R.make_norms_row_invariant(folded.model, steps=True)
    for layer in layers:
        for proj, tiling in ((layer.mlp.gate_up_proj, GemvTiling(16, 32, 4, dot=1, stages=2, glu=1)),
                             (layer.mlp.down_proj, GemvTiling(16, 32, 4, dot=1, stages=2))):
            gemm._switch(proj)
            proj.flare_step_tiling = {c: tiling for c in (1, 2, 4)}
        layer.mlp.gate_up_proj.flare_norm_rows = frozenset({1, 2, 4})
    calls, norms = [], []
    real, real_norm = gemm.gemv_norm_linear, R.rms_norm
    monkeypatch.setattr(gemm, "gemv_norm_linear", lambda x, w, t, n: calls.append((t.glu, n.residual is not None))
                        or real(x, w, t, n))
    monkeypatch.setattr(R, "rms_norm", lambda *a, **kw: norms.append("residual" in kw) or real_norm(*a, **kw))
    decode_alike(plain, folded, [1, 2], steps=2)
    assert calls == [(1, True)] * (2 * len(layers))  # two steps
    # (the input norms and the final norm; the attention layers' q/k norms are in their
    # qk_norm_rotary launch)
    assert not any(norms) and len(norms) == 2 * (len(layers) + 1)


def test_steps_with_the_input_norms_in_the_mixers_gemvs(stream, monkeypatch):
    """With the step norms switched (``--step-norms invariant``) and each decoder layer's q/k/v or
    Gated DeltaNet input projection on a ``dot`` GEMV without a split taking the layer's input norm
    in its loads (``fused.input_norm_projections``, linked by ``link_input_norm`` as
    ``choose_step_gemms`` links them where that family wins): a decode step's input norms are no
    launches of their own (the layer passes the norm's input on, ``fused.input_norm``), the Gated
    DeltaNets' GEMVs take their convolution and the norm together (``gemv_conv_linear``), the
    attention layers' GEMVs the norm (``gemv_norm_linear``; the Gated DeltaNets' too where the
    convolution stays apart), and the tokens and, within float32 rounding, the logits are those of
    the same core without them."""
    from flare.prepare.kernels import gemm, gemv
    from flare.prepare.kernels import rownorm as R
    from flare.prepare.kernels.gemv import GemvTiling
    from flare.prepare.recipes import fused
    from flare.prepare.recipes import qwen3_5 as Q

    core = prepare_core("qwen3_5-tiny", [*HYBRID_OPTS, *INTERPRETER_CHUNK], name="qwen3_5-tiny-prefill64")
    plain, folded = prefilled_rigs(core, {1: stream[:21], 2: stream[30:40]}, 2, attention="triton")
    layers = list(folded.model.model.layers)
    R.make_norms_row_invariant(folded.model, steps=True)
    monkeypatch.setattr(gemm, "_gemv_same_rows", lambda *a: True)  # (tests/test_gemv.py checks the rows)
    found = fused.input_norm_projections(layers)
    assert [proj for proj, _, _ in found] == [layer.linear_attn.in_proj if hasattr(layer, "linear_attn")
                                             else layer.self_attn.qkv_proj for layer in layers]
    for proj, norm, mixer in found:
        gemm._switch(proj)
        proj.flare_step_tiling = {c: GemvTiling(16, 32, 4, dot=1, stages=2) for c in (1, 2, 4)}
        proj.flare_norm_rows = frozenset({1, 2, 4})
        fused.link_input_norm(proj, norm, mixer)
    gdn = sum(1 for layer in layers if hasattr(layer, "linear_attn"))
    assert len(gemm.check_conv_folds(layers, [1, 2])) == gdn
    calls, norms = [], []
    real_conv, real_norm, real_rms = gemv.gemv_conv_linear, gemm.gemv_norm_linear, R.rms_norm
    monkeypatch.setattr(gemv, "gemv_conv_linear", lambda x, w, t, c, norm=None: calls.append(("conv", norm is not None))
                        or real_conv(x, w, t, c, norm=norm))
    monkeypatch.setattr(gemm, "gemv_norm_linear", lambda x, w, t, n, tickets=None:
                        calls.append(("norm", n.residual is not None)) or real_norm(x, w, t, n, tickets=tickets))
    monkeypatch.setattr(R, "rms_norm", lambda x, w, *a, **kw: norms.append(x.shape[-1]) or real_rms(x, w, *a, **kw))
    decode_alike(plain, folded, [1, 2], steps=2)
    attention = len(layers) - gdn
    assert sorted(calls) == sorted([("conv", True)] * (2 * gdn) + [("norm", False)] * (2 * attention))
    hidden = folded.model.config.hidden_size
    # (the post-attention norms and the final norm keep their launches; none of the input norms does)
    assert norms.count(hidden) == 2 * (len(layers) + 1)
    # Steps where the input projections leave the convolution apart (verify steps, Qwen3-Next):
    # every one takes the norm through its module.
    with monkeypatch.context() as m:
        m.setattr(Q, "_conv_fold_tiling", lambda *a: None)
        calls.clear()
        decode_alike(plain, folded, [1, 2], steps=1)
        assert sorted(calls) == [("norm", False)] * len(layers)
    # A hook on a mixer (which would see its input) keeps the layer's input norm a launch of its own.
    handle = layers[0].linear_attn.register_forward_pre_hook(lambda m, a: None)
    try:
        calls.clear()
        norms.clear()
        decode(folded, [1], [int(folded.v["state.pending"][1])])
        assert ("conv", False) in calls and norms.count(hidden) == len(layers) + 2
    finally:
        handle.remove()
