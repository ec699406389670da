"""`viasd bench --suite load`: throughput under concurrency, our continuous batching against
transformers' own and against the bare model's batched forward.

    viasd bench --suite load --concurrency 1,2,4,8,16 --max-tokens 128 --prompts 5 --dtype float32
    viasd bench --suite load --arrival poisson --rate 0.5 --methods "ar;via;generate_batch;roofline"

For each arrival pattern, pass and concurrency C, every method runs once (the order rotated by
pass + C) on the same C requests (prompt i % len(prompts) for request i, `ignore_eos=True`,
exactly `max_tokens` tokens each). Methods: any engine spec of `viasd.bench.methods` (``ar``,
``sd``, ``via``, ...) with max_batch >= C, or with ``@batch1`` at max_batch=1; ``generate_batch``,
transformers' continuous batching on the very verifier module our engine wraps (`_hf_run`);
``roofline``, `MaskedLM.forward_batch` over C rows at L = mean prompt length + max_tokens // 2
cached positions, each step rolled back, tokens/s = C / median step. Arrivals: ``all`` (t = 0) or
``poisson`` (seeded exponential gaps at `rate` requests/s, the first at t = 0); a request is
submitted once its arrival time has passed.

Figures, per run (method, arrival, C, pass):

* aggregate tokens/s = all generated tokens / (last finish - first arrival);
* per-request tokens/s = a request's tokens / (its finish - its arrival), the median;
* TTFT = first token's commit time - arrival; p50 and p99;
* inter-token latency: each chunk after a request's first gives (its time - the previous chunk's)
  / its tokens, once per token; p50 and p99 over all tokens (the roofline's: its step time);
* KV bytes per request (`RequestStats.kv_bytes`, the mean; None for `generate_batch`), peak RSS
  (`RSSSampler`), and for `auto` what the planner did (`planner_record`).

A summary row (arrival, method, C) holds the median of each figure over passes, its ratios to the
roofline and to `generate_batch`, and the share of requests whose tokens equal batched `ar`'s.
`load_targets` evaluates the goals: batched `ar` at C = 8 and 16 >= 0.8x the roofline's decode
rate; our best batched mode >= generate_batch at every C >= 4; `auto` >= AUTO_TO_BEST x the best
fixed mode and >= AUTO_TO_AR x `ar`.
"""

from __future__ import annotations

import contextlib
import gc
import math
import random
import shlex
import statistics
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from viasd import model_thread
from viasd.bench.methods import Method, parse_method, split_specs
from viasd.bench.report import write_results
from viasd.bench.runner import Bench, RSSSampler, _quiet_transformers, _sync
from viasd.bench.workloads import Prompt
from viasd.config import GenerationParams, Mode, parse_params
from viasd.engine import Engine, cost_cache_dir
from viasd.errors import InvalidParameterError
from viasd.runtime import MaskedLM, Row

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16)
DEFAULT_METHODS = ("ar", "sd", "via", "ar@batch1", "sd@batch1", "via@batch1", "generate_batch", "roofline")
ARRIVALS = ("all", "poisson")
BATCH1 = "@batch1"
HF_CB = "generate_batch"
ROOFLINE = "roofline"
ROOFLINE_STEPS = 5  # timed decode steps per roofline measurement (after one untimed)
PREFILL_CHUNK = 512  # our engine's prompt tokens per step; generate_batch gets the same budget

RUN_FIELDS = (
    "method",
    "arrival",
    "concurrency",
    "pass",
    "ok",
    "error",
    "wall_seconds",
    "generated_tokens",
    "aggregate_tokens_per_second",
    "per_request_tokens_per_second_median",
    "ttft_p50",
    "ttft_p99",
    "itl_p50",
    "itl_p99",
    "kv_bytes_per_request",
    "peak_rss_bytes",
    "requests",
)
REQUEST_FIELDS = (
    "index",
    "prompt",
    "prompt_tokens",
    "arrival",
    "submitted",
    "first_token",
    "finished",
    "generated_tokens",
    "tokens",
    "ttft",
    "queue_seconds",
    "tokens_per_second",
    "itl",
    "kv_bytes",
)
SUMMARY_FIELDS = (
    "arrival",
    "method",
    "kind",
    "concurrency",
    "passes",
    "ok_passes",
    "aggregate_tokens_per_second",
    "per_request_tokens_per_second_median",
    "ttft_p50",
    "ttft_p99",
    "itl_p50",
    "itl_p99",
    "kv_bytes_per_request",
    "peak_rss_bytes",
    "ratio_to_roofline",
    "ratio_to_generate_batch",
    "agree_with_ar",
)


# ------------------------------------------------------------------ methods


class LoadMethod:
    """One method of the load suite: an engine spec at a batch size, generate_batch, or the roofline."""

    def __init__(self, label: str, kind: str, method: Method | None = None, batch1: bool = False):
        self.label, self.kind, self.method, self.batch1 = label, kind, method, batch1  # kind: engine | hf_cb | roofline

    def describe(self) -> dict:
        d: dict[str, Any] = {"label": self.label, "kind": self.kind, "batch1": self.batch1}
        if self.method is not None:
            d.update(
                spec=self.method.label, mode=self.method.mode.value, params=self.method.params.model_dump(mode="json")
            )
        return d


def parse_load_methods(spec: str | Sequence[str] | None, base: GenerationParams) -> list[LoadMethod]:
    """``ar``, ``sd``, ``via`` (engine specs with overrides), ``SPEC@batch1``, ``generate_batch``,
    ``roofline``; comma-separated (``;`` when a spec has commas) or a list. Default: DEFAULT_METHODS."""
    specs = list(DEFAULT_METHODS) if spec is None else split_specs(spec) if isinstance(spec, str) else list(spec)
    out: dict[str, LoadMethod] = {}
    for s in specs:
        s = s.strip()
        if s in (HF_CB, "hf-cb", "hf-generate-batch"):
            out.setdefault(HF_CB, LoadMethod(HF_CB, "hf_cb"))
            continue
        if s == ROOFLINE:
            out.setdefault(ROOFLINE, LoadMethod(ROOFLINE, "roofline"))
            continue
        batch1 = s.endswith(BATCH1)
        m = parse_method(s.removesuffix(BATCH1), base)
        if m.kind != "engine":
            raise InvalidParameterError(
                "methods",
                f"{s!r}: the load suite runs our engine specs (ar, sd, via, SPEC{BATCH1}), {HF_CB} and {ROOFLINE}",
            )
        out.setdefault(s, LoadMethod(s, "engine", m, batch1))
    if not out:
        raise InvalidParameterError("methods", "no method given")
    return list(out.values())


def concurrency_levels(spec: str | int, field: str = "concurrency") -> list[int]:
    """The levels of ``--concurrency`` ("1,4,8"; or of the option `field` names): positive
    integers, at least one; else an error naming `field`."""
    try:
        levels = [int(c) for c in str(spec).split(",") if c.strip()]
    except ValueError:
        raise InvalidParameterError(field, f"comma-separated integers, got {spec!r}") from None
    if not levels or min(levels) < 1:
        raise InvalidParameterError(field, f"at least one level, each >= 1, got {spec!r}")
    return levels


def arrival_times(n: int, pattern: str, rate: float, seed: int) -> list[float]:
    """Arrival offsets in seconds of n requests: all 0 (``all``), or a Poisson process at `rate`
    requests/s (exponential gaps, random.Random(seed)), the first request at 0."""
    if pattern == "all":
        return [0.0] * n
    if pattern != "poisson":
        raise InvalidParameterError("arrival", f"unknown arrival pattern {pattern!r}; known: {', '.join(ARRIVALS)}")
    if not rate > 0:
        raise InvalidParameterError("rate", f"must be > 0 requests/s for poisson arrivals, got {rate}")
    rng = random.Random(seed)
    times, t = [], 0.0
    for _i in range(n):
        times.append(t)
        t += rng.expovariate(rate)
    return times


# ------------------------------------------------------------------ figures


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between order statistics; None if empty."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _median(xs: Sequence[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def planner_record(before: dict, after: dict) -> dict:
    """What `auto`'s planner did in one run: `Engine.planner_state()` after it less before (the
    probe and exploration steps it ran, its forecasts of the steps it planned: viasd.planner),
    and the engine-wide running acceptance, margins and prices it started and ended with (model /
    n-gram drafts per position, `via` tokens per cycle and escalation; how much speculation had to
    be expected to beat `ar` by; each tier's predicted seconds at its grid's points,
    `CostModel.summary`), and the steps it planned with the seconds planning them took."""
    costs = after.get("costs") or {}
    return {
        "prices": costs.get("seconds"),
        "probes": after["probes"] - before["probes"],
        "explorations": after["explorations"] - before["explorations"],
        "forecasts": {
            kind: {key: round(value - before["forecasts"][kind][key], 4) for key, value in forecast.items()}
            for kind, forecast in after["forecasts"].items()
        },
        "acceptance": after["acceptance"],
        "via": after["via"],
        "margin": {"start": before["margin"], "end": after["margin"]},
        "planning": {key: round(value - before["planning"][key], 6) for key, value in after["planning"].items()},
    }


def _finish_run(run: dict) -> dict:
    """Fill the run-level figures of a run record from its per-request records (module docstring)."""
    reqs = run["requests"]
    done = [r for r in reqs if r.get("finished") is not None]
    run["generated_tokens"] = sum(r["generated_tokens"] for r in reqs)
    if done and len(done) == len(reqs):
        start = min(r["arrival"] for r in reqs)
        run["wall_seconds"] = max(r["finished"] for r in reqs) - start
        run["aggregate_tokens_per_second"] = (
            run["generated_tokens"] / run["wall_seconds"] if run["wall_seconds"] > 0 else None
        )
    for r in done:
        span = r["finished"] - r["arrival"]
        r["tokens_per_second"] = r["generated_tokens"] / span if span > 0 else None
    run["per_request_tokens_per_second_median"] = _median([r.get("tokens_per_second") for r in done])
    ttft = [r["ttft"] for r in reqs if r.get("ttft") is not None]
    itl = [g for r in reqs for g in r.get("itl") or ()]
    run["ttft_p50"], run["ttft_p99"] = percentile(ttft, 50), percentile(ttft, 99)
    run["itl_p50"], run["itl_p99"] = percentile(itl, 50), percentile(itl, 99)
    kv = [r["kv_bytes"] for r in reqs if r.get("kv_bytes") is not None]
    run["kv_bytes_per_request"] = sum(kv) / len(kv) if kv else None
    return run


def request_record(index: int, prompt_id: str, ids: Sequence[int], arrival: float, **measured) -> dict:
    """One request's record of a load run: what it was, and what was measured (unset: None / empty)."""
    record = {
        "index": index,
        "prompt": prompt_id,
        "prompt_tokens": len(ids),
        "arrival": arrival,
        "submitted": None,
        "first_token": None,
        "finished": None,
        "generated_tokens": 0,
        "tokens": [],
        "ttft": None,
        "queue_seconds": None,
        "tokens_per_second": None,
        "itl": [],
        "kv_bytes": None,
    }
    assert set(measured) <= {*record, "_chunks"}, sorted(set(measured) - set(record))
    return {**record, **measured}


def _gaps(times: Sequence[tuple[float, int]]) -> list[float]:
    """Per-token inter-token latencies from (commit time, tokens) of a request's chunks: chunk i > 0
    gives (t_i - t_{i-1}) / n_i, n_i times."""
    out = []
    for (t0, _), (t1, n) in zip(times, times[1:]):
        out += [(t1 - t0) / n] * n
    return out


# ------------------------------------------------------------------ the runs


class LoadBench:
    """Runs the load suite's methods on one loaded pair (a `Bench`): engines are built once per
    (method, batch size) around the loaded MaskedLMs and reused across concurrency levels."""

    def __init__(self, bench: Bench, max_batch: int, max_seq_len: int):
        self.bench = bench
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len  # rows hold prompt + max_tokens + a draft block: no cut drafts
        self._engines: dict[tuple, Engine] = {}

    def engine(self, lm: LoadMethod) -> Engine:
        b, m = self.bench, lm.method
        mask = b.resolve_mask(m).mask if m.mode == Mode.VIA else b.default_mask
        policy = m.cache_policy or b.cache_policy
        rows = 1 if lm.batch1 else self.max_batch
        key = (mask.keep, str(policy), rows)
        if key not in self._engines:
            self._engines[key] = Engine(
                b.verifier,
                b.drafter,
                mask=mask,
                cache_policy=policy,
                eos_token_ids=b.eos_token_ids,
                max_context=b.max_context,
                max_batch=rows,
                max_seq_len=self.max_seq_len,
                prefill_chunk=PREFILL_CHUNK,
                cost_cache_dir=cost_cache_dir(),
            )
        return self._engines[key]

    def close(self) -> None:
        for e in self._engines.values():
            e.close()

    def run(
        self, lm: LoadMethod, requests: list[tuple[str, list[int]]], arrivals: list[float], params: GenerationParams
    ) -> dict:
        """One run: the figures and the per-request records (raises on failure)."""
        if self.bench.collect_garbage:
            gc.collect()
        with RSSSampler() as rss:
            if lm.kind == "engine":
                engine, auto = self.engine(lm), lm.method.mode == Mode.AUTO
                before = engine.planner_state() if auto else None
                reqs = self._engine_run(
                    engine,
                    requests,
                    arrivals,
                    lm.method.params.model_copy(update={"max_tokens": params.max_tokens, "ignore_eos": True}),
                )
                extra = {"planner": planner_record(before, engine.planner_state())} if auto else {}
            elif lm.kind == "hf_cb":  # (on the model thread, as the engine's forwards: viasd.model_thread)
                reqs, extra = model_thread.run(self._hf_run, requests, arrivals, params)
            else:
                reqs, extra = model_thread.run(self._roofline, requests, params)
        run = {"requests": reqs, "peak_rss_bytes": rss.peak, "rss_start_bytes": rss.start, **extra}
        _finish_run(run)
        if lm.kind == "roofline":  # not requests: the figures are the step's
            step = extra["step_seconds_median"]
            run.update(
                wall_seconds=step,
                generated_tokens=len(requests),
                aggregate_tokens_per_second=len(requests) / step,
                itl_p50=step,
                itl_p99=step,
            )
        return run

    # -------------------------------------------------------------- our engine

    def _engine_run(
        self, engine: Engine, requests: list[tuple[str, list[int]]], arrivals: list[float], params: GenerationParams
    ) -> list[dict]:
        """Drive `engine.step()` ourselves: submit each request once its arrival time has passed."""
        order = deque(sorted(range(len(requests)), key=lambda i: arrivals[i]))
        recs: list[dict] = []
        for i, (pid, ids) in enumerate(requests):
            recs.append(request_record(i, pid, ids, arrivals[i], _chunks=[]))
        by_handle: dict[int, dict] = {}
        _sync(self.bench.verifier.device)
        t0 = time.perf_counter()
        while order or engine.scheduler.has_work():
            now = time.perf_counter() - t0
            while order and arrivals[order[0]] <= now:
                i = order.popleft()
                h = engine.submit(requests[i][1], params)
                recs[i]["submitted"] = time.perf_counter() - t0
                by_handle[h.id] = recs[i]
            if not engine.scheduler.has_work():
                time.sleep(max(0.0, arrivals[order[0]] - (time.perf_counter() - t0)))
                continue
            outs = engine.step()
            _sync(self.bench.verifier.device)
            t = time.perf_counter() - t0
            for h, chunk in outs:
                h.chunks.clear()  # we read the step's return value; the handle's queue would only grow
                r = by_handle[h.id]
                if chunk.token_ids:
                    r["tokens"] += chunk.token_ids
                    r["_chunks"].append((t, len(chunk.token_ids)))
                    if r["first_token"] is None:
                        r["first_token"] = t
                if chunk.finished:
                    r["finished"] = t
                    r["queue_seconds"] = chunk.stats.queue_seconds
                    r["kv_bytes"] = chunk.stats.kv_bytes
                    r["stats"] = chunk.stats.to_dict()
        for r in recs:
            chunks = r.pop("_chunks")
            r["generated_tokens"] = len(r["tokens"])
            r["ttft"] = None if r["first_token"] is None else r["first_token"] - r["arrival"]
            r["itl"] = _gaps(chunks)
        return recs

    # -------------------------------------------------------------- transformers' continuous batching

    def _hf_configs(self, requests: list[tuple[str, list[int]]], params: GenerationParams):
        """The GenerationConfig and ContinuousBatchingConfig of a generate_batch run.

        * greedy (do_sample=False) unless the parameters sample; eos_token_id=-1: no stop token, so
          every request generates exactly max_new_tokens (what ignore_eos does in ours);
        * the paged cache sized for the run (num_blocks = C x the pages one request needs): by
          default it takes 60% of free RAM on CPU, seconds to zero and a meaningless RSS figure;
        * max_batch_tokens = our prefill_chunk + C: the same prompt budget per step as our engine's,
          plus one decode token per running request; max_requests_per_batch = C;
        * no block (prefix) sharing: prompts repeat when cycled and our engine has no prefix cache;
        * auto_switch_to_flash=False: the model keeps its attention implementation (sdpa; eager
          would become paged|eager), there is no flash attention on CPU.
        """
        from transformers import ContinuousBatchingConfig, GenerationConfig

        c = len(requests)
        sampling = (
            {}
            if params.greedy
            else {"temperature": params.temperature, "top_k": params.top_k or None, "top_p": params.top_p}
        )
        gen_cfg = GenerationConfig(
            max_new_tokens=params.max_tokens,
            do_sample=not params.greedy,
            eos_token_id=-1,
            pad_token_id=self.bench.eos_token_ids[0] if self.bench.eos_token_ids else 0,
            **sampling,
        )
        page = 256
        longest = max(len(ids) for _, ids in requests) + params.max_tokens
        pages = math.ceil(longest / page) + 1
        cb_cfg = ContinuousBatchingConfig(
            page_size=page,
            num_blocks=c * pages,
            max_batch_tokens=PREFILL_CHUNK + c,
            max_requests_per_batch=c,
            allow_block_sharing=False,
            auto_switch_to_flash=False,
            seed=params.seed,
        )
        return gen_cfg, cb_cfg

    def _hf_run(
        self, requests: list[tuple[str, list[int]]], arrivals: list[float], params: GenerationParams
    ) -> tuple[list[dict], dict]:
        """generate_batch on the verifier module (``all``), or its manager with add_request at each
        arrival (``poisson``). Times are transformers' own perf_counter stamps: a request's
        created_time (its add_request) and one timestamp per generated token."""
        from transformers.generation.continuous_batching.utils import WorkloadHints

        model = self.bench.verifier.model
        gen_cfg, cb_cfg = self._hf_configs(requests, params)
        inputs = [list(ids) for _, ids in requests]
        attn_before = model.config._attn_implementation
        outputs: dict[int, Any] = {}
        with _quiet_transformers():
            _sync(model.device)
            call0 = time.perf_counter()
            if all(a == 0.0 for a in arrivals):
                res = model.generate_batch(
                    inputs=inputs,
                    generation_config=gen_cfg,
                    continuous_batching_config=cb_cfg,
                    record_timestamps=True,
                    warmup=True,
                )
                outputs = dict(enumerate(res.values()))  # in input order
                t0 = min(o.created_time for o in outputs.values()) if outputs else call0
                attn_used = "paged|eager" if attn_before == "eager" else attn_before  # what the manager switches to
            else:
                hints = WorkloadHints(
                    max_prompt_length=max(map(len, inputs)),
                    max_generated_length=params.max_tokens,
                    num_requests=len(inputs),
                )
                with model.continuous_batching_context_manager(
                    generation_config=gen_cfg,
                    continuous_batching_config=cb_cfg,
                    block=True,
                    timeout=60,
                    warmup=True,
                    workload_hints=hints,
                ) as manager:
                    attn_used = model.config._attn_implementation
                    order = deque(sorted(range(len(inputs)), key=lambda i: arrivals[i]))
                    ids_of: dict[str, int] = {}
                    t0 = time.perf_counter()
                    while len(outputs) < len(inputs):
                        now = time.perf_counter() - t0
                        while order and arrivals[order[0]] <= now:
                            i = order.popleft()
                            rid = manager.add_request(
                                inputs[i],
                                request_id=f"load_{i}",
                                max_new_tokens=params.max_tokens,
                                record_timestamps=True,
                                eos_token_id=-1,
                            )
                            ids_of[rid] = i
                        wait = 0.05 if not order else min(0.05, arrivals[order[0]] - now)
                        out = manager.get_result(timeout=wait) if wait > 0 else None  # results, until the next arrival
                        if out is not None and out.is_finished():
                            outputs[ids_of[out.request_id]] = out
                        if not manager.is_running() and len(outputs) < len(inputs):
                            raise RuntimeError(
                                "transformers' continuous batching thread stopped before all requests finished"
                            )
            call_seconds = time.perf_counter() - call0
        recs = []
        for i, (pid, ids) in enumerate(requests):
            o = outputs.get(i)
            if o is None or o.error is not None:
                raise RuntimeError(f"generate_batch request {i}: {'missing' if o is None else o.error}")
            stamps = [s - t0 for s in (o.timestamps or [])]  # [generated] seconds since the first submission
            submitted = o.created_time - t0
            recs.append(
                request_record(
                    i,
                    pid,
                    ids,
                    arrivals[i],
                    submitted=submitted,
                    first_token=stamps[0] if stamps else None,
                    finished=o.lifespan[1] - t0,
                    generated_tokens=len(o.generated_tokens),
                    tokens=list(o.generated_tokens),
                    ttft=stamps[0] - arrivals[i] if stamps else None,
                    queue_seconds=o.lifespan[0] - o.created_time,
                    itl=_gaps([(s, 1) for s in stamps]),
                )
            )
        extra = {
            "call_seconds": call_seconds,  # the whole call: manager start-up, cache allocation, warm-up, stop
            "hf_attn_implementation": attn_used or attn_before,
            "hf_api": "model.generate_batch"
            if all(a == 0.0 for a in arrivals)  # every request at t = 0
            else "its manager (continuous_batching_context_manager) + add_request at each arrival",
            "hf_cb_config": {
                k: getattr(cb_cfg, k)
                for k in (
                    "page_size",
                    "num_blocks",
                    "max_batch_tokens",
                    "max_requests_per_batch",
                    "allow_block_sharing",
                )
            },
        }
        return recs, extra

    # -------------------------------------------------------------- the roofline

    def _roofline(self, requests: list[tuple[str, list[int]]], params: GenerationParams) -> tuple[list[dict], dict]:
        """One decode step of B = C rows at cached length L through MaskedLM.forward_batch; the
        median of ROOFLINE_STEPS timed steps (each rolled back to L), after one untimed step."""
        lm: MaskedLM = self.bench.verifier
        c = len(requests)
        length = round(statistics.mean(len(ids) for _, ids in requests)) + params.max_tokens // 2  # L
        store = lm.new_store(max_rows=c, max_len=length + 1)
        rows = [store.alloc() for _ in range(c)]
        # each row's L cached tokens: its prompt repeated (the figure does not depend on the values)
        fill = [(ids * (length // len(ids) + 1))[:length] for _, ids in requests]  # C x [L]
        for lo in range(0, length, PREFILL_CHUNK):  # chunked like the engine's prefill
            hi = min(length, lo + PREFILL_CHUNK)
            lm.forward_batch([Row(f[lo:hi], lo, 0, r) for f, r in zip(fill, rows)], store)
        step_rows = [Row([f[-1]], length, 1, r) for f, r in zip(fill, rows)]  # C rows x 1 token at position L
        seconds = []
        for k in range(ROOFLINE_STEPS + 1):
            _sync(lm.device)
            t = time.perf_counter()
            logits = lm.forward_batch(step_rows, store)  # C x [1, V]
            torch.stack([x[-1] for x in logits]).argmax(-1).tolist()  # [C]: the greedy pick, as a decode does
            _sync(lm.device)
            if k:
                seconds.append(time.perf_counter() - t)
            for r in rows:
                store.crop(r, length)
        kv = store.nbytes(rows[0])
        recs = [request_record(i, pid, ids, 0.0, kv_bytes=kv) for i, (pid, ids) in enumerate(requests)]
        return recs, {
            "cached_length": length,
            "step_seconds": seconds,
            "step_seconds_median": statistics.median(seconds),
            "roofline_api": "MaskedLM.forward_batch on a SlotKVCache prefilled to cached_length",
        }


# ------------------------------------------------------------------ summary, targets, report


def summarize_load(runs: list[dict]) -> list[dict]:
    """One row per (arrival, method, concurrency): the median of each figure over the ok passes,
    ratios to the roofline and generate_batch rows of the same arrival and C, agreement with `ar`."""
    keys: dict[tuple, list[dict]] = {}
    for r in runs:
        keys.setdefault((r["arrival"], r["method"], r["concurrency"]), []).append(r)
    ar_tokens = {
        (r["arrival"], r["concurrency"], r["pass"]): [q["tokens"] for q in r["requests"]]
        for r in runs
        if r["method"] == "ar" and r["ok"]
    }
    rows = []
    for (arrival, method, c), rs in keys.items():
        ok = [r for r in rs if r["ok"]]
        row: dict[str, Any] = {
            "arrival": arrival,
            "method": method,
            "kind": rs[0]["kind"],
            "concurrency": c,
            "passes": len(rs),
            "ok_passes": len(ok),
            "errors": sorted({r["error"] for r in rs if r["error"]}),
        }
        for f in (
            "aggregate_tokens_per_second",
            "per_request_tokens_per_second_median",
            "ttft_p50",
            "ttft_p99",
            "itl_p50",
            "itl_p99",
            "kv_bytes_per_request",
            "peak_rss_bytes",
        ):
            row[f] = _median([r.get(f) for r in ok])
        same = [
            a == b
            for r in ok
            if rs[0]["kind"] != "roofline" and (arrival, c, r["pass"]) in ar_tokens
            for a, b in zip((q["tokens"] for q in r["requests"]), ar_tokens[(arrival, c, r["pass"])])
        ]
        row["agree_with_ar"] = sum(same) / len(same) if same else None
        rows.append(row)
    for row in rows:  # the decode-phase rate: C rows each committing a token every ITL p50
        itl = row["itl_p50"]
        row["decode_tokens_per_second"] = row["concurrency"] / itl if itl and BATCH1 not in row["method"] else None
    index = {(r["arrival"], r["method"], r["concurrency"]): r for r in rows}
    for row in rows:
        other = index.get((row["arrival"], ROOFLINE, row["concurrency"]))
        a, b = row["decode_tokens_per_second"], other and other["decode_tokens_per_second"]
        row["decode_ratio_to_roofline"] = a / b if a is not None and b else None
        for name, ref in (("ratio_to_roofline", ROOFLINE), ("ratio_to_generate_batch", HF_CB)):
            other = index.get((row["arrival"], ref, row["concurrency"]))
            a = row["aggregate_tokens_per_second"]
            b = other and other["aggregate_tokens_per_second"]
            row[name] = a / b if a is not None and b else None
    return rows


def load_targets(summary: list[dict]) -> list[dict]:
    """The load suite's targets, each met / missed / not evaluated, with the figures."""
    index = {(r["arrival"], r["method"], r["concurrency"]): r for r in summary}
    out = []
    for c in (8, 16):  # decode phase against the bare step at the same cached length (prefill is not in the roofline)
        row = index.get(("all", "ar", c))
        ratio = row and row["decode_ratio_to_roofline"]
        out.append(
            {
                "target": f"batched ar at C={c} >= 0.8x the roofline, decode phase (all arrivals)",
                "threshold": 0.8,
                "value": ratio,
                "met": None if ratio is None else ratio >= 0.8,
                "detail": "not run"
                if row is None
                else f"ar decodes {_fmt(row['decode_tokens_per_second'])} tok/s (C / ITL p50), roofline "
                f"{_fmt(index.get(('all', ROOFLINE, c), {}).get('decode_tokens_per_second'))} tok/s; aggregate "
                f"with prefill {_fmt(row['aggregate_tokens_per_second'])} tok/s "
                f"({_fmt(row['ratio_to_roofline'], '.2f')}x)",
            }
        )
    ours = [r for r in summary if r["kind"] == "engine" and BATCH1 not in r["method"]]
    for arrival in sorted({r["arrival"] for r in summary}):
        cs = sorted({r["concurrency"] for r in summary if r["arrival"] == arrival and r["concurrency"] >= 4})
        misses, checked, parts = [], 0, []
        for c in cs:
            hf = index.get((arrival, HF_CB, c))
            cand = [
                r
                for r in ours
                if r["arrival"] == arrival and r["concurrency"] == c and r["aggregate_tokens_per_second"] is not None
            ]
            if not hf or hf["aggregate_tokens_per_second"] is None or not cand:
                continue
            best = max(cand, key=lambda r: r["aggregate_tokens_per_second"])
            checked += 1
            ratio = best["aggregate_tokens_per_second"] / hf["aggregate_tokens_per_second"]
            parts.append(f"C={c}: {best['method']} {ratio:.2f}x")
            if ratio < 1.0:
                misses.append(c)
        out.append(
            {
                "target": f"our best batched mode >= generate_batch at every C >= 4 ({arrival} arrivals)",
                "threshold": 1.0,
                "value": None,
                "met": None if not checked else not misses,
                "detail": "; ".join(parts) if parts else "no C >= 4 with both figures",
            }
        )
    out += _auto_targets(index, ours)
    return out


AUTO_TO_BEST, AUTO_TO_AR = 0.97, 1.0  # `auto` against the best fixed mode and against `ar`: never slower


def _auto_targets(index: dict, ours: list[dict]) -> list[dict]:
    """`auto` against the best fixed mode and against `ar`, at every (arrival, C) it ran."""
    out = []
    for arrival, c in sorted({(r["arrival"], r["concurrency"]) for r in ours if r["method"] == "auto"}):
        auto = index[(arrival, "auto", c)]["aggregate_tokens_per_second"]
        fixed = [
            r
            for r in ours
            if r["arrival"] == arrival
            and r["concurrency"] == c
            and r["method"] != "auto"
            and r["aggregate_tokens_per_second"] is not None
        ]
        best = max(fixed, key=lambda r: r["aggregate_tokens_per_second"], default=None)
        ar = index.get((arrival, "ar", c), {}).get("aggregate_tokens_per_second")
        for name, ref, threshold in (
            (f"best fixed mode ({best['method']})" if best else "best fixed mode", best, AUTO_TO_BEST),
            ("ar", ar and {"aggregate_tokens_per_second": ar}, AUTO_TO_AR),
        ):
            ratio = auto / ref["aggregate_tokens_per_second"] if auto is not None and ref else None
            out.append(
                {
                    "target": f"auto >= {threshold}x {name.split(' (')[0]} at C={c} ({arrival} arrivals)",
                    "threshold": threshold,
                    "value": ratio,
                    "met": None if ratio is None else ratio >= threshold,
                    "detail": "not run"
                    if ratio is None
                    else f"auto {auto:.1f} tok/s, {name} {ref['aggregate_tokens_per_second']:.1f} tok/s",
                }
            )
    return out


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f}"


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:.2f}"


def markdown_load(results: dict) -> str:
    """results.md: the setting, one table per arrival pattern (method x concurrency), the targets."""
    meta, summary = results["meta"], results["summary"]
    lines = ["# Load benchmark: throughput under concurrency", ""]
    env = meta.get("environment", {})
    lines += [
        f"- command: `{meta.get('command')}`",
        f"- verifier dtype {meta.get('dtype')}, CPU capability {meta.get('cpu_capability')}, "
        f"{env.get('threads')} threads, {env.get('cpu')}; torch {env.get('torch')}, transformers "
        f"{env.get('transformers')}; commit {env.get('git_commit')}{' (dirty)' if env.get('git_dirty') else ''}",
        f"- {meta.get('max_tokens')} tokens per request (ignore_eos), temperature {meta.get('temperature')}, "
        f"prompts cycled from {meta.get('prompts')} ({meta.get('workload')}), passes {meta.get('passes')}, "
        f"poisson rate {meta.get('rate')} req/s (seed {meta.get('arrival_seed')})",
        "- aggregate tok/s = all tokens / (last finish - first arrival); per-request tok/s = tokens / "
        "(finish - arrival), median; TTFT from arrival; ITL per token (chunk gap / chunk tokens); "
        "KV = RequestStats.kv_bytes, mean per request; RSS = peak resident set during the run",
        "- roofline: one batched decode step of C rows at cached length L = mean prompt + max_tokens/2 through "
        "MaskedLM.forward_batch, tok/s = C / median step; generate_batch: transformers' continuous batching on "
        "the same verifier module"
        + (f" (attention {meta['hf_attn_implementation']})" if meta.get("hf_attn_implementation") else ""),
        "",
    ]
    hf = [r for r in results["runs"] if r["kind"] == "hf_cb" and r["ok"]]
    if hf:
        apis: dict[str, dict[str, set]] = {}
        for r in hf:
            apis.setdefault(r["hf_api"], {}).setdefault(r["arrival"], set()).add(r["concurrency"])
        where = "; ".join(
            f"{api} ({', '.join(f'{a} C=' + ','.join(map(str, sorted(cs))) for a, cs in by.items())})"
            for api, by in apis.items()
        )
        cfg = hf[-1]["hf_cb_config"]
        lines.insert(
            -1,
            f"- generate_batch ran as {where}; greedy, eos_token_id=-1 (fixed length), paged cache sized "
            f"to the run (page_size {cfg['page_size']}, num_blocks = C x pages per request), "
            f"max_batch_tokens = {PREFILL_CHUNK} + C, no prefix sharing; its TTFT / ITL come from its "
            "per-token timestamps",
        )
    cs = sorted({r["concurrency"] for r in summary})
    methods = list(dict.fromkeys(m["label"] for m in results["methods"]))
    for arrival in [a for a in ARRIVALS if any(r["arrival"] == a for r in summary)]:
        lines += [
            f"## Arrivals: {arrival}",
            "",
            "| method | C | agg tok/s | decode tok/s | per-req tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
            "| KV MiB/req | peak RSS MiB | x roofline | decode x roofline | x generate_batch | = ar |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for m in methods:
            for c in cs:
                r = next(
                    (x for x in summary if x["arrival"] == arrival and x["method"] == m and x["concurrency"] == c), None
                )
                if r is None:
                    continue
                if not r["ok_passes"]:
                    lines.append(f"| {m} | {c} | failed: {'; '.join(r['errors'])[:120]} |||||||||||")
                    continue
                lines.append(
                    f"| {m} | {c} | {_fmt(r['aggregate_tokens_per_second'])} | {_fmt(r.get('decode_tokens_per_second'))} | "
                    f"{_fmt(r['per_request_tokens_per_second_median'])} | {_ms(r['ttft_p50'])} / {_ms(r['ttft_p99'])} | "
                    f"{_ms(r['itl_p50'])} / {_ms(r['itl_p99'])} | {_mib(r['kv_bytes_per_request'])} | "
                    f"{_fmt(r['peak_rss_bytes'] and r['peak_rss_bytes'] / 2**20, '.0f')} | {_fmt(r['ratio_to_roofline'], '.2f')} | "
                    f"{_fmt(r.get('decode_ratio_to_roofline'), '.2f')} | "
                    f"{_fmt(r['ratio_to_generate_batch'], '.2f')} | {_fmt(r['agree_with_ar'], '.2f')} |"
                )
        lines.append("")
    lines += ["## Targets", ""]
    for t in results["targets"]:
        state = {True: "met", False: "MISSED", None: "not evaluated"}[t["met"]]
        value = "" if t["value"] is None else f" ({t['value']:.2f}x)"
        lines.append(f"- {t['target']}: **{state}**{value}: {t['detail']}")
    lines += [
        "",
        "decode tok/s = C / ITL p50: the rate while every request decodes (prefill excluded, as in the "
        "roofline); `= ar`: share of requests whose tokens equal batched `ar`'s (bf16: a batch changes the "
        "rounding of every matmul, so greedy ties can part; exactness is proven in float64).",
        "",
        "Batch-1 rows (`@batch1`) are for reference: the same requests queue and run one at a time.",
        "",
    ]
    return "\n".join(lines)


def plot_load(results: dict, out: Path) -> str:
    """load_throughput.png: aggregate tokens/s against concurrency, one line per method, one panel per arrival."""
    from viasd.bench.plots import _setup

    plt = _setup()
    summary = results["summary"]
    arrivals = [a for a in ARRIVALS if any(r["arrival"] == a for r in summary)]
    fig, axes = plt.subplots(1, len(arrivals), figsize=(6.5 * len(arrivals), 4.5), squeeze=False)
    for ax, arrival in zip(axes[0], arrivals):
        for m in dict.fromkeys(x["label"] for x in results["methods"]):
            pts = sorted(
                (r["concurrency"], r["aggregate_tokens_per_second"])
                for r in summary
                if r["arrival"] == arrival and r["method"] == m and r["aggregate_tokens_per_second"] is not None
            )
            if pts:
                style = {"ls": "--", "color": "black"} if m == ROOFLINE else {"ls": ":"} if BATCH1 in m else {}
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m, **style)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["concurrency"] for r in summary}))
        ax.get_xaxis().set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrency C (requests)")
        ax.set_ylabel("aggregate tokens/s")
        ax.set_title(f"{arrival} arrivals")
        ax.legend(fontsize=8)
    fig.suptitle(
        f"Throughput under load ({results['meta'].get('dtype')}, {results['meta'].get('max_tokens')} tokens/request)"
    )
    fig.tight_layout()
    name = "load_throughput.png"
    fig.savefig(Path(out) / name, dpi=110)
    plt.close(fig)
    return name


def write_load_outputs(results: dict, out: str | Path, *, plots: bool = True) -> list[str]:
    """results.json, results.md and load_throughput.png into `out`; returns the file names."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = ["results.json", "results.md"]
    md = markdown_load(results)
    if plots:
        try:
            png = plot_load(results, out)
            files.append(png)
            md += f"\n![{png}]({png})\n"
        except Exception as exc:  # a plot is not worth the numbers: say so and keep them
            results["meta"]["plot_error"] = f"{type(exc).__name__}: {exc}"
            md += f"\nPlot failed: {results['meta']['plot_error']}\n"
    write_results(out, results, md)
    return files


# ------------------------------------------------------------------ the entry points


def _as_bench(obj) -> Bench:
    if isinstance(obj, Bench):
        return obj
    if isinstance(obj, MaskedLM):
        return Bench(obj)
    if isinstance(obj, (tuple, list)):
        return Bench(*obj)
    if hasattr(obj, "engine") and hasattr(obj, "verifier"):  # viasd.llm.LLM
        return Bench.from_llm(obj)
    raise InvalidParameterError(
        "bench", f"expected a Bench, (verifier, drafter) MaskedLMs or an LLM, got {type(obj).__name__}"
    )


def run_load(
    bench_or_models,
    concurrency: Sequence[int] = DEFAULT_CONCURRENCY,
    methods: str | Sequence[str] | None = None,
    *,
    prompts: Sequence[Prompt | Sequence[int]] | None = None,
    base: GenerationParams | None = None,
    max_tokens: int | None = None,
    arrivals: Sequence[str] = ARRIVALS,
    rate: float = 1.0,
    arrival_seed: int = 0,
    passes: int = 1,
    warmup: bool = True,
    out: str | Path | None = None,
    plots: bool = True,
    meta: dict | None = None,
    progress: bool | Callable[[dict], Any] = False,
) -> dict:
    """Run the load suite (module docstring) and return the results; write them to `out` when given.

    `bench_or_models`: a `Bench`, (verifier, drafter) MaskedLMs, or a `viasd.llm.LLM`. `prompts`:
    `Prompt`s or token-id lists (default: 5 HumanEval prompts, which needs the bench's tokenizer).
    `base`: the request parameters (default greedy); `max_tokens` overrides its max_tokens.
    Returns {"meta", "methods", "runs" (every run with its per-request records), "summary", "targets"}.
    A method that raises is recorded (error, traceback) and the sweep goes on.
    """
    from viasd.bench import environment

    bench = _as_bench(bench_or_models)
    base = base or parse_params({"max_tokens": 128, "ignore_eos": True})
    base = base.model_copy(update={"ignore_eos": True, **({"max_tokens": max_tokens} if max_tokens else {})})
    concurrency = sorted({int(c) for c in concurrency})
    if not concurrency or concurrency[0] < 1:
        raise InvalidParameterError("concurrency", f"must be positive integers, got {concurrency}")
    for a in arrivals:
        arrival_times(1, a, rate, arrival_seed)  # validate before running
    table = parse_load_methods(methods, base)
    default_prompts = prompts is None
    if default_prompts:
        from viasd.bench.workloads import humaneval

        prompts = humaneval(5)
    prompts = [p if isinstance(p, Prompt) else Prompt(f"p{i}", ids=list(p)) for i, p in enumerate(prompts)]
    encoded = [(p.id, bench.encode(p)) for p in prompts]
    gamma = max([m.method.params.gamma for m in table if m.method is not None] + [1])
    max_seq_len = max(len(ids) for _, ids in encoded) + base.max_tokens + gamma + 2
    loads = LoadBench(bench, max_batch=max(concurrency), max_seq_len=max_seq_len)
    report = (
        progress
        if callable(progress)
        else (
            (
                lambda r: print(
                    f"[load] {r['arrival']:7s} C={r['concurrency']:<3d} {r['method']:18s} "
                    + (f"{_fmt(r['aggregate_tokens_per_second'])} tok/s" if r["ok"] else f"FAILED {r['error']}"),
                    file=sys.stderr,
                    flush=True,
                )
            )
            if progress
            else None
        )
    )

    def one(lm: LoadMethod, arrival: str, c: int, p: int, params: GenerationParams) -> dict:
        reqs = [encoded[i % len(encoded)] for i in range(c)]
        times = arrival_times(c, arrival, rate, arrival_seed + c)  # one Poisson draw per C, the same for every method
        rec = {
            "method": lm.label,
            "kind": lm.kind,
            "arrival": arrival,
            "concurrency": c,
            "pass": p,
            "ok": False,
            "error": None,
        }
        try:
            rec.update(loads.run(lm, reqs, times, params))
            bad = [
                q["index"]
                for q in rec["requests"]
                if lm.kind != "roofline" and q["generated_tokens"] != params.max_tokens
            ]
            if bad:
                raise RuntimeError(f"requests {bad} did not generate exactly {params.max_tokens} tokens")
            rec["ok"] = True
        except Exception as exc:  # a crashing method is reported, never hidden
            rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["traceback"] = traceback.format_exc(limit=8)
            rec.setdefault("requests", [])
        return rec

    try:
        if warmup:  # one short untimed run per method: allocations and kernel selection out of the timed runs
            wparams = base.model_copy(update={"max_tokens": min(4, base.max_tokens)})
            for lm in table:
                with contextlib.suppress(Exception):
                    loads.run(lm, [encoded[0]] * concurrency[0], [0.0] * concurrency[0], wparams)
        runs: list[dict] = []
        t_start = time.perf_counter()
        for p in range(passes):
            for arrival in arrivals:
                for ci, c in enumerate(concurrency):
                    shift = (p + ci) % len(table)
                    for lm in table[shift:] + table[:shift]:
                        rec = one(lm, arrival, c, p, base)
                        runs.append(rec)
                        if report:
                            report(rec)
        sweep_seconds = time.perf_counter() - t_start
    finally:
        loads.close()
    hf_attn = next((r.get("hf_attn_implementation") for r in runs if r.get("hf_attn_implementation")), None)
    results = {
        "meta": {
            **(meta or {}),
            "suite": "load",
            "concurrency": concurrency,
            "arrivals": list(arrivals),
            "rate": rate,
            "arrival_seed": arrival_seed,
            "passes": passes,
            "max_tokens": base.max_tokens,
            "temperature": base.temperature,
            "params": base.model_dump(mode="json"),
            "prompts": len(prompts),
            "workload": (meta or {}).get("workload") or ("humaneval" if default_prompts else "given prompts"),
            "prompt_tokens": [len(ids) for _, ids in encoded],
            "dtype": str(bench.verifier.dtype).removeprefix("torch."),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "max_batch": max(concurrency),
            "max_seq_len": max_seq_len,
            "prefill_chunk": PREFILL_CHUNK,
            "hf_attn_implementation": hf_attn,
            "sweep_seconds": sweep_seconds,
            "environment": (meta or {}).get("environment") or environment(str(bench.verifier.device)),
        },
        "methods": [m.describe() for m in table],
        "runs": runs,
    }
    results["meta"].setdefault("command", shlex.join([Path(sys.executable).name, *sys.argv]))
    results["summary"] = summarize_load(runs)
    results["targets"] = load_targets(results["summary"])
    if out is not None:
        write_load_outputs(results, out, plots=plots)
    return results


def run_load_bench(args, config, params: GenerationParams) -> int:
    """`viasd bench --suite load`: load the pair once, run the sweep, write the outputs.

    Exit status 0, or 1 when any run of any method failed (the outputs are written either way)."""
    from viasd.bench import environment
    from viasd.bench.workloads import load_workload
    from viasd.llm import LLM

    concurrency = concurrency_levels(args.concurrency)
    arrivals = [a.strip() for a in str(args.arrival).split(",") if a.strip()]
    parse_load_methods(args.methods, params)  # validate before loading models
    for a in arrivals:
        arrival_times(1, a, args.rate, args.arrival_seed)
    prompts = load_workload(getattr(args, "workload", "humaneval"), args.prompts, getattr(args, "prompt_offset", 0))
    t0 = time.perf_counter()
    llm = LLM(config, mask=args.mask)
    load_seconds = time.perf_counter() - t0
    bench = Bench.from_llm(llm)
    print(
        f"loaded in {load_seconds:.1f}s; mask {llm.engine.mask} ({bench.default_mask_source}); "
        f"concurrency {concurrency}, arrivals {arrivals}",
        file=sys.stderr,
    )
    meta = {
        "command": getattr(args, "command_line", None) or shlex.join([Path(sys.executable).name, *sys.argv]),
        "argv": sys.argv,
        "engine": config.model_dump(mode="json"),
        "device": str(llm.verifier.device),
        "runtime": llm.runtime_info(),  # the dtype `auto` chose and why, CPU capability, kernels
        "default_mask": {"skipped_layers": list(llm.engine.mask.skipped), "source": bench.default_mask_source},
        "workload": getattr(args, "workload", "humaneval"),
        "load_seconds": load_seconds,
        "environment": environment(str(llm.verifier.device)),
    }
    results = run_load(
        bench,
        concurrency,
        args.methods,
        prompts=prompts,
        base=params,
        arrivals=arrivals,
        rate=args.rate,
        arrival_seed=args.arrival_seed,
        passes=args.passes,
        warmup=args.warmup_tokens > 0,
        out=args.out,
        plots=not args.no_plots,
        meta=meta,
        progress=not args.no_progress,
    )
    print(markdown_load(results))
    print(
        f"wrote {args.out}/results.json, results.md" + ("" if args.no_plots else " and load_throughput.png"),
        file=sys.stderr,
    )
    return 1 if any(not r["ok"] for r in results["runs"]) else 0
