"""Prometheus metrics of the serving layer: vLLM's speculative-decoding names under `viasd_`.

Counters follow vLLM (`vllm:spec_decode_num_drafts` -> `viasd_spec_decode_num_drafts_total`,
..., `..._num_accepted_tokens_per_pos_total{position="j"}`), plus the VIA-SD tier counters
(q' accepted / rewritten, escalations to q), per-model forward passes, TTFT and inter-token
latency histograms, the queue depth and requests by finish reason. Every series carries the
pipeline's name as `model`; spec-decode and tier series also carry the request's `mode`.

Vocabulary as in `viasd.metrics`: "mean acceptance length includes the bonus token", i.e.
1 + accepted / drafts when every cycle ends with one rewritten, recovered or bonus token.

Two sinks, one recorder (`ServingMetrics`):

* `PrometheusSink` — a `prometheus_client` registry per replica, served as text by the HTTP
  ingress at `/metrics` (what a test or a single-replica deployment scrapes);
* `RaySink` — the same series through `ray.util.metrics`, which Ray exports cluster-wide on
  each node's metrics port (what Prometheus scrapes under KubeRay; Ray prefixes `ray_`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from viasd.metrics import MODELS, RequestStats

# seconds; TTFT on CPU runs to seconds, on GPU to milliseconds
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


@dataclass(frozen=True)
class Spec:
    """One metric: its name without the `viasd_` prefix, kind, help text and label names."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    doc: str
    labels: tuple[str, ...] = ("model",)
    buckets: tuple[float, ...] = ()


_SPEC = ("model", "mode")
SPECS = (
    # vLLM's speculative-decoding counters
    Spec("spec_decode_num_drafts", "counter", "Draft blocks proposed (one per speculative cycle).", _SPEC),
    Spec("spec_decode_num_draft_tokens", "counter", "Draft tokens proposed by the drafter p.", _SPEC),
    Spec("spec_decode_num_accepted_tokens", "counter", "Draft tokens committed as drafted (by q' or q).", _SPEC),
    Spec(
        "spec_decode_num_accepted_tokens_per_pos", "counter",
        "Draft tokens accepted at block position `position` (0-based).", (*_SPEC, "position"),
    ),
    Spec("spec_decode_num_rejected_tokens", "counter", "Draft tokens replaced (rewritten by q' or rejected by q).", _SPEC),
    Spec("spec_decode_num_bonus_tokens", "counter", "Bonus tokens after fully accepted blocks.", _SPEC),
    # VIA-SD tiers
    Spec("slim_accepted_tokens", "counter", "Draft tokens accepted by the slim verifier q' (region A).", _SPEC),
    Spec("slim_rewritten_tokens", "counter", "Region-B rewrites by the slim verifier q'.", _SPEC),
    Spec("escalations", "counter", "Blocks escalated to the full verifier q.", _SPEC),
    Spec("escalated_tokens", "counter", "Draft positions the full verifier q decided.", _SPEC),
    Spec("full_accepted_tokens", "counter", "Escalated draft tokens the full verifier q accepted.", _SPEC),
    Spec("forward_passes", "counter", "Forward passes per tier (drafter, slim, full).", ("model", "tier")),
    Spec("forward_seconds", "counter", "Seconds spent in forward passes per tier.", ("model", "tier")),
    # requests and tokens
    Spec("prompt_tokens", "counter", "Prompt tokens of finished requests.", ("model",)),
    Spec("generation_tokens", "counter", "Generated tokens of finished requests.", ("model",)),
    Spec("request_success", "counter", "Finished requests by finish reason (stop, length, abort).",
         ("model", "finished_reason")),
    Spec("request_errors", "counter", "Requests that ended with an error, by status (invalid, rejected, internal).",
         ("model", "status")),
    Spec("time_to_first_token_seconds", "histogram", "Arrival to first generated token (queue time included).",
         ("model",), TTFT_BUCKETS),
    Spec("inter_token_latency_seconds", "histogram",
         "Time between generated tokens after the first chunk (a chunk of n tokens after a gap g counts n times g/n).",
         ("model",), ITL_BUCKETS),
    Spec("e2e_request_latency_seconds", "histogram", "Arrival to last token.", ("model",), E2E_BUCKETS),
    Spec("request_queue_time_seconds", "histogram",
         "Arrival to a decoding slot (admission: limits.max_concurrent_requests is the batch capacity).",
         ("model",), TTFT_BUCKETS),
    Spec("num_requests_running", "gauge", "Requests decoding in this replica.", ("model",)),
    Spec("num_requests_waiting", "gauge", "Requests queued in this replica for a decoding slot.", ("model",)),
)
PREFIX = "viasd_"


class PrometheusSink:
    """The metrics in a private `prometheus_client` registry (one per replica)."""

    def __init__(self):
        import prometheus_client as prom

        prom.disable_created_metrics()  # no `_created` twin of every counter (as vLLM does)
        self._prom = prom
        self.registry = prom.CollectorRegistry(auto_describe=True)
        kinds = {"counter": prom.Counter, "gauge": prom.Gauge, "histogram": prom.Histogram}
        self.metrics = {}
        for s in SPECS:
            kw = {"buckets": s.buckets} if s.kind == "histogram" else {}
            self.metrics[s.name] = kinds[s.kind](PREFIX + s.name, s.doc, s.labels, registry=self.registry, **kw)

    def counter(self, name: str, value: float, labels: dict[str, str]) -> None:
        self.metrics[name].labels(**labels).inc(value)

    def gauge(self, name: str, value: float, labels: dict[str, str]) -> None:
        self.metrics[name].labels(**labels).set(value)

    def observe(self, name: str, value: float, labels: dict[str, str]) -> None:
        self.metrics[name].labels(**labels).observe(value)

    def exposition(self) -> tuple[bytes, str]:
        """Text exposition format and its content type."""
        return self._prom.generate_latest(self.registry), self._prom.CONTENT_TYPE_LATEST


class RaySink:
    """The same series through Ray's metrics agent (cluster-wide Prometheus export)."""

    def __init__(self):
        from ray.util import metrics as rm

        self.metrics = {}
        for s in SPECS:
            name = PREFIX + s.name + ("_total" if s.kind == "counter" else "")
            if s.kind == "counter":
                self.metrics[s.name] = rm.Counter(name, s.doc, tag_keys=s.labels)
            elif s.kind == "gauge":
                self.metrics[s.name] = rm.Gauge(name, s.doc, tag_keys=s.labels)
            else:
                self.metrics[s.name] = rm.Histogram(name, s.doc, boundaries=list(s.buckets), tag_keys=s.labels)

    def counter(self, name: str, value: float, labels: dict[str, str]) -> None:
        if value:
            self.metrics[name].inc(value, tags=labels)

    def gauge(self, name: str, value: float, labels: dict[str, str]) -> None:
        self.metrics[name].set(value, tags=labels)

    def observe(self, name: str, value: float, labels: dict[str, str]) -> None:
        self.metrics[name].observe(value, tags=labels)


class RequestTimer:
    """Token timing of one request: TTFT and inter-token gaps, measured from its arrival."""

    def __init__(self, metrics: "ServingMetrics"):
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.last: float | None = None

    def tokens(self, n: int) -> None:
        """n tokens were committed now."""
        if n <= 0:
            return
        now = time.perf_counter()
        if self.last is None:  # the first chunk: a TTFT, no gaps
            self.metrics._observe("time_to_first_token_seconds", now - self.arrival)
        else:
            gap = (now - self.last) / n
            for _ in range(n):
                self.metrics._observe("inter_token_latency_seconds", gap)
        self.last = now

    def finish(self, stats: RequestStats | None, finish_reason: str) -> None:
        self.metrics._observe("e2e_request_latency_seconds", time.perf_counter() - self.arrival)
        self.metrics.record_stats(stats, finish_reason)


class ServingMetrics:
    """Records requests into every sink; `exposition()` gives the replica's Prometheus text."""

    def __init__(self, model: str, *, enabled: bool = True, ray_export: bool = False):
        self.model = model
        self.enabled = enabled
        self.prometheus = PrometheusSink() if enabled else None
        self.sinks: list = [self.prometheus] if enabled else []
        if enabled and ray_export:
            self.sinks.append(RaySink())
        self._labels = {"model": model}

    def _counter(self, name: str, value: float, **labels: str) -> None:
        for sink in self.sinks:
            sink.counter(name, value, {**self._labels, **labels})

    def _observe(self, name: str, value: float) -> None:
        for sink in self.sinks:
            sink.observe(name, value, self._labels)

    def set_queue(self, running: int, waiting: int) -> None:
        for sink in self.sinks:
            sink.gauge("num_requests_running", running, self._labels)
            sink.gauge("num_requests_waiting", waiting, self._labels)

    def queue_time(self, seconds: float) -> None:
        """A request waited `seconds` for its decoding slot."""
        self._observe("request_queue_time_seconds", seconds)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def error(self, status: str) -> None:
        self._counter("request_errors", 1, status=status)

    def record_stats(self, stats: RequestStats | None, finish_reason: str) -> None:
        """Add one finished request's statistics to the counters."""
        self._counter("request_success", 1, finished_reason=finish_reason or "abort")
        if stats is None:
            return
        self._counter("prompt_tokens", stats.prompt_tokens)
        self._counter("generation_tokens", stats.generated_tokens)
        for tier in MODELS:
            self._counter("forward_passes", stats.forwards.get(tier, 0), tier=tier)
            self._counter("forward_seconds", stats.seconds.get(tier, 0.0), tier=tier)
        if stats.mode == "ar":
            return
        mode = {"mode": stats.mode}
        for name, value in (
            ("spec_decode_num_drafts", stats.num_drafts),
            ("spec_decode_num_draft_tokens", stats.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", stats.num_accepted_tokens),
            ("spec_decode_num_rejected_tokens", stats.num_rejected_tokens),
            ("spec_decode_num_bonus_tokens", stats.num_bonus_tokens),
        ):
            self._counter(name, value, **mode)
        for pos, value in enumerate(stats.num_accepted_tokens_per_pos):
            self._counter("spec_decode_num_accepted_tokens_per_pos", value, position=str(pos), **mode)
        if stats.mode == "via":
            for name, value in (
                ("slim_accepted_tokens", stats.slim_accepted),
                ("slim_rewritten_tokens", stats.slim_rewritten),
                ("escalations", stats.escalations),
                ("escalated_tokens", stats.escalated_tokens),
                ("full_accepted_tokens", stats.full_accepted),
            ):
                self._counter(name, value, **mode)

    def exposition(self) -> tuple[bytes, str]:
        if self.prometheus is None:
            return b"# metrics disabled in the serving config\n", "text/plain; version=0.0.4; charset=utf-8"
        return self.prometheus.exposition()


def parse_exposition(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of a Prometheus text exposition keyed by (name, sorted labels) (for tests and tools)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


__all__: Sequence[str] = ("SPECS", "PREFIX", "ServingMetrics", "RequestTimer", "parse_exposition", "total")
