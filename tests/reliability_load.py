"""Load, cancellation and loss check of the served pipeline on tiny models, over loopback gRPC: the
long version of tests/integration/test_reliability.py's load test (a helper module of the tests,
and a command; pytest does not collect it).

    flock /tmp/viasd-heavy.lock .venv/bin/python tests/reliability_load.py --streams 32 --duration 90 \
        --cancel-cycles 100 --out load.json

Starts a local Ray, one pipeline (drafter actor + verifier actor, the tiny float32 LLaMA pair of
tests/conftest.py saved to a temporary directory), the public GenerationService on a free
loopback port (admission: `--max-concurrent` decoding, the rest queued), then:

* load: `--streams` concurrent client streams for `--duration` seconds; each stream runs request
  after request from a fixed set of cases (ar / sd / via, greedy and sampled with a seed, four
  prompts); every response stream is compared with the in-process run of the same request
  (`viasd.llm.LLM`, same config), so a lost, duplicated, reordered or foreign token is a
  mismatch. Records request latency (p50 / p99 of time to first token and of the whole
  request), tokens/s, and the resident memory of the server process and of each actor every
  second;
* faults: `--faults drafter@20,verifier@50` kills (SIGKILL) the drafter / verifier rank 0 (`rank1`: a
  follower rank, with `--tp 2`) at
  those seconds of the load, with the pipeline supervised as in the standalone server. A request
  the drafter's death turned into `ar` (stats `drafter_fallback`) is checked for length and
  vocabulary only (its tokens legitimately differ from the reference after the switch); one in
  flight on the dead verifier must fail with UNAVAILABLE (clients back off 0.2 s and go on);
  every other request must equal its reference. Records when each rebuild was done;
* cancellation: `--cancel-cycles` requests started and cancelled (before any token, or after
  one or two responses); then the coordinator's live requests, the actors' sessions and the
  servicer's calls must be 0, and RSS is compared with its level before the cycles.

Prints a summary and writes every figure to `--out` (JSON). Exit status 1 if any request was
lost or wrong, or anything was left open. The test suite runs the same `run_load` with 8 streams
(tests/integration/test_reliability.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PROMPTS = [[5, 17, 3, 88, 41, 9], [60] * 12, [7, 8, 9, 10, 11], [30, 31, 40, 41, 50, 51, 60]]
VIA = dict(mode="via", gamma=4, alpha1=0.9, alpha2=0.7)
SETTINGS = [
    dict(mode="ar"),
    dict(mode="sd", gamma=4),
    dict(VIA),
    dict(mode="ar", temperature=1.0, seed=11),
    dict(mode="sd", gamma=3, temperature=0.8, top_k=40, seed=12),
    dict(VIA, temperature=1.0, seed=13),
]


def cases(max_tokens: int) -> list[tuple[list[int], dict]]:
    """Every (prompt, parameters) the load cycles through: 4 prompts x 6 settings."""
    return [(p, {**s, "max_tokens": max_tokens, "ignore_eos": True}) for p in PROMPTS for s in SETTINGS]


def references(llm, case_list) -> list[list[int]]:
    """The in-process output of every case: what each served stream must equal."""
    from viasd.config import parse_params

    return [llm.complete(prompt, parse_params(params)).token_ids for prompt, params in case_list]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


@dataclass
class LoadResult:
    streams: int
    duration_s: float
    requests: int = 0
    tokens: int = 0
    mismatched: int = 0  # a stream whose tokens differ from its reference (lost / duplicated / reordered / foreign)
    fallbacks: int = 0  # finished as `ar` after the drafter died (length and vocabulary checked)
    faults: list = field(default_factory=list)  # [second, what happened]
    errors: dict = field(default_factory=dict)  # gRPC status name -> count
    e2e_s: list = field(default_factory=list)
    ttft_s: list = field(default_factory=list)
    rss_mb: list = field(default_factory=list)  # [seconds since start, {process: MB}]
    examples: list = field(default_factory=list)  # the first mismatches, for debugging
    error_examples: list = field(default_factory=list)  # [second, request, status, details] of the first errors

    def summary(self) -> dict:
        rss_total = [sum(s.values()) for _, s in self.rss_mb]
        return {
            "streams": self.streams,
            "seconds": round(self.duration_s, 1),
            "requests": self.requests,
            "tokens": self.tokens,
            "mismatched": self.mismatched,
            "errors": self.errors,
            "drafter_fallbacks": self.fallbacks,
            "faults": self.faults,
            "tokens_per_s": round(self.tokens / self.duration_s, 1) if self.duration_s else None,
            "requests_per_s": round(self.requests / self.duration_s, 2) if self.duration_s else None,
            "ttft_p50_s": _r(percentile(self.ttft_s, 50)),
            "ttft_p99_s": _r(percentile(self.ttft_s, 99)),
            "e2e_p50_s": _r(percentile(self.e2e_s, 50)),
            "e2e_p99_s": _r(percentile(self.e2e_s, 99)),
            "rss_total_mb_first": _r(rss_total[0] if rss_total else None, 1),
            "rss_total_mb_max": _r(max(rss_total) if rss_total else None, 1),
            "rss_total_mb_last": _r(rss_total[-1] if rss_total else None, 1),
        }


def _r(x, digits: int = 3):
    return None if x is None else round(x, digits)


async def sample_rss(pids, out: list, every_s: float = 1.0) -> None:
    """Every `every_s`: RSS (MB) of each process of `pids` (a dict name -> pid, or a callable giving one)."""
    import psutil

    t0 = time.monotonic()
    while True:
        sample = {}
        for name, pid in (pids() if callable(pids) else pids).items():
            try:
                sample[name] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
            except psutil.NoSuchProcess:
                sample[name] = 0.0
        out.append([round(time.monotonic() - t0, 1), sample])
        await asyncio.sleep(every_s)


async def run_load(
    stub,
    case_list,
    refs,
    *,
    streams: int,
    duration_s: float | None = None,
    requests_per_stream: int | None = None,
    pids=None,
    faults: list[tuple[float, str]] = (),
    pipeline=None,
) -> LoadResult:
    """`streams` concurrent clients, each running cases one after another until `duration_s` has
    passed (or `requests_per_stream` are done); every stream is checked against its reference."""
    import grpc

    from viasd.config import parse_params
    from viasd.v1 import generation_pb2 as pb
    from viasd.v1.convert import params_to_proto

    result = LoadResult(streams, 0.0)
    t0 = time.monotonic()
    deadline = t0 + duration_s if duration_s else None

    async def client(i: int) -> None:
        n = 0
        while (requests_per_stream is None or n < requests_per_stream) and (
            deadline is None or time.monotonic() < deadline
        ):
            k = (i + n * streams) % len(case_list)
            prompt, params = case_list[k]
            rid = f"load-{i}-{n}"
            req = pb.GenerateRequest(
                request_id=rid, prompt_token_ids=pb.TokenIds(ids=prompt), params=params_to_proto(parse_params(params))
            )
            start = time.monotonic()
            first = last = None
            tokens: list[int] = []
            try:
                async for r in stub.Generate(req, timeout=300):
                    if first is None:
                        first = time.monotonic() - start
                    if r.request_id != rid:
                        raise AssertionError(f"response of {r.request_id!r} on the stream of {rid!r}")
                    tokens.extend(r.token_ids)
                    last = r
            except grpc.aio.AioRpcError as exc:
                result.errors[exc.code().name] = result.errors.get(exc.code().name, 0) + 1
                if len(result.error_examples) < 8:
                    result.error_examples.append([round(time.monotonic() - t0, 1), rid, exc.code().name, exc.details()])
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    await asyncio.sleep(0.2)
            else:
                result.requests += 1
                result.tokens += len(tokens)
                result.e2e_s.append(time.monotonic() - start)
                result.ttft_s.append(first if first is not None else float("nan"))
                if last is not None and last.stats.drafter_fallback:
                    result.fallbacks += 1
                    if len(tokens) != len(refs[k]) or not all(0 <= t < 96 for t in tokens):
                        result.mismatched += 1
                elif tokens != refs[k]:
                    result.mismatched += 1
                    if len(result.examples) < 5:
                        result.examples.append({"request": rid, "case": k, "got": tokens, "want": refs[k]})
            n += 1

    async def inject() -> None:
        import signal

        for at, what in sorted(faults):
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            # "drafter", "verifier" (rank 0) or "rank1", "rank2", ... (a follower rank of a TP group)
            pid = (
                pipeline.drafter_info["pid"]
                if what == "drafter"
                else pipeline.verifier_info["rank_pids"][
                    int(what.removeprefix("rank")) if what.startswith("rank") else 0
                ]
            )
            before = dict(pipeline.rebuilds)
            os.kill(pid, signal.SIGKILL)
            result.faults.append([round(time.monotonic() - t0, 1), f"killed the {what} (pid {pid})"])
            while pipeline.rebuilds == before:
                await asyncio.sleep(0.1)
            component = "drafter" if what == "drafter" else "verifier"
            result.faults.append(
                [
                    round(time.monotonic() - t0, 1),
                    f"{component} rebuilt, now pids "
                    f"{pipeline.drafter_info['pid'] if what == 'drafter' else pipeline.verifier_info['rank_pids']}",
                ]
            )

    sampler = asyncio.ensure_future(sample_rss(pids, result.rss_mb)) if pids else None
    injector = asyncio.ensure_future(inject()) if faults else None
    try:
        await asyncio.gather(*(client(i) for i in range(streams)))
        if injector is not None:
            await asyncio.wait_for(injector, 300)
    finally:
        for task in (sampler, injector):
            if task is not None:
                task.cancel()
    result.duration_s = time.monotonic() - t0
    return result


async def cancel_cycles(stub, n: int, *, long_tokens: int = 400) -> list[int]:
    """Start n long sampled requests one after another and cancel each (before any token, or after
    one or two responses); returns how many responses each read before it was cancelled."""
    from viasd.config import parse_params
    from viasd.v1 import generation_pb2 as pb
    from viasd.v1.convert import params_to_proto

    read = []
    for i in range(n):
        params = parse_params(
            mode=("sd", "via", "ar")[i % 3], max_tokens=long_tokens, ignore_eos=True, temperature=1.0, seed=i
        )
        call = stub.Generate(
            pb.GenerateRequest(
                request_id=f"cancel-{i}",
                prompt_token_ids=pb.TokenIds(ids=PROMPTS[i % len(PROMPTS)]),
                params=params_to_proto(params),
            ),
            timeout=300,
        )
        for _ in range(i % 3):
            await call.read()
        call.cancel()
        read.append(i % 3)
    return read


def tiny_models(root: Path):
    """The test suite's tiny float32 LLaMA pair (tests/conftest.py), saved under root."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import save_tiny_pair

    return save_tiny_pair(root)


async def idle(pipeline, servicer, timeout_s: float = 60.0) -> dict:
    """Wait until nothing is open anywhere; return the counts as found."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = {
            "coordinator": pipeline.coordinator.active_requests(),
            "servicer": servicer.in_flight(),
            **await pipeline.session_counts(),
        }
        if (counts["coordinator"], counts["servicer"], counts["drafter"], sum(counts["verifier"])) == (
            0,
            0,
            0,
            0,
        ) or time.monotonic() > deadline:
            return counts
        await asyncio.sleep(0.2)


async def main_async(args) -> int:
    import gc

    import grpc
    import psutil
    import ray

    from viasd.cluster.grpc_api import GenerationServicer
    from viasd.cluster.handler import Admission
    from viasd.cluster.pipeline import Pipeline, PipelineConfig
    from viasd.cluster.standalone import serve_grpc
    from viasd.llm import LLM
    from viasd.v1 import generation_pb2_grpc

    report: dict = {"command": " ".join(sys.argv), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        engine = tiny_models(Path(tmp))
        case_list = cases(args.max_tokens)
        t = time.monotonic()
        refs = references(LLM(engine), case_list)
        print(f"{len(case_list)} cases, references computed in-process in {time.monotonic() - t:.1f}s", flush=True)
        ray.init(
            address="local", num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False
        )
        pipeline = await Pipeline.start(
            PipelineConfig(
                name="tiny",
                engine=engine,
                drafter_cpus=0.5,
                verifier_cpus_per_rank=0.5,
                rpc_timeout_s=60,
                tp_size=args.tp,
            )
        )
        servicer = GenerationServicer(
            {"tiny": pipeline}, "tiny", admission=Admission(args.max_concurrent, args.max_queued)
        )
        server = await serve_grpc(servicer, 0)
        supervisor = asyncio.ensure_future(pipeline.supervise()) if args.faults else None
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.viasd_port}")
        stub = generation_pb2_grpc.GenerationServiceStub(channel)

        def pids() -> dict[str, int]:  # the current actors (a fault replaces them)
            return {
                "server+coordinator+client": os.getpid(),
                "drafter": pipeline.drafter_info["pid"],
                **{f"verifier rank {r}": p for r, p in enumerate(pipeline.verifier_info["rank_pids"])},
            }

        ok = True
        try:
            await run_load(stub, case_list, refs, streams=min(4, args.streams), requests_per_stream=1)  # warm-up
            if args.duration > 0:
                print(f"load: {args.streams} streams for {args.duration:.0f}s ...", flush=True)
                faults = (
                    [(float(at), what) for what, _, at in (f.partition("@") for f in args.faults.split(",")) if what]
                    if args.faults
                    else []
                )
                load = await run_load(
                    stub,
                    case_list,
                    refs,
                    streams=args.streams,
                    duration_s=args.duration,
                    pids=pids,
                    faults=faults,
                    pipeline=pipeline,
                )
                summary = load.summary()
                report["load"] = {
                    "summary": summary,
                    "rss_mb": load.rss_mb,
                    "e2e_s": load.e2e_s,
                    "ttft_s": load.ttft_s,
                    "mismatch_examples": load.examples,
                    "error_examples": load.error_examples,
                }
                report["load"]["idle_after"] = await idle(pipeline, servicer)
                print(json.dumps(summary), flush=True)
                for example in load.error_examples:
                    print("error:", example, flush=True)
                print("after the load:", report["load"]["idle_after"], flush=True)
                allowed = {"UNAVAILABLE"} if any(w != "drafter" for _, w in faults) else set()
                ok &= load.mismatched == 0 and set(load.errors) <= allowed and _all_zero(report["load"]["idle_after"])
            if args.cancel_cycles > 0:
                await cancel_cycles(stub, 6)  # warm-up
                await idle(pipeline, servicer)
                gc.collect()
                before = {k: psutil.Process(p).memory_info().rss / 2**20 for k, p in pids().items()}
                t = time.monotonic()
                read = await cancel_cycles(stub, args.cancel_cycles)
                counts = await idle(pipeline, servicer)
                gc.collect()
                after = {k: psutil.Process(p).memory_info().rss / 2**20 for k, p in pids().items()}
                report["cancel"] = {
                    "cycles": args.cancel_cycles,
                    "seconds": round(time.monotonic() - t, 1),
                    "cancelled_before_first_token": read.count(0),
                    "cancelled_mid_stream": len(read) - read.count(0),
                    "counts_after": counts,
                    "rss_mb_before": _rounded(before),
                    "rss_mb_after": _rounded(after),
                    "rss_mb_delta_total": round(sum(after.values()) - sum(before.values()), 1),
                }
                print("cancel:", json.dumps(report["cancel"]), flush=True)
                ok &= _all_zero(counts)
        finally:
            if supervisor is not None:
                supervisor.cancel()
            await channel.close()
            await server.stop(grace=1)
            await pipeline.shutdown()
            ray.shutdown()
    report["ok"] = ok
    if args.out:
        from viasd.bench import provenance

        Path(args.out).write_text(json.dumps({**report, **provenance()}, indent=1))
    print("OK" if ok else "FAILED: requests lost or wrong, or something left open", flush=True)
    return 0 if ok else 1


def _all_zero(counts: dict) -> bool:
    return counts["coordinator"] == counts["servicer"] == counts["drafter"] == 0 and not any(counts["verifier"])


def _rounded(d: dict) -> dict:
    return {k: round(v, 1) for k, v in d.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=32, help="concurrent client streams")
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of load (0: skip the load phase)")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    ap.add_argument("--max-concurrent", type=int, default=8, help="requests the server decodes at once")
    ap.add_argument(
        "--max-queued", type=int, default=64, help="requests the server queues (past it: RESOURCE_EXHAUSTED)"
    )
    ap.add_argument("--cancel-cycles", type=int, default=100, help="cancel cycles after the load (0: skip)")
    ap.add_argument(
        "--faults",
        default="",
        help="e.g. drafter@20,verifier@50 (rank 0), rank1@70 (with --tp 2): SIGKILL that process then",
    )
    ap.add_argument("--tp", type=int, default=1, help="verifier tensor-parallel ranks")
    ap.add_argument("--out", help="write every figure to this JSON file")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
