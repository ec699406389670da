"""Layer-masked, batched execution of a Hugging Face decoder-only LM, with slot key/value caches.

The slim verifier q' of VIA-SD is the full verifier q run with a layer mask z in {0,1}^L
(z_l = 0: layer l is bypassed). Both run on the same weights through `MaskedLM.forward_batch`,
over B ragged rows (row b feeds T_b tokens at positions start_b .. start_b + T_b - 1):

    h_0 = embed(x)                                   # [B, T, H], rows right-padded to T = max T_b
    h_l = layer_l(h_{l-1})  if z_l = 1 else h_{l-1}  # skipped layers do not run and write no cache
    logits_b = lm_head(norm(h_L[b, T_b - k_b : T_b]))  # [k_b, V]: only the positions asked for

Query t of row b attends to keys 0 .. start_b + t of its own row (a boolean mask [B, 1, T, S]);
rotary embeddings use explicit per-row positions, never a cache length, so layer 0 may be skipped.
Padding never reaches a real row: pad queries sit after every real query of their row, their
keys and values are never written to the cache, and the cache starts zeroed, so a masked-out
key is finite and contributes exactly 0 to a real row.

`SlotKVCache` holds the keys/values of up to `max_rows` sequences for a subset of layers, each
(layer, row) with its own valid length: a forward appends to the kept layers of its rows only,
a rollback just sets a length, a finished request frees its row. Storage is preallocated per
layer as [rows, H_kv, len, D] and grows by doubling (rows and length) up to the configured
capacity, so one request on a large-capacity engine holds one row, not all of them. It is the
cache interface of the engine (docs/BATCHING.md, "Caches"), which the paged cache
(viasd.blocks.PagedKVCache) shares: `batch` / `RowCache`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from viasd import attention
from viasd.blocks import PagedKVCache
from viasd.errors import CapacityError, MaskError, ModelLoadError
from viasd.kvstore import KVStore, RowCache

# config.model_type values whose decoder blocks are model.model.layers with the LLaMA layer API
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3")


class SlotKVCache(KVStore):
    """Keys and values of up to `max_rows` sequences (rows) for a subset of layers.

    Every (layer, row) has its own valid length; storage per layer is `_k[l]`, `_v[l]`
    [rows_cap, H_kv, len_cap, D]. `batch(...)` gives the object a forward hands to transformers'
    attention modules (`past_key_values.update(k, v, layer_idx)`).
    """

    # ------------------------------------------------------------ lengths

    def crop(self, row: int, length: int, layers: Iterable[int] | None = None) -> None:
        """Roll the given layers (default: all of this cache's layers) of a row back to `length`."""
        for i in self.layers if layers is None else layers:
            self._len[i][row] = min(self._len[i][row], length)

    @torch.inference_mode()  # (the storage a forward allocated is an inference tensor)
    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Give row `dst` the first `length` keys/values of row `src` in every layer (n > 1 samples
        share one prefill): dst's layers end up at min(length, src's length), as if it had fed them."""
        for i in self.layers:
            n = min(length, self._len[i][src])
            if n and self._k[i] is not None:
                self._ensure(i, self._k[i], dst + 1, n)
                self._k[i][dst, :, :n] = self._k[i][src, :, :n]
                self._v[i][dst, :, :n] = self._v[i][src, :, :n]
            self._len[i][dst] = n

    def kv(self, row: int, layer: int) -> tuple[Tensor, Tensor]:
        """The valid keys and values of one row and layer, each [1, H_kv, length, D] (views)."""
        if self._k[layer] is None:
            raise MaskError(f"layer {layer} holds no keys yet")
        n = self._len[layer][row]
        return self._k[layer][row : row + 1, :, :n], self._v[layer][row : row + 1, :, :n]

    # ------------------------------------------------------------ forwards

    def batch(
        self, rows: Sequence[int], starts: Sequence[int], lengths: Sequence[int], device: torch.device | str = "cpu"
    ) -> _BatchWrite:
        """The cache view of one forward on `device`: row b = rows[b] appends lengths[b] tokens at starts[b]."""
        return _BatchWrite(self, list(rows), list(starts), list(lengths), torch.device(device))

    def _ensure(self, layer: int, like: Tensor, rows_needed: int, len_needed: int) -> None:
        """Allocate or grow layer storage (doubling, zero-filled) to hold rows_needed x len_needed."""
        if self.max_len is not None and len_needed > self.max_len:
            raise CapacityError("max_seq_len", f"{len_needed} positions exceed the cache's {self.max_len} per row")
        k = self._k[layer]
        if k is not None and rows_needed <= k.shape[0] and len_needed <= k.shape[2]:
            return
        old_rows, old_len = (0, 0) if k is None else (k.shape[0], k.shape[2])
        rows_cap = min(self.max_rows, max(old_rows, 1 << (rows_needed - 1).bit_length()))
        len_cap = max(old_len, 64, 1 << (len_needed - 1).bit_length())
        if self.max_len is not None:
            len_cap = min(len_cap, self.max_len)
        shape = (rows_cap, like.shape[1], len_cap, like.shape[3])
        new_k = like.new_zeros(shape)  # zeros: a never-written position is finite (see module docstring)
        new_v = like.new_zeros(shape)
        if k is not None:
            new_k[:old_rows, :, :old_len] = k
            new_v[:old_rows, :, :old_len] = self._v[layer]
        self._k[layer], self._v[layer] = new_k, new_v

    def __repr__(self) -> str:
        return f"SlotKVCache(layers={len(self.layers)}/{self.num_layers}, rows={self.rows_in_use}/{self.max_rows})"


class _BatchWrite:
    """What one batched forward gives the attention modules as `past_key_values`.

    `update(key, value, layer_idx)` writes the real tokens of every row (never the padding) and
    returns the keys/values the queries attend to, [B, H_kv, S, D] with S = max_b start_b + T_b.
    """

    def __init__(
        self, cache: SlotKVCache, rows: list[int], starts: list[int], lengths: list[int], device: torch.device
    ):
        self.cache, self.rows, self.starts, self.lengths = cache, rows, starts, lengths
        self.span = max(s + n for s, n in zip(starts, lengths))  # S
        self.contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        if len(rows) > 1:  # flat indices of the real tokens, once per forward: dst (row, pos) <- src (b, t)
            b_idx = [b for b, n in enumerate(lengths) for _ in range(n)]
            t_idx = [t for n in lengths for t in range(n)]
            self.src_b = torch.tensor(b_idx, device=device)  # [N]
            self.src_t = torch.tensor(t_idx, device=device)  # [N]
            self.dst_row = torch.tensor([rows[b] for b in b_idx], device=device)  # [N]
            self.dst_pos = torch.tensor([starts[b] + t for b, t in zip(b_idx, t_idx)], device=device)  # [N]
            self.row_index = torch.tensor(rows, device=device)  # [B]

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """key/value [B, H_kv, T, D] -> the rows' keys/values [B, H_kv, S, D]."""
        cache = self.cache
        if layer_idx not in cache.layers:
            raise MaskError(f"layer {layer_idx} has no slot in this cache (layers {cache.layers})")
        lens = cache._len[layer_idx]
        cache._ensure(layer_idx, key, max(self.rows) + 1, self.span)
        k_buf, v_buf = cache._k[layer_idx], cache._v[layer_idx]
        if len(self.rows) == 1:
            row, start, n = self.rows[0], self.starts[0], self.lengths[0]
            k_buf[row, :, start : start + n] = key[0, :, :n]
            v_buf[row, :, start : start + n] = value[0, :, :n]
        else:
            k_buf[self.dst_row, :, self.dst_pos] = key[self.src_b, :, self.src_t]  # [N, H_kv, D]
            v_buf[self.dst_row, :, self.dst_pos] = value[self.src_b, :, self.src_t]
        for row, start, n in zip(self.rows, self.starts, self.lengths):
            lens[row] = start + n
        if self.contiguous:  # a view, no copy
            r0, r1 = self.rows[0], self.rows[0] + len(self.rows)
            return k_buf[r0:r1, :, : self.span], v_buf[r0:r1, :, : self.span]
        return (
            k_buf[:, :, : self.span].index_select(0, self.row_index),
            v_buf[:, :, : self.span].index_select(0, self.row_index),
        )


@dataclass(frozen=True)
class LayerMask:
    """A layer mask z: `keep[l]` is True when layer l runs (z_l = 1)."""

    keep: tuple[bool, ...]

    @classmethod
    def full(cls, num_layers: int) -> LayerMask:
        return cls((True,) * num_layers)

    @classmethod
    def from_skipped(cls, skipped: Iterable[int], num_layers: int) -> LayerMask:
        skipped = sorted(set(int(i) for i in skipped))
        bad = [i for i in skipped if not 0 <= i < num_layers]
        if bad:
            raise MaskError(f"skipped layers {bad} out of range 0..{num_layers - 1}")
        return cls(tuple(i not in skipped for i in range(num_layers)))

    @classmethod
    def from_z(cls, z: Sequence[int | bool], num_layers: int) -> LayerMask:
        if len(z) != num_layers:
            raise MaskError(f"mask has {len(z)} entries but the verifier has {num_layers} layers")
        if any(int(v) not in (0, 1) for v in z):
            raise MaskError("mask entries must be 0 (skip) or 1 (keep)")
        return cls(tuple(bool(int(v)) for v in z))

    @classmethod
    def evenly_spaced(cls, ratio: float, num_layers: int) -> LayerMask:
        """Skip round(ratio * L) layers spread evenly over layers 1..L-2 (first and last kept).

        A placeholder until a DIMR-searched mask is given: on real models an evenly spread mask
        agrees far less with the full model than a searched one (docs/DIMR.md).
        """
        if not 0.0 <= ratio < 1.0:
            raise MaskError(f"skip ratio must be in [0, 1), got {ratio}", field="skip_ratio")
        n_skip = min(round(ratio * num_layers), max(num_layers - 2, 0))
        inner = list(range(1, num_layers - 1))
        if n_skip == 0:
            return cls.full(num_layers)
        step = len(inner) / n_skip
        skipped = {inner[int(step * k + step / 2)] for k in range(n_skip)}
        return cls.from_skipped(skipped, num_layers)

    @property
    def num_layers(self) -> int:
        return len(self.keep)

    @property
    def kept(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.keep) if k)

    @property
    def skipped(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.keep) if not k)

    @property
    def ratio(self) -> float:
        return len(self.skipped) / self.num_layers

    def __repr__(self) -> str:
        return f"LayerMask(skipped={list(self.skipped)}, L={self.num_layers})"


@dataclass(frozen=True)
class Row:
    """One row of a batched forward: feed `tokens` then `tail` at positions start.., return
    `num_logits` rows. `tail` holds tokens that live on the device (drafted tokens): they are fed
    without being read to the host."""

    tokens: Sequence[int]  # [T_b - n_tail]
    start: int  # position of tokens[0]; the row's cache layers must hold exactly `start` positions
    num_logits: int  # logits for the last num_logits positions (0: none, a prefill chunk)
    cache_row: int | None = None  # the row of the SlotKVCache (None: no cache)
    tail: Tensor | None = None  # [n_tail] long, on the model's device

    def __len__(self) -> int:
        return len(self.tokens) + (0 if self.tail is None else self.tail.shape[0])


class Lap:
    """Seconds of device work from construction to `stop`: CUDA events on a CUDA device (read once
    the device got there: `seconds` waits for it), the host clock elsewhere."""

    def __init__(self, device: torch.device | str):
        self.events = torch.device(device).type == "cuda"
        if self.events:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        self._seconds: float | None = None

    def stop(self) -> Lap:
        if self.events:
            self._end.record()
        else:
            self._seconds = time.perf_counter() - self._t0
        return self

    @property
    def seconds(self) -> float:
        if self._seconds is None:
            self._end.synchronize()
            self._seconds = self._start.elapsed_time(self._end) / 1e3
        return self._seconds


class MaskedLM:
    """Runs a transformers causal LM (LLaMA / Qwen2 family) layer by layer with an optional mask."""

    def __init__(self, model: nn.Module):
        cfg = model.config
        if cfg.model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"model_type {cfg.model_type!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self.model = model
        self.config = cfg
        self.embed = model.model.embed_tokens
        self.layers = model.model.layers
        self.norm = model.model.norm
        self.rotary = model.model.rotary_emb
        self.lm_head = model.lm_head
        self.num_layers = len(self.layers)
        self.vocab_size = self.lm_head.out_features
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device

    @property
    def all_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers))

    def kv_bytes_per_token(self, mask: LayerMask | None = None) -> int:
        """Bytes of keys + values one position costs in the layers `mask` keeps (all by default)."""
        cfg = self.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        layers = self.num_layers if mask is None else len(mask.kept)
        return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=self.dtype).element_size()

    def new_store(
        self,
        mask: LayerMask | None = None,
        *,
        max_rows: int = 1,
        max_len: int | None = None,
        block_size: int | None = None,
        num_blocks: int | None = None,
        prefix_caching: bool = False,
        attention: str = "torch",
    ) -> SlotKVCache | PagedKVCache:
        """An empty cache for the layers `mask` keeps (all by default): a `SlotKVCache`, or with
        `block_size` a `PagedKVCache` of `num_blocks` blocks (default: max_rows rows of max_len),
        sharing published prompt blocks between rows with `prefix_caching`, read by the
        `attention` kernel ("torch" or "flex": viasd.attention)."""
        layers = self.all_layers if mask is None else mask.kept
        if block_size is None:
            return SlotKVCache(layers, self.num_layers, max_rows=max_rows, max_len=max_len)
        if num_blocks is None:
            if max_len is None:
                raise ValueError("a paged cache needs num_blocks or max_len")
            num_blocks = max_rows * -(-max_len // block_size)
        return PagedKVCache(
            layers,
            self.num_layers,
            num_blocks=num_blocks,
            block_size=block_size,
            max_rows=max_rows,
            max_len=max_len,
            prefix_caching=prefix_caching,
            attention=attention,
        )

    def new_cache(self, mask: LayerMask | None = None) -> RowCache:
        """A one-sequence cache (a one-row store)."""
        store = self.new_store(mask)
        return store.row(store.alloc())

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,
        start: int,
        cache: RowCache | None = None,
        mask: LayerMask | None = None,
        num_logits: int | None = None,
    ) -> Tensor:
        """Logits [num_logits or T, V] (float32, float64 for a float64 model) for one sequence's
        `tokens` [T] at positions start..start+T-1: `forward_batch` with one row."""
        assert tokens.ndim == 1, f"tokens must be [T], got {tuple(tokens.shape)}"
        t = tokens.shape[0]
        row = Row(tokens.tolist(), start, t if num_logits is None else num_logits, None if cache is None else cache.row)
        return self.forward_batch([row], None if cache is None else cache.store, mask)[0]

    def run_layers(
        self,
        hidden: Tensor,
        positions: Tensor,
        attn_mask: Tensor | None,
        past_key_values,
        layers: Sequence[int],
        rope: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """The decoder layers `layers` in order over hidden [B, T, H] at positions [B, T]: the
        layer loop of every forward (`forward_batch`, DIMR's shared-policy scoring).
        `attn_mask` [B, 1, T, S] (True: attend) or None (causal over T); `past_key_values`: any
        cache with transformers' `update(key, value, layer_idx)` (None: no cache)."""
        rope = rope if rope is not None else self.rotary(hidden, positions)  # (cos, sin), each [B, T, D]
        with attention.using(self.config):  # grouped-query heads packed, not repeated (viasd.attention)
            for i in layers:
                hidden = self.layers[i](
                    hidden,
                    attention_mask=attn_mask,
                    position_ids=positions,
                    past_key_values=past_key_values,
                    use_cache=past_key_values is not None,
                    position_embeddings=rope,
                )
        return hidden  # [B, T, H]

    def head(self, hidden: Tensor) -> Tensor:
        """Final norm and LM head: hidden [1, N, H] -> logits [N, V] (float32, float64 for a float64 model)."""
        logits = self.lm_head(self.norm(hidden))[0]  # [N, V]
        return logits if logits.dtype == torch.float64 else logits.float()

    @torch.inference_mode()
    def forward_batch(
        self, rows: Sequence[Row], cache: SlotKVCache | PagedKVCache | None = None, mask: LayerMask | None = None
    ) -> list[Tensor]:
        """One forward over ragged rows; returns each row's logits [num_logits_b, V] (float32, or
        float64 for a float64 model).

        With a cache, every kept layer of each row must hold exactly `start_b` positions (the
        caller crops first); the forward appends T_b positions to each kept layer of each row and
        to no other layer. Without a cache every row starts at 0.
        """
        layers = self.all_layers if mask is None else mask.kept
        if mask is not None and mask.num_layers != self.num_layers:
            raise MaskError(f"mask has {mask.num_layers} entries but the model has {self.num_layers} layers")
        if cache is None and any(r.start != 0 for r in rows):
            raise RuntimeError("a forward without cache must start at position 0")
        b, t = len(rows), max(len(r) for r in rows)
        lengths = [len(r) for r in rows]
        if min(lengths) < 1 or any(not 0 <= r.num_logits <= n for r, n in zip(rows, lengths)):
            raise ValueError(
                f"rows need >= 1 token and 0 <= num_logits <= tokens: {[(n, r.num_logits) for r, n in zip(rows, lengths)]}"
            )
        dev = self.device
        ids = torch.tensor([[*r.tokens, *[0] * (t - len(r.tokens))] for r in rows], dtype=torch.long).to(dev)  # [B, T]
        tails = [(i, r) for i, r in enumerate(rows) if r.tail is not None and r.tail.shape[0]]
        if tails:  # device tokens go in place on the device (right after each row's host tokens)
            where = [i * t + len(r.tokens) + j for i, r in tails for j in range(r.tail.shape[0])]
            ids.view(-1)[torch.tensor(where, device=dev)] = torch.cat([r.tail for _, r in tails])
        starts = torch.tensor([r.start for r in rows])  # [B]
        positions = (starts[:, None] + torch.arange(t)[None, :]).to(dev)  # [B, T]
        hidden = self.embed(ids.to(dev))  # [B, T, H]
        rope = self.rotary(hidden, positions)  # (cos, sin), each [B, T, D]
        span = max(r.start + n for r, n in zip(rows, lengths))  # S: keys the longest row sees
        attn_mask = None
        if b > 1 or t > 1:  # query t of row b attends to keys 0..start_b + t of its row
            keys = torch.arange(span, device=dev)  # [S]
            attn_mask = (keys[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, S]
        view = None
        if cache is not None:
            for r in rows:
                stale = {i: cache.length(r.cache_row, i) for i in layers if cache.length(r.cache_row, i) != r.start}
                if stale:
                    raise RuntimeError(f"cache row {r.cache_row}: layers not at position {r.start}: {stale}")
            view = cache.batch([r.cache_row for r in rows], [r.start for r in rows], lengths, dev)
        hidden = self.run_layers(hidden, positions, attn_mask, view, layers, rope)
        wanted = [(i, n - r.num_logits, n) for i, (r, n) in enumerate(zip(rows, lengths)) if r.num_logits]
        out: list[Tensor] = [hidden.new_empty(0, self.vocab_size)] * b
        if wanted:
            picked = torch.cat([hidden[i, lo:hi] for i, lo, hi in wanted])[None]  # [1, N, H] (3-d, as the
            logits = self.head(picked)  # [N, V]   tensor-parallel heads expect)
            for (i, _, _), part in zip(wanted, logits.split([r.num_logits for r in rows if r.num_logits])):
                out[i] = part
        return out
