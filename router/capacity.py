"""The router's KV accounting: how many blocks a request's next round may hold on each side, and
whether a set of requests fits both pools. No torch here; the engines report the pools."""

from __future__ import annotations

from spectandem.block_manager import blocks_for


class KvBudget:
    """`cfg` is the RouterConfig (pool sizes, block sizes, lookahead); a pool of 0 blocks is not
    paged and never limits. `has_drafter`: whether the drafter's pool counts at all."""

    def __init__(self, cfg, has_drafter: bool):
        self.cfg, self.has_drafter = cfg, has_drafter

    def need(self, committed_len: int) -> tuple[int, int]:
        """KV blocks (verifier, drafter) a request at this committed length may hold next round."""
        c = self.cfg
        n = committed_len - 1 + max(c.lookahead, c.plain_steps)
        v = blocks_for(n, c.kv_block_size) if c.kv_blocks else 0
        d = blocks_for(n, c.draft_kv_block_size) if c.draft_kv_blocks and self.has_drafter else 0
        return v, d

    def fits(self, committed_lens: list[int], extra: tuple[int, int] = (0, 0)) -> bool:
        needs = [self.need(n) for n in committed_lens]
        v = extra[0] + sum(x for x, _ in needs)
        d = extra[1] + sum(y for _, y in needs)
        c = self.cfg
        return (not c.kv_blocks or v <= c.kv_blocks) and (not c.draft_kv_blocks or d <= c.draft_kv_blocks)

    def never_fits(self, need: tuple[int, int]) -> str | None:
        """Why a request needing `need` cannot fit even alone (None if it can)."""
        c = self.cfg
        if c.kv_blocks and need[0] > c.kv_blocks:
            return (f"the request needs {need[0]} KV blocks of {c.kv_block_size} entries on the verifier; "
                    f"its pool has {c.kv_blocks} (--kv-blocks)")
        if c.draft_kv_blocks and need[1] > c.draft_kv_blocks:
            return (f"the request needs {need[1]} KV blocks of {c.draft_kv_block_size} entries on the "
                    f"drafter; its pool has {c.draft_kv_blocks} (--draft-kv-blocks)")
        return None
