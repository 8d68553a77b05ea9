"""Multi-step plain decoding on the GPU (`VerifierEngine.decode` over `NativeRunner.decode_greedy`:
the steps chained on the device, each fed the previous step's argmax there) against one-step
verify rounds of an engine on the same paths: the same graphs and kernels at the same shapes, so
tokens and features agree bit for bit, in fp32 and bf16, on the eager path, the CUDA graphs and
the graphs with the Triton paged attention (serve's and the bench's fast path); the KV it leaves
lets speculation continue exactly. And the router's multi-step plain rounds on the fast path
give the tokens of one-step rounds on 8 prompts of the demo pair."""

from __future__ import annotations

import asyncio

import pytest
import torch

from router.links_local import LocalVerifierLink
from router.requests import RouterConfig
from router.loop import Router
from spectandem.checkpoint import load_tokenizer
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from spectandem.messages import root_only_tree
from spectandem.modeling.llama import load_llama
from tests.e2e.conftest import PROMPT_TEXTS
from verifier.engine import VerifierEngine
from verifier.runner import NativeRunner

pytestmark = pytest.mark.gpu

AUX = (2, 4, 5)
MAX_LEN = 256
PATHS = {"eager": {}, "graphs": dict(cuda_graphs=True), "graphs+triton": dict(cuda_graphs=True, triton_attention=True)}


@pytest.fixture(scope="module", autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")


def _engine(model, tokenizer, path: str) -> VerifierEngine:
    eng = VerifierEngine(NativeRunner(model, AUX, max_slots=4, max_len=MAX_LEN, **PATHS[path]), 4, 4096)
    prompts = [tokenizer.encode(t).ids for t in PROMPT_TEXTS[:3]]
    eng.prefill(["a", "b", "c"], prompts, [SamplingParams(max_tokens=200)] * 3, [0, 0, 0])
    return eng


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", list(PATHS))
def test_decode_equals_one_step_rounds(path, dtype):
    target, _ = demo_paths("none")
    model = load_llama(target, dtype, "cuda")
    tokenizer = load_tokenizer(target)
    ref, eng = _engine(model, tokenizer, path), _engine(model, tokenizer, path)
    ids = ["a", "b", "c"]
    for steps in (8, 3, 16):
        want_t, want_f = {i: [] for i in ids}, {i: [] for i in ids}
        for _ in range(steps):
            reqs = [ref.requests[i] for i in ids]
            for o in ref.verify(root_only_tree(ids, [r.committed_len for r in reqs], [r.token_ids[-1] for r in reqs])):
                want_t[o.request_id] += o.token_ids
                want_f[o.request_id].append(o.features)
        outs = eng.decode(ids, [eng.requests[i].committed_len for i in ids], steps)
        for o in outs:
            assert o.token_ids == want_t[o.request_id]
            assert torch.equal(o.features, torch.cat(want_f[o.request_id]))
    # The KV left behind: a verify over a chain of the next tokens accepts alike on both.
    nxt = {i: [] for i in ids}
    probe = [ref.requests[i].token_ids[-1] for i in ids]
    for _ in range(4):
        outs = ref.verify(root_only_tree(ids, [ref.requests[i].committed_len for i in ids], probe))
        probe = [o.token_ids[-1] for o in outs]
        for o in outs:
            nxt[o.request_id] += o.token_ids
    assert [eng.requests[i].token_ids for i in ids] == [ref.requests[i].token_ids[: len(eng.requests[i].token_ids)]
                                                         for i in ids]
    got = eng.decode(ids, [eng.requests[i].committed_len for i in ids], 4)
    assert [o.token_ids for o in got] == [nxt[i] for i in ids]


def test_router_multi_step_plain_rounds_on_the_fast_path():
    target, _ = demo_paths("none")
    tokenizer = load_tokenizer(target)
    prompts = [tokenizer.encode(t).ids for t in PROMPT_TEXTS[:8]]
    params = [SamplingParams(max_tokens=m) for m in (7, 16, 33, 64, 5, 40, 21, 64)]

    def serve(plain_steps: int):
        spec = LocalSpeculator(target, None, SpecConfig(method="none"), max_slots=8, max_len=MAX_LEN, device="cuda",
                               cuda_graphs=True, triton_attention=True)
        router = Router(LocalVerifierLink(spec.verifier), None, spec.tokenizer, RouterConfig(
            max_len=MAX_LEN, eos_token_ids=spec.eos_token_ids, lookahead=1, want_features=False,
            plain_steps=plain_steps))

        async def main():
            router.start()

            async def one(p, sp):
                req, toks = router.submit(p, sp), []
                while not (ev := await asyncio.wait_for(req.events.get(), 60)).finish_reason:
                    toks += ev.token_ids
                return toks + ev.token_ids, ev.finish_reason
            try:
                return await asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, params)))
            finally:
                await router.stop()
        return asyncio.run(main()), router.counters.rounds

    one_step, rounds1 = serve(1)
    chained, rounds8 = serve(8)
    assert chained == one_step
    assert rounds8 < rounds1 / 3
