"""The engine on a real model: SmolLM2-135M-Instruct (LLaMA architecture) from its PyPI package.

Run in float64 (upcast from the float32 conversion) so that exactness is not at the mercy of
ties between batched and step-by-step forwards (docs/ARCHITECTURE.md, "Exactness and precision").
"""

from __future__ import annotations

import pytest
import torch
from reference import physically_removed

from viasd.config import parse_params
from viasd.engine import Engine
from viasd.runtime import LayerMask, MaskedLM

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol():
    from viasd.models import embedded
    from viasd.models.loader import load_causal_lm

    if not embedded.is_installed(embedded.TEST_MODEL):
        pytest.fail(f"install the test model first: {' '.join(embedded.install_command(embedded.TEST_MODEL))}")
    model, tokenizer = load_causal_lm(embedded.TEST_MODEL, dtype="float32")
    return model.double(), tokenizer


PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def test_masked_smollm2_equals_physically_removed_layers(smol):
    model, tok = smol
    lm = MaskedLM(model)
    assert model.config.model_type == "llama" and lm.num_layers == 30
    x = torch.tensor(tok.encode(PROMPT))
    assert torch.equal(lm.forward(x, 0).argmax(-1), model(x[None]).logits[0].argmax(-1))
    torch.testing.assert_close(lm.forward(x, 0), model(x[None]).logits[0], rtol=1e-9, atol=1e-9)
    mask = LayerMask.evenly_spaced(0.45, lm.num_layers)
    ref = physically_removed(model, mask)(x[None]).logits[0]
    torch.testing.assert_close(lm.forward(x, 0, mask=mask), ref, rtol=1e-9, atol=1e-9)


def test_greedy_sd_and_via_on_smollm2(smol):
    model, tok = smol
    verifier = MaskedLM(model)
    # a real drafter with the same vocabulary: SmolLM2 with 10 of its 30 layers removed
    drafter = MaskedLM(physically_removed(model, LayerMask.from_skipped(range(5, 25, 2), 30)))
    engine = Engine(verifier, drafter, mask=LayerMask.evenly_spaced(0.3, 30), eos_token_ids=[])
    prompt = tok.encode(PROMPT)
    ar = engine.complete(prompt, parse_params(mode="ar", max_tokens=32))
    sd = engine.complete(prompt, parse_params(mode="sd", max_tokens=32, gamma=4))
    assert sd.token_ids == ar.token_ids
    assert sd.stats.num_accepted_tokens > 0 and sd.stats.forwards["full"] < ar.stats.forwards["full"]
    # HF generate agrees with our ar on the real model
    hf = model.generate(
        torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=tok.eos_token_id
    )[0, len(prompt) :].tolist()
    assert ar.token_ids == hf
    via = engine.complete(prompt, parse_params(mode="via", max_tokens=32, gamma=4))
    assert via.stats.slim_accepted > 0 and len(via.token_ids) == 32
