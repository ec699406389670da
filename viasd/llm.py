"""Text in, text out: loads the models of an `EngineConfig` and streams decoded text.

llm = LLM(EngineConfig())                       # the embedded default pair
for delta in llm.stream("def fib(n):", parse_params(mode="via", max_tokens=64)):
    print(delta.text, end="")
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers.decoders import DecodeStream

from viasd import model_thread
from viasd.attention import resolve_paged_attention
from viasd.config import EngineConfig, GenerationParams
from viasd.engine import Engine, GenerationResult, cost_cache_dir
from viasd.errors import InvalidParameterError, MaskError
from viasd.gates import Gates, gates_from_artifact
from viasd.metrics import RequestStats, TokenLogprob
from viasd.precision import engine_dtype, kernels
from viasd.quant import engine_linears
from viasd.runtime import LayerMask, MaskedLM


@dataclass
class TextDelta:
    """New text and token ids of one streamed step; the last delta has the finish reason and stats."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: RequestStats | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry (params.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first delta only (params.prompt_logprobs)
    index: int = 0  # which sample of an n > 1 request


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting multi-byte characters.

    With a fast tokenizer (and no clean-up of tokenization spaces, which reads whole words), each
    token is decoded once, by `tokenizers.decoders.DecodeStream`, which holds back an incomplete
    UTF-8 sequence until a later token completes it: linear in the output. Otherwise the whole
    output is decoded at each push and the part past what was emitted is returned (text ending in
    U+FFFD held back). Either way the deltas add up to `tokenizer.decode(all ids)`: the final push
    emits whatever the stream still held (an incomplete sequence, as U+FFFD).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0  # characters handed out
        backend = getattr(tokenizer, "_tokenizer", None)  # (a fast tokenizer's tokenizers.Tokenizer)
        streams = backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._backend = backend if streams else None
        self._stream = DecodeStream(skip_special_tokens=True) if streams else None

    def push(self, ids: Sequence[int], final: bool = False) -> str:
        self.ids.extend(ids)
        if self._stream is not None:
            delta = "".join(p for t in ids if (p := self._stream.step(self._backend, t)) is not None)
            self.emitted += len(delta)
            if final:  # (what the stream still holds: an incomplete sequence)
                rest = self.tokenizer.decode(self.ids, skip_special_tokens=True)[self.emitted :]
                delta, self.emitted = delta + rest, self.emitted + len(rest)
            return delta
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        delta, self.emitted = text[self.emitted :], len(text)
        return delta


class StopStrings:
    """Cuts streamed text at the first of `params.stop`; holds back a tail that may begin one.

    The one matcher of stop strings, used where the text is detokenized (`LLM.stream`, the
    servers): a stop string is searched in the text emitted so far plus the new text, so one
    that spans several steps is found, and it is not part of the text returned.
    """

    def __init__(self, stops: Sequence[str] | None):
        self.stops = list(stops or ())
        self.pending = ""

    def push(self, text: str, final: bool = False) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        if final:
            out, self.pending = self.pending, ""
            return out, False
        keep = max(
            (
                k
                for s in self.stops
                for k in range(1, min(len(s) - 1, len(self.pending)) + 1)
                if self.pending.endswith(s[:k])
            ),
            default=0,
        )  # longest tail that begins a stop string
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False


def load_mask(
    spec: str | Path | Sequence[int] | None,
    num_layers: int,
    skip_ratio: float = 0.45,
    model=None,
    checkpoint: str | Path | None = None,
) -> LayerMask:
    """A layer mask from a z-vector, a comma list of skipped layers ("3,5,9"), or a JSON file.

    The JSON file is a DIMR artifact (`viasd dimr`; it has a "schema_version": its layer count
    and, when `checkpoint` (the verifier's directory) or `model` (the verifier's transformers
    model) is given, the files' or the weights' fingerprint must match (`check_artifact`), else
    MaskError), or a plain {"skipped_layers": [...], "num_layers": L} or {"z": [0/1 per layer]}.
    None gives the evenly spaced placeholder mask.
    """
    if spec is None:
        return LayerMask.evenly_spaced(skip_ratio, num_layers)
    if isinstance(spec, (list, tuple)):
        return LayerMask.from_z(spec, num_layers)
    spec = str(spec)
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise MaskError(f"cannot read mask file {spec}: {exc}") from None
        if not isinstance(data, dict):
            raise MaskError(f"mask file {spec} holds no JSON object")
        if "schema_version" in data:  # a DIMR artifact: checked against the loaded verifier
            from viasd.dimr import check_artifact, parse_artifact

            return check_artifact(parse_artifact(data, spec), model, num_layers, source=spec, checkpoint=checkpoint)
        if "z" in data:
            return LayerMask.from_z(data["z"], num_layers)
        if data.get("num_layers", num_layers) != num_layers:
            raise MaskError(f"mask file is for {data['num_layers']} layers but the verifier has {num_layers}")
        return LayerMask.from_skipped(data.get("skipped_layers", []), num_layers)
    try:
        skipped = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise MaskError(f"mask {spec!r} is neither a JSON file nor a comma-separated list of layer indices") from None
    return LayerMask.from_skipped(skipped, num_layers)


class LLM:
    """The engine with its tokenizer: what the CLI, the benchmark and the servers call."""

    def __init__(self, config: EngineConfig, mask: str | Path | Sequence[int] | None = None):
        # on the model thread (viasd.model_thread): the dtype probe, loading and packing start
        # OpenMP teams, and the thread that runs the forwards must be the only one that has one
        model_thread.run(self._load, config, mask)

    def _load(self, config: EngineConfig, mask: str | Path | Sequence[int] | None) -> None:
        from viasd.models.loader import load_causal_lm

        if config.threads:
            torch.set_num_threads(config.threads)
        self.config = config
        # (refused before any loading when it cannot run here, as fp8 is)
        self.paged_attention = resolve_paged_attention(config.paged_attention, config.device, config.block_size)
        self.dtype_choice = engine_dtype(config)  # `auto`: what runs fastest here at max_batch rows a step
        dtype = self.dtype_choice.dtype
        model, self.tokenizer = load_causal_lm(
            config.verifier, dtype=dtype, device=config.device, trust_remote_code=config.trust_remote_code
        )
        layer_mask, self.mask_source = self._mask(mask, model)  # (fingerprint of the weights as loaded)
        gates, self.gates_source = resolve_gates(config, layer_mask, mask)

        def pack(m, spec):  # quantized (viasd.quant) and prepacked (viasd.precision), before MaskedLM takes them
            return engine_linears(m, config, config.device, spec, dtype)

        reports = [pack(model, config.verifier)]
        self.verifier = MaskedLM(model)
        self.drafter = None
        if config.drafter:
            drafter = load_causal_lm(
                config.drafter, dtype=dtype, device=config.device, trust_remote_code=config.trust_remote_code
            )[0]
            reports.append(pack(drafter, config.drafter))
            self.drafter = MaskedLM(drafter)
        self.kernels = kernels(reports)
        self.engine = Engine(
            self.verifier,
            self.drafter,
            mask=layer_mask,
            cache_policy=config.cache_policy,
            eos_token_ids=eos_ids(self.tokenizer, model),
            max_context=config.max_context,
            max_batch=config.max_batch,
            max_seq_len=config.max_seq_len,
            kv_cache_gib=config.kv_cache_gib,
            prefill_chunk=config.prefill_chunk,
            kv_block_size=config.kv_block_size,
            prefix_caching=config.prefix_caching,
            paged_attention=self.paged_attention.kernel,
            cost_cache_dir=cost_cache_dir(),
            gates=gates,
        )

    def runtime_info(self) -> dict:
        """How this engine runs here: the dtype choice (and why), the CPU capability, the kernels
        (and the weight quantization of each model, viasd.quant), the kernel that reads paged caches
        (and why, viasd.attention)."""
        return {**self.dtype_choice.as_dict(), **self.kernels, **self.paged_attention.as_dict()}

    def _mask(self, mask, model) -> tuple[LayerMask, str]:
        return resolve_mask(self.config, model, mask)

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
        """Token ids of a raw prompt, or of chat messages rendered with the tokenizer's template."""
        return encode_prompt(self.tokenizer, prompt, messages)

    def stream(self, prompt_ids: Sequence[int], params: GenerationParams) -> Iterator[TextDelta]:
        """Text deltas of every sample (`delta.index`); a sample that meets one of `params.stop`
        ends there with finish_reason "stop" (the stop string is not in its text)."""
        detok = [IncrementalDetokenizer(self.tokenizer) for _ in range(params.n)]
        stops = [StopStrings(params.stop) for _ in range(params.n)]
        samples = self.engine.submit(prompt_ids, params).samples
        stopped: set[int] = set()
        stream = self.engine.follow(samples)
        try:
            for chunk in stream:
                i = chunk.index
                if i in stopped:  # chunks a stopped sample committed before it left
                    continue
                text, hit = stops[i].push(detok[i].push(chunk.token_ids, final=chunk.finished), final=chunk.finished)
                finish, stats = chunk.finish_reason, chunk.stats
                if hit:  # the sample ends here; unfinished, it leaves the engine at the next step
                    if not chunk.finished:
                        self.engine.cancel(samples[i])
                    stopped.add(i)
                    finish, stats = "stop", samples[i].stats
                    stats.finish_reason = "stop"
                yield TextDelta(text, chunk.token_ids, finish, stats, chunk.logprobs, chunk.prompt_logprobs, i)
        finally:
            stream.close()

    def complete(self, prompt_ids: Sequence[int], params: GenerationParams) -> GenerationResult:
        return self.engine.complete(prompt_ids, params)

    def complete_n(self, prompt_ids: Sequence[int], params: GenerationParams) -> list[GenerationResult]:
        return self.engine.complete_n(prompt_ids, params)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def resolve_mask(
    config: EngineConfig,
    model,
    mask: str | Path | Sequence[int] | None = None,
    checkpoint: str | Path | None = None,
) -> tuple[LayerMask, str]:
    """The slim verifier's mask and where it came from: the argument, the config, the shipped
    DIMR mask of a built-in verifier at this skip ratio (fingerprint checked), else evenly spaced.

    ``model`` is the verifier's transformers model: whole, unless ``checkpoint``'s files are those
    the artifact was searched on (`mask_needs_weights` is False), when only its layer count is
    read. Used by :class:`LLM` and by the verifier actors, so a served pipeline runs the mask an
    in-process one would.
    """
    n = len(model.model.layers)
    spec = mask if mask is not None else config.mask
    if spec is not None:
        where = f"file {spec}" if _is_file(spec) else f"given {spec}"
        return load_mask(spec, n, config.skip_ratio, model=model, checkpoint=checkpoint), where
    from viasd.dimr import shipped_mask

    shipped, why = shipped_mask(config.verifier, config.skip_ratio, model, checkpoint=checkpoint)
    if shipped is not None:
        return shipped, why
    return load_mask(None, n, config.skip_ratio), f"evenly spaced, skip ratio {config.skip_ratio:g} ({why})"


def mask_needs_weights(config: EngineConfig, checkpoint: str | Path) -> bool:
    """Whether resolving the mask must check a DIMR artifact against the verifier's whole weights:
    an artifact applies (the file given, or those shipped for this verifier) that was not
    searched on the files in `checkpoint` (`viasd.dimr.files_match`). False: a rank may load
    only its slices."""
    from viasd.dimr import files_match, parse_artifact, shipped_artifacts

    if config.mask is not None:
        if not _is_file(config.mask):
            return False
        try:
            data = json.loads(Path(config.mask).read_text())
        except (OSError, json.JSONDecodeError):
            return True  # (resolving it reports the error)
        return "schema_version" in data and not files_match(parse_artifact(data, config.mask), checkpoint)
    shipped = [a for _, a in shipped_artifacts() if a.verifier == config.verifier]
    return not all(files_match(a, checkpoint) for a in shipped)


def _is_file(spec) -> bool:
    return isinstance(spec, (str, Path)) and str(spec).endswith(".json")


def resolve_gates(
    config: EngineConfig, mask: LayerMask, spec: str | Path | Sequence[int] | None = None
) -> tuple[Gates | None, str]:
    """The gates `via` requests get when they choose none, and where they came from: the calibrated
    gates of the mask's DIMR artifact (the file given, or the shipped one with the same layers),
    or None (the paper's: GenerationParams' defaults) with `gates: paper` or when it has none."""
    from viasd.dimr import read_artifact, shipped_artifacts

    if config.gates == "paper":
        return None, "paper (gates: paper)"
    spec = spec if spec is not None else config.mask
    if isinstance(spec, (str, Path)) and str(spec).endswith(".json"):
        found = [(str(spec), read_artifact(spec))]
    elif spec is not None:  # layers given by hand: no artifact, no calibration
        return None, "paper (the mask was given as layers, not a DIMR artifact)"
    else:
        found = [
            (f"viasd/masks/{n}", a)
            for n, a in shipped_artifacts()
            if a.verifier == config.verifier
            and a.num_layers == mask.num_layers
            and tuple(a.skipped_layers) == tuple(mask.skipped)
        ]
    for where, art in found:
        gates = gates_from_artifact(art.gates)
        if gates is not None:
            return (
                gates,
                f"calibrated ({where}): alpha1 {gates.alpha1:g}, alpha2 {gates.alpha2:g}, region B {gates.region_b}",
            )
    return None, "paper (the mask has no calibrated gates)"


def encode_prompt(tokenizer, prompt: str | None = None, messages: list[dict] | None = None) -> list[int]:
    """Token ids of a raw prompt, with the tokenizer's special tokens (a BOS where the model has
    one, as vLLM's completions), or of chat messages rendered with the tokenizer's template (which
    places them itself) (InvalidParameterError naming the field; a model without tokenizer takes
    token ids only)."""
    if (prompt is None) == (messages is None):
        raise InvalidParameterError("prompt", "give exactly one of prompt or messages")
    if tokenizer is None:
        raise InvalidParameterError(
            "prompt" if messages is None else "messages", "this model has no tokenizer; send prompt_token_ids"
        )
    if messages is not None:
        if not messages:
            raise InvalidParameterError("messages", "must contain at least one message")
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    if not isinstance(prompt, str) or not prompt:
        raise InvalidParameterError("prompt", "must be a non-empty string")
    return tokenizer.encode(prompt, add_special_tokens=True)


def eos_ids(tokenizer, model) -> tuple[int, ...]:
    """End-of-sequence ids from the generation config and the tokenizer (deduplicated; the
    tokenizer may be None)."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if src is None:
            continue
        ids.extend([src] if isinstance(src, int) else list(src))
    return tuple(dict.fromkeys(ids))
