"""`viasd serve [MODEL] [flags]`: vLLM's flags with vLLM's meanings, over the --config file."""

from __future__ import annotations

import pytest

from viasd.cli import build_parser, serve_config_from_args
from viasd.errors import InvalidParameterError


def config_of(*argv: str):
    return serve_config_from_args(build_parser().parse_args(["serve", *argv]))


def test_vllm_flags_set_the_default_pipeline():
    c = config_of(
        "my-verifier",
        "--drafter", "my-drafter",
        "--tensor-parallel-size", "4",
        "--max-num-seqs", "32",
        "--max-model-len", "4096",
        "--dtype", "float16",
        "--served-model-name", "llama",
        "--host", "0.0.0.0",
        "--port", "8080",
        "--grpc-port", "9100",
    )  # fmt: skip
    p = c.pipeline()
    assert (p.engine.verifier, p.engine.drafter, p.engine.dtype) == ("my-verifier", "my-drafter", "float16")
    assert (p.tp_size, p.engine.max_batch, p.engine.max_context, p.served_model_name) == (4, 32, 4096, "llama")
    assert c.limits.max_concurrent_requests == 32  # a request past max-num-seqs waits, as in vLLM
    assert (c.http.host, c.http.port, c.grpc.port) == ("0.0.0.0", 8080, 9100)


def test_no_flags_keep_the_defaults_and_a_config_file_is_read_first(tmp_path):
    default = config_of()
    assert default.http.port == 8000 and default.grpc.port == 9000 and default.limits.max_concurrent_requests is None
    assert default.max_running() == default.pipelines[0].engine.max_batch  # what the engine decodes at once
    yaml = tmp_path / "serve.yaml"
    yaml.write_text("pipelines:\n  - engine: {verifier: from-file, max_batch: 6}\nhttp: {port: 8001}\n")
    c = config_of("--config", str(yaml), "--port", "8002")
    assert c.pipeline().engine.verifier == "from-file" and c.pipeline().engine.max_batch == 6 and c.http.port == 8002


def test_the_default_admission_limit_is_max_batch_and_the_full_context_figure_is_logged(caplog):
    """A replica decodes, by default, its engine's max_batch requests at once, with slot rows and
    with paged caches alike (paged: the engine admits them against the blocks they hold and queues
    the rest, as vLLM's max_num_seqs); the full-context requests its started pipeline's caches hold
    (Capacity.concurrency: the rows, or what the blocks hold) is logged, not a limit, and an
    explicit limits.max_concurrent_requests still wins."""
    import logging

    from viasd.cluster.app import running_limit
    from viasd.executor import Capacity

    class Started:  # a started pipeline's info
        def __init__(self, capacity):
            self.capacity = capacity

        def info(self):
            return {"capacity": self.capacity.describe()}

    default = config_of()
    rows = default.pipeline().engine.max_batch
    assert default.pipeline().engine.kv_block_size == 16  # paged by default
    slots = Capacity(max_batch=rows, max_seq_len=4096)
    paged = Capacity(max_batch=rows, max_seq_len=32768, block_size=16, kv_blocks=2048 * 2 + 100)  # 2 of 32k
    assert (slots.concurrency, paged.concurrency) == (rows, 2)
    assert Capacity(max_batch=4, max_seq_len=4096, block_size=16, kv_blocks=256 * 10).concurrency == 4  # rows
    assert Capacity(max_batch=4, max_seq_len=4096, block_size=16, kv_blocks=100).concurrency == 1  # one always runs
    with caplog.at_level(logging.INFO, logger="viasd.serve"):
        assert running_limit(default, default.pipeline().name, Started(paged)) == rows
        assert "2 requests of 32768 positions at once; shorter ones admitted against the blocks" in caplog.text
        assert f"max_concurrent_requests {rows}" in caplog.text
        assert running_limit(default, default.pipeline().name, Started(slots)) == rows
    explicit = default.model_copy(update={"limits": default.limits.model_copy(update={"max_concurrent_requests": 3})})
    assert running_limit(explicit, explicit.pipeline().name, Started(paged)) == 3


def test_speculative_config_maps_to_the_drafter_and_the_default_params():
    c = config_of("m", "--speculative-config", '{"model": "d", "num_speculative_tokens": 3}')
    assert c.pipeline().engine.drafter == "d" and c.default_params["gamma"] == 3
    lookup = config_of(
        "m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2}'
    )
    assert lookup.default_params == {"proposer": "ngram", "gamma": 4, "ngram_max": 2}
    assert config_of("m", "--drafter", "none").pipeline().engine.drafter is None


def test_block_size_chooses_the_kv_cache_and_0_asks_for_slot_rows(tmp_path):
    """vLLM's --block-size is engine.kv_block_size (16: paged caches); 0 selects slot rows, from
    the flag, from YAML and from Python alike; a value that is not a block size names the field."""
    from viasd.cluster.serve_config import load_serve_config
    from viasd.config import EngineConfig, parse_engine_config

    assert config_of().pipeline().engine.kv_block_size == EngineConfig().kv_block_size == 16
    assert config_of("--block-size", "32").pipeline().engine.block_size == 32
    slots = config_of("--block-size", "0").pipeline().engine
    assert (slots.kv_block_size, slots.block_size) == (0, None)
    yaml = tmp_path / "serve.yaml"
    yaml.write_text("pipelines:\n  - engine: {kv_block_size: 0}\n")
    assert load_serve_config(yaml).pipeline().engine.block_size is None
    assert parse_engine_config(kv_block_size=0).block_size is None and EngineConfig(kv_block_size=8).block_size == 8
    for bad in (None, -1, 2048, "sixteen"):
        with pytest.raises(InvalidParameterError) as err:
            parse_engine_config(kv_block_size=bad)
        assert err.value.field == "kv_block_size"
    yaml.write_text("pipelines:\n  - engine: {kv_block_size: null}\n")
    with pytest.raises(InvalidParameterError) as err:
        load_serve_config(yaml)
    assert err.value.field == "pipelines.0.engine.kv_block_size" and "0 for slot rows" in err.value.message
    args = build_parser().parse_args(["generate", "--kv-block-size", "0", "x"])
    assert args.kv_block_size == 0


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--speculative-config", "{not json"], "speculative_config"),
        (["--speculative-config", '{"method": "eagle"}'], "speculative_config"),
        (["--speculative-config", '{"draft_tensor_parallel_size": 2}'], "speculative_config"),
        (["--max-num-seqs", "0"], "pipelines.0.engine.max_batch"),
        (["--block-size", "-1"], "pipelines.0.engine.kv_block_size"),
        (["--port", "9000"], "grpc.port"),
    ],
)
def test_bad_flags_name_their_field(argv, field):
    with pytest.raises(InvalidParameterError) as err:
        config_of(*argv)
    assert err.value.field == field


def test_help_shows_an_example_per_common_case(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--tensor-parallel-size", "--max-num-seqs", "--speculative-config", "--api-key", "--config"):
        assert flag in out
    assert out.count("viasd serve") >= 5


def test_a_hugging_face_id_in_the_local_cache_is_served_offline(tmp_path, monkeypatch):
    """MODEL may be a Hugging Face id already in the local Hugging Face cache (a small cache built
    here: refs/main -> snapshots/<rev>); an id that is not there is refused, saying how to get it."""
    import huggingface_hub.constants
    import torch
    from conftest import tiny_model

    from viasd.errors import ModelLoadError
    from viasd.models.loader import load_causal_lm, resolve_model_dir

    repo = tmp_path / "models--acme--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    tiny_model("llama", dtype=torch.float32).save_pretrained(repo / "snapshots" / "0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_dir("acme/tiny-llama") == repo / "snapshots" / "0123abcd"
    model, _ = load_causal_lm("acme/tiny-llama", dtype="float32")
    assert model.config.model_type == "llama"
    with pytest.raises(ModelLoadError, match="huggingface-cli download acme/other"):
        resolve_model_dir("acme/other")
