"""Shared fixtures: tiny random LLaMA / Qwen2 pairs (drafter shares the verifier's vocabulary)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import os
import random
import socket
import threading
import time

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCAB = 96


def tiny_model(
    arch: str = "llama",
    layers: int = 6,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    hidden: int = 48,
    intermediate: int = 96,
):
    """A small random decoder-only LM of the given architecture, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    cfg = cfg_cls(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.08,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_cls(cfg)
    with torch.no_grad():  # embeddings dominate the residual stream: related sub-models agree often
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.normal_(0.0, 0.6)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.4)
            layer.mlp.down_proj.weight.mul_(0.4)
    return model.to(dtype).eval()


def drafter_from(verifier, keep_layers: int = 2):
    """A drafter that shares the verifier's embeddings and head and keeps its first layers,
    perturbed a little: related enough to be accepted often, different enough to be rejected."""
    d = copy.deepcopy(verifier)
    d.model.layers = torch.nn.ModuleList(list(d.model.layers[:keep_layers]))
    d.config.num_hidden_layers = keep_layers
    if hasattr(d.config, "layer_types") and d.config.layer_types is not None:
        d.config.layer_types = d.config.layer_types[:keep_layers]
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in d.model.layers.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.02)
    return d.eval()


def listen_port() -> int:
    """A loopback port free now, for a server a test starts later. Taken below the kernel's
    ephemeral range (`ip_local_port_range`), so that no socket bound to port 0 meanwhile (the other
    test worker's servers, Ray's, every client's) can take it first, as one picked by binding port 0
    could be taken; random, so that two workers asking at once do not pick the same."""
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(1000):
        port = rng.randrange(min(20000, low - 1000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port below {low}")


def slow_forwards(monkeypatch, lm, seconds: float = 0.01) -> None:
    """Make every batched forward of `lm` take `seconds` more. Drafting ahead (`overlap`) runs
    beside the verifier's forwards and stops when they end: how far it gets is a matter of thread
    timing, and with tiny models often its first token only, whose block is then never used. Beside
    a slow verifier it drafts on, so that a test may count on drafted-ahead tokens being used."""
    import time

    forward_batch = lm.forward_batch

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return forward_batch(*args, **kwargs)

    monkeypatch.setattr(lm, "forward_batch", slow)


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_pair(request):
    """(verifier MaskedLM, drafter MaskedLM) in float64."""
    from viasd.runtime import MaskedLM

    v = tiny_model(request.param)
    return MaskedLM(v), MaskedLM(drafter_from(v))


@pytest.fixture(scope="session")
def ray_session():
    """ONE local Ray for the whole test session (started on first use): loopback only, no
    dashboard, logical CPUs so that tests can place a few small actors on a 2-core machine."""
    import ray

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_enable_worker_prestart", "0")  # actors get their own workers anyway
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local", num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False
        )
    yield ray
    if started:
        ray.shutdown()


# ------------------------------------------------------------------ served pipelines (Ray + gRPC tests)

LOOP_TIMEOUT_S = 120  # any single step (pipeline start, one request) fails after this


class Loop:
    """One event loop in a thread: grpc.aio channels and the pipelines live in it for a module."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = LOOP_TIMEOUT_S):
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.loop).result(timeout + 5)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def aio():
    loop = Loop()
    yield loop
    loop.close()


def process_alive(proc) -> bool:
    """A psutil.Process that still runs (a zombie or a vanished one does not)."""
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def save_tiny_pair(root, tokenizer=None, *, hidden: int = 48, intermediate: int = 96, **engine):
    """A float32 tiny LLaMA pair saved as HF directories (eos_token_id 2 in their configs; with
    `tokenizer` saved beside each), and the EngineConfig that loads it through the normal loader
    (`engine`: more of its fields)."""
    from viasd.config import EngineConfig

    verifier = tiny_model("llama", dtype=torch.float32, hidden=hidden, intermediate=intermediate)
    for name, model in (("verifier", verifier), ("drafter", drafter_from(verifier))):
        model.save_pretrained(root / name)
        if tokenizer is not None:
            tokenizer.save_pretrained(root / name)
    return EngineConfig(
        verifier=str(root / "verifier"),
        drafter=str(root / "drafter"),
        dtype="float32",
        mask=(1, 0, 1, 0, 1, 1),
        threads=1,
        **engine,
    )


@contextlib.contextmanager
def served_http(aio, handler):
    """The OpenAI-compatible app over a request handler, on uvicorn on a free loopback port in the
    test loop: yields its base URL."""
    import uvicorn

    from viasd.cluster.openai_api import build_http_app

    app = build_http_app(handler)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))

    async def start():
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.02)
        return task

    task = aio.run(start())
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        aio.run(task)
        sock.close()
