from spectandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    params: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "stats", "prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stats: _common_pb2.SpecStats
    prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[_common_pb2.SpecStats, _Mapping]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("target_model", "draft_model", "method", "num_steps", "topk", "num_draft_tokens", "max_context", "max_tokens_limit", "max_stop_strings", "max_message_bytes", "vocab_size", "backend", "fused", "max_prompt_chars", "benchmark_acceptance_rate")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    FUSED_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_CHARS_FIELD_NUMBER: _ClassVar[int]
    BENCHMARK_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    draft_model: str
    method: str
    num_steps: int
    topk: int
    num_draft_tokens: int
    max_context: int
    max_tokens_limit: int
    max_stop_strings: int
    max_message_bytes: int
    vocab_size: int
    backend: str
    fused: bool
    max_prompt_chars: int
    benchmark_acceptance_rate: float
    def __init__(self, target_model: _Optional[str] = ..., draft_model: _Optional[str] = ..., method: _Optional[str] = ..., num_steps: _Optional[int] = ..., topk: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., max_context: _Optional[int] = ..., max_tokens_limit: _Optional[int] = ..., max_stop_strings: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., vocab_size: _Optional[int] = ..., backend: _Optional[str] = ..., fused: _Optional[bool] = ..., max_prompt_chars: _Optional[int] = ..., benchmark_acceptance_rate: _Optional[float] = ...) -> None: ...

class GetServerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvUsage(_message.Message):
    __slots__ = ("num_blocks", "used_blocks", "block_size")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    used_blocks: int
    block_size: int
    def __init__(self, num_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class ServerStats(_message.Message):
    __slots__ = ("rounds", "num_drafts", "draft_tokens", "accepted_tokens", "accepted_per_pos", "preemptions", "resumes", "stale_dropped", "draft_ahead_hits", "draft_ahead_misses", "fallback_rounds", "requests_admitted", "requests_finished", "requests_failed", "requests_cancelled", "running", "waiting", "verifier_kv", "drafter_kv", "ready_trees", "detached_admissions", "plain_rounds", "drafter_outages", "mixed_prefills", "mode_rounds", "decode_ahead_taken", "decode_ahead_forgotten", "posted_trees", "prefills_with_verdicts", "detached_running", "early_tree_rounds")
    class ModeRoundsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    STALE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_HITS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_AHEAD_MISSES_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_KV_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_KV_FIELD_NUMBER: _ClassVar[int]
    READY_TREES_FIELD_NUMBER: _ClassVar[int]
    DETACHED_ADMISSIONS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_OUTAGES_FIELD_NUMBER: _ClassVar[int]
    MIXED_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    MODE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_AHEAD_TAKEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_AHEAD_FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    POSTED_TREES_FIELD_NUMBER: _ClassVar[int]
    PREFILLS_WITH_VERDICTS_FIELD_NUMBER: _ClassVar[int]
    DETACHED_RUNNING_FIELD_NUMBER: _ClassVar[int]
    EARLY_TREE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    num_drafts: int
    draft_tokens: int
    accepted_tokens: int
    accepted_per_pos: _containers.RepeatedScalarFieldContainer[int]
    preemptions: int
    resumes: int
    stale_dropped: int
    draft_ahead_hits: int
    draft_ahead_misses: int
    fallback_rounds: int
    requests_admitted: int
    requests_finished: int
    requests_failed: int
    requests_cancelled: int
    running: int
    waiting: int
    verifier_kv: KvUsage
    drafter_kv: KvUsage
    ready_trees: int
    detached_admissions: int
    plain_rounds: int
    drafter_outages: int
    mixed_prefills: int
    mode_rounds: _containers.ScalarMap[str, int]
    decode_ahead_taken: int
    decode_ahead_forgotten: int
    posted_trees: int
    prefills_with_verdicts: int
    detached_running: int
    early_tree_rounds: int
    def __init__(self, rounds: _Optional[int] = ..., num_drafts: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., accepted_per_pos: _Optional[_Iterable[int]] = ..., preemptions: _Optional[int] = ..., resumes: _Optional[int] = ..., stale_dropped: _Optional[int] = ..., draft_ahead_hits: _Optional[int] = ..., draft_ahead_misses: _Optional[int] = ..., fallback_rounds: _Optional[int] = ..., requests_admitted: _Optional[int] = ..., requests_finished: _Optional[int] = ..., requests_failed: _Optional[int] = ..., requests_cancelled: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., verifier_kv: _Optional[_Union[KvUsage, _Mapping]] = ..., drafter_kv: _Optional[_Union[KvUsage, _Mapping]] = ..., ready_trees: _Optional[int] = ..., detached_admissions: _Optional[int] = ..., plain_rounds: _Optional[int] = ..., drafter_outages: _Optional[int] = ..., mixed_prefills: _Optional[int] = ..., mode_rounds: _Optional[_Mapping[str, int]] = ..., decode_ahead_taken: _Optional[int] = ..., decode_ahead_forgotten: _Optional[int] = ..., posted_trees: _Optional[int] = ..., prefills_with_verdicts: _Optional[int] = ..., detached_running: _Optional[int] = ..., early_tree_rounds: _Optional[int] = ...) -> None: ...
