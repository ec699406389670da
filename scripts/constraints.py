"""constraints.txt: the exact versions of every package via-sd's extras need, transitively.

    python scripts/constraints.py > constraints.txt   # after installing and testing new versions

Reads pyproject.toml's requirements and walks the installed packages' own requirements (markers
evaluated for this machine and the extras asked for), so the file lists what CI really runs.
`tests/unit/test_dependencies.py` checks that the file pins every package of that closure within
pyproject.toml's ranges.
"""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "via-sd"
EXTRAS = ("serve", "bench", "dimr", "dev")
#: the build backend (pyproject.toml's build-system), pinned for the editable install too
BUILD = ("setuptools",)
HEADER = """\
# The exact versions CI and scripts/setup.sh install (pip install -c constraints.txt ...): every
# package via-sd[serve,bench,dimr,dev] needs, transitively. pyproject.toml holds the ranges users get.
# torch==X matches both its CPU (+cpu) and CUDA builds. Regenerate: python scripts/constraints.py
"""


def requirements(extras=EXTRAS) -> list[Requirement]:
    """pyproject.toml's base requirements and those of `extras` (references to via-sd itself dropped)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return [r for r in reqs if canonicalize_name(r.name) != PROJECT]


def closure(reqs: list[Requirement]) -> dict[str, str]:
    """Installed version (local label dropped) of every package `reqs` need here, by canonical name.
    KeyError names a requirement that is not installed."""
    versions: dict[str, str] = {}
    seen: set[tuple[str, frozenset]] = set()
    todo = list(reqs)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if (name, frozenset(req.extras)) in seen:
            continue
        seen.add((name, frozenset(req.extras)))
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            raise KeyError(f"{req.name} is required ({req}) but not installed") from None
        versions[name] = dist.version.split("+")[0]
        for line in dist.requires or ():
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ("", *req.extras)):
                todo.append(sub)
    return versions


def pins(path: Path = ROOT / "constraints.txt") -> dict[str, str]:
    """name -> version of a constraints file's `name==version` lines."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version
    return out


def main() -> None:
    versions = closure(requirements())
    for name in BUILD:
        versions[name] = distribution(name).version
    print(HEADER + "".join(f"{n}=={v}\n" for n, v in sorted(versions.items())), end="")


if __name__ == "__main__":
    main()
