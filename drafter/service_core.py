"""What every drafter adapter (in-process link, Ray actor, gRPC servicer) does: translate the
link messages of router/links.py into engine calls and back. No model logic here.

`receiver`: the drafter's end of the direct feature channel (spectandem/channel.py), or None.
Items whose features are a ChannelRef take them from it; when they do not come (late, dropped,
no channel here), the request is reported as one this drafter does not hold, and the router
re-prefills it with features from the verifier's Features call.

`poster`: the drafter's end of the tree channel (spectandem/channel/trees.py), or None: a draft
call with a round to post sends its trees to the verifier there (`drafter_draft_posted`)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from spectandem import codec
from spectandem.call_clock import CallClock, timed
from spectandem.protocol import AheadReply, DrafterPrefillItem, EngineInfo, ExtendItem, Tag, Verdict
from spectandem.channel import ChannelRef, FeatureChannelError, FeatureReceiver, TreePoster
from spectandem.messages import DraftTree, StaleMessage

log = logging.getLogger("spectandem.drafter")


def _take_features(receiver: FeatureReceiver | None, items: list, clock: CallClock | None = None,
                   kind: str = "features") -> tuple[list, list[str]]:
    """(the items with each ChannelRef replaced by its tensor, leaving out those whose features
    did not come; their ids). The items of one call share one deadline; those of one channel
    message are taken together (`FeatureReceiver.take_message`, its parts timed on `clock` as
    "<kind>.wait", ".early_read", ".hand_out"), and come or fail together."""
    by_seq: dict[int, list[int]] = {}
    for k, i in enumerate(items):
        if isinstance(i.features, ChannelRef):
            by_seq.setdefault(i.features.seq, []).append(k)
    if not by_seq:
        return items, []
    deadline = time.monotonic() + (receiver.take_timeout_s if receiver is not None else 0.0)
    got: dict[int, object] = {}
    failed: set[int] = set()
    why = None
    for ks in by_seq.values():
        try:
            if receiver is None:
                raise FeatureChannelError("this drafter has no feature channel")
            got.update(zip(ks, receiver.take_message([items[k].features for k in ks],
                                                     max(0.0, deadline - time.monotonic()), clock, kind)))
        except FeatureChannelError as exc:
            failed.update(ks)
            why = why or exc
    taken = [replace(i, features=got[k]) if k in got else i for k, i in enumerate(items) if k not in failed]
    missing = [items[k].tag.request_id for k in sorted(failed)]
    if missing:
        log.warning("features of %d requests did not come over the channel (%s); resyncing them", len(missing), why)
    return taken, missing


def drafter_prefill(engine, items: list[DrafterPrefillItem], receiver: FeatureReceiver | None = None) -> list[str]:
    """Returns the ids it did not take (their features did not come over the channel)."""
    items, missing = _take_features(receiver, items)
    for rid in missing:  # a re-prefill that did not come: its old state goes, a kept tree stays
        engine.remove(rid, keep_draft=True)
    engine.add_many([(i.tag.request_id, i.prompt_ids, i.first_token_id, i.params, i.seed, i.features, i.tag.epoch)
                     for i in items])
    return missing


def drafter_draft(engine, tags: list[Tag], num_steps: list[int | None] | None = None) -> DraftTree:
    """num_steps: per tag, a depth cap for new trees (None or 0: as configured)."""
    for t in tags:
        engine.check_tag(t.request_id, t.epoch, t.committed_len)
    if num_steps is not None and len(num_steps) != len(tags):
        raise ValueError(f"num_steps has {len(num_steps)} entries for {len(tags)} requests")
    steps = [n or None for n in num_steps] if num_steps else None
    return engine.draft([t.request_id for t in tags], steps)


def drafter_extend_and_draft(engine, tags: list[Tag], num_steps: list[int | None] | None, extend: list[ExtendItem],
                             receiver: FeatureReceiver | None = None, clock: CallClock | None = None,
                             ) -> tuple[DraftTree | None, list[Tag], list[str]]:
    """`extend` first (drafter_extend), then the trees of the tags it did not report unknown:
    (the trees or None when no tag is left, the tags they are for, the unknown ids: those of
    `extend` and the tags' requests this drafter does not hold, as after a restart or a prefill
    with the verdicts that it did not take, drafter/next_trees.py). `clock`: the catch-up is
    timed as "draft.catch_up" (its parts also as "draft.features" and "draft.absorb":
    drafter_extend), the trees as "draft.engine" (a service's EngineInfo.calls)."""
    with timed(clock, "draft.catch_up"):
        unknown = drafter_extend(engine, list(extend), receiver, clock) if extend else []
    unknown = list(unknown) + [t.request_id for t in tags if t.request_id not in engine.requests
                               and t.request_id not in unknown]
    keep = [i for i, t in enumerate(tags) if t.request_id not in unknown]
    known = [tags[i] for i in keep]
    if not known:
        return None, [], unknown
    steps = [num_steps[i] for i in keep] if num_steps else None
    with timed(clock, "draft.engine"):
        return drafter_draft(engine, known, steps), known, unknown


def drafter_draft_posted(engine, tags: list[Tag], num_steps: list[int | None] | None, extend: list[ExtendItem],
                         receiver: FeatureReceiver | None, poster: TreePoster | None, round_id: int,
                         clock: CallClock | None = None, extend_and_draft=None,
                         ) -> tuple[DraftTree | None, list[Tag], list[str], bool]:
    """`drafter_extend_and_draft`, its trees sent to the verifier over the tree channel as round
    `round_id` -> (the trees where they were not sent, else None; the tags they are for; the
    unknown ids; whether the verifier was told). A round with no tree left, and a draft that
    fails (before it raises), send word of that, so the verifier does not wait for them. Where
    the channel is not up nothing is sent: the verifier, without a drafter connected, does not
    wait either, and the caller gets the trees back. `extend_and_draft`: what makes the trees, with
    drafter_extend_and_draft's arguments and result (by default that; drafter/next_trees.py
    NextTrees.extend_and_draft, to take the trees made on the verdicts)."""
    make = extend_and_draft or drafter_extend_and_draft
    try:
        tree, known, unknown = make(engine, tags, num_steps, extend, receiver, clock)
    except BaseException as exc:
        if poster is not None:
            poster.post(round_id, None, f"the draft failed: {type(exc).__name__}: {exc}")
        raise
    if poster is None:
        return tree, known, unknown, False
    if tree is None:
        return None, known, unknown, poster.post(round_id, None, "no request left to draft for")
    with timed(clock, "draft.post"):
        posted = poster.post(round_id, codec.draft_tree_to_bytes(tree, known))
    return (None if posted else tree), known, unknown, posted


def drafter_draft_ahead(engine, tags: list[Tag], extend: list[ExtendItem] = (),
                        receiver: FeatureReceiver | None = None) -> AheadReply:
    """`extend` first (drafter_extend); tags of requests it reports unknown get None (no cache)."""
    unknown = drafter_extend(engine, list(extend), receiver) if extend else []
    known = [t for t in tags if t.request_id not in unknown]
    for t in known:
        engine.check_tag(t.request_id, t.epoch, t.committed_len)
    ids = [t.request_id for t in known]
    hits = engine.draft_ahead(ids)
    trees = engine.outcome_trees(ids)
    got = {rid: (h, tr) for rid, h, tr in zip(ids, hits, trees)}
    per = [got.get(t.request_id, (None, None)) for t in tags]
    return AheadReply([h for h, _ in per], [tr for _, tr in per], unknown)


def drafter_release(engine, request_ids: list[str], keep_draft: bool = False,
                    outputs: dict[str, list[int]] | None = None) -> int:
    """Frees the requests (idempotent); returns how many were known. `outputs` (benchmark mode):
    the committed tokens of greedy requests that ended, held or not, for the proposer to learn
    (`Proposer.learn_output`)."""
    for token_ids in (outputs or {}).values():
        engine.proposer.learn_output(list(token_ids))
    known = sum(r in engine.requests for r in request_ids)
    for r in request_ids:
        engine.remove(r, keep_draft=keep_draft)
    return known


def drafter_extend(engine, items: list[ExtendItem], receiver: FeatureReceiver | None = None,
                   clock: CallClock | None = None, call: str = "draft") -> list[str]:
    """Catch-up; returns the ids this drafter does not hold (it restarted, or the round's
    features did not come over the channel: re-prefill them). `clock`: taking the features is
    timed as "<call>.features", the engine's catch-up (where it runs now rather than inside the
    next draft) as "<call>.absorb"."""
    unknown = [i.tag.request_id for i in items if i.tag.request_id not in engine.requests]
    known = [i for i in items if i.tag.request_id in engine.requests]
    follows: dict[str, int] = {}   # a request may come with several rounds, in order (router backlog)
    for i in known:
        rid, start = i.tag.request_id, i.tag.committed_len - len(i.token_ids)
        if rid in follows and start != follows[rid]:
            raise StaleMessage(f"{rid!r}: extend items out of order (one starts at {start}, the previous "
                               f"ended at {follows[rid]})")
        if rid not in follows:
            engine.check_tag(rid, i.tag.epoch, start)
        follows[rid] = i.tag.committed_len
    with timed(clock, f"{call}.features"):
        known, missing = _take_features(receiver, known, clock, f"{call}.features")
    for rid in missing:  # forgotten, so that "unknown" is true and the re-prefill starts clean
        engine.remove(rid)
    if missing:   # with the request's other rounds of this call, those whose features did come
        known = [i for i in known if i.tag.request_id not in missing]
        unknown += list(dict.fromkeys(missing))
    with timed(clock, f"{call}.absorb"):
        engine.extend([Verdict(i.tag, list(i.token_ids), num_accepted=len(i.token_ids) - 1, num_draft_tokens=0,
                               features=i.features) for i in known])
    return unknown


def drafter_info(engine, model_name: str) -> EngineInfo:
    cfg = engine.cfg
    return EngineInfo(role="drafter", model=model_name, kind=cfg.method, vocab_size=0, max_len=0,
                      max_slots=0, used_slots=len(engine.requests), feature_layers=engine.feature_layers,
                      kv=engine.proposer.kv_stats())
