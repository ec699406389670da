"""Masked execution equals physically removed layers; cached decoding equals one full forward."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from reference import physically_removed

from viasd.errors import MaskError, ModelLoadError
from viasd.runtime import LayerMask, MaskedLM, SlotKVCache

MASKS = [(), (0,), (2, 3), (0, 2, 4), (1, 2, 3, 4), (5,)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_all_ones_mask_equals_hf_logits(arch):
    model = tiny_model(arch)
    x = torch.randint(0, model.config.vocab_size, (1, 23), generator=torch.Generator().manual_seed(0))
    ref = model(x).logits[0]  # [T, V]
    lm = MaskedLM(model)
    assert torch.equal(lm.forward(x[0], 0), ref)
    assert torch.equal(lm.forward(x[0], 0, mask=LayerMask.full(lm.num_layers)), ref)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("skipped", MASKS)
def test_mask_equals_physically_removed_layers(arch, skipped):
    model = tiny_model(arch)
    mask = LayerMask.from_skipped(skipped, model.config.num_hidden_layers)
    x = torch.randint(0, model.config.vocab_size, (1, 19), generator=torch.Generator().manual_seed(1))
    ref = physically_removed(model, mask)(x).logits[0]
    out = MaskedLM(model).forward(x[0], 0, mask=mask)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    if skipped:  # and the mask matters: it is not the full model
        assert (out - model(x).logits[0]).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("skipped", [(), (0, 2), (1, 3, 4)])
def test_cached_step_by_step_equals_full_forward(arch, skipped):
    model = tiny_model(arch)
    lm = MaskedLM(model)
    mask = LayerMask.from_skipped(skipped, lm.num_layers)
    x = torch.randint(0, lm.vocab_size, (40,), generator=torch.Generator().manual_seed(2))
    full = lm.forward(x, 0, mask=mask)  # [40, V]
    cache = lm.new_cache(mask)
    pieces, pos = [], 0
    for size in (7, 1, 1, 5, 1, 13, 1, 11):  # prefill, single steps and blocks
        pieces.append(lm.forward(x[pos : pos + size], pos, cache, mask))
        pos += size
    torch.testing.assert_close(torch.cat(pieces), full, rtol=0, atol=1e-10)
    # skipped layers ran nowhere and wrote nothing
    assert set(cache.layers) == set(mask.kept)
    assert all(cache.length(i) == 40 for i in mask.kept)


def test_rollback_per_layer_then_recompute():
    model = tiny_model("llama")
    lm = MaskedLM(model)
    x = torch.randint(0, lm.vocab_size, (30,), generator=torch.Generator().manual_seed(3))
    full = lm.forward(x, 0)
    cache = lm.new_cache()
    lm.forward(x[:20], 0, cache)
    lm.forward(torch.randint(0, lm.vocab_size, (6,)), 20, cache)  # a rejected block
    cache.crop(20)
    out = lm.forward(x[20:], 20, cache)
    torch.testing.assert_close(out, full[20:], rtol=0, atol=1e-10)
    # crop of some layers only, then a forward that expects them aligned is refused
    cache.crop(10, layers=[0, 1])
    with pytest.raises(RuntimeError, match="not at position"):
        lm.forward(x[10:12], 10, cache)


def test_mask_validation():
    with pytest.raises(MaskError, match="6 layers"):
        LayerMask.from_z([1, 0, 1], 6)
    with pytest.raises(MaskError, match="0 .skip. or 1"):
        LayerMask.from_z([1, 2, 1, 1, 1, 1], 6)
    with pytest.raises(MaskError, match="out of range"):
        LayerMask.from_skipped([6], 6)
    m = LayerMask.evenly_spaced(0.45, 28)
    assert len(m.skipped) == round(0.45 * 28) and m.keep[0] and m.keep[-1]
    model = MaskedLM(tiny_model("llama"))
    with pytest.raises(MaskError, match="mask has 5 entries"):
        model.forward(torch.tensor([1, 2]), 0, mask=LayerMask.full(5))
    with pytest.raises(MaskError):
        SlotKVCache([0, 7], 6)


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(ModelLoadError, match="gpt2"):
        MaskedLM(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)))


def test_a_row_copies_into_storage_a_forward_allocated():
    """n > 1 samples copy their leader's prefilled row, outside inference mode, into storage a
    forward allocated (an inference tensor): the copy must work and equal the source."""
    from viasd.runtime import Row

    lm = MaskedLM(tiny_model("llama"))
    store = lm.new_store(max_rows=4)
    a, _, c, d = store.alloc(), store.alloc(), store.alloc(), store.alloc()
    lm.forward_batch([Row([5, 6, 7, 8], 0, 1, a), Row([9, 10], 0, 1, d)], store)  # storage for rows 0..3
    store.copy_row(a, c, 3)  # (into that storage: it does not grow)
    for layer in store.layers:
        assert store.length(c, layer) == 3
        assert torch.equal(store.kv(c, layer)[0], store.kv(a, layer)[0][:, :, :3])


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (8, 1), (6, 2)])
@pytest.mark.parametrize("t, masked", [(1, False), (1, True), (5, True), (5, False)])
def test_grouped_attention_equals_transformers_sdpa(heads, kv_heads, t, masked):
    """Packed query heads over unrepeated keys (viasd.attention) = transformers' SDPA attention
    (repeat_kv), float64, with a ragged boolean mask, or none (causal: a prefill without cache)."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from viasd.attention import grouped_attention

    gen = torch.Generator().manual_seed(heads * 10 + kv_heads + t)
    b, s, d = 3, 9 if masked or t == 1 else t, 8
    q = torch.randn(b, heads, t, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, kv_heads, s, d, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = None
    if masked:  # rows of 9, 7 and 5 keys, the last t of each are the queries
        ends = torch.tensor([9, 7, 5])
        pos = ends[:, None] - t + torch.arange(t)[None]  # [B, T]
        mask = (torch.arange(s)[None, None] <= pos[:, :, None])[:, None]  # [B, 1, T, S]
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    out, _ = grouped_attention(module, q, k, v, mask, scaling=0.3)
    assert out.shape == (b, t, heads, d)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
