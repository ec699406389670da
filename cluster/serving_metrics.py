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


def _spec(kind: str):
    """A maker of specs of one kind, labelled by the served model name (vLLM's `model_name`) first."""
    return lambda name, doc, *labels, buckets=(): Spec(name, kind, doc, ("model_name", *labels), buckets)


_counter, _gauge, _histogram = _spec("counter"), _spec("gauge"), _spec("histogram")

SPECS = (
    # vLLM's speculative-decoding counters
    _counter("spec_decode_num_drafts", "Draft blocks proposed (one per speculative cycle).", "mode"),
    _counter("spec_decode_num_draft_tokens", "Draft tokens proposed by the drafter p.", "mode"),
    _counter("spec_decode_num_accepted_tokens", "Draft tokens committed as drafted (by q' or q).", "mode"),
    _counter(
        "spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted at block position `position` (0-based).",
        "mode",
        "position",
    ),
    _counter("spec_decode_num_rejected_tokens", "Draft tokens replaced (rewritten by q' or rejected by q).", "mode"),
    _counter("spec_decode_num_bonus_tokens", "Bonus tokens after fully accepted blocks.", "mode"),
    # VIA-SD tiers
    _counter("slim_accepted_tokens", "Draft tokens accepted by the slim verifier q' (region A).", "mode"),
    _counter("slim_rewritten_tokens", "Region-B rewrites by the slim verifier q'.", "mode"),
    _counter("escalations", "Blocks escalated to the full verifier q.", "mode"),
    _counter("escalated_tokens", "Draft positions the full verifier q decided.", "mode"),
    _counter("full_accepted_tokens", "Escalated draft tokens the full verifier q accepted.", "mode"),
    _counter("forward_passes", "Forward passes per tier (drafter, slim, full).", "tier"),
    _counter("forward_seconds", "Seconds spent in forward passes per tier.", "tier"),
    # requests and tokens
    _counter("prompt_tokens", "Prompt tokens of finished requests."),
    _counter("generation_tokens", "Generated tokens of finished requests."),
    _counter("request_success", "Finished requests by finish reason (stop, length, abort).", "finished_reason"),
    _counter("request_errors", "Requests that ended with an error, by status (invalid, rejected, internal).", "status"),
    _histogram(
        "time_to_first_token_seconds", "Arrival to first generated token (queue time included).", buckets=TTFT_BUCKETS
    ),
    _histogram(
        "inter_token_latency_seconds",
        "Time between generated tokens after the first chunk (a chunk of n tokens after a gap g counts n times g/n).",
        buckets=ITL_BUCKETS,
    ),
    _histogram("e2e_request_latency_seconds", "Arrival to last token.", buckets=E2E_BUCKETS),
    _histogram("request_queue_time_seconds", "Arrival to admission into a decoding slot.", buckets=PHASE_BUCKETS),
    _histogram("request_prefill_time_seconds", "Admission to the first generated token.", buckets=PHASE_BUCKETS),
    _histogram("request_decode_time_seconds", "First to last generated token.", buckets=PHASE_BUCKETS),
    _histogram("request_inference_time_seconds", "Admission to the last generated token.", buckets=PHASE_BUCKETS),
    _histogram("request_prompt_tokens", "Prompt tokens per finished request.", buckets=TOKEN_BUCKETS),
    _histogram("request_generation_tokens", "Generated tokens per finished request.", buckets=TOKEN_BUCKETS),
    # mode `auto`: what the planner plans with (viasd.planner), and what it chose
    _gauge(
        "planner_forward_seconds",
        "Mode auto's cost model: predicted seconds of one forward of `tier` over `rows` rows of `tokens` "
        "tokens (profiled at start, corrected online).",
        "tier",
        "rows",
        "tokens",
    ),
    _gauge(
        "planner_acceptance",
        "Mode auto's running acceptance over every request: P(the draft token at `position` is accepted | "
        "reached), for `kind` model or ngram drafts.",
        "kind",
        "position",
    ),
    _gauge(
        "planner_transport_seconds",
        "Mode auto's running estimate of a served step's `call` (propose, verify) outside the service that "
        "answers it: serialisation, the network, gRPC.",
        "call",
    ),
    _gauge("planner_via_tokens_per_cycle", "Mode auto's running mean of tokens a via cycle commits."),
    _gauge("planner_via_escalation_rate", "Mode auto's running probability that a via cycle escalates."),
    _gauge(
        "planner_probe_steps",
        "Mode auto's probe steps so far: `ar` steps run while it speculated, to measure the plan every other "
        "must beat.",
    ),
    _gauge(
        "planner_speculate_margin",
        "Mode auto's margin: how much a speculating batch must be expected to beat every auto row on `ar` by, "
        "from the planner's measured forecast error (1.1 before any step).",
    ),
    _gauge(
        "planner_planning",
        "Mode auto's planning so far (`quantity`): the steps it planned and the seconds planning them took "
        "(each row's state and the plan search): what `auto` costs beside the forwards.",
        "quantity",
    ),
    _gauge(
        "planner_exploration_steps",
        "Mode auto's exploration steps so far: `sd` steps run instead of `ar`, after 16 `ar` steps in a row "
        "when expected within 0.8x of `ar` and its drafters' catch-up costs at most 5% of the rows' time left, "
        "to measure the drafter's acceptance.",
    ),
    _gauge(
        "planner_forecast",
        "Mode auto's steps so far, apart for `steps` that speculated and `ar` ones, and what the planner "
        "expected of them beside what they did (`quantity`): steps, predicted_seconds and seconds (measured, "
        "planning to commit), expected_tokens and tokens (committed).",
        "steps",
        "quantity",
    ),
    _counter("auto_plan_steps", "Steps of mode auto requests by the plan chosen (ar, sd:k=3, ...).", "plan"),
    # the served executor (actors.coordinator.ServedExecutor): where its calls' time goes
    _counter("coordinator_steps", "Engine steps that decoded over the actors (one Verify per backend each)."),
    _counter(
        "coordinator_seconds",
        "The served executor's call time by `phase`: prefill and release (their calls' wall time), drafter and "
        "verifier (what each service spent on its Propose and Verify calls), propose_transport and "
        "verify_transport (the rest of each round trip).",
        "phase",
    ),
    _counter(
        "num_preemptions",
        "Preemptions of requests for KV blocks (paged caches: the request's blocks freed, its caches recomputed "
        "when it resumes), counted when the request ends.",
    ),
    _counter(
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache (paged caches), counted when the request ends.",
    ),
    _counter(
        "prefix_cache_hits", "Prompt tokens the full verifier took from the prefix cache instead of computing them."
    ),
    _gauge("num_requests_running", "Requests decoding in this replica."),
    _gauge("num_requests_waiting", "Requests queued in this replica for a decoding slot."),
    _gauge(
        "kv_cache_usage_perc",
        "KV-cache usage, 0 to 1: positions (prompt + generated) the requests in "
        "flight hold / the pipeline's KV capacity in positions.",
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
        kinds = {"counter": rm.Counter, "gauge": rm.Gauge, "histogram": rm.Histogram}
        self.metrics = {}
        for s in SPECS:
            kw = {"boundaries": list(s.buckets)} if s.kind == "histogram" else {}
            name = PREFIX + s.name + ("_total" if s.kind == "counter" else "")
            self.metrics[s.name] = (kinds[s.kind](name, s.doc, tag_keys=s.labels, **kw), _UPDATE[s.kind])

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
        """Mode auto's planner state (`Engine.planner_state`): cost curves (once profiled), acceptance, via estimates."""
        self._record("planner_via_tokens_per_cycle", state["via"]["tokens_per_cycle"])
        self._record("planner_via_escalation_rate", state["via"]["escalation_rate"])
        self._record("planner_probe_steps", state["probes"])
        self._record("planner_speculate_margin", state["margin"])
        self._record("planner_exploration_steps", state["explorations"])
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
