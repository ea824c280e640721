"""A token tree as one input of a pass (DESIGN.md §12).

A tree's nodes sit after a cache's committed tokens: node m is stored at position `base + m`
(storage order: a parent before its children), and is the token at position `base + depth(m)`
of its own branch, depth 0 for a node whose parent is -1 (the committed prefix's next token).
In a pass, node m attends the committed keys (positions < base) and the keys of its ancestors
and itself, nothing else; so a node's numbers are those of a chain step on its own branch.

An input with a tree runs the tree's last n nodes (its rows), written after the nodes an earlier
pass wrote: the draft grows a tree level by level, one pass per level, on top of the nodes it
wrote before. A chain x_1..x_n is the tree with parents [-1, 0, 1, ..., n-2].
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Tree:
    base: int  # the committed length: node m is stored at base + m
    parents: tuple[int, ...]  # per node, its parent node (earlier), or -1
    depth: tuple[int, ...] = field(init=False)

    def __post_init__(self):
        d: list[int] = []
        for m, p in enumerate(self.parents):
            if not -1 <= p < m:
                raise ValueError(f"tree node {m}: parent {p} must be -1 or an earlier node")
            d.append(0 if p < 0 else d[p] + 1)
        object.__setattr__(self, "depth", tuple(d))

    def __len__(self) -> int:
        return len(self.parents)

    def ancestors(self, m: int) -> list[int]:
        """Node m's ancestors and itself, root first."""
        out = []
        while m >= 0:
            out.append(m)
            m = self.parents[m]
        return out[::-1]

    def visible(self) -> list[list[bool]]:
        """[m][k]: whether node m attends node k (k an ancestor of m, or m)."""
        rows: list[list[bool]] = []
        for m, p in enumerate(self.parents):
            row = list(rows[p]) if p >= 0 else [False] * len(self.parents)
            row[m] = True
            rows.append(row)
        return rows

    @classmethod
    def chain(cls, base: int, n: int) -> "Tree":
        return cls(base, tuple(range(-1, n - 1)))
