from spectandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifierPrefillItem(_message.Message):
    __slots__ = ("tag", "prompt_ids", "params", "resume")
    TAG_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    tag: _common_pb2.RequestTag
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    resume: bool
    def __init__(self, tag: _Optional[_Union[_common_pb2.RequestTag, _Mapping]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., resume: _Optional[bool] = ...) -> None: ...

class VerifierPrefillRequest(_message.Message):
    __slots__ = ("items", "want_features")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    WANT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[VerifierPrefillItem]
    want_features: bool
    def __init__(self, items: _Optional[_Iterable[_Union[VerifierPrefillItem, _Mapping]]] = ..., want_features: _Optional[bool] = ...) -> None: ...

class VerifierPrefillResult(_message.Message):
    __slots__ = ("tag", "first_token_id", "features", "feature_ref", "with_verdicts")
    TAG_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_REF_FIELD_NUMBER: _ClassVar[int]
    WITH_VERDICTS_FIELD_NUMBER: _ClassVar[int]
    tag: _common_pb2.RequestTag
    first_token_id: int
    features: _common_pb2.Tensor
    feature_ref: ChannelRef
    with_verdicts: bool
    def __init__(self, tag: _Optional[_Union[_common_pb2.RequestTag, _Mapping]] = ..., first_token_id: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., feature_ref: _Optional[_Union[ChannelRef, _Mapping]] = ..., with_verdicts: _Optional[bool] = ...) -> None: ...

class ChannelRef(_message.Message):
    __slots__ = ("seq", "index")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    seq: int
    index: int
    def __init__(self, seq: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class VerifierPrefillReply(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifierPrefillResult]
    def __init__(self, results: _Optional[_Iterable[_Union[VerifierPrefillResult, _Mapping]]] = ...) -> None: ...

class DraftTreeMsg(_message.Message):
    __slots__ = ("tags", "token_ids", "parents", "node_valid", "scores", "draft_probs", "sampled")
    TAGS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    NODE_VALID_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedCompositeFieldContainer[_common_pb2.RequestTag]
    token_ids: _common_pb2.Tensor
    parents: _common_pb2.Tensor
    node_valid: _common_pb2.Tensor
    scores: _common_pb2.Tensor
    draft_probs: _common_pb2.Tensor
    sampled: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, tags: _Optional[_Iterable[_Union[_common_pb2.RequestTag, _Mapping]]] = ..., token_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., parents: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., node_valid: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., scores: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., draft_probs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., sampled: _Optional[_Iterable[bool]] = ...) -> None: ...

class PlainItem(_message.Message):
    __slots__ = ("tag", "last_token_id", "steps", "again")
    TAG_FIELD_NUMBER: _ClassVar[int]
    LAST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    AGAIN_FIELD_NUMBER: _ClassVar[int]
    tag: _common_pb2.RequestTag
    last_token_id: int
    steps: int
    again: bool
    def __init__(self, tag: _Optional[_Union[_common_pb2.RequestTag, _Mapping]] = ..., last_token_id: _Optional[int] = ..., steps: _Optional[int] = ..., again: _Optional[bool] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("tree", "want_features", "plain", "prefill", "prefill_features", "tree_round", "tree_wait_ms", "draft_next", "early_after", "early_tags")
    class DraftNextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TREE_FIELD_NUMBER: _ClassVar[int]
    WANT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    PLAIN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FEATURES_FIELD_NUMBER: _ClassVar[int]
    TREE_ROUND_FIELD_NUMBER: _ClassVar[int]
    TREE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_NEXT_FIELD_NUMBER: _ClassVar[int]
    EARLY_AFTER_FIELD_NUMBER: _ClassVar[int]
    EARLY_TAGS_FIELD_NUMBER: _ClassVar[int]
    tree: DraftTreeMsg
    want_features: bool
    plain: _containers.RepeatedCompositeFieldContainer[PlainItem]
    prefill: _containers.RepeatedCompositeFieldContainer[VerifierPrefillItem]
    prefill_features: bool
    tree_round: int
    tree_wait_ms: int
    draft_next: _containers.ScalarMap[str, int]
    early_after: int
    early_tags: _containers.RepeatedCompositeFieldContainer[_common_pb2.RequestTag]
    def __init__(self, tree: _Optional[_Union[DraftTreeMsg, _Mapping]] = ..., want_features: _Optional[bool] = ..., plain: _Optional[_Iterable[_Union[PlainItem, _Mapping]]] = ..., prefill: _Optional[_Iterable[_Union[VerifierPrefillItem, _Mapping]]] = ..., prefill_features: _Optional[bool] = ..., tree_round: _Optional[int] = ..., tree_wait_ms: _Optional[int] = ..., draft_next: _Optional[_Mapping[str, int]] = ..., early_after: _Optional[int] = ..., early_tags: _Optional[_Iterable[_Union[_common_pb2.RequestTag, _Mapping]]] = ...) -> None: ...

class VerifyResultMsg(_message.Message):
    __slots__ = ("tag", "token_ids", "num_accepted", "num_draft_tokens", "features", "feature_ref", "to_drafter")
    TAG_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_REF_FIELD_NUMBER: _ClassVar[int]
    TO_DRAFTER_FIELD_NUMBER: _ClassVar[int]
    tag: _common_pb2.RequestTag
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_accepted: int
    num_draft_tokens: int
    features: _common_pb2.Tensor
    feature_ref: ChannelRef
    to_drafter: bool
    def __init__(self, tag: _Optional[_Union[_common_pb2.RequestTag, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_accepted: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., feature_ref: _Optional[_Union[ChannelRef, _Mapping]] = ..., to_drafter: _Optional[bool] = ...) -> None: ...

class VerifyReply(_message.Message):
    __slots__ = ("results", "prefilled")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[VerifyResultMsg]
    prefilled: _containers.RepeatedCompositeFieldContainer[VerifierPrefillResult]
    def __init__(self, results: _Optional[_Iterable[_Union[VerifyResultMsg, _Mapping]]] = ..., prefilled: _Optional[_Iterable[_Union[VerifierPrefillResult, _Mapping]]] = ...) -> None: ...

class FeaturesRequest(_message.Message):
    __slots__ = ("tag",)
    TAG_FIELD_NUMBER: _ClassVar[int]
    tag: _common_pb2.RequestTag
    def __init__(self, tag: _Optional[_Union[_common_pb2.RequestTag, _Mapping]] = ...) -> None: ...

class FeaturesReply(_message.Message):
    __slots__ = ("features",)
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    features: _common_pb2.Tensor
    def __init__(self, features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_ids", "keep_draft", "outputs")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    KEEP_DRAFT_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    keep_draft: bool
    outputs: _containers.RepeatedCompositeFieldContainer[EndedOutput]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., keep_draft: _Optional[bool] = ..., outputs: _Optional[_Iterable[_Union[EndedOutput, _Mapping]]] = ...) -> None: ...

class EndedOutput(_message.Message):
    __slots__ = ("request_id", "token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class DrafterPrefillItem(_message.Message):
    __slots__ = ("tag", "prompt_ids", "first_token_id", "params", "features", "feature_ref")
    TAG_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_REF_FIELD_NUMBER: _ClassVar[int]
    tag: _common_pb2.RequestTag
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    params: _common_pb2.SamplingParams
    features: _common_pb2.Tensor
    feature_ref: ChannelRef
    def __init__(self, tag: _Optional[_Union[_common_pb2.RequestTag, _Mapping]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., feature_ref: _Optional[_Union[ChannelRef, _Mapping]] = ...) -> None: ...

class DrafterPrefillRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DrafterPrefillItem]
    def __init__(self, items: _Optional[_Iterable[_Union[DrafterPrefillItem, _Mapping]]] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("tags", "num_steps", "extend", "post_round")
    TAGS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    EXTEND_FIELD_NUMBER: _ClassVar[int]
    POST_ROUND_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedCompositeFieldContainer[_common_pb2.RequestTag]
    num_steps: _containers.RepeatedScalarFieldContainer[int]
    extend: _containers.RepeatedCompositeFieldContainer[ExtendItem]
    post_round: int
    def __init__(self, tags: _Optional[_Iterable[_Union[_common_pb2.RequestTag, _Mapping]]] = ..., num_steps: _Optional[_Iterable[int]] = ..., extend: _Optional[_Iterable[_Union[ExtendItem, _Mapping]]] = ..., post_round: _Optional[int] = ...) -> None: ...

class DraftAheadRequest(_message.Message):
    __slots__ = ("tags", "extend")
    TAGS_FIELD_NUMBER: _ClassVar[int]
    EXTEND_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedCompositeFieldContainer[_common_pb2.RequestTag]
    extend: _containers.RepeatedCompositeFieldContainer[ExtendItem]
    def __init__(self, tags: _Optional[_Iterable[_Union[_common_pb2.RequestTag, _Mapping]]] = ..., extend: _Optional[_Iterable[_Union[ExtendItem, _Mapping]]] = ...) -> None: ...

class DraftAheadReply(_message.Message):
    __slots__ = ("cache_hits", "outcome_trees", "unknown_request_ids")
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_TREES_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    cache_hits: _containers.RepeatedScalarFieldContainer[int]
    outcome_trees: _containers.RepeatedCompositeFieldContainer[OutcomeTrees]
    unknown_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cache_hits: _Optional[_Iterable[int]] = ..., outcome_trees: _Optional[_Iterable[_Union[OutcomeTrees, _Mapping]]] = ..., unknown_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class OutcomeTrees(_message.Message):
    __slots__ = ("trees",)
    TREES_FIELD_NUMBER: _ClassVar[int]
    trees: _containers.RepeatedCompositeFieldContainer[OutcomeTree]
    def __init__(self, trees: _Optional[_Iterable[_Union[OutcomeTree, _Mapping]]] = ...) -> None: ...

class OutcomeTree(_message.Message):
    __slots__ = ("outcome", "token_ids", "parents", "scores")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    outcome: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    scores: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, outcome: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., scores: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftReply(_message.Message):
    __slots__ = ("tree", "unknown_request_ids", "posted", "posted_tags")
    TREE_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    POSTED_FIELD_NUMBER: _ClassVar[int]
    POSTED_TAGS_FIELD_NUMBER: _ClassVar[int]
    tree: DraftTreeMsg
    unknown_request_ids: _containers.RepeatedScalarFieldContainer[str]
    posted: bool
    posted_tags: _containers.RepeatedCompositeFieldContainer[_common_pb2.RequestTag]
    def __init__(self, tree: _Optional[_Union[DraftTreeMsg, _Mapping]] = ..., unknown_request_ids: _Optional[_Iterable[str]] = ..., posted: _Optional[bool] = ..., posted_tags: _Optional[_Iterable[_Union[_common_pb2.RequestTag, _Mapping]]] = ...) -> None: ...

class ExtendItem(_message.Message):
    __slots__ = ("tag", "token_ids", "features", "feature_ref")
    TAG_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_REF_FIELD_NUMBER: _ClassVar[int]
    tag: _common_pb2.RequestTag
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    features: _common_pb2.Tensor
    feature_ref: ChannelRef
    def __init__(self, tag: _Optional[_Union[_common_pb2.RequestTag, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., features: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., feature_ref: _Optional[_Union[ChannelRef, _Mapping]] = ...) -> None: ...

class ExtendRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ExtendItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ExtendItem, _Mapping]]] = ...) -> None: ...

class DrafterReply(_message.Message):
    __slots__ = ("unknown_request_ids",)
    UNKNOWN_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    unknown_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, unknown_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("role", "model", "kind", "vocab_size", "max_len", "max_slots", "used_slots", "feature_layers", "device", "kv_blocks", "kv_block_size", "kv_used_blocks", "feature_channel", "decode_ahead", "decode_ahead_taken", "decode_ahead_forgotten", "busy_s", "calls", "tree_channel", "next_trees_made", "next_trees_taken", "feature_early_reads", "feature_ring_messages", "feature_group_messages", "early_trees_taken", "prefills_with_verdicts", "one_thread_forwards")
    class BusySEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class CallsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    DECODE_AHEAD_FIELD_NUMBER: _ClassVar[int]
    DECODE_AHEAD_TAKEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_AHEAD_FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    BUSY_S_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    TREE_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    NEXT_TREES_MADE_FIELD_NUMBER: _ClassVar[int]
    NEXT_TREES_TAKEN_FIELD_NUMBER: _ClassVar[int]
    FEATURE_EARLY_READS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_RING_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_GROUP_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    EARLY_TREES_TAKEN_FIELD_NUMBER: _ClassVar[int]
    PREFILLS_WITH_VERDICTS_FIELD_NUMBER: _ClassVar[int]
    ONE_THREAD_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    role: str
    model: str
    kind: str
    vocab_size: int
    max_len: int
    max_slots: int
    used_slots: int
    feature_layers: str
    device: str
    kv_blocks: int
    kv_block_size: int
    kv_used_blocks: int
    feature_channel: str
    decode_ahead: bool
    decode_ahead_taken: int
    decode_ahead_forgotten: int
    busy_s: _containers.ScalarMap[str, float]
    calls: _containers.ScalarMap[str, int]
    tree_channel: str
    next_trees_made: int
    next_trees_taken: int
    feature_early_reads: int
    feature_ring_messages: int
    feature_group_messages: int
    early_trees_taken: int
    prefills_with_verdicts: int
    one_thread_forwards: int
    def __init__(self, role: _Optional[str] = ..., model: _Optional[str] = ..., kind: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_len: _Optional[int] = ..., max_slots: _Optional[int] = ..., used_slots: _Optional[int] = ..., feature_layers: _Optional[str] = ..., device: _Optional[str] = ..., kv_blocks: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., kv_used_blocks: _Optional[int] = ..., feature_channel: _Optional[str] = ..., decode_ahead: _Optional[bool] = ..., decode_ahead_taken: _Optional[int] = ..., decode_ahead_forgotten: _Optional[int] = ..., busy_s: _Optional[_Mapping[str, float]] = ..., calls: _Optional[_Mapping[str, int]] = ..., tree_channel: _Optional[str] = ..., next_trees_made: _Optional[int] = ..., next_trees_taken: _Optional[int] = ..., feature_early_reads: _Optional[int] = ..., feature_ring_messages: _Optional[int] = ..., feature_group_messages: _Optional[int] = ..., early_trees_taken: _Optional[int] = ..., prefills_with_verdicts: _Optional[int] = ..., one_thread_forwards: _Optional[int] = ...) -> None: ...
