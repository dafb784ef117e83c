"""Gated DeltaNet kernels at Qwen3.5-9B's geometry: GPU time per layer, capture, accuracy.

usage: python bench/gdn_kernels.py --out RESULT.json [--replays 100] [--budget-s 150]
       python bench/gdn_kernels.py --smoke --out /tmp/gdn-smoke.json     (CPU, Triton interpreter, tiny shapes)

Needs torch, triton, numpy and (optionally) fla-core; Flare's own kernels are
imported from this checkout's src/ (they import only torch and triton).

Candidates, per layer (Hk 16, Hv 32, Dk = Dv = 128, conv_dim 8192, kernel 4, bf16
inputs, float32 recurrent state; the state buffers are [rows, 2 layers, ...] and
layer 1 is used, so every state access is a strided view as in the real buffers):

* decode[B].rule.*    one recurrent step for B rows (B = 1, 4), each on its own slot:
  ``ours[bv,w]`` (in place, gates fused), ``fla`` (fused_recurrent with its in-kernel
  gates, state rows gathered before and scattered after), ``torch`` (the recipe's ops).
* decode[B].conv.*    the causal conv's decode step: ``ours`` (in place) vs ``torch``.
* prefill[T].conv.*   the conv over one slot's chunk (T = 128, 2048; count = T - 5).
* prefill[T].gates.*  g and beta zeroed past the count: ``ours`` vs ``torch``.
* prefill[T].rule.*   ``fla`` (chunk_gated_delta_rule from the slot's nonzero state,
  gathered and scattered) vs ``torch_chunk`` (the chunked algorithm of Transformers'
  torch_chunk_gated_delta_rule, re-written here in float32, gathered and scattered).
* prefill[T].rule.ours_recurrent[bv,w]   Flare's token-by-token prefill (the state tile in
  registers over the chunk, in place): bitwise the same wherever a chunk starts, which the
  chunked forms are not (``split_invariant``: the chunk prefilled whole against cut at
  T/2 - 3 and continued, state and outputs compared bit for bit).
* prefill[T].layer.ours+fla / ours   conv + gates + FLA's chunk rule / Flare's recurrent rule.
* prefill[T].layer.grid   the recipe's prefill (``_mix_triton``) on the slot's block grid: the
  same conv and gates, then the chunk rule in two calls over 37 stashed rows and the chunk.

Each candidate runs R calls on R input sets (rotating inputs and state rows so that
L2 does not hold them, about 3x L2 in all); its time is the median over replays of
one CUDA graph holding the R calls, divided by R. Before timing: an eager warm-up
(compiles, autotunes; ``first_call_s``; with --smoke none, the first eager run timed), two
eager runs from the same state
(``deterministic``, together with two replays), a replay compared bit for bit with
the eager run (``replay_bitwise_eager``), and the first set's outputs and state
against a float64 torch reference (``max_abs_err``, ``state_err``; ``out_scale`` is
the reference's largest output). Each candidate is guarded: a failure is recorded
and the rest still run.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from functools import cache
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter switch is read when Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from flare.prepare.kernels.gdn import (  # noqa: E402
    conv1d_decode_step,
    conv1d_prefill_chunk,
    gdn_decode_step,
    gdn_prefill_gates,
    gdn_prefill_recurrent,
)

try:
    import fla
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    FLA_ERROR = None
except Exception as e:  # noqa: BLE001 - reported, the other candidates still run
    fla, FLA_ERROR = None, f"{type(e).__name__}: {e}"

F64 = torch.float64
# Run order: FLA's chunk rule autotunes on its first call (tens of seconds) and the torch
# chunk baseline is slow, so they come last, where a spent budget skips them first.
LAST = (".rule.fla", ".layer.", ".rule.torch_chunk")  # (.layer.grid counts as a layer)


def run_order(case) -> int:
    if not case.name.startswith("prefill"):
        return 0
    return 1 + next((i + 1 for i, key in enumerate(LAST) if key in case.name), 0)


@dataclass(frozen=True)
class Geometry:
    Hk: int = 16
    Hv: int = 32
    Dk: int = 128
    Dv: int = 128
    W: int = 4
    dtype: torch.dtype = torch.bfloat16

    @property
    def D(self) -> int:
        return 2 * self.Hk * self.Dk + self.Hv * self.Dv

    def split(self, mixed):
        """q, k [N, Hk, Dk] and v [N, Hv, Dv] views of a conv output [N, D]."""
        q, k, v = torch.split(mixed, [self.Hk * self.Dk, self.Hk * self.Dk, self.Hv * self.Dv], dim=-1)
        n = mixed.shape[0]
        return q.view(n, self.Hk, self.Dk), k.view(n, self.Hk, self.Dk), v.view(n, self.Hv, self.Dv)


@dataclass
class Case:
    name: str
    calls: list  # R callables, one per input set, each returning a tuple of tensors
    state: list  # the buffers the calls mutate: restored before every check
    check: object = None  # (outputs of set 0, state) -> dict of errors
    notes: str = ""
    bytes_per_call: int = 0  # the least DRAM traffic of one call, for an effective bandwidth


# ---------------------------------------------------------------- references (float64)

def gates64(a, b, A_log, dt_bias, beta_rounded=True):
    g = -A_log.to(F64).exp() * F.softplus(a.to(F64) + dt_bias.to(F64))
    beta = b.sigmoid().to(F64) if beta_rounded else b.to(F64).sigmoid()
    return g, beta


def delta_steps64(S, q, k, v, g, beta):
    """The gated delta rule token by token. S [Hv, Dk, Dv]; q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]."""
    group = v.shape[1] // k.shape[1]
    q, k = (t.to(F64).repeat_interleave(group, dim=1) for t in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    S, v, outs = S.to(F64), v.to(F64), []
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        delta = (v[t] - (S * k[t][:, :, None]).sum(1)) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        outs.append((S * q[t][:, :, None]).sum(1))
    return torch.stack(outs) if outs else v[:0], S


def conv64(history, x, weight):
    """silu(causal depthwise conv) over (history ++ x) in float64: outputs [T, D] and the full sequence."""
    seq = torch.cat([history.to(F64), x.to(F64).transpose(0, 1)], dim=1)
    out = F.conv1d(seq[None], weight.to(F64), groups=weight.shape[0])[0]
    return F.silu(out).transpose(0, 1), seq


def err(a, ref):
    return float((a.to(F64) - ref).abs().max()) if a.numel() else 0.0


# ---------------------------------------------------------------- torch baselines (the recipe's ops)

def torch_decode_rule(geo, q, k, v, a, b, A_log, dt_bias, rec, slots, live):
    h0 = rec.index_select(0, slots)
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    group = geo.Hv // geo.Hk
    qf, kf = (t.float().repeat_interleave(group, dim=1) for t in (q, k))
    qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + 1e-6) * geo.Dk ** -0.5
    kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    s = h0 * g.exp()[..., None, None]
    delta = (v.float() - (s * kf[..., None]).sum(-2)) * beta.float()[..., None]
    s = s + kf[..., None] * delta[..., None, :]
    rec.index_copy_(0, slots, torch.where(live[:, None, None, None], s, h0))
    return ((s * qf[..., None]).sum(-2).to(v.dtype),)


def torch_conv_decode(x, conv_rows, weight, slots, live):
    conv = conv_rows.index_select(0, slots)
    seq = torch.cat([conv, x[:, :, None].to(conv.dtype)], dim=2)
    out = F.conv1d(seq.to(weight.dtype), weight, None, groups=weight.shape[0])[:, :, 0]
    conv_rows.index_copy_(0, slots, torch.where(live[:, None, None], seq[:, :, 1:], conv))
    return (F.silu(out).to(x.dtype),)


def torch_conv_prefill(x, conv_rows, weight, slot, count):
    conv = conv_rows.index_select(0, slot)[0]
    seq = torch.cat([conv, x.transpose(0, 1).to(conv.dtype)], dim=1)
    out = F.conv1d(seq[None].to(weight.dtype), weight, None, groups=weight.shape[0])[0]
    keep = torch.arange(weight.shape[-1] - 1, device=x.device) + count
    conv_rows.index_copy_(0, slot, seq.index_select(1, keep)[None])
    return (F.silu(out).transpose(0, 1).to(x.dtype),)


def torch_gates(a, b, A_log, dt_bias, count):
    valid = (torch.arange(a.shape[0], device=a.device) < count)[:, None]
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return torch.where(valid, g, torch.zeros_like(g)), torch.where(valid, beta, torch.zeros_like(beta))


def torch_chunk_rule(q, k, v, g, beta, h0, chunk=64):
    """The chunked gated delta rule (UT transform per chunk, then a scan over chunks) in float32.
    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; h0 [Hv, Dk, Dv]."""
    T, Hv, Dk = v.shape[0], v.shape[1], q.shape[-1]
    group = Hv // q.shape[1]
    q, k = (t.float().repeat_interleave(group, dim=1) for t in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * Dk ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    pad = (-T) % chunk
    q, k, v = (F.pad(t.float().transpose(0, 1), (0, 0, 0, pad)) for t in (q, k, v))  # [Hv, Tp, D]
    g, beta = (F.pad(t.float().transpose(0, 1), (0, pad)) for t in (g, beta))  # [Hv, Tp]
    n = (T + pad) // chunk
    q, k, v = (t.reshape(Hv, n, chunk, -1) for t in (q, k, v))
    gc = g.reshape(Hv, n, chunk).cumsum(-1)
    beta = beta.reshape(Hv, n, chunk, 1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = k * beta
    system = (kb @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * gc.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * gc.exp()[..., None]
    k_dec = k * (gc[..., -1:] - gc).exp()[..., None]
    last = gc[..., -1].exp()[..., None, None]
    S, outs = h0.float(), []
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ S
        outs.append(q_dec[:, i] @ S + attn[:, i] @ v_new)
        S = S * last[:, i] + k_dec[:, i].transpose(-1, -2) @ v_new
    return torch.cat(outs, dim=1)[:, :T].transpose(0, 1), S


# ---------------------------------------------------------------- inputs and cases

class Bench:
    def __init__(self, geo, device, target_bytes):
        self.geo, self.device, self.target = geo, device, target_bytes
        self.gen = torch.Generator(device=device).manual_seed(0)
        g = geo
        # A = exp(A_log) log-uniform over [0.01, 16]: heads with long and with short memory.
        self.A_log = torch.empty(g.Hv, device=device).uniform_(math.log(0.01), math.log(16.0), generator=self.gen)
        self.dt_bias = self.randn(g.Hv, scale=0.5)
        self.weight = self.randn(g.D, 1, g.W, scale=0.5)

    def randn(self, *shape, dtype=None, scale=1.0):
        t = torch.randn(*shape, generator=self.gen, device=self.device) * scale
        return t.to(dtype or self.geo.dtype)

    def rotations(self, bytes_per_call, most=128):
        return max(2 if self.device == "cpu" else 4, min(most, math.ceil(self.target / max(bytes_per_call, 1))))

    def state_buffers(self, rows):
        g = self.geo
        rec = torch.randn(rows, 2, g.Hv, g.Dk, g.Dv, generator=self.gen, device=self.device).mul_(0.5)
        conv = self.randn(rows, 2, g.D, g.W - 1)
        return rec, conv, rec.select(1, 1), conv.select(1, 1)

    # decode -----------------------------------------------------------------------
    def decode_cases(self, B, ours_configs):
        g = self.geo
        rule_bytes = B * (g.Hv * g.Dk * g.Dv * 4 * 2 + g.D * 2 + g.Hv * g.Dv * 2)
        conv_bytes = B * g.D * 2 * ((g.W - 1) * 2 + 2)
        R = self.rotations(rule_bytes)
        rec, conv, rec_l, conv_l = self.state_buffers(1 + R * B)
        perm = torch.randperm(R * B, generator=self.gen, device=self.device) + 1
        sets = []
        for r in range(R):
            sets.append(dict(
                mixed=self.randn(B, g.D), x=self.randn(B, g.D), a=self.randn(B, g.Hv), b=self.randn(B, g.Hv),
                slots=perm[r * B:(r + 1) * B],
                live=torch.ones(B, dtype=torch.bool, device=self.device)))
        s0 = sets[0]
        h0 = rec_l[s0["slots"]].clone()
        hist0 = conv_l[s0["slots"]].clone()
        q0, k0, v0 = g.split(s0["mixed"])

        @cache
        def reference(beta_rounded):
            gg, beta = gates64(s0["a"], s0["b"], self.A_log, self.dt_bias, beta_rounded)
            ref_o, ref_s = zip(*[delta_steps64(h0[i], q0[i:i + 1], k0[i:i + 1], v0[i:i + 1], gg[i:i + 1],
                                               beta[i:i + 1]) for i in range(B)])
            return torch.cat(ref_o), torch.stack(ref_s)

        def rule_check(beta_rounded):
            def check(outs, state):
                ref_o, ref_s = reference(beta_rounded)
                got_s = state[0].select(1, 1)[s0["slots"]]
                return dict(max_abs_err=err(outs[0].reshape(ref_o.shape), ref_o), state_err=err(got_s, ref_s),
                            out_scale=float(ref_o.abs().max()))
            return check

        def conv_check(outs, state):
            refs = [conv64(hist0[i], s0["x"][i:i + 1], self.weight) for i in range(B)]
            ref_o = torch.cat([r[0] for r in refs])
            hist = state[1].select(1, 1)[s0["slots"]]
            exact = all(torch.equal(hist[i].to(F64), refs[i][1][:, 1:]) for i in range(B))
            return dict(max_abs_err=err(outs[0], ref_o), out_scale=float(ref_o.abs().max()), history_exact=exact)

        cases = []
        for bv, warps in ours_configs:
            cases.append(Case(f"decode[{B}].rule.ours[bv{bv},w{warps}]", [
                (lambda s=s, bv=bv, warps=warps: (gdn_decode_step(
                    *g.split(s["mixed"]), s["a"], s["b"], self.A_log, self.dt_bias, rec_l, s["slots"], s["live"],
                    block_v=bv, num_warps=warps),)) for s in sets], [rec, conv], rule_check(True),
                bytes_per_call=rule_bytes))
        if fla is not None:
            def fla_step(s):
                q, k, v = g.split(s["mixed"])
                h = rec_l.index_select(0, s["slots"])
                o, ht = fused_recurrent_gated_delta_rule(
                    q[:, None], k[:, None], v[:, None], g=s["a"][:, None], beta=s["b"][:, None],
                    initial_state=h, output_final_state=True, use_qk_l2norm_in_kernel=True,
                    use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias, use_beta_sigmoid_in_kernel=True)
                rec_l.index_copy_(0, s["slots"], torch.where(s["live"][:, None, None, None], ht, h))
                return (o[:, 0],)
            cases.append(Case(f"decode[{B}].rule.fla", [(lambda s=s: fla_step(s)) for s in sets], [rec, conv],
                              rule_check(False), "beta = sigmoid(b) in float32 (not rounded to bf16)"))
        else:
            cases.append(Case(f"decode[{B}].rule.fla", [], [], notes=f"fla not importable: {FLA_ERROR}"))
        cases.append(Case(f"decode[{B}].rule.torch", [
            (lambda s=s: torch_decode_rule(g, *g.split(s["mixed"]), s["a"], s["b"], self.A_log, self.dt_bias, rec_l,
                                           s["slots"], s["live"])) for s in sets], [rec, conv], rule_check(True)))
        for bc in (256, 1024):
            cases.append(Case(f"decode[{B}].conv.ours[c{bc}]", [
                (lambda s=s, bc=bc: (conv1d_decode_step(s["x"], conv_l, self.weight, None, s["slots"], s["live"],
                                                        block_c=bc),)) for s in sets], [rec, conv], conv_check,
                bytes_per_call=conv_bytes))
        cases.append(Case(f"decode[{B}].conv.torch", [
            (lambda s=s: torch_conv_decode(s["x"], conv_l, self.weight, s["slots"], s["live"])) for s in sets],
            [rec, conv], conv_check))
        return cases

    # prefill ----------------------------------------------------------------------
    def prefill_cases(self, T, ours_configs):
        g = self.geo
        n = max(T - 5, 1)
        R = self.rotations(T * g.D * 2 * 2 + g.Hv * g.Dk * g.Dv * 4 * 2)
        rec, conv, rec_l, conv_l = self.state_buffers(1 + R)
        valid = (torch.arange(T, device=self.device) < n)[:, None]
        sets = []
        for r in range(R):
            a, b = self.randn(T, g.Hv), self.randn(T, g.Hv)
            gg, beta = torch_gates(a, b, self.A_log, self.dt_bias, n)
            sets.append(dict(x=self.randn(T, g.D), mixed=torch.where(valid, self.randn(T, g.D), 0), a=a, b=b, g=gg,
                             beta=beta, slot=torch.tensor([r + 1], device=self.device),
                             count=torch.tensor([n], device=self.device)))
        s0 = sets[0]
        h0, hist0 = rec_l[1].clone(), conv_l[1].clone()

        @cache
        def reference():
            q, k, v = g.split(s0["mixed"][:n])
            gg, beta = gates64(s0["a"][:n], s0["b"][:n], self.A_log, self.dt_bias)
            return delta_steps64(h0, q, k, v, gg, beta)

        def rule_check(outs, state):
            ref_o, ref_s = reference()
            o = outs[0].reshape(T, g.Hv, g.Dv)
            return dict(max_abs_err=err(o[:n], ref_o), state_err=err(state[0].select(1, 1)[1], ref_s),
                        out_scale=float(ref_o.abs().max()))

        def conv_check(outs, state):
            ref_o, seq = conv64(hist0, s0["x"][:n], self.weight)
            exact = torch.equal(state[1].select(1, 1)[1].to(F64), seq[:, n:])
            return dict(max_abs_err=err(outs[0][:n], ref_o), out_scale=float(ref_o.abs().max()), history_exact=exact)

        def gates_check(outs, state):
            gg, beta = gates64(s0["a"], s0["b"], self.A_log, self.dt_bias)
            return dict(max_abs_err=max(err(outs[0][:n], gg[:n]), err(outs[1][:n], beta[:n])),
                        out_scale=float(gg[:n].abs().max()),
                        zero_past_count=bool((outs[0][n:] == 0).all() and (outs[1][n:] == 0).all()))

        def fla_rule(s, q, k, v, gg, beta):
            h = rec_l.index_select(0, s["slot"])
            o, ht = chunk_gated_delta_rule(q[None], k[None], v[None], g=gg[None], beta=beta[None], initial_state=h,
                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
            rec_l.index_copy_(0, s["slot"], ht)
            return o[0]

        def torch_rule(s):
            h = rec_l.index_select(0, s["slot"])
            o, ht = torch_chunk_rule(*g.split(s["mixed"]), s["g"], s["beta"], h[0])
            rec_l.index_copy_(0, s["slot"], ht[None])
            return (o.to(g.dtype),)

        def layer(s, rule):
            mixed = conv1d_prefill_chunk(s["x"], conv_l, self.weight, None, s["slot"], s["count"])
            gg, beta = gdn_prefill_gates(s["a"], s["b"], self.A_log, self.dt_bias, s["count"])
            return (rule(s, *g.split(mixed), gg, beta),)

        def ours_rule(s, q, k, v, gg, beta, bv=16, warps=1):
            return gdn_prefill_recurrent(q, k, v, gg, beta, rec_l, s["slot"], s["count"], block_v=bv,
                                         num_warps=warps)

        def split_invariant(bv, warps):
            """Whole chunk vs cut at T/2 - 3 and continued: bitwise equal state and outputs."""
            cut = max(T // 2 - 3, 1)
            q, k, v = g.split(s0["mixed"])
            slot = torch.tensor([1], device=self.device)
            rec_l[1].copy_(h0)
            whole = gdn_prefill_recurrent(q, k, v, s0["g"], s0["beta"], rec_l, slot, s0["count"], block_v=bv,
                                          num_warps=warps)
            state_whole = rec_l[1].clone()
            rec_l[1].copy_(h0)
            first = gdn_prefill_recurrent(q, k, v, s0["g"], s0["beta"], rec_l, slot,
                                          torch.tensor([cut], device=self.device), block_v=bv, num_warps=warps)
            second = gdn_prefill_recurrent(q[cut:], k[cut:], v[cut:], s0["g"][cut:], s0["beta"][cut:], rec_l, slot,
                                           torch.tensor([n - cut], device=self.device), block_v=bv, num_warps=warps)
            same = torch.equal(rec_l[1], state_whole) and torch.equal(
                torch.cat([first[:cut], second[:n - cut]]), whole[:n])
            rec_l[1].copy_(h0)
            return same

        cases = []
        for bt, bc in ((32, 128), (64, 64)):
            cases.append(Case(f"prefill[{T}].conv.ours[t{bt},c{bc}]", [
                (lambda s=s, bt=bt, bc=bc: (conv1d_prefill_chunk(s["x"], conv_l, self.weight, None, s["slot"],
                                                                 s["count"], block_t=bt, block_c=bc),))
                for s in sets], [rec, conv], conv_check, bytes_per_call=T * g.D * 2 * 2))
        cases.append(Case(f"prefill[{T}].conv.torch", [
            (lambda s=s: torch_conv_prefill(s["x"], conv_l, self.weight, s["slot"], s["count"])) for s in sets],
            [rec, conv], conv_check))
        cases.append(Case(f"prefill[{T}].gates.ours", [
            (lambda s=s: gdn_prefill_gates(s["a"], s["b"], self.A_log, self.dt_bias, s["count"])) for s in sets],
            [rec, conv], gates_check))
        cases.append(Case(f"prefill[{T}].gates.torch", [
            (lambda s=s: torch_gates(s["a"], s["b"], self.A_log, self.dt_bias, s["count"])) for s in sets],
            [rec, conv], gates_check))
        if fla is not None:
            cases.append(Case(f"prefill[{T}].rule.fla", [
                (lambda s=s: (fla_rule(s, *g.split(s["mixed"]), s["g"], s["beta"]),)) for s in sets],
                [rec, conv], rule_check, "q/k/v zero and g = beta = 0 past the count"))
            cases.append(Case(f"prefill[{T}].layer.ours+fla", [(lambda s=s: layer(s, fla_rule)) for s in sets],
                              [rec, conv], notes="conv + gates + gather + FLA chunk + scatter; parts checked separately"))
        else:
            cases.append(Case(f"prefill[{T}].rule.fla", [], [], notes=f"fla not importable: {FLA_ERROR}"))
        for bv, warps in ours_configs:
            def check(outs, state, bv=bv, warps=warps):
                return {**rule_check(outs, state), "split_invariant": split_invariant(bv, warps)}
            cases.append(Case(f"prefill[{T}].rule.ours_recurrent[bv{bv},w{warps}]", [
                (lambda s=s, bv=bv, warps=warps: (ours_rule(s, *g.split(s["mixed"]), s["g"], s["beta"], bv, warps),))
                for s in sets], [rec, conv], check, "token by token, in place"))
        cases.append(Case(f"prefill[{T}].layer.ours", [(lambda s=s: layer(s, ours_rule)) for s in sets], [rec, conv],
                          notes="conv + gates + Flare's recurrent rule, in place; parts checked separately"))
        cases.append(Case(f"prefill[{T}].rule.torch_chunk", [(lambda s=s: torch_rule(s)) for s in sets],
                          [rec, conv], rule_check, "float32, chunk 64, solve_triangular"))
        cases.append(self.grid_case(T, sets, rec, conv))
        return cases

    def grid_case(self, T, sets, rec, conv):
        """The recipe's own prefill of one layer on the slot's block grid
        (``recipes/qwen3_5._mix_triton``): conv, gates, then the chunk rule over the block
        under way (37 stashed rows, re-run) and the chunk, in two calls (FLA's on the GPU,
        Transformers' torch rule on the CPU). Against ``layer.ours+fla``: what the grid costs."""
        from types import SimpleNamespace

        from flare.prepare.attention import PagedBatch
        from flare.prepare.recipes import qwen3_5 as Q

        g = self.geo
        rows = rec.shape[0]
        start, r0 = 1000 + 37, 37  # the slots' grids end where the chunk starts, 37 rows into a block
        block = torch.randn(rows, 2, g.Hv, g.Dk, g.Dv, generator=self.gen, device=self.device).mul_(0.5)
        stash = self.randn(rows, 2, Q.BLOCK, g.D + 2 * g.Hv)
        grid = torch.tensor([start, r0], dtype=torch.int32, device=self.device).repeat(rows, 2, 1)
        mod = SimpleNamespace(conv1d=SimpleNamespace(weight=self.weight, bias=None), A_log=self.A_log,
                              dt_bias=self.dt_bias, conv_dim=g.D, num_v_heads=g.Hv, key_dim=g.Hk * g.Dk,
                              value_dim=g.Hv * g.Dv, head_k_dim=g.Dk, head_v_dim=g.Dv, state_index=1)
        state = {Q.CONV_STATE: conv, Q.RECURRENT_STATE: rec, Q.BLOCK_STATE: block, Q.STASH: stash, Q.GRID: grid}
        idx = torch.arange(T, device=self.device)

        def call(s):
            valid = idx < s["count"]
            paged = PagedBatch(kv=rec, page_table=grid, token_slot=s["slot"].expand(T),
                               positions=torch.where(valid, start + idx, 0), slot_mapping=idx, valid=valid,
                               impl="triton", single_slot=True, state=state)
            return (Q._mix_triton(mod, paged, s["x"], s["b"], s["a"]),)

        return Case(f"prefill[{T}].layer.grid", [(lambda s=s: call(s)) for s in sets],
                    [rec, conv, block, stash, grid],
                    notes="recipe prefill on the block grid: conv + gates + two chunk-rule calls (37 stashed rows)")


# ---------------------------------------------------------------- measurement

def bitwise_equal(xs, ys) -> bool:
    if len(xs) != len(ys):
        return False
    for x, y in zip(xs, ys):
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if not torch.equal(x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8)):
            return False
    return True


def flat(outputs):
    return [t.clone() for outs in outputs for t in outs]


def measure(case: Case, replays: int, cuda: bool) -> dict:
    res = dict(rotations=len(case.calls))
    snapshot = [s.clone() for s in case.state]

    def restore():
        for s, v in zip(case.state, snapshot):
            s.copy_(v)

    def run_all():
        return [c() for c in case.calls]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    try:
        return _measure(case, replays, cuda, res, restore, run_all, sync)
    finally:
        restore()


def _measure(case, replays, cuda, res, restore, run_all, sync):
    # On the GPU a warm-up first (it compiles and autotunes). Under the interpreter (--smoke)
    # nothing is cached: the first eager run is the first call, and each candidate runs once less.
    t0 = time.perf_counter()
    if cuda:
        run_all()
        sync()
        res["first_call_s"] = round(time.perf_counter() - t0, 3)
        restore()
    eager = run_all()
    if not cuda:
        res["first_call_s"] = round(time.perf_counter() - t0, 3)
    eager_out, eager_state = flat(eager), [s.clone() for s in case.state]
    restore()
    again = flat(run_all())
    deterministic = bitwise_equal(eager_out, again) and bitwise_equal(eager_state, case.state)
    if case.check is not None:
        res.update(case.check(eager[0], eager_state))
    if not cuda:  # the first call's wall clock: a third eager run would time the same (under the interpreter)
        res.update(time_us=res["first_call_s"] * 1e6 / len(case.calls), deterministic=deterministic,
                   replay_bitwise_eager=None, timing="cpu wall clock, eager (meaningless)")
        return res
    restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run_all()
    restore()
    graph.replay()
    sync()
    first, first_state = flat(captured), [s.clone() for s in case.state]
    restore()
    graph.replay()
    sync()
    res["replay_bitwise_eager"] = bitwise_equal(first, eager_out) and bitwise_equal(first_state, eager_state)
    res["deterministic"] = deterministic and bitwise_equal(first, flat(captured)) and bitwise_equal(
        first_state, case.state)
    restore()
    for _ in range(3):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    sync()
    try:  # let the CPU queue every replay before the GPU starts: events then time the GPU alone
        torch.cuda._sleep(int(2e7))
    except Exception:  # noqa: BLE001
        pass
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    sync()
    times = sorted(s.elapsed_time(e) * 1e3 / len(case.calls) for s, e in events)
    res.update(time_us=statistics.median(times), time_us_p10=times[len(times) // 10],
               time_us_p90=times[(len(times) * 9) // 10])
    if case.bytes_per_call:
        res["gb_per_s"] = round(case.bytes_per_call / res["time_us"] / 1e3, 1)
    return res


def kernel_bench_args(doc: str, argv, add, replays: int, budget_s: float):
    """A kernel benchmark's command line: ``--out``, ``--smoke``, what ``add(parser)`` adds,
    ``--replays`` and ``--budget-s`` (2 replays under --smoke). Returns ``(parser, args,
    device)``: device "cuda", "cpu" (--smoke) or None (no GPU and no --smoke: said on stderr)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, no graphs")
    add(p)
    p.add_argument("--replays", type=int, default=replays)
    p.add_argument("--budget-s", type=float, default=budget_s)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("no CUDA device: run with --smoke for the CPU check", file=sys.stderr)
        return p, args, None
    if args.smoke:
        args.replays = 2
    return p, args, "cuda" if cuda else "cpu"


def run(cases, args, cuda, started, log):
    results = []
    for case in cases:
        row = dict(name=case.name, notes=case.notes)
        if not case.calls:
            row["error"] = case.notes
        elif time.perf_counter() - started > args.budget_s:
            row["error"] = f"skipped: the {args.budget_s} s budget was spent"
        else:
            t0 = time.perf_counter()
            try:
                row.update(measure(case, args.replays, cuda))
            except Exception as e:  # noqa: BLE001 - one candidate's failure must not stop the others
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                row["traceback"] = traceback.format_exc()[-2000:]
            row["wall_s"] = round(time.perf_counter() - t0, 2)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        log(_line(row))
        results.append(row)
    return results


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _yn(v):
    return "-" if v is None else ("yes" if v else "NO")


def _line(r):
    if r.get("error"):
        return f"{r['name']:<38} ERROR {r['error'][:160]}"
    extra = "" if r.get("history_exact") is None else f" hist_exact={_yn(r['history_exact'])}"
    extra += "" if r.get("split_invariant") is None else f" split_inv={_yn(r['split_invariant'])}"
    extra += "" if r.get("gb_per_s") is None else f" {r['gb_per_s']} GB/s"
    return (f"{r['name']:<38} {_fmt(r.get('time_us'), '9.2f')} us  bitwise={_yn(r.get('replay_bitwise_eager'))}"
            f"  determ={_yn(r.get('deterministic'))}  err={_fmt(r.get('max_abs_err'), '.2e')}"
            f"  state_err={_fmt(r.get('state_err'), '.2e')}  scale={_fmt(r.get('out_scale'), '.2e')}"
            f"  R={r.get('rotations')}  first={_fmt(r.get('first_call_s'), '.1f')}s{extra}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="where to write the JSON results")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, no graphs")
    p.add_argument("--replays", type=int, default=100, help="timed graph replays per candidate")
    p.add_argument("--budget-s", type=float, default=120.0, help="skip the candidates left after this many seconds")
    p.add_argument("--prefill", default=None, help="chunk sizes, comma separated (default 128,2048)")
    p.add_argument("--decode", default=None, help="batch sizes, comma separated (default 1,4)")
    p.add_argument("--only", default=None, help="run only candidates whose name holds one of these, comma separated")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("no CUDA device: run with --smoke for the CPU check", file=sys.stderr)
        return 2
    geo = Geometry(Hk=2, Hv=4, Dk=16, Dv=16) if args.smoke else Geometry()
    prefill = [int(x) for x in (args.prefill or ("16" if args.smoke else "128,2048")).split(",")]
    decode = [int(x) for x in (args.decode or ("1,2" if args.smoke else "1,4")).split(",")]
    ours = [(16, 1)] if args.smoke else [(8, 1), (16, 2), (32, 4), (64, 4)]
    ours_prefill = [(16, 1)] if args.smoke else [(8, 1), (16, 1), (32, 1), (32, 2), (64, 4)]
    device = "cuda" if cuda else "cpu"
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if cuda else 0
    bench = Bench(geo, device, 3 * l2)
    if args.smoke:
        args.replays = 2

    def log(line):
        print(line, flush=True)

    cases = [c for B in decode for c in bench.decode_cases(B, ours)]
    cases += [c for T in prefill for c in bench.prefill_cases(T, ours_prefill)]
    if args.only:
        cases = [c for c in cases if any(w in c.name for w in args.only.split(","))]
    cases.sort(key=run_order)
    results = run(cases, args, cuda, started, log)

    props = torch.cuda.get_device_properties(0) if cuda else None
    report = dict(
        machine=dict(device=torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
                     capability=list(torch.cuda.get_device_capability(0)) if cuda else None,
                     sm_count=props.multi_processor_count if props else None, l2_bytes=l2 if cuda else None),
        versions=dict(python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
                      cuda=torch.version.cuda, fla=getattr(fla, "__version__", None), fla_error=FLA_ERROR,
                      # FLA's chunk rule dispatches to FlashQLA (TileLang) when that package is importable
                      flash_qla_importable=importlib.util.find_spec("flash_qla") is not None),
        config=dict(smoke=args.smoke, geometry=dict(Hk=geo.Hk, Hv=geo.Hv, Dk=geo.Dk, Dv=geo.Dv, conv_dim=geo.D,
                                                    kernel=geo.W, dtype=str(geo.dtype), state_dtype="float32"),
                    prefill=prefill, prefill_count="T - 5", decode=decode, replays=args.replays,
                    rotation_target_bytes=3 * l2, budget_s=args.budget_s,
                    env={k: v for k, v in os.environ.items() if k.startswith(("FLA_", "TRITON_"))}),
        results=results, wall_s=round(time.perf_counter() - started, 1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\n== Gated DeltaNet kernels, per layer ({report['machine']['device']}, torch {torch.__version__}, "
          f"triton {triton.__version__}, fla {report['versions']['fla']}); {report['wall_s']} s")
    for r in results:
        print(_line(r))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
