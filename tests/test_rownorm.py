"""RMS norms with a row-invariant mean of squares in prompt programs (``kernels/rownorm.py``).

Without CUDA the kernel runs in Triton's CPU interpreter; with CUDA (the GPU suite's kernel
phase) compiled, in bfloat16 too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from flare.prepare.attention import PagedBatch  # noqa: E402
from flare.prepare import prompt_rows  # noqa: E402
from flare.prepare.kernels import rownorm as R  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [100, 576, 2048, 4096])
def test_a_rows_mean_square_is_the_same_bits_for_any_number_of_rows(n, dtype):
    """Rows 0..k of 300 rows alone (k = 1, 16, 37) and among all 300, as rows of a 3-D input and
    as a strided view (read in place), get the same bits; against torch's mean of squares within float32 rounding."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(300, n, generator=g) * 3).to(dtype).to(DEVICE)
    whole = R.mean_square(x)
    assert whole.shape == (300, 1) and whole.dtype == torch.float32
    for k in (1, 16, 37):
        assert torch.equal(R.mean_square(x[:k]), whole[:k])
    assert torch.equal(R.mean_square(x.reshape(3, 100, n)).reshape(300, 1), whole)
    assert torch.equal(R.mean_square(torch.cat([x, x], dim=1)[:, :n]), whole)  # a strided view, read in place
    torch.testing.assert_close(whole, x.float().pow(2).mean(-1, keepdim=True), rtol=2e-6, atol=0)


def _classes():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    return [LlamaRMSNorm, Qwen3MoeRMSNorm, Qwen3_5RMSNorm, Qwen3NextRMSNorm, Qwen3_5RMSNormGated]


@pytest.mark.parametrize("cls", _classes(), ids=lambda c: c.__name__)
def test_a_switched_norm_computes_transformers_formula(cls, monkeypatch):
    """With torch's own mean of squares in the kernel's place, a switched norm gives the
    original class's output bitwise in prompt programs (the formula around the mean is
    Transformers'), and runs the original forward elsewhere; with the kernel, the same to
    float32 rounding of the mean."""
    torch.manual_seed(0)
    n, gated = 64, "Gated" in cls.__name__
    norm = cls(n, eps=1e-6).to(DEVICE)
    with torch.no_grad():
        norm.weight.normal_()
    original = cls(n, eps=1e-6).to(DEVICE)
    original.load_state_dict(norm.state_dict())
    holder = nn.ModuleList([norm])
    switched, left = R.make_norms_row_invariant(holder)
    assert switched == {cls.__name__: 1} and left == [] and type(norm) is not cls and isinstance(norm, cls)
    # Rows of mean square near eps (where eps matters) and near one, in bfloat16.
    x = (torch.randn(8, n) * torch.tensor([3e-3, 1.0]).repeat(4)[:, None]).to(DEVICE, torch.bfloat16)
    args = (x, torch.randn(8, n).to(DEVICE, torch.bfloat16)) if gated else (x,)
    want = original(*args)
    torch.testing.assert_close(norm(*args), want, rtol=0, atol=0)  # outside prompt programs
    with prompt_rows.marked(True):
        kernel = norm(*args)
        monkeypatch.setattr(R, "mean_square", lambda t: t.float().pow(2).mean(-1, keepdim=True))
        assert torch.equal(norm(*args), want)
    torch.testing.assert_close(kernel.float(), want.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("cls", _classes(), ids=lambda c: c.__name__)
def test_step_norms_take_the_row_invariant_mean_where_asked(cls, monkeypatch):
    """``steps=True`` (``--step-norms invariant``): outside prompt programs too (decode and verify
    steps) a switched norm is one ``rms_norm`` launch (the gated one: its mean of squares from
    ``mean_square``), each row the same bits alone and among others; a norm switched before
    for prompt programs only is given the steps as well; without it, steps keep the compiled
    formula."""
    calls = []
    real, real_norm = R.mean_square, R.rms_norm
    monkeypatch.setattr(R, "mean_square", lambda t: calls.append(("mean", t.shape[0])) or real(t))
    monkeypatch.setattr(R, "rms_norm", lambda t, *a, **kw: calls.append(("norm", t.shape[0])) or real_norm(t, *a, **kw))
    x = torch.randn(4, 64).to(DEVICE)
    gate = torch.randn(4, 64).to(DEVICE) if "Gated" in cls.__name__ else None
    kind = "mean" if gate is not None else "norm"

    def run(norm, rows):
        return norm(x[rows]) if gate is None else norm(x[rows], gate[rows])

    for first_prompts_only in (False, True):
        norm = cls(64, eps=1e-6).to(DEVICE)
        holder = nn.ModuleList([norm])
        if first_prompts_only:
            R.make_norms_row_invariant(holder)
            calls.clear()
            run(norm, slice(None))
            assert calls == []  # steps: the compiled formula
        assert R.make_norms_row_invariant(holder, steps=True)[0] == ({} if first_prompts_only else {cls.__name__: 1})
        calls.clear()
        every, alone = run(norm, slice(None)), run(norm, slice(2, 3))
        assert calls == [(kind, 4), (kind, 1)] and torch.equal(alone[0], every[2])
        with prompt_rows.marked(True):  # prompt programs: the mean of squares, the rest compiled
            calls.clear()
            run(norm, slice(None))
            assert calls == [("mean", 4)]


@pytest.mark.parametrize("zero_centred", [True, False])
@pytest.mark.parametrize("n", [64, 576, 4096])
def test_one_launch_norm_and_its_residual_add(n, zero_centred):
    """``rms_norm``: each row the same bits alone and among others, with and without the
    residual add; the sum is ``residual + x`` bit for bit and the norm of it is the norm
    ``rms_norm`` gives that sum alone; against the class's own formula (Qwen3.5's zero-centred,
    Llama's) within the output's rounding."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    g = torch.Generator().manual_seed(n)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x, residual = ((torch.randn(6, n, generator=g) * 2).to(dtype).to(DEVICE) for _ in range(2))
    norm = (Qwen3_5RMSNorm if zero_centred else LlamaRMSNorm)(n, eps=1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=g).to(dtype))
    out, none = R.rms_norm(x, norm.weight, 1e-6, zero_centred)
    assert none is None and out.dtype == dtype and out.shape == x.shape
    for rows in (slice(0, 1), slice(3, 5)):
        assert torch.equal(R.rms_norm(x[rows], norm.weight, 1e-6, zero_centred)[0], out[rows])
    tol = dict(rtol=2**-7, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, norm(x), **tol)
    normed, total = R.rms_norm(x.reshape(2, 3, n), norm.weight, 1e-6, zero_centred, residual=residual.reshape(2, 3, n))
    assert torch.equal(total.reshape(6, n), residual + x)
    assert torch.equal(normed.reshape(6, n), R.rms_norm(residual + x, norm.weight, 1e-6, zero_centred)[0])
    with pytest.raises(ValueError):
        R.rms_norm(x, norm.weight, 1e-6, zero_centred, residual=residual[:, :-1])
    # Rows that are a strided view (a per-head q norm over a projection holding each head's query
    # and gate side by side): read in place, the same bits.
    wide = torch.cat([x, residual], dim=1)
    assert torch.equal(R.rms_norm(wide[:, :n], norm.weight, 1e-6, zero_centred)[0], out)


def test_add_norm_is_one_launch_in_steps_only(monkeypatch):
    """``fused.add_norm``: a step-switched norm adds and normalises in one ``rms_norm`` launch
    outside prompt programs, giving what the add and the norm give apart (the same kernel's
    norm of the sum); in prompt programs, unswitched or hooked, the add and the norm as
    written."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    from flare.prepare.recipes.fused import add_norm

    calls = []
    real = R.rms_norm
    monkeypatch.setattr(R, "rms_norm", lambda *a, **kw: calls.append("residual" in kw) or real(*a, **kw))
    x, residual = torch.randn(3, 64).to(DEVICE), torch.randn(3, 64).to(DEVICE)
    norm = Qwen3_5RMSNorm(64).to(DEVICE)
    want = norm(residual + x)
    normed, total = add_norm(norm, residual, x)  # not switched
    assert calls == [] and torch.equal(total, residual + x) and torch.equal(normed, want)
    R.make_norms_row_invariant(nn.ModuleList([norm]), steps=True)
    normed, total = add_norm(norm, residual, x)
    assert calls == [True] and torch.equal(total, residual + x) and torch.equal(normed, norm(residual + x))
    torch.testing.assert_close(normed, want, rtol=1e-5, atol=1e-6)
    calls.clear()
    with prompt_rows.marked(True):
        add_norm(norm, residual, x)
    hook = norm.register_forward_hook(lambda _m, _a, out: out)
    add_norm(norm, residual, x)
    hook.remove()
    assert calls == [False]  # only the hooked call's own norm, as a step's single launch


def test_a_norm_of_other_code_is_left_and_reported():
    class OddRMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))

        def forward(self, x):
            return x / x.abs().amax(-1, keepdim=True) * self.weight

    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    holder = nn.ModuleList([OddRMSNorm(), LlamaRMSNorm(8), LlamaRMSNorm(8), nn.Linear(8, 8)])
    switched, left = R.make_norms_row_invariant(holder)
    assert switched == {"LlamaRMSNorm": 2} and left == ["OddRMSNorm"]
    assert type(holder[0]) is OddRMSNorm and type(holder[1]) is type(holder[2])
    assert R.make_norms_row_invariant(holder) == ({}, ["OddRMSNorm"])  # switched ones stay as they are


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor's reduction choices are the GPU's")
def test_compiled_prompt_rows_are_the_same_bits_at_every_capacity_on_the_gpu():
    """On the GPU, compiled as the decoder layers are (one graph, no break): a residual add
    and Llama's norm at hidden 2,048 (the routed-expert shape's), then Qwen3.5's norm, switched,
    give every row the same bits at each capacity 16 ... 512 inside a prompt program, and
    stay within bfloat16 rounding of the eager block. (How the same block compiled without
    the switch fares is printed: the suspected cause, docs/gpu.md.)"""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = LlamaRMSNorm(2048), Qwen3_5RMSNorm(2048)

        def forward(self, x, residual):
            return self.b(self.a(x + residual))

    dev = torch.device("cuda")
    torch.manual_seed(0)
    capacities = (16, 32, 64, 128, 256, 512)
    x, residual = (torch.randn(512, 2048, device=dev, dtype=torch.bfloat16) for _ in range(2))
    plain, switched = Block().to(dev, torch.bfloat16), Block().to(dev, torch.bfloat16)
    with torch.no_grad():
        plain.a.weight.normal_()
        plain.b.weight.normal_()
    switched.load_state_dict(plain.state_dict())
    assert R.make_norms_row_invariant(switched)[0] == {"LlamaRMSNorm": 1, "Qwen3_5RMSNorm": 1}
    outs = {}
    # One compiled graph per capacity and block, of one code object (as prepare allows them).
    with torch.inference_mode(), prompt_rows.marked(True), torch._dynamo.config.patch(cache_size_limit=64):
        for name, block in (("plain", plain), ("switched", switched)):
            compiled = torch.compile(block, dynamic=False, fullgraph=True)
            outs[name] = {c: compiled(x[:c], residual[:c]) for c in capacities}
        eager = plain(x, residual)
    differing = [c for c in capacities if not torch.equal(outs["plain"][c], outs["plain"][512][:c])]
    print(f"compiled without the switch, capacities whose rows differ from 512's: {differing}")
    for c in capacities:
        assert torch.equal(outs["switched"][c], outs["switched"][512][:c]), c
    torch.testing.assert_close(outs["switched"][512].float(), eager.float(), rtol=2**-6, atol=2**-6)


class LlamaRMSNormReworded(nn.Module):
    """Llama's norm as another Transformers version might write it: other comments, layout,
    docstring, no annotations."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        """Reworded."""
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)  # in float32
        variance = hidden_states.pow(2).mean(-1, keepdim=True)

        hidden_states = hidden_states * torch.rsqrt(variance
                                                    + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaRMSNormOtherEps(LlamaRMSNormReworded):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + 1e-5)
        return self.weight * hidden_states.to(input_dtype)


def test_norms_match_by_syntax_tree_not_by_text():
    """A norm whose code differs from Transformers' only in comments, layout, docstring and
    annotations is switched; one that computes something else is left."""
    holder = nn.ModuleList([LlamaRMSNormReworded(8), LlamaRMSNormOtherEps(8)])
    switched, left = R.make_norms_row_invariant(holder)
    assert switched == {"LlamaRMSNormReworded": 1} and left == ["LlamaRMSNormOtherEps"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor's reduction choices are the GPU's")
def test_compiled_step_norms_are_one_launch_and_the_same_bits_at_every_row_count_on_the_gpu():
    """On the GPU, compiled as a decode step is (one graph, no break) with ``--step-norms
    invariant``: the residual add and Qwen3.5's post-attention norm (``fused.add_norm``), then
    Llama's norm, give every row the same bits in steps of 1, 2, 4 and 16 rows, the sum bit for
    bit the eager add, within bfloat16 rounding of the eager block."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    from flare.prepare.recipes.fused import add_norm

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Qwen3_5RMSNorm(4096), LlamaRMSNorm(4096)

        def forward(self, x, residual):
            normed, total = add_norm(self.a, residual, x)
            return self.b(normed), total

    dev = torch.device("cuda")
    torch.manual_seed(0)
    x, residual = (torch.randn(16, 4096, device=dev, dtype=torch.bfloat16) for _ in range(2))
    block = Block().to(dev, torch.bfloat16)
    with torch.no_grad():
        block.a.weight.normal_()
        block.b.weight.normal_()
    eager = block(x, residual)
    assert R.make_norms_row_invariant(block, steps=True)[0] == {"LlamaRMSNorm": 1, "Qwen3_5RMSNorm": 1}
    with torch.inference_mode(), torch._dynamo.config.patch(cache_size_limit=64):
        compiled = torch.compile(block, dynamic=False, fullgraph=True)
        outs = {c: compiled(x[:c], residual[:c]) for c in (1, 2, 4, 16)}
    for c, (normed, total) in outs.items():
        assert torch.equal(normed, outs[16][0][:c]) and torch.equal(total, outs[16][1][:c]), c
    assert torch.equal(outs[16][1], eager[1])
    torch.testing.assert_close(outs[16][0].float(), eager[0].float(), rtol=2**-6, atol=2**-6)


@pytest.mark.parametrize("zero_centred", [True, False])
@pytest.mark.parametrize("d,r", [(16, 16), (16, 4), (256, 64)])
def test_the_q_and_k_norms_and_the_rotary_in_one_launch(d, r, zero_centred, monkeypatch):
    """``qk_norm_rotary``: an attention layer's per-head q and k norms (Qwen3.5's zero-centred,
    Qwen3's Llama form) and its rotary embedding of the first r dims (whole heads and partial) in
    one launch, over q heads that are a strided view beside their gates and k heads of a wider
    projection, grouped (4 q heads, 2 k heads): each the same bits as ``rms_norm`` then
    ``rotary_without_cat`` in float32 (bfloat16 on the GPU: the norms' rounded outputs rotated in
    float32 and rounded once, as Inductor compiles the rotary, within one rounding, as a product
    may contract into the sum otherwise); each token's rows the same alone and
    among others. None (the layer's own code then) outside a step, with a hooked norm, or with
    norms of two forms."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    from flare.prepare.recipes.fused import rotary_without_cat

    g = torch.Generator().manual_seed(d + r)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    cls = Qwen3_5RMSNorm if zero_centred else LlamaRMSNorm
    q_norm, k_norm = (cls(d, eps=1e-6).to(DEVICE, dtype) for _ in range(2))
    with torch.no_grad():
        for norm in (q_norm, k_norm):
            norm.weight.copy_(torch.randn(d, generator=g).to(dtype) * 0.3)
    R.make_norms_row_invariant(nn.ModuleList([q_norm, k_norm]), steps=True)
    hq, hk, t = 4, 2, 3
    qkv = (torch.randn(1, t, hq * 2 * d + 2 * hk * d, generator=g) * 2).to(dtype).to(DEVICE)
    q_gate, k, _ = qkv.split([hq * 2 * d, hk * d, hk * d], dim=-1)
    q, _ = torch.chunk(q_gate.view(1, t, hq, 2 * d), 2, dim=-1)
    k = k.view(1, t, hk, d)
    cos, sin = (torch.randn(1, t, r, generator=g).to(dtype).to(DEVICE) for _ in range(2))
    got_q, got_k = R.qk_norm_rotary(q_norm, k_norm, q, k, cos, sin)
    assert got_q.shape == q.shape and got_k.shape == k.shape and got_q.is_contiguous()
    c, s = cos.unsqueeze(2).float(), sin.unsqueeze(2).float()  # (over the heads: [B, T, H, D] here)
    # (the norms' rounded outputs rotated in float32 and rounded once, as the compiled rotary does)
    want_q = rotary_without_cat(q_norm(q).float(), c, s).to(dtype)
    want_k = rotary_without_cat(k_norm(k).float(), c, s).to(dtype)
    if dtype == torch.float32:
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    else:  # (a product may contract into the sum otherwise: one rounding)
        torch.testing.assert_close(got_q, want_q, rtol=2**-7, atol=2**-14)
        torch.testing.assert_close(got_k, want_k, rtol=2**-7, atol=2**-14)
    one_q, one_k = R.qk_norm_rotary(q_norm, k_norm, q[:, 1:2], k[:, 1:2], cos[:, 1:2], sin[:, 1:2])
    assert torch.equal(one_q, got_q[:, 1:2]) and torch.equal(one_k, got_k[:, 1:2])
    # With the page pool: the same q, the same keys (and the values as they are) in the pages at the
    # slot mapping, a row with a negative slot writing nothing (page 0 holds no token here).
    v = qkv[..., -hk * d:].view(1, t, hk, d)
    kv = torch.full((2, 2, 3, 4, hk, d), 7.0, dtype=dtype, device=DEVICE)
    slots = torch.tensor([9, -1, 4], device=DEVICE)
    batch = PagedBatch(kv=kv, page_table=torch.zeros(1, 3, dtype=torch.int32, device=DEVICE),
                       token_slot=torch.zeros(t, dtype=torch.long, device=DEVICE), positions=slots.clone(),
                       slot_mapping=slots, valid=slots >= 0, impl="triton")
    paged_q = R.qk_norm_rotary(q_norm, k_norm, q, k, cos, sin, pages=(v, batch, 1))
    assert torch.equal(paged_q, got_q)
    want = torch.full_like(kv, 7.0)
    for row, slot in ((0, 9), (2, 4)):
        want[1, 0].view(-1, hk, d)[slot] = got_k[0, row]
        want[1, 1].view(-1, hk, d)[slot] = v[0, row]
    assert torch.equal(kv, want)
    # Without q/k norms (Llama's attention): the rotary of the heads as they are and the same write,
    # in a step only, and only with the pages (the compiled rotary stays otherwise).
    kv.fill_(7.0)
    plain_q = R.qk_norm_rotary(None, None, q, k, cos, sin, pages=(v, batch, 1))
    want_q = rotary_without_cat(q.float(), c, s).to(dtype)
    want_k = rotary_without_cat(k.float(), c, s).to(dtype)
    for row, slot in ((0, 9), (2, 4)):
        want[1, 0].view(-1, hk, d)[slot] = want_k[0, row]
    if dtype == torch.float32:
        assert torch.equal(plain_q, want_q) and torch.equal(kv, want)
    else:
        torch.testing.assert_close(plain_q, want_q, rtol=2**-7, atol=2**-14)
        torch.testing.assert_close(kv, want, rtol=2**-7, atol=2**-14)
    assert R.qk_norm_rotary(None, None, q, k, cos, sin) is None
    with prompt_rows.marked(True):
        assert R.qk_norm_rotary(None, None, q, k, cos, sin, pages=(v, batch, 1)) is None
    with prompt_rows.marked(True):
        assert R.qk_norm_rotary(q_norm, k_norm, q, k, cos, sin) is None
    hook = k_norm.register_forward_hook(lambda _m, _a, out: out)
    assert R.qk_norm_rotary(q_norm, k_norm, q, k, cos, sin) is None
    hook.remove()
    other = (LlamaRMSNorm if zero_centred else Qwen3_5RMSNorm)(d, eps=1e-6).to(DEVICE, dtype)
    R.make_norms_row_invariant(nn.ModuleList([other]), steps=True)
    assert R.qk_norm_rotary(q_norm, other, q, k, cos, sin) is None
