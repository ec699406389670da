"""Tensor parallelism for the verifier q (and so for its slim mode q'), with two backends.

The full verifier is sharded across ranks; q' is the same sharded model run with a layer mask
by :class:`viasd.runtime.MaskedLM`, so both tiers share one copy of the sharded weights. Every
rank runs the same forward on the same tokens and ends with the same full logits [T, V]: the
engine's sampling, acceptance rules and caches stay rank-local and identical on every rank.

Sharding (Megatron style): q/k/v and gate/up projections are split by output features (column
parallel; whole heads per rank), o_proj and down_proj by input features (row parallel), followed
by an all-reduce of the partial sums; embeddings, norms and rotary embeddings are replicated. A
:class:`viasd.runtime.KVCache` holds each rank's local KV heads ([1, H_kv / W, S, D]). Two
all-reduces per decoder layer; a skipped layer (z_l = 0) runs nowhere and communicates nothing.

Backends behind one call, :func:`shard_model`:

* ``TPBackend.TORCH``: PyTorch native tensor parallel (1-D ``DeviceMesh``, ``ColwiseParallel`` /
  ``RowwiseParallel``); ``lm_head`` column parallel with an all-gather when the vocabulary divides
  the world size, replicated otherwise. The DTensor weights are then swapped for their local
  shards and DTensor's hooks for plain collectives (:func:`_shard_torch` says why). float64 too.
* ``TPBackend.DEEPSPEED``: ``deepspeed.init_inference(..., replace_with_kernel_inject=False)``
  (AutoTP), the process group handed over through an ``mpu`` object. float32 / bfloat16 / float16.
* ``TPBackend.NONE``: the model unchanged (every rank holds all weights).

Sampled acceptance: only rank 0 holds the drafter's probability rows p; it decides each batched
sampled check and broadcasts the verdicts ([B, 4] integers) within the group
(:class:`VerdictBroadcast`), while the other ranks consume the same random draws, so every rank
commits the same tokens and keeps the same random streams.

Ranks are handed their group explicitly (:class:`TPGroup`); nothing here reads torchrun's
environment, so the same code serves Ray actors, ``torch.multiprocessing`` workers and torchrun.
The environment DeepSpeed reads (``LOCAL_SIZE``, ``RANK``, ``MASTER_ADDR``, ...) is *written* from
the group (:func:`_deepspeed_env`): its shared-memory all-reduce crashes without ``LOCAL_SIZE``.
On CPU :func:`shard_model` by default skips DeepSpeed's JIT-compiled shared-memory op
(``build_shm_op`` returns ``None``, so reductions fall back to ``torch.distributed`` on gloo;
``deepspeed_shm=True`` keeps it); that kernel silently skips dtypes other than float32 / bfloat16
/ float16, so float64 is rejected before DeepSpeed is reached.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from viasd.errors import InvalidParameterError
from viasd.sessions import VerdictShare

__all__ = [
    "TPBackend",
    "TPGroup",
    "VerdictBroadcast",
    "ControlChannel",
    "init_tp",
    "shard_model",
    "load_shard",
    "read_shard",
    "quantize_shard",
    "shutdown_tp",
    "check_shardable",
    "free_port",
]


class TPBackend(str, Enum):
    """How the verifier's weights are split across ranks."""

    NONE = "none"
    DEEPSPEED = "deepspeed"
    TORCH = "torch"


@dataclass(frozen=True)
class TPGroup:
    """What one tensor-parallel worker is handed explicitly: its rank and the rendezvous.

    ``backend`` is ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors, device ``local_rank``).
    ``local_rank`` is the rank's index on its machine; it defaults to ``rank`` (one machine).
    """

    rank: int
    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    backend: str = "gloo"
    local_rank: int | None = None

    def __post_init__(self):
        if self.world_size < 1:
            raise InvalidParameterError("world_size", f"must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise InvalidParameterError("rank", f"must be in [0, {self.world_size}), got {self.rank}")
        if self.backend not in ("gloo", "nccl"):
            raise InvalidParameterError("backend", f"must be 'gloo' or 'nccl', got {self.backend!r}")
        if not 0 < self.master_port < 65536:
            raise InvalidParameterError("master_port", f"must be a TCP port, got {self.master_port}")

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    @property
    def device_type(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", self.rank if self.local_rank is None else self.local_rank)
        return torch.device("cpu")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for a single-machine rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def init_tp(group: TPGroup, timeout: datetime.timedelta = datetime.timedelta(minutes=5)) -> None:
    """Join the process group described by ``group`` (tcp:// rendezvous, explicit rank and size).

    Idempotent: a second call with the same rank and world size does nothing; a call that
    contradicts the live group raises. ``timeout`` bounds every collective, so a dead peer
    turns into an error instead of a hang.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (group.rank, group.world_size):
            raise RuntimeError(
                f"a process group is already live as rank {dist.get_rank()}/{dist.get_world_size()}, "
                f"not {group.rank}/{group.world_size}; call shutdown_tp() first"
            )
        return
    if group.device_type == "cuda":
        torch.cuda.set_device(group.device)
    dist.init_process_group(
        group.backend,
        init_method=group.init_method,
        rank=group.rank,
        world_size=group.world_size,
        timeout=timeout,
    )


class VerdictBroadcast(VerdictShare):
    """Sampled `Check` verdicts from rank 0 to the other ranks of the live process group
    (`torch.distributed.broadcast` of [B, 4] int64 on the group's device: 32 B a row), so no
    follower needs the drafter's probability rows (`viasd.sessions.VerdictShare`)."""

    def __init__(self, rank: int):
        self.leader = rank == 0

    def lead(self, verdicts: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(verdicts.contiguous(), src=0)

    def follow(self, rows: int, device: torch.device) -> torch.Tensor:
        import torch.distributed as dist

        verdicts = torch.empty(rows, 4, dtype=torch.long, device=device)  # [B, 4]
        dist.broadcast(verdicts, src=0)
        return verdicts


class ControlChannel:
    """Rank 0's calls to the other ranks of the live group: each call is broadcast to them
    (`send` / `receive`: the pickled object, `torch.distributed.broadcast_object_list`) and what
    each rank made of it gathered back (`gather`), over a gloo group of its own whose waits never
    time out: a rank idles in `receive` for as long as the server has no work, and a dead peer is
    noticed by whoever started the ranks (their process handles), not by a collective timeout.
    Every rank builds it at once, right after joining the group (`dist.new_group` is collective)."""

    def __init__(self, rank: int, world_size: int):
        import torch.distributed as dist

        self.rank, self.world_size = rank, world_size
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))

    def send(self, obj) -> None:
        """Rank 0: `obj` to every other rank."""
        import torch.distributed as dist

        dist.broadcast_object_list([obj], src=0, group=self.group)

    def receive(self):
        """Ranks 1..N-1: the next object rank 0 sends."""
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj) -> list | None:
        """Every rank's `obj` to rank 0: ranks 1..N-1's in rank order there, None elsewhere."""
        import torch.distributed as dist

        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.group)
        return out[1:] if out is not None else None


def shutdown_tp() -> None:
    """Leave the process group (and forget DeepSpeed's comm state, if DeepSpeed was used)."""
    import torch.distributed as dist

    if "deepspeed.comm.comm" in sys.modules:
        sys.modules["deepspeed.comm.comm"].cdb = None
    if "deepspeed.inference.engine" in sys.modules:
        sys.modules["deepspeed.inference.engine"].InferenceEngine.inference_mp_group = None
    if dist.is_initialized():
        dist.destroy_process_group()


def check_shardable(config, world_size: int) -> None:
    """Raise :class:`InvalidParameterError` unless heads, KV heads and the MLP split evenly."""
    from viasd.runtime import SUPPORTED_ARCHITECTURES

    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise InvalidParameterError(
            "model",
            f"model_type {config.model_type!r} cannot be sharded; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, n in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv_heads),
        ("intermediate_size", config.intermediate_size),
    ):
        if n % world_size:
            raise InvalidParameterError(
                "tensor_parallel_size",
                f"{name}={n} is not divisible by the tensor-parallel size {world_size} "
                f"(heads={heads}, kv_heads={kv_heads}, intermediate_size={config.intermediate_size}); choose a size that divides all three",
            )


def shard_model(
    model: nn.Module, backend: TPBackend | str, group: TPGroup, *, deepspeed_shm: bool = False
) -> nn.Module:
    """Shard ``model`` in place across ``group`` and return it (same module structure).

    The result keeps ``model.model.layers[i]``, ``embed_tokens``, ``norm``, ``rotary_emb`` and
    ``lm_head``; its HF forward and :class:`~viasd.runtime.MaskedLM`'s layer-by-layer forward
    (any mask, with or without a KVCache) give the full logits on every rank. Every rank must
    call it with the same, identically initialised model (the same weights), since each rank
    keeps its own slice. Joins the process group first (:func:`init_tp`) if needed.
    """
    backend = TPBackend(backend)
    if backend == TPBackend.NONE:
        return model.to(group.device)
    check_shardable(model.config, group.world_size)
    if backend == TPBackend.DEEPSPEED:
        if next(model.parameters()).dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise InvalidParameterError(
                "dtype",
                f"DeepSpeed inference supports float32, bfloat16 and float16, not {next(model.parameters()).dtype}",
            )
    if group.world_size == 1:
        return model.to(group.device)
    if backend == TPBackend.DEEPSPEED:
        _deepspeed_env(group)
    init_tp(group)
    if backend == TPBackend.TORCH:
        return _shard_torch(model, group)
    return _shard_deepspeed(model, group, shm=deepspeed_shm)


# ------------------------------------------------------------------------ torch backend


def _layer_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col, row = ColwiseParallel(use_local_output=True), RowwiseParallel(use_local_output=True)
    return {
        "self_attn.q_proj": col,
        "self_attn.k_proj": col,
        "self_attn.v_proj": col,
        "self_attn.o_proj": row,
        "mlp.gate_proj": col,
        "mlp.up_proj": col,
        "mlp.down_proj": row,
    }


def _shard_torch(model: nn.Module, group: TPGroup, *, dtensor_runtime: bool = False) -> nn.Module:
    """DeviceMesh + parallelize_module; then, unless ``dtensor_runtime``, back to plain tensors.

    ``parallelize_module`` places every weight (``Shard(0)`` column parallel, ``Shard(1)`` row
    parallel) and installs DTensor hooks that all-reduce / all-gather. Running through DTensor
    costs Python dispatch on every projection, which dominates a small decode step, so by default
    each sharded weight is replaced by its local shard and the DTensor hooks by two
    plain collectives: ``all_reduce`` after a row-parallel projection, ``all_gather`` of the
    logits after the column-parallel head. The numbers are the same either way.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    # the model may still be on the host: each weight moves to the device as it is sharded, so a
    # rank never holds more than its shards plus one full weight there (a 70B model fits TP ranks)
    mesh = DeviceMesh(group.device_type, list(range(group.world_size)))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    hooks_before = {id(m): (set(m._forward_pre_hooks), set(m._forward_hooks)) for m in linears}
    for layer in model.model.layers:
        parallelize_module(layer, mesh, _layer_plan())
    if model.lm_head.out_features % group.world_size == 0:
        if model.lm_head.weight is model.model.embed_tokens.weight:  # tied: the embedding keeps the full matrix
            model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone(), requires_grad=False)
        parallelize_module(model.lm_head, mesh, ColwiseParallel(output_layouts=Replicate(), use_local_output=True))
    if not dtensor_runtime:
        pg = mesh.get_group()
        for m in linears:
            _localize(m, pg, *hooks_before[id(m)], gather=m is model.lm_head)
    return model.to(group.device)  # what is not sharded (embeddings, norms, rotary buffers)


def _localize(linear: nn.Linear, pg, pre_hooks_before: set, hooks_before: set, *, gather: bool) -> None:
    """Swap a parallelized Linear's DTensor weight for its local shard and its DTensor hooks
    for one plain collective (row parallel: all-reduce; column parallel head: all-gather)."""
    from torch.distributed.tensor import DTensor, Shard

    w = linear.weight
    if not isinstance(w, DTensor):
        return
    for key in set(linear._forward_pre_hooks) - pre_hooks_before:
        del linear._forward_pre_hooks[key]
        linear._forward_pre_hooks_with_kwargs.pop(key, None)
    for key in set(linear._forward_hooks) - hooks_before:
        del linear._forward_hooks[key]
        linear._forward_hooks_with_kwargs.pop(key, None)
        linear._forward_hooks_always_called.pop(key, None)
    shard_dim = w.placements[0].dim if isinstance(w.placements[0], Shard) else None
    linear.weight = nn.Parameter(w.to_local(), requires_grad=False)
    bias = None
    if linear.bias is not None:
        if shard_dim == 1:  # row parallel: the (replicated) bias is added once, after the sum
            bias = linear.bias.full_tensor().detach()
            linear.bias = None
        else:
            linear.bias = nn.Parameter(linear.bias.to_local(), requires_grad=False)
    _collectives(linear, pg, row=shard_dim == 1, bias=bias, gather=gather)


def _collectives(linear: nn.Linear, pg, *, row: bool, bias: torch.Tensor | None, gather: bool) -> None:
    """The collective after a sharded projection: row parallel, all-reduce the partial sums (then
    add the replicated `bias`); a column-parallel head (`gather`), all-gather the logits."""
    import torch.distributed as dist

    if row:

        def all_reduce(module, args, out):
            dist.all_reduce(out, group=pg)
            return out if bias is None else out + bias

        linear.register_forward_hook(all_reduce)
    elif gather:  # column-parallel head: every rank gets the full logits

        def all_gather(module, args, out):
            parts = [torch.empty_like(out) for _ in range(dist.get_world_size(pg))]
            dist.all_gather(parts, out.contiguous(), group=pg)
            return torch.cat(parts, dim=-1)

        linear.register_forward_hook(all_gather)


def _chunk(n: int, group: TPGroup) -> slice:
    """This rank's part of n features: torch.chunk's split, as DTensor's Shard places it."""
    size = -(-n // group.world_size)
    return slice(min(group.rank * size, n), min((group.rank + 1) * size, n))


def load_shard(model_dir, group: TPGroup, dtype: torch.dtype) -> nn.Module:
    """This rank's shard of a local safetensors checkpoint (torch backend), read slice by slice.

    Joins the group (`init_tp`), reads this rank's weights (`read_shard`) and installs the
    collectives: the result is the model `shard_model(full, "torch", group)` makes: plain local
    weights, one all-reduce per row-parallel projection and an all-gather after a sharded head.
    """
    import torch.distributed as dist
    from transformers import AutoConfig

    check_shardable(AutoConfig.from_pretrained(model_dir), group.world_size)  # (before any rendezvous)
    if group.world_size > 1:
        init_tp(group)
    model = read_shard(model_dir, group, dtype)
    if group.world_size > 1:
        pg = dist.group.WORLD
        for layer in model.model.layers:
            for suffix, style in _plan_styles().items():
                if style == "RowwiseParallel":
                    linear = layer.get_submodule(suffix)
                    bias, linear.bias = linear.bias, None
                    _collectives(linear, pg, row=True, bias=bias, gather=False)
        if _head_sharded(model, group):
            _collectives(model.lm_head, pg, row=False, bias=None, gather=True)
    return model


def read_shard(model_dir, group: TPGroup, dtype: torch.dtype) -> nn.Module:
    """Rank `group.rank`'s weights of a local safetensors checkpoint, read without joining any group
    (no collectives installed: `load_shard` adds them; alone, this measures what a rank loads).

    The model is built on the meta device; each weight is then read from its file with
    safetensors' `get_slice`, only this rank's rows (column parallel, the head when the
    vocabulary divides) or columns (row parallel), straight to the rank's device, so no rank holds
    more than its shards plus the replicated embeddings and norms.
    """
    from pathlib import Path

    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from viasd.models.loader import weight_map

    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    check_shardable(config, group.world_size)
    files = weight_map(model_dir)
    if not files:
        raise InvalidParameterError("verifier", f"{model_dir}: no safetensors checkpoint to load shards from")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()
    plan = _plan_styles()  # suffix -> Colwise/Rowwise
    head_sharded = _head_sharded(model, group)

    def read(key: str, part: tuple) -> torch.Tensor:
        """This rank's part of one tensor, copied out of its file (safetensors maps the file and
        slices a view of the whole tensor; the mapping goes when the view does), so at any time a
        rank holds its copied parts plus at most one tensor's pages of the checkpoint."""
        with safe_open(model_dir / files[key], framework="pt") as f:
            view = f.get_slice(key)[part]
            out = torch.empty(view.shape, dtype=dtype, device=group.device)
            out.copy_(view)
            del view
        return out

    for module_name, module in model.named_modules():
        for attr, param in list(module.named_parameters(recurse=False)):
            key = f"{module_name}.{attr}"
            suffix = module_name.split(".", 3)[-1] if module_name.startswith("model.layers.") else module_name
            style = plan.get(suffix) if group.world_size > 1 else None
            if module_name == "lm_head" and head_sharded:
                style = "ColwiseParallel"
            if key == "lm_head.weight" and key not in files:  # tied: the head is the embedding matrix
                if not head_sharded:
                    module.weight = model.model.embed_tokens.weight
                    continue
                key = "model.embed_tokens.weight"
            rows = _chunk(param.shape[0], group)
            part = (
                (rows,)
                if style == "ColwiseParallel"
                else (slice(None), _chunk(param.shape[1], group))
                if style == "RowwiseParallel" and attr == "weight"
                else (slice(None),) * param.ndim
            )
            setattr(module, attr, nn.Parameter(read(key, part), requires_grad=False))
    rotary = model.model.rotary_emb  # (buffers computed at construction: rebuilt on the device)
    model.model.rotary_emb = type(rotary)(config=config).to(group.device)
    meta = [n for n, b in model.named_buffers() if b.is_meta]
    if meta:
        raise InvalidParameterError("verifier", f"buffers not restored after a sharded load: {meta}")
    return model


def _plan_styles() -> dict[str, str]:
    """A decoder layer's projections (suffix) -> "ColwiseParallel" / "RowwiseParallel"."""
    return {name: type(style).__name__ for name, style in _layer_plan().items()}


def _head_sharded(model: nn.Module, group: TPGroup) -> bool:
    """Whether the head is split by rows (the vocabulary divides the world size) or replicated."""
    return group.world_size > 1 and model.lm_head.out_features % group.world_size == 0


# ------------------------------------------------------------------------ quantized shards


def quantize_shard(model: nn.Module, scheme: str, group: TPGroup, *, int4_group: int | None = None, **kw):
    """Quantize this rank's slices of a model sharded by the torch backend (`load_shard`,
    `shard_model`) with `scheme` (`int8`, `int4`, `fp8`; `viasd.quant.quantize_model`, whose keywords
    `kw` passes on), so that the ranks together compute what the unsharded model quantized by the
    same scheme computes: every rank's integers and scales are the slices of the unsharded ones.

    * Column-parallel slices (q/k/v, gate/up, a split head) hold whole output channels and every
      input: quantized here, they are the unsharded quantization's rows.
    * Row-parallel slices (o_proj, down_proj) hold K / W inputs of every channel. int8's scale is
      a channel's max |W| over all K (fp8's too): each rank's maxima go through one all-reduce (MAX) over the
      group before any rank quantizes. int4's groups run along K: a slice must start and end on a
      group boundary (K / W a multiple of the group), else `InvalidParameterError` (`quantization`).
    * int4 takes a linear whose N is a multiple of 16: a linear the unsharded model quantizes must
      keep that in its slice, else the same error (a rank cannot run what the others run).
    * A head tied to the embeddings stays dense, as unsharded; fp8 keeps every head dense.

    Collectives installed on a projection (its forward hooks) move to its quantized module. Every
    rank calls this at once. Returns the `viasd.quant.QuantReport`.
    """
    import torch.distributed as dist

    from viasd.quant import INT4_GROUP, quantize_fp8, quantize_int8, quantize_model

    if scheme not in ("int8", "int4", "fp8"):
        raise InvalidParameterError(
            "quantization", f"a tensor-parallel rank quantizes int8 or int4 or fp8, not {scheme!r}"
        )
    g = int4_group or INT4_GROUP
    world = group.world_size
    rows = {
        f"model.layers.{i}.{suffix}"
        for i in range(len(model.model.layers))
        for suffix, style in _plan_styles().items()
        if style == "RowwiseParallel"
    }
    cols = {
        f"model.layers.{i}.{suffix}"
        for i in range(len(model.model.layers))
        for suffix, style in _plan_styles().items()
        if style == "ColwiseParallel"
    }
    vocab = model.lm_head.out_features  # (the full vocabulary: a split head's module keeps it)
    head_split = world > 1 and tuple(model.lm_head.weight.shape)[0] * world == vocab
    if head_split:
        cols.add("lm_head")
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if scheme == "int4":
        for name in sorted(rows | cols):
            if name == "lm_head" and tied:
                continue
            n, k = model.get_submodule(name).weight.shape  # this rank's [N, K]
            full_n, full_k = (n, k * world) if name in rows else (n * world, k)
            if full_k % g or full_n % 16:
                continue  # unsharded, int4 skips it too
            if k % g or n % 16:
                raise InvalidParameterError(
                    "quantization",
                    f"int4 at tensor-parallel size {world}: {name} is [{full_n}, {full_k}], a rank's slice "
                    f"[{n}, {k}]; a slice must hold whole groups of {g} inputs and a multiple of 16 outputs",
                )
    absmax: dict[str, torch.Tensor] = {}
    if scheme in ("int8", "fp8") and world > 1:  # the row-parallel channels' max |W| over all K: one all-reduce
        names = sorted(rows)
        local = [model.get_submodule(name).weight.detach().abs().amax(1).float() for name in names]  # [N] each
        flat = torch.cat(local)  # [sum N]
        dist.all_reduce(flat, op=dist.ReduceOp.MAX)
        absmax = dict(zip(names, flat.split([t.numel() for t in local])))

    def weights(name, linear):
        if scheme == "int8":
            return quantize_int8(linear.weight, absmax.get(name))
        n, k = linear.weight.shape
        return None if n % 16 or k % 16 else quantize_fp8(linear.weight, absmax.get(name))  # (None: skipped)

    report = quantize_model(
        model,
        scheme,
        group=g,
        include_lm_head=scheme != "fp8" and not (tied and head_split),
        weights=None if scheme == "int4" else weights,
        **kw,
    )
    if tied and head_split and scheme != "fp8":
        report.skipped["lm_head"] = "tied to the input embeddings"
    if head_split and hasattr(model.lm_head, "kernel_name"):
        model.lm_head.out_features = vocab  # (the logits after its all-gather: MaskedLM's vocab_size)
    return report


# ------------------------------------------------------------------------ deepspeed backend


def _deepspeed_env(group: TPGroup) -> None:
    """Write (never read) the environment DeepSpeed consults, from the explicit group.

    Single machine: LOCAL_SIZE = world size (the CPU accelerator's device count and the shm
    op's "all ranks are local" test), LOCAL_RANK = local rank, one node (CROSS_*).
    """
    local_rank = group.rank if group.local_rank is None else group.local_rank
    os.environ.update(
        RANK=str(group.rank),
        WORLD_SIZE=str(group.world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_SIZE=str(group.world_size),
        CROSS_RANK="0",
        CROSS_SIZE="1",
        MASTER_ADDR=group.master_addr,
        MASTER_PORT=str(group.master_port),
    )


class _MPU:
    """The minimal model-parallel unit DeepSpeed's InferenceEngine asks for: our live group."""

    def __init__(self, pg):
        self.pg = pg

    def get_model_parallel_group(self):
        return self.pg

    def get_model_parallel_rank(self):
        import torch.distributed as dist

        return dist.get_rank(self.pg)

    def get_model_parallel_world_size(self):
        import torch.distributed as dist

        return dist.get_world_size(self.pg)


def _shard_deepspeed(model: nn.Module, group: TPGroup, *, shm: bool) -> nn.Module:
    import deepspeed
    import deepspeed.comm  # noqa: F401
    import torch.distributed as dist

    ds_torch = sys.modules["deepspeed.comm.torch"]  # (the attribute `deepspeed.comm.torch` is torch itself)
    if not deepspeed.comm.is_initialized():  # the op is built (or not) when the comm backend is created
        original = ds_torch.__dict__.setdefault("_viasd_build_shm_op", ds_torch.build_shm_op)
        # without the op, inference_all_reduce falls back to torch.distributed.all_reduce on our group
        ds_torch.build_shm_op = original if shm else (lambda: None)
    deepspeed.comm.init_distributed(
        dist_backend=group.backend,
        auto_mpi_discovery=False,
        verbose=False,
        init_method=group.init_method,
        rank=group.rank,
        world_size=group.world_size,
    )
    vocab = model.lm_head.out_features
    dtype = next(model.parameters()).dtype
    engine = deepspeed.init_inference(
        model,  # may be on the host: AutoTP moves each slice to the device as it shards
        tensor_parallel={"tp_size": group.world_size, "mpu": _MPU(dist.group.WORLD), "tp_group": dist.group.WORLD},
        dtype=dtype,
        replace_with_kernel_inject=False,
    )
    module = engine.module.to(group.device)
    if not hasattr(module, "model") or not hasattr(module.model, "layers"):
        raise RuntimeError(f"DeepSpeed AutoTP changed the module structure: {type(module).__name__}")
    if not hasattr(module.lm_head, "out_features"):  # LmHeadLinearAllreduce: full logits, no attribute
        module.lm_head.out_features = vocab
    return module
