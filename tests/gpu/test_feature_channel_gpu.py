"""The direct feature channel over NCCL between two GPUs (run with `python -m pytest -m gpu -s
tests/gpu/test_feature_channel_gpu.py`; -s shows the microbenchmark):

- `python -m verifier` on GPU 0 and `python -m drafter` on GPU 1 (CUDA_VISIBLE_DEVICES per
  process, as Ray and Kubernetes place them), joined by --feature-channel: greedy and seeded
  tokens equal those of the same pair without the channel (features inline over gRPC) and of the
  in-process speculator on one GPU; every prefill and verify reply carried ChannelRefs (fp32);
- a microbenchmark of one round's feature handoff, bf16 [5, 12288] (24 KiB per token, 5
  tokens), from the verifier's cuda:0 until the tensor is usable on the drafter's cuda:1: over the
  channel vs the gRPC tensor path (encode, verifier -> router -> drafter, decode, copy in).
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import statistics
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import pytest
import torch

from router.links_grpc import GrpcDrafterLink
from spectandem.channel import NCCL_ERROR_HANDLING, ChannelRef, FeatureReceiver, FeatureSender
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from tests.router.link_harness import MAX_LEN, PROMPT_TEXTS, TREE, _assert_same, speculate
from tests.router.test_feature_channel import RecordingVerifier, _address, _wait_state

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
ENGINE_DEVICE, VERIFIER_DEVICE, DRAFTER_DEVICE = "cuda", "cuda:0", "cuda:1"
BENCH_SHAPE, BENCH_ROUNDS, BENCH_WARMUP = (5, 12288), 300, 30


def _pythonpath() -> str:
    """The repo first, then whatever the caller had (the GPU image gets pytest and the gRPC health
    package from a carried directory on PYTHONPATH: the engine processes need it too)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


@pytest.fixture(scope="module", autouse=True)
def _two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.fail(f"the feature channel test needs 2 CUDA devices, found {torch.cuda.device_count()}")
    os.environ.update(NCCL_ERROR_HANDLING)   # as the engine entry points do (this process and its children)


# The engine processes' numerics set to the in-process reference's (LocalSpeculator: fp32, eager,
# torch attention); on CUDA they default to bf16, CUDA graphs and Triton attention.
LIKE_LOCAL = ["--dtype", "float32", "--no-cuda-graphs", "--no-triton-attention"]


def _spawn_on(gpu: int, args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=_pythonpath(), CUDA_VISIBLE_DEVICES=str(gpu))
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, *args, "--device", ENGINE_DEVICE, "--host", "127.0.0.1",
                                 "--port", "0"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 0.5)[0]:
            line = proc.stdout.readline()
            if "listening on " in line:
                return proc, line.rsplit("listening on ", 1)[1].strip()
    proc.kill()
    raise AssertionError(f"{args} did not start:\n{log.read_text()[-3000:]}")


def _pair(logs: Path, name: str, channel: bool) -> list[tuple[subprocess.Popen, str]]:
    flags = ["--feature-channel", _address()] if channel else []
    tree = ["--num-steps", str(TREE["num_steps"]), "--topk", str(TREE["topk"]),
            "--num-draft-tokens", str(TREE["num_draft_tokens"])]
    common = ["--max-slots", "4", *LIKE_LOCAL, "--max-len", str(MAX_LEN), *flags]
    return [_spawn_on(0, ["-m", "verifier", *common], logs / f"{name}-v.log"),
            _spawn_on(1, ["-m", "drafter", *common, *tree], logs / f"{name}-d.log")]


def test_nccl_channel_between_two_gpus_matches_inline_and_local(tmp_path):
    target, draft = demo_paths("eagle3")
    local = LocalSpeculator(target, draft, SpecConfig(method="eagle3", **TREE), max_slots=4, max_len=MAX_LEN,
                            device=VERIFIER_DEVICE)
    prompts = [local.tokenizer.encode(t).ids for t in PROMPT_TEXTS]
    greedy = [SamplingParams(max_tokens=24) for _ in prompts]
    seeded = [SamplingParams(max_tokens=24, temperature=1.0, seed=100 + i) for i in range(len(prompts))]
    procs = []
    try:
        procs += _pair(tmp_path, "channel", channel=True)
        procs += _pair(tmp_path, "inline", channel=False)

        async def run(addresses, expect_refs: bool):
            v, d = RecordingVerifier(addresses[0], timeout_s=60), GrpcDrafterLink(addresses[1], timeout_s=60)
            try:
                if expect_refs:
                    await _wait_state(v, "up", timeout=120)
                outs = [await speculate(v, d, prompts, ps, local.eos_token_ids, local.lookahead)
                        for ps in (greedy, seeded)]
                kinds = {type(h).__name__ for h in v.handles}
                assert kinds == ({"ChannelRef"} if expect_refs else {"Tensor"}), kinds
                return outs
            finally:
                await v.close()
                await d.close()

        via_channel = asyncio.run(run([procs[0][1], procs[1][1]], expect_refs=True))
        inline = asyncio.run(run([procs[2][1], procs[3][1]], expect_refs=False))
    finally:
        for p, _ in procs:
            p.terminate()
            p.wait(30)
    for got, ref in zip(via_channel, inline):
        _assert_same(got, ref)   # the channel moves the same bytes: the same tokens and drafts
    for got, ps in zip(via_channel, (greedy, seeded)):
        _assert_same(got, local.generate(prompts, ps), same_stats=False)


# ----------------------------------------------------------------------------------------------
# Microbenchmark


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _bench_receiver(address: str, out: str) -> None:
    """The drafter's side (a subprocess): when each round's features are usable."""
    receiver = FeatureReceiver(address, DRAFTER_DEVICE)
    arrived = []
    for seq in range(1, BENCH_ROUNDS + 1):
        x = receiver.take(ChannelRef(seq, 0), timeout_s=60)
        arrived.append(time.perf_counter())   # CLOCK_MONOTONIC: comparable across processes
        assert x.device == torch.device(DRAFTER_DEVICE) and x[0, 0].item() == seq % 200
    Path(out).write_text(json.dumps(arrived))
    receiver.close()


def _channel_handoff(x: torch.Tensor, tmp_path: Path) -> tuple[list[float], list[float]]:
    """-> (send to usable on the drafter's GPU, the verifier thread's cost of send()), seconds per round."""
    address, out = _address(), tmp_path / "arrived.json"
    child = subprocess.Popen([sys.executable, "-c", "import sys; from tests.gpu.test_feature_channel_gpu import "
                              "_bench_receiver as r; r(sys.argv[1], sys.argv[2])", address, str(out)],
                             cwd=ROOT, env=dict(os.environ, PYTHONPATH=_pythonpath()))
    sender = FeatureSender(address, VERIFIER_DEVICE)
    try:
        deadline = time.monotonic() + 120
        while not sender.ready:
            assert time.monotonic() < deadline and sender.state != "broken", sender.state
            time.sleep(0.01)
        sent, cost = [], []
        for seq in range(1, BENCH_ROUNDS + 1):
            x.fill_(seq % 200)
            _sync(VERIFIER_DEVICE)
            time.sleep(0.002)       # one round at a time: the latency, not the throughput
            t0 = time.perf_counter()
            assert sender.send([x]) == [ChannelRef(seq, 0)]
            cost.append(time.perf_counter() - t0)
            sent.append(t0)
        assert child.wait(120) == 0
    finally:
        sender.close()
        if child.poll() is None:
            child.kill()
    arrived = json.loads(out.read_text())
    return [a - s for a, s in zip(arrived, sent)][BENCH_WARMUP:], cost[BENCH_WARMUP:]


def _grpc_handoff(x: torch.Tensor) -> list[float]:
    """The tensor path: encode on the verifier (copy out), the reply to the router, the router's
    Extend to the drafter (one parse and re-encode between; here an echo server does both
    hops), decode and copy to the drafter's GPU."""
    import grpc

    from spectandem import codec
    from spectandem.grpc_server import CHANNEL_OPTIONS
    from spectandem.v1 import common_pb2

    def relay(request: bytes, context) -> bytes:
        return common_pb2.Tensor.FromString(request).SerializeToString()

    server = grpc.server(futures.ThreadPoolExecutor(2), options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "bench.Relay", {"Relay": grpc.unary_unary_rpc_method_handler(relay)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    times = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
            call = channel.unary_unary("/bench.Relay/Relay")
            for seq in range(1, BENCH_ROUNDS + 1):
                x.fill_(seq % 200)
                _sync(VERIFIER_DEVICE)
                t0 = time.perf_counter()
                reply = call(codec.tensor_to_msg(x).SerializeToString(), timeout=10)
                y = codec.tensor_from_msg(common_pb2.Tensor.FromString(reply)).to(DRAFTER_DEVICE)
                _sync(DRAFTER_DEVICE)
                times.append(time.perf_counter() - t0)
                assert y[0, 0].item() == seq % 200
    finally:
        server.stop(0)
    return times[BENCH_WARMUP:]


def _us(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"median {statistics.median(xs) * 1e6:7.1f} us, p90 {xs[int(0.9 * len(xs))] * 1e6:7.1f} us"


def test_feature_handoff_microbenchmark(tmp_path):
    x = torch.zeros(BENCH_SHAPE, dtype=torch.bfloat16, device=VERIFIER_DEVICE)
    kib = x.numel() * x.element_size() / 1024
    channel, send_cost = _channel_handoff(x, tmp_path)
    tensor_path = _grpc_handoff(x)
    print(f"\nfeature handoff per round, bf16 {list(BENCH_SHAPE)} ({kib:.0f} KiB = {BENCH_SHAPE[0]} tokens x "
          f"{kib / BENCH_SHAPE[0]:.0f} KiB), {VERIFIER_DEVICE} -> usable on {DRAFTER_DEVICE}, {len(channel)} rounds:")
    backend = "NCCL" if x.is_cuda else "gloo"
    print(f"  feature channel ({backend}):       {_us(channel)}   (send() on the verifier's thread: {_us(send_cost)})")
    print(f"  gRPC tensor path (2 hops):    {_us(tensor_path)}")
    print(f"  speed-up (medians): {statistics.median(tensor_path) / statistics.median(channel):.1f}x")
    assert len(channel) == len(tensor_path) == BENCH_ROUNDS - BENCH_WARMUP
