"""Logits processing and sampling, shared by the drafter p, the slim verifier q' and the full verifier q.

All three tiers turn logits into probabilities with the same `Sampler`, so the distributions that
speculative verification compares (p against q) are the distributions tokens are sampled from.
The processing follows Hugging Face's logits warpers, in their order:

    temperature -> top-k -> top-p (nucleus) -> min-p -> renormalise

Masked tokens get probability exactly 0 (their logits become -inf before the final softmax).
Temperature 0 means greedy: the distribution is one-hot at the argmax.

References: Holtzman et al. 2020 (nucleus sampling); Nguyen et al. 2024 (min-p sampling).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from viasd.errors import InvalidParameterError

if TYPE_CHECKING:
    from viasd.config import GenerationParams


def _work_dtype(t: Tensor) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, fp32) is processed in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def one_hot_argmax(logits: Tensor, dtype: torch.dtype) -> Tensor:
    """One-hot distribution at argmax_v logits[t, v]; ties go to the LOWEST token id.

    torch.argmax returns the first maximal index, which is the lowest id: greedy decoding is
    therefore deterministic and the same on every tier.
    """
    assert logits.ndim == 2, f"logits must be [T, V], got {tuple(logits.shape)}"
    idx = logits.argmax(dim=-1, keepdim=True)  # [T, 1]
    out = torch.zeros(logits.shape, dtype=dtype, device=logits.device)  # [T, V]
    return out.scatter_(-1, idx, 1.0)


def sample_probs(probs: Tensor, generator: torch.Generator | None) -> Tensor:
    """Draw one token per row of `probs`: v_t ~ probs[t] (rows need not be normalised).

    When every row is one-hot (exactly one non-zero entry, as in greedy decoding) the result is
    argmax and no randomness is consumed; otherwise one `torch.multinomial` call over all rows.
    """
    assert probs.ndim == 2, f"probs must be [T, V], got {tuple(probs.shape)}"
    if bool(((probs > 0).sum(dim=-1) == 1).all()):
        return probs.argmax(dim=-1)  # [T]
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # [T]


@dataclass(frozen=True)
class Sampler:
    """Turns logits into the sampling distribution, and samples from it."""

    temperature: float = 0.0  # 0 = greedy (argmax, lowest id on ties)
    top_k: int = 0  # keep the k most likely tokens (ties at the k-th value kept); 0 disables
    top_p: float = 1.0  # keep the smallest most-likely prefix with mass >= top_p; 1 disables
    min_p: float = 0.0  # drop tokens with prob < min_p * max prob; 0 disables

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise InvalidParameterError("temperature", f"must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidParameterError("top_k", f"must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameterError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p < 1.0:
            raise InvalidParameterError("min_p", f"must be in [0, 1), got {self.min_p}")

    @classmethod
    def from_params(cls, params: GenerationParams) -> "Sampler":
        """The sampler a request asks for."""
        return cls(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: Tensor) -> Tensor:
        """[T, V] logits -> [T, V] probabilities (float64 if the logits are, else float32).

        Greedy: one-hot at argmax (lowest id on ties). Otherwise, with z = logits / temperature:
          top-k:  keep v iff z_v >= k-th largest z (ties at the k-th value are all kept);
          top-p:  with s = softmax(z) sorted descending (stable: lower id first among ties),
                  keep rank i iff sum_{j<i} s_j < top_p (smallest prefix with mass >= top_p; the
                  top token is always kept);
          min-p:  keep v iff softmax(z)_v >= min_p * max_u softmax(z)_u;
        each filter reading the distribution renormalised over what the previous ones kept, then
        probs = softmax(z with dropped tokens at -inf), so dropped tokens are exactly 0.
        """
        assert logits.ndim == 2, f"logits must be [T, V], got {tuple(logits.shape)}"
        dtype = _work_dtype(logits)
        if self.greedy:
            return one_hot_argmax(logits, dtype)  # [T, V]
        z = logits.to(dtype) / self.temperature  # [T, V]
        vocab = z.shape[-1]
        if 0 < self.top_k < vocab:
            kth = torch.topk(z, self.top_k, dim=-1).values[:, -1:]  # [T, 1]
            z = z.masked_fill(z < kth, float("-inf"))
        if self.top_p < 1.0:
            s, order = torch.sort(torch.softmax(z, dim=-1), dim=-1, descending=True, stable=True)  # [T, V] x2
            before = torch.cumsum(s, dim=-1) - s  # [T, V] mass strictly above each rank
            keep_sorted = before < self.top_p  # [T, V]; rank 0 has before = 0 < top_p: always kept
            keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)  # [T, V]
            z = z.masked_fill(~keep, float("-inf"))
        if self.min_p > 0.0:
            pr = torch.softmax(z, dim=-1)  # [T, V]
            z = z.masked_fill(pr < self.min_p * pr.amax(dim=-1, keepdim=True), float("-inf"))
        return torch.softmax(z, dim=-1)  # [T, V]

    def gate_probs(self, logits: Tensor) -> Tensor:
        """[T, V] -> [T, V]: the distribution the three-tier gate reads (rules.gate).

        The same processing as `probs`, but at temperature 1 when greedy: a one-hot q' would make
        the gate ratio r = q'(x) / max q' either 0 or 1 and the thresholds meaningless.
        """
        return dataclasses.replace(self, temperature=self.temperature or 1.0).probs(logits)

    def sample(self, probs: Tensor, generator: torch.Generator | None) -> Tensor:
        """[T, V] probs -> [T] long: argmax when greedy (no randomness consumed), else
        torch.multinomial(probs, 1, generator). The same generator state gives the same tokens."""
        assert probs.ndim == 2, f"probs must be [T, V], got {tuple(probs.shape)}"
        if self.greedy:
            return probs.argmax(dim=-1)  # [T]
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # [T]
