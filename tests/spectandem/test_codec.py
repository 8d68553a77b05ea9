"""spectandem.codec, the protobuf edge of the engine links: every wire dtype (bfloat16 included),
empty and non-contiguous tensors, draft trees with and without draft probabilities, sampling
parameters, link messages, and the malformed messages each decoder refuses."""

from __future__ import annotations

import pytest
import torch

from spectandem.protocol import DrafterPrefillItem, Tag, Verdict, VerifierPrefillItem
from spectandem import codec
from spectandem.config import SamplingParams
from spectandem.messages import DraftTree
from spectandem.v1 import common_pb2, engines_pb2


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool]


def _sample(dtype: torch.dtype, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype == torch.int64:
        return torch.randint(-2 ** 62, 2 ** 62, shape, generator=g)
    return (torch.randn(shape, generator=g) * 100).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3, 5), (0,), (2, 0, 4), ()], ids=str)
def test_tensor_round_trip(dtype, shape):
    x = _sample(dtype, shape)
    msg = common_pb2.Tensor.FromString(codec.tensor_to_msg(x).SerializeToString())
    y = codec.tensor_from_msg(msg)
    assert y.dtype == dtype and y.shape == x.shape and torch.equal(x, y)
    assert len(msg.data) == x.numel() * x.element_size()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_non_contiguous_and_writable(dtype):
    x = _sample(dtype, (4, 6)).t()[1:]                                              # a strided view
    y = codec.tensor_from_msg(codec.tensor_to_msg(x))
    assert torch.equal(x, y)
    y.zero_()  # the decoded tensor owns its memory


def test_tensor_bytes_are_little_endian_row_major():
    msg = codec.tensor_to_msg(torch.tensor([[1, 2]], dtype=torch.int64))
    assert msg.dtype == "int64" and list(msg.shape) == [1, 2]
    assert msg.data == (1).to_bytes(8, "little") + (2).to_bytes(8, "little")
    bf = codec.tensor_to_msg(torch.tensor([1.0], dtype=torch.bfloat16))
    assert bf.data == bytes([0x80, 0x3F])  # 1.0 in bfloat16 is 0x3F80


def test_tensor_rejects_bad_messages():
    with pytest.raises(ValueError, match="unknown tensor dtype"):
        codec.tensor_from_msg(common_pb2.Tensor(dtype="int32", shape=[1], data=b"\0" * 4))
    with pytest.raises(ValueError, match="needs 24 bytes, got 20"):
        codec.tensor_from_msg(common_pb2.Tensor(dtype="float32", shape=[2, 3], data=b"\0" * 20))
    with pytest.raises(ValueError, match="cannot cross the wire"):
        codec.tensor_to_msg(torch.zeros(2, dtype=torch.int32))


def _tree(with_probs: bool) -> DraftTree:
    # Request a: r -> {x, y}, x -> z; request b: a chain of one draft, padded.
    probs = torch.rand(2, 4, 7, dtype=torch.float64) if with_probs else None
    return DraftTree(request_ids=["a", "b"], committed_lens=[9, 4],
                     token_ids=torch.tensor([[5, 6, 7, 8], [3, 2, -1, -1]]),
                     parents=torch.tensor([[-1, 0, 0, 1], [-1, 0, -1, -1]]),
                     node_valid=torch.tensor([[True] * 4, [True, True, False, False]]),
                     scores=torch.tensor([[0.0, -0.5, -1.5, -0.7], [0.0, -0.1, float("-inf"), float("-inf")]]),
                     draft_probs=probs, sampled=[with_probs, False])


@pytest.mark.parametrize("with_probs", [False, True])
def test_draft_tree_round_trip(with_probs):
    tree = _tree(with_probs)
    msg = engines_pb2.DraftTreeMsg.FromString(codec.draft_tree_to_msg(tree, [3, 0]).SerializeToString())
    back, tags = codec.draft_tree_from_msg(msg)
    assert tags == [Tag("a", 3, 9), Tag("b", 0, 4)]
    assert back.request_ids == tree.request_ids and back.committed_lens == tree.committed_lens
    for name in ("token_ids", "parents", "node_valid", "scores"):
        assert torch.equal(getattr(back, name), getattr(tree, name)), name
    assert back.sampled == tree.sampled
    if with_probs:
        assert torch.equal(back.draft_probs, tree.draft_probs)
    else:
        assert back.draft_probs is None and not msg.HasField("draft_probs")


def test_draft_tree_rejects_mismatched_shapes():
    msg = codec.draft_tree_to_msg(_tree(False), [0, 0])
    msg.parents.CopyFrom(codec.tensor_to_msg(torch.zeros(2, 3, dtype=torch.int64)))
    with pytest.raises(ValueError, match="parents"):
        codec.draft_tree_from_msg(msg)
    msg = codec.draft_tree_to_msg(_tree(False), [0, 0])
    msg.draft_probs.CopyFrom(codec.tensor_to_msg(torch.zeros(0, dtype=torch.float64)))  # empty = none
    assert codec.draft_tree_from_msg(msg)[0].draft_probs is None


def test_params_and_link_messages_round_trip():
    for p in [SamplingParams(), SamplingParams(max_tokens=3, temperature=0.5, top_p=0.25, top_k=40, seed=2 ** 62,
                                               stop_token_ids=(1, 2), stop=("\n\n",), ignore_eos=True)]:
        back = codec.params_from_msg(common_pb2.SamplingParams.FromString(codec.params_to_msg(p).SerializeToString()))
        assert back == p  # 0.5 and 0.25 are exact in float32
    assert not codec.params_to_msg(SamplingParams()).HasField("top_p")
    with pytest.raises(ValueError, match="max_tokens"):
        codec.params_from_msg(common_pb2.SamplingParams())
    item = VerifierPrefillItem(Tag("r", 1, 3), [4, 5, 6], SamplingParams(max_tokens=8), seed=77)
    back = codec.verifier_prefill_item_from_msg(codec.verifier_prefill_item_to_msg(item))
    assert back.tag == item.tag and back.prompt_ids == item.prompt_ids and back.seed == 77
    assert back.params == SamplingParams(max_tokens=8, seed=77)
    feats = torch.randn(3, 8)
    d = DrafterPrefillItem(Tag("r", 1, 4), [4, 5, 6], 9, SamplingParams(), 5, codec.tensor_to_msg(feats))
    back = codec.drafter_prefill_item_from_msg(codec.drafter_prefill_item_to_msg(d))
    assert torch.equal(back.features, feats) and back.first_token_id == 9 and back.seed == 5
    r = Verdict(Tag("r", 0, 12), [7, 8], 1, 4, None)
    assert codec.verdict_from_msg(codec.verdict_to_msg(r)) == r
    for s, layers in [("none", None), ("final", "final"), ("2,4,5", (2, 4, 5))]:
        assert codec.feature_layers_from_str(s) == layers and codec.feature_layers_to_str(layers) == s
    with pytest.raises(ValueError, match="feature layers"):
        codec.feature_layers_from_str("2,x")


def test_ahead_reply_round_trip_and_the_trees_it_makes():
    """DraftAhead's reply: hit flags (None kept) and per tag its outcome trees, float32 scores
    exact; the router's tree from them is the one trees_from_ready builds locally."""
    from spectandem.protocol import AheadReply
    from spectandem.messages import ReadyTree, trees_from_ready

    chain = ReadyTree((7, 11, 12, 13), (-1, 0, 1, 2), (0.0, -0.25, -1.5, float(torch.tensor(-2.1))))
    short = ReadyTree((9, 4, -1), (-1, 0, -1), (0.0, -0.5, float("-inf")))
    reply = AheadReply([True, None, False], [{(3, 7): chain, (9,): short}, None, {}])
    back = codec.ahead_reply_from_msg(engines_pb2.DraftAheadReply.FromString(
        codec.ahead_reply_to_msg(reply).SerializeToString()))
    assert back.hits == [True, None, False]
    assert back.trees == [{(3, 7): chain, (9,): short}, None, None]   # an empty table is no table
    tree = trees_from_ready(["a", "b"], [20, 31], [chain, short])
    assert tree.token_ids.tolist() == [[7, 11, 12, 13], [9, 4, -1, -1]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2], [-1, 0, -1, -1]]
    assert tree.node_valid.tolist() == [[True] * 4, [True, True, False, False]]
    assert tree.scores[0].tolist() == list(chain.scores) and tree.draft_probs is None


@pytest.mark.parametrize("bad, match", [
    (dict(outcome=[], token_ids=[5], parents=[-1], scores=[0.0]), "need an outcome"),
    (dict(outcome=[5], token_ids=[5, 6], parents=[-1], scores=[0.0, 0.0]), "equal, non-empty rows"),
    (dict(outcome=[4], token_ids=[5, 6], parents=[-1, 0], scores=[0.0, 0.0]), "outcome's last token"),
    (dict(outcome=[5], token_ids=[5, 6], parents=[0, 0], scores=[0.0, 0.0]), "parent -1"),
    (dict(outcome=[5], token_ids=[5, 6, 7], parents=[-1, 2, 0], scores=[0.0] * 3), "earlier node"),
])
def test_ahead_reply_rejects_trees_the_verifier_could_not_take(bad, match):
    msg = engines_pb2.DraftAheadReply(cache_hits=[1], outcome_trees=[
        engines_pb2.OutcomeTrees(trees=[engines_pb2.OutcomeTree(**bad)])])
    with pytest.raises(ValueError, match=match):
        codec.ahead_reply_from_msg(msg)
    with pytest.raises(ValueError, match="2 outcome_trees for 1 tags"):
        codec.ahead_reply_from_msg(engines_pb2.DraftAheadReply(cache_hits=[1], outcome_trees=[
            engines_pb2.OutcomeTrees(), engines_pb2.OutcomeTrees()]))


@pytest.mark.parametrize("ahead", [{}, {"taken": 0, "forgotten": 0}, {"taken": 17, "forgotten": 3}], ids=str)
def test_engine_info_round_trip(ahead):
    """A verifier's info crosses the wire whole: its KV pool, its device and its decode-ahead
    counts (none for an engine that does not decode ahead, zeros for one that has not yet)."""
    from spectandem.protocol import EngineInfo

    info = EngineInfo(role="verifier", model="target", kind="NativeRunner", vocab_size=4096, max_len=256,
                      max_slots=8, used_slots=2, feature_layers=(2, 4, 5), extra={"device": "cpu"},
                      kv={"num_blocks": 64, "block_size": 16, "used_blocks": 9}, decode_ahead=ahead)
    back = codec.engine_info_from_msg(engines_pb2.EngineInfo.FromString(
        codec.engine_info_to_msg(info).SerializeToString()))
    assert back == info
