"""GGUF blocks mapped to the quantized layouts (viasd.quant_gguf), checked against gguf's own
dequantization: Q4_K / Q4_1 / Q4_0 to int4 bit for bit, the other types to int8 within half a
step; a GGUF file's tensors found by name, used only where they dequantize to the loaded weight;
and the real SmolLM2 GGUF (Q4_1, LLaMA: q / k rows reordered) served at int4 equals its float32
conversion."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import tiny_model
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter, quants

from viasd import quant as Q
from viasd import quant_gguf as G

#: bytes and weights of a block of each type (ggml's layouts)
BLOCKS = {
    T.Q4_K: (144, 256),
    T.Q4_0: (18, 32),
    T.Q4_1: (20, 32),
    T.Q6_K: (210, 256),
    T.Q8_0: (34, 32),
    T.Q5_0: (22, 32),
}
FP16_AT = {T.Q4_K: (0, 2), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q6_K: (208,), T.Q8_0: (0,), T.Q5_0: (0,)}


def random_blocks(kind, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Rows ``[n, k / block * bytes]`` of random valid blocks: random bytes, with finite fp16
    scales (ggml's d / dmin / m) of a realistic size."""
    nbytes, nweights = BLOCKS[kind]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, size=(n, k // nweights, nbytes), dtype=np.uint8)
    for at in FP16_AT[kind]:
        b[..., at : at + 2] = (
            (rng.uniform(-0.02, 0.02, size=(n, k // nweights)).astype(np.float16)).view(np.uint8).reshape(n, -1, 2)
        )
    return b.reshape(n, -1)


def gguf_values(kind, data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(quants.dequantize(data, kind), np.float32)).reshape(data.shape[0], -1)


class _Tensor:  # what gguf_to_int4 reads of a ReaderTensor
    def __init__(self, kind, data):
        self.tensor_type, self.data = kind, data


@pytest.mark.parametrize("kind", [T.Q4_K, T.Q4_1, T.Q4_0])
def test_4bit_blocks_map_to_int4_exactly(kind):
    data = random_blocks(kind, 48, 512)
    qw = G.gguf_to_int4(_Tensor(kind, data))
    assert (qw.scheme, qw.group, qw.shape) == ("int4", 32, (48, 512)) and int(qw.q.max()) <= 15
    assert torch.equal(qw.dequantize(), gguf_values(kind, data))  # bit for bit
    assert qw.source == f"gguf {kind.name} (exact)"


@pytest.mark.parametrize("kind", [T.Q6_K, T.Q8_0, T.Q5_0])
def test_other_types_are_not_int4(kind):
    assert G.gguf_to_int4(_Tensor(kind, random_blocks(kind, 16, 256))) is None


def test_the_llama_row_order_is_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    for heads in (4, 8):
        expect = LlamaTensorProcessor()._reverse_permute_weights(w, heads, heads)
        assert np.array_equal(w[G._llama_rows(64, heads).numpy()], expect)


def test_names():
    assert G.gguf_name("model.layers.3.mlp.up_proj") == "blk.3.ffn_up.weight"
    assert G.gguf_name("model.layers.0.self_attn.o_proj") == "blk.0.attn_output.weight"
    assert G.gguf_name("lm_head") == "output.weight" and G.gguf_name("model.norm") is None


def _write_gguf(path, tensors: dict[str, tuple]):
    writer = GGUFWriter(str(path), "llama")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])  # metadata the reader skips
    writer.add_array("tokenizer.ggml.scores", [0.5, 1.5, 2.5])
    writer.add_uint32("llama.block_count", 2)
    writer.add_string("general.name", "tiny")
    for name, (kind, data, _) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)  # (data: the rows of blocks, bytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(autouse=True)
def fresh():
    Q._reset_cache()
    yield
    Q._reset_cache()


def test_a_gguf_files_tensors_are_used_where_they_are_the_loaded_weights(tmp_path, monkeypatch):
    """Q4_K -> int4 exact, Q6_K -> int8 from gguf's float32 values (within half a step), a tensor
    that does not dequantize to the loaded weight and a linear the file lacks: quantized at load."""
    monkeypatch.setattr(Q, "probe_dense_from", lambda mod, rows=Q.PROBE_ROWS: (None, {}))
    model = tiny_model("qwen2", layers=2, dtype=torch.float32, hidden=256, intermediate=256)
    layer = model.model.layers[0]
    files = {
        "blk.0.ffn_up.weight": (T.Q4_K, random_blocks(T.Q4_K, 256, 256, 1), 256),
        "blk.0.ffn_down.weight": (T.Q6_K, random_blocks(T.Q6_K, 256, 256, 2), 256),
        "blk.0.ffn_gate.weight": (T.Q4_K, random_blocks(T.Q4_K, 256, 256, 3), 256),
    }
    with torch.no_grad():
        layer.mlp.up_proj.weight.copy_(gguf_values(T.Q4_K, files["blk.0.ffn_up.weight"][1]))
        layer.mlp.down_proj.weight.copy_(gguf_values(T.Q6_K, files["blk.0.ffn_down.weight"][1]))
        # gate_proj keeps its own weight: the file's tensor is not it
    path = tmp_path / "m.gguf"
    _write_gguf(path, files)
    ref, ours = {t.name: t for t in GGUFReader(str(path)).tensors}, G.read_gguf_tensors(path)
    assert set(ref) == set(ours) == set(files)
    for name, t in ref.items():  # our header reader finds what gguf's finds
        assert ours[name].tensor_type == t.tensor_type and ours[name].shape == tuple(int(d) for d in t.shape)
        assert np.array_equal(np.asarray(ours[name].data), np.asarray(t.data))
    down_values = layer.mlp.down_proj.weight.detach().clone()
    report = Q.quantize_model(model, "int4", weights=G.gguf_weights(path, "int4", model.config))
    assert report.sources["model.layers.0.mlp.up_proj"] == "gguf Q4_K (exact)"
    assert report.sources["model.layers.0.mlp.down_proj"] == "gguf Q6_K -> int8"
    assert report.sources["model.layers.0.mlp.gate_proj"].startswith("quantized at load (no source tensor")
    assert report.sources["model.layers.1.mlp.up_proj"].startswith("quantized at load")
    assert report.quantized["model.layers.0.mlp.down_proj"] == "int8"
    down = model.model.layers[0].mlp.down_proj
    w8 = down.qweight.float() * down.scales[:, None]  # [N, K], float32
    assert bool(((w8 - down_values).abs() <= down.scales[:, None] * (0.5 + 1e-5)).all())
    up_values = gguf_values(T.Q4_K, files["blk.0.ffn_up.weight"][1])
    up = model.model.layers[0].mlp.up_proj  # the int4 kernel computes with the file's values
    assert (up.dense_weight() - up_values).abs().max() <= 1e-6 * up_values.abs().max()


@pytest.mark.slow
def test_smollm2_served_at_its_own_int4_is_its_float32_conversion(monkeypatch):
    from viasd.models import embedded as E
    from viasd.models.loader import load_causal_lm

    if not E.is_installed(E.TEST_MODEL):
        pytest.fail(f"install the test model first: {' '.join(E.install_command(E.TEST_MODEL))}")
    monkeypatch.setattr(Q, "probe_dense_from", lambda mod, rows=Q.PROBE_ROWS: (4, {}))
    model, tok = load_causal_lm(E.TEST_MODEL, dtype="float32")
    ref, _ = load_causal_lm(E.TEST_MODEL, dtype="float32")
    path = G.cached_gguf(E.TEST_MODEL)
    theirs, ours = {t.name: t for t in GGUFReader(str(path)).tensors}, G.read_gguf_tensors(path)
    assert set(ours) == set(theirs) and all(
        ours[n].tensor_type == t.tensor_type
        and np.array_equal(np.asarray(ours[n].data).reshape(-1), np.asarray(t.data).reshape(-1))
        for n, t in theirs.items()
    )
    report = Q.quantize_model(model, "int4", weights=G.gguf_weights(path, "int4", model.config))
    assert report.as_dict()["sources"] == {"gguf Q4_1 (exact)": 30 * 7}  # q / k rows reordered too
    assert report.skipped == {"lm_head": "tied to the input embeddings"}
    ids = torch.tensor([tok.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')])
    with torch.no_grad():
        for t in (1, 3, ids.shape[1]):  # the integer kernels, then the dense copies
            a, b = model(ids[:, :t]).logits, ref(ids[:, :t]).logits
            assert (a - b).abs().max() <= 1e-5 * b.abs().max(), (a - b).abs().max()
