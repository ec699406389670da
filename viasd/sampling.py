"""Logits processing and sampling, shared by the drafter p, the slim verifier q' and the full verifier q.

All three tiers turn logits into probabilities with the same `Sampler`, so the distributions that
speculative verification compares (p against q) are the distributions tokens are sampled from.
The processing follows Hugging Face's logits warpers, in their order:

    temperature -> top-k -> top-p (nucleus) -> min-p -> renormalise

Masked tokens get probability exactly 0 (their logits become -inf before the final softmax).
Temperature 0 means greedy: the distribution is one-hot at the argmax.

Before the sampler, `Penalties` (logit_bias, presence / frequency / repetition penalties) turn
the raw logits of a row into the logits the request samples from, conditioned on the tokens
before that row. Logprobs (`token_logprobs`) are read from the raw logits, as vLLM's default.

References: Holtzman et al. 2020 (nucleus sampling); Nguyen et al. 2024 (min-p sampling);
Keskar et al. 2019 (CTRL's repetition penalty).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from viasd.errors import InvalidParameterError
from viasd.metrics import TokenLogprob

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
    def from_params(cls, params: GenerationParams) -> Sampler:
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


class Penalties:
    """logit_bias and the presence / frequency / repetition penalties of one request (vLLM /
    OpenAI semantics), applied to raw logits before the `Sampler`.

    A row's context is the prompt P and the output O before it: the committed generated tokens,
    then the draft tokens before that row (a block's row t sees draft[:t]). With c_v the number
    of times token v occurs in O:

        z_v = logits_v + bias_v                                        logit_bias
        z_v = z_v / rp  if z_v > 0,  z_v * rp  otherwise, for v in P or O   repetition (rp)
        z_v = z_v - frequency * c_v - presence * 1[c_v > 0]               frequency, presence

    in this order (vLLM's: bias, then repetition, frequency, presence). The same processing turns
    the drafter's p, the slim verifier's q' and the full verifier's q rows into the distributions
    the rules compare, each conditioned on the same prefix, so the lossless rule still outputs
    exactly the penalised q (the rule needs only that q_t is the target law given the prefix that
    row t follows). Rows are processed in float64 for float64 logits, else float32.
    """

    def __init__(self, params: GenerationParams, prompt: Sequence[int], vocab_size: int, device):
        self.presence, self.frequency, self.repetition = (
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
        )
        self.prompt_len = len(prompt)
        self.vocab_size, self.device = vocab_size, device
        self.bias: Tensor | None = None  # [V] float64, moved to the logits' dtype per call
        if params.logit_bias:
            self.bias = torch.zeros(vocab_size, dtype=torch.float64)
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            self.bias[ids] = torch.tensor(list(params.logit_bias.values()), dtype=torch.float64)
            self.bias = self.bias.to(device)
        self.counting = self.presence != 0.0 or self.frequency != 0.0 or self.repetition != 1.0
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V]
        if self.repetition != 1.0:
            self.in_prompt[torch.tensor(list(prompt), dtype=torch.long, device=device)] = True

    @classmethod
    def for_request(cls, params: GenerationParams, prompt: Sequence[int], vocab_size: int, device) -> Penalties | None:
        """The request's processor, or None when nothing changes the logits (the default path)."""
        return cls(params, prompt, vocab_size, device) if params.penalised else None

    def counts(self, seq: Sequence[int], block: Sequence[int], rows: int) -> Tensor:
        """c[t, v]: occurrences of v in the output of seq (past the prompt) + block[:t]: [rows, V]."""
        out = torch.tensor(list(seq[self.prompt_len :]), dtype=torch.long, device=self.device)  # [n_out]
        base = torch.bincount(out, minlength=self.vocab_size)  # [V]
        c = base.expand(rows, -1).clone()  # [rows, V]
        if rows > 1 and block:
            steps = torch.tensor(list(block[: rows - 1]), dtype=torch.long, device=self.device)  # [rows - 1]
            c[1:] += torch.nn.functional.one_hot(steps, self.vocab_size).cumsum(dim=0)  # [rows - 1, V]
        return c

    def __call__(self, logits: Tensor, seq: Sequence[int], block: Sequence[int] = ()) -> Tensor:
        """logits [T, V] of the rows after seq + block[:t] (t = 0..T-1) -> processed [T, V]."""
        assert logits.ndim == 2, f"logits must be [T, V], got {tuple(logits.shape)}"
        assert len(block) >= logits.shape[0] - 1, "row t needs the t block tokens before it"
        z = logits.to(_work_dtype(logits))  # [T, V]
        if self.bias is not None:
            z = z + self.bias.to(z.dtype)
        if not self.counting:
            return z
        c = self.counts(seq, block, z.shape[0]).to(z.dtype)  # [T, V]
        seen = c > 0  # [T, V]
        if self.repetition != 1.0:
            z = torch.where(seen | self.in_prompt, torch.where(z > 0, z / self.repetition, z * self.repetition), z)
        return z - self.frequency * c - self.presence * seen.to(z.dtype)


def token_logprobs(logits: Tensor, tokens: Sequence[int], k: int, tier: str = "full") -> list[TokenLogprob]:
    """logits [T, V] (row t: the distribution token t was drawn from), tokens [T] -> T entries:
    log softmax(logits_t)[tokens_t] and the top k (token, logprob) pairs of row t."""
    assert logits.ndim == 2 and logits.shape[0] == len(tokens), (tuple(logits.shape), len(tokens))
    lp = torch.log_softmax(logits.to(_work_dtype(logits)), dim=-1)  # [T, V]
    ids = torch.tensor(list(tokens), dtype=torch.long, device=lp.device)  # [T]
    chosen = lp.gather(-1, ids[:, None])[:, 0].tolist()  # [T]
    top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())  # [T, k] x2
    return [
        TokenLogprob(int(t), float(c), list(zip(i, v)), tier)
        for t, c, i, v in zip(tokens, chosen, top_i.tolist(), top_v.tolist())
    ]
