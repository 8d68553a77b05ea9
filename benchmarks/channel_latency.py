"""How long one message of the feature channel (spectandem/channel/) takes from the verifier's
`send` to the drafter's `take`: the sender in this process, the receiver in a child process (as
between two engine processes of one node), one message at a time, `--gap-ms` apart (longer than
a message takes, so none waits behind another). The child inherits this process's environment:
give OMP_NUM_THREADS, GOMP_SPINCOUNT or OMP_WAIT_POLICY to see what the engines' OpenMP teams
do to it.

    python benchmarks/channel_latency.py --device cpu --rows 4 --width 12288 --dtype bfloat16 --gap-ms 20

Prints the medians and 90th percentiles, in milliseconds, of `send` (the copy into the ring slot
and the queueing) and of send to take (the monotonic clock is the system's, so the two processes
share it).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from spectandem.channel import FeatureReceiver, FeatureSender  # noqa: E402


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _receive(address: str, device: str, messages: int) -> None:
    """The drafter's end, in a process of its own: takes messages 1..`messages` and prints, per
    message, the monotonic time its `take` returned."""
    from spectandem.channel import ChannelRef

    receiver = FeatureReceiver(address, device, capacity=64, take_timeout_s=30.0)
    times = []
    for seq in range(1, messages + 1):
        receiver.take(ChannelRef(seq, 0))
        times.append(time.monotonic())
    receiver.close()
    print(" ".join(f"{t:.9f}" for t in times), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=4, help="rows of the one item (a request's accepted path)")
    p.add_argument("--width", type=int, default=12288, help="features per row (three 4,096-wide layers)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--messages", type=int, default=300)
    p.add_argument("--gap-ms", type=float, default=2.0, help="pause between messages")
    p.add_argument("--receive", metavar="ADDRESS", help=argparse.SUPPRESS)   # the child process
    args = p.parse_args(argv)
    if args.receive:
        _receive(args.receive, args.device, args.messages)
        return 0

    import subprocess

    address = _address()
    child = subprocess.Popen([sys.executable, __file__, "--receive", address, "--device", args.device,
                              "--messages", str(args.messages)], stdout=subprocess.PIPE, text=True)
    sender = FeatureSender(address, args.device, send_timeout_s=5.0)
    deadline = time.monotonic() + 120
    while not sender.ready:
        if time.monotonic() > deadline or child.poll() is not None:
            raise SystemExit("the channel did not come up")
        time.sleep(0.01)
    item = torch.randn(args.rows, args.width).to(getattr(torch, args.dtype)).to(args.device)
    sent, calls = [], []
    for _ in range(args.messages):
        t0 = time.monotonic()
        sender.send([item])
        calls.append(time.monotonic() - t0)
        sent.append(t0)
        time.sleep(args.gap_ms / 1000)
    taken = [float(t) for t in child.communicate(timeout=120)[0].split()]   # the same clock, system-wide
    transport = sender._group.transport
    sender.close()
    total = [(b - a) * 1e3 for a, b in zip(sent, taken)][10:]
    send_ms = [c * 1e3 for c in calls][10:]
    print(f"feature channel, {args.device} ({transport}), one [{args.rows}, {args.width}] {args.dtype} item a "
          f"message, the receiver in another process, {len(total)} messages timed")
    for key, values in (("send", send_ms), ("send to take", total)):
        values = sorted(values)
        print(f"  {key:<14} p50 {statistics.median(values):7.3f} ms   p90 {values[int(0.9 * len(values))]:7.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
