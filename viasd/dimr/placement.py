"""Where the search runs: the CPU, one GPU, or a verifier's decoder layers spread over several.

`viasd dimr --device cuda[:N]` loads the verifier straight onto one GPU in the search's dtype;
`--devices N` (the GPUs cuda:0..N-1), `--devices all` or a list such as `cuda:0,cuda:1` splits
its decoder layers into consecutive blocks, one per device (pipeline placement), for a model
larger than one device (LLaMA-70B in bf16: ~141 GB of weights):

    devices[0]:     embed_tokens, rotary tables, layers 0 .. n_0 - 1
    devices[j]:     the next n_j layers
    devices[N-1]:   its layers, the final norm and lm_head (a head tied to the embeddings
                    stays with them on devices[0], and the final norm with it)

Block sizes differ by at most one layer (`split_layers`). A forward runs the kept layers in
order; the hidden state [B, T, H] moves to the next device where a run of kept layers crosses a
block boundary, and the positions, rotary tables and attention mask are copied to a device once
per forward (`PlacedLM`). A skipped layer runs nowhere, so a mask is applied exactly as on one
device. Only one device computes at a time: the split buys memory, not speed, which the search
does not need (docs/DIMR.md, "Running the search on GPUs", has the estimate).

Each weight is read from the safetensors files straight onto its device (`load_placed`): the
host never holds the model, only one tensor at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from viasd.errors import InvalidParameterError, ModelLoadError
from viasd.runtime import MaskedLM

#: Bytes a device must have free beyond the weights it is given (activations, the reference's
#: log-probabilities, the CUDA context); checked before a weight is read.
HEADROOM_BYTES = 2 << 30

_KINDS = "cpu, cuda or cuda:N"


def _cuda_missing(flag: str, spec: str) -> str:
    why = (
        f"this torch ({torch.__version__}) is built without CUDA"
        if torch.version.cuda is None
        else "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES?)"
    )
    return f"{flag} {spec}: CUDA is not available: {why}; run on a GPU machine with a CUDA build of torch or use {flag} cpu"


def parse_device(spec: str, flag: str = "--device") -> torch.device:
    """`cpu`, `cuda` (the current CUDA device) or `cuda:N` as a torch.device, CUDA ones with their
    index. InvalidParameterError (field `flag` without its dashes, message naming `flag`) for any
    other string, and for a CUDA device when CUDA is not available or has no device N."""
    field = flag.lstrip("-")
    text = str(spec).strip().lower()
    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
        raise InvalidParameterError(field, f"{flag} {spec!r}: unknown device; use {_KINDS}")
    if dev.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise InvalidParameterError(field, _cuda_missing(flag, spec))
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= count:
        raise InvalidParameterError(
            field, f"{flag} {spec}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}"
        )
    return torch.device("cuda", index)


def parse_devices(spec: str, flag: str = "--devices") -> tuple[torch.device, ...]:
    """The devices of a pipeline placement: `N` (cuda:0..N-1), `all` (every visible GPU) or a
    comma list of `parse_device` strings (`cuda:0,cuda:1`; `cpu,cpu` runs the placement on the
    CPU). InvalidParameterError naming `flag` otherwise."""
    field = flag.lstrip("-")
    text = str(spec).strip().lower()
    if text.isdigit() or text == "all":
        if not torch.cuda.is_available():
            raise InvalidParameterError(field, _cuda_missing(flag, spec))
        count = torch.cuda.device_count()
        n = count if text == "all" else int(text)
        if not 1 <= n <= count:
            raise InvalidParameterError(field, f"{flag} {spec}: give 1..{count} (the CUDA devices this machine has)")
        return tuple(torch.device("cuda", i) for i in range(n))
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise InvalidParameterError(
            field, f"{flag} {spec!r}: give a number of GPUs, 'all' or a list such as cuda:0,cuda:1"
        )
    return tuple(parse_device(p.strip(), flag) for p in parts)


def split_layers(num_layers: int, num_devices: int) -> tuple[int, ...]:
    """The device index (0..num_devices-1) of each of num_layers decoder layers: consecutive
    blocks whose sizes differ by at most one, the larger ones on the middle devices first (the
    first device also holds the embeddings, the last the head), then the first, then the last.
    80 layers over 4 devices: 20 each; 80 over 3: 27, 27, 26."""
    if num_devices < 1:
        raise InvalidParameterError("devices", f"need at least one device, got {num_devices}")
    if num_devices > num_layers:
        raise InvalidParameterError(
            "devices", f"{num_devices} devices for a {num_layers}-layer model: give at most {num_layers}"
        )
    base, extra = divmod(num_layers, num_devices)
    order = [*range(1, num_devices - 1), 0, num_devices - 1] if num_devices > 1 else [0]
    sizes = [base] * num_devices
    for j in order[:extra]:
        sizes[j] += 1
    return tuple(j for j, n in enumerate(sizes) for _ in range(n))


@dataclass(frozen=True)
class Placement:
    """Which device every weight of a decoder-only LM goes to (module docstring)."""

    devices: tuple[torch.device, ...]  # as given; a device may repeat (cpu,cpu)
    layer_device: tuple[int, ...]  # [L] index into devices of each decoder layer
    head: int  # index into devices of the final norm and lm_head

    @classmethod
    def spread(cls, devices: Sequence[torch.device], num_layers: int, *, tied: bool = False) -> Placement:
        """Consecutive blocks of layers (`split_layers`) over `devices`; the head on the last
        device, or on the first when it is tied to the embeddings."""
        devices = tuple(torch.device(d) for d in devices)
        return cls(devices, split_layers(num_layers, len(devices)), 0 if tied else len(devices) - 1)

    @property
    def num_layers(self) -> int:
        return len(self.layer_device)

    def param_device(self, name: str) -> torch.device:
        """The device of the parameter or buffer `name` (`model.layers.7.mlp.up_proj.weight`, ...)."""
        if name.startswith("model.layers."):
            return self.devices[self.layer_device[int(name.split(".")[2])]]
        if name.startswith(("model.norm.", "lm_head.")):
            return self.devices[self.head]
        return self.devices[0]  # embeddings, rotary tables

    def blocks(self) -> list[tuple[int, int, int]]:
        """(device index, first layer, last layer) of every block, in order."""
        out: list[tuple[int, int, int]] = []
        for i, j in enumerate(self.layer_device):
            if out and out[-1][0] == j:
                out[-1] = (j, out[-1][1], i)
            else:
                out.append((j, i, i))
        return out

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (the artifact's `placement`): the devices and each one's layer range."""
        return {
            "devices": [str(d) for d in self.devices],
            "layers": [[first, last] for _, first, last in self.blocks()],
            "head": str(self.devices[self.head]),
        }

    def describe(self) -> str:
        """One line for logs: `cuda:0 (embeddings, layers 0-9); ...; cuda:7 (head, layers 70-79)`."""
        parts = []
        for j, first, last in self.blocks():
            extra = (["embeddings"] if j == 0 else []) + (["head"] if j == self.head else [])
            what = ", ".join([*extra, f"layers {first}-{last}" if last > first else f"layer {first}"])
            parts.append(f"{self.devices[j]} ({what})")
        return "; ".join(parts)


def placement_bytes(model: nn.Module, placement: Placement, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of `model`'s parameters (meta tensors will do) in `dtype` on each device, by device
    name (a device listed twice sums its blocks); tied parameters count once."""
    size = torch.empty((), dtype=dtype).element_size()
    out: dict[str, int] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        dev = str(placement.param_device(name))
        out[dev] = out.get(dev, 0) + p.numel() * size
    return out


def check_fits(
    need: dict[str, int], free: dict[str, int], flag: str, headroom: int = HEADROOM_BYTES, what: str = "the model"
) -> None:
    """InvalidParameterError naming `flag` when a device's weights plus `headroom` exceed its free
    bytes (`free` has the devices to check: CUDA devices; others are not checked)."""
    for dev, n in need.items():
        if dev in free and n + headroom > free[dev]:
            total = sum(need.values())
            raise InvalidParameterError(
                flag.lstrip("-"),
                f"{flag}: the weights of {what} need {n / 2**30:.1f} GiB on {dev} (+{headroom / 2**30:.0f} GiB "
                f"headroom), which has {free[dev] / 2**30:.1f} GiB free; all weights: {total / 2**30:.1f} GiB. "
                f"Spread the layers over more GPUs (--devices N)",
            )


def _cuda_free(devices: Sequence[torch.device]) -> dict[str, int]:
    return {str(d): torch.cuda.mem_get_info(d)[0] for d in dict.fromkeys(devices) if d.type == "cuda"}


def load_placed(
    spec: str,
    devices: Sequence[torch.device],
    *,
    dtype: str | torch.dtype = "bfloat16",
    flag: str = "--device",
    trust_remote_code: bool = False,
) -> tuple[nn.Module, Any, Placement]:
    """A causal LM with its layers over `devices` (`Placement.spread`), its tokenizer and the placement.

    The model is built on the meta device; each weight is then read from its safetensors file
    straight onto the device the placement gives it, in `dtype` (``auto`` resolved for
    devices[0], as the engine does), so the host holds one tensor at a time. Before any weight
    is read, every CUDA device is checked to have its share plus HEADROOM_BYTES free
    (InvalidParameterError naming `flag`). The same checks as `load_causal_lm` (safetensors
    only, a supported architecture; ModelLoadError). Eval mode, gradients off; the same weights
    as `load_causal_lm` gives.
    """
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from viasd.models.embedded import concrete_dtype, torch_dtype
    from viasd.models.loader import _checked_dir, _tokenizer_at, weight_map

    devices = tuple(devices)
    dt = torch_dtype(concrete_dtype(dtype, str(devices[0])))
    path, config = _checked_dir(spec, dt, trust_remote_code)
    try:
        files = weight_map(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config, dtype=dt, attn_implementation="sdpa", trust_remote_code=trust_remote_code
            )
    except Exception as exc:
        raise ModelLoadError(f"cannot load model {spec!r} from {path}: {exc}") from exc
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or len(layers) == 0:
        raise ModelLoadError(f"{type(model).__name__} ({config.model_type}) from {path} has no model.model.layers")
    tied = bool(getattr(config, "tie_word_embeddings", False)) or "lm_head.weight" not in files
    placement = Placement.spread(devices, len(layers), tied=tied)
    check_fits(placement_bytes(model, placement, dt), _cuda_free(devices), flag, what=repr(spec))
    opened: dict[tuple[str, str], Any] = {}

    def read(key: str, device: torch.device) -> Tensor:
        if key not in files:
            raise ModelLoadError(f"{path}: the checkpoint has no tensor {key!r}")
        handle = (files[key], str(device))
        if handle not in opened:
            opened[handle] = safe_open(path / files[key], framework="pt", device=str(device))
        return opened[handle].get_tensor(key).to(dt)

    try:
        for module_name, module in model.named_modules():
            for attr, _ in list(module.named_parameters(recurse=False)):
                key = f"{module_name}.{attr}" if module_name else attr
                if tied and key == "lm_head.weight":  # the head is the embedding matrix
                    module.weight = model.model.embed_tokens.weight
                    continue
                setattr(module, attr, nn.Parameter(read(key, placement.param_device(key)), requires_grad=False))
        rotary = model.model.rotary_emb  # (buffers computed at construction: rebuilt on the device)
        model.model.rotary_emb = type(rotary)(config=config).to(devices[0])
        tokenizer = _tokenizer_at(path, trust_remote_code)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot load model {spec!r} from {path}: {exc}") from exc
    finally:
        opened.clear()
    meta = [n for n, b in [*model.named_parameters(), *model.named_buffers()] if b.is_meta]
    if meta:
        raise ModelLoadError(f"{path}: not restored after a placed load: {meta[:5]}")
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer, placement


def _runs(layers: Sequence[int], layer_devices: Sequence[torch.device]) -> list[tuple[torch.device, list[int]]]:
    """`layers` cut into runs of consecutive entries on one device, in order."""
    out: list[tuple[torch.device, list[int]]] = []
    for i in layers:
        dev = layer_devices[i]
        if out and out[-1][0] == dev:
            out[-1][1].append(i)
        else:
            out.append((dev, [i]))
    return out


class PlacedLM(MaskedLM):
    """`MaskedLM` over a model whose decoder layers sit on several devices (`load_placed`).

    Inputs enter on the embeddings' device (`device`); `run_layers` runs each run of kept layers
    on one device through `MaskedLM.run_layers`, moving the hidden state [B, T, H] at a device
    change and giving each device its own copy of positions, attention mask and rotary tables
    (made once per forward); `head` moves the last hidden state to the head's device. Logits
    come out on `head_device`. On one device it computes exactly what `MaskedLM` does.
    """

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.layer_devices = tuple(next(layer.parameters()).device for layer in self.layers)
        self.head_device = self.lm_head.weight.device
        if self.norm.weight.device != self.head_device:
            raise ModelLoadError(f"the final norm ({self.norm.weight.device}) and lm_head ({self.head_device}) differ")
        self.devices = tuple(dict.fromkeys((self.device, *self.layer_devices, self.head_device)))

    def run_layers(
        self,
        hidden: Tensor,
        positions: Tensor,
        attn_mask: Tensor | None,
        past_key_values,
        layers: Sequence[int],
        rope: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """`MaskedLM.run_layers` over placed layers: hidden [B, T, H] -> [B, T, H] on the device
        of the last layer run (the input's device when `layers` is empty)."""
        rope = rope if rope is not None else self.rotary(hidden, positions)  # (cos, sin), each [B, T, D]
        copies = {hidden.device: (positions, attn_mask, rope)}
        for dev, run in _runs(layers, self.layer_devices):
            if dev not in copies:  # once per device and forward (device-to-device: no host wait)
                copies[dev] = (
                    positions.to(dev),
                    None if attn_mask is None else attn_mask.to(dev),
                    (rope[0].to(dev), rope[1].to(dev)),
                )
            pos, am, rp = copies[dev]
            hidden = super().run_layers(hidden.to(dev), pos, am, past_key_values, run, rp)  # [B, T, H]
        return hidden

    def head(self, hidden: Tensor) -> Tensor:
        """`MaskedLM.head` on the head's device: hidden [1, N, H] -> logits [N, V] there."""
        return super().head(hidden.to(self.head_device))


def lm_devices(lm: MaskedLM) -> tuple[torch.device, ...]:
    """The devices `lm` computes on."""
    return getattr(lm, "devices", (lm.device,))


def synchronize(lm: MaskedLM) -> None:
    """Wait until every CUDA device of `lm` has finished its queued work (timing); nothing on CPU."""
    for dev in lm_devices(lm):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)


def search_devices(device: str | None, devices: str | None) -> tuple[tuple[torch.device, ...], str]:
    """The devices of a search and the flag that named them: `--devices` (a placement), else
    `--device` (one device), else the CPU. Validated before anything loads."""
    if device is not None and devices is not None:
        raise InvalidParameterError("devices", "give --device (one device) or --devices (layers spread), not both")
    if devices is not None:
        return parse_devices(devices), "--devices"
    if device is not None:
        return (parse_device(device),), "--device"
    return (torch.device("cpu"),), "--device"
