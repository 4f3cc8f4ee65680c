"""Penalties and log-probabilities stay the target's: greedy output with a repetition penalty is transformers'
own, presence and frequency penalties match a plain decode written here, sampled output follows the penalised
target's distribution, and every committed token's log-probability is the target's own."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from cascade import Cascade
from cascade.engine import CascadeEngine
from cascade.penalties import Penalties
from cascade.sampling import SamplingParams, warp
from tests.conftest import hf_stage, perturbed_copy, random_llama
from tests.test_engine_greedy import CHAINS, EOS, NEW_TOKENS, _stages, build_models, build_prompts
from tests.test_engine_sampling import PROMPT, VOCAB, TableModel, chi_square_p_value, samples

PROMPTS = 8


@pytest.fixture(scope="module")
def models():
    return build_models(48)


@pytest.fixture(scope="module")
def prompts():
    return build_prompts(48)[:PROMPTS]


def _run(models, chain, prompts, params=SamplingParams(), **options):
    engine = CascadeEngine(_stages(models, CHAINS[chain]), [3] * (len(CHAINS[chain]) - 1), eos_token_id=EOS)
    requests = [engine.add_request(p, params, NEW_TOKENS, **options) for p in prompts]
    while engine.has_work:
        engine.step()
    return requests


def penalised(logits: torch.Tensor, context: list[int], prompt_length: int, repetition: float, presence: float,
              frequency: float) -> torch.Tensor:
    """The rule, one token at a time (the test's own reading of vLLM's semantics)."""
    logits = logits.clone().double()
    output = context[prompt_length:]
    for token in set(context):
        if repetition != 1.0:
            logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
    for token in set(output):
        logits[token] -= presence + frequency * output.count(token)
    return logits


@pytest.mark.parametrize("chain", ["1-stage", "3-stage", "ngram+3-stage"])
def test_greedy_repetition_penalty_is_transformers_decode(models, prompts, chain):
    target = models["target"]
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              do_sample=False, repetition_penalty=1.6)
        expected.append(out[0, len(p):].tolist())
    plain = [r.generated for r in _run(models, chain, prompts)]
    assert plain != expected, "the penalty should change some of these decodes"
    got = [r.generated for r in _run(models, chain, prompts, penalties=Penalties(repetition=1.6))]
    assert got == expected


def test_greedy_presence_and_frequency_penalties_are_the_plain_decode(models, prompts):
    target = models["target"]
    rule = dict(repetition=1.2, presence=0.7, frequency=0.5)
    expected = []
    for p in prompts:
        context = list(p)
        while len(context) - len(p) < NEW_TOKENS:
            with torch.no_grad():
                logits = target(torch.tensor([context])).logits[0, -1]
            token = int(penalised(logits, context, len(p), *rule.values()).argmax())
            context.append(token)
            if token == EOS:
                break
        expected.append(context[len(p):])
    for chain in ("3-stage", "ngram+3-stage"):
        got = [r.generated for r in _run(models, chain, prompts, penalties=Penalties(**rule))]
        assert got == expected, chain


@pytest.mark.parametrize("coupled", [False, True], ids=["rejection", "shared-noise"])
def test_sampled_penalties_follow_the_penalised_target(coupled):
    """The first two tokens' joint distribution under the penalised, warped target, against samples of a cascade
    whose drafters do not penalise (drafts of several tokens, so the second token's row is verified with the first
    drafted token in its history)."""
    rule = dict(repetition=1.8, presence=0.6, frequency=0.4)
    params = SamplingParams(temperature=1.0, top_k=8)
    target = TableModel("target", seed=0, scale=2.0)
    medium = TableModel("medium", seed=0, scale=2.0)
    medium.table = medium.table + torch.randn(medium.table.shape, generator=torch.Generator().manual_seed(9)) * 0.5
    bottom = TableModel("bottom", seed=3)

    def p(context):
        logits = penalised(target.logits_after(context), context, len(PROMPT), *rule.values())
        return warp(logits.float()[None], params)[0].double()

    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    first = p(PROMPT)
    for a in range(VOCAB):
        joint[a] = first[a] * p(PROMPT + [a])
    engine = CascadeEngine([bottom, medium, target], [3, 2], eos_token_id=None, max_running=64)
    requests = [engine.add_request(PROMPT, params, 4, seed=s, coupled=coupled, penalties=Penalties(**rule))
                for s in range(samples(8_000))]
    while engine.has_work:
        engine.step()
    counts = Counter(tuple(r.generated[:2]) for r in requests)
    assert chi_square_p_value(counts, joint) > 1e-3
    unpenalised = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)  # the test has power: not the plain target
    plain = warp(target.logits_after(PROMPT)[None], params)[0].double()
    for a in range(VOCAB):
        unpenalised[a] = plain[a] * warp(target.logits_after(PROMPT + [a])[None], params)[0].double()
    assert chi_square_p_value(counts, unpenalised) < 1e-6


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)],
                         ids=["greedy", "sampled"])
def test_logprobs_are_the_targets_own(models, prompts, params):
    """Every committed token's log-probability, and its top alternatives, are the target's log-softmax at that
    position over the whole sequence, computed afresh (float32: within 1e-4)."""
    target = models["target"]
    for chain in ("1-stage", "3-stage", "ngram+3-stage"):
        requests = _run(models, chain, prompts, params, logprobs=3, seed=7)
        for request in requests:
            assert len(request.token_logprobs) == len(request.generated)
            with torch.no_grad():
                full = target(torch.tensor([request.context])).logits[0].log_softmax(-1)  # [length, vocab]
            rows = full[len(request.prompt) - 1 : len(request.context) - 1]
            for entry, token, row in zip(request.token_logprobs, request.generated, rows):
                assert entry.token == token
                assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
                assert [v for _, v in entry.top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
                assert [v for _, v in entry.top] == pytest.approx([float(row[i]) for i, _ in entry.top], abs=1e-4)


def test_api_logprobs_follow_the_tokens_a_stop_string_keeps(tiny_family):
    """Through the Python API: one log-probability per returned token, whether a stop string, a stop token or
    the token limit ended it; min_p and the penalties are accepted and validated."""
    cascade = Cascade.from_config(tiny_family.config_path, progress=False)
    whole = cascade.generate("def parse(", max_tokens=24, ignore_eos=True, logprobs=2)
    assert len(whole.logprobs) == len(whole.token_ids) == 24
    stop_at = whole.token_ids[10]
    cut = cascade.generate("def parse(", max_tokens=24, ignore_eos=True, logprobs=0, stop_token_ids=[stop_at])
    assert cut.token_ids == whole.token_ids[: whole.token_ids.index(stop_at) + 1]
    assert [e.logprob for e in cut.logprobs] == pytest.approx([e.logprob for e in whole.logprobs[: len(cut.token_ids)]],
                                                             abs=1e-5)
    assert all(e.top == () for e in cut.logprobs)
    text = cascade.tokenizer.decode(whole.token_ids[:12])
    stop = text[-3:] if text[-3:].strip() else text[-4:]
    stopped = cascade.generate("def parse(", max_tokens=24, ignore_eos=True, logprobs=1, stop=stop)
    assert len(stopped.logprobs) == len(stopped.token_ids) < 24
    assert cascade.generate("def parse(", max_tokens=8, temperature=0.9, min_p=0.2, seed=1).token_ids
    for bad in (dict(min_p=1.5), dict(repetition_penalty=0.0), dict(presence_penalty=3.0), dict(logprobs=21)):
        with pytest.raises(ValueError):
            cascade.start("x", **bad)


def test_a_penalised_request_beside_plain_ones_changes_only_itself():
    target = random_llama(32, 32, 1, seed=11, eos_token_id=EOS)
    stages = [hf_stage("draft", perturbed_copy(target, 0.1, seed=2)), hf_stage("target", target)]
    prompt = [7, 8, 9, 7, 8]
    alone = CascadeEngine(stages, [3], eos_token_id=EOS)
    plain = alone.run(alone.add_request(prompt, SamplingParams(), 16)).generated
    engine = CascadeEngine(stages, [3], eos_token_id=EOS)
    a = engine.add_request(prompt, SamplingParams(), 16)
    b = engine.add_request(prompt, SamplingParams(), 16, penalties=Penalties(repetition=3.0))
    while engine.has_work:
        engine.step()
    assert a.generated == plain and b.generated != plain
