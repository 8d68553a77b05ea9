"""The wire codec: torch tensors, draft trees, sampling parameters and the link messages of
router/links.py to and from their protobuf messages (spectandem/v1). Protobuf lives only here
and in the gRPC adapters; nothing is ever pickled.

Tensors cross as raw little-endian bytes in row-major order with a dtype name and a shape.
bfloat16 has no numpy type: its bytes are those of the same tensor viewed as int16.
Decoding checks the dtype name and that the byte count is prod(shape) * itemsize, and raises
ValueError otherwise (a peer's bad message is an input error, never an assert).
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

from spectandem.channel import ChannelRef
from spectandem.config import SamplingParams
from spectandem.messages import DraftTree, ReadyTree
from spectandem.protocol import (AheadReply, DrafterPrefillItem, EngineInfo, ExtendItem, PlainItem, Tag, Verdict,
                                 VerifierPrefillItem, VerifierPrefillResult)
from spectandem.v1 import common_pb2, engines_pb2

# dtype name -> (torch dtype, the torch dtype its bytes are moved as, little-endian numpy dtype)
_DTYPES: dict[str, tuple[torch.dtype, torch.dtype, str]] = {
    "float32": (torch.float32, torch.float32, "<f4"),
    "float16": (torch.float16, torch.float16, "<f2"),
    "bfloat16": (torch.bfloat16, torch.int16, "<i2"),
    "float64": (torch.float64, torch.float64, "<f8"),
    "int64": (torch.int64, torch.int64, "<i8"),
    "bool": (torch.bool, torch.bool, "|b1"),
}
_NAMES = {torch_dtype: name for name, (torch_dtype, _, _) in _DTYPES.items()}


# ----------------------------------------------------------------------------------------------
# Tensors


def tensor_to_msg(t: torch.Tensor) -> common_pb2.Tensor:
    """Any tensor of a wire dtype, on any device, contiguous or not."""
    name = _NAMES.get(t.dtype)
    if name is None:
        raise ValueError(f"dtype {t.dtype} cannot cross the wire; supported: {', '.join(_DTYPES)}")
    _, carrier, np_dtype = _DTYPES[name]
    arr = t.detach().to("cpu").contiguous().view(carrier).numpy()
    if sys.byteorder != "little":
        arr = arr.astype(np_dtype)
    return common_pb2.Tensor(dtype=name, shape=list(t.shape), data=arr.tobytes())


def tensor_from_msg(msg: common_pb2.Tensor) -> torch.Tensor:
    """A fresh, writable CPU tensor."""
    if msg.dtype not in _DTYPES:
        raise ValueError(f"unknown tensor dtype {msg.dtype!r}; supported: {', '.join(_DTYPES)}")
    torch_dtype, carrier, np_dtype = _DTYPES[msg.dtype]
    shape = tuple(msg.shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor shape {list(shape)} has a negative dimension")
    itemsize = np.dtype(np_dtype).itemsize
    expected = math.prod(shape) * itemsize
    if len(msg.data) != expected:
        raise ValueError(f"{msg.dtype} tensor of shape {list(shape)} needs {expected} bytes, got {len(msg.data)}")
    # astype to the native byte order copies, so the tensor owns writable memory.
    arr = np.frombuffer(msg.data, dtype=np_dtype).astype(np.dtype(np_dtype).newbyteorder("="))
    return torch.from_numpy(arr).view(carrier).view(torch_dtype).reshape(shape)


def optional_tensor_to_msg(t: torch.Tensor | None) -> common_pb2.Tensor | None:
    return None if t is None else tensor_to_msg(t)


def optional_tensor_from_msg(parent, field: str) -> torch.Tensor | None:
    """The tensor in `parent.field`, None when the field is unset."""
    return tensor_from_msg(getattr(parent, field)) if parent.HasField(field) else None


def feature_handle(x) -> dict:
    """A feature handle as the keyword arguments of a message's `feature_handle` oneof: Tensor
    messages pass through unchanged (features from a gRPC verifier), a torch tensor (from an
    in-process verifier) is encoded, a ChannelRef (features sent over the direct channel)
    becomes `feature_ref`; None sets nothing."""
    if x is None:
        return {}
    if isinstance(x, ChannelRef):
        return {"feature_ref": engines_pb2.ChannelRef(seq=x.seq, index=x.index)}
    return {"features": x if isinstance(x, common_pb2.Tensor) else tensor_to_msg(x)}


# ----------------------------------------------------------------------------------------------
# Tags, sampling parameters, feature layers


def tag_to_msg(tag: Tag) -> common_pb2.RequestTag:
    return common_pb2.RequestTag(request_id=tag.request_id, epoch=tag.epoch, committed_len=tag.committed_len)


def tag_from_msg(msg: common_pb2.RequestTag) -> Tag:
    return Tag(msg.request_id, msg.epoch, msg.committed_len)


def params_to_msg(p: SamplingParams, seed: int | None = None) -> common_pb2.SamplingParams:
    """`seed` overrides p.seed (the link items carry the resolved seed beside the params)."""
    seed = p.seed if seed is None else seed
    msg = common_pb2.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k,
                                    stop_token_ids=list(p.stop_token_ids), stop=list(p.stop),
                                    ignore_eos=p.ignore_eos)
    if p.top_p != 1.0:
        msg.top_p = p.top_p
    if seed is not None:
        msg.seed = seed
    return msg


def params_from_msg(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Validated by SamplingParams (ValueError on bad values). Floats cross as float32, so a
    temperature or top_p of the wire is the float32 nearest the sender's."""
    return SamplingParams(max_tokens=msg.max_tokens, temperature=msg.temperature,
                          top_p=msg.top_p if msg.HasField("top_p") else 1.0, top_k=msg.top_k,
                          seed=msg.seed if msg.HasField("seed") else None,
                          stop_token_ids=tuple(msg.stop_token_ids), stop=tuple(msg.stop), ignore_eos=msg.ignore_eos)


def feature_layers_to_str(layers) -> str:
    """None -> "none", "final" -> "final", (2, 4, 5) -> "2,4,5"."""
    if layers is None:
        return "none"
    if layers == "final":
        return "final"
    return ",".join(str(int(i)) for i in layers)


def feature_layers_from_str(s: str):
    """Inverse of feature_layers_to_str ("" is "none")."""
    s = s.strip()
    if s in ("", "none"):
        return None
    if s == "final":
        return "final"
    try:
        layers = tuple(int(x) for x in s.split(","))
    except ValueError:
        raise ValueError(f"feature layers must be 'none', 'final' or comma-separated layer indices, "
                         f"got {s!r}") from None
    if any(i < 0 for i in layers):
        raise ValueError(f"feature layer indices must be >= 0, got {s!r}")
    return layers


# ----------------------------------------------------------------------------------------------
# Draft trees


def draft_tree_to_msg(tree: DraftTree, epochs: list[int]) -> engines_pb2.DraftTreeMsg:
    """`epochs[b]` is request b's epoch (the tree itself carries ids and committed lengths)."""
    assert len(epochs) == len(tree.request_ids)
    msg = engines_pb2.DraftTreeMsg(
        tags=[common_pb2.RequestTag(request_id=r, epoch=e, committed_len=n)
              for r, e, n in zip(tree.request_ids, epochs, tree.committed_lens)],
        token_ids=tensor_to_msg(tree.token_ids), parents=tensor_to_msg(tree.parents),
        node_valid=tensor_to_msg(tree.node_valid), scores=tensor_to_msg(tree.scores), sampled=list(tree.sampled))
    if tree.draft_probs is not None:
        msg.draft_probs.CopyFrom(tensor_to_msg(tree.draft_probs))
    return msg


def draft_tree_from_msg(msg: engines_pb2.DraftTreeMsg) -> tuple[DraftTree, list[Tag]]:
    """The tree and its tags. An unset or empty draft_probs is None."""
    tags = [tag_from_msg(t) for t in msg.tags]
    token_ids = tensor_from_msg(msg.token_ids)            # [B, N] int64
    parents = tensor_from_msg(msg.parents)                # [B, N] int64
    node_valid = tensor_from_msg(msg.node_valid)          # [B, N] bool
    scores = tensor_from_msg(msg.scores)                  # [B, N] float32
    probs = optional_tensor_from_msg(msg, "draft_probs")  # [B, N, V] float64 or None
    if probs is not None and probs.numel() == 0:
        probs = None
    b = len(tags)
    checks = [("token_ids", token_ids, torch.int64, 2), ("parents", parents, torch.int64, 2),
              ("node_valid", node_valid, torch.bool, 2), ("scores", scores, torch.float32, 2)]
    if probs is not None:
        checks.append(("draft_probs", probs, torch.float64, 3))
    n = token_ids.shape[1] if token_ids.dim() == 2 else -1
    for name, t, dtype, dims in checks:
        if t.dtype != dtype or t.dim() != dims or tuple(t.shape[:2]) != (b, n):
            raise ValueError(f"draft tree {name}: {t.dtype} {list(t.shape)}; expected {dtype} [{b}, N"
                             f"{', V' if dims == 3 else ''}] with N = {n} for {b} tags")
    if msg.sampled and len(msg.sampled) != b:
        raise ValueError(f"draft tree: {len(msg.sampled)} sampled flags for {b} tags")
    tree = DraftTree(request_ids=[t.request_id for t in tags], committed_lens=[t.committed_len for t in tags],
                     token_ids=token_ids, parents=parents, node_valid=node_valid, scores=scores,
                     draft_probs=probs, sampled=list(msg.sampled))
    return tree, tags


def draft_tree_to_bytes(tree: DraftTree, tags) -> bytes:
    """A round's trees as the tree channel carries them (a serialized DraftTreeMsg)."""
    return draft_tree_to_msg(tree, [t.epoch for t in tags]).SerializeToString()


def draft_tree_from_bytes(data: bytes) -> tuple[DraftTree, list[Tag]]:
    return draft_tree_from_msg(engines_pb2.DraftTreeMsg.FromString(data))


def ahead_reply_to_msg(reply: AheadReply) -> engines_pb2.DraftAheadReply:
    return engines_pb2.DraftAheadReply(
        cache_hits=[-1 if h is None else int(h) for h in reply.hits],
        outcome_trees=[engines_pb2.OutcomeTrees(trees=[
            engines_pb2.OutcomeTree(outcome=list(key), token_ids=list(t.token_ids), parents=list(t.parents),
                                    scores=list(t.scores)) for key, t in (trees or {}).items()])
            for trees in reply.trees],
        unknown_request_ids=list(reply.unknown))


def ahead_reply_from_msg(msg: engines_pb2.DraftAheadReply) -> AheadReply:
    """Checks each tree's shape (a tree the router sends on must be one the verifier takes):
    ValueError naming what is wrong. No trees at all (an older drafter): None per tag."""
    hits = [None if h < 0 else bool(h) for h in msg.cache_hits]
    unknown = list(msg.unknown_request_ids)
    if not msg.outcome_trees:
        return AheadReply(hits, [None] * len(hits), unknown)
    if len(msg.outcome_trees) != len(hits):
        raise ValueError(f"DraftAheadReply: {len(msg.outcome_trees)} outcome_trees for {len(hits)} tags")
    trees = []
    for per in msg.outcome_trees:
        table = {}
        for t in per.trees:
            n = len(t.token_ids)
            parents = list(t.parents)
            if not t.outcome or n == 0 or len(parents) != n or len(t.scores) != n:
                raise ValueError(f"OutcomeTree: outcome of {len(t.outcome)} tokens, token_ids {n}, parents "
                                 f"{len(parents)}, scores {len(t.scores)}: need an outcome and equal, non-empty rows")
            if t.token_ids[0] != t.outcome[-1] or parents[0] != -1 or any(
                    t.token_ids[j] >= 0 and not 0 <= parents[j] < j for j in range(1, n)):
                raise ValueError("OutcomeTree: node 0 must be the outcome's last token with parent -1, and each "
                                 "other node's parent an earlier node")
            table[tuple(t.outcome)] = ReadyTree(tuple(t.token_ids), tuple(parents), tuple(t.scores))
        trees.append(table or None)
    return AheadReply(hits, trees, unknown)


# ----------------------------------------------------------------------------------------------
# Link messages. Feature handles (the `feature_handle` oneof): what the router receives (prefill
# and round results) keeps them as Tensor messages or ChannelRefs, opaque handles it passes on;
# what the drafter receives (prefill and extend items) decodes Tensors to tensors and leaves
# ChannelRefs for the drafter to take from its channel. The encoders accept any (feature_handle).


def _features_in(msg, decode: bool):
    which = msg.WhichOneof("feature_handle")
    if which == "feature_ref":
        return ChannelRef(msg.feature_ref.seq, msg.feature_ref.index)
    if which is None:
        return None
    return tensor_from_msg(msg.features) if decode else msg.features


def verifier_prefill_item_to_msg(item: VerifierPrefillItem) -> engines_pb2.VerifierPrefillItem:
    return engines_pb2.VerifierPrefillItem(tag=tag_to_msg(item.tag), prompt_ids=item.prompt_ids,
                                           params=params_to_msg(item.params, item.seed), resume=item.resume)


def verifier_prefill_item_from_msg(msg: engines_pb2.VerifierPrefillItem) -> VerifierPrefillItem:
    params = params_from_msg(msg.params)
    if params.seed is None:
        raise ValueError(f"request {msg.tag.request_id!r}: prefill without a seed")
    return VerifierPrefillItem(tag_from_msg(msg.tag), list(msg.prompt_ids), params, params.seed, msg.resume)


def verifier_prefill_result_to_msg(r: VerifierPrefillResult) -> engines_pb2.VerifierPrefillResult:
    return engines_pb2.VerifierPrefillResult(tag=tag_to_msg(r.tag), first_token_id=r.first_token_id,
                                             with_verdicts=r.with_verdicts, **feature_handle(r.features))


def verifier_prefill_result_from_msg(msg: engines_pb2.VerifierPrefillResult) -> VerifierPrefillResult:
    return VerifierPrefillResult(tag_from_msg(msg.tag), msg.first_token_id, _features_in(msg, decode=False),
                                 msg.with_verdicts)


def plain_item_to_msg(p: PlainItem) -> engines_pb2.PlainItem:
    return engines_pb2.PlainItem(tag=tag_to_msg(p.tag), last_token_id=p.last_token_id, steps=p.steps, again=p.again)


def plain_item_from_msg(msg: engines_pb2.PlainItem) -> PlainItem:
    return PlainItem(tag_from_msg(msg.tag), msg.last_token_id, max(1, msg.steps), msg.again)


def verdict_to_msg(r: Verdict) -> engines_pb2.VerifyResultMsg:
    return engines_pb2.VerifyResultMsg(tag=tag_to_msg(r.tag), token_ids=r.token_ids, num_accepted=r.num_accepted,
                                       num_draft_tokens=r.num_draft_tokens, to_drafter=r.to_drafter,
                                       **feature_handle(r.features))


def verdict_from_msg(msg: engines_pb2.VerifyResultMsg) -> Verdict:
    return Verdict(tag_from_msg(msg.tag), list(msg.token_ids), msg.num_accepted, msg.num_draft_tokens,
                       _features_in(msg, decode=False), msg.to_drafter)


def drafter_prefill_item_to_msg(item: DrafterPrefillItem) -> engines_pb2.DrafterPrefillItem:
    return engines_pb2.DrafterPrefillItem(tag=tag_to_msg(item.tag), prompt_ids=item.prompt_ids,
                                          first_token_id=item.first_token_id,
                                          params=params_to_msg(item.params, item.seed),
                                          **feature_handle(item.features))


def drafter_prefill_item_from_msg(msg: engines_pb2.DrafterPrefillItem) -> DrafterPrefillItem:
    params = params_from_msg(msg.params)
    if params.seed is None:
        raise ValueError(f"request {msg.tag.request_id!r}: prefill without a seed")
    return DrafterPrefillItem(tag_from_msg(msg.tag), list(msg.prompt_ids), msg.first_token_id, params,
                              params.seed, _features_in(msg, decode=True))


def extend_item_to_msg(item: ExtendItem) -> engines_pb2.ExtendItem:
    return engines_pb2.ExtendItem(tag=tag_to_msg(item.tag), token_ids=item.token_ids,
                                  **feature_handle(item.features))


def extend_item_from_msg(msg: engines_pb2.ExtendItem) -> ExtendItem:
    return ExtendItem(tag_from_msg(msg.tag), list(msg.token_ids), _features_in(msg, decode=True))


def engine_info_to_msg(info: EngineInfo) -> engines_pb2.EngineInfo:
    return engines_pb2.EngineInfo(role=info.role, model=info.model, kind=info.kind, vocab_size=info.vocab_size,
                                  max_len=info.max_len, max_slots=info.max_slots, used_slots=info.used_slots,
                                  feature_layers=feature_layers_to_str(info.feature_layers),
                                  device=str(info.extra.get("device", "")),
                                  kv_blocks=info.kv.get("num_blocks", 0), kv_block_size=info.kv.get("block_size", 0),
                                  kv_used_blocks=info.kv.get("used_blocks", 0),
                                  feature_channel=str(info.extra.get("feature_channel", "")),
                                  tree_channel=str(info.extra.get("tree_channel", "")),
                                  next_trees_made=int(info.extra.get("next_trees_made", 0)),
                                  next_trees_taken=int(info.extra.get("next_trees_taken", 0)),
                                  feature_early_reads=int(info.extra.get("feature_early_reads", 0)),
                                  feature_ring_messages=int(info.extra.get("feature_ring_messages", 0)),
                                  feature_group_messages=int(info.extra.get("feature_group_messages", 0)),
                                  early_trees_taken=int(info.extra.get("early_trees_taken", 0)),
                                  prefills_with_verdicts=int(info.extra.get("prefills_with_verdicts", 0)),
                                  one_thread_forwards=int(info.extra.get("one_thread_forwards", 0)),
                                  decode_ahead=bool(info.decode_ahead),
                                  decode_ahead_taken=info.decode_ahead.get("taken", 0),
                                  decode_ahead_forgotten=info.decode_ahead.get("forgotten", 0),
                                  busy_s=info.calls.get("busy_s", {}), calls=info.calls.get("count", {}))


def engine_info_from_msg(msg: engines_pb2.EngineInfo) -> EngineInfo:
    return EngineInfo(role=msg.role, model=msg.model, kind=msg.kind, vocab_size=msg.vocab_size, max_len=msg.max_len,
                      max_slots=msg.max_slots, used_slots=msg.used_slots,
                      feature_layers=feature_layers_from_str(msg.feature_layers),
                      extra={k: v for k, v in (("device", msg.device), ("feature_channel", msg.feature_channel),
                                               ("tree_channel", msg.tree_channel),
                                               ("next_trees_made", msg.next_trees_made),
                                               ("next_trees_taken", msg.next_trees_taken),
                                               ("feature_early_reads", msg.feature_early_reads),
                                               ("feature_ring_messages", msg.feature_ring_messages),
                                               ("feature_group_messages", msg.feature_group_messages),
                                               ("early_trees_taken", msg.early_trees_taken),
                                               ("prefills_with_verdicts", msg.prefills_with_verdicts),
                                               ("one_thread_forwards", msg.one_thread_forwards)) if v},
                      kv={"num_blocks": msg.kv_blocks, "block_size": msg.kv_block_size,
                          "used_blocks": msg.kv_used_blocks} if msg.kv_blocks else {},
                      decode_ahead={"taken": msg.decode_ahead_taken,
                                    "forgotten": msg.decode_ahead_forgotten} if msg.decode_ahead else {},
                      calls={"busy_s": dict(msg.busy_s), "count": dict(msg.calls)} if msg.calls else {})
