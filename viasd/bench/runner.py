"""The benchmark loop: every method on the same prompts, pair and seeds, interleaved in one process.

For each seed, repeat and prompt, the methods run back to back in an order rotated by
(prompt + repeat), so slow phases of the machine (thermal, other processes) hit every method
alike. Every method decodes with the SAME loaded model objects: our engine through `Engine`
objects built around the loaded `MaskedLM`s (one per mask / cache policy, cheap: no reload), and
transformers' `generate` / assisted generation on the very `nn.Module`s those wrap.

A method that raises is recorded (its error and traceback, per run) and the loop goes on.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from viasd import model_thread
from viasd.bench.methods import Method, matched_baseline, parse_method, random_mask_skipped
from viasd.bench.workloads import Prompt
from viasd.config import CachePolicy, GenerationParams, Mode
from viasd.engine import Engine, cost_cache_dir
from viasd.errors import InvalidParameterError, MaskError, require
from viasd.runtime import LayerMask, MaskedLM


class RSSSampler:
    """Peak resident set size of this process while a block runs, sampled by a thread every
    `interval` seconds (psutil). It sees what the OS sees: model weights, caches, allocator pools;
    memory the allocator kept from an earlier method counts as already resident."""

    def __init__(self, interval: float = 0.01):
        psutil = require("psutil", "bench")
        self._proc = psutil.Process()
        self.interval = interval
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _rss(self) -> int:
        return self._proc.memory_info().rss

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> RSSSampler:
        self.start = self.peak = self._rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())


class _FirstTokenTimer:
    """A transformers streamer that records when the first generated token arrives."""

    def __init__(self):
        self.calls = 0
        self.first: float | None = None

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


@contextlib.contextmanager
def _count_forwards(modules: dict[str, torch.nn.Module]) -> Iterator[tuple[dict[str, int], dict[str, float]]]:
    """Count and time top-level forward calls of HF models (our engine calls layers, never these)."""
    counts = dict.fromkeys(modules, 0)
    seconds = dict.fromkeys(modules, 0.0)
    handles = []
    for name, mod in modules.items():
        started: list[float] = []

        def pre(_m, _i, started=started):
            _sync(next(_m.parameters()).device)
            started.append(time.perf_counter())

        def post(_m, _i, _o, name=name, started=started):
            _sync(next(_m.parameters()).device)
            counts[name] += 1
            seconds[name] += time.perf_counter() - started.pop()

        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    try:
        yield counts, seconds
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _patched(obj: Any, **values: Any) -> Iterator[None]:
    old = {k: getattr(obj, k) for k in values}
    for k, v in values.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class MaskInfo:
    """The layer mask a `via` method ran with, and where it came from."""

    mask: LayerMask
    source: str  # "searched (...)", "evenly spaced", "random (seed s)", "given", "file ..."

    def describe(self) -> dict:
        return {"skipped_layers": list(self.mask.skipped), "ratio": self.mask.ratio, "source": self.source}


class Bench:
    """Runs methods on prompts with one loaded verifier / drafter pair.

    `tokenizer` is optional: without it prompts must carry token ids and no pass@1 is computed.
    `searched_masks` maps a number of skipped layers to a searched mask (and its source).
    """

    def __init__(
        self,
        verifier: MaskedLM,
        drafter: MaskedLM | None = None,
        *,
        tokenizer=None,
        mask: LayerMask | None = None,
        mask_source: str = "evenly spaced",
        cache_policy: CachePolicy | str = CachePolicy.SEPARATE,
        eos_token_ids: Sequence[int] = (),
        max_context: int | None = None,
        searched_masks: dict[int, tuple[LayerMask, str]] | None = None,
        skip_ratio: float = 0.45,
        collect_garbage: bool = True,
    ):
        self.verifier = verifier
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.default_mask = mask if mask is not None else LayerMask.evenly_spaced(skip_ratio, verifier.num_layers)
        self.default_mask_source = mask_source
        self.cache_policy = CachePolicy(cache_policy)
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_context = max_context
        self.searched_masks = dict(searched_masks or {})
        if mask_source.startswith("searched"):
            self.searched_masks.setdefault(len(self.default_mask.skipped), (self.default_mask, mask_source))
        self.collect_garbage = collect_garbage  # a full gc before each run (off for tiny models: not worth it)
        self._engines: dict[tuple, Engine] = {}

    @classmethod
    def from_llm(cls, llm, *, mask_source: str | None = None, searched_masks=None) -> Bench:
        """Around an already loaded `viasd.llm.LLM` (its verifier, drafter, tokenizer and mask)."""
        e = llm.engine
        source = mask_source or getattr(llm, "mask_source", None) or "evenly spaced"
        return cls(
            llm.verifier,
            llm.drafter,
            tokenizer=llm.tokenizer,
            mask=e.mask,
            mask_source=source,
            cache_policy=e.cache_policy,
            eos_token_ids=e.eos_token_ids,
            max_context=e.max_context,
            searched_masks=searched_masks,
        )

    # ------------------------------------------------------------------ masks and engines

    def resolve_mask(self, method: Method) -> MaskInfo:
        """The layer mask of a `via` method (see `viasd.bench.methods` for the spellings)."""
        num_layers = self.verifier.num_layers
        spec = method.mask
        ratio = method.skip_ratio if method.skip_ratio is not None else self.default_mask.ratio
        n_skip = min(round(ratio * num_layers), max(num_layers - 2, 0))
        if spec == "default":
            return MaskInfo(self.default_mask, self.default_mask_source)
        if spec in ("searched", "auto"):
            if n_skip in self.searched_masks:
                mask, source = self.searched_masks[n_skip]
                return MaskInfo(mask, source)
            if spec == "searched":
                have = sorted(self.searched_masks) or "none"
                raise MaskError(f"no searched mask with {n_skip} skipped layers (have: {have})")
            return MaskInfo(
                LayerMask.evenly_spaced(ratio, num_layers), "evenly spaced (no searched mask at this ratio)"
            )
        if spec == "even":
            return MaskInfo(LayerMask.evenly_spaced(ratio, num_layers), "evenly spaced")
        if spec == "random" or spec.startswith("random@"):
            seed = int(spec.partition("@")[2] or 0)
            skipped = random_mask_skipped(num_layers, n_skip / num_layers, seed)
            return MaskInfo(LayerMask.from_skipped(skipped, num_layers), f"random (seed {seed})")
        if all(part.strip().isdigit() for part in spec.split("+")):
            return MaskInfo(LayerMask.from_skipped([int(s) for s in spec.split("+")], num_layers), "given")
        from viasd.llm import load_mask

        return MaskInfo(load_mask(spec, num_layers), f"file {spec}")

    def engine_for(self, method: Method) -> tuple[Engine, MaskInfo | None]:
        info = self.resolve_mask(method) if method.mode == Mode.VIA else None
        mask = info.mask if info else self.default_mask
        policy = CachePolicy(method.cache_policy) if method.cache_policy else self.cache_policy
        key = (mask.keep, policy)
        if key not in self._engines:
            self._engines[key] = Engine(
                self.verifier,
                self.drafter,
                mask=mask,
                cache_policy=policy,
                eos_token_ids=self.eos_token_ids,
                max_context=self.max_context,
                cost_cache_dir=cost_cache_dir(),
            )
        return self._engines[key], info

    # ------------------------------------------------------------------ prompts and text

    def encode(self, prompt: Prompt) -> list[int]:
        if prompt.ids is not None:
            return list(prompt.ids)
        if self.tokenizer is None:
            raise InvalidParameterError("prompt", f"prompt {prompt.id} has no token ids and the bench has no tokenizer")
        if prompt.messages is not None:
            out = self.tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=True)
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        return self.tokenizer.encode(prompt.text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ------------------------------------------------------------------ one run

    def run_one(self, method: Method, prompt_ids: list[int], params: GenerationParams) -> dict:
        """Decode one prompt with one method; the figures of that run (raises on failure)."""
        device = self.verifier.device
        if self.collect_garbage:
            gc.collect()  # garbage of the previous run is not this run's memory or pause
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        load_before = os.getloadavg()[0]
        cpu0 = time.process_time()
        with RSSSampler() as rss:
            if method.kind == "engine":
                out = self._run_engine(method, prompt_ids, params)
            else:  # (on the model thread, as the engine's forwards: viasd.model_thread)
                out = model_thread.run(self._run_hf, method, prompt_ids, params)
        out["cpu_seconds"] = time.process_time() - cpu0  # this process, all threads
        # the 1-minute load average around the run: above the core count, other processes competed
        out["loadavg"] = [load_before, os.getloadavg()[0]]
        out["rss_start_bytes"] = rss.start
        out["peak_rss_bytes"] = rss.peak
        out["peak_rss_delta_bytes"] = rss.peak - rss.start
        if device.type == "cuda":
            out["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
        n, sec = len(out["tokens"]), out["seconds"]
        out["generated_tokens"] = n
        out["tokens_per_second"] = n / sec if sec > 0 else None
        return out

    def _run_engine(self, method: Method, prompt_ids: list[int], params: GenerationParams) -> dict:
        engine, _ = self.engine_for(method)
        _sync(self.verifier.device)
        t0 = time.perf_counter()
        res = engine.complete(prompt_ids, params)
        _sync(self.verifier.device)
        seconds = time.perf_counter() - t0
        stats = res.stats.to_dict()
        return {
            "tokens": list(res.token_ids),
            "seconds": seconds,
            "time_to_first_token": stats["time_to_first_token"],
            "kv_bytes": stats["kv_bytes"],  # valid entries of every tier's row when it finished
            "stats": stats,
        }

    def _run_hf(self, method: Method, prompt_ids: list[int], params: GenerationParams) -> dict:
        from transformers import GenerationConfig

        model = self.verifier.model
        assisted, lookup = method.kind == "hf_assisted", method.kind == "hf_lookup"
        if assisted and self.drafter is None:
            raise InvalidParameterError("methods", "hf-assisted needs a drafter")
        n = params.max_tokens
        if self.max_context is not None:
            n = min(n, self.max_context - len(prompt_ids))
        pad = self.eos_token_ids[0] if self.eos_token_ids else 0
        sampling = (
            {}
            if params.greedy
            else {
                "temperature": params.temperature,
                "top_k": params.top_k,
                "top_p": params.top_p,
                "min_p": params.min_p or None,
            }
        )
        gen_cfg = GenerationConfig(
            max_new_tokens=n, do_sample=not params.greedy, pad_token_id=pad, repetition_penalty=1.0, **sampling
        )
        stops = params.stop_token_ids if params.stop_token_ids is not None else self.eos_token_ids
        if not params.ignore_eos:
            gen_cfg.eos_token_id = list(stops) or None
        models = {"full": model}
        kwargs: dict[str, Any] = {}
        patches = [_patched(model.generation_config, eos_token_id=None)] if params.ignore_eos else []
        if assisted:
            draft = self.drafter.model
            models["drafter"] = draft
            kwargs["assistant_model"] = draft
            if method.hf_draft == "fixed":  # exactly gamma draft tokens a cycle, like our sd / via
                patches.append(
                    _patched(
                        draft.generation_config,
                        num_assistant_tokens=params.gamma,
                        num_assistant_tokens_schedule="constant",
                        assistant_confidence_threshold=0.0,
                    )
                )
        if lookup:  # HF's prompt lookup decoding: the n-gram proposer's peer
            gen_cfg.prompt_lookup_num_tokens = params.gamma
            gen_cfg.max_matching_ngram_size = params.ngram_max
        ids = torch.tensor([prompt_ids], device=model.device)
        timer = _FirstTokenTimer()
        if params.seed is not None:
            torch.manual_seed(params.seed)
        with contextlib.ExitStack() as stack, _quiet_transformers():
            for p in patches:
                stack.enter_context(p)
            counts, model_seconds = stack.enter_context(_count_forwards(models))
            _sync(model.device)
            t0 = time.perf_counter()
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg, streamer=timer, **kwargs
            )
            _sync(model.device)
            seconds = time.perf_counter() - t0
        tokens = out[0, len(prompt_ids) :].tolist()
        forwards = {"drafter": counts.get("drafter", 0), "slim": 0, "full": counts["full"]}
        stats: dict[str, Any] = {
            "forwards": forwards,
            "seconds": {"drafter": model_seconds.get("drafter", 0.0), "slim": 0.0, "full": model_seconds["full"]},
        }
        if (assisted or lookup) and forwards["full"]:
            # every assisted cycle is one verifier forward and commits accepted + 1 tokens
            stats["num_drafts"] = forwards["full"]
            stats["num_cycle_tokens"] = len(tokens)
            stats["mean_acceptance_length"] = len(tokens) / forwards["full"]
        return {
            "tokens": tokens,
            "seconds": seconds,
            "time_to_first_token": None if timer.first is None else timer.first - t0,
            "kv_bytes": None,
            "stats": stats,
        }

    # ------------------------------------------------------------------ the whole run

    def plan(
        self,
        methods: Sequence[Method],
        base: GenerationParams,
        *,
        add_reference: bool = True,
        add_matched_baselines: bool = True,
    ) -> list[dict]:
        """The method table: each distinct method once; equivalent ones (same decode) alias the first.

        Adds `ar` (the reference of every speed ratio) when missing, and the matched baseline of
        every lossy `via` method (seed 003).
        """
        ordered = list(methods)
        labels = {m.label for m in ordered}
        if add_reference and "ar" not in labels:
            ordered.insert(0, parse_method("ar", base))
        if add_matched_baselines:
            for m in list(ordered):
                mb = matched_baseline(m, base)
                if mb is not None and mb.label not in {x.label for x in ordered}:
                    ordered.append(mb)
        baselines = {mb.label for mb in (matched_baseline(m, base) for m in ordered) if mb is not None}
        table: list[dict] = []
        by_key: dict[str, str] = {}
        for m in ordered:
            k = m.key()
            mb = matched_baseline(m, base)
            table.append(
                {
                    **m.describe(),
                    "alias_of": by_key.get(k),
                    "matched_baseline": mb.label if mb else None,
                    "role": "matched baseline" if m.label in baselines else None,
                    "method": m,
                }
            )
            by_key.setdefault(k, m.label)
        return table

    def run(
        self,
        methods: Sequence[Method],
        prompts: Sequence[Prompt],
        base: GenerationParams,
        *,
        repeats: int = 1,
        seeds: Sequence[int] = (0,),
        warmup_tokens: int = 8,
        progress: bool | Callable[[int], Any] = True,
        pass_at_1: bool = True,
        exec_timeout: float = 10.0,
        add_reference: bool = True,
        time_budget: float | None = None,
    ) -> dict:
        """Run every method on every prompt, `repeats` times per seed, interleaved.

        Returns {"methods": [...], "prompts": [...], "runs": [...]}: one run record per (method,
        prompt, seed, repeat), with the generated tokens, text, timings, counters, memory and
        (for executable prompts) the pass@1 outcome. Summaries: `viasd.bench.report.summarize`.
        With `time_budget` (seconds), no new (seed, repeat, prompt) round starts once it is spent:
        every method keeps the same prompts, and "stopped_early" says how many rounds were skipped.
        """
        table = self.plan(methods, base, add_reference=add_reference)
        by_key: dict[str, str] = {}
        for e in table:  # resolve masks up front: the results say which mask ran, and two
            m = e["method"]  # spellings of one mask run once
            skipped = None
            if m.mode == Mode.VIA and m.kind == "engine":
                try:
                    info = self.resolve_mask(m)
                    e["mask_info"] = info.describe()
                    skipped = info.mask.skipped
                except Exception as exc:  # reported as a failure of every run of this method
                    e["mask_info"] = {"error": f"{type(exc).__name__}: {exc}"}
            k = m.key(skipped)
            if e["alias_of"] is None and k in by_key:
                e["alias_of"] = by_key[k]
            by_key.setdefault(k, e["alias_of"] or m.label)
        live = [e for e in table if e["alias_of"] is None]
        encoded: list[list[int] | BaseException] = []
        for p in prompts:
            try:
                encoded.append(self.encode(p))
            except Exception as exc:
                encoded.append(exc)

        if warmup_tokens:
            self._warmup(live, encoded, warmup_tokens)

        total = len(seeds) * repeats * len(prompts) * len(live)
        bar = _progress(total, progress)
        runs: list[dict] = []
        deadline = None if time_budget is None else time.perf_counter() + time_budget
        skipped_rounds = 0
        for seed in seeds:
            for rep in range(repeats):
                for pi, prompt in enumerate(prompts):
                    if deadline is not None and time.perf_counter() > deadline:
                        skipped_rounds += 1
                        continue
                    shift = (pi + rep) % len(live)
                    for entry in live[shift:] + live[:shift]:
                        m: Method = entry["method"]
                        params = m.params.model_copy(update={"seed": seed})
                        rec = {
                            "method": m.label,
                            "prompt": prompt.id,
                            "prompt_index": pi,
                            "seed": seed,
                            "repeat": rep,
                            "temperature": params.temperature,
                            "ok": False,
                            "error": None,
                        }
                        bar.set_postfix_str(f"{m.label} {prompt.id}", refresh=False)
                        try:
                            ids = encoded[pi]
                            if isinstance(ids, BaseException):
                                raise ids
                            rec["prompt_tokens"] = len(ids)
                            rec.update(self.run_one(m, ids, params))
                            rec["text"] = self.decode(rec["tokens"])
                            rec["ok"] = True
                        except Exception as exc:  # a crashing method is reported, never hidden
                            rec["error"] = f"{type(exc).__name__}: {exc}"
                            rec["traceback"] = traceback.format_exc(limit=8)
                        runs.append(rec)
                        bar.update(1)
        bar.close()
        if pass_at_1:
            self._score(runs, prompts, exec_timeout)
        for e in table:
            e.pop("method")
        return {
            "methods": table,
            "prompts": [
                {"id": p.id, "tokens": None if isinstance(x, BaseException) else len(x), "executable": p.executable}
                for p, x in zip(prompts, encoded)
            ],
            "runs": runs,
            "stopped_early": skipped_rounds,
        }

    def _warmup(self, live: list[dict], encoded: list, tokens: int) -> None:
        """One short untimed decode per method: one-time costs (allocations, kernel selection)
        out of the timed runs. Failures here are ignored: they recur, and are reported, later."""
        ids = next((x for x in encoded if not isinstance(x, BaseException)), None)
        if ids is None:
            return
        for e in live:
            m: Method = e["method"]
            with contextlib.suppress(Exception):
                self.run_one(m, ids, m.params.model_copy(update={"max_tokens": tokens, "seed": 0}))

    def _score(self, runs: list[dict], prompts: Sequence[Prompt], timeout: float) -> None:
        from viasd.bench.execution import check_many

        jobs, targets = [], []
        for r in runs:
            prob = prompts[r["prompt_index"]].problem
            if r["ok"] and r.get("text") is not None and prompts[r["prompt_index"]].executable:
                jobs.append((prob, r["text"]))
                targets.append(r)
        for r, res in zip(targets, check_many(jobs, timeout=timeout)):
            r["passed"], r["exec_result"] = res.passed, res.result


class _NoBar:
    def __init__(self, callback=None):
        self.n = 0
        self.callback = callback

    def update(self, k: int) -> None:
        self.n += k
        if self.callback:
            self.callback(self.n)

    def set_postfix_str(self, *a, **k) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, progress):
    if progress is True:
        from tqdm import tqdm

        return tqdm(total=total, unit="run", desc="bench", dynamic_ncols=True, smoothing=0.05)
    return _NoBar(progress if callable(progress) else None)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers warns on every assisted call that it sets generation arguments itself."""
    log = logging.getLogger("transformers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)
