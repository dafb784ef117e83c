"""Request lifecycle at the edges: a full admission queue, API keys, request ids,
metrics exposition, and SIGTERM while streams are running."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.conftest import running_server, scrape_metrics

MODEL = "llama-tiny"


def _chat(n: int, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": n, "ignore_eos": True,
            **extra}


def test_full_admission_queue_answers_503(tiny_core):
    # 8 slots (decode capacity 8) + a queue of 2: of 14 long requests arriving together (75
    # tokens each: a second or more of decoding on the CPU, against milliseconds for the 14 to
    # arrive) at most 10 can be accepted; the rest must get 503 queue_full, the others finish.
    with running_server(tiny_core, "--max-waiting", "2") as srv:
        results = [None] * 14

        def one(i):
            r = httpx.post(srv.url + "/v1/chat/completions", json=_chat(75, seed=i), timeout=300)
            results[i] = (r.status_code, r.json())

        threads = [threading.Thread(target=one, args=(i,)) for i in range(14)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rejected = [b for s, b in results if s == 503]
        accepted = [b for s, b in results if s == 200]
        assert len(rejected) >= 4 and len(rejected) + len(accepted) == 14, [s for s, _ in results]
        assert all(b["error"]["code"] == "queue_full" and b["error"]["type"] == "server_error" for b in rejected)
        assert all(b["usage"]["completion_tokens"] == 75 for b in accepted)


def test_api_key_and_request_ids(tiny_core):
    with running_server(tiny_core, "--api-key", "sekrit") as srv:
        url = srv.url + "/v1/chat/completions"
        r = httpx.post(url, json=_chat(2))
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(url, json=_chat(2), headers={"authorization": "Bearer wrong"}).status_code == 401
        ok = httpx.post(url, json=_chat(2), headers={"authorization": "Bearer sekrit"}, timeout=60)
        assert ok.status_code == 200 and ok.headers["x-request-id"] == ok.json()["id"]
        anthropic_style = httpx.get(srv.url + "/v1/models", headers={"x-api-key": "sekrit"})
        assert anthropic_style.status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200  # health stays open
        bad = httpx.post(url, json={**_chat(2), "max_tokens": 0}, headers={"authorization": "Bearer sekrit"})
        assert bad.status_code == 400 and bad.headers["x-request-id"].startswith("chatcmpl-")
        assert bad.headers["x-request-id"] in srv.output()  # failure logs carry the id
        line = next(ln for ln in srv.output().splitlines() if bad.headers["x-request-id"] in ln)
        assert "stage=frontend" in line and "code=invalid_request" in line and "Z request=" in line


def test_metrics_exposition(tiny_core):
    with running_server(tiny_core) as srv:
        for i in range(3):
            assert httpx.post(srv.url + "/v1/chat/completions", json=_chat(6, seed=i), timeout=60).status_code == 200
        httpx.post(srv.url + "/v1/chat/completions", json={**_chat(6), "model": "nope"})
        text = httpx.get(srv.url + "/metrics").text
        values = scrape_metrics(srv.url)
    assert "# TYPE flare_time_to_first_token_seconds histogram" in text
    assert "# TYPE flare_generation_tokens_total counter" in text
    assert values["flare_generation_tokens_total"] == 18
    assert values["flare_time_to_first_token_seconds_count"] == 3
    assert values["flare_inter_token_latency_seconds_count"] == 15
    assert values['flare_request_errors_total{code="model_not_found"}'] == 1
    assert values["flare_prompt_tokens_total"] > 0
    # Two decode steps in flight by default: some of the 15 decode steps ran ahead.
    assert values["flare_engine_steps_in_flight_max"] == 2 and values["flare_engine_steps_ahead_total"] > 0
    assert values["flare_engine_host_gaps_total"] >= 0 and values["flare_engine_host_gap_seconds_total"] >= 0
    # One request at a time (the refused one included): each left Engine.arriving when it was
    # submitted, so the idle engine never held a step for another on its way.
    assert values["flare_engine_admission_waits_total"] == 0
    assert values["flare_engine_admission_wait_seconds_total"] == 0
    total = values["flare_kv_pages_total"]
    assert values["flare_kv_pages_free"] + values["flare_kv_pages_used"] + values["flare_kv_pages_cached"] == total


def test_sigterm_during_streams_drains_and_exits_zero(tiny_core):
    grace = 3.0
    with running_server(tiny_core, "--shutdown-grace", str(grace)) as srv:
        events: list[list[str]] = [[] for _ in range(3)]

        def stream(i):
            with httpx.stream("POST", srv.url + "/v1/chat/completions",
                              json=_chat(900, seed=i, stream=True), timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events[i].append(line[6:])

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        while not all(len(e) > 3 for e in events):
            time.sleep(0.05)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:  # listeners are closed (connection refused) or, if still accepting, admission is
            refused = httpx.post(srv.url + "/v1/chat/completions", json=_chat(2), timeout=5).status_code
        except httpx.ConnectError:
            refused = "connection refused"
        code = srv.proc.wait(timeout=grace + 15)
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(timeout=5)
    assert code == 0
    assert elapsed < grace + 10
    assert refused in (503, "connection refused")
    for e in events:
        last = json.loads(e[-1]) if e[-1] != "[DONE]" else None
        # 900 tokens cannot finish in the grace period: each stream ends with a terminal
        # error event (no [DONE]) telling the client why.
        assert last is not None and last["error"]["code"] == "server_shutdown", e[-3:]
        assert "[DONE]" not in e


def test_startup_failure_binds_no_socket(tiny_core, tmp_path):
    """A core that cannot be loaded fails before the socket is bound: the process exits
    non-zero, says why, and nothing ever listened on the port."""
    import shutil
    import socket
    import subprocess
    import sys

    bad = tmp_path / "core"
    shutil.copytree(tiny_core, bad)
    raw = json.loads((bad / "manifest.json").read_text())
    raw["abi"] += 1
    (bad / "manifest.json").write_text(json.dumps(raw))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "flare.server.cli", str(bad), "--port", str(port)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert "abi_mismatch" in proc.stderr and "Uvicorn running" not in proc.stderr
    with socket.socket() as s:  # the port is still free: nobody bound it
        s.bind(("127.0.0.1", port))
