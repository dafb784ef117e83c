"""Log-probabilities of generated tokens (issue 18), through the real server and the
official ``openai`` client, against Transformers FP32 on the real SmolLM2 core.

The value of a token is ``log_softmax`` of the model's raw logits for its prefix (before
temperature, penalties and filters): sampling at temperature 0.7 with penalties must not
change it. The sampled ids are read back from the tokens' ``bytes`` (a byte-level BPE
vocabulary maps bytes to one id), then one Transformers forward over prompt + output
gives every step's distribution."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import torch

from flare.core.manifest import load_manifest
from flare.server.text import TextCodec
from tests.conftest import TINY_OPTS, prepare_core, running_server
from tests.rig import transformers_model

PROMPTS = 8
TOKENS = 16  # generated per request: 128 sampled positions a test, each with its 5 alternatives
TOP = 5
TOL = 1e-3


@pytest.fixture(scope="module")
def smol(smol_core):
    m = load_manifest(smol_core)
    codec = TextCodec(str(smol_core / m.frontend.tokenizer))
    by_bytes: dict[bytes, int] = {}
    for i in range(m.capacities.sampling_vocab):
        by_bytes.setdefault(codec.token_bytes(i), i)
    return m, codec, by_bytes, transformers_model(smol_core, m, torch.float32)


def _reference(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax rows predicting each output token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].double()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(output) - 1], dim=-1)


def _check(lp: torch.Tensor, ids: list[int], chosen: list[float], tops: list[list[tuple[int, float]]]) -> float:
    worst = 0.0
    for j, (t, value, top) in enumerate(zip(ids, chosen, tops)):
        worst = max(worst, abs(value - lp[j, t].item()))
        ref_top = lp[j].topk(len(top))
        # The alternatives are the reference's top ids in order (values may tie within rounding).
        got_ids = [i for i, _ in top]
        assert got_ids == ref_top.indices.tolist() or np.allclose(
            [v for _, v in top], ref_top.values.tolist(), atol=TOL), (j, got_ids, ref_top.indices.tolist())
        worst = max(worst, max(abs(v - lp[j, i].item()) for i, v in top))
    return worst


def _concurrently(fn, items) -> float:
    """``fn(i, item)`` for every item, four at a time (the server batches them: decode
    capacity 4); the largest of the errors returned."""
    with ThreadPoolExecutor(4) as pool:
        return max(pool.map(fn, range(len(items)), items))


def _prompts(codec) -> list[list[int]]:
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
             "The three primary colours are", "To make a cup of tea, first", "import numpy as np\nx =",
             "Water boils at", "The best way to learn a language is"]
    return [codec.encode(t, add_special_tokens=True) for t in texts[:PROMPTS]]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs_match_transformers(smol_server, smol, stream):
    m, codec, by_bytes, model = smol
    client = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="x")

    def one(i: int, prompt: list[int]) -> float:
        worst = 0.0
        kw = dict(model=m.frontend.served_name, prompt=prompt, max_tokens=TOKENS, logprobs=TOP, seed=i, temperature=0.7,
                  extra_body={"repetition_penalty": 1.3, "ignore_eos": True})
        tokens, chosen, tops = [], [], []
        if stream:
            text = ""
            for chunk in client.completions.create(stream=True, **kw):
                c = chunk.choices[0]
                text += c.text
                if c.logprobs is not None:
                    tokens += c.logprobs.tokens
                    chosen += c.logprobs.token_logprobs
                    tops += c.logprobs.top_logprobs
        else:
            c = client.completions.create(**kw).choices[0]
            text, tokens, chosen, tops = c.text, c.logprobs.tokens, c.logprobs.token_logprobs, c.logprobs.top_logprobs
            offsets = c.logprobs.text_offset
            assert offsets == list(np.cumsum([0] + [len(t) for t in tokens[:-1]]))
        assert len(tokens) == len(chosen) == len(tops) == TOKENS
        assert "".join(tokens) == text
        ids = [by_bytes[t.encode()] if "\ufffd" not in t else None for t in tokens]
        # Tokens that split a character read as U+FFFD: take their id from the alternatives.
        for j, t in enumerate(ids):
            if t is None:
                ids[j] = next(by_bytes[k.encode()] for k, v in tops[j].items() if v == chosen[j])
        lp = _reference(model, prompt, ids)
        alt = []
        for j, top in enumerate(tops):
            assert len(top) in (TOP, TOP + 1)  # the sampled token is added when not among the top
            ranked = sorted(top.items(), key=lambda kv: -kv[1])
            alt.append([(by_bytes[k.encode()], v) for k, v in ranked if "\ufffd" not in k][:TOP])
        for j in range(len(ids)):
            worst = max(worst, abs(chosen[j] - lp[j, ids[j]].item()))
            for k, v in alt[j]:
                worst = max(worst, abs(v - lp[j, k].item()))
        return worst

    worst = _concurrently(one, _prompts(codec))
    assert worst < TOL, worst


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_match_transformers_with_the_openai_client(smol_server, smol, stream):
    """``choices[0].logprobs.content[i].top_logprobs`` as the client types it; the prompt
    ids are the server's own rendering (a completions call of the same text would differ),
    so each prompt is the chat turn rendered by the core's template here."""
    from flare.server.template import ChatTemplate

    m, codec, by_bytes, model = smol
    core = smol_server.core
    template = ChatTemplate((core / m.frontend.chat_template).read_text(), dict(m.frontend.special_tokens))
    client = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="x")
    questions = ["What is the capital of France?", "Name three fruits.", "How do birds fly?", "What is 2 + 2?",
                 "Write a haiku about rain.", "Why is the sky blue?", "What is Python?", "Say hello in Spanish."]

    def one(i: int, q: str) -> float:
        messages = [{"role": "user", "content": q}]
        prompt = codec.encode(template.render(messages, add_generation_prompt=True), add_special_tokens=False)
        kw = dict(model=m.frontend.served_name, messages=messages, max_tokens=TOKENS, logprobs=True, top_logprobs=TOP,
                  seed=i, temperature=0.7, extra_body={"ignore_eos": True})
        if stream:
            content = []
            for chunk in client.chat.completions.create(stream=True, **kw):
                if chunk.choices and chunk.choices[0].logprobs is not None:
                    content += chunk.choices[0].logprobs.content
        else:
            resp = client.chat.completions.create(**kw)
            assert resp.usage.prompt_tokens == len(prompt)
            content = resp.choices[0].logprobs.content
        assert len(content) == TOKENS
        ids = [by_bytes[bytes(e.bytes)] for e in content]
        lp = _reference(model, prompt, ids)
        tops = [[(by_bytes[bytes(a.bytes)], a.logprob) for a in e.top_logprobs] for e in content]
        assert all(len(t) == TOP for t in tops)
        return _check(lp, ids, [e.logprob for e in content], tops)

    worst = _concurrently(one, questions[:PROMPTS])
    assert worst < TOL, worst


def test_logprobs_on_a_core_prepared_without_them_are_a_typed_400():
    core = prepare_core("llama-tiny", [*TINY_OPTS, "--max-logprobs", "0"], name="llama-tiny-no-logprobs")
    assert load_manifest(core).capacities.max_logprobs == 0
    with running_server(core) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        for call in (lambda: client.completions.create(model="llama-tiny-no-logprobs", prompt="x", max_tokens=2,
                                                       logprobs=1),
                     lambda: client.chat.completions.create(model="llama-tiny-no-logprobs", max_tokens=2,
                                                            messages=[{"role": "user", "content": "x"}],
                                                            logprobs=True)):
            with pytest.raises(openai.BadRequestError) as e:
                call()
            assert e.value.body["code"] == "logprobs_unavailable" and e.value.body["param"] == "logprobs"
        ok = client.completions.create(model="llama-tiny-no-logprobs", prompt="x", max_tokens=2)
        assert ok.choices[0].logprobs is None


ECHO_LENGTHS = [20, 57, 128, 200, 257, 384, 512, 600]  # across score chunks (128 here) and their edges


def _long_ids(codec) -> list[int]:
    text = " ".join(["The committee met on Tuesday to review the budget, the schedule and the open questions.",
                     "def area(r):\n    return 3.14159 * r * r  # circles only",
                     "Rain fell over the valley while the river rose slowly through the night.",
                     "Les chercheurs ont publié leurs résultats après trois ans de travail."] * 12)
    return codec.encode(text, add_special_tokens=True)


@pytest.fixture(scope="module")
def echo_reference(smol) -> torch.Tensor:
    """Transformers' log_softmax rows over the longest echo prompt, once for both variants: the
    prompts are its prefixes, and a causal model's row j depends on tokens 0..j only, so row
    j of this forward is the prefix's own (to float32 summation order: measured 7e-5 apart, 7 %
    of TOL). Eight forwards per variant were ~6 s of the test's reference work on CI."""
    m, codec, by_bytes, model = smol
    ids = _long_ids(codec)
    assert len(ids) >= max(ECHO_LENGTHS)
    return _reference(model, ids[:1], ids[1 : max(ECHO_LENGTHS)])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_echo_scores_prompts_like_transformers(smol_server, smol, echo_reference, stream):
    """``echo`` with ``logprobs`` and ``max_tokens: 0``: every prompt token's value (the
    first ``null``) and top alternatives against Transformers FP32, prompts of 20-600
    tokens, several score chunks each, nothing generated."""
    m, codec, by_bytes, model = smol
    ids = _long_ids(codec)
    client = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="x")
    worst = 0.0
    for n in ECHO_LENGTHS:
        prompt = ids[:n]
        kw = dict(model=m.frontend.served_name, prompt=prompt, max_tokens=0, echo=True, logprobs=TOP)
        if stream:
            text, tokens, chosen, tops, finish = "", [], [], [], None
            for chunk in client.completions.create(stream=True, **kw):
                c = chunk.choices[0]
                text += c.text
                finish = c.finish_reason or finish
                if c.logprobs is not None:
                    tokens += c.logprobs.tokens
                    chosen += c.logprobs.token_logprobs
                    tops += c.logprobs.top_logprobs
        else:
            resp = client.completions.create(**kw)
            c = resp.choices[0]
            text, tokens, chosen, tops, finish = (c.text, c.logprobs.tokens, c.logprobs.token_logprobs,
                                                  c.logprobs.top_logprobs, c.finish_reason)
            assert resp.usage.completion_tokens == 0 and resp.usage.prompt_tokens == n
        assert text == codec.decode(prompt) and finish == "length"
        assert len(tokens) == len(chosen) == len(tops) == n
        assert chosen[0] is None and tops[0] is None
        lp = echo_reference[: n - 1]
        for j in range(1, n):
            worst = max(worst, abs(chosen[j] - lp[j - 1, prompt[j]].item()))
            ranked = sorted(tops[j].items(), key=lambda kv: -kv[1])[:TOP]
            ref = lp[j - 1].topk(TOP)
            worst = max(worst, max(abs(a - b) for (_, a), b in zip(ranked, ref.values.tolist())))
    assert worst < TOL, worst


@pytest.mark.parametrize("max_tokens", [1, 0], ids=["harness-body", "score-only"])
def test_loglikelihood_request_as_lm_evaluation_harness_sends_it(smol_server, smol, max_tokens):
    """lm-evaluation-harness's ``local-completions`` loglikelihood body: token prompts
    (context + continuation, a batch of them), ``echo``, ``logprobs=1``, ``max_tokens=1``,
    ``temperature=0`` (a scoring request: greedy), read as the harness reads it:
    ``token_logprobs[ctxlen:-1]`` summed (the one generated token dropped), greedy when
    each value is the largest of its ``top_logprobs``. ``max_tokens=0`` scores only."""
    m, codec, by_bytes, model = smol
    pairs = [("Question: What is the capital of France?\nAnswer:", " Paris"),
             ("Question: What is the capital of France?\nAnswer:", " a cheese omelette with herbs"),
             ("The quick brown fox jumps over the lazy", " dog"),
             ("1, 2, 3, 4, 5,", " 6, 7")]
    prompts, ctxlens = [], []
    for ctx, cont in pairs:
        a, b = codec.encode(ctx, add_special_tokens=True), codec.encode(cont, add_special_tokens=False)
        prompts.append(a + b)
        ctxlens.append(len(a))
    body = {"model": m.frontend.served_name, "prompt": prompts, "temperature": 0, "max_tokens": max_tokens,
            "logprobs": 1, "seed": 1234, "echo": True}
    import httpx

    out = httpx.post(smol_server.url + "/v1/completions", json=body, timeout=120).json()
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert len(choices) == len(pairs)
    for choice, prompt, ctxlen in zip(choices, prompts, ctxlens):
        assert len(choice["logprobs"]["tokens"]) == len(prompt) + max_tokens
        end = len(prompt)  # the harness's [ctxlen:-1] when it generated one token
        values = choice["logprobs"]["token_logprobs"][ctxlen:end]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:end]
        greedy = all(v == max(t.values()) for v, t in zip(values, tops))
        lp = _reference(model, prompt[:ctxlen], prompt[ctxlen:])
        ref = [lp[j, t].item() for j, t in enumerate(prompt[ctxlen:])]
        assert abs(sum(values) - sum(ref)) < TOL * len(ref)
        assert greedy == all(lp[j].argmax().item() == t for j, t in enumerate(prompt[ctxlen:]))
        if max_tokens:  # greedy: the generated token is the most likely one after the prompt
            ref_next = _reference(model, prompt, [0])[0]
            assert choice["logprobs"]["token_logprobs"][-1] == pytest.approx(ref_next.max().item(), abs=TOL)
    assert choices[0]["logprobs"]["token_logprobs"][ctxlens[0]] > choices[1]["logprobs"]["token_logprobs"][ctxlens[1]]


def test_echo_of_text_prompts_then_generation(smol_server, smol):
    """Two text prompts, two choices each, echo with logprobs and 6 generated tokens: each
    choice's text is its prompt then its output, every token's text_offset points at its
    text there, the prompt's entries come first (the first null) and the generated ones
    follow with the sampled token's value among its alternatives."""
    m, codec, by_bytes, model = smol
    prompts = ["Café menu: crème brûlée, 日本茶 and tea.", "def add(a, b):\n    return"]
    out = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="x").completions.create(
        model=m.frontend.served_name, prompt=prompts, n=2, max_tokens=6, echo=True, logprobs=2, seed=5,
        extra_body={"ignore_eos": True})
    assert len(out.choices) == 4
    for c in out.choices:
        prompt = prompts[c.index // 2]
        ids = codec.encode(prompt, add_special_tokens=True)
        lp = c.logprobs
        assert c.text.startswith(prompt) and len(lp.tokens) == len(ids) + 6
        assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[len(ids)] == len(prompt)
        for tok, off in zip(lp.tokens, lp.text_offset):
            if "\ufffd" not in tok:
                assert c.text[off : off + len(tok)] == tok, (tok, off, c.text)
        ref = _reference(model, ids[:1], ids[1:])
        assert max(abs(lp.token_logprobs[j] - ref[j - 1, ids[j]].item()) for j in range(1, len(ids))) < TOL


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_responses_include_output_text_logprobs(smol_server, smol, stream):
    """Responses with ``include: ["message.output_text.logprobs"]`` and ``top_logprobs``:
    the answer's output_text carries one entry per token it holds, with Transformers'
    values; streamed, the deltas carry them and the done event repeats them all."""
    from flare.server.template import ChatTemplate

    m, codec, by_bytes, model = smol
    template = ChatTemplate((smol_server.core / m.frontend.chat_template).read_text(),
                            dict(m.frontend.special_tokens))
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt = codec.encode(template.render(messages, add_generation_prompt=True), add_special_tokens=False)
    client = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="x")
    kw = dict(model=m.frontend.served_name, input="Name a colour.", max_output_tokens=12, top_logprobs=3,
              include=["message.output_text.logprobs"], extra_body={"seed": 4})
    if stream:
        deltas, done, text = [], None, ""
        for e in client.responses.create(stream=True, **kw):
            if e.type == "response.output_text.delta":
                deltas += e.logprobs
                text += e.delta
            elif e.type == "response.output_text.done":
                done = e.logprobs
        entries = deltas
        assert [x.token for x in done] == [x.token for x in deltas]
    else:
        resp = client.responses.create(**kw)
        part = resp.output[-1].content[0]
        entries, text = part.logprobs, part.text
    assert entries and b"".join(bytes(x.bytes) for x in entries).decode() == text
    ids = [by_bytes[bytes(x.bytes)] for x in entries]
    lp = _reference(model, prompt, ids)
    tops = [[(by_bytes[bytes(a.bytes)], a.logprob) for a in x.top_logprobs] for x in entries]
    assert all(len(t) == 3 for t in tops)
    assert _check(lp, ids, [x.logprob for x in entries], tops) < TOL


def test_scored_prompts_publish_checkpoints_and_take_no_hit(smol_server, smol):
    """A scored prompt (echo, logprobs, max_tokens 0) leaves its checkpoint behind: a later
    ordinary request that extends it restores all of it; scoring the same prompt again takes
    no hit (its first tokens would go unscored) and gives the same values bitwise."""
    import httpx

    m, codec, by_bytes, model = smol
    prompt = _long_ids(codec)[:200]
    url = smol_server.url + "/v1/completions"
    score = {"model": m.frontend.served_name, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2}
    first = httpx.post(url, json=score, timeout=120).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    extend = {"model": m.frontend.served_name, "prompt": prompt + [13, 14, 15], "max_tokens": 2}
    hit = httpx.post(url, json=extend, timeout=120).json()
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)
    again = httpx.post(url, json=score, timeout=120).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]
