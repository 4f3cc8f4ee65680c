"""Each request's plan for a step (cascade/engine/planning.py) without the adaptive controller: the configured plan,
the n-gram shortcut's found continuations first, then the drafts the pipelined mode made ahead."""

from __future__ import annotations

import pytest
import torch

from cascade.controller import Plan
from cascade.engine.passes import StagePasses
from cascade.engine.planning import StepPlanner
from cascade.engine.request import Ahead, Request
from cascade.sampling import SamplingParams
from cascade.stages.ngram import NGramDrafter
from cascade.stats import RequestStats, StageStats
from cascade.verify import Draft, Verifier
from tests.conftest import hf_stage, perturbed_copy, random_llama

NGRAM, SMALL, TARGET = 0, 1, 2
CONFIGURED = Plan((NGRAM, SMALL, TARGET), (3, 2), 0.0)
REPEATING = [1, 2, 3, 4, 1, 2]  # "1 2" was followed by "3 4 1": the n-gram drafter finds that
FRESH = [5, 6, 7]  # nothing to find


@pytest.fixture(scope="module")
def stages():
    target = random_llama(16, 16, 1, seed=0)
    return [NGramDrafter(max_ngram=2), hf_stage("small", perturbed_copy(target, 0.3, seed=1)), hf_stage("target", target)]


def _request(seq_id: int, prompt: list[int], stages, params: SamplingParams = SamplingParams()) -> Request:
    stats = RequestStats([StageStats(s.name) for s in stages], prompt_tokens=len(prompt))
    return Request(seq_id, prompt, params, 16, torch.Generator().manual_seed(seq_id), stats, None)


def _planner(stages, *, shortcut: bool, pipelined: bool = False) -> StepPlanner:
    return StepPlanner(StagePasses(stages, Verifier("reference"), (), None), CONFIGURED, shortcut, None, pipelined)


def test_without_the_shortcut_every_round_runs_the_configured_plan(stages):
    repeating, fresh = _request(0, REPEATING, stages), _request(1, FRESH, stages)
    step, drafts = _planner(stages, shortcut=False).plans([repeating, fresh])
    assert step.rounds == {repeating: (CONFIGURED, None), fresh: (CONFIGURED, None)}
    assert drafts == {} and step.ahead is None


def test_the_shortcut_sends_a_found_continuation_straight_to_the_target(stages):
    """A found continuation is the round's draft, at the n-gram drafter's depth, verified by the target alone; a
    request with nothing found runs the models' part of the configured plan."""
    repeating, fresh = _request(0, REPEATING, stages), _request(1, FRESH, stages)
    step, drafts = _planner(stages, shortcut=True).plans([repeating, fresh])
    assert step.rounds[repeating] == (Plan((NGRAM, TARGET), (3,), 0.0), [3, 4, 1])
    assert drafts[repeating] == Draft([3, 4, 1], None)
    assert step.rounds[fresh] == (Plan((SMALL, TARGET), (2,), 0.0), None) and fresh not in drafts


def test_a_draft_made_ahead_is_verified_only_in_the_round_it_was_made_for(stages):
    """The pipelined mode's draft is kept for the round whose context it continues (and is handed out once); one made
    for another length is dropped; a found continuation takes precedence over it."""
    current, stale, found = (_request(i, p, stages) for i, p in enumerate((FRESH, [9, 8, 7], REPEATING), start=10))
    ahead_plan = Plan((SMALL, TARGET), (2,), 0.0)
    current.ahead = Ahead(len(FRESH), ahead_plan, Draft([1, 1], None))
    stale.ahead = Ahead(2, ahead_plan, Draft([2, 2], None))
    found.ahead = Ahead(len(REPEATING), ahead_plan, Draft([5, 5], None))
    planner = _planner(stages, shortcut=True, pipelined=True)
    step, drafts = planner.plans([current, stale, found])
    assert step.kept == {current}
    assert drafts[current] == Draft([1, 1], None) and stale not in drafts and drafts[found] == Draft([3, 4, 1], None)
    assert step.ahead is True  # the small model drafts for the target: the pipelined mode drafts the next rounds ahead
    assert current.ahead is stale.ahead is found.ahead is None
    step, drafts = planner.plans([current])
    assert step.kept == frozenset() and drafts == {}


def test_the_backlog_counts_what_each_model_drafter_has_not_read(stages):
    greedy = [_request(20, FRESH, stages), _request(21, REPEATING, stages)]
    sampled = _request(22, [4, 4], stages, SamplingParams(temperature=1.0))
    planner = _planner(stages, shortcut=True)
    assert planner.backlog([*greedy, sampled], "greedy") == [0, len(FRESH) + len(REPEATING), 0]
    assert planner.backlog([*greedy, sampled], "sampling") == [0, 2, 0]
