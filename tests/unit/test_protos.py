"""The committed gRPC stubs are fresh; protobuf <-> pydantic conversions; the wire helpers of the
pipeline (draft probabilities, in-order execution). No Ray, no models."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from viasd.config import Mode, parse_params
from viasd.errors import InvalidParameterError
from viasd.metrics import RequestStats, TokenLogprob
from viasd.v1 import generation_pb2 as pb
from viasd.v1.convert import (
    logprobs_from_proto,
    logprobs_to_proto,
    params_from_proto,
    params_to_proto,
    stats_from_proto,
    stats_to_proto,
)

ROOT = Path(__file__).resolve().parents[2]


def test_committed_stubs_are_fresh(tmp_path):
    import grpc_tools  # noqa: F401  (declared in the dev extra: missing fails)

    env = {**os.environ, "OUT": str(tmp_path)}
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gen_protos.sh")], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    generated = sorted(p.relative_to(tmp_path) for p in (tmp_path / "viasd" / "v1").iterdir())
    committed = sorted(p.relative_to(ROOT) for p in (ROOT / "viasd" / "v1").glob("*_pb2*"))
    assert generated == committed, "stub files differ: run scripts/gen_protos.sh"
    stale = [str(p) for p in generated if (tmp_path / p).read_bytes() != (ROOT / p).read_bytes()]
    assert not stale, f"stale generated stubs {stale}: run scripts/gen_protos.sh"


# ------------------------------------------------------------------ conversions


def test_unset_fields_take_the_defaults():
    assert params_from_proto(pb.GenerationParams()) == parse_params()
    assert params_from_proto(pb.GenerationParams(), default_mode="ar").mode == Mode.AR
    p = params_from_proto(pb.GenerationParams(temperature=0.0, max_tokens=7))  # explicit zero is a value
    assert p.temperature == 0.0 and p.max_tokens == 7


@pytest.mark.parametrize(
    "values",
    [
        dict(),
        dict(mode="sd", temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=2**63 - 1, gamma=7),
        dict(
            mode="via",
            alpha1=0.7,
            alpha2=0.3,
            region_b="escalate",
            slim_bonus=True,
            rule="lossy",
            lossy_alpha=0.3,
            lossy_beta=0.8,
            stop_token_ids=(3, 9),
            ignore_eos=True,
        ),
        dict(mode="ar", rule="overshoot", overshoot_ceiling=0.123456789),
        dict(
            presence_penalty=0.3,
            frequency_penalty=-0.2,
            repetition_penalty=1.1,
            logit_bias={3: -100.0, 7: 0.5},
            logprobs=3,
            logprobs_tier="slim",
            prompt_logprobs=0,
            max_tokens=0,
            stop=("a", "\n\n"),
            n=3,
        ),
    ],
)
def test_params_round_trip_exactly(values):
    params = parse_params(values)
    msg = pb.GenerationParams.FromString(params_to_proto(params).SerializeToString())
    assert params_from_proto(msg) == params  # doubles on the wire: 0.3 stays 0.3


def test_the_message_mirrors_generation_params_field_for_field_and_value_for_value():
    """One form for a request's parameters from the handler to the actors: the message has every
    field of GenerationParams under its name and no other, and every value of each of its enums
    travels (a rule or mode the wire could not carry would fail the served request only)."""
    from enum import Enum

    from viasd.config import GenerationParams

    assert set(pb.GenerationParams.DESCRIPTOR.fields_by_name) == set(GenerationParams.model_fields)
    for name, field in GenerationParams.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, Enum):
            for value in field.annotation:
                extra = {"mode": "via"} if name == "rule" else {}  # (staged is a `via` rule)
                params = parse_params({**extra, name: value.value})
                assert params_from_proto(params_to_proto(params)) == params, (name, value)


@pytest.mark.parametrize(
    "msg, field",
    [
        (pb.GenerationParams(temperature=-0.5), "temperature"),
        (pb.GenerationParams(top_p=0.0), "top_p"),
        (pb.GenerationParams(alpha1=0.2, alpha2=0.3), "alpha2"),
        (pb.GenerationParams(mode=17), "mode"),
        (pb.GenerationParams(rule=9), "rule"),
        (pb.GenerationParams(seed=2**64 - 1), "seed"),
        (pb.GenerationParams(max_tokens=0), "max_tokens"),
        (pb.GenerationParams(presence_penalty=3.0), "presence_penalty"),
        (pb.GenerationParams(logit_bias={5: 250.0}), "logit_bias"),
        (pb.GenerationParams(logprobs_tier=7), "logprobs_tier"),
        (pb.GenerationParams(stop=["", "x"]), "stop"),
        (pb.GenerationParams(n=0), "n"),
    ],
)
def test_bad_params_name_the_field(msg, field):
    with pytest.raises(InvalidParameterError) as err:
        params_from_proto(msg)
    assert err.value.field == field


def test_logprobs_round_trip():
    entries = [None, TokenLogprob(5, -0.25, [(5, -0.25), (9, -1.5)], "full"), TokenLogprob(2, -3.0, [], "slim")]
    msgs = pb.GenerateResponse(prompt_logprobs=logprobs_to_proto(entries)).SerializeToString()
    assert logprobs_from_proto(pb.GenerateResponse.FromString(msgs).prompt_logprobs) == entries[1:]


def test_stats_round_trip():
    s = RequestStats(
        mode="via",
        prompt_tokens=6,
        generated_tokens=24,
        finish_reason="length",
        num_drafts=5,
        num_draft_tokens=20,
        num_accepted_tokens=14,
        num_accepted_tokens_per_pos=[5, 4, 3, 2],
        num_rejected_tokens=3,
        num_cycle_tokens=19,
        num_bonus_tokens=1,
        slim_accepted=9,
        slim_rewritten=2,
        escalations=2,
        escalated_tokens=6,
        full_accepted=5,
        forwards={"drafter": 20, "slim": 5, "full": 2},
        seconds={"drafter": 0.5, "slim": 0.25, "full": 0.125},
        time_to_first_token=0.01,
        total_seconds=1.5,
        drafter_fallback=True,
        preemptions=2,
    )
    msg = pb.RequestStats.FromString(stats_to_proto(s).SerializeToString())
    assert msg.mean_acceptance_length == pytest.approx(19 / 5)
    assert stats_from_proto(msg, "length") == s
    assert stats_from_proto(stats_to_proto(RequestStats()), None) == RequestStats()


def test_add_counters_sums_the_two_sides():
    drafter = RequestStats(num_drafts=3, num_draft_tokens=9, forwards={"drafter": 9, "slim": 0, "full": 0})
    verifier = RequestStats(
        num_accepted_tokens=5,
        num_accepted_tokens_per_pos=[3, 2],
        num_cycle_tokens=8,
        forwards={"drafter": 0, "slim": 3, "full": 1},
    )
    total = RequestStats(mode="via", generated_tokens=8)
    total.add_counters(drafter)
    total.add_counters(verifier)
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens, total.num_cycle_tokens) == (3, 9, 5, 8)
    assert total.num_accepted_tokens_per_pos == [3, 2] and total.forwards == {"drafter": 9, "slim": 3, "full": 1}
    assert total.generated_tokens == 8 and total.mean_acceptance_length == 8 / 3


# ------------------------------------------------------------------ wire helpers of the pipeline


def test_draft_probs_travel_exactly():
    import torch

    from viasd.actors.rpc import decode_probs, encode_probs
    from viasd.v1 import internal_pb2 as ipb

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        p = torch.softmax(torch.randn(5, 151, generator=g, dtype=dtype) * 3, dim=-1)  # [k, V]
        msg = ipb.DraftProbs.FromString(encode_probs(p).SerializeToString())
        assert msg.dtype == str(dtype).removeprefix("torch.") and len(msg.data) == p.numel() * p.element_size()
        back = decode_probs(msg)
        assert back.dtype == dtype and torch.equal(back, p)
    assert encode_probs(None) is None and decode_probs(None) is None
    p = torch.softmax(torch.randn(3, 97, generator=g), dim=-1)
    half = decode_probs(encode_probs(p, "bfloat16"))  # lossy: relative error below 2^-8
    assert len(encode_probs(p, "bfloat16").data) == p.numel() * 2
    assert ((half - p).abs() <= p * 2**-8 + 1e-30).all() and not torch.equal(half, p)
    with pytest.raises(InvalidParameterError, match="probs.data"):
        decode_probs(ipb.DraftProbs(rows=2, vocab_size=3, data=b"\0" * 8, dtype="float32"))


def test_sparse_draft_probs_travel_exactly_and_small():
    """top-k / top-p rows (p exactly 0 elsewhere) travel as values + columns: bit-exact, a few
    bytes per kept token instead of 4 x V; a dense row in the same block stays exact too; bad
    sparse messages are INVALID_ARGUMENT naming the field."""
    import torch

    from viasd.actors.rpc import decode_probs, encode_probs
    from viasd.config import parse_params
    from viasd.sampling import Sampler
    from viasd.v1 import internal_pb2 as ipb

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 5000, generator=g) * 2  # [k, V]
    for params in (dict(top_k=40), dict(top_p=0.5), dict(min_p=0.2)):
        p = Sampler.from_params(parse_params(temperature=0.9, **params)).probs(logits)  # [k, V]
        msg = ipb.DraftProbs.FromString(encode_probs(p).SerializeToString())
        nnz = int((p != 0).sum())
        assert msg.indices and sum(msg.row_nnz) == nnz and len(msg.data) == 4 * nnz, params
        assert torch.equal(decode_probs(msg), p), params
    mixed = torch.cat([p[:2], torch.softmax(logits[2:3], dim=-1)])  # one dense row: still under half the bytes
    assert torch.equal(decode_probs(encode_probs(mixed)), mixed)
    dense = torch.softmax(logits, dim=-1)
    assert not encode_probs(dense).indices  # plain temperature sampling: dense rows
    msg = encode_probs(p)
    with pytest.raises(InvalidParameterError, match="probs.indices"):
        decode_probs(
            ipb.DraftProbs(
                rows=msg.rows, vocab_size=10, dtype="float32", data=msg.data, indices=msg.indices, row_nnz=msg.row_nnz
            )
        )
    with pytest.raises(InvalidParameterError, match="probs.indices"):
        decode_probs(
            ipb.DraftProbs(
                rows=msg.rows,
                vocab_size=msg.vocab_size,
                dtype="float32",
                data=msg.data,
                indices=msg.indices[:-4],
                row_nnz=msg.row_nnz,
            )
        )


def test_in_order_runs_calls_by_number_whatever_the_arrival_order():
    from viasd.actors.rpc import InOrder

    ran: list[int] = []

    def job(i):
        assert threading.current_thread() is not threading.main_thread()
        ran.append(i)
        return i * 10

    async def main():
        work = InOrder("test")
        futures = {i: work.enqueue(i, job, i) for i in (2, 0, 3, 1)}  # delivered out of order
        assert ran == [] or ran[0] == 0
        results = {i: await f for i, f in futures.items()}
        with pytest.raises(RuntimeError, match="arrived twice"):
            work.enqueue(1, job, 1)
        # a caller that gives up does not stop its call (the other ranks run it too)
        f = work.enqueue(4, job, 4)
        f.cancel()
        await work.enqueue(5, job, 5)
        work.shutdown()
        return results

    assert asyncio.run(main()) == {2: 20, 0: 0, 3: 30, 1: 10}
    assert ran == [0, 1, 2, 3, 4, 5]


def test_gen_protos_script_is_executable():
    assert os.access(ROOT / "scripts" / "gen_protos.sh", os.X_OK)
    assert shutil.which("bash")
