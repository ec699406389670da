"""What every KV cache store of the engine shares: up to `max_rows` sequences (rows) over a subset
of layers, each (layer, row) with its own valid length, and a sequence's view of its row.

The slot store (`viasd.runtime.SlotKVCache`) and the paged store (`viasd.blocks.PagedKVCache`)
differ only in where the keys and values live and how a forward reaches them (`batch`); rows,
lengths, rollback by length and the byte counts are the same here for both. Every store keeps
its keys and values per layer in `_k[l]` / `_v[l]` tensors whose dimension 1 is the key/value
heads and whose last dimension is the head size.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import Tensor

from viasd.errors import CapacityError, MaskError


class KVStore:
    """Rows of sequences over `layers` of a `num_layers`-layer model (see the module docstring)."""

    def __init__(self, layers: Iterable[int], num_layers: int, *, max_rows: int = 1, max_len: int | None = None):
        self.layers = tuple(sorted(set(layers)))
        if any(not 0 <= i < num_layers for i in self.layers):
            raise MaskError(f"cache layers {self.layers} out of range for a {num_layers}-layer model")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.num_layers, self.max_rows = num_layers, max_rows
        self.max_len = max_len  # positions per row; None: unbounded
        self._k: list[Tensor | None] = [None] * num_layers
        self._v: list[Tensor | None] = [None] * num_layers
        self._len = [[0] * max_rows for _ in range(num_layers)]  # [L][row]
        self._free_rows = list(range(max_rows))  # lowest first

    def alloc(self) -> int:
        """A free row (the lowest), all of its layers at length 0."""
        if not self._free_rows:
            raise CapacityError("rows", f"all {self.max_rows} cache rows are in use")
        row = self._free_rows.pop(0)
        for lens in self._len:
            lens[row] = 0
        return row

    def free(self, row: int) -> None:
        """Give a row back (and whatever storage only it held)."""
        if row in self._free_rows or not 0 <= row < self.max_rows:
            raise ValueError(f"row {row} is not allocated")
        for lens in self._len:
            lens[row] = 0
        self._released(row)
        self._free_rows.append(row)
        self._free_rows.sort()

    def _released(self, row: int) -> None:
        """A store's own bookkeeping when a row is freed."""

    def attach(self, row: int, tokens: Sequence[int]) -> int:
        """Prefix caching: give an empty row the cached keys/values of the longest prefix of
        `tokens` the store holds; the positions it now holds (0: none, or no prefix cache)."""
        return 0

    def publish(self, row: int, tokens: Sequence[int]) -> None:
        """Prefix caching: the row's keys/values of `tokens` (its sequence's first positions, all
        written) may be attached by later rows."""

    @property
    def rows_in_use(self) -> int:
        return self.max_rows - len(self._free_rows)

    def row(self, row: int) -> RowCache:
        return RowCache(self, row)

    def length(self, row: int, layer: int) -> int:
        return self._len[layer][row]

    def nbytes(self, row: int | None = None) -> int:
        """Bytes of the valid entries of one row (or of all rows)."""
        total = 0
        for i in self.layers:
            k = self._k[i]
            if k is not None:
                n = self._len[i][row] if row is not None else sum(self._len[i])
                total += 2 * k.shape[1] * n * k.shape[-1] * k.element_size()
        return total

    def reserved_bytes(self) -> int:
        """Bytes of the storage allocated so far (every row or block, valid or not)."""
        return sum(2 * k.numel() * k.element_size() for k in self._k if k is not None)


@dataclass(frozen=True)
class RowCache:
    """One sequence's view of a store: its row, with the single-sequence API."""

    store: KVStore
    row: int

    @property
    def layers(self) -> tuple[int, ...]:
        return self.store.layers

    def length(self, layer: int) -> int:
        return self.store.length(self.row, layer)

    def lengths(self) -> dict[int, int]:
        return {i: self.store.length(self.row, i) for i in self.store.layers}

    def crop(self, length: int, layers: Iterable[int] | None = None) -> None:
        self.store.crop(self.row, length, layers)

    def kv(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.store.kv(self.row, layer)

    def attach(self, tokens: Sequence[int]) -> int:
        return self.store.attach(self.row, tokens)

    def publish(self, tokens: Sequence[int]) -> None:
        self.store.publish(self.row, tokens)

    def copy_from(self, other: RowCache, length: int) -> None:
        """This row's first `length` positions become `other`'s (same store)."""
        assert other.store is self.store, "rows of different caches"
        self.store.copy_row(other.row, self.row, length)

    def nbytes(self) -> int:
        return self.store.nbytes(self.row)

    def release(self) -> None:
        self.store.free(self.row)
