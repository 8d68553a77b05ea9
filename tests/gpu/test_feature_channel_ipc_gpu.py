"""The feature channel between two processes on ONE GPU: payloads in the CUDA IPC ring (run with
`python -m pytest -m gpu tests/gpu/test_feature_channel_ipc_gpu.py`):

- the sender on cuda:0 in this process, the receiver on cuda:0 in a spawned process: the channel
  comes up with the CUDA IPC ring; bf16 and fp32 messages arrive whole, each slot reused many
  times; a source tensor overwritten right after `send` (a CUDA graph output) arrives as it was
  when sent, in a burst too (the messages finding every slot unread wait for a freed one, as
  snapshots); a message larger than a slot goes through host memory and arrives whole too;
- `python -m verifier` and `python -m drafter` on the same GPU, joined by --feature-channel:
  the drafter maps the ring, every reply carries ChannelRefs, and greedy tokens equal the
  in-process speculator's.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import pytest
import torch

from spectandem.channel import ChannelRef, FeatureReceiver, FeatureSender
from tests.router.test_feature_channel import _address

pytestmark = pytest.mark.gpu

DEVICE = "cuda:0"


def _receiver_process(address: str, orders, results) -> None:
    receiver = FeatureReceiver(address, DEVICE, capacity=64, take_timeout_s=60.0)
    try:
        refs = orders.get(timeout=300)
        out = []
        for seq, index in refs:
            t = receiver.take(ChannelRef(seq, index))
            assert t.device == torch.device(DEVICE)
            out.append(t.float().cpu())
        results.put((receiver._group.transport, receiver.lost, out))
        orders.get(timeout=300)
    finally:
        receiver.close()


def test_same_gpu_payloads_go_through_the_cuda_ipc_ring():
    ctx = multiprocessing.get_context("spawn")
    orders, results = ctx.Queue(), ctx.Queue()
    address = _address()
    child = ctx.Process(target=_receiver_process, args=(address, orders, results), daemon=True)
    child.start()
    sender = FeatureSender(address, DEVICE, ring_slots=3, slot_bytes=256 << 10)
    try:
        deadline = time.monotonic() + 120
        while not sender.ready:
            assert time.monotonic() < deadline and sender.state != "broken", sender.state
            time.sleep(0.01)
        ring = sender._group.ring
        assert sender._group.transport == "CUDA IPC ring" and ring is not None
        g = torch.Generator(device=DEVICE).manual_seed(0)
        source = torch.empty(5, 12288, dtype=torch.bfloat16, device=DEVICE)   # reused like a graph output
        sent, refs = [], []
        for k in range(30):
            source.normal_(generator=g)
            sent.append(source.float().cpu())
            small = torch.randn(2, 64, device=DEVICE, generator=g)
            r = sender.send([source, small.to(torch.bfloat16)])
            sent.append(small.to(torch.bfloat16).float().cpu())
            refs += r
            source.fill_(-1.0)                 # overwritten at once: the sent bytes must not change
            while ring.free() < ring.slots:    # one at a time: each message finds a free slot
                time.sleep(0.001)
        assert ring.written == 30
        for k in range(8):   # a burst: those finding every slot unread wait for one, as snapshots
            source.normal_(generator=g)
            sent.append(source.float().cpu())
            refs += sender.send([source])
            source.fill_(-1.0)
        large = torch.randn(64, 4096, device=DEVICE, generator=g)   # 1 MiB: through host memory
        refs += sender.send([large])
        sent.append(large.cpu())
        orders.put([(r.seq, r.index) for r in refs])
        transport, lost, got = results.get(timeout=300)
        assert transport == "CUDA IPC ring" and lost == 0
        assert len(got) == len(sent)
        for a, b in zip(got, sent):
            assert torch.equal(a, b)
        assert (sender.ring_messages, sender.group_messages) == (38, 1)
        orders.put(None)
    finally:
        sender.close()
        child.join(60)
        if child.is_alive():
            child.kill()


def test_engines_on_one_gpu_use_the_ring_and_match_local(tmp_path):
    from router.local import LocalSpeculator
    from spectandem.config import SamplingParams, SpecConfig
    from spectandem.demo import demo_paths
    from router.links_grpc import GrpcDrafterLink
    from tests.gpu.test_feature_channel_gpu import LIKE_LOCAL, _spawn_on
    from tests.router.link_harness import MAX_LEN, PROMPT_TEXTS, TREE, _assert_same, speculate
    from tests.router.test_feature_channel import RecordingVerifier, _maps_ring, _wait_state

    target, draft = demo_paths("eagle3")
    local = LocalSpeculator(target, draft, SpecConfig(method="eagle3", **TREE), max_slots=4, max_len=MAX_LEN,
                            device=DEVICE)
    prompts = [local.tokenizer.encode(t).ids for t in PROMPT_TEXTS]
    greedy = [SamplingParams(max_tokens=24) for _ in prompts]
    tree = ["--num-steps", str(TREE["num_steps"]), "--topk", str(TREE["topk"]),
            "--num-draft-tokens", str(TREE["num_draft_tokens"])]
    common = ["--max-slots", "4", *LIKE_LOCAL, "--max-len", str(MAX_LEN), "--feature-channel", _address()]
    procs = []
    try:
        procs.append(_spawn_on(0, ["-m", "verifier", *common], tmp_path / "v.log"))
        procs.append(_spawn_on(0, ["-m", "drafter", *common, *tree], tmp_path / "d.log"))

        async def run():
            v, d = RecordingVerifier(procs[0][1], timeout_s=60), GrpcDrafterLink(procs[1][1], timeout_s=60)
            try:
                await _wait_state(v, "up", timeout=120)
                out = await speculate(v, d, prompts, greedy, local.eos_token_ids, local.lookahead)
                return out, {type(h).__name__ for h in v.handles}
            finally:
                await v.close()
                await d.close()

        got, kinds = asyncio.run(run())
        assert _maps_ring(procs[1][0].pid)
    finally:
        for p, _ in procs:
            p.terminate()
            p.wait(30)
    assert kinds == {"ChannelRef"}, kinds
    _assert_same(got, local.generate(prompts, greedy), same_stats=False)
