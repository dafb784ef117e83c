"""Learned drafts from a multi-token-prediction head (issue 20, ``flare-prepare --mtp``,
``flare-serve --speculative mtp``) on the tiny Qwen3.5 hybrid with random weights.

Random weights say nothing about how often a trained head's drafts are accepted; what they do
check is that the head computes what it is defined to compute. The programs keep the head's
KV rows across prefill chunks, decode and verify steps (and the rows a verify step writes for
rejected drafts), so the drafts in a verify record must equal the head's greedy chain computed
from scratch over the whole history: Transformers' hidden states of the model, then the head
with eager causal attention (``_reference_drafts``, written from the definition, not from the
programs). And since every draft is verified, greedy requests come out the same as without
speculation.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from flare.core import interface as io
from flare.core.manifest import load_manifest
from flare.prepare.recipes import by_name, mtp
from tests.conftest import HYBRID_OPTS, prepare_core
from tests.rig import admit, decode, load_rig, prefill, transformers_model
from tests.test_pipeline import Sink, _params, _run

D = 3


@pytest.fixture(scope="module")
def mtp_core():
    return prepare_core("qwen3_5-tiny", [*HYBRID_OPTS, "--draft-tokens", str(D), "--mtp"], name="qwen3_5-tiny-mtp")


def _reference(core):
    """Transformers' model on the core's weights and the head on its ``mtp.*`` weights."""
    from safetensors.torch import load_file

    m = load_manifest(core)
    model = transformers_model(core, m, torch.float32)
    recipe = by_name(m.reference.recipe)
    state = recipe.checkpoint_state(m.reference.config, load_file(str(core / m.arena.image)), mtp=True)
    head = mtp.MtpHead(model, model.config, torch.float32)
    head.load_state_dict({k[len("mtp."):]: v for k, v in state.items() if k.startswith("mtp.")}, strict=True)
    return m, model, head.eval()


_CAPTURED: list = []


def _capture(module, query, key, value, attention_mask, **kwargs):
    """Eager attention that keeps the keys and values it attends over (the head's KV rows)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import eager_attention_forward

    _CAPTURED[:] = [key[0].transpose(0, 1), value[0].transpose(0, 1)]  # [T, KVH, D] each
    return eager_attention_forward(module, query, key, value, attention_mask, **kwargs)


@torch.inference_mode()
def _reference_drafts(ref, consumed: list[int], pending: int, k: int):
    """The head's greedy chain after ``consumed`` tokens and the pending one, from its
    definition (``recipes/mtp.py``): the input for token t is (that token, the model's
    final-normed hidden vector at t - 1; zeros for t = 0) at position t, causal attention over
    inputs 0..t; each draft and the head's output feed the next position. Returns the drafts,
    each one's margin over the runner-up logit, and the keys and values of the head's inputs
    0..len(consumed) + k - 1 (``[T, KVH, D]`` each)."""
    from transformers import AttentionInterface

    AttentionInterface.register("flare_test_capture", _capture)
    m, model, head = ref
    head.layers[0].self_attn.config._attn_implementation = "flare_test_capture"
    inner = model.model
    hidden = inner(input_ids=torch.tensor([consumed])).last_hidden_state[0]
    tokens, rows, drafts, margins = consumed + [pending], [torch.zeros_like(hidden[0]), *hidden], [], []
    for _ in range(k):
        T = len(tokens)
        x = torch.cat([head.pre_fc_norm_embedding(inner.embed_tokens(torch.tensor(tokens))),
                       head.pre_fc_norm_hidden(torch.stack(rows))], -1)
        x = head.fc(x)[None]
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
        x = head.layers[0](x, position_embeddings=inner.rotary_emb(x, pos), attention_mask=mask, position_ids=pos)
        out = head.norm(x)[0]
        logits = model.lm_head(out[-1])[: m.capacities.sampling_vocab].float()
        top = torch.topk(logits, 2).values
        drafts.append(int(logits.argmax()))
        margins.append(float(top[0] - top[1]))
        tokens, rows = tokens + [drafts[-1]], rows + [out[-1]]
    return drafts, margins, tuple(_CAPTURED)


@torch.inference_mode()
def _greedy_next(ref, seq: list[int]) -> int:
    """The model's greedy token after ``seq`` (Transformers)."""
    m, model, _ = ref
    return int(model(input_ids=torch.tensor([seq])).logits[0, -1, : m.capacities.sampling_vocab].argmax())


def _verify(r, slot: int, drafts: list[int], room: int) -> tuple[list[int], list[int]]:
    """One verify step of one slot: its emitted tokens and the head's drafts in its record."""
    c = r.m.capacities
    r.v[io.VERIFY_INPUT][:] = 0
    r.v[io.VERIFY_INPUT][0] = torch.from_numpy(io.pack(io.VerifyInput(slot, len(drafts), room)))
    r.v[io.DRAFTS][0, : len(drafts)] = torch.tensor(drafts, dtype=torch.int32)
    r.run["verify.1"]()
    row = r.v[io.VERIFY_COMPLETION][0].tolist()
    _, tokens = io.verify_record(row, c.draft_tokens, c.mtp_drafts)
    return tokens, io.mtp_drafts(row, c.draft_tokens, c.mtp_drafts)


def _agree(got: list[int], want: list[int], margins: list[float]) -> bool:
    """The chains agree up to the first draft whose reference is a near tie (float32 sums in
    another order may pick the runner-up there; the chain after it then differs). Whether
    every draft was compared."""
    for g, w, margin in zip(got, want, margins):
        if margin < 1e-3:
            return False
        assert g == w, (got, want, margins)
    return True


def _head_rows(r, pages: list[int], n: int):
    """The slot's first ``n`` rows of the head's KV layer (the pool's last), keys and values."""
    kv = r.v["kv"][-1]  # [2, P, page_size, KVH, D]
    idx = torch.tensor(pages)
    return [kv[i].index_select(0, idx).reshape(-1, *kv.shape[-2:])[:n] for i in (0, 1)]


def test_the_core_keeps_the_head_and_one_more_kv_layer(mtp_core, hybrid_core):
    m, plain = load_manifest(mtp_core), load_manifest(hybrid_core)
    assert m.capacities.mtp_drafts == D == m.capacities.draft_tokens and plain.capacities.mtp_drafts == 0
    kv = {b.name: b.shape for b in m.buffers}["kv"]
    assert kv[0] == {b.name: b.shape for b in plain.buffers}["kv"][0] + 1
    assert any(b.name.startswith("w.mtp.") for b in m.buffers)
    assert not any(b.name.startswith("w.mtp.") for b in plain.buffers)


def test_verify_records_carry_the_heads_greedy_chain(mtp_core):
    """A prompt prefilled in three chunks, two decode steps, then three verify steps (a draft
    accepted, all rejected, the head's own drafts): after each, the record's drafts are the
    head's chain over the whole history, computed from scratch."""
    ref = _reference(mtp_core)
    r = load_rig(mtp_core)
    ps = r.m.pages.page_size
    prompt = [(37 * i + 11) % 4000 + 3 for i in range(150)]
    pages = r.pages(12)
    room = len(pages) * ps
    admit(r, 1, prompt, pages, seed=1)
    _, _, rec = prefill(r, 1, prompt, splits=(37, 128))  # chunks of 37, 91 and 22 tokens
    seq = prompt + [rec.token]
    for _ in range(2):
        _, recs = decode(r, [1], [seq[-1]])
        seq.append(recs[0].token)
    checked, got = 0, []
    for i, drafts in enumerate(("one right", "all wrong", "the head's")):
        if drafts == "one right":
            right = _greedy_next(ref, seq)
            drafts = [right, (_greedy_next(ref, seq + [right]) + 1) % 4000, 2]
        elif drafts == "all wrong":
            drafts = [(_greedy_next(ref, seq) + 1) % 4000, 6, 7]
        else:
            drafts = got
        tokens, got = _verify(r, 1, drafts, room)
        if i == 0:
            assert len(tokens) == 2, tokens  # the right draft, then the model's own token
        seq += tokens
        want, margins, kv = _reference_drafts(ref, seq[:-1], seq[-1], D)
        assert len(got) == D
        if _agree(got, want, margins):
            # Every row of the head's KV layer the slot's pages hold: the consuming programs'
            # (prefill chunks, decode and verify steps, rejected drafts' rows rewritten) and
            # the chain's own, equal to the definition's keys and values.
            rows = _head_rows(r, pages, kv[0].shape[0])
            for got_rows, want_rows in zip(rows, kv):  # keys, values
                torch.testing.assert_close(got_rows, want_rows, atol=1e-3, rtol=1e-3)
            checked += 1
    assert checked >= 2 and len(seq) > len(prompt) + 5


def test_the_chain_stops_where_the_slots_pages_end(mtp_core):
    """The chain writes the head's KV at its positions: a slot whose pages hold only the
    verified positions gets the drafts that fit (-1 after), never a write past its pages."""
    r = load_rig(mtp_core)
    ps = r.m.pages.page_size
    prompt = list(range(5, 5 + ps * 2 - 3))  # the pending token lands at position 2 ps - 3
    pages = r.pages(2)
    admit(r, 1, prompt, pages, seed=1)
    prefill(r, 1, prompt)
    _, got = _verify(r, 1, [], room=len(pages) * ps)
    # The pending token is consumed at 2 ps - 3, the next one lands at 2 ps - 2: the chain's
    # rows sit at 2 ps - 2 and 2 ps - 1 (inside the pages), then at 2 ps (outside): two drafts.
    assert len(got) == 2, got


def _engine_run(core, reqs, **options):
    """Requests (prompt, params) through an engine on the reference executor; returns them and
    its metrics."""
    from flare.runtime.engine import Engine
    from flare.runtime.reference import ReferenceExecutor
    from flare.runtime.request import Request

    async def go():
        engine = Engine(ReferenceExecutor(core, load_manifest(core)), **options)
        await engine.start()
        try:
            out = [Request(list(p), params, Sink()) for p, params in reqs]
            for r in out:
                engine.submit(r)
            for r in out:
                await asyncio.wait_for(r.sink.done.wait(), 300)
                assert r.error is None, r.error
            return out, engine.metrics
        finally:
            await engine.shutdown(1.0)
            assert engine.failure is None

    return asyncio.run(go())


def test_learned_drafts_are_counted_and_reach_the_context_limit(mtp_core):
    """mtp-always: every step carries the head's drafts (counted in the metrics); a request
    whose prompt and output fill the context exactly finishes with its whole output (the chain's
    pages stay within the slot's page table: a write past it is refused by the executor)."""
    m = load_manifest(mtp_core)
    limit = m.capacities.context_limit
    prompt = [(7 * k + 3) % 4000 + 5 for k in range(limit - 24)]
    reqs, metrics = _engine_run(mtp_core, [(prompt, _greedy(1, 24)), (prompt[:50], _greedy(2, 30))],
                                draft_tokens=D, learned_drafts=True, speculate_always=True)
    assert [len(r.output) for r in reqs] == [24, 30]
    assert metrics.spec_draft_tokens >= 30, metrics.spec_draft_tokens


def test_copy_drafts_on_a_core_with_the_head(mtp_core, hybrid_core):
    """--speculative copy on a core prepared with --mtp: copy drafts verified (the records'
    learned drafts left unread), greedy tokens as without speculation."""
    phrase = [(13 * k + 5) % 4000 for k in range(12)]
    reqs = [(phrase * 3, _greedy(1, 40)), ([9] + phrase * 2, _greedy(2, 30))]
    plain, _ = _engine_run(hybrid_core, reqs)
    copied, metrics = _engine_run(mtp_core, reqs, draft_tokens=D, speculate_always=True)
    assert metrics.spec_draft_tokens > 0
    assert [r.output for r in copied] == [r.output for r in plain]


def _greedy(seed: int, max_tokens: int):
    return _params(seed, max_tokens, top_k=1, repetition_penalty=1.0)


def _learned_draft_batches(vocab: int):
    """Greedy requests, several at once, then a follow-up turn that hits the prefix cache."""
    prompts = [[(13 * k + 5 + i) % vocab for k in range(30 + 7 * i)] for i in range(3)]
    return prompts, [[(p, _greedy(10 + i, 24 + 4 * i), Sink()) for i, p in enumerate(prompts)],
                     [(prompts[0] + [3, 4, 5], _greedy(20, 40), Sink())]]


@pytest.fixture(scope="module")
def plain_learned_draft_requests(mtp_core, hybrid_core):
    """The learned-draft test's requests without speculation, run once for both of its cases."""
    _, batches = _learned_draft_batches(load_manifest(mtp_core).capacities.sampling_vocab)
    return asyncio.run(_run(hybrid_core, 2, batches))[0]


@pytest.mark.parametrize("always", [True, False], ids=["mtp-always", "mtp"])
def test_greedy_requests_are_the_same_with_learned_drafts(mtp_core, plain_learned_draft_requests, always):
    """The engine with learned drafts: greedy requests (several at once, then a follow-up turn
    that hits the prefix cache) come out as the same model's without speculation. mtp-always
    verifies the head's drafts at every step; mtp (the default) under the cost model, which
    on a random head (its drafts rejected) turns to decode steps once it has measured both,
    re-measuring now and then."""
    prompts, batches = _learned_draft_batches(load_manifest(mtp_core).capacities.sampling_vocab)
    ran: list[str] = []
    plain = plain_learned_draft_requests
    learned, _ = asyncio.run(_run(mtp_core, 2, batches, ran, draft_tokens=D, learned_drafts=True,
                                  speculate_always=always))
    verify = sum(n.startswith("verify.") for n in ran)
    decode = sum(n.startswith("decode.") for n in ran)
    if always:
        assert verify and not decode, sorted(set(ran))
    else:
        assert verify and decode > 2 * verify, (verify, decode)
    for a, b in zip(sum(plain, []), sum(learned, [])):
        assert a.output == b.output and len(b.output) == b.params.max_tokens, (a.output, b.output)
    assert learned[1][0].cached_tokens >= len(prompts[0])
