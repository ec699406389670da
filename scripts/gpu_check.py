#!/usr/bin/env python
"""One in-process check of the engine on a GPU: exactness, host reads per step, throughput.

Random-weight models of real shapes (no downloads, no Ray), built on the device:

1. ``exactness``: greedy ``sd`` commits exactly the tokens of greedy ``ar`` (float32), several
   requests of ragged prompts stepping together in one engine, on the Qwen2.5-1.5B verifier /
   Qwen2.5-0.5B drafter shapes; the drafts accepted, and how far greedy ``via`` follows ``ar``
   (informational: ``via`` is lossy by design).
2. ``host_reads``: reads of tensor values into Python per decode step (steady state, after the
   prefill; median over a few steps) at 8 and 32 rows for ar / sd / via, greedy and sampled
   (temperature 1, seeded), on the same pair (viasd.bench.host_reads); on CUDA also every
   operation that synchronised with the device (torch's sync debug mode), hidden ones included.
3. ``throughput``: for the Qwen2.5 pair and a Llama-3.1-8B verifier / Llama-3.2-1B drafter, in
   bf16, at 1 / 8 / 32 / 64 rows: the verifier's decode tokens/s through ``MaskedLM.forward_batch``
   and through the bare transformers forward (one token a row after a 128-token prompt), the
   weight-read roofline (bytes a decode step must read / HBM bandwidth), and the full engine
   step's committed tokens/s in ``ar`` and ``sd`` (greedy, gamma 5), with slot caches and with
   paged ones (blocks of 16 positions).
4. ``shard_load``: a random bf16 checkpoint of LLaMA2-70B's layer shapes (two of its 80 layers,
   its embeddings and head, in several safetensors files) is written to a scratch directory, and
   tensor-parallel rank 0 of 8 reads its slices straight to the device (``viasd.parallel.read_shard``),
   cold (the files dropped from the page cache) and warm: seconds, the bytes it holds against
   the checkpoint's, its peak host memory above the start and the device's peak allocation;
   the seconds for all 80 layers extrapolated by bytes.
5. ``fp8``: the linears of one LLaMA2-70B layer as a tensor-parallel rank of 8 holds them (q / k / v
   / o, gate / up / down slices; and the whole gate projection, 8192 -> 28672), in bf16 against
   fp8 (``viasd.quant``'s ``Fp8Linear``: float8_e4m3fn weights with a scale per output channel,
   activations quantized per token, ``torch._scaled_mm``) at 1 to 512 rows: median seconds by CUDA
   events, the fp8 output's largest deviation from the bf16 weights' float32 product (relative to
   that product's largest value), and the bytes each holds. On a device below compute capability
   8.9 the section records why it did not run.
6. ``paged_attention``: the Qwen2.5-1.5B verifier (bf16) over paged caches (blocks of 16) of
   ragged contexts, read by the two kernels of ``paged_attention`` (viasd.attention): FlexAttention,
   compiled, reading each row's blocks in place through its block table, against the torch path
   (each row's blocks gathered, by span buckets, then SDPA). At 1 / 8 / 32 / 64 rows, one decode
   step (a token a row) and one verify step (GAMMA + 1 tokens a row) from the same caches: the
   largest logit difference (relative to the largest logit) and the argmax agreement, then each
   step's median seconds with either kernel, and the flex kernel's first call (its compilation).
   On CPU flex runs eagerly (the tiny mode's check that the section runs, not a timing).

Every section checks the time left (``--budget-s``) and records ``"skipped": "time budget"``
rather than overrun; one that raises records its error and the next one runs. The JSON goes to
stdout and, with ``--out``, to a file, rewritten after every section. Exit status 0 when greedy
``sd`` equals greedy ``ar``, 1 otherwise.

The weights are random but not degenerate: embeddings N(0, 1) dominate the residual stream, the
layers' writes (o_proj, down_proj) are scaled to a fraction of it, and the head maps each token
to logits of standard deviation ~5. The drafter is related to the verifier at no cost: its
embeddings are the verifier's projected onto an orthonormal basis P [H_v, H_d], and the
verifier's head is the drafter's head through P, so both predict the same next token where their
layers do not move it. The heads are untied (a tied head over embedding-dominated weights repeats
the last token); a decode step reads the same bytes either way.

On CPU (tests): ``python scripts/gpu_check.py --tiny --device cpu --out /tmp/gpu_check.json``.

On the lent H200 (Python 3.12 there, torch and transformers installed; pydantic is not). Here,
once, in the repository root (``.gpu-wheels/`` is in .gitignore; about 2.8 MB)::

    python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        -d .gpu-wheels pydantic==2.14.3 pydantic_core==2.50.4 annotated_types==0.8.0 \\
        typing_inspection==0.4.5 typing_extensions==4.16.0

(``import viasd.engine`` needs these beyond torch, transformers, safetensors and numpy;
typing_extensions because pydantic 2.14 needs >= 4.16. Only pydantic_core is built per Python
version: change ``--python-version`` if ``python3 -V`` there says otherwise.) Then one device run,
carrying ``.gpu-wheels``, with a timeout above the budget (420 s; e.g. 540 s), and the commit
passed in (the copy there has no .git)::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/*.whl \\
        && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 \\
        && python3 scripts/gpu_check.py --commit <sha> --out $OUT/gpu_check.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # viasd from this tree (not installed on the device)

import torch  # noqa: E402

LOGIT_STD = 5.0  # std of the head's logits over an embedding-dominated hidden state
# the layers' writes, all together, against the embedding's unit RMS: on the Qwen2.5 shapes ~76% of the
# drafter's argmaxes agree with the verifier's (0.1: ~57%; 0.03: ~83%)
RESIDUAL_SHARE = 0.05
H200_HBM_GBPS = 4800.0
GAMMA = 5
PAGED_BLOCK = 16  # positions a KV block, for the paged-cache engine rates


@dataclass(frozen=True)
class Shape:
    """The shape of one decoder-only LM."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float


@dataclass(frozen=True)
class Pair:
    """A verifier and a drafter of one architecture and vocabulary."""

    name: str
    arch: str  # "qwen2" | "llama"
    verifier: Shape
    drafter: Shape


QWEN_PAIR = Pair(
    "qwen2.5-1.5b/0.5b",
    "qwen2",
    Shape(1536, 28, 12, 2, 8960, 151936, 1e6),  # Qwen2.5-1.5B
    Shape(896, 24, 14, 2, 4864, 151936, 1e6),  # Qwen2.5-0.5B
)
LLAMA_PAIR = Pair(
    "llama-3.1-8b/3.2-1b",
    "llama",
    Shape(4096, 32, 32, 8, 14336, 128256, 5e5),  # Llama-3.1-8B
    Shape(2048, 16, 32, 8, 8192, 128256, 5e5),  # Llama-3.2-1B
)
LLAMA2_70B = Shape(8192, 80, 64, 8, 28672, 32000, 1e4)  # the shard_load section's layer shapes
TINY_QWEN_PAIR = Pair("tiny-qwen2", "qwen2", Shape(64, 6, 4, 2, 128, 512, 1e6), Shape(32, 2, 2, 1, 64, 512, 1e6))
TINY_LLAMA_PAIR = Pair("tiny-llama", "llama", Shape(64, 4, 4, 2, 128, 512, 5e5), Shape(32, 2, 2, 1, 64, 512, 5e5))


@dataclass(frozen=True)
class Plan:
    """What one run measures: pairs, rows, lengths and repetitions."""

    exact_pair: Pair
    throughput_pairs: tuple[Pair, ...]
    exact_prompt_lengths: tuple[int, ...]
    exact_max_tokens: int
    host_rows: tuple[int, ...]
    host_prompt_len: int
    host_steps: int
    rows: tuple[int, ...]
    prompt_len: int
    warmup: int
    reps: int
    engine_steps: int
    throughput_dtype: str
    shard_shape: Shape  # shard_load: the checkpoint's shapes (its `layers` are the model's; `shard_layers` are written)
    shard_layers: int
    shard_tp: int
    fp8_shape: Shape  # fp8: the layer whose linears (as rank 0 of fp8_tp holds them) are timed
    fp8_tp: int
    fp8_rows: tuple[int, ...]
    paged_rows: tuple[int, ...]  # paged_attention: rows of each step
    paged_contexts: tuple[int, int]  # paged_attention: the least and most positions a row holds before the step


FULL = Plan(
    exact_pair=QWEN_PAIR,
    throughput_pairs=(QWEN_PAIR, LLAMA_PAIR),
    exact_prompt_lengths=(7, 19, 33, 52),
    exact_max_tokens=48,
    host_rows=(8, 32),
    host_prompt_len=32,
    host_steps=5,
    rows=(1, 8, 32, 64),
    prompt_len=128,
    warmup=5,
    reps=20,
    engine_steps=12,
    throughput_dtype="bfloat16",
    shard_shape=LLAMA2_70B,
    shard_layers=2,
    shard_tp=8,
    fp8_shape=LLAMA2_70B,
    fp8_tp=8,
    fp8_rows=(1, 8, 32, 64, 512),
    paged_rows=(1, 8, 32, 64),
    paged_contexts=(128, 2048),
)
TINY = Plan(
    exact_pair=TINY_QWEN_PAIR,
    throughput_pairs=(TINY_QWEN_PAIR, TINY_LLAMA_PAIR),
    exact_prompt_lengths=(5, 9, 14),
    exact_max_tokens=16,
    host_rows=(1, 4),
    host_prompt_len=8,
    host_steps=3,
    rows=(1, 4),
    prompt_len=16,
    warmup=1,
    reps=3,
    engine_steps=3,
    throughput_dtype="float32",
    shard_shape=Shape(64, 80, 8, 8, 256, 512, 1e4),
    shard_layers=2,
    shard_tp=8,
    fp8_shape=Shape(256, 2, 8, 8, 512, 512, 1e4),
    fp8_tp=2,
    fp8_rows=(1, 4),
    paged_rows=(3,),
    paged_contexts=(5, 90),  # (the torch path's spans in two buckets)
)


class Budget:
    """Wall seconds left of `total` since construction."""

    def __init__(self, total: float):
        self.start, self.total = time.perf_counter(), total

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def has(self, seconds: float) -> bool:
        return self.total - self.elapsed() >= seconds


SKIPPED = {"skipped": "time budget"}


def log(msg: str) -> None:
    print(f"[gpu_check] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ models


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def hf_config(arch: str, shape: Shape, max_positions: int):
    """A transformers config of `shape` (untied head; default initialiser std 1/sqrt(hidden), so
    a projection of a unit-RMS input has unit-RMS outputs)."""
    from transformers import LlamaConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch]
    return cls(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max_positions,
        rope_theta=shape.rope_theta,
        initializer_range=1.0 / math.sqrt(shape.hidden),
        tie_word_embeddings=False,
    )


def build_model(arch: str, shape: Shape, dtype: torch.dtype, device: str, seed: int, max_positions: int = 4096):
    """A random model of `shape`, created on `device` in `dtype` (no float32 copy first), in eval mode;
    the layers' residual writes scaled to RESIDUAL_SHARE of the embeddings all together."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    cls = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}[arch]
    torch.manual_seed(seed)
    with torch.device(device), default_dtype(dtype):
        model = cls(hf_config(arch, shape, max_positions))
    scale = RESIDUAL_SHARE / math.sqrt(shape.layers)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(scale)
            layer.mlp.down_proj.weight.mul_(scale)
    return model.eval()


def related_pair(pair: Pair, dtype: torch.dtype, device: str, seed: int = 0):
    """(verifier, drafter) transformers models whose embeddings and heads agree through an
    orthonormal projection P (module docstring), so that drafts are often accepted."""
    hv, hd = pair.verifier.hidden, pair.drafter.hidden
    assert hd <= hv, "the drafter's hidden size must not exceed the verifier's"
    verifier = build_model(pair.arch, pair.verifier, dtype, device, seed)
    drafter = build_model(pair.arch, pair.drafter, dtype, device, seed + 1)
    gen = torch.Generator(device=device).manual_seed(seed + 2)
    f32 = {"device": device, "dtype": torch.float32}
    with torch.no_grad():
        proj = torch.linalg.qr(torch.randn(hv, hd, generator=gen, **f32))[0]  # [Hv, Hd], orthonormal columns
        embed = torch.randn(pair.verifier.vocab, hv, generator=gen, **f32)  # [V, Hv]
        head = torch.randn(pair.verifier.vocab, hd, generator=gen, **f32) * (LOGIT_STD / math.sqrt(hd))  # [V, Hd]
        verifier.model.embed_tokens.weight.copy_(embed)
        verifier.lm_head.weight.copy_(head @ proj.T)  # [V, Hv]
        drafter.model.embed_tokens.weight.copy_(embed @ proj)  # [V, Hd]
        drafter.lm_head.weight.copy_(head)
    del proj, embed, head
    return verifier, drafter


def weight_read_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter but the input embedding table
    (a step gathers only its rows), the head included."""
    embed = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = model.lm_head.weight.data_ptr() == embed.data_ptr()
    return total if tied else total - embed.numel() * embed.element_size()


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ timing and engine driving


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(fn, *, reps: int, warmup: int, device: str, reset=None) -> float:
    """Median wall seconds of `fn()` over `reps` timed calls after `warmup` untimed ones, the
    device synchronised around each; `reset()` runs after every call, outside the timing."""
    times = []
    for i in range(warmup + reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        if reset is not None:
            reset()
    return statistics.median(times)


def random_prompts(lengths, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def step_until_decoding(engine, handles, limit: int = 200) -> int:
    """Step until every request has committed a token (its prefill is done); the steps taken."""
    waiting = set(handles)
    for steps in range(1, limit + 1):
        for handle, chunk in engine.step():
            if chunk.token_ids:
                waiting.discard(handle)
        if not waiting:
            return steps
    raise RuntimeError(f"{len(waiting)} requests committed no token in {limit} steps")


def drain(engine, handles) -> None:
    """Cancel the requests and step until their rows are released (their stats are complete)."""
    for h in handles:
        engine.cancel(h)
    while engine.scheduler.has_work():
        engine.step()


def run_to_end(engine, prompts, params_list) -> tuple[list[list[int]], list]:
    """Submit every request at once and step until all finish; each request's tokens and stats."""
    handles = [engine.submit(p, params) for p, params in zip(prompts, params_list)]
    tokens = {h: [] for h in handles}
    while engine.scheduler.has_work():
        for handle, chunk in engine.step():
            tokens[handle].extend(chunk.token_ids)
    for h in handles:
        if h.error is not None:
            raise h.error
    return [tokens[h] for h in handles], [h.stats for h in handles]


def acceptance(stats) -> float | None:
    drafted = sum(s.num_draft_tokens for s in stats)
    return sum(s.num_accepted_tokens for s in stats) / drafted if drafted else None


def new_engine(verifier, drafter, rows: int, max_seq_len: int, prefill_chunk: int = 512, block_size: int | None = None):
    """An engine over the pair: slot caches of `rows` x `max_seq_len`, or (`block_size`) paged
    caches of as many blocks."""
    from viasd.engine import Engine
    from viasd.runtime import LayerMask

    mask = LayerMask.evenly_spaced(0.45, verifier.num_layers)
    return Engine(
        verifier,
        drafter,
        mask=mask,
        max_batch=rows,
        max_seq_len=max_seq_len,
        prefill_chunk=prefill_chunk,
        kv_block_size=block_size,
    )


# ------------------------------------------------------------------ sections


def environment(device: str, args) -> dict:
    """Versions, device, kernels and the commit of the tree that ran."""
    import transformers

    def git(*cmd):
        try:
            out = subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=10)
            return out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None

    cuda = device.startswith("cuda")
    commit = git("rev-parse", "HEAD") if (ROOT / ".git").exists() else None
    return {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "device_name": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "cuda": torch.version.cuda if cuda else None,
        "exactness_dtype": "float32",
        "throughput_dtype": args.plan.throughput_dtype,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "git_commit": commit or args.commit,
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None,
        "tiny": args.tiny,
        "budget_s": args.budget_s,
        "hbm_gbps": args.hbm_gbps if cuda else None,
    }


def exactness(verifier, drafter, plan: Plan, device: str) -> dict:
    """Greedy `sd` against greedy `ar`, float32, all prompts stepping together in one engine;
    `via` against `ar` for information."""
    from viasd.config import parse_params

    prompts = random_prompts(plan.exact_prompt_lengths, verifier.vocab_size, seed=11)
    n = plan.exact_max_tokens
    engine = new_engine(verifier, drafter, len(prompts), max(plan.exact_prompt_lengths) + n + 2 * GAMMA + 8)
    out = {}
    try:
        runs = {}
        for mode in ("ar", "sd", "via"):
            params = parse_params(mode=mode, max_tokens=n, temperature=0.0, gamma=GAMMA)
            t0 = time.perf_counter()
            runs[mode] = run_to_end(engine, prompts, [params] * len(prompts))
            out[f"{mode}_seconds"] = round(time.perf_counter() - t0, 3)
    finally:
        engine.close()
    ar, _ = runs["ar"]
    sd, sd_stats = runs["sd"]
    via, via_stats = runs["via"]
    mismatch = next(
        (
            {"prompt": i, "position": next((j for j, (x, y) in enumerate(zip(a, s)) if x != y), min(len(a), len(s)))}
            for i, (a, s) in enumerate(zip(ar, sd))
            if a != s
        ),
        None,
    )
    return {
        "pair": plan.exact_pair.name,
        "dtype": "float32",
        "requests": len(prompts),
        "prompt_lengths": list(plan.exact_prompt_lengths),
        "max_tokens": n,
        "gamma": GAMMA,
        "sd_equals_ar": mismatch is None and all(len(a) == n for a in ar),
        "tokens_compared": sum(min(len(a), len(s)) for a, s in zip(ar, sd)),
        "first_mismatch": mismatch,
        "distinct_ar_tokens": len({t for a in ar for t in a}),
        "sd_acceptance": acceptance(sd_stats),
        "via_equals_ar": via == ar,
        "via_tokens_agreeing": sum(x == y for a, v in zip(ar, via) for x, y in zip(a, v)),
        "via_acceptance": acceptance(via_stats),
        **out,
    }


def host_reads_case(engine, prompts, mode: str, temperature: float, steps: int) -> dict:
    """Host reads of each of `steps` decode steps once every request decodes (one step more first)."""
    from viasd.bench.host_reads import count_host_reads
    from viasd.config import parse_params

    max_tokens = (steps + 4) * (GAMMA + 1) + 8
    handles = [
        engine.submit(p, parse_params(mode=mode, max_tokens=max_tokens, temperature=temperature, seed=i, gamma=GAMMA))
        for i, p in enumerate(prompts)
    ]
    try:
        step_until_decoding(engine, handles)
        engine.step()
        counts, syncs, by_method = [], [], {}
        for _ in range(steps):
            with count_host_reads() as reads, device_syncs() as synced:
                engine.step()
            counts.append(int(reads.total))
            syncs.append(synced[0])
            by_method = dict(reads.by_method)
    finally:
        drain(engine, handles)
    return {
        "per_step": counts,
        "median": int(statistics.median(counts)),
        "last_step_by_method": by_method,
        "device_syncs_per_step": syncs if torch.cuda.is_available() else None,
    }


@contextlib.contextmanager
def device_syncs():
    """Count the operations that synchronise with the CUDA device while the block runs (torch's
    sync debug mode warns on each, from any thread): host reads, and the hidden ones (a boolean
    index, a copy to pageable memory); [count] after the block, [0] without CUDA."""
    import warnings

    count = [0]
    if not torch.cuda.is_available():
        yield count
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield count
        finally:
            torch.cuda.set_sync_debug_mode("default")
    count[0] = sum(1 for w in caught if "synchroniz" in str(w.message))


def host_reads(verifier, drafter, plan: Plan, budget: Budget) -> dict:
    """Host reads per steady decode step at each row count, ar / sd / via, greedy and sampled."""
    out = {"pair": plan.exact_pair.name, "dtype": "float32", "prompt_len": plan.host_prompt_len, "rows": {}}
    for rows in plan.host_rows:
        max_seq_len = plan.host_prompt_len + (plan.host_steps + 4) * (GAMMA + 1) + 2 * GAMMA + 24
        engine = new_engine(verifier, drafter, rows, max_seq_len)
        prompts = random_prompts([plan.host_prompt_len] * rows, verifier.vocab_size, seed=rows)
        cases = {}
        try:
            for mode in ("ar", "sd", "via"):
                for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
                    key = f"{mode}_{name}"
                    if not budget.has(20):
                        cases[key] = SKIPPED
                        continue
                    cases[key] = host_reads_case(engine, prompts, mode, temperature, plan.host_steps)
                    log(f"host reads rows={rows} {key}: {cases[key]['per_step']}")
        finally:
            engine.close()
        out["rows"][str(rows)] = cases
    return out


def forward_batch_decode(lm, rows: int, plan: Plan, device: str) -> dict:
    """The verifier's decode tokens/s through MaskedLM.forward_batch: one token per row at
    position prompt_len (each row's cache rolled back to prompt_len after every call)."""
    from viasd.runtime import Row

    store = lm.new_store(max_rows=rows, max_len=plan.prompt_len + 8)
    cache_rows = [store.alloc() for _ in range(rows)]
    prompts = random_prompts([plan.prompt_len] * rows, lm.vocab_size, seed=rows)  # [B][P]
    lm.forward_batch([Row(p, 0, 1, r) for p, r in zip(prompts, cache_rows)], store)
    step = [Row([p[-1]], plan.prompt_len, 1, r) for p, r in zip(prompts, cache_rows)]  # [B] rows of 1 token

    def reset():
        for r in cache_rows:
            store.crop(r, plan.prompt_len)

    seconds = median_seconds(
        lambda: lm.forward_batch(step, store), reps=plan.reps, warmup=plan.warmup, device=device, reset=reset
    )
    return {"seconds": seconds, "tokens_per_s": rows / seconds}


@torch.inference_mode()
def transformers_decode(model, rows: int, plan: Plan, device: str) -> dict:
    """The bare transformers forward's decode tokens/s: model(ids [B, 1], past_key_values=its
    DynamicCache of the prompt, use_cache=True), the cache cropped back after every call."""
    from transformers import DynamicCache

    ids = torch.tensor(random_prompts([plan.prompt_len] * rows, model.config.vocab_size, seed=rows), device=device)
    cache = DynamicCache()
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)  # ids [B, P]
    step = ids[:, -1:]  # [B, 1]
    seconds = median_seconds(
        lambda: model(input_ids=step, past_key_values=cache, use_cache=True),
        reps=plan.reps,
        warmup=plan.warmup,
        device=device,
        reset=lambda: cache.crop(-1),  # drop the decoded position
    )
    return {"seconds": seconds, "tokens_per_s": rows / seconds}


def roofline(model, lm, rows: int, plan: Plan, hbm_gbps: float | None) -> dict:
    """The decode step's bytes (weights once, plus every row's keys/values of the prompt) and the
    tokens/s reading them at the HBM bandwidth allows (null without a bandwidth)."""
    weights = weight_read_bytes(model)
    kv = rows * plan.prompt_len * lm.kv_bytes_per_token()
    if hbm_gbps is None:
        return {"weight_bytes": weights, "kv_bytes": kv, "max_tokens_per_s": None}
    return {"weight_bytes": weights, "kv_bytes": kv, "max_tokens_per_s": rows / ((weights + kv) / (hbm_gbps * 1e9))}


def engine_rate(
    verifier, drafter, mode: str, rows: int, plan: Plan, device: str, block_size: int | None = None
) -> dict:
    """Committed tokens/s of full engine steps, greedy, every row decoding (after the prefill
    and one more step), the device synchronised around the timed steps; slot caches, or paged
    ones of `block_size` positions a block."""
    from viasd.config import parse_params

    max_tokens = (plan.engine_steps + 4) * (GAMMA + 1) + 8
    engine = new_engine(
        verifier,
        drafter,
        rows,
        plan.prompt_len + max_tokens + 2 * GAMMA + 8,
        prefill_chunk=rows * plan.prompt_len,
        block_size=block_size,
    )
    params = parse_params(mode=mode, max_tokens=max_tokens, temperature=0.0, gamma=GAMMA)
    handles = [engine.submit(p, params) for p in random_prompts([plan.prompt_len] * rows, verifier.vocab_size, rows)]
    try:
        step_until_decoding(engine, handles)
        engine.step()
        sync(device)
        t0, tokens = time.perf_counter(), 0
        for _ in range(plan.engine_steps):
            tokens += sum(len(chunk.token_ids) for _, chunk in engine.step())
        sync(device)
        seconds = time.perf_counter() - t0
    finally:
        drain(engine, handles)
        engine.close()
    return {
        "steps": plan.engine_steps,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tokens_per_row_step": tokens / (rows * plan.engine_steps),
        "acceptance": acceptance([h.stats for h in handles]),
    }


def throughput_pair(pair: Pair, plan: Plan, device: str, hbm_gbps: float | None, budget: Budget) -> dict:
    """Verifier decode through forward_batch and transformers, the roofline, and engine steps
    (ar, sd) at each row count, for one pair in the throughput dtype."""
    from viasd.runtime import MaskedLM

    dtype = getattr(torch, plan.throughput_dtype)
    t0 = time.perf_counter()
    verifier, drafter = related_pair(pair, dtype, device)
    vlm, dlm = MaskedLM(verifier), MaskedLM(drafter)
    sync(device)
    out = {
        "dtype": plan.throughput_dtype,
        "build_seconds": round(time.perf_counter() - t0, 2),
        "verifier": {**asdict(pair.verifier), "param_bytes": param_bytes(verifier)},
        "drafter": {**asdict(pair.drafter), "param_bytes": param_bytes(drafter)},
        "prompt_len": plan.prompt_len,
        "gamma": GAMMA,
        "rows": {},
    }
    for rows in plan.rows:
        rec = {"roofline": roofline(verifier, vlm, rows, plan, hbm_gbps)}
        measures = (
            ("forward_batch", lambda: forward_batch_decode(vlm, rows, plan, device)),
            ("transformers", lambda: transformers_decode(verifier, rows, plan, device)),
            ("engine_ar", lambda: engine_rate(vlm, dlm, "ar", rows, plan, device)),
            ("engine_sd", lambda: engine_rate(vlm, dlm, "sd", rows, plan, device)),
            ("engine_ar_paged", lambda: engine_rate(vlm, dlm, "ar", rows, plan, device, PAGED_BLOCK)),
            ("engine_sd_paged", lambda: engine_rate(vlm, dlm, "sd", rows, plan, device, PAGED_BLOCK)),
        )
        for name, measure in measures:
            rec[name] = measure() if budget.has(20) else SKIPPED
            free_memory(device)
        out["rows"][str(rows)] = rec
        rates = ", ".join(f"{k} {rounded(v.get('tokens_per_s'))}" for k, v in rec.items())
        log(f"throughput {pair.name} rows={rows}: {rates}")
    return out  # (the models go with this frame; the caller frees the memory)


# ------------------------------------------------------------------ one rank's shard of a 70B checkpoint


def status_bytes(field: str) -> int | None:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM), None where there is none."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return None


def reset_peak_rss() -> bool:
    """Restart VmHWM from the current resident size (Linux: clear_refs 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def write_checkpoint(shape: Shape, layers: int, directory: Path, device: str, file_bytes: int = 2 << 30) -> int:
    """A random bf16 LLaMA checkpoint of `shape` with `layers` layers in safetensors files of at
    most `file_bytes` (and its index, its config), flushed to disk; returns its tensors' bytes."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    config = hf_config("llama", Shape(**{**asdict(shape), "layers": layers}), 4096)
    with torch.device("meta"):
        names = {n: tuple(p.shape) for n, p in LlamaForCausalLM(config).named_parameters()}
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(directory)
    weight_map, part, size, total, index = {}, {}, 0, 0, 0
    gen = torch.Generator(device=device).manual_seed(0)

    def flush():
        nonlocal part, size, index
        if part:
            name = f"model-{index:05d}.safetensors"
            save_file(part, directory / name)
            weight_map.update(dict.fromkeys(part, name))
            part, size, index = {}, 0, index + 1

    for name, dims in names.items():
        t = torch.randn(dims, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16).cpu()
        if size + t.nbytes > file_bytes:
            flush()
        part[name], size, total = t, size + t.nbytes, total + t.nbytes
    flush()
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    for f in directory.glob("*.safetensors"):
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    return total


def drop_page_cache(directory: Path) -> bool:
    """Ask the kernel to drop the files' clean pages (the next read comes from the disk)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for f in directory.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def shard_load(plan: Plan, device: str) -> dict:
    """Rank 0 of `plan.shard_tp` reading its slices of a `plan.shard_layers`-layer checkpoint of
    `plan.shard_shape` (section 4 of the module docstring)."""
    import tempfile

    from viasd.parallel import TPGroup, read_shard

    cuda = device.startswith("cuda")
    shape, layers, tp = plan.shard_shape, plan.shard_layers, plan.shard_tp
    group = TPGroup(rank=0, world_size=tp, backend="nccl" if cuda else "gloo", local_rank=0 if cuda else None)
    with tempfile.TemporaryDirectory(prefix="viasd-shard-") as tmp:
        directory = Path(tmp)
        t0 = time.perf_counter()
        checkpoint = write_checkpoint(shape, layers, directory, device)
        rec = {"shape": asdict(shape), "layers_written": layers, "tp": tp, "checkpoint_bytes": checkpoint}
        rec["write_seconds"] = time.perf_counter() - t0
        for run in ("cold", "warm"):
            rec[f"{run}_page_cache_dropped"] = drop_page_cache(directory) if run == "cold" else False
            free_memory(device)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start, reset = status_bytes("VmRSS"), reset_peak_rss()
            sync(device)
            t0 = time.perf_counter()
            model = read_shard(directory, group, torch.bfloat16)
            sync(device)
            rec[f"{run}_seconds"] = time.perf_counter() - t0
            peak = status_bytes("VmHWM")
            rec[f"{run}_host_peak_bytes"] = peak - start if reset and peak is not None and start else None
            rec[f"{run}_device_peak_bytes"] = torch.cuda.max_memory_allocated() if cuda else None
            rec["rank_weight_bytes"] = param_bytes(model)
            del model
    rec["rank_share"] = rec["rank_weight_bytes"] / checkpoint
    per_layer = 2 * (  # bf16: q, o; k, v; gate, up, down
        2 * shape.hidden * shape.hidden
        + 2 * shape.hidden * shape.kv_heads * (shape.hidden // shape.heads)
        + 3 * shape.hidden * shape.intermediate
    )
    full = checkpoint + (shape.layers - layers) * per_layer
    rec["full_checkpoint_bytes"] = full
    rec["full_cold_seconds_estimate"] = rec["cold_seconds"] * full / checkpoint
    rec["cold_gb_per_s"] = checkpoint / rec["cold_seconds"] / 1e9  # (the checkpoint's bytes over the read's time)
    return rec


def event_seconds(fn, *, reps: int, warmup: int, device: str) -> float:
    """Median seconds of `fn()` over `reps` calls after `warmup`: CUDA events around each call on
    a GPU (device time, no host sync inside the timing), wall time elsewhere."""
    if not device.startswith("cuda"):
        return median_seconds(fn, reps=reps, warmup=warmup, device=device)
    for _ in range(warmup):
        fn()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in pairs:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) / 1e3 for start, end in pairs)


def fp8_linears(shape: Shape, tp: int) -> dict[str, tuple[int, int]]:
    """One decoder layer's linears as rank 0 of `tp` holds them, name -> (N, K), and the whole
    gate projection."""
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    return {
        f"q_proj/{tp}": (shape.hidden // tp, shape.hidden),
        f"k_proj/{tp}": (max(kv // tp, head_dim), shape.hidden),
        f"o_proj/{tp}": (shape.hidden, shape.hidden // tp),
        f"gate_proj/{tp}": (shape.intermediate // tp, shape.hidden),
        f"down_proj/{tp}": (shape.hidden, shape.intermediate // tp),
        "gate_proj": (shape.intermediate, shape.hidden),
    }


def fp8(plan: Plan, device: str) -> dict:
    """bf16 against fp8 linears of one layer (section 5 of the module docstring)."""
    from viasd.quant import FP8_CAPABILITY, fp8_linear_class, quantize_fp8

    if device.startswith("cuda"):
        capability = torch.cuda.get_device_capability(torch.device(device))
        if capability < FP8_CAPABILITY:
            return {"skipped": f"compute capability {capability[0]}.{capability[1]} < 8.9: no fp8 _scaled_mm"}
    g = torch.Generator(device=device).manual_seed(0)
    rec = {
        "shape": asdict(plan.fp8_shape),
        "tp": plan.fp8_tp,
        "kernel": "torch._scaled_mm, row-wise scales",
        "linears": {},
    }
    for name, (n, k) in fp8_linears(plan.fp8_shape, plan.fp8_tp).items():
        w = (torch.randn(n, k, generator=g, device=device) / math.sqrt(k)).to(torch.bfloat16)  # [N, K]
        mod = fp8_linear_class()(quantize_fp8(w), None)
        lin = {"n": n, "k": k, "bf16_bytes": w.numel() * 2, "fp8_bytes": mod.qweight.numel() + 4 * n, "rows": {}}
        for m in plan.fp8_rows:
            x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)  # [M, K]
            ref = x.float() @ w.float().t()  # [M, N]
            with torch.no_grad():
                y = mod(x)
                bf16_s = event_seconds(
                    lambda: torch.nn.functional.linear(x, w), reps=plan.reps, warmup=plan.warmup, device=device
                )
                fp8_s = event_seconds(lambda: mod(x), reps=plan.reps, warmup=plan.warmup, device=device)
            lin["rows"][str(m)] = {
                "bf16_seconds": bf16_s,
                "fp8_seconds": fp8_s,
                "speedup": bf16_s / fp8_s,
                "rel_err": ((y.float() - ref).abs().max() / ref.abs().max()).item(),
            }
        rec["linears"][name] = lin
        w = mod = None  # (freed before the next linear)
        free_memory(device)
    return rec


# ------------------------------------------------------------------ paged attention: flex against torch


def paged_attention(plan: Plan, device: str, budget: Budget) -> dict:
    """Paged caches read by FlexAttention and by the torch path (section 6 of the module docstring)."""
    from viasd.attention import flex_available
    from viasd.runtime import MaskedLM

    if device.startswith("cuda") and not flex_available():
        return {"skipped": "FlexAttention does not compile here (no Triton)"}
    dtype = getattr(torch, plan.throughput_dtype)
    pair = plan.exact_pair
    lm = MaskedLM(build_model(pair.arch, pair.verifier, dtype, device, seed=0))
    rec = {
        "shape": asdict(pair.verifier),
        "dtype": plan.throughput_dtype,
        "block_size": PAGED_BLOCK,
        "contexts": list(plan.paged_contexts),
        "flex": "torch.compile(flex_attention)" if device.startswith("cuda") else "eager (reference implementation)",
        "rows": {},
    }
    for rows in plan.paged_rows:
        if not budget.has(30 if device.startswith("cuda") else 3):
            rec["rows"][str(rows)] = SKIPPED
            continue
        rec["rows"][str(rows)] = out = paged_attention_rows(lm, rows, plan, device)
        free_memory(device)
        log(
            f"paged_attention rows={rows}: "
            + ", ".join(f"{k} flex/torch {v['flex_over_torch']:.3g}" for k, v in out.items())
        )
    return rec


def paged_attention_rows(lm, rows: int, plan: Plan, device: str) -> dict:
    """One decode and one verify step over `rows` ragged contexts on a paged store, with either
    kernel: logits compared, steps timed (each row cropped back after every call)."""
    from viasd.runtime import Row

    lo, hi = plan.paged_contexts
    rng = random.Random(rows)
    contexts = [rng.randint(lo, hi) for _ in range(rows)]
    prompts = random_prompts([n + GAMMA + 1 for n in contexts], lm.vocab_size, seed=rows)
    store = lm.new_store(max_rows=rows, max_len=hi + GAMMA + 1, block_size=PAGED_BLOCK)
    cache_rows = [store.alloc() for _ in range(rows)]
    for p, n, r in zip(prompts, contexts, cache_rows):  # the contexts, prefilled a row at a time by the torch path
        lm.forward_batch([Row(p[:n], 0, 0, r)], store)

    def reset():
        for r, n in zip(cache_rows, contexts):
            store.crop(r, n)

    out = {}
    for name, t in (("decode", 1), ("verify", GAMMA + 1)):
        step = [Row(p[n : n + t], n, t, r) for p, n, r in zip(prompts, contexts, cache_rows)]  # [B] rows of t tokens
        logits, seconds, first = {}, {}, None
        for kernel in ("torch", "flex"):
            store.attention = kernel
            sync(device)
            t0 = time.perf_counter()
            logits[kernel] = torch.cat(lm.forward_batch(step, store)).float()  # [B * t, V]
            sync(device)
            first = time.perf_counter() - t0 if kernel == "flex" else first
            reset()
            seconds[kernel] = median_seconds(
                lambda: lm.forward_batch(step, store), reps=plan.reps, warmup=plan.warmup, device=device, reset=reset
            )
        diff = (logits["flex"] - logits["torch"]).abs().max() / logits["torch"].abs().max()
        out[name] = {
            "tokens": rows * t,
            "torch_seconds": seconds["torch"],
            "flex_seconds": seconds["flex"],
            "flex_over_torch": seconds["flex"] / seconds["torch"],
            "flex_first_call_seconds": first,
            "max_rel_logit_diff": diff.item(),
            "argmax_agreement": (logits["flex"].argmax(-1) == logits["torch"].argmax(-1)).float().mean().item(),
        }
    return out


def rounded(value):
    """Floats to 4 significant digits, all the way down (measurements, not identities)."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v) for v in value]
    return value


def guarded(name: str, fn) -> dict:
    """fn()'s record, or its error (the next section still runs)."""
    t0 = time.perf_counter()
    try:
        rec = fn()
    except Exception as exc:  # noqa: BLE001 - recorded, and the exit status says it
        traceback.print_exc()
        rec = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
    rec["section_seconds"] = round(time.perf_counter() - t0, 2)
    log(f"{name} done in {rec['section_seconds']} s")
    return rec


def run(args) -> dict:
    """Every section in order, within the budget; the JSON document."""
    plan, device = args.plan, args.device
    budget = Budget(args.budget_s)
    hbm = args.hbm_gbps if device.startswith("cuda") else None
    doc = {"environment": environment(device, args)}
    sections = set(args.sections.split(","))

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(rounded(doc), indent=1, default=str) + "\n")

    pair = None
    if sections & {"exactness", "host_reads"}:
        from viasd.runtime import MaskedLM

        pair = tuple(MaskedLM(m) for m in related_pair(plan.exact_pair, torch.float32, device))
    if "exactness" in sections:
        doc["exactness"] = guarded("exactness", lambda: exactness(*pair, plan, device))
        save()
    if "host_reads" in sections:
        doc["host_reads"] = (
            guarded("host_reads", lambda: host_reads(*pair, plan, budget)) if budget.has(30) else SKIPPED
        )
        save()
    pair = None
    free_memory(device)
    if "throughput" in sections:
        doc["throughput"] = {}
        for p in plan.throughput_pairs:
            enough = budget.has(60 if not args.tiny else 5)
            doc["throughput"][p.name] = (
                guarded(f"throughput {p.name}", lambda: throughput_pair(p, plan, device, hbm, budget))
                if enough
                else SKIPPED
            )
            free_memory(device)
            save()
    if "shard_load" in sections:
        doc["shard_load"] = guarded("shard_load", lambda: shard_load(plan, device)) if budget.has(60) else SKIPPED
        free_memory(device)
        save()
    if "fp8" in sections:
        doc["fp8"] = guarded("fp8", lambda: fp8(plan, device)) if budget.has(30 if not args.tiny else 5) else SKIPPED
        free_memory(device)
        save()
    if "paged_attention" in sections:
        enough = budget.has(60 if not args.tiny else 5)
        doc["paged_attention"] = (
            guarded("paged_attention", lambda: paged_attention(plan, device, budget)) if enough else SKIPPED
        )
        free_memory(device)
        save()
    doc["environment"]["wall_seconds"] = round(budget.elapsed(), 2)
    save()
    return doc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny random shapes, few rows (CPU, seconds)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", help="also write the JSON document here")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall seconds the sections may take")
    ap.add_argument("--hbm-gbps", type=float, default=H200_HBM_GBPS, help="HBM bandwidth for the roofline, GB/s")
    ap.add_argument(
        "--sections", default="exactness,host_reads,throughput,shard_load,fp8,paged_attention", help="comma-separated"
    )
    ap.add_argument("--commit", help="the commit of this tree, recorded where it has no .git (device copies)")
    args = ap.parse_args()
    args.plan = TINY if args.tiny else FULL
    doc = run(args)
    print(json.dumps(rounded(doc), indent=1, default=str))
    exact = doc.get("exactness", {})
    return 0 if exact.get("sd_equals_ar") is True else 1


if __name__ == "__main__":
    sys.exit(main())
