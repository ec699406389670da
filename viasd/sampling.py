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
import itertools
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


def sample_rows(probs: Tensor, greedy: Sequence[bool], generators: Sequence[torch.Generator | None]) -> Tensor:
    """Draw one token per row of `probs` [N, V] (rows need not be normalised) -> [N] long, on the device.

    Greedy rows take argmax_v probs[n, v] (the lowest id on ties) and draw nothing. Every other row
    draws one uniform u ~ U[0, 1) (float64) from its own generator and takes `inverse_cdf` at it.
    Consecutive rows with the same generator draw their uniforms in one call, in row order, so a
    request's stream does not depend on the rows around it.
    """
    assert probs.ndim == 2 and len(greedy) == len(generators) == probs.shape[0], (tuple(probs.shape), len(greedy))
    token = probs.argmax(dim=-1)  # [N]
    sampled = [i for i, g in enumerate(greedy) if not g]
    if not sampled:
        return token
    u = uniforms([generators[i] for i in sampled], [1] * len(sampled), probs.device)  # [M]
    return token.index_copy(0, torch.tensor(sampled, device=probs.device), inverse_cdf(probs[sampled], u))


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """The token each row of `probs` [N, V] (unnormalised, >= 0, some mass) puts at u [N] in [0, 1):
    the first v with cdf_v > u * cdf_{V-1}, cdf = cumsum(probs[n]) in float64, so a token of
    probability 0 is never drawn -> [N] long. Row by row: a row's token does not depend on the
    rows beside it (the cumulative sum runs along each row), so a row drawn alone elsewhere (the
    drafter's probability-only correction, viasd.rules.correct_rows) gets the same token."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)  # [N, V]
    total = cdf[:, -1]  # [N]
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # [N] < total, even rounded
    return torch.searchsorted(cdf, x[:, None], right=True)[:, 0]  # [N] the first v with cdf_v > x: mass > 0


def uniforms(generators: Sequence[torch.Generator | None], counts: Sequence[int], device) -> Tensor:
    """`counts[i]` uniforms U[0, 1) (float64) from each `generators[i]` in order (consecutive equal
    generators in one call) -> [sum counts]; an empty tensor when there are none."""
    pairs = [(g, n) for g, n in zip(generators, counts) if n]
    parts, i = [], 0
    while i < len(pairs):
        j, total = i, 0
        while j < len(pairs) and pairs[j][0] is pairs[i][0]:
            total, j = total + pairs[j][1], j + 1
        parts.append(torch.rand(total, generator=pairs[i][0], dtype=torch.float64, device=device))
        i = j
    if not parts:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def batch_probs(logits: Tensor, samplers: Sequence[Sampler]) -> Tensor:
    """[N, V] logits, one `Sampler` per row -> [N, V] probabilities (float64 if the logits are, else
    float32): `Sampler.probs` of every row at once, each filter applied only when some row asks
    for it, with per-row parameters as tensors on the logits' device (see `Sampler.probs`)."""
    assert logits.ndim == 2 and len(samplers) == logits.shape[0], (tuple(logits.shape), len(samplers))
    dtype, vocab, dev = _work_dtype(logits), logits.shape[-1], logits.device
    greedy = [s.greedy for s in samplers]
    if all(greedy):
        return one_hot_argmax(logits, dtype)  # [N, V]

    def column(values, kind=dtype) -> Tensor:
        return torch.tensor(values, dtype=kind, device=dev)[:, None]  # [N, 1]

    z = logits.to(dtype) / column([s.temperature or 1.0 for s in samplers])  # [N, V]
    if any(0 < s.top_k < vocab for s in samplers):
        ks = [s.top_k if 0 < s.top_k < vocab else 0 for s in samplers]
        top = torch.topk(z, max(ks), dim=-1).values  # [N, k_max]
        kth = top.gather(-1, column([max(k - 1, 0) for k in ks], torch.long))  # [N, 1]
        kth = torch.where(column([k > 0 for k in ks], torch.bool), kth, float("-inf"))
        z = z.masked_fill(z < kth, float("-inf"))
    if any(s.top_p < 1.0 for s in samplers):
        ranked, order = torch.sort(torch.softmax(z, dim=-1), dim=-1, descending=True, stable=True)  # [N, V] x2
        before = torch.cumsum(ranked, dim=-1) - ranked  # [N, V] mass strictly above each rank
        off = column([s.top_p >= 1.0 for s in samplers], torch.bool)  # [N, 1] rows that keep everything
        keep_sorted = (before < column([s.top_p for s in samplers])) | off
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)  # [N, V]; rank 0 always kept
        z = z.masked_fill(~keep, float("-inf"))
    if any(s.min_p > 0.0 for s in samplers):
        pr = torch.softmax(z, dim=-1)  # [N, V]
        z = z.masked_fill(pr < column([s.min_p for s in samplers]) * pr.amax(dim=-1, keepdim=True), float("-inf"))
    probs = torch.softmax(z, dim=-1)  # [N, V]
    if any(greedy):
        probs = torch.where(column(greedy, torch.bool), one_hot_argmax(logits, dtype), probs)
    return probs


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
        return batch_probs(logits, [self] * logits.shape[0])

    def gate_probs(self, logits: Tensor) -> Tensor:
        """[T, V] -> [T, V]: the distribution the three-tier gate reads (rules.gate).

        The same processing as `probs`, but at temperature 1 when greedy: a one-hot q' would make
        the gate ratio r = q'(x) / max q' either 0 or 1 and the thresholds meaningless.
        """
        return self.for_gate.probs(logits)

    @property
    def for_gate(self) -> Sampler:
        """This sampler at temperature 1 when greedy (`gate_probs`)."""
        return dataclasses.replace(self, temperature=self.temperature or 1.0)

    def sample(self, probs: Tensor, generator: torch.Generator | None) -> Tensor:
        """[T, V] probs -> [T] long (`sample_rows`): argmax when greedy (no randomness consumed),
        else one uniform per row from `generator`, inverted through the row's CDF."""
        assert probs.ndim == 2, f"probs must be [T, V], got {tuple(probs.shape)}"
        rows = probs.shape[0]
        return sample_rows(probs, [self.greedy] * rows, [generator] * rows)


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

    def __call__(
        self, logits: Tensor, seq: Sequence[int], block: Sequence[int] | Tensor = (), first: int = 0
    ) -> Tensor:
        """logits [T, V] of the rows after seq + block[:first + t] (t = 0..T-1) -> processed [T, V]."""
        assert logits.ndim == 2, f"logits must be [T, V], got {tuple(logits.shape)}"
        return penalise_rows(logits, [Penalised(self, seq, block, first)], [logits.shape[0]])


@dataclass(frozen=True)
class Penalised:
    """What the rows of one request's logits follow, for its `Penalties`: row t comes after
    seq + block[:first + t]. `block` may be a list or a device tensor (drafted tokens; never read)."""

    penalties: Penalties
    seq: Sequence[int]
    block: Sequence[int] | Tensor = ()
    first: int = 0


def penalise_rows(logits: Tensor, contexts: Sequence[Penalised | None], sizes: Sequence[int]) -> Tensor:
    """`Penalties` of many requests at once: logits [N, V], request i owning the next sizes[i] rows,
    processed as `contexts[i]` says (None: unchanged) -> [N, V] in float32 (float64 for float64
    logits), a new tensor. The counts c of every penalised row are built with one scatter of the
    requests' output tokens and one of their drafted ones, on the device."""
    assert len(contexts) == len(sizes) and sum(sizes) == logits.shape[0], (len(contexts), list(sizes))
    z = logits.to(_work_dtype(logits))  # [N, V]
    starts = [0, *itertools.accumulate(sizes)][:-1]
    owned = [(c, s, n) for c, s, n in zip(contexts, starts, sizes) if c is not None and n]
    if not owned:
        return z
    dev, vocab = z.device, z.shape[-1]
    rows = torch.tensor([s + t for _, s, n in owned for t in range(n)], device=dev)  # [P] the penalised rows
    w = z[rows]  # [P, V]

    def per_row(values, dtype=z.dtype) -> Tensor:  # one value per request -> [P, 1]
        return torch.tensor([v for v, (_, _, n) in zip(values, owned) for _ in range(n)], dtype=dtype, device=dev)[
            :, None
        ]

    biased = [(i, c.penalties.bias) for i, (c, _, _) in enumerate(owned) if c.penalties.bias is not None]
    if biased:
        bias = torch.zeros(len(owned), vocab, dtype=z.dtype, device=dev)  # [A, V]
        bias[torch.tensor([i for i, _ in biased], device=dev)] = torch.stack([b.to(z.dtype) for _, b in biased])
        w = w + bias[_request_of_row(owned, dev)]
    if any(c.penalties.counting for c, _, _ in owned):
        c = _output_counts(owned, dev, vocab).to(z.dtype)  # [P, V]
        seen = c > 0  # [P, V]
        pen = [c_.penalties for c_, _, _ in owned]
        rp = per_row([x.repetition for x in pen])  # [P, 1] (1 leaves a row as it is)
        in_prompt = torch.stack([x.in_prompt for x in pen])[_request_of_row(owned, dev)]  # [P, V]
        w = torch.where(seen | in_prompt, torch.where(w > 0, w / rp, w * rp), w)
        w = w - per_row([x.frequency for x in pen]) * c - per_row([x.presence for x in pen]) * seen.to(z.dtype)
    return z.index_copy(0, rows, w)


def _request_of_row(owned: list, device) -> Tensor:
    """[P] long: the request (index into `owned`) of every penalised row (an index built on the
    host: no repeat_interleave, whose output size the device would have to report)."""
    return torch.tensor([i for i, (_, _, n) in enumerate(owned) for _ in range(n)], device=device)


def _output_counts(owned: list, device, vocab: int) -> Tensor:
    """c [P, V]: row t of each (context, start, n) counts the output of its seq (past the prompt)
    and block[:first + t]; one scatter of the outputs' host tokens (once per request, then
    repeated over its rows), one of the blocks' device tokens."""
    asks, host_tokens, block_rows, block_pos, blocks = [], [], [], [], []
    row, offset = 0, 0
    for i, (ctx, _, n) in enumerate(owned):
        out = list(ctx.seq[ctx.penalties.prompt_len :])
        asks += [i] * len(out)
        host_tokens += out
        block = ctx.block if isinstance(ctx.block, Tensor) else torch.tensor(list(ctx.block), dtype=torch.long)
        for t in range(n):
            seen = min(ctx.first + t, block.shape[0])
            block_rows += [row + t] * seen
            block_pos += range(offset, offset + seen)
        blocks.append(block.to(device))
        row, offset = row + n, offset + block.shape[0]
    base = torch.zeros(len(owned), vocab, dtype=torch.long, device=device)  # [A, V]
    if host_tokens:
        index = (torch.tensor(asks, device=device), torch.tensor(host_tokens, dtype=torch.long, device=device))
        base.index_put_(index, torch.ones(len(host_tokens), dtype=torch.long, device=device), accumulate=True)
    c = base[_request_of_row(owned, device)]  # [P, V]
    if block_pos:
        tokens = torch.cat(blocks)[torch.tensor(block_pos, device=device)]  # [Q] on the device
        index = (torch.tensor(block_rows, device=device), tokens)
        c.index_put_(index, torch.ones(len(block_pos), dtype=torch.long, device=device), accumulate=True)
    return c


def token_logprobs(logits: Tensor, tokens: Sequence[int], k: int, tier: str = "full") -> list[TokenLogprob]:
    """logits [T, V] (row t: the distribution token t was drawn from), tokens [T] -> T entries:
    log softmax(logits_t)[tokens_t] and the top k (token, logprob) pairs of row t."""
    return batch_logprobs([(logits, tokens, k, tier)])[0]


def batch_logprobs(parts: Sequence[tuple[Tensor, Sequence[int], int, str]]) -> list[list[TokenLogprob]]:
    """`token_logprobs` of many (logits [T_i, V], tokens [T_i], k_i, tier_i) at once, with one read
    of the host for all of them."""
    for logits, tokens, _, _ in parts:
        assert logits.ndim == 2 and logits.shape[0] == len(tokens), (tuple(logits.shape), len(tokens))
    rows = torch.cat([lg.to(torch.float64 if lg.dtype == torch.float64 else torch.float32) for lg, *_ in parts])
    lp = torch.log_softmax(rows, dim=-1)  # [N, V]
    ids = torch.tensor([t for _, tokens, _, _ in parts for t in tokens], dtype=torch.long, device=lp.device)  # [N]
    chosen = lp.gather(-1, ids[:, None])[:, 0]  # [N]
    width = max(k for _, _, k, _ in parts)
    top_v, top_i = lp.topk(width, dim=-1) if width > 0 else (lp[:, :0], lp[:, :0].long())  # [N, width] x2
    # one read: ids are exact in float64
    flat = torch.cat([chosen.double(), top_v.double().flatten(), top_i.double().flatten()]).tolist()
    n = len(ids)
    out, row = [], 0
    for _, tokens, k, tier in parts:
        entries = []
        for t in tokens:
            values = flat[n + row * width : n + row * width + k]
            indices = flat[n + n * width + row * width : n + n * width + row * width + k]
            entries.append(TokenLogprob(int(t), flat[row], [(int(i), v) for i, v in zip(indices, values)], tier))
            row += 1
        out.append(entries)
    return out
