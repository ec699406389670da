"""A paged key/value cache: fixed-size blocks taken as a sequence grows, shared by reference.

`PagedKVCache` has `SlotKVCache`'s interface (rows, per-(layer, row) lengths, `crop`, `copy_row`,
`batch`), so every forward and session runs on either. Storage differs:

    pool_l        [P * block_size, H_kv, D]   per layer l; slot s = block * block_size + offset
    table[row]    [blocks of the row]          block i holds positions i*block_size .. (i+1)*block_size - 1

A row holds ceil(max_l length_l / block_size) blocks: memory follows the tokens each request
holds, not the longest row. Block 0 is never handed out: it stays zero, and every key position a
row does not hold (past its length, up to the batch's span) reads it, so a masked-out key is
finite and contributes exactly 0.

Blocks are reference counted. `copy_row` (n > 1 samples sharing one prefill) gives the copy the
source's blocks, not their contents; a write into a block held by more than one row first copies
it (copy on write), so rows never see each other's tokens. Blocks are allocated before a forward
runs (`batch`), lowest id first, so a store that cannot hold a forward refuses it whole
(CapacityError) and changes nothing. Pools grow by doubling up to `num_blocks`.

Prefix caching (`prefix_caching`, vLLM's automatic prefix caching): a full block whose positions
hold the keys/values of known tokens is *published* under the digest of every token up to its
end, chained block by block,

    d_0 = H(tokens[0 : bs]),   d_i = H(d_{i-1} || tokens[i*bs : (i+1)*bs])      (H: BLAKE2b-128)

and a new row *attaches* the published blocks of the longest prefix of its sequence instead of
computing them (`attach`): the keys and values at a position depend on the tokens up to it only,
so they are the ones it would have written. Only full blocks are shared, so every row writes its
first divergent position into a block of its own. A block no row holds any more keeps its
contents and stays published while the pool has other free blocks: it counts as free and is
reused, least recently used first, when none is left. A published block that a row writes in
place (after rolling back into it) is unpublished first.

`attention` picks what reads the blocks (viasd.attention): "torch" gathers each row's blocks,
rows of similar spans together (a row forwarded alone whose blocks are adjacent in the pool is
written and read in place, a slice of the pool); "flex" hands FlexAttention the pool and each
row's block table.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import Tensor

from viasd.attention import PAGED_KERNELS, PagedKV, paged_block_mask, span_buckets
from viasd.errors import CapacityError, MaskError
from viasd.kvstore import KVStore

ZERO_BLOCK = 0  # never allocated: the keys of positions a row does not hold


class PagedKVCache(KVStore):
    """Keys and values of up to `max_rows` sequences in `num_blocks` blocks of `block_size` positions."""

    def __init__(
        self,
        layers: Iterable[int],
        num_layers: int,
        *,
        num_blocks: int,
        block_size: int = 16,
        max_rows: int = 1,
        max_len: int | None = None,
        prefix_caching: bool = False,
        attention: str = "torch",
    ):
        super().__init__(layers, num_layers, max_rows=max_rows, max_len=max_len)  # _k, _v: [capacity * N, H_kv, D]
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1: {num_blocks}, {block_size}")
        if attention not in PAGED_KERNELS:
            raise ValueError(f"attention must be one of {PAGED_KERNELS}, got {attention!r}")
        self.attention = attention  # what reads the blocks in a forward (module docstring)
        self.num_blocks, self.block_size = num_blocks, block_size
        self._capacity = 0  # blocks the pools hold (ZERO_BLOCK included)
        self._top = ZERO_BLOCK  # the highest block id taken so far
        self._tables: list[list[int]] = [[] for _ in range(max_rows)]
        self._refs = [0] * (num_blocks + 1)
        self._free_blocks = list(range(1, num_blocks + 1))  # a heap: lowest id first
        self.prefix_caching = prefix_caching
        self._published: dict[bytes, int] = {}  # chained digest of a full block's tokens -> the block
        self._digest: dict[int, bytes] = {}  # published block -> its digest
        self._cached: OrderedDict[int, None] = OrderedDict()  # published blocks no row holds, least recent first
        self.attached_positions = 0  # positions rows attached instead of computing (prefix cache hits)

    # ------------------------------------------------------------ rows

    def _released(self, row: int) -> None:
        self._drop(row, 0)  # its blocks go back (a shared one when its last holder leaves)

    @property
    def free_blocks(self) -> int:
        """Blocks a forward may take: unused ones and published ones no row holds."""
        return len(self._free_blocks) + len(self._cached)

    def blocks(self, row: int) -> tuple[int, ...]:
        """The row's block table."""
        return tuple(self._tables[row])

    def blocks_for(self, positions: int) -> int:
        """Blocks that hold `positions` positions."""
        return -(-positions // self.block_size)

    # ------------------------------------------------------------ lengths

    def crop(self, row: int, length: int, layers: Iterable[int] | None = None) -> None:
        """Roll the given layers (default: all) of a row back to `length`; blocks no layer needs any
        more go back to the pool."""
        for i in self.layers if layers is None else layers:
            self._len[i][row] = min(self._len[i][row], length)
        self._drop(row, self.blocks_for(max(self._len[i][row] for i in self.layers)))

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Row `dst` (empty) shares the blocks holding `src`'s first `length` positions: its layers
        end up at min(length, src's length), as if it had fed them; the first write copies a shared block."""
        if self._tables[dst]:
            raise ValueError(f"row {dst} already holds blocks")
        for i in self.layers:
            self._len[i][dst] = min(length, self._len[i][src])
        shared = self._tables[src][: self.blocks_for(max(self._len[i][dst] for i in self.layers))]
        for block in shared:
            self._refs[block] += 1
        self._tables[dst] = list(shared)

    def kv(self, row: int, layer: int) -> tuple[Tensor, Tensor]:
        """The valid keys and values of one row and layer, each [1, H_kv, length, D] (gathered copies)."""
        if self._k[layer] is None:
            raise MaskError(f"layer {layer} holds no keys yet")
        slots = self._slots(self._tables[row], self._len[layer][row], self._k[layer].device)  # [n]
        k = self._k[layer][slots].transpose(0, 1)[None]  # [1, H_kv, n, D]
        return k, self._v[layer][slots].transpose(0, 1)[None]

    # ------------------------------------------------------------ forwards

    def batch(
        self, rows: Sequence[int], starts: Sequence[int], lengths: Sequence[int], device: torch.device | str = "cpu"
    ) -> _PagedWrite:
        """The cache view of one forward: row b = rows[b] appends lengths[b] tokens at starts[b].
        Takes every block the forward writes now (new ones, and private copies of shared ones):
        CapacityError, with nothing changed, when the pool cannot hold them."""
        ends = [s + n for s, n in zip(starts, lengths)]
        if self.max_len is not None and max(ends) > self.max_len:
            raise CapacityError("max_seq_len", f"{max(ends)} positions exceed the cache's {self.max_len} per row")
        new = sum(max(0, self.blocks_for(e) - len(self._tables[r])) for r, e in zip(rows, ends))
        shared = [
            (r, i)
            for r, s, e in zip(rows, starts, ends)
            for i in range(s // self.block_size, min(len(self._tables[r]), self.blocks_for(e)))
            if self._refs[self._tables[r][i]] > 1
        ]
        if new + len(shared) > self.free_blocks:
            raise CapacityError(
                "kv_blocks",
                f"the forward needs {new + len(shared)} more KV blocks; {self.free_blocks} of "
                f"{self.num_blocks} are free",
            )
        for r, i in shared:  # copy on write (the last holder of a block writes it in place)
            if self._refs[self._tables[r][i]] == 1:
                continue
            old, block = self._tables[r][i], self._take()
            self._copy_block(old, block)
            self._refs[old] -= 1
            self._tables[r][i] = block
        if self._digest:  # a published block written in place no longer holds the prefix it was published for
            for r, s, e in zip(rows, starts, ends):
                for i in range(s // self.block_size, min(len(self._tables[r]), self.blocks_for(e))):
                    self._unpublish(self._tables[r][i])
        for r, e in zip(rows, ends):
            while len(self._tables[r]) < self.blocks_for(e):
                self._tables[r].append(self._take())
        return _PagedWrite(self, list(rows), list(starts), list(lengths), torch.device(device))

    # ------------------------------------------------------------ prefix caching

    def attach(self, row: int, tokens: Sequence[int]) -> int:
        """An empty row takes the published blocks of the longest prefix of `tokens` in full
        blocks (module docstring); every layer of it then holds their positions, which it returns
        (0: nothing published matches, or prefix caching is off)."""
        if not self.prefix_caching or self._tables[row] or any(self._len[i][row] for i in self.layers):
            return 0
        table = []
        for digest in self._digests(tokens):
            block = self._published.get(digest)
            if block is None:
                break
            table.append(block)
        for block in table:
            if self._refs[block] == 0:
                del self._cached[block]
            self._refs[block] += 1
        self._tables[row] = table
        n = len(table) * self.block_size
        for i in self.layers:
            self._len[i][row] = n
        self.attached_positions += n
        return n

    def publish(self, row: int, tokens: Sequence[int]) -> None:
        """Publish the row's full blocks that hold `tokens` (the first positions of its sequence)
        in every layer, so later rows may attach them. A prefix already published in another
        block stays there."""
        if not self.prefix_caching:
            return
        held = min(self._len[i][row] for i in self.layers)
        for block, digest in zip(self._tables[row], self._digests(tokens[:held])):
            if block not in self._digest and digest not in self._published:
                self._digest[block], self._published[digest] = digest, block

    def _digests(self, tokens: Sequence[int]) -> Iterator[bytes]:
        """The chained digest of each full block of `tokens` (module docstring)."""
        digest, bs = b"", self.block_size
        for i in range(len(tokens) // bs):
            block = array("q", tokens[i * bs : (i + 1) * bs]).tobytes()
            digest = hashlib.blake2b(digest + block, digest_size=16).digest()
            yield digest

    def _unpublish(self, block: int) -> None:
        digest = self._digest.pop(block, None)
        if digest is not None:
            del self._published[digest]

    # ------------------------------------------------------------ blocks

    def _take(self) -> int:
        if self._free_blocks:
            block = heapq.heappop(self._free_blocks)
        else:  # the least recently used published block no row holds: its prefix is forgotten
            block, _ = self._cached.popitem(last=False)
            self._unpublish(block)
        self._refs[block] = 1
        self._top = max(self._top, block)
        return block

    def _drop(self, row: int, keep: int) -> None:
        """Release the row's blocks past the first `keep`."""
        table = self._tables[row]
        while len(table) > keep:
            block = table.pop()
            self._refs[block] -= 1
            if self._refs[block] == 0 and block in self._digest:
                self._cached[block] = None  # (kept for a later row with the same prefix)
            elif self._refs[block] == 0:
                heapq.heappush(self._free_blocks, block)

    @torch.inference_mode()
    def _copy_block(self, src: int, dst: int) -> None:
        """Block `dst` becomes a copy of block `src` in every layer's pool."""
        self._grow()  # (dst may be past the pools)
        bs = self.block_size
        for k, v in zip(self._k, self._v):
            if k is not None:
                k[dst * bs : (dst + 1) * bs] = k[src * bs : (src + 1) * bs]
                v[dst * bs : (dst + 1) * bs] = v[src * bs : (src + 1) * bs]

    def _slots(self, table: Sequence[int], n: int, device) -> Tensor:
        """Pool slots of positions 0..n-1 of a row with this block table, [n]."""
        pos = torch.arange(n)
        blocks = torch.tensor(table or [ZERO_BLOCK], dtype=torch.long)
        return (blocks[pos // self.block_size] * self.block_size + pos % self.block_size).to(device)

    def _ensure(self, layer: int, like: Tensor) -> None:
        """Every pool holds every block taken so far, and layer `layer` has one (zeros, like
        `like` [B, H_kv, T, D])."""
        if self._top >= self._capacity or self._k[layer] is None:  # (checked per layer and forward: cheaply)
            self._allocate(layer, like)

    @torch.inference_mode()  # (pools are inference tensors: a forward allocates them)
    def _allocate(self, layer: int, like: Tensor) -> None:
        self._grow()
        if self._k[layer] is None:
            shape = (self._capacity * self.block_size, like.shape[1], like.shape[3])
            self._k[layer], self._v[layer] = like.new_zeros(shape), like.new_zeros(shape)

    def _grow(self) -> None:
        """Pools that hold every block taken so far: doubling, up to num_blocks + 1 blocks."""
        if self._top < self._capacity:
            return
        capacity = min(self.num_blocks + 1, max(4, 1 << self._top.bit_length()))
        for i, (k, v) in enumerate(zip(self._k, self._v)):
            if k is not None:
                self._k[i], self._v[i] = self._grown(k, capacity), self._grown(v, capacity)
        self._capacity = capacity

    def _grown(self, pool: Tensor, capacity: int) -> Tensor:
        new = pool.new_zeros((capacity * self.block_size, *pool.shape[1:]))
        new[: pool.shape[0]] = pool
        return new

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(layers={len(self.layers)}/{self.num_layers}, rows={self.rows_in_use}/{self.max_rows}, "
            f"blocks={self.num_blocks - self.free_blocks}/{self.num_blocks}x{self.block_size})"
        )


class _PagedWrite:
    """What one batched forward gives the attention modules as `past_key_values`.

    `update(key, value, layer_idx)` writes the real tokens of every row (never the padding) into
    their blocks and returns the keys/values the queries attend to, [B, H_kv, S, D] with
    S = max_b start_b + T_b once gathered from each row's blocks (positions a row does not hold read
    the zero block): gathered by the attention, rows of similar spans together; or, with the
    flex kernel, the pool itself and the rows' BlockMask (built at the first layer, for all).
    """

    def __init__(self, cache: PagedKVCache, rows: list[int], starts: list[int], lengths: list[int], device):
        self.cache, self.rows, self.starts, self.lengths = cache, rows, starts, lengths
        bs = cache.block_size
        span = max(s + n for s, n in zip(starts, lengths))  # S
        width = cache.blocks_for(span)
        self.read, self.buckets, self.block_mask = None, (), None
        self.flex = cache.attention == "flex"
        # one row whose blocks lie one after the other in the pool (a request decoding alone, as
        # the lowest-id-first allocation hands them out): its keys are a slice of the pool, written
        # and read in place (a view), not scattered and gathered slot by slot
        self.base = None
        if len(rows) == 1 and not self.flex:
            table = cache._tables[rows[0]][:width]
            if len(table) == width and table == list(range(table[0], table[0] + width)):
                self.base = table[0] * bs  # (the slot of position 0)
                self.buckets = ((None, span),)
                return
        tables = torch.tensor([cache._tables[r] + [ZERO_BLOCK] * (width - len(cache._tables[r])) for r in rows])
        pos = torch.arange(span)  # [S]
        slots = tables[:, pos // bs] * bs + pos % bs  # [B, S]
        spans = [s + n for s, n in zip(starts, lengths)]
        if self.flex:  # (the mask waits for the pool: its slots are the keys' length)
            self.tables = tables.to(device)  # [B, W]
            self.starts_t, self.spans_t = torch.tensor(starts, device=device), torch.tensor(spans, device=device)
        else:
            held = torch.tensor(spans)[:, None] > pos[None, :]  # [B, S]
            self.read = torch.where(held, slots, 0).to(device)  # [B, S]: the zero block past a row's tokens
            self.buckets = span_buckets(spans, device)
        b_idx = [b for b, n in enumerate(lengths) for _ in range(n)]
        t_idx = [t for n in lengths for t in range(n)]
        self.src_b = torch.tensor(b_idx, device=device)  # [N]
        self.src_t = torch.tensor(t_idx, device=device)  # [N]
        self.dst = slots[b_idx, [starts[b] + t for b, t in zip(b_idx, t_idx)]].to(device)  # [N]

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[PagedKV, PagedKV]:
        """key/value [B, H_kv, T, D] -> the rows' keys/values, read by the attention bucket by
        bucket (viasd.attention.PagedKV: [B, H_kv, S, D] once gathered)."""
        cache = self.cache
        if layer_idx not in cache.layers:
            raise MaskError(f"layer {layer_idx} has no slot in this cache (layers {cache.layers})")
        cache._ensure(layer_idx, key)
        k_pool, v_pool = cache._k[layer_idx], cache._v[layer_idx]  # [slots, H_kv, D]
        if self.base is not None:  # one row in adjacent blocks: its new positions are one slice
            (start,), (n,) = self.starts, self.lengths
            at = self.base + start
            k_pool[at : at + n] = key[0, :, :n].transpose(0, 1)  # [n, H_kv, D]
            v_pool[at : at + n] = value[0, :, :n].transpose(0, 1)
        else:
            k_pool[self.dst] = key[self.src_b, :, self.src_t]  # [N, H_kv, D]
            v_pool[self.dst] = value[self.src_b, :, self.src_t]
        lens = cache._len[layer_idx]
        for row, start, n in zip(self.rows, self.starts, self.lengths):
            lens[row] = start + n
        if self.flex and (self.block_mask is None or self.block_mask.seq_lengths[1] != len(k_pool)):
            q_len = max(self.lengths)  # T: the forward's rows, right-padded
            self.block_mask = paged_block_mask(
                self.tables, self.starts_t, self.spans_t, cache.block_size, len(k_pool), q_len
            )
        return (
            PagedKV(k_pool, self.read, self.buckets, self.block_mask, self.base),
            PagedKV(v_pool, self.read, self.buckets, self.block_mask, self.base),
        )
