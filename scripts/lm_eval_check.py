"""lm-eval against a via-sd server, beside the same task on the in-process engine.

One generate-until task over local files (`tests/data/lm_eval/qa.jsonl`, short questions with
one-word answers; exact match after the first newline), run by lm-eval's own API through its
`local-completions` and `local-chat-completions` clients against a running server, and through
`InProcessLM` (the same `viasd.llm.LLM` the server runs) for the reference score. Greedy
decoding: the served scores must equal the in-process ones exactly.

A loglikelihood task is not run: it needs completions `echo` + `logprobs` (prompt log
probabilities), which the engine does not serve yet (issue 17, in progress); the server refuses
them with a 400.

    python scripts/lm_eval_check.py --out docs/lm_eval.json   # starts its own in-process server

`tests/integration/test_front_end.py` runs `served_scores` / `in_process_scores` against its test server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import lm_eval
import torch
import yaml
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

from viasd.config import parse_params

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "lm_eval" / "qa.jsonl"
TASK = "viasd_qa"
MAX_GEN_TOKS = 8


def task_dir(where: Path) -> Path:
    """A task YAML over the local data file (absolute path: lm-eval resolves data_files from the cwd)."""
    config = {
        "task": TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(DATA)}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "Answer with one word.\nQuestion: {{question}}\nAnswer:",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {
            "until": ["\n", "."],
            "max_gen_toks": MAX_GEN_TOKS,
            "do_sample": False,
            "temperature": 0.0,
        },
        "metric_list": [
            {
                "metric": "exact_match",
                "aggregation": "mean",
                "higher_is_better": True,
                "ignore_case": True,
                "ignore_punctuation": True,
                "regexes_to_ignore": [" "],
            }
        ],
        "metadata": {"version": 1},
    }
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{TASK}.yaml").write_text(yaml.safe_dump(config))
    return where


class InProcessLM(LM):
    """lm-eval's LM over `viasd.llm.LLM`: greedy generate-until, prompts or chat messages."""

    def __init__(self, llm, chat: bool = False):
        super().__init__()
        self.llm = llm
        self.chat = chat

    @property
    def tokenizer_name(self) -> str:
        return "viasd-in-process"

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return json.dumps(chat_history)  # rendered by the model's template in generate_until, as the server does

    def generate_until(self, requests: list[Instance]) -> list[str]:
        out = []
        for request in requests:
            context, kwargs = request.args
            until = [s for s in kwargs.get("until", []) if s]
            messages = json.loads(context) if self.chat else None
            ids = self.llm.encode(None if self.chat else context, messages)
            result = self.llm.complete(
                ids, parse_params(mode="ar", max_tokens=kwargs.get("max_gen_toks", MAX_GEN_TOKS))
            )
            text = self.llm.decode(result.token_ids)
            cut = min([text.index(s) for s in until if s in text], default=len(text))
            out.append(text[:cut])
        return out

    def loglikelihood(self, requests):
        raise NotImplementedError("loglikelihood needs prompt logprobs (echo + logprobs), not served yet")

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError("loglikelihood needs prompt logprobs (echo + logprobs), not served yet")


def _score(results: dict) -> dict:
    """The task's exact match and, per document (in order), what the model answered."""
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return {
        "exact_match": results["results"][TASK]["exact_match,none"],
        "answers": [s["filtered_resps"][0] for s in samples],
    }


def served_scores(base: str, model: str, tasks: Path) -> dict[str, dict]:
    """exact match of lm-eval's local-completions and local-chat-completions against `base`."""
    manager = TaskManager(include_path=str(tasks))
    out = {}
    for name, path, chat in (
        ("local-completions", "/v1/completions", False),
        ("local-chat-completions", "/v1/chat/completions", True),
    ):
        args = {
            "base_url": base + path,
            "model": model,
            "tokenizer_backend": None,
            "tokenized_requests": False,
            "num_concurrent": 1,
            "max_retries": 1,
        }
        results = lm_eval.simple_evaluate(
            model=name,
            model_args=args,
            tasks=[TASK],
            task_manager=manager,
            apply_chat_template=chat,
            log_samples=True,
            bootstrap_iters=0,
        )
        out[name] = _score(results)
    return out


def in_process_scores(llm, tasks: Path) -> dict[str, dict]:
    """The same task on the in-process engine: as a completion and as a chat."""
    manager = TaskManager(include_path=str(tasks))
    out = {}
    for name, chat in (("local-completions", False), ("local-chat-completions", True)):
        results = lm_eval.simple_evaluate(
            model=InProcessLM(llm, chat),
            tasks=[TASK],
            task_manager=manager,
            apply_chat_template=chat,
            log_samples=True,
            bootstrap_iters=0,
        )
        out[name] = _score(results)
    return out


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from viasd.cluster.handler import RequestHandler
    from viasd.cluster.local import LocalPipeline
    from viasd.cluster.openai_api import build_http_app
    from viasd.cluster.pipeline import PipelineConfig
    from viasd.models import embedded

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verifier", default=embedded.TEST_MODEL)
    ap.add_argument("--out", default=None, help="JSON file for the scores (default: print)")
    args = ap.parse_args(argv)
    config = PipelineConfig(engine={"verifier": args.verifier, "drafter": None, "dtype": "float32", "threads": 1})
    pipeline = asyncio.run(LocalPipeline.start(config))
    handler = RequestHandler(pipeline)
    app = build_http_app()
    app.state.server = handler
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        tasks = task_dir(Path(tmp))
        served = served_scores(f"http://127.0.0.1:{port}", handler.name, tasks)
        local = in_process_scores(pipeline.llm, tasks)
    server.should_exit = True
    thread.join(30)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    record = {
        "command": "python scripts/lm_eval_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": commit,
        "lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__") else "0.4.13",
        "machine": {
            "platform": platform.platform(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__,
        },
        "task": {
            "name": TASK,
            "data": str(DATA.relative_to(ROOT)),
            "docs": sum(1 for _ in DATA.open()),
            "output_type": "generate_until",
            "metric": "exact_match",
            "decoding": "greedy, mode ar",
        },
        "verifier": args.verifier,
        "served_model_name": handler.name,
        "served": served,
        "in_process": local,
        "served_equals_in_process": served == local,
        "loglikelihood": "not run: needs completions echo + logprobs (not served yet, issue 17)",
    }
    text = json.dumps(record, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
