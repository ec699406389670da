"""Prometheus metrics of the serving layer: vLLM's metric stems and labels under our own prefix `viasd_`.

Every series a vLLM dashboard reads has vLLM's stem (`vllm:num_requests_running` ->
`viasd_num_requests_running`) and its `model_name` label (the served model name), so that one
Prometheus relabel rule makes a vLLM Grafana dashboard work; ours on top: the VIA-SD tier
counters, forwards and seconds per tier, errors by status, mode `auto`'s planner, the served
executor's calls. The series, one `Spec` each in `SPECS`, are listed in docs/SERVING.md
("Metrics"). "Mean acceptance length includes the bonus token", as in `viasd.metrics`.

Two sinks, one recorder (`ServingMetrics`): `PrometheusSink`, a `prometheus_client` registry
per replica served at `/metrics`; `RaySink`, the same series through `ray.util.metrics`, which
Ray exports cluster-wide (what Prometheus scrapes under KubeRay; Ray prefixes `ray_`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import prometheus_client as prom
from prometheus_client.parser import text_string_to_metric_families
from ray.util import metrics as rm

from viasd.metrics import MODELS, RequestStats

# seconds; TTFT on CPU runs to seconds, on GPU to milliseconds
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


@dataclass(frozen=True)
class Spec:
    """One metric: its name without the `viasd_` prefix, kind, help text and label names."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    doc: str
    labels: tuple[str, ...] = ("model_name",)
    buckets: tuple[float, ...] = ()


_M = ("model_name",)
_SPEC = ("model_name", "mode")
SPECS = (
    # vLLM's speculative-decoding counters
    Spec("spec_decode_num_drafts", "counter", "Draft blocks proposed (one per speculative cycle).", _SPEC),
    Spec("spec_decode_num_draft_tokens", "counter", "Draft tokens proposed by the drafter p.", _SPEC),
    Spec("spec_decode_num_accepted_tokens", "counter", "Draft tokens committed as drafted (by q' or q).", _SPEC),
    Spec(
        "spec_decode_num_accepted_tokens_per_pos",
        "counter",
        "Draft tokens accepted at block position `position` (0-based).",
        (*_SPEC, "position"),
    ),
    Spec(
        "spec_decode_num_rejected_tokens", "counter", "Draft tokens replaced (rewritten by q' or rejected by q).", _SPEC
    ),
    Spec("spec_decode_num_bonus_tokens", "counter", "Bonus tokens after fully accepted blocks.", _SPEC),
    # VIA-SD tiers
    Spec("slim_accepted_tokens", "counter", "Draft tokens accepted by the slim verifier q' (region A).", _SPEC),
    Spec("slim_rewritten_tokens", "counter", "Region-B rewrites by the slim verifier q'.", _SPEC),
    Spec("escalations", "counter", "Blocks escalated to the full verifier q.", _SPEC),
    Spec("escalated_tokens", "counter", "Draft positions the full verifier q decided.", _SPEC),
    Spec("full_accepted_tokens", "counter", "Escalated draft tokens the full verifier q accepted.", _SPEC),
    Spec("forward_passes", "counter", "Forward passes per tier (drafter, slim, full).", ("model_name", "tier")),
    Spec("forward_seconds", "counter", "Seconds spent in forward passes per tier.", ("model_name", "tier")),
    # requests and tokens
    Spec("prompt_tokens", "counter", "Prompt tokens of finished requests.", _M),
    Spec("generation_tokens", "counter", "Generated tokens of finished requests.", _M),
    Spec(
        "request_success",
        "counter",
        "Finished requests by finish reason (stop, length, abort).",
        ("model_name", "finished_reason"),
    ),
    Spec(
        "request_errors",
        "counter",
        "Requests that ended with an error, by status (invalid, rejected, internal).",
        ("model_name", "status"),
    ),
    Spec(
        "time_to_first_token_seconds",
        "histogram",
        "Arrival to first generated token (queue time included).",
        _M,
        TTFT_BUCKETS,
    ),
    Spec(
        "inter_token_latency_seconds",
        "histogram",
        "Time between generated tokens after the first chunk (a chunk of n tokens after a gap g counts n times g/n).",
        _M,
        ITL_BUCKETS,
    ),
    Spec("e2e_request_latency_seconds", "histogram", "Arrival to last token.", _M, E2E_BUCKETS),
    Spec("request_queue_time_seconds", "histogram", "Arrival to admission into a decoding slot.", _M, PHASE_BUCKETS),
    Spec("request_prefill_time_seconds", "histogram", "Admission to the first generated token.", _M, PHASE_BUCKETS),
    Spec("request_decode_time_seconds", "histogram", "First to last generated token.", _M, PHASE_BUCKETS),
    Spec("request_inference_time_seconds", "histogram", "Admission to the last generated token.", _M, PHASE_BUCKETS),
    Spec("request_prompt_tokens", "histogram", "Prompt tokens per finished request.", _M, TOKEN_BUCKETS),
    Spec("request_generation_tokens", "histogram", "Generated tokens per finished request.", _M, TOKEN_BUCKETS),
    # mode `auto`: what the planner plans with (viasd.planner), and what it chose
    Spec(
        "planner_forward_seconds",
        "gauge",
        "Mode auto's cost model: predicted seconds of one forward of `tier` over `rows` rows of `tokens` "
        "tokens (profiled at start, corrected online).",
        ("model_name", "tier", "rows", "tokens"),
    ),
    Spec(
        "planner_acceptance",
        "gauge",
        "Mode auto's running acceptance over every request: P(the draft token at `position` is accepted | "
        "reached), for `kind` model or ngram drafts.",
        ("model_name", "kind", "position"),
    ),
    Spec(
        "planner_transport_seconds",
        "gauge",
        "Mode auto's running estimate of a served step's `call` (propose, verify) outside the service that "
        "answers it: serialisation, the network, gRPC.",
        ("model_name", "call"),
    ),
    Spec("planner_via_tokens_per_cycle", "gauge", "Mode auto's running mean of tokens a via cycle commits.", _M),
    Spec("planner_via_escalation_rate", "gauge", "Mode auto's running probability that a via cycle escalates.", _M),
    Spec(
        "planner_probe_steps",
        "gauge",
        "Mode auto's probe steps so far: `ar` steps run while it speculated, to measure the plan every other "
        "must beat.",
        _M,
    ),
    Spec(
        "planner_speculate_margin",
        "gauge",
        "Mode auto's margin: how much a speculating batch must be expected to beat every auto row on `ar` by, "
        "from the planner's measured forecast error (1.1 before any step).",
        _M,
    ),
    Spec(
        "planner_planning",
        "gauge",
        "Mode auto's planning so far (`quantity`): the steps it planned and the seconds planning them took "
        "(each row's state and the plan search): what `auto` costs beside the forwards.",
        ("model_name", "quantity"),
    ),
    Spec(
        "planner_exploration_steps",
        "gauge",
        "Mode auto's exploration steps so far: `sd` steps run instead of `ar`, after 16 `ar` steps in a row "
        "when expected within 0.8x of `ar` and its drafters' catch-up costs at most 5% of the rows' time left, "
        "to measure the drafter's acceptance.",
        _M,
    ),
    Spec(
        "planner_forecast",
        "gauge",
        "Mode auto's steps so far, apart for `steps` that speculated and `ar` ones, and what the planner "
        "expected of them beside what they did (`quantity`): steps, predicted_seconds and seconds (measured, "
        "planning to commit), expected_tokens and tokens (committed).",
        ("model_name", "steps", "quantity"),
    ),
    Spec(
        "auto_plan_steps",
        "counter",
        "Steps of mode auto requests by the plan chosen (ar, sd:k=3, ...).",
        ("model_name", "plan"),
    ),
    # the served executor (actors.coordinator.ServedExecutor): where its calls' time goes
    Spec(
        "coordinator_steps", "counter", "Engine steps that decoded over the actors (one Verify per backend each).", _M
    ),
    Spec(
        "coordinator_seconds",
        "counter",
        "The served executor's call time by `phase`: prefill and release (their calls' wall time), drafter and "
        "verifier (what each service spent on its Propose and Verify calls), propose_transport and "
        "verify_transport (the rest of each round trip).",
        ("model_name", "phase"),
    ),
    Spec(
        "num_preemptions",
        "counter",
        "Preemptions of requests for KV blocks (paged caches: the request's blocks freed, its caches recomputed "
        "when it resumes), counted when the request ends.",
        _M,
    ),
    Spec(
        "prefix_cache_queries",
        "counter",
        "Prompt tokens looked up in the prefix cache (paged caches), counted when the request ends.",
        _M,
    ),
    Spec(
        "prefix_cache_hits",
        "counter",
        "Prompt tokens the full verifier took from the prefix cache instead of computing them.",
        _M,
    ),
    Spec("num_requests_running", "gauge", "Requests decoding in this replica.", _M),
    Spec("num_requests_waiting", "gauge", "Requests queued in this replica for a decoding slot.", _M),
    Spec(
        "kv_cache_usage_perc",
        "gauge",
        "KV-cache usage, 0 to 1: positions (prompt + generated) the requests in "
        "flight hold / the pipeline's KV capacity in positions.",
        _M,
    ),
)
PREFIX = "viasd_"
#: The counters of speculative requests (mode `via`: and the tier counters), by their RequestStats field.
SPEC_DECODE_COUNTERS = {
    f"spec_decode_num_{n}": f"num_{n}"
    for n in ("drafts", "draft_tokens", "accepted_tokens", "rejected_tokens", "bonus_tokens")
}
VIA_COUNTERS = {
    "slim_accepted_tokens": "slim_accepted",
    "slim_rewritten_tokens": "slim_rewritten",
    "escalations": "escalations",
    "escalated_tokens": "escalated_tokens",
    "full_accepted_tokens": "full_accepted",
}
_UPDATE = {"counter": "inc", "gauge": "set", "histogram": "observe"}  # how each kind takes a value


class PrometheusSink:
    """The metrics in a private `prometheus_client` registry (one per replica)."""

    def __init__(self):
        prom.disable_created_metrics()  # no `_created` twin of every counter (as vLLM does)
        self.registry = prom.CollectorRegistry(auto_describe=True)
        kinds = {"counter": prom.Counter, "gauge": prom.Gauge, "histogram": prom.Histogram}
        self.metrics = {}
        for s in SPECS:
            kw = {"buckets": s.buckets} if s.kind == "histogram" else {}
            metric = kinds[s.kind](PREFIX + s.name, s.doc, s.labels, registry=self.registry, **kw)
            self.metrics[s.name] = (metric, _UPDATE[s.kind])

    def record(self, name: str, value: float, labels: dict[str, str]) -> None:
        """Count, set or observe `value` (by the metric's kind)."""
        metric, update = self.metrics[name]
        getattr(metric.labels(**labels), update)(value)

    def exposition(self) -> tuple[bytes, str]:
        """Text exposition format and its content type."""
        return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST


class RaySink:
    """The same series through Ray's metrics agent (cluster-wide Prometheus export)."""

    def __init__(self):
        self.metrics = {}
        for s in SPECS:
            if s.kind == "counter":
                metric = rm.Counter(PREFIX + s.name + "_total", s.doc, tag_keys=s.labels)
            elif s.kind == "gauge":
                metric = rm.Gauge(PREFIX + s.name, s.doc, tag_keys=s.labels)
            else:
                metric = rm.Histogram(PREFIX + s.name, s.doc, boundaries=list(s.buckets), tag_keys=s.labels)
            self.metrics[s.name] = (metric, _UPDATE[s.kind])

    def record(self, name: str, value: float, labels: dict[str, str]) -> None:
        metric, update = self.metrics[name]
        if value or update != "inc":  # (Ray refuses a counter's zero increment)
            getattr(metric, update)(value, tags=labels)


class RequestTimer:
    """The timeline of one request, from its arrival: admission, first token, every later token.

    vLLM's phases, with admission into a decoding slot as "scheduled": queue = arrival to
    admission; prefill = admission to the first token; decode = first to last token;
    inference = admission to the last token; TTFT and end-to-end from the arrival.
    """

    def __init__(self, metrics: ServingMetrics):
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.start: float | None = None  # admitted
        self.first: float | None = None  # first token
        self.last: float | None = None  # latest token

    def admitted(self) -> None:
        self.start = time.perf_counter()
        self.metrics._record("request_queue_time_seconds", self.start - self.arrival)

    def tokens(self, n: int) -> None:
        """n tokens were committed now."""
        if n <= 0:
            return
        now = time.perf_counter()
        if self.last is None:  # the first chunk: a TTFT, no gaps
            self.first = now
            self.metrics._record("time_to_first_token_seconds", now - self.arrival)
            if self.start is not None:
                self.metrics._record("request_prefill_time_seconds", now - self.start)
        else:
            gap = (now - self.last) / n
            for _ in range(n):
                self.metrics._record("inter_token_latency_seconds", gap)
        self.last = now

    def finish(self, samples: Sequence[RequestStats | None], finish_reason: str) -> None:
        """The request ended: its latencies, and the statistics of its samples (one unless n > 1;
        None where the pipeline sent none: the handler ended it)."""
        self.metrics._record("e2e_request_latency_seconds", time.perf_counter() - self.arrival)
        if self.first is not None:
            self.metrics._record("request_decode_time_seconds", self.last - self.first)
        if self.start is not None and self.last is not None:
            self.metrics._record("request_inference_time_seconds", self.last - self.start)
        self.metrics.record_stats(samples, finish_reason)


class ServingMetrics:
    """Records requests into every sink; `exposition()` gives the replica's Prometheus text."""

    def __init__(self, model: str, *, enabled: bool = True, ray_export: bool = False):
        self.model = model
        self.enabled = enabled
        self.prometheus = PrometheusSink() if enabled else None
        self.sinks: list = [self.prometheus] if enabled else []
        if enabled and ray_export:
            self.sinks.append(RaySink())
        self._labels = {"model_name": model}
        self._steps: tuple[int, dict[str, float]] = (0, {})  # the step totals published so far

    def _record(self, name: str, value: float, **labels: str) -> None:
        for sink in self.sinks:
            sink.record(name, value, {**self._labels, **labels})

    def set_queue(self, running: int, waiting: int) -> None:
        self._record("num_requests_running", running)
        self._record("num_requests_waiting", waiting)

    def set_kv_usage(self, fraction: float) -> None:
        self._record("kv_cache_usage_perc", fraction)

    def set_planner(self, state: dict) -> None:
        """Mode auto's planner state (`Engine.planner_state`): the
        cost curves (once profiled), the running acceptance and the via estimates."""
        for name, value in (
            ("planner_via_tokens_per_cycle", state["via"]["tokens_per_cycle"]),
            ("planner_via_escalation_rate", state["via"]["escalation_rate"]),
            ("planner_probe_steps", state["probes"]),
            ("planner_speculate_margin", state["margin"]),
            ("planner_exploration_steps", state["explorations"]),
        ):
            self._record(name, value)
        for quantity, value in state["planning"].items():
            self._record("planner_planning", value, quantity=quantity)
        for steps, forecast in state["forecasts"].items():
            for quantity, value in forecast.items():
                self._record("planner_forecast", value, steps=steps, quantity=quantity)
        for kind, rates in state["acceptance"].items():
            for j, rate in enumerate(rates):
                self._record("planner_acceptance", rate, kind=kind, position=str(j))
        costs = state["costs"] or {}
        for tier, curve in (costs.get("seconds") or {}).items():
            for p in curve:
                self._record(
                    "planner_forward_seconds", p["seconds"], tier=tier, rows=str(p["rows"]), tokens=str(p["tokens"])
                )
        for call, seconds in (costs.get("transport_seconds") or {}).items():
            self._record("planner_transport_seconds", seconds, call=call)

    def set_steps(self, steps: int, phases: dict[str, float]) -> None:
        """The served executor's running totals (`RpcTotals.steps` and `.phases()`): the counters
        move by what changed since the last call."""
        done, seen = self._steps
        self._record("coordinator_steps", max(0, steps - done))
        for phase, seconds in phases.items():
            self._record("coordinator_seconds", max(0.0, seconds - seen.get(phase, 0.0)), phase=phase)
        self._steps = (max(steps, done), {p: max(v, seen.get(p, 0.0)) for p, v in phases.items()})

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def error(self, status: str) -> None:
        self._record("request_errors", 1, status=status)

    def record_stats(self, samples: Sequence[RequestStats | None], finish_reason: str) -> None:
        """Add one finished request's statistics to the counters: the prompt once, the tokens and
        counters of each of its samples (n > 1: several; None: a sample with no statistics)."""
        self._record("request_success", 1, finished_reason=finish_reason or "abort")
        known = [s for s in samples if s is not None]
        if not known:
            return
        self._record("prompt_tokens", known[0].prompt_tokens)
        self._record("request_prompt_tokens", known[0].prompt_tokens)
        generated = sum(s.generated_tokens for s in known)
        self._record("generation_tokens", generated)
        self._record("request_generation_tokens", generated)
        self._record("num_preemptions", sum(s.preemptions for s in known))
        self._record("prefix_cache_queries", known[0].prompt_tokens)
        self._record("prefix_cache_hits", sum(s.cached_tokens for s in known))
        for stats in known:
            self._record_counters(stats)

    def _record_counters(self, stats: RequestStats) -> None:
        """One sample's per-tier and speculative counters."""
        for tier in MODELS:
            self._record("forward_passes", stats.forwards.get(tier, 0), tier=tier)
            self._record("forward_seconds", stats.seconds.get(tier, 0.0), tier=tier)
        if stats.mode == "ar":
            return
        mode = {"mode": stats.mode}
        for name, attr in (SPEC_DECODE_COUNTERS | (VIA_COUNTERS if stats.mode == "via" else {})).items():
            self._record(name, getattr(stats, attr), **mode)
        for pos, value in enumerate(stats.num_accepted_tokens_per_pos):
            self._record("spec_decode_num_accepted_tokens_per_pos", value, position=str(pos), **mode)
        for plan, steps in stats.plans.items():
            self._record("auto_plan_steps", steps, plan=plan)

    def exposition(self) -> tuple[bytes, str]:
        if self.prometheus is None:
            return b"# metrics disabled in the serving config\n", "text/plain; version=0.0.4; charset=utf-8"
        return self.prometheus.exposition()


def parse_exposition(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of a Prometheus text exposition keyed by (name, sorted labels) (for tests and tools)."""
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
