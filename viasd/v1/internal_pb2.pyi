from viasd.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RowError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

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

class CallTimes(_message.Message):
    __slots__ = ("seconds", "forwards")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    forwards: _containers.RepeatedCompositeFieldContainer[Forward]
    def __init__(self, seconds: _Optional[float] = ..., forwards: _Optional[_Iterable[_Union[Forward, _Mapping]]] = ...) -> None: ...

class Open(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "seed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _generation_pb2.GenerationParams
    seed: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_generation_pb2.GenerationParams, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class PrefillChunk(_message.Message):
    __slots__ = ("request_id", "upto")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    UPTO_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    upto: int
    def __init__(self, request_id: _Optional[str] = ..., upto: _Optional[int] = ...) -> None: ...

class PrefillCopy(_message.Message):
    __slots__ = ("request_id", "leader")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    leader: str
    def __init__(self, request_id: _Optional[str] = ..., leader: _Optional[str] = ...) -> None: ...

class PrefillBatch(_message.Message):
    __slots__ = ("opens", "chunks", "copies", "settles")
    class SettlesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    OPENS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    SETTLES_FIELD_NUMBER: _ClassVar[int]
    opens: _containers.RepeatedCompositeFieldContainer[Open]
    chunks: _containers.RepeatedCompositeFieldContainer[PrefillChunk]
    copies: _containers.RepeatedCompositeFieldContainer[PrefillCopy]
    settles: _containers.ScalarMap[str, int]
    def __init__(self, opens: _Optional[_Iterable[_Union[Open, _Mapping]]] = ..., chunks: _Optional[_Iterable[_Union[PrefillChunk, _Mapping]]] = ..., copies: _Optional[_Iterable[_Union[PrefillCopy, _Mapping]]] = ..., settles: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Prefilled(_message.Message):
    __slots__ = ("request_id", "prompt_logprobs", "error", "fed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    error: RowError
    fed: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., error: _Optional[_Union[RowError, _Mapping]] = ..., fed: _Optional[int] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("rows", "times")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[Prefilled]
    times: CallTimes
    def __init__(self, rows: _Optional[_Iterable[_Union[Prefilled, _Mapping]]] = ..., times: _Optional[_Union[CallTimes, _Mapping]] = ...) -> None: ...

class Outcome(_message.Message):
    __slots__ = ("tokens", "num_draft_accepted")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    num_draft_accepted: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., num_draft_accepted: _Optional[int] = ...) -> None: ...

class ProposeRow(_message.Message):
    __slots__ = ("request_id", "previous", "k", "proposer", "p_x")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    P_X_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    previous: Outcome
    k: int
    proposer: str
    p_x: bool
    def __init__(self, request_id: _Optional[str] = ..., previous: _Optional[_Union[Outcome, _Mapping]] = ..., k: _Optional[int] = ..., proposer: _Optional[str] = ..., p_x: _Optional[bool] = ...) -> None: ...

class ProposeBatch(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[ProposeRow]
    def __init__(self, rows: _Optional[_Iterable[_Union[ProposeRow, _Mapping]]] = ...) -> None: ...

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

class Proposal(_message.Message):
    __slots__ = ("request_id", "draft", "probs", "error", "work_seconds", "fed", "p_x")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WORK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FED_FIELD_NUMBER: _ClassVar[int]
    P_X_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    draft: _containers.RepeatedScalarFieldContainer[int]
    probs: DraftProbs
    error: RowError
    work_seconds: float
    fed: int
    p_x: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., draft: _Optional[_Iterable[int]] = ..., probs: _Optional[_Union[DraftProbs, _Mapping]] = ..., error: _Optional[_Union[RowError, _Mapping]] = ..., work_seconds: _Optional[float] = ..., fed: _Optional[int] = ..., p_x: _Optional[_Iterable[float]] = ...) -> None: ...

class ProposeReply(_message.Message):
    __slots__ = ("rows", "times")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[Proposal]
    times: CallTimes
    def __init__(self, rows: _Optional[_Iterable[_Union[Proposal, _Mapping]]] = ..., times: _Optional[_Union[CallTimes, _Mapping]] = ...) -> None: ...

class VerifyRow(_message.Message):
    __slots__ = ("request_id", "draft", "probs", "plan", "p_x")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    P_X_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    draft: _containers.RepeatedScalarFieldContainer[int]
    probs: DraftProbs
    plan: str
    p_x: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., draft: _Optional[_Iterable[int]] = ..., probs: _Optional[_Union[DraftProbs, _Mapping]] = ..., plan: _Optional[str] = ..., p_x: _Optional[_Iterable[float]] = ...) -> None: ...

class VerifyBatch(_message.Message):
    __slots__ = ("rows", "settles")
    class SettlesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROWS_FIELD_NUMBER: _ClassVar[int]
    SETTLES_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[VerifyRow]
    settles: _containers.ScalarMap[str, int]
    def __init__(self, rows: _Optional[_Iterable[_Union[VerifyRow, _Mapping]]] = ..., settles: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Correction(_message.Message):
    __slots__ = ("q", "u")
    Q_FIELD_NUMBER: _ClassVar[int]
    U_FIELD_NUMBER: _ClassVar[int]
    q: DraftProbs
    u: float
    def __init__(self, q: _Optional[_Union[DraftProbs, _Mapping]] = ..., u: _Optional[float] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("request_id", "outcome", "logprobs", "escalated", "error", "work_seconds", "correction")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ESCALATED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WORK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CORRECTION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    outcome: Outcome
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    escalated: bool
    error: RowError
    work_seconds: float
    correction: Correction
    def __init__(self, request_id: _Optional[str] = ..., outcome: _Optional[_Union[Outcome, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., escalated: _Optional[bool] = ..., error: _Optional[_Union[RowError, _Mapping]] = ..., work_seconds: _Optional[float] = ..., correction: _Optional[_Union[Correction, _Mapping]] = ...) -> None: ...

class VerifyReply(_message.Message):
    __slots__ = ("rows", "times")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[Verdict]
    times: CallTimes
    def __init__(self, rows: _Optional[_Iterable[_Union[Verdict, _Mapping]]] = ..., times: _Optional[_Union[CallTimes, _Mapping]] = ...) -> None: ...

class CorrectRow(_message.Message):
    __slots__ = ("request_id", "position", "q", "u")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    U_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    position: int
    q: DraftProbs
    u: float
    def __init__(self, request_id: _Optional[str] = ..., position: _Optional[int] = ..., q: _Optional[_Union[DraftProbs, _Mapping]] = ..., u: _Optional[float] = ...) -> None: ...

class CorrectBatch(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[CorrectRow]
    def __init__(self, rows: _Optional[_Iterable[_Union[CorrectRow, _Mapping]]] = ...) -> None: ...

class Corrected(_message.Message):
    __slots__ = ("request_id", "token", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token: int
    error: RowError
    def __init__(self, request_id: _Optional[str] = ..., token: _Optional[int] = ..., error: _Optional[_Union[RowError, _Mapping]] = ...) -> None: ...

class CorrectReply(_message.Message):
    __slots__ = ("rows", "times")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TIMES_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[Corrected]
    times: CallTimes
    def __init__(self, rows: _Optional[_Iterable[_Union[Corrected, _Mapping]]] = ..., times: _Optional[_Union[CallTimes, _Mapping]] = ...) -> None: ...

class ReleaseBatch(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class Released(_message.Message):
    __slots__ = ("request_id", "existed", "stats")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    existed: bool
    stats: _generation_pb2.RequestStats
    def __init__(self, request_id: _Optional[str] = ..., existed: _Optional[bool] = ..., stats: _Optional[_Union[_generation_pb2.RequestStats, _Mapping]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[Released]
    def __init__(self, rows: _Optional[_Iterable[_Union[Released, _Mapping]]] = ...) -> None: ...

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
