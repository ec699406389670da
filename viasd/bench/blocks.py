"""`viasd bench --suite blocks`: what one KV budget holds with slot rows and with blocks, and what
prefix caching saves.

**capacity.** The budget is what slot caches fill with 4 rows of `--long` + 48 positions (4 x
2,048 by default). On it, one request with a `--long`-token prompt and `--short-requests` with
`--short`-token prompts each generate `--max-tokens` tokens (`ar`, greedy, distinct random
prompts) under three settings, one engine each over the same loaded models:

    slots, 4 rows       max_batch 4: rows of 2,048 positions, so at most 4 decode at once
    slots, 32 rows      the budget over 32 rows: 256 positions each, the long prompt is refused
    blocks, 32 rows     kv_block_size 16: the budget in blocks, every request admitted against them

Recorded per setting: requests refused (too long), the most that decoded in one step, preemptions,
wall time, generated tokens / s.

**prefix.** `--prefix-requests` requests whose prompts are one `--prefix`-token system prompt and
`--suffix` tokens of their own, on blocks with prefix caching on and off: the first is prefilled
alone, then the others arrive at once. Prompt positions computed, the time until every request
has its first token, tokens / s.

**throughput.** At each level of `--throughput-requests` (default 1 and 16), that many requests
with distinct `--throughput-prompt`-token prompts arrive at once and each generates `--max-tokens`
tokens, per mode of `--modes` (default `ar,sd`), on slot rows and on blocks (`max_batch` = the
requests, the default KV budget), in `--throughput-rounds` rounds (default 2) alternating the
settings (slots, blocks, slots, blocks) after one unmeasured run of each: tokens / s of each round
(and the decode rate after every first token), so that the spread between a setting's rounds (A/A)
can be read beside the difference between the settings. Level 1 is one request decoding alone.

    viasd bench --suite blocks --out docs/benchmarks/cpu/blocks
    viasd bench --suite blocks --parts throughput --out docs/benchmarks/cpu/blocks-throughput

Writes `--out`/results.json and results.md (docs/BATCHING.md's tables read the json).
"""

from __future__ import annotations

import time

SETTINGS = {
    "slots, 4 rows": dict(max_batch=4, kv_block_size=0),
    "slots, 32 rows": dict(max_batch=32, kv_block_size=0),
    "blocks, 32 rows": dict(max_batch=32, kv_block_size=16),
}
THROUGHPUT = {"slots": dict(kv_block_size=0), "blocks": dict(kv_block_size=16)}
PARTS = ("capacity", "prefix", "throughput")


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    """Distinct random prompts of the given lengths (ids from the lower half of the vocabulary:
    ordinary tokens, no special ones)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab // 2, (n,), generator=gen).tolist() for n in lengths]


def _run(engine, prompts: list[list[int]], params, lead: int = 0) -> dict:
    """Submit the first `lead` prompts and step until they are prefilled, then submit the others
    at once; step until all have ended. Refused (at submission: too long for the context or the
    blocks), the most requests decoding in one step, preemptions, wall seconds, tokens."""
    from viasd.errors import CapacityError, InvalidParameterError

    handles, refused, why = [], 0, None
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        while i == lead > 0 and (
            engine.scheduler.num_waiting or not all(r.prefilled for r in engine.scheduler._running)
        ):
            engine.step()
        try:
            handles.append(engine.submit(prompt, params))
        except (CapacityError, InvalidParameterError) as exc:
            refused, why = refused + 1, why or str(exc)
    most, first_tokens = 0, None
    while engine.scheduler.has_work():
        engine.step()
        most = max(most, sum(1 for r in engine.scheduler._running if r.prefilled))
        if first_tokens is None and all(h.stats.time_to_first_token is not None for h in handles):
            first_tokens = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    tokens = sum(h.stats.generated_tokens for h in handles)
    decoding = wall - first_tokens if first_tokens is not None else 0.0
    return {
        "requests": len(prompts),
        "refused": refused,
        "refused_because": why,
        "most_decoding": most,
        "preemptions": engine.scheduler.preemptions,
        "seconds": wall,
        "all_first_tokens_seconds": first_tokens,
        "generated_tokens": tokens,
        "tokens_per_second": tokens / wall,
        # after every request has its first token: the tokens decoded since, per second
        "decode_tokens_per_second": (tokens - len(handles)) / decoding if decoding > 0 else None,
        "cached_tokens": sum(h.stats.cached_tokens for h in handles),
        "prompt_tokens": sum(len(p) for p in prompts[: len(handles) + refused]),
        "prefill_forwards": sum(h.stats.prefill_forwards for h in handles),
    }


def throughput_levels(spec) -> list[int]:
    """The levels of ``--throughput-requests`` ("1,16"): positive integers, at least one."""
    from viasd.bench.load import concurrency_levels

    return concurrency_levels(spec, "throughput_requests")


def _throughput(engine, args, vocab: int) -> dict:
    """The throughput part: {"prompt_tokens", "levels": [{"requests", "modes": {mode: {setting:
    [round records]}}}]}, one level per number of requests arriving at once."""
    from viasd.config import parse_params

    length = args.throughput_prompt
    modes = [m.strip() for m in (args.methods or "ar,sd").split(",") if m.strip()]
    out: dict = {"prompt_tokens": length, "levels": []}
    for n in throughput_levels(args.throughput_requests):
        prompts = _prompts(vocab, [length] * n, seed=4)
        level: dict = {"requests": n, "modes": {}}
        for mode in modes:
            params = parse_params(mode=mode, max_tokens=args.max_tokens or 32, ignore_eos=True)
            rounds: dict[str, list] = {name: [] for name in THROUGHPUT}
            for kw in THROUGHPUT.values():  # warm-up: the first run of a process pays for its allocations
                e = engine(max_batch=n, kv_cache_gib=None, **kw)
                _run(e, prompts, params)
                e.close()
            for _ in range(args.throughput_rounds):
                for name, kw in THROUGHPUT.items():
                    e = engine(max_batch=n, kv_cache_gib=None, **kw)
                    rounds[name].append(_run(e, prompts, params))
                    e.close()
                    r = rounds[name][-1]
                    print(
                        f"throughput {n} x {mode} {name}: {r['tokens_per_second']:.2f} tok/s "
                        f"(decode {r['decode_tokens_per_second'] or 0:.2f})",
                        flush=True,
                    )
            level["modes"][mode] = rounds
        out["levels"].append(level)
    return out


def run_blocks_bench(args, config) -> int:
    from viasd.bench import provenance
    from viasd.bench.report import write_results
    from viasd.bench.tables import blocks_markdown
    from viasd.config import parse_params
    from viasd.engine import Engine
    from viasd.errors import InvalidParameterError
    from viasd.llm import LLM

    parts = [p.strip() for p in (args.parts or ",".join(PARTS)).split(",") if p.strip()]
    if unknown := sorted(set(parts) - set(PARTS)):
        raise InvalidParameterError("parts", f"{', '.join(unknown)} is not a part of blocks ({', '.join(PARTS)})")
    if "throughput" in parts:
        throughput_levels(args.throughput_requests)  # (a bad level is refused before loading)
    llm = LLM(config)
    base = llm.engine
    verifier, drafter = base.verifier, base.drafter
    per_token = base.kv_bytes_per_token
    rows_len = args.long + 48
    gib = 4 * rows_len * per_token / 2**30
    params = parse_params(mode="ar", max_tokens=args.max_tokens or 32, ignore_eos=True)

    # `auto` requests plan with the loaded engine's cost curves (profiled or read once, not per engine)
    costs = base.cost_model() if "throughput" in parts and "auto" in (args.methods or "") else None

    def engine(**kw) -> Engine:
        return Engine(
            verifier,
            drafter,
            mask=base.mask,
            cache_policy=base.cache_policy,
            eos_token_ids=(),
            costs=costs,
            gates=base.gates,
            **{"kv_cache_gib": gib, **kw},
        )

    record = {
        **provenance(),
        "dtype": str(verifier.dtype),
        "budget": {"gib": gib, "kv_bytes_per_token": per_token, "as_slot_rows": [4, rows_len]},
        "capacity": {},
        "prefix": {},
        "throughput": {},
    }
    prompts = _prompts(verifier.vocab_size, [args.long] + [args.short] * args.short_requests, seed=1)
    for name, kw in SETTINGS.items() if "capacity" in parts else ():
        e = engine(**kw)
        record["capacity"][name] = {**_run(e, prompts, params), "capacity": e.scheduler.capacity.describe()}
        e.close()
        print(f"capacity {name}: {record['capacity'][name]}", flush=True)
    system = _prompts(verifier.vocab_size, [args.prefix], seed=2)[0]
    own = _prompts(verifier.vocab_size, [args.suffix] * args.prefix_requests, seed=3)
    for caching in (False, True) if "prefix" in parts else ():
        e = engine(max_batch=args.prefix_requests, kv_block_size=16, prefix_caching=caching)
        name = "prefix caching on" if caching else "prefix caching off"
        record["prefix"][name] = _run(e, [system + p for p in own], params, lead=1)
        e.close()
        print(f"{name}: {record['prefix'][name]}", flush=True)
    if "throughput" in parts:
        record["throughput"] = _throughput(engine, args, verifier.vocab_size)
    out = write_results(args.out, record, blocks_markdown(record))
    print(f"wrote {out}/results.json")
    return 0
