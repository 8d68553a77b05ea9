"""What every verifier adapter (in-process link, Ray actor, gRPC servicer) does: translate the
link messages of router/links.py into engine calls and back. No model logic here.

`sender`: the verifier's end of the direct feature channel (spectandem/channel.py), or None.
While it is up, the results carry ChannelRefs in place of feature tensors; otherwise tensors.
A verify whose trees come over the tree channel takes them with `tree_from_channel`."""

from __future__ import annotations

from dataclasses import replace

from spectandem import codec
from spectandem.protocol import (EngineInfo, PlainItem, Tag, TreeRoute, Verdict, VerifierPrefillItem,
                                 VerifierPrefillResult)
from spectandem.after_reply import AfterReply
from spectandem.call_clock import CallClock, timed
from spectandem.channel import FeatureSender, TreeMailbox
from spectandem.channel.trees import rows_held, sendable_prefills, sendable_verdicts, verdicts_to_bytes
from spectandem.messages import DraftTree, concat_trees, root_only_tree
from verifier.engine import NewRequests


def forward_tokens(tree: DraftTree | None, plain: list, items: list[VerifierPrefillItem]) -> int:
    """The tokens of one forward of `tree`'s nodes, `plain` rows and `items`' prompts (what
    spectandem.devices.SmallForwards places by)."""
    return (tree.node_valid.numel() if tree is not None else 0) + len(plain) + sum(len(i.prompt_ids) for i in items)


def _handles(sender: FeatureSender | None, features: list) -> list:
    """Feature handles for the results: ChannelRefs when the channel took them, else the tensors."""
    refs = sender.send(features) if sender is not None else None
    return features if refs is None else refs


def verifier_prefill(engine, items: list[VerifierPrefillItem], want_features: bool,
                     sender: FeatureSender | None = None) -> list[VerifierPrefillResult]:
    outs = engine.prefill(*_new_requests(items).prefill_args())
    return _prefill_results(items, outs, want_features, sender)


def _new_requests(items: list[VerifierPrefillItem]) -> NewRequests:
    return NewRequests([i.tag.request_id for i in items], [i.prompt_ids for i in items], [i.params for i in items],
                       [i.seed for i in items], [i.tag.epoch for i in items], [i.resume for i in items])


def _prefill_results(items: list[VerifierPrefillItem], outs, want_features: bool,
                     sender: FeatureSender | None) -> list[VerifierPrefillResult]:
    features = _handles(sender, [o.features if want_features else None for o in outs])
    return [VerifierPrefillResult(Tag(i.tag.request_id, i.tag.epoch, len(i.prompt_ids) + (0 if i.resume else 1)),
                                  o.first_token_id, f)
            for i, o, f in zip(items, outs, features)]


def tree_from_channel(trees: TreeMailbox | None, round_id: int, wait_s: float, early_after: int = 0,
                      early_tags: list[Tag] = ()) -> tuple[DraftTree | None, list[Tag]]:
    """The trees the drafter posted for `round_id` and their tags; (None, []) where none came
    (TreeMailbox.take): the verify goes on with its other rows. `early_after`, `early_tags`: a
    round no draft call posts, which only the rows of `early_tags`, in their order, of the trees
    the drafter posted early on the verdicts of round `early_after` serve, where those hold every
    one of them, else none (spectandem/channel/trees.py)."""
    if trees is None:
        return None, []
    if early_after and early_tags:
        want = list(early_tags)
        # An empty body: the drafter made none on those verdicts.
        taken = trees.take_early(round_id, wait_s, early_after, want,
                                 lambda body: rows_held(codec.draft_tree_from_bytes(body) if body else None, want))
        return taken if taken is not None else (None, [])
    data = trees.take(round_id, wait_s)
    return codec.draft_tree_from_bytes(data) if data is not None else (None, [])


def verdicts_to_drafter(trees: TreeMailbox | None, verdicts: list[Verdict], bounds: dict[str, int] | None,
                        clock: CallClock | None, after: AfterReply, sender: FeatureSender | None = None,
                        round_id: int = 0, prefills=()) -> tuple[list[Verdict], set[str]]:
    """Sends the verdicts of the requests `bounds` names (those the router drafts next,
    drafter/next_trees.py) to the drafter over the tree channel, where it is up and their
    features went over the feature channel. `sender`: the feature channel's end; the verdicts
    carry where their features lie in its payload ring (FeatureSender.placement), so the drafter
    copies them out without waiting for the messages' headers. `after`: the call's AfterReply
    (spectandem/after_reply.py), where the features' copies into the channel are queued: those
    copies and then the verdicts run now, in this thread, before the reply is encoded. The
    drafter's work on the verdicts is the round's critical path and the reply is not (the
    router's next verify reaches the verifier well before the trees: profile-round-timeline-
    h100.txt). On the after-reply worker they would go only once the reply had: on the 2-core CPU
    they start 0.2 ms after the forward this way against 0.65-0.73 ms there
    (verdicts-first-cpu-2core.txt). `round_id`: the verify's tree round (0: its trees did not
    come over the channel), which the drafter's early trees follow. `prefills`: (item, result) of
    the requests the verify prefilled in its step, whose drafter prefills go along where `bounds`
    names them (spectandem/channel/trees.py). -> (`verdicts`, those that went marked `to_drafter`;
    the ids of the requests whose drafter prefills went, which `with_prefilled` marks). The
    mailbox notes the ids that went for `round_id` (TreeMailbox.verdicts_went), which a verify
    of only the early trees on them checks."""
    if (not bounds or trees is None or not (any(v.tag.request_id in bounds for v in verdicts)
                                            or any(r.tag.request_id in bounds for _, r in prefills))):
        return verdicts, set()
    sent, went = set(), set()

    def send() -> None:
        with timed(clock, "verify.verdicts"):
            going = sendable_prefills(prefills, bounds)
            body = verdicts_to_bytes(verdicts, bounds, sender.placement if sender is not None else None, round_id,
                                     going)
            ids = [v.tag.request_id for v in sendable_verdicts(verdicts, bounds)]
            if body is not None and trees.send_verdicts(body, round_id, ids + [res.tag.request_id for _, res in going]):
                sent.update(res.tag.request_id for _, res in going)
                went.update(ids)

    after.later(send)
    after.run_now()
    return [replace(v, to_drafter=True) if v.tag.request_id in went else v for v in verdicts], sent


def with_prefilled(prefilled: list[VerifierPrefillResult], sent: set[str]) -> list[VerifierPrefillResult]:
    """A verify step's prefill results, those whose drafter prefills went with the verdicts
    (`verdicts_to_drafter`) marked so."""
    return [replace(r, with_verdicts=True) if r.tag.request_id in sent else r for r in prefilled]


def verify_call(engine, tree: DraftTree | None, tags: list[Tag], route: TreeRoute | None, plain: list[PlainItem],
                want_features: bool, items: list[VerifierPrefillItem], prefill_features: bool,
                draft_next: dict[str, int] | None, *, trees: TreeMailbox | None, sender: FeatureSender | None,
                small, clock: CallClock, after: AfterReply, check_held=None,
                ) -> tuple[list[Verdict], list[VerifierPrefillResult]]:
    """A service's verify call (the gRPC servicer's, the Ray actor's), from its decoded request to
    its results: the trees from the tree channel where `route` says they come that way (timed as
    "verify.tree_wait"; the requests of trees that do not come get no verdict), `check_held(ids)`
    where given (raises for a request the engine does not hold, before anything runs), the
    verify with its prefills, placed by its size (`small`: spectandem.devices.SmallForwards),
    the verdicts to the drafter (`verdicts_to_drafter`) and, once the reply is on its way, the
    decode ahead (verifier/engine.py after_call) -> (the verdicts, the prefill results)."""
    tree_round = 0
    if route is not None:
        tree_round = route.round_id
        with timed(clock, "verify.tree_wait"):
            tree, tags = tree_from_channel(trees, route.round_id, route.wait_s, route.early_after, list(route.early_tags))
    if check_held is not None:
        check_held([t.request_id for t in tags] + [p.tag.request_id for p in plain])
    with small.placed(forward_tokens(tree, plain, items)):
        results, prefilled = verifier_verify_prefill(engine, tree, tags, plain, want_features, items,
                                                     prefill_features, sender, clock=clock)
    results, sent = verdicts_to_drafter(trees, results, draft_next, clock, after, sender, tree_round,
                                        list(zip(items, prefilled)))
    after.later(engine.after_call)
    return results, with_prefilled(prefilled, sent)


def verifier_verify(engine, tree: DraftTree | None, tags: list[Tag], plain: list[PlainItem],
                    want_features: bool, sender: FeatureSender | None = None, on_launch=None) -> list[Verdict]:
    """`on_launch`: VerifierEngine.verify's (in-process links)."""
    return verifier_verify_prefill(engine, tree, tags, plain, want_features, [], False, sender, on_launch)[0]


def verifier_verify_prefill(engine, tree: DraftTree | None, tags: list[Tag], plain: list[PlainItem],
                            want_features: bool, items: list[VerifierPrefillItem], prefill_features: bool,
                            sender: FeatureSender | None = None, on_launch=None,
                            clock: CallClock | None = None) -> tuple[list[Verdict], list[VerifierPrefillResult]]:
    """`verifier_verify` with `items` prefilled in the same step where the engine carries them
    (VerifierEngine.verify_with_prefill, decode_with_prefill) -> (the verdicts, the prefill
    results, with features where `prefill_features`). Every tag is checked before anything runs.
    `clock`: the engine's part is timed as "verify.engine", and again as
    "verify.engine.with_prompts" where the call carries new requests' prompts; the features'
    hand-off as "verify.features" (a service's EngineInfo.calls)."""
    with timed(clock, "verify.engine"), timed(clock if items else None, "verify.engine.with_prompts"):
        outs, prefilled = _verify_on_engine(engine, tree, tags, plain, want_features, items, on_launch)
    with timed(clock, "verify.features"):
        results = _prefill_results(items, prefilled, prefill_features, sender) if items else []
        return handed_on(outs, want_features, sender), results


def _verify_on_engine(engine, tree, tags, plain, want_features, items, on_launch):
    for t in tags + [p.tag for p in plain]:
        engine.check_tag(t.request_id, t.epoch, t.committed_len)
    new = _new_requests(items) if items else None
    steps = {p.steps for p in plain}
    if steps - {1}:
        if tree is not None or len(steps) > 1:
            raise ValueError(f"plain steps must be 1 in a verify with drafts, and alike for every plain item; "
                             f"got {sorted(steps)}{' with a tree' if tree is not None else ''}")
        outs, prefilled = engine.decode_with_prefill([p.tag.request_id for p in plain],
                                                     [p.tag.committed_len for p in plain], steps.pop(), new,
                                                     features=want_features,
                                                     again=[p.tag.request_id for p in plain if p.again])
    else:
        # A plain row rides in the tree's verify padded to its width; one within that many tokens
        # of its context's end (a request that runs to it) has no room for the padding and is
        # verified on its own after it.
        room = engine.max_len - (tree.num_nodes - 1 if tree is not None else 0)
        inner = [p for p in plain if p.tag.committed_len <= room]
        edge = [p for p in plain if p.tag.committed_len > room]
        rows = _root_rows(inner)
        merged = tree if rows is None else (rows if tree is None else concat_trees(tree, rows))
        if merged is None:   # nothing to verify: the prefill alone
            outs, prefilled = [], (engine.prefill(*new.prefill_args()) if new is not None else [])
        elif new is None:
            outs, prefilled = (engine.verify(merged) if on_launch is None else engine.verify(merged, on_launch)), []
        else:
            outs, prefilled = engine.verify_with_prefill(merged, new, on_launch)
        if edge:
            outs = outs + engine.verify(_root_rows(edge))
    return outs, prefilled


def _root_rows(plain: list[PlainItem]) -> DraftTree | None:
    """The plain items as one-node rows of a verify (None for none)."""
    if not plain:
        return None
    return root_only_tree([p.tag.request_id for p in plain], [p.tag.committed_len for p in plain],
                          [p.last_token_id for p in plain])


def handed_on(verdicts: list[Verdict], want_features: bool, sender: FeatureSender | None = None) -> list[Verdict]:
    """The engine's verdicts as a link hands them on: their features as the link's handles (the
    tensors in-process, ChannelRefs through the feature channel), or None where not wanted."""
    features = _handles(sender, [v.features if want_features else None for v in verdicts])
    return [replace(v, features=f) for v, f in zip(verdicts, features)]


def verifier_features(engine, tag: Tag):
    engine.check_tag(tag.request_id, tag.epoch, tag.committed_len)
    return engine.features(tag.request_id)


def verifier_info(engine, model_name: str) -> EngineInfo:
    runner = engine.runner
    return EngineInfo(role="verifier", model=model_name, kind=type(runner).__name__,
                      vocab_size=engine.vocab_size, max_len=engine.max_len,
                      max_slots=len(engine.free_slots) + len(engine.requests), used_slots=len(engine.requests),
                      feature_layers=runner.feature_layers, kv=engine.kv_stats(),
                      decode_ahead={"taken": engine.ahead_used, "forgotten": engine.ahead_dropped}
                      if engine.decode_ahead else {})
