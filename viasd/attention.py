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

`MaskedLM` switches a model to it only for its own forwards (`using`), so transformers'
`generate` on the same modules keeps its own attention.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface

NAME = "viasd_grouped"


@dataclass(frozen=True)
class PagedKV:
    """One layer's keys (or values) of a forward over a paged cache, not gathered yet."""

    pool: Tensor  # [slots, H_kv, D]
    read: Tensor  # [B, S]: the slot of each row's positions (the zero block past its span)
    buckets: tuple[tuple[Tensor | None, int], ...]  # (rows [b] or None: all, their longest span S_b): span_buckets

    def rows(self, rows: Tensor | None, span: int) -> Tensor:
        """The keys of `rows` (all: None) up to `span`, [b, H_kv, span, D] (a gathered copy)."""
        read = self.read[:, :span] if rows is None else self.read[rows, :span]
        return self.pool[read].transpose(1, 2)


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
