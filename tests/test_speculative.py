"""Speculative decoding on the real engine, reference executor and model (issue 20): copy
drafts from each request's history, verified by the core's verify programs.

Greedy requests (top_k 1) must come out exactly as without speculation, whatever was
drafted and rejected, with the prefix cache, a host-side stop inside a verified chain and a
follow-up turn; sampled requests keep their lengths. The tiny random model, greedy, falls
into repetition quickly, which is what copy drafts live on: drafts are accepted.
"""

from __future__ import annotations

import asyncio

from flare.core.manifest import load_manifest
from tests.conftest import TINY_OPTS, prepare_core
from tests.test_pipeline import Sink, _params, _run


def _core():
    return prepare_core("llama-tiny", [*TINY_OPTS, "--draft-tokens", "3"], name="llama-tiny-verify")


def _greedy(seed: int, max_tokens: int):
    return _params(seed, max_tokens, top_k=1, repetition_penalty=1.0)


def test_greedy_requests_are_the_same_with_copy_drafts(tiny_core):
    core = _core()
    vocab = load_manifest(core).capacities.vocab_size
    # Prompts that repeat a phrase (a quoted tool result) and one that does not.
    phrase = [(13 * k + 5) % vocab for k in range(12)]
    prompts = [phrase * 3, [7] + phrase * 2 + [9, 9], [(31 * k + 2) % vocab for k in range(40)], phrase[:5]]

    def batches():
        return [[(p, _greedy(10 + i, 40 + 5 * i), Sink()) for i, p in enumerate(prompts)],
                [(prompts[0] + [3, 4], _greedy(20, 30), Sink())]]

    ran: list[str] = []
    plain, _ = asyncio.run(_run(tiny_core, 2, batches()))
    spec, gauges = asyncio.run(_run(core, 2, batches(), ran, draft_tokens=3))
    assert any(name.startswith("verify.") for name in ran), ran
    for a, b in zip(sum(plain, []), sum(spec, [])):
        assert a.output == b.output and len(b.output) == b.params.max_tokens, (a.output, b.output)
    assert spec[1][0].cached_tokens >= len(prompts[0])


def test_copy_drafts_are_accepted_and_counted():
    """--speculative copy-always: drafts verified and accepted, the accepted-length histogram,
    fewer steps than tokens."""
    core = _core()
    vocab = load_manifest(core).capacities.vocab_size
    phrase = [(13 * k + 5) % vocab for k in range(12)]

    async def go():
        from flare.runtime.engine import Engine
        from flare.runtime.reference import ReferenceExecutor
        from flare.runtime.request import Request

        engine = Engine(ReferenceExecutor(core, load_manifest(core)), draft_tokens=3, speculate_always=True)
        await engine.start()
        try:
            req = Request(phrase * 3, _greedy(1, 60), Sink())
            engine.submit(req)
            await asyncio.wait_for(req.sink.done.wait(), 300)
            return req, engine.metrics, engine.gauges(), engine.metrics.render(engine.gauges())
        finally:
            await engine.shutdown(1.0)

    req, metrics, gauges, text = asyncio.run(go())
    assert len(req.output) == 60
    assert metrics.spec_accepted_tokens > 0 and metrics.spec_draft_tokens >= metrics.spec_accepted_tokens
    assert gauges["flare_engine_steps_total"] < 60  # some steps emitted several tokens
    assert f"flare_spec_accepted_tokens_total {metrics.spec_accepted_tokens}" in text
    assert "flare_spec_accepted_length_bucket" in text and "flare_spec_draft_tokens_total" in text


class _StopAt(Sink):
    """Plays a stop string that the host matches on the request's (k + 1)-th token."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def on_tokens(self, request, ids):
        self.visible.extend(ids)
        return len(self.visible) > self.k


def test_a_host_stop_inside_a_verified_chain(tiny_core):
    """Stop strings (the host's) on tokens 21, 22 and 23 of a greedy request whose verify steps
    (copy-always) emit up to 4 tokens (so some stops fall before a step's last token, where the device has
    consumed more than the host keeps): each request ends there as without speculation, and a
    follow-up turn continuing its conversation, and one repeating its history, get the same
    tokens."""
    core = _core()
    vocab = load_manifest(core).capacities.vocab_size
    phrase = [(13 * k + 5) % vocab for k in range(12)]
    prompt = phrase * 3
    free, _ = asyncio.run(_run(tiny_core, 1, [[(prompt, _greedy(1, 40), Sink())]]))
    tokens = free[0][0].output

    def batches():
        out = []
        for k in (21, 22, 23):
            # follow-ups: the conversation continued, and the stopped request's own history
            # (a whole-prompt hit of its terminal checkpoint when it has one: resume samples
            # from the checkpoint's hidden vector, which must be the endpoint's)
            out += [[(prompt, _greedy(1, 40), _StopAt(k))],
                    [(prompt + tokens[: k + 1] + [2, 3], _greedy(2, 12), Sink())],
                    [(prompt + tokens[:k], _greedy(3, 6), Sink())]]
        return out

    plain, _ = asyncio.run(_run(tiny_core, 2, batches()))
    spec, _ = asyncio.run(_run(core, 2, batches(), draft_tokens=3, speculate_always=True))
    for a, b in zip(sum(plain, []), sum(spec, [])):
        assert a.output == b.output and a.finish_reason == b.finish_reason, (a.output, b.output)
    assert [len(spec[i][0].output) for i in (0, 3, 6)] == [22, 23, 24]


def test_sampled_requests_keep_their_lengths_with_copy_drafts():
    core = _core()
    vocab = load_manifest(core).capacities.vocab_size
    phrase = [(13 * k + 5) % vocab for k in range(12)]
    batches = [[(phrase * 3, _params(40 + i, 25 + 3 * i, temperature=0.3), Sink()) for i in range(3)]]
    out, _ = asyncio.run(_run(core, 2, batches, draft_tokens=3, speculate_always=True))
    for r in out[0]:
        assert len(r.output) == r.params.max_tokens and all(0 <= t < vocab for t in r.output)


def test_served_with_the_official_client_and_refused_without_verify_programs(tiny_core):
    """flare-serve speculates by default on a core with verify programs: a greedy completion
    (temperature 0) of a repetitive text streams the same text as with --speculative off, and
    /metrics counts drafts (and, verifying whenever there are drafts, accepted ones). On a
    core without verify programs --speculative copy refuses to start, as do more drafts
    than the core was prepared for and --draft-tokens without speculation."""
    import subprocess
    import sys

    import openai

    from tests.conftest import running_server, scrape_metrics

    core = _core()
    prompt = "The cat sat on the mat. The dog sat on the log. " * 4 + "The cat"

    def complete(srv) -> str:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
        stream = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=48,
                                           extra_body={"top_k": 1}, stream=True)
        return "".join(c.choices[0].text for c in stream if c.choices)

    with running_server(core) as srv:
        text = complete(srv)
        assert text
        # By default it drafted: a first verify step measures what one costs here. Whether
        # more follow is the cost model's (on this CPU a verify step costs several decode steps).
        assert scrape_metrics(srv.url)["flare_spec_draft_tokens_total"] > 0
    with running_server(core, "--speculative", "copy-always") as srv:
        assert complete(srv) == text
        metrics = scrape_metrics(srv.url)
    with running_server(core, "--speculative", "off") as srv:
        assert complete(srv) == text
        assert scrape_metrics(srv.url)["flare_spec_draft_tokens_total"] == 0
    assert metrics["flare_spec_accepted_tokens_total"] > 0, metrics
    for c, flags in ((tiny_core, ["--speculative", "copy"]), (core, ["--draft-tokens", "4"]),
                     (core, ["--speculative", "off", "--draft-tokens", "2"])):
        proc = subprocess.run([sys.executable, "-m", "flare.server.cli", str(c), "--port", "0", *flags],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "--draft-tokens" in proc.stderr, proc.stderr[-1000:]


class _LogprobSink(Sink):
    def __init__(self):
        super().__init__()
        self.blocks: list = []

    def on_tokens(self, request, ids, logprobs=None):
        self.blocks.extend(logprobs or [])
        return super().on_tokens(request, ids)


def test_a_request_with_logprobs_beside_a_drafting_one(tiny_core):
    """A verify record carries no log-probabilities: while a request that asks for them runs,
    its batch decodes plainly (the other request's drafts wait); both come out as without
    speculation, every token of the first with its block."""
    core = _core()
    vocab = load_manifest(core).capacities.vocab_size
    phrase = [(13 * k + 5) % vocab for k in range(12)]

    def batches():
        return [[(phrase * 3, _greedy(1, 30), Sink()),
                 (phrase[:7], _params(2, 20, top_k=1, repetition_penalty=1.0, logprobs=2), _LogprobSink())]]

    plain, _ = asyncio.run(_run(tiny_core, 2, batches()))
    ran: list[str] = []
    spec, _ = asyncio.run(_run(core, 2, batches(), ran, draft_tokens=3, speculate_always=True))
    for a, b in zip(plain[0], spec[0]):
        assert a.output == b.output
    assert len(spec[0][1].sink.blocks) == 20
    assert any(name.startswith("verify.") for name in ran)  # after the logprobs request finished


def test_preempted_drafting_requests_come_out_as_without_speculation(tiny_core):
    """Speculation under page pressure: three greedy requests that copy (copy-always) on a core
    whose 23 usable KV pages cannot hold their 27, so the newest decoder is preempted and
    readmitted with its history (which then holds accepted tokens only), as without
    speculation on the same core; the same tokens both ways, every page back at the end
    (``_run``'s integrity check)."""
    small = prepare_core("llama-tiny", [*TINY_OPTS, "--draft-tokens", "3", "--context-limit", "256",
                                        "--kv-pages", "24"], name="llama-tiny-verify-small")
    vocab = load_manifest(small).capacities.vocab_size
    phrase = [(13 * k + 5) % vocab for k in range(12)]
    prompts = [phrase * 3, [7] + phrase * 3, phrase[3:] * 3 + [1]]  # 36-37 tokens + 100 generated: 9 pages each

    def batches():
        return [[(p, _greedy(30 + i, 100), Sink()) for i, p in enumerate(prompts)]]

    plain, plain_gauges = asyncio.run(_run(small, 2, batches()))
    ran: list[str] = []
    spec, gauges = asyncio.run(_run(small, 2, batches(), ran, draft_tokens=3, speculate_always=True))
    assert gauges["flare_preemptions_total"] > 0 and plain_gauges["flare_preemptions_total"] > 0, gauges
    assert any(name.startswith("verify.") for name in ran), ran
    for a, b in zip(plain[0], spec[0]):
        assert a.output == b.output and len(b.output) == 100, (a.output, b.output)


class _CancelAt(Sink):
    """Cancels its request through the engine once ``k`` tokens have arrived."""

    def __init__(self, k: int):
        super().__init__()
        self.k, self.engine = k, None

    def on_tokens(self, request, ids):
        self.visible.extend(ids)
        if len(self.visible) >= self.k and self.engine is not None:
            self.engine.cancel(request)
        return False


def test_cancelling_a_drafting_request_leaves_its_neighbour_as_it_was(tiny_core):
    """Two greedy requests that copy (copy-always, verify steps carrying both); one is cancelled
    after 10 tokens, in the middle of its verified chains. It ends early with what it had
    streamed, its slot, pages and drafts are released (every page free at the end), and the
    other request's tokens are those it gets alone without speculation."""
    from flare.runtime.engine import Engine
    from flare.runtime.reference import ReferenceExecutor
    from flare.runtime.request import Request

    core = _core()
    vocab = load_manifest(core).capacities.vocab_size
    phrase = [(13 * k + 5) % vocab for k in range(12)]
    alone, _ = asyncio.run(_run(tiny_core, 2, [[(phrase * 3, _greedy(5, 60), Sink())]]))

    async def go():
        engine = Engine(ReferenceExecutor(core, load_manifest(core)), draft_tokens=3, speculate_always=True)
        await engine.start()
        try:
            victim = _CancelAt(10)
            victim.engine = engine
            reqs = [Request(phrase * 3, _greedy(5, 60), Sink(), request_id="kept"),
                    Request([7] + phrase * 3, _greedy(6, 60), victim, request_id="cancelled")]
            for r in reqs:
                engine.submit(r)
            for r in reqs:
                await asyncio.wait_for(r.sink.done.wait(), 300)
            for _ in range(200):  # the cancelled slot's in-flight step and terminal work drain
                if not engine.scheduler.running and not engine.scheduler.retiring:
                    break
                await asyncio.sleep(0.05)
            sched = engine.scheduler
            sched.check_integrity()
            free, used, cached = sched.page_usage()
            return reqs, used, engine.metrics.spec_draft_tokens
        finally:
            await engine.shutdown(1.0)

    (kept, cancelled), used, drafted = asyncio.run(go())
    assert drafted > 0
    assert kept.output == alone[0][0].output and len(kept.output) == 60
    assert 10 <= len(cancelled.output) < 60 and cancelled.output == cancelled.sink.visible
    assert used == 0
