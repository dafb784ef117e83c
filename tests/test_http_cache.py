"""The prefix cache over HTTP: the ten-turn agent conversation replayed through
the official ``openai`` client against the SmolLM2 and the hybrid servers,
``usage.prompt_tokens_details.cached_tokens`` on every response kind, the
cache metrics, and ``--no-prefix-cache``.

Each turn asks for one token (``max_tokens=1``): its terminal endpoint is then
its prompt endpoint, so the oracle (``agent_conversation``) knows every
published endpoint from the prompts alone. Generation beyond the prompt, and
terminal checkpoints that differ from the prompt, are covered on the reference
executor with token ids in hand (``test_conversation_cache``)."""

from __future__ import annotations

import openai
import pytest

from flare.core.manifest import load_manifest
from flare.server.template import ChatTemplate
from flare.server.text import TextCodec
from tests.agent_conversation import (TURNS, complete_messages_length, deepest_published,
                                      oracle_message_endpoints, turn_messages)
from tests.conftest import running_server
from tests.conftest import scrape_metrics as metrics


def frontend(core):
    m = load_manifest(core)
    return (ChatTemplate((core / m.frontend.chat_template).read_text(), dict(m.frontend.special_tokens)),
            TextCodec(str(core / m.frontend.tokenizer)), m.frontend.served_name)


def _chat(client, model, messages, seed, stream):
    if not stream:
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=1, seed=seed)
        return r.usage
    usage = None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=1, seed=seed,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
    return usage


@pytest.mark.parametrize("server,core", [("smol_server", "smol_core"), ("hybrid_server", "hybrid_core")])
def test_agent_conversation_replay(request, server, core):
    srv, core = request.getfixturevalue(server), request.getfixturevalue(core)
    template, codec, model = frontend(core)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120)
    published: set[tuple[int, ...]] = set()
    report = []
    for i in range(1, TURNS + 1):
        messages = turn_messages(i)
        prompt = codec.encode(template.render(messages, add_generation_prompt=True), add_special_tokens=False)
        before = metrics(srv.url)
        usage = _chat(client, model, messages, seed=i, stream=i % 2 == 0)
        after = metrics(srv.url)
        cached = usage.prompt_tokens_details.cached_tokens
        report.append((i, usage.prompt_tokens, cached))
        assert usage.prompt_tokens == len(prompt)
        assert cached == deepest_published(published, prompt), report
        if i > 1:
            assert cached >= complete_messages_length(template, codec, turn_messages(i - 1)), report
        # Prefill work, from the server's own counter: prompt tokens minus cached tokens.
        assert after["flare_prefill_tokens_total"] - before["flare_prefill_tokens_total"] == len(prompt) - cached
        assert after["flare_prefix_cache_hit_tokens_total"] - before["flare_prefix_cache_hit_tokens_total"] == cached
        for e in oracle_message_endpoints(template, codec, messages, prompt):
            published.add(tuple(prompt[:e]))
        published.add(tuple(prompt))  # prompt endpoint = terminal endpoint (one output token)
    print(f"\n{server} (turn, prompt_tokens, cached_tokens):", report)
    assert all(c > 0 for _, _, c in report[1:])
    m = metrics(srv.url)
    assert m["flare_prefix_cache_enabled"] == 1 and m["flare_prefix_cache_checkpoints"] >= len(published)
    assert m["flare_kv_pages_free"] + m["flare_kv_pages_used"] + m["flare_kv_pages_cached"] == m["flare_kv_pages_total"]
    assert m["flare_kv_pages_cached"] > 0 and m["flare_kv_pages_used"] == 0  # idle: only the cache holds pages
    for name in ("flare_prefix_cache_page_evictions_total", "flare_prefix_cache_snapshot_evictions_total",
                 "flare_prefix_cache_thinned_total", "flare_prefix_cache_captures_skipped_total",
                 "flare_prefix_cache_snapshot_rows_free", "flare_prefix_cache_snapshot_rows_total"):
        assert name in m


def test_completions_report_cached_tokens(smol_server, smol_core):
    """Text completions carry no message endpoints, but the prompt endpoint is captured:
    the same prompt again is a full-prompt hit, streaming or not."""
    client = openai.OpenAI(base_url=smol_server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    prompt = "A short list of rivers in France: the Loire, the Seine,"
    first = client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=3, seed=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    before = metrics(smol_server.url)
    again = client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=3, seed=1)
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens
    assert again.choices[0].text == first.choices[0].text  # resume sampled what prefill sampled
    after = metrics(smol_server.url)
    assert after["flare_prefill_tokens_total"] == before["flare_prefill_tokens_total"]
    usage = None
    for chunk in client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=3, seed=1,
                                           stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
    assert usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens


def test_messages_stream_reports_cached_input_at_message_start(smol_server):
    """Anthropic's message_start is sent once the request is admitted: its usage already
    splits the cached input from the new, as the final usage does."""
    import anthropic

    claude = anthropic.Anthropic(base_url=smol_server.url, api_key="x", max_retries=0, timeout=120)
    kw = dict(model="smollm2-135m-instruct", max_tokens=3, extra_body={"seed": 4},
              messages=[{"role": "user", "content": "Name three rivers of France, one per line."}])
    first = claude.messages.create(**kw)
    assert first.usage.cache_read_input_tokens == 0
    with claude.messages.stream(**kw) as s:
        start = next(e for e in s if e.type == "message_start").message.usage
        final = s.get_final_message().usage
    assert start.cache_read_input_tokens > 0 and start.output_tokens == 0, (start, final)
    assert (start.input_tokens, start.cache_read_input_tokens) == (final.input_tokens, final.cache_read_input_tokens)
    assert start.input_tokens + start.cache_read_input_tokens == first.usage.input_tokens


def test_no_prefix_cache_flag(tiny_core):
    with running_server(tiny_core, "--no-prefix-cache") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        for _ in range(2):
            r = client.chat.completions.create(model="llama-tiny", messages=turn_messages(1), max_tokens=2, seed=3)
            assert r.usage.prompt_tokens_details.cached_tokens == 0
        m = metrics(srv.url)
        assert m["flare_prefix_cache_enabled"] == 0 and m["flare_prefix_cache_checkpoints"] == 0
        assert m["flare_prefill_tokens_total"] == 2 * r.usage.prompt_tokens
        assert m["flare_kv_pages_cached"] == 0
