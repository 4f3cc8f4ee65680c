"""A step's rounds (cascade/engine/rounds.py): every request's round, whatever its plan, driven together, one batched
pass per stage and kind at a time, and each round's tokens the target's own."""

from __future__ import annotations

import pytest
import torch

from cascade.controller import Plan
from cascade.engine.passes import StagePasses
from cascade.engine.request import Request
from cascade.engine.rounds import Rounds
from cascade.sampling import SamplingParams
from cascade.stats import RequestStats, StageStats
from cascade.verify import Draft, Verifier
from tests.conftest import hf_stage, perturbed_copy, random_llama

VOCAB = 24
SMALL, MEDIUM, TARGET = 0, 1, 2


class Passes:
    """The passes a drive ran, as the engine's observer hears them: (stage, positions) in order."""

    def __init__(self):
        self.seen: list[tuple[str, int]] = []

    def on_forward(self, stage, num_positions, seconds):
        self.seen.append((stage, num_positions))

    def on_draft(self, stage, verifier, drafted, accepted, branch_tokens, branch_accepted, branch_rank):
        pass

    def on_plan(self, chain, depths, rounds, changed):
        pass

    def on_step(self, batch, tokens):
        pass


@pytest.fixture(scope="module")
def models():
    target = random_llama(VOCAB, 16, 2, seed=0, init_range=0.5)
    return perturbed_copy(target, 0.4, seed=1), perturbed_copy(target, 0.2, seed=2), target


def greedy(model, prompt: list[int], n: int) -> list[int]:
    """The target's own decode, one token at a time."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _request(seq_id: int, prompt: list[int], stages) -> Request:
    stats = RequestStats([StageStats(s.name) for s in stages], prompt_tokens=len(prompt))
    return Request(seq_id, prompt, SamplingParams(), 32, torch.Generator().manual_seed(seq_id), stats, None)


def _drive(stages, planned: dict[Request, Plan], found: dict[Request, Draft] | None = None):
    observer = Passes()
    rounds = Rounds(StagePasses(stages, Verifier("reference"), (), observer))
    started = {r: rounds.top(plan, r, r.context, 32, (found or {}).get(r)) for r, plan in planned.items()}
    return rounds.drive(started), observer.seen


def test_requests_with_different_chains_share_each_stages_passes(models):
    """Three requests, three plans (the whole chain, small straight to the target, the target alone): the target
    verifies all three in one pass over every position it has not read, the medium model's rounds run for the one request
    that uses it, and each request's tokens are the target's greedy continuation of its prompt."""
    stages = [hf_stage(n, m) for n, m in zip(("small", "medium", "target"), models)]
    whole, skip, alone = (_request(i, p, stages) for i, p in enumerate(([1, 2, 3, 4], [5, 6], [7, 8, 9])))
    plans = {whole: Plan((SMALL, MEDIUM, TARGET), (2, 3), 0.0), skip: Plan((SMALL, TARGET), (4,), 0.0),
             alone: Plan((TARGET,), (), 0.0)}
    done, seen = _drive(stages, plans)
    for request in plans:
        assert done[request] == greedy(models[TARGET], request.prompt, len(done[request])), request.prompt
    assert [stage for stage, _ in seen].count("target") == 1
    # what the target had not read: each prompt (nothing was prefilled) and each draft (medium's 3, small's 4)
    assert ("target", (4 + 3) + (2 + 4) + 3) in seen
    assert seen[-1][0] == "target"  # the lower stages' passes all ran first
    assert whole.stats.stages[MEDIUM].rounds >= 1 and skip.stats.stages[MEDIUM].rounds == 0
    assert alone.width == 1 and skip.width == 5 and whole.width == 4


def test_a_round_with_a_draft_already_made_drafts_nothing_below(models):
    """A found draft (the n-gram shortcut's, or one made ahead) is verified as it is: no lower stage runs, and a wrong
    guess still yields the target's own tokens."""
    stages = [hf_stage(n, m) for n, m in zip(("small", "medium", "target"), models)]
    prompt = [3, 1, 4, 1, 5]
    truth = greedy(models[TARGET], prompt, 4)
    right, wrong = _request(10, prompt, stages), _request(11, prompt, stages)
    guess = [truth[0], truth[1], (truth[2] + 1) % VOCAB]
    plans = {right: Plan((SMALL, TARGET), (3,), 0.0), wrong: Plan((SMALL, TARGET), (3,), 0.0)}
    done, seen = _drive(stages, plans, {right: Draft(truth[:3], None), wrong: Draft(guess, None)})
    assert [stage for stage, _ in seen] == ["target"]
    assert done[right] == truth[:4]
    assert done[wrong] == truth[:3]  # two accepted, then the recovered token
    assert right.stats.stages[SMALL].drafted == 3 and right.stats.stages[SMALL].accepted == 3
    assert wrong.stats.stages[SMALL].accepted == 2


def test_a_round_never_drafts_past_what_its_request_still_wants(models):
    """A round yields at most depth + 1 tokens, so with one token still wanted nobody drafts."""
    stages = [hf_stage(n, m) for n, m in zip(("small", "medium", "target"), models)]
    request = _request(20, [2, 7, 1], stages)
    rounds = Rounds(StagePasses(stages, Verifier("reference"), (), None))
    done = rounds.drive({request: rounds.top(Plan((SMALL, TARGET), (4,), 0.0), request, request.context, 1, None)})
    assert done[request] == greedy(models[TARGET], request.prompt, 1)
    assert request.stats.stages[SMALL].drafted == 0 and request.width == 1
