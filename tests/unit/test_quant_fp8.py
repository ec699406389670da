"""FP8 weights (viasd.quant: float8_e4m3fn per output channel, torch._scaled_mm with per-token
activation scales): the quantizer's error bound against float64, the linear against a float64
emulation of its maths and against the float product, the refusal off CUDA; on a CUDA device, the
linear against the float reference and greedy `sd` == greedy `ar` under fp8.

Bounds (e4m3: 3 mantissa bits, unit roundoff 2^-4; subnormals below 2^-6, spaced 2^-9):

* weights: ``|W - W_q| <= 2^-4 |W| + 2^-10 s``, ``s = max|W[n]| / 448`` a row;
* the linear against its own maths in float64 (``(x_q a) @ (q s)^T``): the bf16 output's rounding,
  ``2^-8 |y|``, and float32 sums: ``<= 2^-8 |ref| + 1e-5 (|x_q a| @ |q s|^T)``;
* the linear against ``x @ W^T`` (both operands rounded to fp8, the output to bf16):
  ``<= (2^-3 + 2^-7) (|x| @ |W|^T) + 2^-8 |x W^T| + 2^-9 (a |W|_1 + s |x|_1)``, elementwise.
"""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_pair, tiny_model

from viasd import quant as Q
from viasd.config import parse_engine_config, parse_params
from viasd.errors import InvalidParameterError

E4M3 = torch.float8_e4m3fn


def _weight(n=64, k=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05  # [N, K]
    w[5] *= 30  # a channel of another magnitude
    w[7, :8] = 1e-6  # values far below the row's max: fp8's subnormals
    return w


def _cpu_scaled_mm() -> bool:
    """torch runs _scaled_mm on CPU (recent versions, through oneDNN)."""
    try:
        a = torch.zeros(1, 16).to(E4M3)
        torch._scaled_mm(
            a, torch.zeros(16, 16).to(E4M3).t(), torch.ones(1, 1), torch.ones(1, 16), out_dtype=torch.bfloat16
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True


def test_the_quantizer_rounds_to_fp8_within_its_bound():
    w = _weight()
    qw = Q.quantize_fp8(w)
    assert qw.q.dtype == E4M3 and qw.scale.shape == (64,) and qw.scale.dtype == torch.float32
    w64 = w.double()
    s = w64.abs().amax(1) / 448  # [N]
    assert torch.allclose(qw.scale.double(), s, rtol=1e-6)
    assert torch.equal(qw.q.float().abs().amax(1), torch.full((64,), 448.0))  # each row's max |W| -> 448
    deq = qw.q.double() * qw.scale.double()[:, None]  # [N, K] in float64
    err = (deq - w64).abs()
    bound = 2.0**-4 * w64.abs() + 2.0**-10 * s[:, None]
    assert bool((err <= bound * (1 + 1e-6)).all()), (err / bound).max()
    assert err.max() > 0 and (err[7, :8] > 0).any()  # (lossy, subnormals included: the test can see it)
    assert torch.equal(qw.dequantize(), deq.float())
    assert qw.nbytes() == 64 * 96 + 64 * 4


@pytest.mark.skipif(not _cpu_scaled_mm(), reason="this torch has no CPU _scaled_mm")
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_linear_computes_its_maths_on_cpu(rows, dtype):
    w, bias = _weight(), torch.randn(64) * 0.1
    qw = Q.quantize_fp8(w)
    mod = Q.fp8_linear_class()(qw, bias.to(dtype))
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, rows, 96, generator=g) * torch.linspace(0.1, 3, 96)).to(dtype)  # [2, M, K]
    y = mod(x)
    assert y.shape == (2, rows, 64) and y.dtype == dtype
    x64 = x.double().reshape(-1, 96)  # [2M, K]
    a = x64.abs().amax(1, keepdim=True) / 448  # [2M, 1]: the per-token scales
    xq = (x64 / a).to(E4M3).double() * a  # [2M, K]
    wq = qw.dequantize().double()  # [N, K]
    emulated = xq @ wq.t()  # [2M, N]
    got = (y.double().reshape(-1, 64) - bias.to(dtype).double()).reshape(-1, 64)
    tol = 2.0**-8 * emulated.abs() + 1e-5 * (xq.abs() @ wq.abs().t())
    if dtype == torch.bfloat16:
        tol += 2.0**-8 * (emulated + bias.double()).abs()  # (the bias added in bf16)
    assert bool(((got - emulated).abs() <= tol).all()), ((got - emulated).abs() / tol).max()
    exact = x64 @ w.double().t()  # [2M, N]
    s = w.double().abs().amax(1)[None] / 448  # [1, N]
    bound = (
        (2.0**-3 + 2.0**-7) * (x64.abs() @ w.double().abs().t())
        + 2.0**-8 * exact.abs()
        + 2.0**-9 * (a * w.double().abs().sum(1)[None] + s * x64.abs().sum(1, keepdim=True))
    )
    if dtype == torch.bfloat16:
        bound += 2.0**-8 * (exact + bias.double()).abs()
    assert bool(((got - exact).abs() <= bound).all()), ((got - exact).abs() / bound).max()
    assert (got - exact).abs().max() > 1e-4  # (fp8: the float product is not what it computes)


def test_the_linear_takes_multiples_of_16():
    with pytest.raises(ValueError, match="multiples of 16"):
        Q.fp8_linear_class()(Q.quantize_fp8(torch.randn(24, 96)), None)
    model = tiny_model("llama", layers=1, dtype=torch.float32)  # hidden 48, kv 24: k / v are skipped
    report = Q.quantize_model(model, "fp8", include_lm_head=False)
    assert "fp8: K=48 or N=24" in report.skipped["model.layers.0.self_attn.k_proj"]
    assert set(report.quantized.values()) == {"fp8"} and report.dense_bytes == 0
    assert "model.layers.0.mlp.down_proj" in report.quantized and report.skipped["lm_head"] == "lm_head excluded"


def test_fp8_is_refused_off_cuda_naming_the_field(tmp_path):
    assert parse_engine_config(quantization="fp8").quantization == "fp8"
    for device, dtype in (("cpu", "bfloat16"), ("cpu", "float32")):
        with pytest.raises(InvalidParameterError) as err:
            Q.resolve_quantization("fp8", device, dtype, False)
        assert err.value.field == "quantization" and "CUDA" in err.value.message and "int4" in err.value.message
    from viasd.llm import LLM

    config = save_tiny_pair(tmp_path).model_copy(update={"quantization": "fp8"})
    with pytest.raises(InvalidParameterError) as err:
        LLM(config)
    assert err.value.field == "quantization"


def test_the_cli_takes_fp8():
    from viasd.cli import _engine_config, build_parser

    args = build_parser().parse_args(["generate", "--quantization", "fp8", "def f():"])
    assert _engine_config(args, max_batch=1).quantization == "fp8"


# ------------------------------------------------------------------ on a CUDA device

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _fp8_capable() -> bool:
    return torch.cuda.get_device_capability() >= Q.FP8_CAPABILITY


@cuda
def test_cuda_fp8_linear_agrees_with_the_float_reference():
    """On a device of compute capability 8.9 or more the bound above holds on CUDA's kernel; below,
    fp8 is refused naming the field."""
    if not _fp8_capable():
        with pytest.raises(InvalidParameterError, match="compute capability"):
            Q.resolve_quantization("fp8", "cuda", "bfloat16", False)
        return
    assert Q.resolve_quantization("fp8", "cuda", "bfloat16", False).scheme == "fp8"
    w = _weight(n=256, k=512).cuda()
    mod = Q.fp8_linear_class()(Q.quantize_fp8(w), None)
    x = torch.randn(9, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).to(torch.bfloat16)
    y = mod(x).double()  # [9, N]
    x64, w64 = x.double(), w.double()
    exact = x64 @ w64.t()
    a, s = x64.abs().amax(1, keepdim=True) / 448, w64.abs().amax(1)[None] / 448
    bound = (
        (2.0**-3 + 2.0**-7) * (x64.abs() @ w64.abs().t())
        + 2.0**-8 * exact.abs()
        + 2.0**-9 * (a * w64.abs().sum(1)[None] + s * x64.abs().sum(1, keepdim=True))
    )
    assert bool(((y - exact).abs() <= bound).all()), ((y - exact).abs() / bound).max()
    # relative to the output's scale: what fp8 costs a product of 512 inputs
    assert ((y - exact).abs().max() / exact.abs().max()).item() < 0.1


@cuda
def test_cuda_greedy_sd_equals_greedy_ar_under_fp8(tmp_path):
    """Through the engine option: both models' decoder linears in fp8 (the heads dense), float32
    activations; `ar`'s one-row steps and `sd`'s verified blocks run the same kernel on the same
    fp8 weights, each row with its own activation scale."""
    if not _fp8_capable():
        pytest.skip("compute capability < 8.9: fp8 is refused (the test above checks the refusal)")
    from viasd.llm import LLM

    config = save_tiny_pair(tmp_path, hidden=64, intermediate=128, device="cuda", quantization="fp8")
    llm = LLM(config)
    verifier_q, drafter_q = llm.runtime_info()["quantization"]
    assert (verifier_q["quantization"], verifier_q["kernels"]) == ("fp8", {"fp8": 6 * 7})
    assert drafter_q["kernels"] == {"fp8": 2 * 7}
    accepted = 0
    for prompt in ([5, 17, 3, 88, 41, 9], [1, 2, 3], [60] * 12):
        ar = llm.complete(prompt, parse_params(mode="ar", max_tokens=32))
        sd = llm.complete(prompt, parse_params(mode="sd", max_tokens=32, gamma=4))
        assert sd.token_ids == ar.token_ids, prompt
        accepted += sd.stats.num_accepted_tokens
    assert accepted > 0
    plain = LLM(config.model_copy(update={"quantization": "none"}))
    ids = torch.tensor([[5, 17, 3, 88]], device="cuda")
    with torch.no_grad():
        assert not torch.equal(llm.verifier.model(ids).logits, plain.verifier.model(ids).logits)  # (fp8 ran)
