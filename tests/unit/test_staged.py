"""The staged lossless rule (`via:rule=staged`): q' filters and corrects the draft, q verifies it.

* greedy staged == greedy ar token for token (float64), both cache policies, several gammas,
  with both stages rejecting at times;
* sampled: the first committed token and the second token's marginal follow q (chi-square over
  4,000 requests decoded 16 rows a step), and the same statistic rejects q' and p;
* the rule is refused outside mode `via`, naming the field.
(A request's output in a batch equals its output alone: tests/unit/test_batching.py, REQUESTS.)
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from viasd.config import parse_params
from viasd.engine import Engine
from viasd.errors import InvalidParameterError
from viasd.runtime import LayerMask

PROMPTS = [[5, 17, 3, 88, 41, 9], [1, 2, 3], [60] * 12]
SKIPPED = (1, 3)


def _engine(pair, policy="separate", **kw):
    verifier, drafter = pair
    return Engine(
        verifier, drafter, mask=LayerMask.from_skipped(SKIPPED, verifier.num_layers), cache_policy=policy, **kw
    )


@pytest.mark.parametrize("policy", ["separate", "shared"])
@pytest.mark.parametrize("gamma", [1, 3, 6])
def test_greedy_staged_equals_greedy_ar(tiny_pair, policy, gamma):
    engine = _engine(tiny_pair, policy)
    slim_rejected = full_rejected = full_accepted = 0
    for prompt in PROMPTS:
        ar = engine.complete(prompt, parse_params(mode="ar", max_tokens=40))
        staged = engine.complete(prompt, parse_params(mode="via", rule="staged", max_tokens=40, gamma=gamma))
        assert staged.token_ids == ar.token_ids
        st = staged.stats
        slim_rejected += st.slim_rewritten
        full_rejected += st.num_rejected_tokens
        full_accepted += st.full_accepted
        assert st.forwards["slim"] == st.forwards["full"] == st.num_drafts  # every cycle runs both stages
    assert slim_rejected > 0 and full_rejected > 0 and full_accepted > 0  # every path of both stages ran


def _chisq(counts: torch.Tensor, law: torch.Tensor) -> float:
    n = counts.sum()
    expected = law * n
    big = expected >= 5  # merge the small bins into one
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


def _two_token_laws(lm, prompt, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact law of the first token [V] and the marginal of the second [V] of `lm` (masked)."""
    first = torch.softmax(lm.forward(torch.tensor(prompt), 0, None, mask)[-1], -1)  # [V]
    second = torch.zeros_like(first)
    for x in range(lm.vocab_size):
        cond = torch.softmax(lm.forward(torch.tensor(prompt + [x]), 0, None, mask)[-1], -1)  # [V]
        second += first[x] * cond
    return first, second


def test_sampled_staged_follows_q(tiny_pair):
    """4,000 sampled staged requests, 16 rows a step: tokens 1 and 2 follow q, not q' nor p."""
    verifier, drafter = tiny_pair
    prompt = PROMPTS[0]
    engine = _engine(tiny_pair, max_batch=16)
    n = 4000
    handles = [
        engine.submit(prompt, parse_params(mode="via", rule="staged", gamma=3, max_tokens=2, temperature=1.0, seed=s))
        for s in range(n)
    ]
    while engine.scheduler.has_work():
        engine.step()
    tokens = torch.tensor([sum((c.token_ids for c in h.chunks), [])[:2] for h in handles])  # [n, 2]
    mask = LayerMask.from_skipped(SKIPPED, verifier.num_layers)
    q1, q2 = _two_token_laws(verifier, prompt)
    s1, s2 = _two_token_laws(verifier, prompt, mask)
    p1, p2 = _two_token_laws(drafter, prompt)
    for pos, (q, slim, p) in enumerate([(q1, s1, p1), (q2, s2, p2)]):
        counts = torch.bincount(tokens[:, pos], minlength=verifier.vocab_size).double()
        assert _chisq(counts, q) > 1e-3, pos
        assert _chisq(counts, slim) < 1e-6, pos
        assert _chisq(counts, p) < 1e-6, pos
    stats = [h.stats for h in handles]
    assert sum(s.slim_accepted for s in stats) > 0 and sum(s.slim_rewritten for s in stats) > 0
    assert sum(s.full_accepted for s in stats) > 0 and sum(s.num_rejected_tokens for s in stats) > 0


@pytest.mark.parametrize("mode", ["sd", "ar", "auto"])
def test_staged_needs_mode_via(mode):
    with pytest.raises(InvalidParameterError) as err:
        parse_params(mode=mode, rule="staged")
    assert err.value.field == "rule"
