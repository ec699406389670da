"""pass@1: run a HumanEval problem's tests against a completion, in a separate process.

Generated code is never executed in the harness process. Each check is a fresh interpreter
(``python -I -B``: isolated mode, no user site, no PYTHON* variables) in an empty temporary
directory with a minimal environment, in its own session (killed as a group on timeout), whose
program first

* caps its address space (2 GiB), output file size (16 MiB) and CPU time (timeout + 1 s), and
* disables the network: ``socket.connect``/``connect_ex``/``sendto``, ``create_connection`` and
  ``getaddrinfo`` raise; where ``unshare -rn`` works (a user and network namespace with no
  interfaces), the process runs inside one as well.

The check program is HumanEval's: ``prompt + completion + "\\n" + test + "\\ncheck(entry_point)"``.
A check passes only when the program exits 0 *and* prints a sentinel after ``check`` returned (so a
completion that calls ``sys.exit(0)`` early does not pass). A timeout is a failure, reported as
``"timed out"``.

Completions are first truncated at the Codex paper's stop sequences (the first line that starts a
new top-level statement: ``def``, ``class``, ``if``, ``print``, a ``#`` comment) plus a closing
Markdown fence; a body that defines helpers at top level after the function loses them, as in
every HumanEval harness that uses these stops.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#", "\n```")
SENTINEL = "__viasd_check_passed__"
MEMORY_LIMIT = 2 << 30

_GUARD = f"""\
import resource as _r, socket as _s
_r.setrlimit(_r.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))
_r.setrlimit(_r.RLIMIT_FSIZE, (16 << 20, 16 << 20))
_r.setrlimit(_r.RLIMIT_CPU, ({{cpu}}, {{cpu}}))
def _no_network(*a, **k):
    raise OSError("network access is disabled in the pass@1 sandbox")
_s.socket.connect = _s.socket.connect_ex = _s.socket.sendto = _no_network
_s.create_connection = _s.getaddrinfo = _no_network
del _r, _s
"""


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one check: passed, and "passed" / "failed: ..." / "timed out"."""

    passed: bool
    result: str


def truncate(completion: str, stops: tuple[str, ...] = STOP_SEQUENCES) -> str:
    """The completion up to the first stop sequence."""
    cut = min((i for i in (completion.find(s) for s in stops) if i >= 0), default=len(completion))
    return completion[:cut]


def check_program(problem: dict, completion: str) -> str:
    """HumanEval's check program for one completion, ending with the pass sentinel."""
    return (
        problem["prompt"]
        + completion
        + "\n"
        + problem["test"]
        + "\n"
        + f"check({problem['entry_point']})\nprint({SENTINEL!r})\n"
    )


@lru_cache(maxsize=1)
def _netns_prefix() -> tuple[str, ...]:
    """``unshare -rn`` when it works here (a network namespace with no interfaces), else nothing."""
    exe = shutil.which("unshare")
    if not exe:
        return ()
    try:
        ok = subprocess.run([exe, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (exe, "-rn") if ok else ()


def isolation() -> str:
    """How checks are isolated on this machine (recorded in the results)."""
    net = "unshare -rn network namespace + socket guard" if _netns_prefix() else "socket guard"
    return f"subprocess (python -I), empty temp dir, rlimits (2 GiB AS, CPU), {net}"


def run_program(program: str, timeout: float = 10.0) -> ExecResult:
    """Run a Python program in a separate, sandboxed interpreter; passed iff it exits 0 and prints
    the sentinel as its last line. Never raises for the program's own failures."""
    cpu = int(timeout) + 2
    with tempfile.TemporaryDirectory(prefix="viasd-exec-") as d:
        path = Path(d) / "check.py"
        path.write_text(_GUARD.format(cpu=cpu) + program)
        env = {
            "PATH": "/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "HOME": d,
            "TMPDIR": d,
            "no_proxy": "*",
            "http_proxy": "http://0.0.0.0:9",
            "https_proxy": "http://0.0.0.0:9",
        }
        cmd = [*_netns_prefix(), sys.executable, "-I", "-B", str(path)]
        try:
            proc = subprocess.Popen(
                cmd,
                cwd=d,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            return ExecResult(False, f"failed: cannot start the checker: {exc}")
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return ExecResult(False, "timed out")
    lines = out.decode(errors="replace").strip().splitlines()
    if proc.returncode == 0 and lines and lines[-1] == SENTINEL:
        return ExecResult(True, "passed")
    if proc.returncode == -signal.SIGXCPU:
        return ExecResult(False, "timed out")
    tail = err.decode(errors="replace").strip().splitlines()
    why = tail[-1] if tail else f"exit code {proc.returncode}"
    return ExecResult(False, f"failed: {why[:300]}")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def check_completion(problem: dict, completion: str, timeout: float = 10.0) -> ExecResult:
    """Truncate a completion at the stop sequences and run the problem's tests against it."""
    return run_program(check_program(problem, truncate(completion)), timeout)


def check_many(jobs: list[tuple[dict, str]], timeout: float = 10.0, workers: int = 2) -> list[ExecResult]:
    """check_completion over (problem, completion) pairs, `workers` processes at a time."""
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(lambda j: check_completion(j[0], j[1], timeout), jobs))
