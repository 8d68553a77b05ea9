"""Router logic: once "auto" has settled on plain decoding at a large batch, new requests are
admitted without the drafter (no target features, no drafter prefill: "detached") and decode
plainly; they rejoin the drafter (a resync) once fewer than LARGE_BATCH run, if they may still
generate REJOIN_MIN_TOKENS tokens, and speculate from there. Requests whose drafts are sampled
are never detached: their seeded tokens follow their drafts. Real engines (demo EAGLE-3 pair, CPU, fp32) behind in-process links that record what they
are asked; LARGE_BATCH lowered to 4 and the chooser's verdict forced, so a small batch shows it.
Greedy tokens must equal plain decoding's throughout."""

from __future__ import annotations

import asyncio

import router.loop
from router.links_local import LocalDrafterLink, LocalVerifierLink
from router.pipeline import KEEP_WINDOWS, ModeChooser, _ClassState
from router.requests import RouterConfig
from router.loop import Router
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.link_harness import collect, drained


class Recording(LocalVerifierLink):
    def __init__(self, engine):
        super().__init__(engine)
        self.prefill_features: list[bool] = []
        self.verify_features: list[bool] = []

    async def prefill(self, items, want_features):
        self.prefill_features.append(want_features)
        return await super().prefill(items, want_features)

    async def verify(self, draft, plain, want_features, on_launch=None):
        self.verify_features.append(want_features)
        return await super().verify(draft, plain, want_features, on_launch)


class CountingDrafter(LocalDrafterLink):
    def __init__(self, engine):
        super().__init__(engine)
        self.prefilled: list[str] = []

    async def prefill(self, items):
        self.prefilled += [i.tag.request_id for i in items]
        return await super().prefill(items)


def _served_settled(spec: LocalSpeculator, prompts, params, records: list | None = None):
    """The requests served by a Router over `spec`'s engines with "auto" forced settled on plain
    from 4 running requests on -> (each (tokens, request), the verifier link, the drafter link,
    the router's counters). `records`: each round's measurement for "auto" is appended to it,
    (mode, request-rounds, drafted)."""
    async def main():
        vlink, dlink = Recording(spec.verifier), CountingDrafter(spec.drafter)
        r = Router(vlink, dlink, spec.tokenizer, RouterConfig(
            max_len=256, eos_token_ids=spec.eos_token_ids, lookahead=spec.lookahead, want_features=True,
            pipeline="auto"))
        r._modes.settled_plain = lambda num_running: num_running >= 4   # "auto" settled on plain
        if records is not None:
            record = r._modes.record

            def recorded(mode, tokens, seconds, request_rounds=1, upkeep=0.0, admitted=0, drafted=None, detached=0):
                records.append((mode, request_rounds, drafted))
                record(mode, tokens, seconds, request_rounds, upkeep, admitted, drafted, detached)
            r._modes.record = recorded
        r.start()
        try:
            done = await asyncio.gather(*(collect(r, p, sp) for p, sp in zip(prompts, params)))
            await drained(spec)
            return done, vlink, dlink, r.counters
        finally:
            await r.stop()

    return asyncio.run(main())


def _five_short_one_long(monkeypatch, rejoin_min_tokens: int, short: int, long: int):
    """LARGE_BATCH 4, the demo pair's engines, six prompts: five requests of `short` greedy tokens
    and one of `long`, which runs on alone below LARGE_BATCH -> (the speculating engines, the
    prompts, their params, plain decoding's tokens)."""
    monkeypatch.setattr(router.loop, "LARGE_BATCH", 4)
    monkeypatch.setattr(router.loop, "REJOIN_MIN_TOKENS", rejoin_min_tokens)
    t, d = demo_paths("eagle3")
    spec = LocalSpeculator(t, d, SpecConfig(method="eagle3"), max_slots=8, max_len=256)
    plain = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=8, max_len=256)
    prompts = [spec.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:6]]
    params = [SamplingParams(max_tokens=short, ignore_eos=True)] * 5 + [SamplingParams(max_tokens=long, ignore_eos=True)]
    return spec, prompts, params, [c.token_ids for c in plain.generate(prompts, params)]


def _check_served(spec: LocalSpeculator, done, expected) -> None:
    """Plain decoding's tokens, and nothing left on either engine."""
    assert [toks for toks, _ in done] == expected
    assert not spec.drafter.requests and spec.drafter.proposer.kv_stats()["used_blocks"] == 0
    assert not spec.verifier.requests


def _serve_detached(monkeypatch, rejoin_min_tokens: int):
    spec, prompts, params, expected = _five_short_one_long(monkeypatch, rejoin_min_tokens, 12, 64)
    done, vlink, dlink, c = _served_settled(spec, prompts, params)
    _check_served(spec, done, expected)
    assert c.detached_admissions == 6 and vlink.prefill_features == [False]
    return done, vlink, dlink


def test_detached_requests_decode_plainly_then_rejoin(monkeypatch):
    done, vlink, dlink = _serve_detached(monkeypatch, rejoin_min_tokens=16)
    long_req = done[-1][1]
    # The long request rejoined the drafter once it ran alone (a resync: its first drafter prefill)
    # and speculated from there; the short ones never reached the drafter.
    assert dlink.prefilled == [long_req.request_id]
    assert long_req.draft_tokens > 0 and all(req.draft_tokens == 0 for _, req in done[:5])
    # While every running request was detached, no round asked for features.
    first_drafted = vlink.verify_features.index(True)
    assert first_drafted > 0 and not any(vlink.verify_features[:first_drafted])


def test_a_detached_request_near_its_end_does_not_rejoin(monkeypatch):
    """The long request has fewer than REJOIN_MIN_TOKENS (here 64) tokens left when it runs
    alone: it ends plainly, with no drafter prefill and no features asked for."""
    done, vlink, dlink = _serve_detached(monkeypatch, rejoin_min_tokens=64)
    assert dlink.prefilled == [] and all(req.draft_tokens == 0 for _, req in done)
    assert not any(vlink.verify_features)


def test_settled_plain_needs_a_second_keep_of_plain_at_a_large_batch():
    cfg = RouterConfig(max_len=256, eos_token_ids=(0,), lookahead=5, want_features=True, pipeline="auto")
    chooser = ModeChooser(cfg)
    key = chooser._class(64)
    chooser._states[key] = s = _ClassState(mode="plain", phase="keep", left=10, keep_windows=KEEP_WINDOWS)
    assert not chooser.settled_plain(64)            # the first keep of plain: not yet
    s.keep_windows = 2 * KEEP_WINDOWS
    assert chooser.settled_plain(64)
    assert not chooser.settled_plain(8)             # another (small) batch class
    s.mode = "sequential"
    assert not chooser.settled_plain(64)
    s.mode, s.phase = "plain", "explore"
    assert not chooser.settled_plain(64)
    s.phase, s.left = "keep", 0
    assert not chooser.settled_plain(64)
    other = ModeChooser(RouterConfig(max_len=256, eos_token_ids=(0,), lookahead=5, want_features=True,
                                     pipeline="sequential"))
    other._states[key] = _ClassState(mode="plain", phase="keep", left=10, keep_windows=2 * KEEP_WINDOWS)
    assert not other.settled_plain(64)              # only "auto" detaches


def test_requests_with_sampled_drafts_are_admitted_with_the_drafter(monkeypatch):
    """Where "auto" has settled on plain, a request whose drafts are sampled (temperature 0.9, at
    or over draft_sampling_min_temperature) still joins the drafter and speculates: its seeded
    tokens equal the in-process engines' for the same seed, token for token, as they are when
    nothing is settled. The greedy requests of the same batch are detached and decode plainly.
    Detached, the sampled requests drew other tokens from their seeds (a plain row samples the
    target directly, a speculating one by its drafts)."""
    monkeypatch.setattr(router.loop, "LARGE_BATCH", 4)
    t, d = demo_paths("eagle3")
    spec = LocalSpeculator(t, d, SpecConfig(method="eagle3"), max_slots=8, max_len=256)
    plain = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=8, max_len=256)
    prompts = [spec.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:6]]
    sampled = [SamplingParams(max_tokens=24, temperature=0.9, seed=11 + i, ignore_eos=True) for i in range(3)]
    greedy = [SamplingParams(max_tokens=24, ignore_eos=True)] * 3
    params = [p for pair in zip(sampled, greedy) for p in pair]
    expected = [c.token_ids for c in spec.generate(prompts[0::2], sampled)]
    expected_greedy = [c.token_ids for c in plain.generate(prompts[1::2], greedy)]
    records = []
    done, _, dlink, c = _served_settled(spec, prompts, params, records)
    assert [toks for toks, _ in done[0::2]] == expected
    assert [toks for toks, _ in done[1::2]] == expected_greedy
    assert c.detached_admissions == 3
    ids = {req.request_id for _, req in done[0::2]}
    assert ids <= set(dlink.prefilled) and all(req.draft_tokens > 0 for _, req in done[0::2])
    # "auto" measured what the speculating rounds' trees commit on the sampled requests they
    # drafted for, not on the detached greedy ones beside them.
    speculating = [(n, drafted) for mode, n, drafted in records if mode != "plain"]
    assert speculating and all(drafted is not None and drafted[1] <= 3 for _, drafted in speculating)
    assert any(n > drafted[1] > 0 for n, drafted in speculating)


class ReleaseRecording(CountingDrafter):
    def __init__(self, engine):
        super().__init__(engine)
        self.released: list[list[str]] = []

    async def release(self, request_ids, keep_draft=False, outputs=None):
        self.released.append(list(request_ids))
        return await super().release(request_ids, keep_draft, outputs)


def _served_settling(spec: LocalSpeculator, prompts, params, after_rounds: int, detach_running: bool = True):
    """The requests served by a Router over `spec`'s engines whose "auto" speculates (sequential)
    for `after_rounds` rounds and then keeps plain, settled from 4 running requests on -> (each
    (tokens, request), the verifier link, the drafter link, the router's counters, the ids on the
    drafter when plain was first kept, the ids it held at the end of each later round).
    `detach_running` False: the router's `_detach_running` does nothing (the control)."""
    async def main():
        vlink, dlink = Recording(spec.verifier), ReleaseRecording(spec.drafter)
        r = Router(vlink, dlink, spec.tokenizer, RouterConfig(
            max_len=256, eos_token_ids=spec.eos_token_ids, lookahead=spec.lookahead, want_features=True,
            pipeline="auto"))
        plain = lambda: r.counters.rounds >= after_rounds   # noqa: E731
        r._modes.choose = lambda num_running, up: "plain" if plain() else "sequential"
        r._modes.settled_plain = lambda num_running: plain() and num_running >= 4
        if not detach_running:
            r._detach_running = lambda: None
        held, at_settle = [], []
        record = r._modes.record

        def recorded(mode, *args, **kw):
            if mode == "plain" and not at_settle:
                at_settle.append(set(spec.drafter.requests))
            held.append(set(spec.drafter.requests))
            record(mode, *args, **kw)
        r._modes.record = recorded
        r.start()
        try:
            done = await asyncio.gather(*(collect(r, p, sp) for p, sp in zip(prompts, params)))
            await drained(spec)
            return done, vlink, dlink, r.counters, at_settle, held
        finally:
            await r.stop()

    return asyncio.run(main())


def _serve_settling(monkeypatch, detach_running: bool):
    spec, prompts, params, expected = _five_short_one_long(monkeypatch, 16, 24, 96)
    out = _served_settling(spec, prompts, params, after_rounds=3, detach_running=detach_running)
    _check_served(spec, out[0], expected)
    return out


def test_running_requests_leave_the_drafter_once_plain_is_settled(monkeypatch):
    """Six greedy requests speculate for three rounds; then "auto" keeps plain, settled. The
    running requests leave the drafter at once (released there, no features asked for in the
    rounds that follow), decode plainly, and the long one rejoins once it runs alone and
    speculates again. Tokens equal plain decoding's throughout. The control, without
    `_detach_running`: the drafter holds them through the plain rounds."""
    done, vlink, dlink, c, at_settle, held = _serve_settling(monkeypatch, detach_running=True)
    ids = [req.request_id for _, req in done]
    assert c.detached_running == 6 and c.detached_admissions == 0
    # Held when plain's first round ran; released before the next one (`_settle`), in one call.
    assert at_settle == [set(ids)] and sorted(dlink.released[0]) == sorted(ids)
    first = held.index(set(ids), 3)
    long_req = done[-1][1]
    assert dlink.prefilled.count(long_req.request_id) == 2       # admitted, then rejoined alone
    rejoined = next(k for k, h in enumerate(held) if k > first and h)
    assert rejoined > first + 2 and all(not h for h in held[first + 1:rejoined])
    # Speculating rounds with features, then plain rounds without until the rejoin, then with.
    flags = vlink.verify_features
    first_plain = flags.index(False)
    back = next(k for k in range(first_plain, len(flags)) if flags[k])
    assert first_plain >= 3 and all(flags[:first_plain]) and back - first_plain >= 5 and all(flags[back:])
    assert long_req.draft_tokens > 0

    done0, vlink0, dlink0, c0, at_settle0, held0 = _serve_settling(monkeypatch, detach_running=False)
    ids0 = {req.request_id for _, req in done0}
    assert c0.detached_running == 0 and at_settle0 == [ids0]
    assert held0[held0.index(ids0, 3) + 1] == ids0 and all(vlink0.verify_features)
