"""The mask space: how many layers a ratio skips, which are free, the evenly spaced mask."""

from __future__ import annotations

from collections.abc import Sequence

from viasd.errors import InvalidParameterError


def num_skipped(ratio: float, num_layers: int) -> int:
    """k = round(ratio * L) (Python rounding, as `LayerMask.evenly_spaced`)."""
    if not 0.0 <= ratio < 1.0:
        raise InvalidParameterError("ratio", f"skip ratio must be in [0, 1), got {ratio}")
    return round(ratio * num_layers)


def normalize_keep(keep: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Layers that are never skipped; negative indices count from the end (-1 = last layer)."""
    out = set()
    for i in keep:
        j = int(i) + num_layers if int(i) < 0 else int(i)
        if not 0 <= j < num_layers:
            raise InvalidParameterError("keep", f"layer {i} out of range for a {num_layers}-layer model")
        out.add(j)
    return tuple(sorted(out))


def evenly_spaced_skips(free: Sequence[int], k: int) -> tuple[int, ...]:
    """k layers spread evenly over `free` (the rule of `LayerMask.evenly_spaced` when free = 1..L-2)."""
    if k == 0:
        return ()
    step = len(free) / k
    return tuple(sorted({free[int(step * j + step / 2)] for j in range(k)}))
