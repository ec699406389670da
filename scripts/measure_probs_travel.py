"""What draft probabilities cost on the wire, per route and encoding (issue 16, "Lockstep per step").

A sampled cycle ships p [k, V] for its k draft tokens. Routes:

* `via coordinator` (before this change): drafter -> coordinator -> verifier rank 0 -> ranks 1..N-1
  (two gRPC hops, then one Ray hop per follower);
* `direct`: drafter -> verifier rank 0 -> followers (one gRPC hop less);

and encodings (viasd.actors.rpc.encode_probs): `dense` float32 (exact), `bfloat16` (half,
lossy), `sparse` (the nonzero values + their columns: exact; small only where top-k / top-p /
min-p leave p exactly 0). p comes from the real drafter on HumanEval-style prompts (the logits
of every prompt position), cut into blocks of k rows and passed through the request's sampler.
Per block: bytes, encode + serialise + parse + decode seconds, and the wall time of one loopback
gRPC hop carrying it (a unary echo of a VerifyBatch with that p: serialisation, transport,
parsing; the median of --repeats).

    flock /tmp/viasd-heavy.lock .venv/bin/python scripts/measure_probs_travel.py \
        --model qwen2.5-coder-0.5b-instruct --out docs/benchmarks/probs-travel-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    'def merge_sorted(a: list, b: list) -> list:\n    """Merge two sorted lists into one sorted list."""\n',
    'def parse_csv_line(line: str) -> list[str]:\n    """Split one CSV line into fields."""\n',
]
SETTINGS = {  # the sampling parameters of a request -> how much of p is nonzero
    "T=1.0": dict(temperature=1.0),
    "T=0.7,top_p=0.95": dict(temperature=0.7, top_p=0.95),
    "T=0.7,top_k=40": dict(temperature=0.7, top_k=40),
}


async def hop_seconds(messages: list, repeats: int) -> float:
    """Median wall time of one loopback gRPC unary call carrying each message (an echo of its size)."""
    import grpc

    from viasd.actors.rpc import GRPC_OPTIONS, start_server
    from viasd.v1 import internal_pb2 as ipb
    from viasd.v1 import internal_pb2_grpc

    class Echo(internal_pb2_grpc.VerifierServiceServicer):
        async def Verify(self, request, context):
            return ipb.VerifyReply(rows=[ipb.Verdict(request_id=r.request_id) for r in request.rows])

    server, port = await start_server(lambda s: internal_pb2_grpc.add_VerifierServiceServicer_to_server(Echo(), s))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
            stub = internal_pb2_grpc.VerifierServiceStub(channel)
            times = []
            for _ in range(repeats):
                for msg in messages:
                    t0 = time.perf_counter()
                    await stub.Verify(
                        ipb.VerifyBatch(rows=[ipb.VerifyRow(request_id="r", draft=[1] * msg.rows, probs=msg)])
                    )
                    times.append(time.perf_counter() - t0)
            return statistics.median(times)
    finally:
        await server.stop(None)


TABLE_HEADER = (
    "| sampling | nonzero p per row (median) | encoding | bytes per block | codec s per block "
    "| one gRPC hop s per block | per cycle, via coordinator / direct (TP=1) |"
)


def markdown_table(results: dict) -> str:
    """The figures as docs/SERVING.md shows them (tests/unit/test_docs_figures.py checks the page)."""
    lines = [TABLE_HEADER, "|" + " --- |" * (TABLE_HEADER.count(" | ") + 1)]
    for name, row in results["settings"].items():
        for encoding in ("dense", "bfloat16", "sparse"):
            e = row[encoding]
            label = encoding + (" (sparse rows)" if e["sparse_rows"] and encoding != "sparse" else "")
            if encoding == "sparse" and not e["sparse_rows"]:
                label = "sparse (rows stay dense)"
            lines.append(
                f"| {name} | {row['nonzero_per_row_median']:g} | {label} | {e['bytes_per_block']:,} "
                f"| {e['encode_decode_s_per_block']:.4f} | {e['grpc_hop_s_per_block']:.4f} "
                f"| {e['cycle_bytes_via_coordinator_tp1']:,} / {e['cycle_bytes_direct_tp1']:,} |"
            )
    return "\n".join(lines)


def main() -> None:
    from viasd.actors.rpc import decode_probs, encode_probs
    from viasd.bench import provenance
    from viasd.config import parse_params
    from viasd.models.loader import load_causal_lm
    from viasd.sampling import Sampler
    from viasd.v1 import internal_pb2 as ipb

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="the drafter")
    ap.add_argument("--k", type=int, default=5, help="draft tokens per block (gamma)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    model, tok = load_causal_lm(args.model, dtype="float32")
    logits = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tok(prompt, return_tensors="pt").input_ids
            logits.append(model(ids).logits[0].float())  # [T, V]
    logits = torch.cat(logits)  # [N, V]
    blocks = [logits[i : i + args.k] for i in range(0, logits.shape[0] - args.k + 1, args.k)]
    vocab = logits.shape[1]
    results = {
        **provenance(),
        "model": args.model,
        "vocab_size": vocab,
        "k": args.k,
        "blocks": len(blocks),
        "settings": {},
    }
    for name, params in SETTINGS.items():
        sampler = Sampler.from_params(parse_params(**params))
        ps = [sampler.probs(b) for b in blocks]  # each [k, V]
        nnz = [int((p != 0).sum()) / p.shape[0] for p in ps]
        row = {"nonzero_per_row_median": statistics.median(nnz), "nonzero_per_row_max": max(nnz)}
        for encoding in ("dense", "bfloat16", "sparse"):
            msgs, seconds = [], []
            for p in ps:
                t0 = time.perf_counter()
                if encoding == "dense":  # the encoding before sparse rows: every value
                    t = p.contiguous()
                    msg = ipb.DraftProbs(
                        rows=t.shape[0],
                        vocab_size=vocab,
                        dtype="float32",
                        data=t.numpy().astype("<f4", copy=False).tobytes(),
                    )
                else:
                    msg = encode_probs(p, "bfloat16" if encoding == "bfloat16" else "auto")
                back = decode_probs(ipb.DraftProbs.FromString(msg.SerializeToString()))
                seconds.append(time.perf_counter() - t0)
                if encoding != "bfloat16":
                    assert torch.equal(back, p), (name, encoding)  # exact
                msgs.append(msg)
            size = statistics.mean(m.ByteSize() for m in msgs)
            hop = asyncio.run(hop_seconds(msgs, args.repeats))
            row[encoding] = {
                "sparse_rows": bool(msgs[0].indices),
                "bytes_per_block": round(size),
                "encode_decode_s_per_block": round(statistics.median(seconds), 5),
                "grpc_hop_s_per_block": round(hop, 5),
                # bytes a sampled cycle moves, per route (TP=2: one follower)
                "cycle_bytes_via_coordinator_tp1": round(2 * size),
                "cycle_bytes_direct_tp1": round(size),
                "cycle_bytes_via_coordinator_tp2": round(3 * size),
                "cycle_bytes_direct_tp2": round(2 * size),
            }
        results["settings"][name] = row
        print(name, json.dumps(row), flush=True)
    print(markdown_table(results), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
