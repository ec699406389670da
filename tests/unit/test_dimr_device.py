"""Where `viasd dimr` runs (viasd.dimr.placement): device flags and their errors, the layer
placement over several devices, the placed forward, host reads per scored mask, and the same
artifact from the default run, `--device cpu` and a layer placement over CPU "devices".

No test here needs a GPU: CUDA's absence is forced where a test depends on it, a placement over
several devices is checked as a pure function, and the placed forward runs on CPU devices that
torch tells apart (`cpu` and `cpu:0`) but that hold the same memory.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model

from viasd import dimr
from viasd.dimr import placement as pl
from viasd.errors import InvalidParameterError
from viasd.runtime import LayerMask, MaskedLM

VOCAB = 96
CUDA = [torch.device("cuda", i) for i in range(8)]  # device objects only: nothing is allocated on them


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_cuda(monkeypatch):
    """CUDA unavailable, whatever this machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def two_gpus(monkeypatch):
    """A machine that says it has cuda:0 and cuda:1 (only the device checks ask)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


# ----------------------------------------------------------------------------- device flags


def test_device_strings_parse_and_bad_ones_name_the_flag(no_cuda):
    assert pl.parse_device("cpu") == torch.device("cpu") == pl.parse_device(" CPU ")
    for bad in ("tpu", "gpu", "mps", "meta", "cpu:1", "cuda:x", ""):
        with pytest.raises(InvalidParameterError, match="--device") as err:
            pl.parse_device(bad)
        assert err.value.field == "device"
    for spec in ("cuda", "cuda:0"):
        with pytest.raises(InvalidParameterError, match="--device cuda.*CUDA is not available"):
            pl.parse_device(spec)
    with pytest.raises(InvalidParameterError, match="--devices 4.*CUDA is not available") as err:
        pl.parse_devices("4")
    assert err.value.field == "devices"
    assert pl.parse_devices("cpu,cpu") == (torch.device("cpu"),) * 2
    for bad in ("", ",", "cpu,tpu"):
        with pytest.raises(InvalidParameterError, match="--devices"):
            pl.parse_devices(bad)
    with pytest.raises(InvalidParameterError, match="not both"):
        pl.search_devices("cpu", "cpu,cpu")
    assert pl.search_devices(None, None) == ((torch.device("cpu"),), "--device")


def test_cuda_devices_get_their_index_and_must_exist(two_gpus):
    assert pl.parse_device("cuda") == torch.device("cuda", 1)  # the current device, with its index
    assert pl.parse_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(InvalidParameterError, match="2 CUDA device"):
        pl.parse_device("cuda:2")
    assert pl.parse_devices("2") == pl.parse_devices("all") == (CUDA[0], CUDA[1])
    assert pl.parse_devices("cuda:1,cuda:0") == (CUDA[1], CUDA[0])
    for bad in ("3", "0"):
        with pytest.raises(InvalidParameterError, match="--devices"):
            pl.parse_devices(bad)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--device", "cuda"], "--device cuda"),
        (["--device", "cuda:1"], "--device cuda:1"),
        (["--device", "tpu"], "--device 'tpu'"),
        (["--devices", "8"], "--devices 8"),
        (["--devices", "cuda:0,cuda:1"], "--devices cuda:0"),
    ],
)
def test_cli_device_errors_exit_2_before_loading_anything(no_cuda, capsys, flags, named):
    from viasd.cli import main

    assert main(["dimr", "--verifier", "no-such-model", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err and "Traceback" not in err
    assert "no-such-model" not in err  # checked before the model is looked up


def test_cli_refuses_device_and_devices_together(capsys):
    from viasd.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["dimr", "--device", "cpu", "--devices", "cpu,cpu"])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err


# ----------------------------------------------------------------------------- placement


def test_split_layers_gives_consecutive_balanced_blocks():
    split = pl.split_layers(80, 4)
    assert split == tuple(j for j in range(4) for _ in range(20))
    sizes = [pl.split_layers(80, 3).count(j) for j in range(3)]
    assert sizes == [27, 27, 26]
    assert [pl.split_layers(10, 4).count(j) for j in range(4)] == [2, 3, 3, 2]  # extras in the middle first
    for layers, n in ((80, 8), (28, 3), (7, 7), (5, 1), (61, 6)):
        s = pl.split_layers(layers, n)
        assert len(s) == layers and list(s) == sorted(s) and set(s) == set(range(n))  # consecutive, all used
        assert max(s.count(j) for j in range(n)) - min(s.count(j) for j in range(n)) <= 1
    with pytest.raises(InvalidParameterError, match="at most 6"):
        pl.split_layers(6, 7)


def test_placement_puts_embeddings_first_and_the_head_last_or_with_tied_embeddings():
    p = pl.Placement.spread(CUDA[:4], 80)
    assert p.param_device("model.embed_tokens.weight") == CUDA[0]
    assert p.param_device("model.layers.0.self_attn.q_proj.weight") == CUDA[0]
    assert p.param_device("model.layers.19.mlp.down_proj.weight") == CUDA[0]
    assert p.param_device("model.layers.20.input_layernorm.weight") == CUDA[1]
    assert p.param_device("model.layers.79.mlp.up_proj.weight") == CUDA[3]
    assert p.param_device("model.norm.weight") == p.param_device("lm_head.weight") == CUDA[3]
    assert p.as_dict() == {
        "devices": ["cuda:0", "cuda:1", "cuda:2", "cuda:3"],
        "layers": [[0, 19], [20, 39], [40, 59], [60, 79]],
        "head": "cuda:3",
    }
    assert p.describe().startswith("cuda:0 (embeddings, layers 0-19); cuda:1 (layers 20-39)")
    assert p.describe().endswith("cuda:3 (head, layers 60-79)")
    tied = pl.Placement.spread(CUDA[:2], 28, tied=True)
    assert tied.param_device("lm_head.weight") == tied.param_device("model.norm.weight") == CUDA[0]


def test_placement_bytes_and_the_memory_check():
    with torch.device("meta"):
        model = tiny_model("llama", layers=6, dtype=torch.float32)
    p = pl.Placement.spread(CUDA[:3], 6)
    need = pl.placement_bytes(model, p, torch.bfloat16)
    total = sum(q.numel() for q in model.parameters()) * 2
    assert sum(need.values()) == total and set(need) == {"cuda:0", "cuda:1", "cuda:2"}
    layer = sum(q.numel() for q in model.model.layers[0].parameters()) * 2
    assert need["cuda:1"] == 2 * layer  # two layers, nothing else
    assert need["cuda:0"] == 2 * layer + model.model.embed_tokens.weight.numel() * 2
    free = dict.fromkeys(need, max(need.values()) + 100)
    pl.check_fits(need, free, "--devices", headroom=100)  # fits exactly
    free["cuda:2"] -= 1
    with pytest.raises(InvalidParameterError, match="--devices: .* on cuda:2") as err:
        pl.check_fits(need, free, "--devices", headroom=100)
    assert err.value.field == "devices"
    pl.check_fits(need, {}, "--device")  # devices without a free-memory figure (CPU) are not checked


# ----------------------------------------------------------------------------- the placed forward


def _alternating(lm: pl.PlacedLM, devices) -> None:
    """Give lm's layers the given devices (all CPU memory, but distinct torch devices)."""
    lm.layer_devices = tuple(devices)
    lm.devices = tuple(dict.fromkeys((lm.device, *lm.layer_devices, lm.head_device)))


def test_placed_forward_runs_each_device_block_in_turn_and_equals_one_device(monkeypatch):
    model = tiny_model("llama", layers=6, dtype=torch.float32)
    base = MaskedLM(model)
    placed = pl.PlacedLM(model)
    cpu, cpu0 = torch.device("cpu"), torch.device("cpu", 0)  # unequal devices, one memory
    _alternating(placed, [cpu, cpu, cpu0, cpu0, cpu0, cpu])
    runs = []
    run_layers = MaskedLM.run_layers

    def spy(self, hidden, positions, attn_mask, past, layers, rope=None):
        runs.append(list(layers))
        return run_layers(self, hidden, positions, attn_mask, past, layers, rope)

    monkeypatch.setattr(MaskedLM, "run_layers", spy)
    tok = torch.randint(0, VOCAB, (17,), generator=torch.Generator().manual_seed(2))
    mask = LayerMask.from_skipped([1, 3], 6)
    got = placed.forward(tok, 0, None, mask)
    assert runs == [[0], [2, 4], [5]]  # one call per block of kept layers on one device
    runs.clear()
    want = base.forward(tok, 0, None, mask)
    assert runs == [[0, 2, 4, 5]]
    assert torch.equal(got, want)
    # the shared-policy scoring goes through the same layer loop
    full = base.new_cache()
    base.forward(tok, 0, full)
    kv = {i: full.kv(i) for i in base.all_layers}
    assert torch.equal(
        dimr.shared_policy_logits(placed, tok, kv, mask, 6), dimr.shared_policy_logits(base, tok, kv, mask, 6)
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_separate_policy_logits_are_the_forward_exactly(arch):
    lm = MaskedLM(tiny_model(arch, layers=8, dtype=torch.float32))
    tok = torch.randint(0, VOCAB, (29,), generator=torch.Generator().manual_seed(4))
    for mask in (LayerMask.full(8), LayerMask.from_skipped([0, 3, 4, 7], 8), LayerMask.evenly_spaced(0.45, 8)):
        assert torch.equal(dimr.separate_policy_logits(lm, tok, mask), lm.forward(tok, 0, None, mask))


# ----------------------------------------------------------------------------- host reads per mask


_READS = ("__float__", "__int__", "__bool__", "item", "tolist", "numpy")


@pytest.mark.parametrize("objective", ["rkl", "kl", "tv", "top1"])
def test_a_scored_mask_reads_the_device_once_per_rung_and_once_at_the_end(objective, monkeypatch):
    """Every way a tensor's value reaches the host is counted while a trial is scored: one read
    (host_sums' tolist) at each rung reached and one at the end, none per sequence."""
    lm = MaskedLM(tiny_model("llama", layers=8, dtype=torch.float32))
    g = torch.Generator().manual_seed(0)
    cal = dimr.token_calibration([torch.randint(0, VOCAB, (24,), generator=g).tolist() for _ in range(8)])
    ref = dimr.build_reference(lm, cal)
    search = dimr.MaskSearch(lm, ref, dimr.make_objective(objective), dimr.SearchSettings(ratio=0.25, trials=4))
    assert search.ends == [2, 4]
    reads = []
    for name in _READS:
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _orig=orig, **k):
            reads.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    rec = dimr.TrialRecord(0, "random", (2, 5))
    search.score(rec)
    monkeypatch.undo()
    assert not rec.pruned and rec.tokens == ref.num_tokens and len(rec.rung_values) == 2
    assert reads == ["tolist"] * 3, reads  # two rungs + the end, over 8 sequences
    # and the value is the per-sequence float sums' (what scoring each sequence on the host gives)
    obj, mask = search.objective, LayerMask.from_skipped((2, 5), 8)
    stats = [dimr.host_sums(obj.stats(dimr.slim_logprobs(lm, ref, i, mask), ref, i)) for i in range(8)]
    want = obj.value({k: sum(s[k] for s in stats) for k in stats[0]})
    assert rec.value == want


# ----------------------------------------------------------------------------- end to end


def _char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): 3 + i for i, c in enumerate(range(32, 125))}}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    t.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


_VOLATILE = ("created_at", "seconds", "reference_seconds", "command", "placement")


def test_cpu_device_and_a_cpu_layer_placement_write_the_default_run_s_artifact(tmp_path, capsys):
    """The default run, `--device cpu` and `--devices cpu,cpu,cpu` (the placed loader and forward,
    layers 0-1 / 2-3 / 4-5) search the same masks to the same values: the artifacts are equal but
    for times, the command and the placement they record."""
    from conftest import drafter_from

    from viasd.cli import main

    verifier = tiny_model("llama", layers=6, dtype=torch.float32)
    tok = _char_tokenizer()
    for name, m in (("verifier", verifier), ("drafter", drafter_from(verifier))):
        m.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    common = [
        "dimr",
        "--verifier",
        str(tmp_path / "verifier"),
        "--drafter",
        str(tmp_path / "drafter"),
        "--dtype",
        "float32",
        "--ratio",
        "0.34",
        "--trials",
        "8",
        "--calib-tokens",
        "96",
        "--max-seq-tokens",
        "24",
        "--heldout-tokens",
        "48",
        "--cache-policy",
        "shared",
        "--costs",
        "1,2,10,5",
        "--no-progress",
    ]
    arts = {}
    for label, extra in (("default", []), ("cpu", ["--device", "cpu"]), ("placed", ["--devices", "cpu,cpu,cpu"])):
        out = tmp_path / f"{label}.json"
        assert main([*common, *extra, "--out", str(out)]) == 0, label
        arts[label] = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert "cpu (embeddings, layers 0-1); cpu (layers 2-3); cpu (head, layers 4-5)" in text
    assert arts["placed"]["placement"]["layers"] == [[0, 1], [2, 3], [4, 5]]
    one_cpu = {"devices": ["cpu"], "layers": [[0, 5]], "head": "cpu"}
    assert arts["default"]["placement"] == arts["cpu"]["placement"] == one_cpu

    def stable(a):
        a = {k: v for k, v in a.items() if k not in _VOLATILE}
        a["search"] = {k: v for k, v in a["search"].items() if k != "search_seconds"}
        return a

    assert stable(arts["default"])["heldout"]["searched"]["e2e"] > 0  # the drafter's figures are there
    assert stable(arts["cpu"]) == stable(arts["default"])
    assert stable(arts["placed"]) == stable(arts["default"])
