"""Draft proposers and the block-length policy.

The drafter side of a request (`viasd.engine.DraftSession`) proposes each block with one of:

* ``model``  — the drafter p samples gamma tokens (the paper's drafter);
* ``ngram``  — prompt lookup (Saxena 2023; Hugging Face's ``prompt_lookup_num_tokens``): find the
  latest earlier occurrence of the sequence's last n tokens (n = ngram_max .. 1) and copy the
  tokens that followed it. No model runs; the proposal is deterministic, so its p is a point mass
  at each proposed token and the rules stay exact: the lossless rule accepts x with probability
  min(1, q(x) / 1) = q(x) and otherwise samples from norm(max(0, q - 1_x)), whose mixture is q;
* ``hybrid`` — the n-gram proposal when the context has a match, the model's otherwise.

Both adaptive-drafting policies only shorten blocks, which keeps the rules exact: whether a
block stops early depends only on the drafter's own distribution, and each verified position is
still one speculative-sampling step from the committed prefix.
"""

from __future__ import annotations

from collections.abc import Sequence


def ngram_lookup(seq: Sequence[int], k: int, ngram_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of seq's last n tokens.

    Tries n = ngram_max, ..., 1 and takes the first n with a match; among matches, the latest
    (closest to the end) wins, since recent context predicts best. Matches must end before the
    suffix itself starts, so the copied tokens are real context, never the suffix again.
    Returns [] when nothing matches.
    """
    length = len(seq)
    for n in range(min(ngram_max, length - 1), 0, -1):
        suffix = list(seq[length - n :])
        first = suffix[0]
        # candidate starts i: seq[i:i+n] == suffix, i + n < length (something follows), i < length - n
        for i in range(length - n - 1, -1, -1):
            if seq[i] == first and list(seq[i : i + n]) == suffix:
                return list(seq[i + n : i + n + k])
    return []


class GammaPolicy:
    """The block length of one request.

    Fixed: always ``gamma``. Adaptive (``adaptive_gamma``; the heuristic Hugging Face's assisted
    generation uses for its assistant): start at gamma; after a block whose draft tokens were all
    accepted, g <- min(gamma, g + 2); after a block with a rejection, g <- max(1, g - 1). The
    request's gamma is the bound, so a client that allows 8 gets at most 8.
    """

    def __init__(self, gamma: int, adaptive: bool):
        self.gamma = gamma
        self.adaptive = adaptive
        self.current = gamma

    def length(self, k: int) -> int:
        """Tokens to draft when the caller allows k (its cut to gamma, the budget and the context)."""
        return min(k, self.current) if self.adaptive else k

    def update(self, drafted: int, accepted: int) -> None:
        """Record a verified block of `drafted` tokens of which `accepted` were committed as drafted."""
        if not self.adaptive or drafted == 0:
            return
        self.current = min(self.gamma, self.current + 2) if accepted == drafted else max(1, self.current - 1)
