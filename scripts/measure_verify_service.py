#!/usr/bin/env python
"""Where a served verify step's time goes, without Ray: the verifier service's own code against
its batched forward, and what a busy neighbour process does to that forward.

Loads the embedded verifier (`ar`, no drafter) with `viasd.llm.LLM` and serves it in this process
with the actors' `VerifierCore` and `VerifierServicer` over gRPC on 127.0.0.1 (what a verifier
rank runs, minus Ray). For each row count it opens that many `ar` sessions (HumanEval prompts)
and times `--steps` Verify calls of all of them (one batched forward each), under two
conditions, alternating step by step:

* `alone`: nothing else running;
* `neighbour`: another process busy `--duty` of the time on one core, in bursts of 2 ms (what the
  serving processes around the actors, Serve's proxy and replica, Ray's daemons and the client,
  kept busy under load: 0.1-0.2 of the two cores, docs/SERVING.md).

Reports per (rows, condition) the medians of the Verify call as the client saw it and of the
batched forward inside it (`MaskedLM.forward_batch`), the service's own part being their difference.

    flock /tmp/viasd-heavy.lock python scripts/measure_verify_service.py [--dtype auto] [--rows 1,8]

Writes ``docs/benchmarks/cpu/verify-service/verify-service-<dtype>-<label>.json``
(``verify-service-<dtype>-omp-<policy>-<label>.json`` with ``OMP_WAIT_POLICY`` set, recorded).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks" / "cpu" / "verify-service"
WARMUP = 4  # steps per (rows, condition) left out of the medians


def neighbour(duty: float, active, stop) -> None:
    """While `active` is set, busy `duty` of the time in bursts of 2 ms; idle otherwise; returns
    once `stop` is set."""
    busy = 0.002
    while not stop.is_set():
        if not active.wait(0.1):
            continue
        t = time.perf_counter()
        while time.perf_counter() - t < busy:
            pass
        time.sleep(busy * (1 - duty) / duty)


async def measure(llm, prompts: list[list[int]], rows: int, steps: int, duty: float) -> dict:
    import grpc

    from viasd.actors.rpc import start_server
    from viasd.actors.verifier import VerifierCore, VerifierServicer
    from viasd.config import parse_params
    from viasd.v1 import internal_pb2 as ipb
    from viasd.v1 import internal_pb2_grpc
    from viasd.v1.convert import params_to_proto

    forwards: list[float] = []
    forward_batch = llm.verifier.forward_batch

    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = forward_batch(*args, **kwargs)
        forwards.append(time.perf_counter() - t)
        return out

    core = VerifierCore(llm.verifier, llm.engine.mask, "separate")
    servicer = VerifierServicer(core)
    server, port = await start_server(lambda s: internal_pb2_grpc.add_VerifierServiceServicer_to_server(servicer, s))
    ctx = multiprocessing.get_context("spawn")
    active, stop = ctx.Event(), ctx.Event()
    side = ctx.Process(target=neighbour, args=(duty, active, stop), daemon=True)
    side.start()  # (started once: its interpreter's start-up stays out of the steps)
    figures: dict[str, dict[str, list[float]]] = {c: {"verify": [], "forward": []} for c in ("alone", "neighbour")}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = internal_pb2_grpc.VerifierServiceStub(channel)
            params = params_to_proto(parse_params(mode="ar", max_tokens=2 * steps + 8, ignore_eos=True))
            ids = [f"r{i}" for i in range(rows)]
            await asyncio.gather(
                *(
                    stub.Open(
                        ipb.OpenRequest(request_id=rid, prompt_token_ids=prompts[i % len(prompts)], params=params)
                    )
                    for i, rid in enumerate(ids)
                )
            )
            request = ipb.VerifyRequest(rows=[ipb.VerifyRequest(request_id=rid) for rid in ids])
            llm.verifier.forward_batch = timed
            await asyncio.sleep(2.0)  # (the neighbour's interpreter has started)
            for step in range(2 * steps):
                condition = ("alone", "neighbour")[step % 2]
                if condition == "neighbour":
                    active.set()
                    await asyncio.sleep(0.05)  # (busy before the step starts)
                forwards.clear()
                t = time.perf_counter()
                await stub.Verify(request, timeout=120)
                wall = time.perf_counter() - t
                active.clear()
                if step // 2 >= WARMUP:
                    figures[condition]["verify"].append(wall)
                    figures[condition]["forward"].append(sum(forwards))
            for rid in ids:
                await stub.Close(ipb.CloseRequest(request_id=rid))
    finally:
        stop.set()
        side.join()
        del llm.verifier.forward_batch
        await server.stop(None)
    out = {}
    for condition, f in figures.items():
        verify, forward = statistics.median(f["verify"]), statistics.median(f["forward"])
        out[condition] = {
            "verify_s": verify,
            "forward_s": forward,
            "service_s": verify - forward,
            "steps": len(f["verify"]),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rows", default="1,8", help="sessions verified together, comma-separated")
    ap.add_argument("--steps", type=int, default=20, help="Verify calls per (rows, condition), after 4 warm-up ones")
    ap.add_argument("--duty", type=float, default=0.1, help="share of the time the neighbour process is busy")
    args = ap.parse_args()

    from viasd.bench import provenance, write_raw
    from viasd.bench.workloads import load_workload
    from viasd.config import parse_engine_config
    from viasd.llm import LLM

    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    config = parse_engine_config(
        verifier="qwen2.5-coder-1.5b-instruct", drafter=None, dtype=args.dtype, max_batch=max(rows)
    )
    llm = LLM(config)
    prompts = [llm.encode(p.text) for p in load_workload("humaneval", max(rows), 0)]
    wait_policy = os.environ.get("OMP_WAIT_POLICY", "")  # libgomp: PASSIVE parks waiting threads
    record = {**provenance(), "runtime": llm.runtime_info(), "duty": args.duty, "omp_wait_policy": wait_policy}
    record["results"] = []
    for r in rows:
        figures = asyncio.run(measure(llm, prompts, r, args.steps + WARMUP, args.duty))
        record["results"].append({"rows": r, **figures})
        print(
            r, {c: {k: round(v * 1e3, 1) for k, v in f.items() if k != "steps"} for c, f in figures.items()}, flush=True
        )
    stem = f"verify-service-{llm.runtime_info()['dtype']}" + (f"-omp-{wait_policy.lower()}" if wait_policy else "")
    path = write_raw(OUT, stem, record)
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
