"""The engines as gRPC services, driven through GrpcVerifierLink + GrpcDrafterLink.

- codec: every wire dtype (bfloat16 included), empty and non-contiguous tensors, draft trees
  with and without draft probabilities, sampling parameters, link messages;
- real servers on free localhost ports with the demo pair, run (a) in this process on a
  background event loop and (b) as `python -m verifier` / `python -m drafter` subprocesses;
  the round protocol over the links (prefill -> draft -> verify -> extend) gives exactly the
  greedy tokens and acceptance counts of the in-process LocalSpeculator;
- errors: a stale tag is StaleMessage, bad input ValueError, a killed drafter EngineUnavailable
  within the per-call timeout; grpc.health.v1 reports SERVING.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.links import (DrafterPrefillItem, EngineUnavailable, ExtendItem, PlainItem, RoundResult, Tag,
                          VerifierPrefillItem)
from router.links_grpc import GrpcDrafterLink, GrpcVerifierLink
from spectandem import codec
from spectandem.checkpoint import load_tokenizer
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from spectandem.local import LocalSpeculator
from spectandem.messages import DraftTree, StaleMessage
from spectandem.reference import Completion, _append
from spectandem.v1 import common_pb2, engines_pb2

ROOT = Path(__file__).resolve().parents[2]
PROMPT_TEXTS = ["def fibonacci(n):\n", "class Queue:\n    def __init__(self", "import os\nimport sys\n\n",
                "    for i in range(len("]
MAX_TOKENS = 24
MAX_LEN = 256
TREE = dict(num_steps=4, topk=2, num_draft_tokens=8)


@pytest.fixture(scope="module")
def prompts():
    tok = load_tokenizer(demo_paths("none")[0])
    return [tok.encode(t).ids for t in PROMPT_TEXTS]


def _greedy(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=MAX_TOKENS) for _ in range(n)]


def _local(method: str, prompts, *param_lists, ahead: bool = False) -> tuple[list[list[Completion]], tuple[int, ...], int]:
    """The in-process reference: completions for each list of params, eos ids, lookahead."""
    target, draft = demo_paths(method)
    spec = LocalSpeculator(target, draft, SpecConfig(method=method, **TREE), max_slots=4, max_len=MAX_LEN)
    return [spec.generate(prompts, ps, ahead=ahead) for ps in param_lists], spec.eos_token_ids, spec.lookahead


# ----------------------------------------------------------------------------------------------
# Codec

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
    r = RoundResult(Tag("r", 0, 12), [7, 8], 1, 4, None)
    assert codec.round_result_from_msg(codec.round_result_to_msg(r)) == r
    for s, layers in [("none", None), ("final", "final"), ("2,4,5", (2, 4, 5))]:
        assert codec.feature_layers_from_str(s) == layers and codec.feature_layers_to_str(layers) == s
    with pytest.raises(ValueError, match="feature layers"):
        codec.feature_layers_from_str("2,x")


# ----------------------------------------------------------------------------------------------
# The round protocol over links (what the router does, without its scheduling)


async def speculate(vlink, dlink, prompts, params, eos: tuple[int, ...], lookahead: int,
                    plain_rounds=lambda rid, n: False, ahead: list | None = None) -> list[Completion]:
    """prefill -> (draft -> verify -> extend)* for a batch, as spectandem.reference.generate does.
    `plain_rounds(request_id, round)` True sends that request as a plain row (no draft).
    `ahead` (a list): DraftAhead on each round's trees, overlapped with their verify; the hit
    flags are appended to it."""
    max_len = (await vlink.info()).max_len
    ids = [f"req-{i}" for i in range(len(prompts))]
    seeds = [p.resolved_seed() for p in params]
    comps = {rid: Completion(rid, list(p)) for rid, p in zip(ids, prompts)}
    sp = dict(zip(ids, params))
    results = await vlink.prefill([VerifierPrefillItem(Tag(rid, 0, len(p)), p, s, seed)
                                   for rid, p, s, seed in zip(ids, prompts, params, seeds)], want_features=True)
    absorb = []
    for r, p, seed in zip(results, prompts, seeds):
        rid = r.tag.request_id
        _append(comps[rid], [r.first_token_id], sp[rid], eos, r.tag.committed_len, max_len)
        if comps[rid].finish_reason is None:
            absorb.append(DrafterPrefillItem(r.tag, p, r.first_token_id, sp[rid], seed, r.features))
    assert await dlink.prefill(absorb) == []
    active = [i.tag for i in absorb]
    n = 0
    while active:
        room = all(t.committed_len - 1 + lookahead <= max_len for t in active)
        drafted = [t for t in active if room and not plain_rounds(t.request_id, n)]
        plain = [PlainItem(t, comps[t.request_id].token_ids[-1]) for t in active if t not in drafted]
        draft = await dlink.draft(drafted) if drafted else None
        if ahead is not None and draft is not None:
            outs, flags = await asyncio.gather(vlink.verify(draft, plain, want_features=True),
                                               dlink.draft_ahead(drafted))
            ahead += flags
        else:
            outs = await vlink.verify(draft, plain, want_features=True)
        assert [o.tag.request_id for o in outs] == [t.request_id for t in drafted] + [p.tag.request_id for p in plain]
        still = []
        for o in outs:
            c = comps[o.tag.request_id]
            c.stats.num_rounds += 1
            c.stats.draft_tokens += o.num_draft_tokens
            c.stats.accepted_tokens += o.num_accepted
            _append(c, o.token_ids, sp[c.request_id], eos, o.tag.committed_len, max_len)
            if c.finish_reason is None:
                still.append(o)
            else:
                await vlink.release([c.request_id])
                await dlink.release([c.request_id])
        if still:
            assert await dlink.extend([ExtendItem(o.tag, o.token_ids, o.features) for o in still]) == []
        active = [o.tag for o in still]
        n += 1
    await vlink.release(ids)
    return [comps[rid] for rid in ids]


def _assert_same(got: list[Completion], expected: list[Completion], same_stats: bool = True):
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.token_ids == e.token_ids, f"prompt {i}"
        assert g.finish_reason == e.finish_reason
        if same_stats:
            assert g.stats == e.stats, f"prompt {i}: {g.stats} != {e.stats}"
    assert sum(g.stats.accepted_tokens for g in got) > 0  # speculation really happened


# ----------------------------------------------------------------------------------------------
# Servers in this process, on a background event loop


class _LoopThread:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def ngram_servers():
    """(verifier address, drafter address) of n-gram engines served from this process."""
    from drafter.service import build_drafter_engine, start_drafter_server
    from verifier.service import build_verifier_engine, resolve_feature_layers, start_verifier_server

    target, _ = demo_paths("ngram")
    cfg = SpecConfig(method="ngram", **TREE)
    layers = resolve_feature_layers(None, "ngram", None, target)
    verifier = build_verifier_engine(target, layers, max_slots=4, max_len=MAX_LEN)
    drafter, _ = build_drafter_engine(cfg, target, None, max_slots=4, max_len=MAX_LEN)
    bg = _LoopThread()
    servers = [bg.run(start_verifier_server(verifier, "127.0.0.1", 0)),
               bg.run(start_drafter_server(drafter, "127.0.0.1", 0, max_slots=4, max_len=MAX_LEN))]
    yield tuple(f"127.0.0.1:{s.port}" for s in servers)
    for s in servers:
        bg.run(s.stop(0))
    bg.close()


def _links(addresses, timeout_s: float = 30.0):
    return GrpcVerifierLink(addresses[0], timeout_s), GrpcDrafterLink(addresses[1], timeout_s)


def test_ngram_in_process_servers_match_local(ngram_servers, prompts):
    (expected,), eos, lookahead = _local("ngram", prompts, _greedy(len(prompts)))

    async def main():
        v, d = _links(ngram_servers)
        try:
            assert (await v.info()).feature_layers is None
            got = await speculate(v, d, prompts, _greedy(len(prompts)), eos, lookahead)
            # Every other round, request 1 decodes as a plain row in the same verify batch.
            mixed = await speculate(v, d, prompts, _greedy(len(prompts)), eos, lookahead,
                                    plain_rounds=lambda rid, n: rid == "req-1" and n % 2 == 1)
            assert (await v.info()).used_slots == 0 and (await d.info()).used_slots == 0
            return got, mixed
        finally:
            await v.close()
            await d.close()

    got, mixed = asyncio.run(main())
    _assert_same(got, expected)
    _assert_same(mixed, expected, same_stats=False)


def test_stale_tags_and_bad_input(ngram_servers, prompts):
    async def main():
        v, d = _links(ngram_servers)
        try:
            p = prompts[0]
            (r,) = await v.prefill([VerifierPrefillItem(Tag("s", 2, len(p)), p, SamplingParams(), 1)], False)
            assert r.tag == Tag("s", 2, len(p) + 1) and r.features is None
            await d.prefill([DrafterPrefillItem(r.tag, p, r.first_token_id, SamplingParams(), 1, None)])
            for bad in (Tag("s", 1, r.tag.committed_len), Tag("s", 2, r.tag.committed_len - 1)):
                with pytest.raises(StaleMessage, match="epoch 2"):
                    await d.draft([bad])
                with pytest.raises(StaleMessage):
                    await v.verify(None, [PlainItem(bad, r.first_token_id)], False)
                with pytest.raises(StaleMessage):
                    await v.features(bad)
            draft = await d.draft([r.tag])
            assert draft.tags == [r.tag]
            (out,) = await v.verify(draft, [], False)
            with pytest.raises(StaleMessage):  # the same draft again: the verifier moved on
                await v.verify(draft, [], False)
            with pytest.raises(StaleMessage):
                await d.extend([ExtendItem(Tag("s", 2, out.tag.committed_len + 1), out.token_ids, None)])
            assert await d.extend([ExtendItem(Tag("gone", 0, 5), [1], None)]) == ["gone"]
            with pytest.raises(ValueError, match="prompt is empty"):
                await v.prefill([VerifierPrefillItem(Tag("e", 0, 0), [], SamplingParams(), 1)], False)
            with pytest.raises(ValueError, match="neither a tree nor plain"):
                await v.verify(None, [], False)
            await v.release(["s"])
            await d.release(["s"])
        finally:
            await v.close()
            await d.close()

    asyncio.run(main())


# ----------------------------------------------------------------------------------------------
# Real entry points in subprocesses


def _spawn(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """Starts a server on a free port; returns it and its address once it prints it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, *args, "--host", "127.0.0.1", "--port", "0"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if "listening on " in line:
                return proc, line.rsplit("listening on ", 1)[1].strip()
        if proc.poll() is not None:
            break
    _stop(proc)
    raise AssertionError(f"{args} did not start:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    proc.stdout.close()


@pytest.fixture(scope="module")
def eagle3_processes(tmp_path_factory):
    """`python -m verifier` and `python -m drafter` without model flags: the demo EAGLE-3 pair
    (the verifier derives its feature layers from the head's config)."""
    logs = tmp_path_factory.mktemp("logs")
    tree = ["--num-steps", str(TREE["num_steps"]), "--topk", str(TREE["topk"]),
            "--num-draft-tokens", str(TREE["num_draft_tokens"])]
    procs = []
    try:
        procs.append(_spawn(["-m", "verifier", "--max-slots", "4", "--max-len", str(MAX_LEN)], logs / "v.log"))
        procs.append(_spawn(["-m", "drafter", "--max-slots", "4", "--max-len", str(MAX_LEN), *tree],
                            logs / "d.log"))
        yield tuple(a for _, a in procs)
    finally:
        for p, _ in procs:
            _stop(p)


def _seeded(n: int) -> list[SamplingParams]:
    """Sampled drafts: their q crosses the wire and the verifier runs rejection sampling.
    (Temperature 1.0 is exact in the wire's float32.)"""
    return [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=100 + i) for i in range(n)]


def test_eagle3_subprocesses_match_local(eagle3_processes, prompts):
    (expected, expected_seeded), eos, lookahead = _local("eagle3", prompts, _greedy(len(prompts)),
                                                         _seeded(len(prompts)))

    async def main():
        v, d = _links(eagle3_processes)
        try:
            vi, di = await v.info(), await d.info()
            assert (vi.role, di.role, di.kind) == ("verifier", "drafter", "eagle3")
            assert vi.feature_layers == di.feature_layers == (2, 4, 5)
            assert vi.max_len == di.max_len == MAX_LEN and vi.max_slots == 4
            return (await speculate(v, d, prompts, _greedy(len(prompts)), eos, lookahead),
                    await speculate(v, d, prompts, _seeded(len(prompts)), eos, lookahead))
        finally:
            await v.close()
            await d.close()

    got, got_seeded = asyncio.run(main())
    _assert_same(got, expected)
    _assert_same(got_seeded, expected_seeded)
    assert any(s.token_ids != g.token_ids for s, g in zip(got_seeded, got))  # it really sampled


def test_draft_ahead_over_grpc_matches_local(eagle3_processes, prompts):
    """DraftAhead over gRPC, overlapped with Verify: greedy and seeded sampled tokens, and the
    trees (stats), equal the in-process loop with the outcome cache; hits and misses happen."""
    (expected, expected_seeded), eos, lookahead = _local("eagle3", prompts, _greedy(len(prompts)),
                                                         _seeded(len(prompts)), ahead=True)

    async def main():
        v, d = _links(eagle3_processes)
        flags: list = []
        try:
            return (await speculate(v, d, prompts, _greedy(len(prompts)), eos, lookahead, ahead=flags),
                    await speculate(v, d, prompts, _seeded(len(prompts)), eos, lookahead, ahead=flags),
                    flags, await d.info())
        finally:
            await v.close()
            await d.close()

    got, got_seeded, flags, info = asyncio.run(main())
    _assert_same(got, expected)
    _assert_same(got_seeded, expected_seeded)
    assert flags.count(True) > 0 and flags.count(False) > 0
    assert info.kv["used_blocks"] == 0


def test_health_and_reflection(eagle3_processes):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    for address, service in zip(eagle3_processes, ("spectandem.v1.Verifier", "spectandem.v1.Drafter")):
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for name in ("", service):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert service in ProtoReflectionDescriptorDatabase(channel).get_services()


def test_killed_drafter_is_unavailable_fast(tmp_path, prompts):
    """`spectandem drafter` (the CLI) on n-gram; SIGKILL it mid-session: the next calls raise
    EngineUnavailable well within the per-call timeout instead of hanging."""
    proc, address = _spawn(["-m", "spectandem.cli", "drafter", "--method", "ngram"], tmp_path / "d.log")
    timeout_s = 5.0

    async def main():
        d = GrpcDrafterLink(address, timeout_s)
        try:
            p = prompts[0]
            tag = Tag("k", 0, len(p) + 1)
            await d.prefill([DrafterPrefillItem(tag, p, 1, SamplingParams(), 1, None)])
            assert (await d.draft([tag])).tags == [tag]
            proc.kill()
            proc.wait()
            for call in (lambda: d.draft([tag]), d.info):
                start = time.monotonic()
                with pytest.raises(EngineUnavailable, match="drafter at"):
                    await call()
                assert time.monotonic() - start < timeout_s
        finally:
            await d.close()

    try:
        asyncio.run(main())
    finally:
        _stop(proc)


def test_unreachable_verifier_is_unavailable():
    async def main():
        v = GrpcVerifierLink("127.0.0.1:1", timeout_s=5.0)
        try:
            with pytest.raises(EngineUnavailable, match="UNAVAILABLE"):
                await v.info()
            with pytest.raises(EngineUnavailable, match="not reachable"):
                await v.wait_ready(0.2)
        finally:
            await v.close()

    asyncio.run(main())
