"""EagleProposer.propose on the real demo target and heads (fp32, CPU): the tree proposals are
held to a plain sequential run of the head along each node's path, and each request drafts
alone what it drafts in a batch."""

import copy

import torch

from drafter.proposers import EagleProposer
from spectandem.kv_cache import KVCache
from tests.drafter.proposer_helpers import ATOL, MAX_LEN, _cfg, _entries, _request, _tokens


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
