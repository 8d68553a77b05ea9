"""Draft-head catch-up, tree proposals and the drafter engine, on the real demo target and heads
(fp32, CPU).

Catch-up writes K/V for every new (feature p, token p + 1) pair but runs the rest of the layer
only for each request's last pair. These tests hold it to the full computation, to each
request run alone, and to one catch-up over all pairs; tree proposals are held to a plain
sequential run of the head along each node's path.
"""

import copy

import pytest
import torch

from drafter.engine import DrafterEngine, DraftProbStore
from drafter.loader import load_head
from drafter.proposers import DraftModelProposer, DraftRequest, EagleProposer, NgramProposer
from spectandem.config import SamplingParams, SpecConfig
from spectandem.kv_cache import KVCache
from spectandem.messages import StaleMessage, VerifyOutput
from spectandem.modeling.llama import load_llama

MODELS = "models/demo"
MAX_LEN = 96
ATOL = 1e-5
# Against a computation of another shape (the full causal pass of `_manual_catch_up`), fp32
# reductions run in another order: allow a few more ulps.
LOOSE = dict(atol=5e-5, rtol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    return load_llama(f"{MODELS}/target", torch.float32)


@pytest.fixture(scope="module", params=["eagle3", "eagle"])
def head(request, target):
    return load_head(f"{MODELS}/{request.param}", target, kind=request.param, dtype=torch.float32)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tokens(n: int, seed: int, vocab: int = 4096) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=_gen(seed)).tolist()


def _features(head, n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, head.spec.feature_size, generator=_gen(seed))


@torch.no_grad()
def target_features(target, head, token_ids: list[int]) -> torch.Tensor:
    """What the verifier sends: the target's features at each position, [T, F]."""
    t = len(token_ids)
    cache = KVCache(target.spec.num_layers, 1, target.spec.num_kv_heads, MAX_LEN, target.spec.head_dim,
                    torch.float32)
    pos = torch.arange(t)[None]
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None]
    capture = head.spec.aux_layers if head.spec.kind == "eagle3" else ()
    hidden, aux = target(torch.tensor([token_ids]), pos, cache.batch(torch.tensor([0]), pos, t), mask, capture)
    return (aux if head.spec.kind == "eagle3" else hidden)[0]


def _request(rid: str, tokens: list[int], temperature: float = 0.0, seed: int = 0) -> DraftRequest:
    return DraftRequest(rid, list(tokens), SamplingParams(temperature=temperature), seed, temperature >= 0.5)


def _cfg(head, **kw) -> SpecConfig:
    return SpecConfig(method=head.spec.kind, **kw)


def _entries(proposer, rid: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The committed K/V entries of a request in a proposer's (one-layer) cache."""
    slot, n = proposer.slots.of[rid], proposer.cache_len[rid]
    rows = proposer.cache.rows(torch.tensor([slot]), torch.arange(n)[None])[0]     # paged: logical -> row
    return proposer.cache.k[0][rows].transpose(0, 1), proposer.cache.v[0][rows].transpose(0, 1)


# ---------------------------------------------------------------- DraftHead.run: reduced == full

@torch.no_grad()
def test_reduced_query_rows_equal_full(head) -> None:
    s = head.spec
    b, base, num_new = 3, torch.tensor([0, 4, 9]), torch.tensor([6, 2, 5])
    t = int(num_new.max())
    toks = torch.randint(0, s.vocab_size, (b, t), generator=_gen(1))
    hidden = head.project(torch.randn(b, t, s.feature_size, generator=_gen(2)))
    caches = [KVCache(1, 4, s.num_kv_heads, 32, s.head_dim, torch.float32) for _ in range(2)]
    prefix = torch.randn(caches[0].k[0].shape, generator=_gen(3))      # earlier entries (and garbage)
    for c in caches:
        c.k[0].copy_(prefix)
        c.v[0].copy_(-prefix)
    slots = torch.tensor([2, 0, 3])
    ar = torch.arange(t)
    positions = base[:, None] + ar                                       # [B, T]
    live = ar[None] < num_new[:, None]                                   # [B, T]
    write = torch.where(live, positions, caches[0].trash_index)
    end = base + num_new
    span = int(end.max())
    cols = torch.arange(span)

    last = (num_new - 1)[:, None]                                        # [B, 1]
    reduced_mask = (cols[None, None] < end[:, None, None])               # [B, 1, span]
    reduced = head.run(toks, hidden, positions, caches[0].batch(slots, write, span), reduced_mask, last)

    every = ar.expand(b, t)                                              # [B, T]
    full_mask = (cols[None, None] <= positions[..., None]) & (cols[None, None] < end[:, None, None])
    full = head.run(toks, hidden, positions, caches[1].batch(slots, write, span), full_mask, every)

    assert reduced.shape == (b, 1, s.hidden_size)
    assert full.shape == (b, t, s.hidden_size)
    assert head.logits(reduced).shape == (b, 1, s.draft_vocab_size)
    torch.testing.assert_close(reduced[:, 0], full[torch.arange(b), num_new - 1], atol=ATOL, rtol=0)
    torch.testing.assert_close(head.logits(reduced)[:, 0], head.logits(full)[torch.arange(b), num_new - 1],
                               atol=ATOL, rtol=0)
    real = slice(0, caches[0].max_len)                                   # all but the trash row
    assert torch.equal(caches[0].k[0][:, :, real], caches[1].k[0][:, :, real])
    assert torch.equal(caches[0].v[0][:, :, real], caches[1].v[0][:, :, real])
    # exactly the new entries were written, each request in its own slot
    changed = (caches[0].k[0][:, :, real] != prefix[:, :, real]).any(-1).any(1)    # [slots, max_len]
    expected = torch.zeros_like(changed)
    for i in range(b):
        expected[slots[i], base[i]: end[i]] = True
    assert torch.equal(changed, expected)


# ---------------------------------------------------------------- EagleProposer.catch_up

@torch.no_grad()
def _manual_catch_up(head, tokens: list[int], feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented convention, computed in full: pair (feature p, token p + 1) at position p,
    causal attention, output of the last pair. -> (hidden [H], logits [Vd])."""
    n = len(tokens) - 1
    s = head.spec
    cache = KVCache(1, 1, s.num_kv_heads, MAX_LEN, s.head_dim, torch.float32)
    pos = torch.arange(n)[None]
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
    out = head.run(torch.tensor([tokens[1:]]), head.project(feats[None]), pos,
                   cache.batch(torch.tensor([0]), pos, n), mask, pos)
    return out[0, -1], head.logits(out[0, -1])


def test_ragged_batch_equals_each_alone(head) -> None:
    cfg = _cfg(head)
    lens = [9, 4, 13]                       # committed lengths after the prefill
    more = [3, 1, 5]                        # pairs absorbed by the extend
    toks = [_tokens(n + m, seed=10 + i) for i, (n, m) in enumerate(zip(lens, more))]
    feats = [_features(head, n + m - 1, seed=20 + i) for i, (n, m) in enumerate(zip(lens, more))]

    batched = EagleProposer(head, cfg, max_slots=4, max_len=MAX_LEN)
    reqs = [_request(f"r{i}", toks[i][: lens[i]]) for i in range(3)]
    batched.catch_up(reqs, [n - 1 for n in lens], [f[: n - 1] for f, n in zip(feats, lens)])
    for i, r in enumerate(reqs):
        assert batched.cache_len[r.request_id] == r.committed_len - 1
        hidden, logits = _manual_catch_up(head, toks[i][: lens[i]], feats[i][: lens[i] - 1])
        torch.testing.assert_close(batched.last_hidden[r.request_id], hidden, **LOOSE)
        torch.testing.assert_close(batched.last_logits[r.request_id], logits, **LOOSE)
    for i, r in enumerate(reqs):
        r.token_ids.extend(toks[i][lens[i]:])
    batched.catch_up(reqs, more, [f[n - 1:] for f, n in zip(feats, lens)])

    for i, r in enumerate(reqs):
        alone = EagleProposer(head, cfg, max_slots=1, max_len=MAX_LEN)
        solo = _request("solo", toks[i])
        alone.catch_up([solo], [len(toks[i]) - 1], [feats[i]])
        rid = r.request_id
        assert batched.cache_len[rid] == r.committed_len - 1 == alone.cache_len["solo"]
        assert batched.last_hidden[rid].shape == (head.spec.hidden_size,)
        assert batched.last_logits[rid].shape == (head.spec.draft_vocab_size,)
        torch.testing.assert_close(batched.last_hidden[rid], alone.last_hidden["solo"], atol=ATOL, rtol=0)
        torch.testing.assert_close(batched.last_logits[rid], alone.last_logits["solo"], atol=ATOL, rtol=0)
        for mine, theirs in zip(_entries(batched, rid), _entries(alone, "solo")):
            torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=0)
        hidden, logits = _manual_catch_up(head, toks[i], feats[i])
        torch.testing.assert_close(batched.last_logits[rid], logits, **LOOSE)


def test_prefill_then_extend_equals_one_catch_up(head) -> None:
    cfg = _cfg(head)
    toks = _tokens(20, seed=30)
    feats = _features(head, 19, seed=31)
    steps = EagleProposer(head, cfg, max_slots=2, max_len=MAX_LEN)
    req = _request("a", toks[:8])
    steps.catch_up([req], [7], [feats[:7]])
    for end in (11, 12, 20):                     # extends of 3, 1 and 8 pairs
        new = end - req.committed_len
        req.token_ids.extend(toks[req.committed_len: end])
        steps.catch_up([req], [new], [feats[end - 1 - new: end - 1]])
        assert steps.cache_len["a"] == req.committed_len - 1 == end - 1
    once = EagleProposer(head, cfg, max_slots=2, max_len=MAX_LEN)
    once.catch_up([_request("a", toks)], [19], [feats])
    torch.testing.assert_close(steps.last_logits["a"], once.last_logits["a"], atol=ATOL, rtol=0)
    torch.testing.assert_close(steps.last_hidden["a"], once.last_hidden["a"], atol=ATOL, rtol=0)
    for mine, theirs in zip(_entries(steps, "a"), _entries(once, "a")):
        torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=0)


def test_catch_up_rejects_pairs_that_do_not_follow(head) -> None:
    p = EagleProposer(head, _cfg(head), max_slots=1, max_len=MAX_LEN)
    req = _request("a", _tokens(6, seed=40))
    with pytest.raises(AssertionError):
        p.catch_up([req], [4], [_features(head, 4, seed=41)])      # 5 pairs are new, not 4


# ---------------------------------------------------------------- EagleProposer.propose

def _draft_index(head) -> dict[int, int]:
    """target id -> draft id."""
    ids = head.draft_to_target(torch.arange(head.spec.draft_vocab_size))
    return {int(t): d for d, t in enumerate(ids.tolist())}


@torch.no_grad()
def _path_logits(proposer, rid: str, path: tuple[int, ...]) -> torch.Tensor:
    """Draft logits after the path (target ids), by running the head one node at a time on a
    copy of the cache: node of depth d at position base + d - 1, seeing the committed entries
    and its own ancestors only, fed the previous output hidden."""
    head = proposer.head
    if not path:
        return proposer.last_logits[rid]
    cache = copy.deepcopy(proposer.cache)
    slot, base = torch.tensor([proposer.slots.of[rid]]), proposer.cache_len[rid]
    h = proposer.last_hidden[rid][None, None]
    for d, tok in enumerate(path):
        pos = torch.tensor([[base + d]])
        mask = torch.ones(1, 1, base + d + 1, dtype=torch.bool)
        h = head.run(torch.tensor([[tok]]), h, pos, cache.batch(slot, pos, base + d + 1), mask,
                     torch.zeros(1, 1, dtype=torch.long))
    return head.logits(h)[0, 0]


def _beam(proposer, rid, k, num_steps, to_draft) -> list[tuple[float, tuple[int, ...]]]:
    """The k + (S-1)k^2 candidates (summed log-prob, path of target ids)."""
    to_target = proposer.head.draft_to_target

    def children(path, score):
        lp = torch.log_softmax(_path_logits(proposer, rid, path).double(), -1)
        vals, ids = lp.topk(k)
        return [(score + float(v), path + (int(to_target(i)),)) for v, i in zip(vals, ids)]

    cands = children((), 0.0)
    live = cands
    for _ in range(1, num_steps):
        step = [c for score, path in live for c in children(path, score)]
        cands = cands + step
        live = sorted(step, key=lambda c: -c[0])[:k]
    return cands


def test_propose_matches_sequential_head_runs(head, target) -> None:
    k, num_steps, n = 2, 3, 6
    cfg = _cfg(head, num_steps=num_steps, topk=k, num_draft_tokens=n)
    proposer = EagleProposer(head, cfg, max_slots=4, max_len=MAX_LEN)
    prompts = [_tokens(12, seed=50), _tokens(5, seed=51), _tokens(17, seed=52)]   # ragged bases
    reqs = []
    for i, p in enumerate(prompts):
        req = _request(f"r{i}", p)
        reqs.append(req)
        proposer.catch_up([req], [len(p) - 1], [target_features(target, head, p)[:-1]])
    before = [e.clone() for r in reqs for e in _entries(proposer, r.request_id)]
    tree = proposer.propose(reqs)
    after = [e for r in reqs for e in _entries(proposer, r.request_id)]
    assert all(torch.equal(x, y) for x, y in zip(before, after)), "drafting overwrote committed entries"
    assert tree.token_ids.shape == (3, n - 1)
    to_draft = _draft_index(head)
    for i, r in enumerate(reqs):
        paths = [()]
        for j, (t, par) in enumerate(zip(tree.token_ids[i].tolist(), tree.parents[i].tolist())):
            assert 0 <= par <= j
            paths.append(paths[par] + (t,))
        nodes = paths[1:]
        for j, path in enumerate(nodes):
            score = sum(float(torch.log_softmax(_path_logits(proposer, r.request_id, path[:d]).double(), -1)
                              [to_draft[path[d]]]) for d in range(len(path)))
            assert abs(float(tree.scores[i, j]) - score) < 1e-4, (r.request_id, path)
        best = sorted(_beam(proposer, r.request_id, k, num_steps, to_draft), key=lambda c: -c[0])[: n - 1]
        assert set(nodes) == {p for _, p in best}
        alone = proposer.propose([r])
        assert torch.equal(alone.token_ids[0], tree.token_ids[i])
        assert torch.equal(alone.parents[0], tree.parents[i])
        torch.testing.assert_close(alone.scores[0], tree.scores[i], atol=ATOL, rtol=0)


# ---------------------------------------------------------------- DrafterEngine

def _verify_output(rid, committed_len, tokens, feats) -> VerifyOutput:
    return VerifyOutput(request_id=rid, committed_len=committed_len, token_ids=tokens,
                        num_accepted=len(tokens) - 1, num_draft_tokens=4, features=feats)


def _engine(head, **kw) -> DrafterEngine:
    cfg = _cfg(head, num_steps=3, topk=2, num_draft_tokens=6, **kw)
    return DrafterEngine(EagleProposer(head, cfg, max_slots=4, max_len=MAX_LEN), cfg)


def test_engine_add_extend_and_stale(head) -> None:
    engine = _engine(head)
    prompt = _tokens(10, seed=60)
    engine.add("a", prompt, 77, SamplingParams(), seed=1, features=_features(head, 10, seed=61))
    engine.add("b", prompt[:6], 78, SamplingParams(), seed=2, features=_features(head, 6, seed=62))
    prop = engine.proposer
    assert engine.requests["a"].committed_len == 11 and prop.cache_len["a"] == 10
    assert engine.requests["b"].committed_len == 7 and prop.cache_len["b"] == 6

    tree = engine.draft(["a", "b"])
    assert tree.committed_lens == [11, 7]
    assert tree.token_ids[:, 0].tolist() == [77, 78]
    assert tree.node_valid.all() and tree.draft_probs is None

    engine.extend([_verify_output("a", 14, [5, 6, 7], _features(head, 3, seed=63)),
                   _verify_output("b", 8, [9], _features(head, 1, seed=64))])
    assert engine.requests["a"].token_ids[-4:] == [77, 5, 6, 7]
    for rid in ("a", "b"):
        assert prop.cache_len[rid] == engine.requests[rid].committed_len - 1
    state = {rid: (engine.requests[rid].committed_len, prop.cache_len[rid], prop.last_logits[rid].clone())
             for rid in ("a", "b")}

    with pytest.raises(StaleMessage):           # "a" is at 14: 3 more tokens make 17, not 18
        engine.extend([_verify_output("a", 18, [1, 2, 3], _features(head, 3, seed=65))])
    with pytest.raises(StaleMessage):           # a repeated (old) verdict
        engine.extend([_verify_output("a", 14, [5, 6, 7], _features(head, 3, seed=63))])
    # a stale verdict in a batch leaves every request of the batch as it was
    with pytest.raises(StaleMessage):
        engine.extend([_verify_output("b", 9, [4], _features(head, 1, seed=66)),
                       _verify_output("a", 99, [1], _features(head, 1, seed=67))])
    for rid, (committed, cached, logits) in state.items():
        assert engine.requests[rid].committed_len == committed
        assert prop.cache_len[rid] == cached
        assert torch.equal(prop.last_logits[rid], logits)
    # and the valid verdict still goes through afterwards
    engine.extend([_verify_output("b", 9, [4], _features(head, 1, seed=66))])
    assert engine.requests["b"].committed_len == 9 and prop.cache_len["b"] == 8

    engine.remove("a")
    assert "a" not in engine.requests and "a" not in prop.cache_len and "a" not in prop.slots.of


def test_engine_sampled_draft_probs_are_tagged(head) -> None:
    engine = _engine(head)
    params = SamplingParams(temperature=1.0, seed=3)
    engine.add("s", _tokens(8, seed=70), 12, params, seed=3, features=_features(head, 8, seed=71))
    tree = engine.draft(["s"])
    assert tree.sampled == [True]
    assert tree.draft_probs is not None and tree.draft_probs.shape[-1] == head.spec.vocab_size
    inner = tree.draft_probs[0].sum(-1)
    assert torch.allclose(inner[0], torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(StaleMessage):
        engine.store.take("s", 8)
    rows = engine.store.take("s", 9)            # a stale take must not consume the round's rows
    torch.testing.assert_close(rows, tree.draft_probs[0, : rows.shape[0]], atol=0, rtol=0)
    assert len(engine.store) == 0


def test_draft_prob_store() -> None:
    store = DraftProbStore()
    probs = torch.full((3, 5), 0.2, dtype=torch.float64)
    store.put("x", 10, probs)
    with pytest.raises(StaleMessage, match="10"):
        store.take("x", 11)
    assert len(store) == 1
    assert store.take("x", 10) is probs
    assert len(store) == 0
    store.put("x", 12, probs)
    store.put("x", 13, probs * 2)               # a new round replaces the old rows
    with pytest.raises(StaleMessage):
        store.take("x", 12)
    store.drop("x")
    store.drop("x")
    assert len(store) == 0


# ---------------------------------------------------------------- the other proposers

@pytest.fixture(scope="module")
def draft_lm():
    return load_llama(f"{MODELS}/draft-lm", torch.float32)


def test_draft_model_catch_up_and_propose(draft_lm) -> None:
    cfg = SpecConfig(method="draft-model", num_steps=3, topk=2, num_draft_tokens=6)
    toks = [_tokens(15, seed=80), _tokens(9, seed=81)]
    steps = DraftModelProposer(draft_lm, cfg, max_slots=2, max_len=MAX_LEN)
    reqs = [_request("a", toks[0][:6]), _request("b", toks[1][:4])]
    steps.catch_up(reqs, [5, 3], [None, None])
    reqs[0].token_ids.extend(toks[0][6:])
    reqs[1].token_ids.extend(toks[1][4:])
    steps.catch_up(reqs, [9, 5], [None, None])
    tree = steps.propose(reqs)
    for i, r in enumerate(reqs):
        assert steps.cache_len[r.request_id] == r.committed_len
        once = DraftModelProposer(draft_lm, cfg, max_slots=1, max_len=MAX_LEN)
        solo = _request("solo", toks[i])
        once.catch_up([solo], [len(toks[i]) - 1], [None])
        torch.testing.assert_close(steps.last_logits[r.request_id], once.last_logits["solo"], atol=ATOL, rtol=0)
        # a plain causal forward over all tokens gives the same next-token logits
        t = len(toks[i])
        cache = KVCache(draft_lm.spec.num_layers, 1, draft_lm.spec.num_kv_heads, MAX_LEN,
                        draft_lm.spec.head_dim, torch.float32)
        pos = torch.arange(t)[None]
        with torch.no_grad():
            hidden, _ = draft_lm(torch.tensor([toks[i]]), pos, cache.batch(torch.tensor([0]), pos, t),
                                 torch.ones(t, t, dtype=torch.bool).tril()[None])
        torch.testing.assert_close(steps.last_logits[r.request_id], draft_lm.logits(hidden)[0, -1],
                                   atol=ATOL, rtol=0)
        alone = once.propose([solo])
        assert torch.equal(alone.token_ids[0], tree.token_ids[i])
        assert torch.equal(alone.parents[0], tree.parents[i])


def test_ngram_lookup() -> None:
    cfg = SpecConfig(method="ngram", num_steps=3, topk=1, num_draft_tokens=8, ngram_max=3, ngram_min=1)
    prop = NgramProposer(cfg)
    reqs = [_request("a", [1, 2, 3, 9, 8, 1, 2, 3]),      # [1, 2, 3] occurred: propose what followed
            _request("b", [5, 6, 7]),                      # nothing repeats
            _request("c", [4, 1, 4, 2, 4])]                # latest earlier occurrence of [4] wins
    tree = prop.propose(reqs)
    assert tree.token_ids.tolist() == [[9, 8, 1], [-1, -1, -1], [2, 4, -1]]
    assert tree.parents.tolist() == [[0, 1, 2]] * 3
    assert tree.scores[1].eq(float("-inf")).all()
    assert tree.scores[0].eq(0).all()


def test_engine_extend_absorbs_held_back_rounds_in_one_catch_up(head) -> None:
    """Rounds a request was decoded plainly come in one call, in order (the router's backlog):
    the engine joins them into one catch-up, which leaves the head where two calls leave it
    (catch-up over several pairs equals pair by pair, up to summation order)."""
    prompt = _tokens(10, seed=70)
    feats = [_features(head, 10, seed=71), _features(head, 1, seed=72), _features(head, 2, seed=73)]
    engines = [_engine(head), _engine(head)]
    for e in engines:
        e.add("a", prompt, 77, SamplingParams(), seed=1, features=feats[0])
        e.add("b", prompt[:6], 78, SamplingParams(), seed=2, features=_features(head, 6, seed=74))
    rounds = [_verify_output("a", 12, [5], feats[1]), _verify_output("a", 14, [6, 7], feats[2])]
    for out in rounds:
        engines[0].extend([out])
    calls = []
    inner = engines[1].proposer.catch_up
    engines[1].proposer.catch_up = lambda reqs, n, f: (calls.append(list(n)), inner(reqs, n, f))
    engines[1].extend([*rounds, _verify_output("b", 8, [9], _features(head, 1, seed=75))])
    assert calls == [[3, 1]], "both held-back rounds of 'a' in one catch-up, beside 'b'"
    one, two = (e.proposer for e in engines)
    assert engines[1].requests["a"].token_ids == engines[0].requests["a"].token_ids
    assert one.cache_len["a"] == two.cache_len["a"] == 13
    torch.testing.assert_close(two.last_logits["a"], one.last_logits["a"], **LOOSE)
    with pytest.raises(StaleMessage):        # a gap between the rounds is refused, nothing applied
        engines[1].extend([_verify_output("b", 10, [1], _features(head, 1, seed=76)),
                           _verify_output("b", 13, [2], _features(head, 1, seed=77))])
    assert engines[1].requests["b"].committed_len == 8
