from viasd.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "seed", "prefill_from", "feed_drafter")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FROM_FIELD_NUMBER: _ClassVar[int]
    FEED_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _generation_pb2.GenerationParams
    seed: int
    prefill_from: str
    feed_drafter: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_generation_pb2.GenerationParams, _Mapping]] = ..., seed: _Optional[int] = ..., prefill_from: _Optional[str] = ..., feed_drafter: _Optional[bool] = ...) -> None: ...

class OpenResponse(_message.Message):
    __slots__ = ("request_id", "prompt_logprobs", "stats")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    stats: _generation_pb2.RequestStats
    def __init__(self, request_id: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., stats: _Optional[_Union[_generation_pb2.RequestStats, _Mapping]] = ...) -> None: ...

class Outcome(_message.Message):
    __slots__ = ("tokens", "num_draft_accepted")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    num_draft_accepted: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., num_draft_accepted: _Optional[int] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("request_id", "previous", "k", "proposer", "rows")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    previous: Outcome
    k: int
    proposer: str
    rows: _containers.RepeatedCompositeFieldContainer[ProposeRequest]
    def __init__(self, request_id: _Optional[str] = ..., previous: _Optional[_Union[Outcome, _Mapping]] = ..., k: _Optional[int] = ..., proposer: _Optional[str] = ..., rows: _Optional[_Iterable[_Union[ProposeRequest, _Mapping]]] = ...) -> None: ...

class RowError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class DraftProbs(_message.Message):
    __slots__ = ("rows", "vocab_size", "data", "dtype", "indices", "row_nnz")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    ROW_NNZ_FIELD_NUMBER: _ClassVar[int]
    rows: int
    vocab_size: int
    data: bytes
    dtype: str
    indices: bytes
    row_nnz: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rows: _Optional[int] = ..., vocab_size: _Optional[int] = ..., data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., indices: _Optional[bytes] = ..., row_nnz: _Optional[_Iterable[int]] = ...) -> None: ...

class Forward(_message.Message):
    __slots__ = ("tier", "rows", "tokens", "seconds")
    TIER_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    rows: int
    tokens: int
    seconds: float
    def __init__(self, tier: _Optional[str] = ..., rows: _Optional[int] = ..., tokens: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("request_id", "draft", "probs", "stats", "rows", "error", "seconds", "forwards", "work_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    WORK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    draft: _containers.RepeatedScalarFieldContainer[int]
    probs: DraftProbs
    stats: _generation_pb2.RequestStats
    rows: _containers.RepeatedCompositeFieldContainer[ProposeResponse]
    error: RowError
    seconds: float
    forwards: _containers.RepeatedCompositeFieldContainer[Forward]
    work_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., draft: _Optional[_Iterable[int]] = ..., probs: _Optional[_Union[DraftProbs, _Mapping]] = ..., stats: _Optional[_Union[_generation_pb2.RequestStats, _Mapping]] = ..., rows: _Optional[_Iterable[_Union[ProposeResponse, _Mapping]]] = ..., error: _Optional[_Union[RowError, _Mapping]] = ..., seconds: _Optional[float] = ..., forwards: _Optional[_Iterable[_Union[Forward, _Mapping]]] = ..., work_seconds: _Optional[float] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("request_id", "draft", "probs", "rows", "plan")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    draft: _containers.RepeatedScalarFieldContainer[int]
    probs: DraftProbs
    rows: _containers.RepeatedCompositeFieldContainer[VerifyRequest]
    plan: str
    def __init__(self, request_id: _Optional[str] = ..., draft: _Optional[_Iterable[int]] = ..., probs: _Optional[_Union[DraftProbs, _Mapping]] = ..., rows: _Optional[_Iterable[_Union[VerifyRequest, _Mapping]]] = ..., plan: _Optional[str] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("request_id", "outcome", "stats", "rows", "error", "logprobs", "seconds", "forwards", "work_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    WORK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    outcome: Outcome
    stats: _generation_pb2.RequestStats
    rows: _containers.RepeatedCompositeFieldContainer[VerifyResponse]
    error: RowError
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    seconds: float
    forwards: _containers.RepeatedCompositeFieldContainer[Forward]
    work_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., outcome: _Optional[_Union[Outcome, _Mapping]] = ..., stats: _Optional[_Union[_generation_pb2.RequestStats, _Mapping]] = ..., rows: _Optional[_Iterable[_Union[VerifyResponse, _Mapping]]] = ..., error: _Optional[_Union[RowError, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., seconds: _Optional[float] = ..., forwards: _Optional[_Iterable[_Union[Forward, _Mapping]]] = ..., work_seconds: _Optional[float] = ...) -> None: ...

class CostsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CostCurve(_message.Message):
    __slots__ = ("tier", "tokens", "seconds", "rows")
    TIER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    seconds: _containers.RepeatedScalarFieldContainer[float]
    rows: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tier: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., seconds: _Optional[_Iterable[float]] = ..., rows: _Optional[_Iterable[int]] = ...) -> None: ...

class CostsResponse(_message.Message):
    __slots__ = ("curves", "key_json", "profile_seconds")
    CURVES_FIELD_NUMBER: _ClassVar[int]
    KEY_JSON_FIELD_NUMBER: _ClassVar[int]
    PROFILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    curves: _containers.RepeatedCompositeFieldContainer[CostCurve]
    key_json: str
    profile_seconds: float
    def __init__(self, curves: _Optional[_Iterable[_Union[CostCurve, _Mapping]]] = ..., key_json: _Optional[str] = ..., profile_seconds: _Optional[float] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...
