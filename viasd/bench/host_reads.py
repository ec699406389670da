"""Count the reads of tensor values into Python that a piece of code makes (every thread).

On a GPU each such read waits for the device's queue to drain, so a decode step should make as
few as it can: its committed tokens and per-row counts once, plus logprobs where a request asks
for them. `count_host_reads` wraps the torch.Tensor methods that hand a value to the host
(`item`, `tolist`, `__int__`, `__float__`, `__bool__`, `__index__`, `numpy`, `cpu`) and counts
their calls from any thread while it is active; a read made inside another counted read (`cpu`
calling into `numpy`, say) counts once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu")
_lock = threading.Lock()


@dataclass
class HostReads:
    """Reads counted so far, in total and by method."""

    total: int = 0
    by_method: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def count_host_reads() -> Iterator[HostReads]:
    """Count host reads of tensor values (module docstring) while the block runs, on every thread."""
    counter, inside = HostReads(), threading.local()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, original):
        def read(self, *args, **kwargs):
            if getattr(inside, "depth", 0) == 0:
                with _lock:
                    counter.total += 1
                    counter.by_method[name] = counter.by_method.get(name, 0) + 1
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                return original(self, *args, **kwargs)
            finally:
                inside.depth -= 1

        return read

    with _lock:
        for name, original in originals.items():
            setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield counter
    finally:
        with _lock:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
