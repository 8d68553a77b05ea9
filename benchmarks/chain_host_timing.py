"""Host time of a draft chain graph's call on the 8B-shaped EAGLE-3 head (drafter/graphs.py
ChainGraphs): `propose_caught_up` (a miss's draft: 4 catch-up pairs, then a chain of 4) and
`propose` (a chain from a catch-up already run), from the call to its return (the graph queued,
not waited for), each call on a drained device, one thread; then the call's total with the
device's work. Medians and quartiles of 200 calls, microseconds. `label` names the code in the
printed rows (run it on two trees to compare them).

    PYTHONPATH=. python benchmarks/chain_host_timing.py [label]
"""

from __future__ import annotations

import sys
import time

import torch

from drafter.proposers import DraftRequest, EagleProposer
from benchmarks.bench.llama8b import SHAPES, llama8b_spec, random_eagle3_head, random_target
from spectandem.config import SamplingParams, SpecConfig


def main() -> None:
    dev, dtype = "cuda", torch.bfloat16
    label = sys.argv[1] if len(sys.argv) > 1 else "this"
    model = random_target(llama8b_spec("full"), dev, dtype, 0)
    head = random_eagle3_head(model, SHAPES["full"]["draft_vocab_size"], dev, dtype, 0)
    del model
    cfg = SpecConfig(method="eagle3", num_steps=4, topk=1, num_draft_tokens=5, ahead_width=5)
    prop = EagleProposer(head, cfg, max_slots=2, max_len=640, cuda_graphs=True)
    g = torch.Generator().manual_seed(0)
    V = head.spec.vocab_size
    req = DraftRequest("r", torch.randint(0, V, (320,), generator=g).tolist(), SamplingParams(), 0, False)
    feats = lambda n: torch.randn(n, head.spec.feature_size, generator=g).to(dev, dtype)
    prop.catch_up([req], [req.committed_len - 1], [feats(req.committed_len - 1)])
    chain = prop.chain
    slot = prop.slots.of["r"]
    base0 = prop.cache_len["r"]
    prop.cache.reserve(slot, base0 + 16)
    toks = torch.randint(0, V, (4,), generator=g).tolist()
    f4 = feats(4)
    def caught():
        return chain.propose_caught_up([slot], [base0 + 4], [toks], [f4], 4, 5)
    def started():
        return chain.propose([slot], [base0], prop.last_logits["r"][None], prop.last_hidden["r"][None, None], 4, 5)
    for name, fn in (("caught_up", caught), ("start", started)):
        for _ in range(20):
            fn(); torch.cuda.synchronize()
        host, total = [], []
        for _ in range(200):
            torch.cuda.synchronize()
            t0 = time.perf_counter(); fn(); t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
            host.append(t1 - t0); total.append(t2 - t0)
        q = lambda xs, p: 1e6 * sorted(xs)[int(p * len(xs))]
        print(f"{label:4s} {name:10s} host us p25 {q(host,.25):7.1f} med {q(host,.5):7.1f} p75 {q(host,.75):7.1f}   total us med {q(total,.5):8.1f}")


if __name__ == "__main__":
    main()
