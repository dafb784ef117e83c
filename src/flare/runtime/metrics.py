"""Counters and histograms, rendered in the Prometheus text format.

Owned by the engine; the scheduler reports request events through
``ServingMetrics`` hooks. No global registry: one instance per engine.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

# Latency buckets in seconds (time to first token, inter-token latency).
ACCEPTED_BUCKETS = tuple(float(n) for n in range(17))  # accepted drafts per verified row (at most 16)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str) -> list[str]:
        lines, cumulative = [], 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.sum:.6f}")
        lines.append(f"{name}_count {self.count}")
        return lines


class ServingMetrics:
    def __init__(self):
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_finished: dict[str, int] = defaultdict(int)
        self.request_errors: dict[str, int] = defaultdict(int)
        self.ttft = Histogram()
        self.itl = Histogram()
        # Speculative decoding: drafts verified, drafts accepted, accepted drafts per verified row.
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_accepted = Histogram(ACCEPTED_BUCKETS)

    # -- hooks (scheduler and server) -----------------------------------------------

    def on_admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens += prompt_tokens

    def on_token(self, arrival: float, first_at: float | None, last_at: float | None, now: float) -> None:
        self.generation_tokens += 1
        if first_at is None:
            self.ttft.observe(now - arrival)
        elif last_at is not None:
            self.itl.observe(now - last_at)

    def on_verified(self, drafted: int, accepted: int) -> None:
        self.spec_draft_tokens += drafted
        self.spec_accepted_tokens += accepted
        self.spec_accepted.observe(accepted)

    def on_finished(self, reason: str) -> None:
        self.requests_finished[reason] += 1

    def on_error(self, code: str) -> None:
        self.request_errors[code] += 1

    # -- exposition -------------------------------------------------------------------

    def render(self, gauges: dict[str, float]) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, lines: list[str]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(lines)

        for name, value in gauges.items():
            metric(name, "gauge", name.removeprefix("flare_").replace("_", " "), [f"{name} {value}"])
        metric("flare_prompt_tokens_total", "counter", "prompt tokens of admitted requests",
               [f"flare_prompt_tokens_total {self.prompt_tokens}"])
        metric("flare_generation_tokens_total", "counter", "sampled output tokens",
               [f"flare_generation_tokens_total {self.generation_tokens}"])
        metric("flare_requests_finished_total", "counter", "finished requests by reason",
               [f'flare_requests_finished_total{{reason="{k}"}} {v}' for k, v in sorted(self.requests_finished.items())])
        metric("flare_request_errors_total", "counter", "failed requests by error code",
               [f'flare_request_errors_total{{code="{k}"}} {v}' for k, v in sorted(self.request_errors.items())])
        metric("flare_time_to_first_token_seconds", "histogram", "time from arrival to the first output token",
               self.ttft.render("flare_time_to_first_token_seconds"))
        metric("flare_inter_token_latency_seconds", "histogram", "time between output tokens of a request",
               self.itl.render("flare_inter_token_latency_seconds"))
        metric("flare_spec_draft_tokens_total", "counter", "draft tokens verified (speculative decoding)",
               [f"flare_spec_draft_tokens_total {self.spec_draft_tokens}"])
        metric("flare_spec_accepted_tokens_total", "counter", "draft tokens accepted",
               [f"flare_spec_accepted_tokens_total {self.spec_accepted_tokens}"])
        metric("flare_spec_accepted_length", "histogram", "accepted drafts per verified request row",
               self.spec_accepted.render("flare_spec_accepted_length"))
        return "\n".join(out) + "\n"
