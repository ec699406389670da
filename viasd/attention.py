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

`MaskedLM` switches a model to it only for its own forwards (`using`), so transformers'
`generate` on the same modules keeps its own attention.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface

NAME = "viasd_grouped"


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
    -> ([B, T, H, D], None)."""
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
