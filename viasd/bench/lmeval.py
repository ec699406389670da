"""`viasd bench --suite lm-eval`: lm-eval's own clients against a via-sd server, beside the same
tasks on the in-process engine.

Two tasks over small data files beside this module, run by lm-eval's API against an in-process
HTTP server (the OpenAI-compatible app over a local pipeline of the engine flags) and through
`InProcessLM` (the same `viasd.llm.LLM` the server runs) for the reference scores:

* generate-until (`lm_eval_qa.jsonl`, short questions with one-word answers; exact match after
  the first newline), through lm-eval's `local-completions` and `local-chat-completions` clients;
  greedy, so the served answers must equal the in-process ones;
* loglikelihood (`lm_eval_mc.jsonl`, multiple choice; accuracy), through `local-completions` with
  lm-eval's `remote` tokenizer (the server's /tokenizer_info, /tokenize) and tokenized requests:
  each choice is scored from completions `echo` + `logprobs`, the prompt tokens' logprobs under the
  full verifier. In-process, the same sums come from `prompt_logprobs` (max_tokens 0).

    viasd bench --suite lm-eval --verifier smollm2-135m-instruct --drafter none --dtype float32 \
        --threads 1 --out bench-out/lm-eval

`served_scores` / `in_process_scores` (and the loglikelihood pair) also run against any server:
tests/integration/test_front_end.py runs them against its test server.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

from viasd.bench.report import write_results
from viasd.config import parse_params
from viasd.errors import require

DATA = Path(__file__).resolve().parent / "lm_eval_qa.jsonl"
MC_DATA = Path(__file__).resolve().parent / "lm_eval_mc.jsonl"
TASK = "viasd_qa"
MC_TASK = "viasd_mc"
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
    mc = {
        "task": MC_TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(MC_DATA)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1},
    }
    where.mkdir(parents=True, exist_ok=True)
    import yaml

    (where / f"{TASK}.yaml").write_text(yaml.safe_dump(config))
    (where / f"{MC_TASK}.yaml").write_text(yaml.safe_dump(mc))
    return where


@functools.cache
def _in_process_lm_class():
    """lm-eval's LM over `viasd.llm.LLM` (built on first use: lm-eval is imported only here)."""
    require("lm_eval", "bench")
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import TemplateLM

    class InProcessLM(TemplateLM):
        """lm-eval's LM over `viasd.llm.LLM`: greedy generate-until (prompts or chat messages) and
        loglikelihood from the full verifier's prompt logprobs."""

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

        @property
        def eot_token_id(self) -> int:
            return self.llm.tokenizer.eos_token_id

        def tok_encode(self, string: str, add_special_tokens: bool = False, **kwargs) -> list[int]:
            return self.llm.tokenizer.encode(string, add_special_tokens=add_special_tokens)  # as the server's /tokenize

        def _loglikelihood_tokens(self, requests, **kwargs) -> list[tuple[float, bool]]:
            """Each (context, continuation) scored as the served request is: the sum of the
            continuation tokens' logprobs, and whether each is the most likely token there."""
            out = []
            for _, context, continuation in requests:
                ids = context + continuation
                result = self.llm.complete(ids, parse_params(mode="ar", max_tokens=0, prompt_logprobs=1))
                scored = result.prompt_logprobs[len(context) :]  # [len(continuation)]
                greedy = all(e.top and e.top[0][0] == e.token_id for e in scored)
                out.append((sum(e.logprob for e in scored), greedy))
            return out

        def loglikelihood_rolling(self, requests):
            raise NotImplementedError("no rolling loglikelihood task is run here")

    return InProcessLM


def InProcessLM(llm, chat: bool = False):  # noqa: N802 (a class, built lazily)
    """An lm-eval LM over `viasd.llm.LLM`: greedy generate-until and loglikelihood from the full
    verifier's prompt logprobs."""
    return _in_process_lm_class()(llm, chat)


def _evaluate(model, task: str, tasks: Path, **kwargs) -> dict:
    """lm-eval's own `simple_evaluate` of one of our tasks (every sample logged, no bootstrap)."""
    lm_eval = require("lm_eval", "bench")
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        tasks=[task],
        # only our task files: indexing lm-eval's thousands of bundled tasks takes seconds a call
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
        **kwargs,
    )


def _score(results: dict) -> dict:
    """The task's exact match and, per document (in order), what the model answered."""
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return {
        "exact_match": results["results"][TASK]["exact_match,none"],
        "answers": [s["filtered_resps"][0] for s in samples],
    }


def _mc_score(results: dict) -> dict:
    """The multiple-choice task's accuracy and, per document (in order), each choice's loglikelihood."""
    samples = sorted(results["samples"][MC_TASK], key=lambda s: s["doc_id"])
    return {
        "acc": results["results"][MC_TASK]["acc,none"],
        "loglikelihoods": [[r[0] for r in s["filtered_resps"]] for s in samples],
    }


def served_loglikelihood(base: str, model: str, tasks: Path, batch_size: int = 1) -> dict:
    """Accuracy of the loglikelihood task through lm-eval's local-completions against `base`
    (`batch_size` prompts in each request)."""
    args = {
        "batch_size": batch_size,
        "base_url": base + "/v1/completions",
        "model": model,
        "tokenizer_backend": "remote",
        "tokenized_requests": True,
        "num_concurrent": 1,
        "max_retries": 1,
    }
    return _mc_score(_evaluate("local-completions", MC_TASK, tasks, model_args=args))


def in_process_loglikelihood(llm, tasks: Path) -> dict:
    return _mc_score(_evaluate(InProcessLM(llm), MC_TASK, tasks))


def served_scores(base: str, model: str, tasks: Path, batch_size: int = 1, chat: bool = True) -> dict[str, dict]:
    """exact match of lm-eval's local-completions (`batch_size` prompts in each request) and, with
    `chat`, local-chat-completions (one conversation a request) against `base`."""
    out = {}
    clients = [("local-completions", "/v1/completions", False)]
    if chat:
        clients.append(("local-chat-completions", "/v1/chat/completions", True))
    for name, path, chat in clients:
        args = {
            "batch_size": batch_size if not chat else 1,
            "base_url": base + path,
            "model": model,
            "tokenizer_backend": None,
            "tokenized_requests": False,
            "num_concurrent": 1,
            "max_retries": 1,
        }
        out[name] = _score(_evaluate(name, TASK, tasks, model_args=args, apply_chat_template=chat))
    return out


def in_process_scores(llm, tasks: Path) -> dict[str, dict]:
    """The same task on the in-process engine: as a completion and as a chat."""
    out = {}
    for name, chat in (("local-completions", False), ("local-chat-completions", True)):
        out[name] = _score(_evaluate(InProcessLM(llm, chat), TASK, tasks, apply_chat_template=chat))
    return out


def max_difference(a: dict, b: dict) -> float:
    """The largest difference between two runs' per-choice loglikelihoods."""
    pairs = [(x, y) for da, db in zip(a["loglikelihoods"], b["loglikelihoods"]) for x, y in zip(da, db)]
    return max(abs(x - y) for x, y in pairs)


def _serve_http(pipeline):
    """The OpenAI-compatible app over `pipeline` on a free loopback port, in a thread; returns
    (base URL, the handler, a function that stops the server)."""
    import threading

    import uvicorn

    from viasd.cluster.handler import RequestHandler
    from viasd.cluster.openai_api import build_http_app

    handler = RequestHandler(pipeline)
    app = build_http_app(handler)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        threading.Event().wait(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]

    def stop() -> None:
        server.should_exit = True
        thread.join(30)

    return f"http://127.0.0.1:{port}", handler, stop


def run_lm_eval_bench(args, config) -> int:
    """Both tasks served and in process on the engine `config`; writes `--out`/results.json.
    Exit status 1 when the served answers differ from the in-process ones."""
    import asyncio
    import tempfile

    import torch

    from viasd.bench import environment
    from viasd.cluster.local import LocalPipeline
    from viasd.cluster.pipeline import PipelineConfig

    lm_eval = require("lm_eval", "bench")
    pipeline = asyncio.run(LocalPipeline.start(PipelineConfig(engine=config)))
    base, handler, stop = _serve_http(pipeline)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tasks = task_dir(Path(tmp))
            served, local = served_scores(base, handler.name, tasks), in_process_scores(pipeline.llm, tasks)
            served_ll = served_loglikelihood(base, handler.name, tasks)
            local_ll = in_process_loglikelihood(pipeline.llm, tasks)
    finally:
        stop()
    package = Path(__file__).resolve().parents[2]
    record = {
        "command": getattr(args, "command_line", None) or " ".join(sys.argv),
        "environment": environment(),
        "lm_eval": getattr(lm_eval, "__version__", None),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "task": {
            "name": TASK,
            "data": DATA.relative_to(package).as_posix(),
            "docs": sum(1 for _ in DATA.open()),
            "output_type": "generate_until",
            "metric": "exact_match",
            "decoding": "greedy, mode ar",
        },
        "verifier": config.verifier,
        "served_model_name": handler.name,
        "served": served,
        "in_process": local,
        "served_equals_in_process": served == local,
        "loglikelihood": {
            "task": {
                "name": MC_TASK,
                "data": MC_DATA.relative_to(package).as_posix(),
                "docs": sum(1 for _ in MC_DATA.open()),
                "output_type": "multiple_choice",
                "metric": "acc",
                "served_through": "local-completions, tokenizer_backend remote, tokenized requests (echo + logprobs)",
            },
            "served": served_ll,
            "in_process": local_ll,
            "max_abs_difference": max_difference(served_ll, local_ll),
        },
    }
    print(json.dumps(record, indent=1))
    out = write_results(args.out, record)
    print(f"wrote {out}/results.json", file=sys.stderr)
    return 0 if record["served_equals_in_process"] else 1
