"""The batched passes of a step (cascade/engine/passes.py): a fault in one request's rows fails that request alone."""

from __future__ import annotations

import pytest
import torch

from cascade.engine import CascadeEngine
from cascade.sampling import BROKEN_ROW, SamplingParams, finite_rows
from cascade.stages.draft import draft_tokens
from tests.conftest import hf_stage, perturbed_copy, random_llama

VOCAB = 12
POISON = 11  # a prompt starting with this token gets NaN logits from the poisoned stage


class Poisoned:
    """A model stage built for the test: the wrapped stage's logits, but NaN for every sequence whose context starts
    with ``POISON`` (a model fault that cannot be caused on purpose with real weights: fp16 overflow, a bad kernel)."""

    def __init__(self, inner):
        self.inner, self.name, self.vocab_size, self.max_context = inner, inner.name, inner.vocab_size, inner.max_context

    @property
    def new_tokens(self):
        return self.inner.new_tokens

    def score(self, seq_ids, contexts, num_positions):
        out = self.inner.score(seq_ids, contexts, num_positions)
        return [torch.full_like(rows, float("nan")) if ctx[0] == POISON else rows for rows, ctx in zip(out, contexts)]

    def argmax(self, seq_ids, contexts, num_positions):  # as HFStage does: BROKEN_ROW where a row is not finite
        rows = self.score(seq_ids, contexts, num_positions)
        return [r.argmax(-1).masked_fill(~finite_rows(r), BROKEN_ROW) for r in rows]

    def draft(self, seq_ids, contexts, depths, eos_token_ids, sampling):
        return draft_tokens(self, seq_ids, contexts, depths, eos_token_ids, sampling)

    def adopt(self, seq_id, prompt):
        return self.inner.adopt(seq_id, prompt)

    def release(self, seq_id):
        self.inner.release(seq_id)

    def num_cached_sequences(self):
        return self.inner.num_cached_sequences()

    def cached_tokens(self, seq_id):
        return self.inner.cached_tokens(seq_id)


@pytest.fixture(scope="module")
def models():
    target = random_llama(VOCAB, 16, 1, seed=0, init_range=0.5)
    return target, perturbed_copy(target, 0.3, seed=1)


def _run(stages, requests):
    """Every (prompt, params, seed) of ``requests`` batched in one engine; the finished requests, in order."""
    engine = CascadeEngine(stages, [3], eos_token_id=None)
    out = [engine.add_request(p, params, 10, seed=seed, coupled=seed is not None) for p, params, seed in requests]
    while engine.has_work:
        engine.step()
    assert not engine.running and all(s.num_cached_sequences() == 0 for s in stages)
    return out


HEALTHY = [([1, 2, 3], SamplingParams(), None), ([4, 5], SamplingParams(temperature=1.0), 7),
           ([6, 1, 1], SamplingParams(temperature=0.7, top_k=5), 3)]


@pytest.mark.parametrize("poisoned", [SamplingParams(), SamplingParams(temperature=1.0),
                                      SamplingParams(temperature=0.8, top_p=0.9)], ids=["greedy", "T=1", "top-p"])
def test_a_request_with_nan_target_logits_fails_alone(models, poisoned):
    """Before: a sampled one's drawn index fell past the vocabulary and the next pass raised IndexError for the
    whole batch; a greedy one went on with the argmax of NaNs."""
    target, drafter = models
    stages = [hf_stage("drafter", drafter), Poisoned(hf_stage("target", target))]
    alone = [r.generated for r in _run(stages, HEALTHY)]
    requests = _run(stages, [HEALTHY[0], ([POISON, 2, 3], poisoned, None), *HEALTHY[1:]])
    bad = requests[1]
    assert bad.finish_reason == "error" and "non-finite logits" in bad.failure and "'target'" in bad.failure
    others = [r for i, r in enumerate(requests) if i != 1]
    assert [r.generated for r in others] == alone  # greedy and seeded: the same text as without the fault
    assert all(r.finish_reason == "length" for r in others)


def test_a_drafters_nan_rows_end_its_draft_and_the_request_goes_on(models):
    """A drafter's broken row is no reason to fail anything: its draft stops there (a shorter draft is a draft)."""
    target, drafter = models
    healthy = [hf_stage("drafter", drafter), hf_stage("target", target)]
    poisoned = [Poisoned(hf_stage("drafter", drafter)), hf_stage("target", target)]
    requests = [([POISON, 2, 3], SamplingParams(), None), ([POISON, 4], SamplingParams(temperature=1.0), 5)]
    expected = [r.generated for r in _run(healthy, requests)]
    got = _run(poisoned, requests)
    assert all(r.finish_reason == "length" for r in got)
    assert got[0].generated == expected[0]  # greedy: the target's own decode whatever the drafts
    assert got[1].generated == expected[1]  # seeded (shared noise): the text does not depend on the drafts


def test_greedy_requests_alone_find_a_broken_row_through_the_argmax(models):
    """A batch of greedy requests only asks the stage for argmax ids: a broken row comes back as BROKEN_ROW, and
    its request fails alone."""
    target, drafter = models
    stages = [hf_stage("drafter", drafter), Poisoned(hf_stage("target", target))]
    greedy = [([1, 2, 3], SamplingParams(), None), ([6, 1, 1], SamplingParams(), None)]
    alone = [r.generated for r in _run(stages, greedy)]
    requests = _run(stages, [greedy[0], ([POISON, 5], SamplingParams(), None), greedy[1]])
    assert requests[1].finish_reason == "error"
    assert [requests[0].generated, requests[2].generated] == alone
