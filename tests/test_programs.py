"""Numerical acceptance: the smol core's prepared programs against Transformers.

The programs run in-process exactly as the reference worker runs them: the
arena is one flat uint8 mapping filled from the core's arena image, the
recipe's model is bound to views of it, and every program reads and writes
named arena buffers. They are driven with the same writes the scheduler stages
(see ``StepEncoder.admission`` / ``prefill`` / ``decode``).
The reference is the canonical ``LlamaForCausalLM`` (eager attention) with the
weights read separately from the image file, in float32 and in float64.

Bound (derived, then measured). Let z be the exact logits; the float64 model
gives z to ~1e-13 relative, so we take hf64 = z (Transformers computes the
rotary cos/sin in float32 even in a float64 model; all three models share that
identical computation, so it cancels from every difference below).
``err32 = max |hf32 - hf64|`` over every compared position and vocabulary entry
is the rounding error of one valid float32 evaluation order of this network on these very inputs. Flare
evaluates the same function in float32 in another order (paged KV, chunked
prefill, batched decode, SDPA with an explicit mask), so its own error
``|flare - z|`` is a sum of rounding terms of the same sizes; allowing it to be up
to 3 * err32 (the maximum over ~6e7 entries of a different summation order stays
well within a small factor of another's), the triangle inequality gives

    |flare - hf32| <= |flare - z| + |z - hf32| <= 3 * err32 + err32 = 4 * err32,

plus 1e-6 so that the bound is never zero. Prefill logits are ``hidden @
lm_head.T`` in float64 (one rounding fewer than Flare's float32 head); decode
logits are Flare's own float32 ``out.logits``. The measured numbers are printed
(``pytest -s``); on the development machine: err32 = 1.04e-4, bound = 4.17e-4,
max |flare - hf32| = 7.9e-5 (prefill, 1,153 rows) and 1.9e-4 (decode, 130 rows),
no argmax disagreement.

Argmax: Flare's argmax must equal the float64 model's at every position. A
disagreement is accepted only as a proven near-tie: the float64 logit gap
between the two tokens must lie within the bound (Flare cannot be asked to
resolve differences smaller than float32 noise); anything else fails.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

from flare.core import interface as io
from flare.core.manifest import HIST_PROMPT_BIT
from flare.prepare.recipes import by_name
from flare.server.template import ChatTemplate
from flare.server.text import TextCodec
from tests.rig import (STEP_STATE, Rig, admit, copy_rig, decode, decode_alike, greedy_continuation, load_rig,
                       prefill, prefilled_rigs)

DECODE_STEPS = 10
BASE_LENGTHS = (15, 16, 17, 31, 32, 33, 127, 128, 129, 257, 290)  # page size 16, prefill chunk 128


@pytest.fixture(scope="module")
def rig(smol_core) -> Rig:
    r = load_rig(smol_core)
    m, c = r.m, r.m.capacities
    assert (c.prefill_capacities, c.decode_capacities, m.pages.page_size) == ((128,), (1, 2, 4), 16)
    r.codec = TextCodec(str(smol_core / m.frontend.tokenizer))
    r.template = ChatTemplate((smol_core / m.frontend.chat_template).read_text(), dict(m.frontend.special_tokens))
    return r


@pytest.fixture(scope="module")
def image_weights(smol_core, rig) -> dict[str, torch.Tensor]:
    """The persistent buffers read straight from the core's image file, independent of
    the arena the programs run in."""
    from safetensors.torch import load_file

    return load_file(str(smol_core / rig.m.arena.image))


@pytest.fixture(scope="module")
def hf_models(rig, image_weights):
    """The canonical model, fp32 and fp64, with the checkpoint weights from the image file.
    Rotary tables are Transformers' own (not the core's precomputed constants)."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    recipe = by_name(rig.m.reference.recipe)
    config = recipe.config_from_json(rig.m.reference.config)
    config._attn_implementation = "eager"
    models = []
    for dtype in (torch.float32, torch.float64):
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        # One tensor per buffer: ties stay tied; fused buffers split into their parts' rows.
        image = {k: t.to(dtype) for k, t in image_weights.items()}
        model.load_state_dict(recipe.checkpoint_state(rig.m.reference.config, image), strict=True, assign=True)
        model.model.rotary_emb = LlamaRotaryEmbedding(config=config)
        models.append(model.to(dtype).eval())
    assert models[0].lm_head.weight.data_ptr() == models[0].model.embed_tokens.weight.data_ptr()
    return models


# ---------------------------------------------------------------------------
# Cases


def chat_ids(r: Rig, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    return r.codec.encode(r.template.render(messages, add_generation_prompt=add_generation_prompt),
                          add_special_tokens=False)


LONG_CHAT = [
    {"role": "system", "content": "You are a patient tutor who explains things step by step."},
    {"role": "user", "content": "Why is the sky blue? Please keep it short but precise."},
    {"role": "assistant", "content": "Sunlight contains all colours. Air molecules scatter short wavelengths much "
                                     "more strongly than long ones (Rayleigh scattering, proportional to 1/λ⁴), so "
                                     "blue light is redirected across the whole sky and reaches your eyes from every "
                                     "direction, while the direct sunlight looks slightly yellow."},
    {"role": "user", "content": "Then why are sunsets red and orange instead of blue?"},
    {"role": "assistant", "content": "At sunset the light crosses far more atmosphere. Most of the blue is scattered "
                                     "out of the beam long before it reaches you, so what remains in the direct path "
                                     "is dominated by red and orange. Dust and aerosols make the colours stronger."},
    {"role": "user", "content": "Could you write a tiny Python function that converts a wavelength in nanometres "
                                "to a rough colour name? Also mention 日本語 and émojis 🌅 in a comment."},
    {"role": "assistant", "content": "def colour(nm):\n    # 日本語 comment with émojis 🌅\n    if nm < 450:\n        "
                                     "return 'violet'\n    if nm < 495:\n        return 'blue'\n    if nm < 570:\n"
                                     "        return 'green'\n    if nm < 590:\n        return 'yellow'\n    return "
                                     "'red'"},
]


@dataclass
class Case:
    name: str
    prompt: list[int]
    continuation: list[int]  # teacher-forced decode tokens


@pytest.fixture(scope="module")
def cases(rig) -> list[Case]:
    base = chat_ids(rig, LONG_CHAT, add_generation_prompt=False)
    assert len(base) >= max(BASE_LENGTHS) + DECODE_STEPS
    out = [Case(f"prefix{L}", base[:L], base[L : L + DECODE_STEPS]) for L in BASE_LENGTHS]
    q = chat_ids(rig, [{"role": "user", "content": "What is the capital of France? Answer in one word."}])
    a = rig.codec.encode("Paris is the capital of France.<|im_end|>", add_special_tokens=False)
    out.append(Case("chat_france", q, (a * 2)[:DECODE_STEPS]))
    q = chat_ids(rig, [{"role": "system", "content": "Réponds brièvement."},
                       {"role": "user", "content": "Traduis en japonais : « bonjour » 🙂"}])
    a = rig.codec.encode("こんにちは (konnichiwa) 🙂 — voilà !", add_special_tokens=False)
    out.append(Case("chat_unicode", q, a[:DECODE_STEPS]))
    assert all(len(c.continuation) == DECODE_STEPS for c in out) and len(out) >= 8
    return out


# Decode groups: sizes 4, 3, 2, 1, 3 exercise decode.4 (full and padded), decode.2 and decode.1 with
# requests of different lengths side by side.
GROUPS = ((0, 1, 2, 3), (4, 5, 6), (7, 8), (9,), (10, 11, 12))


@dataclass
class Outcome:
    prefill_hidden: torch.Tensor  # [L, H] float32 out.prefill_hidden rows
    prefill_head: torch.Tensor  # [V] float32 out.logits of the last prompt token
    prefill_record: io.Completion
    decode_rows: torch.Tensor  # [DECODE_STEPS, V] float32 out.logits
    decode_records: list[io.Completion]  # one per decode step
    state_after_prefill: dict


@pytest.fixture(scope="module")
def flare_outcomes(rig, cases, hf_models) -> list[Outcome]:
    # hf_models first: the reference is built before any program has run.
    out: list[Outcome | None] = [None] * len(cases)
    for group in GROUPS:
        slots = list(range(1, len(group) + 1))
        pre = {}
        for slot, i in zip(slots, group):
            c = cases[i]
            pages = rig.pages(-(-(len(c.prompt) + DECODE_STEPS) // rig.m.pages.page_size))
            admit(rig, slot, c.prompt, pages, seed=1000 + i)
            hidden, last, record = prefill(rig, slot, c.prompt)
            state = {k: rig.v[k][slot].clone() for k in ("state.len", "state.generated", "state.counter",
                                                          "state.pending", "state.hist")}
            pre[i] = (hidden, last, record, state)
        rows, recs = [], []
        for step in range(DECODE_STEPS):
            logits, record = decode(rig, slots, [cases[i].continuation[step] for i in group])
            rows.append(logits)
            recs.append(record)
        for k, i in enumerate(group):
            p = pre[i]
            out[i] = Outcome(p[0], p[1], p[2], torch.stack([x[k] for x in rows]), [x[k] for x in recs], p[3])
    return out


@pytest.fixture(scope="module")
def hf_logits(hf_models, cases) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(float32, float64) logits over prompt + continuation for every case; prefixes of
    the long chat share one forward (causal: row i depends on tokens <= i only)."""
    hf32, hf64 = hf_models
    memo = {}

    def forward(ids: tuple[int, ...]):
        if ids not in memo:
            with torch.inference_mode():
                x = torch.tensor([list(ids)])
                memo[ids] = (hf32(input_ids=x).logits[0], hf64(input_ids=x).logits[0])
        return memo[ids]

    longest = max((c for c in cases if c.name.startswith("prefix")), key=lambda c: len(c.prompt))
    full = tuple(longest.prompt + longest.continuation)
    out = []
    for c in cases:
        seq = tuple(c.prompt + c.continuation)
        if full[: len(seq)] == seq:
            l32, l64 = forward(full)
            out.append((l32[: len(seq)], l64[: len(seq)]))
        else:
            out.append(forward(seq))
    return out


# ---------------------------------------------------------------------------
# The comparisons


@dataclass
class Stats:
    d_flare: float = 0.0  # max |flare - hf32|
    d_flare64: float = 0.0  # max |flare - hf64|
    err32: float = 0.0  # max |hf32 - hf64|
    rows: int = 0
    mismatches: list = field(default_factory=list)


def compare(stats: Stats, name: str, offset: int, flare: torch.Tensor, l32: torch.Tensor, l64: torch.Tensor) -> None:
    flare, l32 = flare.double(), l32.double()
    stats.d_flare = max(stats.d_flare, float((flare - l32).abs().max()))
    stats.d_flare64 = max(stats.d_flare64, float((flare - l64).abs().max()))
    stats.err32 = max(stats.err32, float((l32 - l64).abs().max()))
    stats.rows += flare.shape[0]
    a_fl, a_64 = flare.argmax(-1), l64.argmax(-1)
    for pos in torch.nonzero(a_fl != a_64).flatten().tolist():
        gap = float(l64[pos, a_64[pos]] - l64[pos, a_fl[pos]])
        stats.mismatches.append((name, offset + pos, int(a_fl[pos]), int(a_64[pos]), gap))


@pytest.fixture(scope="module")
def comparison(rig, cases, flare_outcomes, hf_logits):
    head = rig.model.lm_head.weight.detach().double()
    pre, dec = Stats(), Stats()
    for c, o, (l32, l64) in zip(cases, flare_outcomes, hf_logits):
        L = len(c.prompt)
        compare(pre, c.name, 0, o.prefill_hidden.double() @ head.T, l32[:L], l64[:L])
        compare(dec, c.name, L, o.decode_rows, l32[L:], l64[L:])
    err32 = max(pre.err32, dec.err32)
    bound = 4 * err32 + 1e-6
    report = {
        "bound": bound, "err_hf32": err32,
        "prefill": {"rows": pre.rows, "max|flare-hf32|": pre.d_flare, "max|flare-hf64|": pre.d_flare64,
                    "max|hf32-hf64|": pre.err32, "argmax_mismatches": pre.mismatches},
        "decode": {"rows": dec.rows, "max|flare-hf32|": dec.d_flare, "max|flare-hf64|": dec.d_flare64,
                   "max|hf32-hf64|": dec.err32, "argmax_mismatches": dec.mismatches},
    }
    print("\nprogram acceptance:", json.dumps(report, indent=1))
    return pre, dec, bound, err32


def test_reference_error_is_measured(comparison):
    """The bound is only meaningful if float32 rounding is visible and small."""
    _, _, bound, err32 = comparison
    assert 1e-7 < err32 < 1e-2


def test_prefill_logits_match_transformers(comparison, cases):
    pre, _, bound, _ = comparison
    assert pre.rows == sum(len(c.prompt) for c in cases)
    assert pre.d_flare <= bound, f"prefill: max |flare - hf32| = {pre.d_flare:.3g} > bound {bound:.3g}"


def test_decode_logits_match_transformers(comparison, cases):
    _, dec, bound, _ = comparison
    assert dec.rows == DECODE_STEPS * len(cases)
    assert dec.d_flare <= bound, f"decode: max |flare - hf32| = {dec.d_flare:.3g} > bound {bound:.3g}"


def test_argmax_agrees_at_every_position(comparison):
    pre, dec, bound, _ = comparison
    bad = [m for m in pre.mismatches + dec.mismatches if m[4] > bound]
    assert not bad, f"argmax differs beyond a near-tie (name, position, flare, hf64, gap): {bad}"


def test_prefill_last_row_head_and_greedy_sample(rig, cases, flare_outcomes, hf_logits, comparison):
    """out.logits of the last prompt token (Flare's float32 head) and the first sampled
    token: with top_k = 1 it is the argmax of out.logits, and the float64 model agrees."""
    *_, bound, _ = comparison
    for c, o, (l32, l64) in zip(cases, flare_outcomes, hf_logits):
        L = len(c.prompt)
        assert float((o.prefill_head.double() - l32[L - 1].double()).abs().max()) <= bound
        slot, tok, generated, status = o.prefill_record
        assert tok == int(o.prefill_head.argmax()) and generated == 1
        assert status == (io.Status.stop if tok in rig.m.frontend.eos_ids else io.Status.running)
        if tok != int(l64[L - 1].argmax()):
            assert float(l64[L - 1].max() - l64[L - 1, tok]) <= bound
        st = o.state_after_prefill
        assert (int(st["state.len"]), int(st["state.generated"]), int(st["state.counter"])) == (L, 1, 1)
        assert int(st["state.pending"]) == tok
        # Histogram: prompt bit for each distinct prompt token, plus one count for the sample.
        expected = torch.zeros_like(st["state.hist"])
        expected[torch.tensor(sorted(set(c.prompt)))] = HIST_PROMPT_BIT
        expected[tok] += 1
        assert torch.equal(st["state.hist"], expected)


def test_decode_records_are_greedy_and_counted(cases, flare_outcomes):
    for c, o in zip(cases, flare_outcomes):
        recs = o.decode_records
        assert [r.token for r in recs] == o.decode_rows.argmax(-1).tolist()
        assert [r.generated for r in recs] == list(range(2, 2 + DECODE_STEPS))


def test_padded_and_finished_rows_write_nothing(rig):
    """decode.4 with one live slot, one finished slot and two padded rows: every state
    row but the live one, and every KV page except the live slot's written position and
    the null page, are bitwise unchanged."""
    v, ps = rig.v, rig.m.pages.page_size
    codec = rig.codec
    prompts = {s: codec.encode(t, add_special_tokens=False) for s, t in
               {1: "The quick brown fox jumps over the lazy dog.", 2: "One two three four five six seven",
                3: "Bonjour tout le monde, ceci est un test."}.items()}
    owned = {}
    for s, p in prompts.items():
        owned[s] = rig.pages(3)
        admit(rig, s, p, owned[s], seed=s)
        prefill(rig, s, p)
    v["state.done"][2] = 1  # finished: in the batch but not live
    # Slot 4 holds a stale row from earlier tests; it is not in the batch.
    state_names = [b.name for b in rig.m.buffers if b.role.value == "state"]
    before = {k: v[k].clone() for k in state_names}
    # KV: pages handed out so far (this module's earlier cases included) are snapshotted;
    # every other page except the null page has never been written and must stay zero.
    kv = v["kv"]
    unused = sorted(rig.free_pages)
    used = sorted(set(range(1, rig.m.pages.num_pages)) - set(unused))
    used_before = kv.index_select(2, torch.tensor(used)).clone()

    def zero_pages() -> bool:
        return all(int(torch.count_nonzero(kv[:, :, p])) == 0 for p in unused)

    assert zero_pages()
    v["in.decode_slots"][:] = torch.tensor([1, 2, 0, 0], dtype=torch.int32)
    rig.run["decode.4"]()
    rec = [io.completion(row) for row in v[io.DECODE_COMPLETION]]
    L = len(prompts[1])
    assert rec[0].slot == 1 and rec[0].token >= 0 and rec[0].generated == 2
    assert rec[1] == io.Completion(2, -1, 1, io.Status.inactive)
    assert rec[2] == io.Completion(0, -1, int(before["state.generated"][0]), io.Status.inactive)
    assert rec[3] == rec[2]
    for k in state_names:
        for row in range(v[k].shape[0]):
            if row != 1:
                assert torch.equal(v[k][row], before[k][row]), f"{k}[{row}] changed"
    assert int(v["state.len"][1]) == L + 1
    # Only (page of position L, offset L % ps) of slot 1 changed, in every layer, K and V.
    changed = (kv.index_select(2, torch.tensor(used)) != used_before).any(dim=(0, 1, 4, 5))  # [pages, offsets]
    page, off = owned[1][L // ps], L % ps
    assert [[used[i], o] for i, o in torch.nonzero(changed).tolist()] == [[page, off]]
    assert changed.sum() == 1 and bool((kv[:, :, page, off] != used_before[:, :, used.index(page), off]).all())
    assert zero_pages()


def test_programs_never_write_weights(rig, image_weights, flare_outcomes):
    """After every program above ran, each persistent buffer in the arena still holds
    exactly the bytes of the image: programs write only runtime buffers."""
    for b in rig.m.buffers:
        if b.role.value == "weight":
            assert torch.equal(rig.v[b.name], image_weights[b.name]), b.name


def test_grammar_mask_constrains_prefill_and_decode_samples(rig):
    """A slot with ``state.mask_on`` samples only tokens its ``in.token_mask`` row allows
    (greedy here: the best allowed token by ``out.logits``), in prefill and in decode,
    while an unconstrained slot in the same decode batch keeps its plain argmax even
    though its own mask row is set to forbid it."""
    v, V = rig.v, rig.m.capacities.vocab_size
    words = v["in.token_mask"].shape[1]

    def mask_row(allowed) -> torch.Tensor:
        row = [0] * words
        for t in allowed:
            row[t // 32] |= 1 << (t % 32)
        return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in row], dtype=torch.int32)

    prompt = rig.codec.encode("The capital of France is", add_special_tokens=False)
    for s in (1, 2):
        admit(rig, s, prompt, rig.pages(2), seed=s)
    v["state.mask_on"][1], v["state.mask_on"][2] = 1, 0
    _, head, _ = prefill(rig, 2, prompt)
    free_choice = int(head.argmax())
    allowed = sorted(int(t) for t in head.argsort(descending=True)[5:9])  # four tokens below the top five
    v["in.token_mask"][1] = mask_row(allowed + [V - 1])
    v["in.token_mask"][2] = mask_row([3])
    _, head1, record = prefill(rig, 1, prompt)
    first = record.token
    assert first == max(allowed, key=lambda t: float(head1[t])) and first != free_choice
    v["in.token_mask"][1] = mask_row([7, 8])
    logits, records = decode(rig, [1, 2], [first, free_choice])
    assert records[0].token == max((7, 8), key=lambda t: float(logits[0, t]))
    assert records[1].token == int(logits[1].argmax()) and records[1].token != 3
    v["state.mask_on"][1] = 0


@pytest.mark.parametrize("model", ["llama-tiny", "qwen3_5-tiny"])
def test_small_prefill_programs_give_the_same_hidden_rows(model):
    """A core prepared with --min-prefill-capacity 16 runs a 10-token prompt on prefill.16
    and a 40-token one on prefill.64; their hidden rows equal prefill.128's (the default
    core's) to float32 summation order. For the hybrid too: its Gated DeltaNet state and
    block grid (a 10-token prompt is a partial block) in programs of 16 and 64 rows."""
    from tests.conftest import HYBRID_OPTS, TINY_OPTS, prepare_core
    from tests.rig import admit, load_rig, prefill

    opts = HYBRID_OPTS if model == "qwen3_5-tiny" else TINY_OPTS
    small = prepare_core(model, [*opts, "--min-prefill-capacity", "16"], name=f"{model}-small-prefill")
    base = prepare_core(model, opts)
    rigs = [load_rig(small), load_rig(base)]
    assert rigs[0].m.capacities.prefill_capacities == (16, 32, 64, 128)
    assert rigs[1].m.capacities.prefill_capacities == (128,)
    ran = []
    for n in (10, 40):
        prompt = list(range(100, 100 + n))
        rows = []
        for r in rigs:
            runs = dict(r.run)
            r.run = {k: (lambda f=f, k=k: ran.append(k) or f()) for k, f in runs.items()}
            admit(r, 1, prompt, list(range(1, 8)), seed=1)
            rows.append(prefill(r, 1, prompt)[0])
            r.run = runs
        torch.testing.assert_close(rows[0], rows[1], atol=1e-5, rtol=1e-5)
        # The continuation state a later chunk or decode step starts from (the recurrent and
        # block-start matrices, the convolution history, the stash and the grid position).
        for name in [b.name for b in rigs[0].m.buffers if b.name.startswith("state.gdn.")]:
            a, b = (r.v[name][1] for r in rigs)
            if a.dtype.is_floating_point:
                torch.testing.assert_close(a.float(), b.float(), atol=1e-5, rtol=1e-5, msg=name)
            else:
                assert torch.equal(a, b), name
    assert "prefill.16" in ran and "prefill.64" in ran and ran.count("prefill.128") == 2
    assert (model == "qwen3_5-tiny") == any(b.name.startswith("state.gdn.") for b in rigs[0].m.buffers)


@pytest.mark.parametrize("attention", ["reference", "triton"])
def test_pack_program_equals_separate_prefills(attention):
    """A core prepared with --pack-capacities 64 runs three slots' chunks in one pack program
    (one slot continuing a 20-token history, a segment that does not sample, five unused
    segments), on the reference and the Triton attention paths: hidden rows, lengths,
    final hidden vectors, sampled tokens and records equal separate prefill programs' (to
    float32 summation order), and a decode step after it reads the KV the pack wrote as it
    reads the prefills'."""
    from flare.core.manifest import ProgramKind
    from tests.conftest import TINY_OPTS, prepare_core
    from tests.rig import completion, decode, prefill

    # Prefill programs from 16 rows up: the separate prefills below (5 to 12 tokens) run
    # prefill.16, not a prefill.128 of ~9 s under Triton's interpreter (mostly padded rows).
    core = prepare_core("llama-tiny", [*TINY_OPTS, "--pack-capacities", "64", "--min-prefill-capacity", "16"],
                        name="llama-tiny-pack-small-prefill")
    history = list(range(300, 320))
    chunks = {1: list(range(100, 107)), 2: list(range(200, 212)), 3: list(range(400, 409))}
    samples = {1: True, 2: False, 3: True}
    # Both rigs start in one state: the three slots admitted and slot 1's history prefilled
    # (once, on the reference path: the history's prefill is not what is compared). triton:
    # every program below runs the CUDA path's kernels (Triton's CPU interpreter here).
    packed, separate = prefilled_rigs(core, {s: (history if s == 1 else []) + chunks[s] for s in chunks}, 2,
                                      attention=attention, pages=8, prefilled={1: len(history)}, sample=False)
    m = packed.m
    assert m.capacities.pack_capacities == (64,) and m.program("pack.64").kind == ProgramKind.pack
    assert m.capacities.prefill_capacities == (16, 32, 64, 128)
    S = max(m.capacities.decode_capacities)
    rows, records = [], []
    for slot, toks in chunks.items():
        rows.append(prefill(separate, slot, toks, sample=samples[slot])[0])
        records.append(completion(separate, io.PREFILL_COMPLETION)[0])
    v = packed.v
    starts = {1: 0, 2: 9, 3: 32}  # gaps between segments: rows nobody reads
    v[io.TOKENS][:] = 0
    for slot, toks in chunks.items():
        v[io.TOKENS][starts[slot] : starts[slot] + len(toks)] = torch.tensor(toks, dtype=torch.int32)
    pack_rows = torch.zeros((S, len(io.PackSegment._fields)), dtype=torch.int32)
    for i, (slot, toks) in enumerate(chunks.items()):
        pack_rows[i] = torch.from_numpy(io.pack(io.PackSegment(slot, len(toks), int(samples[slot]), starts[slot])))
    v[io.PACK_INPUT][:] = pack_rows
    packed.run["pack.64"]()
    hidden = torch.cat([v["out.prefill_hidden"][starts[s] : starts[s] + len(t)] for s, t in chunks.items()])
    torch.testing.assert_close(hidden, torch.cat(rows), atol=1e-5, rtol=1e-5)
    got = completion(packed, io.PACK_COMPLETION, S)
    assert got[:3] == records, (got, records)
    assert got[1].token == -1 and got[1].status == int(io.Status.inactive)  # asked not to sample
    assert all(g.slot == 0 and g.token == -1 for g in got[3:])  # unused segments
    for slot, toks in chunks.items():
        assert int(v["state.len"][slot]) == int(separate.v["state.len"][slot]) == len(toks) + 20 * (slot == 1)
        torch.testing.assert_close(v["state.hidden"][slot], separate.v["state.hidden"][slot], atol=1e-5, rtol=1e-5)
    # The next step of every slot: the KV the pack wrote is read back the same.
    _, after_pack = decode(packed, [1, 2, 3], [7, 8, 9])
    _, after_prefills = decode(separate, [1, 2, 3], [7, 8, 9])
    assert after_pack == after_prefills
    torch.testing.assert_close(packed.v["out.logits"][:3], separate.v["out.logits"][:3], atol=1e-4, rtol=1e-4)
    # A decode step carrying a prefill chunk: slot 1's next 5 tokens, then slots 2 and 3's
    # pending tokens as one-row segments, against a prefill and a decode program.
    v[io.TOKENS][:7] = torch.tensor([11, 12, 13, 14, 15, int(v["state.pending"][2]), int(v["state.pending"][3])],
                                    dtype=torch.int32)
    pack_rows[:] = 0
    for i, (slot, n, row) in enumerate([(1, 5, 0), (2, 1, 5), (3, 1, 6)]):
        pack_rows[i] = torch.from_numpy(io.pack(io.PackSegment(slot, n, 1, row)))
    v[io.PACK_INPUT][:] = pack_rows
    packed.run["pack.64"]()
    got = completion(packed, io.PACK_COMPLETION, 3)
    logits = packed.v["out.logits"][:3].clone()
    prefill(separate, 1, [11, 12, 13, 14, 15])
    want = [completion(separate, io.PREFILL_COMPLETION)[0]]
    want_logits = [separate.v["out.logits"][0].clone()]
    decoded_logits, decoded = decode(separate, [2, 3], [int(separate.v["state.pending"][s]) for s in (2, 3)])
    assert got == want + decoded, (got, want, decoded)
    torch.testing.assert_close(logits, torch.cat([torch.stack(want_logits), decoded_logits]), atol=1e-4, rtol=1e-4)
    for name in ("state.len", "state.pending", "state.generated", "state.counter", "state.hist"):
        assert torch.equal(v[name][1:4], separate.v[name][1:4]), name
    # A finished slot's segment changes nothing of it; its record says inactive.
    v["state.done"][2] = int(io.Status.stop)
    before = {name: v[name][2].clone() for name in ("state.len", "state.hidden", "state.pending", "state.counter")}
    packed.run["pack.64"]()
    assert completion(packed, io.PACK_COMPLETION, 3)[1].status == int(io.Status.inactive)
    assert all(torch.equal(v[name][2], old) for name, old in before.items())


# Four greedy slots' prompts for the verify tests (here and test_hybrid_verify.py).
VERIFY_PROMPTS = {1: list(range(40, 60)), 2: list(range(70, 83)), 3: list(range(90, 95)), 4: list(range(5, 37))}


def _verify(r, rows: list[tuple[int, list[int]]], count_override: dict | None = None):
    """One verify step: (slot, drafts) per row; returns each row's (record, emitted tokens)."""
    c = r.m.capacities
    D = c.draft_tokens
    cap = next(b for b in c.decode_capacities if b >= len(rows))
    inputs = torch.zeros((max(c.decode_capacities), len(io.VerifyInput._fields)), dtype=torch.int32)
    drafts = torch.zeros((max(c.decode_capacities), D), dtype=torch.int32)
    for i, (slot, d) in enumerate(rows):
        n = (count_override or {}).get(slot, len(d))
        inputs[i] = torch.from_numpy(io.pack(io.VerifyInput(slot, n, c.context_limit)))
        drafts[i, : len(d)] = torch.tensor(d, dtype=torch.int32)
    r.v[io.VERIFY_INPUT][:] = inputs
    r.v[io.DRAFTS][:] = drafts
    r.run[f"verify.{cap}"]()
    return [io.verify_record(r.v[io.VERIFY_COMPLETION][i].tolist(), D) for i in range(len(rows))]


@pytest.mark.parametrize("attention", ["reference", "triton"])
def test_verify_program_emits_what_decode_steps_emit(attention):
    """A core prepared with --draft-tokens 3, greedy requests (top_k 1) in four slots: one
    verify step with drafts that are the true continuation (all accepted: 4 tokens), wrong at
    the second draft (2 tokens), wrong at the first (1 token) and no drafts (1 token) emits
    what separate decode steps emit, and leaves every slot's state (length, pending token,
    generated count, counter, histogram) as those steps do; the rejected drafts' KV, written
    past the new lengths, changes nothing that follows (the next steps agree). A finished
    slot's row changes nothing and says inactive; a constrained slot verifies no drafts. On
    the reference and the Triton attention paths."""
    from tests.conftest import TINY_OPTS, prepare_core

    core = prepare_core("llama-tiny", [*TINY_OPTS, "--draft-tokens", "3"], name="llama-tiny-verify")
    prompts = VERIFY_PROMPTS
    # Two rigs in one state, the prompts prefilled (once, on the reference path: the prefills
    # are not what this test checks, and under Triton's interpreter each is a padded prefill.128
    # of ~9 s); triton: every program below runs the CUDA path's kernels (Triton's CPU
    # interpreter), several rows of one slot.
    spec, plain = prefilled_rigs(core, prompts, 2, attention=attention)
    c = spec.m.capacities
    assert c.draft_tokens == 3 and [p.name for p in spec.m.programs if p.kind.value == "verify"] == [
        f"verify.{b}" for b in c.decode_capacities]
    # The true greedy continuation of each slot (the pending token, then 4 more), from a third
    # rig in that state decoding the four slots together (a row does not depend on its batch),
    # on the reference path: under the interpreter its steps would cost what plain's do. Were
    # the paths' greedy tokens to differ, the verify step's tokens and plain's steps below would
    # not both match them: the test fails, it cannot pass on another path's truth.
    shadow = load_rig(core)
    copy_rig(spec, shadow)
    truth = greedy_continuation(shadow, list(prompts), 4)
    # Drafts continue the pending token: the true next tokens are truth[s][1:].
    wrong = lambda t: (t + 1) % c.sampling_vocab  # noqa: E731
    rows = [(1, truth[1][1:4]), (2, [truth[2][1], wrong(truth[2][2]), truth[2][3]]), (3, [wrong(truth[3][1]), 0, 0]),
            (4, [])]
    got = _verify(spec, rows)
    want_emitted = {1: 4, 2: 2, 3: 1, 4: 1}
    for (slot, _), (rec, toks) in zip(rows, got):
        assert rec.slot == slot and rec.emitted == want_emitted[slot] and rec.status == int(io.Status.running)
        assert toks == truth[slot][1 : 1 + rec.emitted], (slot, toks, truth[slot])
    # The plain rig decodes each slot as many steps as it emitted (slots still due, together).
    for k in range(4):
        due = [s for s in prompts if want_emitted[s] > k]
        decode(plain, due, [int(plain.v["state.pending"][s]) for s in due])
    for (slot, _), (rec, _) in zip(rows, got):
        for name in STEP_STATE:
            assert torch.equal(spec.v[name][slot], plain.v[name][slot]), (slot, name)
        assert rec.generated == int(plain.v["state.generated"][slot])
        torch.testing.assert_close(spec.v["state.hidden"][slot], plain.v["state.hidden"][slot], atol=1e-5, rtol=1e-5)
    # The next steps read only accepted KV: both rigs go on alike.
    decode_alike(spec, plain, list(prompts))
    # A finished slot: nothing changes, the record says inactive and emitted nothing.
    spec.v["state.done"][2] = int(io.Status.stop)
    before = {n: spec.v[n][2].clone() for n in ("state.len", "state.pending", "state.counter", "state.hist")}
    (rec, toks), _ = _verify(spec, [(2, [1, 2, 3]), (1, [])])
    assert rec.status == int(io.Status.inactive) and rec.emitted == 0 and toks == []
    assert all(torch.equal(spec.v[n][2], old) for n, old in before.items())
    # A constrained slot (grammar mask on, every token allowed) verifies no drafts, not even the
    # true continuation (the next three tokens of the plain rig's state, on the reference rig):
    # it emits one token.
    copy_rig(plain, shadow)
    nxt = [decode(shadow, [3], [int(shadow.v["state.pending"][3])])[1][0].token for _ in range(3)]
    spec.v["state.mask_on"][3] = 1
    spec.v["in.token_mask"][3] = -1
    (rec, toks), = _verify(spec, [(3, nxt)])
    assert rec.emitted == 1 and toks == nxt[:1]


def test_scratch_default_grows_with_the_weights():
    """flare-prepare's scratch reservation (CUDA): --scratch-memory when given, else 6 GiB or a
    fifth of the weights, whichever is larger (4 GiB ran out for a 36 GB MoE shape, and for the 9B
    hybrid shape's 17.9 GB)."""
    from flare.prepare.plan import GiB, Options, scratch_gib

    assert scratch_gib(Options(), 16 * GiB) == 6.0
    assert scratch_gib(Options(), 35 * GiB) == pytest.approx(7.0)
    assert scratch_gib(Options(scratch_memory_gib=1.5), 35 * GiB) == 1.5


def test_combo_kernels_reach_inductor_only_when_asked():
    """flare-prepare --combo-kernels: the CLI passes it on, and compiling the layers turns
    Inductor's combo kernels on for that preparation and off otherwise."""
    from types import SimpleNamespace

    import torch._dynamo
    import torch._inductor.config as ic

    from flare.prepare import cli
    from flare.prepare.build import _compile_layers

    assert cli.parser().parse_args(["m", "--out", "x", "--combo-kernels"]).combo_kernels
    assert not cli.parser().parse_args(["m", "--out", "x"]).combo_kernels
    recipe = SimpleNamespace(decoder_layers=lambda model: [torch.nn.Linear(4, 4)])
    # Restored after the test with the config modules' own patch (pytest's monkeypatch deletes a
    # torch config entry when it undoes a setattr on it).
    with ic.patch(combo_kernels=ic.combo_kernels, use_static_cuda_launcher=ic.use_static_cuda_launcher), \
            torch._dynamo.config.patch(cache_size_limit=torch._dynamo.config.cache_size_limit,
                                       accumulated_cache_size_limit=torch._dynamo.config.accumulated_cache_size_limit):
        _compile_layers(recipe, torch.nn.Module(), combo=True)
        assert ic.combo_kernels is True
        _compile_layers(recipe, torch.nn.Module())
        assert ic.combo_kernels is False
