"""A slow reference decoder: every distribution recomputed from scratch, no caches, no engine.

It follows the decode cycle of DESIGN.md step by step and consumes randomness in the order the
engine documents (the drafter's stream for drafted tokens, the verifier's stream for the rewrite
or the verification), so that with the same seed it must produce exactly the engine's tokens.
"""

from __future__ import annotations

import torch

from viasd.config import GenerationParams, Mode, RegionB
from viasd.engine import request_seeds
from viasd.rules import Region, first_non_accept, gate, rule_from_params, verify
from viasd.runtime import LayerMask, MaskedLM
from viasd.sampling import Sampler


def _logits(lm: MaskedLM, seq: list[int], rows: int, mask: LayerMask | None = None) -> torch.Tensor:
    return lm.forward(torch.tensor(seq), 0, None, mask)[-rows:]  # [rows, V], no cache


def reference_decode(
    verifier: MaskedLM, drafter: MaskedLM | None, mask: LayerMask, prompt: list[int], params: GenerationParams
) -> list[int]:
    sampler = Sampler.from_params(params)
    draft_seed, verify_seed = request_seeds(params.seed)
    gen_p = torch.Generator().manual_seed(draft_seed)  # the drafter's stream
    gen = torch.Generator().manual_seed(verify_seed)  # the verifier's stream
    seq, out = list(prompt), []
    rule = rule_from_params(params)
    while len(out) < params.max_tokens:
        remaining = params.max_tokens - len(out)
        if params.mode == Mode.AR:
            new = [int(sampler.sample(sampler.probs(_logits(verifier, seq, 1)), gen)[0])]
        else:
            draft, p_rows = [], []
            for _ in range(min(params.gamma, remaining)):
                p = sampler.probs(_logits(drafter, seq + draft, 1))
                draft.append(int(sampler.sample(p, gen_p)[0]))
                p_rows.append(p)
            k, p = len(draft), torch.cat(p_rows)
            if params.mode == Mode.SD:
                q = sampler.probs(_logits(verifier, seq + draft, k + 1))
                v = verify(rule, p, q, torch.tensor(draft), gen)
                new = draft[: v.num_accepted] + [v.token]
            else:
                s = _logits(verifier, seq + draft, k + 1, mask)
                regions = gate(sampler.gate_probs(s[:k]), torch.tensor(draft), params.alpha1, params.alpha2,
                               rewrite=params.region_b == RegionB.REWRITE)
                i = first_non_accept(regions)
                if i == k:
                    new = list(draft)
                    if params.slim_bonus:
                        new.append(int(sampler.sample(sampler.probs(s[k:]), gen)[0]))
                elif regions[i] == Region.REWRITE:
                    new = draft[:i] + [int(sampler.sample(sampler.probs(s[i : i + 1]), gen)[0])]
                else:
                    q = sampler.probs(_logits(verifier, seq + draft, k + 1))
                    v = verify(rule, p[i:], q[i:], torch.tensor(draft[i:]), gen)
                    new = draft[: i + v.num_accepted] + [v.token]
        new = new[:remaining]
        seq += new
        out += new
    return out
