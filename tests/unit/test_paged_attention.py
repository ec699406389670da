"""The flex kernel of a paged cache (viasd/attention.py, `paged_attention: flex`) against the torch
path and a dense reference: the same attention for random block tables (rows growing side by
side, released and reused blocks, shared blocks copied on write, rollbacks), block sizes 1 / 3 /
4 / 8, mixed spans (the torch path in several buckets), decode rows (T = 1) and verify / prefill
rows (T > 1, causal within the block), grouped-query heads. On CPU FlexAttention runs eagerly:
its mask alone decides; the block mask the compiled kernel walks is checked to list exactly the
blocks that mask reads. The engine with the flex kernel decodes token for token what it decodes
with the torch path. The option: `auto` / `torch` / `flex`, flex refused where it cannot run."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from conftest import drafter_from, save_tiny_pair, tiny_model

from viasd import attention
from viasd.attention import grouped_attention, resolve_paged_attention
from viasd.blocks import PagedKVCache, _PagedWrite
from viasd.config import parse_engine_config, parse_params
from viasd.engine import Engine, engine_capacity
from viasd.errors import InvalidParameterError
from viasd.runtime import LayerMask, MaskedLM

D = 8  # head dim
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # (eager on CPU)


def _schedule(rng: random.Random, rows: int, steps: int):
    """Random ops over `rows` cache rows: ("fwd", {row: T}) | ("crop", row, back) | ("free", row) |
    ("fork", src), after a first forward of every row: a long prompt chunk, a short one, a token."""
    yield ("fwd", {0: 70, 1: 5, 2: 1})
    for _ in range(steps):
        if rng.random() < 0.25:
            yield rng.choice([("crop", rng.randrange(rows), rng.randint(1, 5)), ("free", rng.randrange(rows))])
        if rng.random() < 0.2:
            yield ("fork", rng.randrange(rows))
        decode = rng.random() < 0.4
        yield ("fwd", {r: 1 if decode else rng.choice([1, 2, 3, 4, 6]) for r in range(rows)})


def _views(cache, rows, starts, lengths, device="cpu"):
    """The same forward as each kernel reads it: [torch view, flex view] (the first takes the blocks)."""
    cache.attention = "torch"
    views = [cache.batch(rows, starts, lengths, device)]
    cache.attention = "flex"
    return [*views, _PagedWrite(cache, rows, starts, lengths, device)]


def _reference(cache, q, rows, starts, lengths, g) -> list[torch.Tensor]:
    """Each row alone: its keys and values gathered densely (`kv`), repeated per query head,
    query t at position start + t seeing keys 0 .. start + t -> [T_b, H, D]."""
    out = []
    for b, (row, start, n) in enumerate(zip(rows, starts, lengths)):
        k, v = cache.kv(row, 0)  # [1, H_kv, start + n, D]
        k, v = k[0].repeat_interleave(g, 0), v[0].repeat_interleave(g, 0)  # [H, S_b, D]
        causal = torch.arange(start + n)[None, :] <= (start + torch.arange(n))[:, None]  # [T_b, S_b]
        out.append(F.scaled_dot_product_attention(q[b, :, :n], k, v, attn_mask=causal).transpose(0, 1))
    return out


@pytest.mark.parametrize(
    ("block_size", "dtype", "heads"), [(1, "64", (4, 2)), (3, "32", (6, 2)), (4, "64", (2, 2)), (8, "32", (8, 2))]
)
@torch.inference_mode()  # (the pools are inference tensors, as in a forward)
def test_flex_equals_the_torch_path_and_a_dense_reference(block_size, dtype, heads):
    dtype, atol = {"64": (torch.float64, 1e-12), "32": (torch.float32, 2e-6)}[dtype]
    h, h_kv = heads
    g, rng = h // h_kv, random.Random(block_size)
    gen = torch.Generator().manual_seed(block_size)
    cache = PagedKVCache([0], 1, num_blocks=512, block_size=block_size, max_rows=8)
    live = {r: cache.alloc() for r in range(3)}  # schedule row -> cache row
    pos = dict.fromkeys(live, 0)
    compared = decodes = verifies = buckets = 0
    for op in _schedule(rng, 3, 9):
        if op[0] == "crop" and pos[op[1]] > op[2]:
            pos[op[1]] -= op[2]
            cache.crop(live[op[1]], pos[op[1]])
        elif op[0] == "free":  # its blocks go back; a fresh row takes them in another order
            cache.free(live[op[1]])
            live[op[1]], pos[op[1]] = cache.alloc(), 0
        elif op[0] == "fork" and pos[op[1]]:  # another row shares its blocks (copied on its first write)
            other = next(r for r in live if r != op[1])
            cache.free(live[other])
            live[other] = cache.alloc()
            cache.copy_row(live[op[1]], live[other], pos[op[1]])
            pos[other] = pos[op[1]]
        elif op[0] == "fwd":
            order = rng.sample(sorted(live), 3 if op[1][0] == 70 else rng.randint(1, 3))  # rows in any order
            rows, starts, lengths = [live[r] for r in order], [pos[r] for r in order], [op[1][r] for r in order]
            b, t = len(rows), max(lengths)
            key = torch.randn(b, h_kv, t, D, generator=gen, dtype=dtype)  # [B, H_kv, T, D] (pads too)
            value = torch.randn(b, h_kv, t, D, generator=gen, dtype=dtype)
            q = torch.randn(b, h, t, D, generator=gen, dtype=dtype)  # [B, H, T, D]
            positions = torch.tensor(starts)[:, None] + torch.arange(t)[None, :]  # [B, T]
            span = max(s + n for s, n in zip(starts, lengths))
            mask = None  # MaskedLM.forward_batch's mask: key <= the query's position
            if b > 1 or t > 1:
                mask = (torch.arange(span)[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, S]
            outs, views = [], _views(cache, rows, starts, lengths)
            for view in views:
                k, v = view.update(key, value, 0)
                outs.append(grouped_attention(None, q, k, v, mask)[0])  # [B, T, H, D]
            buckets = max(buckets, len(views[0].buckets))
            assert outs[1].dtype == dtype and outs[1].shape == (b, t, h, D)
            for bi, (ref, n) in enumerate(zip(_reference(cache, q, rows, starts, lengths, g), lengths)):
                torch.testing.assert_close(outs[1][bi, :n], outs[0][bi, :n], rtol=0, atol=atol)  # flex = torch path
                torch.testing.assert_close(outs[1][bi, :n], ref, rtol=0, atol=atol)  # = each row alone
                compared += 1
            decodes, verifies = decodes + (t == 1), verifies + (t > 1)
            for order_row, n in zip(order, lengths):
                pos[order_row] += n
    assert compared >= 12 and decodes and verifies and buckets > 1  # (the torch path: spans in two buckets)


@torch.inference_mode()  # (the pools are inference tensors, as in a forward)
def test_the_block_mask_lists_exactly_the_blocks_its_mask_reads():
    """The compiled kernel reads only the blocks each query tile lists (in full, by the mask): the
    tiles' lists are the blocks holding a position some query of the tile sees, padding queries
    included, in the rows' own tables; nothing of another row, nothing past a row's span."""
    from torch.nn.attention.flex_attention import create_mask

    rng = random.Random(0)
    for block_size in (1, 3, 4, 8):
        cache = PagedKVCache([0], 1, num_blocks=256, block_size=block_size, max_rows=4, attention="flex")
        rows = [cache.alloc() for _ in range(4)]
        pos = dict.fromkeys(rows, 0)
        for t in (5, 40, 1, 21):  # tiles of 16 queries: one, three, one, two
            lengths = [rng.randint(1, t) if i else t for i in range(4)]
            starts = [pos[r] for r in rows]
            view = cache.batch(rows, starts, lengths)
            view.update(torch.zeros(4, 1, t, D), torch.zeros(4, 1, t, D), 0)
            bm = view.block_mask
            slots = bm.seq_lengths[1]
            dense = create_mask(bm.mask_mod, 4, 1, t, slots)[:, 0]  # [B, T, slots]
            for b, (row, start, n) in enumerate(zip(rows, starts, lengths)):
                table = cache.blocks(row)
                seen = dense[b].reshape(t, slots // block_size, block_size).any(-1)  # [T, blocks]
                assert set(seen.any(0).nonzero().flatten().tolist()) == set(table[: cache.blocks_for(start + n)])
                for j in range(-(-t // attention.FLEX_Q_BLOCK)):
                    tile = seen[j * attention.FLEX_Q_BLOCK : (j + 1) * attention.FLEX_Q_BLOCK].any(0)
                    listed = bm.kv_indices[b, 0, j, : bm.kv_num_blocks[b, 0, j]].tolist()
                    assert listed == [blk for blk in table if tile[blk]], (block_size, t, b, j)
                for q in range(t):  # exactly positions 0 .. start + q (a padding query: the row's span)
                    want = torch.zeros(slots, dtype=torch.bool)
                    p = torch.arange(min(start + q, start + n - 1) + 1)
                    want[torch.tensor(table)[p // block_size] * block_size + p % block_size] = True
                    assert torch.equal(dense[b, q], want)
                pos[row] += n


def test_greedy_decoding_with_the_flex_kernel_equals_the_torch_path(monkeypatch):
    """A tiny random pair on blocks of 4: `ar` and `sd` requests batched, token for token the same
    with either kernel reading the caches, and every paged read of the flex engine through it."""
    verifier = tiny_model("qwen2", layers=2, dtype=torch.float32)
    pair = MaskedLM(verifier), MaskedLM(drafter_from(verifier, keep_layers=1))
    calls = []
    flex = attention.flex_paged_attention
    monkeypatch.setattr(attention, "flex_paged_attention", lambda *a: calls.append(1) or flex(*a))
    prompts = [[5, 9, 2, 7, 1, 3], [4, 4, 8, 15, 16, 23, 42, 8, 1], [11, 3]]
    params = [parse_params(mode=m, max_tokens=7, gamma=3, seed=0) for m in ("sd", "ar", "sd")]
    tokens = {}
    for kernel in ("torch", "flex"):
        engine = Engine(
            *pair,
            mask=LayerMask.from_skipped((1,), 2),
            max_batch=3,
            max_seq_len=32,
            kv_block_size=4,
            prefill_chunk=8,
            paged_attention=kernel,
        )
        assert engine.executor.verifier.full_store.attention == kernel == engine.executor.drafter.store.attention
        handles = [engine.submit(p, x) for p, x in zip(prompts, params)]
        out = {h: [] for h in handles}
        while engine.scheduler.has_work():
            for handle, chunk in engine.step():
                out[handle] += chunk.token_ids
        tokens[kernel] = [out[h] for h in handles]
        assert (len(calls) > 0) == (kernel == "flex")
    assert all(len(t) == 7 for t in tokens["torch"])
    assert tokens["flex"] == tokens["torch"]


def test_auto_picks_flex_on_cuda_only_and_flex_is_refused_where_it_cannot_run(monkeypatch, tmp_path):
    def choice(*args):
        c = resolve_paged_attention(*args)
        return c.kernel, c.reason

    assert choice("auto", "cpu", 16) == ("torch", "auto-device")
    assert choice("auto", "cuda", None) == ("torch", "slot-rows")
    assert choice("torch", "cuda:0", 16) == ("torch", "requested")
    for args, says in (
        (("flex", "cpu", 16), "CUDA"),
        (("flex", "cuda", None), "kv_block_size"),
        (("fast", "cpu", 16), "auto, torch or flex"),
    ):
        with pytest.raises(InvalidParameterError) as err:
            resolve_paged_attention(*args)
        assert err.value.field == "paged_attention" and says in err.value.message
    monkeypatch.setattr(attention, "flex_available", lambda: False)
    assert choice("auto", "cuda", 16) == ("torch", "auto-unavailable")
    with pytest.raises(InvalidParameterError, match="does not compile here"):
        resolve_paged_attention("flex", "cuda", 16)
    monkeypatch.setattr(attention, "flex_available", lambda: True)
    assert choice("auto", "cuda", 16) == ("flex", "auto-cuda") and choice("flex", "cuda:1", 64) == ("flex", "requested")
    assert choice("auto", "cuda", 12) == ("torch", "auto-block-size")
    with pytest.raises(InvalidParameterError, match="power of two"):
        resolve_paged_attention("flex", "cuda", 8)
    monkeypatch.undo()

    assert parse_engine_config().paged_attention == "auto"
    with pytest.raises(InvalidParameterError) as err:
        parse_engine_config(paged_attention="fused")
    assert err.value.field == "paged_attention"
    from viasd.llm import LLM

    with pytest.raises(InvalidParameterError) as err:  # (before anything loads)
        LLM(save_tiny_pair(tmp_path, kv_block_size=4, paged_attention="flex"))
    assert err.value.field == "paged_attention"
    llm = LLM(save_tiny_pair(tmp_path, kv_block_size=4))  # the runtime info says which kernel and why
    assert {k: v for k, v in llm.runtime_info().items() if k.startswith("paged_attention")} == {
        "paged_attention": "torch",
        "paged_attention_requested": "auto",
        "paged_attention_reason": "auto-device",
    }
    assert llm.engine.executor.verifier.full_store.attention == "torch"
    config = parse_engine_config(kv_block_size=16, paged_attention="torch")  # (what each served actor sizes)
    assert engine_capacity(config, 1024, "cpu", [512])[0].paged_attention == "torch"
    with pytest.raises(InvalidParameterError, match="paged_attention"):
        engine_capacity(config.model_copy(update={"paged_attention": "flex"}), 1024, "cpu", [512])


cuda = pytest.mark.skipif(not attention.flex_available(), reason="no CUDA device with Triton")


@cuda
@torch.inference_mode()  # (the pools are inference tensors, as in a forward)
def test_cuda_compiled_flex_agrees_with_the_torch_path():
    """Compiled on the device, bf16, blocks of 16: the flex kernel within bf16 rounding of the
    torch path over ragged decode and verify rows."""
    torch.manual_seed(0)
    cache = PagedKVCache([0], 1, num_blocks=256, block_size=16, max_rows=4)
    rows = [cache.alloc() for _ in range(4)]
    starts = [0, 0, 0, 0]
    for lengths in ([37, 130, 5, 64], [1, 1, 1, 1], [6, 6, 1, 6]):
        t = max(lengths)
        key, value = (torch.randn(4, 2, t, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        q = torch.randn(4, 8, t, 64, device="cuda", dtype=torch.bfloat16)
        positions = torch.tensor(starts, device="cuda")[:, None] + torch.arange(t, device="cuda")[None, :]
        span = max(s + n for s, n in zip(starts, lengths))
        mask = (torch.arange(span, device="cuda")[None, None, :] <= positions[:, :, None])[:, None]
        outs = []
        for view in _views(cache, rows, starts, lengths, "cuda"):
            k, v = view.update(key, value, 0)
            outs.append(grouped_attention(None, q, k, v, mask)[0].float())
        for b, n in enumerate(lengths):
            torch.testing.assert_close(outs[1][b, :n], outs[0][b, :n], rtol=0, atol=2e-2)
        starts = [s + n for s, n in zip(starts, lengths)]
