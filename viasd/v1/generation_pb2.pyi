from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_AR: _ClassVar[Mode]
    MODE_SD: _ClassVar[Mode]
    MODE_VIA: _ClassVar[Mode]
    MODE_AUTO: _ClassVar[Mode]

class RegionB(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REGION_B_UNSPECIFIED: _ClassVar[RegionB]
    REGION_B_REWRITE: _ClassVar[RegionB]
    REGION_B_ESCALATE: _ClassVar[RegionB]

class Proposer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROPOSER_UNSPECIFIED: _ClassVar[Proposer]
    PROPOSER_MODEL: _ClassVar[Proposer]
    PROPOSER_NGRAM: _ClassVar[Proposer]
    PROPOSER_HYBRID: _ClassVar[Proposer]

class Rule(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RULE_UNSPECIFIED: _ClassVar[Rule]
    RULE_LOSSLESS: _ClassVar[Rule]
    RULE_LOSSY: _ClassVar[Rule]
    RULE_OVERSHOOT: _ClassVar[Rule]
    RULE_STAGED: _ClassVar[Rule]

class LogprobTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOGPROB_TIER_UNSPECIFIED: _ClassVar[LogprobTier]
    LOGPROB_TIER_FULL: _ClassVar[LogprobTier]
    LOGPROB_TIER_SLIM: _ClassVar[LogprobTier]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
MODE_UNSPECIFIED: Mode
MODE_AR: Mode
MODE_SD: Mode
MODE_VIA: Mode
MODE_AUTO: Mode
REGION_B_UNSPECIFIED: RegionB
REGION_B_REWRITE: RegionB
REGION_B_ESCALATE: RegionB
PROPOSER_UNSPECIFIED: Proposer
PROPOSER_MODEL: Proposer
PROPOSER_NGRAM: Proposer
PROPOSER_HYBRID: Proposer
RULE_UNSPECIFIED: Rule
RULE_LOSSLESS: Rule
RULE_LOSSY: Rule
RULE_OVERSHOOT: Rule
RULE_STAGED: Rule
LOGPROB_TIER_UNSPECIFIED: LogprobTier
LOGPROB_TIER_FULL: LogprobTier
LOGPROB_TIER_SLIM: LogprobTier
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerationParams(_message.Message):
    __slots__ = ("mode", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "gamma", "alpha1", "alpha2", "region_b", "slim_bonus", "rule", "lossy_alpha", "lossy_beta", "overshoot_ceiling", "stop_token_ids", "ignore_eos", "proposer", "ngram_max", "draft_confidence", "adaptive_gamma", "overlap", "auto_lossy", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "logprobs_tier", "prompt_logprobs", "stop", "n")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    ALPHA1_FIELD_NUMBER: _ClassVar[int]
    ALPHA2_FIELD_NUMBER: _ClassVar[int]
    REGION_B_FIELD_NUMBER: _ClassVar[int]
    SLIM_BONUS_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    LOSSY_ALPHA_FIELD_NUMBER: _ClassVar[int]
    LOSSY_BETA_FIELD_NUMBER: _ClassVar[int]
    OVERSHOOT_CEILING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    NGRAM_MAX_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_GAMMA_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    AUTO_LOSSY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_TIER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    mode: Mode
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    gamma: int
    alpha1: float
    alpha2: float
    region_b: RegionB
    slim_bonus: bool
    rule: Rule
    lossy_alpha: float
    lossy_beta: float
    overshoot_ceiling: float
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    proposer: Proposer
    ngram_max: int
    draft_confidence: float
    adaptive_gamma: bool
    overlap: bool
    auto_lossy: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    logprobs: int
    logprobs_tier: LogprobTier
    prompt_logprobs: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    n: int
    def __init__(self, mode: _Optional[_Union[Mode, str]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., gamma: _Optional[int] = ..., alpha1: _Optional[float] = ..., alpha2: _Optional[float] = ..., region_b: _Optional[_Union[RegionB, str]] = ..., slim_bonus: _Optional[bool] = ..., rule: _Optional[_Union[Rule, str]] = ..., lossy_alpha: _Optional[float] = ..., lossy_beta: _Optional[float] = ..., overshoot_ceiling: _Optional[float] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., proposer: _Optional[_Union[Proposer, str]] = ..., ngram_max: _Optional[int] = ..., draft_confidence: _Optional[float] = ..., adaptive_gamma: _Optional[bool] = ..., overlap: _Optional[bool] = ..., auto_lossy: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., logprobs: _Optional[int] = ..., logprobs_tier: _Optional[_Union[LogprobTier, str]] = ..., prompt_logprobs: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., n: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top", "tier")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    tier: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., tier: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt", "messages", "prompt_token_ids", "params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt: str
    messages: ChatMessages
    prompt_token_ids: TokenIds
    params: GenerationParams
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., params: _Optional[_Union[GenerationParams, _Mapping]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestStats(_message.Message):
    __slots__ = ("mode", "prompt_tokens", "generated_tokens", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos", "num_rejected_tokens", "num_bonus_tokens", "slim_accepted", "slim_rewritten", "escalations", "escalated_tokens", "full_accepted", "mean_acceptance_length", "rejection_rate", "forwards", "seconds", "time_to_first_token", "total_seconds", "drafter_fallback", "num_cycle_tokens", "ngram_draft_tokens", "overlap_draft_tokens", "prefill_forwards", "prefill_seconds", "queue_seconds", "plans", "kv_bytes", "preemptions", "cached_tokens")
    class ForwardsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class SecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class PlansEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BONUS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLIM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    SLIM_REWRITTEN_FIELD_NUMBER: _ClassVar[int]
    ESCALATIONS_FIELD_NUMBER: _ClassVar[int]
    ESCALATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FULL_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    REJECTION_RATE_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    NUM_CYCLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NGRAM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    prompt_tokens: int
    generated_tokens: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    num_rejected_tokens: int
    num_bonus_tokens: int
    slim_accepted: int
    slim_rewritten: int
    escalations: int
    escalated_tokens: int
    full_accepted: int
    mean_acceptance_length: float
    rejection_rate: float
    forwards: _containers.ScalarMap[str, int]
    seconds: _containers.ScalarMap[str, float]
    time_to_first_token: float
    total_seconds: float
    drafter_fallback: bool
    num_cycle_tokens: int
    ngram_draft_tokens: int
    overlap_draft_tokens: int
    prefill_forwards: int
    prefill_seconds: float
    queue_seconds: float
    plans: _containers.ScalarMap[str, int]
    kv_bytes: int
    preemptions: int
    cached_tokens: int
    def __init__(self, mode: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., num_drafts: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., num_rejected_tokens: _Optional[int] = ..., num_bonus_tokens: _Optional[int] = ..., slim_accepted: _Optional[int] = ..., slim_rewritten: _Optional[int] = ..., escalations: _Optional[int] = ..., escalated_tokens: _Optional[int] = ..., full_accepted: _Optional[int] = ..., mean_acceptance_length: _Optional[float] = ..., rejection_rate: _Optional[float] = ..., forwards: _Optional[_Mapping[str, int]] = ..., seconds: _Optional[_Mapping[str, float]] = ..., time_to_first_token: _Optional[float] = ..., total_seconds: _Optional[float] = ..., drafter_fallback: _Optional[bool] = ..., num_cycle_tokens: _Optional[int] = ..., ngram_draft_tokens: _Optional[int] = ..., overlap_draft_tokens: _Optional[int] = ..., prefill_forwards: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., plans: _Optional[_Mapping[str, int]] = ..., kv_bytes: _Optional[int] = ..., preemptions: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "stats", "logprobs", "prompt_logprobs", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    stats: RequestStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    index: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "verifier", "drafter", "num_layers", "skipped_layers", "tensor_parallel_size", "max_context", "default_mode", "dtype", "dtype_reason", "device", "cpu_capability")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MODE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_REASON_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CPU_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    name: str
    verifier: str
    drafter: str
    num_layers: int
    skipped_layers: _containers.RepeatedScalarFieldContainer[int]
    tensor_parallel_size: int
    max_context: int
    default_mode: Mode
    dtype: str
    dtype_reason: str
    device: str
    cpu_capability: str
    def __init__(self, name: _Optional[str] = ..., verifier: _Optional[str] = ..., drafter: _Optional[str] = ..., num_layers: _Optional[int] = ..., skipped_layers: _Optional[_Iterable[int]] = ..., tensor_parallel_size: _Optional[int] = ..., max_context: _Optional[int] = ..., default_mode: _Optional[_Union[Mode, str]] = ..., dtype: _Optional[str] = ..., dtype_reason: _Optional[str] = ..., device: _Optional[str] = ..., cpu_capability: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...
