"""Request parameters: one pydantic model shared by the engine, the servers and the client SDK.

Defaults follow the VIA-SD paper (gamma 5, alpha1 0.5, alpha2 0.3). This module imports only
pydantic, so the light client install can validate a request before it touches the network.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from viasd.errors import InvalidParameterError

M = TypeVar("M", bound=BaseModel)

MAX_GAMMA = 32
MAX_STOP_TOKEN_IDS = 1024  # each committed token is checked against them
MIN_TEMPERATURE = 1e-4  # below it logits / temperature overflows float32 into inf (and NaN probabilities)
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (each is added to every processed row)
MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_STOP_STRINGS = 16  # each is searched in the detokenized text after every step
MAX_N = 128  # samples per request: each holds cache rows of its own after the shared prefill
DEFAULT_KV_BLOCK_SIZE = 16  # positions per KV block (vLLM's default; FlexAttention on CUDA needs a power of two >= 16)


class Mode(str, Enum):
    """Which decoder serves a request."""

    AR = "ar"  # q alone, one token per forward
    SD = "sd"  # p -> q, two-tier speculative decoding
    VIA = "via"  # p -> q' -> q, three-tier VIA-SD
    AUTO = "auto"  # per step, the plan with the most expected tokens per second (viasd.planner)


class RegionB(str, Enum):
    """What the slim verifier does with a draft token in region B (alpha2 <= r < alpha1)."""

    REWRITE = "rewrite"  # the paper's rule: commit a token sampled from q', end the cycle
    ESCALATE = "escalate"  # "pre-check": region B escalates like region C (accept-or-escalate)


class Rule(str, Enum):
    """The acceptance rule the full verifier q applies to escalated positions (and in `sd`)."""

    LOSSLESS = "lossless"  # min(1, q/p), residual norm(max(0, q - p)): output ~ q exactly
    LOSSY = "lossy"  # the (alpha, beta) relaxation of the paper's appendix A
    OVERSHOOT = "overshoot"  # overshoot ceiling of seed 003: the draft's excess over q/l is capped
    STAGED = (
        "staged"  # `via` only, lossless: q' filters the block with min(1, q'/p), then q verifies it with min(1, q/q')
    )


class Proposer(str, Enum):
    """Who proposes the draft block (viasd.proposers)."""

    MODEL = "model"  # the drafter model p
    NGRAM = "ngram"  # prompt lookup: copy what followed the latest earlier match of the last n tokens (no model)
    HYBRID = "hybrid"  # n-gram when the context has a match, else the drafter model


class CachePolicy(str, Enum):
    """How the slim verifier q' keeps its keys/values (docs/ARCHITECTURE.md, "Caches")."""

    SEPARATE = "separate"  # q' has its own cache for the kept layers: an exact sub-model
    SHARED = "shared"  # q' writes into q's cache slots; q overwrites them when it escalates


class LogprobTier(str, Enum):
    """Which verifier's distribution gives the logprobs of a token the slim tier committed (mode `via`)."""

    FULL = "full"  # q: recomputed with one full forward over the cycle's tokens (extra cost)
    SLIM = "slim"  # q': the slim verifier's logits of the cycle (free; q' is an approximation of q)


class GenerationParams(BaseModel):
    """Everything a request may choose. Validated once, here, for every entry point."""

    model_config = ConfigDict(extra="forbid", use_enum_values=False, frozen=True)

    mode: Mode = Field(
        Mode.AUTO,
        description="Decoder: 'auto' (a plan per step, the fastest lossless one unless auto_lossy), 'ar' (verifier "
        "alone), 'sd' (two-tier), 'via' (three-tier).",
    )
    max_tokens: int = Field(
        128,
        ge=0,
        le=1 << 20,
        description="Maximum number of new tokens to generate; 0 only with prompt_logprobs (score the prompt).",
    )
    temperature: float = Field(
        0.0, ge=0.0, le=100.0, description="Sampling temperature; 0 means greedy (argmax, lowest token id on ties)."
    )
    top_k: int = Field(0, ge=0, description="Keep only the k most likely tokens before sampling; 0 disables.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: keep the smallest set with mass >= top_p.")
    min_p: float = Field(
        0.0, ge=0.0, lt=1.0, description="Drop tokens whose probability is below min_p times the most likely one's."
    )
    seed: int | None = Field(
        None, ge=0, le=2**63 - 1, description="Per-request random seed; the same seed gives the same output."
    )
    gamma: int = Field(5, ge=1, le=MAX_GAMMA, description="Draft block length: tokens the drafter proposes per cycle.")
    alpha1: float = Field(
        0.5, gt=0.0, le=1.0, description="Accept gate: a draft token is accepted by q' when q'(x)/max q' >= alpha1."
    )
    alpha2: float = Field(
        0.3, ge=0.0, lt=1.0, description="Escalate gate: below alpha2 the position is handed to the full verifier q."
    )
    region_b: RegionB = Field(
        RegionB.REWRITE, description="Region B behaviour: 'rewrite' with q' (paper) or 'escalate' (pre-check variant)."
    )
    slim_bonus: bool = Field(
        False, description="When q' accepts the whole block, also commit a bonus token sampled from q'_{gamma+1}."
    )
    proposer: Proposer = Field(
        Proposer.MODEL,
        description="Draft proposer: 'model' (drafter p), 'ngram' (prompt lookup), 'hybrid' (n-gram first).",
    )
    ngram_max: int = Field(
        3, ge=1, le=8, description="Prompt lookup: longest suffix n-gram matched in the context (tries n..1)."
    )
    draft_confidence: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Adaptive drafting: end a model-drafted block after a token whose drafter probability "
        "(temperature 1) is below this; 0 disables.",
    )
    adaptive_gamma: bool = Field(
        False,
        description="Adapt the block length per request from its acceptance: +2 after a fully accepted "
        "block, -1 otherwise, within [1, gamma].",
    )
    overlap: bool = Field(
        False,
        description="Overlap drafting and verification (PEARL-style): draft the next block from the "
        "optimistic prefix while the verifier checks this one; keep it where the outcome agrees.",
    )
    rule: Rule = Field(
        Rule.LOSSLESS,
        description="Acceptance rule of the full verifier: lossless, lossy, overshoot, or staged "
        "(mode 'via' only: q' filters and corrects the draft losslessly, then q verifies the filtered block "
        "losslessly; the output follows q exactly and the gates alpha1 / alpha2 are not used).",
    )
    lossy_alpha: float = Field(
        0.0, ge=0.0, lt=1.0, description="Lossy rule: accept x with probability min(1, q(x) / ((1 - alpha) p(x)))."
    )
    lossy_beta: float = Field(
        1.0, gt=0.0, le=1.0, description="Lossy rule: on rejection sample from norm(max(0, q - beta p))."
    )
    overshoot_ceiling: float = Field(
        1.0, gt=0.0, le=1.0, description="Overshoot rule: the draft's probability is capped at q(x)/l (l=1: lossless)."
    )
    stop_token_ids: tuple[int, ...] | None = Field(
        None,
        max_length=MAX_STOP_TOKEN_IDS,
        description="Token ids that end generation (at most 1024); default: the tokenizer's end-of-sequence tokens.",
    )
    ignore_eos: bool = Field(False, description="Keep generating past end-of-sequence tokens (benchmarks).")
    presence_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description="Subtracted from the logit of every token the output already contains "
        "(OpenAI / vLLM); > 0 favours new tokens.",
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description="Subtracted from a token's logit once per occurrence in the output "
        "(OpenAI / vLLM); > 0 discourages repetition.",
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        le=100.0,
        description="CTRL / vLLM repetition penalty on every token of the prompt and output: "
        "a positive logit is divided by it, a negative one multiplied; 1 disables.",
    )
    logit_bias: dict[int, float] | None = Field(
        None,
        max_length=MAX_LOGIT_BIAS,
        description="Token id -> bias in [-100, 100] added to its logit before "
        "the penalties (OpenAI / vLLM); at most 1024 entries.",
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Return the log-probability of every generated token under the "
        "full verifier (raw logits, before penalties and temperature) and of the k most likely tokens (0..20); "
        "None or false: no logprobs; true: 0 alternatives (OpenAI chat's flag).",
    )
    logprobs_tier: LogprobTier = Field(
        LogprobTier.FULL,
        description="Mode via: logprobs of tokens the slim tier committed come from q recomputed "
        "('full', one extra full forward per such cycle) or from q' ('slim', free, approximate).",
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="Return the full verifier's log-probability of every prompt "
        "token given its prefix (the first has none) and the k most likely tokens there; None: none.",
    )
    stop: tuple[str, ...] | None = Field(
        None,
        max_length=MAX_STOP_STRINGS,
        description="Strings that end the text (not included in it), matched "
        "on the detokenized text (viasd.llm.StopStrings: LLM.stream and the serving layer, every transport); at "
        "most 16, each non-empty. LLM.complete, which returns token ids only, does not apply them.",
    )
    n: int = Field(
        1,
        ge=1,
        le=MAX_N,
        description="Samples of the prompt: n requests sharing one prefill; sample i uses "
        "seed sample_seed(seed, i) (sample 0: the request's seed).",
    )
    auto_lossy: bool = Field(
        False,
        description="Mode 'auto' may choose the lossy three-tier plan (via, gated by alpha1/alpha2); "
        "off: only lossless plans (ar, sd, n-gram), whose output follows the verifier exactly.",
    )

    @field_validator("temperature")
    @classmethod
    def _check_temperature(cls, v: float) -> float:
        if 0.0 < v < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {v}")
        return v

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs_flag(cls, v: Any) -> Any:
        """OpenAI chat's boolean: false is none, true the chosen tokens' logprobs (0 alternatives)."""
        return (0 if v else None) if isinstance(v, bool) else v

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, v: Any) -> Any:
        return (v,) if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if v is not None and any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v or None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v is None:
            return None
        if any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        if any(not -100.0 <= b <= 100.0 for b in v.values()):
            raise ValueError("biases must be in [-100, 100]")
        return v or None

    @model_validator(mode="after")
    def _check_thresholds(self) -> GenerationParams:
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("must be >= 1 (0 only scores the prompt: set prompt_logprobs)")
        if self.alpha2 >= self.alpha1:
            raise ValueError(f"alpha2 ({self.alpha2}) must be smaller than alpha1 ({self.alpha1})")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative token ids")
        if self.rule == Rule.STAGED and self.mode != Mode.VIA:
            raise ValueError(f"rule: 'staged' is a three-tier rule; it needs mode 'via', got {self.mode.value!r}")
        if self.mode == Mode.AUTO and (self.overlap or self.adaptive_gamma):
            raise ValueError(
                "mode: 'auto' chooses the block length itself; it cannot be combined with overlap or adaptive_gamma"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether logit_bias or a penalty changes the logits (viasd.sampling.Penalties)."""
        return (
            bool(self.logit_bias)
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or (self.repetition_penalty != 1.0)
        )


# The after-validator's cross-field errors name these fields.
_CROSS_FIELD = {
    "0 only scores the prompt": "max_tokens",
    "alpha2 (": "alpha2",
    "stop_token_ids": "stop_token_ids",
    "dtype": "dtype",
    "mask": "mask",
    "mode: ": "mode",
    "rule: ": "rule",
}


def _validate(model: type[BaseModel], values: dict[str, Any] | None, overrides: dict[str, Any]) -> Any:
    try:
        return model.model_validate({**(values or {}), **overrides})
    except ValidationError as exc:
        raise invalid_from_validation(exc) from None


def parse_params(values: dict[str, Any] | None = None, **overrides: Any) -> GenerationParams:
    """Validate request parameters, raising InvalidParameterError that names the first bad field."""
    return _validate(GenerationParams, values, overrides)


def invalid_from_validation(exc: ValidationError) -> InvalidParameterError:
    """Turn pydantic's error list into one typed error naming the field (dotted path)."""
    err = exc.errors()[0]
    field = ".".join(str(p) for p in err.get("loc", ())) or None
    msg = err.get("msg", str(exc))
    if not field:  # a model-level validator: find the field it talks about
        field = next((name for key, name in _CROSS_FIELD.items() if key in msg), "params")
    return InvalidParameterError(field, msg.removeprefix("Value error, "))


def validate_named(model: type[M], values: dict[str, Any]) -> M:
    """`model.model_validate(values)`, raising InvalidParameterError that names the bad field. A
    model-level (cross-field) validator states its field first: "field: what is wrong"."""
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        first = exc.errors()[0]
        if not first.get("loc"):
            field, _, message = first["msg"].removeprefix("Value error, ").partition(": ")
            raise InvalidParameterError(field, message) from None
        raise invalid_from_validation(exc) from None


class EngineConfig(BaseModel):
    """Which models the engine loads and how it runs them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    verifier: str = Field(
        "qwen2.5-coder-1.5b-instruct", description="Full verifier q: a built-in model name or a local HF directory."
    )
    drafter: str | None = Field(
        "qwen2.5-coder-0.5b-instruct",
        description="Drafter p (same tokenizer as the verifier): built-in name or local directory; None serves 'ar' only.",
    )
    dtype: str = Field(
        "auto",
        description="Weight dtype: auto (per device, what runs fastest: bfloat16 on CUDA and on CPUs with "
        "native bf16; without it bfloat16 with mixed kernels where oneDNN can pack them (see packed_linears), else "
        "the dtype that serves a request faster at max_batch rows a step, prompt and decode, measured at load; see "
        "viasd.precision), bfloat16, float16, float32 or float64.",
    )
    mask: tuple[int, ...] | str | None = Field(
        None,
        description="Layer mask z of the slim verifier: one 0 (skip) / 1 (keep) per verifier layer, or the path "
        "of a DIMR artifact (.json; its model fingerprint is checked against the verifier). None: the shipped "
        "DIMR mask of a built-in verifier at skip_ratio, else round(skip_ratio * L) layers spread evenly.",
    )
    skip_ratio: float = Field(
        0.45, ge=0.0, lt=1.0, description="Share of verifier layers q' skips when no mask is given."
    )
    cache_policy: CachePolicy = Field(
        CachePolicy.SEPARATE,
        description="q' cache: 'separate' (own cache, exact) or 'shared' (q's slots, 1.0x memory).",
    )
    gates: str = Field(
        "calibrated",
        pattern=r"^(calibrated|paper)$",
        description="Gates of `via` requests that set none of alpha1 / alpha2 / region_b: 'calibrated' (the "
        "mask artifact's calibrated gates, viasd.gates; the paper's where the artifact has none) or 'paper' "
        "(alpha1 0.5, alpha2 0.3, region B rewrites).",
    )
    max_context: int | None = Field(
        None, ge=2, description="Cap on prompt + generated tokens; default: the models' max_position_embeddings."
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="torch CPU threads; default: torch's choice in process; for the drafter and verifier actors "
        "the node's cores over the verifier's ranks (with every core, the actors of a node take turns on them: "
        "actors.rpc.cores_lock; fewer threads than cores opt an actor out).",
    )
    max_batch: int = Field(
        16,
        ge=1,
        le=1024,
        description="Requests decoding together (continuous batching): KV cache rows per tier. More wait in the queue.",
    )
    max_seq_len: int | None = Field(
        None,
        ge=2,
        description="Positions per request (prompt + generated tokens); default: with blocks (kv_block_size), all "
        "the blocks kv_cache_gib holds, with slot rows what it holds for max_batch rows of every tier; capped by "
        "the context either way.",
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0,
        description="KV cache budget in GiB for all tiers at full capacity; default: a quarter of the "
        "memory available at start. It sets the blocks of each tier (kv_block_size), or with slot rows "
        "max_seq_len when that is not given.",
    )
    kv_block_size: int = Field(
        DEFAULT_KV_BLOCK_SIZE,
        ge=0,
        le=1024,
        description="Positions per KV cache block (vLLM's block_size). Default 16: a paged cache (viasd.blocks) "
        "whose rows take blocks as they grow, admitted against the blocks they hold (preempted by recompute "
        "when they outgrow them), sharing full prompt blocks (prefix_caching) and n > 1 samples' blocks, so "
        "memory follows the tokens requests hold. 0: slot rows, one preallocated row of max_seq_len positions "
        "per request, each as long as the longest (docs/BATCHING.md, 'Caches').",
    )
    prefix_caching: bool = Field(
        True,
        description="With a paged cache (kv_block_size > 0): a request whose prompt begins with the tokens of full "
        "blocks another request computed attaches those blocks instead of recomputing them (automatic prefix "
        "caching, viasd.blocks); blocks no request holds stay cached until the pool needs them. Off: every "
        "request computes its whole prompt.",
    )
    paged_attention: Literal["auto", "torch", "flex"] = Field(
        "auto",
        description="The attention kernel that reads a paged cache (kv_block_size > 0). flex: PyTorch's "
        "FlexAttention, compiled, reading each row's keys and values in place from the block pool through its "
        "block table (CUDA with Triton, kv_block_size a power of two >= 16; refused elsewhere). torch: each "
        "row's blocks gathered, rows of similar length together, then scaled dot-product attention. auto: flex "
        "where it runs, else torch (viasd.attention).",
    )
    packed_linears: bool = Field(
        True,
        description="On CPU, swap the models' linear layers for oneDNN-prepacked ones (viasd.precision."
        "optimize_linears): faster small-batch matmuls for one more copy of the weights in memory. bf16 on a "
        "CPU without native bf16 gets mixed kernels: a float32 copy runs the products of a few rows or more.",
    )
    quantization: Literal["none", "int8", "int4", "fp8", "auto"] = Field(
        "auto",
        description="Quantization of the models' linears (viasd.quant). On CPU, weight-only: int8 (per output "
        "channel) or int4 (a scale and a minimum per 32 weights), quantized at load; products of a few rows run "
        "the integer kernels, larger ones a dense copy where it is faster (with packed_linears); a built-in model "
        "from its GGUF file's own blocks. fp8 (CUDA, compute capability 8.9 or more; refused elsewhere): the "
        "decoder layers' weights in float8_e4m3fn with a scale per output channel, run by torch._scaled_mm with "
        "each token's activations quantized to fp8 as it runs. auto: int4 for a built-in model (its weights ship "
        "4-bit) in bfloat16 / float16 on a CPU where int4 beats the dense kernel, else none. none: the weights as "
        "loaded (docs/QUANTIZATION.md).",
    )
    prefill_chunk: int = Field(
        512,
        ge=1,
        description="Prompt tokens prefilled per engine step over all new requests (chunked prefill).",
    )
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$", description="Where the models run: cpu, cuda or cuda:N.")
    trust_remote_code: bool = Field(
        False,
        description="Run Python code shipped with a model directory (config auto_map). Off: only the built-in "
        "LLaMA / Qwen2 code runs; turn on only for model directories you trust.",
    )

    @field_validator("kv_block_size", mode="before")
    @classmethod
    def _check_kv_block_size(cls, v: Any) -> Any:
        if v is None or isinstance(v, bool):
            raise ValueError(f"positions per KV block (default 16), or 0 for slot rows; got {v!r}")
        return v

    @property
    def block_size(self) -> int | None:
        """Positions per KV block of the paged caches; None: slot rows (`kv_block_size: 0`)."""
        return self.kv_block_size or None

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.dtype not in ("auto", "bfloat16", "float16", "float32", "float64"):
            raise ValueError(f"dtype must be auto, bfloat16, float16, float32 or float64, got {self.dtype!r}")
        if isinstance(self.mask, str) and not self.mask.endswith(".json"):
            raise ValueError("mask must be a 0/1 list or the path of a DIMR artifact (.json)")
        if isinstance(self.mask, tuple) and any(v not in (0, 1) for v in self.mask):
            raise ValueError("mask entries must be 0 (skip) or 1 (keep)")
        return self


def parse_engine_config(values: dict[str, Any] | None = None, **overrides: Any) -> EngineConfig:
    """Validate an engine configuration, raising InvalidParameterError that names the bad field."""
    return _validate(EngineConfig, values, overrides)
