"""Fixed-size KV blocks: who owns which. No torch here.

The protocol: `can_allocate(owner, num_entries)` / `allocate(owner, num_entries)` grow an owner's
block list to hold `num_entries` cache entries (never shrinking it), `deallocate(owner)` returns
its blocks to the pool.
"""

from __future__ import annotations


class KVCacheFull(RuntimeError):
    """The block pool cannot hold what a request needs (the router preempts before this)."""


def blocks_for(num_entries: int, block_size: int) -> int:
    return -(-num_entries // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.tables: dict[int, list[int]] = {}
        # Owners whose first blocks are borrowed from another owner (a fork): how many. Borrowed
        # blocks are read-only for the borrower and never returned to the pool by it.
        self.borrowed: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def missing(self, owner: int, num_entries: int) -> int:
        return max(0, blocks_for(num_entries, self.block_size) - len(self.tables.get(owner, ())))

    def can_allocate(self, owner: int, num_entries: int) -> bool:
        return self.missing(owner, num_entries) <= len(self.free)

    def allocate(self, owner: int, num_entries: int) -> list[int]:
        need = self.missing(owner, num_entries)
        if need > len(self.free):
            raise KVCacheFull(f"KV cache full: {num_entries} entries need {need} more blocks of "
                              f"{self.block_size}, {len(self.free)} of {self.num_blocks} free")
        table = self.tables.setdefault(owner, [])
        for _ in range(need):
            table.append(self.free.pop())
        return table

    def share(self, owner: int, blocks: list[int]) -> None:
        """Starts `owner`'s table with another owner's `blocks`, borrowed (a fork of its prefix).
        The lender must keep them (unchanged) until the borrower is deallocated."""
        if self.tables.get(owner):
            raise ValueError(f"owner {owner} already holds blocks")
        self.tables[owner] = list(blocks)
        self.borrowed[owner] = len(blocks)

    def deallocate(self, owner: int) -> None:
        table = self.tables.pop(owner, [])
        self.free.extend(reversed(table[self.borrowed.pop(owner, 0):]))
