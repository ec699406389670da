"""The full model's reference, computed once, and q'_z's log-probabilities under a cache policy.

Masks are scored under the cache policy the service uses (docs/ARCHITECTURE.md, "Caches"):

* separate: q' has its own cache of the kept layers, so q'_z over the text is one masked forward;
* shared:   q' writes into q's cache slots; older positions carry q's keys/values. Emulated as
            blocks of gamma + 1 positions [s, s + gamma + 1) (s a multiple of gamma + 1): q'_z
            attends to q's keys/values for positions < s and to its own for the block. One
            forward over the whole text does this with a [T, 2T] attention mask over
            [q's K/V ; q'_z's K/V] (`shared_policy_logits`; equal to the block-by-block loop).

The reference holds q's log-probabilities and, for `shared`, its keys/values; for e2e, the
drafter's greedy tokens. On a GPU everything a trial reads stays on the device: the token ids
on the verifier's input device (`Reference.inputs`), q's log-probabilities, argmaxes and the
drafter's tokens where the logits come out (the head's device), q's keys/values beside each
layer. A trial's forward then copies nothing from the host and waits for nothing
(`slim_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from viasd.dimr.calibration import Calibration
from viasd.errors import InvalidParameterError, MaskError
from viasd.runtime import LayerMask, MaskedLM


@dataclass
class Reference:
    """What every trial compares against, computed once."""

    tokens: list[Tensor]  # [T_i] long, one per calibration sequence (host)
    logq: list[Tensor]  # [T_i, V] log q_t, the full model's next-token log-probabilities
    qtop: list[Tensor]  # [T_i] argmax q_t (lowest id on ties)
    cache_policy: str = "separate"
    block: int = 6  # shared policy: q' block length (gamma + 1)
    kv: list[dict[int, tuple[Tensor, Tensor]]] | None = None  # shared: q's K/V per layer, [1, H_kv, T_i, D] each
    draft: list[Tensor] | None = None  # e2e: the drafter's greedy token at every position, [T_i]
    inputs: list[Tensor] | None = None  # the tokens on the verifier's input device, [T_i] (None: moved per use)

    @property
    def lengths(self) -> list[int]:
        return [int(t.shape[0]) for t in self.tokens]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def __repr__(self) -> str:
        return (
            f"Reference(sequences={len(self.tokens)}, tokens={self.num_tokens}, V={self.logq[0].shape[-1]}, "
            f"cache_policy={self.cache_policy!r}, drafter={'yes' if self.draft is not None else 'no'})"
        )


def build_reference(
    verifier: MaskedLM,
    calibration: Calibration,
    *,
    cache_policy: str = "separate",
    gamma: int = 5,
    drafter: MaskedLM | None = None,
) -> Reference:
    """Full-model log-probabilities (and K/V for `shared`, drafter tokens when a drafter is given),
    each on the device the verifier gives it (module docstring)."""
    if cache_policy not in ("separate", "shared"):
        raise InvalidParameterError("cache_policy", f"must be 'separate' or 'shared', got {cache_policy!r}")
    ref = Reference([], [], [], cache_policy=cache_policy, block=gamma + 1, inputs=[])
    if cache_policy == "shared":
        ref.kv = []
    if drafter is not None:
        if drafter.vocab_size != verifier.vocab_size:
            raise InvalidParameterError("drafter", "the drafter's vocabulary differs from the verifier's")
        ref.draft = []
    for seq in calibration.sequences:
        tok = torch.tensor(seq, dtype=torch.long)  # [T]
        cache = verifier.new_cache() if cache_policy == "shared" else None
        logits = verifier.forward(tok, 0, cache)  # [T, V]
        ref.tokens.append(tok)
        ref.inputs.append(tok.to(verifier.device))
        ref.logq.append(logits.log_softmax(-1))  # [T, V]
        ref.qtop.append(logits.argmax(-1))  # [T]
        if cache is not None:
            ref.kv.append({i: tuple(x.clone() for x in cache.kv(i)) for i in verifier.all_layers})
        if drafter is not None:
            ref.draft.append(drafter.forward(tok, 0).argmax(-1).to(logits.device))  # [T]
    return ref


class _PrefixKV:
    """Duck-typed cache for `shared_policy_logits`: layer l attends to [q's K/V ; this forward's K/V]."""

    def __init__(self, full_kv: dict[int, tuple[Tensor, Tensor]]):
        self.full_kv = full_kv

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        fk, fv = self.full_kv[layer_idx]  # [1, H_kv, T, D] each
        return torch.cat([fk, key], dim=2), torch.cat([fv, value], dim=2)  # [1, H_kv, 2T, D]


@torch.inference_mode()
def shared_policy_logits(
    lm: MaskedLM, tokens: Tensor, full_kv: dict[int, tuple[Tensor, Tensor]], mask: LayerMask, block: int
) -> Tensor:
    """Logits [T, V] of q'_z when q' shares q's cache: position i, in block s = block * (i // block),
    attends to q's keys/values at positions < s and to q'_z's own at positions s..i.

    Keys are [q's K/V for 0..T-1 ; q'_z's K/V for 0..T-1] ([1, H_kv, 2T, D]); the boolean attention
    mask [1, 1, T, 2T] picks the prefix from the first half and the block from the second. Equal
    to running q'_z block by block on a cache that holds q's keys/values for the prefix.
    """
    assert tokens.ndim == 1, f"tokens must be [T], got {tuple(tokens.shape)}"
    t = tokens.shape[0]
    dev = lm.device
    pos = torch.arange(t, device=dev)  # [T]
    start = (pos // block) * block  # [T] first position of each query's block
    see_full = pos[None, :] < start[:, None]  # [T, T] q's keys before the block
    see_slim = (pos[None, :] >= start[:, None]) & (pos[None, :] <= pos[:, None])  # [T, T] own keys in the block
    attn_mask = torch.cat([see_full, see_slim], dim=1)[None, None]  # [1, 1, T, 2T]
    positions = pos.unsqueeze(0)  # [1, T]
    hidden = lm.embed(tokens.to(dev).unsqueeze(0))  # [1, T, H]
    hidden = lm.run_layers(hidden, positions, attn_mask, _PrefixKV(full_kv), mask.kept)  # [1, T, H]
    return lm.head(hidden)  # [T, V]


@torch.inference_mode()
def separate_policy_logits(lm: MaskedLM, tokens: Tensor, mask: LayerMask) -> Tensor:
    """Logits [T, V] of q'_z over one sequence from position 0 with no cache: what
    `lm.forward(tokens, 0, None, mask)` returns (the same operations), from token ids already on
    the device: no host-to-device copy, so nothing waits for the device's queued work."""
    assert tokens.ndim == 1, f"tokens must be [T], got {tuple(tokens.shape)}"
    if mask.num_layers != lm.num_layers:
        raise MaskError(f"mask has {mask.num_layers} entries but the model has {lm.num_layers} layers")
    dev = lm.device
    t = tokens.shape[0]
    positions = torch.arange(t, device=dev)[None]  # [1, T]
    attn_mask = (positions[0][None, None, :] <= positions[:, :, None])[:, None] if t > 1 else None  # [1, 1, T, T]
    hidden = lm.embed(tokens.to(dev)[None])  # [1, T, H]
    hidden = lm.run_layers(hidden, positions, attn_mask, None, mask.kept)  # [1, T, H]
    return lm.head(hidden)  # [T, V]


def slim_logprobs(verifier: MaskedLM, ref: Reference, index: int, mask: LayerMask) -> Tensor:
    """log q'_z [T_i, V] over calibration sequence `index`, under the reference's cache policy,
    on the device the logits come out on (where `ref.logq` is)."""
    tok = ref.inputs[index] if ref.inputs is not None else ref.tokens[index]
    if ref.cache_policy == "shared":
        logits = shared_policy_logits(verifier, tok, ref.kv[index], mask, ref.block)
    else:
        logits = separate_policy_logits(verifier, tok, mask)  # [T, V]
    return logits.log_softmax(-1)
