"""The published benchmark tables are the committed result files, rendered (viasd/bench/tables.py).

Regenerating every marked table of the documents from docs/benchmarks/ reproduces the committed
documents byte for byte; a changed figure in a result file changes its table; `viasd bench report
--check` fails on a stale table and `--docs` rewrites it.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from viasd.bench import tables

ROOT = Path(__file__).resolve().parents[2]


def test_regenerating_every_table_reproduces_the_committed_docs_byte_for_byte():
    for doc in tables.DOCS:
        text = (ROOT / doc).read_text()
        new, changed = tables.update(text, ROOT)
        assert changed == [], f"{doc}: stale tables {changed}; run `viasd bench report --docs`"
        assert new == text


def test_every_table_is_published_once_and_its_sources_are_committed():
    published = [name for doc in tables.DOCS for name in tables.marked((ROOT / doc).read_text())]
    assert sorted(published) == sorted(tables.TABLES)
    for t in tables.TABLES.values():
        for path in t.sources:
            assert (ROOT / path).is_file(), path


def test_each_table_names_its_command_commit_and_cpu_capability():
    for name, t in tables.TABLES.items():
        data = json.loads((ROOT / t.sources[0]).read_text())
        first = tables.render(name, ROOT).splitlines()[0]
        assert first.startswith(f"Source: [`{t.sources[0]}`]"), name
        assert f"`{tables._meta(data)['command']}`" in first, name
        assert f"commit `{tables.commit(data)}`" in first and "CPU capability `" in first, name


def _copy_sources(tmp: Path, name: str) -> None:
    for path in tables.TABLES[name].sources:
        (tmp / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tmp / path)


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_a_changed_figure_in_a_result_file_changes_its_table(tmp_path):
    _copy_sources(tmp_path, "load")
    before = tables.render("load", tmp_path)
    assert "| 1 | 16.0 (17.8) |" in before

    def faster_ar(data):
        (row,) = [r for r in data["summary"] if (r["arrival"], r["method"], r["concurrency"]) == ("all", "ar", 1)]
        row["aggregate_tokens_per_second"] = 99.04

    _edit(tmp_path / tables.TABLES["load"].sources[0], faster_ar)
    after = tables.render("load", tmp_path)
    assert after != before
    assert "| 1 | 99.0 (17.8) |" in after
    # the best mode over generate_batch follows: 99.04 / 11.3 tokens/s
    assert after.splitlines()[4].endswith("| 11.3 (12.7) | 17.3 | 8.74x |"), after.splitlines()[4]


def test_a_changed_raw_run_changes_the_ratios_of_batch_1(tmp_path):
    """The assisted-generation ratios are recomputed per pass from the raw runs."""
    _copy_sources(tmp_path, "batch1")
    before = tables.render("batch1", tmp_path)

    def slow_assisted(data):
        for r in data["runs"]:
            if r["method"] == "hf-assisted":
                r["seconds"] *= 2

    _edit(tmp_path / tables.TABLES["batch1"].sources[0], slow_assisted)
    after = tables.render("batch1", tmp_path)
    row = [line for line in after.splitlines() if line.startswith("| `sd` |")][0]
    assert row != [line for line in before.splitlines() if line.startswith("| `sd` |")][0]
    assert "| 2.85x [2.83-2.87] |" in row  # twice the 1.42x [1.42-1.43] of the committed runs


def test_host_work_table_from_a_small_file():
    data = {
        "command": "measure --rows 2",
        "environment": {"cpu_capability": "AVX2", "git_commit": "0123456789", "git_dirty": False},
        "rows": 2,
        "steps": 1,
        "runs": [
            {
                "side": side,
                "dtype": "torch.float32",
                "methods": {
                    "ar": {
                        "step_seconds": step,
                        "forward_seconds": 0.09,
                        "outside_seconds": step - 0.09,
                        "host_reads": reads,
                        "tokens_per_second": tps,
                    }
                },
            }
            for side, step, reads, tps in (
                ("before", 0.1, 2, 20.0),
                ("after", 0.095, 1, 21.0),
                ("after", 0.097, 1, 22.0),
            )
        ],
    }
    lines = tables.host_work([data])
    assert lines[2] == "| `ar` | per row, on the host | 100 | 90 | 10.0 | 2 | 20.0 |"
    assert lines[3] == "| `ar` | batched, on the device | 96 | 90 | 6.0 | 1 | 21.5 [21.0-22.0] |"
    assert tables.capability(data) == "AVX2" and tables.commit(data) == "0123456" and tables.dtype(data) == "float32"


def test_update_rewrites_a_stale_table_and_names_it():
    body = tables.render("host-work", ROOT)
    stale = "intro\n<!-- table:host-work -->\nold figures\n<!-- /table:host-work -->\nend\n"
    new, changed = tables.update(stale, ROOT)
    assert changed == ["host-work"]
    assert new == f"intro\n<!-- table:host-work -->\n{body}<!-- /table:host-work -->\nend\n"
    assert tables.update(new, ROOT) == (new, [])
    with pytest.raises(KeyError, match="unknown table"):
        tables.update("<!-- table:nope -->\n<!-- /table:nope -->\n", ROOT)


def test_report_check_fails_on_a_stale_doc_and_docs_rewrites_it(tmp_path):
    for name in tables.TABLES:
        _copy_sources(tmp_path, name)
    for doc in tables.DOCS:
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        text = (ROOT / doc).read_text().replace("| `sd` | 6.52 [6.48-6.55] |", "| `sd` | 9.99 [6.48-6.55] |")
        assert ("9.99" in text) == (doc == "docs/BENCHMARKS.md")
        (tmp_path / doc).write_text(text)
    out = io.StringIO()
    assert tables.report(tmp_path, check=True, out=out) == 1
    assert "docs/BENCHMARKS.md: batch1" in out.getvalue()
    assert tables.report(tmp_path, docs=True, out=io.StringIO()) == 0
    assert tables.report(tmp_path, check=True, out=io.StringIO()) == 0
    for doc in tables.DOCS:
        assert (tmp_path / doc).read_text() == (ROOT / doc).read_text()


def test_the_cli_checks_the_committed_docs(capsys):
    from viasd.cli import main

    assert main(["bench", "report", "--check", "--root", str(ROOT)]) == 0
    assert main(["bench", "report", "--root", str(ROOT)]) == 0
    assert "<!-- table:quality -->" in capsys.readouterr().out


def test_layer_lists_are_compact_and_a_changed_mask_score_changes_the_dimr_table(tmp_path):
    assert tables._layers([3, 4, 9, 10, 11, 12, 25, 26]) == "3, 4, 9-12, 25, 26"
    assert tables._layers([2, 4, 6, 8, 10, 12]) == "2, 4, 6, ..., 12"
    assert tables._layers([1, 2]) == "1, 2"
    _copy_sources(tmp_path, "dimr-ratios")
    before = tables.render("dimr-ratios", tmp_path)
    assert "| 0.35 | **52.9%** / 2.61 / 0.68 |" in before
    _edit(tmp_path / "docs/dimr-compare.json", lambda d: d["ratios"][3]["masks"][0].update(top1=0.4))
    after = tables.render("dimr-ratios", tmp_path)
    assert "| 0.35 | 40.0% / 2.61 / 0.68 |" in after  # no longer the best: not bold


def test_the_quantization_tables_follow_their_files(tmp_path):
    """docs/QUANTIZATION.md's tables: the committed files' figures, and a changed run changes them."""
    for name in ("quant-e2e", "quant-gguf", "quant-kernels"):
        _copy_sources(tmp_path, name)
    e2e = tables.render("quant-e2e", tmp_path)
    assert "| int4 (int4: `requested`) | 31.7 | 59.8 (1.99x) | 52.0 (1.25x) | 20% | 75.4 (0.98x) | 1.13 / 3.09 |" in e2e
    assert "| `qwen2.5-coder-0.5b-instruct` | Q8_0 | 13 | int8 (gguf Q8_0 -> int8) | 0.0017 | 0.50 |" in tables.render(
        "quant-gguf", tmp_path
    )
    assert "| lm_head 1536 -> 151936 | 1 | 22.39 | 17.19 | 12.06 | 7.276 |" in tables.render("quant-kernels", tmp_path)
    assert "commit `24f0f97 (uncommitted changes)`; CPU capability `AVX512`" in e2e.splitlines()[0]

    def slower_none(data):
        data["e2e"]["runs"][0]["ar_1_s_per_token"] *= 2  # the baseline: every ratio of ar doubles

    _edit(tmp_path / "docs/benchmarks/cpu/quant/e2e.json", slower_none)
    after = tables.render("quant-e2e", tmp_path)
    assert "| int4 (int4: `requested`) | 31.7 | 59.8 (3.98x) |" in after and "| 238.3 | 64.9 |" in after
