"""dtype: auto (viasd.precision) and the prepacked CPU linears: behaviour, not timing (the flag
reader and the probe timer are monkeypatched)."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_pair, tiny_model

from viasd import precision as P
from viasd.config import EngineConfig, parse_engine_config
from viasd.errors import InvalidParameterError, ModelLoadError


@pytest.fixture
def fresh(monkeypatch):
    """A clean per-process cache, restored afterwards."""
    P._reset_cache()
    yield monkeypatch
    monkeypatch.undo()  # (before the reset: it clears the real caches)
    P._reset_cache()


def _cpu(monkeypatch, *, flags, onednn=True, capability="AVX512", bf16_s=0.001, f32_s=0.002, rows=None, mixed=None):
    """A CPU with these flags whose probe products take bf16_s / f32_s seconds, or rows[(dtype, M)];
    `mixed`: its mixed-kernel probe (mixed_probe_seconds; default none: a torch without oneDNN)."""
    calls = []
    monkeypatch.setattr(P, "cpu_bf16_flags", lambda: set(flags))
    monkeypatch.setattr(P, "_onednn_bf16_enabled", lambda: onednn)
    monkeypatch.setattr(P, "cpu_capability", lambda: capability)
    monkeypatch.setattr(P, "mixed_probe_seconds_cached", lambda: dict(mixed or {}))

    def probes(specs, *a, **k):
        calls.extend(name for name, _ in specs)
        return {
            (name, shape): rows[name, shape[0]] if rows else {"bfloat16": bf16_s, "float32": f32_s}[name]
            for name, shape in specs
        }

    monkeypatch.setattr(P, "probe_matmuls", probes)
    return calls


def test_auto_picks_bf16_with_native_bf16_and_a_probe_not_slower(fresh):
    calls = _cpu(fresh, flags={"avx512_bf16"}, bf16_s=0.001, f32_s=0.002)
    choice = P.resolve_dtype("auto", "cpu")
    assert (choice.dtype, choice.reason, choice.native_bf16) == ("bfloat16", "native-bf16", True)
    assert choice.cpu_capability == "AVX512" and choice.probe_seconds == {"bfloat16": 0.001, "float32": 0.002}
    assert choice.torch_dtype is torch.bfloat16
    assert P.resolve_dtype("auto", "cpu") == choice and sorted(calls) == ["bfloat16", "float32"]  # probed once
    d = choice.as_dict()
    assert d["dtype"] == "bfloat16" and d["dtype_requested"] == "auto" and d["cpu_capability"] == "AVX512"


def test_auto_amx_counts_as_native(fresh):
    _cpu(fresh, flags={"amx_bf16"})
    assert P.resolve_dtype("auto").dtype == "bfloat16"


def test_auto_stays_float32_when_the_probe_is_slower(fresh):
    _cpu(fresh, flags={"avx512_bf16"}, bf16_s=0.003, f32_s=0.002)
    choice = P.resolve_dtype("auto", "cpu")
    assert (choice.dtype, choice.reason) == ("float32", "native-bf16-probe-slower")


# the AVX2 CPU of docs/BENCHMARKS.md (one-token and 6-token forwards of the verifier, seconds):
# bf16 halves a one-row step, and its `ar` beats float32's best plan, `sd` with cheap blocks
AVX2 = {("bfloat16", 1): 0.267, ("bfloat16", 6): 0.987, ("float32", 1): 0.502, ("float32", 6): 0.654}
# a CPU where bf16 one-row steps gain little: float32's speculation wins
NARROW = {("bfloat16", 1): 0.45, ("bfloat16", 6): 1.5, ("float32", 1): 0.5, ("float32", 6): 0.6}


@pytest.mark.parametrize(
    "kw", [dict(flags=set()), dict(flags={"avx512_bf16"}, onednn=False), dict(flags={"avx512_bf16"}, capability="AVX2")]
)
@pytest.mark.parametrize(
    "rows, want", [(AVX2, ("bfloat16", "no-native-bf16-decode")), (NARROW, ("float32", "no-native-bf16"))]
)
def test_without_native_bf16_auto_picks_the_dtype_that_decodes_faster(fresh, kw, rows, want):
    calls = _cpu(fresh, **kw, rows=rows)
    choice = P.resolve_dtype("auto", "cpu")
    assert (choice.dtype, choice.reason, choice.native_bf16) == (*want, False)
    assert choice.probe_seconds == {f"{d}@{m}": s for (d, m), s in rows.items()} and len(calls) == 4
    # what decides: float32's reference `sd` cycle against bf16's `ar`
    assert P.decode_speed(0.502, 0.654) == pytest.approx(P.REFERENCE_TOKENS / (1.5 * 0.502 + 0.654))
    assert P.decode_speed(0.267, 0.987) == pytest.approx(1 / 0.267)


# a second real AVX2 CPU (docs/benchmarks/cpu/load-c1-avx2/auto, the probe of its `--dtype auto`
# run): bf16's one-row step wins the decode alone, but its prompts prefill at 8.6 ms a 6-row product
# where float32's take 3.2, and a request prefills about as many tokens as it generates
AVX2_PROMPTS = {
    ("bfloat16", 1): 0.001634,
    ("bfloat16", 6): 0.008567,
    ("float32", 1): 0.002316,
    ("float32", 6): 0.003179,
}


def test_without_native_bf16_auto_prices_the_prompt_too(fresh):
    speed = {d: (AVX2_PROMPTS[d, 1], AVX2_PROMPTS[d, 6]) for d in ("bfloat16", "float32")}
    assert P.decode_speed(*speed["bfloat16"]) > P.decode_speed(*speed["float32"])  # the old choice: bf16
    assert P.request_speed(*speed["bfloat16"]) < P.request_speed(*speed["float32"])
    # 1 / (1 / decode + a prompt token a generated one, each at a sixth of the block)
    assert P.request_speed(0.002316, 0.003179) == pytest.approx(
        1 / (1 / P.decode_speed(0.002316, 0.003179) + 0.003179 / 6)
    )
    assert P.request_speed(0.002316, 0.003179, prompt=0) == pytest.approx(P.decode_speed(0.002316, 0.003179))
    _cpu(fresh, flags=set(), capability="AVX2", rows=AVX2_PROMPTS)
    assert (P.resolve_dtype("auto", "cpu").dtype, P.resolve_dtype("auto", "cpu").reason) == (
        "float32",
        "no-native-bf16",
    )


# the emulated AVX2 CPU of docs/BENCHMARKS.md ("The dtype at the batch capacity"): the probe
# products at one and at eight requests a step, best seconds by (dtype, M)
EMULATED_AVX2 = {
    ("bfloat16", 1): 0.00095,
    ("bfloat16", 6): 0.00562,
    ("bfloat16", 8): 0.0071,
    ("bfloat16", 48): 0.03882,
    ("float32", 1): 0.00272,
    ("float32", 6): 0.00369,
    ("float32", 8): 0.00411,
    ("float32", 48): 0.0105,
}


def test_without_native_bf16_auto_decides_at_the_engines_batch_capacity(fresh):
    """bf16's one-row step wins one request at a time; at eight rows a step its emulated products
    cost more than float32's, so an engine of max_batch=8 loads in float32."""
    calls = _cpu(fresh, flags=set(), capability="AVX2", rows=EMULATED_AVX2)
    one = P.engine_dtype(EngineConfig(max_batch=1))
    eight = P.engine_dtype(EngineConfig(max_batch=8))
    assert (one.dtype, one.reason, one.rows) == ("bfloat16", "no-native-bf16-decode", 1)
    assert (eight.dtype, eight.reason, eight.rows) == ("float32", "no-native-bf16", 8)
    assert set(eight.probe_seconds) == {"bfloat16@8", "bfloat16@48", "float32@8", "float32@48"}
    assert eight.as_dict()["dtype_rows"] == 8 and P.resolve_dtype("auto", "cpu", rows=8) == eight
    assert len(calls) == 8  # probed once per row count
    # at eight rows: float32's `ar` step (8 tokens in 4.11 ms) against bf16's (8 in 7.1 ms)
    assert P.decode_speed(0.00411, 0.0105, 8) == pytest.approx(8 / 0.00411)
    assert P.decode_speed(0.0071, 0.03882, 8) == pytest.approx(8 / 0.0071)
    assert P.decode_shapes(8) == ((8, 1536, 8960), (48, 1536, 8960)) and P.decode_shapes() == P.DECODE_SHAPES


# this real AVX2 CPU's mixed-kernel probe (AMD EPYC, 2 cores; ms, [M, 1536] x [1536, 8960]):
# plain bf16 grows with every row (ATen widens each tile), the packed float32 kernel on widened
# inputs reads twice the bytes at one row and is compute-cheap after
AVX2_MIXED = {
    f"{kind}@{m}": ms / 1e3
    for kind, row in {
        "bf16": (1.71, 3.23, 4.59, 6.03, 9.01, 11.88),
        "mixed": (2.68, 2.84, 3.09, 3.35, 3.70, 4.28),
    }.items()
    for m, ms in zip(P.MIXED_PROBE_ROWS, row)
}


def test_mixed_kernels_start_where_they_stay_faster():
    assert P.from_rows_of(AVX2_MIXED) == 2
    slower_at_3 = {**AVX2_MIXED, "mixed@3": 0.005}  # not faster at 3: from 4 on, where it stays faster
    assert P.from_rows_of(slower_at_3) == 4
    assert P.from_rows_of({**AVX2_MIXED, "mixed@8": 0.02}) is None  # loses at the most rows: never
    assert P.from_rows_of({**AVX2_MIXED, "mixed@1": 0.001}) == 1  # faster even at one row


@pytest.mark.parametrize("max_batch", [1, 8])
def test_without_native_bf16_auto_takes_bf16_with_mixed_kernels_at_any_batch(fresh, max_batch):
    """With mixed kernels bf16 runs float32's kernel on products of from_rows rows or more and
    its own, half the bytes, on fewer: it is the faster dtype at every batch size, and the
    decode probe (dtype against dtype) does not run."""
    probes = {**EMULATED_AVX2, **AVX2_PROMPTS}
    calls = _cpu(fresh, flags=set(), onednn=False, capability="AVX2", rows=probes, mixed=AVX2_MIXED)
    choice = P.engine_dtype(EngineConfig(max_batch=max_batch))
    assert (choice.dtype, choice.reason, choice.rows) == ("bfloat16", "no-native-bf16-mixed", max_batch)
    assert choice.probe_seconds == AVX2_MIXED and calls == []
    # without packed linears the engine would run plain bf16: the decode probe decides (float32 here)
    plain = P.engine_dtype(EngineConfig(max_batch=max_batch, packed_linears=False))
    assert (plain.dtype, plain.reason) == ("float32", "no-native-bf16") and len(calls) == 4


def test_without_native_bf16_auto_stays_float32_where_its_kernel_wins_one_row_too(fresh):
    _cpu(fresh, flags=set(), onednn=False, capability="AVX2", mixed={**AVX2_MIXED, "mixed@1": 0.0015})
    choice = P.resolve_dtype("auto", "cpu")
    assert (choice.dtype, choice.reason) == ("float32", "no-native-bf16")


def test_native_bf16_and_explicit_dtypes_do_not_depend_on_the_rows(fresh):
    _cpu(fresh, flags={"avx512_bf16"}, bf16_s=0.001, f32_s=0.002)
    for rows in (1, 8):
        assert P.engine_dtype(EngineConfig(max_batch=rows)).dtype == "bfloat16"
        assert P.engine_dtype(EngineConfig(max_batch=rows, dtype="float32")).dtype == "float32"


def test_probe_runs_the_engine_s_kernel_or_plain_linear(fresh):
    for packed in (False, True):
        assert 0 < P.probe_matmul("float32", (1, 64, 128), repeats=2, packed=packed) < 1


def test_the_probes_run_interleaved_so_a_pause_of_the_machine_slows_them_all(monkeypatch):
    """One run of every probe per round: a pause that spans a few runs cannot make one dtype's
    probe slow in all its repeats while the other's stays fast (it flipped `auto` once)."""
    order = []
    monkeypatch.setattr(P, "_probe_runner", lambda name, shape, packed: lambda: order.append((name, shape[0])))
    specs = [(d, (m, 8, 8)) for d in ("bfloat16", "float32") for m in (1, 6)]
    seconds = P.probe_matmuls(specs, repeats=3, packed=True)
    keys = [(d, shape[0]) for d, shape in specs]
    assert order == keys * 4  # a warm-up round, then 3 timed rounds in the same order
    assert set(seconds) == set(specs) and all(t >= 0 for t in seconds.values())
    assert set(P.decode_probe_seconds(repeats=1)) == {"bfloat16@1", "bfloat16@6", "float32@1", "float32@6"}


@pytest.mark.parametrize(
    "name,want",
    [
        ("bfloat16", "bfloat16"),
        ("bf16", "bfloat16"),
        ("float16", "float16"),
        ("float32", "float32"),
        ("float64", "float64"),
        (torch.float32, "float32"),
    ],
)
def test_explicit_dtypes_pass_through(fresh, name, want):
    calls = _cpu(fresh, flags=set())
    choice = P.resolve_dtype(name, "cpu")
    assert (choice.dtype, choice.reason, choice.requested) == (want, "requested", want) and calls == []


def test_auto_on_cuda_is_bf16_without_probing(fresh, monkeypatch):
    calls = _cpu(fresh, flags=set())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    assert P.resolve_dtype("auto", "cuda").dtype == "bfloat16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (7, 0))
    assert P.resolve_dtype("auto", "cuda:1").dtype == "float16"
    assert calls == []


def test_unknown_dtype_raises():
    with pytest.raises(ModelLoadError, match="int8"):
        P.resolve_dtype("int8")


def test_probe_runs_and_times_a_product():
    assert 0.0 < P.probe_matmul("float32", shape=(2, 16, 8), repeats=2) < 1.0


def test_engine_config_dtype_defaults_to_auto_and_validates():
    assert EngineConfig().dtype == "auto"
    for name in ("auto", "bfloat16", "float16", "float32", "float64"):
        assert EngineConfig(dtype=name).dtype == name
    with pytest.raises(InvalidParameterError) as exc:
        parse_engine_config(dtype="bogus")
    assert exc.value.field == "dtype" and "auto" in exc.value.message


def test_engine_config_bogus_dtype_is_an_invalid_parameter():
    from pydantic import ValidationError

    with pytest.raises((InvalidParameterError, ValidationError), match="dtype"):
        EngineConfig(dtype="bogus")


def test_auto_loads_a_tiny_model_in_the_concrete_dtype(fresh, tmp_path):
    from viasd.models.loader import load_causal_lm

    save_tiny_pair(tmp_path)
    for native, want in ((False, torch.float32), (True, torch.bfloat16)):
        P._cpu_auto.cache_clear()
        P._native_cpu_auto.cache_clear()
        _cpu(fresh, flags={"avx512_bf16"} if native else set(), rows=None if native else NARROW)
        model, tok = load_causal_lm(str(tmp_path / "verifier"), dtype="auto")
        assert tok is None and next(model.parameters()).dtype is want


def test_auto_never_names_a_cache_auto(fresh, tmp_path, monkeypatch):
    from viasd.models import embedded as E

    monkeypatch.setenv("VIASD_CACHE_DIR", str(tmp_path))
    _cpu(fresh, flags=set(), rows=NARROW)
    assert E.cache_dir_for(E.TEST_MODEL, "auto").name == f"{E.TEST_MODEL}-float32"
    assert E.concrete_dtype("auto") == "float32" and E.concrete_dtype("bf16") == "bfloat16"
    seen = []
    monkeypatch.setattr(E, "_is_valid", lambda target, model, dtype: seen.append((target.name, dtype)) or True)
    assert E.ensure_local(E.TEST_MODEL, "auto").name == f"{E.TEST_MODEL}-float32"
    assert seen == [(f"{E.TEST_MODEL}-float32", "float32")]


# ------------------------------------------------------------------------------------------------
# optimize_linears


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_optimize_linears_keeps_outputs_and_shared_weights(arch, dtype, tol):
    from viasd.runtime import MaskedLM

    if dtype is torch.bfloat16 and not P._onednn_bf16_enabled():
        pytest.skip("oneDNN bf16 not available on this CPU")
    model = tiny_model(arch, dtype=dtype).eval()
    ids = torch.randint(0, model.config.vocab_size, (7,), generator=torch.Generator().manual_seed(1))
    plain = MaskedLM(model).forward(ids, 0)
    params = {n: p.data_ptr() for n, p in model.named_parameters()}
    linears = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    report = P.optimize_linears(model, dtype, "cpu")
    assert report.method == "mkldnn_packed" and sorted(report.swapped) == sorted(linears)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == params  # same parameters, not copies
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert report.extra_bytes == sum(model.get_submodule(n).weight.numel() * dtype.itemsize for n in linears)
    lm = MaskedLM(model)
    fast = lm.forward(ids, 0)
    assert torch.allclose(fast, plain, atol=tol * plain.abs().max().item(), rtol=0)
    cache = lm.new_cache()  # cached decode steps go through the same modules
    lm.forward(ids[:5], 0, cache)
    step = lm.forward(ids[5:], 5, cache)
    assert torch.allclose(step, plain[5:], atol=tol * plain.abs().max().item(), rtol=0)
    assert report.as_dict()["linears_swapped"] == len(linears)


def test_optimize_linears_is_a_no_op_off_cpu_and_for_float64():
    model = tiny_model("llama", dtype=torch.float64)
    assert P.optimize_linears(model, torch.float64).swapped == []
    assert P.optimize_linears(model, None, "cuda").method == "none"
    assert any(type(m) is torch.nn.Linear for m in model.modules())


def test_packed_linear_falls_back_for_other_inputs():
    lin = torch.nn.Linear(8, 4, dtype=torch.float32).requires_grad_(False)
    packed = P.packed_linear_class()(lin)
    x = torch.randn(3, 8)
    assert torch.allclose(packed(x), lin(x), atol=1e-6)


def test_optimize_linears_leaves_memory_free_for_the_kv_cache():
    """Packing stops where a copy would leave less than `keep_free_bytes` free: the linears stay
    plain, each with the reason; with room they are packed."""
    model = tiny_model("llama", dtype=torch.float32).eval()
    free, total = P.cpu_memory()
    assert 0 < free <= total
    report = P.optimize_linears(model, torch.float32, "cpu", keep_free_bytes=free + 1)
    assert report.swapped == [] and report.extra_bytes == 0 and report.skipped
    assert all(r.startswith("memory:") for r in report.skipped.values())
    assert any(type(m) is torch.nn.Linear for m in model.modules())
    assert P.optimize_linears(model, torch.float32, "cpu", keep_free_bytes=0).swapped  # room: packed


def _ops(fn) -> set[str]:
    """The aten / mkldnn operators `fn()` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: set[str] = set()

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Spy():
        fn()
    return seen


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
@pytest.mark.parametrize("bias", [False, True])
def test_a_mixed_linear_runs_float32_from_its_rows_and_plain_bf16_below(bias):
    """Fewer than from_rows rows: plain bf16 F.linear, the very same output; from_rows rows or
    more: the packed float32 kernel on the widened input, rounded once to bf16, which is the exact
    products of the bf16 values summed in float32 (within one bf16 rounding of the float64 sum)."""
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=bias, dtype=torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=g))
    mixed = P.packed_linear_class()(lin, torch.float32, 3)
    assert mixed.weight is lin.weight and mixed.packed_weight.dtype == torch.float32
    for rows in (1, 2, 3, 7):
        x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)  # [M, K]
        with torch.inference_mode():
            out = mixed(x)  # [M, N]
            ops = _ops(lambda: mixed(x))
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 48)
        exact = x.double() @ lin.weight.double().T + (lin.bias.double() if bias else 0)  # [M, N]
        if rows < 3:
            assert torch.equal(out, torch.nn.functional.linear(x, lin.weight, lin.bias))
            assert "mkldnn._linear_pointwise" not in ops
        else:
            assert "mkldnn._linear_pointwise" in ops and "aten.linear" not in ops
            assert torch.allclose(out.double(), exact, rtol=2**-8, atol=1e-6)
    x3 = torch.randn(2, 5, 64, generator=g).to(torch.bfloat16)  # [B, T, K]: rows = B * T
    with torch.inference_mode():
        assert "mkldnn._linear_pointwise" in _ops(lambda: mixed(x3)) and mixed(x3).shape == (2, 5, 48)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")
def test_optimize_linears_mixes_kernels_for_bf16_without_onednn_bf16(monkeypatch):
    """A bf16 model where oneDNN has no bf16 kernels gets mixed linears: the parameters stay the
    bf16 ones, each packed copy is float32 (twice their bytes), and the model's outputs stay the
    bf16 model's within bf16 rounding, for a prompt (rows >= from_rows) and cached one-token steps."""
    from viasd.runtime import MaskedLM

    monkeypatch.setattr(P, "_onednn_bf16_enabled", lambda: False)
    model = tiny_model("qwen2", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, model.config.vocab_size, (7,), generator=torch.Generator().manual_seed(1))
    plain = MaskedLM(model).forward(ids, 0)
    params = {n: p.data_ptr() for n, p in model.named_parameters()}
    linears = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    report = P.optimize_linears(model, torch.bfloat16, "cpu", mixed_from=2)
    assert (report.method, report.from_rows, sorted(report.swapped)) == ("mixed", 2, sorted(linears))
    assert report.as_dict()["linear_mixed_from_rows"] == 2
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == params
    assert report.extra_bytes == sum(model.get_submodule(n).weight.numel() * 4 for n in linears)
    lm = MaskedLM(model)
    fast = lm.forward(ids, 0)
    assert fast.dtype == plain.dtype and torch.allclose(fast, plain, atol=3e-2 * plain.abs().max().item(), rtol=0)
    cache = lm.new_cache()
    lm.forward(ids[:6], 0, cache)
    step = lm.forward(ids[6:], 6, cache)  # one row: plain bf16 linears
    assert torch.allclose(step, plain[6:], atol=3e-2 * plain.abs().max().item(), rtol=0)
    # no row count where the probe finds them faster: plain linears, and why
    model2 = tiny_model("qwen2", dtype=torch.bfloat16)
    monkeypatch.setattr(P, "mixed_from_rows", lambda: None)
    none = P.optimize_linears(model2, torch.bfloat16, "cpu")
    assert none.method == "none" and none.swapped == [] and "*" in none.skipped
