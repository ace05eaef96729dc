"""Expert keys: one routed expert is (layer, expert), the unit every tier, policy, trace and stat counts.

Knows nothing of bytes or tensors. Entry point: `Key(layer, expert)` (a NamedTuple, so plain
`(layer, expert)` tuples compare and hash equal to it).
"""

from __future__ import annotations

from typing import NamedTuple


class Key(NamedTuple):
    layer: int
    expert: int

    def __str__(self) -> str:
        return f"layer {self.layer} expert {self.expert}"
