"""Weight-only quantized linears (viasd.quant): the quantizers' error bounds, every kernel against
the dequantized reference within a stated tolerance, the choice of kernel by row count, whole
models, greedy `sd` == greedy `ar` on quantized weights (float32 activations), the engine option.
Behaviour, not timing: where a probe decides, its timer is replaced."""

from __future__ import annotations

import pytest
import torch
from conftest import drafter_from, save_tiny_pair, tiny_model

from viasd import quant as Q
from viasd.config import parse_engine_config, parse_params
from viasd.engine import Engine
from viasd.errors import InvalidParameterError
from viasd.runtime import LayerMask, MaskedLM

#: |kernel - reference| <= TOL[dtype] * (|x| @ |W|^T), elementwise: float32 sums in float32; in
#: bf16 / fp16 the kernels read scales rounded to the dtype and round their output to it (one
#: rounding each: 2^-8 is bf16's unit roundoff, 2^-10 twice fp16's).
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-10}


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    """No probe kept from another test, and no cache but this test's (an engine keeps its probes
    in the cache directory)."""
    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path / "cache"))
    Q._reset_cache()
    yield
    Q._reset_cache()


def _weight(n=96, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05  # [N, K]
    w[3, :32] = 0.25  # a constant int4 group (scale 0)
    w[5] *= 20  # a channel of another magnitude
    return w


@pytest.mark.parametrize("scheme, group", [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)])
def test_quantizers_round_to_nearest(scheme, group):
    w = _weight()
    qw = Q.quantize_int8(w) if scheme == "int8" else Q.quantize_int4(w, group)
    err = (qw.dequantize() - w).abs()  # [N, K]
    if scheme == "int8":
        assert qw.q.dtype == torch.int8 and int(qw.q.abs().max()) <= 127
        bound = qw.scale[:, None] / 2
    else:
        assert qw.q.dtype == torch.uint8 and int(qw.q.max()) <= 15 and qw.scale.shape == (96, 128 // group)
        bound = qw.scale.repeat_interleave(group, 1) / 2
    assert bool((err <= bound * (1 + 1e-5) + 1e-7).all())
    assert err.max() > 0  # (a lossy quantizer: the test can see an error)
    if scheme == "int4":
        assert torch.equal(qw.dequantize()[3, :32], w[3, :32])  # a constant group is exact


KERNELS = [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("scheme, group", KERNELS)
@pytest.mark.parametrize("kernel", ["int", "dense"])
def test_each_kernel_agrees_with_the_dequantized_reference(scheme, group, dtype, kernel):
    w = _weight()
    qw = Q.quantize_int8(w) if scheme == "int8" else Q.quantize_int4(w, group)
    bias = torch.randn(96).to(dtype)
    mod = Q.quantized_linear(qw, bias, dtype, dense=1 if kernel == "dense" else False)
    ref_w = qw.dequantize().double()  # [N, K]
    g = torch.Generator().manual_seed(1)
    for shape in [(1, 128), (3, 128), (16, 128), (2, 5, 128)]:
        x = torch.randn(*shape, generator=g).to(dtype)
        with torch.no_grad():
            y = mod(x)
        assert y.shape == (*shape[:-1], 96) and y.dtype == dtype
        ref = x.double() @ ref_w.t() + bias.double()
        scale = x.double().abs() @ ref_w.abs().t() + bias.double().abs()
        assert bool(((y.double() - ref).abs() <= TOL[dtype] * scale).all()), (y.double() - ref).abs().max()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_dense_copy_is_the_integer_kernels_weight(scheme, dtype):
    """Both kernels compute with one set of weights: the dense copy equals the weight the integer
    kernel computes with (read back through it on the identity), exactly in bf16 / fp16; in float32
    int4's ``(q - 8) * s + z`` within one float32 rounding (the kernel fuses the multiply-add)."""
    w = _weight()
    qw = Q.quantize_int8(w) if scheme == "int8" else Q.quantize_int4(w)
    mod = Q.quantized_linear(qw, None, dtype)
    dense, kernel = Q._dense_of(qw, mod), mod.dense_weight()
    if scheme == "int8" or dtype != torch.float32:
        assert torch.equal(dense, kernel)
    else:
        s, z = (t.repeat_interleave(32, 1) for t in mod.scales_zeros.transpose(0, 1).unbind(-1))  # [N, K]
        terms = (qw.q.float() - 8).abs() * s + z.abs()
        assert bool(((dense - kernel).abs() <= 2.0**-23 * terms).all())


def _spy(mod):
    calls = []
    int_matmul, dense_matmul = mod.int_matmul, mod.dense_matmul
    mod.int_matmul = lambda x: calls.append(("int", x.shape[0])) or int_matmul(x)
    mod.dense_matmul = lambda x: calls.append(("dense", x.numel() // mod.in_features)) or dense_matmul(x)
    return calls


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_row_count_picks_the_kernel(scheme):
    w = _weight()
    qw = Q.quantize_int8(w) if scheme == "int8" else Q.quantize_int4(w)
    mod = Q.quantized_linear(qw, None, torch.float32, dense=4)
    calls = _spy(mod)
    for shape in [(1, 128), (3, 128), (4, 128), (1, 3, 128), (2, 2, 128), (9, 128)]:
        mod(torch.randn(*shape))
    assert calls == [("int", 1), ("int", 3), ("dense", 4), ("int", 3), ("dense", 4), ("dense", 9)]
    assert mod.kernel_name == ("int4g32@4" if scheme == "int4" else "int8@4")
    mod.set_dense(None, None)  # no dense copy: the integer kernel at every row count
    calls.clear()
    mod(torch.randn(64, 128))
    assert calls == [("int", 64)] and mod.kernel_name in ("int4g32", "int8")


@pytest.mark.parametrize(
    "dense, want",
    [
        (lambda m: 0.5 if m >= 8 else 1 if m == 6 else 2, 8),  # the dense kernel wins from 8 rows (a tie is no win)
        (lambda m: 2, None),  # never
        (lambda m: 0.1, 1),  # always
        (lambda m: 0.5 if m in (4, 16, 24, 32) else 2, 16),  # a win below a loss does not count
        (lambda m: 2 if m == 32 else 0.5, None),  # nor a win below the most rows
    ],
)
def test_the_probe_runs_the_dense_copy_from_the_crossover(monkeypatch, dense, want):
    monkeypatch.setattr(
        Q,
        "_best_seconds",
        lambda runners, repeats: {key: 1.0 if key.startswith("int") else dense(int(key[6:])) for key in runners},
    )
    mod = Q.quantized_linear(Q.quantize_int4(_weight()), None, torch.float32, dense=1)
    from_rows, seconds = Q.probe_dense_from(mod)
    assert from_rows == want and seconds["int@1"] == 1.0 and len(seconds) == 2 * len(Q.PROBE_ROWS)


def _int4_model(arch="llama", layers=4, dtype=torch.float32, seed=0):
    """A tiny model whose every linear the int4 kernel takes (K a multiple of 32, N of 16)."""
    return tiny_model(arch, layers=layers, dtype=dtype, seed=seed, hidden=64, intermediate=128)


def _fixed_probe(monkeypatch, from_rows):
    monkeypatch.setattr(Q, "probe_dense_from", lambda mod, rows=Q.PROBE_ROWS: (from_rows, {"int@1": 1.0}))


def test_quantize_model_replaces_the_layers_and_the_head(monkeypatch):
    _fixed_probe(monkeypatch, 4)
    model = _int4_model("qwen2")
    before = sum(p.numel() for n, p in model.named_parameters() if n.endswith("proj.weight") or n == "lm_head.weight")
    report = Q.quantize_model(model, "int4")
    cls = Q.quantized_linear_class()
    names = [n for n, m in model.named_modules() if isinstance(m, cls)]
    assert len(names) == 4 * 7 + 1 and "lm_head" in names and not report.skipped
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert set(report.quantized.values()) == {"int4g32@4"}
    assert report.replaced_bytes == before * 4 and report.dense_bytes == before * 4  # float32 copies
    assert report.bytes == sum(n * k // 2 + 2 * (n * k // 32) * 4 for n, k in _shapes(model))
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # (Qwen2's q/k/v biases are kept)
    d = report.as_dict()
    assert d["linears"] == 29 and d["kernels"] == {"int4g32@4": 29} and d["dense_from_rows"]["int4:64x64"] == 4


def _shapes(model):
    cls = Q.quantized_linear_class()
    return [(m.out_features, m.in_features) for m in model.modules() if isinstance(m, cls)]


def test_quantize_model_skips_what_the_kernels_cannot_take(monkeypatch):
    _fixed_probe(monkeypatch, None)
    model = tiny_model("llama", layers=2, dtype=torch.float32)  # hidden 48: not a multiple of 32
    model.lm_head.weight = model.model.embed_tokens.weight  # tied
    report = Q.quantize_model(model, "int4")
    assert report.skipped["lm_head"] == "tied to the input embeddings"
    assert "not a multiple of 32" in report.skipped["model.layers.0.self_attn.q_proj"]
    assert list(report.quantized) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]  # K = 96
    report = Q.quantize_model(model, "int8")  # int8 takes any K; no dense copy where the probe finds none
    assert len(report.quantized) == 2 * 6 and report.dense_bytes == 0
    assert set(report.quantized.values()) == {"int8"}
    with pytest.raises(ValueError, match="int8 or int4"):
        Q.quantize_model(model, "int2")
    f64 = tiny_model("llama", layers=1, dtype=torch.float64, hidden=64, intermediate=128)
    report = Q.quantize_model(f64, "int4")
    assert not report.quantized and "float64" in report.skipped["lm_head"]


def _dequantized_copy(model, quantized):
    """``model`` with every linear that ``quantized`` quantized replaced by its dense dequantization."""
    cls = Q.quantized_linear_class()
    for name, mod in quantized.named_modules():
        if isinstance(mod, cls):
            lin = model.get_submodule(name)
            with torch.no_grad():
                lin.weight.copy_(mod.dense_weight())
    return model


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_quantized_model_is_its_dequantized_model(monkeypatch, scheme):
    _fixed_probe(monkeypatch, 3)
    model = _int4_model("llama")
    q = _int4_model("llama")
    Q.quantize_model(q, scheme)
    ref = _dequantized_copy(model, q)
    ids = torch.tensor([[5, 17, 3, 88, 41, 9, 2, 60]])
    with torch.no_grad():
        for t in (1, 2, 8):  # 1-2 rows: the integer kernel; 8: the dense copy
            a, b = q(ids[:, :t]).logits, ref(ids[:, :t]).logits
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (a - b).abs().max()
        assert not torch.allclose(q(ids).logits, _int4_model("llama")(ids).logits, atol=1e-3)  # (it is quantized)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("scheme, dense_from", [("int4", 3), ("int8", 3), ("int4", None)])
def test_greedy_sd_equals_greedy_ar_on_quantized_weights(monkeypatch, arch, scheme, dense_from):
    """float32 activations; dense_from 3: a step of `ar` (one row) runs the integer kernels, a
    verified block of `sd` the dense copies: both decode the same quantized weights."""
    _fixed_probe(monkeypatch, dense_from)
    verifier = _int4_model(arch, layers=6)
    drafter = drafter_from(verifier)
    for m in (verifier, drafter):
        report = Q.quantize_model(m, scheme)
        assert len(report.quantized) == len(m.model.layers) * 7 + 1
    v, d = MaskedLM(verifier), MaskedLM(drafter)
    engine = Engine(v, d, mask=LayerMask.from_skipped((1, 3), v.num_layers))
    accepted = rejected = 0
    for prompt in ([5, 17, 3, 88, 41, 9], [1, 2, 3], [60] * 12):
        ar = engine.complete(prompt, parse_params(mode="ar", max_tokens=40))
        sd = engine.complete(prompt, parse_params(mode="sd", max_tokens=40, gamma=4))
        assert sd.token_ids == ar.token_ids
        accepted += sd.stats.num_accepted_tokens
        rejected += sd.stats.num_rejected_tokens
    assert accepted > 0 and rejected > 0


def test_the_engine_option():
    with pytest.raises(InvalidParameterError) as err:
        parse_engine_config(quantization="int3")
    assert err.value.field == "quantization" and "int4" in str(err.value)
    assert parse_engine_config().quantization == "auto"
    R = Q.resolve_quantization
    assert R("none", "cpu", "bfloat16", True).reason == "requested"
    assert (R("int8", "cpu", "float32", False).scheme, R("int4", "cpu", "bfloat16", False).scheme) == ("int8", "int4")
    assert R("int4", "cuda", "bfloat16", False).as_dict()["quantization"] == "none"
    assert R("int4", "cpu", "float64", False).reason == "dtype"
    assert R("auto", "cpu", "bfloat16", False).reason == "auto-not-builtin"
    assert R("auto", "cpu", "float32", True).reason == "auto-dtype"
    assert R("auto", "cuda:0", "bfloat16", True).reason == "auto-device"
    with pytest.raises(InvalidParameterError, match="quantization"):
        R("fp4", "cpu", "bfloat16", True)


@pytest.mark.parametrize("wins", [True, False])
def test_auto_takes_int4_for_a_builtin_model_where_it_is_faster(monkeypatch, wins):
    monkeypatch.setattr(Q, "_best_seconds", lambda runners, repeats: {"int4@1": 0.5 if wins else 0.9, "dense@1": 1.0})
    choice = Q.resolve_quantization("auto", "cpu", "bfloat16", True)
    assert (choice.scheme, choice.reason) == (("int4", "auto-int4") if wins else ("none", "auto-slower"))
    assert choice.as_dict()["quantization_probe_seconds"] == {"int4@1": 0.5 if wins else 0.9, "dense@1": 1.0}


def test_the_llm_records_the_quantization(tmp_path, monkeypatch):
    from viasd.llm import LLM

    _fixed_probe(monkeypatch, 4)
    config = save_tiny_pair(tmp_path).model_copy(update={"quantization": "int8"})
    llm = LLM(config)
    runtime = llm.runtime_info()
    verifier, drafter = runtime["quantization"]
    assert (verifier["quantization"], verifier["quantization_reason"], verifier["linears"]) == ("int8", "requested", 43)
    assert drafter["linears"] == 2 * 7 + 1 and verifier["dense_from_rows"] == {
        "int8:48x48": 4,
        **verifier["dense_from_rows"],
    }
    assert llm.verifier.model.lm_head.kernel_name == "int8@4"
    ids = [5, 17, 3, 88]
    ar = llm.complete(ids, parse_params(mode="ar", max_tokens=12)).token_ids
    assert llm.complete(ids, parse_params(mode="sd", max_tokens=12)).token_ids == ar
    plain = LLM(config.model_copy(update={"quantization": "none"}))
    assert "quantization" not in plain.runtime_info()
    assert type(plain.verifier.model.lm_head).__name__ != "QuantizedLinear"


def test_cli_flag():
    from viasd.cli import _engine_config, build_parser

    args = build_parser().parse_args(["generate", "--quantization", "int4", "def f():"])
    assert _engine_config(args, max_batch=1).quantization == "int4"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--quantization", "int5", "def f():"])


def test_the_mask_is_checked_on_the_weights_as_loaded(tmp_path, monkeypatch):
    """A DIMR artifact's fingerprint is checked against the verifier's weights before they are
    quantized (viasd.llm resolves the mask, then quantizes), so a mask searched on the loaded
    weights keeps working on the quantized verifier."""
    import viasd.llm as L
    from viasd.models.loader import model_fingerprint

    _fixed_probe(monkeypatch, None)
    config = save_tiny_pair(tmp_path).model_copy(update={"quantization": "int8"})
    seen = []
    resolve = L.resolve_mask

    def spy(config, model, *args, **kwargs):
        seen.append((model_fingerprint(model), sum(isinstance(m, Q.quantized_linear_class()) for m in model.modules())))
        return resolve(config, model, *args, **kwargs)

    monkeypatch.setattr(L, "resolve_mask", spy)
    llm = L.LLM(config)
    from viasd.models.loader import load_causal_lm

    loaded, _ = load_causal_lm(config.verifier, dtype="float32")
    assert seen == [(model_fingerprint(loaded), 0)]
    assert model_fingerprint(llm.verifier.model) != seen[0][0]  # (quantized after)


def test_probes_are_kept_per_machine(tmp_path, monkeypatch):
    calls = []

    def probe(mod, rows=Q.PROBE_ROWS):
        calls.append((mod.in_features, mod.out_features))
        return 4, {"int@1": 1.0}

    monkeypatch.setattr(Q, "probe_dense_from", probe)
    cache = tmp_path / "probes"
    report = Q.quantize_model(_int4_model(), "int4", probe_cache=cache)
    assert sorted(calls) == [(64, 32), (64, 64), (64, 96), (64, 128), (128, 64)]  # once a shape
    assert len(list(cache.glob("probe-*.json"))) == 5 and set(report.dense_from.values()) == {4}
    Q._reset_cache()  # another process on this machine: read back, not probed
    report = Q.quantize_model(_int4_model(), "int4", probe_cache=cache)
    assert len(calls) == 5 and set(report.dense_from.values()) == {4}
    for f in cache.glob("probe-*.json"):
        f.write_text("{damaged")
    Q._reset_cache()
    Q.quantize_model(_int4_model(), "int4", probe_cache=cache)
    assert len(calls) == 10  # measured again
    Q._reset_cache()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)  # another thread count: another probe
    Q.quantize_model(_int4_model(), "int4", probe_cache=cache)
    assert len(calls) == 15


# ------------------------------------------------------------------------------------------------
# a8w8: one-row products of int8 weights with 8-bit activations (bf16 / fp16 only)

needs_a8w8 = pytest.mark.skipif(not Q.a8w8_available(), reason="FBGEMM's int8 linear is not in this torch")


@needs_a8w8
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a8w8_agrees_with_the_dequantized_reference(dtype):
    """|y - ref| <= (a / 2) * sum_k |W_q[n, k]| + 2 TOL (|x| @ |W_q|^T + |b|): the activations'
    rounding to 8 bits (a = (max(x, 0) - min(x, 0)) / 255, the step of the row) over the weight's
    row, then the output's rounding to the dtype and the bias's addition; the integer sums are exact."""
    w = _weight()
    qw = Q.quantize_int8(w)
    bias = torch.randn(96).to(dtype)
    mod = Q.quantized_linear(qw, bias, dtype, dense=4)
    assert mod.set_a8w8(True) == 96 * 128 and mod.kernel_name == "int8+a8w8@4"
    ref_w = (qw.q.double() * mod.scales.double()[:, None]).double()  # [N, K]: the scales as the kernels read them
    g = torch.Generator().manual_seed(1)
    for shape in [(1, 128), (1, 1, 128)]:
        for x in (torch.randn(*shape, generator=g), torch.rand(*shape, generator=g) + 2, -torch.rand(*shape) * 5):
            x = x.to(dtype)
            with torch.no_grad():
                y = mod(x)
            assert y.shape == (*shape[:-1], 96) and y.dtype == dtype
            xd = x.double().reshape(1, 128)
            a = float(xd.max().clamp(min=0) - xd.min().clamp(max=0)) / 255
            ref = (xd @ ref_w.t() + bias.double()).reshape(y.shape)
            bound = a / 2 * ref_w.abs().sum(1) + 2 * TOL[dtype] * (xd.abs() @ ref_w.abs().t() + bias.double().abs())
            err = (y.double() - ref).abs().reshape(1, 96)
            assert bool((err <= bound).all()), (err - bound).max()
            assert err.max() > 0


@needs_a8w8
def test_a8w8_runs_one_row_products_only():
    """A product of several rows runs the integer kernel or the dense copy (a8w8 takes one scale
    for its whole input: only on one row is each row's result its own)."""
    mod = Q.quantized_linear(Q.quantize_int8(_weight()), None, torch.bfloat16, dense=4)
    mod.set_a8w8(True)
    calls = _spy(mod)
    a8w8 = mod.a8w8_matmul
    mod.a8w8_matmul = lambda x: calls.append(("a8w8", x.shape[0])) or a8w8(x)
    for shape in [(1, 128), (1, 1, 128), (3, 128), (4, 128), (2, 1, 128)]:
        mod(torch.randn(*shape).bfloat16())
    assert calls == [("a8w8", 1), ("a8w8", 1), ("int", 3), ("dense", 4), ("int", 2)]
    mod(torch.randn(1, 128))  # float32 activations on bf16 scales: the integer kernel, as before
    assert calls[-1] == ("int", 1)
    assert mod.set_a8w8(False) == 0 and mod.kernel_name == "int8@4"


@needs_a8w8
@pytest.mark.parametrize("a8w8_s, want", [(0.5, True), (1.5, False)])
def test_the_probe_gives_one_row_products_to_a8w8_where_it_wins(monkeypatch, a8w8_s, want):
    def best(runners, repeats):
        return {key: a8w8_s if key == "a8w8@1" else 1.0 if key.startswith("int") else 2.0 for key in runners}

    monkeypatch.setattr(Q, "_best_seconds", best)
    model = _int4_model("qwen2", layers=1, dtype=torch.bfloat16)
    report = Q.quantize_model(model, "int8")
    d = report.as_dict()
    assert set(d["a8w8_one_row"].values()) == {want} and len(d["a8w8_one_row"]) == len(d["dense_from_rows"])
    assert set(report.quantized.values()) == {"int8+a8w8" if want else "int8"}  # (the dense copy never wins)
    assert d["a8w8_bytes"] == (report.replaced_bytes // 2 if want else 0)  # an int8 byte a bf16 weight
    assert all("a8w8@1" in s for s in report.probe_seconds.values())
    f32 = Q.quantize_model(_int4_model("qwen2", layers=1), "int8")  # float32: never offered
    assert not f32.a8w8 and set(f32.quantized.values()) == {"int8"}


def test_without_a8w8_the_int8_kernel_runs_and_the_report_says_why(monkeypatch):
    monkeypatch.setattr(Q, "a8w8_available", lambda: False)
    _fixed_probe(monkeypatch, 4)
    report = Q.quantize_model(_int4_model("qwen2", layers=1, dtype=torch.bfloat16), "int8")
    assert set(report.quantized.values()) == {"int8@4"}
    assert report.as_dict()["a8w8_note"] == "FBGEMM's int8 linear unavailable" and not report.a8w8
    report = Q.quantize_model(_int4_model("qwen2", layers=1, dtype=torch.bfloat16), "int8", dense=False)
    assert "no dense copies" in report.as_dict()["a8w8_note"]


# ------------------------------------------------------------------------------------------------
# a8w8r: products of int8 weights with each row's activations in 8 bits, its own scale (oneDNN)

needs_a8w8r = pytest.mark.skipif(Q.a8w8r_missing() is not None, reason=f"a8w8r: {Q.a8w8r_missing()}")


def _rows(m, k=128, seed=1):
    """``m`` rows of activations of unlike magnitudes and signs (from 4 rows: one all positive, one
    all negative, one of zeros)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]  # [M, K]
    if m >= 4:
        x[1] = torch.rand(k, generator=g) + 2
        x[2] = -torch.rand(k, generator=g) * 5
        x[-1] = 0
    return x


@needs_a8w8r
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a8w8r_quantizes_each_row_with_its_own_scale(dtype):
    """u in 1..255, a = max|x| / 127 a row, |x - a (u - 128)| <= a / 2 (to the float32 rounding of
    x / a); a row of zeros gives u = 128."""
    x = _rows(16).to(dtype)
    u, a = Q.a8w8r_quantize(x)
    assert u.dtype == torch.uint8 and a.shape == (16, 1) and int(u.min()) >= 1
    amax = x.double().abs().amax(1, keepdim=True)
    assert torch.allclose(a.double()[:-1], amax[:-1] / 127, rtol=2.0**-23, atol=0)
    err = (x.double() - a.double() * (u.double() - 128)).abs()
    assert bool((err <= a.double() / 2 * (1 + 2.0**-16)).all())
    assert bool((u[-1] == 128).all()) and bool(((u[:-1].int() - 128).abs().amax(1) == 127).all())


@needs_a8w8r
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a8w8r_agrees_with_the_dequantized_reference(dtype):
    """|y - ref| <= (a[m] / 2) (1 + 2^-16) sum_k |W_q[n, k]| + 2 TOL (|x| @ |W_q|^T + |b|): each row's
    rounding to 8 bits (a[m] = max|x[m]| / 127, its step) over the weight's row, then the float32
    scalings, the output's rounding to the dtype and the bias's addition; the integer sums are exact."""
    w = _weight()
    qw = Q.quantize_int8(w)
    bias = torch.randn(96).to(dtype)
    mod = Q.quantized_linear(qw, bias, dtype)
    assert mod.set_a8w8r(1) == 96 * 128 and mod.kernels == {1: "a8w8r"} and mod.kernel_name == "int8+a8w8r@1"
    ref_w = qw.q.double() * mod.scales.double()[:, None]  # [N, K]: the scales as the kernels read them
    for shape in [(1, 128), (3, 128), (16, 128), (2, 5, 128)]:
        x = _rows(shape[0] * (shape[1] if len(shape) == 3 else 1)).reshape(shape).to(dtype)
        with torch.no_grad():
            y = mod(x)
        assert y.shape == (*shape[:-1], 96) and y.dtype == dtype
        xd = x.double().reshape(-1, 128)  # [M, K]
        a = xd.abs().amax(1, keepdim=True) / 127  # [M, 1]
        ref = xd @ ref_w.t() + bias.double()
        bound = a / 2 * (1 + 2.0**-16) * ref_w.abs().sum(1) + 2 * TOL[dtype] * (
            xd.abs() @ ref_w.abs().t() + bias.double().abs()
        )
        err = (y.double().reshape(-1, 96) - ref).abs()
        assert bool((err <= bound).all()), (err - bound).max()
        assert err.max() > 0


@needs_a8w8r
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_an_a8w8r_row_is_its_own(dtype):
    """A row's result does not depend on the other rows of the product: each row of a 16-row
    product equals that row computed alone, bit for bit (and within any other batch)."""
    qw = Q.quantize_int8(_weight(n=160, k=384))
    mod = Q.quantized_linear(qw, None, dtype)
    mod.set_a8w8r(1)
    x = _rows(16, k=384).to(dtype)
    with torch.no_grad():
        y = mod(x)  # [16, N]
        for i in range(16):
            assert torch.equal(mod(x[i : i + 1])[0], y[i]), i
        for rows in ([3, 0, 9], [15, 14], list(range(1, 12))):
            assert torch.equal(mod(x[rows]), y[rows]), rows


def _spy4(mod):
    calls = _spy(mod)
    for kernel in ("a8w8", "a8w8r"):
        run = getattr(mod, f"{kernel}_matmul")
        setattr(mod, f"{kernel}_matmul", lambda x, run=run, kernel=kernel: calls.append((kernel, x.shape[0])) or run(x))
    return calls


@needs_a8w8r
@needs_a8w8
def test_the_row_count_picks_among_the_four_kernels():
    mod = Q.quantized_linear(Q.quantize_int8(_weight()), None, torch.bfloat16, dense=8)
    mod.set_a8w8(True)
    assert mod.set_a8w8r(3) == 96 * 128
    assert mod.kernels == {1: "a8w8", 2: "int", 3: "a8w8r", 8: "dense"} and mod.kernel_name == "int8+a8w8+a8w8r@3@8"
    calls = _spy4(mod)
    for shape in [(1, 128), (2, 128), (3, 128), (1, 7, 128), (8, 128), (40, 128)]:
        mod(torch.randn(*shape).bfloat16())
    assert calls == [("a8w8", 1), ("int", 2), ("a8w8r", 3), ("a8w8r", 7), ("dense", 8), ("dense", 40)]
    mod(torch.randn(3, 128))  # float32 activations on bf16 scales: the integer kernel, as before
    assert calls[-1] == ("int", 3)
    mod.set_dense(None, None)
    assert mod.kernels == {1: "a8w8", 2: "int", 3: "a8w8r"}
    assert mod.set_a8w8r(None) == 0 and mod.kernels == {1: "a8w8", 2: "int"} and mod.kernel_name == "int8+a8w8"
    f32 = Q.quantized_linear(Q.quantize_int8(_weight()), None, torch.float32)  # float32: never
    assert f32.set_a8w8r(2) == 0 and f32.a8w8r is None and f32.kernels == {1: "int"}
    int4 = Q.quantized_linear(Q.quantize_int4(_weight()), None, torch.bfloat16)  # int8 weights only
    assert int4.set_a8w8r(2) == 0 and int4.kernels == {1: "int"}


def _secs(**by_kernel):
    """Probe seconds ``kernel@M`` from functions of M (a8w8: one row)."""
    out = {f"{k}@{m}": f(m) for k, f in by_kernel.items() if k != "a8w8" for m in Q.PROBE_ROWS}
    if "a8w8" in by_kernel:
        out["a8w8@1"] = by_kernel["a8w8"](1)
    return out


@pytest.mark.parametrize(
    "seconds, offered, want",
    [
        # the integer kernel below 4 rows, a8w8r to 16, the dense copy from 24
        (
            _secs(int=lambda m: m, a8w8r=lambda m: 3 + m / 8, dense=lambda m: 5.9, a8w8=lambda m: 9.0),
            None,
            {1: "int", 4: "a8w8r", 24: "dense"},
        ),
        # a8w8 one row, a8w8r every count above: no dense copy
        (
            _secs(int=lambda m: m, a8w8r=lambda m: 0.9 * m, dense=lambda m: 99.0, a8w8=lambda m: 0.5),
            None,
            {1: "a8w8", 2: "a8w8r"},
        ),
        # a tie goes to the faster-growing kernel; a8w8 must beat the one-row choice
        (_secs(int=lambda m: 1.0, a8w8r=lambda m: 1.0, dense=lambda m: 1.0, a8w8=lambda m: 1.0), None, {1: "int"}),
        # a win below a loss does not count: a8w8r at 3 under the integer kernel at 4
        (
            _secs(int=lambda m: m, a8w8r=lambda m: 2.0 if m == 3 else 6 + m, dense=lambda m: 20.0),
            None,
            {1: "int", 24: "dense"},
        ),
        # the dense copy winning below a8w8r's rows does not run: a kernel that grows faster won above
        (
            _secs(int=lambda m: m, a8w8r=lambda m: 2 + m / 16, dense=lambda m: 2.2 if m == 8 else 9.0),
            None,
            {1: "int", 3: "a8w8r"},
        ),
        # a8w8r not offered (unavailable, float32): the dense crossover as before
        (_secs(int=lambda m: m, a8w8r=lambda m: 0.1, dense=lambda m: 6.5), {"int", "dense"}, {1: "int", 8: "dense"}),
        # a8w8r one row too, unless a8w8 beats it there
        (_secs(int=lambda m: m, a8w8r=lambda m: 0.5 * m, dense=lambda m: 99.0), None, {1: "a8w8r"}),
        (
            _secs(int=lambda m: m, a8w8r=lambda m: 0.5 * m, dense=lambda m: 99.0, a8w8=lambda m: 0.4),
            None,
            {1: "a8w8", 2: "a8w8r"},
        ),
    ],
)
def test_the_kernel_table_of_a_probe(seconds, offered, want):
    assert Q.kernel_table(seconds, Q.PROBE_ROWS, offered) == want


def test_the_kernel_table_between_probed_counts():
    """A kernel runs from its probed count up to the next one's; a8w8 one row only."""
    seconds = {"int@1": 1.0, "a8w8@1": 0.5, "int@4": 4.0, "a8w8r@4": 2.0, "a8w8r@1": 1.5}
    assert Q.kernel_table(seconds, (1, 4)) == {1: "a8w8", 2: "int", 4: "a8w8r"}
    mod = Q.quantized_linear(Q.quantize_int8(_weight()), None, torch.bfloat16)
    if Q.a8w8r_missing() is None and Q.a8w8_available():
        mod.set_a8w8(True)
        mod.set_a8w8r(4)
        assert mod.kernels == Q.kernel_table(seconds, (1, 4))


def _model_probe(monkeypatch, seconds_of):
    """Probes whose timer reports ``seconds_of(kernel, M)``."""

    def best(runners, repeats):
        return {key: seconds_of(key.split("@")[0], int(key.split("@")[1])) for key in runners}

    monkeypatch.setattr(Q, "_best_seconds", best)


@needs_a8w8r
@needs_a8w8
def test_the_probe_gives_rows_to_a8w8r_and_drops_the_dense_copy_it_makes_useless(monkeypatch):
    times = {"int": lambda m: m, "a8w8r": lambda m: 1.5 + m / 16, "dense": lambda m: 4.0, "a8w8": lambda m: 0.5}
    _model_probe(monkeypatch, lambda kernel, m: times[kernel](m))
    model = _int4_model("qwen2", layers=1, dtype=torch.bfloat16)
    report = Q.quantize_model(model, "int8")
    d = report.as_dict()
    assert set(map(str, d["kernels_by_rows"].values())) == {str({"1": "a8w8", "2": "a8w8r"})}
    assert set(report.quantized.values()) == {"int8+a8w8+a8w8r@2"} and not report.dense_bytes
    assert d["a8w8r_bytes"] == d["a8w8_bytes"] == report.replaced_bytes // 2 and "a8w8r_note" not in d
    assert all(f"a8w8r@{m}" in s for s in report.probe_seconds.values() for m in Q.PROBE_ROWS)
    assert d["dense_from_rows"] == dict.fromkeys(d["dense_from_rows"]) and set(d["a8w8_one_row"].values()) == {True}
    for mod in model.modules():
        if isinstance(mod, Q.quantized_linear_class()):
            assert mod.dense is None and mod.kernels == {1: "a8w8", 2: "a8w8r"}
    Q._reset_cache()  # the dense copy from 24 rows: kept
    times["dense"] = lambda m: 2.0
    report = Q.quantize_model(_int4_model("qwen2", layers=1, dtype=torch.bfloat16), "int8")
    assert {str(t) for t in report.kernels_by_rows.values()} == {str({1: "a8w8", 2: "a8w8r", 12: "dense"})}
    assert report.dense_bytes == report.replaced_bytes and set(report.quantized.values()) == {"int8+a8w8+a8w8r@2@12"}
    Q._reset_cache()  # float32 (the exactness dtype) and int4 weights: never offered
    for model, scheme in (
        (_int4_model("qwen2", layers=1), "int8"),
        (_int4_model("qwen2", layers=1, dtype=torch.bfloat16), "int4"),
    ):
        report = Q.quantize_model(model, scheme)
        assert not report.a8w8r_bytes and all("a8w8r" not in t.values() for t in report.kernels_by_rows.values())
        assert not any(k.startswith("a8w8r") for s in report.probe_seconds.values() for k in s)


def test_without_a8w8r_the_other_kernels_run_and_the_report_says_why(monkeypatch):
    monkeypatch.setattr(Q, "a8w8r_missing", lambda: "oneDNN's int8 linear (...) not in this torch")
    _model_probe(monkeypatch, lambda kernel, m: {"int": m, "dense": 4.0, "a8w8": 9.0}[kernel])
    report = Q.quantize_model(_int4_model("qwen2", layers=1, dtype=torch.bfloat16), "int8")
    d = report.as_dict()
    assert d["a8w8r_note"] == "oneDNN's int8 linear (...) not in this torch" and not d["a8w8r_bytes"]
    assert {str(t) for t in d["kernels_by_rows"].values()} == {str({"1": "int", "6": "dense"})}
    assert set(report.quantized.values()) == {"int8@6"}
    report = Q.quantize_model(_int4_model("qwen2", layers=1, dtype=torch.bfloat16), "int8", dense=False)
    assert "no dense copies" in report.as_dict()["a8w8r_note"]


def test_a8w8r_runs_where_the_cpu_has_vnni():
    """Where torch has oneDNN's int8 linear and the CPU VNNI, the check finds a8w8r exact."""
    vnni = getattr(torch.cpu, "_is_vnni_supported", lambda: False)()
    if not (vnni and torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")):
        pytest.skip("no VNNI or no oneDNN int8 linear here")
    assert Q.a8w8r_missing.__wrapped__() is None


def test_a8w8r_missing_names_what_is_missing(monkeypatch):
    missing = Q.a8w8r_missing.__wrapped__
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert missing() == "oneDNN (mkldnn) not in this torch"
    monkeypatch.undo()
    if not torch.backends.mkldnn.is_available():
        return
    monkeypatch.setattr(torch.ops, "onednn", object())
    assert "not in this torch" in missing() and "qlinear_pointwise" in missing()
    monkeypatch.undo()
    if missing() is not None:  # (the rest fakes the kernel's answers where it runs)
        return
    monkeypatch.setattr(Q, "a8w8r_matmul", lambda *a: torch.full((2, 16), 32767.0))  # (a saturating sum)
    assert "saturates" in missing()
    monkeypatch.setattr(Q, "a8w8r_pack", lambda q: (_ for _ in ()).throw(RuntimeError("no kernel")))
    assert "fails: RuntimeError: no kernel" in missing()


@needs_a8w8r
@pytest.mark.parametrize(
    "room, want, dropped",
    [
        (3, {1: "int", 4: "a8w8r", 24: "dense"}, []),  # every copy fits
        (2, {1: "int", 4: "a8w8r"}, ["dense"]),  # the dense copy goes first: a8w8r runs its rows
        (0.5, {1: "int"}, []),  # no room for the probe's dense copy: no probe, the integer kernel everywhere
    ],
)
def test_copies_that_would_leave_too_little_memory_are_not_made(monkeypatch, room, want, dropped):
    """``room``: the bytes a copy may take, in int8 bytes of the weight (dense 2, a8w8r 1)."""
    import viasd.precision as P

    times = {"int": lambda m: m, "a8w8r": lambda m: 3 + m / 8, "dense": lambda m: 5.9, "a8w8": lambda m: 9.0}
    _model_probe(monkeypatch, lambda kernel, m: times[kernel](m))
    monkeypatch.setattr(P, "cpu_memory", lambda: (10**9, 10**10))
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(128, 96, bias=False, dtype=torch.bfloat16)])
    report = Q.quantize_model(model, "int8", keep_free_bytes=10**9 - int(room * 96 * 128))
    assert report.kernels_by_rows == {"int8:128x96": want} and model.layers[0].kernels == want
    assert [k.removeprefix("layers.0.") for k in report.skipped] == dropped
    assert report.dense_bytes + report.a8w8r_bytes == (3 if room == 3 else 1 if room == 2 else 0) * 96 * 128
