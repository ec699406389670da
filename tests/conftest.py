"""Shared fixtures: tiny random LLaMA / Qwen2 pairs (drafter shares the verifier's vocabulary)."""

from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VOCAB = 96


def tiny_model(arch: str = "llama", layers: int = 6, dtype: torch.dtype = torch.float64, seed: int = 0):
    """A small random decoder-only LM of the given architecture, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    cfg = cfg_cls(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
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
    ray = pytest.importorskip("ray")
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_enable_worker_prestart", "0")  # actors get their own workers anyway
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=8, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()
