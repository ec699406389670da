"""Loading causal language models: built-in names or local Hugging Face directories.

:func:`load_causal_lm` is the one entry point the engine uses to get a model and its tokenizer.
:func:`model_fingerprint` ties artifacts computed for a model (layer masks) to that model;
:func:`checkpoint_fingerprint` ties them to its files, read by any rank without loading them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from viasd.errors import ModelLoadError
from viasd.models.embedded import BUILTIN_MODELS, concrete_dtype, ensure_local, torch_dtype
from viasd.runtime import SUPPORTED_ARCHITECTURES  # what MaskedLM can run

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "checkpoint_fingerprint",
    "load_causal_lm",
    "load_tokenizer",
    "model_fingerprint",
    "resolve_model_dir",
    "weight_map",
    "weights_fingerprint",
]

#: Files one of which a directory holds when it has a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


#: Config entries that say how or where a model was loaded, not what it is.
_VOLATILE_CONFIG_KEYS = (
    "_name_or_path",
    "_model_name_or_path",
    "name_or_path",
    "transformers_version",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "_attn_implementation_internal",
    "_experts_implementation",
    "attn_implementation",
    "dtype",
    "torch_dtype",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
)
_FINGERPRINT_BYTES = 4096
#: Windows of _FINGERPRINT_BYTES a checkpoint fingerprint reads of each tensor, evenly spaced.
_CHECKPOINT_WINDOWS = 8


def resolve_model_dir(spec: str, dtype: str | torch.dtype = "bfloat16", device: str = "cpu") -> Path:
    """The local Hugging Face directory for ``spec``: a built-in name (converted on first use into
    the cache of the concrete dtype, ``auto`` resolved for ``device``, see
    :func:`~viasd.models.embedded.ensure_local`) or a path to a directory with config.json."""
    if spec in BUILTIN_MODELS:
        return ensure_local(spec, concrete_dtype(dtype, device))
    path = Path(spec).expanduser()
    if not path.is_dir():
        cached = hub_cached(spec)
        if cached is None:
            raise ModelLoadError(
                f"model {spec!r} is neither a built-in model ({', '.join(sorted(BUILTIN_MODELS))}), "
                f"an existing local directory, nor a Hugging Face id in the local Hugging Face cache "
                f"(download it first: huggingface-cli download {spec})"
            )
        path = cached
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"{path} is not a Hugging Face model directory: it has no config.json "
            f"(built-in models: {', '.join(sorted(BUILTIN_MODELS))})"
        )
    return path


def hub_cached(repo_id: str) -> Path | None:
    """The snapshot directory of a Hugging Face model id already in the local Hugging Face cache
    (`HF_HUB_CACHE`, its `main` revision), or None; never the network."""
    if repo_id.count("/") != 1 or repo_id.startswith(("/", ".", "~")):
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None


def load_causal_lm(
    spec: str, *, dtype: str | torch.dtype = "bfloat16", device: str = "cpu", trust_remote_code: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load a causal LM and its tokenizer, in eval mode with gradients off.

    ``spec`` is a built-in model name (``viasd.models.embedded.BUILTIN_MODELS``) or the path of
    a local Hugging Face directory (config.json + weights + tokenizer; a directory without
    tokenizer files, such as a test model saved with ``save_pretrained``, gives a tokenizer
    of None and is driven with token ids). Only the architectures
    in :data:`SUPPORTED_ARCHITECTURES` are accepted; anything else raises
    :class:`ModelLoadError` naming its ``model_type``. Attention is ``sdpa``.

    Only safetensors weights are read (``use_safetensors=True``): a directory holding only pickled
    weights (``pytorch_model.bin``, which can run code when unpickled) raises ModelLoadError.
    Python code shipped with a model (``auto_map`` in its config) runs only with
    ``trust_remote_code=True`` (``EngineConfig.trust_remote_code``, off by default).

    ``dtype`` is a dtype name, a torch dtype or ``auto``, resolved for ``device`` by
    :func:`viasd.precision.resolve_dtype` at one row a step (cached per process); the model's
    parameters are in the concrete dtype. An engine's tiers resolve at its batch capacity
    (:func:`viasd.precision.engine_dtype`) and pass ``choice.dtype`` here.
    """
    from transformers import AutoModelForCausalLM

    dt = torch_dtype(concrete_dtype(dtype, device))
    path, config = _checked_dir(spec, dt, trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path,
            config=config,
            dtype=dt,
            attn_implementation="sdpa",
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
        )
        tokenizer = _tokenizer_at(path, trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"cannot load model {spec!r} from {path}: {exc}") from exc
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or len(layers) == 0:
        raise ModelLoadError(f"{type(model).__name__} ({config.model_type}) from {path} has no model.model.layers")
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def load_causal_lm_shard(
    spec: str, group, *, dtype: str | torch.dtype = "bfloat16", trust_remote_code: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """This tensor-parallel rank's shard of a causal LM (`viasd.parallel.load_shard`: only its
    slices are read from the safetensors files, straight to `group.device`) and the tokenizer;
    the same checks as `load_causal_lm`."""
    from viasd.parallel import load_shard

    dt = torch_dtype(concrete_dtype(dtype, group.device))
    path, _ = _checked_dir(spec, dt, trust_remote_code)
    try:
        tokenizer = _tokenizer_at(path, trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {spec!r} from {path}: {exc}") from exc
    model = load_shard(path, group, dt)
    model.requires_grad_(False)
    return model, tokenizer


def _checked_dir(spec: str, dt: torch.dtype, trust_remote_code: bool):
    """The model's directory and config, refused (ModelLoadError) without safetensors weights or
    with an architecture MaskedLM cannot run."""
    from transformers import AutoConfig

    path = resolve_model_dir(spec, dt)
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(
            f"{path} has no *.safetensors weights; only safetensors are loaded (pickled "
            f"*.bin / *.pt weights can execute code: convert them with safetensors first)"
        )
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # unknown model_type, malformed JSON, ...
        raise ModelLoadError(f"cannot read the config of {path}: {exc}") from exc
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture: model_type {model_type!r} in {path / 'config.json'}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return path, config


def _tokenizer_at(path: Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase | None:
    from transformers import AutoTokenizer

    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_tokenizer(spec: str, *, dtype: str | torch.dtype = "bfloat16") -> PreTrainedTokenizerBase | None:
    """The tokenizer of a model (built-in name or local directory) without loading its weights;
    None for a directory without tokenizer files."""
    path = resolve_model_dir(spec, concrete_dtype(dtype))
    try:
        return _tokenizer_at(path)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {spec!r} from {path}: {exc}") from exc


def model_fingerprint(model: PreTrainedModel) -> str:
    """A sha256 identifying a model's architecture and weights, cheap to compute.

    Hashes the config (without entries about how it was loaded) and, for every parameter in
    module order, its name, dtype, shape and its first and last 4096 bytes. The same weights
    loaded again (from any path, on any device) give the same fingerprint; another model, another
    dtype or changed weights give another one.
    """
    return _fingerprint(model, as_bf16=False)


def weights_fingerprint(model: PreTrainedModel) -> str:
    """Like :func:`model_fingerprint`, but of the weights' values rounded to bfloat16 and
    without their dtype: the same bf16 weights loaded in bf16 or in float32 (exactly, as a float32
    load of bf16 values is) give the same fingerprint. What a layer mask depends on: a mask searched
    on the bf16 weights holds for their float32 load (`dtype: auto` picks float32 where bf16 is
    emulated), while other weights give another fingerprint."""
    return _fingerprint(model, as_bf16=True)


def weight_map(model_dir: str | Path) -> dict[str, str]:
    """Tensor name -> the safetensors file (its name in `model_dir`) that holds it: the index's
    `weight_map`, else every *.safetensors file's keys; {} when there is no safetensors file."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    out: dict[str, str] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), file.name))
    return out


def checkpoint_fingerprint(model_dir: str | Path) -> str:
    """A sha256 identifying a safetensors checkpoint as stored, read without loading it.

    Hashes config.json (without entries about how it was loaded) and, for every tensor in name
    order whatever file holds it, its name, stored dtype and shape and `_CHECKPOINT_WINDOWS`
    evenly spaced windows of `_FINGERPRINT_BYTES` of its data (all of it when smaller), located
    through each file's header: about 32 KiB read per tensor (~25 MB for a 70B checkpoint). Every
    reader gets the same value -- each tensor-parallel rank at any TP size, any load dtype -- so a
    rank that loads only its slices can still check a layer mask against the weights it was
    searched on. Another config, tensor, shape, stored dtype or value in a window gives another
    fingerprint; re-splitting the same tensors into other files does not.
    """
    import struct

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights to fingerprint")
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {exc}") from exc
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    tensors = {}  # name -> (file, absolute data start, end, dtype, shape)
    for path in files:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))  # the safetensors layout: u64 header length, JSON header, data
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                begin, end = entry["data_offsets"]
                tensors[name] = (path, 8 + size + begin, 8 + size + end, entry["dtype"], tuple(entry["shape"]))
    h = hashlib.sha256(b"viasd-checkpoint-v1\0")
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    handles: dict = {}
    try:
        for name in sorted(tensors):
            path, begin, end, dtype, shape = tensors[name]
            h.update(f"\0{name}\0{dtype}\0{shape}\0".encode())
            f = handles.get(path) or handles.setdefault(path, path.open("rb"))
            span = max(end - begin - _FINGERPRINT_BYTES, 0)
            starts = sorted({begin + span * i // (_CHECKPOINT_WINDOWS - 1) for i in range(_CHECKPOINT_WINDOWS)})
            for start in starts:
                f.seek(start)
                h.update(f.read(min(_FINGERPRINT_BYTES, end - start)))
    finally:
        for f in handles.values():
            f.close()
    return h.hexdigest()


def _fingerprint(model: PreTrainedModel, as_bf16: bool) -> str:
    import torch

    config = model.config.to_dict()
    for key in _VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    h = hashlib.sha256()
    h.update(b"viasd-weights-bf16-v1\0" if as_bf16 else b"viasd-fingerprint-v1\0")
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, param in model.named_parameters():
        t = param.detach()
        if as_bf16:
            t = t.to(torch.bfloat16)
        h.update((f"\0{name}\0{tuple(t.shape)}\0" if as_bf16 else f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0").encode())
        flat = t.reshape(-1)
        n = max(1, _FINGERPRINT_BYTES // t.element_size())
        for piece in (flat[:n], flat[-n:]):
            piece = piece.to("cpu").contiguous()
            h.update(piece.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
