"""Multi-step plain decoding (`VerifierEngine.decode`, `NativeRunner.decode_greedy`) on the demo
target in fp32 on the CPU: the tokens and features of `steps` plain rounds, token for token, on
the eager, static (the CUDA graphs' padded step, run eagerly) and tree-attention paths, and on a
runner without the device chain (transformers); the KV it leaves is what the rounds leave, so
speculation continues from it exactly. Bad requests are refused with the field and the limit.
The negative control: a chain that does not feed each step the previous step's token is caught."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spectandem.config import SamplingParams
from spectandem.messages import DraftTree, StaleMessage, root_only_tree
from spectandem.modeling.llama import load_llama
from verifier.engine import VerifierEngine
from verifier.graphs import VerifyGraphs
from verifier.runner import NativeRunner, load_runner

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo" / "target"
AUX = (2, 4, 5)
MAX_LEN = 128
# The demo tokenizer's ids of "def fibonacci(n):\n", "import os\nimport sys\n", "    for i in range(len(".
PROMPTS = [[482, 288, 1550, 270, 1161, 495, 8, 78, 309, 199], [775, 653, 199, 775, 801, 199],
           [259, 379, 274, 310, 1723, 8, 537, 8]]
GREEDY = SamplingParams(max_tokens=64)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    return load_llama(DEMO)


def _engine(runner) -> VerifierEngine:
    eng = VerifierEngine(runner, max_slots=4, vocab_size=4096)
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    eng.prefill(ids, PROMPTS, [GREEDY] * len(ids), [0] * len(ids))
    return eng


def _native(model, path: str) -> NativeRunner:
    runner = NativeRunner(model, AUX, max_slots=4, max_len=MAX_LEN)
    if path == "static":
        runner.graphs = VerifyGraphs(model, runner.cache, graph=False, batch_buckets=(1, 2, 4))
    elif path == "tree":   # the Triton tree attention's inputs, on its torch reference (no Triton here)
        runner.triton_attention = True
    return runner


def _plain_rounds(eng: VerifierEngine, ids: list[str], steps: int):
    """`steps` one-node verify rounds -> (tokens per request, features per request [steps, F])."""
    toks, feats = {i: [] for i in ids}, {i: [] for i in ids}
    for _ in range(steps):
        reqs = [eng.requests[i] for i in ids]
        for o in eng.verify(root_only_tree(ids, [r.committed_len for r in reqs], [r.token_ids[-1] for r in reqs])):
            toks[o.request_id] += o.token_ids
            feats[o.request_id].append(o.features)
    return [toks[i] for i in ids], [None if feats[i][0] is None else torch.cat(feats[i]) for i in ids]


def _decode(eng: VerifierEngine, ids: list[str], steps: int):
    outs = eng.decode(ids, [eng.requests[i].committed_len for i in ids], steps)
    assert [o.request_id for o in outs] == ids
    for o in outs:
        assert o.committed_len == eng.requests[o.request_id].committed_len
        assert (o.num_accepted, o.num_draft_tokens) == (0, 0)
    return [o.token_ids for o in outs], [o.features for o in outs]


@pytest.mark.parametrize("path", ["eager", "static", "tree"])
def test_decode_equals_plain_rounds(model, path):
    ref, eng = _engine(_native(model, "eager")), _engine(_native(model, path))
    ids = list(ref.requests)
    for steps in (5, 1, 7):
        want_t, want_f = _plain_rounds(ref, ids, steps)
        got_t, got_f = _decode(eng, ids, steps)
        assert got_t == want_t
        for g, w in zip(got_f, want_f):
            assert g.shape == w.shape == (steps, 3 * model.spec.hidden_size)
            if path == "eager":   # the same one-node forward, step by step
                assert torch.equal(g, w)
            else:                 # padded rows and another matmul shape: a few ulps
                torch.testing.assert_close(g, w, atol=5e-5, rtol=1e-5)
    # The decoded tokens are the target's greedy continuation (a few fp32 ulps on the static
    # paths cannot move an argmax of the demo model here: checked above token for token).
    for rid in ids:
        assert eng.requests[rid].token_ids == ref.requests[rid].token_ids
    # The KV a decode leaves is the rounds' KV: a speculative round over a tree continues alike.
    tree = _tree(eng, ids)
    a, b = ref.verify(tree), eng.verify(tree)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert sum(o.num_accepted for o in a) > 0      # the tree's drafts were checked against that KV


@pytest.mark.parametrize("path", ["eager", "static"])
def test_decode_without_features_gives_the_same_tokens_and_none(model, path):
    """features=False (a plain round no drafter catches up on: router/pipeline.py's detached
    requests): the same tokens and KV, no features."""
    ref, eng = _engine(_native(model, path)), _engine(_native(model, path))
    ids = list(ref.requests)
    want_t, want_f = _decode(ref, ids, 6)
    outs = eng.decode(ids, [eng.requests[i].committed_len for i in ids], 6, features=False)
    assert [o.token_ids for o in outs] == want_t and all(f is not None for f in want_f)
    assert all(o.features is None for o in outs)
    tree = _tree(eng, ids)
    assert [o.token_ids for o in ref.verify(tree)] == [o.token_ids for o in eng.verify(tree)]


def _tree(eng: VerifierEngine, ids: list[str]) -> DraftTree:
    """A chain of the next greedy tokens (from a plain run ahead on a copy): drafts that are
    accepted only if the KV before them is right."""
    runner = NativeRunner(eng.runner.model, None, max_slots=4, max_len=MAX_LEN)
    probe = VerifierEngine(runner, max_slots=4, vocab_size=4096)
    probe.prefill(ids, [eng.requests[i].token_ids for i in ids], [GREEDY] * len(ids), [0] * len(ids),
                  resume=[True] * len(ids))
    nxt, _ = _plain_rounds(probe, ids, 3)
    b = len(ids)
    tokens = torch.tensor([[eng.requests[i].token_ids[-1]] + t for i, t in zip(ids, nxt)])
    return DraftTree(request_ids=ids, committed_lens=[eng.requests[i].committed_len for i in ids], token_ids=tokens,
                     parents=torch.tensor([[-1, 0, 1, 2]] * b), node_valid=torch.ones(b, 4, dtype=torch.bool),
                     scores=torch.zeros(b, 4))


def test_decode_without_device_chain():
    """A runner without decode_greedy (transformers) decodes round by round: the same tokens."""
    hf, _ = load_runner(DEMO, AUX, max_slots=4, max_len=MAX_LEN, force_hf=True)
    assert not hasattr(hf, "decode_greedy")
    ref, eng = _engine(NativeRunner(load_llama(DEMO), AUX, max_slots=4, max_len=MAX_LEN)), _engine(hf)
    ids = list(ref.requests)
    want_t, want_f = _plain_rounds(ref, ids, 4)
    got_t, got_f = _decode(eng, ids, 4)
    assert got_t == want_t
    for g, w in zip(got_f, want_f):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_decode_refuses_bad_requests(model):
    eng = _engine(_native(model, "eager"))
    eng.prefill(["hot"], [PROMPTS[0]], [SamplingParams(max_tokens=8, temperature=0.7)], [3])
    with pytest.raises(ValueError, match="'hot'.*greedy only.*temperature is 0.7"):
        eng.decode(["r0", "hot"], [eng.requests["r0"].committed_len, eng.requests["hot"].committed_len], 2)
    with pytest.raises(StaleMessage, match="'r1'.*asked at committed length 3"):
        eng.decode(["r1"], [3], 2)
    c = eng.requests["r2"].committed_len
    with pytest.raises(ValueError, match=f"'r2': {MAX_LEN} steps at committed length {c} exceed the context of {MAX_LEN}"):
        eng.decode(["r2"], [c], MAX_LEN)
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        eng.decode(["r2"], [c], 0)
    # Nothing was committed by the refused calls, and the engine still decodes.
    assert eng.requests["r2"].committed_len == c
    assert len(_decode(eng, ["r0", "r1", "r2"], 3)[0][2]) == 3


def test_negative_control_unfed_chain_is_caught(model):
    """A chain whose steps all read the placeholder token (the feed left out) decodes other tokens."""
    ref, eng = _engine(_native(model, "eager")), _engine(_native(model, "eager"))
    ids = list(ref.requests)
    step = eng.runner._step
    eng.runner._step = lambda slots, lens, toks, parents, valid, device_tokens=None, features=True: step(
        slots, lens, toks, parents, valid)
    want, _ = _plain_rounds(ref, ids, 4)
    got, _ = _decode(eng, ids, 4)
    assert got != want
