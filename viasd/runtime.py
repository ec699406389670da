"""Layer-masked execution of a Hugging Face decoder-only LM, with per-layer key/value caches.

The slim verifier q' of VIA-SD is the full verifier q run with a layer mask z in {0,1}^L
(z_l = 0: layer l is bypassed). Both run on the same weights through `MaskedLM.forward`:

    h_0 = embed(x)                                   # [1, T, H]
    h_l = layer_l(h_{l-1})  if z_l = 1 else h_{l-1}  # skipped layers do not run and write no cache
    logits = lm_head(norm(h_L))                      # [T, V]

Rotary embeddings and the causal mask are computed once per forward and shared by every kept
layer; positions are explicit (`start + arange(T)`), never inferred from a cache length, so that
layer 0 may be skipped.

`KVCache` keeps keys/values per layer with its own valid length, so layers can be rolled back
independently; the two cache policies of DESIGN.md are built from it in `viasd.engine`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from viasd.errors import MaskError, ModelLoadError

# config.model_type values whose decoder blocks are model.model.layers with the LLaMA layer API
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3")


class KVCache:
    """Keys and values of one sequence for a subset of layers; every layer has its own length.

    Storage grows by doubling (amortised O(1) appends, no per-step torch.cat); `crop` only moves
    a length, so a rollback costs nothing. The object is duck-type compatible with the
    `past_key_values.update(k, v, layer_idx)` call that transformers' attention modules make.
    """

    def __init__(self, layers: Iterable[int], num_layers: int):
        self.layers = tuple(sorted(set(layers)))
        if any(not 0 <= i < num_layers for i in self.layers):
            raise MaskError(f"cache layers {self.layers} out of range for a {num_layers}-layer model")
        self.num_layers = num_layers
        self._k: list[Tensor | None] = [None] * num_layers  # each [1, H_kv, capacity, D]
        self._v: list[Tensor | None] = [None] * num_layers
        self._len = [0] * num_layers

    def length(self, layer: int) -> int:
        return self._len[layer]

    def lengths(self) -> dict[int, int]:
        return {i: self._len[i] for i in self.layers}

    def crop(self, length: int, layers: Iterable[int] | None = None) -> None:
        """Roll the given layers (default: all of this cache's layers) back to `length` positions."""
        for i in self.layers if layers is None else layers:
            self._len[i] = min(self._len[i], length)

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Append key/value [1, H_kv, T, D] to layer `layer_idx`; return the layer's whole valid K/V."""
        if layer_idx not in self.layers:
            raise MaskError(f"layer {layer_idx} has no slot in this cache (layers {self.layers})")
        n, t = self._len[layer_idx], key.shape[2]
        k_buf, v_buf = self._k[layer_idx], self._v[layer_idx]
        if k_buf is None or n + t > k_buf.shape[2]:
            cap = max(64, 2 * (n + t))
            shape = (key.shape[0], key.shape[1], cap, key.shape[3])
            new_k, new_v = key.new_empty(shape), value.new_empty(shape)
            if k_buf is not None and n:
                new_k[:, :, :n] = k_buf[:, :, :n]
                new_v[:, :, :n] = v_buf[:, :, :n]
            self._k[layer_idx], self._v[layer_idx] = k_buf, v_buf = new_k, new_v
        k_buf[:, :, n : n + t] = key
        v_buf[:, :, n : n + t] = value
        self._len[layer_idx] = n + t
        return k_buf[:, :, : n + t], v_buf[:, :, : n + t]

    def kv(self, layer: int) -> tuple[Tensor, Tensor]:
        """The valid keys and values of one layer, each [1, H_kv, length, D] (views)."""
        n = self._len[layer]
        if self._k[layer] is None:
            raise MaskError(f"layer {layer} holds no keys yet")
        return self._k[layer][:, :, :n], self._v[layer][:, :, :n]

    def nbytes(self) -> int:
        """Bytes of the valid entries (not the reserved capacity)."""
        total = 0
        for i in self.layers:
            if self._k[i] is not None:
                k = self._k[i]
                total += 2 * k.shape[0] * k.shape[1] * self._len[i] * k.shape[3] * k.element_size()
        return total

    def __repr__(self) -> str:
        lens = sorted(set(self.lengths().values()))
        return f"KVCache(layers={len(self.layers)}/{self.num_layers}, lengths={lens})"


@dataclass(frozen=True)
class LayerMask:
    """A layer mask z: `keep[l]` is True when layer l runs (z_l = 1)."""

    keep: tuple[bool, ...]

    @classmethod
    def full(cls, num_layers: int) -> "LayerMask":
        return cls((True,) * num_layers)

    @classmethod
    def from_skipped(cls, skipped: Iterable[int], num_layers: int) -> "LayerMask":
        skipped = sorted(set(int(i) for i in skipped))
        bad = [i for i in skipped if not 0 <= i < num_layers]
        if bad:
            raise MaskError(f"skipped layers {bad} out of range 0..{num_layers - 1}")
        return cls(tuple(i not in skipped for i in range(num_layers)))

    @classmethod
    def from_z(cls, z: Sequence[int | bool], num_layers: int) -> "LayerMask":
        if len(z) != num_layers:
            raise MaskError(f"mask has {len(z)} entries but the verifier has {num_layers} layers")
        if any(int(v) not in (0, 1) for v in z):
            raise MaskError("mask entries must be 0 (skip) or 1 (keep)")
        return cls(tuple(bool(int(v)) for v in z))

    @classmethod
    def evenly_spaced(cls, ratio: float, num_layers: int) -> "LayerMask":
        """Skip round(ratio * L) layers spread evenly over layers 1..L-2 (first and last kept).

        A placeholder until a DIMR-searched mask is given: on real models an evenly spread mask
        agrees far less with the full model than a searched one (DESIGN.md, measured figures).
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

    def new_cache(self, mask: LayerMask | None = None) -> KVCache:
        return KVCache(self.all_layers if mask is None else mask.kept, self.num_layers)

    @property
    def all_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers))

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,
        start: int,
        cache: KVCache | None = None,
        mask: LayerMask | None = None,
        num_logits: int | None = None,
    ) -> Tensor:
        """Logits [num_logits or T, V] (float32, float64 for a float64 model) for `tokens` [T] at positions start..start+T-1.

        With a cache, every kept layer must hold exactly `start` positions (the caller crops
        first); the forward appends T positions to each kept layer and to no other.
        """
        assert tokens.ndim == 1, f"tokens must be [T], got {tuple(tokens.shape)}"
        t = tokens.shape[0]
        layers = self.all_layers if mask is None else mask.kept
        if mask is not None and mask.num_layers != self.num_layers:
            raise MaskError(f"mask has {mask.num_layers} entries but the model has {self.num_layers} layers")
        if cache is not None:
            stale = {i: cache.length(i) for i in layers if cache.length(i) != start}
            if stale:
                raise RuntimeError(f"cache layers not at position {start}: {stale}")
        elif start != 0:
            raise RuntimeError("a forward without cache must start at position 0")

        positions = torch.arange(start, start + t, device=self.device).unsqueeze(0)  # [1, T]
        hidden = self.embed(tokens.to(self.device).unsqueeze(0))  # [1, T, H]
        rope = self.rotary(hidden, positions)  # (cos, sin), each [1, T, D]
        attn_mask = None
        if t > 1:  # query i attends to keys 0..start+i
            keys = torch.arange(start + t, device=self.device)  # [S]
            attn_mask = (keys.unsqueeze(0) <= positions.squeeze(0).unsqueeze(1))[None, None]  # [1, 1, T, S]
        for i in layers:
            hidden = self.layers[i](
                hidden,
                attention_mask=attn_mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=cache is not None,
                position_embeddings=rope,
            )
        if num_logits is not None:
            hidden = hidden[:, -num_logits:]
        hidden = self.norm(hidden)
        logits = self.lm_head(hidden)[0]  # [T, V]
        return logits if logits.dtype == torch.float64 else logits.float()
