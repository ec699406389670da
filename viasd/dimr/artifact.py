"""The versioned mask artifact: schema, build, save, read, the fingerprint check, shipped masks."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from viasd.dimr.calibration import Calibration
from viasd.dimr.search import SearchResult
from viasd.errors import MaskError
from viasd.runtime import LayerMask, MaskedLM

SCHEMA_VERSION = 1
ARTIFACT_KIND = "viasd.dimr.mask"

# --------------------------------------------------------------------------------------------
# The artifact
# --------------------------------------------------------------------------------------------


class MaskArtifact(BaseModel):
    """The versioned JSON a DIMR search writes and the engine loads (`--mask mask.json`)."""

    model_config = ConfigDict(extra="allow", frozen=True, protected_namespaces=())

    schema_version: int = Field(SCHEMA_VERSION, description="Layout version of this file.")
    kind: str = Field(ARTIFACT_KIND, description="Always 'viasd.dimr.mask'.")
    model_fingerprint: str = Field(
        description="viasd.models.loader.model_fingerprint of the verifier (config + weights + dtype)."
    )
    weights_fingerprint: str | None = Field(
        None,
        description="viasd.models.loader.weights_fingerprint of the verifier (its weights rounded to bf16, "
        "without their dtype): the same weights loaded in another dtype (dtype auto: float32 where bf16 is "
        "emulated) still match. Absent in older artifacts: then only model_fingerprint matches.",
    )
    checkpoint_fingerprint: str | None = Field(
        None,
        description="viasd.models.loader.checkpoint_fingerprint of the verifier's safetensors files, when it "
        "was loaded from a directory: a tensor-parallel rank that reads only its slices checks the mask "
        "against the files (the same value at any TP size). Absent: the weights are checked after a whole load.",
    )
    num_layers: int = Field(ge=1, description="Decoder layers of the verifier.")
    skipped_layers: list[int] = Field(description="Layers the slim verifier skips (z_l = 0).")
    ratio: float = Field(ge=0.0, lt=1.0, description="Requested skip ratio r; len(skipped_layers) = round(r L).")
    objective: dict[str, Any] = Field(description="name, value, direction, params (and total for rkl).")
    trials: int = Field(ge=0, description="Trials the search ran.")
    seconds: float = Field(ge=0.0, description="Wall time of the search (the reference pass included).")
    seed: int | None = Field(None, description="Seed of the search.")
    calibration: dict[str, Any] = Field(default_factory=dict, description="What the masks were scored on.")
    cache_policy: str = Field("separate", description="Cache policy the masks were scored under.")
    verifier: str | None = Field(None, description="Verifier as given to the search (built-in name or path).")
    drafter: str | None = Field(None, description="Drafter (e2e objective / evaluation), if any.")
    dtype: str | None = Field(None, description="Weight dtype of the verifier during the search.")
    created_at: str | None = Field(None, description="UTC time the artifact was written (ISO 8601).")
    viasd_version: str | None = Field(None, description="via-sd version that wrote it.")
    gates: dict[str, Any] | None = Field(
        None,
        description="Calibrated gates for this mask (viasd.gates.calibrate): alpha1, alpha2, region_b, the "
        "quality budget and the calibration figures; absent in artifacts written before gate calibration.",
    )

    @property
    def mask(self) -> LayerMask:
        return LayerMask.from_skipped(self.skipped_layers, self.num_layers)


def build_artifact(
    result: SearchResult,
    verifier: MaskedLM,
    calibration: Calibration,
    *,
    seconds: float,
    cache_policy: str,
    verifier_name: str | None = None,
    drafter_name: str | None = None,
    dtype: str | None = None,
    extra: dict[str, Any] | None = None,
) -> MaskArtifact:
    """The artifact of a search (fingerprints from the verifier's config and weights, and from its
    checkpoint files when `verifier_name` names a local directory or a built-in model)."""
    from viasd import __version__
    from viasd.models.loader import model_fingerprint, weights_fingerprint

    obj = result.objective
    objective = {"name": obj.name, "value": result.value, "direction": obj.direction, "params": obj.params()}
    if obj.name == "rkl":
        objective["total"] = result.value * calibration.num_tokens
        objective["note"] = "value = C(z) / tau (mean per calibration position); total = C(z)"
    fields = {
        "model_fingerprint": model_fingerprint(verifier.model),
        "weights_fingerprint": weights_fingerprint(verifier.model),
        "checkpoint_fingerprint": _files_fingerprint(verifier_name, verifier.dtype),
        "num_layers": verifier.num_layers,
        "skipped_layers": list(result.mask.skipped),
        "ratio": result.ratio,
        "objective": objective,
        "trials": len(result.trials),
        "seconds": round(seconds, 3),
        "seed": result.seed,
        "calibration": calibration.to_dict(),
        "cache_policy": cache_policy,
        "verifier": verifier_name,
        "drafter": drafter_name,
        "dtype": dtype if dtype is not None else str(verifier.dtype).removeprefix("torch."),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "viasd_version": __version__,
        "kept_layers_fixed": list(result.keep),
        "search": {
            **result.settings,
            "evaluations": len(result.trials) - result.num_duplicates,
            "pruned": result.num_pruned,
            "search_seconds": round(result.seconds, 3),
        },
        **(extra or {}),
    }
    if result.baseline is not None and result.baseline.value is not None:
        fields["baseline"] = {
            "evenly_spaced": {"skipped_layers": list(result.baseline.skipped), "value": result.baseline.value}
        }
    return MaskArtifact(**fields)


def _files_fingerprint(verifier_name: str | None, dtype) -> str | None:
    """The checkpoint fingerprint of the directory `verifier_name` resolves to (None when it names
    none: a model built in memory, or a Hugging Face id no longer in the local cache)."""
    from viasd.errors import ModelLoadError
    from viasd.models.loader import checkpoint_fingerprint, resolve_model_dir

    if verifier_name is None:
        return None
    try:
        return checkpoint_fingerprint(resolve_model_dir(verifier_name, dtype))
    except ModelLoadError:
        return None


def save_artifact(artifact: MaskArtifact, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(artifact.model_dump(mode="json"), indent=2) + "\n")
    return path


def parse_artifact(data: dict[str, Any], source: str = "mask artifact") -> MaskArtifact:
    """Validate a loaded artifact dict (MaskError naming 'mask' when it is not one this version reads)."""
    version = data.get("schema_version")
    if not isinstance(version, int) or version < 1:
        raise MaskError(f"{source}: no valid schema_version; not a DIMR mask artifact")
    if version > SCHEMA_VERSION:
        raise MaskError(
            f"{source}: schema_version {version} is newer than this via-sd reads ({SCHEMA_VERSION}); upgrade via-sd"
        )
    try:
        return MaskArtifact.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()))
        raise MaskError(f"{source}: field {where!r}: {err.get('msg')}") from None


def read_artifact(path: str | Path) -> MaskArtifact:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise MaskError(f"cannot read mask artifact {path}: {exc}") from None
    return parse_artifact(data, str(path))


def check_artifact(
    artifact: MaskArtifact,
    model,
    num_layers: int | None = None,
    source: str = "mask artifact",
    checkpoint: str | Path | None = None,
) -> LayerMask:
    """The artifact's mask if it was searched on this verifier; MaskError (field 'mask') otherwise.

    `checkpoint` is the directory the verifier was loaded from: when its files are those searched
    on (`files_match`), the weights are not read. Otherwise `model`, the verifier's transformers
    model (or a MaskedLM), must hold the weights searched on: the same dtype (model_fingerprint),
    or the same values loaded in another dtype (weights_fingerprint, when the artifact records
    it). With neither, only the layer count is checked.
    """
    from viasd.models.loader import model_fingerprint, weights_fingerprint

    if isinstance(model, MaskedLM):
        num_layers = model.num_layers if num_layers is None else num_layers
        model = model.model
    if model is not None and num_layers is None:
        num_layers = len(model.model.layers)
    if num_layers is not None and artifact.num_layers != num_layers:
        raise MaskError(
            f"{source} is for a {artifact.num_layers}-layer verifier but the loaded verifier has {num_layers} layers; "
            f"search a mask for this model with `viasd dimr`"
        )
    if checkpoint is not None and files_match(artifact, checkpoint):
        pass  # the very files it was searched on
    elif model is not None:
        fp = model_fingerprint(model)
        same_weights = (
            artifact.weights_fingerprint is not None and weights_fingerprint(model) == artifact.weights_fingerprint
        )
        if fp != artifact.model_fingerprint and not same_weights:
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
            raise MaskError(
                f"{source} was searched on another model: its fingerprint {artifact.model_fingerprint[:12]} "
                f"({artifact.verifier or 'unknown verifier'}, {artifact.dtype or 'unknown dtype'}) differs from the "
                f"loaded verifier's {fp[:12]} ({dtype}); a mask is tied to the weights it was searched on: "
                f"run `viasd dimr` for this verifier"
            )
    elif checkpoint is not None:
        raise MaskError(
            f"{source} was not searched on the checkpoint in {checkpoint}: "
            + (
                "the artifact records no checkpoint fingerprint"
                if artifact.checkpoint_fingerprint is None
                else f"its files' fingerprint differs from the artifact's {artifact.checkpoint_fingerprint[:12]}"
            )
            + "; load the whole verifier to check its weights, or run `viasd dimr` for these files"
        )
    try:
        return artifact.mask
    except MaskError as exc:
        raise MaskError(f"{source}: {exc.message}") from None


def files_match(artifact: MaskArtifact, checkpoint: str | Path) -> bool:
    """Whether the artifact was searched on the checkpoint files in this directory
    (`checkpoint_fingerprint`; False when the artifact records none)."""
    from viasd.models.loader import checkpoint_fingerprint

    return artifact.checkpoint_fingerprint is not None and (
        checkpoint_fingerprint(checkpoint) == artifact.checkpoint_fingerprint
    )


def load_artifact_mask(path: str | Path, model=None, num_layers: int | None = None) -> LayerMask:
    """Read, validate and check an artifact against the verifier; return its mask."""
    return check_artifact(read_artifact(path), model, num_layers, source=str(path))


# --------------------------------------------------------------------------------------------
# Shipped masks (package data)
# --------------------------------------------------------------------------------------------


def shipped_artifacts() -> list[tuple[str, MaskArtifact]]:
    """(file name, artifact) for every mask shipped in `viasd.masks`."""
    from importlib import resources

    out = []
    root = resources.files("viasd.masks")
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            out.append((entry.name, parse_artifact(json.loads(entry.read_text()), f"viasd/masks/{entry.name}")))
    return out


def shipped_mask(
    verifier_name: str, skip_ratio: float, model, checkpoint: str | Path | None = None
) -> tuple[LayerMask | None, str]:
    """The shipped DIMR mask for this verifier and skip ratio, checked against the loaded model
    (or its checkpoint files: `check_artifact`).

    Matches artifacts whose `verifier` is `verifier_name` and that skip as many layers as
    round(skip_ratio * L). Returns (mask, description), or (None, why not) when there is none
    or it does not fit the loaded weights (another dtype, for instance).
    """
    L = model.num_layers if isinstance(model, MaskedLM) else len(model.model.layers)
    k = round(skip_ratio * L)
    candidates = [
        (n, a)
        for n, a in shipped_artifacts()
        if a.verifier == verifier_name and a.num_layers == L and len(a.skipped_layers) == k
    ]
    if not candidates:
        return None, f"no shipped DIMR mask for {verifier_name} at skip ratio {skip_ratio:g}"
    name, art = candidates[0]
    try:
        mask = check_artifact(art, model, L, source=f"viasd/masks/{name}", checkpoint=checkpoint)
    except MaskError as exc:
        return None, f"shipped DIMR mask not used: {exc.message}"
    return mask, f"DIMR mask viasd/masks/{name} ({art.objective.get('name')}, {art.trials} trials)"
