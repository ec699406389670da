"""The `viasd` command line: validation before loading anything, JSON output on a real model."""

from __future__ import annotations

import json

import pytest

from viasd.cli import main


@pytest.mark.parametrize(
    "flags, field",
    [
        (["--alpha1", "0.3", "--alpha2", "0.5"], "alpha2"),
        (["--gamma", "0"], "gamma"),
        (["--temperature", "-1"], "temperature"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--mode", "fast"], "mode"),
    ],
)
def test_generate_rejects_bad_parameters_naming_the_field(flags, field, capsys):
    assert main(["generate", "x", "--verifier", "no-such-model", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["generate", "x", "--verifier", "no-such-model", "--drafter", "none", "--mode", "ar"]) == 2
    assert "no-such-model" in capsys.readouterr().err


class _Loaded(Exception):
    """Raised in place of loading models: carries the engine config a command would load with."""


@pytest.mark.parametrize(
    "argv, max_batch",
    [
        (["generate", "x"], 1),  # one request
        (["generate", "x", "--max-batch", "4"], 4),
        (["bench", "--methods", "ar"], 1),  # the batch-1 benchmark runs one request at a time
        (["bench", "--suite", "load", "--concurrency", "1,8,2"], 8),  # the highest concurrency
        (["bench", "--suite", "load", "--max-batch", "16"], 16),
    ],
)
def test_each_command_sizes_the_batch_it_runs_and_the_flag_wins(argv, max_batch, monkeypatch):
    """`max_batch` is also the rows a step `dtype: auto` decides for (viasd.precision.engine_dtype)."""
    import viasd.llm

    def load(config, *a, **k):
        raise _Loaded(config)

    monkeypatch.setattr(viasd.llm, "LLM", load)
    flags = ["--verifier", "smollm2-135m-instruct", "--drafter", "none"]
    with pytest.raises(_Loaded) as loaded:
        main([*argv, *flags, *(["--prompts", "1"] if argv[0] == "bench" else [])])
    assert loaded.value.args[0].max_batch == max_batch


def test_bench_help_lists_every_suite_with_one_line_each(capsys):
    from viasd.cli import SUITES, build_parser

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    listed = capsys.readouterr().out.split("suites:\n", 1)[1].strip().splitlines()
    assert [line.split()[0] for line in listed] == list(SUITES) and all(len(line.split()) > 3 for line in listed)
    for suite in SUITES:
        assert build_parser().parse_args(["bench", "--suite", suite]).suite == suite


def test_a_bad_concurrency_names_the_field(capsys):
    assert main(["bench", "--suite", "load", "--concurrency", "0,x"]) == 2
    assert "concurrency" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_json_on_smollm2(capsys):
    rc = main(
        [
            "generate",
            "def add(a, b):",
            "--verifier",
            "smollm2-135m-instruct",
            "--drafter",
            "smollm2-135m-instruct",
            "--dtype",
            "float32",
            "--mode",
            "via",
            "--max-tokens",
            "12",
            "--json",
            "--ignore-eos",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] and out["stats"]["generated_tokens"] == 12 and out["stats"]["mode"] == "via"
    # drafter == verifier and an all-layers-kept slim verifier would accept everything; with the
    # default mask q' differs from q, so the tiers are exercised and counted
    assert out["stats"]["num_drafts"] > 0 and out["stats"]["forwards"]["slim"] == out["stats"]["num_drafts"]
