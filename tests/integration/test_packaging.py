"""Packaging: one distribution, one import name; the client side stays light; pins are exact."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


def test_dependencies_are_pinned_exactly():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    loose = [r for r in reqs if not re.fullmatch(r"[A-Za-z0-9_.\-]+(\[[a-z,]+\])?==[0-9][0-9A-Za-z.+]*", r)]
    assert not loose, loose
    assert {"grpcio", "protobuf", "pydantic"} == {re.split("[=\\[]", r)[0] for r in project["dependencies"]}
