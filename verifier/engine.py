"""The verifier engine: prefill, verify a round's trees, commit the accepted paths.

Per request it keeps the KV slot, the committed length and the sampling parameters. For each
request in a verify batch it picks the acceptance rule:
- temperature 0: greedy (`verify_greedy`);
- deterministic drafts, temperature > 0: target-only tree sampling (`verify_tree_sampling`),
  which draws each position's token with the same uniform plain decoding would use;
- sampled drafts with their probabilities: recursive rejection sampling (`verify_rejection`).
Uniforms come from `spectandem.rng`, keyed by (seed, position, stream, index): a result never
depends on what else is in the batch, and the global RNG is never touched.

Decoding ahead (`decode_ahead`, serve --decode-ahead): after a plain multi-step decode, the
adapter that called it (router/local_base.py, verifier/service.py, verifier/actor.py) calls
`after_call`, which queues on the device the next decode of the requests the router expects to
ask for again (PlainItem.again: no request waiting to be admitted, the same mode, the request not
ending), from the tokens just committed, before anyone asks for it. While the router commits and
streams this call's tokens and prepares its next turn, the device decodes the next chunk. A next
decode for those requests (all of them or some) at their committed lengths, with as many steps or
fewer, takes its tokens from there (with new requests to prefill in its first step, they are
prefilled apart); any other call first forgets it: its KV entries lie past the committed ones
(scratch, written over later) and their blocks go back to the pool. The tokens are
those the asked-for decode would compute from the same state: the same requests, or more of them
in the batch, as a wider round would have it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spectandem import rng
from spectandem.block_manager import KVCacheFull
from spectandem.config import SamplingParams
from spectandem.devices import to_device, to_host
from spectandem.messages import DraftTree, PrefillOutput, StaleMessage, root_only_tree
from spectandem.protocol import Tag, Verdict
from spectandem.sampling import greedy, logits_to_probs, sample_from_probs
from spectandem.kernels.accept import greedy_accept
from spectandem.accept import VerifyResult, verify_rejection, verify_tree_sampling


@dataclass
class _Request:
    slot: int
    token_ids: list[int]         # committed tokens (prompt + generated)
    params: SamplingParams
    seed: int
    epoch: int = 0

    @property
    def committed_len(self) -> int:
        return len(self.token_ids)


@dataclass
class NewRequests:
    """What `VerifierEngine.prefill` takes, for a verify or decode that prefills them too."""
    request_ids: list[str]
    prompts: list[list[int]]
    params: list[SamplingParams]
    seeds: list[int]
    epochs: list[int] | None = None
    resume: list[bool] | None = None

    def __post_init__(self):
        self.resume = list(self.resume) if self.resume is not None else [False] * len(self.request_ids)

    def inputs(self) -> list[list[int]]:
        """The tokens whose KV the prefill writes: the prompt; a resumed request's all but the last."""
        return [p[:-1] if r else p for p, r in zip(self.prompts, self.resume)]

    def prefill_args(self) -> tuple:
        return self.request_ids, self.prompts, self.params, self.seeds, self.epochs, self.resume


@dataclass
class _DecodeAhead:
    """A plain decode queued before anyone asked for it (`VerifierEngine.after_call`): the next
    `steps` greedy tokens of each request in `rows` (request id -> (its row, the committed length
    the decode starts from)), on the device."""
    rows: dict[str, tuple[int, int]]
    steps: int
    features: bool
    tokens: torch.Tensor            # [B, steps]
    feats: torch.Tensor | None      # [B, steps, F] where `features`


class VerifierEngine:
    def __init__(self, runner, max_slots: int, vocab_size: int = 0, decode_ahead: bool = False):
        """`decode_ahead`: queue the next plain decode after each one (module docstring); only
        for a runner that chains decode steps on the device (NativeRunner)."""
        self.runner = runner
        self.vocab_size = vocab_size
        self.requests: dict[str, _Request] = {}
        self.free_slots = list(range(max_slots - 1, -1, -1))
        self.decode_ahead = decode_ahead and runner.chains_decode
        self._ahead: _DecodeAhead | None = None
        self._next: tuple[list[str], int, bool] | None = None   # what `after_call` queues
        self.ahead_used = 0       # decodes whose tokens came from a decode ahead
        self.ahead_dropped = 0    # decodes ahead forgotten unused

    @property
    def ahead_wanted(self) -> bool:
        """Whether `after_call` has a decode to queue (the last call was a plain decode)."""
        return self._next is not None

    def after_call(self) -> None:
        """Queues the decode ahead that the last call, a plain decode, asks for: the same steps
        for its requests marked `again` (and those it prefilled), from their committed tokens.
        Adapters call it once that call's results are complete and on their way (it does not
        wait for the device). Nothing is queued where a request ended meanwhile, the context or
        the KV pool has no room, or another call came first."""
        nxt, self._next = self._next, None
        if nxt is None or self._ahead is not None:
            return
        ids, steps, features = nxt
        reqs = [self.requests.get(rid) for rid in ids]
        if not reqs or any(r is None or r.committed_len - 1 + steps > self.max_len for r in reqs):
            return
        try:
            tokens, feats = self.runner.decode_greedy([r.slot for r in reqs], [r.committed_len - 1 for r in reqs],
                                                      [r.token_ids[-1] for r in reqs], steps, features)
        except KVCacheFull:
            for r in reqs:
                self.runner.trim(r.slot, r.committed_len - 1)
            return
        self._ahead = _DecodeAhead({rid: (b, r.committed_len) for b, (rid, r) in enumerate(zip(ids, reqs))},
                                   steps, features, tokens, feats)

    def _take_ahead(self, request_ids: list[str], committed_lens: list[int], steps: int, features: bool):
        """The decode ahead's tokens and features for this decode -> (tokens [B, steps], features
        or None) on the device, or None where it was not this decode. Its other rows' KV goes, and
        so do the entries past `steps` of a decode ahead of more steps (its first steps are this
        decode's: the router cut the chunk at a request's end)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        rows = [ahead.rows.get(rid) for rid in request_ids]
        if (steps > ahead.steps or (features and not ahead.features)
                or any(r is None or r[1] != c for r, c in zip(rows, committed_lens))):
            self._forget(ahead, set())
            self.ahead_dropped += 1
            return None
        self._forget(ahead, set(request_ids))
        self.ahead_used += 1
        tokens, feats = ahead.tokens, ahead.feats if features else None
        if steps < ahead.steps:
            for rid, c in zip(request_ids, committed_lens):
                self.runner.trim(self.requests[rid].slot, c - 1 + steps)
            tokens, feats = tokens[:, :steps], None if feats is None else feats[:, :steps]
        index = [r[0] for r in rows]
        if index != list(range(tokens.shape[0])):   # some of its requests: their rows, in this order
            sel = to_device(index, tokens.device)
            tokens, feats = tokens.index_select(0, sel), None if feats is None else feats.index_select(0, sel)
        return tokens, feats

    def _forget(self, ahead: _DecodeAhead, keep: set[str]) -> None:
        """The KV that the decode ahead reserved past the committed entries goes back to the pool,
        except for the requests in `keep` (whose decode it is)."""
        for rid, (_, committed) in ahead.rows.items():
            req = self.requests.get(rid)
            if rid not in keep and req is not None:
                self.runner.trim(req.slot, committed - 1)

    def _drop_ahead(self) -> None:
        """Before any call but the decode ahead's own: forget it and what was to be queued."""
        self._next = None
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._forget(ahead, set())
            self.ahead_dropped += 1

    @property
    def max_len(self) -> int:
        return self.runner.max_len

    def _sample_one(self, logits: torch.Tensor, req: _Request, position: int) -> int:
        """A sampled request's token at `position` from logits [V]: a keyed draw from the target
        (greedy requests' tokens are read in one batch: `prefill`)."""
        probs = logits_to_probs(logits[None], req.params.temperature, req.params.top_k, req.params.top_p)
        u = torch.tensor([rng.uniform(req.seed, position, rng.STREAM_TARGET)], dtype=torch.float64)
        return int(sample_from_probs(probs, u)[0])

    def prefill(self, request_ids: list[str], prompts: list[list[int]], params: list[SamplingParams],
                seeds: list[int], epochs: list[int] | None = None,
                resume: list[bool] | None = None) -> list[PrefillOutput]:
        """New requests: KV for the prompt, then the first token is sampled. Resumed requests
        (after preemption): `prompts` holds every committed token; KV is rebuilt for all but the
        last (the next round's root) and nothing is sampled."""
        self._drop_ahead()
        new = NewRequests(request_ids, prompts, params, seeds, epochs, resume)
        slots = self._take_slots(new)
        try:
            logits, feats = self.runner.prefill(slots, new.inputs())
        except Exception:
            self._give_back(slots)
            raise
        return self._prefilled(new, slots, logits, feats)

    def _take_slots(self, new: "NewRequests") -> list[int]:
        """Checks the new requests and takes a slot for each."""
        for rid, p, r in zip(new.request_ids, new.prompts, new.resume):
            if rid in self.requests:
                raise ValueError(f"request id {rid!r} is already active")
            if not p:
                raise ValueError(f"request {rid!r}: prompt is empty")
            if len(p) - int(r) >= self.max_len:
                raise ValueError(f"request {rid!r}: prompt has {len(p)} tokens; the context holds {self.max_len}")
        if len(set(new.request_ids)) != len(new.request_ids):
            raise ValueError("a request id appears twice in one prefill")
        if len(new.request_ids) > len(self.free_slots):
            raise RuntimeError(f"verifier has {len(self.free_slots)} free slots, {len(new.request_ids)} requested")
        return [self.free_slots.pop() for _ in new.request_ids]

    def _give_back(self, slots: list[int]) -> None:
        for slot in slots:
            self.runner.release(slot)
            self.free_slots.append(slot)

    def _prefilled(self, new: "NewRequests", slots: list[int], logits: torch.Tensor, feats) -> list[PrefillOutput]:
        """Registers the prefilled requests; samples each new one's first token from logits [P, V]."""
        # The greedy rows' first tokens with one wait for the device (to_host), not one per request.
        argmax = None
        if any(p.greedy and not r for p, r in zip(new.params, new.resume)):
            (picked,) = to_host(greedy(logits))
            argmax = picked.tolist()
        outs = []
        for i, rid in enumerate(new.request_ids):
            req = _Request(slots[i], list(new.prompts[i]), new.params[i], new.seeds[i],
                           new.epochs[i] if new.epochs else 0)
            if new.resume[i]:
                first = req.token_ids[-1]
            else:
                first = argmax[i] if req.params.greedy else self._sample_one(logits[i], req, len(new.prompts[i]))
                req.token_ids.append(first)
            self.requests[rid] = req
            outs.append(PrefillOutput(rid, first, None if feats is None else feats[i]))
        return outs

    def _prefill_with(self, new: "NewRequests", step) -> tuple[object, list[PrefillOutput]]:
        """Runs `step(slots, inputs)` -> (its own result, how many prompts it prefilled (k), logits
        after each [k, V], their features or None), prefills the prompts it left, and registers
        them all -> (the step's result, the prefill outputs)."""
        slots = self._take_slots(new)
        inputs = new.inputs()
        try:
            result, k, logits, feats = step(slots, inputs)
            if k < len(inputs):
                rest_logits, rest_feats = self.runner.prefill(slots[k:], inputs[k:])
                logits = rest_logits if k == 0 else torch.cat([logits, rest_logits])
                if rest_feats is not None:
                    feats = list(rest_feats) if k == 0 else list(feats) + list(rest_feats)
        except Exception:
            self._give_back(slots)
            raise
        return result, self._prefilled(new, slots, logits, feats)

    def verify(self, tree: DraftTree, on_launch=None) -> list[Verdict]:
        """`on_launch()`, if given, is called once the forward is queued on the device, before
        the host waits for it (the router starts the drafter's work then: router/loop.py)."""
        self._drop_ahead()
        reqs, logits, feats = self._launch(tree)
        if on_launch is not None:
            on_launch()
        return self._verdicts(tree, reqs, logits, feats)

    def verify_with_prefill(self, tree: DraftTree, new: "NewRequests",
                            on_launch=None) -> tuple[list[Verdict], list[PrefillOutput]]:
        """`verify` of the tree and `prefill` of the new requests, in one forward where the
        runner carries them (`verify_and_prefill`; the prompts it leaves are prefilled after it)
        -> (the verdicts, the prefill outputs). The tree's requests and the new ones are checked
        before anything runs."""
        self._drop_ahead()
        reqs = self._check_tree(tree)

        def step(slots, inputs):
            logits, feats, k, first, per = self.runner.verify_and_prefill(
                [r.slot for r in reqs], [r.committed_len - 1 for r in reqs], tree.token_ids, tree.parents,
                tree.node_valid, slots, inputs)
            if on_launch is not None:
                on_launch()
            return (logits, feats), k, first, per

        (logits, feats), outs = self._prefill_with(new, step)
        return self._verdicts(tree, reqs, logits, feats), outs

    def _verdicts(self, tree: DraftTree, reqs: list["_Request"], logits, feats) -> list[Verdict]:
        """The verdicts of a launched verify: acceptance, then the commit."""
        result, picked = self._accept(tree, reqs, logits, feats)
        # Per request from whole-batch host lists (one conversion each, not one per request).
        tokens = result.token_lists()
        if feats is not None and picked is None:
            picked = _gather_path(feats, result.accepted_nodes[:, :max(len(t) for t in tokens)])
        self.commit(tree.request_ids, result.accepted_nodes, tokens)
        num_acc, num_drafts = result.num_accepted.tolist(), tree.num_draft_tokens()
        return [Verdict(Tag(rid, req.epoch, req.committed_len), token_ids=toks, num_accepted=k, num_draft_tokens=d,
                        features=None if picked is None else picked[b, : len(toks)])
                for b, (rid, req, toks, k, d) in enumerate(zip(tree.request_ids, reqs, tokens, num_acc, num_drafts))]

    def _launch(self, tree: DraftTree):
        """Checks the tree's tags and queues its forward -> (requests, logits, features)."""
        reqs = self._check_tree(tree)
        slots = [r.slot for r in reqs]
        cache_lens = [r.committed_len - 1 for r in reqs]
        logits, feats = self.runner.verify(slots, cache_lens, tree.token_ids, tree.parents, tree.node_valid)
        return reqs, logits, feats

    def _check_tree(self, tree: DraftTree) -> list["_Request"]:
        """The tree's requests, each checked at its tag and for the room its tree takes."""
        reqs = [self.requests[rid] for rid in tree.request_ids]
        for rid, req, tag in zip(tree.request_ids, reqs, tree.committed_lens):
            if tag != req.committed_len:
                raise StaleMessage(f"draft for {rid!r} was made at committed length {tag}; the verifier "
                                   f"is at {req.committed_len}")
            if req.committed_len - 1 + tree.num_nodes > self.max_len:
                raise ValueError(f"request {rid!r}: a tree of {tree.num_nodes} nodes at committed length "
                                 f"{req.committed_len} exceeds the context of {self.max_len}")
        return reqs

    def decode(self, request_ids: list[str], committed_lens: list[int], steps: int,
               features: bool = True, again: list[str] | None = None) -> list[Verdict]:
        return self.decode_with_prefill(request_ids, committed_lens, steps, None, features, again)[0]

    def decode_with_prefill(self, request_ids: list[str], committed_lens: list[int], steps: int,
                            new: "NewRequests | None", features: bool = True,
                            again: list[str] | None = None) -> tuple[list[Verdict], list[PrefillOutput]]:
        """Plain greedy decoding of `steps` tokens for each request (temperature 0 only), in one
        call: the tokens `steps` plain rounds would commit, with the host never waiting between
        steps where the runner can chain them on the device (`NativeRunner.decode_greedy`).
        committed_lens: the caller's view of each request (as a tree's tags). Features per
        request: [steps, F], those of each step's input (a plain round's, concatenated); with
        `features` False none are captured (a round no drafter catches up on).
        `new`: requests prefilled in the first step where the runner carries them
        (NativeRunner.decode_greedy's `prompts`), else before it -> (the verdicts, the new
        requests' prefill outputs). `again`: the requests whose next decode the caller expects
        to ask for next (PlainItem.again; None: all of them): with `decode_ahead`, `after_call`
        queues it for them, and for the new requests when there are any."""
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        reqs = [self.requests[rid] for rid in request_ids]
        for rid, req, tag in zip(request_ids, reqs, committed_lens):
            if tag != req.committed_len:
                raise StaleMessage(f"decode for {rid!r} was asked at committed length {tag}; the verifier "
                                   f"is at {req.committed_len}")
            if not req.params.greedy:
                raise ValueError(f"request {rid!r}: multi-step decoding is greedy only; its temperature is "
                                 f"{req.params.temperature}")
            if req.committed_len - 1 + steps > self.max_len:
                raise ValueError(f"request {rid!r}: {steps} steps at committed length {req.committed_len} "
                                 f"exceed the context of {self.max_len}")
        if not self.runner.chains_decode:   # a runner without the device chain: one plain verify per step
            outs = self.prefill(*new.prefill_args()) if new is not None else []
            return self._decode_by_rounds(request_ids, steps), outs
        ahead = self._take_ahead(request_ids, committed_lens, steps, features)
        args = ([r.slot for r in reqs], [r.committed_len - 1 for r in reqs], [r.token_ids[-1] for r in reqs], steps,
                features)
        if ahead is not None:   # the new requests, if any, prefilled apart: the decode is queued already
            (tokens, feats), outs = ahead, (self.prefill(*new.prefill_args()) if new is not None else [])
        elif new is None:
            (tokens, feats), outs = self.runner.decode_greedy(*args), []
        else:
            def step(slots, inputs):
                tokens, feats, k, first, per = self.runner.decode_greedy(*args, slots, inputs)
                return (tokens, feats), k, first, per
            (tokens, feats), outs = self._prefill_with(new, step)
        rows = to_host(tokens)[0].tolist()     # the only wait for the device
        for req, toks in zip(reqs, rows):
            req.token_ids.extend(toks)
        wanted = set(request_ids if again is None else again)
        queued = [rid for rid in request_ids if rid in wanted]
        if self.decode_ahead and queued and (new is None or all(p.greedy for p in new.params)):
            self._next = (queued + ([] if new is None else list(new.request_ids)), steps, features)
        per = [None] * len(reqs) if feats is None else feats.unbind(0)   # one call, not one index per request
        return [Verdict(Tag(rid, req.epoch, req.committed_len), token_ids=toks, num_accepted=0,
                        num_draft_tokens=0, features=f)
                for rid, req, toks, f in zip(request_ids, reqs, rows, per)], outs

    def _decode_by_rounds(self, request_ids: list[str], steps: int) -> list[Verdict]:
        rounds = []
        for _ in range(steps):
            reqs = [self.requests[rid] for rid in request_ids]
            rounds.append(self.verify(root_only_tree(request_ids, [r.committed_len for r in reqs],
                                                     [r.token_ids[-1] for r in reqs])))
        outs = []
        for b, rid in enumerate(request_ids):
            per = [r[b] for r in rounds]
            feats = None if per[0].features is None else torch.cat([o.features for o in per])
            outs.append(Verdict(per[-1].tag, token_ids=[t for o in per for t in o.token_ids], num_accepted=0,
                                num_draft_tokens=0, features=feats))
        return outs

    def commit(self, request_ids: list[str], accepted_nodes: torch.Tensor, token_ids: list[list[int]]) -> None:
        """Commits a verified round. accepted_nodes [B, N]: request b's accepted path as tree node
        indices in order, -1 after it; the runner keeps those nodes' KV. token_ids[b]: the tokens
        the round commits for request b (accepted drafts, then the bonus). `verify` ends here, and
        so does the fused graph round (verifier/fused.py), which reaches its verdict on the device."""
        self._drop_ahead()
        reqs = [self.requests[rid] for rid in request_ids]
        self.runner.commit([r.slot for r in reqs], [r.committed_len - 1 for r in reqs], accepted_nodes)
        for req, toks in zip(reqs, token_ids):
            req.token_ids.extend(toks)

    def _accept(self, tree: DraftTree, reqs: list[_Request], logits: torch.Tensor,
                feats: torch.Tensor | None = None) -> tuple[VerifyResult, torch.Tensor | None]:
        """Runs each request's acceptance rule on its rows and merges the results -> (the
        result, the accepted paths' features [B, W, F] where they were gathered on the device
        before the host waited for the verdict, else None)."""
        groups: dict[str, list[int]] = {}
        for b, req in enumerate(reqs):
            rule = "greedy" if req.params.greedy else ("rejection" if tree.sampled[b] else "tree")
            groups.setdefault(rule, []).append(b)
        if set(groups) == {"greedy"}:   # every row in one walk: nothing to merge
            return self._greedy_on_device(logits, list(range(len(reqs))),
                                          (tree.token_ids, tree.parents, tree.node_valid), feats)
        b_all, width = len(reqs), tree.num_nodes
        accepted = torch.full((b_all, width), -1, dtype=torch.long)
        outputs = torch.full((b_all, width), -1, dtype=torch.long)
        num_acc = torch.zeros(b_all, dtype=torch.long)
        bonus = torch.zeros(b_all, dtype=torch.long)
        # Greedy rows are walked on the logits' device (spectandem/kernels/accept.py): only the
        # argmax and the results cross to the host, not the logits; the sampled rules read them.
        lg = logits.float().cpu()
        for rule, idx in groups.items():
            sel = torch.tensor(idx)
            args = (tree.token_ids[sel], tree.parents[sel], tree.node_valid[sel])
            if rule == "greedy":
                res, _ = self._greedy_on_device(logits, idx, args)
            else:
                probs = torch.stack([logits_to_probs(lg[b], reqs[b].params.temperature, reqs[b].params.top_k,
                                                     reqs[b].params.top_p) for b in idx])
                target_u = self._uniforms(reqs, idx, width, rng.STREAM_TARGET)
                if rule == "tree":
                    res = verify_tree_sampling(*args, probs, target_u)
                else:
                    k = width
                    accept_u = torch.stack([self._uniforms(reqs, idx, width, rng.STREAM_ACCEPT, j)
                                            for j in range(k)], dim=-1)
                    res = verify_rejection(*args, probs, tree.draft_probs[sel], accept_u, target_u)
            w = res.accepted_nodes.shape[1]
            accepted[sel, :w] = res.accepted_nodes
            outputs[sel, :w] = res.output_token_ids
            num_acc[sel] = res.num_accepted
            bonus[sel] = res.bonus_token_ids
        return VerifyResult(accepted_nodes=accepted, num_accepted=num_acc, output_token_ids=outputs,
                            bonus_token_ids=bonus), None

    @staticmethod
    def _greedy_on_device(logits: torch.Tensor, idx: list[int], args: tuple,
                          feats: torch.Tensor | None = None) -> tuple[VerifyResult, torch.Tensor | None]:
        """The greedy walk of rows `idx` of logits [B, N, V] on their device; the tree (token_ids,
        parents, node_valid [len(idx), N]) crosses in one copy and the results come back in one.
        With feats [B, N, F] (every row: idx is all of them) the accepted paths' features are
        gathered on the device too, before the host waits: [B, N, F], row b's first
        num_accepted + 1 entries its path's (what `_gather_path` gives after the wait)."""
        dev = logits.device
        rows = logits if idx == list(range(logits.shape[0])) else logits[to_device(idx, dev)]
        tree = to_device(torch.stack([args[0], args[1], args[2].long()]), dev)          # [3, b, N]
        res = greedy_accept(rows.argmax(-1), tree[0], tree[1], tree[2].bool())
        picked = None if feats is None else _gather_path(feats, res.accepted_nodes)
        n = tree.shape[2]
        packed = to_host(torch.cat([res.accepted_nodes, res.output_token_ids, res.num_accepted[:, None],
                                    res.bonus_token_ids[:, None]], dim=1))[0]        # [b, 2N + 2]
        return VerifyResult(accepted_nodes=packed[:, :n], num_accepted=packed[:, 2 * n],
                            output_token_ids=packed[:, n: 2 * n], bonus_token_ids=packed[:, 2 * n + 1]), picked

    @staticmethod
    def _uniforms(reqs, idx, width, stream, index=0) -> torch.Tensor:
        """[len(idx), width] float64: column d is the uniform for the token at committed_len + d."""
        return torch.tensor([[rng.uniform(reqs[b].seed, reqs[b].committed_len + d, stream, index)
                              for d in range(width)] for b in idx], dtype=torch.float64)

    def release(self, request_id: str) -> None:
        """Frees the request's slot and KV. A decode ahead keeps the other requests' rows: the
        next decode of the rest still takes its tokens from there."""
        if self._ahead is not None:
            self._ahead.rows.pop(request_id, None)
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.runner.release(req.slot)
            self.free_slots.append(req.slot)

    def committed_len(self, request_id: str) -> int:
        return self.requests[request_id].committed_len

    def kv_stats(self) -> dict:
        return self.runner.kv_stats()

    def check_tag(self, request_id: str, epoch: int, committed_len: int) -> None:
        """Raises StaleMessage unless the request is at this epoch and committed length."""
        req = self.requests.get(request_id)
        if req is None:
            raise StaleMessage(f"request {request_id!r} is not active on the verifier")
        if (req.epoch, req.committed_len) != (epoch, committed_len):
            raise StaleMessage(f"request {request_id!r} is at epoch {req.epoch}, committed length "
                               f"{req.committed_len}; the message is for {epoch}, {committed_len}")

    def features(self, request_id: str) -> torch.Tensor | None:
        """Target features of every committed position but the last ([committed_len - 1, F]),
        recomputed without touching the request's KV (to rebuild a drafter's state)."""
        req = self.requests[request_id]
        return self.runner.features(req.token_ids[:-1])


def _gather_path(feats: torch.Tensor, accepted_nodes: torch.Tensor) -> torch.Tensor:
    """feats [B, N, F], accepted_nodes [B, W] (node indices, -1 after the path; on any device)
    -> [B, W, F]: row b's entry j is its path's node j's features (node 0's past the path).
    Every request's path crosses to the features' device in one copy and is gathered in one
    launch; request b's features are then a view of its rows (a Ray actor compacts views before
    shipping them: verifier/actor.py)."""
    path = to_device(accepted_nodes.clamp(min=0), feats.device)
    return feats.gather(1, path[..., None].expand(-1, -1, feats.shape[-1]))
