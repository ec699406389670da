"""Which weight dtype a model runs in: ``dtype: auto`` and what it picked.

:func:`resolve_dtype` turns a requested dtype (``EngineConfig.dtype``) into a concrete one and
says why, as a :class:`DtypeChoice`:

* an explicit dtype (``bfloat16``, ``float16``, ``float32``, ``float64``) passes through
  (reason ``requested``);
* ``auto`` on CUDA is ``bfloat16`` (``float16`` on a GPU without bf16);
* ``auto`` on CPU is ``bfloat16`` when the CPU has native bf16 arithmetic (:func:`native_bf16`)
  *and* a short probe product (PROBE_SHAPE, :func:`probe_matmuls`) is not slower in bf16 than in
  float32; else ``float32``.
* Without native bf16, ATen widens every bf16 tile to float32 on the fly: a one-row product,
  which reads the weights once, gains from reading half the bytes; a product of a few rows is
  compute-bound and loses. So bf16 there runs **mixed kernels** (:func:`optimize_linears`,
  method ``mixed``): each linear keeps a packed float32 copy and runs a product of ``from_rows``
  rows or more in float32 on the widened input, fewer in plain bf16 (:func:`mixed_from_rows`,
  from a short probe). Memory is 2 + 4 bytes a weight against float32's 4 + 4. ``auto`` takes
  bf16 with them (reason ``no-native-bf16-mixed``) unless the float32 kernel wins a one-row
  product too (``from_rows`` 1: ``no-native-bf16``).
* Without mixed kernels (no oneDNN, or ``packed_linears`` off) ``auto`` probes the products of a
  decoding step at the engine's batch capacity ``rows`` (:func:`decode_shapes`) in each dtype and
  picks the dtype that serves a request faster at that load (:func:`request_speed`: its prompt,
  REFERENCE_PROMPT_TOKENS a generated token, priced as block rows, then the faster of `ar` and a
  reference `sd` cycle, :func:`decode_speed`): bf16 when its steps win by more than float32's
  cheap blocks and prefill buy back (reason ``no-native-bf16-decode``), else float32.

The CPU check and the probes run once per process and ``rows`` (cached), so a caller can resolve
once, load every tier with ``choice.dtype`` and record ``choice.as_dict()`` in its stats.
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "AUTO",
    "DECODE_SHAPES",
    "DTYPE_NAMES",
    "PROBE_SHAPE",
    "DtypeChoice",
    "cpu_bf16_flags",
    "cpu_capability",
    "decode_probe_seconds",
    "decode_shapes",
    "decode_speed",
    "engine_dtype",
    "request_speed",
    "native_bf16",
    "optimize_linears",
    "probe_matmul",
    "probe_matmuls",
    "resolve_dtype",
]

AUTO = "auto"
#: The concrete dtypes a config may name (``auto`` resolves to one of them).
DTYPE_NAMES = ("bfloat16", "float16", "float32", "float64")
#: (M, K, N) of the probe product: a 6-token block through a 1536 -> 4096 projection.
PROBE_SHAPE = (6, 1536, 4096)
#: Runs of the probe per dtype (after one warm-up); the best one counts.
PROBE_REPEATS = 5
#: (K, N) of the probes without native bf16: a 1536 -> 8960 projection (larger than the caches:
#: decoding reads its weights from memory).
DECODE_PROJECTION = (1536, 8960)
#: The reference `sd` cycle of decode_speed, set from the embedded pair on code: k draft tokens,
#: committing REFERENCE_TOKENS a cycle (below what fixed `sd` reaches, so that probe noise does
#: not flip the choice), the drafter's step at REFERENCE_DRAFTER of the verifier's.
REFERENCE_K = 5
REFERENCE_TOKENS = 3.6
REFERENCE_DRAFTER = 0.3
#: Prompt tokens a request prefills per token it generates, in request_speed: a prompt is a
#: many-row product, priced at the block's cost a row, which bf16 without native arithmetic loses
#: as it loses blocks, so a dtype chosen on decode steps alone can prefill far slower. One prompt
#: token a generated one: a HumanEval prompt against its completion, a chat's turn.
REFERENCE_PROMPT_TOKENS = 1.0
#: CPU flags (``/proc/cpuinfo`` spelling) that mean native bf16 dot products.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model is loaded in, and why.

    ``dtype``: the concrete dtype name (``bfloat16`` / ``float16`` / ``float32`` / ``float64``).
    ``requested``: what the configuration asked for (``auto`` or a dtype name).
    ``reason``: ``requested``, ``cuda``, ``cuda-no-bf16``, ``native-bf16``,
    ``native-bf16-probe-slower``, ``no-native-bf16``, ``no-native-bf16-mixed``,
    ``no-native-bf16-decode`` or ``device``.
    ``rows``: the rows a decoding step carries that the choice was made for (the engine's batch
    capacity, ``EngineConfig.max_batch``; only the CPU without native bf16 decides by it).
    ``cpu_capability``: ``torch.backends.cpu.get_cpu_capability()`` (``AVX2``, ``AVX512``, ...)
    on CPU, else None. ``native_bf16``: the CPU check of :func:`native_bf16` (None where it did
    not run). ``probe_seconds``: best time of the probe product per dtype name, or per
    ``dtype@rows`` without native bf16, or the mixed probe's ``bf16@rows`` / ``mixed@rows``
    (empty where no probe ran).
    """

    dtype: str
    requested: str
    device: str
    reason: str
    rows: int = 1
    cpu_capability: str | None = None
    native_bf16: bool | None = None
    probe_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: what stats, bench results and ``/v1/models`` record."""
        return {
            "dtype": self.dtype,
            "dtype_requested": self.requested,
            "dtype_reason": self.reason,
            "dtype_rows": self.rows,
            "device": self.device,
            "cpu_capability": self.cpu_capability,
            "native_bf16": self.native_bf16,
            "dtype_probe_seconds": dict(self.probe_seconds),
        }


def _canonical(requested: str) -> str:
    """Canonical dtype name of ``requested`` (aliases of :mod:`viasd.models.embedded`), or auto."""
    from viasd.models.embedded import normalize_dtype

    key = str(requested).removeprefix("torch.").lower()
    return AUTO if key == AUTO else normalize_dtype(key)


def cpu_capability() -> str:
    """``torch.backends.cpu.get_cpu_capability()``: the ATen kernels in use (honours
    ``ATEN_CPU_CAPABILITY``)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def cpu_bf16_flags() -> set[str]:
    """Which of :data:`BF16_FLAGS` the CPU reports: ``/proc/cpuinfo`` on Linux, else
    ``torch.cpu.get_capabilities()`` (cpuinfo) where torch has it; empty when neither says."""
    found: set[str] = set()
    if platform.system() == "Linux":
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("flags"):
                        found = {flag for flag in line.split(":", 1)[1].split() if flag in BF16_FLAGS}
                        break
            return found
        except OSError:
            pass
    try:
        import torch

        caps = torch.cpu.get_capabilities()  # torch >= 2.6
        found = {flag for flag in BF16_FLAGS if caps.get(flag)}
    except Exception:  # noqa: BLE001 - an older torch, or a platform cpuinfo does not know
        pass
    return found


def _onednn_bf16_enabled() -> bool:
    """oneDNN may use bf16 instructions: False when ``ONEDNN_MAX_CPU_ISA`` caps it below
    AVX-512, or where torch has no oneDNN."""
    import torch

    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:  # noqa: BLE001
        return False


def native_bf16() -> bool:
    """Whether this CPU computes bf16 natively: it reports AVX-512 BF16 or AMX BF16, oneDNN may
    use them, and ATen's kernels are not capped below AVX-512 (``ATEN_CPU_CAPABILITY``)."""
    return bool(cpu_bf16_flags()) and _onednn_bf16_enabled() and cpu_capability().upper().startswith("AVX512")


def _probe_runner(dtype_name: str, shape: tuple[int, int, int], packed: bool) -> Callable[[], Any]:
    """``F.linear(x [M, K], w [N, K])`` in ``dtype_name`` on CPU, ready to call. ``packed``: with
    the kernel :func:`optimize_linears` swaps in where it would (oneDNN-prepacked weights)."""
    import torch
    import torch.nn.functional as F

    m, k, n = shape
    dt = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dt)  # [M, K]
    linear = torch.nn.Linear(k, n, bias=False, dtype=dt)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)  # [N, K]
    if packed and torch.backends.mkldnn.is_available() and (dt == torch.float32 or _onednn_bf16_enabled()):
        packed_linear = packed_linear_class()(linear)
        return lambda: packed_linear(x)
    from_rows = mixed_from_rows() if packed and dt == torch.bfloat16 else None
    if from_rows is not None:  # (the mixed kernel: M decides)
        mixed = packed_linear_class()(linear, torch.float32, from_rows)
        return lambda: mixed(x)
    return lambda: F.linear(x, linear.weight)


def probe_matmuls(
    probes: Sequence[tuple[str, tuple[int, int, int]]], repeats: int = PROBE_REPEATS, packed: bool = False
) -> dict[tuple[str, tuple[int, int, int]], float]:
    """Best wall time in seconds of each ``(dtype_name, (M, K, N))`` product (:func:`_probe_runner`),
    after one warm-up run each. The probes run interleaved, one run of each per round, so that a
    pause of the machine (another process, the hypervisor) slows every probe it overlaps, not the
    whole of one dtype's: the choice rests on their ratios, which one slow round must not flip."""
    return _best_interleaved({probe: _probe_runner(*probe, packed) for probe in probes}, repeats)


def _best_interleaved(runners: dict[Any, Callable[[], Any]], repeats: int) -> dict[Any, float]:
    """Best wall seconds of each runner over ``repeats`` rounds after one warm-up call each, one
    call of every runner per round (:func:`probe_matmuls` says why)."""
    import torch

    best = dict.fromkeys(runners, float("inf"))
    with torch.inference_mode():
        for run in runners.values():
            run()
        for _ in range(repeats):
            for key, run in runners.items():
                t0 = time.perf_counter()
                run()
                best[key] = min(best[key], time.perf_counter() - t0)
    return best


def probe_matmul(
    dtype_name: str, shape: tuple[int, int, int] = PROBE_SHAPE, repeats: int = PROBE_REPEATS, packed: bool = False
) -> float:
    """Best wall time in seconds of one product (:func:`probe_matmuls`)."""
    return probe_matmuls([(dtype_name, shape)], repeats, packed)[dtype_name, shape]


def decode_shapes(rows: int = 1) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(M, K, N) of the two products :func:`decode_speed` prices at ``rows`` rows a step: one
    step (``rows`` rows of one token) and one verified block (``rows`` rows of REFERENCE_K + 1
    tokens) through the :data:`DECODE_PROJECTION`."""
    return (rows, *DECODE_PROJECTION), (rows * (REFERENCE_K + 1), *DECODE_PROJECTION)


#: The products at one request a step: a one-row step and a 6-token block.
DECODE_SHAPES = decode_shapes(1)


def decode_speed(step: float, block: float, rows: int = 1) -> float:
    """Tokens per second (relative) at ``rows`` requests a step of the faster of `ar`, one step of
    `step` seconds for ``rows`` tokens, and the reference `sd` cycle: REFERENCE_K drafter steps
    at REFERENCE_DRAFTER of a verifier step and one verified block of `block` seconds for
    REFERENCE_TOKENS tokens a row:

        max(rows / step,  rows * REFERENCE_TOKENS / (REFERENCE_K * REFERENCE_DRAFTER * step + block))"""
    return max(rows / step, rows * REFERENCE_TOKENS / (REFERENCE_K * REFERENCE_DRAFTER * step + block))


def request_speed(step: float, block: float, rows: int = 1, prompt: float = REFERENCE_PROMPT_TOKENS) -> float:
    """Generated tokens per second (relative) of requests that prefill ``prompt`` tokens per token
    they generate and decode at :func:`decode_speed`, a prompt token priced at a row of the block
    product (``block`` seconds for ``rows * (REFERENCE_K + 1)`` rows):

        1 / (1 / decode_speed(step, block, rows) + prompt * block / (rows * (REFERENCE_K + 1)))"""
    return 1 / (1 / decode_speed(step, block, rows) + prompt * block / (rows * (REFERENCE_K + 1)))


def decode_probe_seconds(rows: int = 1, repeats: int = 2 * PROBE_REPEATS, packed: bool = True) -> dict[str, float]:
    """What ``auto`` decides with on a CPU without native bf16 or mixed kernels: the best seconds
    of the :func:`decode_shapes` products at ``rows`` in each dtype with the engine's kernels
    (``packed``: its packed linears), by ``dtype@M`` (best of twice the usual repeats: each probe
    is short, and the choice is their margin)."""
    shapes = decode_shapes(rows)
    probes = probe_matmuls([(d, shape) for d in ("bfloat16", "float32") for shape in shapes], repeats, packed)
    return {f"{d}@{shape[0]}": t for (d, shape), t in probes.items()}


@functools.cache
def _cpu_auto(rows: int = 1, packed: bool = True) -> DtypeChoice:
    """What ``auto`` means on this process's CPU for a step of ``rows`` rows (computed once per
    row count; with native bf16 once in all: that choice does not depend on the rows).
    ``packed``: the engine packs its linears (``EngineConfig.packed_linears``), so bf16 may run
    mixed kernels."""
    if native_bf16():
        return dataclasses.replace(_native_cpu_auto(), rows=rows)
    cap = cpu_capability()
    from_rows = mixed_from_rows() if packed else None
    if from_rows is not None:  # every product runs the faster kernel at its rows
        seconds = dict(mixed_probe_seconds_cached())
        if from_rows > 1:
            return DtypeChoice("bfloat16", AUTO, "cpu", "no-native-bf16-mixed", rows, cap, False, seconds)
        return DtypeChoice("float32", AUTO, "cpu", "no-native-bf16", rows, cap, False, seconds)
    seconds = decode_probe_seconds(rows, packed=packed)
    (step, _, _), (block, _, _) = decode_shapes(rows)
    speed = {
        name: request_speed(seconds[f"{name}@{step}"], seconds[f"{name}@{block}"], rows)
        for name in ("bfloat16", "float32")
    }
    if speed["bfloat16"] > speed["float32"]:
        return DtypeChoice("bfloat16", AUTO, "cpu", "no-native-bf16-decode", rows, cap, False, seconds)
    return DtypeChoice("float32", AUTO, "cpu", "no-native-bf16", rows, cap, False, seconds)


@functools.cache
def _native_cpu_auto() -> DtypeChoice:
    """``auto`` on a CPU with native bf16: bf16 unless the probe product is slower in it."""
    cap = cpu_capability()
    seconds = {d: t for (d, _), t in probe_matmuls([(d, PROBE_SHAPE) for d in ("bfloat16", "float32")]).items()}
    if seconds["bfloat16"] <= seconds["float32"]:
        return DtypeChoice("bfloat16", AUTO, "cpu", "native-bf16", 1, cap, True, seconds)
    return DtypeChoice("float32", AUTO, "cpu", "native-bf16-probe-slower", 1, cap, True, seconds)


def _cuda_auto(device: str) -> DtypeChoice:
    import torch

    index = torch.device(device).index
    try:  # bf16 tensor cores from Ampere (compute capability 8.0) on
        ok = torch.cuda.get_device_capability(0 if index is None else index) >= (8, 0)
    except Exception:  # noqa: BLE001 - no CUDA here: loading will say so
        ok = True
    return DtypeChoice("bfloat16" if ok else "float16", AUTO, device, "cuda" if ok else "cuda-no-bf16")


def resolve_dtype(requested: str | torch.dtype, device: str = "cpu", rows: int = 1, packed: bool = True) -> DtypeChoice:
    """The concrete dtype for ``requested`` (``auto`` or a dtype name / alias / torch dtype) on
    ``device`` (``cpu``, ``cuda``, ``cuda:N``) for decoding steps of up to ``rows`` rows, see the
    module docstring. Raises :class:`~viasd.errors.ModelLoadError` for an unknown dtype name."""
    name = _canonical(requested)
    device = str(device)
    kind = device.split(":", 1)[0]
    cap = cpu_capability() if kind == "cpu" else None
    if name != AUTO:
        return DtypeChoice(name, name, device, "requested", rows, cap)
    if kind == "cpu":
        return _cpu_auto(rows, packed)
    if kind == "cuda":
        return dataclasses.replace(_cuda_auto(device), rows=rows)
    return DtypeChoice("float32", AUTO, device, "device", rows, cap)


def engine_dtype(config, device: str | None = None) -> DtypeChoice:
    """The dtype an engine of ``config`` (an :class:`~viasd.config.EngineConfig`) loads its tiers
    in on ``device`` (default: ``config.device``): :func:`resolve_dtype` of ``config.dtype`` at its
    batch capacity, ``config.max_batch`` rows. Every process that loads a tier of one pipeline
    (the in-process engine, the drafter and verifier actors) calls this, so they agree."""
    return resolve_dtype(config.dtype, device or config.device, rows=config.max_batch, packed=config.packed_linears)


def _reset_cache() -> None:
    """Forget the cached CPU decision (tests)."""
    _cpu_auto.cache_clear()
    _native_cpu_auto.cache_clear()
    mixed_probe_seconds_cached.cache_clear()


# ------------------------------------------------------------------------------------------------
# prepacked CPU linears


def _packed_linear_class():
    import torch
    from torch import nn

    class _PackedLinear(nn.Module):
        """An ``nn.Linear`` whose weight oneDNN has reordered once into its blocked layout
        (``torch.ops.mkldnn._reorder_linear_weight``), run by ``torch.ops.mkldnn._linear_pointwise``:
        the kernel inductor's freezing pass emits for CPU linears. ``weight`` and ``bias`` stay the
        original parameters (shared, tied and fingerprinted as before); the packed copy is a
        non-persistent buffer (extra memory: one more copy of the weight, in ``compute``).

        Mixed (``compute`` float32 for a bf16 weight, on a CPU without native bf16): a product of
        at least ``from_rows`` rows runs the packed float32 copy on the input widened to float32
        and rounds its output to bf16; fewer rows run plain bf16 ``F.linear``. Both sum exact
        products of the same bf16 values in float32 and round once to bf16, so they differ only
        in the order of the sum, as any two GEMM blockings do. Without native bf16, ATen widens
        every bf16 tile on the fly: a one-row product, which reads the weight once, is faster in
        bf16 (half the bytes), a product of a few rows is compute-bound and faster in packed
        float32."""

        def __init__(self, linear: nn.Linear, compute: torch.dtype | None = None, from_rows: int = 1):
            super().__init__()
            self.in_features, self.out_features = linear.in_features, linear.out_features
            self.weight = linear.weight
            self.bias = linear.bias
            self.from_rows = from_rows
            compute = linear.weight.dtype if compute is None else compute
            w = linear.weight.detach().to(compute)  # [N, K]
            self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(w, None), persistent=False)
            b = None if linear.bias is None or compute == linear.weight.dtype else linear.bias.detach().to(compute)
            self.register_buffer("packed_bias", b, persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dtype != self.weight.dtype or x.device.type != "cpu" or torch.is_grad_enabled() and x.requires_grad:
                return nn.functional.linear(x, self.weight, self.bias)
            if self.packed_weight.dtype == x.dtype:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
            if x.numel() < self.from_rows * self.in_features:  # [M, K] with M < from_rows: plain
                return nn.functional.linear(x, self.weight, self.bias)
            wide = x.to(self.packed_weight.dtype)  # [..., K]
            out = torch.ops.mkldnn._linear_pointwise(wide, self.packed_weight, self.packed_bias, "none", [], "")
            return out.to(x.dtype)  # [..., N]

        def extra_repr(self) -> str:
            mixed = f", compute={self.packed_weight.dtype}, from_rows={self.from_rows}"
            return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}" + (
                mixed if self.packed_weight.dtype != self.weight.dtype else ""
            )

    return _PackedLinear


#: Rows the mixed-kernel probe times (mixed_from_rows), ascending.
MIXED_PROBE_ROWS = (1, 2, 3, 4, 6, 8)


def mixed_probe_seconds(repeats: int = PROBE_REPEATS) -> dict[str, float]:
    """Best seconds of a ``[M, K] x [K, N]`` bf16 product (:data:`DECODE_PROJECTION`) at each of
    :data:`MIXED_PROBE_ROWS`, plain (``bf16@M``) and mixed (``mixed@M``: packed float32 on the
    widened input, the output rounded to bf16), interleaved (:func:`_best_interleaved`)."""
    import torch

    k, n = DECODE_PROJECTION
    g = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)  # [N, K]
    mixed = packed_linear_class()(linear, torch.float32, 1)
    runners = {}
    for m in MIXED_PROBE_ROWS:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)  # [M, K]
        runners[f"bf16@{m}"] = functools.partial(torch.nn.functional.linear, x, linear.weight)
        runners[f"mixed@{m}"] = functools.partial(mixed, x)
    return _best_interleaved(runners, repeats)


def from_rows_of(seconds: dict[str, float]) -> int | None:
    """The fewest rows from which the mixed kernel is faster than plain bf16 at every probed row
    count (``seconds``: :func:`mixed_probe_seconds`'s), or None where it is not at the most rows."""
    from_rows = None
    for m in reversed(MIXED_PROBE_ROWS):
        if seconds[f"mixed@{m}"] >= seconds[f"bf16@{m}"]:
            break
        from_rows = m
    return from_rows


@functools.cache
def mixed_probe_seconds_cached() -> dict[str, float]:
    """:func:`mixed_probe_seconds`, once per process (empty where torch has no oneDNN)."""
    import torch

    return mixed_probe_seconds() if torch.backends.mkldnn.is_available() else {}


def mixed_from_rows() -> int | None:
    """:func:`from_rows_of` this CPU's probe (None where torch has no oneDNN, or oneDNN has native
    bf16 kernels: bf16 then packs its own)."""
    if _onednn_bf16_enabled():
        return None
    seconds = mixed_probe_seconds_cached()
    return from_rows_of(seconds) if seconds else None


@functools.cache
def packed_linear_class():
    """The ``nn.Module`` class :func:`optimize_linears` swaps in (built on first use)."""
    return _packed_linear_class()


@dataclass
class LinearReport:
    """What :func:`optimize_linears` did: ``swapped`` module names, ``skipped`` with the
    reason, ``extra_bytes`` of packed copies, ``method``."""

    method: str
    swapped: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    extra_bytes: int = 0
    from_rows: int | None = None  # mixed: the rows from which a product runs in packed float32
    quantization: dict[str, Any] | None = None  # viasd.quant: the choice and what quantize_model did

    def as_dict(self) -> dict[str, Any]:
        return {
            "linear_method": self.method,
            "linears_swapped": len(self.swapped),
            "linears_skipped": dict(self.skipped),
            "linear_extra_bytes": self.extra_bytes,
            "linear_mixed_from_rows": self.from_rows,
            "quantization": self.quantization,
        }


def kernels(reports: list[LinearReport]) -> dict[str, Any]:
    """The linears of several models, as ``/v1/models`` and the stats report them: the method of
    the first (the verifier's) and its mixed kernels' ``from_rows``, and what was packed in all;
    ``quantization``: the weight quantization of each (the verifier's first, viasd.quant), where
    any was asked for."""
    out = {
        "linear_method": reports[0].method if reports else "off",
        "linears_swapped": sum(len(r.swapped) for r in reports),
        "linear_extra_bytes": sum(r.extra_bytes for r in reports),
        "linear_mixed_from_rows": reports[0].from_rows if reports else None,
    }
    if any(r.quantization for r in reports):
        out["quantization"] = [r.quantization for r in reports]
    return out


def linear_kernels(model) -> dict[str, int]:
    """How many linears of ``model`` run each kernel: ``plain`` (``nn.Linear``), ``packed`` (a
    packed copy in the weight's dtype), ``mixed@<from_rows>`` or a quantized linear's
    ``kernel_name`` (``int4g32@<dense_from>``, viasd.quant): what a cost profile depends on."""
    from torch import nn

    cls, counts = packed_linear_class(), Counter()
    for mod in model.modules():
        if type(mod) is nn.Linear:
            counts["plain"] += 1
        elif type(mod) is cls:
            mixed = mod.packed_weight.dtype != mod.weight.dtype
            counts[f"mixed@{mod.from_rows}" if mixed else "packed"] += 1
        elif isinstance(getattr(mod, "kernel_name", None), str):
            counts[mod.kernel_name] += 1
    return dict(sorted(counts.items()))


#: Packing stops before it would leave less than this share of the machine's memory available:
#: the packed copies double the weights' memory, and the KV cache and activations need room too.
PACK_KEEP_FREE_FRACTION = 0.15


def cpu_memory() -> tuple[int, int]:
    """(bytes available now, bytes in all) of this machine's memory. Available is Linux's
    MemAvailable (free pages plus the page cache the kernel can drop: the weight files just read
    sit there), not MemFree, which counts that cache as used."""
    import os

    page = os.sysconf("SC_PAGE_SIZE")
    total = os.sysconf("SC_PHYS_PAGES") * page
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, total
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * page, total


def optimize_linears(
    model,
    dtype: str | torch.dtype | None = None,
    device: str = "cpu",
    *,
    include_lm_head: bool = True,
    keep_free_bytes: int | None = None,
    mixed_from: int | None = None,
) -> LinearReport:
    """Swap the ``nn.Linear`` modules of a loaded model for oneDNN-prepacked ones (see
    ``_PackedLinear``), in place, on CPU; a no-op report elsewhere (method ``none``).

    Outputs equal ``F.linear``'s within the dtype's rounding (oneDNN may sum in another order).
    Weights stay shared (a tied ``lm_head`` keeps pointing at the embedding); each swapped linear
    costs one more copy of its weight. ``dtype`` defaults to the model's. A linear whose copy would
    leave less than ``keep_free_bytes`` free (default: PACK_KEEP_FREE_FRACTION of the machine's
    memory) stays plain, with the reason in ``skipped``: a model that fits only once keeps its
    memory for the KV cache instead of failing later with a tiny context.

    bf16 where oneDNN has no bf16 kernels (no AVX-512): mixed kernels (method ``mixed``), a
    float32 packed copy (twice the bf16 weight's bytes) that runs products of ``mixed_from`` rows
    or more (default: :func:`mixed_from_rows`, this CPU's probe; plain linears where it finds
    none).
    """
    import torch
    from torch import nn

    report = LinearReport("mkldnn_packed")
    if str(device).split(":", 1)[0] != "cpu" or not torch.backends.mkldnn.is_available():
        report.method = "none"
        return report
    dt = getattr(torch, _canonical(dtype)) if dtype is not None else next(model.parameters()).dtype
    compute, from_rows = dt, 1
    if dt == torch.bfloat16 and not _onednn_bf16_enabled():
        compute, from_rows = torch.float32, mixed_from_rows() if mixed_from is None else mixed_from
        report.method, report.from_rows = "mixed", from_rows
    if dt not in (torch.float32, torch.bfloat16) or from_rows is None:
        report.method = "none"
        report.skipped["*"] = f"oneDNN packed linear not used for {dt} on this CPU"
        return report
    cls = packed_linear_class()
    free, total = cpu_memory()
    keep = int(PACK_KEEP_FREE_FRACTION * total) if keep_free_bytes is None else keep_free_bytes
    targets = [(name, mod) for name, mod in model.named_modules() if type(mod) is nn.Linear]
    for name, mod in targets:
        if not include_lm_head and name.split(".")[-1] == "lm_head":
            report.skipped[name] = "lm_head excluded"
            continue
        if mod.weight.dtype != dt or mod.weight.device.type != "cpu":
            report.skipped[name] = f"weight is {mod.weight.dtype} on {mod.weight.device}"
            continue
        size = mod.weight.numel() * compute.itemsize
        if free - report.extra_bytes - size < keep:
            report.skipped[name] = (
                f"memory: a packed copy ({size / 2**20:.0f} MiB) would leave less than {keep / 2**30:.1f} GiB free"
            )
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        with torch.no_grad():
            packed = cls(mod, compute, from_rows)
        setattr(parent, attr, packed)
        report.swapped.append(name)
        report.extra_bytes += size
    return report
