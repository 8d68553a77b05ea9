"""`spectandem bench` on an 8B-shaped target: plain decoding against the memory-bandwidth
roofline, the cost of verifying a tree, and speculation at controlled acceptance rates.

The target has Llama-3.1-8B's shapes (hidden 4096, 32 layers, 32/8 heads, MLP 14336, vocab
128256; bf16 on CUDA) and an EAGLE-3 head of matching shape (draft vocabulary 32000 mapped by
d2t, auxiliary layers (2, 16, 29)), both with random weights made in memory: no download,
nothing written. `--llama8b-scale tiny` makes a small copy of the same structure, so the whole
path runs on a CPU.

The target's weights are random but structured (`random_target`): each layer adds little to the
residual stream, and lm_head maps each token's embedding to a fixed successor token with a wide
logit margin. Its greedy continuation is then the same whether a position is decoded alone or
verified inside a tree in bf16, so the controlled acceptance is exactly the planned one.
Run time does not depend on weight values: the shapes and the kernels are those of the 8B model.
"""

from __future__ import annotations

from drafter.controlled import ControlledProposer, expected_accept_length, plan_drafts
from benchmarks.bench.records import accept_length, record, sync, timed
from spectandem.config import GpuPaths

SHAPES = {  # vocab, hidden, MLP, layers, heads, kv heads, head dim, draft vocab
    "full": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                 num_kv_heads=8, head_dim=128, draft_vocab_size=32000),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_layers=8, num_heads=4,
                 num_kv_heads=2, head_dim=32, draft_vocab_size=256),
}
TREE16_PARENTS = (-1, 0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 5, 5, 6, 8, 11)  # a 16-node tree, 4 children at the root


def llama8b_spec(scale: str = "full"):
    from spectandem.modeling.layers import RopeSpec
    from spectandem.modeling.llama import LlamaSpec

    s = SHAPES[scale]
    return LlamaSpec(architecture="LlamaForCausalLM", vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
                     intermediate_size=s["intermediate_size"], num_layers=s["num_layers"], num_heads=s["num_heads"],
                     num_kv_heads=s["num_kv_heads"], head_dim=s["head_dim"], rms_norm_eps=1e-5,
                     rope=RopeSpec(head_dim=s["head_dim"], theta=500000.0, kind="llama3", factor=8.0,
                                   low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192),
                     max_position_embeddings=131072, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                     mlp_bias=False, qk_norm=False, eos_token_ids=(s["vocab_size"] - 1,))


def random_target(spec, device: str, dtype, seed: int):
    """A LlamaModel with structured random weights (see the module docstring): embeddings
    N(0, 1); q/k/v, gate and up N(0, 0.02); o and down projections so small that each layer
    adds ~0.01 to a residual of RMS ~1; norms 1; lm_head row succ(t) = embedding(t) / sqrt(H),
    succ a random permutation, so the logit of succ(t) after token t is ~sqrt(H) and the others ~N(0, 1)."""
    import torch

    from spectandem.modeling.llama import LlamaModel

    with torch.device("meta"):
        model = LlamaModel(spec).to(dtype)   # allocate once, in the final dtype
    model = model.to_empty(device=device)
    model.model.rotary_emb.inv_freq = spec.rope.inv_freq().to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, 0.01 / p.shape[1] ** 0.5, generator=g)
            elif name != "lm_head.weight":
                p.normal_(0.0, 1.0 if "embed_tokens" in name else 0.02, generator=g)
        succ = torch.randperm(spec.vocab_size, generator=g, device=device)
        model.lm_head.weight[succ] = model.model.embed_tokens.weight / spec.hidden_size ** 0.5
    return model.eval()


def random_eagle3_head(target, draft_vocab_size: int, device: str, dtype, seed: int):
    """An EAGLE-3 head of the target's shape with random weights; embeddings copied from the
    target (as the loader does), d2t mapping the draft vocabulary onto a random sorted subset."""
    import torch

    from drafter.heads import Eagle3Head, HeadSpec
    from spectandem.feature_layers import aux_layers_from_config

    t = target.spec
    spec = HeadSpec(kind="eagle3", hidden_size=t.hidden_size, target_hidden_size=t.hidden_size,
                    intermediate_size=t.intermediate_size, num_heads=t.num_heads, num_kv_heads=t.num_kv_heads,
                    head_dim=t.head_dim, rms_norm_eps=t.rms_norm_eps, rope=t.rope, vocab_size=t.vocab_size,
                    draft_vocab_size=draft_vocab_size, fc_bias=False, qkv_bias=False,
                    aux_layers=aux_layers_from_config({}, t.num_layers))
    with torch.device("meta"):
        head = Eagle3Head(spec).to(dtype)
    head = head.to_empty(device=device)
    head.rotary.inv_freq = spec.rope.inv_freq().to(device)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name != "embed_tokens.weight":
                p.normal_(0.0, 0.02, generator=g)
        head.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        kept = torch.randperm(t.vocab_size, generator=g, device=device)[:draft_vocab_size].sort().values
        head.d2t.copy_(kept - torch.arange(draft_vocab_size, device=device))   # target id = i + d2t[i]
    return head.eval()


ROOFLINE_CHAINS = (4, 16)   # steps per call of the chained plain-decoding rows


def bench_plain_roofline(model, device: str, steps: int, context: int, bandwidth: float,
                         gpu: GpuPaths = GpuPaths(), chain: int = 0) -> dict:
    """Plain decoding at batch 1, `steps` tokens after a `context`-token prefix; the median step
    against (weights + KV bytes) / copy bandwidth. Eager: the model's own forward over a KV cache.
    With `gpu.cuda_graphs`: the verifier runner's one-node verify and commit (what the engine
    runs) on the paths of `gpu` (the bench's fast path adds the Triton paged attention), replayed
    as a CUDA graph, each step's token read on the host before the next starts ("plain-fast").
    With `chain` > 0 as well: `NativeRunner.decode_greedy`, `chain` steps per call fed on the
    device, the host preparing each step while the previous runs (what `VerifierEngine.decode`
    and the router's multi-step plain rounds run); the step is the median call over `chain`
    ("plain-chained")."""
    import torch

    from spectandem.kv_cache import PagedKVCache

    spec = model.spec
    dtype = next(model.parameters()).dtype
    elem = next(model.parameters()).element_size()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cache = PagedKVCache(spec.num_layers, 1, spec.num_kv_heads, context + steps + 1, spec.head_dim, dtype,
                         device, block_size=16)
    slot = torch.zeros(1, dtype=torch.long, device=device)
    cache.reserve(0, context + steps)
    times = []
    if gpu.cuda_graphs:
        times = _graphed_plain_steps(model, device, steps, context, gpu, chain)
    else:
        with torch.no_grad():
            ids = torch.randint(0, spec.vocab_size, (1, context), generator=torch.Generator().manual_seed(0)).to(device)
            pos = torch.arange(context, device=device)[None]
            mask = torch.tril(torch.ones(context, context, dtype=torch.bool, device=device))[None]
            model(ids, pos, cache.batch(slot, pos, context), mask)
            tok = torch.zeros(1, 1, dtype=torch.long, device=device)
            for i in range(steps):
                n = context + i
                p = torch.tensor([[n]], device=device)
                visible = torch.ones(1, 1, n + 1, dtype=torch.bool, device=device)

                def step():
                    h, _ = model(tok, p, cache.batch(slot, p, n + 1), visible)
                    return model.logits(h[:, -1:]).argmax(-1)
                tok, dt = timed(step, (device,))
                times.append(dt)
    step = sorted(times)[len(times) // 2]
    kv_bytes = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * elem * (context + steps // 2)
    floor = (weight_bytes + kv_bytes) / bandwidth if bandwidth else 0.0
    mode = f"plain-chained{chain}" if gpu.cuda_graphs and chain else ("plain-fast" if gpu.cuda_graphs else "plain")
    return record(section="llama8b", workload="llama8b", method="none",
                  mode=mode, batch_size=1, tokens=1,
                  seconds=step, accept_length=1.0, roofline_fraction=round(floor / step, 3) if floor else None,
                  roofline_ms=round(1000 * floor, 3), weight_bytes=weight_bytes, context=context,
                  cuda_graphs=gpu.cuda_graphs, chain=chain if gpu.cuda_graphs and chain else None)


def _graphed_plain_steps(model, device: str, steps: int, context: int, gpu: GpuPaths, chain: int = 0) -> list[float]:
    """Per-step seconds of plain decoding through NativeRunner on `gpu`'s paths (CUDA graphs on).
    chain 0: each step a one-node verify (the graph, argmax inside) and its commit, timed alone.
    chain > 0: `decode_greedy` calls of `chain` steps, each timed from its start until its tokens
    are on the host, over `chain` (after one untimed call: the graph captured)."""
    import torch

    from verifier.runner import NativeRunner

    runner = NativeRunner(model, None, 1, context + steps + 2 * chain + 1, **gpu.runner_kwargs())
    v = model.spec.vocab_size
    logits, _ = runner.prefill([0], [torch.randint(0, v, (context,), generator=torch.Generator().manual_seed(0)).tolist()])
    tok, n, times = int(logits[0].argmax()), context, []
    parents, valid, accepted = torch.tensor([[-1]]), torch.ones(1, 1, dtype=torch.bool), torch.tensor([[0]])

    def step() -> list[int]:
        if chain:
            out, _ = runner.decode_greedy([0], [n], [tok], chain)
            return out[0].tolist()
        out, _ = runner.verify([0], [n], torch.tensor([[tok]]), parents, valid)
        runner.commit([0], [n], accepted)
        return [int(out[0, 0].argmax())]
    if chain:
        tok, n = step()[-1], n + chain
    end = n + steps
    while n < end:
        toks, dt = timed(step, (device,))
        tok, n = toks[-1], n + len(toks)
        times.append(dt / len(toks))
    runner.release(0)
    return times


def verify_forward_times(model, feature_layers, device: str, context: int, chain_nodes: int,
                         repeats: int = 20, gpu: GpuPaths = GpuPaths()) -> dict:
    """Median time of one verify forward (runner.verify: the target over N nodes with tree
    attention, logits of every node) at batch 1 after `context` tokens, for a one-token decode
    step, a chain of `chain_nodes` nodes and a 16-node tree."""
    import torch

    from verifier.runner import NativeRunner

    g = torch.Generator().manual_seed(0)
    v = model.spec.vocab_size
    runner = NativeRunner(model, feature_layers, 1, context + 32, **gpu.runner_kwargs())
    runner.prefill([0], [torch.randint(0, v, (context,), generator=g).tolist()])
    shapes = {"decode": (-1,), "chain": tuple(range(-1, chain_nodes - 1)), "tree16": TREE16_PARENTS}
    out = {}
    for name, parents in shapes.items():
        n = len(parents)
        args = ([0], [context], torch.randint(0, v, (1, n), generator=g), torch.tensor([parents]),
                torch.ones(1, n, dtype=torch.bool))
        for _ in range(3):
            runner.verify(*args)
        times = sorted(timed(lambda: runner.verify(*args), (device,))[1] for _ in range(repeats))
        out[f"{name}_ms"] = round(1000 * times[len(times) // 2], 3)
    runner.release(0)
    sync(device)
    return {"context": context, "chain_nodes": chain_nodes, "tree_nodes": len(TREE16_PARENTS), **out,
            "tree16_over_decode": round(out["tree16_ms"] / out["decode_ms"], 3),
            "chain_over_decode": round(out["chain_ms"] / out["decode_ms"], 3), "target_tree16_over_decode": 1.2,
            "cuda_graphs": gpu.cuda_graphs}



class ControlledRuns:
    """Greedy generation of `num_prompts` random prompts on the engine path: plain (the verifier
    alone) or with an EAGLE-3 chain of `num_steps` drafts at a controlled acceptance rate.

    The target engines live on `device`; the EAGLE-3 head, its proposer (`inner`) and the
    proposer's caches on `drafter_device` (default: `device`), the head copied there when it is
    elsewhere. Target features reach the head's device in `EagleProposer.catch_up`.

    The truth (each prompt's greedy continuation) comes from one plain pass at construction.
    Batch 1 runs the prompts in turn; a larger batch runs them at once, cycled."""

    def __init__(self, model, head, device: str, max_slots: int, num_prompts: int, prompt_len: int,
                 max_tokens: int, num_steps: int, seed: int, gpu: GpuPaths = GpuPaths(),
                 drafter_device: str | None = None):
        import torch

        from spectandem.config import SamplingParams, SpecConfig
        from spectandem.reference import generate
        from verifier.engine import VerifierEngine
        from verifier.runner import NativeRunner

        v = model.spec.vocab_size
        self.max_slots = max(max_slots, num_prompts)      # the truth pass runs every prompt at once
        self.device, self.drafter_device, self.gpu = device, drafter_device or device, gpu
        self.seed, self.vocab_size = seed, v
        self.num_prompts, self.prompt_len, self.max_tokens = num_prompts, prompt_len, max_tokens
        # Draft ahead caches one tree per accept length (0..num_steps): the controlled drafter's
        # best guess for each (drafter/controlled.py).
        self.cfg = SpecConfig(method="eagle3", num_steps=num_steps, topk=1, num_draft_tokens=num_steps + 1,
                              ahead_width=num_steps + 1)
        self.lookahead = self.cfg.max_draft_nodes + 1       # a chain round writes its root and drafts
        # Drafts may reach num_steps past the last token, and trees drafted ahead one round further.
        truth_len = max_tokens + 2 * (num_steps + 1)
        self.max_len = prompt_len + truth_len + self.lookahead
        self.inner = self._proposer(head)
        self.plain = VerifierEngine(NativeRunner(model, None, self.max_slots, self.max_len, **gpu.runner_kwargs()),
                                    self.max_slots, v)
        self.verifier = VerifierEngine(NativeRunner(model, self.inner.feature_layers, self.max_slots, self.max_len,
                                                    **gpu.runner_kwargs()), self.max_slots, v)
        g = torch.Generator().manual_seed(seed)
        self.prompts = [torch.randint(0, v, (prompt_len,), generator=g).tolist() for _ in range(num_prompts)]
        truth_params = SamplingParams(max_tokens=truth_len, ignore_eos=True)
        truth = generate(self.plain, None, self.prompts, [truth_params] * num_prompts)
        self.truths = [p + c.token_ids for p, c in zip(self.prompts, truth)]
        self.params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def with_drafter_device(self, drafter_device: str) -> "ControlledRuns":
        """These runs (the same target engines, prompts and truths) with a proposer of their own
        on `drafter_device`, over a copy of this one's head there: the drafter on its own GPU."""
        import copy

        other = copy.copy(self)
        other.drafter_device = drafter_device
        other.inner = other._proposer(self.inner.head)
        return other

    def placement(self) -> dict:
        """The record fields of where the engines run: placement ("one-device" or
        "drafter-own-gpu"), verifier_device, drafter_device."""
        own = _resolved(self.drafter_device) != _resolved(self.device)
        return dict(placement="drafter-own-gpu" if own else "one-device", verifier_device=self.device,
                    drafter_device=self.drafter_device)

    def _proposer(self, head):
        """An EagleProposer on self.drafter_device over `head`, or over a copy of it there (the
        head of `random_eagle3_head` holds its own embeddings: the copy shares nothing)."""
        import copy

        from drafter.proposers import EagleProposer

        if next(head.parameters()).device != _resolved(self.drafter_device):
            head = copy.deepcopy(head).to(self.drafter_device)
        return EagleProposer(head, self.cfg, self.max_slots, self.max_len, **self.gpu.proposer_kwargs())

    def run(self, batch_size: int, acceptance_rate: float | None, tag: str) -> dict:
        """-> {completions, seconds, matches_truth, diverged}; acceptance_rate None: plain."""
        from drafter.engine import DrafterEngine
        from spectandem.reference import generate

        groups = [[i] for i in range(self.num_prompts)] if batch_size == 1 else [list(range(batch_size))]
        outs, seconds, proposers = [], 0.0, []
        for idx in groups:
            ids = [f"{tag}-{i}" for i in idx]
            prompts = [self.prompts[i % self.num_prompts] for i in idx]
            if acceptance_rate is None:
                verifier, drafter, lookahead = self.plain, None, 1
            else:
                plans = {rid: plan_drafts(self.truths[i % self.num_prompts], self.prompt_len, acceptance_rate,
                                          self.vocab_size, f"{self.seed}:{i}") for rid, i in zip(ids, idx)}
                proposers.append(ControlledProposer(self.inner, plans))
                verifier, drafter, lookahead = self.verifier, DrafterEngine(proposers[-1], self.cfg), self.lookahead
            got, dt = timed(lambda: generate(verifier, drafter, prompts, [self.params] * len(idx), (), lookahead, ids),
                            (self.device, self.drafter_device))
            outs += got
            seconds += dt
        order = [i for grp in groups for i in grp]
        end = self.prompt_len + self.max_tokens
        ok = all(c.token_ids == self.truths[i % self.num_prompts][self.prompt_len: end] for c, i in zip(outs, order))
        return {"completions": outs, "seconds": seconds, "matches_truth": ok,
                "diverged": sum(len(p.diverged) for p in proposers)}


def _resolved(device: str):
    """torch.device(device), "cuda" with the current device's index (as parameters report it)."""
    import torch

    d = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if d.type == "cuda" and d.index is None else d


def bench_controlled(runs: ControlledRuns, rates: list[float], batch_sizes: list[int],
                     verify: dict | None) -> list[dict]:
    """Engine-path plain decoding per batch size, then each controlled acceptance rate per batch
    size, with its speedup over plain at the same batch size and, at batch 1, its fraction of
    the ideal accept_length / (one chain verify forward)."""
    for b in batch_sizes:   # each batch size's graphs captured (and allocator grown) before any timing
        runs.run(b, None, f"warm-plain-b{b}")
        if rates:
            runs.run(b, rates[0], f"warm-spec-b{b}")
    base = dict(section="controlled", workload="llama8b")
    records, plain_tps = [], {}
    for b in batch_sizes:
        res = runs.run(b, None, f"plain-b{b}")
        outs = res["completions"]
        r = record(**base, method="none", mode="engine-plain", batch_size=b, seconds=res["seconds"],
                   tokens=sum(len(o.token_ids) for o in outs), accept_length=1.0, matches_plain=res["matches_truth"])
        plain_tps[b] = r["tokens_per_s"]
        records.append(r)
    m = runs.cfg.num_steps
    for a in rates:
        for b in batch_sizes:
            res = runs.run(b, a, f"a{a}-b{b}")
            outs = res["completions"]
            drafted = sum(o.stats.draft_tokens for o in outs)
            accepted = sum(o.stats.accepted_tokens for o in outs)
            r = record(**base, method="eagle3-controlled", mode="eagle3-chain", batch_size=b, acceptance_rate=a,
                       tokens=sum(len(o.token_ids) for o in outs), seconds=res["seconds"],
                       accept_length=accept_length(outs), expected_accept_length=round(expected_accept_length(a, m), 3),
                       draft_acceptance=round(accepted / drafted, 3) if drafted else None,
                       matches_plain=res["matches_truth"], diverged_requests=res["diverged"])
            r["speedup"] = round(r["tokens_per_s"] / plain_tps[b], 3)
            if b == 1 and verify:
                ideal = r["accept_length"] / (verify["chain_ms"] / 1000)
                r["ideal_tokens_per_s"] = round(ideal, 1)
                r["measured_over_ideal"] = round(r["tokens_per_s"] / ideal, 3)
            records.append(r)
    return records
