"""Quantized linears: weight-only int8 per output channel and int4 group-wise on CPU; fp8 on CUDA.

(fp8, :class:`Fp8Linear`: float8_e4m3fn weights with a scale per output channel and activations
quantized per token as they run, ``torch._scaled_mm``; compute capability 8.9 or more. The rest of
this docstring is about the CPU kernels.)

A decoding step of one request reads every weight of the model once: at batch 1 it runs at the
speed weights come from memory, and only fewer bytes per weight make it faster. A quantized
linear keeps its weight in 8 or 4 bits and computes ``y = x W^T + b`` with activations in the
model's dtype (bfloat16, float16 or float32), the weight widened inside the kernel.

The maths (``W`` is ``[N, K]``: N output channels, K inputs; ``q`` the stored integers):

* **int8**, symmetric per output channel: ``W[n, k] = q[n, k] * s[n]``, ``q`` in -127..127,
  ``s[n] = max_k |W[n, k]| / 127``. Rounding to nearest: ``|W - W_q| <= s[n] / 2``.
* **int4**, asymmetric per group of ``g`` consecutive inputs (g = 32 by default, the group of
  GGUF's Q4_K): ``W[n, k] = q[n, k] * s[n, j] + m[n, j]``, ``j = k // g``, ``q`` in 0..15; a
  scale ``s`` and a minimum ``m`` per group. From float weights: ``m`` the group's minimum,
  ``s = (max - min) / 15``, ``|W - W_q| <= s / 2``. GGUF's Q4_K blocks have exactly this form
  (``s = d * scale``, ``m = -dmin * min``), so they map without requantizing
  (:mod:`viasd.quant_gguf`).

Kernels (measured per shape and row count on this machine, ``docs/benchmarks/cpu/quant/``):

* ``int8``: ``torch._weight_int8pack_mm(x [M, K], q [N, K], s [N])``;
* ``int4``: ``torch._weight_int4pack_mm_for_cpu(x [M, K], packed, g, sz [K/g, N, 2])`` on the
  weight packed once by ``torch._convert_weight_to_int4pack_for_cpu`` (a layout of this CPU's
  vector width: packed weights are built at load, never stored); it computes
  ``(q - 8) * s + z`` with ``z = m + 8 s``.
* ``dense``: a copy of the dequantized weight in the activation dtype, oneDNN-prepacked where
  oneDNN has kernels for it (what :func:`viasd.precision.optimize_linears` runs for plain
  linears).
* ``a8w8`` (int8 weights, bf16 / fp16 activations, one-row products): FBGEMM's dynamic int8
  linear, :func:`a8w8_matmul`: the activations quantized to 8 bits as it runs, integer dot
  products with the int8 weight (AVX-512 VNNI), the weight ``q * s`` with ``s`` as the int8
  kernel reads it. Not weight-only: the row is rounded to 8 bits, ``|x - x_q| <= a / 2`` with
  ``a = (max(x, 0) - min(x, 0)) / 255``. One scale for its whole input, so it runs one-row
  products only (a row's result is then its own); where it beats the one-row product of the
  other kernels (:func:`probe_dense_from`), e.g. a large int8 LM head.
* ``a8w8r`` (int8 weights, bf16 / fp16 activations, any row count): oneDNN's int8 linear,
  :func:`a8w8r_matmul`: each row quantized to 8 bits with its own scale, symmetric,
  ``x = a (u - 128)``, ``u`` in 1..255, ``a = max|x| / 127`` (``|x - x_q| <= a / 2``), integer
  dot products with the int8 weight ``q`` (VNNI), then ``* s[n] * a[m]`` in float32: a row's result
  depends on that row alone, so it runs products of several rows.

The integer kernels read a quarter (int4) or half (int8) of bf16's bytes, but their cost grows
with every row: they win the products of a few rows, the dense kernel the rest (a 16-row step,
a verified block of several requests, a prompt). So each :class:`QuantizedLinear` runs the
integer kernel below ``dense_from`` rows and the dense copy from there: :func:`quantize_model`
times both on the first linear of each shape at :data:`PROBE_ROWS` rows (:func:`probe_dense_from`,
the weights read from memory as in a decoding step; once per shape, dtype and thread count in a
process, and kept per machine in the cache by an engine) and keeps a dense copy only where it
wins some row count (2 bytes a weight in bf16; memory permitting: ``keep_free_bytes``), and an
a8w8 copy of an int8 weight (1 byte a weight) where a8w8 wins the one-row product, an a8w8r copy
(1 byte a weight) where a8w8r wins some row count: the probe picks one kernel for each row count
(:func:`kernel_table`), and a copy that no row count runs is not kept. Without them
(``dense=False``) every product runs the integer kernel. Both kernels compute with the same
dequantized weights: the dense copy is ``(q - 8) * s + z`` with the very scales the integer
kernel uses (rounded to the activation dtype), rounded once more to that dtype. In float32 the
two agree to float32 rounding; in bf16 within bf16's (tests/unit/test_quant.py states the
tolerances).

In bf16 the scales and zeros the int4 kernel reads are bf16: its weight deviates from the
float32 dequantization by at most ``|q - 8| * |s| * 2^-9 + |z| * 2^-9`` (one rounding of each);
int8's scale, by ``|W| * 2^-9``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "INT4_GROUP",
    "PROBE_ROWS",
    "SCHEMES",
    "QuantChoice",
    "QuantReport",
    "QuantizedWeight",
    "kernel_dtypes",
    "probe_dense_from",
    "quantize_fp8",
    "quantize_int4",
    "quantize_int8",
    "quantize_model",
    "engine_linears",
    "fp8_linear_class",
    "kernel_table",
    "quantized_linear",
    "quantized_linear_class",
    "resolve_quantization",
]

#: What ``EngineConfig.quantization`` may name.
SCHEMES = ("none", "int8", "int4", "fp8", "auto")
#: Inputs per int4 group by default: GGUF Q4_K's sub-block.
INT4_GROUP = 32
#: Group sizes the CPU int4 kernel takes.
INT4_GROUPS = (32, 64, 128, 256)
#: Rows at which probe_dense_from times the integer and the dense kernel, ascending: a step of a
#: few requests, a verified block of gamma + 1 = 6, up to batches and prompt chunks.
PROBE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
#: Rounds of each probe (after one warm-up): as many as PROBE_BUDGET_S seconds allow, within these.
PROBE_REPEATS = (3, 40)
PROBE_BUDGET_S = 0.5
#: Keep this share of the machine's memory free when adding dense copies (as optimize_linears).
DENSE_KEEP_FREE_FRACTION = 0.15


def kernel_dtypes() -> tuple[torch.dtype, ...]:
    """Activation dtypes the CPU integer kernels take."""
    import torch

    return (torch.float32, torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------------------------
# quantized weights, in a portable form


@dataclass
class QuantizedWeight:
    """A quantized ``[N, K]`` weight in a portable form (no kernel layout).

    ``scheme`` ``int8``: ``q`` int8 ``[N, K]``, ``scale`` float32 ``[N]``, ``W = q * scale[:, None]``.
    ``scheme`` ``int4``: ``q`` uint8 ``[N, K]`` (one value 0..15 a byte), ``scale`` and ``min``
    float32 ``[N, K / group]``, ``W[n, k] = q[n, k] * scale[n, k // group] + min[n, k // group]``.
    ``scheme`` ``fp8``: ``q`` float8_e4m3fn ``[N, K]``, ``scale`` float32 ``[N]``, ``W = q * scale[:, None]``.
    """

    scheme: str
    q: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor | None = None
    group: int | None = None
    source: str = "quantized at load"  # where the integers came from (viasd.quant_gguf: a GGUF's blocks)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``W`` ``[N, K]``, computed in float32 (``dtype``: then cast; default float32)."""
        import torch

        if self.scheme in ("int8", "fp8"):
            w = self.q.float() * self.scale[:, None]  # [N, K]
        else:
            n, k = self.shape
            qg = self.q.float().reshape(n, k // self.group, self.group)  # [N, K/g, g]
            w = (qg * self.scale[..., None] + self.min[..., None]).reshape(n, k)
        return w if dtype is None or dtype == torch.float32 else w.to(dtype)

    def nbytes(self, dtype_bytes: int = 2) -> int:
        """Bytes the kernels hold: the integers (int4: two a byte) and the scales (and zeros) in
        an activation dtype of ``dtype_bytes``."""
        n, k = self.shape
        if self.scheme == "fp8":
            return n * k + n * 4  # (float32 scales)
        if self.scheme == "int8":
            return n * k + n * dtype_bytes
        return n * k // 2 + 2 * self.scale.numel() * dtype_bytes


def quantize_int8(w: torch.Tensor, absmax: torch.Tensor | None = None) -> QuantizedWeight:
    """Symmetric per-channel int8 of ``w`` ``[N, K]``: ``s = max|w| / 127`` a row, ``q = round(w / s)``.

    ``absmax`` ``[N]``: each row's ``max|W|`` over the whole weight when ``w`` is a slice of its
    inputs (a row-parallel tensor-parallel shard), so that the slice gets the unsliced weight's scales.
    """
    import torch

    wf = w.detach().float()  # [N, K]
    amax = wf.abs().amax(1) if absmax is None else absmax.float()  # [N]
    scale = (amax / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [N]
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight("int8", q, scale)


#: The largest float8_e4m3fn value: a channel's max |W| maps to it.
FP8_MAX = 448.0


def quantize_fp8(w: torch.Tensor, absmax: torch.Tensor | None = None) -> QuantizedWeight:
    """float8_e4m3fn of ``w`` ``[N, K]`` per output channel: ``s = max|w| / 448`` a row,
    ``q = fp8(w / s)`` rounded to nearest (3 mantissa bits: ``|W - W_q| <= 2^-4 |W| + 2^-10 s``,
    the second term where ``w / s`` falls among fp8's subnormals, below 2^-6). ``absmax`` ``[N]``:
    the rows' max |W| over the whole weight when ``w`` is a slice of its inputs (as ``quantize_int8``)."""
    import torch

    wf = w.detach().float()  # [N, K]
    amax = wf.abs().amax(1) if absmax is None else absmax.float()  # [N]
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # [N]
    q = (wf / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight("fp8", q, scale)


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> QuantizedWeight:
    """Asymmetric int4 of ``w`` ``[N, K]`` per group of ``group`` inputs: ``m`` = the group's
    minimum, ``s = (max - min) / 15``, ``q = round((w - m) / s)`` in 0..15."""
    import torch

    n, k = w.shape
    if k % group:
        raise ValueError(f"int4: {k} inputs are not a multiple of the group size {group}")
    wg = w.detach().float().reshape(n, k // group, group)  # [N, K/g, g]
    lo, hi = wg.amin(-1), wg.amax(-1)  # [N, K/g]
    scale = (hi - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: q = 0, W = min
    q = torch.round((wg - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8).reshape(n, k)
    return QuantizedWeight("int4", q, scale, lo, group)


# ------------------------------------------------------------------------------------------------
# the module


def _dense_ok(dtype) -> bool:
    """oneDNN can prepack a dense weight of ``dtype`` on this CPU."""
    import torch

    from viasd.precision import _onednn_bf16_enabled

    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _onednn_bf16_enabled())


#: Activation dtypes a8w8 serves: not float32, the exactness dtype (its 8-bit activations would
#: part `ar`'s one-row steps from `sd`'s blocks far beyond float32 rounding).
A8W8_DTYPES = ("bfloat16", "float16")


def a8w8_pack(q: torch.Tensor, scale: torch.Tensor):
    """FBGEMM's packed form of an int8 weight ``q`` ``[N, K]`` with its scales ``[N]`` (the values
    the int8 kernel reads: ``W = q * scale``), for :func:`a8w8_matmul`. Through torch's quantized
    tensors (deprecated by torch: where they are gone, :func:`a8w8_available` says no)."""
    import warnings

    import torch

    engine = torch.backends.quantized.engine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.backends.quantized.engine = "fbgemm"
            zeros = torch.zeros(q.shape[0], dtype=torch.long)
            qt = torch._make_per_channel_quantized_tensor(q.contiguous(), scale.double(), zeros, 0)
            return torch.ops.quantized.linear_prepack(qt, None)
        finally:
            torch.backends.quantized.engine = engine


def a8w8_matmul(x2: torch.Tensor, packed) -> torch.Tensor:
    """``x2 [M, K] -> [M, N]`` in ``x2``'s dtype by FBGEMM's dynamic int8 linear: the activations
    quantized as the product runs to 8 bits, one asymmetric scale for the whole ``[M, K]`` input
    (``a = (max(x, 0) - min(x, 0)) / 255``, a zero point), int32 sums of u8 x s8 products (AVX-512
    VNNI where the CPU has it), then ``* a * s[n]`` in float32. One scale for the input: run on one
    row at a time, so that a row's result depends on that row alone."""
    import torch

    return torch.ops.quantized.linear_dynamic(x2.float(), packed, False).to(x2.dtype)


@functools.cache
def a8w8_available() -> bool:
    """Whether :func:`a8w8_matmul` runs here, exactly on the extreme products: FBGEMM in this
    torch, and sums of u8 x s8 pairs that do not saturate (where a CPU has no VNNI, FBGEMM's
    16-bit pair sums would overflow without ``reduce_range``, which halves the activations' steps)."""
    import torch

    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        y = a8w8_matmul(torch.ones(1, 64), a8w8_pack(torch.full((16, 64), 127, dtype=torch.int8), torch.ones(16) / 127))
    except Exception:  # noqa: BLE001 - any failure: the kernel is not available
        return False
    return bool(((y - 64).abs() < 1e-3).all())


def a8w8r_pack(q: torch.Tensor) -> torch.Tensor:
    """oneDNN's packed form of an int8 weight ``q`` ``[N, K]`` for :func:`a8w8r_matmul` (an opaque
    oneDNN tensor of ``N * K`` bytes, in a layout of this CPU)."""
    import torch

    return torch.ops.onednn.qlinear_prepack(q.contiguous(), None)


#: The activations' zero point of a8w8r: ``u = round(x / a) + 128`` in 1..255 (oneDNN's int8 linear
#: runs u8 x s8 products; its s8 activations run a reference loop, hundreds of times slower).
A8W8R_ZERO = 128


def a8w8r_quantize(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x2`` ``[M, K]`` in 8 bits with its own scale, symmetric: ``(u [M, K] uint8,
    a [M, 1] float32)`` with ``x ~ a (u - 128)``, ``a = max_k |x[m, k]| / 127`` (a row of zeros: a
    tiny ``a``, ``u = 128``), ``u - 128 = floor(x / a + 1/2)`` (the quotient in float32) in
    -127..127: ``|x - a (u - 128)| <= a / 2``."""
    import torch

    a = x2.abs().amax(1, keepdim=True).float().clamp_(min=127 * torch.finfo(torch.float32).tiny).div_(127)
    u = torch.div(x2, a).add_(A8W8R_ZERO + 0.5).to(torch.int32).to(torch.uint8)  # (floor: the sum is > 0)
    return u, a


def a8w8r_matmul(x2: torch.Tensor, packed, scale: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """``x2 [M, K] -> [M, N]`` in ``x2``'s dtype by oneDNN's int8 linear with a scale per row:
    :func:`a8w8r_quantize`, then ``y[m, n] = a[m] s[n] sum_k (u[m, k] - 128) q[n, k]``, the sums exact
    in int32 (u8 x s8 products, AVX-512 VNNI), ``* s[n]`` (``scale`` float32 ``[N]``; ``zeros`` its
    zero points, int64 zeros ``[N]``) and ``* a[m]`` in float32, then rounded once to the dtype.
    Every step is per row or per element: a row's result depends on that row alone."""
    import torch

    u, a = a8w8r_quantize(x2)
    y = torch.ops.onednn.qlinear_pointwise(
        u, 1.0, A8W8R_ZERO, packed, scale, zeros, None, 1.0, 0, torch.float32, "none", [], ""
    )  # [M, N] float32: s[n] * the integer sums
    return torch.mul(y, a, out=torch.empty(y.shape, dtype=x2.dtype))


@functools.cache
def a8w8r_missing() -> str | None:
    """Why :func:`a8w8r_matmul` does not run here (None: it does, exactly on the extreme products):
    oneDNN or its int8 linear missing from this torch, or u8 x s8 pair sums that saturate (a CPU
    without VNNI, where oneDNN sums pairs in 16 bits)."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return "oneDNN (mkldnn) not in this torch"
    if not (hasattr(torch.ops.onednn, "qlinear_prepack") and hasattr(torch.ops.onednn, "qlinear_pointwise")):
        return "oneDNN's int8 linear (onednn::qlinear_prepack / qlinear_pointwise) not in this torch"
    try:
        packed = a8w8r_pack(torch.full((16, 64), 127, dtype=torch.int8))
        scale, zeros = torch.full((16,), 1 / 127), torch.zeros(16, dtype=torch.long)
        x = torch.tensor([[1.0] * 64, [-1.0] * 64], dtype=torch.bfloat16)  # u = 255 and 1: the extremes
        y = a8w8r_matmul(x, packed, scale, zeros).float()  # [2, 16]: 64 and -64
    except Exception as exc:  # noqa: BLE001 - any failure: the kernel is not available
        return f"oneDNN's int8 linear fails: {type(exc).__name__}: {str(exc)[:200]}"
    want = torch.tensor([[64.0], [-64.0]])
    if not bool(((y - want).abs() < 1e-3).all()):
        return "oneDNN's int8 linear saturates its u8 x s8 sums (no VNNI)"
    return None


def _quantized_linear_class():
    import torch
    from torch import nn

    class QuantizedLinear(nn.Module):
        """A weight-only quantized ``nn.Linear`` (see the module docstring for the maths).

        Buffers (built at load for this CPU; not meant to be saved): int8 ``qweight`` int8
        ``[N, K]`` and ``scales`` ``[N]``; int4 ``qweight`` uint8 ``[N, K/2]`` in the CPU kernel's
        packed layout and ``scales_zeros`` ``[K/g, N, 2]``; scales in ``dtype``, the activations'
        dtype. ``dense``: the dequantized weight in ``dtype`` (oneDNN-prepacked where it can be),
        run by products of ``dense_from`` rows or more; None: every product runs the integer
        kernel. ``a8w8``: an int8 weight packed for :func:`a8w8_matmul`, run by one-row products
        (None: none). ``a8w8r``: an int8 weight packed for :func:`a8w8r_matmul`, run by products
        of ``a8w8r_from`` rows or more below ``dense_from`` (None: none). ``bias`` stays the
        original parameter. :attr:`kernels` says which kernel runs each row count.
        """

        def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype):
            super().__init__()
            if dtype not in kernel_dtypes():
                raise ValueError(f"quantized linears run float32 / bfloat16 / float16 activations, not {dtype}")
            self.out_features, self.in_features = qw.shape
            self.scheme, self.group, self.dtype = qw.scheme, qw.group, dtype
            self.bias = bias
            self.dense_from: int | None = None
            self.register_buffer("dense", None, persistent=False)
            self.dense_packed = False
            self.a8w8 = None  # FBGEMM's packed int8 weight: one-row products (set_a8w8)
            self.a8w8r = None  # oneDNN's packed int8 weight: a8w8r_from rows and more (set_a8w8r)
            self.a8w8r_from: int | None = None
            if qw.scheme == "int8":
                self.register_buffer("qweight", qw.q.contiguous(), persistent=False)  # [N, K] int8
                self.register_buffer("scales", qw.scale.to(dtype), persistent=False)  # [N]
            elif qw.scheme == "int4":
                n, k = qw.shape
                if qw.group not in INT4_GROUPS or k % qw.group or n % 16:
                    raise ValueError(f"int4 kernel: group {qw.group} of {INT4_GROUPS}, K % group == 0, N % 16 == 0")
                packed = torch._convert_weight_to_int4pack_for_cpu(qw.q.to(torch.int32), 1)  # [N, K/2] uint8
                self.register_buffer("qweight", packed, persistent=False)
                scale = qw.scale.to(dtype)  # [N, K/g]: the kernel's own rounding of s and z
                zero = (qw.min + 8 * qw.scale).to(dtype)
                self.register_buffer(
                    "scales_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous(), persistent=False
                )
            else:
                raise ValueError(f"unknown quantization scheme {qw.scheme!r}")

        # -------------------------------------------------------------- kernels

        def int_matmul(self, x2: torch.Tensor) -> torch.Tensor:
            """``x2 [M, K] -> [M, N]`` by the integer kernel (no bias)."""
            if self.scheme == "int8":
                return torch._weight_int8pack_mm(x2, self.qweight, self.scales)
            return torch._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group, self.scales_zeros)

        def dense_weight(self) -> torch.Tensor:
            """The weight the integer kernel computes with, ``[N, K]`` in ``dtype``, read back
            from its own buffers: exact in float32; in bf16 / fp16, the kernel's float32 weight
            rounded once. Runs the integer kernel on the identity (K rows, a slice at a time):
            for checks, slow on large layers."""
            k = self.in_features
            cols = []
            for start in range(0, k, 256):
                eye = torch.eye(k, dtype=self.dtype)[start : start + 256]  # [r, K]
                cols.append(self.int_matmul(eye))  # [r, N] = W^T rows
            return torch.cat(cols).t().contiguous()

        def set_dense(self, w: torch.Tensor | None, from_rows: int | None) -> int:
            """Run products of ``from_rows`` rows or more on ``w`` ``[N, K]`` (``dtype``; None:
            drop the dense copy); bytes the copy holds."""
            if w is None or from_rows is None:
                self.dense, self.dense_from, self.dense_packed = None, None, False
                return 0
            w = w.to(self.dtype).contiguous()
            self.dense_packed = _dense_ok(self.dtype)
            self.dense = torch.ops.mkldnn._reorder_linear_weight(w, None) if self.dense_packed else w
            self.dense_from = from_rows
            return w.numel() * w.element_size()

        def set_a8w8(self, on: bool) -> int:
            """Run one-row products by :func:`a8w8_matmul` (int8 only: 8-bit activations, the weight
            ``q * s`` with ``s`` as the int8 kernel reads it) or not; bytes its packed weight holds."""
            if not (on and self.scheme == "int8"):
                self.a8w8 = None
            elif self.a8w8 is None:
                self.a8w8 = a8w8_pack(self.qweight, self.scales.float())
            return 0 if self.a8w8 is None else self.qweight.numel()

        def a8w8_matmul(self, x2: torch.Tensor) -> torch.Tensor:
            """``x2 [1, K] -> [1, N]`` by the a8w8 kernel (no bias)."""
            return a8w8_matmul(x2, self.a8w8)

        def set_a8w8r(self, from_rows: int | None) -> int:
            """Run products of ``from_rows`` rows or more (below ``dense_from``; one row: a8w8
            first) by :func:`a8w8r_matmul` (None: never); bytes its packed weight holds. int8 in
            bf16 / fp16 only (float32 is the exactness dtype: never 8-bit activations)."""
            if from_rows is None or self.scheme != "int8" or str(self.dtype).removeprefix("torch.") not in A8W8_DTYPES:
                self.a8w8r, self.a8w8r_from = None, None
                return 0
            if self.a8w8r is None:
                self.a8w8r = a8w8r_pack(self.qweight)
                self.a8w8r_scale = self.scales.float()  # [N]: the weight q * s the int8 kernel reads
                self.a8w8r_zeros = torch.zeros(self.out_features, dtype=torch.long)
            self.a8w8r_from = from_rows
            return self.qweight.numel()

        def a8w8r_matmul(self, x2: torch.Tensor) -> torch.Tensor:
            """``x2 [M, K] -> [M, N]`` by the a8w8r kernel (no bias)."""
            return a8w8r_matmul(x2, self.a8w8r, self.a8w8r_scale, self.a8w8r_zeros)

        def dense_matmul(self, x: torch.Tensor) -> torch.Tensor:
            if self.dense_packed:
                return torch.ops.mkldnn._linear_pointwise(x, self.dense, self.bias, "none", [], "")
            return nn.functional.linear(x, self.dense, self.bias)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
            rows = x.numel() // self.in_features
            same = x.dtype == self.dtype  # (else the integer kernel: the kernels take their scales' dtype)
            if same and self.dense is not None and rows >= self.dense_from and (rows > 1 or self.a8w8 is None):
                return self.dense_matmul(x)
            x2 = x.reshape(rows, self.in_features)  # [M, K]
            if not same:
                y = self.int_matmul(x2.to(self.dtype)).to(x.dtype)
            elif rows == 1 and self.a8w8 is not None:
                y = self.a8w8_matmul(x2)
            elif self.a8w8r is not None and rows >= self.a8w8r_from:
                y = self.a8w8r_matmul(x2.contiguous())
            else:
                y = self.int_matmul(x2.contiguous())
            y = y.reshape(*x.shape[:-1], -1)  # [..., N] (out_features may name a gathered head's N)
            return y if self.bias is None else y + self.bias

        def kernel_of(self, rows: int) -> str:
            """The kernel that runs a product of ``rows`` rows in ``dtype`` (as :meth:`forward` picks)."""
            if rows == 1 and self.a8w8 is not None:
                return "a8w8"
            if self.dense is not None and rows >= self.dense_from:
                return "dense"
            if self.a8w8r is not None and rows >= self.a8w8r_from:
                return "a8w8r"
            return "int"

        @property
        def kernels(self) -> dict[int, str]:
            """Which kernel runs each row count (activations in ``dtype``): ``{rows: kernel}``, a
            kernel running from its row count up to the next entry's (the last: every row count
            above); kernels ``int``, ``a8w8`` (one row), ``a8w8r``, ``dense``."""
            table, last = {}, None
            for rows in sorted({1, 2} | {r for r in (self.a8w8r_from, self.dense_from) if r}):
                if (kernel := self.kernel_of(rows)) != last:
                    table[rows] = last = kernel
            return table

        @property
        def kernel_name(self) -> str:
            """What a cost profile depends on: ``int4g32``, ``int8`` (``int8+a8w8``: one-row products
            by a8w8; ``+a8w8r@R``: products of R rows or more by a8w8r), with ``@dense_from``."""
            name = (
                f"int4g{self.group}" if self.scheme == "int4" else "int8" + ("+a8w8" if self.a8w8 is not None else "")
            )
            if self.a8w8r is not None:
                name += f"+a8w8r@{self.a8w8r_from}"
            return f"{name}@{self.dense_from}" if self.dense is not None else name

        def extra_repr(self) -> str:
            group = f", group={self.group}" if self.scheme == "int4" else ""
            return (
                f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scheme={self.scheme}{group}, dtype={self.dtype}, dense_from={self.dense_from}, "
                f"a8w8={self.a8w8 is not None}, a8w8r_from={self.a8w8r_from}"
            )

    return QuantizedLinear


@functools.cache
def quantized_linear_class():
    """The :class:`QuantizedLinear` class (built on first use: torch is imported lazily)."""
    return _quantized_linear_class()


def _fp8_linear_class():
    import torch
    from torch import nn

    class Fp8Linear(nn.Module):
        """An ``nn.Linear`` with its weight in float8_e4m3fn and a scale per output channel, run by
        ``torch._scaled_mm`` (CUDA, compute capability 8.9 or more; also on CPU in recent torch).

        ``qweight`` float8_e4m3fn ``[N, K]`` row-major: its transpose is the column-major ``[K, N]``
        operand ``_scaled_mm`` takes; ``wscale`` float32 ``[1, N]``. Each call quantizes its
        activations dynamically, one scale per row (token): ``x_q = fp8(x / a)``, ``a = max|x| / 448``
        a row, ``[M, 1]``; then ``y = (x_q @ q^T) * a * s`` in one kernel. Per-token, not one scale
        for the tensor: a per-channel weight scale is ``_scaled_mm``'s row-wise mode, which takes a
        row-wise activation scale, needs no calibration, and keeps one outlier token from flattening
        the others. Outputs in bfloat16 (what the row-wise kernel writes everywhere), then in the
        activations' dtype; ``bias`` (the original parameter) is added after. K and N must be
        multiples of 16.
        """

        def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None):
            super().__init__()
            if qw.scheme != "fp8":
                raise ValueError(f"Fp8Linear takes an fp8 weight, not {qw.scheme!r}")
            self.out_features, self.in_features = qw.shape
            if self.out_features % 16 or self.in_features % 16:
                raise ValueError(f"fp8 kernel: K and N multiples of 16, not {qw.shape}")
            self.scheme, self.group = "fp8", None
            self.bias = bias
            self.register_buffer("qweight", qw.q.contiguous(), persistent=False)  # [N, K] float8_e4m3fn
            self.register_buffer("wscale", qw.scale.float().reshape(1, -1).contiguous(), persistent=False)  # [1, N]

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
            x2 = x.reshape(-1, self.in_features)  # [M, K]
            amax = x2.abs().amax(1, keepdim=True).float()  # [M, 1]
            ascale = (amax / FP8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)  # [M, 1]
            xq = (x2.float() / ascale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # [M, K] row-major
            y = torch._scaled_mm(xq, self.qweight.t(), ascale, self.wscale, out_dtype=torch.bfloat16)  # [M, N]
            y = y.to(x.dtype).reshape(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias

        @property
        def kernel_name(self) -> str:
            return "fp8"

        def extra_repr(self) -> str:
            return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, scheme=fp8"

    return Fp8Linear


@functools.cache
def fp8_linear_class():
    """The :class:`Fp8Linear` class (built on first use: torch is imported lazily)."""
    return _fp8_linear_class()


def __getattr__(name: str):
    if name == "QuantizedLinear":
        return quantized_linear_class()
    if name == "Fp8Linear":
        return fp8_linear_class()
    raise AttributeError(name)


def quantized_linear(qw: QuantizedWeight, bias=None, dtype=None, dense: bool | int = False):
    """A :class:`QuantizedLinear` of ``qw`` (``dtype`` default bfloat16). ``dense``: an int, the
    rows from which the dense copy runs (True: 1, every product); False: none."""
    import torch

    mod = quantized_linear_class()(qw, bias, dtype or torch.bfloat16)
    if dense is not False:
        mod.set_dense(_dense_of(qw, mod), int(dense))
    return mod


def _dense_of(qw: QuantizedWeight, mod, chunk: int = 256) -> torch.Tensor:
    """The dense copy of ``mod`` (built from ``qw``) ``[N, K]`` in ``mod.dtype``: the weight the
    integer kernel computes with, ``q * s`` (int8) or ``(q - 8) * s + z`` (int4) in float32 from
    the scales as it reads them (rounded to ``mod.dtype``), then rounded once to ``mod.dtype``;
    ``chunk`` rows at a time (the float32 temporaries stay in the caches)."""
    import torch

    n, k = qw.shape
    out = torch.empty(n, k, dtype=mod.dtype)
    if qw.scheme == "int8":
        scale = mod.scales.float()  # [N]
    else:
        scale, zero = mod.scales_zeros.float().transpose(0, 1).unbind(-1)  # [N, K/g] each
    for r in range(0, n, chunk):
        rows = slice(r, min(n, r + chunk))
        if qw.scheme == "int8":
            w = qw.q[rows].float().mul_(scale[rows, None])
        else:
            w = qw.q[rows].float().sub_(8).reshape(-1, k // qw.group, qw.group)
            w = w.mul_(scale[rows, :, None]).add_(zero[rows, :, None]).reshape(-1, k)
        out[rows] = w
    return out


# ------------------------------------------------------------------------------------------------
# the row count from which the dense copy runs


def _best_seconds(runners: dict[Any, Callable[[], Any]], repeats: tuple[int, int] | int) -> dict[Any, float]:
    """Best wall seconds of each runner over interleaved rounds (viasd.precision's way: a pause of
    the machine slows one round of every runner, not every round of one); ``repeats`` (lo, hi):
    as many rounds as PROBE_BUDGET_S allows after a first timed one, within them."""
    from viasd.precision import _best_interleaved

    if isinstance(repeats, int):
        return _best_interleaved(runners, repeats)
    lo, hi = repeats
    first = _best_interleaved(runners, 1)
    rounds = int(min(hi, max(lo, PROBE_BUDGET_S / max(sum(first.values()), 1e-9))))
    rest = _best_interleaved(runners, rounds)
    return {key: min(first[key], rest[key]) for key in runners}


def last_level_cache_bytes() -> int:
    """This CPU's largest cache (sysfs on Linux; 32 MiB where it does not say)."""
    import glob

    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(path).read().strip().upper()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1:], 0))
        except (OSError, ValueError):
            continue
    return max(sizes, default=32 << 20)


#: The probes cycle through copies of a layer holding this many times the last-level cache.
RING_CACHES = 4
RING_MAX = 64


def _ring(mod) -> list:
    """``mod`` and copies of its buffers (shallow module copies), enough that they hold
    RING_CACHES times the last-level cache (at most RING_MAX): a probe that cycles through them
    reads its weights from memory, as a decoding step does (every other layer's weights pass
    through the caches before a layer comes round again), not from a cache that one repeated
    product keeps warm."""
    import copy

    held = sum(b.numel() * b.element_size() for b in mod.buffers())
    packed = [attr for attr in ("a8w8", "a8w8r") if getattr(mod, attr, None) is not None]
    held += len(packed) * mod.qweight.numel()  # (int8 packed copies: a byte a weight)
    count = min(RING_MAX, max(1, -(-RING_CACHES * last_level_cache_bytes() // max(held, 1))))
    ring = [mod]
    for _ in range(count - 1):
        c = copy.copy(mod)
        c._buffers = {k: (None if v is None else v.clone()) for k, v in mod._buffers.items()}
        if "a8w8" in packed:  # (not buffers: packed again from the copy's own integers)
            c.a8w8 = None
            c.set_a8w8(True)
        if "a8w8r" in packed:
            c.a8w8r = None
            c.set_a8w8r(mod.a8w8r_from)
        ring.append(c)
    return ring


def _cycling(it, method: str, x) -> Callable[[], Any]:
    """A runner calling ``method(x)`` on the next module of ``it`` (an ``itertools.cycle`` over a
    ring that every runner of a probe shares: two calls in a row never read the same copy)."""
    return lambda: getattr(next(it), method)(x)


def probe_dense_from(
    mod, rows: tuple[int, ...] = PROBE_ROWS, repeats: tuple[int, int] | int = PROBE_REPEATS
) -> tuple[int | None, dict]:
    """Time the kernels ``mod`` holds (its integer kernel, its dense copy, which it must hold, and
    where it holds them a8w8 on one row and a8w8r) at ``rows`` rows (random activations,
    interleaved, best of ``repeats`` rounds, the weights read from memory: :func:`_ring`). Returns
    the fewest rows from which :func:`kernel_table` runs the dense copy (None: none), and the
    seconds by ``int@M`` / ``dense@M`` / ``a8w8@1`` / ``a8w8r@M``."""
    import itertools

    import torch

    g = torch.Generator().manual_seed(0)
    ring = itertools.cycle(_ring(mod))
    runners = {}
    for m in rows:
        x = torch.randn(m, mod.in_features, generator=g).to(mod.dtype)  # [M, K]
        runners[f"int@{m}"] = _cycling(ring, "int_matmul", x)
        runners[f"dense@{m}"] = _cycling(ring, "dense_matmul", x)
        if m == 1 and getattr(mod, "a8w8", None) is not None:
            runners["a8w8@1"] = _cycling(ring, "a8w8_matmul", x)
        if getattr(mod, "a8w8r", None) is not None:
            runners[f"a8w8r@{m}"] = _cycling(ring, "a8w8r_matmul", x)
    seconds = _best_seconds(runners, repeats)
    del ring, runners
    return _first(kernel_table(seconds, rows), "dense"), seconds


#: The kernels of several rows, ordered by how fast their cost grows with the rows: the integer
#: kernel (int4 / int8) the fastest, then a8w8r, then the dense copy (flat until its blocking fills).
KERNEL_ORDER = ("int", "a8w8r", "dense")


def kernel_table(seconds: dict, rows: tuple[int, ...] = PROBE_ROWS, offered=None) -> dict[int, str]:
    """The kernel each row count runs, from a probe's ``seconds`` (``kernel@M``) at ``rows``:
    ``{rows: kernel}``, a kernel running from its row count up to the next entry's, the last one
    every count above. Of the kernels timed (and ``offered``: None, all), from the most rows down,
    each probed count runs the fastest of the kernels that grow no slower than the one chosen
    above it (:data:`KERNEL_ORDER`; a tie goes to the faster-growing): a kernel runs a count only
    where it, or one that grows slower, wins every count above (a win below a loss does not
    count). One row runs a8w8 where it beats that choice."""
    ok = (lambda kernel: True) if offered is None else (lambda kernel: kernel in offered)
    chosen: dict[int, str] = {}
    allowed = len(KERNEL_ORDER)
    for m in sorted(rows, reverse=True):
        timed = [
            (seconds[f"{k}@{m}"], i) for i, k in enumerate(KERNEL_ORDER[:allowed]) if ok(k) and f"{k}@{m}" in seconds
        ]
        allowed = min(timed)[1] + 1 if timed else 1
        chosen[m] = KERNEL_ORDER[allowed - 1]
    first = min(rows)
    if first == 1 and ok("a8w8") and seconds.get("a8w8@1", float("inf")) < seconds.get(f"{chosen[1]}@1", 0.0):
        if 2 not in chosen:  # (a8w8 runs one row only: the rows up to the next probed count run the choice at 1)
            chosen[2] = chosen[1]
        chosen[1] = "a8w8"
    table, last = {}, None
    for m in sorted(chosen):
        if chosen[m] != last:
            table[1 if m == first else m] = last = chosen[m]
    return table


def _held(table: dict[int, str], copy_bytes: dict[str, int]) -> int:
    """Bytes of the copies (``copy_bytes`` by kernel) that the kernels of ``table`` run."""
    return sum(size for kernel, size in copy_bytes.items() if kernel in table.values())


def _first(table: dict[int, str], kernel: str) -> int | None:
    """The fewest rows a ``kernel_table`` runs ``kernel`` at (None: none)."""
    return next((rows for rows, k in table.items() if k == kernel), None)


#: (scheme, group, K, N, dtype, threads) -> (dense_from, seconds): one probe per shape a process.
_PROBES: dict[tuple, tuple[int | None, dict]] = {}
#: Bumped when the probe measures differently: older cached probes are measured again.
PROBE_METHOD = 3


def _probe_table(from_rows: int | None, seconds: dict, rows: tuple[int, ...], offered) -> dict[int, str]:
    """The kernel table of a probe (:func:`kernel_table` of the kernels ``offered`` to a linear);
    a probe without the integer kernel's times at every count (one injected by a test, or none
    made for lack of memory) gives its dense crossover only: the integer kernel below
    ``from_rows``, the dense copy from there."""
    if all(f"int@{m}" in seconds for m in rows):
        return kernel_table(seconds, rows, offered)
    return {1: "dense"} if from_rows == 1 else {1: "int", **({from_rows: "dense"} if from_rows else {})}


def _probe_file(cache_dir, key: tuple, rows: tuple[int, ...]):
    """Where the probe of ``key`` on this machine is cached under ``cache_dir`` (what it depends
    on: the shape, scheme, dtype, threads, the CPU and torch), and that key as JSON."""
    import hashlib
    import json
    import platform
    from pathlib import Path

    import torch

    from viasd.precision import cpu_bf16_flags

    scheme, group, k, n, dtype, threads = key
    full = {
        "scheme": scheme,
        "group": group,
        "shape": [k, n],
        "dtype": str(dtype).removeprefix("torch."),
        "threads": threads,
        "rows": list(rows),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "bf16_flags": sorted(cpu_bf16_flags()),
        "cpu": cpu_model() or platform.machine(),
        "llc": last_level_cache_bytes(),
        "torch": torch.__version__,
        "method": PROBE_METHOD,
    }
    digest = hashlib.sha256(json.dumps(full, sort_keys=True).encode()).hexdigest()[:20]
    return Path(cache_dir) / f"probe-{digest}.json", full


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo), None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cached_probe(mod, key: tuple, rows: tuple[int, ...], cache_dir) -> tuple[int | None, dict]:
    """:func:`probe_dense_from` of ``mod``, once per ``key`` in a process and, with ``cache_dir``,
    once per machine (a JSON file a probe; a damaged one is measured again)."""
    import json

    if key in _PROBES:
        return _PROBES[key]
    path = full = None
    if cache_dir is not None:
        path, full = _probe_file(cache_dir, key, rows)
        try:
            data = json.loads(path.read_text())
            if data["key"] == full:
                _PROBES[key] = data["dense_from"], data["seconds"]
                return _PROBES[key]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    _PROBES[key] = probe_dense_from(mod, rows)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"key": full, "dense_from": _PROBES[key][0], "seconds": _PROBES[key][1]}))
            tmp.replace(path)
        except OSError:
            pass
    return _PROBES[key]


def _reset_cache() -> None:
    """Forget the probes (tests)."""
    _PROBES.clear()
    _auto_cpu.cache_clear()


# ------------------------------------------------------------------------------------------------
# whole models


@dataclass
class QuantReport:
    """What :func:`quantize_model` did: ``quantized`` linear names by kernel, ``skipped`` with the
    reason, ``bytes`` the quantized weights hold, ``dense_bytes`` the dense copies,
    ``kernels_by_rows`` the kernel of each row count by shape ``scheme:KxN`` (:func:`kernel_table`),
    ``dense_from`` the rows from which the dense copy runs by shape (None: no dense copy),
    ``a8w8`` whether one row runs a8w8 by int8 shape, ``a8w8_bytes`` / ``a8w8r_bytes`` their
    packed copies, ``probe_seconds``."""

    scheme: str
    group: int | None = None
    quantized: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    bytes: int = 0
    replaced_bytes: int = 0
    dense_bytes: int = 0
    dense_from: dict[str, int | None] = field(default_factory=dict)
    probe_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    seconds: float = 0.0
    sources: dict[str, str] = field(default_factory=dict)  # name -> QuantizedWeight.source
    a8w8: dict[str, bool] = field(default_factory=dict)  # int8 shape KxN -> its one-row products by a8w8
    a8w8_bytes: int = 0  # the a8w8 kernel's packed weights
    a8w8_note: str | None = None  # why no int8 linear was offered the a8w8 kernel
    kernels_by_rows: dict[str, dict[int, str]] = field(default_factory=dict)  # shape -> {rows: kernel from there}
    a8w8r_bytes: int = 0  # the a8w8r kernel's packed weights
    a8w8r_note: str | None = None  # why no int8 linear was offered the a8w8r kernel

    @property
    def copy_bytes(self) -> int:
        """Bytes of the copies beside the quantized weights: dense, a8w8 and a8w8r."""
        return self.dense_bytes + self.a8w8_bytes + self.a8w8r_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "scheme": self.scheme,
            "group": self.group,
            "linears": len(self.quantized),
            "kernels": dict(sorted(_count(self.quantized.values()).items())),
            "sources": dict(sorted(_count(self.sources.values()).items())),
            "skipped": dict(self.skipped),
            "bytes": self.bytes,
            "replaced_bytes": self.replaced_bytes,
            "dense_bytes": self.dense_bytes,
            "dense_from_rows": dict(self.dense_from),
            "a8w8_one_row": dict(self.a8w8),
            "a8w8_bytes": self.a8w8_bytes,
            **({"a8w8_note": self.a8w8_note} if self.a8w8_note else {}),
            "kernels_by_rows": {shape: {str(r): k for r, k in t.items()} for shape, t in self.kernels_by_rows.items()},
            "a8w8r_bytes": self.a8w8r_bytes,
            **({"a8w8r_note": self.a8w8r_note} if self.a8w8r_note else {}),
            "seconds": round(self.seconds, 2),
        }


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _targets(model, include_lm_head: bool, report: QuantReport) -> list[tuple[str, Any]]:
    """The ``nn.Linear`` modules of the decoder layers, and the LM head unless excluded or tied
    to the input embeddings (its weight must stay dense for the embedding lookups)."""
    from torch import nn

    out = []
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear:
            continue
        if name.split(".")[-1] == "lm_head":
            emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
            if not include_lm_head:
                report.skipped[name] = "lm_head excluded"
                continue
            if emb is not None and emb.weight is mod.weight:
                report.skipped[name] = "tied to the input embeddings"
                continue
        elif ".layers." not in f".{name}":
            report.skipped[name] = "not in a decoder layer"
            continue
        out.append((name, mod))
    return out


def quantize_model(
    model,
    scheme: str,
    *,
    group: int = INT4_GROUP,
    include_lm_head: bool = True,
    dense: bool = True,
    keep_free_bytes: int | None = None,
    weights: Callable[[str, Any], QuantizedWeight | None] | None = None,
    probe_rows: tuple[int, ...] = PROBE_ROWS,
    probe_cache=None,
) -> QuantReport:
    """Replace the ``nn.Linear`` modules of ``model``'s decoder layers (and its LM head, unless
    ``include_lm_head`` is off or it is tied to the embeddings) by :class:`QuantizedLinear`, in
    place, on CPU. ``scheme``: ``int8`` or ``int4`` (``group`` inputs a group); or ``fp8``:
    :class:`Fp8Linear` modules wherever the weights are (the engine asks for it on CUDA only; no
    dense copies: one kernel runs every row count; K and N multiples of 16).

    ``weights(name, linear)``: the quantized weight of a linear from elsewhere (a GGUF file's own
    blocks, :mod:`viasd.quant_gguf`), or None to quantize it here by ``scheme``.

    ``dense``: probe the kernels on the first linear of each shape (:func:`probe_dense_from`) and
    run each row count on the fastest (:func:`kernel_table`): a dense copy for the products of
    many rows (2 bytes a weight in bf16); for int8 in bf16 / fp16, a8w8 for one row and a8w8r for
    several (1 byte a weight each); a copy only where some row count runs it, and unless it would
    leave less than ``keep_free_bytes`` free (default DENSE_KEEP_FREE_FRACTION of the machine's
    memory); ``probe_cache``: a directory where the probes are kept per machine (None:
    probed in each process). Activations run in the model's dtype (float32, bfloat16 or float16).
    A linear the kernels cannot take (int4: K not a multiple of ``group``, N not of 16) stays
    ``nn.Linear``, with the reason in ``skipped``.
    """
    import torch

    from viasd.precision import cpu_memory

    if scheme not in ("int8", "int4", "fp8"):
        raise ValueError(f"quantize_model: scheme must be int8 or int4 (CPU) or fp8, got {scheme!r}")
    t0 = time.perf_counter()
    report = QuantReport(scheme, group if scheme == "int4" else None)
    free, total = cpu_memory()
    keep = int(DENSE_KEEP_FREE_FRACTION * total) if keep_free_bytes is None else keep_free_bytes
    threads = torch.get_num_threads()
    a8w8_ok = dense and a8w8_available()
    a8w8r_ok = dense and a8w8r_missing() is None
    if scheme != "fp8" and not a8w8_ok:
        report.a8w8_note = (
            "no dense copies (the probe that picks it)" if not dense else "FBGEMM's int8 linear unavailable"
        )
    if scheme != "fp8" and not a8w8r_ok:
        report.a8w8r_note = "no dense copies (the probe that picks it)" if not dense else a8w8r_missing()
    for name, lin in _targets(model, include_lm_head, report):
        w = lin.weight
        if w.device.type != "cpu" and scheme != "fp8":
            report.skipped[name] = f"weight on {w.device}: the integer kernels run on CPU"
            continue
        if w.dtype not in kernel_dtypes():
            report.skipped[name] = f"weight is {w.dtype}: the kernels take float32 / bfloat16 / float16"
            continue
        n, k = w.shape
        qw = weights(name, lin) if weights is not None else None
        if qw is None:
            if scheme == "int4" and (k % group or n % 16):
                report.skipped[name] = f"int4: K={k} not a multiple of {group} or N={n} not of 16"
                continue
            if scheme == "fp8" and (k % 16 or n % 16):
                report.skipped[name] = f"fp8: K={k} or N={n} not a multiple of 16"
                continue
            qw = {"int8": quantize_int8, "fp8": quantize_fp8}.get(scheme, lambda w: quantize_int4(w, group))(w)
            if weights is not None:
                qw.source = "quantized at load (no source tensor matched the loaded weight)"
        with torch.no_grad():
            if scheme == "fp8":
                mod = fp8_linear_class()(qw, lin.bias)
            else:
                mod = quantized_linear_class()(qw, lin.bias, w.dtype)
        size, qw_source = qw.nbytes(w.element_size()), qw.source
        if dense and scheme != "fp8":  # (fp8's one kernel runs every row count)
            key = (qw.scheme, qw.group, k, n, w.dtype, threads)
            copy_bytes = {"dense": n * k * w.element_size(), "a8w8r": n * k, "a8w8": n * k}  # (the biggest first)
            int8_half = qw.scheme == "int8" and str(w.dtype).removeprefix("torch.") in A8W8_DTYPES
            offered = {"int", "dense"} | {kn for kn, ok in (("a8w8", a8w8_ok), ("a8w8r", a8w8r_ok)) if ok and int8_half}
            from_rows, seconds = None, {}
            if free - report.copy_bytes - copy_bytes["dense"] >= keep:
                if key not in _PROBES:
                    mod.set_dense(_dense_of(qw, mod), 1)
                    mod.set_a8w8("a8w8" in offered)
                    mod.set_a8w8r(1 if "a8w8r" in offered else None)
                from_rows, seconds = _cached_probe(mod, key, probe_rows, probe_cache)
            table = _probe_table(from_rows, seconds, probe_rows, offered)
            while (held := _held(table, copy_bytes)) and free - report.copy_bytes - held < keep:
                kernel = next(kn for kn in copy_bytes if kn in table.values())  # memory: the biggest copy goes
                offered.discard(kernel)
                table = _probe_table(None if kernel == "dense" else from_rows, seconds, probe_rows, offered)
                report.skipped[f"{name}.{kernel}"] = f"memory: no {kernel} copy (kernels by rows: {table})"
            shape = f"{qw.scheme}:{k}x{n}"
            report.probe_seconds.setdefault(shape, seconds)
            report.kernels_by_rows.setdefault(shape, table)
            report.dense_from.setdefault(shape, _first(table, "dense"))
            if int8_half and a8w8_ok:
                report.a8w8.setdefault(shape, table.get(1) == "a8w8")
            report.a8w8_bytes += mod.set_a8w8(table.get(1) == "a8w8")
            report.a8w8r_bytes += mod.set_a8w8r(_first(table, "a8w8r"))
            dense_from = _first(table, "dense")
            report.dense_bytes += mod.set_dense(_dense_of(qw, mod) if dense_from else None, dense_from)
        del qw
        _carry_hooks(lin, mod)  # (a tensor-parallel shard's collectives)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, mod)
        report.quantized[name] = mod.kernel_name
        report.sources[name] = qw_source
        report.bytes += size
        report.replaced_bytes += w.numel() * w.element_size()
    report.seconds = time.perf_counter() - t0
    return report


_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _carry_hooks(old, new) -> None:
    """Give ``new`` the forward hooks of ``old``, the module it replaces (a tensor-parallel
    projection's all-reduce or all-gather, viasd.parallel)."""
    for attr in _HOOK_DICTS:
        getattr(new, attr).update(getattr(old, attr))


# ------------------------------------------------------------------------------------------------
# the engine option


@dataclass(frozen=True)
class QuantChoice:
    """The weight quantization a model is served with, and why.

    ``scheme``: ``none``, ``int8`` or ``int4``; ``requested``: ``EngineConfig.quantization``;
    ``reason``: ``requested``, ``auto-int4`` (a built-in model, whose weights ship in 4 bits, on
    a CPU where the int4 kernel wins a one-row product), or why ``auto`` or the request is not
    applied (``auto-not-builtin``, ``auto-dtype``, ``auto-device``, ``auto-slower``, ``device``,
    ``dtype``; on a tensor-parallel rank ``auto-tensor-parallel``, ``tensor-parallel-backend``:
    :func:`engine_linears`). ``probe_seconds``: ``auto``'s one-row probe."""

    scheme: str
    requested: str
    reason: str
    probe_seconds: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "quantization": self.scheme,
            "quantization_requested": self.requested,
            "quantization_reason": self.reason,
            "quantization_probe_seconds": dict(self.probe_seconds),
        }


#: The product auto times: one row through a 1536 -> 8960 projection (viasd.precision's).
AUTO_PROBE = (1536, 8960)
#: auto quantizes when the int4 kernel's one-row product takes at most this share of the dense one's.
AUTO_MAX_RATIO = 0.8


@functools.cache
def _auto_cpu(dtype_name: str) -> tuple[bool, dict[str, float]]:
    """Whether the int4 kernel beats the dense (prepacked where it can be) kernel on a one-row
    :data:`AUTO_PROBE` product in ``dtype_name`` here, by :data:`AUTO_MAX_RATIO`, the weights read
    from memory (:func:`_ring`); the seconds."""
    import itertools

    import torch

    k, n = AUTO_PROBE
    dt = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) / k**0.5  # [N, K]
    ring = itertools.cycle(_ring(quantized_linear(quantize_int4(w), dtype=dt, dense=1)))
    x = torch.randn(1, k, generator=g).to(dt)  # [1, K]
    seconds = _best_seconds(
        {"int4@1": _cycling(ring, "int_matmul", x), "dense@1": _cycling(ring, "dense_matmul", x)}, PROBE_REPEATS
    )
    return seconds["int4@1"] <= AUTO_MAX_RATIO * seconds["dense@1"], seconds


def resolve_quantization(requested: str, device: str, dtype: str, builtin: bool) -> QuantChoice:
    """The scheme a model loaded in ``dtype`` on ``device`` is served with for ``requested``
    (``EngineConfig.quantization``); ``builtin``: it is a built-in model (its weights ship as a
    quantized GGUF).

    ``int8`` / ``int4`` are applied on CPU in float32 / bfloat16 / float16 (elsewhere: ``none``,
    with the reason). ``auto`` is ``int4`` for a built-in model in bfloat16 / float16 on a CPU
    where the int4 kernel's one-row product takes at most AUTO_MAX_RATIO of the dense kernel's
    (:func:`_auto_cpu`, once per process), else ``none``: other checkpoints are quantized only
    when asked, float32 and float64 are the exactness dtypes, and CUDA has no integer kernel
    here. ``fp8`` is applied on a CUDA device of compute capability 8.9 or more in bfloat16 /
    float16 / float32 and refused anywhere else (:class:`~viasd.errors.InvalidParameterError`
    naming ``quantization``: never a silent fallback)."""
    from viasd.errors import InvalidParameterError

    if requested not in SCHEMES:
        raise InvalidParameterError("quantization", f"must be one of {', '.join(SCHEMES)}, got {requested!r}")
    kind = str(device).split(":", 1)[0]
    if requested == "none":
        return QuantChoice("none", requested, "requested")
    if requested == "fp8":
        _check_fp8(device, dtype)
        return QuantChoice("fp8", requested, "requested")
    if requested != "auto":
        if kind != "cpu":
            return QuantChoice("none", requested, "device")
        if dtype not in ("float32", "bfloat16", "float16"):
            return QuantChoice("none", requested, "dtype")
        return QuantChoice(requested, requested, "requested")
    if kind != "cpu":
        return QuantChoice("none", requested, "auto-device")
    if not builtin:
        return QuantChoice("none", requested, "auto-not-builtin")
    if dtype not in ("bfloat16", "float16"):
        return QuantChoice("none", requested, "auto-dtype")
    wins, seconds = _auto_cpu(dtype)
    return QuantChoice("int4" if wins else "none", requested, "auto-int4" if wins else "auto-slower", seconds)


#: The compute capability from which CUDA runs ``torch._scaled_mm`` on fp8 (Ada, Hopper and later).
FP8_CAPABILITY = (8, 9)


def _check_fp8(device: str, dtype: str) -> None:
    """Refuse ``quantization: fp8`` (InvalidParameterError naming the field) off a CUDA device of
    compute capability FP8_CAPABILITY or more, or for a dtype other than bfloat16 / float16 / float32."""
    import torch

    from viasd.errors import InvalidParameterError

    if str(device).split(":", 1)[0] != "cuda":
        raise InvalidParameterError(
            "quantization",
            f"fp8 runs on CUDA devices (compute capability >= {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}), and this "
            f"engine's device is {device}; on CPU use int8 or int4",
        )
    if not torch.cuda.is_available():
        raise InvalidParameterError("quantization", f"fp8 needs a CUDA device, and torch sees none ({device})")
    capability = torch.cuda.get_device_capability(torch.device(device))
    if capability < FP8_CAPABILITY:
        raise InvalidParameterError(
            "quantization",
            f"fp8 needs compute capability >= {FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}; {device} has "
            f"{capability[0]}.{capability[1]}",
        )
    if dtype not in ("bfloat16", "float16", "float32"):
        raise InvalidParameterError("quantization", f"fp8 takes bfloat16 / float16 / float32 activations, not {dtype}")


def engine_linears(model, config, device: str, spec: str | None, dtype: str, *, tp=None, tp_backend: str = "torch"):
    """Prepare the linears of ``model`` (loaded from ``spec``, a built-in name or a directory, in
    ``dtype``) as an engine of ``config`` (an :class:`~viasd.config.EngineConfig`) runs them on
    ``device``: quantized by :func:`resolve_quantization` of ``config.quantization`` (a built-in
    model from its GGUF file's own blocks, :mod:`viasd.quant_gguf`; dense copies for many-row
    products only with ``config.packed_linears``), then the remaining plain linears
    prepacked (:func:`viasd.precision.optimize_linears`, with ``packed_linears``). Returns the
    :class:`~viasd.precision.LinearReport`, its ``quantization`` the choice and what was done
    (None where none was asked for). Call it before :class:`~viasd.runtime.MaskedLM` takes the
    modules, and after anything that checks the weights' fingerprint (a DIMR mask).

    ``tp``: the :class:`~viasd.parallel.TPGroup` of a tensor-parallel rank whose model is sharded
    (``tp_backend``). With the torch backend each rank quantizes its own slices
    (:func:`viasd.parallel.quantize_shard`: the ranks together compute what the unsharded model
    quantized alike computes) and its other linears keep their kernels; DeepSpeed's sharded
    linears are not quantized (reason ``tensor-parallel-backend``), nor does ``auto`` quantize a
    built-in model's ranks (``auto-tensor-parallel``: its GGUF blocks are not sliced)."""
    from viasd.models.embedded import BUILTIN_MODELS, cache_root
    from viasd.parallel import TPBackend, quantize_shard
    from viasd.precision import LinearReport, optimize_linears

    sharded = tp is not None and tp.world_size > 1
    builtin = spec in BUILTIN_MODELS
    choice = resolve_quantization(config.quantization, device, dtype, builtin)
    if sharded and choice.scheme != "none" and TPBackend(tp_backend) != TPBackend.TORCH:
        choice = QuantChoice("none", config.quantization, "tensor-parallel-backend")
    elif sharded and choice.reason == "auto-int4":
        choice = QuantChoice("none", config.quantization, "auto-tensor-parallel", choice.probe_seconds)
    done = None
    if choice.scheme != "none" and sharded:
        done = quantize_shard(
            model, choice.scheme, tp, dense=config.packed_linears, probe_cache=cache_root() / "quant"
        ).as_dict()
    elif choice.scheme == "fp8":  # (the head stays in the model's dtype: the logits are not rounded to bf16)
        done = quantize_model(model, "fp8", include_lm_head=False, dense=False).as_dict()
    elif choice.scheme != "none":
        weights = None
        if builtin:  # served from its own GGUF quantization (viasd.quant_gguf)
            from viasd.quant_gguf import cached_gguf, gguf_weights

            weights = gguf_weights(cached_gguf(spec), choice.scheme, model.config)
        done = quantize_model(
            model, choice.scheme, dense=config.packed_linears, weights=weights, probe_cache=cache_root() / "quant"
        ).as_dict()
    if sharded:  # (a sharded projection's collectives are hooks on its module: not swapped for a packed one)
        linears = LinearReport("off: sharded (its other linears keep their own kernels)")
    else:
        linears = optimize_linears(model, dtype, device) if config.packed_linears else LinearReport("off")
    if config.quantization != "none":
        linears.quantization = {**choice.as_dict(), **(done or {})}
    return linears
