"""The attention of every forward the engine runs: scaled dot-product attention over each row's
keys, the query heads of a grouped-query layer packed rather than the keys repeated.

With H query heads over H_kv key/value heads (g = H / H_kv query heads per key/value head, head
h reading key/value head h // g), the g heads of a group are stacked along the query axis:

    q    [B, H, T, D]     -> [B, H_kv, g*T, D]     (row r*T + t: head kv*g + r, query t)
    mask [B, 1, T, S]     -> [B, 1, g*T, S]        (each head's queries see what its row sees)
    out  = softmax(q k^T * scale + mask) v          k, v [B, H_kv, S, D], read once per group
         -> [B, H_kv, g*T, D] -> [B, T, H, D]

which is per head exactly the attention transformers computes, without `repeat_kv`'s g copies of
K and V (8x the keys and values of every layer for LLaMA-70B's 64 query heads over 8). The mask
is a boolean [B, 1, T, S] (True: attend) or None for one row of one token.

A paged cache (viasd.blocks) hands it its keys and values as `PagedKV`: a pool of slots and each
row's slots. Rows are read in buckets of similar spans (how many keys each row holds), each
bucket gathered and attended to its own longest span, so one long row does not make every short
row read (and copy) as many keys as it holds; a batch of similar rows is one bucket.

The same read has a fused path (`paged_attention: flex`, viasd.config): PyTorch's FlexAttention
reads the keys straight from the pool, `[1, H_kv, slots, D]`, through a `BlockMask` whose key
blocks are each row's block table, so no row's keys are gathered or copied:

    kv_indices[b, 0, j]    the blocks of row b (its table), as many as query block j may see
    mask_mod(b, h, q, s)   slot s is in a block of row b, at position p = i * N + s % N (i: the
                           block's index in the row's table), with p < span_b and p <= start_b + q

which is per query exactly the mask of `MaskedLM.forward_batch` (key p <= the query's position),
bounded by the row's span (a padding query reads no slot the row did not write). Compiled
(`torch.compile`) on CUDA; elsewhere it runs eagerly (the reference implementation, which
materialises every score: for tests), with the same mask.

`MaskedLM` switches a model to it only for its own forwards (`using`), so transformers'
`generate` on the same modules keeps its own attention.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface

from viasd.errors import InvalidParameterError

NAME = "viasd_grouped"
PAGED_KERNELS = ("torch", "flex")  # what reads a paged cache: gathered rows and SDPA, or FlexAttention in place
FLEX_Q_BLOCK = 16  # queries per tile of the flex BlockMask (and the kernel's BLOCK_M on CUDA)


@dataclass(frozen=True)
class PagedKV:
    """One layer's keys (or values) of a forward over a paged cache, not gathered yet."""

    pool: Tensor  # [slots, H_kv, D]
    read: Tensor | None  # [B, S]: the slot of each row's positions (the zero block past its span); None: flex
    buckets: tuple[tuple[Tensor | None, int], ...]  # (rows [b] or None: all, their longest span S_b): span_buckets
    block_mask: object = None  # flex: the rows' BlockMask over the pool (paged_block_mask); None: the torch path
    base: int | None = None  # one row whose positions are the pool's slots base, base + 1, ...: read in place

    def rows(self, rows: Tensor | None, span: int) -> Tensor:
        """The keys of `rows` (all: None) up to `span`, [b, H_kv, span, D]: a gathered copy, or
        for one row in adjacent blocks (`base`) a view of the pool."""
        if self.base is not None:
            return self.pool[self.base : self.base + span].transpose(0, 1)[None]
        read = self.read[:, :span] if rows is None else self.read[rows, :span]
        return self.pool[read].transpose(1, 2)


@dataclass(frozen=True)
class PagedAttentionChoice:
    """The kernel that reads a paged cache (`EngineConfig.paged_attention`), and why."""

    kernel: str  # "torch" | "flex" (PAGED_KERNELS)
    requested: str  # "auto" | "torch" | "flex"
    reason: str  # requested | auto-cuda | auto-device | auto-unavailable | auto-block-size | slot-rows

    def as_dict(self) -> dict[str, str]:
        return {
            "paged_attention": self.kernel,
            "paged_attention_requested": self.requested,
            "paged_attention_reason": self.reason,
        }


def flex_available() -> bool:
    """FlexAttention can be compiled here: a CUDA device and Triton."""
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return torch.cuda.is_available() and has_triton()


def flex_block_size_ok(block_size: int) -> bool:
    """The compiled kernel tiles keys by whole blocks: a power of two of at least 16 positions."""
    return block_size >= 16 and block_size & (block_size - 1) == 0


def resolve_paged_attention(requested: str, device, block_size: int | None) -> PagedAttentionChoice:
    """The kernel an engine on `device` with KV blocks of `block_size` positions (None or 0: slot rows)
    reads its paged caches with. `auto`: flex on a CUDA device where FlexAttention compiles and
    the blocks suit it, else torch. `flex` where it cannot run is refused
    (InvalidParameterError naming `paged_attention`: never a silent fallback)."""
    if requested not in ("auto", *PAGED_KERNELS):
        raise InvalidParameterError("paged_attention", f"must be auto, torch or flex, got {requested!r}")
    if requested == "torch":
        return PagedAttentionChoice("torch", requested, "requested")
    on_cuda = str(device).split(":", 1)[0] == "cuda"
    if not block_size:
        reason = "flex reads a paged cache: set kv_block_size (16 or another power of two >= 16)"
    elif not on_cuda:
        reason = f"flex runs compiled on CUDA devices, and this engine's device is {device}; use torch or auto"
    elif not flex_available():
        reason = f"FlexAttention does not compile here (torch {torch.__version__}: no CUDA device or no Triton)"
    elif not flex_block_size_ok(block_size):
        reason = f"the flex kernel needs kv_block_size a power of two >= 16, got {block_size}"
    else:
        return PagedAttentionChoice("flex", requested, "requested" if requested == "flex" else "auto-cuda")
    if requested == "flex":
        raise InvalidParameterError("paged_attention", reason)
    if not block_size:
        return PagedAttentionChoice("torch", requested, "slot-rows")
    if not on_cuda:
        return PagedAttentionChoice("torch", requested, "auto-device")
    return PagedAttentionChoice("torch", requested, "auto-block-size" if flex_available() else "auto-unavailable")


def paged_block_mask(tables: Tensor, starts: Tensor, spans: Tensor, block_size: int, slots: int, q_len: int):
    """The FlexAttention BlockMask of one forward over a pool of `slots` slots (module docstring):
    row b's block table `tables` [B, W] (block ids; 0, the zero block no row holds, past its
    blocks), its queries t < q_len at positions starts[b] + t, its keys the spans[b] positions
    it holds (starts, spans [B], on the pool's device)."""
    from torch.nn.attention.flex_attention import BlockMask

    rows, width = tables.shape
    n, dev = block_size, tables.device
    index = torch.full((rows, slots // n), -1, dtype=torch.int32, device=dev)  # [B, pool blocks]: index in b's table
    # (the zero block pads the tables: its index is a padding entry's, whose positions lie past the row's span)
    index.scatter_(
        1, tables.long(), torch.arange(width, dtype=torch.int32, device=dev).expand(rows, width).contiguous()
    )

    def mask_mod(b, h, q, kv):
        i = index[b, kv // n]
        pos = i * n + kv % n  # the slot's position in row b (negative: not row b's)
        return (i >= 0) & (pos < spans[b]) & (pos <= starts[b] + q)

    q_tiles = -(-q_len // FLEX_Q_BLOCK)
    last = ((torch.arange(q_tiles, device=dev) + 1) * FLEX_Q_BLOCK).clamp(max=q_len)  # [Q]: queries to a tile's end
    seen = torch.minimum(starts[:, None] + last[None, :], spans[:, None])  # [B, Q]: positions a tile's queries see
    num = ((seen + n - 1) // n).to(torch.int32)[:, None]  # [B, 1, Q]: blocks each tile reads, the table's first ones
    indices = tables.to(torch.int32)[:, None, None, :].expand(rows, 1, q_tiles, width).contiguous()  # [B, 1, Q, W]
    return BlockMask.from_kv_blocks(
        num,
        indices,
        BLOCK_SIZE=(FLEX_Q_BLOCK, n),
        mask_mod=mask_mod,
        seq_lengths=(q_len, slots),
        compute_q_blocks=False,
    )


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, fullgraph=True)


def flex_paged_attention(query: Tensor, key: PagedKV, value: PagedKV, scaling: float | None) -> Tensor:
    """query [B, H, T, D] over the pools of `key` / `value` through their BlockMask -> [B, T, H, D]:
    every row reads its own blocks in place (the pool is one key/value batch entry, broadcast
    over the rows), the g query heads of a key/value head on the same keys (enable_gqa)."""
    from torch.nn.attention.flex_attention import flex_attention

    k = key.pool.transpose(0, 1)[None]  # [1, H_kv, slots, D]: a view of the pool, no copy
    v = value.pool.transpose(0, 1)[None]
    mask = key.block_mask
    if query.is_cuda:  # tiles of FLEX_Q_BLOCK queries by whole key blocks, the block table's own tiling
        block_n = min(mask.BLOCK_SIZE[1], 32 if query.dtype == torch.float32 else 64)
        options = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": FLEX_Q_BLOCK, "BLOCK_N": block_n}
        out = _compiled_flex()(query, k, v, block_mask=mask, scale=scaling, enable_gqa=True, kernel_options=options)
    else:  # (eager: the reference implementation, every score materialised)
        out = flex_attention(query, k, v, block_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()  # [B, T, H, D]


def span_buckets(spans: list[int], device) -> tuple[tuple[Tensor | None, int], ...]:
    """Rows grouped by span: those whose spans share a power-of-two class (all up to 64 in one),
    each group with its longest span; one group of every row (None) when there is one class."""
    classes: dict[int, list[int]] = {}
    for b, span in enumerate(spans):
        classes.setdefault(max(6, (span - 1).bit_length()), []).append(b)
    if len(classes) == 1:
        return ((None, max(spans)),)
    return tuple(
        (torch.tensor(rows, device=device), max(spans[b] for b in rows)) for _, rows in sorted(classes.items())
    )


def grouped_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract: query [B, H, T, D], key/value [B, H_kv, S, D]
    or `PagedKV` -> ([B, T, H, D], None)."""
    if isinstance(key, PagedKV):
        if key.block_mask is not None:  # (its mask is the forward's, built from the rows' starts and spans)
            return flex_paged_attention(query, key, value, scaling), None
        if len(key.buckets) == 1:
            (_, span), mask = key.buckets[0], attention_mask
            k, v = key.rows(None, span), value.rows(None, span)
            return grouped_attention(module, query, k, v, None if mask is None else mask[..., :span], dropout, scaling)
        out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])  # [B, T, H, D]
        for rows, span in key.buckets:
            mask = None if attention_mask is None else attention_mask[rows, :, :, :span]
            k, v = key.rows(rows, span), value.rows(rows, span)
            out[rows] = grouped_attention(module, query[rows], k, v, mask, dropout, scaling)[0]
        return out, None
    b, h, t, d = query.shape
    h_kv, s = key.shape[1], key.shape[2]
    g = h // h_kv
    mask = attention_mask
    if mask is None and t > 1:  # (a causal block over the last t keys)
        mask = torch.ones(t, s, dtype=torch.bool, device=query.device).tril(s - t)[None, None]
    if mask is not None and g > 1:
        mask = mask[:, :, None].expand(mask.shape[0], 1, g, t, s).reshape(mask.shape[0], 1, g * t, s)
    out = F.scaled_dot_product_attention(
        query.reshape(b, h_kv, g * t, d), key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )  # [B, H_kv, g*T, D]
    return out.reshape(b, h, t, d).transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_attention)


@contextmanager
def using(config):
    """Run the model of `config` on `grouped_attention` for the duration (its own attention after)."""
    previous = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = previous
