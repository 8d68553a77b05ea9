"""The drafter captures its CUDA graphs at start-up (run with `python -m pytest -m gpu
tests/gpu/test_drafter_warm_up.py`): a demo pair built with graphs (the engine factory every
backend uses) then generates greedily, sequential and drafting ahead, prompts of several lengths
in batches of several sizes, without capturing one more graph, and its output equals plain
decoding's."""

from __future__ import annotations

import pytest
import torch

from router.local import LocalSpeculator
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from tests.e2e.conftest import PROMPT_TEXTS

pytestmark = pytest.mark.gpu

MAX_LEN = 512


@pytest.fixture(scope="module", autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")


def _speculator(method: str, **tree) -> LocalSpeculator:
    return LocalSpeculator(*demo_paths(method), SpecConfig(method=method, **tree), max_slots=8, max_len=MAX_LEN,
                           device="cuda", cuda_graphs=True, triton_attention=True)


def _captured(proposer) -> dict[str, int]:
    return {name: len(g._captured) for name, g in
            (("chain", proposer.chain), ("catch_up", proposer.catch_up_graphs), ("ahead", proposer.ahead_graphs))}


def test_nothing_captured_while_generating():
    plain = _speculator("none")
    spec = _speculator("eagle3", num_steps=4, topk=1, num_draft_tokens=5, ahead_width=4)
    proposer = spec.drafter.proposer
    at_start = _captured(proposer)
    assert all(at_start.values()), at_start
    tok = spec.tokenizer
    prompts = [tok.encode(t * (1 + i % 3)).ids for i, t in enumerate(PROMPT_TEXTS[:8])]
    params = SamplingParams(max_tokens=40)
    for batch in ([0], [1, 2], [3, 4, 5, 6, 7], list(range(8))):
        group = [prompts[i] for i in batch]
        expected = [o.token_ids for o in plain.generate(group, [params] * len(group))]
        for ahead in (False, True):
            outs = spec.generate(group, [params] * len(group), ahead=ahead)
            assert [o.token_ids for o in outs] == expected, (batch, ahead)
    assert _captured(proposer) == at_start, "graphs were captured while generating"
